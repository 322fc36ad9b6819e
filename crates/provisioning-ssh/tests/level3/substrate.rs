//! [`SshSubstrate`]: the conformance kit's [`Substrate`] over the real ssh
//! plugin and namespaced sshd hosts.
//!
//! # Work and settling
//! The executor's operations queue on a [`ManualSpawner`], so the trace
//! decides when work runs and in which order. Running work polls them on
//! the harness thread inside the substrate's tokio runtime (one worker
//! thread, which also drives the plugin's own tasks: the swarm listener,
//! join watchdogs, `ssh` child processes). "Run everything" keeps polling
//! until every call has finished or is hung on purpose (bounded by
//! [`WORK_QUIET_WAIT_MAX`]); "run one" polls one task once and may leave
//! its call in flight.
//!
//! # Sessions and stream events
//! Every agent starts behind a boot gate (see `hosts::write_gate_agent`):
//! a `stream … joined` input, or the fair tail, opens the gate and the real
//! agent joins the plugin's swarm listener over TCP. A lost agent is a
//! real `SIGKILL` of the remote agent, an exited workload a `SIGKILL` of
//! the remote workload, a lost lease the agent's whole group killed and
//! its claim removed on the host; each waits (bounded) until the plugin
//! reports the loss.
//!
//! # What is live
//! Counted from the hosts alone, never from the plugin: a lease is a claim
//! directory on a host, or a live agent (in `/proc`, in the host's network
//! namespace) whose claim is gone; a session is a live agent whose session
//! the plugin has not reported ended. Two agents of one key, or claims on
//! two hosts, count twice (G08).
//!
//! # Crashes
//! The agents and the plugin outlive a controller crash; the plugin's
//! agents go quiet for the recovered controller
//! ([`SshSubstrate::controller_restarted`]). Orphans are destroyed through
//! the plugin's own `list_nodes` and `destroy_node`
//! ([`SshSubstrate::destroy_orphan`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::effect::SessionHandle;
use provisioning::observe::LossCause;
use provisioning::spawn::{ManualSpawner, Spawner};
use provisioning::{LeaseHandle, LogicalNodeId, NodeAttemptId, Observation};
use provisioning_agent::RunSecret;
use provisioning_conformance::level3::{Intercepted, WorkBounds, attempt_key, run_work};
use provisioning_conformance::substrate::{
    CallRecord, Capabilities, LiveResources, ResourceKey, Substrate, SubstrateCounters,
};
use provisioning_conformance::trace::{Fault, FaultTarget, StreamEvent, WorkStep};
use provisioning_provider::{ObservationSink, PluginBackendAdapter, ProvisionPlugin};
use provisioning_ssh::{SshAgentConfig, SshPlugin};

use super::Level3;
use super::backend::{Defect, LeakyDestroy, SshBackend, World};
use super::hosts::{Role, signal};
use super::shared::{Shared, new_shared};

/// How long running work waits for real I/O to finish.
pub(crate) const WORK_QUIET_WAIT_MAX: Duration = Duration::from_secs(30);

/// How running work is bounded: looking again every millisecond (the
/// rounds are the wait bound divided by the poll interval, so that the time
/// bound is the one that bites).
const WORK: WorkBounds = WorkBounds {
    quiet_wait_max: WORK_QUIET_WAIT_MAX,
    poll_interval: Duration::from_millis(1),
    rounds_max: 30_000,
};

/// How long an opened gate may take to end in a join (or the session's end).
const JOIN_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long a loss may take to be reported.
const LOSS_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long one plugin call of the substrate's own (orphans, teardown) may take.
const OWN_CALL_WAIT_MAX: Duration = Duration::from_secs(20);

/// How many times teardown lists and destroys what is left.
const TEARDOWN_TRIES: usize = 3;

/// How long the runtime may take to stop its tasks at teardown.
const RUNTIME_SHUTDOWN_WAIT_MAX: Duration = Duration::from_secs(5);

/// The runtime's worker threads (the harness thread polls the executor's work).
const RUNTIME_WORKERS: usize = 1;

/// The ssh client's connect timeout, and the bound on one call: a call cut
/// off by a partition is given up (ambiguous) after it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const COMMAND_TIMEOUT: Duration = Duration::from_millis(2_500);

/// How long a started agent may take to join before its bootstrap fails:
/// longer than any trace keeps a gate closed.
const JOIN_TIMEOUT: Duration = Duration::from_secs(300);

/// The Level 3 substrate. See the module docs.
pub(crate) struct SshSubstrate {
    context: Arc<Level3>,
    world: Arc<World>,
    shared: Arc<Shared>,
    backend: Arc<SshBackend>,
    plugin: Arc<SshPlugin>,
    spawner: ManualSpawner,
    runtime: Option<tokio::runtime::Runtime>,
    started: Instant,
    /// Holds the verify-failure markers; removed last.
    _dir: tempfile::TempDir,
}

impl SshSubstrate {
    /// A fresh substrate with its own run, runtime and plugin.
    ///
    /// # Panics
    /// When the test environment cannot provide them: Level 3 fails loudly.
    pub(crate) fn new(context: Arc<Level3>) -> Self {
        SshSubstrate::with_defect(context, None)
    }

    /// A substrate whose plugin has a deliberate [`Defect`].
    ///
    /// # Panics
    /// As [`SshSubstrate::new`].
    pub(crate) fn with_defect(context: Arc<Level3>, defect: Option<Defect>) -> Self {
        let run = context.next_run();
        let dir = tempfile::tempdir().expect("level 3 needs a temporary directory");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_WORKERS)
            .thread_name("level3-ssh")
            .enable_all()
            .build()
            .expect("level 3 needs a tokio runtime");
        let (mut config, agent) = {
            let bed = context.hosts().bed();
            let mut agent = bed.agent_config(
                &context.agent().display().to_string(),
                RunSecret::generate(),
                0,
            );
            agent.join_timeout = JOIN_TIMEOUT;
            agent.rejoin_window = Some(Duration::from_secs(10));
            (bed.config(run.as_str(), context.slots()), agent)
        };
        config.connect_timeout = CONNECT_TIMEOUT;
        config.command_timeout = COMMAND_TIMEOUT;
        let agent: SshAgentConfig = agent;
        let plugin = runtime
            .block_on(SshPlugin::start(config, agent))
            .expect("the ssh plugin starts");
        let shared = Arc::new(new_shared());
        let reporter = shared.clone();
        let sink = ObservationSink::new(move |observation| reporter.observe(observation));
        let served: Arc<dyn ProvisionPlugin> = match defect {
            None => plugin.clone(),
            Some(Defect::DestroyLeavesClaim) => {
                Arc::new(Intercepted::new(plugin.clone(), LeakyDestroy))
            }
        };
        let adapter = PluginBackendAdapter::single(served, sink);
        let world = Arc::new(World {
            run,
            context: context.clone(),
            markers: dir.path().to_owned(),
        });
        let backend = Arc::new(SshBackend::new(adapter, shared.clone(), world.clone()));
        SshSubstrate {
            context,
            world,
            shared,
            backend,
            plugin,
            spawner: ManualSpawner::new(),
            runtime: Some(runtime),
            started: Instant::now(),
            _dir: dir,
        }
    }

    /// Runs `step` of the work inside the runtime (see the kit's
    /// `level3::run_work`): everything until no call does I/O and nothing is
    /// ready (hung calls may stay), or one task once. Returns the polls.
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

    /// Opens the boot gate of `key` once its agent waits there, then waits
    /// (bounded) for the join. Returns whether the gate was opened.
    fn open_gate(&self, key: &ResourceKey) -> bool {
        let waiting = self
            .shared
            .lock()
            .sessions()
            .get(key)
            .is_some_and(|t| t.accepted && !t.ended && !t.joined);
        if !waiting {
            return false;
        }
        let ended = || self.shared.lock().session_settled(key);
        if !self
            .context
            .hosts()
            .open_gate(&self.world.run, key, "pass", ended)
        {
            return false;
        }
        self.shared.count(|f| f.gates_passed += 1);
        self.shared
            .wait_until(JOIN_WAIT_MAX, |state| state.session_settled(key));
        true
    }

    /// Continues hung call `serial`'s agent. Returns whether it was hung.
    fn release_hang(&self, serial: u64) -> bool {
        let Some(hang) = self.shared.lock().release_hang(serial) else {
            return false;
        };
        if let Some(pid) = hang.what
            && signal(pid, "CONT", false)
        {
            self.shared.count(|f| f.agents_continued += 1);
        }
        true
    }

    fn unreleased_hangs(&self) -> Vec<u64> {
        self.shared.lock().unreleased_hangs()
    }

    /// Destroys, through the plugin, every node of the run it lists, a few
    /// times while some destroy fails (a call may time out on a loaded
    /// machine). Returns what could not be destroyed the last time.
    fn destroy_everything(&self) -> Vec<String> {
        let mut failed = Vec::new();
        for _ in 0..TEARDOWN_TRIES {
            failed = self.destroy_listed();
            if failed.is_empty() {
                break;
            }
        }
        failed
    }

    fn destroy_listed(&self) -> Vec<String> {
        let Some(runtime) = &self.runtime else {
            return Vec::new();
        };
        let plugin = self.plugin.clone();
        let run = self.world.run.clone();
        runtime.block_on(async move {
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
    }

    /// Stops everything of the run: undoes the faults, drains calls in
    /// flight, destroys what the plugin lists, drops queued work, and
    /// removes whatever survived from the hosts (recorded as a leak).
    fn teardown(&mut self) {
        self.shared.stop_faults();
        self.release_all_hangs();
        self.context.hosts().restore();
        if self.shared.lock().busy_calls() > 0 {
            self.run_work_step(WorkStep::Fifo);
        }
        let failed = self.destroy_everything();
        if let Some(runtime) = self.runtime.take() {
            {
                let _context = runtime.enter();
                self.spawner.clear();
            }
            runtime.shutdown_timeout(RUNTIME_SHUTDOWN_WAIT_MAX);
        }
        let (processes, claims) = self.context.hosts().purge(&self.world.run);
        let left = (!processes.is_empty() || !claims.is_empty() || !failed.is_empty()).then(|| {
            format!(
                "outlived the plugin's destroys: processes {:?}, claims {:?}; {}",
                processes
                    .iter()
                    .map(|p| format!("{}/a{} {:?} pid {}", p.node, p.attempt, p.role, p.pid))
                    .collect::<Vec<_>>(),
                claims
                    .iter()
                    .map(|(host, (node, attempt))| format!("{node}/{attempt} on host {host}"))
                    .collect::<Vec<_>>(),
                failed.join("; ")
            )
        });
        let (faults, counters) = {
            let state = self.shared.lock();
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

impl Drop for SshSubstrate {
    fn drop(&mut self) {
        self.teardown();
    }
}

impl Substrate for SshSubstrate {
    type Backend = SshBackend;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            deterministic: false,
        }
    }

    fn backend(&self) -> Arc<SshBackend> {
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
            StreamEvent::Joined => self.open_gate(&key),
            // Progress, convergence, a close and failures are the agent's
            // and the plugin's own doing (a failing verify command is a
            // definite start failure over SSH, scripted as such).
            StreamEvent::Progress(_)
            | StreamEvent::Converged
            | StreamEvent::Closed
            | StreamEvent::Failed(_) => false,
        };
        produced.then_some(key)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        let key = (node.clone(), attempt);
        let hosts = self.context.hosts();
        let run = &self.world.run;
        // Only a joined agent's loss is seen at once (its swarm connection
        // breaks); a claim's loss is seen by the plugin's loss check.
        let joined = self.shared.lock().joined(&key);
        let lost = match cause {
            LossCause::AgentGone if joined => {
                let agents = hosts.processes_of_key(run, &key, Role::Agent);
                let killed = agents
                    .iter()
                    .filter(|a| signal(a.pid, "KILL", false))
                    .count();
                self.shared.count(|f| f.agents_killed += killed as u64);
                killed > 0
            }
            LossCause::WorkloadExited if joined => {
                let workloads = hosts.processes_of_key(run, &key, Role::Workload);
                let killed = workloads
                    .iter()
                    .filter(|w| signal(w.pid, "KILL", false))
                    .count();
                self.shared.count(|f| f.workloads_killed += killed as u64);
                killed > 0
            }
            LossCause::AgentGone | LossCause::WorkloadExited => false,
            LossCause::LeaseGone => {
                let Some(host) = hosts.host_of(run, &key) else {
                    return false;
                };
                // The machine is gone: its processes first, then the claim.
                for agent in hosts.processes_of_key(run, &key, Role::Agent) {
                    signal(agent.pid, "KILL", true);
                    signal(agent.pid, "KILL", false);
                }
                for workload in hosts.processes_of_key(run, &key, Role::Workload) {
                    signal(workload.pid, "KILL", false);
                }
                let removed = std::fs::remove_dir_all(hosts.claim_dir(host, run, &key)).is_ok();
                if removed {
                    self.shared.count(|f| f.claims_removed += 1);
                    if let Some(runtime) = &self.runtime {
                        let plugin = self.plugin.clone();
                        let _ = runtime.block_on(async move {
                            tokio::time::timeout(OWN_CALL_WAIT_MAX, plugin.check_losses()).await
                        });
                    }
                }
                removed
            }
        };
        if lost {
            self.shared
                .wait_until(LOSS_WAIT_MAX, |state| state.lost(&key));
        }
        lost
    }

    fn fair_progress(&mut self) -> usize {
        let waiting: Vec<ResourceKey> = self
            .shared
            .lock()
            .sessions()
            .iter()
            .filter(|(_, t)| t.accepted && !t.ended && !t.joined)
            .map(|(key, _)| key.clone())
            .collect();
        waiting.iter().filter(|key| self.open_gate(key)).count()
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        self.shared.take_observations()
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn live_resources(&self) -> LiveResources {
        let hosts = self.context.hosts();
        let run = &self.world.run;
        let mut live = LiveResources::default();
        let claims: BTreeSet<(usize, ResourceKey)> = hosts.claims(run).into_iter().collect();
        for (_, key) in &claims {
            *live.leases.entry(key.clone()).or_insert(0) += 1;
        }
        let state = self.shared.lock();
        let processes = hosts.processes_of(run);
        for agent in &processes {
            if agent.role != Role::Agent {
                continue;
            }
            let Some(key) = agent.key() else {
                continue;
            };
            if !claims.contains(&(agent.host, key.clone())) {
                // An agent whose claim is gone: a lease only /proc knows of.
                *live.leases.entry(key.clone()).or_insert(0) += 1;
            }
            let ended = state.sessions().get(&key).is_none_or(|t| t.ended);
            if !ended {
                *live.sessions.entry(key).or_insert(0) += 1;
            }
        }
        if live
            .leases
            .values()
            .chain(live.sessions.values())
            .any(|n| *n > 1)
        {
            eprintln!("level 3: run {run} holds {live}; on the hosts: {processes:?}");
        }
        live
    }

    fn take_ledger_alarms(&mut self) -> Vec<String> {
        self.shared.take_alarms()
    }

    /// The agents outlive the controller (the harness's driver and
    /// executor), and so does the plugin that watches them.
    fn survives_controller_crash(&self) -> bool {
        true
    }

    /// The plugin lives on across the crash; its agents go quiet until the
    /// recovered controller's adopting starts announce them again, as a
    /// restarted plugin would meet them.
    fn controller_restarted(&mut self) {
        self.plugin.controller_replaced();
    }

    /// Destroys an orphan the way the durable host does: the plugin lists
    /// the run, and the listed lease of `key` is destroyed through the real
    /// `destroy_node`. Whether anything was live comes from the hosts.
    fn destroy_orphan(&mut self, key: &ResourceKey) -> bool {
        let hosts = self.context.hosts();
        let run = &self.world.run;
        let live = hosts.host_of(run, key).is_some()
            || !hosts.processes_of_key(run, key, Role::Agent).is_empty();
        if !live {
            return false;
        }
        let Some(runtime) = &self.runtime else {
            return false;
        };
        let plugin = self.plugin.clone();
        let attempt = attempt_key(&self.world.run, key);
        let run = run.clone();
        let destroyed = runtime.block_on(async move {
            let listed = tokio::time::timeout(OWN_CALL_WAIT_MAX, plugin.list_nodes(&run))
                .await
                .ok()?
                .ok()?;
            let lease = listed.into_iter().find(|l| l.key == attempt)?.lease;
            tokio::time::timeout(OWN_CALL_WAIT_MAX, plugin.destroy_node(&attempt, &lease))
                .await
                .ok()?
                .ok()
        });
        destroyed.is_some()
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
        let processes = self.context.hosts().processes_of(&self.world.run);
        let stopped = processes.iter().filter(|p| p.state == 'T').count();
        format!(
            "{} task(s) queued ({} runnable), {} call(s) doing I/O, {} hung, \
             {} scripted fault(s) unused, {} live session(s); run {}: {} claim(s), {} process(es) on the hosts, {stopped} stopped",
            self.spawner.len(),
            self.spawner.ready_count(),
            state.busy_calls(),
            state.hung_calls(),
            state.unused_scripts(),
            state.live_sessions().len(),
            self.world.run,
            self.context.hosts().claims(&self.world.run).len(),
            processes.len(),
        )
    }
}
