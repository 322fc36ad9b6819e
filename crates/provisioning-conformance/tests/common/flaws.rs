//! The kit's driver flaws: ways to break the real driver from the outside,
//! shared by the battery's proofs (`oracle_bites.rs`) and the explorer's
//! (`explore.rs`). Each wraps a real `ClusterDriver` and breaks one thing.

use provisioning::driver::{DriveReport, DriverError, DueOperation, OperationSink, SubmitError};
use provisioning::effect::Operation;
use provisioning::id::OperationSequence;
use provisioning::limits::{LimitCounters, Limits};
use provisioning::shape::DesiredState;
use provisioning::{
    ClusterDriver, ClusterShape, ClusterState, DesiredUpdate, ExecutorResult, LogicalNodeId,
    NodeAttemptId, Observation, OperationId, RetryPolicy, Timestamp,
};
use provisioning_conformance::{
    ChangeRead, DriverSetup, DriverUnderTest, TakenChanges, cluster_driver,
};

/// Ways to break the real driver from the outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flaw {
    /// Every submitted operation is followed by an unrecorded copy.
    DispatchesUnrecorded,
    /// Results of a superseded attempt are folded into the current one.
    FoldsSupersededResults,
    /// Stored backoff and restart times are wiped before every pass.
    IgnoresBackoff,
    /// Timeouts are accepted (and listed due) one millisecond early.
    TimesOutEarly,
    /// Remembered ambiguous operations are forgotten before every pass.
    ForgetsAmbiguity,
    /// A lower generation is taken as a no-op instead of an error.
    AcceptsRegressions,
    /// Always reports a requeue time, even when converged.
    AlwaysRequeues,
    /// Endpoint lookups are recorded pending but never reach the executor.
    SwallowsLookups,
    /// Launch caps are dropped from the limits it is given.
    IgnoresCap,
    /// Rollout budgets are dropped from the limits it is given.
    IgnoresBudget,
    /// Every breaker's cool-down is stretched to a thousand days and the
    /// wake for its probe is never reported: an open breaker never
    /// half-opens.
    NeverHalfOpens,
    /// Every breaker's cool-down is dropped: an open breaker lets its probe
    /// through at once.
    ProbesEarly,
    /// Every breaker opens one failure later than its policy says.
    OpensLate,
    /// A replacement attempt starts counting failures from zero instead of
    /// carrying its slot's count (so its backoff is too short).
    RestartResetsFailures,
    /// A restart keeps the attempt id of the attempt it replaces.
    RestartReusesAttempt,
    /// A shrinking group is never shrunk: the driver keeps the larger count
    /// and reports that as its desired state.
    IgnoresScaleDown,
    /// A node that begins deletion keeps the backoff it had stored while
    /// active, so its cleanup waits instead of starting in the next pass.
    DeletionKeepsBackoff,
    /// A timeout is due only once its deadline has passed, a tick late (a
    /// deadline compared with `>` instead of `>=`).
    TimesOutLate,
    /// A lease's facts are folded but the stage stays where it was: the
    /// node hides the lease it holds.
    StageIgnoresLease,
    /// A backend answer of another method's output is folded as a definite
    /// failure instead of an ambiguous one.
    TrustsWrongAnswers,
    /// An acknowledged convergence report is forgotten, so the report is
    /// sent again if a pass comes before the session closes.
    ForgetsConvergenceReport,
    /// A node that leaves the membership (lost, torn down, replaced) stays
    /// listed in every later peers update.
    MembershipKeepsLeavers,
}

struct Broken {
    inner: ClusterDriver,
    flaw: Flaw,
    /// Every member a peers update ever listed (for `MembershipKeepsLeavers`).
    listed: std::collections::BTreeMap<LogicalNodeId, provisioning::Member>,
}

pub(crate) fn broken(
    flaw: Flaw,
) -> impl Fn(&DriverSetup) -> Result<Box<dyn DriverUnderTest>, DriverError> {
    move |setup| {
        let real = cluster_driver(setup)?;
        let desired = real.desired().clone();
        let state = real.state().clone();
        let inner = ClusterDriver::with_state(desired, state, setup.policy);
        Ok(Box::new(Broken {
            inner,
            flaw,
            listed: std::collections::BTreeMap::new(),
        }))
    }
}

/// Accepts endpoint lookups without passing them on.
struct Swallowing<'a> {
    sink: &'a mut dyn OperationSink,
}

impl OperationSink for Swallowing<'_> {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        if operation.kind() == provisioning::EffectKind::LookupEndpoint {
            return Ok(());
        }
        self.sink.submit(operation)
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.sink.attempt_retired(attempt);
    }
}

/// Counts the operations handed on to the harness's sink.
struct Counting<'a> {
    sink: &'a mut dyn OperationSink,
    accepted: usize,
}

impl OperationSink for Counting<'_> {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        self.sink.submit(operation)?;
        self.accepted += 1;
        Ok(())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.sink.attempt_retired(attempt);
    }
}

/// Rebuilds `inner` from its own state after `edit`, as if the state had
/// been stored and reloaded by a faulty persistence layer.
fn rebuild(inner: &mut ClusterDriver, mut edit: impl FnMut(&mut ClusterState) -> bool) {
    let mut state = inner.state().clone();
    if edit(&mut state) {
        let desired = inner.desired().clone();
        let policy = *inner.policy();
        *inner = ClusterDriver::with_state(desired, state, policy);
        // The harness journals what the driver reports changed; a reloaded
        // driver keeps reporting (the edit itself is not reported).
        inner.track_changes();
    }
}

/// Forwards every operation and then submits an unrecorded copy of it.
struct Duplicating<'a> {
    sink: &'a mut dyn OperationSink,
}

impl OperationSink for Duplicating<'_> {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        let mut copy = operation.clone();
        let sequence = operation.id.sequence().get().saturating_add(1_000);
        copy.id = OperationId::new(operation.attempt(), OperationSequence::from_raw(sequence));
        self.sink.submit(operation)?;
        let _ = self.sink.submit(copy);
        Ok(())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.sink.attempt_retired(attempt);
    }
}

/// Drops cleanup operations of the given attempts instead of passing them on.
struct DroppingCleanup<'a> {
    sink: &'a mut dyn OperationSink,
    attempts: &'a [NodeAttemptId],
}

impl OperationSink for DroppingCleanup<'_> {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        if operation.kind().is_cleanup() && self.attempts.contains(&operation.attempt()) {
            return Ok(());
        }
        self.sink.submit(operation)
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.sink.attempt_retired(attempt);
    }
}

impl Broken {
    /// `now`, or a tick before it when some pending deadline is exactly
    /// `now`: the inner driver then sees "due" only strictly past a deadline.
    fn late_by_a_tick(&self, now: Timestamp) -> Timestamp {
        let at_deadline = self
            .inner
            .state()
            .nodes
            .values()
            .filter_map(|n| n.pending.as_ref())
            .any(|p| p.deadline == now);
        match now.as_millis().checked_sub(1) {
            Some(early) if at_deadline => Timestamp::from_millis(early),
            _ => now,
        }
    }

    /// The slot → attempt map of the inner driver's state now.
    fn attempts(&self) -> std::collections::BTreeMap<LogicalNodeId, NodeAttemptId> {
        self.inner
            .state()
            .nodes
            .iter()
            .map(|(id, node)| (id.clone(), node.attempt))
            .collect()
    }

    /// A pass whose restarts lose their slot's failure count, or (with
    /// `reuse`) keep the replaced attempt's id.
    fn drive_with_bad_restarts(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
        reuse: bool,
    ) -> Result<DriveReport, DriverError> {
        let before = self.attempts();
        let report = self.inner.drive_until_blocked(now, sink);
        rebuild(&mut self.inner, |state| {
            let mut edited = false;
            for (id, node) in &mut state.nodes {
                let Some(old) = before.get(id).filter(|old| **old != node.attempt) else {
                    continue;
                };
                if reuse {
                    node.attempt = *old;
                    if let Some(pending) = &mut node.pending {
                        pending.id = OperationId::new(*old, pending.id.sequence());
                    }
                    edited = true;
                } else if node.retry.consecutive_failures > 0 {
                    node.retry.consecutive_failures = 0;
                    edited = true;
                }
            }
            edited
        });
        report
    }

    /// A pass in which a node that begins deletion keeps its stored backoff
    /// and so does not start its cleanup.
    /// Drives the inner driver through this flaw's distortion.
    fn drive_flawed(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<DriveReport, DriverError> {
        match self.flaw {
            Flaw::DispatchesUnrecorded => self
                .inner
                .drive_until_blocked(now, &mut Duplicating { sink }),
            Flaw::IgnoresBackoff => {
                rebuild(&mut self.inner, |state| {
                    let mut waited = false;
                    for node in state.nodes.values_mut() {
                        waited |= node.retry.next_effect_at.is_some_and(|t| t > now)
                            || node.retry.restart_at.is_some_and(|t| t > now);
                        node.retry.next_effect_at = None;
                        node.retry.restart_at = None;
                    }
                    waited
                });
                self.inner.drive_until_blocked(now, sink)
            }
            Flaw::ForgetsAmbiguity => {
                rebuild(&mut self.inner, |state| {
                    let mut forgot = false;
                    for node in state.nodes.values_mut() {
                        forgot |= node.retry.ambiguous.take().is_some();
                    }
                    forgot
                });
                self.inner.drive_until_blocked(now, sink)
            }
            Flaw::SwallowsLookups => self
                .inner
                .drive_until_blocked(now, &mut Swallowing { sink }),
            Flaw::RestartResetsFailures => self.drive_with_bad_restarts(now, sink, false),
            Flaw::RestartReusesAttempt => self.drive_with_bad_restarts(now, sink, true),
            Flaw::DeletionKeepsBackoff => self.drive_keeping_backoff(now, sink),
            _ => self.inner.drive_until_blocked(now, sink),
        }
    }

    fn drive_keeping_backoff(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<DriveReport, DriverError> {
        let waiting: Vec<(NodeAttemptId, Timestamp)> = self
            .inner
            .state()
            .nodes
            .values()
            .filter(|n| n.intent == provisioning::Intent::Active && n.retry.ambiguous.is_none())
            .filter_map(|n| {
                let at = n.retry.next_effect_at.filter(|at| *at > now)?;
                Some((n.attempt, at))
            })
            .collect();
        let attempts: Vec<NodeAttemptId> = waiting.iter().map(|(a, _)| *a).collect();
        let report = self.inner.drive_until_blocked(
            now,
            &mut DroppingCleanup {
                sink,
                attempts: &attempts,
            },
        );
        rebuild(&mut self.inner, |state| {
            let mut edited = false;
            for node in state.nodes.values_mut() {
                let Some((_, at)) = waiting.iter().find(|(a, _)| *a == node.attempt) else {
                    continue;
                };
                let dropped = node.pending.as_ref().is_some_and(|p| p.kind.is_cleanup());
                if node.intent == provisioning::Intent::Deleting && dropped {
                    node.pending = None;
                    node.retry.next_effect_at = Some(*at);
                    edited = true;
                }
            }
            edited
        });
        report
    }
}

impl DriverUnderTest for Broken {
    fn update_desired(&mut self, mut shape: ClusterShape) -> Result<DesiredUpdate, DriverError> {
        if self.flaw == Flaw::IgnoresScaleDown {
            let groups = self.inner.desired().groups();
            for group in &mut shape.groups {
                if let Some(current) = groups.get(&group.id) {
                    group.count = group.count.max(current.count());
                }
            }
        }
        if self.flaw == Flaw::AcceptsRegressions
            && shape.generation < self.inner.desired().generation()
        {
            return Ok(DesiredUpdate::Unchanged);
        }
        self.inner.update_desired(shape)
    }

    fn trigger(&mut self) {
        self.inner.trigger();
    }

    fn drive_until_blocked(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<DriveReport, DriverError> {
        // A flawed driver still counts what it handed over truthfully: each
        // flaw is meant to break its own guarantee, not the report's.
        let mut counting = Counting { sink, accepted: 0 };
        let report = self.drive_flawed(now, &mut counting);
        report.map(|report| DriveReport {
            dispatched: counting.accepted,
            ..report
        })
    }

    fn apply_executor_result(
        &mut self,
        result: &ExecutorResult,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        if self.flaw == Flaw::FoldsSupersededResults {
            let current = self.inner.state().nodes.get(&result.node).and_then(|node| {
                (node.attempt != result.op.attempt())
                    .then_some(node.pending.as_ref())
                    .flatten()
            });
            if let Some(pending) = current {
                let mut rewritten = result.clone();
                rewritten.op = pending.id;
                rewritten.kind = pending.kind;
                return self.inner.apply_executor_result(&rewritten, now);
            }
        }
        if self.flaw == Flaw::TrustsWrongAnswers
            && result
                .outcome
                .as_ref()
                .is_ok_and(|output| output.kind() != result.kind)
        {
            let mut definite = result.clone();
            definite.outcome = Err(provisioning::EffectError::definite("a wrong answer"));
            return self.inner.apply_executor_result(&definite, now);
        }
        let folded = self.inner.apply_executor_result(result, now);
        if self.flaw == Flaw::ForgetsConvergenceReport
            && result.kind == provisioning::EffectKind::BootstrapConvergenceObserved
        {
            rebuild(&mut self.inner, |state| {
                let Some(facts) = state
                    .nodes
                    .get_mut(&result.node)
                    .and_then(|n| n.record.bootstrap.as_mut())
                else {
                    return false;
                };
                std::mem::take(&mut facts.convergence_observed)
            });
        }
        if self.flaw == Flaw::StageIgnoresLease {
            rebuild(&mut self.inner, |state| {
                let Some(node) = state.nodes.get_mut(&result.node) else {
                    return false;
                };
                let moved = matches!(
                    node.record.stage,
                    provisioning::NodeStage::LeaseCreated | provisioning::NodeStage::EndpointKnown
                ) && result.kind == provisioning::EffectKind::CreateLease;
                if moved {
                    node.record.stage = provisioning::NodeStage::LeaseRequested;
                }
                moved
            });
        }
        folded
    }

    fn operation_timed_out(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        let now = match self.flaw {
            Flaw::TimesOutEarly => now.saturating_add(std::time::Duration::from_millis(1)),
            Flaw::TimesOutLate => self.late_by_a_tick(now),
            _ => now,
        };
        self.inner.operation_timed_out(node, op, now)
    }

    fn apply_observation(
        &mut self,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        self.inner.apply_observation(observation, now)
    }

    fn state(&self) -> &ClusterState {
        self.inner.state()
    }

    fn desired(&self) -> &DesiredState {
        self.inner.desired()
    }

    fn policy(&self) -> &RetryPolicy {
        self.inner.policy()
    }

    fn requeue_at(&self) -> Option<Timestamp> {
        match self.flaw {
            Flaw::AlwaysRequeues => self.inner.requeue_at().or(Some(Timestamp::MAX)),
            // The far-off probe wake is never armed.
            Flaw::NeverHalfOpens => self.inner.requeue_at().filter(|at| {
                self.inner
                    .state()
                    .nodes
                    .values()
                    .filter_map(|n| n.pending.as_ref())
                    .any(|p| p.deadline >= *at)
                    || self
                        .inner
                        .breaker(&provisioning::GroupId::new("a"))
                        .is_none()
            }),
            _ => self.inner.requeue_at(),
        }
    }

    fn pending_operations_due(&self, now: Timestamp) -> Vec<DueOperation> {
        let now = match self.flaw {
            Flaw::TimesOutEarly => now.saturating_add(std::time::Duration::from_millis(1)),
            Flaw::TimesOutLate => self.late_by_a_tick(now),
            _ => now,
        };
        self.inner.pending_operations_due(now)
    }

    fn is_converged(&self) -> bool {
        self.inner.is_converged()
    }

    fn is_queued(&self) -> bool {
        self.inner.is_queued()
    }

    fn track_changes(&mut self) {
        self.inner.track_changes();
    }

    fn track_membership(&mut self) {
        self.inner.track_membership();
    }

    fn take_membership(&mut self) -> Option<std::sync::Arc<provisioning::Membership>> {
        let membership = self.inner.take_membership()?;
        if self.flaw != Flaw::MembershipKeepsLeavers {
            return Some(membership);
        }
        for member in &membership.members {
            self.listed.insert(member.node.clone(), member.clone());
        }
        let mut kept = (*membership).clone();
        for (node, member) in &self.listed {
            if !kept.members.iter().any(|m| &m.node == node) {
                kept.members.push(member.clone());
            }
        }
        kept.members.sort_by(|a, b| a.node.cmp(&b.node));
        Some(std::sync::Arc::new(kept))
    }

    fn take_changes(&mut self, now: Timestamp, read: ChangeRead) -> TakenChanges {
        // This driver offers neither `has_changes` nor `durable_state`, so
        // it hands out change sets only, whatever the read asked for.
        let _ = read;
        TakenChanges::ChangeSet(self.inner.take_changes(now).to_owned_changes())
    }

    fn set_limits(&mut self, mut limits: Limits) {
        match self.flaw {
            Flaw::IgnoresCap => limits.max_concurrent_creates.clear(),
            Flaw::IgnoresBudget => limits.max_unavailable.clear(),
            Flaw::NeverHalfOpens => {
                for policy in limits.breakers.values_mut() {
                    policy.cooldown = NEVER;
                }
            }
            Flaw::ProbesEarly => {
                for policy in limits.breakers.values_mut() {
                    policy.cooldown = std::time::Duration::ZERO;
                }
            }
            Flaw::OpensLate => {
                for policy in limits.breakers.values_mut() {
                    policy.failures = policy.failures.saturating_add(1);
                }
            }
            _ => {}
        }
        self.inner.set_limits(limits);
    }

    fn limit_counters(&self) -> LimitCounters {
        self.inner.limit_counters().clone()
    }

    fn breaker_open(&self, group: &provisioning::GroupId, now: Timestamp) -> Option<bool> {
        Some(self.inner.open_breaker(group, now).is_some())
    }

    fn reset_breaker(&mut self, group: &provisioning::GroupId) -> Option<bool> {
        Some(self.inner.reset_breaker(group))
    }
}

/// A cool-down no fair tail waits out (a thousand days).
const NEVER: std::time::Duration = std::time::Duration::from_secs(1_000 * 86_400);
