//! The swarm of remote providers (SSH, Slurm, …): the controller's
//! [`swarm`](crate::swarm) listener with a gate that tracks which keys may
//! join and for how long a dropped agent may come back.
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
//! - a hello is accepted only when the listener checked its credential
//!   against the run's [`RunSecret`] and the key is expected and not
//!   connected right now;
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
use provisioning::{GroupId, Membership, RunId};
use provisioning_provider::AttemptKey;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::credential::{NodeCredential, RunSecret};
use crate::peers::PeersFeed;
use crate::swarm::{ListenerSettings, SwarmGate, accept_joins};
use crate::wire::SwarmHello;

/// The default time an agent whose connection ended has to re-join before
/// its node counts as lost.
pub const DEFAULT_REJOIN_GRACE: Duration = Duration::from_secs(3);

/// How long after the listener starts a join of a key nobody expects yet is
/// refused quietly (logged at debug level): agents of a crashed controller
/// re-dial a restarted one for their re-join window, and are refused until
/// the provider's listing has taken their nodes back
/// ([`RemoteSwarm::expect_adopted`]) — expected, not a warning.
pub const RECOVERY_JOIN_QUIET_MAX: Duration = crate::agent::remote::DEFAULT_REJOIN_WINDOW;

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
    /// When the listener started (see [`RECOVERY_JOIN_QUIET_MAX`]).
    started: std::time::Instant,
    secret: RunSecret,
    grace: Duration,
    table: Mutex<BTreeMap<AttemptKey, Expectation>>,
    changed: watch::Sender<u64>,
    on_event: Callback,
    shutdown: watch::Sender<bool>,
    /// The run's membership, pushed to every member.
    peers: PeersFeed,
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

/// A listening socket on `address` (`SO_REUSEADDR`, as tokio's own bind);
/// with `nonlocal`, one that binds an address this machine does not have
/// yet (`IP_FREEBIND`).
fn listen(address: SocketAddr, nonlocal: bool) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(address),
        Type::STREAM,
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if nonlocal {
        match address {
            SocketAddr::V4(_) => socket.set_freebind_v4(true)?,
            SocketAddr::V6(_) => socket.set_freebind_v6(true)?,
        }
    }
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

impl RemoteSwarm {
    /// Binds the listener and starts accepting on the current tokio runtime.
    /// `on_event` is called from the listener's tasks, never under a lock.
    pub async fn bind(
        config: RemoteSwarmConfig,
        on_event: impl Fn(RemoteEvent) + Send + Sync + 'static,
    ) -> Result<Self, RemoteError> {
        Self::start(config, false, on_event)
    }

    /// As [`RemoteSwarm::bind`], but binds the address even when it is not
    /// (yet) an address of this machine (Linux `IP_FREEBIND`): for an
    /// address that appears later, such as the gateway of a container
    /// network whose bridge the engine makes when its first container
    /// starts. Connections to it are accepted once it is there.
    pub async fn bind_nonlocal(
        config: RemoteSwarmConfig,
        on_event: impl Fn(RemoteEvent) + Send + Sync + 'static,
    ) -> Result<Self, RemoteError> {
        Self::start(config, true, on_event)
    }

    fn start(
        config: RemoteSwarmConfig,
        nonlocal: bool,
        on_event: impl Fn(RemoteEvent) + Send + Sync + 'static,
    ) -> Result<Self, RemoteError> {
        let listener = listen(config.listen, nonlocal).map_err(|source| RemoteError::Bind {
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
            started: std::time::Instant::now(),
            secret: config.secret.clone(),
            grace: config.rejoin_grace,
            table: Mutex::new(BTreeMap::new()),
            changed: watch::channel(0).0,
            on_event: Arc::new(on_event),
            shutdown: watch::channel(false).0,
            peers: PeersFeed::new(),
        });
        let settings = ListenerSettings {
            run_id: config.run_id,
            secret: config.secret,
            keepalive: true,
            shutdown: inner.shutdown.subscribe(),
            peers: inner.peers.subscribe(),
        };
        tokio::spawn(accept_joins(
            listener,
            Arc::new(Gate(inner.clone())),
            settings,
        ));
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

    /// Pushes the run's `membership` to every connected agent (and to every
    /// agent that joins later), unless a newer one was pushed already.
    pub fn publish_peers(&self, membership: &Arc<Membership>) {
        self.inner.peers.publish(membership);
    }

    /// The desired size of `group` in the latest membership pushed.
    pub fn group_size(&self, group: &GroupId) -> Option<u32> {
        self.inner.peers.group_size(group)
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

/// The listener's view of a [`RemoteSwarm`]: its expectations decide who
/// may join, and a connection's end starts the re-join grace.
struct Gate(Arc<Inner>);

/// One admitted connection of the remote swarm.
struct Member {
    key: AttemptKey,
    /// The expectation's generation this connection holds.
    generation: u64,
    /// Whether the key had joined before (a re-join, or an adopted key).
    rejoin: bool,
}

impl Gate {
    /// Whether `member` still holds its key's expectation.
    fn current(&self, member: &Member) -> bool {
        let inner = &self.0;
        let held = inner
            .table()
            .get(&member.key)
            .is_some_and(|e| e.generation == member.generation);
        held && !inner.closing()
    }
}

impl SwarmGate for Gate {
    type Member = Member;

    /// Marks `key` connected.
    fn admit(&self, key: &AttemptKey, _hello: &SwarmHello) -> Result<Member, String> {
        let mut table = self.0.table();
        let entry = table
            .get_mut(key)
            .ok_or_else(|| format!("{key} is not expected to join"))?;
        if entry.connected {
            return Err(format!("{key} is already connected"));
        }
        entry.connected = true;
        entry.generation += 1;
        let rejoin = entry.joined_once;
        entry.joined_once = true;
        Ok(Member {
            key: key.clone(),
            generation: entry.generation,
            rejoin,
        })
    }

    /// A key nobody expects, shortly after the listener started, is most
    /// likely the agent of a node the controller is still recovering.
    fn refusal_expected(&self, key: &AttemptKey) -> bool {
        let inner = &self.0;
        inner.started.elapsed() < RECOVERY_JOIN_QUIET_MAX && !inner.table().contains_key(key)
    }

    fn welcomed(&self, member: &Member) {
        self.0.bump();
        let event = if member.rejoin {
            RemoteEvent::Rejoined(member.key.clone())
        } else {
            RemoteEvent::Joined(member.key.clone())
        };
        (self.0.on_event)(event);
    }

    /// Completes once the key is forgotten, re-admitted on another
    /// connection, or the listener shuts down.
    async fn withdrawn(&self, member: &Member) {
        let mut changed = self.0.changed.subscribe();
        // Bounded by the connection's life: the listener drops this future
        // when the connection ends.
        loop {
            if !self.current(member) {
                return;
            }
            if changed.changed().await.is_err() {
                return;
            }
        }
    }

    fn ended(&self, member: Member, cause: Option<LossCause>) {
        let inner = &self.0;
        let Member {
            key, generation, ..
        } = member;
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
            Some(cause) if cause.is_workload_exit() => lose(inner, &key, generation, cause),
            _ => {
                tokio::spawn(grace_timer(inner.clone(), key, generation, Duration::ZERO));
            }
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
        tracing::warn!(
            "node {} (attempt {}) lost: {cause}",
            key.node,
            key.attempt.get()
        );
        (inner.on_event)(RemoteEvent::Lost(key.clone(), cause));
    }
}

async fn grace_timer(inner: Arc<Inner>, key: AttemptKey, generation: u64, extra: Duration) {
    tokio::time::sleep(inner.grace + extra).await;
    lose(&inner, &key, generation, LossCause::AgentGone);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 192.0.2.1 (TEST-NET-1, RFC 5737) is never an address of this
    /// machine; nothing is sent to it, it is only bound.
    #[tokio::test]
    async fn an_absent_address_binds_only_when_nonlocal_is_asked_for() {
        let absent = SocketAddr::from(([192, 0, 2, 1], 0));
        let refused = listen(absent, false).expect_err("192.0.2.1 is not here");
        assert_eq!(refused.kind(), std::io::ErrorKind::AddrNotAvailable);
        let bound = listen(absent, true).expect("IP_FREEBIND binds it");
        assert_eq!(bound.local_addr().expect("address").ip(), absent.ip());
        let here = SocketAddr::from(([127, 0, 0, 1], 0));
        for nonlocal in [false, true] {
            let listener = listen(here, nonlocal).expect("loopback binds");
            let address = listener.local_addr().expect("address");
            let (accepted, dialed) =
                tokio::join!(listener.accept(), tokio::net::TcpStream::connect(address));
            accepted.expect("a connection is accepted");
            dialed.expect("loopback dials");
        }
    }
}
