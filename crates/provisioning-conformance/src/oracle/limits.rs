//! Operator limits: G29 (the launch cap and the rollout budget hold, and
//! creates in flight are counted) and G30 in its resume form (`provision
//! resume` reports and closes a breaker, and the resumed group is held no
//! longer). The breaker's hold and wake forms are checked against the kit's
//! own breaker model in `harness/breaker.rs`.
//!
//! Checked after every settled input, after every drive and at every resume.

use provisioning::shape::DesiredState;
use provisioning::{
    ClusterState, EffectKind, GroupId, Intent, LogicalNodeId, NodeStage, Timestamp,
};

use super::model::{DesiredSlots, at_or_after, unavailable_slots};
use super::observed::{NewDispatch, SlotChange};
use super::verdict::{Verdict, breach, ensure};
use crate::guarantee::GuaranteeId;

/// G30 (resume form): `provision resume GROUP` says whether the group's
/// breaker was open, and leaves it closed.
pub(crate) fn g30_resume_reports_and_closes(
    group: &GroupId,
    was_open: Option<bool>,
    reported: bool,
    open_after: Option<bool>,
) -> Verdict {
    if let Some(was_open) = was_open {
        ensure(reported == was_open, GuaranteeId::BreakerLiveness, || {
            format!(
                "resume of group {group} reported that its breaker was {}, but it was {}",
                if reported { "open" } else { "closed" },
                if was_open { "open" } else { "closed" }
            )
        })?;
    }
    ensure(
        open_after != Some(true),
        GuaranteeId::BreakerLiveness,
        || format!("after resume of group {group} its breaker still holds new attempts back"),
    )
}

/// G30 (resume form): the pass a resume of an open breaker queues gives
/// every desired slot of the group its node at once (the breaker held
/// their inserts and restarts; nothing else holds an insert).
pub(crate) fn g30_resumed_group_is_not_held(
    state: &ClusterState,
    slots: &DesiredSlots,
    group: &GroupId,
    was_open: bool,
    now: Timestamp,
) -> Verdict {
    if !was_open {
        return Ok(());
    }
    for index in 0..slots.count(group) {
        let id = LogicalNodeId::new(group.clone(), index);
        let held = match state.nodes.get(&id) {
            None => true,
            // A destroyed node whose restart is due must have restarted.
            Some(node) => {
                node.record.stage == NodeStage::Destroyed
                    && node.retry.restart_at.is_none_or(|at| at_or_after(now, at))
            }
        };
        ensure(!held, GuaranteeId::BreakerLiveness, || {
            format!(
                "group {group}'s breaker was resumed, but desired slot {id} still waits for its attempt after the next pass"
            )
        })?;
    }
    Ok(())
}

/// G29 (count form): the driver's count of creates in flight for a provider
/// (what the launch cap is held against, and what a host shows) is the
/// number of its nodes with a create pending.
pub(crate) fn g29_creates_in_flight_are_counted(
    state: &ClusterState,
    provider: &str,
    counted: Option<u32>,
) -> Verdict {
    let Some(counted) = counted else {
        return Ok(());
    };
    let pending = state
        .nodes
        .values()
        .filter(|n| {
            n.spec.template().provider == provider
                && n.pending
                    .as_ref()
                    .is_some_and(|p| p.kind == EffectKind::CreateLease)
        })
        .count();
    ensure(
        u32::try_from(pending).ok() == Some(counted),
        GuaranteeId::BudgetsHold,
        || {
            format!(
                "the driver counts {counted} creates in flight for provider {provider}, but {pending} nodes have one pending"
            )
        },
    )
}

/// G29, launch cap: when a drive started a first create (of an active
/// node), the creates pending across the cluster afterwards are within
/// `cap`. Counted from the recorded state, not from the driver's counters.
pub(crate) fn g29_creates_within_cap(
    dispatches: &[NewDispatch],
    post: &ClusterState,
    cap: Option<u32>,
) -> Verdict {
    let Some(cap) = cap else { return Ok(()) };
    let started = dispatches.iter().any(|d| {
        d.pending.kind == EffectKind::CreateLease
            && post
                .nodes
                .get(&d.node)
                .is_some_and(|n| n.intent == Intent::Active)
    });
    if !started {
        return Ok(());
    }
    let in_flight = post
        .nodes
        .values()
        .filter(|n| {
            n.pending
                .as_ref()
                .is_some_and(|p| p.kind == EffectKind::CreateLease)
        })
        .count();
    if in_flight > cap as usize {
        return Err(breach(
            GuaranteeId::BudgetsHold,
            format!(
                "a create started while {in_flight} creates are in flight, over the cap of {cap}"
            ),
        ));
    }
    Ok(())
}

/// Whether `change` took a ready, desired node of a drifted spec down (a
/// drift replacement: the only deletion a rollout budget holds back).
pub(crate) fn is_drift_takedown(change: &SlotChange<'_>, desired: &DesiredState) -> bool {
    let (Some(before), Some(after)) = (change.before, change.after) else {
        return false;
    };
    let Some(group) = desired.groups().get(change.id.group()) else {
        return false;
    };
    before.is_ready()
        && before.intent == Intent::Active
        && after.intent == Intent::Deleting
        && change.id.index() < group.count()
        && *before.spec.template() != **group.template()
}

/// G29, rollout budget: when a drive took a ready node down for drift
/// replacement, its group has at most `allowed` desired slots without a
/// ready node afterwards.
pub(crate) fn g29_rollout_within_budget(
    group: &GroupId,
    post: &ClusterState,
    desired: &DesiredState,
    allowed: u32,
) -> Verdict {
    let down = unavailable_slots(post, desired, group);
    if down > allowed {
        return Err(breach(
            GuaranteeId::BudgetsHold,
            format!(
                "a drift replacement in group {group} left {down} desired slots unready, over its budget of {allowed}"
            ),
        ));
    }
    Ok(())
}
