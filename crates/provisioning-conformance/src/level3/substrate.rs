//! [`Level3Substrate`]: the kit's [`Substrate`] over a real plugin, with
//! everything that does not depend on the provider written once. A
//! provider's battery supplies a [`Level3World`] — how a stream event or a
//! loss becomes a real event of its engine, how a hung call is let go, what
//! is live by its own count, and how it tears down — and the kit supplies
//! the rest over a [`SubstrateCore`]: the shared state, the manual spawner
//! the executor's work queues on, and the tokio runtime the plugin's own
//! tasks run on.
//!
//! # Work and settling
//! The executor's operations queue on a [`ManualSpawner`], so the trace
//! decides when work runs and in which order. Running work polls them on
//! the harness thread inside the runtime (one worker thread, which also
//! drives the plugin's tasks); see [`run_work`] for how "run everything"
//! and "run one" are bounded.
//!
//! # Teardown
//! Dropping the substrate stops the faults, lets every hung call go, drains
//! the calls still doing I/O (so that none is cut off between a real action
//! and its bookkeeping), and stops the runtime; the world's hooks remove
//! and record whatever its plugin left, in between and after.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use provisioning::effect::SessionHandle;
use provisioning::observe::LossCause;
use provisioning::spawn::{ManualSpawner, Spawner};
use provisioning::{LeaseHandle, LogicalNodeId, NodeAttemptId, Observation, RunId};
use provisioning_provider::{ObservationSink, ProvisionPlugin};

use super::shared::{Shared, attempt_key};
use super::work::{WorkBounds, run_work};
use crate::substrate::{
    CallRecord, Capabilities, LiveResources, ResourceKey, Substrate, SubstrateCounters,
};
use crate::trace::{Fault, FaultTarget, StreamEvent, WorkStep};

/// The runtime's worker threads (the harness thread polls the executor's
/// work; the worker drives the plugin's own tasks).
const RUNTIME_WORKERS: usize = 1;

/// How long the runtime may take to stop its tasks at teardown.
pub const RUNTIME_SHUTDOWN_WAIT_MAX: Duration = Duration::from_secs(5);

/// What every Level 3 substrate holds besides its world: the shared state,
/// the spawner the executor's work queues on, and the runtime the plugin
/// runs on (gone once the substrate is torn down).
pub struct SubstrateCore<F, X = (), P = ()> {
    shared: Arc<Shared<F, X, P>>,
    spawner: ManualSpawner,
    runtime: Option<tokio::runtime::Runtime>,
    bounds: WorkBounds,
}

impl<F, X: Default, P: Clone> SubstrateCore<F, X, P> {
    /// A core over `shared` whose work is bounded by `bounds`, with a
    /// runtime of one worker thread named `thread_name`.
    ///
    /// # Panics
    /// When no tokio runtime can be built: Level 3 fails loudly then.
    pub fn new(shared: Arc<Shared<F, X, P>>, thread_name: &str, bounds: WorkBounds) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_WORKERS)
            .thread_name(thread_name)
            .enable_all()
            .build()
            .expect("level 3 needs a tokio runtime");
        SubstrateCore {
            shared,
            spawner: ManualSpawner::new(),
            runtime: Some(runtime),
            bounds,
        }
    }

    /// The shared state.
    pub fn shared(&self) -> &Arc<Shared<F, X, P>> {
        &self.shared
    }

    /// The spawner the executor's work queues on.
    pub fn spawner(&self) -> &ManualSpawner {
        &self.spawner
    }

    /// The runtime, until teardown stops it.
    pub fn runtime(&self) -> Option<&tokio::runtime::Runtime> {
        self.runtime.as_ref()
    }

    /// Runs `future` to its end on the runtime; `None` once the runtime is
    /// stopped.
    pub fn block_on<T>(&self, future: impl Future<Output = T>) -> Option<T> {
        self.runtime
            .as_ref()
            .map(|runtime| runtime.block_on(future))
    }

    /// A sink that folds what the plugin reports into the shared state.
    pub fn sink(&self) -> ObservationSink
    where
        F: Send + 'static,
        X: Send + 'static,
        P: Send + 'static,
    {
        let reporter = self.shared.clone();
        ObservationSink::new(move |observation| reporter.observe(observation))
    }

    /// Runs `step` of the work inside the runtime (see [`run_work`]):
    /// everything until no call does I/O and nothing is ready (calls hung
    /// on purpose may stay), or one task once; `describe` accounts for work
    /// that does not settle. Returns the polls.
    pub fn run_work(&self, step: WorkStep, describe: impl Fn() -> String) -> usize {
        let Some(runtime) = &self.runtime else {
            return 0;
        };
        let _context = runtime.enter();
        run_work(
            &self.spawner,
            step,
            &self.bounds,
            || self.shared.lock().busy_calls(),
            describe,
        )
    }

    /// Whether work is ready or a call still does I/O.
    pub fn has_runnable_work(&self) -> bool {
        self.spawner.ready_count() > 0 || self.shared.lock().busy_calls() > 0
    }

    /// The first live session, counting `session` round the live ones.
    pub fn live_session(&self, session: u32) -> Option<ResourceKey> {
        let live = self.shared.lock().live_sessions();
        (!live.is_empty()).then(|| live[session as usize % live.len()].clone())
    }

    /// Destroys an orphan the way the durable host does: `plugin` lists
    /// `run`, and the listed lease of `key` is destroyed through the real
    /// `destroy_node`, each call bounded by `wait`. Returns whether the
    /// destroy succeeded.
    pub fn destroy_listed<T>(
        &self,
        plugin: &Arc<T>,
        run: &RunId,
        key: &ResourceKey,
        wait: Duration,
    ) -> bool
    where
        T: ProvisionPlugin + ?Sized,
    {
        let attempt = attempt_key(run, key);
        self.block_on(async move {
            let listed = tokio::time::timeout(wait, plugin.list_nodes(run))
                .await
                .ok()?
                .ok()?;
            let lease = listed.into_iter().find(|l| l.key == attempt)?.lease;
            tokio::time::timeout(wait, plugin.destroy_node(&attempt, &lease))
                .await
                .ok()?
                .ok()
        })
        .flatten()
        .is_some()
    }

    /// The account of the queued work and the shared state every substrate
    /// gives, for `run`; `hung` says what a hung call waits on.
    pub fn describe_work(&self, hung: &str, run: &RunId) -> String {
        let state = self.shared.lock();
        format!(
            "{} task(s) queued ({} runnable), {} call(s) doing I/O, {} hung{hung}, \
             {} scripted fault(s) unused, {} live session(s); run {run}",
            self.spawner.len(),
            self.spawner.ready_count(),
            state.busy_calls(),
            state.hung_calls(),
            state.unused_scripts(),
            state.live_sessions().len(),
        )
    }

    /// Drops the queued work inside the runtime and stops the runtime.
    fn stop_runtime(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            {
                let _context = runtime.enter();
                self.spawner.clear();
            }
            runtime.shutdown_timeout(RUNTIME_SHUTDOWN_WAIT_MAX);
        }
    }
}

/// A provider's part of a Level 3 substrate: its real world, the fault
/// mapping of the kit's inputs onto it, and its own count of what is live.
/// Every method gets the [`SubstrateCore`] for the shared state, the
/// runtime and the work.
pub trait Level3World: Sized {
    /// What one test shares among its substrates.
    type Context;
    /// A deliberate defect a test can build the substrate with.
    type Defect;
    /// The world's real fault counts.
    type Faults: Default;
    /// The world's part of a session.
    type Session: Default;
    /// The world's part of a hang: what to let go on release.
    type Hang: Clone;
    /// The backend under the executor.
    type Backend: provisioning::executor::EffectBackend;

    /// What a hung call waits on, for the work's account (" on a stopped
    /// agent"; empty when it says nothing more).
    const HUNG_ON: &'static str;

    /// Starts a world of its own run in `context`, with its core.
    ///
    /// # Panics
    /// When the test environment cannot provide it: Level 3 fails loudly.
    fn start(context: Arc<Self::Context>, defect: Option<Self::Defect>) -> (Core<Self>, Self);

    /// The world's run.
    fn run(&self) -> &RunId;

    /// The backend.
    fn backend(&self) -> Arc<Self::Backend>;

    /// The calls the backend recorded since the last take.
    fn take_calls(&self) -> Vec<CallRecord>;

    /// Queues a scripted fault (see [`Substrate::script`]).
    fn script(&mut self, core: &Core<Self>, target: FaultTarget, fault: Fault) -> bool {
        core.shared().script(target, fault).is_queued()
    }

    /// Undoes the world's standing faults once no more are scripted (the
    /// shared queue is already stopped).
    fn stop_faults(&mut self, _core: &Core<Self>) {}

    /// Lets hung call `serial` go on. Returns whether it was hung.
    fn release_hang(&mut self, core: &Core<Self>, serial: u64) -> bool;

    /// Makes `event` happen for the live session `key` for real. Returns
    /// whether it did.
    fn stream(&mut self, core: &Core<Self>, key: &ResourceKey, event: StreamEvent) -> bool;

    /// Whether `event` can happen at all; a refused one is not even given
    /// a session (and may be counted).
    fn streamable(&mut self, _core: &Core<Self>, _event: StreamEvent) -> bool {
        true
    }

    /// Makes `key` lost for real by `cause`. Returns whether it was.
    fn lose(&mut self, core: &Core<Self>, key: &ResourceKey, cause: LossCause) -> bool;

    /// Lets every waiting session go on (see [`Substrate::fair_progress`]).
    fn fair_progress(&mut self, core: &Core<Self>) -> usize;

    /// What is live, by the world's own count, never the plugin's word.
    fn live_resources(&self, core: &Core<Self>) -> LiveResources;

    /// The controller was replaced after a crash; the plugin lives on.
    fn controller_restarted(&mut self, core: &Core<Self>);

    /// Destroys the orphan `key` (see [`Substrate::destroy_orphan`]).
    fn destroy_orphan(&mut self, core: &Core<Self>, key: &ResourceKey) -> bool;

    /// The world's part of the work's account, after the run's name.
    fn describe_world(&self, _core: &Core<Self>) -> Option<String> {
        None
    }

    /// Teardown: every hung call was let go; calls still doing I/O are
    /// drained next.
    fn hangs_released(&mut self, _core: &Core<Self>) {}

    /// Teardown: the calls are drained; the runtime stops next.
    fn runtime_stopping(&mut self, _core: &Core<Self>) {}

    /// Teardown: the runtime is stopped; remove and record what is left.
    fn torn_down(&mut self, core: &Core<Self>);
}

/// The core of a world `W`'s substrate.
pub type Core<W> = SubstrateCore<
    <W as Level3World>::Faults,
    <W as Level3World>::Session,
    <W as Level3World>::Hang,
>;

/// The Level 3 substrate over world `W`. See the module docs.
pub struct Level3Substrate<W: Level3World> {
    core: Core<W>,
    world: W,
}

impl<W: Level3World> Level3Substrate<W> {
    /// A fresh substrate with its own run, runtime and plugin.
    ///
    /// # Panics
    /// When the test environment cannot provide them: Level 3 fails loudly.
    pub fn new(context: Arc<W::Context>) -> Self {
        Self::with_defect(context, None)
    }

    /// A substrate whose world has a deliberate defect.
    ///
    /// # Panics
    /// As [`Level3Substrate::new`].
    pub fn with_defect(context: Arc<W::Context>, defect: Option<W::Defect>) -> Self {
        let (core, world) = W::start(context, defect);
        Level3Substrate { core, world }
    }

    /// The core.
    pub fn core(&self) -> &Core<W> {
        &self.core
    }

    /// The world.
    pub fn world(&self) -> &W {
        &self.world
    }

    fn release_hang(&mut self, serial: u64) -> bool {
        self.world.release_hang(&self.core, serial)
    }

    fn unreleased_hangs(&self) -> Vec<u64> {
        self.core.shared.lock().unreleased_hangs()
    }

    fn teardown(&mut self) {
        self.stop_faults();
        self.release_all_hangs();
        self.world.hangs_released(&self.core);
        if self.core.shared.lock().busy_calls() > 0 {
            self.run_work(WorkStep::Fifo);
        }
        self.world.runtime_stopping(&self.core);
        self.core.stop_runtime();
        self.world.torn_down(&self.core);
    }
}

impl<W: Level3World> Drop for Level3Substrate<W> {
    fn drop(&mut self) {
        self.teardown();
    }
}

impl<W: Level3World> Substrate for Level3Substrate<W> {
    type Backend = W::Backend;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            deterministic: false,
        }
    }

    fn backend(&self) -> Arc<W::Backend> {
        self.world.backend()
    }

    fn spawner(&self) -> Arc<dyn Spawner> {
        Arc::new(self.core.spawner.clone())
    }

    fn script(&mut self, target: FaultTarget, fault: Fault) -> bool {
        self.world.script(&self.core, target, fault)
    }

    fn stop_faults(&mut self) {
        self.core.shared.stop_faults();
        self.world.stop_faults(&self.core);
    }

    fn run_work(&mut self, step: WorkStep) -> usize {
        self.core.run_work(step, || self.describe_work())
    }

    fn has_runnable_work(&self) -> bool {
        self.core.has_runnable_work()
    }

    fn release_oldest_hang(&mut self) -> bool {
        self.unreleased_hangs()
            .into_iter()
            .any(|serial| self.release_hang(serial))
    }

    fn release_all_hangs(&mut self) -> usize {
        self.unreleased_hangs()
            .into_iter()
            .filter(|serial| self.release_hang(*serial))
            .count()
    }

    fn stream(&mut self, session: u32, event: StreamEvent) -> Option<ResourceKey> {
        if !self.world.streamable(&self.core, event) {
            return None;
        }
        let key = self.core.live_session(session)?;
        self.world.stream(&self.core, &key, event).then_some(key)
    }

    fn lose(&mut self, node: &LogicalNodeId, attempt: NodeAttemptId, cause: LossCause) -> bool {
        self.world.lose(&self.core, &(node.clone(), attempt), cause)
    }

    fn fair_progress(&mut self) -> usize {
        self.world.fair_progress(&self.core)
    }

    fn take_observations(&mut self) -> Vec<Observation> {
        self.core.shared.take_observations()
    }

    fn take_calls(&mut self) -> Vec<CallRecord> {
        self.world.take_calls()
    }

    fn live_resources(&self) -> LiveResources {
        self.world.live_resources(&self.core)
    }

    fn take_ledger_alarms(&mut self) -> Vec<String> {
        self.core.shared.take_alarms()
    }

    /// The plugin and what it made outlive the controller (the harness's
    /// driver and executor).
    fn survives_controller_crash(&self) -> bool {
        true
    }

    fn controller_restarted(&mut self) {
        self.world.controller_restarted(&self.core);
    }

    fn destroy_orphan(&mut self, key: &ResourceKey) -> bool {
        self.world.destroy_orphan(&self.core, key)
    }

    fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        self.core.shared.lease_owner(lease)
    }

    fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.core.shared.session_owner(session)
    }

    fn counters(&self) -> SubstrateCounters {
        self.core.shared.counters()
    }

    fn describe_work(&self) -> String {
        let common = self.core.describe_work(W::HUNG_ON, self.world.run());
        match self.world.describe_world(&self.core) {
            Some(world) => format!("{common}: {world}"),
            None => common,
        }
    }
}
