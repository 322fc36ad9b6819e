//! The journal contract, run against both implementations: what a commit
//! stores, what survives a crash (dropping the journal) and a reopen.

use std::path::Path;

use provisioning_journal::{
    ChangeSet, Journal, JournalError, JournalStats, MAX_ATTEMPT, MemoryJournal, MemoryStore,
    NodeRow, SCHEMA_VERSION, SqliteJournal, SqliteOptions,
};

fn row(node: &str, attempt: u64, stage: &str) -> NodeRow {
    NodeRow {
        node: node.to_owned(),
        attempt,
        stage: stage.to_owned(),
        body: format!(r#"{{"node":"{node}","attempt":{attempt}}}"#),
    }
}

fn meta(key: &str, value: &str) -> (String, String) {
    (key.to_owned(), value.to_owned())
}

/// Opens (or reopens) the journal under test on the same committed data.
type Reopen<'a> = dyn FnMut() -> Box<dyn Journal> + 'a;

fn with_both(scenario: impl Fn(&mut Reopen<'_>)) {
    let store = MemoryStore::new("r1").unwrap();
    scenario(&mut || Box::new(MemoryJournal::reopen(&store).unwrap()));

    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    scenario(&mut || Box::new(open_sqlite(&state_dir)));
}

fn open_sqlite(state_dir: &Path) -> SqliteJournal {
    SqliteJournal::open(state_dir, "r1", &SqliteOptions::default()).unwrap()
}

#[test]
fn a_new_journal_is_empty_and_clean() {
    with_both(|reopen| {
        let snap = reopen().load().unwrap();
        assert_eq!(snap.run, "r1");
        assert_eq!(snap.schema_version, SCHEMA_VERSION);
        assert!(snap.clean);
        assert_eq!(snap.secret, None);
        assert!(snap.is_blank());
    });
}

#[test]
fn commits_round_trip_through_load_and_reopen() {
    with_both(|reopen| {
        let mut j = reopen();
        j.commit(&ChangeSet {
            meta: vec![meta("generation", "1"), meta("shape", r#"{"groups":[]}"#)],
            upserts: vec![row("g-0", 1, "leased"), row("g-1", 2, "pending")],
            deletes: vec![],
        })
        .unwrap();
        j.commit(&ChangeSet {
            meta: vec![],
            upserts: vec![row("g-1", 3, "joined")],
            deletes: vec![],
        })
        .unwrap();
        let live = j.load().unwrap();
        drop(j);
        let snap = reopen().load().unwrap();
        assert_eq!(snap, live);
        assert!(!snap.clean);
        assert_eq!(snap.meta["generation"], "1");
        assert_eq!(snap.meta["shape"], r#"{"groups":[]}"#);
        assert_eq!(snap.nodes.len(), 2);
        assert_eq!(snap.nodes["g-0"], row("g-0", 1, "leased"));
        assert_eq!(snap.nodes["g-1"], row("g-1", 3, "joined"));
    });
}

#[test]
fn meta_entries_are_upserted_by_key() {
    with_both(|reopen| {
        let mut j = reopen();
        j.commit(&ChangeSet {
            meta: vec![meta("a", "1"), meta("b", "2")],
            ..ChangeSet::default()
        })
        .unwrap();
        j.commit(&ChangeSet {
            meta: vec![meta("a", "10"), meta("c", "3"), meta("c", "30")],
            ..ChangeSet::default()
        })
        .unwrap();
        drop(j);
        let snap = reopen().load().unwrap();
        let got: Vec<_> = snap
            .meta
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(got, [("a", "10"), ("b", "2"), ("c", "30")]);
    });
}

#[test]
fn deletes_remove_nodes_are_applied_after_upserts_and_tolerate_missing_ids() {
    with_both(|reopen| {
        let mut j = reopen();
        j.commit(&ChangeSet {
            upserts: vec![row("g-0", 1, "a"), row("g-1", 1, "a"), row("g-2", 1, "a")],
            ..ChangeSet::default()
        })
        .unwrap();
        j.commit(&ChangeSet {
            meta: vec![],
            upserts: vec![row("g-2", 2, "b"), row("g-3", 1, "a")],
            deletes: vec!["g-0".into(), "g-2".into(), "never-there".into()],
        })
        .unwrap();
        drop(j);
        let snap = reopen().load().unwrap();
        let ids: Vec<_> = snap.nodes.keys().map(String::as_str).collect();
        assert_eq!(ids, ["g-1", "g-3"]);
    });
}

#[test]
fn the_secret_is_stored_replaced_and_leaves_the_clean_flag_alone() {
    with_both(|reopen| {
        let mut j = reopen();
        j.set_secret(&[0, 1, 2, 255]).unwrap();
        assert!(j.load().unwrap().clean);
        drop(j);
        assert_eq!(reopen().load().unwrap().secret, Some(vec![0, 1, 2, 255]));
        let mut j = reopen();
        j.set_secret(b"second").unwrap();
        drop(j);
        let snap = reopen().load().unwrap();
        assert_eq!(snap.secret.as_deref(), Some(&b"second"[..]));
        assert!(snap.clean);
    });
}

#[test]
fn mark_clean_survives_a_reopen_and_the_next_commit_makes_it_unclean_again() {
    with_both(|reopen| {
        let mut j = reopen();
        j.commit(&ChangeSet {
            upserts: vec![row("g-0", 1, "a")],
            ..ChangeSet::default()
        })
        .unwrap();
        assert!(!j.load().unwrap().clean);
        j.mark_clean().unwrap();
        drop(j);
        let mut j = reopen();
        let snap = j.load().unwrap();
        assert!(snap.clean);
        assert_eq!(snap.nodes.len(), 1, "mark_clean keeps the data");
        // Even an empty change set is a commit: the run is live again.
        j.commit(&ChangeSet::new()).unwrap();
        drop(j);
        assert!(!reopen().load().unwrap().clean);
    });
}

#[test]
fn an_attempt_beyond_the_storable_range_is_refused_and_nothing_is_written() {
    with_both(|reopen| {
        let mut j = reopen();
        let err = j
            .commit(&ChangeSet {
                meta: vec![meta("k", "1")],
                upserts: vec![row("g-0", 1, "a"), row("g-1", MAX_ATTEMPT + 1, "a")],
                deletes: vec![],
            })
            .unwrap_err();
        assert!(
            matches!(&err, JournalError::AttemptOutOfRange { node, .. } if node == "g-1"),
            "{err}"
        );
        assert_eq!(j.stats(), JournalStats::default());
        j.commit(&ChangeSet {
            upserts: vec![row("g-0", MAX_ATTEMPT, "a")],
            ..ChangeSet::default()
        })
        .unwrap();
        drop(j);
        let snap = reopen().load().unwrap();
        assert!(snap.meta.is_empty());
        assert_eq!(snap.nodes["g-0"].attempt, MAX_ATTEMPT);
        assert_eq!(snap.nodes.len(), 1);
    });
}

#[test]
fn stats_count_commits_rows_and_payload_bytes_of_this_handle() {
    with_both(|reopen| {
        let mut j = reopen();
        let a = ChangeSet {
            meta: vec![meta("key", "value")],
            upserts: vec![row("g-0", 1, "stage")],
            deletes: vec!["g-9".into()],
        };
        j.commit(&a).unwrap();
        j.commit(&ChangeSet::new()).unwrap();
        j.set_secret(b"not counted").unwrap();
        j.mark_clean().unwrap();
        assert_eq!(
            j.stats(),
            JournalStats {
                commits: 2,
                rows_written: 3,
                bytes_written: a.payload_bytes(),
            }
        );
        drop(j);
        assert_eq!(reopen().stats(), JournalStats::default());
    });
}

#[test]
fn text_is_stored_byte_for_byte() {
    with_both(|reopen| {
        let odd =
            "quote ' double \" nul \0 newline \n unicode \u{1F980} and ; DROP TABLE nodes; --";
        let mut j = reopen();
        j.commit(&ChangeSet {
            meta: vec![meta(odd, odd)],
            upserts: vec![NodeRow {
                node: odd.into(),
                attempt: 0,
                stage: odd.into(),
                body: odd.into(),
            }],
            deletes: vec![],
        })
        .unwrap();
        drop(j);
        let snap = reopen().load().unwrap();
        assert_eq!(snap.meta[odd], odd);
        let r = &snap.nodes[odd];
        assert_eq!(
            (r.node.as_str(), r.stage.as_str(), r.body.as_str()),
            (odd, odd, odd)
        );
    });
}

#[test]
fn many_passes_and_a_large_commit_load_back_exactly() {
    with_both(|reopen| {
        let mut j = reopen();
        let big = ChangeSet {
            upserts: (0..5000)
                .map(|i| row(&format!("big-{i}"), i, "leased"))
                .collect(),
            ..ChangeSet::default()
        };
        j.commit(&big).unwrap();
        for pass in 0..50u64 {
            j.commit(&ChangeSet {
                meta: vec![meta("pass", &pass.to_string())],
                upserts: (0..10)
                    .map(|i| row(&format!("big-{i}"), pass + 100, "joined"))
                    .collect(),
                deletes: vec![format!("big-{}", 1000 + pass)],
            })
            .unwrap();
        }
        drop(j);
        let snap = reopen().load().unwrap();
        assert_eq!(snap.nodes.len(), 5000 - 50);
        assert_eq!(snap.meta["pass"], "49");
        assert_eq!(snap.nodes["big-3"], row("big-3", 149, "joined"));
        assert_eq!(snap.nodes["big-4999"], row("big-4999", 4999, "leased"));
        assert!(!snap.nodes.contains_key("big-1010"));
    });
}

#[test]
fn the_memory_journal_keeps_only_committed_data_after_a_crash() {
    let mut j = MemoryJournal::new("r1").unwrap();
    let store = j.storage();
    j.commit(&ChangeSet {
        upserts: vec![row("g-0", 1, "a")],
        ..ChangeSet::default()
    })
    .unwrap();
    store.fail_next_commit();
    let err = j
        .commit(&ChangeSet {
            meta: vec![meta("k", "v")],
            upserts: vec![row("g-1", 1, "a")],
            deletes: vec!["g-0".into()],
        })
        .unwrap_err();
    assert!(matches!(err, JournalError::Injected));
    assert_eq!(j.stats().commits, 1);
    drop(j); // the crash
    let snap = MemoryJournal::reopen(&store).unwrap().load().unwrap();
    assert_eq!(snap, store.snapshot());
    assert!(snap.meta.is_empty());
    let ids: Vec<_> = snap.nodes.keys().map(String::as_str).collect();
    assert_eq!(ids, ["g-0"]);
}

#[test]
fn a_memory_store_has_one_live_journal_at_a_time() {
    let j = MemoryJournal::new("r1").unwrap();
    let store = j.storage();
    assert!(store.is_held());
    let err = MemoryJournal::reopen(&store).unwrap_err();
    assert!(matches!(&err, JournalError::InUse { run } if run == "r1"));
    assert!(
        err.to_string().contains("another controller for run `r1`"),
        "{err}"
    );
    drop(j);
    assert!(!store.is_held());
    let again = MemoryJournal::reopen(&store).unwrap();
    assert_eq!(again.storage().run(), "r1");
}

#[test]
fn a_memory_store_refuses_a_run_name_the_file_journal_would_refuse() {
    for bad in ["", "../x", "a/b", ".hidden"] {
        assert!(matches!(
            MemoryStore::new(bad),
            Err(JournalError::InvalidRunName { .. })
        ));
    }
}
