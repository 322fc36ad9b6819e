//! Where `provision` keeps each run's durable state, and opening it.
//!
//! One SQLite file per run, `DIR/RUN.db`, with its lock `DIR/RUN.lock`
//! (see `docs/state.md`). DIR is `--state-dir` (or `PROVISION_STATE_DIR`),
//! else `$XDG_STATE_HOME/provision`, else `~/.local/state/provision`.

use std::path::{Path, PathBuf};

use provisioning_agent::RunSecret;
use provisioning_agent::credential::RUN_SECRET_LEN;
use provisioning_journal::{SqliteJournal, SqliteOptions, state_file_path};
use provisioning_runtime::Durability;

/// The most state files `down` looks at when no run is named.
const MAX_STATE_FILES_SCANNED: usize = 256;

/// The state directory in force.
#[derive(Clone, Debug)]
pub(crate) struct StateLocation {
    dir: Option<PathBuf>,
}

impl StateLocation {
    /// `--state-dir` when given, else the default from the environment.
    pub(crate) fn new(dir: Option<PathBuf>) -> Self {
        StateLocation {
            dir: dir.or_else(provisioning_journal::default_state_dir),
        }
    }

    /// The directory.
    ///
    /// # Errors
    /// When neither `--state-dir` nor a usable `XDG_STATE_HOME`/`HOME` names one.
    pub(crate) fn dir(&self) -> Result<&Path, String> {
        self.dir.as_deref().ok_or_else(|| {
            "no state directory: pass --state-dir or set PROVISION_STATE_DIR (HOME is not set)"
                .to_owned()
        })
    }

    /// The state file of `run`, for messages.
    pub(crate) fn file(&self, run: &str) -> String {
        self.dir()
            .ok()
            .and_then(|d| state_file_path(d, run).ok())
            .map_or_else(|| format!("{run}.db"), |p| p.display().to_string())
    }

    /// Opens (creating if needed) and loads the state of `run`. Holds the
    /// run's lock from here on: a second controller is refused. The state
    /// of a run that was torn down cleanly is replaced by a fresh one.
    ///
    /// # Errors
    /// A message naming the file and the problem (locked, corrupt, newer
    /// schema, unwritable directory, unreadable rows); nothing was changed.
    pub(crate) fn open(&self, run: &str) -> Result<Durability, String> {
        let durability = self.open_as_is(run)?;
        if durability.resume_summary().is_some() || durability.secret().is_none() {
            // Left unclean (resumed), or never used: as it is.
            return Ok(durability);
        }
        // A run torn down cleanly starts fresh: generation 1 for the file
        // as first read, attempt numbers from 1, and a new run secret (so
        // no agent of the earlier life could join). The old file is removed
        // while its lock is still held, so no other `up` of the run sees it
        // half gone; whichever `up` takes the lock next creates the new one.
        let dir = self.dir()?;
        let path = state_file_path(dir, run).map_err(|e| e.to_string())?;
        for suffix in ["", "-wal", "-shm"] {
            let mut name = path.clone().into_os_string();
            name.push(suffix);
            match std::fs::remove_file(&name) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(format!(
                        "cannot start run {run} afresh: cannot remove {}: {error}",
                        PathBuf::from(name).display()
                    ));
                }
            }
        }
        drop(durability);
        self.open_as_is(run)
    }

    /// Opens (creating if needed) and loads the state of `run` as it is.
    fn open_as_is(&self, run: &str) -> Result<Durability, String> {
        let dir = self.dir()?;
        let journal =
            SqliteJournal::open(dir, run, &SqliteOptions::default()).map_err(|e| e.to_string())?;
        Durability::open(Box::new(journal)).map_err(|e| format!("{}: {e}", self.file(run)))
    }

    /// Opens the state of `run` only if it exists (nothing is created).
    ///
    /// # Errors
    /// As [`StateLocation::open`]; a missing file is `Ok(None)`.
    pub(crate) fn open_existing(&self, run: &str) -> Result<Option<Durability>, String> {
        let dir = self.dir()?;
        if !SqliteJournal::exists(dir, run) {
            return Ok(None);
        }
        let journal = SqliteJournal::open_existing(dir, run, &SqliteOptions::default())
            .map_err(|e| e.to_string())?;
        Durability::open(Box::new(journal))
            .map(Some)
            .map_err(|e| format!("{}: {e}", self.file(run)))
    }

    /// The runs that have a state file, in name order.
    pub(crate) fn runs(&self) -> Vec<String> {
        let Ok(dir) = self.dir() else {
            return Vec::new();
        };
        let mut runs: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .take(MAX_STATE_FILES_SCANNED)
            .filter_map(|entry| {
                let path = entry.path();
                (path.extension()? == "db")
                    .then(|| path.file_stem()?.to_str().map(str::to_owned))
                    .flatten()
            })
            .collect();
        runs.sort();
        runs
    }
}

/// The run's secret: the stored one, or a new one that is stored before any
/// node can be given a credential derived from it.
///
/// # Errors
/// When the stored secret has the wrong length, or the random source or the
/// journal fails.
pub(crate) fn run_secret(durability: &mut Durability) -> Result<RunSecret, String> {
    if let Some(stored) = durability.secret() {
        let bytes: [u8; RUN_SECRET_LEN] = stored.try_into().map_err(|_| {
            format!(
                "the stored run secret has {} bytes, not {RUN_SECRET_LEN}",
                stored.len()
            )
        })?;
        return Ok(RunSecret::from_bytes(bytes));
    }
    let mut bytes = [0_u8; RUN_SECRET_LEN];
    getrandom::fill(&mut bytes)
        .map_err(|e| format!("cannot read the operating system's random source: {e}"))?;
    durability
        .store_secret(&bytes)
        .map_err(|e| format!("cannot store the run secret: {e}"))?;
    Ok(RunSecret::from_bytes(bytes))
}
