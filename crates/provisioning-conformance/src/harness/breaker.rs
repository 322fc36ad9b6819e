//! The kit's own model of each group's circuit breaker (design §15, G30 hold
//! form), kept from what the kit sees: the folds it delivers and the
//! attempts each drive starts.
//!
//! A group's breaker counts the folds that turn one of its nodes failed,
//! opens when the count reaches the policy's threshold (again after a failed
//! probe), and is closed by a node of the group becoming ready (the kit's
//! policies have no stable window), by a change of the group's shape, or by
//! `resume`. While it is open, a drive starts no new attempt of the group
//! before the cool-down ends, and afterwards one probe until that probe
//! fails or the breaker closes. The model is compared with what the driver
//! says after every fold and every drive, so a driver that stops counting,
//! opens early or late, or lets attempts through during the cool-down is
//! caught where it goes wrong.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::limits::BreakerStatus;
use provisioning::{ClusterState, GroupId, Limits, ManagedNode, NodeStage, Timestamp};

use crate::guarantee::GuaranteeId;
use crate::oracle::{Verdict, breach};

/// One group's breaker as the kit counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Model {
    /// Folds that failed a node of the group since it was last closed.
    failures: u32,
    /// When it (last) opened, in milliseconds; `None` while closed.
    opened_at: Option<u64>,
    /// Whether the probe after the cool-down has started.
    probing: bool,
}

/// The kit's breakers, per group. A group absent from `groups` and from
/// `unknown` has a closed breaker that counted nothing.
#[derive(Debug, Default)]
pub(super) struct BreakerWatch {
    groups: BTreeMap<GroupId, Model>,
    /// Groups whose breaker the kit cannot know (after a controller crash:
    /// the journaled count may include folds the kit saw die with the old
    /// controller) until something closes it.
    unknown: BTreeSet<GroupId>,
    /// The model as of the last commit: what the journal must hold of the
    /// breakers, and what a recovered controller starts from.
    committed: Option<(BTreeMap<GroupId, Model>, BTreeSet<GroupId>)>,
    /// Breakers the model opened (vacuity).
    pub(super) opened: u64,
    /// Probes the model saw start after a cool-down (vacuity).
    pub(super) probes: u64,
}

/// The kit's own reading of "failed" and "ready" from a node's reported facts.
fn failed(node: &ManagedNode) -> bool {
    node.record.stage == NodeStage::Failed
}

fn ready(node: &ManagedNode) -> bool {
    crate::oracle::kit_ready(node)
}

impl BreakerWatch {
    /// Forgets every breaker and marks `groups` unknown.
    pub(super) fn lose_track(&mut self, groups: impl IntoIterator<Item = GroupId>) {
        self.unknown.extend(groups);
        self.unknown.extend(self.groups.keys().cloned());
        self.groups.clear();
    }

    /// The driver's changes were committed: the journal now holds the
    /// breakers as the model has them.
    pub(super) fn committed(&mut self) {
        self.committed = Some((self.groups.clone(), self.unknown.clone()));
    }

    /// G26 (breaker form): a controller recovered from the journal, whose
    /// breakers are `stored`. They must be the model's as of the last
    /// commit (the same failure counts, open or not, probing or not; the
    /// instants are shifted onto the new controller's clock, so they are
    /// taken from the journal), and the model goes on from there. Without a
    /// commit yet, every group is unknown.
    pub(super) fn recovered(
        &mut self,
        stored: &BTreeMap<GroupId, BreakerStatus>,
        recovered: &dyn Fn(&GroupId) -> Option<Option<BreakerStatus>>,
        groups: impl IntoIterator<Item = GroupId>,
    ) -> Verdict {
        let Some((committed, unknown)) = self.committed.clone() else {
            self.lose_track(groups);
            return Ok(());
        };
        self.groups = committed;
        self.unknown = unknown;
        let mut names: BTreeSet<GroupId> = stored.keys().cloned().collect();
        names.extend(self.groups.keys().cloned());
        for group in names {
            if self.unknown.contains(&group) {
                continue;
            }
            let journaled = stored
                .get(&group)
                .map(|b| (b.consecutive_failures, b.opened_at.is_some(), b.probing));
            let expected = self
                .groups
                .get(&group)
                .map(|m| (m.failures, m.opened_at.is_some(), m.probing));
            if journaled != expected {
                return Err(breach(
                    GuaranteeId::CrashSafety,
                    format!(
                        "the journal holds group {group}'s breaker as {journaled:?} (failures, open, probing), but as of the last commit it was {expected:?}"
                    ),
                ));
            }
            // The recovered instants are on the new clock.
            if let (Some(model), Some(Some(status))) =
                (self.groups.get_mut(&group), recovered(&group))
            {
                model.opened_at = status.opened_at.map(Timestamp::as_millis);
            }
        }
        Ok(())
    }

    /// The group's breaker is closed (a shape change of it, or `resume`).
    pub(super) fn close(&mut self, group: &GroupId) {
        self.groups.remove(group);
        self.unknown.remove(group);
    }

    /// Folds one delivery's effect on `node`'s group.
    pub(super) fn fold(
        &mut self,
        group: &GroupId,
        before: &ManagedNode,
        after: &ManagedNode,
        limits: &Limits,
        now: Timestamp,
    ) {
        if ready(after) && !ready(before) {
            self.close(group);
            return;
        }
        if !failed(after) || failed(before) || self.unknown.contains(group) {
            return;
        }
        let model = self.groups.entry(group.clone()).or_default();
        model.failures = model.failures.saturating_add(1);
        let threshold = limits.breakers.get(group).map(|p| p.failures);
        let trips = threshold.is_some_and(|t| model.failures >= t);
        if trips && (model.opened_at.is_none() || model.probing) {
            model.opened_at = Some(now.as_millis());
            model.probing = false;
            self.opened += 1;
        }
    }

    /// Whether the kit's model lets the driver hold `group`'s new attempts
    /// back: its breaker is open, or the kit cannot know.
    pub(super) fn holds(&self, group: &GroupId) -> bool {
        self.open(group).unwrap_or(true)
    }

    /// The cool-down of `group`'s breaker, in milliseconds, when the kit's
    /// model has it open with its probe out after the cool-down at `now`.
    pub(super) fn probe_out(
        &self,
        group: &GroupId,
        limits: &Limits,
        now: Timestamp,
    ) -> Option<u64> {
        if self.unknown.contains(group) {
            return None;
        }
        let model = self.groups.get(group)?;
        let policy = limits.breakers.get(group)?;
        let cooldown = u64::try_from(policy.cooldown.as_millis()).unwrap_or(u64::MAX);
        let probe_at = model.opened_at?.saturating_add(cooldown);
        (model.probing && now.as_millis() >= probe_at).then_some(cooldown)
    }

    /// Whether the kit's breaker of `group` is open; `None` when unknown.
    fn open(&self, group: &GroupId) -> Option<bool> {
        if self.unknown.contains(group) {
            return None;
        }
        Some(
            self.groups
                .get(group)
                .is_some_and(|m| m.opened_at.is_some()),
        )
    }

    /// G30 (hold form): the driver's bookkeeping of `group`'s breaker
    /// (`status`: `None` for a driver that does not show it) is the kit's:
    /// the same count of consecutive failures, opened at the same instant,
    /// probing or not alike.
    pub(super) fn status_agrees(
        &self,
        group: &GroupId,
        status: Option<Option<BreakerStatus>>,
    ) -> Verdict {
        let Some(status) = status else {
            return Ok(());
        };
        if self.unknown.contains(group) {
            return Ok(());
        }
        let said = status.map(|s| {
            (
                s.consecutive_failures,
                s.opened_at.map(Timestamp::as_millis),
                s.probing,
            )
        });
        let seen = self
            .groups
            .get(group)
            .map(|m| (m.failures, m.opened_at, m.probing));
        if said == seen {
            return Ok(());
        }
        Err(breach(
            GuaranteeId::BreakerLiveness,
            format!(
                "group {group}'s breaker by the driver's books is {said:?} (failures, opened at ms, probing), but the kit's model is {seen:?}"
            ),
        ))
    }

    /// G30 (hold form): the driver's word on `group`'s breaker (`said`,
    /// `None` for a driver without breakers) agrees with the kit's count.
    pub(super) fn agrees(&self, group: &GroupId, said: Option<bool>, limits: &Limits) -> Verdict {
        let (Some(said), Some(open)) = (said, self.open(group)) else {
            return Ok(());
        };
        if said == open {
            return Ok(());
        }
        let failures = self.groups.get(group).map_or(0, |m| m.failures);
        let threshold = limits.breakers.get(group).map(|p| p.failures);
        Err(breach(
            GuaranteeId::BreakerLiveness,
            format!(
                "group {group}'s breaker is {} by the driver's word, but the kit counted {failures} consecutive attempt failure(s) since it was last closed (opens at {}): it should be {}",
                if said { "open" } else { "closed" },
                threshold.map_or_else(|| "no breaker".to_owned(), |t| t.to_string()),
                if open { "open" } else { "closed" },
            ),
        ))
    }

    /// G30 (hold form): the attempts one drive started (`pre` to `post`)
    /// respect each open breaker: none before its cool-down ends, one probe
    /// after it until the breaker opens again or closes.
    pub(super) fn drive(
        &mut self,
        pre: &ClusterState,
        post: &ClusterState,
        limits: &Limits,
        now: Timestamp,
    ) -> Verdict {
        let mut started: BTreeMap<&GroupId, Vec<String>> = BTreeMap::new();
        for (id, node) in &post.nodes {
            if pre
                .nodes
                .get(id)
                .is_none_or(|old| old.attempt != node.attempt)
            {
                started
                    .entry(id.group())
                    .or_default()
                    .push(format!("{id} ({})", node.attempt));
            }
        }
        for (group, attempts) in started {
            if self.unknown.contains(group) {
                continue;
            }
            let (Some(policy), Some(model)) =
                (limits.breakers.get(group), self.groups.get_mut(group))
            else {
                continue;
            };
            let Some(opened_at) = model.opened_at else {
                continue;
            };
            let probe_at = opened_at
                .saturating_add(u64::try_from(policy.cooldown.as_millis()).unwrap_or(u64::MAX));
            let cooled = now.as_millis() >= probe_at;
            let allowed = usize::from(cooled && !model.probing);
            if attempts.len() > allowed {
                return Err(breach(
                    GuaranteeId::BreakerLiveness,
                    format!(
                        "group {group}'s breaker opened at {opened_at}ms after {} consecutive failures (cool-down until {probe_at}ms{}), yet a pass at {}ms started {} new attempt(s): {}",
                        model.failures,
                        if model.probing {
                            ", its probe already out"
                        } else {
                            ""
                        },
                        now.as_millis(),
                        attempts.len(),
                        attempts.join(", "),
                    ),
                ));
            }
            // Within the allowance: the one probe after the cool-down.
            model.probing = true;
            self.probes += 1;
        }
        Ok(())
    }
}
