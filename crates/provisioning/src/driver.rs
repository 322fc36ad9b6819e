//! The driver: sole writer of [`ClusterState`].
//!
//! The driver behaves like a single-key workqueue. Triggers queue one pass;
//! triggers while a pass is queued collapse; a trigger while a pass is open
//! guarantees exactly one more pass. A pass asks the decider about the nodes
//! that need it — nodes touched since the last pass and nodes whose stored
//! deadline fell due, or every node when a full pass was requested — applies
//! driver transitions, and records each operation pending *before* handing it
//! to an [`OperationSink`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::deadlines::Deadlines;
use crate::decide::{
    NodeAction, NodeDecision, Rule, Slot, SlotDesire, Wake, decide_slot, reconcile_node,
    walk_slots, walk_slots_skipping,
};
use crate::durable::{
    ChangeSet, ChangeView, DURABLE_FORMAT, DurableEntry, DurableEntryRef, DurableMeta,
    DurableNodeRef, DurableState, RecoveryError, RecoveryReport, Shift,
};
use crate::effect::{EffectError, EffectKind, EffectRequest, ExecutorResult, Operation};
use crate::history::{NodeHistory, Transition};
use crate::id::{AttemptAllocator, GroupId};
use crate::id::{Generation, IdError, LogicalNodeId, NodeAttemptId, OperationId, RunId};
use crate::limits::{BreakerStatus, LimitCounters, Limits};
use crate::observe::{
    BootstrapRejection, FoldContext, FoldableCondition, Observation, fold_bootstrap, fold_loss,
    fold_operation, observation_fold_may_fail, operation_fold_may_fail,
};
use crate::policy::RetryPolicy;
use crate::shape::{ClusterShape, DesiredState, LogicalNodeSpec, ShapeError};
use crate::state::{ClusterState, Intent, ManagedNode, NodeStage, PendingOperation, RetryState};
use crate::steady::SteadySlots;
use crate::time::{ClockSaturated, Timestamp};

/// The most passes one [`ClusterDriver::drive_until_blocked`] call runs. A
/// node needs at most four consecutive passes without outside input
/// (mark destroyed, restart, dispatch); more means something keeps re-queueing.
pub const MAX_PASSES_PER_DRIVE: u32 = 16;

/// Inserting at least this many nodes in one pass (and at least an eighth of
/// the map) rebuilds the node map in one merge instead of node by node.
const BULK_MERGE_MIN: usize = 64;

/// The shortest list of touched nodes that is compacted (sorted, repeats
/// dropped) before it grows further.
const DIRTY_COMPACT_MIN: usize = 1024;

/// Where the driver hands recorded operations.
///
/// # Assumptions
/// `submit` must not run the effect inline and feed its result back into the
/// driver; results come back later through
/// [`ClusterDriver::apply_executor_result`].
pub trait OperationSink {
    /// Submits an operation the driver recorded as pending.
    ///
    /// # Errors
    /// A [`SubmitError`] when the operation was not accepted; the driver folds
    /// it as a definite failure of the operation.
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError>;

    /// The attempt finished cleanup; its bookkeeping may be released.
    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        let _ = attempt;
    }
}

/// Why a sink refused an operation.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SubmitError {
    /// The id was used before with a different input.
    #[error("operation {0} was already submitted with a different input")]
    ConflictingInput(OperationId),
    /// A later operation of the same attempt was already submitted.
    #[error("operation {0} is older than an operation already submitted for its attempt")]
    Stale(OperationId),
    /// The sink no longer accepts work.
    #[error("the executor is shut down")]
    Closed,
    /// A sink of the caller's refused the operation for its own reason (a
    /// quota, a full queue, a journal that could not be written). The reason
    /// reaches the node's `last_error`.
    #[error("{0}")]
    Refused(String),
}

/// Why an observation or result was not folded. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Rejection {
    /// No node is managed for the slot.
    #[error("no node {0} is managed")]
    UnknownNode(LogicalNodeId),
    /// The fact belongs to another attempt than the node's current one.
    #[error("node {node}: fact of attempt {got} but the current attempt is {current}")]
    StaleAttempt {
        /// The slot.
        node: LogicalNodeId,
        /// The node's current attempt.
        current: NodeAttemptId,
        /// The attempt named by the fact.
        got: NodeAttemptId,
    },
    /// The operation is not the node's pending operation (late or duplicate).
    #[error("node {node}: operation {op} is not pending")]
    NotPending {
        /// The slot.
        node: LogicalNodeId,
        /// The operation.
        op: OperationId,
    },
    /// A timeout was reported before the stored deadline.
    #[error("operation {op} is not due before {deadline}")]
    NotYetDue {
        /// The operation.
        op: OperationId,
        /// Its stored deadline.
        deadline: Timestamp,
    },
    /// The node is destroyed; nothing is folded into it.
    #[error("node {0} is destroyed")]
    Destroyed(LogicalNodeId),
    /// A bootstrap event without a session to fold it into.
    #[error("node {node}: {reason}")]
    Bootstrap {
        /// The slot.
        node: LogicalNodeId,
        /// Why.
        reason: BootstrapRejection,
    },
}

/// A problem with one node during a pass. The node was left unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum NodeError {
    /// Attempt or sequence counters are exhausted.
    #[error(transparent)]
    Id(#[from] IdError),
    /// A deadline did not fit the clock.
    #[error(transparent)]
    Clock(#[from] ClockSaturated),
    /// The decider asked for an effect whose input is not known. This is a
    /// bug in the decider and is reported instead of dispatching.
    #[error("cannot build {kind}: {missing} is not known")]
    MissingFact {
        /// The effect.
        kind: EffectKind,
        /// The missing fact.
        missing: &'static str,
    },
}

/// Errors of the driver. Whenever one is returned, nothing changed, except
/// for [`DriverError::NodeErrors`] (see there).
#[derive(Clone, Debug, PartialEq, Error)]
pub enum DriverError {
    /// A desired shape named another run than the driver's.
    #[error("the run cannot change: driver manages {expected}, shape names {got}")]
    RunChanged {
        /// The driver's run.
        expected: RunId,
        /// The run of the rejected shape.
        got: RunId,
    },
    /// A desired shape had a lower generation than the current one.
    #[error("generation {got} is lower than the current generation {current}")]
    GenerationRegressed {
        /// The current generation.
        current: Generation,
        /// The rejected generation.
        got: Generation,
    },
    /// The content changed but the generation did not.
    #[error("the shape changed without a generation bump (generation {generation})")]
    ContentChangedWithoutGenerationBump {
        /// The generation both shapes carry.
        generation: Generation,
    },
    /// The shape failed validation.
    #[error("invalid shape: {0}")]
    InvalidShape(#[from] ShapeError),
    /// A pass is open; passes do not nest and facts are not folded meanwhile.
    #[error("a reconcile pass is already in progress")]
    PassInProgress,
    /// `finish_pass` without `begin_pass`.
    #[error("no reconcile pass is open")]
    NoPassOpen,
    /// The observation or result was rejected.
    #[error("rejected: {0}")]
    Rejected(#[from] Rejection),
    /// A deadline computed while folding did not fit the clock.
    #[error(transparent)]
    Clock(#[from] ClockSaturated),
    /// Some nodes could not take their step; every other node's step was applied.
    #[error("{} node(s) could not take their step; first: {}: {}", .0.len(), .0[0].0, .0[0].1)]
    NodeErrors(Vec<(LogicalNodeId, NodeError)>),
}

/// The outcome of [`ClusterDriver::update_desired`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DesiredUpdate {
    /// The same generation with identical content: nothing to do.
    Unchanged,
    /// A new generation was accepted and a pass queued.
    Accepted,
}

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

/// A pass that was begun and not yet finished.
#[derive(Debug)]
#[must_use = "a begun pass must be finished"]
pub struct PassPlan {
    now: Timestamp,
    full: bool,
    evaluated: usize,
    decisions: Vec<(LogicalNodeId, NodeDecision)>,
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

/// What [`ClusterDriver::drive_until_blocked`] did.
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

#[derive(Debug)]
enum PassStatus {
    Idle { queued: bool },
    Open { retrigger: bool },
}

/// Which nodes the next pass must look at, and when waiting nodes wake.
#[derive(Debug, Default)]
struct Schedule {
    full: bool,
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
    deadlines: Deadlines,
}

impl Schedule {
    fn set_timer(&mut self, node: &LogicalNodeId, at: Option<Timestamp>) {
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

    fn forget(&mut self, node: &LogicalNodeId) {
        self.set_timer(node, None);
    }

    /// Marks `node` for the next pass. Repeats are dropped whenever the
    /// list doubled since they last were, so it holds at most about twice
    /// as many ids as distinct nodes were touched.
    fn mark_dirty(&mut self, node: &LogicalNodeId) {
        if self.dirty.len() >= self.dirty_compact_at.max(DIRTY_COMPACT_MIN) {
            self.dirty.sort_unstable();
            self.dirty.dedup();
            self.dirty_compact_at = self.dirty.len().saturating_mul(2);
        }
        self.dirty.push(node.clone());
    }

    /// Takes the touched nodes for a pass.
    fn take_dirty(&mut self) -> Vec<LogicalNodeId> {
        self.dirty_compact_at = 0;
        std::mem::take(&mut self.dirty)
    }

    fn next_timer(&self) -> Option<Timestamp> {
        self.timers.first().map(|(t, _)| *t)
    }
}

/// What changed since the last change set, when the host asked for it.
#[derive(Debug, Default)]
struct ChangeTracker {
    nodes: BTreeSet<LogicalNodeId>,
    meta: bool,
    /// The breakers as last written: a change set carries the meta again
    /// when they differ (a handful of groups, compared per change set).
    written_breakers: BTreeMap<GroupId, BreakerStatus>,
}

/// What the limits keep between passes.
#[derive(Debug, Default)]
struct LimitState {
    /// `CreateLease` operations pending, per provider kind.
    creates_in_flight: BTreeMap<String, u32>,
    /// Nodes whose create waits for a launch slot, per provider, in slot order.
    held_by_cap: BTreeMap<String, BTreeSet<LogicalNodeId>>,
    /// Drifted ready nodes whose replacement waits for the rollout budget.
    held_by_budget: BTreeMap<GroupId, BTreeSet<LogicalNodeId>>,
    /// Nodes whose insert or restart an open breaker holds back, per group:
    /// their wake depends on the breaker, so a change of it looks at them
    /// again.
    held_by_breaker: BTreeMap<GroupId, BTreeSet<LogicalNodeId>>,
    breakers: BTreeMap<GroupId, BreakerStatus>,
    counters: LimitCounters,
}

/// Pass-local bookkeeping of the limits: each group's unavailable count,
/// computed the first time the pass needs it, and the cleanup re-issues of
/// creates this pass has still to dispatch, per provider.
#[derive(Default)]
struct PassBudget {
    unavailable: BTreeMap<GroupId, u32>,
    /// Cleanup creates are never held back, but they take launch slots: a
    /// launch earlier in slot order must leave room for them, or the pass
    /// would end with more creates in flight than the cap allows.
    cleanup_creates: BTreeMap<String, u32>,
}

/// The sole writer of [`ClusterState`]: folds observations, runs passes and
/// records operations pending before dispatch.
#[derive(Debug)]
pub struct ClusterDriver {
    desired: DesiredState,
    state: ClusterState,
    policy: RetryPolicy,
    schedule: Schedule,
    status: PassStatus,
    counters: DriverCounters,
    /// Nodes inserted by the open pass, in slot order, merged into the state
    /// when it ends.
    inserted: Vec<(LogicalNodeId, Box<ManagedNode>)>,
    /// `Some` once [`ClusterDriver::track_changes`] was called.
    changes: Option<ChangeTracker>,
    limits: Limits,
    limit_state: LimitState,
    /// How many transitions each node keeps; 0 keeps no history.
    history_depth: usize,
    history: BTreeMap<LogicalNodeId, NodeHistory>,
    /// The slots a pass found in the ready steady state, unchanged since:
    /// a full pass counts them without reading their nodes.
    steady: SteadySlots,
}

impl ClusterDriver {
    /// A driver for `run_id` with an empty desired shape at generation 0.
    ///
    /// # Errors
    /// [`DriverError::InvalidShape`] when the run name is invalid.
    pub fn new(run_id: RunId, policy: RetryPolicy) -> Result<Self, DriverError> {
        let desired = ClusterShape::empty(run_id, Generation::default()).validate()?;
        Ok(ClusterDriver::with_state(
            desired,
            ClusterState::default(),
            policy,
        ))
    }

    /// A driver that starts from an existing state (for example one a test
    /// built by hand). A full pass is queued.
    pub fn with_state(desired: DesiredState, state: ClusterState, policy: RetryPolicy) -> Self {
        let mut driver = ClusterDriver {
            desired,
            state,
            policy,
            schedule: Schedule::default(),
            status: PassStatus::Idle { queued: false },
            counters: DriverCounters::default(),
            inserted: Vec::new(),
            changes: None,
            limits: Limits::default(),
            limit_state: LimitState::default(),
            history_depth: 0,
            history: BTreeMap::new(),
            steady: SteadySlots::default(),
        };
        for node in driver.state.nodes.values() {
            if node
                .pending
                .as_ref()
                .is_some_and(|p| p.kind == EffectKind::CreateLease)
            {
                *driver
                    .limit_state
                    .creates_in_flight
                    .entry(node.spec.template().provider.clone())
                    .or_default() += 1;
            }
        }
        for (id, node) in &driver.state.nodes {
            if let Some(pending) = &node.pending {
                driver
                    .schedule
                    .deadlines
                    .insert(pending.deadline, id, &driver.state.nodes);
            }
        }
        driver.trigger();
        driver
    }

    /// The observed state.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The current desired state.
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        self.desired.run_id()
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Counters since the driver was made.
    pub fn counters(&self) -> &DriverCounters {
        &self.counters
    }

    /// Whether a pass is queued (or will follow the open one).
    pub fn is_queued(&self) -> bool {
        match self.status {
            PassStatus::Idle { queued } => queued,
            PassStatus::Open { retrigger } => retrigger,
        }
    }

    /// Replaces the desired shape, enforcing the revision contract.
    ///
    /// # Errors
    /// [`DriverError::RunChanged`], [`DriverError::GenerationRegressed`],
    /// [`DriverError::ContentChangedWithoutGenerationBump`],
    /// [`DriverError::InvalidShape`] or [`DriverError::PassInProgress`]; in
    /// every case nothing changes.
    pub fn update_desired(&mut self, shape: ClusterShape) -> Result<DesiredUpdate, DriverError> {
        self.ensure_idle()?;
        let current = self.desired.shape();
        if shape.run_id != current.run_id {
            return Err(DriverError::RunChanged {
                expected: current.run_id.clone(),
                got: shape.run_id,
            });
        }
        if shape.generation < current.generation {
            return Err(DriverError::GenerationRegressed {
                current: current.generation,
                got: shape.generation,
            });
        }
        if shape.generation == current.generation {
            return if shape.groups == current.groups {
                Ok(DesiredUpdate::Unchanged)
            } else {
                Err(DriverError::ContentChangedWithoutGenerationBump {
                    generation: shape.generation,
                })
            };
        }
        let mut desired = shape.validate()?;
        desired.share_templates_with(&self.desired);
        let changed_groups = self.desired.changed_groups(&desired);
        let changed = !changed_groups.is_empty();
        for group in &changed_groups {
            // A shape change of a group closes its breaker at once.
            self.limit_state.breakers.remove(group);
        }
        self.desired = desired;
        // What a slot is desired to be may have changed: every node is
        // decided afresh by the next full pass.
        self.steady.clear();
        self.meta_changed();
        if changed {
            self.schedule.full = true;
        }
        // The new generation must be observed even when no group changed.
        self.request_pass();
        Ok(DesiredUpdate::Accepted)
    }

    /// Queues a full pass over every node (the periodic safety net, or a
    /// forced pass).
    pub fn trigger(&mut self) {
        self.schedule.full = true;
        self.request_pass();
    }

    /// Queues a pass if a stored retry, probe or restart deadline is due.
    /// Returns whether one was due.
    pub fn trigger_if_due(&mut self, now: Timestamp) -> bool {
        let due = self.schedule.next_timer().is_some_and(|t| now.reached(t));
        if due {
            self.request_pass();
        }
        due
    }

    /// The earliest stored deadline: a timer of a waiting node or the
    /// deadline of a pending operation. The host arms one timer at it.
    ///
    /// While an operation's deadline has passed and its timeout is not
    /// folded yet, this stays in the past.
    pub fn requeue_at(&self) -> Option<Timestamp> {
        let timer = self.schedule.next_timer();
        let deadline = self.schedule.deadlines.first();
        match (timer, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Operations whose stored deadline is at or before `now`.
    pub fn pending_operations_due(&self, now: Timestamp) -> Vec<DueOperation> {
        self.schedule
            .deadlines
            .due(now, &self.state.nodes)
            .map(|(id, pending)| DueOperation {
                node: id.clone(),
                op: pending.id,
                deadline: pending.deadline,
            })
            .collect()
    }

    /// Whether the cluster is converged for the current generation: every
    /// desired slot holds exactly the desired spec, ready, active and with no
    /// pending operation, and no other node remains.
    pub fn is_converged(&self) -> bool {
        if self.state.observed_generation != Some(self.desired.generation()) {
            return false;
        }
        let desired_count = self.desired.node_count();
        if u64::try_from(self.state.nodes.len()).ok() != Some(desired_count) {
            return false;
        }
        let mut converged = true;
        walk_slots(&self.state, &self.desired, |slot| {
            converged = converged
                && match slot {
                    Slot::Managed { node, desire, .. } => {
                        desire.is_desired()
                            && !desire.drifted(node)
                            && node.is_ready()
                            && node.pending.is_none()
                    }
                    Slot::Missing { .. } => false,
                };
        });
        converged
    }

    fn ensure_idle(&self) -> Result<(), DriverError> {
        match self.status {
            PassStatus::Idle { .. } => Ok(()),
            PassStatus::Open { .. } => Err(DriverError::PassInProgress),
        }
    }

    fn request_pass(&mut self) {
        match &mut self.status {
            PassStatus::Idle { queued } => *queued = true,
            PassStatus::Open { retrigger } => *retrigger = true,
        }
    }

    fn touch(&mut self, node: &LogicalNodeId) {
        self.schedule.mark_dirty(node);
        self.node_changed(node);
        self.request_pass();
    }

    /// Every change of a node (its insert, every fold, transition and
    /// dispatch, its removal) passes through here.
    fn node_changed(&mut self, node: &LogicalNodeId) {
        self.steady.remove(node);
        if let Some(changes) = &mut self.changes {
            if !changes.nodes.contains(node) {
                changes.nodes.insert(node.clone());
            }
        }
    }

    fn meta_changed(&mut self) {
        if let Some(changes) = &mut self.changes {
            changes.meta = true;
        }
    }

    /// Looks up the node a fact is about and checks the attempt.
    fn node_for_fact(
        &self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
    ) -> Result<&ManagedNode, Rejection> {
        let managed = self
            .state
            .nodes
            .get(node)
            .ok_or_else(|| Rejection::UnknownNode(node.clone()))?;
        if managed.attempt != attempt {
            return Err(Rejection::StaleAttempt {
                node: node.clone(),
                current: managed.attempt,
                got: attempt,
            });
        }
        if managed.record.stage == NodeStage::Destroyed {
            return Err(Rejection::Destroyed(node.clone()));
        }
        Ok(managed)
    }

    fn check_pending(
        &self,
        node: &LogicalNodeId,
        op: OperationId,
    ) -> Result<&PendingOperation, Rejection> {
        let managed = self.node_for_fact(node, op.attempt())?;
        managed
            .pending
            .as_ref()
            .filter(|p| p.id == op)
            .ok_or_else(|| Rejection::NotPending {
                node: node.clone(),
                op,
            })
    }

    fn count<T>(&mut self, result: Result<T, DriverError>) -> Result<T, DriverError> {
        match &result {
            Ok(_) => self.counters.folded += 1,
            Err(DriverError::Rejected(_)) => self.counters.rejected += 1,
            Err(_) => {}
        }
        result
    }

    /// Folds the result of an operation.
    ///
    /// # Errors
    /// [`DriverError::Rejected`] when the operation is not the node's pending
    /// operation (late, duplicate, or of a superseded attempt);
    /// [`DriverError::Clock`]; [`DriverError::PassInProgress`]. Nothing
    /// changes on error.
    pub fn apply_executor_result(
        &mut self,
        result: &ExecutorResult,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        let outcome = self.fold_result(&result.node, result.op, result.outcome.as_ref(), now);
        self.count(outcome)
    }

    /// Folds the timeout of a pending operation as an ambiguous failure.
    ///
    /// # Errors
    /// [`Rejection::NotYetDue`] before the stored deadline;
    /// [`Rejection::NotPending`] when the operation is no longer pending (the
    /// same timeout reported twice changes nothing); the errors of
    /// [`ClusterDriver::apply_executor_result`].
    pub fn operation_timed_out(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        let outcome = self.fold_timeout(node, op, now);
        if outcome.is_ok() {
            self.counters.timeouts += 1;
        }
        self.count(outcome)
    }

    fn fold_timeout(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        self.ensure_idle()?;
        let deadline = self.check_pending(node, op)?.deadline;
        if !now.reached(deadline) {
            return Err(Rejection::NotYetDue { op, deadline }.into());
        }
        let error = EffectError::timed_out();
        self.fold_result(node, op, Err(&error), now)
    }

    fn fold_result(
        &mut self,
        node_id: &LogicalNodeId,
        op: OperationId,
        outcome: Result<&crate::effect::EffectOutput, &EffectError>,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        self.ensure_idle()?;
        let pending = self.check_pending(node_id, op)?.clone();
        self.fold_pending(node_id, &pending, outcome, now)?;
        Ok(())
    }

    /// Folds the outcome of the node's pending operation. A fold that may
    /// fail works on a copy of the node that replaces it only on success, so
    /// an error leaves the node untouched; any other is applied in place.
    fn fold_pending(
        &mut self,
        node_id: &LogicalNodeId,
        pending: &PendingOperation,
        outcome: Result<&crate::effect::EffectOutput, &EffectError>,
        now: Timestamp,
    ) -> Result<(), ClockSaturated> {
        self.fold_pending_as(node_id, pending, outcome, now, true)
    }

    /// [`ClusterDriver::fold_pending`]; `sent`: whether the operation
    /// reached the provider (not for one the sink refused).
    fn fold_pending_as(
        &mut self,
        node_id: &LogicalNodeId,
        pending: &PendingOperation,
        outcome: Result<&crate::effect::EffectOutput, &EffectError>,
        now: Timestamp,
        sent: bool,
    ) -> Result<(), ClockSaturated> {
        let Some(node) = self.state.nodes.get_mut(node_id) else {
            return Ok(());
        };
        let ctx = FoldContext {
            policy: &self.policy,
            now,
            spec_is_desired: self.desired.is_desired_spec(&node.spec),
            sent,
        };
        let before = (node.record.stage == NodeStage::Failed, node.is_ready());
        if operation_fold_may_fail(pending.kind, outcome) {
            let mut next = node.clone();
            fold_operation(&mut next, pending.id, pending.kind, outcome, &ctx)?;
            *node = next;
        } else {
            let folded = fold_operation(node, pending.id, pending.kind, outcome, &ctx);
            debug_assert!(folded.is_ok(), "a fold that cannot fail failed");
            folded?;
        }
        let after = (node.record.stage == NodeStage::Failed, node.is_ready());
        let created =
            (pending.kind == EffectKind::CreateLease).then(|| node.spec.shared_template().clone());
        self.schedule.deadlines.remove(pending.deadline, node_id);
        if let Some(template) = created {
            self.create_finished(&template.provider);
        }
        self.limit_events(node_id, before, after, now);
        self.note_history_of(node_id, now);
        self.touch(node_id);
        Ok(())
    }

    /// A create of `provider` is no longer pending: its launch slot goes to
    /// the first node that waits for one.
    fn create_finished(&mut self, provider: &str) {
        let limits = &mut self.limit_state;
        if let Some(n) = limits.creates_in_flight.get_mut(provider) {
            *n = n.saturating_sub(1);
        }
        let next = limits
            .held_by_cap
            .get_mut(provider)
            .and_then(BTreeSet::pop_first);
        if let Some(id) = next {
            self.touch(&id);
        }
    }

    /// What a fold means for the limits: a failed attempt counts towards its
    /// group's breaker; a node that became ready closes it and frees rollout
    /// budget for the drifted nodes that wait.
    ///
    /// `before` and `after` are whether the node was failed and ready
    /// before and after the fold (passed in, so the common fold that changes
    /// neither looks the node up only once).
    fn limit_events(
        &mut self,
        id: &LogicalNodeId,
        (was_failed, was_ready): (bool, bool),
        (is_failed, is_ready): (bool, bool),
        now: Timestamp,
    ) {
        let failed = !was_failed && is_failed;
        let became_ready = !was_ready && is_ready;
        if !failed && !became_ready {
            return;
        }
        let Some(after) = self.state.nodes.get(id) else {
            return;
        };
        let last_error = after.retry.last_error.clone();
        let group = id.group();
        // The breaker changes (it counts a failure, opens again after a failed
        // probe, or closes): the nodes it holds back wake by it, so they are
        // looked at again, or a later pass would move their timers (G19).
        let held = self.limit_state.held_by_breaker.remove(group);
        for held in held.into_iter().flatten() {
            self.touch(&held);
        }
        if failed {
            let policy = self.limits.breakers.get(group).copied();
            let breaker = self.limit_state.breakers.entry(group.clone()).or_default();
            if policy.is_some_and(|p| breaker.recovered(&p, now)) {
                // A node stayed ready for the stable window since the last
                // failure: the group was healthy, this failure starts anew.
                *breaker = BreakerStatus::default();
            }
            breaker.recovered_at = None;
            breaker.consecutive_failures = breaker.consecutive_failures.saturating_add(1);
            breaker.last_error = last_error;
            let trips = policy.is_some_and(|p| breaker.consecutive_failures >= p.failures);
            if trips && (!breaker.is_open() || breaker.probing) {
                breaker.opened_at = Some(now);
                breaker.probing = false;
                self.limit_state.counters.breakers_opened += 1;
            }
        }
        if became_ready {
            let stable_after = self
                .limits
                .breakers
                .get(group)
                .map_or(Duration::ZERO, |p| p.stable_after);
            if stable_after.is_zero() {
                self.limit_state.breakers.remove(group);
            } else if let Some(breaker) = self.limit_state.breakers.get_mut(group) {
                breaker.recovered_at.get_or_insert(now);
            }
            let allowed = self.budget_allowance(group);
            for _ in 0..allowed {
                let next = self
                    .limit_state
                    .held_by_budget
                    .get_mut(group)
                    .and_then(BTreeSet::pop_first);
                match next {
                    Some(held) => self.touch(&held),
                    None => break,
                }
            }
        }
    }

    fn budget_allowance(&self, group: &GroupId) -> u32 {
        let desired = self.desired.groups().get(group).map_or(0, |g| g.count());
        self.limits
            .max_unavailable
            .get(group)
            .map_or(0, |budget| budget.of(desired))
    }

    /// Desired slots of `group` without a ready node (of any spec: a node
    /// that still runs the old spec serves until it is replaced).
    fn unavailable(&self, group: &GroupId) -> u32 {
        let Some(desired) = self.desired.groups().get(group) else {
            return 0;
        };
        let range = LogicalNodeId::new(group.clone(), 0)
            ..=LogicalNodeId::new(group.clone(), desired.count().saturating_sub(1));
        let ready = if desired.count() == 0 {
            0
        } else {
            self.state
                .nodes
                .range(range)
                .filter(|(_, n)| n.is_ready())
                .count()
        };
        desired
            .count()
            .saturating_sub(u32::try_from(ready).unwrap_or(u32::MAX))
    }

    /// Applies the limits to one decision of a pass: `None` lets it through,
    /// `Some(wake)` holds the node back (it waits, until `wake` if given).
    fn gate(
        &mut self,
        id: &LogicalNodeId,
        decision: &NodeDecision,
        now: Timestamp,
        budget: &mut PassBudget,
    ) -> Option<Option<Timestamp>> {
        let group = id.group();
        match decision.action {
            // The re-issue of an ambiguous create on a node being torn down
            // is cleanup, never held back; it leaves the pass's reservation.
            NodeAction::Dispatch(EffectKind::CreateLease)
                if decision.rule != Rule::CreateLease && !budget.cleanup_creates.is_empty() =>
            {
                let node = self.state.nodes.get(id)?;
                let provider = &node.spec.template().provider;
                if let Some(n) = budget.cleanup_creates.get_mut(provider) {
                    *n = n.saturating_sub(1);
                }
                None
            }
            // Only a first create of an active node waits for a launch slot,
            // and only while the creates in flight, with the cleanup creates
            // the pass is still to dispatch, fill the cap.
            NodeAction::Dispatch(EffectKind::CreateLease)
                if decision.rule == Rule::CreateLease
                    && !self.limits.max_concurrent_creates.is_empty() =>
            {
                let node = self.state.nodes.get(id)?;
                let provider = &node.spec.template().provider;
                let cap = *self.limits.max_concurrent_creates.get(provider)?;
                let in_flight = self
                    .limit_state
                    .creates_in_flight
                    .get(provider)
                    .copied()
                    .unwrap_or(0)
                    .saturating_add(budget.cleanup_creates.get(provider).copied().unwrap_or(0));
                if in_flight < cap {
                    return None;
                }
                self.limit_state
                    .held_by_cap
                    .entry(provider.clone())
                    .or_default()
                    .insert(id.clone());
                self.limit_state.counters.held_by_cap += 1;
                Some(None)
            }
            NodeAction::BeginDelete if self.limits.max_unavailable.contains_key(group) => {
                let node = self.state.nodes.get(id)?;
                let desired = self.desired.groups().get(group)?;
                let drifted_only = node.is_ready()
                    && id.index() < desired.count()
                    && !Arc::ptr_eq(node.spec.shared_template(), desired.template())
                    && *node.spec.template() != **desired.template();
                if !drifted_only {
                    return None;
                }
                let allowed = self.budget_allowance(group);
                let unavailable = match budget.unavailable.get(group) {
                    Some(n) => *n,
                    None => self.unavailable(group),
                };
                if unavailable < allowed {
                    budget.unavailable.insert(group.clone(), unavailable + 1);
                    return None;
                }
                budget.unavailable.insert(group.clone(), unavailable);
                self.limit_state
                    .held_by_budget
                    .entry(group.clone())
                    .or_default()
                    .insert(id.clone());
                self.limit_state.counters.held_by_budget += 1;
                Some(None)
            }
            NodeAction::Insert | NodeAction::Restart => {
                let policy = *self.limits.breakers.get(group)?;
                let breaker = self.limit_state.breakers.get_mut(group)?;
                if breaker.recovered(&policy, now) {
                    // A node stayed ready for the stable window: healthy.
                    self.limit_state.breakers.remove(group);
                    return None;
                }
                let opened_at = breaker.opened_at?;
                let probe_at = opened_at.saturating_add(policy.cooldown);
                let healthy_at = breaker
                    .recovered_at
                    .map(|at| at.saturating_add(policy.stable_after));
                if now.reached(probe_at) && !breaker.probing {
                    breaker.probing = true;
                    self.limit_state.counters.breaker_probes += 1;
                    return None;
                }
                self.limit_state.counters.held_by_breaker += 1;
                self.limit_state
                    .held_by_breaker
                    .entry(group.clone())
                    .or_default()
                    .insert(id.clone());
                let wake = if now.reached(probe_at) {
                    next_period_after(probe_at, policy.cooldown, now)
                } else {
                    probe_at
                };
                let wake = healthy_at.map_or(wake, |at| at.min(wake));
                Some(Some(wake).filter(|at| *at > now))
            }
            _ => None,
        }
    }

    /// Sets the limits the driver applies from the next pass on (a full
    /// pass is queued, so nodes they held back are looked at again).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        self.trigger();
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The breaker of `group`, when it counted a failure since it was last
    /// closed.
    pub fn breaker(&self, group: &GroupId) -> Option<&BreakerStatus> {
        self.limit_state.breakers.get(group)
    }

    /// The breaker of `group` when it holds new attempts back at `now`: open,
    /// and no node of the group has stayed ready for its stable window since
    /// (such a breaker is closed by the next attempt that looks at it).
    pub fn open_breaker(&self, group: &GroupId, now: Timestamp) -> Option<&BreakerStatus> {
        let breaker = self.limit_state.breakers.get(group)?;
        let recovered = self
            .limits
            .breakers
            .get(group)
            .is_some_and(|policy| breaker.recovered(policy, now));
        (breaker.is_open() && !recovered).then_some(breaker)
    }

    /// Closes the breaker of `group` at once (`provision resume GROUP`).
    /// Returns whether it was open.
    pub fn reset_breaker(&mut self, group: &GroupId) -> bool {
        let was_open = self
            .limit_state
            .breakers
            .remove(group)
            .is_some_and(|b| b.is_open());
        self.trigger();
        was_open
    }

    /// What the limits held back so far.
    pub fn limit_counters(&self) -> &LimitCounters {
        &self.limit_state.counters
    }

    /// `CreateLease` operations pending for `provider`.
    pub fn creates_in_flight(&self, provider: &str) -> u32 {
        self.limit_state
            .creates_in_flight
            .get(provider)
            .copied()
            .unwrap_or(0)
    }

    /// Folds an asynchronous fact about an attempt.
    ///
    /// # Errors
    /// [`DriverError::Rejected`] for a fact of another attempt, an unknown or
    /// destroyed node, or a bootstrap event without a session;
    /// [`DriverError::Clock`]; [`DriverError::PassInProgress`]. Nothing
    /// changes on error.
    pub fn apply_observation(
        &mut self,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        let outcome = self.fold_observation(observation, now);
        self.count(outcome)
    }

    fn fold_observation(
        &mut self,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        self.ensure_idle()?;
        let node_id = observation.node();
        self.node_for_fact(node_id, observation.attempt())?;
        let Some(node) = self.state.nodes.get_mut(node_id) else {
            return Err(Rejection::UnknownNode(node_id.clone()).into());
        };
        let ctx = FoldContext {
            policy: &self.policy,
            now,
            spec_is_desired: self.desired.is_desired_spec(&node.spec),
            sent: true,
        };
        let fold = |node: &mut ManagedNode| -> Result<(), DriverError> {
            match observation {
                Observation::Bootstrap { event, .. } => {
                    fold_bootstrap(node, event, &ctx)?.map_err(|reason| Rejection::Bootstrap {
                        node: node_id.clone(),
                        reason,
                    })?;
                }
                Observation::NodeLost { cause, .. } => fold_loss(node, *cause, &ctx)?,
            }
            Ok(())
        };
        let before = (node.record.stage == NodeStage::Failed, node.is_ready());
        let changed = if observation_fold_may_fail(node, observation) {
            let mut next = node.clone();
            fold(&mut next)?;
            let changed = next != *node;
            *node = next;
            changed
        } else {
            // Cannot fail, and rejects before it changes anything.
            let condition = FoldableCondition::of(node);
            fold(node)?;
            FoldableCondition::of(node) != condition
        };
        let after = (node.record.stage == NodeStage::Failed, node.is_ready());
        // Folded, whether or not it changed what is journaled.
        self.steady.remove(node_id);
        if changed {
            self.limit_events(node_id, before, after, now);
            self.note_history_of(node_id, now);
            self.touch(node_id);
        }
        Ok(())
    }

    /// Begins a pass at `now`: asks the decider about every node that needs
    /// it and returns the decisions. Until [`ClusterDriver::finish_pass`],
    /// facts are not folded and further passes are refused; triggers are
    /// remembered and cause exactly one more pass.
    ///
    /// # Errors
    /// [`DriverError::PassInProgress`] when a pass is already open.
    pub fn begin_pass(&mut self, now: Timestamp) -> Result<PassPlan, DriverError> {
        self.ensure_idle()?;
        let full = std::mem::take(&mut self.schedule.full);
        let dirty = self.schedule.take_dirty();
        let mut decisions = Vec::new();
        let mut evaluated = 0;
        let steady = &mut self.steady;
        let bound = SteadySlots::bound(self.state.nodes.len());
        if full {
            // Every slot; waits without a timer are left out because a full
            // pass rebuilds every timer anyway. A group whose every desired
            // slot is known steady is counted, not walked.
            let covered: Vec<bool> = self
                .desired
                .groups()
                .iter()
                .map(|(group, wanted)| {
                    let covered = steady.covers(group, wanted.count());
                    if covered {
                        evaluated += wanted.count() as usize;
                    }
                    covered
                })
                .collect();
            walk_slots_skipping(&self.state, &self.desired, &covered, |slot| {
                if let Slot::Managed {
                    id,
                    desire: SlotDesire::Template { .. },
                    ..
                } = slot
                    && steady.contains(id)
                {
                    // Decided steady since it and the shape last changed:
                    // steady again, without a read of the node.
                    evaluated += 1;
                    return;
                }
                let (node, desire) = slot.parts();
                let Some(decision) = decide_slot(node, desire, now) else {
                    return;
                };
                if let Slot::Managed {
                    id,
                    node,
                    desire: SlotDesire::Template { .. },
                } = slot
                    && is_steady(&decision, node)
                {
                    steady.insert(id, bound);
                }
                evaluated += 1;
                let timer = matches!(decision.wake, Some(Wake::Timer(_)));
                if decision.action != NodeAction::None || timer {
                    decisions.push((slot.id(), decision));
                }
            });
        } else {
            let mut selected = dirty;
            let schedule = &mut self.schedule;
            while let Some((at, _)) = schedule.timers.first() {
                if !now.reached(*at) {
                    break;
                }
                if let Some((_, id)) = schedule.timers.pop_first() {
                    schedule.timer_of.remove(&id);
                    selected.push(id);
                }
            }
            // In slot order, each once. Touches mostly come in slot order
            // (a batch's results in dispatch order), which the sort finds.
            selected.sort_unstable();
            selected.dedup();
            let run_id = self.desired.run_id();
            // Nearly every node a bring-up step selects has a decision:
            // sized once instead of grown (and copied) a dozen times.
            decisions.reserve_exact(selected.len());
            for id in selected {
                let node = self.state.node(&id);
                // The slot's desired run and template, without building its
                // spec (three shared handles cloned and dropped per node of
                // a bring-up's every step): the id is the node's key, so only
                // run and template are left to compare — unless the node's
                // spec names another slot, which the built spec's comparison
                // reports as drift.
                let decision = if node.is_some_and(|n| n.spec.id() != &id) {
                    reconcile_node(node, self.desired.spec(&id).as_ref(), now)
                } else {
                    let desire = match self.desired.groups().get(id.group()) {
                        Some(group) if id.index() < group.count() => SlotDesire::Template {
                            run_id,
                            template: group.template(),
                        },
                        _ => SlotDesire::Undesired,
                    };
                    let decision = decide_slot(node, desire, now);
                    if let (Some(decision), Some(node), SlotDesire::Template { .. }) =
                        (decision, node, desire)
                        && is_steady(&decision, node)
                    {
                        steady.insert(&id, bound);
                    }
                    decision
                };
                if let Some(decision) = decision {
                    evaluated += 1;
                    decisions.push((id, decision));
                }
            }
        }
        self.status = PassStatus::Open { retrigger: false };
        Ok(PassPlan {
            now,
            full,
            evaluated,
            decisions,
        })
    }

    /// Applies a begun pass: driver transitions, then each dispatch recorded
    /// pending before it is submitted. A refused submission is folded as a
    /// definite failure of the operation.
    ///
    /// # Errors
    /// [`DriverError::NoPassOpen`]; [`DriverError::NodeErrors`] when some nodes
    /// could not take their step (counter exhaustion, clock saturation) — all
    /// other steps were applied, those nodes were left unchanged and are looked
    /// at again one initial backoff later.
    pub fn finish_pass(
        &mut self,
        plan: PassPlan,
        sink: &mut dyn OperationSink,
    ) -> Result<PassReport, DriverError> {
        if !matches!(self.status, PassStatus::Open { .. }) {
            return Err(DriverError::NoPassOpen);
        }
        let now = plan.now;
        let mut report = PassReport {
            evaluated: plan.evaluated,
            ..PassReport::default()
        };
        if plan.full {
            self.schedule.timer_of.clear();
            self.schedule.timers.clear();
            // Every held node is looked at again by this pass.
            self.limit_state.held_by_cap.clear();
            self.limit_state.held_by_budget.clear();
            self.limit_state.held_by_breaker.clear();
        }
        let mut errors = Vec::new();
        let mut budget = PassBudget::default();
        if !self.limits.max_concurrent_creates.is_empty() {
            for (id, decision) in &plan.decisions {
                if decision.action == NodeAction::Dispatch(EffectKind::CreateLease)
                    && decision.rule != Rule::CreateLease
                    && let Some(node) = self.state.nodes.get(id)
                {
                    let provider = &node.spec.template().provider;
                    if self.limits.max_concurrent_creates.contains_key(provider) {
                        *budget.cleanup_creates.entry(provider.clone()).or_default() += 1;
                    }
                }
            }
        }
        // Grown once, not doubled (and copied) through a bring-up's
        // hundred thousand inserts.
        let inserts = plan
            .decisions
            .iter()
            .filter(|(_, d)| d.action == NodeAction::Insert)
            .count();
        self.inserted.reserve_exact(inserts);
        for (id, mut decision) in plan.decisions {
            if decision.action != NodeAction::None {
                if let Some(wake) = self.gate(&id, &decision, now, &mut budget) {
                    decision.action = NodeAction::None;
                    decision.wake = wake.map(Wake::Timer);
                }
            }
            let timer = match decision.wake {
                Some(Wake::Timer(at)) => Some(at),
                _ => None,
            };
            self.schedule.set_timer(&id, timer);
            let applied = match decision.action {
                NodeAction::None => Ok(()),
                NodeAction::Dispatch(kind) => self.dispatch(&id, kind, now, sink, &mut report),
                action => {
                    report.transitions += 1;
                    self.transition(&id, action, now, sink)
                }
            };
            if let Err(error) = applied {
                // Look at the node again later rather than spinning on it now.
                // At the end of the clock there is no later: a timer at `now`
                // would be due at once, forever, so none is set.
                let retry_at =
                    Some(now.saturating_add(self.policy.backoff_initial)).filter(|at| *at > now);
                self.schedule.set_timer(&id, retry_at);
                errors.push((id, error));
            }
        }
        self.merge_inserted();
        let generation = self.desired.generation();
        if self.state.observed_generation < Some(generation) {
            self.state.observed_generation = Some(generation);
            self.meta_changed();
        }
        let retrigger = matches!(self.status, PassStatus::Open { retrigger: true });
        self.status = PassStatus::Idle { queued: retrigger };
        self.counters.passes += 1;
        self.counters.evaluations += report.evaluated as u64;
        self.counters.dispatched += report.dispatched as u64;
        self.counters.refused += report.refused as u64;
        if errors.is_empty() {
            Ok(report)
        } else {
            Err(DriverError::NodeErrors(errors))
        }
    }

    /// Adds the nodes inserted by this pass to the node map. Many at once
    /// (a bring-up) are merged in one go into a map built afresh: its tree
    /// nodes are fully packed (inserting them one by one in slot order would
    /// leave them half empty) and allocated one after the other, in key
    /// order, as the boxed nodes were, so a full pass reads both as streams.
    fn merge_inserted(&mut self) {
        let inserted = std::mem::take(&mut self.inserted);
        if inserted.len() >= BULK_MERGE_MIN.max(self.state.nodes.len() / 8) {
            // Both runs are sorted and their keys disjoint (a slot is
            // inserted only while it has no node); the build sorts and
            // deduplicates anyway, keeping the inserted node of a key.
            let old = std::mem::take(&mut self.state.nodes);
            self.state.nodes = if old.is_empty() {
                // Collected in place from the vector (no copy of it first).
                inserted.into_iter().collect()
            } else {
                old.into_iter().chain(inserted).collect()
            };
        } else {
            self.state.nodes.extend(inserted);
        }
    }

    fn transition(
        &mut self,
        id: &LogicalNodeId,
        action: NodeAction,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<(), NodeError> {
        let teardown_reason = (action == NodeAction::BeginDelete).then(|| self.teardown_reason(id));
        match action {
            NodeAction::Insert | NodeAction::Restart => {
                let Some(spec) = self.desired.spec(id) else {
                    return Ok(());
                };
                let retry = RetryState {
                    consecutive_failures: self
                        .state
                        .nodes
                        .get(id)
                        .map_or(0, |n| n.retry.consecutive_failures),
                    ..RetryState::default()
                };
                let attempt = self.state.attempts.allocate()?;
                self.meta_changed();
                let node = ManagedNode::new(spec, attempt, retry);
                self.note_history(id, &node, now);
                if action == NodeAction::Insert {
                    // Merged into the map at the end of the pass.
                    self.inserted.push((id.clone(), Box::new(node)));
                } else {
                    self.state.nodes.insert(id.clone(), Box::new(node));
                }
            }
            NodeAction::Reap => {
                self.state.nodes.remove(id);
                self.history.remove(id);
                self.schedule.forget(id);
                self.node_changed(id);
                return Ok(());
            }
            NodeAction::BeginDelete => {
                if let Some(node) = self.state.nodes.get_mut(id) {
                    node.intent = Intent::Deleting;
                    node.record.ready = false;
                    if node.retry.ambiguous.is_none() {
                        node.retry.next_effect_at = None;
                    }
                }
            }
            NodeAction::MarkDestroyed => {
                if let Some(node) = self.state.nodes.get_mut(id) {
                    node.record.stage = NodeStage::Destroyed;
                    node.record.destroyed_at = Some(now);
                    node.record.ready = false;
                    node.record.endpoint = None;
                    node.retry.next_effect_at = None;
                    sink.attempt_retired(node.attempt);
                }
            }
            NodeAction::None | NodeAction::Dispatch(_) => return Ok(()),
        }
        if self.history_depth > 0
            && !matches!(action, NodeAction::Insert | NodeAction::Restart)
            && let Some(node) = self.state.nodes.get(id)
        {
            let entry = Transition::of(node, now, teardown_reason);
            let depth = self.history_depth;
            self.history
                .entry(id.clone())
                .or_default()
                .note(entry, depth);
        }
        self.touch(id);
        Ok(())
    }

    /// Why a teardown of `id` begins, in words (for its history). A failed
    /// attempt names its failure first, even when its slot was also scaled
    /// away or drifted: the entry shows the `Failed` stage, and the reason
    /// must say what failed.
    fn teardown_reason(&self, id: &LogicalNodeId) -> String {
        let Some(node) = self.state.nodes.get(id) else {
            return "torn down".to_owned();
        };
        if let Some(failure) = &node.record.failure {
            return format!("failed: {}", failure.reason);
        }
        match self.desired.spec(id) {
            None => "scaled down: the slot is no longer desired".to_owned(),
            Some(spec) if spec != node.spec => "drifted: the group's spec changed".to_owned(),
            Some(_) => "torn down".to_owned(),
        }
    }

    /// Notes `node`'s condition in the history of `id` (when history is on).
    fn note_history(&mut self, id: &LogicalNodeId, node: &ManagedNode, now: Timestamp) {
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
    fn note_history_of(&mut self, id: &LogicalNodeId, now: Timestamp) {
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

    fn dispatch(
        &mut self,
        id: &LogicalNodeId,
        kind: EffectKind,
        now: Timestamp,
        sink: &mut dyn OperationSink,
        report: &mut PassReport,
    ) -> Result<(), NodeError> {
        let run_id = self.desired.run_id().clone();
        let timeout = self.policy.operation_timeout;
        let Some(node) = self.state.nodes.get_mut(id) else {
            return Ok(());
        };
        let request = build_request(node, kind)?;
        let deadline = now.checked_add(timeout)?;
        let sequence = node.next_sequence;
        let next_sequence = sequence.next()?;
        let op = OperationId::new(node.attempt, sequence);
        node.next_sequence = next_sequence;
        let pending = PendingOperation {
            id: op,
            kind,
            dispatched_at: now,
            deadline,
        };
        node.pending = Some(pending.clone());
        if kind == EffectKind::CreateLease && node.record.stage == NodeStage::New {
            node.record.stage = NodeStage::LeaseRequested;
            if self.history_depth > 0 {
                let entry = Transition::of(node, now, None);
                let depth = self.history_depth;
                self.history
                    .entry(id.clone())
                    .or_default()
                    .note(entry, depth);
            }
        }
        if kind == EffectKind::CreateLease {
            let provider = &node.spec.template().provider;
            match self.limit_state.creates_in_flight.get_mut(provider) {
                Some(n) => *n += 1,
                None => {
                    self.limit_state
                        .creates_in_flight
                        .insert(provider.clone(), 1);
                }
            }
        }
        let operation = Operation {
            id: op,
            run_id,
            node: id.clone(),
            spec: node.spec.clone(),
            request,
        };
        self.schedule
            .deadlines
            .insert(deadline, id, &self.state.nodes);
        self.node_changed(id);
        if let Err(refused) = sink.submit(operation) {
            report.refused += 1;
            let error = EffectError::definite(format!("submission refused: {refused}"));
            // Folded at once, while the pass is open: the touch makes sure
            // exactly one more pass follows. The provider never saw it.
            self.fold_pending_as(id, &pending, Err(&error), now, false)?;
        } else {
            report.dispatched += 1;
        }
        Ok(())
    }

    /// Starts tracking what changes, for a host that journals the state:
    /// from now on [`ClusterDriver::take_changes`] returns the nodes and meta
    /// that changed since its last call. The first change set holds the
    /// whole state.
    pub fn track_changes(&mut self) {
        let nodes = self.state.nodes.keys().cloned().collect();
        self.changes = Some(ChangeTracker {
            nodes,
            meta: true,
            written_breakers: BTreeMap::new(),
        });
    }

    /// The changes since the last call (empty when nothing changed, or when
    /// changes are not tracked). `now` is recorded in the meta as the
    /// writer's clock. Take them after a drive and commit them before
    /// submitting the operations that drive produced.
    pub fn take_changes(&mut self, now: Timestamp) -> ChangeSet {
        self.take_change_view(now).to_change_set()
    }

    /// [`ClusterDriver::take_changes`] with the changed nodes borrowed from
    /// the driver instead of copied: what a host that only encodes them
    /// uses. The changes are taken either way.
    pub fn take_change_view(&mut self, now: Timestamp) -> ChangeView<'_> {
        let Some(tracker) = self.changes.as_mut() else {
            return ChangeView::default();
        };
        let breakers_changed = tracker.written_breakers != self.limit_state.breakers;
        if breakers_changed {
            tracker.written_breakers = self.limit_state.breakers.clone();
        }
        let nodes = std::mem::take(&mut tracker.nodes);
        // The meta goes with every write, so that its clock is the clock of
        // the latest instants written: recovery reads every stored instant
        // against it. A meta written only when it changed would keep an old
        // clock, and a node's backoff written since would come back late by
        // all the time in between.
        let meta =
            std::mem::replace(&mut tracker.meta, false) || breakers_changed || !nodes.is_empty();
        let mut changes = ChangeView {
            meta: meta.then(|| std::borrow::Cow::Owned(self.durable_meta(now))),
            ..ChangeView::default()
        };
        for id in nodes {
            match self.state.nodes.get(&id) {
                Some(node) => changes.upserts.push(durable_entry_ref(node)),
                None => changes.removed.push(id),
            }
        }
        changes
    }

    /// Forgets the changes since the last change set without building one:
    /// for a host that only needs to know *whether* something changed
    /// ([`ClusterDriver::has_changes`]), at no cost per changed node.
    pub fn discard_changes(&mut self) {
        if let Some(tracker) = self.changes.as_mut() {
            tracker.nodes.clear();
            tracker.meta = false;
            // The breakers as they are now count as written too, or
            // `has_changes` would go on saying a breaker change waits.
            if tracker.written_breakers != self.limit_state.breakers {
                tracker.written_breakers = self.limit_state.breakers.clone();
            }
        }
    }

    /// Takes the changes without building a change set: the ids of the
    /// nodes inserted, changed or removed since the last one (moved out, in
    /// slot order), and whether anything else changed (the meta or a
    /// breaker). For a host that journals nothing and keeps its own view of
    /// the nodes up to date; costs no work per changed node.
    pub fn take_changed_nodes(&mut self) -> (BTreeSet<LogicalNodeId>, bool) {
        let Some(tracker) = self.changes.as_mut() else {
            return (BTreeSet::new(), false);
        };
        let breakers_changed = tracker.written_breakers != self.limit_state.breakers;
        if breakers_changed {
            tracker.written_breakers = self.limit_state.breakers.clone();
        }
        let meta = std::mem::replace(&mut tracker.meta, false) || breakers_changed;
        (std::mem::take(&mut tracker.nodes), meta)
    }

    /// Whether changes are waiting for [`ClusterDriver::take_changes`]
    /// (a breaker that changed alone counts: it is part of the meta).
    pub fn has_changes(&self) -> bool {
        self.changes.as_ref().is_some_and(|c| {
            c.meta || !c.nodes.is_empty() || c.written_breakers != self.limit_state.breakers
        })
    }

    fn durable_meta(&self, now: Timestamp) -> DurableMeta {
        DurableMeta {
            format: DURABLE_FORMAT,
            desired: self.desired.shape().clone(),
            observed_generation: self.state.observed_generation,
            next_attempt: self.state.attempts.next_unallocated(),
            written_at: now,
            breakers: self.limit_state.breakers.clone(),
        }
    }

    /// The whole durable state, as a journal would hold it after every
    /// change set so far was committed.
    pub fn durable_state(&self, now: Timestamp) -> DurableState {
        DurableState {
            meta: self.durable_meta(now),
            nodes: self
                .state
                .nodes
                .values()
                .map(|n| durable_entry(n))
                .collect(),
        }
    }

    /// Rebuilds a driver from a committed durable state, after the
    /// controller that wrote it stopped (cleanly or not).
    ///
    /// - The allocator resumes at the stored mark (above every stored
    ///   attempt), so no attempt id is handed out twice across restarts.
    /// - Every stored instant moves onto the new clock by the distance
    ///   between the stored `written_at` and `now`, so a backoff keeps the
    ///   time it had left.
    /// - Every pending operation becomes ambiguous at `now` (its result is
    ///   unknown): the ladder re-issues it after backoff and the provider
    ///   adopts what it may have made; cleanup steps are simply retried.
    /// - Every bootstrap session that had not handed off loses its stream
    ///   (it went to the controller that died): its facts are dropped and its
    ///   start becomes ambiguous, so it is re-issued at once and adopted.
    ///
    /// The recovered driver tracks changes, and a full pass is queued.
    ///
    /// # Errors
    /// A [`RecoveryError`] for a state of another format or run, an invalid
    /// stored shape, or nodes stored twice; nothing is built.
    pub fn recover(
        run_id: &RunId,
        stored: DurableState,
        policy: RetryPolicy,
        now: Timestamp,
    ) -> Result<(ClusterDriver, RecoveryReport), RecoveryError> {
        let DurableState { meta, nodes } = stored;
        if meta.format != DURABLE_FORMAT {
            return Err(RecoveryError::UnsupportedFormat {
                found: meta.format,
                supported: DURABLE_FORMAT,
            });
        }
        if &meta.desired.run_id != run_id {
            return Err(RecoveryError::RunMismatch {
                expected: run_id.clone(),
                found: meta.desired.run_id.clone(),
            });
        }
        let desired = meta.desired.validate()?;
        let shift = Shift::between(meta.written_at, now);
        let mut report = RecoveryReport {
            generation: desired.generation(),
            ..RecoveryReport::default()
        };
        let mut map = BTreeMap::new();
        let mut attempts = BTreeSet::new();
        let mut highest = 0;
        for DurableEntry { mut node, template } in nodes {
            if !attempts.insert(node.attempt) {
                return Err(RecoveryError::DuplicateAttempt(node.attempt));
            }
            highest = highest.max(node.attempt.get());
            shift.node(&mut node);
            // Nodes of an unchanged group share the desired template, so
            // drift checks keep comparing pointers.
            let template = match desired.groups().get(node.node.group()) {
                Some(group) if *group.template() == template => group.template().clone(),
                _ => template,
            };
            let spec = LogicalNodeSpec::new(node.node.clone(), run_id.clone(), template);
            let managed = ManagedNode {
                spec,
                attempt: node.attempt,
                intent: node.intent,
                record: node.record,
                pending: node.pending,
                next_sequence: node.next_sequence,
                retry: node.retry,
            };
            if map.insert(node.node.clone(), Box::new(managed)).is_some() {
                return Err(RecoveryError::DuplicateNode(node.node));
            }
        }
        let mut next_attempt = meta.next_attempt;
        if highest >= next_attempt {
            next_attempt = highest.saturating_add(1);
            report.allocator_raised = true;
        }
        let state = ClusterState {
            observed_generation: meta.observed_generation,
            attempts: AttemptAllocator::with_limit(next_attempt, u64::MAX),
            nodes: map,
        };
        let mut driver = ClusterDriver::with_state(desired, state, policy);
        let mut breakers = meta.breakers;
        for breaker in breakers.values_mut() {
            shift.breaker(breaker);
        }
        driver.limit_state.breakers = breakers;
        driver.track_changes();
        if shift.is_zero()
            && let Some(changes) = &mut driver.changes
        {
            // The stored instants are on this clock already: only what
            // recovery itself changes needs writing again. On any other
            // clock everything is written again, moved: a meta written later
            // with this clock must not be read against instants of the old.
            changes.nodes.clear();
            changes.meta = report.allocator_raised;
            changes.written_breakers = driver.limit_state.breakers.clone();
        }
        report.nodes = driver.state.nodes.len();
        let pending: Vec<_> = driver
            .state
            .nodes
            .iter()
            .filter_map(|(id, n)| n.pending.clone().map(|p| (id.clone(), p)))
            .collect();
        let error = EffectError::ambiguous("the controller restarted; the outcome is unknown");
        for (id, op) in pending {
            driver.fold_pending(&id, &op, Err(&error), now)?;
            report.pending_made_ambiguous += 1;
        }
        // A session that had not handed off streamed to the controller that
        // died: nothing more will arrive for it. Its start becomes ambiguous,
        // so the ladder starts it again and the provider adopts the session
        // (and replays what it reports); cleanup re-issues it before it
        // cancels. The join is forgotten too: the agent joins the new
        // controller's swarm again.
        let streaming: Vec<LogicalNodeId> = driver
            .state
            .nodes
            .iter()
            .filter(|(_, n)| {
                n.record.failure.is_none()
                    && n.record.session_active()
                    && !matches!(
                        n.record.stage,
                        NodeStage::HandedOff | NodeStage::Dormant | NodeStage::Destroyed
                    )
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in streaming {
            if let Some(node) = driver.state.nodes.get_mut(&id) {
                let record = &mut node.record;
                record.bootstrap = None;
                record.swarm = None;
                record.stage = if record.endpoint.is_some() {
                    NodeStage::EndpointKnown
                } else if record.lease.is_some() {
                    NodeStage::LeaseCreated
                } else {
                    NodeStage::New
                };
                let last = node.next_sequence.get().saturating_sub(1).max(1);
                node.retry.ambiguous = Some(Box::new(crate::state::AmbiguousOperation {
                    op: OperationId::new(
                        node.attempt,
                        crate::id::OperationSequence::from_raw(last),
                    ),
                    kind: EffectKind::StartBootstrap,
                }));
                node.retry.next_effect_at = None;
                report.sessions_restarted += 1;
            }
            driver.touch(&id);
        }
        Ok((driver, report))
    }

    /// Runs one pass if one is queued.
    ///
    /// # Errors
    /// The errors of [`ClusterDriver::begin_pass`] and
    /// [`ClusterDriver::finish_pass`].
    pub fn drive_next(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<Option<PassReport>, DriverError> {
        self.ensure_idle()?;
        if !self.is_queued() {
            return Ok(None);
        }
        self.status = PassStatus::Idle { queued: false };
        let plan = self.begin_pass(now)?;
        self.finish_pass(plan, sink).map(Some)
    }

    /// Queues a pass if a deadline is due, then runs passes until none is
    /// queued, at most [`MAX_PASSES_PER_DRIVE`].
    ///
    /// # Errors
    /// The first error of a pass; the passes before it were applied.
    pub fn drive_until_blocked(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<DriveReport, DriverError> {
        self.trigger_if_due(now);
        let mut report = DriveReport::default();
        while report.passes < MAX_PASSES_PER_DRIVE {
            match self.drive_next(now, sink)? {
                Some(pass) => {
                    report.passes += 1;
                    report.dispatched += pass.dispatched;
                    report.refused += pass.refused;
                }
                None => return Ok(report),
            }
        }
        report.budget_exhausted = self.is_queued();
        Ok(report)
    }
}

/// The first instant after `now` on the grid of `period`s that starts at
/// `start` (`now` itself for a zero period). A node held while a breaker's
/// probe is out looks again once per cool-down; the grid is fixed by the
/// probe's time, so a pass at any instant of one period sets the same timer
/// and a forced pass over a settled driver moves no timer.
fn next_period_after(start: Timestamp, period: Duration, now: Timestamp) -> Timestamp {
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
    if period_ms == 0 {
        return now;
    }
    let elapsed_ms = now.as_millis().saturating_sub(start.as_millis());
    let periods = elapsed_ms / period_ms + 1;
    Timestamp::from_millis(
        start
            .as_millis()
            .saturating_add(periods.saturating_mul(period_ms)),
    )
}

/// Whether `decision` for `node` holds at every instant until the node or
/// its slot's desired spec changes: the ready steady state with no stored
/// backoff (a backoff in the past would still be compared with the clock).
fn is_steady(decision: &NodeDecision, node: &ManagedNode) -> bool {
    decision.rule == Rule::Steady && decision.wake.is_none() && node.retry.next_effect_at.is_none()
}

/// A history entry of `node`'s condition at `now`; a failed node's entry
/// carries the failure's reason.
fn history_entry(node: &ManagedNode, now: Timestamp) -> Transition {
    let reason = (node.record.stage == NodeStage::Failed)
        .then(|| node.record.failure.as_ref().map(|f| f.reason.clone()))
        .flatten();
    Transition::of(node, now, reason)
}

fn durable_entry(node: &ManagedNode) -> DurableEntry {
    let entry = durable_entry_ref(node);
    DurableEntry {
        node: entry.node.to_node(),
        template: entry.template.clone(),
    }
}

fn durable_entry_ref(node: &ManagedNode) -> DurableEntryRef<'_> {
    DurableEntryRef {
        node: DurableNodeRef {
            node: node.spec.id(),
            attempt: node.attempt,
            intent: node.intent,
            record: &node.record,
            pending: node.pending.as_ref(),
            next_sequence: node.next_sequence,
            retry: &node.retry,
        },
        template: node.spec.shared_template(),
    }
}

fn build_request(node: &ManagedNode, kind: EffectKind) -> Result<EffectRequest, NodeError> {
    let missing = |what| NodeError::MissingFact {
        kind,
        missing: what,
    };
    let lease = || {
        node.record
            .lease
            .as_ref()
            .map(|l| l.lease.clone())
            .ok_or_else(|| missing("lease"))
    };
    let session = || {
        node.record
            .bootstrap
            .as_ref()
            .and_then(|b| b.session.clone())
    };
    Ok(match kind {
        EffectKind::CreateLease => EffectRequest::CreateLease,
        EffectKind::LookupEndpoint => EffectRequest::LookupEndpoint { lease: lease()? },
        EffectKind::StartBootstrap => EffectRequest::StartBootstrap {
            lease: lease()?,
            endpoint: node
                .record
                .endpoint
                .as_ref()
                .map(|e| e.endpoint.clone())
                .ok_or_else(|| missing("endpoint"))?,
        },
        EffectKind::BootstrapConvergenceObserved => {
            EffectRequest::BootstrapConvergenceObserved { session: session() }
        }
        EffectKind::CancelBootstrap => EffectRequest::CancelBootstrap { session: session() },
        EffectKind::DestroyLease => EffectRequest::DestroyLease { lease: lease()? },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_node_wakes_on_the_probes_grid_whatever_instant_the_pass_ran_at() {
        let start = Timestamp::from_millis(1_000);
        let period = Duration::from_millis(500);
        let at = |ms| next_period_after(start, period, Timestamp::from_millis(ms));
        assert_eq!(at(1_000), Timestamp::from_millis(1_500));
        assert_eq!(at(1_001), Timestamp::from_millis(1_500));
        assert_eq!(at(1_499), Timestamp::from_millis(1_500));
        assert_eq!(at(1_500), Timestamp::from_millis(2_000));
        assert_eq!(
            next_period_after(start, Duration::ZERO, Timestamp::from_millis(1_234)),
            Timestamp::from_millis(1_234),
            "no period, no later instant"
        );
    }
}
