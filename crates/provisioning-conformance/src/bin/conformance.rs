//! Runs the Level 1 conformance battery outside `cargo test`.
//!
//! ```text
//! conformance                 the Level 1 battery (honours PROVISIONING_SEED,
//!                             PROVISIONING_MODE, PROVISIONING_TRACE, PROVISIONING_SEEDS)
//! conformance bench [N]       N traces (N/2 seeds x 2 modes, default 512); prints
//!                             traces per second and the wall time
//! conformance replay FILE     replays a regression file
//! conformance explore N D [OPTION...]
//!                             explores every interleaving for N (1 or 2) nodes to
//!                             depth D (G31); prints states and states/s. Options:
//!                             `small` leaves out the executor-level and limit inputs;
//!                             `no-probes` the revision probes; `lifo` also runs the
//!                             liveness tail newest-first; `interleave`, `late-close`
//!                             set those trace headers;
//!                             `ready` / `held-crash` start from a converged cluster /
//!                             a recovered crash with a create still held; `cap=K`, `budget=K`,
//!                             `breaker=F` set a launch cap, group a's rollout budget,
//!                             a breaker opening after F failures (5 s cool-down) first
//! ```
//!
//! Build it in release mode for the benchmark:
//! `cargo run --release -p provisioning-conformance --bin conformance -- bench`.
//! The exit status is 0 when the battery passed, 1 when it failed, 2 on bad usage.

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use provisioning_conformance::explore::Start;
use provisioning_conformance::trace::{Group, LimitChange};
use provisioning_conformance::{
    Battery, BatteryReport, ExploreConfig, Explorer, FakeSubstrate, Regression,
};

/// The number of traces the benchmark runs by default (256 seeds x 2 modes).
const BENCH_TRACES: usize = 512;

/// The wall-time target for [`BENCH_TRACES`] traces, in seconds.
const BENCH_TARGET_SECONDS: f64 = 2.0;

/// Prints a line to stdout. A closed pipe (`conformance bench | head -1`)
/// is not an error worth a panic: the output is simply not wanted any more.
fn say(text: impl std::fmt::Display) {
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

fn usage(problem: &str) -> ExitCode {
    eprintln!(
        "{problem}\nusage: conformance [bench [TRACES] | replay FILE | explore NODES DEPTH [small] [no-probes] [lifo] [interleave] [late-close] [ready|held-crash] [cap=K] [budget=K] [breaker=F]]"
    );
    ExitCode::from(2)
}

fn verdict(report: &BatteryReport) -> ExitCode {
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run_battery() -> ExitCode {
    match Battery::level1().with_env_overrides() {
        Ok(battery) => {
            let report = battery.run();
            say(&report);
            verdict(&report)
        }
        Err(error) => usage(&error.to_string()),
    }
}

fn bench(traces: usize) -> ExitCode {
    let seeds = traces.div_ceil(2);
    let battery = Battery::level1()
        .seed_count(seeds)
        .require_vacuity(traces >= BENCH_TRACES);
    let started = Instant::now();
    let report = battery.run();
    let wall = started.elapsed().as_secs_f64();
    let per_second = if wall > 0.0 {
        report.traces as f64 / wall
    } else {
        0.0
    };
    say(format_args!(
        "level 1 bench: {} traces ({seeds} seeds x 2 modes, {} harness runs including the G18/G20 re-runs) in {wall:.3} s wall: {per_second:.0} traces/s",
        report.traces, report.runs
    ));
    say(format_args!(
        "projected wall time for {BENCH_TRACES} traces: {:.3} s (target <= {BENCH_TARGET_SECONDS} s)",
        BENCH_TRACES as f64 / per_second.max(f64::MIN_POSITIVE)
    ));
    if !report.passed() {
        say(&report);
    }
    verdict(&report)
}

fn replay(path: &str) -> ExitCode {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) => return usage(&format!("cannot read {path}: {error}")),
    };
    let regressions = match Regression::parse_file(&text) {
        Ok(regressions) => regressions,
        Err(error) => return usage(&error.to_string()),
    };
    let report = Battery::level1()
        .seeds([])
        .require_vacuity(false)
        .regressions(regressions)
        .run();
    say(&report);
    verdict(&report)
}

fn explore(nodes: &str, depth: &str, options: &[&str]) -> ExitCode {
    let (Ok(nodes @ 1..=2), Ok(depth)) = (nodes.parse::<u32>(), depth.parse::<usize>()) else {
        return usage("explore wants NODES (1 or 2) and DEPTH");
    };
    let mut config = ExploreConfig::new(nodes, depth);
    for option in options {
        let number = |prefix: &str| {
            option
                .strip_prefix(prefix)
                .and_then(|n| n.parse::<u32>().ok())
        };
        if *option == "small" {
            config.executor_inputs = false;
        } else if *option == "no-probes" {
            config.revision_probes = false;
        } else if *option == "lifo" {
            config.lifo_tail = true;
        } else if *option == "interleave" {
            config.header.interleave = true;
        } else if *option == "late-close" {
            config.header.late_close = true;
        } else if *option == "ready" {
            config.start = Start::Ready;
        } else if *option == "held-crash" {
            config.start = Start::HeldCreateCrash;
        } else if let Some(count) = number("cap=") {
            config.limits.push(LimitChange::Cap { count });
        } else if let Some(count) = number("budget=") {
            config.limits.push(LimitChange::Budget {
                group: Group::A,
                count,
            });
        } else if let Some(failures) = number("breaker=") {
            config.limits.push(LimitChange::Breaker {
                group: Group::A,
                failures,
                cooldown_ms: 5_000,
            });
        } else {
            return usage(&format!("unknown explore option: {option}"));
        }
    }
    let started = Instant::now();
    let report = Explorer::new(FakeSubstrate::new).run(&config);
    let wall = started.elapsed().as_secs_f64();
    let setup = config.setup();
    if !setup.is_empty() {
        let inputs: Vec<String> = setup.iter().map(ToString::to_string).collect();
        say(format_args!(
            "setup prefix (not branched over): {}",
            inputs.join("; ")
        ));
    }
    say(format_args!(
        "explore {nodes} node(s) depth {depth}: {report}{:.3} s wall, {:.0} transitions/s, {:.0} distinct states/s",
        wall,
        report.states_explored as f64 / wall.max(f64::MIN_POSITIVE),
        report.distinct_states as f64 / wall.max(f64::MIN_POSITIVE)
    ));
    if let Some(found) = &report.counterexample {
        let entry = found.to_regression();
        say(format_args!(
            "as a regression entry (save it to FILE; `conformance replay FILE` replays it):\n{}",
            entry.to_entry()
        ));
        say(format_args!(
            "reproduce: PROVISIONING_TRACE='{}' PROVISIONING_MODE={} conformance",
            found.trace.to_single_line(),
            entry.mode.name()
        ));
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] | ["run"] => run_battery(),
        ["bench"] => bench(BENCH_TRACES),
        ["bench", count] => match count.parse::<usize>() {
            Ok(count) if count > 0 => bench(count),
            _ => usage(&format!("not a trace count: {count}")),
        },
        ["replay", path] => replay(path),
        ["explore", nodes, depth, options @ ..] => explore(nodes, depth, options),
        _ => usage("unknown arguments"),
    }
}
