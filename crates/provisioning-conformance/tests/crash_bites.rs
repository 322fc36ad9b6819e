//! Mutation proofs for the durable guarantees: a host or a recovery that is
//! deliberately wrong in one way must be caught by the Level 1 battery with
//! the right guarantee id, and shrunk to a short trace.
//!
//! The mutations live outside the core: the harness host's order and orphan
//! collection are [`HostOptions`], and a broken recovery is a recovery
//! factory wrapped around the real `ClusterDriver::recover`.

#[path = "common/recoveries.rs"]
mod recoveries;

use provisioning_conformance::trace::Input;
use provisioning_conformance::{
    Battery, Failure, FakeSubstrate, GuaranteeId, HostOptions, HostOrder,
};
use recoveries::{allocator_not_restored, drops_pending, readiness_from_the_journal};

/// The longest shrunk trace these tests accept as "short".
const SHORT_TRACE: usize = 12;

/// How many seeds a broken variant may take to be caught.
const SEEDS_TO_CATCH: usize = 128;

fn battery() -> Battery<FakeSubstrate> {
    Battery::level1()
        .seed_count(SEEDS_TO_CATCH)
        .max_failures(1)
        .require_vacuity(false)
        .narrate_failures(false)
}

fn first_failure(battery: Battery<FakeSubstrate>) -> Failure {
    let report = battery.run();
    match report.failures.into_iter().next() {
        Some(failure) => failure,
        None => panic!(
            "the broken variant was not caught in {} traces",
            report.traces
        ),
    }
}

fn check_caught(failure: &Failure, expected: GuaranteeId) {
    eprintln!(
        "caught as {} ({} mode), shrunk from {} to {} inputs:\n{}",
        failure.guarantee(),
        failure.mode.name(),
        failure.original_inputs,
        failure.shrunk.inputs.len(),
        failure.shrunk.to_single_line()
    );
    assert_eq!(
        failure.guarantee(),
        expected,
        "caught as {} instead of {expected}:\n{failure}",
        failure.guarantee()
    );
    assert_eq!(failure.original.guarantee, failure.guarantee());
    assert!(
        failure.shrunk.inputs.len() <= SHORT_TRACE,
        "shrunk only to {} inputs:\n{failure}",
        failure.shrunk.inputs.len()
    );
    assert!(
        failure.shrunk.inputs.contains(&Input::Crash),
        "the shrunk trace needs its crash:\n{failure}"
    );
}

#[test]
fn a_host_that_submits_before_it_commits_is_caught_as_g27() {
    let host = HostOptions {
        order: HostOrder::SubmitThenCommit,
        ..HostOptions::default()
    };
    let failure = first_failure(battery().host(host));
    check_caught(&failure, GuaranteeId::DurableBeforeDispatch);
}

#[test]
fn a_recovery_that_does_not_restore_the_allocator_is_caught_as_g26() {
    let failure = first_failure(battery().recovery(allocator_not_restored));
    check_caught(&failure, GuaranteeId::CrashSafety);
    assert!(failure.violation.detail.contains("G01 broken"), "{failure}");
}

#[test]
fn a_recovery_that_drops_pending_operations_is_caught_as_g26() {
    let failure = first_failure(battery().recovery(drops_pending));
    check_caught(&failure, GuaranteeId::CrashSafety);
    assert!(
        failure
            .violation
            .detail
            .contains("instead of making it ambiguous"),
        "{failure}"
    );
}

#[test]
fn a_recovery_that_takes_readiness_from_the_journal_is_caught_as_g37() {
    let failure = first_failure(battery().recovery(readiness_from_the_journal));
    check_caught(&failure, GuaranteeId::ReadinessReEarned);
    assert!(
        failure
            .violation
            .detail
            .contains("no re-join of its agent was folded"),
        "{failure}"
    );
}

#[test]
fn a_host_that_never_collects_orphans_is_caught_as_g28() {
    let host = HostOptions {
        collect_orphans: false,
        ..HostOptions::default()
    };
    let failure = first_failure(battery().host(host));
    check_caught(&failure, GuaranteeId::OrphansCollected);
}

#[test]
fn the_correct_host_and_recovery_pass_the_same_seeds() {
    let report = battery().run();
    assert!(report.passed(), "{report}");
    assert!(report.vacuity.crashes > 0, "{report}");
}
