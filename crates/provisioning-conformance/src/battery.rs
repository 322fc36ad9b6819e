//! The battery: many seeds, both modes, regressions first, shrunk failures,
//! vacuity counts, and a report.
//!
//! One *evaluation* of a trace in a mode is the run itself plus the checks
//! that need more than one run: on a deterministic substrate the same run
//! again (G18) and, in fair mode, a run whose tail completes queued work
//! newest-first (G20). The shrinker re-runs whole evaluations, so every
//! guarantee — including G18 and G20 — shrinks the same way.

use std::fmt;
use std::rc::Rc;
use std::time::{Duration, Instant};

use provisioning::driver::DriverError;
use provisioning::durable::RecoveryError;
use provisioning::{DurableState, Timestamp};
use thiserror::Error;

use crate::driver_under_test::DriverUnderTest;
use crate::fake::FakeSubstrate;
use crate::generate::{GeneratorConfig, generate};
use crate::guarantee::{GuaranteeId, Phase, Violation};
use crate::harness::{
    DriverFactory, DriverSetup, HostOptions, Mode, RunDigest, RunOptions, RunOutcome, Stepper,
    Vacuity, cluster_driver, run_built,
};
use crate::journal::{
    InMemoryJournal, JournalFactory, KitJournal, Recovered, RecoveryFactory, recover_cluster_driver,
};
use crate::prng::SplitMix64;
use crate::shrink::{DEFAULT_SHRINK_BUDGET, shrink};
use crate::substrate::Substrate;
use crate::trace::{ParseError, Trace, WorkStep};

/// The number of seeds a battery runs by default.
pub const DEFAULT_SEED_COUNT: usize = 256;

/// The base from which Level 1 derives its seeds.
pub const LEVEL1_SEED_BASE: u64 = 0x1E7E_1000_C0DE_0001;

/// How many failures a battery shrinks and reports before it stops.
pub const DEFAULT_MAX_FAILURES: usize = 3;

/// Environment variable: run only this seed (hex `0x…` or decimal).
pub const ENV_SEED: &str = "PROVISIONING_SEED";
/// Environment variable: run only this mode (`adversarial` or `fair`).
pub const ENV_MODE: &str = "PROVISIONING_MODE";
/// Environment variable: run only this trace (its single-line text form).
pub const ENV_TRACE: &str = "PROVISIONING_TRACE";
/// Environment variable: run this many seeds instead of the default.
pub const ENV_SEEDS: &str = "PROVISIONING_SEEDS";

/// `count` seeds derived from `base` with [`SplitMix64`]; stable forever.
pub fn derive_seeds(base: u64, count: usize) -> Vec<u64> {
    let mut rng = SplitMix64::new(base);
    (0..count).map(|_| rng.next_u64()).collect()
}

/// A failing trace kept in a regression file, replayed before new seeds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regression {
    /// The guarantee it once broke, when recorded.
    pub guarantee: Option<GuaranteeId>,
    /// The mode it fails in.
    pub mode: Mode,
    /// A free-form note (what was wrong, where it was fixed).
    pub note: String,
    /// The trace.
    pub trace: Trace,
}

/// A regression file could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RegressionError {
    /// A `===` line does not read `=== <Gxx|-> <mode> [note]`.
    #[error(
        "regression header line {line}: {text:?} (expected `=== <Gxx> <adversarial|fair> [note]`)"
    )]
    BadHeader {
        /// The 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
    /// Trace lines before the first `===` header.
    #[error("regression file line {line}: a trace line before the first `===` header")]
    Orphan {
        /// The 1-based line number.
        line: usize,
    },
    /// A regression's trace does not parse.
    #[error("regression starting at line {line}: {source}")]
    Trace {
        /// The line of its header.
        line: usize,
        /// The parse error.
        source: ParseError,
    },
}

impl Regression {
    /// Parses a regression file: blocks that start with a header line
    /// `=== G08 fair what went wrong` followed by the trace's text form.
    /// Lines starting with `#` outside blocks are comments.
    ///
    /// # Errors
    /// A [`RegressionError`] naming the line.
    pub fn parse_file(text: &str) -> Result<Vec<Regression>, RegressionError> {
        let mut regressions = Vec::new();
        let mut current: Option<(usize, Option<GuaranteeId>, Mode, String, String)> = None;
        let flush = |current: Option<(usize, Option<GuaranteeId>, Mode, String, String)>,
                     out: &mut Vec<Regression>|
         -> Result<(), RegressionError> {
            if let Some((line, guarantee, mode, note, body)) = current {
                let trace = body
                    .parse::<Trace>()
                    .map_err(|source| RegressionError::Trace { line, source })?;
                out.push(Regression {
                    guarantee,
                    mode,
                    note,
                    trace,
                });
            }
            Ok(())
        };
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            if let Some(rest) = line.strip_prefix("===") {
                flush(current.take(), &mut regressions)?;
                let bad = || RegressionError::BadHeader {
                    line: number,
                    text: line.to_owned(),
                };
                let mut words = rest.split_whitespace();
                let id = words.next().ok_or_else(bad)?;
                let guarantee = match id {
                    "-" => None,
                    id => Some(GuaranteeId::from_id(id).ok_or_else(bad)?),
                };
                let mode = words.next().and_then(Mode::from_name).ok_or_else(bad)?;
                let note = words.collect::<Vec<_>>().join(" ");
                current = Some((number, guarantee, mode, note, String::new()));
            } else if let Some((_, _, _, _, body)) = current.as_mut() {
                body.push_str(line);
                body.push('\n');
            } else if !(line.trim().is_empty() || line.trim_start().starts_with('#')) {
                return Err(RegressionError::Orphan { line: number });
            }
        }
        flush(current, &mut regressions)?;
        Ok(regressions)
    }

    /// The block to append to a regression file.
    pub fn to_entry(&self) -> String {
        let id = self.guarantee.map_or("-", GuaranteeId::id);
        let mut entry = format!("=== {id} {} {}\n", self.mode.name(), self.note);
        for line in self.trace.to_string().lines() {
            if !line.starts_with('#') {
                entry.push_str(line);
                entry.push('\n');
            }
        }
        entry
    }
}

/// A shrunk, reproducible failure.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The seed the trace came from (`None` for regressions and given traces).
    pub seed: Option<u64>,
    /// The mode it fails in.
    pub mode: Mode,
    /// The first violation of the original trace.
    pub original: Violation,
    /// How many inputs the original trace had.
    pub original_inputs: usize,
    /// The shrunk trace.
    pub shrunk: Trace,
    /// The shrunk trace's violation (the same guarantee).
    pub violation: Violation,
    /// Candidates the shrinker evaluated.
    pub shrink_evaluations: usize,
    /// The shrunk trace, step by step, with the cluster after each input.
    pub narration: Vec<String>,
    /// One command line that reproduces the shrunk failure.
    pub reproduce: String,
    /// One command line that reproduces the original failure from its seed.
    pub reproduce_seed: Option<String>,
}

impl Failure {
    /// The guarantee broken.
    pub fn guarantee(&self) -> GuaranteeId {
        self.violation.guarantee
    }

    /// This failure as a regression entry.
    pub fn to_regression(&self) -> Regression {
        Regression {
            guarantee: Some(self.guarantee()),
            mode: self.mode,
            note: self
                .seed
                .map_or_else(String::new, |seed| format!("found by seed {seed:#x}")),
            trace: self.shrunk.clone(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let origin = self.seed.map_or_else(
            || "given trace".to_owned(),
            |seed| format!("seed {seed:#x}"),
        );
        writeln!(
            f,
            "{} violated ({} mode, {origin}) at {}: {}",
            self.original.guarantee,
            self.mode.name(),
            self.original.phase,
            self.original.detail
        )?;
        writeln!(
            f,
            "shrunk from {} to {} inputs in {} evaluations; the shrunk trace fails at {}: {}",
            self.original_inputs,
            self.shrunk.inputs.len(),
            self.shrink_evaluations,
            self.violation.phase,
            self.violation.detail
        )?;
        writeln!(f, "--- shrunk trace ---")?;
        write!(f, "{}", self.shrunk)?;
        if !self.narration.is_empty() {
            writeln!(f, "--- narration (input => cluster after it) ---")?;
            for line in &self.narration {
                writeln!(f, "{line}")?;
            }
        }
        writeln!(f, "--- reproduce ---")?;
        writeln!(f, "{}", self.reproduce)?;
        if let Some(seed) = &self.reproduce_seed {
            writeln!(f, "(the original, unshrunk: {seed})")?;
        }
        Ok(())
    }
}

/// What a battery did.
#[derive(Clone, Debug)]
pub struct BatteryReport {
    /// The battery's name.
    pub name: String,
    /// Trace evaluations (seeds × modes, plus regressions and given traces).
    pub traces: usize,
    /// Harness runs, including the re-runs of G18 and G20 (not counting shrinking).
    pub runs: usize,
    /// Regressions replayed.
    pub regressions: usize,
    /// Fair-mode evaluations whose tail converged.
    pub converged: usize,
    /// Evaluations that reached attempt exhaustion or clock saturation.
    pub edge_traces: usize,
    /// Shrunk failures, at most the battery's limit.
    pub failures: Vec<Failure>,
    /// Vacuity counts over every evaluation.
    pub vacuity: Vacuity,
    /// Whether the vacuity counts are required to be non-zero.
    pub vacuity_required: bool,
    /// Wall time, shrinking included.
    pub elapsed: Duration,
}

impl BatteryReport {
    /// The required vacuity counts that stayed at zero.
    pub fn vacuous(&self) -> Vec<&'static str> {
        if !self.vacuity_required {
            return Vec::new();
        }
        self.vacuity
            .required()
            .into_iter()
            .filter(|(_, count)| *count == 0)
            .map(|(name, _)| name)
            .collect()
    }

    /// Whether the battery passed: no failure and nothing vacuous.
    pub fn passed(&self) -> bool {
        self.failures.is_empty() && self.vacuous().is_empty()
    }

    /// Traces per second of wall time.
    pub fn traces_per_second(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.traces as f64 / seconds
        } else {
            0.0
        }
    }

    /// The failures as regression-file entries.
    pub fn regression_entries(&self) -> String {
        self.failures
            .iter()
            .map(|f| f.to_regression().to_entry())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl fmt::Display for BatteryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: {} trace evaluations ({} regressions replayed), {} harness runs, {} fair tails converged, {} reached exhaustion/saturation, in {:.2} s ({:.0} traces/s)",
            self.name,
            self.traces,
            self.regressions,
            self.runs,
            self.converged,
            self.edge_traces,
            self.elapsed.as_secs_f64(),
            self.traces_per_second()
        )?;
        let counts: Vec<String> = self
            .vacuity
            .required()
            .iter()
            .chain(self.vacuity.limits().iter())
            .chain(self.vacuity.informational().iter())
            .map(|(name, count)| format!("{name} {count}"))
            .collect();
        writeln!(f, "vacuity: {}", counts.join(", "))?;
        let vacuous = self.vacuous();
        if !vacuous.is_empty() {
            writeln!(
                f,
                "VACUOUS: never reached: {} — the battery proves nothing about them",
                vacuous.join(", ")
            )?;
        }
        for failure in &self.failures {
            writeln!(f, "\nFAILURE\n{failure}")?;
        }
        if self.passed() {
            writeln!(f, "passed")?;
        }
        Ok(())
    }
}

/// An environment override could not be read.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum EnvError {
    /// A variable holds something that does not parse.
    #[error("{variable}={value:?}: {reason}")]
    Invalid {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        reason: String,
    },
}

/// The outcome of evaluating one trace in one mode.
#[derive(Clone, Debug)]
pub struct Evaluation {
    /// The first violation, if any.
    pub violation: Option<Violation>,
    /// The vacuity counts of the main run.
    pub vacuity: Vacuity,
    /// Harness runs spent.
    pub runs: usize,
    /// Whether the fair tail converged.
    pub converged: bool,
    /// Whether exhaustion or saturation was reached.
    pub edges_reached: bool,
}

/// A battery of seeds against one substrate and driver.
///
/// # Example: running the kit against your own backend
/// ```
/// use provisioning_conformance::{Battery, FakeSubstrate};
///
/// // Replace `FakeSubstrate::new` with a factory for your own `Substrate`.
/// let report = Battery::new("my backend", FakeSubstrate::new)
///     .seed_count(4)
///     .require_vacuity(false)
///     .run();
/// assert!(report.passed(), "{report}");
/// ```
pub struct Battery<S: Substrate> {
    name: String,
    substrate: Box<dyn Fn() -> S>,
    driver: Box<DriverFactory>,
    recovery: Rc<RecoveryFactory>,
    journal: Box<JournalFactory>,
    host: HostOptions,
    seeds: Vec<u64>,
    traces: Vec<Trace>,
    modes: Vec<Mode>,
    generator: GeneratorConfig,
    regressions: Vec<Regression>,
    shrink_budget: usize,
    max_failures: usize,
    require_vacuity: bool,
    reproduce_with: String,
    narrate_failures: bool,
}

impl<S: Substrate> fmt::Debug for Battery<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Battery")
            .field("name", &self.name)
            .field("seeds", &self.seeds.len())
            .field("traces", &self.traces.len())
            .field("modes", &self.modes)
            .field("regressions", &self.regressions.len())
            .finish_non_exhaustive()
    }
}

impl Battery<FakeSubstrate> {
    /// Level 1: the in-memory [`FakeSubstrate`] under the real driver,
    /// 256 seeds × both modes, traces of 64–96 inputs.
    pub fn level1() -> Self {
        Battery::new("level 1 (in-memory FakeBackend)", FakeSubstrate::new)
            .seeds(derive_seeds(LEVEL1_SEED_BASE, DEFAULT_SEED_COUNT))
            .reproduce_with("cargo test -p provisioning-conformance --test level1")
    }
}

impl<S: Substrate> Battery<S> {
    /// A battery named `name` that builds a fresh substrate per run with
    /// `substrate`; the real [`provisioning::ClusterDriver`], 256 seeds derived
    /// from [`LEVEL1_SEED_BASE`], both modes, default generator, vacuity required.
    pub fn new(name: impl Into<String>, substrate: impl Fn() -> S + 'static) -> Self {
        Battery {
            name: name.into(),
            substrate: Box::new(substrate),
            driver: Box::new(cluster_driver),
            recovery: Rc::new(recover_cluster_driver),
            journal: Box::new(InMemoryJournal::boxed),
            host: HostOptions::default(),
            seeds: derive_seeds(LEVEL1_SEED_BASE, DEFAULT_SEED_COUNT),
            traces: Vec::new(),
            modes: Mode::ALL.to_vec(),
            generator: GeneratorConfig::default(),
            regressions: Vec::new(),
            shrink_budget: DEFAULT_SHRINK_BUDGET,
            max_failures: DEFAULT_MAX_FAILURES,
            require_vacuity: true,
            reproduce_with: "cargo test".to_owned(),
            narrate_failures: true,
        }
    }

    /// Runs these seeds.
    pub fn seeds(mut self, seeds: impl IntoIterator<Item = u64>) -> Self {
        self.seeds = seeds.into_iter().collect();
        self
    }

    /// Runs `count` seeds derived from [`LEVEL1_SEED_BASE`].
    pub fn seed_count(self, count: usize) -> Self {
        self.seeds(derive_seeds(LEVEL1_SEED_BASE, count))
    }

    /// Runs these modes.
    pub fn modes(mut self, modes: impl IntoIterator<Item = Mode>) -> Self {
        self.modes = modes.into_iter().collect();
        self
    }

    /// Also runs these given traces (after regressions, before seeds).
    pub fn traces(mut self, traces: impl IntoIterator<Item = Trace>) -> Self {
        self.traces.extend(traces);
        self
    }

    /// Uses another driver under test (the kit's own tests wrap the real
    /// driver in broken variants this way).
    pub fn driver(
        mut self,
        factory: impl Fn(&DriverSetup) -> Result<Box<dyn DriverUnderTest>, DriverError> + 'static,
    ) -> Self {
        self.driver = Box::new(factory);
        self
    }

    /// Recovers the driver under test this way after a crash (default: the
    /// real [`provisioning::ClusterDriver::recover`]; the kit's own tests
    /// put broken recoveries here).
    pub fn recovery(
        mut self,
        recovery: impl Fn(&DriverSetup, DurableState, Timestamp) -> Result<Recovered, RecoveryError>
        + 'static,
    ) -> Self {
        self.recovery = Rc::new(recovery);
        self
    }

    /// Builds each run's journal with `journal` (default: an
    /// [`InMemoryJournal`]).
    pub fn journal(mut self, journal: impl Fn() -> Box<dyn KitJournal> + 'static) -> Self {
        self.journal = Box::new(journal);
        self
    }

    /// Runs the harness host with these options (default: the correct
    /// host; the kit's own tests put broken hosts here).
    pub fn host(mut self, host: HostOptions) -> Self {
        self.host = host;
        self
    }

    /// Shapes generated traces.
    pub fn generator(mut self, config: GeneratorConfig) -> Self {
        self.generator = config;
        self
    }

    /// Replays these regressions first.
    pub fn regressions(mut self, regressions: impl IntoIterator<Item = Regression>) -> Self {
        self.regressions.extend(regressions);
        self
    }

    /// Spends at most `budget` evaluations shrinking each failure.
    pub fn shrink_budget(mut self, budget: usize) -> Self {
        self.shrink_budget = budget;
        self
    }

    /// Stops after this many failures.
    pub fn max_failures(mut self, max: usize) -> Self {
        self.max_failures = max.max(1);
        self
    }

    /// Whether a vacuity count at zero fails the battery.
    pub fn require_vacuity(mut self, required: bool) -> Self {
        self.require_vacuity = required;
        self
    }

    /// The command (without environment variables) that runs this battery,
    /// used in reproduction lines.
    pub fn reproduce_with(mut self, command: impl Into<String>) -> Self {
        self.reproduce_with = command.into();
        self
    }

    /// Whether failure reports include a step-by-step narration.
    pub fn narrate_failures(mut self, narrate: bool) -> Self {
        self.narrate_failures = narrate;
        self
    }

    /// Applies [`ENV_SEED`], [`ENV_MODE`], [`ENV_TRACE`] and [`ENV_SEEDS`]
    /// from the environment, so that a printed reproduction line runs
    /// exactly the failing case. Restricting to one seed or trace skips the
    /// regressions and the vacuity requirement.
    ///
    /// # Errors
    /// [`EnvError::Invalid`] when a variable does not parse.
    pub fn with_env_overrides(self) -> Result<Self, EnvError> {
        let read = |name: &'static str| std::env::var(name).ok().filter(|v| !v.is_empty());
        self.with_overrides(
            read(ENV_SEED).as_deref(),
            read(ENV_MODE).as_deref(),
            read(ENV_TRACE).as_deref(),
            read(ENV_SEEDS).as_deref(),
        )
    }

    /// [`Battery::with_env_overrides`] with the values given explicitly.
    ///
    /// # Errors
    /// [`EnvError::Invalid`] when a value does not parse.
    pub fn with_overrides(
        mut self,
        seed: Option<&str>,
        mode: Option<&str>,
        trace: Option<&str>,
        seed_count: Option<&str>,
    ) -> Result<Self, EnvError> {
        let invalid = |variable, value: &str, reason: String| EnvError::Invalid {
            variable,
            value: value.to_owned(),
            reason,
        };
        if let Some(value) = seed_count {
            let count = value
                .parse::<usize>()
                .map_err(|e| invalid(ENV_SEEDS, value, format!("expected a seed count: {e}")))?;
            self.seeds = derive_seeds(LEVEL1_SEED_BASE, count);
        }
        if let Some(value) = mode {
            let mode = Mode::from_name(value).ok_or_else(|| {
                invalid(ENV_MODE, value, "expected adversarial or fair".to_owned())
            })?;
            self.modes = vec![mode];
        }
        if let Some(value) = seed {
            let parsed = match value.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => value.parse::<u64>(),
            };
            let seed = parsed.map_err(|e| {
                invalid(
                    ENV_SEED,
                    value,
                    format!("expected a hex or decimal seed: {e}"),
                )
            })?;
            self.seeds = vec![seed];
            self.regressions.clear();
            self.require_vacuity = false;
        }
        if let Some(value) = trace {
            let trace = value
                .parse::<Trace>()
                .map_err(|e| invalid(ENV_TRACE, value, e.to_string()))?;
            self.seeds.clear();
            self.traces = vec![trace];
            self.regressions.clear();
            self.require_vacuity = false;
        }
        Ok(self)
    }

    fn run_once(&self, trace: &Trace, options: RunOptions) -> RunOutcome {
        let builder = Stepper::builder((self.substrate)())
            .driver(&*self.driver)
            .journal((self.journal)())
            .shared_recovery(self.recovery.clone())
            .header(trace.header.clone())
            .options(RunOptions {
                host: self.host,
                ..options
            });
        run_built(builder, trace)
    }

    /// Evaluates one trace in one mode: the run, and on a deterministic
    /// substrate the same run again (G18) and, in fair mode, a run with the
    /// tail's work completed newest-first (G20).
    pub fn evaluate(&self, trace: &Trace, mode: Mode) -> Evaluation {
        let options = RunOptions::new(mode);
        let first = self.run_once(trace, options);
        let deterministic = first.deterministic;
        let mut evaluation = Evaluation {
            violation: first.violation.clone(),
            vacuity: first.vacuity,
            runs: 1,
            converged: first.converged,
            edges_reached: first.edges_reached,
        };
        if evaluation.violation.is_some() || !deterministic {
            return evaluation;
        }
        let second = self.run_once(trace, options);
        evaluation.runs += 1;
        if let Some(difference) = digest_difference(&first, &second) {
            evaluation.violation = Some(Violation {
                guarantee: GuaranteeId::Determinism,
                phase: Phase::End,
                detail: format!("the same trace run twice differed: {difference}"),
            });
            return evaluation;
        }
        if mode == Mode::Fair && !first.edges_reached {
            let reordered = self.run_once(
                trace,
                RunOptions {
                    tail_order: WorkStep::Lifo,
                    ..options
                },
            );
            evaluation.runs += 1;
            if let Some(mut violation) = reordered.violation {
                violation.detail = format!(
                    "with the fair tail completing work newest-first: {}",
                    violation.detail
                );
                evaluation.violation = Some(violation);
            } else if first.converged
                && reordered.converged
                && first.converged_shape != reordered.converged_shape
            {
                evaluation.violation = Some(Violation {
                    guarantee: GuaranteeId::Confluence,
                    phase: Phase::End,
                    detail: format!(
                        "completing the tail's work oldest-first and newest-first converged differently: {:?} vs {:?}",
                        first.converged_shape, reordered.converged_shape
                    ),
                });
            }
        }
        evaluation
    }

    fn reproduce_line(&self, mode: Mode, trace: Option<&Trace>, seed: Option<u64>) -> String {
        let mut line = String::new();
        if let Some(trace) = trace {
            line.push_str(&format!("{ENV_TRACE}='{}' ", trace.to_single_line()));
        }
        if let Some(seed) = seed {
            line.push_str(&format!("{ENV_SEED}={seed:#x} "));
        }
        line.push_str(&format!(
            "{ENV_MODE}={} {}",
            mode.name(),
            self.reproduce_with
        ));
        line
    }

    /// Shrinks a failing trace and builds its report.
    pub fn failure(
        &self,
        trace: &Trace,
        mode: Mode,
        violation: &Violation,
        seed: Option<u64>,
    ) -> Failure {
        let mut fails = |candidate: &Trace| self.evaluate(candidate, mode).violation;
        let shrunk = shrink(trace, violation, self.shrink_budget, &mut fails);
        let narration = if self.narrate_failures {
            self.run_once(
                &shrunk.trace,
                RunOptions {
                    narrate: true,
                    ..RunOptions::new(mode)
                },
            )
            .narration
        } else {
            Vec::new()
        };
        Failure {
            seed,
            mode,
            original: violation.clone(),
            original_inputs: trace.inputs.len(),
            reproduce: self.reproduce_line(mode, Some(&shrunk.trace), None),
            reproduce_seed: seed.map(|seed| self.reproduce_line(mode, None, Some(seed))),
            shrunk: shrunk.trace,
            violation: shrunk.violation,
            shrink_evaluations: shrunk.evaluations,
            narration,
        }
    }

    /// Runs the battery: regressions, given traces, then every seed in every
    /// mode, stopping after the failure limit.
    pub fn run(&self) -> BatteryReport {
        let started = Instant::now();
        let mut report = BatteryReport {
            name: self.name.clone(),
            traces: 0,
            runs: 0,
            regressions: 0,
            converged: 0,
            edge_traces: 0,
            failures: Vec::new(),
            vacuity: Vacuity::default(),
            vacuity_required: self.require_vacuity,
            elapsed: Duration::ZERO,
        };
        let mut cases: Vec<(Trace, Vec<Mode>, Option<u64>, bool)> = Vec::new();
        for regression in &self.regressions {
            cases.push((regression.trace.clone(), vec![regression.mode], None, true));
        }
        for trace in &self.traces {
            cases.push((trace.clone(), self.modes.clone(), None, false));
        }
        for seed in &self.seeds {
            cases.push((
                generate(*seed, &self.generator),
                self.modes.clone(),
                Some(*seed),
                false,
            ));
        }
        'cases: for (trace, modes, seed, regression) in cases {
            for mode in modes {
                let evaluation = self.evaluate(&trace, mode);
                report.traces += 1;
                report.regressions += usize::from(regression);
                report.runs += evaluation.runs;
                report.converged += usize::from(evaluation.converged);
                report.edge_traces += usize::from(evaluation.edges_reached);
                report.vacuity.add(&evaluation.vacuity);
                if let Some(violation) = evaluation.violation {
                    report
                        .failures
                        .push(self.failure(&trace, mode, &violation, seed));
                    if report.failures.len() >= self.max_failures {
                        break 'cases;
                    }
                }
            }
        }
        report.elapsed = started.elapsed();
        report
    }
}

fn digest_difference(first: &RunOutcome, second: &RunOutcome) -> Option<String> {
    let (a, b): (&RunDigest, &RunDigest) = (&first.digest, &second.digest);
    if first.violation != second.violation {
        return Some(format!(
            "violations {:?} vs {:?}",
            first.violation, second.violation
        ));
    }
    if a.calls != b.calls {
        let index = a
            .calls
            .iter()
            .zip(&b.calls)
            .position(|(x, y)| x != y)
            .unwrap_or(a.calls.len().min(b.calls.len()));
        return Some(format!(
            "backend calls differ at call #{index}: {:?} vs {:?}",
            a.calls.get(index),
            b.calls.get(index)
        ));
    }
    if a.state != b.state {
        return Some("the final observed states differ".to_owned());
    }
    if a.live != b.live {
        return Some(format!("live resources differ: {} vs {}", a.live, b.live));
    }
    (a.steps != b.steps).then(|| format!("{} vs {} inputs applied", a.steps, b.steps))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_seeds_are_stable() {
        let seeds = derive_seeds(LEVEL1_SEED_BASE, 3);
        assert_eq!(seeds, derive_seeds(LEVEL1_SEED_BASE, 3));
        assert_eq!(seeds.len(), 3);
        assert_ne!(seeds[0], seeds[1]);
    }

    #[test]
    fn regression_files_round_trip_and_reject_malformed_headers() {
        let text = "# comment\n\n=== G08 fair found by seed 0x1\ntick 5ms\nrelease\n=== - adversarial\nrun fifo\n";
        let parsed = Regression::parse_file(text).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].guarantee, Some(GuaranteeId::NoDoubleCreate));
        assert_eq!(parsed[0].mode, Mode::Fair);
        assert_eq!(parsed[0].note, "found by seed 0x1");
        assert_eq!(parsed[0].trace.inputs.len(), 2);
        assert_eq!(parsed[1].guarantee, None);
        let again: String = parsed.iter().map(Regression::to_entry).collect();
        assert_eq!(Regression::parse_file(&again).unwrap(), parsed);
        assert!(matches!(
            Regression::parse_file("=== G99 fair\n"),
            Err(RegressionError::BadHeader { line: 1, .. })
        ));
        assert!(matches!(
            Regression::parse_file("=== G01 sideways\n"),
            Err(RegressionError::BadHeader { .. })
        ));
        assert!(matches!(
            Regression::parse_file("tick 5ms\n"),
            Err(RegressionError::Orphan { line: 1 })
        ));
        assert!(matches!(
            Regression::parse_file("=== G01 fair\ntick soon\n"),
            Err(RegressionError::Trace { line: 1, .. })
        ));
    }

    #[test]
    fn overrides_restrict_the_battery_and_reject_garbage() {
        let battery = Battery::level1()
            .with_overrides(Some("0x2a"), Some("fair"), None, None)
            .unwrap();
        assert_eq!(battery.seeds, [0x2a]);
        assert_eq!(battery.modes, [Mode::Fair]);
        assert!(!battery.require_vacuity);
        let battery = Battery::level1()
            .with_overrides(None, None, Some("tick 5ms; release"), None)
            .unwrap();
        assert!(battery.seeds.is_empty());
        assert_eq!(battery.traces.len(), 1);
        assert!(
            Battery::level1()
                .with_overrides(Some("zz"), None, None, None)
                .is_err()
        );
        assert!(
            Battery::level1()
                .with_overrides(None, Some("calm"), None, None)
                .is_err()
        );
        assert!(
            Battery::level1()
                .with_overrides(None, None, Some("jump"), None)
                .is_err()
        );
        assert!(
            Battery::level1()
                .with_overrides(None, None, None, Some("-1"))
                .is_err()
        );
    }
}
