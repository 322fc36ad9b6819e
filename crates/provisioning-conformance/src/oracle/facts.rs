//! Fact coherence: G06 (a destroyed node holds nothing), G07 (facts leave
//! only on confirmed absence; an attempt ends only when empty), G14
//! (readiness implies the full fact set and the desired spec) and G15
//! (session coherence; a convergence reported once, only after the join;
//! no event after the session ended).
//!
//! Checked after every settled input, after every fold and after every
//! drive (per dispatch and per changed slot).

use std::collections::{BTreeMap, BTreeSet};

use provisioning::MaxUnavailable;
use provisioning::effect::EffectOutput;
use provisioning::observe::BootstrapEvent;
use provisioning::shape::DesiredState;
use provisioning::state::SessionState;
use provisioning::{
    ClusterState, EffectKind, GroupId, Intent, LogicalNodeId, ManagedNode, NodeAttemptId,
    NodeStage, Observation, Timestamp,
};

use super::model::{DesiredSlots, at_or_after, unavailable_slots};
use super::observed::{FoldCause, NewDispatch, SlotChange};
use super::verdict::{Verdict, ensure, label};
use crate::guarantee::GuaranteeId;

/// G06: a destroyed node holds no lease, session or pending operation.
pub(crate) fn g06_dead_nodes_hold_nothing(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        if node.record.stage != NodeStage::Destroyed {
            continue;
        }
        ensure(
            node.record.lease.is_none() && !node.record.session_active() && node.pending.is_none(),
            GuaranteeId::DeadHold,
            || {
                format!(
                    "destroyed {} still holds lease={} session_active={} pending={:?}",
                    label(id, node),
                    node.record.lease.is_some(),
                    node.record.session_active(),
                    node.pending_op()
                )
            },
        )?;
    }
    Ok(())
}

/// G14: readiness implies active, the full fact set and the desired spec;
/// deleting implies not ready. `settled` says no pass is queued, so a ready
/// node whose spec just changed has been looked at — unless its group's
/// rollout budget (in `budgets`) is spent, when it may wait (G29).
pub(crate) fn g14_readiness_coherence(
    state: &ClusterState,
    desired: &DesiredState,
    settled: bool,
    budgets: &BTreeMap<GroupId, MaxUnavailable>,
) -> Verdict {
    for (id, node) in &state.nodes {
        let record = &node.record;
        if node.intent == Intent::Deleting {
            ensure(!record.ready, GuaranteeId::ReadinessCoherence, || {
                format!("deleting {} is marked ready", label(id, node))
            })?;
        }
        if !record.ready {
            continue;
        }
        let missing: Vec<&str> = [
            (node.intent == Intent::Active, "active intent"),
            (
                matches!(record.stage, NodeStage::HandedOff | NodeStage::Dormant),
                "a ready stage",
            ),
            (record.lease.is_some(), "lease"),
            (record.endpoint.is_some(), "endpoint"),
            (record.swarm.is_some(), "swarm join"),
            (record.handed_off_at.is_some(), "handoff"),
        ]
        .into_iter()
        .filter(|(present, _)| !present)
        .map(|(_, what)| what)
        .collect();
        ensure(missing.is_empty(), GuaranteeId::ReadinessCoherence, || {
            format!("ready {} lacks {}", label(id, node), missing.join(", "))
        })?;
        // A drifted ready node may wait while its group's rollout budget is
        // spent (G29); it then still holds the old spec.
        let held_by_budget = budgets.get(id.group()).is_some_and(|budget| {
            let count = desired.groups().get(id.group()).map_or(0, |g| g.count());
            unavailable_slots(state, desired, id.group()) >= budget.of(count)
        });
        if settled && !held_by_budget {
            ensure(
                desired.spec(id).is_some_and(|spec| spec == node.spec),
                GuaranteeId::ReadinessCoherence,
                || format!("ready {} does not hold the desired spec", label(id, node)),
            )?;
        }
    }
    Ok(())
}

/// G15: an active session implies bootstrap facts of a node that has a
/// lease and an endpoint stage; bootstrap stages imply bootstrap facts.
pub(crate) fn g15_session_coherence(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        let record = &node.record;
        if record.session_active() {
            ensure(
                record.lease.is_some()
                    && !matches!(
                        record.stage,
                        NodeStage::New | NodeStage::LeaseRequested | NodeStage::LeaseCreated
                    ),
                GuaranteeId::SessionCoherence,
                || {
                    format!(
                        "{} has an active session without a lease and endpoint (stage {})",
                        label(id, node),
                        record.stage.name()
                    )
                },
            )?;
        }
        if matches!(
            record.stage,
            NodeStage::BootstrapRunning | NodeStage::SwarmJoined
        ) {
            ensure(
                record.bootstrap.is_some(),
                GuaranteeId::SessionCoherence,
                || {
                    format!(
                        "{} is in stage {} without bootstrap facts",
                        label(id, node),
                        record.stage.name()
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// G07: live facts disappear only when absence is confirmed.
pub(crate) fn g07_facts_leave_only_on_confirmed_absence(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> Verdict {
    if before.record.failure.is_some() {
        // A failed attempt only waits for cleanup: a late stream event of it
        // may neither add facts nor end its session (cleanup must still
        // cancel it; the provider answers "absent" if it is gone).
        ensure(
            !matches!(cause, FoldCause::Observation(Observation::Bootstrap { .. }))
                || before == after,
            GuaranteeId::CleanupKeepsFacts,
            || {
                format!(
                    "{} folded a late {} into its failed attempt",
                    label(id, before),
                    cause.describe()
                )
            },
        )?;
    }
    if before.record.lease.is_some() && after.record.lease.is_none() {
        ensure(
            cause.succeeded_with(|o| matches!(o, EffectOutput::LeaseDestroyed)),
            GuaranteeId::CleanupKeepsFacts,
            || {
                format!(
                    "{} lost its lease facts on {}",
                    label(id, before),
                    cause.describe()
                )
            },
        )?;
    }
    if before.record.session_active() && !after.record.session_active() {
        let confirmed = cause.succeeded_with(|o| matches!(o, EffectOutput::BootstrapCancelled))
            || matches!(
                cause,
                FoldCause::Observation(Observation::Bootstrap {
                    event: BootstrapEvent::Closed,
                    ..
                })
            );
        ensure(confirmed, GuaranteeId::CleanupKeepsFacts, || {
            format!(
                "{} lost its active session on {}",
                label(id, before),
                cause.describe()
            )
        })?;
    }
    Ok(())
}

fn holds_something(node: &ManagedNode) -> bool {
    node.record.lease.is_some() || node.record.session_active() || node.pending.is_some()
}

/// G06/G07/G09/G12 (replacement form): an attempt leaves the map (reap) or is
/// replaced (restart) only when it holds nothing, no ambiguity is remembered,
/// and — for a restart — its restart time has come.
pub(crate) fn g07_attempts_end_only_when_empty(
    change: &SlotChange<'_>,
    desired: &DesiredSlots,
    now: Timestamp,
) -> Verdict {
    let Some(before) = change.before else {
        return Ok(());
    };
    let ended = change
        .after
        .is_none_or(|after| after.attempt != before.attempt);
    if !ended {
        return Ok(());
    }
    ensure(
        !holds_something(before),
        GuaranteeId::CleanupKeepsFacts,
        || {
            format!(
                "{} was dropped while it held lease={} session_active={} pending={:?}",
                label(change.id, before),
                before.record.lease.is_some(),
                before.record.session_active(),
                before.pending_op()
            )
        },
    )?;
    ensure(
        before.retry.ambiguous.is_none(),
        GuaranteeId::AdoptBeforeDestroy,
        || {
            format!(
                "{} was dropped with an ambiguous operation remembered",
                label(change.id, before)
            )
        },
    )?;
    match change.after {
        None => ensure(
            !desired.contains(change.id),
            GuaranteeId::ScaleDownOrder,
            || {
                format!(
                    "{} was reaped although its slot is desired",
                    label(change.id, before)
                )
            },
        ),
        Some(_) => {
            // The restart time is set when the attempt fails; an attempt
            // replaced for drift or scale-down has none.
            let restart_at = before.retry.restart_at;
            ensure(
                restart_at.is_none_or(|t| at_or_after(now, t)),
                GuaranteeId::BackoffDiscipline,
                || {
                    format!(
                        "{} was restarted at {now}, before its restart_at {restart_at:?}",
                        label(change.id, before)
                    )
                },
            )
        }
    }
}

/// G15 (report form): a session's convergence is reported at most once: no
/// report is dispatched for an attempt whose report was acknowledged.
pub(crate) fn g15_convergence_reported_once(
    dispatch: &NewDispatch,
    reported: &BTreeSet<NodeAttemptId>,
) -> Verdict {
    ensure(
        dispatch.pending.kind != EffectKind::BootstrapConvergenceObserved
            || !reported.contains(&dispatch.pending.id.attempt()),
        GuaranteeId::SessionCoherence,
        || {
            format!(
                "{} dispatched {} {}, but the convergence of its session was already reported and acknowledged",
                dispatch.node, dispatch.pending.kind, dispatch.pending.id
            )
        },
    )
}

/// G15 (report form): a session's convergence is reported only after the
/// kit reported the session's agent joined: a report for a session still
/// bootstrapping tells the run a node is there that is not.
pub(crate) fn g15_convergence_reported_after_join(
    dispatch: &NewDispatch,
    joined: &BTreeSet<NodeAttemptId>,
) -> Verdict {
    ensure(
        dispatch.pending.kind != EffectKind::BootstrapConvergenceObserved
            || joined.contains(&dispatch.pending.id.attempt()),
        GuaranteeId::SessionCoherence,
        || {
            format!(
                "{} dispatched {} {}, but the kit never reported its session's agent joined",
                dispatch.node, dispatch.pending.kind, dispatch.pending.id
            )
        },
    )
}

/// G15 (stream form): a bootstrap event of a session that already closed or
/// was cancelled is rejected, never folded.
pub(crate) fn g15_no_event_after_the_session_ended(
    id: &LogicalNodeId,
    before: &ManagedNode,
    observation: &Observation,
) -> Verdict {
    let Observation::Bootstrap { event, .. } = observation else {
        return Ok(());
    };
    let ended = before
        .record
        .bootstrap
        .as_ref()
        .is_some_and(|b| b.state != SessionState::Active);
    ensure(!ended, GuaranteeId::SessionCoherence, || {
        format!(
            "{} folded the stream event {event:?} although its session had already ended",
            label(id, before)
        )
    })
}
