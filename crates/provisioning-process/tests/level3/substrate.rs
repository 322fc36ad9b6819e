//! [`ProcessSubstrate`]: the conformance kit's [`Substrate`] over real node
//! agent processes.
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

use provisioning::effect::SessionHandle;
use provisioning::observe::LossCause;
use provisioning::spawn::{ManualSpawner, Spawner};
use provisioning::state::BootstrapFailure;
use provisioning::{LeaseHandle, LogicalNodeId, NodeAttemptId, Observation};
use provisioning_agent::os;
use provisioning_conformance::level3::{WorkBounds, run_work};
use provisioning_conformance::substrate::{
    CallRecord, Capabilities, LiveResources, ResourceKey, Substrate, SubstrateCounters,
};
use provisioning_conformance::trace::{Fault, FaultTarget, StreamEvent, WorkStep};
use provisioning_process::{AgentCommand, ProcessPlugin, ProcessPluginConfig};
use provisioning_provider::{ObservationSink, PluginBackendAdapter, ProvisionPlugin};

use super::Level3;
use super::backend::{Defect, ProcessBackend, World};
use super::os_faults::{self, AgentProgram, GateOpening, Gates, HELD_AGENT_NAME, SHELL};
use super::shared::{GateState, ProcessShared, Shared, new_shared};

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

/// How long the runtime may take to stop its tasks at teardown.
const RUNTIME_SHUTDOWN_WAIT_MAX: Duration = Duration::from_secs(5);

/// The runtime's worker threads (the harness thread polls the executor's work).
const RUNTIME_WORKERS: usize = 1;

/// How a boot gate is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Pass,
    Fail,
}

/// The Level 3 substrate. See the module docs.
pub(crate) struct ProcessSubstrate {
    context: Arc<Level3>,
    world: Arc<World>,
    shared: Arc<Shared>,
    backend: Arc<ProcessBackend>,
    plugin: Arc<ProcessPlugin>,
    spawner: ManualSpawner,
    runtime: Option<tokio::runtime::Runtime>,
    /// Holds the agent program's symlink and the gates; removed last.
    _dir: tempfile::TempDir,
}

impl ProcessSubstrate {
    /// A fresh substrate with its own run, runtime and plugin.
    ///
    /// # Panics
    /// When the test environment cannot provide them (no temporary
    /// directory, no runtime, no loopback): Level 3 fails loudly then.
    pub(crate) fn new(context: Arc<Level3>) -> Self {
        ProcessSubstrate::with_defect(context, None)
    }

    /// A substrate whose backend has a deliberate [`Defect`], for the test
    /// that shows the operating-system counts bite.
    ///
    /// # Panics
    /// As [`ProcessSubstrate::new`].
    pub(crate) fn with_defect(context: Arc<Level3>, defect: Option<Defect>) -> Self {
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
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_WORKERS)
            .thread_name("level3-runtime")
            .enable_all()
            .build()
            .expect("level 3 needs a tokio runtime");
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
        let plugin = runtime
            .block_on(ProcessPlugin::start(config))
            .expect("the process plugin starts");
        let shared = Arc::new(new_shared());
        let reporter = shared.clone();
        let sink = ObservationSink::new(move |observation| reporter.observe(observation));
        let adapter =
            PluginBackendAdapter::single(plugin.clone() as Arc<dyn ProvisionPlugin>, sink);
        let backend = Arc::new(ProcessBackend::new(
            adapter,
            plugin.clone(),
            shared.clone(),
            world.clone(),
            defect,
        ));
        ProcessSubstrate {
            context,
            world,
            shared,
            backend,
            plugin,
            spawner: ManualSpawner::new(),
            runtime: Some(runtime),
            _dir: dir,
        }
    }

    /// Runs `step` of the work inside the runtime (see the kit's
    /// `level3::run_work`): everything until no call does I/O and nothing is
    /// ready (calls hung on a stopped agent may stay), or one task once.
    /// Returns the polls.
    fn run_work_step(&self, step: WorkStep) -> usize {
        let Some(runtime) = &self.runtime else {
            return 0;
        };
        let _context = runtime.enter();
        run_work(
            &self.spawner,
            step,
            &WORK,
            || self.shared.lock().busy_calls(),
            || self.describe_work(),
        )
    }

    /// Opens the boot gate of `key` with `verdict` once its verify command
    /// waits, then waits (bounded) for the join or the failure. Returns
    /// whether the gate was opened.
    fn open_gate(&self, key: &ResourceKey, verdict: Verdict) -> bool {
        let shared = &self.shared;
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

    /// Continues hung call `serial`'s agent. Returns whether it was hung.
    fn release_hang(&self, serial: u64) -> bool {
        let Some(hang) = self.shared.lock().release_hang(serial) else {
            return false;
        };
        if let Some(pid) = hang.what.pid {
            self.shared.count(|os| os.agents_continued += 1);
            os_faults::continue_agent(&self.world.run, &hang.what.key, pid);
        }
        true
    }

    fn unreleased_hangs(&self) -> Vec<u64> {
        self.shared.lock().unreleased_hangs()
    }

    /// Stops everything of the run: drains calls in flight (so that none is
    /// cut off between a spawn and its bookkeeping), shuts the plugin down,
    /// drops queued work, and kills whatever survived.
    fn teardown(&mut self) {
        self.shared.stop_faults();
        self.world.program.restore();
        self.release_all_hangs();
        if self.shared.lock().busy_calls() > 0 {
            self.run_work_step(WorkStep::Fifo);
        }
        if let Some(runtime) = self.runtime.take() {
            let plugin = self.plugin.clone();
            let stopped = runtime.block_on(async move {
                tokio::time::timeout(SHUTDOWN_WAIT_MAX, plugin.shutdown())
                    .await
                    .is_ok()
            });
            if !stopped {
                eprintln!(
                    "level 3: the plugin of run {} did not shut down within {SHUTDOWN_WAIT_MAX:?}",
                    self.world.run
                );
            }
            {
                let _context = runtime.enter();
                self.spawner.clear();
            }
            runtime.shutdown_timeout(RUNTIME_SHUTDOWN_WAIT_MAX);
        }
        let proc_unreadable = |error| panic!("level 3 needs a readable /proc: {error}");
        // What the plugin's shutdown left is a leak; the kill that follows
        // only makes sure the test leaves nothing behind either way.
        let outlived = os::run_processes(&self.world.run).unwrap_or_else(proc_unreadable);
        let unkillable =
            os::kill_run(&self.world.run, KILL_WAIT_MAX).unwrap_or_else(proc_unreadable);
        self.backend.reap_strays();
        let counts = self.shared.lock().faults;
        self.context
            .finished(&self.world.run, &counts, &outlived, &unkillable);
    }
}

impl Drop for ProcessSubstrate {
    fn drop(&mut self) {
        self.teardown();
    }
}

impl Substrate for ProcessSubstrate {
    type Backend = ProcessBackend;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            deterministic: false,
        }
    }

    fn backend(&self) -> Arc<ProcessBackend> {
        self.backend.clone()
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        Arc::new(self.spawner.clone())
    }

    fn script(&mut self, target: FaultTarget, fault: Fault) -> bool {
        self.shared.script(target, fault).is_queued()
    }

    fn stop_faults(&mut self) {
        self.shared.stop_faults();
        self.world.program.restore();
    }

    fn run_work(&mut self, step: WorkStep) -> usize {
        self.run_work_step(step)
    }

    fn has_runnable_work(&self) -> bool {
        self.spawner.ready_count() > 0 || self.shared.lock().busy_calls() > 0
    }

    fn release_oldest_hang(&mut self) -> bool {
        self.unreleased_hangs()
            .into_iter()
            .any(|serial| self.release_hang(serial))
    }

    fn release_all_hangs(&mut self) -> usize {
        self.unreleased_hangs()
            .into_iter()
            .filter(|serial| self.release_hang(*serial))
            .count()
    }

    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        let live = self.shared.lock().live_sessions();
        if live.is_empty() {
            return None;
        }
        let key = live[session as usize % live.len()].clone();
        let produced = match event {
            StreamEvent::Joined => self.open_gate(&key, Verdict::Pass),
            StreamEvent::Failed(BootstrapFailure::BootCheckFailed) => {
                self.open_gate(&key, Verdict::Fail)
            }
            StreamEvent::Failed(BootstrapFailure::StartFailed) => {
                // The verify command passes; starting the workload then finds
                // no program to run.
                let opened = {
                    let _missing = self.world.program.remove();
                    self.open_gate(&key, Verdict::Pass)
                };
                let failed = self
                    .shared
                    .lock()
                    .sessions()
                    .get(&key)
                    .and_then(|t| t.failure);
                if failed == Some(BootstrapFailure::StartFailed) {
                    self.shared.count(|os| os.start_failures += 1);
                }
                opened
            }
            StreamEvent::Failed(BootstrapFailure::StreamError) => {
                // The agent dies mid-session: its control connection breaks.
                let killed = os_faults::kill_agent(&self.world.run, &key);
                if killed {
                    self.shared.count(|os| os.nodes_killed += 1);
                    self.shared
                        .wait_until(LOSS_WAIT_MAX, |state| state.session_settled(&key));
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
        };
        produced.then_some(key)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        let key = (node.clone(), attempt);
        let killed = match cause {
            LossCause::AgentGone | LossCause::WorkloadExited => {
                usize::from(os_faults::kill_agent(&self.world.run, &key))
            }
            LossCause::LeaseGone => os_faults::kill_node(&self.world.run, &key),
        };
        if killed == 0 {
            return false;
        }
        self.shared.count(|os| os.nodes_killed += 1);
        self.shared
            .wait_until(LOSS_WAIT_MAX, |state| state.lost(&key));
        true
    }

    fn fair_progress(&mut self) -> usize {
        let shared = &self.shared;
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
            .filter(|key| self.open_gate(key, Verdict::Pass))
            .count()
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        self.shared.take_observations()
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn live_resources(&self) -> LiveResources {
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
        let state = self.shared.lock();
        for (key, track) in state.sessions() {
            if track.is_live() && live.leases.contains_key(key) {
                live.sessions.insert(key.clone(), 1);
            }
        }
        live
    }

    fn take_ledger_alarms(&mut self) -> Vec<String> {
        self.shared.take_alarms()
    }

    /// The agents are processes of their own: a crash of the controller (the
    /// harness's driver and executor) leaves them, and the plugin that
    /// watches them, running.
    fn survives_controller_crash(&self) -> bool {
        true
    }

    /// The plugin lives on across the crash, as its agents do; its live
    /// sessions go quiet until the recovered controller's adopting starts
    /// re-attach them, as a restarted plugin's adopted agents would.
    fn controller_restarted(&mut self) {
        self.plugin.controller_replaced();
    }

    /// Destroys an orphan the way the durable host does: the plugin lists
    /// the run, and the listed lease of `key` is destroyed through the real
    /// `destroy_node`. Whether anything was live comes from `/proc`.
    fn destroy_orphan(&mut self, key: &ResourceKey) -> bool {
        if os_faults::node_processes(&self.world.run, key).is_empty() {
            return false;
        }
        let Some(runtime) = &self.runtime else {
            return false;
        };
        let plugin = self.plugin.clone();
        let attempt = os_faults::attempt_key(&self.world.run, key);
        let run = self.world.run.clone();
        let destroyed = runtime.block_on(async move {
            let listed = plugin.list_nodes(&run).await.ok()?;
            let lease = listed.into_iter().find(|l| l.key == attempt)?.lease;
            tokio::time::timeout(
                ORPHAN_DESTROY_WAIT_MAX,
                plugin.destroy_node(&attempt, &lease),
            )
            .await
            .ok()?
            .ok()
        });
        if destroyed.is_none() {
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

    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.shared.lease_owner(lease)
    }

    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.shared.session_owner(session)
    }

    fn counters(&self) -> SubstrateCounters {
        self.shared.counters()
    }

    fn describe_work(&self) -> String {
        let state = self.shared.lock();
        let processes = os::run_processes(&self.world.run)
            .map(|p| {
                let stopped = p.iter().filter(|p| p.state == 'T').count();
                format!("{} live process(es), {stopped} stopped", p.len())
            })
            .unwrap_or_else(|error| format!("/proc unreadable: {error}"));
        format!(
            "{} task(s) queued ({} runnable), {} call(s) doing I/O, {} hung on a stopped agent, \
             {} scripted fault(s) unused, {} live session(s); run {}: {processes}",
            self.spawner.len(),
            self.spawner.ready_count(),
            state.busy_calls(),
            state.hung_calls(),
            state.unused_scripts(),
            state.live_sessions().len(),
            self.world.run,
        )
    }
}
