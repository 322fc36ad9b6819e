//! A swarm listener for remote providers (SSH, Slurm, …), independent of
//! [`ProcessPlugin`](crate::ProcessPlugin).
//!
//! A remote provider starts node agents on other machines (see
//! [`crate::agent`], remote boot mode) that join the run's swarm over TCP.
//! [`RemoteSwarm`] is the controller's end:
//!
//! - [`RemoteSwarm::bind`] binds the listen address and reports the
//!   *advertised* address agents must dial ([`RemoteSwarm::advertised`]);
//! - the provider calls [`RemoteSwarm::expect`] for a key before it starts
//!   that key's agent (and, after a controller restart, for every adopted
//!   key it lists), and [`RemoteSwarm::forget`] when it destroys it;
//! - a hello is accepted only when its credential is the one the run's
//!   [`RunSecret`] derives for the claimed key, the run matches, and the key
//!   is expected and not connected right now;
//! - the listener reports [`RemoteEvent`]s through the callback given to
//!   `bind`: `Joined` (first join of an expectation), `Rejoined` (a join
//!   after a connection loss within the re-join grace, or of an adopted
//!   key), and `Lost` (the workload exited, or the connection ended and no
//!   re-join came within the grace). A lost key is no longer expected.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use provisioning::observe::LossCause;
use provisioning::{LogicalNodeId, NodeAttemptId, RunId};
use provisioning_provider::AttemptKey;
use thiserror::Error;
use tokio::io::BufReader;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use crate::credential::{NodeCredential, RunSecret};
use crate::wire::{self, PROTOCOL_VERSION, SwarmHello, SwarmNotice, SwarmReply};

/// How many swarm connections may be open at once.
const CONNECTIONS_MAX: usize = 4096;

/// How long a new connection may take to say hello.
const HELLO_WAIT_MAX: Duration = Duration::from_secs(5);

/// The pause after a failed `accept`.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// The default time an agent whose connection ended has to re-join before
/// its node counts as lost.
pub const DEFAULT_REJOIN_GRACE: Duration = Duration::from_secs(3);

/// How a [`RemoteSwarm`] is set up.
#[derive(Clone, Debug)]
pub struct RemoteSwarmConfig {
    /// The run whose agents may join.
    pub run_id: RunId,
    /// The run's secret; join credentials derive from it.
    pub secret: RunSecret,
    /// The address to bind (port 0 picks a free one).
    pub listen: SocketAddr,
    /// The address agents dial; `None` means the bound address (useful only
    /// when that is reachable from the hosts, not for `0.0.0.0`).
    pub advertised: Option<SocketAddr>,
    /// How long a dropped agent may take to re-join before it is lost.
    pub rejoin_grace: Duration,
}

/// What the listener observed about one key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteEvent {
    /// The agent of `key` joined for the first time since [`RemoteSwarm::expect`].
    Joined(AttemptKey),
    /// The agent of `key` joined again (after a connection loss, or for an
    /// expectation marked adopted). No bootstrap fact should be reported.
    Rejoined(AttemptKey),
    /// The node of `key` is lost; the key is no longer expected.
    Lost(AttemptKey, LossCause),
}

/// The listener could not start.
#[derive(Debug, Error)]
pub enum RemoteError {
    /// Binding the listen address failed.
    #[error("cannot bind the swarm listener on {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug)]
struct Expectation {
    /// Whether a join has happened since `expect` (or the key was adopted).
    joined_once: bool,
    /// Whether an agent connection is open right now.
    connected: bool,
    /// Bumped on every connection; a grace timer of an older one is void.
    generation: u64,
}

type Callback = Arc<dyn Fn(RemoteEvent) + Send + Sync>;

struct Inner {
    run_id: RunId,
    secret: RunSecret,
    grace: Duration,
    table: Mutex<BTreeMap<AttemptKey, Expectation>>,
    changed: watch::Sender<u64>,
    on_event: Callback,
    shutdown: watch::Sender<bool>,
}

impl Inner {
    fn table(&self) -> MutexGuard<'_, BTreeMap<AttemptKey, Expectation>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn closing(&self) -> bool {
        *self.shutdown.borrow()
    }
}

/// The controller's swarm listener for remote agents. Dropping it stops
/// accepting and closes every connection (agents then re-dial for their
/// re-join window, so a restarted controller gets them back).
pub struct RemoteSwarm {
    inner: Arc<Inner>,
    local: SocketAddr,
    advertised: SocketAddr,
}

impl std::fmt::Debug for RemoteSwarm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteSwarm")
            .field("local", &self.local)
            .field("advertised", &self.advertised)
            .finish_non_exhaustive()
    }
}

impl RemoteSwarm {
    /// Binds the listener and starts accepting on the current tokio runtime.
    /// `on_event` is called from the listener's tasks, never under a lock.
    pub async fn bind(
        config: RemoteSwarmConfig,
        on_event: impl Fn(RemoteEvent) + Send + Sync + 'static,
    ) -> Result<Self, RemoteError> {
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| RemoteError::Bind {
                    address: config.listen,
                    source,
                })?;
        let local = listener.local_addr().map_err(|source| RemoteError::Bind {
            address: config.listen,
            source,
        })?;
        let advertised = match config.advertised {
            Some(mut advertised) => {
                if advertised.port() == 0 {
                    advertised.set_port(local.port());
                }
                advertised
            }
            None => local,
        };
        let inner = Arc::new(Inner {
            run_id: config.run_id,
            secret: config.secret,
            grace: config.rejoin_grace,
            table: Mutex::new(BTreeMap::new()),
            changed: watch::channel(0).0,
            on_event: Arc::new(on_event),
            shutdown: watch::channel(false).0,
        });
        tokio::spawn(accept_loop(inner.clone(), listener));
        Ok(RemoteSwarm {
            inner,
            local,
            advertised,
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The address agents must dial (put it in their
    /// [`JoinOrder::address`](crate::wire::JoinOrder::address)).
    pub fn advertised(&self) -> SocketAddr {
        self.advertised
    }

    /// The credential the agent of `key` must present.
    pub fn credential(&self, key: &AttemptKey) -> NodeCredential {
        self.inner.secret.credential(key)
    }

    /// Expects a first join of `key` (reported as [`RemoteEvent::Joined`]).
    /// Replaces any earlier expectation of the key.
    pub fn expect(&self, key: &AttemptKey) {
        self.insert(key, false);
    }

    /// Expects the agent of an adopted `key` (after a controller restart)
    /// to re-join; its join is reported as [`RemoteEvent::Rejoined`]. If it
    /// does not join within the re-join grace plus `wait`, it is lost.
    pub fn expect_adopted(&self, key: &AttemptKey, wait: Duration) {
        let generation = self.insert(key, true);
        tokio::spawn(grace_timer(
            self.inner.clone(),
            key.clone(),
            generation,
            wait,
        ));
    }

    fn insert(&self, key: &AttemptKey, joined_once: bool) -> u64 {
        let generation = {
            let mut table = self.inner.table();
            let generation = table.get(key).map_or(0, |e| e.generation + 1);
            table.insert(
                key.clone(),
                Expectation {
                    joined_once,
                    connected: false,
                    generation,
                },
            );
            generation
        };
        self.inner.bump();
        generation
    }

    /// Stops expecting `key`: its open connection is dropped and nothing
    /// more is reported about it. Absent is fine.
    pub fn forget(&self, key: &AttemptKey) {
        self.inner.table().remove(key);
        self.inner.bump();
    }

    /// Whether `key` is expected (first join, re-join, or connected now).
    pub fn is_expected(&self, key: &AttemptKey) -> bool {
        self.inner.table().contains_key(key)
    }

    /// Whether the agent of `key` is connected right now.
    pub fn is_connected(&self, key: &AttemptKey) -> bool {
        self.inner.table().get(key).is_some_and(|e| e.connected)
    }

    /// Waits until the agent of `key` is connected (`true`), the key is no
    /// longer expected (`false`), or `wait` passes (`false`).
    pub async fn wait_connected(&self, key: &AttemptKey, wait: Duration) -> bool {
        let mut changed = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        // Bounded by the deadline.
        loop {
            match self.inner.table().get(key) {
                None => return false,
                Some(entry) if entry.connected => return true,
                Some(_) => {}
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return false,
            }
        }
    }

    /// The keys currently expected, in order.
    pub fn expected(&self) -> Vec<AttemptKey> {
        self.inner.table().keys().cloned().collect()
    }
}

impl Drop for RemoteSwarm {
    fn drop(&mut self) {
        self.inner.shutdown.send_replace(true);
        self.inner.bump();
    }
}

async fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    let permits = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut shutdown = inner.shutdown.subscribe();
    // Bounded by the listener's life.
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|closing| *closing) => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "remote swarm listener cannot accept");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "too many swarm connections; refusing one");
            continue;
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            serve(inner, stream, peer).await;
            drop(permit);
        });
    }
}

fn check_hello(inner: &Inner, hello: &SwarmHello) -> Result<AttemptKey, String> {
    if hello.protocol != PROTOCOL_VERSION {
        return Err(format!("unsupported protocol version {}", hello.protocol));
    }
    if hello.run != inner.run_id.as_str() {
        return Err(format!(
            "this swarm belongs to another run than {:?}",
            hello.run
        ));
    }
    let node = LogicalNodeId::parse(&hello.node).map_err(|error| error.to_string())?;
    let key = AttemptKey {
        run_id: RunId::new(hello.run.as_str()),
        node,
        attempt: NodeAttemptId::from_raw(hello.attempt),
    };
    let credential = NodeCredential::from_hex(&hello.credential)
        .ok_or_else(|| "the credential is not 32 bytes of hex".to_owned())?;
    if !inner.secret.verify(&key, &credential) {
        return Err(format!("invalid credential for {key}"));
    }
    Ok(key)
}

/// Marks `key` connected; returns the event to report and the generation.
fn admit(inner: &Inner, key: &AttemptKey) -> Result<(RemoteEvent, u64), String> {
    let mut table = inner.table();
    let entry = table
        .get_mut(key)
        .ok_or_else(|| format!("{key} is not expected to join"))?;
    if entry.connected {
        return Err(format!("{key} is already connected"));
    }
    entry.connected = true;
    entry.generation += 1;
    let event = if entry.joined_once {
        RemoteEvent::Rejoined(key.clone())
    } else {
        RemoteEvent::Joined(key.clone())
    };
    entry.joined_once = true;
    Ok((event, entry.generation))
}

/// How long a member's connection may be silent before TCP probes it, how
/// often it probes, and how many unanswered probes end it: a host cut off
/// without a reset (a partition, a pulled cable) ends its connection within
/// about 11 s, and its node is lost after the re-join grace.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_PROBES: u32 = 3;

/// Turns TCP keepalive on for a member's connection (see
/// [`KEEPALIVE_IDLE`]). A socket that refuses it is still served; it then
/// only notices a reset or a close.
fn keep_alive(stream: &TcpStream, peer: SocketAddr) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    if let Err(error) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        tracing::warn!(%peer, %error, "cannot turn TCP keepalive on: a silent partition goes unnoticed");
    }
}

async fn serve(inner: Arc<Inner>, stream: TcpStream, peer: SocketAddr) {
    keep_alive(&stream, peer);
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let hello = match tokio::time::timeout(
        HELLO_WAIT_MAX,
        wire::read_message::<SwarmHello, _>(&mut reader),
    )
    .await
    {
        Ok(Ok(Some(hello))) => hello,
        Ok(Ok(None)) => return,
        Ok(Err(error)) => {
            return reject(&mut write, peer, format!("malformed hello: {error}")).await;
        }
        Err(_) => {
            return reject(
                &mut write,
                peer,
                format!("no hello within {HELLO_WAIT_MAX:?}"),
            )
            .await;
        }
    };
    let admitted =
        check_hello(&inner, &hello).and_then(|key| admit(&inner, &key).map(|a| (key, a)));
    let (key, (event, generation)) = match admitted {
        Ok(admitted) => admitted,
        Err(reason) => return reject(&mut write, peer, reason).await,
    };
    if wire::write_message(&mut write, &SwarmReply::Welcome)
        .await
        .is_err()
    {
        tracing::debug!(node = %key, "agent gone before its welcome");
    }
    inner.bump();
    tracing::info!(node = %key, %peer, "remote agent joined the swarm");
    (inner.on_event)(event);
    let cause = hold(&inner, &key, generation, &mut reader).await;
    let still_ours = {
        let mut table = inner.table();
        match table.get_mut(&key) {
            Some(entry) if entry.generation == generation => {
                entry.connected = false;
                true
            }
            _ => false,
        }
    };
    inner.bump();
    if !still_ours || inner.closing() {
        return;
    }
    match cause {
        LossCause::WorkloadExited => lose(&inner, &key, generation, cause),
        _ => {
            tokio::spawn(grace_timer(inner.clone(), key, generation, Duration::ZERO));
        }
    }
}

/// Reports `key` lost unless it re-joined or was forgotten meanwhile.
fn lose(inner: &Inner, key: &AttemptKey, generation: u64, cause: LossCause) {
    let lost = {
        let mut table = inner.table();
        match table.get(key) {
            Some(entry) if entry.generation == generation && !entry.connected => {
                table.remove(key);
                true
            }
            _ => false,
        }
    };
    if lost && !inner.closing() {
        inner.bump();
        tracing::info!(node = %key, %cause, "remote node lost");
        (inner.on_event)(RemoteEvent::Lost(key.clone(), cause));
    }
}

async fn grace_timer(inner: Arc<Inner>, key: AttemptKey, generation: u64, extra: Duration) {
    tokio::time::sleep(inner.grace + extra).await;
    lose(&inner, &key, generation, LossCause::AgentGone);
}

/// Holds a member's connection until it ends, the workload exits, the key
/// is forgotten or re-admitted elsewhere, or the listener shuts down.
async fn hold(
    inner: &Inner,
    key: &AttemptKey,
    generation: u64,
    reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
) -> LossCause {
    let mut changed = inner.changed.subscribe();
    let current = || {
        inner
            .table()
            .get(key)
            .is_some_and(|e| e.generation == generation)
            && !inner.closing()
    };
    let mut read = std::pin::pin!(wire::read_message::<SwarmNotice, _>(reader));
    // Bounded by the connection's life.
    loop {
        tokio::select! {
            message = &mut read => {
                return match message {
                    Ok(Some(SwarmNotice::WorkloadExited { code, signal })) => {
                        tracing::warn!(node = %key, ?code, ?signal, "remote workload exited");
                        LossCause::WorkloadExited
                    }
                    Ok(None) => LossCause::AgentGone,
                    Err(error) => {
                        tracing::warn!(node = %key, %error, "bad message on a swarm connection");
                        LossCause::AgentGone
                    }
                };
            }
            result = changed.changed() => {
                if result.is_err() || !current() {
                    return LossCause::AgentGone;
                }
            }
        }
    }
}

async fn reject(write: &mut tokio::net::tcp::OwnedWriteHalf, peer: SocketAddr, reason: String) {
    tracing::warn!(%peer, %reason, "remote swarm join rejected");
    let reply = SwarmReply::Rejected { reason };
    let _ = wire::write_message(write, &reply).await;
}
