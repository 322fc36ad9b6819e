//! Status snapshots: what the host tells operators about its cluster.
//!
//! A [`StatusSnapshot`] is a plain, serialisable copy of the interesting
//! parts of the driver's state. Building one is O(nodes), so the host
//! publishes one after a wake that changed something but at most once per
//! [`publish_interval`](crate::host::publish_interval) (never holding a change
//! back longer than [`PUBLISH_INTERVAL_MAX`](crate::host::PUBLISH_INTERVAL_MAX)),
//! and answers status queries with a fresh one.
//!
//! The nodes of a snapshot are shared ([`NodeList`] holds each
//! [`NodeStatus`] behind an `Arc`), so the host keeps its progress view up to
//! date one changed node at a time ([`Progress`]) and a published snapshot
//! copies pointers, not nodes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use provisioning::{
    ClusterDriver, Generation, GroupId, Intent, LogicalNodeId, ManagedNode, Timestamp,
};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
    pub nodes: NodeList,
    /// The journal and orphan collection, when the host keeps durable state.
    #[serde(default)]
    pub durability: Option<DurabilityStatus>,
}

/// The nodes of a [`StatusSnapshot`], in slot order.
///
/// Reads like a slice of [`NodeStatus`] (`iter`, `len`, `get`, indexing,
/// `for node in &list`) and serialises as a plain sequence; each node is
/// shared between the snapshots that show it unchanged, so cloning a list
/// copies pointers. Writing through an index copies that one node first when
/// another snapshot shares it.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NodeList(Vec<Arc<NodeStatus>>);

impl NodeList {
    /// How many nodes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no node.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The node at `index`.
    pub fn get(&self, index: usize) -> Option<&NodeStatus> {
        self.0.get(index).map(Arc::as_ref)
    }

    /// The nodes, in slot order.
    pub fn iter(&self) -> NodeIter<'_> {
        NodeIter(self.0.iter())
    }

    /// Appends `node`.
    pub fn push(&mut self, node: NodeStatus) {
        self.0.push(Arc::new(node));
    }
}

impl fmt::Debug for NodeList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl std::ops::Index<usize> for NodeList {
    type Output = NodeStatus;

    fn index(&self, index: usize) -> &NodeStatus {
        &self.0[index]
    }
}

impl std::ops::IndexMut<usize> for NodeList {
    fn index_mut(&mut self, index: usize) -> &mut NodeStatus {
        Arc::make_mut(&mut self.0[index])
    }
}

impl From<Vec<NodeStatus>> for NodeList {
    fn from(nodes: Vec<NodeStatus>) -> Self {
        nodes.into_iter().collect()
    }
}

impl FromIterator<NodeStatus> for NodeList {
    fn from_iter<I: IntoIterator<Item = NodeStatus>>(nodes: I) -> Self {
        NodeList(nodes.into_iter().map(Arc::new).collect())
    }
}

impl<'a> IntoIterator for &'a NodeList {
    type Item = &'a NodeStatus;
    type IntoIter = NodeIter<'a>;

    fn into_iter(self) -> NodeIter<'a> {
        self.iter()
    }
}

impl Serialize for NodeList {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for NodeList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<NodeStatus>::deserialize(deserializer).map(NodeList::from)
    }
}

/// The nodes of a [`NodeList`], in slot order.
#[derive(Clone, Debug)]
pub struct NodeIter<'a>(std::slice::Iter<'a, Arc<NodeStatus>>);

impl<'a> Iterator for NodeIter<'a> {
    type Item = &'a NodeStatus;

    fn next(&mut self) -> Option<&'a NodeStatus> {
        self.0.next().map(Arc::as_ref)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl DoubleEndedIterator for NodeIter<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.0.next_back().map(Arc::as_ref)
    }
}

impl ExactSizeIterator for NodeIter<'_> {}

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
    /// How many ready nodes of the group have an older spec and are not
    /// being removed: during a rollout, the old nodes that still serve.
    #[serde(default)]
    pub ready_old: u32,
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
    /// The lifecycle stage (`new`, `lease-requested`, …, `dormant`,
    /// `rejoining` (recovered after a restart, not ready until its agent
    /// re-joins), `failed`,
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
        let desired = driver.desired();
        let state = driver.state();
        let mut ready_by_group: BTreeMap<&str, u32> = BTreeMap::new();
        let mut old_by_group: BTreeMap<&str, u32> = BTreeMap::new();
        let nodes = state
            .nodes
            .iter()
            .map(|(id, node)| {
                let is_desired = desired.is_desired_spec(&node.spec);
                if is_desired && node.is_ready() {
                    *ready_by_group.entry(id.group().as_str()).or_default() += 1;
                } else if serves_old_spec(node, is_desired) {
                    *old_by_group.entry(id.group().as_str()).or_default() += 1;
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
                Arc::new(status)
            })
            .collect();
        let groups = group_statuses(driver, uptime_ms, |id| {
            (
                ready_by_group.get(id.as_str()).copied().unwrap_or(0),
                old_by_group.get(id.as_str()).copied().unwrap_or(0),
            )
        });
        StatusSnapshot {
            run_id: driver.run_id().to_string(),
            generation: desired.generation().get(),
            observed_generation: state.observed_generation.map(|g| g.get()),
            converged: driver.is_converged(),
            phase,
            uptime_ms,
            groups,
            nodes: NodeList(nodes),
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

/// Whether `node` is a ready node of an older spec that is not being
/// removed: one that still serves while a rollout replaces it.
fn serves_old_spec(node: &ManagedNode, is_desired: bool) -> bool {
    !is_desired && node.is_ready() && node.intent != Intent::Deleting
}

/// One entry per desired group, in name order, with the ready counts
/// (desired spec, older spec) `ready` gives for each.
fn group_statuses(
    driver: &ClusterDriver,
    uptime_ms: u64,
    ready: impl Fn(&GroupId) -> (u32, u32),
) -> Vec<GroupStatus> {
    let now = Timestamp::from_millis(uptime_ms);
    driver
        .desired()
        .groups()
        .iter()
        .map(|(id, group)| {
            let (ready, ready_old) = ready(id);
            GroupStatus {
                id: id.to_string(),
                provider: group.template().provider.clone(),
                desired: group.count(),
                ready,
                ready_old,
                paused: driver.open_breaker(id, now).map(|b| {
                    format!(
                        "group {id} paused after {} failed attempts: {}",
                        b.consecutive_failures,
                        b.last_error.as_deref().unwrap_or("no reason recorded")
                    )
                }),
            }
        })
        .collect()
}

/// The host's progress view: every node's status, brought up to date one
/// changed node at a time, and the counts a snapshot shows, so that a
/// progress snapshot costs the nodes that changed since the last one plus a
/// pointer per node, not a status built per node.
///
/// # Assumptions
/// Every change of a node a [`NodeStatus`] shows reaches
/// [`Progress::note_changes`] (the driver's change tracker records every
/// change of a node's durable form, which holds every field shown), and a
/// node's `desired` flag changes only with the desired generation (a new
/// generation rebuilds the whole view).
#[derive(Debug, Default)]
pub(crate) struct Progress {
    nodes: BTreeMap<LogicalNodeId, Arc<NodeStatus>>,
    /// Nodes changed since the view was last brought up to date.
    changed: BTreeSet<LogicalNodeId>,
    /// The desired generation the view was built against; `None` until the
    /// first build, and after [`Progress::invalidate`].
    generation: Option<Generation>,
    counts: Counts,
}

/// What a [`Progress`] view counts over its nodes.
#[derive(Debug, Default)]
struct Counts {
    /// Per group: desired slots holding a ready node with the desired spec.
    ready: BTreeMap<GroupId, u32>,
    /// Per group: ready nodes of an older spec not being removed.
    ready_old: BTreeMap<GroupId, u32>,
    /// Nodes desired with their spec, ready, with no operation pending: all
    /// of them are, whenever the driver is converged.
    settled: usize,
}

impl Counts {
    fn add(&mut self, id: &LogicalNodeId, status: &NodeStatus) {
        if shows_old_spec(status) {
            match self.ready_old.get_mut(id.group()) {
                Some(old) => *old = old.saturating_add(1),
                None => {
                    self.ready_old.insert(id.group().clone(), 1);
                }
            }
        }
        if !(status.desired && status.ready) {
            return;
        }
        match self.ready.get_mut(id.group()) {
            Some(ready) => *ready = ready.saturating_add(1),
            None => {
                self.ready.insert(id.group().clone(), 1);
            }
        }
        if status.pending.is_none() {
            self.settled = self.settled.saturating_add(1);
        }
    }

    fn remove(&mut self, id: &LogicalNodeId, status: &NodeStatus) {
        if shows_old_spec(status)
            && let Some(old) = self.ready_old.get_mut(id.group())
        {
            *old = old.saturating_sub(1);
        }
        if !(status.desired && status.ready) {
            return;
        }
        if let Some(ready) = self.ready.get_mut(id.group()) {
            *ready = ready.saturating_sub(1);
        }
        if status.pending.is_none() {
            self.settled = self.settled.saturating_sub(1);
        }
    }
}

impl Progress {
    /// Notes the nodes in `changed` (inserted, changed or removed).
    pub(crate) fn note_nodes(&mut self, mut changed: BTreeSet<LogicalNodeId>) {
        if self.generation.is_none() {
            return;
        }
        if self.changed.is_empty() {
            self.changed = changed;
        } else {
            self.changed.append(&mut changed);
        }
    }

    /// Forgets the view: the next snapshot builds it whole.
    pub(crate) fn invalidate(&mut self) {
        self.generation = None;
        self.changed.clear();
    }

    /// A snapshot of `driver` as [`StatusSnapshot::of`] builds it, from the
    /// view brought up to date first.
    pub(crate) fn snapshot(
        &mut self,
        driver: &ClusterDriver,
        phase: HostPhase,
        uptime_ms: u64,
    ) -> StatusSnapshot {
        self.update(driver);
        let desired = driver.desired();
        let state = driver.state();
        let desired_count = desired.node_count();
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        // Converged implies every node settled and one node per desired
        // slot, so the driver's own O(nodes) check runs only when the
        // counts allow it.
        let converged = state.observed_generation == Some(desired.generation())
            && count(self.nodes.len()) == desired_count
            && count(self.counts.settled) == desired_count
            && driver.is_converged();
        let groups = group_statuses(driver, uptime_ms, |id| {
            (
                self.counts.ready.get(id).copied().unwrap_or(0),
                self.counts.ready_old.get(id).copied().unwrap_or(0),
            )
        });
        StatusSnapshot {
            run_id: driver.run_id().to_string(),
            generation: desired.generation().get(),
            observed_generation: state.observed_generation.map(|g| g.get()),
            converged,
            phase,
            uptime_ms,
            groups,
            nodes: NodeList(self.nodes.values().cloned().collect()),
            durability: None,
        }
    }

    /// Brings the view up to date with `driver`: builds the status of each
    /// node changed since the last update (the whole view after a new
    /// desired generation, or when most nodes changed).
    pub(crate) fn update(&mut self, driver: &ClusterDriver) {
        let generation = driver.desired().generation();
        if self.generation != Some(generation) {
            self.rebuild(driver);
            return;
        }
        if self.changed.len() > self.nodes.len() / 2 {
            // Most nodes changed: building the view whole is cheaper.
            self.rebuild(driver);
            return;
        }
        let desired = driver.desired();
        let nodes = &driver.state().nodes;
        for id in std::mem::take(&mut self.changed) {
            match (self.nodes.get_mut(&id), nodes.get(&id)) {
                (Some(shown), Some(node)) => {
                    let is_desired = desired.is_desired_spec(&node.spec);
                    if shows(shown, node, is_desired) {
                        // A change a snapshot does not show (a handle, a
                        // sequence number): the shared status stays.
                        continue;
                    }
                    let status = node_status(&id, node, is_desired);
                    self.counts.remove(&id, shown);
                    self.counts.add(&id, &status);
                    *shown = Arc::new(status);
                }
                (Some(_), None) => {
                    if let Some(old) = self.nodes.remove(&id) {
                        self.counts.remove(&id, &old);
                    }
                }
                (None, Some(node)) => {
                    let status = node_status(&id, node, desired.is_desired_spec(&node.spec));
                    self.counts.add(&id, &status);
                    self.nodes.insert(id, Arc::new(status));
                }
                (None, None) => {}
            }
        }
    }

    fn rebuild(&mut self, driver: &ClusterDriver) {
        let desired = driver.desired();
        self.changed.clear();
        self.counts = Counts::default();
        let mut nodes = BTreeMap::new();
        for (id, node) in &driver.state().nodes {
            let status = node_status(id, node, desired.is_desired_spec(&node.spec));
            self.counts.add(id, &status);
            nodes.insert(id.clone(), Arc::new(status));
        }
        self.nodes = nodes;
        self.generation = Some(desired.generation());
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

/// Whether `status` shows a ready node of an older spec that is not being
/// removed (as [`serves_old_spec`] says of its node).
fn shows_old_spec(status: &NodeStatus) -> bool {
    !status.desired && status.ready && !status.deleting
}

/// Whether `status` already shows `node` as [`node_status`] would build it
/// (the id and group are the slot's; compares every other field it sets).
fn shows(status: &NodeStatus, node: &ManagedNode, desired: bool) -> bool {
    status.attempt == node.attempt.get()
        && status.stage == node.record.stage.name()
        && status.ready == node.is_ready()
        && status.deleting == (node.intent == Intent::Deleting)
        && status.desired == desired
        && status.pending.as_deref() == node.pending.as_ref().map(|p| p.kind.name())
        && status.endpoint.as_deref()
            == node.record.endpoint.as_ref().map(|e| e.endpoint.0.as_str())
        && status.consecutive_failures == node.retry.consecutive_failures
        && status.last_error == node.retry.last_error
        && status.history.is_empty()
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

    use super::{NodeList, NodeStatus};

    fn node(id: &str, stage: &str) -> NodeStatus {
        NodeStatus {
            id: id.to_owned(),
            group: "g".to_owned(),
            attempt: 1,
            stage: stage.to_owned(),
            ready: false,
            deleting: false,
            desired: true,
            pending: None,
            endpoint: None,
            consecutive_failures: 0,
            last_error: None,
            history: Vec::new(),
        }
    }

    #[test]
    fn a_node_list_serialises_as_a_plain_sequence_and_reads_back_equal() {
        let list = NodeList::from(vec![node("g-0", "new"), node("g-1", "dormant")]);
        let json = serde_json::to_value(&list).unwrap();
        let plain = serde_json::to_value(vec![node("g-0", "new"), node("g-1", "dormant")]).unwrap();
        assert_eq!(json, plain);
        let back: NodeList = serde_json::from_value(json).unwrap();
        assert_eq!(back, list);
        let ids: Vec<&str> = back.iter().rev().map(|n| n.id.as_str()).collect();
        assert_eq!(ids, ["g-1", "g-0"]);
    }

    #[test]
    fn writing_through_an_index_leaves_a_shared_copy_unchanged() {
        let shared = NodeList::from(vec![node("g-0", "new")]);
        let mut written = shared.clone();
        written[0].stage = "failed".to_owned();
        assert_eq!(shared[0].stage, "new");
        assert_eq!(written.get(0).map(|n| n.stage.as_str()), Some("failed"));
        assert_ne!(shared, written);
    }

    #[test]
    fn a_status_shows_its_node_until_a_field_it_shows_changes() {
        use provisioning::state::RetryState;
        use provisioning::{
            Intent, LogicalNodeSpec, ManagedNode, NodeAttemptId, NodeStage, NodeTemplate, RunId,
        };
        let template = std::sync::Arc::new(NodeTemplate {
            role: "worker".into(),
            provider: "fake".into(),
            shape: Default::default(),
            boot: Default::default(),
            swarm_join: Default::default(),
        });
        let id = LogicalNodeId::new(GroupId::new("g"), 3);
        let spec = LogicalNodeSpec::new(id.clone(), RunId::new("r"), template);
        let base = ManagedNode::new(spec, NodeAttemptId::from_raw(1), RetryState::default());
        let shown = super::node_status(&id, &base, true);
        assert!(super::shows(&shown, &base, true));
        assert!(!super::shows(&shown, &base, false), "desired");
        let mut unshown = base.clone();
        unshown.next_sequence = unshown.next_sequence.next().unwrap();
        assert!(
            super::shows(&shown, &unshown, true),
            "a sequence is not shown"
        );
        let changes: [fn(&mut ManagedNode); 6] = [
            |n| n.attempt = NodeAttemptId::from_raw(2),
            |n| n.record.stage = NodeStage::LeaseRequested,
            |n| n.intent = Intent::Deleting,
            |n| n.retry.consecutive_failures = 1,
            |n| n.retry.last_error = Some("boom".into()),
            |n| {
                n.record.stage = NodeStage::Dormant;
                n.record.ready = true;
            },
        ];
        for (index, change) in changes.into_iter().enumerate() {
            let mut changed = base.clone();
            change(&mut changed);
            assert!(!super::shows(&shown, &changed, true), "change {index}");
            let rebuilt = super::node_status(&id, &changed, true);
            assert!(super::shows(&rebuilt, &changed, true), "rebuilt {index}");
        }
    }

    #[test]
    fn node_names_are_what_the_ids_display() {
        for (group, index) in [("web", 0), ("gpu-pool", 9), ("a", 10), ("b", 4_294_967_295)] {
            let id = LogicalNodeId::new(GroupId::new(group), index);
            assert_eq!(super::node_name(&id), id.to_string());
        }
    }
}
