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
//! # Example
//!
//! A driver and an executor over a backend, driven by hand on a
//! [`ManualSpawner`]. A host does the same on every wake, with a real clock
//! and a runtime-backed spawner.
//!
//! ```
//! use std::sync::Arc;
//! use provisioning::*;
//! use provisioning::effect::EffectRequest;
//!
//! /// A provider that succeeds at once.
//! struct Instant;
//! impl EffectBackend for Instant {
//!     fn execute<'a>(&'a self, op: &'a Operation)
//!         -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
//!         let out = match &op.request {
//!             EffectRequest::CreateLease => EffectOutput::LeaseCreated {
//!                 lease: LeaseHandle("l".into()),
//!                 endpoint: Some(Endpoint("127.0.0.1:1".into())),
//!                 adopted: false,
//!             },
//!             EffectRequest::StartBootstrap { .. } => EffectOutput::BootstrapStarted {
//!                 session: SessionHandle("s".into()),
//!                 adopted: false,
//!             },
//!             EffectRequest::BootstrapConvergenceObserved { .. } => {
//!                 EffectOutput::ConvergenceAcknowledged
//!             }
//!             other => unreachable!("{other:?}"),
//!         };
//!         Box::pin(async move { Ok(out) })
//!     }
//! }
//!
//! let run = RunId::new("demo");
//! let template = NodeTemplate {
//!     role: "worker".into(),
//!     provider: "instant".into(),
//!     shape: ProviderShape::default(),
//!     boot: BootParams::default(),
//!     swarm_join: SwarmJoinTemplate::default(),
//! };
//! let shape = ClusterShape {
//!     run_id: run.clone(),
//!     generation: Generation::new(1),
//!     groups: vec![NodeGroup { id: GroupId::new("web"), run_id: run.clone(), count: 2, template }],
//! };
//!
//! let spawner = ManualSpawner::new();
//! let mut executor = IdempotentEffectExecutor::new(Arc::new(Instant), Arc::new(spawner.clone()));
//! let mut driver = ClusterDriver::new(run, RetryPolicy::default())?;
//! driver.update_desired(shape)?;
//! let now = Timestamp::ZERO;
//! for _ in 0..10 {
//!     driver.drive_until_blocked(now, &mut executor)?;
//!     spawner.run_all(RunOrder::Fifo);
//!     for result in executor.take_results() {
//!         driver.apply_executor_result(&result, now)?;
//!         // A real provider streams these through its observation sink.
//!         let event = match result.kind {
//!             EffectKind::StartBootstrap => BootstrapEvent::Joined,
//!             EffectKind::BootstrapConvergenceObserved => BootstrapEvent::Closed,
//!             _ => continue,
//!         };
//!         let attempt = result.op.attempt();
//!         driver.apply_observation(&Observation::Bootstrap { node: result.node, attempt, event }, now)?;
//!     }
//! }
//! assert!(driver.is_converged());
//! # Ok::<(), DriverError>(())
//! ```
//!
//! This crate does no I/O, reads no clock and no randomness, and owns no
//! async runtime: time is a [`Timestamp`] passed in, effects are values
//! handed to a backend, and work is spawned through a [`Spawner`] the caller
//! provides.

mod deadlines;
pub mod decide;
pub mod driver;
pub mod durable;
pub mod effect;
pub mod executor;
pub mod history;
pub mod id;
pub mod limits;
pub mod membership;
pub mod observe;
pub mod policy;
pub mod shape;
pub mod spawn;
pub mod state;
mod steady;
pub mod time;

pub use decide::{NodeAction, NodeDecision, Plan, Rule, reconcile, reconcile_node};
pub use driver::{
    ClusterDriver, DesiredUpdate, DriveReport, DriverChangesView, DriverCounters, DriverError,
    DueOperation, NodeError, OperationSink, PassReport, Rejection, SubmitError,
};
pub use durable::{
    DURABLE_FORMAT, DriverChanges, DurableEntry, DurableEntryRef, DurableMeta, DurableNode,
    DurableNodeRef, DurableState, RecoveryError, RecoveryReport,
};
pub use effect::{
    Disposition, EffectError, EffectKind, EffectOutput, EffectRequest, Endpoint, EndpointLookup,
    ExecutorResult, LeaseHandle, Operation, SessionHandle,
};
pub use executor::{EffectBackend, ExecutorCounters, IdempotentEffectExecutor, Submitted};
pub use history::{NodeHistory, Transition};
pub use id::{
    AttemptAllocator, Generation, GroupId, IdError, LogicalNodeId, NodeAttemptId, OperationId,
    OperationSequence, RunId,
};
pub use limits::{BreakerPolicy, BreakerStatus, LimitCounters, Limits, MaxUnavailable};
pub use membership::{Member, Membership, member_of};
pub use observe::{BootstrapEvent, BootstrapRejection, LossCause, Observation};
pub use policy::RetryPolicy;
pub use shape::{
    BootParams, ClusterShape, DesiredState, LogicalNodeSpec, NodeGroup, NodeTemplate,
    ProviderShape, ShapeError, SwarmJoinTemplate,
};
pub use spawn::{BoxFuture, ManualSpawner, RunOrder, Spawner};
pub use state::{
    AmbiguousOperation, BootstrapFacts, BootstrapFailure, BootstrapProgress, BootstrapStage,
    ClusterState, EndpointFacts, FailureFacts, Intent, LeaseFacts, ManagedNode, NodeRecord,
    NodeStage, PendingOperation, RetryState, SessionState, SwarmJoinFacts,
};
pub use time::Timestamp;
