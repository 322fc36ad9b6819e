//! What the driver notes in each node's history, when history is kept:
//! the node's condition wherever it changes, with a failed node's reason.
//! Transitions and dispatches note their own entries where they happen.

use super::ClusterDriver;
use crate::history::{NodeHistory, Transition};
use crate::id::LogicalNodeId;
use crate::state::{ManagedNode, NodeStage};
use crate::time::Timestamp;

impl ClusterDriver {
    /// Notes `node`'s condition in the history of `id` (when history is on).
    pub(super) fn note_history(&mut self, id: &LogicalNodeId, node: &ManagedNode, now: Timestamp) {
        if self.history_depth == 0 {
            return;
        }
        let entry = history_entry(node, now);
        let depth = self.history_depth;
        self.history
            .entry(id.clone())
            .or_default()
            .note(entry, depth);
    }

    /// Notes the condition of the managed node `id` in its history (when
    /// history is on).
    pub(super) fn note_history_of(&mut self, id: &LogicalNodeId, now: Timestamp) {
        if self.history_depth == 0 {
            return;
        }
        let Some(node) = self.state.nodes.get(id) else {
            return;
        };
        let entry = history_entry(node, now);
        let depth = self.history_depth;
        self.history
            .entry(id.clone())
            .or_default()
            .note(entry, depth);
    }

    /// Keeps the last `depth` transitions of every node from now on (0, the
    /// default, keeps none and forgets what was kept).
    pub fn set_history_depth(&mut self, depth: usize) {
        self.history_depth = depth;
        if depth == 0 {
            self.history.clear();
        }
    }

    /// The kept transitions of `id`, oldest first.
    pub fn history(&self, id: &LogicalNodeId) -> Option<&NodeHistory> {
        self.history.get(id)
    }
}

/// A history entry of `node`'s condition at `now`; a failed node's entry
/// carries the failure's reason.
fn history_entry(node: &ManagedNode, now: Timestamp) -> Transition {
    let reason = (node.record.stage == NodeStage::Failed)
        .then(|| node.record.failure.as_ref().map(|f| f.reason.clone()))
        .flatten();
    Transition::of(node, now, reason)
}
