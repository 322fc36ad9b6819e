//! What a host is started with: its [`HostConfig`] and the plugins it
//! serves, each as a [`PluginEntry`] with an optional shutdown hook.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use provisioning::spawn::BoxFuture;
use provisioning::{RetryPolicy, RunId};
use provisioning_provider::ProvisionPlugin;

/// The default period of the safety tick that forces a full pass. Progress
/// never depends on it; it only bounds how long a lost wake-up can stall.
pub const DEFAULT_SAFETY_TICK: Duration = Duration::from_secs(5);

/// The default bound on a graceful shutdown before it is forced.
pub const DEFAULT_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(30);

/// How the host runs.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The run the host manages; fixed for its lifetime.
    pub run_id: RunId,
    /// Backoff, timeouts and probe interval of the driver.
    pub policy: RetryPolicy,
    /// The period of the safety tick.
    pub safety_tick: Duration,
    /// The bound on a graceful shutdown.
    pub shutdown_deadline: Duration,
    /// Launch caps, rollout budgets and breakers (none by default).
    pub limits: provisioning::Limits,
    /// How many transitions each node's history keeps (shown by `status`);
    /// 0 keeps none.
    pub history_depth: usize,
    /// Whether the host reports to the `metrics` facade (see the table in
    /// the crate's `metrics` module); off by default.
    pub metrics: bool,
}

impl HostConfig {
    /// The defaults for `run_id`.
    pub fn new(run_id: RunId) -> Self {
        HostConfig {
            run_id,
            policy: RetryPolicy::default(),
            safety_tick: DEFAULT_SAFETY_TICK,
            shutdown_deadline: DEFAULT_SHUTDOWN_DEADLINE,
            limits: provisioning::Limits::default(),
            history_depth: DEFAULT_HISTORY_DEPTH,
            metrics: false,
        }
    }
}

/// How many transitions each node keeps by default: enough to see a whole
/// bring-up and the failure before it.
pub const DEFAULT_HISTORY_DEPTH: usize = 16;

pub(super) type ShutdownHook = Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>;

/// A plugin the host serves, with an optional hook the host awaits when it
/// stops (for example to kill every process the plugin started).
pub struct PluginEntry {
    pub(super) plugin: Arc<dyn ProvisionPlugin>,
    pub(super) on_shutdown: Option<ShutdownHook>,
}

impl fmt::Debug for PluginEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginEntry")
            .field("kind", &self.plugin.kind())
            .field("has_shutdown_hook", &self.on_shutdown.is_some())
            .finish()
    }
}

impl PluginEntry {
    /// A plugin without a shutdown hook.
    pub fn new(plugin: Arc<dyn ProvisionPlugin>) -> Self {
        PluginEntry {
            plugin,
            on_shutdown: None,
        }
    }

    /// Adds the hook the host awaits (bounded by
    /// [`PLUGIN_SHUTDOWN_WAIT`](super::PLUGIN_SHUTDOWN_WAIT)) once it stops
    /// reconciling, whether the shutdown was clean or forced.
    ///
    /// # Assumptions
    /// The hook releases everything the plugin still holds; after a forced
    /// shutdown that is the only cleanup there is.
    pub fn with_shutdown<F, Fut>(mut self, hook: F) -> Self
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.on_shutdown = Some(Box::new(move || Box::pin(hook())));
        self
    }
}
