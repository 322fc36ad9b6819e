//! The text form, parsed back: [`Trace`]'s `FromStr`, with a
//! [`ParseError`] naming the line and what is wrong with it.

use std::str::FromStr;

use provisioning::EffectKind;
use provisioning::observe::LossCause;
use provisioning::state::BootstrapFailure;
use thiserror::Error;

use super::alphabet::{
    DriftField, Fault, FaultTarget, Group, Input, LimitChange, MAX_GROUP_COUNT, MAX_TICK_MS,
    MAX_TRACE_INPUTS, PROGRESS_STAGES, RevisionProbe, ShapeChange, StreamEvent, WorkStep,
    failure_name, progress_name,
};
use super::header::{Trace, TraceHeader};

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
        "rejoin" => Input::Rejoin,
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
