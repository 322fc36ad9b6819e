//! [`ContainerSubstrate`]: the conformance kit's `Level3Substrate` over real
//! containers on the private engine, with [`ContainerWorld`] as the
//! container plugin's part.
//!
//! # Stream events, all real
//! - `joined`: the node's verify command reads `pass` from its boot gate (a
//!   named pipe in a directory bind-mounted into every container); the
//!   agent starts the workload and joins the plugin's swarm over TCP.
//! - `failed boot-check-failed`: the gate says `fail`; the verify command
//!   fails and the agent reports it on the exec's output.
//! - `failed start-failed`: the agent is SIGKILLed while it waits at its
//!   gate; its exec ends before it joined.
//! - Refused: progress, `converged`, `closed` and the other failure stages
//!   — the agent and the plugin produce those on their own.
//!
//! # Losses, all real
//! - `lease-gone`: by turns the container is removed by hand
//!   (`docker rm -f`) or killed (`docker kill`: it exits, lost with its
//!   exit code).
//! - `agent-gone`: the agent is SIGKILLed inside its container (from the
//!   host: the container's processes are this machine's); its swarm
//!   connection drops. `workload-exited`: the workload is SIGKILLed.
//!
//! # What is live
//! Leases are counted from the engine's listing (every container of the
//! run, any state: an exited container not yet destroyed is still a leak);
//! a session counts while the plugin has not reported its end and an agent
//! process runs in the node's container (`/proc`, by the container's cgroup).

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::{Signal, kill};
use nix::sys::stat::Mode;
use nix::unistd::Pid;
use provisioning::RunId;
use provisioning::observe::LossCause;
use provisioning::state::BootstrapFailure;
use provisioning_agent::RunSecret;
use provisioning_agent::os;
use provisioning_conformance::level3::{
    Core, Intercepted, Level3Substrate, Level3World, WorkBounds,
};
use provisioning_conformance::substrate::{CallRecord, LiveResources, ResourceKey};
use provisioning_conformance::trace::StreamEvent;
use provisioning_container::{AGENT_MOUNT_PATH, ContainerPlugin};
use provisioning_provider::{PluginBackendAdapter, ProvisionPlugin};

use super::backend::{ContainerBackend, Defect, LeakyDestroy, World};
use super::shared::{FaultCounts, new_shared};
use super::{Level3, Listed};

/// How running work is bounded: 30 s for real I/O to finish.
const WORK: WorkBounds = WorkBounds {
    quiet_wait_max: Duration::from_secs(30),
    poll_interval: Duration::from_millis(1),
    rounds_max: 30_000,
};

/// How long an accepted session may take to reach its boot gate.
const BOOT_CHECK_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long an opened gate may take to end in a join or a failure.
const SESSION_OUTCOME_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long opening a gate waits for its verify command to open the pipe.
const GATE_READER_WAIT_MAX: Duration = Duration::from_secs(5);

/// How long a loss may take to be reported.
const LOSS_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long one of the substrate's own plugin calls may take.
const OWN_CALL_WAIT_MAX: Duration = Duration::from_secs(30);

/// How long a started agent may take to join before its bootstrap fails:
/// longer than a trace keeps an agent at its gate, so that the trace's
/// gates decide.
const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// Losses of leases so far: they alternate between removal and kill.
static LEASE_LOSSES: AtomicU64 = AtomicU64::new(0);

/// The Level 3 substrate over containers. See the module docs.
pub(crate) type ContainerSubstrate = Level3Substrate<ContainerWorld>;

/// The container plugin's part of the substrate.
pub(crate) struct ContainerWorld {
    context: Arc<Level3>,
    world: Arc<World>,
    backend: Arc<ContainerBackend>,
    plugin: Arc<ContainerPlugin>,
    started: Instant,
    undestroyed: Vec<String>,
    /// Holds the gates; removed last.
    _dir: tempfile::TempDir,
}

/// Creates the boot gate of `key` in `gates` unless it exists.
pub(crate) fn prepare_gate(gates: &std::path::Path, key: &ResourceKey) {
    let path = gates.join(format!("{}.{}", key.0, key.1.get()));
    match nix::unistd::mkfifo(&path, Mode::S_IRUSR | Mode::S_IWUSR) {
        Ok(()) | Err(Errno::EEXIST) => {}
        Err(error) => eprintln!("level 3: cannot create the boot gate of {key:?}: {error}"),
    }
}

fn signal(pid: i32, signal: Signal) -> bool {
    kill(Pid::from_raw(pid), signal).is_ok()
}

/// The node-agent processes of this machine by the id of the container
/// they run in (from `/proc`: the command and the cgroup).
fn agents_by_container() -> BTreeMap<String, Vec<i32>> {
    let mut agents: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return agents;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let program = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        if program != AGENT_MOUNT_PATH.as_bytes() {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        if stat
            .rsplit(") ")
            .next()
            .is_some_and(|rest| rest.starts_with('Z'))
        {
            continue;
        }
        let cgroup = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        let id = cgroup
            .split(|c: char| !c.is_ascii_hexdigit())
            .find(|word| word.len() == 64)
            .map(str::to_owned);
        if let Some(id) = id {
            agents.entry(id).or_default().push(pid);
        }
    }
    agents
}

impl ContainerWorld {
    fn gate(&self, key: &ResourceKey) -> PathBuf {
        self.world.gates.join(format!("{}.{}", key.0, key.1.get()))
    }

    fn prepare_gate(&self, key: &ResourceKey) {
        prepare_gate(&self.world.gates, key);
    }

    /// Writes `verdict` to the verify command waiting on `key`'s gate once
    /// it opened the pipe (bounded by `wait`), unless `give_up` says it
    /// never will.
    fn write_gate(
        &self,
        key: &ResourceKey,
        verdict: &str,
        wait: Duration,
        give_up: impl Fn() -> bool,
    ) -> bool {
        let path = self.gate(key);
        let deadline = Instant::now() + wait;
        // Bounded by the deadline.
        loop {
            let opened = OpenOptions::new()
                .write(true)
                .custom_flags(OFlag::O_NONBLOCK.bits())
                .open(&path);
            match opened {
                Ok(mut pipe) => return pipe.write_all(format!("{verdict}\n").as_bytes()).is_ok(),
                Err(error)
                    if error.raw_os_error() == Some(Errno::ENXIO as i32)
                        || error.kind() == ErrorKind::NotFound => {}
                Err(error) => {
                    eprintln!("level 3: cannot open the boot gate of {key:?}: {error}");
                    return false;
                }
            }
            if give_up() || Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Opens the gate of `key` with `verdict` once its verify command
    /// waits, then waits (bounded) for the join or the failure.
    fn open_gate(&self, core: &Core<Self>, key: &ResourceKey, pass: bool) -> bool {
        let shared = core.shared();
        let waiting = shared
            .lock()
            .sessions()
            .get(key)
            .is_some_and(|t| t.accepted && !t.ended && !t.joined);
        if !waiting {
            return false;
        }
        self.prepare_gate(key);
        let ended = || shared.lock().session_settled(key);
        let verdict = if pass { "pass" } else { "fail" };
        if !self.write_gate(key, verdict, GATE_READER_WAIT_MAX, ended) {
            return false;
        }
        if pass {
            shared.count(|f| f.gates_passed += 1);
        } else {
            shared.count(|f| f.verify_failures += 1);
        }
        shared.wait_until(SESSION_OUTCOME_WAIT_MAX, |state| state.session_settled(key));
        true
    }

    /// The container of `key`, from the engine's listing.
    fn container_of(&self, key: &ResourceKey) -> Option<Listed> {
        let node = key.0.to_string();
        self.context
            .containers(&self.world.run)
            .into_iter()
            .find(|c| c.node == node && c.attempt == key.1.get())
    }

    /// The agents running in `key`'s container.
    fn agents_of(&self, key: &ResourceKey) -> Vec<i32> {
        let Some(container) = self.container_of(key) else {
            return Vec::new();
        };
        agents_by_container()
            .remove(&container.id)
            .unwrap_or_default()
    }

    /// The tagged processes (verify command, workload) of `key`'s node.
    fn node_processes(&self, key: &ResourceKey) -> Vec<os::TaggedProcess> {
        os::node_processes(&provisioning_conformance::level3::attempt_key(
            &self.world.run,
            key,
        ))
        .unwrap_or_else(|error| panic!("level 3 needs a readable /proc: {error}"))
    }

    fn destroy_everything(&self, core: &Core<Self>) -> Vec<String> {
        let plugin = self.plugin.clone();
        let run = self.world.run.clone();
        core.block_on(async move {
            let listed =
                match tokio::time::timeout(OWN_CALL_WAIT_MAX, plugin.list_nodes(&run)).await {
                    Ok(Ok(listed)) => listed,
                    Ok(Err(error)) => return vec![format!("listing failed: {error}")],
                    Err(_) => return vec!["listing did not answer".to_owned()],
                };
            let mut failed = Vec::new();
            for node in listed {
                let destroyed = tokio::time::timeout(
                    OWN_CALL_WAIT_MAX,
                    plugin.destroy_node(&node.key, &node.lease),
                )
                .await;
                if !matches!(destroyed, Ok(Ok(()))) {
                    failed.push(format!("destroying {} failed: {destroyed:?}", node.key));
                }
            }
            failed
        })
        .unwrap_or_default()
    }
}

impl Level3World for ContainerWorld {
    type Context = Level3;
    type Defect = Defect;
    type Faults = FaultCounts;
    type Session = ();
    type Hang = ();
    type Backend = ContainerBackend;

    const HUNG_ON: &'static str = "";

    fn start(context: Arc<Level3>, defect: Option<Defect>) -> (Core<Self>, Self) {
        let run = context.next_run();
        let dir = tempfile::Builder::new()
            .prefix("prov-l3-gates-")
            .tempdir_in("/tmp")
            .expect("level 3 needs a temporary directory");
        let core = Core::<Self>::new(Arc::new(new_shared()), "level3-container", WORK);
        let mut config = {
            let engine = context.engine();
            crate::common::config(&engine, run.as_str(), RunSecret::generate())
        };
        config.join_timeout = JOIN_TIMEOUT;
        let network = context.engine().network().to_owned();
        let plugin = Arc::new(
            core.block_on(ContainerPlugin::start(config))
                .expect("the runtime runs")
                .expect("the container plugin starts"),
        );
        let served: Arc<dyn ProvisionPlugin> = match defect {
            None => plugin.clone(),
            Some(Defect::DestroyLeavesContainer) => {
                Arc::new(Intercepted::new(plugin.clone(), LeakyDestroy))
            }
        };
        let adapter = PluginBackendAdapter::single(served, core.sink());
        let world = Arc::new(World {
            run,
            context: context.clone(),
            gates: dir.path().to_owned(),
            network,
        });
        let backend = Arc::new(ContainerBackend::new(
            adapter,
            plugin.clone(),
            core.shared().clone(),
            world.clone(),
        ));
        let parts = ContainerWorld {
            context,
            world,
            backend,
            plugin,
            started: Instant::now(),
            undestroyed: Vec::new(),
            _dir: dir,
        };
        (core, parts)
    }

    fn run(&self) -> &RunId {
        &self.world.run
    }

    fn backend(&self) -> Arc<ContainerBackend> {
        self.backend.clone()
    }

    fn take_calls(&self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn release_hang(&mut self, core: &Core<Self>, serial: u64) -> bool {
        core.shared().lock().release_hang(serial).is_some()
    }

    fn streamable(&mut self, core: &Core<Self>, event: StreamEvent) -> bool {
        let _ = core;
        matches!(
            event,
            StreamEvent::Joined
                | StreamEvent::Failed(
                    BootstrapFailure::BootCheckFailed | BootstrapFailure::StartFailed
                )
        )
    }

    fn stream(&mut self, core: &Core<Self>, key: &ResourceKey, event: StreamEvent) -> bool {
        match event {
            StreamEvent::Joined => self.open_gate(core, key, true),
            StreamEvent::Failed(BootstrapFailure::BootCheckFailed) => {
                self.open_gate(core, key, false)
            }
            StreamEvent::Failed(BootstrapFailure::StartFailed) => {
                let shared = core.shared();
                shared.wait_until(BOOT_CHECK_WAIT_MAX, |state| {
                    state
                        .sessions()
                        .get(key)
                        .is_none_or(|t| t.ended || !t.accepted || t.boot_checking)
                });
                let at_gate = shared
                    .lock()
                    .sessions()
                    .get(key)
                    .is_some_and(|t| !t.ended && t.accepted && t.boot_checking && !t.joined);
                if !at_gate {
                    return false;
                }
                let agents = self.agents_of(key);
                let killed = agents
                    .iter()
                    .filter(|pid| signal(**pid, Signal::SIGKILL))
                    .count();
                for process in self.node_processes(key) {
                    signal(process.pid, Signal::SIGKILL);
                }
                if killed > 0 {
                    shared.count(|f| f.agents_killed_before_join += 1);
                    shared.wait_until(LOSS_WAIT_MAX, |state| state.session_settled(key));
                }
                killed > 0
            }
            StreamEvent::Progress(_)
            | StreamEvent::Converged
            | StreamEvent::Closed
            | StreamEvent::Failed(_) => false,
        }
    }

    fn lose(&mut self, core: &Core<Self>, key: &ResourceKey, cause: LossCause) -> bool {
        let shared = core.shared();
        let joined = shared.lock().joined(key);
        let lost = match cause {
            LossCause::AgentGone if joined => {
                let killed = self
                    .agents_of(key)
                    .iter()
                    .filter(|pid| signal(**pid, Signal::SIGKILL))
                    .count();
                shared.count(|f| f.agents_killed += killed as u64);
                killed > 0
            }
            LossCause::WorkloadExited | LossCause::WorkloadEnded(_) if joined => {
                let killed = self
                    .node_processes(key)
                    .iter()
                    .filter(|p| signal(p.pid, Signal::SIGKILL))
                    .count();
                shared.count(|f| f.workloads_killed += killed as u64);
                killed > 0
            }
            LossCause::AgentGone | LossCause::WorkloadExited | LossCause::WorkloadEnded(_) => false,
            LossCause::LeaseGone => {
                let Some(container) = self.container_of(key) else {
                    return false;
                };
                let remove = LEASE_LOSSES.fetch_add(1, Ordering::Relaxed) % 2 == 0;
                let action = if remove {
                    vec!["rm", "-f", container.id.as_str()]
                } else {
                    vec!["kill", container.id.as_str()]
                };
                let done = self.context.engine().docker(&action).0;
                if done {
                    if remove {
                        shared.count(|f| f.containers_removed += 1);
                    } else {
                        shared.count(|f| f.containers_killed += 1);
                    }
                }
                done
            }
        };
        if lost {
            shared.wait_until(LOSS_WAIT_MAX, |state| state.lost(key));
        }
        lost
    }

    fn fair_progress(&mut self, core: &Core<Self>) -> usize {
        let shared = core.shared();
        // Agents that took their boot order reach their gate on their own.
        shared.wait_until(BOOT_CHECK_WAIT_MAX, |state| {
            state
                .sessions()
                .values()
                .all(|t| t.ended || !t.accepted || t.joined || t.boot_checking)
        });
        let waiting: Vec<(ResourceKey, bool)> = shared
            .lock()
            .sessions()
            .iter()
            .filter(|(_, t)| t.accepted && !t.ended && !t.joined)
            .map(|(key, t)| (key.clone(), t.boot_checking))
            .collect();
        waiting
            .iter()
            .filter(|(key, reported)| {
                if *reported {
                    self.open_gate(core, key, true)
                } else {
                    // No stage reported, yet a verify command may wait at
                    // the gate (an adopted agent): open it if so.
                    self.write_gate(key, "pass", Duration::ZERO, || true) && {
                        shared.count(|f| f.gates_passed += 1);
                        shared.wait_until(SESSION_OUTCOME_WAIT_MAX, |state| {
                            state.session_settled(key)
                        });
                        true
                    }
                }
            })
            .count()
    }

    fn live_resources(&self, core: &Core<Self>) -> LiveResources {
        let mut live = LiveResources::default();
        let containers = self.context.containers(&self.world.run);
        let agents = agents_by_container();
        let state = core.shared().lock();
        for container in &containers {
            let Some(key) = self.key_of(container) else {
                continue;
            };
            *live.leases.entry(key.clone()).or_insert(0) += 1;
            let ended = state.sessions().get(&key).is_none_or(|t| t.ended);
            if !ended && agents.contains_key(&container.id) {
                *live.sessions.entry(key).or_insert(0) += 1;
            }
        }
        live
    }

    fn controller_restarted(&mut self, _core: &Core<Self>) {
        self.plugin.controller_replaced();
    }

    fn destroy_orphan(&mut self, core: &Core<Self>, key: &ResourceKey) -> bool {
        self.container_of(key).is_some()
            && core.destroy_listed(&self.plugin, &self.world.run, key, OWN_CALL_WAIT_MAX)
    }

    fn describe_world(&self, _core: &Core<Self>) -> Option<String> {
        let containers = self.context.containers(&self.world.run);
        Some(format!("containers on the engine: {containers:?}"))
    }

    fn hangs_released(&mut self, _core: &Core<Self>) {
        self.context.engine().resume();
    }

    fn runtime_stopping(&mut self, core: &Core<Self>) {
        self.undestroyed = self.destroy_everything(core);
    }

    fn torn_down(&mut self, core: &Core<Self>) {
        let failed = std::mem::take(&mut self.undestroyed);
        let left = self.context.purge(&self.world.run);
        let left = (!left.is_empty() || !failed.is_empty()).then(|| {
            format!(
                "outlived the plugin's destroys: containers {:?}; {}",
                left.iter().map(|c| &c.name).collect::<Vec<_>>(),
                failed.join("; ")
            )
        });
        let (faults, counters) = {
            let state = core.shared().lock();
            (state.faults, state.counters)
        };
        eprintln!(
            "level 3: run {} done in {:.1} s ({} creations, {} adoptions, {} hangs, {} faults applied)",
            self.world.run,
            self.started.elapsed().as_secs_f64(),
            counters.creations,
            counters.adoptions,
            counters.hangs,
            counters.faults_applied,
        );
        self.context.finished(&self.world.run, &faults, left);
    }
}

impl ContainerWorld {
    /// The key of a listed container of this run.
    fn key_of(&self, container: &Listed) -> Option<ResourceKey> {
        let node = provisioning::LogicalNodeId::parse(&container.node).ok()?;
        Some((
            node,
            provisioning::NodeAttemptId::from_raw(container.attempt),
        ))
    }
}
