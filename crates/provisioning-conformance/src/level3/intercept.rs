//! A real plugin with some of its methods intercepted: how a battery puts a
//! fault or a deliberate defect around the calls of a plugin it does not
//! own, without writing out the methods it leaves alone.
//!
//! An [`Intercept`] gets every call with the inner plugin at hand; each of
//! its methods passes the call straight through unless the hook overrides
//! it. [`Intercepted`] is the [`ProvisionPlugin`] that puts the two together.

use std::sync::Arc;

use async_trait::async_trait;
use provisioning::effect::SessionHandle;
use provisioning::spawn::BoxFuture;
use provisioning::{EndpointLookup, LeaseHandle, LogicalNodeSpec, RunId};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};

/// The future of one intercepted plugin call.
pub type PluginCall<'a, T> = BoxFuture<'a, Result<T, PluginError>>;

/// What happens around the calls of an [`Intercepted`] plugin. Every method
/// passes the call to `inner` unless overridden.
pub trait Intercept: Send + Sync + 'static {
    /// The plugin's kind (default: the inner plugin's).
    fn kind<'a>(&'a self, inner: &'a dyn ProvisionPlugin) -> &'a str {
        inner.kind()
    }

    /// See [`ProvisionPlugin::create_node`].
    fn create_node<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        spec: &'a LogicalNodeSpec,
    ) -> PluginCall<'a, NodeLease> {
        inner.create_node(key, spec)
    }

    /// See [`ProvisionPlugin::lookup_endpoint`].
    fn lookup_endpoint<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        lease: &'a LeaseHandle,
    ) -> PluginCall<'a, EndpointLookup> {
        inner.lookup_endpoint(key, lease)
    }

    /// See [`ProvisionPlugin::start_bootstrap`].
    fn start_bootstrap<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        request: &'a BootstrapRequest,
    ) -> PluginCall<'a, BootstrapSession> {
        inner.start_bootstrap(key, request)
    }

    /// See [`ProvisionPlugin::complete_bootstrap`].
    fn complete_bootstrap<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        session: Option<&'a SessionHandle>,
    ) -> PluginCall<'a, ()> {
        inner.complete_bootstrap(key, session)
    }

    /// See [`ProvisionPlugin::cancel_bootstrap`].
    fn cancel_bootstrap<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        session: Option<&'a SessionHandle>,
    ) -> PluginCall<'a, ()> {
        inner.cancel_bootstrap(key, session)
    }

    /// See [`ProvisionPlugin::destroy_node`].
    fn destroy_node<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        lease: &'a LeaseHandle,
    ) -> PluginCall<'a, ()> {
        inner.destroy_node(key, lease)
    }

    /// See [`ProvisionPlugin::list_nodes`].
    fn list_nodes<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        run: &'a RunId,
    ) -> PluginCall<'a, Vec<ListedNode>> {
        inner.list_nodes(run)
    }
}

/// A plugin whose calls go through `hook` to `inner`. See the module docs.
pub struct Intercepted<H> {
    inner: Arc<dyn ProvisionPlugin>,
    hook: H,
}

impl<H: Intercept> Intercepted<H> {
    /// `inner` with its calls intercepted by `hook`.
    pub fn new(inner: Arc<dyn ProvisionPlugin>, hook: H) -> Self {
        Intercepted { inner, hook }
    }
}

impl<H> std::fmt::Debug for Intercepted<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Intercepted")
            .field("kind", &self.inner.kind())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<H: Intercept> ProvisionPlugin for Intercepted<H> {
    fn kind(&self) -> &str {
        self.hook.kind(self.inner.as_ref())
    }

    /// The sink always reaches the inner plugin: a hook changes calls, not
    /// the facts the plugin reports.
    fn attach(&self, sink: ObservationSink) {
        self.inner.attach(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        self.hook.create_node(self.inner.as_ref(), key, spec).await
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        self.hook
            .lookup_endpoint(self.inner.as_ref(), key, lease)
            .await
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        self.hook
            .start_bootstrap(self.inner.as_ref(), key, request)
            .await
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.hook
            .complete_bootstrap(self.inner.as_ref(), key, session)
            .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.hook
            .cancel_bootstrap(self.inner.as_ref(), key, session)
            .await
    }

    async fn destroy_node(&self, key: &AttemptKey, lease: &LeaseHandle) -> Result<(), PluginError> {
        self.hook
            .destroy_node(self.inner.as_ref(), key, lease)
            .await
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        self.hook.list_nodes(self.inner.as_ref(), run).await
    }
}
