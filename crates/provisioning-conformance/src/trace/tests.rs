//! The text form's round trip, its rejections and the shrinker's
//! simplifications.

use provisioning::EffectKind;
use provisioning::observe::LossCause;
use provisioning::state::BootstrapFailure;

use super::*;

fn every_input_shape() -> Vec<Input> {
    let mut inputs = vec![
        Input::Tick { millis: 1 },
        Input::Tick { millis: 61_000 },
        Input::Release,
        Input::Crash,
        Input::Rejoin,
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
