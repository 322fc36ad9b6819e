//! The operator limits as the driver applies them: launch caps per
//! provider, rollout budgets and breakers per group.
//!
//! The decider knows nothing of limits. While a pass is applied, each
//! decision goes through the gate in slot order and may be held back (the
//! node waits) instead of dispatched. A held node is woken by the event that
//! can free it — a create's answer, a node becoming ready, a breaker's
//! change or cool-down — never by a scan; the folds report those events
//! here. What the limits keep between passes is a `LimitState`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use super::ClusterDriver;
use crate::decide::{NodeAction, NodeDecision, Rule};
use crate::effect::EffectKind;
use crate::id::{GroupId, LogicalNodeId};
use crate::limits::{BreakerStatus, LimitCounters, Limits};
use crate::time::Timestamp;

/// Pass-local bookkeeping of the limits: each group's unavailable count,
/// computed the first time the pass needs it, and the cleanup re-issues of
/// creates this pass has still to dispatch, per provider.
#[derive(Default)]
pub(super) struct PassBudget {
    unavailable: BTreeMap<GroupId, u32>,
    /// Cleanup creates are never held back, but they take launch slots: a
    /// launch earlier in slot order must leave room for them, or the pass
    /// would end with more creates in flight than the cap allows.
    pub(super) cleanup_creates: BTreeMap<String, u32>,
}

impl ClusterDriver {
    /// A create of `provider` is no longer pending: its launch slot goes to
    /// the first node that waits for one.
    pub(super) fn create_finished(&mut self, provider: &str) {
        let limits = &mut self.limit_state;
        if let Some(n) = limits.creates_in_flight.get_mut(provider) {
            *n = n.saturating_sub(1);
        }
        let next = limits
            .held_by_cap
            .get_mut(provider)
            .and_then(BTreeSet::pop_first);
        if let Some(id) = next {
            self.touch(&id);
        }
    }

    /// What a fold means for the limits: a failed attempt counts towards its
    /// group's breaker; a node that became ready closes it and frees rollout
    /// budget for the drifted nodes that wait.
    ///
    /// `before` and `after` are whether the node was failed and ready
    /// before and after the fold (passed in, so the common fold that changes
    /// neither looks the node up only once).
    pub(super) fn limit_events(
        &mut self,
        id: &LogicalNodeId,
        (was_failed, was_ready): (bool, bool),
        (is_failed, is_ready): (bool, bool),
        now: Timestamp,
    ) {
        let failed = !was_failed && is_failed;
        let became_ready = !was_ready && is_ready;
        if !failed && !became_ready {
            return;
        }
        let Some(after) = self.state.nodes.get(id) else {
            return;
        };
        let last_error = after.retry.last_error.clone();
        let group = id.group();
        // The breaker changes (it counts a failure, opens again after a failed
        // probe, or closes): the nodes it holds back wake by it, so they are
        // looked at again, or a later pass would move their timers (G19).
        let held = self.limit_state.held_by_breaker.remove(group);
        for held in held.into_iter().flatten() {
            self.touch(&held);
        }
        if failed {
            let policy = self.limits.breakers.get(group).copied();
            let breaker = self.limit_state.breakers.entry(group.clone()).or_default();
            if policy.is_some_and(|p| breaker.recovered(&p, now)) {
                // A node stayed ready for the stable window since the last
                // failure: the group was healthy, this failure starts anew.
                *breaker = BreakerStatus::default();
            }
            breaker.recovered_at = None;
            breaker.consecutive_failures = breaker.consecutive_failures.saturating_add(1);
            breaker.last_error = last_error;
            let trips = policy.is_some_and(|p| breaker.consecutive_failures >= p.failures);
            if trips && (!breaker.is_open() || breaker.probing) {
                breaker.opened_at = Some(now);
                breaker.probing = false;
                self.limit_state.counters.breakers_opened += 1;
            }
        }
        if became_ready {
            let stable_after = self
                .limits
                .breakers
                .get(group)
                .map_or(Duration::ZERO, |p| p.stable_after);
            if stable_after.is_zero() {
                self.limit_state.breakers.remove(group);
            } else if let Some(breaker) = self.limit_state.breakers.get_mut(group) {
                breaker.recovered_at.get_or_insert(now);
            }
            let allowed = self.budget_allowance(group);
            for _ in 0..allowed {
                let next = self
                    .limit_state
                    .held_by_budget
                    .get_mut(group)
                    .and_then(BTreeSet::pop_first);
                match next {
                    Some(held) => self.touch(&held),
                    None => break,
                }
            }
        }
    }

    fn budget_allowance(&self, group: &GroupId) -> u32 {
        let desired = self.desired.groups().get(group).map_or(0, |g| g.count());
        self.limits
            .max_unavailable
            .get(group)
            .map_or(0, |budget| budget.of(desired))
    }

    /// Desired slots of `group` without a ready node (of any spec: a node
    /// that still runs the old spec serves until it is replaced).
    fn unavailable(&self, group: &GroupId) -> u32 {
        let Some(desired) = self.desired.groups().get(group) else {
            return 0;
        };
        let range = LogicalNodeId::new(group.clone(), 0)
            ..=LogicalNodeId::new(group.clone(), desired.count().saturating_sub(1));
        let ready = if desired.count() == 0 {
            0
        } else {
            self.state
                .nodes
                .range(range)
                .filter(|(_, n)| n.is_ready())
                .count()
        };
        desired
            .count()
            .saturating_sub(u32::try_from(ready).unwrap_or(u32::MAX))
    }

    /// Applies the limits to one decision of a pass: `None` lets it through,
    /// `Some(wake)` holds the node back (it waits, until `wake` if given).
    pub(super) fn gate(
        &mut self,
        id: &LogicalNodeId,
        decision: &NodeDecision,
        now: Timestamp,
        budget: &mut PassBudget,
    ) -> Option<Option<Timestamp>> {
        let group = id.group();
        match decision.action {
            // The re-issue of an ambiguous create on a node being torn down
            // is cleanup, never held back; it leaves the pass's reservation.
            NodeAction::Dispatch(EffectKind::CreateLease)
                if decision.rule != Rule::CreateLease && !budget.cleanup_creates.is_empty() =>
            {
                let node = self.state.nodes.get(id)?;
                let provider = &node.spec.template().provider;
                if let Some(n) = budget.cleanup_creates.get_mut(provider) {
                    *n = n.saturating_sub(1);
                }
                None
            }
            // Only a first create of an active node waits for a launch slot,
            // and only while the creates in flight, with the cleanup creates
            // the pass is still to dispatch, fill the cap.
            NodeAction::Dispatch(EffectKind::CreateLease)
                if decision.rule == Rule::CreateLease
                    && !self.limits.max_concurrent_creates.is_empty() =>
            {
                let node = self.state.nodes.get(id)?;
                let provider = &node.spec.template().provider;
                let cap = *self.limits.max_concurrent_creates.get(provider)?;
                let in_flight = self
                    .limit_state
                    .creates_in_flight
                    .get(provider)
                    .copied()
                    .unwrap_or(0)
                    .saturating_add(budget.cleanup_creates.get(provider).copied().unwrap_or(0));
                if in_flight < cap {
                    return None;
                }
                self.limit_state
                    .held_by_cap
                    .entry(provider.clone())
                    .or_default()
                    .insert(id.clone());
                self.limit_state.counters.held_by_cap += 1;
                Some(None)
            }
            NodeAction::BeginDelete if self.limits.max_unavailable.contains_key(group) => {
                let node = self.state.nodes.get(id)?;
                let desired = self.desired.groups().get(group)?;
                let drifted_only = node.is_ready()
                    && id.index() < desired.count()
                    && !Arc::ptr_eq(node.spec.shared_template(), desired.template())
                    && *node.spec.template() != **desired.template();
                if !drifted_only {
                    return None;
                }
                let allowed = self.budget_allowance(group);
                let unavailable = match budget.unavailable.get(group) {
                    Some(n) => *n,
                    None => self.unavailable(group),
                };
                if unavailable < allowed {
                    budget.unavailable.insert(group.clone(), unavailable + 1);
                    return None;
                }
                budget.unavailable.insert(group.clone(), unavailable);
                self.limit_state
                    .held_by_budget
                    .entry(group.clone())
                    .or_default()
                    .insert(id.clone());
                self.limit_state.counters.held_by_budget += 1;
                Some(None)
            }
            NodeAction::Insert | NodeAction::Restart => {
                let policy = *self.limits.breakers.get(group)?;
                let breaker = self.limit_state.breakers.get_mut(group)?;
                if breaker.recovered(&policy, now) {
                    // A node stayed ready for the stable window: healthy.
                    self.limit_state.breakers.remove(group);
                    return None;
                }
                let opened_at = breaker.opened_at?;
                let probe_at = opened_at.saturating_add(policy.cooldown);
                let healthy_at = breaker
                    .recovered_at
                    .map(|at| at.saturating_add(policy.stable_after));
                if now.reached(probe_at) && !breaker.probing {
                    breaker.probing = true;
                    self.limit_state.counters.breaker_probes += 1;
                    return None;
                }
                self.limit_state.counters.held_by_breaker += 1;
                self.limit_state
                    .held_by_breaker
                    .entry(group.clone())
                    .or_default()
                    .insert(id.clone());
                let wake = if now.reached(probe_at) {
                    next_period_after(probe_at, policy.cooldown, now)
                } else {
                    probe_at
                };
                let wake = healthy_at.map_or(wake, |at| at.min(wake));
                Some(Some(wake).filter(|at| *at > now))
            }
            _ => None,
        }
    }

    /// Sets the limits the driver applies from the next pass on (a full
    /// pass is queued, so nodes they held back are looked at again).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        self.trigger();
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The breaker of `group`, when it counted a failure since it was last
    /// closed.
    pub fn breaker(&self, group: &GroupId) -> Option<&BreakerStatus> {
        self.limit_state.breakers.get(group)
    }

    /// The breaker of `group` when it holds new attempts back at `now`: open,
    /// and no node of the group has stayed ready for its stable window since
    /// (such a breaker is closed by the next attempt that looks at it).
    pub fn open_breaker(&self, group: &GroupId, now: Timestamp) -> Option<&BreakerStatus> {
        let breaker = self.limit_state.breakers.get(group)?;
        let recovered = self
            .limits
            .breakers
            .get(group)
            .is_some_and(|policy| breaker.recovered(policy, now));
        (breaker.is_open() && !recovered).then_some(breaker)
    }

    /// Closes the breaker of `group` at once (`provision resume GROUP`).
    /// Returns whether it was open.
    pub fn reset_breaker(&mut self, group: &GroupId) -> bool {
        let was_open = self
            .limit_state
            .breakers
            .remove(group)
            .is_some_and(|b| b.is_open());
        self.trigger();
        was_open
    }

    /// What the limits held back so far.
    pub fn limit_counters(&self) -> &LimitCounters {
        &self.limit_state.counters
    }

    /// `CreateLease` operations pending for `provider`.
    pub fn creates_in_flight(&self, provider: &str) -> u32 {
        self.limit_state
            .creates_in_flight
            .get(provider)
            .copied()
            .unwrap_or(0)
    }
}

/// The first instant after `now` on the grid of `period`s that starts at
/// `start` (`now` itself for a zero period). A node held while a breaker's
/// probe is out looks again once per cool-down; the grid is fixed by the
/// probe's time, so a pass at any instant of one period sets the same timer
/// and a forced pass over a settled driver moves no timer.
fn next_period_after(start: Timestamp, period: Duration, now: Timestamp) -> Timestamp {
    let period_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
    if period_ms == 0 {
        return now;
    }
    let elapsed_ms = now.as_millis().saturating_sub(start.as_millis());
    let periods = elapsed_ms / period_ms + 1;
    Timestamp::from_millis(
        start
            .as_millis()
            .saturating_add(periods.saturating_mul(period_ms)),
    )
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_node_wakes_on_the_probes_grid_whatever_instant_the_pass_ran_at() {
        let start = Timestamp::from_millis(1_000);
        let period = Duration::from_millis(500);
        let at = |ms| next_period_after(start, period, Timestamp::from_millis(ms));
        assert_eq!(at(1_000), Timestamp::from_millis(1_500));
        assert_eq!(at(1_001), Timestamp::from_millis(1_500));
        assert_eq!(at(1_499), Timestamp::from_millis(1_500));
        assert_eq!(at(1_500), Timestamp::from_millis(2_000));
        assert_eq!(
            next_period_after(start, Duration::ZERO, Timestamp::from_millis(1_234)),
            Timestamp::from_millis(1_234),
            "no period, no later instant"
        );
    }
}
