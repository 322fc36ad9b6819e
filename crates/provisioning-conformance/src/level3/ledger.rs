//! The session and owner ledger of a Level 3 substrate: what the plugin
//! answered and reported, folded into one view per resource key.
//!
//! The ledger never looks at the provider. It knows what the plugin said —
//! start answers, lease answers, facts through the sink — which is what
//! the harness needs to pick live sessions for stream events, to tell when
//! a session has nothing more to wait for, and to name the owner of a
//! handle. Live resources themselves are counted by the substrate from the
//! real world (`/proc`, `squeue`, claims on hosts), never from here.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::effect::{EffectRequest, SessionHandle};
use provisioning::observe::BootstrapEvent;
use provisioning::state::{BootstrapFailure, BootstrapProgress};
use provisioning::{EffectError, EffectOutput, LeaseHandle, Observation, Operation};

use crate::substrate::{ResourceKey, SubstrateCounters};

/// What a session handle names, which decides how a start answered with the
/// handle of a session that already ended is folded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionHandles {
    /// Every start gets a handle of its own: a start answered with the handle
    /// of an ended session adopted something that is over, so the new
    /// session is ended at once (the process and SSH plugins).
    PerStart,
    /// The handle names the attempt's session (a Slurm job step), not one
    /// start: an ended handle handed out again says nothing about the new
    /// session.
    PerAttempt,
}

/// Who owns a lease handle that was issued more than once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseOwners {
    /// A handle may be reissued for another key (a reused pid names a new
    /// agent): once two keys held it, its owner is not known for sure.
    UniqueOnly,
    /// A handle names one place for good: the key it was issued for last
    /// owns it.
    Latest,
}

/// How a [`Ledger`] folds answers whose meaning depends on the plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LedgerPolicy {
    /// What a session handle names.
    pub session_handles: SessionHandles,
    /// Who owns a reissued lease handle.
    pub lease_owners: LeaseOwners,
}

/// The substrate's view of one bootstrap session, from the plugin's replies
/// and the facts it reported. `X` is what a substrate tracks beyond that
/// (a boot gate, a note that the fair tail waited for it).
#[derive(Clone, Debug, Default)]
pub struct SessionTrack<X = ()> {
    /// The handle the plugin answered the start with, once it answered.
    pub handle: Option<SessionHandle>,
    /// The plugin answered the start with a session (the agent took it).
    pub accepted: bool,
    /// The agent reported that it runs its verify commands.
    pub boot_checking: bool,
    /// The agent joined the swarm.
    pub joined: bool,
    /// Nothing more will happen to the session (closed, failed, cancelled,
    /// or its node is gone).
    pub ended: bool,
    /// The stage at which the plugin reported it failed, if it did.
    pub failure: Option<BootstrapFailure>,
    /// The substrate's own part.
    pub extra: X,
}

impl<X> SessionTrack<X> {
    /// Whether the session still runs, as far as the plugin told.
    pub fn is_live(&self) -> bool {
        !self.ended
    }
}

/// Sessions, losses and handle owners by resource key. See the module docs.
#[derive(Clone, Debug)]
pub struct Ledger<X = ()> {
    policy: LedgerPolicy,
    sessions: BTreeMap<ResourceKey, SessionTrack<X>>,
    /// Handles of sessions that ended ([`SessionHandles::PerStart`] only).
    ended_handles: BTreeSet<SessionHandle>,
    losses: BTreeSet<ResourceKey>,
    lease_owners: BTreeMap<LeaseHandle, BTreeSet<ResourceKey>>,
    session_owners: BTreeMap<SessionHandle, ResourceKey>,
}

impl<X: Default> Ledger<X> {
    /// An empty ledger folding answers by `policy`.
    pub fn new(policy: LedgerPolicy) -> Self {
        Ledger {
            policy,
            sessions: BTreeMap::new(),
            ended_handles: BTreeSet::new(),
            losses: BTreeSet::new(),
            lease_owners: BTreeMap::new(),
            session_owners: BTreeMap::new(),
        }
    }

    /// Every tracked session, in key order.
    pub fn sessions(&self) -> &BTreeMap<ResourceKey, SessionTrack<X>> {
        &self.sessions
    }

    /// Every tracked session, mutable, in key order (for the substrate's own
    /// part; the plugin's part is the ledger's to fold).
    pub fn sessions_mut(&mut self) -> impl Iterator<Item = (&ResourceKey, &mut SessionTrack<X>)> {
        self.sessions.iter_mut()
    }

    /// The session of `key`, tracked from now on if it was not.
    pub fn track_mut(&mut self, key: &ResourceKey) -> &mut SessionTrack<X> {
        self.sessions.entry(key.clone()).or_default()
    }

    /// Marks the session of `key` ended, remembering its handle when
    /// handles are per start.
    fn end_session(&mut self, key: &ResourceKey) {
        if let Some(track) = self.sessions.get_mut(key) {
            track.ended = true;
            if self.policy.session_handles == SessionHandles::PerStart
                && let Some(handle) = &track.handle
            {
                self.ended_handles.insert(handle.clone());
            }
        }
    }

    /// The live sessions the plugin answered for (a trace's stream events
    /// pick among these), in key order.
    pub fn live_sessions(&self) -> Vec<ResourceKey> {
        self.sessions
            .iter()
            .filter(|(_, track)| track.is_live() && track.accepted)
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Whether the plugin reported that the agent of `key` joined.
    pub fn joined(&self, key: &ResourceKey) -> bool {
        self.sessions.get(key).is_some_and(|track| track.joined)
    }

    /// Whether the plugin reported the loss of `key`.
    pub fn lost(&self, key: &ResourceKey) -> bool {
        self.losses.contains(key)
    }

    /// Whether the session of `key` has nothing more to wait for.
    pub fn session_settled(&self, key: &ResourceKey) -> bool {
        self.sessions
            .get(key)
            .is_none_or(|track| track.ended || track.joined)
    }

    /// Notes that a start call for `key` begins: its session may exist from
    /// now on. After an ended session the plugin may start a new one.
    pub fn session_starting(&mut self, key: &ResourceKey) {
        let track = self.track_mut(key);
        if track.ended {
            *track = SessionTrack::default();
        }
    }

    /// The key a lease was issued for, when exactly one key holds it.
    pub fn lease_owner(&self, lease: &LeaseHandle) -> Option<ResourceKey> {
        let owners = self.lease_owners.get(lease)?;
        (owners.len() == 1)
            .then(|| owners.first().cloned())
            .flatten()
    }

    /// The key a session was issued for.
    pub fn session_owner(&self, session: &SessionHandle) -> Option<ResourceKey> {
        self.session_owners.get(session).cloned()
    }

    /// Folds a fact the plugin reported through its sink.
    pub fn observe(&mut self, observation: &Observation) {
        let key = (observation.node().clone(), observation.attempt());
        match observation {
            Observation::Bootstrap { event, .. } => match event {
                BootstrapEvent::Progress(BootstrapProgress::BootChecking) => {
                    self.track_mut(&key).boot_checking = true;
                }
                BootstrapEvent::Joined => self.track_mut(&key).joined = true,
                BootstrapEvent::Closed => {
                    self.track_mut(&key);
                    self.end_session(&key);
                }
                BootstrapEvent::Failed { failure, .. } => {
                    self.track_mut(&key).failure = Some(*failure);
                    self.end_session(&key);
                }
                BootstrapEvent::Progress(_) | BootstrapEvent::Converged => {}
            },
            Observation::NodeLost { .. } => {
                self.end_session(&key);
                self.losses.insert(key);
            }
            // An agent that re-joined a restarted controller: its session
            // and lease stay as they were.
            Observation::AgentRejoined { .. } => {}
        }
    }

    /// Folds what a backend call answered: lease and session owners, the
    /// session tracker, and the creation and adoption counts.
    pub fn answered(
        &mut self,
        operation: &Operation,
        outcome: &Result<EffectOutput, EffectError>,
        counters: &mut SubstrateCounters,
    ) {
        let key = (operation.node.clone(), operation.attempt());
        match outcome {
            Ok(EffectOutput::LeaseCreated { lease, adopted, .. }) => {
                let owners = self.lease_owners.entry(lease.clone()).or_default();
                if self.policy.lease_owners == LeaseOwners::Latest {
                    owners.clear();
                }
                owners.insert(key);
                count_creation(counters, *adopted);
            }
            Ok(EffectOutput::BootstrapStarted { session, adopted }) => {
                self.session_owners.insert(session.clone(), key.clone());
                let over = self.ended_handles.contains(session);
                let track = self.track_mut(&key);
                track.handle = Some(session.clone());
                track.accepted = true;
                // A session that ended before this answer was folded, or an
                // ended one the plugin hands out again, stays ended.
                if over || track.ended {
                    self.end_session(&key);
                }
                count_creation(counters, *adopted);
            }
            Ok(EffectOutput::BootstrapCancelled | EffectOutput::LeaseDestroyed) => {
                self.end_session(&key);
            }
            // A definite start failure left no session behind.
            Err(error)
                if !error.is_ambiguous()
                    && matches!(operation.request, EffectRequest::StartBootstrap { .. })
                    && self.sessions.get(&key).is_some_and(|t| !t.accepted) =>
            {
                self.end_session(&key);
            }
            _ => {}
        }
    }
}

fn count_creation(counters: &mut SubstrateCounters, adopted: bool) {
    if adopted {
        counters.adoptions += 1;
    } else {
        counters.creations += 1;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use provisioning::id::OperationSequence;
    use provisioning::observe::LossCause;
    use provisioning::{
        EffectRequest, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate,
        OperationId, RunId,
    };

    use super::*;

    fn key() -> ResourceKey {
        (
            LogicalNodeId::new(GroupId::new("a"), 0),
            NodeAttemptId::from_raw(1),
        )
    }

    fn operation(sequence: u32, request: EffectRequest) -> Operation {
        let (node, attempt) = key();
        let template = NodeTemplate {
            role: "r".into(),
            provider: "fake".into(),
            shape: Default::default(),
            boot: Default::default(),
            swarm_join: Default::default(),
        };
        Operation {
            id: OperationId::new(attempt, OperationSequence::from_raw(sequence)),
            run_id: RunId::new("conformance"),
            node: node.clone(),
            spec: LogicalNodeSpec::new(node, RunId::new("conformance"), Arc::new(template)),
            request,
        }
    }

    fn started(session: &str) -> Result<EffectOutput, EffectError> {
        Ok(EffectOutput::BootstrapStarted {
            session: SessionHandle(session.to_owned()),
            adopted: false,
        })
    }

    fn ledger(session_handles: SessionHandles, lease_owners: LeaseOwners) -> Ledger {
        Ledger::new(LedgerPolicy {
            session_handles,
            lease_owners,
        })
    }

    /// Starts a session answered with `s1`, loses the node, and starts again
    /// with the same handle handed out: whether that session is live.
    fn live_after_reissued_handle(handles: SessionHandles) -> bool {
        let mut ledger = ledger(handles, LeaseOwners::UniqueOnly);
        let mut counters = SubstrateCounters::default();
        let start = operation(2, EffectRequest::CreateLease);
        ledger.session_starting(&key());
        ledger.answered(&start, &started("s1"), &mut counters);
        assert_eq!(ledger.live_sessions(), vec![key()]);
        ledger.observe(&Observation::NodeLost {
            node: key().0,
            attempt: key().1,
            cause: LossCause::AgentGone,
        });
        assert!(ledger.lost(&key()));
        assert!(ledger.session_settled(&key()));
        ledger.session_starting(&key());
        ledger.answered(&start, &started("s1"), &mut counters);
        assert_eq!(counters.creations, 2);
        !ledger.live_sessions().is_empty()
    }

    #[test]
    fn an_ended_handle_handed_out_again_is_over_only_when_handles_are_per_start() {
        assert!(!live_after_reissued_handle(SessionHandles::PerStart));
        assert!(live_after_reissued_handle(SessionHandles::PerAttempt));
    }

    #[test]
    fn a_lease_handle_issued_to_two_keys_has_no_owner_unless_the_latest_owns_it() {
        let other: ResourceKey = (key().0, NodeAttemptId::from_raw(2));
        for (policy, expected) in [
            (LeaseOwners::UniqueOnly, None),
            (LeaseOwners::Latest, Some(other.clone())),
        ] {
            let mut ledger = ledger(SessionHandles::PerStart, policy);
            let mut counters = SubstrateCounters::default();
            let created = Ok(EffectOutput::LeaseCreated {
                lease: LeaseHandle("pid-7".to_owned()),
                endpoint: None,
                adopted: false,
            });
            let mut create = operation(1, EffectRequest::CreateLease);
            ledger.answered(&create, &created, &mut counters);
            assert_eq!(
                ledger.lease_owner(&LeaseHandle("pid-7".to_owned())),
                Some(key())
            );
            create.id = OperationId::new(other.1, OperationSequence::from_raw(1));
            ledger.answered(&create, &created, &mut counters);
            assert_eq!(
                ledger.lease_owner(&LeaseHandle("pid-7".to_owned())),
                expected,
                "{policy:?}"
            );
        }
    }
}
