//! Delivering what the host receives to the driver — executor results and
//! substrate observations, fresh or redelivered late — and checking every
//! fold it makes (G07, G09, G11, G12, G32, and the kit's breaker model).

use provisioning::driver::DriverError;
use provisioning::{
    BootstrapEvent, EffectKind, EffectOutput, EndpointLookup, ExecutorResult, Intent,
    LogicalNodeId, ManagedNode, Observation, OperationId,
};

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::{Delivery, Harness, MAX_HISTORY};
use crate::oracle::{self, FoldCause, breach};
use crate::substrate::Substrate;

impl<S: Substrate> Harness<S> {
    pub(in crate::harness) fn remember(&mut self, delivery: Delivery) {
        if self.history.len() >= MAX_HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(delivery);
    }

    pub(in crate::harness) fn is_pending(&self, node: &LogicalNodeId, op: OperationId) -> bool {
        self.driver
            .state()
            .nodes
            .get(node)
            .and_then(|n| n.pending_op())
            == Some(op)
    }

    pub(in crate::harness) fn deliver_result(
        &mut self,
        result: ExecutorResult,
    ) -> Result<(), Violation> {
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

    pub(in crate::harness) fn deliver_observation(
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
                if let Observation::AgentRejoined { attempt, .. } = &observation {
                    self.rejoin_folded(&node_id, *attempt);
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

    pub(in crate::harness) fn check_fold(
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
        let verdict = oracle::at_fold(id, before, after, cause, policy, self.now, failures);
        self.check(verdict)
    }
}
