//! The oracle: one named check per guarantee and per place it applies.
//!
//! Checks are pure functions of what the harness observed (state snapshots,
//! the substrate's ledger, the fold or pass that just happened) and return a
//! [`Breach`] naming the guarantee. They live by guarantee family, so that
//! every form of one guarantee's check stands in one file:
//!
//! | File | Guarantees |
//! |---|---|
//! | `identity.rs` | G01 G02 G03: attempt identity and correlation |
//! | `dispatch.rs` | G04 G05 G13 (panic form) G27: record before dispatch, deduplication |
//! | `facts.rs` | G06 G07 G14 G15: fact coherence |
//! | `stages.rs` | G32: stage coherence, histories |
//! | `ledger.rs` | G08 G23 G28: live resources, leaks, orphans |
//! | `retry.rs` | G09 G10 G11 G12 G25: backoff, cleanup, probes, ambiguity, deadlines |
//! | `generation.rs` | G16 G17: generations and the desired shape |
//! | `plan.rs` | G19: the driver against the pure decider (with G29/G30's holds) |
//! | `limits.rs` | G29 G30 (resume form): the operator's limits |
//! | `recovery.rs` | G26: durable state across a crash |
//! | `rejoin.rs` | G37: readiness re-earned after a crash |
//! | `membership.rs` | G35: the peers updates a host hands its agents |
//!
//! Beside them, `verdict.rs` holds what a check returns, `model.rs` the
//! kit's own model (plain-millisecond time, [`DesiredSlots`], readiness,
//! ownership) and `observed.rs` what the harness saw around a moment
//! (`FoldCause`, `SlotChange`, `NewDispatch`). The families lean on
//! those three and never on each other or on this file. This file hands
//! their checks on to the harness under the names it has always called, and
//! runs together the families due at one fold ([`at_fold`]), one backend
//! call start ([`at_call_start`]) and one dispatched operation
//! ([`at_dispatch`]).
//!
//! The harness decides when to run them:
//!
//! | When | Checks |
//! |---|---|
//! | after every input (settled) | G01 G02 G03 G06 G08 G14 G15 G16 G17 G32, G19 "converged means no requeue" |
//! | after every fold of a result or observation | G32 G07 G09 G11 G12 |
//! | for every stale delivery | G02 (results), G03 (observations of other attempts): nothing changes |
//! | after every pass batch (`drive_until_blocked`) | G01 (new attempts, ids ever seen) G32 G06/G07 (replacement) G09 (failure counts, backoff) G10 (failed and deleting nodes clean up) G12 (retry bookkeeping untouched by passes) G17 G25 (stored deadline) |
//! | for every backend call start | G04 G05 |
//! | at every host wake on an operation deadline | G25 (not a tick early), G02 (the timeout reported twice) |
//! | every few inputs and at the end | G19 forced pass |
//! | revision probes | G16 |
//! | after every drive (and every wake without one) | G35: the membership taken, against the state now |
//! | after the fair tail | G21 G22 G23 G24 |
//! | across runs of one trace | G18 (same trace twice), G20 (tail work in another order) |
//! | at every recovery after a crash | G26 (pending operations made ambiguous, journal readable, recovery succeeds), G37 |
//! | after every input | G37 (a node recovered as ready is not ready, and the driver not converged, until its re-join was folded) |
//! | at every backend call start | G27 (committed as pending before the call) |
//! | after every input and tail round; at every orphan destroy | G28 (collected in time once faults stop; never an owned resource) |
//!
//! The oracle keeps its own model where the driver's answer would vouch for
//! itself: deadlines are compared in plain milliseconds, never with the
//! core's `Timestamp` comparisons; desired slots come from the kit's model
//! of the shapes it submitted ([`DesiredSlots`]), never the driver's
//! `DesiredState`; expected delays come from the kit's own count of a
//! slot's consecutive failures; attempt ids are checked against every id the
//! kit has seen in the run ([`AttemptsSeen`]).

mod dispatch;
mod facts;
mod generation;
mod identity;
mod ledger;
mod limits;
mod membership;
mod model;
mod observed;
mod plan;
mod recovery;
mod rejoin;
mod retry;
mod stages;
mod verdict;

use std::collections::{BTreeMap, BTreeSet};

use provisioning::{
    ClusterState, LogicalNodeId, ManagedNode, NodeAttemptId, OperationId, RetryPolicy, Timestamp,
};

use crate::substrate::CallRecord;

pub(crate) use dispatch::{
    ExecutorSeen, g04_call_was_recorded, g04_drive_report_matches_sink,
    g04_driver_counts_what_it_did, g04_executor_accounts_for_its_results,
    g04_executor_counts_what_it_did, g04_no_call_after_a_newer_one, g04_no_call_after_its_expiry,
    g05_different_input_is_refused, g05_newest_is_answered_from_the_record,
    g05_one_call_per_attempt, g05_resubmission_is_deduplicated,
    g13_panic_reported_with_its_message, g27_committed_before_the_call,
};
pub(crate) use facts::{
    g06_dead_nodes_hold_nothing, g07_attempts_end_only_when_empty,
    g07_facts_leave_only_on_confirmed_absence, g14_readiness_coherence,
    g15_convergence_reported_after_join, g15_convergence_reported_once,
    g15_no_event_after_the_session_ended, g15_session_coherence,
};
pub(crate) use generation::{
    g16_generation_is_monotonic, g17_only_undesired_drifted_or_failed_nodes_are_deleted,
    g17_undesired_slots_are_not_active,
};
pub(crate) use identity::{
    AttemptsSeen, g01_attempts_never_come_back, g01_identity_in_state, g01_new_attempts_are_fresh,
    g02_executor_expires_what_it_holds, g02_pending_belongs_to_current_attempt,
    g02_published_result_is_accounted_for, g03_facts_belong_to_current_attempt,
};
pub(crate) use ledger::{
    g08_no_double_create, g23_converged_leaks_nothing, g28_never_an_owned_resource,
    g28_orphans_collected_in_time,
};
pub(crate) use limits::{
    g29_creates_in_flight_are_counted, g29_creates_within_cap, g29_rollout_within_budget,
    g30_resume_reports_and_closes, g30_resumed_group_is_not_held, is_drift_takedown,
};
pub(crate) use membership::{MembershipWatch, g35_update_lists_exactly_the_ready_attempts};
pub(crate) use model::{
    DesiredSlots, at_or_after, creates_pending, kit_ready, later_than, owned, unavailable_slots,
};
pub(crate) use observed::{
    Condition, FoldCause, NewDispatch, condition, new_dispatches, pass_before, slot_changes,
};
pub(crate) use plan::{
    Held, Holds, g19_converged_has_no_requeue, g19_pass_did_what_it_planned,
    g19_settled_driver_agrees_with_plan,
};
pub(crate) use recovery::{
    g26_journal_holds_durable_state, g26_recovery_made_pending_ambiguous,
    g26_recovery_reports_what_it_recovered, g26_write_carries_the_clock,
};
pub(crate) use rejoin::{g09_rejoin_loss_backs_off, g37_readiness_is_re_earned, rejoin_expired};
pub(crate) use retry::{
    counts_as_failure, g09_delays_follow_the_policy, g09_no_effect_before_backoff,
    g09_passes_keep_failure_counts, g10_deletion_proceeds_at_once,
    g10_failed_attempt_starts_cleanup, g11_probe_is_not_failure,
    g12_ambiguity_forgotten_only_by_an_answer, g12_no_destructive_step_while_ambiguous,
    g12_not_destroyed_while_ambiguous, g12_passes_keep_retry_bookkeeping,
    g12_wrong_answer_is_ambiguous, g25_deadline_is_stored_at_dispatch,
};
pub(crate) use stages::{
    g32_history_agrees_with_nodes, g32_loss_names_what_was_lost, g32_stage_agrees_with_facts,
    g32_stages_agree_with_facts, g32_teardown_names_its_cause,
};
pub(crate) use verdict::{Breach, Verdict, breach, describe_node, describe_pending};

// The moments at which the harness runs several families at once. Each runs
// its checks in a fixed order and stops at the first breach, so a report
// names the same guarantee on every replay.

/// The checks of one fold — a result or an observation folded on `id`,
/// `before` and `after` being the node around it, `failures` the kit's own
/// count of the slot's consecutive failures after it: G32 (stage, loss
/// reason), G07, G09, G11 and G12.
pub(crate) fn at_fold(
    id: &LogicalNodeId,
    before: &ManagedNode,
    after: &ManagedNode,
    cause: &FoldCause<'_>,
    policy: &RetryPolicy,
    now: Timestamp,
    failures: u32,
) -> Verdict {
    g32_stage_agrees_with_facts(id, after)
        .and_then(|()| g32_loss_names_what_was_lost(id, before, after, cause))
        .and_then(|()| g07_facts_leave_only_on_confirmed_absence(id, before, after, cause))
        .and_then(|()| {
            g09_delays_follow_the_policy(id, before, after, cause, policy, now, failures)
        })
        .and_then(|()| g11_probe_is_not_failure(id, before, after, cause))
        .and_then(|()| g12_wrong_answer_is_ambiguous(id, after, cause))
        .and_then(|()| g12_ambiguity_forgotten_only_by_an_answer(id, before, after, cause))
}

/// The checks of one backend call start: G05 (one call per attempt in
/// flight) and G04 (recorded pending, not overtaken by a newer operation of
/// its attempt, and — on a `strict` substrate, where every start before an
/// expiry was seen before it — not started after its expiry). `newest`
/// records the call as the newest of its attempt.
pub(crate) fn at_call_start(
    call: &CallRecord,
    state: &ClusterState,
    timed_out: &BTreeSet<OperationId>,
    ever_pending: &BTreeSet<OperationId>,
    expired: &BTreeSet<OperationId>,
    newest: &mut BTreeMap<NodeAttemptId, OperationId>,
    strict: bool,
) -> Verdict {
    g05_one_call_per_attempt(call)
        .and_then(|()| g04_call_was_recorded(call, state, timed_out, ever_pending, strict))
        .and_then(|()| g04_no_call_after_a_newer_one(call, newest))
        .and_then(|()| {
            if strict {
                g04_no_call_after_its_expiry(call, expired)
            } else {
                Ok(())
            }
        })
}

/// The checks of one operation a drive dispatched (`pre` and `post` being
/// the state around the drive): G25 (its deadline stored), G09 (not before
/// its backoff), G12 (nothing destructive while ambiguous) and G15 (a
/// convergence reported once, and only for a session whose join the kit
/// reported).
pub(crate) fn at_dispatch(
    dispatch: &NewDispatch,
    pre: &ClusterState,
    post: &ClusterState,
    policy: &RetryPolicy,
    now: Timestamp,
    convergence_reported: &BTreeSet<NodeAttemptId>,
    joined: &BTreeSet<NodeAttemptId>,
) -> Verdict {
    g25_deadline_is_stored_at_dispatch(dispatch, policy, now)
        .and_then(|()| g09_no_effect_before_backoff(dispatch, pre, post, now))
        .and_then(|()| g12_no_destructive_step_while_ambiguous(dispatch, pre))
        .and_then(|()| g15_convergence_reported_once(dispatch, convergence_reported))
        .and_then(|()| g15_convergence_reported_after_join(dispatch, joined))
}
