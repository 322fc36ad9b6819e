//! Building and starting a host: [`Host::start`] and
//! [`Host::start_durable`] build the driver (recovered from the journal for
//! a durable host), the executor over the plugins' adapter and the channels
//! between the loop and its handles, then spawn the loop; [`Host::join`]
//! waits for it to end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use provisioning::spawn::Spawner;
use provisioning::{ClusterDriver, IdempotentEffectExecutor, Observation, Timestamp};
use provisioning_provider::{ObservationSink, PluginBackendAdapter};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::config::{HostConfig, PluginEntry};
use super::error::HostError;
use super::handle::{HostHandle, ShutdownOutcome, ShutdownReport, ShutdownRequest};
use super::run_loop::HostLoop;
use crate::durable::{Durability, DurableLoop};
use crate::spawner::TokioSpawner;
use crate::status::{HostPhase, Progress, StatusSnapshot};

/// How many commands may wait for the host loop.
pub const COMMAND_QUEUE_CAPACITY: usize = 64;

/// How many plugin observations may wait for the host loop. Past this, an
/// observation is dropped with a warning and counted; the bound is far above
/// what a healthy loop lets pile up.
pub const OBSERVATION_QUEUE_CAPACITY: usize = 1 << 16;

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
        let (recovered, durable) = match durability {
            None => (None, None),
            Some(durability) => {
                let (recovered, durable) =
                    DurableLoop::open(durability, &config.run_id, config.policy)?;
                (recovered, Some(durable))
            }
        };
        let driver = match recovered {
            Some(driver) => driver,
            None => {
                let mut driver = ClusterDriver::new(config.run_id.clone(), config.policy)?;
                // The change tracker says when a snapshot is due (see
                // `publish_if_due`) and, in a durable host, what to commit.
                driver.track_changes();
                driver
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
        // The run's membership goes to the plugins (their agents' peers
        // files) and to `HostHandle::membership` whenever it changes.
        driver.track_membership();
        let (membership_tx, membership) = watch::channel(None);
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
            membership: membership_tx,
            membership_taken_at: None,
            membership_generation: None,
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
            handle: HostHandle::new(
                command_tx,
                shutdown_tx,
                progress,
                membership,
                finished,
                config.run_id,
                kinds,
            ),
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
