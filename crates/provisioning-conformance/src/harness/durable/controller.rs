//! The controller boundary: [`ControllerBackend`] wraps the substrate's
//! backend for one controller life (an *epoch*). At every call start it
//! records whether the operation was committed as pending (G27); after a
//! crash it refuses every call the dead controller's executor still had
//! queued, while calls already running in the backend go on there
//! (*zombies*). [`Control`] is what the wrappers of one run share with the
//! harness.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures_util::FutureExt;

use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{
    EffectError, EffectKind, EffectOutput, IdempotentEffectExecutor, LogicalNodeId, NodeAttemptId,
    Operation, OperationId,
};

use crate::guarantee::Violation;
use crate::harness::Harness;
use crate::oracle::{self};
use crate::substrate::{ResourceKey, Substrate};

/// One call that passed the wrapper into the substrate's backend.
#[derive(Clone, Debug)]
pub(in crate::harness) struct CallStart {
    pub(in crate::harness) op: OperationId,
    pub(in crate::harness) node: LogicalNodeId,
    pub(in crate::harness) kind: EffectKind,
    /// Whether the operation was committed as pending before the call.
    pub(in crate::harness) committed: bool,
    /// Calls of the same attempt from dead controllers still in the backend.
    pub(in crate::harness) zombies: u32,
}

#[derive(Debug, Default)]
pub(in crate::harness) struct ControlState {
    /// The epoch of the live controller.
    pub(super) live_epoch: u64,
    /// Every operation some commit held pending.
    pub(super) committed: BTreeSet<OperationId>,
    /// Calls started since the harness last looked.
    pub(super) starts: Vec<CallStart>,
    /// Calls the live controller's executor started in the backend (the
    /// kit's own count of what `ExecutorCounters::started` reports).
    pub(in crate::harness) live_calls: u64,
    /// Backend panics that came out of calls of the live controller's
    /// executor (the kit's own count of what `ExecutorCounters::panics`
    /// reports).
    pub(in crate::harness) live_panics: u64,
    /// The live controller's calls that panicked, with the text of the
    /// panic (when its payload is text), until the harness takes their
    /// result: what the executor reports for the call must carry it.
    pub(in crate::harness) panicked: BTreeMap<OperationId, Option<String>>,
    /// Calls in the backend, per attempt: (epoch, operation).
    pub(super) in_flight: BTreeMap<NodeAttemptId, Vec<(u64, OperationId)>>,
    /// Keys a zombie call created a resource for.
    pub(super) zombie_created: BTreeSet<ResourceKey>,
}

impl ControlState {
    /// How many calls of the live controller's executor are in the backend
    /// now (started and not yet ended).
    pub(in crate::harness) fn live_in_backend(&self) -> u64 {
        let live = self.live_epoch;
        self.in_flight
            .values()
            .flatten()
            .filter(|(epoch, _)| *epoch == live)
            .count() as u64
    }
}

/// The text of a panic's payload, when it is text.
fn payload_text(payload: &(dyn std::any::Any + Send)) -> Option<String> {
    payload
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
}

/// What the controller wrappers of one run share with the harness.
#[derive(Clone, Debug, Default)]
pub(in crate::harness) struct Control {
    state: Arc<Mutex<ControlState>>,
}

impl Control {
    pub(in crate::harness) fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The backend under one controller life's executor: the substrate's
/// backend, seen through the G27 check and the crash boundary.
pub(in crate::harness) struct ControllerBackend<B: EffectBackend> {
    inner: Arc<B>,
    epoch: u64,
    control: Control,
}

impl<B: EffectBackend> ControllerBackend<B> {
    pub(in crate::harness) fn new(inner: Arc<B>, control: &Control) -> Self {
        let epoch = control.lock().live_epoch;
        ControllerBackend {
            inner,
            epoch,
            control: control.clone(),
        }
    }
}

struct InFlight {
    control: Control,
    attempt: NodeAttemptId,
    epoch: u64,
    op: OperationId,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.control.lock();
        if let Some(calls) = state.in_flight.get_mut(&self.attempt) {
            calls.retain(|call| *call != (self.epoch, self.op));
            if calls.is_empty() {
                state.in_flight.remove(&self.attempt);
            }
        }
    }
}

impl<B: EffectBackend> EffectBackend for ControllerBackend<B> {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(async move {
            let attempt = operation.attempt();
            let in_flight = {
                let mut state = self.control.lock();
                if state.live_epoch != self.epoch {
                    // Queued work of a dead controller: it died with it.
                    return Err(EffectError::definite("the controller died"));
                }
                let committed = state.committed.contains(&operation.id);
                let zombies = state.in_flight.get(&attempt).map_or(0, |calls| {
                    calls
                        .iter()
                        .filter(|(epoch, _)| *epoch != self.epoch)
                        .count()
                });
                state.live_calls += 1;
                state.starts.push(CallStart {
                    op: operation.id,
                    node: operation.node.clone(),
                    kind: operation.kind(),
                    committed,
                    zombies: u32::try_from(zombies).unwrap_or(u32::MAX),
                });
                state
                    .in_flight
                    .entry(attempt)
                    .or_default()
                    .push((self.epoch, operation.id));
                InFlight {
                    control: self.control.clone(),
                    attempt,
                    epoch: self.epoch,
                    op: operation.id,
                }
            };
            let call = AssertUnwindSafe(self.inner.execute(operation))
                .catch_unwind()
                .await;
            let outcome = match call {
                Ok(outcome) => outcome,
                Err(payload) => {
                    // Seen on its way out, and passed on as it came: the
                    // executor must turn it into an error (G13).
                    let mut state = self.control.lock();
                    if state.live_epoch == self.epoch {
                        state.live_panics += 1;
                        state.panicked.insert(operation.id, payload_text(&*payload));
                    }
                    drop(state);
                    drop(in_flight);
                    std::panic::resume_unwind(payload);
                }
            };
            {
                // Marked before the call leaves the in-flight list, so that
                // the oracle (which may look from another thread at a Level 3
                // substrate) always sees a dead controller's resource as
                // either still being made or made by it.
                let mut state = self.control.lock();
                if state.live_epoch != self.epoch {
                    let created = matches!(
                        outcome,
                        Ok(EffectOutput::LeaseCreated { adopted: false, .. }
                            | EffectOutput::BootstrapStarted { adopted: false, .. })
                    );
                    if created {
                        state
                            .zombie_created
                            .insert((operation.node.clone(), attempt));
                    }
                }
            }
            drop(in_flight);
            outcome
        })
    }
}

impl<S: Substrate> Harness<S> {
    /// Builds the executor of the current controller life, counting its
    /// wake-ups ("a result is ready to be taken") in `notified`.
    pub(in crate::harness) fn controller_executor(
        substrate: &S,
        control: &Control,
        notified: &Arc<AtomicU64>,
    ) -> IdempotentEffectExecutor<ControllerBackend<S::Backend>> {
        let backend = ControllerBackend::new(substrate.backend(), control);
        let notified = notified.clone();
        IdempotentEffectExecutor::with_notify(Arc::new(backend), substrate.spawner(), move || {
            notified.fetch_add(1, Ordering::Relaxed);
        })
    }

    /// The calls that passed the wrapper since the last look, and the
    /// zombie count per operation for G05.
    pub(in crate::harness) fn take_call_starts(
        &mut self,
    ) -> (Vec<CallStart>, BTreeMap<OperationId, u32>) {
        let starts = std::mem::take(&mut self.durable.control.lock().starts);
        let zombies = starts.iter().map(|s| (s.op, s.zombies)).collect();
        (starts, zombies)
    }

    /// G27 for calls that passed the wrapper.
    pub(in crate::harness) fn check_committed(
        &self,
        starts: &[CallStart],
    ) -> Result<(), Violation> {
        for start in starts {
            self.check(oracle::g27_committed_before_the_call(
                &start.op,
                &start.node,
                start.kind,
                start.committed,
            ))?;
        }
        Ok(())
    }
}
