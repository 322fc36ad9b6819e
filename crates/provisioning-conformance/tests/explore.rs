//! G31: the exhaustive explorer passes the correct stack at CI depth and
//! finds the kit's mutations with shortest counterexamples.

use provisioning_conformance::{
    Defect, ExploreConfig, Explorer, FakeSubstrate, GuaranteeId, HostOptions, HostOrder, Trace,
};

#[test]
fn one_node_every_interleaving_to_depth_five_keeps_safety_and_liveness() {
    let report = Explorer::new(FakeSubstrate::new).run(&ExploreConfig::new(1, 5));
    eprintln!("{report}");
    assert!(report.passed(), "{report}");
    assert_eq!(report.depth_reached, 5);
    assert!(report.distinct_states > 20, "{report}");
}

#[test]
fn two_nodes_every_interleaving_to_depth_four_keeps_safety_and_liveness() {
    let report = Explorer::new(FakeSubstrate::new).run(&ExploreConfig::new(2, 4));
    eprintln!("{report}");
    assert!(report.passed(), "{report}");
    assert_eq!(report.depth_reached, 4);
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
