//! The desired shape and its generation: G16 (the observed generation
//! never decreases nor passes the desired one) and G17 (a shrunk group
//! sheds exactly its highest indices; only undesired, drifted or failed
//! nodes are deleted).
//!
//! Checked after every settled input and after every drive.

use provisioning::shape::DesiredState;
use provisioning::{ClusterState, Intent, NodeStage};

use super::model::DesiredSlots;
use super::observed::SlotChange;
use super::verdict::{Verdict, ensure, label};
use crate::guarantee::GuaranteeId;

/// G16: the observed generation never decreases and never passes the
/// desired one.
pub(crate) fn g16_generation_is_monotonic(
    state: &ClusterState,
    desired: &DesiredState,
    highest_seen: &mut Option<u64>,
) -> Verdict {
    let observed = state.observed_generation.map(|g| g.get());
    ensure(
        observed >= *highest_seen,
        GuaranteeId::MonotonicGeneration,
        || format!("observed generation went from {highest_seen:?} down to {observed:?}"),
    )?;
    ensure(
        observed <= Some(desired.generation().get()),
        GuaranteeId::MonotonicGeneration,
        || {
            format!(
                "observed generation {observed:?} is ahead of the desired {}",
                desired.generation()
            )
        },
    )?;
    *highest_seen = observed;
    Ok(())
}

/// G17 (settled form): no node of an undesired slot is still active, so a
/// shrunk group has shed exactly its highest indices.
pub(crate) fn g17_undesired_slots_are_not_active(
    state: &ClusterState,
    desired: &DesiredSlots,
) -> Verdict {
    for (id, node) in &state.nodes {
        if node.intent == Intent::Active && node.record.stage != NodeStage::Destroyed {
            ensure(desired.contains(id), GuaranteeId::ScaleDownOrder, || {
                format!(
                    "{} is still active although its slot is no longer desired",
                    label(id, node)
                )
            })?;
        }
    }
    Ok(())
}

/// G17 (pass form): a node begins deletion only because its slot is
/// undesired, its spec drifted, or it failed — never a desired, current one.
pub(crate) fn g17_only_undesired_drifted_or_failed_nodes_are_deleted(
    change: &SlotChange<'_>,
    desired: &DesiredSlots,
) -> Verdict {
    let (Some(before), Some(after)) = (change.before, change.after) else {
        return Ok(());
    };
    if before.attempt != after.attempt
        || before.intent != Intent::Active
        || after.intent != Intent::Deleting
    {
        return Ok(());
    }
    let undesired = !desired.contains(change.id);
    let drifted = desired
        .template(change.id)
        .is_some_and(|template| template != before.spec.template());
    let failed = before.record.stage == NodeStage::Failed;
    ensure(
        undesired || drifted || failed,
        GuaranteeId::ScaleDownOrder,
        || {
            format!(
                "{} began deletion although its slot is desired, its spec current and it did not fail",
                label(change.id, before)
            )
        },
    )
}
