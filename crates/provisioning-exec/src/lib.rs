//! The exec provider: a [`ProvisionPlugin`] that is a separate program.
//!
//! [`ExecPlugin`] runs a program (command and arguments, no shell) and
//! speaks the JSON-lines plugin protocol of `docs/plugin-protocol.md` with it
//! over the program's stdin and stdout; the program's stderr goes to the log.
//! The program can be written in any language.
//!
//! # Guarantees
//! - A reply that does not come within [`ExecConfig::call_timeout`] fails
//!   the call [`PluginError::Ambiguous`]; a late reply is logged and dropped.
//! - A program that exits makes every call in flight ambiguous, and is
//!   restarted with a backoff between [`ExecConfig::restart_backoff_min`] and
//!   [`ExecConfig::restart_backoff_max`] (doubling, reset by a good reply).
//! - A call that could not be sent (the program cannot be started, its
//!   handshake failed) fails definitely: nothing reached the program.
//! - A reply of the wrong shape fails its call definitely and is logged;
//!   output that names no call in flight is logged and ignored. Decoding
//!   never panics ([`wire::decode_line`]), and no wait is unbounded.
//! - Dropping the plugin kills the program.
//!
//! # Assumptions
//! Calls run on a tokio runtime (with the `process`, `time` and `io-util`
//! drivers enabled); constructing an [`ExecPlugin`] needs none.
//!
//! With the `kit` feature (off by default: running a provider program
//! needs no conformance kit), the crate also implements the kit's
//! `ContractFaults` over the protocol's optional test hooks
//! (`contract_faults`), `conformance` runs the seam contract suite against a
//! program, and `battery` runs the kit's trace battery against it.

#[cfg(feature = "kit")]
pub mod battery;
#[cfg(feature = "kit")]
pub mod conformance;
#[cfg(feature = "kit")]
mod contract_faults;
pub mod wire;

use std::collections::BTreeMap;
use std::fmt;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use provisioning::effect::SessionHandle;
use provisioning::spawn::BoxFuture;
use provisioning::{Endpoint, EndpointLookup, LeaseHandle, LogicalNodeSpec, RunId};
use provisioning_agent::codec::{LossyLine, LossyLinesCodec};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use serde_json::{Value, json};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::codec::FramedRead;

use crate::wire::{
    CreateResult, DecodeError, Disposition, HANDSHAKE_ID, Hello, ListResult, LookupResult, Message,
    PROTOCOL, PROTOCOL_VERSION, StartResult, WireError,
};

/// The default provider kind an [`ExecPlugin`] serves.
pub const DEFAULT_KIND: &str = "exec";

/// The default bound on one call's reply.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The default bound on the handshake of a started program.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The default first restart delay.
pub const DEFAULT_RESTART_BACKOFF_MIN: Duration = Duration::from_millis(100);

/// The default longest restart delay.
pub const DEFAULT_RESTART_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The most characters of a bad line quoted in the log.
const LOG_QUOTE_MAX: usize = 200;

/// How to run a provider program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecConfig {
    /// The provider kind the plugin serves (`provider = "..."` in a shape).
    pub kind: String,
    /// The program to run (looked up on `PATH` when it has no `/`).
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// How long a call waits for its reply before it is ambiguous.
    pub call_timeout: Duration,
    /// How long a started program has to answer the handshake.
    pub handshake_timeout: Duration,
    /// The delay before the first restart of a program that exited.
    pub restart_backoff_min: Duration,
    /// The longest delay between restarts.
    pub restart_backoff_max: Duration,
    /// Whether the handshake tells the program that a test harness drives
    /// it (`"harness": true`, `docs/plugin-protocol.md` §6.3): a program
    /// offering the `emit` hook then reports bootstrap events only when
    /// asked. Only the conformance battery sets it.
    pub harness: bool,
}

impl ExecConfig {
    /// A program serving [`DEFAULT_KIND`] with the default timeouts.
    pub fn new(
        command: impl Into<String>,
        args: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        ExecConfig {
            kind: DEFAULT_KIND.to_owned(),
            command: command.into(),
            args: args.into_iter().map(Into::into).collect(),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            restart_backoff_min: DEFAULT_RESTART_BACKOFF_MIN,
            restart_backoff_max: DEFAULT_RESTART_BACKOFF_MAX,
            harness: false,
        }
    }

    /// A program from a command line split into words as a POSIX shell
    /// splits them (`"python3 provider.py --flag"`, `"'/opt/my tools/p' -v"`):
    /// quotes and backslashes group and escape, nothing is expanded.
    ///
    /// # Errors
    /// [`ExecError::EmptyCommand`] when the line holds no word;
    /// [`ExecError::BadQuoting`] when a quote is not closed (or the line
    /// ends in a lone backslash).
    pub fn from_command_line(line: &str) -> Result<Self, ExecError> {
        let words = shlex::split(line).ok_or_else(|| ExecError::BadQuoting(line.to_owned()))?;
        let mut words = words.into_iter();
        let command = words.next().ok_or(ExecError::EmptyCommand)?;
        Ok(ExecConfig::new(command, words))
    }

    /// The same program serving `kind`.
    pub fn with_kind(mut self, kind: impl Into<String>) -> Self {
        self.kind = kind.into();
        self
    }

    /// The same program with another call timeout.
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The same program, told in its handshake that a test harness drives
    /// it (see [`ExecConfig::harness`]).
    pub fn with_harness(mut self) -> Self {
        self.harness = true;
        self
    }

    /// The program's name for logs: the last part of its path, and of its
    /// first argument when it has one (`python3 provider.py`).
    fn name(&self) -> String {
        let base = |path: &str| path.rsplit('/').next().unwrap_or(path).to_owned();
        match self.args.first() {
            Some(first) => format!("{} {}", base(&self.command), base(first)),
            None => base(&self.command),
        }
    }
}

/// Starting a program failed.
#[derive(Debug, Error)]
pub enum ExecError {
    /// The command line was empty.
    #[error("the provider command is empty")]
    EmptyCommand,
    /// The command line has a quote that is not closed.
    #[error("the provider command {0:?} has an unclosed quote or a trailing backslash")]
    BadQuoting(String),
    /// The program could not be spawned.
    #[error("could not start provider program {command:?}: {source}")]
    Spawn {
        /// The command.
        command: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The last start failed and the next is not due yet.
    #[error("provider program {command:?} failed to start; the next start is due in {wait:?}")]
    Backoff {
        /// The command.
        command: String,
        /// How long until the next start.
        wait: Duration,
    },
    /// [`ExecPlugin::close`] stopped the program for good.
    #[error("provider program {command:?} was closed")]
    Closed {
        /// The command.
        command: String,
    },
    /// The handshake failed.
    #[error("provider program {command:?} failed its handshake: {why}")]
    Handshake {
        /// The command.
        command: String,
        /// Why.
        why: String,
    },
}

/// What the reader hands a waiting call.
enum Reply {
    Answer(Result<Value, WireError>),
    Malformed(String),
    Died(String),
}

/// What one running program shares with its reader.
struct Shared {
    name: String,
    pending: Mutex<BTreeMap<u64, oneshot::Sender<Reply>>>,
    dead: AtomicBool,
    /// Whether the handshake succeeded (only such a program is restarted).
    established: AtomicBool,
    answered: AtomicBool,
    sink: Arc<Mutex<Option<ObservationSink>>>,
}

impl Shared {
    fn pending(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, oneshot::Sender<Reply>>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Marks the program dead and fails every call in flight ambiguously.
    fn die(&self, why: &str) {
        self.dead.store(true, Ordering::SeqCst);
        let pending = std::mem::take(&mut *self.pending());
        for (_, reply) in pending {
            let _ = reply.send(Reply::Died(why.to_owned()));
        }
    }

    fn handle(&self, line: &[u8]) {
        match wire::decode_line(line) {
            Ok(Message::Reply { id, outcome }) => match self.pending().remove(&id) {
                Some(waiting) => {
                    let _ = waiting.send(Reply::Answer(outcome));
                }
                None => tracing::warn!(
                    program = %self.name,
                    "reply to request {id}, which is not in flight (late or unknown); dropped"
                ),
            },
            Ok(Message::Observation(observation)) => {
                let sink = self
                    .sink
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                match sink {
                    Some(sink) => {
                        sink.report(observation);
                    }
                    None => tracing::warn!(
                        program = %self.name,
                        "observation before the plugin was attached; dropped: {observation:?}"
                    ),
                }
            }
            Err(DecodeError::BadReply { id, why }) => {
                tracing::error!(
                    program = %self.name,
                    "malformed reply to request {id} ({why}): {}",
                    quote(line)
                );
                if let Some(waiting) = self.pending().remove(&id) {
                    let _ = waiting.send(Reply::Malformed(why));
                }
            }
            Err(error) => tracing::error!(
                program = %self.name,
                "malformed output ignored ({error}): {}",
                quote(line)
            ),
        }
    }
}

fn quote(line: &[u8]) -> String {
    let text = String::from_utf8_lossy(line);
    let mut quoted: String = text.chars().take(LOG_QUOTE_MAX).collect();
    if text.chars().count() > LOG_QUOTE_MAX {
        quoted.push('…');
    }
    format!("{quoted:?}")
}

/// One running program.
struct Connection {
    /// Killed when the connection is dropped (taken by [`ExecPlugin::close`]).
    child: Mutex<Option<Child>>,
    /// Taken (closing the program's stdin) by [`ExecPlugin::close`].
    writer: Mutex<Option<mpsc::UnboundedSender<String>>>,
    shared: Arc<Shared>,
    hello: Hello,
    next_id: AtomicU64,
}

impl Connection {
    /// Registers a call and writes its request; the receiver gets the reply.
    fn send(
        &self,
        method: &str,
        key: Option<&AttemptKey>,
        args: Value,
    ) -> Option<(u64, oneshot::Receiver<Reply>)> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shared.pending().insert(id, tx);
        let line = wire::encode_request(id, method, key, args);
        let written = self
            .writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .is_some_and(|writer| writer.send(line).is_ok());
        if self.shared.is_dead() || !written {
            self.shared.pending().remove(&id);
            return None;
        }
        Some((id, rx))
    }
}

/// Removes a call's pending entry when the call is abandoned.
struct PendingGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.shared.pending().remove(&self.id);
    }
}

/// The restart bookkeeping.
#[derive(Default)]
struct Restarts {
    /// Consecutive starts without a good reply in between.
    failures: u32,
    last_start: Option<Instant>,
    /// Whether the last start failed (spawn or handshake).
    last_failed: bool,
}

struct Inner {
    config: ExecConfig,
    name: String,
    sink: Arc<Mutex<Option<ObservationSink>>>,
    current: Mutex<Option<Arc<Connection>>>,
    restarts: tokio::sync::Mutex<Restarts>,
    starts: AtomicU64,
    /// Set by [`ExecPlugin::close`]: no more starts.
    closed: AtomicBool,
}

impl Inner {
    fn live(&self) -> Option<Arc<Connection>> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|c| !c.shared.is_dead())
    }

    fn backoff(&self, failures: u32) -> Duration {
        let factor = 1u32.checked_shl(failures.min(16)).unwrap_or(u32::MAX);
        self.config
            .restart_backoff_min
            .saturating_mul(factor)
            .min(self.config.restart_backoff_max)
    }

    /// The running program, started (after the backoff) when there is none.
    /// (Boxed: the reader's restart calls it, and the reader is spawned by it.)
    fn connection(self: &Arc<Self>) -> BoxFuture<'_, Result<Arc<Connection>, ExecError>> {
        Box::pin(async move {
            if let Some(live) = self.live() {
                return Ok(live);
            }
            if self.closed.load(Ordering::SeqCst) {
                return Err(ExecError::Closed {
                    command: self.config.command.clone(),
                });
            }
            let mut restarts = self.restarts.lock().await;
            if let Some(live) = self.live() {
                return Ok(live);
            }
            let previous = self
                .current
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            if previous.is_some_and(|p| p.shared.answered.load(Ordering::SeqCst)) {
                restarts.failures = 0;
            }
            if let Some(last) = restarts.last_start {
                let due = last + self.backoff(restarts.failures);
                let now = Instant::now();
                if restarts.last_failed && now < due {
                    // Fail fast instead of queueing every caller behind
                    // another doomed start.
                    return Err(ExecError::Backoff {
                        command: self.config.command.clone(),
                        wait: due - now,
                    });
                }
                tokio::time::sleep_until(due).await;
                restarts.failures = restarts.failures.saturating_add(1);
            }
            restarts.last_start = Some(Instant::now());
            let started = self.spawn().await;
            restarts.last_failed = started.is_err();
            let connection = Arc::new(started?);
            *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(connection.clone());
            Ok(connection)
        })
    }

    async fn spawn(self: &Arc<Self>) -> Result<Connection, ExecError> {
        let config = &self.config;
        let start = self.starts.fetch_add(1, Ordering::Relaxed) + 1;
        let mut child = Command::new(&config.command)
            .args(&config.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| ExecError::Spawn {
                command: config.command.clone(),
                source,
            })?;
        tracing::info!(program = %self.name, start, pid = ?child.id(), "provider program started");
        let shared = Arc::new(Shared {
            name: self.name.clone(),
            pending: Mutex::new(BTreeMap::new()),
            dead: AtomicBool::new(false),
            established: AtomicBool::new(false),
            answered: AtomicBool::new(false),
            sink: self.sink.clone(),
        });
        let (writer, lines) = mpsc::unbounded_channel();
        if let Some(stdin) = child.stdin.take() {
            tokio::spawn(write_lines(stdin, lines, shared.clone()));
        }
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(log_stderr(stderr, self.name.clone()));
        }
        let handshake_failed = |why: String| ExecError::Handshake {
            command: config.command.clone(),
            why,
        };
        let Some(stdout) = child.stdout.take() else {
            return Err(handshake_failed("no stdout".to_owned()));
        };
        let (tx, rx) = oneshot::channel();
        shared.pending().insert(HANDSHAKE_ID, tx);
        tokio::spawn(read_lines(stdout, shared.clone(), Arc::downgrade(self)));
        let line = wire::encode_request(
            HANDSHAKE_ID,
            "handshake",
            None,
            if config.harness {
                json!({"protocol": PROTOCOL, "versions": [PROTOCOL_VERSION], "harness": true})
            } else {
                json!({"protocol": PROTOCOL, "versions": [PROTOCOL_VERSION]})
            },
        );
        let _ = writer.send(line);
        let hello = match tokio::time::timeout(config.handshake_timeout, rx).await {
            Err(_) => Err(format!("no answer within {:?}", config.handshake_timeout)),
            Ok(Err(_)) | Ok(Ok(Reply::Died(_))) => {
                Err("the program exited before answering".to_owned())
            }
            Ok(Ok(Reply::Malformed(why))) => Err(format!("malformed answer: {why}")),
            Ok(Ok(Reply::Answer(Err(error)))) => Err(format!("refused: {}", error.message)),
            Ok(Ok(Reply::Answer(Ok(value)))) => wire::decode_result::<Hello>(value)
                .map_err(|why| format!("malformed answer: {why}")),
        };
        let hello = match hello {
            Ok(hello) if hello.protocol != PROTOCOL => Err(format!(
                "it speaks protocol {:?}, not {PROTOCOL:?}",
                hello.protocol
            )),
            Ok(hello) if hello.version != PROTOCOL_VERSION => Err(format!(
                "it speaks version {}, this host only {PROTOCOL_VERSION}",
                hello.version
            )),
            other => other,
        };
        match hello {
            Ok(hello) => {
                shared.established.store(true, Ordering::SeqCst);
                tracing::info!(
                    program = %self.name,
                    "handshake: program {:?}, provider kind {:?}, protocol version {}",
                    hello.program,
                    hello.kind,
                    hello.version
                );
                Ok(Connection {
                    child: Mutex::new(Some(child)),
                    writer: Mutex::new(Some(writer)),
                    shared,
                    hello,
                    next_id: AtomicU64::new(HANDSHAKE_ID + 1),
                })
            }
            Err(why) => {
                // The child is killed as it is dropped here.
                shared.dead.store(true, Ordering::SeqCst);
                tracing::error!(program = %self.name, "handshake failed: {why}");
                Err(handshake_failed(why))
            }
        }
    }

    /// Sends one request — right after an `inject_fault` for it when `arm`
    /// names a fault, on the same connection, so that the program arms the
    /// fault for exactly this request — and waits for its reply.
    async fn call_armed(
        self: &Arc<Self>,
        method: &'static str,
        key: Option<&AttemptKey>,
        args: Value,
        arm: Arm<'_>,
    ) -> Result<Value, PluginError> {
        let connection = self
            .connection()
            .await
            .map_err(|e| PluginError::definite(format!("{method} was not sent: {e}")))?;
        if let Some(fault) = arm.fault {
            // The program arms it before it reads the request (§1), and its
            // reply is not needed: `{"armed": false}` is logged by the hook.
            if connection
                .send(
                    "inject_fault",
                    None,
                    json!({"method": method, "fault": fault}),
                )
                .is_none()
            {
                return Err(PluginError::definite(format!(
                    "{method} was not sent: provider program {} is not running",
                    self.name
                )));
            }
        }
        let Some((id, rx)) = connection.send(method, key, args) else {
            return Err(PluginError::definite(format!(
                "{method} was not sent: provider program {} is not running",
                self.name
            )));
        };
        if let Some(sent) = arm.sent {
            sent();
        }
        let _guard = PendingGuard {
            shared: &connection.shared,
            id,
        };
        let reply = match tokio::time::timeout(self.config.call_timeout, rx).await {
            Err(_) => {
                tracing::warn!(
                    program = %self.name,
                    "{method} (request {id}) got no reply within {:?}",
                    self.config.call_timeout
                );
                return Err(PluginError::ambiguous(format!(
                    "{method}: provider program {} did not reply within {:?}",
                    self.name, self.config.call_timeout
                )));
            }
            Ok(Err(_)) => Reply::Died("the connection closed".to_owned()),
            Ok(Ok(reply)) => reply,
        };
        match reply {
            Reply::Died(why) => Err(PluginError::ambiguous(format!(
                "{method}: provider program {} exited before replying ({why})",
                self.name
            ))),
            Reply::Malformed(why) => Err(PluginError::definite(format!(
                "{method}: provider program {} sent a malformed reply: {why}",
                self.name
            ))),
            Reply::Answer(Ok(value)) => {
                connection.shared.answered.store(true, Ordering::SeqCst);
                Ok(value)
            }
            Reply::Answer(Err(WireError {
                disposition,
                message,
            })) => {
                connection.shared.answered.store(true, Ordering::SeqCst);
                Err(match disposition {
                    Disposition::Definite => PluginError::Definite(message),
                    Disposition::Ambiguous => PluginError::Ambiguous(message),
                    Disposition::NotFound => PluginError::NotFound(message),
                })
            }
        }
    }

    /// A reply's `result` of the wrong shape: a definite error, logged.
    fn malformed(&self, method: &str, why: impl fmt::Display) -> PluginError {
        tracing::error!(program = %self.name, "malformed result of {method}: {why}");
        PluginError::definite(format!(
            "{method}: provider program {} sent a malformed result: {why}",
            self.name
        ))
    }

    async fn call_as<T: serde::de::DeserializeOwned>(
        self: &Arc<Self>,
        method: &'static str,
        key: Option<&AttemptKey>,
        args: Value,
        arm: Arm<'_>,
    ) -> Result<T, PluginError> {
        let value = self.call_armed(method, key, args, arm).await?;
        wire::decode_result(value).map_err(|why| self.malformed(method, why))
    }

    async fn call_empty(
        self: &Arc<Self>,
        method: &'static str,
        key: &AttemptKey,
        args: Value,
        arm: Arm<'_>,
    ) -> Result<(), PluginError> {
        let value = self.call_armed(method, Some(key), args, arm).await?;
        if wire::is_empty_result(&value) {
            Ok(())
        } else {
            Err(self.malformed(method, format!("expected an object, got {value}")))
        }
    }
}

async fn write_lines(
    mut stdin: ChildStdin,
    mut lines: mpsc::UnboundedReceiver<String>,
    shared: Arc<Shared>,
) {
    while let Some(line) = lines.recv().await {
        let written = async {
            stdin.write_all(line.as_bytes()).await?;
            stdin.flush().await
        };
        if let Err(error) = written.await {
            tracing::warn!(program = %shared.name, "writing to the program failed: {error}");
            break;
        }
    }
}

async fn log_stderr(stderr: impl AsyncRead + Unpin, name: String) {
    let mut lines = FramedRead::new(stderr, LossyLinesCodec::new(wire::MAX_LINE_BYTES));
    while let Some(Ok(line)) = lines.next().await {
        log_stderr_line(&name, line);
    }
}

fn log_stderr_line(name: &str, line: LossyLine) {
    match line {
        LossyLine::Text(text) => {
            tracing::info!(program = %name, "stderr: {}", String::from_utf8_lossy(&text));
        }
        LossyLine::TooLong(length) => {
            tracing::info!(program = %name, "stderr: (a line of {length} bytes, not shown)");
        }
    }
}

async fn read_lines(stdout: impl AsyncRead + Unpin, shared: Arc<Shared>, owner: Weak<Inner>) {
    let mut lines = FramedRead::new(stdout, LossyLinesCodec::new(wire::MAX_LINE_BYTES));
    let why = loop {
        match lines.next().await {
            None => break "it closed its stdout".to_owned(),
            Some(Ok(line)) => handle_line(&shared, line),
            Some(Err(error)) => break format!("reading its stdout failed: {error}"),
        }
    };
    let owned = owner
        .upgrade()
        .is_some_and(|inner| !inner.closed.load(Ordering::SeqCst));
    if owned {
        tracing::warn!(program = %shared.name, "provider program is gone: {why}");
    } else {
        tracing::debug!(program = %shared.name, "provider program stopped with its plugin: {why}");
    }
    shared.die(&why);
    // Restart it (after the backoff) unless the plugin is gone.
    if owned && shared.established.load(Ordering::SeqCst) {
        tokio::spawn(async move {
            if let Some(inner) = owner.upgrade() {
                if inner.live().is_none() {
                    if let Err(error) = inner.connection().await {
                        tracing::error!(program = %inner.name, "restart failed: {error}");
                    }
                }
            }
        });
    }
}

fn handle_line(shared: &Shared, line: LossyLine) {
    match line {
        LossyLine::Text(text) if text.iter().all(u8::is_ascii_whitespace) => {}
        LossyLine::Text(text) => shared.handle(&text),
        LossyLine::TooLong(length) => tracing::error!(
            program = %shared.name,
            "malformed output ignored: a line of {length} bytes exceeds {} bytes",
            wire::MAX_LINE_BYTES
        ),
    }
}

/// A [`ProvisionPlugin`] served by a provider program over the plugin
/// protocol. See the [crate docs](crate).
pub struct ExecPlugin {
    inner: Arc<Inner>,
}

impl fmt::Debug for ExecPlugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecPlugin")
            .field("config", &self.inner.config)
            .field("running", &self.inner.live().is_some())
            .finish_non_exhaustive()
    }
}

impl ExecPlugin {
    /// A plugin that starts the program on its first call.
    pub fn new(config: ExecConfig) -> Self {
        let name = config.name();
        ExecPlugin {
            inner: Arc::new(Inner {
                config,
                name,
                sink: Arc::new(Mutex::new(None)),
                current: Mutex::new(None),
                restarts: tokio::sync::Mutex::new(Restarts::default()),
                starts: AtomicU64::new(0),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// A plugin whose program is started and has answered the handshake.
    ///
    /// # Errors
    /// When the program cannot be started or fails its handshake.
    pub async fn start(config: ExecConfig) -> Result<Self, ExecError> {
        let plugin = ExecPlugin::new(config);
        plugin.inner.connection().await?;
        Ok(plugin)
    }

    /// The running program's handshake answer, if one runs.
    pub fn hello(&self) -> Option<Hello> {
        self.inner.live().map(|c| c.hello.clone())
    }

    /// How many times the program has been started.
    pub fn start_count(&self) -> u64 {
        self.inner.starts.load(Ordering::Relaxed)
    }

    /// The configuration.
    pub fn config(&self) -> &ExecConfig {
        &self.inner.config
    }

    /// Stops the program for good: closes its stdin, so that it can exit on
    /// its own (and tidy up, §1), waits for that at most `grace`, then kills
    /// it. Calls in flight fail ambiguously; later calls fail definitely,
    /// and the program is not restarted.
    pub async fn close(&self, grace: Duration) {
        self.inner.closed.store(true, Ordering::SeqCst);
        let current = self
            .inner
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(connection) = current else {
            return;
        };
        drop(
            connection
                .writer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let child = connection
            .child
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut child) = child {
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                tracing::warn!(
                    program = %self.inner.name,
                    "did not exit within {grace:?} of its stdin closing; killed"
                );
                let _ = child.kill().await;
            }
        }
    }
}

/// Where a call's request may carry a fault armed for it, and who hears
/// that it was sent (the battery's bookkeeping of held calls).
#[derive(Clone, Copy, Default)]
pub(crate) struct Arm<'a> {
    /// The protocol's name of the fault to arm for this very request.
    pub(crate) fault: Option<&'a str>,
    /// Called once the request is written to the program's queue.
    pub(crate) sent: Option<&'a (dyn Fn() + Send + Sync)>,
}

impl Arm<'_> {
    /// No fault, no callback: an ordinary call.
    pub(crate) const NONE: Arm<'static> = Arm {
        fault: None,
        sent: None,
    };
}

fn template_of(spec: &LogicalNodeSpec) -> Result<Value, PluginError> {
    serde_json::to_value(spec.template())
        .map_err(|e| PluginError::definite(format!("the template cannot be sent: {e}")))
}

impl ExecPlugin {
    pub(crate) async fn create_node_armed(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
        arm: Arm<'_>,
    ) -> Result<NodeLease, PluginError> {
        let template = template_of(spec)?;
        let result: CreateResult = self
            .inner
            .call_as("create_node", Some(key), json!({"template": template}), arm)
            .await?;
        Ok(NodeLease {
            lease: LeaseHandle(result.lease),
            endpoint: result.endpoint.map(Endpoint),
            adopted: result.adopted,
        })
    }

    pub(crate) async fn lookup_endpoint_armed(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
        arm: Arm<'_>,
    ) -> Result<EndpointLookup, PluginError> {
        let result: LookupResult = self
            .inner
            .call_as("lookup_endpoint", Some(key), json!({"lease": lease.0}), arm)
            .await?;
        match (result.ready, result.endpoint) {
            (true, Some(endpoint)) => Ok(EndpointLookup::Ready(Endpoint(endpoint))),
            (true, None) => Err(self.inner.malformed(
                "lookup_endpoint",
                "`ready` is true but there is no `endpoint`",
            )),
            (false, _) => Ok(EndpointLookup::NotReady),
        }
    }

    pub(crate) async fn start_bootstrap_armed(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
        arm: Arm<'_>,
    ) -> Result<BootstrapSession, PluginError> {
        let template = template_of(&request.spec)?;
        let result: StartResult = self
            .inner
            .call_as(
                "start_bootstrap",
                Some(key),
                json!({"lease": request.lease.0, "endpoint": request.endpoint.0, "template": template}),
                arm,
            )
            .await?;
        Ok(BootstrapSession {
            session: SessionHandle(result.session),
            adopted: result.adopted,
        })
    }

    pub(crate) async fn session_call_armed(
        &self,
        method: &'static str,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
        arm: Arm<'_>,
    ) -> Result<(), PluginError> {
        self.inner
            .call_empty(
                method,
                key,
                json!({"session": session.map(|s| s.0.as_str())}),
                arm,
            )
            .await
    }

    pub(crate) async fn destroy_node_armed(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
        arm: Arm<'_>,
    ) -> Result<(), PluginError> {
        self.inner
            .call_empty("destroy_node", key, json!({"lease": lease.0}), arm)
            .await
    }

    pub(crate) async fn list_nodes_armed(
        &self,
        run: &RunId,
        arm: Arm<'_>,
    ) -> Result<Vec<ListedNode>, PluginError> {
        let result: ListResult = self
            .inner
            .call_as("list_nodes", None, json!({"run": run.as_str()}), arm)
            .await?;
        Ok(result
            .nodes
            .into_iter()
            .map(|node| ListedNode {
                key: node.key.to_key(),
                lease: LeaseHandle(node.lease),
            })
            .collect())
    }

    /// A test hook's call (§6): its result decoded as `T`.
    #[cfg(feature = "kit")]
    pub(crate) async fn hook<T: serde::de::DeserializeOwned>(
        &self,
        method: &'static str,
        key: Option<&AttemptKey>,
        args: Value,
    ) -> Result<T, PluginError> {
        self.inner.call_as(method, key, args, Arm::NONE).await
    }

    /// The name of the running program's start, for logs.
    #[cfg(feature = "kit")]
    pub(crate) fn name(&self) -> &str {
        &self.inner.name
    }
}

#[async_trait]
impl ProvisionPlugin for ExecPlugin {
    fn kind(&self) -> &str {
        &self.inner.config.kind
    }

    fn attach(&self, sink: ObservationSink) {
        *self
            .inner
            .sink
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        self.create_node_armed(key, spec, Arm::NONE).await
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        self.lookup_endpoint_armed(key, lease, Arm::NONE).await
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        self.start_bootstrap_armed(key, request, Arm::NONE).await
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.session_call_armed("complete_bootstrap", key, session, Arm::NONE)
            .await
    }

    async fn cancel_bootstrap(
        &self,
        key: &AttemptKey,
        session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.session_call_armed("cancel_bootstrap", key, session, Arm::NONE)
            .await
    }

    async fn destroy_node(&self, key: &AttemptKey, lease: &LeaseHandle) -> Result<(), PluginError> {
        self.destroy_node_armed(key, lease, Arm::NONE).await
    }

    async fn list_nodes(&self, run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        self.list_nodes_armed(run, Arm::NONE).await
    }
}

#[cfg(test)]
mod tests {
    use super::{ExecConfig, ExecError};

    #[test]
    fn a_command_line_with_a_quoted_path_keeps_its_space() {
        let config =
            ExecConfig::from_command_line("python3 '/tmp/my providers/dirs.py' --root \"/a b\"")
                .unwrap();
        assert_eq!(config.command, "python3");
        assert_eq!(config.args, ["/tmp/my providers/dirs.py", "--root", "/a b"]);
        assert!(matches!(
            ExecConfig::from_command_line("python3 'open"),
            Err(ExecError::BadQuoting(_))
        ));
        assert!(matches!(
            ExecConfig::from_command_line("   "),
            Err(ExecError::EmptyCommand)
        ));
    }
}
