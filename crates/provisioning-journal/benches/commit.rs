//! Commit throughput of the SQLite journal, plain `std::time`:
//! one change set of 100 000 node rows, then 1 000 passes of 10 rows each,
//! with `synchronous` FULL and NORMAL. Prints medians.
//!
//! `cargo bench -p provisioning-journal` (append `-- --quick` for fewer rounds).

use std::time::{Duration, Instant};

use provisioning_journal::{
    ChangeSet, Journal, NodeRow, SqliteJournal, SqliteOptions, Synchronous,
};

fn body(i: u64, attempt: u64) -> String {
    format!(
        r#"{{"intent":"run","facts":{{"lease":{{"attempt":{attempt},"key":"lease-{i:08}"}},"endpoint":"10.0.{}.{}:22"}},"retry":{{"failures":0}},"pending":null}}"#,
        i / 256 % 256,
        i % 256
    )
}

fn rows(range: std::ops::Range<u64>, attempt: u64) -> Vec<NodeRow> {
    range
        .map(|i| NodeRow {
            node: format!("workers-{i}"),
            attempt,
            stage: "joined".to_owned(),
            body: body(i, attempt),
        })
        .collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 1 } else { 5 };
    for sync in [Synchronous::Full, Synchronous::Normal] {
        let opts = SqliteOptions {
            synchronous: sync,
            ..SqliteOptions::default()
        };
        let mut big = Vec::new();
        let mut small = Vec::new();
        let mut load = Vec::new();
        let mut bytes = 0;
        for _ in 0..rounds {
            let tmp = tempfile::tempdir().expect("tempdir");
            let mut j = SqliteJournal::open(tmp.path(), "bench", &opts).expect("open");
            let first = ChangeSet {
                meta: vec![("generation".into(), "1".into())],
                upserts: rows(0..100_000, 1),
                deletes: vec![],
            };
            bytes = first.payload_bytes();
            let t = Instant::now();
            j.commit(&first).expect("commit 100k");
            big.push(t.elapsed());

            for pass in 0..1000u64 {
                let start = pass * 10 % 100_000;
                let cs = ChangeSet {
                    meta: vec![("generation".into(), pass.to_string())],
                    upserts: rows(start..start + 10, pass + 2),
                    deletes: vec![],
                };
                let t = Instant::now();
                j.commit(&cs).expect("commit pass");
                small.push(t.elapsed());
            }
            let t = Instant::now();
            let snap = j.load().expect("load");
            load.push(t.elapsed());
            assert_eq!(snap.nodes.len(), 100_000);
        }
        println!(
            "synchronous={sync:?}: 100k-row commit ({:.1} MiB) median {:?}; 10-row pass median {:?} (p99 {:?}); load of 100k rows median {:?}",
            bytes as f64 / (1024.0 * 1024.0),
            median(big),
            median(small.clone()),
            {
                small.sort();
                small[small.len() * 99 / 100]
            },
            median(load),
        );
    }
}
