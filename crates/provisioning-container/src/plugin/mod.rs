//! [`ContainerPlugin`]: nodes that are containers on a Docker Engine API.
//!
//! The plugin's parts: this module (the type, its construction, what it
//! shares with its background tasks, the loss watch), `exec` (scripts and
//! the agent run inside a container) and `seam` (the `ProvisionPlugin`
//! methods).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use bollard::Docker;
use bollard::models::ContainerSummary;
use bollard::query_parameters::ListContainersOptions;
use provisioning::observe::{BootstrapEvent, LossCause, WorkloadEnd};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{LeaseHandle, LogicalNodeId, NodeAttemptId, RunId};
use provisioning_agent::remote::{RemoteError, RemoteEvent, RemoteSwarm, RemoteSwarmConfig};
use provisioning_provider::{AttemptKey, ObservationSink, PluginError};

use crate::config::{ContainerPluginConfig, socket_path};
use crate::engine;

mod exec;
mod seam;

/// The provider kind this plugin serves.
pub const PROVIDER_KIND: &str = "container";

/// The label every container of this plugin carries (value
/// [`MANAGED_BY`]), so that listing never touches anyone else's.
pub const LABEL_MANAGED_BY: &str = "io.provisioning.managed-by";
/// The value of [`LABEL_MANAGED_BY`].
pub const MANAGED_BY: &str = "provisioning";
/// The label holding the run.
pub const LABEL_RUN: &str = "io.provisioning.run";
/// The label holding the node (slot).
pub const LABEL_NODE: &str = "io.provisioning.node";
/// The label holding the attempt number.
pub const LABEL_ATTEMPT: &str = "io.provisioning.attempt";

/// How long an adopted agent may take to re-join the swarm (on top of the
/// re-join grace) before its node counts as lost.
const ADOPTED_JOIN_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Starting the plugin failed; nothing was started.
#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    /// The swarm listener could not bind.
    #[error(transparent)]
    Swarm(#[from] RemoteError),
    /// The socket is not a `unix://` address or path.
    #[error("the container provider serves unix sockets only, not {0:?}")]
    Socket(String),
    /// The engine could not be reached.
    #[error("cannot reach the container engine at {socket}: {source}")]
    Engine {
        /// The socket.
        socket: String,
        /// The error.
        #[source]
        source: bollard::errors::Error,
    },
    /// Not called inside a tokio runtime.
    #[error("the container plugin must be started inside a tokio runtime")]
    NoRuntime,
    /// The listen address is neither an address of this machine nor the
    /// gateway of one of the engine's networks.
    #[error(
        "cannot bind the swarm listener on {address}: it is not an address of this machine, nor the gateway of one of the engine's networks ({gateways}); containers reach the controller at their network's gateway: set `listen` to that address (with the port you want), or listen on 0.0.0.0:PORT and set `advertise` to GATEWAY:PORT"
    )]
    ListenNotHere {
        /// The listen address.
        address: std::net::SocketAddr,
        /// The engine's networks and their gateways, as a list for people.
        gateways: String,
    },
}

/// Binds the plugin's swarm listener. A listen address this machine does
/// not have is bound anyway when it is the gateway of one of the engine's
/// networks: Podman makes a network's bridge (and gives the host its
/// gateway address) only when the network's first container starts, so
/// on a fresh Podman host the default network's `10.88.0.1` is not there
/// until the first node runs, and connections to it are accepted once it
/// is. Any other address that is not here is refused, naming the gateways.
async fn bind_swarm(
    config: RemoteSwarmConfig,
    docker: &Docker,
    events: &Weak<Shared>,
) -> Result<RemoteSwarm, ContainerError> {
    let on_event = |events: Weak<Shared>| {
        move |event| {
            if let Some(shared) = events.upgrade() {
                shared.on_swarm(event);
            }
        }
    };
    let address = config.listen;
    match RemoteSwarm::bind(config.clone(), on_event(events.clone())).await {
        Err(RemoteError::Bind { source, .. })
            if source.kind() == std::io::ErrorKind::AddrNotAvailable =>
        {
            let gateways = engine::gateways(docker).await;
            let Some((network, _)) = gateways.iter().find(|(_, ip)| *ip == address.ip()) else {
                let gateways = if gateways.is_empty() {
                    "the engine listed none".to_owned()
                } else {
                    gateways
                        .iter()
                        .map(|(network, ip)| format!("{network}: {ip}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                return Err(ContainerError::ListenNotHere { address, gateways });
            };
            tracing::info!(
                %address,
                %network,
                "the listen address is network {network}'s gateway, not on this machine yet (its bridge is made when its first container starts); listening on it anyway"
            );
            Ok(RemoteSwarm::bind_nonlocal(config, on_event(events.clone())).await?)
        }
        outcome => Ok(outcome?),
    }
}

/// A step of the plugin the fault hook can fault (see
/// [`ContainerPlugin::arm_fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultStep {
    /// The creating call of `create_node` (after the look for an existing
    /// container).
    Create,
    /// The stop and removal of `destroy_node`.
    Destroy,
}

/// How a faulted step fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultMode {
    /// The step's calls go to a socket nobody listens on: a real refused
    /// connection, before anything was sent (definite).
    Refused,
    /// The step runs on the engine, then its reply is thrown away
    /// (ambiguous).
    ReplyLost,
}

tokio::task_local! {
    /// Set for a call whose every engine request must meet a refusing
    /// socket (see [`with_refused_engine`]).
    static REFUSED_ENGINE: ();
}

/// A testing hook: runs `call` (plugin calls of this task) with every
/// engine request sent to a socket nobody listens on — a real refused
/// connection before anything was sent — while the plugin's background
/// tasks keep the real engine.
pub async fn with_refused_engine<F: std::future::Future>(call: F) -> F::Output {
    REFUSED_ENGINE.scope((), call).await
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A bootstrap session this instance started or adopted.
#[derive(Debug)]
struct Session {
    /// Bumped per start; a follower of an older start is void.
    serial: u64,
    /// The highest progress stage reported (see [`stage_rank`]).
    rank: u8,
    /// Whether the agent joined (or the session ended otherwise).
    settled: bool,
    /// Whether the agent's join was seen by this instance's swarm listener.
    joined: bool,
    /// Held for a controller that replaced the one this session reported
    /// to: nothing is reported until that controller's adopting start.
    quiet: bool,
}

fn stage_rank(stage: BootstrapProgress) -> u8 {
    match stage {
        BootstrapProgress::Created => 1,
        BootstrapProgress::Connecting => 2,
        BootstrapProgress::Connected => 3,
        BootstrapProgress::Streaming => 4,
        BootstrapProgress::BootChecking => 5,
        BootstrapProgress::AgentStarting => 6,
        BootstrapProgress::WaitingForJoin => 7,
    }
}

/// What the plugin and its background tasks share.
pub(crate) struct Shared {
    config: ContainerPluginConfig,
    docker: Docker,
    sink: Mutex<Option<ObservationSink>>,
    /// Live containers this instance created or adopted, by key, with
    /// their id: watched for containers that exit or go.
    known: Mutex<BTreeMap<AttemptKey, String>>,
    /// Keys a create was sent for: a container of theirs may exist.
    sent: Mutex<BTreeSet<AttemptKey>>,
    /// Keys whose container this instance created and started: no agent
    /// runs in it until this instance starts one (only a controller of the
    /// run, holding the run's secret, starts agents, and this one has not).
    fresh: Mutex<BTreeSet<AttemptKey>>,
    sessions: Mutex<BTreeMap<AttemptKey, Session>>,
    /// Agents of an earlier controller that re-joined before a start
    /// adopted them: the adopting start reports the join.
    rejoined: Mutex<BTreeSet<AttemptKey>>,
    serial: Mutex<u64>,
}

impl Shared {
    fn report(&self, key: &AttemptKey, event: BootstrapEvent) {
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.bootstrap(key, event);
        }
    }

    fn lost(&self, key: &AttemptKey, cause: LossCause) {
        tracing::info!(node = %key, %cause, "node lost");
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.lost(key, cause);
        }
    }

    fn next_serial(&self) -> u64 {
        let mut serial = lock(&self.serial);
        *serial += 1;
        *serial
    }

    /// Reports `stage` for session `serial` of `key` if it moves on.
    pub(crate) fn progress(&self, key: &AttemptKey, serial: u64, stage: BootstrapProgress) {
        let report = {
            let mut sessions = lock(&self.sessions);
            match sessions.get_mut(key) {
                Some(s)
                    if s.serial == serial
                        && !s.settled
                        && !s.quiet
                        && stage_rank(stage) > s.rank =>
                {
                    s.rank = stage_rank(stage);
                    true
                }
                _ => false,
            }
        };
        if report {
            self.report(key, BootstrapEvent::Progress(stage));
        }
    }

    /// Reports a failure of session `serial` unless it settled already.
    pub(crate) fn fail(
        &self,
        key: &AttemptKey,
        serial: u64,
        failure: BootstrapFailure,
        detail: String,
    ) {
        let report = {
            let mut sessions = lock(&self.sessions);
            match sessions.get_mut(key) {
                Some(s) if s.serial == serial && !s.settled => {
                    s.settled = true;
                    true
                }
                _ => false,
            }
        };
        if report {
            tracing::warn!(node = %key, ?failure, %detail, "bootstrap failed");
            self.report(key, BootstrapEvent::Failed { failure, detail });
        }
    }

    /// The agent of `key` joined (`again`: it had joined before, this
    /// controller or an earlier one). Reported once per session, and not
    /// while the session is quiet; a re-join before any start adopted the
    /// agent waits for that start.
    fn joined(&self, key: &AttemptKey, again: bool) {
        let report = {
            let mut sessions = lock(&self.sessions);
            match sessions.get_mut(key) {
                Some(s) if s.joined => None,
                Some(s) => {
                    s.joined = true;
                    s.settled = true;
                    if s.quiet {
                        None
                    } else {
                        let missing = s.rank < stage_rank(BootstrapProgress::WaitingForJoin);
                        s.rank = stage_rank(BootstrapProgress::WaitingForJoin);
                        Some(missing)
                    }
                }
                None => {
                    if again {
                        lock(&self.rejoined).insert(key.clone());
                    }
                    None
                }
            }
        };
        if let Some(waiting_missing) = report {
            // The stage lines and the join travel different roads; the
            // driver hears them in order.
            if waiting_missing {
                self.report(
                    key,
                    BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin),
                );
            }
            self.report(key, BootstrapEvent::Joined);
        }
    }

    fn on_swarm(&self, event: RemoteEvent) {
        match event {
            RemoteEvent::Joined(key) => self.joined(&key, false),
            RemoteEvent::Rejoined(key) => {
                // Re-earns the readiness of a node recovered as ready (an
                // adopted container's agent); changes nothing otherwise.
                if let Some(sink) = lock(&self.sink).as_ref() {
                    sink.rejoined(&key);
                }
                self.joined(&key, true);
            }
            RemoteEvent::Lost(key, cause) => {
                lock(&self.sessions).remove(&key);
                lock(&self.rejoined).remove(&key);
                self.lost(&key, cause);
            }
        }
    }

    fn watch(&self, key: &AttemptKey, id: &str) {
        if key.run_id == self.config.run_id {
            lock(&self.known).insert(key.clone(), id.to_owned());
        }
    }

    /// Every container of `run` this plugin made (any state).
    async fn containers_of(
        &self,
        docker: &Docker,
        run: &RunId,
    ) -> Result<Vec<ContainerSummary>, PluginError> {
        let filters = HashMap::from([(
            "label".to_owned(),
            vec![
                format!("{LABEL_MANAGED_BY}={MANAGED_BY}"),
                format!("{LABEL_RUN}={run}"),
            ],
        )]);
        let options = ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        };
        docker
            .list_containers(Some(options))
            .await
            .map_err(|e| engine::looking("listing the run's containers", &e))
    }

    /// One look for watched containers that exited or went.
    async fn check_losses(&self, swarm: &RemoteSwarm) -> Result<usize, PluginError> {
        let watched = lock(&self.known).clone();
        if watched.is_empty() {
            return Ok(0);
        }
        let present = self
            .containers_of(&self.docker, &self.config.run_id)
            .await?;
        let mut lost = 0;
        for (key, id) in watched {
            let row = present
                .iter()
                .find(|c| c.id.as_deref() == Some(id.as_str()));
            let state = row.and_then(|c| c.state).map(|s| s.to_string());
            let cause = match state.as_deref() {
                None => LossCause::LeaseGone,
                Some("exited" | "dead") => {
                    let code = self
                        .docker
                        .inspect_container(&id, None)
                        .await
                        .ok()
                        .and_then(|c| c.state)
                        .and_then(|s| s.exit_code);
                    match code.and_then(|c| i32::try_from(c).ok()) {
                        Some(code) => LossCause::WorkloadEnded(WorkloadEnd::Status(code)),
                        None => LossCause::LeaseGone,
                    }
                }
                Some(_) => continue,
            };
            // Still watched: not destroyed through this plugin meanwhile.
            if lock(&self.known).remove(&key).is_some() {
                tracing::warn!(node = %key, container = %id, state = state.as_deref().unwrap_or("removed"), "the node's container exited or went: node lost");
                swarm.forget(&key);
                lock(&self.sessions).remove(&key);
                self.lost(&key, cause);
                lost += 1;
            }
        }
        Ok(lost)
    }
}

/// A [`ProvisionPlugin`](provisioning_provider::ProvisionPlugin) whose nodes
/// are containers on a Docker Engine API (Docker, or Podman's
/// `podman system service`).
///
/// # How it works
/// - A node is a container named `prov.{run}.{node}.a{attempt}` and
///   labelled with [`LABEL_MANAGED_BY`], [`LABEL_RUN`], [`LABEL_NODE`] and
///   [`LABEL_ATTEMPT`], made from the group's `container` table
///   ([`GroupShape`](crate::GroupShape)). Its first process is a small
///   shell that holds the container and, when the container is stopped,
///   stops every other process with a grace. `create_node` first looks for
///   the key's container by its labels (adopting it; one that was created
///   but not started is started), then creates and starts it; the unique
///   name makes a second create of the key adopt instead. The lease is
///   `container:{id}`. The plugin never pulls: an image missing from the
///   engine is a definite failure.
/// - The endpoint is `container://{address}`, the container's address on
///   its network, once it runs.
/// - Bootstrap runs the node agent with the engine's `exec` in its remote
///   boot mode: its boot order, with the credential, goes on the exec's
///   standard input into a `0600` file; its stages come back on the exec's
///   output; it joins the plugin's [`RemoteSwarm`] over TCP. The agent is
///   the controller's executable bind-mounted read-only, or one in the
///   image ([`AgentSource`](crate::AgentSource)).
/// - `cancel_bootstrap` stops the agent inside the container;
///   `destroy_node` stops the container with the configured grace, then
///   removes it; absent is success.
/// - A watched container that exits is reported lost with its exit code
///   ([`LossCause::WorkloadEnded`]); one that is removed by someone else is
///   lost ([`LossCause::LeaseGone`]), by a background look every
///   `watch_interval`; a dropped agent connection is lost through the swarm.
///
/// # Errors
/// A call that never reached the engine (the socket absent or refusing) or
/// that the engine refused (an image or network that does not exist, a
/// bad request) is definite; one whose outcome is unknown (a time-out, a
/// connection that broke off, an engine error) is ambiguous.
pub struct ContainerPlugin {
    shared: Arc<Shared>,
    swarm: Arc<RemoteSwarm>,
    watch: tokio::task::AbortHandle,
    faults: Mutex<BTreeMap<FaultStep, FaultMode>>,
    /// A socket file nobody listens on, for [`FaultMode::Refused`].
    refusing: Mutex<Option<(scratch::Dir, Docker)>>,
}

/// A directory removed on drop, without a dependency for it.
mod scratch {
    use std::path::{Path, PathBuf};

    /// A directory this plugin made; removed with everything in it on drop.
    pub(crate) struct Dir(pub(crate) PathBuf);

    impl Dir {
        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl fmt::Debug for ContainerPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContainerPlugin")
            .field("run_id", &self.shared.config.run_id)
            .field("socket", &self.shared.config.socket)
            .field("swarm", &self.swarm.advertised())
            .finish_non_exhaustive()
    }
}

impl Drop for ContainerPlugin {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl ContainerPlugin {
    /// Connects to the engine, binds the swarm listener and starts the
    /// loss watch on the current tokio runtime.
    ///
    /// # Errors
    /// When the socket is not a unix socket, the engine does not answer,
    /// or the listener cannot bind.
    pub async fn start(config: ContainerPluginConfig) -> Result<Self, ContainerError> {
        tokio::runtime::Handle::try_current().map_err(|_| ContainerError::NoRuntime)?;
        let path = socket_path(&config.socket)
            .ok_or_else(|| ContainerError::Socket(config.socket.clone()))?;
        let docker = engine::connect(&path, config.call_timeout)
            .await
            .map_err(|source| ContainerError::Engine {
                socket: config.socket.clone(),
                source,
            })?;
        let swarm_config = RemoteSwarmConfig {
            run_id: config.run_id.clone(),
            secret: config.secret.clone(),
            listen: config.listen,
            advertised: config.advertise,
            rejoin_grace: config.rejoin_grace,
        };
        let interval = config.watch_interval;
        let shared = Arc::new(Shared {
            config,
            docker,
            sink: Mutex::new(None),
            known: Mutex::new(BTreeMap::new()),
            sent: Mutex::new(BTreeSet::new()),
            fresh: Mutex::new(BTreeSet::new()),
            sessions: Mutex::new(BTreeMap::new()),
            rejoined: Mutex::new(BTreeSet::new()),
            serial: Mutex::new(0),
        });
        let events = Arc::downgrade(&shared);
        let swarm = Arc::new(bind_swarm(swarm_config, &shared.docker, &events).await?);
        let watch = tokio::spawn(watch_loop(
            Arc::downgrade(&shared),
            Arc::downgrade(&swarm),
            interval,
        ))
        .abort_handle();
        tracing::info!(
            run = %shared.config.run_id,
            socket = %shared.config.socket,
            swarm = %swarm.advertised(),
            "container plugin started"
        );
        Ok(ContainerPlugin {
            shared,
            swarm,
            watch,
            faults: Mutex::new(BTreeMap::new()),
            refusing: Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ContainerPluginConfig {
        &self.shared.config
    }

    /// The address agents dial.
    pub fn swarm_address(&self) -> std::net::SocketAddr {
        self.swarm.advertised()
    }

    /// The controller this plugin reports to was replaced in-process by one
    /// recovered from its journal, while the plugin, the containers and
    /// their agents live on. Every session goes quiet until the new
    /// controller's adopting `start_bootstrap`, which reports the join if
    /// the agent joined meanwhile. Returns how many sessions went quiet.
    pub fn controller_replaced(&self) -> usize {
        let mut sessions = lock(&self.shared.sessions);
        for session in sessions.values_mut() {
            session.quiet = true;
        }
        sessions.len()
    }

    /// Looks once for watched containers that exited or went and reports
    /// each lost; returns how many. (The background watch does this every
    /// `watch_interval`.)
    ///
    /// # Errors
    /// When the engine cannot be asked; nothing is reported then.
    pub async fn check_losses(&self) -> Result<usize, PluginError> {
        self.shared.check_losses(&self.swarm).await
    }

    /// A testing hook: makes the next `step` fail the way `mode` says, with
    /// a real refused connection or a reply really thrown away.
    pub fn arm_fault(&self, step: FaultStep, mode: FaultMode) {
        lock(&self.faults).insert(step, mode);
    }

    fn take_fault(&self, step: FaultStep) -> Option<FaultMode> {
        lock(&self.faults).remove(&step)
    }

    /// The engine client for a call: the refusing one inside
    /// [`with_refused_engine`], else the real one.
    fn engine(&self) -> Result<Docker, PluginError> {
        if REFUSED_ENGINE.try_with(|_| ()).is_ok() {
            self.refusing_client()
        } else {
            Ok(self.shared.docker.clone())
        }
    }

    /// A client on a socket file nobody listens on.
    fn refusing_client(&self) -> Result<Docker, PluginError> {
        let mut refusing = lock(&self.refusing);
        if let Some((_, client)) = refusing.as_ref() {
            return Ok(client.clone());
        }
        let dir = std::env::temp_dir().join(format!(
            "provision-refusing-{}-{}",
            std::process::id(),
            self.shared.next_serial()
        ));
        let made = std::fs::create_dir_all(&dir).and_then(|()| {
            let socket = dir.join("engine.sock");
            // Bound and closed at once: connecting is refused.
            drop(std::os::unix::net::UnixListener::bind(&socket)?);
            Ok(socket)
        });
        let dir = scratch::Dir(dir);
        let socket: PathBuf = made
            .map_err(|e| PluginError::definite(format!("cannot make the refusing socket: {e}")))?;
        let client = engine::unconnected(&socket, self.shared.config.call_timeout)
            .map_err(|e| PluginError::definite(format!("cannot make the refusing client: {e}")))?;
        debug_assert!(socket.starts_with(dir.path()));
        *refusing = Some((dir, client.clone()));
        Ok(client)
    }
}

/// The container name of `key`; `None` when run or node would not make a
/// name the engine accepts.
pub fn container_name(key: &AttemptKey) -> Option<String> {
    let node = key.node.to_string();
    (is_safe_name(key.run_id.as_str()) && is_safe_name(&node))
        .then(|| format!("prov.{}.{node}.a{}", key.run_id, key.attempt.get()))
}

fn is_safe_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The key a container's labels name, if it is one of `run`'s.
fn key_of(run: &RunId, labels: Option<&HashMap<String, String>>) -> Option<AttemptKey> {
    let labels = labels?;
    if labels.get(LABEL_MANAGED_BY).map(String::as_str) != Some(MANAGED_BY)
        || labels.get(LABEL_RUN).map(String::as_str) != Some(run.as_str())
    {
        return None;
    }
    let node = LogicalNodeId::parse(labels.get(LABEL_NODE)?).ok()?;
    let attempt = labels.get(LABEL_ATTEMPT)?.parse::<u64>().ok()?;
    Some(AttemptKey {
        run_id: run.clone(),
        node,
        attempt: NodeAttemptId::from_raw(attempt),
    })
}

fn lease_of(id: &str) -> LeaseHandle {
    LeaseHandle(format!("container:{id}"))
}

async fn watch_loop(shared: Weak<Shared>, swarm: Weak<RemoteSwarm>, interval: std::time::Duration) {
    // Bounded by the plugin's life: it ends when the plugin is dropped.
    loop {
        tokio::time::sleep(interval).await;
        let (Some(shared), Some(swarm)) = (shared.upgrade(), swarm.upgrade()) else {
            return;
        };
        if let Err(error) = shared.check_losses(&swarm).await {
            tracing::debug!(%error, "loss check incomplete");
        }
    }
}
