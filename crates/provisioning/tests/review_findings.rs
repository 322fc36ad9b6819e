//! Findings of the outside review of the first release (issue 10), each as
//! the sequence the reviewer wrote against the public API.

mod common;

use std::sync::Arc;

use common::*;
use provisioning::effect::{EffectRequest, Operation};
use provisioning::{
    BootstrapEvent, BootstrapFailure, BootstrapRejection, DriverError, EffectError, EffectKind,
    IdempotentEffectExecutor, LogicalNodeSpec, ManualSpawner, NodeAttemptId, NodeStage,
    OperationId, OperationSequence, OperationSink, Rejection, RunId, RunOrder, SessionState,
    SubmitError, Submitted,
};

/// Brings `g-0` to a dispatched bootstrap start (not yet answered).
fn start_dispatched(d: &mut provisioning::ClusterDriver, sink: &mut RecordingSink) -> Operation {
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let now = at(0);
    let create = one(drive(d, sink, now), EffectKind::CreateLease);
    d.apply_executor_result(&success(&create), now).unwrap();
    let lookup = one(drive(d, sink, now), EffectKind::LookupEndpoint);
    d.apply_executor_result(&success(&lookup), now).unwrap();
    one(drive(d, sink, now), EffectKind::StartBootstrap)
}

#[test]
fn late_stream_events_of_a_failed_session_are_rejected_and_cleanup_still_cancels_it() {
    let mut d = driver();
    let mut sink = RecordingSink::default();
    let start = start_dispatched(&mut d, &mut sink);
    let now = at(0);
    d.apply_executor_result(&success(&start), now).unwrap();
    d.apply_observation(
        &bootstrap(
            &start,
            BootstrapEvent::Failed {
                failure: BootstrapFailure::StartFailed,
                detail: "workload exited".into(),
            },
        ),
        now,
    )
    .unwrap();
    let before = d.state().nodes[&node("g-0")].clone();
    assert_eq!(before.record.stage, NodeStage::Failed);

    for late in [BootstrapEvent::Joined, BootstrapEvent::Closed] {
        let outcome = d.apply_observation(&bootstrap(&start, late.clone()), now);
        assert_eq!(
            outcome,
            Err(DriverError::Rejected(Rejection::Bootstrap {
                node: node("g-0"),
                reason: BootstrapRejection::AttemptFailed,
            })),
            "a late {late:?} of a failed session must be rejected"
        );
        assert_eq!(
            d.state().nodes[&node("g-0")],
            before,
            "{late:?} changed the node"
        );
    }
    let managed = &d.state().nodes[&node("g-0")];
    assert!(managed.record.swarm.is_none());
    assert_eq!(
        managed.record.bootstrap.as_ref().map(|b| b.state),
        Some(SessionState::Active)
    );

    // Cleanup starts at once and cancels the session before the lease.
    let cancel = one(drive(&mut d, &mut sink, now), EffectKind::CancelBootstrap);
    d.apply_executor_result(&success(&cancel), now).unwrap();
    one(drive(&mut d, &mut sink, now), EffectKind::DestroyLease);
}

#[test]
fn stream_evidence_of_the_session_answers_a_remembered_ambiguous_start() {
    let mut d = driver();
    let mut sink = RecordingSink::default();
    let start = start_dispatched(&mut d, &mut sink);
    let now = at(0);
    d.apply_executor_result(
        &reply(&start, Err(EffectError::ambiguous("lost reply"))),
        now,
    )
    .unwrap();
    let id = node("g-0");
    assert!(d.state().nodes[&id].retry.ambiguous.is_some());

    // The stream proves the session exists before the backoff ends.
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Joined), at(10))
        .unwrap();
    assert_eq!(
        d.state().nodes[&id].retry.ambiguous,
        None,
        "a stream event of the same attempt answers the ambiguous start"
    );
    assert!(
        drive(&mut d, &mut sink, at(10)).is_empty(),
        "backoff still runs"
    );
    let later = at(60_000);
    let observe = one(
        drive(&mut d, &mut sink, later),
        EffectKind::BootstrapConvergenceObserved,
    );
    d.apply_executor_result(&success(&observe), later).unwrap();
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Closed), later)
        .unwrap();
    assert!(drive(&mut d, &mut sink, later).is_empty());
    assert!(d.is_converged());

    // Teardown goes straight to cleanup: the session closed, so the lease.
    d.update_desired(shape(2, vec![])).unwrap();
    let ops = drive(&mut d, &mut sink, later);
    let kinds: Vec<_> = ops.iter().map(Operation::kind).collect();
    assert_eq!(kinds, vec![EffectKind::DestroyLease]);
}

fn executor_op(seq: u32) -> Operation {
    let spec = LogicalNodeSpec::new(node("g-0"), RunId::new(RUN), Arc::new(template("a")));
    Operation {
        id: OperationId::new(NodeAttemptId::from_raw(1), OperationSequence::from_raw(seq)),
        run_id: RunId::new(RUN),
        node: node("g-0"),
        spec,
        request: EffectRequest::CreateLease,
    }
}

#[test]
fn a_repeat_of_an_older_completed_operation_replays_its_result() {
    let spawner = ManualSpawner::new();
    let exec = IdempotentEffectExecutor::new(
        shared(ScriptedBackend::default()),
        Arc::new(spawner.clone()),
    );
    let first = executor_op(1);
    exec.submit(first.clone()).unwrap();
    let expired = exec.expire(first.id).expect("in flight");
    assert!(
        expired
            .outcome
            .as_ref()
            .is_err_and(EffectError::is_ambiguous)
    );
    spawner.run_all(RunOrder::Fifo);

    let second = executor_op(2);
    exec.submit(second.clone()).unwrap();
    spawner.run_all(RunOrder::Fifo);
    let done = exec.take_results();
    assert_eq!(done.len(), 1);
    assert!(done[0].outcome.is_ok());

    // The older operation is repeated: its result (the timeout) replays.
    assert_eq!(exec.submit(first.clone()), Ok(Submitted::Replayed));
    let replayed = exec.take_results();
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].op, first.id);
    assert_eq!(replayed[0].outcome, expired.outcome);
    // And the newer one replays its success.
    assert_eq!(exec.submit(second.clone()), Ok(Submitted::Replayed));
    assert_eq!(exec.take_results()[0].outcome, done[0].outcome);
    assert_eq!(exec.backend().calls.lock().unwrap().len(), 1);
}

#[test]
fn an_older_operation_that_completed_normally_is_stale_once_a_newer_one_completed() {
    // Its caller received its result before moving on; only an expired
    // operation (whose caller got the timeout) replays after a newer one.
    let spawner = ManualSpawner::new();
    let exec = IdempotentEffectExecutor::new(
        shared(ScriptedBackend::default()),
        Arc::new(spawner.clone()),
    );
    for seq in 1..=2 {
        exec.submit(executor_op(seq)).unwrap();
        spawner.run_all(RunOrder::Fifo);
    }
    exec.take_results();
    let first = executor_op(1);
    assert_eq!(
        exec.submit(first.clone()),
        Err(SubmitError::Stale(first.id))
    );
    assert_eq!(exec.submit(executor_op(2)), Ok(Submitted::Replayed));
}

/// A sink that refuses every operation with its own reason.
struct QuotaSink;

impl OperationSink for QuotaSink {
    fn submit(&mut self, _operation: Operation) -> Result<(), SubmitError> {
        Err(SubmitError::Refused(
            "provider quota of 0 creates reached".into(),
        ))
    }
}

#[test]
fn a_drive_report_counts_refused_submissions_apart_from_dispatched_ones() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 3, "img:1")]))
        .unwrap();
    let report = d.drive_until_blocked(at(0), &mut QuotaSink).unwrap();
    assert_eq!(report.dispatched, 0, "{report:?}");
    assert_eq!(report.refused, 3, "{report:?}");
    assert_eq!(d.counters().dispatched, 0);
    assert_eq!(d.counters().refused, 3);

    let mut sink = RecordingSink::default();
    let later = at(60_000);
    let report = d.drive_until_blocked(later, &mut sink).unwrap();
    assert_eq!((report.dispatched, report.refused), (3, 0), "{report:?}");
}

#[test]
fn a_custom_sink_refusal_reason_reaches_the_nodes_last_error() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    d.drive_until_blocked(at(0), &mut QuotaSink).unwrap();
    let last = d.state().nodes[&node("g-0")].retry.last_error.clone();
    let last = last.expect("a refused submission is a failure");
    assert!(
        last.contains("provider quota of 0 creates reached"),
        "{last}"
    );
}

#[test]
fn an_executor_drives_a_driver_without_a_sink_binding() {
    let spawner = ManualSpawner::new();
    let exec = IdempotentEffectExecutor::new(
        shared(ScriptedBackend::default()),
        Arc::new(spawner.clone()),
    );
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 2, "img:1")]))
        .unwrap();
    let report = exec.drive(&mut d, at(0)).unwrap();
    assert_eq!(report.dispatched, 2);
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(exec.take_results().len(), 2);
}
