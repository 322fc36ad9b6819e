//! What the substrate, its backend and the plugin's observation sink share.
//!
//! The harness thread (substrate methods, and the backend calls it polls)
//! and the tokio thread on which the plugin reports facts both touch it.
//! Everything sits behind one mutex that is never held across an `.await`
//! or a plugin call; a condition variable lets the harness thread wait
//! (bounded) for a fact the plugin reports in the background.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use provisioning::effect::{EffectRequest, SessionHandle};
use provisioning::observe::BootstrapEvent;
use provisioning::{
    EffectError, EffectKind, EffectOutput, LeaseHandle, Observation, Operation, OperationId,
};
use provisioning_conformance::substrate::{FaultQueue, ResourceKey, SubstrateCounters};
use provisioning_conformance::trace::{Fault, FaultTarget};

/// How many observations may wait for the harness (a safety bound: every
/// harness step takes them).
const INBOX_OBSERVATIONS_MAX: usize = 4096;

/// Whether the substrate can turn `fault` into a real event for a call of
/// `kind` (the table is in the module docs of `backend`).
pub(crate) fn producible(kind: EffectKind, fault: Fault) -> bool {
    use EffectKind as K;
    match fault {
        Fault::Succeed => true,
        Fault::Definite => matches!(
            kind,
            K::CreateLease
                | K::LookupEndpoint
                | K::StartBootstrap
                | K::CancelBootstrap
                | K::DestroyLease
        ),
        Fault::NotReady => kind == K::LookupEndpoint,
        Fault::AmbiguousDone | Fault::AmbiguousUndone => kind == K::CreateLease,
        Fault::Hang => matches!(kind, K::CreateLease | K::CancelBootstrap | K::DestroyLease),
        // A panic is no event of a real host: the in-memory levels cover it.
        Fault::Panic => false,
    }
}

/// The substrate's view of one bootstrap session, from the plugin's
/// replies and the facts it reported.
#[derive(Clone, Debug, Default)]
pub(crate) struct SessionTrack {
    /// The plugin answered the start with a session.
    pub(crate) accepted: bool,
    /// The handle it answered with.
    pub(crate) handle: Option<SessionHandle>,
    /// The agent joined the swarm.
    pub(crate) joined: bool,
    /// Nothing more will happen to the session (closed, failed, cancelled,
    /// or its node is gone).
    pub(crate) ended: bool,
}

/// Whether a backend call is working or deliberately stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CallPhase {
    /// Real I/O in progress: settling waits for it.
    Busy,
    /// Held, or against a stopped agent, until released.
    Hung,
}

/// A hung call: a create held before the plugin (`pid: None`), or a call
/// against a remote agent stopped with `SIGSTOP`.
#[derive(Clone, Debug)]
pub(crate) struct Hang {
    /// The hung call.
    pub(crate) op: OperationId,
    /// The stopped agent.
    pub(crate) pid: Option<u32>,
    /// Whether it was released.
    pub(crate) released: bool,
}

/// How often each real fault was applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FaultCounts {
    /// Remote agents killed with `SIGKILL` (a lost agent).
    pub(crate) agents_killed: u64,
    /// Remote workloads killed with `SIGKILL` (an exited workload).
    pub(crate) workloads_killed: u64,
    /// Claims removed on the host behind the plugin's back (a lost lease).
    pub(crate) claims_removed: u64,
    /// Remote agents stopped with `SIGSTOP` during a call.
    pub(crate) agents_stopped: u64,
    /// Stopped agents continued with `SIGCONT`.
    pub(crate) agents_continued: u64,
    /// Calls answered definitely while the host's sshd was stopped.
    pub(crate) refused: u64,
    /// Lookups answered "not ready" while the host's sshd was stopped.
    pub(crate) refused_not_ready: u64,
    /// Calls cut off by the host's link going down mid-call, answered
    /// ambiguously.
    pub(crate) partitions: u64,
    /// Calls refused because the host's key in the known-hosts file changed.
    pub(crate) host_key_changed: u64,
    /// Creates refused because every slot of the inventory was taken.
    pub(crate) inventory_exhausted: u64,
    /// Bootstrap starts whose verify command failed on the host.
    pub(crate) verify_failures: u64,
    /// Boot gates opened: agents let go to join.
    pub(crate) gates_passed: u64,
    /// Creates held before they reached the plugin (a slow call).
    pub(crate) creates_held: u64,
}

impl FaultCounts {
    /// Adds `other` to `self`.
    pub(crate) fn add(&mut self, other: &FaultCounts) {
        for (mine, theirs) in self.fields_mut().into_iter().zip(other.fields()) {
            *mine += theirs;
        }
    }

    fn fields(&self) -> [u64; 13] {
        [
            self.agents_killed,
            self.workloads_killed,
            self.claims_removed,
            self.agents_stopped,
            self.agents_continued,
            self.refused,
            self.refused_not_ready,
            self.partitions,
            self.host_key_changed,
            self.inventory_exhausted,
            self.verify_failures,
            self.gates_passed,
            self.creates_held,
        ]
    }

    fn fields_mut(&mut self) -> [&mut u64; 13] {
        [
            &mut self.agents_killed,
            &mut self.workloads_killed,
            &mut self.claims_removed,
            &mut self.agents_stopped,
            &mut self.agents_continued,
            &mut self.refused,
            &mut self.refused_not_ready,
            &mut self.partitions,
            &mut self.host_key_changed,
            &mut self.inventory_exhausted,
            &mut self.verify_failures,
            &mut self.gates_passed,
            &mut self.creates_held,
        ]
    }

    /// Every count, by name; the battery requires each to be reached.
    pub(crate) fn required(&self) -> [(&'static str, u64); 13] {
        let names = [
            "SIGKILL of a remote agent",
            "SIGKILL of a remote workload",
            "claim removed on the host",
            "SIGSTOP of a remote agent",
            "SIGCONT on release",
            "sshd stopped: refused (definite)",
            "sshd stopped: lookup not ready",
            "link down mid-call (ambiguous)",
            "changed host key",
            "exhausted inventory",
            "failing verify command",
            "boot gate passed",
            "held create",
        ];
        let values = self.fields();
        std::array::from_fn(|i| (names[i], values[i]))
    }
}

/// Everything behind the mutex.
#[derive(Debug, Default)]
pub(crate) struct State {
    scripts: FaultQueue<EffectKind>,
    inbox: Vec<Observation>,
    /// Sessions by key.
    pub(crate) sessions: BTreeMap<ResourceKey, SessionTrack>,
    ended_sessions: BTreeSet<SessionHandle>,
    losses: BTreeSet<ResourceKey>,
    calls: BTreeMap<OperationId, CallPhase>,
    /// Hung calls by serial, oldest first.
    pub(crate) hangs: BTreeMap<u64, Hang>,
    next_hang: u64,
    lease_owners: BTreeMap<LeaseHandle, ResourceKey>,
    session_owners: BTreeMap<SessionHandle, ResourceKey>,
    alarms: Vec<String>,
    /// Vacuity counters for the harness.
    pub(crate) counters: SubstrateCounters,
    /// Real faults applied.
    pub(crate) faults: FaultCounts,
}

impl State {
    fn session(&mut self, key: &ResourceKey) -> &mut SessionTrack {
        self.sessions.entry(key.clone()).or_default()
    }

    fn end_session(&mut self, key: &ResourceKey) {
        if let Some(track) = self.sessions.get_mut(key) {
            track.ended = true;
            if let Some(handle) = &track.handle {
                self.ended_sessions.insert(handle.clone());
            }
        }
    }

    /// The live sessions the plugin answered for, in key order.
    pub(crate) fn live_sessions(&self) -> Vec<ResourceKey> {
        self.sessions
            .iter()
            .filter(|(_, t)| t.accepted && !t.ended)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Whether the session of `key` is live and its agent joined.
    pub(crate) fn joined(&self, key: &ResourceKey) -> bool {
        self.sessions.get(key).is_some_and(|t| t.joined)
    }

    /// Whether the plugin reported the loss of `key`.
    pub(crate) fn lost(&self, key: &ResourceKey) -> bool {
        self.losses.contains(key)
    }

    /// Whether the session of `key` has nothing more to wait for.
    pub(crate) fn session_settled(&self, key: &ResourceKey) -> bool {
        self.sessions.get(key).is_none_or(|t| t.ended || t.joined)
    }

    /// Backend calls doing real I/O right now.
    pub(crate) fn busy_calls(&self) -> usize {
        self.calls
            .values()
            .filter(|p| **p == CallPhase::Busy)
            .count()
    }

    /// Backend calls hung until released.
    pub(crate) fn hung_calls(&self) -> usize {
        self.calls.len() - self.busy_calls()
    }

    /// Scripted faults not used yet.
    pub(crate) fn unused_scripts(&self) -> usize {
        self.scripts.len()
    }

    /// Marks `op` busy (a held create's task doing its call).
    pub(crate) fn mark_busy(&mut self, op: OperationId) {
        self.calls.insert(op, CallPhase::Busy);
    }

    /// Forgets `op`'s mark (its task ended).
    pub(crate) fn unmark_busy(&mut self, op: OperationId) {
        self.calls.remove(&op);
    }

    /// Marks hang `serial` released and its call busy again.
    pub(crate) fn release_hang(&mut self, serial: u64) -> Option<Hang> {
        let hang = self.hangs.get_mut(&serial).filter(|h| !h.released)?;
        hang.released = true;
        let hang = hang.clone();
        if let Some(phase) = self.calls.get_mut(&hang.op) {
            *phase = CallPhase::Busy;
        }
        Some(hang)
    }

    fn count_creation(&mut self, adopted: bool) {
        if adopted {
            self.counters.adoptions += 1;
        } else {
            self.counters.creations += 1;
        }
    }
}

/// The shared state and its condition variable.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// Removes a call from the in-flight registry when it ends, however.
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

    /// Wakes every waiter.
    pub(crate) fn notify(&self) {
        self.changed.notify_all();
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

    /// Takes the fault for the call of `kind` that starts now.
    pub(crate) fn take_script(&self, kind: EffectKind) -> Option<Fault> {
        let mut state = self.lock();
        let fault = state.scripts.take(&kind, |fault| producible(kind, fault))?;
        state.counters.faults_applied += 1;
        Some(fault)
    }

    /// Registers a call as in flight (busy) until the guard drops.
    pub(crate) fn call_started(&self, op: OperationId) -> InFlight<'_> {
        self.lock().calls.insert(op, CallPhase::Busy);
        InFlight { shared: self, op }
    }

    /// Records that `op` hangs (on the stopped agent `pid`, or held before
    /// the plugin when `None`). Returns the hang's serial.
    pub(crate) fn hang(&self, op: OperationId, pid: Option<u32>) -> u64 {
        let mut state = self.lock();
        let serial = state.next_hang;
        state.next_hang += 1;
        state.hangs.insert(
            serial,
            Hang {
                op,
                pid,
                released: false,
            },
        );
        state.calls.insert(op, CallPhase::Hung);
        state.counters.hangs += 1;
        match pid {
            Some(_) => state.faults.agents_stopped += 1,
            None => state.faults.creates_held += 1,
        }
        serial
    }

    /// Whether hang `serial` was released (or has ended).
    pub(crate) fn released(&self, serial: u64) -> bool {
        self.lock().hangs.get(&serial).is_none_or(|h| h.released)
    }

    /// Forgets hang `serial` (its call ended). Returns it when it was never
    /// released.
    pub(crate) fn end_hang(&self, serial: u64) -> Option<Hang> {
        let hang = self.lock().hangs.remove(&serial)?;
        (!hang.released).then_some(hang)
    }

    /// Adds to the fault counts.
    pub(crate) fn count(&self, update: impl FnOnce(&mut FaultCounts)) {
        update(&mut self.lock().faults);
    }

    /// Raises a G08 alarm.
    pub(crate) fn alarm(&self, alarm: String) {
        self.lock().alarms.push(alarm);
    }

    /// The alarms raised since the last call.
    pub(crate) fn take_alarms(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().alarms)
    }

    /// The observations reported since the last call.
    pub(crate) fn take_observations(&self) -> Vec<Observation> {
        std::mem::take(&mut self.lock().inbox)
    }

    /// The key `lease` was issued for.
    pub(crate) fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.lock().lease_owners.get(lease).cloned()
    }

    /// The key `session` was issued for.
    pub(crate) fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.lock().session_owners.get(session).cloned()
    }

    /// Notes that a start call for `key` begins: after an ended session the
    /// plugin may start a new one.
    pub(crate) fn session_starting(&self, key: &ResourceKey) {
        let mut state = self.lock();
        let track = state.session(key);
        if track.ended {
            *track = SessionTrack::default();
        }
    }

    /// Folds a fact the plugin reported through the sink.
    pub(crate) fn observe(&self, observation: Observation) {
        let key = (observation.node().clone(), observation.attempt());
        let mut state = self.lock();
        match &observation {
            Observation::Bootstrap { event, .. } => match event {
                BootstrapEvent::Joined => state.session(&key).joined = true,
                BootstrapEvent::Closed | BootstrapEvent::Failed { .. } => {
                    state.session(&key);
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
            eprintln!("level 3: observation inbox full; dropped {observation:?}");
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Folds what a backend call answered.
    pub(crate) fn answered(
        &self,
        operation: &Operation,
        outcome: &Result<EffectOutput, EffectError>,
    ) {
        let key = (operation.node.clone(), operation.attempt());
        let mut state = self.lock();
        match outcome {
            Ok(EffectOutput::LeaseCreated { lease, adopted, .. }) => {
                state.lease_owners.insert(lease.clone(), key);
                state.count_creation(*adopted);
            }
            Ok(EffectOutput::BootstrapStarted { session, adopted }) => {
                state.session_owners.insert(session.clone(), key.clone());
                let over = state.ended_sessions.contains(session);
                let track = state.session(&key);
                track.handle = Some(session.clone());
                track.accepted = true;
                if over || track.ended {
                    state.end_session(&key);
                }
                state.count_creation(*adopted);
            }
            Ok(EffectOutput::BootstrapCancelled | EffectOutput::LeaseDestroyed) => {
                state.end_session(&key);
            }
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
