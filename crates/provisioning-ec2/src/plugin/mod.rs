//! [`Ec2Plugin`]: leases that are EC2 instances tagged with their attempt.
//!
//! The plugin's parts: this module (the type, its construction, tags and
//! the loss watch), `agent` (what is known of each attempt's agent) and
//! `seam` (the `ProvisionPlugin` methods).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use provisioning::effect::SessionHandle;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{
    Endpoint, EndpointLookup, LeaseHandle, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, RunId,
};
use provisioning_agent::RunSecret;
use provisioning_agent::remote::{
    DEFAULT_REJOIN_GRACE, RemoteError, RemoteSwarm, RemoteSwarmConfig,
};
use provisioning_agent::wire::{self, BootOrder, JoinOrder};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use sha2::Digest;
use thiserror::Error;

use crate::client::{ApiEndpoint, Ec2Client, Filter, RunRequest};
use crate::config::{AddressChoice, GroupShape};
use crate::credentials::Credentials;
use crate::response::{Instance, InstanceState};
use crate::userdata;

mod agent;
mod seam;

use agent::Shared;

/// The provider kind this plugin serves.
pub const PROVIDER_KIND: &str = "ec2";

/// The tag marking an instance as managed by `provision`.
pub const TAG_MANAGED_BY: &str = "provision:managed-by";
/// The managed-by tag's value.
pub const MANAGED_BY: &str = "provision";
/// The tag naming the run.
pub const TAG_RUN: &str = "provision:run";
/// The tag naming the slot.
pub const TAG_NODE: &str = "provision:node";
/// The tag naming the attempt (`a3`).
pub const TAG_ATTEMPT: &str = "provision:attempt";

/// The state reason EC2 gives a spot instance it took back.
pub const SPOT_TERMINATION_REASON: &str = "Server.SpotInstanceTermination";

/// The default time an API call may take.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// The default time a booted instance's agent may take to join.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long an adopted instance's agent may take to re-join after a restart.
pub const DEFAULT_ADOPT_WAIT: Duration = Duration::from_secs(30);
/// The agent's path in the image when the settings name none.
pub const DEFAULT_AGENT_PATH: &str = "/usr/local/bin/provision-agent";

/// Why a node's instance went away without `provision` asking.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LossReason {
    /// A spot interruption took it back.
    Preempted,
    /// Someone or something else terminated (or stopped) it.
    TerminatedOutside,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::Preempted => "preempted",
            LossReason::TerminatedOutside => "terminated outside provision",
        })
    }
}

/// Where and as whom the plugin calls the API.
#[derive(Clone, Debug)]
pub struct Ec2PluginConfig {
    /// The run.
    pub run_id: RunId,
    /// The API endpoint.
    pub endpoint: ApiEndpoint,
    /// The region.
    pub region: String,
    /// The credentials.
    pub credentials: Credentials,
    /// How long one API call may take.
    pub request_timeout: Duration,
    /// Which address is a node's endpoint.
    pub address: AddressChoice,
}

/// The node agent the instances start and the listener they dial.
#[derive(Clone, Debug)]
pub struct Ec2AgentConfig {
    /// The agent executable's path on the instance.
    pub program: String,
    /// Its leading arguments (none for `provision-agent`).
    pub args: Vec<String>,
    /// The run's secret: join credentials derive from it.
    pub secret: RunSecret,
    /// The address the swarm listener binds.
    pub listen: SocketAddr,
    /// The address agents dial, when it differs from `listen`.
    pub advertised: Option<SocketAddr>,
    /// How long a booted instance's agent may take to join.
    pub join_timeout: Duration,
    /// How long, beyond the re-join grace, an adopted agent may take.
    pub adopt_wait: Duration,
    /// How long a dropped agent may take to re-join.
    pub rejoin_grace: Duration,
    /// How long an agent that lost the swarm re-dials before it stops.
    pub rejoin_window: Option<Duration>,
}

impl Ec2AgentConfig {
    /// Defaults for `program`, `secret` and `listen`.
    pub fn new(program: impl Into<String>, secret: RunSecret, listen: SocketAddr) -> Self {
        Ec2AgentConfig {
            program: program.into(),
            args: Vec::new(),
            secret,
            listen,
            advertised: None,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            adopt_wait: DEFAULT_ADOPT_WAIT,
            rejoin_grace: DEFAULT_REJOIN_GRACE,
            rejoin_window: None,
        }
    }
}

/// [`Ec2Plugin::start`] failed; nothing was started.
#[derive(Debug, Error)]
pub enum Ec2StartError {
    /// The swarm listener could not be bound.
    #[error(transparent)]
    Swarm(#[from] RemoteError),
    /// Not called inside a tokio runtime.
    #[error("the ec2 plugin must be started inside a tokio runtime")]
    NoRuntime,
}

/// A [`ProvisionPlugin`] over the EC2 API.
///
/// # How it works
/// - A lease is an instance tagged `provision:run`, `provision:node`,
///   `provision:attempt` and `provision:managed-by = provision`; the lease
///   handle is `ec2:{instance id}`.
/// - `create_node` lists the key's live instances by tag and adopts one;
///   only when there is none does it call `RunInstances`, with a
///   `ClientToken` derived from the attempt key. Both, because some
///   EC2-compatible servers ignore tokens: the listing keeps those from
///   double-creating, the token keeps a lost reply from doing so on AWS
///   (where a new instance may not be listed at once).
/// - The endpoint is the instance's private (or public) address once it is
///   `running`; `pending` is not ready; an ending instance is not found.
/// - Boot: the instance's user-data starts the agent ([`crate::userdata`]),
///   which dials the plugin's [`RemoteSwarm`]; `start_bootstrap` only
///   reports the stages and waits for the join.
/// - `destroy_node` terminates; an unknown or ending instance is success, a
///   live one after the call is ambiguous (asked again).
/// - [`Ec2Plugin::check_losses`] (one paged listing of the run) reports an
///   instance that ended without `provision` asking as a lost node, with its
///   [`LossReason`] (a spot interruption is `preempted`).
/// - No call is retried inside the plugin: see [`crate::Ec2Error`].
pub struct Ec2Plugin {
    config: Arc<Ec2PluginConfig>,
    client: Ec2Client,
    shared: Arc<Shared>,
    agent: Option<AgentRuntime>,
    /// The live instances this instance of the plugin created or adopted:
    /// what the loss watch watches.
    known: Mutex<BTreeMap<AttemptKey, String>>,
    /// Why each lost attempt was lost.
    losses: Mutex<BTreeMap<AttemptKey, LossReason>>,
}

struct AgentRuntime {
    config: Ec2AgentConfig,
    swarm: Arc<RemoteSwarm>,
}

/// The background loss watch ([`Ec2Plugin::start_watch`]); dropping it
/// stops the watch.
#[derive(Debug)]
pub struct WatchHandle(tokio::task::AbortHandle);

impl Drop for WatchHandle {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl fmt::Debug for Ec2Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ec2Plugin")
            .field("run_id", &self.config.run_id)
            .field("endpoint", &self.config.endpoint)
            .field("region", &self.config.region)
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The `ClientToken` of an attempt: at most 64 ASCII characters, the same
/// for every call of the attempt and different for every other attempt.
pub fn client_token(key: &AttemptKey) -> String {
    let digest = sha2::Sha256::digest(key.to_string().as_bytes());
    format!("provision-{}", &hex::encode(digest)[..48])
}

/// The lease handle of an instance.
fn lease_of(id: &str) -> LeaseHandle {
    LeaseHandle(format!("ec2:{id}"))
}

/// The instance a lease names.
fn instance_of(lease: &LeaseHandle) -> Option<&str> {
    lease
        .0
        .strip_prefix("ec2:")
        .filter(|id| id.starts_with("i-"))
}

/// The attempt an instance's tags name, for run `run`.
fn key_of(instance: &Instance, run: &RunId) -> Option<AttemptKey> {
    if instance.tags.get(TAG_RUN)? != run.as_str()
        || instance.tags.get(TAG_MANAGED_BY).map(String::as_str) != Some(MANAGED_BY)
    {
        return None;
    }
    let node = LogicalNodeId::parse(instance.tags.get(TAG_NODE)?).ok()?;
    let attempt = instance
        .tags
        .get(TAG_ATTEMPT)?
        .strip_prefix('a')?
        .parse::<u64>()
        .ok()?;
    Some(AttemptKey {
        run_id: run.clone(),
        node,
        attempt: NodeAttemptId::from_raw(attempt),
    })
}

impl Ec2Plugin {
    /// A plugin without an agent: it creates, lists and destroys instances,
    /// and its `start_bootstrap` fails definitely.
    pub fn new(config: Ec2PluginConfig) -> Self {
        let client = Ec2Client::new(
            config.endpoint.clone(),
            config.region.clone(),
            config.credentials.clone(),
            config.request_timeout,
        );
        Ec2Plugin {
            config: Arc::new(config),
            client,
            shared: Arc::new(Shared::default()),
            agent: None,
            known: Mutex::new(BTreeMap::new()),
            losses: Mutex::new(BTreeMap::new()),
        }
    }

    /// A plugin whose instances start `agent`'s node agent: binds the swarm
    /// listener on the current tokio runtime.
    ///
    /// # Errors
    /// [`Ec2StartError`] when the listener cannot be bound or outside a
    /// tokio runtime.
    pub async fn start(
        config: Ec2PluginConfig,
        agent: Ec2AgentConfig,
    ) -> Result<Arc<Self>, Ec2StartError> {
        tokio::runtime::Handle::try_current().map_err(|_| Ec2StartError::NoRuntime)?;
        let mut plugin = Ec2Plugin::new(config);
        let events = plugin.shared.clone();
        let swarm = RemoteSwarm::bind(
            RemoteSwarmConfig {
                run_id: plugin.config.run_id.clone(),
                secret: agent.secret.clone(),
                listen: agent.listen,
                advertised: agent.advertised,
                rejoin_grace: agent.rejoin_grace,
            },
            move |event| events.on_event(event),
        )
        .await?;
        tracing::info!(
            run = %plugin.config.run_id,
            endpoint = %plugin.config.endpoint.authority,
            swarm = %swarm.advertised(),
            "ec2 plugin started"
        );
        plugin.agent = Some(AgentRuntime {
            config: agent,
            swarm: Arc::new(swarm),
        });
        Ok(Arc::new(plugin))
    }

    /// The API client.
    pub fn client(&self) -> &Ec2Client {
        &self.client
    }

    /// The swarm listener agents dial, for a plugin made with
    /// [`Ec2Plugin::start`].
    pub fn swarm(&self) -> Option<&RemoteSwarm> {
        self.agent.as_ref().map(|a| a.swarm.as_ref())
    }

    /// Why `key`'s node was lost, when the loss watch found it gone.
    pub fn loss_reason(&self, key: &AttemptKey) -> Option<LossReason> {
        lock(&self.losses).get(key).copied()
    }

    /// The controller this plugin reports to was replaced in-process by one
    /// recovered from its journal; see the ssh plugin's method of that name.
    pub fn controller_replaced(&self) -> usize {
        self.shared.controller_replaced()
    }

    /// Starts a task calling [`Ec2Plugin::check_losses`] every `interval`
    /// until the handle or the plugin is dropped.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn start_watch(self: &Arc<Self>, interval: Duration) -> WatchHandle {
        let plugin = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(plugin) = plugin.upgrade() else {
                    return;
                };
                if let Err(error) = plugin.check_losses().await {
                    tracing::debug!(%error, "loss check incomplete");
                }
            }
        });
        WatchHandle(task.abort_handle())
    }

    /// Lists the run's instances once (one paged `DescribeInstances`) and
    /// reports every watched attempt whose instance ended or vanished as a
    /// lost node ([`LossCause::LeaseGone`]), remembering its
    /// [`LossReason`]. Returns how many were reported.
    ///
    /// # Errors
    /// When the listing failed; nothing is reported then.
    pub async fn check_losses(&self) -> Result<usize, PluginError> {
        if lock(&self.known).is_empty() {
            return Ok(0);
        }
        let filters = [
            Filter::new(format!("tag:{TAG_RUN}"), &[self.config.run_id.as_str()]),
            Filter::new(format!("tag:{TAG_MANAGED_BY}"), &[MANAGED_BY]),
        ];
        let listed = self
            .client
            .describe_instances(&filters, &[])
            .await
            .map_err(|e| e.into_plugin_error("watching instances", false))?;
        let by_id: BTreeMap<&str, &Instance> = listed.iter().map(|i| (i.id.as_str(), i)).collect();
        let mut lost = 0;
        // Copied first: the loop takes the lock again.
        let watched = lock(&self.known).clone();
        for (key, id) in watched {
            let reason = match by_id.get(id.as_str()) {
                Some(instance) if !instance.state.is_ending() => {
                    if !matches!(
                        instance.state,
                        InstanceState::Stopping | InstanceState::Stopped
                    ) {
                        continue;
                    }
                    LossReason::TerminatedOutside
                }
                Some(instance)
                    if instance.state_reason.as_deref() == Some(SPOT_TERMINATION_REASON) =>
                {
                    LossReason::Preempted
                }
                _ => LossReason::TerminatedOutside,
            };
            // Still watched: not destroyed through this plugin meanwhile.
            if lock(&self.known).remove(&key).is_some() {
                tracing::warn!(node = %key, instance = %id, %reason, "instance ended: node lost");
                lock(&self.losses).insert(key.clone(), reason);
                self.forget_agent(&key);
                self.shared.report_lost(&key, LossCause::LeaseGone);
                lost += 1;
            }
        }
        Ok(lost)
    }

    fn watch(&self, key: &AttemptKey, id: &str) {
        if key.run_id == self.config.run_id {
            lock(&self.known).insert(key.clone(), id.to_owned());
        }
    }

    fn forget_agent(&self, key: &AttemptKey) {
        self.shared.forget(key);
        if let Some(agent) = &self.agent {
            agent.swarm.forget(key);
        }
    }

    /// The tags of `key`'s instance: the shape's extras, then the
    /// provider's own (which win).
    fn tags(&self, key: &AttemptKey, shape: &GroupShape) -> BTreeMap<String, String> {
        let mut tags = shape.tags.clone();
        tags.insert(TAG_MANAGED_BY.to_owned(), MANAGED_BY.to_owned());
        tags.insert(TAG_RUN.to_owned(), key.run_id.as_str().to_owned());
        tags.insert(TAG_NODE.to_owned(), key.node.to_string());
        tags.insert(TAG_ATTEMPT.to_owned(), key.attempt.to_string());
        tags.insert("Name".to_owned(), format!("provision {key}"));
        tags
    }

    /// The filters of `key`'s live instances.
    fn key_filters(key: &AttemptKey) -> Vec<Filter> {
        vec![
            Filter::new(format!("tag:{TAG_RUN}"), &[key.run_id.as_str()]),
            Filter::new(format!("tag:{TAG_NODE}"), &[&key.node.to_string()]),
            Filter::new(format!("tag:{TAG_ATTEMPT}"), &[&key.attempt.to_string()]),
            Filter::new(format!("tag:{TAG_MANAGED_BY}"), &[MANAGED_BY]),
            Filter::new("instance-state-name", &InstanceState::LIVE),
        ]
    }

    /// The user-data of `key`: the agent's start with its boot order, or an
    /// empty script for a plugin without an agent.
    fn user_data(&self, key: &AttemptKey, spec: &LogicalNodeSpec) -> Result<String, PluginError> {
        let Some(agent) = &self.agent else {
            return Ok("#!/bin/sh\n".to_owned());
        };
        let order = serde_json::to_string(&self.boot_order(agent, key, spec))
            .map_err(|e| PluginError::definite(format!("encoding the boot order: {e}")))?;
        let agent_env: Vec<(&str, String)> = agent
            .config
            .rejoin_window
            .map(|w| {
                (
                    provisioning_agent::agent::env::REJOIN_WINDOW_MS,
                    w.as_millis().to_string(),
                )
            })
            .into_iter()
            .collect();
        let dir = format!("{}/{}/{}", key.run_id, key.node, key.attempt);
        Ok(userdata::script(
            &dir,
            &agent.config.program,
            &agent.config.args,
            &agent_env,
            &order,
        ))
    }

    fn boot_order(
        &self,
        agent: &AgentRuntime,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> BootOrder {
        let template = spec.template();
        let boot = &template.boot;
        BootOrder {
            protocol: wire::PROTOCOL_VERSION,
            run: key.run_id.as_str().to_owned(),
            node: key.node.to_string(),
            attempt: key.attempt.get(),
            user: boot.user.clone(),
            verify_commands: boot.verify_commands.clone(),
            start_command: boot.start_command.clone(),
            env: boot.env.clone(),
            args: boot.args.clone(),
            join: JoinOrder {
                address: agent.swarm.advertised(),
                credential: agent.swarm.credential(key).to_hex(),
                swarm: template.swarm_join.swarm.clone(),
                labels: template.swarm_join.labels.clone(),
            },
            resume_only: false,
            group_size: agent.swarm.group_size(key.node.group()),
            // Unknown when the user-data is written (before the instance
            // has an address): the peers file carries it.
            address: None,
            on_peers_change: boot.on_peers_change.clone(),
        }
    }

    fn endpoint_of(&self, instance: &Instance) -> Option<Endpoint> {
        let address = match self.config.address {
            AddressChoice::Private => instance.private_ip.as_ref(),
            AddressChoice::Public => instance.public_ip.as_ref(),
        }?;
        Some(Endpoint(format!("ec2://{}@{address}", instance.id)))
    }

    /// Fails `key`'s bootstrap unless its agent joins within the join timeout.
    fn spawn_join_watchdog(&self, agent: &AgentRuntime, key: &AttemptKey) {
        let swarm = agent.swarm.clone();
        let shared = self.shared.clone();
        let wait = agent.config.join_timeout;
        let watched = key.clone();
        let task = tokio::spawn(async move {
            let key = watched;
            if swarm.wait_connected(&key, wait).await
                || shared.is_joined(&key)
                || !swarm.is_expected(&key)
            {
                return;
            }
            swarm.forget(&key);
            shared.agents().remove(&key);
            let detail = format!(
                "the instance's agent did not join within {wait:?} (is the agent at its path in the image, and can the instance reach the listener {}?)",
                swarm.advertised()
            );
            tracing::warn!(node = %key, %detail, "the agent did not join");
            shared.report(
                &key,
                BootstrapEvent::Failed {
                    failure: BootstrapFailure::JoinFailed,
                    detail,
                },
            );
        });
        let previous = self
            .shared
            .agents()
            .entry(key.clone())
            .or_default()
            .watchdog
            .replace(task.abort_handle());
        if let Some(previous) = previous {
            previous.abort();
        }
    }

    /// A listed instance of this run: its agent may have joined an earlier
    /// controller; it is expected to re-join (adopted, workload untouched).
    fn adopt_agent(&self, key: &AttemptKey) {
        let Some(agent) = &self.agent else {
            return;
        };
        if key.run_id != self.config.run_id || agent.swarm.is_expected(key) {
            return;
        }
        agent.swarm.expect_adopted(key, agent.config.adopt_wait);
    }
}

/// The error of a bootstrap asked of a plugin without an agent.
fn no_agent() -> PluginError {
    PluginError::definite(
        "this ec2 plugin has no node agent to start (made with Ec2Plugin::new; Ec2Plugin::start configures one)",
    )
}
