//! What the substrate, its backend and the plugin's observation sink share.
//!
//! Two kinds of threads touch it: the harness thread (substrate methods,
//! and backend calls, which the harness polls), and the tokio threads on
//! which the plugin reports facts through its sink. Everything sits behind
//! one mutex that is never held across an `.await` or a plugin call; a
//! condition variable lets the harness thread wait (bounded) for a fact the
//! plugin reports in the background.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use provisioning::effect::{EffectRequest, SessionHandle};
use provisioning::observe::BootstrapEvent;
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{
    EffectError, EffectKind, EffectOutput, LeaseHandle, Observation, Operation, OperationId,
};
use provisioning_conformance::substrate::{FaultQueue, ResourceKey, SubstrateCounters};
use provisioning_conformance::trace::{Fault, FaultTarget};

/// How many observations may wait for the harness (a safety bound: every
/// harness step takes them, and one step reports a handful).
const INBOX_OBSERVATIONS_MAX: usize = 4096;

/// Whether the substrate can turn `fault` into a real operating-system event
/// for a call of `kind`. See the module docs of `backend` for the mapping.
pub(crate) fn producible(kind: EffectKind, fault: Fault) -> bool {
    match fault {
        Fault::Succeed | Fault::Definite => true,
        Fault::NotReady => kind == EffectKind::LookupEndpoint,
        // A start hangs on a stopped agent; a create is held before it
        // reaches the plugin, as a slow provider API would hold it.
        Fault::Hang => matches!(kind, EffectKind::StartBootstrap | EffectKind::CreateLease),
        // A lost reply or a panic is no event of the operating system: the
        // in-memory levels cover them.
        Fault::AmbiguousDone | Fault::AmbiguousUndone | Fault::Panic => false,
    }
}

/// Where the boot gate of a session stands (see `os_faults::Gates`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GateState {
    /// The verify command waits on the gate.
    Closed,
    /// The gate was opened with a passing verdict.
    Passed,
    /// The gate was opened with a failing verdict.
    Failed,
}

/// The substrate's view of one bootstrap session, from the plugin's replies
/// and the facts it reported.
#[derive(Clone, Debug)]
pub(crate) struct SessionTrack {
    /// The handle the plugin returned, once it answered.
    pub(crate) handle: Option<SessionHandle>,
    /// The plugin answered the start with a session (the agent took the order).
    pub(crate) accepted: bool,
    /// The agent reported that it runs its verify commands: its gate reader
    /// is about to open.
    pub(crate) boot_checking: bool,
    /// The boot gate.
    pub(crate) gate: GateState,
    /// The agent joined the swarm.
    pub(crate) joined: bool,
    /// Nothing more will happen to the session (closed, failed, cancelled,
    /// or its node is gone).
    pub(crate) ended: bool,
    /// The stage at which the plugin reported it failed, if it did.
    pub(crate) failure: Option<BootstrapFailure>,
}

impl SessionTrack {
    fn new() -> Self {
        SessionTrack {
            handle: None,
            accepted: false,
            boot_checking: false,
            gate: GateState::Closed,
            joined: false,
            ended: false,
            failure: None,
        }
    }

    /// Whether the session still runs, as far as the plugin told.
    pub(crate) fn is_live(&self) -> bool {
        !self.ended
    }
}

/// Whether a backend call is working or deliberately stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CallPhase {
    /// Real I/O in progress: settling waits for it.
    Busy,
    /// Its node's agent is stopped (`SIGSTOP`) until released.
    Hung,
}

/// A hung call: a start whose node's agent is stopped, or a create held
/// before it reaches the plugin.
#[derive(Clone, Debug)]
pub(crate) struct Hang {
    /// The node.
    pub(crate) key: ResourceKey,
    /// The hung call.
    pub(crate) op: OperationId,
    /// The stopped agent (`None`: a held create).
    pub(crate) pid: Option<i32>,
    /// Whether `SIGCONT` was sent.
    pub(crate) released: bool,
}

/// How often each operating-system fault was really applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct OsFaultCounts {
    /// Node processes killed with `SIGKILL` (scripted faults, losses, stream errors).
    pub(crate) nodes_killed: u64,
    /// Agents stopped with `SIGSTOP` so that a bootstrap start hung.
    pub(crate) agents_stopped: u64,
    /// Hung agents continued with `SIGCONT`.
    pub(crate) agents_continued: u64,
    /// Creates that failed because the agent program was missing.
    pub(crate) spawn_failures: u64,
    /// Verify commands that failed (a boot gate opened with a failing verdict).
    pub(crate) verify_failures: u64,
    /// Workload starts that failed because the agent program was missing.
    pub(crate) start_failures: u64,
    /// Endpoint lookups answered "not ready" while the agent was held.
    pub(crate) not_ready_answers: u64,
    /// Boot gates opened with a passing verdict.
    pub(crate) gates_passed: u64,
    /// Creates held before they reached the plugin (a slow provider call).
    pub(crate) creates_held: u64,
}

impl OsFaultCounts {
    /// Adds `other` to `self`.
    pub(crate) fn add(&mut self, other: &OsFaultCounts) {
        self.nodes_killed += other.nodes_killed;
        self.agents_stopped += other.agents_stopped;
        self.agents_continued += other.agents_continued;
        self.spawn_failures += other.spawn_failures;
        self.verify_failures += other.verify_failures;
        self.start_failures += other.start_failures;
        self.not_ready_answers += other.not_ready_answers;
        self.gates_passed += other.gates_passed;
        self.creates_held += other.creates_held;
    }

    /// The counts that must not stay at zero over a battery, by name.
    pub(crate) fn required(&self) -> [(&'static str, u64); 8] {
        [
            ("SIGKILL of node processes", self.nodes_killed),
            ("SIGSTOP hang", self.agents_stopped),
            ("SIGCONT release", self.agents_continued),
            ("spawn failure", self.spawn_failures),
            ("failing verify command", self.verify_failures),
            ("held agent not ready", self.not_ready_answers),
            ("boot gate passed", self.gates_passed),
            ("held create", self.creates_held),
        ]
    }
}

/// Everything behind the mutex.
#[derive(Debug, Default)]
pub(crate) struct State {
    scripts: FaultQueue<EffectKind>,
    inbox: Vec<Observation>,
    /// Sessions by key, from start calls and reported facts.
    pub(crate) sessions: BTreeMap<ResourceKey, SessionTrack>,
    /// Handles of sessions that ended: a start that adopts one of them
    /// adopts something over.
    ended_sessions: BTreeSet<SessionHandle>,
    /// Keys whose loss the plugin reported.
    losses: BTreeSet<ResourceKey>,
    calls: BTreeMap<OperationId, CallPhase>,
    /// Hung calls by serial, oldest first.
    pub(crate) hangs: BTreeMap<u64, Hang>,
    next_hang: u64,
    lease_owners: BTreeMap<LeaseHandle, BTreeSet<ResourceKey>>,
    session_owners: BTreeMap<SessionHandle, ResourceKey>,
    alarms: Vec<String>,
    /// Vacuity counters for the harness.
    pub(crate) counters: SubstrateCounters,
    /// Operating-system faults applied.
    pub(crate) os: OsFaultCounts,
}

impl State {
    fn session(&mut self, key: &ResourceKey) -> &mut SessionTrack {
        self.sessions
            .entry(key.clone())
            .or_insert_with(SessionTrack::new)
    }

    /// Marks the session of `key` ended, remembering its handle.
    fn end_session(&mut self, key: &ResourceKey) {
        if let Some(track) = self.sessions.get_mut(key) {
            track.ended = true;
            if let Some(handle) = &track.handle {
                self.ended_sessions.insert(handle.clone());
            }
        }
    }

    /// The live sessions the plugin answered for (a trace's stream events
    /// pick among these), in key order.
    pub(crate) fn live_sessions(&self) -> Vec<ResourceKey> {
        self.sessions
            .iter()
            .filter(|(_, session)| session.is_live() && session.accepted)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Whether the plugin reported the loss of `key`.
    pub(crate) fn lost(&self, key: &ResourceKey) -> bool {
        self.losses.contains(key)
    }

    /// Whether the session of `key` has nothing more to wait for.
    pub(crate) fn session_settled(&self, key: &ResourceKey) -> bool {
        self.sessions
            .get(key)
            .is_none_or(|session| session.ended || session.joined)
    }

    /// Backend calls doing real I/O right now.
    pub(crate) fn busy_calls(&self) -> usize {
        self.calls
            .values()
            .filter(|phase| **phase == CallPhase::Busy)
            .count()
    }

    /// Marks `op` busy (a held create's task doing its call).
    pub(crate) fn mark_busy(&mut self, op: OperationId) {
        self.calls.insert(op, CallPhase::Busy);
    }

    /// Forgets `op`'s mark (its task ended).
    pub(crate) fn unmark_busy(&mut self, op: OperationId) {
        self.calls.remove(&op);
    }

    /// Backend calls hung on a stopped agent.
    pub(crate) fn hung_calls(&self) -> usize {
        self.calls.len() - self.busy_calls()
    }

    /// Scripted faults not used yet.
    pub(crate) fn unused_scripts(&self) -> usize {
        self.scripts.len()
    }

    /// Marks hang `serial` released and its call busy again.
    pub(crate) fn release_hang(&mut self, serial: u64) -> Option<Hang> {
        let hang = self.hangs.get_mut(&serial).filter(|h| !h.released)?;
        hang.released = true;
        let hang = hang.clone();
        if let Some(phase) = self.calls.get_mut(&hang.op) {
            *phase = CallPhase::Busy;
        }
        if hang.pid.is_some() {
            self.os.agents_continued += 1;
        }
        Some(hang)
    }
}

/// The shared state and its condition variable.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// Removes a call from the in-flight registry when the call ends, however
/// it ends (completion, or its future dropped at teardown).
pub(crate) struct InFlight<'a> {
    shared: &'a Shared,
    op: OperationId,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.shared.lock().calls.remove(&self.op);
        self.shared.changed.notify_all();
    }
}

impl Shared {
    /// Locks the state.
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until `done` holds or `timeout` passes. Returns whether it held.
    pub(crate) fn wait_until(&self, timeout: Duration, done: impl Fn(&State) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        // Bounded by the deadline: every wake-up either returns or waits less.
        loop {
            if done(&state) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Queues a fault; `false` when it cannot be produced or is refused.
    pub(crate) fn script(&self, target: FaultTarget, fault: Fault) -> bool {
        let can = match target {
            FaultTarget::Kind(kind) => producible(kind, fault),
            FaultTarget::Any => EffectKind::ALL.into_iter().any(|k| producible(k, fault)),
        };
        can && self.lock().scripts.push(target.kind(), fault)
    }

    /// Drops every scripted fault and accepts no more.
    pub(crate) fn stop_faults(&self) {
        self.lock().scripts.stop();
    }

    /// Takes the fault for the call of `kind` that starts now: one scripted
    /// for the kind first, then one scripted for any call.
    pub(crate) fn take_script(&self, kind: EffectKind) -> Option<Fault> {
        let mut state = self.lock();
        let fault = state.scripts.take(&kind, |fault| producible(kind, fault))?;
        state.counters.faults_applied += 1;
        Some(fault)
    }

    /// Wakes every waiter to look at the state again.
    pub(crate) fn notify(&self) {
        self.changed.notify_all();
    }

    /// Registers a call as in flight (busy) until the guard drops.
    pub(crate) fn call_started(&self, op: OperationId) -> InFlight<'_> {
        self.lock().calls.insert(op, CallPhase::Busy);
        InFlight { shared: self, op }
    }

    /// Records that `op` hangs on the stopped agent `pid` (`None`: a create
    /// held before the plugin). Returns the hang's serial.
    pub(crate) fn hang(&self, key: ResourceKey, op: OperationId, pid: Option<i32>) -> u64 {
        let mut state = self.lock();
        let serial = state.next_hang;
        state.next_hang += 1;
        state.hangs.insert(
            serial,
            Hang {
                key,
                op,
                pid,
                released: false,
            },
        );
        state.calls.insert(op, CallPhase::Hung);
        state.counters.hangs += 1;
        if pid.is_some() {
            state.os.agents_stopped += 1;
        } else {
            state.os.creates_held += 1;
        }
        serial
    }

    /// Whether hang `serial` was released (or has ended).
    pub(crate) fn released(&self, serial: u64) -> bool {
        self.lock()
            .hangs
            .get(&serial)
            .is_none_or(|hang| hang.released)
    }

    /// Forgets hang `serial` (its call ended). Returns it when it was never
    /// released: its agent is still stopped.
    pub(crate) fn end_hang(&self, serial: u64) -> Option<Hang> {
        let mut state = self.lock();
        let hang = state.hangs.remove(&serial)?;
        if hang.released {
            return None;
        }
        if hang.pid.is_some() {
            state.os.agents_continued += 1;
        }
        Some(hang)
    }

    /// Adds to the operating-system fault counts.
    pub(crate) fn count(&self, update: impl FnOnce(&mut OsFaultCounts)) {
        update(&mut self.lock().os);
    }

    /// Notes that a start call for `key` begins: its session may exist from
    /// now on. After an ended session the plugin may start a new one.
    pub(crate) fn session_starting(&self, key: &ResourceKey) {
        let mut state = self.lock();
        let track = state.session(key);
        if track.ended {
            *track = SessionTrack::new();
        }
    }

    /// Updates the gate of `key`'s session.
    pub(crate) fn set_gate(&self, key: &ResourceKey, gate: GateState) {
        let mut state = self.lock();
        state.session(key).gate = gate;
        match gate {
            GateState::Passed => state.os.gates_passed += 1,
            GateState::Failed => state.os.verify_failures += 1,
            GateState::Closed => {}
        }
    }

    /// Raises a G08 alarm.
    pub(crate) fn alarm(&self, alarm: String) {
        self.lock().alarms.push(alarm);
    }

    /// Takes the raised alarms.
    pub(crate) fn take_alarms(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().alarms)
    }

    /// Takes the observations reported since the last call.
    pub(crate) fn take_observations(&self) -> Vec<Observation> {
        std::mem::take(&mut self.lock().inbox)
    }

    /// The key a lease was issued for, when exactly one key holds it.
    pub(crate) fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        let state = self.lock();
        let owners = state.lease_owners.get(lease)?;
        // A pid (and with it a lease name) can be reused by a later agent;
        // then the owner is not known for sure.
        (owners.len() == 1)
            .then(|| owners.first().cloned())
            .flatten()
    }

    /// The key a session was issued for.
    pub(crate) fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.lock().session_owners.get(session).cloned()
    }

    /// Folds a fact the plugin reported through its sink (called on the
    /// plugin's threads as well as the harness thread).
    pub(crate) fn observe(&self, observation: Observation) {
        let key = (observation.node().clone(), observation.attempt());
        let mut state = self.lock();
        match &observation {
            Observation::Bootstrap { event, .. } => match event {
                BootstrapEvent::Progress(BootstrapProgress::BootChecking) => {
                    state.session(&key).boot_checking = true;
                }
                BootstrapEvent::Joined => state.session(&key).joined = true,
                BootstrapEvent::Closed => {
                    state.session(&key);
                    state.end_session(&key);
                }
                BootstrapEvent::Failed { failure, .. } => {
                    state.session(&key).failure = Some(*failure);
                    state.end_session(&key);
                }
                BootstrapEvent::Progress(_) | BootstrapEvent::Converged => {}
            },
            Observation::NodeLost { .. } => {
                state.end_session(&key);
                state.losses.insert(key);
            }
        }
        if state.inbox.len() < INBOX_OBSERVATIONS_MAX {
            state.inbox.push(observation);
        } else {
            // Never reached while the harness drains the inbox every step;
            // if it were, the harness would miss a fact, so say so.
            eprintln!("level 3: observation inbox full; dropped {observation:?}");
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Folds what a backend call answered: lease and session owners, the
    /// session tracker, and the creation and adoption counts.
    pub(crate) fn answered(
        &self,
        operation: &Operation,
        outcome: &Result<EffectOutput, EffectError>,
    ) {
        let key = (operation.node.clone(), operation.attempt());
        let mut state = self.lock();
        match outcome {
            Ok(EffectOutput::LeaseCreated { lease, adopted, .. }) => {
                state
                    .lease_owners
                    .entry(lease.clone())
                    .or_default()
                    .insert(key);
                state.count_creation(*adopted);
            }
            Ok(EffectOutput::BootstrapStarted { session, adopted }) => {
                state.session_owners.insert(session.clone(), key.clone());
                let over = state.ended_sessions.contains(session);
                let track = state.session(&key);
                track.handle = Some(session.clone());
                track.accepted = true;
                // A session that ended before this answer was folded, or an
                // ended one the plugin hands out again, stays ended.
                if over || track.ended {
                    state.end_session(&key);
                }
                state.count_creation(*adopted);
            }
            Ok(EffectOutput::BootstrapCancelled | EffectOutput::LeaseDestroyed) => {
                state.end_session(&key);
            }
            // A definite start failure left no session behind.
            Err(error)
                if !error.is_ambiguous()
                    && matches!(operation.request, EffectRequest::StartBootstrap { .. })
                    && state.sessions.get(&key).is_some_and(|t| !t.accepted) =>
            {
                state.end_session(&key);
            }
            _ => {}
        }
        drop(state);
        self.changed.notify_all();
    }
}

impl State {
    fn count_creation(&mut self, adopted: bool) {
        if adopted {
            self.counters.adoptions += 1;
        } else {
            self.counters.creations += 1;
        }
    }
}
