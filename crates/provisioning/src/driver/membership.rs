//! Membership tracking: the driver's side of [`crate::membership`] — which
//! nodes changed since a host last took the membership, and the take.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::ClusterDriver;
use crate::id::GroupId;
use crate::membership::{Membership, MembershipTracker, member_of};

impl ClusterDriver {
    /// Starts keeping the membership: from now on
    /// [`ClusterDriver::take_membership`] hands out a new one whenever it
    /// changed. The first take hands out the current membership.
    pub fn track_membership(&mut self) {
        self.membership = Some(MembershipTracker {
            dirty: self.state().nodes.keys().cloned().collect(),
            ..MembershipTracker::default()
        });
    }

    /// Whether a take might hand out a new membership: nodes changed since
    /// the last take, the group sizes changed, or none was handed out yet.
    /// `false` when the membership is not tracked. Lets a host that paces
    /// its takes wake only when one is worth it.
    pub fn membership_pending(&self) -> bool {
        let Some(tracker) = &self.membership else {
            return false;
        };
        tracker.version == 0
            || !tracker.dirty.is_empty()
            || tracker.group_sizes.len() != self.desired().groups().len()
            || self
                .desired()
                .groups()
                .iter()
                .any(|(id, group)| tracker.group_sizes.get(id) != Some(&group.count()))
    }

    /// The membership, if it changed since the last take (or this is the
    /// first); `None` when it did not, or when it is not tracked. Costs the
    /// nodes changed since the last take, plus a copy of the members when
    /// something changed.
    pub fn take_membership(&mut self) -> Option<Arc<Membership>> {
        let group_sizes: BTreeMap<GroupId, u32> = self
            .desired()
            .groups()
            .iter()
            .map(|(id, group)| (id.clone(), group.count()))
            .collect();
        let mut tracker = self.membership.take()?;
        // The first take hands out a membership even for an empty run.
        let mut changed = tracker.version == 0 || tracker.group_sizes != group_sizes;
        for id in std::mem::take(&mut tracker.dirty) {
            let member = self
                .state()
                .nodes
                .get(&id)
                .and_then(|node| member_of(&id, node));
            let before = match member {
                Some(member) => tracker.members.insert(id, member.clone()) != Some(member),
                None => tracker.members.remove(&id).is_some(),
            };
            changed |= before;
        }
        let taken = changed.then(|| {
            tracker.version += 1;
            tracker.group_sizes = group_sizes;
            Arc::new(Membership {
                version: tracker.version,
                members: tracker.members.values().cloned().collect(),
                group_sizes: tracker.group_sizes.clone(),
            })
        });
        self.membership = Some(tracker);
        taken
    }

    /// The membership the driver holds now, computed from every node
    /// (version 0: not one handed out). For status commands and checks.
    pub fn current_membership(&self) -> Membership {
        Membership {
            version: 0,
            members: self
                .state()
                .nodes
                .iter()
                .filter_map(|(id, node)| member_of(id, node))
                .collect(),
            group_sizes: self
                .desired()
                .groups()
                .iter()
                .map(|(id, group)| (id.clone(), group.count()))
                .collect(),
        }
    }
}
