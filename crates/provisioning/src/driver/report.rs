//! What the driver reports: a begun pass's plan, what a pass and a drive
//! did, and the counters kept since the driver was made.

use crate::decide::NodeDecision;
use crate::id::LogicalNodeId;
use crate::time::Timestamp;

/// A pass that was begun and not yet finished.
#[derive(Debug)]
#[must_use = "a begun pass must be finished"]
pub struct PassPlan {
    pub(super) now: Timestamp,
    pub(super) full: bool,
    pub(super) evaluated: usize,
    pub(super) decisions: Vec<(LogicalNodeId, NodeDecision)>,
}

impl PassPlan {
    /// The instant the pass evaluates.
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// The decisions, in slot order. An incremental pass lists every node it
    /// evaluated; a full pass lists the nodes that act or wait on a timer.
    pub fn decisions(&self) -> &[(LogicalNodeId, NodeDecision)] {
        &self.decisions
    }

    /// Whether the pass evaluates every slot.
    pub fn is_full(&self) -> bool {
        self.full
    }

    /// How many nodes the decider looked at.
    pub fn evaluated(&self) -> usize {
        self.evaluated
    }
}

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Nodes the decider looked at.
    pub evaluated: usize,
    /// Driver transitions applied.
    pub transitions: usize,
    /// Operations recorded pending and accepted by the sink.
    pub dispatched: usize,
    /// Operations recorded pending that the sink refused; each was folded
    /// at once as a definite failure. Not counted in `dispatched`.
    pub refused: usize,
}

/// What [`ClusterDriver::drive_until_blocked`](super::ClusterDriver::drive_until_blocked) did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriveReport {
    /// Passes run.
    pub passes: u32,
    /// Operations the sink accepted, over all passes.
    pub dispatched: usize,
    /// Operations the sink refused, over all passes (folded as failures).
    pub refused: usize,
    /// Whether a pass is still queued because the pass budget ran out.
    pub budget_exhausted: bool,
}

/// Counters for operators and test kits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverCounters {
    /// Passes run.
    pub passes: u64,
    /// Node evaluations over all passes.
    pub evaluations: u64,
    /// Operations the sink accepted.
    pub dispatched: u64,
    /// Operations the sink refused.
    pub refused: u64,
    /// Results, timeouts and observations folded.
    pub folded: u64,
    /// Results, timeouts and observations rejected.
    pub rejected: u64,
    /// Timeouts folded as ambiguous failures.
    pub timeouts: u64,
}
