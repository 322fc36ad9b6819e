//! G19, the driver against the pure decider: a converged cluster has
//! nothing to requeue, a settled driver agrees with a full pass of the
//! decider (and with the reference decider, slot by slot), and every pass
//! did what it planned — holding back only what a limit must (G29, G30).
//!
//! Checked after every settled input (state and plan forms) and at every
//! split pass (pass plan form).

use std::collections::BTreeMap;

use provisioning::shape::DesiredState;
use provisioning::{ClusterState, EffectKind, GroupId, Intent, LogicalNodeId, Timestamp};

use super::model::{DesiredSlots, creates_pending, kit_ready};
use super::observed::PassBefore;
use super::verdict::{Breach, Verdict, breach, ensure};
use crate::guarantee::GuaranteeId;

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
