//! The substrate's ledger of live resources: G08 (no double create), G23 (a
//! converged cluster leaks nothing) and G28 (orphans are collected in time
//! and never an owned resource).
//!
//! Checked after every input, at the end of the fair tail and at every
//! orphan destroy.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::{ClusterState, LogicalNodeId, NodeAttemptId, Timestamp};

use super::model::owned;
use super::verdict::{Verdict, ensure};
use crate::guarantee::GuaranteeId;
use crate::substrate::{LiveResources, ResourceKey};

/// G08: at most one live resource per key, and live resources of at most one
/// attempt per slot.
pub(crate) fn g08_no_double_create(live: &LiveResources) -> Verdict {
    let mut attempts_of: BTreeMap<&LogicalNodeId, BTreeSet<NodeAttemptId>> = BTreeMap::new();
    for (what, map) in [("leases", &live.leases), ("sessions", &live.sessions)] {
        for ((node, attempt), count) in map {
            ensure(*count <= 1, GuaranteeId::NoDoubleCreate, || {
                format!("the backend holds {count} live {what} for {node}/{attempt}")
            })?;
            if *count > 0 {
                attempts_of.entry(node).or_default().insert(*attempt);
            }
        }
    }
    for (node, attempts) in attempts_of {
        ensure(attempts.len() <= 1, GuaranteeId::NoDoubleCreate, || {
            format!("the backend holds live resources of attempts {attempts:?} of slot {node}")
        })?;
    }
    Ok(())
}

/// G23: at convergence the live resources are exactly one lease per desired
/// node's current attempt, and no session of any other attempt is live.
pub(crate) fn g23_converged_leaks_nothing(state: &ClusterState, live: &LiveResources) -> Verdict {
    let expected: BTreeSet<ResourceKey> = state
        .nodes
        .iter()
        .map(|(id, node)| (id.clone(), node.attempt))
        .collect();
    let leased: BTreeSet<ResourceKey> = live
        .leases
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(key, _)| key.clone())
        .collect();
    let leaked: Vec<String> = leased
        .difference(&expected)
        .map(|(node, attempt)| format!("{node}/{attempt}"))
        .collect();
    let missing: Vec<String> = expected
        .difference(&leased)
        .map(|(node, attempt)| format!("{node}/{attempt}"))
        .collect();
    ensure(
        leaked.is_empty() && missing.is_empty(),
        GuaranteeId::ConvergedLeaksNothing,
        || {
            format!(
                "converged, but leases leaked: [{}], missing: [{}] (live: {live})",
                leaked.join(", "),
                missing.join(", ")
            )
        },
    )?;
    let stale_sessions: Vec<String> = live
        .sessions
        .iter()
        .filter(|(key, n)| **n > 0 && !expected.contains(*key))
        .map(|((node, attempt), _)| format!("{node}/{attempt}"))
        .collect();
    ensure(
        stale_sessions.is_empty(),
        GuaranteeId::ConvergedLeaksNothing,
        || {
            format!(
                "converged, but sessions of other attempts are live: [{}]",
                stale_sessions.join(", ")
            )
        },
    )
}

/// G28 (safety form): a resource about to be destroyed as an orphan is not
/// owned by a node's current attempt.
pub(crate) fn g28_never_an_owned_resource(state: &ClusterState, key: &ResourceKey) -> Verdict {
    ensure(!owned(state, key), GuaranteeId::OrphansCollected, || {
        format!(
            "the host destroyed {}/{} as an orphan, but it is that node's current attempt",
            key.0, key.1
        )
    })
}

/// G28 (liveness form): once faults stopped at `stopped`, every resource
/// observed unowned is gone within `bound` (grace + one scan interval) of
/// the later of `stopped` and when it was first observed unowned.
pub(crate) fn g28_orphans_collected_in_time(
    observed: &BTreeMap<ResourceKey, Timestamp>,
    stopped: Timestamp,
    bound: std::time::Duration,
    now: Timestamp,
) -> Verdict {
    for ((node, attempt), since) in observed {
        let from = since.as_millis().max(stopped.as_millis());
        let bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        let deadline = from.saturating_add(bound_ms);
        ensure(
            now.as_millis() <= deadline,
            GuaranteeId::OrphansCollected,
            || {
                format!(
                    "{node}/{attempt}, owned by no current attempt since {since}, is still live at {now} (faults stopped at {stopped}; bound {} ms)",
                    bound.as_millis()
                )
            },
        )?;
    }
    Ok(())
}
