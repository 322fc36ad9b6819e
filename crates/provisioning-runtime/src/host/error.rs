//! [`HostError`]: why the host refused a command or could not start.

use provisioning::{DriverError, Generation, ShapeError};
use provisioning_provider::AdapterError;
use thiserror::Error;

use crate::durable::DurabilityError;

/// Errors of the host.
#[derive(Debug, Error)]
pub enum HostError {
    /// A group names a provider kind no registered plugin serves.
    #[error(
        "group {group:?} names provider {provider:?}, which no plugin serves (available: {available})"
    )]
    UnknownProvider {
        /// The group.
        group: String,
        /// The provider kind it names.
        provider: String,
        /// The kinds that are served, comma-separated.
        available: String,
    },
    /// The driver refused the shape; nothing changed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The shape failed validation; nothing changed.
    #[error("invalid shape: {0}")]
    Shape(#[from] ShapeError),
    /// Two plugins serve one provider kind.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// The host is tearing the cluster down and accepts no new shape.
    #[error("the host is shutting down")]
    ShuttingDown,
    /// The host loop has ended.
    #[error("the host has stopped")]
    Stopped,
    /// [`Host::start`](super::Host::start) was called outside a tokio runtime.
    #[error("the host must be started from within a tokio runtime")]
    NoRuntime,
    /// The generation counter is exhausted.
    #[error("no generation is left after {0}")]
    GenerationExhausted(Generation),
    /// No desired group has that name.
    #[error("no group {0:?} is desired")]
    UnknownGroup(String),
    /// Durable state could not be resumed; nothing was started.
    #[error(transparent)]
    Durability(#[from] DurabilityError),
}
