//! The provider seam of the Slurm plugin: `ProvisionPlugin` for
//! [`SlurmPlugin`], over the job and step helpers of its parent module.

#[allow(clippy::wildcard_imports)]
use super::*;

#[async_trait]
impl ProvisionPlugin for SlurmPlugin {
    fn kind(&self) -> &str {
        PROVIDER_KIND
    }

    fn attach(&self, sink: ObservationSink) {
        *lock(&self.shared.sink) = Some(sink);
    }

    /// Pushes the membership to every agent of the swarm.
    fn membership_changed(&self, membership: &Arc<provisioning::Membership>) {
        self.swarm.publish_peers(membership);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        let name = name_of(key)?;
        let shape = GroupShape::from_labels(&spec.template().shape.labels)
            .map_err(PluginError::definite)?;
        let existing = match self.live_job(&name).await {
            Ok(existing) => existing,
            Err(error) if lock(&self.shared.sent).contains(key) => {
                return Err(PluginError::ambiguous(format!(
                    "a job of {key} was submitted and cannot be looked for now: {error}"
                )));
            }
            Err(error) => return Err(error),
        };
        if let Some(job) = existing {
            self.shared.watch(key, job.id);
            return Ok(NodeLease {
                lease: lease_of(job.id),
                endpoint: None,
                adopted: true,
            });
        }
        let mut args = vec![
            "--parsable".into(),
            format!("--job-name={name}"),
            "--nodes=1".into(),
            "--ntasks=1".into(),
            "--no-requeue".into(),
            "--chdir=/tmp".into(),
            "--output=/dev/null".into(),
            "--error=/dev/null".into(),
        ];
        args.extend(shape.sbatch_options());
        args.push(format!("--wrap={HOLD_COMMAND}"));
        lock(&self.shared.sent).insert(key.clone());
        let what = format!("submitting the job of {key}");
        let output = match self.shared.run(Tool::Sbatch, args).await {
            Ok(output) => output,
            Err(failure) => {
                let error = acting_failure(&what, failure);
                if matches!(error, PluginError::Definite(_)) {
                    lock(&self.shared.sent).remove(key);
                }
                return Err(error);
            }
        };
        if !output.success {
            let error = acting_refused(&what, &output);
            if matches!(error, PluginError::Definite(_)) {
                lock(&self.shared.sent).remove(key);
            }
            return Err(error);
        }
        let job = parse::parse_submitted(&output.stdout)
            .map_err(|e| PluginError::ambiguous(format!("{what}: {e}")))?;
        if let Some(reason) = self.hopeless(&name, job).await {
            // Slurm took the job but no node can ever run it: take it back,
            // so that the failure is definite and leaves nothing.
            self.shared
                .cancel(
                    vec![job.to_string()],
                    &format!("withdrawing the job of {key}"),
                )
                .await?;
            self.wait_gone(&format!("the withdrawn job of {key}"), || async {
                let rows = self.shared.jobs_named(&name).await?;
                Ok(!rows.iter().any(JobRow::is_present))
            })
            .await?;
            lock(&self.shared.sent).remove(key);
            return Err(PluginError::definite(format!(
                "no node can satisfy the request of {key}: Slurm left job {job} pending for reason {reason} (the group's slurm table asks for more than the partition offers)"
            )));
        }
        self.shared.watch(key, job);
        tracing::info!(node = %key, job, "submitted the node's job");
        Ok(NodeLease {
            lease: lease_of(job),
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
        let listed = self
            .shared
            .recent_jobs()
            .await?
            .iter()
            .filter(|r| r.name == name && r.is_live())
            .min_by_key(|r| r.id)
            .cloned();
        // A listing older than the job does not show it: only a fresh look
        // may say it is gone.
        let job = match listed {
            Some(job) => Some(job),
            None => self.live_job(&name).await?,
        };
        match job {
            Some(job) if job.state == "RUNNING" && !job.nodes.is_empty() => {
                self.shared.watch(key, job.id);
                Ok(EndpointLookup::Ready(Endpoint(format!(
                    "slurm://{}/{}",
                    job.nodes, job.id
                ))))
            }
            Some(_) => Ok(EndpointLookup::NotReady),
            None => {
                lock(&self.shared.known).remove(key);
                Err(PluginError::not_found(format!("no live Slurm job {name}")))
            }
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
                // A quiet session is re-attached by this adopting start: what
                // its agent did meanwhile is reported now.
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
        let Some(job) = self.live_job(&name).await? else {
            return Err(PluginError::not_found(format!("no live Slurm job {name}")));
        };
        if job.state != "RUNNING" {
            return Err(PluginError::definite(format!(
                "the job of {key} is {}, not running",
                job.state
            )));
        }
        self.shared.watch(key, job.id);
        let steps = self.shared.steps(job.id).await?;
        if steps.iter().any(|s| s.name == AGENT_STEP) {
            // An agent step from an earlier controller: take it back.
            let serial = {
                let mut serial = lock(&self.shared.serial);
                *serial += 1;
                *serial
            };
            // Its agent may have re-joined already; then the join is
            // reported now, else when it re-joins.
            let joined = lock(&self.shared.rejoined).remove(key);
            lock(&self.shared.sessions).insert(
                key.clone(),
                Session {
                    serial,
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
        self.launch(key, job.id, request).await?;
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
        match self.live_job(&name).await? {
            Some(_) => {
                if let Some(s) = lock(&self.shared.sessions).get_mut(key) {
                    s.settled = true;
                }
                self.shared.report(key, BootstrapEvent::Closed);
                Ok(())
            }
            None => Err(PluginError::not_found(format!("no live Slurm job {name}"))),
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
        let rows = self.shared.jobs_named(&name).await?;
        for job in rows.iter().filter(|r| r.is_present()) {
            let steps: Vec<String> = self
                .shared
                .steps(job.id)
                .await?
                .iter()
                .filter(|s| s.name == AGENT_STEP)
                .map(StepRow::id)
                .collect();
            if steps.is_empty() {
                continue;
            }
            self.shared
                .cancel(steps, &format!("cancelling the agent step of {key}"))
                .await?;
            let id = job.id;
            self.wait_gone(&format!("the agent step of {key}"), || async move {
                let steps = self.shared.steps(id).await?;
                Ok(!steps.iter().any(|s| s.name == AGENT_STEP))
            })
            .await?;
        }
        Ok(())
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
        lock(&self.shared.sessions).remove(key);
        self.swarm.forget(key);
        let result = async {
            let present: Vec<String> = self
                .shared
                .jobs_named(&name)
                .await?
                .iter()
                .filter(|r| r.is_present())
                .map(|r| r.id.to_string())
                .collect();
            if present.is_empty() {
                return Ok(());
            }
            self.shared
                .cancel(present, &format!("cancelling the job of {key}"))
                .await?;
            self.wait_gone(&format!("the job of {key}"), || async {
                let rows = self.shared.jobs_named(&name).await?;
                Ok(!rows.iter().any(JobRow::is_present))
            })
            .await
        }
        .await;
        match &result {
            Ok(()) => {
                lock(&self.shared.sent).remove(key);
                // A listing taken before the job was gone would still show
                // it to the next endpoint lookup. The listing's lock is held
                // while a listing is taken, so one taken after this is fresh.
                *self.shared.listing.lock().await = None;
            }
            Err(PluginError::Definite(_)) => {
                if let Some(job) = watched {
                    self.shared.watch(key, job);
                }
            }
            Err(_) => {}
        }
        result
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        if !parse::is_safe_name(run.as_str()) {
            return Ok(Vec::new());
        }
        let prefix = run_prefix(run);
        let rows = self.shared.all_jobs().await?;
        let listed: Vec<(u64, bool, AttemptKey)> = rows
            .iter()
            .filter(|r| r.is_live() && r.name.starts_with(&prefix))
            .filter_map(|r| Some((r.id, r.state == "RUNNING", parse_job_name(run, &r.name)?)))
            .collect();
        self.adopt_agent_steps(run, &listed).await?;
        let mut nodes: Vec<ListedNode> = listed
            .into_iter()
            .map(|(id, _, key)| ListedNode {
                key,
                lease: lease_of(id),
            })
            .collect();
        nodes.sort();
        Ok(nodes)
    }
}
