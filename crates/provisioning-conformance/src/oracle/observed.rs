//! What the harness observed around one moment, in the form the checks
//! take it: the cause of a fold ([`FoldCause`]), the operations a drive
//! dispatched ([`NewDispatch`]), each slot before and after a drive
//! ([`SlotChange`]), what a pass found ([`PassBefore`]) and what a node's
//! history entry should say of it ([`Condition`]).

use std::collections::{BTreeMap, BTreeSet};

use provisioning::effect::{EffectOutput, EndpointLookup};
use provisioning::state::PendingOperation;
use provisioning::{
    ClusterState, ExecutorResult, Intent, LogicalNodeId, ManagedNode, NodeAttemptId, NodeStage,
    Observation,
};

use super::model::kit_ready;

/// What a fold was about, for the fold checks.
pub(crate) enum FoldCause<'a> {
    /// The result of the node's pending operation.
    Result(&'a ExecutorResult),
    /// An observation of the node's current attempt.
    Observation(&'a Observation),
}

impl FoldCause<'_> {
    pub(super) fn succeeded_with(&self, wanted: fn(&EffectOutput) -> bool) -> bool {
        matches!(self, FoldCause::Result(r) if r.outcome.as_ref().is_ok_and(wanted))
    }

    pub(super) fn is_probe(&self) -> bool {
        self.succeeded_with(|o| matches!(o, EffectOutput::Endpoint(EndpointLookup::NotReady)))
    }

    /// A cleanup step (cancel, destroy) that failed, or whose output is of
    /// another operation (which the driver folds as a failure).
    pub(super) fn is_failed_cleanup(&self) -> bool {
        matches!(self, FoldCause::Result(r) if r.kind.is_cleanup()
            && !r.outcome.as_ref().is_ok_and(|output| output.kind() == r.kind))
    }

    pub(super) fn describe(&self) -> String {
        match self {
            FoldCause::Result(r) => match &r.outcome {
                Ok(output) => format!("result of {} {}: ok {output:?}", r.kind, r.op),
                Err(error) => format!("result of {} {}: {error}", r.kind, r.op),
            },
            FoldCause::Observation(o) => format!("observation {o:?}"),
        }
    }
}

/// What a node's history entry says of it: attempt, stage, whether it is
/// being torn down, whether it is ready.
pub(crate) type Condition = (NodeAttemptId, NodeStage, bool, bool);

/// The condition of `node`, by the kit's reading of its fields.
pub(crate) fn condition(node: &ManagedNode) -> Condition {
    (
        node.attempt,
        node.record.stage,
        node.intent == Intent::Deleting,
        node.is_ready(),
    )
}

/// An operation recorded pending during a drive.
#[derive(Clone, Debug)]
pub(crate) struct NewDispatch {
    pub(crate) node: LogicalNodeId,
    pub(crate) pending: PendingOperation,
}

/// Lists the operations recorded pending during a drive.
pub(crate) fn new_dispatches(pre: &ClusterState, post: &ClusterState) -> Vec<NewDispatch> {
    post.nodes
        .iter()
        .filter_map(|(id, node)| {
            let pending = node.pending.as_ref()?;
            let before = pre.node(id).and_then(ManagedNode::pending_op);
            (before != Some(pending.id)).then(|| NewDispatch {
                node: id.clone(),
                pending: pending.clone(),
            })
        })
        .collect()
}

/// What happened to one slot during a drive.
pub(crate) struct SlotChange<'a> {
    pub(crate) id: &'a LogicalNodeId,
    pub(crate) before: Option<&'a ManagedNode>,
    pub(crate) after: Option<&'a ManagedNode>,
}

/// Every slot present before or after a drive.
pub(crate) fn slot_changes<'a>(
    pre: &'a ClusterState,
    post: &'a ClusterState,
) -> Vec<SlotChange<'a>> {
    let ids: BTreeSet<&LogicalNodeId> = pre.nodes.keys().chain(post.nodes.keys()).collect();
    ids.into_iter()
        .map(|id| SlotChange {
            id,
            before: pre.node(id),
            after: post.node(id),
        })
        .collect()
}

/// What a pass found of each node: its pending operation, attempt, intent
/// and template.
pub(crate) type PassBefore = BTreeMap<
    LogicalNodeId,
    (
        Option<provisioning::OperationId>,
        NodeAttemptId,
        Intent,
        bool,
    ),
>;

/// What a pass found of every node of `state` (the last field: whether the
/// node was ready, by the kit's reading).
pub(crate) fn pass_before(state: &ClusterState) -> PassBefore {
    state
        .nodes
        .iter()
        .map(|(id, node)| {
            let ready = kit_ready(node);
            (
                id.clone(),
                (
                    node.pending.as_ref().map(|p| p.id),
                    node.attempt,
                    node.intent,
                    ready,
                ),
            )
        })
        .collect()
}
