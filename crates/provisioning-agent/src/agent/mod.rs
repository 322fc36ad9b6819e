//! The node agent: the process that is a node (of the local process
//! provider here; see [`remote`] for the boot mode of remote providers).
//!
//! The plugin starts one agent per node attempt, as the leader of a new
//! process group, configured through the environment (see [`mod@env`]). The
//! agent:
//!
//! 1. asks the kernel to send it `SIGTERM` when its parent dies, then checks
//!    that its parent is still the controller that started it (closing the
//!    race where the controller died first);
//! 2. listens on a loopback port and announces it on standard output;
//! 3. takes one boot order on a control connection: runs the verify
//!    commands, starts the workload, and joins the run's swarm with the
//!    credential it was given (see [`crate::wire`]);
//! 4. on `SIGTERM`, or when its swarm connection ends, terminates its whole
//!    process group (`SIGTERM`, then `SIGKILL` after the stop grace) —
//!    itself included.
//!
//! Verify commands and the workload run through `/bin/sh -c`, started via
//! this same binary in a small wrapper role that first sets its own
//! parent-death signal (so they die with the agent), then `exec`s the shell.
//!
//! **Detached agents** ([`env::DETACHED`]) differ in three ways: they start
//! a session of their own instead of arming a parent-death signal (so the
//! controller's death does not reach them), the end of their swarm
//! connection does not stop the node (the controller may only have
//! crashed), and once booted they accept a *resume* from a restarted
//! controller: a boot order for their own key carrying their original
//! credential, which makes them re-join the swarm at the order's new
//! address without restarting the workload (see [`crate::wire`]).

mod boot;
pub mod env;
pub mod remote;
pub mod rendezvous;
mod wrapper;

use std::ffi::OsString;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use nix::sys::prctl;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::{Pid, getpgrp, getpid, getppid, setsid};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::AbortHandle;

use crate::codec::encode_message;
use crate::os;
use crate::wire::{AgentAnnouncement, JoinOrder, SwarmNotice};

/// How many control connections the agent serves at once. Only one can boot
/// it; the others are refused quickly.
const CONTROL_CONNECTIONS_MAX: usize = 4;

/// The pause after a failed `accept`.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// How often the agent looks at its process group while stopping it.
const GROUP_POLL_INTERVAL: Duration = Duration::from_millis(20);

/// The exit code for a configuration error (missing or bad environment).
const EXIT_CONFIG: u8 = 2;

/// Why the agent could not run.
#[derive(Debug, Error)]
pub enum AgentError {
    /// A required environment variable is missing.
    #[error("environment variable {0} is not set; the agent is started by the process plugin")]
    MissingEnv(&'static str),
    /// An environment variable has an unusable value.
    #[error("environment variable {name} has an invalid value {value:?}")]
    BadEnv {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// The controller died before the agent armed its parent-death signal.
    #[error("the controller (pid {expected}) is gone; the parent is now pid {actual}")]
    ParentGone {
        /// The pid of the controller that started the agent.
        expected: i32,
        /// The pid of the actual parent.
        actual: i32,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    System {
        /// What the agent was doing.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

fn system(what: &'static str) -> impl FnOnce(std::io::Error) -> AgentError {
    move |source| AgentError::System { what, source }
}

fn errno(what: &'static str) -> impl FnOnce(nix::Error) -> AgentError {
    move |error| AgentError::System {
        what,
        source: std::io::Error::from(error),
    }
}

/// The agent's configuration, read from its environment.
#[derive(Clone, Debug)]
pub(crate) struct AgentConfig {
    pub(crate) run: String,
    pub(crate) node: String,
    pub(crate) attempt: u64,
    /// The controller that started the agent; `None` when detached.
    parent: Option<Pid>,
    /// Whether the agent outlives its controller (see [`env::DETACHED`]).
    pub(crate) detached: bool,
    stop_grace: Duration,
    /// How to start this binary again (for the wrapper role).
    pub(crate) program: PathBuf,
    pub(crate) program_args: Vec<OsString>,
    /// The loopback address of the control listener.
    pub(crate) listen: Ipv4Addr,
}

/// The control listener's address: [`env::LISTEN_ADDRESS`], a loopback
/// address, or `127.0.0.1`.
fn listen_address() -> Result<Ipv4Addr, AgentError> {
    let Ok(value) = std::env::var(env::LISTEN_ADDRESS) else {
        return Ok(Ipv4Addr::LOCALHOST);
    };
    match value.parse::<Ipv4Addr>() {
        Ok(address) if address.is_loopback() => Ok(address),
        _ => Err(AgentError::BadEnv {
            name: env::LISTEN_ADDRESS,
            value,
        }),
    }
}

fn required(name: &'static str) -> Result<String, AgentError> {
    std::env::var(name).map_err(|_| AgentError::MissingEnv(name))
}

fn parsed<T: std::str::FromStr>(name: &'static str) -> Result<T, AgentError> {
    let value = required(name)?;
    value
        .parse()
        .map_err(|_| AgentError::BadEnv { name, value })
}

impl AgentConfig {
    fn from_env() -> Result<Self, AgentError> {
        let command = required(env::COMMAND)?;
        let bad_command = || AgentError::BadEnv {
            name: env::COMMAND,
            value: command.clone(),
        };
        let mut parts = command
            .split(',')
            .map(|part| hex::decode(part).map(OsString::from_vec));
        let program = parts
            .next()
            .ok_or_else(bad_command)?
            .map_err(|_| bad_command())?;
        let program_args = parts
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| bad_command())?;
        let detached = match std::env::var(env::DETACHED) {
            Err(_) => false,
            Ok(value) if value == "1" => true,
            Ok(value) if value == "0" => false,
            Ok(value) => {
                return Err(AgentError::BadEnv {
                    name: env::DETACHED,
                    value,
                });
            }
        };
        let parent = if detached {
            None
        } else {
            Some(Pid::from_raw(parsed(env::PARENT_PID)?))
        };
        Ok(AgentConfig {
            run: required(os::RUN_TAG)?,
            node: required(os::NODE_TAG)?,
            attempt: parsed(os::ATTEMPT_TAG)?,
            parent,
            detached,
            stop_grace: Duration::from_millis(parsed(env::STOP_GRACE_MS)?),
            program: PathBuf::from(program),
            program_args,
            listen: listen_address()?,
        })
    }
}

/// How far the agent's one boot got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// No boot order taken yet.
    Fresh,
    /// Verify commands or the workload start are under way.
    Booting,
    /// The boot was abandoned before the workload ran; its commands were
    /// killed. A detached agent may boot again; an attached one never.
    Abandoned,
    /// A verify command, the workload start or the first join failed.
    Failed,
    /// The workload started (or there is none) and the agent got as far as
    /// waiting for its join: what a resume may pick up.
    Started,
}

/// The agent's boot bookkeeping, behind [`Agent::boot_state`].
pub(crate) struct BootState {
    pub(crate) phase: Phase,
    /// Whether a control connection boots or resumes the agent right now.
    pub(crate) busy: bool,
    /// The join order of the accepted boot: its credential authenticates a
    /// resume, its swarm and labels are what a resume joins with.
    pub(crate) first_join: Option<JoinOrder>,
}

/// The running agent, shared by its tasks.
pub(crate) struct Agent {
    pub(crate) config: AgentConfig,
    boot: Mutex<BootState>,
    /// Workload notices; the current swarm membership holds the lock.
    pub(crate) notices: Arc<tokio::sync::Mutex<Option<mpsc::Receiver<SwarmNotice>>>>,
    /// The task holding the current swarm membership; a resume replaces it.
    pub(crate) membership: Mutex<Option<AbortHandle>>,
    /// The node's peers file, once the boot made it; a resume keeps it.
    pub(crate) peers: Mutex<Option<Arc<rendezvous::PeersFile>>>,
    /// Whether the agent leads its process group (it does when the plugin
    /// started it). Only a leader may take its whole group down.
    leader: bool,
}

impl Agent {
    pub(crate) fn boot_state(&self) -> MutexGuard<'_, BootState> {
        self.boot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces the current membership task (a resume joined elsewhere).
    pub(crate) fn replace_membership(&self, task: AbortHandle) {
        let previous = self
            .membership
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(task);
        if let Some(previous) = previous {
            previous.abort();
        }
    }

    /// Kills every other live process of this node's group (verify commands,
    /// the workload and whatever it forked). The agent itself survives.
    pub(crate) fn kill_children(&self) {
        let me = getpid().as_raw();
        let run = provisioning::RunId::new(self.config.run.as_str());
        match os::group_processes(&run, getpgrp().as_raw()) {
            Ok(processes) => {
                let children: Vec<_> = processes.into_iter().filter(|p| p.pid != me).collect();
                os::signal_processes(&children, Signal::SIGKILL);
            }
            Err(error) => tracing::warn!(%error, "cannot list this node's processes"),
        }
    }

    /// Terminates the node: `SIGTERM` to the group, a grace for the others
    /// to exit, then `SIGKILL` to the group, which ends the agent too.
    ///
    /// The grace ends early once no descendant of the agent in its group is
    /// alive. That is read from the agent's own process tree
    /// (`/proc/PID/task/TID/children`), not from a scan of every process on
    /// the machine: a thousand agents stopping at once each scanning `/proc`
    /// is quadratic. A group member that was re-parented away (its parent
    /// died first) is not waited for, but the final `SIGKILL` of the group
    /// reaches it all the same.
    async fn stop_node(&self) {
        // The agent may not live to drop it: its process can end with the
        // group's final `SIGKILL`.
        if let Some(peers) = self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            peers.remove();
        }
        if !self.leader {
            self.kill_children();
            return;
        }
        let group = getpgrp();
        // The agent handles SIGTERM itself, so this only reaches the others.
        let _ = killpg(group, Signal::SIGTERM);
        let run = provisioning::RunId::new(self.config.run.as_str());
        let me = getpid().as_raw();
        let deadline = tokio::time::Instant::now() + self.config.stop_grace;
        while tokio::time::Instant::now() < deadline {
            let others = match os::live_descendants(me) {
                Ok(found) => found.iter().any(|p| p.process_group == group.as_raw()),
                // No `children` files on this kernel: scan the group.
                Err(_) => os::group_processes(&run, group.as_raw())
                    .map(|processes| processes.iter().any(|p| p.pid != me))
                    .unwrap_or(false),
            };
            if !others {
                break;
            }
            tokio::time::sleep(GROUP_POLL_INTERVAL).await;
        }
        let _ = killpg(group, Signal::SIGKILL);
    }
}

/// The agent's log writer: its standard error, which is a pipe to the
/// controller. When the controller is gone the pipe is broken; a log line
/// must then vanish quietly instead of failing (or panicking in the middle
/// of the agent's orderly stop).
struct QuietStderr;

impl Write for QuietStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env(env::LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| QuietStderr)
        .log_internal_errors(false)
        .with_ansi(false)
        .with_target(false);
    if std::env::var_os(env::DETACHED).is_some_and(|v| v == "1") {
        // A detached agent's log is a file of its own: timestamped here.
        let _ = builder.try_init();
    } else {
        // The controller timestamps and labels every relayed line itself.
        let _ = builder.without_time().try_init();
    }
}

/// Makes any panic of the agent take its node down with it: a half-dead
/// agent must not leave its workload running unsupervised.
fn kill_group_on_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if getpgrp() == getpid() {
            let _ = killpg(getpgrp(), Signal::SIGKILL);
        }
        previous(info);
    }));
}

/// The agent's entry point. `args` are the arguments after the command that
/// selected the agent (none are accepted: the plugin configures the agent
/// through its environment). Builds its own single-threaded runtime, so that
/// every child is forked from the main thread, which lives as long as the
/// agent.
pub fn main(args: Vec<OsString>) -> ExitCode {
    if std::env::var_os(env::ROLE).is_some_and(|role| role == env::ROLE_WORKLOAD) {
        return wrapper::run();
    }
    if !args.is_empty() {
        let _ = writeln!(
            std::io::stderr(),
            "the node agent takes no arguments (got {args:?}); it is started and configured by the process plugin"
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    init_logging();
    kill_group_on_panic();
    if let Some(path) = std::env::var_os(env::BOOT_FILE) {
        return remote::main(PathBuf::from(path));
    }
    let config = match AgentConfig::from_env() {
        Ok(config) => config,
        Err(error) => {
            tracing::error!(%error, "cannot start the node agent");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot build the agent's runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(%error, "node agent failed");
            ExitCode::FAILURE
        }
    }
}

fn announce(address: SocketAddr) -> Result<(), AgentError> {
    let line = encode_message(&AgentAnnouncement::Listening {
        address,
        pid: std::process::id(),
    })
    .map_err(|error| AgentError::System {
        what: "encoding the announcement",
        source: std::io::Error::other(error),
    })?;
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(&line)
        .and_then(|()| stdout.flush())
        .map_err(system("announcing the endpoint"))
}

async fn run(config: AgentConfig) -> Result<(), AgentError> {
    // The handler exists before the parent-death signal is armed, so a
    // controller that dies from here on leads to an orderly stop.
    let mut terminate = signal(SignalKind::terminate()).map_err(system("handling SIGTERM"))?;
    if let Some(expected) = config.parent {
        prctl::set_pdeathsig(Signal::SIGTERM).map_err(errno("arming the parent-death signal"))?;
        let parent = getppid();
        if parent != expected {
            return Err(AgentError::ParentGone {
                expected: expected.as_raw(),
                actual: parent.as_raw(),
            });
        }
    } else {
        // A session (and process group) of its own: no signal meant for the
        // controller's terminal or group reaches the node.
        setsid().map_err(errno("starting a session of its own"))?;
    }
    let leader = getpgrp() == getpid();
    if !leader {
        tracing::warn!("not a process group leader; stopping will kill children one by one");
    }
    let listener = TcpListener::bind((config.listen, 0))
        .await
        .map_err(system("binding the control listener"))?;
    let address = listener
        .local_addr()
        .map_err(system("reading the control address"))?;
    match announce(address) {
        Ok(()) => {}
        // The controller that would read it may be gone already; a
        // restarted one finds the endpoint in /proc.
        Err(error) if config.detached => {
            tracing::warn!(%error, "cannot announce the endpoint; going on detached");
        }
        Err(error) => return Err(error),
    }
    tracing::info!(node = %config.node, attempt = config.attempt, %address, "node agent listening");

    let agent = Arc::new(Agent {
        config,
        boot: Mutex::new(BootState {
            phase: Phase::Fresh,
            busy: false,
            first_join: None,
        }),
        notices: Arc::new(tokio::sync::Mutex::new(None)),
        peers: Mutex::new(None),
        membership: Mutex::new(None),
        leader,
    });
    let (fatal_tx, mut fatal) = mpsc::channel::<String>(1);
    let permits = Arc::new(Semaphore::new(CONTROL_CONNECTIONS_MAX));
    // Bounded by the agent's life: SIGTERM, the parent's death or the loss
    // of the swarm connection end it.
    loop {
        tokio::select! {
            _ = terminate.recv() => {
                tracing::info!("terminating");
                agent.stop_node().await;
                return Ok(());
            }
            Some(reason) = fatal.recv() => {
                // The controller ended the membership (the node was lost or
                // is being stopped) and logs why itself; a warning here
                // would only repeat it.
                tracing::info!("stopping the node: {reason}");
                agent.stop_node().await;
                return Ok(());
            }
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        tracing::warn!(%error, "cannot accept a control connection");
                        tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                        continue;
                    }
                };
                if !peer.ip().is_loopback() {
                    tracing::warn!(%peer, "refusing a control connection from off the machine");
                    continue;
                }
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    tracing::warn!(%peer, "too many control connections; refusing one");
                    continue;
                };
                let agent = agent.clone();
                let fatal = fatal_tx.clone();
                tokio::spawn(async move {
                    boot::serve(agent, stream, fatal).await;
                    drop(permit);
                });
            }
        }
    }
}
