//! Time: host wake-ups at stored deadlines and operation timeouts (G25).

use provisioning::driver::{DriverError, DueOperation, Rejection};
use provisioning::{
    EffectError, EffectKind, ExecutorResult, LogicalNodeId, OperationId, Timestamp,
};

use super::{Delivery, Harness, MAX_WAKES_PER_TICK};
use crate::guarantee::{GuaranteeId, Violation};
use crate::oracle::{self, FoldCause, breach};
use crate::substrate::Substrate;

impl<S: Substrate> Harness<S> {
    /// Moves the clock to `target`, waking at every stored deadline on the way.
    pub(super) fn advance_to(&mut self, target: Timestamp) -> Result<(), Violation> {
        for _ in 0..MAX_WAKES_PER_TICK {
            match self.driver.requeue_at() {
                Some(wake)
                    if oracle::later_than(wake, self.now) && oracle::at_or_after(target, wake) =>
                {
                    self.probe_deadline_boundary(wake)?;
                    self.now = wake;
                    self.settle()?;
                    self.orphan_wake()?;
                }
                _ => break,
            }
        }
        if oracle::later_than(target, self.now) {
            self.now = target;
        }
        self.settle()?;
        self.orphan_wake()?;
        self.settle()
    }

    /// G25: one tick before `wake`, no operation whose deadline is `wake` is
    /// due, and reporting its timeout is refused and changes nothing.
    fn probe_deadline_boundary(&mut self, wake: Timestamp) -> Result<(), Violation> {
        let Some(early) = wake.as_millis().checked_sub(1).map(Timestamp::from_millis) else {
            return Ok(());
        };
        let at_deadline: Vec<(LogicalNodeId, OperationId)> = self
            .driver
            .state()
            .nodes
            .iter()
            .filter_map(|(id, node)| {
                let pending = node.pending.as_ref()?;
                (pending.deadline.as_millis() == wake.as_millis()).then(|| (id.clone(), pending.id))
            })
            .collect();
        if at_deadline.is_empty() {
            return Ok(());
        }
        let due_early = self.driver.pending_operations_due(early);
        for (node, op) in at_deadline {
            if due_early.iter().any(|d| d.op == op) {
                return Err(self.violation(breach(
                    GuaranteeId::DeadlineBoundary,
                    format!(
                        "{node} {op} is listed due at {early}, a tick before its deadline {wake}"
                    ),
                )));
            }
            let before = self.driver.state().clone();
            let outcome = self.driver.operation_timed_out(&node, op, early);
            self.driver_counts.fold(&outcome, true);
            let refused = matches!(
                outcome,
                Err(DriverError::Rejected(Rejection::NotYetDue { .. }))
            );
            if !refused || *self.driver.state() != before {
                return Err(self.violation(breach(
                    GuaranteeId::DeadlineBoundary,
                    format!(
                        "the timeout of {node} {op} reported at {early}, a tick before its deadline {wake}, was not refused: {outcome:?}"
                    ),
                )));
            }
        }
        Ok(())
    }

    /// Folds the timeouts of every operation whose deadline has passed.
    /// Returns whether any was folded.
    pub(super) fn fold_due_timeouts(&mut self) -> Result<bool, Violation> {
        let due = self.driver.pending_operations_due(self.now);
        self.check_due_list(&due)?;
        let mut folded = false;
        for item in due {
            if self.is_pending(&item.node, item.op) {
                folded |= self.fold_timeout(&item)?;
            }
        }
        Ok(folded)
    }

    /// G25: the due list holds exactly the pending operations whose deadline
    /// is at or before now.
    fn check_due_list(&self, due: &[DueOperation]) -> Result<(), Violation> {
        let now = self.now;
        if let Some(early) = due
            .iter()
            .find(|item| !oracle::at_or_after(now, item.deadline))
        {
            return Err(self.violation(breach(
                GuaranteeId::DeadlineBoundary,
                format!(
                    "{} {} listed due at {now} before its deadline {}",
                    early.node, early.op, early.deadline
                ),
            )));
        }
        let missing = self.driver.state().nodes.iter().find_map(|(id, node)| {
            let pending = node.pending.as_ref()?;
            let listed = due.iter().any(|d| d.node == *id && d.op == pending.id);
            (oracle::at_or_after(now, pending.deadline) && !listed)
                .then(|| format!("{id} {}", pending.id))
        });
        match missing {
            Some(missing) => Err(self.violation(breach(
                GuaranteeId::DeadlineBoundary,
                format!("{missing} is past its deadline at {now} but not listed due"),
            ))),
            None => Ok(()),
        }
    }

    /// Folds one timeout, through the executor's expiry or straight to the
    /// driver (alternating by operation sequence parity, as design §5 allows
    /// both), then reports it a second time, which must change nothing.
    /// Returns whether it was folded (a saturated clock may refuse it).
    fn fold_timeout(&mut self, item: &DueOperation) -> Result<bool, Violation> {
        let now = self.now;
        let before = self.driver.state().nodes.get(&item.node).cloned();
        let via_executor = item.op.sequence().get() % 2 == 0;
        let expired = via_executor
            .then(|| self.executor.expire(item.op))
            .flatten();
        if expired.is_some() {
            self.executor_watch.expired.insert(item.op);
            let watch = &mut self.executor_watch;
            if watch.waiting_behind.get(&item.op.attempt()) == Some(&item.op) {
                // It waited, never called: expired now, it never will be.
                watch.waiting_behind.remove(&item.op.attempt());
                watch.skipped_at_expiry += 1;
                self.vacuity.skipped_at_expiry += 1;
            }
        } else if via_executor && self.strict_calls {
            // With a deterministic substrate every result of work that ran
            // was taken before timeouts are folded: an accepted operation
            // without a published result is still in the executor's hands,
            // and its first expiry must answer with the timeout (or its
            // late completion would not be dropped).
            let watch = &self.executor_watch;
            self.check(oracle::g02_executor_expires_what_it_holds(
                item.op,
                watch.accepted_here.contains(&item.op)
                    && !watch.published_here.contains(&item.op)
                    && !watch.expired.contains(&item.op),
            ))?;
        }
        let (outcome, result) = match expired {
            Some(result) => {
                let outcome = self.driver.apply_executor_result(&result, now);
                self.driver_counts.fold(&outcome, false);
                (outcome, result)
            }
            None => {
                let kind = before
                    .as_ref()
                    .and_then(|n| n.pending.as_ref())
                    .map_or(EffectKind::CreateLease, |p| p.kind);
                let result = ExecutorResult {
                    op: item.op,
                    node: item.node.clone(),
                    kind,
                    outcome: Err(EffectError::timed_out()),
                };
                let outcome = self.driver.operation_timed_out(&item.node, item.op, now);
                self.driver_counts.fold(&outcome, true);
                (outcome, result)
            }
        };
        match outcome {
            Ok(()) => {}
            Err(error) if Harness::<S>::edge_error(&error) => {
                self.edges_reached = true;
                return Ok(false);
            }
            Err(error) => {
                return Err(self.violation(breach(
                    GuaranteeId::DeadlineBoundary,
                    format!(
                        "the timeout of {} {} at its deadline {} was refused: {error}",
                        item.node, item.op, item.deadline
                    ),
                )));
            }
        }
        self.vacuity.timeouts += 1;
        self.timed_out.insert(item.op);
        self.remember(Delivery::Result(result.clone()));
        if let Some(before) = before {
            self.check_fold(&item.node, &before, &FoldCause::Result(&result))?;
        }
        if result.kind.is_cleanup() {
            self.cleanup_failed.insert(item.op.attempt());
        }
        let snapshot = self.driver.state().clone();
        let again = self.driver.operation_timed_out(&item.node, item.op, now);
        self.driver_counts.fold(&again, true);
        if again.is_ok() || *self.driver.state() != snapshot {
            return Err(self.violation(breach(
                GuaranteeId::Correlation,
                format!(
                    "the timeout of {} {} reported a second time was folded again: {again:?}",
                    item.node, item.op
                ),
            )));
        }
        Ok(true)
    }
}
