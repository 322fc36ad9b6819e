//! The Level 3 battery runner: seeds × both modes plus written traces that
//! reach every real fault on purpose, shrinking within a small budget (each
//! evaluation starts real things), with the kit's reproduce line, and the
//! checks of the final summary: no failure, no vacuous situation except
//! those waived with a reason, and no required real fault left at zero.

use std::fmt;

use crate::battery::{ENV_SEED, ENV_TRACE, EnvError, derive_seeds};
use crate::generate::GeneratorConfig;
use crate::journal::KitJournal;
use crate::substrate::Substrate;
use crate::trace::{ParseError, Trace};
use crate::{Battery, BatteryReport};

/// Why a Level 3 battery cannot run or did not pass.
#[derive(Debug, thiserror::Error)]
pub enum Level3Error {
    /// A written trace does not parse.
    #[error("written Level 3 trace {index} does not parse: {error}")]
    Trace {
        /// Its index among the written traces.
        index: usize,
        /// Why.
        error: ParseError,
    },
    /// An environment override does not parse.
    #[error("an environment override does not parse: {0}")]
    Env(#[from] EnvError),
    /// The battery found failures, or situations it never reached.
    #[error("{name}: never reached: {vacuous:?}\n{report}")]
    Failed {
        /// The battery's name.
        name: String,
        /// The vacuity counts left at zero and not waived.
        vacuous: Vec<&'static str>,
        /// The whole report.
        report: Box<BatteryReport>,
    },
    /// Real faults that were never applied over the whole battery.
    #[error("{name} never applied these real faults: {never:?} ({counts})")]
    FaultsNeverApplied {
        /// The battery's name.
        name: String,
        /// The faults at zero.
        never: Vec<&'static str>,
        /// Every required count, for the diagnosis.
        counts: String,
    },
}

/// A vacuity count a battery does not require yet, and why.
pub type Waiver = (&'static str, &'static str);

/// How one Level 3 battery runs. See the module docs.
pub struct Level3Battery {
    name: String,
    reproduce: String,
    seeds: Vec<u64>,
    seed_count: usize,
    generator: Option<GeneratorConfig>,
    traces: Vec<Trace>,
    shrink_budget: usize,
    journal: Option<fn() -> Box<dyn KitJournal>>,
    waived: Vec<Waiver>,
}

impl fmt::Debug for Level3Battery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Level3Battery")
            .field("name", &self.name)
            .field("seeds", &self.seeds.len())
            .field("traces", &self.traces.len())
            .field("shrink_budget", &self.shrink_budget)
            .finish_non_exhaustive()
    }
}

impl Level3Battery {
    /// A battery named `name` whose failures print `reproduce` (the cargo
    /// command of the test) in their reproduce line; `seed_count` seeds per
    /// mode derived from `seed_base`, one failure reported, shrunk within
    /// `shrink_budget` evaluations.
    pub fn new(
        name: impl Into<String>,
        reproduce: impl Into<String>,
        seed_base: u64,
        seed_count: usize,
        shrink_budget: usize,
    ) -> Self {
        Level3Battery {
            name: name.into(),
            reproduce: reproduce.into(),
            seeds: derive_seeds(seed_base, seed_count),
            seed_count,
            generator: None,
            traces: Vec::new(),
            shrink_budget,
            journal: None,
            waived: Vec::new(),
        }
    }

    /// Generates the seeds' traces with `config` instead of the default.
    pub fn generator(mut self, config: GeneratorConfig) -> Self {
        self.generator = Some(config);
        self
    }

    /// Runs the written traces `texts` too, in both modes.
    ///
    /// # Errors
    /// [`Level3Error::Trace`] when one does not parse.
    pub fn written_traces(mut self, texts: &[&str]) -> Result<Self, Level3Error> {
        for (index, text) in texts.iter().enumerate() {
            let trace = text
                .parse()
                .map_err(|error| Level3Error::Trace { index, error })?;
            self.traces.push(trace);
        }
        Ok(self)
    }

    /// Builds every run's journal with `journal` (a crash recovers from it).
    pub fn journal(mut self, journal: fn() -> Box<dyn KitJournal>) -> Self {
        self.journal = Some(journal);
        self
    }

    /// Does not require the vacuity counts `waived` (each with its reason,
    /// printed with the summary).
    pub fn waive(mut self, waived: &[Waiver]) -> Self {
        self.waived.extend_from_slice(waived);
        self
    }

    /// The seeds per mode.
    pub fn seed_count(&self) -> usize {
        self.seed_count
    }

    /// The seeds, in order.
    pub fn seeds(&self) -> &[u64] {
        &self.seeds
    }

    /// How many written traces run.
    pub fn written_trace_count(&self) -> usize {
        self.traces.len()
    }

    /// Runs the battery over fresh substrates from `factory`, with the
    /// environment's overrides (one seed, one mode, one trace).
    ///
    /// # Errors
    /// [`Level3Error::Env`] when an override does not parse.
    pub fn run<S: Substrate + 'static>(
        &self,
        factory: impl Fn() -> S + 'static,
    ) -> Result<BatteryReport, Level3Error> {
        let mut battery = Battery::new(self.name.clone(), factory)
            .seeds(self.seeds.iter().copied())
            .traces(self.traces.iter().cloned())
            .shrink_budget(self.shrink_budget)
            .max_failures(1)
            .reproduce_with(self.reproduce.clone());
        if let Some(journal) = self.journal {
            battery = battery.journal(journal);
        }
        if let Some(generator) = self.generator {
            battery = battery.generator(generator);
        }
        Ok(battery.with_env_overrides()?.run())
    }

    /// Checks `report`: no failure, and no vacuity count at zero that is
    /// not waived. Prints the waivers with their reasons.
    ///
    /// # Errors
    /// [`Level3Error::Failed`] with the report.
    pub fn check(&self, report: &BatteryReport) -> Result<(), Level3Error> {
        let vacuous: Vec<&'static str> = report
            .vacuous()
            .into_iter()
            .filter(|name| !self.waived.iter().any(|(waived, _)| waived == name))
            .collect();
        for (name, why) in &self.waived {
            eprintln!("{}: vacuity {name:?} waived: {why}", self.name);
        }
        if report.failures.is_empty() && vacuous.is_empty() {
            Ok(())
        } else {
            Err(Level3Error::Failed {
                name: self.name.clone(),
                vacuous,
                report: Box::new(report.clone()),
            })
        }
    }

    /// Checks that every required real fault was applied at least once,
    /// unless the environment restricts the battery to one seed or one
    /// trace (which reaches what it reaches; the kit waives vacuity then
    /// too).
    ///
    /// # Errors
    /// [`Level3Error::FaultsNeverApplied`] with the counts.
    pub fn check_faults(&self, required: &[(&'static str, u64)]) -> Result<(), Level3Error> {
        let never: Vec<&'static str> = required
            .iter()
            .filter(|(_, count)| *count == 0)
            .map(|(name, _)| *name)
            .collect();
        if restricted() || never.is_empty() {
            Ok(())
        } else {
            Err(Level3Error::FaultsNeverApplied {
                name: self.name.clone(),
                never,
                counts: describe(required),
            })
        }
    }
}

/// Whether the environment restricts the battery to one seed or one trace.
pub fn restricted() -> bool {
    [ENV_SEED, ENV_TRACE]
        .iter()
        .any(|name| std::env::var_os(name).is_some_and(|value| !value.is_empty()))
}

/// `name count, name count, …` for a summary line.
pub fn describe(counts: &[(&str, u64)]) -> String {
    counts
        .iter()
        .map(|(name, count)| format!("{name} {count}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(feature = "sqlite")]
pub use temp_sqlite::{TempSqliteJournal, temp_sqlite_journal};

#[cfg(feature = "sqlite")]
mod temp_sqlite {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};

    use provisioning::{DriverChanges, DurableState};

    use crate::journal::KitJournal;
    use crate::sqlite::SqliteKitJournal;

    /// How many names a temporary journal directory tries before it gives up.
    const TEMP_DIR_TRIES_MAX: u64 = 64;

    /// Directories made by this process so far (their names' serials).
    static TEMP_DIRS: AtomicU64 = AtomicU64::new(0);

    /// A directory of its own under the system's temporary directory,
    /// removed with everything in it when dropped.
    #[derive(Debug)]
    struct TempDir {
        path: PathBuf,
    }

    impl TempDir {
        fn create() -> std::io::Result<TempDir> {
            let base = std::env::temp_dir();
            let mut last = None;
            for _ in 0..TEMP_DIR_TRIES_MAX {
                let serial = TEMP_DIRS.fetch_add(1, Ordering::Relaxed);
                let path = base.join(format!(
                    "provisioning-l3-journal-{}-{serial}",
                    std::process::id()
                ));
                match std::fs::create_dir(&path) {
                    Ok(()) => return Ok(TempDir { path }),
                    Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                        last = Some(error);
                    }
                    Err(error) => return Err(error),
                }
            }
            Err(last.unwrap_or_else(|| std::io::Error::other("no free name")))
        }

        fn path(&self) -> &Path {
            &self.path
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }

    /// The kit's SQLite journal in a temporary directory of its own, removed
    /// with it.
    pub struct TempSqliteJournal {
        // Declared first: the journal closes before its directory goes.
        journal: SqliteKitJournal,
        _dir: TempDir,
    }

    impl TempSqliteJournal {
        /// Opens a fresh journal in a new temporary directory.
        ///
        /// # Errors
        /// Why the directory or the SQLite file cannot be made.
        pub fn open() -> Result<Self, String> {
            let dir = TempDir::create()
                .map_err(|error| format!("no temporary directory for the journal: {error}"))?;
            let journal = SqliteKitJournal::open(dir.path())?;
            Ok(TempSqliteJournal { journal, _dir: dir })
        }
    }

    impl KitJournal for TempSqliteJournal {
        fn name(&self) -> &str {
            self.journal.name()
        }

        fn commit(&mut self, changes: &DriverChanges) -> Result<(), String> {
            self.journal.commit(changes)
        }

        fn load(&mut self) -> Result<Option<DurableState>, String> {
            self.journal.load()
        }
    }

    /// A journal factory for [`Level3Battery::journal`](super::Level3Battery::journal).
    ///
    /// # Panics
    /// When the test environment has no temporary directory or SQLite
    /// cannot open a file there: Level 3 then fails loudly rather than run
    /// without the journal its crashes recover from.
    pub fn temp_sqlite_journal() -> Box<dyn KitJournal> {
        match TempSqliteJournal::open() {
            Ok(journal) => Box::new(journal),
            Err(error) => panic!("level 3 needs its SQLite journal: {error}"),
        }
    }
}
