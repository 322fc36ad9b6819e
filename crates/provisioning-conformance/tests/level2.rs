//! Level 2: the real `PluginBackendAdapter` over `FakePlugin`, under the
//! real driver and executor — regressions of both levels first, then 256
//! seeds × 2 modes, with faults reaching every plugin method the adapter
//! calls (cleanup included). The seam contract suite against `FakePlugin` is
//! in `tests/contract.rs`.
//!
//! Reproduce one case with the line a failure prints, for example
//! `PROVISIONING_SEED=0x… PROVISIONING_MODE=fair cargo test -p
//! provisioning-conformance --test level2`, or `PROVISIONING_TRACE='…'`.
//! `PROVISIONING_SAVE_REGRESSIONS=1` appends the shrunk failures to
//! `regressions/level2.trace`.

use std::io::Write;

use provisioning::EffectKind;
use provisioning_conformance::contract::PluginMethod;
use provisioning_conformance::plugin_fake::FaultCoverage;
use provisioning_conformance::trace::Fault;
use provisioning_conformance::{
    Battery, BatteryReport, Failure, FakePlugin, GuaranteeId, Mode, PluginDefect, PluginSubstrate,
    Regression, Trace,
};

const LEVEL1_REGRESSIONS: &str = include_str!("../regressions/level1.trace");
const LEVEL2_REGRESSIONS: &str = include_str!("../regressions/level2.trace");

/// How many seeds a broken plugin may take to be caught.
const SEEDS_TO_CATCH: usize = 64;

/// The longest shrunk trace accepted as "short".
const SHORT_TRACE: usize = 12;

/// The faults every adapter-called method must have received at least once.
const FAULTS_ON_EVERY_METHOD: [Fault; 5] = [
    Fault::Definite,
    Fault::AmbiguousDone,
    Fault::AmbiguousUndone,
    Fault::Panic,
    Fault::Hang,
];

fn regressions() -> Vec<Regression> {
    let mut all = Vec::new();
    for text in [LEVEL1_REGRESSIONS, LEVEL2_REGRESSIONS] {
        let parsed = Regression::parse_file(text);
        assert!(parsed.is_ok(), "{parsed:?}");
        all.extend(parsed.unwrap_or_default());
    }
    all
}

fn save_regressions(entries: &str) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/regressions/level2.trace");
    let written = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut file| writeln!(file, "\n{entries}"));
    if let Err(error) = written {
        eprintln!("could not append to {path}: {error}");
    }
}

/// How often the battery must apply each (plugin method, fault) pair.
const COVERAGE_MARGIN: u64 = 8;

fn run_level2(coverage: &FaultCoverage) -> BatteryReport {
    let shared = coverage.clone();
    // Every plugin of the battery counts the faults it applied.
    let battery = Battery::level2_with(move || {
        PluginSubstrate::new(FakePlugin::new().with_coverage(shared.clone()))
    })
    .regressions(regressions())
    .with_env_overrides();
    assert!(battery.is_ok(), "{battery:?}");
    match battery {
        Ok(battery) => battery.run(),
        Err(error) => panic!("{error}"),
    }
}

#[test]
fn level_2_battery_keeps_every_guarantee_over_256_seeds_in_both_modes_with_faults_on_every_method()
{
    let coverage = FaultCoverage::new();
    let report = run_level2(&coverage);
    eprintln!("{report}");
    if !report.failures.is_empty() && std::env::var_os("PROVISIONING_SAVE_REGRESSIONS").is_some() {
        save_regressions(&report.regression_entries());
    }
    assert!(report.passed(), "{report}");
    if report.vacuity_required {
        let wanted = EffectKind::ALL
            .into_iter()
            .map(PluginMethod::for_effect)
            .flat_map(|method| FAULTS_ON_EVERY_METHOD.map(|fault| (method, fault)))
            .chain([(PluginMethod::LookupEndpoint, Fault::NotReady)]);
        // With margin, not by luck: every pair is reached several times, so
        // an unrelated change to the generator cannot lose one.
        let thin: Vec<((PluginMethod, Fault), u64)> = wanted
            .map(|(method, fault)| ((method, fault), coverage.count(method, fault)))
            .filter(|(_, count)| *count < COVERAGE_MARGIN)
            .collect();
        assert!(
            thin.is_empty(),
            "faults reached these plugin methods fewer than {COVERAGE_MARGIN} times: {thin:?}"
        );
    }
}

#[test]
fn level_2_replays_both_levels_regressions_and_the_level_1_seeds() {
    let all = regressions();
    assert!(all.len() >= 3, "the committed regressions parse");
    let battery = format!("{:?}", Battery::level2());
    assert!(battery.contains("seeds: 256"), "{battery}");
    assert_eq!(Mode::ALL, [Mode::Adversarial, Mode::Fair]);
}

fn first_failure(battery: Battery<PluginSubstrate<FakePlugin>>) -> Failure {
    let report = battery
        .max_failures(1)
        .require_vacuity(false)
        .narrate_failures(false)
        .run();
    match report.failures.into_iter().next() {
        Some(failure) => failure,
        None => panic!(
            "the broken plugin was not caught in {} traces",
            report.traces
        ),
    }
}

fn check_caught(failure: &Failure, expected: &[GuaranteeId]) {
    eprintln!(
        "caught as {} ({} mode), shrunk from {} to {} inputs:\n{}",
        failure.guarantee(),
        failure.mode.name(),
        failure.original_inputs,
        failure.shrunk.inputs.len(),
        failure.shrunk
    );
    assert!(
        expected.contains(&failure.guarantee()),
        "caught as {} instead of {expected:?}:\n{failure}",
        failure.guarantee()
    );
    assert!(
        failure.shrunk.inputs.len() <= SHORT_TRACE,
        "not shrunk to a short trace:\n{failure}"
    );
    assert!(
        failure.reproduce.contains("--test level2"),
        "{}",
        failure.reproduce
    );
}

fn broken(defect: PluginDefect) -> Battery<PluginSubstrate<FakePlugin>> {
    Battery::level2_with(move || PluginSubstrate::new(FakePlugin::with_defects([defect])))
}

#[test]
fn a_plugin_that_creates_on_every_call_is_caught_by_the_level_2_battery_as_g08() {
    let battery = broken(PluginDefect::CreateIgnoresExisting).seed_count(SEEDS_TO_CATCH);
    check_caught(&first_failure(battery), &[GuaranteeId::NoDoubleCreate]);
}

#[test]
fn a_plugin_whose_destroy_keeps_the_node_is_caught_by_the_level_2_battery_as_g23() {
    let scale_away: Trace = "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; \
                             run fifo; desire scale a 1; run fifo; run fifo; tick 1000ms"
        .parse()
        .unwrap_or_default();
    let battery = broken(PluginDefect::DestroyKeepsResource)
        .seeds([])
        .modes([Mode::Fair])
        .traces([scale_away]);
    check_caught(
        &first_failure(battery),
        &[GuaranteeId::ConvergedLeaksNothing],
    );
}

#[test]
fn a_plugin_that_fails_definitely_after_acting_is_caught_by_the_level_2_battery_as_a_leak() {
    // The create fails "definitely" but made the node; the slot is scaled
    // away before the retry could adopt it, so nobody ever destroys it.
    let scaled_away_during_backoff: Trace =
        "script create-lease definite; run fifo; desire scale a 0; run fifo"
            .parse()
            .unwrap_or_default();
    let battery = broken(PluginDefect::DefiniteAfterWork)
        .seeds([])
        .modes([Mode::Fair])
        .traces([scaled_away_during_backoff]);
    check_caught(
        &first_failure(battery),
        &[
            GuaranteeId::NoDoubleCreate,
            GuaranteeId::ConvergedLeaksNothing,
        ],
    );
}

#[test]
fn a_plugin_whose_cleanup_of_absent_things_fails_is_caught_by_the_level_2_battery_as_g21() {
    let battery = broken(PluginDefect::CleanupOfAbsentFails).seed_count(SEEDS_TO_CATCH);
    check_caught(&first_failure(battery), &[GuaranteeId::FairConvergence]);
}
