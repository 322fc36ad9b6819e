//! Status snapshots: what the host tells operators about its cluster.
//!
//! A [`StatusSnapshot`] is a plain, serialisable copy of the interesting
//! parts of the driver's state. Building one is O(nodes), so the host
//! publishes one after a wake that changed something but at most once per
//! [`publish_interval`](crate::host::publish_interval) (never holding a change
//! back longer than [`PUBLISH_INTERVAL_MAX`](crate::host::PUBLISH_INTERVAL_MAX)),
//! and answers status queries with a fresh one.

use std::collections::BTreeMap;

use provisioning::{ClusterDriver, Intent, LogicalNodeId, ManagedNode};
use serde::{Deserialize, Serialize};

/// Where the host is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HostPhase {
    /// Reconciling towards the latest applied shape.
    Running,
    /// Tearing the cluster down to zero nodes.
    ShuttingDown,
    /// The host loop ended.
    Stopped,
}

impl HostPhase {
    /// A stable, lower-case name (the one used in JSON).
    pub fn name(self) -> &'static str {
        match self {
            HostPhase::Running => "running",
            HostPhase::ShuttingDown => "shutting-down",
            HostPhase::Stopped => "stopped",
        }
    }
}

/// A snapshot of the cluster as the host sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusSnapshot {
    /// The run.
    pub run_id: String,
    /// The generation of the latest accepted desired shape.
    pub generation: u64,
    /// The last generation a pass evaluated; `None` before the first pass.
    /// Equal to `generation` does not mean ready, see `converged`.
    pub observed_generation: Option<u64>,
    /// Whether every desired node is ready with its desired spec and nothing
    /// else remains.
    pub converged: bool,
    /// The host's phase.
    pub phase: HostPhase,
    /// Milliseconds since the host started.
    pub uptime_ms: u64,
    /// One entry per desired group, in name order.
    pub groups: Vec<GroupStatus>,
    /// One entry per managed node, in slot order.
    pub nodes: Vec<NodeStatus>,
    /// The journal and orphan collection, when the host keeps durable state.
    #[serde(default)]
    pub durability: Option<DurabilityStatus>,
}

/// What a host that keeps durable state reports about it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurabilityStatus {
    /// Whether the host resumed a run a previous controller left unclean.
    pub resumed: bool,
    /// Journal commits since the host started.
    pub commits: u64,
    /// Approximate bytes the journal wrote since the host started.
    pub bytes_written: u64,
    /// The last journal error, while commits fail (operations wait).
    pub journal_error: Option<String>,
    /// Provider resources no node's current attempt owns, waiting out their
    /// grace period before they are destroyed.
    pub orphans_suspected: usize,
    /// Orphans destroyed since the host started.
    pub orphans_collected: u64,
    /// Nodes found lost at recovery (journaled, no longer listed).
    pub lost_at_recovery: u64,
}

/// The state of one desired group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupStatus {
    /// The group.
    pub id: String,
    /// The provider kind serving it.
    pub provider: String,
    /// How many nodes are desired.
    pub desired: u32,
    /// How many desired slots hold a ready node with the desired spec.
    pub ready: u32,
    /// Why the group starts no new attempt, while its breaker is open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<String>,
}

/// The state of one managed node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// The slot, `{group}-{index}`.
    pub id: String,
    /// The group of the slot.
    pub group: String,
    /// The current attempt.
    pub attempt: u64,
    /// The lifecycle stage (`new`, `lease-requested`, …, `dormant`, `failed`,
    /// `destroyed`).
    pub stage: String,
    /// Whether the node is ready.
    pub ready: bool,
    /// Whether the node is being torn down.
    pub deleting: bool,
    /// Whether the slot is still desired with this node's spec.
    pub desired: bool,
    /// The kind of the pending operation, if one is in flight.
    pub pending: Option<String>,
    /// The endpoint, once known.
    pub endpoint: Option<String>,
    /// Failures since the node was last ready.
    pub consecutive_failures: u32,
    /// The last error, for operators.
    pub last_error: Option<String>,
    /// The node's last transitions, oldest first (empty when the host keeps
    /// no history).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<TransitionStatus>,
}

/// One transition of a node's history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransitionStatus {
    /// Milliseconds after the host started.
    pub at_ms: u64,
    /// The attempt after the transition.
    pub attempt: u64,
    /// The stage after the transition.
    pub stage: String,
    /// Whether the node was being torn down.
    pub deleting: bool,
    /// Whether the node was ready.
    pub ready: bool,
    /// Why, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl StatusSnapshot {
    /// Builds a snapshot of `driver`, `uptime_ms` after the host started
    /// (the driver's clock), without the nodes' histories (what progress
    /// displays need, built often).
    pub fn of(driver: &ClusterDriver, phase: HostPhase, uptime_ms: u64) -> Self {
        Self::build(driver, phase, uptime_ms, false)
    }

    /// The same, with every node's kept history (what `status` asks for).
    pub fn with_history(driver: &ClusterDriver, phase: HostPhase, uptime_ms: u64) -> Self {
        Self::build(driver, phase, uptime_ms, true)
    }

    fn build(driver: &ClusterDriver, phase: HostPhase, uptime_ms: u64, history: bool) -> Self {
        let now = provisioning::Timestamp::from_millis(uptime_ms);
        let desired = driver.desired();
        let state = driver.state();
        let mut ready_by_group: BTreeMap<&str, u32> = BTreeMap::new();
        let nodes = state
            .nodes
            .iter()
            .map(|(id, node)| {
                let is_desired = desired.is_desired_spec(&node.spec);
                if is_desired && node.is_ready() {
                    *ready_by_group.entry(id.group().as_str()).or_default() += 1;
                }
                let mut status = node_status(id, node, is_desired);
                if let Some(history) = driver.history(id).filter(|_| history) {
                    status.history = history
                        .entries()
                        .map(|t| TransitionStatus {
                            at_ms: t.at.as_millis(),
                            attempt: t.attempt.get(),
                            stage: t.stage.name().to_owned(),
                            deleting: t.deleting,
                            ready: t.ready,
                            reason: t.reason.clone(),
                        })
                        .collect();
                }
                status
            })
            .collect();
        let groups = desired
            .groups()
            .iter()
            .map(|(id, group)| GroupStatus {
                id: id.to_string(),
                provider: group.template().provider.clone(),
                desired: group.count(),
                ready: ready_by_group.get(id.as_str()).copied().unwrap_or(0),
                paused: driver.open_breaker(id, now).map(|b| {
                    format!(
                        "group {id} paused after {} failed attempts: {}",
                        b.consecutive_failures,
                        b.last_error.as_deref().unwrap_or("no reason recorded")
                    )
                }),
            })
            .collect();
        StatusSnapshot {
            run_id: driver.run_id().to_string(),
            generation: desired.generation().get(),
            observed_generation: state.observed_generation.map(|g| g.get()),
            converged: driver.is_converged(),
            phase,
            uptime_ms,
            groups,
            nodes,
            durability: None,
        }
    }

    /// Desired slots that hold a ready node with the desired spec, over all
    /// groups: the sum of the groups' `ready`, so a header built from it
    /// always agrees with the group lines (a ready node of a removed slot or
    /// an old spec is not counted).
    pub fn ready_count(&self) -> usize {
        self.groups
            .iter()
            .map(|g| usize::try_from(g.ready).unwrap_or(usize::MAX))
            .sum()
    }

    /// Nodes desired over all groups.
    pub fn desired_count(&self) -> u64 {
        self.groups.iter().map(|g| u64::from(g.desired)).sum()
    }

    /// Whether `other` differs from `self` in anything but the uptime.
    pub fn differs_from(&self, other: &StatusSnapshot) -> bool {
        self.generation != other.generation
            || self.observed_generation != other.observed_generation
            || self.converged != other.converged
            || self.phase != other.phase
            || self.groups != other.groups
            || self.nodes != other.nodes
            || self.durability != other.durability
    }
}

/// `{group}-{index}`, as the id's `Display` shows it, without a formatter:
/// a snapshot names every node, so this runs 100 000 times per build at
/// 100k nodes.
fn node_name(id: &LogicalNodeId) -> String {
    let group = id.group().as_str();
    let mut digits = [0u8; 10];
    let mut index = id.index();
    let mut start = digits.len();
    loop {
        start -= 1;
        // `index % 10` is below 10, so the cast is exact.
        digits[start] = b'0' + (index % 10) as u8;
        index /= 10;
        if index == 0 {
            break;
        }
    }
    let mut name = String::with_capacity(group.len() + 1 + digits.len() - start);
    name.push_str(group);
    name.push('-');
    for &digit in &digits[start..] {
        name.push(char::from(digit));
    }
    name
}

fn node_status(id: &LogicalNodeId, node: &ManagedNode, desired: bool) -> NodeStatus {
    NodeStatus {
        id: node_name(id),
        group: id.group().as_str().to_owned(),
        attempt: node.attempt.get(),
        stage: node.record.stage.name().to_owned(),
        ready: node.is_ready(),
        deleting: node.intent == Intent::Deleting,
        desired,
        pending: node.pending.as_ref().map(|p| p.kind.name().to_owned()),
        endpoint: node.record.endpoint.as_ref().map(|e| e.endpoint.0.clone()),
        consecutive_failures: node.retry.consecutive_failures,
        last_error: node.retry.last_error.clone(),
        history: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use provisioning::{GroupId, LogicalNodeId};

    #[test]
    fn node_names_are_what_the_ids_display() {
        for (group, index) in [("web", 0), ("gpu-pool", 9), ("a", 10), ("b", 4_294_967_295)] {
            let id = LogicalNodeId::new(GroupId::new(group), index);
            assert_eq!(super::node_name(&id), id.to_string());
        }
    }
}
