//! The durable side of the harness host: journaling before dispatch (G27),
//! controller crashes and recovery (G26), and orphan collection (G28).
//!
//! Per wake the host drives the driver into a [`Batch`], commits the drive's
//! change set to the journal, and only then submits the batch to the
//! executor — as the real host does. The executor runs over a
//! [`ControllerBackend`], a thin wrapper of the substrate's backend that
//! belongs to one controller life (an *epoch*): it checks at every call start
//! that the operation was committed as pending (G27), and after a crash it
//! refuses every call the dead controller's executor still had queued, while
//! calls that were already running in the backend go on there (*zombies*).

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::FutureExt;

use provisioning::driver::{OperationSink, SubmitError};
use provisioning::durable::RecoveryError;
use provisioning::executor::{EffectBackend, Submitted};
use provisioning::observe::LossCause;
use provisioning::spawn::BoxFuture;
use provisioning::state::PendingOperation;
use provisioning::{
    DriverChanges, EffectError, EffectKind, EffectOutput, ExecutorResult, IdempotentEffectExecutor,
    LogicalNodeId, NodeAttemptId, NodeTemplate, Observation, Operation, OperationId, Timestamp,
};

use super::Harness;
use crate::guarantee::{GuaranteeId, Violation};
use crate::journal::InMemoryJournal;
use crate::oracle::{self, breach};
use crate::substrate::{LiveResources, ResourceKey, Substrate};
use crate::trace::WorkStep;

/// The default `orphan_grace`: how long a resource must be seen unowned
/// before the host destroys it (SPEC §13's default).
pub const DEFAULT_ORPHAN_GRACE: Duration = Duration::from_secs(30);

/// The default `orphan_scan_interval`: how often the host lists the
/// substrate's live resources while running.
pub const DEFAULT_ORPHAN_SCAN_INTERVAL: Duration = Duration::from_secs(10);

/// In which order the host makes a drive durable and hands it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostOrder {
    /// Commit the drive's change set, then submit its operations (correct;
    /// SPEC §13, G27).
    CommitThenSubmit,
    /// Submit first, commit after — a deliberately wrong host, for the
    /// kit's own mutation tests (caught as G27).
    SubmitThenCommit,
}

/// How the harness host journals, recovers and collects orphans.
///
/// The defaults are the correct host. The other settings exist so the
/// kit's tests can prove the oracle notices a wrong host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostOptions {
    /// Commit before submit (default) or the reverse.
    pub order: HostOrder,
    /// Whether orphans are destroyed at all (default: yes; `false` is a
    /// mutation, caught as G28).
    pub collect_orphans: bool,
    /// How long a resource must be seen unowned before it is destroyed.
    pub orphan_grace: Duration,
    /// How often the live resources are listed while running.
    pub orphan_scan_interval: Duration,
}

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            order: HostOrder::CommitThenSubmit,
            collect_orphans: true,
            orphan_grace: DEFAULT_ORPHAN_GRACE,
            orphan_scan_interval: DEFAULT_ORPHAN_SCAN_INTERVAL,
        }
    }
}

/// Collects a drive's operations so they are submitted only after the
/// drive's changes are committed.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) operations: Vec<Operation>,
    pub(super) retired: Vec<NodeAttemptId>,
    /// Armed refusals (`refuse` inputs): each refuses the next operation of
    /// its kind (`None`: of any kind), in order.
    pub(super) refuse: Vec<Option<EffectKind>>,
    /// The operations this sink refused.
    pub(super) refused: Vec<Operation>,
}

impl OperationSink for Batch {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        let kind = operation.kind();
        // At most one refusal per node and drive: the kit judges each as one
        // fold between the drive's start and end.
        let again = self.refused.iter().any(|r| r.node == operation.node);
        if let Some(armed) = self
            .refuse
            .iter()
            .position(|target| target.is_none_or(|k| k == kind))
            .filter(|_| !again)
        {
            self.refuse.remove(armed);
            self.refused.push(operation);
            return Err(SubmitError::Refused("the host's outbox is full".to_owned()));
        }
        self.operations.push(operation);
        Ok(())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.retired.push(attempt);
    }
}

/// One call that passed the wrapper into the substrate's backend.
#[derive(Clone, Debug)]
pub(super) struct CallStart {
    pub(super) op: OperationId,
    pub(super) node: LogicalNodeId,
    pub(super) kind: EffectKind,
    /// Whether the operation was committed as pending before the call.
    pub(super) committed: bool,
    /// Calls of the same attempt from dead controllers still in the backend.
    pub(super) zombies: u32,
}

#[derive(Debug, Default)]
pub(super) struct ControlState {
    /// The epoch of the live controller.
    live_epoch: u64,
    /// Every operation some commit held pending.
    committed: BTreeSet<OperationId>,
    /// Calls started since the harness last looked.
    starts: Vec<CallStart>,
    /// Calls the live controller's executor started in the backend (the
    /// kit's own count of what `ExecutorCounters::started` reports).
    pub(super) live_calls: u64,
    /// Backend panics that came out of calls of the live controller's
    /// executor (the kit's own count of what `ExecutorCounters::panics`
    /// reports).
    pub(super) live_panics: u64,
    /// The live controller's calls that panicked, with the text of the
    /// panic (when its payload is text), until the harness takes their
    /// result: what the executor reports for the call must carry it.
    pub(super) panicked: BTreeMap<OperationId, Option<String>>,
    /// Calls in the backend, per attempt: (epoch, operation).
    in_flight: BTreeMap<NodeAttemptId, Vec<(u64, OperationId)>>,
    /// Keys a zombie call created a resource for.
    zombie_created: BTreeSet<ResourceKey>,
}

impl ControlState {
    /// How many calls of the live controller's executor are in the backend
    /// now (started and not yet ended).
    pub(super) fn live_in_backend(&self) -> u64 {
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
pub(super) struct Control {
    state: Arc<Mutex<ControlState>>,
}

impl Control {
    pub(super) fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The backend under one controller life's executor: the substrate's
/// backend, seen through the G27 check and the crash boundary.
pub(super) struct ControllerBackend<B: EffectBackend> {
    inner: Arc<B>,
    epoch: u64,
    control: Control,
}

impl<B: EffectBackend> ControllerBackend<B> {
    pub(super) fn new(inner: Arc<B>, control: &Control) -> Self {
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

/// What the durable side of one run keeps.
#[derive(Debug)]
pub(super) struct DurableSide {
    pub(super) control: Control,
    /// A crash input is waiting for its wake.
    pub(super) crash_armed: bool,
    /// Crashes that happened.
    pub(super) crashes: u64,
    /// What the last commit wrote: meta, upserts, removals (all zero for
    /// an empty change set).
    pub(super) last_commit: (bool, usize, usize),
    /// What the driver said before the commit: whether changes waited.
    pub(super) changes_waiting: Option<bool>,
    /// Create/start operations recovery made ambiguous, by attempt.
    pub(super) recovered_ambiguous: BTreeSet<(NodeAttemptId, EffectKind)>,
    /// The host's orphan suspects: key → first seen unowned.
    pub(super) suspects: BTreeMap<ResourceKey, Timestamp>,
    /// The oracle's own sample: key → first observed unowned.
    pub(super) observed_orphans: BTreeMap<ResourceKey, Timestamp>,
    /// When the host lists the live resources next.
    pub(super) next_scan_at: Timestamp,
    /// When faults stopped (the fair tail began).
    pub(super) faults_stopped_at: Option<Timestamp>,
    /// Late results the executors of dead controllers dropped.
    pub(super) late_dropped_before: u64,
    /// Commits attempted (successful or not): which of the three ways the
    /// next one takes the driver's changes.
    pub(super) commits: u64,
    /// What the journal holds, as the kit applied every committed change set
    /// itself (`None` before the first commit of a controller whose
    /// journal the kit has not read).
    pub(super) replica: Option<InMemoryJournal>,
    /// A breach found while committing, reported right after the commit.
    pub(super) commit_breach: Option<oracle::Breach>,
}

impl DurableSide {
    pub(super) fn new(now: Timestamp, options: &HostOptions) -> Self {
        DurableSide {
            control: Control::default(),
            crash_armed: false,
            crashes: 0,
            last_commit: (false, 0, 0),
            changes_waiting: None,
            recovered_ambiguous: BTreeSet::new(),
            suspects: BTreeMap::new(),
            observed_orphans: BTreeMap::new(),
            next_scan_at: now.saturating_add(options.orphan_scan_interval),
            faults_stopped_at: None,
            late_dropped_before: 0,
            commits: 0,
            replica: None,
            commit_breach: None,
        }
    }

    /// The guarantee to report for a breach of `guarantee` once a crash
    /// happened: an attempt id reused after a crash is G26's.
    pub(super) fn relabel(&self, guarantee: GuaranteeId, detail: String) -> (GuaranteeId, String) {
        // G08, G21 and G23 keep their own ids after a crash: they are the
        // same guarantees (G26 names them), and a defect that breaks them
        // shrinks to the same id with or without the crash.
        let covered = guarantee == GuaranteeId::Identity;
        if self.crashes > 0 && covered {
            (
                GuaranteeId::CrashSafety,
                format!(
                    "after {} controller crash(es), {} broken: {detail}",
                    self.crashes,
                    guarantee.id()
                ),
            )
        } else {
            (guarantee, detail)
        }
    }
}

impl<S: Substrate> Harness<S> {
    /// A violation of `guarantee`, relabelled as G26 after a crash where G26
    /// covers it.
    pub(super) fn crash_aware(&self, guarantee: GuaranteeId, detail: String) -> Violation {
        let (guarantee, detail) = self.durable.relabel(guarantee, detail);
        self.violation(breach(guarantee, detail))
    }

    /// The driver's changes were committed: the journal holds the breakers
    /// as the kit's model has them. Past an edge the kit stops following the
    /// breakers (a fold may have stopped halfway; finding 13), so from then on
    /// it cannot say what the journal holds of them: every group is unknown.
    fn breakers_committed(&mut self) {
        if self.edges_reached {
            let groups: Vec<_> = self.driver.desired().groups().keys().cloned().collect();
            self.breaker_watch.lose_track(groups);
        }
        self.breaker_watch.committed();
    }

    /// Whether the substrate survives a controller crash (crash inputs and
    /// orphan collection apply only then).
    pub(super) fn crash_capable(&self) -> bool {
        self.substrate.survives_controller_crash()
    }

    /// Builds the executor of the current controller life, counting its
    /// wake-ups ("a result is ready to be taken") in `notified`.
    pub(super) fn controller_executor(
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

    /// Commits the driver's changes since the last commit. On failure the
    /// driver tracks everything again, so the next commit rewrites it all.
    ///
    /// The changes are taken in turn the three ways a host may take them:
    /// as a change set; as the ids of the changed nodes and whether anything
    /// else changed, the host reading those nodes and the meta itself; and
    /// by asking only *whether* something changed, writing the whole state
    /// then and discarding the changes. All three must keep the journal
    /// equal to the driver's durable state (G26, commit form).
    fn commit(&mut self) -> Result<(), String> {
        let way = self.durable.commits % 3;
        self.durable.commits += 1;
        let changes = match way {
            1 => self.changes_from_ids(),
            2 => self.changes_as_snapshot(),
            _ => None,
        }
        .unwrap_or_else(|| self.driver.take_changes(self.now));
        self.durable.last_commit = (
            changes.meta.is_some(),
            changes.upserts.len(),
            changes.removed.len(),
        );
        if changes.is_empty() {
            // Nothing to write: the journal already holds what the driver
            // has, breakers included.
            self.breakers_committed();
            self.check_replica();
            return Ok(());
        }
        if self.durable.commit_breach.is_none() {
            self.durable.commit_breach =
                oracle::g26_write_carries_the_clock(&changes, self.now).err();
        }
        match self.journal.commit(&changes) {
            Ok(()) => {
                self.breakers_committed();
                let mut control = self.durable.control.lock();
                for entry in &changes.upserts {
                    if let Some(pending) = &entry.node.pending {
                        control.committed.insert(pending.id);
                    }
                }
                drop(control);
                match (&mut self.durable.replica, &changes.meta) {
                    (Some(replica), _) => replica.apply(changes),
                    (None, Some(_)) => {
                        let mut fresh = InMemoryJournal::new();
                        fresh.apply(changes);
                        self.durable.replica = Some(fresh);
                    }
                    (None, None) => {}
                }
                self.check_replica();
                Ok(())
            }
            Err(error) => {
                self.driver.track_changes();
                Err(error)
            }
        }
    }

    /// The changes as a host that keeps its own view takes them: the ids of
    /// the nodes that changed, and whether anything else did, read from
    /// the driver's durable state. `None` when the driver does not offer it.
    fn changes_from_ids(&mut self) -> Option<DriverChanges> {
        let (ids, meta) = self.driver.take_changed_nodes()?;
        if ids.is_empty() && !meta {
            return Some(DriverChanges::default());
        }
        let Some(whole) = self.driver.durable_state(self.now) else {
            // It names its changed nodes but cannot show its durable state:
            // everything is taken again, as a change set.
            self.driver.track_changes();
            return None;
        };
        // A journaling host writes the meta with every write: it carries the
        // clock the written instants are read against.
        let mut changes = DriverChanges {
            meta: (meta || !ids.is_empty()).then(|| whole.meta.clone()),
            ..DriverChanges::default()
        };
        let by_id: BTreeMap<&LogicalNodeId, &provisioning::DurableEntry> =
            whole.nodes.iter().map(|e| (&e.node.node, e)).collect();
        for id in ids {
            match by_id.get(&id) {
                Some(entry) => changes.upserts.push((*entry).clone()),
                None => changes.removed.push(id),
            }
        }
        Some(changes)
    }

    /// The changes as a host that only asks whether something changed takes
    /// them: then the whole state (and the removal of every node the
    /// journal holds that the driver no longer has), the changes discarded.
    /// Afterwards the driver must say nothing is waiting. `None` when the
    /// driver does not offer it.
    fn changes_as_snapshot(&mut self) -> Option<DriverChanges> {
        let waiting = self.driver.has_changes()?;
        if !waiting {
            return Some(DriverChanges::default());
        }
        let whole = self.driver.durable_state(self.now)?;
        if !self.driver.discard_changes() {
            return None;
        }
        if self.driver.has_changes() != Some(false) {
            self.durable.commit_breach = Some(breach(
                GuaranteeId::CrashSafety,
                "the driver's changes were discarded, but it still says changes are waiting"
                    .to_owned(),
            ));
        }
        let kept: BTreeSet<&LogicalNodeId> = whole.nodes.iter().map(|e| &e.node.node).collect();
        let removed = self
            .durable
            .replica
            .iter()
            .filter_map(InMemoryJournal::held)
            .flat_map(|(_, nodes)| nodes.keys())
            .filter(|id| !kept.contains(id))
            .cloned()
            .collect();
        Some(DriverChanges {
            meta: Some(whole.meta),
            upserts: whole.nodes,
            removed,
        })
    }

    /// G26 (commit form): after a commit (every fourth), the journal as the
    /// kit applied the change sets holds the driver's durable state — every
    /// node that changed was written, every node that left was removed, and
    /// the meta (shape, allocator, breakers) was written whenever it changed.
    fn check_replica(&mut self) {
        // Every fourth commit (the three ways rotate through the checked
        // ones): a write the driver missed stays missing in the replica
        // until it is written, so a sample finds it, at a quarter of the
        // cost of comparing the whole state after every commit.
        if self.durable.commit_breach.is_some() || self.durable.commits % 4 != 0 {
            return;
        }
        let Some((meta, nodes)) = self
            .durable
            .replica
            .as_ref()
            .and_then(InMemoryJournal::held)
        else {
            return;
        };
        let Some(whole) = self.driver.durable_state(self.now) else {
            return;
        };
        self.durable.commit_breach =
            oracle::g26_journal_holds_durable_state(meta, nodes, &whole).err();
    }

    /// Makes a drive durable and hands its operations out, in the host's
    /// order; an armed crash fires between the two steps.
    pub(super) fn hand_out(&mut self, batch: Batch) -> Result<(), Violation> {
        let crash_now = self.durable.crash_armed && !batch.operations.is_empty();
        // A host that only asks whether to write (and skips the write
        // otherwise) must get the same answer as one that takes the changes.
        self.durable.changes_waiting = self.driver.has_changes();
        match self.options.host.order {
            HostOrder::CommitThenSubmit => {
                let committed = self.commit();
                self.check_changes_waiting()?;
                if crash_now {
                    return self.crash_mid_wake();
                }
                self.submit_batch(batch, committed)
            }
            HostOrder::SubmitThenCommit => {
                self.submit_batch(batch, Ok(()))?;
                if crash_now {
                    return self.crash_mid_wake();
                }
                // Too late to hold anything back if it fails.
                let _ = self.commit();
                self.check_changes_waiting()?;
                Ok(())
            }
        }
    }

    /// G19 (change form): what the driver said was waiting before the
    /// commit agrees with what the commit found.
    fn check_changes_waiting(&mut self) -> Result<(), Violation> {
        if let Some(found) = self.durable.commit_breach.take() {
            return Err(self.violation(found));
        }
        let Some(waiting) = self.durable.changes_waiting.take() else {
            return Ok(());
        };
        let written = self.durable.last_commit != (false, 0, 0);
        self.check(if waiting == written {
            Ok(())
        } else {
            Err(oracle::breach(
                GuaranteeId::Quiescence,
                format!(
                    "the driver said changes were {}waiting, but the change set it gave was {}empty",
                    if waiting { "" } else { "not " },
                    if written { "not " } else { "" }
                ),
            ))
        })
    }

    fn submit_batch(
        &mut self,
        batch: Batch,
        committed: Result<(), String>,
    ) -> Result<(), Violation> {
        for (index, attempt) in batch.retired.into_iter().enumerate() {
            // Retired through the executor's sink faces, as a host whose
            // driver drives straight into it would (both of them, in turn).
            if index % 2 == 0 {
                OperationSink::attempt_retired(&mut self.executor, attempt);
            } else {
                let mut sink = &self.executor;
                sink.attempt_retired(attempt);
            }
            self.executor_watch.retired.insert(attempt);
        }
        for operation in batch.operations {
            let refused = match &committed {
                Ok(()) => match self.submit_in_turn(operation.clone()) {
                    Ok(submitted) => {
                        self.watch_waiting(&operation, submitted);
                        if submitted == Submitted::Queued {
                            self.executor_watch.queued_here += 1;
                            self.vacuity.queued_submissions += 1;
                        }
                        if submitted == Submitted::Replayed {
                            self.executor_watch.replayed_here += 1;
                        }
                        if matches!(submitted, Submitted::Started | Submitted::Queued) {
                            // Taken and not yet run: the executor has it in
                            // flight, and says it has work.
                            let shown = self.executor.in_flight().contains(&operation.id);
                            if !shown || !self.executor.has_work() {
                                return Err(self.violation(oracle::breach(
                                    GuaranteeId::RecordBeforeDispatch,
                                    format!(
                                        "the executor took {} {} but {}",
                                        operation.kind(),
                                        operation.id,
                                        if shown {
                                            "says it has no work"
                                        } else {
                                            "does not list it in flight"
                                        }
                                    ),
                                )));
                            }
                        }
                        self.watch_submission(operation);
                        continue;
                    }
                    Err(refused) => format!("submission refused: {refused}"),
                },
                Err(error) => format!("the journal could not be written: {error}"),
            };
            let result = ExecutorResult {
                op: operation.id,
                node: operation.node.clone(),
                kind: operation.kind(),
                outcome: Err(EffectError::definite(refused)),
            };
            self.deliver_result(result)?;
        }
        Ok(())
    }

    /// Hands `operation` to the executor through its inherent `submit` and
    /// its two `OperationSink` faces in turn, as hosts do (one whose driver
    /// drives straight into the executor uses a face). A face says only
    /// whether the operation was taken; how it was taken is read from the
    /// executor's replay and wait counts and its in-flight list, and a face
    /// that took nothing shows as an operation said started and not in
    /// flight (G04).
    fn submit_in_turn(&mut self, operation: Operation) -> Result<Submitted, SubmitError> {
        let turn = self.executor_watch.submissions % 3;
        self.executor_watch.submissions += 1;
        if turn == 0 {
            return self.executor.submit(operation);
        }
        let before = self.executor.counters();
        let running = self.executor.in_flight().contains(&operation.id);
        if turn == 1 {
            OperationSink::submit(&mut self.executor, operation)?;
        } else {
            let mut sink = &self.executor;
            OperationSink::submit(&mut sink, operation)?;
        }
        let after = self.executor.counters();
        Ok(if after.replayed > before.replayed {
            Submitted::Replayed
        } else if after.waited > before.waited {
            Submitted::Queued
        } else if running {
            Submitted::AlreadyRunning
        } else {
            Submitted::Started
        })
    }

    /// Notes what `submitted` says of `operation` for the kit's count of
    /// skipped operations: one said started waits for its call; one said
    /// queued waits behind its attempt's older operation; and one said
    /// started or queued while an older one of its attempt still waited
    /// (never called yet, not expired through the executor) means that
    /// older one was skipped — it must never reach the backend after a
    /// newer one.
    fn watch_waiting(&mut self, operation: &Operation, submitted: Submitted) {
        let attempt = operation.attempt();
        if matches!(submitted, Submitted::Started | Submitted::Queued) {
            self.executor_watch.uncalled.insert(operation.id);
        }
        let older = match submitted {
            Submitted::Started => {
                self.executor_watch.awaiting_call.insert(operation.id);
                self.executor_watch.waiting_behind.remove(&attempt)
            }
            // A newer operation queued in its place: the older one no
            // longer waits either.
            Submitted::Queued => self
                .executor_watch
                .waiting_behind
                .insert(attempt, operation.id),
            Submitted::AlreadyRunning | Submitted::Replayed => None,
        };
        if let Some(older) = older {
            // A call may have started since the harness last took the
            // starts (a pass between deliveries submits).
            let called = self
                .durable
                .control
                .lock()
                .starts
                .iter()
                .any(|s| s.op == older);
            if !called {
                self.executor_watch.skipped_at_submission += 1;
                self.vacuity.skipped_at_submission += 1;
            }
        }
    }

    /// The armed crash fires: the backend runs whatever work reached it,
    /// then the controller dies and is recovered.
    fn crash_mid_wake(&mut self) -> Result<(), Violation> {
        self.substrate.run_work(WorkStep::Fifo);
        self.check_calls()?;
        self.crash()
    }

    /// The controller dies now and a new one is recovered from the journal.
    pub(super) fn crash(&mut self) -> Result<(), Violation> {
        self.durable.crash_armed = false;
        let stored = match self.journal.load() {
            Ok(Some(stored)) => stored,
            Ok(None) => {
                return Err(self.violation(breach(
                    GuaranteeId::CrashSafety,
                    format!(
                        "the controller crashed, and the {} journal holds nothing to recover from (does the driver under test journal its changes?)",
                        self.journal.name()
                    ),
                )));
            }
            Err(error) => {
                return Err(self.violation(breach(
                    GuaranteeId::CrashSafety,
                    format!(
                        "the {} journal cannot be read after a crash: {error}",
                        self.journal.name()
                    ),
                )));
            }
        };
        let pending: Vec<(LogicalNodeId, PendingOperation)> = stored
            .nodes
            .iter()
            .filter_map(|e| e.node.pending.clone().map(|p| (e.node.node.clone(), p)))
            .collect();
        let stored_nodes = stored.nodes.len();
        let stored_generation = stored.meta.desired.generation;
        let stored_breakers = stored.meta.breakers.clone();
        let stored_templates: BTreeMap<LogicalNodeId, Arc<NodeTemplate>> = stored
            .nodes
            .iter()
            .map(|e| (e.node.node.clone(), e.template.clone()))
            .collect();
        // Sessions that streamed to the dead controller and had not handed
        // off: recovery must start them again (and say how many it did).
        let streaming: Vec<LogicalNodeId> = stored
            .nodes
            .iter()
            .filter(|e| {
                let record = &e.node.record;
                record.failure.is_none()
                    && record
                        .bootstrap
                        .as_ref()
                        .is_some_and(|b| b.state == provisioning::state::SessionState::Active)
                    && !matches!(
                        record.stage,
                        provisioning::NodeStage::HandedOff
                            | provisioning::NodeStage::Dormant
                            | provisioning::NodeStage::Destroyed
                    )
            })
            .map(|e| e.node.node.clone())
            .collect();
        // The journal holds what was committed: the kit's replica of it
        // starts again from what it gave back.
        self.durable.replica = Some(InMemoryJournal::holding(&stored));
        let (driver, report) = match (self.recovery)(&self.setup, stored, self.now) {
            Ok(recovered) => recovered,
            Err(RecoveryError::Clock(_)) => {
                // G13's edge: a clock at its end cannot take the recovered
                // deadlines. The error is the right answer; this controller
                // then simply does not crash.
                self.edges_reached = true;
                return Ok(());
            }
            Err(error) => {
                return Err(self.violation(breach(
                    GuaranteeId::CrashSafety,
                    format!("recovery from the committed state failed: {error}"),
                )));
            }
        };
        // The controller dies: its executor (queued work, undelivered
        // results) and every undelivered observation are lost; calls already
        // in the backend go on there.
        self.durable.crashes += 1;
        self.vacuity.crashes += 1;
        self.durable.late_dropped_before += self.executor.counters().late_dropped;
        self.close_dead_executor()?;
        {
            let mut control = self.durable.control.lock();
            control.live_epoch += 1;
            control.live_calls = 0;
            control.live_panics = 0;
            control.panicked.clear();
        }
        // The provider's sessions streamed to the dead controller: they go
        // quiet until the new one re-attaches them.
        self.substrate.controller_restarted();
        let _lost = self.substrate.take_observations();
        // What was delivered went to the dead controller: no late or
        // duplicated delivery of it can reach the new one (its executor and
        // its provider streams are new), so `redeliver` starts afresh.
        self.history.clear();
        // The new executor knows nothing of the old one's operations.
        self.executor_watch.recent.clear();
        self.executor_watch.expired.clear();
        self.executor_watch.accepted_here.clear();
        self.executor_watch.published_here.clear();
        self.executor_watch.queued_here = 0;
        self.executor_watch.replayed_here = 0;
        self.executor_watch.taken_here = 0;
        self.executor_watch.awaiting_call.clear();
        self.executor_watch.waiting_behind.clear();
        self.executor_watch.skipped_at_submission = 0;
        self.executor_watch.skipped_at_expiry = 0;
        self.executor_watch.uncalled.clear();
        self.executor_watch.notified = Arc::new(AtomicU64::new(0));
        // An acknowledgement folded after the last commit died with the
        // controller: the recovered one may report that convergence again.
        let recovered = driver.state();
        self.executor_watch.convergence_reported.retain(|attempt| {
            recovered.nodes.values().any(|n| {
                n.attempt == *attempt
                    && n.record
                        .bootstrap
                        .as_ref()
                        .is_some_and(|b| b.convergence_observed)
            })
        });
        self.executor = Harness::controller_executor(
            &self.substrate,
            &self.durable.control,
            &self.executor_watch.notified,
        );
        self.driver = driver;
        // The limits are configuration: the new controller is given them too.
        self.driver.set_limits(self.limits.clone());
        let depth = if self.history_off {
            0
        } else {
            super::HISTORY_DEPTH
        };
        self.history_watch = super::HistoryWatch::start(self.driver.as_mut(), depth);
        let groups = self
            .driver
            .desired()
            .groups()
            .keys()
            .cloned()
            .collect::<Vec<_>>();
        let driver = &self.driver;
        let verdict = self.breaker_watch.recovered(
            &stored_breakers,
            &|group| driver.breaker_status(group),
            groups,
        );
        self.check(verdict)?;
        // G26 (template form): every recovered node runs the template its
        // attempt was journaled with (a node of an older template is
        // drifted, not up to date).
        let wrong = self.driver.state().nodes.iter().find(|(id, node)| {
            stored_templates
                .get(*id)
                .is_some_and(|t| **t != *node.spec.template())
        });
        if let Some((id, node)) = wrong {
            return Err(self.violation(breach(
                GuaranteeId::CrashSafety,
                format!(
                    "{id} was recovered with template {:?}, but its attempt was journaled with {:?}",
                    node.spec.template(),
                    stored_templates.get(id)
                ),
            )));
        }
        self.driver_counts = super::DriverCounts::default();
        self.full_expected = None;
        // Folds after the last commit die with the controller, and recovery
        // folds every journaled pending operation as ambiguous: the kit's
        // failure counts restart from the recovered ones (an approximation —
        // a recovery that resets counts is not caught here).
        self.failures = self
            .driver
            .state()
            .nodes
            .iter()
            .map(|(id, node)| (id.clone(), node.retry.consecutive_failures))
            .collect();
        self.check(oracle::g26_recovery_made_pending_ambiguous(
            self.driver.state(),
            &pending,
        ))?;
        let restarted = streaming
            .iter()
            .filter(|id| {
                self.driver
                    .state()
                    .nodes
                    .get(*id)
                    .is_some_and(|n| n.record.failure.is_none())
            })
            .count();
        self.check(oracle::g26_recovery_reports_what_it_recovered(
            &report,
            stored_nodes,
            pending.len(),
            restarted,
            stored_generation,
        ))?;
        self.durable.recovered_ambiguous = pending
            .iter()
            .filter(|(_, p)| matches!(p.kind, EffectKind::CreateLease | EffectKind::StartBootstrap))
            .map(|(_, p)| (p.id.attempt(), p.kind))
            .collect();
        if self.options.narrate {
            self.narration.push(format!(
                "   crash #{}: recovered {} node(s), {} pending made ambiguous",
                self.durable.crashes,
                self.driver.state().nodes.len(),
                pending.len()
            ));
        }
        // The real `up` applies the shape file again: a newer shape than the
        // journal's is submitted again.
        if self.driver.desired().generation().get() < self.generation {
            let shape = self.model.shape(self.generation);
            let _ = self.driver.update_desired(shape);
        }
        self.reconcile_listing()?;
        self.scan_orphans()
    }

    /// G26 (close form): the dead controller's executor is closed before it
    /// goes, as a host shutting a controller down closes it; closed, it
    /// must refuse a submission (here its latest operation again), so that
    /// nothing a late caller hands it can reach the backend.
    fn close_dead_executor(&mut self) -> Result<(), Violation> {
        self.executor.close();
        let Some(operation) = self.executor_watch.recent.back().cloned() else {
            return Ok(());
        };
        let answer = self.executor.submit(operation.clone());
        self.check(if matches!(answer, Err(SubmitError::Closed)) {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::CrashSafety,
                format!(
                    "the crashed controller's executor was closed, but it answered {answer:?} to {} {} submitted again (expected a refusal: closed)",
                    operation.kind(),
                    operation.id
                ),
            ))
        })
    }

    /// After recovery: a journaled lease of a node's current attempt that is
    /// no longer live means the node is lost.
    fn reconcile_listing(&mut self) -> Result<(), Violation> {
        let live = self.substrate.live_resources();
        let lost: Vec<(LogicalNodeId, NodeAttemptId)> = self
            .driver
            .state()
            .nodes
            .iter()
            .filter(|(id, node)| {
                let leased = node
                    .record
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.attempt == node.attempt);
                leased
                    && node.record.stage != provisioning::NodeStage::Destroyed
                    && live
                        .leases
                        .get(&((*id).clone(), node.attempt))
                        .is_none_or(|n| *n == 0)
            })
            .map(|(id, node)| (id.clone(), node.attempt))
            .collect();
        for (node, attempt) in lost {
            self.deliver_observation(Observation::NodeLost {
                node,
                attempt,
                cause: LossCause::LeaseGone,
            })?;
        }
        Ok(())
    }

    /// The live keys no node's current attempt owns.
    fn unowned(&self, live: &LiveResources) -> BTreeSet<ResourceKey> {
        let state = self.driver.state();
        live.leases
            .iter()
            .chain(live.sessions.iter())
            .filter(|(key, count)| **count > 0 && !oracle::owned(state, key))
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Lists the live resources: unowned ones become suspects (or stay
    /// suspects), owned or vanished ones stop being suspects; then collects.
    fn scan_orphans(&mut self) -> Result<(), Violation> {
        if !self.crash_capable() {
            return Ok(());
        }
        let unowned = self.unowned(&self.substrate.live_resources());
        let now = self.now;
        self.durable.suspects.retain(|key, _| unowned.contains(key));
        for key in unowned {
            self.durable.suspects.entry(key).or_insert(now);
        }
        self.collect_orphans()
    }

    /// Destroys every suspect seen unowned for `orphan_grace`, checking
    /// again first that no current attempt owns it.
    fn collect_orphans(&mut self) -> Result<(), Violation> {
        if !self.options.host.collect_orphans {
            return Ok(());
        }
        let grace = self.options.host.orphan_grace;
        let due: Vec<ResourceKey> = self
            .durable
            .suspects
            .iter()
            .filter(|(_, since)| oracle::at_or_after(self.now, since.saturating_add(grace)))
            .map(|(key, _)| key.clone())
            .collect();
        for key in due {
            self.durable.suspects.remove(&key);
            let unowned = self.unowned(&self.substrate.live_resources());
            if !unowned.contains(&key) {
                continue;
            }
            self.check(oracle::g28_never_an_owned_resource(
                self.driver.state(),
                &key,
            ))?;
            if self.substrate.destroy_orphan(&key) {
                self.vacuity.orphans_collected += 1;
            }
        }
        self.check_calls()
    }

    /// At a host wake: a periodic scan when one is due, and the collection
    /// of suspects whose grace ran out.
    pub(super) fn orphan_wake(&mut self) -> Result<(), Violation> {
        if !self.crash_capable() {
            return Ok(());
        }
        if oracle::at_or_after(self.now, self.durable.next_scan_at) {
            let interval = self
                .options
                .host
                .orphan_scan_interval
                .max(Duration::from_millis(1));
            self.durable.next_scan_at = self.now.saturating_add(interval);
            return self.scan_orphans();
        }
        if self.durable.suspects.is_empty() {
            return Ok(());
        }
        self.collect_orphans()
    }

    /// When the host next does something about orphans, if anything is
    /// (or may be) unowned.
    pub(super) fn next_orphan_event(&self) -> Option<Timestamp> {
        if self.durable.observed_orphans.is_empty() && self.durable.suspects.is_empty() {
            return None;
        }
        let grace = self.options.host.orphan_grace;
        let collect = self
            .durable
            .suspects
            .values()
            .map(|since| since.saturating_add(grace))
            .min();
        Some(collect.map_or(self.durable.next_scan_at, |c| {
            c.min(self.durable.next_scan_at)
        }))
    }

    /// The oracle's orphan sample after an input or tail round: what is
    /// unowned now, since when it was seen so, and G28's bound once faults
    /// stopped.
    pub(super) fn check_orphans(&mut self, live: &LiveResources) -> Result<(), Violation> {
        if !self.crash_capable() {
            return Ok(());
        }
        let unowned = self.unowned(live);
        let now = self.now;
        {
            // An orphan needs a cause: a call of a dead controller that made
            // it after the crash. Any other unowned resource is a provider's
            // leak (a destroy that did not take, a definite failure that
            // left something) — G23's, even before convergence.
            // A dead controller's call still in flight may have made it
            // already (a real provider's create spawns before it returns):
            // judged once the call returns.
            let control = self.durable.control.lock();
            let zombie_in_flight = |attempt: &NodeAttemptId| {
                control.in_flight.get(attempt).is_some_and(|calls| {
                    calls.iter().any(|(epoch, _)| *epoch != control.live_epoch)
                })
            };
            let leak = unowned
                .iter()
                .find(|key| !control.zombie_created.contains(*key) && !zombie_in_flight(&key.1))
                .cloned();
            drop(control);
            if let Some((node, attempt)) = leak {
                return Err(self.violation(breach(
                    GuaranteeId::ConvergedLeaksNothing,
                    format!(
                        "{node}/{attempt} is live, but no node's current attempt owns it and no call of a crashed controller made it: leaked (live: {live})"
                    ),
                )));
            }
        }
        let observed = &mut self.durable.observed_orphans;
        observed.retain(|key, _| unowned.contains(key));
        for key in unowned {
            observed.entry(key).or_insert(now);
        }
        let Some(stopped) = self.durable.faults_stopped_at else {
            return Ok(());
        };
        let bound = self
            .options
            .host
            .orphan_grace
            .saturating_add(self.options.host.orphan_scan_interval);
        self.check(oracle::g28_orphans_collected_in_time(
            &self.durable.observed_orphans,
            stopped,
            bound,
            now,
        ))
    }

    /// Whether a live resource left by a dead controller's call explains a
    /// G08 sample or alarm about `node` (an orphan, G28's business).
    pub(super) fn zombie_slots(&self) -> BTreeSet<LogicalNodeId> {
        let state = self.driver.state();
        self.durable
            .control
            .lock()
            .zombie_created
            .iter()
            .filter(|key| !oracle::owned(state, key))
            .map(|(node, _)| node.clone())
            .collect()
    }

    /// The calls that passed the wrapper since the last look, and the
    /// zombie count per operation for G05.
    pub(super) fn take_call_starts(&mut self) -> (Vec<CallStart>, BTreeMap<OperationId, u32>) {
        let starts = std::mem::take(&mut self.durable.control.lock().starts);
        let zombies = starts.iter().map(|s| (s.op, s.zombies)).collect();
        (starts, zombies)
    }

    /// G27 for calls that passed the wrapper.
    pub(super) fn check_committed(&self, starts: &[CallStart]) -> Result<(), Violation> {
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
