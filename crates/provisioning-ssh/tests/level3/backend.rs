//! The backend under the executor: the real `PluginBackendAdapter` over the
//! real `SshPlugin`, with every call recorded (G04, G05) and each scripted
//! fault turned into a real event on a host around the call:
//!
//! | Scripted fault | Call | What really happens |
//! |---|---|---|
//! | `definite` | create-lease | by turns: every slot of every host is taken by claims of a filler run (an **exhausted inventory**: "no free slot"), or every host's **sshd is stopped** (refused before anything ran) |
//! | `definite` | start-bootstrap | by turns: the host's line in the known-hosts file names another key (a **changed host key**), or the node's verify command **fails on the host** |
//! | `definite` | lookup-endpoint | a **changed host key** |
//! | `definite` | cancel-bootstrap, destroy-lease | the host's **sshd is stopped** for the call: refused |
//! | `not-ready` | lookup-endpoint | the host's **sshd is stopped** for the call: the host does not answer |
//! | `ambiguous-done` | create-lease | the test holds every host's claim lock, so the claim script waits on its host in `flock`; then the host's **link goes down** (mid-call), the lock is let go, the claim is made and its reply never comes back |
//! | `ambiguous-undone` | create-lease | as above, but the waiting `flock` is killed first: nothing is claimed, and no reply comes back either |
//! | `hang` | cancel-bootstrap, destroy-lease | the node's remote agent is stopped with **`SIGSTOP`** for the call (its stop waits on the host); `SIGCONT` on release |
//! | `hang` | create-lease | held before it reaches the plugin (a slow call) until released; the executor's deadline passes meanwhile |
//!
//! Every node's spec becomes the plugin's: the substrate's run, provider
//! `ssh`, one verify command that fails only while the node's marker file
//! exists, and a long-running workload.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use provisioning::effect::EffectRequest;
use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{EffectError, EffectOutput, EndpointLookup, LeaseHandle, Operation, RunId};
use provisioning_conformance::level3::{Intercept, PluginCall, RealNode, hold_call};
use provisioning_conformance::substrate::{CallRecorder, ResourceKey};
use provisioning_conformance::trace::Fault;
use provisioning_provider::{AttemptKey, PluginBackendAdapter, ProvisionPlugin};
use provisioning_ssh::PROVIDER_KIND;

use super::Level3;
use super::hosts::{Role, signal};
use super::shared::{Shared, hang_on};

/// The environment variable naming a node's verify-failure marker.
const FAIL_ENV: &str = "PROVISION_L3_FAIL";

/// The verify command of every node: it fails while the marker exists.
const VERIFY_COMMAND: &str =
    "[ ! -e \"$PROVISION_L3_FAIL\" ] || { echo 'level 3 fails this verify command' >&2; exit 1; }";

/// How often a cut create looks for its claim script waiting on a host.
const CUT_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// How long a cut create waits for its claim script to reach the lock.
const CUT_WAIT_MAX: Duration = Duration::from_secs(8);

/// How long a stopped agent may take to show as stopped.
const STOP_SETTLE_WAIT_MAX: Duration = Duration::from_secs(2);

/// A deliberate defect, to show that Level 3's counts come from the hosts
/// and not from anyone's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Defect {
    /// The plugin's destroy only cancels the bootstrap (the agent stops)
    /// and reports success: the claim stays on the host.
    DestroyLeavesClaim,
}

/// [`Defect::DestroyLeavesClaim`] around the real plugin: every method is
/// the real plugin's, except a destroy that leaves the claim.
pub(crate) struct LeakyDestroy;

impl Intercept for LeakyDestroy {
    fn destroy_node<'a>(
        &'a self,
        inner: &'a dyn ProvisionPlugin,
        key: &'a AttemptKey,
        _lease: &'a LeaseHandle,
    ) -> PluginCall<'a, ()> {
        // The defect: the agent goes, the claim stays.
        inner.cancel_bootstrap(key, None)
    }
}

/// The real world of one substrate.
pub(crate) struct World {
    /// The substrate's own run.
    pub(crate) run: RunId,
    /// The test's hosts.
    pub(crate) context: Arc<Level3>,
    /// Where verify-failure markers go.
    pub(crate) markers: PathBuf,
}

impl World {
    /// The host holding `key`'s claim.
    fn host_of(&self, key: &ResourceKey) -> Option<usize> {
        self.context.hosts().host_of(&self.run, key)
    }

    fn marker(&self, key: &ResourceKey) -> PathBuf {
        self.markers.join(format!("{}.{}", key.0, key.1.get()))
    }
}

/// The backend the executor runs effects through. See the module docs.
pub(crate) struct SshBackend {
    adapter: Arc<PluginBackendAdapter>,
    /// Calls as they start, for G04 and G05.
    pub(crate) calls: CallRecorder,
    shared: Arc<Shared>,
    world: Arc<World>,
    /// Turns of the faults that alternate.
    create_turn: AtomicU64,
    start_turn: AtomicU64,
}

/// Continues a stopped agent when its call ends without a release.
struct HangRelease<'a> {
    backend: &'a SshBackend,
    serial: u64,
}

impl Drop for HangRelease<'_> {
    fn drop(&mut self) {
        if let Some(hang) = self.backend.shared.end_hang(self.serial)
            && let Some(pid) = hang.what
            && signal(pid, "CONT", false)
        {
            self.backend.shared.count(|f| f.agents_continued += 1);
        }
    }
}

fn is_definite<T>(outcome: &Result<T, EffectError>) -> bool {
    outcome.as_ref().is_err_and(|e| !e.is_ambiguous())
}

impl SshBackend {
    /// A backend over `adapter`.
    pub(crate) fn new(
        adapter: PluginBackendAdapter,
        shared: Arc<Shared>,
        world: Arc<World>,
    ) -> Self {
        SshBackend {
            adapter: Arc::new(adapter),
            calls: CallRecorder::new(),
            shared,
            world,
            create_turn: AtomicU64::new(0),
            start_turn: AtomicU64::new(0),
        }
    }

    /// The operation as the ssh plugin sees it (see the module docs).
    fn translate(&self, operation: &Operation) -> Operation {
        let key = (operation.node.clone(), operation.attempt());
        RealNode {
            run: &self.world.run,
            provider: PROVIDER_KIND,
            verify_command: VERIFY_COMMAND,
            env: BTreeMap::from([(
                FAIL_ENV.to_owned(),
                self.world.marker(&key).display().to_string(),
            )]),
            shape: None,
        }
        .operation(operation)
    }

    async fn run(&self, operation: &Operation) -> Result<EffectOutput, EffectError> {
        let _recorded = self.calls.start(operation);
        let _in_flight = self.shared.call_started(operation.id);
        let key: ResourceKey = (operation.node.clone(), operation.attempt());
        let real = self.translate(operation);
        let fault = self.shared.take_script(operation.kind());
        if matches!(operation.request, EffectRequest::StartBootstrap { .. }) {
            self.shared.session_starting(&key);
        }
        let outcome = match (&operation.request, fault) {
            (EffectRequest::CreateLease, Some(Fault::Definite)) => {
                self.create_refused(&real, &key).await
            }
            (EffectRequest::CreateLease, Some(Fault::Hang)) => self.create_held(&real, &key).await,
            (EffectRequest::CreateLease, Some(Fault::AmbiguousDone)) => {
                self.create_cut(&real, &key, true).await
            }
            (EffectRequest::CreateLease, Some(Fault::AmbiguousUndone)) => {
                self.create_cut(&real, &key, false).await
            }
            (EffectRequest::CreateLease, _) => self.create(&real, &key).await,
            (EffectRequest::LookupEndpoint { .. }, Some(Fault::NotReady)) => {
                self.lookup_refused(&real, &key).await
            }
            (EffectRequest::LookupEndpoint { .. }, Some(Fault::Definite)) => {
                self.with_changed_key(&real, &key).await
            }
            (EffectRequest::StartBootstrap { .. }, Some(Fault::Definite)) => {
                if self.start_turn.fetch_add(1, Ordering::Relaxed) % 2 == 0 {
                    self.with_changed_key(&real, &key).await
                } else {
                    self.start_failing_verify(&real, &key).await
                }
            }
            (
                EffectRequest::CancelBootstrap { .. } | EffectRequest::DestroyLease { .. },
                Some(Fault::Definite),
            ) => self.with_sshd_stopped(&real, &key).await,
            (
                EffectRequest::CancelBootstrap { .. } | EffectRequest::DestroyLease { .. },
                Some(Fault::Hang),
            ) => self.with_agent_stopped(&real, &key).await,
            _ => self.adapter.execute(&real).await,
        };
        self.shared.answered(operation, &outcome);
        outcome
    }

    /// A create, then a look at the hosts: a new claim must be the only one
    /// of its slot.
    async fn create(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let outcome = self.adapter.execute(real).await;
        if let Ok(EffectOutput::LeaseCreated { adopted: false, .. }) = &outcome {
            self.check_single_claim(key);
        }
        outcome
    }

    /// Raises a G08 alarm when the slot of `key` has claims or agents of
    /// another attempt, or more than one claim of `key`, on the hosts.
    fn check_single_claim(&self, key: &ResourceKey) {
        let hosts = self.world.context.hosts();
        let mut own = 0;
        let mut others = Vec::new();
        for (host, (node, attempt)) in hosts.claims(&self.world.run) {
            if node != key.0 {
                continue;
            }
            if attempt == key.1 {
                own += 1;
            } else {
                others.push(format!("claim {node}/{attempt} on host {host}"));
            }
        }
        for process in hosts.processes_of(&self.world.run) {
            let Some((node, attempt)) = process.key() else {
                continue;
            };
            if node == key.0 && attempt != key.1 && process.role == Role::Agent {
                others.push(format!("agent {node}/{attempt} (pid {})", process.pid));
            }
        }
        if own > 1 || !others.is_empty() {
            self.shared.alarm(format!(
                "after creating {}/{}, the hosts hold {own} claim(s) of it and of other attempts of the slot: [{}]",
                key.0,
                key.1,
                others.join(", ")
            ));
        }
    }

    /// A create that meets an exhausted inventory, or every sshd stopped.
    async fn create_refused(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let hosts = self.world.context.hosts();
        if self.create_turn.fetch_add(1, Ordering::Relaxed) % 2 == 0 {
            let outcome = {
                let _full = hosts.fill();
                self.create(real, key).await
            };
            if let Err(error) = &outcome
                && !error.is_ambiguous()
                && error.to_string().contains("no free slot")
            {
                self.shared.count(|f| f.inventory_exhausted += 1);
            }
            outcome
        } else {
            let outcome = {
                let _stopped: Vec<_> = (0..hosts.len()).map(|h| hosts.stop_sshd(h)).collect();
                self.create(real, key).await
            };
            if is_definite(&outcome) {
                self.shared.count(|f| f.refused += 1);
            }
            outcome
        }
    }

    /// A create held before it reaches the plugin until the trace releases
    /// it (or, as a safety bound, the kit's `HOLD_WAIT_MAX` passes): a slow call. It
    /// runs as a task of the substrate's runtime, so it would go on after a
    /// controller crash (crashes are not exercised yet; see the substrate).
    async fn create_held(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let serial = hang_on(&self.shared, real.id, None);
        let outcome = hold_call(&self.shared, &self.adapter, serial, real).await;
        if let Ok(EffectOutput::LeaseCreated { adopted: false, .. }) = &outcome {
            self.check_single_claim(key);
        }
        outcome
    }

    /// A create cut off by a partition while its claim script waits on the
    /// host for the claim lock; with `done`, the claim is made before the
    /// lock is let go, else the waiting `flock` is killed first.
    async fn create_cut(
        &self,
        real: &Operation,
        key: &ResourceKey,
        done: bool,
    ) -> Result<EffectOutput, EffectError> {
        let hosts = self.world.context.hosts();
        let Some(mut locks) = hosts.lock_claims() else {
            return self.create(real, key).await;
        };
        let call = self.create(real, key);
        tokio::pin!(call);
        let deadline = Instant::now() + CUT_WAIT_MAX;
        let mut waiting = None;
        // Bounded by the deadline.
        while waiting.is_none() && Instant::now() < deadline {
            tokio::select! {
                outcome = &mut call => {
                    // It never reached the lock (adopted, or no host free).
                    locks.release();
                    return outcome;
                }
                () = tokio::time::sleep(CUT_POLL_INTERVAL) => {}
            }
            waiting = hosts.blocked_claims().first().copied();
        }
        let Some((host, pid)) = waiting else {
            locks.release();
            return call.await;
        };
        let outcome = {
            let _down = hosts.partition(host);
            if !done {
                signal(pid, "KILL", false);
            }
            locks.release();
            call.await
        };
        if outcome.as_ref().is_err_and(EffectError::is_ambiguous) {
            self.shared.count(|f| f.partitions += 1);
        }
        outcome
    }

    /// A lookup while the host's sshd is stopped.
    async fn lookup_refused(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let hosts = self.world.context.hosts();
        let Some(host) = self.world.host_of(key) else {
            return self.adapter.execute(real).await;
        };
        let outcome = {
            let _stopped = hosts.stop_sshd(host);
            self.adapter.execute(real).await
        };
        if let Ok(EffectOutput::Endpoint(EndpointLookup::NotReady)) = &outcome {
            self.shared.count(|f| f.refused_not_ready += 1);
        }
        outcome
    }

    /// A call while the host's sshd is stopped.
    async fn with_sshd_stopped(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let hosts = self.world.context.hosts();
        let Some(host) = self.world.host_of(key) else {
            return self.adapter.execute(real).await;
        };
        let outcome = {
            let _stopped = hosts.stop_sshd(host);
            self.adapter.execute(real).await
        };
        if is_definite(&outcome) {
            self.shared.count(|f| f.refused += 1);
        }
        outcome
    }

    /// A call while the known-hosts file names another key for the host.
    async fn with_changed_key(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let hosts = self.world.context.hosts();
        let Some(host) = self.world.host_of(key) else {
            return self.adapter.execute(real).await;
        };
        let outcome = {
            let _changed = hosts.change_key(host);
            self.adapter.execute(real).await
        };
        if let Err(error) = &outcome
            && !error.is_ambiguous()
            && error.to_string().contains("HOST KEY VERIFICATION FAILED")
        {
            self.shared.count(|f| f.host_key_changed += 1);
        }
        outcome
    }

    /// A bootstrap start whose verify command fails on the host.
    async fn start_failing_verify(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let marker = self.world.marker(key);
        if let Err(error) = std::fs::write(&marker, b"fail\n") {
            eprintln!("level 3: cannot write the verify marker: {error}");
        }
        let outcome = self.adapter.execute(real).await;
        let _ = std::fs::remove_file(&marker);
        if let Err(error) = &outcome
            && !error.is_ambiguous()
            && error.to_string().contains("boot check failed")
        {
            self.shared.count(|f| f.verify_failures += 1);
        }
        outcome
    }

    /// A call against the node's remote agent stopped with `SIGSTOP`.
    async fn with_agent_stopped(
        &self,
        real: &Operation,
        key: &ResourceKey,
    ) -> Result<EffectOutput, EffectError> {
        let hosts = self.world.context.hosts();
        let agent = hosts
            .processes_of_key(&self.world.run, key, Role::Agent)
            .into_iter()
            .find(|p| p.state != 'T');
        let Some(agent) = agent.filter(|a| signal(a.pid, "STOP", false)) else {
            return self.adapter.execute(real).await;
        };
        let deadline = Instant::now() + STOP_SETTLE_WAIT_MAX;
        while Instant::now() < deadline
            && hosts
                .processes_of_key(&self.world.run, key, Role::Agent)
                .iter()
                .any(|p| p.pid == agent.pid && p.state != 'T')
        {
            tokio::time::sleep(CUT_POLL_INTERVAL).await;
        }
        let serial = hang_on(&self.shared, real.id, Some(agent.pid));
        let _release = HangRelease {
            backend: self,
            serial,
        };
        self.adapter.execute(real).await
    }
}

impl EffectBackend for SshBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        Box::pin(self.run(operation))
    }
}
