//! The backend under the executor: the real [`PluginBackendAdapter`] over
//! the real [`ProcessPlugin`], with scripted faults turned into operating
//! system events right before the call reaches the adapter.
//!
//! | Scripted fault | Call | What really happens |
//! |---|---|---|
//! | `definite` | create | the agent program is renamed away for the call: the spawn fails with `ENOENT` (a live node of the key is adopted instead, as it must be) |
//! | `definite` | any other | every process of the node is killed with `SIGKILL` first; the call then meets a dead node |
//! | `not-ready` | lookup | the freshly created agent is left stopped before its `exec`, so it has really not announced an endpoint |
//! | `hang` | create | the call is held before it reaches the plugin until the trace releases it: a slow provider call, which may reach the plugin only after its controller crashed (and so make an orphan) |
//! | `hang` | bootstrap start | the agent is stopped with `SIGSTOP`: the boot order waits unanswered in the socket, the call hangs past its deadline (the plugin's own handshake wait is the only bound) until `SIGCONT` |
//! | `ambiguous-*`, `panic` | — | not operating-system events; refused when scripted (Levels 1 and 2 cover them) |
//!
//! Without a fault, a lookup first continues an agent still held before its
//! `exec` and waits (bounded) until it announced itself, so "not ready" is
//! what the trace asked for, not an accident of timing.
//!
//! The kit's shapes name the provider `fake`, boot commands that do not
//! exist and the fixed run `conformance`. Each call is translated before it
//! reaches the adapter: the run becomes the substrate's own (so concurrent
//! runs never see each other's processes), the provider becomes `process`,
//! and the boot becomes the node's gated verify command and a long-running
//! workload. The operation id, slot and attempt are untouched.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use provisioning::effect::EffectRequest;
use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{
    EffectError, EffectOutput, EndpointLookup, LeaseHandle, NodeAttemptId, Operation, RunId,
};
use provisioning_agent::os;
use provisioning_conformance::level3::{RealNode, hold_call};
use provisioning_conformance::substrate::{CallRecorder, ResourceKey};
use provisioning_conformance::trace::Fault;
use provisioning_process::{PROVIDER_KIND, ProcessPlugin};
use provisioning_provider::{PluginBackendAdapter, ProvisionPlugin};

use super::os_faults::{self, AgentProgram, GATE_VERIFY_COMMAND, GATES_ENV, Gates, attempt_key};
use super::shared::{ProcessShared, Shared, Stopped};

/// How often a lookup asks whether a continued agent announced itself.
const ANNOUNCE_POLL_INTERVAL: Duration = Duration::from_millis(2);

/// The most times a lookup asks before it lets the plugin answer as it is.
const ANNOUNCE_POLLS_MAX: usize = 2_500;

/// How often a call looks whether the plugin reported a node it killed.
const LOSS_POLL_INTERVAL: Duration = Duration::from_millis(2);

/// The most times a call looks for that report before it goes on.
const LOSS_POLLS_MAX: usize = 1_500;

/// A deliberate dishonesty of the backend, to show that Level 3's counts
/// come from the operating system and not from anyone's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Defect {
    /// Before each destroy, a process tagged as the node is started in a
    /// process group of its own, where the plugin's destroy does not reach:
    /// a leaked lease only `/proc` knows about.
    DestroyLeavesStray,
}

/// The operating-system world of one substrate.
#[derive(Debug)]
pub(crate) struct World {
    /// The substrate's own run.
    pub(crate) run: RunId,
    /// The program agents are started through.
    pub(crate) program: AgentProgram,
    /// The boot gates.
    pub(crate) gates: Gates,
}

/// The backend the executor runs effects through. See the module docs.
pub(crate) struct ProcessBackend {
    adapter: Arc<PluginBackendAdapter>,
    plugin: Arc<ProcessPlugin>,
    /// Calls as they start, for G04 and G05.
    pub(crate) calls: CallRecorder,
    shared: Arc<Shared>,
    world: Arc<World>,
    defect: Option<Defect>,
    /// Processes a defect started, reaped at teardown.
    strays: Mutex<Vec<Child>>,
}

/// Continues a hung agent when its call ends without a release.
struct HangRelease<'a> {
    backend: &'a ProcessBackend,
    serial: u64,
}

impl Drop for HangRelease<'_> {
    fn drop(&mut self) {
        if let Some(Stopped {
            key,
            pid: Some(pid),
        }) = self.backend.shared.end_stop(self.serial)
        {
            os_faults::continue_agent(&self.backend.world.run, &key, pid);
        }
    }
}

impl ProcessBackend {
    /// A backend over `plugin`, reporting through the adapter's sink.
    pub(crate) fn new(
        adapter: PluginBackendAdapter,
        plugin: Arc<ProcessPlugin>,
        shared: Arc<Shared>,
        world: Arc<World>,
        defect: Option<Defect>,
    ) -> Self {
        ProcessBackend {
            adapter: Arc::new(adapter),
            plugin,
            calls: CallRecorder::new(),
            shared,
            world,
            defect,
            strays: Mutex::new(Vec::new()),
        }
    }

    /// Waits for the processes a defect started (they are killed with the
    /// rest of the run at teardown).
    pub(crate) fn reap_strays(&self) {
        let strays =
            std::mem::take(&mut *self.strays.lock().unwrap_or_else(PoisonError::into_inner));
        for mut stray in strays {
            let _ = stray.kill();
            let _ = stray.wait();
        }
    }

    /// Starts a process tagged as `key`'s node in a process group of its own.
    fn start_stray(&self, key: &ResourceKey) {
        let stray = std::process::Command::new("sleep")
            .arg("3600")
            .env(os::RUN_TAG, self.world.run.as_str())
            .env(os::NODE_TAG, key.0.to_string())
            .env(os::ATTEMPT_TAG, key.1.get().to_string())
            .stdin(Stdio::null())
            .process_group(0)
            .spawn();
        match stray {
            Ok(child) => self
                .strays
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(child),
            Err(error) => eprintln!("level 3: the defect cannot start its stray: {error}"),
        }
    }

    /// The operation as the process plugin sees it (see the module docs):
    /// the substrate's run, the `process` provider, the gated verify
    /// command and the workload.
    fn translate(&self, operation: &Operation) -> Operation {
        RealNode {
            run: &self.world.run,
            provider: PROVIDER_KIND,
            verify_command: GATE_VERIFY_COMMAND,
            env: BTreeMap::from([(
                GATES_ENV.to_owned(),
                self.world.gates.dir().display().to_string(),
            )]),
            shape: None,
        }
        .operation(operation)
    }

    async fn run(&self, operation: &Operation) -> Result<EffectOutput, EffectError> {
        let _recorded = self.calls.start(operation);
        let _in_flight = self.shared.call_started(operation.id);
        let key: ResourceKey = (operation.node.clone(), operation.attempt());
        let real = self.translate(operation);
        let fault = self.shared.take_script(operation.kind());
        if matches!(operation.request, EffectRequest::StartBootstrap { .. }) {
            self.world.gates.prepare(&key);
            self.shared.session_starting(&key);
        }
        if self.defect == Some(Defect::DestroyLeavesStray)
            && matches!(operation.request, EffectRequest::DestroyLease { .. })
        {
            self.start_stray(&key);
        }
        let outcome = match (&operation.request, fault) {
            (EffectRequest::CreateLease, Some(Fault::Definite)) => {
                self.create_without_program(&real).await
            }
            (EffectRequest::CreateLease, Some(Fault::Hang)) => self.create_held(&real, &key).await,
            (EffectRequest::CreateLease, _) => self.create(&real, &key).await,
            (EffectRequest::LookupEndpoint { .. }, Some(Fault::NotReady)) => {
                self.lookup_while_held(&real).await
            }
            (_, Some(Fault::Definite)) => {
                self.kill_first(&key).await;
                self.adapter.execute(&real).await
            }
            (EffectRequest::LookupEndpoint { lease }, _) => {
                self.let_agent_announce(&key, lease).await;
                self.adapter.execute(&real).await
            }
            (EffectRequest::StartBootstrap { .. }, Some(Fault::Hang)) => {
                self.start_hung(&real, &key).await
            }
            _ => self.adapter.execute(&real).await,
        };
        self.shared.answered(operation, &outcome);
        outcome
    }

    /// A create whose spawn finds no agent program.
    async fn create_without_program(&self, real: &Operation) -> Result<EffectOutput, EffectError> {
        let outcome = {
            let _missing = self.world.program.remove();
            self.adapter.execute(real).await
        };
        if outcome.as_ref().is_err_and(|e| !e.is_ambiguous()) {
            self.shared.count(|os| os.spawn_failures += 1);
        }
        outcome
    }

    /// A create held before it reaches the plugin until the trace releases
    /// it (or, as a safety bound, the kit's `HOLD_WAIT_MAX` passes): a slow provider
    /// call. The call runs as a task of the substrate's runtime, so it goes
    /// on even when the controller that made it crashed and its executor was
    /// dropped — and then may reach the plugin after recovery moved on, and
    /// make an orphan, as a slow cloud call would.
    async fn create_held(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let serial = self.shared.hang_on(key.clone(), real.id, None);
        let outcome = hold_call(&self.shared, &self.adapter, serial, real).await;
        if let Ok(EffectOutput::LeaseCreated { adopted: false, .. }) = &outcome {
            self.check_single_agent(key);
        }
        outcome
    }

    /// A create, then a look at the operating system: a new agent must be
    /// the only live one of its slot.
    async fn create(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let outcome = self.adapter.execute(real).await;
        if let Ok(EffectOutput::LeaseCreated { adopted: false, .. }) = &outcome {
            self.check_single_agent(key);
        }
        outcome
    }

    /// Raises a G08 alarm when the slot of `key` has agents of another
    /// attempt, or more than one of `key`'s.
    fn check_single_agent(&self, key: &ResourceKey) {
        let agents = os::agents(&self.world.run)
            .unwrap_or_else(|error| panic!("level 3 needs a readable /proc: {error}"));
        let slot = key.0.to_string();
        let of_slot: Vec<(u64, i32)> = agents
            .iter()
            .filter(|agent| agent.node.as_deref() == Some(slot.as_str()))
            .filter_map(|agent| agent.attempt.map(|attempt| (attempt, agent.pid)))
            .collect();
        let own = of_slot.iter().filter(|(a, _)| *a == key.1.get()).count();
        let others: Vec<String> = of_slot
            .iter()
            .filter(|(a, _)| *a != key.1.get())
            .map(|(a, pid)| format!("{} (pid {pid})", NodeAttemptId::from_raw(*a)))
            .collect();
        if own > 1 || !others.is_empty() {
            self.shared.alarm(format!(
                "after creating {}/{}, /proc shows {own} agent(s) of that attempt and agents of other attempts of the slot: [{}]",
                key.0,
                key.1,
                others.join(", ")
            ));
        }
    }

    /// A lookup while the agent is still held before its `exec`.
    async fn lookup_while_held(&self, real: &Operation) -> Result<EffectOutput, EffectError> {
        let outcome = self.adapter.execute(real).await;
        if let Ok(EffectOutput::Endpoint(EndpointLookup::NotReady)) = &outcome {
            self.shared.count(|os| os.not_ready_answers += 1);
        }
        outcome
    }

    /// Continues a held agent and waits (bounded) until the plugin has its
    /// endpoint, or knows the node is gone.
    async fn let_agent_announce(&self, key: &ResourceKey, lease: &LeaseHandle) {
        let asked = attempt_key(&self.world.run, key);
        for _ in 0..ANNOUNCE_POLLS_MAX {
            match self.plugin.lookup_endpoint(&asked, lease).await {
                Ok(EndpointLookup::NotReady) => {}
                Ok(EndpointLookup::Ready(_)) | Err(_) => return,
            }
            os_faults::release_held_agent(&self.world.run, key);
            tokio::time::sleep(ANNOUNCE_POLL_INTERVAL).await;
        }
    }

    /// Kills every process of the node, then waits (bounded) until the
    /// plugin reported the loss, so that the call meets a node the plugin
    /// knows is dead.
    async fn kill_first(&self, key: &ResourceKey) {
        if os_faults::kill_node(&self.world.run, key) == 0 {
            return;
        }
        self.shared.count(|os| os.nodes_killed += 1);
        for _ in 0..LOSS_POLLS_MAX {
            if self.shared.lock().lost(key) {
                return;
            }
            tokio::time::sleep(LOSS_POLL_INTERVAL).await;
        }
    }

    /// A bootstrap start against a stopped agent.
    async fn start_hung(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let Some(pid) = os_faults::stop_agent(&self.world.run, key) else {
            // No running agent to stop: the call meets whatever is there.
            return self.adapter.execute(real).await;
        };
        let serial = self.shared.hang_on(key.clone(), real.id, Some(pid));
        let _release = HangRelease {
            backend: self,
            serial,
        };
        self.adapter.execute(real).await
    }
}

impl EffectBackend for ProcessBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(self.run(operation))
    }
}
