//! The reconciler core of `provisioning`.
//!
//! A caller declares a [`ClusterShape`]; the [`ClusterDriver`] compares it
//! with the observed [`ClusterState`] and, node by node, takes the next safe
//! step: acquire a lease, learn the endpoint, bootstrap an agent, see it join
//! the swarm, and later replace, scale down or clean up.
//!
//! Where to start reading:
//! - [`decide::reconcile_node`] — the per-node decision ladder, a pure function
//!   of `(observed, desired, now)`;
//! - [`ClusterDriver`] — the sole writer of observed state: folds observations,
//!   runs passes, records operations pending before dispatch;
//! - [`IdempotentEffectExecutor`] — runs provider effects through an
//!   [`EffectBackend`], deduplicated by [`OperationId`].
//!
//! This crate does no I/O, reads no clock and no randomness, and owns no
//! async runtime: time is a [`Timestamp`] passed in, effects are values
//! handed to a backend, and work is spawned through a [`Spawner`] the caller
//! provides.

pub mod decide;
pub mod driver;
pub mod effect;
pub mod executor;
pub mod id;
pub mod observe;
pub mod policy;
pub mod shape;
pub mod spawn;
pub mod state;
pub mod time;

pub use decide::{NodeAction, NodeDecision, Plan, Rule, reconcile, reconcile_node};
pub use driver::{
    ClusterDriver, DesiredUpdate, DriverError, DueOperation, OperationSink, Rejection, SubmitError,
};
pub use effect::{
    Disposition, EffectError, EffectKind, EffectOutput, EffectRequest, Endpoint, EndpointLookup,
    ExecutorResult, LeaseHandle, Operation, SessionHandle,
};
pub use executor::{EffectBackend, IdempotentEffectExecutor, Submitted};
pub use id::{Generation, GroupId, LogicalNodeId, NodeAttemptId, OperationId, RunId};
pub use observe::{BootstrapEvent, LossCause, Observation};
pub use policy::RetryPolicy;
pub use shape::{
    BootParams, ClusterShape, DesiredState, LogicalNodeSpec, NodeGroup, NodeTemplate,
    ProviderShape, ShapeError, SwarmJoinTemplate,
};
pub use spawn::{BoxFuture, ManualSpawner, RunOrder, Spawner};
pub use state::{ClusterState, Intent, ManagedNode, NodeRecord, NodeStage};
pub use time::Timestamp;
