//! G37, readiness is re-earned: after a controller crash and recovery, a node
//! the journal held as ready is not ready, and the cluster not converged,
//! before an observation of the new controller says its agent re-joined.
//!
//! Checked at every recovery and after every input.

use std::collections::BTreeSet;

use provisioning::{ClusterState, LogicalNodeId, NodeAttemptId};

use super::verdict::{Verdict, breach, label};
use crate::guarantee::GuaranteeId;

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
