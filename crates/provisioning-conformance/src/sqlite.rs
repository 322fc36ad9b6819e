//! The kit's journal over the real SQLite journal (feature `sqlite`):
//! what Level 3 batteries and the Level 1 parity test run against.
//!
//! Every commit is one SQLite transaction of the codec's rows. `load`, which
//! the harness calls only after a crash, drops the crashed controller's
//! handle (and its lock), opens the file again as a restarted controller
//! would, and decodes it with a fresh codec, so nothing but what reached the
//! file survives.

use std::path::{Path, PathBuf};

use provisioning::{DriverChanges, DurableState};
use provisioning_journal::codec::StateCodec;
use provisioning_journal::{Journal, SqliteJournal, SqliteOptions, Synchronous};

use crate::harness::RUN_NAME;
use crate::journal::KitJournal;

/// A [`KitJournal`] backed by a [`SqliteJournal`] file in a directory the
/// caller owns (and removes).
pub struct SqliteKitJournal {
    dir: PathBuf,
    options: SqliteOptions,
    journal: Option<SqliteJournal>,
    codec: StateCodec,
}

impl SqliteKitJournal {
    /// Opens a new journal of the kit's run in `dir`, with `NORMAL`
    /// synchronisation (a crash of the kit's controller is not a power loss).
    ///
    /// # Errors
    /// Why the SQLite file cannot be created.
    pub fn open(dir: &Path) -> Result<Self, String> {
        let options = SqliteOptions {
            synchronous: Synchronous::Normal,
            ..SqliteOptions::default()
        };
        let journal =
            SqliteJournal::open(dir, RUN_NAME, &options).map_err(|error| error.to_string())?;
        Ok(SqliteKitJournal {
            dir: dir.to_owned(),
            options,
            journal: Some(journal),
            codec: StateCodec::new(),
        })
    }
}

impl KitJournal for SqliteKitJournal {
    fn name(&self) -> &str {
        "sqlite"
    }

    fn commit(&mut self, changes: &DriverChanges) -> Result<(), String> {
        let rows = self.codec.encode(changes).map_err(|e| e.to_string())?;
        let journal = self.journal.as_mut().ok_or("the journal is closed")?;
        journal.commit(&rows).map_err(|e| e.to_string())
    }

    fn load(&mut self) -> Result<Option<DurableState>, String> {
        self.journal = None;
        let journal = SqliteJournal::open_existing(&self.dir, RUN_NAME, &self.options)
            .map_err(|e| e.to_string())?;
        let snapshot = journal.load().map_err(|e| e.to_string())?;
        self.codec = StateCodec::new();
        let state = self.codec.decode(&snapshot).map_err(|e| e.to_string())?;
        self.journal = Some(journal);
        Ok(state)
    }
}
