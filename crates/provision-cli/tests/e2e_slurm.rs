//! End-to-end on Slurm: the real `provision up` binary against a real
//! four-node Slurm cluster on this machine (`provisioning_slurm::testbed`).
//! The agent is the `provision` binary itself, run as a job step. Every
//! wait is bounded; `up` is killed and the testbed (daemons, jobs, steps,
//! files) torn down in `Drop`, also when the test fails. Jobs are counted
//! from `squeue`, independently of the plugin.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use provisioning_slurm::testbed::Testbed;
use serde_json::Value;

const BINARY: &str = env!("CARGO_BIN_EXE_provision");
/// The bound on convergence.
const CONVERGE_BOUND: Duration = Duration::from_secs(120);
/// The bound on `up` exiting after it was asked to.
const EXIT_BOUND: Duration = Duration::from_secs(90);
/// The bound on one short command.
const COMMAND_BOUND: Duration = Duration::from_secs(30);
const POLL_INTERVAL: Duration = Duration::from_millis(200);
const NODES: usize = 4;

/// `provision up` over a testbed; dropping it kills `up`, then the testbed.
struct SlurmCluster {
    up: Option<Child>,
    run: String,
    dir: tempfile::TempDir,
    // Last: torn down after `up` is dead.
    bed: Testbed,
}

impl SlurmCluster {
    fn new(test: &str) -> Self {
        Self::build(test, None)
    }

    /// With the swarm listener on a fixed port of 127.0.0.1, so that a
    /// restarted `up` listens where the running agents re-dial.
    fn with_listen(test: &str, port: u16) -> Self {
        Self::build(test, Some(port))
    }

    fn build(test: &str, listen: Option<u16>) -> Self {
        let bed = Testbed::start(NODES);
        let dir = tempfile::Builder::new()
            .prefix("provision-e2e-slurm-")
            .tempdir()
            .expect("a temporary directory");
        let run = format!("e2e-slurm-{test}-{}", std::process::id());
        let shape = format!(
            "run = \"{run}\"\n\n[providers.slurm]\nslurm_conf = \"{conf}\"\n{listen}\n\
             [[group]]\nid = \"workers\"\ncount = {NODES}\nprovider = \"slurm\"\n\
             slurm = {{ partition = \"debug\", cpus = 1, memory = \"100M\" }}\n\
             [group.boot]\nverify_commands = [\"test -d /proc/self\"]\nstart_command = \"sleep 3600\"\n",
            conf = bed.conf().display(),
            listen = listen.map_or(String::new(), |port| format!(
                "listen = \"127.0.0.1:{port}\"\n"
            )),
        );
        let cluster = SlurmCluster {
            up: None,
            run,
            dir,
            bed,
        };
        fs::write(cluster.file(), shape).expect("write the shape file");
        cluster
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("slurm.toml")
    }

    fn prefix(&self) -> String {
        format!("prov+{}+", self.run)
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(BINARY);
        command
            .args(args)
            .env("PROVISION_SOCKET_DIR", self.dir.path().join("sockets"))
            .env("PROVISION_STATE_DIR", self.dir.path().join("state"))
            .env_remove("PROVISION_SOCKET")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null());
        command
    }

    fn start(&mut self) {
        let append = |name: &str| {
            fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.path().join(name))
                .expect("output file")
        };
        let child = self
            .command(&[])
            .args(["up", "--plain", "--shutdown-timeout", "60"])
            .arg(self.file())
            .stdout(append("up.out"))
            .stderr(append("up.err"))
            .spawn()
            .expect("start provision up");
        self.up = Some(child);
    }

    /// The `up` log so far (both lives of a restarted `up` append to it).
    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("up.err")).unwrap_or_default()
    }

    fn up_output(&self) -> String {
        let read = |name: &str| fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        let err = read("up.err");
        let tail: Vec<&str> = err.lines().rev().take(80).collect();
        format!(
            "--- up stdout ---\n{}\n--- up stderr (last 80 lines) ---\n{}\n--- squeue ---\n{:?}",
            read("up.out"),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            self.bed.jobs()
        )
    }

    fn run_command(&self, args: &[&str]) -> Output {
        let mut child = self
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start provision");
        let deadline = Instant::now() + COMMAND_BOUND;
        loop {
            if child.try_wait().expect("poll").is_some() {
                return child.wait_with_output().expect("output");
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                panic!("provision {args:?} did not finish in {COMMAND_BOUND:?}");
            }
            sleep(Duration::from_millis(20));
        }
    }

    fn status(&self) -> Option<Value> {
        let output = self.run_command(&["status", "--json", "--run", &self.run]);
        output
            .status
            .success()
            .then(|| serde_json::from_slice(&output.stdout).expect("status --json is JSON"))
    }

    fn wait_for(&mut self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + CONVERGE_BOUND;
        let mut last = None;
        loop {
            if let Some(status) = self.status() {
                if done(&status) {
                    return status;
                }
                last = Some(status);
            }
            if let Some(child) = self.up.as_mut()
                && let Ok(Some(exit)) = child.try_wait()
            {
                panic!(
                    "up exited ({exit}) while waiting for {what}\n{}",
                    self.up_output()
                );
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; last status: {last:#?}\n{}",
                self.up_output()
            );
            sleep(POLL_INTERVAL);
        }
    }

    fn wait_up_exit(&mut self) -> ExitStatus {
        let mut child = self.up.take().expect("up runs");
        let deadline = Instant::now() + EXIT_BOUND;
        loop {
            if let Some(exit) = child.try_wait().expect("poll up") {
                return exit;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("up did not exit in time\n{}", self.up_output());
            }
            sleep(POLL_INTERVAL);
        }
    }

    /// The run's jobs that hold or wait for an allocation, from `squeue`.
    fn live_job_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .bed
            .live_jobs(&self.prefix())
            .into_iter()
            .map(|(id, ..)| id)
            .collect();
        ids.sort_unstable();
        ids
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        if let Some(mut child) = self.up.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn nodes(status: &Value) -> Vec<(String, u64, bool)> {
    status["nodes"]
        .as_array()
        .expect("nodes is an array")
        .iter()
        .map(|n| {
            (
                n["id"].as_str().expect("id").to_owned(),
                n["attempt"].as_u64().expect("attempt"),
                n["ready"].as_bool().expect("ready"),
            )
        })
        .collect()
}

fn ready(status: &Value) -> usize {
    nodes(status).iter().filter(|n| n.2).count()
}

#[test]
fn a_slurm_fleet_converges_replaces_a_cancelled_job_and_ctrl_c_leaves_no_job() {
    let mut cluster = SlurmCluster::new("converge");
    cluster.start();
    let first = cluster.wait_for("convergence with every node ready", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES
    });
    let jobs = cluster.live_job_ids();
    assert_eq!(
        nodes(&first).iter().filter(|n| n.1 > NODES as u64).count(),
        0,
        "every node came up at its first attempt: {:?}\n{}",
        nodes(&first),
        cluster.up_output()
    );
    assert_eq!(
        jobs.len(),
        NODES,
        "one job per node\n{}",
        cluster.up_output()
    );
    let before = nodes(&first);

    // Someone cancels one node's job: the node is lost and replaced.
    let victim = jobs[0];
    cluster.bed.cancel_by_hand(victim);
    let changed = |s: &Value| {
        nodes(s)
            .iter()
            .zip(&before)
            .filter(|(now, then)| now.1 != then.1)
            .count()
    };
    let replaced = cluster.wait_for("the cancelled node's replacement", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES && changed(s) >= 1
    });
    let after = cluster.live_job_ids();
    assert_eq!(after.len(), NODES, "{}", cluster.up_output());
    assert!(!after.contains(&victim), "the cancelled job is gone");
    assert_eq!(
        changed(&replaced),
        1,
        "exactly one node was replaced: {before:?} then {:?}\n{}",
        nodes(&replaced),
        cluster.up_output()
    );

    // Ctrl-C: a graceful teardown that leaves no job of the run.
    kill(
        Pid::from_raw(i32::try_from(cluster.up.as_ref().expect("up").id()).expect("pid")),
        Signal::SIGINT,
    )
    .expect("SIGINT");
    let exit = cluster.wait_up_exit();
    assert!(
        exit.success(),
        "up exited with {exit}\n{}",
        cluster.up_output()
    );
    assert_eq!(
        cluster.live_job_ids(),
        Vec::<u64>::new(),
        "jobs left after Ctrl-C\n{}",
        cluster.up_output()
    );
}

/// A free port of 127.0.0.1.
fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[test]
fn after_kill_9_of_up_a_restart_adopts_every_job_and_its_running_agent() {
    let mut cluster = SlurmCluster::with_listen("crash", free_port());
    cluster.start();
    let first = cluster.wait_for("convergence with every node ready", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES
    });
    let jobs = cluster.live_job_ids();
    assert_eq!(jobs.len(), NODES, "{}", cluster.up_output());

    // The controller dies without a word; jobs and agent steps stay.
    let mut up = cluster.up.take().expect("up runs");
    up.kill().expect("SIGKILL");
    let _ = up.wait();
    assert_eq!(
        cluster.live_job_ids(),
        jobs,
        "the jobs outlive the controller"
    );
    let before_restart = cluster.log().len();

    cluster.start();
    let again = cluster.wait_for("convergence after the restart", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES
    });
    // Every running agent re-joins the restarted controller (adopted): its
    // workload was not started again.
    let deadline = Instant::now() + CONVERGE_BOUND;
    loop {
        let log = cluster.log();
        let rejoined = log
            .get(before_restart..)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("remote agent joined the swarm"))
            .count();
        if rejoined >= NODES {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {rejoined} of {NODES} agents re-joined the restarted controller\n{}",
            cluster.up_output()
        );
        sleep(POLL_INTERVAL);
    }
    assert_eq!(
        nodes(&again),
        nodes(&first),
        "no node was replaced (same attempts, all ready)\n{}",
        cluster.up_output()
    );
    assert_eq!(
        cluster.live_job_ids(),
        jobs,
        "the same jobs, none doubled\n{}",
        cluster.up_output()
    );
    let launches = cluster.log()[before_restart..]
        .lines()
        .filter(|l| l.contains("starting the agent step"))
        .count();
    assert_eq!(
        launches,
        0,
        "no agent step was started again\n{}",
        cluster.up_output()
    );

    kill(
        Pid::from_raw(i32::try_from(cluster.up.as_ref().expect("up").id()).expect("pid")),
        Signal::SIGINT,
    )
    .expect("SIGINT");
    let exit = cluster.wait_up_exit();
    assert!(
        exit.success(),
        "up exited with {exit}\n{}",
        cluster.up_output()
    );
    assert_eq!(
        cluster.live_job_ids(),
        Vec::<u64>::new(),
        "jobs left after Ctrl-C\n{}",
        cluster.up_output()
    );
}
