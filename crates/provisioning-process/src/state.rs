//! The plugin's bookkeeping, shared by its calls and its background tasks.
//!
//! One table maps each attempt key to its agent process and bootstrap
//! session. It sits behind a plain mutex that is never held across an
//! `.await`; every state change happens under it, and facts are reported to
//! the sink only after it is released.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use provisioning::effect::SessionHandle;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::BootstrapFailure;
use provisioning::{LeaseHandle, RunId};
use provisioning_provider::{AttemptKey, ObservationSink};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use crate::plugin::{AgentCommand, AgentLifetime, ProcessPluginConfig};
use crate::scan::ProcScanner;
use crate::session::{Handshake, SessionCommand};
use provisioning_agent::credential::RunSecret;
use provisioning_agent::peers::PeersFeed;

use crate::addresses::SlotAddresses;

/// Whether a node's agent process runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Life {
    /// Running, as far as the plugin knows.
    Running,
    /// A destroy (or shutdown) is taking it down; its exit is expected.
    Destroying,
    /// The agent exited and was reaped.
    Exited,
}

/// Where a bootstrap session stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SessionState {
    /// Connecting to the agent and handing over the boot order.
    Handshaking,
    /// The agent took the order and runs boot checks and the workload.
    Booting,
    /// The agent may join now; the swarm listener accepts its credential.
    AwaitingJoin,
    /// The agent joined the swarm.
    Joined,
    /// Closed after the join (the handoff).
    Closed,
    /// The boot failed; the failure was reported.
    Failed,
    /// Cancelled by cleanup.
    Cancelled,
}

impl SessionState {
    /// Whether nothing more will be reported for the session.
    pub(crate) fn is_over(self) -> bool {
        matches!(
            self,
            SessionState::Closed | SessionState::Failed | SessionState::Cancelled
        )
    }
}

/// The plugin's record of one bootstrap session.
pub(crate) struct SessionRecord {
    /// Distinguishes sessions of one key over time.
    pub(crate) serial: u64,
    pub(crate) handle: SessionHandle,
    pub(crate) state: SessionState,
    /// The swarm the agent must name when it joins; `None` for a re-attach,
    /// where the agent joins with the swarm of its first boot.
    pub(crate) swarm: Option<String>,
    /// A re-attach the plugin started by itself when it adopted a detached
    /// agent: nothing of it is reported until a `start_bootstrap` adopts it.
    pub(crate) quiet: bool,
    pub(crate) handshake: watch::Receiver<Handshake>,
    pub(crate) commands: mpsc::Sender<SessionCommand>,
    pub(crate) task: AbortHandle,
}

/// The plugin's record of one node agent process.
pub(crate) struct NodeEntry {
    /// Distinguishes processes of one key over time (a dead one re-created).
    pub(crate) instance: u64,
    pub(crate) lease: LeaseHandle,
    /// The agent's pid, which is also its process group id.
    pub(crate) group: i32,
    pub(crate) endpoint: Option<SocketAddr>,
    /// Found in `/proc` (a detached agent of an earlier controller), not
    /// spawned: it is not this process's child, so its exit is polled and
    /// it is signalled by its tags only.
    pub(crate) adopted: bool,
    pub(crate) life: Life,
    pub(crate) exited: watch::Receiver<bool>,
    pub(crate) session: Option<SessionRecord>,
}

/// State shared by the plugin and its background tasks.
pub(crate) struct Shared {
    pub(crate) run_id: RunId,
    pub(crate) secret: RunSecret,
    pub(crate) agent: AgentCommand,
    pub(crate) stop_grace: Duration,
    pub(crate) lifetime: AgentLifetime,
    sink: Mutex<Option<ObservationSink>>,
    table: Mutex<BTreeMap<AttemptKey, NodeEntry>>,
    /// Set once shutdown or drop began: exits are expected, nothing is reported.
    closing: AtomicBool,
    /// Flipped to `true` to stop the swarm listener and its connections.
    pub(crate) shutdown: watch::Sender<bool>,
    serials: AtomicU64,
    /// Scans of `/proc` for the run's processes, shared by every caller.
    pub(crate) scanner: ProcScanner,
    /// The run's membership, pushed to every agent in the swarm.
    pub(crate) peers: PeersFeed,
    /// Every slot's loopback address.
    pub(crate) addresses: Mutex<SlotAddresses>,
}

impl Shared {
    pub(crate) fn new(config: ProcessPluginConfig) -> Self {
        let (shutdown, _) = watch::channel(false);
        Shared {
            scanner: ProcScanner::new(config.run_id.clone()),
            addresses: Mutex::new(SlotAddresses::new(&config.run_id)),
            run_id: config.run_id,
            secret: config.run_secret,
            agent: config.agent,
            stop_grace: config.stop_grace,
            lifetime: config.lifetime,
            sink: Mutex::new(None),
            table: Mutex::new(BTreeMap::new()),
            closing: AtomicBool::new(false),
            shutdown,
            serials: AtomicU64::new(1),
            peers: PeersFeed::new(),
        }
    }

    /// Replaces the sink facts are reported to.
    pub(crate) fn attach(&self, sink: ObservationSink) {
        *self.sink.lock().unwrap_or_else(PoisonError::into_inner) = Some(sink);
    }

    /// Marks the plugin as closing and stops the swarm listener: from now
    /// on exits are expected and nothing is reported.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let _ = self.shutdown.send(true);
    }

    pub(crate) fn table(&self) -> MutexGuard<'_, BTreeMap<AttemptKey, NodeEntry>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn next_serial(&self) -> u64 {
        self.serials.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether agents outlive this plugin.
    pub(crate) fn detached(&self) -> bool {
        matches!(self.lifetime, AgentLifetime::Detached { .. })
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    fn sink(&self) -> Option<ObservationSink> {
        self.sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Reports a bootstrap event, unless the plugin is closing or the
    /// key's session is a quiet re-attach.
    pub(crate) fn report(&self, key: &AttemptKey, event: BootstrapEvent) {
        if self.is_closing() {
            return;
        }
        let quiet = self
            .table()
            .get(key)
            .and_then(|entry| entry.session.as_ref())
            .is_some_and(|session| session.quiet);
        if quiet {
            tracing::debug!(node = %key, ?event, "re-attach event (not reported)");
            return;
        }
        tracing::debug!(node = %key, ?event, "bootstrap event");
        match self.sink() {
            Some(sink) => {
                sink.bootstrap(key, event);
            }
            None => tracing::debug!(node = %key, "no sink attached; event dropped"),
        }
    }

    /// Reports that the adopted agent of `key` re-joined this controller
    /// (quiet or not), unless the plugin is closing.
    pub(crate) fn report_rejoined(&self, key: &AttemptKey) {
        if self.is_closing() {
            return;
        }
        tracing::debug!(node = %key, "adopted agent re-joined");
        if let Some(sink) = self.sink() {
            sink.rejoined(key);
        }
    }

    /// Reports the loss of a node, unless the plugin is closing.
    pub(crate) fn report_lost(&self, key: &AttemptKey, cause: LossCause) {
        if self.is_closing() {
            return;
        }
        // Whoever saw the loss logged it in words already.
        tracing::debug!(node = %key, %cause, "reporting the node lost");
        if let Some(sink) = self.sink() {
            sink.lost(key, cause);
        }
    }

    /// Whether session `serial` of `key` is current and may still report.
    pub(crate) fn session_is_live(&self, key: &AttemptKey, serial: u64) -> bool {
        self.table()
            .get(key)
            .and_then(|entry| entry.session.as_ref())
            .is_some_and(|session| session.serial == serial && !session.state.is_over())
    }

    /// Moves session `serial` of `key` from `from` to `to`. Returns whether it did.
    pub(crate) fn advance_session(
        &self,
        key: &AttemptKey,
        serial: u64,
        from: &[SessionState],
        to: SessionState,
    ) -> bool {
        let mut table = self.table();
        let Some(session) = table
            .get_mut(key)
            .and_then(|entry| entry.session.as_mut())
            .filter(|session| session.serial == serial)
        else {
            return false;
        };
        if from.contains(&session.state) {
            session.state = to;
            true
        } else {
            false
        }
    }

    /// Removes session `serial` of `key`: it left nothing behind, so a retry
    /// may start afresh.
    pub(crate) fn forget_session(&self, key: &AttemptKey, serial: u64) {
        let mut table = self.table();
        if let Some(entry) = table.get_mut(key)
            && entry.session.as_ref().is_some_and(|s| s.serial == serial)
        {
            entry.session = None;
        }
    }

    /// Marks the session failed and reports it, unless it already ended or
    /// the agent joined (after the join, the swarm connection is what counts).
    pub(crate) fn fail_session(
        &self,
        key: &AttemptKey,
        serial: u64,
        failure: BootstrapFailure,
        detail: String,
    ) {
        let live = [
            SessionState::Handshaking,
            SessionState::Booting,
            SessionState::AwaitingJoin,
        ];
        if self.advance_session(key, serial, &live, SessionState::Failed) {
            tracing::warn!(node = %key, ?failure, %detail, "bootstrap failed");
            self.report(key, BootstrapEvent::Failed { failure, detail });
        } else {
            tracing::debug!(node = %key, ?failure, %detail, "session already settled");
        }
    }

    /// Whether the agent of `key` runs and is not being destroyed.
    pub(crate) fn is_running(&self, key: &AttemptKey) -> bool {
        self.table()
            .get(key)
            .is_some_and(|entry| entry.life == Life::Running)
    }
}
