//! G31: the exhaustive explorer passes the correct stack at CI depth and
//! finds the kit's mutations with shortest counterexamples: a backend that
//! creates anew (G08) or keeps what it destroyed (G23), a host that submits
//! before it commits (G27), recoveries that forget the allocator or the
//! pending operations (G26). It also shows that states differing only in
//! the executor's ledger are kept apart. The orphan mutation (G28, a host
//! that never collects orphans) is beyond CI depth: the battery finds it
//! only with the fair tail completing work newest-first, after a hung
//! create, a crash and a definite retry (9 inputs shrunk, two nodes); the
//! explorer's newest-first tail (`ExploreConfig::lifo_tail`) does not reach
//! it at depth 4 for one or two nodes, nor at depth 5 (BENCHMARKS.md §8).
//! It stays with the Level 1 battery (tests/crash_bites.rs).

use std::rc::Rc;

#[path = "common/recoveries.rs"]
mod recoveries;

use provisioning::durable::RecoveryError;
use provisioning::{DurableState, Timestamp};
use provisioning_conformance::explore::{BackendMirror, fingerprint, setup_prefix};
use provisioning_conformance::journal::{Recovered, RecoveryFactory};
use provisioning_conformance::{
    Defect, DriverSetup, ExploreConfig, Explorer, FakeSubstrate, GuaranteeId, HostOptions,
    HostOrder, Input, Mode, Stepper, Substrate, Trace,
};
use recoveries::{allocator_not_restored, drops_pending};

/// CI depths: the whole alphabet (executor-level and limit inputs included)
/// with the executor's ledger and the waiting scripted replies in the
/// fingerprint. Deeper runs are BENCHMARKS.md §8's.
const ONE_NODE_DEPTH: usize = 4;
const TWO_NODE_DEPTH: usize = 3;

#[test]
fn one_node_every_interleaving_to_ci_depth_keeps_safety_and_liveness() {
    let report = Explorer::new(FakeSubstrate::new).run(&ExploreConfig::new(1, ONE_NODE_DEPTH));
    eprintln!("{report}");
    assert!(report.passed(), "{report}");
    assert_eq!(report.depth_reached, ONE_NODE_DEPTH);
    assert!(report.distinct_states > 1_000, "{report}");
    assert_eq!(report.unmirrored, 0, "{report}");
}

#[test]
fn two_nodes_every_interleaving_to_ci_depth_keeps_safety_and_liveness() {
    let report = Explorer::new(FakeSubstrate::new).run(&ExploreConfig::new(2, TWO_NODE_DEPTH));
    eprintln!("{report}");
    assert!(report.passed(), "{report}");
    assert_eq!(report.depth_reached, TWO_NODE_DEPTH);
    assert_eq!(report.unmirrored, 0, "{report}");
}

fn caught(
    explorer_report: provisioning_conformance::ExploreReport,
) -> provisioning_conformance::Counterexample {
    eprintln!("{explorer_report}");
    let found = explorer_report.counterexample.expect("mutation not found");
    // The counterexample's text form parses back to the same trace.
    let line = found.trace.to_single_line();
    assert_eq!(line.parse::<Trace>().as_ref(), Ok(&found.trace));
    found
}

#[test]
fn a_backend_that_creates_anew_is_found_as_g08_shortest() {
    let explorer = Explorer::new(|| FakeSubstrate::with_defects([Defect::CreateIgnoresExisting]));
    let found = caught(explorer.run(&ExploreConfig::new(1, 3)));
    assert_eq!(found.guarantee(), GuaranteeId::NoDoubleCreate);
    assert_eq!(found.length, 1, "{found}");
    assert!(found.liveness);
}

#[test]
fn a_backend_that_keeps_destroyed_resources_is_found_as_g23_shortest() {
    let explorer = Explorer::new(|| FakeSubstrate::with_defects([Defect::DestroyKeepsResource]));
    let found = caught(explorer.run(&ExploreConfig::new(1, 3)));
    assert_eq!(found.guarantee(), GuaranteeId::ConvergedLeaksNothing);
    // The one-node setup prefix scales the kit's two nodes down to one,
    // which already leaks: the empty continuation is the shortest.
    assert_eq!(found.length, 0, "{found}");
}

#[test]
fn a_host_that_submits_before_it_commits_is_found_as_g27_shortest() {
    let host = HostOptions {
        order: HostOrder::SubmitThenCommit,
        ..HostOptions::default()
    };
    let explorer = Explorer::new(FakeSubstrate::new).host(host);
    let found = caught(explorer.run(&ExploreConfig::new(2, 3)));
    assert_eq!(found.guarantee(), GuaranteeId::DurableBeforeDispatch);
    // `crash; run fifo`: the crash fires between submit and commit.
    assert_eq!(found.length, 2, "{found}");
}

/// Deep enough for two paths to reach one state with different ids.
const MERGE_DEPTH: usize = 3;

#[test]
fn states_equal_up_to_renamed_ids_merge() {
    let explorer = Explorer::new(FakeSubstrate::new);
    let merged = explorer.run(&ExploreConfig {
        liveness: false,
        ..ExploreConfig::new(2, MERGE_DEPTH)
    });
    let raw = explorer.run(&ExploreConfig {
        normalise_ids: false,
        liveness: false,
        ..ExploreConfig::new(2, MERGE_DEPTH)
    });
    eprintln!("normalised: {merged}raw: {raw}");
    assert!(merged.passed() && raw.passed());
    assert!(
        merged.distinct_states < raw.distinct_states,
        "renaming ids merged nothing: {} vs {}",
        merged.distinct_states,
        raw.distinct_states
    );
}

fn recovery(
    broken: fn(&DriverSetup, DurableState, Timestamp) -> Result<Recovered, RecoveryError>,
) -> Rc<RecoveryFactory> {
    Rc::new(broken)
}

#[test]
fn a_recovery_that_does_not_restore_the_allocator_is_found_as_g26_shortest() {
    let explorer = Explorer::new(FakeSubstrate::new).recovery(recovery(allocator_not_restored));
    let found = caught(explorer.run(&ExploreConfig::new(1, 4)));
    assert_eq!(found.guarantee(), GuaranteeId::CrashSafety);
    assert!(found.violation.detail.contains("G01"), "{found}");
    assert_eq!(found.length, ALLOCATOR_LENGTH, "{found}");
}

/// `crash`: the fair tail's first wake fires it while the first create is
/// pending; the recovered driver's allocator then sits below that attempt.
const ALLOCATOR_LENGTH: usize = 1;

#[test]
fn a_recovery_that_drops_pending_operations_is_found_as_g26_shortest() {
    let explorer = Explorer::new(FakeSubstrate::new).recovery(recovery(drops_pending));
    let found = caught(explorer.run(&ExploreConfig::new(1, 3)));
    assert_eq!(found.guarantee(), GuaranteeId::CrashSafety);
    assert_eq!(found.length, DROPS_PENDING_LENGTH, "{found}");
}

/// `crash`: the fair tail's first wake fires it while the first create is
/// pending, and the recovery forgets it.
const DROPS_PENDING_LENGTH: usize = 1;

fn replayed(inputs: &str) -> (Stepper<FakeSubstrate>, Vec<Input>) {
    let mut path = setup_prefix(1);
    path.extend(inputs.parse::<Trace>().expect("a trace").inputs);
    replayed_path(path)
}

fn replayed_path(path: Vec<Input>) -> (Stepper<FakeSubstrate>, Vec<Input>) {
    let mut stepper = Stepper::builder(FakeSubstrate::new())
        .mode(Mode::Adversarial)
        .build()
        .expect("a stepper");
    stepper.steps(&path).expect("no violation");
    (stepper, path)
}

/// What the fingerprint held before the executor's ledger was added to it.
fn observed(stepper: &Stepper<FakeSubstrate>) -> String {
    provisioning_conformance::explore::normalise_ids(&format!(
        "{:?}|{:?}|{}|{:?}|{:?}|{}",
        stepper.state(),
        stepper.desired_shape(),
        stepper.now().as_millis(),
        stepper.requeue_at(),
        stepper.live_resources(),
        stepper.substrate().describe_work(),
    ))
}

#[test]
fn states_that_differ_only_in_the_executor_ledger_are_kept_apart() {
    // Both creates time out at the driver, then run: the driver folded the
    // same timeouts and the backend holds the same leases (ambiguous-done
    // does the work), but the executor recorded different late outcomes —
    // which a resubmission of the operation replays.
    let (plain, plain_path) = replayed("tick 30000ms; run fifo");
    let (lost, lost_path) = replayed("script any ambiguous-done; tick 30000ms; run fifo");
    assert_eq!(observed(&plain), observed(&lost));
    let mirror = BackendMirror::default();
    assert_ne!(
        fingerprint(&plain, &mirror, &plain_path, true),
        fingerprint(&lost, &mirror, &lost_path, true),
        "the executor ledgers differ:\n{}\n{}",
        plain.host_ledger(2),
        lost.host_ledger(2)
    );
    // And the difference is behaviour: resubmitting the timed-out create
    // delivers a different replayed result.
    // (`resubmit 1`: the most recent operation is the other node's create.)
    let mut delivered = Vec::new();
    for (stepper, path) in [(plain, plain_path), (lost, lost_path)] {
        drop(stepper);
        let (mut stepper, _) = replayed_path(path);
        stepper
            .step(&Input::Resubmit { back: 1 })
            .expect("no violation");
        let ledger = stepper.host_ledger(1);
        // The last field: the most recent delivery.
        let latest = ledger.rsplit_once("|[").map(|(_, last)| last.to_owned());
        delivered.push(latest.expect("the deliveries field"));
    }
    eprintln!("replayed: {delivered:?}");
    assert_ne!(delivered[0], delivered[1]);
}
