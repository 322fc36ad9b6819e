//! [`SlurmSubstrate`]: the conformance kit's `Level3Substrate` over real
//! Slurm jobs and job steps on the testbed, with [`SlurmWorld`] as the Slurm
//! plugin's part.
//!
//! # Work and settling
//! The executor's operations queue on a [`ManualSpawner`], so the trace
//! decides when work runs, in which order, and what is left pending across
//! a clock tick. Running work polls them on the harness thread inside the
//! substrate's tokio runtime (one worker thread, which also drives the
//! plugin's own tasks: its loss watch, its step followers, its swarm
//! listener). "Run everything" polls until every call has finished or hangs
//! on a command stopped on purpose (bounded by [`WORK`]);
//! "run one" polls one task once and may leave its call in flight.
//!
//! # Stream events, all real
//! - `joined`: the node's verify command reads `pass` from its boot gate (a
//!   named pipe); the agent starts the workload and joins the plugin's
//!   swarm over TCP, and the plugin reports the join.
//! - `failed boot-check-failed`: the gate says `fail`; the verify command
//!   fails and the agent reports it on the step's output.
//! - `failed start-failed`: the agent step's processes are SIGKILLed while
//!   the agent waits at its gate; the step ends before the agent joined.
//! - Refused (counted in [`FaultCounts`](super::FaultCounts)): progress,
//!   `converged`, `closed` and the other failure stages — the agent and the
//!   plugin produce those on their own, never on demand.
//!
//! # Losses, all real
//! - `lease-gone`: the node's job is cancelled by hand (`scancel`); the
//!   first such loss of every other run SIGKILLs the job's `slurmd`
//!   instead — its node goes down after `SlurmdTimeout`, the controller
//!   fails the job (`NODE_FAIL`) — and starts the `slurmd` again once the
//!   plugin reported the loss.
//! - `agent-gone`: the agent process of the node is SIGKILLed; its swarm
//!   connection drops. `workload-exited`: the workload is SIGKILLed.
//!
//! # What is live
//! Leases are counted from `squeue` alone: the run's jobs by name that
//! still hold or wait for an allocation (a job in `COMPLETING` is being
//! released by Slurm and is not counted). A bootstrap session counts as
//! live while the plugin has not reported its end and `squeue --steps`
//! shows its job's agent step.

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::signal::Signal;
use nix::sys::stat::Mode;
use provisioning::RunId;
use provisioning::observe::LossCause;
use provisioning::state::BootstrapFailure;
use provisioning_agent::RunSecret;
use provisioning_agent::os::{self, TaggedProcess};
use provisioning_conformance::level3::{Core, Level3Substrate, Level3World, WorkBounds};
use provisioning_conformance::substrate::{CallRecord, LiveResources, ResourceKey};
use provisioning_conformance::trace::{Fault, FaultTarget, StreamEvent, WorkStep};
use provisioning_provider::{PluginBackendAdapter, ProvisionPlugin};
use provisioning_slurm::parse::{self, AGENT_STEP, STEPS_FORMAT, parse_job_name};
use provisioning_slurm::{SlurmPlugin, SlurmPluginConfig};

use super::Level3;
use super::backend::{Defect, SlurmBackend, attempt_key};
use super::cli::{L3Cli, signal};
use super::shared::{FaultCounts, GateState, Shared, SlurmSession, SlurmShared, new_shared};

/// How running work is bounded: 30 s for real I/O to finish, looking again
/// every millisecond (the rounds are the wait bound divided by the poll
/// interval, so that the time bound is the one that bites).
const WORK: WorkBounds = WorkBounds {
    quiet_wait_max: Duration::from_secs(30),
    poll_interval: Duration::from_millis(1),
    rounds_max: 30_000,
};

/// How long an accepted session may take to reach its boot gate (a step
/// launch and an agent start on a loaded machine).
const BOOT_CHECK_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long an opened gate may take to end in a join or a failure.
const SESSION_OUTCOME_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long opening a gate waits for its verify command to open the pipe.
const GATE_READER_WAIT_MAX: Duration = Duration::from_secs(5);

/// How long a cancelled job or a killed agent may take to be reported lost.
const LOSS_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long a node whose `slurmd` was killed may take to be reported lost
/// (`SlurmdTimeout` is 10 s on the testbed).
const NODE_DOWN_LOSS_WAIT_MAX: Duration = Duration::from_secs(60);

/// How long a released create in a task of its own may take.
const DETACHED_CALL_WAIT_MAX: Duration = Duration::from_secs(30);

/// How long one orphan's destroy may take.
const ORPHAN_DESTROY_WAIT_MAX: Duration = Duration::from_secs(30);

/// How often the plugin looks for jobs that ended by themselves.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// How long a dropped agent connection may stay away before its node is lost.
const REJOIN_GRACE: Duration = Duration::from_millis(500);

/// Substrates started so far: every other one kills a `slurmd` for its
/// first `lease-gone` loss.
static SUBSTRATES: AtomicU32 = AtomicU32::new(0);

/// How a boot gate is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Pass,
    Fail,
}

/// The boot gates of one substrate: a named pipe per node attempt that the
/// node's verify command reads its verdict from.
#[derive(Debug)]
pub(crate) struct Gates {
    dir: PathBuf,
}

impl Gates {
    /// The gate directory, for the verify commands' environment.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &ResourceKey) -> PathBuf {
        self.dir.join(format!("{}.{}", key.0, key.1.get()))
    }

    /// Creates the gate of `key` unless it exists.
    pub(crate) fn prepare(&self, key: &ResourceKey) {
        match nix::unistd::mkfifo(&self.path(key), Mode::S_IRUSR | Mode::S_IWUSR) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(error) => eprintln!("level 3: cannot create the boot gate of {key:?}: {error}"),
        }
    }

    /// Writes `verdict` to a verify command waiting on `key`'s gate right
    /// now; whether one was waiting.
    fn open_now(&self, key: &ResourceKey, verdict: &str) -> bool {
        OpenOptions::new()
            .write(true)
            .custom_flags(OFlag::O_NONBLOCK.bits())
            .open(self.path(key))
            .is_ok_and(|mut pipe| pipe.write_all(format!("{verdict}\n").as_bytes()).is_ok())
    }

    /// Writes `verdict` to the verify command waiting on `key`'s gate once
    /// it has opened the pipe (bounded), unless `give_up` says it never will.
    fn open(&self, key: &ResourceKey, verdict: &str, give_up: impl Fn() -> bool) -> bool {
        let path = self.path(key);
        let deadline = Instant::now() + GATE_READER_WAIT_MAX;
        // Bounded by the deadline.
        loop {
            let opened = OpenOptions::new()
                .write(true)
                .custom_flags(OFlag::O_NONBLOCK.bits())
                .open(&path);
            match opened {
                Ok(mut pipe) => return pipe.write_all(format!("{verdict}\n").as_bytes()).is_ok(),
                // No reader yet (ENXIO), or the gate is not there.
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
}

/// The Level 3 substrate over Slurm jobs. See the module docs.
pub(crate) type SlurmSubstrate = Level3Substrate<SlurmWorld>;

/// The Slurm plugin's part of the substrate: the cluster (through the
/// context), the boot gates, the plugin and the backend.
pub(crate) struct SlurmWorld {
    context: Arc<Level3>,
    run: RunId,
    shared: Arc<Shared>,
    backend: Arc<SlurmBackend>,
    plugin: Arc<SlurmPlugin>,
    gates: Arc<Gates>,
    /// Whether this substrate may still kill a `slurmd` for a loss.
    may_kill_slurmd: bool,
    /// When the substrate started, for the summary.
    started: Instant,
    /// Holds the gates; removed last.
    _dir: tempfile::TempDir,
}

impl SlurmWorld {
    /// The tagged processes (verify command, workload) of `key`'s node.
    fn node_processes(&self, key: &ResourceKey) -> Vec<TaggedProcess> {
        os::node_processes(&attempt_key(&self.run, key))
            .unwrap_or_else(|error| panic!("level 3 needs a readable /proc: {error}"))
    }

    /// The agent of `key`: the parent of its verify command or workload.
    fn agent_pid(&self, key: &ResourceKey) -> Option<u32> {
        let processes = self.node_processes(key);
        let tagged: BTreeSet<i32> = processes.iter().map(|p| p.pid).collect();
        processes
            .iter()
            .map(|p| p.parent_pid)
            .find(|parent| !tagged.contains(parent) && *parent > 1)
            .and_then(|pid| u32::try_from(pid).ok())
    }

    /// SIGKILLs the agent of `key` and its tagged processes (or only the
    /// workload). Returns whether anything was killed.
    fn kill_node_processes(&self, key: &ResourceKey, workload_only: bool) -> bool {
        let agent = if workload_only {
            None
        } else {
            self.agent_pid(key)
        };
        let processes = self.node_processes(key);
        if agent.is_none() && (!workload_only || processes.is_empty()) {
            return false;
        }
        if let Some(agent) = agent {
            signal(agent, Signal::SIGKILL);
        }
        for process in processes {
            if let Ok(pid) = u32::try_from(process.pid) {
                signal(pid, Signal::SIGKILL);
            }
        }
        true
    }

    /// Opens the boot gate of `key` with `verdict` once its verify command
    /// waits, then waits (bounded) for the join or the failure.
    fn open_gate(&self, key: &ResourceKey, verdict: Verdict) -> bool {
        if !self.wait_at_gate(key) {
            return false;
        }
        let text = match verdict {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
        };
        let shared = &self.shared;
        let ended = || shared.lock().sessions().get(key).is_none_or(|t| t.ended);
        if !self.gates.open(key, text, ended) {
            return false;
        }
        shared.set_gate(
            key,
            match verdict {
                Verdict::Pass => GateState::Passed,
                Verdict::Fail => GateState::Failed,
            },
        );
        shared.wait_until(SESSION_OUTCOME_WAIT_MAX, |state| state.session_settled(key));
        true
    }

    /// Waits (bounded) until the session of `key` waits at its closed gate.
    fn wait_at_gate(&self, key: &ResourceKey) -> bool {
        let shared = &self.shared;
        shared.wait_until(BOOT_CHECK_WAIT_MAX, |state| {
            state
                .sessions()
                .get(key)
                .is_none_or(|t| t.ended || !t.accepted || t.boot_checking)
        });
        shared.lock().sessions().get(key).is_some_and(|t| {
            !t.ended && t.accepted && t.boot_checking && t.extra.gate == GateState::Closed
        })
    }

    /// The live job of `key` (id, node name), from `squeue`.
    fn job_of(&self, key: &ResourceKey) -> Option<(u64, String)> {
        self.context
            .live_jobs(&self.run)
            .into_iter()
            .filter(|(_, _, state, _)| state != "COMPLETING")
            .find(|(_, name, ..)| {
                parse_job_name(&self.run, name)
                    .is_some_and(|k| k.node == key.0 && k.attempt == key.1)
            })
            .map(|(id, _, _, nodes)| (id, nodes))
    }

    /// Loses the lease of `key` for real: its job cancelled by hand, or its
    /// node's `slurmd` SIGKILLed. Returns whether anything was lost.
    fn lose_lease(&mut self, key: &ResourceKey) -> bool {
        let Some((job, nodes)) = self.job_of(key) else {
            return false;
        };
        let slurmd = nodes
            .strip_prefix('n')
            .and_then(|index| index.parse::<usize>().ok())
            .filter(|_| self.may_kill_slurmd);
        if let Some(index) = slurmd {
            self.may_kill_slurmd = false;
            self.context.bed().kill_slurmd(index);
            self.shared.count(|f| f.slurmds_killed += 1);
            let lost = self
                .shared
                .wait_until(NODE_DOWN_LOSS_WAIT_MAX, |state| state.lost(key));
            self.context.bed().restart_slurmd(index);
            if !lost {
                eprintln!("level 3: the node of {key:?} (n{index}) was not reported lost");
            }
            return true;
        }
        let cancelled = self
            .context
            .bed()
            .client("scancel")
            .arg(job.to_string())
            .status()
            .is_ok_and(|s| s.success());
        if !cancelled {
            return false;
        }
        self.shared.count(|f| f.jobs_cancelled_by_hand += 1);
        self.shared
            .wait_until(LOSS_WAIT_MAX, |state| state.lost(key));
        true
    }

    /// The agent steps `squeue --steps` shows, by the key of their job.
    fn agent_steps(&self) -> BTreeSet<ResourceKey> {
        let output = self
            .context
            .bed()
            .client("squeue")
            .args(["--steps", "--noheader", &format!("--format={STEPS_FORMAT}")])
            .output();
        let Ok(output) = output else {
            panic!("level 3 cannot run squeue --steps");
        };
        let steps = parse::parse_steps(&String::from_utf8_lossy(&output.stdout))
            .unwrap_or_else(|error| panic!("squeue --steps printed something else: {error}"));
        let jobs: Vec<(u64, String)> = self
            .context
            .live_jobs(&self.run)
            .into_iter()
            .map(|(id, name, ..)| (id, name))
            .collect();
        steps
            .iter()
            .filter(|step| step.name == AGENT_STEP)
            .filter_map(|step| {
                let (_, name) = jobs.iter().find(|(id, _)| *id == step.job)?;
                let key = parse_job_name(&self.run, name)?;
                Some((key.node, key.attempt))
            })
            .collect()
    }
}

impl Level3World for SlurmWorld {
    type Context = Level3;
    type Defect = Defect;
    type Faults = FaultCounts;
    type Session = SlurmSession;
    type Hang = u32;
    type Backend = SlurmBackend;

    const HUNG_ON: &'static str = " on a stopped command";

    fn start(context: Arc<Level3>, defect: Option<Defect>) -> (Core<Self>, Self) {
        let run = context.next_run();
        let dir = tempfile::tempdir().expect("level 3 needs a temporary directory");
        let gates = Arc::new(Gates {
            dir: dir.path().join("gates"),
        });
        std::fs::create_dir(gates.dir()).expect("level 3 needs a gate directory");
        let shared = Arc::new(new_shared());
        let core = Core::<Self>::new(shared.clone(), "level3-runtime", WORK);
        let cli = Arc::new(L3Cli::new(
            context.client_conf(),
            context.closed_conf(),
            context.slow_closed_conf(),
            shared.clone(),
        ));
        let mut config = SlurmPluginConfig::new(
            run.clone(),
            RunSecret::generate(),
            vec![crate::common::AGENT.to_owned()],
        );
        config.slurm_conf = Some(context.client_conf().to_owned());
        config.watch_interval = WATCH_INTERVAL;
        config.rejoin_grace = REJOIN_GRACE;
        let plugin = Arc::new(
            core.block_on(SlurmPlugin::start_with_cli(config, cli))
                .expect("the runtime runs")
                .expect("the slurm plugin starts"),
        );
        let adapter =
            PluginBackendAdapter::single(plugin.clone() as Arc<dyn ProvisionPlugin>, core.sink());
        let backend = Arc::new(SlurmBackend::new(
            adapter,
            plugin.clone(),
            shared.clone(),
            context.clone(),
            run.clone(),
            gates.clone(),
            defect,
        ));
        let may_kill_slurmd = SUBSTRATES.fetch_add(1, Ordering::Relaxed) % 2 == 1;
        let parts = SlurmWorld {
            context,
            run,
            shared,
            backend,
            plugin,
            gates,
            may_kill_slurmd,
            started: Instant::now(),
            _dir: dir,
        };
        (core, parts)
    }

    fn run(&self) -> &RunId {
        &self.run
    }

    fn backend(&self) -> Arc<SlurmBackend> {
        self.backend.clone()
    }

    fn take_calls(&self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn script(&mut self, _core: &Core<Self>, target: FaultTarget, fault: Fault) -> bool {
        self.shared.script_counted(target, fault)
    }

    /// Continues hung call `serial`'s command. Returns whether it was hung.
    fn release_hang(&mut self, core: &Core<Self>, serial: u64) -> bool {
        let Some(hang) = self.shared.release(serial) else {
            return false;
        };
        signal(hang.what, Signal::SIGCONT);
        self.shared.notify();
        // A held create in a task of its own is performed at once (its
        // executor may be gone): wait (bounded) for it, then poll the ready
        // work, so that its answer reaches whoever waits for it and what it
        // made is there for the next call to find.
        if self.shared.lock().is_detached(hang.op) {
            self.shared
                .wait_until(DETACHED_CALL_WAIT_MAX, |state| !state.is_detached(hang.op));
            core.run_work(WorkStep::Fifo, || {
                core.describe_work(Self::HUNG_ON, &self.run)
            });
        }
        true
    }

    /// Refuses (counted) what the substrate cannot produce: progress,
    /// `converged`, `closed` and the other failure stages.
    fn streamable(&mut self, _core: &Core<Self>, event: StreamEvent) -> bool {
        let producible = matches!(
            event,
            StreamEvent::Joined
                | StreamEvent::Failed(
                    BootstrapFailure::BootCheckFailed | BootstrapFailure::StartFailed
                )
        );
        if !producible {
            self.shared.count(|f| f.refused_stream_events += 1);
        }
        producible
    }

    fn stream(&mut self, _core: &Core<Self>, key: &ResourceKey, event: StreamEvent) -> bool {
        match event {
            StreamEvent::Joined => self.open_gate(key, Verdict::Pass),
            StreamEvent::Failed(BootstrapFailure::BootCheckFailed) => {
                self.open_gate(key, Verdict::Fail)
            }
            StreamEvent::Failed(BootstrapFailure::StartFailed) => {
                // The agent step dies before its agent joined.
                let killed = self.wait_at_gate(key) && self.kill_node_processes(key, false);
                if killed {
                    self.shared.count(|f| f.steps_killed += 1);
                    self.shared
                        .wait_until(LOSS_WAIT_MAX, |state| state.session_settled(key));
                }
                killed
            }
            StreamEvent::Progress(_)
            | StreamEvent::Converged
            | StreamEvent::Closed
            | StreamEvent::Failed(_) => false,
        }
    }

    fn lose(&mut self, _core: &Core<Self>, key: &ResourceKey, cause: LossCause) -> bool {
        let lost = match cause {
            LossCause::LeaseGone => self.lose_lease(key),
            LossCause::AgentGone | LossCause::WorkloadExited | LossCause::WorkloadEnded(_) => {
                let killed = self.kill_node_processes(key, cause.is_workload_exit());
                if killed {
                    self.shared.count(|f| f.agents_killed += 1);
                    self.shared
                        .wait_until(LOSS_WAIT_MAX, |state| state.lost(key));
                }
                killed
            }
        };
        if !lost {
            self.shared.count(|f| f.losses_not_applied += 1);
        }
        lost
    }

    fn fair_progress(&mut self, _core: &Core<Self>) -> usize {
        let shared = &self.shared;
        // Agents that took their boot order reach their gate, and opened
        // gates end in a join or a failure, on their own: wait for both,
        // once per session (an adopted agent step reports no stage).
        shared.wait_until(BOOT_CHECK_WAIT_MAX, |state| {
            state.sessions().iter().all(|(key, t)| {
                t.ended
                    || !t.accepted
                    || t.extra.waited
                    || (t.extra.gate == GateState::Closed && t.boot_checking)
                    || (t.extra.gate != GateState::Closed && state.session_settled(key))
            })
        });
        let waiting: Vec<(ResourceKey, bool)> = {
            let mut state = shared.lock();
            state
                .ledger
                .sessions_mut()
                .filter(|(_, t)| !t.ended && t.accepted && t.extra.gate == GateState::Closed)
                .map(|(key, t)| {
                    t.extra.waited = true;
                    (key.clone(), t.boot_checking)
                })
                .collect()
        };
        waiting
            .iter()
            .filter(|(key, reported)| {
                if *reported {
                    self.open_gate(key, Verdict::Pass)
                } else {
                    // No stage reported, yet a verify command may wait at
                    // the gate (an adopted agent step): open it if so.
                    self.gates.open_now(key, "pass") && {
                        shared.set_gate(key, GateState::Passed);
                        shared.wait_until(SESSION_OUTCOME_WAIT_MAX, |state| {
                            state.session_settled(key)
                        });
                        true
                    }
                }
            })
            .count()
    }

    fn live_resources(&self, _core: &Core<Self>) -> LiveResources {
        let mut live = LiveResources::default();
        for (_, name, state, _) in self.context.live_jobs(&self.run) {
            if state == "COMPLETING" {
                continue;
            }
            let Some(key) = parse_job_name(&self.run, &name) else {
                continue;
            };
            *live.leases.entry((key.node, key.attempt)).or_insert(0) += 1;
        }
        let tracked: Vec<ResourceKey> = self
            .shared
            .lock()
            .sessions()
            .iter()
            .filter(|(key, t)| !t.ended && live.leases.contains_key(key))
            .map(|(key, _)| key.clone())
            .collect();
        if !tracked.is_empty() {
            let steps = self.agent_steps();
            for key in tracked {
                if steps.contains(&key) {
                    live.sessions.insert(key, 1);
                }
            }
        }
        live
    }

    /// The plugin lives on across the crash, as the jobs and agent steps
    /// do; its sessions go quiet until the recovered controller's adopting
    /// starts re-attach them, as a restarted plugin would find them.
    fn controller_restarted(&mut self, _core: &Core<Self>) {
        self.plugin.controller_replaced();
    }

    /// Destroys an orphan the way the durable host does (see the kit's
    /// `SubstrateCore::destroy_listed`). Whether anything was live comes
    /// from `squeue`.
    fn destroy_orphan(&mut self, core: &Core<Self>, key: &ResourceKey) -> bool {
        self.job_of(key).is_some()
            && core.destroy_listed(&self.plugin, &self.run, key, ORPHAN_DESTROY_WAIT_MAX)
    }

    /// Cancels the run's jobs by hand once the runtime stopped.
    fn torn_down(&mut self, _core: &Core<Self>) {
        let left = self.context.cancel_run(&self.run);
        if !left.is_empty() {
            eprintln!("level 3: jobs of run {} did not go: {left:?}", self.run);
        }
        let counts = self.shared.lock().faults;
        self.context.finished(&counts);
        eprintln!(
            "level 3: run {} took {:.1} s",
            self.run,
            self.started.elapsed().as_secs_f64()
        );
    }
}
