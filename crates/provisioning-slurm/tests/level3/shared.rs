//! What the substrate, its backend, its tools and the plugin's observation
//! sink share.
//!
//! Two kinds of threads touch it: the harness thread (substrate methods and
//! the backend calls it polls) and the runtime's worker, on which the
//! plugin reports facts through its sink. Everything sits behind one mutex
//! that is never held across an `.await` or a Slurm command; a condition
//! variable lets the harness thread wait (bounded) for a fact the plugin
//! reports in the background.

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

/// How many observations may wait for the harness (a safety bound).
const INBOX_OBSERVATIONS_MAX: usize = 4096;

/// Whether the substrate can turn `fault` into a real event for a call of
/// `kind` (the table is in the docs of `backend`).
pub(crate) fn producible(kind: EffectKind, fault: Fault) -> bool {
    match fault {
        Fault::Succeed | Fault::Definite | Fault::AmbiguousUndone | Fault::Hang => true,
        Fault::NotReady => kind == EffectKind::LookupEndpoint,
        // A lost reply of the call's acting command (`sbatch`, `scancel`) or
        // of the lookup's `squeue`. A start's work is `srun`, which the
        // plugin does not wait for, and a completion's `Closed` comes after
        // its only command: neither can lose a reply after doing the work.
        Fault::AmbiguousDone => !matches!(
            kind,
            EffectKind::StartBootstrap | EffectKind::BootstrapConvergenceObserved
        ),
        // No event of a Slurm cluster: the in-memory levels cover it.
        Fault::Panic => false,
    }
}

/// Where the boot gate of a session stands.
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
    /// The plugin answered the start with a session.
    pub(crate) accepted: bool,
    /// The agent reported that it runs its verify commands.
    pub(crate) boot_checking: bool,
    /// The boot gate.
    pub(crate) gate: GateState,
    /// The agent joined the swarm.
    pub(crate) joined: bool,
    /// Nothing more will happen to the session.
    pub(crate) ended: bool,
    /// The stage at which the plugin reported it failed, if it did.
    pub(crate) failure: Option<BootstrapFailure>,
    /// The fair tail waited once for it to reach its gate.
    pub(crate) waited: bool,
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
            waited: false,
        }
    }
}

/// Whether a backend call is working or deliberately stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CallPhase {
    /// Real I/O in progress: settling waits for it.
    Busy,
    /// Its command is stopped (`SIGSTOP`) until released.
    Hung,
}

/// A hung call: one of its Slurm commands is stopped.
#[derive(Clone, Debug)]
pub(crate) struct Hang {
    /// The hung call.
    pub(crate) op: OperationId,
    /// The stopped command.
    pub(crate) pid: u32,
    /// Whether `SIGCONT` was sent.
    pub(crate) released: bool,
}

/// How often each real fault was applied, and which inputs were refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FaultCounts {
    /// Jobs cancelled by hand (`scancel`) as a loss.
    pub(crate) jobs_cancelled_by_hand: u64,
    /// `slurmd`s SIGKILLed (their node went down, its job failed).
    pub(crate) slurmds_killed: u64,
    /// Controller outages (`slurmctld` stopped for a call, then restarted).
    pub(crate) controller_outages: u64,
    /// Calls that failed definitely while the controller was stopped.
    pub(crate) definite_in_outage: u64,
    /// Commands run against a closed controller port (connect failure).
    pub(crate) connect_failures: u64,
    /// Commands killed by their time-out while they retried to connect.
    pub(crate) command_timeouts: u64,
    /// Acting commands that ran and whose reply was thrown away.
    pub(crate) replies_lost: u64,
    /// Submissions no node can satisfy (refused by the controller).
    pub(crate) unsatisfiable: u64,
    /// Commands stopped with `SIGSTOP` so that their call hung.
    pub(crate) commands_stopped: u64,
    /// Stopped commands continued with `SIGCONT`.
    pub(crate) commands_continued: u64,
    /// Lookups answered "not ready" while the job was pending or suspended.
    pub(crate) not_ready_answers: u64,
    /// Boot gates opened with a passing verdict (agents that joined).
    pub(crate) gates_passed: u64,
    /// Boot gates opened with a failing verdict (verify commands failed).
    pub(crate) verify_failures: u64,
    /// Agent steps SIGKILLed before they joined (start failures).
    pub(crate) steps_killed: u64,
    /// Agents of ready nodes SIGKILLed (their swarm connection dropped).
    pub(crate) agents_killed: u64,
    /// Scripted faults the substrate cannot produce (refused, no-ops).
    pub(crate) refused_scripts: u64,
    /// Scripted faults taken by a call that never ran the command they
    /// were meant for (nothing applied).
    pub(crate) scripts_not_reached: u64,
    /// Stream events the substrate cannot produce (refused, no-ops).
    pub(crate) refused_stream_events: u64,
    /// Losses the substrate could not produce (nothing live to lose).
    pub(crate) losses_not_applied: u64,
}

impl FaultCounts {
    /// Adds `other` to `self`.
    pub(crate) fn add(&mut self, other: &FaultCounts) {
        for (mine, (_, theirs)) in self.fields_mut().into_iter().zip(other.fields()) {
            *mine += theirs;
        }
    }

    fn fields(&self) -> [(&'static str, u64); 19] {
        [
            ("job cancelled by hand", self.jobs_cancelled_by_hand),
            ("slurmd SIGKILLed", self.slurmds_killed),
            ("slurmctld stopped and restarted", self.controller_outages),
            (
                "definite call while slurmctld was down",
                self.definite_in_outage,
            ),
            ("connect failure", self.connect_failures),
            ("command timed out", self.command_timeouts),
            ("reply lost", self.replies_lost),
            ("request no node can satisfy", self.unsatisfiable),
            ("SIGSTOP hang", self.commands_stopped),
            ("SIGCONT release", self.commands_continued),
            ("not ready", self.not_ready_answers),
            ("boot gate passed", self.gates_passed),
            ("failing verify command", self.verify_failures),
            ("agent step killed before joining", self.steps_killed),
            ("agent of a ready node killed", self.agents_killed),
            ("refused script", self.refused_scripts),
            ("script not reached", self.scripts_not_reached),
            ("refused stream event", self.refused_stream_events),
            ("loss not applied", self.losses_not_applied),
        ]
    }

    fn fields_mut(&mut self) -> [&mut u64; 19] {
        [
            &mut self.jobs_cancelled_by_hand,
            &mut self.slurmds_killed,
            &mut self.controller_outages,
            &mut self.definite_in_outage,
            &mut self.connect_failures,
            &mut self.command_timeouts,
            &mut self.replies_lost,
            &mut self.unsatisfiable,
            &mut self.commands_stopped,
            &mut self.commands_continued,
            &mut self.not_ready_answers,
            &mut self.gates_passed,
            &mut self.verify_failures,
            &mut self.steps_killed,
            &mut self.agents_killed,
            &mut self.refused_scripts,
            &mut self.scripts_not_reached,
            &mut self.refused_stream_events,
            &mut self.losses_not_applied,
        ]
    }

    /// Every count, by name, for the summary.
    pub(crate) fn all(&self) -> [(&'static str, u64); 19] {
        self.fields()
    }

    /// The real faults that must not stay at zero over the battery.
    pub(crate) fn required(&self) -> Vec<(&'static str, u64)> {
        self.fields().into_iter().take(15).collect()
    }
}

/// Everything behind the mutex.
#[derive(Debug, Default)]
pub(crate) struct State {
    scripts: FaultQueue<EffectKind>,
    inbox: Vec<Observation>,
    /// Sessions by key, from start calls and reported facts.
    pub(crate) sessions: BTreeMap<ResourceKey, SessionTrack>,
    /// Keys whose loss the plugin reported.
    losses: BTreeSet<ResourceKey>,
    calls: BTreeMap<OperationId, CallPhase>,
    /// Calls running in a task of their own (a held create), which outlive
    /// the executor that made them.
    detached: BTreeSet<OperationId>,
    /// Hung calls by serial, oldest first.
    pub(crate) hangs: BTreeMap<u64, Hang>,
    next_hang: u64,
    lease_owners: BTreeMap<LeaseHandle, BTreeSet<ResourceKey>>,
    session_owners: BTreeMap<SessionHandle, ResourceKey>,
    alarms: Vec<String>,
    /// Vacuity counters for the harness.
    pub(crate) counters: SubstrateCounters,
    /// Real faults applied, inputs refused.
    pub(crate) faults: FaultCounts,
}

impl State {
    fn session(&mut self, key: &ResourceKey) -> &mut SessionTrack {
        self.sessions
            .entry(key.clone())
            .or_insert_with(SessionTrack::new)
    }

    fn end_session(&mut self, key: &ResourceKey) {
        if let Some(track) = self.sessions.get_mut(key) {
            track.ended = true;
        }
    }

    /// The live sessions the plugin answered for, in key order.
    pub(crate) fn live_sessions(&self) -> Vec<ResourceKey> {
        self.sessions
            .iter()
            .filter(|(_, s)| !s.ended && s.accepted)
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
        let attached = self
            .calls
            .values()
            .filter(|phase| **phase == CallPhase::Busy)
            .count();
        // A detached call whose executor is gone is busy unless it hangs.
        let detached = self
            .detached
            .iter()
            .filter(|op| !self.calls.contains_key(op))
            .filter(|op| !self.hangs.values().any(|h| h.op == **op && !h.released))
            .count();
        attached + detached
    }

    /// Whether call `op` still runs in a task of its own.
    pub(crate) fn is_detached(&self, op: OperationId) -> bool {
        self.detached.contains(&op)
    }

    /// Backend calls hung on a stopped command.
    pub(crate) fn hung_calls(&self) -> usize {
        self.hangs.values().filter(|h| !h.released).count()
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
        self.faults.commands_continued += 1;
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

/// Removes a call from the in-flight registry when the call ends, however
/// it ends (completion, or its future dropped).
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

/// Marks a call's own task running until dropped.
pub(crate) struct Detached {
    shared: std::sync::Arc<Shared>,
    op: OperationId,
}

impl Drop for Detached {
    fn drop(&mut self) {
        self.shared.lock().detached.remove(&self.op);
        self.shared.changed.notify_all();
    }
}

impl Shared {
    /// Registers call `op`'s own task until the guard drops.
    pub(crate) fn detached(self: &std::sync::Arc<Self>, op: OperationId) -> Detached {
        self.lock().detached.insert(op);
        Detached {
            shared: self.clone(),
            op,
        }
    }

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

    /// Queues a fault; `false` (counted) when it cannot be produced, and
    /// `false` when the queue is full or stopped.
    pub(crate) fn script(&self, target: FaultTarget, fault: Fault) -> bool {
        let can = match target {
            FaultTarget::Kind(kind) => producible(kind, fault),
            FaultTarget::Any => EffectKind::ALL.into_iter().any(|k| producible(k, fault)),
        };
        let mut state = self.lock();
        if !can {
            state.faults.refused_scripts += 1;
            return false;
        }
        state.scripts.push(target.kind(), fault)
    }

    /// Drops every scripted fault and accepts no more.
    pub(crate) fn stop_faults(&self) {
        self.lock().scripts.stop();
    }

    /// Takes the fault for the call of `kind` that starts now.
    pub(crate) fn take_script(&self, kind: EffectKind) -> Option<Fault> {
        self.lock()
            .scripts
            .take(&kind, |fault| producible(kind, fault))
    }

    /// Counts a scripted fault that reached its call's command.
    pub(crate) fn applied(&self, update: impl FnOnce(&mut FaultCounts)) {
        let mut state = self.lock();
        state.counters.faults_applied += 1;
        update(&mut state.faults);
    }

    /// Adds to the fault counts.
    pub(crate) fn count(&self, update: impl FnOnce(&mut FaultCounts)) {
        update(&mut self.lock().faults);
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

    /// Records that `op` hangs on the stopped command `pid`; returns the
    /// hang's serial.
    pub(crate) fn hang(&self, op: OperationId, pid: u32) -> u64 {
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
        if let Some(phase) = state.calls.get_mut(&op) {
            *phase = CallPhase::Hung;
        }
        state.counters.hangs += 1;
        state.counters.faults_applied += 1;
        state.faults.commands_stopped += 1;
        serial
    }

    /// Whether hang `serial` was released (or has ended).
    pub(crate) fn released(&self, serial: u64) -> bool {
        self.lock().hangs.get(&serial).is_none_or(|h| h.released)
    }

    /// Forgets hang `serial` (its command goes on); returns it when it was
    /// never released: its command is still stopped.
    pub(crate) fn end_hang(&self, serial: u64) -> Option<Hang> {
        let mut state = self.lock();
        let hang = state.hangs.remove(&serial)?;
        if let Some(phase) = state.calls.get_mut(&hang.op) {
            *phase = CallPhase::Busy;
        }
        if hang.released {
            return None;
        }
        state.faults.commands_continued += 1;
        Some(hang)
    }

    /// Notes that a start call for `key` begins.
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
            GateState::Passed => state.faults.gates_passed += 1,
            GateState::Failed => state.faults.verify_failures += 1,
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
        (owners.len() == 1)
            .then(|| owners.first().cloned())
            .flatten()
    }

    /// The key a session was issued for.
    pub(crate) fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.lock().session_owners.get(session).cloned()
    }

    /// Folds a fact the plugin reported through its sink.
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
            eprintln!("level 3: observation inbox full; dropped {observation:?}");
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Folds what a backend call answered: owners, sessions, counts.
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
                // A session that ended before this answer was folded stays
                // ended (the handle names the attempt's step, not one start).
                let track = state.session(&key);
                track.handle = Some(session.clone());
                track.accepted = true;
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
