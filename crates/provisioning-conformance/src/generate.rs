//! The seeded trace generator, with per-seed swarm weights.
//!
//! Each seed first draws its own [`SwarmWeights`]: how often each input kind,
//! fault, stream event and tick size appears. Some seeds omit whole kinds of
//! input (no faults at all, no stream failures, no redeliveries…), which
//! finds bugs that a uniform mix dilutes ("swarm testing", Groce et al. 2012).
//! Then it draws the inputs. Everything comes from one [`SplitMix64`]
//! stream, so a seed names a trace forever.

use provisioning::EffectKind;
use provisioning::observe::LossCause;
use provisioning::state::BootstrapFailure;

use crate::prng::SplitMix64;
use crate::trace::{
    DriftField, Fault, FaultTarget, Group, Input, InputKind, LimitChange, MAX_GROUP_COUNT,
    PROGRESS_STAGES, RevisionProbe, ShapeChange, StreamEvent, Trace, TraceHeader, WorkStep,
};

/// Tick sizes the generator draws from, in milliseconds: around the default
/// backoff steps, the probe interval, the operation timeout and the backoff cap.
pub const TICK_SIZES_MS: [u64; 13] = [
    1, 10, 250, 999, 1_000, 1_001, 2_000, 5_000, 29_999, 30_000, 30_001, 61_000, 120_000,
];

/// The default share of seeds (in a thousand) with untidy interleavings.
pub const INTERLEAVE_PER_MILLE: u32 = 250;

/// The default share of seeds (in a thousand) whose sessions close later
/// than the convergence call ([`TraceHeader::late_close`]).
pub const LATE_CLOSE_PER_MILLE: u32 = 250;

/// The default share of seeds (in a thousand) that draw the executor-level
/// inputs ([`Input::Resubmit`], [`Input::Confuse`]).
pub const EXECUTOR_INPUTS_PER_MILLE: u32 = 250;

/// How the generator shapes traces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeneratorConfig {
    /// The fewest inputs of a trace.
    pub min_inputs: usize,
    /// The most inputs of a trace.
    pub max_inputs: usize,
    /// How many seeds in a thousand get an exhaustion or saturation edge (G13).
    pub edges_per_mille: u32,
    /// How many seeds in a thousand also draw the executor-level inputs
    /// ([`Input::Resubmit`], [`Input::Confuse`]); [`EXECUTOR_INPUTS_PER_MILLE`]
    /// by default. The other seeds' traces do not depend on this setting.
    pub executor_inputs_per_mille: u32,
    /// How many seeds in a thousand run with untidy interleavings (a pass
    /// after every single delivery; [`TraceHeader::interleave`]).
    pub interleave_per_mille: u32,
    /// How many seeds in a thousand have their sessions closed later than
    /// the convergence call ([`TraceHeader::late_close`]).
    pub late_close_per_mille: u32,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        GeneratorConfig {
            min_inputs: 64,
            max_inputs: 96,
            edges_per_mille: 60,
            executor_inputs_per_mille: EXECUTOR_INPUTS_PER_MILLE,
            interleave_per_mille: INTERLEAVE_PER_MILLE,
            late_close_per_mille: LATE_CLOSE_PER_MILLE,
        }
    }
}

/// The per-seed mix of inputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwarmWeights {
    /// Weight per [`InputKind`], in [`InputKind::ALL`] order; zero omits the kind.
    pub kinds: [u32; 16],
    /// Weight per [`Fault`], in [`Fault::ALL`] order.
    pub faults: [u32; 7],
    /// Weight of "any call", then of each [`EffectKind`] in [`EffectKind::ALL`] order.
    pub fault_targets: [u32; 7],
    /// Weight of joined, closed, converged, progress and failed stream events.
    pub stream_events: [u32; 5],
    /// Weight per tick size, in [`TICK_SIZES_MS`] order.
    pub ticks: [u32; 13],
}

/// Input kinds whose weights are drawn after every other weight (they were
/// added to the alphabet later).
const LATE_KINDS: [InputKind; 6] = [
    InputKind::Crash,
    InputKind::Resubmit,
    InputKind::Confuse,
    InputKind::Resume,
    InputKind::Refuse,
    // Never drawn by weight: see `insert_rejoins`.
    InputKind::Rejoin,
];

/// Seeds in a thousand that draw the operator's `resume` input.
const OPERATOR_INPUTS_PER_MILLE: u32 = 250;

/// Seeds in a thousand that draw the host's `refuse` input.
const REFUSE_PER_MILLE: u32 = 250;

/// Seeds in a thousand whose operator limits change eight times as often.
const LIMIT_HEAVY_PER_MILLE: u32 = 200;

/// The executor-level input kinds, drawn for some seeds only.
const EXECUTOR_KINDS: [InputKind; 2] = [InputKind::Resubmit, InputKind::Confuse];

/// Input kinds a seed never omits: without them nothing would ever run.
const ESSENTIAL: [InputKind; 2] = [InputKind::Tick, InputKind::Run];

fn base_weight(kind: InputKind) -> u32 {
    match kind {
        InputKind::Tick => 12,
        InputKind::Desire => 4,
        InputKind::Revision => 1,
        InputKind::Script => 10,
        InputKind::Run => 14,
        InputKind::Stream => 10,
        InputKind::Redeliver => 3,
        InputKind::Release => 3,
        InputKind::Lose => 2,
        InputKind::Crash => 2,
        InputKind::Limit => 1,
        InputKind::Resubmit => 2,
        InputKind::Confuse => 2,
        InputKind::Resume => 2,
        InputKind::Refuse => 2,
        InputKind::Rejoin => 2,
    }
}

impl SwarmWeights {
    /// Draws a seed's weights. Each non-essential input kind is omitted with
    /// probability 1/4; faults, targets, events and tick sizes are each
    /// omitted with probability 1/5, keeping at least one of each family.
    /// The crash weight is drawn last, so the other weights of a seed are
    /// what they were before crashes joined the alphabet.
    /// The executor-level kinds get weights in `executor_per_mille` seeds
    /// of a thousand only.
    pub fn draw(rng: &mut SplitMix64, executor_per_mille: u32) -> Self {
        let draw_kind = |rng: &mut SplitMix64, kind: InputKind| {
            let omitted = !ESSENTIAL.contains(&kind) && rng.chance(250);
            if omitted {
                0
            } else {
                base_weight(kind) * rng.between(1, 3) as u32
            }
        };
        let mut kinds = [0; InputKind::ALL.len()];
        for (weight, kind) in kinds.iter_mut().zip(InputKind::ALL) {
            if !LATE_KINDS.contains(&kind) {
                *weight = draw_kind(rng, kind);
            }
        }
        let faults = draw_family(rng);
        let fault_targets = draw_family(rng);
        let stream_events = draw_family(rng);
        let ticks = draw_family(rng);
        kinds[InputKind::Crash as usize] = draw_kind(rng, InputKind::Crash);
        // The executor-level inputs, added later, come in
        // `executor_per_mille` seeds of a thousand (drawn from a fork): the
        // other seeds keep the traces they had.
        let mut executor_rng = rng.fork();
        if executor_rng.chance(executor_per_mille) {
            for kind in EXECUTOR_KINDS {
                kinds[kind as usize] = draw_kind(&mut executor_rng, kind);
            }
        }
        // `resume`, added after them, comes in a quarter of the seeds (drawn
        // from its own fork): the other seeds keep the traces they had.
        let mut operator_rng = rng.fork();
        if operator_rng.chance(OPERATOR_INPUTS_PER_MILLE) {
            kinds[InputKind::Resume as usize] = draw_kind(&mut operator_rng, InputKind::Resume);
        }
        // Limit-heavy seeds, added after `resume` (drawn from their own
        // fork, the other seeds keep their traces): operator limits change
        // often enough that breakers open, probe and hold slots back while
        // their probe is out.
        let mut limits_rng = rng.fork();
        if limits_rng.chance(LIMIT_HEAVY_PER_MILLE) {
            kinds[InputKind::Limit as usize] =
                base_weight(InputKind::Limit) * 8 * limits_rng.between(1, 3) as u32;
        }
        // `refuse`, added after them, comes in a quarter of the seeds (its
        // own fork again).
        let mut refuse_rng = rng.fork();
        if refuse_rng.chance(REFUSE_PER_MILLE) {
            kinds[InputKind::Refuse as usize] = draw_kind(&mut refuse_rng, InputKind::Refuse);
        }
        SwarmWeights {
            kinds,
            faults,
            fault_targets,
            stream_events,
            ticks,
        }
    }
}

fn draw_family<const N: usize>(rng: &mut SplitMix64) -> [u32; N] {
    let mut weights = [0u32; N];
    for weight in &mut weights {
        *weight = if rng.chance(200) {
            0
        } else {
            rng.between(1, 4) as u32
        };
    }
    if weights.iter().all(|w| *w == 0) && N > 0 {
        weights[rng.below(N as u64) as usize] = 1;
    }
    weights
}

/// Generates the trace of `seed`.
pub fn generate(seed: u64, config: &GeneratorConfig) -> Trace {
    let mut rng = SplitMix64::new(seed);
    let mut header_rng = rng.fork();
    let weights = SwarmWeights::draw(&mut rng.fork(), config.executor_inputs_per_mille);
    let mut input_rng = rng.fork();
    let header = draw_header(seed, config, &mut header_rng);
    let low = config.min_inputs.min(config.max_inputs) as u64;
    let high = config.max_inputs.max(config.min_inputs) as u64;
    let length = input_rng.between(low, high) as usize;
    let mut inputs: Vec<Input> = (0..length)
        .map(|_| draw_input(&weights, &mut input_rng))
        .collect();
    // A rollout budget only holds something back when it is in force before
    // a drift of a group with several ready nodes; a limit drawn at a random
    // point rarely is. A quarter of the seeds start with a budget of one
    // for a group instead (drawn from a fork, so the rest stays as it was).
    let mut budget_rng = rng.fork();
    if budget_rng.chance(250)
        && let Some(first) = inputs.first_mut()
    {
        // In place of the first input, so the length stays as configured.
        *first = Input::Limit(LimitChange::Budget {
            group: draw_group(&mut budget_rng),
            count: 1,
        });
    }
    insert_rejoins(&mut inputs, &mut rng.fork());
    Trace { header, inputs }
}

/// After each `crash`, three times in four, a `rejoin` a few inputs later:
/// the agents of the nodes recovered as ready re-join the new controller
/// during the trace (the other crashes leave them to the fair tail, or to
/// their rejoin window's end). In place of the input there (never another
/// crash), so the length stays as configured and every other input of a
/// seed stays what it was before `rejoin` joined the alphabet.
fn insert_rejoins(inputs: &mut [Input], rng: &mut SplitMix64) {
    for at in 0..inputs.len() {
        if inputs[at] == Input::Crash && rng.chance(750) {
            let target = at + 1 + rng.below(8) as usize;
            if let Some(input) = inputs.get_mut(target)
                && *input != Input::Crash
            {
                *input = Input::Rejoin;
            }
        }
    }
}

fn draw_header(seed: u64, config: &GeneratorConfig, rng: &mut SplitMix64) -> TraceHeader {
    let jitter_per_mille = if rng.chance(250) {
        rng.between(1, 1000) as u16
    } else {
        0
    };
    let mut header = TraceHeader {
        seed: Some(seed),
        jitter_per_mille,
        attempt_limit: None,
        clock_start_ms: 0,
        interleave: false,
        late_close: false,
    };
    if rng.chance(config.edges_per_mille) {
        if rng.chance(500) {
            header.attempt_limit = Some(rng.between(3, 12));
        } else {
            header.clock_start_ms = u64::MAX - rng.between(10_000, 600_000);
        }
    }
    // From a fork, so the draws above stay as they were.
    header.interleave = rng.fork().chance(config.interleave_per_mille);
    // From another fork, after the one above, so nothing above moves.
    header.late_close = rng.fork().chance(config.late_close_per_mille);
    header
}

fn pick<T: Copy>(rng: &mut SplitMix64, items: &[T], weights: &[u32]) -> Option<T> {
    rng.weighted(weights).and_then(|i| items.get(i).copied())
}

fn draw_group(rng: &mut SplitMix64) -> Group {
    Group::ALL[rng.below(Group::ALL.len() as u64) as usize]
}

fn draw_input(weights: &SwarmWeights, rng: &mut SplitMix64) -> Input {
    let kind = pick(rng, &InputKind::ALL, &weights.kinds).unwrap_or(InputKind::Run);
    match kind {
        InputKind::Tick => Input::Tick {
            millis: pick(rng, &TICK_SIZES_MS, &weights.ticks).unwrap_or(1_000),
        },
        InputKind::Desire => Input::Desire(draw_shape_change(rng)),
        InputKind::Revision => {
            Input::Revision(RevisionProbe::ALL[rng.below(RevisionProbe::ALL.len() as u64) as usize])
        }
        InputKind::Script => {
            let mut targets = vec![FaultTarget::Any];
            targets.extend(EffectKind::ALL.map(FaultTarget::Kind));
            let target = pick(rng, &targets, &weights.fault_targets).unwrap_or(FaultTarget::Any);
            let mut fault = pick(rng, &Fault::ALL, &weights.faults).unwrap_or(Fault::Definite);
            if let FaultTarget::Kind(kind) = target {
                if !fault.applies_to(kind) {
                    fault = Fault::Definite;
                }
            }
            Input::Script { target, fault }
        }
        InputKind::Run => Input::Run(match rng.below(10) {
            0..=4 => WorkStep::Fifo,
            5..=6 => WorkStep::Lifo,
            _ => WorkStep::One(rng.below(4) as u32),
        }),
        InputKind::Stream => Input::Stream {
            session: rng.below(4) as u32,
            event: draw_stream_event(weights, rng),
        },
        InputKind::Redeliver => Input::Redeliver {
            back: rng.below(16) as u32,
        },
        InputKind::Release => Input::Release,
        InputKind::Resubmit => Input::Resubmit {
            back: rng.below(8) as u32,
        },
        InputKind::Confuse => {
            let mut targets = vec![FaultTarget::Any];
            targets.extend(EffectKind::ALL.map(FaultTarget::Kind));
            Input::Confuse {
                target: pick(rng, &targets, &weights.fault_targets).unwrap_or(FaultTarget::Any),
            }
        }
        InputKind::Refuse => {
            let mut targets = vec![FaultTarget::Any];
            targets.extend(EffectKind::ALL.map(FaultTarget::Kind));
            Input::Refuse {
                target: pick(rng, &targets, &weights.fault_targets).unwrap_or(FaultTarget::Any),
            }
        }
        InputKind::Crash => Input::Crash,
        InputKind::Rejoin => Input::Rejoin,
        InputKind::Resume => Input::Resume {
            group: draw_group(rng),
        },
        InputKind::Limit => Input::Limit(match rng.below(3) {
            0 => LimitChange::Cap {
                count: rng.below(3) as u32,
            },
            1 => LimitChange::Budget {
                group: draw_group(rng),
                count: rng.below(3) as u32,
            },
            _ => LimitChange::Breaker {
                group: draw_group(rng),
                failures: rng.below(4) as u32,
                cooldown_ms: [1_000, 10_000, 60_000][rng.below(3) as usize],
            },
        }),
        InputKind::Lose => Input::Lose {
            ready: rng.below(4) as u32,
            cause: if rng.chance(500) {
                LossCause::AgentGone
            } else {
                LossCause::LeaseGone
            },
        },
    }
}

fn draw_shape_change(rng: &mut SplitMix64) -> ShapeChange {
    let group = draw_group(rng);
    match rng.below(8) {
        0..=3 => ShapeChange::Scale {
            group,
            count: rng.between(0, u64::from(MAX_GROUP_COUNT)) as u32,
        },
        4 | 5 => ShapeChange::Drift {
            group,
            field: DriftField::ALL[rng.below(DriftField::ALL.len() as u64) as usize],
        },
        6 => ShapeChange::Add {
            group,
            count: rng.between(1, u64::from(MAX_GROUP_COUNT)) as u32,
        },
        _ => ShapeChange::Remove { group },
    }
}

fn draw_stream_event(weights: &SwarmWeights, rng: &mut SplitMix64) -> StreamEvent {
    match rng.weighted(&weights.stream_events) {
        Some(1) => StreamEvent::Closed,
        Some(2) => StreamEvent::Converged,
        Some(3) => {
            StreamEvent::Progress(PROGRESS_STAGES[rng.below(PROGRESS_STAGES.len() as u64) as usize])
        }
        Some(4) => StreamEvent::Failed(
            BootstrapFailure::ALL[rng.below(BootstrapFailure::ALL.len() as u64) as usize],
        ),
        _ => StreamEvent::Joined,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn the_same_seed_gives_the_same_trace() {
        let config = GeneratorConfig::default();
        assert_eq!(generate(7, &config), generate(7, &config));
        assert_ne!(generate(7, &config), generate(8, &config));
    }

    #[test]
    fn traces_respect_the_configured_length() {
        let config = GeneratorConfig {
            min_inputs: 64,
            max_inputs: 70,
            edges_per_mille: 0,
            executor_inputs_per_mille: 0,
            interleave_per_mille: 0,
            late_close_per_mille: 0,
        };
        for seed in 0..50 {
            let trace = generate(seed, &config);
            assert!((64..=70).contains(&trace.inputs.len()));
            assert!(!trace.header.has_edges());
            assert_eq!(trace.header.seed, Some(seed));
        }
    }

    #[test]
    fn some_seeds_omit_whole_input_kinds_and_all_kinds_appear_somewhere() {
        let config = GeneratorConfig {
            executor_inputs_per_mille: 500,
            ..GeneratorConfig::default()
        };
        let mut seen_anywhere = BTreeSet::new();
        let mut seeds_omitting_something = 0;
        for seed in 0..64 {
            let trace = generate(seed, &config);
            let kinds: BTreeSet<InputKind> = trace.inputs.iter().map(Input::kind).collect();
            if kinds.len() < InputKind::ALL.len() {
                seeds_omitting_something += 1;
            }
            seen_anywhere.extend(kinds);
        }
        assert_eq!(seen_anywhere.len(), InputKind::ALL.len());
        assert!(seeds_omitting_something > 16, "{seeds_omitting_something}");
    }

    #[test]
    fn executor_inputs_leave_the_other_seeds_traces_as_they_were() {
        let with_executor = GeneratorConfig::default();
        let plain = GeneratorConfig {
            executor_inputs_per_mille: 0,
            ..with_executor
        };
        let executor_kind = |i: &Input| EXECUTOR_KINDS.contains(&i.kind());
        let (mut same, mut changed) = (0, 0);
        for seed in 0..64 {
            let before = generate(seed, &plain);
            let after = generate(seed, &with_executor);
            assert!(!before.inputs.iter().any(executor_kind));
            if after.inputs.iter().any(executor_kind) {
                changed += 1;
            } else if before == after {
                same += 1;
            }
        }
        assert!(same > 16 && changed > 8, "{same} {changed}");
    }

    #[test]
    fn generated_traces_survive_the_text_round_trip() {
        for seed in 0..32 {
            let trace = generate(seed, &GeneratorConfig::default());
            assert_eq!(trace.to_string().parse::<Trace>(), Ok(trace));
        }
    }
}
