//! Plans: what applying a shape would change, without applying it.
//!
//! [`plan_against`] compares an observed state with a validated desired
//! state. It reports one [`PlannedChange`] per slot (create, replace,
//! remove, keep) for people, and the decider's next step per slot
//! ([`provisioning::reconcile`]) for those who want to see the machinery.

use std::collections::BTreeSet;

use provisioning::{
    ClusterState, DesiredState, Intent, LogicalNodeId, NodeAction, NodeStage, Timestamp, reconcile,
};
use serde::{Deserialize, Serialize};

/// What would happen to one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChangeKind {
    /// The slot is desired and has no node: a node will be created.
    Create,
    /// The slot's node has another spec: it will be replaced by a new attempt.
    Replace,
    /// The slot is no longer desired: its node will be torn down.
    Remove,
    /// The slot's node is already being torn down and is not desired.
    AlreadyRemoving,
    /// The slot's node already has the desired spec.
    Keep,
}

impl ChangeKind {
    /// A short word for tables.
    pub fn name(self) -> &'static str {
        match self {
            ChangeKind::Create => "create",
            ChangeKind::Replace => "replace",
            ChangeKind::Remove => "remove",
            ChangeKind::AlreadyRemoving => "removing",
            ChangeKind::Keep => "keep",
        }
    }
}

/// The planned change of one slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedChange {
    /// The slot.
    pub node: String,
    /// What happens to it.
    pub change: ChangeKind,
    /// The attempt the slot holds now, if any.
    pub attempt: Option<u64>,
}

/// The decider's next step for one slot, as text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedStep {
    /// The slot.
    pub node: String,
    /// The ladder rule that matched (for example `CreateLease`).
    pub rule: String,
    /// The action (for example `dispatch create-lease`).
    pub action: String,
}

/// What applying a shape would do.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanReport {
    /// The run.
    pub run_id: String,
    /// The generation the plan evaluated.
    pub generation: u64,
    /// One entry per slot, managed or desired, in slot order.
    pub changes: Vec<PlannedChange>,
    /// The decider's next step for each slot that would act now.
    pub next_steps: Vec<PlannedStep>,
}

impl PlanReport {
    /// How many slots get `kind`.
    pub fn count(&self, kind: ChangeKind) -> usize {
        self.changes.iter().filter(|c| c.change == kind).count()
    }

    /// Whether applying the shape would change nothing.
    pub fn is_noop(&self) -> bool {
        self.changes
            .iter()
            .all(|c| matches!(c.change, ChangeKind::Keep))
    }
}

/// Plans `desired` against `state` at `now`. Pure: reads no clock, changes
/// nothing.
pub fn plan_against(state: &ClusterState, desired: &DesiredState, now: Timestamp) -> PlanReport {
    let mut slots: BTreeSet<LogicalNodeId> = state.nodes.keys().cloned().collect();
    slots.extend(desired.specs().map(|spec| spec.id().clone()));
    let changes = slots
        .into_iter()
        .map(|id| {
            let node = state.nodes.get(&id);
            let spec = desired.spec(&id);
            let change = match (node, spec) {
                (None, _) => ChangeKind::Create,
                (Some(node), None) => {
                    if node.intent == Intent::Deleting || node.record.stage == NodeStage::Destroyed
                    {
                        ChangeKind::AlreadyRemoving
                    } else {
                        ChangeKind::Remove
                    }
                }
                (Some(node), Some(spec)) if node.spec != spec => ChangeKind::Replace,
                (Some(node), Some(_)) if node.intent == Intent::Deleting => ChangeKind::Replace,
                (Some(_), Some(_)) => ChangeKind::Keep,
            };
            PlannedChange {
                node: id.to_string(),
                change,
                attempt: node.map(|n| n.attempt.get()),
            }
        })
        .collect();
    let plan = reconcile(state, desired, now);
    let next_steps = plan
        .actions
        .iter()
        .map(|step| PlannedStep {
            node: step.node.to_string(),
            rule: format!("{:?}", step.rule),
            action: action_text(step.action),
        })
        .collect();
    PlanReport {
        run_id: desired.run_id().to_string(),
        generation: desired.generation().get(),
        changes,
        next_steps,
    }
}

fn action_text(action: NodeAction) -> String {
    match action {
        NodeAction::None => "none".to_owned(),
        NodeAction::Insert => "insert".to_owned(),
        NodeAction::Reap => "reap".to_owned(),
        NodeAction::Restart => "restart".to_owned(),
        NodeAction::BeginDelete => "begin-delete".to_owned(),
        NodeAction::MarkDestroyed => "mark-destroyed".to_owned(),
        NodeAction::ExpireRejoin => "expire-rejoin".to_owned(),
        NodeAction::Dispatch(kind) => format!("dispatch {kind}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provisioning::{
        BootParams, ClusterShape, Generation, GroupId, NodeGroup, NodeTemplate, ProviderShape,
        RunId, SwarmJoinTemplate,
    };

    fn group(id: &str, count: u32) -> NodeGroup {
        NodeGroup {
            id: GroupId::new(id),
            run_id: RunId::new("run"),
            count,
            template: NodeTemplate {
                role: "worker".into(),
                provider: "fake".into(),
                shape: ProviderShape::default(),
                boot: BootParams::default(),
                swarm_join: SwarmJoinTemplate::default(),
            },
        }
    }

    #[test]
    fn a_plan_from_empty_creates_every_desired_slot() {
        let desired = ClusterShape {
            run_id: RunId::new("run"),
            generation: Generation::new(1),
            groups: vec![group("a", 2), group("b", 1)],
        }
        .validate()
        .unwrap();
        let report = plan_against(&ClusterState::default(), &desired, Timestamp::ZERO);
        let changes: Vec<(&str, ChangeKind)> = report
            .changes
            .iter()
            .map(|c| (c.node.as_str(), c.change))
            .collect();
        assert_eq!(
            changes,
            [
                ("a-0", ChangeKind::Create),
                ("a-1", ChangeKind::Create),
                ("b-0", ChangeKind::Create)
            ]
        );
        assert_eq!(report.next_steps.len(), 3);
        assert!(report.next_steps.iter().all(|s| s.action == "insert"));
        assert!(!report.is_noop());
    }
}
