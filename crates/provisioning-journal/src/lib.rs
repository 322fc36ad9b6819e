//! The durable journal of a controller run (design §13).
//!
//! Storage only: this crate knows nothing of the reconciler's types. The core
//! produces, per reconcile pass, a [`ChangeSet`] whose values are already
//! serialized as JSON text; the host commits it with [`Journal::commit`] as
//! **one transaction, before any operation of that pass is submitted**. On
//! restart the host calls [`Journal::load`] and gets a [`Snapshot`] of
//! everything that was committed, and nothing that was not.
//!
//! Two implementations:
//! - [`SqliteJournal`]: one SQLite file per run, `<state_dir>/<run>.db`, in WAL
//!   mode, guarded by an exclusive lock on `<state_dir>/<run>.lock` so that
//!   only one controller drives a run. The layout is documented in
//!   `docs/state.md`.
//! - [`MemoryJournal`]: the in-memory twin for the conformance kit. Its
//!   committed data lives in a shared [`MemoryStore`], so a test can drop the
//!   journal (a crash) and [`MemoryJournal::reopen`] the same store.
//!
//! Both apply a change set in the same order (meta, then upserts, then
//! deletes), refuse the same bad input, and report the same [`JournalStats`].

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

pub mod codec;
mod error;
mod memory;
mod sqlite;

pub use error::JournalError;
pub use memory::{MemoryJournal, MemoryStore};
pub use sqlite::{SqliteJournal, SqliteOptions, Synchronous};

/// The schema version this build writes and the newest it can read
/// (`PRAGMA user_version` of a state file).
pub const SCHEMA_VERSION: u32 = 1;

/// `PRAGMA application_id` of every state file: the ASCII bytes `PRVJ`.
/// A SQLite file with another non-zero id belongs to another program.
pub const APPLICATION_ID: i32 = 0x5052_564a;

/// The longest run name accepted (the core's limit on names).
pub const MAX_RUN_NAME_LEN: usize = 63;

/// The largest attempt number a journal stores (SQLite integers are signed
/// 64-bit).
pub const MAX_ATTEMPT: u64 = i64::MAX as u64;

/// One node's durable record: the slot id, its current attempt, a short stage
/// label (for people reading the file) and everything else as JSON text.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeRow {
    /// The logical node id (`{group}-{index}`), the row's key.
    pub node: String,
    /// The node's current attempt number, at most [`MAX_ATTEMPT`].
    pub attempt: u64,
    /// A short stage label, e.g. `leased` or `joined`.
    pub stage: String,
    /// The rest of the node's record, serialized as JSON by the caller.
    pub body: String,
}

/// The changes of one reconcile pass, committed as one transaction.
///
/// Applied in this order: `meta` upserts, node `upserts`, node `deletes`.
/// Within a list a later entry for the same key wins, and a node that is
/// both upserted and deleted in one change set ends up deleted. Deleting a
/// node that is not there is not an error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChangeSet {
    /// `(key, JSON value)` pairs, inserted or replaced.
    pub meta: Vec<(String, String)>,
    /// Node rows, inserted or replaced by `node`.
    pub upserts: Vec<NodeRow>,
    /// Node ids whose rows are removed.
    pub deletes: Vec<String>,
}

impl ChangeSet {
    /// An empty change set.
    pub fn new() -> Self {
        Self::default()
    }

    /// True when the change set changes nothing.
    pub fn is_empty(&self) -> bool {
        self.meta.is_empty() && self.upserts.is_empty() && self.deletes.is_empty()
    }

    /// How many rows the change set writes or deletes.
    pub fn len(&self) -> usize {
        self.meta.len() + self.upserts.len() + self.deletes.len()
    }

    /// The approximate payload size: the lengths of every meta key and value
    /// and of every node id, stage and body, plus every deleted id.
    pub fn payload_bytes(&self) -> u64 {
        let meta: usize = self.meta.iter().map(|(k, v)| k.len() + v.len()).sum();
        let nodes: usize = self
            .upserts
            .iter()
            .map(|r| r.node.len() + r.stage.len() + r.body.len())
            .sum();
        let deletes: usize = self.deletes.iter().map(String::len).sum();
        (meta + nodes + deletes) as u64
    }

    /// Checks what the storage cannot hold, before anything is written.
    pub(crate) fn validate(&self) -> Result<(), JournalError> {
        for row in &self.upserts {
            if row.attempt > MAX_ATTEMPT {
                return Err(JournalError::AttemptOutOfRange {
                    node: row.node.clone(),
                    attempt: row.attempt,
                });
            }
        }
        Ok(())
    }
}

/// Everything a journal holds, as committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The run the journal belongs to.
    pub run: String,
    /// The schema version of the storage ([`SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// True after [`Journal::mark_clean`] with no commit since: the previous
    /// controller tore the run down cleanly, so the next start is fresh. A
    /// new journal is clean too (nothing to recover).
    pub clean: bool,
    /// The run's secret, if one was set.
    pub secret: Option<Vec<u8>>,
    /// Meta entries by key (JSON values).
    pub meta: BTreeMap<String, String>,
    /// Node rows by node id.
    pub nodes: BTreeMap<String, NodeRow>,
}

impl Snapshot {
    /// The snapshot of a journal nothing was ever committed to.
    pub fn empty(run: &str) -> Self {
        Snapshot {
            run: run.to_owned(),
            schema_version: SCHEMA_VERSION,
            clean: true,
            secret: None,
            meta: BTreeMap::new(),
            nodes: BTreeMap::new(),
        }
    }

    /// True when the journal holds no meta entry and no node.
    pub fn is_blank(&self) -> bool {
        self.meta.is_empty() && self.nodes.is_empty()
    }
}

/// What one journal handle wrote since it was opened. Failed commits count
/// nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct JournalStats {
    /// Successful [`Journal::commit`] calls.
    pub commits: u64,
    /// Rows written or deleted by those commits ([`ChangeSet::len`]).
    pub rows_written: u64,
    /// Approximate bytes written ([`ChangeSet::payload_bytes`]).
    pub bytes_written: u64,
}

impl JournalStats {
    pub(crate) fn record(&mut self, changes: &ChangeSet) {
        self.commits += 1;
        self.rows_written += changes.len() as u64;
        self.bytes_written += changes.payload_bytes();
    }
}

/// The durable journal of one run, owned by its one controller.
pub trait Journal: Send {
    /// Everything committed so far.
    fn load(&self) -> Result<Snapshot, JournalError>;

    /// Applies `changes` as one transaction and marks the state unclean.
    /// Either all of it is durable when this returns `Ok`, or none of it is.
    /// An empty change set still marks the state unclean.
    fn commit(&mut self, changes: &ChangeSet) -> Result<(), JournalError>;

    /// Stores the run's secret, replacing any previous one. Does not change
    /// the clean flag.
    fn set_secret(&mut self, secret: &[u8]) -> Result<(), JournalError>;

    /// Marks the state clean, after a clean teardown: the next start is
    /// fresh. The next commit marks it unclean again. Data is kept.
    fn mark_clean(&mut self) -> Result<(), JournalError>;

    /// What this handle wrote since it was opened.
    fn stats(&self) -> JournalStats;
}

/// Checks a run name against the rules of the core's shape validation:
/// 1 to 63 ASCII letters, digits, `_`, `.` or `-`, not starting with `.` or
/// `-`. Such a name cannot name a path outside the state directory.
pub fn validate_run_name(run: &str) -> Result<(), JournalError> {
    let reason = if run.is_empty() {
        Some("must not be empty")
    } else if run.len() > MAX_RUN_NAME_LEN {
        Some("longer than 63 characters")
    } else if !run
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        Some("only ASCII letters, digits, '_', '.' and '-' are allowed")
    } else if run.starts_with('-') || run.starts_with('.') {
        Some("must start with a letter, digit or '_'")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(JournalError::InvalidRunName {
            run: run.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// The default state directory from the environment: `$XDG_STATE_HOME/provision`
/// when `XDG_STATE_HOME` is set to an absolute path, else
/// `$HOME/.local/state/provision`; `None` when neither is usable. The
/// command line's `--state-dir` / `PROVISION_STATE_DIR` take precedence; that
/// is the caller's business.
pub fn default_state_dir() -> Option<PathBuf> {
    default_state_dir_from(std::env::var_os("XDG_STATE_HOME"), std::env::var_os("HOME"))
}

/// [`default_state_dir`] with the two variables passed in.
pub fn default_state_dir_from(
    xdg_state_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    let absolute = |v: Option<OsString>| {
        v.filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    if let Some(xdg) = absolute(xdg_state_home) {
        return Some(xdg.join("provision"));
    }
    absolute(home).map(|h| h.join(".local").join("state").join("provision"))
}

/// The state file of `run` in `state_dir`: `<state_dir>/<run>.db`.
pub fn state_file_path(state_dir: &Path, run: &str) -> Result<PathBuf, JournalError> {
    validate_run_name(run)?;
    Ok(state_dir.join(format!("{run}.db")))
}

/// The lock file of `run` in `state_dir`: `<state_dir>/<run>.lock`.
pub fn lock_file_path(state_dir: &Path, run: &str) -> Result<PathBuf, JournalError> {
    validate_run_name(run)?;
    Ok(state_dir.join(format!("{run}.lock")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_names_follow_the_cores_rules_and_cannot_escape_the_directory() {
        for good in ["a", "run-1", "my_run.2", "_x", &"a".repeat(63)] {
            assert!(validate_run_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            "/abs",
            "-flag",
            ".hidden",
            "sp ace",
            "nul\0",
            "é",
            &"a".repeat(64),
        ] {
            let err = validate_run_name(bad).unwrap_err();
            assert!(matches!(err, JournalError::InvalidRunName { .. }), "{bad}");
        }
    }

    #[test]
    fn default_state_dir_prefers_an_absolute_xdg_state_home_then_home() {
        let d = default_state_dir_from(Some("/x/state".into()), Some("/home/u".into()));
        assert_eq!(d, Some(PathBuf::from("/x/state/provision")));
        let d = default_state_dir_from(Some("relative".into()), Some("/home/u".into()));
        assert_eq!(d, Some(PathBuf::from("/home/u/.local/state/provision")));
        let d = default_state_dir_from(Some("".into()), Some("/home/u".into()));
        assert_eq!(d, Some(PathBuf::from("/home/u/.local/state/provision")));
        assert_eq!(default_state_dir_from(None, None), None);
        assert_eq!(default_state_dir_from(None, Some("".into())), None);
    }

    #[test]
    fn change_set_counts_rows_and_payload() {
        let cs = ChangeSet {
            meta: vec![("k".into(), "12".into())],
            upserts: vec![NodeRow {
                node: "g-0".into(),
                attempt: 1,
                stage: "s".into(),
                body: "{}".into(),
            }],
            deletes: vec!["g-1".into()],
        };
        assert!(!cs.is_empty());
        assert_eq!(cs.len(), 3);
        assert_eq!(cs.payload_bytes(), 3 + 3 + 1 + 2 + 3);
        assert!(ChangeSet::new().is_empty());
    }
}
