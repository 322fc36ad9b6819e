//! Level 1: the battery against the in-memory `FakeBackend`, inside
//! `cargo test` — regressions first, then 256 seeds × 2 modes.
//!
//! Reproduce one case with the line a failure prints, for example
//! `PROVISIONING_SEED=0x… PROVISIONING_MODE=fair cargo test -p
//! provisioning-conformance --test level1`, or `PROVISIONING_TRACE='…'`.
//! `PROVISIONING_SEEDS=N` runs more seeds; `PROVISIONING_SAVE_REGRESSIONS=1`
//! appends the shrunk failures to `regressions/level1.trace`.

use std::io::Write;

use provisioning_conformance::battery::{DEFAULT_SEED_COUNT, LEVEL1_SEED_BASE, derive_seeds};
use provisioning_conformance::{Battery, GeneratorConfig, Mode, Regression, generate};

const REGRESSIONS: &str = include_str!("../regressions/level1.trace");

fn save_regressions(entries: &str) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/regressions/level1.trace");
    let written = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut file| writeln!(file, "\n{entries}"));
    if let Err(error) = written {
        eprintln!("could not append to {path}: {error}");
    }
}

#[test]
fn level_1_battery_keeps_every_guarantee_over_256_seeds_in_both_modes() {
    let regressions = Regression::parse_file(REGRESSIONS);
    assert!(regressions.is_ok(), "{regressions:?}");
    let battery = Battery::level1()
        .regressions(regressions.unwrap_or_default())
        .with_env_overrides();
    assert!(battery.is_ok(), "{battery:?}");
    let Ok(battery) = battery else { return };
    let report = battery.run();
    eprintln!("{report}");
    if !report.failures.is_empty() && std::env::var_os("PROVISIONING_SAVE_REGRESSIONS").is_some() {
        save_regressions(&report.regression_entries());
    }
    assert!(report.passed(), "{report}");
}

#[test]
fn level_1_runs_every_regression_and_at_least_256_seeds_in_two_modes_of_64_inputs() {
    let regressions = Regression::parse_file(REGRESSIONS).unwrap_or_default();
    assert!(regressions.len() >= 3, "the committed regressions parse");
    let seeds = derive_seeds(LEVEL1_SEED_BASE, DEFAULT_SEED_COUNT);
    assert_eq!(seeds.len(), 256);
    let config = GeneratorConfig::default();
    for seed in seeds {
        let inputs = generate(seed, &config).inputs.len();
        assert!(inputs >= 64, "seed {seed:#x} has only {inputs} inputs");
    }
    assert_eq!(Mode::ALL, [Mode::Adversarial, Mode::Fair]);
}
