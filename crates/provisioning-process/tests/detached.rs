//! Detached agents (`AgentLifetime::Detached`): nodes that outlive their
//! plugin, and a new plugin of the same run and secret that adopts them.
//!
//! A plugin dropped without `shutdown` stands for a crashed controller here
//! (`detached_death.rs` kills a real controller process with `SIGKILL`).
//! Every test counts processes from `/proc` and kills what it started in a
//! `RunGuard`, however it ends.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use common::*;
use provisioning::observe::BootstrapEvent;
use provisioning::state::BootstrapProgress;
use provisioning::{EndpointLookup, RunId};
use provisioning_agent::{RunSecret, os};
use provisioning_process::ProcessPlugin;
use provisioning_provider::{AttemptKey, BootstrapRequest, ProvisionPlugin};

async fn detached_plugin(run: &RunId, log_dir: &Path) -> (Arc<ProcessPlugin>, Recorder) {
    plugin_with(detached_config(run, Some(log_dir))).await
}

/// The pids of `key`'s node other than its agent: the workload's.
fn workload_pids(key: &AttemptKey) -> BTreeSet<i32> {
    os::node_processes(key)
        .expect("/proc is readable")
        .into_iter()
        .filter(|p| !p.is_group_leader())
        .map(|p| p.pid)
        .collect()
}

/// The workload's processes once two reads 50 ms apart agree: right after a
/// boot, a short-lived process of the node (the shell before it execs its
/// command, say) can still be seen beside the workload. Fails after 5 s.
async fn settled_workload_pids(key: &AttemptKey) -> BTreeSet<i32> {
    let mut last = workload_pids(key);
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let now = workload_pids(key);
        if now == last && !now.is_empty() {
            return now;
        }
        last = now;
    }
    panic!("the workload's processes never settled: {last:?}");
}

fn agent_pid(key: &AttemptKey) -> Option<i32> {
    os::node_processes(key)
        .expect("/proc is readable")
        .into_iter()
        .find(os::TaggedProcess::is_group_leader)
        .map(|p| p.pid)
}

#[tokio::test]
async fn a_detached_agent_survives_the_drop_of_its_plugin_and_a_new_plugin_adopts_it_without_restarting_its_workload()
 {
    let guard = RunGuard::new("detached-adopt");
    let logs = tempfile::tempdir().unwrap();
    let run = guard.run.clone();
    let key = key(&run, "web", 0, 1);
    let spec = spec(&key, boot(&["true"], "sleep 300 & sleep 300; wait"));

    let (first, first_events) = detached_plugin(&run, logs.path()).await;
    let (lease, _) = bring_up(&first, &first_events, &key, &spec).await;
    first.complete_bootstrap(&key, None).await.unwrap();
    let endpoint = wait_endpoint(&first, &key, &lease).await;
    wait_for_processes(&run, "the workload", |_| workload_pids(&key).len() >= 2).await;
    let agent = agent_pid(&key).expect("the agent runs");
    let workload = workload_pids(&key);
    // The controller "crashes": no shutdown, no cleanup of its nodes.
    drop(first);

    let (second, events) = detached_plugin(&run, logs.path()).await;
    let listed = second.list_nodes(&run).await.unwrap();
    assert_eq!(
        listed.iter().map(|n| &n.key).collect::<Vec<_>>(),
        vec![&key],
        "the new plugin lists the detached agent: {listed:?}"
    );
    assert_eq!(listed[0].lease, lease.lease, "same agent, same lease");

    let adopted = second.create_node(&key, &spec).await.unwrap();
    assert!(adopted.adopted, "create adopts the live agent");
    assert_eq!(adopted.lease, lease.lease);
    assert_eq!(
        second.lookup_endpoint(&key, &adopted.lease).await.unwrap(),
        EndpointLookup::Ready(endpoint.clone())
    );
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: adopted.lease.clone(),
        endpoint,
    };
    let session = second.start_bootstrap(&key, &request).await.unwrap();
    assert!(session.adopted, "the running boot is adopted");
    events
        .wait_for("the agent to re-join the new plugin's swarm", |e| {
            joined(e, &key)
        })
        .await;
    assert!(
        events
            .bootstrap_events(&key)
            .contains(&BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin)),
        "{:?}",
        events.bootstrap_events(&key)
    );
    second.complete_bootstrap(&key, None).await.unwrap();
    assert_eq!(
        events.bootstrap_events(&key).last(),
        Some(&BootstrapEvent::Closed)
    );
    assert_eq!(agent_pid(&key), Some(agent), "the same agent runs");
    assert_eq!(
        workload_pids(&key),
        workload,
        "the workload was not restarted"
    );

    // The credential reached the agent only over loopback connections.
    let credential = RunSecret::from_bytes(SECRET).credential(&key).to_hex();
    let log = std::fs::read_to_string(logs.path().join("web-0-a1.log")).unwrap();
    assert!(log.contains("re-joined the swarm"), "{log}");
    assert!(!log.contains(&credential), "the credential is in the log");
    let cmdline = std::fs::read(format!("/proc/{agent}/cmdline")).unwrap();
    let environ = std::fs::read(format!("/proc/{agent}/environ")).unwrap();
    for text in [cmdline, environ] {
        assert!(!String::from_utf8_lossy(&text).contains(&credential));
    }

    second.destroy_node(&key, &adopted.lease).await.unwrap();
    assert_no_processes(&run);
    second.shutdown().await;
}

#[tokio::test]
async fn a_detached_agent_is_re_attached_when_listed_and_its_loss_is_reported_to_the_new_plugin() {
    let guard = RunGuard::new("detached-relist");
    let logs = tempfile::tempdir().unwrap();
    let run = guard.run.clone();
    let key = key(&run, "web", 0, 4);
    let spec = spec(&key, boot(&[], "sleep 300"));
    let (first, first_events) = detached_plugin(&run, logs.path()).await;
    bring_up(&first, &first_events, &key, &spec).await;
    first.complete_bootstrap(&key, None).await.unwrap();
    drop(first);

    // A converged node: the new controller only lists it (no bootstrap
    // call follows), yet the agent re-joins, so its loss is still seen.
    let (second, events) = detached_plugin(&run, logs.path()).await;
    assert_eq!(second.list_nodes(&run).await.unwrap().len(), 1);
    let log = logs.path().join("web-0-a4.log");
    let deadline = tokio::time::Instant::now() + WAIT_MAX;
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("re-joined the swarm")
    {
        assert!(tokio::time::Instant::now() < deadline, "no re-join");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(
        events.bootstrap_events(&key).is_empty(),
        "a re-attach nobody asked for reports no bootstrap events"
    );
    os::signal_agent(&key, nix::sys::signal::Signal::SIGKILL).unwrap();
    events
        .wait_for("the loss of the re-attached agent", |e| {
            e.iter().any(|o| {
                matches!(o, provisioning::Observation::NodeLost { node, attempt, .. }
                    if *node == key.node && *attempt == key.attempt)
            })
        })
        .await;
    // The new plugin takes what is left of the node down (asynchronously:
    // the runtime must keep running while this test waits).
    wait_for_processes(&run, "the workload to be killed", <[_]>::is_empty).await;
    second.shutdown().await;
}

#[tokio::test]
async fn a_detached_agent_that_never_booted_is_adopted_and_booted_by_the_new_plugin() {
    let guard = RunGuard::new("detached-unbooted");
    let logs = tempfile::tempdir().unwrap();
    let run = guard.run.clone();
    let key = key(&run, "web", 1, 2);
    let spec = spec(&key, boot(&[], "sleep 300"));
    let (first, _) = detached_plugin(&run, logs.path()).await;
    let lease = first.create_node(&key, &spec).await.unwrap();
    wait_endpoint(&first, &key, &lease).await;
    drop(first);

    let (second, events) = detached_plugin(&run, logs.path()).await;
    let adopted = second.create_node(&key, &spec).await.unwrap();
    assert!(adopted.adopted);
    let endpoint = wait_endpoint(&second, &key, &adopted).await;
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: adopted.lease.clone(),
        endpoint,
    };
    let session = second.start_bootstrap(&key, &request).await.unwrap();
    assert!(!session.adopted, "nothing had booted: a fresh boot");
    events.wait_for("the join", |e| joined(e, &key)).await;
    assert_eq!(os::agents(&run).unwrap().len(), 1, "still one agent");
    second.destroy_node(&key, &adopted.lease).await.unwrap();
    assert_no_processes(&run);
    second.shutdown().await;
}

#[tokio::test]
async fn shutdown_of_a_detached_plugin_leaves_its_agents_and_destroy_and_cancel_of_adopted_agents_leave_zero_processes()
 {
    let guard = RunGuard::new("detached-destroy");
    let logs = tempfile::tempdir().unwrap();
    let run = guard.run.clone();
    let booted = key(&run, "web", 0, 1);
    let idle = key(&run, "web", 1, 2);
    let (first, first_events) = detached_plugin(&run, logs.path()).await;
    let (booted_lease, _) = bring_up(
        &first,
        &first_events,
        &booted,
        &spec(&booted, boot(&[], "sleep 300 & sleep 300; wait")),
    )
    .await;
    let idle_lease = first
        .create_node(&idle, &spec(&idle, boot(&[], "")))
        .await
        .unwrap();
    wait_endpoint(&first, &idle, &idle_lease).await;
    let before = live(&run);
    first.shutdown().await;
    drop(first);
    let after = live(&run);
    assert_eq!(
        before.iter().map(|p| p.pid).collect::<Vec<_>>(),
        after.iter().map(|p| p.pid).collect::<Vec<_>>(),
        "shutdown in detached mode stops no node"
    );

    // A new plugin that never created them destroys them.
    let (second, _) = detached_plugin(&run, logs.path()).await;
    second.cancel_bootstrap(&booted, None).await.unwrap();
    second
        .destroy_node(&booted, &booted_lease.lease)
        .await
        .unwrap();
    assert!(
        os::node_processes(&booted).unwrap().is_empty(),
        "{:#?}",
        live(&run)
    );
    second.destroy_node(&idle, &idle_lease.lease).await.unwrap();
    assert_no_processes(&run);
    // Absent is success.
    second.cancel_bootstrap(&booted, None).await.unwrap();
    second
        .destroy_node(&booted, &booted_lease.lease)
        .await
        .unwrap();
    assert!(second.list_nodes(&run).await.unwrap().is_empty());
    second.shutdown().await;
}

#[tokio::test]
async fn default_mode_agents_still_die_with_their_plugin_and_a_new_plugin_finds_nothing() {
    let guard = RunGuard::new("attached-dies");
    let run = guard.run.clone();
    let key = key(&run, "web", 0, 1);
    let (first, events) = plugin(&run).await;
    bring_up(&first, &events, &key, &spec(&key, boot(&[], "sleep 300"))).await;
    drop(first);
    assert_no_processes(&run);
    let (second, _) = plugin(&run).await;
    assert!(second.list_nodes(&run).await.unwrap().is_empty());
    second.shutdown().await;
}

#[tokio::test]
async fn a_resume_without_the_agents_credential_is_refused_and_changes_nothing() {
    let guard = RunGuard::new("detached-forged");
    let logs = tempfile::tempdir().unwrap();
    let run = guard.run.clone();
    let key = key(&run, "web", 0, 1);
    let spec = spec(&key, boot(&[], "sleep 300"));
    let (first, first_events) = detached_plugin(&run, logs.path()).await;
    bring_up(&first, &first_events, &key, &spec).await;
    drop(first);
    let workload = settled_workload_pids(&key).await;

    // Another secret: its credential is not the agent's.
    let mut forged = detached_config(&run, None);
    forged.run_secret = RunSecret::from_bytes([7; 32]);
    let (second, events) = plugin_with(forged).await;
    let adopted = second.create_node(&key, &spec).await.unwrap();
    assert!(adopted.adopted);
    let endpoint = wait_endpoint(&second, &key, &adopted).await;
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: adopted.lease.clone(),
        endpoint,
    };
    let refused = second.start_bootstrap(&key, &request).await.unwrap_err();
    assert!(refused.to_string().contains("credential"), "{refused}");
    assert!(!joined(&events.snapshot(), &key));
    assert_eq!(workload_pids(&key), workload, "the workload runs on");
    second.destroy_node(&key, &adopted.lease).await.unwrap();
    assert_no_processes(&run);
    second.shutdown().await;
}
