//! [`SshPlugin`]: leases that are slots claimed on the hosts of an inventory.
//!
//! The plugin's parts: this module (the type, its construction, claims and
//! losses), `install` (the agent's upload by content hash), `launch`
//! (starting and adopting agents, the join watchdog) and `seam` (the
//! `ProvisionPlugin` methods).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;
use provisioning::effect::SessionHandle;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{
    Endpoint, EndpointLookup, LeaseHandle, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, RunId,
};
use provisioning_agent::remote::{RemoteSwarm, RemoteSwarmConfig};
use provisioning_agent::wire::{self, BootOrder, ControlReply, FailureStage, JoinOrder};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use sha2::Digest;

use crate::agent::{Shared, SshAgentConfig, SshStartError};
use crate::config::{ConfigErrors, SshHost, SshPluginConfig, is_safe_name};
use crate::script;
use crate::ssh::{self, Reply, SshFailure, quote};

mod install;
mod launch;
mod reach;
mod seam;

use install::file_digest;

/// The provider kind this plugin serves.
pub const PROVIDER_KIND: &str = "ssh";

/// A closed port on every host: where the fault hook's refused connections go.
const REFUSED_PORT: u16 = 1;

/// A step of the plugin the fault hook can fault (see [`SshPlugin::arm_fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultStep {
    /// The claim of a slot in `create_node` (after the look for an existing claim).
    Claim,
    /// The release of a claim in `destroy_node`.
    Release,
}

/// How a faulted step fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultMode {
    /// The step's SSH connection goes to a closed port of the host: a real
    /// refused connection, before anything ran (definite).
    Refused,
    /// The step runs on the host, then its reply is thrown away (ambiguous).
    ReplyLost,
}

/// A [`ProvisionPlugin`] over a static inventory of SSH hosts.
///
/// # How it works
/// - A lease is a claim directory `{claim_root}/{run}/{node}/a{attempt}` on
///   one host, created with `mkdir` while holding `flock` on
///   `{claim_root}/.lock` after counting the host's claims (of every run)
///   against its `slots`. The claim lives on the host, so `create_node`
///   adopts it and `list_nodes` finds it from any controller, also after a
///   restart. The lease handle is `ssh:{host}:{run}/{node}/a{attempt}`.
/// - `create_node` first asks every host whether the key's claim exists
///   (adopting it when it does), then claims a slot on the first host that
///   has one free, in inventory order starting at the host of the node's
///   index (so a group spreads over the inventory and its creates do not
///   all queue for one host's lock). No free slot anywhere is a definite
///   failure that names the inventory and says what each host answered.
/// - Every call is one `ssh … sh -s` with the script on standard input,
///   `BatchMode=yes`, `StrictHostKeyChecking=yes` against the configured
///   known-hosts file only, and `ConnectTimeout`. A host key that is unknown
///   or changed is a definite failure with a loud message.
/// - A call that never connected (refused, timed out, no route, not
///   authenticated, bad host key) did nothing: definite. A call that broke
///   or timed out after its script may have started is ambiguous.
///
/// - A claim that disappears from its host (removed by hand, host
///   reinstalled) is reported lost ([`LossCause::LeaseGone`]) under its own
///   attempt by [`SshPlugin::check_losses`], which [`SshPlugin::start_watch`]
///   runs periodically.
///
/// # Bootstrap: the node agent
/// A plugin made with [`SshPlugin::start`] owns a swarm listener
/// ([`RemoteSwarm`]) and starts the node agent on its hosts
/// (`provisioning_agent::agent`, remote boot mode). `start_bootstrap` is
/// one SSH call (plus one upload the first time a host lacks the agent):
/// with the host key verified, it runs the verify commands, and starts the
/// installed agent detached (a session of its own, so it outlives the SSH
/// connection and the controller) with its boot order — and the
/// per-attempt credential — in a `0600` file written from the script on
/// standard input, never on a command line. The agent's first join is
/// reported `Joined`; a lost agent or an exited workload is a lost node; an
/// agent that does not join within [`SshAgentConfig::join_timeout`] fails
/// the bootstrap with what its status file says. `cancel_bootstrap` and
/// `destroy_node` stop the agent's process group on the host.
/// `complete_bootstrap` is the handoff: the agent and its workload run on.
/// After a controller restart (same run secret, same listen address),
/// `list_nodes` expects the agents of every listed session to re-join;
/// they are adopted without restarting their workload, and one that does
/// not come back within the re-join grace plus
/// [`SshAgentConfig::adopt_wait`] is a lost node.
///
/// A plugin made with [`SshPlugin::new`] has no agent: it creates, lists
/// and destroys claims, and its `start_bootstrap` fails definitely.
pub struct SshPlugin {
    config: Arc<SshPluginConfig>,
    shared: Arc<Shared>,
    agent: Option<AgentRuntime>,
    /// The hosts this instance sent a claim of each key to: a host among
    /// them that cannot be asked may hold the key's claim.
    sent: Mutex<BTreeMap<AttemptKey, BTreeSet<usize>>>,
    faults: Mutex<BTreeMap<FaultStep, FaultMode>>,
    /// The live claims this instance created or adopted, with their host:
    /// what [`SshPlugin::check_losses`] watches.
    known: Mutex<BTreeMap<AttemptKey, usize>>,
    /// Per host, the last listing of the run's claims and when it started.
    listings: Vec<tokio::sync::Mutex<Option<Listing>>>,
    /// Per host, whether it is known to be cut off (see [`reach`]).
    reach: Vec<Mutex<reach::Reach>>,
}

/// A listing of a host's claims: when it started, and what it found.
type Listing = (
    tokio::time::Instant,
    Result<Option<Arc<BTreeSet<String>>>, SshFailure>,
);

/// The agent side of a plugin made with [`SshPlugin::start`].
struct AgentRuntime {
    config: SshAgentConfig,
    swarm: Arc<RemoteSwarm>,
    /// The agent executable's SHA-256, hex: its file name on every host.
    digest: String,
    /// One upload to a host at a time, so a host gets the agent once.
    install_locks: Vec<tokio::sync::Mutex<()>>,
}

/// The background loss watch of a plugin ([`SshPlugin::start_watch`]);
/// dropping it stops the watch.
#[derive(Debug)]
pub struct WatchHandle(tokio::task::AbortHandle);

impl Drop for WatchHandle {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl fmt::Debug for SshPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SshPlugin")
            .field("run_id", &self.config.run_id)
            .field("inventory", &self.config.inventory_name)
            .field("hosts", &self.config.hosts.len())
            .finish_non_exhaustive()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A claim's path below the claim root: `{run}/{node}/a{attempt}`.
fn claim_path(key: &AttemptKey) -> Result<String, PluginError> {
    let node = key.node.to_string();
    if !is_safe_name(key.run_id.as_str()) || !is_safe_name(&node) {
        return Err(PluginError::definite(format!(
            "{key} cannot name a claim directory: run and group names must use letters, digits, '.', '_' and '-'"
        )));
    }
    Ok(format!("{}/{node}/{}", key.run_id, key.attempt))
}

impl SshPlugin {
    /// A plugin over `config`'s inventory. It connects to nothing yet.
    ///
    /// # Errors
    /// Every problem of the configuration ([`SshPluginConfig::validate`]).
    pub fn new(config: SshPluginConfig) -> Result<Self, ConfigErrors> {
        config.validate()?;
        let hosts = config.hosts.len();
        Ok(SshPlugin {
            config: Arc::new(config),
            shared: Arc::new(Shared::default()),
            agent: None,
            sent: Mutex::new(BTreeMap::new()),
            faults: Mutex::new(BTreeMap::new()),
            known: Mutex::new(BTreeMap::new()),
            listings: (0..hosts).map(|_| tokio::sync::Mutex::new(None)).collect(),
            reach: (0..hosts).map(|_| Mutex::default()).collect(),
        })
    }

    /// A plugin over `config`'s inventory that bootstraps nodes with the
    /// node agent of `agent`: binds the swarm listener on the current tokio
    /// runtime and reads the agent executable once for its content hash.
    ///
    /// # Errors
    /// [`SshStartError`] when the configuration is invalid, the agent cannot
    /// be read, the listener cannot be bound, or outside a tokio runtime.
    pub async fn start(
        config: SshPluginConfig,
        agent: SshAgentConfig,
    ) -> Result<Arc<Self>, SshStartError> {
        tokio::runtime::Handle::try_current().map_err(|_| SshStartError::NoRuntime)?;
        config.validate()?;
        let program = agent.program.clone();
        let digest = tokio::task::spawn_blocking(move || file_digest(&program))
            .await
            .map_err(|error| SshStartError::Agent {
                path: agent.program.clone(),
                source: std::io::Error::other(error.to_string()),
            })?
            .map_err(|source| SshStartError::Agent {
                path: agent.program.clone(),
                source,
            })?;
        let shared = Arc::new(Shared::default());
        let events = shared.clone();
        let swarm = RemoteSwarm::bind(
            RemoteSwarmConfig {
                run_id: config.run_id.clone(),
                secret: agent.secret.clone(),
                listen: agent.listen,
                advertised: agent.advertised,
                rejoin_grace: agent.rejoin_grace,
            },
            move |event| events.on_event(event),
        )
        .await?;
        tracing::info!(
            run = %config.run_id,
            inventory = %config.inventory_name,
            swarm = %swarm.advertised(),
            agent = %agent.program.display(),
            %digest,
            "ssh plugin started"
        );
        let hosts = config.hosts.len();
        let mut plugin = SshPlugin::new(config)?;
        plugin.shared = shared;
        plugin.agent = Some(AgentRuntime {
            config: agent,
            swarm: Arc::new(swarm),
            digest,
            install_locks: (0..hosts).map(|_| tokio::sync::Mutex::new(())).collect(),
        });
        Ok(Arc::new(plugin))
    }

    /// The swarm listener agents join, for a plugin made with
    /// [`SshPlugin::start`].
    pub fn swarm(&self) -> Option<&RemoteSwarm> {
        self.agent.as_ref().map(|agent| agent.swarm.as_ref())
    }

    /// Starts a task on the current tokio runtime that calls
    /// [`SshPlugin::check_losses`] every `interval` until the handle is
    /// dropped or the plugin is.
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

    /// Looks on every host holding a claim this instance created or adopted
    /// and reports each claim that is gone ([`LossCause::LeaseGone`]) through
    /// the sink, under its own attempt. Returns how many were reported.
    /// A host that cannot be asked reports nothing (its claims may live).
    ///
    /// # Errors
    /// The first host that could not be asked; the others were still checked.
    pub async fn check_losses(&self) -> Result<usize, PluginError> {
        let watched = lock(&self.known).clone();
        let hosts: BTreeSet<usize> = watched.values().copied().collect();
        let run = self.config.run_id.clone();
        let body = script::list(run.as_str());
        let replies = join_all(hosts.iter().map(|&i| self.call(i, None, &body))).await;
        let mut first_error = None;
        let mut lost = 0;
        for (&index, reply) in hosts.iter().zip(replies) {
            let host = &self.config.hosts[index];
            let reply = match reply {
                Ok(reply) if reply.verdict() == "END" => reply,
                Ok(reply) => {
                    first_error.get_or_insert(self.unexpected(index, "watching claims", &reply));
                    continue;
                }
                Err(failure) => {
                    first_error.get_or_insert(self.failure(host, "watching claims", failure));
                    continue;
                }
            };
            let present: BTreeSet<&str> = reply
                .stdout
                .lines()
                .filter_map(|l| l.strip_prefix("CLAIM "))
                .filter_map(|claim| claim.split_whitespace().next())
                .collect();
            for (key, _) in watched.iter().filter(|(_, h)| **h == index) {
                let claim = format!("{}/{}", key.node, key.attempt);
                if present.contains(claim.as_str()) {
                    continue;
                }
                // Still watched: not destroyed through this plugin meanwhile.
                if lock(&self.known).remove(key).is_some() {
                    tracing::warn!(%key, host = %host.name, "the claim is gone from its host: node lost");
                    self.forget_agent(key);
                    self.shared.report_lost(key, LossCause::LeaseGone);
                    lost += 1;
                }
            }
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(lost),
        }
    }

    /// The controller this plugin reports to was replaced in-process by one
    /// recovered from its journal, while the plugin and the remote agents
    /// live on. Every agent goes quiet, as for a restarted plugin: its join
    /// (also one seen before) is reported once the new controller's
    /// adopting `start_bootstrap` announces its bootstrap. Returns how many
    /// agents went quiet.
    pub fn controller_replaced(&self) -> usize {
        self.shared.controller_replaced()
    }

    /// The configuration.
    pub fn config(&self) -> &SshPluginConfig {
        &self.config
    }

    /// A testing hook: makes the next `step` fail the way `mode` says, with
    /// a real refused connection or a reply really thrown away. A claim
    /// fault holds for every host the next creating `create_node` tries.
    pub fn arm_fault(&self, step: FaultStep, mode: FaultMode) {
        lock(&self.faults).insert(step, mode);
    }

    fn take_fault(&self, step: FaultStep) -> Option<FaultMode> {
        lock(&self.faults).remove(&step)
    }

    fn lease_of(&self, host: usize, path: &str) -> LeaseHandle {
        LeaseHandle(format!("ssh:{}:{path}", self.config.hosts[host].name))
    }

    /// The host a lease of `key` names, if the lease is one of this
    /// plugin's for that key. `Err` when it names a host not in the inventory.
    fn host_of(&self, key: &AttemptKey, lease: &LeaseHandle) -> Result<Option<usize>, PluginError> {
        let Ok(path) = claim_path(key) else {
            return Ok(None);
        };
        let Some((name, rest)) = lease.0.strip_prefix("ssh:").and_then(|l| l.split_once(':'))
        else {
            return Ok(None);
        };
        if rest != path {
            return Ok(None);
        }
        match self.config.hosts.iter().position(|h| h.name == name) {
            Some(index) => Ok(Some(index)),
            None => Err(PluginError::definite(format!(
                "lease {} names host {name:?}, which is not in inventory {:?}: its claim cannot be reached",
                lease.0, self.config.inventory_name
            ))),
        }
    }

    /// The host a session handle of `key` names, if it is one of this
    /// plugin's sessions for that key.
    fn host_of_session(&self, key: &AttemptKey, session: Option<&SessionHandle>) -> Option<usize> {
        let path = claim_path(key).ok()?;
        let (name, rest) = session?.0.strip_prefix("ssh-session:")?.split_once(':')?;
        (rest == path)
            .then(|| self.config.hosts.iter().position(|h| h.name == name))
            .flatten()
    }

    fn endpoint_of(&self, host: &SshHost) -> Endpoint {
        let address = if host.address.contains(':') {
            format!("[{}]", host.address)
        } else {
            host.address.clone()
        };
        Endpoint(format!("ssh://{}@{address}:{}", host.user, host.port))
    }

    fn host_key_message(&self, host: &SshHost, said: &str) -> String {
        format!(
            "HOST KEY VERIFICATION FAILED for host {:?} ({}@{}:{}): its key is UNKNOWN to, or CHANGED from, the one in the known-hosts file {}. \
             Refusing to connect: this may be a man-in-the-middle attack or a reinstalled host; check the key out of band and fix {}. ssh said: {said}",
            host.name,
            host.user,
            host.address,
            host.port,
            self.config.known_hosts.display(),
            self.config.known_hosts.display(),
        )
    }

    /// The failure of a call to `host` as a plugin error.
    fn failure(&self, host: &SshHost, what: &str, failure: SshFailure) -> PluginError {
        match failure {
            SshFailure::HostKey(said) => {
                let message = self.host_key_message(host, &said);
                tracing::error!("{message}");
                PluginError::definite(message)
            }
            SshFailure::NotConnected(said) => PluginError::definite(format!(
                "{what}: could not connect to host {:?} ({}:{}), nothing ran: {said}",
                host.name, host.address, host.port
            )),
            SshFailure::Unknown(said) => PluginError::ambiguous(format!(
                "{what}: the call to host {:?} broke off, its outcome is unknown: {said}",
                host.name
            )),
        }
    }

    /// Runs `body` on host `index`. A host whose last call failed to
    /// connect is probed first (see [`reach`]); a fault's `port` is called
    /// as it is.
    async fn call(&self, index: usize, port: Option<u16>, body: &str) -> Result<Reply, SshFailure> {
        let host = &self.config.hosts[index];
        let gate = lock(&self.reach[index]).gate();
        let probed = match (port, gate) {
            (None, reach::Gate::Probe) => {
                let window = self.config.connect_timeout.max(reach::PROBE_EVERY);
                if reach::answers(&host.address, host.port, window).await {
                    Some(reach::Probed::Answered)
                } else {
                    let probed = lock(&self.reach[index]).silent();
                    if probed == reach::Probed::Silent {
                        return Err(SshFailure::NotConnected(format!(
                            "no TCP connection to {}:{} within {window:?} (probed before calling ssh: the host's last call failed to connect)",
                            host.address, host.port
                        )));
                    }
                    Some(probed)
                }
            }
            _ => None,
        };
        let script = format!("root={}\n{body}", quote(host.claim_root()));
        let outcome = ssh::run(&self.config, host, port, &script).await;
        if port.is_none() {
            let connected = !matches!(outcome, Err(SshFailure::NotConnected(_)));
            lock(&self.reach[index]).called(connected, probed);
        }
        outcome
    }

    fn unexpected(&self, host: usize, what: &str, reply: &Reply) -> PluginError {
        PluginError::ambiguous(format!(
            "{what}: host {:?} answered unexpectedly (status {}, output {:?}, errors {:?})",
            self.config.hosts[host].name,
            reply.status,
            reply.stdout.trim(),
            reply.stderr.trim()
        ))
    }

    fn report(&self, key: &AttemptKey, event: BootstrapEvent) {
        self.shared.report(key, event);
    }

    /// The claims (`{node}/a{attempt}`) of this plugin's run on host
    /// `index`, from a listing that started at `since` or later: a running
    /// or recent one is shared. `None` when the reply made no sense.
    async fn claims_on(
        &self,
        index: usize,
        since: tokio::time::Instant,
    ) -> Result<Option<Arc<BTreeSet<String>>>, SshFailure> {
        let mut listing = self.listings[index].lock().await;
        if let Some((at, outcome)) = listing.as_ref()
            && *at >= since
        {
            return outcome.clone();
        }
        let at = tokio::time::Instant::now();
        let outcome = match self
            .call(index, None, &script::list(self.config.run_id.as_str()))
            .await
        {
            Ok(reply) if reply.verdict() == "END" => Ok(Some(Arc::new(
                reply
                    .stdout
                    .lines()
                    .filter_map(|l| l.strip_prefix("CLAIM "))
                    .filter_map(|claim| claim.split_whitespace().next())
                    .map(str::to_owned)
                    .collect(),
            ))),
            Ok(_) => Ok(None),
            Err(failure) => Err(failure),
        };
        *listing = Some((at, outcome.clone()));
        outcome
    }

    /// Whether `key`'s claim is on `host`; `None` when the reply made no sense.
    async fn probe(&self, host: usize, path: &str) -> Result<Option<bool>, SshFailure> {
        let reply = self.call(host, None, &script::probe(path)).await?;
        Ok(match reply.verdict() {
            "PRESENT" => Some(true),
            "ABSENT" => Some(false),
            _ => None,
        })
    }
}

/// The error of a bootstrap asked of a plugin made without an agent.
fn no_agent() -> PluginError {
    PluginError::definite(
        "this ssh plugin has no node agent to start (made with SshPlugin::new; SshPlugin::start configures one)",
    )
}
