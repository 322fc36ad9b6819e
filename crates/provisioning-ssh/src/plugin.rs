//! [`SshPlugin`]: leases that are slots claimed on the hosts of an inventory.

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

    /// Makes sure the host `host` (by inventory name) holds the executable
    /// `local`, uploading it once per content hash: it ends up at
    /// `{claim_root}/.agents/{sha256}` (mode 0755), checked against its hash
    /// on the host before it is renamed into place. Returns the remote path
    /// and whether it was uploaded now.
    ///
    /// # Errors
    /// Definite when `local` cannot be read, the host is unknown or could
    /// not be reached, or the upload did not check out; ambiguous when the
    /// call broke off.
    pub async fn install_agent(
        &self,
        host: &str,
        local: &std::path::Path,
    ) -> Result<(String, bool), PluginError> {
        let index = self
            .config
            .hosts
            .iter()
            .position(|h| h.name == host)
            .ok_or_else(|| {
                PluginError::definite(format!(
                    "host {host:?} is not in inventory {:?}",
                    self.config.inventory_name
                ))
            })?;
        let path = local.to_owned();
        let binary = tokio::task::spawn_blocking(move || std::fs::read(path))
            .await
            .map_err(|error| PluginError::definite(format!("reading the agent: {error}")))?
            .map_err(|error| {
                PluginError::definite(format!(
                    "cannot read the agent {}: {error}",
                    local.display()
                ))
            })?;
        let hash = digest_of(local, &binary);
        self.upload(index, &binary, &hash).await
    }

    /// Uploads `binary` (whose SHA-256 is `hash`) to host `index` unless it
    /// holds it (asked first, so a present agent is not sent again): the
    /// remote path and whether it was uploaded now.
    async fn upload(
        &self,
        index: usize,
        binary: &[u8],
        hash: &str,
    ) -> Result<(String, bool), PluginError> {
        let path = format!("{}/.agents/{hash}", self.config.hosts[index].claim_root());
        if self.agent_present(index, hash).await? {
            return Ok((path, false));
        }
        self.send_agent(index, binary, hash).await?;
        Ok((path, true))
    }

    /// Whether host `index` holds the agent of content hash `hash`.
    async fn agent_present(&self, index: usize, hash: &str) -> Result<bool, PluginError> {
        let host = &self.config.hosts[index];
        let reply = self
            .call(index, None, &script::agent_present(hash))
            .await
            .map_err(|failure| self.failure(host, "looking for the agent", failure))?;
        match reply.verdict() {
            "PRESENT" => Ok(true),
            "ABSENT" => Ok(false),
            _ => Err(self.unexpected(index, "looking for the agent", &reply)),
        }
    }

    /// Sends `binary` to host `index`, where it is installed under its hash
    /// after the hash checked out.
    async fn send_agent(&self, index: usize, binary: &[u8], hash: &str) -> Result<(), PluginError> {
        let host = &self.config.hosts[index];
        let remote = format!(
            "sh -c {}",
            quote(&script::install_agent(host.claim_root(), hash))
        );
        let reply = ssh::run_with_input(&self.config, host, None, &remote, binary)
            .await
            .map_err(|failure| self.failure(host, "installing the agent", failure))?;
        match reply.verdict() {
            "PRESENT" => Ok(()),
            "INSTALLED" => {
                tracing::info!(host = %host.name, %hash, bytes = binary.len(), "agent installed");
                Ok(())
            }
            "MISMATCH" | "FAILED" => Err(PluginError::definite(format!(
                "installing the agent on host {:?} failed ({}): {}",
                host.name,
                reply.verdict(),
                reply.stderr.trim()
            ))),
            _ => Err(self.unexpected(index, "installing the agent", &reply)),
        }
    }

    /// Makes sure host `index` holds the plugin's agent, uploading it at
    /// most once per host and content hash.
    async fn ensure_installed(&self, index: usize) -> Result<(), PluginError> {
        let Some(agent) = &self.agent else {
            return Err(no_agent());
        };
        let _one_upload_per_host = agent.install_locks[index].lock().await;
        if self.agent_present(index, &agent.digest).await? {
            return Ok(());
        }
        let program = agent.config.program.clone();
        let binary = tokio::task::spawn_blocking(move || std::fs::read(program))
            .await
            .map_err(|error| PluginError::definite(format!("reading the agent: {error}")))?
            .map_err(|error| {
                PluginError::definite(format!(
                    "cannot read the agent {}: {error}",
                    agent.config.program.display()
                ))
            })?;
        self.send_agent(index, &binary, &agent.digest).await
    }

    /// Starts the installed agent `agent` (see [`SshPlugin::install_agent`])
    /// for the claim of `key` on `host`, in the remote boot mode of
    /// `provisioning_agent::agent::remote`. `order` is the boot order's
    /// JSON; it travels on `ssh`'s standard input into a `0600` file, never
    /// on a command line. Returns `true` when started now, `false` when a
    /// session of the claim existed already.
    ///
    /// # Errors
    /// Not found when the claim is gone; definite when the host is unknown,
    /// refused the connection or the start failed; ambiguous when the call
    /// broke off.
    pub async fn launch_agent(
        &self,
        host: &str,
        key: &AttemptKey,
        agent: &str,
        order: &[u8],
    ) -> Result<bool, PluginError> {
        let index = self
            .config
            .hosts
            .iter()
            .position(|h| h.name == host)
            .ok_or_else(|| {
                PluginError::definite(format!(
                    "host {host:?} is not in inventory {:?}",
                    self.config.inventory_name
                ))
            })?;
        let path = claim_path(key)?;
        let host = &self.config.hosts[index];
        let order = std::str::from_utf8(order)
            .map_err(|_| PluginError::definite("the boot order is not UTF-8 JSON"))?;
        let env = BTreeMap::new();
        let boot = script::Boot {
            agent,
            args: &[],
            verify_commands: &[],
            env: &env,
            agent_env: &[],
            order,
        };
        let reply = self
            .call(index, None, &script::boot(&path, &boot))
            .await
            .map_err(|failure| self.failure(host, "starting the agent", failure))?;
        match reply.verdict() {
            "NOAGENT" => Err(PluginError::definite(format!(
                "no agent is installed at {agent} on host {:?}",
                host.name
            ))),
            "STARTED" => {
                self.watch(key, index);
                Ok(true)
            }
            "ADOPTED" => {
                self.watch(key, index);
                Ok(false)
            }
            "NOTFOUND" => Err(PluginError::not_found(format!(
                "the claim of {key} is gone from host {:?}",
                host.name
            ))),
            "FAILED" => Err(PluginError::definite(format!(
                "starting the agent on host {:?} failed: {}",
                host.name,
                reply.stderr.trim()
            ))),
            _ => Err(self.unexpected(index, "starting the agent", &reply)),
        }
    }

    /// A listed claim of this run with a session: its agent may be running
    /// from an earlier controller. Unless it is expected already, it is
    /// expected to re-join (adopted, workload untouched); one that does not
    /// within the grace and the adopt wait is a lost node.
    fn adopt_agent(&self, key: &AttemptKey, host: usize) {
        let Some(agent) = &self.agent else {
            return;
        };
        if key.run_id != self.config.run_id || agent.swarm.is_expected(key) {
            return;
        }
        tracing::info!(node = %key, host = %self.config.hosts[host].name, "expecting the agent of a listed claim to re-join");
        self.watch(key, host);
        agent.swarm.expect_adopted(key, agent.config.adopt_wait);
    }

    fn watch(&self, key: &AttemptKey, host: usize) {
        if key.run_id == self.config.run_id {
            lock(&self.known).insert(key.clone(), host);
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

    async fn call(&self, host: usize, port: Option<u16>, body: &str) -> Result<Reply, SshFailure> {
        let host = &self.config.hosts[host];
        let script = format!("root={}\n{body}", quote(host.claim_root()));
        ssh::run(&self.config, host, port, &script).await
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

    /// Stops expecting the agent of `key`: nothing more is reported about
    /// it, and its swarm connection (if any) is dropped.
    fn forget_agent(&self, key: &AttemptKey) {
        self.shared.forget(key);
        if let Some(agent) = &self.agent {
            agent.swarm.forget(key);
        }
    }

    /// The boot order of `key`'s agent: its workload, and how to join.
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
            // The bootstrap script ran them before it started the agent.
            verify_commands: Vec::new(),
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
        }
    }

    /// Fails the bootstrap of `key` unless its agent joins within the join
    /// timeout (it exited, could not reach the listener, was refused): the
    /// failure carries what the agent's status file and log say.
    fn spawn_join_watchdog(&self, agent: &AgentRuntime, key: &AttemptKey, index: usize) {
        let swarm = agent.swarm.clone();
        let shared = self.shared.clone();
        let config = self.config.clone();
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
            let host = &config.hosts[index];
            let (failure, detail) = match claim_path(&key) {
                Ok(path) => {
                    let script = format!(
                        "root={}\n{}",
                        quote(host.claim_root()),
                        script::session_report(&path)
                    );
                    match ssh::run(&config, host, None, &script).await {
                        Ok(reply) => join_failure(&reply.stdout, wait),
                        Err(failure) => (
                            BootstrapFailure::JoinFailed,
                            format!(
                                "the agent did not join within {wait:?}, and host {:?} could not be asked why: {failure:?}",
                                host.name
                            ),
                        ),
                    }
                }
                Err(error) => (BootstrapFailure::JoinFailed, error.to_string()),
            };
            // Still waiting, after the look at the host?
            if shared.is_joined(&key) || !swarm.is_expected(&key) {
                return;
            }
            swarm.forget(&key);
            shared.agents().remove(&key);
            tracing::warn!(node = %key, host = %host.name, %detail, "the agent did not join");
            shared.report(&key, BootstrapEvent::Failed { failure, detail });
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

#[async_trait]
impl ProvisionPlugin for SshPlugin {
    fn kind(&self) -> &str {
        PROVIDER_KIND
    }

    fn attach(&self, sink: ObservationSink) {
        self.shared.attach(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        _spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let path = claim_path(key)?;
        let hosts = &self.config.hosts;
        // Look on every host first: an existing claim is adopted.
        // One listing per host, shared by the creates that began before it
        // started (a group's creates arrive together): not one probe per
        // host and node.
        let since = tokio::time::Instant::now();
        let claim = format!("{}/{}", key.node, key.attempt);
        let probes = join_all((0..hosts.len()).map(|i| {
            let claim = claim.as_str();
            let path = path.as_str();
            async move {
                if key.run_id != self.config.run_id {
                    return self.probe(i, path).await;
                }
                self.claims_on(i, since)
                    .await
                    .map(|claims| claims.map(|claims| claims.contains(claim)))
            }
        }))
        .await;
        let sent = lock(&self.sent).get(key).cloned().unwrap_or_default();
        let mut notes = Vec::new();
        let mut usable = Vec::new();
        let mut unaskable = Vec::new();
        for (index, probe) in probes.into_iter().enumerate() {
            let host = &hosts[index];
            match probe {
                Ok(Some(true)) => {
                    self.watch(key, index);
                    return Ok(NodeLease {
                        lease: self.lease_of(index, &path),
                        endpoint: None,
                        adopted: true,
                    });
                }
                Ok(Some(false)) => usable.push(index),
                Ok(None) => {
                    unaskable.push(index);
                    notes.push(format!("{}: answered nonsense", host.name));
                }
                Err(failure) => {
                    unaskable.push(index);
                    notes.push(format!(
                        "{}: {}",
                        host.name,
                        self.failure(host, "looking for a claim", failure)
                    ));
                }
            }
        }
        if let Some(&index) = unaskable.iter().find(|i| sent.contains(i)) {
            return Err(PluginError::ambiguous(format!(
                "a claim of {key} was sent to host {:?}, which cannot be asked now; it may hold the claim ({})",
                hosts[index].name,
                notes.join("; ")
            )));
        }
        // An armed fault holds for every claim of this call.
        let fault = self.take_fault(FaultStep::Claim);
        // Nodes spread over the inventory: a node's search starts at the
        // host of its index, so a group's concurrent creates do not all
        // queue for the first host's lock.
        let start = key.node.index() as usize % hosts.len();
        usable.sort_by_key(|&index| (index + hosts.len() - start) % hosts.len());
        for index in usable {
            let host = &hosts[index];
            let port = (fault == Some(FaultMode::Refused)).then_some(REFUSED_PORT);
            lock(&self.sent)
                .entry(key.clone())
                .or_default()
                .insert(index);
            let forget = || {
                if let Some(hosts) = lock(&self.sent).get_mut(key) {
                    hosts.remove(&index);
                }
            };
            let reply = match self
                .call(index, port, &script::claim(&path, host.slots))
                .await
            {
                Ok(reply) => reply,
                Err(failure @ (SshFailure::HostKey(_) | SshFailure::NotConnected(_))) => {
                    forget();
                    notes.push(format!(
                        "{}: {}",
                        host.name,
                        self.failure(host, "claiming a slot", failure)
                    ));
                    continue;
                }
                Err(failure) => return Err(self.failure(host, "claiming a slot", failure)),
            };
            let verdict = reply.verdict().to_owned();
            let lease = |adopted| NodeLease {
                lease: self.lease_of(index, &path),
                endpoint: None,
                adopted,
            };
            match verdict.split_whitespace().next().unwrap_or("") {
                "CREATED" | "ADOPTED" if fault == Some(FaultMode::ReplyLost) => {
                    return Err(PluginError::ambiguous(format!(
                        "claiming a slot for {key} on host {:?}: the reply was lost (injected fault)",
                        host.name
                    )));
                }
                "CREATED" => {
                    self.watch(key, index);
                    return Ok(lease(false));
                }
                "ADOPTED" => {
                    self.watch(key, index);
                    return Ok(lease(true));
                }
                "FULL" => {
                    forget();
                    notes.push(format!("{}: all {} slots taken", host.name, host.slots));
                }
                "NOFLOCK" => {
                    forget();
                    notes.push(format!("{}: flock(1) is not installed", host.name));
                }
                "NOROOT" | "BUSY" | "CLAIMFAILED" => {
                    forget();
                    notes.push(format!(
                        "{}: could not claim ({verdict}: {})",
                        host.name,
                        reply.stderr.trim()
                    ));
                }
                _ => return Err(self.unexpected(index, "claiming a slot", &reply)),
            }
        }
        Err(PluginError::definite(format!(
            "no free slot in ssh inventory {:?} for {key}: {}",
            self.config.inventory_name,
            notes.join("; ")
        )))
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        let Some(index) = self.host_of(key, lease)? else {
            return Err(PluginError::not_found(format!(
                "{} is no lease of {key}",
                lease.0
            )));
        };
        let path = claim_path(key)?;
        let host = &self.config.hosts[index];
        match self.probe(index, &path).await {
            Ok(Some(true)) => {
                self.watch(key, index);
                Ok(EndpointLookup::Ready(self.endpoint_of(host)))
            }
            Ok(Some(false)) => Err(PluginError::not_found(format!(
                "the claim of {key} is gone from host {:?}",
                host.name
            ))),
            Ok(None) => Ok(EndpointLookup::NotReady),
            Err(failure @ SshFailure::HostKey(_)) => {
                Err(self.failure(host, "looking up the endpoint", failure))
            }
            Err(failure) => {
                tracing::debug!(host = %host.name, ?failure, "host not answering: endpoint not ready");
                Ok(EndpointLookup::NotReady)
            }
        }
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        let Some(agent) = &self.agent else {
            return Err(no_agent());
        };
        let Some(index) = self.host_of(key, &request.lease)? else {
            return Err(PluginError::not_found(format!(
                "{} is no lease of {key}",
                request.lease.0
            )));
        };
        let path = claim_path(key)?;
        let host = &self.config.hosts[index];
        let session = SessionHandle(format!("ssh-session:{}:{path}", host.name));
        self.report(key, BootstrapEvent::Progress(BootstrapProgress::Connecting));
        // Expected before it can start, so its join is never refused. A key
        // expected already (a retry, a re-joining adopted agent) keeps its
        // expectation and connection.
        let newly_expected = !agent.swarm.is_expected(key);
        if newly_expected {
            agent.swarm.expect(key);
        }
        let order = serde_json::to_string(&self.boot_order(agent, key, &request.spec))
            .map_err(|error| PluginError::definite(format!("encoding the boot order: {error}")))?;
        let remote_agent = format!("{}/.agents/{}", host.claim_root(), agent.digest);
        let boot = &request.spec.template().boot;
        let agent_env: Vec<(&str, String)> = agent
            .config
            .rejoin_window
            .map(|window| {
                (
                    provisioning_agent::agent::env::REJOIN_WINDOW_MS,
                    window.as_millis().to_string(),
                )
            })
            .into_iter()
            .collect();
        let body = script::boot(
            &path,
            &script::Boot {
                agent: &remote_agent,
                args: &agent.config.args,
                verify_commands: &boot.verify_commands,
                env: &boot.env,
                agent_env: &agent_env,
                order: &order,
            },
        );
        let nothing_ran = |error: PluginError| {
            if newly_expected {
                self.forget_agent(key);
            }
            error
        };
        let call = |failure| match failure {
            failure @ (SshFailure::HostKey(_) | SshFailure::NotConnected(_)) => {
                nothing_ran(self.failure(host, "starting the bootstrap", failure))
            }
            failure => self.failure(host, "starting the bootstrap", failure),
        };
        let mut reply = self.call(index, None, &body).await.map_err(call)?;
        if reply.verdict() == "NOAGENT" {
            self.ensure_installed(index).await.map_err(nothing_ran)?;
            reply = self.call(index, None, &body).await.map_err(call)?;
        }
        let verdict = reply.verdict().to_owned();
        match verdict.split_whitespace().next().unwrap_or("") {
            "STARTED" => {
                self.watch(key, index);
                for stage in [
                    BootstrapProgress::Connected,
                    BootstrapProgress::BootChecking,
                    BootstrapProgress::AgentStarting,
                    BootstrapProgress::WaitingForJoin,
                ] {
                    self.report(key, BootstrapEvent::Progress(stage));
                }
                self.shared.announce(key);
                self.spawn_join_watchdog(agent, key, index);
                Ok(BootstrapSession {
                    session,
                    adopted: false,
                })
            }
            "ADOPTED" => {
                self.watch(key, index);
                let announced = self
                    .shared
                    .agents()
                    .get(key)
                    .is_some_and(|state| state.announced);
                if !announced {
                    self.report(
                        key,
                        BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin),
                    );
                }
                self.shared.announce(key);
                let watching = self
                    .shared
                    .agents()
                    .get(key)
                    .is_some_and(|state| state.joined || state.watchdog.is_some());
                if !watching {
                    self.spawn_join_watchdog(agent, key, index);
                }
                Ok(BootstrapSession {
                    session,
                    adopted: true,
                })
            }
            "NOTFOUND" => Err(nothing_ran(PluginError::not_found(format!(
                "the claim of {key} is gone from host {:?}",
                host.name
            )))),
            "VERIFYFAILED" => Err(nothing_ran(PluginError::definite(format!(
                "boot check failed on host {:?} for {key}: verify command #{} failed: {}",
                host.name,
                verdict.split_whitespace().nth(1).unwrap_or("?"),
                reply.stderr.trim()
            )))),
            "NOAGENT" => Err(nothing_ran(PluginError::definite(format!(
                "the agent {remote_agent} is still not executable on host {:?} after its upload",
                host.name
            )))),
            "FAILED" => Err(nothing_ran(PluginError::definite(format!(
                "starting the agent on host {:?} failed: {}",
                host.name,
                reply.stderr.trim()
            )))),
            _ => Err(self.unexpected(index, "starting the bootstrap", &reply)),
        }
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        // The handoff: the agent and its workload run on.
        if self.shared.is_joined(key) {
            self.report(key, BootstrapEvent::Closed);
            return Ok(());
        }
        if self
            .agent
            .as_ref()
            .is_some_and(|agent| agent.swarm.is_expected(key))
        {
            return Err(PluginError::ambiguous(format!(
                "the agent of {key} is not joined right now (it may be re-joining)"
            )));
        }
        let path = claim_path(key)?;
        // The session's host, else every host that may hold the claim.
        let hosts = match self.host_of_session(key, session) {
            Some(index) => vec![index],
            None => (0..self.config.hosts.len()).collect(),
        };
        for index in hosts {
            let host = &self.config.hosts[index];
            match self.probe(index, &path).await {
                Ok(Some(true)) => {
                    return Err(PluginError::definite(format!(
                        "the bootstrap of {key} cannot complete: its agent has not joined"
                    )));
                }
                Ok(Some(false)) => {}
                Ok(None) => {
                    return Err(PluginError::ambiguous(format!(
                        "completing the bootstrap: host {:?} answered nonsense",
                        host.name
                    )));
                }
                Err(failure) => {
                    return Err(self.failure(host, "completing the bootstrap", failure));
                }
            }
        }
        Err(PluginError::not_found(format!(
            "no host of inventory {:?} holds the claim of {key}",
            self.config.inventory_name
        )))
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        let Ok(path) = claim_path(key) else {
            return Ok(());
        };
        // Stopping the agent is no loss.
        self.forget_agent(key);
        let hosts = match self.host_of_session(key, session) {
            Some(index) => vec![index],
            None => (0..self.config.hosts.len()).collect(),
        };
        let body = script::stop_session(&path);
        let results = join_all(hosts.iter().map(|&i| self.call(i, None, &body))).await;
        for (&index, result) in hosts.iter().zip(results) {
            let host = &self.config.hosts[index];
            // A host that may hold the key's claim: the session's, one a
            // claim was sent to, or the one a live claim was seen on.
            let may_hold = session.is_some()
                || lock(&self.sent)
                    .get(key)
                    .is_some_and(|hosts| hosts.contains(&index))
                || lock(&self.known).get(key) == Some(&index);
            match result {
                Ok(reply) if matches!(reply.verdict(), "STOPPED" | "ABSENT") => {}
                Ok(reply) => {
                    return Err(self.unexpected(index, "cancelling the bootstrap", &reply));
                }
                Err(SshFailure::NotConnected(_) | SshFailure::HostKey(_)) if !may_hold => {}
                Err(failure) => {
                    return Err(self.failure(host, "cancelling the bootstrap", failure));
                }
            }
        }
        Ok(())
    }

    async fn destroy_node(&self, key: &AttemptKey, lease: &LeaseHandle) -> Result<(), PluginError> {
        let Some(index) = self.host_of(key, lease)? else {
            // Not a lease this plugin issued for the key: nothing of it exists.
            return Ok(());
        };
        let path = claim_path(key)?;
        let host = &self.config.hosts[index];
        let fault = self.take_fault(FaultStep::Release);
        let port = (fault == Some(FaultMode::Refused)).then_some(REFUSED_PORT);
        // Not watched while it goes: its absence, and its agent's, is no loss.
        let watched = lock(&self.known).remove(key).is_some();
        self.forget_agent(key);
        let reply = match self.call(index, port, &script::release(&path)).await {
            Ok(reply) => reply,
            Err(failure) => {
                if watched && !matches!(failure, SshFailure::Unknown(_)) {
                    self.watch(key, index);
                }
                return Err(self.failure(host, "destroying the node", failure));
            }
        };
        match reply.verdict() {
            "DESTROYED" | "ABSENT" if fault == Some(FaultMode::ReplyLost) => {
                Err(PluginError::ambiguous(format!(
                    "destroying {key} on host {:?}: the reply was lost (injected fault)",
                    host.name
                )))
            }
            "DESTROYED" | "ABSENT" => {
                let mut sent = lock(&self.sent);
                if let Some(hosts) = sent.get_mut(key) {
                    hosts.remove(&index);
                    if hosts.is_empty() {
                        sent.remove(key);
                    }
                }
                Ok(())
            }
            _ => Err(self.unexpected(index, "destroying the node", &reply)),
        }
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        if !is_safe_name(run.as_str()) {
            return Ok(Vec::new());
        }
        let body = script::list(run.as_str());
        let replies =
            join_all((0..self.config.hosts.len()).map(|i| self.call(i, None, &body))).await;
        let mut nodes = Vec::new();
        for (index, reply) in replies.into_iter().enumerate() {
            let host = &self.config.hosts[index];
            let reply = reply.map_err(|failure| self.failure(host, "listing claims", failure))?;
            if reply.verdict() != "END" {
                return Err(self.unexpected(index, "listing claims", &reply));
            }
            for line in reply.stdout.lines() {
                let Some(listed) = line.strip_prefix("CLAIM ") else {
                    continue;
                };
                let mut words = listed.split_whitespace();
                let claim = words.next().unwrap_or("");
                let has_session = words.next() == Some("session");
                let parsed = claim.split_once('/').and_then(|(node, attempt)| {
                    let node = LogicalNodeId::parse(node).ok()?;
                    let attempt = attempt.strip_prefix('a')?.parse::<u64>().ok()?;
                    Some((node, NodeAttemptId::from_raw(attempt)))
                });
                let Some((node, attempt)) = parsed else {
                    tracing::warn!(host = %host.name, claim, "ignoring a claim directory that names no attempt");
                    continue;
                };
                let key = AttemptKey {
                    run_id: run.clone(),
                    node,
                    attempt,
                };
                let path = claim_path(&key)?;
                if has_session {
                    self.adopt_agent(&key, index);
                }
                nodes.push(ListedNode {
                    lease: self.lease_of(index, &path),
                    key,
                });
            }
        }
        nodes.sort();
        nodes.dedup();
        Ok(nodes)
    }
}

impl Drop for SshPlugin {
    fn drop(&mut self) {
        self.shared.close();
    }
}

fn no_agent() -> PluginError {
    PluginError::definite(
        "this ssh plugin has no node agent to start (made with SshPlugin::new; SshPlugin::start configures one)",
    )
}

/// Content hashes of local files by path, size and modification time, so
/// a large agent is hashed once per process, not once per plugin or call.
type DigestCache = BTreeMap<std::path::PathBuf, (u64, std::time::SystemTime, String)>;

static DIGESTS: Mutex<DigestCache> = Mutex::new(BTreeMap::new());

/// The size and modification time of `local`.
fn stamp_of(local: &std::path::Path) -> Option<(u64, std::time::SystemTime)> {
    std::fs::metadata(local)
        .and_then(|m| m.modified().map(|t| (m.len(), t)))
        .ok()
}

/// The remembered hash of `local`, if it did not change since.
fn cached_digest(local: &std::path::Path) -> Option<String> {
    let (len, modified) = stamp_of(local)?;
    lock(&DIGESTS)
        .get(local)
        .filter(|(l, m, _)| *l == len && *m == modified)
        .map(|(_, _, hash)| hash.clone())
}

/// The SHA-256 (hex) of `bytes`, just read from `local`.
fn digest_of(local: &std::path::Path, bytes: &[u8]) -> String {
    let stamp = stamp_of(local).filter(|(len, _)| *len == bytes.len() as u64);
    if stamp.is_some()
        && let Some(hash) = cached_digest(local)
    {
        return hash;
    }
    let hash = hex::encode(sha2::Sha256::digest(bytes));
    if let Some((len, modified)) = stamp {
        lock(&DIGESTS).insert(local.to_owned(), (len, modified, hash.clone()));
    }
    hash
}

/// The SHA-256 (hex) of the file at `local`, read only when not remembered.
fn file_digest(local: &std::path::Path) -> std::io::Result<String> {
    if let Some(hash) = cached_digest(local) {
        return Ok(hash);
    }
    let bytes = std::fs::read(local)?;
    Ok(digest_of(local, &bytes))
}

/// Why an agent did not join, from the `STATUS`/`LOG` lines of
/// [`script::session_report`].
fn join_failure(report: &str, wait: Duration) -> (BootstrapFailure, String) {
    let mut failure = BootstrapFailure::JoinFailed;
    let mut said = None;
    let mut lines = Vec::new();
    for line in report.lines() {
        if let Some(status) = line.strip_prefix("STATUS ") {
            if let Ok(ControlReply::Failed { stage, detail }) =
                serde_json::from_str::<ControlReply>(status)
            {
                failure = match stage {
                    FailureStage::BootCheck => BootstrapFailure::BootCheckFailed,
                    FailureStage::Start => BootstrapFailure::StartFailed,
                    FailureStage::Join => BootstrapFailure::JoinFailed,
                };
                said = Some(detail);
            }
        } else if let Some(log) = line.strip_prefix("LOG ") {
            lines.push(log.trim().to_owned());
        }
    }
    let detail = match said {
        Some(detail) => format!("the agent failed: {detail}"),
        None => format!(
            "the agent did not join within {wait:?}; its log ends with: {:?}",
            lines.join(" | ")
        ),
    };
    (failure, detail)
}
