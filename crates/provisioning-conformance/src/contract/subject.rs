//! What the suite runs against: a [`ContractSubject`] (a plugin, with an
//! optional template and pause) and the optional [`ContractFaults`] hook
//! through which the plugin's author lets the suite script faults on a
//! [`PluginMethod`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use provisioning::spawn::BoxFuture;
use provisioning::{EffectKind, NodeTemplate, RunId};
use provisioning_provider::{AttemptKey, ProvisionPlugin};

use crate::trace::Fault;

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
    pub(super) plugin: Arc<dyn ProvisionPlugin>,
    pub(super) run_id: RunId,
    pub(super) faults: Option<Arc<dyn ContractFaults>>,
    pub(super) template: Option<NodeTemplate>,
    pub(super) pause: Option<PauseFn>,
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
