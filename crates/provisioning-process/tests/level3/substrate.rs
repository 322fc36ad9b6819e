//! [`ProcessSubstrate`]: the conformance kit's `Level3Substrate` over real
//! node agent processes, with [`ProcessWorld`] as the process plugin's part.
//!
//! # Work and settling
//! The executor's operations queue on a [`ManualSpawner`], so the trace
//! decides when work runs, in which order, and what is left pending across a
//! clock tick, exactly as at Level 1. Running work polls them on the harness
//! thread inside the substrate's tokio runtime (one worker thread, which also
//! drives the plugin's own tasks: process watchers, sessions, the swarm
//! listener). Because the calls do real I/O, "run everything" keeps polling
//! until every call has finished or hangs on an agent the substrate stopped
//! on purpose (bounded by [`WORK_QUIET_WAIT_MAX`]); "run one" polls one task
//! once and may leave its call in flight, a slow call the trace can time out.
//!
//! # Time
//! The harness's clock is virtual; real time only passes inside the bounded
//! waits. An operation deadline is virtual too, but a hang is real: the call
//! waits on a stopped agent until `SIGCONT`, whatever the harness does in
//! between, and its late answer is dropped by the executor.
//!
//! # What is live
//! Leases are counted from `/proc` alone: the run's tagged process-group
//! leaders (agents), per node and attempt ([`provisioning_agent::os`]). A
//! bootstrap session has no process of its own; it counts as live while the
//! plugin has not reported its end and its agent is alive in `/proc`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::observe::LossCause;
use provisioning::state::BootstrapFailure;
use provisioning::{LogicalNodeId, NodeAttemptId, RunId};
use provisioning_agent::os;
use provisioning_conformance::level3::{Core, Level3Substrate, Level3World, WorkBounds};
use provisioning_conformance::substrate::{CallRecord, LiveResources, ResourceKey};
use provisioning_conformance::trace::StreamEvent;
use provisioning_process::{AgentCommand, ProcessPlugin, ProcessPluginConfig};
use provisioning_provider::{PluginBackendAdapter, ProvisionPlugin};

use super::Level3;
use super::backend::{Defect, ProcessBackend, World};
use super::os_faults::{self, AgentProgram, GateOpening, Gates, HELD_AGENT_NAME, SHELL};
use super::shared::{GateState, OsFaultCounts, ProcessShared, Stopped, new_shared};

/// The grace between `SIGTERM` and `SIGKILL` when a node is destroyed.
pub(crate) const STOP_GRACE: Duration = Duration::from_millis(200);

/// How long running work waits for real I/O to finish.
pub(crate) const WORK_QUIET_WAIT_MAX: Duration = Duration::from_secs(20);

/// How often running work looks again while calls do I/O (and an orphan's
/// destroy looks whether its processes went).
const WORK_POLL_INTERVAL: Duration = Duration::from_micros(500);

/// How running work is bounded (the rounds are the wait bound divided by
/// the poll interval, so that the time bound is the one that bites).
const WORK: WorkBounds = WorkBounds {
    quiet_wait_max: WORK_QUIET_WAIT_MAX,
    poll_interval: WORK_POLL_INTERVAL,
    rounds_max: 40_000,
};

/// How long an accepted session may take to reach its boot gate.
const BOOT_CHECK_WAIT_MAX: Duration = Duration::from_secs(5);

/// How long an opened gate may take to end in a join or a failure.
const SESSION_OUTCOME_WAIT_MAX: Duration = Duration::from_secs(5);

/// How long a killed node may take to be reported lost.
const LOSS_WAIT_MAX: Duration = Duration::from_secs(5);

/// How long one orphan's destroy may take.
const ORPHAN_DESTROY_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long teardown waits for the plugin's shutdown.
const SHUTDOWN_WAIT_MAX: Duration = Duration::from_secs(20);

/// How long teardown keeps killing what is left of the run.
const KILL_WAIT_MAX: Duration = Duration::from_secs(10);

/// How a boot gate is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Pass,
    Fail,
}

/// The Level 3 substrate over real processes. See the module docs.
pub(crate) type ProcessSubstrate = Level3Substrate<ProcessWorld>;

/// The process plugin's part of the substrate: its run's operating-system
/// world, the plugin and the backend.
pub(crate) struct ProcessWorld {
    context: Arc<Level3>,
    world: Arc<World>,
    backend: Arc<ProcessBackend>,
    plugin: Arc<ProcessPlugin>,
    /// Holds the agent program's symlink and the gates; removed last.
    _dir: tempfile::TempDir,
}

impl ProcessWorld {
    /// Opens the boot gate of `key` with `verdict` once its verify command
    /// waits, then waits (bounded) for the join or the failure. Returns
    /// whether the gate was opened.
    fn open_gate(&self, core: &Core<Self>, key: &ResourceKey, verdict: Verdict) -> bool {
        let shared = core.shared();
        // An accepted session reaches its gate on its own, a moment later.
        shared.wait_until(BOOT_CHECK_WAIT_MAX, |state| {
            state
                .sessions()
                .get(key)
                .is_none_or(|t| t.ended || !t.accepted || t.boot_checking)
        });
        let waiting = shared.lock().sessions().get(key).is_some_and(|t| {
            t.is_live() && t.accepted && t.boot_checking && t.extra == GateState::Closed
        });
        if !waiting {
            return false;
        }
        let (text, gate) = match verdict {
            Verdict::Pass => ("pass", GateState::Passed),
            Verdict::Fail => ("fail", GateState::Failed),
        };
        let ended = || shared.lock().sessions().get(key).is_none_or(|t| t.ended);
        if self.world.gates.open(key, text, ended) != GateOpening::Delivered {
            return false;
        }
        shared.set_gate(key, gate);
        shared.wait_until(SESSION_OUTCOME_WAIT_MAX, |state| state.session_settled(key));
        true
    }
}

impl Level3World for ProcessWorld {
    type Context = Level3;
    type Defect = Defect;
    type Faults = OsFaultCounts;
    type Session = GateState;
    type Hang = Stopped;
    type Backend = ProcessBackend;

    const HUNG_ON: &'static str = " on a stopped agent";

    /// # Panics
    /// When the test environment cannot provide a temporary directory, a
    /// runtime or loopback: Level 3 fails loudly then.
    fn start(context: Arc<Level3>, defect: Option<Defect>) -> (Core<Self>, Self) {
        let run = context.next_run();
        let dir = tempfile::tempdir().expect("level 3 needs a temporary directory");
        let program = AgentProgram::create(dir.path(), HELD_AGENT_NAME, Path::new(SHELL))
            .expect("level 3 needs a symlink");
        let gates_dir = dir.path().join("gates");
        std::fs::create_dir(&gates_dir).expect("level 3 needs a gate directory");
        let world = Arc::new(World {
            run: run.clone(),
            program,
            gates: Gates::new(gates_dir),
        });
        let core = Core::<Self>::new(Arc::new(new_shared()), "level3-runtime", WORK);
        let agent = AgentCommand::new(
            world.program.path(),
            [
                "-c".into(),
                os_faults::agent_script(context.agent_binary()).into(),
                "level3-agent".into(),
            ],
        );
        let mut config = ProcessPluginConfig::new(run, agent);
        config.stop_grace = STOP_GRACE;
        let plugin = core
            .block_on(ProcessPlugin::start(config))
            .expect("the runtime runs")
            .expect("the process plugin starts");
        let adapter =
            PluginBackendAdapter::single(plugin.clone() as Arc<dyn ProvisionPlugin>, core.sink());
        let backend = Arc::new(ProcessBackend::new(
            adapter,
            plugin.clone(),
            core.shared().clone(),
            world.clone(),
            defect,
        ));
        let parts = ProcessWorld {
            context,
            world,
            backend,
            plugin,
            _dir: dir,
        };
        (core, parts)
    }

    fn run(&self) -> &RunId {
        &self.world.run
    }

    fn backend(&self) -> Arc<ProcessBackend> {
        self.backend.clone()
    }

    fn take_calls(&self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn stop_faults(&mut self, _core: &Core<Self>) {
        self.world.program.restore();
    }

    /// Continues hung call `serial`'s agent. Returns whether it was hung.
    fn release_hang(&mut self, core: &Core<Self>, serial: u64) -> bool {
        let Some(hang) = core.shared().lock().release_hang(serial) else {
            return false;
        };
        if let Some(pid) = hang.what.pid {
            core.shared().count(|os| os.agents_continued += 1);
            os_faults::continue_agent(&self.world.run, &hang.what.key, pid);
        }
        true
    }

    fn stream(&mut self, core: &Core<Self>, key: &ResourceKey, event: StreamEvent) -> bool {
        let shared = core.shared();
        match event {
            StreamEvent::Joined => self.open_gate(core, key, Verdict::Pass),
            StreamEvent::Failed(BootstrapFailure::BootCheckFailed) => {
                self.open_gate(core, key, Verdict::Fail)
            }
            StreamEvent::Failed(BootstrapFailure::StartFailed) => {
                // The verify command passes; starting the workload then finds
                // no program to run.
                let opened = {
                    let _missing = self.world.program.remove();
                    self.open_gate(core, key, Verdict::Pass)
                };
                let failed = shared.lock().sessions().get(key).and_then(|t| t.failure);
                if failed == Some(BootstrapFailure::StartFailed) {
                    shared.count(|os| os.start_failures += 1);
                }
                opened
            }
            StreamEvent::Failed(BootstrapFailure::StreamError) => {
                // The agent dies mid-session: its control connection breaks.
                let killed = os_faults::kill_agent(&self.world.run, key);
                if killed {
                    shared.count(|os| os.nodes_killed += 1);
                    shared.wait_until(LOSS_WAIT_MAX, |state| state.session_settled(key));
                }
                killed
            }
            // Progress, convergence, a close before the join and the other
            // failure stages are the agent's and the plugin's own doing; a
            // real process cannot be made to report them on demand.
            StreamEvent::Progress(_)
            | StreamEvent::Converged
            | StreamEvent::Closed
            | StreamEvent::Failed(_) => false,
        }
    }

    fn lose(&mut self, core: &Core<Self>, key: &ResourceKey, cause: LossCause) -> bool {
        let killed = match cause {
            LossCause::AgentGone | LossCause::WorkloadExited | LossCause::WorkloadEnded(_) => {
                usize::from(os_faults::kill_agent(&self.world.run, key))
            }
            LossCause::LeaseGone => os_faults::kill_node(&self.world.run, key),
        };
        if killed == 0 {
            return false;
        }
        core.shared().count(|os| os.nodes_killed += 1);
        core.shared()
            .wait_until(LOSS_WAIT_MAX, |state| state.lost(key));
        true
    }

    fn fair_progress(&mut self, core: &Core<Self>) -> usize {
        let shared = core.shared();
        // Agents that took their boot order reach their gate, and opened
        // gates end in a join or a failure, on their own: wait for both.
        shared.wait_until(BOOT_CHECK_WAIT_MAX, |state| {
            state.sessions().iter().all(|(key, t)| {
                t.ended
                    || !t.accepted
                    || (t.extra == GateState::Closed && t.boot_checking)
                    || (t.extra != GateState::Closed && state.session_settled(key))
            })
        });
        let waiting: Vec<ResourceKey> = shared
            .lock()
            .sessions()
            .iter()
            .filter(|(_, t)| t.is_live() && t.boot_checking && t.extra == GateState::Closed)
            .map(|(key, _)| key.clone())
            .collect();
        waiting
            .iter()
            .filter(|key| self.open_gate(core, key, Verdict::Pass))
            .count()
    }

    fn live_resources(&self, core: &Core<Self>) -> LiveResources {
        let agents = os::agents(&self.world.run)
            .unwrap_or_else(|error| panic!("level 3 needs a readable /proc: {error}"));
        let mut live = LiveResources::default();
        for agent in agents {
            let node = agent
                .node
                .as_deref()
                .and_then(|node| LogicalNodeId::parse(node).ok());
            let (Some(node), Some(attempt)) = (node, agent.attempt) else {
                continue;
            };
            *live
                .leases
                .entry((node, NodeAttemptId::from_raw(attempt)))
                .or_insert(0) += 1;
        }
        let state = core.shared().lock();
        for (key, track) in state.sessions() {
            if track.is_live() && live.leases.contains_key(key) {
                live.sessions.insert(key.clone(), 1);
            }
        }
        live
    }

    /// The plugin lives on across the crash, as its agents do; its live
    /// sessions go quiet until the recovered controller's adopting starts
    /// re-attach them, as a restarted plugin's adopted agents would.
    fn controller_restarted(&mut self, _core: &Core<Self>) {
        self.plugin.controller_replaced();
    }

    /// Destroys an orphan the way the durable host does (see the kit's
    /// `SubstrateCore::destroy_listed`). Whether anything was live comes
    /// from `/proc`.
    fn destroy_orphan(&mut self, core: &Core<Self>, key: &ResourceKey) -> bool {
        if os_faults::node_processes(&self.world.run, key).is_empty() {
            return false;
        }
        if !core.destroy_listed(&self.plugin, &self.world.run, key, ORPHAN_DESTROY_WAIT_MAX) {
            return false;
        }
        // The destroy waits for the agent's process group; what it missed
        // stays in `/proc`, where G23 and the teardown find it.
        let deadline = Instant::now() + LOSS_WAIT_MAX;
        while !os_faults::node_processes(&self.world.run, key).is_empty()
            && Instant::now() < deadline
        {
            std::thread::sleep(WORK_POLL_INTERVAL);
        }
        true
    }

    fn describe_world(&self, _core: &Core<Self>) -> Option<String> {
        Some(
            os::run_processes(&self.world.run)
                .map(|p| {
                    let stopped = p.iter().filter(|p| p.state == 'T').count();
                    format!("{} live process(es), {stopped} stopped", p.len())
                })
                .unwrap_or_else(|error| format!("/proc unreadable: {error}")),
        )
    }

    /// Shuts the plugin down before the runtime stops (draining first, so
    /// that no call is cut off between a spawn and its bookkeeping).
    fn runtime_stopping(&mut self, core: &Core<Self>) {
        let plugin = self.plugin.clone();
        let stopped = core.block_on(async move {
            tokio::time::timeout(SHUTDOWN_WAIT_MAX, plugin.shutdown())
                .await
                .is_ok()
        });
        if stopped == Some(false) {
            eprintln!(
                "level 3: the plugin of run {} did not shut down within {SHUTDOWN_WAIT_MAX:?}",
                self.world.run
            );
        }
    }

    /// Kills whatever survived, and records it.
    fn torn_down(&mut self, core: &Core<Self>) {
        let proc_unreadable = |error| panic!("level 3 needs a readable /proc: {error}");
        // What the plugin's shutdown left is a leak; the kill that follows
        // only makes sure the test leaves nothing behind either way.
        let outlived = os::run_processes(&self.world.run).unwrap_or_else(proc_unreadable);
        let unkillable =
            os::kill_run(&self.world.run, KILL_WAIT_MAX).unwrap_or_else(proc_unreadable);
        self.backend.reap_strays();
        let counts = core.shared().lock().faults;
        self.context
            .finished(&self.world.run, &counts, &outlived, &unkillable);
    }
}
