//! The executor: runs provider effects off the pass, deduplicated by
//! [`OperationId`].
//!
//! # Ledger rules
//! - Submitting an operation that already completed replays its result:
//!   the attempt's latest completed operation, and its latest expired one
//!   (whose result is its timeout), even after newer operations completed.
//!   Any other id below the attempt's latest submission is refused as
//!   [`SubmitError::Stale`]. The rule follows from who repeats an id: a
//!   caller moves on to a new sequence only after it received the old
//!   result — except when the old operation expired, where what it got was
//!   the executor's timeout; so an expired operation is the one older id a
//!   caller may still ask about, and it is kept at a fixed, small cost.
//! - Submitting an id again with a different input is refused.
//! - At most one operation runs per attempt. An operation submitted while an
//!   older one of its attempt is still physically running (typically one that
//!   expired) waits behind it; the older one's late result is dropped.
//! - A backend panic becomes a definite error.
//! - [`IdempotentEffectExecutor::expire`] turns a running or waiting operation
//!   into an ambiguous timeout; its late completion is dropped, never reported.
//!
//! # Ownership
//! The executor is the only strong owner of the backend. A spawned task holds
//! a weak handle until it starts, the shared ledger holds no task, spawner or
//! backend, and no task holds the spawner — so dropping the executor releases
//! the backend even while work is still queued in the spawner.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use futures_channel::oneshot;
use futures_util::FutureExt;

use crate::driver::{ClusterDriver, DriveReport, DriverError, OperationSink, SubmitError};
use crate::effect::{EffectError, EffectKind, EffectOutput, ExecutorResult, Operation};
use crate::id::{LogicalNodeId, NodeAttemptId, OperationId, OperationSequence};
use crate::shape::NodeTemplate;
use crate::spawn::{BoxFuture, Spawner};

/// Where provider I/O happens.
///
/// # Assumptions
/// - Requests are keyed by `(run, node, attempt)`. A create or bootstrap start
///   adopts an existing resource of its key before creating one, so running
///   it twice is harmless.
/// - Cancel and destroy treat "already absent" as success.
/// - A [`crate::effect::Disposition::Definite`] error means the call left
///   nothing behind for its key; when in doubt, report an ambiguous error.
pub trait EffectBackend: Send + Sync + 'static {
    /// Performs one effect.
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>>;
}

/// How [`IdempotentEffectExecutor::submit`] handled an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// Handed to the spawner; it runs now.
    Started,
    /// Handed to the spawner; it runs once the attempt's older operation ends.
    Queued,
    /// The same operation is already running or waiting.
    AlreadyRunning,
    /// The operation completed before; its result was queued again.
    Replayed,
}

/// Counters for tests and operators.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecutorCounters {
    /// Operations whose backend call started.
    pub started: u64,
    /// Operations that expired before their backend call started; they never
    /// reach the backend.
    pub skipped: u64,
    /// Results reported.
    pub completed: u64,
    /// Completed results replayed for a repeated submission.
    pub replayed: u64,
    /// Operations expired as ambiguous.
    pub expired: u64,
    /// Late completions dropped after expiry or supersession.
    pub late_dropped: u64,
    /// Backend panics turned into definite errors.
    pub panics: u64,
    /// Operations that waited behind an older one of their attempt.
    pub waited: u64,
}

/// One attempt's entry in the executor's ledger, as
/// [`IdempotentEffectExecutor::ledger`] shows it (for model checkers: two
/// executors with equal entries and equal untaken results answer every
/// submission alike).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerEntry {
    /// The attempt.
    pub attempt: NodeAttemptId,
    /// The attempt's latest submitted sequence (older ids are stale).
    pub highest: Option<OperationSequence>,
    /// The running operation, and whether its late result will be dropped.
    pub running: Option<(OperationId, bool)>,
    /// The operation waiting behind the running one.
    pub waiting: Option<OperationId>,
    /// The latest completed operation and the result a resubmission replays.
    pub completed: Option<(OperationId, Result<EffectOutput, EffectError>)>,
    /// The latest expired operation.
    pub expired: Option<OperationId>,
    /// Retired while an operation still ran.
    pub retired: bool,
}

/// What identifies an operation's input, kept instead of a copy of it: a
/// hash of everything but the template, and the shared template itself
/// (compared by pointer first, by content when the pointers differ).
#[derive(Clone)]
struct InputPrint {
    id: OperationId,
    kind: EffectKind,
    hash: u64,
    template: Arc<NodeTemplate>,
}

impl InputPrint {
    fn of(op: &Operation) -> Self {
        let mut hasher = DefaultHasher::new();
        (&op.id, &op.run_id, &op.node, op.spec.id(), &op.request).hash(&mut hasher);
        InputPrint {
            id: op.id,
            kind: op.kind(),
            hash: hasher.finish(),
            template: op.spec.shared_template().clone(),
        }
    }

    /// `None` when `other` has another id; otherwise whether its input matches.
    fn same_input(&self, other: &InputPrint) -> Option<bool> {
        (self.id == other.id).then(|| self.same_content(other.hash, &other.template))
    }

    fn same_content(&self, hash: u64, template: &Arc<NodeTemplate>) -> bool {
        self.hash == hash && (Arc::ptr_eq(&self.template, template) || self.template == *template)
    }
}

struct Running {
    print: InputPrint,
    /// Set once the operation expired or was superseded: its late result is
    /// dropped.
    expired: bool,
    /// Gates of operations waiting behind this one.
    gates: Vec<oneshot::Sender<()>>,
}

/// An outcome kept for replay, without its payload where it has none —
/// as the last outcome of every converged node has none.
#[derive(Clone, Copy)]
enum Kept {
    ConvergenceAcknowledged,
    BootstrapCancelled,
    LeaseDestroyed,
    TimedOut,
    /// The outcome is in [`Completed::payload`].
    Other,
}

/// The latest completed operation of an attempt, kept flat (the attempt is
/// the ledger's key, so only the sequence is kept of its id): one is kept
/// for every attempt the executor has seen, so its size counts per node.
struct Completed {
    sequence: OperationSequence,
    kind: EffectKind,
    kept: Kept,
    hash: u64,
    template: Arc<NodeTemplate>,
    /// `Some` exactly when `kept` is [`Kept::Other`].
    payload: Option<Box<Result<EffectOutput, EffectError>>>,
}

impl Completed {
    fn new(print: InputPrint, outcome: Result<EffectOutput, EffectError>) -> Self {
        let (kept, payload) = match outcome {
            Ok(EffectOutput::ConvergenceAcknowledged) => (Kept::ConvergenceAcknowledged, None),
            Ok(EffectOutput::BootstrapCancelled) => (Kept::BootstrapCancelled, None),
            Ok(EffectOutput::LeaseDestroyed) => (Kept::LeaseDestroyed, None),
            other => (Kept::Other, Some(Box::new(other))),
        };
        Completed::with(print, kept, payload)
    }

    fn timed_out(print: InputPrint) -> Self {
        Completed::with(print, Kept::TimedOut, None)
    }

    fn with(
        print: InputPrint,
        kept: Kept,
        payload: Option<Box<Result<EffectOutput, EffectError>>>,
    ) -> Self {
        Completed {
            sequence: print.id.sequence(),
            kind: print.kind,
            kept,
            hash: print.hash,
            template: print.template,
            payload,
        }
    }

    /// The id of the operation, given its attempt (the ledger's key).
    fn id(&self, attempt: NodeAttemptId) -> OperationId {
        OperationId::new(attempt, self.sequence)
    }

    /// `None` when `print` has another id; otherwise whether its input
    /// matches.
    fn same_input(&self, print: &InputPrint) -> Option<bool> {
        (self.sequence == print.id.sequence())
            .then(|| print.same_content(self.hash, &self.template))
    }

    fn outcome(&self) -> Result<EffectOutput, EffectError> {
        match self.kept {
            Kept::ConvergenceAcknowledged => Ok(EffectOutput::ConvergenceAcknowledged),
            Kept::BootstrapCancelled => Ok(EffectOutput::BootstrapCancelled),
            Kept::LeaseDestroyed => Ok(EffectOutput::LeaseDestroyed),
            Kept::TimedOut => Err(EffectError::timed_out()),
            Kept::Other => match &self.payload {
                Some(outcome) => (**outcome).clone(),
                // Not reached: `Completed::new` keeps the payload of `Other`.
                None => Err(EffectError::ambiguous("the kept outcome was lost")),
            },
        }
    }
}

/// What an attempt has in flight: the node it is for (results name it),
/// and its running and waiting operations.
struct InFlight {
    node: LogicalNodeId,
    running: Option<Running>,
    waiting: Option<InputPrint>,
}

impl InFlight {
    fn result(
        &self,
        print: &InputPrint,
        outcome: Result<EffectOutput, EffectError>,
    ) -> ExecutorResult {
        ExecutorResult {
            op: print.id,
            node: self.node.clone(),
            kind: print.kind,
            outcome,
        }
    }
}

/// The ledger of one attempt. Most attempts are idle most of the time (a
/// converged node's attempt is idle for good), so what only an attempt with
/// work in flight needs is boxed apart: an idle attempt keeps its latest
/// completed operation and little else.
struct AttemptLedger {
    highest: Option<OperationSequence>,
    /// `Some` while an operation runs or waits; dropped when none does.
    in_flight: Option<Box<InFlight>>,
    /// The latest completed operation (an expired one counts, with its
    /// timeout as result).
    completed: Option<Completed>,
    /// The latest operation that expired; its result is always the timeout.
    expired: Option<Box<InputPrint>>,
    retired: bool,
}

impl AttemptLedger {
    fn new() -> Self {
        AttemptLedger {
            highest: None,
            in_flight: None,
            completed: None,
            expired: None,
            retired: false,
        }
    }

    fn idle(&self) -> bool {
        self.in_flight.is_none()
    }

    fn running(&self) -> Option<&Running> {
        self.in_flight.as_ref()?.running.as_ref()
    }

    fn waiting(&self) -> Option<&InputPrint> {
        self.in_flight.as_ref()?.waiting.as_ref()
    }

    /// Drops the in-flight part once nothing runs or waits.
    fn settle(&mut self) {
        if self
            .in_flight
            .as_ref()
            .is_some_and(|f| f.running.is_none() && f.waiting.is_none())
        {
            self.in_flight = None;
        }
    }
}

#[derive(Default)]
struct Ledger {
    /// Boxed: attempts arrive in increasing order, which leaves a B-tree's
    /// nodes half full; small boxed entries waste little of that space.
    attempts: BTreeMap<NodeAttemptId, Box<AttemptLedger>>,
    outbox: VecDeque<ExecutorResult>,
    counters: ExecutorCounters,
    closed: bool,
}

type Notify = Box<dyn Fn() + Send + Sync>;

struct Shared {
    ledger: Mutex<Ledger>,
    notify: Option<Notify>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn notify(&self) {
        if let Some(notify) = &self.notify {
            notify();
        }
    }
}

/// Runs effects through an [`EffectBackend`], deduplicated by operation id.
pub struct IdempotentEffectExecutor<B: EffectBackend + ?Sized> {
    backend: Arc<B>,
    spawner: Arc<dyn Spawner>,
    shared: Arc<Shared>,
}

impl<B: EffectBackend + ?Sized> fmt::Debug for IdempotentEffectExecutor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentEffectExecutor")
            .field("counters", &self.counters())
            .finish_non_exhaustive()
    }
}

impl<B: EffectBackend + ?Sized> IdempotentEffectExecutor<B> {
    /// An executor over `backend` that hands work to `spawner`.
    pub fn new(backend: Arc<B>, spawner: Arc<dyn Spawner>) -> Self {
        IdempotentEffectExecutor::build(backend, spawner, None)
    }

    /// Like [`IdempotentEffectExecutor::new`], and calls `notify` (from the
    /// task that finished) whenever a result is ready to be taken.
    pub fn with_notify(
        backend: Arc<B>,
        spawner: Arc<dyn Spawner>,
        notify: impl Fn() + Send + Sync + 'static,
    ) -> Self {
        IdempotentEffectExecutor::build(backend, spawner, Some(Box::new(notify)))
    }

    fn build(backend: Arc<B>, spawner: Arc<dyn Spawner>, notify: Option<Notify>) -> Self {
        IdempotentEffectExecutor {
            backend,
            spawner,
            shared: Arc::new(Shared {
                ledger: Mutex::new(Ledger::default()),
                notify,
            }),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Counters since the executor was made.
    pub fn counters(&self) -> ExecutorCounters {
        self.shared.lock().counters.clone()
    }

    /// Takes the results reported since the last call, in completion order.
    pub fn take_results(&self) -> Vec<ExecutorResult> {
        // Taken with its buffer: a drained queue would keep the capacity of
        // its largest batch (a whole bring-up's results) for good.
        Vec::from(std::mem::take(&mut self.shared.lock().outbox))
    }

    /// Whether any operation is running or waiting.
    pub fn has_work(&self) -> bool {
        self.shared.lock().attempts.values().any(|a| !a.idle())
    }

    /// Operations currently running or waiting, for status displays.
    pub fn in_flight(&self) -> Vec<OperationId> {
        let ledger = self.shared.lock();
        let mut ids = Vec::new();
        for attempt in ledger.attempts.values() {
            ids.extend(attempt.running().map(|r| r.print.id));
            ids.extend(attempt.waiting().map(|w| w.id));
        }
        ids
    }

    /// The ledger: every attempt's entry, in attempt order, and the results
    /// reported but not yet taken, oldest first.
    pub fn ledger(&self) -> (Vec<LedgerEntry>, Vec<ExecutorResult>) {
        let ledger = self.shared.lock();
        let entries = ledger
            .attempts
            .iter()
            .map(|(attempt, entry)| LedgerEntry {
                attempt: *attempt,
                highest: entry.highest,
                running: entry.running().map(|r| (r.print.id, r.expired)),
                waiting: entry.waiting().map(|w| w.id),
                completed: entry
                    .completed
                    .as_ref()
                    .map(|c| (c.id(*attempt), c.outcome())),
                expired: entry.expired.as_ref().map(|e| e.id),
                retired: entry.retired,
            })
            .collect();
        (entries, ledger.outbox.iter().cloned().collect())
    }

    /// Submits an operation.
    ///
    /// # Errors
    /// [`SubmitError::ConflictingInput`] when the id was used with another
    /// input; [`SubmitError::Stale`] when a later operation of the attempt was
    /// submitted already; [`SubmitError::Closed`] after [`Self::close`].
    pub fn submit(&self, op: Operation) -> Result<Submitted, SubmitError> {
        let mut ledger = self.shared.lock();
        if ledger.closed {
            return Err(SubmitError::Closed);
        }
        let Ledger {
            attempts,
            outbox,
            counters,
            ..
        } = &mut *ledger;
        let entry = attempts
            .entry(op.attempt())
            .or_insert_with(|| Box::new(AttemptLedger::new()));
        let print = InputPrint::of(&op);
        let verdict = |known: &InputPrint| {
            known.same_input(&print).map(|same| {
                if same {
                    Ok(())
                } else {
                    Err(SubmitError::ConflictingInput(op.id))
                }
            })
        };
        if let Some(verdict) = entry.running().and_then(|r| verdict(&r.print)) {
            return verdict.map(|()| Submitted::AlreadyRunning);
        }
        if let Some(verdict) = entry.waiting().and_then(verdict) {
            return verdict.map(|()| Submitted::AlreadyRunning);
        }
        let same = |same: bool| {
            if same {
                Ok(())
            } else {
                Err(SubmitError::ConflictingInput(op.id))
            }
        };
        let replay = entry
            .completed
            .as_ref()
            .and_then(|c| c.same_input(&print).map(|v| (c.kind, c.outcome(), same(v))))
            .or_else(|| {
                let expired = entry.expired.as_deref()?;
                verdict(expired).map(|v| (expired.kind, Err(EffectError::timed_out()), v))
            });
        if let Some((kind, outcome, verdict)) = replay {
            verdict?;
            // The same id with the same input names the same node.
            let replay = ExecutorResult {
                op: op.id,
                node: op.node.clone(),
                kind,
                outcome,
            };
            outbox.push_back(replay);
            counters.replayed += 1;
            drop(ledger);
            self.shared.notify();
            return Ok(Submitted::Replayed);
        }
        if entry.highest.is_some_and(|h| op.id.sequence() <= h) {
            return Err(SubmitError::Stale(op.id));
        }
        entry.highest = Some(op.id.sequence());
        entry.retired = false;

        let in_flight: &mut InFlight = entry.in_flight.get_or_insert_with(|| {
            Box::new(InFlight {
                node: op.node.clone(),
                running: None,
                waiting: None,
            })
        });
        let gate = match &mut in_flight.running {
            Some(older) => {
                // The driver moved on from the older operation: whatever it
                // reports now is late. This one waits until it really ends.
                older.expired = true;
                let (open, gate) = oneshot::channel();
                older.gates.push(open);
                if in_flight.waiting.replace(print).is_some() {
                    // The operation that waited before this one never
                    // reaches the backend now: its task finds it replaced.
                    counters.skipped += 1;
                }
                counters.waited += 1;
                Some(gate)
            }
            None => {
                // An older operation still recorded as waiting (its gate open,
                // its task not yet run) timed out straight at the driver, which
                // then moved on: it must never reach the backend after this one.
                if in_flight.waiting.take().is_some() {
                    counters.skipped += 1;
                }
                in_flight.running = Some(Running {
                    print,
                    expired: false,
                    gates: Vec::new(),
                });
                None
            }
        };
        drop(ledger);
        let queued = gate.is_some();
        let task = run_operation(
            Arc::downgrade(&self.backend),
            Arc::downgrade(&self.shared),
            op,
            gate,
        );
        self.spawner.spawn(Box::pin(task));
        Ok(if queued {
            Submitted::Queued
        } else {
            Submitted::Started
        })
    }

    /// Expires a running or waiting operation: returns its ambiguous timeout
    /// result for the caller to fold, and drops its late completion. Returns
    /// `None` when the operation is not in flight (already completed or
    /// unknown), so expiring twice reports once.
    pub fn expire(&self, op: OperationId) -> Option<ExecutorResult> {
        let mut ledger = self.shared.lock();
        let Ledger {
            attempts, counters, ..
        } = &mut *ledger;
        let entry = attempts.get_mut(&op.attempt())?;
        let in_flight = entry.in_flight.as_deref_mut()?;
        let expired = if let Some(running) = in_flight.running.as_mut().filter(|r| r.print.id == op)
        {
            if running.expired {
                return None;
            }
            running.expired = true;
            running.print.clone()
        } else if in_flight.waiting.as_ref().is_some_and(|w| w.id == op) {
            // It waited behind an older operation: it never reaches the
            // backend now.
            counters.skipped += 1;
            in_flight.waiting.take()?
        } else {
            return None;
        };
        let result = in_flight.result(&expired, Err(EffectError::timed_out()));
        entry.settle();
        entry.expired = Some(Box::new(expired.clone()));
        entry.completed = Some(Completed::timed_out(expired));
        counters.expired += 1;
        Some(result)
    }

    /// Releases the bookkeeping of an attempt that finished cleanup. An
    /// operation still physically running keeps it until it ends.
    pub fn retire(&self, attempt: NodeAttemptId) {
        let mut ledger = self.shared.lock();
        if let Some(entry) = ledger.attempts.get_mut(&attempt) {
            if entry.idle() {
                ledger.attempts.remove(&attempt);
            } else {
                entry.retired = true;
            }
        }
    }

    /// Runs `driver` until it is blocked with this executor as its sink:
    /// shorthand for `driver.drive_until_blocked(now, &mut &executor)`.
    ///
    /// # Errors
    /// The errors of [`ClusterDriver::drive_until_blocked`].
    pub fn drive(
        &self,
        driver: &mut ClusterDriver,
        now: crate::time::Timestamp,
    ) -> Result<DriveReport, DriverError> {
        let mut sink = self;
        driver.drive_until_blocked(now, &mut sink)
    }

    /// Refuses further submissions. Work already handed out still finishes.
    pub fn close(&self) {
        self.shared.lock().closed = true;
    }
}

impl<B: EffectBackend + ?Sized> Drop for IdempotentEffectExecutor<B> {
    fn drop(&mut self) {
        self.close();
    }
}

impl<B: EffectBackend + ?Sized> OperationSink for IdempotentEffectExecutor<B> {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        IdempotentEffectExecutor::submit(self, operation).map(|_| ())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.retire(attempt);
    }
}

impl<B: EffectBackend + ?Sized> OperationSink for &IdempotentEffectExecutor<B> {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        IdempotentEffectExecutor::submit(self, operation).map(|_| ())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.retire(attempt);
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-text panic payload".to_owned()
    }
}

/// The task for one operation. It holds only weak handles, so a queued task
/// keeps neither the backend nor the ledger alive.
#[expect(
    clippy::manual_async_fn,
    reason = "an async fn keeps its arguments twice in its future (352 bytes against 160 per queued task)"
)]
fn run_operation<B: EffectBackend + ?Sized>(
    backend: Weak<B>,
    shared: Weak<Shared>,
    op: Operation,
    gate: Option<oneshot::Receiver<()>>,
) -> impl Future<Output = ()> {
    // An `async` block rather than an `async fn`: its captures are kept once,
    // where an `async fn` would keep its arguments twice (before and after
    // its first resumption), and every queued task pays for its future.
    async move {
        if let Some(gate) = gate {
            // A dropped sender also opens the gate: the older task is gone.
            let _ = gate.await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let mut ledger = shared.lock();
            let Some(entry) = ledger.attempts.get_mut(&op.attempt()) else {
                return;
            };
            if entry.waiting().is_none_or(|w| w.id != op.id) || entry.running().is_some() {
                // Expired or superseded while waiting.
                return;
            }
            let Some(in_flight) = entry.in_flight.as_deref_mut() else {
                return;
            };
            let print = in_flight.waiting.take();
            in_flight.running = print.map(|print| Running {
                print,
                expired: false,
                gates: Vec::new(),
            });
        }

        if !begin_call(&shared, op.id) {
            // The driver already gave up on it: running it now would be an effect
            // nobody has pending. Ending it here also opens its waiters' gates.
            finish(&shared, &op, Err(EffectError::timed_out()));
            return;
        }
        // The call's own state (the backend's future, the unwind guard) is
        // allocated when the call starts and freed when it ends: a queued task
        // holds little more than its operation, so a large batch of queued work
        // touches little memory.
        let outcome = Box::pin(call_backend(&backend, &shared, &op)).await;
        finish(&shared, &op, outcome);
    }
}

/// One backend call, a panic turned into a definite error.
async fn call_backend<B: EffectBackend + ?Sized>(
    backend: &Weak<B>,
    shared: &Weak<Shared>,
    op: &Operation,
) -> Result<EffectOutput, EffectError> {
    match backend.upgrade() {
        Some(backend) => {
            let call = AssertUnwindSafe(async { backend.execute(op).await })
                .catch_unwind()
                .await;
            drop(backend);
            call.map_err(|payload| {
                if let Some(shared) = shared.upgrade() {
                    shared.lock().counters.panics += 1;
                }
                EffectError::definite(format!("backend panicked: {}", panic_message(&*payload)))
            })
            .and_then(|outcome| outcome)
        }
        None => Err(EffectError::definite("the executor was dropped")),
    }
}

/// Decides, under one lock, whether the call may start: not when the
/// operation expired before it got here. Counts the call either way.
fn begin_call(shared: &Weak<Shared>, op: OperationId) -> bool {
    let Some(shared) = shared.upgrade() else {
        return true;
    };
    let mut ledger = shared.lock();
    let expired = ledger
        .attempts
        .get(&op.attempt())
        .and_then(|entry| entry.running())
        .is_some_and(|running| running.print.id == op && running.expired);
    if expired {
        ledger.counters.skipped += 1;
    } else {
        ledger.counters.started += 1;
    }
    !expired
}

fn finish(shared: &Weak<Shared>, op: &Operation, outcome: Result<EffectOutput, EffectError>) {
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let mut ledger = shared.lock();
    let Ledger {
        attempts,
        outbox,
        counters,
        ..
    } = &mut *ledger;
    let Some(entry) = attempts.get_mut(&op.attempt()) else {
        return;
    };
    let Some(in_flight) = entry.in_flight.as_deref_mut() else {
        return;
    };
    let Some(running) = in_flight.running.take_if(|r| r.print.id == op.id) else {
        return;
    };
    let mut reported = false;
    if running.expired {
        // The driver already folded a timeout (or moved on): drop the result.
        counters.late_dropped += 1;
    } else {
        let (id, kind) = (running.print.id, running.print.kind);
        let completed = Completed::new(running.print, outcome);
        outbox.push_back(ExecutorResult {
            op: id,
            node: in_flight.node.clone(),
            kind,
            outcome: completed.outcome(),
        });
        entry.completed = Some(completed);
        counters.completed += 1;
        reported = true;
    }
    for gate in running.gates {
        let _ = gate.send(());
    }
    entry.settle();
    if entry.retired && entry.idle() {
        attempts.remove(&op.attempt());
    }
    drop(ledger);
    if reported {
        shared.notify();
    }
}
