//! The driver's workqueue: whether a pass is queued or open, which nodes the
//! next pass must look at, and when waiting nodes and pending operations
//! fall due.
//!
//! Triggers queue one pass; triggers while a pass is queued collapse; a
//! trigger while a pass is open guarantees exactly one more pass. Between
//! passes the schedule gathers the nodes touched since the last one, the
//! timers of nodes that wait, and the deadlines of pending operations, so an
//! incremental pass looks only at the nodes that need it.

use std::collections::{BTreeMap, BTreeSet};

use super::error::DriverError;
use crate::deadlines::Deadlines;
use crate::id::{LogicalNodeId, OperationId};
use crate::time::Timestamp;

/// The shortest list of touched nodes that is compacted (sorted, repeats
/// dropped) before it grows further.
const DIRTY_COMPACT_MIN: usize = 1024;

/// An operation whose stored deadline has passed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DueOperation {
    /// The slot.
    pub node: LogicalNodeId,
    /// The operation.
    pub op: OperationId,
    /// Its stored deadline.
    pub deadline: Timestamp,
}

/// Whether a pass is open, and whether another one is asked for.
#[derive(Debug)]
enum PassStatus {
    Idle { queued: bool },
    Open { retrigger: bool },
}

/// Whether a pass is queued or open, which nodes the next pass must look
/// at, and when waiting nodes wake.
#[derive(Debug)]
pub(super) struct Schedule {
    status: PassStatus,
    /// Whether the next pass looks at every slot.
    pub(super) full: bool,
    /// Nodes touched since the last pass, in touch order, possibly more
    /// than once, and possibly removed since: a pass sorts and dedups them
    /// (a push per touch instead of a B-tree insert), and a removed node
    /// has nothing to decide (its slot is undesired: a slot is reaped only
    /// then, and a shape that makes it desired again queues a full pass).
    dirty: Vec<LogicalNodeId>,
    /// The length at which `dirty` is next compacted.
    dirty_compact_at: usize,
    timer_of: BTreeMap<LogicalNodeId, Timestamp>,
    timers: BTreeSet<(Timestamp, LogicalNodeId)>,
    /// The deadlines of pending operations.
    pub(super) deadlines: Deadlines,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            status: PassStatus::Idle { queued: false },
            full: false,
            dirty: Vec::new(),
            dirty_compact_at: 0,
            timer_of: BTreeMap::new(),
            timers: BTreeSet::new(),
            deadlines: Deadlines::default(),
        }
    }
}

impl Schedule {
    /// Whether a pass is queued (or will follow the open one).
    pub(super) fn is_queued(&self) -> bool {
        match self.status {
            PassStatus::Idle { queued } => queued,
            PassStatus::Open { retrigger } => retrigger,
        }
    }

    /// Refuses while a pass is open: passes do not nest, and facts are not
    /// folded meanwhile.
    pub(super) fn ensure_idle(&self) -> Result<(), DriverError> {
        match self.status {
            PassStatus::Idle { .. } => Ok(()),
            PassStatus::Open { .. } => Err(DriverError::PassInProgress),
        }
    }

    /// Whether a pass is open.
    pub(super) fn is_open(&self) -> bool {
        matches!(self.status, PassStatus::Open { .. })
    }

    /// Queues a pass, or one more after the open one.
    pub(super) fn request_pass(&mut self) {
        match &mut self.status {
            PassStatus::Idle { queued } => *queued = true,
            PassStatus::Open { retrigger } => *retrigger = true,
        }
    }

    /// Queues a full pass over every node.
    pub(super) fn trigger(&mut self) {
        self.full = true;
        self.request_pass();
    }

    /// Takes the queued pass off the queue, to run it now.
    pub(super) fn dequeue(&mut self) {
        self.status = PassStatus::Idle { queued: false };
    }

    /// Opens a pass: triggers from now on ask for one more.
    pub(super) fn open_pass(&mut self) {
        self.status = PassStatus::Open { retrigger: false };
    }

    /// Closes the open pass; one more is queued when a trigger came while
    /// it was open.
    pub(super) fn close_pass(&mut self) {
        let retrigger = matches!(self.status, PassStatus::Open { retrigger: true });
        self.status = PassStatus::Idle { queued: retrigger };
    }

    /// Sets when waiting `node` is looked at again (`None`: only when
    /// something touches it).
    pub(super) fn set_timer(&mut self, node: &LogicalNodeId, at: Option<Timestamp>) {
        let old = match at {
            Some(at) => self.timer_of.insert(node.clone(), at),
            None => self.timer_of.remove(node),
        };
        if old == at {
            return;
        }
        if let Some(old) = old {
            self.timers.remove(&(old, node.clone()));
        }
        if let Some(at) = at {
            self.timers.insert((at, node.clone()));
        }
    }

    /// Drops the timer of a node that left the map.
    pub(super) fn forget(&mut self, node: &LogicalNodeId) {
        self.set_timer(node, None);
    }

    /// Drops every timer: a full pass sets each again.
    pub(super) fn clear_timers(&mut self) {
        self.timer_of.clear();
        self.timers.clear();
    }

    /// Moves the nodes whose timer is at or before `now` onto `selected`,
    /// and forgets their timers.
    pub(super) fn take_due_timers(&mut self, now: Timestamp, selected: &mut Vec<LogicalNodeId>) {
        while let Some((at, _)) = self.timers.first() {
            if !now.reached(*at) {
                break;
            }
            if let Some((_, id)) = self.timers.pop_first() {
                self.timer_of.remove(&id);
                selected.push(id);
            }
        }
    }

    /// Marks `node` for the next pass. Repeats are dropped whenever the
    /// list doubled since they last were, so it holds at most about twice
    /// as many ids as distinct nodes were touched.
    pub(super) fn mark_dirty(&mut self, node: &LogicalNodeId) {
        if self.dirty.len() >= self.dirty_compact_at.max(DIRTY_COMPACT_MIN) {
            self.dirty.sort_unstable();
            self.dirty.dedup();
            self.dirty_compact_at = self.dirty.len().saturating_mul(2);
        }
        self.dirty.push(node.clone());
    }

    /// Takes the touched nodes for a pass.
    pub(super) fn take_dirty(&mut self) -> Vec<LogicalNodeId> {
        self.dirty_compact_at = 0;
        std::mem::take(&mut self.dirty)
    }

    /// The earliest timer of a waiting node.
    fn next_timer(&self) -> Option<Timestamp> {
        self.timers.first().map(|(t, _)| *t)
    }

    /// Whether a timer of a waiting node is at or before `now`.
    pub(super) fn timer_due(&self, now: Timestamp) -> bool {
        self.next_timer().is_some_and(|t| now.reached(t))
    }

    /// The earliest stored deadline: a timer of a waiting node or the
    /// deadline of a pending operation.
    pub(super) fn requeue_at(&self) -> Option<Timestamp> {
        let timer = self.next_timer();
        let deadline = self.deadlines.first();
        match (timer, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
