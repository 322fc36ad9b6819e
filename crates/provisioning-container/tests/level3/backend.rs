//! The backend under the executor: the real `PluginBackendAdapter` over the
//! real `ContainerPlugin`, with every call recorded (G04, G05) and each
//! scripted fault turned into a real event around the call:
//!
//! | Scripted fault | Call | What really happens |
//! |---|---|---|
//! | `definite` | create-lease | by turns: the group's **image is not on the engine** (refused by the engine), or the call's engine requests go to a **socket nobody listens on** (refused before anything was sent) |
//! | `definite` | any other | the first of a run **stops the engine daemon** for the call (its socket is gone; containers live on) and starts it again; later ones meet the **refusing socket** |
//! | `not-ready` | lookup-endpoint | the node's container is **paused** (`docker pause`) for the call |
//! | `ambiguous-done` | create-lease, destroy-lease | the plugin's fault hook: the container is really created (or stopped and removed), then the reply is thrown away |
//! | `hang` | create-lease | held before it reaches the plugin (a slow call) until released |
//!
//! Every node's spec becomes the plugin's: the substrate's run, provider
//! `container`, the test image on the engine's network with the boot
//! gates bind-mounted, one verify command that reads its verdict from the
//! node's gate, and a long-running workload.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use provisioning::effect::EffectRequest;
use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{
    EffectError, EffectOutput, EndpointLookup, LeaseHandle, Operation, ProviderShape, RunId,
};
use provisioning_conformance::level3::{Intercept, PluginCall, RealNode, hold_call};
use provisioning_conformance::substrate::{CallRecorder, ResourceKey};
use provisioning_conformance::trace::Fault;
use provisioning_container::testbed::TEST_IMAGE;
use provisioning_container::{
    ContainerPlugin, FaultMode, FaultStep, PROVIDER_KIND, container_name, with_refused_engine,
};
use provisioning_provider::{AttemptKey, PluginBackendAdapter, ProvisionPlugin};

use super::Level3;
use super::shared::Shared;

/// The environment variable naming the gate directory in verify commands.
pub(crate) const GATES_ENV: &str = "PROVISION_L3_GATES";

/// The verify command of every node: read the verdict from the node's gate.
pub(crate) const GATE_VERIFY_COMMAND: &str = "read verdict < \"$PROVISION_L3_GATES/$PROVISION_NODE_ID.$PROVISION_ATTEMPT\"; \
     [ \"$verdict\" = pass ] || { echo \"boot gate says: $verdict\" >&2; exit 1; }";

/// An image no engine of the tests holds.
const MISSING_IMAGE: &str = "provision-missing:0";

/// How many calls of one run may stop the engine.
const ENGINE_OUTAGES_PER_RUN: u64 = 1;

/// A deliberate defect, to show that Level 3's counts come from the engine
/// and not from anyone's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Defect {
    /// The plugin's destroy only stops the agent and reports success: the
    /// container stays.
    DestroyLeavesContainer,
}

/// [`Defect::DestroyLeavesContainer`] around the real plugin.
pub(crate) struct LeakyDestroy;

impl Intercept for LeakyDestroy {
    fn destroy_node<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        _lease: &'a LeaseHandle,
    ) -> PluginCall<'a, ()> {
        // The defect: the agent goes, the container stays.
        inner.cancel_bootstrap(key, None)
    }
}

/// The real world of one substrate.
pub(crate) struct World {
    /// The substrate's own run.
    pub(crate) run: RunId,
    /// The test's engine.
    pub(crate) context: Arc<Level3>,
    /// The boot gates, bind-mounted at the same path into every container.
    pub(crate) gates: PathBuf,
    /// The engine's network.
    pub(crate) network: String,
}

/// The backend the executor runs effects through. See the module docs.
pub(crate) struct ContainerBackend {
    adapter: Arc<PluginBackendAdapter>,
    plugin: Arc<ContainerPlugin>,
    /// Calls as they start, for G04 and G05.
    pub(crate) calls: CallRecorder,
    shared: Arc<Shared>,
    world: Arc<World>,
    /// Turns of the create faults that alternate.
    create_turn: AtomicU64,
    /// Engine outages of this run so far.
    outages: AtomicU64,
}

fn is_definite<T>(outcome: &Result<T, EffectError>) -> bool {
    outcome.as_ref().is_err_and(|e| !e.is_ambiguous())
}

impl ContainerBackend {
    /// A backend over `adapter`.
    pub(crate) fn new(
        adapter: PluginBackendAdapter,
        plugin: Arc<ContainerPlugin>,
        shared: Arc<Shared>,
        world: Arc<World>,
    ) -> Self {
        ContainerBackend {
            adapter: Arc::new(adapter),
            plugin,
            calls: CallRecorder::new(),
            shared,
            world,
            create_turn: AtomicU64::new(0),
            outages: AtomicU64::new(0),
        }
    }

    /// The operation as the container plugin sees it (see the module docs).
    fn translate(&self, operation: &Operation, image: &str) -> Operation {
        let gates = self.world.gates.display().to_string();
        let labels = BTreeMap::from([
            ("container.image".to_owned(), image.to_owned()),
            ("container.network".to_owned(), self.world.network.clone()),
            (
                "container.mounts".to_owned(),
                serde_json::Value::from(vec![format!("{gates}:{gates}")]).to_string(),
            ),
        ]);
        RealNode {
            run: &self.world.run,
            provider: PROVIDER_KIND,
            verify_command: GATE_VERIFY_COMMAND,
            env: BTreeMap::from([(GATES_ENV.to_owned(), gates)]),
            shape: Some(ProviderShape {
                image: String::new(),
                resources: BTreeMap::new(),
                labels,
            }),
        }
        .operation(operation)
    }

    async fn run(&self, operation: &Operation) -> Result<EffectOutput, EffectError> {
        let _recorded = self.calls.start(operation);
        let _in_flight = self.shared.call_started(operation.id);
        let key: ResourceKey = (operation.node.clone(), operation.attempt());
        let real = self.translate(operation, TEST_IMAGE);
        let fault = self.shared.take_script(operation.kind());
        if matches!(operation.request, EffectRequest::StartBootstrap { .. }) {
            super::substrate::prepare_gate(&self.world.gates, &key);
            self.shared.session_starting(&key);
        }
        let outcome = match (&operation.request, fault) {
            (EffectRequest::CreateLease, Some(Fault::Definite)) => {
                if self.create_turn.fetch_add(1, Ordering::Relaxed) % 2 == 0 {
                    self.create_without_image(operation, &key).await
                } else {
                    self.refused(&real).await
                }
            }
            (EffectRequest::CreateLease, Some(Fault::Hang)) => self.create_held(&real, &key).await,
            (EffectRequest::CreateLease, Some(Fault::AmbiguousDone)) => {
                self.reply_lost(&real, FaultStep::Create).await
            }
            (EffectRequest::DestroyLease { .. }, Some(Fault::AmbiguousDone)) => {
                self.reply_lost(&real, FaultStep::Destroy).await
            }
            (EffectRequest::CreateLease, _) => self.create(&real, &key).await,
            (EffectRequest::LookupEndpoint { .. }, Some(Fault::NotReady)) => {
                self.lookup_paused(&real, &key).await
            }
            (_, Some(Fault::Definite)) => {
                if self.outages.fetch_add(1, Ordering::Relaxed) < ENGINE_OUTAGES_PER_RUN {
                    self.in_outage(&real).await
                } else {
                    self.refused(&real).await
                }
            }
            _ => self.adapter.execute(&real).await,
        };
        self.shared.answered(operation, &outcome);
        outcome
    }

    /// A create, then a look at the engine: a new container must be the
    /// only one of its slot.
    async fn create(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let outcome = self.adapter.execute(real).await;
        if let Ok(EffectOutput::LeaseCreated { adopted: false, .. }) = &outcome {
            self.check_single_container(key);
        }
        outcome
    }

    /// Raises a G08 alarm when the engine holds containers of another
    /// attempt of `key`'s slot, or more than one of `key`.
    fn check_single_container(&self, key: &ResourceKey) {
        let node = key.0.to_string();
        let listed: Vec<_> = self
            .world
            .context
            .containers(&self.world.run)
            .into_iter()
            .filter(|c| c.node == node && !matches!(c.state.as_str(), "exited" | "dead"))
            .collect();
        let own = listed.iter().filter(|c| c.attempt == key.1.get()).count();
        let others: Vec<String> = listed
            .iter()
            .filter(|c| c.attempt != key.1.get())
            .map(|c| format!("{} ({})", c.name, c.state))
            .collect();
        if own > 1 || !others.is_empty() {
            self.shared.alarm(format!(
                "after creating {}/{}, the engine holds {own} container(s) of it and of other attempts of the slot: [{}]",
                key.0,
                key.1,
                others.join(", ")
            ));
        }
    }

    /// A create whose group names an image the engine does not hold.
    async fn create_without_image(
        &self,
        operation: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let real = self.translate(operation, MISSING_IMAGE);
        let outcome = self.create(&real, key).await;
        if let Err(error) = &outcome
            && !error.is_ambiguous()
            && error.to_string().contains(MISSING_IMAGE)
        {
            self.shared.applied(|f| f.images_missing += 1);
        }
        outcome
    }

    /// A call whose engine requests meet a socket nobody listens on.
    async fn refused(&self, real: &Operation) -> Result<EffectOutput, EffectError> {
        let outcome = with_refused_engine(self.adapter.execute(real)).await;
        if is_definite(&outcome) {
            self.shared.applied(|f| f.refused += 1);
        }
        outcome
    }

    /// A call while the engine daemon is stopped; it is started again
    /// after. The steps run in a task of their own, so that the engine
    /// comes back even when the harness leaves the call unpolled.
    async fn in_outage(&self, real: &Operation) -> Result<EffectOutput, EffectError> {
        let adapter = self.adapter.clone();
        let context = self.world.context.clone();
        let real = real.clone();
        let detached = self.shared.detached(real.id);
        let outage = tokio::spawn(async move {
            let _detached = detached;
            let stopper = context.clone();
            let stopped = tokio::task::spawn_blocking(move || stopper.engine().stop_daemon())
                .await
                .is_ok();
            let outcome = adapter.execute(&real).await;
            if let Err(error) = tokio::task::spawn_blocking(move || context.engine().resume()).await
            {
                eprintln!("level 3: the engine did not come back: {error}");
            }
            (stopped, outcome)
        });
        let (stopped, outcome) = outage.await.unwrap_or_else(|error| {
            (
                false,
                Err(EffectError::ambiguous(format!(
                    "the outage's task ended without an answer: {error}"
                ))),
            )
        });
        let definite = is_definite(&outcome);
        if stopped {
            self.shared.applied(|f| {
                f.engine_outages += 1;
                if definite {
                    f.definite_in_outage += 1;
                }
            });
        }
        outcome
    }

    /// A create held before it reaches the plugin until the trace releases
    /// it: a slow call, in a task of the substrate's runtime, so that it
    /// goes on after a controller crash.
    async fn create_held(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let serial = self.shared.hang(real.id, (), |f| f.creates_held += 1);
        let outcome = hold_call(&self.shared, &self.adapter, serial, real).await;
        if let Ok(EffectOutput::LeaseCreated { adopted: false, .. }) = &outcome {
            self.check_single_container(key);
        }
        outcome
    }

    /// A create or destroy done on the engine whose reply is thrown away.
    async fn reply_lost(
        &self,
        real: &Operation,
        step: FaultStep,
    ) -> Result<EffectOutput, EffectError> {
        self.plugin.arm_fault(step, FaultMode::ReplyLost);
        let outcome = self.adapter.execute(real).await;
        if outcome.as_ref().is_err_and(EffectError::is_ambiguous) {
            self.shared.applied(|f| f.replies_lost += 1);
        }
        outcome
    }

    /// A lookup while the node's container is paused.
    async fn lookup_paused(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let Some(name) = container_name(&AttemptKey {
            run_id: self.world.run.clone(),
            node: key.0.clone(),
            attempt: key.1,
        }) else {
            return self.adapter.execute(real).await;
        };
        let context = self.world.context.clone();
        let pausing = name.clone();
        let paused =
            tokio::task::spawn_blocking(move || context.engine().docker(&["pause", &pausing]).0)
                .await
                .unwrap_or(false);
        let outcome = self.adapter.execute(real).await;
        if paused {
            let context = self.world.context.clone();
            let _ =
                tokio::task::spawn_blocking(move || context.engine().docker(&["unpause", &name]))
                    .await;
            if let Ok(EffectOutput::Endpoint(EndpointLookup::NotReady)) = &outcome {
                self.shared.applied(|f| f.paused_not_ready += 1);
            }
        }
        outcome
    }
}

impl EffectBackend for ContainerBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(self.run(operation))
    }
}
