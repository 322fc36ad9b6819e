//! What the plugin knows about the agent of each attempt, shared with its
//! swarm listener's callback: a join is reported as `Joined` only once the
//! attempt's bootstrap stages were reported (an instance's agent may dial
//! before `start_bootstrap` runs), and a loss the listener sees is a lost
//! node.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning_agent::remote::RemoteEvent;
use provisioning_provider::{AttemptKey, ObservationSink};

/// What the plugin knows about one attempt's agent.
#[derive(Debug, Default)]
pub(crate) struct AgentState {
    /// This plugin reported the bootstrap's stages: a join may be reported.
    pub(crate) announced: bool,
    /// The agent joined and was not lost since.
    pub(crate) joined: bool,
    /// `Joined` was reported.
    pub(crate) join_reported: bool,
    /// The task failing the bootstrap if the agent never joins.
    pub(crate) watchdog: Option<tokio::task::AbortHandle>,
}

/// The sink and the agents' states.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    sink: Mutex<Option<ObservationSink>>,
    agents: Mutex<BTreeMap<AttemptKey, AgentState>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub(crate) fn attach(&self, sink: ObservationSink) {
        *lock(&self.sink) = Some(sink);
    }

    pub(crate) fn agents(&self) -> MutexGuard<'_, BTreeMap<AttemptKey, AgentState>> {
        lock(&self.agents)
    }

    pub(crate) fn report(&self, key: &AttemptKey, event: BootstrapEvent) {
        tracing::debug!(node = %key, ?event, "bootstrap event");
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.bootstrap(key, event);
        }
    }

    pub(crate) fn report_lost(&self, key: &AttemptKey, cause: LossCause) {
        if let Some(sink) = lock(&self.sink).as_ref() {
            sink.lost(key, cause);
        }
    }

    /// Marks `key`'s bootstrap announced and reports a join that came first.
    pub(crate) fn announce(&self, key: &AttemptKey) {
        let join_now = {
            let mut agents = self.agents();
            let state = agents.entry(key.clone()).or_default();
            state.announced = true;
            let join_now = state.joined && !state.join_reported;
            state.join_reported |= join_now;
            join_now
        };
        if join_now {
            self.report(key, BootstrapEvent::Joined);
        }
    }

    pub(crate) fn is_announced(&self, key: &AttemptKey) -> bool {
        self.agents().get(key).is_some_and(|s| s.announced)
    }

    pub(crate) fn is_joined(&self, key: &AttemptKey) -> bool {
        self.agents().get(key).is_some_and(|s| s.joined)
    }

    /// Forgets `key` and stops its watchdog.
    pub(crate) fn forget(&self, key: &AttemptKey) {
        if let Some(state) = self.agents().remove(key)
            && let Some(watchdog) = state.watchdog
        {
            watchdog.abort();
        }
    }

    /// A new controller took over: nothing of an agent is reported until its
    /// adopting `start_bootstrap` announces it again.
    pub(crate) fn controller_replaced(&self) -> usize {
        let mut agents = self.agents();
        for state in agents.values_mut() {
            state.announced = false;
            state.join_reported = false;
        }
        agents.len()
    }

    /// The swarm listener's callback.
    pub(crate) fn on_event(&self, event: RemoteEvent) {
        if let RemoteEvent::Rejoined(key) = &event
            && let Some(sink) = lock(&self.sink).as_ref()
        {
            // Re-earns the readiness of a node recovered as ready (an
            // adopted instance's agent); changes nothing otherwise.
            sink.rejoined(key);
        }
        match event {
            RemoteEvent::Joined(key) | RemoteEvent::Rejoined(key) => {
                let join_now = {
                    let mut agents = self.agents();
                    let state = agents.entry(key.clone()).or_default();
                    state.joined = true;
                    let join_now = state.announced && !state.join_reported;
                    state.join_reported |= join_now;
                    join_now
                };
                if join_now {
                    self.report(&key, BootstrapEvent::Joined);
                }
            }
            RemoteEvent::Lost(key, cause) => {
                tracing::info!(node = %key, %cause, "agent lost");
                self.forget(&key);
                self.report_lost(&key, cause);
            }
        }
    }

    /// Stops every watchdog.
    pub(crate) fn close(&self) {
        for state in self.agents().values_mut() {
            if let Some(watchdog) = state.watchdog.take() {
                watchdog.abort();
            }
        }
    }
}
