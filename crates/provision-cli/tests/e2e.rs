//! End-to-end tests: the real `provision` binary on the local-process
//! provider. Every test gets its own run id and socket directory, bounds
//! every wait, and kills whatever is left in a drop guard.

mod up;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use provisioning::RunId;
use provisioning_agent::os;
use serde_json::Value;
use up::{Bounds, POLL_INTERVAL, Up, nodes, wait_output};

const BOUNDS: Bounds = Bounds {
    // After a start or an edit.
    converge: Duration::from_secs(90),
    exit: Duration::from_secs(60),
    // `status`, `plan`, `validate`.
    command: Duration::from_secs(30),
};
/// The bound on one short command.
const COMMAND_BOUND: Duration = BOUNDS.command;
/// How long leftovers get to die in the drop guard.
const CLEANUP_BOUND: Duration = Duration::from_secs(10);

/// One isolated `provision up` and its files. Dropping it kills the `up`
/// process and every process of its run.
struct Cluster {
    up: Up,
    /// The run id (the one `up` was made with).
    run: String,
}

fn shape(run: &str, groups: &[(&str, u32, &str)]) -> String {
    let mut text = format!("run = \"{run}\"\n");
    for (id, count, start) in groups {
        text.push_str(&format!(
            "\n[[group]]\nid = \"{id}\"\ncount = {count}\n[group.boot]\nverify_commands = [\"true\"]\nstart_command = \"{start}\"\n"
        ));
    }
    text
}

impl Cluster {
    fn new(test: &str) -> Self {
        let run = format!("e2e-{test}-{}", std::process::id());
        let up = Up::new("provision-e2e-", run.clone(), "shape.toml", BOUNDS);
        Cluster { up, run }
    }

    /// A file of the test's directory.
    fn path(&self, name: &str) -> PathBuf {
        self.up.path(name)
    }

    fn file(&self) -> PathBuf {
        self.up.file()
    }

    fn socket_dir(&self) -> PathBuf {
        self.up.socket_dir()
    }

    fn state_file(&self) -> PathBuf {
        self.up.state_dir().join(format!("{}.db", self.run))
    }

    fn write(&self, groups: &[(&str, u32, &str)]) {
        self.write_text(&shape(&self.run, groups));
    }

    fn write_text(&self, text: &str) {
        self.up.write_shape(text);
    }

    fn command(&self, args: &[&str]) -> Command {
        self.up.command(args)
    }

    fn start(&mut self) {
        self.start_with(&[]);
    }

    /// Starts `up` with `args` before its own (`-v`, say).
    fn start_with(&mut self, args: &[&str]) {
        self.start_up(args, &[]);
    }

    /// Starts `up` with global `args` before it and `up_args` after it.
    fn start_up(&mut self, args: &[&str], up_args: &[&str]) {
        self.up.start(args, up_args, 30);
    }

    /// What `up` wrote to its standard error (a file) so far.
    fn up_stderr(&self) -> String {
        self.up.log()
    }

    fn up_output(&self) -> String {
        self.up.output()
    }

    /// Runs a short command to its end, bounded.
    fn run(&self, args: &[&str]) -> Output {
        self.up.run_command(args)
    }

    /// `provision status --json`, parsed; `None` while nothing answers.
    fn status(&self) -> Option<Value> {
        self.up.status()
    }

    /// Polls the status until `done` holds; fails with the last status and
    /// the output of `up` when the bound passes.
    fn wait_for(&mut self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        self.up.wait_for(what, done, String::new)
    }

    fn wait_converged(&mut self, generation: u64) -> Value {
        self.wait_for(&format!("convergence at generation {generation}"), |s| {
            s["converged"] == Value::Bool(true) && s["generation"] == generation
        })
    }

    fn signal_up(&self, signal: Signal) {
        self.up.signal(signal);
    }

    fn wait_up_exit(&mut self) -> ExitStatus {
        self.up.wait_exit()
    }

    fn run_id(&self) -> RunId {
        RunId::new(self.run.as_str())
    }

    /// Live processes of the run, by node, agents only (group leaders).
    fn agents(&self) -> Vec<(String, Option<u64>)> {
        let mut agents: Vec<_> = os::run_processes(&self.run_id())
            .expect("read /proc")
            .into_iter()
            .filter(|p| p.is_group_leader())
            .map(|p| (p.node.unwrap_or_default(), p.attempt))
            .collect();
        agents.sort();
        agents
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.up.kill();
        let _ = os::kill_run(&self.run_id(), CLEANUP_BOUND);
    }
}

fn attempt_of(status: &Value, id: &str) -> u64 {
    nodes(status)
        .into_iter()
        .find(|n| n.0 == id)
        .map(|n| n.1)
        .unwrap_or_else(|| panic!("no node {id} in {status:#}"))
}

fn ids(status: &Value) -> Vec<String> {
    nodes(status).into_iter().map(|n| n.0).collect()
}

const WORKLOAD: &str = "sleep 3600";

#[test]
fn up_converges_and_status_json_reports_every_node_ready() {
    let mut cluster = Cluster::new("converge");
    cluster.write(&[("web", 2, WORKLOAD), ("worker", 1, WORKLOAD)]);
    cluster.start();
    let status = cluster.wait_converged(1);

    assert_eq!(status["observed_generation"], 1);
    assert_eq!(ids(&status), ["web-0", "web-1", "worker-0"]);
    for (id, attempt, stage, ready) in nodes(&status) {
        assert!(ready, "{id} is ready");
        assert!(attempt >= 1, "{id} has an attempt");
        assert_eq!(stage, "dormant", "{id} is in the ready steady state");
    }
    let agents = cluster.agents();
    let slots: Vec<&str> = agents.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(slots, ["web-0", "web-1", "worker-0"], "one agent per node");

    let file = cluster.file();
    let second = cluster.run(&["up", "--plain", file.to_str().expect("utf-8 path")]);
    assert_eq!(
        second.status.code(),
        Some(2),
        "a second up of the run is refused by the state's lock"
    );
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("another controller"), "{stderr}");
    assert_eq!(cluster.agents().len(), 3, "the refused up started nothing");

    let table = cluster.run(&["status", "--run", &cluster.run]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("converged yes") && text.contains("web-1"),
        "{text}"
    );

    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
}

#[test]
fn a_node_killed_with_sigkill_is_replaced_by_a_new_attempt() {
    let mut cluster = Cluster::new("sigkill");
    cluster.write(&[("web", 2, WORKLOAD)]);
    cluster.start();
    let before = cluster.wait_converged(1);
    let old = attempt_of(&before, "web-1");

    let victim = os::run_processes(&cluster.run_id())
        .expect("read /proc")
        .into_iter()
        .find(|p| p.is_group_leader() && p.node.as_deref() == Some("web-1"))
        .expect("the agent of web-1 runs");
    kill(Pid::from_raw(victim.pid), Signal::SIGKILL).expect("kill the agent");

    let after = cluster.wait_for("web-1 replaced by a ready new attempt", |s| {
        s["converged"] == Value::Bool(true) && attempt_of(s, "web-1") != old
    });
    assert!(attempt_of(&after, "web-1") > old);
    assert_eq!(attempt_of(&after, "web-0"), attempt_of(&before, "web-0"));
    let agents = cluster.agents();
    assert!(
        !agents.contains(&("web-1".to_owned(), Some(old))),
        "the killed attempt left no agent: {agents:?}"
    );
    assert_eq!(agents.len(), 2, "{agents:?}");

    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
}

#[test]
fn editing_the_file_scales_up_and_down_and_replaces_a_drifted_group() {
    let mut cluster = Cluster::new("edit");
    cluster.write(&[("web", 2, WORKLOAD), ("worker", 1, WORKLOAD)]);
    cluster.start();
    let first = cluster.wait_converged(1);

    cluster.write(&[("web", 4, WORKLOAD), ("worker", 1, WORKLOAD)]);
    let up = cluster.wait_converged(2);
    assert_eq!(ids(&up), ["web-0", "web-1", "web-2", "web-3", "worker-0"]);
    assert_eq!(attempt_of(&up, "web-1"), attempt_of(&first, "web-1"));

    cluster.write(&[("web", 1, WORKLOAD), ("worker", 1, WORKLOAD)]);
    let down = cluster.wait_converged(3);
    assert_eq!(
        ids(&down),
        ["web-0", "worker-0"],
        "the highest indices went"
    );
    assert_eq!(attempt_of(&down, "web-0"), attempt_of(&first, "web-0"));
    let slots: Vec<String> = cluster.agents().into_iter().map(|(n, _)| n).collect();
    assert_eq!(slots, ["web-0", "worker-0"], "removed nodes left no agent");

    cluster.write(&[("web", 1, WORKLOAD), ("worker", 1, "sleep 3599")]);
    let drifted = cluster.wait_converged(4);
    assert!(attempt_of(&drifted, "worker-0") > attempt_of(&first, "worker-0"));
    assert_eq!(attempt_of(&drifted, "web-0"), attempt_of(&first, "web-0"));
    let agents = cluster.agents();
    assert_eq!(
        agents,
        [
            ("web-0".to_owned(), Some(attempt_of(&drifted, "web-0"))),
            (
                "worker-0".to_owned(),
                Some(attempt_of(&drifted, "worker-0"))
            )
        ],
        "only the current attempts run"
    );

    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
}

#[test]
fn an_invalid_edit_is_reported_and_ignored_while_the_cluster_keeps_running() {
    let mut cluster = Cluster::new("bad-edit");
    cluster.write(&[("web", 1, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);

    let bad = format!(
        "{}\n[group.shape]\nresources = {{ cpu = nan }}\n",
        shape(&cluster.run, &[("web", 3, WORKLOAD)])
    );
    cluster.write_text(&bad);
    let deadline = Instant::now() + BOUNDS.converge;
    while !cluster.up_output().contains("edit ignored") {
        assert!(
            Instant::now() < deadline,
            "no report of the invalid edit\n{}",
            cluster.up_output()
        );
        sleep(POLL_INTERVAL);
    }
    let output = cluster.up_output();
    assert!(
        output.contains("shape.toml:"),
        "the report names the file\n{output}"
    );
    assert!(
        output.contains("resources.cpu"),
        "the report names the field\n{output}"
    );
    let status = cluster.status().expect("up still answers");
    assert_eq!(status["generation"], 1, "nothing was applied");
    assert_eq!(status["converged"], Value::Bool(true));

    cluster.write(&[("web", 2, WORKLOAD)]);
    cluster.wait_converged(2);
    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
}

#[test]
fn sigint_tears_down_with_no_process_of_the_run_left() {
    let mut cluster = Cluster::new("sigint");
    cluster.write(&[("web", 3, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    assert_eq!(cluster.agents().len(), 3);

    cluster.signal_up(Signal::SIGINT);
    let exit = cluster.wait_up_exit();
    assert!(
        exit.success(),
        "up exits 0 after a clean teardown\n{}",
        cluster.up_output()
    );
    let left = os::run_processes(&cluster.run_id()).expect("read /proc");
    assert!(left.is_empty(), "processes of the run are left: {left:#?}");
    assert!(
        !cluster
            .socket_dir()
            .join(format!("{}.sock", cluster.run))
            .exists(),
        "the control socket was removed"
    );
    assert!(cluster.up_output().contains("every node was torn down"));
}

#[test]
fn two_hundred_local_nodes_come_up_and_go_down_gracefully_leaving_no_process() {
    let mut cluster = Cluster::new("two-hundred");
    cluster.write(&[("web", 120, WORKLOAD), ("db", 80, WORKLOAD)]);
    cluster.start();
    let status = cluster.wait_converged(1);
    assert_eq!(status["nodes"].as_array().map(Vec::len), Some(200));
    assert_eq!(cluster.agents().len(), 200);
    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(
        down.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&down.stdout),
        cluster.up_output()
    );
    let exit = cluster.wait_up_exit();
    assert!(
        exit.success(),
        "graceful, not forced\n{}",
        cluster.up_output()
    );
    assert!(cluster.up_output().contains("every node was torn down"));
    assert!(
        !cluster.up_output().contains("forced"),
        "{}",
        cluster.up_output()
    );
    let left = os::run_processes(&cluster.run_id()).expect("read /proc");
    assert!(
        left.is_empty(),
        "{} processes of the run are left",
        left.len()
    );
}

#[test]
fn down_tears_the_cluster_down_and_waits_for_zero() {
    let mut cluster = Cluster::new("down");
    cluster.write(&[("web", 2, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);

    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(String::from_utf8_lossy(&down.stdout).contains("no node is left"));
    assert!(
        os::run_processes(&cluster.run_id())
            .expect("read /proc")
            .is_empty()
    );
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
}

#[test]
fn a_malformed_file_is_rejected_with_a_clear_message_and_nothing_starts() {
    let cluster = Cluster::new("malformed");
    cluster.write_text(&format!(
        "run = \"{}\"\n\n[[group]]\nid = \"web\"\ncount = 2\n[group.boot]\nstart_comand = \"sleep 3600\"\n",
        cluster.run
    ));
    let file = cluster.file();
    let file_arg = file.to_str().expect("utf-8 path");
    let up = cluster.run(&["up", "--plain", file_arg]);
    assert_eq!(up.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&up.stderr);
    assert!(
        stderr.contains(&format!("{file_arg}:7:")),
        "file and line: {stderr}"
    );
    assert!(stderr.contains("start_comand"), "the field: {stderr}");
    assert!(stderr.contains("nothing was started"), "{stderr}");
    assert!(
        os::run_processes(&cluster.run_id())
            .expect("read /proc")
            .is_empty()
    );
    assert!(
        !cluster
            .socket_dir()
            .join(format!("{}.sock", cluster.run))
            .exists()
    );

    let validate = cluster.run(&["validate", file_arg]);
    assert_eq!(validate.status.code(), Some(2));

    cluster.write_text(&format!(
        "run = \"{}\"\n[[group]]\nid = \"web\"\ncount = \"two\"\n",
        cluster.run
    ));
    let wrong_type = cluster.run(&["up", "--plain", file_arg]);
    assert_eq!(wrong_type.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&wrong_type.stderr);
    assert!(
        stderr.contains(":4:") && stderr.contains("group[0].count"),
        "{stderr}"
    );
}

#[test]
fn plan_shows_changes_from_empty_and_against_the_running_cluster() {
    let mut cluster = Cluster::new("plan");
    cluster.write(&[("web", 2, WORKLOAD)]);
    let file = cluster.file();
    let file_arg = file.to_str().expect("utf-8 path").to_owned();

    let from_empty = cluster.run(&["plan", "--json", &file_arg]);
    assert!(from_empty.status.success());
    let plan: Value = serde_json::from_slice(&from_empty.stdout).expect("plan --json is JSON");
    let changes: Vec<(&str, &str)> = plan["changes"]
        .as_array()
        .expect("changes")
        .iter()
        .map(|c| (c["node"].as_str().unwrap(), c["change"].as_str().unwrap()))
        .collect();
    assert_eq!(changes, [("web-0", "create"), ("web-1", "create")]);

    cluster.start();
    cluster.wait_converged(1);
    // A second file with the same run, so `up` does not apply it.
    let other = cluster.path("next.toml");
    fs::write(
        &other,
        shape(
            &cluster.run,
            &[("web", 1, "sleep 3599"), ("db", 1, WORKLOAD)],
        ),
    )
    .expect("write the next shape");
    let against = cluster.run(&["plan", other.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&against.stdout);
    assert!(
        against.status.success(),
        "{}",
        String::from_utf8_lossy(&against.stderr)
    );
    assert!(text.contains("against the running cluster"), "{text}");
    assert!(text.contains("create    db-0"), "{text}");
    assert!(text.contains("replace   web-0"), "{text}");
    assert!(text.contains("remove    web-1"), "{text}");
    assert_eq!(
        cluster.status().expect("status")["generation"],
        1,
        "plan applied nothing"
    );

    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
}

#[test]
fn status_without_a_running_up_fails_with_a_clear_message() {
    let cluster = Cluster::new("no-up");
    let output = cluster.run(&["status", "--json"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no running `provision up`"), "{stderr}");
}

#[test]
fn the_agent_subcommand_gets_its_arguments_without_clap_parsing_them() {
    let cluster = Cluster::new("agent-args");
    let output = cluster.run(&["agent", "--not-a-provision-flag"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains("Usage: provision"),
        "clap must not parse the agent's arguments: {stderr}"
    );
}

#[test]
fn validate_accepts_the_shipped_examples() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut checked = 0;
    for entry in fs::read_dir(&examples).expect("examples directory") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let cluster = Cluster::new("examples");
            let output = cluster.run(&["validate", path.to_str().unwrap()]);
            assert!(
                output.status.success(),
                "{}: {}",
                path.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            checked += 1;
        }
    }
    assert!(checked >= 1, "no example was checked");
}

#[test]
fn logs_written_to_a_file_carry_no_colour_codes() {
    let mut cluster = Cluster::new("no-colour");
    cluster.write(&[("web", 1, WORKLOAD)]);
    cluster.start_with(&["-v"]);
    cluster.wait_converged(1);
    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());

    let log = cluster.up_stderr();
    assert!(
        log.contains("local-process provider started"),
        "-v logs to stderr\n{log}"
    );
    assert!(
        !log.contains('\u{1b}'),
        "a log written to a file has no ANSI escape codes:\n{log:?}"
    );
}

/// The number of warnings in `log` about `attempt` of `node` that mention `marker`.
fn warnings_about(log: &str, run: &str, node: &str, attempt: u64, marker: &str) -> usize {
    let tag = format!("{run}/{node}/a{attempt}");
    log.lines()
        .filter(|line| line.contains("WARN") && line.contains(marker))
        .filter(|line| {
            line.match_indices(&tag)
                .any(|(at, _)| !line[at + tag.len()..].starts_with(|c: char| c.is_ascii_digit()))
        })
        .count()
}

#[test]
fn an_agent_warning_appears_once_in_the_up_output() {
    let mut cluster = Cluster::new("warn-once");
    let marker = "verify-marker-7f3a";
    cluster.write_text(&format!(
        "run = \"{}\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nverify_commands = [\"echo {marker}; false\"]\nstart_command = \"{WORKLOAD}\"\n",
        cluster.run
    ));
    cluster.start();
    // Attempts 1 and 2 failed their verify command and were torn down.
    cluster.wait_for("a third attempt after two failed verifies", |s| {
        attempt_of(s, "web-0") >= 3
    });
    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());

    let log = cluster.up_stderr();
    for attempt in [1, 2] {
        assert_eq!(
            warnings_about(&log, &cluster.run, "web-0", attempt, marker),
            1,
            "one warning about the failed verify of attempt {attempt}:\n{log}"
        );
    }
}

#[test]
fn validate_cuts_an_over_long_value_it_echoes() {
    let cluster = Cluster::new("long-value");
    let long = "r".repeat(5000);
    cluster.write_text(&format!(
        "run = \"{long}\"\n[[group]]\nid = \"web\"\ncount = 1\n"
    ));
    let file = cluster.file();
    let validate = cluster.run(&["validate", file.to_str().expect("utf-8 path")]);
    assert_eq!(validate.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&validate.stderr);
    assert!(
        stderr.contains(":1:7: field `run`: invalid run id"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("\"{}\"\u{2026} (5000 characters)", "r".repeat(64))),
        "the value is cut to its first 64 characters and its length: {stderr}"
    );
    assert!(stderr.len() < 400, "{} bytes: {stderr}", stderr.len());
}

#[test]
fn plan_summarises_consecutive_slots_as_ranges() {
    let cluster = Cluster::new("plan-ranges");
    cluster.write_text(&format!(
        "run = \"{}\"\n[[group]]\nid = \"w\"\ncount = 100000\n[[group]]\nid = \"db\"\ncount = 1\n",
        cluster.run
    ));
    let file = cluster.file();
    let file_arg = file.to_str().expect("utf-8 path");

    let human = cluster.run(&["plan", file_arg]);
    assert!(
        human.status.success(),
        "{}",
        String::from_utf8_lossy(&human.stderr)
    );
    let text = String::from_utf8_lossy(&human.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[0].starts_with("plan for run "), "{text}");
    assert_eq!(lines[1], "  create    db-0", "{text}");
    assert_eq!(
        lines[2], "  create    w-0 \u{2026} w-99999 (100000 nodes)",
        "{text}"
    );
    assert_eq!(
        lines[3],
        "100001 to create, 0 to replace, 0 to remove, 0 unchanged"
    );

    let json = cluster.run(&["plan", "--json", file_arg]);
    assert!(json.status.success());
    let plan: Value = serde_json::from_slice(&json.stdout).expect("plan --json is JSON");
    let changes = plan["changes"].as_array().expect("changes");
    assert_eq!(changes.len(), 100_001, "--json lists every slot");
    assert_eq!(changes[0]["node"], "db-0");
    assert_eq!(changes[1]["node"], "w-0");
    assert_eq!(changes[100_000]["node"], "w-99999");
    assert!(changes.iter().all(|c| c["change"] == "create"));
}

// ---------------------------------------------------------------------------
// Durable state (design §13).
// ---------------------------------------------------------------------------

#[test]
fn after_kill_9_of_up_a_restart_resumes_and_replaces_every_node_in_the_default_mode() {
    let mut cluster = Cluster::new("crash");
    cluster.write(&[("web", 3, WORKLOAD)]);
    cluster.start();
    let before = cluster.wait_converged(1);
    cluster.signal_up(Signal::SIGKILL);
    let _ = cluster.wait_up_exit();
    // The default mode ties every agent to its controller.
    let deadline = Instant::now() + CLEANUP_BOUND;
    while !cluster.agents().is_empty() && Instant::now() < deadline {
        sleep(POLL_INTERVAL);
    }
    assert_eq!(cluster.agents(), vec![], "agents die with their controller");

    cluster.start();
    let after = cluster.wait_converged(1);
    assert!(
        cluster.up_output().contains("resuming run"),
        "{}",
        cluster.up_output()
    );
    for id in ["web-0", "web-1", "web-2"] {
        assert!(
            attempt_of(&after, id) > attempt_of(&before, id),
            "{id} is replaced by a fresh attempt, never one reused"
        );
    }
    let agents = cluster.agents();
    assert_eq!(agents.len(), 3, "exactly the desired agents: {agents:?}");
    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
    assert_eq!(cluster.agents(), vec![]);
}

#[test]
fn a_second_up_of_the_same_run_is_refused_and_starts_nothing() {
    let mut cluster = Cluster::new("second");
    cluster.write(&[("web", 1, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    // Another socket directory, so only the state's lock can catch it.
    let second = cluster
        .command(&["up", "--plain", "--socket-dir"])
        .arg(cluster.path("other-sockets"))
        .arg(cluster.file())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a second up");
    let output = wait_output(second, COMMAND_BOUND, "a second up");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("another controller"), "{stderr}");
    assert!(stderr.contains(&cluster.run), "{stderr}");
    assert_eq!(cluster.agents().len(), 1, "nothing more started");
}

#[test]
fn a_corrupt_state_file_is_refused_by_name_and_left_as_it_was() {
    let cluster = Cluster::new("corrupt");
    cluster.write(&[("web", 1, WORKLOAD)]);
    fs::create_dir_all(cluster.up.state_dir()).expect("state dir");
    let garbage = b"this is not a database, just bytes a disk fault left behind".repeat(100);
    fs::write(cluster.state_file(), &garbage).expect("write garbage");
    let output = cluster.run(&["up", "--plain", cluster.file().to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&cluster.state_file().display().to_string()),
        "{stderr}"
    );
    assert!(stderr.contains("nothing was started"), "{stderr}");
    assert_eq!(fs::read(cluster.state_file()).expect("read"), garbage);
    assert_eq!(cluster.agents(), vec![]);
}

#[test]
fn an_unusable_state_directory_is_refused_and_starts_nothing() {
    let cluster = Cluster::new("baddir");
    cluster.write(&[("web", 1, WORKLOAD)]);
    // A directory below a regular file cannot exist, even for root.
    let blocker = cluster.path("blocker");
    fs::write(&blocker, "a file").expect("write");
    let output = cluster.run(&[
        "--state-dir",
        blocker.join("state").to_str().expect("utf-8"),
        "up",
        "--plain",
        cluster.file().to_str().expect("utf-8"),
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("state directory"), "{stderr}");
    assert_eq!(cluster.agents(), vec![]);
}

#[test]
fn down_without_a_running_up_tears_a_crashed_run_down_from_its_state() {
    let mut cluster = Cluster::new("downstate");
    cluster.write(&[("web", 2, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    cluster.signal_up(Signal::SIGKILL);
    let _ = cluster.wait_up_exit();

    let down = cluster.run(&["down", "--run", &cluster.run]);
    let stdout = String::from_utf8_lossy(&down.stdout);
    assert!(
        down.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(stdout.contains("recovering run"), "{stdout}");
    assert!(stdout.contains("marked clean"), "{stdout}");
    assert_eq!(cluster.agents(), vec![]);
    // Clean now: another down finds nothing to do, and up starts fresh.
    let again = cluster.run(&["down", "--run", &cluster.run]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("no run was left unclean"));
}

/// A shape whose agents outlive their controller.
fn detached_shape(cluster: &Cluster, groups: &[(&str, u32, &str)]) -> String {
    let logs = cluster.path("agent-logs");
    let text = shape(&cluster.run, groups);
    // After the top-level `run` key, before the group tables.
    let (run_line, tables) = text.split_once('\n').expect("a run line");
    format!(
        "{run_line}\n\n[providers.process]\nagents = \"detached\"\nlog_dir = \"{}\"\n{tables}",
        logs.display()
    )
}

/// Every process of the run (agents and workloads), by pid.
fn run_pids(cluster: &Cluster) -> Vec<i32> {
    let mut pids: Vec<i32> = os::run_processes(&cluster.run_id())
        .expect("read /proc")
        .into_iter()
        .map(|p| p.pid)
        .collect();
    pids.sort_unstable();
    pids
}

/// Every process of the run once two reads 100 ms apart agree: at
/// convergence a node's workload may still be starting a child (the shell
/// of its command), which a single read can miss. Fails after 10 s.
fn settled_run_pids(cluster: &Cluster) -> Vec<i32> {
    let mut last = run_pids(cluster);
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = run_pids(cluster);
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the run's processes never settled: {last:?}");
}

#[test]
fn in_detached_mode_a_restart_after_kill_9_adopts_every_node_without_restarting_a_workload() {
    let mut cluster = Cluster::new("adopt");
    cluster.write_text(&detached_shape(
        &cluster,
        &[("web", 3, WORKLOAD), ("db", 1, WORKLOAD)],
    ));
    cluster.start();
    let before = cluster.wait_converged(1);
    let pids_before = settled_run_pids(&cluster);
    assert!(
        pids_before.len() >= 8,
        "agents and workloads: {pids_before:?}"
    );
    cluster.signal_up(Signal::SIGKILL);
    let _ = cluster.wait_up_exit();
    assert_eq!(
        run_pids(&cluster),
        pids_before,
        "the fleet outlives its controller"
    );

    cluster.start();
    let after = cluster.wait_converged(1);
    assert!(
        cluster.up_output().contains("resuming run"),
        "{}",
        cluster.up_output()
    );
    for id in ["web-0", "web-1", "web-2", "db-0"] {
        assert_eq!(
            attempt_of(&after, id),
            attempt_of(&before, id),
            "{id} adopted"
        );
    }
    assert_eq!(
        run_pids(&cluster),
        pids_before,
        "no agent or workload restarted"
    );
    assert_eq!(after["durability"]["lost_at_recovery"], 0);

    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
    assert_eq!(run_pids(&cluster), Vec::<i32>::new());
}

/// Stops (SIGSTOP) a set of processes; dropping it continues them, so a
/// failed assertion never leaves a frozen process behind.
struct Frozen(Vec<i32>);

impl Frozen {
    fn freeze(pids: Vec<i32>) -> Self {
        for &pid in &pids {
            let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
        }
        Frozen(pids)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        for &pid in &self.0 {
            let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
        }
    }
}

/// Whether every node of `status` awaits its agent's re-join.
fn all_rejoining(status: &Value) -> bool {
    let nodes = nodes(status);
    !nodes.is_empty()
        && nodes
            .iter()
            .all(|(_, _, stage, ready)| stage == "rejoining" && !ready)
}

#[test]
fn in_detached_mode_a_restarted_up_is_not_converged_before_its_agents_rejoin() {
    let mut cluster = Cluster::new("rejoin");
    cluster.write_text(&detached_shape(&cluster, &[("web", 3, WORKLOAD)]));
    cluster.start();
    let before = cluster.wait_converged(1);
    let pids_before = settled_run_pids(&cluster);
    cluster.signal_up(Signal::SIGKILL);
    let _ = cluster.wait_up_exit();

    // Agents that cannot answer: the restarted controller finds them in
    // /proc, but none of them can re-join it yet.
    let frozen = Frozen::freeze(pids_before.clone());
    cluster.start();
    let waiting = cluster.wait_for("every node rejoining", all_rejoining);
    assert_eq!(waiting["converged"], Value::Bool(false), "{waiting}");
    // For a while (well inside the 60 s rejoin window) nothing changes:
    // readiness is never taken from the state file.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        if let Some(status) = cluster.status() {
            assert_eq!(
                status["converged"],
                Value::Bool(false),
                "converged while no agent could re-join: {status}"
            );
            assert!(all_rejoining(&status), "{status}");
        }
        sleep(POLL_INTERVAL);
    }

    drop(frozen);
    let after = cluster.wait_converged(1);
    for id in ["web-0", "web-1", "web-2"] {
        assert_eq!(
            attempt_of(&after, id),
            attempt_of(&before, id),
            "{id} re-earned its readiness with the same attempt"
        );
    }
    assert_eq!(
        settled_run_pids(&cluster),
        pids_before,
        "no agent or workload restarted"
    );
}

#[test]
fn in_detached_mode_kill_9_at_any_point_of_a_bring_up_ends_with_exactly_the_desired_agents() {
    const NODES: u32 = 20;
    const REPETITIONS: u64 = 20;
    let mut cluster = Cluster::new("chaos");
    cluster.write_text(&detached_shape(&cluster, &[("w", NODES, WORKLOAD)]));
    // A fixed sequence of crash points between 0 and 1.5 s into the start.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for repetition in 0..REPETITIONS {
        cluster.start();
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        sleep(Duration::from_millis(seed % 1500));
        cluster.signal_up(Signal::SIGKILL);
        let _ = cluster.wait_up_exit();

        cluster.start();
        let status = cluster.wait_converged(1);
        let agents = cluster.agents();
        let slots: std::collections::BTreeSet<&str> =
            agents.iter().map(|(node, _)| node.as_str()).collect();
        assert_eq!(
            agents.len(),
            NODES as usize,
            "repetition {repetition}: exactly {NODES} agents, counted from /proc: {agents:?}"
        );
        assert_eq!(
            slots.len(),
            NODES as usize,
            "one agent per slot: {agents:?}"
        );
        for (node, attempt) in &agents {
            assert_eq!(
                Some(attempt_of(&status, node)),
                *attempt,
                "repetition {repetition}: {node}'s agent is its current attempt"
            );
        }
        cluster.signal_up(Signal::SIGKILL);
        let _ = cluster.wait_up_exit();
    }
    let down = cluster.run(&["down", "--run", &cluster.run]);
    let stdout = String::from_utf8_lossy(&down.stdout);
    assert!(
        down.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert_eq!(cluster.agents(), vec![], "{stdout}");
    assert_eq!(run_pids(&cluster), Vec::<i32>::new());
}

// ---------------------------------------------------------------------------
// Operator safety (design §15).
// ---------------------------------------------------------------------------

fn ready_in(status: &Value, group: &str) -> usize {
    nodes(status)
        .into_iter()
        .filter(|(id, _, _, ready)| id.starts_with(&format!("{group}-")) && *ready)
        .count()
}

#[test]
fn a_drift_edit_with_max_unavailable_2_never_has_more_than_2_of_6_nodes_unready() {
    let mut cluster = Cluster::new("budget");
    let run = cluster.run.clone();
    let text = |start: &str| {
        format!(
            "run = \"{}\"\n[[group]]\nid = \"web\"\ncount = 6\nmax_unavailable = 2\n[group.boot]\nstart_command = \"{start}\"\n",
            run
        )
    };
    cluster.write_text(&text("sleep 3600"));
    cluster.start();
    cluster.wait_converged(1);
    cluster.write_text(&text("sleep 3601"));
    let deadline = Instant::now() + BOUNDS.converge;
    let mut worst = 0;
    let mut samples = 0;
    loop {
        if let Some(status) = cluster.status() {
            samples += 1;
            if status["generation"] == 2 {
                worst = worst.max(6 - ready_in(&status, "web"));
                if status["converged"] == Value::Bool(true) {
                    break;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no convergence\n{}",
            cluster.up_output()
        );
        sleep(Duration::from_millis(20));
    }
    assert!(
        worst <= 2,
        "{worst} of 6 unready at once (over {samples} samples)"
    );
}

#[test]
fn a_group_whose_boot_check_fails_pauses_and_resume_lets_it_try_again() {
    let mut cluster = Cluster::new("breaker");
    let run = cluster.run.clone();
    let text = |check: &str| {
        format!(
            "run = \"{}\"\n[[group]]\nid = \"web\"\ncount = 1\nbreaker_failures = 2\nbreaker_cooldown_secs = 3600\n[group.boot]\nverify_commands = [\"{check}\"]\nstart_command = \"sleep 3600\"\n",
            run
        )
    };
    cluster.write_text(&text("test -e /no/such/image"));
    cluster.start();
    let paused = cluster.wait_for("the breaker to open", |s| {
        s["groups"][0]["paused"].as_str().is_some()
    });
    let reason = paused["groups"][0]["paused"].as_str().unwrap().to_owned();
    assert!(
        reason.starts_with("group web paused after 2 failed attempts"),
        "{reason}"
    );
    let table = cluster.run(&["status", "--run", &cluster.run]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("paused after 2 failed attempts"));
    // While paused, no new attempt starts.
    let attempts = attempt_of(&paused, "web-0");
    sleep(Duration::from_secs(3));
    let still = cluster.status().expect("status");
    assert_eq!(
        attempt_of(&still, "web-0"),
        attempts,
        "paused: no new attempt"
    );

    let resume = cluster.run(&["resume", "web", "--run", &cluster.run]);
    assert!(
        resume.status.success(),
        "{}",
        String::from_utf8_lossy(&resume.stderr)
    );
    assert!(String::from_utf8_lossy(&resume.stdout).contains("resumed"));
    cluster.wait_for("a new attempt after resume", |s| {
        attempt_of(s, "web-0") > attempts
    });
    let unknown = cluster.run(&["resume", "nope", "--run", &cluster.run]);
    assert_eq!(unknown.status.code(), Some(2));

    // A fixed boot check converges (the edit also closes the breaker).
    cluster.write_text(&text("true"));
    cluster.wait_converged(2);
    assert!(
        cluster
            .up_output()
            .contains("paused after 2 failed attempts")
    );
}

#[test]
fn a_workload_that_exits_at_once_pauses_its_group_instead_of_restarting_forever() {
    let mut cluster = Cluster::new("typo");
    // A typo in the start command: the shell exits with 127 right after it
    // started, before the agent joins: every attempt fails its start with
    // that status, and none is ever shown ready.
    cluster.write_text(&format!(
        "run = \"{}\"\n[[group]]\nid = \"web\"\ncount = 1\nbreaker_failures = 3\nbreaker_cooldown_secs = 3600\n[group.boot]\nstart_command = \"srve --port 8080\"\n",
        cluster.run
    ));
    cluster.start();
    let paused = cluster.wait_for("the breaker to open", |s| {
        s["groups"][0]["paused"].as_str().is_some()
    });
    let reason = paused["groups"][0]["paused"].as_str().unwrap().to_owned();
    assert!(
        reason.starts_with("group web paused after 3 failed attempts: ")
            && reason.contains("workload exited with status 127"),
        "{reason}"
    );
    let attempts = attempt_of(&paused, "web-0");
    sleep(Duration::from_secs(3));
    let still = cluster.status().expect("status");
    assert_eq!(
        attempt_of(&still, "web-0"),
        attempts,
        "paused: no restart loop"
    );
    assert!(
        cluster
            .up_output()
            .contains("paused after 3 failed attempts")
    );

    // The node's history says what happened, in text and in JSON.
    let details = cluster.run(&["status", "web-0", "--run", &cluster.run]);
    assert!(details.status.success());
    let text = String::from_utf8_lossy(&details.stdout).into_owned();
    assert!(text.starts_with("node web-0  group web"), "{text}");
    assert!(text.contains("workload exited with status 127"), "{text}");
    let json = cluster.run(&["status", "web-0", "--json", "--run", &cluster.run]);
    let node: serde_json::Value = serde_json::from_slice(&json.stdout).expect("node json");
    let history = node["history"].as_array().expect("history");
    assert!(history.len() >= 4, "{node}");
    assert!(
        history.iter().any(|t| t["reason"]
            .as_str()
            .is_some_and(|r| r.contains("workload exited with status 127"))),
        "{node}"
    );
    assert!(
        history.iter().all(|t| t["ready"] == Value::Bool(false)),
        "a workload that never ran is never shown ready: {node}"
    );
    assert!(
        !cluster.up_output().contains("(ready)"),
        "never shown ready: {}",
        cluster.up_output()
    );
    let attempts: Vec<u64> = history
        .iter()
        .filter_map(|t| t["attempt"].as_u64())
        .collect();
    assert!(
        attempts.windows(2).all(|w| w[0] <= w[1]),
        "oldest first: {attempts:?}"
    );
    let missing = cluster.run(&["status", "web-9", "--run", &cluster.run]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("has no node \"web-9\""));
}

/// One GET over loopback, answered in full (the exporter closes or sends a
/// length); returns the status line's code and the body.
fn http_get(address: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line: {head}")))?;
    Ok((code, body.to_owned()))
}

/// The value of the sample `name{labels}` in a Prometheus text body.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (key, value) = line.rsplit_once(' ')?;
            (key == series).then(|| value.parse().ok()).flatten()
        })
}

#[test]
fn a_metrics_scrape_parses_and_matches_status() {
    let mut cluster = Cluster::new("metrics");
    let address = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        probe.local_addr().expect("address")
    };
    let text = shape(
        &cluster.run,
        &[("web", 3, "sleep 600"), ("db", 1, "sleep 600")],
    );
    cluster.write_text(&text);
    cluster.start_up(&[], &["--metrics", &address.to_string()]);
    let status = cluster.wait_converged(1);
    assert!(
        cluster
            .up_output()
            .contains(&format!("metrics at http://{address}/metrics"))
    );
    // Gauges follow the published snapshot; give the exporter a moment.
    let mut body = String::new();
    for _ in 0..50 {
        let (code, text) = http_get(address, "/metrics").expect("scrape");
        assert_eq!(code, 200, "{text}");
        body = text;
        if sample(&body, "provision_nodes_ready{group=\"web\"}") == Some(3.0) {
            break;
        }
        sleep(Duration::from_millis(200));
    }
    for group in status["groups"].as_array().unwrap() {
        let id = group["id"].as_str().unwrap();
        for (metric, field) in [
            ("provision_nodes_desired", "desired"),
            ("provision_nodes_ready", "ready"),
        ] {
            let series = format!("{metric}{{group=\"{id}\"}}");
            assert_eq!(
                sample(&body, &series),
                group[field].as_f64(),
                "{series} against status:\n{body}"
            );
        }
        assert_eq!(
            sample(&body, &format!("provision_group_paused{{group=\"{id}\"}}")),
            Some(0.0)
        );
    }
    let dormant = status["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["group"] == "web" && n["stage"] == "dormant")
        .count();
    assert_eq!(
        sample(&body, "provision_nodes{group=\"web\",stage=\"dormant\"}"),
        Some(dormant as f64),
        "{body}"
    );
    // Every node took one create-lease: four answered successfully.
    assert_eq!(
        sample(
            &body,
            "provision_operations_total{kind=\"create-lease\",outcome=\"ok\"}"
        ),
        Some(4.0),
        "{body}"
    );
    assert!(
        body.contains("provision_operation_duration_seconds"),
        "{body}"
    );
    assert!(
        sample(&body, "provision_passes_total").is_some_and(|p| p >= 1.0),
        "{body}"
    );

    // A second `up` cannot take the same address: a clear refusal.
    let other = Cluster::new("metrics-busy");
    let busy_text = shape(&other.run, &[("web", 1, "sleep 600")]);
    other.write_text(&busy_text);
    let refused = other.run(&[
        "up",
        "--plain",
        "--metrics",
        &address.to_string(),
        other.file().to_str().unwrap(),
    ]);
    assert_eq!(
        refused.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr)
            .contains(&format!("cannot serve metrics on {address}")),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

#[test]
fn json_logs_are_one_object_per_line_without_colour_codes() {
    let mut cluster = Cluster::new("jsonlog");
    let text = shape(&cluster.run, &[("web", 1, "sleep 600")]);
    cluster.write_text(&text);
    cluster.start_with(&["-v", "--log-format", "json"]);
    cluster.wait_converged(1);
    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(down.status.success());
    cluster.wait_up_exit();
    let stderr = fs::read_to_string(cluster.path("up.err")).unwrap();
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(!lines.is_empty(), "-v logs something");
    for line in lines {
        assert!(!line.contains('\u{1b}'), "no ANSI codes: {line:?}");
        let object: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        assert!(
            object["level"].is_string() && object["fields"].is_object(),
            "{line}"
        );
    }
}

// ---------------------------------------------------------------------------
// Providers in any language (design §16).
// ---------------------------------------------------------------------------

#[test]
fn down_after_a_crash_starts_the_runs_provider_program_again_and_leaves_nothing() {
    let mut cluster = Cluster::new("exec-crash");
    let program = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/providers/dirs.py");
    assert!(
        program.exists(),
        "the reference provider is at {}",
        program.display()
    );
    let root = cluster.path("machines-root");
    fs::create_dir_all(&root).unwrap();
    cluster.write_text(&format!(
        "run = \"{}\"\n\n[providers.exec]\ncommand = [\"python3\", \"{}\", \"--root\", \"{}\"]\n\n[[group]]\nid = \"remote\"\ncount = 2\nprovider = \"exec\"\n",
        cluster.run,
        program.display(),
        root.display()
    ));
    cluster.start();
    cluster.wait_converged(1);
    let machines =
        |root: &Path| -> usize { fs::read_dir(root.join("machines")).map_or(0, |d| d.count()) };
    assert_eq!(machines(&root), 2, "two machines made");
    cluster.signal_up(Signal::SIGKILL);
    let _ = cluster.wait_up_exit();
    assert_eq!(machines(&root), 2, "the machines outlive the controller");

    // No `up` runs and no file is given: the state keeps the file, so the
    // provider program is started again and destroys its machines.
    let down = cluster.run(&["down", "--run", &cluster.run]);
    let stdout = String::from_utf8_lossy(&down.stdout);
    assert!(
        down.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(stdout.contains("recovering run"), "{stdout}");
    assert!(!stdout.contains("embedded provider only"), "{stdout}");
    assert_eq!(machines(&root), 0, "down destroyed every machine: {stdout}");
}

#[test]
fn a_group_served_by_a_provider_program_converges_and_tears_down() {
    let mut cluster = Cluster::new("exec");
    let double = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../provisioning-exec/tests/doubles/memory_provider.py");
    assert!(
        double.exists(),
        "the reference double is at {}",
        double.display()
    );
    cluster.write_text(&format!(
        "run = \"{}\"\n\n[providers.exec]\ncommand = [\"python3\", \"{}\"]\n\n[[group]]\nid = \"remote\"\ncount = 3\nprovider = \"exec\"\n",
        cluster.run,
        double.display()
    ));
    cluster.start();
    let status = cluster.wait_converged(1);
    assert_eq!(ids(&status), ["remote-0", "remote-1", "remote-2"]);
    assert_eq!(status["groups"][0]["provider"], "exec");
    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
}

#[test]
fn an_exec_provider_without_a_command_is_refused_with_its_line() {
    let cluster = Cluster::new("execbad");
    cluster.write_text(&format!(
        "run = \"{}\"\n\n[providers.exec]\ncommand = []\n",
        cluster.run
    ));
    let output = cluster.run(&["validate", cluster.file().to_str().expect("utf-8")]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("providers.exec.command"), "{stderr}");
}

#[test]
fn a_workload_that_exits_after_the_join_shows_its_exit_status_in_status() {
    let mut cluster = Cluster::new("exit3");
    cluster.write_text(&format!(
        "run = \"{}\"\n[[group]]\nid = \"web\"\ncount = 1\nbreaker_failures = 1\nbreaker_cooldown_secs = 3600\n[group.boot]\nstart_command = \"sleep 2; exit 3\"\n",
        cluster.run
    ));
    cluster.start();
    let paused = cluster.wait_for("the breaker to open", |s| {
        s["groups"][0]["paused"].as_str().is_some()
    });
    let expected = "workload exited with status 3";
    let node = &paused["nodes"][0];
    assert!(
        node["last_error"]
            .as_str()
            .is_some_and(|e| e.contains(expected)),
        "{paused:#}"
    );
    let table = cluster.run(&["status", "--run", &cluster.run]);
    let text = String::from_utf8_lossy(&table.stdout).into_owned();
    assert!(text.contains(expected), "LAST ERROR: {text}");
    let details = cluster.run(&["status", "web-0", "--json", "--run", &cluster.run]);
    let details: Value = serde_json::from_slice(&details.stdout).expect("node json");
    assert!(
        details["history"]
            .as_array()
            .expect("history")
            .iter()
            .any(|t| t["reason"].as_str() == Some(expected)),
        "{details:#}"
    );
    let log = cluster.up_stderr();
    assert!(
        !log.contains("Some(") && !log.contains("ExitStatus("),
        "no Rust debug forms in the log:\n{log}"
    );
}

/// Warnings of `log` that call a node lost or relay a signal's debug form.
fn loss_warnings(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|line| line.contains("WARN"))
        .filter(|line| line.contains("lost") || line.contains("signal=Some"))
        .collect()
}

#[test]
fn a_deliberate_teardown_logs_no_node_as_lost() {
    let mut cluster = Cluster::new("quiet-down");
    cluster.write(&[("web", 4, WORKLOAD), ("worker", 2, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    // A scale-down and a replacement are stops the controller orders.
    cluster.write(&[("web", 2, WORKLOAD), ("worker", 2, "sleep 3601")]);
    cluster.wait_converged(2);
    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(down.status.success(), "{}", cluster.up_output());
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());
    let log = cluster.up_stderr();
    assert_eq!(loss_warnings(&log), Vec::<&str>::new(), "{log}");
    assert!(
        !log.contains("WARN WARN") && !log.lines().any(|l| l.matches("WARN").count() > 1),
        "one level per line:\n{log}"
    );
}

#[test]
fn a_second_up_after_a_clean_down_starts_fresh_at_generation_1() {
    let mut cluster = Cluster::new("fresh");
    cluster.write(&[("web", 2, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    cluster.write(&[("web", 3, WORKLOAD)]);
    cluster.wait_converged(2);
    cluster.signal_up(Signal::SIGINT);
    assert!(cluster.wait_up_exit().success(), "{}", cluster.up_output());

    cluster.start();
    let status = cluster.wait_converged(1);
    assert_eq!(attempt_of(&status, "web-0"), 1, "{status:#}");
    let output = cluster.up.read("up.out");
    assert!(output.contains("generation 1 in force"), "{output}");
    for stale in ["generation 0 in force", "generation 3", "generation 4"] {
        assert!(!output.contains(stale), "{stale:?}:\n{output}");
    }
    let table = cluster.run(&["status", "--run", &cluster.run]);
    let text = String::from_utf8_lossy(&table.stdout).into_owned();
    assert!(
        text.starts_with(&format!("run {}  generation 1  ", cluster.run)),
        "{text}"
    );
}

#[test]
fn a_fresh_run_never_shows_generation_0() {
    let mut cluster = Cluster::new("gen0");
    cluster.write(&[("web", 1, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    let output = cluster.up.read("up.out");
    assert!(!output.contains("generation 0"), "{output}");
    assert!(output.contains("generation 1 in force"), "{output}");
}

#[test]
fn status_after_a_crashed_up_and_a_recovering_down_finds_no_dead_socket() {
    let mut cluster = Cluster::new("deadsock");
    cluster.write(&[("web", 1, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    cluster.signal_up(Signal::SIGKILL);
    let _ = cluster.wait_up_exit();
    let socket = cluster.socket_dir().join(format!("{}.sock", cluster.run));
    assert!(socket.exists(), "kill -9 leaves the socket");

    let down = cluster.run(&["down", "--run", &cluster.run]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(
        !socket.exists(),
        "the recovering down removes the dead socket"
    );

    // A dead socket of another crashed run is skipped, and said so with -v.
    let other = cluster.socket_dir().join("crashed-elsewhere.sock");
    drop(std::os::unix::net::UnixListener::bind(&other).expect("bind"));
    let status = cluster.run(&["-v", "status"]);
    let stderr = String::from_utf8_lossy(&status.stderr).into_owned();
    assert_eq!(status.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("no running `provision up` found"),
        "{stderr}"
    );
    assert!(
        stderr.contains("skipping") && stderr.contains("crashed-elsewhere.sock"),
        "{stderr}"
    );
    for wrong in ["several runs are up", "refused"] {
        assert!(!stderr.contains(wrong), "{wrong:?}: {stderr}");
    }
}

#[test]
fn validate_warns_when_no_group_asks_for_a_node() {
    let cluster = Cluster::new("zero");
    cluster.write(&[("web", 0, WORKLOAD), ("worker", 0, WORKLOAD)]);
    let file = cluster.file();
    let validate = cluster.run(&["validate", file.to_str().expect("utf-8 path")]);
    assert!(validate.status.success());
    let stderr = String::from_utf8_lossy(&validate.stderr);
    assert!(
        stderr.contains("warning:") && stderr.contains("no group asks for a node"),
        "{stderr}"
    );
    cluster.write(&[("web", 0, WORKLOAD), ("worker", 1, WORKLOAD)]);
    let validate = cluster.run(&["validate", file.to_str().expect("utf-8 path")]);
    assert!(!String::from_utf8_lossy(&validate.stderr).contains("warning"));
}

#[test]
fn up_warns_when_no_group_asks_for_a_node() {
    let mut cluster = Cluster::new("zero-up");
    cluster.write(&[("web", 0, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    let output = cluster.up.read("up.out");
    assert!(
        output.contains("warning:") && output.contains("no group asks for a node"),
        "{output}"
    );
}

#[test]
fn a_rollout_shows_old_spec_nodes_that_still_serve() {
    let mut cluster = Cluster::new("rollout");
    cluster.write(&[("web", 3, WORKLOAD)]);
    cluster.start();
    cluster.wait_converged(1);
    // Each new node takes 2 s to boot, so the old ones serve meanwhile.
    cluster.write_text(&format!(
        "run = \"{}\"\n[[group]]\nid = \"web\"\ncount = 3\n[group.boot]\nverify_commands = [\"sleep 2\"]\nstart_command = \"sleep 3601\"\n",
        cluster.run
    ));
    let during = cluster.wait_for("old-spec nodes serving during the rollout", |s| {
        s["generation"] == 2 && s["groups"][0]["ready_old"].as_u64().is_some_and(|n| n >= 1)
    });
    let group = &during["groups"][0];
    let (ready, old) = (
        group["ready"].as_u64().unwrap(),
        group["ready_old"].as_u64().unwrap(),
    );
    assert!(ready + old <= 3, "{during:#}");
    let table = cluster.run(&["status", "--run", &cluster.run]);
    let text = String::from_utf8_lossy(&table.stdout).into_owned();
    let line = text
        .lines()
        .find(|l| l.starts_with("group web"))
        .unwrap_or_default();
    assert!(
        line.contains(" old)")
            || cluster
                .status()
                .is_some_and(|s| s["groups"][0]["ready_old"] == 0),
        "{text}"
    );
    let done = cluster.wait_converged(2);
    assert_eq!(done["groups"][0]["ready_old"], 0, "{done:#}");
}
