//! Observed state: what the driver knows about every slot.
//!
//! Only [`crate::driver::ClusterDriver`] writes these types while it owns
//! them; the decider reads them. Fields are public so that a state can be
//! inspected, printed and built by hand for the pure decider.

use std::collections::BTreeMap;

use crate::effect::{EffectKind, Endpoint, LeaseHandle, SessionHandle};
use crate::id::{
    AttemptAllocator, Generation, LogicalNodeId, NodeAttemptId, OperationId, OperationSequence,
};
use crate::shape::LogicalNodeSpec;
use crate::time::Timestamp;

/// Everything the driver observed about the cluster.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterState {
    /// The last generation a pass evaluated; `None` before the first pass.
    pub observed_generation: Option<Generation>,
    /// The per-cluster attempt counter.
    pub attempts: AttemptAllocator,
    /// One entry per slot the driver manages, desired or not. Boxed: a
    /// bring-up's nodes are built once, where they stay, and the map (and
    /// the batch it is built from) moves a pointer per node instead of the
    /// whole node, twice.
    pub nodes: BTreeMap<LogicalNodeId, Box<ManagedNode>>,
}

impl ClusterState {
    /// The node of slot `id`, if the driver manages one.
    pub fn node(&self, id: &LogicalNodeId) -> Option<&ManagedNode> {
        self.nodes.get(id).map(|node| &**node)
    }
}

/// Whether a node should exist or is being torn down.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Intent {
    /// The node should be brought up and kept ready.
    Active,
    /// The node is being cleaned up; it never becomes active again.
    Deleting,
}

/// The lifecycle stage of one attempt.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum NodeStage {
    /// Inserted; nothing dispatched yet.
    New,
    /// `CreateLease` dispatched.
    LeaseRequested,
    /// The lease exists; the endpoint is not known yet.
    LeaseCreated,
    /// Lease and endpoint known.
    EndpointKnown,
    /// The bootstrap session runs.
    BootstrapRunning,
    /// The node's agent joined the run's swarm.
    SwarmJoined,
    /// Handoff recorded by the host (accepted as ready).
    HandedOff,
    /// Bootstrap finished after join: the ready steady state.
    Dormant,
    /// Ready before a controller restart, and not ready again until its
    /// agent re-joins the new controller (or the rejoin window ends and the
    /// node is lost). Holds what a dormant node holds.
    Rejoining,
    /// The attempt failed; cleanup follows.
    Failed,
    /// Cleanup finished; the node awaits reap or restart.
    Destroyed,
}

impl NodeStage {
    /// A stable, lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            NodeStage::New => "new",
            NodeStage::LeaseRequested => "lease-requested",
            NodeStage::LeaseCreated => "lease-created",
            NodeStage::EndpointKnown => "endpoint-known",
            NodeStage::BootstrapRunning => "bootstrap-running",
            NodeStage::SwarmJoined => "swarm-joined",
            NodeStage::HandedOff => "handed-off",
            NodeStage::Dormant => "dormant",
            NodeStage::Rejoining => "rejoining",
            NodeStage::Failed => "failed",
            NodeStage::Destroyed => "destroyed",
        }
    }
}

/// Progress stages a bootstrap stream reports.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum BootstrapProgress {
    /// The session object exists.
    Created,
    /// Connecting to the node's endpoint.
    Connecting,
    /// Connected.
    Connected,
    /// Output is streaming.
    Streaming,
    /// Running the boot (verify) checks.
    BootChecking,
    /// Starting the agent and workload.
    AgentStarting,
    /// Waiting for the agent to join the swarm.
    WaitingForJoin,
}

/// Ways a bootstrap session can fail.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum BootstrapFailure {
    /// Could not connect to the endpoint.
    ConnectFailed,
    /// A verify command failed.
    BootCheckFailed,
    /// The agent or workload did not start.
    StartFailed,
    /// The agent did not join the swarm.
    JoinFailed,
    /// The stream broke.
    StreamError,
}

impl BootstrapFailure {
    /// Every failure, in stream order.
    pub const ALL: [BootstrapFailure; 5] = [
        BootstrapFailure::ConnectFailed,
        BootstrapFailure::BootCheckFailed,
        BootstrapFailure::StartFailed,
        BootstrapFailure::JoinFailed,
        BootstrapFailure::StreamError,
    ];
}

/// What an operator reads: the stage of the bootstrap that failed.
impl std::fmt::Display for BootstrapFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BootstrapFailure::ConnectFailed => "could not reach the node's agent",
            BootstrapFailure::BootCheckFailed => "a boot check failed",
            BootstrapFailure::StartFailed => "the agent or its workload did not start",
            BootstrapFailure::JoinFailed => "the agent did not join the swarm",
            BootstrapFailure::StreamError => "the bootstrap stream broke",
        })
    }
}

/// The last bootstrap fact folded for a session.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum BootstrapStage {
    /// A progress stage.
    Progress(BootstrapProgress),
    /// The stream reported convergence.
    Converged,
    /// The session closed.
    Closed,
    /// The session failed.
    Failed(BootstrapFailure),
    /// The session was cancelled by cleanup.
    Cancelled,
}

/// Whether a bootstrap session is still running.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum SessionState {
    /// Running, or possibly running: cleanup must cancel it.
    Active,
    /// Closed by the provider.
    Closed,
    /// Cancelled by cleanup.
    Cancelled,
}

/// Facts about the lease of the current attempt.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LeaseFacts {
    /// The attempt the lease was created for.
    pub attempt: NodeAttemptId,
    /// The provider's name for the lease.
    pub lease: LeaseHandle,
    /// When the creation result was folded.
    pub observed_at: Timestamp,
    /// Whether the provider adopted an existing resource.
    #[serde(default, skip_serializing_if = "is_false")]
    pub adopted: bool,
}

/// Facts about the endpoint of the current attempt.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EndpointFacts {
    /// The attempt the endpoint belongs to.
    pub attempt: NodeAttemptId,
    /// Where the node is reachable.
    pub endpoint: Endpoint,
    /// When it was learned.
    pub observed_at: Timestamp,
}

/// Facts about the bootstrap session of the current attempt.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BootstrapFacts {
    /// The attempt the session belongs to.
    pub attempt: NodeAttemptId,
    /// The provider's name for the session, once the start result named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionHandle>,
    /// Whether the session still runs.
    pub state: SessionState,
    /// The last stage folded.
    pub stage: BootstrapStage,
    /// Whether the result of `BootstrapConvergenceObserved` was folded for
    /// this session; it is dispatched at most once per session.
    #[serde(default, skip_serializing_if = "is_false")]
    pub convergence_observed: bool,
}

/// Facts about the agent's swarm membership.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SwarmJoinFacts {
    /// The attempt whose agent joined.
    pub attempt: NodeAttemptId,
    /// When the join was folded.
    pub joined_at: Timestamp,
}

/// Why and when an attempt failed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FailureFacts {
    /// A human-readable reason.
    pub reason: String,
    /// When the failure was folded.
    pub at: Timestamp,
}

/// The lifecycle facts of one attempt.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeRecord {
    /// The stage.
    pub stage: NodeStage,
    /// Whether the node is ready (converged for its spec).
    #[serde(default, skip_serializing_if = "is_false")]
    pub ready: bool,
    /// The lease, while it is (or may be) live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseFacts>,
    /// The endpoint, while the lease is live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<EndpointFacts>,
    /// The bootstrap session, once one was started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<BootstrapFacts>,
    /// The swarm join, once the agent joined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swarm: Option<SwarmJoinFacts>,
    /// When the handoff (bootstrap close after join) was folded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_off_at: Option<Timestamp>,
    /// Why the attempt failed, if it did. Boxed: a record rarely holds one,
    /// and the box keeps 24 bytes out of every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Box<FailureFacts>>,
    /// When cleanup finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destroyed_at: Option<Timestamp>,
    /// While the node is [`NodeStage::Rejoining`]: the instant its agent
    /// must have re-joined the restarted controller by, or the node is lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejoin_by: Option<Timestamp>,
}

impl NodeRecord {
    /// The record of a freshly inserted attempt.
    pub fn new() -> Self {
        NodeRecord {
            stage: NodeStage::New,
            ready: false,
            lease: None,
            endpoint: None,
            bootstrap: None,
            swarm: None,
            handed_off_at: None,
            failure: None,
            destroyed_at: None,
            rejoin_by: None,
        }
    }

    /// Whether a bootstrap session may still be running.
    pub fn session_active(&self) -> bool {
        self.bootstrap
            .as_ref()
            .is_some_and(|b| b.state == SessionState::Active)
    }
}

impl Default for NodeRecord {
    fn default() -> Self {
        NodeRecord::new()
    }
}

/// The single operation a node may have in flight.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PendingOperation {
    /// The operation.
    pub id: OperationId,
    /// Its kind.
    pub kind: EffectKind,
    /// When it was recorded.
    pub dispatched_at: Timestamp,
    /// When it times out (due exactly at this instant).
    pub deadline: Timestamp,
}

/// An ambiguous create or bootstrap start that must be re-issued before any
/// destructive step.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AmbiguousOperation {
    /// The operation whose outcome is unknown.
    pub op: OperationId,
    /// Its kind.
    pub kind: EffectKind,
}

/// Per-node retry bookkeeping. Deadlines are computed when an observation is
/// folded and only read by the decider.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RetryState {
    /// Failures since the node was last ready; carries into a replacement.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub consecutive_failures: u32,
    /// No effect before this instant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_effect_at: Option<Timestamp>,
    /// A failed attempt restarts no earlier than this instant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_at: Option<Timestamp>,
    /// The last error, for operators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// An ambiguous create/start to re-issue before anything destructive.
    /// Boxed: rarely set, and the box keeps 16 bytes out of every node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ambiguous: Option<Box<AmbiguousOperation>>,
}

/// One slot under management.
///
/// Laid out in this field order (`repr(C)`) so that what a full pass reads
/// of a node at rest — the record's stage and ready flag (which the compiler
/// puts at the end of the record), the intent, the spec's run and template,
/// whether an operation is pending and the stored backoff (at the start of
/// the retry state) — lies within about a hundred bytes instead of being
/// spread over the whole node: a pass over a large cluster is bound by the
/// cache lines it touches.
#[derive(Clone, Debug, PartialEq)]
#[repr(C)]
pub struct ManagedNode {
    /// Lifecycle facts of the current attempt.
    pub record: NodeRecord,
    /// Active or deleting.
    pub intent: Intent,
    /// The sequence the next operation of this attempt gets.
    pub next_sequence: OperationSequence,
    /// The immutable template of the current attempt.
    pub spec: LogicalNodeSpec,
    /// The operation in flight, if any.
    pub pending: Option<PendingOperation>,
    /// Retry bookkeeping.
    pub retry: RetryState,
    /// The current attempt.
    pub attempt: NodeAttemptId,
}

impl ManagedNode {
    /// A freshly inserted (or restarted) attempt.
    pub fn new(spec: LogicalNodeSpec, attempt: NodeAttemptId, retry: RetryState) -> Self {
        ManagedNode {
            spec,
            attempt,
            intent: Intent::Active,
            record: NodeRecord::new(),
            pending: None,
            next_sequence: OperationSequence::FIRST,
            retry,
        }
    }

    /// Whether the node counts as ready: the flag is set, the node is active
    /// and in a ready stage.
    pub fn is_ready(&self) -> bool {
        self.record.ready
            && self.intent == Intent::Active
            && matches!(self.record.stage, NodeStage::HandedOff | NodeStage::Dormant)
    }

    /// The pending operation id, if any.
    pub fn pending_op(&self) -> Option<OperationId> {
        self.pending.as_ref().map(|p| p.id)
    }
}

// Written instead of the default values they skip, so a journal row holds
// only what a node has.
#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_false(value: &bool) -> bool {
    !*value
}

#[allow(clippy::trivially_copy_pass_by_ref)]
fn is_zero(value: &u32) -> bool {
    *value == 0
}

/// A fresh node of slot `index` of group `g` on [`crate::shape::test_template`],
/// attempt `attempt`, for the crate's unit tests.
#[cfg(test)]
pub(crate) fn test_node(index: u32, attempt: u64) -> ManagedNode {
    let id = LogicalNodeId::new(crate::id::GroupId::new("g"), index);
    let spec = LogicalNodeSpec::new(
        id,
        crate::id::RunId::new("r"),
        std::sync::Arc::new(crate::shape::test_template("img")),
    );
    ManagedNode::new(
        spec,
        NodeAttemptId::from_raw(attempt),
        RetryState::default(),
    )
}
