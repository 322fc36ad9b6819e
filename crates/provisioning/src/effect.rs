//! Effects: what the driver asks a provider to do, and what comes back.

use std::fmt;

use thiserror::Error;

use crate::id::{LogicalNodeId, NodeAttemptId, OperationId, RunId};
use crate::shape::LogicalNodeSpec;

/// The kinds of provider effects the decider can dispatch.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum EffectKind {
    /// Create (or adopt) the lease for an attempt.
    CreateLease,
    /// Ask where the leased node can be reached.
    LookupEndpoint,
    /// Start (or adopt) the bootstrap session of an attempt.
    StartBootstrap,
    /// Tell the provider that the agent joined, so it may finish the session.
    BootstrapConvergenceObserved,
    /// Stop the bootstrap session of an attempt; absent counts as success.
    CancelBootstrap,
    /// Release the lease of an attempt; absent counts as success.
    DestroyLease,
}

impl EffectKind {
    /// Every kind, in ladder order.
    pub const ALL: [EffectKind; 6] = [
        EffectKind::CreateLease,
        EffectKind::LookupEndpoint,
        EffectKind::StartBootstrap,
        EffectKind::BootstrapConvergenceObserved,
        EffectKind::CancelBootstrap,
        EffectKind::DestroyLease,
    ];

    /// Whether an ambiguous outcome of this kind must be re-issued before any
    /// destructive step (the provider adopts what the first call may have made).
    pub fn adopts_after_ambiguity(self) -> bool {
        matches!(self, EffectKind::CreateLease | EffectKind::StartBootstrap)
    }

    /// Whether this kind is a cleanup step.
    pub fn is_cleanup(self) -> bool {
        matches!(self, EffectKind::CancelBootstrap | EffectKind::DestroyLease)
    }

    /// A stable, lower-case name for logs and traces.
    pub fn name(self) -> &'static str {
        match self {
            EffectKind::CreateLease => "create-lease",
            EffectKind::LookupEndpoint => "lookup-endpoint",
            EffectKind::StartBootstrap => "start-bootstrap",
            EffectKind::BootstrapConvergenceObserved => "convergence-observed",
            EffectKind::CancelBootstrap => "cancel-bootstrap",
            EffectKind::DestroyLease => "destroy-lease",
        }
    }
}

impl fmt::Display for EffectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A provider's name for a lease (an instance id, a process id, …).
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct LeaseHandle(pub String);

/// Where a node can be reached (for example `127.0.0.1:40321`).
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct Endpoint(pub String);

/// A provider's name for a bootstrap session.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct SessionHandle(pub String);

/// The input of one effect. Every effect is keyed by `(run, node, attempt)`;
/// handles are passed along where the driver knows them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EffectRequest {
    /// Create or adopt the lease of this attempt.
    CreateLease,
    /// Look up the endpoint of the lease.
    LookupEndpoint {
        /// The lease.
        lease: LeaseHandle,
    },
    /// Start or adopt the bootstrap session.
    StartBootstrap {
        /// The lease.
        lease: LeaseHandle,
        /// The endpoint to bootstrap through.
        endpoint: Endpoint,
    },
    /// Report that the agent joined the swarm.
    BootstrapConvergenceObserved {
        /// The session, when the provider named it.
        session: Option<SessionHandle>,
    },
    /// Cancel the bootstrap session.
    CancelBootstrap {
        /// The session, when the provider named it.
        session: Option<SessionHandle>,
    },
    /// Destroy the lease.
    DestroyLease {
        /// The lease.
        lease: LeaseHandle,
    },
}

impl EffectRequest {
    /// The kind of this request.
    pub fn kind(&self) -> EffectKind {
        match self {
            EffectRequest::CreateLease => EffectKind::CreateLease,
            EffectRequest::LookupEndpoint { .. } => EffectKind::LookupEndpoint,
            EffectRequest::StartBootstrap { .. } => EffectKind::StartBootstrap,
            EffectRequest::BootstrapConvergenceObserved { .. } => {
                EffectKind::BootstrapConvergenceObserved
            }
            EffectRequest::CancelBootstrap { .. } => EffectKind::CancelBootstrap,
            EffectRequest::DestroyLease { .. } => EffectKind::DestroyLease,
        }
    }
}

/// One dispatched effect, named by its [`OperationId`].
#[derive(Clone, Debug, PartialEq)]
pub struct Operation {
    /// The operation id; its attempt is the provider key's attempt.
    pub id: OperationId,
    /// The run.
    pub run_id: RunId,
    /// The slot.
    pub node: LogicalNodeId,
    /// The immutable template of the attempt (which provider, which image,
    /// how to boot). Shared, so cheap to carry on every operation.
    pub spec: LogicalNodeSpec,
    /// What to do.
    pub request: EffectRequest,
}

impl Operation {
    /// The kind of the request.
    pub fn kind(&self) -> EffectKind {
        self.request.kind()
    }

    /// The attempt the operation belongs to.
    pub fn attempt(&self) -> NodeAttemptId {
        self.id.attempt()
    }
}

/// The answer of an endpoint lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointLookup {
    /// The node is reachable here.
    Ready(Endpoint),
    /// The node is not reachable yet; probe again later. Not a failure.
    NotReady,
}

/// What a successful effect produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EffectOutput {
    /// The lease exists (created now, or adopted).
    LeaseCreated {
        /// The provider's name for it.
        lease: LeaseHandle,
        /// The endpoint, when the provider knows it at creation.
        endpoint: Option<Endpoint>,
        /// Whether an existing resource was adopted instead of created.
        adopted: bool,
    },
    /// The endpoint lookup answered.
    Endpoint(EndpointLookup),
    /// The bootstrap session runs (started now, or adopted).
    BootstrapStarted {
        /// The provider's name for the session.
        session: SessionHandle,
        /// Whether an existing session was adopted.
        adopted: bool,
    },
    /// The provider took note of convergence.
    ConvergenceAcknowledged,
    /// The bootstrap session is gone.
    BootstrapCancelled,
    /// The lease is gone.
    LeaseDestroyed,
}

impl EffectOutput {
    /// The kind of effect this output answers.
    pub fn kind(&self) -> EffectKind {
        match self {
            EffectOutput::LeaseCreated { .. } => EffectKind::CreateLease,
            EffectOutput::Endpoint(_) => EffectKind::LookupEndpoint,
            EffectOutput::BootstrapStarted { .. } => EffectKind::StartBootstrap,
            EffectOutput::ConvergenceAcknowledged => EffectKind::BootstrapConvergenceObserved,
            EffectOutput::BootstrapCancelled => EffectKind::CancelBootstrap,
            EffectOutput::LeaseDestroyed => EffectKind::DestroyLease,
        }
    }
}

/// Whether a failed effect may have taken place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Disposition {
    /// The effect certainly did not happen.
    Definite,
    /// The effect may have happened (timeouts, lost replies).
    Ambiguous,
}

/// A failed effect.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{disposition:?} failure: {message}")]
pub struct EffectError {
    /// Whether the effect may have happened.
    pub disposition: Disposition,
    /// What went wrong, for logs.
    pub message: String,
}

impl EffectError {
    /// The effect certainly did not happen.
    pub fn definite(message: impl Into<String>) -> Self {
        EffectError {
            disposition: Disposition::Definite,
            message: message.into(),
        }
    }

    /// The effect may have happened.
    pub fn ambiguous(message: impl Into<String>) -> Self {
        EffectError {
            disposition: Disposition::Ambiguous,
            message: message.into(),
        }
    }

    /// The operation passed its deadline: always ambiguous.
    pub fn timed_out() -> Self {
        EffectError::ambiguous("operation timed out")
    }

    /// Whether the effect may have happened.
    pub fn is_ambiguous(&self) -> bool {
        self.disposition == Disposition::Ambiguous
    }
}

/// The outcome of one operation, as the executor reports it to the driver.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecutorResult {
    /// The operation.
    pub op: OperationId,
    /// The slot.
    pub node: LogicalNodeId,
    /// The kind of effect.
    pub kind: EffectKind,
    /// What happened.
    pub outcome: Result<EffectOutput, EffectError>,
}
