//! Settling and driving: folding everything the executor and substrate
//! have, then running the driver's queued passes — every second drive
//! split into plan and application so that each pass can be held to its
//! plan (G19) — and handing out what they dispatched.

use std::collections::BTreeMap;

use provisioning::driver::{DriveReport, DriverError, NodeError};
use provisioning::{EffectKind, GroupId, LogicalNodeId, MaxUnavailable};

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::durable::Batch;
use crate::harness::{Harness, MAX_SETTLE_ROUNDS, summarize};
use crate::oracle::{self, breach};
use crate::substrate::Substrate;

impl<S: Substrate> Harness<S> {
    /// Folds everything available and drives until nothing moves.
    pub(in crate::harness) fn settle(&mut self) -> Result<(), Violation> {
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

    pub(in crate::harness) fn edge_error(error: &DriverError) -> bool {
        match error {
            DriverError::Clock(_) => true,
            DriverError::NodeErrors(errors) => errors
                .iter()
                .all(|(_, e)| matches!(e, NodeError::Id(_) | NodeError::Clock(_))),
            _ => false,
        }
    }

    pub(in crate::harness) fn unexpected(&self, what: &str, error: &DriverError) -> Violation {
        self.violation(breach(
            GuaranteeId::ErrorsNotPanics,
            format!("{what} failed with an unexpected error: {error}"),
        ))
    }

    /// Runs queued passes; returns whether any pass ran.
    pub(in crate::harness) fn drive(&mut self) -> Result<bool, Violation> {
        let due_timer = self
            .driver
            .requeue_at()
            .is_some_and(|t| oracle::at_or_after(self.now, t));
        if !self.driver.is_queued() && !due_timer {
            // A host hands out the membership after every wake, drive or
            // not: folds alone can change it.
            self.check_peers_update()?;
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
        self.check_peers_update()?;
        self.hand_out(batch)?;
        Ok(passes > 0)
    }

    /// Takes the membership as a host does after a drive, to push it to the
    /// agents, and holds it to the driver's state now (G35).
    fn check_peers_update(&mut self) -> Result<(), Violation> {
        if self.edges_reached {
            return Ok(());
        }
        let Some(membership) = self.driver.take_membership() else {
            return Ok(());
        };
        let verdict = oracle::g35_update_lists_exactly_the_ready_attempts(
            &membership,
            self.driver.state(),
            &mut self.membership,
        );
        self.check(verdict)
    }

    /// Something asked the driver for a full pass (a changed shape, new
    /// limits, a resume, a trigger): its next pass must be full.
    pub(super) fn ask_full(&mut self) {
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
                    .get(crate::harness::PROVIDER_KIND)
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
}
