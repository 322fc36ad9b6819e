//! One contract's run: `ContractRun` holds the plugin, its sink and
//! adapter, and the steps every contract is written with (create, list,
//! destroy, cancel, wait for a report or an endpoint, tear down); a step
//! stops a contract as failed or as skipped with a reason.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use provisioning::effect::SessionHandle;
use provisioning::{
    EndpointLookup, GroupId, LeaseHandle, LogicalNodeId, LogicalNodeSpec, NodeAttemptId,
    NodeTemplate, Observation, RunId,
};
use provisioning_provider::{
    AttemptKey, ListedNode, NodeLease, ObservationSink, PluginBackendAdapter, PluginError,
    ProvisionPlugin,
};

use super::subject::{ContractFaults, ContractSubject, PluginMethod};
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

/// The most nodes the suite's own teardown destroys after a contract.
pub const TEARDOWN_NODES_MAX: usize = 64;

/// The group every node the suite creates belongs to.
pub const CONTRACT_GROUP: &str = "contract";

/// A lease or session handle no plugin ever issued, for the absent-cleanup calls.
pub(super) const NEVER_ISSUED: &str = "provisioning-contract-never-issued";

/// Why a contract stopped early.
pub(super) enum Stop {
    Failed(String),
    Skipped(String),
}

pub(super) type Step<T = ()> = Result<T, Stop>;

pub(super) fn fail<T>(why: impl Into<String>) -> Step<T> {
    Err(Stop::Failed(why.into()))
}

pub(super) fn skip<T>(why: impl Into<String>) -> Step<T> {
    Err(Stop::Skipped(why.into()))
}

/// Whether a cleanup call's answer counts as success.
/// How many times the suite repeats a cleanup step answered "ambiguous"
/// (a real engine may take longer than one call waits to confirm absence:
/// Slurm's step cleanup, say).
pub(super) const CLEANUP_AMBIGUOUS_RETRIES: usize = 2;

pub(super) fn cleanup_ok(outcome: &Result<(), PluginError>) -> bool {
    matches!(outcome, Ok(()) | Err(PluginError::NotFound(_)))
}

pub(super) fn describe_leases(leases: &[LeaseHandle]) -> String {
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
pub(super) struct ContractRun {
    pub(super) subject: ContractSubject,
    pub(super) adapter: PluginBackendAdapter,
    pub(super) delivered: Arc<Mutex<Vec<Observation>>>,
    pub(super) template: Arc<NodeTemplate>,
}

/// A fact in a few words, for failure messages.
pub(super) fn describe_fact(observation: &Observation) -> String {
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
        Observation::AgentRejoined { node, attempt } => {
            format!("re-join of {node}/{attempt}'s agent")
        }
    }
}

pub(super) fn describe_facts(observations: &[Observation]) -> String {
    if observations.is_empty() {
        return "nothing".to_owned();
    }
    observations
        .iter()
        .map(describe_fact)
        .collect::<Vec<_>>()
        .join("; ")
}

impl ContractRun {
    pub(super) fn new(subject: ContractSubject) -> Self {
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

    pub(super) fn plugin(&self) -> &dyn ProvisionPlugin {
        &*self.subject.plugin
    }

    pub(super) fn run_id(&self) -> &RunId {
        &self.subject.run_id
    }

    pub(super) fn key(&self, slot: u32, attempt: u64) -> AttemptKey {
        AttemptKey {
            run_id: self.run_id().clone(),
            node: LogicalNodeId::new(GroupId::new(CONTRACT_GROUP), slot),
            attempt: NodeAttemptId::from_raw(attempt),
        }
    }

    pub(super) fn spec(&self, key: &AttemptKey) -> LogicalNodeSpec {
        LogicalNodeSpec::new(key.node.clone(), key.run_id.clone(), self.template.clone())
    }

    pub(super) fn faults(&self) -> Step<&dyn ContractFaults> {
        match &self.subject.faults {
            Some(faults) => Ok(&**faults),
            None => skip("the subject has no ContractFaults hook (ContractSubject::with_faults)"),
        }
    }

    /// Arms the first fault of `choices` the hook can produce for `method`.
    pub(super) fn inject_first(&self, method: PluginMethod, choices: &[Fault]) -> Step<Fault> {
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

    pub(super) fn delivered(&self) -> Vec<Observation> {
        self.delivered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) async fn create(&self, key: &AttemptKey) -> Result<NodeLease, PluginError> {
        self.plugin().create_node(key, &self.spec(key)).await
    }

    pub(super) async fn create_ok(&self, key: &AttemptKey, what: &str) -> Step<NodeLease> {
        match self.create(key).await {
            Ok(lease) => Ok(lease),
            Err(error) => fail(format!("{what}: create_node of {key} failed: {error:?}")),
        }
    }

    pub(super) async fn listed(&self) -> Step<Vec<ListedNode>> {
        match self.plugin().list_nodes(self.run_id()).await {
            Ok(listed) => Ok(listed),
            Err(error) => fail(format!("list_nodes({}) failed: {error:?}", self.run_id())),
        }
    }

    pub(super) async fn listed_for(&self, key: &AttemptKey) -> Step<Vec<LeaseHandle>> {
        Ok(self
            .listed()
            .await?
            .into_iter()
            .filter(|n| n.key == *key)
            .map(|n| n.lease)
            .collect())
    }

    pub(super) async fn expect_listed(
        &self,
        key: &AttemptKey,
        expected: &[LeaseHandle],
        when: &str,
    ) -> Step {
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
    pub(super) async fn destroy_ok(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
        when: &str,
    ) -> Step {
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

    pub(super) async fn cancel_ok(
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
    pub(super) async fn pause(&self) {
        match &self.subject.pause {
            Some(pause) => pause(ENDPOINT_POLL_PAUSE).await,
            None => YieldOnce { yielded: false }.await,
        }
    }

    /// A hint for failure messages of waits, when the subject has no pause.
    pub(super) fn pause_hint(&self) -> &'static str {
        if self.subject.pause.is_some() {
            ""
        } else {
            "; give the subject a pause (ContractSubject::with_pause) if the plugin works in the background"
        }
    }

    /// Waits until `reported` holds for the sink's delivered facts after
    /// index `from` and its dropped count; returns whether it did.
    pub(super) async fn await_report(
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
    pub(super) async fn endpoint(
        &self,
        key: &AttemptKey,
        lease: &NodeLease,
    ) -> Step<provisioning::Endpoint> {
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

    /// Destroys whatever the plugin still lists for the run (best effort).
    pub(super) async fn teardown(&self) {
        let Ok(listed) = self.plugin().list_nodes(self.run_id()).await else {
            return;
        };
        for node in listed.into_iter().take(TEARDOWN_NODES_MAX) {
            let _ = self.plugin().cancel_bootstrap(&node.key, None).await;
            let _ = self.plugin().destroy_node(&node.key, &node.lease).await;
        }
    }
}

/// Returns `Pending` once (waking itself at once), then `Ready`: lets a
/// runtime run other work without the suite knowing which runtime it is.
pub(super) struct YieldOnce {
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
