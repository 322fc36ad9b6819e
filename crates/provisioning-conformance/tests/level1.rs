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
    // The operator limits (G29, G30) are exercised, not just checked.
    let restricted = std::env::var_os("PROVISIONING_SEED").is_some()
        || std::env::var_os("PROVISIONING_TRACE").is_some();
    if !restricted {
        for (name, count) in report.vacuity.limits() {
            assert!(count > 0, "never reached at Level 1: {name}\n{report}");
        }
    }
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

/// The kit's journal trait over the real SQLite journal: every commit is one
/// SQLite transaction, and `load` (called only after a crash) closes the
/// file and opens it again, as a restarted controller would, decoding the
/// snapshot with a fresh codec.
struct Sqlite {
    dir: std::path::PathBuf,
    journal: Option<provisioning_journal::SqliteJournal>,
    codec: provisioning_journal::codec::StateCodec,
}

impl Sqlite {
    fn open(dir: &std::path::Path) -> Self {
        let journal = provisioning_journal::SqliteJournal::open(
            dir,
            provisioning_conformance::harness::RUN_NAME,
            &fast_sqlite(),
        )
        .unwrap_or_else(|error| panic!("the SQLite journal opens: {error}"));
        Sqlite {
            dir: dir.to_owned(),
            journal: Some(journal),
            codec: provisioning_journal::codec::StateCodec::new(),
        }
    }
}

fn fast_sqlite() -> provisioning_journal::SqliteOptions {
    provisioning_journal::SqliteOptions {
        synchronous: provisioning_journal::Synchronous::Normal,
        ..provisioning_journal::SqliteOptions::default()
    }
}

impl provisioning_conformance::KitJournal for Sqlite {
    fn name(&self) -> &str {
        "sqlite"
    }

    fn commit(&mut self, changes: &provisioning::DriverChanges) -> Result<(), String> {
        use provisioning_journal::Journal;
        let rows = self.codec.encode(changes).map_err(|e| e.to_string())?;
        let journal = self.journal.as_mut().ok_or("the journal is closed")?;
        journal.commit(&rows).map_err(|e| e.to_string())
    }

    fn load(&mut self) -> Result<Option<provisioning::DurableState>, String> {
        use provisioning_journal::Journal;
        // The crashed controller's handle goes (and its lock with it).
        self.journal = None;
        let journal = provisioning_journal::SqliteJournal::open_existing(
            &self.dir,
            provisioning_conformance::harness::RUN_NAME,
            &fast_sqlite(),
        )
        .map_err(|e| e.to_string())?;
        let snapshot = journal.load().map_err(|e| e.to_string())?;
        self.codec = provisioning_journal::codec::StateCodec::new();
        let state = self.codec.decode(&snapshot).map_err(|e| e.to_string())?;
        self.journal = Some(journal);
        Ok(state)
    }
}

#[test]
fn level_1_traces_with_crashes_give_identical_digests_over_the_sqlite_and_the_in_memory_journal() {
    use provisioning_conformance::{FakeSubstrate, InMemoryJournal, Input, KitJournal, Stepper};
    let run =
        |trace: &provisioning_conformance::Trace, mode: Mode, journal: Box<dyn KitJournal>| {
            let mut stepper = Stepper::builder(FakeSubstrate::new())
                .journal(journal)
                .header(trace.header.clone())
                .mode(mode)
                .build()
                .unwrap_or_else(|error| panic!("{error}"));
            for input in &trace.inputs {
                if stepper.step(input).is_err() {
                    break;
                }
            }
            stepper.finish()
        };
    let config = GeneratorConfig::default();
    let mut crashes = 0;
    let mut traces = 0;
    for seed in derive_seeds(LEVEL1_SEED_BASE, 64) {
        let trace = generate(seed, &config);
        if !trace.inputs.contains(&Input::Crash) || trace.header.has_edges() {
            continue;
        }
        for mode in Mode::ALL {
            let memory = run(&trace, mode, InMemoryJournal::boxed());
            let dir = tempfile::tempdir().unwrap_or_else(|error| panic!("a tempdir: {error}"));
            let sqlite = run(&trace, mode, Box::new(Sqlite::open(dir.path())));
            assert_eq!(memory.violation, None, "{trace}");
            assert_eq!(sqlite.violation, None, "{trace}");
            assert_eq!(
                memory.digest,
                sqlite.digest,
                "seed {seed:#x} {}",
                mode.name()
            );
            assert_eq!(
                memory.vacuity,
                sqlite.vacuity,
                "seed {seed:#x} {}",
                mode.name()
            );
            crashes += memory.vacuity.crashes;
        }
        traces += 1;
        if traces == 12 {
            break;
        }
    }
    assert!(
        traces >= 8 && crashes >= 8,
        "{traces} traces, {crashes} crashes"
    );
}
