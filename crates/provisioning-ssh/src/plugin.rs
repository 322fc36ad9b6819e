//! [`SshPlugin`]: leases that are slots claimed on the hosts of an inventory.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::join_all;
use provisioning::effect::SessionHandle;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::BootstrapProgress;
use provisioning::{
    Endpoint, EndpointLookup, LeaseHandle, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, RunId,
};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use sha2::Digest;

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
///   (adopting it when it does), then claims a slot on the first host, in
///   inventory order, that has one free. No free slot anywhere is a definite
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
/// # Not yet done
/// `start_bootstrap` runs the verify commands and starts the workload
/// (`boot.start_command`) detached in a session of its own, recorded in the
/// claim; it does not yet install the node agent nor wait for its swarm
/// join, so no node of this plugin reports `Joined`.
pub struct SshPlugin {
    config: Arc<SshPluginConfig>,
    sink: Mutex<Option<ObservationSink>>,
    /// The hosts this instance sent a claim of each key to: a host among
    /// them that cannot be asked may hold the key's claim.
    sent: Mutex<BTreeMap<AttemptKey, BTreeSet<usize>>>,
    faults: Mutex<BTreeMap<FaultStep, FaultMode>>,
    /// The live claims this instance created or adopted, with their host:
    /// what [`SshPlugin::check_losses`] watches.
    known: Mutex<BTreeMap<AttemptKey, usize>>,
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
        Ok(SshPlugin {
            config: Arc::new(config),
            sink: Mutex::new(None),
            sent: Mutex::new(BTreeMap::new()),
            faults: Mutex::new(BTreeMap::new()),
            known: Mutex::new(BTreeMap::new()),
        })
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
                .collect();
            for (key, _) in watched.iter().filter(|(_, h)| **h == index) {
                let claim = format!("{}/{}", key.node, key.attempt);
                if present.contains(claim.as_str()) {
                    continue;
                }
                // Still watched: not destroyed through this plugin meanwhile.
                if lock(&self.known).remove(key).is_some() {
                    tracing::warn!(%key, host = %host.name, "the claim is gone from its host: node lost");
                    if let Some(sink) = lock(&self.sink).as_ref() {
                        sink.lost(key, LossCause::LeaseGone);
                    }
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
        let hash = hex::encode(sha2::Sha256::digest(&binary));
        let host = &self.config.hosts[index];
        let remote = format!(
            "sh -c {}",
            quote(&script::install_agent(host.claim_root(), &hash))
        );
        let reply = ssh::run_with_input(&self.config, host, None, &remote, &binary)
            .await
            .map_err(|failure| self.failure(host, "installing the agent", failure))?;
        let path = format!("{}/.agents/{hash}", host.claim_root());
        match reply.verdict() {
            "PRESENT" => Ok((path, false)),
            "INSTALLED" => Ok((path, true)),
            "MISMATCH" | "FAILED" => Err(PluginError::definite(format!(
                "installing the agent on host {:?} failed ({}): {}",
                host.name,
                reply.verdict(),
                reply.stderr.trim()
            ))),
            _ => Err(self.unexpected(index, "installing the agent", &reply)),
        }
    }

    /// Starts the installed agent `agent` (see [`SshPlugin::install_agent`])
    /// for the claim of `key` on `host`, in the remote boot mode of
    /// `provisioning_process::agent::remote`. `order` is the boot order's
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
        let remote = format!(
            "sh -c {}",
            quote(&script::launch_agent(host.claim_root(), &path, agent))
        );
        let reply = ssh::run_with_input(&self.config, host, None, &remote, order)
            .await
            .map_err(|failure| self.failure(host, "starting the agent", failure))?;
        match reply.verdict() {
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

    fn watch(&self, key: &AttemptKey, host: usize) {
        if key.run_id == self.config.run_id {
            lock(&self.known).insert(key.clone(), host);
        }
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
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.bootstrap(key, event);
        }
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
        *lock(&self.sink) = Some(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        _spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let path = claim_path(key)?;
        let hosts = &self.config.hosts;
        // Look on every host first: an existing claim is adopted.
        let probes = join_all((0..hosts.len()).map(|i| self.probe(i, &path))).await;
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
        let Some(index) = self.host_of(key, &request.lease)? else {
            return Err(PluginError::not_found(format!(
                "{} is no lease of {key}",
                request.lease.0
            )));
        };
        let path = claim_path(key)?;
        let host = &self.config.hosts[index];
        let session = SessionHandle(format!("ssh-session:{}:{path}", host.name));
        let boot = &request.spec.template().boot;
        let body = script::start_session(&path, boot);
        self.report(key, BootstrapEvent::Progress(BootstrapProgress::Connecting));
        let reply = self
            .call(index, None, &body)
            .await
            .map_err(|failure| self.failure(host, "starting the bootstrap", failure))?;
        let verdict = reply.verdict().to_owned();
        match verdict.split_whitespace().next().unwrap_or("") {
            "ADOPTED" => {
                self.watch(key, index);
                Ok(BootstrapSession {
                    session,
                    adopted: true,
                })
            }
            "STARTED" => {
                self.watch(key, index);
                for stage in [
                    BootstrapProgress::Connected,
                    BootstrapProgress::BootChecking,
                    BootstrapProgress::AgentStarting,
                ] {
                    self.report(key, BootstrapEvent::Progress(stage));
                }
                Ok(BootstrapSession {
                    session,
                    adopted: false,
                })
            }
            "NOTFOUND" => Err(PluginError::not_found(format!(
                "the claim of {key} is gone from host {:?}",
                host.name
            ))),
            "VERIFYFAILED" => Err(PluginError::definite(format!(
                "boot check failed on host {:?} for {key}: verify command #{} failed: {}",
                host.name,
                verdict.split_whitespace().nth(1).unwrap_or("?"),
                reply.stderr.trim()
            ))),
            _ => Err(self.unexpected(index, "starting the bootstrap", &reply)),
        }
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
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
                    self.report(key, BootstrapEvent::Closed);
                    return Ok(());
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
        // Not watched while it goes: its absence is no loss.
        let watched = lock(&self.known).remove(key).is_some();
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
                let Some(claim) = line.strip_prefix("CLAIM ") else {
                    continue;
                };
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
