//! The seam the driver hands recorded operations to: an [`OperationSink`],
//! and why a sink may refuse one ([`SubmitError`]).

use thiserror::Error;

use crate::effect::Operation;
use crate::id::{NodeAttemptId, OperationId};

/// Where the driver hands recorded operations.
///
/// # Assumptions
/// `submit` must not run the effect inline and feed its result back into the
/// driver; results come back later through
/// [`ClusterDriver::apply_executor_result`](super::ClusterDriver::apply_executor_result).
pub trait OperationSink {
    /// Submits an operation the driver recorded as pending.
    ///
    /// # Errors
    /// A [`SubmitError`] when the operation was not accepted; the driver folds
    /// it as a definite failure of the operation.
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError>;

    /// The attempt finished cleanup; its bookkeeping may be released.
    fn attempt_retired(&mut self, attempt: NodeAttemptId) {
        let _ = attempt;
    }
}

/// Why a sink refused an operation.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SubmitError {
    /// The id was used before with a different input.
    #[error("operation {0} was already submitted with a different input")]
    ConflictingInput(OperationId),
    /// A later operation of the same attempt was already submitted.
    #[error("operation {0} is older than an operation already submitted for its attempt")]
    Stale(OperationId),
    /// The sink no longer accepts work.
    #[error("the executor is shut down")]
    Closed,
    /// A sink of the caller's refused the operation for its own reason (a
    /// quota, a full queue, a journal that could not be written). The reason
    /// reaches the node's `last_error`.
    #[error("{0}")]
    Refused(String),
}
