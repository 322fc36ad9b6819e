//! Applying a trace's inputs: clock ticks, shape changes and revision
//! probes, scripted faults and refusals, work run, stream events,
//! redeliveries and resubmissions, limit changes, resumes, crashes and
//! losses. Each input ends by settling the machine.

use std::sync::Arc;
use std::time::Duration;

use provisioning::driver::DriverError;
use provisioning::{
    BreakerPolicy, DesiredUpdate, GroupId, LogicalNodeId, LogicalNodeSpec, MaxUnavailable,
    NodeAttemptId,
};

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::{Delivery, Harness, MAX_HISTORY};
use crate::oracle::{self, breach};
use crate::substrate::Substrate;
use crate::trace::{Input, LimitChange, RevisionProbe};

impl<S: Substrate> Harness<S> {
    /// Applies a trace's limit change to the kit's model of the limits.
    fn change_limit(&mut self, change: LimitChange) {
        match change {
            LimitChange::Cap { count: 0 } => {
                self.limits.max_concurrent_creates.clear();
            }
            LimitChange::Cap { count } => {
                self.limits
                    .max_concurrent_creates
                    .insert(crate::harness::PROVIDER_KIND.to_owned(), count);
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

    pub(super) fn apply(&mut self, input: &Input) -> Result<(), Violation> {
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
            Input::Rejoin => {
                self.rejoin_agents(false);
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
    pub(in crate::harness) fn watch_submission(&mut self, operation: provisioning::Operation) {
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

    pub(super) fn submit_shape(&mut self) -> Result<(), Violation> {
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
}
