//! Per-node history: the last transitions of each node (design §15).
//!
//! The driver keeps it only when asked to ([`crate::ClusterDriver::set_history_depth`]);
//! the default keeps none, so a driver that nobody inspects pays nothing. An
//! entry is noted whenever a node's attempt, stage, intent or readiness
//! changes, with the driver's `now` and, where there is one, the reason.
//! Each node keeps at most the configured number of entries (oldest dropped
//! first); a reaped node's history goes with it.

use std::collections::VecDeque;

use crate::id::NodeAttemptId;
use crate::state::{Intent, ManagedNode, NodeStage};
use crate::time::Timestamp;

/// One transition of a node.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Transition {
    /// When the driver noted it.
    pub at: Timestamp,
    /// The attempt after the transition.
    pub attempt: NodeAttemptId,
    /// The stage after the transition.
    pub stage: NodeStage,
    /// Whether the node is being torn down.
    pub deleting: bool,
    /// Whether the node is ready.
    pub ready: bool,
    /// Why, when the driver knows (a failure's reason, why a teardown began).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Transition {
    /// The entry describing `node` now.
    pub(crate) fn of(node: &ManagedNode, at: Timestamp, reason: Option<String>) -> Self {
        Transition {
            at,
            attempt: node.attempt,
            stage: node.record.stage,
            deleting: node.intent == Intent::Deleting,
            ready: node.is_ready(),
            reason,
        }
    }

    /// Whether `self` and `other` describe the same condition.
    fn same_condition(&self, other: &Transition) -> bool {
        self.attempt == other.attempt
            && self.stage == other.stage
            && self.deleting == other.deleting
            && self.ready == other.ready
    }
}

/// The bounded history of one node, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeHistory {
    entries: VecDeque<Transition>,
}

impl NodeHistory {
    /// The entries, oldest first.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = &Transition> {
        self.entries.iter()
    }

    /// Notes `entry` unless it describes the condition of the newest entry;
    /// keeps at most `depth` entries. Returns whether it was noted.
    pub(crate) fn note(&mut self, entry: Transition, depth: usize) -> bool {
        if self
            .entries
            .back()
            .is_some_and(|last| last.same_condition(&entry))
        {
            return false;
        }
        while self.entries.len() >= depth.max(1) {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
        true
    }
}
