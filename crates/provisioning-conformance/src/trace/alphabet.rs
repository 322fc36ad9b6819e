//! The input alphabet: what one [`Input`] of a trace may be (ticks, shape
//! mutations, scripted faults, work scheduling, stream events, duplicate
//! and late deliveries, node loss, crashes, limit changes), its
//! [`InputKind`], and the simpler variants the shrinker tries.

use provisioning::EffectKind;
use provisioning::observe::LossCause;
use provisioning::state::{BootstrapFailure, BootstrapProgress};

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

    pub(super) fn parse(text: &str) -> Option<Group> {
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

/// A probe of the revision contract (design §2); none of them may change anything.
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

pub(super) fn progress_name(stage: BootstrapProgress) -> &'static str {
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

pub(super) fn failure_name(failure: BootstrapFailure) -> &'static str {
    match failure {
        BootstrapFailure::ConnectFailed => "connect-failed",
        BootstrapFailure::BootCheckFailed => "boot-check-failed",
        BootstrapFailure::StartFailed => "start-failed",
        BootstrapFailure::JoinFailed => "join-failed",
        BootstrapFailure::StreamError => "stream-error",
    }
}

pub(super) fn loss_name(cause: LossCause) -> &'static str {
    match cause {
        LossCause::AgentGone => "agent",
        LossCause::LeaseGone => "lease",
        LossCause::WorkloadExited | LossCause::WorkloadEnded(_) => "workload",
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
    /// After a crash, the agent of every node the new controller waits on
    /// (recovered as ready: rejoining) re-joins it, if that agent is still
    /// live, and the substrate reports it
    /// ([`Observation::AgentRejoined`](provisioning::Observation::AgentRejoined)).
    /// A no-op when no node waits or the substrate cannot re-join agents.
    Rejoin,
    /// Change the operator limits the driver applies (design §15).
    Limit(LimitChange),
}

/// A change of the operator limits (design §15, G29, G30). Zero removes the
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
            Input::Rejoin => InputKind::Rejoin,
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
    /// [`Input::Rejoin`].
    Rejoin,
}

impl InputKind {
    /// Every kind, in order.
    pub const ALL: [InputKind; 16] = [
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
        InputKind::Rejoin,
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
            InputKind::Rejoin => "rejoin",
        }
    }
}
