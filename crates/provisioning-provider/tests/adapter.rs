//! Specification tests of `PluginBackendAdapter` and `ObservationSink`: how
//! each plugin answer becomes an effect result, how operations are routed,
//! and which facts reach the driver.

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use async_trait::async_trait;
use provisioning::effect::{EffectRequest, SessionHandle};
use provisioning::executor::EffectBackend;
use provisioning::id::OperationSequence;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::{
    Disposition, EffectError, EffectKind, EffectOutput, Endpoint, EndpointLookup, GroupId,
    LeaseHandle, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate, Observation,
    Operation, OperationId, RunId,
};
use provisioning_provider::{
    AdapterError, AttemptKey, BootstrapRequest, BootstrapSession, ListError, ListedNode, NodeLease,
    ObservationSink, PluginBackendAdapter, PluginError, ProvisionPlugin,
};

/// The most polls a test spends on a future that should be ready at once.
const POLLS_MAX: usize = 16;

/// Runs a future that never waits (every plugin here answers at once).
fn ready<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut context = Context::from_waker(Waker::noop());
    for _ in 0..POLLS_MAX {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            return output;
        }
    }
    panic!("a future that should be ready at once kept waiting");
}

/// A scripted plugin: answers every call normally, except that the next
/// call fails with the scripted error; records each call.
struct Scripted {
    kind: &'static str,
    next_error: Mutex<Option<PluginError>>,
    calls: Mutex<Vec<(&'static str, AttemptKey)>>,
    attached: Mutex<u32>,
    listed: Vec<ListedNode>,
}

impl Scripted {
    fn new(kind: &'static str) -> Arc<Scripted> {
        Scripted::listing(kind, Vec::new())
    }

    fn listing(kind: &'static str, listed: Vec<ListedNode>) -> Arc<Scripted> {
        Arc::new(Scripted {
            kind,
            next_error: Mutex::new(None),
            calls: Mutex::new(Vec::new()),
            attached: Mutex::new(0),
            listed,
        })
    }

    fn fail_next(&self, error: PluginError) {
        *self
            .next_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(error);
    }

    fn answer<T>(&self, method: &'static str, key: &AttemptKey, ok: T) -> Result<T, PluginError> {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((method, key.clone()));
        match self
            .next_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            Some(error) => Err(error),
            None => Ok(ok),
        }
    }

    fn calls(&self) -> Vec<&'static str> {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(method, _)| *method)
            .collect()
    }
}

#[async_trait]
impl ProvisionPlugin for Scripted {
    fn kind(&self) -> &str {
        self.kind
    }

    fn attach(&self, _sink: ObservationSink) {
        *self.attached.lock().unwrap_or_else(PoisonError::into_inner) += 1;
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        _spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let lease = NodeLease {
            lease: LeaseHandle(format!("lease:{key}")),
            endpoint: None,
            adopted: false,
        };
        self.answer("create_node", key, lease)
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        self.answer("lookup_endpoint", key, EndpointLookup::NotReady)
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        _request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        let session = BootstrapSession {
            session: SessionHandle(format!("session:{key}")),
            adopted: true,
        };
        self.answer("start_bootstrap", key, session)
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.answer("complete_bootstrap", key, ())
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.answer("cancel_bootstrap", key, ())
    }

    async fn destroy_node(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<(), PluginError> {
        self.answer("destroy_node", key, ())
    }

    async fn list_nodes(&self, _run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        let key = AttemptKey {
            run_id: RunId::new("list"),
            node: node(0),
            attempt: NodeAttemptId::from_raw(1),
        };
        self.answer("list_nodes", &key, self.listed.clone())
    }
}

fn node(index: u32) -> LogicalNodeId {
    LogicalNodeId::new(GroupId::new("web"), index)
}

fn operation(kind: &str, attempt: u64, request: EffectRequest) -> Operation {
    let run = RunId::new("run");
    let template = NodeTemplate {
        role: "worker".into(),
        provider: kind.into(),
        shape: Default::default(),
        boot: Default::default(),
        swarm_join: Default::default(),
    };
    Operation {
        id: OperationId::new(
            NodeAttemptId::from_raw(attempt),
            OperationSequence::from_raw(1),
        ),
        run_id: run.clone(),
        node: node(0),
        spec: LogicalNodeSpec::new(node(0), run, Arc::new(template)),
        request,
    }
}

fn request(kind: EffectKind) -> EffectRequest {
    let lease = LeaseHandle("lease".into());
    match kind {
        EffectKind::CreateLease => EffectRequest::CreateLease,
        EffectKind::LookupEndpoint => EffectRequest::LookupEndpoint { lease },
        EffectKind::StartBootstrap => EffectRequest::StartBootstrap {
            lease,
            endpoint: Endpoint("127.0.0.1:1".into()),
        },
        EffectKind::BootstrapConvergenceObserved => {
            EffectRequest::BootstrapConvergenceObserved { session: None }
        }
        EffectKind::CancelBootstrap => EffectRequest::CancelBootstrap { session: None },
        EffectKind::DestroyLease => EffectRequest::DestroyLease { lease },
    }
}

fn recording_sink() -> (ObservationSink, Arc<Mutex<Vec<Observation>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let sink = ObservationSink::new(move |observation| {
        record
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(observation);
    });
    (sink, seen)
}

/// What an effect should come back as.
#[derive(Debug, PartialEq)]
enum Expected {
    Success,
    Failure(Disposition),
}

fn outcome_of(result: &Result<EffectOutput, EffectError>) -> Expected {
    match result {
        Ok(_) => Expected::Success,
        Err(error) => Expected::Failure(error.disposition),
    }
}

/// Runs `kind` through an adapter whose plugin answers `error`, and checks
/// the result's disposition and whether a lease loss was reported.
fn check(kind: EffectKind, error: PluginError, expected: Expected, reports_loss: bool) {
    let plugin = Scripted::new("scripted");
    let (sink, seen) = recording_sink();
    let adapter = PluginBackendAdapter::single(plugin.clone(), sink);
    plugin.fail_next(error.clone());
    let op = operation("scripted", 7, request(kind));
    let result = ready(adapter.execute(&op));
    assert_eq!(
        outcome_of(&result),
        expected,
        "{kind} answered {error:?}: {result:?}"
    );
    let lost = Observation::NodeLost {
        node: node(0),
        attempt: NodeAttemptId::from_raw(7),
        cause: LossCause::LeaseGone,
    };
    let observed = seen.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let expected_observations = if reports_loss { vec![lost] } else { vec![] };
    assert_eq!(observed, expected_observations, "{kind} answered {error:?}");
}

#[test]
fn definite_and_ambiguous_errors_keep_their_disposition_for_every_effect() {
    for kind in EffectKind::ALL {
        check(
            kind,
            PluginError::definite("refused"),
            Expected::Failure(Disposition::Definite),
            false,
        );
        check(
            kind,
            PluginError::ambiguous("timed out"),
            Expected::Failure(Disposition::Ambiguous),
            false,
        );
    }
}

#[test]
fn not_found_is_success_for_cleanup_a_lease_loss_for_lookup_start_and_complete_and_definite_for_create()
 {
    let gone = || PluginError::not_found("no such node");
    check(
        EffectKind::CancelBootstrap,
        gone(),
        Expected::Success,
        false,
    );
    check(EffectKind::DestroyLease, gone(), Expected::Success, false);
    for kind in [
        EffectKind::LookupEndpoint,
        EffectKind::StartBootstrap,
        EffectKind::BootstrapConvergenceObserved,
    ] {
        check(kind, gone(), Expected::Failure(Disposition::Definite), true);
    }
    check(
        EffectKind::CreateLease,
        gone(),
        Expected::Failure(Disposition::Definite),
        false,
    );
}

#[test]
fn every_effect_reaches_its_own_plugin_method_and_answers_with_its_own_output_kind() {
    let plugin = Scripted::new("scripted");
    let (sink, _) = recording_sink();
    let adapter = PluginBackendAdapter::single(plugin.clone(), sink);
    for kind in EffectKind::ALL {
        let result = ready(adapter.execute(&operation("scripted", 1, request(kind))));
        assert_eq!(result.map(|output| output.kind()), Ok(kind));
    }
    assert_eq!(
        plugin.calls(),
        [
            "create_node",
            "lookup_endpoint",
            "start_bootstrap",
            "complete_bootstrap",
            "cancel_bootstrap",
            "destroy_node"
        ]
    );
}

#[test]
fn operations_are_routed_by_provider_kind_and_an_unserved_kind_fails_definitely() {
    let first = Scripted::new("first");
    let second = Scripted::new("second");
    let (sink, _) = recording_sink();
    let plugins: Vec<Arc<dyn ProvisionPlugin>> = vec![first.clone(), second.clone()];
    let adapter = PluginBackendAdapter::new(plugins, sink);
    let adapter = adapter.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(adapter.kinds().collect::<Vec<_>>(), ["first", "second"]);
    assert_eq!(
        (*first
            .attached
            .lock()
            .unwrap_or_else(PoisonError::into_inner)),
        1
    );

    let create = request(EffectKind::CreateLease);
    assert!(ready(adapter.execute(&operation("second", 1, create.clone()))).is_ok());
    assert_eq!(second.calls(), ["create_node"]);
    assert!(first.calls().is_empty());

    let unserved = ready(adapter.execute(&operation("third", 1, create)));
    assert_eq!(
        outcome_of(&unserved),
        Expected::Failure(Disposition::Definite)
    );
    assert!(first.calls().is_empty() && second.calls().len() == 1);
}

#[test]
fn two_plugins_serving_one_kind_are_refused() {
    let (sink, _) = recording_sink();
    let plugins: Vec<Arc<dyn ProvisionPlugin>> = vec![Scripted::new("same"), Scripted::new("same")];
    let refused = PluginBackendAdapter::new(plugins, sink);
    assert!(matches!(refused, Err(AdapterError::DuplicateKind(kind)) if kind == "same"));
}

#[test]
fn the_sink_drops_facts_of_attempts_older_than_the_newest_one_the_adapter_used() {
    let plugin = Scripted::new("scripted");
    let (sink, seen) = recording_sink();
    let adapter = PluginBackendAdapter::single(plugin, sink.clone());
    let key = |attempt| AttemptKey {
        run_id: RunId::new("run"),
        node: node(0),
        attempt: NodeAttemptId::from_raw(attempt),
    };
    // Nothing noted yet: every fact passes.
    assert!(sink.bootstrap(&key(3), BootstrapEvent::Joined));
    let _ = ready(adapter.execute(&operation("scripted", 5, request(EffectKind::CreateLease))));
    assert!(sink.is_superseded(&node(0), NodeAttemptId::from_raw(3)));
    assert!(!sink.bootstrap(&key(3), BootstrapEvent::Closed));
    assert!(!sink.lost(&key(4), LossCause::AgentGone));
    assert!(sink.bootstrap(&key(5), BootstrapEvent::Joined));
    // An older attempt's late call never un-supersedes.
    let _ = ready(adapter.execute(&operation("scripted", 3, request(EffectKind::DestroyLease))));
    assert!(!sink.lost(&key(3), LossCause::LeaseGone));
    // Other slots are unaffected.
    let other = AttemptKey {
        node: node(1),
        ..key(1)
    };
    assert!(sink.bootstrap(&other, BootstrapEvent::Joined));

    assert_eq!(sink.delivered_count(), 3);
    assert_eq!(sink.dropped_count(), 3);
    let attempts: Vec<u64> = seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|o| o.attempt().get())
        .collect();
    assert_eq!(attempts, [3, 5, 1]);
}

#[test]
fn list_nodes_merges_every_plugin_sorted_and_names_the_one_that_failed() {
    let listed = |attempt| ListedNode {
        key: AttemptKey {
            run_id: RunId::new("run"),
            node: node(0),
            attempt: NodeAttemptId::from_raw(attempt),
        },
        lease: LeaseHandle(format!("l{attempt}")),
    };
    let first = Scripted::listing("first", vec![listed(9), listed(2)]);
    let second = Scripted::listing("second", vec![listed(4)]);
    let (sink, _) = recording_sink();
    let plugins: Vec<Arc<dyn ProvisionPlugin>> = vec![first, second.clone()];
    let adapter = PluginBackendAdapter::new(plugins, sink).unwrap_or_else(|e| panic!("{e}"));
    let run = RunId::new("run");
    assert_eq!(
        ready(adapter.list_nodes(&run)),
        Ok(vec![listed(2), listed(4), listed(9)])
    );
    second.fail_next(PluginError::ambiguous("api down"));
    let failed = ready(adapter.list_nodes(&run));
    assert_eq!(
        failed,
        Err(ListError {
            kind: "second".into(),
            source: PluginError::ambiguous("api down"),
        })
    );
    let shown = failed.map(|_| ()).unwrap_err().to_string();
    assert!(
        shown.contains("\"second\"") && shown.contains("api down"),
        "{shown}"
    );
}
