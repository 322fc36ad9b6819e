//! Starting a node's agent on its host, adopting agents a restarted
//! controller finds, and the watchdog that fails a bootstrap whose agent
//! never joins.

use super::*;

impl SshPlugin {
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
    pub(super) fn adopt_agent(&self, key: &AttemptKey, host: usize) {
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

    pub(super) fn watch(&self, key: &AttemptKey, host: usize) {
        if key.run_id == self.config.run_id {
            lock(&self.known).insert(key.clone(), host);
        }
    }

    /// Stops expecting the agent of `key`: nothing more is reported about
    /// it, and its swarm connection (if any) is dropped.
    pub(super) fn forget_agent(&self, key: &AttemptKey) {
        self.shared.forget(key);
        if let Some(agent) = &self.agent {
            agent.swarm.forget(key);
        }
    }

    /// The boot order of `key`'s agent: its workload, and how to join.
    pub(super) fn boot_order(
        &self,
        agent: &AgentRuntime,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> BootOrder {
        let template = request.spec.template();
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
            group_size: agent.swarm.group_size(key.node.group()),
            address: Some(wire::address_of_endpoint(&request.endpoint.0)),
            on_peers_change: boot.on_peers_change.clone(),
            resume_only: false,
        }
    }

    /// Fails the bootstrap of `key` unless its agent joins within the join
    /// timeout (it exited, could not reach the listener, was refused): the
    /// failure carries what the agent's status file and log say.
    pub(super) fn spawn_join_watchdog(&self, agent: &AgentRuntime, key: &AttemptKey, index: usize) {
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
}

/// Why an agent did not join, from the `STATUS`/`LOG` lines of
/// [`script::session_report`].
pub(super) fn join_failure(report: &str, wait: Duration) -> (BootstrapFailure, String) {
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
