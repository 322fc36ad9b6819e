//! What the two in-memory fakes share: [`FakeBackend`](crate::FakeBackend)
//! (Level 1) and [`FakePlugin`](crate::FakePlugin) (Level 2) keep the same
//! honest [`Ledger`] of live resources and scripted faults, and hang calls
//! behind the same [`HangGate`]. They differ only in their keys, in what a
//! fault is scripted for, and in how they answer.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, Once, PoisonError};
use std::task::{Context, Poll, Waker};

use provisioning::effect::SessionHandle;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::{Endpoint, LeaseHandle, NodeAttemptId};
use provisioning_provider::{AttemptKey, BootstrapSession, NodeLease};

use crate::fake::SCRIPTED_PANIC_MESSAGE;
use crate::substrate::{FaultQueue, LiveResources, ResourceKey, SubstrateCounters};
use crate::trace::{Fault, StreamEvent};

/// Installs, once per process, a panic hook that keeps scripted panics
/// ([`SCRIPTED_PANIC_MESSAGE`]) out of the output and hands every other
/// panic to the hook that was installed before.
pub(crate) fn silence_scripted_panics() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let scripted = payload
                .downcast_ref::<&str>()
                .is_some_and(|text| *text == SCRIPTED_PANIC_MESSAGE)
                || payload
                    .downcast_ref::<String>()
                    .is_some_and(|text| text == SCRIPTED_PANIC_MESSAGE);
            if !scripted {
                previous(info);
            }
        }));
    });
}

/// Counts a fake's scripted panics, to vary their payload.
#[derive(Debug, Default)]
pub(crate) struct PanicSerial(AtomicU64);

impl PanicSerial {
    /// Panics as scripted: with [`SCRIPTED_PANIC_MESSAGE`] as a `&'static
    /// str` payload the first time and every second time after, and as a
    /// `String` payload (what `panic!` with arguments carries) in between,
    /// so a host's reading of both kinds of payload is exercised.
    pub(crate) fn panic(&self) -> ! {
        if self.0.fetch_add(1, Ordering::Relaxed) % 2 == 0 {
            std::panic::panic_any(SCRIPTED_PANIC_MESSAGE)
        } else {
            std::panic::panic_any(SCRIPTED_PANIC_MESSAGE.to_owned())
        }
    }
}

/// The endpoint a fake node announces.
pub(crate) fn endpoint_of(lease: &LeaseHandle) -> Endpoint {
    Endpoint(format!("endpoint-of-{}", lease.0))
}

/// Some providers know the endpoint when the lease is made, others only
/// later: every third attempt gets it at creation, so both paths of the
/// ladder (lookup and no lookup) are taken.
fn endpoint_at_creation(attempt: NodeAttemptId, lease: &LeaseHandle) -> Option<Endpoint> {
    (attempt.get() % 3 == 0).then(|| endpoint_of(lease))
}

/// The key a ledger keeps resources under: one attempt of one slot.
pub(crate) trait SlotKey: Ord + Clone {
    /// The attempt.
    fn attempt(&self) -> NodeAttemptId;

    /// Whether `other` is an attempt of the same slot.
    fn same_slot(&self, other: &Self) -> bool;

    /// The key as the harness names resources.
    fn resource_key(&self) -> ResourceKey;

    /// The name of the `serial`-th handle, a `what` (lease, session).
    fn handle_name(&self, what: &str, serial: u64) -> String;
}

impl SlotKey for ResourceKey {
    fn attempt(&self) -> NodeAttemptId {
        self.1
    }

    fn same_slot(&self, other: &Self) -> bool {
        self.0 == other.0
    }

    fn resource_key(&self) -> ResourceKey {
        self.clone()
    }

    fn handle_name(&self, what: &str, serial: u64) -> String {
        format!("{what}-{}-{}-{serial}", self.0, self.1)
    }
}

impl SlotKey for AttemptKey {
    fn attempt(&self) -> NodeAttemptId {
        self.attempt
    }

    fn same_slot(&self, other: &Self) -> bool {
        self.run_id == other.run_id && self.node == other.node
    }

    fn resource_key(&self) -> ResourceKey {
        (self.node.clone(), self.attempt)
    }

    fn handle_name(&self, what: &str, serial: u64) -> String {
        format!(
            "plugin-{what}-{}-{}-{}-{serial}",
            self.run_id, self.node, self.attempt
        )
    }
}

#[derive(Clone, Debug)]
struct Session {
    handle: SessionHandle,
    joined: bool,
    /// The session streams to a controller that died: its agent goes on
    /// (and re-joins the swarm of the new controller, as the remote agents
    /// do), but the provider reports nothing of it until the new controller
    /// re-attaches with an adopting start (see [`Ledger::controller_restarted`]).
    quiet: bool,
    /// The convergence call was acknowledged, and the close is still to come
    /// (only when sessions close late, [`Ledger::close_sessions_late`]).
    acknowledged: bool,
}

/// What a convergence call (`BootstrapConvergenceObserved`,
/// `complete_bootstrap`) did to the session of its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    /// The session ended now; `report` says whether its `Closed` event is to
    /// be reported (not for a quiet session).
    Closed { report: bool },
    /// Acknowledged; the session closes later.
    Acknowledged,
    /// No session was live.
    NoSession,
}

/// What is live per key `K`, who every handle was issued to, the faults
/// scripted for targets `M`, G08 alarms and vacuity counters.
#[derive(Debug)]
pub(crate) struct Ledger<K, M> {
    leases: BTreeMap<K, Vec<LeaseHandle>>,
    sessions: BTreeMap<K, Session>,
    lease_owners: BTreeMap<LeaseHandle, K>,
    session_owners: BTreeMap<SessionHandle, K>,
    serial: u64,
    /// How many times the controller restarted: a call that started in an
    /// earlier epoch is a dead controller's call.
    epoch: u64,
    /// Sessions close later than the convergence call.
    late_close: bool,
    alarms: Vec<String>,
    /// Keys whose agent was lost: it re-joins no restarted controller.
    agents_gone: BTreeSet<K>,
    /// Faults waiting for their calls.
    pub(crate) scripts: FaultQueue<M>,
    /// Creations, adoptions, hangs and faults applied.
    pub(crate) counters: SubstrateCounters,
}

impl<K, M: PartialEq> Default for Ledger<K, M> {
    fn default() -> Self {
        Ledger {
            leases: BTreeMap::new(),
            sessions: BTreeMap::new(),
            lease_owners: BTreeMap::new(),
            session_owners: BTreeMap::new(),
            serial: 0,
            epoch: 0,
            late_close: false,
            alarms: Vec::new(),
            agents_gone: BTreeSet::new(),
            scripts: FaultQueue::new(),
            counters: SubstrateCounters::default(),
        }
    }
}

impl<K: SlotKey, M: PartialEq> Ledger<K, M> {
    /// Takes the fault scripted for a call of `target` that starts now and
    /// counts it applied (and a hang as a hang).
    pub(crate) fn take_script(
        &mut self,
        target: M,
        applies: impl Fn(Fault) -> bool,
    ) -> Option<Fault> {
        let fault = self.scripts.take(&target, applies)?;
        self.counters.faults_applied += 1;
        if fault == Fault::Hang {
            self.counters.hangs += 1;
        }
        Some(fault)
    }

    /// The first live lease of `key`.
    pub(crate) fn live_lease(&self, key: &K) -> Option<&LeaseHandle> {
        self.leases.get(key).and_then(|leases| leases.first())
    }

    /// Whether `lease` is live for `key`.
    pub(crate) fn holds_lease(&self, key: &K, lease: &LeaseHandle) -> bool {
        self.leases.get(key).is_some_and(|l| l.contains(lease))
    }

    /// Whether `key` has a live session.
    pub(crate) fn has_session(&self, key: &K) -> bool {
        self.sessions.contains_key(key)
    }

    /// Every live lease, in key order.
    pub(crate) fn leases(&self) -> impl Iterator<Item = (&K, &LeaseHandle)> {
        self.leases
            .iter()
            .flat_map(|(key, leases)| leases.iter().map(move |lease| (key, lease)))
    }

    /// Adopts the live lease of `key` when `adopt` allows, else creates one.
    pub(crate) fn create_lease(&mut self, key: &K, adopt: bool) -> NodeLease {
        if let Some(lease) = self.live_lease(key).filter(|_| adopt).cloned() {
            self.counters.adoptions += 1;
            return NodeLease {
                endpoint: endpoint_at_creation(key.attempt(), &lease),
                lease,
                adopted: true,
            };
        }
        self.watch_creation(key, "lease", self.live_lease(key).is_some());
        self.serial += 1;
        let lease = LeaseHandle(key.handle_name("lease", self.serial));
        self.leases
            .entry(key.clone())
            .or_default()
            .push(lease.clone());
        self.lease_owners.insert(lease.clone(), key.clone());
        self.counters.creations += 1;
        NodeLease {
            endpoint: endpoint_at_creation(key.attempt(), &lease),
            lease,
            adopted: false,
        }
    }

    /// The controller epoch now: a call records it when it starts and hands
    /// it to [`Ledger::start_session`].
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The controller died and a new one was recovered. Every live session
    /// streamed to the dead one, and so does a session a call of the dead
    /// controller starts later: such a session goes *quiet*. Its agent lives
    /// on, but the provider reports nothing of it (no stream event, no join,
    /// no close) until an adopting start of the new controller re-attaches
    /// it; the agent then joins the new controller's swarm and that join is
    /// reported. This is what the real providers do: the process plugin's
    /// re-attach of a listed session, the ssh and Slurm agents that re-join a
    /// restarted controller and are announced by its start. The core's
    /// recovery relies on it: it makes every session that had not handed off
    /// an ambiguous start, to be re-issued.
    pub(crate) fn controller_restarted(&mut self) {
        self.epoch += 1;
        for session in self.sessions.values_mut() {
            session.quiet = true;
        }
    }

    /// Adopts the live session of `key`, or starts one, for a call that
    /// started in controller epoch `epoch`. The caller checked that the
    /// key's lease is live.
    pub(crate) fn start_session(&mut self, key: &K, epoch: u64) -> BootstrapSession {
        let dead_caller = epoch != self.epoch;
        if let Some(session) = self.sessions.get_mut(key) {
            // A start that adopts opens a new stream to its caller (a
            // recovered controller re-attaching): the agent joins that
            // controller's swarm again, and the join is reported again once
            // it does. A dead controller's start re-attaches nothing.
            if !dead_caller {
                session.joined = false;
                session.quiet = false;
                session.acknowledged = false;
            }
            let session = session.handle.clone();
            self.counters.adoptions += 1;
            return BootstrapSession {
                session,
                adopted: true,
            };
        }
        // The key's own session would have been adopted above.
        self.watch_creation(key, "session", false);
        self.serial += 1;
        let session = SessionHandle(key.handle_name("session", self.serial));
        let live = Session {
            handle: session.clone(),
            joined: false,
            quiet: dead_caller,
            acknowledged: false,
        };
        self.sessions.insert(key.clone(), live);
        self.session_owners.insert(session.clone(), key.clone());
        self.counters.creations += 1;
        BootstrapSession {
            session,
            adopted: false,
        }
    }

    /// From now on a convergence call only acknowledges: the session stays
    /// open until a later close ([`Ledger::close_acknowledged`], a `closed`
    /// stream event, or a second convergence call), as a provider whose
    /// agent hands off on its own time would.
    pub(crate) fn close_sessions_late(&mut self) {
        self.late_close = true;
    }

    /// The convergence call for `key`: ends the session, or, when sessions
    /// close late, acknowledges it the first time.
    pub(crate) fn complete_session(&mut self, key: &K) -> Completion {
        let late = self.late_close;
        let Some(session) = self.sessions.get_mut(key) else {
            return Completion::NoSession;
        };
        if late && !session.acknowledged {
            session.acknowledged = true;
            return Completion::Acknowledged;
        }
        let report = !session.quiet;
        self.sessions.remove(key);
        Completion::Closed { report }
    }

    /// Closes every acknowledged session that streams to the controller
    /// (the fair tail's progress). Returns their keys, in key order.
    pub(crate) fn close_acknowledged(&mut self) -> Vec<K> {
        let closing: Vec<K> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.acknowledged && !s.quiet)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &closing {
            self.sessions.remove(key);
        }
        closing
    }

    /// Ends the session of `key`. Returns whether one was live.
    pub(crate) fn end_session(&mut self, key: &K) -> bool {
        self.sessions.remove(key).is_some()
    }

    /// Removes everything of `key`.
    pub(crate) fn destroy(&mut self, key: &K) {
        self.leases.remove(key);
        self.sessions.remove(key);
    }

    /// Makes the `index`-th live session (modulo their number, in key order)
    /// report `event`; `closed` and failures end the session. Returns the
    /// session's key and the event, or `None` when no session is live.
    ///
    /// Only sessions that stream to the controller are counted: a quiet
    /// session (see [`Ledger::controller_restarted`]) reports nothing.
    pub(crate) fn stream(&mut self, index: u32, event: StreamEvent) -> Option<(K, BootstrapEvent)> {
        let streaming = self.sessions.values().filter(|s| !s.quiet).count();
        let nth = (index as usize).checked_rem(streaming)?;
        let key = self
            .sessions
            .iter()
            .filter(|(_, s)| !s.quiet)
            .nth(nth)?
            .0
            .clone();
        let event = match event {
            StreamEvent::Progress(stage) => BootstrapEvent::Progress(stage),
            StreamEvent::Converged => BootstrapEvent::Converged,
            StreamEvent::Joined => {
                if let Some(session) = self.sessions.get_mut(&key) {
                    session.joined = true;
                }
                BootstrapEvent::Joined
            }
            StreamEvent::Closed => {
                self.sessions.remove(&key);
                BootstrapEvent::Closed
            }
            StreamEvent::Failed(failure) => {
                self.sessions.remove(&key);
                BootstrapEvent::Failed {
                    failure,
                    detail: "scripted stream failure".to_owned(),
                }
            }
        };
        Some((key, event))
    }

    /// Makes `key` lose its agent (its session ends) or its lease
    /// (everything of the key goes). Returns whether anything was lost.
    pub(crate) fn lose(&mut self, key: &K, cause: LossCause) -> bool {
        let had_lease = self.live_lease(key).is_some();
        let had_session = self.sessions.remove(key).is_some();
        self.agents_gone.insert(key.clone());
        if cause == LossCause::LeaseGone {
            self.leases.remove(key);
        }
        had_lease || had_session
    }

    /// Whether the agent of `key` would re-join a restarted controller: its
    /// lease is live and it was not lost.
    pub(crate) fn agent_live(&self, key: &K) -> bool {
        self.live_lease(key).is_some() && !self.agents_gone.contains(key)
    }

    /// Lets every live session whose agent has not joined yet join (and was
    /// not acknowledged: it joined before its convergence call). Returns
    /// their keys, in key order. A quiet session's agent joins nobody the
    /// provider reports to: it waits for the new controller's re-attach.
    pub(crate) fn join_waiting(&mut self) -> Vec<K> {
        let mut joined = Vec::new();
        for (key, session) in self
            .sessions
            .iter_mut()
            .filter(|(_, s)| !s.joined && !s.quiet && !s.acknowledged)
        {
            session.joined = true;
            joined.push(key.clone());
        }
        joined
    }

    /// The newest attempt of `key`'s slot that ever got a lease.
    pub(crate) fn newest_attempt(&self, key: &K) -> Option<NodeAttemptId> {
        self.lease_owners
            .values()
            .filter(|owner| owner.same_slot(key))
            .map(SlotKey::attempt)
            .max()
    }

    /// The leases and sessions that are live right now.
    pub(crate) fn live(&self) -> LiveResources {
        let leases = self
            .leases
            .iter()
            .filter(|(_, leases)| !leases.is_empty())
            .map(|(key, leases)| {
                let count = u32::try_from(leases.len()).unwrap_or(u32::MAX);
                (key.resource_key(), count)
            })
            .collect();
        let sessions = self
            .sessions
            .keys()
            .map(|key| (key.resource_key(), 1))
            .collect();
        LiveResources { leases, sessions }
    }

    /// The key a lease was issued for.
    pub(crate) fn lease_owner(&self, lease: &LeaseHandle) -> Option<K> {
        self.lease_owners.get(lease).cloned()
    }

    /// The key a session was issued for.
    pub(crate) fn session_owner(&self, session: &SessionHandle) -> Option<K> {
        self.session_owners.get(session).cloned()
    }

    /// G08 breaches seen since the last call.
    pub(crate) fn take_alarms(&mut self) -> Vec<String> {
        std::mem::take(&mut self.alarms)
    }

    /// Raises an alarm when `key` is about to get a `what` while it already
    /// holds one (`same_key`), or another attempt of its slot holds anything.
    fn watch_creation(&mut self, key: &K, what: &str, same_key: bool) {
        let holders: BTreeSet<NodeAttemptId> = self
            .leases
            .iter()
            .filter(|(k, leases)| k.same_slot(key) && !leases.is_empty())
            .map(|(k, _)| k.attempt())
            .chain(
                self.sessions
                    .keys()
                    .filter(|k| k.same_slot(key) && k.attempt() != key.attempt())
                    .map(SlotKey::attempt),
            )
            .collect();
        if same_key || holders.iter().any(|a| *a != key.attempt()) {
            let (node, attempt) = key.resource_key();
            let names: Vec<String> = holders.iter().map(ToString::to_string).collect();
            self.alarms.push(format!(
                "a {what} was created for {node}/{attempt} while the slot held live resources of attempts [{}]",
                names.join(", ")
            ));
        }
    }
}

#[derive(Debug, Default)]
struct HangSlot {
    released: bool,
    waker: Option<Waker>,
}

impl HangSlot {
    fn release(&mut self) {
        self.released = true;
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }
}

#[derive(Debug, Default)]
struct HangSlots {
    slots: BTreeMap<u64, HangSlot>,
    next: u64,
}

/// Calls hung on purpose, oldest first, until the harness releases them.
#[derive(Debug, Default)]
pub(crate) struct HangGate {
    state: Mutex<HangSlots>,
}

impl HangGate {
    fn lock(&self) -> MutexGuard<'_, HangSlots> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hangs a call: the future resolves once the call is released.
    pub(crate) fn park(&self) -> Hung<'_> {
        let mut state = self.lock();
        let id = state.next;
        state.next += 1;
        state.slots.insert(id, HangSlot::default());
        Hung { gate: self, id }
    }

    /// Lets the oldest hung call go on. Returns whether one was hung.
    pub(crate) fn release_oldest(&self) -> bool {
        let mut state = self.lock();
        let oldest = state.slots.values_mut().find(|slot| !slot.released);
        oldest.map(HangSlot::release).is_some()
    }

    /// Lets every hung call go on. Returns how many were hung.
    pub(crate) fn release_all(&self) -> usize {
        let mut state = self.lock();
        let mut released = 0;
        for slot in state.slots.values_mut().filter(|slot| !slot.released) {
            slot.release();
            released += 1;
        }
        released
    }

    /// Calls hung right now.
    pub(crate) fn hung(&self) -> usize {
        self.lock().slots.values().filter(|s| !s.released).count()
    }
}

/// A call parked at a [`HangGate`].
pub(crate) struct Hung<'a> {
    gate: &'a HangGate,
    id: u64,
}

impl Future for Hung<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.gate.lock();
        match state.slots.get_mut(&self.id) {
            Some(slot) if !slot.released => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
            _ => {
                state.slots.remove(&self.id);
                Poll::Ready(())
            }
        }
    }
}
