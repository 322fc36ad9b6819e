//! Killing the controller mid-bring-up leaves no node process alive.
//!
//! This test binary plays two roles. Run by `cargo test`, it is the test: it
//! starts itself again as a *controller* (a process running a
//! `ProcessPlugin`), waits until that controller has nodes in every stage of
//! bring-up, kills it with `SIGKILL` — no cleanup code of the controller can
//! run — and then counts the run's processes in `/proc` until none is left.
//! It has its own `main` (no libtest harness) because the controller role
//! must not run any test.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use provisioning::RunId;
use provisioning::state::BootstrapProgress;
use provisioning_agent::os;
use provisioning_provider::ProvisionPlugin;

const TEST_NAME: &str = "killing_the_controller_mid_bring_up_leaves_no_node_process";

/// Selects the controller role and names its run.
const CONTROLLER_RUN_ENV: &str = "PROVISION_TEST_CONTROLLER_RUN";

/// What the controller prints once its nodes are in place.
const READY_LINE: &str = "controller ready";

/// The longest the controller lives if nobody kills it.
const CONTROLLER_LIFETIME_MAX: Duration = Duration::from_secs(120);

fn main() -> ExitCode {
    if let Ok(run) = std::env::var(CONTROLLER_RUN_ENV) {
        return controller(RunId::new(run));
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        // The test is never ignored, so it is absent from the ignored list.
        if !args.iter().any(|a| a == "--ignored") {
            println!("{TEST_NAME}: test");
        }
        return ExitCode::SUCCESS;
    }
    let exact = args.iter().any(|a| a == "--exact");
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let selected = filters.is_empty()
        || filters.iter().any(|f| {
            if exact {
                f.as_str() == TEST_NAME
            } else {
                TEST_NAME.contains(f.as_str())
            }
        });
    println!(
        "\nrunning {} test{}",
        u8::from(selected),
        if selected { "" } else { "s" }
    );
    if !selected {
        println!("\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out\n");
        return ExitCode::SUCCESS;
    }
    let started = Instant::now();
    let outcome =
        std::panic::catch_unwind(killing_the_controller_mid_bring_up_leaves_no_node_process);
    let passed = outcome.is_ok();
    println!(
        "test {TEST_NAME} ... {}",
        if passed { "ok" } else { "FAILED" }
    );
    println!(
        "\ntest result: {}. {} passed; {} failed; 0 ignored; 0 measured; 0 filtered out; finished in {:.2}s\n",
        if passed { "ok" } else { "FAILED" },
        u8::from(passed),
        u8::from(!passed),
        started.elapsed().as_secs_f64()
    );
    if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Kills the controller child however the test ends.
struct ControllerGuard(std::process::Child);

impl Drop for ControllerGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn killing_the_controller_mid_bring_up_leaves_no_node_process() {
    let guard = RunGuard::new("controller-death");
    let controller = Command::new(std::env::current_exe().unwrap())
        .env(CONTROLLER_RUN_ENV, guard.run.as_str())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut controller = ControllerGuard(controller);
    let stdout = controller.0.stdout.take().unwrap();
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if lines_tx.send(line).is_err() {
                return;
            }
        }
    });
    let ready = lines.recv_timeout(WAIT_MAX);
    assert!(
        matches!(&ready, Ok(Ok(line)) if line == READY_LINE),
        "the controller did not get ready: {ready:?}"
    );

    // Joined node: agent, shell and two sleeps; booting node: agent and its
    // verify command; created node: the agent alone.
    let before = os::run_processes(&guard.run).unwrap();
    let leaders = before.iter().filter(|p| p.is_group_leader()).count();
    assert_eq!(leaders, 3, "three agents expected: {before:#?}");
    assert!(
        before.len() >= 6,
        "nodes in every stage expected: {before:#?}"
    );
    assert!(
        before.iter().all(|p| p.parent_pid != 1),
        "a node process was already orphaned: {before:#?}"
    );

    let killed_at = Instant::now();
    controller.0.kill().unwrap();
    controller.0.wait().unwrap();
    let left = os::wait_until_run_gone(&guard.run, WAIT_MAX).unwrap();
    assert!(
        left.is_empty(),
        "node processes survived their controller: {left:#?}"
    );
    eprintln!(
        "{} node processes gone {:?} after the controller was killed",
        before.len(),
        killed_at.elapsed()
    );
}

/// The controller role: a plugin with three nodes at different stages.
fn controller(run: RunId) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let (plugin, recorder) = plugin(&run).await;
        let joined_key = key(&run, "web", 0, 1);
        bring_up(
            &plugin,
            &recorder,
            &joined_key,
            &spec(&joined_key, boot(&[], "sleep 600 & sleep 600; wait")),
        )
        .await;
        let booting_key = key(&run, "web", 1, 2);
        create_and_start(
            &plugin,
            &booting_key,
            &spec(&booting_key, boot(&["sleep 600"], "sleep 600")),
        )
        .await;
        recorder
            .wait_for("the boot check", |_| {
                recorder.bootstrap_events(&booting_key).contains(
                    &provisioning::observe::BootstrapEvent::Progress(
                        BootstrapProgress::BootChecking,
                    ),
                )
            })
            .await;
        let created_key = key(&run, "web", 2, 3);
        let lease = plugin
            .create_node(&created_key, &spec(&created_key, boot(&[], "")))
            .await
            .unwrap();
        wait_endpoint(&plugin, &created_key, &lease).await;
        wait_for_processes(&run, "every node process", |p| p.len() >= 6).await;
        println!("{READY_LINE}");
        tokio::time::sleep(CONTROLLER_LIFETIME_MAX).await;
    });
    ExitCode::SUCCESS
}
