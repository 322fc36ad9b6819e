//! Shutdown: a graceful one applies an empty shape at the next generation
//! and lets the loop reconcile until no node is left, bounded by
//! [`HostConfig::shutdown_deadline`](super::HostConfig::shutdown_deadline);
//! then, however the loop ended, [`HostLoop::finish`] stops the executor's
//! tasks, awaits each plugin's shutdown hook, closes the durable side and
//! reports.

use std::sync::atomic::Ordering;
use std::time::Duration;

use provisioning::{ClusterShape, Generation, Timestamp};
use tokio::time::Instant;

use super::handle::{ShutdownOutcome, ShutdownReport};
use super::run_loop::HostLoop;
use crate::status::HostPhase;

/// How long shutdown waits for the executor's aborted tasks to end.
pub const TASK_SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// How long shutdown waits for one plugin's shutdown hook.
pub const PLUGIN_SHUTDOWN_WAIT: Duration = Duration::from_secs(15);

impl HostLoop {
    /// Starts a graceful shutdown: the empty shape at the next generation,
    /// under the shutdown deadline (or at once forced, when it is refused).
    pub(super) fn begin_shutdown(&mut self) {
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

    /// Ends the loop however it stopped: tasks, hooks, the durable side, the
    /// last snapshot and the report.
    pub(super) async fn finish(mut self, outcome: ShutdownOutcome) -> ShutdownReport {
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
            durable.close(&mut self.driver, now, &mut self.view, clean);
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
