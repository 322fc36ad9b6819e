//! The run's swarm listener: where agents join with their credentials.
//!
//! A join is accepted only when the credential is the one derived for the
//! exact `(run, node, attempt)` the agent claims, and a bootstrap session of
//! that key is waiting for the join. Anything else is rejected, logged, and
//! changes nothing. A welcomed agent keeps its connection open; when the
//! connection ends while the node is supposed to run, the node is lost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::{LogicalNodeId, NodeAttemptId, RunId};
use provisioning_provider::AttemptKey;
use tokio::io::BufReader;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::credential::NodeCredential;
use crate::state::{Life, SessionState, Shared};
use crate::wire::{self, PROTOCOL_VERSION, SwarmHello, SwarmNotice, SwarmReply};

/// How many swarm connections (joined or joining) may be open at once.
const SWARM_CONNECTIONS_MAX: usize = 4096;

/// How long a new connection may take to say hello.
const HELLO_WAIT_MAX: Duration = Duration::from_secs(5);

/// The pause after a failed `accept` (for example out of file descriptors).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Accepts swarm connections until the plugin shuts down.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let permits = Arc::new(Semaphore::new(SWARM_CONNECTIONS_MAX));
    let mut shutdown = shared.shutdown.subscribe();
    // Bounded by the plugin's life: shutdown and drop end it.
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
        let shared = shared.clone();
        tokio::spawn(async move {
            serve(shared, stream, peer).await;
            drop(permit);
        });
    }
}

/// Why a hello was rejected. Logged in full; the peer sees the same text,
/// which never contains secret material.
fn check_hello(shared: &Shared, hello: &SwarmHello) -> Result<AttemptKey, String> {
    if hello.protocol != PROTOCOL_VERSION {
        return Err(format!("unsupported protocol version {}", hello.protocol));
    }
    if hello.run != shared.run_id.as_str() {
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
    if !shared.secret.verify(&key, &credential) {
        return Err(format!("invalid credential for {key}"));
    }
    Ok(key)
}

/// Admits the agent of `key` into the swarm if its session waits for it.
fn admit(shared: &Shared, key: &AttemptKey, swarm: &str) -> Result<(), String> {
    let mut table = shared.table();
    let entry = table
        .get_mut(key)
        .ok_or_else(|| format!("no node process for {key}"))?;
    if entry.life != Life::Running {
        return Err(format!("the node of {key} is being destroyed"));
    }
    let session = entry
        .session
        .as_mut()
        .ok_or_else(|| format!("no bootstrap session for {key}"))?;
    // A re-attach accepts the swarm of the agent's first boot.
    if let Some(expected) = &session.swarm
        && expected != swarm
    {
        return Err(format!(
            "{key} belongs to swarm {expected:?}, not {swarm:?}"
        ));
    }
    match session.state {
        SessionState::AwaitingJoin => {
            session.state = SessionState::Joined;
            Ok(())
        }
        SessionState::Joined | SessionState::Closed => Err(format!("{key} already joined")),
        other => Err(format!(
            "the bootstrap of {key} does not expect a join ({other:?})"
        )),
    }
}

async fn serve(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let hello = match tokio::time::timeout(
        HELLO_WAIT_MAX,
        wire::read_message::<SwarmHello, _>(&mut reader),
    )
    .await
    {
        Ok(Ok(Some(hello))) => hello,
        Ok(Ok(None)) => {
            tracing::debug!(%peer, "swarm connection closed before its hello");
            return;
        }
        Ok(Err(error)) => {
            return reject(&mut write, peer, None, format!("malformed hello: {error}")).await;
        }
        Err(_) => {
            return reject(
                &mut write,
                peer,
                None,
                format!("no hello within {HELLO_WAIT_MAX:?}"),
            )
            .await;
        }
    };
    let key = match check_hello(&shared, &hello)
        .and_then(|key| admit(&shared, &key, &hello.swarm).map(|()| key))
    {
        Ok(key) => key,
        Err(reason) => return reject(&mut write, peer, Some(&hello), reason).await,
    };
    tracing::info!(node = %key, %peer, "agent joined the swarm");
    shared.report(&key, BootstrapEvent::Joined);
    if let Err(error) = wire::write_message(&mut write, &SwarmReply::Welcome).await {
        tracing::debug!(node = %key, %error, "agent gone before its welcome");
    }
    let cause = hold(&shared, &key, &mut reader).await;
    if let Some(cause) = cause
        && shared.is_running(&key)
        && !shared.is_closing()
    {
        shared.report_lost(&key, cause);
    }
}

/// Keeps a member's connection until it ends, its workload exits (or the
/// plugin shuts down, which loses nothing). Returns what the node lost.
async fn hold(
    shared: &Shared,
    key: &AttemptKey,
    reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
) -> Option<LossCause> {
    let mut shutdown = shared.shutdown.subscribe();
    let message = tokio::select! {
        _ = shutdown.wait_for(|closing| *closing) => return None,
        message = wire::read_message::<SwarmNotice, _>(reader) => message,
    };
    match message {
        Ok(Some(SwarmNotice::WorkloadExited { code, signal })) => {
            // The node no longer does its work: lost, and replaced. A
            // workload that exits at once every time (a typo in its start
            // command) trips the group's breaker this way.
            tracing::warn!(node = %key, ?code, ?signal, "workload exited; the node is lost");
            Some(LossCause::WorkloadExited)
        }
        Ok(None) => {
            tracing::debug!(node = %key, "swarm connection closed");
            Some(LossCause::AgentGone)
        }
        Err(error) => {
            tracing::warn!(node = %key, %error, "bad message on the swarm connection; dropping it");
            Some(LossCause::AgentGone)
        }
    }
}

async fn reject(
    write: &mut tokio::net::tcp::OwnedWriteHalf,
    peer: SocketAddr,
    hello: Option<&SwarmHello>,
    reason: String,
) {
    tracing::warn!(
        %peer,
        run = hello.map(|h| h.run.as_str()),
        node = hello.map(|h| h.node.as_str()),
        attempt = hello.map(|h| h.attempt),
        %reason,
        "swarm join rejected"
    );
    let reply = SwarmReply::Rejected { reason };
    if let Err(error) = wire::write_message(write, &reply).await {
        tracing::debug!(%peer, %error, "cannot tell the peer it was rejected");
    }
}
