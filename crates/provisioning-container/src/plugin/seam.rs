//! The `ProvisionPlugin` methods of [`ContainerPlugin`], and the helpers
//! only they use (the container's definition, adoption, the boot order).

use std::collections::HashMap;

use async_trait::async_trait;
use bollard::Docker;
use bollard::models::{ContainerCreateBody, ContainerInspectResponse, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptions, ListContainersOptions, RemoveContainerOptions, StopContainerOptions,
};
use provisioning::effect::SessionHandle;
use provisioning::observe::BootstrapEvent;
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{Endpoint, EndpointLookup, LeaseHandle, LogicalNodeSpec, RunId};
use provisioning_agent::wire::{BootOrder, JoinOrder, PROTOCOL_VERSION};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};

use super::exec::{self, HOLD_SCRIPT};
use super::{
    ADOPTED_JOIN_WAIT, ContainerPlugin, FaultMode, FaultStep, LABEL_ATTEMPT, LABEL_MANAGED_BY,
    LABEL_NODE, LABEL_RUN, MANAGED_BY, PROVIDER_KIND, Session, container_name, key_of, lease_of,
    lock, stage_rank,
};
use crate::config::{AGENT_MOUNT_PATH, AgentSource, GroupShape};
use crate::engine::{self, Failure};

/// The network a container joins when its group names none.
const DEFAULT_NETWORK: &str = "bridge";

fn name_of(key: &AttemptKey) -> Result<String, PluginError> {
    container_name(key).ok_or_else(|| {
        PluginError::definite(format!(
            "{key} cannot name a container: run and group names must use letters, digits, '.', '_' and '-'"
        ))
    })
}

fn session_of(name: &str) -> SessionHandle {
    SessionHandle(format!("container-agent:{name}"))
}

/// What an inspected container's state says.
enum Liveness {
    /// Running (or paused): it is the node.
    Running,
    /// Created, restarting: not yet, or not now.
    Pending,
    /// Exited or dead, with its exit code.
    Ended(Option<i64>),
}

fn liveness(container: &ContainerInspectResponse) -> Liveness {
    let Some(state) = container.state.as_ref() else {
        return Liveness::Pending;
    };
    if state.paused == Some(true) {
        // Frozen: nothing in it answers until it is unpaused.
        return Liveness::Pending;
    }
    if state.running == Some(true) && state.restarting != Some(true) {
        return Liveness::Running;
    }
    let status = state.status.map(|s| s.to_string()).unwrap_or_default();
    match status.as_str() {
        "exited" | "dead" | "removing" => Liveness::Ended(state.exit_code),
        _ => Liveness::Pending,
    }
}

impl ContainerPlugin {
    /// The container of `key`, found by its labels (any state).
    async fn find(&self, key: &AttemptKey) -> Result<Option<(String, String)>, PluginError> {
        let filters = HashMap::from([(
            "label".to_owned(),
            vec![
                format!("{LABEL_MANAGED_BY}={MANAGED_BY}"),
                format!("{LABEL_RUN}={}", key.run_id),
                format!("{LABEL_NODE}={}", key.node),
                format!("{LABEL_ATTEMPT}={}", key.attempt.get()),
            ],
        )]);
        let options = ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        };
        let rows = self
            .engine()?
            .list_containers(Some(options))
            .await
            .map_err(|e| engine::looking(&format!("looking for the container of {key}"), &e))?;
        Ok(rows
            .into_iter()
            .filter(|c| key_of(&key.run_id, c.labels.as_ref()).as_ref() == Some(key))
            .find_map(|c| {
                let state = c.state.map(|s| s.to_string()).unwrap_or_default();
                c.id.map(|id| (id, state))
            }))
    }

    /// The inspected container `name`; `None` when it does not exist.
    async fn inspect(
        &self,
        name: &str,
        what: &str,
    ) -> Result<Option<ContainerInspectResponse>, PluginError> {
        match self.engine()?.inspect_container(name, None).await {
            Ok(container) => Ok(Some(container)),
            Err(error) if engine::classify(&error) == Failure::Missing => Ok(None),
            Err(error) => Err(engine::looking(what, &error)),
        }
    }

    /// Adopts the existing container `id` of `key` (state `state`): one that
    /// was created but never started is started now.
    async fn adopt(
        &self,
        key: &AttemptKey,
        id: &str,
        state: &str,
    ) -> Result<NodeLease, PluginError> {
        if state == "created" {
            self.engine()?
                .start_container(id, None)
                .await
                .map_err(|e| {
                    PluginError::ambiguous(format!("starting the adopted container of {key}: {e}"))
                })?;
        }
        self.shared.watch(key, id);
        tracing::info!(node = %key, container = %id, state, "adopted the node's container");
        Ok(NodeLease {
            lease: lease_of(id),
            endpoint: None,
            adopted: true,
        })
    }

    fn definition(&self, key: &AttemptKey, shape: &GroupShape) -> ContainerCreateBody {
        let labels = HashMap::from([
            (LABEL_MANAGED_BY.to_owned(), MANAGED_BY.to_owned()),
            (LABEL_RUN.to_owned(), key.run_id.as_str().to_owned()),
            (LABEL_NODE.to_owned(), key.node.to_string()),
            (LABEL_ATTEMPT.to_owned(), key.attempt.get().to_string()),
        ]);
        let mut binds: Vec<String> = shape.mounts.clone().unwrap_or_default();
        if let AgentSource::Mount(path) = &self.shared.config.agent {
            binds.push(format!("{}:{AGENT_MOUNT_PATH}:ro", path.display()));
        }
        let env: Vec<String> = shape
            .env
            .iter()
            .flatten()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        ContainerCreateBody {
            image: shape.image.clone(),
            entrypoint: Some(vec!["/bin/sh".into(), "-c".into(), HOLD_SCRIPT.into()]),
            labels: Some(labels),
            env: (!env.is_empty()).then_some(env),
            user: shape.user.clone(),
            host_config: Some(HostConfig {
                nano_cpus: shape.cpus.map(|c| (c * 1e9) as i64),
                memory: shape.memory_bytes(),
                binds: (!binds.is_empty()).then_some(binds),
                network_mode: Some(
                    shape
                        .network
                        .clone()
                        .unwrap_or_else(|| DEFAULT_NETWORK.to_owned()),
                ),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Creates and starts the container of `key` on `docker`.
    async fn make(
        &self,
        docker: &Docker,
        key: &AttemptKey,
        name: &str,
        body: ContainerCreateBody,
    ) -> Result<String, PluginError> {
        let what = format!("creating the container of {key}");
        let options = CreateContainerOptions {
            name: Some(name.to_owned()),
            ..Default::default()
        };
        let image = body.image.clone().unwrap_or_default();
        let created = match docker.create_container(Some(options), body).await {
            Ok(created) => created,
            Err(error) => {
                return Err(match engine::classify(&error) {
                    Failure::Missing => PluginError::definite(format!(
                        "{what}: image {image:?} is not on the engine (the container provider never pulls; build or load it there): {error}"
                    )),
                    Failure::Conflict => match self.find(key).await? {
                        Some((id, _)) => return Ok(id),
                        None => PluginError::definite(format!(
                            "{what}: the name {name:?} is taken by a container that is not this node's: {error}"
                        )),
                    },
                    _ => engine::acting(&what, &error),
                });
            }
        };
        let id = created.id;
        if let Err(error) = docker.start_container(&id, None).await {
            let start_error = error.to_string();
            // Take the container back, so that a failed start leaves nothing.
            let removed = docker
                .remove_container(
                    &id,
                    Some(RemoveContainerOptions {
                        force: true,
                        ..Default::default()
                    }),
                )
                .await;
            return Err(match removed {
                Ok(()) => PluginError::definite(format!(
                    "{what}: the engine could not start it (removed again): {start_error}"
                )),
                Err(_) => PluginError::ambiguous(format!(
                    "{what}: the engine could not start it and it may still exist: {start_error}"
                )),
            });
        }
        Ok(id)
    }

    fn agent_command(&self) -> Vec<String> {
        let program = match &self.shared.config.agent {
            AgentSource::Mount(_) => AGENT_MOUNT_PATH.to_owned(),
            AgentSource::InImage(path) => path.clone(),
        };
        let mut command = vec![program];
        command.extend(self.shared.config.agent_args.iter().cloned());
        command
    }

    fn boot_order(&self, key: &AttemptKey, request: &BootstrapRequest) -> BootOrder {
        let spec = &request.spec;
        let template = spec.template();
        let boot = &template.boot;
        BootOrder {
            protocol: PROTOCOL_VERSION,
            run: key.run_id.as_str().to_owned(),
            node: key.node.to_string(),
            attempt: key.attempt.get(),
            user: boot.user.clone(),
            verify_commands: boot.verify_commands.clone(),
            start_command: boot.start_command.clone(),
            env: boot.env.clone(),
            args: boot.args.clone(),
            join: JoinOrder {
                address: self.swarm.advertised(),
                credential: self.swarm.credential(key).to_hex(),
                swarm: template.swarm_join.swarm.clone(),
                labels: template.swarm_join.labels.clone(),
            },
            resume_only: false,
            group_size: self.swarm.group_size(key.node.group()),
            address: Some(provisioning_agent::wire::address_of_endpoint(
                &request.endpoint.0,
            )),
            on_peers_change: boot.on_peers_change.clone(),
        }
    }

    /// Whether the agent runs inside container `name`.
    async fn agent_running(&self, key: &AttemptKey, name: &str) -> Result<bool, PluginError> {
        let outcome = exec::run_script(
            &self.engine()?,
            name,
            &format!("looking for the agent of {key}"),
            &exec::probe_script(),
        )
        .await?;
        Ok(outcome.stdout.contains("RUNNING"))
    }

    /// Starts the agent of `key` in container `name`.
    async fn launch(
        &self,
        key: &AttemptKey,
        name: &str,
        request: &BootstrapRequest,
    ) -> Result<(), PluginError> {
        let order = serde_json::to_vec(&self.boot_order(key, request))
            .map_err(|e| PluginError::definite(format!("cannot encode the boot order: {e}")))?;
        let serial = self.shared.next_serial();
        lock(&self.shared.sessions).insert(
            key.clone(),
            Session {
                serial,
                rank: 0,
                settled: false,
                joined: false,
                quiet: false,
            },
        );
        self.swarm.expect(key);
        self.shared
            .progress(key, serial, BootstrapProgress::Connecting);
        tracing::info!(node = %key, container = name, "starting the agent");
        let launched = exec::launch_agent(
            &self.engine()?,
            &self.shared,
            key,
            serial,
            name,
            self.agent_command(),
            order,
        )
        .await;
        if let Err(error) = launched {
            if !matches!(error, PluginError::Ambiguous(_)) {
                lock(&self.shared.sessions).remove(key);
                self.swarm.forget(key);
            }
            return Err(error);
        }
        self.shared
            .progress(key, serial, BootstrapProgress::Connected);
        self.spawn_join_watchdog(key, serial);
        Ok(())
    }

    /// Fails session `serial` of `key` if its agent has not joined within
    /// the join time-out.
    fn spawn_join_watchdog(&self, key: &AttemptKey, serial: u64) {
        let shared = std::sync::Arc::downgrade(&self.shared);
        let wait = self.shared.config.join_timeout;
        let key = key.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            if let Some(shared) = shared.upgrade() {
                shared.fail(
                    &key,
                    serial,
                    BootstrapFailure::JoinFailed,
                    format!("the agent did not join within {wait:?}"),
                );
            }
        });
    }

    /// Listed running containers of this run whose agent runs, from an
    /// earlier controller: unless expected already, each agent is expected
    /// to re-join (adopted, workload untouched) and its container watched.
    async fn adopt_agents(&self, run: &RunId, listed: &[(String, bool, AttemptKey)]) {
        if run != &self.shared.config.run_id {
            return;
        }
        let expected: std::collections::BTreeSet<AttemptKey> =
            self.swarm.expected().into_iter().collect();
        for (id, running, key) in listed {
            if !*running || expected.contains(key) {
                continue;
            }
            match self.agent_running(key, id).await {
                Ok(true) => {
                    tracing::info!(node = %key, container = %id, "expecting the agent of a listed container to re-join");
                    self.shared.watch(key, id);
                    self.swarm.expect_adopted(key, ADOPTED_JOIN_WAIT);
                }
                Ok(false) => {}
                Err(error) => tracing::debug!(node = %key, %error, "cannot look for the agent"),
            }
        }
    }
}

#[async_trait]
impl ProvisionPlugin for ContainerPlugin {
    fn kind(&self) -> &str {
        PROVIDER_KIND
    }

    fn attach(&self, sink: ObservationSink) {
        *lock(&self.shared.sink) = Some(sink);
    }

    /// Pushes the membership to every agent of the swarm.
    fn membership_changed(&self, membership: &std::sync::Arc<provisioning::Membership>) {
        self.swarm.publish_peers(membership);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let name = name_of(key)?;
        let shape = GroupShape::from_labels(&spec.template().shape.labels).map_err(|errors| {
            let listed: Vec<String> = errors.iter().map(ToString::to_string).collect();
            PluginError::definite(format!(
                "the container table of {key} is invalid: {}",
                listed.join("; ")
            ))
        })?;
        let existing = match self.find(key).await {
            Ok(existing) => existing,
            Err(error) if lock(&self.shared.sent).contains(key) => {
                return Err(PluginError::ambiguous(format!(
                    "a container of {key} was asked for and cannot be looked for now: {error}"
                )));
            }
            Err(error) => return Err(error),
        };
        if let Some((id, state)) = existing {
            return self.adopt(key, &id, &state).await;
        }
        let fault = self.take_fault(FaultStep::Create);
        let docker = match fault {
            Some(FaultMode::Refused) => self.refusing_client()?,
            _ => self.engine()?,
        };
        lock(&self.shared.sent).insert(key.clone());
        let body = self.definition(key, &shape);
        let id = match self.make(&docker, key, &name, body).await {
            Ok(id) => id,
            Err(error) => {
                if matches!(error, PluginError::Definite(_)) {
                    lock(&self.shared.sent).remove(key);
                }
                return Err(error);
            }
        };
        self.shared.watch(key, &id);
        lock(&self.shared.fresh).insert(key.clone());
        tracing::info!(node = %key, container = %id, "created the node's container");
        if fault == Some(FaultMode::ReplyLost) {
            return Err(PluginError::ambiguous(format!(
                "creating the container of {key}: the reply was lost (fault hook)"
            )));
        }
        Ok(NodeLease {
            lease: lease_of(&id),
            endpoint: None,
            adopted: false,
        })
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        let name = name_of(key)?;
        let what = format!("looking at the container of {key}");
        let Some(container) = self.inspect(&name, &what).await? else {
            lock(&self.shared.known).remove(key);
            return Err(PluginError::not_found(format!("no container {name}")));
        };
        match liveness(&container) {
            Liveness::Running => {
                if let Some(id) = container.id.as_deref() {
                    self.shared.watch(key, id);
                }
                let address = container
                    .network_settings
                    .as_ref()
                    .and_then(|n| n.networks.as_ref())
                    .and_then(|networks| {
                        networks
                            .values()
                            .filter_map(|n| n.ip_address.clone())
                            .find(|ip| !ip.is_empty())
                    })
                    .unwrap_or(name);
                Ok(EndpointLookup::Ready(Endpoint(format!(
                    "container://{address}"
                ))))
            }
            Liveness::Pending => Ok(EndpointLookup::NotReady),
            Liveness::Ended(code) => Err(PluginError::not_found(format!(
                "the container {name} ended (exit status {})",
                code.map_or_else(|| "unknown".to_owned(), |c| c.to_string())
            ))),
        }
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        let name = name_of(key)?;
        let session = session_of(&name);
        let replay = {
            let mut sessions = lock(&self.shared.sessions);
            sessions.get_mut(key).map(|s| {
                // A quiet session is re-attached by this adopting start:
                // what its agent did meanwhile is reported now.
                let replay = std::mem::replace(&mut s.quiet, false) && s.joined;
                if replay {
                    s.rank = stage_rank(BootstrapProgress::WaitingForJoin);
                }
                replay
            })
        };
        if let Some(replay) = replay {
            if replay {
                self.shared.report(
                    key,
                    BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin),
                );
                self.shared.report(key, BootstrapEvent::Joined);
            }
            return Ok(BootstrapSession {
                session,
                adopted: true,
            });
        }
        let what = format!("looking at the container of {key}");
        let Some(container) = self.inspect(&name, &what).await? else {
            return Err(PluginError::not_found(format!("no container {name}")));
        };
        match liveness(&container) {
            Liveness::Running => {}
            Liveness::Pending => {
                return Err(PluginError::definite(format!(
                    "the container of {key} is not running yet"
                )));
            }
            Liveness::Ended(_) => {
                return Err(PluginError::not_found(format!(
                    "the container {name} ended"
                )));
            }
        }
        if let Some(id) = container.id.as_deref() {
            self.shared.watch(key, id);
        }
        // A container this instance made holds no agent yet: the look
        // inside (one exec) is only for containers found or adopted.
        let fresh = lock(&self.shared.fresh).remove(key);
        if !fresh && self.agent_running(key, &name).await? {
            // An agent from an earlier controller: take it back.
            let joined = lock(&self.shared.rejoined).remove(key);
            lock(&self.shared.sessions).insert(
                key.clone(),
                Session {
                    serial: self.shared.next_serial(),
                    rank: stage_rank(BootstrapProgress::WaitingForJoin),
                    settled: true,
                    joined,
                    quiet: false,
                },
            );
            if !self.swarm.expected().contains(key) {
                self.swarm.expect_adopted(key, ADOPTED_JOIN_WAIT);
            }
            if joined {
                self.shared.report(key, BootstrapEvent::Joined);
            }
            return Ok(BootstrapSession {
                session,
                adopted: true,
            });
        }
        self.launch(key, &name, request).await?;
        Ok(BootstrapSession {
            session,
            adopted: false,
        })
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        let name = name_of(key)?;
        let what = format!("looking at the container of {key}");
        match self.inspect(&name, &what).await? {
            Some(container) if !matches!(liveness(&container), Liveness::Ended(_)) => {
                if let Some(s) = lock(&self.shared.sessions).get_mut(key) {
                    s.settled = true;
                }
                self.shared.report(key, BootstrapEvent::Closed);
                Ok(())
            }
            _ => Err(PluginError::not_found(format!("no live container {name}"))),
        }
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        let Ok(name) = name_of(key) else {
            return Ok(());
        };
        lock(&self.shared.sessions).remove(key);
        self.swarm.forget(key);
        let what = format!("stopping the agent of {key}");
        let Some(container) = self.inspect(&name, &what).await? else {
            return Ok(());
        };
        if !matches!(liveness(&container), Liveness::Running) {
            return Ok(());
        }
        let grace_ticks = (self.shared.config.stop_grace.as_millis() / 100).max(1) as u64;
        match exec::run_script(
            &self.engine()?,
            &name,
            &what,
            &exec::stop_script(grace_ticks),
        )
        .await
        {
            Ok(outcome) if outcome.stdout.contains("GONE") => Ok(()),
            Ok(outcome) => Err(PluginError::ambiguous(format!(
                "{what}: it did not go (exit status {:?})",
                outcome.exit_code
            ))),
            // The container went meanwhile: so did the agent.
            Err(PluginError::NotFound(_)) => Ok(()),
            Err(error) => Err(error),
        }
    }

    async fn destroy_node(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<(), PluginError> {
        let Ok(name) = name_of(key) else {
            return Ok(());
        };
        // Not watched while it goes: its end is no loss.
        let watched = lock(&self.shared.known).remove(key);
        lock(&self.shared.fresh).remove(key);
        lock(&self.shared.sessions).remove(key);
        self.swarm.forget(key);
        let fault = self.take_fault(FaultStep::Destroy);
        let docker = match fault {
            Some(FaultMode::Refused) => self.refusing_client()?,
            _ => self.engine()?,
        };
        let what = format!("destroying the container of {key}");
        let grace = i32::try_from(self.shared.config.stop_grace.as_secs()).unwrap_or(i32::MAX);
        let stopped = docker
            .stop_container(
                &name,
                Some(StopContainerOptions {
                    t: Some(grace),
                    ..Default::default()
                }),
            )
            .await;
        let result = match stopped {
            // 304: it was not running.
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 304, ..
            }) => Ok(()),
            Err(error) if engine::classify(&error) == Failure::Missing => Ok(()),
            Err(error) => Err(engine::acting(&what, &error)),
            Ok(()) => Ok(()),
        };
        let result = match result {
            Ok(()) => match docker
                .remove_container(
                    &name,
                    Some(RemoveContainerOptions {
                        force: true,
                        ..Default::default()
                    }),
                )
                .await
            {
                Ok(()) => Ok(()),
                Err(error) if engine::classify(&error) == Failure::Missing => Ok(()),
                Err(error) => Err(engine::acting(&what, &error)),
            },
            Err(error) => Err(error),
        };
        match &result {
            Ok(()) => {
                lock(&self.shared.sent).remove(key);
                if fault == Some(FaultMode::ReplyLost) {
                    return Err(PluginError::ambiguous(format!(
                        "{what}: the reply was lost (fault hook)"
                    )));
                }
            }
            Err(PluginError::Definite(_)) => {
                if let Some(id) = watched {
                    self.shared.watch(key, &id);
                }
            }
            Err(_) => {}
        }
        result
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        let rows = self.shared.containers_of(&self.engine()?, run).await?;
        let listed: Vec<(String, bool, AttemptKey)> = rows
            .into_iter()
            .filter_map(|c| {
                let key = key_of(run, c.labels.as_ref())?;
                let running = c.state.map(|s| s.to_string()).as_deref() == Some("running");
                Some((c.id?, running, key))
            })
            .collect();
        self.adopt_agents(run, &listed).await;
        let mut nodes: Vec<ListedNode> = listed
            .into_iter()
            .map(|(id, _, key)| ListedNode {
                key,
                lease: lease_of(&id),
            })
            .collect();
        nodes.sort();
        Ok(nodes)
    }
}
