//! The host loop: inputs, settling, deliveries and the per-step checks.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use provisioning::driver::{DriveReport, DriverError, NodeError};
use provisioning::{
    BootstrapEvent, BreakerPolicy, ClusterState, DesiredUpdate, EffectKind, EffectOutput,
    EndpointLookup, ExecutorResult, GroupId, Intent, LeaseHandle, LogicalNodeId, LogicalNodeSpec,
    ManagedNode, MaxUnavailable, NodeAttemptId, Observation, OperationId, RetryPolicy,
    SessionHandle, Timestamp,
};

use super::durable::{Batch, DurableSide};
use super::{
    Delivery, DriverFactory, DriverSetup, Harness, MAX_HISTORY, MAX_SETTLE_ROUNDS, NodeShape,
    QUIESCENCE_PROBE_PERIOD, RunDigest, RunOptions, RunOutcome, ShapeModel, Vacuity, summarize,
};
use crate::guarantee::{GuaranteeId, Phase, Violation};
use crate::journal::{KitJournal, RecoveryFactory};
use crate::oracle::{self, Breach, FoldCause, Verdict, breach};
use crate::substrate::Substrate;
use crate::trace::{Input, LimitChange, RevisionProbe, TraceHeader};

impl<S: Substrate> Harness<S> {
    /// Builds the driver (with `factory`) and the executor over `substrate`
    /// for a run of `model` under `header`. Submits nothing yet.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
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
        let history_watch = super::HistoryWatch::start(driver.as_mut(), super::HISTORY_DEPTH);
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
            executor_watch: super::ExecutorWatch {
                notified,
                ..super::ExecutorWatch::default()
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
            breaker_watch: super::breaker::BreakerWatch::default(),
            history_off: header.late_close,
            driver_counts: super::DriverCounts::default(),
            drives: 0,
            full_expected: None,
            edges_reached: false,
            converged: false,
            tail_rounds: 0,
            tail_new_attempts: 0,
            steps: 0,
            narration: Vec::new(),
        })
    }

    pub(super) fn violation(&self, breach: Breach) -> Violation {
        Violation {
            guarantee: breach.guarantee,
            phase: self.phase,
            detail: breach.detail,
        }
    }

    pub(super) fn check(&self, verdict: Verdict) -> Result<(), Violation> {
        verdict.map_err(|b| self.violation(b))
    }

    /// Submits the initial shape and settles: the setup phase of a run.
    pub(super) fn set_up(&mut self) -> Result<(), Violation> {
        self.phase = Phase::Setup;
        self.submit_shape()?;
        self.settle()?;
        self.check_state()?;
        if self.history_off {
            // From here on the driver keeps no history: what it kept during
            // the setup must go at once.
            self.history_watch = super::HistoryWatch::start(self.driver.as_mut(), 0);
            self.check_history()?;
        }
        Ok(())
    }

    /// Applies the next input of the run and checks what the oracle checks
    /// after every input (and, every [`QUIESCENCE_PROBE_PERIOD`] inputs, a
    /// forced pass).
    pub(super) fn input(&mut self, input: &Input) -> Result<(), Violation> {
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
    pub(super) fn end_of_inputs(&mut self) -> Result<(), Violation> {
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
    pub(super) fn vacuity_so_far(&self) -> Vacuity {
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
    pub(super) fn node_shapes(&self) -> BTreeMap<LogicalNodeId, NodeShape> {
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
    pub(super) fn digest(&self) -> RunDigest {
        RunDigest {
            calls: self.calls.clone(),
            state: self.driver.state().clone(),
            live: self.substrate.live_resources(),
            steps: self.steps,
        }
    }

    pub(super) fn finish(
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

    // -----------------------------------------------------------------------
    // Inputs.
    // -----------------------------------------------------------------------

    /// Applies a trace's limit change to the kit's model of the limits.
    fn change_limit(&mut self, change: LimitChange) {
        match change {
            LimitChange::Cap { count: 0 } => {
                self.limits.max_concurrent_creates.clear();
            }
            LimitChange::Cap { count } => {
                self.limits
                    .max_concurrent_creates
                    .insert(super::PROVIDER_KIND.to_owned(), count);
            }
            LimitChange::Budget { group, count } => {
                let id = GroupId::new(group.name());
                if count == 0 {
                    self.limits.max_unavailable.remove(&id);
                } else {
                    self.limits
                        .max_unavailable
                        .insert(id, MaxUnavailable::Count(count));
                }
            }
            LimitChange::Breaker {
                group,
                failures,
                cooldown_ms,
            } => {
                let id = GroupId::new(group.name());
                if failures == 0 {
                    self.limits.breakers.remove(&id);
                } else {
                    self.limits.breakers.insert(
                        id,
                        BreakerPolicy::new(failures, Duration::from_millis(cooldown_ms)),
                    );
                }
            }
        }
    }

    fn apply(&mut self, input: &Input) -> Result<(), Violation> {
        match *input {
            Input::Tick { millis } => {
                let target = self.now.saturating_add(Duration::from_millis(millis));
                self.advance_to(target)?;
            }
            Input::Desire(change) => {
                if self.model.apply(change) {
                    // A shape change of a group closes its breaker.
                    self.breaker_watch
                        .close(&GroupId::new(change.group().name()));
                    self.submit_shape()?;
                    self.ask_full();
                }
            }
            Input::Revision(probe) => self.probe_revision(probe)?,
            Input::Script { target, fault } => {
                self.substrate.script(target, fault);
            }
            Input::Refuse { target } => {
                if self.refusals.len() < crate::substrate::MAX_SCRIPTED_FAULTS {
                    self.refusals.push(target.kind());
                }
            }
            Input::Run(step) => {
                self.substrate.run_work(step);
                self.check_calls()?;
            }
            Input::Stream { session, event } => {
                self.substrate.stream(session, event);
            }
            Input::Redeliver { back } => {
                if !self.history.is_empty() {
                    let index = self.history.len() - 1 - (back as usize % self.history.len());
                    if let Some(delivery) = self.history.get(index).cloned() {
                        match delivery {
                            Delivery::Result(result) => self.deliver_result(result)?,
                            Delivery::Observation(observation) => {
                                self.deliver_observation(observation)?;
                            }
                        }
                    }
                }
            }
            Input::Release => {
                self.substrate.release_oldest_hang();
            }
            Input::Resubmit { back } => self.resubmit(back)?,
            Input::Confuse { target } => {
                self.substrate.script_wrong_answer(target);
            }
            Input::Limit(change) => {
                self.change_limit(change);
                self.driver.set_limits(self.limits.clone());
                self.ask_full();
                if let Some(in_force) = self.driver.limits_in_force() {
                    self.check(if in_force == self.limits {
                        Ok(())
                    } else {
                        Err(breach(
                            GuaranteeId::BudgetsHold,
                            format!(
                                "the driver says {in_force:?} are in force, but it was given {:?}",
                                self.limits
                            ),
                        ))
                    })?;
                }
            }
            Input::Resume { group } => {
                let id = GroupId::new(group.name());
                let was_open = self.driver.breaker_open(&id, self.now);
                let Some(reported) = self.driver.reset_breaker(&id) else {
                    return self.settle();
                };
                self.ask_full();
                self.check(oracle::g30_resume_reports_and_closes(
                    &id,
                    was_open,
                    reported,
                    self.driver.breaker_open(&id, self.now),
                ))?;
                if reported {
                    self.vacuity.breakers_resumed += 1;
                }
                self.breaker_watch.close(&id);
                self.settle()?;
                // The pass the resume queued gave every held slot its node.
                return self.check(oracle::g30_resumed_group_is_not_held(
                    self.driver.state(),
                    &self.slots,
                    &id,
                    reported,
                    self.now,
                ));
            }
            Input::Crash => {
                if self.crash_capable() {
                    self.durable.crash_armed = true;
                }
            }
            Input::Lose { ready, cause } => {
                let ready_nodes: Vec<(LogicalNodeId, NodeAttemptId)> = self
                    .driver
                    .state()
                    .nodes
                    .iter()
                    .filter(|(_, node)| node.is_ready())
                    .map(|(id, node)| (id.clone(), node.attempt))
                    .collect();
                if !ready_nodes.is_empty() {
                    let (node, attempt) = &ready_nodes[ready as usize % ready_nodes.len()];
                    if self.substrate.lose(node, *attempt, cause) {
                        self.vacuity.ready_node_losses += 1;
                    }
                }
            }
        }
        self.settle()
    }

    /// Remembers an operation the executor accepted.
    pub(super) fn watch_submission(&mut self, operation: provisioning::Operation) {
        let watch = &mut self.executor_watch;
        watch.submitted.insert(operation.id);
        watch.accepted_here.insert(operation.id);
        if watch.recent.len() >= MAX_HISTORY {
            watch.recent.pop_front();
        }
        watch.recent.push_back(operation);
    }

    /// Hands the `back`-th most recent operation of an attempt the executor
    /// still keeps to the executor once more: it must not run it again.
    fn resubmit(&mut self, back: u32) -> Result<(), Violation> {
        let watch = &self.executor_watch;
        let candidates: Vec<&provisioning::Operation> = watch
            .recent
            .iter()
            .rev()
            .filter(|op| !watch.retired.contains(&op.attempt()))
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let operation = candidates[back as usize % candidates.len()].clone();
        // The newest operation the live executor took for its attempt: it
        // still holds it, running or with its result kept.
        let newest = !watch.recent.iter().any(|op| {
            op.attempt() == operation.attempt() && op.id.sequence() > operation.id.sequence()
        });
        let outcome = self.executor.submit(operation.clone());
        self.vacuity.resubmissions += 1;
        self.note_replay(&outcome);
        self.check(oracle::g05_resubmission_is_deduplicated(
            &operation, &outcome,
        ))?;
        self.check(oracle::g05_newest_is_answered_from_the_record(
            &operation, newest, &outcome,
        ))?;
        // The same input with its template copied (equal, not shared) is
        // the same operation; an input that differs under the same id is a
        // conflict wherever the executor still recognises the id.
        let template = operation.spec.template().clone();
        let mut copied = operation.clone();
        copied.spec = LogicalNodeSpec::new(
            operation.spec.id().clone(),
            operation.spec.run_id().clone(),
            Arc::new(template.clone()),
        );
        let again = self.executor.submit(copied);
        self.note_replay(&again);
        self.check(oracle::g05_resubmission_is_deduplicated(&operation, &again))?;
        let mut altered = operation.clone();
        if back % 2 == 0 {
            let mut other = template;
            other.role.push_str("-altered");
            altered.spec = LogicalNodeSpec::new(
                operation.spec.id().clone(),
                operation.spec.run_id().clone(),
                Arc::new(other),
            );
        } else {
            altered.node = LogicalNodeId::new(
                operation.node.group().clone(),
                operation.node.index() + 1000,
            );
        }
        let conflict = self.executor.submit(altered);
        self.note_replay(&conflict);
        self.check(oracle::g05_different_input_is_refused(
            &operation, &outcome, &conflict,
        ))
    }

    /// Counts a submission the executor answered by replaying a result.
    fn note_replay(
        &mut self,
        outcome: &Result<provisioning::Submitted, provisioning::driver::SubmitError>,
    ) {
        if matches!(outcome, Ok(provisioning::Submitted::Replayed)) {
            self.executor_watch.replayed_here += 1;
        }
    }

    fn submit_shape(&mut self) -> Result<(), Violation> {
        self.generation += 1;
        self.slots = self.model.slots();
        let shape = self.model.shape(self.generation);
        match self.driver.update_desired(shape) {
            Ok(DesiredUpdate::Accepted) => Ok(()),
            other => Err(self.violation(breach(
                GuaranteeId::MonotonicGeneration,
                format!(
                    "a valid shape at the strictly higher generation {} was not accepted: {other:?}",
                    self.generation
                ),
            ))),
        }
    }

    fn probe_revision(&mut self, probe: RevisionProbe) -> Result<(), Violation> {
        let (shape, expected) = match probe {
            RevisionProbe::Regress => (
                self.model.shape(self.generation.saturating_sub(1)),
                "a generation regression error",
            ),
            RevisionProbe::Same => (self.model.shape(self.generation), "an unchanged no-op"),
            RevisionProbe::Silent => (
                self.model.altered().shape(self.generation),
                "a content-changed-without-bump error",
            ),
        };
        let before_state = self.driver.state().clone();
        let before_desired = self.driver.desired().clone();
        let outcome = self.driver.update_desired(shape);
        let as_expected = match probe {
            RevisionProbe::Regress => {
                matches!(outcome, Err(DriverError::GenerationRegressed { .. }))
            }
            RevisionProbe::Same => matches!(outcome, Ok(DesiredUpdate::Unchanged)),
            RevisionProbe::Silent => matches!(
                outcome,
                Err(DriverError::ContentChangedWithoutGenerationBump { .. })
            ),
        };
        let unchanged =
            *self.driver.state() == before_state && *self.driver.desired() == before_desired;
        self.check(if as_expected && unchanged {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::MonotonicGeneration,
                format!(
                    "revision probe {}: expected {expected} changing nothing, got {outcome:?} (changed: {})",
                    probe.name(),
                    !unchanged
                ),
            ))
        })
    }

    // -----------------------------------------------------------------------
    // Settling.
    // -----------------------------------------------------------------------

    /// Folds everything available and drives until nothing moves.
    pub(super) fn settle(&mut self) -> Result<(), Violation> {
        for _ in 0..MAX_SETTLE_ROUNDS {
            let mut progressed = false;
            let results = self.executor.take_results();
            // Counted at once: a crash while they are delivered (a pass
            // between deliveries may hand out work) makes a new executor,
            // which must not be held to the dead one's results.
            self.executor_watch.taken_here += results.len() as u64;
            for result in results {
                self.executor_watch.published_here.insert(result.op);
                self.check(oracle::g02_published_result_is_accounted_for(
                    &result,
                    &self.executor_watch.submitted,
                    &self.executor_watch.expired,
                ))?;
                let panicked = self.durable.control.lock().panicked.remove(&result.op);
                // An operation the kit expired through the executor answers
                // with its timeout; its call's panic was dropped late.
                if let Some(text) = panicked
                    && !self.executor_watch.expired.contains(&result.op)
                {
                    self.check(oracle::g13_panic_reported_with_its_message(
                        &result,
                        text.as_deref(),
                    ))?;
                }
                self.deliver_result(result)?;
                self.pass_between_deliveries()?;
                progressed = true;
            }
            for observation in self.substrate.take_observations() {
                self.deliver_observation(observation)?;
                self.pass_between_deliveries()?;
                progressed = true;
            }
            progressed |= self.fold_due_timeouts()?;
            progressed |= self.drive()?;
            self.check_calls()?;
            if !progressed {
                return Ok(());
            }
        }
        Err(self.violation(breach(
            GuaranteeId::Quiescence,
            format!(
                "livelock: the machine did not settle within {MAX_SETTLE_ROUNDS} rounds ({})",
                summarize(self.driver.state())
            ),
        )))
    }

    /// Under untidy interleavings, the passes a delivery makes due run at
    /// once, before the next delivery.
    fn pass_between_deliveries(&mut self) -> Result<(), Violation> {
        if self.interleave {
            self.drive()?;
            self.check_calls()?;
        }
        Ok(())
    }

    pub(super) fn edge_error(error: &DriverError) -> bool {
        match error {
            DriverError::Clock(_) => true,
            DriverError::NodeErrors(errors) => errors
                .iter()
                .all(|(_, e)| matches!(e, NodeError::Id(_) | NodeError::Clock(_))),
            _ => false,
        }
    }

    pub(super) fn unexpected(&self, what: &str, error: &DriverError) -> Violation {
        self.violation(breach(
            GuaranteeId::ErrorsNotPanics,
            format!("{what} failed with an unexpected error: {error}"),
        ))
    }

    /// Runs queued passes; returns whether any pass ran.
    pub(super) fn drive(&mut self) -> Result<bool, Violation> {
        let due_timer = self
            .driver
            .requeue_at()
            .is_some_and(|t| oracle::at_or_after(self.now, t));
        if !self.driver.is_queued() && !due_timer {
            return Ok(false);
        }
        let pre = self.driver.state().clone();
        let mut batch = Batch {
            refuse: std::mem::take(&mut self.refusals),
            ..Batch::default()
        };
        self.drives += 1;
        let split = if self.drives % 2 == 0 {
            self.drive_split(&mut batch)?
        } else {
            None
        };
        let outcome = match split {
            Some(outcome) => outcome,
            None => self.driver.drive_until_blocked(self.now, &mut batch),
        };
        self.full_expected = match &outcome {
            Ok(report) if report.passes == 0 => self.full_expected,
            Ok(_) => Some(false),
            Err(_) => None,
        };
        self.refusals = std::mem::take(&mut batch.refuse);
        self.vacuity.refusals += batch.refused.len() as u64;
        if let Ok(report) = &outcome {
            self.driver_counts.passes += u64::from(report.passes);
            self.driver_counts.dispatched += batch.operations.len() as u64;
            self.driver_counts.refused += batch.refused.len() as u64;
        }
        let (passes, edge) = match &outcome {
            Ok(report) => (report.passes, false),
            Err(error) if Harness::<S>::edge_error(error) => {
                self.edges_reached = true;
                (1, true)
            }
            Err(error) => return Err(self.unexpected("a pass", error)),
        };
        if let Ok(report) = &outcome {
            self.check(oracle::g04_drive_report_matches_sink(
                report.dispatched,
                report.refused,
                batch.operations.len(),
                batch.refused.len(),
            ))?;
        }
        let refused = std::mem::take(&mut batch.refused);
        self.check_drive(&pre, edge, &refused)?;
        if !edge && !self.edges_reached {
            self.check_breakers()?;
        }
        self.hand_out(batch)?;
        Ok(passes > 0)
    }

    /// Something asked the driver for a full pass (a changed shape, new
    /// limits, a resume, a trigger): its next pass must be full.
    fn ask_full(&mut self) {
        if self.full_expected.is_some() {
            self.full_expected = Some(true);
        }
    }

    /// Drives pass by pass, each split into its plan and its application,
    /// checking after each that the pass did what it planned (G19, pass
    /// plan form). `None` when the driver cannot split a pass.
    fn drive_split(
        &mut self,
        batch: &mut Batch,
    ) -> Result<Option<Result<DriveReport, DriverError>>, Violation> {
        let counters_before = self.driver.limit_counters();
        let evaluations_before = self.driver.counters().map(|c| c.evaluations);
        let mut evaluated = 0u64;
        let mut held = oracle::Held::default();
        let mut report = DriveReport::default();
        while report.passes < provisioning::driver::MAX_PASSES_PER_DRIVE {
            let before = oracle::pass_before(self.driver.state());
            let refused_before = batch.refused.len();
            let first = report.passes == 0;
            // While the pass is open, a fold must be refused and change
            // nothing: the timeout of the first pending operation, at its
            // deadline (it would fold if the pass were not open).
            let probe = self
                .driver
                .state()
                .nodes
                .iter()
                .find_map(|(id, n)| n.pending.as_ref().map(|p| (id.clone(), p.id, p.deadline)));
            let mut refused: Option<Result<(), String>> = None;
            let mut between = |driver: &mut dyn crate::DriverUnderTest| {
                let Some((node, op, deadline)) = &probe else {
                    return;
                };
                let outcome = driver.operation_timed_out(node, *op, *deadline);
                let still = driver
                    .state()
                    .nodes
                    .get(node)
                    .and_then(|n| n.pending.as_ref())
                    .is_some_and(|p| p.id == *op);
                refused = Some(match outcome {
                    Err(DriverError::PassInProgress) if still => Ok(()),
                    other => Err(format!(
                        "the timeout of {node} {op} folded while a pass was open answered {other:?} (its operation {} pending)",
                        if still { "still" } else { "no longer" }
                    )),
                });
            };
            let Some(outcome) = self
                .driver
                .drive_one_pass(self.now, batch, first, &mut between)
            else {
                return Ok(None);
            };
            if let Some(Err(detail)) = refused {
                return Err(self.violation(breach(GuaranteeId::Correlation, detail)));
            }
            let (planned, pass) = match outcome {
                Ok(Some(done)) => done,
                Ok(None) => break,
                Err(error) => return Ok(Some(Err(error))),
            };
            let refused_here: BTreeMap<LogicalNodeId, EffectKind> = batch.refused[refused_before..]
                .iter()
                .map(|op| (op.node.clone(), op.kind()))
                .collect();
            report.passes += 1;
            report.dispatched += pass.dispatched;
            report.refused += pass.refused;
            let full_expected = if first {
                self.full_expected
            } else {
                Some(false)
            };
            let watch = &self.breaker_watch;
            let breaker_holds = |group: &GroupId| watch.holds(group);
            let holds = oracle::Holds {
                cap: self
                    .limits
                    .max_concurrent_creates
                    .get(super::PROVIDER_KIND)
                    .copied(),
                budgets: self
                    .limits
                    .max_unavailable
                    .iter()
                    .map(|(group, budget)| {
                        let count = match budget {
                            MaxUnavailable::Count(n) => *n,
                            MaxUnavailable::Percent(_) => 1,
                        };
                        (group.clone(), count.max(1))
                    })
                    .collect(),
                breaker_holds: &breaker_holds,
            };
            let verdict = oracle::g19_pass_did_what_it_planned(
                &planned,
                &before,
                self.driver.state(),
                &self.slots,
                self.now,
                full_expected,
                &holds,
                &refused_here,
            );
            match verdict {
                Ok((pass_held, took)) => {
                    held.cap += pass_held.cap;
                    held.budget += pass_held.budget;
                    held.breaker += pass_held.breaker;
                    evaluated += planned.evaluated as u64;
                    // The pass's own report: what it evaluated, dispatched
                    // and applied, as the kit saw it take the steps.
                    let said = (
                        pass.evaluated,
                        pass.dispatched + pass.refused,
                        pass.transitions,
                    );
                    let seen = (planned.evaluated, took.dispatches, took.transitions);
                    self.check(if said == seen {
                        Ok(())
                    } else {
                        Err(breach(
                            GuaranteeId::RecordBeforeDispatch,
                            format!(
                                "a pass at {} reports {said:?} (evaluated, dispatched, transitions), but planned and took {seen:?}",
                                self.now
                            ),
                        ))
                    })?;
                }
                Err(breach) => return Err(self.violation(breach)),
            }
        }
        if report.passes == provisioning::driver::MAX_PASSES_PER_DRIVE {
            report.budget_exhausted = self.driver.is_queued();
        }
        if let (Some(before), Some(after)) = (
            evaluations_before,
            self.driver.counters().map(|c| c.evaluations),
        ) {
            self.check(if after - before == evaluated {
                Ok(())
            } else {
                Err(breach(
                    GuaranteeId::RecordBeforeDispatch,
                    format!(
                        "over a drive the driver counts {} node evaluations, but its plans evaluated {evaluated}",
                        after - before
                    ),
                ))
            })?;
        }
        let counters = self.driver.limit_counters();
        let counted = oracle::Held {
            cap: counters.held_by_cap - counters_before.held_by_cap,
            budget: counters.held_by_budget - counters_before.held_by_budget,
            breaker: counters.held_by_breaker - counters_before.held_by_breaker,
        };
        self.check(if counted == held {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::BudgetsHold,
                format!(
                    "over a drive the driver counts {counted:?} steps held back by the cap, the budgets and the breakers, but the kit saw {held:?} planned steps held"
                ),
            ))
        })?;
        Ok(Some(Ok(report)))
    }

    /// G30 (hold form) after a drive: the driver's word on each breaker
    /// agrees with the kit's (whose model took the drive's starts in
    /// [`Self::check_drive`]).
    fn check_breakers(&mut self) -> Result<(), Violation> {
        let groups: Vec<GroupId> = self.limits.breakers.keys().cloned().collect();
        let mut reports_breakers = false;
        for group in groups {
            let said = self.driver.breaker_open(&group, self.now);
            reports_breakers |= said.is_some();
            self.check(self.breaker_watch.agrees(&group, said, &self.limits))?;
            let status = self.driver.breaker_status(&group);
            self.check(self.breaker_watch.status_agrees(&group, status))?;
        }
        if reports_breakers && self.durable.crashes == 0 {
            // The driver's own counts of openings and probes (what a host
            // shows an operator) against the model's, over the one life.
            let counters = self.driver.limit_counters();
            let said = (counters.breakers_opened, counters.breaker_probes);
            let seen = (self.breaker_watch.opened, self.breaker_watch.probes);
            self.check(if said == seen {
                Ok(())
            } else {
                Err(breach(
                    GuaranteeId::BreakerLiveness,
                    format!(
                        "the driver counts {} breaker openings and {} probes, but the kit's model saw {} and {}",
                        said.0, said.1, seen.0, seen.1
                    ),
                ))
            })?;
        }
        Ok(())
    }

    fn check_drive(
        &mut self,
        pre: &ClusterState,
        edge: bool,
        refused: &[provisioning::Operation],
    ) -> Result<(), Violation> {
        // A refused submission is folded inside the pass, as a definite
        // failure of its operation: its node is held to the fold checks
        // (below), not to the rule that passes keep retry bookkeeping.
        let folded_here: BTreeSet<&LogicalNodeId> = refused.iter().map(|op| &op.node).collect();
        let now = self.now;
        let policy = *self.driver.policy();
        let post = self.driver.state();
        let mut highest = self.highest_attempt;
        if let Err(reused) = oracle::g01_new_attempts_are_fresh(pre, post, &mut highest)
            .and_then(|()| oracle::g01_attempts_never_come_back(post, &mut self.attempts))
        {
            return Err(self.crash_aware(reused.guarantee, reused.detail));
        }
        let desired = &self.slots;
        let mut verdict = oracle::g32_stages_agree_with_facts(post);
        let dispatches = oracle::new_dispatches(pre, post);
        for dispatch in &dispatches {
            verdict = verdict
                .and_then(|()| oracle::g25_deadline_is_stored_at_dispatch(dispatch, &policy, now))
                .and_then(|()| oracle::g09_no_effect_before_backoff(dispatch, pre, post, now))
                .and_then(|()| oracle::g12_no_destructive_step_while_ambiguous(dispatch, pre))
                .and_then(|()| {
                    oracle::g15_convergence_reported_once(
                        dispatch,
                        &self.executor_watch.convergence_reported,
                    )
                })
                .and_then(|()| {
                    oracle::g15_convergence_reported_after_join(
                        dispatch,
                        &self.executor_watch.joined,
                    )
                });
        }
        let mut replacements = 0;
        let mut scale_downs = 0;
        for change in oracle::slot_changes(pre, post) {
            let folded = folded_here.contains(change.id);
            verdict = verdict
                .and_then(|()| oracle::g07_attempts_end_only_when_empty(&change, desired, now))
                .and_then(|()| oracle::g12_not_destroyed_while_ambiguous(&change))
                .and_then(|()| {
                    if folded {
                        Ok(())
                    } else {
                        oracle::g12_passes_keep_retry_bookkeeping(&change)
                    }
                })
                .and_then(|()| {
                    // A refusal folded in the pass may have failed the node
                    // that a later pass of the drive began to tear down.
                    let failed_here =
                        folded && change.after.is_some_and(|a| a.record.failure.is_some());
                    if failed_here {
                        Ok(())
                    } else {
                        oracle::g17_only_undesired_drifted_or_failed_nodes_are_deleted(
                            &change, desired,
                        )
                    }
                });
            if !edge {
                verdict = verdict
                    .and_then(|()| {
                        if folded {
                            Ok(())
                        } else {
                            oracle::g10_failed_attempt_starts_cleanup(&change, now)
                        }
                    })
                    .and_then(|()| {
                        // Near the end of the clock a cleanup step may have
                        // no deadline to be dispatched with (G13's edge).
                        // (A refused cleanup step was dispatched, and folded.)
                        if self.edges_reached || folded {
                            Ok(())
                        } else {
                            oracle::g10_deletion_proceeds_at_once(&change, now)
                        }
                    })
                    .and_then(|()| {
                        let failures = &self.failures;
                        if folded {
                            Ok(())
                        } else {
                            oracle::g09_passes_keep_failure_counts(&change, failures)
                        }
                    });
            }
            if let (Some(before), Some(after)) = (change.before, change.after) {
                if before.attempt != after.attempt {
                    replacements += 1;
                }
                if before.intent == Intent::Active
                    && after.intent == Intent::Deleting
                    && !desired.contains(change.id)
                {
                    scale_downs += 1;
                }
            }
        }
        let cap = self
            .limits
            .max_concurrent_creates
            .get(super::PROVIDER_KIND)
            .copied();
        verdict = verdict.and_then(|()| oracle::g29_creates_within_cap(&dispatches, post, cap));
        if verdict.is_ok()
            && cap.is_some_and(|cap| {
                dispatches
                    .iter()
                    .any(|d| d.pending.kind == EffectKind::CreateLease)
                    && oracle::creates_pending(post) >= cap as usize
            })
        {
            self.vacuity.cap_reached += 1;
        }
        let mut drifted_groups = BTreeSet::new();
        for change in oracle::slot_changes(pre, post) {
            if oracle::is_drift_takedown(&change, self.driver.desired()) {
                if self.limits.max_unavailable.contains_key(change.id.group()) {
                    self.vacuity.budget_rollouts += 1;
                }
                drifted_groups.insert(change.id.group().clone());
            }
        }
        let desired = self.driver.desired();
        for group in &drifted_groups {
            if let Some(budget) = self.limits.max_unavailable.get(group) {
                let allowed = budget.of(desired.groups().get(group).map_or(0, |g| g.count()));
                verdict = verdict.and_then(|()| {
                    oracle::g29_rollout_within_budget(group, post, desired, allowed)
                });
            }
        }
        self.check(verdict)?;
        let post = self.driver.state();
        self.failures.retain(|id, _| post.nodes.contains_key(id));
        self.highest_attempt = highest;
        self.vacuity.replacements += replacements;
        self.vacuity.scale_downs += scale_downs;
        for dispatch in dispatches {
            let attempt = dispatch.pending.id.attempt();
            if dispatch.pending.kind.is_cleanup() && self.cleanup_failed.remove(&attempt) {
                self.vacuity.cleanup_retries += 1;
            }
            self.ever_pending.insert(dispatch.pending.id);
        }
        // The attempts the drive started, against the kit's breakers, before
        // the drive's refusals are folded into them: a probe whose create was
        // refused is out by the driver's books (finding 11). The kit sees a
        // drive's starts and refusals, not their order, so it takes the
        // starts first; a start let through after a refusal of the same drive
        // opened its group's breaker is not caught here (docs/testing.md).
        if !edge && !self.edges_reached {
            let verdict =
                self.breaker_watch
                    .drive(pre, self.driver.state(), &self.limits, self.now);
            self.check(verdict)?;
        }
        // Each refused operation, as the definite failure it was folded as:
        // the fold checks (the kit's failure count, the breaker, the
        // backoff) hold for it as for one delivered.
        for (index, op) in refused.iter().enumerate() {
            // A node inserted by the drive was new, with nothing counted.
            let inserted = || {
                self.driver.state().node(&op.node).map(|n| ManagedNode {
                    retry: provisioning::state::RetryState::default(),
                    ..n.clone()
                })
            };
            let Some(before) = pre.node(&op.node).cloned().or_else(inserted) else {
                continue;
            };
            // The driver's breakers already hold every refusal of the
            // drive: the kit's model is compared once it folded them all.
            self.more_refusals_to_fold = refused[index + 1..]
                .iter()
                .any(|other| other.node.group() == op.node.group());
            let result = ExecutorResult {
                op: op.id,
                node: op.node.clone(),
                kind: op.kind(),
                outcome: Err(provisioning::EffectError::definite(
                    "submission refused: the host's outbox is full",
                )),
            };
            // G12 (refusal form): a refusal is the host's answer, not the
            // provider's: what the provider may have done stays remembered.
            let forgot =
                before.retry.ambiguous.is_some()
                    && self.driver.state().nodes.get(&op.node).is_some_and(|n| {
                        n.attempt == before.attempt && n.retry.ambiguous.is_none()
                    });
            if forgot {
                self.more_refusals_to_fold = false;
                return Err(self.violation(breach(
                    GuaranteeId::AdoptBeforeDestroy,
                    format!(
                        "{} forgot the ambiguous {:?} when the host refused {} {}: the provider never saw the refused operation",
                        op.node,
                        before.retry.ambiguous,
                        op.kind(),
                        op.id
                    ),
                )));
            }
            let checked = self.check_fold(&op.node, &before, &FoldCause::Result(&result));
            self.more_refusals_to_fold = false;
            checked?;
        }
        Ok(())
    }

    pub(super) fn check_calls(&mut self) -> Result<(), Violation> {
        let alarms = self.substrate.take_ledger_alarms();
        if !alarms.is_empty() {
            let zombies = self.zombie_slots();
            // A resource a dead controller's call made after the crash is an
            // orphan (G28), not a double-create by this controller.
            let explained = |alarm: &String| {
                zombies
                    .iter()
                    .any(|node| alarm.contains(&format!(" {node}/")))
            };
            if let Some(alarm) = alarms.into_iter().find(|alarm| !explained(alarm)) {
                return Err(self.crash_aware(GuaranteeId::NoDoubleCreate, alarm));
            }
        }
        let (starts, zombies) = self.take_call_starts();
        for start in &starts {
            let watch = &mut self.executor_watch;
            watch.awaiting_call.remove(&start.op);
            watch.uncalled.remove(&start.op);
            if watch.waiting_behind.get(&start.op.attempt()) == Some(&start.op) {
                watch.waiting_behind.remove(&start.op.attempt());
            }
        }
        for mut call in self.substrate.take_calls() {
            // Calls of a dead controller still running in the backend are
            // beyond any executor's single flight.
            let zombie_calls = zombies.get(&call.op).copied().unwrap_or(0);
            call.overlapping = call.overlapping.saturating_sub(zombie_calls);
            let verdict = oracle::g05_one_call_per_attempt(&call)
                .and_then(|()| {
                    oracle::g04_call_was_recorded(
                        &call,
                        self.driver.state(),
                        &self.timed_out,
                        &self.ever_pending,
                        self.strict_calls,
                    )
                })
                .and_then(|()| oracle::g04_no_call_after_a_newer_one(&call, &mut self.newest_call))
                .and_then(|()| {
                    // With a deterministic substrate calls start only while
                    // work runs, and every start before an expiry was looked
                    // at before it: a start seen now came after.
                    if self.strict_calls {
                        oracle::g04_no_call_after_its_expiry(&call, &self.executor_watch.expired)
                    } else {
                        Ok(())
                    }
                });
            self.check(verdict)?;
            self.calls.push(call);
        }
        self.check_committed(&starts)
    }

    pub(super) fn remember(&mut self, delivery: Delivery) {
        if self.history.len() >= MAX_HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(delivery);
    }

    pub(super) fn is_pending(&self, node: &LogicalNodeId, op: OperationId) -> bool {
        self.driver
            .state()
            .nodes
            .get(node)
            .and_then(|n| n.pending_op())
            == Some(op)
    }

    pub(super) fn deliver_result(&mut self, result: ExecutorResult) -> Result<(), Violation> {
        self.remember(Delivery::Result(result.clone()));
        if !self.is_pending(&result.node, result.op) {
            let before = self.driver.state().clone();
            let outcome = self.driver.apply_executor_result(&result, self.now);
            self.driver_counts.fold(&outcome, false);
            self.vacuity.late_results_discarded += 1;
            let unchanged = *self.driver.state() == before;
            return self.check(if unchanged && outcome.is_err() {
                Ok(())
            } else {
                Err(breach(
                    GuaranteeId::Correlation,
                    format!(
                        "the result of {} {} for {}, which was not pending, was folded ({outcome:?}; state changed: {})",
                        result.kind, result.op, result.node, !unchanged
                    ),
                ))
            });
        }
        let before = self.driver.state().nodes.get(&result.node).cloned();
        let outcome = self.driver.apply_executor_result(&result, self.now);
        self.driver_counts.fold(&outcome, false);
        match outcome {
            Ok(()) => {}
            Err(error) if Harness::<S>::edge_error(&error) => {
                self.edges_reached = true;
                return Ok(());
            }
            Err(error @ DriverError::Rejected(_)) => {
                return Err(self.violation(breach(
                    GuaranteeId::Correlation,
                    format!(
                        "the result of the pending {} {} for {} was rejected: {error}",
                        result.kind, result.op, result.node
                    ),
                )));
            }
            Err(error) => return Err(self.unexpected("folding a result", &error)),
        }
        if let Some(before) = before {
            self.check_fold(&result.node.clone(), &before, &FoldCause::Result(&result))?;
        }
        match &result.outcome {
            Ok(EffectOutput::ConvergenceAcknowledged)
                if result.kind == EffectKind::BootstrapConvergenceObserved =>
            {
                self.executor_watch
                    .convergence_reported
                    .insert(result.op.attempt());
            }
            Ok(EffectOutput::Endpoint(EndpointLookup::NotReady)) => {
                self.vacuity.endpoint_probes += 1;
            }
            Ok(
                EffectOutput::LeaseCreated { adopted: true, .. }
                | EffectOutput::BootstrapStarted { adopted: true, .. },
            ) if self
                .durable
                .recovered_ambiguous
                .contains(&(result.op.attempt(), result.kind)) =>
            {
                self.vacuity.adoptions_after_recovery += 1;
            }
            Err(_) if result.kind.is_cleanup() => {
                self.cleanup_failed.insert(result.op.attempt());
            }
            _ => {}
        }
        Ok(())
    }

    pub(super) fn deliver_observation(
        &mut self,
        observation: Observation,
    ) -> Result<(), Violation> {
        self.remember(Delivery::Observation(observation.clone()));
        let node_id = observation.node().clone();
        let current = self
            .driver
            .state()
            .nodes
            .get(&node_id)
            .filter(|n| n.attempt == observation.attempt())
            .cloned();
        let before_state = self.driver.state().clone();
        let outcome = self.driver.apply_observation(&observation, self.now);
        self.driver_counts.fold(&outcome, false);
        let Some(before) = current else {
            let unchanged = *self.driver.state() == before_state;
            return self.check(if unchanged && outcome.is_err() {
                Ok(())
            } else {
                Err(breach(
                    GuaranteeId::AttemptFactOwnership,
                    format!(
                        "an observation of a superseded or unknown attempt was folded: {observation:?} ({outcome:?}; state changed: {})",
                        !unchanged
                    ),
                ))
            });
        };
        match outcome {
            Ok(()) => {
                self.check(oracle::g15_no_event_after_the_session_ended(
                    &node_id,
                    &before,
                    &observation,
                ))?;
                if let Observation::Bootstrap {
                    attempt,
                    event: BootstrapEvent::Joined | BootstrapEvent::Converged,
                    ..
                } = &observation
                {
                    self.executor_watch.joined.insert(*attempt);
                }
                self.check_fold(&node_id, &before, &FoldCause::Observation(&observation))
            }
            Err(error) if Harness::<S>::edge_error(&error) => {
                self.edges_reached = true;
                Ok(())
            }
            Err(DriverError::Rejected(_)) => {
                let unchanged = *self.driver.state() == before_state;
                self.check(if unchanged {
                    Ok(())
                } else {
                    Err(breach(
                        GuaranteeId::Correlation,
                        format!("a rejected observation changed the state: {observation:?}"),
                    ))
                })
            }
            Err(error) => Err(self.unexpected("folding an observation", &error)),
        }
    }

    pub(super) fn check_fold(
        &mut self,
        id: &LogicalNodeId,
        before: &ManagedNode,
        cause: &FoldCause<'_>,
    ) -> Result<(), Violation> {
        let Some(after) = self.driver.state().nodes.get(id) else {
            return Ok(());
        };
        // The kit's own count of the slot's consecutive failures: one more
        // for a fold that failed something, none once the node is ready.
        let counted = self.failures.get(id).copied().unwrap_or(0);
        let failures = if self.edges_reached {
            // An edge error may have stopped a fold halfway; from there on
            // the kit follows the driver's count.
            after.retry.consecutive_failures
        } else if after.record.ready && !before.record.ready {
            0
        } else if oracle::counts_as_failure(before, after, cause) {
            counted.saturating_add(1)
        } else {
            counted
        };
        self.failures.insert(id.clone(), failures);
        if !self.edges_reached {
            let group = id.group();
            self.breaker_watch
                .fold(group, before, after, &self.limits, self.now);
        }
        if !self.edges_reached && !self.more_refusals_to_fold {
            let group = id.group();
            let said = self.driver.breaker_open(group, self.now);
            let verdict = self.breaker_watch.agrees(group, said, &self.limits);
            self.check(verdict)?;
            let status = self.driver.breaker_status(group);
            let verdict = self.breaker_watch.status_agrees(group, status);
            self.check(verdict)?;
        }
        let after = self.driver.state().node(id).unwrap_or(before);
        let policy = self.driver.policy();
        if let FoldCause::Observation(Observation::NodeLost { .. }) = cause
            && before.intent == Intent::Deleting
            && after != before
        {
            return Err(self.violation(breach(
                GuaranteeId::CleanupKeepsFacts,
                format!(
                    "a loss folded on {id}, which was being torn down, changed it: {} -> {}",
                    oracle::describe_node(id, before),
                    oracle::describe_node(id, after)
                ),
            )));
        }
        let verdict = oracle::g32_stage_agrees_with_facts(id, after)
            .and_then(|()| oracle::g32_loss_names_what_was_lost(id, before, after, cause))
            .and_then(|()| {
                oracle::g07_facts_leave_only_on_confirmed_absence(id, before, after, cause)
            })
            .and_then(|()| {
                oracle::g09_delays_follow_the_policy(
                    id, before, after, cause, policy, self.now, failures,
                )
            })
            .and_then(|()| oracle::g11_probe_is_not_failure(id, before, after, cause))
            .and_then(|()| oracle::g12_wrong_answer_is_ambiguous(id, after, cause))
            .and_then(|()| {
                oracle::g12_ambiguity_forgotten_only_by_an_answer(id, before, after, cause)
            });
        self.check(verdict)
    }

    pub(super) fn check_state(&mut self) -> Result<(), Violation> {
        self.check_held_wake()?;
        let live = self.substrate.live_resources();
        self.check_orphans(&live)?;
        let zombies = if self.durable.crashes > 0 {
            self.zombie_slots()
        } else {
            BTreeSet::new()
        };
        let double = if zombies.is_empty() {
            oracle::g08_no_double_create(&live)
        } else {
            // Resources a dead controller's calls made after the crash are
            // orphans (G28), not double-creates of this controller.
            let mut sample = live.clone();
            let state = self.driver.state();
            let orphan_of_zombie = |key: &crate::substrate::ResourceKey| {
                zombies.contains(&key.0) && !oracle::owned(state, key)
            };
            sample.leases.retain(|key, _| !orphan_of_zombie(key));
            sample.sessions.retain(|key, _| !orphan_of_zombie(key));
            oracle::g08_no_double_create(&sample)
        };
        if let Err(double) = double {
            return Err(self.crash_aware(double.guarantee, double.detail));
        }
        let state = self.driver.state();
        let desired = self.driver.desired();
        let settled = !self.driver.is_queued();
        let lease_owner = |lease: &LeaseHandle| self.substrate.lease_owner(lease);
        let session_owner = |session: &SessionHandle| self.substrate.session_owner(session);
        let mut highest = self.highest_generation;
        if let Err(identity) = oracle::g01_identity_in_state(state)
            .and_then(|()| oracle::g01_attempts_never_come_back(state, &mut self.attempts))
        {
            return Err(self.crash_aware(identity.guarantee, identity.detail));
        }
        let verdict = oracle::g02_pending_belongs_to_current_attempt(state)
            .and_then(|()| {
                oracle::g03_facts_belong_to_current_attempt(state, &lease_owner, &session_owner)
            })
            .and_then(|()| oracle::g06_dead_nodes_hold_nothing(state))
            .and_then(|()| {
                oracle::g14_readiness_coherence(
                    state,
                    desired,
                    settled,
                    &self.limits.max_unavailable,
                )
            })
            .and_then(|()| oracle::g15_session_coherence(state))
            .and_then(|()| oracle::g32_stages_agree_with_facts(state))
            .and_then(|()| oracle::g16_generation_is_monotonic(state, desired, &mut highest))
            .and_then(|()| {
                if settled && !self.edges_reached {
                    oracle::g17_undesired_slots_are_not_active(state, &self.slots)
                } else {
                    Ok(())
                }
            })
            .and_then(|()| {
                oracle::g19_converged_has_no_requeue(
                    self.driver.is_converged(),
                    self.driver.requeue_at(),
                )
            })
            .and_then(|()| {
                oracle::g29_creates_in_flight_are_counted(
                    state,
                    super::PROVIDER_KIND,
                    self.driver.creates_in_flight(super::PROVIDER_KIND),
                )
            })
            .and_then(|()| {
                let limited = !self.limits.max_concurrent_creates.is_empty()
                    || !self.limits.max_unavailable.is_empty()
                    || !self.limits.breakers.is_empty();
                if settled && !self.edges_reached && !limited {
                    oracle::g19_settled_driver_agrees_with_plan(
                        state,
                        desired,
                        self.now,
                        self.driver.requeue_at(),
                    )
                } else {
                    Ok(())
                }
            });
        self.check(verdict)?;
        self.highest_generation = highest;
        self.check_history()?;
        let counters = self.executor.counters();
        let calls = self.durable.control.lock().live_calls;
        if !self.edges_reached
            && let Some(counted) = self.driver.counters()
        {
            let seen = self.driver_counts;
            self.check(oracle::g04_driver_counts_what_it_did(
                &counted,
                [
                    seen.passes,
                    seen.dispatched,
                    seen.refused,
                    seen.folded,
                    seen.rejected,
                    seen.timeouts,
                ],
            ))?;
        }
        self.check(oracle::g04_executor_counts_what_it_did(
            (counters.started, calls),
            (counters.expired, self.executor_watch.expired.len()),
            (counters.waited, self.executor_watch.queued_here),
        ))?;
        self.check(if counters.replayed == self.executor_watch.replayed_here {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::RecordBeforeDispatch,
                format!(
                    "the executor counts {} replayed results, but the kit saw {} submissions answered by a replay",
                    counters.replayed, self.executor_watch.replayed_here
                ),
            ))
        })?;
        let seen = {
            let control = self.durable.control.lock();
            let watch = &self.executor_watch;
            oracle::ExecutorSeen {
                taken: watch.taken_here,
                replayed: watch.replayed_here,
                notified: watch.notified.load(std::sync::atomic::Ordering::Relaxed),
                calls_ended: control.live_calls.saturating_sub(control.live_in_backend()),
                panics: control.live_panics,
                // Once no work is runnable, every operation the executor
                // said it started has had its task run.
                started_never_called: (!self.substrate.has_runnable_work())
                    .then_some(watch.awaiting_call.len() as u64),
                skipped_at_submission: watch.skipped_at_submission,
                skipped_at_expiry: watch.skipped_at_expiry,
                uncalled: watch.uncalled.len() as u64,
            }
        };
        self.check(oracle::g04_executor_accounts_for_its_results(
            &counters, &seen,
        ))?;
        Ok(())
    }

    /// G30 (wake form): while a group's breaker has its probe out, the slots
    /// it holds back (desired, with no node or a destroyed attempt waiting
    /// for its restart) are looked at again within one
    /// cool-down: the driver's next wake is no later. A probe that hangs
    /// must not hold them for good.
    fn check_held_wake(&self) -> Result<(), Violation> {
        if self.edges_reached || self.driver.is_queued() {
            return Ok(());
        }
        let state = self.driver.state();
        for group in self.limits.breakers.keys() {
            let Some(cooldown) = self.breaker_watch.probe_out(group, &self.limits, self.now) else {
                continue;
            };
            let held = (0..self.slots.count(group))
                .map(|index| LogicalNodeId::new(group.clone(), index))
                .find(|id| {
                    // No node, or one whose attempt is gone and whose restart
                    // waits on no timer of its own.
                    let due = |at: Option<Timestamp>| {
                        at.is_none_or(|at| at.as_millis() <= self.now.as_millis())
                    };
                    state.nodes.get(id).is_none_or(|n| {
                        n.record.stage == provisioning::NodeStage::Destroyed
                            && due(n.retry.restart_at)
                            && due(n.retry.next_effect_at)
                    })
                });
            let Some(held) = held else {
                continue;
            };
            let by = self.now.as_millis().saturating_add(cooldown);
            let wake = self.driver.requeue_at();
            if wake.is_none_or(|at| at.as_millis() > by) {
                return Err(self.violation(breach(
                    GuaranteeId::BreakerLiveness,
                    format!(
                        "group {group}'s breaker has its probe out and holds {held} back, but the driver's next wake is {wake:?}, not within the cool-down of {cooldown}ms (by {by}ms)"
                    ),
                )));
            }
        }
        Ok(())
    }

    /// G32 (history form): the driver's node histories agree with its nodes.
    fn check_history(&mut self) -> Result<(), Violation> {
        let watch = &self.history_watch;
        if watch.keeps_none {
            let state = self.driver.state();
            let kept = state
                .nodes
                .keys()
                .chain(watch.seen.iter())
                .find(|id| self.driver.history(id).is_some());
            return self.check(match kept {
                None => Ok(()),
                Some(id) => Err(breach(
                    GuaranteeId::StageCoherence,
                    format!("{id} has a history, but the driver was told to keep none"),
                )),
            });
        }
        if watch.depth == 0 {
            return Ok(());
        }
        let state = self.driver.state();
        let removed: BTreeSet<LogicalNodeId> = watch
            .seen
            .iter()
            .filter(|id| !state.nodes.contains_key(*id))
            .cloned()
            .collect();
        let driver = &self.driver;
        let verdict = oracle::g32_history_agrees_with_nodes(
            state,
            |id| driver.history(id),
            &watch.at_start,
            &removed,
            watch.depth,
            self.now,
        );
        self.check(verdict)?;
        // G32 (teardown form): a teardown's entry says why it began, judged
        // when the kit first sees it (against the shape that began it).
        for (id, node) in &state.nodes {
            if node.intent != Intent::Deleting
                || self.history_watch.teardowns_judged.contains(&node.attempt)
            {
                continue;
            }
            let Some(history) = driver.history(id) else {
                continue;
            };
            // The entry where the teardown began: deleting, after one that
            // was not (a recovered node's teardown began before the crash,
            // and histories are not journaled).
            let entries: Vec<&provisioning::Transition> = history.entries().collect();
            let Some(entry) = entries.windows(2).find_map(|pair| {
                let (before, entry) = (pair[0], pair[1]);
                (!before.deleting
                    && entry.deleting
                    && entry.attempt == node.attempt
                    && entry.stage != provisioning::NodeStage::Failed)
                    .then_some(entry)
            }) else {
                continue;
            };
            self.history_watch.teardowns_judged.insert(node.attempt);
            let desired = self.slots.template(id);
            self.check(oracle::g32_teardown_names_its_cause(
                id,
                entry,
                desired.map(|t| t == node.spec.template()),
            ))?;
        }
        self.history_watch.seen = self.driver.state().nodes.keys().cloned().collect();
        Ok(())
    }

    /// G19: a forced pass over the settled machine dispatches nothing,
    /// changes nothing and keeps `requeue_at`.
    pub(super) fn probe_quiescence(&mut self) -> Result<(), Violation> {
        if self.edges_reached || self.driver.is_queued() {
            return Ok(());
        }
        let before = self.driver.state().clone();
        let requeue_at = self.driver.requeue_at();
        self.driver.trigger();
        self.ask_full();
        self.durable.last_commit = (false, 0, 0);
        self.drive()?;
        let state = self.driver.state();
        if *state != before {
            let changed: Vec<String> = oracle::slot_changes(&before, state)
                .into_iter()
                .filter(|c| c.before != c.after)
                .map(|c| match (c.before, c.after) {
                    (Some(b), Some(a)) => format!(
                        "{} -> {}",
                        oracle::describe_node(c.id, b),
                        oracle::describe_node(c.id, a)
                    ),
                    (None, Some(a)) => format!("new {}", oracle::describe_node(c.id, a)),
                    (Some(b), None) => format!("removed {}", oracle::describe_node(c.id, b)),
                    (None, None) => String::new(),
                })
                .collect();
            return Err(self.violation(breach(
                GuaranteeId::Quiescence,
                format!(
                    "a forced pass over a settled machine changed it: {}",
                    changed.join("; ")
                ),
            )));
        }
        // Nothing changed, so nothing is written: a host journals every
        // wake's change set, and an idle pass must cost no write.
        let written = self.durable.last_commit;
        if written != (false, 0, 0) {
            return Err(self.violation(breach(
                GuaranteeId::Quiescence,
                format!(
                    "a forced pass over a settled machine wrote to the journal (meta {}, {} nodes, {} removals)",
                    written.0, written.1, written.2
                ),
            )));
        }
        let after = self.driver.requeue_at();
        self.check(if after == requeue_at {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::Quiescence,
                format!(
                    "a forced pass over a settled machine moved requeue_at from {requeue_at:?} to {after:?}"
                ),
            ))
        })
    }
}
