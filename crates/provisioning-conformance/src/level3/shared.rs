//! What a Level 3 substrate, its backend and the plugin's observation sink
//! share: one [`State`] behind one mutex, and a condition variable.
//!
//! Two kinds of threads touch it: the harness thread (substrate methods,
//! and the backend calls it polls) and the runtime's threads on which the
//! plugin reports facts through its sink. The mutex is never held across an
//! `.await` or a plugin call; [`Shared::wait_until`] lets the harness
//! thread wait, bounded, for a fact the plugin reports in the background.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use provisioning::effect::SessionHandle;
use provisioning::{EffectError, EffectKind, EffectOutput, LeaseHandle, Observation, Operation};
use provisioning::{OperationId, RunId};

use super::ledger::{Ledger, LedgerPolicy};
use crate::substrate::{FaultQueue, ResourceKey, SubstrateCounters};
use crate::trace::{Fault, FaultTarget};

/// How many observations may wait for the harness (a safety bound: every
/// harness step takes them, and one step reports a handful).
pub const INBOX_OBSERVATIONS_MAX: usize = 4096;

/// Whether a substrate can turn a scripted fault into a real event for a
/// call of a kind (each substrate's table says how).
pub type Producible = fn(EffectKind, Fault) -> bool;

/// What became of a scripted fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scripted {
    /// Queued for its call.
    Queued,
    /// The substrate cannot produce it for its target: refused.
    Unproducible,
    /// The queue is full or stopped (the fair tail): refused.
    NotAccepted,
}

impl Scripted {
    /// Whether the fault was queued.
    pub fn is_queued(self) -> bool {
        self == Scripted::Queued
    }
}

/// Whether a backend call is working or deliberately stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CallPhase {
    /// Real I/O in progress: settling waits for it.
    Busy,
    /// Stopped on purpose until released.
    Hung,
}

/// A call hung on purpose, with what the substrate needs to release it
/// (`P`: a stopped pid, a node key, nothing for a held call).
#[derive(Clone, Debug)]
pub struct Hang<P> {
    /// The hung call.
    pub op: OperationId,
    /// The substrate's own part: what to continue on release.
    pub what: P,
    /// Whether it was released.
    pub released: bool,
}

/// The mutable part of [`Shared`]. `F` counts the substrate's real faults,
/// `X` is its part of a session, `P` its part of a hang.
#[derive(Debug)]
pub struct State<F, X = (), P = ()> {
    producible: Producible,
    scripts: FaultQueue<EffectKind>,
    inbox: Vec<Observation>,
    /// Sessions, losses and handle owners.
    pub ledger: Ledger<X>,
    calls: BTreeMap<OperationId, CallPhase>,
    /// Calls running in a task of their own, which outlive the executor that
    /// made them.
    detached: BTreeSet<OperationId>,
    hangs: BTreeMap<u64, Hang<P>>,
    next_hang: u64,
    alarms: Vec<String>,
    /// Vacuity counters for the harness.
    pub counters: SubstrateCounters,
    /// Real faults the substrate applied.
    pub faults: F,
}

impl<F, X: Default, P: Clone> State<F, X, P> {
    /// Every tracked session, in key order.
    pub fn sessions(&self) -> &BTreeMap<ResourceKey, super::ledger::SessionTrack<X>> {
        self.ledger.sessions()
    }

    /// The live sessions the plugin answered for, in key order.
    pub fn live_sessions(&self) -> Vec<ResourceKey> {
        self.ledger.live_sessions()
    }

    /// Whether the plugin reported the loss of `key`.
    pub fn lost(&self, key: &ResourceKey) -> bool {
        self.ledger.lost(key)
    }

    /// Whether the plugin reported that the agent of `key` joined.
    pub fn joined(&self, key: &ResourceKey) -> bool {
        self.ledger.joined(key)
    }

    /// Whether the session of `key` has nothing more to wait for.
    pub fn session_settled(&self, key: &ResourceKey) -> bool {
        self.ledger.session_settled(key)
    }

    /// Backend calls doing real I/O right now: attached calls not hung, and
    /// detached calls whose executor is gone unless they hang.
    pub fn busy_calls(&self) -> usize {
        let attached = self
            .calls
            .values()
            .filter(|phase| **phase == CallPhase::Busy)
            .count();
        let detached = self
            .detached
            .iter()
            .filter(|op| !self.calls.contains_key(op))
            .filter(|op| !self.hangs.values().any(|h| h.op == **op && !h.released))
            .count();
        attached + detached
    }

    /// Hung calls not released yet.
    pub fn hung_calls(&self) -> usize {
        self.hangs.values().filter(|hang| !hang.released).count()
    }

    /// Whether call `op` still runs in a task of its own.
    pub fn is_detached(&self, op: OperationId) -> bool {
        self.detached.contains(&op)
    }

    /// Scripted faults not used yet.
    pub fn unused_scripts(&self) -> usize {
        self.scripts.len()
    }

    /// Marks `op` busy (a held call's task doing its call).
    pub fn mark_busy(&mut self, op: OperationId) {
        self.calls.insert(op, CallPhase::Busy);
    }

    /// Forgets `op`'s mark (its task ended).
    pub fn unmark_busy(&mut self, op: OperationId) {
        self.calls.remove(&op);
    }

    /// The hangs not released yet, oldest first.
    pub fn unreleased_hangs(&self) -> Vec<u64> {
        self.hangs
            .iter()
            .filter(|(_, hang)| !hang.released)
            .map(|(serial, _)| *serial)
            .collect()
    }

    /// Marks hang `serial` released and its call busy again; the hang, when
    /// it was not released before.
    pub fn release_hang(&mut self, serial: u64) -> Option<Hang<P>> {
        let hang = self.hangs.get_mut(&serial).filter(|h| !h.released)?;
        hang.released = true;
        let hang = hang.clone();
        if let Some(phase) = self.calls.get_mut(&hang.op) {
            *phase = CallPhase::Busy;
        }
        Some(hang)
    }
}

/// The shared state and its condition variable. See the module docs.
#[derive(Debug)]
pub struct Shared<F, X = (), P = ()> {
    state: Mutex<State<F, X, P>>,
    changed: Condvar,
}

/// Removes a call from the in-flight registry when the call ends, however
/// it ends (completion, or its future dropped).
#[derive(Debug)]
pub struct InFlight<'a, F, X, P> {
    shared: &'a Shared<F, X, P>,
    op: OperationId,
}

impl<F, X, P> Drop for InFlight<'_, F, X, P> {
    fn drop(&mut self) {
        self.shared.lock().calls.remove(&self.op);
        self.shared.changed.notify_all();
    }
}

/// Marks a call's own task running until dropped.
#[derive(Debug)]
pub struct Detached<F, X, P> {
    shared: Arc<Shared<F, X, P>>,
    op: OperationId,
}

impl<F, X, P> Drop for Detached<F, X, P> {
    fn drop(&mut self) {
        self.shared.lock().detached.remove(&self.op);
        self.shared.changed.notify_all();
    }
}

/// Ends a held call's hang and its busy mark when its task ends.
#[derive(Debug)]
pub struct HeldCall<F, X, P> {
    shared: Arc<Shared<F, X, P>>,
    serial: u64,
    op: OperationId,
}

impl<F, X, P> Drop for HeldCall<F, X, P> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.hangs.remove(&self.serial);
        state.calls.remove(&self.op);
        drop(state);
        self.shared.changed.notify_all();
    }
}

impl<F: Default, X: Default, P: Clone> Shared<F, X, P> {
    /// Empty shared state for a substrate that can produce what
    /// `producible` says, folding answers by `policy`.
    pub fn new(producible: Producible, policy: LedgerPolicy) -> Self {
        Shared {
            state: Mutex::new(State {
                producible,
                scripts: FaultQueue::new(),
                inbox: Vec::new(),
                ledger: Ledger::new(policy),
                calls: BTreeMap::new(),
                detached: BTreeSet::new(),
                hangs: BTreeMap::new(),
                next_hang: 0,
                alarms: Vec::new(),
                counters: SubstrateCounters::default(),
                faults: F::default(),
            }),
            changed: Condvar::new(),
        }
    }
}

impl<F, X, P> Shared<F, X, P> {
    /// Locks the state (a poisoned lock is taken over: a panicking test
    /// thread must not hide what the others saw).
    pub fn lock(&self) -> MutexGuard<'_, State<F, X, P>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<F, X: Default, P: Clone> Shared<F, X, P> {
    /// Waits until `done` holds or `timeout` passes. Returns whether it held.
    pub fn wait_until(&self, timeout: Duration, done: impl Fn(&State<F, X, P>) -> bool) -> bool {
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

    /// Wakes every waiter to look at the state again.
    pub fn notify(&self) {
        self.changed.notify_all();
    }

    /// Queues a fault for its target, unless the substrate cannot produce it
    /// there or the queue does not accept it.
    pub fn script(&self, target: FaultTarget, fault: Fault) -> Scripted {
        let mut state = self.lock();
        let producible = state.producible;
        let can = match target {
            FaultTarget::Kind(kind) => producible(kind, fault),
            FaultTarget::Any => EffectKind::ALL.into_iter().any(|k| producible(k, fault)),
        };
        if !can {
            Scripted::Unproducible
        } else if state.scripts.push(target.kind(), fault) {
            Scripted::Queued
        } else {
            Scripted::NotAccepted
        }
    }

    /// Drops every scripted fault and accepts no more.
    pub fn stop_faults(&self) {
        self.lock().scripts.stop();
    }

    /// Takes the fault for the call of `kind` that starts now (one scripted
    /// for the kind first, then one scripted for any call) and counts it as
    /// applied: for substrates whose every taken fault is applied.
    pub fn take_script(&self, kind: EffectKind) -> Option<Fault> {
        let mut state = self.lock();
        let fault = take(&mut state, kind)?;
        state.counters.faults_applied += 1;
        Some(fault)
    }

    /// Takes the fault for the call of `kind` that starts now without
    /// counting it: for substrates that count a fault once it reached its
    /// real event ([`Shared::applied`]).
    pub fn take_script_unapplied(&self, kind: EffectKind) -> Option<Fault> {
        take(&mut self.lock(), kind)
    }

    /// Counts a scripted fault that reached its real event, and its kind.
    pub fn applied(&self, update: impl FnOnce(&mut F)) {
        let mut state = self.lock();
        state.counters.faults_applied += 1;
        update(&mut state.faults);
    }

    /// Adds to the fault counts.
    pub fn count(&self, update: impl FnOnce(&mut F)) {
        update(&mut self.lock().faults);
    }

    /// Registers a call as in flight (busy) until the guard drops.
    pub fn call_started(&self, op: OperationId) -> InFlight<'_, F, X, P> {
        self.lock().calls.insert(op, CallPhase::Busy);
        InFlight { shared: self, op }
    }

    /// Registers call `op`'s own task until the guard drops.
    pub fn detached(self: &Arc<Self>, op: OperationId) -> Detached<F, X, P> {
        self.lock().detached.insert(op);
        Detached {
            shared: self.clone(),
            op,
        }
    }

    /// Records that `op` hangs (`what` says how to release it), counts it
    /// with `update`, and returns the hang's serial.
    pub fn hang(&self, op: OperationId, what: P, update: impl FnOnce(&mut F)) -> u64 {
        let mut state = self.lock();
        let serial = state.next_hang;
        state.next_hang += 1;
        state.hangs.insert(
            serial,
            Hang {
                op,
                what,
                released: false,
            },
        );
        if let Some(phase) = state.calls.get_mut(&op) {
            *phase = CallPhase::Hung;
        }
        state.counters.hangs += 1;
        update(&mut state.faults);
        serial
    }

    /// A guard that ends hang `serial` of the held call `op` when the call's
    /// task ends (see [`Shared::mark_busy`] for the call itself).
    pub fn held(self: &Arc<Self>, serial: u64, op: OperationId) -> HeldCall<F, X, P> {
        HeldCall {
            shared: self.clone(),
            serial,
            op,
        }
    }

    /// Marks the held call `op` busy once it was let go.
    pub fn mark_busy(&self, op: OperationId) {
        self.lock().mark_busy(op);
    }

    /// Whether hang `serial` was released (or has ended).
    pub fn released(&self, serial: u64) -> bool {
        self.lock()
            .hangs
            .get(&serial)
            .is_none_or(|hang| hang.released)
    }

    /// Forgets hang `serial` (its call goes on or ended). Returns it when it
    /// was never released: what it stopped is still stopped.
    pub fn end_hang(&self, serial: u64) -> Option<Hang<P>> {
        let mut state = self.lock();
        let hang = state.hangs.remove(&serial)?;
        if let Some(phase) = state.calls.get_mut(&hang.op) {
            *phase = CallPhase::Busy;
        }
        (!hang.released).then_some(hang)
    }

    /// Notes that a start call for `key` begins (see
    /// [`Ledger::session_starting`]).
    pub fn session_starting(&self, key: &ResourceKey) {
        self.lock().ledger.session_starting(key);
    }

    /// Raises a G08 alarm.
    pub fn alarm(&self, alarm: String) {
        self.lock().alarms.push(alarm);
    }

    /// Takes the raised alarms.
    pub fn take_alarms(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().alarms)
    }

    /// Takes the observations reported since the last call.
    pub fn take_observations(&self) -> Vec<Observation> {
        std::mem::take(&mut self.lock().inbox)
    }

    /// The key a lease was issued for (see [`Ledger::lease_owner`]).
    pub fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.lock().ledger.lease_owner(lease)
    }

    /// The key a session was issued for.
    pub fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.lock().ledger.session_owner(session)
    }

    /// The vacuity counters.
    pub fn counters(&self) -> SubstrateCounters {
        self.lock().counters
    }

    /// Folds a fact the plugin reported through its sink (called on the
    /// plugin's threads as well as the harness thread) and keeps it for the
    /// harness, within [`INBOX_OBSERVATIONS_MAX`].
    pub fn observe(&self, observation: Observation) {
        let mut state = self.lock();
        state.ledger.observe(&observation);
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

    /// Folds what a backend call answered (see [`Ledger::answered`]).
    pub fn answered(&self, operation: &Operation, outcome: &Result<EffectOutput, EffectError>) {
        let mut state = self.lock();
        let State {
            ledger, counters, ..
        } = &mut *state;
        ledger.answered(operation, outcome, counters);
        drop(state);
        self.changed.notify_all();
    }
}

fn take<F, X, P>(state: &mut State<F, X, P>, kind: EffectKind) -> Option<Fault> {
    let producible = state.producible;
    state.scripts.take(&kind, |fault| producible(kind, fault))
}

/// The attempt key of `key` in `run`, as a plugin names it.
pub fn attempt_key(run: &RunId, key: &ResourceKey) -> provisioning_provider::AttemptKey {
    provisioning_provider::AttemptKey {
        run_id: run.clone(),
        node: key.0.clone(),
        attempt: key.1,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use provisioning::observe::LossCause;
    use provisioning::{GroupId, LogicalNodeId, NodeAttemptId};

    use super::*;
    use crate::level3::{LeaseOwners, SessionHandles};

    type TestShared = Shared<u64>;

    fn shared() -> Arc<TestShared> {
        Arc::new(Shared::new(
            |kind, fault| kind == EffectKind::CreateLease && fault == Fault::Hang,
            LedgerPolicy {
                session_handles: SessionHandles::PerStart,
                lease_owners: LeaseOwners::UniqueOnly,
            },
        ))
    }

    fn lost() -> Observation {
        Observation::NodeLost {
            node: LogicalNodeId::new(GroupId::new("a"), 0),
            attempt: NodeAttemptId::from_raw(1),
            cause: LossCause::LeaseGone,
        }
    }

    #[test]
    fn a_wait_ends_when_the_plugin_reports_the_fact_and_gives_up_without_it() {
        let shared = shared();
        let key = (
            LogicalNodeId::new(GroupId::new("a"), 0),
            NodeAttemptId::from_raw(1),
        );
        assert!(!shared.wait_until(Duration::from_millis(10), |s| s.lost(&key)));
        let reporter = shared.clone();
        let thread = std::thread::spawn(move || reporter.observe(lost()));
        assert!(shared.wait_until(Duration::from_secs(60), |s| s.lost(&key)));
        thread.join().expect("the reporting thread ends");
        assert_eq!(shared.take_observations(), vec![lost()]);
        assert!(shared.take_observations().is_empty());
    }

    #[test]
    fn the_inbox_keeps_at_most_its_bound() {
        let shared = shared();
        for _ in 0..INBOX_OBSERVATIONS_MAX + 3 {
            shared.observe(lost());
        }
        assert_eq!(shared.take_observations().len(), INBOX_OBSERVATIONS_MAX);
    }

    #[test]
    fn only_producible_faults_are_queued_and_a_hang_counts_until_released() {
        let shared = shared();
        let kind = FaultTarget::Kind(EffectKind::CreateLease);
        assert_eq!(
            shared.script(FaultTarget::Kind(EffectKind::DestroyLease), Fault::Hang),
            Scripted::Unproducible
        );
        assert_eq!(shared.script(kind, Fault::Hang), Scripted::Queued);
        assert_eq!(shared.take_script(EffectKind::DestroyLease), None);
        assert_eq!(
            shared.take_script(EffectKind::CreateLease),
            Some(Fault::Hang)
        );
        let op = OperationId::new(
            NodeAttemptId::from_raw(1),
            provisioning::id::OperationSequence::from_raw(1),
        );
        let in_flight = shared.call_started(op);
        assert_eq!(shared.lock().busy_calls(), 1);
        let serial = shared.hang(op, (), |count| *count += 1);
        let busy_and_hung = {
            let state = shared.lock();
            (state.busy_calls(), state.hung_calls())
        };
        assert_eq!(busy_and_hung, (0, 1));
        assert!(shared.lock().release_hang(serial).is_some());
        assert!(shared.lock().release_hang(serial).is_none());
        assert_eq!(shared.lock().busy_calls(), 1);
        assert!(shared.end_hang(serial).is_none(), "it was released");
        drop(in_flight);
        assert_eq!(shared.lock().busy_calls(), 0);
        let state = shared.lock();
        assert_eq!((state.faults, state.counters.hangs), (1, 1));
        assert_eq!(state.counters.faults_applied, 1);
        drop(state);
        shared.stop_faults();
        assert_eq!(shared.script(kind, Fault::Hang), Scripted::NotAccepted);
    }
}
