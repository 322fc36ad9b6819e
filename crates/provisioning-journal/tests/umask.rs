//! Modes do not depend on the umask. One test alone in its binary, because
//! the umask belongs to the whole process.

use std::fs;
use std::os::unix::fs::PermissionsExt;

use nix::sys::stat::{Mode, umask};
use provisioning_journal::{ChangeSet, Journal, NodeRow, SqliteJournal, SqliteOptions};

#[test]
fn modes_are_0700_and_0600_under_a_hostile_umask() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a").join("state");
    // Masks the owner's write and execute bits and everything of others:
    // mkdir(0700) would give 0500 and open(0600) 0400.
    let old = umask(Mode::from_bits_truncate(0o277));
    let opened = SqliteJournal::open(&dir, "r", &SqliteOptions::default());
    let mut j = opened.unwrap();
    j.commit(&ChangeSet {
        upserts: vec![NodeRow {
            node: "g-0".into(),
            attempt: 1,
            stage: "s".into(),
            body: "{}".into(),
        }],
        ..ChangeSet::default()
    })
    .unwrap();
    umask(old);
    let mode = |p: &std::path::Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&dir), 0o700);
    for name in ["r.db", "r.db-wal", "r.db-shm", "r.lock"] {
        assert_eq!(mode(&dir.join(name)), 0o600, "{name}");
    }
    drop(j);
    let j = SqliteJournal::open(&dir, "r", &SqliteOptions::default()).unwrap();
    assert_eq!(j.load().unwrap().nodes.len(), 1);
}
