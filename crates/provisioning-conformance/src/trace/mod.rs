//! The trace alphabet and its stable text form.
//!
//! A [`Trace`] is a small header (retry-policy jitter, optional limits) and a
//! list of [`Input`]s. Every input is a value, so a trace can be stored,
//! shrunk, printed and parsed back. The text form is one input per line (or
//! `;`-separated on one line, for command lines), `#` starts a comment:
//!
//! ```text
//! seed 0x2a
//! jitter 250
//! tick 1500ms
//! desire scale a 3
//! script create-lease ambiguous-done
//! run fifo
//! stream @0 joined
//! lose @1 agent
//! crash
//! ```
//!
//! Targets written `@k` are resolved when the input is applied: `stream @k`
//! picks the `k`-th live bootstrap session of the substrate (modulo how many
//! there are), `lose @k` the `k`-th ready node, `redeliver k` the `k`-th most
//! recent delivery. This keeps inputs meaningful when the shrinker removes
//! the inputs before them.
//!
//! The parts: `alphabet` (the inputs and their kinds), `header` (a whole
//! trace and its settings), `print` and `parse` (the text form both ways).

mod alphabet;
mod header;
mod parse;
mod print;
#[cfg(test)]
mod tests;

pub use alphabet::{
    DriftField, Fault, FaultTarget, Group, Input, InputKind, LimitChange, MAX_GROUP_COUNT,
    MAX_TARGET_SIMPLIFICATIONS, MAX_TICK_MS, MAX_TRACE_INPUTS, PROGRESS_STAGES, RevisionProbe,
    ShapeChange, StreamEvent, WorkStep,
};
pub use header::{Trace, TraceHeader};
pub use parse::{ParseError, ParseErrorReason};
