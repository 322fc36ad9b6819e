//! The per-node decision ladder of design §5, row by row.

mod common;

use common::*;
use provisioning::decide::{NodeAction, Rule, Wake, reconcile, reconcile_node};
use provisioning::effect::{EffectKind, Endpoint, LeaseHandle};
use provisioning::id::OperationSequence;
use provisioning::state::{
    AmbiguousOperation, BootstrapFacts, BootstrapProgress, BootstrapStage, EndpointFacts, Intent,
    LeaseFacts, ManagedNode, NodeStage, PendingOperation, RetryState, SessionState, SwarmJoinFacts,
};
use provisioning::{ClusterState, LogicalNodeSpec, NodeAttemptId, OperationId, RunId, Timestamp};
use std::sync::Arc;

const NOW: u64 = 10_000;

fn spec(id: &str, image: &str) -> LogicalNodeSpec {
    LogicalNodeSpec::new(node(id), RunId::new(RUN), Arc::new(template(image)))
}

fn attempt() -> NodeAttemptId {
    NodeAttemptId::from_raw(7)
}

/// A node of `g-0` at `stage` with the facts that stage implies.
fn at_stage(stage: NodeStage) -> ManagedNode {
    let mut n = ManagedNode::new(spec("g-0", "img:1"), attempt(), RetryState::default());
    n.record.stage = stage;
    let lease = LeaseFacts {
        attempt: attempt(),
        lease: LeaseHandle("l".into()),
        observed_at: at(0),
        adopted: false,
    };
    let endpoint = EndpointFacts {
        attempt: attempt(),
        endpoint: Endpoint("e".into()),
        observed_at: at(0),
    };
    let session = BootstrapFacts {
        attempt: attempt(),
        session: None,
        state: SessionState::Active,
        stage: BootstrapStage::Progress(BootstrapProgress::Created),
        convergence_observed: false,
    };
    use NodeStage::*;
    if matches!(
        stage,
        LeaseCreated | EndpointKnown | BootstrapRunning | SwarmJoined | HandedOff | Dormant
    ) {
        n.record.lease = Some(lease);
    }
    if matches!(
        stage,
        EndpointKnown | BootstrapRunning | SwarmJoined | HandedOff | Dormant
    ) {
        n.record.endpoint = Some(endpoint);
    }
    if matches!(stage, BootstrapRunning | SwarmJoined) {
        n.record.bootstrap = Some(session.clone());
    }
    if matches!(stage, SwarmJoined | HandedOff | Dormant) {
        n.record.swarm = Some(SwarmJoinFacts {
            attempt: attempt(),
            joined_at: at(0),
        });
    }
    if matches!(stage, HandedOff | Dormant) {
        n.record.bootstrap = Some(BootstrapFacts {
            state: SessionState::Closed,
            stage: BootstrapStage::Closed,
            ..session
        });
        n.record.ready = true;
    }
    n
}

fn pending(kind: EffectKind, deadline: u64) -> Option<PendingOperation> {
    Some(PendingOperation {
        id: OperationId::new(attempt(), OperationSequence::FIRST),
        kind,
        dispatched_at: at(0),
        deadline: at(deadline),
    })
}

fn deleting(mut n: ManagedNode) -> ManagedNode {
    n.intent = Intent::Deleting;
    n.record.ready = false;
    n
}

/// Checks one decision: the matched rule, the action, and the wake instant.
fn check(
    node: Option<&ManagedNode>,
    desired: Option<&LogicalNodeSpec>,
    rule: Rule,
    action: NodeAction,
    wake: Option<Wake>,
) {
    let decision = reconcile_node(node, desired, at(NOW)).expect("a decision");
    assert_eq!(
        (decision.rule, decision.action, decision.wake),
        (rule, action, wake),
        "node: {node:#?}"
    );
}

fn desired() -> LogicalNodeSpec {
    spec("g-0", "img:1")
}

fn dispatch(kind: EffectKind) -> NodeAction {
    NodeAction::Dispatch(kind)
}

#[test]
fn row_0_a_desired_slot_without_node_is_inserted() {
    check(
        None,
        Some(&desired()),
        Rule::Insert,
        NodeAction::Insert,
        None,
    );
    assert_eq!(reconcile_node(None, None, at(NOW)), None);
}

#[test]
fn row_1_a_destroyed_undesired_node_is_reaped() {
    let n = at_stage(NodeStage::Destroyed);
    check(Some(&n), None, Rule::Reap, NodeAction::Reap, None);
}

#[test]
fn row_2_a_destroyed_desired_node_restarts_when_restart_at_is_due() {
    let mut n = at_stage(NodeStage::Destroyed);
    check(
        Some(&n),
        Some(&desired()),
        Rule::Restart,
        NodeAction::Restart,
        None,
    );
    n.retry.restart_at = Some(at(NOW));
    check(
        Some(&n),
        Some(&desired()),
        Rule::Restart,
        NodeAction::Restart,
        None,
    );
}

#[test]
fn row_3_a_destroyed_desired_node_waits_for_restart_at() {
    let mut n = at_stage(NodeStage::Destroyed);
    n.retry.restart_at = Some(at(NOW + 1));
    check(
        Some(&n),
        Some(&desired()),
        Rule::AwaitRestart,
        NodeAction::None,
        Some(Wake::Timer(at(NOW + 1))),
    );
}

#[test]
fn row_4_an_active_node_that_is_undesired_drifted_or_failed_begins_delete() {
    let n = at_stage(NodeStage::Dormant);
    check(
        Some(&n),
        None,
        Rule::BeginDelete,
        NodeAction::BeginDelete,
        None,
    );
    check(
        Some(&n),
        Some(&spec("g-0", "img:2")),
        Rule::BeginDelete,
        NodeAction::BeginDelete,
        None,
    );
    let mut failed = at_stage(NodeStage::BootstrapRunning);
    failed.record.stage = NodeStage::Failed;
    check(
        Some(&failed),
        Some(&desired()),
        Rule::BeginDelete,
        NodeAction::BeginDelete,
        None,
    );
    // Row 4 comes before row 5: a pending operation does not delay the intent change.
    let mut busy = at_stage(NodeStage::New);
    busy.pending = pending(EffectKind::CreateLease, NOW + 5);
    check(
        Some(&busy),
        None,
        Rule::BeginDelete,
        NodeAction::BeginDelete,
        None,
    );
}

#[test]
fn row_5_a_pending_operation_waits_until_its_stored_deadline() {
    let mut n = at_stage(NodeStage::LeaseCreated);
    n.pending = pending(EffectKind::LookupEndpoint, NOW + 30);
    check(
        Some(&n),
        Some(&desired()),
        Rule::AwaitOperation,
        NodeAction::None,
        Some(Wake::OperationDeadline(at(NOW + 30))),
    );
    let mut d = deleting(at_stage(NodeStage::Dormant));
    d.pending = pending(EffectKind::DestroyLease, NOW + 30);
    check(
        Some(&d),
        None,
        Rule::AwaitOperation,
        NodeAction::None,
        Some(Wake::OperationDeadline(at(NOW + 30))),
    );
}

#[test]
fn row_6_a_deleting_node_reissues_a_remembered_ambiguous_operation() {
    for kind in [EffectKind::CreateLease, EffectKind::StartBootstrap] {
        let mut n = deleting(at_stage(NodeStage::BootstrapRunning));
        n.retry.ambiguous = Some(Box::new(AmbiguousOperation {
            op: OperationId::new(attempt(), OperationSequence::FIRST),
            kind,
        }));
        check(Some(&n), None, Rule::ReissueAmbiguous, dispatch(kind), None);
    }
}

#[test]
fn rows_6_to_9_respect_a_stored_backoff_first() {
    let mut n = deleting(at_stage(NodeStage::BootstrapRunning));
    n.retry.next_effect_at = Some(at(NOW + 1));
    check(
        Some(&n),
        None,
        Rule::AwaitCleanupBackoff,
        NodeAction::None,
        Some(Wake::Timer(at(NOW + 1))),
    );
    // Due exactly at the stored instant.
    n.retry.next_effect_at = Some(at(NOW));
    check(
        Some(&n),
        None,
        Rule::CancelBootstrap,
        dispatch(EffectKind::CancelBootstrap),
        None,
    );
}

#[test]
fn row_7_a_deleting_node_with_an_active_session_cancels_it() {
    let n = deleting(at_stage(NodeStage::SwarmJoined));
    check(
        Some(&n),
        None,
        Rule::CancelBootstrap,
        dispatch(EffectKind::CancelBootstrap),
        None,
    );
}

#[test]
fn row_8_a_deleting_node_with_a_live_lease_destroys_it() {
    // A closed session needs no cancel.
    let n = deleting(at_stage(NodeStage::Dormant));
    check(
        Some(&n),
        Some(&desired()),
        Rule::DestroyLease,
        dispatch(EffectKind::DestroyLease),
        None,
    );
}

#[test]
fn row_9_a_deleting_node_with_nothing_left_is_marked_destroyed() {
    let n = deleting(at_stage(NodeStage::New));
    check(
        Some(&n),
        None,
        Rule::MarkDestroyed,
        NodeAction::MarkDestroyed,
        None,
    );
}

#[test]
fn row_10_an_active_node_waits_for_its_backoff() {
    let mut n = at_stage(NodeStage::New);
    n.retry.next_effect_at = Some(at(NOW + 1_000));
    check(
        Some(&n),
        Some(&desired()),
        Rule::AwaitBackoff,
        NodeAction::None,
        Some(Wake::Timer(at(NOW + 1_000))),
    );
}

/// A node recovered as ready: the facts of a dormant node, not ready, with
/// its rejoin deadline.
fn rejoining(rejoin_by: u64) -> ManagedNode {
    let mut n = at_stage(NodeStage::Dormant);
    n.record.stage = NodeStage::Rejoining;
    n.record.ready = false;
    n.record.rejoin_by = Some(at(rejoin_by));
    n
}

#[test]
fn row_10a_a_rejoining_node_waits_for_its_agent_until_the_rejoin_deadline() {
    let n = rejoining(NOW + 1);
    check(
        Some(&n),
        Some(&desired()),
        Rule::AwaitRejoin,
        NodeAction::None,
        Some(Wake::Timer(at(NOW + 1))),
    );
}

#[test]
fn row_10b_a_rejoining_node_is_lost_exactly_at_its_rejoin_deadline() {
    for deadline in [NOW, NOW - 1] {
        check(
            Some(&rejoining(deadline)),
            Some(&desired()),
            Rule::RejoinExpired,
            NodeAction::ExpireRejoin,
            None,
        );
    }
}

#[test]
fn row_4_a_rejoining_node_that_drifted_or_is_undesired_begins_delete() {
    let n = rejoining(NOW + 1);
    check(
        Some(&n),
        None,
        Rule::BeginDelete,
        NodeAction::BeginDelete,
        None,
    );
    check(
        Some(&n),
        Some(&spec("g-0", "img:2")),
        Rule::BeginDelete,
        NodeAction::BeginDelete,
        None,
    );
}

#[test]
fn row_11_a_ready_node_is_left_alone() {
    for stage in [NodeStage::Dormant, NodeStage::HandedOff] {
        let n = at_stage(stage);
        check(
            Some(&n),
            Some(&desired()),
            Rule::Steady,
            NodeAction::None,
            None,
        );
    }
}

#[test]
fn row_12_an_active_node_without_lease_creates_one() {
    let n = at_stage(NodeStage::New);
    check(
        Some(&n),
        Some(&desired()),
        Rule::CreateLease,
        dispatch(EffectKind::CreateLease),
        None,
    );
}

#[test]
fn row_13_a_lease_without_endpoint_looks_it_up() {
    let n = at_stage(NodeStage::LeaseCreated);
    check(
        Some(&n),
        Some(&desired()),
        Rule::LookupEndpoint,
        dispatch(EffectKind::LookupEndpoint),
        None,
    );
}

#[test]
fn row_14_a_joined_node_with_a_live_session_reports_convergence_once() {
    let mut n = at_stage(NodeStage::SwarmJoined);
    check(
        Some(&n),
        Some(&desired()),
        Rule::ObserveConvergence,
        dispatch(EffectKind::BootstrapConvergenceObserved),
        None,
    );
    if let Some(b) = n.record.bootstrap.as_mut() {
        b.convergence_observed = true;
    }
    check(
        Some(&n),
        Some(&desired()),
        Rule::AwaitBootstrap,
        NodeAction::None,
        None,
    );
}

#[test]
fn row_15_a_running_bootstrap_awaits_stream_events() {
    let n = at_stage(NodeStage::BootstrapRunning);
    check(
        Some(&n),
        Some(&desired()),
        Rule::AwaitBootstrap,
        NodeAction::None,
        None,
    );
}

#[test]
fn row_16_lease_and_endpoint_without_session_start_bootstrap() {
    let n = at_stage(NodeStage::EndpointKnown);
    check(
        Some(&n),
        Some(&desired()),
        Rule::StartBootstrap,
        dispatch(EffectKind::StartBootstrap),
        None,
    );
}

#[test]
fn the_first_matching_row_wins_over_later_rows() {
    // A destroyed node with a (stale) backoff still restarts: rows 1-3 come first.
    let mut n = at_stage(NodeStage::Destroyed);
    n.retry.next_effect_at = Some(at(NOW + 1));
    check(
        Some(&n),
        Some(&desired()),
        Rule::Restart,
        NodeAction::Restart,
        None,
    );
    // Backoff (row 10) hides the steady state (row 11) only for active nodes
    // that are not ready; a failed node begins delete despite its backoff.
    let mut failed = at_stage(NodeStage::Failed);
    failed.retry.next_effect_at = Some(at(NOW + 1));
    check(
        Some(&failed),
        Some(&desired()),
        Rule::BeginDelete,
        NodeAction::BeginDelete,
        None,
    );
}

#[test]
fn deciding_reads_only_its_inputs_and_is_repeatable() {
    let n = at_stage(NodeStage::LeaseCreated);
    let before = n.clone();
    let first = reconcile_node(Some(&n), Some(&desired()), at(NOW));
    let second = reconcile_node(Some(&n), Some(&desired()), at(NOW));
    assert_eq!(first, second);
    assert_eq!(n, before);
}

#[test]
fn a_full_plan_visits_the_union_of_nodes_and_desired_slots_in_slot_order() {
    let desired = shape(1, vec![group("g", 3, "img:1")]).validate().unwrap();
    let mut state = ClusterState::default();
    // g-1 is ready, g-5 is an undesired leftover, g-0 and g-2 are missing.
    let mut ready = at_stage(NodeStage::Dormant);
    ready.spec = spec("g-1", "img:1");
    state.nodes.insert(node("g-1"), Box::new(ready));
    let mut waiting = at_stage(NodeStage::New);
    waiting.spec = spec("g-9", "img:1");
    waiting.retry.next_effect_at = Some(at(NOW + 5));
    waiting.intent = Intent::Deleting;
    state.nodes.insert(node("g-9"), Box::new(waiting));
    let plan = reconcile(&state, &desired, at(NOW));
    let steps: Vec<(String, NodeAction)> = plan
        .actions
        .iter()
        .map(|a| (a.node.to_string(), a.action))
        .collect();
    assert_eq!(
        steps,
        [
            ("g-0".to_string(), NodeAction::Insert),
            ("g-2".to_string(), NodeAction::Insert),
        ]
    );
    assert_eq!(plan.requeue_at, Some(at(NOW + 5)));
    assert_eq!(plan.observed_generation, desired.generation());
}

#[test]
fn time_at_the_end_of_the_clock_never_panics_the_decider() {
    let mut n = at_stage(NodeStage::New);
    n.retry.next_effect_at = Some(Timestamp::MAX);
    let d = reconcile_node(Some(&n), Some(&desired()), Timestamp::MAX).unwrap();
    assert_eq!(
        d.rule,
        Rule::CreateLease,
        "due exactly at the maximum instant"
    );
}
