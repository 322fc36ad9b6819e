//! The controller's swarm listener: where agents join the run's swarm with
//! their credentials. One mechanism for every provider; what a join means
//! is the caller's, through a [`SwarmGate`].
//!
//! The listener does what every provider needs alike: it accepts at most
//! [`SWARM_CONNECTIONS_MAX`] connections at once, waits [`HELLO_WAIT_MAX`]
//! for a [`SwarmHello`], and checks it — the protocol version, the run, the
//! node id, and that the credential is the one the run's [`RunSecret`]
//! derives for the exact `(run, node, attempt)` claimed. Only then does it
//! ask the gate to [admit](SwarmGate::admit) the agent. An admitted agent is
//! sent [`SwarmReply::Welcome`] and keeps its connection; the listener holds
//! it until the agent says its workload exited, the connection ends, or the
//! gate [withdraws](SwarmGate::withdrawn) the membership, and tells the gate
//! how it [ended](SwarmGate::ended). Anything refused is logged, answered
//! with [`SwarmReply::Rejected`] (whose reason never holds secret material),
//! and changes nothing. A member is sent the run's membership (the latest
//! line of [`ListenerSettings::peers`]) right after its welcome and again
//! whenever it changes: the peers push of design §22, over the connection
//! the agent already holds.
//!
//! Users: the process plugin (agents on this machine, over loopback) and
//! [`RemoteSwarm`](crate::remote::RemoteSwarm) (agents of remote providers).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use provisioning::observe::LossCause;
use provisioning::{LogicalNodeId, NodeAttemptId, RunId};
use provisioning_provider::AttemptKey;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use crate::codec::{CodecError, MessageReader, write_message};
use crate::credential::{NodeCredential, RunSecret};
use crate::peers::PeersSubscription;
use crate::wire::{PROTOCOL_VERSION, SwarmHello, SwarmNotice, SwarmReply};

/// How many swarm connections (joined or joining) may be open at once.
pub const SWARM_CONNECTIONS_MAX: usize = 4096;

/// How long a new connection may take to say hello.
pub const HELLO_WAIT_MAX: Duration = Duration::from_secs(5);

/// How long writing one membership to a member may take: an agent that
/// reads nothing for that long is gone.
const PEERS_WRITE_WAIT_MAX: Duration = Duration::from_secs(10);

/// The pause after a failed `accept` (for example out of file descriptors).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// How long a member's connection may be silent before TCP probes it, how
/// often it probes, and how many unanswered probes end it: a host cut off
/// without a reset (a partition, a pulled cable) ends its connection within
/// about 11 s.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_PROBES: u32 = 3;

/// How long a member's connection is silent before its unanswered probes
/// end it.
const KEEPALIVE_SILENCE: Duration = Duration::from_secs(
    KEEPALIVE_IDLE.as_secs() + KEEPALIVE_INTERVAL.as_secs() * KEEPALIVE_PROBES as u64,
);

/// What a provider decides about the agents that join its swarm. The
/// listener calls it from its connection tasks, never under a lock of its
/// own.
pub trait SwarmGate: Send + Sync + 'static {
    /// What the gate keeps for one admitted connection.
    type Member: Send + Sync + 'static;

    /// Admits the agent of `key` (its hello and credential already checked)
    /// or says why not; the reason is logged and sent to the agent.
    ///
    /// # Errors
    /// The reason the agent may not join now.
    fn admit(&self, key: &AttemptKey, hello: &SwarmHello) -> Result<Self::Member, String>;

    /// Whether the refusal [`admit`](SwarmGate::admit) just gave `key` is
    /// expected, so that it is logged at debug level instead of as a
    /// warning: for example the re-join of an agent whose node a restarted
    /// controller has not taken back yet. No by default.
    fn refusal_expected(&self, _key: &AttemptKey) -> bool {
        false
    }

    /// The agent of `member` was sent its welcome (or was gone before it).
    fn welcomed(&self, member: &Self::Member);

    /// Completes when the gate no longer wants `member`'s connection (the
    /// node was forgotten, its key joined again elsewhere, the provider
    /// shuts down); the listener then drops the connection.
    fn withdrawn(&self, member: &Self::Member) -> impl Future<Output = ()> + Send;

    /// The membership ended: `Some(cause)` when the agent's side ended it
    /// (its workload exited, its connection ended or misbehaved), `None`
    /// when the gate withdrew it. The listener logs a workload's end at
    /// debug level only: the gate knows whether it was a loss or a stop it
    /// ordered, and logs the loss.
    fn ended(&self, member: Self::Member, cause: Option<LossCause>);
}

/// How a listener checks joins and treats connections.
#[derive(Clone, Debug)]
pub struct ListenerSettings {
    /// The run whose agents may join.
    pub run_id: RunId,
    /// The run's secret; join credentials derive from it.
    pub secret: RunSecret,
    /// Whether members' connections get TCP keepalive probes (see
    /// `KEEPALIVE_IDLE`): worth it across a network, where a peer may
    /// vanish without a reset; pointless over loopback.
    pub keepalive: bool,
    /// The listener stops accepting once this turns `true`.
    pub shutdown: watch::Receiver<bool>,
    /// The run's membership, pushed to every member
    /// ([`PeersFeed::subscribe`](crate::peers::PeersFeed::subscribe)).
    pub peers: PeersSubscription,
}

/// Accepts swarm connections on `listener` until `settings.shutdown` turns
/// `true`, serving each in a task of its own. Spawn it.
pub async fn accept_joins<G: SwarmGate>(
    listener: TcpListener,
    gate: Arc<G>,
    settings: ListenerSettings,
) {
    let permits = Arc::new(Semaphore::new(SWARM_CONNECTIONS_MAX));
    let settings = Arc::new(settings);
    let mut shutdown = settings.shutdown.clone();
    // Bounded by the provider's life: its shutdown ends it.
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|closing| *closing) => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "swarm listener cannot accept");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "too many swarm connections; refusing one");
            continue;
        };
        let gate = gate.clone();
        let settings = settings.clone();
        tokio::spawn(async move {
            serve(&*gate, &settings, stream, peer).await;
            drop(permit);
        });
    }
}

/// Checks a hello against the run and its secret; returns the key it
/// proves. The reason of a refusal never holds secret material.
fn check_hello(settings: &ListenerSettings, hello: &SwarmHello) -> Result<AttemptKey, String> {
    if hello.protocol != PROTOCOL_VERSION {
        return Err(format!("unsupported protocol version {}", hello.protocol));
    }
    if hello.run != settings.run_id.as_str() {
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
    if !settings.secret.verify(&key, &credential) {
        return Err(format!("invalid credential for {key}"));
    }
    Ok(key)
}

/// Turns TCP keepalive on for a member's connection. A socket that refuses
/// it is still served; it then only notices a reset or a close.
fn keep_alive(stream: &TcpStream, peer: SocketAddr) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    let socket = socket2::SockRef::from(stream);
    if let Err(error) = socket.set_tcp_keepalive(&keepalive) {
        tracing::warn!(%peer, %error, "cannot turn TCP keepalive on: a silent partition goes unnoticed");
    }
    // Keepalive probes are only sent while nothing written waits for its
    // acknowledgement: a peers push written as the link went silent would
    // otherwise leave the connection to the kernel's retransmissions
    // (about 15 minutes). Unacknowledged data ends it after the same
    // silence instead.
    if let Err(error) = socket.set_tcp_user_timeout(Some(KEEPALIVE_SILENCE)) {
        tracing::warn!(%peer, %error, "cannot bound unacknowledged writes: a partition during a push may go unnoticed");
    }
}

async fn serve<G: SwarmGate>(
    gate: &G,
    settings: &ListenerSettings,
    stream: TcpStream,
    peer: SocketAddr,
) {
    if settings.keepalive {
        keep_alive(&stream, peer);
    }
    let (read, mut write) = stream.into_split();
    let mut hellos = MessageReader::<SwarmHello, _>::new(read);
    let hello = match tokio::time::timeout(HELLO_WAIT_MAX, hellos.next()).await {
        Ok(Ok(Some(hello))) => hello,
        Ok(Ok(None)) => {
            tracing::debug!(%peer, "swarm connection closed before its hello");
            return;
        }
        Ok(Err(error)) => {
            let reason = format!("malformed hello: {error}");
            return reject(&mut write, peer, None, reason, false).await;
        }
        Err(_) => {
            let reason = format!("no hello within {HELLO_WAIT_MAX:?}");
            return reject(&mut write, peer, None, reason, false).await;
        }
    };
    let key = match check_hello(settings, &hello) {
        Ok(key) => key,
        Err(reason) => return reject(&mut write, peer, Some(&hello), reason, false).await,
    };
    let member = match gate.admit(&key, &hello) {
        Ok(member) => member,
        Err(reason) => {
            let expected = gate.refusal_expected(&key);
            return reject(&mut write, peer, Some(&hello), reason, expected).await;
        }
    };
    if let Err(error) = write_message(&mut write, &SwarmReply::Welcome).await {
        tracing::debug!(node = %key, %error, "agent gone before its welcome");
    }
    tracing::info!(node = %key, %peer, "agent joined the swarm");
    gate.welcomed(&member);
    // Only notices follow a hello; the reader keeps anything already
    // received after it.
    let mut notices = hellos.retyped::<SwarmNotice>();
    let mut peers = settings.peers.clone();
    // The member learns the membership as it is now, then every change.
    peers.mark_changed();
    let cause = {
        let withdrawn = gate.withdrawn(&member);
        tokio::pin!(withdrawn);
        let mut peers_open = true;
        // Bounded by the membership's life: every arm but a membership
        // change ends it, and those come one per change of the run.
        loop {
            tokio::select! {
                () = &mut withdrawn => break None,
                message = notices.next() => break Some(member_ended(&key, message)),
                changed = peers.changed(), if peers_open => {
                    if changed.is_err() {
                        peers_open = false;
                        continue;
                    }
                    let line = peers
                        .borrow_and_update()
                        .as_ref()
                        .map(|published| published.line.clone());
                    let Some(line) = line.filter(|line| !line.is_empty()) else {
                        continue;
                    };
                    let written = tokio::time::timeout(PEERS_WRITE_WAIT_MAX, write.write_all(&line)).await;
                    if let Err(error) = written.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())) {
                        // Whether that is a loss is the gate's to say (an
                        // agent stopped as ordered goes away too), and it
                        // logs what it decides.
                        tracing::debug!(node = %key, %error, "connection lost sending the peers");
                        break Some(LossCause::AgentGone);
                    }
                }
            }
        }
    };
    gate.ended(member, cause);
}

/// What ended a membership, from the member's side: the notice its
/// connection carried, or how the connection ended.
fn member_ended(key: &AttemptKey, message: Result<Option<SwarmNotice>, CodecError>) -> LossCause {
    match message {
        Ok(Some(SwarmNotice::WorkloadExited { code, signal })) => {
            // The node no longer does its work. Whether that is a loss
            // is the gate's to say (a stop the controller ordered ends
            // the workload too), so it logs what it decides.
            let cause = LossCause::workload(code, signal);
            tracing::debug!(node = %key, %cause, "the agent says its workload ended");
            cause
        }
        Ok(None) => {
            tracing::debug!(node = %key, "swarm connection closed");
            LossCause::AgentGone
        }
        Err(CodecError::Io(error)) if error.kind() == std::io::ErrorKind::TimedOut => {
            tracing::warn!(
                "no message from {}'s agent (attempt {}) for {} s; connection timed out",
                key.node,
                key.attempt.get(),
                KEEPALIVE_SILENCE.as_secs(),
            );
            LossCause::AgentGone
        }
        Err(CodecError::Io(error))
            if matches!(
                error.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ) =>
        {
            // An agent that exits with a peers push it did not read resets
            // its connection instead of closing it: the same end as a
            // close, whose meaning (a loss, or a stop the controller
            // ordered) the gate decides and logs.
            tracing::debug!(node = %key, %error, "swarm connection reset");
            LossCause::AgentGone
        }
        Err(CodecError::Io(error)) => {
            tracing::warn!(
                "lost the connection to {}'s agent (attempt {}): {error}",
                key.node,
                key.attempt.get(),
            );
            LossCause::AgentGone
        }
        Err(error) => {
            tracing::warn!(node = %key, %error, "bad message on the swarm connection; dropping it");
            LossCause::AgentGone
        }
    }
}

/// Refuses a join: logs why (as a warning, or at debug level when the
/// gate expected it) and tells the peer.
async fn reject(
    write: &mut OwnedWriteHalf,
    peer: SocketAddr,
    hello: Option<&SwarmHello>,
    reason: String,
    expected: bool,
) {
    let run = hello.map(|h| h.run.as_str());
    let node = hello.map(|h| h.node.as_str());
    let attempt = hello.map(|h| h.attempt);
    if expected {
        tracing::debug!(%peer, run, node, attempt, %reason, "swarm join refused for now");
    } else {
        tracing::warn!(%peer, run, node, attempt, %reason, "swarm join rejected");
    }
    let reply = SwarmReply::Rejected { reason };
    if let Err(error) = write_message(write, &reply).await {
        tracing::debug!(%peer, %error, "cannot tell the peer it was rejected");
    }
}
