//! A host that keeps durable state (design §13): journaled before dispatch,
//! resumed after a crash, orphans collected, clean teardown marked clean.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use provisioning::RunId;
use provisioning_journal::{MemoryJournal, MemoryStore};
use provisioning_provider::AttemptKey;
use provisioning_runtime::{Durability, Host, HostHandle, PluginEntry, ShutdownOutcome};

fn durable_host(plugin: &Arc<FakePlugin>, store: &MemoryStore, grace: Duration) -> Host {
    let journal = MemoryJournal::reopen(store).expect("the store is free");
    let mut durability = Durability::open(Box::new(journal)).expect("readable");
    durability.orphan_grace = grace;
    durability.orphan_scan_interval = Duration::from_secs(1);
    let for_hook = plugin.clone();
    let entry = PluginEntry::new(plugin.clone()).with_shutdown(move || async move {
        for_hook.shut_down.store(true, Ordering::SeqCst);
    });
    Host::start_durable(config(), vec![entry], durability).expect("host starts")
}

/// The node row the journal holds for `key`'s node, as JSON.
fn committed_row(store: &MemoryStore, key: &AttemptKey) -> Option<serde_json::Value> {
    let snapshot = store.snapshot();
    let row = snapshot.nodes.get(&key.node.to_string())?;
    serde_json::from_str(&row.body).ok()
}

async fn apply(handle: &HostHandle, groups: Vec<provisioning::NodeGroup>) {
    handle
        .apply_revision(RunId::new(RUN), groups)
        .await
        .expect("accepted");
}

/// Crashes a host: the loop stops by force, nothing is marked clean, and
/// the plugin keeps its nodes (they outlive the controller).
async fn crash(host: Host) {
    let handle = host.handle();
    handle.force_shutdown();
    let report = host.join().await;
    assert_eq!(report.outcome, ShutdownOutcome::Forced);
}

/// On real time and several workers: an executor task may start on another
/// thread the moment an operation is submitted, so a submission before the
/// commit would be seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_a_plugin_sees_was_committed_as_pending_before_it_started() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let breaches = Arc::new(Mutex::new(Vec::new()));
    let checked = Arc::new(Mutex::new(0_usize));
    {
        let (store, breaches, checked) = (store.clone(), breaches.clone(), checked.clone());
        *plugin.on_call.lock().unwrap() = Some(Box::new(move |key: &AttemptKey, method: &str| {
            *checked.lock().unwrap() += 1;
            let row = committed_row(&store, key);
            let pending = row
                .as_ref()
                .filter(|r| r["node"]["attempt"] == key.attempt.get())
                .and_then(|r| r["node"]["pending"]["kind"].as_str().map(str::to_owned));
            if pending.is_none() {
                breaches
                    .lock()
                    .unwrap()
                    .push(format!("{method} of {key}: row {row:?}"));
            }
        }));
    }
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(
        &handle,
        vec![group("web", 3, "serve"), group("db", 1, "db")],
    )
    .await;
    wait_until(&handle, "convergence", |s| s.converged).await;
    apply(&handle, vec![group("web", 1, "serve")]).await;
    wait_until(&handle, "scale-down", |s| s.converged && s.nodes.len() == 1).await;
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
    assert!(*checked.lock().unwrap() > 10, "the check ran");
    assert_eq!(*breaches.lock().unwrap(), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn a_clean_teardown_marks_the_state_clean_and_the_next_start_is_fresh() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(&handle, vec![group("web", 2, "serve")]).await;
    let first = wait_until(&handle, "convergence", |s| s.converged).await;
    let before = attempts(&first);
    let generation_before = first.generation;
    assert!(!store.snapshot().clean, "a running cluster is unclean");
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
    host.join().await;
    assert!(store.snapshot().clean);
    let reopened = Durability::open(Box::new(MemoryJournal::reopen(&store).unwrap())).unwrap();
    assert_eq!(
        reopened.resume_summary(),
        None,
        "a clean run is not resumed"
    );
    drop(reopened);

    // Fresh, but attempt ids and generations continue: none is reused.
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(&handle, vec![group("web", 2, "serve")]).await;
    let again = wait_until(&handle, "convergence again", |s| s.converged).await;
    assert!(!again.durability.as_ref().unwrap().resumed);
    let highest_before = before.values().max().copied().unwrap();
    assert!(
        attempts(&again).values().all(|a| *a > highest_before),
        "{again:?}"
    );
    assert!(again.generation > generation_before);
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
}

#[tokio::test(start_paused = true)]
async fn a_restart_after_a_crash_adopts_every_listed_node_without_a_new_attempt() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(&handle, vec![group("web", 3, "serve")]).await;
    let before = attempts(&wait_until(&handle, "convergence", |s| s.converged).await);
    crash(host).await;
    let creates = plugin.creates.load(Ordering::SeqCst);

    let journal = MemoryJournal::reopen(&store).unwrap();
    let durability = Durability::open(Box::new(journal)).unwrap();
    let summary = durability.resume_summary().expect("unclean: resumed");
    assert_eq!(summary.nodes, 3);
    drop(durability);
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    let after = wait_until(&handle, "convergence after restart", |s| s.converged).await;
    assert_eq!(
        attempts(&after),
        before,
        "every node adopted, none replaced"
    );
    assert_eq!(
        plugin.creates.load(Ordering::SeqCst),
        creates,
        "no create after recovery"
    );
    let durability = after.durability.expect("durable");
    assert!(durability.resumed);
    assert_eq!(durability.lost_at_recovery, 0);
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
    assert!(plugin.live().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_journaled_node_its_provider_no_longer_lists_is_replaced_after_a_restart() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(&handle, vec![group("web", 2, "serve")]).await;
    let before = attempts(&wait_until(&handle, "convergence", |s| s.converged).await);
    crash(host).await;
    // While no controller runs, web-1's machine disappears.
    plugin
        .nodes
        .lock()
        .unwrap()
        .retain(|k, _| k.node.to_string() != "web-1");

    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    let after = wait_until(&handle, "convergence after restart", |s| s.converged).await;
    let after_attempts = attempts(&after);
    assert_eq!(after_attempts["web-0"], before["web-0"], "web-0 adopted");
    assert!(
        after_attempts["web-1"] > before["web-1"],
        "web-1 replaced by a fresh attempt"
    );
    assert_eq!(after.durability.unwrap().lost_at_recovery, 1);
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
    assert!(plugin.live().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_resource_no_current_attempt_owns_is_destroyed_after_its_grace() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let host = durable_host(&plugin, &store, Duration::from_secs(5));
    let handle = host.handle();
    apply(&handle, vec![group("web", 1, "serve")]).await;
    let converged = wait_until(&handle, "convergence", |s| s.converged).await;
    crash(host).await;
    // A leftover of an older attempt of web-0, and one of a slot the run
    // never had: neither is owned by a current attempt.
    let current = converged.nodes[0].attempt;
    for (node, attempt) in [("web-0", current + 100), ("ghost-7", 1)] {
        let key = AttemptKey {
            run_id: RunId::new(RUN),
            node: provisioning::LogicalNodeId::parse(node).unwrap(),
            attempt: provisioning::NodeAttemptId::from_raw(attempt),
        };
        plugin.nodes.lock().unwrap().insert(
            key,
            FakeNode {
                lease: provisioning::LeaseHandle(format!("leftover-{node}")),
                session: false,
            },
        );
    }
    let host = durable_host(&plugin, &store, Duration::from_secs(5));
    let handle = host.handle();
    let suspected = wait_until(&handle, "orphans suspected", |s| {
        s.durability
            .as_ref()
            .is_some_and(|d| d.orphans_suspected == 2)
    })
    .await;
    assert_eq!(
        suspected.durability.unwrap().orphans_collected,
        0,
        "not before the grace"
    );
    let collected = wait_until(&handle, "orphans collected", |s| {
        s.durability
            .as_ref()
            .is_some_and(|d| d.orphans_collected == 2)
    })
    .await;
    assert!(collected.converged);
    let live = plugin.live();
    assert_eq!(
        live,
        vec![("web-0".to_owned(), current)],
        "the owned node is kept"
    );
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
}

#[tokio::test(start_paused = true)]
async fn nothing_is_submitted_while_the_journal_cannot_be_written() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    for _ in 0..3 {
        store.fail_next_commit();
    }
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(&handle, vec![group("web", 2, "serve")]).await;
    let failing = wait_until(&handle, "a journal error", |s| {
        s.durability
            .as_ref()
            .is_some_and(|d| d.journal_error.is_some())
    })
    .await;
    assert_eq!(
        plugin.creates.load(Ordering::SeqCst),
        0,
        "no create reached the plugin"
    );
    assert!(failing.nodes.iter().all(|n| n.pending.is_none()));
    let healed = wait_until(&handle, "convergence once commits work", |s| s.converged).await;
    assert_eq!(healed.durability.unwrap().journal_error, None);
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
}

/// Waits until the published progress satisfies `done`, then checks that
/// it shows what a fresh status shows.
async fn progress_agrees(
    handle: &HostHandle,
    what: &str,
    done: impl Fn(&provisioning_runtime::StatusSnapshot) -> bool,
) -> provisioning_runtime::StatusSnapshot {
    let mut progress = handle.subscribe();
    let seen = tokio::time::timeout(WAIT_BOUND, progress.wait_for(|s| done(s)))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .expect("host alive")
        .clone();
    let fresh = handle.status().await;
    let shown = |s: &provisioning_runtime::StatusSnapshot| {
        let nodes: Vec<_> = s
            .nodes
            .iter()
            .map(|n| {
                let mut n = n.clone();
                n.history.clear();
                n
            })
            .collect();
        (s.generation, s.converged, s.groups.clone(), nodes)
    };
    assert_eq!(shown(&seen), shown(&fresh), "{what}");
    seen
}

/// A durable host keeps its progress view from the changes it journals:
/// what it publishes agrees with a fresh status after each change.
#[tokio::test(start_paused = true)]
async fn a_durable_hosts_progress_agrees_with_a_fresh_status_after_each_change() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(
        &handle,
        vec![group("web", 3, "serve"), group("db", 1, "db")],
    )
    .await;
    let first = progress_agrees(&handle, "convergence", |s| {
        s.converged && s.ready_count() == 4
    })
    .await;
    let old = first
        .nodes
        .iter()
        .find(|n| n.id == "web-2")
        .unwrap()
        .attempt;
    plugin.kill("web-2");
    progress_agrees(&handle, "replacement", |s| {
        s.converged && s.nodes.iter().any(|n| n.id == "web-2" && n.attempt > old)
    })
    .await;
    apply(&handle, vec![group("web", 1, "serve")]).await;
    progress_agrees(&handle, "scale-down", |s| s.converged && s.nodes.len() == 1).await;
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
}

/// G37 on the host: after a crash a node the journal held as ready is shown
/// `rejoining`, not ready, and the run is never converged before its agent
/// re-joins the new controller.
#[tokio::test(start_paused = true)]
async fn a_recovered_node_is_rejoining_and_the_run_not_converged_until_its_agent_rejoins() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(&handle, vec![group("web", 2, "serve")]).await;
    let before = attempts(&wait_until(&handle, "convergence", |s| s.converged).await);
    crash(host).await;
    plugin.agents_stay_away.store(true, Ordering::SeqCst);

    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    let rejoining = wait_until(&handle, "recovered", |s| {
        s.nodes.len() == 2 && s.observed_generation.is_some()
    })
    .await;
    // Well inside the window: still waiting, and never converged.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let waiting = handle.status().await;
    for snapshot in [&rejoining, &waiting] {
        assert!(!snapshot.converged, "{snapshot:?}");
        assert_eq!(snapshot.ready_count(), 0);
        assert!(
            snapshot
                .nodes
                .iter()
                .all(|n| n.stage == "rejoining" && !n.ready),
            "{snapshot:?}"
        );
    }
    let json = serde_json::to_value(&waiting).unwrap();
    assert_eq!(json["converged"], false);
    assert_eq!(json["nodes"][0]["stage"], "rejoining");
    // The agents re-join: ready again, the same attempts, no create.
    let creates = plugin.creates.load(Ordering::SeqCst);
    let keys: Vec<AttemptKey> = plugin.nodes.lock().unwrap().keys().cloned().collect();
    for key in &keys {
        plugin.sink().rejoined(key);
    }
    let after = wait_until(&handle, "re-joined", |s| s.converged).await;
    assert_eq!(attempts(&after), before);
    assert!(after.nodes.iter().all(|n| n.stage == "dormant" && n.ready));
    assert_eq!(plugin.creates.load(Ordering::SeqCst), creates);
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
}

/// A node whose agent does not re-join the restarted controller within the
/// rejoin window (60 s) is lost, with the reason, and replaced.
#[tokio::test(start_paused = true)]
async fn a_node_whose_agent_does_not_rejoin_within_the_window_is_lost_and_replaced() {
    let plugin = Arc::new(FakePlugin::default());
    let store = MemoryStore::new(RUN).unwrap();
    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    apply(&handle, vec![group("web", 1, "serve")]).await;
    let before = attempts(&wait_until(&handle, "convergence", |s| s.converged).await);
    crash(host).await;
    plugin.agents_stay_away.store(true, Ordering::SeqCst);

    let host = durable_host(&plugin, &store, Duration::from_secs(30));
    let handle = host.handle();
    let started = tokio::time::Instant::now();
    let lost = wait_until(&handle, "lost", |s| {
        s.nodes.iter().any(|n| {
            n.last_error
                .as_deref()
                .is_some_and(|e| e.contains("did not re-join the restarted controller within 60 s"))
        })
    })
    .await;
    assert!(started.elapsed() >= Duration::from_secs(59), "{lost:?}");
    let after = wait_until(&handle, "replaced", |s| s.converged).await;
    assert!(attempts(&after)["web-0"] > before["web-0"], "{after:?}");
    assert_eq!(handle.shutdown().await.outcome, ShutdownOutcome::Clean);
    assert!(plugin.live().is_empty());
}
