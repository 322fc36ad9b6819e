//! The driver's errors: why a fact was not folded ([`Rejection`]), why one
//! node could not take its step in a pass ([`NodeError`]), and what any call
//! of the driver may return ([`DriverError`]).

use thiserror::Error;

use crate::effect::EffectKind;
use crate::id::{Generation, IdError, LogicalNodeId, NodeAttemptId, OperationId, RunId};
use crate::observe::BootstrapRejection;
use crate::shape::ShapeError;
use crate::time::{ClockSaturated, Timestamp};

/// Why an observation or result was not folded. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum Rejection {
    /// No node is managed for the slot.
    #[error("no node {0} is managed")]
    UnknownNode(LogicalNodeId),
    /// The fact belongs to another attempt than the node's current one.
    #[error("node {node}: fact of attempt {got} but the current attempt is {current}")]
    StaleAttempt {
        /// The slot.
        node: LogicalNodeId,
        /// The node's current attempt.
        current: NodeAttemptId,
        /// The attempt named by the fact.
        got: NodeAttemptId,
    },
    /// The operation is not the node's pending operation (late or duplicate).
    #[error("node {node}: operation {op} is not pending")]
    NotPending {
        /// The slot.
        node: LogicalNodeId,
        /// The operation.
        op: OperationId,
    },
    /// A timeout was reported before the stored deadline.
    #[error("operation {op} is not due before {deadline}")]
    NotYetDue {
        /// The operation.
        op: OperationId,
        /// Its stored deadline.
        deadline: Timestamp,
    },
    /// The node is destroyed; nothing is folded into it.
    #[error("node {0} is destroyed")]
    Destroyed(LogicalNodeId),
    /// A bootstrap event without a session to fold it into.
    #[error("node {node}: {reason}")]
    Bootstrap {
        /// The slot.
        node: LogicalNodeId,
        /// Why.
        reason: BootstrapRejection,
    },
}

/// A problem with one node during a pass. The node was left unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum NodeError {
    /// Attempt or sequence counters are exhausted.
    #[error(transparent)]
    Id(#[from] IdError),
    /// A deadline did not fit the clock.
    #[error(transparent)]
    Clock(#[from] ClockSaturated),
    /// The decider asked for an effect whose input is not known. This is a
    /// bug in the decider and is reported instead of dispatching.
    #[error("cannot build {kind}: {missing} is not known")]
    MissingFact {
        /// The effect.
        kind: EffectKind,
        /// The missing fact.
        missing: &'static str,
    },
}

/// Errors of the driver. Whenever one is returned, nothing changed, except
/// for [`DriverError::NodeErrors`] (see there).
#[derive(Clone, Debug, PartialEq, Error)]
pub enum DriverError {
    /// A desired shape named another run than the driver's.
    #[error("the run cannot change: driver manages {expected}, shape names {got}")]
    RunChanged {
        /// The driver's run.
        expected: RunId,
        /// The run of the rejected shape.
        got: RunId,
    },
    /// A desired shape had a lower generation than the current one.
    #[error("generation {got} is lower than the current generation {current}")]
    GenerationRegressed {
        /// The current generation.
        current: Generation,
        /// The rejected generation.
        got: Generation,
    },
    /// The content changed but the generation did not.
    #[error("the shape changed without a generation bump (generation {generation})")]
    ContentChangedWithoutGenerationBump {
        /// The generation both shapes carry.
        generation: Generation,
    },
    /// The shape failed validation.
    #[error("invalid shape: {0}")]
    InvalidShape(#[from] ShapeError),
    /// A pass is open; passes do not nest and facts are not folded meanwhile.
    #[error("a reconcile pass is already in progress")]
    PassInProgress,
    /// `finish_pass` without `begin_pass`.
    #[error("no reconcile pass is open")]
    NoPassOpen,
    /// The observation or result was rejected.
    #[error("rejected: {0}")]
    Rejected(#[from] Rejection),
    /// A deadline computed while folding did not fit the clock.
    #[error(transparent)]
    Clock(#[from] ClockSaturated),
    /// Some nodes could not take their step; every other node's step was applied.
    #[error("{} node(s) could not take their step; first: {}: {}", .0.len(), .0[0].0, .0[0].1)]
    NodeErrors(Vec<(LogicalNodeId, NodeError)>),
}
