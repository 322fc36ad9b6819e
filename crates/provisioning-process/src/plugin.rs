//! [`ProcessPlugin`]: leases that are local node agent processes.

use std::ffi::OsString;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use provisioning::effect::SessionHandle;
use provisioning::observe::BootstrapEvent;
use provisioning::state::BootstrapProgress;
use provisioning::{Endpoint, EndpointLookup, LeaseHandle, LogicalNodeSpec, RunId};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use crate::node;
use crate::session::{self, Handshake, SessionCommand, SessionSetup};
use crate::spawner::Spawner;
use crate::state::{Life, NodeEntry, SessionRecord, SessionState, Shared};
use crate::swarm;
use provisioning_agent::agent::env as agent_env;
use provisioning_agent::credential::RunSecret;
use provisioning_agent::os;
use provisioning_agent::wire::{BootOrder, JoinOrder, PROTOCOL_VERSION};

/// The provider kind this plugin serves.
pub const PROVIDER_KIND: &str = "process";

/// The default grace between `SIGTERM` and `SIGKILL` when a node is destroyed.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(2);

/// How long a reconciler serving this plugin should wait before probing
/// again for an endpoint that was not ready.
///
/// An agent announces its port a few milliseconds after it was spawned, and
/// a probe is a table lookup in this process. The core's default interval
/// (one second, sized for remote providers whose probes are API calls)
/// would make every local node idle for most of a second after its create.
pub const ENDPOINT_PROBE_INTERVAL: Duration = Duration::from_millis(20);

/// How long `start_bootstrap` waits for the agent to take the boot order.
/// Past it the call is ambiguous; the session goes on and a retry adopts it.
const HANDSHAKE_WAIT_MAX: Duration = Duration::from_secs(10);

/// Starting the plugin failed.
#[derive(Debug, Error)]
pub enum ProcessError {
    /// [`ProcessPlugin::start`] was called outside a tokio runtime.
    #[error("the process plugin must be started inside a tokio runtime")]
    NoRuntime,
    /// The swarm listener could not be bound on loopback.
    #[error("cannot listen for swarm joins on 127.0.0.1: {0}")]
    Listen(#[source] std::io::Error),
    /// The thread that starts agents could not be created.
    #[error("cannot start the agent spawner thread: {0}")]
    SpawnerThread(#[source] std::io::Error),
    /// The log directory of detached agents could not be created.
    #[error("cannot create the agent log directory {}: {source}", path.display())]
    LogDir {
        /// The directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// How to start a node agent: a program and its leading arguments.
///
/// The command must end up in [`provisioning_agent::agent::main`]; for example the
/// `provision` binary with `["agent"]`, or `provision-node-agent` with no
/// arguments. The plugin adds no arguments of its own: it configures the
/// agent through the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentCommand {
    /// The executable.
    pub program: PathBuf,
    /// Arguments placed before anything else.
    pub args: Vec<OsString>,
}

impl AgentCommand {
    /// The command `program args…`.
    pub fn new(program: impl Into<PathBuf>, args: impl IntoIterator<Item = OsString>) -> Self {
        AgentCommand {
            program: program.into(),
            args: args.into_iter().collect(),
        }
    }

    /// The form passed to the agent so that it can start its helpers with
    /// the same command: each part hex-encoded, separated by commas.
    pub(crate) fn encode(&self) -> String {
        std::iter::once(self.program.as_os_str())
            .chain(self.args.iter().map(OsString::as_os_str))
            .map(|part| hex::encode(part.as_bytes()))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Whether node agents live and die with the controller.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AgentLifetime {
    /// The default: every agent (and its workload) dies with the process
    /// that runs the plugin. Agents arm a parent-death signal, their output
    /// is relayed to this process's log, and dropping or shutting down the
    /// plugin kills every node it started. A restarted controller finds
    /// nothing and replaces every node.
    #[default]
    WithController,
    /// Agents outlive the controller, so a forced stop or a crash (even
    /// `kill -9`) keeps the fleet running and a restarted controller with
    /// the same run and [`RunSecret`] adopts it:
    ///
    /// - each agent starts a session (and process group) of its own and
    ///   arms no parent-death signal; its standard input is `/dev/null`, and
    ///   its standard error — with its workload's output — goes to
    ///   `{log_dir}/{node}-a{attempt}.log` (created `0600`, the directory
    ///   `0700`), or to `/dev/null` when `log_dir` is `None`. Its standard
    ///   output carries only the endpoint announcement, which a restarted
    ///   controller does not need: it reads the endpoint from `/proc`;
    /// - the plugin finds the agents of its run in `/proc` by their tags:
    ///   [`list_nodes`](ProvisionPlugin::list_nodes) lists them,
    ///   `create_node` of a key whose agent lives adopts it, and every other
    ///   call adopts it on first use. An adopted agent whose workload runs is
    ///   re-attached at once: the plugin connects to its loopback endpoint
    ///   and hands it this plugin's swarm address over that connection; the
    ///   agent re-joins with its per-attempt credential (never on a command
    ///   line or in a log). Nothing of that re-attach is reported until a
    ///   `start_bootstrap` of the key adopts it (`adopted: true`, workload
    ///   untouched); then its join is reported and the usual close follows;
    /// - [`ProcessPlugin::shutdown`] and dropping the plugin leave every
    ///   agent running (they only stop this process's side). A clean
    ///   teardown destroys every node through the driver first, so nothing
    ///   is left; after a crash or a forced stop, a restarted controller
    ///   adopts the agents (or destroys them as orphans).
    Detached {
        /// Where each agent's log goes; `None` discards it.
        log_dir: Option<PathBuf>,
    },
}

/// The configuration of one [`ProcessPlugin`], which serves one run.
#[derive(Clone, Debug)]
pub struct ProcessPluginConfig {
    /// The run every node of this plugin belongs to.
    pub run_id: RunId,
    /// How to start a node agent.
    pub agent: AgentCommand,
    /// The run's secret; node credentials derive from it.
    pub run_secret: RunSecret,
    /// The grace between `SIGTERM` and `SIGKILL` when a node is destroyed.
    pub stop_grace: Duration,
    /// Whether agents die with the controller (the default) or outlive it.
    pub lifetime: AgentLifetime,
}

impl ProcessPluginConfig {
    /// A configuration with a fresh secret, [`DEFAULT_STOP_GRACE`] and
    /// agents that die with the controller.
    ///
    /// # Panics
    /// As [`RunSecret::generate`].
    pub fn new(run_id: RunId, agent: AgentCommand) -> Self {
        ProcessPluginConfig {
            run_id,
            agent,
            run_secret: RunSecret::generate(),
            stop_grace: DEFAULT_STOP_GRACE,
            lifetime: AgentLifetime::default(),
        }
    }
}

/// A [`ProvisionPlugin`] whose nodes are local agent processes.
///
/// Create it with [`ProcessPlugin::start`] inside a tokio runtime (with the
/// I/O, time and signal drivers enabled). Stop it with
/// [`ProcessPlugin::shutdown`]; dropping it also kills every node it started.
pub struct ProcessPlugin {
    shared: Arc<Shared>,
    spawner: Spawner,
    swarm_address: SocketAddr,
    listener_task: AbortHandle,
    /// Serialises creates, so that two creates of one key cannot both spawn.
    create_lock: tokio::sync::Mutex<()>,
}

impl fmt::Debug for ProcessPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessPlugin")
            .field("run_id", &self.shared.run_id)
            .field("swarm_address", &self.swarm_address)
            .field("nodes", &self.shared.table().len())
            .finish_non_exhaustive()
    }
}

impl ProcessPlugin {
    /// Starts the plugin: binds the swarm listener on `127.0.0.1:0` and the
    /// thread that spawns agents.
    ///
    /// # Errors
    /// [`ProcessError`] when not inside a tokio runtime, or when the listener,
    /// the spawner thread or a detached agents' log directory cannot be
    /// created.
    pub async fn start(config: ProcessPluginConfig) -> Result<Arc<ProcessPlugin>, ProcessError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ProcessError::NoRuntime)?;
        if let AgentLifetime::Detached {
            log_dir: Some(path),
        } = &config.lifetime
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(|source| ProcessError::LogDir {
                    path: path.clone(),
                    source,
                })?;
        }
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(ProcessError::Listen)?;
        let swarm_address = listener.local_addr().map_err(ProcessError::Listen)?;
        let spawner = Spawner::start(runtime).map_err(ProcessError::SpawnerThread)?;
        let shared = Arc::new(Shared::new(config));
        let listener_task =
            tokio::spawn(swarm::accept_loop(shared.clone(), listener)).abort_handle();
        tracing::info!(run = %shared.run_id, %swarm_address, "process plugin started");
        Ok(Arc::new(ProcessPlugin {
            shared,
            spawner,
            swarm_address,
            listener_task,
            create_lock: tokio::sync::Mutex::new(()),
        }))
    }

    /// The loopback address agents join the swarm on.
    pub fn swarm_address(&self) -> SocketAddr {
        self.swarm_address
    }

    /// The run this plugin serves.
    pub fn run_id(&self) -> &RunId {
        &self.shared.run_id
    }

    /// The controller this plugin reports to was replaced in-process by one
    /// recovered from its journal, while the plugin and its agents live on.
    /// Every live session goes quiet, exactly as if a restarted plugin had
    /// adopted its agent from `/proc`: nothing of it is reported until the
    /// new controller's adopting `start_bootstrap` re-attaches it, and what
    /// it did meanwhile (waiting for its join, joined) is reported then.
    /// Returns how many sessions went quiet.
    pub fn controller_replaced(&self) -> usize {
        let mut table = self.shared.table();
        let mut quieted = 0;
        for entry in table.values_mut() {
            if let Some(session) = entry.session.as_mut()
                && !session.state.is_over()
            {
                session.quiet = true;
                quieted += 1;
            }
        }
        drop(table);
        tracing::info!(
            run = %self.shared.run_id,
            sessions = quieted,
            "controller replaced; live sessions wait for its adopting starts"
        );
        quieted
    }

    /// Terminates every node process group the plugin started and stops the
    /// swarm listener. Idempotent; later creates fail.
    ///
    /// With [`AgentLifetime::Detached`] agents, only the plugin's side stops
    /// (the listener and the control connections): every agent runs on, for
    /// a restarted controller to adopt. This is what a forced stop of
    /// `provision up` calls; a clean teardown has destroyed every node
    /// through the driver before.
    ///
    /// # Guarantees
    /// Bounded: `SIGTERM` to every group, `SIGKILL` after the stop grace,
    /// then a bounded wait for the groups to disappear. Nothing is reported
    /// to the sink from the moment shutdown begins.
    pub async fn shutdown(&self) {
        self.shared.close();
        self.listener_task.abort();
        if self.shared.detached() {
            let _no_create_in_flight = self.create_lock.lock().await;
            let mut table = self.shared.table();
            for entry in table.values_mut() {
                if let Some(session) = &entry.session {
                    session.task.abort();
                }
            }
            tracing::info!(
                run = %self.shared.run_id,
                nodes = table.len(),
                "process plugin stopped; detached node agents keep running"
            );
            return;
        }
        let keys: Vec<AttemptKey> = {
            // A create that is spawning right now finishes first, so that its
            // node is in the table and stopped with the others.
            let _no_create_in_flight = self.create_lock.lock().await;
            self.shared.table().keys().cloned().collect()
        };
        let mut stops = tokio::task::JoinSet::new();
        for key in keys {
            let shared = self.shared.clone();
            stops.spawn(async move {
                if let Err(error) = node::stop_node(&shared, &key).await {
                    tracing::warn!(node = %key, %error, "node did not stop cleanly at shutdown");
                }
            });
        }
        while stops.join_next().await.is_some() {}
        // Every node of the run on this machine is stopped: what is left of
        // their peers files (an agent killed before it removed its own) goes.
        let peers = provisioning_agent::agent::rendezvous::peers_dir(self.shared.run_id.as_str());
        if let Err(error) = std::fs::remove_dir_all(&peers)
            && error.kind() != std::io::ErrorKind::NotFound
        {
            tracing::debug!(dir = %peers.display(), %error, "cannot remove the run's peers files");
        }
    }

    fn check_run(&self, key: &AttemptKey) -> Result<(), PluginError> {
        if key.run_id != self.shared.run_id {
            return Err(PluginError::definite(format!(
                "this process plugin serves run {}, not {}",
                self.shared.run_id, key.run_id
            )));
        }
        if self.shared.is_closing() {
            return Err(PluginError::definite("the process plugin is shut down"));
        }
        Ok(())
    }

    fn agent_command(&self, key: &AttemptKey) -> Result<std::process::Command, PluginError> {
        let shared = &self.shared;
        let mut command = std::process::Command::new(&shared.agent.program);
        command
            .args(&shared.agent.args)
            .env_remove(agent_env::ROLE)
            .env(os::RUN_TAG, key.run_id.as_str())
            .env(os::NODE_TAG, key.node.to_string())
            .env(os::ATTEMPT_TAG, key.attempt.get().to_string())
            .env(
                agent_env::STOP_GRACE_MS,
                shared.stop_grace.as_millis().to_string(),
            )
            .env(agent_env::COMMAND, shared.agent.encode())
            .env(
                agent_env::LISTEN_ADDRESS,
                shared
                    .addresses
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .of(&key.node)
                    .to_string(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        match &shared.lifetime {
            AgentLifetime::WithController => {
                command
                    .env_remove(agent_env::DETACHED)
                    .env(agent_env::PARENT_PID, std::process::id().to_string())
                    .stderr(Stdio::piped())
                    .process_group(0);
            }
            AgentLifetime::Detached { log_dir } => {
                // The agent starts its own session (a group leader could not).
                command
                    .env(agent_env::DETACHED, "1")
                    .env_remove(agent_env::PARENT_PID)
                    .stderr(detached_log(log_dir.as_deref(), key)?);
            }
        }
        Ok(command)
    }

    async fn spawn_node(&self, key: &AttemptKey) -> Result<NodeLease, PluginError> {
        let mut child = self
            .spawner
            .spawn(self.agent_command(key)?)
            .await
            .map_err(|error| {
                PluginError::definite(format!(
                    "cannot start node agent {}: {error}",
                    self.shared.agent.program.display()
                ))
            })?;
        let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) else {
            // Already exited and reaped: nothing of it is left.
            return Err(PluginError::definite(
                "the node agent exited before its pid was known",
            ));
        };
        let lease = LeaseHandle(format!("process:{pid}"));
        let instance = self.shared.next_serial();
        let (exited_tx, exited) = watch::channel(false);
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        self.shared.table().insert(
            key.clone(),
            NodeEntry {
                instance,
                lease: lease.clone(),
                group: pid,
                endpoint: None,
                adopted: false,
                life: Life::Running,
                exited,
                session: None,
            },
        );
        tracing::info!(node = %key, pid, "node agent started");
        tokio::spawn(node::watch_process(
            self.shared.clone(),
            key.clone(),
            instance,
            child,
            exited_tx,
        ));
        if let Some(stdout) = stdout {
            tokio::spawn(node::read_announcement(
                self.shared.clone(),
                key.clone(),
                instance,
                stdout,
            ));
        }
        if let Some(stderr) = stderr {
            tokio::spawn(node::relay_output(key.clone(), stderr));
        }
        Ok(NodeLease {
            lease,
            endpoint: None,
            adopted: false,
        })
    }

    /// The boot order of `key`'s agent, reached at `endpoint`.
    fn boot_order(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
        endpoint: SocketAddr,
    ) -> BootOrder {
        let template = spec.template();
        BootOrder {
            protocol: PROTOCOL_VERSION,
            run: key.run_id.as_str().to_owned(),
            node: key.node.to_string(),
            attempt: key.attempt.get(),
            user: template.boot.user.clone(),
            verify_commands: template.boot.verify_commands.clone(),
            start_command: template.boot.start_command.clone(),
            env: template.boot.env.clone(),
            args: template.boot.args.clone(),
            join: JoinOrder {
                address: self.swarm_address,
                credential: self.shared.secret.credential(key).to_hex(),
                swarm: template.swarm_join.swarm.clone(),
                labels: template.swarm_join.labels.clone(),
            },
            group_size: self.shared.peers.group_size(key.node.group()),
            address: Some(endpoint.ip().to_string()),
            on_peers_change: template.boot.on_peers_change.clone(),
            resume_only: false,
        }
    }

    /// The order that re-attaches an adopted agent: resume only (an agent
    /// that has not booted refuses it), join at this plugin's listener.
    fn reattach_order(&self, key: &AttemptKey) -> BootOrder {
        BootOrder {
            protocol: PROTOCOL_VERSION,
            run: key.run_id.as_str().to_owned(),
            node: key.node.to_string(),
            attempt: key.attempt.get(),
            user: String::new(),
            verify_commands: Vec::new(),
            start_command: String::new(),
            env: std::collections::BTreeMap::new(),
            args: Vec::new(),
            join: JoinOrder {
                address: self.swarm_address,
                credential: self.shared.secret.credential(key).to_hex(),
                swarm: String::new(),
                labels: std::collections::BTreeMap::new(),
            },
            group_size: None,
            address: None,
            on_peers_change: String::new(),
            resume_only: true,
        }
    }

    /// Starts the session task of `key` and returns its record.
    fn begin_session(
        &self,
        key: &AttemptKey,
        endpoint: SocketAddr,
        order: BootOrder,
        swarm: Option<String>,
        quiet: bool,
    ) -> SessionRecord {
        let serial = self.shared.next_serial();
        let handle = SessionHandle(format!("boot:{key}#{serial}"));
        let (handshake_tx, handshake) = watch::channel(Handshake::Pending);
        let (commands, commands_rx) = mpsc::channel(session::SESSION_COMMANDS_MAX);
        let setup = SessionSetup {
            key: key.clone(),
            serial,
            endpoint,
            order,
        };
        let task = tokio::spawn(session::run(
            self.shared.clone(),
            setup,
            handshake_tx,
            commands_rx,
        ))
        .abort_handle();
        SessionRecord {
            serial,
            handle,
            state: SessionState::Handshaking,
            swarm,
            quiet,
            handshake,
            commands,
            task,
        }
    }

    /// In detached mode, adopts the live agent of `key` from `/proc` when
    /// the plugin does not know the key yet. Returns whether it knows it now.
    ///
    /// The search is a shared scan of `/proc`, off the runtime: one scan
    /// serves every call that waits for one (a resumed controller's first
    /// calls for a whole fleet of unknown keys).
    async fn ensure_adopted(&self, key: &AttemptKey) -> bool {
        if self.shared.table().contains_key(key) {
            return true;
        }
        if !self.shared.detached() || self.shared.is_closing() {
            return false;
        }
        let agent = self
            .shared
            .scanner
            .processes(|p| p.is_group_leader() && p.belongs_to(key))
            .await
            .ok()
            .and_then(|found| found.into_iter().next());
        match agent {
            Some(agent) => {
                self.adopt(key, agent.pid);
                true
            }
            None => false,
        }
    }

    /// Records the live detached agent `pid` of `key` (started by an earlier
    /// controller) and re-attaches it when it already listens.
    fn adopt(&self, key: &AttemptKey, pid: i32) {
        let endpoint = os::tcp_listeners(pid)
            .ok()
            .and_then(|found| found.into_iter().find(|a| a.ip().is_loopback()));
        if let Some(SocketAddr::V4(endpoint)) = endpoint {
            self.shared
                .addresses
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .reserve(&key.node, *endpoint.ip());
        }
        let instance = self.shared.next_serial();
        let (exited_tx, exited) = watch::channel(false);
        {
            let mut table = self.shared.table();
            if table.contains_key(key) {
                return;
            }
            let session = endpoint.map(|endpoint| {
                self.begin_session(key, endpoint, self.reattach_order(key), None, true)
            });
            table.insert(
                key.clone(),
                NodeEntry {
                    instance,
                    lease: LeaseHandle(format!("process:{pid}")),
                    group: pid,
                    endpoint,
                    adopted: true,
                    life: Life::Running,
                    exited,
                    session,
                },
            );
        }
        tracing::info!(node = %key, pid, ?endpoint, "adopted a detached node agent");
        tokio::spawn(node::watch_adopted(
            self.shared.clone(),
            key.clone(),
            instance,
            pid,
            exited_tx,
        ));
    }

    /// Adopts the session of `key` if there is one; otherwise starts one.
    /// Returns the handshake to wait for and whether it was adopted.
    ///
    /// A quiet re-attach (see [`AgentLifetime::Detached`]) is adopted: from
    /// now on it reports, and what it did so far is reported first.
    fn open_session(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<OpenedSession, PluginError> {
        let mut replay = Vec::new();
        let opened = {
            let mut table = self.shared.table();
            let entry = table
                .get_mut(key)
                .ok_or_else(|| PluginError::not_found(format!("no node process for {key}")))?;
            if entry.life != Life::Running {
                return Err(PluginError::not_found(format!(
                    "the node process of {key} is gone"
                )));
            }
            if let Some(session) = entry.session.as_mut() {
                if session.quiet && session.state == SessionState::Failed {
                    // A re-attach whose join failed: the agent waits for
                    // another resume; a session of the driver's own tries.
                    session.task.abort();
                    entry.session = None;
                } else if session.state == SessionState::Cancelled {
                    return Err(PluginError::definite(format!(
                        "the bootstrap of {key} was cancelled; an agent boots once"
                    )));
                } else {
                    let reattach = session.quiet;
                    if reattach {
                        session.quiet = false;
                        session.swarm = Some(request.spec.template().swarm_join.swarm.clone());
                        if matches!(
                            session.state,
                            SessionState::AwaitingJoin | SessionState::Joined
                        ) {
                            replay
                                .push(BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin));
                        }
                        if session.state == SessionState::Joined {
                            replay.push(BootstrapEvent::Joined);
                        }
                    }
                    let opened = OpenedSession {
                        handle: session.handle.clone(),
                        handshake: session.handshake.clone(),
                        adopted: true,
                        reattach,
                    };
                    drop(table);
                    for event in replay {
                        self.shared.report(key, event);
                    }
                    return Ok(opened);
                }
            }
            let endpoint = parse_loopback(&request.endpoint)?;
            let swarm = request.spec.template().swarm_join.swarm.clone();
            let record = self.begin_session(
                key,
                endpoint,
                self.boot_order(key, &request.spec, endpoint),
                Some(swarm),
                false,
            );
            let opened = OpenedSession {
                handle: record.handle.clone(),
                handshake: record.handshake.clone(),
                adopted: false,
                reattach: false,
            };
            entry.session = Some(record);
            opened
        };
        Ok(opened)
    }
}

/// What [`ProcessPlugin::open_session`] opened or adopted.
struct OpenedSession {
    handle: SessionHandle,
    handshake: watch::Receiver<Handshake>,
    /// An existing session (of this plugin, or a re-attach).
    adopted: bool,
    /// It was a quiet re-attach until now.
    reattach: bool,
}

/// Where a detached agent's standard error (its log) goes.
fn detached_log(log_dir: Option<&std::path::Path>, key: &AttemptKey) -> Result<Stdio, PluginError> {
    let Some(dir) = log_dir else {
        return Ok(Stdio::null());
    };
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(format!("{}-a{}.log", key.node, key.attempt.get()));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&path)
        .map_err(|error| {
            PluginError::definite(format!(
                "cannot open the agent log {}: {error}",
                path.display()
            ))
        })?;
    Ok(Stdio::from(file))
}

impl Drop for ProcessPlugin {
    fn drop(&mut self) {
        self.shared.close();
        self.listener_task.abort();
        let detached = self.shared.detached();
        let mut table = self.shared.table();
        for (key, entry) in table.iter_mut() {
            if let Some(session) = &entry.session {
                session.task.abort();
            }
            if entry.life != Life::Exited && !detached {
                tracing::debug!(node = %key, group = entry.group, "killing node group on drop");
                let _ = killpg(Pid::from_raw(entry.group), Signal::SIGKILL);
                entry.life = Life::Destroying;
            }
        }
    }
}

/// The attempt key an agent's tags name, when they name one.
fn agent_key(run: &RunId, agent: &os::TaggedProcess) -> Option<AttemptKey> {
    let node = provisioning::LogicalNodeId::parse(agent.node.as_deref()?).ok()?;
    Some(AttemptKey {
        run_id: run.clone(),
        node,
        attempt: provisioning::NodeAttemptId::from_raw(agent.attempt?),
    })
}

fn parse_loopback(endpoint: &Endpoint) -> Result<SocketAddr, PluginError> {
    let address: SocketAddr = endpoint.0.parse().map_err(|_| {
        PluginError::definite(format!("endpoint {:?} is not an address", endpoint.0))
    })?;
    if !address.ip().is_loopback() {
        return Err(PluginError::definite(format!(
            "endpoint {address} is not on loopback"
        )));
    }
    Ok(address)
}

#[async_trait]
impl ProvisionPlugin for ProcessPlugin {
    fn kind(&self) -> &str {
        PROVIDER_KIND
    }

    /// Pushes the membership to every agent of the swarm.
    fn membership_changed(&self, membership: &std::sync::Arc<provisioning::Membership>) {
        self.shared.peers.publish(membership);
    }

    fn attach(&self, sink: ObservationSink) {
        self.shared.attach(sink);
    }

    /// Starts the agent of `key`, or adopts the live one.
    ///
    /// # Errors
    /// Definite when the agent cannot be spawned (for example a missing
    /// binary): nothing was started.
    async fn create_node(
        &self,
        key: &AttemptKey,
        _spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        self.check_run(key)?;
        let _one_create_at_a_time = self.create_lock.lock().await;
        // Shutdown may have begun while this call waited for the lock.
        self.check_run(key)?;
        self.ensure_adopted(key).await;
        let dead = {
            let table = self.shared.table();
            match table.get(key) {
                Some(entry) if entry.life == Life::Running => {
                    return Ok(NodeLease {
                        lease: entry.lease.clone(),
                        endpoint: entry.endpoint.map(|a| Endpoint(a.to_string())),
                        adopted: true,
                    });
                }
                Some(_) => true,
                None => false,
            }
        };
        if dead {
            // The earlier process of this key is gone or going: finish it off
            // so that at most one process of the key ever lives.
            node::stop_node(&self.shared, key).await?;
        }
        self.spawn_node(key).await
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        self.ensure_adopted(key).await;
        let unknown_endpoint_of = self.shared.table().get(key).and_then(|entry| {
            (entry.adopted && entry.endpoint.is_none() && entry.life == Life::Running)
                .then_some(entry.group)
        });
        if let Some(pid) = unknown_endpoint_of {
            // An adopted agent that was not listening yet when it was found.
            let found = os::tcp_listeners(pid)
                .ok()
                .and_then(|found| found.into_iter().find(|a| a.ip().is_loopback()));
            if let Some(address) = found
                && let Some(entry) = self.shared.table().get_mut(key)
                && entry.group == pid
            {
                entry.endpoint = Some(address);
            }
        }
        let table = self.shared.table();
        let entry = table
            .get(key)
            .ok_or_else(|| PluginError::not_found(format!("no node process for {key}")))?;
        if entry.life != Life::Running {
            return Err(PluginError::not_found(format!(
                "the node process of {key} is gone"
            )));
        }
        Ok(match entry.endpoint {
            Some(address) => EndpointLookup::Ready(Endpoint(address.to_string())),
            None => EndpointLookup::NotReady,
        })
    }

    /// Connects to `request.endpoint` and hands the agent its boot order, or
    /// adopts the session of `key` that already exists.
    ///
    /// # Errors
    /// Definite when the endpoint is unusable, the connection is refused or
    /// the agent refuses the order; ambiguous when the agent does not answer
    /// in time (the session goes on, and a retry adopts it).
    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        self.check_run(key)?;
        self.ensure_adopted(key).await;
        // Twice at most: a re-attach the agent refused (it had not booted)
        // is forgotten, and the driver's own boot order follows it.
        let mut rounds = 0;
        loop {
            rounds += 1;
            let opened = self.open_session(key, request)?;
            let OpenedSession {
                handle: session,
                mut handshake,
                adopted,
                reattach,
            } = opened;
            let answer = tokio::time::timeout(
                HANDSHAKE_WAIT_MAX,
                handshake.wait_for(|h| *h != Handshake::Pending),
            )
            .await;
            let outcome = match answer {
                Err(_) => {
                    return Err(PluginError::ambiguous(format!(
                        "the agent of {key} did not take its boot order within {HANDSHAKE_WAIT_MAX:?}"
                    )));
                }
                Ok(Err(_)) => {
                    Handshake::Broken("the session ended before the agent answered".into())
                }
                Ok(Ok(outcome)) => outcome.clone(),
            };
            return match outcome {
                Handshake::Accepted => Ok(BootstrapSession { session, adopted }),
                Handshake::Resumed => {
                    tracing::info!(node = %key, "adopted the running boot of a detached agent");
                    Ok(BootstrapSession {
                        session,
                        adopted: true,
                    })
                }
                Handshake::Broken(_) if adopted => Ok(BootstrapSession { session, adopted }),
                Handshake::Broken(reason) => Err(PluginError::ambiguous(reason)),
                Handshake::Refused(_) | Handshake::ConnectFailed(_) if reattach && rounds < 2 => {
                    continue;
                }
                Handshake::Refused(reason) | Handshake::ConnectFailed(reason) => {
                    Err(PluginError::definite(reason))
                }
                Handshake::Pending => Err(PluginError::ambiguous("no answer from the agent")),
            };
        }
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.ensure_adopted(key).await;
        let commands = {
            let mut table = self.shared.table();
            let session = table
                .get_mut(key)
                .and_then(|entry| entry.session.as_mut())
                .ok_or_else(|| PluginError::not_found(format!("no bootstrap session for {key}")))?;
            match session.state {
                SessionState::Closed => return Ok(()),
                SessionState::Joined => {
                    session.quiet = false;
                    session.state = SessionState::Closed;
                    session.commands.clone()
                }
                state if session.quiet && !state.is_over() => {
                    return Err(PluginError::ambiguous(format!(
                        "the detached agent of {key} is re-joining ({state:?})"
                    )));
                }
                other => {
                    return Err(PluginError::definite(format!(
                        "the bootstrap of {key} cannot complete: the agent has not joined ({other:?})"
                    )));
                }
            }
        };
        let _ = commands.try_send(SessionCommand::Close);
        self.shared.report(key, BootstrapEvent::Closed);
        Ok(())
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.ensure_adopted(key).await;
        let mut table = self.shared.table();
        if let Some(session) = table.get_mut(key).and_then(|entry| entry.session.as_mut())
            && !session.state.is_over()
        {
            // The agent is told to abandon its boot; before the order was
            // taken (or when the session cannot take the command), dropping
            // the control connection says the same.
            let handshaking = session.state == SessionState::Handshaking;
            session.state = SessionState::Cancelled;
            if handshaking || session.commands.try_send(SessionCommand::Cancel).is_err() {
                session.task.abort();
            }
            tracing::debug!(node = %key, "bootstrap cancelled");
        }
        Ok(())
    }

    /// Terminates the node's process group and waits until it is gone.
    ///
    /// # Errors
    /// Ambiguous when processes of the node survive the bounded wait.
    async fn destroy_node(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<(), PluginError> {
        self.ensure_adopted(key).await;
        node::stop_node(&self.shared, key).await
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        if *run != self.shared.run_id {
            return Ok(Vec::new());
        }
        if self.shared.detached() && !self.shared.is_closing() {
            // Detached agents of an earlier controller are adopted (and
            // re-attached) here; no spawn is in flight meanwhile, so none of
            // this plugin's own agents is mistaken for one.
            let _no_create_in_flight = self.create_lock.lock().await;
            let agents = self
                .shared
                .scanner
                .processes(os::TaggedProcess::is_group_leader)
                .await
                .map_err(|error| {
                    PluginError::ambiguous(format!("cannot list node agents: {error}"))
                })?;
            for agent in agents {
                let Some(key) = agent_key(run, &agent) else {
                    continue;
                };
                if !self.shared.table().contains_key(&key) {
                    self.adopt(&key, agent.pid);
                }
            }
        }
        Ok(self
            .shared
            .table()
            .iter()
            .filter(|(_, entry)| entry.life != Life::Exited)
            .map(|(key, entry)| ListedNode {
                key: key.clone(),
                lease: entry.lease.clone(),
            })
            .collect())
    }
}
