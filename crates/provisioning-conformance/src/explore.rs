//! Exhaustive exploration of small clusters (G31): breadth-first over every
//! interleaving of a finite input alphabet, up to a depth.
//!
//! The explorer drives the real driver, executor and a [`Substrate`] through
//! the kit's [`Stepper`]. A stepper cannot be cloned (it owns a driver, an
//! executor and backend tasks), so every state is reached by replaying its
//! input sequence from a fresh stepper; breadth-first order makes the first
//! violating sequence found a shortest one. States are deduplicated by a
//! hash of the observed state, the desired shape, the clock, the backend's
//! ledger (live resources, queued work, waiting scripted replies) and the
//! host's and executor's ledger ([`fingerprint`]).
//!
//! # What "every interleaving to depth D" means
//!
//! An exploration is fixed by an [`ExploreConfig`]: the nodes (1 or 2), a
//! trace header ([`ExploreConfig::header`]), operator limits
//! ([`ExploreConfig::limits`]), a start configuration ([`Start`]) and the
//! depth D. Together the first three give one fixed *setup prefix*
//! ([`ExploreConfig::setup`]):
//!
//! | start | setup prefix (after `desire scale a 1` for one node, then `limit …` for each limit) |
//! |---|---|
//! | [`Start::Fresh`] | nothing: the first pass has submitted the creates, no call has run |
//! | [`Start::Ready`] | `run fifo` ×3, `stream @i joined` for each node, `run fifo`: converged |
//! | [`Start::HeldCreateCrash`] | `script create-lease hang; crash; run fifo`: recovered, a dead controller's create still held |
//!
//! The prefix is checked by the oracle like any input but not branched
//! over. From the state it reaches, the explorer applies every sequence of
//! at most D inputs of the [`alphabet`] (computed at each state; only the
//! clock jump depends on the state), except that a sequence is not extended
//! past a state whose fingerprint an earlier (no longer) sequence already
//! reached. At every distinct state: the oracle's safety checks ran on
//! every step to it (each [`Stepper::step`] runs them); the three revision
//! probes are applied one after the other ([`ExploreConfig::revision_probes`];
//! not branched on, because the oracle requires a probe to leave the
//! driver's state and desired state unchanged, so a passing probe's
//! successor is its parent but for the harness's input count); and, with
//! [`ExploreConfig::liveness`], the fair tail run from it — completing work
//! oldest-first, and newest-first as well with [`ExploreConfig::lifo_tail`] —
//! must converge (G21–G24, G28, G30). A counterexample's
//! [`Counterexample::length`] counts the inputs after the prefix; a
//! probe's counterexample at a state of depth D is D + 1 long.
//!
//! Not covered, whatever D: other prefixes (an exploration from
//! [`Start::Ready`] says nothing about a cluster that was brought up in
//! another order, or with faults); other headers and limit values; inputs
//! outside the alphabet (replies aimed at one call kind, other sessions
//! than the first live one, other drift fields, lease or workload losses,
//! other breaker settings, shape changes by more than one node); and
//! differences between two states that the fingerprint does not see (the
//! oracle's own bookkeeping is not in it, so two states the driver cannot
//! tell apart merge even if the oracle would check them differently).

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::rc::Rc;

use crate::battery::Regression;
use crate::driver_under_test::DriverUnderTest;
use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::{DriverFactory, DriverSetup, HostOptions, Mode, Stepper};
use crate::journal::RecoveryFactory;
use crate::substrate::{MAX_SCRIPTED_FAULTS, Substrate};
use crate::trace::{
    DriftField, Fault, FaultTarget, Group, Input, LimitChange, RevisionProbe, ShapeChange,
    StreamEvent, Trace, TraceHeader, WorkStep,
};
use provisioning::observe::LossCause;
use provisioning::state::BootstrapFailure;
use provisioning::{DriverError, EffectKind, OperationId};

/// How an exploration is bounded and what it checks.
#[derive(Clone, Debug)]
pub struct ExploreConfig {
    /// Nodes in the cluster: 1 or 2 (group `a`).
    pub nodes: u32,
    /// The longest input sequence explored (not counting the setup prefix).
    pub depth: usize,
    /// Whether to run the fair-tail liveness check from every distinct state.
    pub liveness: bool,
    /// An upper bound on distinct states, so a run stays bounded.
    pub max_states: usize,
    /// Whether states equal up to a renaming of ids merge (see
    /// [`normalise_ids`]); off only to measure what the renaming saves.
    pub normalise_ids: bool,
    /// Whether the alphabet has the executor-level inputs (`resubmit`,
    /// `confuse`) and a breaker limit; off only to compare with the
    /// smaller alphabet.
    pub executor_inputs: bool,
    /// Whether the liveness check also runs the fair tail completing work
    /// newest-first (as the battery's G20 run does), doubling its cost.
    pub lifo_tail: bool,
    /// Operator limits set before anything else, as a trace's first
    /// inputs (the kit's generator does the same for a quarter of its
    /// seeds): launch caps, rollout budgets, breakers. Part of the setup
    /// prefix, so not counted in the depth.
    pub limits: Vec<LimitChange>,
    /// The configuration the exploration starts from (see [`Start`]).
    pub start: Start,
    /// The trace header every explored sequence runs under (untidy
    /// interleavings, late session closes, …), as the kit's generator sets
    /// headers; counterexamples carry it.
    pub header: TraceHeader,
    /// Whether the revision probes (`revision regress|same|silent`) are
    /// applied at every distinct state. They are not branched on: the
    /// oracle requires a probe to change nothing in the driver (G16), so a
    /// probe that passes leads back to the state it started from.
    pub revision_probes: bool,
}

/// The configuration an exploration starts from. Whichever it is, the
/// exploration covers every interleaving of the alphabet to the depth
/// *from that configuration*, and nothing before it: the setup prefix
/// ([`ExploreConfig::setup`]) is one fixed input sequence, checked by the
/// oracle like any other but not branched over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Start {
    /// Nothing has run yet: the driver's first pass has submitted the
    /// creates, no backend call has started.
    #[default]
    Fresh,
    /// The cluster is up and converged: every create, lookup and start ran
    /// and every session joined and reported convergence (fault-free, oldest
    /// first). Bugs that need ready nodes (a drift under a rollout budget, a
    /// loss under a breaker, a replaced attempt's late result) are then a
    /// few inputs away instead of a dozen.
    Ready,
    /// The controller crashed while the first node's create was held in
    /// the backend (a scripted hang) and was recovered from its journal:
    /// that create is now a dead controller's call, still running, which
    /// may make a resource no current attempt owns when it is released
    /// (the cause of every orphan, G28). The recovered driver holds the
    /// create as ambiguous and waits out its backoff.
    HeldCreateCrash,
}

impl ExploreConfig {
    /// A configuration for `nodes` nodes to `depth` inputs, liveness on.
    pub fn new(nodes: u32, depth: usize) -> Self {
        ExploreConfig {
            nodes,
            depth,
            liveness: true,
            max_states: 1_000_000,
            normalise_ids: true,
            executor_inputs: true,
            lifo_tail: false,
            limits: Vec::new(),
            start: Start::Fresh,
            header: TraceHeader::default(),
            revision_probes: true,
        }
    }

    /// The same exploration from `start`.
    pub fn starting(mut self, start: Start) -> Self {
        self.start = start;
        self
    }

    /// The same exploration with `limit` set first.
    pub fn limit(mut self, limit: LimitChange) -> Self {
        self.limits.push(limit);
        self
    }

    /// The fixed input sequence every explored sequence starts with: the
    /// one-node scale-down ([`setup_prefix`]), the limits, then what
    /// [`Start`] needs.
    pub fn setup(&self) -> Vec<Input> {
        let mut prefix = setup_prefix(self.nodes);
        prefix.extend(self.limits.iter().map(|limit| Input::Limit(*limit)));
        match self.start {
            Start::Fresh => {}
            Start::Ready => {
                // Creates, lookups, starts; every session joins; the
                // convergence reports.
                prefix.extend([Input::Run(WorkStep::Fifo); 3]);
                prefix.extend((0..self.nodes).map(|session| Input::Stream {
                    session,
                    event: StreamEvent::Joined,
                }));
                prefix.push(Input::Run(WorkStep::Fifo));
            }
            Start::HeldCreateCrash => prefix.extend([
                Input::Script {
                    target: FaultTarget::Kind(EffectKind::CreateLease),
                    fault: Fault::Hang,
                },
                Input::Crash,
                Input::Run(WorkStep::Fifo),
            ]),
        }
        prefix
    }
}

/// What the explorer found broken: the guarantee and a shortest input
/// sequence (in the kit's trace text form) that reaches it.
#[derive(Clone, Debug)]
pub struct Counterexample {
    /// The violation the oracle reported.
    pub violation: Violation,
    /// Whether it was found by the liveness check (the fair tail from the
    /// last state) rather than by a step's safety checks.
    pub liveness: bool,
    /// The whole trace, setup prefix included; replay it with
    /// `PROVISIONING_TRACE='…'` (single-line form) or a regression file.
    pub trace: Trace,
    /// The number of explored inputs (without the setup prefix).
    pub length: usize,
}

impl Counterexample {
    /// The guarantee broken.
    pub fn guarantee(&self) -> GuaranteeId {
        self.violation.guarantee
    }

    /// The counterexample as a regression-file entry, which `conformance
    /// replay FILE` (or [`crate::Battery::regressions`]) replays: fair mode
    /// when the fair tail found it, adversarial otherwise.
    pub fn to_regression(&self) -> Regression {
        Regression {
            guarantee: Some(self.violation.guarantee),
            mode: if self.liveness {
                Mode::Fair
            } else {
                Mode::Adversarial
            },
            note: format!("found by the explorer after {} inputs", self.length),
            trace: self.trace.clone(),
        }
    }
}

impl fmt::Display for Counterexample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "G31 exhaustive: {} ({}) after {} explored inputs{}",
            self.violation.guarantee,
            self.violation.detail,
            self.length,
            if self.liveness {
                ", in the fair tail"
            } else {
                ""
            }
        )?;
        write!(f, "{}", self.trace)
    }
}

/// What an exploration did.
#[derive(Clone, Debug, Default)]
pub struct ExploreReport {
    /// Inputs applied from a reached state (edges explored).
    pub states_explored: usize,
    /// Distinct states after deduplication (the root included).
    pub distinct_states: usize,
    /// The deepest level whose states were all expanded.
    pub depth_reached: usize,
    /// Whether the state bound stopped the search early.
    pub truncated: bool,
    /// Distinct states whose scripted replies the explorer could not mirror
    /// (their fingerprint then holds their whole input sequence, so they
    /// merge with nothing); zero over the kit's in-memory backend.
    pub unmirrored: usize,
    /// The first (shortest) violation, if any.
    pub counterexample: Option<Counterexample>,
}

impl ExploreReport {
    /// Whether no violation was found.
    pub fn passed(&self) -> bool {
        self.counterexample.is_none()
    }
}

impl fmt::Display for ExploreReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "explored {} transitions, {} distinct states, depth {}{}",
            self.states_explored,
            self.distinct_states,
            self.depth_reached,
            if self.truncated { " (truncated)" } else { "" }
        )?;
        if self.unmirrored > 0 {
            writeln!(
                f,
                "{} states with scripted replies not mirrored (not merged)",
                self.unmirrored
            )?;
        }
        if let Some(counterexample) = &self.counterexample {
            write!(f, "{counterexample}")?;
        }
        Ok(())
    }
}

/// The setup prefix that makes the kit's default two-node shape a cluster
/// of `nodes` nodes (empty for two).
pub fn setup_prefix(nodes: u32) -> Vec<Input> {
    if nodes == 2 {
        Vec::new()
    } else {
        vec![Input::Desire(ShapeChange::Scale {
            group: Group::A,
            count: nodes,
        })]
    }
}

/// The explorer: a substrate factory plus optional host options and
/// recovery, so that the kit's mutations can be put under it.
pub struct Explorer<F> {
    factory: F,
    host: HostOptions,
    recovery: Option<Rc<RecoveryFactory>>,
    driver: Option<Box<DriverFactory>>,
}

impl<S: Substrate, F: Fn() -> S> Explorer<F> {
    /// An explorer over substrates made by `factory`, with the correct host
    /// and the real recovery.
    pub fn new(factory: F) -> Self {
        Explorer {
            factory,
            host: HostOptions::default(),
            recovery: None,
            driver: None,
        }
    }

    /// Another driver under test (the kit's broken variants go here, as
    /// with [`crate::Battery::driver`]).
    pub fn driver(
        mut self,
        factory: impl Fn(&DriverSetup) -> Result<Box<dyn DriverUnderTest>, DriverError> + 'static,
    ) -> Self {
        self.driver = Some(Box::new(factory));
        self
    }

    /// Host options (e.g. a broken commit order).
    pub fn host(mut self, host: HostOptions) -> Self {
        self.host = host;
        self
    }

    /// A recovery factory (e.g. a broken one).
    pub fn recovery(mut self, recovery: Rc<RecoveryFactory>) -> Self {
        self.recovery = Some(recovery);
        self
    }

    fn stepper(&self, tail: WorkStep, header: &TraceHeader) -> Result<Stepper<S>, Violation> {
        let mut builder = Stepper::builder((self.factory)())
            .mode(Mode::Adversarial)
            .tail_order(tail)
            .header(header.clone())
            .host(self.host);
        if let Some(recovery) = &self.recovery {
            builder = builder.shared_recovery(Rc::clone(recovery));
        }
        let built = match &self.driver {
            Some(factory) => builder.driver(factory.as_ref()).build(),
            None => builder.build(),
        };
        match built {
            Ok(stepper) => match stepper.violation() {
                Some(violation) => Err(violation.clone()),
                None => Ok(stepper),
            },
            Err(error) => Err(Violation {
                guarantee: GuaranteeId::ErrorsNotPanics,
                phase: crate::guarantee::Phase::Setup,
                detail: error.to_string(),
            }),
        }
    }

    /// Replays `inputs` on a fresh stepper, mirroring the backend's scripted
    /// replies on the way (see [`BackendMirror`]).
    fn replay(
        &self,
        inputs: &[Input],
        header: &TraceHeader,
    ) -> Result<(Stepper<S>, BackendMirror), Violation> {
        self.replay_with(inputs, header, WorkStep::Fifo)
    }

    fn replay_with(
        &self,
        inputs: &[Input],
        header: &TraceHeader,
        tail: WorkStep,
    ) -> Result<(Stepper<S>, BackendMirror), Violation> {
        let mut stepper = self.stepper(tail, header)?;
        let mut mirror = BackendMirror::default();
        for input in inputs {
            mirror.before(input);
            let report = stepper.step(input)?;
            for call in &report.calls {
                mirror.call(call.op, call.kind);
            }
            mirror.check(&stepper);
        }
        Ok((stepper, mirror))
    }

    /// Explores breadth-first as `config` says.
    pub fn run(&self, config: &ExploreConfig) -> ExploreReport {
        let prefix = config.setup();
        let header = &config.header;
        let mut report = ExploreReport::default();
        let fail = |violation: Violation, liveness: bool, inputs: &[Input]| Counterexample {
            violation,
            liveness,
            trace: Trace {
                header: header.clone(),
                inputs: inputs.to_vec(),
            },
            length: inputs.len() - prefix.len(),
        };
        let mut root = match self.replay(&prefix, header) {
            Ok((stepper, armed)) => (stepper, armed),
            Err(violation) => {
                report.counterexample = Some(fail(violation, false, &prefix));
                return report;
            }
        };
        let mut seen = BTreeSet::new();
        seen.insert(fingerprint(&root.0, &root.1, &prefix, config.normalise_ids));
        report.unmirrored += usize::from(root.1.lost);
        report.distinct_states = 1;
        if config.liveness
            && let Some(violation) = self.liveness(&prefix, config)
        {
            report.counterexample = Some(fail(violation, true, &prefix));
            return report;
        }
        let mut frontier: VecDeque<(Vec<Input>, Vec<Input>)> = VecDeque::new();
        frontier.push_back((prefix.clone(), alphabet(&root.0, config)));
        // A revision probe's counterexample is one input longer than the
        // state it was applied at: it waits until every state of that depth
        // was looked at, so that the first one returned stays a shortest.
        let mut probed = if config.revision_probes {
            self.probe(&mut root.0, &prefix, header)
                .map(|(violation, path)| fail(violation, false, &path))
        } else {
            None
        };
        drop(root);
        for level in 0..config.depth {
            if probed.is_some() {
                report.counterexample = probed;
                report.depth_reached = level;
                return report;
            }
            let mut next = VecDeque::new();
            while let Some((inputs, choices)) = frontier.pop_front() {
                for input in choices {
                    let mut path = inputs.clone();
                    path.push(input);
                    report.states_explored += 1;
                    let mut stepper = match self.replay(&path, header) {
                        Ok(replayed) => replayed,
                        Err(violation) => {
                            report.counterexample = Some(fail(violation, false, &path));
                            return report;
                        }
                    };
                    if !seen.insert(fingerprint(
                        &stepper.0,
                        &stepper.1,
                        &path,
                        config.normalise_ids,
                    )) {
                        continue;
                    }
                    report.distinct_states += 1;
                    report.unmirrored += usize::from(stepper.1.lost);
                    let choices = alphabet(&stepper.0, config);
                    if config.revision_probes && probed.is_none() {
                        probed = self
                            .probe(&mut stepper.0, &path, header)
                            .map(|(violation, path)| fail(violation, false, &path));
                    }
                    drop(stepper);
                    if config.liveness
                        && let Some(violation) = self.liveness(&path, config)
                    {
                        report.counterexample = Some(fail(violation, true, &path));
                        return report;
                    }
                    if report.distinct_states >= config.max_states {
                        report.truncated = true;
                        report.depth_reached = level;
                        report.counterexample = probed;
                        return report;
                    }
                    next.push_back((path, choices));
                }
            }
            report.depth_reached = level + 1;
            if next.is_empty() {
                break;
            }
            frontier = next;
        }
        report.counterexample = probed;
        report
    }

    /// Applies every revision probe to `stepper` (the state `path` reached,
    /// already expanded), one after the other: the first that breaks a
    /// guarantee, with the shortest sequence that shows it — `path` and
    /// that probe alone when that replays to the same violation, else
    /// `path` and the probes up to it.
    fn probe(
        &self,
        stepper: &mut Stepper<S>,
        path: &[Input],
        header: &TraceHeader,
    ) -> Option<(Violation, Vec<Input>)> {
        for (index, probe) in RevisionProbe::ALL.into_iter().enumerate() {
            let Err(violation) = stepper.step(&Input::Revision(probe)) else {
                continue;
            };
            let mut alone = path.to_vec();
            alone.push(Input::Revision(probe));
            if index == 0 {
                return Some((violation, alone));
            }
            if let Err(shorter) = self.replay(&alone, header)
                && shorter.guarantee == violation.guarantee
            {
                return Some((shorter, alone));
            }
            let mut all = path.to_vec();
            all.extend(
                RevisionProbe::ALL[..=index]
                    .iter()
                    .map(|p| Input::Revision(*p)),
            );
            return Some((violation, all));
        }
        None
    }

    /// Replays `inputs` and runs the fair tail (also newest-first with
    /// [`ExploreConfig::lifo_tail`]): `Some` when it does not converge (and
    /// no exhaustion edge excuses it) or breaks a guarantee.
    fn liveness(&self, inputs: &[Input], config: &ExploreConfig) -> Option<Violation> {
        let orders: &[WorkStep] = if config.lifo_tail {
            &[WorkStep::Fifo, WorkStep::Lifo]
        } else {
            &[WorkStep::Fifo]
        };
        orders
            .iter()
            .find_map(|order| self.tail_violation(inputs, config, *order))
    }

    fn tail_violation(
        &self,
        inputs: &[Input],
        config: &ExploreConfig,
        order: WorkStep,
    ) -> Option<Violation> {
        let mut stepper = match self.replay_with(inputs, &config.header, order) {
            Ok((stepper, _)) => stepper,
            Err(violation) => return Some(violation),
        };
        let tail = stepper.run_fair_tail();
        if let Some(mut violation) = tail.violation {
            if order == WorkStep::Lifo {
                violation.detail = format!(
                    "with the fair tail completing work newest-first: {}",
                    violation.detail
                );
            }
            return Some(violation);
        }
        if !tail.converged && !tail.edges_reached {
            return Some(Violation {
                guarantee: GuaranteeId::FairConvergence,
                phase: crate::guarantee::Phase::Tail(tail.rounds),
                detail: format!("no convergence: {}", tail.pending_description),
            });
        }
        None
    }
}

/// How many of the most recent deliveries and submissions the alphabet's
/// `redeliver` and `resubmit` inputs reach (`back` 0 and 1).
const BACK: u32 = 2;

/// The breaker the alphabet's `limit` input sets on group `a`: open after
/// one failure, for five seconds (a clock jump reaches its end).
pub const EXPLORED_BREAKER: LimitChange = LimitChange::Breaker {
    group: Group::A,
    failures: 1,
    cooldown_ms: 5_000,
};

/// The inputs worth trying from `stepper`'s state: every reply kind for the
/// next backend call, delivering one queued task, a join, a convergence
/// report or a failed boot check of the first live session, a clock
/// jump to the next stored deadline, one shape change (up, down, drift,
/// empty), a duplicated or late delivery (`redeliver` of the two most
/// recent), a node loss, a hang release and a controller crash — and, with
/// [`ExploreConfig::executor_inputs`], a resubmission of one of the two
/// most recent operations, another method's output for the next call, and
/// a breaker on the group ([`EXPLORED_BREAKER`]).
pub fn alphabet<S: Substrate>(stepper: &Stepper<S>, config: &ExploreConfig) -> Vec<Input> {
    let nodes = config.nodes;
    let mut out = Vec::new();
    for fault in [
        Fault::Succeed,
        Fault::NotReady,
        Fault::Definite,
        Fault::AmbiguousDone,
        Fault::AmbiguousUndone,
        Fault::Hang,
    ] {
        out.push(Input::Script {
            target: FaultTarget::Any,
            fault,
        });
    }
    out.push(Input::Run(WorkStep::Fifo));
    for n in 0..nodes {
        out.push(Input::Run(WorkStep::One(n)));
    }
    out.push(Input::Stream {
        session: 0,
        event: StreamEvent::Joined,
    });
    out.push(Input::Stream {
        session: 0,
        event: StreamEvent::Converged,
    });
    out.push(Input::Stream {
        session: 0,
        event: StreamEvent::Failed(BootstrapFailure::BootCheckFailed),
    });
    if let Some(at) = stepper.requeue_at() {
        let millis = at.as_millis().saturating_sub(stepper.now().as_millis());
        out.push(Input::Tick {
            millis: millis.clamp(1, crate::trace::MAX_TICK_MS),
        });
    }
    out.push(Input::Desire(ShapeChange::Scale {
        group: Group::A,
        count: nodes + 1,
    }));
    out.push(Input::Desire(ShapeChange::Scale {
        group: Group::A,
        count: nodes - 1,
    }));
    if nodes > 1 {
        // Empty (for one node, scaling down already empties the group).
        out.push(Input::Desire(ShapeChange::Scale {
            group: Group::A,
            count: 0,
        }));
    }
    out.push(Input::Desire(ShapeChange::Drift {
        group: Group::A,
        field: DriftField::Image,
    }));
    for back in 0..BACK {
        out.push(Input::Redeliver { back });
    }
    out.push(Input::Release);
    out.push(Input::Lose {
        ready: 0,
        cause: LossCause::AgentGone,
    });
    out.push(Input::Crash);
    if config.executor_inputs {
        for back in 0..BACK {
            out.push(Input::Resubmit { back });
        }
        out.push(Input::Confuse {
            target: FaultTarget::Any,
        });
        out.push(Input::Limit(EXPLORED_BREAKER));
    }
    out
}

/// The explorer's copy of what the backend was told but does not show in
/// its ledger: the scripted replies and wrong answers still waiting, in
/// order, and the calls hung now. A substrate describes these only by
/// count, and states that differ only in *which* reply waits must not
/// merge (a `script definite` and a `script hang` before the first call
/// would). The copy follows the kit's rules ([`crate::substrate::FaultQueue`]
/// and the fake backend's): a call takes the oldest wrong answer for its
/// kind or for any call first, else the oldest applicable scripted reply
/// for its kind, else for any call; a hang parks the call until a
/// `release` lets the oldest go. It checks itself against the substrate's
/// counters after every step and, where they disagree, says it is `lost`.
#[derive(Clone, Debug, Default)]
pub struct BackendMirror {
    scripts: Vec<(Option<EffectKind>, Fault)>,
    wrong: Vec<Option<EffectKind>>,
    hung: VecDeque<OperationId>,
    /// Scripted replies the mirror saw taken.
    applied: u64,
    /// Hangs the mirror saw taken.
    hangs: u64,
    /// The counters disagreed with the mirror at some step.
    pub lost: bool,
}

impl BackendMirror {
    /// Records what `input` tells the backend, before it is applied.
    fn before(&mut self, input: &Input) {
        match *input {
            Input::Script { target, fault } => {
                let kind = target.kind();
                if kind.is_none_or(|kind| fault.applies_to(kind))
                    && self.scripts.len() < MAX_SCRIPTED_FAULTS
                {
                    self.scripts.push((kind, fault));
                }
            }
            Input::Confuse { target } => {
                if self.wrong.len() < MAX_SCRIPTED_FAULTS {
                    self.wrong.push(target.kind());
                } else {
                    // The fake's own cap is not visible here.
                    self.lost = true;
                }
            }
            Input::Release => {
                self.hung.pop_front();
            }
            _ => {}
        }
    }

    /// A backend call of `kind` started.
    fn call(&mut self, op: OperationId, kind: EffectKind) {
        let oldest = |targets: &[Option<EffectKind>]| {
            (targets.iter().position(|t| *t == Some(kind)))
                .or_else(|| targets.iter().position(Option::is_none))
        };
        if let Some(index) = oldest(&self.wrong) {
            self.wrong.remove(index);
            return;
        }
        let scripted = (self.scripts.iter())
            .position(|(t, f)| *t == Some(kind) && f.applies_to(kind))
            .or_else(|| (self.scripts.iter()).position(|(t, f)| t.is_none() && f.applies_to(kind)));
        if let Some(index) = scripted {
            let (_, fault) = self.scripts.remove(index);
            self.applied += 1;
            if fault == Fault::Hang {
                self.hangs += 1;
                self.hung.push_back(op);
            }
        }
    }

    fn check<S: Substrate>(&mut self, stepper: &Stepper<S>) {
        let counters = stepper.substrate_counters();
        if counters.faults_applied != self.applied || counters.hangs != self.hangs {
            self.lost = true;
        }
    }
}

/// A hash of what makes two states equivalent: observed state, desired
/// shape, clock and requeue, the backend's ledger (live resources, queued
/// work, and the waiting replies and hung calls of the [`BackendMirror`]),
/// and the host's and executor's ledger ([`Stepper::host_ledger`]: the
/// executor's entries and untaken results, limits, an armed crash, orphan
/// suspects, what `resubmit` and `redeliver` can pick) — with ids
/// normalised ([`normalise_ids`]), so that states equal up to a renaming of
/// attempt ids, operation sequences and handle serials merge. A state whose
/// mirror is lost hashes its whole input sequence too.
pub fn fingerprint<S: Substrate>(
    stepper: &Stepper<S>,
    mirror: &BackendMirror,
    inputs: &[Input],
    normalise: bool,
) -> u64 {
    let mut text = format!(
        "{:?}|{:?}|{}|{:?}|{:?}|{}|{:?}|{:?}|{:?}|{}",
        stepper.state(),
        stepper.desired_shape(),
        stepper.now().as_millis(),
        stepper.requeue_at(),
        stepper.live_resources(),
        stepper.substrate().describe_work(),
        mirror.scripts,
        mirror.wrong,
        mirror.hung,
        stepper.host_ledger(BACK as usize),
    );
    if mirror.lost {
        text.push_str(&format!("|{inputs:?}"));
    }
    let mut hasher = DefaultHasher::new();
    if normalise {
        normalise_ids(&text).hash(&mut hasher);
    } else {
        text.hash(&mut hasher);
    }
    hasher.finish()
}

/// Where a number is an id, in the `Debug` forms of the kit's state: the
/// marker before it and the renaming it belongs to. Attempt ids are one
/// renaming (the allocator's next id among them, so a state that burned an
/// attempt more merges with one that did not), operation sequences a
/// second, and the serials the kit's fakes put at the end of their handle
/// names (`lease-a-0-a3-7`) a third, shared with the attempt in the handle.
const ID_MARKERS: [(&str, usize); 4] = [
    ("NodeAttemptId(", 0),
    ("AttemptAllocator { next: ", 0),
    ("OperationSequence(", 1),
    ("-a", 0),
];

/// Renames the ids in `text` (see `ID_MARKERS`) to their order of first
/// appearance, one renaming per kind. A handle's `-aN-M` renames `N` as an
/// attempt and `M` as a serial. Renaming by first appearance is a bijection
/// per state and consistent across the whole text, so two texts normalise
/// alike exactly when they are equal up to such a renaming.
pub fn normalise_ids(text: &str) -> String {
    let mut maps: [std::collections::BTreeMap<&str, usize>; 3] = Default::default();
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    'scan: while !rest.is_empty() {
        for (marker, kind) in ID_MARKERS {
            let Some(after) = rest.strip_prefix(marker) else {
                continue;
            };
            let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits == 0 {
                continue;
            }
            let (number, tail) = after.split_at(digits);
            out.push_str(marker);
            let next = maps[kind].len();
            let renamed = *maps[kind].entry(number).or_insert(next);
            out.push('#');
            out.push_str(&renamed.to_string());
            rest = tail;
            // A handle: `-aN-M` — the serial after the attempt.
            if marker == "-a"
                && let Some(serial_part) = rest.strip_prefix('-')
            {
                let digits = serial_part.len()
                    - serial_part
                        .trim_start_matches(|c: char| c.is_ascii_digit())
                        .len();
                if digits > 0 {
                    let (serial, tail) = serial_part.split_at(digits);
                    let next = maps[2].len();
                    let renamed = *maps[2].entry(serial).or_insert(next);
                    out.push_str("-#");
                    out.push_str(&renamed.to_string());
                    rest = tail;
                }
            }
            continue 'scan;
        }
        let mut chars = rest.chars();
        if let Some(c) = chars.next() {
            out.push(c);
        }
        rest = chars.as_str();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn script(fault: Fault) -> Input {
        Input::Script {
            target: FaultTarget::Any,
            fault,
        }
    }

    #[test]
    fn the_mirror_takes_replies_as_the_kit_does() {
        use provisioning::NodeAttemptId;
        use provisioning::id::OperationSequence;
        let op = |n| OperationId::new(NodeAttemptId::from_raw(n), OperationSequence::FIRST);
        let mut mirror = BackendMirror::default();
        for fault in [Fault::NotReady, Fault::Hang, Fault::Definite] {
            mirror.before(&script(fault));
        }
        mirror.before(&Input::Confuse {
            target: FaultTarget::Any,
        });
        // A wrong answer goes first and takes no scripted reply.
        mirror.call(op(1), EffectKind::CreateLease);
        assert_eq!(mirror.scripts.len(), 3);
        // "Not ready" applies to lookups only: a create skips it.
        mirror.call(op(2), EffectKind::CreateLease);
        assert_eq!(mirror.hung, [op(2)]);
        mirror.call(op(3), EffectKind::LookupEndpoint);
        assert_eq!(mirror.scripts, [(None, Fault::Definite)]);
        mirror.before(&Input::Release);
        assert!(mirror.hung.is_empty());
        assert_eq!((mirror.applied, mirror.hangs, mirror.lost), (2, 1, false));
    }

    #[test]
    fn renamed_ids_normalise_alike_and_different_structure_does_not() {
        let one = "AttemptAllocator { next: 5, limit: 9 } a: NodeAttemptId(3) \
                   op OperationSequence(4) lease-a-0-a3-17 b: NodeAttemptId(4)";
        let two = "AttemptAllocator { next: 7, limit: 9 } a: NodeAttemptId(5) \
                   op OperationSequence(2) lease-a-0-a5-2 b: NodeAttemptId(6)";
        assert_eq!(normalise_ids(one), normalise_ids(two));
        // The same attempt twice is not two different attempts.
        let same = "a: NodeAttemptId(3) b: NodeAttemptId(3)";
        let other = "a: NodeAttemptId(3) b: NodeAttemptId(4)";
        assert_ne!(normalise_ids(same), normalise_ids(other));
        // Numbers that are not ids stay as they are.
        assert_eq!(normalise_ids("count: 2, at 1500"), "count: 2, at 1500");
        assert_ne!(normalise_ids("count: 2"), normalise_ids("count: 3"));
    }
}
