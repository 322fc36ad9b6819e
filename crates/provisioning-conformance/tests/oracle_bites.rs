//! Proof that the oracle bites: deliberately broken backends and driver
//! wrappers are each caught with the guarantee they break, and the failure
//! is shrunk to a short trace. A kit whose oracle let these pass would prove
//! nothing about a correct implementation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use provisioning::driver::{DriveReport, DriverError, DueOperation, OperationSink, SubmitError};
use provisioning::effect::{LeaseHandle, Operation, SessionHandle};
use provisioning::id::OperationSequence;
use provisioning::limits::{LimitCounters, Limits};
use provisioning::observe::LossCause;
use provisioning::shape::DesiredState;
use provisioning::spawn::Spawner;
use provisioning::{
    ChangeSet, ClusterDriver, ClusterShape, ClusterState, DesiredUpdate, ExecutorResult,
    LogicalNodeId, NodeAttemptId, Observation, OperationId, RetryPolicy, Timestamp,
};
use provisioning_conformance::substrate::{ResourceKey, SubstrateCounters};
use provisioning_conformance::trace::{Fault, FaultTarget, StreamEvent, WorkStep};
use provisioning_conformance::{
    Battery, CallRecord, Capabilities, Defect, DriverSetup, DriverUnderTest, Failure, FakeBackend,
    FakeSubstrate, GuaranteeId, LiveResources, Mode, Substrate, Trace, cluster_driver,
};

/// The longest shrunk trace these tests accept as "short".
const SHORT_TRACE: usize = 12;

/// How many seeds a broken variant may take to be caught.
const SEEDS_TO_CATCH: usize = 64;

fn first_failure<S: Substrate>(battery: Battery<S>) -> Failure {
    let report = battery
        .max_failures(1)
        .require_vacuity(false)
        .narrate_failures(false)
        .run();
    match report.failures.into_iter().next() {
        Some(failure) => failure,
        None => panic!(
            "the broken variant was not caught in {} traces",
            report.traces
        ),
    }
}

fn check_caught(failure: &Failure, expected: &[GuaranteeId]) {
    eprintln!(
        "caught as {} ({} mode), shrunk from {} to {} inputs",
        failure.guarantee(),
        failure.mode.name(),
        failure.original_inputs,
        failure.shrunk.inputs.len()
    );
    assert!(
        expected.contains(&failure.guarantee()),
        "caught as {} instead of {expected:?}:\n{failure}",
        failure.guarantee()
    );
    assert_eq!(failure.original.guarantee, failure.guarantee());
    assert!(
        failure.shrunk.inputs.len() <= SHORT_TRACE,
        "not shrunk to a short trace ({} inputs):\n{failure}",
        failure.shrunk.inputs.len()
    );
    assert!(
        failure.reproduce.contains("PROVISIONING_TRACE='"),
        "{}",
        failure.reproduce
    );
    // The shrunk trace, parsed back from the reproduction line, still fails.
    let line = failure.reproduce.split('\'').nth(1).unwrap_or_default();
    assert_eq!(line.parse::<Trace>().as_ref(), Ok(&failure.shrunk));
}

#[test]
fn a_backend_that_creates_anew_instead_of_adopting_is_caught_as_g08() {
    let battery = Battery::new("creates anew", || {
        FakeSubstrate::with_defects([Defect::CreateIgnoresExisting])
    })
    .seed_count(SEEDS_TO_CATCH);
    check_caught(&first_failure(battery), &[GuaranteeId::NoDoubleCreate]);
}

#[test]
fn a_backend_that_keeps_a_destroyed_resource_is_caught_as_g23_when_its_slot_is_scaled_away() {
    let scale_away: Trace = "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; \
                             run fifo; desire scale a 1; run fifo; run fifo; tick 1000ms"
        .parse()
        .unwrap();
    let battery = Battery::new("destroy keeps the resource", || {
        FakeSubstrate::with_defects([Defect::DestroyKeepsResource])
    })
    .seeds([])
    .modes([Mode::Fair])
    .traces([scale_away]);
    check_caught(
        &first_failure(battery),
        &[GuaranteeId::ConvergedLeaksNothing],
    );
}

#[test]
fn a_backend_that_keeps_a_destroyed_resource_is_caught_from_random_seeds() {
    // From random traces the kept resource is usually noticed earlier, when
    // its slot gets a new attempt next to it (G08); otherwise at convergence.
    let battery = Battery::new("destroy keeps the resource", || {
        FakeSubstrate::with_defects([Defect::DestroyKeepsResource])
    })
    .seed_count(SEEDS_TO_CATCH);
    check_caught(
        &first_failure(battery),
        &[
            GuaranteeId::NoDoubleCreate,
            GuaranteeId::ConvergedLeaksNothing,
        ],
    );
}

/// Ways to break the real driver from the outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
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
}

struct Broken {
    inner: ClusterDriver,
    flaw: Flaw,
}

fn broken(flaw: Flaw) -> impl Fn(&DriverSetup) -> Result<Box<dyn DriverUnderTest>, DriverError> {
    move |setup| {
        let real = cluster_driver(setup)?;
        let desired = real.desired().clone();
        let state = real.state().clone();
        let inner = ClusterDriver::with_state(desired, state, setup.policy);
        Ok(Box::new(Broken { inner, flaw }))
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

    fn take_changes(&mut self, now: Timestamp) -> ChangeSet {
        self.inner.take_changes(now)
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
            _ => {}
        }
        self.inner.set_limits(limits);
    }

    fn limit_counters(&self) -> LimitCounters {
        self.inner.limit_counters().clone()
    }
}

/// A cool-down no fair tail waits out (a thousand days).
const NEVER: std::time::Duration = std::time::Duration::from_secs(1_000 * 86_400);

fn broken_battery(flaw: Flaw) -> Battery<FakeSubstrate> {
    Battery::new(format!("{flaw:?}"), FakeSubstrate::new)
        .seed_count(SEEDS_TO_CATCH)
        .driver(broken(flaw))
}

#[test]
fn a_driver_that_ignores_launch_caps_is_caught_as_g29() {
    let failure = first_failure(broken_battery(Flaw::IgnoresCap));
    check_caught(&failure, &[GuaranteeId::BudgetsHold]);
}

#[test]
fn a_driver_that_ignores_rollout_budgets_is_caught_as_g29() {
    // A drift of a ready two-node group under a budget of one: random seeds
    // rarely line that up, so the trace is given (and shrunk all the same).
    let rollout: Trace = "limit budget a 1; run fifo; run fifo; run fifo; stream @0 joined; \
                          stream @1 joined; run fifo; tick 1000ms; desire drift a image; \
                          run fifo; run fifo"
        .parse()
        .unwrap();
    let battery = broken_battery(Flaw::IgnoresBudget)
        .seeds([])
        .traces([rollout.clone()]);
    check_caught(&first_failure(battery), &[GuaranteeId::BudgetsHold]);
    // The real driver keeps the same trace within its budget.
    let report = Battery::new("budget kept", FakeSubstrate::new)
        .seeds([])
        .traces([rollout])
        .require_vacuity(false)
        .run();
    assert!(
        report.failures.is_empty(),
        "{:?}",
        report.failures.first().map(ToString::to_string)
    );
}

#[test]
fn a_breaker_that_never_half_opens_is_caught_as_g30() {
    let tripped: Trace = "limit breaker a 1 1000ms; run fifo; run fifo; run fifo; \
                          stream @0 failed start-failed; stream @1 failed start-failed; \
                          run fifo; run fifo; tick 1000ms; run fifo"
        .parse()
        .unwrap();
    let battery = broken_battery(Flaw::NeverHalfOpens)
        .seeds([])
        .modes([Mode::Fair])
        .traces([tripped.clone()]);
    check_caught(&first_failure(battery), &[GuaranteeId::BreakerLiveness]);
    let report = Battery::new("breaker probes", FakeSubstrate::new)
        .seeds([])
        .traces([tripped])
        .require_vacuity(false)
        .run();
    assert!(
        report.failures.is_empty(),
        "{:?}",
        report.failures.first().map(ToString::to_string)
    );
}

#[test]
fn a_driver_that_dispatches_without_recording_pending_is_caught_as_g04() {
    let failure = first_failure(broken_battery(Flaw::DispatchesUnrecorded));
    check_caught(&failure, &[GuaranteeId::RecordBeforeDispatch]);
}

#[test]
fn a_driver_that_folds_results_of_a_superseded_attempt_is_caught_as_g02_or_g03() {
    // A late result of the replaced attempt while the replacement has an
    // operation pending: the seeds reach it only now and then (the executor
    // inputs, on by default, moved the seed that used to), so the shrunk
    // trace of such a seed is given as well.
    let late: Trace = "seed 0x82e197de29264d79; run fifo; run one 0; run fifo; \
                       stream @0 closed; run fifo; tick 1000ms; run one 0; redeliver 1"
        .parse()
        .unwrap();
    let failure = first_failure(broken_battery(Flaw::FoldsSupersededResults).traces([late]));
    check_caught(
        &failure,
        &[GuaranteeId::Correlation, GuaranteeId::AttemptFactOwnership],
    );
}

#[test]
fn a_driver_that_ignores_backoff_is_caught_as_g09() {
    let failure = first_failure(broken_battery(Flaw::IgnoresBackoff));
    check_caught(&failure, &[GuaranteeId::BackoffDiscipline]);
}

#[test]
fn a_driver_that_times_out_a_tick_early_is_caught_as_g25() {
    let failure = first_failure(broken_battery(Flaw::TimesOutEarly));
    check_caught(&failure, &[GuaranteeId::DeadlineBoundary]);
}

#[test]
fn a_driver_that_forgets_ambiguous_operations_is_caught_as_g12() {
    let failure = first_failure(broken_battery(Flaw::ForgetsAmbiguity));
    check_caught(&failure, &[GuaranteeId::AdoptBeforeDestroy]);
}

#[test]
fn a_driver_that_accepts_a_generation_regression_is_caught_as_g16() {
    let failure = first_failure(broken_battery(Flaw::AcceptsRegressions));
    check_caught(&failure, &[GuaranteeId::MonotonicGeneration]);
}

#[test]
fn a_driver_that_requeues_when_converged_is_caught_as_g19() {
    let failure = first_failure(broken_battery(Flaw::AlwaysRequeues));
    check_caught(&failure, &[GuaranteeId::Quiescence]);
}

#[test]
fn a_driver_that_never_delivers_endpoint_lookups_is_caught_as_g21_in_the_fair_tail() {
    let failure = first_failure(broken_battery(Flaw::SwallowsLookups));
    check_caught(&failure, &[GuaranteeId::FairConvergence]);
    assert_eq!(failure.mode, Mode::Fair);
}

/// Counts runs across the whole test binary, so that two runs of one trace
/// see different values.
static RUNS: AtomicU64 = AtomicU64::new(0);

/// A substrate that claims to be deterministic but runs queued work oldest-
/// or newest-first depending on how many runs came before it.
struct Flaky {
    inner: FakeSubstrate,
    order: WorkStep,
}

impl Flaky {
    fn new() -> Self {
        let run = RUNS.fetch_add(1, Ordering::Relaxed);
        Flaky {
            inner: FakeSubstrate::new(),
            order: if run % 2 == 0 {
                WorkStep::Fifo
            } else {
                WorkStep::Lifo
            },
        }
    }
}

impl Substrate for Flaky {
    type Backend = FakeBackend;

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn backend(&self) -> Arc<FakeBackend> {
        self.inner.backend()
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        self.inner.spawner()
    }

    fn script(&mut self, target: FaultTarget, fault: Fault) -> bool {
        self.inner.script(target, fault)
    }

    fn stop_faults(&mut self) {
        self.inner.stop_faults();
    }

    fn run_work(&mut self, step: WorkStep) -> usize {
        let step = match step {
            WorkStep::One(_) => step,
            _ => self.order,
        };
        self.inner.run_work(step)
    }

    fn has_runnable_work(&self) -> bool {
        self.inner.has_runnable_work()
    }

    fn release_oldest_hang(&mut self) -> bool {
        self.inner.release_oldest_hang()
    }

    fn release_all_hangs(&mut self) -> usize {
        self.inner.release_all_hangs()
    }

    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        self.inner.stream(session, event)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        self.inner.lose(node, attempt, cause)
    }

    fn fair_progress(&mut self) -> usize {
        self.inner.fair_progress()
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        self.inner.take_observations()
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.inner.take_calls()
    }

    fn take_ledger_alarms(&mut self) -> Vec<String> {
        self.inner.take_ledger_alarms()
    }

    fn live_resources(&self) -> LiveResources {
        self.inner.live_resources()
    }

    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.inner.lease_owner(lease)
    }

    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.inner.session_owner(session)
    }

    fn counters(&self) -> SubstrateCounters {
        self.inner.counters()
    }

    fn describe_work(&self) -> String {
        self.inner.describe_work()
    }
}

#[test]
fn a_substrate_that_is_not_reproducible_is_caught_as_g18() {
    let battery = Battery::new("flaky order", Flaky::new).seed_count(SEEDS_TO_CATCH);
    check_caught(&first_failure(battery), &[GuaranteeId::Determinism]);
}

#[test]
fn a_restart_that_forgets_its_slots_failure_count_is_caught_as_g09() {
    let failure = first_failure(broken_battery(Flaw::RestartResetsFailures));
    check_caught(&failure, &[GuaranteeId::BackoffDiscipline]);
}

#[test]
fn a_restart_that_keeps_the_replaced_attempt_id_is_caught_as_g01() {
    let failure = first_failure(broken_battery(Flaw::RestartReusesAttempt));
    check_caught(&failure, &[GuaranteeId::Identity]);
}

#[test]
fn a_driver_that_keeps_its_own_idea_of_the_desired_slots_is_caught_as_g17() {
    // The driver reports the larger count as its desired state, so only the
    // kit's own model of the shape sees the undesired slots still active.
    let failure = first_failure(broken_battery(Flaw::IgnoresScaleDown));
    check_caught(&failure, &[GuaranteeId::ScaleDownOrder]);
}

#[test]
fn a_deletion_that_waits_on_an_old_backoff_is_caught_as_g10() {
    // An endpoint that is not ready stores a probe delay; a drift within
    // that second deletes the node, whose cleanup must start at once.
    let probe_then_drift: Trace = "script lookup-endpoint not-ready; run fifo; run fifo; \
                                   desire drift a image; run fifo"
        .parse()
        .unwrap();
    let battery = broken_battery(Flaw::DeletionKeepsBackoff)
        .seeds([])
        .traces([probe_then_drift.clone()]);
    check_caught(&first_failure(battery), &[GuaranteeId::AttemptFailure]);
    let report = Battery::new("deletion at once", FakeSubstrate::new)
        .seeds([])
        .traces([probe_then_drift])
        .require_vacuity(false)
        .run();
    assert!(
        report.failures.is_empty(),
        "{:?}",
        report.failures.first().map(ToString::to_string)
    );
}

#[test]
fn a_driver_that_times_out_a_tick_late_is_caught_as_g25() {
    let failure = first_failure(broken_battery(Flaw::TimesOutLate));
    check_caught(&failure, &[GuaranteeId::DeadlineBoundary]);
}

#[test]
fn a_stage_that_hides_the_lease_it_holds_is_caught_as_g32() {
    let failure = first_failure(broken_battery(Flaw::StageIgnoresLease));
    check_caught(&failure, &[GuaranteeId::StageCoherence]);
}

#[test]
fn a_driver_that_trusts_an_answer_of_another_method_is_caught_as_g12() {
    let confused: Trace = "run fifo; confuse start-bootstrap; run fifo; run fifo; run fifo"
        .parse()
        .unwrap();
    let battery = broken_battery(Flaw::TrustsWrongAnswers)
        .seeds([])
        .traces([confused.clone()]);
    check_caught(&first_failure(battery), &[GuaranteeId::AdoptBeforeDestroy]);
    // The real driver takes the wrong answer as ambiguous and adopts.
    let report = Battery::new("wrong answers are ambiguous", FakeSubstrate::new)
        .seeds([])
        .traces([confused])
        .require_vacuity(false)
        .run();
    assert!(
        report.failures.is_empty(),
        "{:?}",
        report.failures.first().map(ToString::to_string)
    );
}

#[test]
fn the_real_executor_deduplicates_every_resubmitted_operation() {
    use provisioning_conformance::{Stepper, default_shape};
    let trace: Trace = "resubmit 0; run fifo; resubmit 0; resubmit 1; run fifo; resubmit 3; \
                        script any hang; run fifo; resubmit 0; tick 30000ms; resubmit 0; \
                        resubmit 2; run fifo; stream @0 joined; stream @1 joined; run fifo; \
                        resubmit 1; resubmit 5"
        .parse()
        .unwrap();
    let mut stepper = Stepper::new(FakeSubstrate::new(), default_shape(), Mode::Fair).unwrap();
    for input in &trace.inputs {
        if let Err(violation) = stepper.step(input) {
            panic!("{violation}");
        }
    }
    assert!(
        stepper.vacuity().resubmissions >= 8,
        "{:?}",
        stepper.vacuity()
    );
    let tail = stepper.run_fair_tail();
    assert!(tail.converged, "{}", tail.pending_description);
}

#[test]
fn a_convergence_report_sent_twice_is_caught_as_g15_under_untidy_interleavings() {
    // Only a pass between the report's answer and the session's close sees
    // the forgotten report: the interleaving seeds find it.
    // Without late closes, so the interleaving alone must find it.
    let config = provisioning_conformance::GeneratorConfig {
        late_close_per_mille: 0,
        ..provisioning_conformance::GeneratorConfig::default()
    };
    let failure = first_failure(broken_battery(Flaw::ForgetsConvergenceReport).generator(config));
    check_caught(&failure, &[GuaranteeId::SessionCoherence]);
    assert!(failure.shrunk.header.interleave, "{failure}");
}

#[test]
fn a_convergence_report_sent_twice_is_caught_as_g15_when_sessions_close_late() {
    // A provider that closes the session later than the convergence call
    // lets passes run between the two, even with tidy interleavings.
    let config = provisioning_conformance::GeneratorConfig {
        interleave_per_mille: 0,
        ..provisioning_conformance::GeneratorConfig::default()
    };
    let failure = first_failure(broken_battery(Flaw::ForgetsConvergenceReport).generator(config));
    check_caught(&failure, &[GuaranteeId::SessionCoherence]);
    assert!(
        failure.shrunk.header.late_close && !failure.shrunk.header.interleave,
        "{failure}"
    );
    assert!(failure.shrunk.inputs.len() <= SHORT_TRACE, "{failure}");
}

/// The driver flaws above, put under the exhaustive explorer (G31) instead
/// of the random battery: one node, every interleaving to depth 3. Each is
/// found with the same guarantee id as by the battery, at a shortest length
/// (after the one-node setup prefix) asserted here. Not in the table, and
/// why: `FoldsSupersededResults` needs a superseded attempt's late result
/// (deeper than 3); `AcceptsRegressions`, `TrustsWrongAnswers` and the
/// limit flaws (`IgnoresCap`, `IgnoresBudget`, `NeverHalfOpens`) need inputs
/// outside the explorer's alphabet (a generation regression, a confused
/// answer, limit changes); `ForgetsConvergenceReport` needs the interleaving
/// header.
#[test]
fn the_explorer_finds_the_driver_flaws_with_their_ids_at_shortest_lengths() {
    use provisioning_conformance::{ExploreConfig, Explorer};
    let table = [
        (Flaw::DispatchesUnrecorded, "G04", 0),
        (Flaw::AlwaysRequeues, "G19", 0),
        (Flaw::SwallowsLookups, "G21", 0),
        (Flaw::IgnoresScaleDown, "G17", 0),
        (Flaw::StageIgnoresLease, "G32", 0),
        (Flaw::IgnoresBackoff, "G09", 1),
        (Flaw::TimesOutEarly, "G25", 1),
        (Flaw::TimesOutLate, "G25", 1),
        (Flaw::ForgetsAmbiguity, "G12", 1),
        (Flaw::RestartReusesAttempt, "G01", 1),
        (Flaw::RestartResetsFailures, "G09", 2),
        (Flaw::DeletionKeepsBackoff, "G10", 3),
    ];
    for (flaw, id, length) in table {
        let report = Explorer::new(FakeSubstrate::new)
            .driver(broken(flaw))
            .run(&ExploreConfig::new(1, 3));
        let Some(found) = report.counterexample.clone() else {
            panic!("the explorer missed {flaw:?}: {report}");
        };
        eprintln!("{flaw:?}: {found}");
        assert_eq!(found.guarantee().id(), id, "{flaw:?}: {found}");
        assert_eq!(found.length, length, "{flaw:?}: {found}");
        let line = found.trace.to_single_line();
        assert_eq!(line.parse::<Trace>().as_ref(), Ok(&found.trace));
    }
}
