//! The host loop against an in-memory plugin, on paused virtual time.

mod common;

use common::*;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use provisioning::{DesiredUpdate, DriverError, Generation, RunId};
use provisioning_runtime::{
    AppliedRevision, ChangeKind, Host, HostError, HostHandle, NodeStatus, PluginEntry,
    ShutdownOutcome, StatusSnapshot,
};

fn start(plugin: &Arc<FakePlugin>) -> Host {
    let for_hook = plugin.clone();
    let entry = PluginEntry::new(plugin.clone()).with_shutdown(move || async move {
        for_hook.shut_down.store(true, Ordering::SeqCst);
        for_hook.nodes.lock().unwrap().clear();
    });
    Host::start(config(), vec![entry]).expect("host starts")
}

#[tokio::test(start_paused = true)]
async fn host_converges_a_two_group_shape_and_reports_every_node_ready() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    let update = handle
        .apply(shape(1, vec![group("a", 2, "x"), group("b", 3, "y")]))
        .await
        .unwrap();
    assert_eq!(update, DesiredUpdate::Accepted);

    let status = wait_until(&handle, "convergence", converged_at(1)).await;
    assert_eq!(status.observed_generation, Some(1));
    let ids: Vec<&str> = status.nodes.iter().map(|n| n.id.as_str()).collect();
    assert_eq!(ids, ["a-0", "a-1", "b-0", "b-1", "b-2"]);
    assert!(status.nodes.iter().all(|n| n.ready && n.stage == "dormant"));
    assert_eq!(status.groups.iter().map(|g| g.ready).sum::<u32>(), 5);
    assert_eq!(plugin.live().len(), 5);

    let report = handle.shutdown().await;
    assert_eq!(report.outcome, ShutdownOutcome::Clean);
    assert!(plugin.live().is_empty());
}

#[tokio::test(start_paused = true)]
async fn scaling_down_removes_the_highest_indices_and_releases_their_resources() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 4, "x")]))
        .await
        .unwrap();
    let before = wait_until(&handle, "four nodes", converged_at(1)).await;

    handle
        .apply(shape(2, vec![group("a", 2, "x")]))
        .await
        .unwrap();
    let after = wait_until(&handle, "two nodes", converged_at(2)).await;
    let kept = attempts(&after);
    assert_eq!(
        kept.keys().map(String::as_str).collect::<Vec<_>>(),
        ["a-0", "a-1"]
    );
    assert_eq!(
        kept["a-0"],
        attempts(&before)["a-0"],
        "kept slots keep their attempt"
    );
    let live: Vec<String> = plugin.live().into_iter().map(|(n, _)| n).collect();
    assert_eq!(live, ["a-0", "a-1"]);
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_lost_node_is_replaced_by_a_new_attempt_that_becomes_ready() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 2, "x")]))
        .await
        .unwrap();
    let before = wait_until(&handle, "convergence", converged_at(1)).await;
    let old = attempts(&before)["a-1"];

    plugin.kill("a-1");
    let after = wait_until(&handle, "replacement", |s| {
        s.converged && attempts(s).get("a-1").is_some_and(|a| *a != old)
    })
    .await;
    assert!(attempts(&after)["a-1"] > old);
    assert_eq!(attempts(&after)["a-0"], attempts(&before)["a-0"]);
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_drifted_group_is_replaced_with_new_attempts_and_the_other_group_is_kept() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 2, "x"), group("b", 1, "y")]))
        .await
        .unwrap();
    let before = attempts(&wait_until(&handle, "convergence", converged_at(1)).await);

    handle
        .apply(shape(2, vec![group("a", 2, "x2"), group("b", 1, "y")]))
        .await
        .unwrap();
    let after = attempts(&wait_until(&handle, "drift replaced", converged_at(2)).await);
    assert!(after["a-0"] > before["a-0"] && after["a-1"] > before["a-1"]);
    assert_eq!(after["b-0"], before["b-0"]);
    assert_eq!(plugin.live().len(), 3, "the old attempts were destroyed");
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_unknown_provider_kind_is_rejected_naming_the_group_and_changes_nothing() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    let mut cloud = group("gpu", 1, "x");
    cloud.template.provider = "cloud".into();
    let error = handle
        .apply(shape(1, vec![group("a", 1, "x"), cloud]))
        .await
        .unwrap_err();
    assert!(matches!(error, HostError::UnknownProvider { .. }));
    let message = error.to_string();
    assert!(
        message.contains("\"gpu\"") && message.contains("\"cloud\""),
        "{message}"
    );
    assert!(message.contains("available: fake"), "{message}");
    let status = handle.status().await;
    assert_eq!(status.generation, 0);
    assert!(status.nodes.is_empty());
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_lower_generation_or_a_silent_change_is_refused_with_the_drivers_typed_error() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(3, vec![group("a", 1, "x")]))
        .await
        .unwrap();
    let same = handle
        .apply(shape(3, vec![group("a", 1, "x")]))
        .await
        .unwrap();
    assert_eq!(same, DesiredUpdate::Unchanged);
    let lower = handle.apply(shape(2, vec![group("a", 1, "x")])).await;
    assert!(matches!(
        lower,
        Err(HostError::Driver(DriverError::GenerationRegressed { .. }))
    ));
    let silent = handle.apply(shape(3, vec![group("a", 2, "x")])).await;
    assert!(matches!(
        silent,
        Err(HostError::Driver(
            DriverError::ContentChangedWithoutGenerationBump { .. }
        ))
    ));
    let mut other = shape(4, vec![]);
    other.run_id = RunId::new("other-run");
    assert!(matches!(
        handle.apply(other).await,
        Err(HostError::Driver(DriverError::RunChanged { .. }))
    ));
    assert_eq!(handle.status().await.generation, 3);
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn apply_revision_bumps_the_generation_only_when_the_groups_change() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    let run = RunId::new(RUN);
    let first = handle
        .apply_revision(run.clone(), vec![group("a", 1, "x")])
        .await
        .unwrap();
    assert_eq!(
        first,
        AppliedRevision::Applied {
            generation: Generation::new(1)
        }
    );
    let again = handle
        .apply_revision(run.clone(), vec![group("a", 1, "x")])
        .await
        .unwrap();
    assert_eq!(
        again,
        AppliedRevision::Unchanged {
            generation: Generation::new(1)
        }
    );
    let second = handle
        .apply_revision(run.clone(), vec![group("a", 2, "x")])
        .await
        .unwrap();
    assert_eq!(second.generation(), Generation::new(2));
    let other = handle.apply_revision(RunId::new("other-run"), vec![]).await;
    assert!(matches!(
        other,
        Err(HostError::Driver(DriverError::RunChanged { .. }))
    ));
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn graceful_shutdown_tears_down_to_zero_through_the_driver_then_calls_the_hook() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 3, "x")]))
        .await
        .unwrap();
    wait_until(&handle, "convergence", converged_at(1)).await;

    let report = handle.shutdown().await;
    assert_eq!(report.outcome, ShutdownOutcome::Clean);
    assert_eq!(report.remaining_nodes, 0);
    assert!(plugin.shut_down.load(Ordering::SeqCst), "the hook ran");
    let last = handle.status().await;
    assert_eq!(last.generation, 2, "teardown is the next generation");
    assert!(last.nodes.is_empty());
    assert!(matches!(
        handle.apply(shape(9, vec![])).await,
        Err(HostError::Stopped)
    ));
    assert!(handle.is_stopped());
    let joined = host.join().await;
    assert_eq!(joined.outcome, ShutdownOutcome::Clean);
}

#[tokio::test(start_paused = true)]
async fn shutdown_is_forced_when_cleanup_hangs_past_the_deadline() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 2, "x")]))
        .await
        .unwrap();
    wait_until(&handle, "convergence", converged_at(1)).await;

    plugin.hang_destroy.store(true, Ordering::SeqCst);
    let report = handle.shutdown().await;
    assert_eq!(report.outcome, ShutdownOutcome::Forced);
    assert_eq!(report.remaining_nodes, 2);
    assert!(
        plugin.shut_down.load(Ordering::SeqCst),
        "the hook released the rest"
    );
    assert!(plugin.live().is_empty());
}

#[tokio::test(start_paused = true)]
async fn force_shutdown_stops_without_waiting_for_the_teardown() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 2, "x")]))
        .await
        .unwrap();
    wait_until(&handle, "convergence", converged_at(1)).await;
    plugin.hang_destroy.store(true, Ordering::SeqCst);

    handle.request_shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!handle.is_stopped());
    let started = tokio::time::Instant::now();
    handle.force_shutdown();
    let report = handle.wait_stopped().await;
    assert_eq!(report.outcome, ShutdownOutcome::Forced);
    assert!(
        started.elapsed() < config().shutdown_deadline,
        "force did not wait for the graceful deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn an_operation_hanging_past_its_deadline_expires_and_the_retry_adopts() {
    let plugin = Arc::new(FakePlugin::default());
    *plugin.slow_create_once.lock().unwrap() = Some(Duration::from_secs(5));
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 1, "x")]))
        .await
        .unwrap();
    let status = wait_until(&handle, "convergence", converged_at(1)).await;
    assert_eq!(status.nodes[0].attempt, 1, "the same attempt recovered");
    assert_eq!(plugin.live().len(), 1, "no double create");
    assert!(
        plugin.creates.load(Ordering::SeqCst) >= 2,
        "the create was re-issued"
    );
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_plan_names_creates_replacements_and_removals_without_changing_anything() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 2, "x"), group("b", 1, "y")]))
        .await
        .unwrap();
    wait_until(&handle, "convergence", converged_at(1)).await;

    let run = RunId::new(RUN);
    let report = handle
        .plan(run.clone(), vec![group("a", 3, "x"), group("c", 1, "z")])
        .await
        .unwrap();
    let changes: Vec<(&str, ChangeKind)> = report
        .changes
        .iter()
        .map(|c| (c.node.as_str(), c.change))
        .collect();
    assert_eq!(
        changes,
        [
            ("a-0", ChangeKind::Keep),
            ("a-1", ChangeKind::Keep),
            ("a-2", ChangeKind::Create),
            ("b-0", ChangeKind::Remove),
            ("c-0", ChangeKind::Create),
        ]
    );
    assert_eq!(report.generation, 2);
    let drift = handle
        .plan(run.clone(), vec![group("a", 2, "new"), group("b", 1, "y")])
        .await
        .unwrap();
    assert_eq!(drift.count(ChangeKind::Replace), 2);
    let same = handle
        .plan(run, vec![group("a", 2, "x"), group("b", 1, "y")])
        .await
        .unwrap();
    assert!(same.is_noop());
    assert_eq!(same.generation, 1);
    let status = handle.status().await;
    assert_eq!(status.generation, 1, "planning applies nothing");
    assert!(status.converged);
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn progress_subscribers_see_the_cluster_converge() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    let mut progress = handle.subscribe();
    handle
        .apply(shape(1, vec![group("a", 2, "x")]))
        .await
        .unwrap();
    let seen = tokio::time::timeout(
        WAIT_BOUND,
        progress.wait_for(|s| s.converged && s.generation == 1),
    )
    .await
    .expect("bounded")
    .expect("host alive")
    .clone();
    assert_eq!(seen.ready_count(), 2);
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn dropping_every_handle_tears_the_cluster_down_and_releases_the_plugin() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 2, "x")]))
        .await
        .unwrap();
    wait_until(&handle, "convergence", converged_at(1)).await;
    drop(handle);

    let report = tokio::time::timeout(WAIT_BOUND, host.join())
        .await
        .expect("bounded");
    assert_eq!(report.outcome, ShutdownOutcome::Clean);
    assert!(plugin.live().is_empty());
    // Background bootstrap tasks of the fake may still hold the sink for a
    // moment; the host itself holds nothing.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        Arc::strong_count(&plugin),
        1,
        "the host released the plugin"
    );
}

#[tokio::test]
async fn a_host_started_outside_a_runtime_is_an_error_not_a_panic() {
    let plugin = Arc::new(FakePlugin::default());
    let outcome = std::thread::spawn(move || {
        Host::start(config(), vec![PluginEntry::new(plugin)]).map(|_| ())
    })
    .join()
    .expect("no panic");
    assert!(matches!(outcome, Err(HostError::NoRuntime)));
}

/// What a progress snapshot and a fresh status must agree on: everything
/// but the uptime and the nodes' histories (progress carries none).
fn shown(snapshot: &StatusSnapshot) -> StatusSnapshot {
    let mut shown = snapshot.clone();
    shown.uptime_ms = 0;
    shown.nodes = snapshot
        .nodes
        .iter()
        .map(|n| NodeStatus {
            history: Vec::new(),
            ..n.clone()
        })
        .collect();
    shown
}

/// Waits until the published progress satisfies `done`, then checks it
/// against a fresh status built whole.
async fn progress_agrees_with_status(
    handle: &HostHandle,
    what: &str,
    done: impl Fn(&StatusSnapshot) -> bool,
) -> StatusSnapshot {
    let mut progress = handle.subscribe();
    let seen = tokio::time::timeout(WAIT_BOUND, progress.wait_for(|s| done(s)))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .expect("host alive")
        .clone();
    let fresh = handle.status().await;
    assert_eq!(shown(&seen), shown(&fresh), "{what}");
    seen
}

#[tokio::test(start_paused = true)]
async fn progress_kept_up_per_changed_node_matches_a_fresh_status_after_every_change() {
    let plugin = Arc::new(FakePlugin::default());
    let host = start(&plugin);
    let handle = host.handle();
    handle
        .apply(shape(1, vec![group("a", 3, "x"), group("b", 2, "y")]))
        .await
        .unwrap();
    let before = progress_agrees_with_status(&handle, "convergence", converged_at(1)).await;
    assert_eq!(before.ready_count(), 5);
    let old = attempts(&before)["a-1"];

    plugin.kill("a-1");
    let replaced = progress_agrees_with_status(&handle, "replacement", |s| {
        s.converged && attempts(s).get("a-1").is_some_and(|a| *a > old)
    })
    .await;
    assert_eq!(attempts(&replaced)["a-0"], attempts(&before)["a-0"]);

    // Scale a down and drift b in one generation.
    handle
        .apply(shape(2, vec![group("a", 1, "x"), group("b", 2, "y2")]))
        .await
        .unwrap();
    let after = progress_agrees_with_status(&handle, "scale-down and drift", |s| {
        converged_at(2)(s) && s.nodes.len() == 3
    })
    .await;
    assert!(after.nodes.iter().all(|n| n.ready && n.desired));
    assert!(attempts(&after)["b-0"] > attempts(&before)["b-0"]);

    // Scale up again within the same view (a new generation, more nodes).
    handle
        .apply(shape(3, vec![group("a", 4, "x"), group("b", 2, "y2")]))
        .await
        .unwrap();
    let grown = progress_agrees_with_status(&handle, "scale-up", |s| {
        converged_at(3)(s) && s.ready_count() == 6
    })
    .await;
    assert_eq!(grown.nodes.len(), 6);

    let report = handle.shutdown().await;
    assert_eq!(report.outcome, ShutdownOutcome::Clean);
    let last = handle.subscribe().borrow().clone();
    assert!(last.nodes.is_empty(), "{last:#?}");
}
