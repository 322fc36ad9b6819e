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
//!   a lookup, so both paths of the ladder are taken.
//!
//! Work runs on a [`ManualSpawner`], so a trace replays identically.
//! [`Defect`]s turn the backend deliberately dishonest, to show that the
//! oracle notices (mutation testing of the kit itself).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, Once, PoisonError};
use std::task::{Context, Poll, Waker};

use provisioning::effect::{EffectRequest, LeaseHandle, SessionHandle};
use provisioning::executor::EffectBackend;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::spawn::{BoxFuture, ManualSpawner, RunOrder, Spawner};
use provisioning::{
    EffectError, EffectKind, EffectOutput, Endpoint, EndpointLookup, LogicalNodeId, NodeAttemptId,
    Observation, Operation,
};

use crate::substrate::{
    CallRecord, CallRecorder, Capabilities, LiveResources, ResourceKey, Substrate,
    SubstrateCounters,
};
use crate::trace::{Fault, FaultTarget, StreamEvent, WorkStep};

/// How many scripted faults may wait for a call; further scripts are dropped.
pub const MAX_SCRIPTED_FAULTS: usize = 8;

/// The payload of a scripted backend panic. The fake's panic hook keeps
/// these out of the test output; every other panic is reported as usual.
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

#[derive(Clone, Debug)]
struct FakeSession {
    handle: SessionHandle,
    joined: bool,
}

#[derive(Debug, Default)]
struct HangSlot {
    released: bool,
    waker: Option<Waker>,
}

#[derive(Debug, Default)]
struct Ledger {
    leases: BTreeMap<ResourceKey, Vec<LeaseHandle>>,
    sessions: BTreeMap<ResourceKey, FakeSession>,
    lease_owners: BTreeMap<LeaseHandle, ResourceKey>,
    session_owners: BTreeMap<SessionHandle, ResourceKey>,
    serial: u64,
    scripts: VecDeque<(FaultTarget, Fault)>,
    faults_stopped: bool,
    hangs: BTreeMap<u64, HangSlot>,
    next_hang: u64,
    observations: Vec<Observation>,
    alarms: Vec<String>,
    counters: SubstrateCounters,
}

impl Ledger {
    fn next_serial(&mut self) -> u64 {
        self.serial += 1;
        self.serial
    }

    /// Raises an alarm when `key` is about to get a resource while it, or
    /// another attempt of its slot, already holds one.
    fn watch_creation(&mut self, key: &ResourceKey, what: &str) {
        let (node, attempt) = key;
        let holders: Vec<String> = self
            .leases
            .iter()
            .filter(|((n, _), leases)| n == node && !leases.is_empty())
            .map(|((_, a), _)| a.to_string())
            .chain(
                self.sessions
                    .keys()
                    .filter(|(n, a)| n == node && a != attempt)
                    .map(|(_, a)| a.to_string()),
            )
            .collect();
        let same_key = match what {
            "lease" => self.live_lease(key).is_some(),
            _ => self.sessions.contains_key(key),
        };
        let other_attempts = holders.iter().any(|a| *a != attempt.to_string());
        if same_key || other_attempts {
            self.alarms.push(format!(
                "a {what} was created for {node}/{attempt} while the slot held live resources of attempts [{}]",
                holders.join(", ")
            ));
        }
    }

    fn live_lease(&self, key: &ResourceKey) -> Option<&LeaseHandle> {
        self.leases.get(key).and_then(|leases| leases.first())
    }

    fn take_script(&mut self, kind: EffectKind) -> Option<Fault> {
        let position = self.scripts.iter().position(|(target, fault)| {
            fault.applies_to(kind) && matches!(target, FaultTarget::Kind(k) if *k == kind)
        });
        let position = position.or_else(|| {
            self.scripts
                .iter()
                .position(|(target, fault)| *target == FaultTarget::Any && fault.applies_to(kind))
        })?;
        let (_, fault) = self.scripts.remove(position)?;
        self.counters.faults_applied += 1;
        Some(fault)
    }

    fn report_lost(&mut self, key: &ResourceKey, cause: LossCause) {
        self.observations.push(Observation::NodeLost {
            node: key.0.clone(),
            attempt: key.1,
            cause,
        });
    }

    fn report_bootstrap(&mut self, key: &ResourceKey, event: BootstrapEvent) {
        self.observations.push(Observation::Bootstrap {
            node: key.0.clone(),
            attempt: key.1,
            event,
        });
    }
}

/// The in-memory backend of Level 1. See the [module docs](self).
#[derive(Debug)]
pub struct FakeBackend {
    ledger: Mutex<Ledger>,
    calls: CallRecorder,
    defects: BTreeSet<Defect>,
}

/// What the backend decided when a call started.
enum Plan {
    Fault(Fault),
    Normal,
}

struct HangFuture<'a> {
    backend: &'a FakeBackend,
    id: u64,
}

impl Future for HangFuture<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut ledger = self.backend.lock();
        match ledger.hangs.get_mut(&self.id) {
            Some(slot) if !slot.released => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
            _ => {
                ledger.hangs.remove(&self.id);
                Poll::Ready(())
            }
        }
    }
}

pub(crate) fn silence_scripted_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let scripted = info
                .payload()
                .downcast_ref::<&str>()
                .is_some_and(|text| *text == SCRIPTED_PANIC_MESSAGE);
            if !scripted {
                previous(info);
            }
        }));
    });
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
            calls: CallRecorder::new(),
            defects: defects.into_iter().collect(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn has(&self, defect: Defect) -> bool {
        self.defects.contains(&defect)
    }

    fn begin(&self, operation: &Operation) -> (Plan, Option<u64>) {
        let mut ledger = self.lock();
        let plan = match ledger.take_script(operation.kind()) {
            Some(fault) => Plan::Fault(fault),
            None => Plan::Normal,
        };
        let hang = match plan {
            Plan::Fault(Fault::Hang) => {
                let id = ledger.next_hang;
                ledger.next_hang += 1;
                ledger.hangs.insert(id, HangSlot::default());
                ledger.counters.hangs += 1;
                Some(id)
            }
            _ => None,
        };
        (plan, hang)
    }

    /// Whether a create or start of this operation would adopt something.
    fn would_adopt(ledger: &Ledger, operation: &Operation) -> bool {
        let key = key_of(operation);
        match operation.kind() {
            EffectKind::CreateLease => ledger.live_lease(&key).is_some(),
            EffectKind::StartBootstrap => ledger.sessions.contains_key(&key),
            _ => false,
        }
    }

    fn finish(&self, operation: &Operation, plan: &Plan) -> Result<EffectOutput, EffectError> {
        let mut ledger = self.lock();
        let fault = match plan {
            Plan::Normal | Plan::Fault(Fault::Succeed | Fault::Hang) => {
                return self.perform(&mut ledger, operation);
            }
            Plan::Fault(fault) => *fault,
        };
        match fault {
            Fault::NotReady => {
                let key = key_of(operation);
                if ledger.live_lease(&key).is_some() {
                    Ok(EffectOutput::Endpoint(EndpointLookup::NotReady))
                } else {
                    self.perform(&mut ledger, operation)
                }
            }
            // An honest backend looks before it fails: a definite failure
            // (or a crash) on the creation path cannot hide an existing resource.
            Fault::Definite | Fault::Panic if FakeBackend::would_adopt(&ledger, operation) => {
                self.perform(&mut ledger, operation)
            }
            Fault::Definite => Err(EffectError::definite("scripted definite failure")),
            Fault::Panic => {
                drop(ledger);
                std::panic::panic_any(SCRIPTED_PANIC_MESSAGE);
            }
            Fault::AmbiguousDone => {
                self.perform(&mut ledger, operation)?;
                Err(EffectError::ambiguous("scripted lost reply after the work"))
            }
            _ => Err(EffectError::ambiguous("scripted ambiguous failure")),
        }
    }

    fn perform(
        &self,
        ledger: &mut Ledger,
        operation: &Operation,
    ) -> Result<EffectOutput, EffectError> {
        let key = key_of(operation);
        let lost = |ledger: &mut Ledger, cause| {
            ledger.report_lost(&key, cause);
            Err(EffectError::definite(format!(
                "not found: the lease of {}/{} is gone",
                key.0, key.1
            )))
        };
        match &operation.request {
            EffectRequest::CreateLease => {
                if let Some(lease) = ledger.live_lease(&key).cloned() {
                    if !self.has(Defect::CreateIgnoresExisting) {
                        ledger.counters.adoptions += 1;
                        return Ok(EffectOutput::LeaseCreated {
                            endpoint: endpoint_at_creation(&key, &lease),
                            lease,
                            adopted: true,
                        });
                    }
                }
                ledger.watch_creation(&key, "lease");
                let serial = ledger.next_serial();
                let lease = LeaseHandle(format!("lease-{}-{}-{serial}", key.0, key.1));
                ledger
                    .leases
                    .entry(key.clone())
                    .or_default()
                    .push(lease.clone());
                ledger.lease_owners.insert(lease.clone(), key.clone());
                ledger.counters.creations += 1;
                Ok(EffectOutput::LeaseCreated {
                    endpoint: endpoint_at_creation(&key, &lease),
                    lease,
                    adopted: false,
                })
            }
            EffectRequest::LookupEndpoint { lease } => {
                if ledger.leases.get(&key).is_some_and(|l| l.contains(lease)) {
                    Ok(EffectOutput::Endpoint(EndpointLookup::Ready(endpoint_of(
                        lease,
                    ))))
                } else {
                    lost(ledger, LossCause::LeaseGone)
                }
            }
            EffectRequest::StartBootstrap { lease, .. } => {
                if !ledger.leases.get(&key).is_some_and(|l| l.contains(lease)) {
                    return lost(ledger, LossCause::LeaseGone);
                }
                if let Some(session) = ledger.sessions.get(&key) {
                    let session = session.handle.clone();
                    ledger.counters.adoptions += 1;
                    return Ok(EffectOutput::BootstrapStarted {
                        session,
                        adopted: true,
                    });
                }
                ledger.watch_creation(&key, "session");
                let serial = ledger.next_serial();
                let session = SessionHandle(format!("session-{}-{}-{serial}", key.0, key.1));
                ledger.sessions.insert(
                    key.clone(),
                    FakeSession {
                        handle: session.clone(),
                        joined: false,
                    },
                );
                ledger.session_owners.insert(session.clone(), key.clone());
                ledger.counters.creations += 1;
                Ok(EffectOutput::BootstrapStarted {
                    session,
                    adopted: false,
                })
            }
            EffectRequest::BootstrapConvergenceObserved { .. } => {
                if ledger.sessions.remove(&key).is_some() {
                    // The provider finishes the session once told the agent joined.
                    ledger.report_bootstrap(&key, BootstrapEvent::Closed);
                    Ok(EffectOutput::ConvergenceAcknowledged)
                } else if ledger.live_lease(&key).is_some() {
                    // Already closed: finishing it again is a no-op.
                    Ok(EffectOutput::ConvergenceAcknowledged)
                } else {
                    lost(ledger, LossCause::LeaseGone)
                }
            }
            EffectRequest::CancelBootstrap { .. } => {
                ledger.sessions.remove(&key);
                Ok(EffectOutput::BootstrapCancelled)
            }
            EffectRequest::DestroyLease { .. } => {
                if !self.has(Defect::DestroyKeepsResource) {
                    ledger.leases.remove(&key);
                    ledger.sessions.remove(&key);
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

fn endpoint_of(lease: &LeaseHandle) -> Endpoint {
    Endpoint(format!("endpoint-of-{}", lease.0))
}

/// Some providers know the endpoint when the lease is made, others only
/// later: every third attempt gets it at creation, so both paths are taken.
fn endpoint_at_creation(key: &ResourceKey, lease: &LeaseHandle) -> Option<Endpoint> {
    (key.1.get() % 3 == 0).then(|| endpoint_of(lease))
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
            let (plan, hang) = self.begin(operation);
            if let Some(id) = hang {
                HangFuture { backend: self, id }.await;
            }
            self.finish(operation, &plan)
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
        let mut ledger = self.backend.lock();
        if ledger.faults_stopped || ledger.scripts.len() >= MAX_SCRIPTED_FAULTS {
            return false;
        }
        if let FaultTarget::Kind(kind) = target {
            if !fault.applies_to(kind) {
                return false;
            }
        }
        ledger.scripts.push_back((target, fault));
        true
    }

    fn stop_faults(&mut self) {
        let mut ledger = self.backend.lock();
        ledger.scripts.clear();
        ledger.faults_stopped = true;
    }

    fn run_work(&mut self, step: WorkStep) -> usize {
        match step {
            WorkStep::Fifo => self.spawner.run_all(RunOrder::Fifo),
            WorkStep::Lifo => self.spawner.run_all(RunOrder::Lifo),
            WorkStep::One(index) => {
                let ready = self.spawner.ready_count();
                if ready == 0 {
                    return 0;
                }
                usize::from(self.spawner.run_nth(index as usize % ready))
            }
        }
    }

    fn has_runnable_work(&self) -> bool {
        self.spawner.ready_count() > 0
    }

    fn release_oldest_hang(&mut self) -> bool {
        let mut ledger = self.backend.lock();
        let Some(slot) = ledger.hangs.values_mut().find(|slot| !slot.released) else {
            return false;
        };
        slot.released = true;
        if let Some(waker) = slot.waker.take() {
            waker.wake();
        }
        true
    }

    fn release_all_hangs(&mut self) -> usize {
        let mut ledger = self.backend.lock();
        let mut released = 0;
        for slot in ledger.hangs.values_mut().filter(|slot| !slot.released) {
            slot.released = true;
            if let Some(waker) = slot.waker.take() {
                waker.wake();
            }
            released += 1;
        }
        released
    }

    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        let mut ledger = self.backend.lock();
        let count = ledger.sessions.len();
        if count == 0 {
            return None;
        }
        let key = ledger
            .sessions
            .keys()
            .nth(session as usize % count)?
            .clone();
        let event = match event {
            StreamEvent::Progress(stage) => BootstrapEvent::Progress(stage),
            StreamEvent::Converged => BootstrapEvent::Converged,
            StreamEvent::Joined => {
                if let Some(live) = ledger.sessions.get_mut(&key) {
                    live.joined = true;
                }
                BootstrapEvent::Joined
            }
            StreamEvent::Closed => {
                ledger.sessions.remove(&key);
                BootstrapEvent::Closed
            }
            StreamEvent::Failed(failure) => {
                ledger.sessions.remove(&key);
                BootstrapEvent::Failed {
                    failure,
                    detail: "scripted stream failure".to_owned(),
                }
            }
        };
        ledger.report_bootstrap(&key, event);
        Some(key)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        let mut ledger = self.backend.lock();
        let key = (node.clone(), attempt);
        let had_lease = ledger.live_lease(&key).is_some();
        let had_session = ledger.sessions.remove(&key).is_some();
        if cause == LossCause::LeaseGone {
            ledger.leases.remove(&key);
        }
        if !(had_lease || had_session) {
            return false;
        }
        ledger.report_lost(&key, cause);
        true
    }

    fn fair_progress(&mut self) -> usize {
        let mut ledger = self.backend.lock();
        let waiting: Vec<ResourceKey> = ledger
            .sessions
            .iter()
            .filter(|(_, session)| !session.joined)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &waiting {
            if let Some(session) = ledger.sessions.get_mut(key) {
                session.joined = true;
            }
            ledger.report_bootstrap(key, BootstrapEvent::Joined);
        }
        waiting.len()
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        std::mem::take(&mut self.backend.lock().observations)
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn live_resources(&self) -> LiveResources {
        let ledger = self.backend.lock();
        let leases = ledger
            .leases
            .iter()
            .filter(|(_, leases)| !leases.is_empty())
            .map(|(key, leases)| (key.clone(), u32::try_from(leases.len()).unwrap_or(u32::MAX)))
            .collect();
        let sessions = ledger.sessions.keys().map(|key| (key.clone(), 1)).collect();
        LiveResources { leases, sessions }
    }

    fn take_ledger_alarms(&mut self) -> Vec<String> {
        std::mem::take(&mut self.backend.lock().alarms)
    }

    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.backend.lock().lease_owners.get(lease).cloned()
    }

    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.backend.lock().session_owners.get(session).cloned()
    }

    fn counters(&self) -> SubstrateCounters {
        self.backend.lock().counters
    }

    fn describe_work(&self) -> String {
        let ledger = self.backend.lock();
        let hung = ledger.hangs.values().filter(|s| !s.released).count();
        format!(
            "{} task(s) queued ({} runnable), {hung} hung call(s), {} scripted fault(s) unused",
            self.spawner.len(),
            self.spawner.ready_count(),
            ledger.scripts.len()
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
    use std::task::Waker;

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
