//! Helpers shared by the process plugin's tests: unique runs, a guard that
//! kills what a test leaves behind, a recording sink, and specs.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use provisioning::observe::BootstrapEvent;
use provisioning::{
    BootParams, Endpoint, EndpointLookup, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId,
    NodeTemplate, Observation, ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_agent::RunSecret;
use provisioning_agent::os::{self, TaggedProcess};
use provisioning_process::{AgentCommand, AgentLifetime, ProcessPlugin, ProcessPluginConfig};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, NodeLease, ObservationSink, ProvisionPlugin,
};

/// The agent binary built for these tests.
pub const AGENT: &str = env!("CARGO_BIN_EXE_provision-node-agent");

/// A safety bound on every wait in a test; never a performance assertion.
pub const WAIT_MAX: Duration = Duration::from_secs(30);

/// How often waits look again.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// The secret every test plugin uses, so tests can derive credentials.
pub const SECRET: [u8; 32] = [42; 32];

/// A run id no other test (or test process) uses.
pub fn unique_run(name: &str) -> RunId {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let serial = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut text = format!("t{}-{serial}-{name}", std::process::id());
    text.truncate(63);
    RunId::new(text)
}

/// Kills every process of its run when dropped, so that a failing test
/// leaves nothing behind.
pub struct RunGuard {
    pub run: RunId,
}

impl RunGuard {
    pub fn new(name: &str) -> Self {
        RunGuard {
            run: unique_run(name),
        }
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        match os::kill_run(&self.run, Duration::from_secs(10)) {
            Ok(left) if left.is_empty() => {}
            Ok(left) => eprintln!("run {} left processes behind: {left:#?}", self.run),
            Err(error) => eprintln!("cannot clean up run {}: {error}", self.run),
        }
    }
}

/// The live processes of `run`, from `/proc`.
pub fn live(run: &RunId) -> Vec<TaggedProcess> {
    os::run_processes(run).expect("/proc is readable")
}

/// Waits (bounded) until `run` has no live process, and fails with the
/// survivors otherwise.
pub fn assert_no_processes(run: &RunId) {
    let left = os::wait_until_run_gone(run, WAIT_MAX).expect("/proc is readable");
    assert!(
        left.is_empty(),
        "processes of run {run} survived: {left:#?}"
    );
}

/// Waits (bounded) until `check` holds for the live processes of `run`.
pub async fn wait_for_processes(
    run: &RunId,
    what: &str,
    check: impl Fn(&[TaggedProcess]) -> bool,
) -> Vec<TaggedProcess> {
    let deadline = tokio::time::Instant::now() + WAIT_MAX;
    loop {
        let processes = live(run);
        if check(&processes) {
            return processes;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; processes of {run}: {processes:#?}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// A sink that records every observation.
#[derive(Clone, Default)]
pub struct Recorder {
    events: Arc<Mutex<Vec<Observation>>>,
}

impl Recorder {
    pub fn sink(&self) -> ObservationSink {
        let events = self.events.clone();
        ObservationSink::new(move |observation| {
            events
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(observation);
        })
    }

    pub fn snapshot(&self) -> Vec<Observation> {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The bootstrap events of `key`, in order.
    pub fn bootstrap_events(&self, key: &AttemptKey) -> Vec<BootstrapEvent> {
        self.snapshot()
            .into_iter()
            .filter_map(|observation| match observation {
                Observation::Bootstrap {
                    node,
                    attempt,
                    event,
                } if node == key.node && attempt == key.attempt => Some(event),
                _ => None,
            })
            .collect()
    }

    /// Waits (bounded) until `check` holds for the recorded observations.
    pub async fn wait_for(
        &self,
        what: &str,
        check: impl Fn(&[Observation]) -> bool,
    ) -> Vec<Observation> {
        let deadline = tokio::time::Instant::now() + WAIT_MAX;
        loop {
            let events = self.snapshot();
            if check(&events) {
                return events;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}; observed so far: {events:#?}"
            );
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

pub fn key(run: &RunId, group: &str, index: u32, attempt: u64) -> AttemptKey {
    AttemptKey {
        run_id: run.clone(),
        node: LogicalNodeId::new(GroupId::new(group), index),
        attempt: NodeAttemptId::from_raw(attempt),
    }
}

pub fn boot(verify: &[&str], start: &str) -> BootParams {
    BootParams {
        on_peers_change: String::new(),
        user: String::new(),
        verify_commands: verify.iter().map(|c| (*c).to_owned()).collect(),
        start_command: start.to_owned(),
        env: BTreeMap::new(),
        args: Vec::new(),
    }
}

pub fn spec(key: &AttemptKey, boot: BootParams) -> LogicalNodeSpec {
    let template = NodeTemplate {
        role: "worker".to_owned(),
        provider: "process".to_owned(),
        shape: ProviderShape::default(),
        boot,
        swarm_join: SwarmJoinTemplate {
            swarm: "main".to_owned(),
            labels: BTreeMap::new(),
        },
    };
    LogicalNodeSpec::new(key.node.clone(), key.run_id.clone(), Arc::new(template))
}

pub fn config(run: &RunId) -> ProcessPluginConfig {
    ProcessPluginConfig {
        run_id: run.clone(),
        agent: AgentCommand::new(AGENT, []),
        run_secret: RunSecret::from_bytes(SECRET),
        stop_grace: Duration::from_millis(500),
        lifetime: AgentLifetime::WithController,
    }
}

/// A started plugin with a recording sink attached.
pub async fn plugin(run: &RunId) -> (Arc<ProcessPlugin>, Recorder) {
    plugin_with(config(run)).await
}

/// `config(run)` with agents that outlive the plugin, logging to `log_dir`.
pub fn detached_config(run: &RunId, log_dir: Option<&std::path::Path>) -> ProcessPluginConfig {
    ProcessPluginConfig {
        lifetime: AgentLifetime::Detached {
            log_dir: log_dir.map(std::path::Path::to_owned),
        },
        ..config(run)
    }
}

pub async fn plugin_with(config: ProcessPluginConfig) -> (Arc<ProcessPlugin>, Recorder) {
    let plugin = ProcessPlugin::start(config).await.expect("plugin starts");
    let recorder = Recorder::default();
    plugin.attach(recorder.sink());
    (plugin, recorder)
}

/// Probes the endpoint until the agent reports it (bounded).
pub async fn wait_endpoint(
    plugin: &ProcessPlugin,
    key: &AttemptKey,
    lease: &NodeLease,
) -> Endpoint {
    let deadline = tokio::time::Instant::now() + WAIT_MAX;
    loop {
        match plugin
            .lookup_endpoint(key, &lease.lease)
            .await
            .expect("lookup succeeds")
        {
            EndpointLookup::Ready(endpoint) => return endpoint,
            EndpointLookup::NotReady => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the endpoint of {key} never became ready"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Creates the node of `key` and starts its bootstrap.
pub async fn create_and_start(
    plugin: &ProcessPlugin,
    key: &AttemptKey,
    spec: &LogicalNodeSpec,
) -> (NodeLease, BootstrapSession) {
    let lease = plugin
        .create_node(key, spec)
        .await
        .expect("create succeeds");
    let endpoint = wait_endpoint(plugin, key, &lease).await;
    let request = BootstrapRequest {
        spec: spec.clone(),
        lease: lease.lease.clone(),
        endpoint,
    };
    let session = plugin
        .start_bootstrap(key, &request)
        .await
        .expect("bootstrap starts");
    (lease, session)
}

/// Whether `events` hold the join of `key`.
pub fn joined(events: &[Observation], key: &AttemptKey) -> bool {
    events.iter().any(|o| {
        matches!(o, Observation::Bootstrap { node, attempt, event: BootstrapEvent::Joined }
            if *node == key.node && *attempt == key.attempt)
    })
}

/// Brings the node of `key` up to its join.
pub async fn bring_up(
    plugin: &ProcessPlugin,
    recorder: &Recorder,
    key: &AttemptKey,
    spec: &LogicalNodeSpec,
) -> (NodeLease, BootstrapSession) {
    let started = create_and_start(plugin, key, spec).await;
    recorder
        .wait_for(&format!("{key} to join"), |events| joined(events, key))
        .await;
    started
}
