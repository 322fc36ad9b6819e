//! Regressions for defects the conformance kit found in the core. Each test
//! names the guarantee the kit reported and replays the kit's shrunk trace
//! by hand, so the core's own suite keeps them fixed without the kit.

mod common;

use std::sync::{Arc, Mutex, PoisonError};

use common::*;
use provisioning::effect::{EffectRequest, Operation};
use provisioning::executor::{EffectBackend, Submitted};
use provisioning::id::OperationSequence;
use provisioning::spawn::BoxFuture;
use provisioning::{
    BootstrapEvent, ClusterDriver, EffectError, EffectKind, EffectOutput, IdempotentEffectExecutor,
    Intent, LogicalNodeSpec, ManualSpawner, NodeAttemptId, NodeStage, OperationId, RunId, RunOrder,
    Timestamp,
};

fn drive(d: &mut ClusterDriver, sink: &mut RecordingSink, now: Timestamp) -> Vec<Operation> {
    let _ = d.drive_until_blocked(now, sink);
    sink.take()
}

/// Kit finding (G09 backoff discipline), shrunk trace:
/// `run fifo; run fifo; run fifo; desire drift a image; stream @0 joined;
/// tick 30000ms; stream @0 closed`.
///
/// A deleting node whose cancel failed waits out its backoff (design §5:
/// inside the deleting rows a stored `next_effect_at` is respected first).
/// The session closing after the join is a handoff, but on a deleting node
/// it must not wipe the stored cleanup backoff.
#[test]
fn a_session_closing_on_a_deleting_node_keeps_its_cleanup_backoff() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    let create = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&create), now).unwrap();
    let lookup = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&lookup), now).unwrap();
    let start = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&start), now).unwrap();

    // Drift: the node is replaced; cleanup cancels the session first.
    d.update_desired(shape(2, vec![group("g", 1, "img:2")]))
        .unwrap();
    let cancel = drive(&mut d, &mut sink, now).remove(0);
    assert_eq!(cancel.kind(), EffectKind::CancelBootstrap);
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Joined), now)
        .unwrap();
    let failed_at = at(30_000);
    d.apply_executor_result(
        &reply(&cancel, Err(EffectError::definite("cancel failed"))),
        failed_at,
    )
    .unwrap();
    let id = node("g-0");
    let backoff = d.state().nodes[&id].retry.next_effect_at;
    assert_eq!(backoff, Some(at(31_000)));

    // The session closes (after the join) while the node waits.
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Closed), failed_at)
        .unwrap();
    let managed = &d.state().nodes[&id];
    assert_eq!(managed.intent, Intent::Deleting);
    assert!(!managed.record.ready);
    assert_eq!(
        managed.retry.next_effect_at, backoff,
        "the handoff of a deleting node must not clear its cleanup backoff"
    );
    assert!(
        drive(&mut d, &mut sink, failed_at).is_empty(),
        "no cleanup step before the backoff is due"
    );
    let destroy = drive(&mut d, &mut sink, at(31_000));
    assert_eq!(
        kinds(&destroy),
        [("g-0".to_owned(), EffectKind::DestroyLease)]
    );
}

fn kinds(ops: &[Operation]) -> Vec<(String, EffectKind)> {
    ops.iter().map(|o| (o.node.to_string(), o.kind())).collect()
}

/// Kit finding (G19 quiescence, reported as a livelock), shrunk trace:
/// `clock-start 18446744073709460851; tick 120000ms`.
///
/// At the end of the clock every dispatch fails with a saturated deadline.
/// The node must then not be re-armed at `now` (which a saturating add gives
/// at `Timestamp::MAX`): the host would wake at once, fail again, forever.
/// design §6: clock saturation is an error, never a spin.
#[test]
fn a_saturated_clock_errors_without_rearming_a_timer_that_is_already_due() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let end = Timestamp::MAX;
    let outcome = d.drive_until_blocked(end, &mut sink);
    assert!(
        outcome.is_err(),
        "the dispatch deadline cannot be represented"
    );
    assert!(sink.take().is_empty());
    assert!(
        d.requeue_at().is_none_or(|t| t > end),
        "requeue_at {:?} is due at once: the host would spin",
        d.requeue_at()
    );
    assert!(!d.is_queued());
    // A host that wakes again anyway gets nothing to do rather than a spin.
    assert!(!d.trigger_if_due(end));

    // Short of the end, the errored node is looked at one initial backoff later.
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let near = Timestamp::from_millis(u64::MAX - 10_000);
    assert!(d.drive_until_blocked(near, &mut sink).is_err());
    assert_eq!(
        d.requeue_at(),
        Some(Timestamp::from_millis(u64::MAX - 9_000))
    );
    // A few milliseconds short of the end, the retry lands on the last instant,
    // and there the rule above applies.
    let almost = Timestamp::from_millis(u64::MAX - 10);
    d.trigger();
    assert!(d.drive_until_blocked(almost, &mut sink).is_err());
    assert_eq!(d.requeue_at(), Some(end));
    assert!(d.drive_until_blocked(end, &mut sink).is_err());
    assert_eq!(d.requeue_at(), None, "no timer at the last instant");
    let managed = d.state().nodes.get(&node("g-0"));
    assert!(managed.is_none_or(|n| n.record.stage == NodeStage::New));
}

/// Kit finding (G19 quiescence: converged means no requeue), shrunk trace:
/// `run fifo; run fifo; run fifo; stream @0 joined; stream @0 closed;
/// tick 29999ms; tick 1ms`.
///
/// The provider closes the session (the handoff) before the answer to
/// `BootstrapConvergenceObserved` arrives, and that answer is then lost (a
/// timeout). design §5: the result of that operation only clears the pending
/// operation. Counting it as a failure gave a ready, converged node a
/// backoff timer — a requeue on a converged cluster.
#[test]
fn a_lost_convergence_report_after_the_handoff_only_clears_the_pending_operation() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    let create = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&create), now).unwrap();
    let lookup = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&lookup), now).unwrap();
    let start = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&start), now).unwrap();
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Joined), now)
        .unwrap();
    let report = drive(&mut d, &mut sink, now).remove(0);
    assert_eq!(report.kind(), EffectKind::BootstrapConvergenceObserved);
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Closed), now)
        .unwrap();
    assert!(d.state().nodes[&node("g-0")].is_ready());
    assert!(!d.is_converged(), "the report is still pending");

    let deadline = d.state().nodes[&node("g-0")]
        .pending
        .as_ref()
        .unwrap()
        .deadline;
    d.operation_timed_out(&node("g-0"), report.id, deadline)
        .unwrap();
    assert!(drive(&mut d, &mut sink, deadline).is_empty());
    let managed = &d.state().nodes[&node("g-0")];
    assert!(managed.is_ready());
    assert_eq!(managed.retry.consecutive_failures, 0);
    assert_eq!(managed.retry.next_effect_at, None);
    assert!(d.is_converged());
    assert_eq!(d.requeue_at(), None, "converged means no requeue");
}

/// A backend that answers every call at once and remembers which ran.
#[derive(Default)]
struct CallLog {
    calls: Mutex<Vec<OperationId>>,
}

impl EffectBackend for CallLog {
    fn execute<'a>(
        &'a self,
        op: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(op.id);
        Box::pin(async move { success(op).outcome })
    }
}

fn create_op(sequence: u32) -> Operation {
    let spec = LogicalNodeSpec::new(node("g-0"), RunId::new(RUN), Arc::new(template("a")));
    Operation {
        id: OperationId::new(
            NodeAttemptId::from_raw(1),
            OperationSequence::from_raw(sequence),
        ),
        run_id: RunId::new(RUN),
        node: node("g-0"),
        spec,
        request: EffectRequest::CreateLease,
    }
}

/// Kit finding (G08 no double-create, Levels 1 and 2, seed
/// 0x890765095591ecaf at 6000 seeds), shrunk trace:
/// `script create-lease definite; tick 1000ms; tick 120000ms; tick 30000ms;
/// run one 0; tick 30000ms; desire drift a image; run lifo`.
///
/// A create waited behind an expired one; the expired one ended (its gate
/// opened) before the waiting one's task ran, and the waiting one then timed
/// out straight at the driver (design §5 allows both timeout paths), so the
/// executor still held it as waiting. The driver's next create started at
/// once — and the stale one ran after it. There, the newer create failed
/// definitely, the deleting node was marked destroyed, and the stale create
/// made a lease nobody tracked: a leak, then a second live attempt of the slot.
#[test]
fn an_operation_left_waiting_after_a_timeout_at_the_driver_never_runs_after_a_newer_one() {
    let spawner = ManualSpawner::new();
    let executor =
        IdempotentEffectExecutor::new(Arc::new(CallLog::default()), Arc::new(spawner.clone()));
    assert_eq!(executor.submit(create_op(1)), Ok(Submitted::Started));
    assert!(executor.expire(create_op(1).id).is_some());
    assert_eq!(executor.submit(create_op(2)), Ok(Submitted::Queued));
    // Only the expired operation's task runs: it never reaches the backend,
    // and its end opens the gate of the waiting one.
    assert!(spawner.run_one(RunOrder::Fifo));
    assert!(
        executor
            .backend()
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    );

    // The driver times operation 2 out by itself and issues operation 3.
    assert_eq!(executor.submit(create_op(3)), Ok(Submitted::Started));
    spawner.run_all(RunOrder::Lifo);

    let calls = executor
        .backend()
        .calls
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    assert_eq!(
        calls,
        [create_op(3).id],
        "the stale operation 2 must not run"
    );
    let reported: Vec<OperationId> = executor.take_results().iter().map(|r| r.op).collect();
    assert_eq!(reported, [create_op(3).id]);
    assert_eq!(executor.counters().skipped, 2);
    assert!(!executor.has_work());
}

/// Kit finding (G32 stage coherence), shrunk trace:
/// `script start-bootstrap ambiguous-done; run one 0; run fifo; run fifo;
/// stream @0 converged`.
///
/// A convergence report that arrives before the start's answer (after an
/// ambiguous start) is evidence of a running session, like a progress
/// event: the node must not stay `EndpointKnown` while it holds an active
/// session.
#[test]
fn a_convergence_report_before_the_starts_answer_moves_the_node_to_bootstrap_running() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    let create = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&create), now).unwrap();
    let lookup = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&success(&lookup), now).unwrap();
    let start = drive(&mut d, &mut sink, now).remove(0);
    assert_eq!(start.kind(), EffectKind::StartBootstrap);
    d.apply_executor_result(
        &reply(&start, Err(EffectError::ambiguous("reply lost"))),
        now,
    )
    .unwrap();
    let id = node("g-0");
    assert_eq!(d.state().nodes[&id].record.stage, NodeStage::EndpointKnown);
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Converged), now)
        .unwrap();
    let record = &d.state().nodes[&id].record;
    assert!(record.bootstrap.is_some(), "the session's facts exist");
    assert_eq!(record.stage, NodeStage::BootstrapRunning);
}

/// Answers every operation at `now` with success, except that every start
/// fails definitely; drives until nothing more is submitted.
fn with_failing_starts(d: &mut ClusterDriver, sink: &mut RecordingSink, now: Timestamp) {
    for _ in 0..32 {
        let ops = drive(d, sink, now);
        if ops.is_empty() {
            return;
        }
        for op in ops {
            let outcome = if op.kind() == EffectKind::StartBootstrap {
                reply(&op, Err(EffectError::definite("the agent does not start")))
            } else {
                success(&op)
            };
            d.apply_executor_result(&outcome, now).unwrap();
        }
    }
}

/// Kit finding (G19 quiescence), shrunk trace:
/// `run fifo; run fifo; limit breaker a 2 1000ms; run fifo; stream @0 failed
/// join-failed; stream @0 closed; run one 0; run fifo; tick 30001ms; run one
/// 0; run fifo; stream @0 failed stream-error`.
///
/// A node an open breaker holds back wakes by the breaker (at the probe, or
/// on the probe's grid while the probe is out). When the probe fails the
/// breaker opens again at that instant, so the held node's wake changes: it
/// must be looked at again then, or a forced pass over the settled driver
/// moves its timer (design §7, G19).
#[test]
fn a_failed_breaker_probe_looks_again_at_the_nodes_the_breaker_holds() {
    let mut d = driver();
    let g = provisioning::GroupId::new("g");
    d.set_limits(provisioning::Limits {
        breakers: std::collections::BTreeMap::from([(
            g.clone(),
            provisioning::BreakerPolicy::new(2, std::time::Duration::from_millis(1_000)),
        )]),
        ..provisioning::Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 2, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    // Both first attempts fail: the breaker opens at 0.
    with_failing_starts(&mut d, &mut sink, at(0));
    assert_eq!(d.breaker(&g).and_then(|b| b.opened_at), Some(at(0)));
    // Long after the cool-down g-0's restart is the probe (g-1 is held),
    // and the probe fails too: the breaker opens again, now.
    let now = at(30_001);
    with_failing_starts(&mut d, &mut sink, now);
    assert_eq!(d.breaker(&g).and_then(|b| b.opened_at), Some(now));
    assert_eq!(d.limit_counters().breaker_probes, 1);
    let settled = d.requeue_at();
    assert_eq!(
        settled,
        Some(at(31_001)),
        "g-1 wakes for the next probe, one cool-down after the breaker opened again"
    );
    d.trigger();
    assert!(drive(&mut d, &mut sink, now).is_empty());
    assert_eq!(d.requeue_at(), settled, "a forced pass moves no timer");
}

/// A sink that refuses every operation (a host whose outbox is full).
struct Refusing(Vec<Operation>);

impl provisioning::driver::OperationSink for Refusing {
    fn submit(&mut self, operation: Operation) -> Result<(), provisioning::driver::SubmitError> {
        self.0.push(operation);
        Err(provisioning::driver::SubmitError::Refused(
            "the outbox is full".to_owned(),
        ))
    }
}

/// Kit finding (G23 converged leaks nothing, then G12 refusal form),
/// shrunk trace: `desire drift a image; refuse any; tick 61000ms`.
///
/// A create timed out (ambiguous: the provider may have made the lease).
/// The node's slot drifted, so its cleanup re-issues the create to adopt
/// what it made before destroying it; the host's sink refused that
/// re-issue. The refusal was folded like a provider's definite answer
/// ("nothing was created for this key"), the ambiguity was forgotten and
/// the node reaped: the lease the first create made leaked. A refusal now
/// keeps what the provider may have done remembered.
#[test]
fn a_refused_reissue_keeps_the_ambiguous_create_remembered() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let create = drive(&mut d, &mut sink, at(0)).remove(0);
    d.operation_timed_out(&create.node, create.id, at(30_000))
        .unwrap();
    d.update_desired(shape(2, vec![group("g", 1, "img:2")]))
        .unwrap();
    let mut refusing = Refusing(Vec::new());
    let _ = d.drive_until_blocked(at(31_000), &mut refusing);
    let reissued = refusing.0.first().expect("the create is re-issued");
    assert_eq!(reissued.kind(), EffectKind::CreateLease);
    let node = &d.state().nodes[&node("g-0")];
    assert_eq!(
        node.retry.ambiguous.as_ref().map(|a| a.kind),
        Some(EffectKind::CreateLease),
        "the refusal is not the provider's answer"
    );
    let next = node.retry.next_effect_at.expect("retried after a backoff");
    // Once the host takes it, the provider adopts the lease and cleanup
    // destroys it: nothing leaks.
    let taken = drive(&mut d, &mut sink, next);
    assert!(taken.iter().any(|op| op.kind() == EffectKind::CreateLease));
}

/// A start the host's sink refused did not fail the attempt: the provider
/// never saw it, so it is tried again after the backoff.
#[test]
fn a_refused_start_is_tried_again_without_failing_the_attempt() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let create = drive(&mut d, &mut sink, at(0)).remove(0);
    d.apply_executor_result(&success(&create), at(0)).unwrap();
    let lookup = drive(&mut d, &mut sink, at(0)).remove(0);
    d.apply_executor_result(&success(&lookup), at(0)).unwrap();
    let mut refusing = Refusing(Vec::new());
    let _ = d.drive_until_blocked(at(0), &mut refusing);
    assert_eq!(refusing.0[0].kind(), EffectKind::StartBootstrap);
    let node = &d.state().nodes[&node("g-0")];
    assert_eq!(node.record.stage, NodeStage::EndpointKnown);
    assert!(node.record.failure.is_none(), "the attempt did not fail");
    assert_eq!(node.intent, Intent::Active);
    let next = node.retry.next_effect_at.expect("retried after a backoff");
    let again = drive(&mut d, &mut sink, next);
    assert_eq!(again[0].kind(), EffectKind::StartBootstrap);
    assert_eq!(again[0].attempt(), create.attempt(), "the same attempt");
}
