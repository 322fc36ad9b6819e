//! The text form, printed: one input per line, the header's settings
//! first; [`Trace::to_single_line`](super::Trace::to_single_line) joins
//! the lines for a command line.

use std::fmt;

use super::alphabet::{
    FaultTarget, Input, LimitChange, ShapeChange, StreamEvent, WorkStep, failure_name, loss_name,
    progress_name,
};
use super::header::Trace;

impl fmt::Display for FaultTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultTarget::Any => f.write_str("any"),
            FaultTarget::Kind(kind) => f.write_str(kind.name()),
        }
    }
}

impl fmt::Display for StreamEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StreamEvent::Progress(stage) => write!(f, "progress {}", progress_name(*stage)),
            StreamEvent::Joined => f.write_str("joined"),
            StreamEvent::Converged => f.write_str("converged"),
            StreamEvent::Closed => f.write_str("closed"),
            StreamEvent::Failed(failure) => write!(f, "failed {}", failure_name(*failure)),
        }
    }
}

impl fmt::Display for Input {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Input::Tick { millis } => write!(f, "tick {millis}ms"),
            Input::Desire(change) => match change {
                ShapeChange::Scale { group, count } => {
                    write!(f, "desire scale {} {count}", group.name())
                }
                ShapeChange::Drift { group, field } => {
                    write!(f, "desire drift {} {}", group.name(), field.name())
                }
                ShapeChange::Add { group, count } => {
                    write!(f, "desire add {} {count}", group.name())
                }
                ShapeChange::Remove { group } => write!(f, "desire remove {}", group.name()),
            },
            Input::Revision(probe) => write!(f, "revision {}", probe.name()),
            Input::Script { target, fault } => write!(f, "script {target} {}", fault.name()),
            Input::Run(WorkStep::Fifo) => f.write_str("run fifo"),
            Input::Run(WorkStep::Lifo) => f.write_str("run lifo"),
            Input::Run(WorkStep::One(n)) => write!(f, "run one {n}"),
            Input::Stream { session, event } => write!(f, "stream @{session} {event}"),
            Input::Redeliver { back } => write!(f, "redeliver {back}"),
            Input::Release => f.write_str("release"),
            Input::Resubmit { back } => write!(f, "resubmit {back}"),
            Input::Confuse { target } => write!(f, "confuse {target}"),
            Input::Refuse { target } => write!(f, "refuse {target}"),
            Input::Resume { group } => write!(f, "resume {}", group.name()),
            Input::Lose { ready, cause } => write!(f, "lose @{ready} {}", loss_name(*cause)),
            Input::Crash => f.write_str("crash"),
            Input::Rejoin => f.write_str("rejoin"),
            Input::Limit(LimitChange::Cap { count }) => write!(f, "limit cap {count}"),
            Input::Limit(LimitChange::Budget { group, count }) => {
                write!(f, "limit budget {} {count}", group.name())
            }
            Input::Limit(LimitChange::Breaker {
                group,
                failures,
                cooldown_ms,
            }) => write!(
                f,
                "limit breaker {} {failures} {cooldown_ms}ms",
                group.name()
            ),
        }
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "# provisioning-conformance trace v1")?;
        let header = &self.header;
        if let Some(seed) = header.seed {
            writeln!(f, "seed {seed:#x}")?;
        }
        if header.jitter_per_mille != 0 {
            writeln!(f, "jitter {}", header.jitter_per_mille)?;
        }
        if let Some(limit) = header.attempt_limit {
            writeln!(f, "attempt-limit {limit}")?;
        }
        if header.clock_start_ms != 0 {
            writeln!(f, "clock-start {}", header.clock_start_ms)?;
        }
        if header.interleave {
            writeln!(f, "interleave")?;
        }
        if header.late_close {
            writeln!(f, "late-close")?;
        }
        for input in &self.inputs {
            writeln!(f, "{input}")?;
        }
        Ok(())
    }
}
