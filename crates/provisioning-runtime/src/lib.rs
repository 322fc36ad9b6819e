//! The tokio host of `provisioning`.
//!
//! Start with [`Host::start`]: it takes a [`HostConfig`] and the plugins
//! ([`PluginEntry`]), builds the [`provisioning::ClusterDriver`], an
//! [`provisioning::IdempotentEffectExecutor`] over a
//! [`provisioning_provider::PluginBackendAdapter`] and a [`TokioSpawner`],
//! and spawns the host loop. Everything else goes through a [`HostHandle`]:
//! apply a shape, read a [`StatusSnapshot`], compute a [`PlanReport`],
//! follow progress, shut down.
//!
//! This crate reads no files and parses no configuration: shapes arrive as
//! [`provisioning::ClusterShape`] values (the `provision` CLI owns the file
//! format).

pub mod durable;
mod fold;
pub mod host;
mod metrics;
pub mod plan;
pub mod spawner;
pub mod status;

pub use durable::{
    DEFAULT_ORPHAN_GRACE, DEFAULT_ORPHAN_SCAN_INTERVAL, Durability, DurabilityError, ResumeSummary,
};
pub use host::{
    AppliedRevision, DEFAULT_HISTORY_DEPTH, Host, HostConfig, HostError, HostHandle, PluginEntry,
    ShutdownOutcome, ShutdownReport,
};
pub use plan::{ChangeKind, PlanReport, PlannedChange, PlannedStep, plan_against};
pub use spawner::TokioSpawner;
pub use status::{
    DurabilityStatus, GroupStatus, HostPhase, NodeIter, NodeList, NodeStatus, StatusSnapshot,
    TransitionStatus,
};
