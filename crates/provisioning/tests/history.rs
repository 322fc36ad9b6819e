//! Per-node history (design §15): the last transitions of each node, with
//! time and reason, kept only when asked for and bounded.

mod common;

use common::*;
use provisioning::{EffectError, EffectKind, NodeStage};

fn stages(d: &provisioning::ClusterDriver, id: &str) -> Vec<(NodeStage, bool, bool)> {
    d.history(&node(id))
        .map(|h| {
            h.entries()
                .map(|t| (t.stage, t.deleting, t.ready))
                .collect()
        })
        .unwrap_or_default()
}

#[derive(Debug, PartialEq)]
enum Answered {
    Nothing,
    Succeeded,
    FailedStart,
}

/// One drive, then every dispatched operation answered: a start fails
/// definitely (its program is not found), everything else succeeds.
fn answer_with_a_failing_start(
    d: &mut provisioning::ClusterDriver,
    sink: &mut RecordingSink,
    now: provisioning::Timestamp,
) -> Answered {
    d.drive_until_blocked(now, sink).unwrap();
    let mut answered = Answered::Nothing;
    for op in sink.take() {
        let outcome = if op.kind() == EffectKind::StartBootstrap {
            answered = Answered::FailedStart;
            reply(&op, Err(EffectError::definite("sh: srve: not found")))
        } else {
            if answered == Answered::Nothing {
                answered = Answered::Succeeded;
            }
            success(&op)
        };
        d.apply_executor_result(&outcome, now).unwrap();
    }
    answered
}

#[test]
fn a_driver_keeps_no_history_unless_asked() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 2, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(0));
    assert!(d.is_converged());
    assert!(d.history(&node("g-0")).is_none());
}

#[test]
fn a_bring_up_is_recorded_stage_by_stage_with_its_times() {
    let mut d = driver();
    d.set_history_depth(16);
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(5));
    let seen = stages(&d, "g-0");
    assert_eq!(seen.first(), Some(&(NodeStage::New, false, false)));
    assert_eq!(
        seen.get(1),
        Some(&(NodeStage::LeaseRequested, false, false))
    );
    assert!(
        seen.contains(&(NodeStage::LeaseCreated, false, false)),
        "{seen:?}"
    );
    let last = seen.last().unwrap();
    assert!(last.2, "the newest entry is ready: {seen:?}");
    for entry in d.history(&node("g-0")).unwrap().entries() {
        assert_eq!(entry.at, at(5));
        assert_eq!(entry.attempt, d.state().nodes[&node("g-0")].attempt);
    }
    // No two neighbours describe the same condition.
    assert!(seen.windows(2).all(|w| w[0] != w[1]), "{seen:?}");
}

#[test]
fn a_failure_and_the_teardown_it_causes_carry_their_reasons_and_history_is_bounded() {
    let mut d = driver();
    d.set_history_depth(4);
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    for _ in 0..16 {
        if answer_with_a_failing_start(&mut d, &mut sink, at(0)) == Answered::Nothing {
            break;
        }
    }
    let history = d.history(&node("g-0")).unwrap();
    assert!(history.entries().len() <= 4, "bounded: {history:?}");
    let failed = history
        .entries()
        .find(|t| t.stage == NodeStage::Failed && !t.deleting)
        .expect("the failure is kept");
    assert!(
        failed
            .reason
            .as_deref()
            .unwrap()
            .contains("srve: not found"),
        "{failed:?}"
    );
    let teardown = history
        .entries()
        .find(|t| t.deleting)
        .expect("teardown kept");
    assert!(
        teardown.reason.as_deref().unwrap().starts_with("failed: "),
        "{teardown:?}"
    );
}

#[test]
fn scale_down_says_why_and_a_reaped_node_forgets_its_history() {
    let mut d = driver();
    d.set_history_depth(32);
    d.update_desired(shape(1, vec![group("g", 2, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(0));
    d.update_desired(shape(2, vec![group("g", 1, "img")]))
        .unwrap();
    d.drive_until_blocked(at(10), &mut sink).unwrap();
    let deleting = d
        .history(&node("g-1"))
        .unwrap()
        .entries()
        .find(|t| t.deleting)
        .cloned()
        .expect("the teardown is noted");
    assert_eq!(
        deleting.reason.as_deref(),
        Some("scaled down: the slot is no longer desired")
    );
    assert_eq!(deleting.at, at(10));
    converge(&mut d, &mut sink, at(20));
    assert!(d.is_converged());
    assert!(d.history(&node("g-1")).is_none(), "reaped with its node");
    assert!(d.history(&node("g-0")).is_some());
}

#[test]
fn a_failed_node_whose_slot_is_also_scaled_away_names_its_failure_in_the_teardown() {
    let mut d = driver();
    d.set_history_depth(8);
    d.update_desired(shape(1, vec![group("g", 1, "img")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let mut failed = false;
    for _ in 0..16 {
        if answer_with_a_failing_start(&mut d, &mut sink, at(0)) == Answered::FailedStart {
            failed = true;
            break;
        }
    }
    assert!(failed, "the start was dispatched");
    assert_eq!(
        d.state().nodes[&node("g-0")].record.stage,
        NodeStage::Failed
    );
    // The slot goes away before the pass that begins the teardown: the
    // teardown entry still shows the Failed stage, so it names the failure.
    d.update_desired(shape(2, vec![group("g", 0, "img")]))
        .unwrap();
    d.drive_until_blocked(at(1), &mut sink).unwrap();
    let teardown = d
        .history(&node("g-0"))
        .unwrap()
        .entries()
        .find(|t| t.deleting)
        .cloned()
        .expect("the teardown is noted");
    assert_eq!(teardown.stage, NodeStage::Failed);
    assert!(
        teardown
            .reason
            .as_deref()
            .is_some_and(|r| r.starts_with("failed: ") && r.contains("srve: not found")),
        "{teardown:?}"
    );
}
