//! The driver: revision contract, workqueue semantics, folding and cleanup.

mod common;

use common::*;
use provisioning::decide::NodeAction;
use provisioning::driver::{DesiredUpdate, DriverError, Rejection};
use provisioning::effect::Operation;
use provisioning::id::AttemptAllocator;
use provisioning::observe::LossCause;
use provisioning::state::BootstrapProgress;
use provisioning::{
    BootstrapEvent, ClusterDriver, ClusterState, EffectError, EffectKind, Generation, Intent,
    NodeStage, Observation, RetryPolicy, RunId, Timestamp,
};

fn kinds(ops: &[Operation]) -> Vec<(String, EffectKind)> {
    ops.iter().map(|o| (o.node.to_string(), o.kind())).collect()
}

/// Brings `g` with `count` nodes to convergence at `now` and returns the driver.
fn converged(count: u32) -> (ClusterDriver, RecordingSink) {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", count, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(0));
    assert!(d.is_converged());
    (d, sink)
}

fn drive(d: &mut ClusterDriver, sink: &mut RecordingSink, now: Timestamp) -> Vec<Operation> {
    d.drive_until_blocked(now, sink).unwrap();
    sink.take()
}

// ---- revision contract ----

#[test]
fn update_desired_rejects_a_run_change_and_changes_nothing() {
    let mut d = driver();
    let mut s = shape(1, vec![]);
    s.run_id = RunId::new("other");
    assert!(matches!(
        d.update_desired(s),
        Err(DriverError::RunChanged { .. })
    ));
    assert_eq!(d.desired().generation(), Generation::new(0));
}

#[test]
fn update_desired_rejects_a_generation_regression_and_changes_nothing() {
    let mut d = driver();
    d.update_desired(shape(5, vec![group("g", 1, "a")]))
        .unwrap();
    let err = d.update_desired(shape(4, vec![])).unwrap_err();
    assert_eq!(
        err,
        DriverError::GenerationRegressed {
            current: Generation::new(5),
            got: Generation::new(4)
        }
    );
    assert_eq!(d.desired().node_count(), 1);
}

#[test]
fn update_desired_rejects_changed_content_at_the_same_generation() {
    let mut d = driver();
    d.update_desired(shape(2, vec![group("g", 1, "a")]))
        .unwrap();
    let err = d
        .update_desired(shape(2, vec![group("g", 2, "a")]))
        .unwrap_err();
    assert_eq!(
        err,
        DriverError::ContentChangedWithoutGenerationBump {
            generation: Generation::new(2)
        }
    );
    assert_eq!(d.desired().node_count(), 1);
}

#[test]
fn update_desired_accepts_identical_content_at_the_same_generation_as_a_no_op() {
    let mut d = driver();
    d.update_desired(shape(2, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    assert!(!d.is_queued());
    assert_eq!(
        d.update_desired(shape(2, vec![group("g", 1, "a")])),
        Ok(DesiredUpdate::Unchanged)
    );
    assert!(!d.is_queued(), "a no-op update queues nothing");
}

#[test]
fn update_desired_rejects_an_invalid_shape_and_changes_nothing() {
    let mut d = driver();
    let err = d
        .update_desired(shape(1, vec![group("g", 1, "a"), group("g", 1, "a")]))
        .unwrap_err();
    assert!(matches!(err, DriverError::InvalidShape(_)), "{err}");
    assert_eq!(d.desired().generation(), Generation::new(0));
}

#[test]
fn observed_generation_follows_the_last_evaluated_shape_and_never_decreases() {
    let mut d = driver();
    let mut sink = RecordingSink::default();
    assert_eq!(d.state().observed_generation, None);
    d.update_desired(shape(3, vec![group("g", 1, "a")]))
        .unwrap();
    assert_eq!(d.state().observed_generation, None, "not evaluated yet");
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    assert_eq!(d.state().observed_generation, Some(Generation::new(3)));
    d.update_desired(shape(9, vec![group("g", 1, "a")]))
        .unwrap();
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    assert_eq!(d.state().observed_generation, Some(Generation::new(9)));
    assert!(!d.is_converged(), "observing a generation is not readiness");
}

// ---- workqueue semantics ----

#[test]
fn a_second_pass_while_one_is_open_is_an_error() {
    let mut d = driver();
    let plan = d.begin_pass(at(0)).unwrap();
    assert_eq!(
        d.begin_pass(at(0)).unwrap_err(),
        DriverError::PassInProgress
    );
    let mut sink = RecordingSink::default();
    d.finish_pass(plan, &mut sink).unwrap();
    assert!(d.begin_pass(at(0)).is_ok());
}

#[test]
fn finishing_a_pass_that_was_not_begun_is_an_error() {
    // A plan begun on one driver, finished on another that has no open pass.
    let plan = driver().begin_pass(at(0)).unwrap();
    let mut idle = driver();
    assert_eq!(
        idle.finish_pass(plan, &mut RecordingSink::default())
            .unwrap_err(),
        DriverError::NoPassOpen
    );
}

#[test]
fn facts_are_not_folded_while_a_pass_is_open() {
    let (mut d, _) = converged(1);
    let plan = d.begin_pass(at(1)).unwrap();
    let attempt = d.state().nodes[&node("g-0")].attempt;
    let lost = Observation::NodeLost {
        node: node("g-0"),
        attempt,
        cause: LossCause::AgentGone,
    };
    assert_eq!(
        d.apply_observation(&lost, at(1)),
        Err(DriverError::PassInProgress)
    );
    assert_eq!(
        d.update_desired(shape(2, vec![])),
        Err(DriverError::PassInProgress)
    );
    let mut sink = RecordingSink::default();
    d.finish_pass(plan, &mut sink).unwrap();
    assert!(d.state().nodes[&node("g-0")].is_ready());
}

#[test]
fn a_trigger_during_a_pass_guarantees_exactly_one_more_pass() {
    let (mut d, mut sink) = converged(1);
    assert!(!d.is_queued());
    let plan = d.begin_pass(at(1)).unwrap();
    d.trigger();
    d.trigger();
    d.finish_pass(plan, &mut sink).unwrap();
    assert!(d.is_queued(), "the trigger during the pass queued one more");
    assert!(d.drive_next(at(1), &mut sink).unwrap().is_some());
    assert!(!d.is_queued());
    assert!(
        d.drive_next(at(1), &mut sink).unwrap().is_none(),
        "exactly one"
    );
}

#[test]
fn triggers_while_queued_collapse_into_one_pass() {
    let (mut d, mut sink) = converged(2);
    d.trigger();
    d.trigger();
    d.trigger();
    let report = d.drive_until_blocked(at(1), &mut sink).unwrap();
    assert_eq!(report.passes, 1);
}

#[test]
fn a_refused_submission_is_folded_as_a_definite_failure_and_passes_again() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink {
        refuse: true,
        ..RecordingSink::default()
    };
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert!(n.pending.is_none(), "no unrecorded effect is in flight");
    assert_eq!(n.record.stage, NodeStage::New);
    assert_eq!(n.retry.consecutive_failures, 1);
    assert_eq!(n.retry.next_effect_at, Some(at(1_000)));
    assert!(
        n.retry
            .last_error
            .as_deref()
            .unwrap()
            .contains("submission refused")
    );
    assert_eq!(
        d.counters().dispatched,
        0,
        "a refused operation is not dispatched"
    );
    assert_eq!(d.counters().refused, 1);
}

#[test]
fn every_submitted_operation_is_its_nodes_pending_operation_with_a_stored_deadline() {
    // That it was recorded *before* submission cannot be seen from a sink,
    // which has no access to the driver; the conformance kit checks the order
    // at the backend (G04, with a mutation test that dispatches unrecorded).
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 3, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let ops = drive(&mut d, &mut sink, at(0));
    assert_eq!(ops.len(), 3);
    for op in &ops {
        let n = &d.state().nodes[&op.node];
        assert_eq!(n.pending_op(), Some(op.id));
        assert_eq!(n.pending.as_ref().unwrap().deadline, at(30_000));
    }
}

#[test]
fn a_pass_evaluates_only_touched_and_due_nodes_unless_forced() {
    let (mut d, mut sink) = converged(5);
    let before = d.counters().evaluations;
    let attempt = d.state().nodes[&node("g-3")].attempt;
    d.apply_observation(
        &Observation::NodeLost {
            node: node("g-3"),
            attempt,
            cause: LossCause::AgentGone,
        },
        at(1),
    )
    .unwrap();
    d.drive_next(at(1), &mut sink).unwrap();
    assert_eq!(d.counters().evaluations - before, 1);
    d.trigger();
    d.drive_next(at(1), &mut sink).unwrap();
    assert_eq!(d.counters().evaluations - before, 6);
}

#[test]
fn a_forced_pass_over_a_settled_cluster_changes_nothing() {
    let (mut d, mut sink) = converged(3);
    let state = d.state().clone();
    let requeue = d.requeue_at();
    d.trigger();
    let ops = drive(&mut d, &mut sink, at(5));
    assert!(ops.is_empty());
    assert_eq!(*d.state(), state);
    assert_eq!(d.requeue_at(), requeue);
    assert_eq!(d.requeue_at(), None, "converged means no requeue");
}

// ---- timeouts and deadlines ----

#[test]
fn an_operation_is_due_exactly_at_its_stored_deadline() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let ops = drive(&mut d, &mut sink, at(100));
    let deadline = at(100 + 30_000);
    assert_eq!(d.requeue_at(), Some(deadline));
    assert!(d.pending_operations_due(at(30_099)).is_empty());
    let due = d.pending_operations_due(deadline);
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].op, ops[0].id);
    assert_eq!(
        d.operation_timed_out(&node("g-0"), ops[0].id, at(30_099)),
        Err(DriverError::Rejected(Rejection::NotYetDue {
            op: ops[0].id,
            deadline
        }))
    );
    d.operation_timed_out(&node("g-0"), ops[0].id, deadline)
        .unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert!(n.pending.is_none());
    assert_eq!(
        n.retry.ambiguous.as_ref().map(|a| a.kind),
        Some(EffectKind::CreateLease)
    );
}

#[test]
fn the_same_timeout_reported_twice_changes_nothing() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let ops = drive(&mut d, &mut sink, at(0));
    d.operation_timed_out(&node("g-0"), ops[0].id, at(30_000))
        .unwrap();
    let state = d.state().clone();
    assert!(matches!(
        d.operation_timed_out(&node("g-0"), ops[0].id, at(30_000)),
        Err(DriverError::Rejected(Rejection::NotPending { .. }))
    ));
    assert_eq!(*d.state(), state);
    assert_eq!(d.counters().timeouts, 1);
}

#[test]
fn a_timeout_through_the_executor_result_path_is_the_same_ambiguous_failure() {
    let mut a = driver();
    let mut b = driver();
    let mut sa = RecordingSink::default();
    let mut sb = RecordingSink::default();
    for (d, s) in [(&mut a, &mut sa), (&mut b, &mut sb)] {
        d.update_desired(shape(1, vec![group("g", 1, "a")]))
            .unwrap();
        d.drive_until_blocked(at(0), s).unwrap();
    }
    let op = sa.take().remove(0);
    sb.take();
    a.operation_timed_out(&op.node, op.id, at(30_000)).unwrap();
    b.apply_executor_result(&reply(&op, Err(EffectError::timed_out())), at(30_000))
        .unwrap();
    assert_eq!(a.state(), b.state());
}

#[test]
fn trigger_if_due_queues_a_pass_only_at_a_stored_timer() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let op = drive(&mut d, &mut sink, at(0)).remove(0);
    d.apply_executor_result(&reply(&op, Err(EffectError::definite("quota"))), at(0))
        .unwrap();
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    assert_eq!(d.requeue_at(), Some(at(1_000)));
    assert!(!d.trigger_if_due(at(999)));
    assert!(d.trigger_if_due(at(1_000)));
    let ops = drive(&mut d, &mut sink, at(1_000));
    assert_eq!(kinds(&ops), [("g-0".to_string(), EffectKind::CreateLease)]);
}

// ---- rejected facts ----

#[test]
fn results_of_unknown_nodes_or_operations_are_rejected_and_change_nothing() {
    let (mut d, _) = converged(1);
    let state = d.state().clone();
    let mut sink = RecordingSink::default();
    let mut other = driver();
    other
        .update_desired(shape(1, vec![group("x", 1, "a")]))
        .unwrap();
    let foreign = drive(&mut other, &mut sink, at(0)).remove(0);
    assert!(matches!(
        d.apply_executor_result(&success(&foreign), at(1)),
        Err(DriverError::Rejected(Rejection::UnknownNode(_)))
    ));
    assert_eq!(*d.state(), state);
    assert!(d.counters().rejected >= 1);
}

#[test]
fn a_duplicated_result_is_rejected_the_second_time() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let op = drive(&mut d, &mut sink, at(0)).remove(0);
    d.apply_executor_result(&success(&op), at(1)).unwrap();
    let state = d.state().clone();
    assert!(matches!(
        d.apply_executor_result(&success(&op), at(2)),
        Err(DriverError::Rejected(Rejection::NotPending { .. }))
    ));
    assert_eq!(*d.state(), state);
}

#[test]
fn results_and_facts_of_a_superseded_attempt_change_nothing() {
    let (mut d, mut sink) = converged(1);
    let old = d.state().nodes[&node("g-0")].attempt;
    // Drift the group: the old attempt is torn down and replaced.
    d.update_desired(shape(2, vec![group("g", 1, "img:2")]))
        .unwrap();
    let teardown = converge(&mut d, &mut sink, at(10));
    assert!(d.is_converged());
    let new = d.state().nodes[&node("g-0")].attempt;
    assert_ne!(old, new);
    let old_op = teardown.iter().find(|o| o.attempt() == old).unwrap();
    let state = d.state().clone();
    assert!(matches!(
        d.apply_executor_result(&success(old_op), at(11)),
        Err(DriverError::Rejected(Rejection::StaleAttempt { .. }))
    ));
    for event in [
        BootstrapEvent::Failed {
            failure: provisioning::state::BootstrapFailure::StreamError,
            detail: "late".into(),
        },
        BootstrapEvent::Closed,
    ] {
        let late = Observation::Bootstrap {
            node: node("g-0"),
            attempt: old,
            event,
        };
        assert!(matches!(
            d.apply_observation(&late, at(11)),
            Err(DriverError::Rejected(Rejection::StaleAttempt { .. }))
        ));
    }
    let lost = Observation::NodeLost {
        node: node("g-0"),
        attempt: old,
        cause: LossCause::LeaseGone,
    };
    assert!(d.apply_observation(&lost, at(11)).is_err());
    assert_eq!(*d.state(), state);
}

#[test]
fn bootstrap_events_without_a_session_are_rejected() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let op = drive(&mut d, &mut sink, at(0)).remove(0);
    let early = bootstrap(&op, BootstrapEvent::Joined);
    assert!(matches!(
        d.apply_observation(&early, at(0)),
        Err(DriverError::Rejected(Rejection::Bootstrap { .. }))
    ));
}

#[test]
fn stream_events_before_the_start_result_are_kept() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let mut start = None;
    for _ in 0..3 {
        for op in drive(&mut d, &mut sink, at(0)) {
            if op.kind() == EffectKind::StartBootstrap {
                start = Some(op);
            } else {
                d.apply_executor_result(&success(&op), at(0)).unwrap();
            }
        }
    }
    let start = start.expect("bootstrap started");
    d.apply_observation(
        &bootstrap(
            &start,
            BootstrapEvent::Progress(BootstrapProgress::Connected),
        ),
        at(1),
    )
    .unwrap();
    d.apply_observation(&bootstrap(&start, BootstrapEvent::Joined), at(1))
        .unwrap();
    d.apply_executor_result(&success(&start), at(2)).unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert_eq!(n.record.stage, NodeStage::SwarmJoined);
    assert!(n.record.session_active());
    assert!(n.record.bootstrap.as_ref().unwrap().session.is_some());
}

// ---- failure classification (design §6) ----

fn fresh_until(kind: EffectKind) -> (ClusterDriver, RecordingSink, Operation) {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    for _ in 0..8 {
        for op in drive(&mut d, &mut sink, at(0)) {
            if op.kind() == kind {
                return (d, sink, op);
            }
            d.apply_executor_result(&success(&op), at(0)).unwrap();
            if op.kind() == EffectKind::StartBootstrap {
                d.apply_observation(&bootstrap(&op, BootstrapEvent::Joined), at(0))
                    .unwrap();
            }
        }
    }
    panic!("{kind} was never dispatched");
}

#[test]
fn classification_definite_create_failure_keeps_nothing_and_retries_after_backoff() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::CreateLease);
    d.apply_executor_result(
        &reply(&op, Err(EffectError::definite("no capacity"))),
        at(0),
    )
    .unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert!(n.record.lease.is_none() && n.retry.ambiguous.is_none());
    assert_eq!(n.retry.next_effect_at, Some(at(1_000)));
    assert!(drive(&mut d, &mut sink, at(999)).is_empty());
    assert_eq!(
        kinds(&drive(&mut d, &mut sink, at(1_000))),
        [("g-0".into(), EffectKind::CreateLease)]
    );
}

#[test]
fn classification_endpoint_not_ready_is_a_probe_not_a_failure() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::LookupEndpoint);
    let not_ready = provisioning::EffectOutput::Endpoint(provisioning::EndpointLookup::NotReady);
    d.apply_executor_result(&reply(&op, Ok(not_ready)), at(0))
        .unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert_eq!(n.retry.consecutive_failures, 0);
    assert!(n.record.lease.is_some());
    assert_eq!(
        n.retry.next_effect_at,
        Some(at(d.policy().endpoint_probe_interval.as_millis() as u64))
    );
    assert_eq!(
        kinds(&drive(&mut d, &mut sink, at(1_000))),
        [("g-0".into(), EffectKind::LookupEndpoint)]
    );
}

#[test]
fn classification_endpoint_lookup_error_keeps_the_lease_and_retries_after_backoff() {
    let (mut d, _, op) = fresh_until(EffectKind::LookupEndpoint);
    d.apply_executor_result(&reply(&op, Err(EffectError::definite("api down"))), at(0))
        .unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert!(n.record.lease.is_some());
    assert_eq!(n.retry.consecutive_failures, 1);
    assert_eq!(n.retry.next_effect_at, Some(at(1_000)));
    assert_eq!(n.intent, Intent::Active);
}

#[test]
fn classification_definite_start_failure_fails_the_attempt_and_cleans_up_at_once() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::StartBootstrap);
    d.apply_executor_result(
        &reply(&op, Err(EffectError::definite("ssh refused"))),
        at(0),
    )
    .unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert_eq!(n.record.stage, NodeStage::Failed);
    assert!(n.record.lease.is_some(), "facts are kept for cleanup");
    assert_eq!(n.retry.restart_at, Some(at(1_000)));
    // Next pass: begin delete; the one after: destroy the lease, without waiting.
    let ops = drive(&mut d, &mut sink, at(0));
    assert_eq!(kinds(&ops), [("g-0".into(), EffectKind::DestroyLease)]);
    d.apply_executor_result(&success(&ops[0]), at(0)).unwrap();
    drive(&mut d, &mut sink, at(0));
    let n = &d.state().nodes[&node("g-0")];
    assert_eq!(n.record.stage, NodeStage::Destroyed, "the restart waits");
    let ops = drive(&mut d, &mut sink, at(1_000));
    assert_eq!(kinds(&ops), [("g-0".into(), EffectKind::CreateLease)]);
    assert_ne!(ops[0].attempt(), op.attempt());
}

#[test]
fn classification_bootstrap_runtime_and_join_failures_fail_the_attempt() {
    for failure in provisioning::state::BootstrapFailure::ALL {
        let (mut d, _, op) = fresh_until(EffectKind::StartBootstrap);
        d.apply_executor_result(&success(&op), at(0)).unwrap();
        let event = BootstrapEvent::Failed {
            failure,
            detail: "boom".into(),
        };
        d.apply_observation(&bootstrap(&op, event), at(0)).unwrap();
        let n = &d.state().nodes[&node("g-0")];
        assert_eq!(n.record.stage, NodeStage::Failed, "{failure:?}");
        // The operator reads the failed stage in words, not a Rust name.
        let error = n.retry.last_error.as_deref().unwrap_or_default();
        assert_eq!(error, format!("bootstrap failed: {failure}: boom"));
        assert!(!error.contains(&format!("{failure:?}")), "{error}");
        assert!(
            n.record.session_active(),
            "the session is cancelled by cleanup"
        );
        assert_eq!(n.retry.restart_at, Some(at(1_000)));
    }
}

/// Brings a node to the first cleanup step of `kind` on scale-down to zero.
fn deleting_until(kind: EffectKind) -> (ClusterDriver, RecordingSink, Operation) {
    let (mut d, mut sink, start) = fresh_until(EffectKind::StartBootstrap);
    d.apply_executor_result(&success(&start), at(0)).unwrap();
    if kind == EffectKind::DestroyLease {
        // A session that closed after the join needs no cancel.
        d.apply_observation(&bootstrap(&start, BootstrapEvent::Joined), at(0))
            .unwrap();
        d.apply_observation(&bootstrap(&start, BootstrapEvent::Closed), at(0))
            .unwrap();
    }
    d.update_desired(shape(2, vec![])).unwrap();
    let mut ops = drive(&mut d, &mut sink, at(0));
    assert_eq!(kinds(&ops), [("g-0".into(), kind)]);
    (d, sink, ops.remove(0))
}

#[test]
fn classification_a_failed_cleanup_step_stays_deleting_keeps_facts_and_retries_after_backoff() {
    for kind in [EffectKind::CancelBootstrap, EffectKind::DestroyLease] {
        for error in [EffectError::definite("x"), EffectError::ambiguous("x")] {
            let (mut d, mut sink, op) = deleting_until(kind);
            let before = d.state().nodes[&node("g-0")].record.clone();
            d.apply_executor_result(&reply(&op, Err(error)), at(0))
                .unwrap();
            let n = &d.state().nodes[&node("g-0")];
            assert_eq!(n.intent, Intent::Deleting);
            assert_eq!(
                n.record.lease, before.lease,
                "G07: facts kept until absence is confirmed"
            );
            assert_eq!(n.record.session_active(), before.session_active());
            assert_eq!(n.retry.next_effect_at, Some(at(1_000)));
            assert!(drive(&mut d, &mut sink, at(999)).is_empty());
            assert_eq!(
                kinds(&drive(&mut d, &mut sink, at(1_000))),
                [("g-0".into(), kind)]
            );
        }
    }
}

#[test]
fn classification_ambiguous_create_is_reissued_before_any_destructive_step() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::CreateLease);
    d.apply_executor_result(
        &reply(&op, Err(EffectError::ambiguous("lost reply"))),
        at(0),
    )
    .unwrap();
    // Scale to zero: the node is deleting, but the create is re-issued first.
    d.update_desired(shape(2, vec![])).unwrap();
    assert!(drive(&mut d, &mut sink, at(0)).is_empty(), "backoff first");
    let ops = drive(&mut d, &mut sink, at(1_000));
    assert_eq!(kinds(&ops), [("g-0".into(), EffectKind::CreateLease)]);
    assert_eq!(
        ops[0].attempt(),
        op.attempt(),
        "the same attempt: the backend adopts"
    );
    d.apply_executor_result(&success(&ops[0]), at(1_000))
        .unwrap();
    let ops = drive(&mut d, &mut sink, at(1_000));
    assert_eq!(kinds(&ops), [("g-0".into(), EffectKind::DestroyLease)]);
}

#[test]
fn classification_ambiguous_start_keeps_the_attempt_and_reissues_the_start() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::StartBootstrap);
    d.apply_executor_result(&reply(&op, Err(EffectError::timed_out())), at(0))
        .unwrap();
    let n = &d.state().nodes[&node("g-0")];
    assert_ne!(n.record.stage, NodeStage::Failed);
    let ops = drive(&mut d, &mut sink, at(1_000));
    assert_eq!(kinds(&ops), [("g-0".into(), EffectKind::StartBootstrap)]);
    assert_eq!(ops[0].attempt(), op.attempt());
}

#[test]
fn a_late_endpoint_failure_on_a_deleting_node_lets_cleanup_proceed_at_once() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::LookupEndpoint);
    d.update_desired(shape(2, vec![])).unwrap();
    drive(&mut d, &mut sink, at(0)); // begin delete; lookup still pending
    d.apply_executor_result(&reply(&op, Err(EffectError::definite("x"))), at(0))
        .unwrap();
    assert_eq!(d.state().nodes[&node("g-0")].retry.next_effect_at, None);
    let ops = drive(&mut d, &mut sink, at(0));
    assert_eq!(kinds(&ops), [("g-0".into(), EffectKind::DestroyLease)]);
}

#[test]
fn reaching_ready_resets_the_failure_count_and_a_replacement_inherits_it() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::CreateLease);
    d.apply_executor_result(&reply(&op, Err(EffectError::definite("x"))), at(0))
        .unwrap();
    assert_eq!(d.state().nodes[&node("g-0")].retry.consecutive_failures, 1);
    converge(&mut d, &mut sink, at(1_000));
    assert!(d.is_converged());
    assert_eq!(d.state().nodes[&node("g-0")].retry.consecutive_failures, 0);

    let (mut d, mut sink, op) = fresh_until(EffectKind::StartBootstrap);
    d.apply_executor_result(&reply(&op, Err(EffectError::definite("x"))), at(0))
        .unwrap();
    let ops = drive(&mut d, &mut sink, at(0));
    d.apply_executor_result(&success(&ops[0]), at(0)).unwrap();
    drive(&mut d, &mut sink, at(1_000));
    let n = &d.state().nodes[&node("g-0")];
    assert_ne!(n.attempt, op.attempt());
    assert_eq!(
        n.retry.consecutive_failures, 1,
        "carried into the replacement"
    );
}

// ---- lifecycle ----

#[test]
fn bring_up_dispatches_the_healthy_ladder_in_order() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let ops = converge(&mut d, &mut sink, at(0));
    let order: Vec<EffectKind> = ops.iter().map(Operation::kind).collect();
    assert_eq!(
        order,
        [
            EffectKind::CreateLease,
            EffectKind::LookupEndpoint,
            EffectKind::StartBootstrap,
            EffectKind::BootstrapConvergenceObserved
        ]
    );
    let n = &d.state().nodes[&node("g-0")];
    assert_eq!(n.record.stage, NodeStage::Dormant);
    assert!(n.is_ready());
}

#[test]
fn convergence_observed_is_dispatched_at_most_once_per_session() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::BootstrapConvergenceObserved);
    d.apply_executor_result(&success(&op), at(0)).unwrap();
    d.trigger();
    assert!(drive(&mut d, &mut sink, at(0)).is_empty());
    assert!(!d.is_converged(), "waits for the session to close");
    let close = bootstrap(&op, BootstrapEvent::Closed);
    d.apply_observation(&close, at(0)).unwrap();
    assert!(d.is_converged());
}

#[test]
fn a_session_closing_before_any_join_fails_the_attempt() {
    let (mut d, _, op) = fresh_until(EffectKind::StartBootstrap);
    d.apply_executor_result(&success(&op), at(0)).unwrap();
    d.apply_observation(&bootstrap(&op, BootstrapEvent::Closed), at(0))
        .unwrap();
    assert_eq!(
        d.state().nodes[&node("g-0")].record.stage,
        NodeStage::Failed
    );
}

#[test]
fn scale_down_removes_the_highest_indices() {
    let (mut d, mut sink) = converged(4);
    d.update_desired(shape(2, vec![group("g", 2, "img:1")]))
        .unwrap();
    let ops = drive(&mut d, &mut sink, at(1));
    let mut nodes: Vec<String> = ops.iter().map(|o| o.node.to_string()).collect();
    nodes.sort();
    assert_eq!(nodes, ["g-2", "g-3"]);
    for op in &ops {
        d.apply_executor_result(&success(op), at(1)).unwrap();
    }
    converge(&mut d, &mut sink, at(1));
    let left: Vec<String> = d.state().nodes.keys().map(ToString::to_string).collect();
    assert_eq!(left, ["g-0", "g-1"]);
    assert!(d.is_converged());
}

#[test]
fn cleanup_runs_cancel_then_destroy_then_mark_destroyed_then_reap() {
    let (mut d, mut sink, op) = fresh_until(EffectKind::StartBootstrap);
    d.apply_executor_result(&success(&op), at(0)).unwrap();
    d.update_desired(shape(2, vec![])).unwrap();
    let mut steps = Vec::new();
    for _ in 0..10 {
        let plan = d.begin_pass(at(0)).unwrap();
        steps.extend(plan.decisions().iter().map(|(_, dec)| dec.action));
        d.finish_pass(plan, &mut sink).unwrap();
        for op in sink.take() {
            d.apply_executor_result(&success(&op), at(0)).unwrap();
        }
        if d.state().nodes.is_empty() {
            break;
        }
    }
    steps.retain(|a| *a != NodeAction::None);
    assert_eq!(
        steps,
        [
            NodeAction::BeginDelete,
            NodeAction::Dispatch(EffectKind::CancelBootstrap),
            NodeAction::Dispatch(EffectKind::DestroyLease),
            NodeAction::MarkDestroyed,
            NodeAction::Reap
        ]
    );
    assert_eq!(sink.retired, [op.attempt()]);
}

#[test]
fn re_adding_a_deleting_slot_never_resurrects_the_old_attempt() {
    let (mut d, mut sink) = converged(1);
    let old = d.state().nodes[&node("g-0")].attempt;
    d.update_desired(shape(2, vec![])).unwrap();
    let destroy = drive(&mut d, &mut sink, at(1));
    assert_eq!(kinds(&destroy), [("g-0".into(), EffectKind::DestroyLease)]);
    d.update_desired(shape(3, vec![group("g", 1, "img:1")]))
        .unwrap();
    d.trigger();
    assert!(
        drive(&mut d, &mut sink, at(1)).is_empty(),
        "still deleting, destroy pending"
    );
    assert_eq!(d.state().nodes[&node("g-0")].intent, Intent::Deleting);
    d.apply_executor_result(&success(&destroy[0]), at(1))
        .unwrap();
    let ops = converge(&mut d, &mut sink, at(1));
    assert!(d.is_converged());
    assert!(ops.iter().all(|o| o.attempt() != old));
    assert_ne!(d.state().nodes[&node("g-0")].attempt, old);
}

#[test]
fn loss_of_a_ready_node_fails_the_attempt_and_the_slot_is_rebuilt() {
    let (mut d, mut sink) = converged(2);
    let old = d.state().nodes[&node("g-1")].attempt;
    let lost = Observation::NodeLost {
        node: node("g-1"),
        attempt: old,
        cause: LossCause::AgentGone,
    };
    d.apply_observation(&lost, at(5)).unwrap();
    assert!(!d.is_converged());
    let n = &d.state().nodes[&node("g-1")];
    assert_eq!(n.record.stage, NodeStage::Failed);
    assert!(!n.record.ready);
    let ops = converge(&mut d, &mut sink, at(1_005));
    assert_eq!(ops[0].kind(), EffectKind::DestroyLease);
    assert!(d.is_converged());
    assert_ne!(d.state().nodes[&node("g-1")].attempt, old);
}

#[test]
fn loss_of_a_node_being_deleted_changes_nothing() {
    let (mut d, mut sink) = converged(1);
    d.update_desired(shape(2, vec![])).unwrap();
    drive(&mut d, &mut sink, at(1));
    let state = d.state().clone();
    let attempt = state.nodes[&node("g-0")].attempt;
    d.apply_observation(
        &Observation::NodeLost {
            node: node("g-0"),
            attempt,
            cause: LossCause::AgentGone,
        },
        at(2),
    )
    .unwrap();
    assert_eq!(*d.state(), state);
}

// ---- convergence predicate ----

#[test]
fn convergence_requires_every_desired_slot_ready_with_the_desired_spec_and_nothing_else() {
    let d = driver();
    assert!(!d.is_converged(), "the empty shape is not evaluated yet");
    let mut d = driver();
    let mut sink = RecordingSink::default();
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    assert!(d.is_converged(), "the evaluated empty shape is converged");

    let (mut d, mut sink) = converged(2);
    d.update_desired(shape(2, vec![group("g", 2, "img:2")]))
        .unwrap();
    assert!(!d.is_converged(), "drifted spec");
    converge(&mut d, &mut sink, at(1));
    assert!(d.is_converged());

    let (mut d, _) = converged(2);
    d.update_desired(shape(2, vec![group("g", 1, "img:1")]))
        .unwrap();
    d.drive_until_blocked(at(1), &mut RecordingSink::default())
        .unwrap();
    assert!(!d.is_converged(), "an undesired node remains");

    let (mut d, mut sink) = converged(1);
    d.update_desired(shape(
        2,
        vec![group("g", 1, "img:1"), group("h", 1, "img:1")],
    ))
    .unwrap();
    d.drive_until_blocked(at(1), &mut sink).unwrap();
    assert!(!d.is_converged(), "a desired slot has no ready node");
}

// ---- exhaustion and saturation ----

#[test]
fn attempt_exhaustion_is_an_error_and_leaves_the_slot_untouched() {
    let desired = shape(1, vec![group("g", 2, "a")]).validate().unwrap();
    let state = ClusterState {
        attempts: AttemptAllocator::with_limit(10, 11),
        ..ClusterState::default()
    };
    let mut d = ClusterDriver::with_state(desired, state, RetryPolicy::default());
    let mut sink = RecordingSink::default();
    let err = d.drive_until_blocked(at(0), &mut sink).unwrap_err();
    match err {
        DriverError::NodeErrors(errors) => {
            assert_eq!(errors.len(), 1);
            assert_eq!(errors[0].0, node("g-1"));
        }
        other => panic!("unexpected {other}"),
    }
    assert_eq!(d.state().nodes.len(), 1, "g-0 got the last attempt id");
}

#[test]
fn operation_sequence_exhaustion_is_an_error_not_a_dispatch() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    // Rebuild the state with the node's sequence at its maximum.
    let mut state = d.state().clone();
    let n = state.nodes.get_mut(&node("g-0")).unwrap();
    n.pending = None;
    n.next_sequence = provisioning::id::OperationSequence::from_raw(u32::MAX);
    let mut d = ClusterDriver::with_state(d.desired().clone(), state, RetryPolicy::default());
    sink.take();
    let err = d.drive_until_blocked(at(0), &mut sink).unwrap_err();
    assert!(err.to_string().contains("sequence"), "{err}");
    assert!(sink.submitted.is_empty());
    assert!(d.state().nodes[&node("g-0")].pending.is_none());
}

#[test]
fn time_near_the_end_of_the_clock_yields_errors_not_panics() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "a")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let late = Timestamp::from_millis(u64::MAX - 10);
    d.drive_until_blocked(late, &mut sink).unwrap_err();
    assert!(sink.submitted.is_empty(), "no deadline, no dispatch");
    assert_eq!(
        d.requeue_at(),
        Some(Timestamp::MAX),
        "retried later, not spun on"
    );
    // Folding with a saturated clock is an error that changes nothing.
    d.trigger();
    let op = drive(&mut d, &mut sink, at(0)).remove(0);
    let state = d.state().clone();
    let err = d
        .apply_executor_result(&reply(&op, Err(EffectError::definite("x"))), late)
        .unwrap_err();
    assert!(matches!(err, DriverError::Clock(_)), "{err}");
    assert_eq!(*d.state(), state);
    assert!(d.pending_operations_due(Timestamp::MAX).len() == 1);
    d.trigger_if_due(Timestamp::MAX);
}

#[test]
fn an_incremental_pass_decides_a_node_once_however_often_it_was_touched() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let start = started(&mut d, &mut sink, at(0));
    d.drive_until_blocked(at(0), &mut sink).unwrap();
    sink.take();
    // Thousands of facts that each change the node, between two passes.
    for i in 0..3_000 {
        let progress = if i % 2 == 0 {
            BootstrapProgress::Connecting
        } else {
            BootstrapProgress::Connected
        };
        d.apply_observation(
            &bootstrap(&start, BootstrapEvent::Progress(progress)),
            at(0),
        )
        .unwrap();
    }
    let plan = d.begin_pass(at(0)).unwrap();
    assert!(!plan.is_full());
    assert_eq!(plan.evaluated(), 1);
    assert_eq!(plan.decisions().len(), 1, "{:?}", plan.decisions());
    d.finish_pass(plan, &mut sink).unwrap();
}
