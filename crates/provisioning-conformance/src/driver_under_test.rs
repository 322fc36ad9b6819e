//! The driver seam: what the harness needs from a driver.
//!
//! The harness talks to the driver through [`DriverUnderTest`], implemented
//! for [`ClusterDriver`]. The seam exists so that the kit can test itself:
//! its own tests wrap the real driver in deliberately broken variants (one
//! that dispatches without recording, one that ignores backoff…) and check
//! that the oracle names the broken guarantee. It is equally usable for an
//! alternative driver implementation that claims the same contract.

use std::collections::BTreeSet;
use std::sync::Arc;

use provisioning::driver::{DriveReport, DriverError, DueOperation, OperationSink, PassReport};
use provisioning::limits::{BreakerStatus, LimitCounters, Limits};
use provisioning::shape::DesiredState;
use provisioning::{
    ClusterDriver, ClusterShape, ClusterState, DesiredUpdate, DriverChanges, DurableState,
    ExecutorResult, GroupId, LogicalNodeId, Membership, NodeDecision, NodeHistory, Observation,
    OperationId, RetryPolicy, Timestamp,
};

/// What one pass planned before it was applied, as
/// [`PassPlan`](provisioning::driver::PassPlan) shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedPass {
    /// The instant the pass evaluates.
    pub now: Timestamp,
    /// Whether it evaluates every slot.
    pub full: bool,
    /// How many slots the decider looked at.
    pub evaluated: usize,
    /// Its decisions, in slot order (an incremental pass lists every node it
    /// evaluated; a full pass the nodes that act or wait on a timer).
    pub decisions: Vec<(LogicalNodeId, NodeDecision)>,
}

/// How a host reads the changes it takes from a driver
/// ([`ClusterDriver::take_changes`], read through a
/// [`DriverChangesView`](provisioning::DriverChangesView)). The harness takes
/// them each way in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeRead {
    /// The change set, owned: what a host that journals it reads.
    ChangeSet,
    /// The ids of the changed nodes alone: what a host that keeps its own
    /// view of the nodes reads.
    Ids,
    /// Nothing: the changes are discarded unread, by a host that asked only
    /// whether something changed and writes the whole state.
    Nothing,
}

/// The changes a driver handed out ([`DriverUnderTest::take_changes`]).
#[derive(Clone, Debug, PartialEq)]
pub enum TakenChanges {
    /// The change set.
    ChangeSet(DriverChanges),
    /// The ids of the nodes inserted, changed or removed, in slot order.
    Ids {
        /// The nodes.
        nodes: BTreeSet<LogicalNodeId>,
        /// Whether anything is to be written (a node, the meta or a
        /// breaker changed).
        written: bool,
    },
    /// The changes were taken and discarded.
    Discarded,
}

/// The operations of [`ClusterDriver`] the harness uses. See its docs for
/// the contract of each method; an implementation must keep it.
pub trait DriverUnderTest {
    /// See [`ClusterDriver::update_desired`].
    ///
    /// # Errors
    /// As [`ClusterDriver::update_desired`].
    fn update_desired(&mut self, shape: ClusterShape) -> Result<DesiredUpdate, DriverError>;

    /// See [`ClusterDriver::trigger`].
    fn trigger(&mut self);

    /// See [`ClusterDriver::drive_until_blocked`].
    ///
    /// # Errors
    /// As [`ClusterDriver::drive_until_blocked`].
    fn drive_until_blocked(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<DriveReport, DriverError>;

    /// One queued pass in two steps ([`ClusterDriver::begin_pass`], then
    /// [`ClusterDriver::finish_pass`]), reporting what it planned. With
    /// `first`, a due stored deadline queues a pass first, as
    /// [`ClusterDriver::drive_until_blocked`] does. `Ok(None)` when no pass
    /// is queued. `between` is called while the pass is open, after its
    /// plan and before its application (the kit probes there that folds are
    /// refused). The default cannot split a pass (`None`): the harness
    /// then drives with [`DriverUnderTest::drive_until_blocked`] only.
    ///
    /// # Errors
    /// As [`ClusterDriver::begin_pass`] and [`ClusterDriver::finish_pass`].
    #[allow(clippy::type_complexity)]
    fn drive_one_pass(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
        first: bool,
        between: &mut dyn FnMut(&mut dyn DriverUnderTest),
    ) -> Option<Result<Option<(PlannedPass, PassReport)>, DriverError>> {
        let _ = (now, sink, first, between);
        None
    }

    /// See [`ClusterDriver::apply_executor_result`].
    ///
    /// # Errors
    /// As [`ClusterDriver::apply_executor_result`].
    fn apply_executor_result(
        &mut self,
        result: &ExecutorResult,
        now: Timestamp,
    ) -> Result<(), DriverError>;

    /// See [`ClusterDriver::operation_timed_out`].
    ///
    /// # Errors
    /// As [`ClusterDriver::operation_timed_out`].
    fn operation_timed_out(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        now: Timestamp,
    ) -> Result<(), DriverError>;

    /// See [`ClusterDriver::apply_observation`].
    ///
    /// # Errors
    /// As [`ClusterDriver::apply_observation`].
    fn apply_observation(
        &mut self,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(), DriverError>;

    /// See [`ClusterDriver::state`].
    fn state(&self) -> &ClusterState;

    /// See [`ClusterDriver::desired`].
    fn desired(&self) -> &DesiredState;

    /// See [`ClusterDriver::policy`].
    fn policy(&self) -> &RetryPolicy;

    /// See [`ClusterDriver::requeue_at`].
    fn requeue_at(&self) -> Option<Timestamp>;

    /// See [`ClusterDriver::pending_operations_due`].
    fn pending_operations_due(&self, now: Timestamp) -> Vec<DueOperation>;

    /// See [`ClusterDriver::is_converged`].
    fn is_converged(&self) -> bool;

    /// See [`ClusterDriver::is_queued`].
    fn is_queued(&self) -> bool;

    /// See [`ClusterDriver::track_changes`]. The harness calls it once on a
    /// freshly built driver, and again after a failed commit (so the next
    /// change set rewrites everything). The default does nothing: a driver
    /// that does not journal cannot be recovered after a crash.
    fn track_changes(&mut self) {}

    /// See [`ClusterDriver::take_changes`]: the changes since the last take,
    /// read as `read` asks (as a change set, as the changed ids alone, or
    /// not at all: discarded). A driver may answer any read with a change
    /// set, which the harness then uses as one. The default hands out an
    /// empty change set.
    fn take_changes(&mut self, now: Timestamp, read: ChangeRead) -> TakenChanges {
        let _ = (now, read);
        TakenChanges::ChangeSet(DriverChanges::default())
    }

    /// See [`ClusterDriver::track_membership`]. The harness calls it once
    /// on every driver it builds (also after a recovery). The default does
    /// nothing: a driver that hands out no membership passes G35 vacuously.
    fn track_membership(&mut self) {}

    /// See [`ClusterDriver::take_membership`]: the run's membership if it
    /// changed since the last take. The harness takes it after every drive,
    /// as a host does before it pushes it to the agents. The default hands
    /// out none.
    fn take_membership(&mut self) -> Option<Arc<Membership>> {
        None
    }

    /// See [`ClusterDriver::has_changes`]: whether a change set is waiting.
    /// The default does not say (`None`).
    fn has_changes(&self) -> Option<bool> {
        None
    }

    /// See [`ClusterDriver::durable_state`]: the whole state as a journal
    /// would hold it. The default does not offer it (`None`).
    fn durable_state(&self, now: Timestamp) -> Option<DurableState> {
        let _ = now;
        None
    }

    /// See [`ClusterDriver::set_limits`]. The default ignores limits (a
    /// driver without them: the oracle's G29/G30 checks then pass
    /// vacuously, and the battery's limit vacuity counts stay zero).
    fn set_limits(&mut self, limits: Limits) {
        let _ = limits;
    }

    /// See [`ClusterDriver::limit_counters`], for vacuity reports only (the
    /// oracle never trusts them). The default counts nothing.
    fn limit_counters(&self) -> LimitCounters {
        LimitCounters::default()
    }

    /// See [`ClusterDriver::counters`]: what the driver counted since it was
    /// made (a host meters them). The default counts nothing (`None`; the
    /// oracle's count check then passes vacuously).
    fn counters(&self) -> Option<provisioning::driver::DriverCounters> {
        None
    }

    /// See [`ClusterDriver::set_history_depth`]; returns whether this driver
    /// keeps node histories. The default keeps none and returns `false` (the
    /// oracle's history check then passes vacuously).
    fn set_history_depth(&mut self, depth: usize) -> bool {
        let _ = depth;
        false
    }

    /// See [`ClusterDriver::history`]. The default keeps none.
    fn history(&self, id: &LogicalNodeId) -> Option<&NodeHistory> {
        let _ = id;
        None
    }

    /// See [`ClusterDriver::open_breaker`]: whether `group`'s breaker holds
    /// new attempts back at `now`. The default has no breakers (`None`).
    fn breaker_open(&self, group: &GroupId, now: Timestamp) -> Option<bool> {
        let _ = (group, now);
        None
    }

    /// See [`ClusterDriver::breaker`]: the breaker's bookkeeping, what a
    /// host shows an operator. The default has no breakers (`None`).
    fn breaker_status(&self, group: &GroupId) -> Option<Option<BreakerStatus>> {
        let _ = group;
        None
    }

    /// See [`ClusterDriver::limits`]: the limits in force. The default
    /// reports none (`None`).
    fn limits_in_force(&self) -> Option<Limits> {
        None
    }

    /// See [`ClusterDriver::reset_breaker`] (`provision resume GROUP`):
    /// whether the breaker was open. The default has no breakers (`None`).
    fn reset_breaker(&mut self, group: &GroupId) -> Option<bool> {
        let _ = group;
        None
    }

    /// See [`ClusterDriver::creates_in_flight`] (what a host shows and the
    /// launch cap counts). The default does not count (`None`: the oracle's
    /// check of the count passes vacuously).
    fn creates_in_flight(&self, provider: &str) -> Option<u32> {
        let _ = provider;
        None
    }
}

impl DriverUnderTest for ClusterDriver {
    fn update_desired(&mut self, shape: ClusterShape) -> Result<DesiredUpdate, DriverError> {
        ClusterDriver::update_desired(self, shape)
    }

    fn trigger(&mut self) {
        ClusterDriver::trigger(self);
    }

    fn drive_until_blocked(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<DriveReport, DriverError> {
        ClusterDriver::drive_until_blocked(self, now, sink)
    }

    fn drive_one_pass(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
        first: bool,
        between: &mut dyn FnMut(&mut dyn DriverUnderTest),
    ) -> Option<Result<Option<(PlannedPass, PassReport)>, DriverError>> {
        if first {
            self.trigger_if_due(now);
        }
        if !self.is_queued() {
            return Some(Ok(None));
        }
        let plan = match self.begin_pass(now) {
            Ok(plan) => plan,
            Err(error) => return Some(Err(error)),
        };
        let planned = PlannedPass {
            now: plan.now(),
            full: plan.is_full(),
            evaluated: plan.evaluated(),
            decisions: plan.decisions().to_vec(),
        };
        between(self);
        Some(
            self.finish_pass(plan, sink)
                .map(|report| Some((planned, report))),
        )
    }

    fn apply_executor_result(
        &mut self,
        result: &ExecutorResult,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        ClusterDriver::apply_executor_result(self, result, now)
    }

    fn operation_timed_out(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        ClusterDriver::operation_timed_out(self, node, op, now)
    }

    fn apply_observation(
        &mut self,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        ClusterDriver::apply_observation(self, observation, now)
    }

    fn state(&self) -> &ClusterState {
        ClusterDriver::state(self)
    }

    fn desired(&self) -> &DesiredState {
        ClusterDriver::desired(self)
    }

    fn policy(&self) -> &RetryPolicy {
        ClusterDriver::policy(self)
    }

    fn requeue_at(&self) -> Option<Timestamp> {
        ClusterDriver::requeue_at(self)
    }

    fn pending_operations_due(&self, now: Timestamp) -> Vec<DueOperation> {
        ClusterDriver::pending_operations_due(self, now)
    }

    fn is_converged(&self) -> bool {
        ClusterDriver::is_converged(self)
    }

    fn is_queued(&self) -> bool {
        ClusterDriver::is_queued(self)
    }

    fn track_changes(&mut self) {
        ClusterDriver::track_changes(self);
    }

    fn has_changes(&self) -> Option<bool> {
        Some(ClusterDriver::has_changes(self))
    }

    fn track_membership(&mut self) {
        ClusterDriver::track_membership(self);
    }

    fn take_membership(&mut self) -> Option<Arc<Membership>> {
        ClusterDriver::take_membership(self)
    }

    fn take_changes(&mut self, now: Timestamp, read: ChangeRead) -> TakenChanges {
        let changes = ClusterDriver::take_changes(self, now);
        match read {
            ChangeRead::ChangeSet => TakenChanges::ChangeSet(changes.to_owned_changes()),
            ChangeRead::Ids => TakenChanges::Ids {
                written: !changes.is_empty(),
                nodes: changes.into_nodes(),
            },
            ChangeRead::Nothing => {
                drop(changes);
                TakenChanges::Discarded
            }
        }
    }

    fn durable_state(&self, now: Timestamp) -> Option<DurableState> {
        Some(ClusterDriver::durable_state(self, now))
    }

    fn set_limits(&mut self, limits: Limits) {
        ClusterDriver::set_limits(self, limits);
    }

    fn limit_counters(&self) -> LimitCounters {
        ClusterDriver::limit_counters(self).clone()
    }

    fn counters(&self) -> Option<provisioning::driver::DriverCounters> {
        Some(ClusterDriver::counters(self).clone())
    }

    fn set_history_depth(&mut self, depth: usize) -> bool {
        ClusterDriver::set_history_depth(self, depth);
        true
    }

    fn history(&self, id: &LogicalNodeId) -> Option<&NodeHistory> {
        ClusterDriver::history(self, id)
    }

    fn creates_in_flight(&self, provider: &str) -> Option<u32> {
        Some(ClusterDriver::creates_in_flight(self, provider))
    }

    fn breaker_open(&self, group: &GroupId, now: Timestamp) -> Option<bool> {
        Some(ClusterDriver::open_breaker(self, group, now).is_some())
    }

    fn breaker_status(&self, group: &GroupId) -> Option<Option<BreakerStatus>> {
        Some(ClusterDriver::breaker(self, group).cloned())
    }

    fn limits_in_force(&self) -> Option<Limits> {
        Some(ClusterDriver::limits(self).clone())
    }

    fn reset_breaker(&mut self, group: &GroupId) -> Option<bool> {
        Some(ClusterDriver::reset_breaker(self, group))
    }
}
