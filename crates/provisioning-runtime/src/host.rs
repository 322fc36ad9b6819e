//! The host: a tokio task that owns the driver, the executor and the plugins.
//!
//! [`Host::start`] builds the pieces and spawns the host loop. The loop is
//! the only code that touches the [`ClusterDriver`]; everyone else talks to
//! it through a [`HostHandle`] (commands over a bounded channel, progress
//! over a watch channel).
//!
//! # The loop
//! The loop sleeps until one of these happens: the executor reports a
//! result (its notify callback pings a [`Notify`]), a plugin reports an
//! observation, a command arrives, the timer armed at
//! [`ClusterDriver::requeue_at`] fires, the periodic safety tick fires (it
//! forces a full pass), or shutdown is requested. After every wake it folds
//! executor results, folds observations, expires operations whose stored
//! deadline passed, drives the driver until it is blocked, publishes a
//! snapshot when one is due and re-arms the timer.
//!
//! # Publishing
//! A snapshot lists every node. The loop keeps a progress view
//! ([`crate::status`]) with every node's status, brought up to date only for
//! the nodes the driver's change tracker names (one status built per changed
//! node and snapshot; the whole view after a new desired generation), and a
//! snapshot shares the view's node statuses, so assembling one copies a
//! pointer per node. The loop publishes only when something changed since
//! the last (the change tracker says so, or the phase or the orphan
//! bookkeeping moved), and at most once per [`publish_interval`]: ten times
//! what assembling the last one cost, capped at [`PUBLISH_INTERVAL_MAX`]. A
//! small cluster publishes after every wake; a large one spends at most about
//! a tenth of its time assembling snapshots, and a change held back is
//! published when the interval ends (the loop arms a timer for it), so a
//! subscriber is never more than [`PUBLISH_INTERVAL_MAX`] behind. Status
//! queries always build a fresh, whole one (with the nodes' histories).
//!
//! # Shutdown
//! A graceful shutdown applies an empty shape at the next generation and
//! keeps reconciling until no node is left, bounded by
//! [`HostConfig::shutdown_deadline`]. Past the deadline, or when forced, the
//! host stops the executor's tasks and calls each plugin's shutdown hook,
//! which must release everything the plugin still holds.

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use provisioning::spawn::{BoxFuture, Spawner};
use provisioning::{
    ClusterDriver, ClusterShape, DesiredUpdate, DriverError, EffectError, ExecutorResult,
    Generation, IdempotentEffectExecutor, LossCause, NodeAttemptId, NodeGroup, Observation,
    Operation, OperationSink, RetryPolicy, RunId, ShapeError, SubmitError, Timestamp,
};
use provisioning_journal::Journal;
use provisioning_journal::codec::StateCodec;
use provisioning_provider::{AdapterError, ObservationSink, PluginBackendAdapter, ProvisionPlugin};
use thiserror::Error;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use crate::durable::{Durability, DurabilityError, OrphanReport, Orphans, list_all, owned};
use crate::plan::{PlanReport, plan_against};
use crate::spawner::TokioSpawner;
use crate::status::{DurabilityStatus, HostPhase, Progress, StatusSnapshot};

/// The default period of the safety tick that forces a full pass. Progress
/// never depends on it; it only bounds how long a lost wake-up can stall.
pub const DEFAULT_SAFETY_TICK: Duration = Duration::from_secs(5);

/// The default bound on a graceful shutdown before it is forced.
pub const DEFAULT_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(30);

/// How many commands may wait for the host loop.
pub const COMMAND_QUEUE_CAPACITY: usize = 64;

/// The longest a change waits before it is published to subscribers.
pub const PUBLISH_INTERVAL_MAX: Duration = Duration::from_secs(1);

/// How many times the cost of the last snapshot build the loop waits before
/// it builds the next one (so publishing takes at most about 1/this of the
/// loop's time).
const PUBLISH_COST_FACTOR: u32 = 10;

/// The wait between two published snapshots, after one that cost `cost` to
/// build: [`PUBLISH_COST_FACTOR`] times it, at most [`PUBLISH_INTERVAL_MAX`].
pub fn publish_interval(cost: Duration) -> Duration {
    cost.saturating_mul(PUBLISH_COST_FACTOR)
        .min(PUBLISH_INTERVAL_MAX)
}

/// How many plugin observations may wait for the host loop. Past this, an
/// observation is dropped with a warning and counted; the bound is far above
/// what a healthy loop lets pile up.
pub const OBSERVATION_QUEUE_CAPACITY: usize = 1 << 16;

/// The most observations folded in one wake; the rest wait for the next one,
/// which follows at once.
pub const MAX_OBSERVATIONS_PER_WAKE: usize = 4096;

/// How long shutdown waits for the executor's aborted tasks to end.
pub const TASK_SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// How long shutdown waits for one plugin's shutdown hook.
pub const PLUGIN_SHUTDOWN_WAIT: Duration = Duration::from_secs(15);

/// How long the loop waits before looking again at a stored deadline that
/// stayed in the past after a full wake (a fact the driver refused to fold).
/// Keeps such a deadline from turning the loop into a spin.
pub const STALE_DEADLINE_RETRY: Duration = Duration::from_millis(250);

/// How the host runs.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The run the host manages; fixed for its lifetime.
    pub run_id: RunId,
    /// Backoff, timeouts and probe interval of the driver.
    pub policy: RetryPolicy,
    /// The period of the safety tick.
    pub safety_tick: Duration,
    /// The bound on a graceful shutdown.
    pub shutdown_deadline: Duration,
    /// Launch caps, rollout budgets and breakers (none by default).
    pub limits: provisioning::Limits,
    /// How many transitions each node's history keeps (shown by `status`);
    /// 0 keeps none.
    pub history_depth: usize,
    /// Whether the host reports to the `metrics` facade (see the table in
    /// the crate's `metrics` module); off by default.
    pub metrics: bool,
}

impl HostConfig {
    /// The defaults for `run_id`.
    pub fn new(run_id: RunId) -> Self {
        HostConfig {
            run_id,
            policy: RetryPolicy::default(),
            safety_tick: DEFAULT_SAFETY_TICK,
            shutdown_deadline: DEFAULT_SHUTDOWN_DEADLINE,
            limits: provisioning::Limits::default(),
            history_depth: DEFAULT_HISTORY_DEPTH,
            metrics: false,
        }
    }
}

/// How many transitions each node keeps by default: enough to see a whole
/// bring-up and the failure before it.
pub const DEFAULT_HISTORY_DEPTH: usize = 16;

type ShutdownHook = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

/// A plugin the host serves, with an optional hook the host awaits when it
/// stops (for example to kill every process the plugin started).
pub struct PluginEntry {
    plugin: Arc<dyn ProvisionPlugin>,
    on_shutdown: Option<ShutdownHook>,
}

impl fmt::Debug for PluginEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginEntry")
            .field("kind", &self.plugin.kind())
            .field("has_shutdown_hook", &self.on_shutdown.is_some())
            .finish()
    }
}

impl PluginEntry {
    /// A plugin without a shutdown hook.
    pub fn new(plugin: Arc<dyn ProvisionPlugin>) -> Self {
        PluginEntry {
            plugin,
            on_shutdown: None,
        }
    }

    /// Adds the hook the host awaits (bounded by [`PLUGIN_SHUTDOWN_WAIT`])
    /// once it stops reconciling, whether the shutdown was clean or forced.
    ///
    /// # Assumptions
    /// The hook releases everything the plugin still holds; after a forced
    /// shutdown that is the only cleanup there is.
    pub fn with_shutdown<F, Fut>(mut self, hook: F) -> Self
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.on_shutdown = Some(Box::new(move || Box::pin(hook())));
        self
    }
}

/// Errors of the host.
#[derive(Debug, Error)]
pub enum HostError {
    /// A group names a provider kind no registered plugin serves.
    #[error(
        "group {group:?} names provider {provider:?}, which no plugin serves (available: {available})"
    )]
    UnknownProvider {
        /// The group.
        group: String,
        /// The provider kind it names.
        provider: String,
        /// The kinds that are served, comma-separated.
        available: String,
    },
    /// The driver refused the shape; nothing changed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The shape failed validation; nothing changed.
    #[error("invalid shape: {0}")]
    Shape(#[from] ShapeError),
    /// Two plugins serve one provider kind.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// The host is tearing the cluster down and accepts no new shape.
    #[error("the host is shutting down")]
    ShuttingDown,
    /// The host loop has ended.
    #[error("the host has stopped")]
    Stopped,
    /// [`Host::start`] was called outside a tokio runtime.
    #[error("the host must be started from within a tokio runtime")]
    NoRuntime,
    /// The generation counter is exhausted.
    #[error("no generation is left after {0}")]
    GenerationExhausted(Generation),
    /// No desired group has that name.
    #[error("no group {0:?} is desired")]
    UnknownGroup(String),
    /// Durable state could not be resumed; nothing was started.
    #[error(transparent)]
    Durability(#[from] DurabilityError),
}

/// The outcome of [`HostHandle::apply_revision`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppliedRevision {
    /// The groups equal the current desired groups; nothing changed.
    Unchanged {
        /// The current generation.
        generation: Generation,
    },
    /// The groups were accepted as a new generation.
    Applied {
        /// The generation they got.
        generation: Generation,
    },
}

impl AppliedRevision {
    /// The generation in force after the call.
    pub fn generation(self) -> Generation {
        match self {
            AppliedRevision::Unchanged { generation } | AppliedRevision::Applied { generation } => {
                generation
            }
        }
    }
}

/// How the host loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShutdownOutcome {
    /// Every node was torn down through the driver.
    Clean,
    /// The deadline passed or force was requested; plugin shutdown hooks did
    /// the rest.
    Forced,
}

/// What [`HostHandle::wait_stopped`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// How the loop ended.
    pub outcome: ShutdownOutcome,
    /// Nodes the driver still managed when the loop ended (0 when clean).
    pub remaining_nodes: usize,
    /// Observations dropped because their queue was full.
    pub dropped_observations: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum ShutdownRequest {
    None,
    Graceful,
    Force,
}

enum Command {
    Apply {
        shape: ClusterShape,
        reply: oneshot::Sender<Result<DesiredUpdate, HostError>>,
    },
    ApplyRevision {
        run_id: RunId,
        groups: Vec<NodeGroup>,
        reply: oneshot::Sender<Result<AppliedRevision, HostError>>,
    },
    Status {
        reply: oneshot::Sender<StatusSnapshot>,
    },
    Plan {
        run_id: RunId,
        groups: Vec<NodeGroup>,
        reply: oneshot::Sender<Result<PlanReport, HostError>>,
    },
    SetLimits {
        limits: provisioning::Limits,
        reply: oneshot::Sender<()>,
    },
    Resume {
        group: provisioning::GroupId,
        reply: oneshot::Sender<Result<bool, HostError>>,
    },
}

/// A cheap, cloneable handle to a running host.
///
/// When every handle (including the one inside [`Host`]) is dropped, the
/// host shuts down gracefully on its own.
#[derive(Clone)]
pub struct HostHandle {
    commands: mpsc::Sender<Command>,
    shutdown: Arc<watch::Sender<ShutdownRequest>>,
    progress: watch::Receiver<StatusSnapshot>,
    finished: watch::Receiver<Option<ShutdownReport>>,
    run_id: RunId,
    kinds: Arc<[String]>,
}

impl fmt::Debug for HostHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostHandle")
            .field("run_id", &self.run_id)
            .field("kinds", &self.kinds)
            .finish_non_exhaustive()
    }
}

impl HostHandle {
    /// The run the host manages.
    pub fn run_id(&self) -> &RunId {
        &self.run_id
    }

    /// The provider kinds the host's plugins serve.
    pub fn provider_kinds(&self) -> &[String] {
        &self.kinds
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, HostError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(make(reply))
            .await
            .map_err(|_| HostError::Stopped)?;
        answer.await.map_err(|_| HostError::Stopped)
    }

    /// Applies `shape` as the desired shape, under the driver's revision
    /// contract.
    ///
    /// # Errors
    /// [`HostError::UnknownProvider`] when a group names a kind no plugin
    /// serves; [`HostError::Driver`] with the driver's typed refusal (run
    /// changed, generation regressed, content changed without a bump,
    /// invalid shape); [`HostError::ShuttingDown`]; [`HostError::Stopped`].
    /// Nothing changes on error.
    pub async fn apply(&self, shape: ClusterShape) -> Result<DesiredUpdate, HostError> {
        self.ask(|reply| Command::Apply { shape, reply }).await?
    }

    /// Applies `groups` as the next generation when they differ from the
    /// current desired groups; identical groups change nothing. The host
    /// picks the generation, so a caller without its own revision counter
    /// (a file watcher) cannot get it wrong.
    ///
    /// # Errors
    /// As [`HostHandle::apply`]; a `run_id` other than the host's is
    /// [`DriverError::RunChanged`].
    pub async fn apply_revision(
        &self,
        run_id: RunId,
        groups: Vec<NodeGroup>,
    ) -> Result<AppliedRevision, HostError> {
        self.ask(|reply| Command::ApplyRevision {
            run_id,
            groups,
            reply,
        })
        .await?
    }

    /// A fresh snapshot. After the host stopped, the last one it published.
    pub async fn status(&self) -> StatusSnapshot {
        match self.ask(|reply| Command::Status { reply }).await {
            Ok(snapshot) => snapshot,
            Err(_) => self.progress.borrow().clone(),
        }
    }

    /// Replaces the limits (launch caps, rollout budgets, breakers) from the
    /// next pass on.
    ///
    /// # Errors
    /// [`HostError::Stopped`].
    pub async fn set_limits(&self, limits: provisioning::Limits) -> Result<(), HostError> {
        self.ask(|reply| Command::SetLimits { limits, reply }).await
    }

    /// Closes the breaker of `group` at once (`provision resume GROUP`);
    /// returns whether it was open.
    ///
    /// # Errors
    /// [`HostError::UnknownGroup`]; [`HostError::Stopped`].
    pub async fn resume(&self, group: provisioning::GroupId) -> Result<bool, HostError> {
        self.ask(|reply| Command::Resume { group, reply }).await?
    }

    /// What applying `groups` would change against the current state.
    ///
    /// # Errors
    /// [`HostError::UnknownProvider`], [`HostError::Shape`], a
    /// [`DriverError::RunChanged`] for another run, [`HostError::Stopped`].
    pub async fn plan(
        &self,
        run_id: RunId,
        groups: Vec<NodeGroup>,
    ) -> Result<PlanReport, HostError> {
        self.ask(|reply| Command::Plan {
            run_id,
            groups,
            reply,
        })
        .await?
    }

    /// Snapshots as the host publishes them (after a wake that changed
    /// something, at most once per [`publish_interval`]; a change is never
    /// held back longer than [`PUBLISH_INTERVAL_MAX`]), for live displays.
    /// [`HostHandle::status`] answers with a fresh one instead.
    ///
    /// # Caveats
    /// A borrowed snapshot (`borrow()`, or the guard `wait_for` returns) holds
    /// the channel's lock: the host waits for it at its next publish. Clone
    /// what you need and drop the guard before awaiting anything else.
    pub fn subscribe(&self) -> watch::Receiver<StatusSnapshot> {
        self.progress.clone()
    }

    /// Asks for a graceful shutdown and returns at once.
    pub fn request_shutdown(&self) {
        self.escalate(ShutdownRequest::Graceful);
    }

    /// Asks the host to stop reconciling now and let the plugins' shutdown
    /// hooks release everything. Returns at once.
    pub fn force_shutdown(&self) {
        self.escalate(ShutdownRequest::Force);
    }

    fn escalate(&self, to: ShutdownRequest) {
        self.shutdown.send_if_modified(|current| {
            let raise = *current < to;
            if raise {
                *current = to;
            }
            raise
        });
    }

    /// Whether the host loop has ended.
    pub fn is_stopped(&self) -> bool {
        self.finished.borrow().is_some()
    }

    /// Waits until the host loop has ended and reports how.
    pub async fn wait_stopped(&self) -> ShutdownReport {
        let mut finished = self.finished.clone();
        let fallback = ShutdownReport {
            outcome: ShutdownOutcome::Forced,
            remaining_nodes: 0,
            dropped_observations: 0,
        };
        match finished.wait_for(Option::is_some).await {
            Ok(report) => report.unwrap_or(fallback),
            // The loop ended without a report: it panicked.
            Err(_) => fallback,
        }
    }

    /// Requests a graceful shutdown and waits until the host stopped.
    pub async fn shutdown(&self) -> ShutdownReport {
        self.request_shutdown();
        self.wait_stopped().await
    }
}

/// A started host: its handle and its loop task.
#[derive(Debug)]
pub struct Host {
    handle: HostHandle,
    task: JoinHandle<ShutdownReport>,
}

impl Host {
    /// Builds the driver, the executor and the plugin adapter, and spawns
    /// the host loop on the current tokio runtime.
    ///
    /// # Errors
    /// [`HostError::NoRuntime`] outside a runtime; [`HostError::Adapter`]
    /// when two plugins serve one kind; [`HostError::Driver`] when the run
    /// name is invalid.
    pub fn start(config: HostConfig, plugins: Vec<PluginEntry>) -> Result<Host, HostError> {
        Host::build(config, plugins, None)
    }

    /// Like [`Host::start`], keeping durable state in `durability`'s
    /// journal: every drive's changes are committed before its operations
    /// are submitted, a run left unclean is resumed (recovered from the
    /// journal, then reconciled against every provider's listing before the
    /// first pass), orphans are collected, and a clean teardown marks the
    /// state clean.
    ///
    /// # Errors
    /// As [`Host::start`]; [`HostError::Durability`] when the journaled
    /// state cannot be recovered (nothing is started).
    pub fn start_durable(
        config: HostConfig,
        plugins: Vec<PluginEntry>,
        durability: Durability,
    ) -> Result<Host, HostError> {
        Host::build(config, plugins, Some(durability))
    }

    fn build(
        config: HostConfig,
        plugins: Vec<PluginEntry>,
        durability: Option<Durability>,
    ) -> Result<Host, HostError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| HostError::NoRuntime)?;
        let mut resumed = false;
        let (driver, durable) = match durability {
            None => {
                let mut driver = ClusterDriver::new(config.run_id.clone(), config.policy)?;
                // Only to know when a snapshot is due (see `publish_if_due`).
                driver.track_changes();
                (driver, None)
            }
            Some(mut durability) => {
                let driver = match durability.resume.take() {
                    Some(stored) => {
                        let (driver, report) = ClusterDriver::recover(
                            &config.run_id,
                            stored,
                            config.policy,
                            Timestamp::ZERO,
                        )
                        .map_err(DurabilityError::from)?;
                        if durability.unclean {
                            tracing::info!(
                                run = %config.run_id,
                                generation = report.generation.get(),
                                nodes = report.nodes,
                                pending = report.pending_made_ambiguous,
                                "resuming from the journal"
                            );
                        } else {
                            tracing::info!(
                                generation = report.generation.get(),
                                next_attempt = driver.state().attempts.next_unallocated(),
                                "a clean start; generations and attempts continue from the journal"
                            );
                        }
                        if report.allocator_raised {
                            tracing::warn!(
                                "the journal's attempt mark was below a stored attempt; raised"
                            );
                        }
                        resumed = durability.unclean;
                        driver
                    }
                    None => {
                        let mut driver = ClusterDriver::new(config.run_id.clone(), config.policy)?;
                        driver.track_changes();
                        driver
                    }
                };
                let (reports_tx, reports) = tokio::sync::mpsc::unbounded_channel();
                let orphans = Orphans::new(
                    durability.orphan_grace,
                    durability.orphan_scan_interval,
                    reports_tx,
                );
                let durable = DurableLoop {
                    journal: durability.journal,
                    codec: durability.codec,
                    journal_error: None,
                    orphans,
                    reports,
                    resumed,
                    lost_at_recovery: 0,
                };
                (driver, Some(durable))
            }
        };

        let dropped = Arc::new(AtomicU64::new(0));
        let (observation_tx, observations) = mpsc::channel(OBSERVATION_QUEUE_CAPACITY);
        let dropped_in_sink = dropped.clone();
        let sink = ObservationSink::new(move |observation: Observation| {
            match observation_tx.try_send(observation) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(lost)) => {
                    dropped_in_sink.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(node = %lost.node(), "observation queue full; observation dropped");
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    tracing::debug!("observation after the host stopped ignored");
                }
            }
        });

        let mut hooks = Vec::new();
        let mut served = Vec::new();
        for entry in plugins {
            let kind = entry.plugin.kind().to_owned();
            if let Some(hook) = entry.on_shutdown {
                hooks.push((kind, hook));
            }
            served.push(entry.plugin);
        }
        let adapter = PluginBackendAdapter::new(served, sink)?;
        let kinds: Arc<[String]> = adapter.kinds().map(str::to_owned).collect();

        let wake = Arc::new(Notify::new());
        let spawner = Arc::new(TokioSpawner::new(runtime.clone()));
        let notify = wake.clone();
        let executor = IdempotentEffectExecutor::with_notify(
            Arc::new(adapter),
            spawner.clone() as Arc<dyn Spawner>,
            move || notify.notify_one(),
        );

        let start = Instant::now();
        let (command_tx, commands) = mpsc::channel(COMMAND_QUEUE_CAPACITY);
        let (shutdown_tx, shutdown_rx) = watch::channel(ShutdownRequest::None);
        let initial = StatusSnapshot::of(&driver, HostPhase::Running, 0);
        let (progress_tx, progress) = watch::channel(initial);
        let (finished_tx, finished) = watch::channel(None);

        let mut driver = driver;
        driver.set_history_depth(config.history_depth);
        if config.limits != provisioning::Limits::default() {
            driver.set_limits(config.limits.clone());
        }
        let host_loop = HostLoop {
            driver,
            executor: Some(executor),
            spawner,
            kinds: kinds.iter().cloned().collect(),
            hooks,
            start,
            wake,
            observations,
            commands,
            shutdown_rx,
            progress: progress_tx,
            finished: finished_tx,
            phase: HostPhase::Running,
            teardown_deadline: None,
            last_wake_at: Timestamp::ZERO,
            config: config.clone(),
            dropped,
            durable,
            status_dirty: true,
            stage_gauges: std::sync::Mutex::default(),
            view: Progress::default(),
            published_at: None,
            publish_cost: Duration::ZERO,
        };
        let task = runtime.spawn(host_loop.run());
        Ok(Host {
            handle: HostHandle {
                commands: command_tx,
                shutdown: Arc::new(shutdown_tx),
                progress,
                finished,
                run_id: config.run_id,
                kinds,
            },
            task,
        })
    }

    /// A handle to the host.
    pub fn handle(&self) -> HostHandle {
        self.handle.clone()
    }

    /// Waits for the host loop to end (after a shutdown request, or after
    /// every other handle was dropped).
    pub async fn join(self) -> ShutdownReport {
        let Host { handle, task } = self;
        drop(handle);
        match task.await {
            Ok(report) => report,
            Err(error) => {
                tracing::error!("the host loop ended abnormally: {error}");
                ShutdownReport {
                    outcome: ShutdownOutcome::Forced,
                    remaining_nodes: 0,
                    dropped_observations: 0,
                }
            }
        }
    }
}

/// What one wake of the loop asks for next.
enum Next {
    Continue,
    Stop(ShutdownOutcome),
}

struct HostLoop {
    driver: ClusterDriver,
    /// `None` once the loop stopped reconciling; dropping it releases the
    /// backend and the plugins.
    executor: Option<IdempotentEffectExecutor<PluginBackendAdapter>>,
    spawner: Arc<TokioSpawner>,
    kinds: BTreeSet<String>,
    hooks: Vec<(String, ShutdownHook)>,
    start: Instant,
    wake: Arc<Notify>,
    observations: mpsc::Receiver<Observation>,
    commands: mpsc::Receiver<Command>,
    shutdown_rx: watch::Receiver<ShutdownRequest>,
    progress: watch::Sender<StatusSnapshot>,
    finished: watch::Sender<Option<ShutdownReport>>,
    phase: HostPhase,
    teardown_deadline: Option<Instant>,
    /// The instant the last wake evaluated.
    last_wake_at: Timestamp,
    config: HostConfig,
    dropped: Arc<AtomicU64>,
    durable: Option<DurableLoop>,
    /// Something a snapshot shows changed since the last one was published.
    status_dirty: bool,
    /// When the last snapshot was published.
    published_at: Option<Instant>,
    /// What assembling the last published snapshot cost (from a view
    /// already up to date).
    publish_cost: Duration,
    /// The (group, stage) gauges set by the last published snapshot.
    stage_gauges: std::sync::Mutex<BTreeSet<(String, String)>>,
    /// What progress snapshots are built from, kept up to date per changed
    /// node.
    view: Progress,
}

/// The journal side of a durable host loop.
struct DurableLoop {
    journal: Box<dyn Journal>,
    codec: StateCodec,
    /// The last commit's error, while commits fail.
    journal_error: Option<String>,
    orphans: Orphans,
    reports: mpsc::UnboundedReceiver<OrphanReport>,
    resumed: bool,
    lost_at_recovery: u64,
}

impl DurableLoop {
    /// Commits the driver's changes; on failure nothing of this drive may
    /// be submitted.
    fn commit(
        &mut self,
        driver: &mut ClusterDriver,
        now: Timestamp,
        view: &mut Progress,
    ) -> Result<(), String> {
        let changes = driver.take_change_view(now);
        if changes.is_empty() {
            return Ok(());
        }
        view.note_changes(&changes);
        let encoded = self.codec.encode_view(&changes);
        drop(changes);
        let outcome = encoded
            .map_err(|e| e.to_string())
            .and_then(|rows| self.journal.commit(&rows).map_err(|e| e.to_string()));
        match &outcome {
            Ok(()) => {
                if self.journal_error.take().is_some() {
                    tracing::info!("the state journal is writable again");
                }
            }
            Err(error) => {
                // The changes are lost from the tracker; a full rewrite of
                // what may be missing follows the next successful commit.
                driver.track_changes();
                view.invalidate();
                if self.journal_error.as_deref() != Some(error.as_str()) {
                    tracing::error!(
                        "the state journal could not be written; nothing is submitted until it can: {error}"
                    );
                }
                self.journal_error = Some(error.clone());
            }
        }
        outcome
    }
}

/// Collects a drive's operations so they are submitted only after the
/// drive's changes are committed.
#[derive(Default)]
struct Batch {
    operations: Vec<Operation>,
    retired: Vec<NodeAttemptId>,
}

impl OperationSink for Batch {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        self.operations.push(operation);
        Ok(())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.retired.push(attempt);
    }
}

impl HostLoop {
    fn now(&self) -> Timestamp {
        let elapsed = self.start.elapsed().as_millis();
        Timestamp::from_millis(u64::try_from(elapsed).unwrap_or(u64::MAX))
    }

    fn instant_of(&self, at: Timestamp) -> Option<Instant> {
        self.start
            .checked_add(Duration::from_millis(at.as_millis()))
    }

    async fn run(mut self) -> ShutdownReport {
        let tick_period = self.config.safety_tick.max(Duration::from_millis(1));
        let mut tick = tokio::time::interval_at(self.start + tick_period, tick_period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut commands_open = true;
        let mut shutdown_open = true;
        let mut observations_open = true;
        if self.durable.as_ref().is_some_and(|d| d.resumed) {
            self.reconcile_listing().await;
        }
        let outcome = loop {
            if let Next::Stop(outcome) = self.step() {
                break outcome;
            }
            let timer = self.timer_instant();
            let again = self.driver.is_queued();
            let teardown = self.teardown_deadline;
            let scan_at = self.durable.as_ref().and_then(|d| d.orphans.next_scan());
            let publish_at = self.publish_at();
            tokio::select! {
                biased;
                changed = self.shutdown_rx.changed(), if shutdown_open => {
                    if changed.is_err() {
                        shutdown_open = false;
                        self.begin_shutdown();
                    } else if *self.shutdown_rx.borrow_and_update() == ShutdownRequest::Force {
                        break ShutdownOutcome::Forced;
                    } else {
                        self.begin_shutdown();
                    }
                }
                _ = sleep_until_option(teardown), if teardown.is_some() => {
                    tracing::warn!("graceful shutdown passed its deadline; forcing");
                    break ShutdownOutcome::Forced;
                }
                command = self.commands.recv(), if commands_open => match command {
                    Some(command) => self.handle(command),
                    None => {
                        commands_open = false;
                        self.begin_shutdown();
                    }
                },
                () = self.wake.notified() => {}
                received = self.observations.recv(), if observations_open => match received {
                    Some(observation) => self.fold_one_observation(&observation),
                    None => observations_open = false,
                },
                () = sleep_until_option(timer), if timer.is_some() => {}
                report = recv_report(self.durable.as_mut()) => self.on_orphan_report(report),
                () = sleep_until_option(scan_at), if scan_at.is_some() => self.start_scan(),
                () = sleep_until_option(publish_at), if publish_at.is_some() => {}
                _ = tick.tick() => self.driver.trigger(),
                () = tokio::task::yield_now(), if again => {}
            }
        };
        self.finish(outcome).await
    }

    /// The instant to wake at for the driver's earliest stored deadline.
    fn timer_instant(&self) -> Option<Instant> {
        let at = self.driver.requeue_at()?;
        // Compared with the instant the last wake evaluated, not with the
        // clock now: a deadline that fell due since then is simply armed
        // (in the past, so it fires at once).
        let now = self.last_wake_at;
        if now.reached(at) {
            // Every due deadline was handled by the wake that just ran, so
            // one still in the past belongs to a fact the driver refused.
            tracing::debug!(%at, %now, "a stored deadline stayed in the past");
            return Some(Instant::now() + STALE_DEADLINE_RETRY);
        }
        self.instant_of(at)
    }

    /// One wake: fold, expire, drive, publish.
    fn step(&mut self) -> Next {
        let Some(executor) = self.executor.as_mut() else {
            return Next::Stop(ShutdownOutcome::Forced);
        };
        let now = {
            let elapsed = self.start.elapsed().as_millis();
            Timestamp::from_millis(u64::try_from(elapsed).unwrap_or(u64::MAX))
        };
        self.last_wake_at = now;
        for result in executor.take_results() {
            fold_result(&mut self.driver, &result, now, self.config.metrics);
        }
        let mut folded = 0;
        while folded < MAX_OBSERVATIONS_PER_WAKE {
            match self.observations.try_recv() {
                Ok(observation) => {
                    fold_observation(&mut self.driver, &observation, now);
                    folded += 1;
                }
                Err(_) => break,
            }
        }
        if folded == MAX_OBSERVATIONS_PER_WAKE {
            // More may be queued: come back at once.
            self.wake.notify_one();
        }
        for due in self.driver.pending_operations_due(now) {
            match executor.expire(due.op) {
                Some(result) => fold_result(&mut self.driver, &result, now, self.config.metrics),
                None => {
                    if let Err(error) = self.driver.operation_timed_out(&due.node, due.op, now) {
                        tracing::debug!(node = %due.node, op = %due.op, "timeout not folded: {error}");
                    }
                }
            }
        }
        match &mut self.durable {
            None => {
                let started = self.config.metrics.then(Instant::now);
                match self.driver.drive_until_blocked(now, executor) {
                    Ok(report) => {
                        if let Some(started) = started {
                            crate::metrics::drive(report.passes, started.elapsed());
                        }
                        if report.dispatched > 0 || report.refused > 0 {
                            tracing::debug!(
                                passes = report.passes,
                                dispatched = report.dispatched,
                                refused = report.refused,
                                "drove"
                            );
                        }
                    }
                    Err(error) => tracing::warn!("reconcile pass failed: {error}"),
                }
                // Nothing is journaled: the changes only say a snapshot is
                // due, and which nodes it must show anew.
                let (nodes, other) = self.driver.take_changed_nodes();
                if other || !nodes.is_empty() {
                    self.status_dirty = true;
                    self.view.note_nodes(nodes);
                }
            }
            Some(durable) => {
                let mut batch = Batch::default();
                let started = self.config.metrics.then(Instant::now);
                match self.driver.drive_until_blocked(now, &mut batch) {
                    Ok(report) => {
                        if let Some(started) = started {
                            crate::metrics::drive(report.passes, started.elapsed());
                        }
                    }
                    Err(error) => tracing::warn!("reconcile pass failed: {error}"),
                }
                if self.driver.has_changes() {
                    self.status_dirty = true;
                }
                // G27: the drive's changes, its dispatches among them, are
                // durable before any of its operations reaches a provider.
                let committed = durable.commit(&mut self.driver, now, &mut self.view);
                for attempt in batch.retired {
                    executor.retire(attempt);
                }
                for operation in batch.operations {
                    let refused = match &committed {
                        Ok(()) => match executor.submit(operation.clone()) {
                            Ok(_) => continue,
                            Err(refused) => format!("submission refused: {refused}"),
                        },
                        Err(error) => format!("the state journal could not be written: {error}"),
                    };
                    let result = ExecutorResult {
                        op: operation.id,
                        node: operation.node.clone(),
                        kind: operation.kind(),
                        outcome: Err(EffectError::definite(refused)),
                    };
                    fold_result(&mut self.driver, &result, now, self.config.metrics);
                }
            }
        }
        self.publish_if_due();
        if self.phase == HostPhase::ShuttingDown && self.driver.state().nodes.is_empty() {
            return Next::Stop(ShutdownOutcome::Clean);
        }
        Next::Continue
    }

    /// A progress snapshot, from the view kept up to date per changed node.
    fn snapshot(&mut self) -> StatusSnapshot {
        let uptime = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let snapshot = self.view.snapshot(&self.driver, self.phase, uptime);
        self.with_durability(snapshot)
    }

    /// A fresh snapshot built whole, with the nodes' histories (what a
    /// status query answers).
    fn fresh_snapshot(&self) -> StatusSnapshot {
        let uptime = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let snapshot = StatusSnapshot::with_history(&self.driver, self.phase, uptime);
        self.with_durability(snapshot)
    }

    fn with_durability(&self, mut snapshot: StatusSnapshot) -> StatusSnapshot {
        snapshot.durability = self.durable.as_ref().map(|d| {
            let stats = d.journal.stats();
            DurabilityStatus {
                resumed: d.resumed,
                commits: stats.commits,
                bytes_written: stats.bytes_written,
                journal_error: d.journal_error.clone(),
                orphans_suspected: d.orphans.suspected(),
                orphans_collected: d.orphans.collected,
                lost_at_recovery: d.lost_at_recovery,
            }
        });
        snapshot
    }

    /// Before the first pass of a resumed run: every provider's listing
    /// against the journal. A journaled lease of a current attempt that its
    /// provider no longer lists is a lost node (the ladder replaces it); a
    /// listed resource no current attempt owns is an orphan suspect.
    async fn reconcile_listing(&mut self) {
        let Some(adapter) = self.executor.as_ref().map(|e| e.backend().clone()) else {
            return;
        };
        let run = self.config.run_id.clone();
        let listing = list_all(&adapter, &run).await;
        let now = self.now();
        let Some(durable) = self.durable.as_mut() else {
            return;
        };
        let mut adopted = 0_usize;
        let mut lost = Vec::new();
        for (kind, listed) in &listing {
            let listed = match listed {
                Ok(listed) => listed,
                Err(error) => {
                    tracing::warn!(provider = %kind, "cannot list the provider's nodes at recovery: {error}");
                    continue;
                }
            };
            let keys: BTreeSet<_> = listed.iter().map(|n| &n.key).collect();
            for node in listed {
                if node.key.run_id != run {
                    continue;
                }
                if owned(self.driver.state(), &node.key) {
                    adopted += 1;
                } else {
                    durable.orphans.seed(kind, node);
                }
            }
            for (id, node) in &self.driver.state().nodes {
                let ours = node.spec.template().provider == *kind;
                let leased = node
                    .record
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.attempt == node.attempt);
                if !ours || !leased || node.record.stage == provisioning::NodeStage::Destroyed {
                    continue;
                }
                let key = provisioning_provider::AttemptKey {
                    run_id: run.clone(),
                    node: id.clone(),
                    attempt: node.attempt,
                };
                if !keys.contains(&key) {
                    lost.push((id.clone(), node.attempt));
                }
            }
        }
        durable.lost_at_recovery = lost.len() as u64;
        for (node, attempt) in lost {
            tracing::info!(%node, %attempt, "journaled node no longer listed by its provider: lost");
            let observation = Observation::NodeLost {
                node,
                attempt,
                cause: LossCause::LeaseGone,
            };
            fold_observation(&mut self.driver, &observation, now);
        }
        tracing::info!(
            adopted,
            lost = durable.lost_at_recovery,
            orphans = durable.orphans.suspected(),
            "recovery listing reconciled"
        );
    }

    fn start_scan(&mut self) {
        let Some(adapter) = self.executor.as_ref().map(|e| e.backend().clone()) else {
            return;
        };
        if let Some(durable) = self.durable.as_mut() {
            durable
                .orphans
                .start_scan(adapter, self.config.run_id.clone());
        }
    }

    fn on_orphan_report(&mut self, report: Option<OrphanReport>) {
        let Some(report) = report else {
            return;
        };
        self.status_dirty = true;
        let Some(adapter) = self.executor.as_ref().map(|e| e.backend().clone()) else {
            return;
        };
        let Some(durable) = self.durable.as_mut() else {
            return;
        };
        match report {
            OrphanReport::Listed(listing) => {
                durable.orphans.on_listing(
                    &listing,
                    self.driver.state(),
                    &adapter,
                    &self.config.run_id,
                );
            }
            OrphanReport::Destroyed { kind, key, outcome } => {
                durable.orphans.on_destroyed(kind, key, outcome);
            }
        }
    }

    /// When the next snapshot is due: `None` while nothing changed.
    fn publish_at(&self) -> Option<Instant> {
        if !self.status_dirty {
            return None;
        }
        Some(match self.published_at {
            Some(at) => at + publish_interval(self.publish_cost),
            None => Instant::now(),
        })
    }

    /// Publishes a snapshot if something changed and the interval since the
    /// last one is over; otherwise the loop's timer comes back for it.
    fn publish_if_due(&mut self) {
        let Some(due) = self.publish_at() else {
            return;
        };
        let now = Instant::now();
        if now < due {
            return;
        }
        // Bringing the view up to date costs the nodes changed since the
        // last snapshot (each changed node is built once per snapshot at
        // most): work in proportion to the loop's own, not counted in the
        // interval. What a snapshot costs beyond it (a pointer per node, the
        // groups, the metrics) is.
        self.view.update(&self.driver);
        let assembling = Instant::now();
        let replaced = self.publish();
        self.publish_cost = assembling.elapsed();
        // Frees the statuses of the nodes that changed since (per-change
        // work again), off the loop: another worker does it.
        if !replaced.nodes.is_empty() {
            tokio::spawn(async move { drop(replaced) });
        }
        self.published_at = Some(now);
        self.status_dirty = false;
    }

    /// Publishes a snapshot; returns the one it replaced (or the fresh one,
    /// when nothing it shows changed), for the caller to drop outside the
    /// channel's lock.
    fn publish(&mut self) -> StatusSnapshot {
        let mut fresh = self.snapshot();
        if self.config.metrics {
            let mut previous = self
                .stage_gauges
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            crate::metrics::gauges(&fresh, &mut previous);
        }
        self.progress.send_if_modified(|current| {
            let changed = fresh.differs_from(current);
            if changed {
                std::mem::swap(current, &mut fresh);
            }
            changed
        });
        fresh
    }

    fn fold_one_observation(&mut self, observation: &Observation) {
        let now = self.now();
        fold_observation(&mut self.driver, observation, now);
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Apply { shape, reply } => {
                let outcome = self.apply(shape);
                let _ = reply.send(outcome);
            }
            Command::ApplyRevision {
                run_id,
                groups,
                reply,
            } => {
                let outcome = self.apply_revision(run_id, groups);
                let _ = reply.send(outcome);
            }
            Command::Status { reply } => {
                let _ = reply.send(self.fresh_snapshot());
            }
            Command::Plan {
                run_id,
                groups,
                reply,
            } => {
                let _ = reply.send(self.plan(run_id, groups));
            }
            Command::SetLimits { limits, reply } => {
                if *self.driver.limits() != limits {
                    tracing::info!("limits changed: {limits:?}");
                    self.driver.set_limits(limits);
                }
                let _ = reply.send(());
            }
            Command::Resume { group, reply } => {
                let outcome = if self.driver.desired().groups().contains_key(&group) {
                    let was_open = self.driver.reset_breaker(&group);
                    tracing::info!(%group, was_open, "breaker closed by hand");
                    Ok(was_open)
                } else {
                    Err(HostError::UnknownGroup(group.to_string()))
                };
                let _ = reply.send(outcome);
            }
        }
    }

    fn check_providers(&self, groups: &[NodeGroup]) -> Result<(), HostError> {
        for group in groups {
            let provider = &group.template.provider;
            if !self.kinds.contains(provider) {
                return Err(HostError::UnknownProvider {
                    group: group.id.to_string(),
                    provider: provider.clone(),
                    available: self.kinds.iter().cloned().collect::<Vec<_>>().join(", "),
                });
            }
        }
        Ok(())
    }

    fn apply(&mut self, shape: ClusterShape) -> Result<DesiredUpdate, HostError> {
        if self.phase != HostPhase::Running {
            return Err(HostError::ShuttingDown);
        }
        self.check_providers(&shape.groups)?;
        let generation = shape.generation;
        let update = self.driver.update_desired(shape)?;
        if update == DesiredUpdate::Accepted {
            tracing::info!(generation = generation.get(), "desired shape accepted");
        }
        Ok(update)
    }

    fn next_shape(&self, run_id: RunId, groups: Vec<NodeGroup>) -> Result<ClusterShape, HostError> {
        let current = self.driver.desired().shape();
        let generation = if groups == current.groups {
            current.generation
        } else {
            let next = current
                .generation
                .get()
                .checked_add(1)
                .ok_or(HostError::GenerationExhausted(current.generation))?;
            Generation::new(next)
        };
        Ok(ClusterShape {
            run_id,
            generation,
            groups,
        })
    }

    fn apply_revision(
        &mut self,
        run_id: RunId,
        groups: Vec<NodeGroup>,
    ) -> Result<AppliedRevision, HostError> {
        let shape = self.next_shape(run_id, groups)?;
        let generation = shape.generation;
        Ok(match self.apply(shape)? {
            DesiredUpdate::Unchanged => AppliedRevision::Unchanged { generation },
            DesiredUpdate::Accepted => AppliedRevision::Applied { generation },
        })
    }

    fn plan(&self, run_id: RunId, groups: Vec<NodeGroup>) -> Result<PlanReport, HostError> {
        self.check_providers(&groups)?;
        if &run_id != self.driver.run_id() {
            return Err(DriverError::RunChanged {
                expected: self.driver.run_id().clone(),
                got: run_id,
            }
            .into());
        }
        let desired = self.next_shape(run_id, groups)?.validate()?;
        Ok(plan_against(self.driver.state(), &desired, self.now()))
    }

    fn begin_shutdown(&mut self) {
        if self.phase != HostPhase::Running {
            return;
        }
        self.phase = HostPhase::ShuttingDown;
        self.status_dirty = true;
        self.teardown_deadline = Some(Instant::now() + self.config.shutdown_deadline);
        let current = self.driver.desired().generation();
        let Some(next) = current.get().checked_add(1) else {
            tracing::error!("no generation left for the empty shape; shutdown will be forced");
            self.teardown_deadline = Some(Instant::now());
            return;
        };
        let empty = ClusterShape::empty(self.config.run_id.clone(), Generation::new(next));
        match self.driver.update_desired(empty) {
            Ok(_) => tracing::info!(generation = next, "tearing the cluster down"),
            Err(error) => {
                tracing::error!("the empty shape was refused ({error}); shutdown will be forced");
                self.teardown_deadline = Some(Instant::now());
            }
        }
    }

    async fn finish(mut self, outcome: ShutdownOutcome) -> ShutdownReport {
        if let Some(executor) = self.executor.as_ref() {
            executor.close();
        }
        let stuck = self.spawner.shutdown(TASK_SHUTDOWN_WAIT).await;
        if stuck > 0 {
            tracing::warn!(tasks = stuck, "executor tasks did not end in time");
        }
        for (kind, hook) in std::mem::take(&mut self.hooks) {
            if tokio::time::timeout(PLUGIN_SHUTDOWN_WAIT, hook())
                .await
                .is_err()
            {
                tracing::error!(provider = %kind, "the plugin's shutdown did not finish in time");
            }
        }
        if let Some(durable) = self.durable.as_mut() {
            let now = Timestamp::from_millis(
                u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX),
            );
            let clean = outcome == ShutdownOutcome::Clean && self.driver.state().nodes.is_empty();
            let committed = durable.commit(&mut self.driver, now, &mut self.view);
            if clean && committed.is_ok() {
                match durable.journal.mark_clean() {
                    Ok(()) => tracing::info!("state marked clean"),
                    Err(error) => tracing::error!("cannot mark the state clean: {error}"),
                }
            } else if !clean {
                tracing::warn!("the state stays unclean: the next start resumes this run");
            }
        }
        // Releases the backend and, with it, the host's hold on the plugins.
        self.executor = None;
        self.phase = HostPhase::Stopped;
        let remaining_nodes = self.driver.state().nodes.len();
        let report = ShutdownReport {
            outcome,
            remaining_nodes,
            dropped_observations: self.dropped.load(Ordering::Relaxed),
        };
        let last = self.snapshot();
        self.progress.send_replace(last);
        self.finished.send_replace(Some(report));
        match outcome {
            ShutdownOutcome::Clean => tracing::info!("cluster torn down; host stopped"),
            ShutdownOutcome::Forced => {
                tracing::warn!(remaining_nodes, "host stopped by force");
            }
        }
        report
    }
}

fn fold_result(driver: &mut ClusterDriver, result: &ExecutorResult, now: Timestamp, metrics: bool) {
    if metrics {
        let latency = driver
            .state()
            .nodes
            .get(&result.node)
            .and_then(|node| node.pending.as_ref())
            .filter(|pending| pending.id == result.op)
            .map(|pending| {
                Duration::from_millis(
                    now.as_millis()
                        .saturating_sub(pending.dispatched_at.as_millis()),
                )
            });
        crate::metrics::operation(result, latency);
    }
    match driver.apply_executor_result(result, now) {
        Ok(()) => {
            if let Err(error) = &result.outcome {
                tracing::debug!(node = %result.node, op = %result.op, kind = %result.kind, "operation failed: {error}");
            }
        }
        Err(error) => {
            tracing::debug!(node = %result.node, op = %result.op, "result not folded: {error}");
        }
    }
}

fn fold_observation(driver: &mut ClusterDriver, observation: &Observation, now: Timestamp) {
    if let Err(error) = driver.apply_observation(observation, now) {
        tracing::debug!(node = %observation.node(), "observation not folded: {error}");
    }
}

/// The next orphan report, or never when the host keeps no durable state.
async fn recv_report(durable: Option<&mut DurableLoop>) -> Option<OrphanReport> {
    match durable {
        Some(durable) => durable.reports.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_option(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
