//! Level 3 of the conformance kit: the battery — 16 seeds × both modes,
//! plus a few written traces that reach every operating-system fault on
//! purpose — against the real `ProcessPlugin` behind the real
//! `PluginBackendAdapter`. Faults are real events: `SIGKILL` of node
//! processes, `SIGSTOP` so that a bootstrap start hangs past its deadline
//! (`SIGCONT` on release), a missing agent program, failing verify
//! commands, a create held like a slow provider call. "No double-create"
//! (G08) and "converged leaks nothing" (G23) are checked against the
//! processes `/proc` shows, and no process of any run survives the test,
//! passing or failing.
//!
//! Crashes: the agents are processes of their own, so the substrate
//! survives a controller crash. A `crash` input drops the harness's driver
//! and executor and recovers them from a real SQLite journal (one file per
//! run, in a temporary directory); orphans — agents a crashed controller's
//! slow create started after recovery moved on — are found in `/proc`,
//! destroyed through the plugin's own `destroy_node` after their grace, and
//! G26–G28 hold over real processes.
//!
//! Reproduce one case with the line a failure prints, for example
//! `PROVISIONING_SEED=0x… PROVISIONING_MODE=fair cargo test -p
//! provisioning-process --test level3`, or `PROVISIONING_TRACE='…'`.
//! Operating-system timing is not reproducible, so G18 and G20 are checked
//! at Levels 1 and 2 only.

mod common;
#[path = "level3/mod.rs"]
mod level3;

use std::sync::Arc;
use std::time::{Duration, Instant};

use level3::{Defect, Level3, ProcessSubstrate, ProcessWorld, RUN_GONE_WAIT_MAX, contract_subject};
use provisioning_agent::os;
use provisioning_conformance::contract::run_contract_suite;
use provisioning_conformance::level3::{
    FaultCounts, Level3Battery, RunsGuard, assert_clean_run, assert_leak_caught, describe,
    temp_sqlite_journal,
};

/// The base from which Level 3 derives its seeds.
const LEVEL3_SEED_BASE: u64 = 0x1E7E_3000_C0DE_0003;

/// Seeds per mode.
const LEVEL3_SEED_COUNT: usize = 16;

/// Evaluations spent shrinking a failure: each one starts real processes.
const LEVEL3_SHRINK_BUDGET: usize = 24;

/// A safety bound on the whole seam contract suite (real processes).
const CONTRACT_SUITE_WAIT_MAX: Duration = Duration::from_secs(120);

/// Two nodes come up; one is scaled away, so its lease is destroyed.
const SCALE_DOWN_TRACE: &str = "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; \
     run fifo; desire scale a 1; run fifo; run fifo";

/// Written traces that reach each operating-system fault on purpose; the
/// generated seeds then mix them at random.
const WRITTEN_TRACES: [&str; 7] = [
    // A start hangs on a stopped agent past its deadline; the node is then
    // scaled away, so the start is re-issued before any cleanup: it waits
    // behind the hung call and adopts the session once SIGCONT lets the
    // first one go on.
    "run fifo; run fifo; script start-bootstrap hang; run fifo; tick 30000ms; desire scale a 0; \
     tick 2000ms; run fifo; release; run fifo; run fifo; desire scale a 2; run fifo; run fifo; \
     run fifo; stream @0 joined; stream @1 joined; run fifo",
    // A start hangs on a stopped agent and stays hung to the end of the
    // trace: the fair tail continues the agent (SIGCONT) and converges.
    "run fifo; run fifo; script any hang; run fifo; tick 30000ms; tick 2000ms; run fifo; \
     desire scale a 3; run fifo",
    // A create is polled once (the agent is spawned) and left in flight past
    // its deadline; the retry waits behind it and adopts the agent.
    "run one 0; tick 30000ms; tick 2000ms; run fifo; run fifo; run fifo",
    // A held agent is really not ready; a verify command fails; a workload
    // cannot start; a spawn fails for want of the agent program; a lookup
    // meets a killed node.
    "script lookup-endpoint not-ready; run fifo; run fifo; tick 1000ms; run fifo; run fifo; \
     stream @0 failed boot-check-failed; stream @1 failed start-failed; run fifo; \
     script create-lease definite; script lookup-endpoint definite; tick 1000ms; run fifo; \
     tick 2000ms; run fifo; run fifo",
    // Ready nodes lose their agent and their whole process group; a boot's
    // control connection breaks when its agent dies; a scale-down's cleanup
    // stays queued past its deadline and is retried.
    "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; \
     lose @0 agent; run fifo; lose @0 lease; run fifo; tick 1000ms; run fifo; run fifo; \
     run fifo; stream @0 failed stream-error; desire scale a 1; tick 30000ms; tick 2000ms; run fifo",
    // A create is held (a slow call) when the controller crashes. The
    // recovered controller scales the node away; its cleanup asks again,
    // meets a missing agent program (nothing of the attempt exists yet) and
    // lets the node go. Then the crashed controller's create goes through:
    // an orphan agent, found by listing and destroyed after its grace.
    "script create-lease hang; run one 0; crash; tick 1000ms; run fifo; desire scale a 0; \
     run fifo; tick 1000ms; script create-lease definite; run fifo; run fifo; release; run fifo; \
     tick 60000ms; run fifo; tick 60000ms; run fifo",
    // The controller crashes while starts are answered but not yet folded;
    // an agent joins right after. Its session is quiet for the recovered
    // controller until the re-issued start adopts it, and the join is
    // reported then (before, the join reached the new controller first,
    // the start was never re-issued and the node never became ready: G21).
    "run fifo; run fifo; run fifo; crash; stream @0 joined",
];

/// Fails with the survivors when any run of `context` still has a process.
fn assert_no_process_of_any_run(context: &Level3) {
    for run in context.runs() {
        let left = os::wait_until_run_gone(&run, RUN_GONE_WAIT_MAX).expect("/proc is readable");
        assert!(
            left.is_empty(),
            "processes of run {run} survived: {left:#?}"
        );
    }
}

/// Vacuity counts this battery does not require, and why.
const NOT_REACHED: [(&str, &str); 1] = [(
    "adoption after recovery",
    "timing-dependent here: it needs an operation still pending at a crash to be answered by \
     adoption, and whether a real agent's start is still in flight at the crash depends on the \
     machine's load (reached in 2 of 3 runs on a loaded machine, before and after the 100 ms \
     start check); the count is printed, and the detached e2e tests adopt after a real kill -9",
)];

fn battery() -> Level3Battery {
    Level3Battery::new(
        "level 3 (ProcessPlugin, real processes)",
        "cargo test -p provisioning-process --test level3",
        LEVEL3_SEED_BASE,
        LEVEL3_SEED_COUNT,
        LEVEL3_SHRINK_BUDGET,
    )
    .journal(temp_sqlite_journal)
    .waive(&NOT_REACHED)
    .written_traces(&WRITTEN_TRACES)
    .unwrap_or_else(|error| panic!("{error}"))
}

#[test]
fn level_3_battery_keeps_every_guarantee_with_real_processes_over_16_seeds_in_both_modes() {
    let context = Arc::new(Level3::new("battery", common::AGENT));
    let _guard = RunsGuard::new(&context);
    let started = Instant::now();
    let battery = battery();
    let report = {
        let context = context.clone();
        battery.run(move || ProcessSubstrate::new(context.clone()))
    }
    .unwrap_or_else(|error| panic!("{error}"));
    let faults = context.faults();
    eprintln!("{report}");
    eprintln!(
        "operating-system faults applied: {}; {} runs in {:.1} s",
        describe(&faults.required()),
        context.runs().len(),
        started.elapsed().as_secs_f64()
    );
    if let Err(error) = battery.check(&report) {
        panic!("{error}");
    }
    if let Err(error) = battery.check_faults(&faults.required()) {
        panic!("{error}");
    }
    let survivors = context.survivors();
    assert!(
        survivors.is_empty(),
        "processes outlived their plugin's shutdown:\n{}",
        survivors.join("\n")
    );
    assert_no_process_of_any_run(&context);
}

#[test]
fn level_3_counts_live_processes_from_the_operating_system_not_from_the_plugin() {
    let context = Arc::new(Level3::new("defect", common::AGENT));
    let _guard = RunsGuard::new(&context);
    // A clean run of the same trace converges and leaks nothing.
    assert_clean_run::<ProcessWorld>(&context, SCALE_DOWN_TRACE);
    // A process tagged as the destroyed node, outside its process group, is
    // a leaked lease the plugin never heard of; /proc shows it.
    assert_leak_caught::<ProcessWorld>(
        &context,
        Defect::DestroyLeavesStray,
        SCALE_DOWN_TRACE,
        "a process",
        "a-1/a2",
    );
    // Teardown finds the stray the plugin's shutdown could not know about.
    assert_eq!(context.survivors().len(), 1, "{:#?}", context.survivors());
    assert_no_process_of_any_run(&context);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seam_contract_holds_for_the_process_plugin_with_real_faults() {
    let context = Arc::new(Level3::new("contract", common::AGENT));
    let _guard = RunsGuard::new(&context);
    let suite = run_contract_suite(|| {
        let context = context.clone();
        async move { contract_subject(&context).await }
    });
    let report = tokio::time::timeout(CONTRACT_SUITE_WAIT_MAX, suite)
        .await
        .expect("the seam contract suite finishes within its bound");
    eprintln!("{report}");
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "Level 3 must produce every fault the suite asks for:\n{report}"
    );
    let context = context.clone();
    tokio::task::spawn_blocking(move || assert_no_process_of_any_run(&context))
        .await
        .expect("the final check runs");
}
