//! The node agent as seen from outside: bad input on its control port is
//! refused without harm, it boots once, and it refuses to run without the
//! controller that started it.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use provisioning_agent::agent::env as agent_env;
use provisioning_agent::codec::{self, MessageReader};
use provisioning_agent::os;
use provisioning_agent::wire::{
    self, BootOrder, ControlReply, ControlRequest, JoinOrder, PROTOCOL_VERSION,
};
use provisioning_provider::{AttemptKey, BootstrapRequest, ProvisionPlugin};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

fn order_for(key: &AttemptKey, swarm: std::net::SocketAddr) -> BootOrder {
    BootOrder {
        protocol: PROTOCOL_VERSION,
        run: key.run_id.as_str().to_owned(),
        node: key.node.to_string(),
        attempt: key.attempt.get(),
        user: String::new(),
        verify_commands: Vec::new(),
        start_command: String::new(),
        env: Default::default(),
        args: Vec::new(),
        join: JoinOrder {
            address: swarm,
            credential: "00".repeat(32),
            swarm: "main".to_owned(),
            labels: Default::default(),
        },
        group_size: None,
        address: None,
        on_peers_change: String::new(),
        resume_only: false,
    }
}

/// Sends `bytes` to the agent's control port and returns its first reply.
async fn first_reply(endpoint: &str, bytes: &[u8]) -> Option<ControlReply> {
    let stream = TcpStream::connect(endpoint).await.unwrap();
    let (read, mut write) = stream.into_split();
    let _ = write.write_all(bytes).await;
    let mut read = MessageReader::new(read);
    tokio::time::timeout(WAIT_MAX, read.next())
        .await
        .expect("the agent answers in time")
        .ok()
        .flatten()
}

fn refused(reply: &Option<ControlReply>) -> bool {
    matches!(reply, Some(ControlReply::Refused { .. }))
}

#[tokio::test]
async fn bad_control_input_is_refused_and_the_agent_still_boots_once() {
    let guard = RunGuard::new("agent-input");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], ""));
    let lease = plugin.create_node(&key, &spec).await.unwrap();
    let endpoint = wait_endpoint(&plugin, &key, &lease).await;
    let swarm = plugin.swarm_address();

    let mut other_node = order_for(&key, swarm);
    other_node.node = "web-1".to_owned();
    let mut off_machine = order_for(&key, swarm);
    off_machine.join.address = "10.0.0.1:4000".parse().unwrap();
    let mut bad_credential = order_for(&key, swarm);
    bad_credential.join.credential = "zz".to_owned();
    let mut unknown_user = order_for(&key, swarm);
    unknown_user.user = "no-such-user-here".to_owned();
    let encode =
        |order: BootOrder| codec::encode_message(&ControlRequest::Boot(Box::new(order))).unwrap();
    let inputs: Vec<(&str, Vec<u8>)> = vec![
        ("not json", b"boot please\n".to_vec()),
        (
            "not a boot order",
            codec::encode_message(&ControlRequest::Join).unwrap(),
        ),
        ("another node's order", encode(other_node)),
        ("an off-machine swarm", encode(off_machine)),
        ("a bad credential", encode(bad_credential)),
        ("an unknown user", encode(unknown_user)),
        ("an oversized line", vec![b'{'; codec::LINE_BYTES_MAX + 1]),
    ];
    for (what, bytes) in inputs {
        let reply = first_reply(&endpoint.0, &bytes).await;
        assert!(refused(&reply), "{what}: {reply:?}");
    }
    let processes = live(&guard.run);
    assert_eq!(
        processes.len(),
        1,
        "the agent must survive bad input: {processes:#?}"
    );

    // None of that booted the agent: the plugin's bootstrap goes through.
    let request = BootstrapRequest {
        spec,
        lease: lease.lease.clone(),
        endpoint: endpoint.clone(),
    };
    plugin.start_bootstrap(&key, &request).await.unwrap();
    recorder
        .wait_for("the join", |events| joined(events, &key))
        .await;
    // An agent boots once.
    let again = first_reply(&endpoint.0, &encode(order_for(&key, swarm))).await;
    assert!(refused(&again), "{again:?}");
    assert_eq!(live(&guard.run).len(), 1);
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

fn agent_command(run: &str) -> std::process::Command {
    let mut command = std::process::Command::new(AGENT);
    command
        .env(os::RUN_TAG, run)
        .env(os::NODE_TAG, "web-0")
        .env(os::ATTEMPT_TAG, "1")
        .env(agent_env::STOP_GRACE_MS, "100")
        .env(agent_env::COMMAND, hex::encode(AGENT))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

#[test]
fn an_agent_whose_controller_is_already_gone_exits_at_once() {
    let guard = RunGuard::new("orphan-start");
    // Its parent is this test, not the controller pid it was told about.
    let output = agent_command(guard.run.as_str())
        .env(agent_env::PARENT_PID, "1")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(
        output.stdout.is_empty(),
        "it announced an endpoint: {output:?}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("is gone"), "{stderr}");
    assert!(live(&guard.run).is_empty());
}

#[test]
fn an_agent_without_its_configuration_refuses_to_start() {
    let guard = RunGuard::new("no-config");
    let output = std::process::Command::new(AGENT)
        .env_remove(os::RUN_TAG)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let output = agent_command(guard.run.as_str())
        .env(agent_env::PARENT_PID, std::process::id().to_string())
        .arg("--surprise")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let output = agent_command(guard.run.as_str())
        .env(agent_env::PARENT_PID, "not-a-pid")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(live(&guard.run).is_empty());
}

#[test]
fn an_agent_stops_its_group_when_its_parent_dies() {
    // A shell stands in for the controller: it starts the agent (as the
    // leader of a new group, like the plugin does) and is then killed.
    let guard = RunGuard::new("parent-dies");
    let mut shell = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(format!(
            "export {}=$$; setsid {} & wait",
            agent_env::PARENT_PID,
            AGENT
        ))
        .env(os::RUN_TAG, guard.run.as_str())
        .env(os::NODE_TAG, "web-0")
        .env(os::ATTEMPT_TAG, "1")
        .env(agent_env::STOP_GRACE_MS, "100")
        .env(agent_env::COMMAND, hex::encode(AGENT))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + WAIT_MAX;
    let found = loop {
        let found = live(&guard.run);
        if found.iter().any(|p| p.is_group_leader()) || std::time::Instant::now() > deadline {
            break found;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        found.iter().any(|p| p.is_group_leader()),
        "the agent never started: {found:#?}"
    );
    shell.kill().unwrap();
    shell.wait().unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn an_agent_whose_join_is_rejected_reports_a_join_failure() {
    let guard = RunGuard::new("join-rejected");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], ""));
    let lease = plugin.create_node(&key, &spec).await.unwrap();
    let endpoint = wait_endpoint(&plugin, &key, &lease).await;
    // The test boots the agent itself, with a credential the swarm refuses.
    let stream = TcpStream::connect(&endpoint.0).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut read = MessageReader::new(read);
    let order = order_for(&key, plugin.swarm_address());
    codec::write_message(&mut write, &ControlRequest::Boot(Box::new(order)))
        .await
        .unwrap();
    let mut replies = Vec::new();
    for _ in 0..4 {
        replies.push(read.next().await.unwrap());
    }
    assert_eq!(
        replies,
        vec![
            Some(ControlReply::Accepted),
            Some(ControlReply::Progress {
                stage: wire::ProgressStage::BootChecking
            }),
            Some(ControlReply::Progress {
                stage: wire::ProgressStage::AgentStarting
            }),
            Some(ControlReply::Progress {
                stage: wire::ProgressStage::WaitingForJoin
            }),
        ]
    );
    codec::write_message(&mut write, &ControlRequest::Join)
        .await
        .unwrap();
    let failure = read.next().await.unwrap();
    let Some(ControlReply::Failed { stage, detail }) = failure else {
        panic!("expected a join failure, got {failure:?}");
    };
    assert_eq!(stage, wire::FailureStage::Join);
    assert!(detail.contains("invalid credential"), "{detail}");
    // The plugin had no session for it: nothing was reported.
    assert!(recorder.snapshot().is_empty(), "{:#?}", recorder.snapshot());
    assert_eq!(live(&guard.run).len(), 1);
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}
