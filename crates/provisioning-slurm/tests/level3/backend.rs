//! The backend under the executor: the real `PluginBackendAdapter` over the
//! real [`SlurmPlugin`], with every scripted fault a real event.
//!
//! | Scripted fault | Call | What really happens |
//! |---|---|---|
//! | `definite` | create | every other one asks for more memory than any node has: the controller refuses the request no node can satisfy; the others meet a closed controller port (see `cli`) |
//! | `definite` | lookup | the first of a run stops `slurmctld` (SIGTERM), makes the call, and starts it again from its saved state (then waits until every node answers it again): a real outage; later ones meet a closed port |
//! | `definite` | other | a closed controller port (see `cli`) |
//! | `ambiguous-undone`, `ambiguous-done`, `hang` | any | on the call's first or acting Slurm command (see `cli`); a held create runs in a task of its own, which outlives a controller crash |
//! | `not-ready` | lookup | the lookup is made at once, while the job is still pending; a job already running is suspended (`scontrol suspend`) for the lookup and resumed after |
//! | `panic` | — | refused: no event of a cluster |
//!
//! A lookup without a `not-ready` fault first waits (bounded) until the job
//! runs — jobs take about a second to start, and the harness's clock is
//! virtual. Every operation is translated to the substrate's own run, and
//! its spec to a `slurm` node whose one verify command reads a verdict from
//! the node's boot gate and whose workload sleeps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use provisioning::effect::EffectRequest;
use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{
    EffectError, EffectKind, EffectOutput, EndpointLookup, LeaseHandle, Operation, ProviderShape,
    RunId,
};
use provisioning_conformance::level3::RealNode;
pub(crate) use provisioning_conformance::level3::attempt_key;
use provisioning_conformance::substrate::{CallRecorder, ResourceKey};
use provisioning_conformance::trace::Fault;
use provisioning_provider::{AttemptKey, PluginBackendAdapter, ProvisionPlugin};
use provisioning_slurm::parse::parse_job_name;
use provisioning_slurm::testbed::NODE_MEMORY_MB;
use provisioning_slurm::{LABEL_PREFIX, PROVIDER_KIND, SlurmPlugin, Tool};

use super::Level3;
use super::cli::{CallFault, with_fault};
use super::shared::Shared;
use super::substrate::Gates;

/// The environment variable naming the gate directory in verify commands.
pub(crate) const GATES_ENV: &str = "PROVISION_L3_GATES";

/// The verify command of every node: read the verdict from the node's gate.
pub(crate) const GATE_VERIFY_COMMAND: &str = "read verdict < \"$PROVISION_L3_GATES/$PROVISION_NODE_ID.$PROVISION_ATTEMPT\"; \
     [ \"$verdict\" = pass ] || { echo \"boot gate says: $verdict\" >&2; exit 1; }";

/// How many lookups of one run may stop the controller.
const CONTROLLER_OUTAGES_PER_RUN: u64 = 1;

/// How long a lookup waits for its job to run before it asks.
const RUN_WAIT_MAX: Duration = Duration::from_secs(8);

/// The pause between two looks while a lookup waits for its job.
const RUN_WAIT_POLL: Duration = Duration::from_millis(100);

/// Longer than the plugin keeps a job listing for its lookups.
const LISTING_AGE_WAIT: Duration = Duration::from_millis(250);

/// A deliberate dishonesty of the backend, to show that Level 3's counts
/// come from `squeue` and not from anyone's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Defect {
    /// A destroy answers success without reaching Slurm: the driver and the
    /// plugin believe the job gone; `squeue` shows it running.
    DestroyIsSkipped,
}

/// The backend the executor runs effects through. See the module docs.
pub(crate) struct SlurmBackend {
    adapter: Arc<PluginBackendAdapter>,
    plugin: Arc<SlurmPlugin>,
    /// Calls as they start, for G04 and G05.
    pub(crate) calls: CallRecorder,
    shared: Arc<Shared>,
    context: Arc<Level3>,
    run: RunId,
    gates: Arc<Gates>,
    defect: Option<Defect>,
    /// Creates with a `definite` fault so far (they alternate).
    definite_creates: AtomicU64,
    /// Lookups with a `definite` fault so far (the first few stop slurmctld).
    outages: AtomicU64,
}

/// The command a lost reply is meant for in a call of `kind`.
fn acting_tool(kind: EffectKind) -> Tool {
    match kind {
        EffectKind::CreateLease => Tool::Sbatch,
        EffectKind::CancelBootstrap | EffectKind::DestroyLease => Tool::Scancel,
        _ => Tool::Squeue,
    }
}

impl SlurmBackend {
    /// A backend over `plugin` through `adapter`.
    pub(crate) fn new(
        adapter: PluginBackendAdapter,
        plugin: Arc<SlurmPlugin>,
        shared: Arc<Shared>,
        context: Arc<Level3>,
        run: RunId,
        gates: Arc<Gates>,
        defect: Option<Defect>,
    ) -> Self {
        SlurmBackend {
            adapter: Arc::new(adapter),
            plugin,
            calls: CallRecorder::new(),
            shared,
            context,
            run,
            gates,
            defect,
            definite_creates: AtomicU64::new(0),
            outages: AtomicU64::new(0),
        }
    }

    /// The operation as the plugin sees it: the substrate's run, a `slurm`
    /// spec, more memory than any node has when `unsatisfiable`.
    fn translate(&self, operation: &Operation, unsatisfiable: bool) -> Operation {
        let mut labels = BTreeMap::new();
        if unsatisfiable {
            labels.insert(
                format!("{LABEL_PREFIX}memory"),
                format!("{}M", 2 * NODE_MEMORY_MB),
            );
        }
        RealNode {
            run: &self.run,
            provider: PROVIDER_KIND,
            verify_command: GATE_VERIFY_COMMAND,
            env: BTreeMap::from([(GATES_ENV.to_owned(), self.gates.dir().display().to_string())]),
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
        let kind = operation.kind();
        let fault = self.shared.take_script_unapplied(kind);
        if kind == EffectKind::StartBootstrap {
            self.gates.prepare(&key);
            self.shared.session_starting(&key);
        }
        let outcome = match (&operation.request, fault) {
            (EffectRequest::DestroyLease { .. }, _)
                if self.defect == Some(Defect::DestroyIsSkipped) =>
            {
                Ok(EffectOutput::LeaseDestroyed)
            }
            (EffectRequest::CreateLease, Some(Fault::Definite))
                if self.definite_creates.fetch_add(1, Ordering::Relaxed) % 2 == 0 =>
            {
                self.create_unsatisfiable(operation).await
            }
            (EffectRequest::LookupEndpoint { .. }, Some(Fault::Definite))
                if self.outages.fetch_add(1, Ordering::Relaxed) < CONTROLLER_OUTAGES_PER_RUN =>
            {
                self.lookup_in_outage(operation).await
            }
            (EffectRequest::CreateLease, Some(Fault::Hang)) => self.create_held(operation).await,
            (EffectRequest::LookupEndpoint { lease }, Some(Fault::NotReady)) => {
                self.lookup_not_ready(operation, &key, lease).await
            }
            (request, fault) => {
                if let EffectRequest::LookupEndpoint { lease } = request {
                    self.wait_until_running(&key, lease).await;
                }
                self.execute(operation, fault).await
            }
        };
        if let (EffectRequest::CreateLease, Ok(EffectOutput::LeaseCreated { adopted, .. })) =
            (&operation.request, &outcome)
            && !adopted
        {
            self.check_single_job(&key);
        }
        self.shared.answered(operation, &outcome);
        outcome
    }

    /// The call through the adapter, `fault` applied to its commands.
    async fn execute(
        &self,
        operation: &Operation,
        fault: Option<Fault>,
    ) -> Result<EffectOutput, EffectError> {
        let real = self.translate(operation, false);
        let fault = fault
            .filter(|f| !matches!(f, Fault::Succeed | Fault::NotReady | Fault::Panic))
            .map(|f| CallFault::new(operation.id, f, acting_tool(operation.kind())));
        let outcome = with_fault(fault.clone(), self.adapter.execute(&real)).await;
        if fault.is_some_and(|f| f.untaken()) {
            self.shared.count(|f| f.scripts_not_reached += 1);
        }
        outcome
    }

    /// A create whose first command is stopped, in a task of its own: like
    /// a slow call to a cloud API, it goes on when the controller that made
    /// it crashed and its executor was dropped — and may then submit a job
    /// after recovery moved on: an orphan, found by listing.
    async fn create_held(&self, operation: &Operation) -> Result<EffectOutput, EffectError> {
        let real = self.translate(operation, false);
        let fault = CallFault::new(operation.id, Fault::Hang, Tool::Sbatch);
        let adapter = self.adapter.clone();
        let detached = self.shared.detached(operation.id);
        let call = tokio::spawn(async move {
            let _detached = detached;
            with_fault(Some(fault), adapter.execute(&real)).await
        });
        call.await.unwrap_or_else(|error| {
            Err(EffectError::ambiguous(format!(
                "the held create's task ended without an answer: {error}"
            )))
        })
    }

    /// A create that asks for more memory than any node has.
    async fn create_unsatisfiable(
        &self,
        operation: &Operation,
    ) -> Result<EffectOutput, EffectError> {
        let real = self.translate(operation, true);
        let outcome = self.adapter.execute(&real).await;
        match &outcome {
            Err(error) if !error.is_ambiguous() => {
                self.shared.applied(|f| f.unsatisfiable += 1);
            }
            _ => self.shared.count(|f| f.scripts_not_reached += 1),
        }
        outcome
    }

    /// A lookup while `slurmctld` is stopped; it is started again after.
    /// The three steps run in a task of their own, so that the controller
    /// comes back even when the harness leaves the call unpolled.
    async fn lookup_in_outage(&self, operation: &Operation) -> Result<EffectOutput, EffectError> {
        let real = self.translate(operation, false);
        let adapter = self.adapter.clone();
        let context = self.context.clone();
        let detached = self.shared.detached(operation.id);
        let outage = tokio::spawn(async move {
            let _detached = detached;
            let stopper = context.clone();
            let stopped = tokio::task::spawn_blocking(move || stopper.bed().stop_controller())
                .await
                .is_ok();
            let outcome = adapter.execute(&real).await;
            let restarted = tokio::task::spawn_blocking(move || {
                context.bed().restart_controller();
                context.wait_nodes_respond();
            })
            .await;
            if let Err(error) = restarted {
                // The testbed panicked: the cluster is unusable; say so loudly.
                eprintln!("level 3: slurmctld did not come back: {error}");
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
        let definite = outcome.as_ref().is_err_and(|e| !e.is_ambiguous());
        if stopped {
            self.shared.applied(|f| {
                f.controller_outages += 1;
                if definite {
                    f.definite_in_outage += 1;
                }
            });
        }
        outcome
    }

    /// A lookup made at once; a running job is suspended for it.
    async fn lookup_not_ready(
        &self,
        operation: &Operation,
        key: &ResourceKey,
        lease: &LeaseHandle,
    ) -> Result<EffectOutput, EffectError> {
        let asked = attempt_key(&self.run, key);
        let running = matches!(
            self.plugin.lookup_endpoint(&asked, lease).await,
            Ok(EndpointLookup::Ready(_))
        );
        let job = lease.0.strip_prefix("slurm:").map(str::to_owned);
        let suspended = match (&job, running) {
            (Some(job), true) => self.scontrol("suspend", job).await,
            _ => false,
        };
        if suspended {
            // The plugin answers lookups from a listing a moment old.
            tokio::time::sleep(LISTING_AGE_WAIT).await;
        }
        let outcome = self.execute(operation, None).await;
        if let (Some(job), true) = (&job, suspended) {
            self.scontrol("resume", job).await;
        }
        if let Ok(EffectOutput::Endpoint(EndpointLookup::NotReady)) = &outcome {
            self.shared.applied(|f| f.not_ready_answers += 1);
        } else {
            self.shared.count(|f| f.scripts_not_reached += 1);
        }
        outcome
    }

    /// `scontrol ACTION JOB` on the testbed; whether it succeeded.
    async fn scontrol(&self, action: &str, job: &str) -> bool {
        let context = self.context.clone();
        let (action, job) = (action.to_owned(), job.to_owned());
        tokio::task::spawn_blocking(move || {
            context
                .bed()
                .client("scontrol")
                .args([action.as_str(), job.as_str()])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .await
        .unwrap_or(false)
    }

    /// Waits (bounded) until the plugin sees the job of `key` run, or gone.
    async fn wait_until_running(&self, key: &ResourceKey, lease: &LeaseHandle) {
        let asked = attempt_key(&self.run, key);
        let deadline = tokio::time::Instant::now() + RUN_WAIT_MAX;
        while tokio::time::Instant::now() < deadline {
            match self.plugin.lookup_endpoint(&asked, lease).await {
                Ok(EndpointLookup::NotReady) => {}
                Ok(EndpointLookup::Ready(_)) | Err(_) => return,
            }
            tokio::time::sleep(RUN_WAIT_POLL).await;
        }
    }

    /// Raises a G08 alarm when `squeue` shows, right after `key` was
    /// created, another live job of its attempt or one of another attempt
    /// of its slot.
    fn check_single_job(&self, key: &ResourceKey) {
        let jobs = self.context.live_jobs(&self.run);
        let of_slot: Vec<(u64, String, AttemptKey)> = jobs
            .into_iter()
            .filter(|(_, _, state, _)| state != "COMPLETING")
            .filter_map(|(id, name, ..)| {
                let parsed = parse_job_name(&self.run, &name)?;
                (parsed.node == key.0).then_some((id, name, parsed))
            })
            .collect();
        let own = of_slot.iter().filter(|(.., k)| k.attempt == key.1).count();
        let others: Vec<String> = of_slot
            .iter()
            .filter(|(.., k)| k.attempt != key.1)
            .map(|(id, name, _)| format!("{name} (job {id})"))
            .collect();
        if own > 1 || !others.is_empty() {
            self.shared.alarm(format!(
                "after creating {}/{}, squeue shows {own} job(s) of that attempt and jobs of other attempts of the slot: [{}]",
                key.0,
                key.1,
                others.join(", ")
            ));
        }
    }
}

impl EffectBackend for SlurmBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(self.run(operation))
    }
}
