//! [`SlurmPlugin`]: nodes that are one-node Slurm job allocations.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use provisioning::effect::SessionHandle;
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{Endpoint, EndpointLookup, LeaseHandle, LogicalNodeSpec, RunId};
use provisioning_agent::codec::{LINE_BYTES_MAX, LossyLine, LossyLinesCodec};
use provisioning_agent::remote::{RemoteError, RemoteEvent, RemoteSwarm, RemoteSwarmConfig};
use provisioning_agent::wire::{
    BootOrder, ControlReply, FailureStage, JoinOrder, PROTOCOL_VERSION, ProgressStage,
};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::codec::FramedRead;

use crate::cli::{CommandFailure, CommandOutput, SlurmCli, SystemCli, Tool};
use crate::config::{GroupShape, SlurmPluginConfig};
use crate::parse::{
    self, AGENT_STEP, Failure, JobRow, SQUEUE_FORMAT, STEPS_FORMAT, StepRow, job_name,
    parse_job_name, run_prefix,
};

/// The provider kind this plugin serves.
pub const PROVIDER_KIND: &str = "slurm";

/// The holding job's command: it only keeps the allocation.
const HOLD_COMMAND: &str = "exec sleep infinity";

/// The pause between two looks while waiting for a job or step to go.
const GONE_POLL: Duration = Duration::from_millis(50);

/// How old a job listing an endpoint lookup uses may be: the host probes
/// endpoints often, and one `squeue` then answers for every pending node.
const LISTING_MAX_AGE: Duration = Duration::from_millis(100);

/// How long a create watches its new job for a reason that says it can
/// never run (the scheduler looks at a new job within about a second).
const HOPELESS_CHECK_WAIT: Duration = Duration::from_secs(3);

/// How much of a step's error output is kept for failure messages.
const STEP_STDERR_BYTES_MAX: u64 = 8 * 1024;

/// How long an adopted agent step may take to re-join the swarm (on top
/// of the re-join grace) before its node counts as lost.
const ADOPTED_JOIN_WAIT: Duration = Duration::from_secs(30);

/// The job step's shell: the boot order arrives on standard input and goes
/// into a `0600` file the agent removes once it has read it, so the
/// credential is never on a command line. Stages go to standard output,
/// which `srun` relays to the plugin.
const STEP_SCRIPT: &str = "umask 077
f=$(mktemp \"${TMPDIR:-/tmp}/provision-boot.XXXXXX\") || exit 2
cat >\"$f\" || { rm -f \"$f\"; exit 2; }
PROVISION_AGENT_BOOT_FILE=$f PROVISION_AGENT_STATUS_FILE=/dev/stdout exec \"$@\"";

/// Starting the plugin failed.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// The swarm listener could not bind.
    #[error(transparent)]
    Swarm(#[from] RemoteError),
    /// The configuration names no agent command.
    #[error("the slurm provider needs an agent command")]
    NoAgent,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A bootstrap session this instance started or adopted.
#[derive(Debug)]
struct Session {
    /// Bumped per start; a follower of an older start is void.
    serial: u64,
    /// The highest progress stage reported (see [`stage_rank`]).
    rank: u8,
    /// Whether the agent joined (or the session ended otherwise).
    settled: bool,
    /// Whether the agent's join was seen by this instance's swarm listener.
    joined: bool,
    /// Held for a controller that replaced the one this session reported
    /// to ([`SlurmPlugin::controller_replaced`]): nothing of its progress or
    /// join is reported until that controller's adopting start.
    quiet: bool,
}

fn stage_rank(stage: BootstrapProgress) -> u8 {
    match stage {
        BootstrapProgress::Created => 1,
        BootstrapProgress::Connecting => 2,
        BootstrapProgress::Connected => 3,
        BootstrapProgress::Streaming => 4,
        BootstrapProgress::BootChecking => 5,
        BootstrapProgress::AgentStarting => 6,
        BootstrapProgress::WaitingForJoin => 7,
    }
}

/// What the plugin and its background tasks share.
struct Shared {
    config: SlurmPluginConfig,
    cli: Arc<dyn SlurmCli>,
    sink: Mutex<Option<ObservationSink>>,
    /// Live jobs this instance created or adopted, by key: watched for jobs
    /// that end by themselves.
    known: Mutex<BTreeMap<AttemptKey, u64>>,
    /// Keys a submission was sent for: a job of theirs may exist.
    sent: Mutex<BTreeSet<AttemptKey>>,
    sessions: Mutex<BTreeMap<AttemptKey, Session>>,
    /// Agents of an earlier controller that re-joined this instance's swarm
    /// before a start adopted their step: the adopting start reports the
    /// join.
    rejoined: Mutex<BTreeSet<AttemptKey>>,
    serial: Mutex<u64>,
    /// The last job listing and when it was taken: endpoint lookups of many
    /// nodes share one `squeue` per [`LISTING_MAX_AGE`].
    listing: tokio::sync::Mutex<Option<(tokio::time::Instant, Arc<Vec<JobRow>>)>>,
}

impl Shared {
    fn report(&self, key: &AttemptKey, event: BootstrapEvent) {
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.bootstrap(key, event);
        }
    }

    fn lost(&self, key: &AttemptKey, cause: LossCause) {
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.lost(key, cause);
        }
    }

    /// Reports `stage` for the session `serial` of `key` if it moves on.
    fn progress(&self, key: &AttemptKey, serial: u64, stage: BootstrapProgress) {
        let report = {
            let mut sessions = lock(&self.sessions);
            match sessions.get_mut(key) {
                Some(s)
                    if s.serial == serial
                        && !s.settled
                        && !s.quiet
                        && stage_rank(stage) > s.rank =>
                {
                    s.rank = stage_rank(stage);
                    true
                }
                _ => false,
            }
        };
        if report {
            self.report(key, BootstrapEvent::Progress(stage));
        }
    }

    /// Reports a failure of session `serial` unless it settled already.
    fn fail(&self, key: &AttemptKey, serial: u64, failure: BootstrapFailure, detail: String) {
        let report = {
            let mut sessions = lock(&self.sessions);
            match sessions.get_mut(key) {
                Some(s) if s.serial == serial && !s.settled => {
                    s.settled = true;
                    true
                }
                _ => false,
            }
        };
        if report {
            tracing::warn!(node = %key, ?failure, %detail, "bootstrap failed");
            self.report(key, BootstrapEvent::Failed { failure, detail });
        }
    }

    /// The agent of `key` joined this instance's swarm (`again`: an agent
    /// that had joined before, of this controller or an earlier one). Its
    /// join is reported once per session, and not while the session is
    /// quiet; a re-join before any start adopted the step waits for it.
    fn joined(&self, key: &AttemptKey, again: bool) {
        let report = {
            let mut sessions = lock(&self.sessions);
            match sessions.get_mut(key) {
                Some(s) if s.joined => None,
                Some(s) => {
                    s.joined = true;
                    s.settled = true;
                    if s.quiet {
                        None
                    } else {
                        let missing = s.rank < stage_rank(BootstrapProgress::WaitingForJoin);
                        s.rank = stage_rank(BootstrapProgress::WaitingForJoin);
                        Some(missing)
                    }
                }
                None => {
                    if again {
                        lock(&self.rejoined).insert(key.clone());
                    }
                    None
                }
            }
        };
        if let Some(waiting_missing) = report {
            // The stage lines and the join travel different roads; the
            // driver hears them in order.
            if waiting_missing {
                self.report(
                    key,
                    BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin),
                );
            }
            self.report(key, BootstrapEvent::Joined);
        }
    }

    fn on_swarm(&self, event: RemoteEvent) {
        match event {
            RemoteEvent::Joined(key) => self.joined(&key, false),
            RemoteEvent::Rejoined(key) => {
                tracing::info!(node = %key, "agent re-joined the swarm");
                // Re-earns the readiness of a node recovered as ready;
                // changes nothing for any other node.
                if let Some(sink) = lock(&self.sink).as_ref() {
                    sink.rejoined(&key);
                }
                self.joined(&key, true);
            }
            RemoteEvent::Lost(key, cause) => {
                lock(&self.sessions).remove(&key);
                lock(&self.rejoined).remove(&key);
                self.lost(&key, cause);
            }
        }
    }

    async fn run(&self, tool: Tool, args: Vec<String>) -> Result<CommandOutput, CommandFailure> {
        self.cli.run(tool, &args).await
    }

    /// Every job of this user that `squeue` shows (all states).
    async fn all_jobs(&self) -> Result<Vec<JobRow>, PluginError> {
        let args = vec![
            "--noheader".into(),
            "--me".into(),
            "--states=all".into(),
            format!("--format={SQUEUE_FORMAT}"),
        ];
        self.query_jobs(args).await
    }

    /// A job listing at most [`LISTING_MAX_AGE`] old (single flight).
    async fn recent_jobs(&self) -> Result<Arc<Vec<JobRow>>, PluginError> {
        let mut listing = self.listing.lock().await;
        if let Some((at, rows)) = listing.as_ref()
            && at.elapsed() < LISTING_MAX_AGE
        {
            return Ok(rows.clone());
        }
        let rows = Arc::new(self.all_jobs().await?);
        *listing = Some((tokio::time::Instant::now(), rows.clone()));
        Ok(rows)
    }

    /// The jobs named `name` (all states).
    async fn jobs_named(&self, name: &str) -> Result<Vec<JobRow>, PluginError> {
        let args = vec![
            "--noheader".into(),
            "--me".into(),
            "--states=all".into(),
            format!("--name={name}"),
            format!("--format={SQUEUE_FORMAT}"),
        ];
        let rows = self.query_jobs(args).await?;
        // `--name` matches exactly already; keep the check local too.
        Ok(rows.into_iter().filter(|r| r.name == name).collect())
    }

    async fn query_jobs(&self, args: Vec<String>) -> Result<Vec<JobRow>, PluginError> {
        let output = self.run(Tool::Squeue, args).await.map_err(query_failure)?;
        if !output.success {
            return Err(query_refused(&output));
        }
        parse::parse_squeue(&output.stdout).map_err(|e| PluginError::ambiguous(e.to_string()))
    }

    /// The steps of every job of this user.
    async fn all_steps(&self) -> Result<Vec<StepRow>, PluginError> {
        let args = vec![
            "--steps".into(),
            "--noheader".into(),
            "--me".into(),
            format!("--format={STEPS_FORMAT}"),
        ];
        let output = self.run(Tool::Squeue, args).await.map_err(query_failure)?;
        if !output.success {
            return Err(query_refused(&output));
        }
        parse::parse_steps(&output.stdout).map_err(|e| PluginError::ambiguous(e.to_string()))
    }

    /// The steps of job `job`.
    async fn steps(&self, job: u64) -> Result<Vec<StepRow>, PluginError> {
        let args = vec![
            "--steps".into(),
            "--noheader".into(),
            format!("--jobs={job}"),
            format!("--format={STEPS_FORMAT}"),
        ];
        let output = self.run(Tool::Squeue, args).await.map_err(query_failure)?;
        if !output.success {
            // A job that ended meanwhile has no steps.
            if output.stderr.contains("Invalid job id") {
                return Ok(Vec::new());
            }
            return Err(query_refused(&output));
        }
        let rows = parse::parse_steps(&output.stdout)
            .map_err(|e| PluginError::ambiguous(e.to_string()))?;
        Ok(rows.into_iter().filter(|s| s.job == job).collect())
    }

    /// `scancel TARGETS`; `what` names the action in errors.
    async fn cancel(&self, targets: Vec<String>, what: &str) -> Result<(), PluginError> {
        match self.run(Tool::Scancel, targets).await {
            Ok(output) if output.success => Ok(()),
            Ok(output) => Err(acting_refused(what, &output)),
            Err(failure) => Err(acting_failure(what, failure)),
        }
    }

    fn watch(&self, key: &AttemptKey, job: u64) {
        if key.run_id == self.config.run_id {
            lock(&self.known).insert(key.clone(), job);
        }
    }

    /// One look for watched jobs that ended by themselves.
    async fn check_losses(&self, swarm: &RemoteSwarm) -> Result<usize, PluginError> {
        let watched = lock(&self.known).clone();
        if watched.is_empty() {
            return Ok(0);
        }
        let rows = self.all_jobs().await?;
        let mut lost = 0;
        for (key, job) in watched {
            let row = rows.iter().find(|r| r.id == job);
            if row.is_some_and(JobRow::is_live) {
                continue;
            }
            // Still watched: not destroyed through this plugin meanwhile.
            if lock(&self.known).remove(&key).is_some() {
                let state = row.map_or("gone", |r| r.state.as_str());
                let reason = row.map_or("", |r| r.reason.as_str());
                tracing::warn!(node = %key, job, state, reason, "the node's job ended by itself: node lost");
                swarm.forget(&key);
                lock(&self.sessions).remove(&key);
                self.lost(&key, LossCause::LeaseGone);
                lost += 1;
            }
        }
        Ok(lost)
    }
}

/// A read-only command that did not finish.
fn query_failure(failure: CommandFailure) -> PluginError {
    match failure {
        CommandFailure::NotStarted(m) => PluginError::definite(m),
        CommandFailure::TimedOut { .. } => PluginError::ambiguous(failure.to_string()),
    }
}

/// A read-only command that failed: it changed nothing either way.
fn query_refused(output: &CommandOutput) -> PluginError {
    let message = format!("squeue failed: {}", output.stderr.trim());
    match parse::classify(&output.stderr) {
        Failure::Unreachable | Failure::Refused => PluginError::definite(message),
        Failure::Unknown => PluginError::ambiguous(message),
    }
}

/// A command that asks the controller to act and did not finish.
fn acting_failure(what: &str, failure: CommandFailure) -> PluginError {
    match failure {
        CommandFailure::NotStarted(m) => PluginError::definite(format!("{what}: {m}")),
        CommandFailure::TimedOut { .. } => PluginError::ambiguous(format!("{what}: {failure}")),
    }
}

/// A command that asks the controller to act and failed: definite when the
/// controller was never reached or refused, else ambiguous.
fn acting_refused(what: &str, output: &CommandOutput) -> PluginError {
    let message = format!("{what}: {}", output.stderr.trim());
    match parse::classify(&output.stderr) {
        Failure::Unreachable => PluginError::definite(format!(
            "{message} (the controller was not reached; nothing was done)"
        )),
        Failure::Refused => PluginError::definite(message),
        Failure::Unknown => PluginError::ambiguous(message),
    }
}

fn lease_of(job: u64) -> LeaseHandle {
    LeaseHandle(format!("slurm:{job}"))
}

fn session_of(name: &str) -> SessionHandle {
    SessionHandle(format!("slurm-step:{name}/{AGENT_STEP}"))
}

fn name_of(key: &AttemptKey) -> Result<String, PluginError> {
    job_name(key).ok_or_else(|| {
        PluginError::definite(format!(
            "{key} cannot name a Slurm job: run and group names must use letters, digits, '.', '_' and '-'"
        ))
    })
}

/// A [`ProvisionPlugin`] whose nodes are one-node Slurm jobs.
///
/// # How it works
/// - A node is a batch job named `prov+{run}+{node}+a{attempt}` that holds
///   a one-node allocation (`sleep infinity`, `--no-requeue`) with the
///   group's `slurm` table as `sbatch` options. `create_node` first looks
///   for a live job of that name (adopting it), then submits. The lease is
///   `slurm:{job id}`.
/// - The endpoint is the allocated node once the job runs; pending is not
///   ready. A job that is gone or ending is not found.
/// - Bootstrap runs the node agent as a job step (`srun --jobid=J
///   --overlap`, step name `provision-agent`) in the agent's remote boot
///   mode; its boot order, with the credential, goes on the step's standard
///   input into a `0600` file. The agent joins the plugin's
///   [`RemoteSwarm`] over TCP; its stages come back on the step's output.
/// - Cancel and destroy `scancel` the step or the job and wait until
///   `squeue` no longer shows it; absent is success.
/// - A watched job that ends by itself (time limit, preemption, node
///   failure, cancelled by someone) is reported lost
///   ([`LossCause::LeaseGone`]) by a background look every
///   `watch_interval`; a dropped agent connection is lost through the swarm.
///
/// # Errors
/// A command that never reached the controller (connect failure) or that
/// the controller refused is definite; one whose outcome is unknown (a
/// time-out, a connection that broke off, an unknown error) is ambiguous.
pub struct SlurmPlugin {
    shared: Arc<Shared>,
    swarm: Arc<RemoteSwarm>,
    watch: tokio::task::AbortHandle,
}

impl fmt::Debug for SlurmPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlurmPlugin")
            .field("run_id", &self.shared.config.run_id)
            .field("slurm_conf", &self.shared.config.slurm_conf)
            .field("swarm", &self.swarm.advertised())
            .finish_non_exhaustive()
    }
}

impl Drop for SlurmPlugin {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

impl SlurmPlugin {
    /// Binds the swarm listener and starts the loss watch on the current
    /// tokio runtime, with the system's Slurm tools.
    ///
    /// # Errors
    /// When the listener cannot bind or no agent command is configured.
    pub async fn start(config: SlurmPluginConfig) -> Result<Self, SlurmError> {
        let cli = SystemCli::new(config.slurm_conf.clone(), config.command_timeout);
        Self::start_with_cli(config, Arc::new(cli)).await
    }

    /// [`SlurmPlugin::start`] over another [`SlurmCli`] (recorded outputs,
    /// fault injection).
    ///
    /// # Errors
    /// As [`SlurmPlugin::start`].
    pub async fn start_with_cli(
        config: SlurmPluginConfig,
        cli: Arc<dyn SlurmCli>,
    ) -> Result<Self, SlurmError> {
        if config.agent.is_empty() {
            return Err(SlurmError::NoAgent);
        }
        let swarm_config = RemoteSwarmConfig {
            run_id: config.run_id.clone(),
            secret: config.secret.clone(),
            listen: config.listen,
            advertised: config.advertise,
            rejoin_grace: config.rejoin_grace,
        };
        let interval = config.watch_interval;
        let shared = Arc::new(Shared {
            config,
            cli,
            sink: Mutex::new(None),
            known: Mutex::new(BTreeMap::new()),
            sent: Mutex::new(BTreeSet::new()),
            sessions: Mutex::new(BTreeMap::new()),
            rejoined: Mutex::new(BTreeSet::new()),
            serial: Mutex::new(0),
            listing: tokio::sync::Mutex::new(None),
        });
        let events = Arc::downgrade(&shared);
        let swarm = Arc::new(
            RemoteSwarm::bind(swarm_config, move |event| {
                if let Some(shared) = events.upgrade() {
                    shared.on_swarm(event);
                }
            })
            .await?,
        );
        let watch = tokio::spawn(watch_loop(
            Arc::downgrade(&shared),
            Arc::downgrade(&swarm),
            interval,
        ))
        .abort_handle();
        Ok(SlurmPlugin {
            shared,
            swarm,
            watch,
        })
    }

    /// The controller this plugin reports to was replaced in-process by one
    /// recovered from its journal, while the plugin, the jobs and their
    /// agent steps live on. Every session goes quiet, as if a restarted
    /// plugin had found its step: nothing of its progress or join is
    /// reported until the new controller's adopting `start_bootstrap`, which
    /// reports the join if the agent joined meanwhile. Returns how many
    /// sessions went quiet.
    pub fn controller_replaced(&self) -> usize {
        let mut sessions = lock(&self.shared.sessions);
        for session in sessions.values_mut() {
            session.quiet = true;
        }
        sessions.len()
    }

    /// The address agents dial.
    pub fn swarm_address(&self) -> std::net::SocketAddr {
        self.swarm.advertised()
    }

    /// The address the swarm listener is bound to (its port picked when
    /// the configuration asked for port 0).
    pub fn listen_address(&self) -> std::net::SocketAddr {
        self.swarm.local_addr()
    }

    /// Looks once for watched jobs that ended by themselves and reports each
    /// lost; returns how many. (The background watch does this every
    /// `watch_interval`.)
    ///
    /// # Errors
    /// When `squeue` cannot be asked; nothing is reported then.
    pub async fn check_losses(&self) -> Result<usize, PluginError> {
        self.shared.check_losses(&self.swarm).await
    }

    fn boot_order(&self, key: &AttemptKey, request: &BootstrapRequest) -> BootOrder {
        let template = request.spec.template();
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
            group_size: self.swarm.group_size(key.node.group()),
            address: Some(provisioning_agent::wire::address_of_endpoint(
                &request.endpoint.0,
            )),
            on_peers_change: boot.on_peers_change.clone(),
            resume_only: false,
        }
    }

    /// Listed running jobs of this run whose agent step is running, from an
    /// earlier controller: unless expected already, each agent is expected
    /// to re-join (adopted, workload untouched) and its job watched; one
    /// that does not re-join within the grace and the adopt wait is a lost
    /// node. A restarted controller lists before its first pass, so nodes
    /// that were ready keep their agents.
    async fn adopt_agent_steps(
        &self,
        run: &RunId,
        listed: &[(u64, bool, AttemptKey)],
    ) -> Result<(), PluginError> {
        if run != &self.shared.config.run_id || !listed.iter().any(|(_, running, _)| *running) {
            return Ok(());
        }
        let expected: BTreeSet<AttemptKey> = self.swarm.expected().into_iter().collect();
        let waiting: Vec<&(u64, bool, AttemptKey)> = listed
            .iter()
            .filter(|(_, running, key)| *running && !expected.contains(key))
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        let steps = self.shared.all_steps().await?;
        for (job, _, key) in waiting {
            if steps.iter().any(|s| s.job == *job && s.name == AGENT_STEP) {
                tracing::info!(node = %key, job, "expecting the agent step of a listed job to re-join");
                self.shared.watch(key, *job);
                self.swarm.expect_adopted(key, ADOPTED_JOIN_WAIT);
            }
        }
        Ok(())
    }

    /// Starts the agent step of `key` in job `job`.
    async fn launch(
        &self,
        key: &AttemptKey,
        job: u64,
        request: &BootstrapRequest,
    ) -> Result<(), PluginError> {
        let order = serde_json::to_vec(&self.boot_order(key, request))
            .map_err(|e| PluginError::definite(format!("cannot encode the boot order: {e}")))?;
        tracing::info!(node = %key, job, "starting the agent step");
        let mut args = vec![
            format!("--jobid={job}"),
            "--overlap".into(),
            "--nodes=1".into(),
            "--ntasks=1".into(),
            format!("--job-name={AGENT_STEP}"),
            "--quiet".into(),
            "sh".into(),
            "-c".into(),
            STEP_SCRIPT.into(),
            "sh".into(),
        ];
        args.extend(self.shared.config.agent.iter().cloned());
        let serial = {
            let mut serial = lock(&self.shared.serial);
            *serial += 1;
            *serial
        };
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
        let mut command = self.shared.cli.step_command(&args);
        // A process group of its own: a Ctrl-C meant for the controller
        // does not cancel the step; the step outlives srun in any case.
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(error) => {
                lock(&self.shared.sessions).remove(key);
                self.swarm.forget(key);
                return Err(PluginError::definite(format!("cannot run srun: {error}")));
            }
        };
        let written = match child.stdin.take() {
            Some(mut stdin) => {
                let result = stdin.write_all(&order).await;
                drop(stdin);
                result.map_err(|e| e.to_string())
            }
            None => Err("no standard input".to_owned()),
        };
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        tokio::spawn(follow(
            Arc::downgrade(&self.shared),
            key.clone(),
            serial,
            child,
            stdout,
            stderr,
        ));
        if let Err(error) = written {
            // srun may have started the step before it went away.
            return Err(PluginError::ambiguous(format!(
                "handing the boot order to the agent step of {key} failed: {error}"
            )));
        }
        self.shared
            .progress(key, serial, BootstrapProgress::Connected);
        Ok(())
    }

    /// Watches a just submitted job until the scheduler has looked at it
    /// (bounded by [`HOPELESS_CHECK_WAIT`]); returns its reason when that
    /// says it can never run.
    async fn hopeless(&self, name: &str, job: u64) -> Option<String> {
        let deadline = tokio::time::Instant::now() + HOPELESS_CHECK_WAIT;
        // Bounded by the deadline.
        while tokio::time::Instant::now() < deadline {
            let rows = self.shared.jobs_named(name).await.ok()?;
            let row = rows.into_iter().find(|r| r.id == job)?;
            if row.state != "PENDING" {
                return None;
            }
            if parse::is_hopeless_reason(&row.reason) {
                return Some(row.reason);
            }
            if row.reason != "None" {
                return None;
            }
            tokio::time::sleep(GONE_POLL).await;
        }
        None
    }

    /// The live job of `key`, if any.
    async fn live_job(&self, name: &str) -> Result<Option<JobRow>, PluginError> {
        let rows = self.shared.jobs_named(name).await?;
        Ok(rows
            .into_iter()
            .filter(JobRow::is_live)
            .min_by_key(|r| r.id))
    }

    /// Waits until `gone` holds (bounded by `gone_wait`); `what` names it.
    async fn wait_gone<F, Fut>(&self, what: &str, mut gone: F) -> Result<(), PluginError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, PluginError>>,
    {
        let deadline = tokio::time::Instant::now() + self.shared.config.gone_wait;
        // Bounded by the deadline.
        loop {
            match gone().await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(error) => tracing::debug!(%error, "cannot confirm yet that {what} is gone"),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(PluginError::ambiguous(format!(
                    "{what} was cancelled but is still there after {:?}",
                    self.shared.config.gone_wait
                )));
            }
            tokio::time::sleep(GONE_POLL).await;
        }
    }
}

async fn watch_loop(shared: Weak<Shared>, swarm: Weak<RemoteSwarm>, interval: Duration) {
    // Bounded by the plugin's life: it ends when the plugin is dropped.
    loop {
        tokio::time::sleep(interval).await;
        let (Some(shared), Some(swarm)) = (shared.upgrade(), swarm.upgrade()) else {
            return;
        };
        if let Err(error) = shared.check_losses(&swarm).await {
            tracing::debug!(%error, "loss check incomplete");
        }
    }
}

/// Follows one agent step: relays its stages, and reports a failure when
/// the step ends before its agent joined.
async fn follow(
    shared: Weak<Shared>,
    key: AttemptKey,
    serial: u64,
    mut child: tokio::process::Child,
    stdout: Option<tokio::process::ChildStdout>,
    stderr: Option<tokio::process::ChildStderr>,
) {
    let errors = tokio::spawn(async move {
        let mut tail = Vec::new();
        if let Some(stderr) = stderr {
            let _ = stderr
                .take(STEP_STDERR_BYTES_MAX)
                .read_to_end(&mut tail)
                .await;
        }
        String::from_utf8_lossy(&tail).trim().to_owned()
    });
    if let Some(stdout) = stdout {
        // The agent writes one `ControlReply` a line. A line that is not
        // one (too long, not JSON, not a reply) is logged and skipped, so
        // lines are read with the lossy codec rather than `MessageReader`,
        // which would stop at the first.
        let mut lines = FramedRead::new(stdout, LossyLinesCodec::new(LINE_BYTES_MAX));
        // Bounded by the step's output: it ends with the step.
        while let Some(Ok(line)) = lines.next().await {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let line = match line {
                LossyLine::Text(text) => String::from_utf8_lossy(&text).into_owned(),
                LossyLine::TooLong(length) => {
                    tracing::debug!(node = %key, "agent step output: a line of {length} bytes, not shown");
                    continue;
                }
            };
            match serde_json::from_str::<ControlReply>(line.trim()) {
                Ok(ControlReply::Progress { stage }) => {
                    let stage = match stage {
                        ProgressStage::BootChecking => BootstrapProgress::BootChecking,
                        ProgressStage::AgentStarting => BootstrapProgress::AgentStarting,
                        ProgressStage::WaitingForJoin => BootstrapProgress::WaitingForJoin,
                    };
                    shared.progress(&key, serial, stage);
                }
                Ok(ControlReply::Failed { stage, detail }) => {
                    let failure = match stage {
                        FailureStage::BootCheck => BootstrapFailure::BootCheckFailed,
                        FailureStage::Start => BootstrapFailure::StartFailed,
                        FailureStage::Join => BootstrapFailure::JoinFailed,
                    };
                    shared.fail(&key, serial, failure, detail);
                }
                Ok(_) => {}
                Err(_) => tracing::debug!(node = %key, line, "agent step output"),
            }
        }
    }
    let status = child.wait().await;
    let tail = errors.await.unwrap_or_default();
    let Some(shared) = shared.upgrade() else {
        return;
    };
    let detail = match status {
        Ok(status) => format!("the agent step ended ({status}) before the agent joined: {tail}"),
        Err(error) => format!("cannot wait for srun: {error}"),
    };
    shared.fail(&key, serial, BootstrapFailure::StartFailed, detail);
}

mod seam;
