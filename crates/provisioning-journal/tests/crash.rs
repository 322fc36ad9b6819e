//! A controller process that dies without closing its journal: the lock goes
//! with it, and what it committed is there for the next one.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use provisioning_journal::{
    ChangeSet, Journal, JournalError, NodeRow, SqliteJournal, SqliteOptions,
};

const CHILD_DIR: &str = "PROVISIONING_JOURNAL_CRASH_CHILD_DIR";
const COMMITTED: &str = "<<journal-child-committed>>";

/// Kills the child if the test fails before it does.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn row(node: &str, attempt: u64) -> NodeRow {
    NodeRow {
        node: node.to_owned(),
        attempt,
        stage: "pending".to_owned(),
        body: "{}".to_owned(),
    }
}

/// The child's side of `a_killed_controller_releases_its_lock_and_keeps_its_commits`:
/// it does nothing unless that test started this binary as its child.
#[test]
fn crash_child_entry_point() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let mut j = SqliteJournal::open(Path::new(&dir), "r", &SqliteOptions::default()).unwrap();
    j.commit(&ChangeSet {
        meta: vec![("generation".into(), "3".into())],
        upserts: vec![row("g-0", 1), row("g-1", 2)],
        deletes: vec![],
    })
    .unwrap();
    j.commit(&ChangeSet {
        upserts: vec![row("g-1", 3)],
        ..ChangeSet::default()
    })
    .unwrap();
    // libtest has already printed "test crash_child_entry_point ... " on
    // this line, so the parent looks for the marker anywhere in a line.
    println!("{COMMITTED}");
    std::io::stdout().flush().unwrap();
    // Wait to be killed; stdin closes only if the parent died first.
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn a_killed_controller_releases_its_lock_and_keeps_its_commits() {
    if std::env::var_os(CHILD_DIR).is_some() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_child_entry_point",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, tmp.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let pid = child.0.id();
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert_ne!(
            out.read_line(&mut line).unwrap(),
            0,
            "the child exited early"
        );
        if line.contains(COMMITTED) {
            break;
        }
    }

    let err = SqliteJournal::open(tmp.path(), "r", &SqliteOptions::default()).unwrap_err();
    assert!(
        matches!(&err, JournalError::Locked { pid: Some(p), .. } if *p == pid),
        "{err}"
    );
    assert!(err.to_string().contains(&format!("(pid {pid})")), "{err}");

    child.0.kill().unwrap(); // SIGKILL: no destructor runs
    child.0.wait().unwrap();
    assert!(
        tmp.path().join("r.db-wal").exists(),
        "the WAL was left behind"
    );

    let j = SqliteJournal::open(tmp.path(), "r", &SqliteOptions::default()).unwrap();
    let snap = j.load().unwrap();
    assert!(!snap.clean);
    assert_eq!(snap.meta["generation"], "3");
    assert_eq!(snap.nodes["g-0"], row("g-0", 1));
    assert_eq!(snap.nodes["g-1"], row("g-1", 3));
    assert_eq!(j.lock_holder_pid(), Some(std::process::id()));
}
