//! The conformance kit's battery (seeds × modes) against a provider
//! program, through the same adapter and oracle as Level 2.
//!
//! [`ExecScriptable`] is an [`ExecPlugin`] that gives the harness its hands
//! and eyes — the kit's [`ScriptablePlugin`] — over the protocol's battery
//! hooks (`docs/plugin-protocol.md` §6.3): faults are armed with
//! `inject_fault` for exactly the request they are scripted for, hung calls
//! are held by the program until `release`, stream events come from `emit`,
//! losses from `lose_node`, and the ledger of live resources is the
//! program's own answer to `live`.
//!
//! [`ExecSubstrate`] puts it behind the real [`PluginBackendAdapter`] under
//! the harness. The kit's [`PluginSubstrate`](provisioning_conformance::PluginSubstrate)
//! cannot host it: it polls work once on a [`ManualSpawner`] without a
//! runtime and expects every call to finish in that poll, while a program's
//! reply arrives over a pipe a moment later. So this substrate follows Level
//! 3 (`crates/provisioning-process/tests/level3/substrate.rs`): work is polled
//! on the harness thread inside the substrate's own tokio runtime, and
//! "run everything" polls again until no call is waiting for a reply (held
//! calls excepted), within [`WORK_QUIET_WAIT_MAX`]; "run one" polls one task
//! once and may leave its call in flight, a slow call the trace can time
//! out. The program's timing is not the trace's, so the substrate is not
//! deterministic and G18/G20 are not checked.
//!
//! A released call is performed by the program at once, so the substrate
//! polls the ready work right after a release: the call's answer then
//! arrives with the machine it made (unlike Level 2, where a released call
//! acts only when next polled).
//!
//! The program and its machines outlive a crash of the harness's controller
//! ([`ScriptablePlugin::survives_controller_crash`]); an orphan is destroyed
//! through the program's own `destroy_node`, found by its `live` answer.
//!
//! Every substrate serves a run of its own (the harness's run is renamed on
//! the way to the program), so substrates never see each other's machines
//! even when the program keeps them in one place, and its teardown destroys
//! whatever the program still holds for that run.
//!
//! [`run_battery_against`] runs the battery, or says why it cannot.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use provisioning::effect::SessionHandle;
use provisioning::observe::LossCause;
use provisioning::spawn::{ManualSpawner, RunOrder, Spawner};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{
    EndpointLookup, LeaseHandle, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, Observation, RunId,
};
use provisioning_conformance::contract::PluginMethod;
use provisioning_conformance::harness::{PROVIDER_KIND, RUN_NAME};
use provisioning_conformance::level3::{WorkBounds, run_work_reporting};
use provisioning_conformance::plugin_substrate::PluginBackend;
use provisioning_conformance::substrate::{
    CallRecord, Capabilities, FaultQueue, LiveResources, ResourceKey, Substrate, SubstrateCounters,
};
use provisioning_conformance::trace::{Fault, FaultTarget, StreamEvent, WorkStep};
use provisioning_conformance::{Battery, BatteryReport, Mode, ScriptablePlugin};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginBackendAdapter, PluginError, ProvisionPlugin,
};
use serde_json::json;

use crate::wire::{EmitResult, Hello, LiveResult, LoseResult, ReleaseResult};
use crate::{Arm, ExecConfig, ExecError, ExecPlugin};

/// The hooks without which the battery cannot run: the honest ledger and
/// the stream events (the fair tail needs sessions to join).
pub const REQUIRED_HOOKS: [&str; 2] = ["live", "emit"];

/// The default number of seeds per mode.
pub const DEFAULT_BATTERY_SEEDS: usize = 8;

/// Evaluations spent shrinking a failure: each starts the program again.
pub const BATTERY_SHRINK_BUDGET: usize = 32;

/// How long running work waits for the program's replies.
pub const WORK_QUIET_WAIT_MAX: Duration = Duration::from_secs(20);

/// How running work is bounded: looking again every 200 µs while a reply is
/// on its way (the rounds are the wait bound divided by the poll interval,
/// so that the time bound is the one that bites).
const WORK: WorkBounds = WorkBounds {
    quiet_wait_max: WORK_QUIET_WAIT_MAX,
    poll_interval: Duration::from_micros(200),
    rounds_max: 100_000,
};

/// The bound on one test-hook call; a program that misses it is treated as
/// unresponsive for the rest of its substrate's run.
const HOOK_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a program has to exit after its stdin closed at teardown.
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// The runtime's worker threads (the harness thread polls the executor's work).
const RUNTIME_WORKERS: usize = 1;

/// Substrates started by this process, for unique run names.
static SUBSTRATES: AtomicU64 = AtomicU64::new(0);

/// The protocol's name of a fault the battery scripts, if it has one.
fn fault_name(fault: Fault) -> Option<&'static str> {
    match fault {
        Fault::Definite => Some("definite"),
        Fault::AmbiguousDone => Some("ambiguous_done"),
        Fault::AmbiguousUndone => Some("ambiguous_undone"),
        Fault::Hang => Some("hang"),
        Fault::NotReady => Some("not_ready"),
        Fault::Succeed | Fault::Panic => None,
    }
}

fn stage_name(stage: BootstrapProgress) -> &'static str {
    match stage {
        BootstrapProgress::Created => "created",
        BootstrapProgress::Connecting => "connecting",
        BootstrapProgress::Connected => "connected",
        BootstrapProgress::Streaming => "streaming",
        BootstrapProgress::BootChecking => "boot_checking",
        BootstrapProgress::AgentStarting => "agent_starting",
        BootstrapProgress::WaitingForJoin => "waiting_for_join",
    }
}

fn failure_name(failure: BootstrapFailure) -> &'static str {
    match failure {
        BootstrapFailure::ConnectFailed => "connect_failed",
        BootstrapFailure::BootCheckFailed => "boot_check_failed",
        BootstrapFailure::StartFailed => "start_failed",
        BootstrapFailure::JoinFailed => "join_failed",
        BootstrapFailure::StreamError => "stream_error",
    }
}

fn cause_name(cause: LossCause) -> &'static str {
    match cause {
        LossCause::AgentGone => "agent_gone",
        LossCause::LeaseGone => "lease_gone",
        LossCause::WorkloadExited | LossCause::WorkloadEnded(_) => "workload_exited",
    }
}

/// The `emit` arguments of a stream event.
fn emit_args(event: StreamEvent) -> serde_json::Value {
    match event {
        StreamEvent::Progress(stage) => json!({"event": "progress", "stage": stage_name(stage)}),
        StreamEvent::Joined => json!({"event": "joined"}),
        StreamEvent::Converged => json!({"event": "converged"}),
        StreamEvent::Closed => json!({"event": "closed"}),
        StreamEvent::Failed(failure) => json!({
            "event": "failed",
            "failure": failure_name(failure),
            "detail": "scripted stream failure",
        }),
    }
}

/// Why the battery cannot run against a program, if it cannot.
pub fn battery_unavailable(hello: &Hello) -> Option<String> {
    let missing: Vec<&str> = REQUIRED_HOOKS
        .into_iter()
        .filter(|hook| !hello.has_hook(hook))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "program {:?} does not implement the battery hook(s) {} (docs/plugin-protocol.md §6.3)",
            hello.program,
            missing.join(", ")
        )
    })
}

/// What the harness-side bookkeeping of an [`ExecScriptable`] holds.
#[derive(Debug, Default)]
struct ScriptState {
    faults: FaultQueue<PluginMethod>,
    next_call: u64,
    /// Calls whose future has not ended.
    in_flight: BTreeSet<u64>,
    /// Calls the program holds (a `hang`), in the order it got them — the
    /// order `release` lets them go. A call stays here after its future
    /// was dropped: the program still holds it.
    held: VecDeque<u64>,
    counters: SubstrateCounters,
    lease_owners: BTreeMap<LeaseHandle, ResourceKey>,
    session_owners: BTreeMap<SessionHandle, ResourceKey>,
}

/// An [`ExecPlugin`] the conformance harness can drive. See the
/// [module docs](self).
///
/// # Assumptions
/// The hooks ([`ScriptablePlugin`]'s methods) are called from a thread that
/// is not running async code (the harness's); they wait for the program on
/// the runtime of `handle`, each within a bound. The plugin calls are polled
/// inside that runtime's context.
pub struct ExecScriptable {
    plugin: ExecPlugin,
    hello: Hello,
    handle: tokio::runtime::Handle,
    /// The run the program sees instead of the harness's.
    run: RunId,
    state: Mutex<ScriptState>,
    /// Set once a hook got no answer in time: later hooks do not wait.
    unresponsive: AtomicBool,
}

impl fmt::Debug for ExecScriptable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecScriptable")
            .field("program", &self.hello.program)
            .field("run", &self.run)
            .finish_non_exhaustive()
    }
}

impl ExecScriptable {
    /// Drives `plugin`, whose program answered `hello`, serving `run` at
    /// the program; hooks wait on `handle`.
    pub fn new(
        plugin: ExecPlugin,
        hello: Hello,
        handle: tokio::runtime::Handle,
        run: RunId,
    ) -> Self {
        ExecScriptable {
            plugin,
            hello,
            handle,
            run,
            state: Mutex::new(ScriptState::default()),
            unresponsive: AtomicBool::new(false),
        }
    }

    /// The program's handshake answer.
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// Calls whose reply the harness is waiting for (held calls excepted).
    pub fn busy_calls(&self) -> usize {
        let state = self.lock();
        state
            .in_flight
            .iter()
            .filter(|call| !state.held.contains(call))
            .count()
    }

    fn lock(&self) -> MutexGuard<'_, ScriptState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the program can produce `fault` on a call of `method`.
    fn offers(&self, method: PluginMethod, fault: Fault) -> bool {
        match fault {
            Fault::Succeed => true,
            Fault::Panic => false,
            Fault::NotReady if method != PluginMethod::LookupEndpoint => false,
            Fault::Hang if !self.hello.has_hook("release") => false,
            fault => {
                fault_name(fault).is_some_and(|name| self.hello.offers_fault(method.name(), name))
            }
        }
    }

    /// The key as the program sees it: the substrate's own run.
    fn program_key(&self, key: &AttemptKey) -> AttemptKey {
        AttemptKey {
            run_id: self.run.clone(),
            node: key.node.clone(),
            attempt: key.attempt,
        }
    }

    fn harness_key(&self, key: &AttemptKey) -> AttemptKey {
        AttemptKey {
            run_id: RunId::new(RUN_NAME),
            node: key.node.clone(),
            attempt: key.attempt,
        }
    }

    /// Starts the bookkeeping of one call of `method`: takes its scripted
    /// fault and marks it in flight until the ticket is dropped.
    fn begin(&self, method: PluginMethod) -> Ticket<'_> {
        let mut state = self.lock();
        let fault = state.faults.take(&method, |f| self.offers(method, f));
        if let Some(fault) = fault {
            state.counters.faults_applied += 1;
            if fault == Fault::Hang {
                state.counters.hangs += 1;
            }
        }
        let serial = state.next_call;
        state.next_call += 1;
        state.in_flight.insert(serial);
        Ticket {
            owner: self,
            serial,
            fault: fault.unwrap_or(Fault::Succeed),
        }
    }

    fn count_creation(&self, adopted: bool) {
        let mut state = self.lock();
        if adopted {
            state.counters.adoptions += 1;
        } else {
            state.counters.creations += 1;
        }
    }

    /// Calls a test hook and waits for its answer (bounded).
    fn hook<T: serde::de::DeserializeOwned>(
        &self,
        method: &'static str,
        key: Option<&AttemptKey>,
        args: serde_json::Value,
    ) -> Option<T> {
        if self.unresponsive.load(Ordering::SeqCst) {
            return None;
        }
        let call = self.plugin.hook::<T>(method, key, args);
        let answer = self
            .handle
            .block_on(async { tokio::time::timeout(HOOK_TIMEOUT, call).await });
        match answer {
            Ok(Ok(value)) => Some(value),
            Ok(Err(error)) => {
                if matches!(error, PluginError::Ambiguous(_)) {
                    self.unresponsive.store(true, Ordering::SeqCst);
                }
                tracing::warn!(program = %self.plugin.name(), "{method} failed: {error}");
                None
            }
            Err(_) => {
                self.unresponsive.store(true, Ordering::SeqCst);
                tracing::error!(
                    program = %self.plugin.name(),
                    "{method} got no answer within {HOOK_TIMEOUT:?}; the program is treated as unresponsive"
                );
                None
            }
        }
    }

    /// The program's ledger of the substrate's run, and what it says about
    /// who owns which handle (remembered: a handle is issued for one key).
    fn ledger(&self) -> Option<LiveResult> {
        let live: LiveResult = self.hook("live", None, json!({"run": self.run.as_str()}))?;
        let mut state = self.lock();
        for lease in &live.leases {
            let key = lease.key.to_key();
            state
                .lease_owners
                .entry(LeaseHandle(lease.lease.clone()))
                .or_insert((key.node, key.attempt));
        }
        for session in &live.sessions {
            let key = session.key.to_key();
            state
                .session_owners
                .entry(SessionHandle(session.session.clone()))
                .or_insert((key.node, key.attempt));
        }
        Some(live)
    }

    /// The live sessions, in the kit's key order.
    fn sessions(&self) -> Vec<(ResourceKey, bool)> {
        let Some(live) = self.ledger() else {
            return Vec::new();
        };
        let sessions: BTreeMap<ResourceKey, bool> = live
            .sessions
            .iter()
            .map(|s| {
                let key = s.key.to_key();
                ((key.node, key.attempt), s.joined)
            })
            .collect();
        sessions.into_iter().collect()
    }

    fn emit(&self, key: &ResourceKey, event: StreamEvent) -> bool {
        let key = self.resource_key(key);
        self.hook::<EmitResult>("emit", Some(&key), emit_args(event))
            .is_some_and(|r| r.emitted)
    }

    fn resource_key(&self, (node, attempt): &ResourceKey) -> AttemptKey {
        AttemptKey {
            run_id: self.run.clone(),
            node: node.clone(),
            attempt: *attempt,
        }
    }

    fn release(&self, which: &str) -> usize {
        let Some(result) = self.hook::<ReleaseResult>("release", None, json!({"which": which}))
        else {
            return 0;
        };
        let released = usize::try_from(result.released).unwrap_or(usize::MAX);
        let mut state = self.lock();
        for _ in 0..released {
            state.held.pop_front();
        }
        released
    }

    /// Destroys everything the program still holds for the substrate's run.
    fn destroy_everything(&self) {
        let Some(live) = self.ledger() else {
            return;
        };
        for lease in live.leases {
            self.destroy(&lease.key.to_key(), &lease.lease);
        }
    }

    /// One `destroy_node` of the program's, outside the harness's calls.
    fn destroy(&self, key: &AttemptKey, lease: &str) {
        if self.unresponsive.load(Ordering::SeqCst) {
            return;
        }
        let lease = LeaseHandle(lease.to_owned());
        let destroyed = self.handle.block_on(async {
            tokio::time::timeout(
                HOOK_TIMEOUT,
                self.plugin.destroy_node_armed(key, &lease, Arm::NONE),
            )
            .await
        });
        if !matches!(destroyed, Ok(Ok(()) | Err(PluginError::NotFound(_)))) {
            tracing::warn!(program = %self.plugin.name(), "destroy of {key} failed");
        }
    }

    /// Stops the program (see [`ExecPlugin::close`]).
    fn close(&self) {
        self.handle.block_on(self.plugin.close(EXIT_GRACE));
    }
}

/// One call's bookkeeping: in flight until dropped.
struct Ticket<'a> {
    owner: &'a ExecScriptable,
    serial: u64,
    fault: Fault,
}

impl Ticket<'_> {
    /// Marks a hung call held once its request is on its way.
    fn sent(&self) {
        if self.fault == Fault::Hang {
            self.owner.lock().held.push_back(self.serial);
        }
    }

    fn arm<'b>(&self, sent: &'b (dyn Fn() + Send + Sync)) -> Arm<'b> {
        Arm {
            fault: fault_name(self.fault),
            sent: Some(sent),
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.owner.lock().in_flight.remove(&self.serial);
    }
}

#[async_trait]
impl ProvisionPlugin for ExecScriptable {
    /// The harness's provider kind, which its shapes name.
    fn kind(&self) -> &str {
        PROVIDER_KIND
    }

    fn attach(&self, sink: ObservationSink) {
        self.plugin.attach(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let ticket = self.begin(PluginMethod::CreateNode);
        let sent = || ticket.sent();
        let key = self.program_key(key);
        let created = self
            .plugin
            .create_node_armed(&key, spec, ticket.arm(&sent))
            .await;
        if let Ok(lease) = &created {
            self.count_creation(lease.adopted);
        }
        created
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        let ticket = self.begin(PluginMethod::LookupEndpoint);
        let sent = || ticket.sent();
        let key = self.program_key(key);
        self.plugin
            .lookup_endpoint_armed(&key, lease, ticket.arm(&sent))
            .await
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        let ticket = self.begin(PluginMethod::StartBootstrap);
        let sent = || ticket.sent();
        let key = self.program_key(key);
        let started = self
            .plugin
            .start_bootstrap_armed(&key, request, ticket.arm(&sent))
            .await;
        if let Ok(session) = &started {
            self.count_creation(session.adopted);
        }
        started
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        let ticket = self.begin(PluginMethod::CompleteBootstrap);
        let sent = || ticket.sent();
        let key = self.program_key(key);
        self.plugin
            .session_call_armed("complete_bootstrap", &key, session, ticket.arm(&sent))
            .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        let ticket = self.begin(PluginMethod::CancelBootstrap);
        let sent = || ticket.sent();
        let key = self.program_key(key);
        self.plugin
            .session_call_armed("cancel_bootstrap", &key, session, ticket.arm(&sent))
            .await
    }

    async fn destroy_node(&self, key: &AttemptKey, lease: &LeaseHandle) -> Result<(), PluginError> {
        let ticket = self.begin(PluginMethod::DestroyNode);
        let sent = || ticket.sent();
        let key = self.program_key(key);
        self.plugin
            .destroy_node_armed(&key, lease, ticket.arm(&sent))
            .await
    }

    async fn list_nodes(&self, _run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        let ticket = self.begin(PluginMethod::ListNodes);
        let sent = || ticket.sent();
        let listed = self
            .plugin
            .list_nodes_armed(&self.run, ticket.arm(&sent))
            .await?;
        Ok(listed
            .into_iter()
            .map(|node| ListedNode {
                key: self.harness_key(&node.key),
                lease: node.lease,
            })
            .collect())
    }
}

impl ScriptablePlugin for ExecScriptable {
    /// A program's replies arrive when they arrive: not reproducible.
    fn deterministic(&self) -> bool {
        false
    }

    fn script_fault(&self, method: Option<PluginMethod>, fault: Fault) -> bool {
        let possible = match method {
            Some(method) => self.offers(method, fault),
            None => PluginMethod::ALL.into_iter().any(|m| self.offers(m, fault)),
        };
        possible && self.lock().faults.push(method, fault)
    }

    fn stop_faults(&self) {
        self.lock().faults.stop();
    }

    fn release_oldest_hang(&self) -> bool {
        if self.lock().held.is_empty() {
            return false;
        }
        self.release("oldest") > 0
    }

    fn release_all_hangs(&self) -> usize {
        if self.lock().held.is_empty() {
            return 0;
        }
        self.release("all")
    }

    fn stream_event(&self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        let sessions = self.sessions();
        let nth = (session as usize).checked_rem(sessions.len())?;
        let (key, _) = sessions.into_iter().nth(nth)?;
        self.emit(&key, event).then_some(key)
    }

    fn lose_node_now(&self, key: &AttemptKey, cause: LossCause) -> bool {
        if !self.hello.lose_node {
            return false;
        }
        let args = if cause == LossCause::LeaseGone {
            json!({})
        } else if self.hello.has_hook("lose_cause") {
            json!({"cause": cause_name(cause)})
        } else {
            return false;
        };
        let key = self.program_key(key);
        self.hook::<LoseResult>("lose_node", Some(&key), args)
            .is_some_and(|r| r.lost)
    }

    fn progress_fairly(&self) -> usize {
        self.sessions()
            .into_iter()
            .filter(|(_, joined)| !joined)
            .filter(|(key, _)| self.emit(key, StreamEvent::Joined))
            .count()
    }

    fn live(&self) -> LiveResources {
        let mut resources = LiveResources::default();
        let Some(live) = self.ledger() else {
            return resources;
        };
        for lease in live.leases {
            let key = lease.key.to_key();
            *resources.leases.entry((key.node, key.attempt)).or_insert(0) += 1;
        }
        for session in live.sessions {
            let key = session.key.to_key();
            *resources
                .sessions
                .entry((key.node, key.attempt))
                .or_insert(0) += 1;
        }
        resources
    }

    fn owner_of_lease(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        if let Some(owner) = self.lock().lease_owners.get(lease) {
            return Some(owner.clone());
        }
        self.ledger()?;
        self.lock().lease_owners.get(lease).cloned()
    }

    fn owner_of_session(&self, session: &SessionHandle) -> Option<ResourceKey> {
        if let Some(owner) = self.lock().session_owners.get(session) {
            return Some(owner.clone());
        }
        self.ledger()?;
        self.lock().session_owners.get(session).cloned()
    }

    fn plugin_counters(&self) -> SubstrateCounters {
        self.lock().counters
    }

    /// The program's machines are its own (a process, and whatever it
    /// keeps): a crash of the harness's controller leaves them and the
    /// program running, and calls in flight go on.
    fn survives_controller_crash(&self) -> bool {
        true
    }

    /// Destroys an orphan the way the host's orphan collection does: the
    /// key's leases, as the program's ledger lists them, each through the
    /// program's own `destroy_node`. Whether anything was live comes from
    /// the ledger.
    fn destroy_orphan(&self, key: &AttemptKey) -> bool {
        let key = self.program_key(key);
        let Some(live) = self.ledger() else {
            return false;
        };
        let had_session = live.sessions.iter().any(|s| s.key.to_key() == key);
        let leases: Vec<String> = live
            .leases
            .into_iter()
            .filter(|l| l.key.to_key() == key)
            .map(|l| l.lease)
            .collect();
        for lease in &leases {
            self.destroy(&key, lease);
        }
        !leases.is_empty() || had_session
    }

    fn describe_plugin(&self) -> String {
        let state = self.lock();
        format!(
            "program {:?}: {} call(s) in flight, {} held until released, {} scripted fault(s) unused{}",
            self.hello.program,
            state.in_flight.len(),
            state.held.len(),
            state.faults.len(),
            if self.unresponsive.load(Ordering::SeqCst) {
                ", unresponsive to test hooks"
            } else {
                ""
            }
        )
    }
}

/// The battery's substrate over a provider program. See the
/// [module docs](self).
pub struct ExecSubstrate {
    runtime: Option<tokio::runtime::Runtime>,
    plugin: Arc<ExecScriptable>,
    backend: Arc<PluginBackend>,
    spawner: ManualSpawner,
    observations: Arc<Mutex<Vec<Observation>>>,
}

impl fmt::Debug for ExecSubstrate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecSubstrate")
            .field("plugin", &self.plugin)
            .finish_non_exhaustive()
    }
}

impl ExecSubstrate {
    /// Starts a fresh process of the program of `config` (told that a
    /// harness drives it) on a runtime of its own, behind a fresh adapter.
    ///
    /// # Errors
    /// When the runtime cannot be built, or the program cannot be started
    /// or fails its handshake.
    pub fn start(config: &ExecConfig) -> Result<Self, ExecError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_WORKERS)
            .thread_name("exec-battery")
            .enable_all()
            .build()
            .map_err(|source| ExecError::Spawn {
                command: config.command.clone(),
                source,
            })?;
        let plugin = runtime.block_on(ExecPlugin::start(config.clone().with_harness()))?;
        let hello = plugin.hello().ok_or_else(|| ExecError::Handshake {
            command: config.command.clone(),
            why: "the program exited right after its handshake".to_owned(),
        })?;
        let serial = SUBSTRATES.fetch_add(1, Ordering::Relaxed);
        let run = RunId::new(format!("battery-{}-{serial}", std::process::id()));
        let plugin = Arc::new(ExecScriptable::new(
            plugin,
            hello,
            runtime.handle().clone(),
            run,
        ));
        let observations = Arc::new(Mutex::new(Vec::new()));
        let buffer = observations.clone();
        let sink = ObservationSink::new(move |observation| {
            buffer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(observation);
        });
        let adapter = PluginBackendAdapter::single(plugin.clone(), sink);
        Ok(ExecSubstrate {
            runtime: Some(runtime),
            plugin,
            backend: Arc::new(PluginBackend::new(adapter)),
            spawner: ManualSpawner::new(),
            observations,
        })
    }

    /// The plugin.
    pub fn plugin(&self) -> &Arc<ExecScriptable> {
        &self.plugin
    }

    /// Runs `step` of the work inside the runtime (the kit's Level 3 work
    /// polling): everything until no call waits for a reply and nothing is
    /// ready (held calls may stay), or one task once. Returns the polls.
    fn run_work_step(&self, step: WorkStep) -> usize {
        let Some(runtime) = &self.runtime else {
            return 0;
        };
        let _context = runtime.enter();
        run_work_reporting(
            &self.spawner,
            step,
            &WORK,
            || self.plugin.busy_calls(),
            |waited| {
                tracing::warn!(
                    "battery: work did not settle within {waited:?}: {}",
                    self.describe_work()
                );
            },
        )
    }

    /// Polls what is ready once (the released calls, whose replies are
    /// already in), without waiting for any further reply.
    fn run_released(&self) {
        if let Some(runtime) = &self.runtime {
            let _context = runtime.enter();
            self.spawner.run_all(RunOrder::Fifo);
        }
    }

    fn key(node: &LogicalNodeId, attempt: NodeAttemptId) -> AttemptKey {
        AttemptKey {
            run_id: RunId::new(RUN_NAME),
            node: node.clone(),
            attempt,
        }
    }
}

impl Drop for ExecSubstrate {
    /// Lets held calls go, destroys what the program still holds for the
    /// run, drops queued work and stops the program.
    fn drop(&mut self) {
        self.plugin.stop_faults();
        self.plugin.release_all_hangs();
        self.plugin.destroy_everything();
        if let Some(runtime) = self.runtime.take() {
            {
                let _context = runtime.enter();
                self.spawner.clear();
            }
            self.plugin.close();
            runtime.shutdown_timeout(EXIT_GRACE);
        }
    }
}

impl Substrate for ExecSubstrate {
    type Backend = PluginBackend;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            deterministic: false,
        }
    }

    fn backend(&self) -> Arc<PluginBackend> {
        self.backend.clone()
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        Arc::new(self.spawner.clone())
    }

    fn script(&mut self, target: FaultTarget, fault: Fault) -> bool {
        self.plugin.script_target(target, fault)
    }

    fn stop_faults(&mut self) {
        self.plugin.stop_faults();
    }

    fn run_work(&mut self, step: WorkStep) -> usize {
        self.run_work_step(step)
    }

    fn has_runnable_work(&self) -> bool {
        self.spawner.ready_count() > 0 || self.plugin.busy_calls() > 0
    }

    /// Releases at the program, which performs the call at once; the
    /// call's own task is then polled, so that its answer is where the
    /// program's machine is (a crashed controller's call is known to have
    /// made what it made as soon as it exists).
    fn release_oldest_hang(&mut self) -> bool {
        let released = self.plugin.release_oldest_hang();
        if released {
            self.run_released();
        }
        released
    }

    fn release_all_hangs(&mut self) -> usize {
        let released = self.plugin.release_all_hangs();
        if released > 0 {
            self.run_released();
        }
        released
    }

    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        self.plugin.stream_event(session, event)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        self.plugin
            .lose_node_now(&ExecSubstrate::key(node, attempt), cause)
    }

    fn fair_progress(&mut self) -> usize {
        self.plugin.progress_fairly()
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        std::mem::take(
            &mut *self
                .observations
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.backend.calls().take()
    }

    fn live_resources(&self) -> LiveResources {
        self.plugin.live()
    }

    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.plugin.owner_of_lease(lease)
    }

    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.plugin.owner_of_session(session)
    }

    fn counters(&self) -> SubstrateCounters {
        self.plugin.plugin_counters()
    }

    fn survives_controller_crash(&self) -> bool {
        self.plugin.survives_controller_crash()
    }

    fn destroy_orphan(&mut self, (node, attempt): &ResourceKey) -> bool {
        self.plugin
            .destroy_orphan(&ExecSubstrate::key(node, *attempt))
    }

    fn describe_work(&self) -> String {
        format!(
            "{} task(s) queued ({} runnable), {}",
            self.spawner.len(),
            self.spawner.ready_count(),
            self.plugin.describe_plugin()
        )
    }
}

/// How to run the battery against a program.
#[derive(Clone, Debug)]
pub struct BatteryOptions {
    /// Seeds per mode.
    pub seeds: usize,
    /// The modes.
    pub modes: Vec<Mode>,
    /// The command that reruns the battery, for reproduction lines.
    pub reproduce_with: String,
    /// Whether `PROVISIONING_SEED`, `PROVISIONING_MODE`, `PROVISIONING_TRACE`
    /// and `PROVISIONING_SEEDS` from the environment apply (so that a
    /// printed reproduction line runs exactly the failing case).
    pub env_overrides: bool,
}

impl Default for BatteryOptions {
    fn default() -> Self {
        BatteryOptions {
            seeds: DEFAULT_BATTERY_SEEDS,
            modes: Mode::ALL.to_vec(),
            reproduce_with: "provision conformance --plugin CMD".to_owned(),
            env_overrides: false,
        }
    }
}

/// What running the battery against a program came to.
#[derive(Debug)]
pub enum BatteryOutcome {
    /// The battery ran; the report says whether it passed.
    Ran {
        /// The program's handshake answer.
        hello: Hello,
        /// The report.
        report: Box<BatteryReport>,
    },
    /// The battery could not run against this program (not a failure).
    Skipped(String),
    /// The battery could not be run at all (a failure): the program could
    /// not be started, or the battery stopped abnormally.
    Broken(String),
}

impl BatteryOutcome {
    /// Whether nothing failed (a skipped battery fails nothing).
    pub fn is_success(&self) -> bool {
        match self {
            BatteryOutcome::Ran { report, .. } => report.passed(),
            BatteryOutcome::Skipped(_) => true,
            BatteryOutcome::Broken(_) => false,
        }
    }
}

impl fmt::Display for BatteryOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatteryOutcome::Ran { hello, report } => {
                let mut hooks = hello.hooks.clone();
                if hello.lose_node {
                    hooks.push("lose_node".to_owned());
                }
                writeln!(
                    f,
                    "battery hooks: {}; faults offered: {}",
                    hooks.join(", "),
                    hello.faults.len()
                )?;
                write!(f, "{report}")?;
                if !report.passed() {
                    writeln!(f, "battery: FAILED")?;
                }
                Ok(())
            }
            BatteryOutcome::Skipped(why) => writeln!(f, "battery: SKIPPED: {why}"),
            BatteryOutcome::Broken(why) => writeln!(f, "battery: FAILED: {why}"),
        }
    }
}

/// Runs the battery (seeds × modes, through the real adapter and the kit's
/// oracle) against the program of `config`, a fresh process per harness run.
///
/// Runs on the calling thread and blocks it: call it from a thread that is
/// not running async code (for example `std::thread::spawn`).
///
/// # Caveats
/// The program is started once first to read its handshake: without the
/// hooks of [`REQUIRED_HOOKS`] the battery is [`BatteryOutcome::Skipped`].
/// Every wait on the program is bounded, so the battery ends.
pub fn run_battery_against(config: &ExecConfig, options: &BatteryOptions) -> BatteryOutcome {
    let hello = match ExecSubstrate::start(config) {
        Ok(probe) => probe.plugin().hello().clone(),
        Err(error) => return BatteryOutcome::Broken(error.to_string()),
    };
    if let Some(why) = battery_unavailable(&hello) {
        return BatteryOutcome::Skipped(why);
    }
    let factory_config = config.clone();
    let factory = move || match ExecSubstrate::start(&factory_config) {
        Ok(substrate) => substrate,
        // The factory cannot fail otherwise; the panic is caught below and
        // reported as a broken battery.
        Err(error) => panic!("the provider program could not be started for a run: {error}"),
    };
    let name = format!(
        "battery against {:?} (exec, PluginBackendAdapter)",
        hello.program
    );
    let mut battery = Battery::new(name, factory)
        .seed_count(options.seeds)
        .modes(options.modes.clone())
        .shrink_budget(BATTERY_SHRINK_BUDGET)
        .max_failures(1)
        .require_vacuity(false)
        .reproduce_with(options.reproduce_with.clone());
    if options.env_overrides {
        battery = match battery.with_env_overrides() {
            Ok(battery) => battery,
            Err(error) => return BatteryOutcome::Broken(error.to_string()),
        };
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| battery.run())) {
        Ok(report) => BatteryOutcome::Ran {
            hello,
            report: Box::new(report),
        },
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "the battery panicked".to_owned());
            BatteryOutcome::Broken(why)
        }
    }
}
