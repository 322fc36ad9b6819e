//! The oracle: one named check per guarantee and per place it applies.
//!
//! Checks are pure functions of what the harness observed (state snapshots,
//! the substrate's ledger, the fold or pass that just happened) and return a
//! [`Breach`] naming the guarantee. The harness decides when to run them:
//!
//! | When | Checks |
//! |---|---|
//! | after every input (settled) | G01 G02 G03 G06 G08 G14 G15 G16 G17 G32, G19 "converged means no requeue" |
//! | after every fold of a result or observation | G32 G07 G09 G11 G12 |
//! | for every stale delivery | G02 (results), G03 (observations of other attempts): nothing changes |
//! | after every pass batch (`drive_until_blocked`) | G01 (new attempts, ids ever seen) G32 G06/G07 (replacement) G09 (failure counts, backoff) G10 (failed and deleting nodes clean up) G12 (retry bookkeeping untouched by passes) G17 G25 (stored deadline) |
//!
//! The oracle keeps its own model where the driver's answer would vouch for
//! itself: deadlines are compared in plain milliseconds, never with the
//! core's `Timestamp` comparisons; desired slots come from the kit's model
//! of the shapes it submitted ([`DesiredSlots`]), never the driver's
//! `DesiredState`; expected delays come from the kit's own count of a
//! slot's consecutive failures; attempt ids are checked against every id the
//! kit has seen in the run ([`AttemptsSeen`]).
//! | for every backend call start | G04 G05 |
//! | at every host wake on an operation deadline | G25 (not a tick early), G02 (the timeout reported twice) |
//! | every few inputs and at the end | G19 forced pass |
//! | revision probes | G16 |
//! | after the fair tail | G21 G22 G23 G24 |
//! | across runs of one trace | G18 (same trace twice), G20 (tail work in another order) |
//! | at every recovery after a crash | G26 (pending operations made ambiguous, journal readable, recovery succeeds) |
//! | at every backend call start | G27 (committed as pending before the call) |
//! | after every input and tail round; at every orphan destroy | G28 (collected in time once faults stop; never an owned resource) |

use std::collections::{BTreeMap, BTreeSet};

use provisioning::MaxUnavailable;
use provisioning::effect::{EffectOutput, EndpointLookup};
use provisioning::observe::BootstrapEvent;
use provisioning::shape::DesiredState;
use provisioning::state::{PendingOperation, SessionState};
use provisioning::{
    ClusterState, EffectKind, ExecutorResult, GroupId, Intent, LeaseHandle, LogicalNodeId,
    ManagedNode, NodeAttemptId, NodeStage, Observation, RetryPolicy, SessionHandle, Timestamp,
};

use crate::guarantee::GuaranteeId;
use crate::substrate::{CallRecord, LiveResources, ResourceKey};

/// A broken guarantee, before the harness adds where it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Breach {
    pub(crate) guarantee: GuaranteeId,
    pub(crate) detail: String,
}

pub(crate) type Verdict = Result<(), Breach>;

pub(crate) fn breach(guarantee: GuaranteeId, detail: impl Into<String>) -> Breach {
    Breach {
        guarantee,
        detail: detail.into(),
    }
}

fn ensure(condition: bool, guarantee: GuaranteeId, detail: impl FnOnce() -> String) -> Verdict {
    if condition {
        Ok(())
    } else {
        Err(breach(guarantee, detail()))
    }
}

fn label(id: &LogicalNodeId, node: &ManagedNode) -> String {
    format!("{id}/{}", node.attempt)
}

// ---------------------------------------------------------------------------
// The kit's own arithmetic on time: plain milliseconds, never the core's
// `Timestamp` comparisons, so a core that compares deadlines wrongly cannot
// fool the oracle with the same mistake.
// ---------------------------------------------------------------------------

/// Whether `now` is at or past `deadline`, in plain milliseconds.
pub(crate) fn at_or_after(now: Timestamp, deadline: Timestamp) -> bool {
    now.as_millis() >= deadline.as_millis()
}

/// Whether `deadline` is strictly later than `now`, in plain milliseconds.
pub(crate) fn later_than(deadline: Timestamp, now: Timestamp) -> bool {
    deadline.as_millis() > now.as_millis()
}

/// `now + delay` in plain milliseconds, `None` past the end of the clock.
/// A delay with a sub-millisecond part is rounded up (a deadline is never
/// earlier than its delay), as SPEC's clock counts whole milliseconds.
pub(crate) fn plus_ms(now: Timestamp, delay: std::time::Duration) -> Option<u64> {
    let mut delay_ms = u64::try_from(delay.as_millis()).ok()?;
    if delay.subsec_nanos() % 1_000_000 != 0 {
        delay_ms = delay_ms.checked_add(1)?;
    }
    now.as_millis().checked_add(delay_ms)
}

/// What a fold was about, for the fold checks.
pub(crate) enum FoldCause<'a> {
    /// The result of the node's pending operation.
    Result(&'a ExecutorResult),
    /// An observation of the node's current attempt.
    Observation(&'a Observation),
}

impl FoldCause<'_> {
    fn succeeded_with(&self, wanted: fn(&EffectOutput) -> bool) -> bool {
        matches!(self, FoldCause::Result(r) if r.outcome.as_ref().is_ok_and(wanted))
    }

    fn is_probe(&self) -> bool {
        self.succeeded_with(|o| matches!(o, EffectOutput::Endpoint(EndpointLookup::NotReady)))
    }

    fn describe(&self) -> String {
        match self {
            FoldCause::Result(r) => match &r.outcome {
                Ok(output) => format!("result of {} {}: ok {output:?}", r.kind, r.op),
                Err(error) => format!("result of {} {}: {error}", r.kind, r.op),
            },
            FoldCause::Observation(o) => format!("observation {o:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// State checks, after every settled input.
// ---------------------------------------------------------------------------

/// G01: attempt ids are unique across nodes and below the allocator.
pub(crate) fn g01_identity_in_state(state: &ClusterState) -> Verdict {
    let limit = state.attempts.next_unallocated();
    let mut seen: BTreeMap<NodeAttemptId, &LogicalNodeId> = BTreeMap::new();
    for (id, node) in &state.nodes {
        ensure(node.attempt.get() < limit, GuaranteeId::Identity, || {
            format!(
                "{} holds an attempt at or above the allocator ({limit})",
                label(id, node)
            )
        })?;
        if let Some(other) = seen.insert(node.attempt, id) {
            return Err(breach(
                GuaranteeId::Identity,
                format!("attempt {} is held by both {other} and {id}", node.attempt),
            ));
        }
    }
    Ok(())
}

/// G02: a pending operation belongs to its node's current attempt.
pub(crate) fn g02_pending_belongs_to_current_attempt(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        if let Some(pending) = &node.pending {
            ensure(
                pending.id.attempt() == node.attempt,
                GuaranteeId::Correlation,
                || {
                    format!(
                        "{} has pending {} of another attempt",
                        label(id, node),
                        pending.id
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// G03: the facts a node holds were produced for its current attempt — both
/// as the state records it and as the substrate issued the handles.
pub(crate) fn g03_facts_belong_to_current_attempt(
    state: &ClusterState,
    lease_owner: &dyn Fn(&LeaseHandle) -> Option<ResourceKey>,
    session_owner: &dyn Fn(&SessionHandle) -> Option<ResourceKey>,
) -> Verdict {
    for (id, node) in &state.nodes {
        let record = &node.record;
        let attempts = [
            ("lease", record.lease.as_ref().map(|f| f.attempt)),
            ("endpoint", record.endpoint.as_ref().map(|f| f.attempt)),
            ("bootstrap", record.bootstrap.as_ref().map(|f| f.attempt)),
            ("swarm join", record.swarm.as_ref().map(|f| f.attempt)),
        ];
        for (fact, attempt) in attempts {
            if let Some(attempt) = attempt {
                ensure(
                    attempt == node.attempt,
                    GuaranteeId::AttemptFactOwnership,
                    || {
                        format!(
                            "{} holds {fact} facts of attempt {attempt}",
                            label(id, node)
                        )
                    },
                )?;
            }
        }
        let key = (id.clone(), node.attempt);
        if let Some(lease) = &record.lease {
            if let Some(owner) = lease_owner(&lease.lease) {
                ensure(owner == key, GuaranteeId::AttemptFactOwnership, || {
                    format!(
                        "{} holds lease {:?}, which the backend issued for {}/{}",
                        label(id, node),
                        lease.lease.0,
                        owner.0,
                        owner.1
                    )
                })?;
            }
        }
        if let Some(session) = record.bootstrap.as_ref().and_then(|b| b.session.as_ref()) {
            if let Some(owner) = session_owner(session) {
                ensure(owner == key, GuaranteeId::AttemptFactOwnership, || {
                    format!(
                        "{} holds session {:?}, which the backend issued for {}/{}",
                        label(id, node),
                        session.0,
                        owner.0,
                        owner.1
                    )
                })?;
            }
        }
    }
    Ok(())
}

/// G06: a destroyed node holds no lease, session or pending operation.
pub(crate) fn g06_dead_nodes_hold_nothing(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        if node.record.stage != NodeStage::Destroyed {
            continue;
        }
        ensure(
            node.record.lease.is_none() && !node.record.session_active() && node.pending.is_none(),
            GuaranteeId::DeadHold,
            || {
                format!(
                    "destroyed {} still holds lease={} session_active={} pending={:?}",
                    label(id, node),
                    node.record.lease.is_some(),
                    node.record.session_active(),
                    node.pending_op()
                )
            },
        )?;
    }
    Ok(())
}

/// G08: at most one live resource per key, and live resources of at most one
/// attempt per slot.
pub(crate) fn g08_no_double_create(live: &LiveResources) -> Verdict {
    let mut attempts_of: BTreeMap<&LogicalNodeId, BTreeSet<NodeAttemptId>> = BTreeMap::new();
    for (what, map) in [("leases", &live.leases), ("sessions", &live.sessions)] {
        for ((node, attempt), count) in map {
            ensure(*count <= 1, GuaranteeId::NoDoubleCreate, || {
                format!("the backend holds {count} live {what} for {node}/{attempt}")
            })?;
            if *count > 0 {
                attempts_of.entry(node).or_default().insert(*attempt);
            }
        }
    }
    for (node, attempts) in attempts_of {
        ensure(attempts.len() <= 1, GuaranteeId::NoDoubleCreate, || {
            format!("the backend holds live resources of attempts {attempts:?} of slot {node}")
        })?;
    }
    Ok(())
}

/// G14: readiness implies active, the full fact set and the desired spec;
/// deleting implies not ready. `settled` says no pass is queued, so a ready
/// node whose spec just changed has been looked at — unless its group's
/// rollout budget (in `budgets`) is spent, when it may wait (G29).
pub(crate) fn g14_readiness_coherence(
    state: &ClusterState,
    desired: &DesiredState,
    settled: bool,
    budgets: &BTreeMap<GroupId, MaxUnavailable>,
) -> Verdict {
    for (id, node) in &state.nodes {
        let record = &node.record;
        if node.intent == Intent::Deleting {
            ensure(!record.ready, GuaranteeId::ReadinessCoherence, || {
                format!("deleting {} is marked ready", label(id, node))
            })?;
        }
        if !record.ready {
            continue;
        }
        let missing: Vec<&str> = [
            (node.intent == Intent::Active, "active intent"),
            (
                matches!(record.stage, NodeStage::HandedOff | NodeStage::Dormant),
                "a ready stage",
            ),
            (record.lease.is_some(), "lease"),
            (record.endpoint.is_some(), "endpoint"),
            (record.swarm.is_some(), "swarm join"),
            (record.handed_off_at.is_some(), "handoff"),
        ]
        .into_iter()
        .filter(|(present, _)| !present)
        .map(|(_, what)| what)
        .collect();
        ensure(missing.is_empty(), GuaranteeId::ReadinessCoherence, || {
            format!("ready {} lacks {}", label(id, node), missing.join(", "))
        })?;
        // A drifted ready node may wait while its group's rollout budget is
        // spent (G29); it then still holds the old spec.
        let held_by_budget = budgets.get(id.group()).is_some_and(|budget| {
            let count = desired.groups().get(id.group()).map_or(0, |g| g.count());
            unavailable_slots(state, desired, id.group()) >= budget.of(count)
        });
        if settled && !held_by_budget {
            ensure(
                desired.spec(id).is_some_and(|spec| spec == node.spec),
                GuaranteeId::ReadinessCoherence,
                || format!("ready {} does not hold the desired spec", label(id, node)),
            )?;
        }
    }
    Ok(())
}

/// G15: an active session implies bootstrap facts of a node that has a
/// lease and an endpoint stage; bootstrap stages imply bootstrap facts.
pub(crate) fn g15_session_coherence(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        let record = &node.record;
        if record.session_active() {
            ensure(
                record.lease.is_some()
                    && !matches!(
                        record.stage,
                        NodeStage::New | NodeStage::LeaseRequested | NodeStage::LeaseCreated
                    ),
                GuaranteeId::SessionCoherence,
                || {
                    format!(
                        "{} has an active session without a lease and endpoint (stage {})",
                        label(id, node),
                        record.stage.name()
                    )
                },
            )?;
        }
        if matches!(
            record.stage,
            NodeStage::BootstrapRunning | NodeStage::SwarmJoined
        ) {
            ensure(
                record.bootstrap.is_some(),
                GuaranteeId::SessionCoherence,
                || {
                    format!(
                        "{} is in stage {} without bootstrap facts",
                        label(id, node),
                        record.stage.name()
                    )
                },
            )?;
        }
    }
    Ok(())
}

/// G16: the observed generation never decreases and never passes the
/// desired one.
pub(crate) fn g16_generation_is_monotonic(
    state: &ClusterState,
    desired: &DesiredState,
    highest_seen: &mut Option<u64>,
) -> Verdict {
    let observed = state.observed_generation.map(|g| g.get());
    ensure(
        observed >= *highest_seen,
        GuaranteeId::MonotonicGeneration,
        || format!("observed generation went from {highest_seen:?} down to {observed:?}"),
    )?;
    ensure(
        observed <= Some(desired.generation().get()),
        GuaranteeId::MonotonicGeneration,
        || {
            format!(
                "observed generation {observed:?} is ahead of the desired {}",
                desired.generation()
            )
        },
    )?;
    *highest_seen = observed;
    Ok(())
}

/// G17 (settled form): no node of an undesired slot is still active, so a
/// shrunk group has shed exactly its highest indices.
pub(crate) fn g17_undesired_slots_are_not_active(
    state: &ClusterState,
    desired: &DesiredSlots,
) -> Verdict {
    for (id, node) in &state.nodes {
        if node.intent == Intent::Active && node.record.stage != NodeStage::Destroyed {
            ensure(desired.contains(id), GuaranteeId::ScaleDownOrder, || {
                format!(
                    "{} is still active although its slot is no longer desired",
                    label(id, node)
                )
            })?;
        }
    }
    Ok(())
}

/// G04 (report form): what a drive reports it dispatched and refused is
/// what its sink accepted and refused; a host counts and meters operations
/// from this report.
pub(crate) fn g04_drive_report_matches_sink(
    reported_dispatched: usize,
    reported_refused: usize,
    accepted: usize,
    refused: usize,
) -> Verdict {
    ensure(
        reported_dispatched == accepted && reported_refused == refused,
        GuaranteeId::RecordBeforeDispatch,
        || {
            format!(
                "a drive reported {reported_dispatched} operations dispatched and {reported_refused} refused, but its sink accepted {accepted} and refused {refused}"
            )
        },
    )
}

/// G26 (report form): recovery reports what the journal held: every
/// stored node, every stored pending operation made ambiguous, the stored
/// generation, and no allocator mark it had to raise (the kit's journal is
/// written by a correct writer, so a raised mark is a recovery that misread
/// it). An operator reads this report when `up` resumes a run.
pub(crate) fn g26_recovery_reports_what_it_recovered(
    report: &provisioning::durable::RecoveryReport,
    stored_nodes: usize,
    stored_pending: usize,
    streaming: usize,
    stored_generation: provisioning::Generation,
) -> Verdict {
    ensure(
        report.nodes == stored_nodes
            && report.pending_made_ambiguous == stored_pending
            && report.sessions_restarted == streaming
            && report.generation == stored_generation
            && !report.allocator_raised,
        GuaranteeId::CrashSafety,
        || {
            format!(
                "recovery reported {report:?}, but the journal held {stored_nodes} nodes, {stored_pending} pending operations, {streaming} sessions streaming before their handoff and generation {stored_generation:?}, written by a correct writer"
            )
        },
    )
}

/// G04 (executor form): the executor's counters agree with what the kit saw
/// it do: the calls it started in the backend (counted by the kit's wrapper
/// around the backend), the operations it expired (those for which
/// `expire` answered with a timeout) and the submissions it queued behind
/// an older operation of their attempt (those it answered "queued"). A host
/// meters all three. Each pair is (the executor's count, the kit's).
pub(crate) fn g04_executor_counts_what_it_did(
    started: (u64, u64),
    expired: (u64, usize),
    queued: (u64, u64),
) -> Verdict {
    ensure(
        started.0 == started.1
            && usize::try_from(expired.0).ok() == Some(expired.1)
            && queued.0 == queued.1,
        GuaranteeId::RecordBeforeDispatch,
        || {
            format!(
                "the executor counts {} calls started, {} operations expired and {} submissions queued, but the kit saw {} calls reach the backend, {} expiries and {} submissions answered as queued",
                started.0, expired.0, queued.0, started.1, expired.1, queued.1
            )
        },
    )
}

/// What the kit saw of the live controller's executor since it was made,
/// to hold its result counters to (G04, count form). Every figure is the
/// kit's own: results the host took, submissions it saw answered by a
/// replay, wake-ups it received, calls its backend wrapper saw start and
/// end, panics it saw come out of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ExecutorSeen {
    /// Results the host took from the executor (completions and replays).
    pub(crate) taken: u64,
    /// Submissions the executor answered by replaying a kept result.
    pub(crate) replayed: u64,
    /// Times the executor said a result was ready to be taken.
    pub(crate) notified: u64,
    /// Backend calls of the executor that started and ended.
    pub(crate) calls_ended: u64,
    /// Backend panics that came out of the executor's calls.
    pub(crate) panics: u64,
    /// Operations the executor answered as started that never reached the
    /// backend, when no work is runnable (so their tasks ran); `None`
    /// while some work is runnable.
    pub(crate) started_never_called: Option<u64>,
    /// Operations that waited behind an older one of their attempt, never
    /// reached the backend, and were overtaken by a newer submission the
    /// executor said it started.
    pub(crate) skipped_at_submission: u64,
    /// Operations that waited behind an older one of their attempt, never
    /// reached the backend, and expired through the executor.
    pub(crate) skipped_at_expiry: u64,
    /// Operations it answered as started or queued that the kit has not
    /// seen reach the backend: the most it can have skipped.
    pub(crate) uncalled: u64,
}

/// G04 (result count form): the executor's result counters, which a host
/// meters, agree with what the kit saw, at a point where the host has
/// taken every result (the harness settles first):
/// - every result it reported was taken: the completed ones and the
///   replayed ones add up to the results the host took, and it woke the
///   host once per result (`with_notify`'s contract);
/// - it counts every backend panic of its calls;
/// - a call that ended without a result is a late result dropped, and what
///   else it counts as dropped late never reached the backend: at least
///   the calls whose result it did not report, at most those and the
///   operations it skipped;
/// - an operation it said it started and whose task ran without reaching
///   the backend was skipped, and so was one that waited behind an older
///   operation of its attempt, never reached the backend, and was
///   overtaken by a newer one it said it started or queued, or expired
///   through it; and nothing else was: it skipped no more operations than
///   it took (started or queued) and never called.
pub(crate) fn g04_executor_accounts_for_its_results(
    counters: &provisioning::executor::ExecutorCounters,
    seen: &ExecutorSeen,
) -> Verdict {
    let guarantee = GuaranteeId::RecordBeforeDispatch;
    ensure(
        counters.completed.checked_add(seen.replayed) == Some(seen.taken),
        guarantee,
        || {
            format!(
                "the executor counts {} results completed, and the kit saw {} submissions answered by a replay, but the host took {} results from it (expected completed + replayed = taken)",
                counters.completed, seen.replayed, seen.taken
            )
        },
    )?;
    ensure(seen.notified == seen.taken, guarantee, || {
        format!(
            "the executor said a result was ready {} times, but the host took {} results from it (expected one wake-up per result)",
            seen.notified, seen.taken
        )
    })?;
    ensure(counters.panics == seen.panics, guarantee, || {
        format!(
            "the executor counts {} backend panics, but the kit saw {} panics come out of its backend calls",
            counters.panics, seen.panics
        )
    })?;
    // Results of calls: what the host took, less the replays.
    let reported = seen.taken.saturating_sub(seen.replayed);
    ensure(reported <= seen.calls_ended, guarantee, || {
        format!(
            "the host took {reported} results of calls from the executor (besides replays), but only {} of its backend calls ended",
            seen.calls_ended
        )
    })?;
    let unreported = seen.calls_ended - reported;
    ensure(
        counters.late_dropped >= unreported
            && counters.late_dropped - unreported <= counters.skipped,
        guarantee,
        || {
            format!(
                "the executor counts {} late results dropped and {} operations skipped, but {} of its backend calls ended without their result reported (expected dropped >= {unreported}, and dropped - {unreported} <= skipped: a result dropped without a call is a skipped operation's)",
                counters.late_dropped, counters.skipped, unreported
            )
        },
    )?;
    let never = seen.started_never_called.unwrap_or(0);
    ensure(
        counters.skipped
            >= never
                .saturating_add(seen.skipped_at_submission)
                .saturating_add(seen.skipped_at_expiry),
        guarantee,
        || {
            format!(
                "the executor counts {} operations skipped, but {} operations that waited behind an older one were overtaken by a newer one it said it started or queued, {} expired through it while they waited, and {} operations it said it started never reached the backend{}",
                counters.skipped,
                seen.skipped_at_submission,
                seen.skipped_at_expiry,
                never,
                if seen.started_never_called.is_some() {
                    ", with no work left to run"
                } else {
                    " (not counted while work is runnable)"
                }
            )
        },
    )?;
    ensure(counters.skipped <= seen.uncalled, guarantee, || {
        format!(
            "the executor counts {} operations skipped, but only {} operations it took (started or queued) have not reached the backend",
            counters.skipped, seen.uncalled
        )
    })
}

/// G13 (panic form): the result of a call whose backend panicked is a
/// definite error that carries the panic's message (`text`, when the
/// payload was text): an operator must see why the call failed.
pub(crate) fn g13_panic_reported_with_its_message(
    result: &ExecutorResult,
    text: Option<&str>,
) -> Verdict {
    let shown = match &result.outcome {
        Err(error) => {
            error.disposition == provisioning::effect::Disposition::Definite
                && text.is_none_or(|text| error.message.contains(text))
        }
        Ok(_) => false,
    };
    ensure(shown, GuaranteeId::ErrorsNotPanics, || {
        format!(
            "the backend panicked during {} {} for {} with {}, but the executor reported {:?} (expected a definite error carrying the panic's message)",
            result.kind,
            result.op,
            result.node,
            text.map_or_else(|| "a non-text payload".to_owned(), |t| format!("{t:?}")),
            result.outcome
        )
    })
}

/// G04 (driver count form): the driver's counters, which a host meters,
/// agree with what the kit saw it do since it was made: `seen` holds the
/// passes its drives reported, the operations the kit's sink received and
/// refused, the folds it accepted and rejected, and the timeouts it folded.
pub(crate) fn g04_driver_counts_what_it_did(
    counted: &provisioning::driver::DriverCounters,
    seen: [u64; 6],
) -> Verdict {
    let said = [
        counted.passes,
        counted.dispatched,
        counted.refused,
        counted.folded,
        counted.rejected,
        counted.timeouts,
    ];
    ensure(said == seen, GuaranteeId::RecordBeforeDispatch, || {
        format!(
            "the driver counts passes, dispatched, refused, folded, rejected and timeouts as {said:?}, but the kit saw {seen:?}"
        )
    })
}

/// G30 (resume form): `provision resume GROUP` says whether the group's
/// breaker was open, and leaves it closed.
pub(crate) fn g30_resume_reports_and_closes(
    group: &GroupId,
    was_open: Option<bool>,
    reported: bool,
    open_after: Option<bool>,
) -> Verdict {
    if let Some(was_open) = was_open {
        ensure(reported == was_open, GuaranteeId::BreakerLiveness, || {
            format!(
                "resume of group {group} reported that its breaker was {}, but it was {}",
                if reported { "open" } else { "closed" },
                if was_open { "open" } else { "closed" }
            )
        })?;
    }
    ensure(
        open_after != Some(true),
        GuaranteeId::BreakerLiveness,
        || format!("after resume of group {group} its breaker still holds new attempts back"),
    )
}

/// G30 (resume form): the pass a resume of an open breaker queues gives
/// every desired slot of the group its node at once (the breaker held
/// their inserts and restarts; nothing else holds an insert).
pub(crate) fn g30_resumed_group_is_not_held(
    state: &ClusterState,
    slots: &DesiredSlots,
    group: &GroupId,
    was_open: bool,
    now: Timestamp,
) -> Verdict {
    if !was_open {
        return Ok(());
    }
    for index in 0..slots.count(group) {
        let id = LogicalNodeId::new(group.clone(), index);
        let held = match state.nodes.get(&id) {
            None => true,
            // A destroyed node whose restart is due must have restarted.
            Some(node) => {
                node.record.stage == NodeStage::Destroyed
                    && node.retry.restart_at.is_none_or(|at| at_or_after(now, at))
            }
        };
        ensure(!held, GuaranteeId::BreakerLiveness, || {
            format!(
                "group {group}'s breaker was resumed, but desired slot {id} still waits for its attempt after the next pass"
            )
        })?;
    }
    Ok(())
}

/// G02 (expiry form): the executor expires an operation it still holds
/// (accepted, no result published) with its timeout, so that the operation's
/// late completion is dropped and never folded.
pub(crate) fn g02_executor_expires_what_it_holds(
    op: provisioning::OperationId,
    held: bool,
) -> Verdict {
    ensure(!held, GuaranteeId::Correlation, || {
        format!(
            "the executor did not expire {op}, which it still holds (accepted, no result published)"
        )
    })
}

/// G19 (state form): a converged cluster has nothing to requeue.
pub(crate) fn g19_converged_has_no_requeue(
    converged: bool,
    requeue_at: Option<Timestamp>,
) -> Verdict {
    ensure(
        !converged || requeue_at.is_none(),
        GuaranteeId::Quiescence,
        || format!("the cluster is converged but requeues at {requeue_at:?}"),
    )
}

/// G19 (plan form): a settled driver agrees with a full pass of the pure
/// decider over the same state. The decider would take no step (a step it
/// would take is one the driver's incremental passes missed), and the
/// driver's timer is the plan's earliest wake (a timer set later than that
/// stalls a node; one set earlier spins the host). Only meaningful while no
/// operator limit is in force: the decider does not know about the launch
/// cap, the rollout budget or the breakers, which hold steps back on
/// purpose and add wakes of their own.
pub(crate) fn g19_settled_driver_agrees_with_plan(
    state: &ClusterState,
    desired: &DesiredState,
    now: Timestamp,
    requeue_at: Option<Timestamp>,
) -> Verdict {
    let plan = provisioning::reconcile(state, desired, now);
    if let Some(step) = plan.actions.first() {
        return Err(breach(
            GuaranteeId::Quiescence,
            format!(
                "the driver settled, but a full pass of the decider would still act: {} {:?} (row {:?}){}",
                step.node,
                step.action,
                step.rule,
                if plan.actions.len() > 1 {
                    format!(" and {} more", plan.actions.len() - 1)
                } else {
                    String::new()
                }
            ),
        ));
    }
    ensure(
        plan.requeue_at.map(Timestamp::as_millis) == requeue_at.map(Timestamp::as_millis),
        GuaranteeId::Quiescence,
        || {
            format!(
                "the settled driver wakes at {requeue_at:?}, but the decider's plan asks for {:?}",
                plan.requeue_at
            )
        },
    )?;
    g19_reference_decider_agrees(state, desired, now, requeue_at)
}

/// G19 (reference form): the decider in its plainest public form, every
/// slot's spec built and decided one node at a time (`for_each_slot` and
/// `reconcile_node`, what `provision plan` and the core's own tests lean
/// on), agrees with the settled driver as the full pass does.
fn g19_reference_decider_agrees(
    state: &ClusterState,
    desired: &DesiredState,
    now: Timestamp,
    requeue_at: Option<Timestamp>,
) -> Verdict {
    let mut first_step = None;
    let mut wake: Option<u64> = None;
    provisioning::decide::for_each_slot(state, desired, |node, spec| {
        let Some(decision) = provisioning::reconcile_node(node, spec, now) else {
            return;
        };
        if let Some(at) = decision.wake.map(|w| w.at().as_millis()) {
            wake = Some(wake.map_or(at, |earliest| earliest.min(at)));
        }
        if decision.action != provisioning::NodeAction::None && first_step.is_none() {
            let id = spec.map(|s| s.id()).or(node.map(|n| n.spec.id()));
            first_step = Some(format!(
                "{} {:?} (row {:?})",
                id.map(ToString::to_string).unwrap_or_default(),
                decision.action,
                decision.rule
            ));
        }
    });
    if let Some(step) = first_step {
        return Err(breach(
            GuaranteeId::Quiescence,
            format!(
                "the driver settled, but the reference decider (each slot's spec built and decided alone) would still act: {step}"
            ),
        ));
    }
    ensure(
        wake == requeue_at.map(Timestamp::as_millis),
        GuaranteeId::Quiescence,
        || {
            format!(
                "the settled driver wakes at {requeue_at:?}, but the reference decider asks for {wake:?} ms"
            )
        },
    )
}

/// What a node's history entry says of it: attempt, stage, whether it is
/// being torn down, whether it is ready.
pub(crate) type Condition = (NodeAttemptId, NodeStage, bool, bool);

/// The condition of `node`, by the kit's reading of its fields.
pub(crate) fn condition(node: &ManagedNode) -> Condition {
    (
        node.attempt,
        node.record.stage,
        node.intent == Intent::Deleting,
        node.is_ready(),
    )
}

/// G32 (history form): a node's kept history agrees with the node. Its
/// newest entry describes the node's present attempt, stage, intent and
/// readiness (a failed node's entry carries the failure's reason); it keeps
/// at most `depth` entries, in time order, none later than `now`; a node
/// that changed since the controller started has a history (one that did
/// not may have none: histories are not journaled); a removed node has none.
pub(crate) fn g32_history_agrees_with_nodes<'a>(
    state: &ClusterState,
    history: impl Fn(&LogicalNodeId) -> Option<&'a provisioning::NodeHistory>,
    at_start: &BTreeMap<LogicalNodeId, Condition>,
    removed: &BTreeSet<LogicalNodeId>,
    depth: usize,
    now: Timestamp,
) -> Verdict {
    for id in removed {
        ensure(history(id).is_none(), GuaranteeId::StageCoherence, || {
            format!("{id} was removed, but its history is still kept")
        })?;
    }
    for (id, node) in &state.nodes {
        let now_condition = condition(node);
        let entries: Vec<&provisioning::Transition> = history(id)
            .map(|h| h.entries().collect())
            .unwrap_or_default();
        let Some(newest) = entries.last().copied() else {
            ensure(
                at_start.get(id) == Some(&now_condition),
                GuaranteeId::StageCoherence,
                || {
                    format!(
                        "{} changed since the controller started (now {:?}), but its history is empty",
                        label(id, node),
                        node.record.stage
                    )
                },
            )?;
            continue;
        };
        ensure(entries.len() <= depth, GuaranteeId::StageCoherence, || {
            format!(
                "{} keeps {} history entries, over the depth of {depth}",
                label(id, node),
                entries.len()
            )
        })?;
        let ordered = entries
            .windows(2)
            .all(|pair| pair[0].at.as_millis() <= pair[1].at.as_millis());
        ensure(
            ordered && newest.at.as_millis() <= now.as_millis(),
            GuaranteeId::StageCoherence,
            || {
                format!(
                    "{}'s history is out of time order or ahead of the clock",
                    label(id, node)
                )
            },
        )?;
        let said = (newest.attempt, newest.stage, newest.deleting, newest.ready);
        ensure(said == now_condition, GuaranteeId::StageCoherence, || {
            format!(
                "{}'s newest history entry says {said:?}, but the node is {now_condition:?}",
                label(id, node)
            )
        })?;
        if node.record.stage == NodeStage::Failed {
            // The failure's own entry gives its reason; the teardown's entry
            // says it tears down a failed attempt. An attempt keeps the
            // reason it failed for (finding 12): a later failure folded while
            // it is torn down is only its last error.
            let reason = node.record.failure.as_ref().map(|f| f.reason.as_str());
            let said = newest.reason.as_deref();
            let agrees = (reason.is_some() && said == reason)
                || (newest.deleting && said.is_some_and(|said| said.starts_with("failed: ")));
            ensure(agrees, GuaranteeId::StageCoherence, || {
                format!(
                    "failed {}'s newest history entry gives the reason {said:?}, the record {reason:?}",
                    label(id, node)
                )
            })?;
        }
    }
    Ok(())
}

/// G32 (loss form): a loss that fails a node gives it a reason naming what
/// was lost, in the kit's own words for each cause (the agent, the lease,
/// the workload): what an operator reads in `status` and the history.
pub(crate) fn g32_loss_names_what_was_lost(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> Verdict {
    let FoldCause::Observation(Observation::NodeLost { cause: lost, .. }) = cause else {
        return Ok(());
    };
    if before.record.failure.is_some() {
        return Ok(());
    }
    let Some(failure) = &after.record.failure else {
        return Ok(());
    };
    let word = match lost {
        provisioning::LossCause::AgentGone => "agent",
        provisioning::LossCause::LeaseGone => "lease",
        provisioning::LossCause::WorkloadExited => "workload",
    };
    ensure(
        failure.reason.contains(word),
        GuaranteeId::StageCoherence,
        || {
            format!(
                "{} failed on a loss of its {word}, but its reason is {:?}",
                label(id, after),
                failure.reason
            )
        },
    )
}

/// G32 (teardown form): the history entry where a teardown of a healthy
/// attempt began says why, as the kit's own shape has it: a slot no longer
/// desired was scaled down, a slot desired with another template drifted,
/// and neither is claimed otherwise. `desired_same`: `None` when the slot
/// is not desired, else whether its desired template is the node's.
pub(crate) fn g32_teardown_names_its_cause(
    id: &LogicalNodeId,
    entry: &provisioning::Transition,
    desired_same: Option<bool>,
) -> Verdict {
    let said = entry.reason.as_deref().unwrap_or("");
    let says_scale = said.contains("scaled down");
    let says_drift = said.contains("drift");
    let (agrees, why) = match desired_same {
        None => (says_scale && !says_drift, "its slot is no longer desired"),
        Some(false) => (
            says_drift && !says_scale,
            "its slot is desired with another template (drift)",
        ),
        Some(true) => (
            !says_scale && !says_drift,
            "its slot is desired with its own template",
        ),
    };
    ensure(agrees, GuaranteeId::StageCoherence, || {
        format!(
            "{id}'s teardown of {} began with the reason {:?}, but {why}",
            entry.attempt, entry.reason
        )
    })
}

// ---------------------------------------------------------------------------
// Fold checks: `before` and `after` are one node around one fold.
// ---------------------------------------------------------------------------

/// G07: live facts disappear only when absence is confirmed.
pub(crate) fn g07_facts_leave_only_on_confirmed_absence(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> Verdict {
    if before.record.failure.is_some() {
        // A failed attempt only waits for cleanup: a late stream event of it
        // may neither add facts nor end its session (cleanup must still
        // cancel it; the provider answers "absent" if it is gone).
        ensure(
            !matches!(cause, FoldCause::Observation(Observation::Bootstrap { .. }))
                || before == after,
            GuaranteeId::CleanupKeepsFacts,
            || {
                format!(
                    "{} folded a late {} into its failed attempt",
                    label(id, before),
                    cause.describe()
                )
            },
        )?;
    }
    if before.record.lease.is_some() && after.record.lease.is_none() {
        ensure(
            cause.succeeded_with(|o| matches!(o, EffectOutput::LeaseDestroyed)),
            GuaranteeId::CleanupKeepsFacts,
            || {
                format!(
                    "{} lost its lease facts on {}",
                    label(id, before),
                    cause.describe()
                )
            },
        )?;
    }
    if before.record.session_active() && !after.record.session_active() {
        let confirmed = cause.succeeded_with(|o| matches!(o, EffectOutput::BootstrapCancelled))
            || matches!(
                cause,
                FoldCause::Observation(Observation::Bootstrap {
                    event: BootstrapEvent::Closed,
                    ..
                })
            );
        ensure(confirmed, GuaranteeId::CleanupKeepsFacts, || {
            format!(
                "{} lost its active session on {}",
                label(id, before),
                cause.describe()
            )
        })?;
    }
    Ok(())
}

/// G09 (fold form): stored delays follow the policy applied to the kit's own
/// count of consecutive failures of the slot (`failures`, carried across
/// restarts and reset on ready — never the driver's own count), and an
/// observation never shortens the stored backoff of a node being cleaned up.
/// The driver's count must equal the kit's.
pub(crate) fn g09_delays_follow_the_policy(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
    policy: &RetryPolicy,
    now: Timestamp,
    failures: u32,
) -> Verdict {
    let retry = &after.retry;
    ensure(
        retry.consecutive_failures == failures,
        GuaranteeId::BackoffDiscipline,
        || {
            format!(
                "{} holds {} consecutive failure(s) after {}; the kit counted {failures} for the slot",
                label(id, after),
                retry.consecutive_failures,
                cause.describe()
            )
        },
    )?;
    let backoff = plus_ms(now, policy.backoff(failures, after.attempt));
    if retry.next_effect_at != before.retry.next_effect_at {
        if let Some(at) = retry.next_effect_at {
            let probe = plus_ms(now, policy.endpoint_probe_interval);
            let expected = if cause.is_probe() { probe } else { backoff };
            ensure(
                expected == Some(at.as_millis()),
                GuaranteeId::BackoffDiscipline,
                || {
                    format!(
                        "{} stored next_effect_at {at} after {failures} failure(s) on {}; the policy gives {expected:?} ms",
                        label(id, after),
                        cause.describe()
                    )
                },
            )?;
        }
    }
    if retry.restart_at != before.retry.restart_at {
        if let Some(at) = retry.restart_at {
            ensure(
                backoff == Some(at.as_millis()),
                GuaranteeId::BackoffDiscipline,
                || {
                    format!(
                        "{} stored restart_at {at} after {failures} failure(s); the policy gives {backoff:?} ms",
                        label(id, after),
                    )
                },
            )?;
        }
    }
    if let (FoldCause::Observation(_), Intent::Deleting, Some(stored)) = (
        cause,
        before.intent,
        before.retry.next_effect_at.filter(|t| later_than(*t, now)),
    ) {
        ensure(
            retry.next_effect_at == Some(stored),
            GuaranteeId::BackoffDiscipline,
            || {
                format!(
                    "{} is being cleaned up and waits until {stored}, but {} changed the stored backoff to {:?}",
                    label(id, after),
                    cause.describe(),
                    retry.next_effect_at
                )
            },
        )?;
    }
    Ok(())
}

/// Whether a fold counts as one more consecutive failure of the slot, by the
/// kit's reading of SPEC §6: a failed or wrongly answered operation (except a
/// convergence report whose session already ended, which is moot), or an
/// observation that failed the attempt (a bootstrap failure, a session closed
/// before the join, the loss of a live node).
pub(crate) fn counts_as_failure(
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> bool {
    match cause {
        FoldCause::Result(result) => {
            let failed = match &result.outcome {
                Ok(output) => output.kind() != result.kind,
                Err(_) => true,
            };
            // A convergence report whose session already ended is moot.
            let moot = result.kind == EffectKind::BootstrapConvergenceObserved
                && !before.record.session_active();
            failed && !moot
        }
        FoldCause::Observation(_) => {
            before.record.failure.is_none() && after.record.failure.is_some()
        }
    }
}

/// G11: an endpoint that is not ready yet is a probe, not a failure.
pub(crate) fn g11_probe_is_not_failure(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> Verdict {
    if !cause.is_probe() {
        return Ok(());
    }
    ensure(
        after.retry.consecutive_failures == before.retry.consecutive_failures,
        GuaranteeId::ProbeIsNotFailure,
        || {
            format!(
                "{} counted endpoint-not-ready as a failure ({} -> {})",
                label(id, after),
                before.retry.consecutive_failures,
                after.retry.consecutive_failures
            )
        },
    )
}

/// G12 (wrong-answer form): a create or bootstrap start answered with
/// another method's output may have acted, so the driver remembers it as
/// ambiguous (and re-issues it before anything destructive).
pub(crate) fn g12_wrong_answer_is_ambiguous(
    id: &LogicalNodeId,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> Verdict {
    let FoldCause::Result(result) = cause else {
        return Ok(());
    };
    let wrong = result
        .outcome
        .as_ref()
        .is_ok_and(|output| output.kind() != result.kind);
    if !wrong
        || !matches!(
            result.kind,
            EffectKind::CreateLease | EffectKind::StartBootstrap
        )
    {
        return Ok(());
    }
    ensure(
        after
            .retry
            .ambiguous
            .as_ref()
            .is_some_and(|a| a.kind == result.kind),
        GuaranteeId::AdoptBeforeDestroy,
        || {
            format!(
                "{} did not remember {} as ambiguous although the backend answered it with another method's output",
                label(id, after),
                cause.describe()
            )
        },
    )
}

/// G12 (fold form): a remembered ambiguous operation is forgotten only when
/// an operation of its kind answers, or — for a bootstrap start — when the
/// stream reports an event of the same attempt's session, which proves the
/// session exists (adopting it needs no second start).
pub(crate) fn g12_ambiguity_forgotten_only_by_an_answer(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
) -> Verdict {
    let Some(ambiguous) = &before.retry.ambiguous else {
        return Ok(());
    };
    if after.retry.ambiguous.is_some() {
        return Ok(());
    }
    let answered = match cause {
        FoldCause::Result(r) => r.kind == ambiguous.kind,
        FoldCause::Observation(Observation::Bootstrap { attempt, .. }) => {
            ambiguous.kind == EffectKind::StartBootstrap && *attempt == before.attempt
        }
        FoldCause::Observation(_) => false,
    };
    ensure(answered, GuaranteeId::AdoptBeforeDestroy, || {
        format!(
            "{} forgot the ambiguous {} {} on {}",
            label(id, after),
            ambiguous.kind,
            ambiguous.op,
            cause.describe()
        )
    })
}

// ---------------------------------------------------------------------------
// Pass checks: `pre` and `post` are the state around one drive.
// ---------------------------------------------------------------------------

/// An operation recorded pending during a drive.
#[derive(Clone, Debug)]
pub(crate) struct NewDispatch {
    pub(crate) node: LogicalNodeId,
    pub(crate) pending: PendingOperation,
}

/// Lists the operations recorded pending during a drive.
pub(crate) fn new_dispatches(pre: &ClusterState, post: &ClusterState) -> Vec<NewDispatch> {
    post.nodes
        .iter()
        .filter_map(|(id, node)| {
            let pending = node.pending.as_ref()?;
            let before = pre.node(id).and_then(ManagedNode::pending_op);
            (before != Some(pending.id)).then(|| NewDispatch {
                node: id.clone(),
                pending: pending.clone(),
            })
        })
        .collect()
}

/// G01 (pass form): attempts that appeared are fresh — above every attempt
/// seen before, below the allocator — and each appears at one slot.
pub(crate) fn g01_new_attempts_are_fresh(
    pre: &ClusterState,
    post: &ClusterState,
    highest_seen: &mut Option<NodeAttemptId>,
) -> Verdict {
    let before = *highest_seen;
    for (id, node) in &post.nodes {
        let previous = pre.nodes.get(id).filter(|n| n.attempt == node.attempt);
        if let Some(previous) = previous {
            // Only a new attempt starts at `New` (and may be dispatched its
            // create in the same drive): an attempt that went back there
            // from a later stage was restarted under its old id.
            let starting = |stage| matches!(stage, NodeStage::New | NodeStage::LeaseRequested);
            ensure(
                starting(previous.record.stage) || !starting(node.record.stage),
                GuaranteeId::Identity,
                || {
                    format!(
                        "{} went from stage {} back to {} in a pass: the restart kept attempt {}",
                        id,
                        previous.record.stage.name(),
                        node.record.stage.name(),
                        node.attempt
                    )
                },
            )?;
            continue;
        }
        ensure(
            before.is_none_or(|h| node.attempt > h),
            GuaranteeId::Identity,
            || {
                format!(
                    "{} got attempt {}, not above the highest seen before ({before:?})",
                    id, node.attempt
                )
            },
        )?;
        *highest_seen = Some(highest_seen.map_or(node.attempt, |h| h.max(node.attempt)));
    }
    Ok(())
}

/// G25 (dispatch form): the stored deadline is the dispatch time plus the
/// policy's operation timeout.
pub(crate) fn g25_deadline_is_stored_at_dispatch(
    dispatch: &NewDispatch,
    policy: &RetryPolicy,
    now: Timestamp,
) -> Verdict {
    let pending = &dispatch.pending;
    let expected = plus_ms(now, policy.operation_timeout);
    ensure(
        pending.dispatched_at.as_millis() == now.as_millis()
            && Some(pending.deadline.as_millis()) == expected,
        GuaranteeId::DeadlineBoundary,
        || {
            format!(
                "{} {} was dispatched at {now} with deadline {} (recorded at {}); expected {expected:?} ms",
                dispatch.node, pending.id, pending.deadline, pending.dispatched_at
            )
        },
    )
}

/// G09 (dispatch form): no effect before the stored `next_effect_at`, unless
/// the same drive began deleting the node (which clears it by design).
pub(crate) fn g09_no_effect_before_backoff(
    dispatch: &NewDispatch,
    pre: &ClusterState,
    post: &ClusterState,
    now: Timestamp,
) -> Verdict {
    let Some(before) = pre.nodes.get(&dispatch.node) else {
        return Ok(());
    };
    let Some(after) = post.nodes.get(&dispatch.node) else {
        return Ok(());
    };
    if before.attempt != after.attempt {
        return Ok(());
    }
    let began_delete = before.intent == Intent::Active
        && after.intent == Intent::Deleting
        && before.retry.ambiguous.is_none();
    let stored = before.retry.next_effect_at;
    ensure(
        began_delete || stored.is_none_or(|t| at_or_after(now, t)),
        GuaranteeId::BackoffDiscipline,
        || {
            format!(
                "{} dispatched {} {} at {now}, before its stored next_effect_at {stored:?}",
                dispatch.node, dispatch.pending.kind, dispatch.pending.id
            )
        },
    )
}

/// G12 (dispatch form): while an ambiguous create/start is remembered, no
/// destructive step is dispatched.
pub(crate) fn g12_no_destructive_step_while_ambiguous(
    dispatch: &NewDispatch,
    pre: &ClusterState,
) -> Verdict {
    let Some(before) = pre.nodes.get(&dispatch.node) else {
        return Ok(());
    };
    let Some(ambiguous) = &before.retry.ambiguous else {
        return Ok(());
    };
    ensure(
        before.attempt != dispatch.pending.id.attempt() || !dispatch.pending.kind.is_cleanup(),
        GuaranteeId::AdoptBeforeDestroy,
        || {
            format!(
                "{} dispatched {} while the ambiguous {} {} was not re-issued",
                dispatch.node, dispatch.pending.kind, ambiguous.kind, ambiguous.op
            )
        },
    )
}

/// What happened to one slot during a drive.
pub(crate) struct SlotChange<'a> {
    pub(crate) id: &'a LogicalNodeId,
    pub(crate) before: Option<&'a ManagedNode>,
    pub(crate) after: Option<&'a ManagedNode>,
}

/// Every slot present before or after a drive.
pub(crate) fn slot_changes<'a>(
    pre: &'a ClusterState,
    post: &'a ClusterState,
) -> Vec<SlotChange<'a>> {
    let ids: BTreeSet<&LogicalNodeId> = pre.nodes.keys().chain(post.nodes.keys()).collect();
    ids.into_iter()
        .map(|id| SlotChange {
            id,
            before: pre.node(id),
            after: post.node(id),
        })
        .collect()
}

fn holds_something(node: &ManagedNode) -> bool {
    node.record.lease.is_some() || node.record.session_active() || node.pending.is_some()
}

/// G06/G07/G09/G12 (replacement form): an attempt leaves the map (reap) or is
/// replaced (restart) only when it holds nothing, no ambiguity is remembered,
/// and — for a restart — its restart time has come.
pub(crate) fn g07_attempts_end_only_when_empty(
    change: &SlotChange<'_>,
    desired: &DesiredSlots,
    now: Timestamp,
) -> Verdict {
    let Some(before) = change.before else {
        return Ok(());
    };
    let ended = change
        .after
        .is_none_or(|after| after.attempt != before.attempt);
    if !ended {
        return Ok(());
    }
    ensure(
        !holds_something(before),
        GuaranteeId::CleanupKeepsFacts,
        || {
            format!(
                "{} was dropped while it held lease={} session_active={} pending={:?}",
                label(change.id, before),
                before.record.lease.is_some(),
                before.record.session_active(),
                before.pending_op()
            )
        },
    )?;
    ensure(
        before.retry.ambiguous.is_none(),
        GuaranteeId::AdoptBeforeDestroy,
        || {
            format!(
                "{} was dropped with an ambiguous operation remembered",
                label(change.id, before)
            )
        },
    )?;
    match change.after {
        None => ensure(
            !desired.contains(change.id),
            GuaranteeId::ScaleDownOrder,
            || {
                format!(
                    "{} was reaped although its slot is desired",
                    label(change.id, before)
                )
            },
        ),
        Some(_) => {
            // The restart time is set when the attempt fails; an attempt
            // replaced for drift or scale-down has none.
            let restart_at = before.retry.restart_at;
            ensure(
                restart_at.is_none_or(|t| at_or_after(now, t)),
                GuaranteeId::BackoffDiscipline,
                || {
                    format!(
                        "{} was restarted at {now}, before its restart_at {restart_at:?}",
                        label(change.id, before)
                    )
                },
            )
        }
    }
}

/// G12 (mark form): a node is never marked destroyed while an ambiguous
/// operation is remembered.
pub(crate) fn g12_not_destroyed_while_ambiguous(change: &SlotChange<'_>) -> Verdict {
    let (Some(before), Some(after)) = (change.before, change.after) else {
        return Ok(());
    };
    if before.attempt != after.attempt || after.record.stage != NodeStage::Destroyed {
        return Ok(());
    }
    // Only a fold can settle an ambiguity, and no fold happens inside a
    // pass: what was remembered before the pass must still block it.
    ensure(
        before.record.stage == NodeStage::Destroyed || before.retry.ambiguous.is_none(),
        GuaranteeId::AdoptBeforeDestroy,
        || {
            format!(
                "{} was marked destroyed with an ambiguous operation remembered",
                label(change.id, after)
            )
        },
    )
}

/// G12/G09 (pass form): a pass keeps the retry bookkeeping it only reads. It
/// never forgets a remembered ambiguity (only an answer does), and it moves
/// a stored `next_effect_at` only where the ladder says so: `BeginDelete`
/// clears it when no ambiguity is remembered, `MarkDestroyed` clears it.
pub(crate) fn g12_passes_keep_retry_bookkeeping(change: &SlotChange<'_>) -> Verdict {
    let (Some(before), Some(after)) = (change.before, change.after) else {
        return Ok(());
    };
    if before.attempt != after.attempt {
        return Ok(());
    }
    ensure(
        after.retry.ambiguous == before.retry.ambiguous,
        GuaranteeId::AdoptBeforeDestroy,
        || {
            format!(
                "a pass changed the remembered ambiguous operation of {} from {:?} to {:?}",
                label(change.id, after),
                before.retry.ambiguous,
                after.retry.ambiguous
            )
        },
    )?;
    let began_delete = before.intent == Intent::Active
        && after.intent == Intent::Deleting
        && before.retry.ambiguous.is_none();
    let marked_destroyed =
        before.record.stage != NodeStage::Destroyed && after.record.stage == NodeStage::Destroyed;
    let cleared_by_ladder =
        after.retry.next_effect_at.is_none() && (began_delete || marked_destroyed);
    ensure(
        after.retry.next_effect_at == before.retry.next_effect_at || cleared_by_ladder,
        GuaranteeId::BackoffDiscipline,
        || {
            format!(
                "a pass moved the stored next_effect_at of {} from {:?} to {:?}",
                label(change.id, after),
                before.retry.next_effect_at,
                after.retry.next_effect_at
            )
        },
    )?;
    ensure(
        after.retry.restart_at == before.retry.restart_at,
        GuaranteeId::BackoffDiscipline,
        || {
            format!(
                "a pass moved the stored restart_at of {} from {:?} to {:?}",
                label(change.id, after),
                before.retry.restart_at,
                after.retry.restart_at
            )
        },
    )
}

/// G10: a failed active attempt starts cleanup in the same drive: it is
/// deleting and has a cleanup step in flight, is already destroyed, or waits
/// only to re-issue an ambiguous operation.
pub(crate) fn g10_failed_attempt_starts_cleanup(
    change: &SlotChange<'_>,
    now: Timestamp,
) -> Verdict {
    let (Some(before), Some(after)) = (change.before, change.after) else {
        return Ok(());
    };
    if before.intent != Intent::Active
        || before.record.stage != NodeStage::Failed
        || before.attempt != after.attempt
    {
        return Ok(());
    }
    let waiting_to_adopt = after.retry.ambiguous.is_some()
        && after
            .retry
            .next_effect_at
            .is_some_and(|t| later_than(t, now));
    ensure(
        after.intent == Intent::Deleting
            && (after.pending.is_some()
                || after.record.stage == NodeStage::Destroyed
                || waiting_to_adopt),
        GuaranteeId::AttemptFailure,
        || {
            format!(
                "failed {} did not start cleanup in the next pass (intent {:?}, pending {:?}, next_effect_at {:?})",
                label(change.id, after),
                after.intent,
                after.pending_op(),
                after.retry.next_effect_at
            )
        },
    )
}

/// G09 (pass form): a pass never changes a slot's failure count: the
/// driver's count equals the kit's, which a replacement carries over (so a
/// restart that starts counting afresh is caught at once).
pub(crate) fn g09_passes_keep_failure_counts(
    change: &SlotChange<'_>,
    failures: &BTreeMap<LogicalNodeId, u32>,
) -> Verdict {
    let Some(after) = change.after else {
        return Ok(());
    };
    let expected = failures.get(change.id).copied().unwrap_or(0);
    ensure(
        after.retry.consecutive_failures == expected,
        GuaranteeId::BackoffDiscipline,
        || {
            format!(
                "after a pass {} holds {} consecutive failure(s); the kit counted {expected} for the slot{}",
                label(change.id, after),
                after.retry.consecutive_failures,
                match change.before {
                    Some(before) if before.attempt != after.attempt => {
                        format!(" (a replacement of {} carries its count)", before.attempt)
                    }
                    _ => String::new(),
                }
            )
        },
    )
}

/// G15 (report form): a session's convergence is reported at most once: no
/// report is dispatched for an attempt whose report was acknowledged.
pub(crate) fn g15_convergence_reported_once(
    dispatch: &NewDispatch,
    reported: &BTreeSet<NodeAttemptId>,
) -> Verdict {
    ensure(
        dispatch.pending.kind != EffectKind::BootstrapConvergenceObserved
            || !reported.contains(&dispatch.pending.id.attempt()),
        GuaranteeId::SessionCoherence,
        || {
            format!(
                "{} dispatched {} {}, but the convergence of its session was already reported and acknowledged",
                dispatch.node, dispatch.pending.kind, dispatch.pending.id
            )
        },
    )
}

/// G15 (report form): a session's convergence is reported only after the
/// kit reported the session's agent joined: a report for a session still
/// bootstrapping tells the run a node is there that is not.
pub(crate) fn g15_convergence_reported_after_join(
    dispatch: &NewDispatch,
    joined: &BTreeSet<NodeAttemptId>,
) -> Verdict {
    ensure(
        dispatch.pending.kind != EffectKind::BootstrapConvergenceObserved
            || joined.contains(&dispatch.pending.id.attempt()),
        GuaranteeId::SessionCoherence,
        || {
            format!(
                "{} dispatched {} {}, but the kit never reported its session's agent joined",
                dispatch.node, dispatch.pending.kind, dispatch.pending.id
            )
        },
    )
}

/// G15 (stream form): a bootstrap event of a session that already closed or
/// was cancelled is rejected, never folded.
pub(crate) fn g15_no_event_after_the_session_ended(
    id: &LogicalNodeId,
    before: &ManagedNode,
    observation: &Observation,
) -> Verdict {
    let Observation::Bootstrap { event, .. } = observation else {
        return Ok(());
    };
    let ended = before
        .record
        .bootstrap
        .as_ref()
        .is_some_and(|b| b.state != SessionState::Active);
    ensure(!ended, GuaranteeId::SessionCoherence, || {
        format!(
            "{} folded the stream event {event:?} although its session had already ended",
            label(id, before)
        )
    })
}

/// G17 (pass form): a node begins deletion only because its slot is
/// undesired, its spec drifted, or it failed — never a desired, current one.
pub(crate) fn g17_only_undesired_drifted_or_failed_nodes_are_deleted(
    change: &SlotChange<'_>,
    desired: &DesiredSlots,
) -> Verdict {
    let (Some(before), Some(after)) = (change.before, change.after) else {
        return Ok(());
    };
    if before.attempt != after.attempt
        || before.intent != Intent::Active
        || after.intent != Intent::Deleting
    {
        return Ok(());
    }
    let undesired = !desired.contains(change.id);
    let drifted = desired
        .template(change.id)
        .is_some_and(|template| template != before.spec.template());
    let failed = before.record.stage == NodeStage::Failed;
    ensure(
        undesired || drifted || failed,
        GuaranteeId::ScaleDownOrder,
        || {
            format!(
                "{} began deletion although its slot is desired, its spec current and it did not fail",
                label(change.id, before)
            )
        },
    )
}

// ---------------------------------------------------------------------------
// Call checks.
// ---------------------------------------------------------------------------

/// G04: a backend call started only for an operation the driver recorded
/// pending. A strict substrate requires the operation to be pending at the
/// start (or already timed out by the host); a relaxed one, that it was
/// recorded pending at some point.
pub(crate) fn g04_call_was_recorded(
    call: &CallRecord,
    state: &ClusterState,
    timed_out: &BTreeSet<provisioning::OperationId>,
    ever_pending: &BTreeSet<provisioning::OperationId>,
    strict: bool,
) -> Verdict {
    let pending_now = state.node(&call.node).and_then(ManagedNode::pending_op) == Some(call.op);
    let recorded = if strict {
        pending_now || timed_out.contains(&call.op)
    } else {
        ever_pending.contains(&call.op)
    };
    ensure(recorded, GuaranteeId::RecordBeforeDispatch, || {
        format!(
            "the backend started {} {} for {}, which the driver had not recorded pending",
            call.kind, call.op, call.node
        )
    })
}

/// G04 (executor form): an operation the executor expired before its call
/// began never reaches the backend afterwards — the driver has folded its
/// timeout, so running it would be an effect nobody has pending.
pub(crate) fn g04_no_call_after_its_expiry(
    call: &CallRecord,
    expired: &BTreeSet<provisioning::OperationId>,
) -> Verdict {
    ensure(
        !expired.contains(&call.op),
        GuaranteeId::RecordBeforeDispatch,
        || {
            format!(
                "the backend started {} {} for {} after the executor had expired it",
                call.kind, call.op, call.node
            )
        },
    )
}

/// G04: no call of an attempt starts after a newer operation of that attempt
/// started — by then the driver has moved on, so the older one is an effect
/// nobody has pending. (A call of a timed-out operation may still start, but
/// only before the operation that replaces it.) `newest` holds the newest
/// operation started per attempt.
pub(crate) fn g04_no_call_after_a_newer_one(
    call: &CallRecord,
    newest: &mut BTreeMap<NodeAttemptId, provisioning::OperationId>,
) -> Verdict {
    let attempt = call.op.attempt();
    if let Some(newer) = newest.get(&attempt).filter(|newer| **newer > call.op) {
        return Err(breach(
            GuaranteeId::RecordBeforeDispatch,
            format!(
                "the backend started {} {} for {} after the newer {} of its attempt had started: the driver had moved on from it",
                call.kind, call.op, call.node, newer
            ),
        ));
    }
    newest.insert(attempt, call.op);
    Ok(())
}

/// G05 (executor form): an operation handed to the executor again — as a
/// host that retries a submission — is deduplicated: it is still running or
/// waiting, its recorded result is replayed, or it is refused as stale. It
/// never starts a second time.
pub(crate) fn g05_resubmission_is_deduplicated(
    operation: &provisioning::Operation,
    outcome: &Result<provisioning::Submitted, provisioning::driver::SubmitError>,
) -> Verdict {
    use provisioning::Submitted;
    use provisioning::driver::SubmitError;
    let deduplicated = matches!(
        outcome,
        Ok(Submitted::AlreadyRunning | Submitted::Replayed) | Err(SubmitError::Stale(_))
    );
    ensure(deduplicated, GuaranteeId::SingleFlight, || {
        format!(
            "{} {} for {}, submitted again, was not deduplicated by the executor: {outcome:?}",
            operation.kind(),
            operation.id,
            operation.node
        )
    })
}

/// G05 (record form): the newest operation an executor took for an attempt
/// is one it still holds, running or with its result kept: submitted again,
/// it is answered from that record (running, or the result replayed), never
/// dismissed as stale.
pub(crate) fn g05_newest_is_answered_from_the_record(
    operation: &provisioning::Operation,
    newest: bool,
    outcome: &Result<provisioning::Submitted, provisioning::driver::SubmitError>,
) -> Verdict {
    use provisioning::Submitted;
    ensure(
        !newest || matches!(outcome, Ok(Submitted::AlreadyRunning | Submitted::Replayed)),
        GuaranteeId::SingleFlight,
        || {
            format!(
                "{} {} for {}, the newest operation of its attempt, submitted again, was answered {outcome:?} instead of from the executor's record",
                operation.kind(),
                operation.id,
                operation.node
            )
        },
    )
}

/// G05 (conflict form): an operation submitted again under its id with a
/// different input (another template, another slot) is refused as a
/// conflict wherever the executor still recognised the id (the identical
/// resubmission, `first`, was deduplicated as running or replayed); an id it
/// already answered as stale may be refused either way. Never accepted.
pub(crate) fn g05_different_input_is_refused(
    operation: &provisioning::Operation,
    first: &Result<provisioning::Submitted, provisioning::driver::SubmitError>,
    altered: &Result<provisioning::Submitted, provisioning::driver::SubmitError>,
) -> Verdict {
    use provisioning::driver::SubmitError;
    let refused = match first {
        Err(SubmitError::Stale(_)) => matches!(
            altered,
            Err(SubmitError::Stale(_) | SubmitError::ConflictingInput(_))
        ),
        _ => matches!(altered, Err(SubmitError::ConflictingInput(id)) if *id == operation.id),
    };
    ensure(refused, GuaranteeId::SingleFlight, || {
        format!(
            "{} {} for {}, submitted again with a different input, was answered {altered:?} (the identical resubmission: {first:?})",
            operation.kind(),
            operation.id,
            operation.node
        )
    })
}

/// G02 (executor form): what the executor publishes is accounted for: a
/// result is of an operation handed to this executor, and a result of an
/// operation the executor expired is its timeout (replayed), never the
/// backend's late answer — caught here even though the driver would drop it.
pub(crate) fn g02_published_result_is_accounted_for(
    result: &ExecutorResult,
    submitted: &BTreeSet<provisioning::OperationId>,
    expired: &BTreeSet<provisioning::OperationId>,
) -> Verdict {
    ensure(
        submitted.contains(&result.op),
        GuaranteeId::Correlation,
        || {
            format!(
                "the executor published a result of {} {} for {}, which was never submitted to it",
                result.kind, result.op, result.node
            )
        },
    )?;
    ensure(
        !expired.contains(&result.op)
            || result.outcome == Err(provisioning::EffectError::timed_out()),
        GuaranteeId::Correlation,
        || {
            format!(
                "the executor published a late result of {} {} for {} after it expired the operation: {:?}",
                result.kind, result.op, result.node, result.outcome
            )
        },
    )
}

/// G05: no two calls of one attempt in flight at the backend at once.
pub(crate) fn g05_one_call_per_attempt(call: &CallRecord) -> Verdict {
    ensure(call.overlapping == 0, GuaranteeId::SingleFlight, || {
        format!(
            "the backend started {} {} for {} while {} other call(s) of its attempt were running",
            call.kind, call.op, call.node, call.overlapping
        )
    })
}

// ---------------------------------------------------------------------------
// End-of-tail checks.
// ---------------------------------------------------------------------------

/// G23: at convergence the live resources are exactly one lease per desired
/// node's current attempt, and no session of any other attempt is live.
pub(crate) fn g23_converged_leaks_nothing(state: &ClusterState, live: &LiveResources) -> Verdict {
    let expected: BTreeSet<ResourceKey> = state
        .nodes
        .iter()
        .map(|(id, node)| (id.clone(), node.attempt))
        .collect();
    let leased: BTreeSet<ResourceKey> = live
        .leases
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(key, _)| key.clone())
        .collect();
    let leaked: Vec<String> = leased
        .difference(&expected)
        .map(|(node, attempt)| format!("{node}/{attempt}"))
        .collect();
    let missing: Vec<String> = expected
        .difference(&leased)
        .map(|(node, attempt)| format!("{node}/{attempt}"))
        .collect();
    ensure(
        leaked.is_empty() && missing.is_empty(),
        GuaranteeId::ConvergedLeaksNothing,
        || {
            format!(
                "converged, but leases leaked: [{}], missing: [{}] (live: {live})",
                leaked.join(", "),
                missing.join(", ")
            )
        },
    )?;
    let stale_sessions: Vec<String> = live
        .sessions
        .iter()
        .filter(|(key, n)| **n > 0 && !expected.contains(*key))
        .map(|((node, attempt), _)| format!("{node}/{attempt}"))
        .collect();
    ensure(
        stale_sessions.is_empty(),
        GuaranteeId::ConvergedLeaksNothing,
        || {
            format!(
                "converged, but sessions of other attempts are live: [{}]",
                stale_sessions.join(", ")
            )
        },
    )
}

// ---------------------------------------------------------------------------
// Durable state, crashes and orphans (G26–G28).
// ---------------------------------------------------------------------------

/// Whether a node's current attempt owns the resource of `key`: the slot is
/// managed, at that attempt, and not destroyed.
pub(crate) fn owned(state: &ClusterState, key: &ResourceKey) -> bool {
    state
        .nodes
        .get(&key.0)
        .is_some_and(|n| n.attempt == key.1 && n.record.stage != NodeStage::Destroyed)
}

/// G26 (clock form): a change set that writes anything carries the meta
/// with the writer's clock. Recovery reads every stored instant against
/// the meta's clock; a meta left from an older write would make a backoff
/// or a breaker's cool-down written since come back late by all the time in
/// between.
pub(crate) fn g26_write_carries_the_clock(
    changes: &provisioning::DriverChanges,
    now: Timestamp,
) -> Verdict {
    let written_at = changes.meta.as_ref().map(|m| m.written_at);
    ensure(
        changes.is_empty() || written_at == Some(now),
        GuaranteeId::CrashSafety,
        || match written_at {
            None => format!(
                "a change set writes {} node(s) and {} removal(s) at {now:?} without the meta, so the journal keeps an older clock for instants written now",
                changes.upserts.len(),
                changes.removed.len()
            ),
            Some(at) => format!("a change set written at {now:?} carries the clock {at:?}"),
        },
    )
}

/// G26 (commit form): the journal, as the kit applied every committed
/// change set to what it held, equals the driver's durable state right after
/// a commit (the meta compared without its writer's clock). A node missing,
/// stale or not removed, or a meta not written when it changed, would come
/// back wrong after a crash.
pub(crate) fn g26_journal_holds_durable_state(
    journal_meta: &provisioning::DurableMeta,
    journal: &BTreeMap<LogicalNodeId, provisioning::DurableEntry>,
    driver: &provisioning::DurableState,
) -> Verdict {
    // Every field but the writer's clock, compared in place.
    let provisioning::DurableMeta {
        format,
        desired,
        observed_generation,
        next_attempt,
        written_at: _,
        breakers,
    } = journal_meta;
    let same_meta = *format == driver.meta.format
        && *desired == driver.meta.desired
        && *observed_generation == driver.meta.observed_generation
        && *next_attempt == driver.meta.next_attempt
        && *breakers == driver.meta.breakers;
    // The common case first: the same nodes in the same (id) order.
    let same_nodes = journal.len() == driver.nodes.len()
        && journal
            .iter()
            .zip(&driver.nodes)
            .all(|((id, held), has)| *id == has.node.node && held == has);
    let problem = if same_meta && same_nodes {
        None
    } else if !same_meta {
        Some(format!(
            "its meta is {journal_meta:?}, but the driver's is {:?}",
            driver.meta
        ))
    } else {
        let has: BTreeMap<&LogicalNodeId, &provisioning::DurableEntry> =
            driver.nodes.iter().map(|e| (&e.node.node, e)).collect();
        journal
            .keys()
            .chain(has.keys().copied())
            .find(|id| journal.get(*id) != has.get(*id).copied())
            .map(|id| match (journal.get(id), has.get(id)) {
                (Some(_), None) => format!("it still holds {id}, which the driver no longer has"),
                (None, Some(_)) => format!("it lacks {id}, which the driver has"),
                (old, new) => format!(
                    "it holds {id} as {:?}, but the driver has {:?}",
                    old.map(|e| &e.node),
                    new.map(|e| &e.node)
                ),
            })
    };
    ensure(problem.is_none(), GuaranteeId::CrashSafety, || {
        format!(
            "after a commit the journal differs from the driver's durable state: {}",
            problem.unwrap_or_default()
        )
    })
}

/// G26 (recovery form): every operation the journal held pending is no
/// longer pending after recovery, and a pending create or bootstrap start is
/// remembered as ambiguous, so the ladder re-issues it before anything
/// destructive and the provider adopts what it may have made.
pub(crate) fn g26_recovery_made_pending_ambiguous(
    recovered: &ClusterState,
    journaled: &[(LogicalNodeId, PendingOperation)],
) -> Verdict {
    for (id, pending) in journaled {
        let Some(node) = recovered.nodes.get(id) else {
            return Err(breach(
                GuaranteeId::CrashSafety,
                format!(
                    "recovery lost node {id}, whose {} {} the journal held pending",
                    pending.kind, pending.id
                ),
            ));
        };
        ensure(
            node.attempt == pending.id.attempt(),
            GuaranteeId::CrashSafety,
            || {
                format!(
                    "recovery moved {} off attempt {} of its pending {} {}",
                    id,
                    pending.id.attempt(),
                    pending.kind,
                    pending.id
                )
            },
        )?;
        ensure(
            node.pending.as_ref().is_none_or(|p| p.id != pending.id),
            GuaranteeId::CrashSafety,
            || {
                format!(
                    "{} still has {} {} pending after recovery, with no executor running it",
                    label(id, node),
                    pending.kind,
                    pending.id
                )
            },
        )?;
        let adoptable = matches!(
            pending.kind,
            EffectKind::CreateLease | EffectKind::StartBootstrap
        );
        ensure(
            !adoptable
                || node
                    .retry
                    .ambiguous
                    .as_ref()
                    .is_some_and(|a| a.kind == pending.kind),
            GuaranteeId::CrashSafety,
            || {
                format!(
                    "recovery forgot the pending {} {} of {} instead of making it ambiguous (it may have happened at the provider; now {})",
                    pending.kind,
                    pending.id,
                    label(id, node),
                    describe_node(id, node)
                )
            },
        )?;
    }
    Ok(())
}

/// G27: the call's operation was committed to the journal as pending
/// before the call started.
pub(crate) fn g27_committed_before_the_call(
    op: &provisioning::OperationId,
    node: &LogicalNodeId,
    kind: EffectKind,
    committed: bool,
) -> Verdict {
    ensure(committed, GuaranteeId::DurableBeforeDispatch, || {
        format!(
            "the backend started {kind} {op} for {node}, which no commit to the journal held pending"
        )
    })
}

/// G28 (safety form): a resource about to be destroyed as an orphan is not
/// owned by a node's current attempt.
pub(crate) fn g28_never_an_owned_resource(state: &ClusterState, key: &ResourceKey) -> Verdict {
    ensure(!owned(state, key), GuaranteeId::OrphansCollected, || {
        format!(
            "the host destroyed {}/{} as an orphan, but it is that node's current attempt",
            key.0, key.1
        )
    })
}

/// G28 (liveness form): once faults stopped at `stopped`, every resource
/// observed unowned is gone within `bound` (grace + one scan interval) of
/// the later of `stopped` and when it was first observed unowned.
pub(crate) fn g28_orphans_collected_in_time(
    observed: &BTreeMap<ResourceKey, Timestamp>,
    stopped: Timestamp,
    bound: std::time::Duration,
    now: Timestamp,
) -> Verdict {
    for ((node, attempt), since) in observed {
        let from = since.as_millis().max(stopped.as_millis());
        let bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        let deadline = from.saturating_add(bound_ms);
        ensure(
            now.as_millis() <= deadline,
            GuaranteeId::OrphansCollected,
            || {
                format!(
                    "{node}/{attempt}, owned by no current attempt since {since}, is still live at {now} (faults stopped at {stopped}; bound {} ms)",
                    bound.as_millis()
                )
            },
        )?;
    }
    Ok(())
}

/// A description of what keeps a cluster from convergence, for G21 reports.
pub(crate) fn describe_pending(state: &ClusterState, desired: &DesiredState) -> String {
    let mut lines = Vec::new();
    for spec in desired.specs() {
        match state.nodes.get(spec.id()) {
            None => lines.push(format!("{}: no node", spec.id())),
            Some(node) if node.is_ready() && node.spec == spec && node.pending.is_none() => {}
            Some(node) => lines.push(describe_node(spec.id(), node)),
        }
    }
    for (id, node) in &state.nodes {
        if !desired.contains(id) {
            lines.push(format!("{} (undesired)", describe_node(id, node)));
        }
    }
    lines.join("; ")
}

pub(crate) fn describe_node(id: &LogicalNodeId, node: &ManagedNode) -> String {
    let mut text = format!("{} {}", label(id, node), node.record.stage.name());
    if node.intent == Intent::Deleting {
        text.push_str(" deleting");
    }
    if node.record.ready {
        text.push_str(" ready");
    }
    if let Some(pending) = &node.pending {
        text.push_str(&format!(
            " pending {} {} until {}",
            pending.kind, pending.id, pending.deadline
        ));
    }
    if let Some(bootstrap) = &node.record.bootstrap {
        if bootstrap.state == SessionState::Active {
            text.push_str(" session-active");
        }
    }
    if let Some(at) = node.retry.next_effect_at {
        text.push_str(&format!(" next-effect-at {at}"));
    }
    if let Some(at) = node.retry.restart_at {
        text.push_str(&format!(" restart-at {at}"));
    }
    if let Some(ambiguous) = &node.retry.ambiguous {
        text.push_str(&format!(" ambiguous {} {}", ambiguous.kind, ambiguous.op));
    }
    text
}

/// G29 (count form): the driver's count of creates in flight for a provider
/// (what the launch cap is held against, and what a host shows) is the
/// number of its nodes with a create pending.
pub(crate) fn g29_creates_in_flight_are_counted(
    state: &ClusterState,
    provider: &str,
    counted: Option<u32>,
) -> Verdict {
    let Some(counted) = counted else {
        return Ok(());
    };
    let pending = state
        .nodes
        .values()
        .filter(|n| {
            n.spec.template().provider == provider
                && n.pending
                    .as_ref()
                    .is_some_and(|p| p.kind == EffectKind::CreateLease)
        })
        .count();
    ensure(
        u32::try_from(pending).ok() == Some(counted),
        GuaranteeId::BudgetsHold,
        || {
            format!(
                "the driver counts {counted} creates in flight for provider {provider}, but {pending} nodes have one pending"
            )
        },
    )
}

/// G29, launch cap: when a drive started a first create (of an active
/// node), the creates pending across the cluster afterwards are within
/// `cap`. Counted from the recorded state, not from the driver's counters.
pub(crate) fn g29_creates_within_cap(
    dispatches: &[NewDispatch],
    post: &ClusterState,
    cap: Option<u32>,
) -> Verdict {
    let Some(cap) = cap else { return Ok(()) };
    let started = dispatches.iter().any(|d| {
        d.pending.kind == EffectKind::CreateLease
            && post
                .nodes
                .get(&d.node)
                .is_some_and(|n| n.intent == Intent::Active)
    });
    if !started {
        return Ok(());
    }
    let in_flight = post
        .nodes
        .values()
        .filter(|n| {
            n.pending
                .as_ref()
                .is_some_and(|p| p.kind == EffectKind::CreateLease)
        })
        .count();
    if in_flight > cap as usize {
        return Err(breach(
            GuaranteeId::BudgetsHold,
            format!(
                "a create started while {in_flight} creates are in flight, over the cap of {cap}"
            ),
        ));
    }
    Ok(())
}

/// Desired slots of `group` in `state` without a ready node.
pub(crate) fn unavailable_slots(
    state: &ClusterState,
    desired: &DesiredState,
    group: &GroupId,
) -> u32 {
    let Some(wanted) = desired.groups().get(group) else {
        return 0;
    };
    let ready = (0..wanted.count())
        .filter(|&i| {
            state
                .node(&LogicalNodeId::new(group.clone(), i))
                .is_some_and(ManagedNode::is_ready)
        })
        .count();
    wanted
        .count()
        .saturating_sub(u32::try_from(ready).unwrap_or(u32::MAX))
}

/// Whether `change` took a ready, desired node of a drifted spec down (a
/// drift replacement: the only deletion a rollout budget holds back).
pub(crate) fn is_drift_takedown(change: &SlotChange<'_>, desired: &DesiredState) -> bool {
    let (Some(before), Some(after)) = (change.before, change.after) else {
        return false;
    };
    let Some(group) = desired.groups().get(change.id.group()) else {
        return false;
    };
    before.is_ready()
        && before.intent == Intent::Active
        && after.intent == Intent::Deleting
        && change.id.index() < group.count()
        && *before.spec.template() != **group.template()
}

/// G29, rollout budget: when a drive took a ready node down for drift
/// replacement, its group has at most `allowed` desired slots without a
/// ready node afterwards.
pub(crate) fn g29_rollout_within_budget(
    group: &GroupId,
    post: &ClusterState,
    desired: &DesiredState,
    allowed: u32,
) -> Verdict {
    let down = unavailable_slots(post, desired, group);
    if down > allowed {
        return Err(breach(
            GuaranteeId::BudgetsHold,
            format!(
                "a drift replacement in group {group} left {down} desired slots unready, over its budget of {allowed}"
            ),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The kit's own model: desired slots, attempts ever seen.
// ---------------------------------------------------------------------------

/// The desired slots and their templates by the kit's own reckoning, built
/// from the shapes the harness submitted — never from the driver's
/// `DesiredState`, so a driver that shrinks the wrong end of a group, or
/// keeps a shape it was not given, cannot vouch for itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct DesiredSlots {
    groups: BTreeMap<GroupId, (u32, provisioning::NodeTemplate)>,
}

impl DesiredSlots {
    /// The slots of `groups`: per group its count and template.
    pub(crate) fn new(
        groups: impl IntoIterator<Item = (GroupId, u32, provisioning::NodeTemplate)>,
    ) -> Self {
        DesiredSlots {
            groups: groups
                .into_iter()
                .map(|(id, count, template)| (id, (count, template)))
                .collect(),
        }
    }

    /// Whether `id` is a desired slot: its group is wanted and its index is
    /// below the group's count (a shrinking group loses its highest indices).
    pub(crate) fn contains(&self, id: &LogicalNodeId) -> bool {
        self.template(id).is_some()
    }

    /// How many slots of `group` are desired.
    pub(crate) fn count(&self, group: &GroupId) -> u32 {
        self.groups.get(group).map_or(0, |(count, _)| *count)
    }

    /// The desired template of slot `id`, if the slot is desired.
    pub(crate) fn template(&self, id: &LogicalNodeId) -> Option<&provisioning::NodeTemplate> {
        let (count, template) = self.groups.get(id.group())?;
        (id.index() < *count).then_some(template)
    }

    /// How many slots are desired, over all groups.
    pub(crate) fn total(&self) -> u64 {
        self.groups
            .values()
            .map(|(count, _)| u64::from(*count))
            .sum()
    }
}

/// Whether `node` is ready, by the kit's own reading of its facts: active,
/// marked ready, in a stage past the handoff.
pub(crate) fn kit_ready(node: &ManagedNode) -> bool {
    node.record.ready
        && node.intent == Intent::Active
        && matches!(node.record.stage, NodeStage::HandedOff | NodeStage::Dormant)
}

/// How many nodes of `state` have a create pending.
pub(crate) fn creates_pending(state: &ClusterState) -> usize {
    state
        .nodes
        .values()
        .filter(|n| {
            n.pending
                .as_ref()
                .is_some_and(|p| p.kind == EffectKind::CreateLease)
        })
        .count()
}

/// What a pass found of each node: its pending operation, attempt, intent
/// and template.
pub(crate) type PassBefore = BTreeMap<
    LogicalNodeId,
    (
        Option<provisioning::OperationId>,
        NodeAttemptId,
        Intent,
        bool,
    ),
>;

/// What a pass found of every node of `state` (the last field: whether the
/// node was ready, by the kit's reading).
pub(crate) fn pass_before(state: &ClusterState) -> PassBefore {
    state
        .nodes
        .iter()
        .map(|(id, node)| {
            let ready = kit_ready(node);
            (
                id.clone(),
                (
                    node.pending.as_ref().map(|p| p.id),
                    node.attempt,
                    node.intent,
                    ready,
                ),
            )
        })
        .collect()
}

/// The operator limits as the kit set them, for judging what a pass held
/// back: the launch cap of the kit's provider, each group's rollout budget
/// (a count, at least one), and whether the kit's breaker model holds a
/// group's new attempts.
pub(crate) struct Holds<'a> {
    pub(crate) cap: Option<u32>,
    pub(crate) budgets: BTreeMap<GroupId, u32>,
    pub(crate) breaker_holds: &'a dyn Fn(&GroupId) -> bool,
}

/// How many planned steps a pass held back, by limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) cap: u64,
    pub(crate) budget: u64,
    pub(crate) breaker: u64,
}

/// How many planned steps a pass took: dispatches and other transitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Taken {
    pub(crate) dispatches: usize,
    pub(crate) transitions: usize,
}

/// G19 (pass plan form), with G29/G30's "hold only what the limit must":
/// what a pass planned (`begin_pass`) is what it then did (`finish_pass`).
/// The plan evaluates at the pass's instant; it is a full pass exactly when
/// one was asked for since the last pass (`full_expected`; `None` when the
/// kit cannot know, after a recovery); a full pass evaluates every managed
/// or desired slot, an incremental one lists every node it evaluated; every
/// operation the pass dispatched has a step in the plan; and every step the
/// plan lists was taken, unless a limit held it back with cause: a first
/// create while the creates pending fill the launch cap, the teardown of a
/// ready drifted desired node while its group's unready slots fill its
/// rollout budget, a new attempt while the kit's model holds the group's
/// breaker open. Returns what was held, by limit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn g19_pass_did_what_it_planned(
    planned: &crate::driver_under_test::PlannedPass,
    before: &PassBefore,
    after: &ClusterState,
    slots: &DesiredSlots,
    now: Timestamp,
    full_expected: Option<bool>,
    holds: &Holds<'_>,
    refused: &BTreeMap<LogicalNodeId, EffectKind>,
) -> Result<(Held, Taken), Breach> {
    ensure(
        planned.now.as_millis() == now.as_millis(),
        GuaranteeId::Quiescence,
        || format!("a pass at {now} planned for {}", planned.now),
    )?;
    if let Some(full) = full_expected {
        ensure(planned.full == full, GuaranteeId::Quiescence, || {
            format!(
                "a pass at {now} was {}, but {}",
                if planned.full { "full" } else { "incremental" },
                if full {
                    "the shape, the limits or a trigger asked for a full pass since the last one"
                } else {
                    "nothing asked for a full pass since the last one"
                }
            )
        })?;
    }
    let expected = if planned.full {
        let desired_with_node = before.keys().filter(|id| slots.contains(id)).count() as u64;
        (before.len() as u64 + slots.total() - desired_with_node) as usize
    } else {
        planned.decisions.len()
    };
    ensure(
        planned.evaluated == expected,
        GuaranteeId::Quiescence,
        || {
            format!(
                "{} pass at {now} says it evaluated {} slots, but it {} {expected}",
                if planned.full {
                    "a full"
                } else {
                    "an incremental"
                },
                planned.evaluated,
                if planned.full {
                    "had managed or desired slots"
                } else {
                    "listed decisions for"
                }
            )
        },
    )?;
    let pending_before = |id: &LogicalNodeId| before.get(id).and_then(|b| b.0);
    let decided: BTreeMap<&LogicalNodeId, &provisioning::NodeDecision> =
        planned.decisions.iter().map(|(id, d)| (id, d)).collect();
    for (id, node) in &after.nodes {
        let Some(pending) = &node.pending else {
            continue;
        };
        if pending_before(id) == Some(pending.id) {
            continue;
        }
        ensure(
            decided
                .get(id)
                .is_some_and(|d| d.action != provisioning::NodeAction::None),
            GuaranteeId::Quiescence,
            || {
                format!(
                    "a pass at {now} dispatched {} {} for {id}, but its plan had no step for that node",
                    pending.kind, pending.id
                )
            },
        )?;
    }
    let creates_pending = creates_pending(after) as u64;
    let mut held = Held::default();
    let mut took = Taken::default();
    for (id, decision) in &planned.decisions {
        use provisioning::NodeAction;
        let now_node = after.nodes.get(id);
        let taken = match decision.action {
            // Dispatched: pending now, or handed to the sink and refused
            // there (folded at once).
            NodeAction::Dispatch(kind) => {
                refused.get(id) == Some(&kind)
                    || now_node
                        .and_then(|n| n.pending.as_ref())
                        .is_some_and(|p| p.kind == kind && pending_before(id) != Some(p.id))
            }
            NodeAction::BeginDelete => now_node.is_none_or(|n| n.intent == Intent::Deleting),
            NodeAction::Insert => now_node.is_some(),
            NodeAction::Restart => {
                now_node.is_some_and(|n| before.get(id).is_none_or(|b| b.1 != n.attempt))
            }
            _ => true,
        };
        if taken {
            match decision.action {
                NodeAction::None => {}
                NodeAction::Dispatch(_) => took.dispatches += 1,
                _ => took.transitions += 1,
            }
            continue;
        }
        let cause = match decision.action {
            NodeAction::Dispatch(EffectKind::CreateLease)
                if decision.rule == provisioning::Rule::CreateLease =>
            {
                let cap = holds.cap.ok_or_else(|| {
                    breach(
                        GuaranteeId::BudgetsHold,
                        format!(
                            "a pass at {now} held back the first create of {id} without a launch cap"
                        ),
                    )
                })?;
                ensure(
                    creates_pending >= u64::from(cap),
                    GuaranteeId::BudgetsHold,
                    || {
                        format!(
                            "a pass at {now} held back the first create of {id} with only {creates_pending} creates pending under a launch cap of {cap}"
                        )
                    },
                )?;
                &mut held.cap
            }
            NodeAction::BeginDelete => {
                let group = id.group();
                let ready = before.get(id).is_some_and(|b| b.3);
                let drifted = match (now_node, slots.template(id)) {
                    (Some(node), Some(template)) => node.spec.template() != template,
                    _ => false,
                };
                let budget = holds.budgets.get(group).copied();
                ensure(
                    budget.is_some() && ready && drifted,
                    GuaranteeId::BudgetsHold,
                    || {
                        format!(
                            "a pass at {now} held back the teardown of {id}, which is not a ready drifted node of a group under a rollout budget ({})",
                            if slots.contains(id) {
                                "desired"
                            } else {
                                "undesired: a scale-down is never held"
                            }
                        )
                    },
                )?;
                let budget = budget.unwrap_or(0);
                let unready = unready_desired(after, slots, group);
                ensure(unready >= budget, GuaranteeId::BudgetsHold, || {
                    format!(
                        "a pass at {now} held back the rollout of {id} with {unready} desired slots of group {group} unready, under its budget of {budget}"
                    )
                })?;
                &mut held.budget
            }
            NodeAction::Insert | NodeAction::Restart => {
                ensure(
                    (holds.breaker_holds)(id.group()),
                    GuaranteeId::BreakerLiveness,
                    || {
                        format!(
                            "a pass at {now} held back the new attempt of {id} ({:?}) though the kit's model of group {}'s breaker is closed",
                            decision.action,
                            id.group()
                        )
                    },
                )?;
                &mut held.breaker
            }
            action => {
                return Err(breach(
                    GuaranteeId::Quiescence,
                    format!(
                        "a pass at {now} planned {action:?} for {id} (row {:?}) but did not take the step, and no limit holds such a step",
                        decision.rule
                    ),
                ));
            }
        };
        *cause += 1;
    }
    Ok((held, took))
}

/// Desired slots of `group` without a ready node in `state`.
fn unready_desired(state: &ClusterState, slots: &DesiredSlots, group: &GroupId) -> u32 {
    let count = slots.count(group);
    let ready = state
        .nodes
        .iter()
        .filter(|(id, node)| id.group() == group && id.index() < count && kit_ready(node))
        .count() as u32;
    count.saturating_sub(ready)
}

/// Every attempt id the kit has seen in the run, and which of them ended.
#[derive(Clone, Debug, Default)]
pub(crate) struct AttemptsSeen {
    /// The slot each attempt id was first seen at.
    slot_of: BTreeMap<NodeAttemptId, LogicalNodeId>,
    /// The attempt each slot held when last looked at.
    current: BTreeMap<LogicalNodeId, NodeAttemptId>,
    /// Attempts that were destroyed, replaced or reaped.
    ended: BTreeSet<NodeAttemptId>,
}

/// G01 (history form): against every attempt id the kit has seen in the
/// run, an attempt is never seen at a second slot, and an attempt that was
/// destroyed, replaced or reaped never comes back in use — not even at its
/// own slot (a restart that kept its id). Records what it saw.
pub(crate) fn g01_attempts_never_come_back(
    state: &ClusterState,
    seen: &mut AttemptsSeen,
) -> Verdict {
    for (id, node) in &state.nodes {
        if let Some(first) = seen.slot_of.get(&node.attempt) {
            ensure(first == id, GuaranteeId::Identity, || {
                format!(
                    "{} uses attempt {}, which the kit saw first at slot {first}",
                    label(id, node),
                    node.attempt
                )
            })?;
        }
        let alive = node.record.stage != NodeStage::Destroyed;
        ensure(
            !(alive && seen.ended.contains(&node.attempt)),
            GuaranteeId::Identity,
            || {
                format!(
                    "{} is in stage {} with attempt {}, which had already ended (destroyed, replaced or reaped): an attempt id was reused",
                    label(id, node),
                    node.record.stage.name(),
                    node.attempt
                )
            },
        )?;
    }
    for (id, node) in &state.nodes {
        seen.slot_of
            .entry(node.attempt)
            .or_insert_with(|| id.clone());
        if let Some(previous) = seen.current.insert(id.clone(), node.attempt) {
            if previous != node.attempt {
                seen.ended.insert(previous);
            }
        }
        if node.record.stage == NodeStage::Destroyed {
            seen.ended.insert(node.attempt);
        }
    }
    let gone: Vec<LogicalNodeId> = seen
        .current
        .keys()
        .filter(|id| !state.nodes.contains_key(*id))
        .cloned()
        .collect();
    for id in gone {
        if let Some(attempt) = seen.current.remove(&id) {
            seen.ended.insert(attempt);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// G32 stage coherence.
// ---------------------------------------------------------------------------

/// Facts a stage requires or rules out: whether each is present, and its name.
type Facts = Vec<(bool, &'static str)>;

/// G32: a node's stage agrees with its facts. Each stage claims some facts
/// (it must hold them) and rules others out (it must not hold them):
///
/// | Stage | Holds | Holds not |
/// |---|---|---|
/// | `New` | — | lease, endpoint, bootstrap, join, failure, a pending create |
/// | `LeaseRequested` | — | lease, endpoint, bootstrap, join, failure |
/// | `LeaseCreated` | lease | endpoint, bootstrap, join, failure |
/// | `EndpointKnown` | lease, endpoint | an active session, join, failure |
/// | `BootstrapRunning` | lease, endpoint, an active session | join, failure |
/// | `SwarmJoined` | lease, endpoint, bootstrap, join | failure |
/// | `HandedOff`, `Dormant` | lease, endpoint, join, handoff | failure, an active session (`Dormant`) |
/// | `Failed` | a failure | readiness |
/// | `Destroyed` | — | lease, endpoint, an active session, a pending operation, readiness |
///
/// A node being deleted may already have given a lease back before the pass
/// that marks it destroyed, so "holds" is required of active nodes only; and
/// a failure is only ever held in `Failed` or `Destroyed`.
pub(crate) fn g32_stage_agrees_with_facts(id: &LogicalNodeId, node: &ManagedNode) -> Verdict {
    let record = &node.record;
    let lease = record.lease.is_some();
    let endpoint = record.endpoint.is_some();
    let bootstrap = record.bootstrap.is_some();
    let session = record.session_active();
    let joined = record.swarm.is_some();
    let failed = record.failure.is_some();
    let handed_off = record.handed_off_at.is_some();
    let pending_create = node
        .pending
        .as_ref()
        .is_some_and(|p| p.kind == EffectKind::CreateLease);
    let active = node.intent == Intent::Active;
    let (holds, holds_not): (Facts, Facts) = match record.stage {
        NodeStage::New => (
            vec![],
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
                (failed, "a failure"),
                (pending_create, "a pending create"),
            ],
        ),
        NodeStage::LeaseRequested => (
            vec![(pending_create, "a pending create")],
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
                (failed, "a failure"),
            ],
        ),
        NodeStage::LeaseCreated => (
            vec![(lease, "a lease")],
            vec![
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
                (failed, "a failure"),
            ],
        ),
        NodeStage::EndpointKnown => (
            vec![(lease, "a lease"), (endpoint, "an endpoint")],
            vec![
                (session, "an active session"),
                (joined, "a swarm join"),
                (failed, "a failure"),
            ],
        ),
        NodeStage::BootstrapRunning => (
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (session, "an active session"),
            ],
            vec![(joined, "a swarm join"), (failed, "a failure")],
        ),
        NodeStage::SwarmJoined => (
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (bootstrap, "bootstrap facts"),
                (joined, "a swarm join"),
            ],
            vec![(failed, "a failure")],
        ),
        NodeStage::HandedOff | NodeStage::Dormant => (
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (joined, "a swarm join"),
                (handed_off, "a handoff"),
            ],
            vec![
                (failed, "a failure"),
                (
                    session && record.stage == NodeStage::Dormant,
                    "an active session",
                ),
            ],
        ),
        NodeStage::Failed => (
            vec![(failed, "a failure")],
            vec![(record.ready, "readiness")],
        ),
        NodeStage::Destroyed => (
            vec![],
            vec![
                (lease, "a lease"),
                (endpoint, "an endpoint"),
                (session, "an active session"),
                (node.pending.is_some(), "a pending operation"),
                (record.ready, "readiness"),
            ],
        ),
    };
    let missing: Vec<&str> = holds
        .into_iter()
        .filter(|(present, _)| active && !present)
        .map(|(_, what)| what)
        .collect();
    let extra: Vec<&str> = holds_not
        .into_iter()
        .filter(|(present, _)| *present)
        .map(|(_, what)| what)
        .collect();
    ensure(
        missing.is_empty() && extra.is_empty(),
        GuaranteeId::StageCoherence,
        || {
            let mut text = format!("{} is in stage {}", label(id, node), record.stage.name());
            if !missing.is_empty() {
                text.push_str(&format!(" without {}", missing.join(", ")));
            }
            if !extra.is_empty() {
                if !missing.is_empty() {
                    text.push_str(" and");
                }
                text.push_str(&format!(" holding {}", extra.join(", ")));
            }
            text
        },
    )
}

/// G32 over every node of `state`.
pub(crate) fn g32_stages_agree_with_facts(state: &ClusterState) -> Verdict {
    for (id, node) in &state.nodes {
        g32_stage_agrees_with_facts(id, node)?;
    }
    Ok(())
}

/// G10 (deletion form): after a drive, a node being deleted and not yet
/// destroyed has a cleanup step (or the re-issue of an ambiguous operation)
/// in flight — unless it waits on a stored backoff it may wait on: one it
/// already waited on before the drive while deleting (a failed cleanup
/// step's), or one kept to re-issue a remembered ambiguous create/start. A
/// node that began deletion in this drive has no reason to wait otherwise.
pub(crate) fn g10_deletion_proceeds_at_once(change: &SlotChange<'_>, now: Timestamp) -> Verdict {
    let Some(after) = change.after else {
        return Ok(());
    };
    if after.intent != Intent::Deleting
        || after.record.stage == NodeStage::Destroyed
        || after.pending.is_some()
    {
        return Ok(());
    }
    let waits = after.retry.next_effect_at.filter(|t| later_than(*t, now));
    let allowed = waits.is_some_and(|at| {
        after.retry.ambiguous.is_some()
            || change.before.is_some_and(|before| {
                before.attempt == after.attempt
                    && before.intent == Intent::Deleting
                    && before.retry.next_effect_at == Some(at)
            })
    });
    ensure(allowed, GuaranteeId::AttemptFailure, || {
        format!(
            "deleting {} has no cleanup step in flight after the pass (next_effect_at {:?}, stage {})",
            label(change.id, after),
            after.retry.next_effect_at,
            after.record.stage.name()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use provisioning::id::OperationSequence;
    use provisioning::{EffectKind, GroupId, OperationId};

    fn call(attempt: u64, sequence: u32) -> CallRecord {
        CallRecord {
            op: OperationId::new(
                NodeAttemptId::from_raw(attempt),
                OperationSequence::from_raw(sequence),
            ),
            node: LogicalNodeId::new(GroupId::new("a"), 0),
            kind: EffectKind::CreateLease,
            overlapping: 0,
        }
    }

    #[test]
    fn the_executor_may_publish_for_an_expired_operation_only_its_timeout() {
        let op = call(1, 1).op;
        let result = |outcome| ExecutorResult {
            op,
            node: LogicalNodeId::new(GroupId::new("a"), 0),
            kind: EffectKind::CreateLease,
            outcome,
        };
        let late = result(Ok(EffectOutput::ConvergenceAcknowledged));
        let timeout = result(Err(provisioning::EffectError::timed_out()));
        let submitted = BTreeSet::from([op]);
        let expired = BTreeSet::from([op]);
        let none = BTreeSet::new();
        assert!(g02_published_result_is_accounted_for(&late, &submitted, &none).is_ok());
        assert!(g02_published_result_is_accounted_for(&timeout, &submitted, &expired).is_ok());
        for (result, submitted) in [(&late, &submitted), (&timeout, &none)] {
            let verdict = g02_published_result_is_accounted_for(result, submitted, &expired);
            assert_eq!(
                verdict.map_err(|b| b.guarantee),
                Err(GuaranteeId::Correlation)
            );
        }
    }

    #[test]
    fn a_call_starting_after_a_newer_operation_of_its_attempt_breaks_g04() {
        let mut newest = BTreeMap::new();
        assert!(g04_no_call_after_a_newer_one(&call(1, 1), &mut newest).is_ok());
        assert!(g04_no_call_after_a_newer_one(&call(1, 3), &mut newest).is_ok());
        assert!(g04_no_call_after_a_newer_one(&call(2, 1), &mut newest).is_ok());
        assert!(
            g04_no_call_after_a_newer_one(&call(1, 3), &mut newest).is_ok(),
            "the same operation again (an adoption re-issue) is fine"
        );
        let stale = g04_no_call_after_a_newer_one(&call(1, 2), &mut newest);
        let breach = stale.err().map(|b| (b.guarantee, b.detail));
        assert!(
            matches!(&breach, Some((GuaranteeId::RecordBeforeDispatch, d)) if d.contains("a1/op2") && d.contains("a1/op3")),
            "{breach:?}"
        );
    }

    #[test]
    fn the_executor_accounts_for_its_results_by_the_kits_own_counts() {
        let counters = provisioning::executor::ExecutorCounters {
            started: 5,
            skipped: 2,
            completed: 3,
            replayed: 1,
            expired: 1,
            late_dropped: 2,
            panics: 1,
            waited: 1,
        };
        // 4 results taken (3 completions, 1 replay), 4 calls ended (1 of
        // them dropped late), 1 skip at a submission, 1 operation said
        // started that never reached the backend (dropped late too).
        let seen = ExecutorSeen {
            taken: 4,
            replayed: 1,
            notified: 4,
            calls_ended: 4,
            panics: 1,
            started_never_called: Some(1),
            skipped_at_submission: 1,
            skipped_at_expiry: 0,
            uncalled: 2,
        };
        assert!(g04_executor_accounts_for_its_results(&counters, &seen).is_ok());
        let broken = [
            ExecutorSeen { taken: 5, ..seen },
            ExecutorSeen {
                notified: 3,
                ..seen
            },
            ExecutorSeen { panics: 0, ..seen },
            ExecutorSeen {
                calls_ended: 6,
                ..seen
            },
            ExecutorSeen {
                calls_ended: 2,
                ..seen
            },
            ExecutorSeen {
                started_never_called: Some(2),
                ..seen
            },
            ExecutorSeen {
                skipped_at_submission: 2,
                ..seen
            },
            ExecutorSeen {
                skipped_at_expiry: 1,
                ..seen
            },
            ExecutorSeen {
                uncalled: 1,
                ..seen
            },
        ];
        for seen in broken {
            let verdict = g04_executor_accounts_for_its_results(&counters, &seen);
            assert_eq!(
                verdict.map_err(|b| b.guarantee),
                Err(GuaranteeId::RecordBeforeDispatch),
                "{seen:?}"
            );
        }
        let dropped_more = provisioning::executor::ExecutorCounters {
            late_dropped: 5,
            ..counters
        };
        assert!(g04_executor_accounts_for_its_results(&dropped_more, &seen).is_err());
    }

    #[test]
    fn a_panicking_call_is_reported_as_a_definite_error_with_the_panics_message() {
        let result = |outcome| ExecutorResult {
            op: call(1, 1).op,
            node: LogicalNodeId::new(GroupId::new("a"), 0),
            kind: EffectKind::CreateLease,
            outcome,
        };
        let text = "scripted backend panic";
        let told = result(Err(provisioning::EffectError::definite(format!(
            "backend panicked: {text}"
        ))));
        assert!(g13_panic_reported_with_its_message(&told, Some(text)).is_ok());
        assert!(g13_panic_reported_with_its_message(&told, None).is_ok());
        let untold = result(Err(provisioning::EffectError::definite("backend panicked")));
        let ambiguous = result(Err(provisioning::EffectError::ambiguous(text)));
        let fine = result(Ok(EffectOutput::ConvergenceAcknowledged));
        for result in [&untold, &ambiguous, &fine] {
            let verdict = g13_panic_reported_with_its_message(result, Some(text));
            assert_eq!(
                verdict.map_err(|b| b.guarantee),
                Err(GuaranteeId::ErrorsNotPanics)
            );
        }
    }
}
