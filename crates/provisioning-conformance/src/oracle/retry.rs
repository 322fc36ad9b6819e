//! The retry ladder and its clock: G09 (stored delays follow the policy and
//! the kit's own failure count; no effect before its backoff), G10 (failed
//! and deleting nodes start cleaning up at once), G11 (a probe is not a
//! failure), G12 (a wrong answer is ambiguous, and ambiguity is forgotten
//! only by an answer; nothing destructive meanwhile) and G25 (a deadline is
//! stored at dispatch).
//!
//! Checked after every fold (fold forms) and after every drive (per
//! dispatch and per changed slot).

use std::collections::BTreeMap;

use provisioning::{
    ClusterState, EffectKind, Intent, LogicalNodeId, ManagedNode, NodeStage, Observation,
    RetryPolicy, Timestamp,
};

use super::model::{at_or_after, later_than, plus_ms};
use super::observed::{FoldCause, NewDispatch, SlotChange};
use super::verdict::{Verdict, ensure, label};
use crate::guarantee::GuaranteeId;

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
            let cleanup = plus_ms(now, policy.cleanup_backoff(failures, after.attempt));
            let expected = if cause.is_probe() {
                probe
            } else if cause.is_failed_cleanup() {
                cleanup
            } else {
                backoff
            };
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
/// kit's reading of design §6: a failed or wrongly answered operation (except a
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
    // A rejoin window that ended loses the node, which stores its restart
    // (held to the policy by `g09_rejoin_loss_backs_off`).
    ensure(
        after.retry.restart_at == before.retry.restart_at || super::rejoin::rejoin_expired(change),
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
