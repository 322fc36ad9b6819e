//! The durable form of the driver's memory (design §13): change sets, the
//! serialized form, and recovery after a controller crash.

mod common;

use common::*;
use provisioning::{
    ClusterDriver, DURABLE_FORMAT, DriverChanges, DurableState, EffectError, EffectKind, NodeStage,
    Observation, RecoveryError, RetryPolicy, RunId, Timestamp,
};

/// A journal as a test keeps it: the first change set, then every later one
/// applied on top.
struct Journal(Option<DurableState>);

impl Journal {
    fn commit(&mut self, d: &mut ClusterDriver, now: Timestamp) -> DriverChanges {
        let changes = d.take_changes(now).to_owned_changes();
        match &mut self.0 {
            Some(state) => state.apply(&changes),
            None => {
                let meta = changes
                    .meta
                    .clone()
                    .expect("the first change set has the meta");
                let mut state = DurableState {
                    meta,
                    nodes: Vec::new(),
                };
                state.apply(&changes);
                self.0 = Some(state);
            }
        }
        changes
    }

    fn state(&self) -> DurableState {
        self.0.clone().expect("committed")
    }
}

fn run() -> RunId {
    RunId::new(RUN)
}

#[test]
fn a_change_set_holds_only_the_nodes_that_changed_since_the_last_one() {
    let mut d = tracked(vec![group("g", 3, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(0);
    let creates = drive(&mut d, &mut sink, now);
    assert_eq!(creates.len(), 3);
    let mut journal = Journal(None);
    let first = journal.commit(&mut d, now);
    assert_eq!(first.upserts.len(), 3);
    assert!(first.meta.is_some());
    assert!(d.take_changes(now).is_empty(), "nothing changed since");

    d.apply_executor_result(&success(&creates[1]), now).unwrap();
    let changes = journal.commit(&mut d, now);
    let ids: Vec<_> = changes
        .upserts
        .iter()
        .map(|e| e.node.node.to_string())
        .collect();
    assert_eq!(ids, vec!["g-1"]);
    assert_eq!(
        changes.meta.map(|m| m.written_at),
        Some(now),
        "every write carries the meta with the writer's clock"
    );

    let lookup = drive(&mut d, &mut sink, now);
    assert_eq!(lookup.len(), 1);
    let changes = journal.commit(&mut d, now);
    assert_eq!(changes.upserts.len(), 1);
    assert_eq!(
        changes.upserts[0].node.pending.as_ref().map(|p| p.id),
        Some(lookup[0].id),
        "the dispatch is in the change set, pending"
    );
}

#[test]
fn one_take_is_read_as_ids_as_entries_or_not_at_all() {
    let mut d = tracked(vec![group("g", 3, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(0);
    let creates = drive(&mut d, &mut sink, now);
    // The ids alone: the first take names every node.
    let ids: Vec<String> = d
        .take_changes(now)
        .into_nodes()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ids, ["g-0", "g-1", "g-2"]);
    assert!(!d.has_changes(), "the ids were taken");

    // The borrowed entries and the owned copy say the same.
    d.apply_executor_result(&success(&creates[1]), now).unwrap();
    assert!(d.has_changes());
    let view = d.take_changes(now);
    assert!(!view.is_empty());
    let owned = view.to_owned_changes();
    let borrowed: Vec<_> = view
        .entries()
        .map(|(id, entry)| (id.clone(), entry.map(|e| e.to_entry())))
        .collect();
    let copied: Vec<_> = owned
        .upserts
        .iter()
        .map(|e| (e.node.node.clone(), Some(e.clone())))
        .collect();
    assert_eq!(borrowed, copied);
    assert_eq!(view.meta(), owned.meta);
    drop(view);

    // A view dropped unread discards its changes.
    d.apply_executor_result(&success(&creates[0]), now).unwrap();
    assert!(d.has_changes());
    drop(d.take_changes(now));
    assert!(!d.has_changes(), "a dropped view discards the changes");
    assert!(d.take_changes(now).is_empty());
}

#[test]
fn reaped_nodes_are_removed_and_allocations_move_the_meta() {
    let mut d = tracked(vec![group("g", 2, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(0);
    converge(&mut d, &mut sink, now);
    let mut journal = Journal(None);
    journal.commit(&mut d, now);
    d.update_desired(shape(2, vec![group("g", 1, "img:1")]))
        .unwrap();
    converge(&mut d, &mut sink, now);
    let changes = journal.commit(&mut d, now);
    assert_eq!(
        changes
            .removed
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        vec!["g-1"]
    );
    let meta = changes.meta.expect("the generation changed");
    assert_eq!(meta.desired.generation.get(), 2);
    assert_eq!(journal.state().nodes.len(), 1);
}

#[test]
fn the_durable_form_round_trips_through_json() {
    let mut d = tracked(vec![group("g", 2, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(5);
    let creates = drive(&mut d, &mut sink, now);
    d.apply_executor_result(
        &reply(&creates[0], Err(EffectError::ambiguous("lost"))),
        now,
    )
    .unwrap();
    let state = d.durable_state(now);
    let meta = serde_json::to_string(&state.meta).unwrap();
    assert_eq!(
        serde_json::from_str::<provisioning::DurableMeta>(&meta).unwrap(),
        state.meta
    );
    for entry in &state.nodes {
        let node = serde_json::to_string(&entry.node).unwrap();
        let template = serde_json::to_string(&*entry.template).unwrap();
        assert_eq!(
            serde_json::from_str::<provisioning::DurableNode>(&node).unwrap(),
            entry.node
        );
        assert_eq!(
            serde_json::from_str::<provisioning::NodeTemplate>(&template).unwrap(),
            *entry.template
        );
    }
}

#[test]
fn a_recovered_driver_without_pending_work_equals_the_one_that_wrote_it() {
    let mut d = tracked(vec![group("g", 3, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(1_000);
    converge(&mut d, &mut sink, now);
    let mut journal = Journal(None);
    journal.commit(&mut d, now);
    let (recovered, report) =
        ClusterDriver::recover(&run(), journal.state(), RetryPolicy::default(), now).unwrap();
    assert_eq!(report.nodes, 3);
    assert_eq!(report.pending_made_ambiguous, 0);
    assert_eq!(recovered.desired().shape(), d.desired().shape());
    // Readiness is re-earned (G37): every node is rejoining until its agent
    // re-joins the new controller; then the state is the one written.
    let mut recovered = recovered;
    assert_eq!(report.rejoining, 3);
    assert!(!recovered.is_converged());
    rejoin_all(&mut recovered, now);
    assert_eq!(recovered.state(), d.state());
    assert!(recovered.is_converged());
}

/// Folds the re-join of every rejoining node's agent at `now`.
fn rejoin_all(d: &mut ClusterDriver, now: Timestamp) {
    let rejoining: Vec<_> = d
        .state()
        .nodes
        .iter()
        .filter(|(_, n)| n.record.stage == NodeStage::Rejoining)
        .map(|(id, n)| (id.clone(), n.attempt))
        .collect();
    for (node, attempt) in rejoining {
        d.apply_observation(&Observation::AgentRejoined { node, attempt }, now)
            .unwrap();
    }
}

/// A converged one-node driver, journaled and recovered at `recover_at`.
fn recovered_ready(recover_at: u64) -> (ClusterDriver, RecordingSink, ClusterDriver) {
    let mut d = tracked(vec![group("g", 1, "img:1")]);
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(1_000));
    assert!(d.is_converged());
    let state = d.durable_state(at(1_000));
    let (r, _) =
        ClusterDriver::recover(&run(), state, RetryPolicy::default(), at(recover_at)).unwrap();
    (d, sink, r)
}

#[test]
fn a_node_recovered_as_ready_is_rejoining_until_its_agent_rejoins_the_new_controller() {
    let (_, mut sink, mut r) = recovered_ready(5_000);
    let n = &r.state().nodes[&node("g-0")];
    assert_eq!(n.record.stage, NodeStage::Rejoining);
    assert!(!n.record.ready && !n.is_ready());
    assert_eq!(n.record.rejoin_by, Some(at(5_000 + 60_000)));
    assert!(!r.is_converged(), "never converged on the journal's word");
    // Left alone: nothing is destroyed or restarted while it rejoins, and the
    // driver wakes at the rejoin deadline.
    assert!(drive(&mut r, &mut sink, at(5_000)).is_empty());
    assert_eq!(r.requeue_at(), Some(at(65_000)));
    assert!(drive(&mut r, &mut sink, at(64_999)).is_empty());
    assert!(!r.is_converged());
    let attempt = r.state().nodes[&node("g-0")].attempt;
    r.apply_observation(
        &Observation::AgentRejoined {
            node: node("g-0"),
            attempt,
        },
        at(6_000),
    )
    .unwrap();
    let n = &r.state().nodes[&node("g-0")];
    assert_eq!(n.record.stage, NodeStage::Dormant);
    assert!(n.is_ready() && n.record.rejoin_by.is_none());
    assert!(drive(&mut r, &mut sink, at(6_000)).is_empty());
    assert!(r.is_converged());
    assert_eq!(r.requeue_at(), None, "no rejoin timer is left");
}

#[test]
fn a_rejoin_of_another_attempt_is_rejected_and_a_rejoin_of_a_ready_node_changes_nothing() {
    let (_, _, mut r) = recovered_ready(5_000);
    let attempt = r.state().nodes[&node("g-0")].attempt;
    let before = r.state().clone();
    let stale = Observation::AgentRejoined {
        node: node("g-0"),
        attempt: provisioning::NodeAttemptId::from_raw(attempt.get() + 100),
    };
    assert!(r.apply_observation(&stale, at(6_000)).is_err());
    assert_eq!(r.state(), &before, "a stale re-join changes nothing");
    let rejoin = Observation::AgentRejoined {
        node: node("g-0"),
        attempt,
    };
    r.apply_observation(&rejoin, at(6_000)).unwrap();
    let ready = r.state().clone();
    // The agent re-dials again later: nothing new.
    r.apply_observation(&rejoin, at(7_000)).unwrap();
    assert_eq!(r.state(), &ready);
}

#[test]
fn a_rejoining_node_whose_window_ends_is_lost_and_replaced() {
    let (_, mut sink, mut r) = recovered_ready(5_000);
    r.set_history_depth(8);
    let attempt = r.state().nodes[&node("g-0")].attempt;
    // The deadline is due exactly at its instant: the node is lost.
    let mut ops = drive(&mut r, &mut sink, at(65_000));
    assert!(ops.iter().all(|op| op.kind() == EffectKind::DestroyLease));
    let n = &r.state().nodes[&node("g-0")];
    assert_eq!(n.intent, provisioning::Intent::Deleting);
    let failure = n.record.failure.as_ref().expect("lost");
    assert_eq!(
        failure.reason,
        "the node's agent did not re-join the restarted controller within 60 s"
    );
    let history = r.history(&node("g-0")).expect("history kept");
    assert!(
        history.entries().any(|t| t.stage == NodeStage::Failed
            && t.reason.as_deref() == Some(failure.reason.as_str())),
        "the loss is noted: {history:?}"
    );
    // Replaced by the ladder as any lost node: destroy, then a new attempt.
    let mut now = 65_000;
    for _ in 0..16 {
        if ops.is_empty() {
            now += 1_000;
        }
        for op in ops.drain(..) {
            r.apply_executor_result(&success(&op), at(now)).unwrap();
            if op.kind() == EffectKind::StartBootstrap {
                r.apply_observation(
                    &bootstrap(&op, provisioning::BootstrapEvent::Joined),
                    at(now),
                )
                .unwrap();
            }
            if op.kind() == EffectKind::BootstrapConvergenceObserved {
                r.apply_observation(
                    &bootstrap(&op, provisioning::BootstrapEvent::Closed),
                    at(now),
                )
                .unwrap();
            }
        }
        ops = drive(&mut r, &mut sink, at(now));
        if r.is_converged() {
            break;
        }
    }
    assert!(r.is_converged(), "{:#?}", r.state());
    assert_ne!(r.state().nodes[&node("g-0")].attempt, attempt, "replaced");
}

#[test]
fn a_rejoining_node_whose_slot_drifts_or_is_scaled_away_is_torn_down() {
    for groups in [vec![group("g", 1, "img:2")], vec![group("g", 0, "img:1")]] {
        let (_, mut sink, mut r) = recovered_ready(5_000);
        r.update_desired(shape(2, groups)).unwrap();
        let ops = drive(&mut r, &mut sink, at(5_000));
        assert_eq!(one(ops, EffectKind::DestroyLease).node, node("g-0"));
        let n = &r.state().nodes[&node("g-0")];
        assert_eq!(n.intent, provisioning::Intent::Deleting);
        assert_eq!(n.record.stage, NodeStage::Dormant, "no longer rejoining");
        assert!(n.record.rejoin_by.is_none() && !n.record.ready);
    }
}

#[test]
fn a_rejoin_deadline_is_journaled_and_keeps_its_time_left_across_a_second_restart() {
    let (_, mut sink, mut r) = recovered_ready(5_000);
    r.track_changes();
    drive(&mut r, &mut sink, at(5_000));
    let changes = r.take_changes(at(15_000)).to_owned_changes();
    let written = changes
        .upserts
        .iter()
        .find(|e| e.node.node == node("g-0"))
        .expect("the rejoining node is written");
    assert_eq!(written.node.record.stage, NodeStage::Rejoining);
    assert_eq!(written.node.record.rejoin_by, Some(at(65_000)));
    // The second controller dies 10 s into the window; a third starts on a
    // clock of its own: the node still has 50 s left, not a fresh window.
    let state = r.durable_state(at(15_000));
    let (third, report) =
        ClusterDriver::recover(&run(), state, RetryPolicy::default(), at(100)).unwrap();
    let n = &third.state().nodes[&node("g-0")];
    assert_eq!(n.record.stage, NodeStage::Rejoining);
    assert_eq!(n.record.rejoin_by, Some(at(50_100)));
    assert_eq!(report.rejoining, 0, "already rejoining, not marked again");
}

#[test]
fn the_rejoin_window_is_the_policys() {
    let mut d = tracked(vec![group("g", 1, "img:1")]);
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(0));
    let policy = RetryPolicy {
        rejoin_window: std::time::Duration::from_secs(5),
        ..RetryPolicy::default()
    };
    let (mut r, _) = ClusterDriver::recover(&run(), d.durable_state(at(0)), policy, at(0)).unwrap();
    assert_eq!(
        r.state().nodes[&node("g-0")].record.rejoin_by,
        Some(at(5_000))
    );
    drive(&mut r, &mut sink, at(5_000));
    assert_eq!(
        r.state().nodes[&node("g-0")]
            .record
            .failure
            .as_ref()
            .map(|f| f.reason.as_str()),
        Some("the node's agent did not re-join the restarted controller within 5 s")
    );
}

#[test]
fn recovery_makes_pending_operations_ambiguous_and_the_ladder_reissues_them() {
    let mut d = tracked(vec![group("g", 1, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(0);
    let create = drive(&mut d, &mut sink, now).remove(0);
    let mut journal = Journal(None);
    journal.commit(&mut d, now);
    // The controller dies with the create in flight; it restarts later.
    drop(d);
    let later = at(500_000);
    let (mut r, report) =
        ClusterDriver::recover(&run(), journal.state(), RetryPolicy::default(), later).unwrap();
    assert_eq!(report.pending_made_ambiguous, 1);
    let id = node("g-0");
    let managed = &r.state().nodes[&id];
    assert!(managed.pending.is_none());
    let ambiguous = managed.retry.ambiguous.as_ref().expect("remembered");
    assert_eq!(
        (ambiguous.op, ambiguous.kind),
        (create.id, EffectKind::CreateLease)
    );
    assert!(drive(&mut r, &mut sink, later).is_empty(), "backoff first");
    let reissue = drive(&mut r, &mut sink, at(600_000));
    assert_eq!(reissue.len(), 1);
    assert_eq!(reissue[0].kind(), EffectKind::CreateLease);
    assert_eq!(
        reissue[0].attempt(),
        create.attempt(),
        "the same attempt: the provider adopts"
    );
    assert!(reissue[0].id.sequence() > create.id.sequence());
    let changes = r.take_changes(at(600_000)).to_owned_changes();
    assert_eq!(
        changes.upserts.len(),
        1,
        "what recovery changed is journaled"
    );
}

#[test]
fn the_allocator_resumes_above_its_mark_so_attempt_ids_are_never_reused() {
    let mut d = tracked(vec![group("g", 2, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(0);
    converge(&mut d, &mut sink, now);
    // Scale down and up: attempts 1 and 2 were used, 3 is the next.
    d.update_desired(shape(2, vec![group("g", 1, "img:1")]))
        .unwrap();
    converge(&mut d, &mut sink, now);
    let mut journal = Journal(None);
    journal.commit(&mut d, now);
    let (mut r, report) =
        ClusterDriver::recover(&run(), journal.state(), RetryPolicy::default(), now).unwrap();
    assert!(!report.allocator_raised);
    r.update_desired(shape(3, vec![group("g", 2, "img:1")]))
        .unwrap();
    let ops = drive(&mut r, &mut sink, now);
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0].attempt().get(), 3);
}

#[test]
fn a_stored_mark_below_a_stored_attempt_is_raised_and_reported() {
    let mut d = tracked(vec![group("g", 2, "img:1")]);
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(0));
    let mut state = d.durable_state(at(0));
    state.meta.next_attempt = 1;
    let (r, report) = ClusterDriver::recover(&run(), state, RetryPolicy::default(), at(0)).unwrap();
    assert!(report.allocator_raised);
    assert_eq!(r.state().attempts.next_unallocated(), 3);
}

#[test]
fn stored_deadlines_keep_the_time_they_had_left_on_the_new_clock() {
    let mut d = tracked(vec![group("g", 1, "img:1")]);
    let mut sink = RecordingSink::default();
    let create = drive(&mut d, &mut sink, at(10_000)).remove(0);
    d.apply_executor_result(
        &reply(&create, Err(EffectError::definite("quota"))),
        at(10_000),
    )
    .unwrap();
    let backoff = d.state().nodes[&node("g-0")].retry.next_effect_at.unwrap();
    assert_eq!(backoff, at(11_000));
    // Written at 10 500 (500 ms left); the new controller's clock starts at 0.
    let state = d.durable_state(at(10_500));
    let (r, _) = ClusterDriver::recover(&run(), state, RetryPolicy::default(), at(0)).unwrap();
    assert_eq!(
        r.state().nodes[&node("g-0")].retry.next_effect_at,
        Some(at(500))
    );
}

/// Found by the kit's commit check (G26): the meta, and with it the
/// writer's clock, used to be written only when it changed. A backoff
/// written an hour later was then read against the clock of an hour before,
/// and came back an hour late after a restart.
#[test]
fn a_backoff_written_long_after_the_meta_comes_back_on_time() {
    let mut d = tracked(vec![group("g", 1, "img:1")]);
    let mut sink = RecordingSink::default();
    let mut journal = Journal(None);
    let create = drive(&mut d, &mut sink, at(0)).remove(0);
    journal.commit(&mut d, at(0));
    let hour = 3_600_000;
    d.apply_executor_result(
        &reply(&create, Err(EffectError::definite("quota"))),
        at(hour),
    )
    .unwrap();
    journal.commit(&mut d, at(hour));
    assert_eq!(
        d.state().nodes[&node("g-0")].retry.next_effect_at,
        Some(at(hour + 1_000))
    );
    // The controller dies at once; the new one's clock starts at 0.
    let (r, _) =
        ClusterDriver::recover(&run(), journal.state(), RetryPolicy::default(), at(0)).unwrap();
    assert_eq!(
        r.state().nodes[&node("g-0")].retry.next_effect_at,
        Some(at(1_000)),
        "one second left, as when it was written"
    );
}

/// Recovery on another clock moves every stored instant; the journal still
/// holds them on the old one. If only the meta were written again (with the
/// new clock), a second recovery would read the old instants against it.
/// So the first change set after such a recovery writes every node again.
#[test]
fn after_recovery_on_a_new_clock_the_first_write_moves_every_node_to_it() {
    let mut d = tracked(vec![group("g", 2, "img:1")]);
    let mut sink = RecordingSink::default();
    let mut journal = Journal(None);
    let creates = drive(&mut d, &mut sink, at(50_000));
    for create in &creates {
        d.apply_executor_result(
            &reply(create, Err(EffectError::definite("quota"))),
            at(50_000),
        )
        .unwrap();
    }
    journal.commit(&mut d, at(50_000));
    let (mut r, _) =
        ClusterDriver::recover(&run(), journal.state(), RetryPolicy::default(), at(0)).unwrap();
    let first = journal.commit(&mut r, at(0));
    assert_eq!(
        first.upserts.len(),
        2,
        "every node written on the new clock"
    );
    // A second crash at once: the backoffs still have their second left.
    let (again, _) =
        ClusterDriver::recover(&run(), journal.state(), RetryPolicy::default(), at(0)).unwrap();
    for id in ["g-0", "g-1"] {
        assert_eq!(
            again.state().nodes[&node(id)].retry.next_effect_at,
            Some(at(1_000))
        );
    }
}

#[test]
fn a_state_of_another_run_or_format_is_refused() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 1, "img:1")]))
        .unwrap();
    let state = d.durable_state(at(0));
    assert!(matches!(
        ClusterDriver::recover(
            &RunId::new("other"),
            state.clone(),
            RetryPolicy::default(),
            at(0)
        ),
        Err(RecoveryError::RunMismatch { .. })
    ));
    let mut newer = state;
    newer.meta.format = DURABLE_FORMAT + 1;
    assert!(matches!(
        ClusterDriver::recover(&run(), newer, RetryPolicy::default(), at(0)),
        Err(RecoveryError::UnsupportedFormat { .. })
    ));
}

#[test]
fn a_session_that_had_not_handed_off_is_started_again_after_recovery_and_the_provider_adopts_it() {
    let mut d = tracked(vec![group("g", 1, "img:1")]);
    let mut sink = RecordingSink::default();
    let now = at(0);
    let start = started(&mut d, &mut sink, now);
    d.apply_observation(
        &bootstrap(&start, provisioning::BootstrapEvent::Joined),
        now,
    )
    .unwrap();
    let state = d.durable_state(now);
    // The controller dies while the session streams to it.
    let (mut r, report) =
        ClusterDriver::recover(&run(), state, RetryPolicy::default(), at(10)).unwrap();
    assert_eq!(report.sessions_restarted, 1);
    let managed = &r.state().nodes[&node("g-0")];
    assert!(managed.record.bootstrap.is_none() && managed.record.swarm.is_none());
    assert_eq!(
        managed.retry.ambiguous.as_ref().map(|a| a.kind),
        Some(EffectKind::StartBootstrap)
    );
    let again = drive(&mut r, &mut sink, at(10));
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].kind(), EffectKind::StartBootstrap);
    assert_eq!(
        again[0].attempt(),
        start.attempt(),
        "the same attempt: adopted"
    );
    // Adopted, then the stream goes on: the node becomes ready.
    r.apply_executor_result(&success(&again[0]), at(10))
        .unwrap();
    r.apply_observation(
        &bootstrap(&again[0], provisioning::BootstrapEvent::Joined),
        at(10),
    )
    .unwrap();
    converge(&mut r, &mut sink, at(10));
    assert!(r.is_converged());
}
