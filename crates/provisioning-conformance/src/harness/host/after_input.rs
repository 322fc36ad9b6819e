//! The checks after every settled input: the whole state against the
//! oracle's state forms, the ledger (G08, G28), the driver's and executor's
//! counters (G04), a held breaker's wake (G30) and the node histories (G32).

use std::collections::BTreeSet;

use provisioning::{Intent, LeaseHandle, LogicalNodeId, SessionHandle, Timestamp};

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::Harness;
use crate::oracle::{self, breach};
use crate::substrate::Substrate;

impl<S: Substrate> Harness<S> {
    pub(in crate::harness) fn check_state(&mut self) -> Result<(), Violation> {
        self.check_held_wake()?;
        self.check_rejoins()?;
        let live = self.substrate.live_resources();
        self.check_orphans(&live)?;
        let zombies = if self.durable.crashes > 0 {
            self.zombie_slots()
        } else {
            BTreeSet::new()
        };
        let double = if zombies.is_empty() {
            oracle::g08_no_double_create(&live)
        } else {
            // Resources a dead controller's calls made after the crash are
            // orphans (G28), not double-creates of this controller.
            let mut sample = live.clone();
            let state = self.driver.state();
            let orphan_of_zombie = |key: &crate::substrate::ResourceKey| {
                zombies.contains(&key.0) && !oracle::owned(state, key)
            };
            sample.leases.retain(|key, _| !orphan_of_zombie(key));
            sample.sessions.retain(|key, _| !orphan_of_zombie(key));
            oracle::g08_no_double_create(&sample)
        };
        if let Err(double) = double {
            return Err(self.crash_aware(double.guarantee, double.detail));
        }
        let state = self.driver.state();
        let desired = self.driver.desired();
        let settled = !self.driver.is_queued();
        let lease_owner = |lease: &LeaseHandle| self.substrate.lease_owner(lease);
        let session_owner = |session: &SessionHandle| self.substrate.session_owner(session);
        let mut highest = self.highest_generation;
        if let Err(identity) = oracle::g01_identity_in_state(state)
            .and_then(|()| oracle::g01_attempts_never_come_back(state, &mut self.attempts))
        {
            return Err(self.crash_aware(identity.guarantee, identity.detail));
        }
        let verdict = oracle::g02_pending_belongs_to_current_attempt(state)
            .and_then(|()| {
                oracle::g03_facts_belong_to_current_attempt(state, &lease_owner, &session_owner)
            })
            .and_then(|()| oracle::g06_dead_nodes_hold_nothing(state))
            .and_then(|()| {
                oracle::g14_readiness_coherence(
                    state,
                    desired,
                    settled,
                    &self.limits.max_unavailable,
                )
            })
            .and_then(|()| oracle::g15_session_coherence(state))
            .and_then(|()| oracle::g32_stages_agree_with_facts(state))
            .and_then(|()| oracle::g16_generation_is_monotonic(state, desired, &mut highest))
            .and_then(|()| {
                if settled && !self.edges_reached {
                    oracle::g17_undesired_slots_are_not_active(state, &self.slots)
                } else {
                    Ok(())
                }
            })
            .and_then(|()| {
                oracle::g19_converged_has_no_requeue(
                    self.driver.is_converged(),
                    self.driver.requeue_at(),
                )
            })
            .and_then(|()| {
                oracle::g29_creates_in_flight_are_counted(
                    state,
                    crate::harness::PROVIDER_KIND,
                    self.driver.creates_in_flight(crate::harness::PROVIDER_KIND),
                )
            })
            .and_then(|()| {
                let limited = !self.limits.max_concurrent_creates.is_empty()
                    || !self.limits.max_unavailable.is_empty()
                    || !self.limits.breakers.is_empty();
                if settled && !self.edges_reached && !limited {
                    oracle::g19_settled_driver_agrees_with_plan(
                        state,
                        desired,
                        self.now,
                        self.driver.requeue_at(),
                    )
                } else {
                    Ok(())
                }
            });
        self.check(verdict)?;
        self.highest_generation = highest;
        self.check_history()?;
        let counters = self.executor.counters();
        let calls = self.durable.control.lock().live_calls;
        if !self.edges_reached
            && let Some(counted) = self.driver.counters()
        {
            let seen = self.driver_counts;
            self.check(oracle::g04_driver_counts_what_it_did(
                &counted,
                [
                    seen.passes,
                    seen.dispatched,
                    seen.refused,
                    seen.folded,
                    seen.rejected,
                    seen.timeouts,
                ],
            ))?;
        }
        self.check(oracle::g04_executor_counts_what_it_did(
            (counters.started, calls),
            (counters.expired, self.executor_watch.expired.len()),
            (counters.waited, self.executor_watch.queued_here),
        ))?;
        self.check(if counters.replayed == self.executor_watch.replayed_here {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::RecordBeforeDispatch,
                format!(
                    "the executor counts {} replayed results, but the kit saw {} submissions answered by a replay",
                    counters.replayed, self.executor_watch.replayed_here
                ),
            ))
        })?;
        let seen = {
            let control = self.durable.control.lock();
            let watch = &self.executor_watch;
            oracle::ExecutorSeen {
                taken: watch.taken_here,
                replayed: watch.replayed_here,
                notified: watch.notified.load(std::sync::atomic::Ordering::Relaxed),
                calls_ended: control.live_calls.saturating_sub(control.live_in_backend()),
                panics: control.live_panics,
                // Once no work is runnable, every operation the executor
                // said it started has had its task run.
                started_never_called: (!self.substrate.has_runnable_work())
                    .then_some(watch.awaiting_call.len() as u64),
                skipped_at_submission: watch.skipped_at_submission,
                skipped_at_expiry: watch.skipped_at_expiry,
                uncalled: watch.uncalled.len() as u64,
            }
        };
        self.check(oracle::g04_executor_accounts_for_its_results(
            &counters, &seen,
        ))?;
        Ok(())
    }

    /// G30 (wake form): while a group's breaker has its probe out, the slots
    /// it holds back (desired, with no node or a destroyed attempt waiting
    /// for its restart) are looked at again within one
    /// cool-down: the driver's next wake is no later. A probe that hangs
    /// must not hold them for good.
    fn check_held_wake(&self) -> Result<(), Violation> {
        if self.edges_reached || self.driver.is_queued() {
            return Ok(());
        }
        let state = self.driver.state();
        for group in self.limits.breakers.keys() {
            let Some(cooldown) = self.breaker_watch.probe_out(group, &self.limits, self.now) else {
                continue;
            };
            let held = (0..self.slots.count(group))
                .map(|index| LogicalNodeId::new(group.clone(), index))
                .find(|id| {
                    // No node, or one whose attempt is gone and whose restart
                    // waits on no timer of its own.
                    let due = |at: Option<Timestamp>| {
                        at.is_none_or(|at| at.as_millis() <= self.now.as_millis())
                    };
                    state.nodes.get(id).is_none_or(|n| {
                        n.record.stage == provisioning::NodeStage::Destroyed
                            && due(n.retry.restart_at)
                            && due(n.retry.next_effect_at)
                    })
                });
            let Some(held) = held else {
                continue;
            };
            let by = self.now.as_millis().saturating_add(cooldown);
            let wake = self.driver.requeue_at();
            if wake.is_none_or(|at| at.as_millis() > by) {
                return Err(self.violation(breach(
                    GuaranteeId::BreakerLiveness,
                    format!(
                        "group {group}'s breaker has its probe out and holds {held} back, but the driver's next wake is {wake:?}, not within the cool-down of {cooldown}ms (by {by}ms)"
                    ),
                )));
            }
        }
        Ok(())
    }

    /// G32 (history form): the driver's node histories agree with its nodes.
    pub(super) fn check_history(&mut self) -> Result<(), Violation> {
        let watch = &self.history_watch;
        if watch.keeps_none {
            let state = self.driver.state();
            let kept = state
                .nodes
                .keys()
                .chain(watch.seen.iter())
                .find(|id| self.driver.history(id).is_some());
            return self.check(match kept {
                None => Ok(()),
                Some(id) => Err(breach(
                    GuaranteeId::StageCoherence,
                    format!("{id} has a history, but the driver was told to keep none"),
                )),
            });
        }
        if watch.depth == 0 {
            return Ok(());
        }
        let state = self.driver.state();
        let removed: BTreeSet<LogicalNodeId> = watch
            .seen
            .iter()
            .filter(|id| !state.nodes.contains_key(*id))
            .cloned()
            .collect();
        let driver = &self.driver;
        let verdict = oracle::g32_history_agrees_with_nodes(
            state,
            |id| driver.history(id),
            &watch.at_start,
            &removed,
            watch.depth,
            self.now,
        );
        self.check(verdict)?;
        // G32 (teardown form): a teardown's entry says why it began, judged
        // when the kit first sees it (against the shape that began it).
        for (id, node) in &state.nodes {
            if node.intent != Intent::Deleting
                || self.history_watch.teardowns_judged.contains(&node.attempt)
            {
                continue;
            }
            let Some(history) = driver.history(id) else {
                continue;
            };
            // The entry where the teardown began: deleting, after one that
            // was not (a recovered node's teardown began before the crash,
            // and histories are not journaled).
            let entries: Vec<&provisioning::Transition> = history.entries().collect();
            let Some(entry) = entries.windows(2).find_map(|pair| {
                let (before, entry) = (pair[0], pair[1]);
                (!before.deleting
                    && entry.deleting
                    && entry.attempt == node.attempt
                    && entry.stage != provisioning::NodeStage::Failed)
                    .then_some(entry)
            }) else {
                continue;
            };
            self.history_watch.teardowns_judged.insert(node.attempt);
            let desired = self.slots.template(id);
            self.check(oracle::g32_teardown_names_its_cause(
                id,
                entry,
                desired.map(|t| t == node.spec.template()),
            ))?;
        }
        self.history_watch.seen = self.driver.state().nodes.keys().cloned().collect();
        Ok(())
    }
}
