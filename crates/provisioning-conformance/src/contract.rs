//! The seam contract suite: what every [`ProvisionPlugin`] must do, checked
//! against a plugin you hand in.
//!
//! The battery ([`crate::Battery`]) drives a whole cluster through a plugin
//! and checks the cluster's guarantees. This suite is smaller and sharper: it
//! calls the plugin's methods directly, a few at a time, and checks the
//! promises the driver relies on — the ones in the [`ProvisionPlugin`] docs:
//!
//! | Contract | What is checked |
//! |---|---|
//! | [`Contract::CreateTwiceAdopts`] | a second `create_node` for one key adopts the first node; `list_nodes` still shows one |
//! | [`Contract::DefiniteFaultCreatesNothing`] | a `create_node` that fails definitely leaves nothing listed for its key |
//! | [`Contract::DefiniteFaultAdoptsExisting`] | a fault on the creation path never hides a live node: the call adopts it (or is ambiguous), never fails definitely |
//! | [`Contract::AmbiguousFaultRetryAdopts`] | after an ambiguous `create_node`, at most one node exists, and the retry adopts it without creating a second |
//! | [`Contract::StartTwiceAdopts`] | a second `start_bootstrap` for one key adopts the running session |
//! | [`Contract::CleanupOfAbsentSucceeds`] | `cancel_bootstrap` and `destroy_node` of something absent succeed (or say not found) |
//! | [`Contract::CleanupFaultsRetry`] | a definite `destroy_node` failure leaves the node; an ambiguous one is followed by a retry that succeeds |
//! | [`Contract::ListIsExact`] | `list_nodes` reports exactly the live nodes of the run, each once, with the lease `create_node` returned |
//! | [`Contract::TeardownLeavesNothing`] | cancelling and destroying every node leaves nothing listed |
//! | [`Contract::SupersededFactsDropped`] | facts of a lost node are reported under its own attempt, and those of a superseded attempt never reach the driver |
//!
//! Contracts that need a fault the plugin cannot be made to produce are
//! **skipped with a reason**, never silently passed: faults come from the
//! plugin author through the optional [`ContractFaults`] hook.
//!
//! # Running it
//! The suite is an `async fn` you await on your own runtime; it spawns
//! nothing and reads no clock. The factory builds a fresh plugin for every
//! contract.
//!
//! ```
//! use std::convert::Infallible;
//! use provisioning_conformance::contract::{complete_without_runtime, run_contract_suite};
//! use provisioning_conformance::plugin_fake::FakePlugin;
//!
//! let suite = run_contract_suite(|| async {
//!     let plugin = FakePlugin::new();
//!     // Your plugin here; `with_faults` is optional but unlocks most contracts.
//!     Ok::<_, Infallible>(plugin.contract_subject())
//! });
//! // With tokio: `let report = suite.await;` inside `#[tokio::test]`.
//! let report = complete_without_runtime(suite).expect("the fake never waits");
//! report.assert_passed();
//! assert!(report.skipped().is_empty(), "{report}");
//! ```
//!
//! # Caveats
//! The suite awaits every plugin call as it is; a call that never returns
//! hangs the suite. Bound it with your runtime's timeout
//! (`tokio::time::timeout(Duration::from_secs(120), suite)`).

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::FutureExt;
use provisioning::effect::{EffectRequest, SessionHandle};
use provisioning::executor::EffectBackend;
use provisioning::id::OperationSequence;
use provisioning::spawn::BoxFuture;
use provisioning::{
    EffectKind, EffectOutput, EndpointLookup, GroupId, LeaseHandle, LogicalNodeId, LogicalNodeSpec,
    NodeAttemptId, NodeTemplate, Observation, Operation, OperationId, RunId,
};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, ListedNode, NodeLease, ObservationSink, PluginBackendAdapter,
    PluginError, ProvisionPlugin,
};

use crate::harness::panic_text;
use crate::trace::Fault;

/// How many times the suite asks for an endpoint before it gives up on a
/// node becoming reachable (pausing between asks when the subject has a pause).
pub const ENDPOINT_POLLS_MAX: usize = 100;

/// The pause between endpoint polls, handed to the subject's pause function.
pub const ENDPOINT_POLL_PAUSE: Duration = Duration::from_millis(50);

/// How many times the suite looks for the report of a lost node before it
/// decides the plugin reported nothing (pausing between looks when the
/// subject has a pause).
pub const LOSS_REPORT_POLLS_MAX: usize = 100;

/// How many polls [`complete_without_runtime`] spends before giving up.
pub const MAX_POLLS_WITHOUT_RUNTIME: usize = 1 << 16;

/// The most nodes the suite's own teardown destroys after a contract.
pub const TEARDOWN_NODES_MAX: usize = 64;

/// The group every node the suite creates belongs to.
pub const CONTRACT_GROUP: &str = "contract";

/// A lease or session handle no plugin ever issued, for the absent-cleanup calls.
const NEVER_ISSUED: &str = "provisioning-contract-never-issued";

/// One method of [`ProvisionPlugin`], for fault scripting and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PluginMethod {
    /// [`ProvisionPlugin::create_node`].
    CreateNode,
    /// [`ProvisionPlugin::lookup_endpoint`].
    LookupEndpoint,
    /// [`ProvisionPlugin::start_bootstrap`].
    StartBootstrap,
    /// [`ProvisionPlugin::complete_bootstrap`].
    CompleteBootstrap,
    /// [`ProvisionPlugin::cancel_bootstrap`].
    CancelBootstrap,
    /// [`ProvisionPlugin::destroy_node`].
    DestroyNode,
    /// [`ProvisionPlugin::list_nodes`].
    ListNodes,
}

impl PluginMethod {
    /// Every method, in trait order.
    pub const ALL: [PluginMethod; 7] = [
        PluginMethod::CreateNode,
        PluginMethod::LookupEndpoint,
        PluginMethod::StartBootstrap,
        PluginMethod::CompleteBootstrap,
        PluginMethod::CancelBootstrap,
        PluginMethod::DestroyNode,
        PluginMethod::ListNodes,
    ];

    /// The method's name in the trait.
    pub fn name(self) -> &'static str {
        match self {
            PluginMethod::CreateNode => "create_node",
            PluginMethod::LookupEndpoint => "lookup_endpoint",
            PluginMethod::StartBootstrap => "start_bootstrap",
            PluginMethod::CompleteBootstrap => "complete_bootstrap",
            PluginMethod::CancelBootstrap => "cancel_bootstrap",
            PluginMethod::DestroyNode => "destroy_node",
            PluginMethod::ListNodes => "list_nodes",
        }
    }

    /// The method [`PluginBackendAdapter`] calls for an effect of `kind`.
    pub fn for_effect(kind: EffectKind) -> PluginMethod {
        match kind {
            EffectKind::CreateLease => PluginMethod::CreateNode,
            EffectKind::LookupEndpoint => PluginMethod::LookupEndpoint,
            EffectKind::StartBootstrap => PluginMethod::StartBootstrap,
            EffectKind::BootstrapConvergenceObserved => PluginMethod::CompleteBootstrap,
            EffectKind::CancelBootstrap => PluginMethod::CancelBootstrap,
            EffectKind::DestroyLease => PluginMethod::DestroyNode,
        }
    }
}

impl fmt::Display for PluginMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The plugin author's hands on their plugin's failures: how the suite makes
/// a call fail or a node disappear. Every method is optional; a contract
/// whose fault cannot be produced is skipped with a reason.
///
/// Only these [`Fault`]s are asked for: [`Fault::Definite`] (the call fails
/// definitely, as a refused request would), [`Fault::AmbiguousDone`] (the
/// call does its work, then reports an ambiguous failure, as a lost reply
/// would) and [`Fault::AmbiguousUndone`] (an ambiguous failure whether or not
/// the work happened — a timeout).
pub trait ContractFaults: Send + Sync {
    /// Makes the next call of `method` that reaches the provider fail with
    /// `fault`. Returns `false` when the plugin cannot produce that fault (the
    /// default).
    ///
    /// A plugin that looks for an existing resource before creating never
    /// reaches the creation step when it adopts; a fault armed for that step
    /// then stays armed, which the suite allows.
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        let _ = (method, fault);
        false
    }

    /// Makes the node of `key` disappear behind the plugin's back (a killed
    /// process, a terminated machine). Resolves to `true` once it is gone; the
    /// suite then waits (with the subject's pause, at most
    /// [`LOSS_REPORT_POLLS_MAX`] times) for the plugin to report the loss
    /// through its sink. Resolves to `false` when the plugin cannot lose a node
    /// on demand (the default).
    fn lose_node<'a>(&'a self, key: &'a AttemptKey) -> BoxFuture<'a, bool> {
        let _ = key;
        Box::pin(std::future::ready(false))
    }
}

/// How the suite waits between endpoint polls: your runtime's sleep.
pub type PauseFn = Arc<dyn Fn(Duration) -> BoxFuture<'static, ()> + Send + Sync>;

/// What the factory hands the suite for one contract: the plugin, the run it
/// serves, and optionally its fault hook, a node template and a pause.
#[derive(Clone)]
pub struct ContractSubject {
    plugin: Arc<dyn ProvisionPlugin>,
    run_id: RunId,
    faults: Option<Arc<dyn ContractFaults>>,
    template: Option<NodeTemplate>,
    pause: Option<PauseFn>,
}

impl fmt::Debug for ContractSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContractSubject")
            .field("kind", &self.plugin.kind())
            .field("run_id", &self.run_id)
            .field("faults", &self.faults.is_some())
            .field("template", &self.template)
            .field("pause", &self.pause.is_some())
            .finish()
    }
}

impl ContractSubject {
    /// A fresh `plugin` that serves `run_id`. Nothing may be attached to it
    /// yet: the suite attaches its own sink.
    pub fn new(plugin: Arc<dyn ProvisionPlugin>, run_id: RunId) -> Self {
        ContractSubject {
            plugin,
            run_id,
            faults: None,
            template: None,
            pause: None,
        }
    }

    /// The hook that produces faults (see [`ContractFaults`]).
    pub fn with_faults(mut self, faults: Arc<dyn ContractFaults>) -> Self {
        self.faults = Some(faults);
        self
    }

    /// The template the suite's nodes are created with (its provider kind is
    /// replaced by the plugin's). By default: role `contract`, everything else
    /// empty.
    pub fn with_template(mut self, template: NodeTemplate) -> Self {
        self.template = Some(template);
        self
    }

    /// How to wait between polls (for an endpoint, for the report of a lost
    /// node), for a plugin that works in the background; for example
    /// `Arc::new(|d| Box::pin(tokio::time::sleep(d)))`. Without one the suite
    /// only yields to the runtime between its at most [`ENDPOINT_POLLS_MAX`]
    /// (or [`LOSS_REPORT_POLLS_MAX`]) looks.
    pub fn with_pause(mut self, pause: PauseFn) -> Self {
        self.pause = Some(pause);
        self
    }
}

/// The promises the suite checks. See the [module docs](self) for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Contract {
    /// A second create for the same attempt adopts without creating.
    CreateTwiceAdopts,
    /// A definite create fault creates nothing.
    DefiniteFaultCreatesNothing,
    /// A definite fault on the creation path never hides a live node.
    DefiniteFaultAdoptsExisting,
    /// An ambiguous create fault may create; the retry adopts.
    AmbiguousFaultRetryAdopts,
    /// A second bootstrap start for the same attempt adopts the session.
    StartTwiceAdopts,
    /// Cancel and destroy of something absent succeed.
    CleanupOfAbsentSucceeds,
    /// Failed cleanup keeps the node (definite) or is retried (ambiguous).
    CleanupFaultsRetry,
    /// `list_nodes` reports exactly the live nodes.
    ListIsExact,
    /// Full teardown leaves nothing.
    TeardownLeavesNothing,
    /// Facts of a superseded attempt are dropped.
    SupersededFactsDropped,
}

impl Contract {
    /// Every contract, in the order the suite runs them.
    pub const ALL: [Contract; 10] = [
        Contract::CreateTwiceAdopts,
        Contract::DefiniteFaultCreatesNothing,
        Contract::DefiniteFaultAdoptsExisting,
        Contract::AmbiguousFaultRetryAdopts,
        Contract::StartTwiceAdopts,
        Contract::CleanupOfAbsentSucceeds,
        Contract::CleanupFaultsRetry,
        Contract::ListIsExact,
        Contract::TeardownLeavesNothing,
        Contract::SupersededFactsDropped,
    ];

    /// The contract's stable name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Contract::CreateTwiceAdopts => "create-twice-adopts",
            Contract::DefiniteFaultCreatesNothing => "definite-fault-creates-nothing",
            Contract::DefiniteFaultAdoptsExisting => "definite-fault-adopts-existing",
            Contract::AmbiguousFaultRetryAdopts => "ambiguous-fault-retry-adopts",
            Contract::StartTwiceAdopts => "start-twice-adopts",
            Contract::CleanupOfAbsentSucceeds => "cleanup-of-absent-succeeds",
            Contract::CleanupFaultsRetry => "cleanup-faults-retry",
            Contract::ListIsExact => "list-is-exact",
            Contract::TeardownLeavesNothing => "teardown-leaves-nothing",
            Contract::SupersededFactsDropped => "superseded-facts-dropped",
        }
    }
}

impl fmt::Display for Contract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What happened to one contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContractVerdict {
    /// The plugin kept the contract.
    Passed,
    /// The plugin broke the contract; the text says how.
    Failed(String),
    /// The contract could not be checked; the text says why.
    Skipped(String),
}

/// The verdict on one contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContractResult {
    /// The contract.
    pub contract: Contract,
    /// Its verdict.
    pub verdict: ContractVerdict,
}

/// What the suite found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContractReport {
    /// The provider kind of the plugin checked (empty when no subject was built).
    pub kind: String,
    /// One result per contract, in [`Contract::ALL`] order.
    pub results: Vec<ContractResult>,
}

impl ContractReport {
    /// The verdict on `contract`.
    pub fn verdict(&self, contract: Contract) -> Option<&ContractVerdict> {
        self.results
            .iter()
            .find(|r| r.contract == contract)
            .map(|r| &r.verdict)
    }

    /// The contracts kept.
    pub fn passed(&self) -> Vec<Contract> {
        self.results
            .iter()
            .filter(|r| r.verdict == ContractVerdict::Passed)
            .map(|r| r.contract)
            .collect()
    }

    /// The contracts broken, with how.
    pub fn failed(&self) -> Vec<(Contract, &str)> {
        self.results
            .iter()
            .filter_map(|r| match &r.verdict {
                ContractVerdict::Failed(why) => Some((r.contract, why.as_str())),
                _ => None,
            })
            .collect()
    }

    /// The contracts not checked, with why.
    pub fn skipped(&self) -> Vec<(Contract, &str)> {
        self.results
            .iter()
            .filter_map(|r| match &r.verdict {
                ContractVerdict::Skipped(why) => Some((r.contract, why.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Whether no contract failed (skipped ones are listed in the report).
    pub fn is_success(&self) -> bool {
        self.failed().is_empty()
    }

    /// Panics with the whole report when a contract failed.
    ///
    /// # Panics
    /// When [`ContractReport::is_success`] is false.
    #[track_caller]
    pub fn assert_passed(&self) {
        assert!(
            self.is_success(),
            "the plugin breaks the seam contract:\n{self}"
        );
    }
}

impl fmt::Display for ContractReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seam contract suite for provider {:?}: {} passed, {} failed, {} skipped",
            self.kind,
            self.passed().len(),
            self.failed().len(),
            self.skipped().len()
        )?;
        for result in &self.results {
            match &result.verdict {
                ContractVerdict::Passed => writeln!(f, "  pass  {}", result.contract)?,
                ContractVerdict::Failed(why) => {
                    writeln!(f, "  FAIL  {}: {why}", result.contract)?;
                }
                ContractVerdict::Skipped(why) => {
                    writeln!(f, "  skip  {}: {why}", result.contract)?;
                }
            }
        }
        Ok(())
    }
}

/// Runs every contract against a fresh plugin from `factory` each.
///
/// # Guarantees
/// Every contract in [`Contract::ALL`] gets exactly one verdict. A factory
/// error or a plugin panic fails that contract with its message; nothing
/// else stops the suite. After each contract the suite destroys every node
/// the plugin still lists for the run, then drops the subject.
///
/// # Assumptions
/// The factory returns a plugin with nothing attached and nothing live for
/// the subject's run. The suite uses group [`CONTRACT_GROUP`] and attempts
/// from 1 upwards.
///
/// # Caveats
/// Spawns nothing and reads no clock: await it on the runtime your plugin
/// needs, and bound it with that runtime's timeout.
pub async fn run_contract_suite<F, Fut, E>(mut factory: F) -> ContractReport
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<ContractSubject, E>>,
    E: fmt::Display,
{
    let mut report = ContractReport {
        kind: String::new(),
        results: Vec::with_capacity(Contract::ALL.len()),
    };
    for contract in Contract::ALL {
        let verdict = match factory().await {
            Ok(subject) => {
                report.kind = subject.plugin.kind().to_owned();
                let run = ContractRun::new(subject);
                let checked = AssertUnwindSafe(run.check(contract)).catch_unwind().await;
                let verdict = match checked {
                    Ok(Ok(())) => ContractVerdict::Passed,
                    Ok(Err(Stop::Failed(why))) => ContractVerdict::Failed(why),
                    Ok(Err(Stop::Skipped(why))) => ContractVerdict::Skipped(why),
                    Err(payload) => ContractVerdict::Failed(format!(
                        "the plugin panicked: {}",
                        panic_text(payload.as_ref())
                    )),
                };
                let _ = AssertUnwindSafe(run.teardown()).catch_unwind().await;
                verdict
            }
            Err(error) => ContractVerdict::Failed(format!("the factory failed: {error}")),
        };
        report.results.push(ContractResult { contract, verdict });
    }
    report
}

/// Polls `future` to completion without a runtime: for plugins whose calls
/// never wait (in-memory fakes). Returns `None` when it is still pending
/// after [`MAX_POLLS_WITHOUT_RUNTIME`] polls — it waits for something only a
/// runtime would deliver.
pub fn complete_without_runtime<F: Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    for _ in 0..MAX_POLLS_WITHOUT_RUNTIME {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return Some(output);
        }
    }
    None
}

/// Returns `Pending` once (waking itself at once), then `Ready`: lets a
/// runtime run other work without the suite knowing which runtime it is.
struct YieldOnce {
    yielded: bool,
}

impl Future for YieldOnce {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Why a contract stopped early.
enum Stop {
    Failed(String),
    Skipped(String),
}

type Step<T = ()> = Result<T, Stop>;

fn fail<T>(why: impl Into<String>) -> Step<T> {
    Err(Stop::Failed(why.into()))
}

fn skip<T>(why: impl Into<String>) -> Step<T> {
    Err(Stop::Skipped(why.into()))
}

/// Whether a cleanup call's answer counts as success.
/// How many times the suite repeats a cleanup step answered "ambiguous"
/// (a real engine may take longer than one call waits to confirm absence:
/// Slurm's step cleanup, say).
const CLEANUP_AMBIGUOUS_RETRIES: usize = 2;

fn cleanup_ok(outcome: &Result<(), PluginError>) -> bool {
    matches!(outcome, Ok(()) | Err(PluginError::NotFound(_)))
}

fn describe_leases(leases: &[LeaseHandle]) -> String {
    if leases.is_empty() {
        return "nothing".to_owned();
    }
    leases
        .iter()
        .map(|l| l.0.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// One contract's plugin, sink and adapter.
struct ContractRun {
    subject: ContractSubject,
    adapter: PluginBackendAdapter,
    delivered: Arc<Mutex<Vec<Observation>>>,
    template: Arc<NodeTemplate>,
}

impl ContractRun {
    fn new(subject: ContractSubject) -> Self {
        let delivered = Arc::new(Mutex::new(Vec::new()));
        let record = delivered.clone();
        let sink = ObservationSink::new(move |observation| {
            record
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(observation);
        });
        let adapter = PluginBackendAdapter::single(subject.plugin.clone(), sink);
        let mut template = subject.template.clone().unwrap_or_else(|| NodeTemplate {
            role: CONTRACT_GROUP.to_owned(),
            provider: String::new(),
            shape: Default::default(),
            boot: Default::default(),
            swarm_join: Default::default(),
        });
        subject.plugin.kind().clone_into(&mut template.provider);
        ContractRun {
            subject,
            adapter,
            delivered,
            template: Arc::new(template),
        }
    }

    fn plugin(&self) -> &dyn ProvisionPlugin {
        &*self.subject.plugin
    }

    fn run_id(&self) -> &RunId {
        &self.subject.run_id
    }

    fn key(&self, slot: u32, attempt: u64) -> AttemptKey {
        AttemptKey {
            run_id: self.run_id().clone(),
            node: LogicalNodeId::new(GroupId::new(CONTRACT_GROUP), slot),
            attempt: NodeAttemptId::from_raw(attempt),
        }
    }

    fn spec(&self, key: &AttemptKey) -> LogicalNodeSpec {
        LogicalNodeSpec::new(key.node.clone(), key.run_id.clone(), self.template.clone())
    }

    fn faults(&self) -> Step<&dyn ContractFaults> {
        match &self.subject.faults {
            Some(faults) => Ok(&**faults),
            None => skip("the subject has no ContractFaults hook (ContractSubject::with_faults)"),
        }
    }

    /// Arms the first fault of `choices` the hook can produce for `method`.
    fn inject_first(&self, method: PluginMethod, choices: &[Fault]) -> Step<Fault> {
        let faults = self.faults()?;
        for &fault in choices {
            if faults.inject(method, fault) {
                return Ok(fault);
            }
        }
        let names: Vec<&str> = choices.iter().map(|f| f.name()).collect();
        skip(format!(
            "the ContractFaults hook cannot make {method} fail with any of [{}]",
            names.join(", ")
        ))
    }

    fn delivered(&self) -> Vec<Observation> {
        self.delivered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn create(&self, key: &AttemptKey) -> Result<NodeLease, PluginError> {
        self.plugin().create_node(key, &self.spec(key)).await
    }

    async fn create_ok(&self, key: &AttemptKey, what: &str) -> Step<NodeLease> {
        match self.create(key).await {
            Ok(lease) => Ok(lease),
            Err(error) => fail(format!("{what}: create_node of {key} failed: {error:?}")),
        }
    }

    async fn listed(&self) -> Step<Vec<ListedNode>> {
        match self.plugin().list_nodes(self.run_id()).await {
            Ok(listed) => Ok(listed),
            Err(error) => fail(format!("list_nodes({}) failed: {error:?}", self.run_id())),
        }
    }

    async fn listed_for(&self, key: &AttemptKey) -> Step<Vec<LeaseHandle>> {
        Ok(self
            .listed()
            .await?
            .into_iter()
            .filter(|n| n.key == *key)
            .map(|n| n.lease)
            .collect())
    }

    async fn expect_listed(&self, key: &AttemptKey, expected: &[LeaseHandle], when: &str) -> Step {
        let listed = self.listed_for(key).await?;
        if listed == expected {
            return Ok(());
        }
        fail(format!(
            "{when}, list_nodes shows {} for {key}; expected {}",
            describe_leases(&listed),
            describe_leases(expected)
        ))
    }

    /// A destroy that succeeds or finds nothing. An ambiguous answer ("it may
    /// not have taken yet") is retried, as the driver retries a cleanup step,
    /// at most [`CLEANUP_AMBIGUOUS_RETRIES`] times.
    async fn destroy_ok(&self, key: &AttemptKey, lease: &LeaseHandle, when: &str) -> Step {
        let mut outcome = self.plugin().destroy_node(key, lease).await;
        for _ in 0..CLEANUP_AMBIGUOUS_RETRIES {
            if !matches!(outcome, Err(PluginError::Ambiguous(_))) {
                break;
            }
            outcome = self.plugin().destroy_node(key, lease).await;
        }
        if cleanup_ok(&outcome) {
            return Ok(());
        }
        fail(format!("{when}: destroy_node of {key} failed: {outcome:?}"))
    }

    async fn cancel_ok(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
        when: &str,
    ) -> Step {
        // Retried on an ambiguous answer, as `destroy_ok` is.
        let mut outcome = self.plugin().cancel_bootstrap(key, session).await;
        for _ in 0..CLEANUP_AMBIGUOUS_RETRIES {
            if !matches!(outcome, Err(PluginError::Ambiguous(_))) {
                break;
            }
            outcome = self.plugin().cancel_bootstrap(key, session).await;
        }
        if cleanup_ok(&outcome) {
            return Ok(());
        }
        fail(format!(
            "{when}: cancel_bootstrap of {key} failed: {outcome:?}"
        ))
    }

    /// Waits a little: the subject's pause, or else one yield to the runtime
    /// (so that work on the same thread can go on).
    async fn pause(&self) {
        match &self.subject.pause {
            Some(pause) => pause(ENDPOINT_POLL_PAUSE).await,
            None => YieldOnce { yielded: false }.await,
        }
    }

    /// A hint for failure messages of waits, when the subject has no pause.
    fn pause_hint(&self) -> &'static str {
        if self.subject.pause.is_some() {
            ""
        } else {
            "; give the subject a pause (ContractSubject::with_pause) if the plugin works in the background"
        }
    }

    /// Waits until `reported` holds for the sink's delivered facts after
    /// index `from` and its dropped count; returns whether it did.
    async fn await_report(
        &self,
        from: usize,
        reported: impl Fn(&[Observation], u64) -> bool,
    ) -> bool {
        let sink = self.adapter.sink();
        for _ in 0..LOSS_REPORT_POLLS_MAX {
            let delivered = self.delivered();
            if reported(
                delivered.get(from..).unwrap_or_default(),
                sink.dropped_count(),
            ) {
                return true;
            }
            self.pause().await;
        }
        false
    }

    /// The node's endpoint: the one create returned, or the first ready lookup.
    async fn endpoint(&self, key: &AttemptKey, lease: &NodeLease) -> Step<provisioning::Endpoint> {
        if let Some(endpoint) = &lease.endpoint {
            return Ok(endpoint.clone());
        }
        for _ in 0..ENDPOINT_POLLS_MAX {
            match self.plugin().lookup_endpoint(key, &lease.lease).await {
                Ok(EndpointLookup::Ready(endpoint)) => return Ok(endpoint),
                Ok(EndpointLookup::NotReady) => self.pause().await,
                Err(error) => {
                    return fail(format!(
                        "lookup_endpoint of the live node {key} failed: {error:?}"
                    ));
                }
            }
        }
        skip(format!(
            "the endpoint of {key} was not ready after {ENDPOINT_POLLS_MAX} lookups{}",
            self.pause_hint()
        ))
    }

    async fn check(&self, contract: Contract) -> Step {
        match contract {
            Contract::CreateTwiceAdopts => self.create_twice_adopts().await,
            Contract::DefiniteFaultCreatesNothing => self.definite_fault_creates_nothing().await,
            Contract::DefiniteFaultAdoptsExisting => self.definite_fault_adopts_existing().await,
            Contract::AmbiguousFaultRetryAdopts => self.ambiguous_fault_retry_adopts().await,
            Contract::StartTwiceAdopts => self.start_twice_adopts().await,
            Contract::CleanupOfAbsentSucceeds => self.cleanup_of_absent_succeeds().await,
            Contract::CleanupFaultsRetry => self.cleanup_faults_retry().await,
            Contract::ListIsExact => self.list_is_exact().await,
            Contract::TeardownLeavesNothing => self.teardown_leaves_nothing().await,
            Contract::SupersededFactsDropped => self.superseded_facts_dropped().await,
        }
    }

    /// Destroys whatever the plugin still lists for the run (best effort).
    async fn teardown(&self) {
        let Ok(listed) = self.plugin().list_nodes(self.run_id()).await else {
            return;
        };
        for node in listed.into_iter().take(TEARDOWN_NODES_MAX) {
            let _ = self.plugin().cancel_bootstrap(&node.key, None).await;
            let _ = self.plugin().destroy_node(&node.key, &node.lease).await;
        }
    }

    async fn create_twice_adopts(&self) -> Step {
        let key = self.key(0, 1);
        let first = self.create_ok(&key, "the first create").await?;
        if first.adopted {
            return fail(format!(
                "the first create_node of {key} on a fresh plugin claimed to adopt an existing node"
            ));
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&first.lease),
            "after one create_node",
        )
        .await?;
        let second = self.create_ok(&key, "the second create").await?;
        if !second.adopted || second.lease != first.lease {
            return fail(format!(
                "a second create_node for {key} did not adopt: it returned lease {} (adopted: {}) while {} was live — create must look for the key's node before creating",
                second.lease.0, second.adopted, first.lease.0
            ));
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&first.lease),
            "after a second create_node for the same key (it must adopt, not create)",
        )
        .await
    }

    async fn definite_fault_creates_nothing(&self) -> Step {
        self.inject_first(PluginMethod::CreateNode, &[Fault::Definite])?;
        let key = self.key(1, 1);
        match self.create(&key).await {
            Err(PluginError::Definite(_)) => {}
            Ok(lease) => {
                return fail(format!(
                    "create_node of {key} succeeded (lease {}) although a definite fault was injected: the ContractFaults hook did not take effect",
                    lease.lease.0
                ));
            }
            Err(other) => {
                return fail(format!(
                    "create_node of {key} answered {other:?} to an injected definite fault; expected PluginError::Definite"
                ));
            }
        }
        self.expect_listed(
            &key,
            &[],
            "after create_node failed definitely (a definite error must leave nothing behind for its key)",
        )
        .await?;
        let retry = self
            .create_ok(&key, "the retry after a definite fault")
            .await?;
        self.expect_listed(
            &key,
            std::slice::from_ref(&retry.lease),
            "after the retry of a definitely failed create_node",
        )
        .await
    }

    async fn definite_fault_adopts_existing(&self) -> Step {
        let key = self.key(2, 1);
        let live = self.create_ok(&key, "the first create").await?;
        self.inject_first(PluginMethod::CreateNode, &[Fault::Definite])?;
        match self.create(&key).await {
            Ok(again) if again.adopted && again.lease == live.lease => {}
            Ok(again) => {
                return fail(format!(
                    "under an injected definite fault, create_node of {key} returned lease {} (adopted: {}) instead of adopting the live {}",
                    again.lease.0, again.adopted, live.lease.0
                ));
            }
            Err(PluginError::Ambiguous(_)) => {}
            Err(other) => {
                return fail(format!(
                    "create_node of {key} answered {other:?} while its node {} was live: a plugin looks before it fails, so a definite (or not-found) error can never hide an existing node",
                    live.lease.0
                ));
            }
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&live.lease),
            "after a faulted create_node of a live node",
        )
        .await
    }

    async fn ambiguous_fault_retry_adopts(&self) -> Step {
        let fault = self.inject_first(
            PluginMethod::CreateNode,
            &[Fault::AmbiguousDone, Fault::AmbiguousUndone],
        )?;
        let key = self.key(3, 1);
        match self.create(&key).await {
            Err(PluginError::Ambiguous(_)) => {}
            Ok(lease) => {
                return fail(format!(
                    "create_node of {key} succeeded (lease {}) although an ambiguous fault ({}) was injected: the ContractFaults hook did not take effect",
                    lease.lease.0,
                    fault.name()
                ));
            }
            Err(other) => {
                return fail(format!(
                    "create_node of {key} answered {other:?} to an injected {} fault; expected PluginError::Ambiguous",
                    fault.name()
                ));
            }
        }
        let left = self.listed_for(&key).await?;
        if left.len() > 1 {
            return fail(format!(
                "one ambiguous create_node left {} nodes for {key}: {}",
                left.len(),
                describe_leases(&left)
            ));
        }
        if fault == Fault::AmbiguousDone && left.is_empty() {
            return fail(format!(
                "after a create_node that did its work and then failed ambiguously, list_nodes shows nothing for {key}: either the hook did not do the work or list_nodes misses the node"
            ));
        }
        let retry = self
            .create_ok(&key, "the retry after an ambiguous fault")
            .await?;
        if let Some(existing) = left.first() {
            if !retry.adopted || retry.lease != *existing {
                return fail(format!(
                    "the retry after an ambiguous create_node of {key} returned lease {} (adopted: {}) instead of adopting {}, which the first call left",
                    retry.lease.0, retry.adopted, existing.0
                ));
            }
        }
        self.expect_listed(
            &key,
            std::slice::from_ref(&retry.lease),
            "after the retry of an ambiguous create_node (one node, adopted)",
        )
        .await
    }

    async fn start_twice_adopts(&self) -> Step {
        let key = self.key(4, 1);
        let lease = self
            .create_ok(&key, "creating the node to bootstrap")
            .await?;
        let endpoint = self.endpoint(&key, &lease).await?;
        let request = BootstrapRequest {
            spec: self.spec(&key),
            lease: lease.lease.clone(),
            endpoint,
        };
        let first = match self.plugin().start_bootstrap(&key, &request).await {
            Ok(session) => session,
            Err(error) => {
                return fail(format!(
                    "start_bootstrap of the reachable node {key} failed: {error:?}"
                ));
            }
        };
        if first.adopted {
            return fail(format!(
                "the first start_bootstrap of {key} claimed to adopt an existing session"
            ));
        }
        match self.plugin().start_bootstrap(&key, &request).await {
            Ok(again) if again.adopted && again.session == first.session => {}
            Ok(again) => {
                return fail(format!(
                    "a second start_bootstrap for {key} returned session {} (adopted: {}) instead of adopting the running {} — start must look for the key's session first",
                    again.session.0, again.adopted, first.session.0
                ));
            }
            Err(error) => {
                return fail(format!(
                    "a second start_bootstrap for {key} failed instead of adopting the running session {}: {error:?}",
                    first.session.0
                ));
            }
        }
        self.cancel_ok(&key, Some(&first.session), "cancelling the adopted session")
            .await?;
        self.destroy_ok(&key, &lease.lease, "destroying the bootstrapped node")
            .await?;
        self.expect_listed(&key, &[], "after cancelling and destroying the node")
            .await
    }

    async fn cleanup_of_absent_succeeds(&self) -> Step {
        let never = self.key(5, 1);
        let unknown_session = SessionHandle(NEVER_ISSUED.to_owned());
        let unknown_lease = LeaseHandle(NEVER_ISSUED.to_owned());
        self.cancel_ok(&never, None, "cancelling a session that never existed")
            .await?;
        self.cancel_ok(
            &never,
            Some(&unknown_session),
            "cancelling an unknown session handle",
        )
        .await?;
        self.destroy_ok(
            &never,
            &unknown_lease,
            "destroying a node that never existed",
        )
        .await?;
        let key = self.key(5, 2);
        let lease = self
            .create_ok(&key, "creating a node to destroy twice")
            .await?;
        self.destroy_ok(&key, &lease.lease, "the first destroy")
            .await?;
        self.destroy_ok(&key, &lease.lease, "destroying an already destroyed node")
            .await?;
        self.cancel_ok(&key, None, "cancelling the bootstrap of a destroyed node")
            .await?;
        self.expect_listed(&key, &[], "after destroying the node")
            .await
    }

    async fn cleanup_faults_retry(&self) -> Step {
        let key = self.key(6, 1);
        let lease = self
            .create_ok(&key, "creating a node to fail to destroy")
            .await?;
        let mut checked = Vec::new();
        if self
            .inject_first(PluginMethod::DestroyNode, &[Fault::Definite])
            .is_ok()
        {
            match self.plugin().destroy_node(&key, &lease.lease).await {
                Err(PluginError::Definite(_)) => {}
                other => {
                    return fail(format!(
                        "destroy_node of {key} answered {other:?} to an injected definite fault; expected PluginError::Definite"
                    ));
                }
            }
            self.expect_listed(
                &key,
                std::slice::from_ref(&lease.lease),
                "after destroy_node failed definitely (it certainly did not happen, so the node is still there)",
            )
            .await?;
            checked.push("definite");
        }
        let ambiguous = self.inject_first(
            PluginMethod::DestroyNode,
            &[Fault::AmbiguousDone, Fault::AmbiguousUndone],
        );
        if let Ok(fault) = ambiguous {
            match self.plugin().destroy_node(&key, &lease.lease).await {
                Err(PluginError::Ambiguous(_)) => {}
                other => {
                    return fail(format!(
                        "destroy_node of {key} answered {other:?} to an injected {} fault; expected PluginError::Ambiguous",
                        fault.name()
                    ));
                }
            }
            checked.push("ambiguous");
        }
        if checked.is_empty() {
            return skip(
                "the ContractFaults hook cannot make destroy_node fail definitely or ambiguously",
            );
        }
        self.destroy_ok(&key, &lease.lease, "the retry of a failed destroy")
            .await?;
        self.expect_listed(&key, &[], "after the retry of a failed destroy_node")
            .await
    }

    async fn list_is_exact(&self) -> Step {
        let keys = [self.key(7, 1), self.key(8, 2), self.key(9, 3)];
        let mut expected = Vec::new();
        for key in &keys {
            let lease = self.create_ok(key, "creating the nodes to list").await?;
            expected.push(ListedNode {
                key: key.clone(),
                lease: lease.lease,
            });
        }
        self.expect_exact_listing(&expected, "after creating three nodes")
            .await?;
        let other_run = RunId::new(format!("{}-other", self.run_id()));
        match self.plugin().list_nodes(&other_run).await {
            Ok(listed) if listed.iter().all(|n| n.key.run_id == other_run) => {}
            Ok(listed) => {
                return fail(format!(
                    "list_nodes({other_run}) reported nodes of another run: {listed:?}"
                ));
            }
            Err(error) => return fail(format!("list_nodes({other_run}) failed: {error:?}")),
        }
        let gone = expected.remove(1);
        self.destroy_ok(&gone.key, &gone.lease, "destroying one listed node")
            .await?;
        self.expect_exact_listing(&expected, "after destroying one of three nodes")
            .await
    }

    async fn expect_exact_listing(&self, expected: &[ListedNode], when: &str) -> Step {
        let mut listed = self.listed().await?;
        listed.sort();
        let mut expected = expected.to_vec();
        expected.sort();
        if listed == expected {
            return Ok(());
        }
        let show = |nodes: &[ListedNode]| {
            nodes
                .iter()
                .map(|n| format!("{} ({})", n.key, n.lease.0))
                .collect::<Vec<_>>()
                .join(", ")
        };
        fail(format!(
            "{when}, list_nodes({}) reported [{}]; the live nodes are [{}]",
            self.run_id(),
            show(&listed),
            show(&expected)
        ))
    }

    async fn teardown_leaves_nothing(&self) -> Step {
        let keys = [self.key(10, 1), self.key(11, 1), self.key(12, 2)];
        let mut live = Vec::new();
        for key in &keys {
            live.push((
                key.clone(),
                self.create_ok(key, "creating nodes to tear down").await?,
            ));
        }
        // Bootstrap the first node when it becomes reachable, so that
        // teardown also has a session to end. A plugin whose nodes never
        // become reachable here is torn down without one.
        let (first_key, first_lease) = &live[0];
        let mut session = None;
        if let Ok(endpoint) = self.endpoint(first_key, first_lease).await {
            let request = BootstrapRequest {
                spec: self.spec(first_key),
                lease: first_lease.lease.clone(),
                endpoint,
            };
            session = self
                .plugin()
                .start_bootstrap(first_key, &request)
                .await
                .ok()
                .map(|s| s.session);
        }
        for (key, lease) in &live {
            let handle = if key == first_key {
                session.as_ref()
            } else {
                None
            };
            self.cancel_ok(key, handle, "tearing down").await?;
            self.destroy_ok(key, &lease.lease, "tearing down").await?;
        }
        let left = self.listed().await?;
        if left.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = left
            .iter()
            .map(|n| format!("{} ({})", n.key, n.lease.0))
            .collect();
        fail(format!(
            "after cancelling and destroying every node, list_nodes still shows: {}",
            names.join(", ")
        ))
    }

    /// Runs one effect through the adapter, as the executor would.
    async fn execute(&self, key: &AttemptKey, request: EffectRequest) -> Step<EffectOutput> {
        let operation = Operation {
            id: OperationId::new(key.attempt, OperationSequence::from_raw(1)),
            run_id: key.run_id.clone(),
            node: key.node.clone(),
            spec: self.spec(key),
            request,
        };
        let kind = operation.kind();
        match self.adapter.execute(&operation).await {
            Ok(output) => Ok(output),
            Err(error) => fail(format!(
                "{kind} of {key} through PluginBackendAdapter failed: {error}"
            )),
        }
    }

    async fn superseded_facts_dropped(&self) -> Step {
        let faults = self.faults()?;
        // A loss of a current attempt reaches the driver, under its attempt.
        let current = self.key(13, 1);
        self.execute(&current, EffectRequest::CreateLease).await?;
        let before = self.delivered().len();
        if !faults.lose_node(&current).await {
            return skip("the ContractFaults hook cannot lose a node (lose_node)");
        }
        let about_current =
            |o: &Observation| o.attempt() == current.attempt && *o.node() == current.node;
        let seen = self
            .await_report(before, |facts, _| facts.iter().any(about_current))
            .await;
        let reported = self.delivered().split_off(before);
        if !seen {
            return fail(format!(
                "after its node {current} was lost, the plugin reported nothing for it through the sink within {LOSS_REPORT_POLLS_MAX} looks (reported: {}){}",
                describe_facts(&reported),
                self.pause_hint()
            ));
        }
        if let Some(wrong) = reported.iter().find(|o| !about_current(o)) {
            return fail(format!(
                "the loss of {current} was reported as a fact of another attempt: {}",
                describe_fact(wrong)
            ));
        }
        self.expect_listed(&current, &[], "after the node was lost")
            .await?;

        // A loss of a superseded attempt is dropped at the sink.
        let old = self.key(14, 2);
        let new = self.key(14, 3);
        self.execute(&old, EffectRequest::CreateLease).await?;
        self.execute(&new, EffectRequest::CreateLease).await?;
        let before = self.delivered().len();
        let dropped = self.adapter.sink().dropped_count();
        if !faults.lose_node(&old).await {
            return skip("the ContractFaults hook could not lose a second node");
        }
        let seen = self
            .await_report(before, |facts, now_dropped| {
                now_dropped > dropped || facts.iter().any(|o| *o.node() == old.node)
            })
            .await;
        let reported = self.delivered().split_off(before);
        if let Some(leaked) = reported.iter().find(|o| *o.node() == old.node) {
            return fail(format!(
                "after attempt {} of {} was superseded by {}, the loss of the old node reached the driver as {}: facts must be tagged with the attempt they are about, and a superseded attempt's facts are dropped at the sink",
                old.attempt,
                old.node,
                new.attempt,
                describe_fact(leaked)
            ));
        }
        if !seen {
            return fail(format!(
                "the superseded node {old} was lost but the plugin reported nothing through the sink within {LOSS_REPORT_POLLS_MAX} looks (nothing was dropped){}",
                self.pause_hint()
            ));
        }
        Ok(())
    }
}

/// A fact in a few words, for failure messages.
fn describe_fact(observation: &Observation) -> String {
    match observation {
        Observation::Bootstrap {
            node,
            attempt,
            event,
        } => format!("bootstrap event {event:?} of {node}/{attempt}"),
        Observation::NodeLost {
            node,
            attempt,
            cause,
        } => format!("loss of {node}/{attempt} ({cause})"),
    }
}

fn describe_facts(observations: &[Observation]) -> String {
    if observations.is_empty() {
        return "nothing".to_owned();
    }
    observations
        .iter()
        .map(describe_fact)
        .collect::<Vec<_>>()
        .join("; ")
}
