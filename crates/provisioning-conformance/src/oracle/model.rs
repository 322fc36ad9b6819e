//! The kit's own model of what the driver should hold, kept so that the
//! driver's answer never vouches for itself.
//!
//! Time is compared in plain milliseconds, never with the core's
//! `Timestamp` comparisons, so a core that compares deadlines wrongly
//! cannot fool the oracle with the same mistake. The desired slots come
//! from the shapes the kit submitted ([`DesiredSlots`]), never from the
//! driver's `DesiredState`; readiness, pending creates and ownership of a
//! resource are read from the node's own fields by the kit's rules.

use std::collections::BTreeMap;

use provisioning::shape::DesiredState;
use provisioning::{
    ClusterState, EffectKind, GroupId, Intent, LogicalNodeId, ManagedNode, NodeStage, Timestamp,
};

use crate::substrate::ResourceKey;

/// Whether `now` is at or past `deadline`, in plain milliseconds.
pub(crate) fn at_or_after(now: Timestamp, deadline: Timestamp) -> bool {
    now.as_millis() >= deadline.as_millis()
}

/// Whether `deadline` is strictly later than `now`, in plain milliseconds.
pub(crate) fn later_than(deadline: Timestamp, now: Timestamp) -> bool {
    deadline.as_millis() > now.as_millis()
}

/// `now + delay` in plain milliseconds, `None` past the end of the clock.
/// A delay with a sub-millisecond part is rounded up (a deadline is never
/// earlier than its delay), as the design's clock counts whole milliseconds (docs/design.md).
pub(crate) fn plus_ms(now: Timestamp, delay: std::time::Duration) -> Option<u64> {
    let mut delay_ms = u64::try_from(delay.as_millis()).ok()?;
    if delay.subsec_nanos() % 1_000_000 != 0 {
        delay_ms = delay_ms.checked_add(1)?;
    }
    now.as_millis().checked_add(delay_ms)
}

/// Whether a node's current attempt owns the resource of `key`: the slot is
/// managed, at that attempt, and not destroyed.
pub(crate) fn owned(state: &ClusterState, key: &ResourceKey) -> bool {
    state
        .nodes
        .get(&key.0)
        .is_some_and(|n| n.attempt == key.1 && n.record.stage != NodeStage::Destroyed)
}

/// Desired slots of `group` in `state` without a ready node.
pub(crate) fn unavailable_slots(
    state: &ClusterState,
    desired: &DesiredState,
    group: &GroupId,
) -> u32 {
    let Some(wanted) = desired.groups().get(group) else {
        return 0;
    };
    let ready = (0..wanted.count())
        .filter(|&i| {
            state
                .node(&LogicalNodeId::new(group.clone(), i))
                .is_some_and(ManagedNode::is_ready)
        })
        .count();
    wanted
        .count()
        .saturating_sub(u32::try_from(ready).unwrap_or(u32::MAX))
}

/// The desired slots and their templates by the kit's own reckoning, built
/// from the shapes the harness submitted — never from the driver's
/// `DesiredState`, so a driver that shrinks the wrong end of a group, or
/// keeps a shape it was not given, cannot vouch for itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct DesiredSlots {
    groups: BTreeMap<GroupId, (u32, provisioning::NodeTemplate)>,
}

impl DesiredSlots {
    /// The slots of `groups`: per group its count and template.
    pub(crate) fn new(
        groups: impl IntoIterator<Item = (GroupId, u32, provisioning::NodeTemplate)>,
    ) -> Self {
        DesiredSlots {
            groups: groups
                .into_iter()
                .map(|(id, count, template)| (id, (count, template)))
                .collect(),
        }
    }

    /// Whether `id` is a desired slot: its group is wanted and its index is
    /// below the group's count (a shrinking group loses its highest indices).
    pub(crate) fn contains(&self, id: &LogicalNodeId) -> bool {
        self.template(id).is_some()
    }

    /// How many slots of `group` are desired.
    pub(crate) fn count(&self, group: &GroupId) -> u32 {
        self.groups.get(group).map_or(0, |(count, _)| *count)
    }

    /// The desired template of slot `id`, if the slot is desired.
    pub(crate) fn template(&self, id: &LogicalNodeId) -> Option<&provisioning::NodeTemplate> {
        let (count, template) = self.groups.get(id.group())?;
        (id.index() < *count).then_some(template)
    }

    /// How many slots are desired, over all groups.
    pub(crate) fn total(&self) -> u64 {
        self.groups
            .values()
            .map(|(count, _)| u64::from(*count))
            .sum()
    }
}

/// Whether `node` is ready, by the kit's own reading of its facts: active,
/// marked ready, in a stage past the handoff.
pub(crate) fn kit_ready(node: &ManagedNode) -> bool {
    node.record.ready
        && node.intent == Intent::Active
        && matches!(node.record.stage, NodeStage::HandedOff | NodeStage::Dormant)
}

/// How many nodes of `state` have a create pending.
pub(crate) fn creates_pending(state: &ClusterState) -> usize {
    state
        .nodes
        .values()
        .filter(|n| {
            n.pending
                .as_ref()
                .is_some_and(|p| p.kind == EffectKind::CreateLease)
        })
        .count()
}
