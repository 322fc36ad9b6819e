//! G37, readiness is re-earned: after a controller crash and recovery, a node
//! the journal held as ready is not ready, and the cluster not converged,
//! before an observation of the new controller says its agent re-joined.
//!
//! Checked at every recovery and after every input.

use std::collections::BTreeSet;

use provisioning::{ClusterState, LogicalNodeId, NodeAttemptId, NodeStage, RetryPolicy, Timestamp};

use super::model::plus_ms;
use super::observed::SlotChange;
use super::verdict::{Verdict, breach, ensure, label};
use crate::guarantee::GuaranteeId;

/// Whether a drive lost a rejoining node when its rejoin window ended: the
/// same attempt, rejoining before and failed after. The only failure a pass
/// makes (every other comes with a fold).
pub(crate) fn rejoin_expired(change: &SlotChange<'_>) -> bool {
    matches!(
        (change.before, change.after),
        (Some(before), Some(after))
            if before.attempt == after.attempt
                && before.record.stage == NodeStage::Rejoining
                && after.record.failure.is_some()
    )
}

/// G09 (rejoin form): a node lost at the end of its rejoin window restarts
/// after the policy's backoff for the kit's count of the slot's failures,
/// this loss included, as a node whose loss was reported does.
pub(crate) fn g09_rejoin_loss_backs_off(
    change: &SlotChange<'_>,
    failures: u32,
    policy: &RetryPolicy,
    now: Timestamp,
) -> Verdict {
    let Some(after) = change.after else {
        return Ok(());
    };
    let delay = policy.backoff(failures, after.attempt);
    let expected = plus_ms(now, delay);
    ensure(
        after.retry.restart_at.map(Timestamp::as_millis) == expected,
        GuaranteeId::BackoffDiscipline,
        || {
            format!(
                "{} was lost at the end of its rejoin window at {}ms with restart_at {:?}; the policy after {failures} failure(s) says {expected:?}ms",
                label(change.id, after),
                now.as_millis(),
                after.retry.restart_at
            )
        },
    )
}

/// G37: every node in `awaiting` (held ready by the journal at a crash, and
/// whose re-join the kit has not folded since) that still runs that attempt
/// is not ready; and while one of them waits, `converged` (the driver's word)
/// is false.
pub(crate) fn g37_readiness_is_re_earned(
    state: &ClusterState,
    awaiting: &BTreeSet<(LogicalNodeId, NodeAttemptId)>,
    converged: bool,
) -> Verdict {
    let mut waiting = None;
    for (id, attempt) in awaiting {
        let Some(node) = state.node(id).filter(|n| n.attempt == *attempt) else {
            continue;
        };
        if node.is_ready() || node.record.ready {
            return Err(breach(
                GuaranteeId::ReadinessReEarned,
                format!(
                    "{} is ready after a controller restart, but no re-join of its agent was folded into the new controller (stage {})",
                    label(id, node),
                    node.record.stage.name()
                ),
            ));
        }
        waiting.get_or_insert((id, node));
    }
    match waiting {
        Some((id, node)) if converged => Err(breach(
            GuaranteeId::ReadinessReEarned,
            format!(
                "the driver says it is converged while {} awaits the re-join of its agent after a controller restart",
                label(id, node)
            ),
        )),
        _ => Ok(()),
    }
}
