//! Level 3 of the conformance kit over Slurm: the battery — 6 generated
//! seeds × both modes, plus written traces that reach every scheduler
//! fault on purpose — against the real `SlurmPlugin` behind the real
//! `PluginBackendAdapter`, on the testbed's cluster (12 one-CPU nodes).
//!
//! Faults are real events (the tables are in `level3/backend.rs`,
//! `level3/cli.rs` and `level3/substrate.rs`): a job cancelled by hand, a
//! `slurmd` SIGKILLed (its node goes down, its job fails), `slurmctld`
//! stopped and restarted while a lookup runs, a request no node can
//! satisfy, commands that meet a closed controller port, commands killed
//! by their time-out, commands stopped with `SIGSTOP` (hangs, continued
//! with `SIGCONT` on release), suspended jobs (not ready), boot gates that
//! pass or fail, agent steps and agents SIGKILLed. "No double create"
//! (G08) and "converged leaks nothing" (G23) are counted from `squeue`,
//! never from the plugin; no job of any run survives the test, passing or
//! failing.
//!
//! Not applied, and counted as refused in the summary: `panic` faults, a
//! lost reply of a bootstrap start or completion, and the stream events a
//! real agent produces only on its own (progress stages, `converged`,
//! `closed`, stream, connect and join failures). A job hitting its time
//! limit is not in the battery: Slurm's smallest limit is one minute, too
//! slow for it; `tests/scheduler_faults.rs` covers it.
//!
//! Crashes: jobs and steps outlive the controller. A `crash` input drops
//! the harness's driver and executor and recovers them from a real SQLite
//! journal (one file per run, in a temporary directory); a held create
//! goes on in a task of its own and can submit an orphan job, found by
//! listing and destroyed through the plugin's own `destroy_node` after its
//! grace.
//!
//! Reproduce one case with the line a failure prints, for example
//! `PROVISIONING_SEED=0x… PROVISIONING_MODE=fair cargo test -p
//! provisioning-slurm --test level3`, or `PROVISIONING_TRACE='…'`.

mod common;
#[path = "level3/mod.rs"]
mod level3;

use std::sync::Arc;
use std::time::Instant;

use level3::{Defect, Level3, SlurmSubstrate, SlurmWorld};
use provisioning_conformance::Mode;
use provisioning_conformance::generate::GeneratorConfig;
use provisioning_conformance::level3::{
    FaultCounts, Level3Battery, RunsGuard, assert_clean_run, assert_leak_caught, describe,
    temp_sqlite_journal,
};

/// The base from which Level 3 over Slurm derives its seeds.
const LEVEL3_SEED_BASE: u64 = 0x1E7E_3000_51A2_0003;

/// Seeds per mode.
const LEVEL3_SEED_COUNT: usize = 6;

/// Evaluations spent shrinking a failure: each one submits real jobs.
const LEVEL3_SHRINK_BUDGET: usize = 8;

/// Nodes of the testbed: the kit's shapes ask for at most nine nodes, and
/// replacements may overlap the jobs they replace for a moment.
const TESTBED_NODES: usize = 12;

/// Short generated traces: every job takes about a second to start.
const GENERATOR: GeneratorConfig = GeneratorConfig {
    min_inputs: 16,
    max_inputs: 28,
    edges_per_mille: 60,
    executor_inputs_per_mille: 0,
    interleave_per_mille: 250,
    // The real plugin closes a session when Slurm reports the step's end; a
    // late close is the in-memory fakes' input.
    late_close_per_mille: 0,
};

/// Two nodes come up; one is scaled away, so its job is cancelled.
const SCALE_DOWN_TRACE: &str = "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; \
     run fifo; desire scale a 1; run fifo; run fifo";

/// Written traces that reach each scheduler fault on purpose; the generated
/// seeds then mix them at random.
const WRITTEN_TRACES: [&str; 5] = [
    // A start's first command is stopped past its deadline; the nodes are
    // scaled away, so cleanup waits behind the hung call; SIGCONT lets it
    // go on and its late answer is dropped.
    "run fifo; run fifo; script start-bootstrap hang; run fifo; tick 30000ms; desire scale a 0; \
     tick 2000ms; run fifo; release; run fifo; run fifo; desire scale a 2; run fifo; run fifo; \
     run fifo; stream @0 joined; stream @1 joined; run fifo",
    // A create is polled once and left in flight past its deadline; the
    // retry adopts the job it submitted. A lookup suspends a running job
    // (not ready); a verify command fails; an agent step is killed before
    // it joined; a request no node can satisfy; a lookup meets a stopped
    // slurmctld, which is started again.
    "run one 0; tick 30000ms; tick 2000ms; run fifo; script lookup-endpoint not-ready; run fifo; \
     run fifo; tick 1000ms; run fifo; run fifo; stream @0 failed boot-check-failed; \
     stream @1 failed start-failed; run fifo; script create-lease definite; \
     script lookup-endpoint definite; tick 1000ms; run fifo; tick 2000ms; run fifo; run fifo",
    // Ready nodes lose their agent and their job (cancelled by hand, or a
    // slurmd SIGKILLed); the replacement creates meet a request no node can
    // satisfy and a lost reply (the retry adopts the job); the scale-down's
    // cleanup meets a closed port and a command killed while it retried to
    // connect, and is retried.
    "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; \
     script create-lease definite; script create-lease ambiguous-done; lose @0 agent; run fifo; \
     tick 1000ms; run fifo; tick 2000ms; run fifo; tick 4000ms; run fifo; run fifo; \
     lose @0 lease; run fifo; run fifo; script cancel-bootstrap definite; \
     script destroy-lease ambiguous-undone; desire scale a 0; run fifo; run fifo; tick 5000ms; \
     run fifo; run fifo; tick 5000ms; run fifo; run fifo",
    // A create's first command is stopped when the controller crashes. The
    // recovered controller scales the node away; then the crashed
    // controller's create goes on: an orphan job, found by listing and
    // destroyed after its grace.
    "script create-lease hang; run one 0; crash; tick 1000ms; run fifo; desire scale a 0; \
     run fifo; tick 1000ms; run fifo; run fifo; release; run fifo; \
     tick 60000ms; run fifo; tick 60000ms; run fifo",
    // The controller crashes while starts are answered but not yet folded,
    // and an agent joins right after: its session is quiet for the
    // recovered controller until the re-issued start adopts the step, which
    // reports the join (adoption after recovery).
    "run fifo; run fifo; run fifo; crash; stream @0 joined",
];

/// Fails with the survivors when any run of `context` still has a live job.
fn assert_no_job_of_any_run(context: &Level3) {
    let left = context.cancel_all();
    assert!(left.is_empty(), "jobs survived their runs: {left:?}");
    let live = context.live_jobs_of_any_run();
    assert!(live.is_empty(), "jobs survived their runs: {live:?}");
}

fn battery() -> Level3Battery {
    Level3Battery::new(
        "level 3 (SlurmPlugin, real Slurm testbed)",
        "cargo test -p provisioning-slurm --test level3",
        LEVEL3_SEED_BASE,
        LEVEL3_SEED_COUNT,
        LEVEL3_SHRINK_BUDGET,
    )
    .journal(temp_sqlite_journal)
    .generator(GENERATOR)
    .written_traces(&WRITTEN_TRACES)
    .unwrap_or_else(|error| panic!("{error}"))
}

#[test]
fn level_3_battery_keeps_every_guarantee_on_a_real_slurm_cluster_over_6_seeds_in_both_modes() {
    let context = Arc::new(Level3::new("battery", TESTBED_NODES));
    let _guard = RunsGuard::new(&context);
    let battery = battery();
    for &seed in battery.seeds() {
        let trace = provisioning_conformance::generate(seed, &GENERATOR);
        eprintln!(
            "level 3 over Slurm: seed {seed:#x}, {} inputs",
            trace.inputs.len()
        );
    }
    let started = Instant::now();
    let report = {
        let context = context.clone();
        battery.run(move || SlurmSubstrate::new(context.clone()))
    }
    .unwrap_or_else(|error| panic!("{error}"));
    let faults = context.faults();
    eprintln!("{report}");
    eprintln!(
        "level 3 over Slurm: {} generated seeds x modes {:?} + {} written traces; {} runs in {:.1} s",
        LEVEL3_SEED_COUNT,
        Mode::ALL.map(Mode::name),
        WRITTEN_TRACES.len(),
        context.runs().len(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("real faults and refusals: {}", describe(&faults.all()));
    if let Err(error) = battery.check(&report) {
        panic!("{error}");
    }
    if let Err(error) = battery.check_faults(&faults.required()) {
        panic!("{error}");
    }
    assert_no_job_of_any_run(&context);
}

#[test]
fn level_3_counts_live_jobs_from_squeue_not_from_the_plugin() {
    let context = Arc::new(Level3::new("defect", 4));
    let _guard = RunsGuard::new(&context);
    // A clean run of the same trace converges and leaks nothing.
    assert_clean_run::<SlurmWorld>(&context, SCALE_DOWN_TRACE);
    // A destroy that answers success without reaching Slurm leaves a job
    // the driver and the plugin believe gone; squeue shows it.
    assert_leak_caught::<SlurmWorld>(
        &context,
        Defect::DestroyIsSkipped,
        SCALE_DOWN_TRACE,
        "a job",
        "a-1/a2",
    );
    assert_no_job_of_any_run(&context);
}
