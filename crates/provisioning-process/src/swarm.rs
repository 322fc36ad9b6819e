//! The process plugin's gate on the run's swarm listener
//! ([`provisioning_agent::swarm`]): which agents may join, and what their
//! end means.
//!
//! The listener checks that a join's credential is the one derived for the
//! exact `(run, node, attempt)` the agent claims; this gate admits it only
//! when a bootstrap session of that key is waiting for the join, reports the
//! join, and reports the node lost when the connection ends while the node
//! is supposed to run.

use std::sync::Arc;

use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning_agent::swarm::{ListenerSettings, SwarmGate, accept_joins};
use provisioning_agent::wire::SwarmHello;
use provisioning_provider::AttemptKey;
use tokio::net::TcpListener;

use crate::state::{Life, SessionState, Shared};

/// Accepts swarm connections until the plugin shuts down.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let settings = ListenerSettings {
        run_id: shared.run_id.clone(),
        secret: shared.secret.clone(),
        // Agents are on this machine: a vanished one resets its connection.
        keepalive: false,
        shutdown: shared.shutdown.subscribe(),
        peers: shared.peers.subscribe(),
    };
    accept_joins(listener, Arc::new(Gate(shared)), settings).await;
}

/// The plugin's state, seen as the swarm's gate.
struct Gate(Arc<Shared>);

impl SwarmGate for Gate {
    /// A member is known by its key.
    type Member = AttemptKey;

    /// Admits the agent of `key` into the swarm if its session waits for
    /// it, and reports the join. The join of a quiet re-attach (an agent a
    /// restarted controller adopted) is reported as a re-join instead: it
    /// is what re-earns the readiness of a node recovered as ready.
    fn admit(&self, key: &AttemptKey, hello: &SwarmHello) -> Result<AttemptKey, String> {
        let reattach = admit(&self.0, key, &hello.swarm)?;
        if reattach {
            self.0.report_rejoined(key);
        } else {
            self.0.report(key, BootstrapEvent::Joined);
        }
        Ok(key.clone())
    }

    fn welcomed(&self, _key: &AttemptKey) {}

    /// Only the plugin's shutdown withdraws a membership (and loses
    /// nothing); a destroyed node's agent ends its connection itself.
    async fn withdrawn(&self, _key: &AttemptKey) {
        let mut shutdown = self.0.shutdown.subscribe();
        let _ = shutdown.wait_for(|closing| *closing).await;
    }

    /// A membership that ends while its node is meant to run is the loss
    /// of the node, logged as a warning. One that ends while the node is
    /// being destroyed (or the plugin shuts down) is the stop the
    /// controller ordered: its workload's end is expected, and logged at
    /// debug level only.
    fn ended(&self, key: AttemptKey, cause: Option<LossCause>) {
        let shared = &self.0;
        let Some(cause) = cause else {
            return;
        };
        if shared.is_running(&key) && !shared.is_closing() {
            tracing::warn!(
                "node {} (attempt {}) lost: {cause}",
                key.node,
                key.attempt.get()
            );
            shared.report_lost(&key, cause);
        } else {
            tracing::debug!(node = %key, %cause, "node stopped as ordered");
        }
    }
}

/// Marks the session of `key` joined if it waits for the join of `swarm`;
/// returns whether that session is a quiet re-attach.
fn admit(shared: &Shared, key: &AttemptKey, swarm: &str) -> Result<bool, String> {
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
            Ok(session.quiet)
        }
        SessionState::Joined | SessionState::Closed => Err(format!("{key} already joined")),
        other => Err(format!(
            "the bootstrap of {key} does not expect a join ({other:?})"
        )),
    }
}
