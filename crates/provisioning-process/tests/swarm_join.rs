//! Swarm joins: only the credential of the exact `(run, node, attempt)` gets
//! in, and only while that node's bootstrap waits for the join. Here the test
//! plays the node's agent itself, so it can present any hello it likes while
//! a genuine session is waiting.

mod common;

use std::net::SocketAddr;

use common::*;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::BootstrapProgress;
use provisioning::{Endpoint, Observation, RunId};
use provisioning_agent::codec::{self, MessageReader};
use provisioning_agent::wire::{
    self, ControlReply, ControlRequest, ProgressStage, SwarmHello, SwarmReply,
};
use provisioning_agent::{NodeCredential, RunSecret};
use provisioning_provider::{AttemptKey, BootstrapRequest, ProvisionPlugin};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

fn hello(claimed: &AttemptKey, credential: &NodeCredential) -> SwarmHello {
    SwarmHello {
        protocol: wire::PROTOCOL_VERSION,
        run: claimed.run_id.as_str().to_owned(),
        node: claimed.node.to_string(),
        attempt: claimed.attempt.get(),
        credential: credential.to_hex(),
        swarm: "main".to_owned(),
        labels: Default::default(),
    }
}

/// Sends raw bytes as a hello and returns the swarm's answer, if any.
async fn send_raw(swarm: SocketAddr, bytes: &[u8]) -> Option<SwarmReply> {
    let stream = TcpStream::connect(swarm).await.unwrap();
    let (read, mut write) = stream.into_split();
    // The peer may close before reading everything (an oversized line).
    let _ = write.write_all(bytes).await;
    let _ = write.shutdown().await;
    let mut read = MessageReader::new(read);
    tokio::time::timeout(WAIT_MAX, read.next())
        .await
        .expect("the swarm answers or closes in time")
        .ok()
        .flatten()
}

async fn send_hello(swarm: SocketAddr, hello: &SwarmHello) -> Option<SwarmReply> {
    send_raw(swarm, &codec::encode_message(hello).unwrap()).await
}

fn rejected(reply: &Option<SwarmReply>) -> bool {
    matches!(reply, Some(SwarmReply::Rejected { .. }))
}

#[tokio::test]
async fn forged_and_misattributed_credentials_are_rejected_and_change_nothing() {
    let guard = RunGuard::new("credentials");
    let (plugin, recorder) = plugin(&guard.run).await;
    let swarm = plugin.swarm_address();
    let secret = RunSecret::from_bytes(SECRET);
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], ""));
    let lease = plugin.create_node(&key, &spec).await.unwrap();

    // Before any bootstrap, even the genuine credential finds no session.
    let reply = send_hello(swarm, &hello(&key, &secret.credential(&key))).await;
    assert!(rejected(&reply), "{reply:?}");
    assert!(recorder.snapshot().is_empty());

    // The test answers the plugin's control connection as the agent would.
    let fake_agent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let request = BootstrapRequest {
        spec,
        lease: lease.lease.clone(),
        endpoint: Endpoint(fake_agent.local_addr().unwrap().to_string()),
    };
    let start = tokio::spawn({
        let plugin = plugin.clone();
        let key = key.clone();
        async move { plugin.start_bootstrap(&key, &request).await }
    });
    let (control, _) = fake_agent.accept().await.unwrap();
    let (read, mut write) = control.into_split();
    let mut read = MessageReader::new(read);
    let Some(ControlRequest::Boot(order)) = read.next().await.unwrap() else {
        panic!("expected a boot order first");
    };
    assert_eq!(
        (order.run.as_str(), order.node.as_str(), order.attempt),
        (guard.run.as_str(), "web-0", 1)
    );
    assert_eq!(order.join.address, swarm);
    assert_eq!(order.join.credential, secret.credential(&key).to_hex());
    codec::write_message(&mut write, &ControlReply::Accepted)
        .await
        .unwrap();
    let session = start.await.unwrap().unwrap();
    assert!(!session.adopted);
    for stage in [
        ProgressStage::BootChecking,
        ProgressStage::AgentStarting,
        ProgressStage::WaitingForJoin,
    ] {
        codec::write_message(&mut write, &ControlReply::Progress { stage })
            .await
            .unwrap();
    }
    assert_eq!(read.next().await.unwrap(), Some(ControlRequest::Join));
    recorder
        .wait_for("waiting for join", |_| {
            recorder
                .bootstrap_events(&key)
                .contains(&BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin))
        })
        .await;
    let before = recorder.snapshot();

    // Every one of these is rejected while a genuine session waits.
    let other_node = common::key(&guard.run, "web", 1, 1);
    let other_attempt = common::key(&guard.run, "web", 0, 2);
    let other_run = AttemptKey {
        run_id: RunId::new("someone-else"),
        ..key.clone()
    };
    let other_secret = RunSecret::from_bytes([7; 32]);
    let mut wrong_swarm = hello(&key, &secret.credential(&key));
    wrong_swarm.swarm = "elsewhere".to_owned();
    let mut wrong_protocol = hello(&key, &secret.credential(&key));
    wrong_protocol.protocol = 99;
    let mut bad_hex = hello(&key, &secret.credential(&key));
    bad_hex.credential = "not hex".to_owned();
    let forgeries = [
        ("forged", hello(&key, &NodeCredential::from_bytes([0; 32]))),
        (
            "another node's",
            hello(&key, &secret.credential(&other_node)),
        ),
        (
            "another attempt's",
            hello(&key, &secret.credential(&other_attempt)),
        ),
        ("another run's", hello(&key, &secret.credential(&other_run))),
        (
            "another secret's",
            hello(&key, &other_secret.credential(&key)),
        ),
        (
            "claiming another run",
            hello(&other_run, &secret.credential(&other_run)),
        ),
        ("wrong swarm", wrong_swarm),
        ("wrong protocol", wrong_protocol),
        ("bad hex", bad_hex),
    ];
    for (what, forged) in &forgeries {
        let reply = send_hello(swarm, forged).await;
        assert!(rejected(&reply), "{what} credential: {reply:?}");
        assert_eq!(
            recorder.snapshot(),
            before,
            "{what} credential changed something"
        );
    }
    let long_line = vec![b'x'; codec::LINE_BYTES_MAX + 1];
    for (what, bytes) in [
        ("not json", &b"hello there\n"[..]),
        ("wrong message", &b"{\"type\":\"welcome\"}\n"[..]),
        ("oversized", &long_line[..]),
        ("truncated", &b"{\"type\":\"hel"[..]),
    ] {
        let reply = send_raw(swarm, bytes).await;
        assert!(rejected(&reply), "{what}: {reply:?}");
        assert_eq!(recorder.snapshot(), before, "{what} changed something");
    }

    // The genuine hello gets in, exactly once.
    let member = TcpStream::connect(swarm).await.unwrap();
    let (member_read, mut member_write) = member.into_split();
    let mut member_read = MessageReader::new(member_read);
    codec::write_message(&mut member_write, &hello(&key, &secret.credential(&key)))
        .await
        .unwrap();
    assert_eq!(member_read.next().await.unwrap(), Some(SwarmReply::Welcome));
    recorder
        .wait_for("the join", |events| joined(events, &key))
        .await;
    let after_join = recorder.snapshot();
    let replay = send_hello(swarm, &hello(&key, &secret.credential(&key))).await;
    assert!(rejected(&replay), "a second join got in: {replay:?}");
    assert_eq!(recorder.snapshot(), after_join);

    // Completing closes the session on both sides.
    plugin
        .complete_bootstrap(&key, Some(&session.session))
        .await
        .unwrap();
    assert_eq!(read.next().await.unwrap(), Some(ControlRequest::Close));
    assert_eq!(
        recorder.bootstrap_events(&key).last(),
        Some(&BootstrapEvent::Closed)
    );

    // The member's connection ending is the loss of the node.
    drop(member_write);
    drop(member_read);
    let events = recorder
        .wait_for("the loss", |events| {
            events
                .iter()
                .any(|o| matches!(o, Observation::NodeLost { .. }))
        })
        .await;
    assert_eq!(
        events.last(),
        Some(&Observation::NodeLost {
            node: key.node.clone(),
            attempt: key.attempt,
            cause: LossCause::AgentGone,
        })
    );
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}

#[tokio::test]
async fn a_malformed_message_from_the_agent_fails_the_session_with_a_stream_error() {
    let guard = RunGuard::new("hang-up");
    let (plugin, recorder) = plugin(&guard.run).await;
    let key = key(&guard.run, "web", 0, 1);
    let spec = spec(&key, boot(&[], ""));
    let lease = plugin.create_node(&key, &spec).await.unwrap();
    let fake_agent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let request = BootstrapRequest {
        spec,
        lease: lease.lease.clone(),
        endpoint: Endpoint(fake_agent.local_addr().unwrap().to_string()),
    };
    let start = tokio::spawn({
        let plugin = plugin.clone();
        let key = key.clone();
        async move { plugin.start_bootstrap(&key, &request).await }
    });
    let (control, _) = fake_agent.accept().await.unwrap();
    let (read, mut write) = control.into_split();
    let mut read = MessageReader::<ControlRequest, _>::new(read);
    read.next().await.unwrap();
    codec::write_message(&mut write, &ControlReply::Accepted)
        .await
        .unwrap();
    start.await.unwrap().unwrap();
    // A malformed line from the agent breaks the session: reported once.
    write.write_all(b"garbage\n").await.unwrap();
    let events = recorder
        .wait_for("the stream error", |events| {
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
    assert!(matches!(
        events.last(),
        Some(Observation::Bootstrap {
            event: BootstrapEvent::Failed {
                failure: provisioning::state::BootstrapFailure::StreamError,
                ..
            },
            ..
        })
    ));
    plugin.destroy_node(&key, &lease.lease).await.unwrap();
    assert_no_processes(&guard.run);
}
