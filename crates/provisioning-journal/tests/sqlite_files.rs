//! The SQLite journal as files on disk: layout, modes, the lock, atomicity,
//! and refusing bad state without touching it.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use provisioning_journal::{
    APPLICATION_ID, ChangeSet, Journal, JournalError, NodeRow, SCHEMA_VERSION, SqliteJournal,
    SqliteOptions, Synchronous,
};
use rusqlite::Connection;

fn opts() -> SqliteOptions {
    SqliteOptions::default()
}

fn open(dir: &Path, run: &str) -> Result<SqliteJournal, JournalError> {
    SqliteJournal::open(dir, run, &opts())
}

fn row(node: &str, attempt: u64) -> NodeRow {
    NodeRow {
        node: node.to_owned(),
        attempt,
        stage: "leased".to_owned(),
        body: format!(r#"{{"attempt":{attempt}}}"#),
    }
}

fn upserts(rows: Vec<NodeRow>) -> ChangeSet {
    ChangeSet {
        upserts: rows,
        ..ChangeSet::default()
    }
}

fn mode(path: &Path) -> u32 {
    fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// Every file in `dir` with its bytes, to show that nothing changed.
fn dir_contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

/// A closed, checkpointed journal of `run` with one node.
fn make_journal(dir: &Path, run: &str) -> PathBuf {
    let mut j = open(dir, run).unwrap();
    j.commit(&upserts(vec![row("g-0", 1)])).unwrap();
    j.path().to_owned()
}

#[test]
fn the_state_file_is_named_after_the_run_in_the_state_dir_and_created_with_missing_parents() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("xdg").join("provision");
    let j = open(&dir, "prod-1").unwrap();
    assert_eq!(j.path(), dir.join("prod-1.db"));
    assert_eq!(j.lock_path(), dir.join("prod-1.lock"));
    assert_eq!(j.run(), "prod-1");
    assert!(SqliteJournal::exists(&dir, "prod-1"));
    assert!(!SqliteJournal::exists(&dir, "other"));
    assert!(!SqliteJournal::exists(&dir, "../prod-1"));
}

#[test]
fn the_state_dir_is_0700_and_the_state_wal_shm_and_lock_files_are_0600() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let mut j = open(&dir, "r").unwrap();
    j.commit(&upserts(vec![row("g-0", 1)])).unwrap();
    assert_eq!(mode(&dir), 0o700);
    for name in ["r.db", "r.db-wal", "r.db-shm", "r.lock"] {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
    }
}

#[test]
fn the_file_follows_the_documented_schema_version_1() {
    let tmp = tempfile::tempdir().unwrap();
    let path = make_journal(tmp.path(), "r");
    let c = Connection::open(&path).unwrap();
    let pragma = |name: &str| -> i64 { c.pragma_query_value(None, name, |r| r.get(0)).unwrap() };
    assert_eq!(pragma("user_version"), i64::from(SCHEMA_VERSION));
    assert_eq!(pragma("application_id"), i64::from(APPLICATION_ID));
    let mode: String = c
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let columns = |table: &str| -> Vec<String> {
        let mut s = c
            .prepare(&format!("SELECT name FROM pragma_table_info('{table}')"))
            .unwrap();
        s.query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    assert_eq!(
        columns("run"),
        [
            "id",
            "name",
            "clean",
            "secret",
            "created_unix_ms",
            "commits",
            "last_commit_unix_ms"
        ]
    );
    assert_eq!(columns("meta"), ["key", "value"]);
    assert_eq!(columns("nodes"), ["node", "attempt", "stage", "body"]);
    let (name, clean, commits): (String, i64, i64) = c
        .query_row("SELECT name, clean, commits FROM run", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap();
    assert_eq!((name.as_str(), clean, commits), ("r", 0, 1));
    let body: String = c
        .query_row("SELECT body FROM nodes WHERE node = 'g-0'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(body, r#"{"attempt":1}"#);
}

#[test]
fn a_failed_commit_leaves_nothing_behind_after_a_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut j = open(dir, "r").unwrap();
    j.commit(&upserts(vec![row("g-0", 1)])).unwrap();
    // A trigger that aborts on one row makes the commit fail half-way
    // through its transaction, after other rows were written in it.
    Connection::open(j.path())
        .unwrap()
        .execute_batch(
            "CREATE TRIGGER poison BEFORE INSERT ON nodes WHEN NEW.node = 'poison' \
             BEGIN SELECT RAISE(ABORT, 'poisoned row'); END;",
        )
        .unwrap();
    let err = j
        .commit(&ChangeSet {
            meta: vec![("generation".into(), "2".into())],
            upserts: vec![row("g-1", 1), row("poison", 1), row("g-2", 1)],
            deletes: vec!["g-0".into()],
        })
        .unwrap_err();
    assert!(matches!(err, JournalError::Sqlite { .. }), "{err}");
    assert!(err.to_string().contains("r.db"), "{err}");
    assert_eq!(j.stats().commits, 1);
    j.mark_clean().unwrap();
    drop(j);
    let snap = open(dir, "r").unwrap().load().unwrap();
    assert!(snap.meta.is_empty());
    let ids: Vec<_> = snap.nodes.keys().map(String::as_str).collect();
    assert_eq!(ids, ["g-0"]);
    assert!(
        snap.clean,
        "the failed commit did not mark the state unclean"
    );
}

#[test]
fn synchronous_normal_is_accepted_and_commits_survive_a_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let normal = SqliteOptions {
        synchronous: Synchronous::Normal,
        ..SqliteOptions::default()
    };
    let mut j = SqliteJournal::open(tmp.path(), "r", &normal).unwrap();
    j.commit(&upserts(vec![row("g-0", 7)])).unwrap();
    drop(j);
    let j = SqliteJournal::open_existing(tmp.path(), "r", &opts()).unwrap();
    assert_eq!(j.load().unwrap().nodes["g-0"].attempt, 7);
}

#[test]
fn a_second_open_of_the_same_run_is_refused_naming_the_run_pid_and_lock_file() {
    let tmp = tempfile::tempdir().unwrap();
    let first = open(tmp.path(), "r").unwrap();
    assert_eq!(first.lock_holder_pid(), Some(std::process::id()));
    let err = open(tmp.path(), "r").unwrap_err();
    let lock = tmp.path().join("r.lock");
    match &err {
        JournalError::Locked { run, path, pid } => {
            assert_eq!(run, "r");
            assert_eq!(path, &lock);
            assert_eq!(*pid, Some(std::process::id()));
        }
        other => panic!("expected Locked, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("another controller for run `r` is running"),
        "{text}"
    );
    assert!(
        text.contains(&format!("pid {}", std::process::id())),
        "{text}"
    );
    assert!(text.contains(&lock.display().to_string()), "{text}");
    // The refused open changed nothing of the first one's.
    assert_eq!(first.lock_holder_pid(), Some(std::process::id()));
    assert!(first.load().unwrap().is_blank());
}

#[test]
fn the_lock_is_released_when_the_journal_is_dropped() {
    let tmp = tempfile::tempdir().unwrap();
    let first = open(tmp.path(), "r").unwrap();
    assert!(open(tmp.path(), "r").is_err());
    drop(first);
    let second = open(tmp.path(), "r").unwrap();
    assert_eq!(second.lock_holder_pid(), Some(std::process::id()));
}

#[test]
fn runs_in_one_state_dir_are_independent() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = open(tmp.path(), "a").unwrap();
    let mut b = open(tmp.path(), "b").unwrap();
    a.commit(&upserts(vec![row("g-0", 1)])).unwrap();
    b.commit(&upserts(vec![row("h-0", 2)])).unwrap();
    assert!(a.load().unwrap().nodes.contains_key("g-0"));
    assert!(!a.load().unwrap().nodes.contains_key("h-0"));
    assert_eq!(b.load().unwrap().run, "b");
}

#[test]
fn open_existing_refuses_a_missing_state_file_and_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let err = SqliteJournal::open_existing(&dir, "r", &opts()).unwrap_err();
    assert!(matches!(&err, JournalError::NotFound { path } if path == &dir.join("r.db")));
    assert!(err.to_string().contains("r.db"), "{err}");
    assert!(!dir.exists());
}

#[test]
fn a_run_name_that_could_escape_the_state_dir_is_refused_before_any_file_is_made() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    for bad in ["../escape", "a/b", "/abs", "..", "", ".hidden", "x\0y"] {
        let err = open(&dir, bad).unwrap_err();
        assert!(
            matches!(err, JournalError::InvalidRunName { .. }),
            "{bad}: {err}"
        );
    }
    assert!(!dir.exists());
    assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn a_zero_byte_state_file_left_by_a_crash_during_creation_is_initialised() {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("r.db"), b"").unwrap();
    let mut j = open(tmp.path(), "r").unwrap();
    j.commit(&upserts(vec![row("g-0", 1)])).unwrap();
    drop(j);
    assert_eq!(
        open(tmp.path(), "r").unwrap().load().unwrap().nodes.len(),
        1
    );
}

#[test]
fn a_state_file_of_garbage_is_refused_naming_the_file_and_left_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("r.db");
    let garbage: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    fs::write(&path, &garbage).unwrap();
    let before = dir_contents(tmp.path());
    let err = open(tmp.path(), "r").unwrap_err();
    assert!(
        matches!(&err, JournalError::Corrupt { path: p, .. } if p == &path),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains("not a SQLite database"), "{text}");
    assert_eq!(fs::read(&path).unwrap(), garbage);
    // Only the lock file was added; no -wal or -shm appeared.
    let after: Vec<_> = dir_contents(tmp.path())
        .into_iter()
        .filter(|(p, _)| p.extension().is_none_or(|e| e != "lock"))
        .collect();
    assert_eq!(after, before);
    // The lock is not kept after a refused open.
    assert!(matches!(
        open(tmp.path(), "r").unwrap_err(),
        JournalError::Corrupt { .. }
    ));
}

#[test]
fn a_journal_with_a_damaged_page_fails_its_integrity_check_and_is_left_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let path = {
        let mut j = open(tmp.path(), "r").unwrap();
        j.commit(&upserts(
            (0..2000).map(|i| row(&format!("g-{i}"), i)).collect(),
        ))
        .unwrap();
        j.path().to_owned()
    };
    assert!(!tmp.path().join("r.db-wal").exists(), "closed cleanly");
    let mut bytes = fs::read(&path).unwrap();
    let page = 4096;
    assert!(bytes.len() > 6 * page);
    for b in &mut bytes[3 * page..5 * page] {
        *b = 0xA5;
    }
    fs::write(&path, &bytes).unwrap();
    let err = open(tmp.path(), "r").unwrap_err();
    assert!(
        matches!(&err, JournalError::Corrupt { path: p, .. } if p == &path),
        "{err}"
    );
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert_eq!(fs::read(&path).unwrap(), bytes);
}

#[test]
fn a_newer_schema_version_is_refused_and_the_file_is_left_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let path = make_journal(tmp.path(), "r");
    Connection::open(&path)
        .unwrap()
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let before = fs::read(&path).unwrap();
    let err = open(tmp.path(), "r").unwrap_err();
    match &err {
        JournalError::NewerSchema {
            path: p,
            found,
            supported,
        } => {
            assert_eq!(p, &path);
            assert_eq!(*found, SCHEMA_VERSION + 1);
            assert_eq!(*supported, SCHEMA_VERSION);
        }
        other => panic!("expected NewerSchema, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains("schema version 2, newer than 1"), "{text}");
    assert_eq!(fs::read(&path).unwrap(), before);
}

#[test]
fn a_newer_schema_version_still_in_the_wal_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = make_journal(tmp.path(), "r");
    // Keep the bump in the WAL: a reader stays open so the writer's close
    // does not checkpoint, and the header of the main file still says 1.
    let reader = Connection::open(&path).unwrap();
    let writer = Connection::open(&path).unwrap();
    writer
        .execute_batch("PRAGMA wal_autocheckpoint = 0; PRAGMA user_version = 7;")
        .unwrap();
    let err = open(tmp.path(), "r").unwrap_err();
    assert!(
        matches!(err, JournalError::NewerSchema { found: 7, .. }),
        "{err}"
    );
    drop((reader, writer));
}

#[test]
fn a_state_file_of_another_run_is_refused_and_left_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let a = make_journal(tmp.path(), "a");
    let b = tmp.path().join("b.db");
    fs::copy(&a, &b).unwrap();
    let before = fs::read(&b).unwrap();
    let err = open(tmp.path(), "b").unwrap_err();
    match &err {
        JournalError::WrongRun {
            path,
            expected,
            found,
        } => {
            assert_eq!(path, &b);
            assert_eq!((expected.as_str(), found.as_str()), ("b", "a"));
        }
        other => panic!("expected WrongRun, got {other:?}"),
    }
    assert!(
        err.to_string().contains("belongs to run `a`, not `b`"),
        "{err}"
    );
    assert_eq!(fs::read(&b).unwrap(), before);
}

#[test]
fn a_sqlite_file_of_another_program_is_refused_and_left_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("r.db");
    Connection::open(&path)
        .unwrap()
        .execute_batch(
            "CREATE TABLE photos (id INTEGER PRIMARY KEY); INSERT INTO photos VALUES (1);",
        )
        .unwrap();
    let before = fs::read(&path).unwrap();
    let err = open(tmp.path(), "r").unwrap_err();
    assert!(
        matches!(&err, JournalError::Foreign { path: p, .. } if p == &path),
        "{err}"
    );
    assert!(
        err.to_string().contains("not a provisioning journal"),
        "{err}"
    );
    assert_eq!(fs::read(&path).unwrap(), before);
    assert_eq!(
        Connection::open(&path)
            .unwrap()
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r
                .get::<_, i64>(0))
            .unwrap(),
        1
    );

    let other_app = tmp.path().join("s.db");
    Connection::open(&other_app)
        .unwrap()
        .pragma_update(None, "application_id", 42)
        .unwrap();
    let err = open(tmp.path(), "s").unwrap_err();
    assert!(matches!(err, JournalError::Foreign { .. }), "{err}");
}

#[test]
fn an_unreadable_state_file_is_refused_naming_it() {
    // Tests run as root, where modes do not stop reads; a directory where
    // the file should be cannot be read as a database either.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("r.db");
    fs::create_dir(&path).unwrap();
    fs::write(path.join("keep"), b"x").unwrap();
    let err = open(tmp.path(), "r").unwrap_err();
    assert!(
        matches!(&err, JournalError::Unreadable { path: p, .. } if p == &path),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(text.contains("cannot be read"), "{text}");
    assert_eq!(fs::read(path.join("keep")).unwrap(), b"x");
}

#[test]
fn a_state_dir_that_cannot_be_created_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    fs::write(&file, b"not a directory").unwrap();

    let under_file = file.join("state");
    let err = open(&under_file, "r").unwrap_err();
    assert!(
        matches!(&err, JournalError::StateDir { path, action: "create it", .. } if path == &under_file),
        "{err:?}"
    );
    assert!(
        err.to_string().starts_with(&format!(
            "state directory {}: cannot create it",
            under_file.display()
        )),
        "{err}"
    );

    let err = open(&file, "r").unwrap_err();
    assert!(
        matches!(&err, JournalError::StateDir { path, .. } if path == &file),
        "{err:?}"
    );
    assert!(err.to_string().contains("not a directory"), "{err}");
    assert_eq!(fs::read(&file).unwrap(), b"not a directory");
}
