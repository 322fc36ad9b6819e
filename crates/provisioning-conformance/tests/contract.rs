//! The seam contract suite against `FakePlugin`: the honest plugin keeps
//! every contract with none skipped, and each deliberately broken variant is
//! caught by the contract it breaks, with a message that says what went wrong.

use std::convert::Infallible;
use std::sync::Arc;

use provisioning::RunId;
use provisioning_conformance::contract::{
    Contract, ContractReport, ContractSubject, ContractVerdict, complete_without_runtime,
    run_contract_suite,
};
use provisioning_conformance::plugin_fake::{CONTRACT_RUN, FakePlugin, PluginDefect};

/// Runs the suite against fresh plugins with `defects`.
fn suite(defects: &[PluginDefect]) -> ContractReport {
    let defects = defects.to_vec();
    let run = run_contract_suite(move || {
        let plugin = FakePlugin::with_defects(defects.clone());
        async move { Ok::<_, Infallible>(plugin.contract_subject()) }
    });
    match complete_without_runtime(run) {
        Some(report) => report,
        None => panic!("the suite waited on an in-memory plugin that never waits"),
    }
}

/// Checks that `contract` failed with a message containing every fragment.
fn check_caught(report: &ContractReport, contract: Contract, fragments: &[&str]) {
    eprintln!("{report}");
    match report.verdict(contract) {
        Some(ContractVerdict::Failed(why)) => {
            for fragment in fragments {
                assert!(
                    why.contains(fragment),
                    "{contract} failed, but the message lacks {fragment:?}: {why}"
                );
            }
        }
        other => panic!("{contract} was not caught ({other:?}):\n{report}"),
    }
    let shown = report.to_string();
    assert!(
        shown.contains(&format!("FAIL  {contract}")),
        "the report names the failed contract:\n{shown}"
    );
}

#[test]
fn an_honest_fake_plugin_keeps_every_contract_and_skips_none() {
    let report = suite(&[]);
    eprintln!("{report}");
    report.assert_passed();
    assert!(report.skipped().is_empty(), "{report}");
    assert_eq!(report.passed(), Contract::ALL);
    assert_eq!(report.kind, "fake");
}

#[test]
fn a_plugin_that_creates_on_every_call_is_caught_as_create_twice_adopts() {
    let report = suite(&[PluginDefect::CreateIgnoresExisting]);
    check_caught(
        &report,
        Contract::CreateTwiceAdopts,
        &["second create_node", "did not adopt"],
    );
    check_caught(
        &report,
        Contract::AmbiguousFaultRetryAdopts,
        &["instead of adopting"],
    );
}

#[test]
fn a_plugin_whose_destroy_keeps_the_node_is_caught_as_list_is_exact_and_teardown() {
    let report = suite(&[PluginDefect::DestroyKeepsResource]);
    check_caught(
        &report,
        Contract::TeardownLeavesNothing,
        &["list_nodes still shows"],
    );
    check_caught(
        &report,
        Contract::ListIsExact,
        &["after destroying one of three nodes"],
    );
    check_caught(
        &report,
        Contract::CleanupOfAbsentSucceeds,
        &["after destroying the node"],
    );
}

#[test]
fn a_plugin_that_fails_definitely_after_acting_is_caught_as_definite_fault_creates_nothing() {
    let report = suite(&[PluginDefect::DefiniteAfterWork]);
    check_caught(
        &report,
        Contract::DefiniteFaultCreatesNothing,
        &["failed definitely", "must leave nothing behind"],
    );
}

#[test]
fn a_plugin_that_reports_losses_under_the_wrong_attempt_is_caught_as_superseded_facts_dropped() {
    let report = suite(&[PluginDefect::LossReportedUnderLatestAttempt]);
    check_caught(
        &report,
        Contract::SupersededFactsDropped,
        &["superseded", "reached the driver"],
    );
}

#[test]
fn a_plugin_that_loses_nodes_silently_is_caught_as_superseded_facts_dropped() {
    let report = suite(&[PluginDefect::LossNotReported]);
    check_caught(
        &report,
        Contract::SupersededFactsDropped,
        &["was lost", "reported nothing"],
    );
}

#[test]
fn a_plugin_whose_cleanup_of_absent_things_fails_is_caught_as_cleanup_of_absent_succeeds() {
    let report = suite(&[PluginDefect::CleanupOfAbsentFails]);
    check_caught(
        &report,
        Contract::CleanupOfAbsentSucceeds,
        &["never existed", "Definite"],
    );
}

#[test]
fn contracts_that_need_faults_are_skipped_with_a_reason_without_a_hook() {
    let run = run_contract_suite(|| async {
        let plugin: Arc<FakePlugin> = Arc::new(FakePlugin::new());
        Ok::<_, Infallible>(ContractSubject::new(plugin, RunId::new(CONTRACT_RUN)))
    });
    let report = complete_without_runtime(run).unwrap_or_else(|| panic!("the fake never waits"));
    eprintln!("{report}");
    report.assert_passed();
    let skipped: Vec<Contract> = report.skipped().iter().map(|(c, _)| *c).collect();
    assert_eq!(
        skipped,
        [
            Contract::DefiniteFaultCreatesNothing,
            Contract::DefiniteFaultAdoptsExisting,
            Contract::AmbiguousFaultRetryAdopts,
            Contract::CleanupFaultsRetry,
            Contract::SupersededFactsDropped,
        ]
    );
    for (contract, why) in report.skipped() {
        assert!(why.contains("ContractFaults"), "{contract}: {why}");
    }
    assert!(
        report
            .to_string()
            .contains("skip  superseded-facts-dropped")
    );
}

#[test]
fn a_failing_factory_fails_every_contract_with_its_message() {
    let run = run_contract_suite(|| async { Err::<ContractSubject, _>("no credentials") });
    let report = complete_without_runtime(run).unwrap_or_else(|| panic!("nothing waits"));
    assert_eq!(report.failed().len(), Contract::ALL.len());
    for (_, why) in report.failed() {
        assert_eq!(why, "the factory failed: no credentials");
    }
    assert!(!report.is_success());
}
