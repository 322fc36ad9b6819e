//! [`HostHandle`], what callers hold: it sends commands to the host loop
//! over a bounded channel, asks for shutdown over a watch channel and reads
//! published snapshots and the final [`ShutdownReport`]. Also what its calls
//! answer ([`AppliedRevision`], [`ShutdownOutcome`]).

use std::fmt;
use std::sync::Arc;

use provisioning::{ClusterShape, DesiredUpdate, Generation, Membership, NodeGroup, RunId};
use tokio::sync::{mpsc, oneshot, watch};

use super::error::HostError;
use crate::plan::PlanReport;
use crate::status::StatusSnapshot;

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
pub(super) enum ShutdownRequest {
    None,
    Graceful,
    Force,
}

pub(super) enum Command {
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
/// When every handle (including the one inside [`Host`](super::Host)) is dropped, the
/// host shuts down gracefully on its own.
#[derive(Clone)]
pub struct HostHandle {
    commands: mpsc::Sender<Command>,
    shutdown: Arc<watch::Sender<ShutdownRequest>>,
    progress: watch::Receiver<StatusSnapshot>,
    membership: watch::Receiver<Option<Arc<Membership>>>,
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
    /// A handle over the host loop's channels (see `build`).
    pub(super) fn new(
        commands: mpsc::Sender<Command>,
        shutdown: watch::Sender<ShutdownRequest>,
        progress: watch::Receiver<StatusSnapshot>,
        membership: watch::Receiver<Option<Arc<Membership>>>,
        finished: watch::Receiver<Option<ShutdownReport>>,
        run_id: RunId,
        kinds: Arc<[String]>,
    ) -> Self {
        HostHandle {
            commands,
            shutdown: Arc::new(shutdown),
            progress,
            membership,
            finished,
            run_id,
            kinds,
        }
    }

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
    /// [`DriverError::RunChanged`](provisioning::DriverError::RunChanged).
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
    /// [`DriverError::RunChanged`](provisioning::DriverError::RunChanged)
    /// for another run, [`HostError::Stopped`].
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
    /// something, at most once per [`publish_interval`](super::publish_interval); a
    /// change is never held back longer than
    /// [`PUBLISH_INTERVAL_MAX`](super::PUBLISH_INTERVAL_MAX)), for live
    /// displays.
    /// [`HostHandle::status`] answers with a fresh one instead.
    ///
    /// # Caveats
    /// A borrowed snapshot (`borrow()`, or the guard `wait_for` returns) holds
    /// the channel's lock: the host waits for it at its next publish. Clone
    /// what you need and drop the guard before awaiting anything else.
    pub fn subscribe(&self) -> watch::Receiver<StatusSnapshot> {
        self.progress.clone()
    }

    /// The run's membership as the loop last handed it to the plugins
    /// (design §22): its ready nodes and every group's desired size;
    /// `None` before the first drive.
    pub fn membership(&self) -> Option<Arc<Membership>> {
        self.membership.borrow().clone()
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
