//! The run's membership: G35 (a peers update lists exactly the current
//! attempts of the nodes the controller held ready when it sent it, never an
//! attempt whose loss or teardown it had folded).
//!
//! The harness plays the host, which hands the driver's membership to the
//! agents whenever it changed: after every drive it takes the membership and
//! checks it here against the driver's state at that moment. Readiness is
//! the kit's own reading of the record (active, a ready stage, the ready
//! flag, an endpoint of the current attempt), not the core's `member_of`.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::{ClusterState, Intent, LogicalNodeId, Membership, NodeAttemptId, NodeStage};

use super::verdict::{Verdict, ensure};
use crate::guarantee::GuaranteeId;

/// What the oracle remembers between peers updates.
#[derive(Debug, Default)]
pub(crate) struct MembershipWatch {
    /// The version of the last update.
    version: u64,
    /// Attempts whose loss or teardown the kit saw folded: never listed again.
    ended: BTreeSet<(LogicalNodeId, NodeAttemptId)>,
    /// Every slot's attempt as the kit last saw it.
    seen: BTreeMap<LogicalNodeId, NodeAttemptId>,
    /// How many updates listed at least one member (vacuity).
    pub(crate) nonempty_updates: u64,
}

impl MembershipWatch {
    /// Notes what `state` shows ended: attempts deleting, failed or
    /// destroyed, and attempts replaced or reaped since the last look.
    pub(crate) fn note(&mut self, state: &ClusterState) {
        for (id, attempt) in &self.seen {
            let current = state.nodes.get(id).map(|n| n.attempt);
            if current != Some(*attempt) {
                self.ended.insert((id.clone(), *attempt));
            }
        }
        self.seen.clear();
        for (id, node) in &state.nodes {
            self.seen.insert(id.clone(), node.attempt);
            let torn_down = node.intent == Intent::Deleting
                || matches!(node.record.stage, NodeStage::Failed | NodeStage::Destroyed);
            if torn_down {
                self.ended.insert((id.clone(), node.attempt));
            }
        }
    }

    /// Forgets the version after a controller crash: a recovered
    /// controller numbers its updates anew.
    pub(crate) fn controller_replaced(&mut self) {
        self.version = 0;
    }
}

/// The `(slot, attempt)` pairs the kit reads as ready in `state`.
fn ready_attempts(state: &ClusterState) -> BTreeSet<(LogicalNodeId, NodeAttemptId)> {
    state
        .nodes
        .iter()
        .filter(|(_, node)| {
            node.record.ready
                && node.intent == Intent::Active
                && matches!(node.record.stage, NodeStage::HandedOff | NodeStage::Dormant)
                && node
                    .record
                    .endpoint
                    .as_ref()
                    .is_some_and(|e| e.attempt == node.attempt)
        })
        .map(|(id, node)| (id.clone(), node.attempt))
        .collect()
}

/// G35: the update `membership`, taken with the driver's `state` as it is
/// now, lists exactly the ready nodes' current attempts, none of them an
/// attempt the kit saw end, with a version above the last one's.
pub(crate) fn g35_update_lists_exactly_the_ready_attempts(
    membership: &Membership,
    state: &ClusterState,
    watch: &mut MembershipWatch,
) -> Verdict {
    watch.note(state);
    ensure(
        membership.version > watch.version,
        GuaranteeId::Membership,
        || {
            format!(
                "a peers update of version {} follows version {}",
                membership.version, watch.version
            )
        },
    )?;
    watch.version = membership.version;
    let listed: BTreeSet<(LogicalNodeId, NodeAttemptId)> = membership
        .members
        .iter()
        .map(|m| (m.node.clone(), m.attempt))
        .collect();
    ensure(
        listed.len() == membership.members.len(),
        GuaranteeId::Membership,
        || format!("a peers update lists a node twice: {listed:?}"),
    )?;
    if let Some(gone) = listed.iter().find(|member| watch.ended.contains(*member)) {
        return Err(super::verdict::breach(
            GuaranteeId::Membership,
            format!(
                "a peers update lists {}/{} after its loss or teardown was folded",
                gone.0, gone.1
            ),
        ));
    }
    let ready = ready_attempts(state);
    ensure(listed == ready, GuaranteeId::Membership, || {
        let extra: Vec<String> = listed
            .difference(&ready)
            .map(|(id, a)| format!("{id}/{a}"))
            .collect();
        let missing: Vec<String> = ready
            .difference(&listed)
            .map(|(id, a)| format!("{id}/{a}"))
            .collect();
        format!(
            "a peers update does not list exactly the ready nodes: extra {extra:?}, missing {missing:?}"
        )
    })?;
    if !listed.is_empty() {
        watch.nonempty_updates += 1;
    }
    Ok(())
}
