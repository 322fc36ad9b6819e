//! [`FakePlugin`]: an honest in-memory [`ProvisionPlugin`] with scriptable
//! faults on every method, for Level 2 and for the contract suite's own tests.
//!
//! It keeps a real ledger of leases and bootstrap sessions per
//! [`AttemptKey`], so counts of creations and live resources are the truth,
//! not the driver's belief. Its honest semantics:
//!
//! - `create_node` and `start_bootstrap` adopt a live resource of their key
//!   before creating one;
//! - a definite failure (and a panic) leaves nothing behind for its key — so a
//!   scripted definite fault of a call that would adopt adopts instead, as a
//!   plugin that looks first would;
//! - `cancel_bootstrap` and `destroy_node` of something absent succeed: for
//!   odd attempts with `Ok(())`, for even attempts with
//!   [`PluginError::NotFound`], so that both answers the seam allows are taken;
//! - `lookup_endpoint`, `start_bootstrap` and `complete_bootstrap` of a node
//!   that is gone answer [`PluginError::NotFound`];
//! - every third attempt knows its endpoint at creation; the others need a lookup;
//! - facts (bootstrap events, losses) go through the attached
//!   [`ObservationSink`], only when the harness asks: [`FakePlugin::stream`],
//!   [`FakePlugin::lose`], [`FakePlugin::fair_progress`], and the `Closed`
//!   event that ends a session when its bootstrap is completed;
//! - after a controller crash ([`FakePlugin::controller_restarted`]) the live
//!   sessions, and any a dead controller's call starts later, are quiet: they
//!   report nothing until an adopting `start_bootstrap` of the new controller
//!   re-attaches them, whose agent then joins (and is reported) again — as
//!   the process plugin's re-attach and the re-joining ssh and Slurm agents;
//! - with [`FakePlugin::close_sessions_late`], `complete_bootstrap` only
//!   acknowledges, and the session closes later.
//!
//! # Faults
//! [`FakePlugin::script`] queues a [`Fault`] for the next call of one method
//! (or of any method). Every method can be faulted, `list_nodes` included:
//!
//! | Fault | Effect |
//! |---|---|
//! | `definite` | fails definitely without acting (adopts instead when the call would adopt) |
//! | `ambiguous-done` | acts, then fails ambiguously (a lost reply) |
//! | `ambiguous-undone` | fails ambiguously without acting (a timeout) |
//! | `panic` | panics before acting (adopts instead when the call would adopt) |
//! | `hang` | waits until [`FakePlugin::release_oldest_hang`], then acts |
//! | `not-ready` | `lookup_endpoint` of a live node answers "not ready yet" |
//! | `succeed` | acts normally (uses up the script) |
//!
//! [`PluginDefect`]s make the plugin deliberately dishonest, to show that the
//! contract suite and the battery notice.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use provisioning::effect::SessionHandle;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::spawn::BoxFuture;
use provisioning::{EndpointLookup, LeaseHandle, LogicalNodeSpec, RunId};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};

use crate::contract::{ContractFaults, ContractSubject, PluginMethod};
use crate::fake_support::{
    Completion, HangGate, Ledger, PanicSerial, endpoint_of, silence_scripted_panics,
};
use crate::harness::PROVIDER_KIND;
use crate::substrate::{LiveResources, SubstrateCounters};
use crate::trace::{Fault, StreamEvent};

/// The run a [`FakePlugin::contract_subject`] serves.
pub const CONTRACT_RUN: &str = "contract";

/// A deliberate dishonesty of the [`FakePlugin`]. Never enable one for real
/// validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PluginDefect {
    /// `create_node` makes a new node on every call instead of adopting.
    CreateIgnoresExisting,
    /// `destroy_node` reports success but keeps the node.
    DestroyKeepsResource,
    /// A scripted definite fault strikes after the work is done, so a
    /// "definite" failure leaves a resource behind.
    DefiniteAfterWork,
    /// A lost node is reported under the newest attempt of its slot instead
    /// of its own.
    LossReportedUnderLatestAttempt,
    /// `cancel_bootstrap` and `destroy_node` of something absent fail definitely.
    CleanupOfAbsentFails,
    /// A lost node disappears without a word to the sink.
    LossNotReported,
}

/// Counts of scripted faults applied, per method and fault, shared between
/// plugins (so a whole battery can be asked whether faults reached every method).
#[derive(Clone, Debug, Default)]
pub struct FaultCoverage {
    counts: Arc<Mutex<BTreeMap<(PluginMethod, Fault), u64>>>,
}

impl FaultCoverage {
    /// An empty count.
    pub fn new() -> Self {
        FaultCoverage::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<(PluginMethod, Fault), u64>> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn record(&self, method: PluginMethod, fault: Fault) {
        *self.lock().entry((method, fault)).or_insert(0) += 1;
    }

    /// How often `fault` was applied to a call of `method`.
    pub fn count(&self, method: PluginMethod, fault: Fault) -> u64 {
        self.lock().get(&(method, fault)).copied().unwrap_or(0)
    }

    /// The pairs of `wanted` that were never applied.
    pub fn missing(
        &self,
        wanted: impl IntoIterator<Item = (PluginMethod, Fault)>,
    ) -> Vec<(PluginMethod, Fault)> {
        let counts = self.lock();
        wanted
            .into_iter()
            .filter(|pair| counts.get(pair).is_none_or(|n| *n == 0))
            .collect()
    }
}

/// A fact to report once the ledger is unlocked.
enum Fact {
    Bootstrap(AttemptKey, BootstrapEvent),
    Lost(AttemptKey, LossCause),
    Rejoined(AttemptKey),
}

type PluginLedger = Ledger<AttemptKey, PluginMethod>;

/// Whether `fault` can apply to a call of `method` (`not-ready` only to a lookup).
fn applies(method: PluginMethod, fault: Fault) -> bool {
    fault != Fault::NotReady || method == PluginMethod::LookupEndpoint
}

/// The answer to a call that needs a node that is gone.
fn gone(key: &AttemptKey, lease: &LeaseHandle) -> PluginError {
    PluginError::not_found(format!("the node {} of {key} is gone", lease.0))
}

/// The in-memory plugin of Level 2. See the [module docs](self).
pub struct FakePlugin {
    kind: String,
    ledger: Mutex<PluginLedger>,
    hangs: HangGate,
    sink: Mutex<Option<ObservationSink>>,
    defects: BTreeSet<PluginDefect>,
    coverage: Option<FaultCoverage>,
    panics: PanicSerial,
}

impl fmt::Debug for FakePlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakePlugin")
            .field("kind", &self.kind)
            .field("defects", &self.defects)
            .field("live", &self.live_resources().to_string())
            .finish_non_exhaustive()
    }
}

impl Default for FakePlugin {
    fn default() -> Self {
        FakePlugin::new()
    }
}

impl FakePlugin {
    /// An honest plugin serving provider kind `fake` (the harness's kind).
    pub fn new() -> Self {
        FakePlugin::with_defects([])
    }

    /// A plugin with deliberate defects (see [`PluginDefect`]).
    ///
    /// Like [`crate::FakeBackend`], the first one installs a panic hook that
    /// keeps scripted panics out of the test output.
    pub fn with_defects(defects: impl IntoIterator<Item = PluginDefect>) -> Self {
        silence_scripted_panics();
        FakePlugin {
            kind: PROVIDER_KIND.to_owned(),
            ledger: Mutex::new(Ledger::default()),
            hangs: HangGate::default(),
            sink: Mutex::new(None),
            defects: defects.into_iter().collect(),
            coverage: None,
            panics: PanicSerial::default(),
        }
    }

    /// Serves provider kind `kind` instead.
    pub fn with_kind(mut self, kind: impl Into<String>) -> Self {
        self.kind = kind.into();
        self
    }

    /// Also counts the faults applied into `coverage`.
    pub fn with_coverage(mut self, coverage: FaultCoverage) -> Self {
        self.coverage = Some(coverage);
        self
    }

    /// This plugin as the contract suite's subject, serving run
    /// [`CONTRACT_RUN`], with itself as the fault hook.
    pub fn contract_subject(self) -> ContractSubject {
        let plugin = Arc::new(self);
        ContractSubject::new(plugin.clone(), RunId::new(CONTRACT_RUN)).with_faults(plugin)
    }

    fn lock(&self) -> MutexGuard<'_, PluginLedger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn has(&self, defect: PluginDefect) -> bool {
        self.defects.contains(&defect)
    }

    /// Queues `fault` for the next call of `method` (any method when `None`).
    /// Returns `false` when it cannot apply (`not-ready` to anything but a
    /// lookup), when [`FakePlugin::stop_faults`] was called, or when
    /// [`MAX_SCRIPTED_FAULTS`](crate::substrate::MAX_SCRIPTED_FAULTS) are
    /// already waiting.
    pub fn script(&self, method: Option<PluginMethod>, fault: Fault) -> bool {
        method.is_none_or(|method| applies(method, fault))
            && self.lock().scripts.push(method, fault)
    }

    /// Drops every queued fault and accepts no more.
    pub fn stop_faults(&self) {
        self.lock().scripts.stop();
    }

    /// Lets the oldest hung call go on. Returns whether one was hung.
    pub fn release_oldest_hang(&self) -> bool {
        self.hangs.release_oldest()
    }

    /// Lets every hung call go on. Returns how many were hung.
    pub fn release_all_hangs(&self) -> usize {
        self.hangs.release_all()
    }

    /// Calls hung right now.
    pub fn hung_calls(&self) -> usize {
        self.hangs.hung()
    }

    /// Makes the `index`-th live session (modulo their number, in key order)
    /// report `event`; `closed` and failures end the session. Returns the
    /// session's key, or `None` when no session is live.
    pub fn stream(&self, index: u32, event: StreamEvent) -> Option<AttemptKey> {
        let (key, event) = self.lock().stream(index, event)?;
        self.emit(vec![Fact::Bootstrap(key.clone(), event)]);
        Some(key)
    }

    /// The controller crashed and a new one was recovered: the live
    /// sessions go quiet until the new controller re-attaches them with an
    /// adopting start (see the module docs).
    pub fn controller_restarted(&self) {
        self.lock().controller_restarted();
    }

    /// Makes the node of `key` lose its agent (its session ends) or its lease
    /// (everything of the key goes), and reports the loss. Returns whether
    /// anything was lost.
    pub fn lose(&self, key: &AttemptKey, cause: LossCause) -> bool {
        let reported = {
            let mut ledger = self.lock();
            if !ledger.lose(key, cause) {
                return false;
            }
            let mut reported = key.clone();
            if self.has(PluginDefect::LossReportedUnderLatestAttempt) {
                if let Some(newest) = ledger.newest_attempt(key) {
                    reported.attempt = newest;
                }
            }
            reported
        };
        if !self.has(PluginDefect::LossNotReported) {
            self.emit(vec![Fact::Lost(reported, cause)]);
        }
        true
    }

    /// After a controller restart: the agent of `key`, if still live (its
    /// lease is and it was not lost), re-joins the new controller and the
    /// re-join is reported through the sink. Returns whether it was.
    pub fn rejoin(&self, key: &AttemptKey) -> bool {
        if !self.lock().agent_live(key) {
            return false;
        }
        self.emit(vec![Fact::Rejoined(key.clone())]);
        true
    }

    /// Lets every live session whose agent has not joined yet join, and
    /// reports the joins. Returns how many joined.
    pub fn fair_progress(&self) -> usize {
        let (joined, closed) = {
            let mut ledger = self.lock();
            (ledger.join_waiting(), ledger.close_acknowledged())
        };
        let count = joined.len() + closed.len();
        self.emit(
            joined
                .into_iter()
                .map(|key| Fact::Bootstrap(key, BootstrapEvent::Joined))
                .chain(
                    closed
                        .into_iter()
                        .map(|key| Fact::Bootstrap(key, BootstrapEvent::Closed)),
                )
                .collect(),
        );
        count
    }

    /// From now on `complete_bootstrap` only acknowledges; the session closes
    /// later (a `closed` stream event, a second completion, or
    /// [`FakePlugin::fair_progress`]), so passes run between the two.
    pub fn close_sessions_late(&self) {
        self.lock().close_sessions_late();
    }

    /// Destroys whatever is live for `key` (lease and session) without a
    /// plugin call: how the harness host collects an orphan. Returns whether
    /// anything was live.
    pub fn destroy_orphan(&self, key: &AttemptKey) -> bool {
        let mut ledger = self.lock();
        let live = ledger.live_lease(key).is_some() || ledger.has_session(key);
        ledger.destroy(key);
        live
    }

    /// The leases and sessions that are live right now, per key (every run).
    pub fn live_resources(&self) -> LiveResources {
        self.lock().live()
    }

    /// Live leases of `key`.
    pub fn live_leases(&self, key: &AttemptKey) -> usize {
        self.lock().leases().filter(|(k, _)| *k == key).count()
    }

    /// G08 breaches seen since the last call.
    pub fn take_alarms(&self) -> Vec<String> {
        self.lock().take_alarms()
    }

    /// The key a lease was issued for.
    pub fn lease_owner(&self, lease: &LeaseHandle) -> Option<AttemptKey> {
        self.lock().lease_owner(lease)
    }

    /// The key a session was issued for.
    pub fn session_owner(&self, session: &SessionHandle) -> Option<AttemptKey> {
        self.lock().session_owner(session)
    }

    /// Creations, adoptions, hangs and faults applied so far.
    pub fn counters(&self) -> SubstrateCounters {
        self.lock().counters
    }

    /// Hung calls and unused scripts, for reports.
    pub fn describe(&self) -> String {
        format!(
            "{} hung plugin call(s), {} scripted fault(s) unused",
            self.hangs.hung(),
            self.lock().scripts.len()
        )
    }

    fn emit(&self, facts: Vec<Fact>) {
        let sink = self
            .sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(sink) = sink else {
            return;
        };
        for fact in facts {
            match fact {
                Fact::Bootstrap(key, event) => {
                    sink.bootstrap(&key, event);
                }
                Fact::Lost(key, cause) => {
                    sink.lost(&key, cause);
                }
                Fact::Rejoined(key) => {
                    sink.rejoined(&key);
                }
            }
        }
    }

    /// Takes the scripted fault of a call, counted in the coverage.
    fn begin(&self, method: PluginMethod) -> Fault {
        let Some(fault) = self.lock().take_script(method, |f| applies(method, f)) else {
            return Fault::Succeed;
        };
        if let Some(coverage) = &self.coverage {
            coverage.record(method, fault);
        }
        fault
    }

    /// Whether `method` for `key` would adopt what exists instead of creating.
    fn would_adopt(
        &self,
        ledger: &PluginLedger,
        method: PluginMethod,
        key: Option<&AttemptKey>,
    ) -> bool {
        let Some(key) = key else {
            return false;
        };
        match method {
            PluginMethod::CreateNode => {
                !self.has(PluginDefect::CreateIgnoresExisting) && ledger.live_lease(key).is_some()
            }
            PluginMethod::StartBootstrap => ledger.has_session(key),
            _ => false,
        }
    }

    /// One plugin call: takes its scripted fault, hangs if asked, then does
    /// (or does not do) the work `perform` describes. `perform` gets whether
    /// a lookup must answer "not ready".
    async fn call<T, P>(
        &self,
        method: PluginMethod,
        key: Option<&AttemptKey>,
        perform: P,
    ) -> Result<T, PluginError>
    where
        T: Send,
        P: FnOnce(&mut PluginLedger, &mut Vec<Fact>, bool) -> Result<T, PluginError> + Send,
    {
        let fault = self.begin(method);
        if fault == Fault::Hang {
            self.hangs.park().await;
        }
        let mut facts = Vec::new();
        let outcome = {
            let mut ledger = self.lock();
            let adopts = self.would_adopt(&ledger, method, key);
            match fault {
                Fault::Succeed | Fault::Hang => perform(&mut ledger, &mut facts, false),
                Fault::NotReady => perform(&mut ledger, &mut facts, true),
                Fault::Definite | Fault::Panic if adopts => perform(&mut ledger, &mut facts, false),
                Fault::Definite if self.has(PluginDefect::DefiniteAfterWork) => {
                    perform(&mut ledger, &mut facts, false).and_then(|_| {
                        Err(PluginError::definite(format!(
                            "scripted definite failure of {method} (after the work: defect)"
                        )))
                    })
                }
                Fault::Definite => Err(PluginError::definite(format!(
                    "scripted definite failure of {method}"
                ))),
                Fault::Panic => {
                    drop(ledger);
                    self.panics.panic();
                }
                Fault::AmbiguousDone => perform(&mut ledger, &mut facts, false).and_then(|_| {
                    Err(PluginError::ambiguous(format!(
                        "scripted lost reply of {method} after the work"
                    )))
                }),
                Fault::AmbiguousUndone => Err(PluginError::ambiguous(format!(
                    "scripted ambiguous failure of {method}"
                ))),
            }
        };
        self.emit(facts);
        outcome
    }

    /// The answer to cleaning up something absent.
    fn absent(&self, key: &AttemptKey, what: &str) -> Result<(), PluginError> {
        if self.has(PluginDefect::CleanupOfAbsentFails) {
            return Err(PluginError::definite(format!(
                "no {what} of {key} to clean up (defect)"
            )));
        }
        if key.attempt.get() % 2 == 0 {
            Err(PluginError::not_found(format!("no {what} of {key}")))
        } else {
            Ok(())
        }
    }
}

#[async_trait]
impl ProvisionPlugin for FakePlugin {
    fn kind(&self) -> &str {
        &self.kind
    }

    fn attach(&self, sink: ObservationSink) {
        *self.sink.lock().unwrap_or_else(PoisonError::into_inner) = Some(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        _spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let adopt = !self.has(PluginDefect::CreateIgnoresExisting);
        self.call(PluginMethod::CreateNode, Some(key), |ledger, _, _| {
            Ok(ledger.create_lease(key, adopt))
        })
        .await
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        self.call(
            PluginMethod::LookupEndpoint,
            Some(key),
            |ledger, _, not_ready| {
                if !ledger.holds_lease(key, lease) {
                    return Err(gone(key, lease));
                }
                Ok(if not_ready {
                    EndpointLookup::NotReady
                } else {
                    EndpointLookup::Ready(endpoint_of(lease))
                })
            },
        )
        .await
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        // The controller epoch the call starts in (see `controller_restarted`).
        let epoch = self.lock().epoch();
        self.call(PluginMethod::StartBootstrap, Some(key), |ledger, _, _| {
            if ledger.holds_lease(key, &request.lease) {
                Ok(ledger.start_session(key, epoch))
            } else {
                Err(gone(key, &request.lease))
            }
        })
        .await
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.call(
            PluginMethod::CompleteBootstrap,
            Some(key),
            |ledger, facts, _| {
                // Told that the agent joined, the plugin finishes the session:
                // at once, or later when sessions close late. A quiet
                // session's close reaches nobody.
                match ledger.complete_session(key) {
                    Completion::Closed { report } => {
                        if report {
                            facts.push(Fact::Bootstrap(key.clone(), BootstrapEvent::Closed));
                        }
                        Ok(())
                    }
                    Completion::Acknowledged => Ok(()),
                    // Already finished: completing again changes nothing.
                    Completion::NoSession if ledger.live_lease(key).is_some() => Ok(()),
                    Completion::NoSession => {
                        Err(PluginError::not_found(format!("the node of {key} is gone")))
                    }
                }
            },
        )
        .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.call(PluginMethod::CancelBootstrap, Some(key), |ledger, _, _| {
            if ledger.end_session(key) {
                Ok(())
            } else {
                self.absent(key, "bootstrap session")
            }
        })
        .await
    }

    async fn destroy_node(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<(), PluginError> {
        self.call(PluginMethod::DestroyNode, Some(key), |ledger, _, _| {
            if ledger.live_lease(key).is_none() {
                ledger.end_session(key);
                return self.absent(key, "node");
            }
            if !self.has(PluginDefect::DestroyKeepsResource) {
                ledger.destroy(key);
            }
            Ok(())
        })
        .await
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        self.call(PluginMethod::ListNodes, None, |ledger, _, _| {
            Ok(ledger
                .leases()
                .filter(|(key, _)| key.run_id == *run)
                .map(|(key, lease)| ListedNode {
                    key: key.clone(),
                    lease: lease.clone(),
                })
                .collect())
        })
        .await
    }
}

impl ContractFaults for FakePlugin {
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        self.script(Some(method), fault)
    }

    fn lose_node<'a>(&'a self, key: &'a AttemptKey) -> BoxFuture<'a, bool> {
        Box::pin(std::future::ready(self.lose(key, LossCause::LeaseGone)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::complete_without_runtime;
    use crate::substrate::MAX_SCRIPTED_FAULTS;
    use provisioning::{GroupId, LogicalNodeId, NodeAttemptId, NodeTemplate, Observation};
    use std::future::Future;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::task::{Context, Poll, Waker};

    type Seen = Arc<Mutex<Vec<Observation>>>;

    fn key(attempt: u64) -> AttemptKey {
        AttemptKey {
            run_id: RunId::new(CONTRACT_RUN),
            node: LogicalNodeId::new(GroupId::new("a"), 0),
            attempt: NodeAttemptId::from_raw(attempt),
        }
    }

    fn spec(key: &AttemptKey) -> LogicalNodeSpec {
        let template = NodeTemplate {
            role: "r".into(),
            provider: PROVIDER_KIND.into(),
            shape: Default::default(),
            boot: Default::default(),
            swarm_join: Default::default(),
        };
        LogicalNodeSpec::new(key.node.clone(), key.run_id.clone(), Arc::new(template))
    }

    fn now<T>(future: impl Future<Output = T>) -> T {
        match complete_without_runtime(future) {
            Some(output) => output,
            None => panic!("an unhung fake plugin call waited"),
        }
    }

    /// The inputs of one call, owned so that a hung call can borrow them.
    struct Call {
        method: PluginMethod,
        key: AttemptKey,
        spec: LogicalNodeSpec,
        request: BootstrapRequest,
    }

    impl Call {
        fn new(method: PluginMethod, lease: &LeaseHandle) -> Self {
            let key = key(1);
            let spec = spec(&key);
            let request = BootstrapRequest {
                spec: spec.clone(),
                lease: lease.clone(),
                endpoint: endpoint_of(lease),
            };
            Call {
                method,
                key,
                spec,
                request,
            }
        }

        fn on<'a>(&'a self, plugin: &'a FakePlugin) -> BoxFuture<'a, Result<(), PluginError>> {
            let (key, lease) = (&self.key, &self.request.lease);
            match self.method {
                PluginMethod::CreateNode => {
                    Box::pin(async move { plugin.create_node(key, &self.spec).await.map(|_| ()) })
                }
                PluginMethod::LookupEndpoint => {
                    Box::pin(async move { plugin.lookup_endpoint(key, lease).await.map(|_| ()) })
                }
                PluginMethod::StartBootstrap => {
                    Box::pin(
                        async move { plugin.start_bootstrap(key, &self.request).await.map(|_| ()) },
                    )
                }
                PluginMethod::CompleteBootstrap => plugin.complete_bootstrap(key, None),
                PluginMethod::CancelBootstrap => plugin.cancel_bootstrap(key, None),
                PluginMethod::DestroyNode => plugin.destroy_node(key, lease),
                PluginMethod::ListNodes => {
                    Box::pin(async move { plugin.list_nodes(&key.run_id).await.map(|_| ()) })
                }
            }
        }
    }

    /// A plugin reporting into `Seen`, holding what a call of `method` needs:
    /// nothing for a create, a node for a lookup, start or list, a node and a
    /// session for the rest.
    fn prepared(method: PluginMethod) -> (FakePlugin, LeaseHandle, Seen) {
        let plugin = FakePlugin::new();
        let seen: Seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        plugin.attach(ObservationSink::new(move |o| {
            record
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(o);
        }));
        let k = key(1);
        if method == PluginMethod::CreateNode {
            return (plugin, LeaseHandle("not-yet".into()), seen);
        }
        let lease = now(plugin.create_node(&k, &spec(&k)));
        let lease = lease.unwrap_or_else(|e| panic!("{e}")).lease;
        let with_session = matches!(
            method,
            PluginMethod::CompleteBootstrap
                | PluginMethod::CancelBootstrap
                | PluginMethod::DestroyNode
        );
        if with_session {
            let start = Call::new(PluginMethod::StartBootstrap, &lease);
            now(start.on(&plugin)).unwrap_or_else(|e| panic!("{e}"));
        }
        (plugin, lease, seen)
    }

    /// The ledger after a call: what is live and how much was ever created.
    fn ledger(plugin: &FakePlugin) -> (LiveResources, u64) {
        (plugin.live_resources(), plugin.counters().creations)
    }

    fn disposition(outcome: &Result<(), PluginError>) -> &'static str {
        match outcome {
            Ok(()) => "ok",
            Err(PluginError::Definite(_)) => "definite",
            Err(PluginError::Ambiguous(_)) => "ambiguous",
            Err(PluginError::NotFound(_)) => "not-found",
        }
    }

    /// Scripts `fault` on a prepared call of `method` and checks the answer
    /// and whether the work happened (compared with an unfaulted call).
    fn check(method: PluginMethod, fault: Fault, answer: &str, work_done: bool) {
        let (plugin, lease, _) = prepared(method);
        let before = ledger(&plugin);
        let call = Call::new(method, &lease);
        let normal = {
            let (reference, reference_lease, _) = prepared(method);
            let _ = now(Call::new(method, &reference_lease).on(&reference));
            ledger(&reference)
        };
        assert!(plugin.script(Some(method), fault), "{method} {fault:?}");
        let outcome = catch_unwind(AssertUnwindSafe(|| now(call.on(&plugin))));
        let shown = outcome.as_ref().map_or("panic", disposition);
        assert_eq!(shown, answer, "{method} under {}", fault.name());
        let expected = if work_done { normal } else { before };
        assert_eq!(
            ledger(&plugin),
            expected,
            "{method} under {}: work done should be {work_done}",
            fault.name()
        );
    }

    #[test]
    fn every_method_takes_every_fault_as_documented() {
        for method in PluginMethod::ALL {
            check(method, Fault::Definite, "definite", false);
            check(method, Fault::AmbiguousUndone, "ambiguous", false);
            check(method, Fault::AmbiguousDone, "ambiguous", true);
            check(method, Fault::Panic, "panic", false);
            check(method, Fault::Succeed, "ok", true);
        }
        check(PluginMethod::LookupEndpoint, Fault::NotReady, "ok", true);
    }

    #[test]
    fn a_hung_call_of_any_method_acts_only_once_released() {
        for method in PluginMethod::ALL {
            let (plugin, lease, _) = prepared(method);
            let before = ledger(&plugin);
            assert!(plugin.script(Some(method), Fault::Hang));
            let call = Call::new(method, &lease);
            let mut future = call.on(&plugin);
            let mut cx = Context::from_waker(Waker::noop());
            assert!(future.as_mut().poll(&mut cx).is_pending(), "{method}");
            assert_eq!(ledger(&plugin), before, "{method} acted while hung");
            assert_eq!(plugin.hung_calls(), 1);
            assert!(plugin.describe().contains("1 hung plugin call"));
            assert!(plugin.release_oldest_hang());
            assert!(!plugin.release_oldest_hang());
            let outcome = future.as_mut().poll(&mut cx);
            assert!(
                matches!(outcome, Poll::Ready(Ok(()))),
                "{method}: {outcome:?}"
            );
            assert_eq!(plugin.counters().hangs, 1);
        }
    }

    #[test]
    fn a_definite_fault_or_a_panic_on_a_call_that_would_adopt_adopts_instead() {
        for fault in [Fault::Definite, Fault::Panic] {
            let (plugin, lease, _) = prepared(PluginMethod::DestroyNode);
            let k = key(1);
            assert!(plugin.script(None, fault));
            let again = now(plugin.create_node(&k, &spec(&k)));
            assert!(
                matches!(&again, Ok(n) if n.adopted && n.lease == lease),
                "{again:?}"
            );
            assert!(plugin.script(Some(PluginMethod::StartBootstrap), fault));
            let start = now(Call::new(PluginMethod::StartBootstrap, &lease).on(&plugin));
            assert_eq!(start, Ok(()));
            assert_eq!(plugin.counters().creations, 2, "one lease, one session");
            assert_eq!(plugin.counters().adoptions, 2);
        }
    }

    #[test]
    fn cleanup_of_absent_things_succeeds_with_ok_for_odd_and_not_found_for_even_attempts() {
        let plugin = FakePlugin::new();
        let gone = LeaseHandle("gone".into());
        for (attempt, expected) in [(1, "ok"), (2, "not-found"), (3, "ok")] {
            let k = key(attempt);
            assert_eq!(
                disposition(&now(plugin.cancel_bootstrap(&k, None))),
                expected
            );
            assert_eq!(disposition(&now(plugin.destroy_node(&k, &gone))), expected);
        }
        let broken = FakePlugin::with_defects([PluginDefect::CleanupOfAbsentFails]);
        assert_eq!(
            disposition(&now(broken.destroy_node(&key(1), &gone))),
            "definite"
        );
    }

    #[test]
    fn calls_that_need_a_gone_node_answer_not_found() {
        let plugin = FakePlugin::new();
        let gone = LeaseHandle("gone".into());
        for method in [
            PluginMethod::LookupEndpoint,
            PluginMethod::StartBootstrap,
            PluginMethod::CompleteBootstrap,
        ] {
            let outcome = now(Call::new(method, &gone).on(&plugin));
            assert_eq!(disposition(&outcome), "not-found", "{method}");
        }
    }

    #[test]
    fn facts_reach_the_sink_only_when_asked_and_completing_closes_the_session() {
        let (plugin, lease, seen) = prepared(PluginMethod::CompleteBootstrap);
        let k = key(1);
        assert!(
            seen.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
        );
        assert_eq!(plugin.fair_progress(), 1);
        assert_eq!(plugin.fair_progress(), 0, "joins once");
        assert_eq!(plugin.stream(5, StreamEvent::Converged), Some(k.clone()));
        assert_eq!(now(plugin.complete_bootstrap(&k, None)), Ok(()));
        assert_eq!(
            now(plugin.complete_bootstrap(&k, None)),
            Ok(()),
            "again: no-op"
        );
        assert_eq!(
            plugin.stream(0, StreamEvent::Joined),
            None,
            "no live session"
        );
        assert!(plugin.lose(&k, LossCause::LeaseGone));
        assert!(!plugin.lose(&k, LossCause::LeaseGone));
        assert!(plugin.live_resources().is_empty());
        let events: Vec<String> = seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|o| format!("{o:?}"))
            .collect();
        assert_eq!(events.len(), 4, "{events:?}");
        assert!(events[0].contains("Joined") && events[1].contains("Converged"));
        assert!(events[2].contains("Closed") && events[3].contains("LeaseGone"));
        assert_eq!(plugin.lease_owner(&lease), Some(k));
    }

    #[test]
    fn every_third_attempt_knows_its_endpoint_at_creation() {
        let plugin = FakePlugin::new();
        let known: Vec<bool> = (1..=6)
            .map(|attempt| {
                let k = key(attempt);
                let created = now(plugin.create_node(&k, &spec(&k)));
                created.is_ok_and(|n| n.endpoint.is_some())
            })
            .collect();
        assert_eq!(known, [false, false, true, false, false, true]);
        assert_eq!(
            plugin.take_alarms().len(),
            5,
            "six attempts of one slot live at once"
        );
    }

    #[test]
    fn scripts_are_bounded_prefer_their_method_and_stop_and_coverage_counts_them() {
        let coverage = FaultCoverage::new();
        let plugin = FakePlugin::new().with_coverage(coverage.clone());
        let k = key(1);
        assert!(!plugin.script(Some(PluginMethod::CreateNode), Fault::NotReady));
        assert!(plugin.script(None, Fault::AmbiguousUndone));
        assert!(plugin.script(Some(PluginMethod::CreateNode), Fault::Definite));
        let first = now(plugin.create_node(&k, &spec(&k)));
        assert!(matches!(first, Err(PluginError::Definite(_))), "{first:?}");
        let second = now(plugin.create_node(&k, &spec(&k)));
        assert!(
            matches!(second, Err(PluginError::Ambiguous(_))),
            "{second:?}"
        );
        assert_eq!(coverage.count(PluginMethod::CreateNode, Fault::Definite), 1);
        assert_eq!(
            coverage.missing([
                (PluginMethod::CreateNode, Fault::AmbiguousUndone),
                (PluginMethod::DestroyNode, Fault::Hang)
            ]),
            [(PluginMethod::DestroyNode, Fault::Hang)]
        );
        for _ in 0..MAX_SCRIPTED_FAULTS {
            assert!(plugin.script(None, Fault::Definite));
        }
        assert!(!plugin.script(None, Fault::Definite), "bounded");
        plugin.stop_faults();
        assert!(!plugin.script(None, Fault::Definite));
        assert!(now(plugin.create_node(&k, &spec(&k))).is_ok());
        assert!(plugin.describe().contains("0 scripted fault(s) unused"));
    }

    #[test]
    fn defects_make_the_plugin_dishonest_as_documented() {
        let k = key(1);
        let creates_anew = FakePlugin::with_defects([PluginDefect::CreateIgnoresExisting]);
        let _ = now(creates_anew.create_node(&k, &spec(&k)));
        let again = now(creates_anew.create_node(&k, &spec(&k)));
        assert!(matches!(again, Ok(n) if !n.adopted));
        assert_eq!(creates_anew.live_leases(&k), 2);
        assert_eq!(creates_anew.take_alarms().len(), 1);

        let keeps = FakePlugin::with_defects([PluginDefect::DestroyKeepsResource]);
        let lease = now(keeps.create_node(&k, &spec(&k))).map(|n| n.lease);
        let lease = lease.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(now(keeps.destroy_node(&k, &lease)), Ok(()));
        assert_eq!(keeps.live_leases(&k), 1);

        let lies = FakePlugin::with_defects([PluginDefect::DefiniteAfterWork]);
        assert!(lies.script(None, Fault::Definite));
        let failed = now(lies.create_node(&k, &spec(&k)));
        assert!(matches!(failed, Err(PluginError::Definite(_))));
        assert_eq!(lies.live_leases(&k), 1);
    }
}
