//! The guarantees of design §11 and §17 (G26–G28), by stable id, and the violations the oracle
//! reports against them.
//!
//! # How the oracle evaluates each guarantee
//!
//! "After every input" means once the harness has settled the machine (folded
//! every result, observation and due timeout, and run every queued pass).
//! Where a check is weaker than the guarantee's wording, the row says so.
//!
//! | Id | Evaluation |
//! |---|---|
//! | G01 | After every input: attempts unique across nodes and below the allocator. After every pass batch: an attempt that appears is above every attempt seen before in the run (so none is reused), and no attempt goes back to `New` in a pass (a restart that kept its id). Against every attempt id the kit has seen in the run: none is seen at a second slot, none that was destroyed, replaced or reaped is in use again. |
//! | G02 | After every input: each pending operation carries its node's attempt. Every delivery of a result that is not the node's pending operation — late results, redeliveries of old ones, results of superseded attempts, a timeout reported a second time — must be rejected and leave the state equal. A result of the pending operation must be accepted. Every result the executor publishes is of an operation it was given, and after the executor expired an operation, only its timeout. |
//! | G03 | After every input: lease, endpoint, bootstrap and swarm facts are tagged with the node's attempt, and the lease and session handles are ones the substrate issued for that same `(slot, attempt)` (when the substrate knows its handles). Observations of another attempt must be rejected and change nothing. |
//! | G04 | At every backend call start: on a deterministic substrate the operation is pending in observed state, or the host already folded its timeout (a call queued before its expiry may still start); otherwise (approximation) it was recorded pending at some point. Count form, after every input: the driver's and the executor's counters agree with what the kit saw (the executor's: calls started, expiries, queued and replayed submissions, results taken, one `with_notify` wake-up per result, backend panics, late results dropped and operations skipped, bounded by the calls that ended unreported and the operations that never reached the backend); its operations are handed out through its inherent `submit` and both `OperationSink` faces in turn; its `Debug` text shows its counters. |
//! | G05 | At most one pending operation per node is structural. At the backend, no call starts while another call of the same attempt is in flight ([`crate::substrate::CallRecorder`]). An operation handed to the executor again ([`Input::Resubmit`](crate::trace::Input::Resubmit)) is deduplicated: still running, replayed, or refused as stale. |
//! | G06 | After every input: a destroyed node holds no lease, no active session, no pending operation. |
//! | G07 | At every fold: lease facts disappear only on a successful destroy, an active session only on a successful cancel or a `Closed` event; so a failed cleanup step keeps them. After every pass batch: an attempt is replaced or reaped only when it holds no lease, session or pending operation. |
//! | G08 | After every input and every batch of work: at most one live lease and session per key, live resources of at most one attempt per slot — from the substrate's ledger, plus alarms a substrate raises the moment a second resource appears. |
//! | G09 | At every dispatch: not before the stored `next_effect_at` as it was before the pass (the ladder's `BeginDelete` clearing excepted); a restart not before `restart_at`. At every fold: a newly stored delay equals the policy applied to the kit's own count of the slot's consecutive failures (`backoff(kit_count, attempt)`, or the probe interval; the kit counts failed or wrongly answered operations and observations that fail the attempt, carries the count into a replacement, resets it on ready, and takes the recovered counts after a crash), and the driver's count equals the kit's (also after every pass); an observation never shortens a deleting node's stored backoff. Passes never move stored times except where the ladder says so. |
//! | G10 | After the pass batch that follows an attempt failure: the node is deleting and has a cleanup step in flight, or is destroyed, or waits only to re-issue an ambiguous operation. After every pass batch, any deleting node that is not destroyed has a cleanup step (or an adoption re-issue) in flight, unless it waits on a backoff it already waited on while deleting (a failed cleanup step's) or one kept for a remembered ambiguous operation. The restart delay is checked under G09. |
//! | G11 | At every fold of "endpoint not ready": the failure count is unchanged and the delay is the probe interval. |
//! | G12 | A create or start answered with another method's output ([`Input::Confuse`](crate::trace::Input::Confuse)) is remembered as ambiguous. While an ambiguous create/start is remembered: no cancel or destroy is dispatched, the node is not marked destroyed, replaced or reaped; a pass never forgets it; a fold forgets it only when an operation of its kind answers — a submission the host's sink refused ([`Input::Refuse`](crate::trace::Input::Refuse)) is no answer, the provider never saw it. |
//! | G13 | Every step runs under `catch_unwind`: a panic escaping the driver, executor or backend is a violation (backend panics must come back as definite errors carrying the panic's message; scripted panics carry it as a `&str` and as a `String` payload in turn). Driver errors other than attempt exhaustion and clock saturation are violations. Seeds with an attempt limit or a clock near its end reach those edges. |
//! | G14 | After every input: a ready node is active, in a ready stage, with lease, endpoint, swarm join and handoff facts, and (when no pass is queued) holds the desired spec; a deleting node is not ready. |
//! | G15 | After every input: an active session implies a lease and a stage past the endpoint; a bootstrap stage implies bootstrap facts. (The core's types already make "active session without facts" unrepresentable, so the check covers the facts around it.) After every pass batch: no convergence report is dispatched for a session whose report was acknowledged. At every fold of a stream event: an event of a closed or cancelled session is rejected. |
//! | G16 | After every input: observed generation never decreases nor passes the desired one. Every valid shape at a strictly higher generation is accepted; revision probes (a lower generation, the same shape, changed content under the same generation) are rejected or no-ops and change nothing. |
//! | G17 | After every pass batch: a node begins deletion only when its slot is undesired, its spec drifted, or it failed; only undesired slots are reaped. After every input: no active node sits in an undesired slot. Desired slots are `index < count` of the kit's own model of the last shape it submitted (never the driver's `DesiredState`), so a shrinking group loses exactly its highest indices. |
//! | G18 | Deterministic substrates: the evaluation runs the trace twice and compares every backend call, the final state, the live resources and the outcome. |
//! | G19 | A forced full pass every few inputs, at the end and at convergence must dispatch nothing, change nothing and keep `requeue_at`; a converged cluster has no `requeue_at`; settling after an input must finish within a bound (a livelock is a violation). |
//! | G20 | Deterministic substrates, fair mode: the run is repeated with the tail completing queued work newest-first; both must converge to the same per-slot spec, stage, readiness and intent. (Approximation: attempt ids and timestamps legitimately depend on order and are not compared.) |
//! | G21 | Fair mode: after the trace, faults stop; each tail round releases hung calls, runs all work, delivers everything, lets live sessions join, then advances the clock to the next stored deadline. The cluster must converge within [`crate::harness::FAIR_ROUNDS_MAX`] rounds (a round in which nothing happened does not count, up to [`crate::harness::FAIR_ROUNDS_IDLE_MAX`] rounds in all), or the report lists what is pending. Waived once exhaustion or saturation was reached. |
//! | G22 | Fair mode: attempts allocated during the tail stay within `2 × desired nodes + 2`. |
//! | G23 | Fair mode, at convergence: the live leases are exactly the managed nodes' current attempts (one each) and no session of another attempt is live. After an empty shape that is nothing. |
//! | G24 | Fair mode, at convergence: the driver's desired shape is the last one the harness submitted, and the observed generation is its generation. Intermediate generations are skipped whenever shapes change faster than the cluster converges. |
//! | G25 | At every dispatch: deadline = dispatch time + operation timeout, in plain milliseconds (the kit never uses the core's `Timestamp` comparisons). The host wakes exactly at each stored deadline; one millisecond before, the operation is not listed due and its timeout is refused without change; at the deadline it is listed due and accepted; nothing past its deadline is missing from the due list. |
//! | G26 | Across every [`Input::Crash`](crate::trace::Input::Crash) and recovery: the journal gives back what was committed (recovery fails otherwise); every operation the journal held pending is no longer pending after recovery, and a pending create or bootstrap start is remembered as ambiguous (so it is re-issued and adopted); an attempt that appears after a crash is above every attempt seen before it (never reused). After a crash, a G01 reuse is reported as G26. G08, G21 and G23 keep being checked across crashes under their own ids — except that a resource a dead controller's call created after the crash is an orphan (left to G28), not a double-create — and the fair tail converges only once no orphan is left. The dead controller's executor is closed at the crash and must refuse a submission. After every commit (the harness takes the driver's changes in turn as a change set, as the ids of the changed nodes read back from its durable state, and as "whether anything changed" with the whole state written and the changes discarded): a write carries the meta with the writer's clock, and the journal as the kit applied every committed change set equals the driver's durable state; after a discard the driver says nothing waits. Recovery reports the nodes, pending operations and sessions it restarted that the journal held. |
//! | G27 | At every backend call start (the harness host's executor runs over a wrapper of the substrate's backend): the operation was committed to the journal as pending by some commit before the call started. Calls a dead controller's executor still had queued never reach the backend. |
//! | G28 | The harness host lists the substrate's live resources after every recovery and every `orphan_scan_interval` of virtual time, and destroys a resource no node's current attempt owns (not in the map, another attempt, or a destroyed node) once it was seen unowned for `orphan_grace`. The oracle samples the live resources after every input and tail round: once faults stop (the fair tail), a resource it saw unowned must be gone within `orphan_grace` + one scan interval; a resource a current attempt owns is never destroyed as an orphan. |
//! | G35 | After every drive (the harness plays the host, which hands the driver's membership to its agents whenever it changed): every membership taken lists exactly the `(slot, attempt)` pairs of the nodes that are ready in the driver's state at that moment (active, in a ready stage, with the ready flag and an endpoint of the current attempt), with versions that strictly grow; and none of them is an attempt whose loss the kit delivered, or whose teardown (deleting, failed or destroyed) it saw, before. |
//! | G32 | After every input, every fold and every pass batch: each node's stage agrees with its facts (the table at `oracle::g32_stage_agrees_with_facts`: `New` holds no lease and no pending create, `LeaseRequested` a pending create and no lease, `LeaseCreated` a lease and no endpoint, `EndpointKnown` no active session, `BootstrapRunning` an active session, `Failed` a failure, `Destroyed` nothing). A deleting node's "holds" are not required (cleanup gives facts back before the pass that marks it destroyed). A loss that fails a node gives a reason naming what was lost (agent, lease, workload); the history entry where a healthy node's teardown began names its cause by the kit's own shape (scaled down when its slot is not desired, drifted when it is desired with another template). |
//! | G37 | At every recovery after a crash and after every input: a node the journal held as ready (or rejoining) when the controller crashed is, while it keeps that attempt, not ready until the kit folded an [`Observation::AgentRejoined`](provisioning::Observation::AgentRejoined) of it into the new controller, and while any such node waits the driver is not converged. The substrates deliver the re-join of a still-live agent at a [`Input::Rejoin`](crate::trace::Input::Rejoin) input and, in the fair tail, for even slot indices (odd ones let the rejoin window end, so the loss path runs). |

use std::fmt;

/// A guarantee of design §11 and §17. The id (`G01`…`G30`) is stable: reports,
/// regression files and tests refer to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GuaranteeId {
    /// G01: attempt ids are unique across nodes, below the allocator, never reused.
    Identity,
    /// G02: a pending operation belongs to its node's current attempt; results
    /// for other operations change nothing.
    Correlation,
    /// G03: lease, endpoint and session facts were produced for the node's
    /// current attempt.
    AttemptFactOwnership,
    /// G04: every effect a backend executes was pending in observed state
    /// when it started.
    RecordBeforeDispatch,
    /// G05: at most one pending operation per node; at most one operation
    /// running per attempt at the backend.
    SingleFlight,
    /// G06: a destroyed node holds no lease, session or pending operation.
    DeadHold,
    /// G07: a failed cancel/destroy keeps the live facts until absence is confirmed.
    CleanupKeepsFacts,
    /// G08: a backend never holds two live resources for one attempt, nor
    /// live resources of two attempts of one slot.
    NoDoubleCreate,
    /// G09: no effect before the stored `next_effect_at`; delays follow the policy.
    BackoffDiscipline,
    /// G10: a failed attempt starts cleanup in the next pass; only the
    /// restart is delayed.
    AttemptFailure,
    /// G11: endpoint-not-ready never increments the failure count.
    ProbeIsNotFailure,
    /// G12: after an ambiguous create/bootstrap the same operation is
    /// re-issued before any destructive step.
    AdoptBeforeDestroy,
    /// G13: exhaustion and clock saturation return errors; no step panics.
    ErrorsNotPanics,
    /// G14: readiness implies the full set of facts and the desired spec;
    /// deleting implies not ready.
    ReadinessCoherence,
    /// G15: an active session implies bootstrap facts.
    SessionCoherence,
    /// G16: observed generation never decreases; regressions and silent
    /// changes are rejected.
    MonotonicGeneration,
    /// G17: a shrinking group loses only its highest indices.
    ScaleDownOrder,
    /// G18: the same trace gives identical state and backend calls, run twice.
    Determinism,
    /// G19: a forced pass over a settled machine changes nothing; converged
    /// means no requeue.
    Quiescence,
    /// G20: completing independent work in different orders converges to the
    /// same state.
    Confluence,
    /// G21: once faults stop, the latest desired shape converges within
    /// bounded rounds.
    FairConvergence,
    /// G22: during the fair tail new attempts stay within `2 × nodes + 2`.
    BoundedReplacement,
    /// G23: at convergence the backend's live resources are exactly the
    /// desired nodes' current attempts.
    ConvergedLeaksNothing,
    /// G24: the end state matches the last desired shape.
    LatestDesiredWins,
    /// G25: an operation expires exactly at its stored deadline.
    DeadlineBoundary,
    /// G26: across a controller crash and recovery, attempt ids are never
    /// reused, nothing is created twice, and once faults stop the latest
    /// shape converges with nothing leaked, orphans included.
    CrashSafety,
    /// G27: every effect a backend executes was committed to the journal as
    /// pending before it started.
    DurableBeforeDispatch,
    /// G28: a resource no node's current attempt owns is destroyed within
    /// `orphan_grace` + one scan interval once faults stop, and never one a
    /// current attempt owns.
    OrphansCollected,
    /// G29: in-flight creates never exceed a provider's cap; a group's drift
    /// replacement never takes more than `max_unavailable` ready nodes down
    /// at once.
    BudgetsHold,
    /// G30: an open breaker never blocks convergence forever once faults
    /// stop; while its probe is out, the slots it holds back are looked at
    /// again within one cool-down.
    BreakerLiveness,
    /// G32: a node's stage agrees with its facts — no stage claims a lease,
    /// endpoint, session, join or failure the record does not hold, and
    /// none hides one it does.
    StageCoherence,
    /// G37: after a controller crash and recovery, a node the journal held
    /// as ready is not ready, and the cluster not converged, until an
    /// observation of the new controller says its agent re-joined.
    ReadinessReEarned,
    /// G35: a peers update lists exactly the current attempts of the nodes
    /// the controller held ready when it sent it, never an attempt whose
    /// loss or teardown it had folded.
    Membership,
}

impl GuaranteeId {
    /// Every guarantee, in id order.
    pub const ALL: [GuaranteeId; 33] = [
        GuaranteeId::Identity,
        GuaranteeId::Correlation,
        GuaranteeId::AttemptFactOwnership,
        GuaranteeId::RecordBeforeDispatch,
        GuaranteeId::SingleFlight,
        GuaranteeId::DeadHold,
        GuaranteeId::CleanupKeepsFacts,
        GuaranteeId::NoDoubleCreate,
        GuaranteeId::BackoffDiscipline,
        GuaranteeId::AttemptFailure,
        GuaranteeId::ProbeIsNotFailure,
        GuaranteeId::AdoptBeforeDestroy,
        GuaranteeId::ErrorsNotPanics,
        GuaranteeId::ReadinessCoherence,
        GuaranteeId::SessionCoherence,
        GuaranteeId::MonotonicGeneration,
        GuaranteeId::ScaleDownOrder,
        GuaranteeId::Determinism,
        GuaranteeId::Quiescence,
        GuaranteeId::Confluence,
        GuaranteeId::FairConvergence,
        GuaranteeId::BoundedReplacement,
        GuaranteeId::ConvergedLeaksNothing,
        GuaranteeId::LatestDesiredWins,
        GuaranteeId::DeadlineBoundary,
        GuaranteeId::CrashSafety,
        GuaranteeId::DurableBeforeDispatch,
        GuaranteeId::OrphansCollected,
        GuaranteeId::BudgetsHold,
        GuaranteeId::BreakerLiveness,
        GuaranteeId::StageCoherence,
        GuaranteeId::ReadinessReEarned,
        GuaranteeId::Membership,
    ];

    /// The stable id (`G01`…`G30`, `G32`, `G35`, `G37`). Ids are the specification's, not
    /// positions: G31 (exhaustive exploration) is checked by the explorer
    /// and may have no variant here.
    pub fn id(self) -> &'static str {
        const IDS: [&str; 30] = [
            "G01", "G02", "G03", "G04", "G05", "G06", "G07", "G08", "G09", "G10", "G11", "G12",
            "G13", "G14", "G15", "G16", "G17", "G18", "G19", "G20", "G21", "G22", "G23", "G24",
            "G25", "G26", "G27", "G28", "G29", "G30",
        ];
        match self {
            GuaranteeId::StageCoherence => "G32",
            GuaranteeId::ReadinessReEarned => "G37",
            GuaranteeId::Membership => "G35",
            other => IDS[other as usize],
        }
    }

    /// A short name.
    pub fn name(self) -> &'static str {
        match self {
            GuaranteeId::Identity => "identity",
            GuaranteeId::Correlation => "correlation",
            GuaranteeId::AttemptFactOwnership => "attempt-fact ownership",
            GuaranteeId::RecordBeforeDispatch => "record-before-dispatch",
            GuaranteeId::SingleFlight => "single flight",
            GuaranteeId::DeadHold => "dead hold",
            GuaranteeId::CleanupKeepsFacts => "cleanup keeps facts",
            GuaranteeId::NoDoubleCreate => "no double-create",
            GuaranteeId::BackoffDiscipline => "backoff discipline",
            GuaranteeId::AttemptFailure => "attempt failure",
            GuaranteeId::ProbeIsNotFailure => "probe is not failure",
            GuaranteeId::AdoptBeforeDestroy => "adopt before destroy",
            GuaranteeId::ErrorsNotPanics => "errors, not panics",
            GuaranteeId::ReadinessCoherence => "readiness coherence",
            GuaranteeId::SessionCoherence => "session coherence",
            GuaranteeId::MonotonicGeneration => "monotonic generation",
            GuaranteeId::ScaleDownOrder => "scale-down order",
            GuaranteeId::Determinism => "determinism",
            GuaranteeId::Quiescence => "quiescence",
            GuaranteeId::Confluence => "confluence",
            GuaranteeId::FairConvergence => "fair convergence",
            GuaranteeId::BoundedReplacement => "bounded replacement",
            GuaranteeId::ConvergedLeaksNothing => "converged leaks nothing",
            GuaranteeId::LatestDesiredWins => "latest desired wins",
            GuaranteeId::DeadlineBoundary => "deadline boundary",
            GuaranteeId::CrashSafety => "crash safety",
            GuaranteeId::DurableBeforeDispatch => "durable before dispatch",
            GuaranteeId::OrphansCollected => "orphans collected",
            GuaranteeId::BudgetsHold => "budgets hold",
            GuaranteeId::BreakerLiveness => "breaker liveness",
            GuaranteeId::StageCoherence => "stage coherence",
            GuaranteeId::ReadinessReEarned => "readiness is re-earned",
            GuaranteeId::Membership => "membership",
        }
    }

    /// The guarantee with stable id `id` (`"G08"`), if any.
    pub fn from_id(id: &str) -> Option<GuaranteeId> {
        GuaranteeId::ALL.into_iter().find(|g| g.id() == id)
    }
}

impl fmt::Display for GuaranteeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.id(), self.name())
    }
}

/// Where in a run a violation was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Setting up the initial shape, before the first input.
    Setup,
    /// While applying input number `n` (0-based) of the trace.
    Input(usize),
    /// In round `n` of the fair-scheduler tail.
    Tail(usize),
    /// In a check run after the whole trace (determinism, confluence, end state).
    End,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Setup => f.write_str("setup"),
            Phase::Input(n) => write!(f, "input #{n}"),
            Phase::Tail(n) => write!(f, "fair tail round {n}"),
            Phase::End => f.write_str("end of run"),
        }
    }
}

/// A guarantee found broken, with where and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The guarantee.
    pub guarantee: GuaranteeId,
    /// Where in the run.
    pub phase: Phase,
    /// What the oracle saw, for a human.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {}: {}", self.guarantee, self.phase, self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_round_trip() {
        for guarantee in GuaranteeId::ALL {
            assert_eq!(GuaranteeId::from_id(guarantee.id()), Some(guarantee));
        }
        for (index, guarantee) in GuaranteeId::ALL[..30].iter().enumerate() {
            assert_eq!(guarantee.id(), format!("G{:02}", index + 1));
        }
        assert_eq!(GuaranteeId::NoDoubleCreate.id(), "G08");
        assert_eq!(GuaranteeId::ConvergedLeaksNothing.id(), "G23");
        assert_eq!(GuaranteeId::CrashSafety.id(), "G26");
        assert_eq!(GuaranteeId::OrphansCollected.id(), "G28");
        assert_eq!(GuaranteeId::BudgetsHold.id(), "G29");
        assert_eq!(GuaranteeId::BreakerLiveness.id(), "G30");
        assert_eq!(GuaranteeId::StageCoherence.id(), "G32");
        assert_eq!(GuaranteeId::ReadinessReEarned.id(), "G37");
        assert_eq!(GuaranteeId::Membership.id(), "G35");
    }
}
