//! The provider seam: [`ProvisionPlugin`] for [`SshPlugin`].

use super::*;

#[async_trait]
impl ProvisionPlugin for SshPlugin {
    fn kind(&self) -> &str {
        PROVIDER_KIND
    }

    fn attach(&self, sink: ObservationSink) {
        self.shared.attach(sink);
    }

    /// Pushes the membership to every agent of the swarm.
    fn membership_changed(&self, membership: &Arc<provisioning::Membership>) {
        if let Some(agent) = &self.agent {
            agent.swarm.publish_peers(membership);
        }
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
        let order = serde_json::to_string(&self.boot_order(agent, key, request))
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
