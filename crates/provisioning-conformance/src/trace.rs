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

use std::fmt;
use std::str::FromStr;

use provisioning::EffectKind;
use provisioning::observe::LossCause;
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use thiserror::Error;

/// The longest trace the parser accepts, in inputs.
pub const MAX_TRACE_INPUTS: usize = 4096;

/// The largest group size a desired-shape input may ask for.
pub const MAX_GROUP_COUNT: u32 = 3;

/// The longest single clock tick, in milliseconds (one day).
pub const MAX_TICK_MS: u64 = 86_400_000;

/// One of the node groups a trace can shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Group {
    /// Group `a` (present in the initial shape).
    A,
    /// Group `b`.
    B,
    /// Group `c`.
    C,
}

impl Group {
    /// Every group, in order.
    pub const ALL: [Group; 3] = [Group::A, Group::B, Group::C];

    /// The group's name in shapes and traces.
    pub fn name(self) -> &'static str {
        match self {
            Group::A => "a",
            Group::B => "b",
            Group::C => "c",
        }
    }

    fn parse(text: &str) -> Option<Group> {
        Group::ALL.into_iter().find(|g| g.name() == text)
    }
}

/// Which part of a group's template a drift changes. Every drift means the
/// group's nodes are replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DriftField {
    /// The provider image.
    Image,
    /// The boot parameters (start command).
    Boot,
    /// The role.
    Role,
    /// The swarm-join template.
    Swarm,
}

impl DriftField {
    /// Every field, in order.
    pub const ALL: [DriftField; 4] = [
        DriftField::Image,
        DriftField::Boot,
        DriftField::Role,
        DriftField::Swarm,
    ];

    /// The field's name in traces.
    pub fn name(self) -> &'static str {
        match self {
            DriftField::Image => "image",
            DriftField::Boot => "boot",
            DriftField::Role => "role",
            DriftField::Swarm => "swarm",
        }
    }
}

/// A change to the desired shape. Each accepted change carries a strictly
/// higher generation; changes that would leave the shape as it is are skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ShapeChange {
    /// Set a present group's node count (scale up or down).
    Scale {
        /// The group.
        group: Group,
        /// The new count.
        count: u32,
    },
    /// Change one field of a present group's template.
    Drift {
        /// The group.
        group: Group,
        /// The field.
        field: DriftField,
    },
    /// Add an absent group.
    Add {
        /// The group.
        group: Group,
        /// Its node count.
        count: u32,
    },
    /// Remove a present group.
    Remove {
        /// The group.
        group: Group,
    },
}

impl ShapeChange {
    /// The group the change is about.
    pub fn group(self) -> Group {
        match self {
            ShapeChange::Scale { group, .. }
            | ShapeChange::Drift { group, .. }
            | ShapeChange::Add { group, .. }
            | ShapeChange::Remove { group } => group,
        }
    }
}

/// A probe of the revision contract (SPEC §2); none of them may change anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RevisionProbe {
    /// Submit a lower generation: must be rejected.
    Regress,
    /// Submit the current shape again: must be accepted as a no-op.
    Same,
    /// Submit changed content under the current generation: must be rejected.
    Silent,
}

impl RevisionProbe {
    /// Every probe, in order.
    pub const ALL: [RevisionProbe; 3] = [
        RevisionProbe::Regress,
        RevisionProbe::Same,
        RevisionProbe::Silent,
    ];

    /// The probe's name in traces.
    pub fn name(self) -> &'static str {
        match self {
            RevisionProbe::Regress => "regress",
            RevisionProbe::Same => "same",
            RevisionProbe::Silent => "silent",
        }
    }
}

/// Which backend call a scripted fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultTarget {
    /// The next call of any kind the fault applies to.
    Any,
    /// The next call of this kind.
    Kind(EffectKind),
}

impl FaultTarget {
    /// The kind of call targeted, `None` for any.
    pub fn kind(self) -> Option<EffectKind> {
        match self {
            FaultTarget::Any => None,
            FaultTarget::Kind(kind) => Some(kind),
        }
    }
}

/// A scripted reply for one backend call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// Succeed normally.
    Succeed,
    /// Answer an endpoint lookup with "not ready yet" (applies to lookups only).
    NotReady,
    /// Fail definitely: nothing was done for the key.
    Definite,
    /// Do the work, then report an ambiguous failure (a lost reply).
    AmbiguousDone,
    /// Report an ambiguous failure without doing the work.
    AmbiguousUndone,
    /// Panic inside the backend before doing anything.
    Panic,
    /// Hang past the deadline; the work happens when the hang is released.
    Hang,
}

impl Fault {
    /// Every fault, in order.
    pub const ALL: [Fault; 7] = [
        Fault::Succeed,
        Fault::NotReady,
        Fault::Definite,
        Fault::AmbiguousDone,
        Fault::AmbiguousUndone,
        Fault::Panic,
        Fault::Hang,
    ];

    /// The fault's name in traces.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Succeed => "succeed",
            Fault::NotReady => "not-ready",
            Fault::Definite => "definite",
            Fault::AmbiguousDone => "ambiguous-done",
            Fault::AmbiguousUndone => "ambiguous-undone",
            Fault::Panic => "panic",
            Fault::Hang => "hang",
        }
    }

    /// Whether the fault can apply to a call of `kind`.
    pub fn applies_to(self, kind: EffectKind) -> bool {
        self != Fault::NotReady || kind == EffectKind::LookupEndpoint
    }
}

/// How much queued work to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkStep {
    /// Everything runnable, oldest first.
    Fifo,
    /// Everything runnable, newest first.
    Lifo,
    /// One poll of the `n`-th runnable task (modulo how many there are).
    One(u32),
}

/// An event of a bootstrap stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StreamEvent {
    /// A progress stage.
    Progress(BootstrapProgress),
    /// The agent joined the swarm.
    Joined,
    /// The stream reported convergence.
    Converged,
    /// The session closed.
    Closed,
    /// The session failed at a stage.
    Failed(BootstrapFailure),
}

/// Every progress stage, in stream order.
pub const PROGRESS_STAGES: [BootstrapProgress; 7] = [
    BootstrapProgress::Created,
    BootstrapProgress::Connecting,
    BootstrapProgress::Connected,
    BootstrapProgress::Streaming,
    BootstrapProgress::BootChecking,
    BootstrapProgress::AgentStarting,
    BootstrapProgress::WaitingForJoin,
];

fn progress_name(stage: BootstrapProgress) -> &'static str {
    match stage {
        BootstrapProgress::Created => "created",
        BootstrapProgress::Connecting => "connecting",
        BootstrapProgress::Connected => "connected",
        BootstrapProgress::Streaming => "streaming",
        BootstrapProgress::BootChecking => "boot-checking",
        BootstrapProgress::AgentStarting => "agent-starting",
        BootstrapProgress::WaitingForJoin => "waiting-for-join",
    }
}

fn failure_name(failure: BootstrapFailure) -> &'static str {
    match failure {
        BootstrapFailure::ConnectFailed => "connect-failed",
        BootstrapFailure::BootCheckFailed => "boot-check-failed",
        BootstrapFailure::StartFailed => "start-failed",
        BootstrapFailure::JoinFailed => "join-failed",
        BootstrapFailure::StreamError => "stream-error",
    }
}

fn loss_name(cause: LossCause) -> &'static str {
    match cause {
        LossCause::AgentGone => "agent",
        LossCause::LeaseGone => "lease",
        LossCause::WorkloadExited => "workload",
    }
}

/// One input of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Input {
    /// Advance the clock. The host wakes at every stored deadline on the way.
    Tick {
        /// How far, in milliseconds.
        millis: u64,
    },
    /// Change the desired shape.
    Desire(ShapeChange),
    /// Probe the revision contract.
    Revision(RevisionProbe),
    /// Script the reply of a future backend call.
    Script {
        /// Which call.
        target: FaultTarget,
        /// The reply.
        fault: Fault,
    },
    /// Run queued work.
    Run(WorkStep),
    /// A bootstrap stream event of the `session`-th live session.
    Stream {
        /// Which live session (modulo the number of live sessions).
        session: u32,
        /// The event.
        event: StreamEvent,
    },
    /// Deliver again the `back`-th most recent result or observation
    /// (a duplicate, or a late delivery of a superseded attempt's fact).
    Redeliver {
        /// How far back (modulo the history length).
        back: u32,
    },
    /// Release the oldest hung backend call; its work happens now.
    Release,
    /// The host submits the `back`-th most recent operation it handed to
    /// the executor once more, as a host that retries a submission would.
    /// The executor must deduplicate it (running, replayed, or refused as
    /// stale) — never run it a second time at the backend.
    Resubmit {
        /// How far back (modulo how many operations are remembered).
        back: u32,
    },
    /// The next backend call matching `target` does its work and answers
    /// with another method's output; the driver must take that as an
    /// ambiguous failure (the provider may have acted).
    Confuse {
        /// Which call.
        target: FaultTarget,
    },
    /// The host refuses the next operation matching `target` that a drive
    /// hands its sink (its outbox is full): the driver must fold the refusal
    /// at once as a definite failure of that operation, and count it.
    Refuse {
        /// Which operation.
        target: FaultTarget,
    },
    /// The operator closes `group`'s breaker at once (`provision resume
    /// GROUP`): the driver must say whether it was open, and the group's
    /// held slots must get their attempts in the next pass.
    Resume {
        /// Which group.
        group: Group,
    },
    /// The `ready`-th ready node loses its agent or its lease.
    Lose {
        /// Which ready node (modulo the number of ready nodes).
        ready: u32,
        /// What is lost.
        cause: LossCause,
    },
    /// The controller crashes: at its next wake that hands out operations,
    /// right after the first of its two steps (commit the drive's changes,
    /// submit its operations), the backend runs whatever work had reached
    /// it and the controller dies — the driver, the executor with its
    /// queued work and undelivered results, and every undelivered
    /// observation are lost, while calls already running in the backend
    /// may still finish there (their results are lost too). A new driver is
    /// then recovered from the journal with a new executor over the same
    /// substrate, and the trace goes on. When no such wake comes before the
    /// inputs end, the crash happens then, between wakes. A no-op on a
    /// substrate that cannot survive a controller crash.
    Crash,
    /// Change the operator limits the driver applies (SPEC §15).
    Limit(LimitChange),
}

/// A change of the operator limits (SPEC §15, G29, G30). Zero removes the
/// limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LimitChange {
    /// The launch cap of the substrate's provider: creates in flight at once.
    Cap {
        /// The cap; zero: no cap.
        count: u32,
    },
    /// A group's rollout budget (`max_unavailable`, as a count).
    Budget {
        /// Which group.
        group: Group,
        /// The budget; zero: no budget.
        count: u32,
    },
    /// A group's circuit breaker.
    Breaker {
        /// Which group.
        group: Group,
        /// Consecutive failures that open it; zero: no breaker.
        failures: u32,
        /// Its cool-down, in milliseconds.
        cooldown_ms: u64,
    },
}

impl Input {
    /// The kind of the input, for swarm weights and vacuity reports.
    pub fn kind(&self) -> InputKind {
        match self {
            Input::Tick { .. } => InputKind::Tick,
            Input::Desire(_) => InputKind::Desire,
            Input::Revision(_) => InputKind::Revision,
            Input::Script { .. } => InputKind::Script,
            Input::Run(_) => InputKind::Run,
            Input::Stream { .. } => InputKind::Stream,
            Input::Redeliver { .. } => InputKind::Redeliver,
            Input::Release => InputKind::Release,
            Input::Resubmit { .. } => InputKind::Resubmit,
            Input::Confuse { .. } => InputKind::Confuse,
            Input::Refuse { .. } => InputKind::Refuse,
            Input::Resume { .. } => InputKind::Resume,
            Input::Lose { .. } => InputKind::Lose,
            Input::Crash => InputKind::Crash,
            Input::Limit(_) => InputKind::Limit,
        }
    }

    /// Simpler variants of this input, simplest first, for the shrinker.
    pub fn simplifications(&self) -> Vec<Input> {
        let mut out = Vec::new();
        match *self {
            Input::Tick { millis } => {
                for simpler in [1, 1_000, 30_000] {
                    if simpler < millis {
                        out.push(Input::Tick { millis: simpler });
                    }
                }
            }
            Input::Desire(ShapeChange::Scale { group, count }) => {
                for simpler in 0..count {
                    out.push(Input::Desire(ShapeChange::Scale {
                        group,
                        count: simpler,
                    }));
                }
            }
            Input::Desire(ShapeChange::Add { group, count }) => {
                for simpler in 0..count {
                    out.push(Input::Desire(ShapeChange::Add {
                        group,
                        count: simpler,
                    }));
                }
            }
            Input::Desire(ShapeChange::Drift { group, field }) if field != DriftField::Image => {
                out.push(Input::Desire(ShapeChange::Drift {
                    group,
                    field: DriftField::Image,
                }));
            }
            Input::Script { target, fault } => {
                let simpler: &[Fault] = match fault {
                    Fault::Hang => &[Fault::AmbiguousUndone, Fault::AmbiguousDone],
                    Fault::AmbiguousDone => &[Fault::AmbiguousUndone, Fault::Definite],
                    Fault::AmbiguousUndone | Fault::Panic => &[Fault::Definite],
                    _ => &[],
                };
                out.extend(simpler.iter().map(|&fault| Input::Script { target, fault }));
            }
            Input::Run(WorkStep::Lifo) => out.push(Input::Run(WorkStep::Fifo)),
            // Smaller targets, every one of them: when the shrinker deletes
            // earlier inputs, the target that still hits may be any lower one.
            Input::Run(WorkStep::One(n)) => {
                out.extend(smaller(n).map(|k| Input::Run(WorkStep::One(k))));
            }
            Input::Stream { session, event } => {
                out.extend(smaller(session).map(|session| Input::Stream { session, event }));
            }
            Input::Redeliver { back } => {
                out.extend(smaller(back).map(|back| Input::Redeliver { back }));
            }
            Input::Resubmit { back } => {
                out.extend(smaller(back).map(|back| Input::Resubmit { back }));
            }
            Input::Confuse {
                target: FaultTarget::Kind(_),
            } => out.push(Input::Confuse {
                target: FaultTarget::Any,
            }),
            Input::Refuse {
                target: FaultTarget::Kind(_),
            } => out.push(Input::Refuse {
                target: FaultTarget::Any,
            }),
            Input::Lose { ready, cause } => {
                out.extend(smaller(ready).map(|ready| Input::Lose { ready, cause }));
            }
            Input::Limit(LimitChange::Breaker {
                group,
                failures,
                cooldown_ms,
            }) => {
                for simpler in [1, 1_000] {
                    if simpler < cooldown_ms {
                        out.push(Input::Limit(LimitChange::Breaker {
                            group,
                            failures,
                            cooldown_ms: simpler,
                        }));
                    }
                }
            }
            _ => {}
        }
        out
    }
}

/// The values below `n`, at most [`MAX_TARGET_SIMPLIFICATIONS`] of them,
/// smallest first.
fn smaller(n: u32) -> impl Iterator<Item = u32> {
    (0..n).take(MAX_TARGET_SIMPLIFICATIONS)
}

/// The most smaller targets one input offers the shrinker.
pub const MAX_TARGET_SIMPLIFICATIONS: usize = 16;

/// The kinds of input, for swarm weights and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum InputKind {
    /// [`Input::Tick`].
    Tick,
    /// [`Input::Desire`].
    Desire,
    /// [`Input::Revision`].
    Revision,
    /// [`Input::Script`].
    Script,
    /// [`Input::Run`].
    Run,
    /// [`Input::Stream`].
    Stream,
    /// [`Input::Redeliver`].
    Redeliver,
    /// [`Input::Release`].
    Release,
    /// [`Input::Lose`].
    Lose,
    /// [`Input::Crash`].
    Crash,
    /// [`Input::Limit`].
    Limit,
    /// [`Input::Resubmit`].
    Resubmit,
    /// [`Input::Confuse`].
    Confuse,
    /// [`Input::Resume`].
    Resume,
    /// [`Input::Refuse`].
    Refuse,
}

impl InputKind {
    /// Every kind, in order.
    pub const ALL: [InputKind; 15] = [
        InputKind::Tick,
        InputKind::Desire,
        InputKind::Revision,
        InputKind::Script,
        InputKind::Run,
        InputKind::Stream,
        InputKind::Redeliver,
        InputKind::Release,
        InputKind::Lose,
        InputKind::Crash,
        InputKind::Limit,
        InputKind::Resubmit,
        InputKind::Confuse,
        InputKind::Resume,
        InputKind::Refuse,
    ];

    /// The keyword that starts an input of this kind in the text form.
    pub fn keyword(self) -> &'static str {
        match self {
            InputKind::Tick => "tick",
            InputKind::Desire => "desire",
            InputKind::Revision => "revision",
            InputKind::Script => "script",
            InputKind::Run => "run",
            InputKind::Stream => "stream",
            InputKind::Redeliver => "redeliver",
            InputKind::Release => "release",
            InputKind::Lose => "lose",
            InputKind::Crash => "crash",
            InputKind::Limit => "limit",
            InputKind::Resubmit => "resubmit",
            InputKind::Confuse => "confuse",
            InputKind::Resume => "resume",
            InputKind::Refuse => "refuse",
        }
    }
}

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

/// Why a trace text could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("trace line {line}: {reason} (in {text:?})")]
pub struct ParseError {
    /// The 1-based line (or `;`-separated item) number.
    pub line: usize,
    /// The offending text.
    pub text: String,
    /// What is wrong.
    pub reason: ParseErrorReason,
}

/// What is wrong with a trace line.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ParseErrorReason {
    /// The first word is not a known keyword.
    #[error("unknown keyword")]
    UnknownKeyword,
    /// A word is missing.
    #[error("missing {0}")]
    Missing(&'static str),
    /// A word is not what the keyword expects.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// More words than the keyword takes.
    #[error("unexpected trailing words")]
    Trailing,
    /// A header line after the first input, or a header given twice.
    #[error("header lines must come once, before the inputs")]
    MisplacedHeader,
    /// The trace has more than [`MAX_TRACE_INPUTS`] inputs.
    #[error("more than {MAX_TRACE_INPUTS} inputs")]
    TooLong,
}

struct Words<'a> {
    words: std::str::SplitWhitespace<'a>,
}

impl<'a> Words<'a> {
    fn next(&mut self, what: &'static str) -> Result<&'a str, ParseErrorReason> {
        self.words.next().ok_or(ParseErrorReason::Missing(what))
    }

    fn finish(mut self) -> Result<(), ParseErrorReason> {
        match self.words.next() {
            Some(_) => Err(ParseErrorReason::Trailing),
            None => Ok(()),
        }
    }
}

fn parse_u64(text: &str, what: &'static str) -> Result<u64, ParseErrorReason> {
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse::<u64>(),
    };
    parsed.map_err(|_| ParseErrorReason::Invalid(what))
}

fn parse_u32(text: &str, what: &'static str) -> Result<u32, ParseErrorReason> {
    text.parse::<u32>()
        .map_err(|_| ParseErrorReason::Invalid(what))
}

fn parse_target(text: &str) -> Result<u32, ParseErrorReason> {
    let index = text
        .strip_prefix('@')
        .ok_or(ParseErrorReason::Invalid("target (expected @index)"))?;
    parse_u32(index, "target index")
}

fn parse_group(text: &str) -> Result<Group, ParseErrorReason> {
    Group::parse(text).ok_or(ParseErrorReason::Invalid("group (expected a, b or c)"))
}

fn parse_count(text: &str) -> Result<u32, ParseErrorReason> {
    let count = parse_u32(text, "count")?;
    if count > MAX_GROUP_COUNT {
        return Err(ParseErrorReason::Invalid("count (at most 3)"));
    }
    Ok(count)
}

fn parse_tick(text: &str) -> Result<u64, ParseErrorReason> {
    let (number, scale) = if let Some(ms) = text.strip_suffix("ms") {
        (ms, 1)
    } else if let Some(s) = text.strip_suffix('s') {
        (s, 1_000)
    } else {
        (text, 1)
    };
    let millis = number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or(ParseErrorReason::Invalid("duration"))?;
    if millis > MAX_TICK_MS {
        return Err(ParseErrorReason::Invalid("duration (at most one day)"));
    }
    Ok(millis)
}

fn parse_fault(text: &str) -> Result<Fault, ParseErrorReason> {
    Fault::ALL
        .into_iter()
        .find(|f| f.name() == text)
        .ok_or(ParseErrorReason::Invalid("fault"))
}

fn parse_fault_target(text: &str) -> Result<FaultTarget, ParseErrorReason> {
    if text == "any" {
        return Ok(FaultTarget::Any);
    }
    EffectKind::ALL
        .into_iter()
        .find(|k| k.name() == text)
        .map(FaultTarget::Kind)
        .ok_or(ParseErrorReason::Invalid("fault target"))
}

fn parse_stream_event(words: &mut Words<'_>) -> Result<StreamEvent, ParseErrorReason> {
    Ok(match words.next("stream event")? {
        "joined" => StreamEvent::Joined,
        "converged" => StreamEvent::Converged,
        "closed" => StreamEvent::Closed,
        "progress" => {
            let name = words.next("progress stage")?;
            let stage = PROGRESS_STAGES
                .into_iter()
                .find(|s| progress_name(*s) == name)
                .ok_or(ParseErrorReason::Invalid("progress stage"))?;
            StreamEvent::Progress(stage)
        }
        "failed" => {
            let name = words.next("failure stage")?;
            let failure = BootstrapFailure::ALL
                .into_iter()
                .find(|f| failure_name(*f) == name)
                .ok_or(ParseErrorReason::Invalid("failure stage"))?;
            StreamEvent::Failed(failure)
        }
        _ => return Err(ParseErrorReason::Invalid("stream event")),
    })
}

fn parse_desire(words: &mut Words<'_>) -> Result<ShapeChange, ParseErrorReason> {
    Ok(match words.next("shape change")? {
        "scale" => ShapeChange::Scale {
            group: parse_group(words.next("group")?)?,
            count: parse_count(words.next("count")?)?,
        },
        "add" => ShapeChange::Add {
            group: parse_group(words.next("group")?)?,
            count: parse_count(words.next("count")?)?,
        },
        "remove" => ShapeChange::Remove {
            group: parse_group(words.next("group")?)?,
        },
        "drift" => {
            let group = parse_group(words.next("group")?)?;
            let name = words.next("drift field")?;
            let field = DriftField::ALL
                .into_iter()
                .find(|f| f.name() == name)
                .ok_or(ParseErrorReason::Invalid("drift field"))?;
            ShapeChange::Drift { group, field }
        }
        _ => return Err(ParseErrorReason::Invalid("shape change")),
    })
}

fn parse_input(keyword: &str, words: &mut Words<'_>) -> Result<Input, ParseErrorReason> {
    Ok(match keyword {
        "tick" => Input::Tick {
            millis: parse_tick(words.next("duration")?)?,
        },
        "desire" => Input::Desire(parse_desire(words)?),
        "revision" => {
            let name = words.next("revision probe")?;
            Input::Revision(
                RevisionProbe::ALL
                    .into_iter()
                    .find(|p| p.name() == name)
                    .ok_or(ParseErrorReason::Invalid("revision probe"))?,
            )
        }
        "script" => Input::Script {
            target: parse_fault_target(words.next("fault target")?)?,
            fault: parse_fault(words.next("fault")?)?,
        },
        "run" => Input::Run(match words.next("work order")? {
            "fifo" => WorkStep::Fifo,
            "lifo" => WorkStep::Lifo,
            "one" => WorkStep::One(parse_u32(words.next("task index")?, "task index")?),
            _ => return Err(ParseErrorReason::Invalid("work order")),
        }),
        "stream" => Input::Stream {
            session: parse_target(words.next("session target")?)?,
            event: parse_stream_event(words)?,
        },
        "redeliver" => Input::Redeliver {
            back: parse_u32(words.next("history index")?, "history index")?,
        },
        "release" => Input::Release,
        "resubmit" => Input::Resubmit {
            back: parse_u32(words.next("submission index")?, "submission index")?,
        },
        "confuse" => Input::Confuse {
            target: parse_fault_target(words.next("fault target")?)?,
        },
        "refuse" => Input::Refuse {
            target: parse_fault_target(words.next("fault target")?)?,
        },
        "crash" => Input::Crash,
        "resume" => Input::Resume {
            group: parse_group(words.next("group")?)?,
        },
        "limit" => Input::Limit(match words.next("limit")? {
            "cap" => LimitChange::Cap {
                count: parse_u32(words.next("cap")?, "cap")?,
            },
            "budget" => LimitChange::Budget {
                group: parse_group(words.next("group")?)?,
                count: parse_u32(words.next("budget")?, "budget")?,
            },
            "breaker" => LimitChange::Breaker {
                group: parse_group(words.next("group")?)?,
                failures: parse_u32(words.next("breaker failures")?, "breaker failures")?,
                cooldown_ms: parse_tick(words.next("breaker cool-down")?)?,
            },
            _ => return Err(ParseErrorReason::Invalid("limit")),
        }),
        "lose" => Input::Lose {
            ready: parse_target(words.next("ready-node target")?)?,
            cause: match words.next("loss cause")? {
                "agent" => LossCause::AgentGone,
                "lease" => LossCause::LeaseGone,
                "workload" => LossCause::WorkloadExited,
                _ => return Err(ParseErrorReason::Invalid("loss cause")),
            },
        },
        _ => return Err(ParseErrorReason::UnknownKeyword),
    })
}

/// Applies one header line; returns `Ok(false)` when `keyword` is not a header.
fn parse_header(
    header: &mut TraceHeader,
    seen: &mut Vec<&'static str>,
    keyword: &str,
    words: &mut Words<'_>,
) -> Result<bool, ParseErrorReason> {
    let key: &'static str = match keyword {
        "seed" => "seed",
        "jitter" => "jitter",
        "attempt-limit" => "attempt-limit",
        "clock-start" => "clock-start",
        "interleave" => "interleave",
        "late-close" => "late-close",
        _ => return Ok(false),
    };
    if seen.contains(&key) {
        return Err(ParseErrorReason::MisplacedHeader);
    }
    seen.push(key);
    match key {
        "seed" => header.seed = Some(parse_u64(words.next("seed")?, "seed")?),
        "jitter" => {
            let value = parse_u64(words.next("jitter")?, "jitter")?;
            header.jitter_per_mille = u16::try_from(value)
                .ok()
                .filter(|v| *v <= 1000)
                .ok_or(ParseErrorReason::Invalid("jitter (0-1000)"))?;
        }
        "attempt-limit" => {
            header.attempt_limit = Some(parse_u64(words.next("limit")?, "attempt limit")?);
        }
        "interleave" => header.interleave = true,
        "late-close" => header.late_close = true,
        _ => header.clock_start_ms = parse_u64(words.next("clock start")?, "clock start")?,
    }
    Ok(true)
}

impl FromStr for Trace {
    type Err = ParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let mut trace = Trace::default();
        let mut seen = Vec::new();
        let items = text.split(['\n', ';']).map(str::trim).enumerate();
        for (index, item) in items {
            if item.is_empty() || item.starts_with('#') {
                continue;
            }
            let fail = |reason| ParseError {
                line: index + 1,
                text: item.to_owned(),
                reason,
            };
            let mut words = Words {
                words: item.split_whitespace(),
            };
            let keyword = words.next("keyword").map_err(fail)?;
            let is_header =
                parse_header(&mut trace.header, &mut seen, keyword, &mut words).map_err(fail)?;
            if is_header {
                if !trace.inputs.is_empty() {
                    return Err(fail(ParseErrorReason::MisplacedHeader));
                }
            } else {
                if trace.inputs.len() >= MAX_TRACE_INPUTS {
                    return Err(fail(ParseErrorReason::TooLong));
                }
                trace
                    .inputs
                    .push(parse_input(keyword, &mut words).map_err(fail)?);
            }
            words.finish().map_err(fail)?;
        }
        Ok(trace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_input_shape() -> Vec<Input> {
        let mut inputs = vec![
            Input::Tick { millis: 1 },
            Input::Tick { millis: 61_000 },
            Input::Release,
            Input::Crash,
            Input::Limit(LimitChange::Cap { count: 2 }),
            Input::Limit(LimitChange::Budget {
                group: Group::B,
                count: 0,
            }),
            Input::Limit(LimitChange::Breaker {
                group: Group::C,
                failures: 3,
                cooldown_ms: 5_000,
            }),
            Input::Redeliver { back: 7 },
            Input::Resubmit { back: 2 },
            Input::Resume { group: Group::B },
            Input::Confuse {
                target: FaultTarget::Any,
            },
            Input::Confuse {
                target: FaultTarget::Kind(EffectKind::StartBootstrap),
            },
            Input::Refuse {
                target: FaultTarget::Any,
            },
            Input::Refuse {
                target: FaultTarget::Kind(EffectKind::CreateLease),
            },
            Input::Run(WorkStep::Fifo),
            Input::Run(WorkStep::Lifo),
            Input::Run(WorkStep::One(3)),
        ];
        for group in Group::ALL {
            inputs.push(Input::Desire(ShapeChange::Scale { group, count: 3 }));
            inputs.push(Input::Desire(ShapeChange::Add { group, count: 0 }));
            inputs.push(Input::Desire(ShapeChange::Remove { group }));
            for field in DriftField::ALL {
                inputs.push(Input::Desire(ShapeChange::Drift { group, field }));
            }
        }
        inputs.extend(RevisionProbe::ALL.map(Input::Revision));
        for fault in Fault::ALL {
            inputs.push(Input::Script {
                target: FaultTarget::Any,
                fault,
            });
            for kind in EffectKind::ALL {
                inputs.push(Input::Script {
                    target: FaultTarget::Kind(kind),
                    fault,
                });
            }
        }
        let mut events = vec![
            StreamEvent::Joined,
            StreamEvent::Converged,
            StreamEvent::Closed,
        ];
        events.extend(PROGRESS_STAGES.map(StreamEvent::Progress));
        events.extend(BootstrapFailure::ALL.map(StreamEvent::Failed));
        for event in events {
            inputs.push(Input::Stream { session: 2, event });
        }
        for cause in [LossCause::AgentGone, LossCause::LeaseGone] {
            inputs.push(Input::Lose { ready: 1, cause });
        }
        inputs
    }

    #[test]
    fn every_input_prints_and_parses_back_to_itself() {
        let trace = Trace {
            header: TraceHeader {
                seed: Some(0xDEAD_BEEF),
                jitter_per_mille: 250,
                attempt_limit: Some(9),
                clock_start_ms: u64::MAX - 5,
                interleave: true,
                late_close: true,
            },
            inputs: every_input_shape(),
        };
        let text = trace.to_string();
        assert_eq!(text.parse::<Trace>(), Ok(trace.clone()), "{text}");
        let line = trace.to_single_line();
        assert!(!line.contains('\n'));
        assert_eq!(line.parse::<Trace>(), Ok(trace));
    }

    #[test]
    fn the_text_form_is_stable() {
        let trace = Trace {
            header: TraceHeader {
                seed: Some(42),
                ..TraceHeader::default()
            },
            inputs: vec![
                Input::Tick { millis: 1_500 },
                Input::Desire(ShapeChange::Scale {
                    group: Group::A,
                    count: 3,
                }),
                Input::Script {
                    target: FaultTarget::Kind(EffectKind::CreateLease),
                    fault: Fault::AmbiguousDone,
                },
                Input::Stream {
                    session: 0,
                    event: StreamEvent::Failed(BootstrapFailure::BootCheckFailed),
                },
                Input::Lose {
                    ready: 1,
                    cause: LossCause::AgentGone,
                },
                Input::Crash,
            ],
        };
        assert_eq!(
            trace.to_single_line(),
            "seed 0x2a; tick 1500ms; desire scale a 3; script create-lease ambiguous-done; \
             stream @0 failed boot-check-failed; lose @1 agent; crash"
        );
    }

    fn check_rejected(text: &str, expected: ParseErrorReason) {
        let err = text.parse::<Trace>().unwrap_err();
        assert_eq!(err.reason, expected, "{text:?}: {err}");
    }

    #[test]
    fn malformed_text_is_a_parse_error_naming_the_problem() {
        check_rejected("jump 5", ParseErrorReason::UnknownKeyword);
        check_rejected("tick", ParseErrorReason::Missing("duration"));
        check_rejected("tick 5 6", ParseErrorReason::Trailing);
        check_rejected("tick fast", ParseErrorReason::Invalid("duration"));
        check_rejected(
            "tick 99999999999999999999s",
            ParseErrorReason::Invalid("duration"),
        );
        check_rejected(
            "tick 2000000000ms",
            ParseErrorReason::Invalid("duration (at most one day)"),
        );
        check_rejected(
            "desire scale z 1",
            ParseErrorReason::Invalid("group (expected a, b or c)"),
        );
        check_rejected(
            "desire scale a 9",
            ParseErrorReason::Invalid("count (at most 3)"),
        );
        check_rejected(
            "stream 3 joined",
            ParseErrorReason::Invalid("target (expected @index)"),
        );
        check_rejected(
            "stream @1 failed oops",
            ParseErrorReason::Invalid("failure stage"),
        );
        check_rejected("script any explode", ParseErrorReason::Invalid("fault"));
        check_rejected("tick 1ms; seed 5", ParseErrorReason::MisplacedHeader);
        check_rejected("seed 1; seed 2", ParseErrorReason::MisplacedHeader);
        check_rejected("jitter 1001", ParseErrorReason::Invalid("jitter (0-1000)"));
        let long = "release\n".repeat(MAX_TRACE_INPUTS + 1);
        check_rejected(&long, ParseErrorReason::TooLong);
    }

    #[test]
    fn arbitrary_text_parses_or_fails_with_an_error_never_a_panic() {
        let vocabulary = [
            "tick",
            "desire",
            "scale",
            "drift",
            "add",
            "remove",
            "a",
            "z",
            "revision",
            "regress",
            "script",
            "any",
            "create-lease",
            "hang",
            "not-ready",
            "run",
            "one",
            "fifo",
            "stream",
            "@",
            "@1",
            "@99999999999",
            "joined",
            "failed",
            "progress",
            "redeliver",
            "release",
            "lose",
            "crash",
            "lease",
            "seed",
            "jitter",
            "attempt-limit",
            "clock-start",
            "0x",
            "0xffff",
            "-1",
            "18446744073709551616",
            "5ms",
            "5s",
            "ms",
            ";",
            "\n",
            "#",
            "é",
            "\u{0}",
        ];
        let mut rng = crate::prng::SplitMix64::new(99);
        let mut parsed = 0;
        for _ in 0..5_000 {
            let words = rng.between(0, 8);
            let text: Vec<&str> = (0..words)
                .map(|_| vocabulary[rng.below(vocabulary.len() as u64) as usize])
                .collect();
            let text = text.join(" ").replace("\\n", "\n");
            if text.parse::<Trace>().is_ok() {
                parsed += 1;
            }
        }
        assert!(parsed > 0, "some random texts are valid traces");
    }

    #[test]
    fn comments_blank_lines_and_seconds_are_accepted() {
        let trace: Trace = "# a comment\n\n  tick 2s  \n; release".parse().unwrap();
        assert_eq!(
            trace.inputs,
            [Input::Tick { millis: 2_000 }, Input::Release]
        );
    }

    #[test]
    fn simplifications_are_strictly_simpler_variants_of_the_same_kind() {
        for input in every_input_shape() {
            for simpler in input.simplifications() {
                assert_eq!(simpler.kind(), input.kind(), "{input} -> {simpler}");
                assert_ne!(simpler, input);
            }
        }
    }
}
