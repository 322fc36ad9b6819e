//! Operator safety limits (design §15, G29, G30): launch caps, rollout budgets
//! and circuit breakers, applied by the driver to the decider's answers.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use provisioning::effect::Operation;
use provisioning::{
    BootstrapEvent, BreakerPolicy, ClusterDriver, DurableState, EffectError, EffectKind, GroupId,
    Limits, MaxUnavailable, RetryPolicy, RunId, Timestamp,
};

fn names(ops: &[Operation]) -> Vec<String> {
    ops.iter()
        .map(|op| format!("{} {}", op.kind(), op.node))
        .collect()
}

#[test]
fn creates_beyond_a_providers_cap_wait_in_slot_order() {
    let mut d = driver();
    d.set_limits(Limits {
        max_concurrent_creates: BTreeMap::from([("fake".to_owned(), 3)]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 5, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    let first = drive(&mut d, &mut sink, now);
    assert_eq!(
        names(&first),
        ["create-lease g-0", "create-lease g-1", "create-lease g-2"]
    );
    assert_eq!(d.creates_in_flight("fake"), 3);
    assert!(
        drive(&mut d, &mut sink, now).is_empty(),
        "nothing more while the cap is reached"
    );

    d.apply_executor_result(&success(&first[1]), now).unwrap();
    let next = drive(&mut d, &mut sink, now);
    let creates: Vec<_> = next
        .iter()
        .filter(|o| o.kind() == EffectKind::CreateLease)
        .collect();
    assert_eq!(creates.len(), 1);
    assert_eq!(
        creates[0].node.to_string(),
        "g-3",
        "the lowest waiting slot goes first"
    );
    assert!(d.limit_counters().held_by_cap > 0);

    // With everything answered (the operations still out included) the
    // group converges.
    sink.submitted.extend([first[0].clone(), first[2].clone()]);
    sink.submitted.extend(next);
    converge(&mut d, &mut sink, now);
    assert!(d.is_converged());
    assert_eq!(d.creates_in_flight("fake"), 0);
}

#[test]
fn a_launch_cap_never_holds_back_cleanup() {
    let mut d = driver();
    d.set_limits(Limits {
        max_concurrent_creates: BTreeMap::from([("fake".to_owned(), 1)]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 2, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    let create = drive(&mut d, &mut sink, now).remove(0);
    d.apply_executor_result(&reply(&create, Err(EffectError::ambiguous("lost"))), now)
        .unwrap();
    // g-0's ambiguous create is remembered; the shape empties while g-1's
    // create is still pending... g-1 took the slot after g-0's answer.
    let second = drive(&mut d, &mut sink, now);
    assert_eq!(names(&second), ["create-lease g-1"]);
    d.update_desired(shape(2, vec![])).unwrap();
    // Teardown re-issues g-0's ambiguous create (adoption before destroy)
    // although the cap is taken by g-1's create.
    let later = at(60_000);
    let teardown = drive(&mut d, &mut sink, later);
    assert_eq!(names(&teardown), ["create-lease g-0"]);
}

#[test]
fn a_launch_leaves_room_for_the_cleanup_creates_of_its_pass() {
    // Found by `conformance explore 2 3 cap=1`: a launch early in slot order
    // took the last slot, then a cleanup re-issue later in the same pass (never
    // held back) went out too, and the pass ended over the cap.
    let mut d = driver();
    d.set_limits(Limits {
        max_concurrent_creates: BTreeMap::from([("fake".to_owned(), 2)]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 2, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    let creates = drive(&mut d, &mut sink, now);
    assert_eq!(names(&creates), ["create-lease g-0", "create-lease g-1"]);
    for op in &creates {
        d.apply_executor_result(&reply(op, Err(EffectError::ambiguous("lost"))), now)
            .unwrap();
    }
    d.set_limits(Limits {
        max_concurrent_creates: BTreeMap::from([("fake".to_owned(), 1)]),
        ..Limits::default()
    });
    d.update_desired(shape(2, vec![group("g", 1, "img")]))
        .unwrap();
    assert!(
        drive(&mut d, &mut sink, now).is_empty(),
        "both backoffs still run"
    );
    // Both are due in one pass: g-0 would re-launch, g-1 re-issues its
    // ambiguous create as cleanup. Only the cleanup goes out.
    let later = at(60_000);
    let due = drive(&mut d, &mut sink, later);
    assert_eq!(names(&due), ["create-lease g-1"]);
    assert_eq!(d.creates_in_flight("fake"), 1);
    assert!(d.limit_counters().held_by_cap > 0);
    // The cleanup's answer frees the slot for g-0's launch.
    d.apply_executor_result(&success(&due[0]), later).unwrap();
    let next = drive(&mut d, &mut sink, later);
    assert!(
        names(&next).contains(&"create-lease g-0".to_owned()),
        "{:?}",
        names(&next)
    );
    assert!(d.creates_in_flight("fake") <= 1);
}

fn drifted_converge_counting_unready(
    d: &mut ClusterDriver,
    sink: &mut RecordingSink,
    now: Timestamp,
    group_size: usize,
) -> usize {
    let mut worst = 0;
    for _ in 0..256 {
        d.drive_until_blocked(now, sink).unwrap();
        let unready = group_size - d.state().nodes.values().filter(|n| n.is_ready()).count();
        worst = worst.max(unready);
        let ops = sink.take();
        if ops.is_empty() {
            break;
        }
        for op in ops {
            d.apply_executor_result(&success(&op), now).unwrap();
            let event = match op.kind() {
                EffectKind::StartBootstrap => BootstrapEvent::Joined,
                EffectKind::BootstrapConvergenceObserved => BootstrapEvent::Closed,
                _ => continue,
            };
            d.apply_observation(&bootstrap(&op, event), now).unwrap();
            let unready = group_size - d.state().nodes.values().filter(|n| n.is_ready()).count();
            worst = worst.max(unready);
        }
    }
    worst
}

#[test]
fn a_drift_rollout_takes_at_most_max_unavailable_ready_nodes_down_at_once() {
    let mut d = driver();
    d.set_limits(Limits {
        max_unavailable: BTreeMap::from([(GroupId::new("g"), MaxUnavailable::Count(2))]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 6, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    converge(&mut d, &mut sink, now);
    assert!(d.is_converged());
    let before: Vec<_> = d.state().nodes.values().map(|n| n.attempt).collect();

    d.update_desired(shape(2, vec![group("g", 6, "img:2")]))
        .unwrap();
    let worst = drifted_converge_counting_unready(&mut d, &mut sink, now, 6);
    assert!(d.is_converged(), "the rollout finishes");
    assert_eq!(
        worst, 2,
        "never more than 2 of 6 unready, and the budget is used"
    );
    let after: Vec<_> = d.state().nodes.values().map(|n| n.attempt).collect();
    assert!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "every node replaced"
    );
    assert!(d.limit_counters().held_by_budget > 0);
}

#[test]
fn a_rollout_budget_never_holds_back_a_scale_down() {
    let mut d = driver();
    d.set_limits(Limits {
        max_unavailable: BTreeMap::from([(GroupId::new("g"), MaxUnavailable::Percent(10))]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 5, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let now = at(0);
    converge(&mut d, &mut sink, now);
    // Drift and shrink at once: the two removed slots go at once, and the
    // budget (10 % of 3, at least 1) lets one drifted node go.
    d.update_desired(shape(2, vec![group("g", 3, "img:2")]))
        .unwrap();
    d.drive_until_blocked(now, &mut sink).unwrap();
    let deleting: Vec<String> = d
        .state()
        .nodes
        .iter()
        .filter(|(_, n)| n.intent == provisioning::Intent::Deleting)
        .map(|(id, _)| id.to_string())
        .collect();
    assert_eq!(deleting, ["g-0", "g-3", "g-4"]);
}

fn failing_start(d: &mut ClusterDriver, sink: &mut RecordingSink, now: Timestamp) -> usize {
    // Answers everything; a start fails definitely.
    let mut failures = 0;
    for _ in 0..32 {
        d.drive_until_blocked(now, sink).unwrap();
        let ops = sink.take();
        if ops.is_empty() {
            break;
        }
        for op in ops {
            let outcome = if op.kind() == EffectKind::StartBootstrap {
                failures += 1;
                reply(&op, Err(EffectError::definite("sh: serve: not found")))
            } else {
                success(&op)
            };
            d.apply_executor_result(&outcome, now).unwrap();
        }
    }
    failures
}

#[test]
fn a_breaker_opens_after_consecutive_failures_lets_one_probe_through_and_resume_closes_it() {
    let mut d = driver();
    let g = GroupId::new("g");
    d.set_limits(Limits {
        breakers: BTreeMap::from([(g.clone(), BreakerPolicy::new(3, Duration::from_secs(300)))]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let mut failures = 0;
    let mut now;
    // Restarts come one backoff after each failure; step time past them.
    for step in 0..20 {
        now = at(step * 70_000);
        failures += failing_start(&mut d, &mut sink, now);
        if d.breaker(&g).is_some_and(|b| b.is_open()) {
            break;
        }
    }
    assert_eq!(failures, 3, "the breaker opened on the third failure");
    let breaker = d.breaker(&g).unwrap().clone();
    assert!(breaker.is_open());
    assert!(
        breaker.last_error.as_deref().unwrap().contains("not found"),
        "{breaker:?}"
    );

    // Open: no new attempt before the cool-down, even long after backoffs.
    let opened = breaker.opened_at.unwrap();
    let before = opened.saturating_add(Duration::from_secs(299));
    assert_eq!(failing_start(&mut d, &mut sink, before), 0);
    assert!(d.requeue_at().is_some(), "it wakes for the probe");
    // After it: exactly one probe attempt, whose failure re-opens the breaker.
    let probe_at = opened.saturating_add(Duration::from_secs(300));
    assert_eq!(failing_start(&mut d, &mut sink, probe_at), 1);
    assert_eq!(d.limit_counters().breaker_probes, 1);
    let reopened = d.breaker(&g).unwrap();
    assert!(reopened.is_open());
    assert_eq!(reopened.opened_at, Some(probe_at));

    // resume closes it at once: the next attempt starts without waiting.
    assert!(d.reset_breaker(&g));
    let later = probe_at.saturating_add(Duration::from_secs(120));
    converge(&mut d, &mut sink, later);
    assert!(d.is_converged());
    assert_eq!(d.breaker(&g), None, "success keeps it closed");
}

#[test]
fn a_shape_change_of_the_group_closes_its_breaker() {
    let mut d = driver();
    let g = GroupId::new("g");
    d.set_limits(Limits {
        breakers: BTreeMap::from([(g.clone(), BreakerPolicy::new(1, Duration::from_secs(3600)))]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 1, "bad")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    assert_eq!(failing_start(&mut d, &mut sink, at(0)), 1);
    assert!(d.breaker(&g).unwrap().is_open());
    d.update_desired(shape(2, vec![group("g", 1, "fixed")]))
        .unwrap();
    assert_eq!(d.breaker(&g), None);
    converge(&mut d, &mut sink, at(120_000));
    assert!(d.is_converged());
}

/// Converges, then loses the group's one node at `lost_at` each time it is
/// ready; returns how many losses it took to open the breaker (or `None`).
fn lose_when_ready(
    d: &mut ClusterDriver,
    sink: &mut RecordingSink,
    start: u64,
    ready_for: u64,
) -> Option<u32> {
    let g = GroupId::new("g");
    let mut now = start;
    for loss in 1..=10 {
        converge(d, sink, at(now));
        if !d.is_converged() {
            return None;
        }
        now += ready_for;
        let (id, node) = d.state().nodes.iter().next().unwrap();
        let lost = provisioning::Observation::NodeLost {
            node: id.clone(),
            attempt: node.attempt,
            cause: provisioning::LossCause::AgentGone,
        };
        d.apply_observation(&lost, at(now)).unwrap();
        if d.open_breaker(&g, at(now)).is_some() {
            return Some(loss);
        }
        // The replacement starts after its backoff.
        now += 70_000;
    }
    None
}

#[test]
fn nodes_lost_right_after_they_became_ready_open_the_breaker_of_a_stable_window() {
    let g = GroupId::new("g");
    let policy =
        BreakerPolicy::new(3, Duration::from_secs(300)).with_stable_after(Duration::from_secs(10));
    let mut d = driver();
    d.set_limits(Limits {
        breakers: BTreeMap::from([(g.clone(), policy)]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    // Ready, then gone a second later: a workload that exits at once.
    assert_eq!(lose_when_ready(&mut d, &mut sink, 0, 1_000), Some(3));
    let breaker = d.open_breaker(&g, at(u64::MAX / 4)).unwrap();
    assert!(
        breaker
            .last_error
            .as_deref()
            .unwrap()
            .contains("agent is gone"),
        "{breaker:?}"
    );

    // Without the window, each ready closes the breaker again: it never opens.
    let mut d = driver();
    d.set_limits(Limits {
        breakers: BTreeMap::from([(g.clone(), BreakerPolicy::new(3, Duration::from_secs(300)))]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    assert_eq!(lose_when_ready(&mut d, &mut sink, 0, 1_000), None);
}

#[test]
fn a_node_that_stays_ready_for_the_stable_window_makes_the_group_healthy_again() {
    let g = GroupId::new("g");
    let policy =
        BreakerPolicy::new(3, Duration::from_secs(300)).with_stable_after(Duration::from_secs(10));
    let mut d = driver();
    d.set_limits(Limits {
        breakers: BTreeMap::from([(g.clone(), policy)]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    // Each node stays ready past the window before it is lost: every loss
    // is a first failure, and the breaker never opens.
    assert_eq!(lose_when_ready(&mut d, &mut sink, 0, 11_000), None);
    assert_eq!(d.breaker(&g).unwrap().consecutive_failures, 1);
}

#[test]
fn an_open_breaker_is_journaled_and_stays_open_after_recovery() {
    let g = GroupId::new("g");
    let limits = Limits {
        breakers: BTreeMap::from([(g.clone(), BreakerPolicy::new(2, Duration::from_secs(300)))]),
        ..Limits::default()
    };
    let mut d = tracked(vec![group("g", 1, "img")]);
    d.set_limits(limits.clone());
    let mut sink = RecordingSink::default();
    let mut now = at(0);
    let mut state: Option<DurableState> = None;
    let mut commit = |d: &mut ClusterDriver, now: Timestamp| {
        let changes = d.take_changes(now).to_owned_changes();
        let state = state.get_or_insert_with(|| DurableState {
            meta: changes
                .meta
                .clone()
                .expect("the first change set has the meta"),
            nodes: Vec::new(),
        });
        state.apply(&changes);
        state.clone()
    };
    for step in 0..20 {
        now = at(step * 70_000);
        failing_start(&mut d, &mut sink, now);
        commit(&mut d, now);
        if d.breaker(&g).is_some_and(|b| b.is_open()) {
            break;
        }
    }
    let opened = d.breaker(&g).and_then(|b| b.opened_at).expect("open");
    let stored = commit(&mut d, now);
    assert!(
        stored.meta.breakers.get(&g).is_some_and(|b| b.is_open()),
        "the committed meta carries the open breaker: {:?}",
        stored.meta.breakers
    );
    // Nothing changed since: the next change set does not rewrite the meta.
    assert!(d.take_changes(now).meta().is_none());

    // A new controller, on a clock that started again (now 5 s).
    let restarted = at(5_000);
    let (mut recovered, _) =
        ClusterDriver::recover(&RunId::new(RUN), stored, RetryPolicy::default(), restarted)
            .expect("recovers");
    recovered.set_limits(limits);
    let breaker = recovered.breaker(&g).expect("the breaker survived").clone();
    assert!(breaker.is_open());
    assert_eq!(breaker.consecutive_failures, 2);
    // Its opening moved onto the new clock with every other instant.
    let shifted = breaker.opened_at.expect("open");
    assert_eq!(
        now.as_millis() - opened.as_millis(),
        restarted.as_millis() - shifted.as_millis()
    );
    // Still open: no new attempt before the cool-down.
    let before = shifted.saturating_add(Duration::from_secs(299));
    assert_eq!(failing_start(&mut recovered, &mut sink, before), 0);
    let probe = shifted.saturating_add(Duration::from_secs(300));
    assert_eq!(failing_start(&mut recovered, &mut sink, probe), 1);
}

/// A breaker closed by `resume` changes nothing but the meta: a host that
/// asks whether anything changed (to refresh its status) must hear yes, as
/// the change set it then takes carries the new breakers.
#[test]
fn a_resumed_breaker_counts_as_a_change() {
    let mut d = driver();
    let g = GroupId::new("g");
    d.set_limits(Limits {
        breakers: BTreeMap::from([(g.clone(), BreakerPolicy::new(1, Duration::from_secs(300)))]),
        ..Limits::default()
    });
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    d.track_changes();
    let mut sink = RecordingSink::default();
    assert_eq!(failing_start(&mut d, &mut sink, at(0)), 1);
    assert!(d.breaker(&g).is_some_and(|b| b.is_open()));
    let _ = d.take_changes(at(0));
    assert!(!d.has_changes(), "everything was taken");
    assert!(d.reset_breaker(&g));
    assert!(d.has_changes(), "the closed breaker is a change");
    let changes = d.take_changes(at(0));
    assert!(
        changes.meta().is_some_and(|m| m.breakers.is_empty()),
        "the meta carries the closed breaker"
    );
}
