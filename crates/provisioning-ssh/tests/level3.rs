//! Level 3 of the conformance kit over SSH: the battery — 8 seeds × both
//! modes, plus a few written traces that reach every real fault on purpose
//! — against the real `SshPlugin` behind the real `PluginBackendAdapter`,
//! over namespaced sshd hosts of the testbed (each with its own address,
//! port 22, in a network namespace of its own). Faults are real events on
//! the hosts: `SIGKILL` and `SIGSTOP` of remote agents (`SIGCONT` on
//! release), sshd stopped (refused), a host's link set down mid-call
//! (ambiguous), a changed host key, an exhausted inventory, a failing
//! verify command, a create held like a slow call (see
//! `level3/backend.rs` for the table). "No double create" (G08) and
//! "converged leaks nothing" (G23) are counted from the claims on the hosts
//! and the agents in each host's namespace (`/proc`), never from the
//! plugin; no agent process and no claim of any run survives the test,
//! passing or failing.
//!
//! Crashes: the agents and the plugin outlive the controller. A `crash`
//! input drops the harness's driver and executor and recovers them from a
//! real SQLite journal (one file per run, in a temporary directory), as the
//! process provider's Level 3 does; the plugin's agents go quiet until the
//! recovered controller's adopting starts announce them again.
//!
//! The seam contract suite over SSH (all ten contracts) is
//! `tests/contract.rs`.
//!
//! Reproduce one case with the line a failure prints, for example
//! `PROVISIONING_SEED=0x… PROVISIONING_MODE=fair cargo test -p
//! provisioning-ssh --test level3`, or `PROVISIONING_TRACE='…'`. Timing on
//! real hosts is not reproducible, so G18 and G20 are checked at Levels 1
//! and 2 only.

mod common;
#[path = "level3/mod.rs"]
mod level3;

use std::sync::Arc;
use std::time::Instant;

use level3::{Defect, Level3, SshSubstrate, SshWorld};
use provisioning_conformance::level3::{
    FaultCounts, Level3Battery, RunsGuard, assert_clean_run, assert_leak_caught, describe,
    temp_sqlite_journal,
};
use provisioning_conformance::{GeneratorConfig, Mode};

const AGENT: &str = env!("CARGO_BIN_EXE_provision-remote-agent");

/// The base from which Level 3 over SSH derives its seeds.
const LEVEL3_SEED_BASE: u64 = 0x1E7E_3000_55A0_0003;

/// Seeds per mode.
const LEVEL3_SEED_COUNT: usize = 8;

/// The inputs of a generated trace: fewer than the kit's default, since
/// every input here costs real SSH calls on a loaded machine.
const LEVEL3_INPUTS: (usize, usize) = (16, 32);

/// Evaluations spent shrinking a failure: each one runs real SSH calls.
const LEVEL3_SHRINK_BUDGET: usize = 12;

/// The namespaced sshd hosts of the battery, and the slots of each: room
/// for the largest shape a trace asks for (three groups of three) and the
/// replacements on their way.
const HOSTS: usize = 2;
const SLOTS: u32 = 8;

/// Two nodes come up; one is scaled away, so its lease is destroyed.
const SCALE_DOWN_TRACE: &str = "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; \
     run fifo; desire scale a 1; run fifo; run fifo";

/// Written traces that reach each real fault on purpose; the generated
/// seeds then mix them at random.
/// Vacuity counts this battery does not require yet, and why.
const NOT_REACHED: [(&str, &str); 1] = [(
    "adoption after recovery",
    "open: crashes are applied (about 20 a run) and every guarantee holds across them, but no \
         seed or written trace here yet gets an adopted answer to an operation that was pending \
         at the crash (the held-create trace above was meant to); adoption after a real restart \
         of `provision up` over SSH is checked end to end by the CLI's e2e_ssh tests",
)];

const WRITTEN_TRACES: [&str; 9] = [
    // Creates meet an exhausted inventory, then every sshd stopped; later
    // creates are cut off mid-call by a partition, once after the claim
    // was made and once before.
    "script create-lease definite; run fifo; tick 1000ms; script create-lease definite; \
     run fifo; tick 2000ms; run fifo; desire scale a 3; script create-lease ambiguous-done; \
     run fifo; tick 2000ms; run fifo; desire add b 1; script create-lease ambiguous-undone; \
     run fifo; tick 2000ms; run fifo; run fifo; tick 5000ms; run fifo",
    // A lookup meets a stopped sshd (not ready); a start meets a changed
    // host key, the next a failing verify command; a later lookup meets a
    // changed host key.
    "run fifo; script lookup-endpoint not-ready; run fifo; tick 1000ms; run fifo; \
     script start-bootstrap definite; script start-bootstrap definite; run fifo; \
     tick 2000ms; run fifo; run fifo; script lookup-endpoint definite; tick 2000ms; run fifo; \
     tick 2000ms; run fifo; run fifo; tick 2000ms; run fifo",
    // A scale-down's destroy meets a stopped agent (SIGSTOP), released
    // (SIGCONT) before it is done; then ready nodes lose their agent,
    // their workload and their lease; a last destroy meets a stopped sshd.
    "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; \
     script destroy-lease hang; desire scale a 1; run fifo; release; run fifo; \
     desire scale a 3; run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; \
     stream @2 joined; run fifo; lose @0 agent; run fifo; run fifo; lose @0 workload; \
     run fifo; run fifo; lose @1 lease; run fifo; run fifo; script destroy-lease definite; \
     desire scale a 0; run fifo; tick 1000ms; run fifo",
    // A create is held (a slow call) past its deadline; the node is
    // scaled away and its retried create meets an exhausted inventory;
    // then the held create goes through, and its claim is cleaned up.
    "script create-lease hang; run one 0; tick 1000ms; run fifo; desire scale a 0; \
     run fifo; tick 1000ms; script create-lease definite; run fifo; run fifo; release; \
     run fifo; tick 60000ms; run fifo; tick 60000ms; run fifo",
    // The controller crashes while starts are answered but not yet folded,
    // and an agent joins right after: it is quiet for the recovered
    // controller until the re-issued start adopts it and reports the join
    // (before, the join was never reported again and the node never became
    // ready: G21).
    "run fifo; run fifo; run fifo; crash; stream @0 joined",
    // A create is held (a slow call) when the controller crashes; the
    // recovered controller scales the node away (its retried create meets
    // an exhausted inventory), then the crashed controller's create goes
    // through: an orphan claim, found by listing and destroyed after its
    // grace.
    "script create-lease hang; run one 0; crash; tick 1000ms; run fifo; desire scale a 0; \
     run fifo; tick 1000ms; script create-lease definite; run fifo; run fifo; release; run fifo; \
     tick 60000ms; run fifo; tick 60000ms; run fifo",
    // A create is held (a slow call) when the controller crashes and goes
    // through right after; the recovered controller re-issues it and adopts
    // the claim it made (adoption after recovery).
    "script create-lease hang; run one 0; crash; release; tick 1000ms; run fifo; run fifo; \
     run fifo; run fifo; stream @0 joined; run fifo",
    // Each kind of loss once more, from a freshly converged pair, so that
    // every loss is reached by two written paths: the long trace above
    // takes its third loss only when both replacements joined in time, and
    // a loss with no ready node to take is a no-op. Each loss here picks
    // whichever node is still ready (the other is being replaced).
    "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; \
     lose @1 lease; run fifo; run fifo; lose @0 workload; run fifo; run fifo; tick 1000ms; \
     run fifo; run fifo; run fifo",
    "run fifo; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo; \
     lose @0 agent; run fifo; run fifo; lose @1 lease; run fifo; run fifo; tick 1000ms; \
     run fifo; run fifo; run fifo",
];

/// Fails with the survivors when any run of `context` still has an agent,
/// a workload or a claim on a host.
fn assert_nothing_of_any_run(context: &Level3) {
    for run in context.runs() {
        let processes = context.hosts().processes_of(&run);
        let claims = context.hosts().claims(&run);
        assert!(
            processes.is_empty() && claims.is_empty(),
            "run {run} left processes {processes:#?} and claims {claims:?}"
        );
    }
}

fn battery() -> Level3Battery {
    Level3Battery::new(
        "level 3 (SshPlugin, namespaced sshd hosts)",
        "cargo test -p provisioning-ssh --test level3",
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
    .waive(&NOT_REACHED)
}

#[test]
fn level_3_over_ssh_keeps_every_guarantee_over_8_seeds_in_both_modes_with_real_faults() {
    let context = Arc::new(Level3::new("battery", HOSTS, SLOTS, AGENT));
    let _guard = RunsGuard::new(&context);
    let started = Instant::now();
    let battery = battery();
    let report = {
        let context = context.clone();
        battery.run(move || SshSubstrate::new(context.clone()))
    }
    .unwrap_or_else(|error| panic!("{error}"));
    let faults = context.faults();
    eprintln!("{report}");
    eprintln!(
        "level 3 over ssh: {LEVEL3_SEED_COUNT} seeds x {} modes + {} written traces, {} runs in {:.1} s; \
         guarantees counted from the hosts (claims, /proc of each namespace): G08, G23; \
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
        "agents or claims outlived the plugin's destroys:\n{}",
        survivors.join("\n")
    );
    assert_nothing_of_any_run(&context);
}

#[test]
fn level_3_over_ssh_counts_leases_from_the_hosts_not_from_the_plugin() {
    let context = Arc::new(Level3::new("defect", 1, 4, AGENT));
    let _guard = RunsGuard::new(&context);
    // A clean run of the same trace converges and leaks nothing.
    assert_clean_run::<SshWorld>(&context, SCALE_DOWN_TRACE);
    assert!(context.survivors().is_empty(), "{:#?}", context.survivors());
    // A destroy that stops the agent but leaves the claim reports success:
    // the claim on the host is a leaked lease.
    assert_leak_caught::<SshWorld>(
        &context,
        Defect::DestroyLeavesClaim,
        SCALE_DOWN_TRACE,
        "a claim",
        "a-1/a",
    );
    assert_nothing_of_any_run(&context);
}
