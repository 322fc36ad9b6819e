//! Shared fixtures of the host tests: an in-memory plugin on virtual time.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::BootstrapProgress;
use provisioning::{
    BootParams, ClusterShape, Endpoint, EndpointLookup, Generation, GroupId, LeaseHandle,
    LogicalNodeSpec, NodeGroup, NodeTemplate, ProviderShape, RetryPolicy, RunId, SessionHandle,
    SwarmJoinTemplate,
};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use provisioning_runtime::{HostConfig, HostHandle, StatusSnapshot};

/// The bound on every wait in these tests, in virtual time.
pub const WAIT_BOUND: Duration = Duration::from_secs(600);
/// How often the tests poll the host, in virtual time.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
pub const RUN: &str = "test-run";

#[derive(Debug)]
pub struct FakeNode {
    pub lease: LeaseHandle,
    pub session: bool,
}

/// An in-memory provider: nodes are map entries; a bootstrap reports
/// progress and the join shortly after it starts.
/// A check run at the start of every plugin call, with its key and method.
pub type CallCheck = Box<dyn Fn(&AttemptKey, &str) + Send + Sync>;

#[derive(Default)]
pub struct FakePlugin {
    pub sink: Mutex<Option<ObservationSink>>,
    pub nodes: Mutex<BTreeMap<AttemptKey, FakeNode>>,
    pub creates: AtomicUsize,
    pub hang_destroy: AtomicBool,
    pub slow_create_once: Mutex<Option<Duration>>,
    pub shut_down: AtomicBool,
    /// Called at the start of every call with its key and method name.
    pub on_call: Mutex<Option<CallCheck>>,
    /// Whether handed-off agents stay away from a restarted controller: by
    /// default each re-joins it when the controller lists the nodes.
    pub agents_stay_away: AtomicBool,
}

impl FakePlugin {
    fn called(&self, key: &AttemptKey, method: &str) {
        if let Some(check) = self.on_call.lock().unwrap().as_ref() {
            check(key, method);
        }
    }

    pub fn sink(&self) -> ObservationSink {
        self.sink.lock().unwrap().clone().expect("attached")
    }

    pub fn live(&self) -> Vec<(String, u64)> {
        self.nodes
            .lock()
            .unwrap()
            .keys()
            .map(|k| (k.node.to_string(), k.attempt.get()))
            .collect()
    }

    /// Reports the loss of the live node of `slot`, as a crashed process would.
    pub fn kill(&self, slot: &str) {
        let key = {
            let mut nodes = self.nodes.lock().unwrap();
            let key = nodes
                .keys()
                .find(|k| k.node.to_string() == slot)
                .cloned()
                .expect("slot is live");
            nodes.remove(&key);
            key
        };
        self.sink().lost(&key, LossCause::AgentGone);
    }
}

#[async_trait]
impl ProvisionPlugin for FakePlugin {
    fn kind(&self) -> &str {
        "fake"
    }

    fn attach(&self, sink: ObservationSink) {
        *self.sink.lock().unwrap() = Some(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        _spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        self.called(key, "create_node");
        let delay = self.slow_create_once.lock().unwrap().take();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        self.creates.fetch_add(1, Ordering::SeqCst);
        let mut nodes = self.nodes.lock().unwrap();
        let adopted = nodes.contains_key(key);
        let node = nodes.entry(key.clone()).or_insert_with(|| FakeNode {
            lease: LeaseHandle(format!("lease-{key}")),
            session: false,
        });
        Ok(NodeLease {
            lease: node.lease.clone(),
            endpoint: None,
            adopted,
        })
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        self.called(key, "lookup_endpoint");
        if self.nodes.lock().unwrap().contains_key(key) {
            Ok(EndpointLookup::Ready(Endpoint(format!("fake://{key}"))))
        } else {
            Err(PluginError::not_found(key))
        }
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        _request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        self.called(key, "start_bootstrap");
        let adopted = {
            let mut nodes = self.nodes.lock().unwrap();
            let node = nodes
                .get_mut(key)
                .ok_or_else(|| PluginError::not_found(key))?;
            std::mem::replace(&mut node.session, true)
        };
        if !adopted {
            let sink = self.sink();
            let key = key.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                sink.bootstrap(
                    &key,
                    BootstrapEvent::Progress(BootstrapProgress::AgentStarting),
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
                sink.bootstrap(&key, BootstrapEvent::Joined);
            });
        }
        Ok(BootstrapSession {
            session: SessionHandle(format!("session-{key}")),
            adopted,
        })
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.called(key, "complete_bootstrap");
        self.sink().bootstrap(key, BootstrapEvent::Closed);
        Ok(())
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.called(key, "cancel_bootstrap");
        if let Some(node) = self.nodes.lock().unwrap().get_mut(key) {
            node.session = false;
        }
        Ok(())
    }

    async fn destroy_node(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<(), PluginError> {
        self.called(key, "destroy_node");
        if self.hang_destroy.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.nodes.lock().unwrap().remove(key);
        Ok(())
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        let (listed, agents): (Vec<ListedNode>, Vec<AttemptKey>) = {
            let nodes = self.nodes.lock().unwrap();
            let ours = nodes.iter().filter(|(k, _)| &k.run_id == run);
            (
                ours.clone()
                    .map(|(k, n)| ListedNode {
                        key: k.clone(),
                        lease: n.lease.clone(),
                    })
                    .collect(),
                ours.filter(|(_, n)| n.session)
                    .map(|(k, _)| k.clone())
                    .collect(),
            )
        };
        // A listing is what a restarted controller does first: the agents
        // of its nodes re-dial it then (a re-join of an agent that never
        // left changes nothing).
        if !self.agents_stay_away.load(Ordering::SeqCst)
            && let Some(sink) = self.sink.lock().unwrap().clone()
        {
            for key in &agents {
                sink.rejoined(key);
            }
        }
        Ok(listed)
    }
}

pub fn group(id: &str, count: u32, start: &str) -> NodeGroup {
    NodeGroup {
        id: GroupId::new(id),
        run_id: RunId::new(RUN),
        count,
        template: NodeTemplate {
            role: "worker".into(),
            provider: "fake".into(),
            shape: ProviderShape::default(),
            boot: BootParams {
                on_peers_change: String::new(),
                start_command: start.into(),
                ..BootParams::default()
            },
            swarm_join: SwarmJoinTemplate::default(),
        },
    }
}

pub fn shape(generation: u64, groups: Vec<NodeGroup>) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new(RUN),
        generation: Generation::new(generation),
        groups,
    }
}

pub fn config() -> HostConfig {
    let mut config = HostConfig::new(RunId::new(RUN));
    config.policy = RetryPolicy {
        operation_timeout: Duration::from_secs(2),
        ..RetryPolicy::default()
    };
    config.shutdown_deadline = Duration::from_secs(20);
    config
}

/// Polls the host until `done` holds, failing with the last snapshot when
/// the bound passes.
pub async fn wait_until(
    handle: &HostHandle,
    what: &str,
    done: impl Fn(&StatusSnapshot) -> bool,
) -> StatusSnapshot {
    let deadline = tokio::time::Instant::now() + WAIT_BOUND;
    loop {
        let snapshot = handle.status().await;
        if done(&snapshot) {
            return snapshot;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}; last status: {snapshot:#?}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

pub fn converged_at(generation: u64) -> impl Fn(&StatusSnapshot) -> bool {
    move |s| s.converged && s.generation == generation
}

pub fn attempts(snapshot: &StatusSnapshot) -> BTreeMap<String, u64> {
    snapshot
        .nodes
        .iter()
        .map(|n| (n.id.clone(), n.attempt))
        .collect()
}
