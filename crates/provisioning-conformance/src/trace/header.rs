//! A whole [`Trace`]: its [`TraceHeader`] (settings besides the inputs)
//! and the inputs, in order.

use super::alphabet::Input;

/// Settings a trace carries besides its inputs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceHeader {
    /// The seed the trace was generated from, if any (informational).
    pub seed: Option<u64>,
    /// The retry policy's jitter, in thousandths.
    pub jitter_per_mille: u16,
    /// An attempt-id limit, so that exhaustion is reached (G13).
    pub attempt_limit: Option<u64>,
    /// The clock at the start of the trace, in milliseconds; a value near
    /// `u64::MAX` makes deadlines saturate (G13).
    pub clock_start_ms: u64,
    /// Untidy interleavings: the host runs the driver's passes after every
    /// single delivery of a result or an observation instead of folding
    /// everything available first, so a pass can fall between any two
    /// deliveries. Text form: a header line `interleave`.
    pub interleave: bool,
    /// Sessions close later than the convergence call: a provider that
    /// acknowledges `BootstrapConvergenceObserved` keeps the session open,
    /// and closes it (reporting `Closed`) only at a later `stream … closed`
    /// input, a repeated convergence call, or the fair tail's progress. So
    /// passes run between the acknowledgement and the close. Text form: a
    /// header line `late-close`.
    pub late_close: bool,
}

impl TraceHeader {
    /// Whether the header asks for an exhaustion or saturation edge, under
    /// which convergence cannot be required.
    pub fn has_edges(&self) -> bool {
        self.attempt_limit.is_some() || self.clock_start_ms > u64::MAX / 2
    }
}

/// A header and a list of inputs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// Settings.
    pub header: TraceHeader,
    /// The inputs, applied in order.
    pub inputs: Vec<Input>,
}

impl Trace {
    /// A trace with a default header.
    pub fn new(inputs: Vec<Input>) -> Self {
        Trace {
            header: TraceHeader::default(),
            inputs,
        }
    }

    /// The text form on a single line, inputs separated by `; `; suitable
    /// for an environment variable on a command line.
    pub fn to_single_line(&self) -> String {
        self.to_string()
            .lines()
            .filter(|line| !line.starts_with('#'))
            .collect::<Vec<_>>()
            .join("; ")
    }
}
