//! The idempotent executor's ledger rules (design §8).

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use futures_channel::oneshot;
use provisioning::driver::SubmitError;
use provisioning::effect::EffectRequest;
use provisioning::executor::{EffectBackend, Submitted};
use provisioning::id::OperationSequence;
use provisioning::spawn::BoxFuture;
use provisioning::{
    Disposition, EffectError, EffectKind, EffectOutput, ExecutorResult, IdempotentEffectExecutor,
    LogicalNodeSpec, ManualSpawner, NodeAttemptId, Operation, OperationId, RunId, RunOrder,
};

/// A backend whose calls can be held until released, that counts live
/// instances and concurrent calls per attempt.
#[derive(Default)]
struct GatedBackend {
    holds: Mutex<BTreeMap<OperationId, oneshot::Receiver<()>>>,
    calls: Mutex<Vec<OperationId>>,
    running: Mutex<BTreeMap<NodeAttemptId, usize>>,
    max_concurrent: AtomicUsize,
    panic_on: Mutex<Option<OperationId>>,
    dropped: Option<Arc<AtomicUsize>>,
}

impl Drop for GatedBackend {
    fn drop(&mut self) {
        if let Some(d) = &self.dropped {
            d.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl GatedBackend {
    fn hold(&self, op: OperationId) -> oneshot::Sender<()> {
        let (tx, rx) = oneshot::channel();
        self.holds.lock().unwrap().insert(op, rx);
        tx
    }
}

impl EffectBackend for GatedBackend {
    fn execute<'a>(
        &'a self,
        op: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(async move {
            self.calls.lock().unwrap().push(op.id);
            let now = {
                let mut running = self.running.lock().unwrap();
                let n = running.entry(op.attempt()).or_default();
                *n += 1;
                *n
            };
            self.max_concurrent.fetch_max(now, Ordering::SeqCst);
            let hold = self.holds.lock().unwrap().remove(&op.id);
            if let Some(hold) = hold {
                let _ = hold.await;
            }
            *self.running.lock().unwrap().get_mut(&op.attempt()).unwrap() -= 1;
            if *self.panic_on.lock().unwrap() == Some(op.id) {
                panic!("backend bug");
            }
            success(op).outcome
        })
    }
}

fn op(attempt: u64, seq: u32, request: EffectRequest) -> Operation {
    let spec = LogicalNodeSpec::new(node("g-0"), RunId::new(RUN), Arc::new(template("a")));
    Operation {
        id: OperationId::new(
            NodeAttemptId::from_raw(attempt),
            OperationSequence::from_raw(seq),
        ),
        run_id: RunId::new(RUN),
        node: node("g-0"),
        spec,
        request,
    }
}

fn create(attempt: u64, seq: u32) -> Operation {
    op(attempt, seq, EffectRequest::CreateLease)
}

fn setup() -> (IdempotentEffectExecutor<GatedBackend>, ManualSpawner) {
    let spawner = ManualSpawner::new();
    let exec =
        IdempotentEffectExecutor::new(Arc::new(GatedBackend::default()), Arc::new(spawner.clone()));
    (exec, spawner)
}

/// An executor whose `create(1, 1)` expired while its backend call is still
/// held; the sender releases the call, the result is the expiry's.
fn expired_while_running() -> (
    IdempotentEffectExecutor<GatedBackend>,
    ManualSpawner,
    oneshot::Sender<()>,
    ExecutorResult,
) {
    let (exec, spawner) = setup();
    let release = exec.backend().hold(create(1, 1).id);
    exec.submit(create(1, 1)).unwrap();
    spawner.run_all(RunOrder::Fifo);
    let timeout = exec.expire(create(1, 1).id).expect("in flight");
    (exec, spawner, release, timeout)
}

#[test]
fn a_completed_operation_submitted_again_replays_its_result_without_running_again() {
    let (exec, spawner) = setup();
    assert_eq!(exec.submit(create(1, 1)), Ok(Submitted::Started));
    spawner.run_all(RunOrder::Fifo);
    let first = exec.take_results();
    assert_eq!(first.len(), 1);
    assert_eq!(exec.submit(create(1, 1)), Ok(Submitted::Replayed));
    assert_eq!(spawner.run_all(RunOrder::Fifo), 0, "nothing new to run");
    assert_eq!(exec.take_results(), first);
    assert_eq!(exec.backend().calls.lock().unwrap().len(), 1);
    assert_eq!(exec.counters().replayed, 1);
}

#[test]
fn an_operation_submitted_twice_while_running_runs_once() {
    let (exec, spawner) = setup();
    exec.submit(create(1, 1)).unwrap();
    assert_eq!(exec.submit(create(1, 1)), Ok(Submitted::AlreadyRunning));
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(exec.take_results().len(), 1);
    assert_eq!(exec.backend().calls.lock().unwrap().len(), 1);
}

#[test]
fn reusing_an_operation_id_with_a_different_input_is_refused() {
    let (exec, spawner) = setup();
    exec.submit(create(1, 1)).unwrap();
    let other = op(
        1,
        1,
        EffectRequest::DestroyLease {
            lease: provisioning::LeaseHandle("x".into()),
        },
    );
    assert_eq!(
        exec.submit(other.clone()),
        Err(SubmitError::ConflictingInput(other.id))
    );
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(
        exec.submit(other.clone()),
        Err(SubmitError::ConflictingInput(other.id))
    );
}

#[test]
fn an_operation_older_than_one_already_submitted_for_its_attempt_is_refused() {
    let (exec, spawner) = setup();
    exec.submit(create(1, 2)).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(
        exec.submit(create(1, 1)),
        Err(SubmitError::Stale(create(1, 1).id))
    );
}

#[test]
fn a_new_operation_waits_behind_an_expired_one_that_is_still_running() {
    let (exec, spawner, release, timeout) = expired_while_running();
    assert_eq!(
        timeout.outcome.unwrap_err().disposition,
        Disposition::Ambiguous
    );
    assert_eq!(exec.submit(create(1, 2)), Ok(Submitted::Queued));
    spawner.run_all(RunOrder::Lifo);
    assert_eq!(
        exec.backend().calls.lock().unwrap().len(),
        1,
        "the new one waits"
    );
    release.send(()).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(
        *exec.backend().calls.lock().unwrap(),
        [create(1, 1).id, create(1, 2).id]
    );
    assert_eq!(
        exec.backend().max_concurrent.load(Ordering::SeqCst),
        1,
        "one running per attempt"
    );
    let results = exec.take_results();
    assert_eq!(
        results.len(),
        1,
        "the late result of the expired operation is dropped"
    );
    assert_eq!(results[0].op, create(1, 2).id);
    assert_eq!(exec.counters().late_dropped, 1);
}

#[test]
fn operations_of_different_attempts_run_concurrently() {
    let (exec, spawner) = setup();
    let r1 = exec.backend().hold(create(1, 1).id);
    let r2 = exec.backend().hold(create(2, 1).id);
    exec.submit(create(1, 1)).unwrap();
    exec.submit(create(2, 1)).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(exec.backend().calls.lock().unwrap().len(), 2);
    r1.send(()).unwrap();
    r2.send(()).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(exec.take_results().len(), 2);
}

#[test]
fn a_backend_panic_becomes_a_definite_error() {
    let (exec, spawner) = setup();
    *exec.backend().panic_on.lock().unwrap() = Some(create(1, 1).id);
    exec.submit(create(1, 1)).unwrap();
    spawner.run_all(RunOrder::Fifo);
    let results = exec.take_results();
    let error = results[0].outcome.clone().unwrap_err();
    assert_eq!(error.disposition, Disposition::Definite);
    assert!(error.message.contains("backend bug"), "{}", error.message);
    assert_eq!(exec.counters().panics, 1);
    // The executor keeps working.
    exec.submit(create(1, 2)).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert!(exec.take_results()[0].outcome.is_ok());
}

#[test]
fn expiry_is_ambiguous_reported_once_and_the_late_completion_is_dropped() {
    let (exec, spawner) = setup();
    let release = exec.backend().hold(create(1, 1).id);
    exec.submit(create(1, 1)).unwrap();
    spawner.run_all(RunOrder::Fifo);
    let expired = exec.expire(create(1, 1).id).unwrap();
    assert_eq!(expired.kind, EffectKind::CreateLease);
    assert!(expired.outcome.unwrap_err().is_ambiguous());
    assert_eq!(
        exec.expire(create(1, 1).id),
        None,
        "expiring twice reports once"
    );
    release.send(()).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert!(exec.take_results().is_empty());
    assert!(!exec.has_work());
    assert_eq!(
        exec.expire(create(9, 1).id),
        None,
        "unknown operations are not in flight"
    );
}

#[test]
fn expiring_a_waiting_operation_means_it_never_runs() {
    let (exec, spawner, release, _) = expired_while_running();
    exec.submit(create(1, 2)).unwrap();
    assert!(exec.expire(create(1, 2).id).is_some());
    release.send(()).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(*exec.backend().calls.lock().unwrap(), [create(1, 1).id]);
    assert!(exec.take_results().is_empty());
    assert_eq!(
        exec.counters().skipped,
        1,
        "it expired before its call started"
    );
    assert_eq!(exec.counters().expired, 2);
}

#[test]
fn a_waiting_operation_replaced_by_a_newer_one_never_runs_and_counts_as_skipped() {
    let (exec, spawner, release, _) = expired_while_running();
    assert_eq!(exec.submit(create(1, 2)), Ok(Submitted::Queued));
    assert_eq!(exec.submit(create(1, 3)), Ok(Submitted::Queued));
    release.send(()).unwrap();
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(
        *exec.backend().calls.lock().unwrap(),
        [create(1, 1).id, create(1, 3).id]
    );
    let results = exec.take_results();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].op, create(1, 3).id);
    let counters = exec.counters();
    assert_eq!((counters.skipped, counters.waited), (1, 2));
}

#[test]
fn dropping_the_executor_with_queued_work_drops_the_backend() {
    let dropped = Arc::new(AtomicUsize::new(0));
    let spawner = ManualSpawner::new();
    let mut backend = GatedBackend::default();
    backend.dropped = Some(dropped.clone());
    let exec = IdempotentEffectExecutor::new(Arc::new(backend), Arc::new(spawner.clone()));
    for attempt in 1..=3 {
        exec.submit(create(attempt, 1)).unwrap();
    }
    assert_eq!(spawner.len(), 3);
    drop(exec);
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "the queued tasks hold no strong handle"
    );
    // The queued tasks then run to nothing.
    spawner.run_all(RunOrder::Fifo);
    assert!(spawner.is_empty());
}

#[test]
fn dropping_the_spawner_and_executor_with_parked_work_drops_the_backend() {
    let dropped = Arc::new(AtomicUsize::new(0));
    let spawner = ManualSpawner::new();
    let mut backend = GatedBackend::default();
    backend.dropped = Some(dropped.clone());
    let exec = IdempotentEffectExecutor::new(Arc::new(backend), Arc::new(spawner.clone()));
    let _release = exec.backend().hold(create(1, 1).id);
    exec.submit(create(1, 1)).unwrap();
    spawner.run_all(RunOrder::Fifo);
    drop(exec);
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        0,
        "a started call keeps its backend"
    );
    drop(spawner);
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
}

#[test]
fn a_closed_executor_refuses_work() {
    let (exec, _) = setup();
    exec.close();
    assert_eq!(exec.submit(create(1, 1)), Err(SubmitError::Closed));
}

#[test]
fn retiring_an_attempt_releases_its_ledger_once_idle() {
    let (exec, spawner) = setup();
    exec.submit(create(1, 1)).unwrap();
    exec.retire(NodeAttemptId::from_raw(1));
    spawner.run_all(RunOrder::Fifo);
    exec.take_results();
    // Bookkeeping is gone: the same id runs again instead of replaying.
    assert_eq!(exec.submit(create(1, 1)), Ok(Submitted::Started));
}

#[test]
fn the_driver_over_the_executor_converges_whatever_order_work_runs_in() {
    for order in [RunOrder::Fifo, RunOrder::Lifo] {
        let spawner = ManualSpawner::new();
        let mut exec = IdempotentEffectExecutor::new(
            Arc::new(ScriptedBackend::default()),
            Arc::new(spawner.clone()),
        );
        let mut d = driver();
        d.update_desired(shape(1, vec![group("g", 3, "a")]))
            .unwrap();
        for _ in 0..32 {
            d.drive_until_blocked(at(0), &mut exec).unwrap();
            spawner.run_all(order);
            let results = exec.take_results();
            if results.is_empty() {
                break;
            }
            for r in results {
                d.apply_executor_result(&r, at(0)).unwrap();
                let event = match r.kind {
                    EffectKind::StartBootstrap => provisioning::BootstrapEvent::Joined,
                    EffectKind::BootstrapConvergenceObserved => {
                        provisioning::BootstrapEvent::Closed
                    }
                    _ => continue,
                };
                let obs = provisioning::Observation::Bootstrap {
                    node: r.node.clone(),
                    attempt: r.op.attempt(),
                    event,
                };
                d.apply_observation(&obs, at(0)).unwrap();
            }
        }
        assert!(d.is_converged(), "{order:?}");
        assert_eq!(exec.backend().calls.lock().unwrap().len(), 12);
    }
}

#[test]
fn an_operation_that_expired_before_it_started_never_reaches_the_backend() {
    let (exec, spawner) = setup();
    exec.submit(create(1, 1)).unwrap();
    assert!(exec.expire(create(1, 1).id).is_some());
    spawner.run_all(RunOrder::Fifo);
    assert!(exec.backend().calls.lock().unwrap().is_empty());
    assert!(
        exec.take_results().is_empty(),
        "its timeout was already reported"
    );
    assert_eq!(exec.counters().skipped, 1);
    assert!(!exec.has_work());
    // The attempt is free for the next operation.
    assert_eq!(exec.submit(create(1, 2)), Ok(Submitted::Started));
}

#[test]
fn every_kind_of_outcome_replays_as_first_reported_and_a_changed_input_is_refused() {
    // The ledger keeps payload-free outcomes without their payload and the
    // others boxed: each must replay exactly as it was first reported.
    let lease = provisioning::LeaseHandle("l".into());
    let session = Some(provisioning::SessionHandle("s".into()));
    let requests = [
        EffectRequest::CreateLease,
        EffectRequest::LookupEndpoint {
            lease: lease.clone(),
        },
        EffectRequest::StartBootstrap {
            lease: lease.clone(),
            endpoint: provisioning::Endpoint("e".into()),
        },
        EffectRequest::BootstrapConvergenceObserved {
            session: session.clone(),
        },
        EffectRequest::CancelBootstrap {
            session: session.clone(),
        },
        EffectRequest::DestroyLease { lease },
    ];
    let (exec, spawner) = setup();
    for (seq, request) in (1..).zip(requests) {
        let operation = op(1, seq, request.clone());
        assert_eq!(exec.submit(operation.clone()), Ok(Submitted::Started));
        spawner.run_all(RunOrder::Fifo);
        let first = exec.take_results();
        assert_eq!(first.len(), 1, "{request:?}");
        assert_eq!(first[0].outcome, success(&operation).outcome, "{request:?}");
        assert_eq!(
            exec.submit(operation),
            Ok(Submitted::Replayed),
            "{request:?}"
        );
        assert_eq!(exec.take_results(), first, "{request:?}");
        let changed = op(1, seq, EffectRequest::CreateLease);
        let changed = if request == EffectRequest::CreateLease {
            op(1, seq, EffectRequest::CancelBootstrap { session: None })
        } else {
            changed
        };
        assert_eq!(
            exec.submit(changed),
            Err(SubmitError::ConflictingInput(OperationId::new(
                NodeAttemptId::from_raw(1),
                OperationSequence::from_raw(seq),
            ))),
            "{request:?}"
        );
    }
    // An expired operation replays its timeout, the older id it keeps.
    let held = op(1, 7, EffectRequest::CreateLease);
    exec.submit(held.clone()).unwrap();
    let expired = exec.expire(held.id).expect("in flight");
    assert_eq!(expired.outcome, Err(EffectError::timed_out()));
    assert_eq!(exec.submit(held.clone()), Ok(Submitted::AlreadyRunning));
    // Its task ends without calling the backend (it expired first).
    spawner.run_all(RunOrder::Fifo);
    assert_eq!(exec.take_results(), Vec::new());
    assert_eq!(exec.submit(held), Ok(Submitted::Replayed));
    assert_eq!(exec.take_results(), vec![expired]);
    assert_eq!(exec.backend().calls.lock().unwrap().len(), 6);
}
