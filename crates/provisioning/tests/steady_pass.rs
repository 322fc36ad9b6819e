//! A full pass over a converged cluster skips the nodes the driver knows to
//! be steady. These tests check that it still decides exactly what the pure
//! decider decides for every slot, after every kind of change a steady node
//! or the desired shape can go through: a full pass after a change must act.

mod common;

use common::*;
use provisioning::decide::{NodeAction, NodeDecision, for_each_slot};
use provisioning::observe::LossCause;
use provisioning::{
    BootstrapEvent, BootstrapFailure, ClusterDriver, EffectKind, Limits, LogicalNodeId,
    Observation, RetryPolicy, Rule, Timestamp, reconcile_node,
};

/// What the pure decider says of every slot at `now`: the decisions a full
/// pass lists (those that act or wait on a timer), and how many slots it
/// evaluates.
fn oracle(d: &ClusterDriver, now: Timestamp) -> (Vec<(LogicalNodeId, NodeDecision)>, usize) {
    let mut listed = Vec::new();
    let mut slots = 0;
    for_each_slot(d.state(), d.desired(), |node, spec| {
        let Some(decision) = reconcile_node(node, spec, now) else {
            return;
        };
        slots += 1;
        let id = spec.map_or_else(|| node.unwrap().spec.id().clone(), |s| s.id().clone());
        let timer = matches!(decision.wake, Some(provisioning::decide::Wake::Timer(_)));
        if decision.action != NodeAction::None || timer {
            listed.push((id, decision));
        }
    });
    (listed, slots)
}

/// Runs one forced full pass at `now`, checks its decisions against the
/// decider's, applies it and returns the decisions that act.
fn checked_full_pass(
    d: &mut ClusterDriver,
    sink: &mut RecordingSink,
    now: Timestamp,
) -> Vec<(String, Rule)> {
    let (expected, slots) = oracle(d, now);
    d.trigger();
    let plan = d.begin_pass(now).unwrap();
    assert!(plan.is_full());
    assert_eq!(plan.decisions(), expected.as_slice(), "full pass at {now}");
    assert_eq!(plan.evaluated(), slots, "every slot is evaluated");
    let acting = plan
        .decisions()
        .iter()
        .filter(|(_, d)| d.action != NodeAction::None)
        .map(|(id, d)| (id.to_string(), d.rule))
        .collect();
    d.finish_pass(plan, sink).unwrap();
    acting
}

/// Answers `ops` with success, playing the bootstrap stream.
fn answer(d: &mut ClusterDriver, ops: Vec<provisioning::Operation>, now: Timestamp) {
    for op in ops {
        d.apply_executor_result(&success(&op), now).unwrap();
        let event = match op.kind() {
            EffectKind::StartBootstrap => BootstrapEvent::Joined,
            EffectKind::BootstrapConvergenceObserved => BootstrapEvent::Closed,
            _ => continue,
        };
        d.apply_observation(&bootstrap(&op, event), now).unwrap();
    }
}

/// Brings `d` to convergence from `now`, running a checked full pass before
/// every drive (so both full and incremental passes mark nodes steady) and
/// waiting for timers when nothing acts. Returns the instant it converged.
fn settle(d: &mut ClusterDriver, mut now: Timestamp) -> Timestamp {
    let mut sink = RecordingSink::default();
    for _ in 0..256 {
        let acted = checked_full_pass(d, &mut sink, now);
        d.drive_until_blocked(now, &mut sink).unwrap();
        let ops = sink.take();
        if acted.is_empty() && ops.is_empty() {
            if d.is_converged() {
                return now;
            }
            let next = d
                .requeue_at()
                .expect("an unconverged idle driver waits on a timer");
            assert!(next > now, "a due timer was not acted on at {now}");
            now = next;
            continue;
        }
        answer(d, ops, now);
    }
    panic!("did not converge");
}

/// Two groups of 70 (more than one 64-slot word each), converged, with
/// every node known steady; then a steady full pass acts on nothing.
fn steady_cluster() -> (ClusterDriver, Timestamp) {
    let mut d = driver();
    d.update_desired(shape(
        1,
        vec![group("a", 70, "img:1"), group("b", 70, "img:1")],
    ))
    .unwrap();
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(0));
    assert!(d.is_converged());
    let now = settle(&mut d, at(0));
    for _ in 0..2 {
        assert_eq!(checked_full_pass(&mut d, &mut sink, now), vec![]);
    }
    assert!(sink.take().is_empty());
    (d, now)
}

fn lose(d: &mut ClusterDriver, id: &str, cause: LossCause, now: Timestamp) {
    let node = node(id);
    let attempt = d.state().nodes[&node].attempt;
    d.apply_observation(
        &Observation::NodeLost {
            node,
            attempt,
            cause,
        },
        now,
    )
    .unwrap();
}

/// After `change`, a full pass acts (and the decisions of every pass until
/// the cluster converges again are the decider's).
fn full_pass_acts_after(
    what: &str,
    change: impl FnOnce(&mut ClusterDriver, Timestamp),
    expect: &[(&str, Rule)],
) {
    let (mut d, now) = steady_cluster();
    change(&mut d, now);
    let mut sink = RecordingSink::default();
    let acted = checked_full_pass(&mut d, &mut sink, now);
    let expect: Vec<(String, Rule)> = expect.iter().map(|(n, r)| (n.to_string(), *r)).collect();
    assert_eq!(acted, expect, "{what}");
    answer(&mut d, sink.take(), now);
    let now = settle(&mut d, now);
    assert!(d.is_converged(), "{what}");
    assert_eq!(checked_full_pass(&mut d, &mut sink, now), vec![], "{what}");
}

#[test]
fn a_full_pass_acts_on_a_steady_node_that_was_lost() {
    for (cause, id) in [
        (LossCause::AgentGone, "a-0"),
        (LossCause::LeaseGone, "a-64"),
        (LossCause::WorkloadExited, "b-69"),
    ] {
        full_pass_acts_after(
            &format!("{cause:?}"),
            |d, now| lose(d, id, cause, now),
            &[(id, Rule::BeginDelete)],
        );
    }
}

#[test]
fn a_full_pass_acts_on_every_node_after_the_template_changed() {
    let expect: Vec<(String, Rule)> = (0..70)
        .map(|i| (format!("b-{i}"), Rule::BeginDelete))
        .collect();
    let expect: Vec<(&str, Rule)> = expect.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    full_pass_acts_after(
        "template",
        |d, _| {
            d.update_desired(shape(
                2,
                vec![group("a", 70, "img:1"), group("b", 70, "img:2")],
            ))
            .unwrap();
        },
        &expect,
    );
}

#[test]
fn a_full_pass_acts_after_a_scale_down_a_scale_up_and_a_removed_group() {
    full_pass_acts_after(
        "scale down",
        |d, _| {
            d.update_desired(shape(
                2,
                vec![group("a", 68, "img:1"), group("b", 70, "img:1")],
            ))
            .unwrap();
        },
        &[("a-68", Rule::BeginDelete), ("a-69", Rule::BeginDelete)],
    );
    full_pass_acts_after(
        "scale up",
        |d, _| {
            d.update_desired(shape(
                2,
                vec![group("a", 70, "img:1"), group("b", 71, "img:1")],
            ))
            .unwrap();
        },
        &[("b-70", Rule::Insert)],
    );
    let expect: Vec<(String, Rule)> = (0..70)
        .map(|i| (format!("a-{i}"), Rule::BeginDelete))
        .collect();
    let expect: Vec<(&str, Rule)> = expect.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    full_pass_acts_after(
        "group removed",
        |d, _| {
            d.update_desired(shape(2, vec![group("b", 70, "img:1")]))
                .unwrap();
        },
        &expect,
    );
}

#[test]
fn a_full_pass_after_a_change_that_needs_nothing_still_acts_on_nothing() {
    // A new generation of the same content, new limits, a rejected late
    // stream event: nothing to do, and the pass says so.
    full_pass_acts_after(
        "same content",
        |d, _| {
            d.update_desired(shape(
                2,
                vec![group("a", 70, "img:1"), group("b", 70, "img:1")],
            ))
            .unwrap();
        },
        &[],
    );
    full_pass_acts_after(
        "limits",
        |d, _| {
            d.set_limits(Limits {
                max_concurrent_creates: [("fake".to_owned(), 1)].into(),
                ..Limits::default()
            });
        },
        &[],
    );
    full_pass_acts_after(
        "late event",
        |d, now| {
            let id = node("a-5");
            let attempt = d.state().nodes[&id].attempt;
            let late = Observation::Bootstrap {
                node: id,
                attempt,
                event: BootstrapEvent::Failed {
                    failure: BootstrapFailure::StreamError,
                    detail: "late".into(),
                },
            };
            assert!(d.apply_observation(&late, now).is_err());
        },
        &[],
    );
}

#[test]
fn a_full_pass_acts_through_refused_submissions_timeouts_and_restarts() {
    let (mut d, now) = steady_cluster();
    lose(&mut d, "a-3", LossCause::AgentGone, now);
    let mut sink = RecordingSink::default();
    // The teardown begins; its first cleanup step is refused by the sink.
    assert_eq!(
        checked_full_pass(&mut d, &mut sink, now),
        vec![("a-3".to_owned(), Rule::BeginDelete)]
    );
    sink.refuse = true;
    d.drive_until_blocked(now, &mut sink).unwrap();
    sink.refuse = false;
    // The refusal left a backoff: nothing acts until it is due, then the
    // cleanup step is dispatched again and times out.
    let mut now = now;
    let op = loop {
        checked_full_pass(&mut d, &mut sink, now);
        d.drive_until_blocked(now, &mut sink).unwrap();
        if let Some(op) = sink.take().into_iter().next() {
            break op;
        }
        now = d.requeue_at().expect("the node waits on its backoff");
    };
    let deadline = d.state().nodes[&op.node].pending.as_ref().unwrap().deadline;
    d.operation_timed_out(&op.node, op.id, deadline).unwrap();
    assert!(
        !checked_full_pass(&mut d, &mut sink, deadline).is_empty()
            || d.requeue_at().is_some_and(|t| t > deadline),
        "after the timeout the node acts or waits on a timer"
    );
    answer(&mut d, sink.take(), deadline);
    let now = settle(&mut d, deadline);
    assert_eq!(checked_full_pass(&mut d, &mut sink, now), vec![]);
}

#[test]
fn a_full_pass_acts_on_a_recovered_driver() {
    let (d, now) = steady_cluster();
    let stored = d.durable_state(now);
    let (mut recovered, _) =
        ClusterDriver::recover(d.run_id(), stored, RetryPolicy::default(), now).unwrap();
    let mut sink = RecordingSink::default();
    assert_eq!(checked_full_pass(&mut recovered, &mut sink, now), vec![]);
    lose(&mut recovered, "b-1", LossCause::LeaseGone, now);
    assert_eq!(
        checked_full_pass(&mut recovered, &mut sink, now),
        vec![("b-1".to_owned(), Rule::BeginDelete)]
    );
}
