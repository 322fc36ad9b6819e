//! The controller's side of one bootstrap session: the control connection to
//! a node agent, from the boot order to the close.
//!
//! The session task is owned by the plugin, not by the `start_bootstrap`
//! call: if the call gives up (its deadline passed), the session goes on and
//! a retry adopts it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use provisioning::observe::BootstrapEvent;
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning_provider::AttemptKey;
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use crate::state::{SessionState, Shared};
use provisioning_agent::codec::{CodecError, MessageReader, write_message};
use provisioning_agent::wire::{self, BootOrder, ControlReply, ControlRequest, FailureStage};

/// How many commands (close) may wait for a session task.
pub(crate) const SESSION_COMMANDS_MAX: usize = 4;

/// How many agent replies may wait for the session task.
const REPLY_QUEUE_MAX: usize = 16;

/// How long connecting to an agent may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest silence accepted from an agent during a boot. The agent bounds
/// each verify command well below this, so silence past it means the agent
/// is stuck (for example stopped).
const AGENT_SILENCE_MAX: Duration = Duration::from_secs(15 * 60);

/// How the hand-over of the boot order ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Handshake {
    /// Not settled yet.
    Pending,
    /// The agent took the order.
    Accepted,
    /// The agent had booted already and resumes (it re-joins this plugin's
    /// swarm; its workload runs on).
    Resumed,
    /// The agent refused the order; nothing started.
    Refused(String),
    /// The agent could not be reached; nothing was sent.
    ConnectFailed(String),
    /// The connection broke after the order may have been delivered.
    Broken(String),
}

/// What the plugin may ask of a running session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SessionCommand {
    /// The agent joined and the driver saw it: end the session politely.
    Close,
    /// Cleanup abandons the boot: tell the agent, then end the session.
    Cancel,
}

/// Everything a session task needs to start.
pub(crate) struct SessionSetup {
    pub(crate) key: AttemptKey,
    pub(crate) serial: u64,
    pub(crate) endpoint: SocketAddr,
    pub(crate) order: BootOrder,
}

/// Aborts a helper task when the session task ends, however it ends.
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs one session to its end.
pub(crate) async fn run(
    shared: Arc<Shared>,
    setup: SessionSetup,
    handshake: watch::Sender<Handshake>,
    commands: mpsc::Receiver<SessionCommand>,
) {
    let SessionSetup {
        key,
        serial,
        endpoint,
        order,
    } = setup;
    let session = Session {
        shared,
        key,
        serial,
    };
    session.progress(BootstrapProgress::Connecting);
    let stream = match connect(endpoint).await {
        Ok(stream) => stream,
        Err(reason) => return session.refuse(&handshake, Handshake::ConnectFailed(reason)),
    };
    session.progress(BootstrapProgress::Connected);
    let (read, mut write) = stream.into_split();
    let (replies_tx, mut replies) = mpsc::channel(REPLY_QUEUE_MAX);
    let _reader = AbortOnDrop(tokio::spawn(read_replies(read, replies_tx)).abort_handle());

    let boot = ControlRequest::Boot(Box::new(order));
    if let Err(error) = write_message(&mut write, &boot).await {
        return session.break_off(&handshake, format!("cannot send the boot order: {error}"));
    }
    match hand_over(&mut replies).await {
        accepted @ (Handshake::Accepted | Handshake::Resumed) => {
            session.shared.advance_session(
                &session.key,
                serial,
                &[SessionState::Handshaking],
                SessionState::Booting,
            );
            let _ = handshake.send(accepted);
        }
        refused @ Handshake::Refused(_) => return session.refuse(&handshake, refused),
        Handshake::Broken(reason) => return session.break_off(&handshake, reason),
        other => return session.break_off(&handshake, format!("{other:?}")),
    }
    session.follow(&mut write, &mut replies, commands).await;
}

async fn connect(endpoint: SocketAddr) -> Result<TcpStream, String> {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(endpoint)).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(error)) => Err(format!(
            "cannot connect to the agent at {endpoint}: {error}"
        )),
        Err(_) => Err(format!(
            "connecting to the agent at {endpoint} took longer than {CONNECT_TIMEOUT:?}"
        )),
    }
}

/// Waits for the agent's answer to the boot order.
async fn hand_over(replies: &mut mpsc::Receiver<Result<ControlReply, CodecError>>) -> Handshake {
    match tokio::time::timeout(AGENT_SILENCE_MAX, replies.recv()).await {
        Ok(Some(Ok(ControlReply::Accepted))) => Handshake::Accepted,
        Ok(Some(Ok(ControlReply::Resumed))) => Handshake::Resumed,
        Ok(Some(Ok(ControlReply::Refused { reason }))) => {
            Handshake::Refused(format!("the agent refused the boot order: {reason}"))
        }
        Ok(Some(Ok(other))) => Handshake::Broken(format!(
            "expected an answer to the boot order, got {other:?}"
        )),
        Ok(Some(Err(error))) => Handshake::Broken(format!("bad answer to the boot order: {error}")),
        Ok(None) => Handshake::Broken("the agent closed the connection".to_owned()),
        Err(_) => Handshake::Broken(format!(
            "no answer from the agent within {AGENT_SILENCE_MAX:?}"
        )),
    }
}

struct Session {
    shared: Arc<Shared>,
    key: AttemptKey,
    serial: u64,
}

impl Session {
    fn progress(&self, progress: BootstrapProgress) {
        if self.shared.session_is_live(&self.key, self.serial) {
            self.shared
                .report(&self.key, BootstrapEvent::Progress(progress));
        }
    }

    /// The order was certainly not taken: forget the session, so that a retry
    /// starts afresh, and settle the handshake.
    fn refuse(&self, handshake: &watch::Sender<Handshake>, outcome: Handshake) {
        let why = match &outcome {
            Handshake::Refused(reason)
            | Handshake::ConnectFailed(reason)
            | Handshake::Broken(reason) => reason.as_str(),
            Handshake::Pending | Handshake::Accepted | Handshake::Resumed => "no answer",
        };
        tracing::warn!("bootstrap of {} not started: {why}", self.key);
        self.shared.forget_session(&self.key, self.serial);
        let _ = handshake.send(outcome);
    }

    /// The order may have been taken but the session is broken: report the
    /// failure and settle the handshake as broken.
    fn break_off(&self, handshake: &watch::Sender<Handshake>, detail: String) {
        self.shared.fail_session(
            &self.key,
            self.serial,
            BootstrapFailure::StreamError,
            detail.clone(),
        );
        let _ = handshake.send(Handshake::Broken(detail));
    }

    /// Relays the agent's progress until the session ends.
    async fn follow(
        &self,
        write: &mut OwnedWriteHalf,
        replies: &mut mpsc::Receiver<Result<ControlReply, CodecError>>,
        mut commands: mpsc::Receiver<SessionCommand>,
    ) {
        loop {
            tokio::select! {
                reply = tokio::time::timeout(AGENT_SILENCE_MAX, replies.recv()) => {
                    let reply = match reply {
                        Ok(Some(Ok(reply))) => reply,
                        Ok(Some(Err(error))) => return self.broken(format!("bad message from the agent: {error}")),
                        Ok(None) => return self.broken("the agent closed the connection".to_owned()),
                        Err(_) => return self.broken(format!("no message from the agent within {AGENT_SILENCE_MAX:?}")),
                    };
                    if !self.on_reply(write, reply).await {
                        return;
                    }
                }
                command = commands.recv() => match command {
                    Some(SessionCommand::Close) => {
                        if let Err(error) = write_message(write, &ControlRequest::Close).await {
                            tracing::debug!(node = %self.key, %error, "agent gone before the close");
                        }
                        return;
                    }
                    Some(SessionCommand::Cancel) => {
                        if let Err(error) = write_message(write, &ControlRequest::Cancel).await {
                            tracing::debug!(node = %self.key, %error, "agent gone before the cancel");
                        }
                        return;
                    }
                    None => return,
                },
            }
        }
    }

    /// Handles one reply; returns whether the session goes on.
    async fn on_reply(&self, write: &mut OwnedWriteHalf, reply: ControlReply) -> bool {
        match reply {
            ControlReply::Progress {
                stage: wire::ProgressStage::WaitingForJoin,
            } => {
                if !self.shared.advance_session(
                    &self.key,
                    self.serial,
                    &[SessionState::Booting],
                    SessionState::AwaitingJoin,
                ) {
                    return false;
                }
                self.shared.report(
                    &self.key,
                    BootstrapEvent::Progress(BootstrapProgress::WaitingForJoin),
                );
                // The go-ahead follows the report, so Joined can never be
                // reported before WaitingForJoin.
                if let Err(error) = write_message(write, &ControlRequest::Join).await {
                    self.broken(format!("cannot send the join go-ahead: {error}"));
                    return false;
                }
                true
            }
            ControlReply::Progress { stage } => {
                self.progress(progress_of(stage));
                true
            }
            ControlReply::Failed { stage, detail } => {
                let failure = match stage {
                    FailureStage::BootCheck => BootstrapFailure::BootCheckFailed,
                    FailureStage::Start => BootstrapFailure::StartFailed,
                    FailureStage::Join => BootstrapFailure::JoinFailed,
                };
                self.shared
                    .fail_session(&self.key, self.serial, failure, detail);
                false
            }
            ControlReply::Joined => {
                tracing::debug!(node = %self.key, "agent confirms it joined");
                true
            }
            ControlReply::Accepted | ControlReply::Resumed | ControlReply::Refused { .. } => {
                self.broken(format!("unexpected {reply:?} during the boot"));
                false
            }
        }
    }

    /// The control connection broke. Before the join that fails the boot;
    /// after it the swarm connection alone tells whether the agent lives.
    fn broken(&self, detail: String) {
        let joined = self
            .shared
            .table()
            .get(&self.key)
            .and_then(|entry| entry.session.as_ref())
            .is_some_and(|s| s.serial == self.serial && s.state == SessionState::Joined);
        if joined {
            tracing::debug!(node = %self.key, %detail, "control connection ended after the join");
        } else {
            self.shared.fail_session(
                &self.key,
                self.serial,
                BootstrapFailure::StreamError,
                detail,
            );
        }
    }
}

/// Forwards the agent's replies; ends at the end of the stream or at the
/// first error (which it forwards).
async fn read_replies(
    read: OwnedReadHalf,
    replies: mpsc::Sender<Result<ControlReply, CodecError>>,
) {
    let mut reader = MessageReader::<ControlReply, _>::new(read);
    // Bounded by the connection: it ends with the stream or the first error.
    loop {
        let message = reader.next().await;
        let (forward, stop) = match message {
            Ok(Some(reply)) => (Ok(reply), false),
            Ok(None) => return,
            Err(error) => (Err(error), true),
        };
        if replies.send(forward).await.is_err() || stop {
            return;
        }
    }
}

/// Progress stages as the core names them.
fn progress_of(stage: wire::ProgressStage) -> BootstrapProgress {
    match stage {
        wire::ProgressStage::BootChecking => BootstrapProgress::BootChecking,
        wire::ProgressStage::AgentStarting => BootstrapProgress::AgentStarting,
        wire::ProgressStage::WaitingForJoin => BootstrapProgress::WaitingForJoin,
    }
}
