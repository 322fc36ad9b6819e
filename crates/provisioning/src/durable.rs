//! The durable form of a driver's memory, change sets, and recovery.
//!
//! A host that must survive its own crash asks the driver to track changes
//! ([`crate::ClusterDriver::track_changes`]), takes the changes after every
//! drive ([`crate::ClusterDriver::take_changes`], read borrowed or as an owned
//! [`DriverChanges`]) and commits them to durable storage *before* it submits
//! any operation that drive produced.
//! A change set holds only the nodes that changed since the last one, so a
//! pass costs O(nodes changed), never the whole map.
//!
//! After a crash, [`crate::ClusterDriver::recover`] rebuilds a driver from
//! the last committed [`DurableState`]: the allocator resumes at its mark (an
//! attempt id is never handed out twice), every stored instant is moved onto
//! the new clock, and every operation that was pending becomes ambiguous, so
//! the ladder re-issues it and the provider adopts what it may have made. A
//! bootstrap session that had not handed off streamed to the controller that
//! died, so its start becomes ambiguous as well and is re-issued (adopted).
//!
//! The types here are plain serde values; encoding them and writing them is
//! the host's business. Nothing in this module reads a clock or does I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::id::{Generation, GroupId, LogicalNodeId, NodeAttemptId, OperationSequence, RunId};
use crate::limits::BreakerStatus;
use crate::shape::{ClusterShape, NodeTemplate, ShapeError};
use crate::state::{Intent, NodeRecord, PendingOperation, RetryState};
use crate::time::Timestamp;

/// The version of the durable form this crate writes and reads.
pub const DURABLE_FORMAT: u32 = 1;

/// Everything durable that is not a node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DurableMeta {
    /// [`DURABLE_FORMAT`] of the writer.
    pub format: u32,
    /// The desired shape in force, with its generation.
    pub desired: ClusterShape,
    /// The last generation a pass evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<Generation>,
    /// The allocator's high-water mark: the next attempt id it would hand out.
    pub next_attempt: u64,
    /// The driver's clock when the meta was taken. Recovery moves every stored
    /// instant by the distance between this and the new clock.
    pub written_at: Timestamp,
    /// The groups' breakers that counted a failure since they were last
    /// closed (absent in states written before breakers were durable).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub breakers: BTreeMap<GroupId, BreakerStatus>,
}

/// One node as it is written, without its template.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DurableNode {
    /// The slot.
    pub node: LogicalNodeId,
    /// The current attempt.
    pub attempt: NodeAttemptId,
    /// Active or deleting.
    pub intent: Intent,
    /// The lifecycle facts of the attempt.
    pub record: NodeRecord,
    /// The operation in flight when the state was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<PendingOperation>,
    /// The sequence the attempt's next operation gets.
    pub next_sequence: OperationSequence,
    /// Retry bookkeeping.
    pub retry: RetryState,
}

/// A node with the template of its attempt. Templates are shared: every node
/// created from one group generation points at the same template, so a
/// writer can store each distinct template once.
#[derive(Clone, Debug, PartialEq)]
pub struct DurableEntry {
    /// The node.
    pub node: DurableNode,
    /// The immutable template of its attempt.
    pub template: Arc<NodeTemplate>,
}

/// What changed in the driver since its changes were last taken, owned
/// ([`crate::DriverChangesView::to_owned_changes`] of
/// [`crate::ClusterDriver::take_changes`]): what a host commits to its
/// journal in one transaction, before it submits the operations of the drive.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DriverChanges {
    /// The meta, whenever anything is written: it carries the writer's
    /// clock ([`DurableMeta::written_at`]), which every stored instant is
    /// read against at recovery.
    pub meta: Option<DurableMeta>,
    /// Nodes that were inserted or changed, in slot order.
    pub upserts: Vec<DurableEntry>,
    /// Nodes that left the map (reaped), in slot order.
    pub removed: Vec<LogicalNodeId>,
}

impl DriverChanges {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.meta.is_none() && self.upserts.is_empty() && self.removed.is_empty()
    }
}

/// What changed in a driver since the last change set, when its host asked
/// for changes to be tracked. Only the driver writes it.
#[derive(Debug, Default)]
pub(crate) struct ChangeTracker {
    /// Nodes inserted, changed or removed.
    pub(crate) nodes: BTreeSet<LogicalNodeId>,
    /// Whether the meta changed.
    pub(crate) meta: bool,
    /// The breakers as last written: a change set carries the meta again
    /// when they differ (a handful of groups, compared per change set).
    pub(crate) written_breakers: BTreeMap<GroupId, BreakerStatus>,
}

/// A [`DurableNode`] borrowed from the driver: serializes exactly as the
/// owned form does, so a writer encodes a change without cloning the node.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DurableNodeRef<'a> {
    /// The slot.
    pub node: &'a LogicalNodeId,
    /// The current attempt.
    pub attempt: NodeAttemptId,
    /// Active or deleting.
    pub intent: Intent,
    /// The lifecycle facts of the attempt.
    pub record: &'a NodeRecord,
    /// The operation in flight when the state was taken.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending: Option<&'a PendingOperation>,
    /// The sequence the attempt's next operation gets.
    pub next_sequence: OperationSequence,
    /// Retry bookkeeping.
    pub retry: &'a RetryState,
}

impl DurableNodeRef<'_> {
    /// The owned node.
    pub fn to_node(&self) -> DurableNode {
        DurableNode {
            node: self.node.clone(),
            attempt: self.attempt,
            intent: self.intent,
            record: self.record.clone(),
            pending: self.pending.cloned(),
            next_sequence: self.next_sequence,
            retry: self.retry.clone(),
        }
    }
}

impl DurableNode {
    /// The node, borrowed.
    pub fn as_ref(&self) -> DurableNodeRef<'_> {
        DurableNodeRef {
            node: &self.node,
            attempt: self.attempt,
            intent: self.intent,
            record: &self.record,
            pending: self.pending.as_ref(),
            next_sequence: self.next_sequence,
            retry: &self.retry,
        }
    }
}

/// A [`DurableEntry`] borrowed from the driver.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DurableEntryRef<'a> {
    /// The node.
    pub node: DurableNodeRef<'a>,
    /// The immutable template of its attempt.
    pub template: &'a Arc<NodeTemplate>,
}

impl DurableEntryRef<'_> {
    /// The owned entry.
    pub fn to_entry(&self) -> DurableEntry {
        DurableEntry {
            node: self.node.to_node(),
            template: self.template.clone(),
        }
    }
}

impl DurableEntry {
    /// The entry, borrowed.
    pub fn as_ref(&self) -> DurableEntryRef<'_> {
        DurableEntryRef {
            node: self.node.as_ref(),
            template: &self.template,
        }
    }
}

/// A whole committed state, as recovery reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct DurableState {
    /// The meta.
    pub meta: DurableMeta,
    /// Every node, in any order.
    pub nodes: Vec<DurableEntry>,
}

impl DurableState {
    /// Applies a change set on top of this state, as storage would.
    pub fn apply(&mut self, changes: &DriverChanges) {
        let mut nodes: BTreeMap<LogicalNodeId, DurableEntry> = std::mem::take(&mut self.nodes)
            .into_iter()
            .map(|e| (e.node.node.clone(), e))
            .collect();
        for id in &changes.removed {
            nodes.remove(id);
        }
        for entry in &changes.upserts {
            nodes.insert(entry.node.node.clone(), entry.clone());
        }
        if let Some(meta) = &changes.meta {
            self.meta = meta.clone();
        }
        self.nodes = nodes.into_values().collect();
    }
}

/// Why a durable state could not be recovered. Nothing was built.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum RecoveryError {
    /// The state was written by a newer (or unknown) format.
    #[error("the state has format {found}; this version reads format {supported}")]
    UnsupportedFormat {
        /// The format found.
        found: u32,
        /// The format this crate reads.
        supported: u32,
    },
    /// The stored desired shape does not validate.
    #[error("the stored desired shape is invalid: {0}")]
    InvalidShape(#[from] ShapeError),
    /// The state belongs to another run than the one being recovered.
    #[error("the state belongs to run {found}, not {expected}")]
    RunMismatch {
        /// The run asked for.
        expected: RunId,
        /// The run the state names.
        found: RunId,
    },
    /// Two stored nodes claim one slot.
    #[error("node {0} is stored twice")]
    DuplicateNode(LogicalNodeId),
    /// Two stored nodes share one attempt id.
    #[error("attempt {0} is stored for two nodes")]
    DuplicateAttempt(NodeAttemptId),
    /// A stored node is of another run.
    #[error("node {node} belongs to run {found}")]
    ForeignNode {
        /// The node.
        node: LogicalNodeId,
        /// Its run.
        found: RunId,
    },
    /// A deadline did not fit the clock while folding a pending operation.
    #[error(transparent)]
    Clock(#[from] crate::time::ClockSaturated),
}

/// What recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Nodes recovered.
    pub nodes: usize,
    /// Pending operations that became ambiguous.
    pub pending_made_ambiguous: usize,
    /// Bootstrap sessions that had not handed off: their start became
    /// ambiguous, to be re-issued (and adopted by the provider).
    pub sessions_restarted: usize,
    /// Nodes the journal held as ready, now rejoining: not ready until their
    /// agent re-joins the new controller.
    pub rejoining: usize,
    /// Whether the stored allocator mark was below a stored attempt and was
    /// raised above it (a state no correct writer produces; reported, never
    /// trusted).
    pub allocator_raised: bool,
    /// The generation recovered.
    pub generation: Generation,
}

/// A signed move of the clock, from the writer's clock to the recoverer's.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Shift {
    Later(Duration),
    Earlier(Duration),
}

impl Shift {
    /// Whether the clock does not move.
    pub(crate) fn is_zero(self) -> bool {
        matches!(self, Shift::Later(by) | Shift::Earlier(by) if by.is_zero())
    }

    pub(crate) fn between(written_at: Timestamp, now: Timestamp) -> Shift {
        if now.reached(written_at) {
            Shift::Later(now.saturating_duration_since(written_at))
        } else {
            Shift::Earlier(written_at.saturating_duration_since(now))
        }
    }

    pub(crate) fn apply(self, at: Timestamp) -> Timestamp {
        match self {
            Shift::Later(by) => at.saturating_add(by),
            Shift::Earlier(by) => {
                let by = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
                Timestamp::from_millis(at.as_millis().saturating_sub(by))
            }
        }
    }

    fn apply_opt(self, at: &mut Option<Timestamp>) {
        if let Some(t) = at {
            *t = self.apply(*t);
        }
    }

    /// Moves the instants of a breaker.
    pub(crate) fn breaker(self, breaker: &mut BreakerStatus) {
        self.apply_opt(&mut breaker.opened_at);
        self.apply_opt(&mut breaker.recovered_at);
    }

    /// Moves every stored instant of a node.
    pub(crate) fn node(self, node: &mut DurableNode) {
        let record = &mut node.record;
        if let Some(lease) = &mut record.lease {
            lease.observed_at = self.apply(lease.observed_at);
        }
        if let Some(endpoint) = &mut record.endpoint {
            endpoint.observed_at = self.apply(endpoint.observed_at);
        }
        if let Some(swarm) = &mut record.swarm {
            swarm.joined_at = self.apply(swarm.joined_at);
        }
        if let Some(failure) = &mut record.failure {
            failure.at = self.apply(failure.at);
        }
        self.apply_opt(&mut record.handed_off_at);
        self.apply_opt(&mut record.destroyed_at);
        self.apply_opt(&mut record.rejoin_by);
        if let Some(pending) = &mut node.pending {
            pending.dispatched_at = self.apply(pending.dispatched_at);
            pending.deadline = self.apply(pending.deadline);
        }
        self.apply_opt(&mut node.retry.next_effect_at);
        self.apply_opt(&mut node.retry.restart_at);
    }
}
