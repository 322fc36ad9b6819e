//! What the substrate, its backend and the plugin's observation sink share:
//! the kit's [`level3::Shared`](provisioning_conformance::level3::Shared)
//! with the process substrate's own parts — which faults are operating-system
//! events, the boot gate of a session, the stopped agent of a hang, and the
//! operating-system fault counts.

use provisioning::{EffectKind, OperationId};
use provisioning_conformance::level3::{self, LeaseOwners, LedgerPolicy, SessionHandles};
use provisioning_conformance::substrate::ResourceKey;
use provisioning_conformance::trace::Fault;

/// The shared state of one process substrate.
pub(crate) type Shared = level3::Shared<OsFaultCounts, GateState, Stopped>;

/// How the ledger folds the process plugin's answers: every start gets a
/// session handle of its own, and a pid (and with it a lease name) can be
/// reused by a later agent.
const POLICY: LedgerPolicy = LedgerPolicy {
    session_handles: SessionHandles::PerStart,
    lease_owners: LeaseOwners::UniqueOnly,
};

/// Fresh shared state for one substrate.
pub(crate) fn new_shared() -> Shared {
    Shared::new(producible, POLICY)
}

/// Whether the substrate can turn `fault` into a real operating-system event
/// for a call of `kind`. See the module docs of `backend` for the mapping.
pub(crate) fn producible(kind: EffectKind, fault: Fault) -> bool {
    match fault {
        Fault::Succeed | Fault::Definite => true,
        Fault::NotReady => kind == EffectKind::LookupEndpoint,
        // A start hangs on a stopped agent; a create is held before it
        // reaches the plugin, as a slow provider API would hold it.
        Fault::Hang => matches!(kind, EffectKind::StartBootstrap | EffectKind::CreateLease),
        // A lost reply or a panic is no event of the operating system: the
        // in-memory levels cover them.
        Fault::AmbiguousDone | Fault::AmbiguousUndone | Fault::Panic => false,
    }
}

/// Where the boot gate of a session stands (see `os_faults::Gates`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum GateState {
    /// The verify command waits on the gate.
    #[default]
    Closed,
    /// The gate was opened with a passing verdict.
    Passed,
    /// The gate was opened with a failing verdict.
    Failed,
}

/// What a hang stopped: a start's node agent (`SIGSTOP`), or nothing for a
/// create held before it reaches the plugin.
#[derive(Clone, Debug)]
pub(crate) struct Stopped {
    /// The node.
    pub(crate) key: ResourceKey,
    /// The stopped agent (`None`: a held create).
    pub(crate) pid: Option<i32>,
}

/// How often each operating-system fault was really applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct OsFaultCounts {
    /// Node processes killed with `SIGKILL` (scripted faults, losses, stream errors).
    pub(crate) nodes_killed: u64,
    /// Agents stopped with `SIGSTOP` so that a bootstrap start hung.
    pub(crate) agents_stopped: u64,
    /// Hung agents continued with `SIGCONT`.
    pub(crate) agents_continued: u64,
    /// Creates that failed because the agent program was missing.
    pub(crate) spawn_failures: u64,
    /// Verify commands that failed (a boot gate opened with a failing verdict).
    pub(crate) verify_failures: u64,
    /// Workload starts that failed because the agent program was missing.
    pub(crate) start_failures: u64,
    /// Endpoint lookups answered "not ready" while the agent was held.
    pub(crate) not_ready_answers: u64,
    /// Boot gates opened with a passing verdict.
    pub(crate) gates_passed: u64,
    /// Creates held before they reached the plugin (a slow provider call).
    pub(crate) creates_held: u64,
}

impl level3::FaultCounts for OsFaultCounts {
    fn add(&mut self, other: &OsFaultCounts) {
        self.nodes_killed += other.nodes_killed;
        self.agents_stopped += other.agents_stopped;
        self.agents_continued += other.agents_continued;
        self.spawn_failures += other.spawn_failures;
        self.verify_failures += other.verify_failures;
        self.start_failures += other.start_failures;
        self.not_ready_answers += other.not_ready_answers;
        self.gates_passed += other.gates_passed;
        self.creates_held += other.creates_held;
    }

    fn required(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("SIGKILL of node processes", self.nodes_killed),
            ("SIGSTOP hang", self.agents_stopped),
            ("SIGCONT release", self.agents_continued),
            ("spawn failure", self.spawn_failures),
            ("failing verify command", self.verify_failures),
            ("held agent not ready", self.not_ready_answers),
            ("boot gate passed", self.gates_passed),
            ("held create", self.creates_held),
        ]
    }
}

/// The process substrate's own steps on the shared state.
pub(crate) trait ProcessShared {
    /// Updates the gate of `key`'s session, counting what it opened.
    fn set_gate(&self, key: &ResourceKey, gate: GateState);

    /// Records that `op` hangs on the stopped agent `pid` (`None`: a create
    /// held before the plugin). Returns the hang's serial.
    fn hang_on(&self, key: ResourceKey, op: OperationId, pid: Option<i32>) -> u64;

    /// Forgets hang `serial` (its call ended). Returns what it stopped when
    /// it was never released: that agent is still stopped.
    fn end_stop(&self, serial: u64) -> Option<Stopped>;
}

impl ProcessShared for Shared {
    fn set_gate(&self, key: &ResourceKey, gate: GateState) {
        let mut state = self.lock();
        state.ledger.track_mut(key).extra = gate;
        match gate {
            GateState::Passed => state.faults.gates_passed += 1,
            GateState::Failed => state.faults.verify_failures += 1,
            GateState::Closed => {}
        }
    }

    fn hang_on(&self, key: ResourceKey, op: OperationId, pid: Option<i32>) -> u64 {
        self.hang(op, Stopped { key, pid }, |os| {
            if pid.is_some() {
                os.agents_stopped += 1;
            } else {
                os.creates_held += 1;
            }
        })
    }

    fn end_stop(&self, serial: u64) -> Option<Stopped> {
        let hang = self.end_hang(serial)?;
        if hang.what.pid.is_some() {
            self.count(|os| os.agents_continued += 1);
        }
        Some(hang.what)
    }
}
