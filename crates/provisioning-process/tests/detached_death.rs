//! Detached agents survive `SIGKILL` of their controller, and a restarted
//! plugin with the same run and secret adopts them without restarting a
//! workload.
//!
//! This test binary plays two roles (as `controller_death.rs`). Run by
//! `cargo test`, it is the test: it starts itself again as a *controller* (a
//! process running a detached `ProcessPlugin`) that brings one node up to
//! the close of its boot and leaves a second one booting-ready, kills it
//! with `SIGKILL`, then plays the restarted controller in-process.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use std::collections::BTreeSet;
use std::sync::Arc;

use provisioning::RunId;
use provisioning::{EndpointLookup, LogicalNodeSpec};
use provisioning_agent::os;
use provisioning_process::ProcessPlugin;
use provisioning_provider::{AttemptKey, BootstrapRequest, ProvisionPlugin};

const TEST_NAME: &str = "detached_agents_survive_sigkill_of_their_controller_and_a_restarted_plugin_adopts_them_without_restarting_workloads";

/// Selects the controller role and names its run.
const CONTROLLER_RUN_ENV: &str = "PROVISION_TEST_DETACHED_CONTROLLER_RUN";

/// The controller's agent log directory.
const CONTROLLER_LOGS_ENV: &str = "PROVISION_TEST_DETACHED_CONTROLLER_LOGS";

/// What the controller prints once its nodes are in place.
const READY_LINE: &str = "controller ready";

/// The longest the controller lives if nobody kills it.
const CONTROLLER_LIFETIME_MAX: Duration = Duration::from_secs(120);

fn main() -> ExitCode {
    if let Ok(run) = std::env::var(CONTROLLER_RUN_ENV) {
        let logs = std::env::var_os(CONTROLLER_LOGS_ENV).map(std::path::PathBuf::from);
        return controller(RunId::new(run), logs);
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
    let outcome = std::panic::catch_unwind(
        detached_agents_survive_sigkill_of_their_controller_and_a_restarted_plugin_adopts_them_without_restarting_workloads,
    );
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

fn keys(run: &RunId) -> (AttemptKey, AttemptKey) {
    (key(run, "web", 0, 1), key(run, "web", 1, 2))
}

fn specs(run: &RunId) -> (LogicalNodeSpec, LogicalNodeSpec) {
    let (closed, joined) = keys(run);
    (
        spec(&closed, boot(&["true"], "sleep 600 & sleep 600; wait")),
        spec(&joined, boot(&[], "sleep 600")),
    )
}

async fn detached_plugin(run: &RunId, logs: Option<PathBuf>) -> (Arc<ProcessPlugin>, Recorder) {
    plugin_with(detached_config(run, logs.as_deref())).await
}

/// Every process of `run` that is not an agent, by pid.
fn workloads(run: &RunId) -> BTreeSet<i32> {
    os::run_processes(run)
        .unwrap()
        .into_iter()
        .filter(|p| !p.is_group_leader())
        .map(|p| p.pid)
        .collect()
}

fn detached_agents_survive_sigkill_of_their_controller_and_a_restarted_plugin_adopts_them_without_restarting_workloads()
 {
    let guard = RunGuard::new("detached-sigkill");
    let logs = tempfile::tempdir().unwrap();
    let controller = Command::new(std::env::current_exe().unwrap())
        .env(CONTROLLER_RUN_ENV, guard.run.as_str())
        .env(CONTROLLER_LOGS_ENV, logs.path())
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
    let before = os::run_processes(&guard.run).unwrap();
    let agents: BTreeSet<i32> = before
        .iter()
        .filter(|p| p.is_group_leader())
        .map(|p| p.pid)
        .collect();
    assert_eq!(agents.len(), 2, "two agents expected: {before:#?}");
    let workload = workloads(&guard.run);
    assert!(workload.len() >= 3, "workloads expected: {before:#?}");

    controller.0.kill().unwrap();
    controller.0.wait().unwrap();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let run = guard.run.clone();
    runtime.block_on(async move {
        let (closed, joined_key) = keys(&run);
        let (closed_spec, joined_spec) = specs(&run);
        let (plugin, events) = detached_plugin(&run, Some(logs.path().to_owned())).await;
        let listed: BTreeSet<AttemptKey> = plugin
            .list_nodes(&run)
            .await
            .unwrap()
            .into_iter()
            .map(|n| n.key)
            .collect();
        assert_eq!(listed, BTreeSet::from([closed.clone(), joined_key.clone()]));
        // The node whose boot was still open when the controller died: the
        // journal re-issues its create and its start with the same key.
        let lease = plugin.create_node(&joined_key, &joined_spec).await.unwrap();
        assert!(lease.adopted);
        let endpoint = match plugin
            .lookup_endpoint(&joined_key, &lease.lease)
            .await
            .unwrap()
        {
            EndpointLookup::Ready(endpoint) => endpoint,
            EndpointLookup::NotReady => panic!("an adopted agent has a known endpoint"),
        };
        let request = BootstrapRequest {
            spec: joined_spec.clone(),
            lease: lease.lease.clone(),
            endpoint,
        };
        let session = plugin.start_bootstrap(&joined_key, &request).await.unwrap();
        assert!(session.adopted);
        events
            .wait_for("the re-join of the open node", |e| joined(e, &joined_key))
            .await;
        plugin.complete_bootstrap(&joined_key, None).await.unwrap();
        // Both agents re-joined this plugin's swarm: killing the converged
        // node's agent is reported as its loss here.
        let log = logs.path().join("web-0-a1.log");
        let deadline = tokio::time::Instant::now() + WAIT_MAX;
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("re-joined the swarm")
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no re-join of {closed}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = closed_spec;
        let now: BTreeSet<i32> = os::agents(&run).unwrap().iter().map(|p| p.pid).collect();
        assert_eq!(now, agents, "the same agents run");
        assert_eq!(workloads(&run), workload, "no workload was restarted");

        for key in [&closed, &joined_key] {
            plugin
                .destroy_node(key, &provisioning::LeaseHandle(String::new()))
                .await
                .unwrap();
        }
        wait_for_processes(&run, "every node to be gone", <[_]>::is_empty).await;
        plugin.shutdown().await;
    });
    drop(runtime);
    assert_no_processes(&guard.run);
}

/// The controller role: a detached plugin with one node past the close of
/// its boot and one joined but not closed.
fn controller(run: RunId, logs: Option<PathBuf>) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let (plugin, recorder) = detached_plugin(&run, logs).await;
        let (closed, joined_key) = keys(&run);
        let (closed_spec, joined_spec) = specs(&run);
        bring_up(&plugin, &recorder, &closed, &closed_spec).await;
        plugin.complete_bootstrap(&closed, None).await.unwrap();
        bring_up(&plugin, &recorder, &joined_key, &joined_spec).await;
        wait_for_processes(&run, "every workload", |p| {
            p.iter().filter(|p| !p.is_group_leader()).count() >= 3
        })
        .await;
        println!("{READY_LINE}");
        tokio::time::sleep(CONTROLLER_LIFETIME_MAX).await;
    });
    ExitCode::SUCCESS
}
