//! The Level 2 substrate: the real [`PluginBackendAdapter`] over a plugin,
//! under the real executor.
//!
//! [`PluginSubstrate`] puts any [`ScriptablePlugin`] — a [`ProvisionPlugin`]
//! that also gives the harness its hands and eyes (fault scripting, hung-call
//! release, stream events, node loss, and an honest ledger of what is live) —
//! behind the adapter, exactly as a host does, and runs its work on a
//! deterministic [`ManualSpawner`]. Observations travel the production path:
//! the plugin reports through the [`ObservationSink`] the adapter attached,
//! the sink drops facts of superseded attempts, and what is left reaches the
//! driver.
//!
//! Faults reach every plugin method the adapter calls: a trace's
//! `script <effect-kind> <fault>` becomes a fault of the method that effect
//! runs through ([`PluginMethod::for_effect`]), and `script any <fault>` one of
//! whichever method is called next — cleanup included.
//!
//! [`FakePlugin`] is the Level 2 plugin ([`Battery::level2`]). A plugin that
//! needs a real runtime (Level 3) builds its own substrate, and can reuse
//! [`PluginBackend`] for the call recording.

use std::sync::{Arc, Mutex, PoisonError};

use provisioning::effect::SessionHandle;
use provisioning::executor::EffectBackend;
use provisioning::observe::LossCause;
use provisioning::spawn::{BoxFuture, ManualSpawner, Spawner};
use provisioning::{
    EffectError, EffectOutput, LeaseHandle, LogicalNodeId, NodeAttemptId, Observation, Operation,
    RunId,
};
use provisioning_provider::{AttemptKey, ObservationSink, PluginBackendAdapter, ProvisionPlugin};

use crate::battery::{Battery, DEFAULT_SEED_COUNT, LEVEL1_SEED_BASE, derive_seeds};
use crate::contract::PluginMethod;
use crate::harness::{PROVIDER_KIND, RUN_NAME};
use crate::level3::{Intercept, Intercepted};
use crate::plugin_fake::FakePlugin;
use crate::substrate::{
    CallRecord, CallRecorder, Capabilities, LiveResources, ResourceKey, Substrate,
    SubstrateCounters, run_manual_work,
};
use crate::trace::{Fault, FaultTarget, StreamEvent, WorkStep};

/// A plugin the harness can drive: the provider-side hooks of a
/// [`Substrate`], on the plugin itself.
///
/// Keys passed in belong to the harness's run ([`RUN_NAME`]).
pub trait ScriptablePlugin: ProvisionPlugin {
    /// Whether the plugin behaves identically for identical calls (G18, G20).
    fn deterministic(&self) -> bool;

    /// Queues `fault` for the next call of `method` (of any method when
    /// `None`). Returns `false` when it cannot be produced or is refused.
    fn script_fault(&self, method: Option<PluginMethod>, fault: Fault) -> bool;

    /// Queues `fault` for the next call of the method behind `target`, as
    /// a trace scripts it: `false` for a fault that cannot apply to the
    /// target's effect kind, else what [`ScriptablePlugin::script_fault`]
    /// answers.
    fn script_target(&self, target: FaultTarget, fault: Fault) -> bool {
        let method = match target {
            FaultTarget::Any => None,
            FaultTarget::Kind(kind) if fault.applies_to(kind) => {
                Some(PluginMethod::for_effect(kind))
            }
            FaultTarget::Kind(_) => return false,
        };
        self.script_fault(method, fault)
    }

    /// Drops every queued fault and accepts no more.
    fn stop_faults(&self);

    /// Lets the oldest hung call go on. Returns whether one was hung.
    fn release_oldest_hang(&self) -> bool;

    /// Lets every hung call go on. Returns how many were hung.
    fn release_all_hangs(&self) -> usize;

    /// Makes the `session`-th live session report `event` through the sink.
    fn stream_event(&self, session: u32, event: StreamEvent) -> Option<ResourceKey>;

    /// Makes the node of `key` lose its agent or lease and report it.
    fn lose_node_now(&self, key: &AttemptKey, cause: LossCause) -> bool;

    /// Lets sessions whose agent has not joined yet join (the fair tail).
    fn progress_fairly(&self) -> usize;

    /// After a controller restart, makes the agent of `key` re-join the new
    /// controller and report it, if it is still live: see
    /// [`Substrate::rejoin`]. Default: cannot.
    fn rejoin_now(&self, key: &AttemptKey) -> bool {
        let _ = key;
        false
    }

    /// What is really live, from the plugin's own ledger.
    fn live(&self) -> LiveResources;

    /// G08 breaches the plugin saw happen since the last call.
    fn take_alarms(&self) -> Vec<String> {
        Vec::new()
    }

    /// The key a lease was issued for.
    fn owner_of_lease(&self, lease: &LeaseHandle) -> Option<ResourceKey>;

    /// The key a session was issued for.
    fn owner_of_session(&self, session: &SessionHandle) -> Option<ResourceKey>;

    /// Creations, adoptions, hangs and faults applied.
    fn plugin_counters(&self) -> SubstrateCounters;

    /// Hung calls and unused faults, for reports.
    fn describe_plugin(&self) -> String;

    /// Whether the plugin's resources outlive a controller crash and
    /// [`ScriptablePlugin::destroy_orphan`] works (crash inputs apply only
    /// then). Default: no.
    fn survives_controller_crash(&self) -> bool {
        false
    }

    /// The controller crashed and a new one was recovered: see
    /// [`Substrate::controller_restarted`]. Default: nothing.
    fn controller_restarted(&self) {}

    /// Sessions close later than the convergence call: see
    /// [`Substrate::close_sessions_late`]. Default: nothing.
    fn close_sessions_late(&self) {}

    /// Destroys everything live for `key` (an orphan). Returns whether
    /// anything was live. Default: cannot.
    fn destroy_orphan(&self, key: &AttemptKey) -> bool {
        let _ = key;
        false
    }
}

impl ScriptablePlugin for FakePlugin {
    fn deterministic(&self) -> bool {
        true
    }

    fn script_fault(&self, method: Option<PluginMethod>, fault: Fault) -> bool {
        self.script(method, fault)
    }

    fn stop_faults(&self) {
        FakePlugin::stop_faults(self);
    }

    fn release_oldest_hang(&self) -> bool {
        FakePlugin::release_oldest_hang(self)
    }

    fn release_all_hangs(&self) -> usize {
        FakePlugin::release_all_hangs(self)
    }

    fn stream_event(&self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        self.stream(session, event)
            .map(|key| (key.node, key.attempt))
    }

    fn lose_node_now(&self, key: &AttemptKey, cause: LossCause) -> bool {
        self.lose(key, cause)
    }

    fn progress_fairly(&self) -> usize {
        self.fair_progress()
    }

    fn rejoin_now(&self, key: &AttemptKey) -> bool {
        self.rejoin(key)
    }

    fn live(&self) -> LiveResources {
        self.live_resources()
    }

    fn take_alarms(&self) -> Vec<String> {
        FakePlugin::take_alarms(self)
    }

    fn owner_of_lease(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.lease_owner(lease).map(|key| (key.node, key.attempt))
    }

    fn owner_of_session(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.session_owner(session)
            .map(|key| (key.node, key.attempt))
    }

    fn plugin_counters(&self) -> SubstrateCounters {
        self.counters()
    }

    fn survives_controller_crash(&self) -> bool {
        true
    }

    fn controller_restarted(&self) {
        FakePlugin::controller_restarted(self);
    }

    fn close_sessions_late(&self) {
        FakePlugin::close_sessions_late(self);
    }

    fn destroy_orphan(&self, key: &AttemptKey) -> bool {
        FakePlugin::destroy_orphan(self, key)
    }

    fn describe_plugin(&self) -> String {
        self.describe()
    }
}

/// The backend under the executor at Level 2: the adapter, with every call
/// recorded as it starts (G04, G05).
#[derive(Debug)]
pub struct PluginBackend {
    adapter: PluginBackendAdapter,
    calls: CallRecorder,
}

impl PluginBackend {
    /// Records the calls made through `adapter`.
    pub fn new(adapter: PluginBackendAdapter) -> Self {
        PluginBackend {
            adapter,
            calls: CallRecorder::new(),
        }
    }

    /// The adapter.
    pub fn adapter(&self) -> &PluginBackendAdapter {
        &self.adapter
    }

    /// The recorder of started calls.
    pub fn calls(&self) -> &CallRecorder {
        &self.calls
    }
}

impl EffectBackend for PluginBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(async move {
            let _in_flight = self.calls.start(operation);
            self.adapter.execute(operation).await
        })
    }
}

/// Serves a plugin under the harness's provider kind ([`PROVIDER_KIND`]),
/// for plugins whose own kind differs.
struct UnderHarnessKind;

impl Intercept for UnderHarnessKind {
    fn kind<'a>(&'a self, _inner: &'a dyn ProvisionPlugin) -> &'a str {
        PROVIDER_KIND
    }
}

/// The Level 2 substrate. See the [module docs](self).
#[derive(Debug)]
pub struct PluginSubstrate<P: ScriptablePlugin> {
    plugin: Arc<P>,
    backend: Arc<PluginBackend>,
    spawner: ManualSpawner,
    observations: Arc<Mutex<Vec<Observation>>>,
}

impl PluginSubstrate<FakePlugin> {
    /// An honest [`FakePlugin`] behind the adapter.
    pub fn fake() -> Self {
        PluginSubstrate::new(FakePlugin::new())
    }
}

impl<P: ScriptablePlugin> PluginSubstrate<P> {
    /// `plugin` behind a fresh adapter whose sink feeds the harness.
    pub fn new(plugin: P) -> Self {
        let plugin = Arc::new(plugin);
        let observations = Arc::new(Mutex::new(Vec::new()));
        let buffer = observations.clone();
        let sink = ObservationSink::new(move |observation| {
            buffer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(observation);
        });
        let served: Arc<dyn ProvisionPlugin> = if plugin.kind() == PROVIDER_KIND {
            plugin.clone()
        } else {
            Arc::new(Intercepted::new(plugin.clone(), UnderHarnessKind))
        };
        let adapter = PluginBackendAdapter::single(served, sink);
        PluginSubstrate {
            plugin,
            backend: Arc::new(PluginBackend::new(adapter)),
            spawner: ManualSpawner::new(),
            observations,
        }
    }

    /// The plugin.
    pub fn plugin(&self) -> &Arc<P> {
        &self.plugin
    }

    fn key(node: &LogicalNodeId, attempt: NodeAttemptId) -> AttemptKey {
        AttemptKey {
            run_id: RunId::new(RUN_NAME),
            node: node.clone(),
            attempt,
        }
    }
}

impl<P: ScriptablePlugin> Substrate for PluginSubstrate<P> {
    type Backend = PluginBackend;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            deterministic: self.plugin.deterministic(),
        }
    }

    fn backend(&self) -> Arc<PluginBackend> {
        self.backend.clone()
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        Arc::new(self.spawner.clone())
    }

    fn script(&mut self, target: FaultTarget, fault: Fault) -> bool {
        self.plugin.script_target(target, fault)
    }

    fn stop_faults(&mut self) {
        self.plugin.stop_faults();
    }

    fn run_work(&mut self, step: WorkStep) -> usize {
        run_manual_work(&self.spawner, step)
    }

    fn has_runnable_work(&self) -> bool {
        self.spawner.ready_count() > 0
    }

    fn release_oldest_hang(&mut self) -> bool {
        self.plugin.release_oldest_hang()
    }

    fn release_all_hangs(&mut self) -> usize {
        self.plugin.release_all_hangs()
    }

    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        self.plugin.stream_event(session, event)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        self.plugin
            .lose_node_now(&PluginSubstrate::<P>::key(node, attempt), cause)
    }

    fn rejoin(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId) -> bool {
        self.plugin
            .rejoin_now(&PluginSubstrate::<P>::key(node, attempt))
    }

    fn fair_progress(&mut self) -> usize {
        self.plugin.progress_fairly()
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        std::mem::take(
            &mut *self
                .observations
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.backend.calls.take()
    }

    fn live_resources(&self) -> LiveResources {
        self.plugin.live()
    }

    fn take_ledger_alarms(&mut self) -> Vec<String> {
        self.plugin.take_alarms()
    }

    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.plugin.owner_of_lease(lease)
    }

    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.plugin.owner_of_session(session)
    }

    fn counters(&self) -> SubstrateCounters {
        self.plugin.plugin_counters()
    }

    fn survives_controller_crash(&self) -> bool {
        self.plugin.survives_controller_crash()
    }

    fn controller_restarted(&mut self) {
        self.plugin.controller_restarted();
    }

    fn close_sessions_late(&mut self) {
        self.plugin.close_sessions_late();
    }

    fn destroy_orphan(&mut self, (node, attempt): &ResourceKey) -> bool {
        self.plugin
            .destroy_orphan(&PluginSubstrate::<P>::key(node, *attempt))
    }

    fn describe_work(&self) -> String {
        format!(
            "{} task(s) queued ({} runnable), {}",
            self.spawner.len(),
            self.spawner.ready_count(),
            self.plugin.describe_plugin()
        )
    }
}

impl Battery<PluginSubstrate<FakePlugin>> {
    /// Level 2: [`PluginBackendAdapter`] over an honest [`FakePlugin`], with
    /// faults on every plugin method, 256 seeds × both modes. The seeds are
    /// Level 1's, so a trace that passes one level and fails the other points
    /// at the seam.
    pub fn level2() -> Self {
        Battery::level2_with(PluginSubstrate::fake)
    }

    /// [`Battery::level2`] over the substrates `factory` builds (a counting or
    /// deliberately broken [`FakePlugin`]).
    pub fn level2_with(factory: impl Fn() -> PluginSubstrate<FakePlugin> + 'static) -> Self {
        Battery::new("level 2 (PluginBackendAdapter over FakePlugin)", factory)
            .seeds(derive_seeds(LEVEL1_SEED_BASE, DEFAULT_SEED_COUNT))
            .reproduce_with("cargo test -p provisioning-conformance --test level2")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::{Mode, RunOptions, cluster_driver, run_trace};
    use crate::plugin_fake::FaultCoverage;
    use crate::trace::Trace;
    use provisioning::EffectKind;

    fn run(substrate: PluginSubstrate<FakePlugin>, trace: &str, mode: Mode) -> crate::RunOutcome {
        let trace: Trace = trace.parse().unwrap_or_default();
        run_trace(substrate, &cluster_driver, &trace, RunOptions::new(mode))
    }

    #[test]
    fn a_plugin_of_another_kind_is_served_under_the_harness_kind_and_converges() {
        let substrate = PluginSubstrate::new(FakePlugin::new().with_kind("elsewhere"));
        assert_eq!(substrate.plugin().kind(), "elsewhere");
        let outcome = run(substrate, "", Mode::Fair);
        assert_eq!(outcome.violation, None);
        assert!(outcome.converged);
        assert_eq!(outcome.digest.live.leases.len(), 2);
    }

    #[test]
    fn a_fault_scripted_for_an_effect_reaches_the_plugin_method_it_runs_through() {
        let mut substrate = PluginSubstrate::fake();
        assert!(!substrate.script(FaultTarget::Kind(EffectKind::CreateLease), Fault::NotReady));
        for kind in EffectKind::ALL {
            assert!(substrate.script(FaultTarget::Kind(kind), Fault::Succeed));
        }
        assert!(substrate.script(FaultTarget::Any, Fault::Definite));
        substrate.stop_faults();
        assert!(!substrate.script(FaultTarget::Any, Fault::Definite));

        let coverage = FaultCoverage::new();
        let substrate = PluginSubstrate::new(FakePlugin::new().with_coverage(coverage.clone()));
        let outcome = run(
            substrate,
            "script lookup-endpoint not-ready; script destroy-lease ambiguous-done; \
             run fifo; run fifo; desire scale a 0; run fifo; run fifo; tick 2s; run fifo",
            Mode::Fair,
        );
        assert_eq!(outcome.violation, None);
        assert!(outcome.converged);
        assert!(outcome.vacuity.endpoint_probes >= 1);
        assert_eq!(
            coverage.count(PluginMethod::LookupEndpoint, Fault::NotReady),
            1
        );
        assert_eq!(
            coverage.count(PluginMethod::DestroyNode, Fault::AmbiguousDone),
            1
        );
        assert!(outcome.digest.live.is_empty());
    }

    #[test]
    fn calls_through_the_adapter_are_recorded_and_facts_travel_through_the_sink() {
        let outcome = run(
            PluginSubstrate::fake(),
            "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; run fifo",
            Mode::Adversarial,
        );
        assert_eq!(outcome.violation, None);
        assert!(outcome.digest.state.nodes.values().all(|n| n.is_ready()));
        let kinds: Vec<EffectKind> = outcome.digest.calls.iter().map(|c| c.kind).collect();
        assert!(
            kinds.contains(&EffectKind::BootstrapConvergenceObserved),
            "{kinds:?}"
        );
        assert!(outcome.digest.calls.iter().all(|c| c.overlapping == 0));
    }
}
