//! G32, stage coherence: a node's stage claims only the facts it holds and
//! hides none (the table at [`g32_stage_agrees_with_facts`]); a node's kept
//! history agrees with the node; a loss and a teardown name their cause.
//!
//! Checked after every input, every fold and every drive.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::{
    ClusterState, EffectKind, Intent, LogicalNodeId, ManagedNode, NodeStage, Observation, Timestamp,
};

use super::observed::{Condition, FoldCause, condition};
use super::verdict::{Verdict, ensure, label};
use crate::guarantee::GuaranteeId;

/// G32 (history form): a node's kept history agrees with the node. Its
/// newest entry describes the node's present attempt, stage, intent and
/// readiness (a failed node's entry carries the failure's reason); it keeps
/// at most `depth` entries, in time order, none later than `now`; a node
/// that changed since the controller started has a history (one that did
/// not may have none: histories are not journaled); a removed node has none.
pub(crate) fn g32_history_agrees_with_nodes<'a>(
    state: &ClusterState,
    history: impl Fn(&LogicalNodeId) -> Option<&'a provisioning::NodeHistory>,
    at_start: &BTreeMap<LogicalNodeId, Condition>,
    removed: &BTreeSet<LogicalNodeId>,
    depth: usize,
    now: Timestamp,
) -> Verdict {
    for id in removed {
        ensure(history(id).is_none(), GuaranteeId::StageCoherence, || {
            format!("{id} was removed, but its history is still kept")
        })?;
    }
    for (id, node) in &state.nodes {
        let now_condition = condition(node);
        let entries: Vec<&provisioning::Transition> = history(id)
            .map(|h| h.entries().collect())
            .unwrap_or_default();
        let Some(newest) = entries.last().copied() else {
            ensure(
                at_start.get(id) == Some(&now_condition),
                GuaranteeId::StageCoherence,
                || {
                    format!(
                        "{} changed since the controller started (now {:?}), but its history is empty",
                        label(id, node),
                        node.record.stage
                    )
                },
            )?;
            continue;
        };
        ensure(entries.len() <= depth, GuaranteeId::StageCoherence, || {
            format!(
                "{} keeps {} history entries, over the depth of {depth}",
                label(id, node),
                entries.len()
            )
        })?;
        let ordered = entries
            .windows(2)
            .all(|pair| pair[0].at.as_millis() <= pair[1].at.as_millis());
        ensure(
            ordered && newest.at.as_millis() <= now.as_millis(),
            GuaranteeId::StageCoherence,
            || {
                format!(
                    "{}'s history is out of time order or ahead of the clock",
                    label(id, node)
                )
            },
        )?;
        let said = (newest.attempt, newest.stage, newest.deleting, newest.ready);
        ensure(said == now_condition, GuaranteeId::StageCoherence, || {
            format!(
                "{}'s newest history entry says {said:?}, but the node is {now_condition:?}",
                label(id, node)
            )
        })?;
        if node.record.stage == NodeStage::Failed {
            // The failure's own entry gives its reason; the teardown's entry
            // says it tears down a failed attempt. An attempt keeps the
            // reason it failed for (finding 12): a later failure folded while
            // it is torn down is only its last error.
            let reason = node.record.failure.as_ref().map(|f| f.reason.as_str());
            let said = newest.reason.as_deref();
            let agrees = (reason.is_some() && said == reason)
                || (newest.deleting && said.is_some_and(|said| said.starts_with("failed: ")));
            ensure(agrees, GuaranteeId::StageCoherence, || {
                format!(
                    "failed {}'s newest history entry gives the reason {said:?}, the record {reason:?}",
                    label(id, node)
                )
            })?;
        }
    }
    Ok(())
}

/// G32 (loss form): a loss that fails a node gives it a reason naming what
/// was lost, in the kit's own words for each cause (the agent, the lease,
/// the workload): what an operator reads in `status` and the history.
pub(crate) fn g32_loss_names_what_was_lost(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> Verdict {
    let FoldCause::Observation(Observation::NodeLost { cause: lost, .. }) = cause else {
        return Ok(());
    };
    if before.record.failure.is_some() {
        return Ok(());
    }
    let Some(failure) = &after.record.failure else {
        return Ok(());
    };
    let word = match lost {
        provisioning::LossCause::AgentGone => "agent",
        provisioning::LossCause::LeaseGone => "lease",
        provisioning::LossCause::WorkloadExited | provisioning::LossCause::WorkloadEnded(_) => {
            "workload"
        }
    };
    ensure(
        failure.reason.contains(word),
        GuaranteeId::StageCoherence,
        || {
            format!(
                "{} failed on a loss of its {word}, but its reason is {:?}",
                label(id, after),
                failure.reason
            )
        },
    )
}

/// G32 (teardown form): the history entry where a teardown of a healthy
/// attempt began says why, as the kit's own shape has it: a slot no longer
/// desired was scaled down, a slot desired with another template drifted,
/// and neither is claimed otherwise. `desired_same`: `None` when the slot
/// is not desired, else whether its desired template is the node's.
pub(crate) fn g32_teardown_names_its_cause(
    id: &LogicalNodeId,
    entry: &provisioning::Transition,
    desired_same: Option<bool>,
) -> Verdict {
    let said = entry.reason.as_deref().unwrap_or("");
    let says_scale = said.contains("scaled down");
    let says_drift = said.contains("drift");
    let (agrees, why) = match desired_same {
        None => (says_scale && !says_drift, "its slot is no longer desired"),
        Some(false) => (
            says_drift && !says_scale,
            "its slot is desired with another template (drift)",
        ),
        Some(true) => (
            !says_scale && !says_drift,
            "its slot is desired with its own template",
        ),
    };
    ensure(agrees, GuaranteeId::StageCoherence, || {
        format!(
            "{id}'s teardown of {} began with the reason {:?}, but {why}",
            entry.attempt, entry.reason
        )
    })
}

/// Facts a stage requires or rules out: whether each is present, and its name.
type Facts = Vec<(bool, &'static str)>;

/// G32: a node's stage agrees with its facts. Each stage claims some facts
/// (it must hold them) and rules others out (it must not hold them):
///
/// | Stage | Holds | Holds not |
/// |---|---|---|
/// | `New` | — | lease, endpoint, bootstrap, join, failure, a pending create |
/// | `LeaseRequested` | — | lease, endpoint, bootstrap, join, failure |
/// | `LeaseCreated` | lease | endpoint, bootstrap, join, failure |
/// | `EndpointKnown` | lease, endpoint | an active session, join, failure |
/// | `BootstrapRunning` | lease, endpoint, an active session | join, failure |
/// | `SwarmJoined` | lease, endpoint, bootstrap, join | failure |
/// | `HandedOff`, `Dormant` | lease, endpoint, join, handoff | failure, an active session (`Dormant`) |
/// | `Rejoining` | lease, endpoint, join, handoff, a rejoin deadline | failure, an active session, readiness, a teardown |
/// | `Failed` | a failure | readiness |
/// | `Destroyed` | — | lease, endpoint, an active session, a pending operation, readiness |
///
/// A node being deleted may already have given a lease back before the pass
/// that marks it destroyed, so "holds" is required of active nodes only; and
/// a failure is only ever held in `Failed` or `Destroyed`; a rejoin deadline
/// only in `Rejoining`.
pub(crate) fn g32_stage_agrees_with_facts(id: &LogicalNodeId, node: &ManagedNode) -> Verdict {
    let record = &node.record;
    let lease = record.lease.is_some();
    let endpoint = record.endpoint.is_some();
    let bootstrap = record.bootstrap.is_some();
    let session = record.session_active();
    let joined = record.swarm.is_some();
    let failed = record.failure.is_some();
    let handed_off = record.handed_off_at.is_some();
    let pending_create = node
        .pending
        .as_ref()
        .is_some_and(|p| p.kind == EffectKind::CreateLease);
    let active = node.intent == Intent::Active;
    let rejoin_deadline = record.rejoin_by.is_some();
    let (holds, holds_not): (Facts, Facts) = match record.stage {
        NodeStage::New => (
            vec![],
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
                (failed, "a failure"),
                (pending_create, "a pending create"),
            ],
        ),
        NodeStage::LeaseRequested => (
            vec![(pending_create, "a pending create")],
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
                (failed, "a failure"),
            ],
        ),
        NodeStage::LeaseCreated => (
            vec![(lease, "a lease")],
            vec![
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
                (failed, "a failure"),
            ],
        ),
        NodeStage::EndpointKnown => (
            vec![(lease, "a lease"), (endpoint, "an endpoint")],
            vec![
                (session, "an active session"),
                (joined, "a swarm join"),
                (failed, "a failure"),
            ],
        ),
        NodeStage::BootstrapRunning => (
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (session, "an active session"),
            ],
            vec![(joined, "a swarm join"), (failed, "a failure")],
        ),
        NodeStage::SwarmJoined => (
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
            ],
            vec![(failed, "a failure")],
        ),
        NodeStage::HandedOff | NodeStage::Dormant => (
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (joined, "a swarm join"),
                (handed_off, "a handoff"),
            ],
            vec![
                (failed, "a failure"),
                (
                    session && record.stage == NodeStage::Dormant,
                    "an active session",
                ),
            ],
        ),
        // A node recovered as ready (G37): a dormant node's facts and its
        // rejoin deadline, never ready and never torn down while rejoining.
        NodeStage::Rejoining => (
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (joined, "a swarm join"),
                (handed_off, "a handoff"),
                (rejoin_deadline, "a rejoin deadline"),
            ],
            vec![
                (failed, "a failure"),
                (session, "an active session"),
                (record.ready, "readiness"),
                (!active, "a teardown"),
            ],
        ),
        NodeStage::Failed => (
            vec![(failed, "a failure")],
            vec![(record.ready, "readiness")],
        ),
        NodeStage::Destroyed => (
            vec![],
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (session, "an active session"),
                (node.pending.is_some(), "a pending operation"),
                (record.ready, "readiness"),
            ],
        ),
    };
    let missing: Vec<&str> = holds
        .into_iter()
        .filter(|(present, _)| active && !present)
        .map(|(_, what)| what)
        .collect();
    let extra: Vec<&str> = holds_not
        .into_iter()
        .chain(
            (record.stage != NodeStage::Rejoining)
                .then_some((rejoin_deadline, "a rejoin deadline")),
        )
        .filter(|(present, _)| *present)
        .map(|(_, what)| what)
        .collect();
    ensure(
        missing.is_empty() && extra.is_empty(),
        GuaranteeId::StageCoherence,
        || {
            let mut text = format!("{} is in stage {}", label(id, node), record.stage.name());
            if !missing.is_empty() {
                text.push_str(&format!(" without {}", missing.join(", ")));
            }
            if !extra.is_empty() {
                if !missing.is_empty() {
                    text.push_str(" and");
                }
                text.push_str(&format!(" holding {}", extra.join(", ")));
            }
            text
        },
    )
}

/// G32 over every node of `state`.
pub(crate) fn g32_stages_agree_with_facts(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        g32_stage_agrees_with_facts(id, node)?;
    }
    Ok(())
}
