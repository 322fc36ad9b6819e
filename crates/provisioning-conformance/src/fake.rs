//! The Level 1 substrate: an honest in-memory backend with a real ledger.
//!
//! [`FakeBackend`] keeps every live lease and bootstrap session per
//! `(slot, attempt)` key, so "no double-create" (G08) and "converged leaks
//! nothing" (G23) are checked against what the backend really holds, not
//! against what the driver believes. It follows the [`EffectBackend`]
//! contract to the letter:
//!
//! - create and bootstrap start look for a live resource of their key and
//!   adopt it before creating;
//! - a definite failure (and a panic) leaves nothing behind for its key — so
//!   a scripted definite failure of a create whose key already has a live
//!   resource adopts instead, as an honest backend that looks first would;
//! - cancel and destroy of something absent succeed;
//! - a call that needs a lease that is gone reports the node lost and fails
//!   definitely (as the plugin adapter does for a not-found resource);
//! - every third attempt learns its endpoint with the lease, the others need
//!   a lookup, so both paths of the ladder are taken;
//! - after a controller crash the live sessions (and any a dead controller's
//!   call starts later) are quiet: nothing of them is reported until an
//!   adopting start of the new controller re-attaches them, whose agent then
//!   joins again (see `Ledger::controller_restarted`);
//! - when the trace asks for late closes, the convergence call only
//!   acknowledges and the session closes later (a `closed` stream event, a
//!   second convergence call, or the fair tail's progress).
//!
//! Work runs on a [`ManualSpawner`], so a trace replays identically.
//! [`Defect`]s turn the backend deliberately dishonest, to show that the
//! oracle notices (mutation testing of the kit itself).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use provisioning::effect::{EffectRequest, LeaseHandle, SessionHandle};
use provisioning::executor::EffectBackend;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::spawn::{BoxFuture, ManualSpawner, Spawner};
use provisioning::{
    EffectError, EffectKind, EffectOutput, EndpointLookup, LogicalNodeId, NodeAttemptId,
    Observation, Operation,
};
use provisioning_provider::{BootstrapSession, NodeLease};

use crate::fake_support::{
    Completion, HangGate, Ledger, PanicSerial, endpoint_of, silence_scripted_panics,
};
use crate::substrate::{
    CallRecord, CallRecorder, Capabilities, LiveResources, ResourceKey, Substrate,
    SubstrateCounters, run_manual_work,
};
use crate::trace::{Fault, FaultTarget, StreamEvent, WorkStep};

pub use crate::substrate::MAX_SCRIPTED_FAULTS;

/// The text of a scripted backend panic's payload (a `&'static str` or a
/// `String`, alternately: a host must read both). The fake's panic hook
/// keeps these out of the test output; every other panic is reported as
/// usual.
pub const SCRIPTED_PANIC_MESSAGE: &str = "provisioning-conformance: scripted backend panic";

/// A deliberate dishonesty of the [`FakeBackend`], to prove that the oracle
/// catches it. Never enable one for real validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Defect {
    /// Create makes a new lease even when one of its key is live, instead of
    /// adopting it (caught as G08 no double-create).
    CreateIgnoresExisting,
    /// Destroy reports success but keeps the lease (caught as G23 converged
    /// leaks nothing).
    DestroyKeepsResource,
}

/// The in-memory backend of Level 1. See the [module docs](self).
#[derive(Debug)]
pub struct FakeBackend {
    ledger: Mutex<Ledger<ResourceKey, EffectKind>>,
    hangs: HangGate,
    observations: Mutex<Vec<Observation>>,
    calls: CallRecorder,
    defects: BTreeSet<Defect>,
    wrong_answers: Mutex<WrongAnswers>,
    panics: PanicSerial,
}

/// Scripted wrong answers: the targets of the next calls that answer with
/// another method's output, oldest first, at most [`MAX_WRONG_ANSWERS`].
#[derive(Debug, Default)]
struct WrongAnswers {
    targets: Vec<Option<EffectKind>>,
    stopped: bool,
}

/// The most wrong answers scripted at once.
const MAX_WRONG_ANSWERS: usize = 8;

/// An output of another kind than `kind`'s: what a confused provider says.
fn wrong_output(kind: EffectKind) -> EffectOutput {
    match kind {
        EffectKind::DestroyLease => EffectOutput::ConvergenceAcknowledged,
        _ => EffectOutput::LeaseDestroyed,
    }
}

impl FakeBackend {
    /// An honest backend.
    pub fn new() -> Self {
        FakeBackend::with_defects([])
    }

    /// A backend with deliberate defects (see [`Defect`]).
    ///
    /// The first backend created installs a panic hook that keeps scripted
    /// backend panics ([`SCRIPTED_PANIC_MESSAGE`]) out of the output and hands
    /// every other panic to the hook that was installed before.
    pub fn with_defects(defects: impl IntoIterator<Item = Defect>) -> Self {
        silence_scripted_panics();
        FakeBackend {
            ledger: Mutex::new(Ledger::default()),
            hangs: HangGate::default(),
            observations: Mutex::new(Vec::new()),
            calls: CallRecorder::new(),
            defects: defects.into_iter().collect(),
            wrong_answers: Mutex::new(WrongAnswers::default()),
            panics: PanicSerial::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ledger<ResourceKey, EffectKind>> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wrong_answers(&self) -> MutexGuard<'_, WrongAnswers> {
        self.wrong_answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the oldest wrong answer scripted for `kind` (or for any call).
    fn take_wrong_answer(&self, kind: EffectKind) -> bool {
        let mut scripted = self.wrong_answers();
        let found = scripted
            .targets
            .iter()
            .position(|t| *t == Some(kind))
            .or_else(|| scripted.targets.iter().position(Option::is_none));
        found.map(|index| scripted.targets.remove(index)).is_some()
    }

    fn has(&self, defect: Defect) -> bool {
        self.defects.contains(&defect)
    }

    fn report(&self, observation: Observation) {
        self.observations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(observation);
    }

    fn report_bootstrap(&self, (node, attempt): &ResourceKey, event: BootstrapEvent) {
        self.report(Observation::Bootstrap {
            node: node.clone(),
            attempt: *attempt,
            event,
        });
    }

    fn report_lost(&self, (node, attempt): &ResourceKey, cause: LossCause) {
        self.report(Observation::NodeLost {
            node: node.clone(),
            attempt: *attempt,
            cause,
        });
    }

    /// Whether a create or start of this operation would adopt something.
    fn would_adopt(ledger: &Ledger<ResourceKey, EffectKind>, operation: &Operation) -> bool {
        let key = key_of(operation);
        match operation.kind() {
            EffectKind::CreateLease => ledger.live_lease(&key).is_some(),
            EffectKind::StartBootstrap => ledger.has_session(&key),
            _ => false,
        }
    }

    fn finish(
        &self,
        operation: &Operation,
        fault: Option<Fault>,
        epoch: u64,
    ) -> Result<EffectOutput, EffectError> {
        let mut ledger = self.lock();
        let fault = match fault {
            None | Some(Fault::Succeed | Fault::Hang) => {
                return self.perform(&mut ledger, operation, epoch);
            }
            Some(fault) => fault,
        };
        match fault {
            Fault::NotReady => {
                let key = key_of(operation);
                if ledger.live_lease(&key).is_some() {
                    Ok(EffectOutput::Endpoint(EndpointLookup::NotReady))
                } else {
                    self.perform(&mut ledger, operation, epoch)
                }
            }
            // An honest backend looks before it fails: a definite failure
            // (or a crash) on the creation path cannot hide an existing resource.
            Fault::Definite | Fault::Panic if FakeBackend::would_adopt(&ledger, operation) => {
                self.perform(&mut ledger, operation, epoch)
            }
            Fault::Definite => Err(EffectError::definite("scripted definite failure")),
            Fault::Panic => {
                drop(ledger);
                self.panics.panic();
            }
            Fault::AmbiguousDone => {
                self.perform(&mut ledger, operation, epoch)?;
                Err(EffectError::ambiguous("scripted lost reply after the work"))
            }
            _ => Err(EffectError::ambiguous("scripted ambiguous failure")),
        }
    }

    fn perform(
        &self,
        ledger: &mut Ledger<ResourceKey, EffectKind>,
        operation: &Operation,
        epoch: u64,
    ) -> Result<EffectOutput, EffectError> {
        let key = key_of(operation);
        let lost = || {
            self.report_lost(&key, LossCause::LeaseGone);
            Err(EffectError::definite(format!(
                "not found: the lease of {}/{} is gone",
                key.0, key.1
            )))
        };
        match &operation.request {
            EffectRequest::CreateLease => {
                let adopt = !self.has(Defect::CreateIgnoresExisting);
                let NodeLease {
                    lease,
                    endpoint,
                    adopted,
                } = ledger.create_lease(&key, adopt);
                Ok(EffectOutput::LeaseCreated {
                    lease,
                    endpoint,
                    adopted,
                })
            }
            EffectRequest::LookupEndpoint { lease } if ledger.holds_lease(&key, lease) => Ok(
                EffectOutput::Endpoint(EndpointLookup::Ready(endpoint_of(lease))),
            ),
            EffectRequest::StartBootstrap { lease, .. } if ledger.holds_lease(&key, lease) => {
                let BootstrapSession { session, adopted } = ledger.start_session(&key, epoch);
                Ok(EffectOutput::BootstrapStarted { session, adopted })
            }
            EffectRequest::LookupEndpoint { .. } | EffectRequest::StartBootstrap { .. } => lost(),
            EffectRequest::BootstrapConvergenceObserved { .. } => {
                // The provider finishes the session once told the agent
                // joined: at once, or later when sessions close late. A
                // quiet session's close reaches nobody.
                match ledger.complete_session(&key) {
                    Completion::Closed { report } => {
                        if report {
                            self.report_bootstrap(&key, BootstrapEvent::Closed);
                        }
                        Ok(EffectOutput::ConvergenceAcknowledged)
                    }
                    Completion::Acknowledged => Ok(EffectOutput::ConvergenceAcknowledged),
                    // Already closed: finishing it again is a no-op.
                    Completion::NoSession if ledger.live_lease(&key).is_some() => {
                        Ok(EffectOutput::ConvergenceAcknowledged)
                    }
                    Completion::NoSession => lost(),
                }
            }
            EffectRequest::CancelBootstrap { .. } => {
                ledger.end_session(&key);
                Ok(EffectOutput::BootstrapCancelled)
            }
            EffectRequest::DestroyLease { .. } => {
                if !self.has(Defect::DestroyKeepsResource) {
                    ledger.destroy(&key);
                }
                Ok(EffectOutput::LeaseDestroyed)
            }
        }
    }
}

impl Default for FakeBackend {
    fn default() -> Self {
        FakeBackend::new()
    }
}

fn key_of(operation: &Operation) -> ResourceKey {
    (operation.node.clone(), operation.attempt())
}

impl EffectBackend for FakeBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(async move {
            let _in_flight = self.calls.start(operation);
            let kind = operation.kind();
            // The controller epoch the call started in (see
            // `Ledger::controller_restarted`).
            let epoch = self.lock().epoch();
            if self.take_wrong_answer(kind) {
                let mut ledger = self.lock();
                return self
                    .perform(&mut ledger, operation, epoch)
                    .map(|_| wrong_output(kind));
            }
            let fault = self.lock().take_script(kind, |f| f.applies_to(kind));
            if fault == Some(Fault::Hang) {
                self.hangs.park().await;
            }
            self.finish(operation, fault, epoch)
        })
    }
}

/// The Level 1 substrate: a [`FakeBackend`] on a [`ManualSpawner`].
#[derive(Debug)]
pub struct FakeSubstrate {
    backend: Arc<FakeBackend>,
    spawner: ManualSpawner,
}

impl FakeSubstrate {
    /// An honest substrate.
    pub fn new() -> Self {
        FakeSubstrate::with_defects([])
    }

    /// A substrate whose backend has deliberate defects (see [`Defect`]).
    pub fn with_defects(defects: impl IntoIterator<Item = Defect>) -> Self {
        FakeSubstrate {
            backend: Arc::new(FakeBackend::with_defects(defects)),
            spawner: ManualSpawner::new(),
        }
    }
}

impl Default for FakeSubstrate {
    fn default() -> Self {
        FakeSubstrate::new()
    }
}

impl Substrate for FakeSubstrate {
    type Backend = FakeBackend;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            deterministic: true,
        }
    }

    fn backend(&self) -> Arc<FakeBackend> {
        self.backend.clone()
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        Arc::new(self.spawner.clone())
    }

    fn script(&mut self, target: FaultTarget, fault: Fault) -> bool {
        let kind = target.kind();
        kind.is_none_or(|kind| fault.applies_to(kind))
            && self.backend.lock().scripts.push(kind, fault)
    }

    fn script_wrong_answer(&mut self, target: FaultTarget) -> bool {
        let mut scripted = self.backend.wrong_answers();
        if scripted.stopped || scripted.targets.len() >= MAX_WRONG_ANSWERS {
            return false;
        }
        scripted.targets.push(target.kind());
        true
    }

    fn stop_faults(&mut self) {
        self.backend.lock().scripts.stop();
        let mut scripted = self.backend.wrong_answers();
        scripted.targets.clear();
        scripted.stopped = true;
    }

    fn run_work(&mut self, step: WorkStep) -> usize {
        run_manual_work(&self.spawner, step)
    }

    fn has_runnable_work(&self) -> bool {
        self.spawner.ready_count() > 0
    }

    fn release_oldest_hang(&mut self) -> bool {
        self.backend.hangs.release_oldest()
    }

    fn release_all_hangs(&mut self) -> usize {
        self.backend.hangs.release_all()
    }

    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        let (key, event) = self.backend.lock().stream(session, event)?;
        self.backend.report_bootstrap(&key, event);
        Some(key)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        let key = (node.clone(), attempt);
        let lost = self.backend.lock().lose(&key, cause);
        if lost {
            self.backend.report_lost(&key, cause);
        }
        lost
    }

    fn rejoin(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId) -> bool {
        let key = (node.clone(), attempt);
        let live = self.backend.lock().agent_live(&key);
        if live {
            self.backend.report(Observation::AgentRejoined {
                node: node.clone(),
                attempt,
            });
        }
        live
    }

    fn fair_progress(&mut self) -> usize {
        let (joined, closed) = {
            let mut ledger = self.backend.lock();
            (ledger.join_waiting(), ledger.close_acknowledged())
        };
        for key in &joined {
            self.backend.report_bootstrap(key, BootstrapEvent::Joined);
        }
        for key in &closed {
            self.backend.report_bootstrap(key, BootstrapEvent::Closed);
        }
        joined.len() + closed.len()
    }

    fn close_sessions_late(&mut self) {
        self.backend.lock().close_sessions_late();
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        let observations = &self.backend.observations;
        std::mem::take(&mut *observations.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn live_resources(&self) -> LiveResources {
        self.backend.lock().live()
    }

    fn take_ledger_alarms(&mut self) -> Vec<String> {
        self.backend.lock().take_alarms()
    }

    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.backend.lock().lease_owner(lease)
    }

    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.backend.lock().session_owner(session)
    }

    fn counters(&self) -> SubstrateCounters {
        self.backend.lock().counters
    }

    fn survives_controller_crash(&self) -> bool {
        true
    }

    fn controller_restarted(&mut self) {
        self.backend.lock().controller_restarted();
    }

    fn destroy_orphan(&mut self, key: &ResourceKey) -> bool {
        let mut ledger = self.backend.lock();
        let live = ledger.live_lease(key).is_some() || ledger.has_session(key);
        ledger.destroy(key);
        live
    }

    fn describe_work(&self) -> String {
        format!(
            "{} task(s) queued ({} runnable), {} hung call(s), {} scripted fault(s) unused",
            self.spawner.len(),
            self.spawner.ready_count(),
            self.backend.hangs.hung(),
            self.backend.lock().scripts.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::{PROVIDER_KIND, RUN_NAME};
    use provisioning::effect::Endpoint as EndpointName;
    use provisioning::id::OperationSequence;
    use provisioning::{
        GroupId, LogicalNodeSpec, NodeTemplate, OperationId, RunId, state::BootstrapFailure,
    };
    use std::panic::AssertUnwindSafe;
    use std::task::{Context, Poll, Waker};

    fn node() -> LogicalNodeId {
        LogicalNodeId::new(GroupId::new("a"), 0)
    }

    fn operation(attempt: u64, sequence: u32, request: EffectRequest) -> Operation {
        let template = NodeTemplate {
            role: "r".into(),
            provider: PROVIDER_KIND.into(),
            shape: Default::default(),
            boot: Default::default(),
            swarm_join: Default::default(),
        };
        Operation {
            id: OperationId::new(
                NodeAttemptId::from_raw(attempt),
                OperationSequence::from_raw(sequence),
            ),
            run_id: RunId::new(RUN_NAME),
            node: node(),
            spec: LogicalNodeSpec::new(node(), RunId::new(RUN_NAME), Arc::new(template)),
            request,
        }
    }

    fn create(attempt: u64) -> Operation {
        operation(attempt, 1, EffectRequest::CreateLease)
    }

    /// Polls a backend call once; `None` while it is pending (hung).
    fn poll_once(
        future: &mut BoxFuture<'_, Result<EffectOutput, EffectError>>,
    ) -> Option<Result<EffectOutput, EffectError>> {
        let mut cx = Context::from_waker(Waker::noop());
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(outcome) => Some(outcome),
            Poll::Pending => None,
        }
    }

    fn call(backend: &FakeBackend, op: &Operation) -> Option<Result<EffectOutput, EffectError>> {
        poll_once(&mut backend.execute(op))
    }

    fn leases(substrate: &FakeSubstrate) -> Vec<u32> {
        substrate.live_resources().leases.into_values().collect()
    }

    fn lease_of(output: Option<Result<EffectOutput, EffectError>>) -> LeaseHandle {
        match output {
            Some(Ok(EffectOutput::LeaseCreated { lease, .. })) => lease,
            other => panic!("expected a lease, got {other:?}"),
        }
    }

    #[test]
    fn a_second_create_for_the_same_attempt_adopts_the_live_lease() {
        let substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        let first = lease_of(call(&backend, &create(1)));
        let again = call(&backend, &operation(1, 2, EffectRequest::CreateLease));
        assert_eq!(
            again,
            Some(Ok(EffectOutput::LeaseCreated {
                lease: first,
                endpoint: None,
                adopted: true
            }))
        );
        assert_eq!(leases(&substrate), [1]);
        assert_eq!(substrate.counters().adoptions, 1);
        assert_eq!(substrate.counters().creations, 1);
    }

    #[test]
    fn a_definite_failure_leaves_nothing_and_never_hides_an_existing_resource() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        assert!(substrate.script(FaultTarget::Any, Fault::Definite));
        let failed = call(&backend, &create(1));
        assert!(
            matches!(failed, Some(Err(ref e)) if !e.is_ambiguous()),
            "{failed:?}"
        );
        assert!(substrate.live_resources().is_empty());
        // With a live lease, an honest backend looks first and adopts.
        lease_of(call(&backend, &create(1)));
        assert!(substrate.script(FaultTarget::Kind(EffectKind::CreateLease), Fault::Definite));
        let adopted = call(&backend, &operation(1, 2, EffectRequest::CreateLease));
        assert!(matches!(
            adopted,
            Some(Ok(EffectOutput::LeaseCreated { adopted: true, .. }))
        ));
        assert_eq!(leases(&substrate), [1]);
    }

    #[test]
    fn ambiguous_faults_may_or_may_not_have_done_the_work() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        substrate.script(FaultTarget::Any, Fault::AmbiguousUndone);
        assert!(matches!(call(&backend, &create(1)), Some(Err(ref e)) if e.is_ambiguous()));
        assert!(substrate.live_resources().is_empty());
        substrate.script(FaultTarget::Any, Fault::AmbiguousDone);
        assert!(matches!(call(&backend, &create(1)), Some(Err(ref e)) if e.is_ambiguous()));
        assert_eq!(leases(&substrate), [1], "the lost reply's lease exists");
        let retry = call(&backend, &operation(1, 2, EffectRequest::CreateLease));
        assert!(matches!(
            retry,
            Some(Ok(EffectOutput::LeaseCreated { adopted: true, .. }))
        ));
    }

    #[test]
    fn a_scripted_panic_happens_before_any_work() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        substrate.script(FaultTarget::Any, Fault::Panic);
        let op = create(1);
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| call(&backend, &op)));
        assert!(outcome.is_err());
        assert!(substrate.live_resources().is_empty());
        assert_eq!(
            backend.calls.in_flight(),
            0,
            "the unwound call is not in flight"
        );
    }

    #[test]
    fn a_hung_call_does_its_work_only_when_released() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        substrate.script(FaultTarget::Kind(EffectKind::CreateLease), Fault::Hang);
        let op = create(1);
        let mut hung = backend.execute(&op);
        assert_eq!(poll_once(&mut hung), None);
        assert!(substrate.live_resources().is_empty());
        assert_eq!(backend.calls.in_flight(), 1);
        assert!(substrate.describe_work().contains("1 hung call"));
        assert!(substrate.release_oldest_hang());
        assert!(!substrate.release_oldest_hang());
        lease_of(poll_once(&mut hung));
        drop(hung);
        assert_eq!(leases(&substrate), [1]);
        assert_eq!(backend.calls.in_flight(), 0);
        let calls = substrate.take_calls();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].overlapping, 0);
    }

    #[test]
    fn cleanup_of_absent_things_succeeds_and_a_missing_lease_is_reported_lost() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        let cancel = operation(1, 1, EffectRequest::CancelBootstrap { session: None });
        assert_eq!(
            call(&backend, &cancel),
            Some(Ok(EffectOutput::BootstrapCancelled))
        );
        let lease = LeaseHandle("gone".into());
        let destroy = operation(
            1,
            2,
            EffectRequest::DestroyLease {
                lease: lease.clone(),
            },
        );
        assert_eq!(
            call(&backend, &destroy),
            Some(Ok(EffectOutput::LeaseDestroyed))
        );
        let lookup = operation(1, 3, EffectRequest::LookupEndpoint { lease });
        assert!(matches!(call(&backend, &lookup), Some(Err(ref e)) if !e.is_ambiguous()));
        assert_eq!(
            substrate.take_observations(),
            [Observation::NodeLost {
                node: node(),
                attempt: NodeAttemptId::from_raw(1),
                cause: LossCause::LeaseGone
            }]
        );
    }

    #[test]
    fn a_session_streams_joins_and_closes_when_convergence_is_reported() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        let lease = lease_of(call(&backend, &create(1)));
        let start = operation(
            1,
            2,
            EffectRequest::StartBootstrap {
                lease: lease.clone(),
                endpoint: EndpointName("e".into()),
            },
        );
        assert!(matches!(
            call(&backend, &start),
            Some(Ok(EffectOutput::BootstrapStarted { adopted: false, .. }))
        ));
        assert_eq!(substrate.live_resources().sessions.len(), 1);
        assert_eq!(substrate.fair_progress(), 1);
        assert_eq!(substrate.fair_progress(), 0, "joins once");
        let report = operation(
            1,
            3,
            EffectRequest::BootstrapConvergenceObserved { session: None },
        );
        assert_eq!(
            call(&backend, &report),
            Some(Ok(EffectOutput::ConvergenceAcknowledged))
        );
        assert!(substrate.live_resources().sessions.is_empty());
        let events: Vec<_> = substrate.take_observations();
        assert_eq!(events.len(), 2);
        assert!(matches!(
            events[1],
            Observation::Bootstrap {
                event: BootstrapEvent::Closed,
                ..
            }
        ));
        assert_eq!(
            substrate.stream(0, StreamEvent::Joined),
            None,
            "no live session"
        );
    }

    #[test]
    fn after_a_controller_restart_a_session_is_quiet_until_an_adopting_start_re_attaches_it() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        let lease = lease_of(call(&backend, &create(1)));
        let start = |sequence| {
            operation(
                1,
                sequence,
                EffectRequest::StartBootstrap {
                    lease: lease.clone(),
                    endpoint: EndpointName("e".into()),
                },
            )
        };
        call(&backend, &start(2));
        assert_eq!(
            substrate.fair_progress(),
            1,
            "the agent joins the first controller"
        );
        substrate.take_observations();
        substrate.controller_restarted();
        // The session streamed to the controller that died: the new one hears
        // nothing of it, its join included.
        assert_eq!(substrate.stream(0, StreamEvent::Converged), None);
        assert_eq!(substrate.fair_progress(), 0);
        assert!(substrate.take_observations().is_empty());
        assert_eq!(
            substrate.live_resources().sessions.len(),
            1,
            "the agent lives on"
        );
        // The new controller's start adopts the session and re-attaches it:
        // the agent joins its swarm, and that join is reported.
        assert!(matches!(
            call(&backend, &start(3)),
            Some(Ok(EffectOutput::BootstrapStarted { adopted: true, .. }))
        ));
        assert!(substrate.stream(0, StreamEvent::Converged).is_some());
        assert_eq!(substrate.fair_progress(), 1);
        assert_eq!(substrate.take_observations().len(), 2);
    }

    #[test]
    fn sessions_that_close_late_are_acknowledged_first_and_closed_later() {
        let mut substrate = FakeSubstrate::new();
        substrate.close_sessions_late();
        let backend = substrate.backend();
        let report = |sequence| {
            operation(
                1,
                sequence,
                EffectRequest::BootstrapConvergenceObserved { session: None },
            )
        };
        let open_joined = |substrate: &mut FakeSubstrate| {
            let lease = lease_of(call(&backend, &create(1)));
            let start = operation(
                1,
                2,
                EffectRequest::StartBootstrap {
                    lease,
                    endpoint: EndpointName("e".into()),
                },
            );
            call(&backend, &start);
            substrate.fair_progress();
            substrate.take_observations();
        };
        open_joined(&mut substrate);
        let acknowledged = Some(Ok(EffectOutput::ConvergenceAcknowledged));
        assert_eq!(call(&backend, &report(3)), acknowledged);
        assert_eq!(substrate.live_resources().sessions.len(), 1, "still open");
        assert!(substrate.take_observations().is_empty(), "no close yet");
        // The fair tail's progress closes it (and does not join it again).
        assert_eq!(substrate.fair_progress(), 1);
        assert!(substrate.live_resources().sessions.is_empty());
        let closed = substrate.take_observations();
        assert!(matches!(
            closed.as_slice(),
            [Observation::Bootstrap {
                event: BootstrapEvent::Closed,
                ..
            }]
        ));
        assert_eq!(substrate.fair_progress(), 0);
        // A second convergence call closes an acknowledged session at once.
        open_joined(&mut substrate);
        assert_eq!(call(&backend, &report(3)), acknowledged);
        assert_eq!(call(&backend, &report(4)), acknowledged);
        assert!(substrate.live_resources().sessions.is_empty());
        assert_eq!(substrate.take_observations().len(), 1);
    }

    #[test]
    fn a_session_a_dead_controllers_hung_start_makes_is_quiet() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        let lease = lease_of(call(&backend, &create(1)));
        let start = operation(
            1,
            2,
            EffectRequest::StartBootstrap {
                lease,
                endpoint: EndpointName("e".into()),
            },
        );
        substrate.script(FaultTarget::Kind(EffectKind::StartBootstrap), Fault::Hang);
        let mut hung = backend.execute(&start);
        assert_eq!(poll_once(&mut hung), None);
        substrate.controller_restarted();
        assert!(substrate.release_oldest_hang());
        assert!(poll_once(&mut hung).is_some());
        drop(hung);
        assert_eq!(substrate.live_resources().sessions.len(), 1);
        assert_eq!(substrate.stream(0, StreamEvent::Joined), None);
        assert_eq!(substrate.fair_progress(), 0);
    }

    #[test]
    fn stream_failures_end_the_session_and_loss_removes_what_it_names() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        let lease = lease_of(call(&backend, &create(1)));
        let start = operation(
            1,
            2,
            EffectRequest::StartBootstrap {
                lease,
                endpoint: EndpointName("e".into()),
            },
        );
        call(&backend, &start);
        let key = substrate.stream(7, StreamEvent::Failed(BootstrapFailure::JoinFailed));
        assert_eq!(key, Some((node(), NodeAttemptId::from_raw(1))));
        assert!(substrate.live_resources().sessions.is_empty());
        assert_eq!(leases(&substrate), [1]);
        assert!(substrate.lose(&node(), NodeAttemptId::from_raw(1), LossCause::AgentGone));
        assert_eq!(leases(&substrate), [1], "losing the agent keeps the lease");
        assert!(substrate.lose(&node(), NodeAttemptId::from_raw(1), LossCause::LeaseGone));
        assert!(substrate.live_resources().is_empty());
        assert!(!substrate.lose(&node(), NodeAttemptId::from_raw(1), LossCause::LeaseGone));
    }

    #[test]
    fn scripts_prefer_their_kind_respect_applicability_and_stop_in_the_fair_tail() {
        let mut substrate = FakeSubstrate::new();
        let backend = substrate.backend();
        assert!(!substrate.script(FaultTarget::Kind(EffectKind::CreateLease), Fault::NotReady));
        assert!(substrate.script(FaultTarget::Any, Fault::NotReady));
        assert!(substrate.script(FaultTarget::Any, Fault::AmbiguousUndone));
        assert!(substrate.script(FaultTarget::Kind(EffectKind::CreateLease), Fault::Definite));
        // The kind-specific script wins over the older `any` ones; `not-ready`
        // is skipped for a create.
        assert!(matches!(call(&backend, &create(1)), Some(Err(ref e)) if !e.is_ambiguous()));
        assert!(matches!(call(&backend, &create(1)), Some(Err(ref e)) if e.is_ambiguous()));
        let lease = lease_of(call(&backend, &create(1)));
        let lookup = operation(1, 4, EffectRequest::LookupEndpoint { lease });
        assert_eq!(
            call(&backend, &lookup),
            Some(Ok(EffectOutput::Endpoint(EndpointLookup::NotReady)))
        );
        for _ in 0..MAX_SCRIPTED_FAULTS {
            assert!(substrate.script(FaultTarget::Any, Fault::Definite));
        }
        assert!(
            !substrate.script(FaultTarget::Any, Fault::Definite),
            "bounded"
        );
        substrate.stop_faults();
        assert!(!substrate.script(FaultTarget::Any, Fault::Definite));
        assert!(matches!(call(&backend, &create(2)), Some(Ok(_))));
    }

    #[test]
    fn defects_make_the_backend_dishonest_as_documented() {
        let substrate = FakeSubstrate::with_defects([Defect::CreateIgnoresExisting]);
        let backend = substrate.backend();
        lease_of(call(&backend, &create(1)));
        let mut substrate = substrate;
        assert!(substrate.take_ledger_alarms().is_empty());
        lease_of(call(&backend, &operation(1, 2, EffectRequest::CreateLease)));
        assert_eq!(leases(&substrate), [2]);
        let alarms = substrate.take_ledger_alarms();
        assert_eq!(alarms.len(), 1, "{alarms:?}");
        assert!(alarms[0].contains("a-0/a1"), "{alarms:?}");

        let substrate = FakeSubstrate::with_defects([Defect::DestroyKeepsResource]);
        let backend = substrate.backend();
        let lease = lease_of(call(&backend, &create(1)));
        let destroy = operation(1, 2, EffectRequest::DestroyLease { lease });
        assert_eq!(
            call(&backend, &destroy),
            Some(Ok(EffectOutput::LeaseDestroyed))
        );
        assert_eq!(leases(&substrate), [1]);
    }
}
