//! Folding what the executor and the plugins report into the driver, as
//! the host loop and its durable side both do: a fact the driver refuses is
//! logged and dropped, never an error of the loop.

use std::time::Duration;

use provisioning::{ClusterDriver, ExecutorResult, Observation, Timestamp};

/// Folds an executor result, recording the operation's latency when the
/// host reports metrics.
pub(crate) fn fold_result(
    driver: &mut ClusterDriver,
    result: &ExecutorResult,
    now: Timestamp,
    metrics: bool,
) {
    if metrics {
        let latency = driver
            .state()
            .nodes
            .get(&result.node)
            .and_then(|node| node.pending.as_ref())
            .filter(|pending| pending.id == result.op)
            .map(|pending| {
                Duration::from_millis(
                    now.as_millis()
                        .saturating_sub(pending.dispatched_at.as_millis()),
                )
            });
        crate::metrics::operation(result, latency);
    }
    match driver.apply_executor_result(result, now) {
        Ok(()) => match &result.outcome {
            Err(error) => {
                tracing::debug!(node = %result.node, op = %result.op, kind = %result.kind, "operation failed: {error}");
            }
            Ok(_) => {
                tracing::trace!(node = %result.node, op = %result.op, kind = %result.kind, "operation succeeded");
            }
        },
        Err(error) => {
            tracing::debug!(node = %result.node, op = %result.op, "result not folded: {error}");
        }
    }
}

/// Folds a plugin observation.
pub(crate) fn fold_observation(
    driver: &mut ClusterDriver,
    observation: &Observation,
    now: Timestamp,
) {
    if let Err(error) = driver.apply_observation(observation, now) {
        tracing::debug!(node = %observation.node(), "observation not folded: {error}");
    }
}
