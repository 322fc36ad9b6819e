//! The process plugin against real agent processes: every test starts real
//! children, checks the operating system's view through `/proc`, and leaves
//! no process of its run behind, passing or failing.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{Endpoint, EndpointLookup, LeaseHandle, Observation};
use provisioning_agent::os;
use provisioning_process::{AgentCommand, ProcessPluginConfig};
use provisioning_provider::{BootstrapRequest, PluginError, ProvisionPlugin};

fn progress(stage: BootstrapProgress) -> BootstrapEvent {
    BootstrapEvent::Progress(stage)
}

#[tokio::test]
async fn bring_up_reports_every_stage_in_order_and_closes_after_complete() {
    let guard = RunGuard::new("bring-up");
    let (plugin, recorder) = plugin(&guard.run).await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("workload");
    let key = key(&guard.run, "web", 0, 1);
    let mut params = boot(
        &["test \"$GREETING\" = hello", "true"],
        &format!(
            "echo \"$1 $GREETING $PROVISION_NODE_ID\" > {}; exec sleep 600",
            marker.display()
        ),
    );
    params.env.insert("GREETING".into(), "hello".into());
    params.args = vec!["first-arg".into()];
    let spec = spec(&key, params);

    let started = Instant::now();
    let lease = plugin.create_node(&key, &spec).await.unwrap();
    assert!(!lease.adopted);
    let endpoint = wait_endpoint(&plugin, &key, &lease).await;
    // The slot's own loopback address (design §22), not 127.0.0.1.
    let address: std::net::SocketAddr = endpoint.0.parse().expect("an address");
    assert!(
        address.ip().is_loopback() && address.ip().to_string() != "127.0.0.1",
        "{endpoint:?}"
    );
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: lease.lease.clone(),
        endpoint,
    };
    let session = plugin.start_bootstrap(&key, &request).await.unwrap();
    assert!(!session.adopted);
    recorder
        .wait_for("the join", |events| joined(events, &key))
        .await;
    plugin
        .complete_bootstrap(&key, Some(&session.session))
        .await
        .unwrap();
    eprintln!("one node from create to Closed: {:?}", started.elapsed());

    assert_eq!(
        recorder.bootstrap_events(&key),
        vec![
            progress(BootstrapProgress::Connecting),
            progress(BootstrapProgress::Connected),
            progress(BootstrapProgress::BootChecking),
            progress(BootstrapProgress::AgentStarting),
            progress(BootstrapProgress::WaitingForJoin),
            BootstrapEvent::Joined,
            BootstrapEvent::Closed,
        ]
    );
    // A second complete is a no-op and reports nothing more.
    plugin.complete_bootstrap(&key, None).await.unwrap();
    assert_eq!(recorder.bootstrap_events(&key).len(), 7);

    // The workload runs with the group's environment, arguments and tags.
    let processes = wait_for_processes(&guard.run, "the agent and its workload", |p| {
        p.len() == 2 && marker.exists()
    })
    .await;
    assert!(
        processes.iter().all(|p| p.belongs_to(&key)),
        "{processes:#?}"
    );
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap().trim(),
        "first-arg hello web-0"
    );
    let listed = plugin.list_nodes(&guard.run).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, key);
    assert_eq!(listed[0].lease, lease.lease);

    let destroy_started = Instant::now();
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    eprintln!("destroying a joined node: {:?}", destroy_started.elapsed());
    assert!(
        live(&guard.run).is_empty(),
        "destroy returned before the group was gone"
    );
    assert!(plugin.list_nodes(&guard.run).await.unwrap().is_empty());
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn a_second_create_adopts_the_live_process() {
    let guard = RunGuard::new("adopt-create");
    let (plugin, _recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], ""));
    let first = plugin.create_node(&key, &spec).await.unwrap();
    let endpoint = wait_endpoint(&plugin, &key, &first).await;
    let second = plugin.create_node(&key, &spec).await.unwrap();
    assert!(second.adopted);
    assert_eq!(second.lease, first.lease);
    assert_eq!(second.endpoint, Some(endpoint));
    let processes = live(&guard.run);
    assert_eq!(processes.len(), 1, "{processes:#?}");
    assert_eq!(
        first.lease,
        LeaseHandle(format!("process:{}", processes[0].pid))
    );
    assert!(processes[0].is_group_leader());
    assert_eq!(plugin.list_nodes(&guard.run).await.unwrap().len(), 1);

    // Another attempt of the same slot is another key, hence another process.
    let other = common::key(&guard.run, "web", 0, 2);
    let third = plugin.create_node(&other, &spec).await.unwrap();
    assert!(!third.adopted);
    wait_for_processes(&guard.run, "two agents", |p| p.len() == 2).await;
    plugin.shutdown().await;
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn destroy_kills_the_whole_group_including_the_workload_and_its_children() {
    let guard = RunGuard::new("destroy-group");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    // The shell forks two children and waits: three workload processes.
    let spec = spec(&key, boot(&[], "sleep 600 & sleep 600 & wait"));
    let (lease, _session) = bring_up(&plugin, &recorder, &key, &spec).await;
    wait_for_processes(&guard.run, "agent, shell and two sleeps", |p| p.len() == 4).await;

    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    let left = live(&guard.run);
    assert!(left.is_empty(), "destroy left {left:#?}");
    assert!(matches!(
        plugin.lookup_endpoint(&key, &lease.lease).await,
        Err(PluginError::NotFound(_))
    ));
    assert!(plugin.list_nodes(&guard.run).await.unwrap().is_empty());
    // The node is being torn down on purpose: that is no loss.
    assert!(
        !recorder
            .snapshot()
            .iter()
            .any(|o| matches!(o, Observation::NodeLost { .. })),
        "{:#?}",
        recorder.snapshot()
    );
    // Destroying again is destroying something absent.
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn cancel_and_destroy_of_absent_nodes_succeed() {
    let guard = RunGuard::new("absent");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 3, 9);
    plugin.cancel_bootstrap(&key, None).await.unwrap();
    plugin
        .destroy_node(&key, &LeaseHandle("process:999999".into()))
        .await
        .unwrap();
    assert!(matches!(
        plugin.lookup_endpoint(&key, &LeaseHandle("x".into())).await,
        Err(PluginError::NotFound(_))
    ));
    assert!(matches!(
        plugin.complete_bootstrap(&key, None).await,
        Err(PluginError::NotFound(_))
    ));
    assert!(recorder.snapshot().is_empty());
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn sigkill_of_a_joined_agent_reports_the_node_lost_and_takes_its_workload_down() {
    let guard = RunGuard::new("sigkill");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], "sleep 600 & wait"));
    let (lease, session) = bring_up(&plugin, &recorder, &key, &spec).await;
    plugin
        .complete_bootstrap(&key, Some(&session.session))
        .await
        .unwrap();
    wait_for_processes(&guard.run, "agent, shell and sleep", |p| p.len() == 3).await;

    let agent = os::signal_agent(&key, Signal::SIGKILL).unwrap();
    assert!(agent.is_some(), "no agent found for {key}");
    let events = recorder
        .wait_for("the loss of the agent", |events| {
            events.iter().any(|o| {
                matches!(
                    o,
                    Observation::NodeLost {
                        cause: LossCause::AgentGone,
                        ..
                    }
                )
            })
        })
        .await;
    assert!(
        events
            .iter()
            .all(|o| o.node() == &key.node && o.attempt() == key.attempt)
    );
    // Without the agent the node's leftovers are killed, and it is gone.
    assert_no_processes(&guard.run);
    assert!(matches!(
        plugin.lookup_endpoint(&key, &lease.lease).await,
        Err(PluginError::NotFound(_))
    ));
    assert!(plugin.list_nodes(&guard.run).await.unwrap().is_empty());
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
}

#[tokio::test]
async fn a_failing_verify_command_fails_the_boot_check_and_starts_nothing() {
    let guard = RunGuard::new("verify-fails");
    let (plugin, recorder) = plugin(&guard.run).await;
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(
        &key,
        boot(
            &["true", "echo disk missing >&2; exit 3", "true"],
            &format!("touch {}; sleep 600", marker.display()),
        ),
    );
    let (lease, session) = create_and_start(&plugin, &key, &spec).await;
    let events = recorder
        .wait_for("the boot check failure", |events| {
            events.iter().any(|o| {
                matches!(
                    o,
                    Observation::Bootstrap {
                        event: BootstrapEvent::Failed { .. },
                        ..
                    }
                )
            })
        })
        .await;
    let Some(Observation::Bootstrap {
        event: BootstrapEvent::Failed { failure, detail },
        ..
    }) = events.last()
    else {
        panic!("the failure is not the last event: {events:#?}");
    };
    assert_eq!(*failure, BootstrapFailure::BootCheckFailed);
    assert!(detail.contains("#2"), "{detail}");
    assert!(detail.contains("exit status 3"), "{detail}");
    assert!(detail.contains("disk missing"), "{detail}");
    assert!(!joined(&events, &key));
    assert!(matches!(
        plugin
            .complete_bootstrap(&key, Some(&session.session))
            .await,
        Err(PluginError::Definite(_))
    ));
    // The agent stays up (the lease lives until destroyed); nothing else runs.
    let processes = live(&guard.run);
    assert_eq!(processes.len(), 1, "{processes:#?}");
    assert!(!marker.exists());
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn a_missing_agent_binary_is_a_definite_error_that_leaves_nothing() {
    let guard = RunGuard::new("missing-binary");
    let config = ProcessPluginConfig {
        agent: AgentCommand::new("/nonexistent/provision-node-agent", []),
        ..config(&guard.run)
    };
    let (plugin, recorder) = plugin_with(config).await;
    let key = key(&guard.run, "web", 0, 1);
    let error = plugin
        .create_node(&key, &spec(&key, boot(&[], "")))
        .await
        .unwrap_err();
    let PluginError::Definite(message) = error else {
        panic!("expected a definite error, got {error:?}");
    };
    assert!(
        message.contains("/nonexistent/provision-node-agent"),
        "{message}"
    );
    assert!(plugin.list_nodes(&guard.run).await.unwrap().is_empty());
    assert!(recorder.snapshot().is_empty());
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn dropping_the_plugin_kills_every_node_it_started() {
    let guard = RunGuard::new("drop");
    let (plugin, recorder) = plugin(&guard.run).await;
    let joined_key = key(&guard.run, "web", 0, 1);
    let idle_key = key(&guard.run, "web", 1, 2);
    bring_up(
        &plugin,
        &recorder,
        &joined_key,
        &spec(&joined_key, boot(&[], "sleep 600 & wait")),
    )
    .await;
    plugin
        .create_node(&idle_key, &spec(&idle_key, boot(&[], "")))
        .await
        .unwrap();
    wait_for_processes(&guard.run, "two agents and a workload", |p| p.len() == 4).await;
    drop(plugin);
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn shutdown_stops_every_node_is_idempotent_and_refuses_new_work() {
    let guard = RunGuard::new("shutdown");
    let (plugin, recorder) = plugin(&guard.run).await;
    let first = key(&guard.run, "web", 0, 1);
    let second = key(&guard.run, "web", 1, 2);
    bring_up(
        &plugin,
        &recorder,
        &first,
        &spec(&first, boot(&[], "sleep 600")),
    )
    .await;
    plugin
        .create_node(&second, &spec(&second, boot(&[], "")))
        .await
        .unwrap();
    let before = recorder.snapshot().len();
    plugin.shutdown().await;
    assert!(live(&guard.run).is_empty(), "{:#?}", live(&guard.run));
    plugin.shutdown().await;
    assert!(matches!(
        plugin
            .create_node(&first, &spec(&first, boot(&[], "")))
            .await,
        Err(PluginError::Definite(_))
    ));
    // Stopping on purpose reports no loss.
    assert_eq!(
        recorder.snapshot().len(),
        before,
        "{:#?}",
        recorder.snapshot()
    );
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn a_second_start_bootstrap_adopts_the_running_session() {
    let guard = RunGuard::new("adopt-session");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&["sleep 0.2"], "exec sleep 600"));
    let (lease, first) = create_and_start(&plugin, &key, &spec).await;
    let endpoint = wait_endpoint(&plugin, &key, &lease).await;
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: lease.lease.clone(),
        endpoint,
    };
    let second = plugin.start_bootstrap(&key, &request).await.unwrap();
    assert!(second.adopted);
    assert_eq!(second.session, first.session);
    recorder
        .wait_for("the join", |events| joined(events, &key))
        .await;
    let third = plugin.start_bootstrap(&key, &request).await.unwrap();
    assert!(third.adopted);
    let connecting = recorder
        .bootstrap_events(&key)
        .iter()
        .filter(|e| **e == progress(BootstrapProgress::Connecting))
        .count();
    assert_eq!(connecting, 1, "{:#?}", recorder.bootstrap_events(&key));
    wait_for_processes(&guard.run, "one agent and one workload", |p| p.len() == 2).await;
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn cancel_before_the_join_abandons_the_boot_and_kills_its_commands() {
    let guard = RunGuard::new("cancel");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&["sleep 600"], "sleep 600"));
    let (lease, session) = create_and_start(&plugin, &key, &spec).await;
    recorder
        .wait_for("the boot check to start", |_| {
            recorder
                .bootstrap_events(&key)
                .contains(&progress(BootstrapProgress::BootChecking))
        })
        .await;
    // The shell may run `sleep` as a child of its own: the cancel must
    // reach it too.
    wait_for_processes(&guard.run, "the agent and its verify command", |p| {
        p.iter().any(|p| p.name == "sleep")
    })
    .await;
    plugin
        .cancel_bootstrap(&key, Some(&session.session))
        .await
        .unwrap();
    wait_for_processes(&guard.run, "the verify command to be killed", |p| {
        p.len() == 1 && p[0].is_group_leader()
    })
    .await;
    let events = recorder.bootstrap_events(&key);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, BootstrapEvent::Failed { .. } | BootstrapEvent::Joined)),
        "{events:#?}"
    );
    // Cancelling again, or something already cancelled, succeeds.
    plugin.cancel_bootstrap(&key, None).await.unwrap();
    // An agent boots once: a new start on a cancelled session is refused.
    let endpoint = wait_endpoint(&plugin, &key, &lease).await;
    let request = BootstrapRequest {
        spec,
        lease: lease.lease.clone(),
        endpoint,
    };
    assert!(matches!(
        plugin.start_bootstrap(&key, &request).await,
        Err(PluginError::Definite(_))
    ));
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn a_stopped_agent_makes_start_hang_and_a_retry_adopts_the_session() {
    let guard = RunGuard::new("sigstop");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], "sleep 600"));
    let lease = plugin.create_node(&key, &spec).await.unwrap();
    let endpoint = wait_endpoint(&plugin, &key, &lease).await;
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: lease.lease.clone(),
        endpoint,
    };
    os::signal_agent(&key, Signal::SIGSTOP).unwrap().unwrap();
    wait_for_processes(&guard.run, "the agent to stop", |p| {
        p.len() == 1 && p[0].state == 'T'
    })
    .await;
    // A caller's deadline passes while the agent cannot answer.
    let hung = tokio::time::timeout(
        Duration::from_millis(500),
        plugin.start_bootstrap(&key, &request),
    )
    .await;
    assert!(
        hung.is_err(),
        "start returned while the agent was stopped: {hung:?}"
    );
    os::signal_agent(&key, Signal::SIGCONT).unwrap().unwrap();
    let retry = plugin.start_bootstrap(&key, &request).await.unwrap();
    assert!(retry.adopted);
    recorder
        .wait_for("the join", |events| joined(events, &key))
        .await;
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn destroy_kills_a_stopped_node() {
    let guard = RunGuard::new("destroy-stopped");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], "exec sleep 600"));
    let (lease, _) = bring_up(&plugin, &recorder, &key, &spec).await;
    wait_for_processes(&guard.run, "agent and workload", |p| p.len() == 2).await;
    os::signal_node(&key, Signal::SIGSTOP).unwrap();
    wait_for_processes(&guard.run, "the node to stop", |p| {
        p.iter().all(|p| p.state == 'T')
    })
    .await;
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert!(live(&guard.run).is_empty());
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn a_start_against_a_closed_endpoint_is_definite_and_can_be_retried() {
    let guard = RunGuard::new("closed-endpoint");
    let (plugin, _recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], ""));
    let lease = plugin.create_node(&key, &spec).await.unwrap();
    let real = wait_endpoint(&plugin, &key, &lease).await;
    // A port nobody listens on: bind one, then let it go.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let mut request = BootstrapRequest {
        spec,
        lease: lease.lease.clone(),
        endpoint: Endpoint(closed.to_string()),
    };
    assert!(matches!(
        plugin.start_bootstrap(&key, &request).await,
        Err(PluginError::Definite(_))
    ));
    request.endpoint = Endpoint("example.invalid:80".into());
    assert!(matches!(
        plugin.start_bootstrap(&key, &request).await,
        Err(PluginError::Definite(_))
    ));
    request.endpoint = Endpoint("10.1.2.3:80".into());
    assert!(matches!(
        plugin.start_bootstrap(&key, &request).await,
        Err(PluginError::Definite(_))
    ));
    // Nothing was left behind, so the real endpoint starts afresh.
    request.endpoint = real;
    let session = plugin.start_bootstrap(&key, &request).await.unwrap();
    assert!(!session.adopted);
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn calls_for_another_run_are_refused_and_list_nothing() {
    let guard = RunGuard::new("other-run");
    let (plugin, _recorder) = plugin(&guard.run).await;
    let stranger = key(&unique_run("stranger"), "web", 0, 1);
    assert!(matches!(
        plugin
            .create_node(&stranger, &spec(&stranger, boot(&[], "")))
            .await,
        Err(PluginError::Definite(_))
    ));
    assert!(
        plugin
            .list_nodes(&stranger.run_id)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        plugin
            .lookup_endpoint(&stranger, &LeaseHandle("x".into()))
            .await,
        Err(PluginError::NotFound(format!(
            "no node process for {stranger}"
        )))
    );
    let _ = EndpointLookup::NotReady;
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn boot_commands_run_as_the_boot_user() {
    let guard = RunGuard::new("user");
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "this test switches users and must run as root"
    );
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let mut params = boot(&["test \"$(id -u)\" = 65534"], "exec sleep 600");
    params.user = "nobody".to_owned();
    let (lease, _) = bring_up(&plugin, &recorder, &key, &spec(&key, params)).await;
    let agents = os::agents(&guard.run).unwrap();
    assert_eq!(agents.len(), 1, "{agents:#?}");
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

/// Two hundred nodes up, then destroyed all at once, as a host tearing a
/// fleet down does: every destroy succeeds and nothing of the run is left.
/// (Each destroy used to scan all of `/proc`, and each stopping agent did
/// too, which made a 1000-node teardown stall; see BENCHMARKS.md §5.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_nodes_are_destroyed_at_once_and_leave_nothing() {
    const NODES: u32 = 200;
    let guard = RunGuard::new("fleet-teardown");
    let (plugin, recorder) = plugin(&guard.run).await;
    let keys: Vec<_> = (0..NODES).map(|i| key(&guard.run, "fleet", i, 1)).collect();
    let mut ups = tokio::task::JoinSet::new();
    for key in keys.clone() {
        let plugin = plugin.clone();
        ups.spawn(async move {
            let spec = spec(&key, boot(&["true"], "exec sleep 600"));
            let (lease, _session) = create_and_start(&plugin, &key, &spec).await;
            (key, lease)
        });
    }
    let mut leases = Vec::new();
    while let Some(up) = ups.join_next().await {
        leases.push(up.expect("bring-up task"));
    }
    recorder
        .wait_for("every node to join", |events| {
            keys.iter().all(|key| joined(events, key))
        })
        .await;
    let agents = os::agents(&guard.run).unwrap();
    assert_eq!(agents.len(), keys.len(), "one agent per node");

    let mut downs = tokio::task::JoinSet::new();
    for (key, lease) in leases {
        let plugin = plugin.clone();
        downs.spawn(async move {
            let outcome = plugin.destroy_node(&key, &lease.lease).await;
            (key, outcome)
        });
    }
    while let Some(down) = downs.join_next().await {
        let (key, outcome) = down.expect("destroy task");
        assert!(outcome.is_ok(), "destroy of {key} failed: {outcome:?}");
    }
    assert_no_processes(&guard.run);
    assert!(plugin.list_nodes(&guard.run).await.unwrap().is_empty());
}

/// Design §22: a membership handed to the plugin reaches every joined
/// agent over its swarm connection, which rewrites the node's peers file
/// and runs `on_peers_change` within 2 s.
#[tokio::test]
async fn a_membership_reaches_the_peers_file_of_a_joined_node_within_two_seconds() {
    let guard = RunGuard::new("peers-push");
    let (plugin, recorder) = plugin(&guard.run).await;
    let dir = tempfile::tempdir().unwrap();
    let told = dir.path().join("told");
    let hooked = dir.path().join("hooked");
    let key = key(&guard.run, "web", 0, 1);
    let mut params = boot(
        &[],
        &format!(
            "echo \"$PROVISION_PEERS_FILE $PROVISION_ADDRESS $PROVISION_NODE_INDEX\" > {}; exec sleep 600",
            told.display()
        ),
    );
    params.on_peers_change = format!("cp \"$PROVISION_PEERS_FILE\" {}", hooked.display());
    let spec = spec(&key, params);
    let lease = plugin.create_node(&key, &spec).await.unwrap();
    let endpoint = wait_endpoint(&plugin, &key, &lease).await;
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: lease.lease.clone(),
        endpoint: endpoint.clone(),
    };
    let session = plugin.start_bootstrap(&key, &request).await.unwrap();
    recorder
        .wait_for("the join", |events| joined(events, &key))
        .await;
    plugin
        .complete_bootstrap(&key, Some(&session.session))
        .await
        .unwrap();
    wait_for_processes(&guard.run, "the workload", |_| told.exists()).await;
    let told = std::fs::read_to_string(&told).unwrap();
    let mut parts = told.split_whitespace();
    let peers_file = std::path::PathBuf::from(parts.next().expect("the peers file"));
    let address = parts.next().expect("the address").to_owned();
    assert_eq!(parts.next(), Some("0"), "{told}");
    assert_eq!(Some(address.as_str()), endpoint.0.split(':').next());

    let membership = std::sync::Arc::new(provisioning::Membership {
        version: 7,
        members: vec![provisioning::Member {
            node: key.node.clone(),
            attempt: key.attempt,
            endpoint: endpoint.clone(),
            ready_since: provisioning::Timestamp::from_millis(42),
        }],
        group_sizes: [(key.node.group().clone(), 1)].into_iter().collect(),
    });
    let pushed = Instant::now();
    plugin.membership_changed(&membership);
    let deadline = pushed + Duration::from_secs(2);
    let written = loop {
        let file = std::fs::read_to_string(&peers_file).unwrap_or_default();
        let hook = std::fs::read_to_string(&hooked).unwrap_or_default();
        if file.contains("\"version\": 7") && hook == file {
            break file;
        }
        assert!(
            Instant::now() < deadline,
            "the peers file was not rewritten within 2 s: {file:?}, hook copy {hook:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!("peers file rewritten {:?} after the push", pushed.elapsed());
    let update: serde_json::Value = serde_json::from_str(&written).unwrap();
    assert_eq!(update["groups"]["web"], 1);
    assert_eq!(update["peers"][0]["node"], "web-0");
    assert_eq!(update["peers"][0]["address"], address.as_str());
    assert_eq!(update["peers"][0]["ready_since_ms"], 42);

    plugin.destroy_node(&key, &lease.lease).await.unwrap();
}
