//! The stepping API: a harness run one input at a time.

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;

use provisioning::durable::RecoveryError;
use provisioning::executor::ExecutorCounters;
use provisioning::shape::DesiredState;
use provisioning::{
    ClusterShape, ClusterState, DurableState, LogicalNodeId, NodeTemplate, ShapeError, Timestamp,
};

use super::model::{self, ShapeModel};
use super::{
    DriverFactory, DriverSetup, Harness, HostOptions, Mode, NodeShape, RunDigest, RunOptions,
    RunOutcome, Vacuity, cluster_driver, panic_text,
};
use crate::guarantee::{GuaranteeId, Phase, Violation};
use crate::journal::{
    InMemoryJournal, KitJournal, Recovered, RecoveryFactory, recover_cluster_driver,
};
use crate::substrate::{CallRecord, LiveResources, Substrate, SubstrateCounters};
use crate::trace::{Input, TraceHeader, WorkStep};

/// The kit's initial shape: run [`RUN_NAME`](super::RUN_NAME), generation 1,
/// one group `a` of two nodes with the kit's template ([`kit_template`]).
/// [`run_trace`](super::run_trace) starts every trace from it.
pub fn default_shape() -> ClusterShape {
    ShapeModel::initial().shape(1)
}

/// The kit's template for a group named `group`: provider kind
/// [`PROVIDER_KIND`](super::PROVIDER_KIND) (the kind the kit's substrates
/// serve), image `image-{group}:1`, one cpu, role `role-{group}-v1`.
///
/// A group with this template drifts as the kit's own groups do (each
/// drift bumps the version inside the drifted field); any other template
/// drifts by appending `~driftN` to the drifted field.
pub fn kit_template(group: &str) -> NodeTemplate {
    model::kit_template(group, [1; 4])
}

/// Why a [`Stepper`] could not be built.
#[derive(Clone, Debug, PartialEq)]
pub enum BuildError {
    /// The initial shape does not validate; nothing was built.
    InvalidShape(ShapeError),
    /// The driver factory failed, or building the driver or the executor
    /// panicked: a G13 violation in the setup phase.
    Setup(Violation),
}

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BuildError::InvalidShape(error) => write!(f, "invalid initial shape: {error}"),
            BuildError::Setup(violation) => write!(f, "setup failed: {violation}"),
        }
    }
}

impl std::error::Error for BuildError {}

/// Builds a [`Stepper`]: [`Stepper::builder`].
pub struct StepperBuilder<'f, S: Substrate> {
    substrate: S,
    factory: &'f DriverFactory,
    journal: Box<dyn KitJournal>,
    recovery: Rc<RecoveryFactory>,
    shape: ClusterShape,
    header: TraceHeader,
    options: RunOptions,
}

impl<S: Substrate> fmt::Debug for StepperBuilder<'_, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepperBuilder")
            .field("shape", &self.shape)
            .field("header", &self.header)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<'f, S: Substrate> StepperBuilder<'f, S> {
    /// The initial desired shape (default: [`default_shape`]).
    ///
    /// Any valid shape: its run id becomes the run's, its groups the initial
    /// groups. The harness numbers generations itself: the initial shape is
    /// submitted at its own generation (at least 1) and every later change
    /// at the next one. Trace inputs that change the shape
    /// ([`Input::Desire`]) name groups `a`, `b` and `c`: they act on the
    /// groups of those names and leave the others alone; an added group gets
    /// [`kit_template`].
    ///
    /// The kit's substrates serve provider kind
    /// [`PROVIDER_KIND`](super::PROVIDER_KIND), and
    /// [`PluginSubstrate`](crate::PluginSubstrate) keys resources by run
    /// [`RUN_NAME`](super::RUN_NAME): over them, use those in your shape.
    pub fn shape(mut self, shape: ClusterShape) -> Self {
        self.shape = shape;
        self
    }

    /// The mode (default: [`Mode::Adversarial`]). It decides what
    /// [`Stepper::finish`] runs after the last step; [`Stepper::run_fair_tail`]
    /// can be called in either mode.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.options.mode = mode;
        self
    }

    /// Every run option at once: mode, the fair tail's work order and
    /// narration (default: [`RunOptions::new`]`(Mode::Adversarial)`).
    pub fn options(mut self, options: RunOptions) -> Self {
        self.options = options;
        self
    }

    /// In which order the fair tail runs queued work (default: oldest
    /// first). [`WorkStep::One`] means oldest first.
    pub fn tail_order(mut self, order: WorkStep) -> Self {
        self.options.tail_order = order;
        self
    }

    /// Whether to keep a one-line narration per step
    /// ([`Stepper::narration`]; default: no).
    pub fn narrate(mut self, narrate: bool) -> Self {
        self.options.narrate = narrate;
        self
    }

    /// The trace header: retry-policy jitter, attempt-id limit and the
    /// clock's start (default: [`TraceHeader::default`], clock at 0).
    pub fn header(mut self, header: TraceHeader) -> Self {
        self.header = header;
        self
    }

    /// The driver under test (default: [`cluster_driver`], the real
    /// [`ClusterDriver`](provisioning::ClusterDriver)).
    pub fn driver<'g>(self, factory: &'g DriverFactory) -> StepperBuilder<'g, S> {
        StepperBuilder {
            substrate: self.substrate,
            factory,
            journal: self.journal,
            recovery: self.recovery,
            shape: self.shape,
            header: self.header,
            options: self.options,
        }
    }

    /// The journal the host commits to (default: an empty
    /// [`InMemoryJournal`]).
    pub fn journal(mut self, journal: Box<dyn KitJournal>) -> Self {
        self.journal = journal;
        self
    }

    /// How a driver is recovered from the journal after a crash (default:
    /// [`recover_cluster_driver`], the real
    /// [`ClusterDriver::recover`](provisioning::ClusterDriver::recover)).
    pub fn recovery(
        self,
        recovery: impl Fn(&DriverSetup, DurableState, Timestamp) -> Result<Recovered, RecoveryError>
        + 'static,
    ) -> Self {
        self.shared_recovery(Rc::new(recovery))
    }

    /// [`StepperBuilder::recovery`] with a shared factory.
    pub fn shared_recovery(mut self, recovery: Rc<RecoveryFactory>) -> Self {
        self.recovery = recovery;
        self
    }

    /// How the host journals and collects orphans (default: the correct
    /// host, [`HostOptions::default`]).
    pub fn host(mut self, host: HostOptions) -> Self {
        self.options.host = host;
        self
    }

    /// Builds the driver and the executor over the substrate, submits the
    /// initial shape and settles (the setup phase).
    ///
    /// A violation found while setting up does not fail the build: the
    /// stepper is returned with it recorded ([`Stepper::violation`]), so the
    /// state that broke the guarantee can be inspected.
    ///
    /// # Errors
    /// [`BuildError::InvalidShape`] when the initial shape does not
    /// validate; [`BuildError::Setup`] when the driver cannot be built.
    pub fn build(self) -> Result<Stepper<S>, BuildError> {
        self.shape.validate().map_err(BuildError::InvalidShape)?;
        let model = ShapeModel::from_shape(&self.shape);
        let first_generation = self.shape.generation.get().max(1);
        let StepperBuilder {
            substrate,
            factory,
            journal,
            recovery,
            header,
            options,
            ..
        } = self;
        let built = catch_unwind(AssertUnwindSafe(move || {
            Harness::new(
                substrate,
                factory,
                journal,
                recovery,
                &header,
                model,
                first_generation,
                options,
            )
        }));
        let harness = match built {
            Ok(Ok(harness)) => harness,
            Ok(Err(violation)) => return Err(BuildError::Setup(violation)),
            Err(payload) => {
                return Err(BuildError::Setup(Violation {
                    guarantee: GuaranteeId::ErrorsNotPanics,
                    phase: Phase::Setup,
                    detail: format!("a step panicked: {}", panic_text(payload.as_ref())),
                }));
            }
        };
        let mut stepper = Stepper {
            harness,
            violation: None,
            tail_is_current: false,
        };
        // A setup violation is recorded in the stepper.
        let _ = stepper.guarded(Harness::set_up);
        Ok(stepper)
    }
}

/// What one successful [`Stepper::step`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepReport {
    /// The step's index in the run (0-based; the phase `input #index`).
    pub index: usize,
    /// The backend calls that started during the step, in start order.
    pub calls: Vec<CallRecord>,
    /// The harness clock after the step.
    pub now: Timestamp,
}

/// What [`Stepper::run_fair_tail`] ended with.
#[derive(Clone, Debug, PartialEq)]
pub struct TailOutcome {
    /// Whether the cluster converged on the latest desired shape.
    pub converged: bool,
    /// Whether attempt exhaustion or clock saturation was reached at some
    /// point of the run, which waives convergence (no G21 violation then).
    pub edges_reached: bool,
    /// How many tail rounds ran.
    pub rounds: usize,
    /// How many attempts the tail allocated (G22 bounds them).
    pub new_attempts: u64,
    /// The slots still keeping the cluster from convergence: desired slots
    /// without a ready, up-to-date, idle node, and nodes of undesired slots.
    pub pending: Vec<LogicalNodeId>,
    /// The same, described for a human (stage, pending operation, backoff).
    pub pending_description: String,
    /// The latest desired shape the harness submitted.
    pub desired: ClusterShape,
    /// The first guarantee found broken, in the tail or before it: G21
    /// (fair convergence) when the tail did not converge.
    pub violation: Option<Violation>,
}

/// A harness run one input at a time: the real driver and executor over
/// any [`Substrate`], from any initial [`ClusterShape`], with the oracle
/// checking after every step exactly as [`run_trace`](super::run_trace)
/// does (which is this type, run to the end).
///
/// Once a step finds a violation the run is over: that step and every later
/// [`step`](Stepper::step) return it, and nothing is applied any more. The
/// inspection methods keep working, on the state the violation left.
///
/// Deterministic over a deterministic substrate: the same substrate, shape,
/// header and inputs give the same calls, state and digest.
///
/// ```
/// use provisioning_conformance::trace::WorkStep;
/// use provisioning_conformance::{FakeSubstrate, Input, Mode, Stepper, default_shape};
///
/// let mut stepper = Stepper::builder(FakeSubstrate::new())
///     .shape(default_shape())
///     .mode(Mode::Fair)
///     .build()?;
/// let report = stepper.step(&Input::Run(WorkStep::Fifo)).expect("no violation");
/// assert_eq!(report.calls.len(), 2, "one create per node");
/// assert_eq!(stepper.live_resources().leases.len(), 2);
/// let tail = stepper.run_fair_tail();
/// assert!(tail.converged, "{}", tail.pending_description);
/// # Ok::<(), provisioning_conformance::BuildError>(())
/// ```
pub struct Stepper<S: Substrate> {
    harness: Harness<S>,
    violation: Option<Violation>,
    /// The fair tail ran after the last step (so `finish` does not run it again).
    tail_is_current: bool,
}

impl<S: Substrate> fmt::Debug for Stepper<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stepper")
            .field("mode", &self.harness.options.mode)
            .field("steps", &self.harness.steps)
            .field("now", &self.harness.now)
            .field("violation", &self.violation)
            .finish_non_exhaustive()
    }
}

impl<S: Substrate> Stepper<S> {
    /// A builder over `substrate` with the defaults: [`default_shape`],
    /// adversarial mode, default header, the real driver.
    pub fn builder(substrate: S) -> StepperBuilder<'static, S> {
        StepperBuilder {
            substrate,
            factory: &cluster_driver,
            journal: InMemoryJournal::boxed(),
            recovery: Rc::new(recover_cluster_driver),
            shape: default_shape(),
            header: TraceHeader::default(),
            options: RunOptions::new(Mode::Adversarial),
        }
    }

    /// Shorthand for `Stepper::builder(substrate).shape(shape).mode(mode).build()`.
    ///
    /// # Errors
    /// As [`StepperBuilder::build`].
    pub fn new(substrate: S, shape: ClusterShape, mode: Mode) -> Result<Self, BuildError> {
        Stepper::builder(substrate).shape(shape).mode(mode).build()
    }

    /// Runs `f` on the harness under `catch_unwind`; a panic becomes a G13
    /// violation at the current phase. Records the first violation.
    fn guarded(
        &mut self,
        f: impl FnOnce(&mut Harness<S>) -> Result<(), Violation>,
    ) -> Result<(), Violation> {
        if let Some(violation) = &self.violation {
            return Err(violation.clone());
        }
        let harness = &mut self.harness;
        let result = match catch_unwind(AssertUnwindSafe(|| f(harness))) {
            Ok(result) => result,
            Err(payload) => Err(Violation {
                guarantee: GuaranteeId::ErrorsNotPanics,
                phase: self.harness.phase,
                detail: format!("a step panicked: {}", panic_text(payload.as_ref())),
            }),
        };
        if let Err(violation) = &result {
            self.violation = Some(violation.clone());
        }
        result
    }

    /// Applies one input, settles the machine (folds every result,
    /// observation and due timeout, drives until blocked) and runs the
    /// oracle's checks, exactly as a whole-trace run does for that input.
    ///
    /// # Errors
    /// The first guarantee found broken, naming its id
    /// ([`Violation::guarantee`]); also returned for every later step.
    pub fn step(&mut self, input: &Input) -> Result<StepReport, Violation> {
        let index = self.harness.steps;
        let calls_before = self.harness.calls.len();
        self.guarded(|harness| harness.input(input))?;
        self.tail_is_current = false;
        Ok(StepReport {
            index,
            calls: self.harness.calls[calls_before..].to_vec(),
            now: self.harness.now,
        })
    }

    /// Applies `inputs` in order, stopping at the first violation.
    ///
    /// # Errors
    /// As [`Stepper::step`].
    pub fn steps<'i>(
        &mut self,
        inputs: impl IntoIterator<Item = &'i Input>,
    ) -> Result<(), Violation> {
        for input in inputs {
            self.step(input)?;
        }
        Ok(())
    }

    /// Runs the fair-scheduler tail now, whatever the mode: the end-of-inputs
    /// forced pass (G19), then faults stop for good, hung calls are released,
    /// all work runs, every result is delivered and time advances to each
    /// stored deadline, for at most [`FAIR_ROUNDS_MAX`](super::FAIR_ROUNDS_MAX)
    /// rounds — with G21–G24 checked as in fair mode.
    ///
    /// Steps may follow (scripted faults are refused from now on); the tail
    /// may be run again. When the run already has a violation, nothing runs
    /// and the outcome carries it.
    pub fn run_fair_tail(&mut self) -> TailOutcome {
        if self.violation.is_none() {
            let _ = self.guarded(|harness| {
                harness.end_of_inputs()?;
                harness.fair_tail()
            });
            self.tail_is_current = true;
        }
        let harness = &self.harness;
        let (pending, pending_description) =
            pending(harness.driver.state(), harness.driver.desired());
        TailOutcome {
            converged: harness.converged,
            edges_reached: harness.edges_reached,
            rounds: harness.tail_rounds,
            new_attempts: harness.tail_new_attempts,
            pending,
            pending_description,
            desired: self.desired_shape(),
            violation: self.violation.clone(),
        }
    }

    /// Ends the run as [`run_trace`](super::run_trace) does after the last
    /// input — the end-of-inputs forced pass and, in fair mode, the fair tail
    /// (unless [`Stepper::run_fair_tail`] ran after the last step) — and
    /// returns its outcome: violation, vacuity, digest, convergence.
    pub fn finish(mut self) -> RunOutcome {
        if self.violation.is_none() && !self.tail_is_current {
            if self.harness.options.mode == Mode::Fair {
                self.run_fair_tail();
            } else {
                let _ = self.guarded(Harness::end_of_inputs);
            }
        }
        let narration = std::mem::take(&mut self.harness.narration);
        self.harness.finish(self.violation, narration)
    }

    /// The first violation found, if any.
    pub fn violation(&self) -> Option<&Violation> {
        self.violation.as_ref()
    }

    /// The run's mode.
    pub fn mode(&self) -> Mode {
        self.harness.options.mode
    }

    /// How many inputs were applied successfully.
    pub fn step_count(&self) -> usize {
        self.harness.steps
    }

    /// The harness clock.
    pub fn now(&self) -> Timestamp {
        self.harness.now
    }

    /// The driver's observed state (nodes, pending operations, facts).
    pub fn state(&self) -> &ClusterState {
        self.harness.driver.state()
    }

    /// The desired state the driver holds.
    pub fn desired(&self) -> &DesiredState {
        self.harness.driver.desired()
    }

    /// The latest desired shape the harness submitted (at its generation).
    pub fn desired_shape(&self) -> ClusterShape {
        self.harness.model.shape(self.harness.generation)
    }

    /// Whether the driver reports convergence on its desired shape.
    pub fn is_converged(&self) -> bool {
        self.harness.driver.is_converged()
    }

    /// When the driver next wants a pass, if ever.
    pub fn requeue_at(&self) -> Option<Timestamp> {
        self.harness.driver.requeue_at()
    }

    /// The counters of the current executor (started, completed, expired,
    /// late dropped…); a crash starts a new executor at zero.
    pub fn executor_counters(&self) -> ExecutorCounters {
        self.harness.executor.counters()
    }

    /// What the host holds besides the driver, in `Debug` text, for the
    /// explorer's state fingerprint (G31): the executor's ledger and untaken
    /// results, the operator limits, whether a crash is armed, the host's
    /// orphan suspects and next scan, the oracle's orphan sample, the
    /// operations [`Input::Resubmit`] can pick (newest first) and the
    /// `deliveries` most recent deliveries [`Input::Redeliver`] repeats.
    pub fn host_ledger(&self, deliveries: usize) -> String {
        let harness = &self.harness;
        let watch = &harness.executor_watch;
        let resubmittable: Vec<_> = (watch.recent.iter().rev())
            .filter(|op| !watch.retired.contains(&op.attempt()))
            .map(|op| (op.id, &op.request))
            .collect();
        let recent: Vec<_> = harness.history.iter().rev().take(deliveries).collect();
        let durable = &harness.durable;
        format!(
            "{:?}|{:?}|{}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}",
            harness.executor.ledger(),
            harness.limits,
            durable.crash_armed,
            durable.recovered_ambiguous,
            durable.suspects,
            durable.next_scan_at,
            durable.observed_orphans,
            resubmittable,
            recent
        )
    }

    /// The resources the substrate's ledger says are live now.
    pub fn live_resources(&self) -> LiveResources {
        self.harness.substrate.live_resources()
    }

    /// The substrate's counters (adoptions, creations, hangs, faults applied).
    pub fn substrate_counters(&self) -> SubstrateCounters {
        self.harness.substrate.counters()
    }

    /// The substrate, to read its own state.
    pub fn substrate(&self) -> &S {
        &self.harness.substrate
    }

    /// The vacuity counts so far (what [`RunOutcome::vacuity`] would say now).
    pub fn vacuity(&self) -> Vacuity {
        self.harness.vacuity_so_far()
    }

    /// Every backend call started so far, in start order.
    pub fn calls(&self) -> &[CallRecord] {
        &self.harness.calls
    }

    /// Whether attempt exhaustion or clock saturation was reached.
    pub fn edges_reached(&self) -> bool {
        self.harness.edges_reached
    }

    /// The narration so far (one line per step, when asked for).
    pub fn narration(&self) -> &[String] {
        &self.harness.narration
    }

    /// What identifies the run so far (G18): every call, the state, the
    /// live resources and the step count. Equal to [`RunOutcome::digest`]
    /// when taken after [`Stepper::finish`]'s work.
    pub fn digest(&self) -> RunDigest {
        self.harness.digest()
    }

    /// The per-slot shape of the cluster now (spec, stage, readiness,
    /// intent), as the confluence check (G20) compares it.
    pub fn node_shapes(&self) -> BTreeMap<LogicalNodeId, NodeShape> {
        self.harness.node_shapes()
    }
}

/// The slots keeping `state` from converging on `desired`, and their
/// description.
fn pending(state: &ClusterState, desired: &DesiredState) -> (Vec<LogicalNodeId>, String) {
    let mut slots: Vec<LogicalNodeId> = desired
        .specs()
        .filter(|spec| {
            !state
                .nodes
                .get(spec.id())
                .is_some_and(|node| node.is_ready() && node.spec == *spec && node.pending.is_none())
        })
        .map(|spec| spec.id().clone())
        .collect();
    slots.extend(
        state
            .nodes
            .keys()
            .filter(|id| !desired.contains(id))
            .cloned(),
    );
    (slots, crate::oracle::describe_pending(state, desired))
}
