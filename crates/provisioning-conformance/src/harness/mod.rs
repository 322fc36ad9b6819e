//! The harness: folds a trace into a real driver, executor and substrate,
//! and runs the oracle as it goes.
//!
//! The harness plays the host. It owns the clock, arms one timer at the
//! driver's `requeue_at` (so it wakes exactly at every stored deadline on the
//! way through a tick), folds executor results, observations and operation
//! timeouts, and calls `drive_until_blocked` until the machine settles —
//! within [`MAX_SETTLE_ROUNDS`]; not settling is reported as a livelock.
//!
//! A run has a [`Mode`]: adversarial (the trace, faults to the end, safety
//! checks only) or fair (the same trace, then a fair-scheduler tail in which
//! faults stop, hung work is released, every queued result is delivered and
//! time advances — and the cluster must converge).
//!
//! [`Stepper`] is the harness one input at a time, from any [`Substrate`]
//! and any initial [`ClusterShape`]: the oracle checks after each
//! [`Stepper::step`], and between steps the driver's state, the desired
//! shape, the executor's counters, the substrate's ledger and the vacuity
//! counts can be read; [`Stepper::run_fair_tail`] runs the fair tail on
//! demand. [`run_trace`] is a stepper stepped through a whole trace from
//! [`default_shape`], so both share one code path.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::rc::Rc;

use provisioning::driver::DriverError;
use provisioning::id::AttemptAllocator;
use provisioning::{
    ClusterDriver, ClusterShape, ClusterState, ExecutorResult, Generation,
    IdempotentEffectExecutor, Intent, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeStage,
    Observation, OperationId, RetryPolicy, RunId, Timestamp,
};

use crate::driver_under_test::DriverUnderTest;
use crate::guarantee::{GuaranteeId, Phase, Violation};
use crate::journal::{KitJournal, RecoveryFactory};
use crate::oracle;
use crate::substrate::{CallRecord, LiveResources, Substrate};
use crate::trace::{Trace, WorkStep};

/// The most settle rounds (fold everything, drive) after one input before
/// the harness declares a livelock.
pub const MAX_SETTLE_ROUNDS: usize = 64;

/// The most host wake-ups inside one clock tick; past it the host coalesces
/// the remaining wake-ups into one at the end of the tick.
pub const MAX_WAKES_PER_TICK: usize = 256;

/// The most rounds of the fair tail. Each round delivers all work and then
/// advances the clock to the next stored deadline. A round in which nothing
/// happened (no work ran, and the driver's state is what it was when the
/// previous round ended) does not count: a driver may wake its held nodes
/// once per breaker cool-down while another node waits out a longer
/// backoff, and a cool-down of a millisecond makes those wakes many.
pub const FAIR_ROUNDS_MAX: usize = 64;

/// The most rounds of the fair tail, idle ones included.
pub const FAIR_ROUNDS_IDLE_MAX: usize = 8192;

/// The most work/deliver iterations inside one fair-tail round.
pub const FAIR_INNER_MAX: usize = 32;

/// How many deliveries the harness remembers for
/// [`Input::Redeliver`](crate::trace::Input::Redeliver).
pub const MAX_HISTORY: usize = 64;

/// A forced pass (G19) runs after every this many inputs, and at the end.
pub const QUIESCENCE_PROBE_PERIOD: usize = 4;

/// The run id every harness run uses.
pub const RUN_NAME: &str = "conformance";

/// The provider kind of every group in the harness's shapes.
pub const PROVIDER_KIND: &str = "fake";

/// How a trace is run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// Faults to the end; safety guarantees only.
    Adversarial,
    /// The trace, then a fair-scheduler tail that must converge (G21–G23).
    Fair,
}

impl Mode {
    /// Both modes, in battery order.
    pub const ALL: [Mode; 2] = [Mode::Adversarial, Mode::Fair];

    /// The mode's name in reports and on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Adversarial => "adversarial",
            Mode::Fair => "fair",
        }
    }

    /// The mode named `text`, if any.
    pub fn from_name(text: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == text)
    }
}

/// What the harness passes to a driver factory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverSetup {
    /// The run.
    pub run_id: RunId,
    /// The retry policy (jitter from the trace header).
    pub policy: RetryPolicy,
    /// An attempt-id limit from the trace header, if any.
    pub attempt_limit: Option<u64>,
}

/// Builds the driver under test for one run.
pub type DriverFactory = dyn Fn(&DriverSetup) -> Result<Box<dyn DriverUnderTest>, DriverError>;

/// The default factory: a real [`ClusterDriver`] with an empty shape at
/// generation 0 and the setup's attempt limit.
///
/// # Errors
/// [`DriverError::InvalidShape`] when the run name is invalid.
pub fn cluster_driver(setup: &DriverSetup) -> Result<Box<dyn DriverUnderTest>, DriverError> {
    let desired = ClusterShape::empty(setup.run_id.clone(), Generation::new(0)).validate()?;
    let state = ClusterState {
        attempts: match setup.attempt_limit {
            Some(limit) => AttemptAllocator::with_limit(1, limit),
            None => AttemptAllocator::new(),
        },
        ..ClusterState::default()
    };
    Ok(Box::new(ClusterDriver::with_state(
        desired,
        state,
        setup.policy,
    )))
}

/// Options of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunOptions {
    /// The mode.
    pub mode: Mode,
    /// In which order the fair tail runs queued work (G20 compares orders).
    pub tail_order: WorkStep,
    /// Whether to keep a step-by-step narration for reports.
    pub narrate: bool,
    /// How the harness host journals and collects orphans (default: the
    /// correct host).
    pub host: HostOptions,
}

impl RunOptions {
    /// A run in `mode`, FIFO tail, no narration, the correct host.
    pub fn new(mode: Mode) -> Self {
        RunOptions {
            mode,
            tail_order: WorkStep::Fifo,
            narrate: false,
            host: HostOptions::default(),
        }
    }
}

/// How often each interesting situation was reached (the vacuity check).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Vacuity {
    /// A create or start adopted a resource an earlier ambiguous call left.
    pub adoptions_after_ambiguity: u64,
    /// An operation timeout was folded.
    pub timeouts: u64,
    /// A slot got a fresh attempt replacing an old one.
    pub replacements: u64,
    /// A node began deletion because its slot was no longer desired.
    pub scale_downs: u64,
    /// A cleanup step was dispatched again after a failed one.
    pub cleanup_retries: u64,
    /// An endpoint lookup answered "not ready yet".
    pub endpoint_probes: u64,
    /// A late or duplicate result was discarded (by the executor or the driver).
    pub late_results_discarded: u64,
    /// A ready node was lost.
    pub ready_node_losses: u64,
    /// Attempt exhaustion or clock saturation was reached (informational).
    pub edges_reached: u64,
    /// The controller crashed and was recovered from its journal.
    pub crashes: u64,
    /// A create or bootstrap start that recovery made ambiguous was
    /// re-issued and adopted what the dead controller's call had made.
    pub adoptions_after_recovery: u64,
    /// An orphan (a live resource no current attempt owns) was destroyed.
    pub orphans_collected: u64,
    /// A first create started with its provider's cap reached afterwards.
    pub cap_reached: u64,
    /// A ready drifted node waited while its group's rollout budget was
    /// spent (the driver's count, informational).
    pub budget_held: u64,
    /// A ready drifted node of a group under a rollout budget was taken down
    /// for its replacement (the kit's own count, from the state before and
    /// after a pass: a budget that never lets a replacement through leaves
    /// it at zero).
    pub budget_rollouts: u64,
    /// A group's breaker opened (the kit's own count, from its model of the
    /// breakers: a driver that never counts failures leaves it at zero
    /// only if the battery never failed enough attempts).
    pub breakers_opened: u64,
    /// An open breaker let its probe attempt through after the cool-down
    /// (the kit's own count).
    pub breaker_probes: u64,
    /// A `resume` input closed an open breaker (the driver said it was open
    /// and the kit saw it closed).
    pub breakers_resumed: u64,
    /// A submission waited behind an older operation of its attempt that
    /// was still running (the executor answered "queued"; informational).
    pub queued_submissions: u64,
    /// A queued operation that never reached the backend was overtaken by
    /// a newer one of its attempt the executor started or queued (the
    /// kit's count of skips at a submission; informational).
    pub skipped_at_submission: u64,
    /// A queued operation that never reached the backend expired through
    /// the executor (the kit's count of skips at an expiry; informational).
    pub skipped_at_expiry: u64,
    /// The host's sink refused an operation
    /// ([`Input::Refuse`](crate::trace::Input::Refuse); informational).
    pub refusals: u64,
    /// An operation was handed to the executor a second time
    /// ([`Input::Resubmit`](crate::trace::Input::Resubmit); informational).
    pub resubmissions: u64,
    /// A node recovered as ready had its agent's re-join folded into the
    /// new controller (G37; informational).
    pub rejoined_after_recovery: u64,
    /// A node recovered as ready was lost when its rejoin window ended with
    /// no re-join (G37; informational).
    pub rejoin_windows_expired: u64,
    /// Runs whose substrate survives a controller crash; the three counts
    /// above are required only when some run's did.
    pub crash_capable_runs: u64,
}

impl Vacuity {
    /// The counts the battery requires to be non-zero, by name. The crash
    /// counts are required only when some run's substrate survives a
    /// controller crash.
    pub fn required(&self) -> Vec<(&'static str, u64)> {
        let mut required = vec![
            ("adoption after ambiguity", self.adoptions_after_ambiguity),
            ("timeout", self.timeouts),
            ("replacement", self.replacements),
            ("scale-down", self.scale_downs),
            ("cleanup retry", self.cleanup_retries),
            ("endpoint probe", self.endpoint_probes),
            ("late result discarded", self.late_results_discarded),
            ("ready-node loss", self.ready_node_losses),
        ];
        if self.crash_capable_runs > 0 {
            required.extend([
                ("crash", self.crashes),
                ("adoption after recovery", self.adoptions_after_recovery),
                ("orphan collected", self.orphans_collected),
            ]);
        }
        required
    }

    /// The operator-limit counts (design §15, G29/G30), by name. Reported by
    /// every battery; required (non-zero) by Level 1's battery, whose 512
    /// traces reach them all, and not by the small real-engine batteries of
    /// Levels 2 and 3.
    pub fn limits(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("cap reached", self.cap_reached),
            ("budget held a replacement back", self.budget_held),
            ("budget let a replacement through", self.budget_rollouts),
            ("breaker opened", self.breakers_opened),
            ("breaker probe", self.breaker_probes),
            ("breaker resumed", self.breakers_resumed),
        ]
    }

    /// Counts reported by every battery and required by none.
    pub fn informational(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("resubmission", self.resubmissions),
            ("queued submission", self.queued_submissions),
            ("skipped at a submission", self.skipped_at_submission),
            ("skipped at an expiry", self.skipped_at_expiry),
            ("refused submission", self.refusals),
            ("rejoined after recovery", self.rejoined_after_recovery),
            ("rejoin window expired", self.rejoin_windows_expired),
        ]
    }

    /// Adds `other` to `self`.
    pub fn add(&mut self, other: &Vacuity) {
        self.adoptions_after_ambiguity += other.adoptions_after_ambiguity;
        self.timeouts += other.timeouts;
        self.replacements += other.replacements;
        self.scale_downs += other.scale_downs;
        self.cleanup_retries += other.cleanup_retries;
        self.endpoint_probes += other.endpoint_probes;
        self.late_results_discarded += other.late_results_discarded;
        self.ready_node_losses += other.ready_node_losses;
        self.edges_reached += other.edges_reached;
        self.crashes += other.crashes;
        self.adoptions_after_recovery += other.adoptions_after_recovery;
        self.orphans_collected += other.orphans_collected;
        self.crash_capable_runs += other.crash_capable_runs;
        self.cap_reached += other.cap_reached;
        self.budget_held += other.budget_held;
        self.budget_rollouts += other.budget_rollouts;
        self.breakers_opened += other.breakers_opened;
        self.breaker_probes += other.breaker_probes;
        self.breakers_resumed += other.breakers_resumed;
        self.resubmissions += other.resubmissions;
        self.queued_submissions += other.queued_submissions;
        self.skipped_at_submission += other.skipped_at_submission;
        self.skipped_at_expiry += other.skipped_at_expiry;
        self.refusals += other.refusals;
        self.rejoined_after_recovery += other.rejoined_after_recovery;
        self.rejoin_windows_expired += other.rejoin_windows_expired;
    }
}

/// What identifies a run's outcome for the determinism check (G18).
#[derive(Clone, Debug, PartialEq)]
pub struct RunDigest {
    /// Every backend call, in start order.
    pub calls: Vec<CallRecord>,
    /// The final observed state.
    pub state: ClusterState,
    /// The final live resources.
    pub live: LiveResources,
    /// How many inputs were applied.
    pub steps: usize,
}

/// A node's converged shape, for the confluence check (G20): what must not
/// depend on the order in which independent work completed.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeShape {
    /// The node's spec.
    pub spec: LogicalNodeSpec,
    /// The stage.
    pub stage: NodeStage,
    /// Whether it is ready.
    pub ready: bool,
    /// Its intent.
    pub intent: Intent,
}

/// The result of one run.
#[derive(Clone, Debug)]
pub struct RunOutcome {
    /// The first guarantee found broken, if any.
    pub violation: Option<Violation>,
    /// Vacuity counts of this run.
    pub vacuity: Vacuity,
    /// The run's digest.
    pub digest: RunDigest,
    /// Whether the fair tail converged (fair mode only).
    pub converged: bool,
    /// Whether attempt exhaustion or clock saturation was reached, which
    /// waives the convergence checks.
    pub edges_reached: bool,
    /// Whether the substrate promised reproducible runs (G18 and G20 apply).
    pub deterministic: bool,
    /// The converged cluster's shape per slot (fair mode, when converged).
    pub converged_shape: Option<BTreeMap<LogicalNodeId, NodeShape>>,
    /// A step-by-step narration, when asked for.
    pub narration: Vec<String>,
}

/// Runs `trace` against a fresh `substrate` and the driver `factory` builds,
/// from the kit's initial shape ([`default_shape`]: group `a` with two nodes).
///
/// This is [`Stepper`] run to the end: build, one [`Stepper::step`] per
/// input until the first violation, then [`Stepper::finish`].
///
/// # Guarantees
/// Never panics because of the driver, executor or backend: a panic escaping
/// any of them is reported as a G13 violation. Bounded: every loop inside has
/// a named limit, and hitting a settle limit is reported as a livelock.
pub fn run_trace<S: Substrate>(
    substrate: S,
    factory: &DriverFactory,
    trace: &Trace,
    options: RunOptions,
) -> RunOutcome {
    let builder = Stepper::builder(substrate)
        .driver(factory)
        .header(trace.header.clone())
        .options(options);
    run_built(builder, trace)
}

/// Builds the stepper and runs `trace` through it to the end.
pub(crate) fn run_built<S: Substrate>(builder: StepperBuilder<'_, S>, trace: &Trace) -> RunOutcome {
    let mut stepper = match builder.build() {
        Ok(stepper) => stepper,
        Err(error) => {
            let violation = match error {
                BuildError::Setup(violation) => violation,
                BuildError::InvalidShape(error) => Violation {
                    guarantee: GuaranteeId::ErrorsNotPanics,
                    phase: Phase::Setup,
                    detail: format!("the kit's initial shape is invalid: {error}"),
                },
            };
            return RunOutcome {
                violation: Some(violation),
                vacuity: Vacuity::default(),
                digest: RunDigest {
                    calls: Vec::new(),
                    state: ClusterState::default(),
                    live: LiveResources::default(),
                    steps: 0,
                },
                converged: false,
                edges_reached: false,
                deterministic: false,
                converged_shape: None,
                narration: Vec::new(),
            };
        }
    };
    for input in &trace.inputs {
        if stepper.step(input).is_err() {
            break;
        }
    }
    stepper.finish()
}

/// The text of a panic's payload, for reports.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "non-text panic payload".to_owned()
    }
}

mod breaker;
mod clock;
mod durable;
mod host;
mod model;
mod stepper;
mod tail;

use durable::{ControllerBackend, DurableSide};
pub use durable::{DEFAULT_ORPHAN_GRACE, DEFAULT_ORPHAN_SCAN_INTERVAL, HostOptions, HostOrder};
use model::ShapeModel;
pub use stepper::{
    BuildError, StepReport, Stepper, StepperBuilder, TailOutcome, default_shape, kit_template,
};

/// What the harness host handed to the executor, for the checks on what the
/// executor publishes and for [`Input::Resubmit`](crate::trace::Input::Resubmit).
#[derive(Debug, Default)]
struct ExecutorWatch {
    recent: VecDeque<provisioning::Operation>,
    submitted: BTreeSet<OperationId>,
    expired: BTreeSet<OperationId>,
    retired: BTreeSet<NodeAttemptId>,
    /// Attempts whose convergence report was acknowledged (at most one per
    /// session).
    convergence_reported: BTreeSet<NodeAttemptId>,
    /// Attempts whose session the kit reported joined (or converged), by a
    /// stream event the driver folded.
    joined: BTreeSet<NodeAttemptId>,
    /// Operations the live controller's executor accepted, and those whose
    /// result it published: an accepted operation without a published
    /// result is still in its hands.
    accepted_here: BTreeSet<OperationId>,
    published_here: BTreeSet<OperationId>,
    /// Submissions the live controller's executor answered as queued
    /// behind an older operation of their attempt.
    queued_here: u64,
    /// Submissions it answered by replaying a kept result.
    replayed_here: u64,
    /// Results the harness took from it (completions and replays).
    taken_here: u64,
    /// Operations it answered as started whose call the kit has not yet
    /// seen reach the backend: once no work is runnable, each of these
    /// was skipped.
    awaiting_call: BTreeSet<OperationId>,
    /// The latest operation of each attempt it answered as queued, while
    /// the kit has seen it neither reach the backend nor expire through
    /// the executor: it still waits behind the attempt's older operation.
    waiting_behind: BTreeMap<NodeAttemptId, OperationId>,
    /// Operations it must have skipped when a newer one of their attempt
    /// was submitted: it answered the newer one as started or queued while
    /// the older one still waited, so the older one can never reach the
    /// backend.
    skipped_at_submission: u64,
    /// Operations it must have skipped when they expired through it while
    /// they waited behind an older one: they can never reach the backend.
    skipped_at_expiry: u64,
    /// Operations it answered as started or queued whose call the kit has
    /// not seen reach the backend: only these can have been skipped.
    uncalled: BTreeSet<OperationId>,
    /// How many times it said a result was ready to be taken.
    notified: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Submissions handed to it so far, to take turns between its
    /// inherent `submit` and its two `OperationSink` faces.
    submissions: u64,
}

/// What the kit saw the live driver do, to hold its counters to (G04,
/// count form): drives' passes, operations its sink received, folds the
/// driver accepted and rejected, timeouts it folded.
#[derive(Debug, Default, Clone, Copy)]
struct DriverCounts {
    passes: u64,
    dispatched: u64,
    refused: u64,
    folded: u64,
    rejected: u64,
    timeouts: u64,
}

impl DriverCounts {
    /// Counts one fold call's outcome (`timeout`: an `operation_timed_out`).
    fn fold(&mut self, outcome: &Result<(), DriverError>, timeout: bool) {
        match outcome {
            Ok(()) => {
                self.folded += 1;
                if timeout {
                    self.timeouts += 1;
                }
            }
            Err(DriverError::Rejected(_)) => self.rejected += 1,
            Err(_) => {}
        }
    }
}

/// How many transitions per node the harness asks the driver to keep: few,
/// so that dropping the oldest entry is exercised too.
const HISTORY_DEPTH: usize = 3;

/// The kit's watch on the driver's node histories (G32, history form).
#[derive(Debug, Default)]
struct HistoryWatch {
    /// Entries the driver keeps per node; 0 when it keeps no history.
    depth: usize,
    /// The driver was told to keep no history (depth 0) and can be: then
    /// it must keep none at all.
    keeps_none: bool,
    /// Each node's condition when the controller started: histories are
    /// not journaled, so a recovered node has none until it changes.
    at_start: BTreeMap<LogicalNodeId, oracle::Condition>,
    /// The nodes present at the last check.
    seen: BTreeSet<LogicalNodeId>,
    /// Attempts whose teardown entry was judged (when it first appeared).
    teardowns_judged: BTreeSet<NodeAttemptId>,
}

impl HistoryWatch {
    /// Asks a freshly built or recovered `driver` to keep `wanted` entries
    /// of history per node (0: none), and notes where its nodes start.
    fn start(driver: &mut dyn DriverUnderTest, wanted: usize) -> Self {
        let supported = driver.set_history_depth(wanted);
        let depth = if supported { wanted } else { 0 };
        let state = driver.state();
        HistoryWatch {
            depth,
            keeps_none: supported && wanted == 0,
            at_start: state
                .nodes
                .iter()
                .map(|(id, node)| (id.clone(), oracle::condition(node)))
                .collect(),
            seen: state.nodes.keys().cloned().collect(),
            teardowns_judged: BTreeSet::new(),
        }
    }
}

#[derive(Clone, Debug)]
enum Delivery {
    Result(ExecutorResult),
    Observation(Observation),
}

/// The host the harness plays: everything one run holds. [`Stepper`] is its
/// public face.
struct Harness<S: Substrate> {
    substrate: S,
    executor: IdempotentEffectExecutor<ControllerBackend<S::Backend>>,
    driver: Box<dyn DriverUnderTest>,
    setup: DriverSetup,
    journal: Box<dyn KitJournal>,
    recovery: Rc<RecoveryFactory>,
    durable: DurableSide,
    options: RunOptions,
    strict_calls: bool,
    phase: Phase,
    now: Timestamp,
    model: ShapeModel,
    /// The desired slots of the latest submitted shape, from `model`.
    slots: oracle::DesiredSlots,
    /// Every attempt id seen in the run (G01).
    attempts: oracle::AttemptsSeen,
    /// The kit's own count of consecutive failures per slot: carried into
    /// a replacement, reset when the slot's node becomes ready (G09).
    failures: BTreeMap<LogicalNodeId, u32>,
    /// The executor seen from outside: the operations handed to it (most
    /// recent last, for `resubmit`), every id handed to it, the ids it
    /// expired, and the attempts retired from it.
    executor_watch: ExecutorWatch,
    /// A pass after every single delivery
    /// ([`TraceHeader::interleave`](crate::trace::TraceHeader::interleave)).
    interleave: bool,
    generation: u64,
    history: VecDeque<Delivery>,
    timed_out: BTreeSet<OperationId>,
    ever_pending: BTreeSet<OperationId>,
    newest_call: BTreeMap<NodeAttemptId, OperationId>,
    highest_attempt: Option<NodeAttemptId>,
    highest_generation: Option<u64>,
    cleanup_failed: BTreeSet<NodeAttemptId>,
    calls: Vec<CallRecord>,
    vacuity: Vacuity,
    /// The limits the trace set, as the kit models them (the oracle's G29
    /// checks read these, never the driver's).
    limits: provisioning::Limits,
    /// Armed `refuse` inputs, for the next drives' sinks.
    refusals: Vec<Option<provisioning::EffectKind>>,
    /// While the refusals of a drive are folded in the kit's models: a
    /// later one of the same group is still to come.
    more_refusals_to_fold: bool,
    history_watch: HistoryWatch,
    /// The kit's own model of each group's breaker (G30, hold form).
    breaker_watch: breaker::BreakerWatch,
    /// Whether the driver is told to keep no history once set up (the
    /// `late-close` runs, a quarter of the seeds): what it kept must go,
    /// and nothing be kept after.
    history_off: bool,
    /// The kit's count of what the live driver did (G04, count form).
    driver_counts: DriverCounts,
    /// Drives so far: every second one runs its passes one at a time,
    /// split into plan and application, when the driver can (G19, pass
    /// plan form).
    drives: u64,
    /// Whether the next pass must be full: something asked for one since
    /// the last pass (`None` when the kit cannot know).
    full_expected: Option<bool>,
    edges_reached: bool,
    converged: bool,
    tail_rounds: usize,
    tail_new_attempts: u64,
    steps: usize,
    narration: Vec<String>,
    /// What G35 remembers between the peers updates the host hands out.
    membership: oracle::MembershipWatch,
}

/// A one-line description of every node, for narrations and reports.
pub(crate) fn summarize(state: &ClusterState) -> String {
    if state.nodes.is_empty() {
        return "no nodes".to_owned();
    }
    state
        .nodes
        .iter()
        .map(|(id, node)| oracle::describe_node(id, node))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeSubstrate;

    fn run(trace: &str, mode: Mode) -> RunOutcome {
        let trace: Trace = trace.parse().unwrap();
        run_trace(
            FakeSubstrate::new(),
            &cluster_driver,
            &trace,
            RunOptions::new(mode),
        )
    }

    #[test]
    fn extreme_headers_give_errors_and_no_violation() {
        let config = crate::generate::GeneratorConfig {
            min_inputs: 24,
            max_inputs: 24,
            edges_per_mille: 0,
            executor_inputs_per_mille: 0,
            interleave_per_mille: 0,
            late_close_per_mille: 0,
        };
        let limits = [Some(0), Some(1), Some(2), None];
        let clocks = [0, u64::MAX, u64::MAX - 1, u64::MAX - 30_000];
        for (index, (limit, clock)) in limits
            .into_iter()
            .flat_map(|l| clocks.map(|c| (l, c)))
            .enumerate()
        {
            let mut trace = crate::generate::generate(index as u64, &config);
            trace.header.attempt_limit = limit;
            trace.header.clock_start_ms = clock;
            trace.header.jitter_per_mille = 1000;
            for mode in Mode::ALL {
                let outcome = run_trace(
                    FakeSubstrate::new(),
                    &cluster_driver,
                    &trace,
                    RunOptions::new(mode),
                );
                assert_eq!(outcome.violation, None, "{trace}");
                if limit.is_some() || clock > 0 {
                    assert!(outcome.edges_reached || outcome.converged, "{trace}");
                }
            }
        }
    }

    #[test]
    fn an_empty_trace_converges_in_the_fair_tail() {
        let outcome = run("", Mode::Fair);
        assert_eq!(outcome.violation, None);
        assert!(outcome.converged);
        assert_eq!(outcome.digest.state.nodes.len(), 2);
        assert_eq!(outcome.digest.live.leases.len(), 2);
    }

    #[test]
    fn a_plain_bring_up_converges_inside_the_trace() {
        let outcome = run(
            "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; run fifo",
            Mode::Adversarial,
        );
        assert_eq!(outcome.violation, None);
        assert!(
            outcome.digest.state.nodes.values().all(|n| n.is_ready()),
            "{}",
            summarize(&outcome.digest.state)
        );
    }
}
