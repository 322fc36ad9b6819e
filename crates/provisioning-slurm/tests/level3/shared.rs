//! What the substrate, its backend, its tools and the plugin's observation
//! sink share: the kit's
//! [`level3::Shared`](provisioning_conformance::level3::Shared) with the
//! Slurm substrate's own parts — which faults are real scheduler events,
//! the boot gate of a session, the stopped command of a hang, and the
//! counts of real faults and refused inputs.

use provisioning::{EffectKind, OperationId};
use provisioning_conformance::level3::{self, LeaseOwners, LedgerPolicy, Scripted, SessionHandles};
use provisioning_conformance::substrate::ResourceKey;
use provisioning_conformance::trace::{Fault, FaultTarget};

/// The shared state of one Slurm substrate; a hang stopped the command
/// with this pid.
pub(crate) type Shared = level3::Shared<FaultCounts, SlurmSession, u32>;

/// How the ledger folds the Slurm plugin's answers: a session handle names
/// the attempt's agent step, not one start (so an ended handle handed out
/// again says nothing of the new session).
const POLICY: LedgerPolicy = LedgerPolicy {
    session_handles: SessionHandles::PerAttempt,
    lease_owners: LeaseOwners::UniqueOnly,
};

/// Fresh shared state for one substrate.
pub(crate) fn new_shared() -> Shared {
    Shared::new(producible, POLICY)
}

/// Whether the substrate can turn `fault` into a real event for a call of
/// `kind` (the table is in the docs of `backend`).
pub(crate) fn producible(kind: EffectKind, fault: Fault) -> bool {
    match fault {
        Fault::Succeed | Fault::Definite | Fault::AmbiguousUndone | Fault::Hang => true,
        Fault::NotReady => kind == EffectKind::LookupEndpoint,
        // A lost reply of the call's acting command (`sbatch`, `scancel`) or
        // of the lookup's `squeue`. A start's work is `srun`, which the
        // plugin does not wait for, and a completion's `Closed` comes after
        // its only command: neither can lose a reply after doing the work.
        Fault::AmbiguousDone => !matches!(
            kind,
            EffectKind::StartBootstrap | EffectKind::BootstrapConvergenceObserved
        ),
        // No event of a Slurm cluster: the in-memory levels cover it.
        Fault::Panic => false,
    }
}

/// Where the boot gate of a session stands.
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

/// The Slurm substrate's part of a session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SlurmSession {
    /// The boot gate.
    pub(crate) gate: GateState,
    /// The fair tail waited once for it to reach its gate.
    pub(crate) waited: bool,
}

/// How often each real fault was applied, and which inputs were refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FaultCounts {
    /// Jobs cancelled by hand (`scancel`) as a loss.
    pub(crate) jobs_cancelled_by_hand: u64,
    /// `slurmd`s SIGKILLed (their node went down, its job failed).
    pub(crate) slurmds_killed: u64,
    /// Controller outages (`slurmctld` stopped for a call, then restarted).
    pub(crate) controller_outages: u64,
    /// Calls that failed definitely while the controller was stopped.
    pub(crate) definite_in_outage: u64,
    /// Commands run against a closed controller port (connect failure).
    pub(crate) connect_failures: u64,
    /// Commands killed by their time-out while they retried to connect.
    pub(crate) command_timeouts: u64,
    /// Acting commands that ran and whose reply was thrown away.
    pub(crate) replies_lost: u64,
    /// Submissions no node can satisfy (refused by the controller).
    pub(crate) unsatisfiable: u64,
    /// Commands stopped with `SIGSTOP` so that their call hung.
    pub(crate) commands_stopped: u64,
    /// Stopped commands continued with `SIGCONT`.
    pub(crate) commands_continued: u64,
    /// Lookups answered "not ready" while the job was pending or suspended.
    pub(crate) not_ready_answers: u64,
    /// Boot gates opened with a passing verdict (agents that joined).
    pub(crate) gates_passed: u64,
    /// Boot gates opened with a failing verdict (verify commands failed).
    pub(crate) verify_failures: u64,
    /// Agent steps SIGKILLed before they joined (start failures).
    pub(crate) steps_killed: u64,
    /// Agents of ready nodes SIGKILLed (their swarm connection dropped).
    pub(crate) agents_killed: u64,
    /// Scripted faults the substrate cannot produce (refused, no-ops).
    pub(crate) refused_scripts: u64,
    /// Scripted faults taken by a call that never ran the command they
    /// were meant for (nothing applied).
    pub(crate) scripts_not_reached: u64,
    /// Stream events the substrate cannot produce (refused, no-ops).
    pub(crate) refused_stream_events: u64,
    /// Losses the substrate could not produce (nothing live to lose).
    pub(crate) losses_not_applied: u64,
}

impl FaultCounts {
    fn fields(&self) -> [(&'static str, u64); 19] {
        [
            ("job cancelled by hand", self.jobs_cancelled_by_hand),
            ("slurmd SIGKILLed", self.slurmds_killed),
            ("slurmctld stopped and restarted", self.controller_outages),
            (
                "definite call while slurmctld was down",
                self.definite_in_outage,
            ),
            ("connect failure", self.connect_failures),
            ("command timed out", self.command_timeouts),
            ("reply lost", self.replies_lost),
            ("request no node can satisfy", self.unsatisfiable),
            ("SIGSTOP hang", self.commands_stopped),
            ("SIGCONT release", self.commands_continued),
            ("not ready", self.not_ready_answers),
            ("boot gate passed", self.gates_passed),
            ("failing verify command", self.verify_failures),
            ("agent step killed before joining", self.steps_killed),
            ("agent of a ready node killed", self.agents_killed),
            ("refused script", self.refused_scripts),
            ("script not reached", self.scripts_not_reached),
            ("refused stream event", self.refused_stream_events),
            ("loss not applied", self.losses_not_applied),
        ]
    }

    fn fields_mut(&mut self) -> [&mut u64; 19] {
        [
            &mut self.jobs_cancelled_by_hand,
            &mut self.slurmds_killed,
            &mut self.controller_outages,
            &mut self.definite_in_outage,
            &mut self.connect_failures,
            &mut self.command_timeouts,
            &mut self.replies_lost,
            &mut self.unsatisfiable,
            &mut self.commands_stopped,
            &mut self.commands_continued,
            &mut self.not_ready_answers,
            &mut self.gates_passed,
            &mut self.verify_failures,
            &mut self.steps_killed,
            &mut self.agents_killed,
            &mut self.refused_scripts,
            &mut self.scripts_not_reached,
            &mut self.refused_stream_events,
            &mut self.losses_not_applied,
        ]
    }
}

impl level3::FaultCounts for FaultCounts {
    fn add(&mut self, other: &FaultCounts) {
        for (mine, (_, theirs)) in self.fields_mut().into_iter().zip(other.fields()) {
            *mine += theirs;
        }
    }

    /// The real faults that must not stay at zero over the battery (the
    /// refusals after them are counted for the summary only).
    fn required(&self) -> Vec<(&'static str, u64)> {
        self.fields().into_iter().take(15).collect()
    }

    fn all(&self) -> Vec<(&'static str, u64)> {
        self.fields().to_vec()
    }
}

/// The Slurm substrate's own steps on the shared state.
pub(crate) trait SlurmShared {
    /// Queues a fault; `false` (counted) when it cannot be produced, and
    /// `false` when the queue is full or stopped.
    fn script_counted(&self, target: FaultTarget, fault: Fault) -> bool;

    /// Records that `op` hangs on the stopped command `pid` (a scripted
    /// fault applied); returns the hang's serial.
    fn hang_on(&self, op: OperationId, pid: u32) -> u64;

    /// Marks hang `serial` released (its command is continued next);
    /// returns the stopped command.
    fn release(&self, serial: u64) -> Option<level3::Hang<u32>>;

    /// Forgets hang `serial` (its command goes on); returns it when it was
    /// never released: its command is still stopped.
    fn end_stop(&self, serial: u64) -> Option<level3::Hang<u32>>;

    /// Updates the gate of `key`'s session, counting what it opened.
    fn set_gate(&self, key: &ResourceKey, gate: GateState);
}

impl SlurmShared for Shared {
    fn script_counted(&self, target: FaultTarget, fault: Fault) -> bool {
        match self.script(target, fault) {
            Scripted::Queued => true,
            Scripted::Unproducible => {
                self.count(|f| f.refused_scripts += 1);
                false
            }
            Scripted::NotAccepted => false,
        }
    }

    fn hang_on(&self, op: OperationId, pid: u32) -> u64 {
        // The hang is a scripted fault that reached its command.
        self.applied(|f| f.commands_stopped += 1);
        self.hang(op, pid, |_| {})
    }

    fn release(&self, serial: u64) -> Option<level3::Hang<u32>> {
        let hang = self.lock().release_hang(serial)?;
        self.count(|f| f.commands_continued += 1);
        Some(hang)
    }

    fn end_stop(&self, serial: u64) -> Option<level3::Hang<u32>> {
        let hang = self.end_hang(serial)?;
        self.count(|f| f.commands_continued += 1);
        Some(hang)
    }

    fn set_gate(&self, key: &ResourceKey, gate: GateState) {
        let mut state = self.lock();
        state.ledger.track_mut(key).extra.gate = gate;
        match gate {
            GateState::Passed => state.faults.gates_passed += 1,
            GateState::Failed => state.faults.verify_failures += 1,
            GateState::Closed => {}
        }
    }
}
