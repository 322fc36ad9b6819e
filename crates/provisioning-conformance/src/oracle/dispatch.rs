//! Recording before dispatch and deduplication: G04 (a call starts only for
//! an operation the driver recorded pending, never after it expired or was
//! overtaken, and the driver's and executor's counters agree with what the
//! kit saw), G05 (one call per attempt in flight; a resubmission is
//! deduplicated, a conflicting one refused), G13 in its panic form (a
//! panicking call comes back as a definite error with its message) and G27
//! (the operation was committed to the journal before its call started).
//!
//! Checked at every backend call start, after every drive (report form),
//! after every settled input (count forms) and at every resubmission.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::{
    ClusterState, EffectKind, ExecutorResult, LogicalNodeId, ManagedNode, NodeAttemptId,
};

use super::verdict::{Verdict, breach, ensure};
use crate::guarantee::GuaranteeId;
use crate::substrate::CallRecord;

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

/// G05: no two calls of one attempt in flight at the backend at once.
pub(crate) fn g05_one_call_per_attempt(call: &CallRecord) -> Verdict {
    ensure(call.overlapping == 0, GuaranteeId::SingleFlight, || {
        format!(
            "the backend started {} {} for {} while {} other call(s) of its attempt were running",
            call.kind, call.op, call.node, call.overlapping
        )
    })
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

#[cfg(test)]
mod tests {
    use provisioning::effect::EffectOutput;
    use provisioning::id::OperationSequence;
    use provisioning::{GroupId, OperationId};

    use super::*;

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
