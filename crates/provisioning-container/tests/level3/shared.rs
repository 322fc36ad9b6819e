//! What the substrate, its backend and the plugin's observation sink share:
//! the kit's [`level3::Shared`](provisioning_conformance::level3::Shared)
//! with the container substrate's own parts — which faults are real engine
//! events, and the real fault counts.

use provisioning::EffectKind;
use provisioning_conformance::level3::{self, LeaseOwners, LedgerPolicy, SessionHandles};
use provisioning_conformance::trace::Fault;

/// The shared state of one container substrate (a hang holds a create
/// before the plugin; nothing to continue).
pub(crate) type Shared = level3::Shared<FaultCounts, (), ()>;

/// How the ledger folds the container plugin's answers: a session handle
/// names the attempt's agent, not one start, and a lease names one
/// container for good.
const POLICY: LedgerPolicy = LedgerPolicy {
    session_handles: SessionHandles::PerAttempt,
    lease_owners: LeaseOwners::UniqueOnly,
};

/// Fresh shared state for one substrate.
pub(crate) fn new_shared() -> Shared {
    Shared::new(producible, POLICY)
}

/// Whether the substrate can turn `fault` into a real event for a call of
/// `kind` (the table is in the module docs of `backend`).
pub(crate) fn producible(kind: EffectKind, fault: Fault) -> bool {
    use EffectKind as K;
    match fault {
        Fault::Succeed | Fault::Definite => true,
        Fault::NotReady => kind == K::LookupEndpoint,
        Fault::AmbiguousDone => matches!(kind, K::CreateLease | K::DestroyLease),
        Fault::Hang => kind == K::CreateLease,
        // No event of an engine the plugin could not tell from a refusal
        // or a lost reply; the in-memory levels cover these.
        Fault::AmbiguousUndone | Fault::Panic => false,
    }
}

/// How often each real fault was applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FaultCounts {
    /// Containers removed by hand (`docker rm -f`): a lost lease.
    pub(crate) containers_removed: u64,
    /// Containers killed (`docker kill`): a lost node with its exit code.
    pub(crate) containers_killed: u64,
    /// Agents SIGKILLed inside their container (a lost agent).
    pub(crate) agents_killed: u64,
    /// Workloads SIGKILLed inside their container (an exited workload).
    pub(crate) workloads_killed: u64,
    /// Agents SIGKILLed while they waited at their boot gate (start failed).
    pub(crate) agents_killed_before_join: u64,
    /// Engine outages: the daemon stopped for a call and started again.
    pub(crate) engine_outages: u64,
    /// Calls answered definitely while the engine was stopped.
    pub(crate) definite_in_outage: u64,
    /// Calls answered definitely from a socket nobody listens on.
    pub(crate) refused: u64,
    /// Creates refused because their image is not on the engine.
    pub(crate) images_missing: u64,
    /// Creates and destroys done whose reply was thrown away.
    pub(crate) replies_lost: u64,
    /// Lookups answered "not ready" while the container was paused.
    pub(crate) paused_not_ready: u64,
    /// Creates held before they reached the plugin (a slow call).
    pub(crate) creates_held: u64,
    /// Boot gates opened with a passing verdict.
    pub(crate) gates_passed: u64,
    /// Boot gates opened with a failing verdict (verify commands failed).
    pub(crate) verify_failures: u64,
}

impl FaultCounts {
    fn named(&self) -> [(&'static str, u64); 14] {
        [
            ("container removed by hand", self.containers_removed),
            ("container killed", self.containers_killed),
            ("agent SIGKILLed", self.agents_killed),
            ("workload SIGKILLed", self.workloads_killed),
            (
                "agent SIGKILLed before it joined",
                self.agents_killed_before_join,
            ),
            ("engine stopped and restarted", self.engine_outages),
            (
                "definite call while the engine was stopped",
                self.definite_in_outage,
            ),
            ("refused socket (definite)", self.refused),
            ("image missing (definite)", self.images_missing),
            ("reply lost (ambiguous)", self.replies_lost),
            ("container paused: not ready", self.paused_not_ready),
            ("held create", self.creates_held),
            ("boot gate passed", self.gates_passed),
            ("failing verify command", self.verify_failures),
        ]
    }

    fn fields_mut(&mut self) -> [&mut u64; 14] {
        [
            &mut self.containers_removed,
            &mut self.containers_killed,
            &mut self.agents_killed,
            &mut self.workloads_killed,
            &mut self.agents_killed_before_join,
            &mut self.engine_outages,
            &mut self.definite_in_outage,
            &mut self.refused,
            &mut self.images_missing,
            &mut self.replies_lost,
            &mut self.paused_not_ready,
            &mut self.creates_held,
            &mut self.gates_passed,
            &mut self.verify_failures,
        ]
    }
}

impl level3::FaultCounts for FaultCounts {
    fn add(&mut self, other: &FaultCounts) {
        for (mine, (_, theirs)) in self.fields_mut().into_iter().zip(other.named()) {
            *mine += theirs;
        }
    }

    /// Every count: the battery requires each to be reached.
    fn required(&self) -> Vec<(&'static str, u64)> {
        self.named().to_vec()
    }
}
