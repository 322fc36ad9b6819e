//! The run's membership: which nodes' current attempts count as members
//! (the ready ones), where they are reached, and the desired size of every
//! group — what the agents' peers files list (design §22, guarantee G35).
//!
//! The driver keeps the membership up to date per changed node once a host
//! asks for it ([`ClusterDriver::track_membership`](crate::ClusterDriver::track_membership)) and hands out a new
//! [`Membership`], with a higher version, whenever it changed
//! ([`ClusterDriver::take_membership`](crate::ClusterDriver::take_membership)). Whether a node is a member is
//! decided in one place, [`member_of`], so that a new stage that holds a
//! node back from readiness changes the membership with it.

use std::collections::{BTreeMap, BTreeSet};

use crate::effect::Endpoint;
use crate::id::{GroupId, LogicalNodeId, NodeAttemptId};
use crate::state::ManagedNode;
use crate::time::Timestamp;

/// One member of the run: a ready node's current attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The slot (its group and index).
    pub node: LogicalNodeId,
    /// The slot's current attempt.
    pub attempt: NodeAttemptId,
    /// Where the provider said the node is reached.
    pub endpoint: Endpoint,
    /// When the node became ready (handed off), on the driver's clock.
    pub ready_since: Timestamp,
}

/// The run's membership as the driver held it at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// Grows by one with every change; a reader keeps the highest it saw.
    pub version: u64,
    /// The members, in slot order.
    pub members: Vec<Member>,
    /// Every desired group's desired node count.
    pub group_sizes: BTreeMap<GroupId, u32>,
}

impl Membership {
    /// The desired size of `group`, if the group is desired.
    pub fn group_size(&self, group: &GroupId) -> Option<u32> {
        self.group_sizes.get(group).copied()
    }
}

/// The member a node contributes, if it counts as one: a ready node, with
/// the endpoint and hand-off time of its current attempt. The one place that
/// says who is a member.
pub fn member_of(id: &LogicalNodeId, node: &ManagedNode) -> Option<Member> {
    if !node.is_ready() {
        return None;
    }
    let endpoint = node
        .record
        .endpoint
        .as_ref()
        .filter(|facts| facts.attempt == node.attempt)?;
    Some(Member {
        node: id.clone(),
        attempt: node.attempt,
        endpoint: endpoint.endpoint.clone(),
        ready_since: node.record.handed_off_at.unwrap_or(Timestamp::ZERO),
    })
}

/// What the driver keeps to hand out membership changes.
#[derive(Debug, Default)]
pub(crate) struct MembershipTracker {
    /// Nodes changed since the last take.
    pub(crate) dirty: BTreeSet<LogicalNodeId>,
    /// The members as last handed out.
    pub(crate) members: BTreeMap<LogicalNodeId, Member>,
    /// The group sizes as last handed out.
    pub(crate) group_sizes: BTreeMap<GroupId, u32>,
    /// The version last handed out (0: none yet).
    pub(crate) version: u64,
}
