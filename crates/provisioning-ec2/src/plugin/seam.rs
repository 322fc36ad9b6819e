//! The provider seam: [`ProvisionPlugin`] for [`Ec2Plugin`].

use super::*;

impl Ec2Plugin {
    /// The live instances of `key`, sorted by id.
    async fn instances_of(&self, key: &AttemptKey) -> Result<Vec<Instance>, crate::Ec2Error> {
        let mut found = self
            .client
            .describe_instances(&Self::key_filters(key), &[])
            .await?;
        found.retain(|i| !i.state.is_ending() && key_of(i, &key.run_id).as_ref() == Some(key));
        found.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(found)
    }

    /// One instance by id; `None` when the server does not know it.
    async fn instance(&self, id: &str) -> Result<Option<Instance>, crate::Ec2Error> {
        match self.client.describe_instances(&[], &[id.to_owned()]).await {
            Ok(found) => Ok(found.into_iter().find(|i| i.id == id)),
            Err(error) if error.is_not_found() => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Adopts the first of `found` and terminates the others: instances a
    /// server that ignores tokens made twice (never expected, but nothing
    /// of a key may stay doubled).
    async fn adopt(&self, key: &AttemptKey, found: Vec<Instance>) -> NodeLease {
        let first = &found[0];
        if found.len() > 1 {
            let extra: Vec<String> = found[1..].iter().map(|i| i.id.clone()).collect();
            tracing::warn!(node = %key, kept = %first.id, ?extra, "more than one instance for one attempt: terminating the extra");
            if let Err(error) = self.client.terminate_instances(&extra).await {
                tracing::warn!(node = %key, %error, "terminating extra instances failed; the orphan sweep will retry");
            }
        }
        self.watch(key, &first.id);
        NodeLease {
            lease: lease_of(&first.id),
            endpoint: None,
            adopted: true,
        }
    }
}

#[async_trait]
impl ProvisionPlugin for Ec2Plugin {
    fn kind(&self) -> &str {
        PROVIDER_KIND
    }

    fn attach(&self, sink: ObservationSink) {
        self.shared.attach(sink);
    }

    /// Pushes the membership to every agent of the swarm.
    fn membership_changed(&self, membership: &std::sync::Arc<provisioning::Membership>) {
        if let Some(agent) = &self.agent {
            agent.swarm.publish_peers(membership);
        }
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let shape = GroupShape::from_labels(&spec.template().shape.labels).map_err(|e| {
            PluginError::definite(format!("the group's ec2 table is invalid for {key}: {e}"))
        })?;
        // Look first. A look that failed cannot say nothing exists (an
        // earlier create may have acted), so its failure is ambiguous.
        let found = self.instances_of(key).await.map_err(|e| {
            PluginError::ambiguous(format!(
                "looking for the instance of {key} before creating it: {e}"
            ))
        })?;
        if !found.is_empty() {
            return Ok(self.adopt(key, found).await);
        }
        // Expected before it can boot, so its first dial is never refused.
        let newly_expected = match &self.agent {
            Some(agent) if !agent.swarm.is_expected(key) => {
                agent.swarm.expect(key);
                true
            }
            _ => false,
        };
        let request = RunRequest {
            client_token: client_token(key),
            image_id: shape.image.clone(),
            instance_type: shape.instance_type.clone(),
            subnet_id: shape.subnet.clone(),
            zone: shape.zone.clone(),
            key_name: shape.key_name.clone(),
            security_group_ids: shape.security_groups.clone(),
            spot: shape.spot.then(|| shape.spot_max_price.clone()),
            root_volume_gib: shape.root_volume_gib,
            tags: self.tags(key, &shape),
            user_data: self.user_data(key, spec)?,
        };
        match self.client.run_instance(&request).await {
            Ok(instance) => {
                tracing::info!(node = %key, instance = %instance.id, "instance created");
                self.watch(key, &instance.id);
                Ok(NodeLease {
                    lease: lease_of(&instance.id),
                    endpoint: None,
                    adopted: false,
                })
            }
            Err(error) => {
                if !error.may_have_acted() && newly_expected {
                    self.forget_agent(key);
                }
                Err(error.into_plugin_error(&format!("creating the instance of {key}"), true))
            }
        }
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        let Some(id) = instance_of(lease) else {
            return Err(PluginError::not_found(format!(
                "{} is no lease of {key}",
                lease.0
            )));
        };
        let instance = self
            .instance(id)
            .await
            .map_err(|e| e.into_plugin_error("looking up the endpoint", false))?;
        match instance {
            Some(instance) if key_of(&instance, &key.run_id).as_ref() != Some(key) => Err(
                PluginError::not_found(format!("instance {id} is not tagged for {key}")),
            ),
            Some(instance) if instance.state == InstanceState::Running => {
                self.watch(key, id);
                Ok(match self.endpoint_of(&instance) {
                    Some(endpoint) => EndpointLookup::Ready(endpoint),
                    None => EndpointLookup::NotReady,
                })
            }
            Some(instance) if instance.state == InstanceState::Pending => {
                Ok(EndpointLookup::NotReady)
            }
            Some(instance) => Err(PluginError::not_found(format!(
                "instance {id} of {key} is {}",
                instance.state.as_str()
            ))),
            None => Err(PluginError::not_found(format!(
                "instance {id} of {key} is gone"
            ))),
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
        let Some(id) = instance_of(&request.lease) else {
            return Err(PluginError::not_found(format!(
                "{} is no lease of {key}",
                request.lease.0
            )));
        };
        let session = SessionHandle(format!("ec2-session:{id}"));
        if self.shared.is_announced(key) {
            return Ok(BootstrapSession {
                session,
                adopted: true,
            });
        }
        // The instance boots its agent from its user-data: nothing to start,
        // only a join to wait for. A key no longer expected (an earlier
        // watchdog gave up, a restart) is expected again.
        let adopted = agent.swarm.is_expected(key) && !self.shared.agents().contains_key(key);
        if !agent.swarm.is_expected(key) {
            agent.swarm.expect(key);
        }
        for stage in [
            BootstrapProgress::Connecting,
            BootstrapProgress::Connected,
            BootstrapProgress::AgentStarting,
            BootstrapProgress::WaitingForJoin,
        ] {
            self.shared.report(key, BootstrapEvent::Progress(stage));
        }
        self.shared.announce(key);
        if !self.shared.is_joined(key) {
            self.spawn_join_watchdog(agent, key);
        }
        Ok(BootstrapSession { session, adopted })
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        if self.shared.is_joined(key) {
            self.shared.report(key, BootstrapEvent::Closed);
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
        let id = session
            .and_then(|s| s.0.strip_prefix("ec2-session:"))
            .map(str::to_owned);
        let found = match id {
            Some(id) => self.instance(&id).await.map(|i| i.into_iter().collect()),
            None => self.instances_of(key).await,
        }
        .map_err(|e| e.into_plugin_error("completing the bootstrap", false))?;
        if found.iter().any(|i: &Instance| !i.state.is_ending()) {
            return Err(PluginError::definite(format!(
                "the bootstrap of {key} cannot complete: its agent has not joined"
            )));
        }
        Err(PluginError::not_found(format!(
            "the instance of {key} is gone"
        )))
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        // The agent runs until its instance is terminated; no longer
        // expected, its dials are refused from now on and it stops at the
        // end of its re-join window.
        self.forget_agent(key);
        Ok(())
    }

    async fn destroy_node(&self, key: &AttemptKey, lease: &LeaseHandle) -> Result<(), PluginError> {
        let Some(id) = instance_of(lease) else {
            // Not a lease this plugin issued: nothing of it exists.
            return Ok(());
        };
        // Not watched while it goes: its end is no loss.
        let watched = lock(&self.known).remove(key);
        self.forget_agent(key);
        let restore = || {
            if let Some(id) = &watched {
                self.watch(key, id);
            }
        };
        match self.client.terminate_instances(&[id.to_owned()]).await {
            Ok(changes) => match changes.iter().find(|c| c.id == id) {
                Some(change) if change.current.is_ending() => Ok(()),
                Some(change) => Err(PluginError::ambiguous(format!(
                    "instance {id} of {key} is still {} after TerminateInstances",
                    change.current.as_str()
                ))),
                None => Err(PluginError::ambiguous(format!(
                    "TerminateInstances did not say what became of instance {id} of {key}"
                ))),
            },
            Err(error) if error.is_not_found() => Ok(()),
            Err(error) => {
                if !error.may_have_acted() {
                    restore();
                }
                Err(error.into_plugin_error(&format!("terminating instance {id} of {key}"), true))
            }
        }
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        let filters = [
            Filter::new(format!("tag:{TAG_RUN}"), &[run.as_str()]),
            Filter::new(format!("tag:{TAG_MANAGED_BY}"), &[MANAGED_BY]),
            Filter::new("instance-state-name", &InstanceState::LIVE),
        ];
        let listed = self
            .client
            .describe_instances(&filters, &[])
            .await
            .map_err(|e| e.into_plugin_error("listing instances", false))?;
        let mut nodes = Vec::new();
        for instance in listed.iter().filter(|i| !i.state.is_ending()) {
            let Some(key) = key_of(instance, run) else {
                tracing::warn!(instance = %instance.id, "ignoring an instance whose tags name no attempt");
                continue;
            };
            if key.run_id == self.config.run_id {
                self.watch(&key, &instance.id);
                self.adopt_agent(&key);
            }
            nodes.push(ListedNode {
                key,
                lease: lease_of(&instance.id),
            });
        }
        nodes.sort();
        nodes.dedup();
        Ok(nodes)
    }
}

impl Drop for Ec2Plugin {
    fn drop(&mut self) {
        self.shared.close();
    }
}
