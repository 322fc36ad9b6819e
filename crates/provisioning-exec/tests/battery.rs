//! The conformance kit's battery against provider programs: the reference
//! provider (`examples/providers/dirs.py`) keeps every guarantee over 8
//! seeds × both modes, its broken variant (creates anew instead of
//! adopting) is caught with the guarantee named, and a program without the
//! battery hooks gets a skipped battery with the reason.
//!
//! Needs `python3`; without it the programs cannot start and the tests fail.
//!
//! Reproduce one case with the line a failure prints
//! (`PROVISIONING_SEED=… PROVISIONING_MODE=… cargo test -p provisioning-exec
//! --test battery`).

use std::path::PathBuf;

use provisioning_conformance::GuaranteeId;
use provisioning_conformance::substrate::Substrate;
use provisioning_conformance::{
    Mode, RunOptions, Stepper, Trace, cluster_driver, default_shape, run_trace,
};
use provisioning_exec::ExecConfig;
use provisioning_exec::battery::{
    BatteryOptions, BatteryOutcome, DEFAULT_BATTERY_SEEDS, ExecSubstrate, run_battery_against,
};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/providers");
const OLD_DOUBLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/doubles/memory_provider.py"
);

/// A fresh directory for a program's machines, removed on drop.
struct Root(PathBuf);

impl Root {
    fn new(name: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("dirs-battery-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("a temporary directory");
        Root(path)
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn program(name: &str, root: Option<&PathBuf>) -> ExecConfig {
    let mut args = vec![format!("{EXAMPLES}/{name}")];
    if let Some(root) = root {
        args.push("--root".to_owned());
        args.push(root.display().to_string());
    }
    ExecConfig::new("python3", args)
}

fn options(seeds: usize) -> BatteryOptions {
    BatteryOptions {
        seeds,
        reproduce_with: "cargo test -p provisioning-exec --test battery".to_owned(),
        env_overrides: true,
        ..BatteryOptions::default()
    }
}

fn report_of(outcome: BatteryOutcome) -> Box<provisioning_conformance::BatteryReport> {
    match outcome {
        BatteryOutcome::Ran { report, .. } => report,
        other => panic!("the battery did not run: {other}"),
    }
}

#[test]
fn the_reference_provider_keeps_every_guarantee_over_8_seeds_in_both_modes() {
    // One root for every run of the battery: each substrate's own run keeps
    // them apart, and each teardown leaves the root empty.
    let root = Root::new("reference");
    let root_path = root.0.clone();
    let outcome = run_battery_against(
        &program("dirs.py", Some(&root_path)),
        &options(DEFAULT_BATTERY_SEEDS),
    );
    eprintln!("{outcome}");
    assert!(outcome.is_success(), "{outcome}");
    let report = report_of(outcome);
    assert_eq!(report.traces, 2 * DEFAULT_BATTERY_SEEDS, "{report}");
    assert!(report.converged > 0, "no fair tail converged: {report}");
    assert!(
        report.vacuity.timeouts > 0,
        "no call ever timed out: {report}"
    );
    let left: Vec<_> = std::fs::read_dir(root_path.join("machines"))
        .expect("the machines directory")
        .collect();
    assert!(left.is_empty(), "machines left behind: {left:?}");
}

#[test]
fn the_broken_provider_that_creates_anew_fails_the_battery_with_no_double_create_named() {
    let outcome = run_battery_against(
        &program("dirs_broken.py", None),
        &options(DEFAULT_BATTERY_SEEDS),
    );
    eprintln!("{outcome}");
    assert!(!outcome.is_success(), "{outcome}");
    let report = report_of(outcome);
    let failure = report.failures.first().expect("a failure");
    assert_eq!(
        failure.guarantee(),
        GuaranteeId::NoDoubleCreate,
        "{failure}"
    );
    assert!(report.to_string().contains("G08"), "{report}");
}

#[test]
fn a_program_without_the_battery_hooks_gets_a_skipped_battery_with_the_reason() {
    let config = ExecConfig::new("python3", [OLD_DOUBLE]);
    let outcome = run_battery_against(&config, &options(1));
    assert!(outcome.is_success(), "skipped is not failed: {outcome}");
    match outcome {
        BatteryOutcome::Skipped(why) => assert!(why.contains("live, emit"), "{why}"),
        other => panic!("expected a skipped battery: {other}"),
    }
}

#[test]
fn a_program_that_cannot_start_breaks_the_battery() {
    let config = ExecConfig::new("/nonexistent/provider", Vec::<String>::new());
    let outcome = run_battery_against(&config, &options(1));
    assert!(!outcome.is_success(), "{outcome}");
    assert!(matches!(outcome, BatteryOutcome::Broken(_)), "{outcome}");
}

/// A written trace through the substrate: a create is held by the program
/// while the rest of the work goes on; it stays held across "run fifo"
/// until released, then both nodes come up and the tail converges with
/// nothing leaked.
#[test]
fn a_held_create_waits_at_the_program_until_released_and_the_cluster_then_converges() {
    let substrate = ExecSubstrate::start(&program("dirs.py", None)).expect("the program starts");
    let mut stepper =
        Stepper::new(substrate, default_shape(), Mode::Fair).expect("the stepper builds");
    let before: Trace = "script create-lease hang; run fifo; run fifo"
        .parse()
        .expect("the trace parses");
    stepper.steps(&before.inputs).expect("no violation");
    assert_eq!(stepper.substrate_counters().hangs, 1);
    assert_eq!(
        stepper.live_resources().leases.len(),
        1,
        "one create went through, the held one did not act"
    );
    assert!(stepper.substrate().has_runnable_work() || stepper.live_resources().leases.len() == 1);
    let after: Trace = "release; run fifo; run fifo; stream @0 joined; stream @1 joined; run fifo"
        .parse()
        .expect("the trace parses");
    stepper.steps(&after.inputs).expect("no violation");
    assert_eq!(
        stepper.live_resources().leases.len(),
        2,
        "released, it acted"
    );
    let tail = stepper.run_fair_tail();
    assert_eq!(tail.violation, None);
    assert!(tail.converged, "{}", tail.pending_description);
}

/// A create is held at the program when the controller crashes; the
/// recovered controller scales the node away, then the held create goes
/// through: an orphan machine, found in the program's ledger after its
/// grace and destroyed through the program's own `destroy_node`.
#[test]
fn a_crashed_controllers_held_create_leaves_an_orphan_that_is_collected() {
    let substrate = ExecSubstrate::start(&program("dirs.py", None)).expect("the program starts");
    let trace: Trace = "script create-lease hang; run one 0; crash; tick 1000ms; run fifo; \
                        desire scale a 0; run fifo; tick 1000ms; run fifo; run fifo; release; \
                        run fifo; tick 60000ms; run fifo; tick 60000ms; run fifo"
        .parse()
        .expect("the trace parses");
    let outcome = run_trace(
        substrate,
        &cluster_driver,
        &trace,
        RunOptions::new(Mode::Fair),
    );
    assert_eq!(outcome.violation, None, "{:?}", outcome.violation);
    assert!(outcome.converged);
    assert_eq!(outcome.vacuity.crashes, 1);
    assert!(
        outcome.vacuity.orphans_collected >= 1,
        "no orphan was collected: {:?}",
        outcome.vacuity
    );
    assert!(outcome.digest.live.is_empty(), "{}", outcome.digest.live);
}
