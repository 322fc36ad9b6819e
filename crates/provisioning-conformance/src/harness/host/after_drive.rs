//! The checks after every drive: new attempts and every changed slot
//! against the identity, fact, retry, generation and limit families, the
//! breakers against the kit's model (G30), every refusal held to the fold
//! checks; and the forced pass over a settled machine (G19).

use std::collections::BTreeSet;

use provisioning::{
    ClusterState, EffectKind, ExecutorResult, GroupId, Intent, LogicalNodeId, ManagedNode,
};

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::Harness;
use crate::oracle::{self, FoldCause, breach};
use crate::substrate::Substrate;

impl<S: Substrate> Harness<S> {
    pub(super) fn check_drive(
        &mut self,
        pre: &ClusterState,
        edge: bool,
        refused: &[provisioning::Operation],
    ) -> Result<(), Violation> {
        // A refused submission is folded inside the pass, as a definite
        // failure of its operation: its node is held to the fold checks
        // (below), not to the rule that passes keep retry bookkeeping.
        let folded_here: BTreeSet<&LogicalNodeId> = refused.iter().map(|op| &op.node).collect();
        let now = self.now;
        let policy = *self.driver.policy();
        let post = self.driver.state();
        let mut highest = self.highest_attempt;
        if let Err(reused) = oracle::g01_new_attempts_are_fresh(pre, post, &mut highest)
            .and_then(|()| oracle::g01_attempts_never_come_back(post, &mut self.attempts))
        {
            return Err(self.crash_aware(reused.guarantee, reused.detail));
        }
        let desired = &self.slots;
        let mut verdict = oracle::g32_stages_agree_with_facts(post);
        let dispatches = oracle::new_dispatches(pre, post);
        for dispatch in &dispatches {
            verdict = verdict.and_then(|()| {
                oracle::at_dispatch(
                    dispatch,
                    pre,
                    post,
                    &policy,
                    now,
                    &self.executor_watch.convergence_reported,
                    &self.executor_watch.joined,
                )
            });
        }
        // A rejoin window that ended in a pass lost its node (G37's loss
        // path): the one failure a pass makes. The kit counts it as it
        // counts a reported loss, in the slot's failures and the breaker.
        for change in oracle::slot_changes(pre, post) {
            if !oracle::rejoin_expired(&change) {
                continue;
            }
            let count = self.failures.entry(change.id.clone()).or_default();
            *count = count.saturating_add(1);
            let count = *count;
            if let (Some(before), Some(after)) = (change.before, change.after) {
                self.breaker_watch
                    .fold(change.id.group(), before, after, &self.limits, now);
            }
            verdict = verdict
                .and_then(|()| oracle::g09_rejoin_loss_backs_off(&change, count, &policy, now));
        }
        let mut replacements = 0;
        let mut scale_downs = 0;
        for change in oracle::slot_changes(pre, post) {
            let folded = folded_here.contains(change.id);
            verdict = verdict
                .and_then(|()| oracle::g07_attempts_end_only_when_empty(&change, desired, now))
                .and_then(|()| oracle::g12_not_destroyed_while_ambiguous(&change))
                .and_then(|()| {
                    if folded {
                        Ok(())
                    } else {
                        oracle::g12_passes_keep_retry_bookkeeping(&change)
                    }
                })
                .and_then(|()| {
                    // A refusal folded in the pass may have failed the node
                    // that a later pass of the drive began to tear down.
                    // So may a rejoin window that ended in this drive.
                    let failed_here = (folded
                        && change.after.is_some_and(|a| a.record.failure.is_some()))
                        || oracle::rejoin_expired(&change);
                    if failed_here {
                        Ok(())
                    } else {
                        oracle::g17_only_undesired_drifted_or_failed_nodes_are_deleted(
                            &change, desired,
                        )
                    }
                });
            if !edge {
                verdict = verdict
                    .and_then(|()| {
                        if folded {
                            Ok(())
                        } else {
                            oracle::g10_failed_attempt_starts_cleanup(&change, now)
                        }
                    })
                    .and_then(|()| {
                        // Near the end of the clock a cleanup step may have
                        // no deadline to be dispatched with (G13's edge).
                        // (A refused cleanup step was dispatched, and folded.)
                        if self.edges_reached || folded {
                            Ok(())
                        } else {
                            oracle::g10_deletion_proceeds_at_once(&change, now)
                        }
                    })
                    .and_then(|()| {
                        let failures = &self.failures;
                        if folded {
                            Ok(())
                        } else {
                            oracle::g09_passes_keep_failure_counts(&change, failures)
                        }
                    });
            }
            if let (Some(before), Some(after)) = (change.before, change.after) {
                if before.attempt != after.attempt {
                    replacements += 1;
                }
                if before.intent == Intent::Active
                    && after.intent == Intent::Deleting
                    && !desired.contains(change.id)
                {
                    scale_downs += 1;
                }
            }
        }
        let cap = self
            .limits
            .max_concurrent_creates
            .get(crate::harness::PROVIDER_KIND)
            .copied();
        verdict = verdict.and_then(|()| oracle::g29_creates_within_cap(&dispatches, post, cap));
        if verdict.is_ok()
            && cap.is_some_and(|cap| {
                dispatches
                    .iter()
                    .any(|d| d.pending.kind == EffectKind::CreateLease)
                    && oracle::creates_pending(post) >= cap as usize
            })
        {
            self.vacuity.cap_reached += 1;
        }
        let mut drifted_groups = BTreeSet::new();
        for change in oracle::slot_changes(pre, post) {
            if oracle::is_drift_takedown(&change, self.driver.desired()) {
                if self.limits.max_unavailable.contains_key(change.id.group()) {
                    self.vacuity.budget_rollouts += 1;
                }
                drifted_groups.insert(change.id.group().clone());
            }
        }
        let desired = self.driver.desired();
        for group in &drifted_groups {
            if let Some(budget) = self.limits.max_unavailable.get(group) {
                let allowed = budget.of(desired.groups().get(group).map_or(0, |g| g.count()));
                verdict = verdict.and_then(|()| {
                    oracle::g29_rollout_within_budget(group, post, desired, allowed)
                });
            }
        }
        self.check(verdict)?;
        let post = self.driver.state();
        self.failures.retain(|id, _| post.nodes.contains_key(id));
        self.highest_attempt = highest;
        self.vacuity.replacements += replacements;
        self.vacuity.scale_downs += scale_downs;
        for dispatch in dispatches {
            let attempt = dispatch.pending.id.attempt();
            if dispatch.pending.kind.is_cleanup() && self.cleanup_failed.remove(&attempt) {
                self.vacuity.cleanup_retries += 1;
            }
            self.ever_pending.insert(dispatch.pending.id);
        }
        // The attempts the drive started, against the kit's breakers, before
        // the drive's refusals are folded into them: a probe whose create was
        // refused is out by the driver's books (finding 11). The kit sees a
        // drive's starts and refusals, not their order, so it takes the
        // starts first; a start let through after a refusal of the same drive
        // opened its group's breaker is not caught here (docs/testing.md).
        if !edge && !self.edges_reached {
            let verdict =
                self.breaker_watch
                    .drive(pre, self.driver.state(), &self.limits, self.now);
            self.check(verdict)?;
        }
        // Each refused operation, as the definite failure it was folded as:
        // the fold checks (the kit's failure count, the breaker, the
        // backoff) hold for it as for one delivered.
        for (index, op) in refused.iter().enumerate() {
            // A node inserted by the drive was new, with nothing counted.
            let inserted = || {
                self.driver.state().node(&op.node).map(|n| ManagedNode {
                    retry: provisioning::state::RetryState::default(),
                    ..n.clone()
                })
            };
            let Some(before) = pre.node(&op.node).cloned().or_else(inserted) else {
                continue;
            };
            // The driver's breakers already hold every refusal of the
            // drive: the kit's model is compared once it folded them all.
            self.more_refusals_to_fold = refused[index + 1..]
                .iter()
                .any(|other| other.node.group() == op.node.group());
            let result = ExecutorResult {
                op: op.id,
                node: op.node.clone(),
                kind: op.kind(),
                outcome: Err(provisioning::EffectError::definite(
                    "submission refused: the host's outbox is full",
                )),
            };
            // G12 (refusal form): a refusal is the host's answer, not the
            // provider's: what the provider may have done stays remembered.
            let forgot =
                before.retry.ambiguous.is_some()
                    && self.driver.state().nodes.get(&op.node).is_some_and(|n| {
                        n.attempt == before.attempt && n.retry.ambiguous.is_none()
                    });
            if forgot {
                self.more_refusals_to_fold = false;
                return Err(self.violation(breach(
                    GuaranteeId::AdoptBeforeDestroy,
                    format!(
                        "{} forgot the ambiguous {:?} when the host refused {} {}: the provider never saw the refused operation",
                        op.node,
                        before.retry.ambiguous,
                        op.kind(),
                        op.id
                    ),
                )));
            }
            let checked = self.check_fold(&op.node, &before, &FoldCause::Result(&result));
            self.more_refusals_to_fold = false;
            checked?;
        }
        Ok(())
    }

    /// G30 (hold form) after a drive: the driver's word on each breaker
    /// agrees with the kit's (whose model took the drive's starts in
    /// [`Self::check_drive`]).
    pub(super) fn check_breakers(&mut self) -> Result<(), Violation> {
        let groups: Vec<GroupId> = self.limits.breakers.keys().cloned().collect();
        let mut reports_breakers = false;
        for group in groups {
            let said = self.driver.breaker_open(&group, self.now);
            reports_breakers |= said.is_some();
            self.check(self.breaker_watch.agrees(&group, said, &self.limits))?;
            let status = self.driver.breaker_status(&group);
            self.check(self.breaker_watch.status_agrees(&group, status))?;
        }
        if reports_breakers && self.durable.crashes == 0 {
            // The driver's own counts of openings and probes (what a host
            // shows an operator) against the model's, over the one life.
            let counters = self.driver.limit_counters();
            let said = (counters.breakers_opened, counters.breaker_probes);
            let seen = (self.breaker_watch.opened, self.breaker_watch.probes);
            self.check(if said == seen {
                Ok(())
            } else {
                Err(breach(
                    GuaranteeId::BreakerLiveness,
                    format!(
                        "the driver counts {} breaker openings and {} probes, but the kit's model saw {} and {}",
                        said.0, said.1, seen.0, seen.1
                    ),
                ))
            })?;
        }
        Ok(())
    }

    /// G19: a forced pass over the settled machine dispatches nothing,
    /// changes nothing and keeps `requeue_at`.
    pub(in crate::harness) fn probe_quiescence(&mut self) -> Result<(), Violation> {
        if self.edges_reached || self.driver.is_queued() {
            return Ok(());
        }
        let before = self.driver.state().clone();
        let requeue_at = self.driver.requeue_at();
        self.driver.trigger();
        self.ask_full();
        self.durable.last_commit = (false, 0, 0);
        self.drive()?;
        let state = self.driver.state();
        if *state != before {
            let changed: Vec<String> = oracle::slot_changes(&before, state)
                .into_iter()
                .filter(|c| c.before != c.after)
                .map(|c| match (c.before, c.after) {
                    (Some(b), Some(a)) => format!(
                        "{} -> {}",
                        oracle::describe_node(c.id, b),
                        oracle::describe_node(c.id, a)
                    ),
                    (None, Some(a)) => format!("new {}", oracle::describe_node(c.id, a)),
                    (Some(b), None) => format!("removed {}", oracle::describe_node(c.id, b)),
                    (None, None) => String::new(),
                })
                .collect();
            return Err(self.violation(breach(
                GuaranteeId::Quiescence,
                format!(
                    "a forced pass over a settled machine changed it: {}",
                    changed.join("; ")
                ),
            )));
        }
        // Nothing changed, so nothing is written: a host journals every
        // wake's change set, and an idle pass must cost no write.
        let written = self.durable.last_commit;
        if written != (false, 0, 0) {
            return Err(self.violation(breach(
                GuaranteeId::Quiescence,
                format!(
                    "a forced pass over a settled machine wrote to the journal (meta {}, {} nodes, {} removals)",
                    written.0, written.1, written.2
                ),
            )));
        }
        let after = self.driver.requeue_at();
        self.check(if after == requeue_at {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::Quiescence,
                format!(
                    "a forced pass over a settled machine moved requeue_at from {requeue_at:?} to {after:?}"
                ),
            ))
        })
    }
}
