//! G26, durable state across a crash: every write carries the writer's
//! clock, the journal equals the driver's durable state after a commit, and
//! recovery makes pending operations ambiguous and reports what it read.
//!
//! Checked at every commit and at every recovery after a crash.

use std::collections::BTreeMap;

use provisioning::state::PendingOperation;
use provisioning::{ClusterState, EffectKind, LogicalNodeId, Timestamp};

use super::verdict::{Verdict, breach, describe_node, ensure, label};
use crate::guarantee::GuaranteeId;

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
