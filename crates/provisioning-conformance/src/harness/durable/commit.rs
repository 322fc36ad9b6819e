//! Journaling before dispatch (G27): per wake the host drives the driver
//! into a [`Batch`], commits the drive's change set and only then submits
//! the batch to the executor, as the real host does. Commits take the
//! driver's changes in turn the three ways a host may (a change set; the
//! changed ids read back from the durable state; "anything changed?" with
//! the whole state written and the changes discarded), and submissions go
//! through the executor's inherent `submit` and its two sink faces in turn.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::driver::{OperationSink, SubmitError};
use provisioning::executor::Submitted;
use provisioning::{
    DriverChanges, EffectError, EffectKind, ExecutorResult, LogicalNodeId, NodeAttemptId, Operation,
};

use super::options::HostOrder;
use crate::driver_under_test::{ChangeRead, TakenChanges};
use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::Harness;
use crate::journal::InMemoryJournal;
use crate::oracle::{self, breach};
use crate::substrate::Substrate;

/// Collects a drive's operations so they are submitted only after the
/// drive's changes are committed.
#[derive(Default)]
pub(in crate::harness) struct Batch {
    pub(in crate::harness) operations: Vec<Operation>,
    pub(in crate::harness) retired: Vec<NodeAttemptId>,
    /// Armed refusals (`refuse` inputs): each refuses the next operation of
    /// its kind (`None`: of any kind), in order.
    pub(in crate::harness) refuse: Vec<Option<EffectKind>>,
    /// The operations this sink refused.
    pub(in crate::harness) refused: Vec<Operation>,
}

impl OperationSink for Batch {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        let kind = operation.kind();
        // At most one refusal per node and drive: the kit judges each as one
        // fold between the drive's start and end.
        let again = self.refused.iter().any(|r| r.node == operation.node);
        if let Some(armed) = self
            .refuse
            .iter()
            .position(|target| target.is_none_or(|k| k == kind))
            .filter(|_| !again)
        {
            self.refuse.remove(armed);
            self.refused.push(operation);
            return Err(SubmitError::Refused("the host's outbox is full".to_owned()));
        }
        self.operations.push(operation);
        Ok(())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.retired.push(attempt);
    }
}

impl<S: Substrate> Harness<S> {
    /// The driver's changes were committed: the journal holds the breakers
    /// as the kit's model has them. Past an edge the kit stops following the
    /// breakers (a fold may have stopped halfway; finding 13), so from then on
    /// it cannot say what the journal holds of them: every group is unknown.
    fn breakers_committed(&mut self) {
        if self.edges_reached {
            let groups: Vec<_> = self.driver.desired().groups().keys().cloned().collect();
            self.breaker_watch.lose_track(groups);
        }
        self.breaker_watch.committed();
    }

    /// Commits the driver's changes since the last commit. On failure the
    /// driver tracks everything again, so the next commit rewrites it all.
    ///
    /// The changes are taken in turn the three ways a host may take them:
    /// as a change set; as the ids of the changed nodes and whether anything
    /// else changed, the host reading those nodes and the meta itself; and
    /// by asking only *whether* something changed, writing the whole state
    /// then and discarding the changes. All three must keep the journal
    /// equal to the driver's durable state (G26, commit form).
    pub(in crate::harness) fn commit(&mut self) -> Result<(), String> {
        let way = self.durable.commits % 3;
        self.durable.commits += 1;
        let changes = match way {
            1 => self.changes_from_ids(),
            2 => self.changes_as_snapshot(),
            _ => self.change_set(),
        };
        self.durable.last_commit = (
            changes.meta.is_some(),
            changes.upserts.len(),
            changes.removed.len(),
        );
        if changes.is_empty() {
            // Nothing to write: the journal already holds what the driver
            // has, breakers included.
            self.breakers_committed();
            self.check_replica();
            return Ok(());
        }
        if self.durable.commit_breach.is_none() {
            self.durable.commit_breach =
                oracle::g26_write_carries_the_clock(&changes, self.now).err();
        }
        match self.journal.commit(&changes) {
            Ok(()) => {
                self.breakers_committed();
                let mut control = self.durable.control.lock();
                for entry in &changes.upserts {
                    if let Some(pending) = &entry.node.pending {
                        control.committed.insert(pending.id);
                    }
                }
                drop(control);
                match (&mut self.durable.replica, &changes.meta) {
                    (Some(replica), _) => replica.apply(changes),
                    (None, Some(_)) => {
                        let mut fresh = InMemoryJournal::new();
                        fresh.apply(changes);
                        self.durable.replica = Some(fresh);
                    }
                    (None, None) => {}
                }
                self.check_replica();
                Ok(())
            }
            Err(error) => {
                self.driver.track_changes();
                Err(error)
            }
        }
    }

    /// The changes as a host that journals them takes them: a change set.
    fn change_set(&mut self) -> DriverChanges {
        match self.driver.take_changes(self.now, ChangeRead::ChangeSet) {
            TakenChanges::ChangeSet(changes) => changes,
            TakenChanges::Ids { .. } | TakenChanges::Discarded => {
                // The changes are gone unread: everything is taken again.
                self.durable.commit_breach = Some(breach(
                    GuaranteeId::CrashSafety,
                    "the driver was asked for a change set and handed out something else"
                        .to_owned(),
                ));
                self.driver.track_changes();
                DriverChanges::default()
            }
        }
    }

    /// The changes as a host that keeps its own view takes them: the ids of
    /// the nodes that changed, and whether anything is to be written, the
    /// nodes and the meta read from the driver's durable state. A driver
    /// that hands out a change set instead is taken at its word.
    fn changes_from_ids(&mut self) -> DriverChanges {
        let (ids, written) = match self.driver.take_changes(self.now, ChangeRead::Ids) {
            TakenChanges::Ids { nodes, written } => (nodes, written),
            TakenChanges::ChangeSet(changes) => return changes,
            TakenChanges::Discarded => {
                // Nothing tells what changed: everything is taken again.
                self.driver.track_changes();
                return self.change_set();
            }
        };
        if !written {
            return DriverChanges::default();
        }
        let Some(whole) = self.driver.durable_state(self.now) else {
            // It names its changed nodes but cannot show its durable state:
            // everything is taken again, as a change set.
            self.driver.track_changes();
            return self.change_set();
        };
        // A journaling host writes the meta with every write: it carries the
        // clock the written instants are read against.
        let mut changes = DriverChanges {
            meta: Some(whole.meta.clone()),
            ..DriverChanges::default()
        };
        let by_id: BTreeMap<&LogicalNodeId, &provisioning::DurableEntry> =
            whole.nodes.iter().map(|e| (&e.node.node, e)).collect();
        for id in ids {
            match by_id.get(&id) {
                Some(entry) => changes.upserts.push((*entry).clone()),
                None => changes.removed.push(id),
            }
        }
        changes
    }

    /// The changes as a host that only asks whether something changed takes
    /// them: then the whole state (and the removal of every node the
    /// journal holds that the driver no longer has), the changes taken and
    /// discarded unread. Afterwards the driver must say nothing is waiting.
    /// A driver that cannot say, or cannot show its durable state, hands
    /// out a change set; so does one that answers the discard with one.
    fn changes_as_snapshot(&mut self) -> DriverChanges {
        let Some(waiting) = self.driver.has_changes() else {
            return self.change_set();
        };
        if !waiting {
            return DriverChanges::default();
        }
        let Some(whole) = self.driver.durable_state(self.now) else {
            return self.change_set();
        };
        match self.driver.take_changes(self.now, ChangeRead::Nothing) {
            TakenChanges::ChangeSet(changes) => return changes,
            TakenChanges::Ids { .. } | TakenChanges::Discarded => {}
        }
        if self.driver.has_changes() != Some(false) {
            self.durable.commit_breach = Some(breach(
                GuaranteeId::CrashSafety,
                "the driver's changes were discarded, but it still says changes are waiting"
                    .to_owned(),
            ));
        }
        let kept: BTreeSet<&LogicalNodeId> = whole.nodes.iter().map(|e| &e.node.node).collect();
        let removed = self
            .durable
            .replica
            .iter()
            .filter_map(InMemoryJournal::held)
            .flat_map(|(_, nodes)| nodes.keys())
            .filter(|id| !kept.contains(id))
            .cloned()
            .collect();
        DriverChanges {
            meta: Some(whole.meta),
            upserts: whole.nodes,
            removed,
        }
    }

    /// Makes a drive durable and hands its operations out, in the host's
    /// order; an armed crash fires between the two steps.
    pub(in crate::harness) fn hand_out(&mut self, batch: Batch) -> Result<(), Violation> {
        let crash_now = self.durable.crash_armed && !batch.operations.is_empty();
        // A host that only asks whether to write (and skips the write
        // otherwise) must get the same answer as one that takes the changes.
        self.durable.changes_waiting = self.driver.has_changes();
        match self.options.host.order {
            HostOrder::CommitThenSubmit => {
                let committed = self.commit();
                self.check_changes_waiting()?;
                if crash_now {
                    return self.crash_mid_wake();
                }
                self.submit_batch(batch, committed)
            }
            HostOrder::SubmitThenCommit => {
                self.submit_batch(batch, Ok(()))?;
                if crash_now {
                    return self.crash_mid_wake();
                }
                // Too late to hold anything back if it fails.
                let _ = self.commit();
                self.check_changes_waiting()?;
                Ok(())
            }
        }
    }

    /// G19 (change form): what the driver said was waiting before the
    /// commit agrees with what the commit found.
    fn check_changes_waiting(&mut self) -> Result<(), Violation> {
        if let Some(found) = self.durable.commit_breach.take() {
            return Err(self.violation(found));
        }
        let Some(waiting) = self.durable.changes_waiting.take() else {
            return Ok(());
        };
        let written = self.durable.last_commit != (false, 0, 0);
        self.check(if waiting == written {
            Ok(())
        } else {
            Err(oracle::breach(
                GuaranteeId::Quiescence,
                format!(
                    "the driver said changes were {}waiting, but the change set it gave was {}empty",
                    if waiting { "" } else { "not " },
                    if written { "not " } else { "" }
                ),
            ))
        })
    }

    fn submit_batch(
        &mut self,
        batch: Batch,
        committed: Result<(), String>,
    ) -> Result<(), Violation> {
        for (index, attempt) in batch.retired.into_iter().enumerate() {
            // Retired through the executor's sink faces, as a host whose
            // driver drives straight into it would (both of them, in turn).
            if index % 2 == 0 {
                OperationSink::attempt_retired(&mut self.executor, attempt);
            } else {
                let mut sink = &self.executor;
                sink.attempt_retired(attempt);
            }
            self.executor_watch.retired.insert(attempt);
        }
        for operation in batch.operations {
            let refused = match &committed {
                Ok(()) => match self.submit_in_turn(operation.clone()) {
                    Ok(submitted) => {
                        self.watch_waiting(&operation, submitted);
                        if submitted == Submitted::Queued {
                            self.executor_watch.queued_here += 1;
                            self.vacuity.queued_submissions += 1;
                        }
                        if submitted == Submitted::Replayed {
                            self.executor_watch.replayed_here += 1;
                        }
                        if matches!(submitted, Submitted::Started | Submitted::Queued) {
                            // Taken and not yet run: the executor has it in
                            // flight, and says it has work.
                            let shown = self.executor.in_flight().contains(&operation.id);
                            if !shown || !self.executor.has_work() {
                                return Err(self.violation(oracle::breach(
                                    GuaranteeId::RecordBeforeDispatch,
                                    format!(
                                        "the executor took {} {} but {}",
                                        operation.kind(),
                                        operation.id,
                                        if shown {
                                            "says it has no work"
                                        } else {
                                            "does not list it in flight"
                                        }
                                    ),
                                )));
                            }
                        }
                        self.watch_submission(operation);
                        continue;
                    }
                    Err(refused) => format!("submission refused: {refused}"),
                },
                Err(error) => format!("the journal could not be written: {error}"),
            };
            let result = ExecutorResult {
                op: operation.id,
                node: operation.node.clone(),
                kind: operation.kind(),
                outcome: Err(EffectError::definite(refused)),
            };
            self.deliver_result(result)?;
        }
        Ok(())
    }

    /// Hands `operation` to the executor through its inherent `submit` and
    /// its two `OperationSink` faces in turn, as hosts do (one whose driver
    /// drives straight into the executor uses a face). A face says only
    /// whether the operation was taken; how it was taken is read from the
    /// executor's replay and wait counts and its in-flight list, and a face
    /// that took nothing shows as an operation said started and not in
    /// flight (G04).
    fn submit_in_turn(&mut self, operation: Operation) -> Result<Submitted, SubmitError> {
        let turn = self.executor_watch.submissions % 3;
        self.executor_watch.submissions += 1;
        if turn == 0 {
            return self.executor.submit(operation);
        }
        let before = self.executor.counters();
        let running = self.executor.in_flight().contains(&operation.id);
        if turn == 1 {
            OperationSink::submit(&mut self.executor, operation)?;
        } else {
            let mut sink = &self.executor;
            OperationSink::submit(&mut sink, operation)?;
        }
        let after = self.executor.counters();
        Ok(if after.replayed > before.replayed {
            Submitted::Replayed
        } else if after.waited > before.waited {
            Submitted::Queued
        } else if running {
            Submitted::AlreadyRunning
        } else {
            Submitted::Started
        })
    }

    /// Notes what `submitted` says of `operation` for the kit's count of
    /// skipped operations: one said started waits for its call; one said
    /// queued waits behind its attempt's older operation; and one said
    /// started or queued while an older one of its attempt still waited
    /// (never called yet, not expired through the executor) means that
    /// older one was skipped — it must never reach the backend after a
    /// newer one.
    fn watch_waiting(&mut self, operation: &Operation, submitted: Submitted) {
        let attempt = operation.attempt();
        if matches!(submitted, Submitted::Started | Submitted::Queued) {
            self.executor_watch.uncalled.insert(operation.id);
        }
        let older = match submitted {
            Submitted::Started => {
                self.executor_watch.awaiting_call.insert(operation.id);
                self.executor_watch.waiting_behind.remove(&attempt)
            }
            // A newer operation queued in its place: the older one no
            // longer waits either.
            Submitted::Queued => self
                .executor_watch
                .waiting_behind
                .insert(attempt, operation.id),
            Submitted::AlreadyRunning | Submitted::Replayed => None,
        };
        if let Some(older) = older {
            // A call may have started since the harness last took the
            // starts (a pass between deliveries submits).
            let called = self
                .durable
                .control
                .lock()
                .starts
                .iter()
                .any(|s| s.op == older);
            if !called {
                self.executor_watch.skipped_at_submission += 1;
                self.vacuity.skipped_at_submission += 1;
            }
        }
    }
}
