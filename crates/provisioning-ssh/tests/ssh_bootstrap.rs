//! `start_bootstrap` over real SSH with the real node agent: the agent is
//! installed once per content hash, started detached with its boot order
//! (and credential) in a `0600` file written from the script on standard
//! input, and joins the plugin's own swarm listener over TCP; the join, the
//! handoff and the losses are the observations the driver needs.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Testbed, agents_under, key, process_alive, processes_mentioning, spec};
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{BootParams, EndpointLookup, LogicalNodeSpec, Observation};
use provisioning_agent::RunSecret;
use provisioning_provider::{
    AttemptKey, BootstrapRequest, NodeLease, ObservationSink, PluginError, ProvisionPlugin,
};
use provisioning_ssh::SshPlugin;

const AGENT: &str = env!("CARGO_BIN_EXE_provision-remote-agent");

/// How many times a test looks for an expected fact (20 ms apart).
const POLLS_MAX: usize = 3_000;

type Facts = Arc<Mutex<Vec<Observation>>>;

fn collect(plugin: &SshPlugin) -> Facts {
    let facts: Facts = Arc::new(Mutex::new(Vec::new()));
    let seen = facts.clone();
    plugin.attach(ObservationSink::new(move |o| {
        seen.lock().expect("facts").push(o)
    }));
    facts
}

async fn wait_for(what: &str, facts: &Facts, wanted: impl Fn(&[Observation]) -> bool) {
    for _ in 0..POLLS_MAX {
        if wanted(&facts.lock().expect("facts")) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "{what} was never reported; facts: {:#?}",
        facts.lock().expect("facts")
    );
}

fn events_of(facts: &Facts, key: &AttemptKey) -> Vec<BootstrapEvent> {
    facts
        .lock()
        .expect("facts")
        .iter()
        .filter_map(|o| match o {
            Observation::Bootstrap {
                node,
                attempt,
                event,
            } if *node == key.node && *attempt == key.attempt => Some(event.clone()),
            _ => None,
        })
        .collect()
}

fn joined(key: &AttemptKey) -> impl Fn(&[Observation]) -> bool + '_ {
    move |facts| {
        facts.iter().any(|o| {
            matches!(o, Observation::Bootstrap { node, attempt, event: BootstrapEvent::Joined }
                if *node == key.node && *attempt == key.attempt)
        })
    }
}

fn lost(key: &AttemptKey, cause: LossCause) -> impl Fn(&[Observation]) -> bool + '_ {
    move |facts| {
        facts.iter().any(|o| {
            *o == Observation::NodeLost {
                node: key.node.clone(),
                attempt: key.attempt,
                cause,
            }
        })
    }
}

async fn create_and_request(
    plugin: &SshPlugin,
    key: &AttemptKey,
    node_spec: &LogicalNodeSpec,
) -> (NodeLease, BootstrapRequest) {
    let lease = plugin.create_node(key, node_spec).await.expect("create");
    let endpoint = match plugin
        .lookup_endpoint(key, &lease.lease)
        .await
        .expect("lookup")
    {
        EndpointLookup::Ready(endpoint) => endpoint,
        EndpointLookup::NotReady => panic!("a live host is ready"),
    };
    let request = BootstrapRequest {
        spec: node_spec.clone(),
        lease: lease.lease.clone(),
        endpoint,
    };
    (lease, request)
}

fn sleeper() -> BootParams {
    BootParams {
        on_peers_change: String::new(),
        verify_commands: vec!["true".into(), "test -n \"$GREETING\"".into()],
        start_command: "sleep 600".into(),
        env: [("GREETING".to_owned(), "hello".to_owned())].into(),
        ..BootParams::default()
    }
}

fn read_pid(path: &std::path::Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_joins_after_the_reported_stages_and_the_handoff_keeps_it_running() {
    let bed = Testbed::start(1);
    let secret = RunSecret::generate();
    let plugin = bed
        .agent_plugin("boot", 2, bed.agent_config(AGENT, secret.clone(), 0))
        .await;
    let facts = collect(&plugin);
    let k = key("boot", "w", 0, 1);
    let (lease, request) = create_and_request(&plugin, &k, &spec(&k, sleeper())).await;

    let first = plugin.start_bootstrap(&k, &request).await.expect("start");
    assert!(!first.adopted);
    wait_for("the agent's join", &facts, joined(&k)).await;
    assert_eq!(
        events_of(&facts, &k),
        vec![
            BootstrapEvent::Progress(BootstrapProgress::Connecting),
            BootstrapEvent::Progress(BootstrapProgress::Connected),
            BootstrapEvent::Progress(BootstrapProgress::BootChecking),
            BootstrapEvent::Progress(BootstrapProgress::AgentStarting),
            BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin),
            BootstrapEvent::Joined,
        ]
    );
    let claims = bed.hosts[0].claims();
    let session = claims.join("boot/w-0/a1/session");
    let agent = read_pid(&session.join("pid"));
    assert!(process_alive(&agent), "the agent runs after ssh returned");
    assert_eq!(agents_under(&claims).len(), 1, "one agent on the host");
    let workload = provisioning_agent::os::node_processes(&k).expect("scan /proc");
    assert!(
        !workload.is_empty(),
        "the workload runs, tagged with its key"
    );

    // The credential is nowhere but in the agent's memory.
    let credential = plugin.swarm().expect("a swarm").credential(&k).to_hex();
    assert!(!session.join("order").exists(), "the boot file is removed");
    let log = std::fs::read_to_string(session.join("log")).unwrap_or_default();
    let status = std::fs::read_to_string(session.join("status")).unwrap_or_default();
    assert!(!log.contains(&credential), "the credential reached the log");
    assert!(
        !status.contains(&credential),
        "the credential reached the status"
    );
    assert_eq!(
        processes_mentioning(&credential),
        Vec::new(),
        "the credential is on a command line or in an environment"
    );

    // A second start adopts the running session and reports no second join.
    let second = plugin
        .start_bootstrap(&k, &request)
        .await
        .expect("start again");
    assert!(second.adopted);
    assert_eq!(second.session, first.session);
    plugin
        .complete_bootstrap(&k, Some(&first.session))
        .await
        .expect("complete");
    let events = events_of(&facts, &k);
    assert_eq!(
        events
            .iter()
            .filter(|e| **e == BootstrapEvent::Joined)
            .count(),
        1
    );
    assert_eq!(events.last(), Some(&BootstrapEvent::Closed));
    assert!(
        process_alive(&agent),
        "the handoff leaves the agent running"
    );

    // The same agent content is not uploaded again for a second node.
    let k2 = key("boot", "w", 1, 2);
    let (lease2, request2) = create_and_request(&plugin, &k2, &spec(&k2, sleeper())).await;
    let agents_dir = claims.join(".agents");
    let installed_before = std::fs::metadata(&agents_dir)
        .and_then(|m| m.modified())
        .expect("agents dir");
    plugin
        .start_bootstrap(&k2, &request2)
        .await
        .expect("start 2");
    wait_for("the second agent's join", &facts, joined(&k2)).await;
    assert_eq!(
        std::fs::read_dir(&agents_dir).expect("agents").count(),
        1,
        "one installed agent"
    );
    assert_eq!(
        std::fs::metadata(&agents_dir)
            .and_then(|m| m.modified())
            .expect("agents dir"),
        installed_before,
        "nothing was uploaded for the second node"
    );

    // Cancel stops the second node's agent and keeps its claim.
    let agent2 = read_pid(&claims.join("boot/w-1/a2/session/pid"));
    plugin.cancel_bootstrap(&k2, None).await.expect("cancel");
    assert!(!process_alive(&agent2), "cancel stops the agent");
    assert!(claims.join("boot/w-1/a2").is_dir());
    plugin
        .destroy_node(&k2, &lease2.lease)
        .await
        .expect("destroy 2");

    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
    assert!(!process_alive(&agent), "destroy stops the agent");
    assert_eq!(
        provisioning_agent::os::node_processes(&k).expect("scan /proc"),
        Vec::new(),
        "destroy stops the workload"
    );
    assert!(!claims.join("boot/w-0/a1").exists());
    assert!(agents_under(&claims).is_empty());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !facts
            .lock()
            .expect("facts")
            .iter()
            .any(|o| matches!(o, Observation::NodeLost { .. })),
        "stopping agents through the plugin is no loss: {:#?}",
        facts.lock().expect("facts")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_verify_command_is_definite_and_starts_nothing() {
    let bed = Testbed::start(1);
    let plugin = bed
        .agent_plugin(
            "verify",
            1,
            bed.agent_config(AGENT, RunSecret::generate(), 0),
        )
        .await;
    let k = key("verify", "w", 0, 1);
    let params = BootParams {
        on_peers_change: String::new(),
        verify_commands: vec!["true".into(), "echo nope >&2; false".into()],
        start_command: "sleep 600".into(),
        ..BootParams::default()
    };
    let (lease, request) = create_and_request(&plugin, &k, &spec(&k, params)).await;
    match plugin.start_bootstrap(&k, &request).await {
        Err(PluginError::Definite(message)) => {
            assert!(message.contains("#2"), "{message}");
            assert!(message.contains("nope"), "{message}");
        }
        other => panic!("a failing verify command: {other:?}"),
    }
    let claims = bed.hosts[0].claims();
    assert!(!claims.join("verify/w-0/a1/session").exists());
    assert!(agents_under(&claims).is_empty());
    assert!(
        !plugin.swarm().expect("a swarm").is_expected(&k),
        "a boot that started nothing expects no join"
    );
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_cannot_start_its_workload_fails_the_bootstrap_with_its_reason() {
    let bed = Testbed::start(1);
    let mut agent = bed.agent_config(AGENT, RunSecret::generate(), 0);
    agent.join_timeout = Duration::from_secs(3);
    let plugin = bed.agent_plugin("nojoin", 1, agent).await;
    let facts = collect(&plugin);
    let k = key("nojoin", "w", 0, 1);
    let params = BootParams {
        on_peers_change: String::new(),
        user: "no-such-user-of-this-test".into(),
        start_command: "sleep 600".into(),
        ..BootParams::default()
    };
    let (lease, request) = create_and_request(&plugin, &k, &spec(&k, params)).await;
    plugin.start_bootstrap(&k, &request).await.expect("start");
    wait_for("the bootstrap failure", &facts, |facts| {
        facts.iter().any(|o| {
            matches!(o, Observation::Bootstrap {
                event: BootstrapEvent::Failed { failure: BootstrapFailure::StartFailed, detail },
                ..
            } if detail.contains("no-such-user-of-this-test"))
        })
    })
    .await;
    assert!(!plugin.swarm().expect("a swarm").is_expected(&k));
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_agent_is_a_lost_node_under_its_attempt() {
    let bed = Testbed::start(1);
    let plugin = bed
        .agent_plugin("kill", 1, bed.agent_config(AGENT, RunSecret::generate(), 0))
        .await;
    let facts = collect(&plugin);
    let k = key("kill", "w", 0, 4);
    let (lease, request) = create_and_request(&plugin, &k, &spec(&k, sleeper())).await;
    plugin.start_bootstrap(&k, &request).await.expect("start");
    wait_for("the agent's join", &facts, joined(&k)).await;
    let agent = read_pid(&bed.hosts[0].claims().join("kill/w-0/a4/session/pid"));
    let status = std::process::Command::new("kill")
        .args(["-KILL", &agent])
        .status()
        .expect("kill");
    assert!(status.success());
    wait_for(
        "the loss of the killed agent's node",
        &facts,
        lost(&k, LossCause::AgentGone),
    )
    .await;
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
    assert_eq!(
        provisioning_agent::os::node_processes(&k).expect("scan /proc"),
        Vec::new(),
        "destroy stops the orphaned workload"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_partitioned_agent_is_a_lost_node() {
    let bed = Testbed::start_netns(1);
    let link = bed.hosts[0].netns.as_ref().expect("a host in a namespace");
    let plugin = bed
        .agent_plugin("cut", 1, bed.agent_config(AGENT, RunSecret::generate(), 0))
        .await;
    let facts = collect(&plugin);
    let k = key("cut", "w", 0, 3);
    let (lease, request) = create_and_request(&plugin, &k, &spec(&k, sleeper())).await;
    plugin.start_bootstrap(&k, &request).await.expect("start");
    wait_for("the agent's join", &facts, joined(&k)).await;
    // The host's link goes down: no reset, no close, the connection just
    // goes silent. Only the swarm's TCP keepalive can notice.
    link.partition();
    wait_for(
        "the loss of the partitioned host's node",
        &facts,
        lost(&k, LossCause::AgentGone),
    )
    .await;
    link.heal();
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy after the partition healed");
    assert_eq!(
        provisioning_agent::os::node_processes(&k).expect("scan /proc"),
        Vec::new(),
        "destroy stops the partitioned node's agent and workload"
    );
}

/// A free port of `address`, to give a restarted plugin the same one.
fn free_port(address: std::net::Ipv4Addr) -> u16 {
    std::net::TcpListener::bind((address, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_plugin_adopts_running_agents_and_loses_the_dead_ones() {
    let bed = Testbed::start(1);
    let secret = RunSecret::generate();
    let port = free_port(bed.controller_address());
    let (kept, dead) = (key("again", "w", 0, 1), key("again", "w", 1, 2));
    let claims = bed.hosts[0].claims();
    let (lease_kept, lease_dead, agent_kept, agent_dead, workload) = {
        let plugin = bed
            .agent_plugin("again", 2, bed.agent_config(AGENT, secret.clone(), port))
            .await;
        let facts = collect(&plugin);
        let mut leases = Vec::new();
        for k in [&kept, &dead] {
            let (lease, request) = create_and_request(&plugin, k, &spec(k, sleeper())).await;
            let session = plugin.start_bootstrap(k, &request).await.expect("start");
            wait_for("the agent's join", &facts, joined(k)).await;
            plugin
                .complete_bootstrap(k, Some(&session.session))
                .await
                .expect("complete");
            leases.push(lease.lease);
        }
        let workload = provisioning_agent::os::node_processes(&kept).expect("scan");
        (
            leases[0].clone(),
            leases[1].clone(),
            read_pid(&claims.join("again/w-0/a1/session/pid")),
            read_pid(&claims.join("again/w-1/a2/session/pid")),
            workload,
        )
        // The controller goes away; its agents re-dial.
    };
    // One agent dies while no controller runs.
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &agent_dead])
            .status()
            .expect("kill")
            .success()
    );
    let mut agent = bed.agent_config(AGENT, secret, port);
    // Long enough for a re-dialing agent (its pause grows to 2 s), short
    // enough that the dead agent's node is lost soon.
    agent.adopt_wait = Duration::from_secs(8);
    let mut plugin = None;
    for _ in 0..POLLS_MAX {
        match SshPlugin::start(bed.config("again", 2), agent.clone()).await {
            Ok(started) => {
                plugin = Some(started);
                break;
            }
            // The old listener's port is released asynchronously.
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let plugin = plugin.expect("the restarted plugin binds the same port");
    let facts = collect(&plugin);
    let listed = plugin
        .list_nodes(&provisioning::RunId::new("again"))
        .await
        .expect("list");
    assert_eq!(listed.len(), 2);
    let swarm = plugin.swarm().expect("a swarm");
    assert!(
        swarm.wait_connected(&kept, Duration::from_secs(30)).await,
        "the running agent re-joins the restarted controller"
    );
    wait_for(
        "the loss of the node whose agent died",
        &facts,
        lost(&dead, LossCause::AgentGone),
    )
    .await;
    assert_eq!(
        read_pid(&claims.join("again/w-0/a1/session/pid")),
        agent_kept,
        "the same agent"
    );
    assert!(process_alive(&agent_kept));
    assert_eq!(
        provisioning_agent::os::node_processes(&kept).expect("scan"),
        workload,
        "the workload was not restarted"
    );
    assert!(
        events_of(&facts, &kept).is_empty(),
        "an adopted re-join reports no bootstrap fact"
    );
    assert!(!lost(&kept, LossCause::AgentGone)(
        &facts.lock().expect("facts")
    ));
    plugin
        .destroy_node(&kept, &lease_kept)
        .await
        .expect("destroy kept");
    plugin
        .destroy_node(&dead, &lease_dead)
        .await
        .expect("destroy dead");
    assert!(agents_under(&claims).is_empty());
    assert_eq!(
        provisioning_agent::os::node_processes(&kept).expect("scan"),
        Vec::new()
    );
}
