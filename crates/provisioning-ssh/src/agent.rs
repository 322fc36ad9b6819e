//! The node agent the plugin starts on its hosts, the swarm it joins, and
//! what the plugin reports about each agent.
//!
//! The plugin owns a [`RemoteSwarm`] (the controller's TCP listener). Before
//! it starts a key's agent it `expect`s the key; the agent joins with the
//! per-attempt credential of its boot order. The listener's events become
//! the observations the process plugin reports about its own agents:
//! `Joined` for a first join (only once the bootstrap's stages were
//! reported, so a join never precedes its `WaitingForJoin`), nothing for a
//! re-join, and a node loss (`LossCause`) for a loss.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning_agent::RunSecret;
use provisioning_agent::remote::{DEFAULT_REJOIN_GRACE, RemoteError, RemoteEvent};
use provisioning_provider::{AttemptKey, ObservationSink};
use thiserror::Error;

use crate::config::ConfigErrors;

/// How long a freshly started agent may take to join the swarm before its
/// bootstrap fails.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long, beyond the re-join grace, the agent of a node adopted after a
/// controller restart may take to re-join before its node is lost.
pub const DEFAULT_ADOPT_WAIT: Duration = Duration::from_secs(20);

/// The node agent of an [`SshPlugin`](crate::SshPlugin) and the swarm
/// listener its agents join.
#[derive(Clone, Debug)]
pub struct SshAgentConfig {
    /// The local agent executable, uploaded to every host once per content
    /// hash (for `provision`, the `provision-agent` binary shipped next to
    /// it, or the running binary itself). It must run on
    /// the hosts: same architecture and C library.
    pub program: PathBuf,
    /// Its leading arguments (`["agent"]` for the `provision` binary; none
    /// for `provision-agent`).
    pub args: Vec<String>,
    /// The run's secret: join credentials derive from it. A restarted
    /// controller must use the same secret to get its agents back.
    pub secret: RunSecret,
    /// The address the swarm listener binds. A fixed port lets a restarted
    /// controller be found by the agents it left running.
    pub listen: SocketAddr,
    /// The address agents dial, when it differs from `listen` (a wildcard
    /// listen address, NAT). A port of 0 means the bound port.
    pub advertised: Option<SocketAddr>,
    /// How long a started agent may take to join before its bootstrap fails
    /// ([`DEFAULT_JOIN_TIMEOUT`]).
    pub join_timeout: Duration,
    /// How long, beyond `rejoin_grace`, the agent of a node found after a
    /// restart may take to re-join before the node is lost
    /// ([`DEFAULT_ADOPT_WAIT`]).
    pub adopt_wait: Duration,
    /// How long a dropped agent may take to re-join before its node is lost.
    pub rejoin_grace: Duration,
    /// How long an agent that lost the swarm re-dials before it stops its
    /// node; `None` keeps the agent's default (60 s).
    pub rejoin_window: Option<Duration>,
}

impl SshAgentConfig {
    /// A configuration with the default timeouts, advertising the listen
    /// address.
    pub fn new(
        program: impl Into<PathBuf>,
        args: Vec<String>,
        secret: RunSecret,
        listen: SocketAddr,
    ) -> Self {
        SshAgentConfig {
            program: program.into(),
            args,
            secret,
            listen,
            advertised: None,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            adopt_wait: DEFAULT_ADOPT_WAIT,
            rejoin_grace: DEFAULT_REJOIN_GRACE,
            rejoin_window: None,
        }
    }
}

/// [`SshPlugin::start`](crate::SshPlugin::start) failed; nothing was started.
#[derive(Debug, Error)]
pub enum SshStartError {
    /// The inventory is invalid.
    #[error(transparent)]
    Config(#[from] ConfigErrors),
    /// The agent executable cannot be read.
    #[error("cannot read the agent executable {}: {source}", path.display())]
    Agent {
        /// The executable.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The swarm listener could not be bound.
    #[error(transparent)]
    Swarm(#[from] RemoteError),
    /// Not called inside a tokio runtime.
    #[error("the ssh plugin must be started inside a tokio runtime")]
    NoRuntime,
}

/// What the plugin knows about the agent of one key.
#[derive(Debug, Default)]
pub(crate) struct AgentState {
    /// A `start_bootstrap` of this instance reported the bootstrap's stages:
    /// a join may be reported now.
    pub(crate) announced: bool,
    /// The agent joined (or re-joined) and was not lost since.
    pub(crate) joined: bool,
    /// `Joined` was reported for the key.
    pub(crate) join_reported: bool,
    /// The task that fails the bootstrap if the agent never joins.
    pub(crate) watchdog: Option<tokio::task::AbortHandle>,
}

/// What the plugin shares with its swarm listener's callback.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    sink: Mutex<Option<ObservationSink>>,
    agents: Mutex<BTreeMap<AttemptKey, AgentState>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub(crate) fn attach(&self, sink: ObservationSink) {
        *lock(&self.sink) = Some(sink);
    }

    pub(crate) fn agents(&self) -> MutexGuard<'_, BTreeMap<AttemptKey, AgentState>> {
        lock(&self.agents)
    }

    pub(crate) fn report(&self, key: &AttemptKey, event: BootstrapEvent) {
        tracing::debug!(node = %key, ?event, "bootstrap event");
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.bootstrap(key, event);
        }
    }

    pub(crate) fn report_rejoined(&self, key: &AttemptKey) {
        tracing::debug!(node = %key, "agent re-joined");
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.rejoined(key);
        }
    }

    pub(crate) fn report_lost(&self, key: &AttemptKey, cause: LossCause) {
        tracing::info!(node = %key, %cause, "node lost");
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.lost(key, cause);
        }
    }

    /// Marks the bootstrap of `key` announced (its stages are reported) and
    /// reports the join if the agent joined already.
    pub(crate) fn announce(&self, key: &AttemptKey) {
        let join_now = {
            let mut agents = self.agents();
            let state = agents.entry(key.clone()).or_default();
            state.announced = true;
            let join_now = state.joined && !state.join_reported;
            state.join_reported |= join_now;
            join_now
        };
        if join_now {
            self.report(key, BootstrapEvent::Joined);
        }
    }

    /// A new controller replaced the one the facts so far were reported to:
    /// no bootstrap is announced any more, so nothing of an agent (its join
    /// included) is reported until that controller's adopting start
    /// announces it again. Returns how many agents were known.
    pub(crate) fn controller_replaced(&self) -> usize {
        let mut agents = self.agents();
        for state in agents.values_mut() {
            state.announced = false;
            state.join_reported = false;
        }
        agents.len()
    }

    /// Forgets everything about `key` and stops its watchdog.
    pub(crate) fn forget(&self, key: &AttemptKey) {
        if let Some(state) = self.agents().remove(key)
            && let Some(watchdog) = state.watchdog
        {
            watchdog.abort();
        }
    }

    /// Whether the agent of `key` is joined.
    pub(crate) fn is_joined(&self, key: &AttemptKey) -> bool {
        self.agents().get(key).is_some_and(|state| state.joined)
    }

    /// The swarm listener's callback.
    pub(crate) fn on_event(&self, event: RemoteEvent) {
        let rejoin = matches!(event, RemoteEvent::Rejoined(_));
        match event {
            RemoteEvent::Joined(key) | RemoteEvent::Rejoined(key) => {
                if rejoin {
                    // An adopted agent re-joined a restarted controller (or
                    // a dropped one came back): that re-earns the readiness
                    // of a node recovered as ready; otherwise it changes
                    // nothing.
                    self.report_rejoined(&key);
                }
                let join_now = {
                    let mut agents = self.agents();
                    let state = agents.entry(key.clone()).or_default();
                    state.joined = true;
                    let join_now = state.announced && !state.join_reported;
                    state.join_reported |= join_now;
                    join_now
                };
                if join_now {
                    self.report(&key, BootstrapEvent::Joined);
                }
            }
            RemoteEvent::Lost(key, cause) => {
                self.forget(&key);
                self.report_lost(&key, cause);
            }
        }
    }

    /// Stops every watchdog.
    pub(crate) fn close(&self) {
        for state in self.agents().values_mut() {
            if let Some(watchdog) = state.watchdog.take() {
                watchdog.abort();
            }
        }
    }
}
