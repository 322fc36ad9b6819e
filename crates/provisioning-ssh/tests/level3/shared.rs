//! What the substrate, its backend and the plugin's observation sink share:
//! the kit's [`level3::Shared`](provisioning_conformance::level3::Shared)
//! with the SSH substrate's own parts — which faults are real events on a
//! host, the stopped agent of a hang, and the real fault counts.

use provisioning::{EffectKind, OperationId};
use provisioning_conformance::level3::{self, LeaseOwners, LedgerPolicy, SessionHandles};
use provisioning_conformance::trace::Fault;

/// The shared state of one SSH substrate; a hang stopped the remote agent
/// with this pid, or (`None`) held a create before the plugin.
pub(crate) type Shared = level3::Shared<FaultCounts, (), Option<u32>>;

/// How the ledger folds the ssh plugin's answers: every start gets a
/// session handle of its own, and a lease handle names one claim for good.
const POLICY: LedgerPolicy = LedgerPolicy {
    session_handles: SessionHandles::PerStart,
    lease_owners: LeaseOwners::Latest,
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
        Fault::Succeed => true,
        Fault::Definite => matches!(
            kind,
            K::CreateLease
                | K::LookupEndpoint
                | K::StartBootstrap
                | K::CancelBootstrap
                | K::DestroyLease
        ),
        Fault::NotReady => kind == K::LookupEndpoint,
        Fault::AmbiguousDone | Fault::AmbiguousUndone => kind == K::CreateLease,
        Fault::Hang => matches!(kind, K::CreateLease | K::CancelBootstrap | K::DestroyLease),
        // A panic is no event of a real host: the in-memory levels cover it.
        Fault::Panic => false,
    }
}

/// How often each real fault was applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FaultCounts {
    /// Remote agents killed with `SIGKILL` (a lost agent).
    pub(crate) agents_killed: u64,
    /// Remote workloads killed with `SIGKILL` (an exited workload).
    pub(crate) workloads_killed: u64,
    /// Claims removed on the host behind the plugin's back (a lost lease).
    pub(crate) claims_removed: u64,
    /// Remote agents stopped with `SIGSTOP` during a call.
    pub(crate) agents_stopped: u64,
    /// Stopped agents continued with `SIGCONT`.
    pub(crate) agents_continued: u64,
    /// Calls answered definitely while the host's sshd was stopped.
    pub(crate) refused: u64,
    /// Lookups answered "not ready" while the host's sshd was stopped.
    pub(crate) refused_not_ready: u64,
    /// Calls cut off by the host's link going down mid-call, answered
    /// ambiguously.
    pub(crate) partitions: u64,
    /// Calls refused because the host's key in the known-hosts file changed.
    pub(crate) host_key_changed: u64,
    /// Creates refused because every slot of the inventory was taken.
    pub(crate) inventory_exhausted: u64,
    /// Bootstrap starts whose verify command failed on the host.
    pub(crate) verify_failures: u64,
    /// Boot gates opened: agents let go to join.
    pub(crate) gates_passed: u64,
    /// Creates held before they reached the plugin (a slow call).
    pub(crate) creates_held: u64,
}

impl FaultCounts {
    fn fields(&self) -> [u64; 13] {
        [
            self.agents_killed,
            self.workloads_killed,
            self.claims_removed,
            self.agents_stopped,
            self.agents_continued,
            self.refused,
            self.refused_not_ready,
            self.partitions,
            self.host_key_changed,
            self.inventory_exhausted,
            self.verify_failures,
            self.gates_passed,
            self.creates_held,
        ]
    }

    fn fields_mut(&mut self) -> [&mut u64; 13] {
        [
            &mut self.agents_killed,
            &mut self.workloads_killed,
            &mut self.claims_removed,
            &mut self.agents_stopped,
            &mut self.agents_continued,
            &mut self.refused,
            &mut self.refused_not_ready,
            &mut self.partitions,
            &mut self.host_key_changed,
            &mut self.inventory_exhausted,
            &mut self.verify_failures,
            &mut self.gates_passed,
            &mut self.creates_held,
        ]
    }

    /// Every count, by name.
    fn named(&self) -> [(&'static str, u64); 13] {
        let names = [
            "SIGKILL of a remote agent",
            "SIGKILL of a remote workload",
            "claim removed on the host",
            "SIGSTOP of a remote agent",
            "SIGCONT on release",
            "sshd stopped: refused (definite)",
            "sshd stopped: lookup not ready",
            "link down mid-call (ambiguous)",
            "changed host key",
            "exhausted inventory",
            "failing verify command",
            "boot gate passed",
            "held create",
        ];
        let values = self.fields();
        std::array::from_fn(|i| (names[i], values[i]))
    }
}

impl level3::FaultCounts for FaultCounts {
    fn add(&mut self, other: &FaultCounts) {
        for (mine, theirs) in self.fields_mut().into_iter().zip(other.fields()) {
            *mine += theirs;
        }
    }

    /// Every count: the battery requires each to be reached.
    fn required(&self) -> Vec<(&'static str, u64)> {
        self.named().to_vec()
    }
}

/// Records that `op` hangs (on the stopped agent `pid`, or held before the
/// plugin when `None`), counted. Returns the hang's serial.
pub(crate) fn hang_on(shared: &Shared, op: OperationId, pid: Option<u32>) -> u64 {
    shared.hang(op, pid, |f| match pid {
        Some(_) => f.agents_stopped += 1,
        None => f.creates_held += 1,
    })
}
