//! The pure decider: one step per node from `(observed, desired, now)`.
//!
//! [`reconcile_node`] implements the per-node ladder of the specification
//! (section 5) row by row; [`reconcile`] applies it to every slot and
//! collects a [`Plan`]. Neither looks at which event caused the pass, reads a
//! clock or mutates its inputs.

use std::cmp::Ordering;
use std::sync::Arc;

use crate::effect::EffectKind;
use crate::id::{Generation, GroupId, LogicalNodeId, RunId};
use crate::shape::{DesiredState, LogicalNodeSpec, NodeTemplate};
use crate::state::{ClusterState, Intent, ManagedNode, NodeStage, SessionState};
use crate::time::Timestamp;

/// The ladder row that produced a decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    /// A desired slot has no node: insert one.
    Insert,
    /// Row 1: destroyed and undesired.
    Reap,
    /// Row 2: destroyed, desired and the restart is due.
    Restart,
    /// Row 3: destroyed, restart not due yet.
    AwaitRestart,
    /// Row 4: active and undesired, drifted or failed.
    BeginDelete,
    /// Row 5: an operation is pending.
    AwaitOperation,
    /// Rows 6–9, precondition: the stored backoff of a deleting node is not due.
    AwaitCleanupBackoff,
    /// Row 6: deleting with an ambiguous create/start remembered.
    ReissueAmbiguous,
    /// Row 7: deleting with an active bootstrap session.
    CancelBootstrap,
    /// Row 8: deleting with a live lease.
    DestroyLease,
    /// Row 9: deleting and nothing left.
    MarkDestroyed,
    /// Row 10: backoff not due.
    AwaitBackoff,
    /// Row 10a: rejoining after a controller restart; wait for the agent's
    /// re-join until the rejoin deadline.
    AwaitRejoin,
    /// Row 10b: rejoining, and the rejoin deadline came with no re-join.
    RejoinExpired,
    /// Row 11: ready steady state.
    Steady,
    /// Row 12: no lease.
    CreateLease,
    /// Row 13: a lease without endpoint.
    LookupEndpoint,
    /// Row 14: joined with a live session, convergence not yet reported.
    ObserveConvergence,
    /// Row 15: bootstrap running; wait for stream events.
    AwaitBootstrap,
    /// Row 16: lease and endpoint, no session.
    StartBootstrap,
}

/// What the driver does for one node in one pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NodeAction {
    /// Nothing this pass.
    None,
    /// Create the node for a desired slot with a fresh attempt.
    Insert,
    /// Remove the destroyed node from the map.
    Reap,
    /// Replace the destroyed node with a fresh attempt of the latest spec.
    Restart,
    /// Switch the node to `Deleting`.
    BeginDelete,
    /// Record that cleanup finished.
    MarkDestroyed,
    /// The rejoin window of a rejoining node ended: mark the node lost.
    ExpireRejoin,
    /// Record an operation pending and submit it.
    Dispatch(EffectKind),
}

/// When a waiting node wants to be looked at again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Wake {
    /// A stored retry, probe or restart deadline.
    Timer(Timestamp),
    /// The stored deadline of the pending operation; the host folds its
    /// timeout (see [`crate::driver::ClusterDriver::pending_operations_due`]).
    OperationDeadline(Timestamp),
}

impl Wake {
    /// The instant.
    pub fn at(self) -> Timestamp {
        match self {
            Wake::Timer(t) | Wake::OperationDeadline(t) => t,
        }
    }
}

/// The decision for one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeDecision {
    /// The ladder row that matched.
    pub rule: Rule,
    /// What to do.
    pub action: NodeAction,
    /// When to look again if nothing else happens.
    pub wake: Option<Wake>,
}

impl NodeDecision {
    fn act(rule: Rule, action: NodeAction) -> Self {
        NodeDecision {
            rule,
            action,
            wake: None,
        }
    }

    fn dispatch(rule: Rule, kind: EffectKind) -> Self {
        NodeDecision::act(rule, NodeAction::Dispatch(kind))
    }

    fn wait(rule: Rule, wake: Option<Wake>) -> Self {
        NodeDecision {
            rule,
            action: NodeAction::None,
            wake,
        }
    }
}

fn due(at: Option<Timestamp>, now: Timestamp) -> bool {
    at.is_none_or(|t| now.reached(t))
}

/// What the decider needs to know about a slot's desired spec: whether the
/// slot is desired, and whether a node's spec is the desired one.
#[derive(Clone, Copy)]
pub(crate) enum SlotDesire<'a> {
    /// The slot is not desired.
    Undesired,
    /// The slot's desired spec, built.
    Spec(&'a LogicalNodeSpec),
    /// The desired spec of a slot whose id the caller already matched with
    /// the node's: only run and template are left to compare, and no spec
    /// is built for it.
    Template {
        /// The desired run.
        run_id: &'a RunId,
        /// The group's desired template.
        template: &'a Arc<NodeTemplate>,
    },
}

impl SlotDesire<'_> {
    pub(crate) fn is_desired(self) -> bool {
        !matches!(self, SlotDesire::Undesired)
    }

    /// Whether `node` runs another spec than the desired one (or its slot
    /// is not desired).
    pub(crate) fn drifted(self, node: &ManagedNode) -> bool {
        match self {
            SlotDesire::Undesired => true,
            SlotDesire::Spec(spec) => *spec != node.spec,
            SlotDesire::Template { run_id, template } => {
                let spec = &node.spec;
                !(*run_id == *spec.run_id()
                    && (Arc::ptr_eq(template, spec.shared_template())
                        || **template == *spec.template()))
            }
        }
    }
}

/// Decides the next step for one slot.
///
/// `node` is the managed node (if any) and `desired` the slot's desired spec
/// (if the slot is desired). Returns `None` only when both are absent.
pub fn reconcile_node(
    node: Option<&ManagedNode>,
    desired: Option<&LogicalNodeSpec>,
    now: Timestamp,
) -> Option<NodeDecision> {
    decide_slot(
        node,
        desired.map_or(SlotDesire::Undesired, SlotDesire::Spec),
        now,
    )
}

/// [`reconcile_node`], with the desired side as a [`SlotDesire`].
///
/// Inlined into the walks over every slot: called, it returned its decision
/// through memory, and the caller's reads of it stalled on the store.
#[inline(always)]
pub(crate) fn decide_slot(
    node: Option<&ManagedNode>,
    desired: SlotDesire<'_>,
    now: Timestamp,
) -> Option<NodeDecision> {
    let Some(node) = node else {
        return desired
            .is_desired()
            .then(|| NodeDecision::act(Rule::Insert, NodeAction::Insert));
    };
    let record = &node.record;
    let retry = &node.retry;

    if record.stage == NodeStage::Destroyed {
        // Rows 1–3.
        return Some(if !desired.is_desired() {
            NodeDecision::act(Rule::Reap, NodeAction::Reap)
        } else if due(retry.restart_at, now) {
            NodeDecision::act(Rule::Restart, NodeAction::Restart)
        } else {
            NodeDecision::wait(Rule::AwaitRestart, retry.restart_at.map(Wake::Timer))
        });
    }

    // Row 4.
    if node.intent == Intent::Active && (record.stage == NodeStage::Failed || desired.drifted(node))
    {
        return Some(NodeDecision::act(
            Rule::BeginDelete,
            NodeAction::BeginDelete,
        ));
    }

    // Row 5.
    if let Some(pending) = &node.pending {
        return Some(NodeDecision::wait(
            Rule::AwaitOperation,
            Some(Wake::OperationDeadline(pending.deadline)),
        ));
    }

    if node.intent == Intent::Deleting {
        // Rows 6–9, each behind the stored backoff.
        if !due(retry.next_effect_at, now) {
            return Some(NodeDecision::wait(
                Rule::AwaitCleanupBackoff,
                retry.next_effect_at.map(Wake::Timer),
            ));
        }
        return Some(if let Some(ambiguous) = &retry.ambiguous {
            NodeDecision::dispatch(Rule::ReissueAmbiguous, ambiguous.kind)
        } else if record.session_active() {
            NodeDecision::dispatch(Rule::CancelBootstrap, EffectKind::CancelBootstrap)
        } else if record.lease.is_some() {
            NodeDecision::dispatch(Rule::DestroyLease, EffectKind::DestroyLease)
        } else {
            NodeDecision::act(Rule::MarkDestroyed, NodeAction::MarkDestroyed)
        });
    }

    // Row 10.
    if !due(retry.next_effect_at, now) {
        return Some(NodeDecision::wait(
            Rule::AwaitBackoff,
            retry.next_effect_at.map(Wake::Timer),
        ));
    }

    // Rows 10a–10b. A node the journal held as ready waits, after a
    // controller restart, for its agent to re-join the new controller, and
    // is lost when the window ends; it is otherwise left alone.
    if record.stage == NodeStage::Rejoining {
        return Some(if due(record.rejoin_by, now) {
            NodeDecision::act(Rule::RejoinExpired, NodeAction::ExpireRejoin)
        } else {
            NodeDecision::wait(Rule::AwaitRejoin, record.rejoin_by.map(Wake::Timer))
        });
    }

    // Row 11.
    if record.ready && matches!(record.stage, NodeStage::HandedOff | NodeStage::Dormant) {
        return Some(NodeDecision::wait(Rule::Steady, None));
    }

    // Rows 12–16.
    Some(if record.lease.is_none() {
        NodeDecision::dispatch(Rule::CreateLease, EffectKind::CreateLease)
    } else if record.endpoint.is_none() {
        NodeDecision::dispatch(Rule::LookupEndpoint, EffectKind::LookupEndpoint)
    } else if let Some(session) = record
        .bootstrap
        .as_ref()
        .filter(|b| b.state == SessionState::Active)
    {
        if record.stage == NodeStage::SwarmJoined && !session.convergence_observed {
            NodeDecision::dispatch(
                Rule::ObserveConvergence,
                EffectKind::BootstrapConvergenceObserved,
            )
        } else {
            NodeDecision::wait(Rule::AwaitBootstrap, None)
        }
    } else {
        NodeDecision::dispatch(Rule::StartBootstrap, EffectKind::StartBootstrap)
    })
}

/// One non-waiting step of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedAction {
    /// The slot.
    pub node: LogicalNodeId,
    /// The ladder row.
    pub rule: Rule,
    /// The step.
    pub action: NodeAction,
}

/// The outcome of a full pass of the decider.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The steps to take, in slot order.
    pub actions: Vec<PlannedAction>,
    /// The generation the plan evaluated.
    pub observed_generation: Generation,
    /// The earliest instant a waiting node wants to be looked at again.
    pub requeue_at: Option<Timestamp>,
}

/// Calls `visit` for every slot that is managed or desired, in slot order,
/// with the managed node and the desired spec (at least one is present).
pub fn for_each_slot(
    state: &ClusterState,
    desired: &DesiredState,
    mut visit: impl FnMut(Option<&ManagedNode>, Option<&LogicalNodeSpec>),
) {
    // Merge-join the two sorted sequences of slots.
    let mut nodes = state.nodes.iter().peekable();
    let mut specs = desired.specs().peekable();
    loop {
        let order = match (nodes.peek(), specs.peek()) {
            (None, None) => break,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some((id, _)), Some(spec)) => (*id).cmp(spec.id()),
        };
        let node = if order == Ordering::Greater {
            None
        } else {
            nodes.next().map(|(_, node)| &**node)
        };
        let spec = if order == Ordering::Less {
            None
        } else {
            specs.next()
        };
        visit(node, spec.as_ref());
    }
}

/// One slot visited by [`walk_slots`].
pub(crate) enum Slot<'a> {
    /// A managed node and what is desired of its slot.
    Managed {
        /// The slot.
        id: &'a LogicalNodeId,
        /// The node.
        node: &'a ManagedNode,
        /// What is desired of the slot.
        desire: SlotDesire<'a>,
    },
    /// A desired slot without a node.
    Missing {
        /// The slot's group.
        group: &'a GroupId,
        /// The slot's index.
        index: u32,
        /// What is desired of the slot.
        desire: SlotDesire<'a>,
    },
}

impl<'a> Slot<'a> {
    /// The managed node, if any, and what is desired of the slot.
    pub(crate) fn parts(&self) -> (Option<&'a ManagedNode>, SlotDesire<'a>) {
        match *self {
            Slot::Managed { node, desire, .. } => (Some(node), desire),
            Slot::Missing { desire, .. } => (None, desire),
        }
    }

    /// The slot's id (built for a missing slot).
    pub(crate) fn id(&self) -> LogicalNodeId {
        match *self {
            Slot::Managed { id, .. } => id.clone(),
            Slot::Missing { group, index, .. } => LogicalNodeId::new(group.clone(), index),
        }
    }
}

/// Visits every slot that is managed or desired, in slot order, like
/// [`for_each_slot`], without building a [`LogicalNodeSpec`] per slot: the
/// node map is merge-joined with the desired groups, whose slots are a
/// range of indices each.
pub(crate) fn walk_slots<'a>(
    state: &'a ClusterState,
    desired: &'a DesiredState,
    visit: impl FnMut(Slot<'a>),
) {
    walk_slots_skipping(state, desired, &[], visit);
}

/// [`walk_slots`], leaving out the desired slots of the groups `skip`
/// names by position in [`DesiredState::groups`] (a group past its end is
/// walked): the caller vouches that each of those slots holds a node it
/// needs no visit for. The walk jumps over them in the node map instead of
/// stepping through them; the group's nodes past its count are visited.
pub(crate) fn walk_slots_skipping<'a>(
    state: &'a ClusterState,
    desired: &'a DesiredState,
    skip: &[bool],
    mut visit: impl FnMut(Slot<'a>),
) {
    let run_id = desired.run_id();
    let mut nodes = state.nodes.range::<LogicalNodeId, _>(..).peekable();
    for (position, (group, wanted)) in desired.groups().iter().enumerate() {
        let desire = SlotDesire::Template {
            run_id,
            template: wanted.template(),
        };
        let count = wanted.count();
        // Nodes of groups that sort before this one are not desired.
        while let Some((id, node)) =
            nodes.next_if(|(id, _)| id.group() != group && id.group() < group)
        {
            visit(Slot::Managed {
                id,
                node,
                desire: SlotDesire::Undesired,
            });
        }
        let mut next_index = 0;
        if skip.get(position).copied().unwrap_or(false) {
            nodes = state
                .nodes
                .range(LogicalNodeId::new(group.clone(), count)..)
                .peekable();
            next_index = count;
        }
        while let Some((id, node)) = nodes.next_if(|(id, _)| id.group() == group) {
            let index = id.index();
            let desired_slot = index < count;
            let missing_until = if desired_slot { index } else { count };
            while next_index < missing_until {
                visit(Slot::Missing {
                    group,
                    index: next_index,
                    desire,
                });
                next_index += 1;
            }
            if desired_slot {
                next_index = index + 1;
                visit(Slot::Managed { id, node, desire });
            } else {
                visit(Slot::Managed {
                    id,
                    node,
                    desire: SlotDesire::Undesired,
                });
            }
        }
        while next_index < count {
            visit(Slot::Missing {
                group,
                index: next_index,
                desire,
            });
            next_index += 1;
        }
    }
    for (id, node) in nodes {
        visit(Slot::Managed {
            id,
            node,
            desire: SlotDesire::Undesired,
        });
    }
}

/// Decides the next step for every slot: the union of managed nodes and
/// desired slots, visited in slot order.
pub fn reconcile(state: &ClusterState, desired: &DesiredState, now: Timestamp) -> Plan {
    let mut actions = Vec::new();
    let mut requeue_at: Option<Timestamp> = None;
    walk_slots(state, desired, |slot| {
        let (node, desire) = slot.parts();
        let Some(decision) = decide_slot(node, desire, now) else {
            return;
        };
        if let Some(wake) = decision.wake {
            requeue_at = Some(requeue_at.map_or(wake.at(), |t| t.min(wake.at())));
        }
        if decision.action != NodeAction::None {
            actions.push(PlannedAction {
                node: slot.id(),
                rule: decision.rule,
                action: decision.action,
            });
        }
    });
    Plan {
        actions,
        observed_generation: desired.generation(),
        requeue_at,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::id::NodeAttemptId;
    use crate::shape::{ClusterShape, NodeGroup};
    use crate::state::{ManagedNode, RetryState};

    use crate::shape::test_template as template;

    /// The slots `walk_slots` visits, with whether each is desired and
    /// drifted, must be exactly those `for_each_slot` visits with built specs.
    #[test]
    fn walking_slots_without_specs_visits_what_building_specs_visits() {
        let run = RunId::new("run");
        let group = |id: &str, count| NodeGroup {
            id: GroupId::new(id),
            run_id: run.clone(),
            count,
            template: template("img"),
        };
        let desired = ClusterShape {
            run_id: run.clone(),
            generation: Generation::new(1),
            groups: vec![group("b", 3), group("d", 2)],
        }
        .validate()
        .unwrap();
        // Nodes before, inside (with gaps and past the count), between and
        // after the desired groups; one of them with another template.
        let mut nodes = BTreeMap::new();
        let mut attempt = 0;
        for (g, index, image) in [
            ("a", 0, "img"),
            ("b", 1, "img"),
            ("b", 2, "other"),
            ("b", 7, "img"),
            ("c", 0, "img"),
            ("d", 1, "img"),
            ("e", 4, "img"),
        ] {
            attempt += 1;
            let id = LogicalNodeId::new(GroupId::new(g), index);
            let spec = LogicalNodeSpec::new(id.clone(), run.clone(), Arc::new(template(image)));
            let node = ManagedNode::new(
                spec,
                NodeAttemptId::from_raw(attempt),
                RetryState::default(),
            );
            nodes.insert(id, Box::new(node));
        }
        let state = ClusterState {
            nodes,
            ..ClusterState::default()
        };
        let mut expected = Vec::new();
        for_each_slot(&state, &desired, |node, spec| {
            let id = spec.map_or_else(|| node.unwrap().spec.id().clone(), |s| s.id().clone());
            let drifted = node.map(|n| spec.is_none_or(|s| *s != n.spec));
            expected.push((id.to_string(), spec.is_some(), drifted));
        });
        let mut walked = Vec::new();
        walk_slots(&state, &desired, |slot| {
            let (node, desire) = slot.parts();
            let drifted = node.map(|n| desire.drifted(n));
            walked.push((slot.id().to_string(), desire.is_desired(), drifted));
        });
        assert_eq!(walked, expected);
        assert_eq!(walked.len(), 9, "{walked:?}");
    }
}
