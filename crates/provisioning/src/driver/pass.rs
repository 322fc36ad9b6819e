//! Running a pass: [`ClusterDriver::begin_pass`] asks the decider about the
//! nodes that need it (or every slot, for a full pass) and
//! [`ClusterDriver::finish_pass`] applies the answers in slot order — each
//! through the limits' gate, then as a transition or a dispatch — and merges
//! the nodes it inserted. [`ClusterDriver::drive_until_blocked`] runs passes
//! until none is queued.

use super::error::DriverError;
use super::gate::PassBudget;
use super::report::{DriveReport, PassPlan, PassReport};
use super::sink::OperationSink;
use super::{ClusterDriver, MAX_PASSES_PER_DRIVE};
use crate::decide::{
    NodeAction, NodeDecision, Rule, Slot, SlotDesire, Wake, decide_slot, reconcile_node,
    walk_slots_skipping,
};
use crate::effect::EffectKind;
use crate::state::ManagedNode;
use crate::steady::SteadySlots;
use crate::time::Timestamp;

/// Inserting at least this many nodes in one pass (and at least an eighth of
/// the map) rebuilds the node map in one merge instead of node by node.
const BULK_MERGE_MIN: usize = 64;

impl ClusterDriver {
    /// Begins a pass at `now`: asks the decider about every node that needs
    /// it and returns the decisions. Until [`ClusterDriver::finish_pass`],
    /// facts are not folded and further passes are refused; triggers are
    /// remembered and cause exactly one more pass.
    ///
    /// # Errors
    /// [`DriverError::PassInProgress`] when a pass is already open.
    pub fn begin_pass(&mut self, now: Timestamp) -> Result<PassPlan, DriverError> {
        self.schedule.ensure_idle()?;
        let full = std::mem::take(&mut self.schedule.full);
        let dirty = self.schedule.take_dirty();
        let mut decisions = Vec::new();
        let mut evaluated = 0;
        let steady = &mut self.steady;
        let bound = SteadySlots::bound(self.state.nodes.len());
        if full {
            // Every slot; waits without a timer are left out because a full
            // pass rebuilds every timer anyway. A group whose every desired
            // slot is known steady is counted, not walked.
            let covered: Vec<bool> = self
                .desired
                .groups()
                .iter()
                .map(|(group, wanted)| {
                    let covered = steady.covers(group, wanted.count());
                    if covered {
                        evaluated += wanted.count() as usize;
                    }
                    covered
                })
                .collect();
            walk_slots_skipping(&self.state, &self.desired, &covered, |slot| {
                if let Slot::Managed {
                    id,
                    desire: SlotDesire::Template { .. },
                    ..
                } = slot
                    && steady.contains(id)
                {
                    // Decided steady since it and the shape last changed:
                    // steady again, without a read of the node.
                    evaluated += 1;
                    return;
                }
                let (node, desire) = slot.parts();
                let Some(decision) = decide_slot(node, desire, now) else {
                    return;
                };
                if let Slot::Managed {
                    id,
                    node,
                    desire: SlotDesire::Template { .. },
                } = slot
                    && is_steady(&decision, node)
                {
                    steady.insert(id, bound);
                }
                evaluated += 1;
                let timer = matches!(decision.wake, Some(Wake::Timer(_)));
                if decision.action != NodeAction::None || timer {
                    decisions.push((slot.id(), decision));
                }
            });
        } else {
            let mut selected = dirty;
            self.schedule.take_due_timers(now, &mut selected);
            // In slot order, each once. Touches mostly come in slot order
            // (a batch's results in dispatch order), which the sort finds.
            selected.sort_unstable();
            selected.dedup();
            let run_id = self.desired.run_id();
            // Nearly every node a bring-up step selects has a decision:
            // sized once instead of grown (and copied) a dozen times.
            decisions.reserve_exact(selected.len());
            for id in selected {
                let node = self.state.node(&id);
                // The slot's desired run and template, without building its
                // spec (three shared handles cloned and dropped per node of
                // a bring-up's every step): the id is the node's key, so only
                // run and template are left to compare — unless the node's
                // spec names another slot, which the built spec's comparison
                // reports as drift.
                let decision = if node.is_some_and(|n| n.spec.id() != &id) {
                    reconcile_node(node, self.desired.spec(&id).as_ref(), now)
                } else {
                    let desire = match self.desired.groups().get(id.group()) {
                        Some(group) if id.index() < group.count() => SlotDesire::Template {
                            run_id,
                            template: group.template(),
                        },
                        _ => SlotDesire::Undesired,
                    };
                    let decision = decide_slot(node, desire, now);
                    if let (Some(decision), Some(node), SlotDesire::Template { .. }) =
                        (decision, node, desire)
                        && is_steady(&decision, node)
                    {
                        steady.insert(&id, bound);
                    }
                    decision
                };
                if let Some(decision) = decision {
                    evaluated += 1;
                    decisions.push((id, decision));
                }
            }
        }
        self.schedule.open_pass();
        Ok(PassPlan {
            now,
            full,
            evaluated,
            decisions,
        })
    }

    /// Applies a begun pass: driver transitions, then each dispatch recorded
    /// pending before it is submitted. A refused submission is folded as a
    /// definite failure of the operation.
    ///
    /// # Errors
    /// [`DriverError::NoPassOpen`]; [`DriverError::NodeErrors`] when some nodes
    /// could not take their step (counter exhaustion, clock saturation) — all
    /// other steps were applied, those nodes were left unchanged and are looked
    /// at again one initial backoff later.
    pub fn finish_pass(
        &mut self,
        plan: PassPlan,
        sink: &mut dyn OperationSink,
    ) -> Result<PassReport, DriverError> {
        if !self.schedule.is_open() {
            return Err(DriverError::NoPassOpen);
        }
        let now = plan.now;
        let mut report = PassReport {
            evaluated: plan.evaluated,
            ..PassReport::default()
        };
        if plan.full {
            self.schedule.clear_timers();
            // Every held node is looked at again by this pass.
            self.limit_state.held_by_cap.clear();
            self.limit_state.held_by_budget.clear();
            self.limit_state.held_by_breaker.clear();
        }
        let mut errors = Vec::new();
        let mut budget = PassBudget::default();
        if !self.limits.max_concurrent_creates.is_empty() {
            for (id, decision) in &plan.decisions {
                if decision.action == NodeAction::Dispatch(EffectKind::CreateLease)
                    && decision.rule != Rule::CreateLease
                    && let Some(node) = self.state.nodes.get(id)
                {
                    let provider = &node.spec.template().provider;
                    if self.limits.max_concurrent_creates.contains_key(provider) {
                        *budget.cleanup_creates.entry(provider.clone()).or_default() += 1;
                    }
                }
            }
        }
        // Grown once, not doubled (and copied) through a bring-up's
        // hundred thousand inserts.
        let inserts = plan
            .decisions
            .iter()
            .filter(|(_, d)| d.action == NodeAction::Insert)
            .count();
        self.inserted.reserve_exact(inserts);
        for (id, mut decision) in plan.decisions {
            if decision.action != NodeAction::None {
                if let Some(wake) = self.gate(&id, &decision, now, &mut budget) {
                    decision.action = NodeAction::None;
                    decision.wake = wake.map(Wake::Timer);
                }
            }
            let timer = match decision.wake {
                Some(Wake::Timer(at)) => Some(at),
                _ => None,
            };
            self.schedule.set_timer(&id, timer);
            let applied = match decision.action {
                NodeAction::None => Ok(()),
                NodeAction::Dispatch(kind) => self.dispatch(&id, kind, now, sink, &mut report),
                action => {
                    report.transitions += 1;
                    self.transition(&id, action, now, sink)
                }
            };
            if let Err(error) = applied {
                // Look at the node again later rather than spinning on it now.
                // At the end of the clock there is no later: a timer at `now`
                // would be due at once, forever, so none is set.
                let retry_at =
                    Some(now.saturating_add(self.policy.backoff_initial)).filter(|at| *at > now);
                self.schedule.set_timer(&id, retry_at);
                errors.push((id, error));
            }
        }
        self.merge_inserted();
        let generation = self.desired.generation();
        if self.state.observed_generation < Some(generation) {
            self.state.observed_generation = Some(generation);
            self.meta_changed();
        }
        self.schedule.close_pass();
        self.counters.passes += 1;
        self.counters.evaluations += report.evaluated as u64;
        self.counters.dispatched += report.dispatched as u64;
        self.counters.refused += report.refused as u64;
        if errors.is_empty() {
            Ok(report)
        } else {
            Err(DriverError::NodeErrors(errors))
        }
    }

    /// Adds the nodes inserted by this pass to the node map. Many at once
    /// (a bring-up) are merged in one go into a map built afresh: its tree
    /// nodes are fully packed (inserting them one by one in slot order would
    /// leave them half empty) and allocated one after the other, in key
    /// order, as the boxed nodes were, so a full pass reads both as streams.
    fn merge_inserted(&mut self) {
        let inserted = std::mem::take(&mut self.inserted);
        if inserted.len() >= BULK_MERGE_MIN.max(self.state.nodes.len() / 8) {
            // Both runs are sorted and their keys disjoint (a slot is
            // inserted only while it has no node); the build sorts and
            // deduplicates anyway, keeping the inserted node of a key.
            let old = std::mem::take(&mut self.state.nodes);
            self.state.nodes = if old.is_empty() {
                // Collected in place from the vector (no copy of it first).
                inserted.into_iter().collect()
            } else {
                old.into_iter().chain(inserted).collect()
            };
        } else {
            self.state.nodes.extend(inserted);
        }
    }

    /// Runs one pass if one is queued.
    ///
    /// # Errors
    /// The errors of [`ClusterDriver::begin_pass`] and
    /// [`ClusterDriver::finish_pass`].
    pub fn drive_next(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<Option<PassReport>, DriverError> {
        self.schedule.ensure_idle()?;
        if !self.is_queued() {
            return Ok(None);
        }
        self.schedule.dequeue();
        let plan = self.begin_pass(now)?;
        self.finish_pass(plan, sink).map(Some)
    }

    /// Queues a pass if a deadline is due, then runs passes until none is
    /// queued, at most [`MAX_PASSES_PER_DRIVE`].
    ///
    /// # Errors
    /// The first error of a pass; the passes before it were applied.
    pub fn drive_until_blocked(
        &mut self,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<DriveReport, DriverError> {
        self.trigger_if_due(now);
        let mut report = DriveReport::default();
        while report.passes < MAX_PASSES_PER_DRIVE {
            match self.drive_next(now, sink)? {
                Some(pass) => {
                    report.passes += 1;
                    report.dispatched += pass.dispatched;
                    report.refused += pass.refused;
                }
                None => return Ok(report),
            }
        }
        report.budget_exhausted = self.is_queued();
        Ok(report)
    }
}

/// Whether `decision` for `node` holds at every instant until the node or
/// its slot's desired spec changes: the ready steady state with no stored
/// backoff (a backoff in the past would still be compared with the clock).
fn is_steady(decision: &NodeDecision, node: &ManagedNode) -> bool {
    decision.rule == Rule::Steady && decision.wake.is_none() && node.retry.next_effect_at.is_none()
}
