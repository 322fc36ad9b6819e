//! [`SshSubstrate`]: the conformance kit's `Level3Substrate` over the real
//! ssh plugin and namespaced sshd hosts, with [`SshWorld`] as the ssh
//! plugin's part.
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
//! ([`SshWorld::controller_restarted`]). Orphans are destroyed through
//! the plugin's own `list_nodes` and `destroy_node`
//! ([`SshWorld::destroy_orphan`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::RunId;
use provisioning::observe::LossCause;
use provisioning_agent::RunSecret;
use provisioning_conformance::level3::{
    Core, Intercepted, Level3Substrate, Level3World, WorkBounds,
};
use provisioning_conformance::substrate::{CallRecord, LiveResources, ResourceKey};
use provisioning_conformance::trace::StreamEvent;
use provisioning_provider::{PluginBackendAdapter, ProvisionPlugin};
use provisioning_ssh::{SshAgentConfig, SshPlugin};

use super::Level3;
use super::backend::{Defect, LeakyDestroy, SshBackend, World};
use super::hosts::{Role, signal};
use super::shared::{FaultCounts, new_shared};

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

/// The ssh client's connect timeout, and the bound on one call: a call cut
/// off by a partition is given up (ambiguous) after it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const COMMAND_TIMEOUT: Duration = Duration::from_millis(2_500);

/// How long a started agent may take to join before its bootstrap fails:
/// longer than any trace keeps a gate closed.
const JOIN_TIMEOUT: Duration = Duration::from_secs(300);

/// The Level 3 substrate over namespaced sshd hosts. See the module docs.
pub(crate) type SshSubstrate = Level3Substrate<SshWorld>;

/// The ssh plugin's part of the substrate: the hosts (through the
/// context), the plugin and the backend.
pub(crate) struct SshWorld {
    context: Arc<Level3>,
    world: Arc<World>,
    backend: Arc<SshBackend>,
    plugin: Arc<SshPlugin>,
    started: Instant,
    /// What teardown's destroys could not destroy.
    undestroyed: Vec<String>,
    /// Holds the verify-failure markers; removed last.
    _dir: tempfile::TempDir,
}

impl SshWorld {
    /// Opens the boot gate of `key` once its agent waits there, then waits
    /// (bounded) for the join. Returns whether the gate was opened.
    fn open_gate(&self, core: &Core<Self>, key: &ResourceKey) -> bool {
        let shared = core.shared();
        let waiting = shared
            .lock()
            .sessions()
            .get(key)
            .is_some_and(|t| t.accepted && !t.ended && !t.joined);
        if !waiting {
            return false;
        }
        let ended = || shared.lock().session_settled(key);
        if !self
            .context
            .hosts()
            .open_gate(&self.world.run, key, "pass", ended)
        {
            return false;
        }
        shared.count(|f| f.gates_passed += 1);
        shared.wait_until(JOIN_WAIT_MAX, |state| state.session_settled(key));
        true
    }

    /// Destroys, through the plugin, every node of the run it lists, a few
    /// times while some destroy fails (a call may time out on a loaded
    /// machine). Returns what could not be destroyed the last time.
    fn destroy_everything(&self, core: &Core<Self>) -> Vec<String> {
        let mut failed = Vec::new();
        for _ in 0..TEARDOWN_TRIES {
            failed = self.destroy_listed(core);
            if failed.is_empty() {
                break;
            }
        }
        failed
    }

    fn destroy_listed(&self, core: &Core<Self>) -> Vec<String> {
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

impl Level3World for SshWorld {
    type Context = Level3;
    type Defect = Defect;
    type Faults = FaultCounts;
    type Session = ();
    type Hang = Option<u32>;
    type Backend = SshBackend;

    const HUNG_ON: &'static str = "";

    fn start(context: Arc<Level3>, defect: Option<Defect>) -> (Core<Self>, Self) {
        let run = context.next_run();
        let dir = tempfile::tempdir().expect("level 3 needs a temporary directory");
        let core = Core::<Self>::new(Arc::new(new_shared()), "level3-ssh", WORK);
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
        let plugin = core
            .block_on(SshPlugin::start(config, agent))
            .expect("the runtime runs")
            .expect("the ssh plugin starts");
        let served: Arc<dyn ProvisionPlugin> = match defect {
            None => plugin.clone(),
            Some(Defect::DestroyLeavesClaim) => {
                Arc::new(Intercepted::new(plugin.clone(), LeakyDestroy))
            }
        };
        let adapter = PluginBackendAdapter::single(served, core.sink());
        let world = Arc::new(World {
            run,
            context: context.clone(),
            markers: dir.path().to_owned(),
        });
        let backend = Arc::new(SshBackend::new(
            adapter,
            core.shared().clone(),
            world.clone(),
        ));
        let parts = SshWorld {
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

    fn backend(&self) -> Arc<SshBackend> {
        self.backend.clone()
    }

    fn take_calls(&self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    /// Continues hung call `serial`'s agent. Returns whether it was hung.
    fn release_hang(&mut self, core: &Core<Self>, serial: u64) -> bool {
        let Some(hang) = core.shared().lock().release_hang(serial) else {
            return false;
        };
        if let Some(pid) = hang.what
            && signal(pid, "CONT", false)
        {
            core.shared().count(|f| f.agents_continued += 1);
        }
        true
    }

    fn stream(&mut self, core: &Core<Self>, key: &ResourceKey, event: StreamEvent) -> bool {
        match event {
            StreamEvent::Joined => self.open_gate(core, key),
            // Progress, convergence, a close and failures are the agent's
            // and the plugin's own doing (a failing verify command is a
            // definite start failure over SSH, scripted as such).
            StreamEvent::Progress(_)
            | StreamEvent::Converged
            | StreamEvent::Closed
            | StreamEvent::Failed(_) => false,
        }
    }

    fn lose(&mut self, core: &Core<Self>, key: &ResourceKey, cause: LossCause) -> bool {
        let shared = core.shared();
        let hosts = self.context.hosts();
        let run = &self.world.run;
        // Only a joined agent's loss is seen at once (its swarm connection
        // breaks); a claim's loss is seen by the plugin's loss check.
        let joined = shared.lock().joined(key);
        let lost = match cause {
            LossCause::AgentGone if joined => {
                let agents = hosts.processes_of_key(run, key, Role::Agent);
                let killed = agents
                    .iter()
                    .filter(|a| signal(a.pid, "KILL", false))
                    .count();
                shared.count(|f| f.agents_killed += killed as u64);
                killed > 0
            }
            LossCause::WorkloadExited | LossCause::WorkloadEnded(_) if joined => {
                let workloads = hosts.processes_of_key(run, key, Role::Workload);
                let killed = workloads
                    .iter()
                    .filter(|w| signal(w.pid, "KILL", false))
                    .count();
                shared.count(|f| f.workloads_killed += killed as u64);
                killed > 0
            }
            LossCause::AgentGone | LossCause::WorkloadExited | LossCause::WorkloadEnded(_) => false,
            LossCause::LeaseGone => {
                let Some(host) = hosts.host_of(run, key) else {
                    return false;
                };
                // The machine is gone: its processes first, then the claim.
                for agent in hosts.processes_of_key(run, key, Role::Agent) {
                    signal(agent.pid, "KILL", true);
                    signal(agent.pid, "KILL", false);
                }
                for workload in hosts.processes_of_key(run, key, Role::Workload) {
                    signal(workload.pid, "KILL", false);
                }
                let removed = std::fs::remove_dir_all(hosts.claim_dir(host, run, key)).is_ok();
                if removed {
                    shared.count(|f| f.claims_removed += 1);
                    let plugin = self.plugin.clone();
                    let _ = core.block_on(async move {
                        tokio::time::timeout(OWN_CALL_WAIT_MAX, plugin.check_losses()).await
                    });
                }
                removed
            }
        };
        if lost {
            shared.wait_until(LOSS_WAIT_MAX, |state| state.lost(key));
        }
        lost
    }

    fn fair_progress(&mut self, core: &Core<Self>) -> usize {
        let waiting: Vec<ResourceKey> = core
            .shared()
            .lock()
            .sessions()
            .iter()
            .filter(|(_, t)| t.accepted && !t.ended && !t.joined)
            .map(|(key, _)| key.clone())
            .collect();
        waiting
            .iter()
            .filter(|key| self.open_gate(core, key))
            .count()
    }

    fn live_resources(&self, core: &Core<Self>) -> LiveResources {
        let hosts = self.context.hosts();
        let run = &self.world.run;
        let mut live = LiveResources::default();
        let claims: BTreeSet<(usize, ResourceKey)> = hosts.claims(run).into_iter().collect();
        for (_, key) in &claims {
            *live.leases.entry(key.clone()).or_insert(0) += 1;
        }
        let state = core.shared().lock();
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

    /// The plugin lives on across the crash; its agents go quiet until the
    /// recovered controller's adopting starts announce them again, as a
    /// restarted plugin would meet them.
    fn controller_restarted(&mut self, _core: &Core<Self>) {
        self.plugin.controller_replaced();
    }

    /// Destroys an orphan the way the durable host does (see the kit's
    /// `SubstrateCore::destroy_listed`). Whether anything was live comes
    /// from the hosts.
    fn destroy_orphan(&mut self, core: &Core<Self>, key: &ResourceKey) -> bool {
        let hosts = self.context.hosts();
        let run = &self.world.run;
        let live = hosts.host_of(run, key).is_some()
            || !hosts.processes_of_key(run, key, Role::Agent).is_empty();
        live && core.destroy_listed(&self.plugin, run, key, OWN_CALL_WAIT_MAX)
    }

    fn describe_world(&self, _core: &Core<Self>) -> Option<String> {
        let processes = self.context.hosts().processes_of(&self.world.run);
        let stopped = processes.iter().filter(|p| p.state == 'T').count();
        Some(format!(
            "{} claim(s), {} process(es) on the hosts, {stopped} stopped",
            self.context.hosts().claims(&self.world.run).len(),
            processes.len(),
        ))
    }

    /// Undoes the faults on the hosts once every stopped agent was let go.
    fn hangs_released(&mut self, _core: &Core<Self>) {
        self.context.hosts().restore();
    }

    /// Destroys what the plugin lists while its runtime still runs.
    fn runtime_stopping(&mut self, core: &Core<Self>) {
        self.undestroyed = self.destroy_everything(core);
    }

    /// Removes whatever survived from the hosts (recorded as a leak).
    fn torn_down(&mut self, core: &Core<Self>) {
        let failed = std::mem::take(&mut self.undestroyed);
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
