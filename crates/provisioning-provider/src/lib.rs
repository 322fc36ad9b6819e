//! The provider seam of `provisioning`.
//!
//! A provider implements [`ProvisionPlugin`]: create or adopt a node for an
//! [`AttemptKey`], look up its endpoint, start, complete and cancel its
//! bootstrap, destroy it, and list what it manages. Errors carry a
//! [`PluginError`] disposition — definite, ambiguous or not found — so
//! "it may have happened" is part of the type. Asynchronous facts (bootstrap
//! stages, swarm join, a node process that exited) go through the
//! [`ObservationSink`] the host attaches; facts of a superseded attempt are
//! dropped there. [`PluginBackendAdapter`] turns plugins into the core's
//! [`EffectBackend`].
//!
//! A plugin depends on this crate and on `provisioning` for the identity and
//! spec types; it never needs the driver.
//!
//! # Writing a plugin
//!
//! Key everything on the [`AttemptKey`], look before you create, and say
//! [`PluginError::Ambiguous`] whenever a call may have acted. A complete
//! (in-memory) plugin:
//!
//! ```
//! use std::collections::BTreeMap;
//! use std::sync::Mutex;
//!
//! use async_trait::async_trait;
//! use provisioning::effect::SessionHandle;
//! use provisioning::{Endpoint, EndpointLookup, LeaseHandle, LogicalNodeSpec, RunId};
//! use provisioning_provider::{
//!     AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, PluginError,
//!     ProvisionPlugin,
//! };
//!
//! #[derive(Default)]
//! struct MemoryPlugin {
//!     /// Live nodes and, when bootstrapping, their session.
//!     nodes: Mutex<BTreeMap<AttemptKey, Option<SessionHandle>>>,
//! }
//!
//! fn lease_of(key: &AttemptKey) -> LeaseHandle {
//!     LeaseHandle(format!("memory:{key}"))
//! }
//!
//! #[async_trait]
//! impl ProvisionPlugin for MemoryPlugin {
//!     fn kind(&self) -> &str {
//!         "memory"
//!     }
//!
//!     async fn create_node(&self, key: &AttemptKey, _spec: &LogicalNodeSpec)
//!         -> Result<NodeLease, PluginError> {
//!         let mut nodes = self.nodes.lock().unwrap();
//!         // Look first: a second create for the key adopts.
//!         let adopted = nodes.contains_key(key);
//!         nodes.entry(key.clone()).or_insert(None);
//!         Ok(NodeLease { lease: lease_of(key), endpoint: None, adopted })
//!     }
//!
//!     async fn lookup_endpoint(&self, key: &AttemptKey, _lease: &LeaseHandle)
//!         -> Result<EndpointLookup, PluginError> {
//!         match self.nodes.lock().unwrap().contains_key(key) {
//!             true => Ok(EndpointLookup::Ready(Endpoint(format!("memory://{key}")))),
//!             false => Err(PluginError::not_found(key)),
//!         }
//!     }
//!
//!     async fn start_bootstrap(&self, key: &AttemptKey, _request: &BootstrapRequest)
//!         -> Result<BootstrapSession, PluginError> {
//!         let mut nodes = self.nodes.lock().unwrap();
//!         let session = nodes.get_mut(key).ok_or_else(|| PluginError::not_found(key))?;
//!         let adopted = session.is_some();
//!         let handle = session.get_or_insert_with(|| SessionHandle(format!("boot:{key}")));
//!         // A real plugin reports stages, the join and `Closed` through its sink.
//!         Ok(BootstrapSession { session: handle.clone(), adopted })
//!     }
//!
//!     async fn complete_bootstrap(&self, key: &AttemptKey, _session: Option<&SessionHandle>)
//!         -> Result<(), PluginError> {
//!         match self.nodes.lock().unwrap().get_mut(key) {
//!             Some(session) => { *session = None; Ok(()) }
//!             None => Err(PluginError::not_found(key)),
//!         }
//!     }
//!
//!     async fn cancel_bootstrap(&self, key: &AttemptKey, _session: Option<&SessionHandle>)
//!         -> Result<(), PluginError> {
//!         if let Some(session) = self.nodes.lock().unwrap().get_mut(key) {
//!             *session = None;
//!         }
//!         Ok(()) // absent counts as success
//!     }
//!
//!     async fn destroy_node(&self, key: &AttemptKey, _lease: &LeaseHandle)
//!         -> Result<(), PluginError> {
//!         self.nodes.lock().unwrap().remove(key);
//!         Ok(()) // absent counts as success
//!     }
//!
//!     async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
//!         let nodes = self.nodes.lock().unwrap();
//!         Ok(nodes.keys().filter(|k| k.run_id == *run)
//!             .map(|key| ListedNode { key: key.clone(), lease: lease_of(key) })
//!             .collect())
//!     }
//! }
//! # let _ = MemoryPlugin::default();
//! ```
//!
//! Then prove it keeps the contract with the conformance kit
//! (`provisioning_conformance::contract::run_contract_suite`); the guide in
//! `docs/providers.md` shows both steps.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use provisioning::effect::{EffectRequest, SessionHandle};
use provisioning::executor::EffectBackend;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::spawn::BoxFuture;
use provisioning::{
    EffectError, EffectOutput, Endpoint, EndpointLookup, LeaseHandle, LogicalNodeId,
    LogicalNodeSpec, Membership, NodeAttemptId, Observation, Operation, RunId,
};
use thiserror::Error;

/// The key every provider request is made for: one attempt of one slot.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AttemptKey {
    /// The run.
    pub run_id: RunId,
    /// The slot.
    pub node: LogicalNodeId,
    /// The attempt.
    pub attempt: NodeAttemptId,
}

impl AttemptKey {
    /// The key of an operation.
    pub fn of(operation: &Operation) -> Self {
        AttemptKey {
            run_id: operation.run_id.clone(),
            node: operation.node.clone(),
            attempt: operation.attempt(),
        }
    }
}

impl fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.run_id, self.node, self.attempt)
    }
}

/// A failed plugin call. The variant says whether the call may have acted.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PluginError {
    /// The call certainly left nothing behind for its key.
    #[error("{0}")]
    Definite(String),
    /// The call may have acted (a timeout, a lost reply, a half-done step).
    #[error("outcome unknown: {0}")]
    Ambiguous(String),
    /// The resource the call is about does not exist.
    #[error("not found: {0}")]
    NotFound(String),
}

impl PluginError {
    /// A definite failure.
    pub fn definite(message: impl fmt::Display) -> Self {
        PluginError::Definite(message.to_string())
    }

    /// An ambiguous failure.
    pub fn ambiguous(message: impl fmt::Display) -> Self {
        PluginError::Ambiguous(message.to_string())
    }

    /// A missing resource.
    pub fn not_found(message: impl fmt::Display) -> Self {
        PluginError::NotFound(message.to_string())
    }
}

/// A node a plugin created or adopted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeLease {
    /// The provider's name for it.
    pub lease: LeaseHandle,
    /// The endpoint, when already known.
    pub endpoint: Option<Endpoint>,
    /// Whether an existing resource of the key was adopted.
    pub adopted: bool,
}

/// What a bootstrap start needs.
#[derive(Clone, Debug, PartialEq)]
pub struct BootstrapRequest {
    /// The attempt's immutable spec (boot parameters, swarm join template).
    pub spec: LogicalNodeSpec,
    /// The lease.
    pub lease: LeaseHandle,
    /// The endpoint to reach the node through.
    pub endpoint: Endpoint,
}

/// A bootstrap session a plugin started or adopted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BootstrapSession {
    /// The provider's name for it.
    pub session: SessionHandle,
    /// Whether an existing session of the key was adopted.
    pub adopted: bool,
}

/// One resource a plugin manages.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ListedNode {
    /// The key it was created for.
    pub key: AttemptKey,
    /// The provider's name for it.
    pub lease: LeaseHandle,
}

/// A provider of nodes.
///
/// # Assumptions
/// - Every call is keyed by an [`AttemptKey`]. `create_node` and
///   `start_bootstrap` first look for an existing resource of their key and
///   adopt it; they create only when none exists. Calling them twice for one
///   key therefore creates at most one resource.
/// - [`PluginError::Definite`] means the call left nothing behind for its key
///   and changed nothing; when unsure, return [`PluginError::Ambiguous`]. A
///   definite error must never hide an existing resource: a create that fails
///   after finding the key's node adopts it instead (or is ambiguous).
/// - [`PluginError::NotFound`] means the *node* of the key is gone. On
///   `cancel_bootstrap` and `destroy_node` the adapter treats it as success;
///   on `lookup_endpoint`, `start_bootstrap` and `complete_bootstrap` it
///   reports the attempt lost ([`LossCause::LeaseGone`]), which ends it. So a
///   session that merely ended is not "not found": completing or cancelling it
///   again succeeds.
/// - Methods may be called concurrently for different keys; for one key, the
///   executor runs at most one call at a time. A call may also be abandoned
///   (its future dropped) after a timeout, and later re-issued: the re-issue
///   must adopt whatever the abandoned call made.
/// - A panic inside a call becomes a definite error of that call, so a plugin
///   must not panic after acting.
///
/// # Guarantees the host gives
/// [`ProvisionPlugin::attach`] is called once, before any other call, by
/// [`PluginBackendAdapter`]. Results of calls for an attempt the driver has
/// moved past are discarded, and facts reported for superseded attempts are
/// dropped at the sink; a plugin need not track supersession itself.
///
/// # Checking an implementation
/// The conformance kit's contract suite
/// (`provisioning_conformance::contract::run_contract_suite`) checks each of
/// these promises against a plugin; its Level 2 battery runs a whole cluster
/// through this trait with faults on every method.
#[async_trait]
pub trait ProvisionPlugin: Send + Sync + 'static {
    /// The provider kind this plugin serves (`provider = "..."` in a shape).
    fn kind(&self) -> &str;

    /// Receives the sink for asynchronous facts. Called once by
    /// [`PluginBackendAdapter`] before any other call.
    fn attach(&self, sink: ObservationSink) {
        let _ = sink;
    }

    /// The run's membership changed (design §22): its ready nodes, and every
    /// group's desired size. The host calls it after the drive that folded
    /// the change, with versions in increasing order. A provider whose
    /// agents hold a swarm connection pushes it to them (the peers file);
    /// others ignore it, as by default. Must not block.
    fn membership_changed(&self, membership: &Arc<Membership>) {
        let _ = membership;
    }

    /// Creates the node of `key`, or adopts the existing one.
    ///
    /// # Errors
    /// Definite when the provider refused and nothing exists for the key;
    /// ambiguous when a node may have been made (a timeout, a lost reply) —
    /// the driver re-issues the same call, which must then adopt it.
    async fn create_node(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError>;

    /// Where the node can be reached; `NotReady` until it can ("not ready" is
    /// a normal answer, not a failure).
    ///
    /// # Errors
    /// Not found when the node is gone (the attempt is then lost); definite
    /// or ambiguous for a failed lookup, which the driver retries.
    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError>;

    /// Starts the bootstrap session of `key`, or adopts the running one.
    /// Stages are reported through the sink as they happen.
    ///
    /// # Errors
    /// Definite when no session runs for the key and none was started (the
    /// attempt fails and is replaced); ambiguous when one may have started —
    /// the re-issue must adopt it; not found when the node is gone.
    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError>;

    /// Tells the session that the agent joined; the plugin then closes it
    /// (reporting [`BootstrapEvent::Closed`]). Completing a session that
    /// already ended succeeds.
    ///
    /// # Errors
    /// Not found only when the node itself is gone.
    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError>;

    /// Stops the bootstrap session; absent counts as success.
    ///
    /// # Errors
    /// Definite when the session certainly still runs; ambiguous when it
    /// may. The driver retries after a backoff, keeping its facts meanwhile.
    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError>;

    /// Destroys the node (and any session of it); absent counts as success.
    ///
    /// # Errors
    /// Definite when the node certainly still exists; ambiguous when it may.
    /// The driver retries after a backoff until the node is confirmed gone.
    async fn destroy_node(&self, key: &AttemptKey, lease: &LeaseHandle) -> Result<(), PluginError>;

    /// Every node this plugin manages for `run`, each once, with the lease
    /// `create_node` returned for it: for adoption after a restart and for
    /// leak checks.
    ///
    /// # Errors
    /// When the provider cannot be asked; a partial list is never returned.
    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError>;
}

type Deliver = Box<dyn Fn(Observation) + Send + Sync>;

struct SinkInner {
    deliver: Deliver,
    latest: Mutex<BTreeMap<LogicalNodeId, NodeAttemptId>>,
    delivered: AtomicU64,
    dropped: AtomicU64,
}

/// Where plugins report asynchronous facts.
///
/// The sink remembers the newest attempt it has seen for each slot (the
/// adapter tells it before every call). A fact about an older attempt is
/// dropped here and never reaches the driver.
#[derive(Clone)]
pub struct ObservationSink {
    inner: Arc<SinkInner>,
}

impl fmt::Debug for ObservationSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObservationSink")
            .field("delivered", &self.delivered_count())
            .field("dropped", &self.dropped_count())
            .finish_non_exhaustive()
    }
}

impl ObservationSink {
    /// A sink that hands accepted facts to `deliver`.
    pub fn new(deliver: impl Fn(Observation) + Send + Sync + 'static) -> Self {
        ObservationSink {
            inner: Arc::new(SinkInner {
                deliver: Box::new(deliver),
                latest: Mutex::new(BTreeMap::new()),
                delivered: AtomicU64::new(0),
                dropped: AtomicU64::new(0),
            }),
        }
    }

    /// Records that `attempt` of `node` is in use; older attempts of the slot
    /// are superseded from now on.
    pub fn note_attempt(&self, node: &LogicalNodeId, attempt: NodeAttemptId) {
        let mut latest = self
            .inner
            .latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = latest.entry(node.clone()).or_insert(attempt);
        if *entry < attempt {
            *entry = attempt;
        }
    }

    /// Whether `attempt` of `node` is older than the newest attempt seen.
    pub fn is_superseded(&self, node: &LogicalNodeId, attempt: NodeAttemptId) -> bool {
        self.inner
            .latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(node)
            .is_some_and(|latest| attempt < *latest)
    }

    /// Reports a fact. Returns `false` when it was dropped because its
    /// attempt is superseded.
    pub fn report(&self, observation: Observation) -> bool {
        if self.is_superseded(observation.node(), observation.attempt()) {
            self.inner.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.inner.delivered.fetch_add(1, Ordering::Relaxed);
        (self.inner.deliver)(observation);
        true
    }

    /// Reports a bootstrap event of `key`.
    pub fn bootstrap(&self, key: &AttemptKey, event: BootstrapEvent) -> bool {
        self.report(Observation::Bootstrap {
            node: key.node.clone(),
            attempt: key.attempt,
            event,
        })
    }

    /// Reports that the agent or lease of `key` is gone.
    pub fn lost(&self, key: &AttemptKey, cause: LossCause) -> bool {
        self.report(Observation::NodeLost {
            node: key.node.clone(),
            attempt: key.attempt,
            cause,
        })
    }

    /// Reports that the agent of `key` re-joined this controller after a
    /// controller restart: a node recovered as ready is ready again.
    pub fn rejoined(&self, key: &AttemptKey) -> bool {
        self.report(Observation::AgentRejoined {
            node: key.node.clone(),
            attempt: key.attempt,
        })
    }

    /// Facts handed on so far.
    pub fn delivered_count(&self) -> u64 {
        self.inner.delivered.load(Ordering::Relaxed)
    }

    /// Facts dropped as superseded so far.
    pub fn dropped_count(&self) -> u64 {
        self.inner.dropped.load(Ordering::Relaxed)
    }
}

/// An [`EffectBackend`] over one or more plugins, routed by the provider
/// kind named in each operation's spec.
///
/// # Guarantees
/// - Before every call it tells the sink which attempt of the slot is in use,
///   so facts of older attempts are dropped from then on.
/// - Each effect maps to one plugin method: create → `create_node`, lookup →
///   `lookup_endpoint`, start → `start_bootstrap`, convergence observed →
///   `complete_bootstrap`, cancel → `cancel_bootstrap`, destroy →
///   `destroy_node`. Definite and ambiguous errors keep their disposition.
/// - [`PluginError::NotFound`] on cancel or destroy is success. On lookup,
///   start or complete it reports the attempt lost
///   ([`LossCause::LeaseGone`]) through the sink and fails definitely. On
///   create it fails definitely.
/// - An operation whose provider kind no plugin serves fails definitely.
pub struct PluginBackendAdapter {
    plugins: BTreeMap<String, Arc<dyn ProvisionPlugin>>,
    sink: ObservationSink,
}

impl fmt::Debug for PluginBackendAdapter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginBackendAdapter")
            .field("providers", &self.plugins.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A plugin could not list its nodes.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("provider {kind:?} could not list its nodes: {source}")]
pub struct ListError {
    /// The provider kind of the plugin that failed.
    pub kind: String,
    /// Its error.
    #[source]
    pub source: PluginError,
}

/// Building an adapter failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AdapterError {
    /// Two plugins claim one provider kind.
    #[error("two plugins serve provider kind {0:?}")]
    DuplicateKind(String),
}

impl PluginBackendAdapter {
    /// An adapter over `plugins`, each attached to `sink`.
    ///
    /// # Errors
    /// [`AdapterError::DuplicateKind`] when two plugins serve one kind.
    pub fn new(
        plugins: impl IntoIterator<Item = Arc<dyn ProvisionPlugin>>,
        sink: ObservationSink,
    ) -> Result<Self, AdapterError> {
        let mut map = BTreeMap::new();
        for plugin in plugins {
            let kind = plugin.kind().to_owned();
            if map.contains_key(&kind) {
                return Err(AdapterError::DuplicateKind(kind));
            }
            plugin.attach(sink.clone());
            map.insert(kind, plugin);
        }
        Ok(PluginBackendAdapter { plugins: map, sink })
    }

    /// An adapter over a single plugin.
    pub fn single(plugin: Arc<dyn ProvisionPlugin>, sink: ObservationSink) -> Self {
        plugin.attach(sink.clone());
        let kind = plugin.kind().to_owned();
        PluginBackendAdapter {
            plugins: BTreeMap::from([(kind, plugin)]),
            sink,
        }
    }

    /// The provider kinds served.
    pub fn kinds(&self) -> impl Iterator<Item = &str> {
        self.plugins.keys().map(String::as_str)
    }

    /// The plugin serving `kind`.
    pub fn plugin(&self, kind: &str) -> Option<&Arc<dyn ProvisionPlugin>> {
        self.plugins.get(kind)
    }

    /// The sink the plugins report to.
    pub fn sink(&self) -> &ObservationSink {
        &self.sink
    }

    /// Hands the run's `membership` to every plugin
    /// ([`ProvisionPlugin::membership_changed`]).
    pub fn membership_changed(&self, membership: &Arc<Membership>) {
        for plugin in self.plugins.values() {
            plugin.membership_changed(membership);
        }
    }

    /// Every node the plugins manage for `run`, sorted by key: what a host
    /// compares with its state to find leaks or nodes to adopt.
    ///
    /// # Errors
    /// The first plugin's error, naming its kind; no partial list.
    pub async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, ListError> {
        let mut nodes = Vec::new();
        for (kind, plugin) in &self.plugins {
            let listed = plugin.list_nodes(run).await.map_err(|source| ListError {
                kind: kind.clone(),
                source,
            })?;
            nodes.extend(listed);
        }
        nodes.sort();
        Ok(nodes)
    }

    async fn run(&self, operation: &Operation) -> Result<EffectOutput, EffectError> {
        let kind = operation.spec.template().provider.as_str();
        let plugin = self
            .plugins
            .get(kind)
            .ok_or_else(|| EffectError::definite(format!("no plugin serves provider {kind:?}")))?;
        let key = AttemptKey::of(operation);
        self.sink.note_attempt(&key.node, key.attempt);
        let absent_is_success = matches!(
            operation.request,
            EffectRequest::CancelBootstrap { .. } | EffectRequest::DestroyLease { .. }
        );
        let outcome = match &operation.request {
            EffectRequest::CreateLease => {
                plugin
                    .create_node(&key, &operation.spec)
                    .await
                    .map(|lease| EffectOutput::LeaseCreated {
                        lease: lease.lease,
                        endpoint: lease.endpoint,
                        adopted: lease.adopted,
                    })
            }
            EffectRequest::LookupEndpoint { lease } => plugin
                .lookup_endpoint(&key, lease)
                .await
                .map(EffectOutput::Endpoint),
            EffectRequest::StartBootstrap { lease, endpoint } => {
                let request = BootstrapRequest {
                    spec: operation.spec.clone(),
                    lease: lease.clone(),
                    endpoint: endpoint.clone(),
                };
                plugin.start_bootstrap(&key, &request).await.map(|s| {
                    EffectOutput::BootstrapStarted {
                        session: s.session,
                        adopted: s.adopted,
                    }
                })
            }
            EffectRequest::BootstrapConvergenceObserved { session } => plugin
                .complete_bootstrap(&key, session.as_ref())
                .await
                .map(|()| EffectOutput::ConvergenceAcknowledged),
            EffectRequest::CancelBootstrap { session } => plugin
                .cancel_bootstrap(&key, session.as_ref())
                .await
                .map(|()| EffectOutput::BootstrapCancelled),
            EffectRequest::DestroyLease { lease } => plugin
                .destroy_node(&key, lease)
                .await
                .map(|()| EffectOutput::LeaseDestroyed),
        };
        match outcome {
            Ok(output) => Ok(output),
            Err(PluginError::NotFound(_)) if absent_is_success => Ok(match operation.request {
                EffectRequest::CancelBootstrap { .. } => EffectOutput::BootstrapCancelled,
                _ => EffectOutput::LeaseDestroyed,
            }),
            Err(PluginError::NotFound(message))
                if matches!(operation.request, EffectRequest::CreateLease) =>
            {
                Err(EffectError::definite(format!("not found: {message}")))
            }
            Err(PluginError::NotFound(message)) => {
                // The node this call needed is gone: the attempt is lost.
                self.sink.lost(&key, LossCause::LeaseGone);
                Err(EffectError::definite(format!("not found: {message}")))
            }
            Err(PluginError::Definite(message)) => Err(EffectError::definite(message)),
            Err(PluginError::Ambiguous(message)) => Err(EffectError::ambiguous(message)),
        }
    }
}

impl EffectBackend for PluginBackendAdapter {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(self.run(operation))
    }
}
