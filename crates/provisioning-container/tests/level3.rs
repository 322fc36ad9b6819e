//! Level 3 of the conformance kit over containers: the battery — 8
//! generated seeds × both modes, plus written traces that reach every real
//! fault on purpose — against the real `ContainerPlugin` behind the real
//! `PluginBackendAdapter`, on a private Docker engine of this test.
//!
//! Faults are real events (the tables are in `level3/backend.rs` and
//! `level3/substrate.rs`): a container removed or killed by hand, an agent
//! or a workload SIGKILLed inside its container, a container paused for a
//! lookup, the engine daemon stopped for a call and started again (its
//! containers live on), a socket nobody listens on, an image the engine
//! does not hold, a reply thrown away after the engine acted, a create
//! held like a slow call, boot gates that pass or fail. "No double create"
//! (G08) and "converged leaks nothing" (G23) are counted from the engine's
//! listing and `/proc`, never from the plugin; no container of any run
//! survives the test, passing or failing.
//!
//! Not applied, and refused: `panic` and `ambiguous-undone` faults, hangs
//! of calls other than a create, and the stream events a real agent
//! produces only on its own.
//!
//! Reproduce one case with the line a failure prints, for example
//! `PROVISIONING_SEED=0x… PROVISIONING_MODE=fair cargo test -p
//! provisioning-container --test level3`.

mod common;
#[path = "level3/mod.rs"]
mod level3;

use std::sync::Arc;
use std::time::Instant;

use level3::{ContainerSubstrate, ContainerWorld, Defect, Level3};
use provisioning_conformance::level3::{
    FaultCounts, Level3Battery, RunsGuard, assert_clean_run, assert_leak_caught, describe,
    temp_sqlite_journal,
};
use provisioning_conformance::{GeneratorConfig, Mode};

/// The base from which Level 3 over containers derives its seeds.
const LEVEL3_SEED_BASE: u64 = 0x1E7E_3000_C0DE_0003;

/// Seeds per mode.
const LEVEL3_SEED_COUNT: usize = 8;

/// The length of the generated traces.
const LEVEL3_INPUTS: (usize, usize) = (16, 32);

/// Evaluations spent shrinking a failure: each one starts real containers.
const LEVEL3_SHRINK_BUDGET: usize = 8;

/// Two nodes come up; one is scaled away, so its container is destroyed.
const SCALE_DOWN_TRACE: &str = "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; \
     run fifo; desire scale a 1; run fifo; run fifo";

/// Written traces that reach each real fault on purpose; the generated
/// seeds then mix them at random.
const WRITTEN_TRACES: [&str; 7] = [
    // Creates meet a missing image, a refusing socket and a lost reply (the
    // retry adopts the container the lost reply made).
    "script create-lease definite; run fifo; tick 1000ms; script create-lease definite; \
     run fifo; tick 2000ms; run fifo; desire scale a 3; script create-lease ambiguous-done; \
     run fifo; tick 2000ms; run fifo; run fifo; tick 5000ms; run fifo; run fifo",
    // A lookup meets a paused container (not ready); a start meets the
    // engine stopped and then a refusing socket.
    "run fifo; script lookup-endpoint not-ready; run fifo; tick 1000ms; run fifo; \
     script start-bootstrap definite; script start-bootstrap definite; run fifo; \
     tick 2000ms; run fifo; run fifo; tick 2000ms; run fifo; run fifo; \
     tick 2000ms; run fifo; run fifo; tick 2000ms; run fifo",
    // Agents waiting at their boot gate: one verify command fails, one
    // agent is killed before it joined; both nodes are replaced.
    "run fifo; run fifo; run fifo; stream @0 failed boot-check-failed; \
     stream @1 failed start-failed; run fifo; tick 2000ms; run fifo; run fifo; \
     tick 2000ms; run fifo; run fifo; run fifo",
    // Ready nodes lose their agent, their workload, their container; a
    // destroy's reply is lost, another meets the refusing socket.
    "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; \
     desire scale a 3; run fifo; run fifo; run fifo; stream @2 joined; run fifo; \
     lose @0 agent; run fifo; run fifo; lose @1 workload; run fifo; run fifo; \
     lose @2 lease; run fifo; run fifo; tick 1000ms; run fifo; run fifo; run fifo; \
     script destroy-lease ambiguous-done; script destroy-lease definite; desire scale a 0; \
     run fifo; tick 1000ms; run fifo; tick 2000ms; run fifo; run fifo",
    // A create held past the controller's crash; the recovered controller
    // scales the node away; the held create goes on: an orphan, found by
    // listing and destroyed after its grace.
    "script create-lease hang; run one 0; crash; tick 1000ms; run fifo; desire scale a 0; \
     run fifo; tick 1000ms; run fifo; run fifo; release; run fifo; \
     tick 60000ms; run fifo; tick 60000ms; run fifo",
    // The controller crashes while starts are answered but not yet folded,
    // and an agent joins right after: the re-issued start adopts it.
    "run fifo; run fifo; run fifo; crash; stream @0 joined",
    // Lease losses of both kinds (removed, killed with an exit code).
    "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; \
     lose @0 lease; run fifo; run fifo; lose @1 lease; run fifo; run fifo; tick 1000ms; \
     run fifo; run fifo; run fifo",
];

fn battery() -> Level3Battery {
    Level3Battery::new(
        "level 3 (ContainerPlugin, private dockerd)",
        "cargo test -p provisioning-container --test level3",
        LEVEL3_SEED_BASE,
        LEVEL3_SEED_COUNT,
        LEVEL3_SHRINK_BUDGET,
    )
    .journal(temp_sqlite_journal)
    .generator(GeneratorConfig {
        min_inputs: LEVEL3_INPUTS.0,
        max_inputs: LEVEL3_INPUTS.1,
        ..GeneratorConfig::default()
    })
    .written_traces(&WRITTEN_TRACES)
    .unwrap_or_else(|error| panic!("{error}"))
}

fn assert_no_container_of_any_run(context: &Level3) {
    for run in context.runs() {
        let left = context.containers(&run);
        assert!(left.is_empty(), "run {run} left containers {left:#?}");
    }
}

#[test]
fn level_3_over_containers_keeps_every_guarantee_over_8_seeds_in_both_modes_with_real_faults() {
    let context = Arc::new(Level3::new("battery"));
    let _guard = RunsGuard::new(&context);
    let started = Instant::now();
    let battery = battery();
    let report = {
        let context = context.clone();
        battery.run(move || ContainerSubstrate::new(context.clone()))
    }
    .unwrap_or_else(|error| panic!("{error}"));
    let faults = context.faults();
    eprintln!("{report}");
    eprintln!(
        "level 3 over containers: {LEVEL3_SEED_COUNT} seeds x {} modes + {} written traces, {} runs in {:.1} s; \
         real faults applied: {}",
        Mode::ALL.len(),
        WRITTEN_TRACES.len(),
        context.runs().len(),
        started.elapsed().as_secs_f64(),
        describe(&faults.required()),
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
        "containers outlived the plugin's destroys:\n{}",
        survivors.join("\n")
    );
    assert_no_container_of_any_run(&context);
}

#[test]
fn level_3_over_containers_counts_leases_from_the_engine_not_from_the_plugin() {
    let context = Arc::new(Level3::new("defect"));
    let _guard = RunsGuard::new(&context);
    assert_clean_run::<ContainerWorld>(&context, SCALE_DOWN_TRACE);
    assert!(context.survivors().is_empty(), "{:#?}", context.survivors());
    assert_leak_caught::<ContainerWorld>(
        &context,
        Defect::DestroyLeavesContainer,
        SCALE_DOWN_TRACE,
        "a container",
        "a-1/a",
    );
    assert_no_container_of_any_run(&context);
}
