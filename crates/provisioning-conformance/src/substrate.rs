//! The substrate: what the harness runs the driver and executor against.
//!
//! A substrate supplies the [`EffectBackend`] that goes under the executor
//! and the [`Spawner`] its work runs on, and it is the harness's hands and
//! eyes on the provider side: it scripts faults for future calls, runs or
//! releases queued work, makes bootstrap sessions report events, loses ready
//! nodes, and — crucially for G04, G05, G08 and G23 — reports the calls the
//! backend started and the resources that are really live.
//!
//! Level 1 is [`crate::fake::FakeSubstrate`] (an in-memory backend on a
//! deterministic spawner). A plugin substrate (Level 2) or a process substrate
//! (Level 3, real async I/O on a tokio runtime, live resources counted from
//! the operating system) implements the same trait; a non-deterministic one
//! says so in [`Capabilities`] and the harness skips the checks that need
//! reproducibility.
//!
//! Pieces any substrate can reuse: [`CallRecorder`] (the call log for G04 and
//! G05), [`FaultQueue`] (scripted faults waiting for their calls) and
//! [`run_manual_work`] (a work step on a [`ManualSpawner`]).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use provisioning::effect::{LeaseHandle, SessionHandle};
use provisioning::executor::EffectBackend;
use provisioning::observe::LossCause;
use provisioning::spawn::{ManualSpawner, RunOrder, Spawner};
use provisioning::{EffectKind, LogicalNodeId, NodeAttemptId, Observation, Operation, OperationId};

use crate::trace::{Fault, FaultTarget, StreamEvent, WorkStep};

/// How many scripted faults may wait for a call; further scripts are refused.
pub const MAX_SCRIPTED_FAULTS: usize = 8;

/// What a substrate can promise the harness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Runs are reproducible from the trace: the same trace gives the same
    /// calls in the same order. G18 (determinism), G20 (confluence) and the
    /// strict form of G04 (the call started while its operation was pending)
    /// are checked only then.
    pub deterministic: bool,
}

/// One backend call, as the substrate saw it start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRecord {
    /// The operation.
    pub op: OperationId,
    /// The slot.
    pub node: LogicalNodeId,
    /// The kind of effect.
    pub kind: EffectKind,
    /// How many other calls of the same attempt were in flight at the
    /// backend when this one started (G05 wants zero).
    pub overlapping: u32,
}

#[derive(Debug, Default)]
struct RecorderState {
    fresh: Vec<CallRecord>,
    in_flight: BTreeMap<NodeAttemptId, u32>,
}

/// Records backend calls as they start and counts the calls of each attempt
/// in flight, for G04 and G05. Any substrate can put one inside its backend:
/// call [`CallRecorder::start`] first thing in `execute` and keep the guard
/// until the call ends (however it ends — completion, panic or drop).
#[derive(Clone, Debug, Default)]
pub struct CallRecorder {
    state: Arc<Mutex<RecorderState>>,
}

/// Marks one call in flight until dropped.
#[derive(Debug)]
#[must_use = "the call counts as in flight only while the guard lives"]
pub struct CallGuard {
    state: Arc<Mutex<RecorderState>>,
    attempt: NodeAttemptId,
}

impl CallRecorder {
    /// An empty recorder.
    pub fn new() -> Self {
        CallRecorder::default()
    }

    fn lock(state: &Mutex<RecorderState>) -> MutexGuard<'_, RecorderState> {
        state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that `operation` started at the backend.
    pub fn start(&self, operation: &Operation) -> CallGuard {
        let mut state = CallRecorder::lock(&self.state);
        let attempt = operation.attempt();
        let in_flight = state.in_flight.entry(attempt).or_insert(0);
        let overlapping = *in_flight;
        *in_flight += 1;
        state.fresh.push(CallRecord {
            op: operation.id,
            node: operation.node.clone(),
            kind: operation.kind(),
            overlapping,
        });
        CallGuard {
            state: self.state.clone(),
            attempt,
        }
    }

    /// The calls started since the last call, in start order.
    pub fn take(&self) -> Vec<CallRecord> {
        std::mem::take(&mut CallRecorder::lock(&self.state).fresh)
    }

    /// How many calls are in flight right now.
    pub fn in_flight(&self) -> u32 {
        CallRecorder::lock(&self.state).in_flight.values().sum()
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        let mut state = CallRecorder::lock(&self.state);
        if let Some(count) = state.in_flight.get_mut(&self.attempt) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                state.in_flight.remove(&self.attempt);
            }
        }
    }
}

/// Scripted faults waiting for the calls they are meant for, at most
/// [`MAX_SCRIPTED_FAULTS`] of them: what a substrate keeps behind
/// [`Substrate::script`] and [`Substrate::stop_faults`].
///
/// A fault is scripted for one target (an effect kind, a plugin method) or
/// for any call (`None`). A call takes the oldest fault scripted for its
/// target, else the oldest scripted for any call, skipping faults that
/// cannot apply to it.
#[derive(Clone, Debug)]
pub struct FaultQueue<T> {
    waiting: VecDeque<(Option<T>, Fault)>,
    stopped: bool,
}

impl<T: PartialEq> FaultQueue<T> {
    /// An empty queue that accepts faults.
    pub fn new() -> Self {
        FaultQueue {
            waiting: VecDeque::new(),
            stopped: false,
        }
    }

    /// Queues `fault` for the next call of `target` (of any call when
    /// `None`). Returns `false`, queueing nothing, once the queue was stopped
    /// or while [`MAX_SCRIPTED_FAULTS`] are waiting.
    pub fn push(&mut self, target: Option<T>, fault: Fault) -> bool {
        if self.stopped || self.waiting.len() >= MAX_SCRIPTED_FAULTS {
            return false;
        }
        self.waiting.push_back((target, fault));
        true
    }

    /// Takes the fault for a call of `target` that starts now, among those
    /// that `applies` accepts for it.
    pub fn take(&mut self, target: &T, applies: impl Fn(Fault) -> bool) -> Option<Fault> {
        let position = self
            .waiting
            .iter()
            .position(|(t, fault)| t.as_ref() == Some(target) && applies(*fault))
            .or_else(|| {
                self.waiting
                    .iter()
                    .position(|(t, fault)| t.is_none() && applies(*fault))
            })?;
        self.waiting.remove(position).map(|(_, fault)| fault)
    }

    /// Drops every waiting fault and accepts no more (the fair tail).
    pub fn stop(&mut self) {
        self.waiting.clear();
        self.stopped = true;
    }

    /// How many faults are waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether no fault is waiting.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

impl<T: PartialEq> Default for FaultQueue<T> {
    fn default() -> Self {
        FaultQueue::new()
    }
}

/// Runs one work step on `spawner`: everything runnable oldest or newest
/// first, or one poll of the `n`-th runnable task (modulo how many there
/// are). Returns how many polls it made.
pub fn run_manual_work(spawner: &ManualSpawner, step: WorkStep) -> usize {
    match step {
        WorkStep::Fifo => spawner.run_all(RunOrder::Fifo),
        WorkStep::Lifo => spawner.run_all(RunOrder::Lifo),
        WorkStep::One(index) => match (index as usize).checked_rem(spawner.ready_count()) {
            Some(nth) => usize::from(spawner.run_nth(nth)),
            None => 0,
        },
    }
}

/// The key of a provider resource: one attempt of one slot (the run is fixed
/// per harness).
pub type ResourceKey = (LogicalNodeId, NodeAttemptId);

/// The resources that are really live at the provider, by key and count.
///
/// A correct provider never holds more than one lease or session per key.
/// The counts come from the substrate's own ledger (Level 1 and 2) or from
/// the operating system (Level 3) — never from the driver's state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveResources {
    /// Live leases (machines, processes) per key.
    pub leases: BTreeMap<ResourceKey, u32>,
    /// Live bootstrap sessions per key.
    pub sessions: BTreeMap<ResourceKey, u32>,
}

impl LiveResources {
    /// Whether nothing is live.
    pub fn is_empty(&self) -> bool {
        self.leases.values().all(|n| *n == 0) && self.sessions.values().all(|n| *n == 0)
    }
}

impl fmt::Display for LiveResources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (label, map) in [("lease", &self.leases), ("session", &self.sessions)] {
            for ((node, attempt), count) in map.iter().filter(|(_, n)| **n > 0) {
                if !first {
                    f.write_str(", ")?;
                }
                first = false;
                write!(f, "{label} {node}/{attempt}")?;
                if *count > 1 {
                    write!(f, " x{count}")?;
                }
            }
        }
        if first {
            f.write_str("nothing")?;
        }
        Ok(())
    }
}

/// Counters a substrate keeps for vacuity reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubstrateCounters {
    /// Creates or bootstrap starts that adopted an existing resource of their key.
    pub adoptions: u64,
    /// Resources created.
    pub creations: u64,
    /// Calls that hung until released.
    pub hangs: u64,
    /// Scripted faults that were applied to a call.
    pub faults_applied: u64,
}

/// The provider side of a harness run.
///
/// # Assumptions
/// - The harness is single-threaded and calls these methods between driver
///   steps; a substrate with real concurrency (Level 3) synchronises inside.
/// - Every method is cheap and bounded; none waits for more than the
///   substrate's own bounded settling time.
pub trait Substrate {
    /// The backend the executor runs effects through.
    type Backend: EffectBackend;

    /// What the substrate can promise.
    fn capabilities(&self) -> Capabilities;

    /// The backend to put under the executor (called once per run, and
    /// again after every controller crash).
    fn backend(&self) -> Arc<Self::Backend>;

    /// The spawner the executor hands its work to (called once per run, and
    /// again after every controller crash).
    fn spawner(&self) -> Arc<dyn Spawner>;

    /// Scripts the reply of a future call. Returns `false` when the
    /// substrate cannot produce this fault (the input is then a no-op).
    fn script(&mut self, target: FaultTarget, fault: Fault) -> bool;

    /// Scripts the next call matching `target` to do its work and answer
    /// with another method's output. Returns `false` when the substrate
    /// cannot (the input is then a no-op) — the default: a provider behind
    /// the plugin seam cannot answer one method with another's output.
    fn script_wrong_answer(&mut self, target: FaultTarget) -> bool {
        let _ = target;
        false
    }

    /// Drops every scripted fault and scripts no more (the fair tail).
    fn stop_faults(&mut self);

    /// Runs queued work. Returns how many units of work made progress.
    fn run_work(&mut self, step: WorkStep) -> usize;

    /// Whether some queued work could make progress if run.
    fn has_runnable_work(&self) -> bool;

    /// Releases the oldest hung call. Returns whether one was hung.
    fn release_oldest_hang(&mut self) -> bool;

    /// Releases every hung call. Returns how many were hung.
    fn release_all_hangs(&mut self) -> usize;

    /// Makes the `session`-th live bootstrap session (modulo their number)
    /// report `event`. Returns the session's key, or `None` when no session
    /// is live or the substrate cannot produce the event.
    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey>;

    /// Makes a node lose its agent or lease, and report it. Returns whether
    /// anything was lost.
    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool;

    /// After a controller crash: makes the agent of `node`'s `attempt`, if
    /// it is still live (its lease is, and it was not lost), re-join the new
    /// controller and reports it
    /// ([`Observation::AgentRejoined`](provisioning::Observation::AgentRejoined)).
    /// Returns whether it was reported. Default: the substrate cannot
    /// (nothing is reported, and such nodes are lost when their rejoin
    /// window ends).
    fn rejoin(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId) -> bool {
        let _ = (node, attempt);
        false
    }

    /// Lets autonomous processes make their next step without faults (in the
    /// fair tail: live sessions whose agent has not joined yet join).
    /// Returns how many made a step.
    fn fair_progress(&mut self) -> usize;

    /// Observations reported since the last call, in report order.
    fn take_observations(&mut self) -> Vec<Observation>;

    /// Backend calls started since the last call, in start order.
    fn take_calls(&mut self) -> Vec<CallRecord>;

    /// The resources that are live right now.
    fn live_resources(&self) -> LiveResources;

    /// G08 breaches the substrate saw happen (a second live resource for a
    /// key, or for another attempt of a slot) since the last call, described
    /// for a human. A substrate that can only sample its resources keeps the
    /// default (none); the harness also samples [`Substrate::live_resources`].
    fn take_ledger_alarms(&mut self) -> Vec<String> {
        Vec::new()
    }

    /// The key a lease handle was issued for, when the substrate knows it.
    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey>;

    /// The key a session handle was issued for, when the substrate knows it.
    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey>;

    /// Counters for vacuity reports.
    fn counters(&self) -> SubstrateCounters;

    /// A one-line description of queued and hung work, for reports.
    fn describe_work(&self) -> String;

    /// Whether the provider side outlives a controller crash: its resources
    /// stay, calls already running in the backend go on, and
    /// [`Substrate::destroy_orphan`] works. Only then do
    /// [`Input::Crash`](crate::trace::Input::Crash) inputs crash the
    /// controller (otherwise they are no-ops), and only then does the host
    /// collect orphans. After a crash the harness calls
    /// [`Substrate::backend`] and [`Substrate::spawner`] again for the new
    /// executor, and drops undelivered observations
    /// ([`Substrate::take_observations`]). Default: no.
    fn survives_controller_crash(&self) -> bool {
        false
    }

    /// The controller crashed and a new one was recovered (called once per
    /// crash, before the new controller runs). A substrate whose provider
    /// reports a session's stream only to the controller that started it
    /// goes quiet for the live sessions here, until the new controller's
    /// adopting start re-attaches them, as the real providers do. Default:
    /// nothing.
    fn controller_restarted(&mut self) {}

    /// The trace asks for sessions that close later than the convergence
    /// call ([`TraceHeader::late_close`](crate::trace::TraceHeader::late_close)),
    /// called once before the run: the convergence call then only
    /// acknowledges, and the session closes at a later `closed` stream
    /// event, a second convergence call, or the fair tail's
    /// [`Substrate::fair_progress`]. Default: nothing (sessions close as the
    /// provider closes them).
    fn close_sessions_late(&mut self) {}

    /// Destroys everything live for `key` — an orphan no node's current
    /// attempt owns — the way the host's orphan collection does (design §13).
    /// Returns whether anything was live. Default: cannot (returns `false`).
    fn destroy_orphan(&mut self, key: &ResourceKey) -> bool {
        let _ = key;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provisioning::GroupId;

    #[test]
    fn a_fault_queue_serves_its_target_first_skips_what_cannot_apply_and_is_bounded() {
        let create = EffectKind::CreateLease;
        let applies = |fault: Fault| fault.applies_to(create);
        let mut queue = FaultQueue::new();
        assert!(queue.push(None, Fault::NotReady));
        assert!(queue.push(None, Fault::AmbiguousUndone));
        assert!(queue.push(Some(create), Fault::Definite));
        assert_eq!(queue.take(&create, applies), Some(Fault::Definite));
        assert_eq!(queue.take(&create, applies), Some(Fault::AmbiguousUndone));
        assert_eq!(queue.take(&create, applies), None, "not-ready stays");
        while queue.len() < MAX_SCRIPTED_FAULTS {
            assert!(queue.push(None, Fault::Hang));
        }
        assert!(!queue.push(None, Fault::Hang), "bounded");
        queue.stop();
        assert!(queue.is_empty());
        assert!(!queue.push(None, Fault::Hang), "stopped");
    }

    #[test]
    fn live_resources_print_only_what_is_live() {
        let node = LogicalNodeId::new(GroupId::new("a"), 1);
        let mut live = LiveResources::default();
        assert_eq!(live.to_string(), "nothing");
        assert!(live.is_empty());
        live.leases
            .insert((node.clone(), NodeAttemptId::from_raw(3)), 2);
        live.sessions.insert((node, NodeAttemptId::from_raw(4)), 0);
        assert_eq!(live.to_string(), "lease a-1/a3 x2");
        assert!(!live.is_empty());
    }
}
