//! The agent's side of a bootstrap session: one control connection, one boot.

use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nix::unistd::{User, getpid, getuid};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use super::{Agent, Phase, env, rendezvous};
use crate::codec::{CodecError, JsonLinesCodec, MessageReader, write_message};
use crate::credential::NodeCredential;
use crate::os;
use crate::wire::{
    BootOrder, ControlReply, ControlRequest, FailureStage, JoinOrder, PEERS_LINE_BYTES_MAX,
    PROTOCOL_VERSION, ProgressStage, SwarmHello, SwarmNotice, SwarmPush, SwarmReply,
};

/// How long a new control connection may take to send its boot order.
const BOOT_ORDER_WAIT_MAX: Duration = Duration::from_secs(10);

/// The longest a single verify command may run.
const VERIFY_COMMAND_TIMEOUT: Duration = Duration::from_secs(10 * 60);

/// How long the agent waits for the controller's go-ahead to join.
const JOIN_GO_AHEAD_WAIT_MAX: Duration = Duration::from_secs(60);

/// How many times the agent tries to connect to the swarm listener.
const JOIN_CONNECT_ATTEMPTS_MAX: u32 = 5;

/// The pause between two connection attempts.
const JOIN_RETRY_PAUSE: Duration = Duration::from_millis(200);

/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the swarm may take to answer the hello.
const WELCOME_WAIT_MAX: Duration = Duration::from_secs(10);

/// How long the control connection stays open after the join, waiting for
/// the controller to close the session.
const CLOSE_WAIT_MAX: Duration = Duration::from_secs(60 * 60);

/// How many controller requests may wait for the boot task.
const REQUEST_QUEUE_MAX: usize = 8;

/// How many unexpected requests are ignored before the connection counts as
/// broken.
const UNEXPECTED_REQUESTS_MAX: usize = 16;

/// How long the agent watches a freshly started workload before it says it
/// is ready to join. A workload that exits within it (a typo in its start
/// command, `exit 3`) fails the boot at its start, with its exit status,
/// instead of joining and being reported lost a moment later: a node whose
/// workload never ran is never shown ready.
const WORKLOAD_START_CHECK: Duration = Duration::from_millis(100);

/// How many workload notices may wait for the swarm connection.
const NOTICE_QUEUE_MAX: usize = 8;

/// How much of a failed verify command's output is reported.
const OUTPUT_TAIL_BYTES: usize = 2048;

/// How long output is still collected after a verify command exited (a
/// background child may hold the pipe open forever).
const OUTPUT_DRAIN_WAIT: Duration = Duration::from_millis(200);

/// Aborts a helper task when its owner ends.
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves one control connection.
pub(super) async fn serve(agent: Arc<Agent>, stream: TcpStream, fatal: mpsc::Sender<String>) {
    let (read, mut write) = stream.into_split();
    let (requests_tx, mut requests) = mpsc::channel(REQUEST_QUEUE_MAX);
    let _reader = AbortOnDrop(tokio::spawn(read_requests(read, requests_tx)).abort_handle());
    let order = match tokio::time::timeout(BOOT_ORDER_WAIT_MAX, requests.recv()).await {
        Ok(Some(Ok(ControlRequest::Boot(order)))) => order,
        Ok(Some(Ok(other))) => {
            return refuse(&mut write, format!("expected a boot order, got {other:?}")).await;
        }
        Ok(Some(Err(error))) => {
            return refuse(&mut write, format!("malformed request: {error}")).await;
        }
        Ok(None) => return,
        Err(_) => {
            return refuse(
                &mut write,
                format!("no boot order within {BOOT_ORDER_WAIT_MAX:?}"),
            )
            .await;
        }
    };
    let user = match check_order(&agent, &order) {
        Ok(user) => user,
        Err(reason) => return refuse(&mut write, reason).await,
    };
    let resume = match claim(&agent, &order) {
        Ok(resume) => resume,
        Err(reason) => return refuse(&mut write, reason).await,
    };
    let _busy = Busy(agent.clone());
    let mut boot = Boot {
        agent,
        order,
        user,
        write,
        requests,
    };
    if resume {
        tracing::info!(swarm = %boot.order.join.address, "resuming: re-joining a restarted controller");
        if boot.send(ControlReply::Resumed).await {
            boot.resume(fatal).await;
        }
    } else {
        tracing::info!("boot order accepted");
        if boot.send(ControlReply::Accepted).await {
            boot.run(fatal).await;
        }
    }
}

/// Marks the agent free for another control connection when dropped.
struct Busy(Arc<Agent>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.boot_state().busy = false;
    }
}

/// Decides whether `order` boots the agent (`false`) or resumes it
/// (`true`), and claims the agent for this connection; `Err` says why the
/// order is refused.
fn claim(agent: &Agent, order: &BootOrder) -> Result<bool, String> {
    let detached = agent.config.detached;
    let mut state = agent.boot_state();
    if state.busy {
        return Err("another control connection is booting this agent".to_owned());
    }
    let resume = match state.phase {
        Phase::Fresh if order.resume_only => {
            return Err("nothing to resume: this agent has not booted".to_owned());
        }
        Phase::Fresh => false,
        Phase::Abandoned if detached && !order.resume_only => false,
        Phase::Started if detached => {
            let first = state
                .first_join
                .as_ref()
                .map(|join| join.credential.as_str());
            if first != Some(order.join.credential.as_str()) {
                return Err("the resume does not carry this agent's credential".to_owned());
            }
            true
        }
        Phase::Abandoned | Phase::Booting if order.resume_only => {
            return Err("nothing to resume: the boot did not start the workload".to_owned());
        }
        _ => return Err("this agent has already booted".to_owned()),
    };
    if !resume {
        state.phase = Phase::Booting;
        state.first_join = Some(order.join.clone());
    }
    state.busy = true;
    Ok(resume)
}

// A refusal or a failure goes to the controller, which logs it as a warning
// itself; the agent's own line stays below the level the controller relays
// as a warning, so that the warning appears once.
async fn refuse(write: &mut OwnedWriteHalf, reason: String) {
    tracing::info!(%reason, "boot order refused");
    let _ = write_message(write, &ControlReply::Refused { reason }).await;
}

/// The uid and gid commands run as, when they differ from the agent's own.
#[derive(Clone, Copy, Debug)]
struct RunAs {
    uid: u32,
    gid: u32,
}

/// Checks an order against the agent's own identity. Returns the user to
/// run commands as, or why the order is refused.
fn check_order(agent: &Agent, order: &BootOrder) -> Result<Option<RunAs>, String> {
    let config = &agent.config;
    if order.protocol != PROTOCOL_VERSION {
        return Err(format!("unsupported protocol version {}", order.protocol));
    }
    if order.run != config.run || order.node != config.node || order.attempt != config.attempt {
        return Err(format!(
            "the order is for {}/{}/a{}, this agent is {}/{}/a{}",
            order.run, order.node, order.attempt, config.run, config.node, config.attempt
        ));
    }
    if !order.join.address.ip().is_loopback() {
        return Err(format!(
            "swarm address {} is not on loopback",
            order.join.address
        ));
    }
    if NodeCredential::from_hex(&order.join.credential).is_none() {
        return Err("the credential is not 32 bytes of hex".to_owned());
    }
    resolve_user(&order.user)
}

fn resolve_user(name: &str) -> Result<Option<RunAs>, String> {
    if name.is_empty() {
        return Ok(None);
    }
    let current = User::from_uid(getuid()).ok().flatten();
    if current.as_ref().is_some_and(|user| user.name == name) {
        return Ok(None);
    }
    match User::from_name(name) {
        Ok(Some(user)) => Ok(Some(RunAs {
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        })),
        Ok(None) => Err(format!("unknown user {name:?}")),
        Err(error) => Err(format!("cannot look up user {name:?}: {error}")),
    }
}

/// Forwards the controller's requests; ends at the end of the stream or at
/// the first error (which it forwards).
async fn read_requests(
    read: OwnedReadHalf,
    requests: mpsc::Sender<Result<ControlRequest, CodecError>>,
) {
    let mut reader = MessageReader::<ControlRequest, _>::new(read);
    // Bounded by the connection: it ends with the stream or the first error.
    loop {
        let (forward, stop) = match reader.next().await {
            Ok(Some(request)) => (Ok(request), false),
            Ok(None) => return,
            Err(error) => (Err(error), true),
        };
        if requests.send(forward).await.is_err() || stop {
            return;
        }
    }
}

struct Boot {
    agent: Arc<Agent>,
    order: Box<BootOrder>,
    user: Option<RunAs>,
    write: OwnedWriteHalf,
    requests: mpsc::Receiver<Result<ControlRequest, CodecError>>,
}

/// The connection ended or misbehaved, or the controller cancelled.
enum Cancelled {
    /// The controller said so ([`ControlRequest::Cancel`]), or misbehaved.
    Explicitly,
    /// The connection ended: a cancel, or the controller's death.
    HungUp,
}

impl Boot {
    /// Sends a reply; returns whether the controller is still there.
    async fn send(&mut self, reply: ControlReply) -> bool {
        match write_message(&mut self.write, &reply).await {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "control connection lost");
                false
            }
        }
    }

    async fn progress(&mut self, stage: ProgressStage) -> Result<(), Cancelled> {
        tracing::info!("boot stage: {}", stage.describe());
        if self.send(ControlReply::Progress { stage }).await {
            Ok(())
        } else {
            Err(Cancelled::HungUp)
        }
    }

    fn set_phase(&self, phase: Phase) {
        self.agent.boot_state().phase = phase;
    }

    async fn fail(&mut self, stage: FailureStage, detail: String) {
        // The controller logs the failure as a warning (see `refuse`).
        tracing::info!("boot failed at {}: {detail}", stage.describe());
        self.set_phase(Phase::Failed);
        self.send(ControlReply::Failed { stage, detail }).await;
    }

    /// Runs `work` unless the controller goes away first.
    async fn until_cancelled<F: Future>(&mut self, work: F) -> Result<F::Output, Cancelled> {
        let mut work = std::pin::pin!(work);
        for _ in 0..UNEXPECTED_REQUESTS_MAX {
            tokio::select! {
                output = &mut work => return Ok(output),
                request = self.requests.recv() => match request {
                    None | Some(Err(_)) => return Err(Cancelled::HungUp),
                    Some(Ok(ControlRequest::Cancel)) => return Err(Cancelled::Explicitly),
                    Some(Ok(request)) => tracing::warn!(?request, "ignoring a request during the boot"),
                },
            }
        }
        Err(Cancelled::Explicitly)
    }

    async fn wait_for_join(&mut self) -> Result<(), Cancelled> {
        let deadline = tokio::time::Instant::now() + JOIN_GO_AHEAD_WAIT_MAX;
        for _ in 0..UNEXPECTED_REQUESTS_MAX {
            match tokio::time::timeout_at(deadline, self.requests.recv()).await {
                Ok(Some(Ok(ControlRequest::Join))) => return Ok(()),
                Ok(Some(Ok(ControlRequest::Cancel))) => return Err(Cancelled::Explicitly),
                Ok(Some(Ok(request))) => {
                    tracing::warn!(?request, "ignoring a request while waiting to join");
                }
                // No go-ahead in time counts as a hang-up: a detached agent
                // keeps its workload for the next controller.
                Ok(None | Some(Err(_))) | Err(_) => return Err(Cancelled::HungUp),
            }
        }
        Err(Cancelled::Explicitly)
    }

    async fn run(mut self, fatal: mpsc::Sender<String>) {
        match self.steps(fatal).await {
            Ok(()) => {}
            Err(cancelled) => self.abandon(cancelled),
        }
    }

    /// The boot (or resume) ended before the join. A detached agent whose
    /// workload runs keeps it when the controller merely hung up: it may
    /// have died, and its successor resumes the node. Otherwise the boot's
    /// commands are stopped.
    fn abandon(&self, cancelled: Cancelled) {
        let started = self.agent.boot_state().phase == Phase::Started;
        if self.agent.config.detached && started && matches!(cancelled, Cancelled::HungUp) {
            tracing::warn!(
                "the controller hung up before the join; keeping the workload for a resume"
            );
            return;
        }
        // A cancel the controller sent (a teardown, a replacement): expected.
        tracing::info!("the controller abandoned the boot; stopping its commands");
        self.agent.kill_children();
        self.set_phase(Phase::Abandoned);
    }

    /// Re-joins the swarm at the order's address with the first boot's
    /// credential, swarm and labels; the workload runs on untouched.
    async fn resume(mut self, fatal: mpsc::Sender<String>) {
        match self.resume_steps(fatal).await {
            Ok(()) => {}
            Err(cancelled) => self.abandon(cancelled),
        }
    }

    async fn resume_steps(&mut self, fatal: mpsc::Sender<String>) -> Result<(), Cancelled> {
        self.progress(ProgressStage::WaitingForJoin).await?;
        self.wait_for_join().await?;
        let first = self.agent.boot_state().first_join.clone();
        let Some(mut join) = first else {
            self.send(ControlReply::Failed {
                stage: FailureStage::Join,
                detail: "no join order to resume".to_owned(),
            })
            .await;
            return Ok(());
        };
        join.address = self.order.join.address;
        let agent = self.agent.clone();
        let membership = match self.until_cancelled(join_swarm(&agent, &join)).await? {
            Ok(membership) => membership,
            Err(detail) => {
                // The workload runs on; a later resume may try again.
                tracing::info!(%detail, "re-join failed");
                self.send(ControlReply::Failed {
                    stage: FailureStage::Join,
                    detail,
                })
                .await;
                return Ok(());
            }
        };
        tracing::info!(swarm = %join.address, "re-joined the swarm");
        self.hold(membership, fatal);
        if !self.send(ControlReply::Joined).await {
            return Ok(());
        }
        let _ = tokio::time::timeout(CLOSE_WAIT_MAX, self.requests.recv()).await;
        tracing::info!("bootstrap session closed");
        Ok(())
    }

    /// Makes `membership` the agent's current one.
    fn hold(&self, membership: Membership, fatal: mpsc::Sender<String>) {
        let peers = self
            .agent
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let task = tokio::spawn(hold_membership(
            membership,
            peers,
            self.agent.notices.clone(),
            self.agent.config.detached,
            fatal,
        ));
        self.agent.replace_membership(task.abort_handle());
    }

    async fn steps(&mut self, fatal: mpsc::Sender<String>) -> Result<(), Cancelled> {
        self.progress(ProgressStage::BootChecking).await?;
        let checks = self.order.verify_commands.clone();
        for (index, check) in checks.iter().enumerate() {
            let outcome = self.until_cancelled(self.check(check)).await?;
            if let Err(detail) = outcome {
                let detail = format!("verify command #{} `{check}` failed: {detail}", index + 1);
                self.fail(FailureStage::BootCheck, detail).await;
                return Ok(());
            }
        }
        self.progress(ProgressStage::AgentStarting).await?;
        if let Err(detail) = self.make_peers_file() {
            self.fail(FailureStage::Start, detail).await;
            return Ok(());
        }
        let (notices_tx, notices) = mpsc::channel(NOTICE_QUEUE_MAX);
        let (ended_tx, mut ended) = watch::channel(None::<String>);
        if !self.order.start_command.is_empty() {
            match self.start_workload() {
                Ok(workload) => {
                    tokio::spawn(watch_workload(workload, notices_tx, ended_tx));
                }
                Err(detail) => {
                    self.fail(FailureStage::Start, detail).await;
                    return Ok(());
                }
            }
            let early = self
                .until_cancelled(async {
                    let ended =
                        tokio::time::timeout(WORKLOAD_START_CHECK, ended.wait_for(Option::is_some))
                            .await;
                    match ended {
                        Ok(Ok(how)) => how.clone(),
                        _ => None,
                    }
                })
                .await?;
            if let Some(how) = early {
                let detail = format!("workload {how} right after it started");
                self.fail(FailureStage::Start, detail).await;
                return Ok(());
            }
        }
        *self.agent.notices.lock().await = Some(notices);
        self.set_phase(Phase::Started);
        self.progress(ProgressStage::WaitingForJoin).await?;
        self.wait_for_join().await?;
        let early = ended.borrow().clone();
        if let Some(how) = early {
            // It ended while the controller's go-ahead was on its way.
            let detail = format!("workload {how} before the node joined");
            self.fail(FailureStage::Start, detail).await;
            return Ok(());
        }
        let join = self.order.join.clone();
        let agent = self.agent.clone();
        let membership = match self.until_cancelled(join_swarm(&agent, &join)).await? {
            Ok(membership) => membership,
            Err(detail) => {
                self.fail(FailureStage::Join, detail).await;
                return Ok(());
            }
        };
        tracing::info!("joined the swarm");
        self.hold(membership, fatal);
        if !self.send(ControlReply::Joined).await {
            return Ok(());
        }
        // The session ends with the controller's close, or when it hangs up.
        let _ = tokio::time::timeout(CLOSE_WAIT_MAX, self.requests.recv()).await;
        tracing::info!("bootstrap session closed");
        Ok(())
    }

    /// A command for `shell_command` through the wrapper role.
    fn command(&self, shell_command: &str, args: &[String]) -> Command {
        let peers_file = rendezvous::peers_file_path(&self.order);
        workload_command(
            &self.agent.config,
            &self.order,
            self.user,
            &peers_file,
            shell_command,
            args,
        )
    }

    /// Makes the node's peers file (empty) before its workload starts, with
    /// the group's `on_peers_change` command run after each rewrite.
    fn make_peers_file(&self) -> Result<(), String> {
        let path = rendezvous::peers_file_path(&self.order);
        let on_change = (!self.order.on_peers_change.is_empty()).then(|| {
            let agent = self.agent.clone();
            let order = self.order.clone();
            let user = self.user;
            let path = path.clone();
            Box::new(move || {
                let mut command = workload_command(
                    &agent.config,
                    &order,
                    user,
                    &path,
                    &order.on_peers_change,
                    &[],
                );
                command.stdout(Stdio::null()).stderr(Stdio::null());
                command
            }) as Box<dyn Fn() -> Command + Send + Sync>
        });
        let file = rendezvous::PeersFile::create(path, on_change)?;
        *self
            .agent
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(file);
        Ok(())
    }

    /// Runs one verify command; `Err` says how it failed.
    fn check(&self, check: &str) -> impl Future<Output = Result<(), String>> + use<> {
        let mut command = self.command(check, &[]);
        command.stdout(Stdio::piped()).stderr(Stdio::piped());
        let spawned = command.spawn();
        async move {
            let mut child = spawned.map_err(|error| format!("cannot start it: {error}"))?;
            let tail = Arc::new(Mutex::new(Vec::new()));
            let mut readers = Vec::new();
            if let Some(out) = child.stdout.take() {
                readers.push(AbortOnDrop(
                    tokio::spawn(collect_tail(out, tail.clone())).abort_handle(),
                ));
            }
            if let Some(err) = child.stderr.take() {
                readers.push(AbortOnDrop(
                    tokio::spawn(collect_tail(err, tail.clone())).abort_handle(),
                ));
            }
            let status = match tokio::time::timeout(VERIFY_COMMAND_TIMEOUT, child.wait()).await {
                Ok(Ok(status)) => status,
                Ok(Err(error)) => return Err(format!("cannot wait for it: {error}")),
                Err(_) => {
                    let _ = child.start_kill();
                    return Err(format!("still running after {VERIFY_COMMAND_TIMEOUT:?}"));
                }
            };
            if status.success() {
                return Ok(());
            }
            tokio::time::sleep(OUTPUT_DRAIN_WAIT).await;
            drop(readers);
            let tail = tail.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let output = String::from_utf8_lossy(&tail);
            Err(format!("{}; output: {:?}", describe(status), output.trim()))
        }
    }

    /// Starts the workload, its output going to the agent's own error stream.
    fn start_workload(&self) -> Result<Child, String> {
        let mut command = self.command(&self.order.start_command, &self.order.args);
        let stderr = std::io::stderr()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|error| format!("cannot share the agent's error stream: {error}"))?;
        let stdout = stderr
            .try_clone()
            .map_err(|error| format!("cannot share the agent's error stream: {error}"))?;
        command
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr));
        let child = command
            .spawn()
            .map_err(|error| format!("cannot start the workload: {error}"))?;
        tracing::info!(pid = ?child.id(), "workload started");
        Ok(child)
    }
}

/// A command for `shell_command` through the wrapper role, with the
/// environment a workload is told ([`rendezvous::workload_env`]).
fn workload_command(
    config: &super::AgentConfig,
    order: &BootOrder,
    user: Option<RunAs>,
    peers_file: &std::path::Path,
    shell_command: &str,
    args: &[String],
) -> Command {
    let mut command = Command::new(&config.program);
    command
        .args(&config.program_args)
        .envs(&order.env)
        .envs(rendezvous::workload_env(order, peers_file))
        // The tags come after the user's environment so that they win.
        .env(os::RUN_TAG, &config.run)
        .env(os::NODE_TAG, &config.node)
        .env(os::ATTEMPT_TAG, config.attempt.to_string())
        .env_remove(env::PARENT_PID)
        .env_remove(env::COMMAND)
        .env_remove(env::STOP_GRACE_MS)
        .env_remove(env::DETACHED)
        .env_remove(env::LISTEN_ADDRESS)
        .env(env::ROLE, env::ROLE_WORKLOAD)
        .env(env::WORKLOAD_COMMAND, shell_command)
        .env(
            env::WORKLOAD_ARGS,
            serde_json::to_string(args).unwrap_or_else(|_| "[]".to_owned()),
        )
        .env(env::WORKLOAD_PARENT_PID, getpid().as_raw().to_string())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    // The wrapper itself starts as the agent's user (so it can always be
    // executed) and switches before it arms its parent-death signal:
    // the kernel clears that signal when a process changes its user.
    if let Some(user) = user {
        command
            .env(env::WORKLOAD_UID, user.uid.to_string())
            .env(env::WORKLOAD_GID, user.gid.to_string());
    } else {
        command
            .env_remove(env::WORKLOAD_UID)
            .env_remove(env::WORKLOAD_GID);
    }
    command
}

fn describe(status: std::process::ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => "ended abnormally".to_owned(),
    }
}

/// Keeps the last [`OUTPUT_TAIL_BYTES`] of a stream.
async fn collect_tail<R: AsyncRead + Unpin>(mut stream: R, tail: Arc<Mutex<Vec<u8>>>) {
    let mut buffer = [0_u8; 1024];
    // Bounded by the stream: it ends at its end or first error.
    loop {
        let read = match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        let mut tail = tail.lock().unwrap_or_else(PoisonError::into_inner);
        tail.extend_from_slice(&buffer[..read]);
        let excess = tail.len().saturating_sub(OUTPUT_TAIL_BYTES);
        tail.drain(..excess);
    }
}

async fn watch_workload(
    mut workload: Child,
    notices: mpsc::Sender<SwarmNotice>,
    ended: watch::Sender<Option<String>>,
) {
    // Bounded by the workload's life; the agent kills it when it stops.
    let notice = match workload.wait().await {
        Ok(status) => {
            let how =
                provisioning::observe::WorkloadEnd::from_parts(status.code(), status.signal())
                    .map_or_else(|| "ended abnormally".to_owned(), |end| end.to_string());
            tracing::info!("workload {how}");
            ended.send_replace(Some(how));
            SwarmNotice::WorkloadExited {
                code: status.code(),
                signal: status.signal(),
            }
        }
        Err(error) => {
            tracing::warn!(%error, "cannot wait for the workload");
            return;
        }
    };
    let _ = notices.try_send(notice);
}

/// A welcomed swarm connection: the controller's pushes are read from it.
struct Membership {
    read: MessageReader<SwarmPush, OwnedReadHalf>,
    write: OwnedWriteHalf,
}

async fn join_swarm(agent: &Agent, join: &JoinOrder) -> Result<Membership, String> {
    let mut last_error = String::from("no attempt made");
    let mut stream = None;
    for _ in 0..JOIN_CONNECT_ATTEMPTS_MAX {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(join.address)).await {
            Ok(Ok(connected)) => {
                stream = Some(connected);
                break;
            }
            Ok(Err(error)) => last_error = error.to_string(),
            Err(_) => last_error = format!("no connection within {CONNECT_TIMEOUT:?}"),
        }
        tokio::time::sleep(JOIN_RETRY_PAUSE).await;
    }
    let stream = stream.ok_or_else(|| {
        format!(
            "cannot reach the swarm at {} after {JOIN_CONNECT_ATTEMPTS_MAX} attempts: {last_error}",
            join.address
        )
    })?;
    let (read, mut write) = stream.into_split();
    let config = &agent.config;
    let hello = SwarmHello {
        protocol: PROTOCOL_VERSION,
        run: config.run.clone(),
        node: config.node.clone(),
        attempt: config.attempt,
        credential: join.credential.clone(),
        swarm: join.swarm.clone(),
        labels: join.labels.clone(),
    };
    write_message(&mut write, &hello)
        .await
        .map_err(|error| format!("cannot send the hello: {error}"))?;
    // The membership the controller pushes after the welcome may be long,
    // and may arrive in the welcome's read: the reader keeps it.
    let mut reader = MessageReader::<SwarmReply, _>::with_codec(
        read,
        JsonLinesCodec::with_max_line_bytes(PEERS_LINE_BYTES_MAX),
    );
    let reply = tokio::time::timeout(WELCOME_WAIT_MAX, reader.next()).await;
    match reply {
        Ok(Ok(Some(SwarmReply::Welcome))) => Ok(Membership {
            read: reader.retyped(),
            write,
        }),
        Ok(Ok(Some(SwarmReply::Rejected { reason }))) => {
            Err(format!("the swarm rejected the join: {reason}"))
        }
        Ok(Ok(None)) => Err("the swarm closed the connection".to_owned()),
        Ok(Err(error)) => Err(format!("bad answer from the swarm: {error}")),
        Err(_) => Err(format!(
            "no answer from the swarm within {WELCOME_WAIT_MAX:?}"
        )),
    }
}

/// Keeps the swarm membership and forwards workload notices. When the
/// connection ends, the node has lost its swarm: an attached agent stops
/// it; a detached one waits for a restarted controller to resume it.
async fn hold_membership(
    mut membership: Membership,
    peers: Option<Arc<rendezvous::PeersFile>>,
    notices: Arc<tokio::sync::Mutex<Option<mpsc::Receiver<SwarmNotice>>>>,
    detached: bool,
    fatal: mpsc::Sender<String>,
) {
    // Held for the membership's life; a resume's membership waits for it.
    let mut notices = notices.lock_owned().await;
    let mut notices_open = notices.is_some();
    // Bounded by the connection's life.
    let reason = loop {
        tokio::select! {
            push = membership.read.next() => match push {
                Ok(Some(SwarmPush::Peers(update))) => {
                    if let Some(peers) = &peers {
                        peers.rewrite(&update);
                    }
                }
                Ok(Some(SwarmPush::Unknown)) => tracing::debug!("ignoring an unknown push"),
                Ok(None) => break "the swarm connection closed".to_owned(),
                Err(error) => break format!("the swarm connection failed: {error}"),
            },
            notice = next_notice(&mut notices), if notices_open => match notice {
                Some(notice) => {
                    if let Err(error) = write_message(&mut membership.write, &notice).await {
                        break format!("cannot write to the swarm: {error}");
                    }
                }
                None => notices_open = false,
            },
        }
    };
    if detached {
        tracing::warn!(%reason, "swarm membership lost; the node runs on, waiting for its controller");
    } else {
        let _ = fatal.try_send(reason);
    }
}

async fn next_notice(notices: &mut Option<mpsc::Receiver<SwarmNotice>>) -> Option<SwarmNotice> {
    match notices {
        Some(notices) => notices.recv().await,
        None => None,
    }
}
