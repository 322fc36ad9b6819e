//! What the tests on the private engine share: a plugin over an
//! [`Engine`], node specs, and a bounded wait.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use provisioning::{
    BootParams, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate, ProviderShape, RunId,
    SwarmJoinTemplate,
};
use provisioning_agent::RunSecret;
use provisioning_container::testbed::{Engine, TEST_IMAGE};
use provisioning_container::{AgentSource, ContainerPlugin, ContainerPluginConfig};
use provisioning_provider::AttemptKey;

/// The agent binary of this crate.
pub const AGENT: &str = env!("CARGO_BIN_EXE_provision-container-agent");

/// How often the plugin under test looks for containers that ended.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// The longest any wait of a test takes before it fails with a diagnosis.
pub const WAIT: Duration = Duration::from_secs(60);

/// A private engine with the test image made for this crate's agent.
pub fn engine() -> Engine {
    Engine::start(std::path::Path::new(AGENT))
}

pub fn config(engine: &Engine, run: &str, secret: RunSecret) -> ContainerPluginConfig {
    let mut config =
        ContainerPluginConfig::new(RunId::new(run), secret, AgentSource::Mount(AGENT.into()));
    config.socket = engine.socket();
    config.listen = SocketAddr::new(engine.gateway(), 0);
    config.watch_interval = WATCH_INTERVAL;
    config.rejoin_grace = Duration::from_millis(500);
    config.stop_grace = Duration::from_secs(2);
    config
}

/// A plugin of `run` on the engine.
pub async fn plugin(engine: &Engine, run: &str) -> Arc<ContainerPlugin> {
    Arc::new(
        ContainerPlugin::start(config(engine, run, RunSecret::generate()))
            .await
            .expect("start the container plugin"),
    )
}

pub fn key(run: &str, node: &str, attempt: u64) -> AttemptKey {
    AttemptKey {
        run_id: RunId::new(run),
        node: LogicalNodeId::parse(node).expect("node id"),
        attempt: NodeAttemptId::from_raw(attempt),
    }
}

/// The group table of the tests: the test image on the engine's network.
pub fn labels(engine: &Engine) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("container.image".to_owned(), TEST_IMAGE.to_owned()),
        ("container.network".to_owned(), engine.network().to_owned()),
    ])
}

/// A spec of `key`'s slot with `labels` (the group's `container` table)
/// and `start` as the workload.
pub fn spec(key: &AttemptKey, labels: BTreeMap<String, String>, start: &str) -> LogicalNodeSpec {
    let template = NodeTemplate {
        role: key.node.group().as_str().to_owned(),
        provider: "container".to_owned(),
        shape: ProviderShape {
            image: String::new(),
            resources: BTreeMap::new(),
            labels,
        },
        boot: BootParams {
            user: String::new(),
            verify_commands: vec!["true".to_owned()],
            start_command: start.to_owned(),
            env: BTreeMap::new(),
            args: Vec::new(),
            on_peers_change: String::new(),
        },
        swarm_join: SwarmJoinTemplate {
            swarm: "default".to_owned(),
            labels: BTreeMap::new(),
        },
    };
    LogicalNodeSpec::new(key.node.clone(), key.run_id.clone(), Arc::new(template))
}

/// Waits (bounded by [`WAIT`]) until `done` holds; panics with `what`.
pub async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::time::Instant::now() < deadline {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out after {WAIT:?} waiting for {what}");
}
