use std::collections::BTreeMap;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, TransactionBehavior, params};

use crate::{
    APPLICATION_ID, ChangeSet, Journal, JournalError, JournalStats, NodeRow, SCHEMA_VERSION,
    Snapshot, lock_file_path, state_file_path,
};

/// How hard SQLite pushes each commit to the disk (`PRAGMA synchronous`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Synchronous {
    /// `FULL`: a commit that returned survives a power loss. The default.
    #[default]
    Full,
    /// `NORMAL`: a commit that returned survives a crash of the controller;
    /// the last commits may be lost on a power loss. The file stays
    /// consistent either way.
    Normal,
}

impl Synchronous {
    fn pragma_value(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// Options of [`SqliteJournal::open`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SqliteOptions {
    /// `PRAGMA synchronous`; [`Synchronous::Full`] by default.
    pub synchronous: Synchronous,
    /// How long a statement waits for a lock held by a reader such as a
    /// `sqlite3` shell; 5 s by default.
    pub busy_timeout: Duration,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            synchronous: Synchronous::Full,
            busy_timeout: Duration::from_secs(5),
        }
    }
}

/// The journal of one run in `<state_dir>/<run>.db`, SQLite in WAL mode,
/// one transaction per commit. It holds an exclusive `flock` on
/// `<state_dir>/<run>.lock` for its whole life, so a second controller for
/// the same run is refused with [`JournalError::Locked`]. Dropping it closes
/// the database, then releases the lock.
#[derive(Debug)]
pub struct SqliteJournal {
    // Field order is drop order: the checkpointer stops first, then the
    // connection closes (and checkpoints) before the lock is released.
    checkpointer: Option<Checkpointer>,
    conn: Connection,
    lock: Flock<File>,
    run: String,
    path: PathBuf,
    lock_path: PathBuf,
    stats: JournalStats,
}

const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

const SCHEMA: &str = "
CREATE TABLE run (
    id                  INTEGER PRIMARY KEY CHECK (id = 1),
    name                TEXT    NOT NULL,
    clean               INTEGER NOT NULL CHECK (clean IN (0, 1)),
    secret              BLOB,
    created_unix_ms     INTEGER NOT NULL,
    commits             INTEGER NOT NULL DEFAULT 0,
    last_commit_unix_ms INTEGER
);
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE nodes (
    node    TEXT    PRIMARY KEY,
    attempt INTEGER NOT NULL CHECK (attempt >= 0),
    stage   TEXT    NOT NULL,
    body    TEXT    NOT NULL
) WITHOUT ROWID;
";

const UPSERT_META: &str = "INSERT INTO meta (key, value) VALUES (?1, ?2) \
     ON CONFLICT (key) DO UPDATE SET value = excluded.value";
const UPSERT_NODE: &str = "INSERT INTO nodes (node, attempt, stage, body) VALUES (?1, ?2, ?3, ?4) \
     ON CONFLICT (node) DO UPDATE SET attempt = excluded.attempt, stage = excluded.stage, body = excluded.body";
const DELETE_NODE: &str = "DELETE FROM nodes WHERE node = ?1";
const MARK_UNCLEAN: &str = "UPDATE run SET clean = 0, commits = commits + 1, \
     last_commit_unix_ms = ?1 WHERE id = 1";

/// WAL bytes after which a commit asks the checkpoint thread to run.
const CHECKPOINT_AFTER_BYTES: u64 = 8 << 20;

/// WAL bytes after which a commit checkpoints itself (the thread is far
/// behind): the bound on the WAL's growth.
const CHECKPOINT_FORCE_BYTES: u64 = 256 << 20;

/// Copies the WAL into the database on a thread of its own, so a commit
/// only appends to the WAL. SQLite's automatic checkpoint would otherwise
/// run inside the commit that crossed its threshold, and for a large change
/// set that copy costs about as much as the commit itself. A `PASSIVE`
/// checkpoint never blocks the writer; the WAL restarts from its beginning
/// at the next commit after a complete one. Stopping closes the channel
/// and joins the thread.
#[derive(Debug)]
struct Checkpointer {
    poke: Option<SyncSender<()>>,
    thread: Option<JoinHandle<()>>,
    /// Bytes committed since the last finished checkpoint (approximate: the
    /// change sets' payload sizes).
    pending: Arc<AtomicU64>,
}

impl Checkpointer {
    /// Opens a second connection to `path` and starts the thread; `None`
    /// when either fails (SQLite's automatic checkpoints then stay on).
    fn start(path: &Path, opts: &SqliteOptions) -> Option<Checkpointer> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .ok()?;
        conn.busy_timeout(opts.busy_timeout).ok()?;
        conn.pragma_update(None, "wal_autocheckpoint", 0).ok()?;
        let (poke, pokes) = mpsc::sync_channel::<()>(1);
        let pending = Arc::new(AtomicU64::new(0));
        let seen = pending.clone();
        let thread = std::thread::Builder::new()
            .name("journal-checkpoint".to_owned())
            .spawn(move || {
                // Ends when the journal drops its sender.
                while pokes.recv().is_ok() {
                    let before = seen.load(Ordering::Acquire);
                    // A failed checkpoint is retried at the next poke; the
                    // commit path's forced checkpoint reports errors.
                    if conn
                        .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                        .is_ok()
                    {
                        let _ = seen.fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                            Some(now.saturating_sub(before))
                        });
                    }
                }
            })
            .ok()?;
        Some(Checkpointer {
            poke: Some(poke),
            thread: Some(thread),
            pending,
        })
    }

    /// Counts a commit of `bytes`, pokes the thread past
    /// [`CHECKPOINT_AFTER_BYTES`]. Returns whether the commit must
    /// checkpoint itself (past [`CHECKPOINT_FORCE_BYTES`]).
    fn committed(&self, bytes: u64) -> bool {
        let pending = self.pending.fetch_add(bytes, Ordering::AcqRel) + bytes;
        if pending >= CHECKPOINT_AFTER_BYTES
            && let Some(poke) = &self.poke
        {
            match poke.try_send(()) {
                Ok(()) | Err(TrySendError::Full(())) => {}
                Err(TrySendError::Disconnected(())) => return true,
            }
        }
        pending >= CHECKPOINT_FORCE_BYTES
    }

    /// The commit path checkpointed itself.
    fn caught_up(&self) {
        self.pending.store(0, Ordering::Release);
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.poke = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What inspecting an existing file found.
enum Inspection {
    /// A journal of this run, schema [`SCHEMA_VERSION`].
    Journal,
    /// An empty file or a SQLite database with nothing in it: initialise it.
    Blank,
}

impl SqliteJournal {
    /// Opens the journal of `run` in `state_dir`, creating the directory
    /// (mode 0700) and the state file (mode 0600) if they are missing.
    ///
    /// An existing file is first inspected read-only: it must be a SQLite
    /// database that passes `PRAGMA quick_check`, carries this crate's
    /// application id, a schema version no newer than [`SCHEMA_VERSION`] and
    /// the same run name. Otherwise the open is refused with an error naming
    /// the file, and the file is left as it was.
    pub fn open(
        state_dir: &Path,
        run: &str,
        opts: &SqliteOptions,
    ) -> Result<SqliteJournal, JournalError> {
        Self::open_inner(state_dir, run, opts, true)
    }

    /// Like [`SqliteJournal::open`], but fails with [`JournalError::NotFound`]
    /// instead of creating anything when the state file does not exist.
    pub fn open_existing(
        state_dir: &Path,
        run: &str,
        opts: &SqliteOptions,
    ) -> Result<SqliteJournal, JournalError> {
        Self::open_inner(state_dir, run, opts, false)
    }

    /// True when `state_dir` holds a state file for `run` (a valid name).
    pub fn exists(state_dir: &Path, run: &str) -> bool {
        state_file_path(state_dir, run).is_ok_and(|p| p.exists())
    }

    /// The state file, `<state_dir>/<run>.db`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The lock file, `<state_dir>/<run>.lock`.
    pub fn lock_path(&self) -> &Path {
        &self.lock_path
    }

    /// The run this journal belongs to.
    pub fn run(&self) -> &str {
        &self.run
    }

    fn open_inner(
        state_dir: &Path,
        run: &str,
        opts: &SqliteOptions,
        create: bool,
    ) -> Result<SqliteJournal, JournalError> {
        let path = state_file_path(state_dir, run)?;
        let lock_path = lock_file_path(state_dir, run)?;
        if !create && !path.exists() {
            return Err(JournalError::NotFound { path });
        }
        ensure_state_dir(state_dir)?;
        let lock = take_lock(&lock_path, run)?;

        let fresh = match fs::metadata(&path) {
            Ok(meta) if !meta.is_file() => {
                return Err(JournalError::Unreadable {
                    path,
                    source: io::Error::other("not a regular file"),
                });
            }
            Ok(meta) if meta.len() == 0 => true,
            Ok(_) => matches!(inspect(&path, run)?, Inspection::Blank),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if !create {
                    return Err(JournalError::NotFound { path });
                }
                create_private_file(&path)?;
                true
            }
            Err(source) => return Err(JournalError::Unreadable { path, source }),
        };

        let conn = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| map_sqlite(&path, "open it read-write", e))?;
        configure(&conn, &path, opts)?;
        if fresh {
            initialise(&conn, &path, run)?;
            sync_dir(state_dir)?;
        }
        let checkpointer = Checkpointer::start(&path, opts);
        if checkpointer.is_some() {
            conn.pragma_update(None, "wal_autocheckpoint", 0)
                .map_err(|e| map_sqlite(&path, "hand checkpoints to their thread", e))?;
        }
        Ok(SqliteJournal {
            checkpointer,
            conn,
            lock,
            run: run.to_owned(),
            path,
            lock_path,
            stats: JournalStats::default(),
        })
    }

    fn err(&self, action: &'static str) -> impl FnOnce(rusqlite::Error) -> JournalError + '_ {
        move |e| map_sqlite(&self.path, action, e)
    }

    fn update_run(
        &self,
        sql: &str,
        action: &'static str,
        value: &dyn rusqlite::ToSql,
    ) -> Result<(), JournalError> {
        let changed = self
            .conn
            .prepare_cached(sql)
            .and_then(|mut s| s.execute([value]))
            .map_err(self.err(action))?;
        if changed != 1 {
            return Err(self.missing_run_row());
        }
        Ok(())
    }

    fn missing_run_row(&self) -> JournalError {
        JournalError::Corrupt {
            path: self.path.clone(),
            problem: "the run table has no row".to_owned(),
        }
    }
}

impl Journal for SqliteJournal {
    fn load(&self) -> Result<Snapshot, JournalError> {
        let action = "read the journal";
        // One read transaction, so the tables are read at one point in time.
        let tx = self
            .conn
            .unchecked_transaction()
            .map_err(self.err(action))?;
        let (run, clean, secret): (String, i64, Option<Vec<u8>>) = tx
            .prepare_cached("SELECT name, clean, secret FROM run WHERE id = 1")
            .and_then(|mut s| {
                s.query_row([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                    .optional()
            })
            .map_err(self.err(action))?
            .ok_or_else(|| self.missing_run_row())?;

        let mut meta = BTreeMap::new();
        {
            let mut stmt = tx
                .prepare_cached("SELECT key, value FROM meta")
                .map_err(self.err(action))?;
            let rows = stmt
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
                .map_err(self.err(action))?;
            for row in rows {
                let (k, v) = row.map_err(self.err(action))?;
                meta.insert(k, v);
            }
        }

        let mut nodes = BTreeMap::new();
        {
            let mut stmt = tx
                .prepare_cached("SELECT node, attempt, stage, body FROM nodes")
                .map_err(self.err(action))?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, String>(3)?,
                    ))
                })
                .map_err(self.err(action))?;
            for row in rows {
                let (node, attempt, stage, body) = row.map_err(self.err(action))?;
                let attempt = u64::try_from(attempt).map_err(|_| JournalError::Corrupt {
                    path: self.path.clone(),
                    problem: format!("node `{node}` has a negative attempt {attempt}"),
                })?;
                nodes.insert(
                    node.clone(),
                    NodeRow {
                        node,
                        attempt,
                        stage,
                        body,
                    },
                );
            }
        }
        tx.finish().map_err(self.err(action))?;
        Ok(Snapshot {
            run,
            schema_version: SCHEMA_VERSION,
            clean: clean != 0,
            secret,
            meta,
            nodes,
        })
    }

    fn commit(&mut self, changes: &ChangeSet) -> Result<(), JournalError> {
        changes.validate()?;
        let path = &self.path;
        let action = "commit a change set";
        let e = |e| map_sqlite(path, action, e);
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(e)?;
        {
            if !changes.meta.is_empty() {
                let mut stmt = tx.prepare_cached(UPSERT_META).map_err(e)?;
                for (key, value) in &changes.meta {
                    stmt.execute(params![key, value]).map_err(e)?;
                }
            }
            if !changes.upserts.is_empty() {
                let mut stmt = tx.prepare_cached(UPSERT_NODE).map_err(e)?;
                // In the key order of the table's B-tree (text order, where
                // `g-10` sorts before `g-2`, unlike the driver's slot order):
                // each row then lands next to the previous one, so a large
                // change set fills pages in sequence instead of splitting
                // pages all over the tree.
                let mut rows: Vec<_> = changes.upserts.iter().collect();
                rows.sort_unstable_by(|a, b| a.node.as_bytes().cmp(b.node.as_bytes()));
                for row in rows {
                    // validate() bounded the attempt to i64::MAX.
                    let attempt = i64::try_from(row.attempt).unwrap_or(i64::MAX);
                    stmt.execute(params![row.node, attempt, row.stage, row.body])
                        .map_err(e)?;
                }
            }
            if !changes.deletes.is_empty() {
                let mut stmt = tx.prepare_cached(DELETE_NODE).map_err(e)?;
                for node in &changes.deletes {
                    stmt.execute([node]).map_err(e)?;
                }
            }
            let changed = tx
                .prepare_cached(MARK_UNCLEAN)
                .and_then(|mut s| s.execute([now_unix_ms()]))
                .map_err(e)?;
            if changed != 1 {
                // Dropping the transaction rolls it back.
                return Err(JournalError::Corrupt {
                    path: path.clone(),
                    problem: "the run table has no row".to_owned(),
                });
            }
        }
        tx.commit().map_err(e)?;
        self.stats.record(changes);
        if let Some(checkpointer) = &self.checkpointer
            && checkpointer.committed(changes.payload_bytes())
        {
            // The thread fell far behind: this commit waits for a checkpoint
            // so the WAL stays bounded.
            self.conn
                .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                .map_err(self.err("checkpoint the WAL"))?;
            checkpointer.caught_up();
        }
        Ok(())
    }

    fn set_secret(&mut self, secret: &[u8]) -> Result<(), JournalError> {
        self.update_run(
            "UPDATE run SET secret = ?1 WHERE id = 1",
            "store the secret",
            &secret,
        )
    }

    fn mark_clean(&mut self) -> Result<(), JournalError> {
        self.update_run(
            "UPDATE run SET clean = ?1 WHERE id = 1",
            "mark the state clean",
            &1_i64,
        )
    }

    fn stats(&self) -> JournalStats {
        self.stats
    }
}

impl SqliteJournal {
    /// The pid written into the lock file by this journal (this process).
    pub fn lock_holder_pid(&self) -> Option<u32> {
        let mut text = String::new();
        let mut file: &File = &self.lock;
        file.rewind().ok()?;
        file.read_to_string(&mut text).ok()?;
        text.trim().parse().ok()
    }
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// A SQLite error, as [`JournalError::Corrupt`] when SQLite says the file is
/// damaged or not a database.
fn map_sqlite(path: &Path, action: &'static str, e: rusqlite::Error) -> JournalError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => JournalError::Corrupt {
            path: path.to_owned(),
            problem: e.to_string(),
        },
        _ => JournalError::Sqlite {
            path: path.to_owned(),
            action,
            source: e,
        },
    }
}

fn ensure_state_dir(dir: &Path) -> Result<(), JournalError> {
    match fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(JournalError::StateDir {
            path: dir.to_owned(),
            action: "use it",
            source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
        }),
        Err(_) => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| JournalError::StateDir {
                    path: dir.to_owned(),
                    action: "create it",
                    source,
                })?;
            // The mode given to mkdir is masked by the umask; set it exactly.
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|source| {
                JournalError::StateDir {
                    path: dir.to_owned(),
                    action: "set its mode to 0700",
                    source,
                }
            })
        }
    }
}

/// Creates `path` with mode 0600 whatever the umask.
fn create_private_file(path: &Path) -> Result<File, JournalError> {
    let err = |action| {
        move |source| JournalError::StateDir {
            path: path.to_owned(),
            action,
            source,
        }
    };
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(err("create the state file"))?;
    file.set_permissions(fs::Permissions::from_mode(0o600))
        .map_err(err("set the state file's mode to 0600"))?;
    Ok(file)
}

fn take_lock(lock_path: &Path, run: &str) -> Result<Flock<File>, JournalError> {
    let err = |action| {
        move |source| JournalError::StateDir {
            path: lock_path.to_owned(),
            action,
            source,
        }
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(lock_path)
        .map_err(err("create the lock file"))?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((mut file, Errno::EWOULDBLOCK)) => {
            let mut text = String::new();
            let pid = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            return Err(JournalError::Locked {
                run: run.to_owned(),
                path: lock_path.to_owned(),
                pid,
            });
        }
        Err((_, errno)) => {
            return Err(JournalError::Io {
                path: lock_path.to_owned(),
                action: "lock the lock file",
                source: io::Error::from(errno),
            });
        }
    };
    let io_err = |action| {
        move |source| JournalError::Io {
            path: lock_path.to_owned(),
            action,
            source,
        }
    };
    lock.set_permissions(fs::Permissions::from_mode(0o600))
        .map_err(io_err("set the lock file's mode to 0600"))?;
    lock.set_len(0).map_err(io_err("truncate the lock file"))?;
    lock.rewind().map_err(io_err("rewind the lock file"))?;
    writeln!(lock, "{}", std::process::id()).map_err(io_err("write the pid into the lock file"))?;
    Ok(lock)
}

/// Looks at an existing, non-empty file without changing it: first its
/// header by hand, then through a read-only SQLite connection.
fn inspect(path: &Path, run: &str) -> Result<Inspection, JournalError> {
    let mut header = Vec::with_capacity(100);
    File::open(path)
        .and_then(|f| f.take(100).read_to_end(&mut header))
        .map_err(|source| JournalError::Unreadable {
            path: path.to_owned(),
            source,
        })?;
    if header.len() < 100 || !header.starts_with(SQLITE_MAGIC) {
        return Err(JournalError::Corrupt {
            path: path.to_owned(),
            problem: "not a SQLite database (no SQLite header)".to_owned(),
        });
    }
    let be = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    check_ids(path, be(60), be(68) as i32)?;

    let corrupt = |problem: String| JournalError::Corrupt {
        path: path.to_owned(),
        problem,
    };
    let ro = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| map_sqlite(path, "open it read-only", e))?;
    let sql = |action| move |e| map_sqlite(path, action, e);

    let mut problems = Vec::new();
    {
        let mut stmt = ro
            .prepare("PRAGMA quick_check(5)")
            .map_err(sql("check its integrity"))?;
        let rows = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(sql("check its integrity"))?;
        for row in rows {
            problems.push(row.map_err(sql("check its integrity"))?);
        }
    }
    if problems != ["ok"] {
        return Err(corrupt(format!(
            "integrity check failed: {}",
            problems.join("; ")
        )));
    }

    let user_version: i64 = ro
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(sql("read its schema version"))?;
    let application_id: i64 = ro
        .pragma_query_value(None, "application_id", |r| r.get(0))
        .map_err(sql("read its application id"))?;
    // Both pragmas are 32-bit header fields; SQLite reports them signed.
    check_ids(path, user_version as u32, application_id as i32)?;

    if user_version == 0 && application_id == 0 {
        let objects: i64 = ro
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .map_err(sql("list its tables"))?;
        if objects == 0 {
            return Ok(Inspection::Blank);
        }
    }
    if application_id as i32 != APPLICATION_ID {
        return Err(JournalError::Foreign {
            path: path.to_owned(),
            problem: format!("application id {application_id:#x}, expected {APPLICATION_ID:#x}"),
        });
    }
    if user_version as u32 != SCHEMA_VERSION {
        return Err(corrupt(format!(
            "schema version {user_version}, expected {SCHEMA_VERSION}"
        )));
    }
    for probe in [
        "SELECT id, name, clean, secret, created_unix_ms, commits, last_commit_unix_ms FROM run LIMIT 0",
        "SELECT key, value FROM meta LIMIT 0",
        "SELECT node, attempt, stage, body FROM nodes LIMIT 0",
    ] {
        ro.prepare(probe)
            .map_err(|e| corrupt(format!("unexpected schema: {e}")))?;
    }
    let found: Option<String> = ro
        .query_row("SELECT name FROM run WHERE id = 1", [], |r| r.get(0))
        .optional()
        .map_err(sql("read its run name"))?;
    match found {
        None => Err(corrupt("the run table has no row".to_owned())),
        Some(found) if found != run => Err(JournalError::WrongRun {
            path: path.to_owned(),
            expected: run.to_owned(),
            found,
        }),
        Some(_) => Ok(Inspection::Journal),
    }
}

/// Refuses a newer schema or another program's application id.
fn check_ids(path: &Path, user_version: u32, application_id: i32) -> Result<(), JournalError> {
    if application_id != 0 && application_id != APPLICATION_ID {
        return Err(JournalError::Foreign {
            path: path.to_owned(),
            problem: format!("application id {application_id:#x}, expected {APPLICATION_ID:#x}"),
        });
    }
    if user_version > SCHEMA_VERSION {
        return Err(JournalError::NewerSchema {
            path: path.to_owned(),
            found: user_version,
            supported: SCHEMA_VERSION,
        });
    }
    Ok(())
}

fn configure(conn: &Connection, path: &Path, opts: &SqliteOptions) -> Result<(), JournalError> {
    conn.busy_timeout(opts.busy_timeout)
        .map_err(|e| map_sqlite(path, "set the busy timeout", e))?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .map_err(|e| map_sqlite(path, "switch to WAL mode", e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(JournalError::Io {
            path: path.to_owned(),
            action: "switch to WAL mode",
            source: io::Error::other(format!("SQLite kept journal_mode {mode}")),
        });
    }
    conn.pragma_update(None, "synchronous", opts.synchronous.pragma_value())
        .map_err(|e| map_sqlite(path, "set synchronous", e))?;
    // A 32 MiB page cache keeps a large first commit from spilling pages to
    // the WAL before it commits.
    conn.pragma_update(None, "cache_size", -32_768)
        .map_err(|e| map_sqlite(path, "set the cache size", e))?;
    Ok(())
}

fn initialise(conn: &Connection, path: &Path, run: &str) -> Result<(), JournalError> {
    let e = |e| map_sqlite(path, "create the schema", e);
    let tx = conn.unchecked_transaction().map_err(e)?;
    tx.execute_batch(SCHEMA).map_err(e)?;
    tx.execute(
        "INSERT INTO run (id, name, clean, secret, created_unix_ms) VALUES (1, ?1, 1, NULL, ?2)",
        params![run, now_unix_ms()],
    )
    .map_err(e)?;
    tx.pragma_update(None, "application_id", APPLICATION_ID)
        .map_err(e)?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
        .map_err(e)?;
    tx.commit().map_err(e)
}

/// Makes a newly created file's directory entry durable.
fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| JournalError::Io {
            path: dir.to_owned(),
            action: "sync the state directory",
            source,
        })
}
