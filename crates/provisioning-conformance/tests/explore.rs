//! G31: the exhaustive explorer passes the correct stack at CI depth, from
//! every start configuration it uses, and finds every mutation of the kit
//! it can express with a shortest counterexample — the guarantee id and the
//! length asserted per mutation, the counterexample replayed as `conformance
//! replay` replays a regression file (it must fail with the same id under
//! the mutation and pass under the correct stack). It also shows that
//! states differing only in the executor's ledger are kept apart, and that
//! states equal up to renamed ids merge.
//!
//! The mutations: the driver flaws of `common/flaws.rs` (also the battery's,
//! `oracle_bites.rs`), the fake backend's defects, the broken hosts
//! (submit before commit, no orphan collection) and recoveries of
//! `crash_bites.rs`. Not here: the substrate that is not reproducible (G18,
//! `oracle_bites.rs`) — the explorer replays every state and assumes a
//! deterministic substrate, which the battery checks.

use std::rc::Rc;

#[path = "common/flaws.rs"]
mod flaws;
#[path = "common/recoveries.rs"]
mod recoveries;

use flaws::{Flaw, broken};
use provisioning::durable::RecoveryError;
use provisioning::{DurableState, Timestamp};
use provisioning_conformance::explore::{BackendMirror, Start, fingerprint, setup_prefix};
use provisioning_conformance::journal::Recovered;
use provisioning_conformance::trace::{Group, LimitChange, TraceHeader};
use provisioning_conformance::{
    Battery, Counterexample, Defect, DriverSetup, ExploreConfig, ExploreReport, Explorer,
    FakeSubstrate, HostOptions, HostOrder, Input, Mode, Stepper, Substrate, Trace,
};
use recoveries::{allocator_not_restored, drops_pending};

/// CI depths: the whole alphabet (executor-level and limit inputs included)
/// with the executor's ledger and the waiting scripted replies in the
/// fingerprint, and the revision probes at every state. Deeper runs are
/// BENCHMARKS.md §8's.
const ONE_NODE_DEPTH: usize = 4;
const TWO_NODE_DEPTH: usize = 3;

/// The depth at which the correct stack is explored from each of the other
/// start configurations in CI (BENCHMARKS.md §8 goes to 3).
const START_DEPTH: usize = 2;

fn passes(report: &ExploreReport, depth: usize) {
    eprintln!("{report}");
    assert!(report.passed(), "{report}");
    assert_eq!(report.depth_reached, depth, "{report}");
    assert!(!report.truncated, "{report}");
    assert_eq!(report.unmirrored, 0, "{report}");
}

#[test]
fn one_node_every_interleaving_to_ci_depth_keeps_safety_and_liveness() {
    let report = Explorer::new(FakeSubstrate::new).run(&ExploreConfig::new(1, ONE_NODE_DEPTH));
    passes(&report, ONE_NODE_DEPTH);
    assert!(report.distinct_states > 1_000, "{report}");
}

#[test]
fn two_nodes_every_interleaving_to_ci_depth_keeps_safety_and_liveness() {
    let report = Explorer::new(FakeSubstrate::new).run(&ExploreConfig::new(2, TWO_NODE_DEPTH));
    passes(&report, TWO_NODE_DEPTH);
}

/// A launch cap of one for the kit's provider.
const CAP: LimitChange = LimitChange::Cap { count: 1 };
/// A rollout budget of one node for group `a`.
const BUDGET: LimitChange = LimitChange::Budget {
    group: Group::A,
    count: 1,
};
/// A breaker on group `a` that opens after one failure (five seconds).
const BREAKER: LimitChange = provisioning_conformance::explore::EXPLORED_BREAKER;

fn header(interleave: bool, late_close: bool) -> TraceHeader {
    TraceHeader {
        interleave,
        late_close,
        ..TraceHeader::default()
    }
}

/// The start configurations the mutations below need, other than the
/// plain fresh one, each explored with the correct stack: none may fail.
fn start_configurations() -> Vec<(&'static str, ExploreConfig)> {
    let ready = |nodes| ExploreConfig::new(nodes, START_DEPTH).starting(Start::Ready);
    vec![
        (
            "1 node, ready, cap + budget + breaker",
            ready(1).limit(CAP).limit(BUDGET).limit(BREAKER),
        ),
        (
            "2 nodes, ready, cap + budget + breaker",
            ready(2).limit(CAP).limit(BUDGET).limit(BREAKER),
        ),
        ("1 node, ready", ready(1)),
        (
            "2 nodes, fresh, cap (creates in flight over a lowered cap)",
            ExploreConfig::new(2, START_DEPTH).limit(CAP),
        ),
        (
            "1 node, held create and crash, newest-first tail too",
            ExploreConfig {
                lifo_tail: true,
                ..ExploreConfig::new(1, START_DEPTH).starting(Start::HeldCreateCrash)
            },
        ),
        (
            "1 node, late-close",
            ExploreConfig {
                header: header(false, true),
                ..ExploreConfig::new(1, START_DEPTH)
            },
        ),
        (
            "1 node, interleave",
            ExploreConfig {
                header: header(true, false),
                ..ExploreConfig::new(1, START_DEPTH)
            },
        ),
    ]
}

#[test]
fn the_correct_stack_passes_from_every_start_configuration() {
    for (name, config) in start_configurations() {
        eprintln!("{name}:");
        let report = Explorer::new(FakeSubstrate::new).run(&config);
        passes(&report, config.depth);
    }
}

#[test]
fn the_ready_start_is_converged() {
    for nodes in [1, 2] {
        let config = ExploreConfig::new(nodes, 0).starting(Start::Ready);
        let mut stepper = Stepper::builder(FakeSubstrate::new())
            .mode(Mode::Adversarial)
            .build()
            .expect("a stepper");
        stepper.steps(&config.setup()).expect("no violation");
        assert!(stepper.is_converged(), "{nodes} node(s): not converged");
        assert_eq!(stepper.live_resources().leases.len(), nodes as usize);
    }
}

type Recovery = fn(&DriverSetup, DurableState, Timestamp) -> Result<Recovered, RecoveryError>;

/// One of the kit's mutations.
#[derive(Clone, Copy, Debug)]
enum Mutation {
    /// A driver flaw (`common/flaws.rs`).
    Driver(Flaw),
    /// A defect of the fake backend.
    Backend(Defect),
    /// A broken host.
    Host(HostOptions),
    /// A broken recovery (`common/recoveries.rs`).
    Recovery(&'static str, Recovery),
}

type Factory = Box<dyn Fn() -> FakeSubstrate>;

impl Mutation {
    /// The mutation's name in reports.
    fn label(self) -> String {
        match self {
            Mutation::Recovery(name, _) => format!("recovery: {name}"),
            other => format!("{other:?}"),
        }
    }

    fn substrate(self) -> Factory {
        match self {
            Mutation::Backend(defect) => Box::new(move || FakeSubstrate::with_defects([defect])),
            _ => Box::new(FakeSubstrate::new),
        }
    }

    fn explorer(self) -> Explorer<Factory> {
        let explorer = Explorer::new(self.substrate());
        match self {
            Mutation::Driver(flaw) => explorer.driver(broken(flaw)),
            Mutation::Backend(_) => explorer,
            Mutation::Host(host) => explorer.host(host),
            Mutation::Recovery(_, recovery) => explorer.recovery(Rc::new(recovery)),
        }
    }

    /// A battery that replays regressions only, as `conformance replay`
    /// does, under this mutation (or, with `correct`, without it).
    fn battery(self, correct: bool) -> Battery<FakeSubstrate> {
        let battery = if correct {
            Battery::new("correct", FakeSubstrate::new)
        } else {
            let battery = Battery::new(self.label(), self.substrate());
            match self {
                Mutation::Driver(flaw) => battery.driver(broken(flaw)),
                Mutation::Backend(_) => battery,
                Mutation::Host(host) => battery.host(host),
                Mutation::Recovery(_, recovery) => battery.recovery(recovery),
            }
        };
        battery
            .seeds([])
            .require_vacuity(false)
            .narrate_failures(false)
            .max_failures(1)
            .shrink_budget(0)
    }
}

/// Checks that `found` replays as a regression entry: the mutation fails it
/// with the same guarantee, the correct stack passes it.
fn replays(mutation: Mutation, found: &Counterexample) {
    let entry = found.to_regression().to_entry();
    let parsed = provisioning_conformance::Regression::parse_file(&entry).expect("an entry");
    assert_eq!(parsed.len(), 1, "{entry}");
    assert_eq!(parsed[0].trace, found.trace, "{entry}");
    let broken = mutation.battery(false).regressions(parsed.clone()).run();
    let failure = broken.failures.first();
    assert_eq!(
        failure.map(|f| f.guarantee()),
        Some(found.guarantee()),
        "{}: the regression entry does not fail as found:\n{entry}\n{broken}",
        mutation.label()
    );
    let correct = mutation.battery(true).regressions(parsed).run();
    assert!(
        correct.passed(),
        "{}: the correct stack fails the counterexample too:\n{entry}\n{correct}",
        mutation.label()
    );
}

/// Every mutation of the kit the explorer can express, with the
/// configuration it is explored under, the guarantee it must be found as
/// and the length of the shortest counterexample (inputs after the setup
/// prefix). The depth is one more than the length, so that a longer
/// counterexample than expected fails the test as not found.
fn mutations() -> Vec<(Mutation, ExploreConfig, &'static str, usize)> {
    let fresh = |nodes, length: usize| ExploreConfig::new(nodes, length + 1);
    let ready = |nodes, length: usize| fresh(nodes, length).starting(Start::Ready);
    let driver = |flaw, length, id| (Mutation::Driver(flaw), fresh(1, length), id, length);
    vec![
        driver(Flaw::DispatchesUnrecorded, 0, "G04"),
        driver(Flaw::AlwaysRequeues, 0, "G19"),
        driver(Flaw::SwallowsLookups, 0, "G21"),
        driver(Flaw::IgnoresScaleDown, 0, "G17"),
        driver(Flaw::StageIgnoresLease, 0, "G32"),
        driver(Flaw::IgnoresBackoff, 1, "G09"),
        driver(Flaw::TimesOutEarly, 1, "G25"),
        driver(Flaw::TimesOutLate, 1, "G25"),
        driver(Flaw::ForgetsAmbiguity, 1, "G12"),
        driver(Flaw::RestartReusesAttempt, 1, "G01"),
        driver(Flaw::RestartResetsFailures, 2, "G09"),
        driver(Flaw::DeletionKeepsBackoff, 3, "G10"),
        driver(Flaw::TrustsWrongAnswers, 2, "G12"),
        // `revision regress` at the root (a probe, applied at every state).
        driver(Flaw::AcceptsRegressions, 1, "G16"),
        // A second convergence report: the fair tail from the root, once
        // passes can run between the report and the session's close.
        (
            Mutation::Driver(Flaw::ForgetsConvergenceReport),
            ExploreConfig {
                header: header(false, true),
                ..fresh(1, 0)
            },
            "G15",
            0,
        ),
        (
            Mutation::Driver(Flaw::ForgetsConvergenceReport),
            ExploreConfig {
                header: header(true, false),
                ..fresh(1, 0)
            },
            "G15",
            0,
        ),
        // `desire drift a image`: both ready nodes replaced at once, then
        // two creates in flight (cap) or two nodes down (budget).
        (
            Mutation::Driver(Flaw::IgnoresCap),
            ready(2, 1).limit(CAP),
            "G29",
            1,
        ),
        (
            Mutation::Driver(Flaw::IgnoresBudget),
            ready(2, 1).limit(BUDGET),
            "G29",
            1,
        ),
        // `lose @0 agent`: the failure opens the breaker, which never
        // lets its probe through.
        (
            Mutation::Driver(Flaw::NeverHalfOpens),
            ready(1, 1).limit(BREAKER),
            "G30",
            1,
        ),
        // `lose @0 agent`: the failure opens the breaker, and the restart
        // goes out at once, inside the cool-down.
        (
            Mutation::Driver(Flaw::ProbesEarly),
            ready(1, 1).limit(BREAKER),
            "G30",
            1,
        ),
        // `lose @0 agent`: one failure, which opens the kit's breaker and
        // not the driver's.
        (
            Mutation::Driver(Flaw::OpensLate),
            ready(1, 1).limit(BREAKER),
            "G30",
            1,
        ),
        // `desire drift a image; run fifo; redeliver 0`: the replaced
        // attempt's destroy result, delivered again while the replacement's
        // create is pending.
        (
            Mutation::Driver(Flaw::FoldsSupersededResults),
            ready(1, 3),
            "G02",
            3,
        ),
        (
            Mutation::Backend(Defect::CreateIgnoresExisting),
            fresh(1, 1),
            "G08",
            1,
        ),
        // The one-node setup prefix scales the kit's two nodes down to one,
        // which already leaks: the empty continuation is the shortest.
        (
            Mutation::Backend(Defect::DestroyKeepsResource),
            fresh(1, 0),
            "G23",
            0,
        ),
        // `crash; run fifo`: the crash fires between submit and commit.
        (
            Mutation::Host(HostOptions {
                order: HostOrder::SubmitThenCommit,
                ..HostOptions::default()
            }),
            fresh(2, 2),
            "G27",
            2,
        ),
        // `tick 1000ms; desire scale a 0; run fifo`: the recovered driver
        // adopts the held create's lease and destroys it; the fair tail,
        // completing work newest-first, releases the dead controller's
        // create after that destroy, and nobody collects what it made.
        (
            Mutation::Host(HostOptions {
                collect_orphans: false,
                ..HostOptions::default()
            }),
            ExploreConfig {
                lifo_tail: true,
                ..fresh(1, 3).starting(Start::HeldCreateCrash)
            },
            "G28",
            3,
        ),
        // `crash`: the fair tail's first wake fires it while the first
        // create is pending; the recovered driver's allocator then sits
        // below that attempt (G01 under G26) / the recovery forgets it.
        (
            Mutation::Recovery("allocator not restored", allocator_not_restored),
            fresh(1, 1),
            "G26",
            1,
        ),
        (
            Mutation::Recovery("drops pending", drops_pending),
            fresh(1, 1),
            "G26",
            1,
        ),
    ]
}

#[test]
fn every_mutation_is_found_with_its_id_at_its_shortest_length_and_replays() {
    for (mutation, config, id, length) in mutations() {
        let report = mutation.explorer().run(&config);
        let Some(found) = report.counterexample.clone() else {
            panic!(
                "the explorer missed {} ({config:?}): {report}",
                mutation.label()
            );
        };
        let label = mutation.label();
        eprintln!("{label}: {found}");
        assert_eq!(found.guarantee().id(), id, "{label}: {found}");
        assert_eq!(found.length, length, "{label}: {found}");
        assert_eq!(
            found.trace.inputs.len(),
            config.setup().len() + length,
            "{found}"
        );
        // The single-line form parses back to the same trace.
        let line = found.trace.to_single_line();
        assert_eq!(line.parse::<Trace>().as_ref(), Ok(&found.trace));
        replays(mutation, &found);
    }
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
