//! The commit protocol of a durable host (G27): each wake drives the
//! driver into a `Batch`, commits the drive's change set as one
//! transaction and only then submits the buffered operations. A failed
//! commit submits nothing: each buffered operation is folded as a definite
//! failure (it never reached a provider) and retried after backoff. At
//! shutdown the last changes are committed and a clean teardown marks the
//! state clean.

use provisioning::{
    ClusterDriver, EffectError, ExecutorResult, IdempotentEffectExecutor, NodeAttemptId, Operation,
    OperationSink, SubmitError, Timestamp,
};
use provisioning_provider::PluginBackendAdapter;
use tokio::time::Instant;

use super::host_side::DurableLoop;
use crate::fold::fold_result;
use crate::status::Progress;

/// Collects a drive's operations so they are submitted only after the
/// drive's changes are committed.
#[derive(Default)]
struct Batch {
    operations: Vec<Operation>,
    retired: Vec<NodeAttemptId>,
}

impl OperationSink for Batch {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        self.operations.push(operation);
        Ok(())
    }

    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        self.retired.push(attempt);
    }
}

impl DurableLoop {
    /// Commits the driver's changes; on failure nothing of this drive may
    /// be submitted.
    fn commit(
        &mut self,
        driver: &mut ClusterDriver,
        now: Timestamp,
        view: &mut Progress,
    ) -> Result<(), String> {
        let changes = driver.take_changes(now);
        if changes.is_empty() {
            return Ok(());
        }
        let encoded = self.codec.encode_view(&changes);
        // The encoded rows are all the journal needs: the ids move on to
        // the progress view, uncopied.
        view.note_nodes(changes.into_nodes());
        let outcome = encoded
            .map_err(|e| e.to_string())
            .and_then(|rows| self.journal.commit(&rows).map_err(|e| e.to_string()));
        match &outcome {
            Ok(()) => {
                if self.journal_error.take().is_some() {
                    tracing::info!("the state journal is writable again");
                }
            }
            Err(error) => {
                // The changes are lost from the tracker; a full rewrite of
                // what may be missing follows the next successful commit.
                driver.track_changes();
                view.invalidate();
                if self.journal_error.as_deref() != Some(error.as_str()) {
                    tracing::error!(
                        "the state journal could not be written; nothing is submitted until it can: {error}"
                    );
                }
                self.journal_error = Some(error.clone());
            }
        }
        outcome
    }

    /// One wake's drive: into a batch, then the commit, then the batch's
    /// retirements and submissions (or, when the commit failed, each
    /// operation folded as a definite failure). Returns whether the drive
    /// changed something a snapshot shows.
    pub(crate) fn drive(
        &mut self,
        driver: &mut ClusterDriver,
        executor: &mut IdempotentEffectExecutor<PluginBackendAdapter>,
        now: Timestamp,
        view: &mut Progress,
        metrics: bool,
    ) -> bool {
        let mut batch = Batch::default();
        let started = metrics.then(Instant::now);
        match driver.drive_until_blocked(now, &mut batch) {
            Ok(report) => {
                if let Some(started) = started {
                    crate::metrics::drive(report.passes, started.elapsed());
                }
            }
            Err(error) => tracing::warn!("reconcile pass failed: {error}"),
        }
        let changed = driver.has_changes();
        // G27: the drive's changes, its dispatches among them, are
        // durable before any of its operations reaches a provider.
        let committed = self.commit(driver, now, view);
        for attempt in batch.retired {
            executor.retire(attempt);
        }
        for operation in batch.operations {
            let refused = match &committed {
                Ok(()) => match executor.submit(operation.clone()) {
                    Ok(_) => continue,
                    Err(refused) => format!("submission refused: {refused}"),
                },
                Err(error) => format!("the state journal could not be written: {error}"),
            };
            let result = ExecutorResult {
                op: operation.id,
                node: operation.node.clone(),
                kind: operation.kind(),
                outcome: Err(EffectError::definite(refused)),
            };
            fold_result(driver, &result, now, metrics);
        }
        changed
    }

    /// The last commit, when the loop ends; a clean teardown (`clean`: no
    /// node is left) whose commit succeeded marks the state clean, anything
    /// else leaves it for the next start to resume.
    pub(crate) fn close(
        &mut self,
        driver: &mut ClusterDriver,
        now: Timestamp,
        view: &mut Progress,
        clean: bool,
    ) {
        let committed = self.commit(driver, now, view);
        if clean && committed.is_ok() {
            match self.journal.mark_clean() {
                Ok(()) => tracing::info!("state marked clean"),
                Err(error) => tracing::error!("cannot mark the state clean: {error}"),
            }
        } else if !clean {
            tracing::warn!("the state stays unclean: the next start resumes this run");
        }
    }
}
