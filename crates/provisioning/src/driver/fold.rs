//! Folding facts into the state: the result or timeout of a pending
//! operation, and the asynchronous observations of an attempt (bootstrap
//! events, a lost node).
//!
//! A fact is checked against the node's current attempt and pending
//! operation first; a fact that does not belong is rejected and changes
//! nothing. A folded fact touches its node, so the next pass looks at it.

use super::ClusterDriver;
use super::error::{DriverError, Rejection};
use crate::effect::{EffectError, EffectKind, EffectOutput, ExecutorResult};
use crate::id::{LogicalNodeId, NodeAttemptId, OperationId};
use crate::observe::{
    FoldContext, FoldableCondition, Observation, fold_bootstrap, fold_loss, fold_operation,
    fold_rejoin, observation_fold_may_fail, operation_fold_may_fail,
};
use crate::state::{ManagedNode, NodeStage, PendingOperation};
use crate::time::{ClockSaturated, Timestamp};

impl ClusterDriver {
    /// Looks up the node a fact is about and checks the attempt.
    fn node_for_fact(
        &self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
    ) -> Result<&ManagedNode, Rejection> {
        let managed = self
            .state
            .nodes
            .get(node)
            .ok_or_else(|| Rejection::UnknownNode(node.clone()))?;
        if managed.attempt != attempt {
            return Err(Rejection::StaleAttempt {
                node: node.clone(),
                current: managed.attempt,
                got: attempt,
            });
        }
        if managed.record.stage == NodeStage::Destroyed {
            return Err(Rejection::Destroyed(node.clone()));
        }
        Ok(managed)
    }

    fn check_pending(
        &self,
        node: &LogicalNodeId,
        op: OperationId,
    ) -> Result<&PendingOperation, Rejection> {
        let managed = self.node_for_fact(node, op.attempt())?;
        managed
            .pending
            .as_ref()
            .filter(|p| p.id == op)
            .ok_or_else(|| Rejection::NotPending {
                node: node.clone(),
                op,
            })
    }

    fn count<T>(&mut self, result: Result<T, DriverError>) -> Result<T, DriverError> {
        match &result {
            Ok(_) => self.counters.folded += 1,
            Err(DriverError::Rejected(_)) => self.counters.rejected += 1,
            Err(_) => {}
        }
        result
    }

    /// Folds the result of an operation.
    ///
    /// # Errors
    /// [`DriverError::Rejected`] when the operation is not the node's pending
    /// operation (late, duplicate, or of a superseded attempt);
    /// [`DriverError::Clock`]; [`DriverError::PassInProgress`]. Nothing
    /// changes on error.
    pub fn apply_executor_result(
        &mut self,
        result: &ExecutorResult,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        let outcome = self.fold_result(&result.node, result.op, result.outcome.as_ref(), now);
        self.count(outcome)
    }

    /// Folds the timeout of a pending operation as an ambiguous failure.
    ///
    /// # Errors
    /// [`Rejection::NotYetDue`] before the stored deadline;
    /// [`Rejection::NotPending`] when the operation is no longer pending (the
    /// same timeout reported twice changes nothing); the errors of
    /// [`ClusterDriver::apply_executor_result`].
    pub fn operation_timed_out(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        let outcome = self.fold_timeout(node, op, now);
        if outcome.is_ok() {
            self.counters.timeouts += 1;
        }
        self.count(outcome)
    }

    fn fold_timeout(
        &mut self,
        node: &LogicalNodeId,
        op: OperationId,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        self.schedule.ensure_idle()?;
        let deadline = self.check_pending(node, op)?.deadline;
        if !now.reached(deadline) {
            return Err(Rejection::NotYetDue { op, deadline }.into());
        }
        let error = EffectError::timed_out();
        self.fold_result(node, op, Err(&error), now)
    }

    fn fold_result(
        &mut self,
        node_id: &LogicalNodeId,
        op: OperationId,
        outcome: Result<&EffectOutput, &EffectError>,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        self.schedule.ensure_idle()?;
        let pending = self.check_pending(node_id, op)?.clone();
        self.fold_pending(node_id, &pending, outcome, now)?;
        Ok(())
    }

    /// Folds the outcome of the node's pending operation. A fold that may
    /// fail works on a copy of the node that replaces it only on success, so
    /// an error leaves the node untouched; any other is applied in place.
    pub(super) fn fold_pending(
        &mut self,
        node_id: &LogicalNodeId,
        pending: &PendingOperation,
        outcome: Result<&EffectOutput, &EffectError>,
        now: Timestamp,
    ) -> Result<(), ClockSaturated> {
        self.fold_pending_as(node_id, pending, outcome, now, true)
    }

    /// [`ClusterDriver::fold_pending`]; `sent`: whether the operation
    /// reached the provider (not for one the sink refused).
    pub(super) fn fold_pending_as(
        &mut self,
        node_id: &LogicalNodeId,
        pending: &PendingOperation,
        outcome: Result<&EffectOutput, &EffectError>,
        now: Timestamp,
        sent: bool,
    ) -> Result<(), ClockSaturated> {
        let Some(node) = self.state.nodes.get_mut(node_id) else {
            return Ok(());
        };
        let ctx = FoldContext {
            policy: &self.policy,
            now,
            spec_is_desired: self.desired.is_desired_spec(&node.spec),
            sent,
        };
        let before = (node.record.stage == NodeStage::Failed, node.is_ready());
        if operation_fold_may_fail(pending.kind, outcome) {
            let mut next = node.clone();
            fold_operation(&mut next, pending.id, pending.kind, outcome, &ctx)?;
            *node = next;
        } else {
            let folded = fold_operation(node, pending.id, pending.kind, outcome, &ctx);
            debug_assert!(folded.is_ok(), "a fold that cannot fail failed");
            folded?;
        }
        let after = (node.record.stage == NodeStage::Failed, node.is_ready());
        let created =
            (pending.kind == EffectKind::CreateLease).then(|| node.spec.shared_template().clone());
        self.schedule.deadlines.remove(pending.deadline, node_id);
        if let Some(template) = created {
            self.create_finished(&template.provider);
        }
        self.limit_events(node_id, before, after, now);
        self.note_history_of(node_id, now);
        self.touch(node_id);
        Ok(())
    }

    /// Folds an asynchronous fact about an attempt.
    ///
    /// # Errors
    /// [`DriverError::Rejected`] for a fact of another attempt, an unknown or
    /// destroyed node, or a bootstrap event without a session;
    /// [`DriverError::Clock`]; [`DriverError::PassInProgress`]. Nothing
    /// changes on error.
    pub fn apply_observation(
        &mut self,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        let outcome = self.fold_observation(observation, now);
        self.count(outcome)
    }

    fn fold_observation(
        &mut self,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(), DriverError> {
        self.schedule.ensure_idle()?;
        let node_id = observation.node();
        self.node_for_fact(node_id, observation.attempt())?;
        let Some(node) = self.state.nodes.get_mut(node_id) else {
            return Err(Rejection::UnknownNode(node_id.clone()).into());
        };
        let ctx = FoldContext {
            policy: &self.policy,
            now,
            spec_is_desired: self.desired.is_desired_spec(&node.spec),
            sent: true,
        };
        let fold = |node: &mut ManagedNode| -> Result<(), DriverError> {
            match observation {
                Observation::Bootstrap { event, .. } => {
                    fold_bootstrap(node, event, &ctx)?.map_err(|reason| Rejection::Bootstrap {
                        node: node_id.clone(),
                        reason,
                    })?;
                }
                Observation::NodeLost { cause, .. } => fold_loss(node, *cause, &ctx)?,
                Observation::AgentRejoined { .. } => fold_rejoin(node, &ctx),
            }
            Ok(())
        };
        let before = (node.record.stage == NodeStage::Failed, node.is_ready());
        let changed = if observation_fold_may_fail(node, observation) {
            let mut next = node.clone();
            fold(&mut next)?;
            let changed = next != *node;
            *node = next;
            changed
        } else {
            // Cannot fail, and rejects before it changes anything.
            let condition = FoldableCondition::of(node);
            fold(node)?;
            FoldableCondition::of(node) != condition
        };
        let after = (node.record.stage == NodeStage::Failed, node.is_ready());
        // Folded, whether or not it changed what is journaled.
        self.steady.remove(node_id);
        if changed {
            self.limit_events(node_id, before, after, now);
            self.note_history_of(node_id, now);
            self.touch(node_id);
        }
        Ok(())
    }
}
