use std::io;
use std::path::PathBuf;

/// Why a journal could not be opened, read or written. Every variant about a
/// file names that file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// The run name is not usable as a file name.
    #[error("invalid run name {run:?}: {reason}")]
    InvalidRunName {
        /// The rejected name.
        run: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The state directory could not be created or used.
    #[error("state directory {}: cannot {action}: {source}", .path.display())]
    StateDir {
        /// The directory (or the file inside it) concerned.
        path: PathBuf,
        /// What was attempted.
        action: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },

    /// Another controller holds the run's lock.
    #[error(
        "another controller for run `{run}` is running ({}); it holds the lock on {}",
        match .pid { Some(pid) => format!("pid {pid}"), None => "pid unknown".to_owned() },
        .path.display()
    )]
    Locked {
        /// The run.
        run: String,
        /// The lock file.
        path: PathBuf,
        /// The pid written into the lock file by its holder, if readable.
        pid: Option<u32>,
    },

    /// A [`crate::MemoryStore`] already has a live journal.
    #[error("another controller for run `{run}` is running (in-memory journal already open)")]
    InUse {
        /// The run.
        run: String,
    },

    /// `open_existing` found no state file.
    #[error("state file {} does not exist", .path.display())]
    NotFound {
        /// The missing file.
        path: PathBuf,
    },

    /// The state file exists but cannot be read.
    #[error("state file {} cannot be read: {source}; nothing was changed", .path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },

    /// The state file is not a SQLite database, or fails its integrity check.
    #[error("state file {} is corrupt: {problem}; nothing was changed", .path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },

    /// The state file was written by a newer build.
    #[error(
        "state file {} has schema version {found}, newer than {supported}, the newest this build supports; nothing was changed",
        .path.display()
    )]
    NewerSchema {
        /// The file.
        path: PathBuf,
        /// Its `user_version`.
        found: u32,
        /// [`crate::SCHEMA_VERSION`].
        supported: u32,
    },

    /// The state file is a SQLite database of some other program.
    #[error("state file {} is not a provisioning journal: {problem}; nothing was changed", .path.display())]
    Foreign {
        /// The file.
        path: PathBuf,
        /// What gave it away.
        problem: String,
    },

    /// The state file belongs to another run.
    #[error(
        "state file {} belongs to run `{found}`, not `{expected}`; nothing was changed",
        .path.display()
    )]
    WrongRun {
        /// The file.
        path: PathBuf,
        /// The run that was asked for.
        expected: String,
        /// The run recorded in the file.
        found: String,
    },

    /// A node row's attempt does not fit in the storage.
    #[error("attempt {attempt} of node `{node}` exceeds the largest storable attempt")]
    AttemptOutOfRange {
        /// The node.
        node: String,
        /// The attempt.
        attempt: u64,
    },

    /// SQLite failed while the state file was in use.
    #[error("state file {}: cannot {action}: {source}", .path.display())]
    Sqlite {
        /// The file.
        path: PathBuf,
        /// What was attempted.
        action: &'static str,
        /// SQLite's error.
        #[source]
        source: rusqlite::Error,
    },

    /// A file operation failed while the state file was in use.
    #[error("{}: cannot {action}: {source}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was attempted.
        action: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },

    /// A failure injected by [`crate::MemoryStore::fail_next_commit`].
    #[error("injected journal failure")]
    Injected,
}
