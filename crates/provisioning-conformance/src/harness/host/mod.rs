//! The host loop: how the kit plays a host around a real driver and
//! executor, one input at a time, checking the oracle after each.
//!
//! This file holds a run's life (build the driver and executor, set up,
//! take each input, end the inputs, report); its parts hold the rest:
//! `input.rs` applies a trace's inputs, `drive.rs` settles the machine and
//! drives the driver, `deliver.rs` folds results and observations,
//! `calls.rs` checks every backend call start, and `after_drive.rs` and
//! `after_input.rs` run the oracle's checks at those two moments.

mod after_drive;
mod after_input;
mod calls;
mod deliver;
mod drive;
mod input;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

use provisioning::{LogicalNodeId, RetryPolicy, Timestamp};

use crate::guarantee::{GuaranteeId, Phase, Violation};
use crate::harness::durable::DurableSide;
use crate::harness::{
    DriverFactory, DriverSetup, Harness, NodeShape, QUIESCENCE_PROBE_PERIOD, RunDigest, RunOptions,
    RunOutcome, ShapeModel, Vacuity, summarize,
};
use crate::journal::{KitJournal, RecoveryFactory};
use crate::oracle::{self, Breach, Verdict, breach};
use crate::substrate::Substrate;
use crate::trace::{Input, TraceHeader};

impl<S: Substrate> Harness<S> {
    /// Builds the driver (with `factory`) and the executor over `substrate`
    /// for a run of `model` under `header`. Submits nothing yet.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::harness) fn new(
        mut substrate: S,
        factory: &DriverFactory,
        journal: Box<dyn KitJournal>,
        recovery: Rc<RecoveryFactory>,
        header: &TraceHeader,
        model: ShapeModel,
        first_generation: u64,
        options: RunOptions,
    ) -> Result<Self, Violation> {
        let policy = RetryPolicy {
            jitter_per_mille: header.jitter_per_mille,
            ..RetryPolicy::default()
        };
        let setup = DriverSetup {
            run_id: model.run_id().clone(),
            policy,
            attempt_limit: header.attempt_limit,
        };
        let mut driver = factory(&setup).map_err(|error| Violation {
            guarantee: GuaranteeId::ErrorsNotPanics,
            phase: Phase::Setup,
            detail: format!("the driver could not be built: {error}"),
        })?;
        driver.track_changes();
        driver.track_membership();
        let history_watch =
            crate::harness::HistoryWatch::start(driver.as_mut(), crate::harness::HISTORY_DEPTH);
        let now = Timestamp::from_millis(header.clock_start_ms);
        let durable = DurableSide::new(now, &options.host);
        if header.late_close {
            substrate.close_sessions_late();
        }
        let notified = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let executor = Harness::controller_executor(&substrate, &durable.control, &notified);
        let strict_calls = substrate.capabilities().deterministic;
        let mut vacuity = Vacuity::default();
        if substrate.survives_controller_crash() {
            vacuity.crash_capable_runs = 1;
        }
        Ok(Harness {
            substrate,
            executor,
            driver,
            setup,
            journal,
            recovery,
            durable,
            options,
            strict_calls,
            phase: Phase::Setup,
            now,
            slots: model.slots(),
            attempts: oracle::AttemptsSeen::default(),
            failures: BTreeMap::new(),
            executor_watch: crate::harness::ExecutorWatch {
                notified,
                ..crate::harness::ExecutorWatch::default()
            },
            interleave: header.interleave,
            model,
            generation: first_generation.saturating_sub(1),
            history: VecDeque::new(),
            timed_out: BTreeSet::new(),
            ever_pending: BTreeSet::new(),
            newest_call: BTreeMap::new(),
            highest_attempt: None,
            highest_generation: None,
            cleanup_failed: BTreeSet::new(),
            calls: Vec::new(),
            vacuity,
            limits: provisioning::Limits::default(),
            refusals: Vec::new(),
            more_refusals_to_fold: false,
            history_watch,
            breaker_watch: crate::harness::breaker::BreakerWatch::default(),
            history_off: header.late_close,
            driver_counts: crate::harness::DriverCounts::default(),
            drives: 0,
            full_expected: None,
            edges_reached: false,
            converged: false,
            tail_rounds: 0,
            tail_new_attempts: 0,
            steps: 0,
            narration: Vec::new(),
            membership: oracle::MembershipWatch::default(),
        })
    }

    pub(in crate::harness) fn violation(&self, breach: Breach) -> Violation {
        Violation {
            guarantee: breach.guarantee,
            phase: self.phase,
            detail: breach.detail,
        }
    }

    pub(in crate::harness) fn check(&self, verdict: Verdict) -> Result<(), Violation> {
        verdict.map_err(|b| self.violation(b))
    }

    /// Submits the initial shape and settles: the setup phase of a run.
    pub(in crate::harness) fn set_up(&mut self) -> Result<(), Violation> {
        self.phase = Phase::Setup;
        self.submit_shape()?;
        self.settle()?;
        self.check_state()?;
        if self.history_off {
            // From here on the driver keeps no history: what it kept during
            // the setup must go at once.
            self.history_watch = crate::harness::HistoryWatch::start(self.driver.as_mut(), 0);
            self.check_history()?;
        }
        Ok(())
    }

    /// Applies the next input of the run and checks what the oracle checks
    /// after every input (and, every [`QUIESCENCE_PROBE_PERIOD`] inputs, a
    /// forced pass).
    pub(in crate::harness) fn input(&mut self, input: &Input) -> Result<(), Violation> {
        let index = self.steps;
        self.phase = Phase::Input(index);
        self.apply(input)?;
        self.steps = index + 1;
        self.check_state()?;
        if (index + 1) % QUIESCENCE_PROBE_PERIOD == 0 {
            self.probe_quiescence()?;
        }
        if self.options.narrate {
            let summary = summarize(self.driver.state());
            self.narration
                .push(format!("#{index} {input} => {summary}"));
        }
        Ok(())
    }

    /// The check at the end of the inputs: a forced pass (G19).
    pub(in crate::harness) fn end_of_inputs(&mut self) -> Result<(), Violation> {
        self.phase = Phase::End;
        if self.durable.crash_armed {
            self.crash()?;
            self.settle()?;
            self.check_state()?;
        }
        self.check_executor_debug()?;
        self.probe_quiescence()
    }

    /// G04 (diagnostics form): the executor's debug text, what a host's
    /// logs show of it, carries its counters — at least the calls it
    /// started, as the kit counted them.
    fn check_executor_debug(&self) -> Result<(), Violation> {
        let calls = self.durable.control.lock().live_calls;
        let text = format!("{:?}", self.executor);
        let expected = format!("started: {calls}");
        self.check(if text.contains(&expected) {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::RecordBeforeDispatch,
                format!(
                    "the executor's debug text is {text:?}, which does not show its counters (expected it to contain {expected:?})"
                ),
            ))
        })
    }

    /// The vacuity counts so far, with the substrate's and the executor's
    /// counters folded in.
    pub(in crate::harness) fn vacuity_so_far(&self) -> Vacuity {
        let mut vacuity = self.vacuity;
        vacuity.adoptions_after_ambiguity = self.substrate.counters().adoptions;
        vacuity.late_results_discarded +=
            self.executor.counters().late_dropped + self.durable.late_dropped_before;
        if self.edges_reached {
            vacuity.edges_reached = 1;
        }
        let limits = self.driver.limit_counters();
        vacuity.budget_held += limits.held_by_budget;
        vacuity.breakers_opened += self.breaker_watch.opened;
        vacuity.breaker_probes += self.breaker_watch.probes;
        vacuity
    }

    /// The per-slot shape of the cluster now, for the confluence check.
    pub(in crate::harness) fn node_shapes(&self) -> BTreeMap<LogicalNodeId, NodeShape> {
        self.driver
            .state()
            .nodes
            .iter()
            .map(|(id, node)| {
                (
                    id.clone(),
                    NodeShape {
                        spec: node.spec.clone(),
                        stage: node.record.stage,
                        ready: node.record.ready,
                        intent: node.intent,
                    },
                )
            })
            .collect()
    }

    /// What identifies the run so far (G18).
    pub(in crate::harness) fn digest(&self) -> RunDigest {
        RunDigest {
            calls: self.calls.clone(),
            state: self.driver.state().clone(),
            live: self.substrate.live_resources(),
            steps: self.steps,
        }
    }

    pub(in crate::harness) fn finish(
        mut self,
        violation: Option<Violation>,
        narration: Vec<String>,
    ) -> RunOutcome {
        let vacuity = self.vacuity_so_far();
        let converged_shape = self.converged.then(|| self.node_shapes());
        RunOutcome {
            violation,
            vacuity,
            digest: RunDigest {
                calls: std::mem::take(&mut self.calls),
                state: self.driver.state().clone(),
                live: self.substrate.live_resources(),
                steps: self.steps,
            },
            converged: self.converged,
            edges_reached: self.edges_reached,
            deterministic: self.strict_calls,
            converged_shape,
            narration,
        }
    }
}
