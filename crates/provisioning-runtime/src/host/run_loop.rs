//! The host loop: [`HostLoop`] owns the driver, the executor and the
//! plugins, sleeps until something wakes it (a result, an observation, a
//! command, the timer at the driver's earliest deadline, the safety tick,
//! orphan work, a due snapshot, shutdown) and then folds, expires, drives
//! and publishes. How it answers commands, publishes and shuts down is in
//! the sibling modules `commands`, `publish` and `shutdown`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use provisioning::{ClusterDriver, IdempotentEffectExecutor, Membership, Observation, Timestamp};
use provisioning_provider::PluginBackendAdapter;
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};

use super::config::{HostConfig, ShutdownHook};
use super::handle::{Command, ShutdownOutcome, ShutdownReport, ShutdownRequest};
use crate::durable::{DurableLoop, OrphanReport, list_all, recv_report};
use crate::fold::{fold_observation, fold_result};
use crate::spawner::TokioSpawner;
use crate::status::{HostPhase, Progress, StatusSnapshot};

/// The most observations folded in one wake; the rest wait for the next one,
/// which follows at once.
pub const MAX_OBSERVATIONS_PER_WAKE: usize = 4096;

/// How long the loop waits before looking again at a stored deadline that
/// stayed in the past after a full wake (a fact the driver refused to fold).
/// Keeps such a deadline from turning the loop into a spin.
pub const STALE_DEADLINE_RETRY: Duration = Duration::from_millis(250);

/// What one wake of the loop asks for next.
pub(super) enum Next {
    Continue,
    Stop(ShutdownOutcome),
}

/// The shortest time between two hand-outs of the membership to the
/// plugins: well inside the 2 s design §22 allows from a fold to the
/// rewritten peers files.
pub const MEMBERSHIP_INTERVAL: Duration = Duration::from_millis(250);

/// Everything the loop owns; only the loop touches the driver.
pub(super) struct HostLoop {
    pub(super) driver: ClusterDriver,
    /// `None` once the loop stopped reconciling; dropping it releases the
    /// backend and the plugins.
    pub(super) executor: Option<IdempotentEffectExecutor<PluginBackendAdapter>>,
    pub(super) spawner: Arc<TokioSpawner>,
    pub(super) kinds: BTreeSet<String>,
    pub(super) hooks: Vec<(String, ShutdownHook)>,
    pub(super) start: Instant,
    pub(super) wake: Arc<Notify>,
    pub(super) observations: mpsc::Receiver<Observation>,
    pub(super) commands: mpsc::Receiver<Command>,
    pub(super) shutdown_rx: watch::Receiver<ShutdownRequest>,
    pub(super) progress: watch::Sender<StatusSnapshot>,
    /// The membership last handed to the plugins.
    pub(super) membership: watch::Sender<Option<Arc<Membership>>>,
    /// When the membership was last taken from the driver.
    pub(super) membership_taken_at: Option<Instant>,
    /// The desired generation of the last take.
    pub(super) membership_generation: Option<provisioning::Generation>,
    pub(super) finished: watch::Sender<Option<ShutdownReport>>,
    pub(super) phase: HostPhase,
    pub(super) teardown_deadline: Option<Instant>,
    /// The instant the last wake evaluated.
    pub(super) last_wake_at: Timestamp,
    pub(super) config: HostConfig,
    pub(super) dropped: Arc<AtomicU64>,
    pub(super) durable: Option<DurableLoop>,
    /// Something a snapshot shows changed since the last one was published.
    pub(super) status_dirty: bool,
    /// When the last snapshot was published.
    pub(super) published_at: Option<Instant>,
    /// What assembling the last published snapshot cost (from a view
    /// already up to date).
    pub(super) publish_cost: Duration,
    /// The (group, stage) gauges set by the last published snapshot.
    pub(super) stage_gauges: std::sync::Mutex<BTreeSet<(String, String)>>,
    /// What progress snapshots are built from, kept up to date per changed
    /// node.
    pub(super) view: Progress,
}

impl HostLoop {
    pub(super) fn now(&self) -> Timestamp {
        let elapsed = self.start.elapsed().as_millis();
        Timestamp::from_millis(u64::try_from(elapsed).unwrap_or(u64::MAX))
    }

    fn instant_of(&self, at: Timestamp) -> Option<Instant> {
        self.start
            .checked_add(Duration::from_millis(at.as_millis()))
    }

    pub(super) async fn run(mut self) -> ShutdownReport {
        let tick_period = self.config.safety_tick.max(Duration::from_millis(1));
        let mut tick = tokio::time::interval_at(self.start + tick_period, tick_period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut commands_open = true;
        let mut shutdown_open = true;
        let mut observations_open = true;
        if self.durable.as_ref().is_some_and(DurableLoop::resumed) {
            self.reconcile_listing().await;
        }
        let outcome = loop {
            if let Next::Stop(outcome) = self.step() {
                break outcome;
            }
            let timer = self.timer_instant();
            let again = self.driver.is_queued();
            let teardown = self.teardown_deadline;
            let scan_at = self.durable.as_ref().and_then(DurableLoop::next_scan);
            let publish_at = self.publish_at();
            let membership_at = self.membership_at();
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
                () = sleep_until_option(membership_at), if membership_at.is_some() => {}
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
                let changes = self.driver.take_changes(now);
                if !changes.is_empty() {
                    self.status_dirty = true;
                    self.view.note_nodes(changes.into_nodes());
                }
            }
            Some(durable) => {
                let changed = durable.drive(
                    &mut self.driver,
                    executor,
                    now,
                    &mut self.view,
                    self.config.metrics,
                );
                if changed {
                    self.status_dirty = true;
                }
            }
        }
        self.forward_membership();
        self.publish_if_due();
        if self.phase == HostPhase::ShuttingDown && self.driver.state().nodes.is_empty() {
            return Next::Stop(ShutdownOutcome::Clean);
        }
        Next::Continue
    }

    /// When the membership is next taken: `None` while nothing that could
    /// change it happened; at once for a new desired generation (its group
    /// sizes go into the boot orders of the nodes it creates), else
    /// [`MEMBERSHIP_INTERVAL`] after the last take.
    pub(super) fn membership_at(&self) -> Option<Instant> {
        if !self.driver.membership_pending() {
            return None;
        }
        let generation = self.driver.desired().generation();
        Some(match self.membership_taken_at {
            Some(at) if self.membership_generation == Some(generation) => at + MEMBERSHIP_INTERVAL,
            _ => Instant::now(),
        })
    }

    /// Hands a changed membership to the plugins (which push it to their
    /// agents) after the drive that folded the change, at most once per
    /// [`MEMBERSHIP_INTERVAL`]: each hand-out costs the whole list (every
    /// plugin encodes it, every agent receives it), so a bring-up that makes
    /// nodes ready in many drives sends a few lists a second, not one per
    /// drive.
    fn forward_membership(&mut self) {
        let Some(due) = self.membership_at() else {
            return;
        };
        let now = Instant::now();
        if now < due {
            return;
        }
        self.membership_taken_at = Some(now);
        self.membership_generation = Some(self.driver.desired().generation());
        let Some(membership) = self.driver.take_membership() else {
            return;
        };
        if let Some(executor) = &self.executor {
            executor.backend().membership_changed(&membership);
        }
        self.membership.send_replace(Some(membership));
    }

    fn fold_one_observation(&mut self, observation: &Observation) {
        let now = self.now();
        fold_observation(&mut self.driver, observation, now);
    }

    /// Before the first pass of a resumed run: every provider's listing
    /// against the journal (see [`DurableLoop::reconcile_listing`]).
    async fn reconcile_listing(&mut self) {
        let Some(adapter) = self.executor.as_ref().map(|e| e.backend().clone()) else {
            return;
        };
        let run = self.config.run_id.clone();
        let listing = list_all(&adapter, &run).await;
        let now = self.now();
        if let Some(durable) = self.durable.as_mut() {
            durable.reconcile_listing(&listing, &mut self.driver, &run, now);
        }
    }

    /// Starts a background listing of every provider to look for orphans.
    fn start_scan(&mut self) {
        let Some(adapter) = self.executor.as_ref().map(|e| e.backend().clone()) else {
            return;
        };
        if let Some(durable) = self.durable.as_mut() {
            durable.start_scan(adapter, self.config.run_id.clone());
        }
    }

    /// Hands a finished listing or orphan destroy to the durable side.
    fn on_orphan_report(&mut self, report: Option<OrphanReport>) {
        let Some(report) = report else {
            return;
        };
        self.status_dirty = true;
        let Some(adapter) = self.executor.as_ref().map(|e| e.backend().clone()) else {
            return;
        };
        if let Some(durable) = self.durable.as_mut() {
            durable.on_orphan_report(report, self.driver.state(), &adapter, &self.config.run_id);
        }
    }
}

async fn sleep_until_option(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
