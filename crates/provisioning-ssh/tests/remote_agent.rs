//! The remote agent path on its own, over loopback: a real agent process in
//! remote boot mode joins a [`RemoteSwarm`], its losses are reported, and a
//! re-bound listener (a restarted controller) gets it back without a
//! workload restart.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use provisioning::observe::{LossCause, WorkloadEnd};
use provisioning::{LogicalNodeId, NodeAttemptId, RunId};
use provisioning_agent::RunSecret;
use provisioning_agent::remote::{RemoteEvent, RemoteSwarm, RemoteSwarmConfig};
use provisioning_agent::wire::{BootOrder, JoinOrder, PROTOCOL_VERSION};
use provisioning_provider::AttemptKey;

const AGENT: &str = env!("CARGO_BIN_EXE_provision-remote-agent");
const WAIT: Duration = Duration::from_secs(20);

/// Kills the agent's whole process group when the test ends, however.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        let pgid = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["-KILL", "--", &pgid]).status();
        let _ = self.0.wait();
    }
}

fn key(node: &str) -> AttemptKey {
    AttemptKey {
        run_id: RunId::new("run-remote-test"),
        node: LogicalNodeId::parse(node).expect("node id"),
        attempt: NodeAttemptId::from_raw(1),
    }
}

type Events = Arc<Mutex<Vec<RemoteEvent>>>;

async fn swarm(secret: &RunSecret, listen: &str, events: &Events) -> RemoteSwarm {
    // A dropped listener's task lets go of its port soon, not at once.
    let mut last = None;
    for _ in 0..100 {
        let events = events.clone();
        let bound = RemoteSwarm::bind(
            RemoteSwarmConfig {
                run_id: RunId::new("run-remote-test"),
                secret: secret.clone(),
                listen: listen.parse().expect("address"),
                advertised: None,
                rejoin_grace: Duration::from_millis(500),
            },
            move |event| events.lock().expect("events").push(event),
        )
        .await;
        match bound {
            Ok(swarm) => return swarm,
            Err(error) => last = Some(error),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("cannot bind {listen}: {last:?}")
}

fn write_order(
    dir: &Path,
    swarm: &RemoteSwarm,
    key: &AttemptKey,
    start: &str,
    mode: u32,
) -> std::path::PathBuf {
    let order = BootOrder {
        protocol: PROTOCOL_VERSION,
        run: key.run_id.as_str().to_owned(),
        node: key.node.to_string(),
        attempt: key.attempt.get(),
        user: String::new(),
        verify_commands: vec!["true".to_owned()],
        start_command: start.to_owned(),
        env: BTreeMap::new(),
        args: Vec::new(),
        join: JoinOrder {
            address: swarm.advertised(),
            credential: swarm.credential(key).to_hex(),
            swarm: "default".to_owned(),
            labels: BTreeMap::new(),
        },
        group_size: None,
        address: None,
        on_peers_change: String::new(),
        resume_only: false,
    };
    let path = dir.join(format!("{}.json", key.node));
    std::fs::write(&path, serde_json::to_vec(&order).expect("json")).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    path
}

fn start(order: &Path, status: &Path, window_ms: u64) -> Group {
    Group(
        Command::new(AGENT)
            .env("PROVISION_AGENT_BOOT_FILE", order)
            .env("PROVISION_AGENT_STATUS_FILE", status)
            .env("PROVISION_AGENT_REJOIN_WINDOW_MS", window_ms.to_string())
            .env("PROVISION_AGENT_STOP_GRACE_MS", "500")
            .stdin(Stdio::null())
            .spawn()
            .expect("start the agent"),
    )
}

async fn wait_for(events: &Events, wanted: &RemoteEvent) {
    for _ in 0..(WAIT.as_millis() / 20) {
        if events.lock().expect("events").contains(wanted) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no {wanted:?}; saw {:?}", events.lock().expect("events"));
}

#[tokio::test]
async fn joins_rejoins_after_a_restart_and_is_lost_when_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = RunSecret::generate();
    let events = Events::default();
    let first = swarm(&secret, "127.0.0.1:0", &events).await;
    let address = first.local_addr();
    let key = key("remote-1");
    first.expect(&key);
    let order = write_order(dir.path(), &first, &key, "sleep 300", 0o600);
    let status = dir.path().join("status");
    let mut agent = start(&order, &status, 30_000);
    assert!(
        first.wait_connected(&key, WAIT).await,
        "the agent never joined"
    );
    wait_for(&events, &RemoteEvent::Joined(key.clone())).await;
    assert!(!order.exists(), "the boot file must be removed once read");
    // The agent writes the stage just after its welcome.
    let mut stages = String::new();
    for _ in 0..(WAIT.as_millis() / 20) {
        stages = std::fs::read_to_string(&status).unwrap_or_default();
        if stages.contains("\"joined\"") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(stages.contains("\"joined\""), "stages: {stages}");
    assert!(!stages.contains(&first.credential(&key).to_hex()));

    // The controller goes away and comes back on the same address.
    drop(first);
    let second = swarm(&secret, &address.to_string(), &events).await;
    second.expect_adopted(&key, WAIT);
    assert!(second.wait_connected(&key, WAIT).await, "no re-join");
    wait_for(&events, &RemoteEvent::Rejoined(key.clone())).await;
    assert_eq!(
        agent.0.try_wait().expect("wait"),
        None,
        "the agent restarted"
    );

    // A real fault: the agent is killed; the node is lost after the grace.
    agent.0.kill().expect("kill");
    wait_for(
        &events,
        &RemoteEvent::Lost(key.clone(), LossCause::AgentGone),
    )
    .await;
    assert!(second.expected().is_empty());
}

#[tokio::test]
async fn workload_exit_is_a_loss_and_stops_the_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = RunSecret::generate();
    let events = Events::default();
    let swarm = swarm(&secret, "127.0.0.1:0", &events).await;
    let key = key("remote-2");
    swarm.expect(&key);
    let order = write_order(dir.path(), &swarm, &key, "sleep 1", 0o600);
    let mut agent = start(&order, &dir.path().join("status"), 30_000);
    wait_for(
        &events,
        &RemoteEvent::Lost(
            key.clone(),
            LossCause::WorkloadEnded(WorkloadEnd::Status(0)),
        ),
    )
    .await;
    let exit = tokio::task::spawn_blocking(move || {
        let code = agent.0.wait().map(|s| s.code());
        (agent, code)
    })
    .await
    .expect("join");
    assert_eq!(exit.1.expect("wait"), Some(0));
}

#[tokio::test]
async fn a_boot_file_readable_by_others_is_refused_and_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = RunSecret::generate();
    let events = Events::default();
    let swarm = swarm(&secret, "127.0.0.1:0", &events).await;
    let key = key("remote-3");
    swarm.expect(&key);
    let order = write_order(dir.path(), &swarm, &key, "sleep 300", 0o644);
    let mut agent = start(&order, &dir.path().join("status"), 30_000);
    let code = tokio::task::spawn_blocking(move || agent.0.wait().map(|s| s.code()))
        .await
        .expect("join")
        .expect("wait");
    assert_eq!(code, Some(2));
    assert!(!order.exists());
    assert!(events.lock().expect("events").is_empty());
}

#[tokio::test]
async fn an_abandoned_agent_stops_after_its_rejoin_window() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret = RunSecret::generate();
    let events = Events::default();
    let swarm = swarm(&secret, "127.0.0.1:0", &events).await;
    let key = key("remote-4");
    swarm.expect(&key);
    let order = write_order(dir.path(), &swarm, &key, "sleep 300", 0o600);
    let mut agent = start(&order, &dir.path().join("status"), 1_000);
    assert!(swarm.wait_connected(&key, WAIT).await);
    drop(swarm);
    let code = tokio::task::spawn_blocking(move || agent.0.wait().map(|s| s.code()))
        .await
        .expect("join")
        .expect("wait");
    assert_eq!(code, Some(0), "the agent stops once its window is over");
}
