//! What a check returns: a [`Breach`] naming the guarantee it broke, and
//! the small helpers every family of checks words its findings with.
//!
//! No guarantee is checked here; every other file of the oracle leans on
//! this one and it leans on none of them.

use provisioning::shape::DesiredState;
use provisioning::state::SessionState;
use provisioning::{ClusterState, Intent, LogicalNodeId, ManagedNode};

use crate::guarantee::GuaranteeId;

/// A broken guarantee, before the harness adds where it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Breach {
    pub(crate) guarantee: GuaranteeId,
    pub(crate) detail: String,
}

pub(crate) type Verdict = Result<(), Breach>;

pub(crate) fn breach(guarantee: GuaranteeId, detail: impl Into<String>) -> Breach {
    Breach {
        guarantee,
        detail: detail.into(),
    }
}

pub(super) fn ensure(
    condition: bool,
    guarantee: GuaranteeId,
    detail: impl FnOnce() -> String,
) -> Verdict {
    if condition {
        Ok(())
    } else {
        Err(breach(guarantee, detail()))
    }
}

pub(super) fn label(id: &LogicalNodeId, node: &ManagedNode) -> String {
    format!("{id}/{}", node.attempt)
}

/// A description of what keeps a cluster from convergence, for G21 reports.
pub(crate) fn describe_pending(state: &ClusterState, desired: &DesiredState) -> String {
    let mut lines = Vec::new();
    for spec in desired.specs() {
        match state.nodes.get(spec.id()) {
            None => lines.push(format!("{}: no node", spec.id())),
            Some(node) if node.is_ready() && node.spec == spec && node.pending.is_none() => {}
            Some(node) => lines.push(describe_node(spec.id(), node)),
        }
    }
    for (id, node) in &state.nodes {
        if !desired.contains(id) {
            lines.push(format!("{} (undesired)", describe_node(id, node)));
        }
    }
    lines.join("; ")
}

pub(crate) fn describe_node(id: &LogicalNodeId, node: &ManagedNode) -> String {
    let mut text = format!("{} {}", label(id, node), node.record.stage.name());
    if node.intent == Intent::Deleting {
        text.push_str(" deleting");
    }
    if node.record.ready {
        text.push_str(" ready");
    }
    if let Some(pending) = &node.pending {
        text.push_str(&format!(
            " pending {} {} until {}",
            pending.kind, pending.id, pending.deadline
        ));
    }
    if let Some(bootstrap) = &node.record.bootstrap {
        if bootstrap.state == SessionState::Active {
            text.push_str(" session-active");
        }
    }
    if let Some(at) = node.retry.next_effect_at {
        text.push_str(&format!(" next-effect-at {at}"));
    }
    if let Some(at) = node.retry.restart_at {
        text.push_str(&format!(" restart-at {at}"));
    }
    if let Some(ambiguous) = &node.retry.ambiguous {
        text.push_str(&format!(" ambiguous {} {}", ambiguous.kind, ambiguous.op));
    }
    text
}
