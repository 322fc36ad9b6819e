//! The stepping API, used as a provider author outside the kit would: any
//! substrate, any initial shape, one input at a time, with the oracle
//! checking after every step and the run inspectable in between.

use std::collections::BTreeMap;

use provisioning::shape::{BootParams, ProviderShape, SwarmJoinTemplate};
use provisioning::{
    ClusterShape, EffectKind, Generation, GroupId, LogicalNodeId, NodeGroup, NodeTemplate, RunId,
    ShapeError,
};
use provisioning_conformance::battery::{LEVEL1_SEED_BASE, derive_seeds};
use provisioning_conformance::harness::{PROVIDER_KIND, RUN_NAME};
use provisioning_conformance::trace::{Fault, FaultTarget, ShapeChange, StreamEvent, WorkStep};
use provisioning_conformance::{
    BuildError, Defect, FakePlugin, FakeSubstrate, GeneratorConfig, GuaranteeId, Input, Mode,
    Phase, PluginSubstrate, RunOptions, Stepper, Substrate, Trace, cluster_driver, default_shape,
    generate, run_trace,
};

fn template(role: &str, image: &str) -> NodeTemplate {
    NodeTemplate {
        role: role.to_owned(),
        provider: PROVIDER_KIND.to_owned(),
        shape: ProviderShape {
            image: image.to_owned(),
            resources: BTreeMap::from([("cpu".to_owned(), 2.0)]),
            labels: BTreeMap::new(),
        },
        boot: BootParams {
            on_peers_change: String::new(),
            start_command: format!("run-{role}"),
            ..BootParams::default()
        },
        swarm_join: SwarmJoinTemplate {
            swarm: "main".to_owned(),
            labels: BTreeMap::new(),
        },
    }
}

/// An author's own shape: three groups of their own names and templates.
fn three_groups() -> ClusterShape {
    let run = RunId::new(RUN_NAME);
    let group = |name: &str, count: u32, image: &str| NodeGroup {
        id: GroupId::new(name),
        run_id: run.clone(),
        count,
        template: template(name, image),
    };
    ClusterShape {
        run_id: run.clone(),
        generation: Generation::new(7),
        groups: vec![
            group("web", 2, "nginx:1.27"),
            group("db", 1, "postgres:17"),
            group("cache", 3, "redis:8"),
        ],
    }
}

fn node(name: &str) -> LogicalNodeId {
    LogicalNodeId::parse(name).unwrap()
}

/// The substrate's ledger agrees with the driver: at most one live lease
/// and session per key, every live resource belongs to a managed node's
/// current attempt, and every node the driver believes holds a lease has
/// a live one.
fn assert_ledger_matches_state<S: Substrate>(stepper: &Stepper<S>) {
    let live = stepper.live_resources();
    let state = stepper.state();
    for ((id, attempt), count) in live.leases.iter().chain(&live.sessions) {
        assert!(*count <= 1, "{id}/{attempt} is live {count} times");
        let node = state.nodes.get(id);
        assert_eq!(
            node.map(|n| n.attempt),
            Some(*attempt),
            "live {id}/{attempt} is not a current attempt"
        );
    }
    for (id, managed) in &state.nodes {
        if managed.record.lease.is_some() {
            assert_eq!(
                live.leases.get(&(id.clone(), managed.attempt)),
                Some(&1),
                "{id} holds a lease the ledger does not"
            );
        }
    }
}

#[test]
fn a_custom_three_group_shape_converges_step_by_step_with_the_ledger_checked_at_every_step() {
    let shape = three_groups();
    let mut stepper = Stepper::new(FakeSubstrate::new(), shape.clone(), Mode::Adversarial)
        .expect("a valid shape builds");
    assert_eq!(stepper.violation(), None);
    assert_eq!(stepper.desired().generation(), Generation::new(7));
    assert_eq!(stepper.desired().node_count(), 6);
    assert_eq!(stepper.state().nodes.len(), 6, "one node per slot");
    assert!(stepper.live_resources().is_empty(), "no work has run yet");

    let mut steps = 0;
    while !stepper.is_converged() {
        assert!(steps < 40, "no convergence: {:?}", stepper.state());
        let sessions = stepper.live_resources().sessions.len() as u32;
        let inputs: Vec<Input> = std::iter::once(Input::Run(WorkStep::Fifo))
            .chain((0..sessions).map(|session| Input::Stream {
                session,
                event: StreamEvent::Joined,
            }))
            .collect();
        for input in &inputs {
            stepper
                .step(input)
                .expect("an honest backend keeps every guarantee");
            assert_ledger_matches_state(&stepper);
            steps += 1;
        }
    }
    let live = stepper.live_resources();
    assert_eq!(live.leases.len(), 6);
    for id in ["web-0", "web-1", "db-0", "cache-0", "cache-1", "cache-2"] {
        let managed = &stepper.state().nodes[&node(id)];
        assert!(managed.is_ready(), "{id}");
        assert_eq!(managed.spec.template().shape.resources["cpu"], 2.0);
    }
    assert_eq!(stepper.desired_shape().generation, Generation::new(7));
    assert_eq!(
        stepper.desired_shape().groups.len(),
        3,
        "the author's groups, in name order"
    );
    assert!(stepper.vacuity().replacements == 0);
    let outcome = stepper.finish();
    assert_eq!(outcome.violation, None);
}

#[test]
fn a_stepped_run_and_a_whole_trace_run_of_the_same_seed_give_identical_digests() {
    for seed in derive_seeds(LEVEL1_SEED_BASE, 24) {
        let trace = generate(seed, &GeneratorConfig::default());
        for mode in Mode::ALL {
            let whole = run_trace(
                FakeSubstrate::new(),
                &cluster_driver,
                &trace,
                RunOptions::new(mode),
            );
            let mut stepper = Stepper::builder(FakeSubstrate::new())
                .shape(default_shape())
                .header(trace.header.clone())
                .mode(mode)
                .build()
                .unwrap();
            let mut stepped = 0;
            for input in &trace.inputs {
                if stepper.step(input).is_err() {
                    break;
                }
                stepped += 1;
            }
            assert_eq!(stepper.digest().steps, stepped);
            let outcome = stepper.finish();
            assert_eq!(
                outcome.digest,
                whole.digest,
                "seed {seed:#x} {}",
                mode.name()
            );
            assert_eq!(outcome.violation, whole.violation);
            assert_eq!(outcome.vacuity, whole.vacuity);
            assert_eq!(outcome.converged, whole.converged);
            assert_eq!(outcome.converged_shape, whole.converged_shape);
        }
    }
}

#[test]
fn a_stepped_run_is_deterministic_over_the_plugin_substrate_from_a_custom_shape() {
    let trace: Trace = "run fifo; script create-lease ambiguous-done; tick 1500ms; run fifo; \
                        stream @0 joined; tick 40000ms; run fifo; stream @1 joined; run lifo"
        .parse()
        .unwrap();
    let run = || {
        let mut stepper = Stepper::new(
            PluginSubstrate::new(FakePlugin::new()),
            three_groups(),
            Mode::Fair,
        )
        .unwrap();
        stepper.steps(&trace.inputs).expect("no violation");
        let tail = stepper.run_fair_tail();
        assert!(tail.converged, "{}", tail.pending_description);
        assert_eq!(tail.violation, None);
        assert_eq!(tail.desired.groups.len(), 3);
        assert_eq!(stepper.live_resources().leases.len(), 6);
        stepper.finish()
    };
    let (first, second) = (run(), run());
    assert_eq!(first.violation, None);
    assert_eq!(first.digest, second.digest);
    assert!(first.deterministic);
}

#[test]
fn a_hung_create_is_seen_pending_mid_way_and_the_executor_counters_move_with_it() {
    let mut stepper = Stepper::new(FakeSubstrate::new(), default_shape(), Mode::Fair).unwrap();
    stepper
        .step(&Input::Script {
            target: FaultTarget::Kind(EffectKind::CreateLease),
            fault: Fault::Hang,
        })
        .unwrap();
    let report = stepper.step(&Input::Run(WorkStep::Fifo)).unwrap();
    assert_eq!(report.index, 1);
    assert_eq!(report.calls.len(), 2, "both creates started");
    let counters = stepper.executor_counters();
    assert_eq!((counters.started, counters.completed), (2, 1));
    assert_eq!(stepper.substrate_counters().hangs, 1);

    // The hung node's create is pending in the driver's state, with its deadline.
    let hung = report.calls[0].node.clone();
    let pending = stepper.state().nodes[&hung]
        .pending
        .clone()
        .expect("the hung create is pending");
    assert_eq!(pending.kind, EffectKind::CreateLease);
    assert_eq!(
        stepper.live_resources().leases.len(),
        1,
        "the hung one did nothing yet"
    );

    // Past its deadline the operation times out: ambiguous, and remembered.
    stepper.step(&Input::Tick { millis: 31_000 }).unwrap();
    assert!(stepper.now() >= pending.deadline);
    assert!(stepper.vacuity().timeouts >= 1);
    let timed_out = &stepper.state().nodes[&hung];
    assert_ne!(timed_out.pending.as_ref().map(|p| p.id), Some(pending.id));
    assert!(
        timed_out.retry.ambiguous.is_some(),
        "a timeout is ambiguous"
    );

    // Released, the hung call does its work; its late reply is dropped.
    let late_before = stepper.executor_counters().late_dropped;
    stepper.step(&Input::Release).unwrap();
    stepper.step(&Input::Run(WorkStep::Fifo)).unwrap();
    assert!(stepper.executor_counters().late_dropped > late_before);

    let tail = stepper.run_fair_tail();
    assert!(tail.converged, "{}", tail.pending_description);
    assert!(tail.pending.is_empty());
    assert_eq!(
        stepper.substrate_counters().adoptions,
        1,
        "the retry adopted the late lease"
    );
    assert_eq!(stepper.vacuity().adoptions_after_ambiguity, 1);
}

/// A create whose reply is lost, then its retry: an honest backend adopts
/// the lease the lost call made, a defective one makes a second.
fn lost_reply_then_retry() -> Vec<Input> {
    vec![
        Input::Script {
            target: FaultTarget::Kind(EffectKind::CreateLease),
            fault: Fault::AmbiguousDone,
        },
        Input::Run(WorkStep::Fifo),
        Input::Tick { millis: 5_000 },
        Input::Run(WorkStep::Fifo),
        Input::Run(WorkStep::Fifo),
    ]
}

#[test]
fn a_backend_that_creates_twice_is_reported_as_g08_by_the_step_that_does_it() {
    let inputs = lost_reply_then_retry();
    let mut honest =
        Stepper::new(FakeSubstrate::new(), default_shape(), Mode::Adversarial).unwrap();
    honest.steps(&inputs).expect("an honest backend adopts");

    let defective = FakeSubstrate::with_defects([Defect::CreateIgnoresExisting]);
    let mut stepper = Stepper::new(defective, default_shape(), Mode::Adversarial).unwrap();
    let mut failed_at = None;
    for (index, input) in inputs.iter().enumerate() {
        if let Err(violation) = stepper.step(input) {
            failed_at = Some((index, violation));
            break;
        }
    }
    let (index, violation) = failed_at.expect("the double create is caught");
    assert_eq!(violation.guarantee, GuaranteeId::NoDoubleCreate);
    assert_eq!(violation.guarantee.id(), "G08");
    assert_eq!(violation.phase, Phase::Input(index));
    assert!(
        matches!(inputs[index], Input::Run(_)),
        "caught when the work ran"
    );
    assert_eq!(stepper.violation(), Some(&violation));
    assert_eq!(
        stepper.step_count(),
        index,
        "the failing step does not count"
    );
    // The run is over: every later step reports the same violation.
    assert_eq!(
        stepper.step(&Input::Tick { millis: 1 }),
        Err(violation.clone())
    );
    // And the whole-trace run of the same inputs names the same guarantee.
    let whole = run_trace(
        FakeSubstrate::with_defects([Defect::CreateIgnoresExisting]),
        &cluster_driver,
        &Trace::new(inputs),
        RunOptions::new(Mode::Adversarial),
    );
    assert_eq!(whole.violation, Some(violation));
}

#[test]
fn a_backend_that_keeps_destroyed_leases_is_reported_as_g23_in_the_fair_tail_outcome() {
    let defective = FakeSubstrate::with_defects([Defect::DestroyKeepsResource]);
    let mut stepper = Stepper::new(defective, three_groups(), Mode::Fair).unwrap();
    stepper
        .step(&Input::Run(WorkStep::Fifo))
        .expect("nothing is destroyed yet");
    // The kit's shape changes name groups a, b, c: removing `a` is a no-op
    // for this shape, adding it adds a kit group.
    stepper
        .step(&Input::Desire(ShapeChange::Remove {
            group: provisioning_conformance::trace::Group::A,
        }))
        .unwrap();
    assert_eq!(stepper.desired().generation(), Generation::new(7));
    stepper
        .step(&Input::Desire(ShapeChange::Add {
            group: provisioning_conformance::trace::Group::A,
            count: 1,
        }))
        .unwrap();
    assert_eq!(stepper.desired().generation(), Generation::new(8));
    stepper
        .step(&Input::Desire(ShapeChange::Remove {
            group: provisioning_conformance::trace::Group::A,
        }))
        .unwrap();
    let tail = stepper.run_fair_tail();
    let violation = tail.violation.expect("the kept lease is a leak");
    assert_eq!(violation.guarantee, GuaranteeId::ConvergedLeaksNothing);
    // A live resource no current attempt owns and no crashed controller's
    // call made is a leak as soon as the oracle sees it, before convergence.
    assert!(violation.detail.contains("leaked"), "{violation}");
    assert_eq!(tail.desired.generation, Generation::new(9));
    assert_eq!(tail.desired.groups.len(), 3);
    assert_eq!(stepper.violation(), Some(&violation));
}

#[test]
fn an_invalid_initial_shape_is_refused_before_anything_runs() {
    let mut shape = three_groups();
    shape.groups[1].id = GroupId::new("web");
    let error = Stepper::new(FakeSubstrate::new(), shape, Mode::Fair).unwrap_err();
    assert!(
        matches!(
            error,
            BuildError::InvalidShape(ShapeError::DuplicateGroup { .. })
        ),
        "{error}"
    );
}

#[test]
fn the_fair_tail_converges_an_untouched_custom_shape_and_leaves_nothing_pending() {
    let mut stepper =
        Stepper::new(FakeSubstrate::new(), three_groups(), Mode::Adversarial).unwrap();
    let tail = stepper.run_fair_tail();
    assert_eq!(tail.violation, None);
    assert!(tail.converged);
    assert!(!tail.edges_reached);
    assert!(tail.rounds >= 1);
    assert!(tail.pending.is_empty(), "{}", tail.pending_description);
    assert_eq!(tail.new_attempts, 0, "the initial attempts sufficed");
    let mut expected = three_groups();
    expected.groups.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(tail.desired, expected);
    assert_eq!(
        stepper.executor_counters().started,
        stepper.calls().len() as u64
    );
    // Finishing after the tail does not run it again.
    let calls = stepper.calls().len();
    let outcome = stepper.finish();
    assert!(outcome.converged);
    assert_eq!(outcome.digest.calls.len(), calls);
}
