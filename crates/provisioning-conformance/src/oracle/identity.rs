//! Attempt identity and correlation: G01 (attempt ids are unique, fresh and
//! never come back), G02 (a pending operation, and every result the
//! executor publishes or expires, belongs to the attempt that issued it)
//! and G03 (the facts a node holds were produced for its current attempt).
//!
//! Checked after every settled input (state forms), after every drive
//! (new attempts, ids ever seen), at every result the executor publishes and
//! at every host wake on an operation deadline (executor forms).

use std::collections::{BTreeMap, BTreeSet};

use provisioning::{
    ClusterState, ExecutorResult, LeaseHandle, LogicalNodeId, NodeAttemptId, NodeStage,
    SessionHandle,
};

use super::verdict::{Verdict, breach, ensure, label};
use crate::guarantee::GuaranteeId;
use crate::substrate::ResourceKey;

/// G01: attempt ids are unique across nodes and below the allocator.
pub(crate) fn g01_identity_in_state(state: &ClusterState) -> Verdict {
    let limit = state.attempts.next_unallocated();
    let mut seen: BTreeMap<NodeAttemptId, &LogicalNodeId> = BTreeMap::new();
    for (id, node) in &state.nodes {
        ensure(node.attempt.get() < limit, GuaranteeId::Identity, || {
            format!(
                "{} holds an attempt at or above the allocator ({limit})",
                label(id, node)
            )
        })?;
        if let Some(other) = seen.insert(node.attempt, id) {
            return Err(breach(
                GuaranteeId::Identity,
                format!("attempt {} is held by both {other} and {id}", node.attempt),
            ));
        }
    }
    Ok(())
}

/// G02: a pending operation belongs to its node's current attempt.
pub(crate) fn g02_pending_belongs_to_current_attempt(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        if let Some(pending) = &node.pending {
            ensure(
                pending.id.attempt() == node.attempt,
                GuaranteeId::Correlation,
                || {
                    format!(
                        "{} has pending {} of another attempt",
                        label(id, node),
                        pending.id
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// G03: the facts a node holds were produced for its current attempt — both
/// as the state records it and as the substrate issued the handles.
pub(crate) fn g03_facts_belong_to_current_attempt(
    state: &ClusterState,
    lease_owner: &dyn Fn(&LeaseHandle) -> Option<ResourceKey>,
    session_owner: &dyn Fn(&SessionHandle) -> Option<ResourceKey>,
) -> Verdict {
    for (id, node) in &state.nodes {
        let record = &node.record;
        let attempts = [
            ("lease", record.lease.as_ref().map(|f| f.attempt)),
            ("endpoint", record.endpoint.as_ref().map(|f| f.attempt)),
            ("bootstrap", record.bootstrap.as_ref().map(|f| f.attempt)),
            ("swarm join", record.swarm.as_ref().map(|f| f.attempt)),
        ];
        for (fact, attempt) in attempts {
            if let Some(attempt) = attempt {
                ensure(
                    attempt == node.attempt,
                    GuaranteeId::AttemptFactOwnership,
                    || {
                        format!(
                            "{} holds {fact} facts of attempt {attempt}",
                            label(id, node)
                        )
                    },
                )?;
            }
        }
        let key = (id.clone(), node.attempt);
        if let Some(lease) = &record.lease {
            if let Some(owner) = lease_owner(&lease.lease) {
                ensure(owner == key, GuaranteeId::AttemptFactOwnership, || {
                    format!(
                        "{} holds lease {:?}, which the backend issued for {}/{}",
                        label(id, node),
                        lease.lease.0,
                        owner.0,
                        owner.1
                    )
                })?;
            }
        }
        if let Some(session) = record.bootstrap.as_ref().and_then(|b| b.session.as_ref()) {
            if let Some(owner) = session_owner(session) {
                ensure(owner == key, GuaranteeId::AttemptFactOwnership, || {
                    format!(
                        "{} holds session {:?}, which the backend issued for {}/{}",
                        label(id, node),
                        session.0,
                        owner.0,
                        owner.1
                    )
                })?;
            }
        }
    }
    Ok(())
}

/// G02 (expiry form): the executor expires an operation it still holds
/// (accepted, no result published) with its timeout, so that the operation's
/// late completion is dropped and never folded.
pub(crate) fn g02_executor_expires_what_it_holds(
    op: provisioning::OperationId,
    held: bool,
) -> Verdict {
    ensure(!held, GuaranteeId::Correlation, || {
        format!(
            "the executor did not expire {op}, which it still holds (accepted, no result published)"
        )
    })
}

/// G01 (pass form): attempts that appeared are fresh — above every attempt
/// seen before, below the allocator — and each appears at one slot.
pub(crate) fn g01_new_attempts_are_fresh(
    pre: &ClusterState,
    post: &ClusterState,
    highest_seen: &mut Option<NodeAttemptId>,
) -> Verdict {
    let before = *highest_seen;
    for (id, node) in &post.nodes {
        let previous = pre.nodes.get(id).filter(|n| n.attempt == node.attempt);
        if let Some(previous) = previous {
            // Only a new attempt starts at `New` (and may be dispatched its
            // create in the same drive): an attempt that went back there
            // from a later stage was restarted under its old id.
            let starting = |stage| matches!(stage, NodeStage::New | NodeStage::LeaseRequested);
            ensure(
                starting(previous.record.stage) || !starting(node.record.stage),
                GuaranteeId::Identity,
                || {
                    format!(
                        "{} went from stage {} back to {} in a pass: the restart kept attempt {}",
                        id,
                        previous.record.stage.name(),
                        node.record.stage.name(),
                        node.attempt
                    )
                },
            )?;
            continue;
        }
        ensure(
            before.is_none_or(|h| node.attempt > h),
            GuaranteeId::Identity,
            || {
                format!(
                    "{} got attempt {}, not above the highest seen before ({before:?})",
                    id, node.attempt
                )
            },
        )?;
        *highest_seen = Some(highest_seen.map_or(node.attempt, |h| h.max(node.attempt)));
    }
    Ok(())
}

/// G02 (executor form): what the executor publishes is accounted for: a
/// result is of an operation handed to this executor, and a result of an
/// operation the executor expired is its timeout (replayed), never the
/// backend's late answer — caught here even though the driver would drop it.
pub(crate) fn g02_published_result_is_accounted_for(
    result: &ExecutorResult,
    submitted: &BTreeSet<provisioning::OperationId>,
    expired: &BTreeSet<provisioning::OperationId>,
) -> Verdict {
    ensure(
        submitted.contains(&result.op),
        GuaranteeId::Correlation,
        || {
            format!(
                "the executor published a result of {} {} for {}, which was never submitted to it",
                result.kind, result.op, result.node
            )
        },
    )?;
    ensure(
        !expired.contains(&result.op)
            || result.outcome == Err(provisioning::EffectError::timed_out()),
        GuaranteeId::Correlation,
        || {
            format!(
                "the executor published a late result of {} {} for {} after it expired the operation: {:?}",
                result.kind, result.op, result.node, result.outcome
            )
        },
    )
}

/// Every attempt id the kit has seen in the run, and which of them ended.
#[derive(Clone, Debug, Default)]
pub(crate) struct AttemptsSeen {
    /// The slot each attempt id was first seen at.
    slot_of: BTreeMap<NodeAttemptId, LogicalNodeId>,
    /// The attempt each slot held when last looked at.
    current: BTreeMap<LogicalNodeId, NodeAttemptId>,
    /// Attempts that were destroyed, replaced or reaped.
    ended: BTreeSet<NodeAttemptId>,
}

/// G01 (history form): against every attempt id the kit has seen in the
/// run, an attempt is never seen at a second slot, and an attempt that was
/// destroyed, replaced or reaped never comes back in use — not even at its
/// own slot (a restart that kept its id). Records what it saw.
pub(crate) fn g01_attempts_never_come_back(
    state: &ClusterState,
    seen: &mut AttemptsSeen,
) -> Verdict {
    for (id, node) in &state.nodes {
        if let Some(first) = seen.slot_of.get(&node.attempt) {
            ensure(first == id, GuaranteeId::Identity, || {
                format!(
                    "{} uses attempt {}, which the kit saw first at slot {first}",
                    label(id, node),
                    node.attempt
                )
            })?;
        }
        let alive = node.record.stage != NodeStage::Destroyed;
        ensure(
            !(alive && seen.ended.contains(&node.attempt)),
            GuaranteeId::Identity,
            || {
                format!(
                    "{} is in stage {} with attempt {}, which had already ended (destroyed, replaced or reaped): an attempt id was reused",
                    label(id, node),
                    node.record.stage.name(),
                    node.attempt
                )
            },
        )?;
    }
    for (id, node) in &state.nodes {
        seen.slot_of
            .entry(node.attempt)
            .or_insert_with(|| id.clone());
        if let Some(previous) = seen.current.insert(id.clone(), node.attempt) {
            if previous != node.attempt {
                seen.ended.insert(previous);
            }
        }
        if node.record.stage == NodeStage::Destroyed {
            seen.ended.insert(node.attempt);
        }
    }
    let gone: Vec<LogicalNodeId> = seen
        .current
        .keys()
        .filter(|id| !state.nodes.contains_key(*id))
        .cloned()
        .collect();
    for id in gone {
        if let Some(attempt) = seen.current.remove(&id) {
            seen.ended.insert(attempt);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use provisioning::effect::EffectOutput;
    use provisioning::id::OperationSequence;
    use provisioning::{EffectKind, GroupId, OperationId};

    use super::*;
    #[test]
    fn the_executor_may_publish_for_an_expired_operation_only_its_timeout() {
        let op = OperationId::new(NodeAttemptId::from_raw(1), OperationSequence::from_raw(1));
        let result = |outcome| ExecutorResult {
            op,
            node: LogicalNodeId::new(GroupId::new("a"), 0),
            kind: EffectKind::CreateLease,
            outcome,
        };
        let late = result(Ok(EffectOutput::ConvergenceAcknowledged));
        let timeout = result(Err(provisioning::EffectError::timed_out()));
        let submitted = BTreeSet::from([op]);
        let expired = BTreeSet::from([op]);
        let none = BTreeSet::new();
        assert!(g02_published_result_is_accounted_for(&late, &submitted, &none).is_ok());
        assert!(g02_published_result_is_accounted_for(&timeout, &submitted, &expired).is_ok());
        for (result, submitted) in [(&late, &submitted), (&timeout, &none)] {
            let verdict = g02_published_result_is_accounted_for(result, submitted, &expired);
            assert_eq!(
                verdict.map_err(|b| b.guarantee),
                Err(GuaranteeId::Correlation)
            );
        }
    }
}
