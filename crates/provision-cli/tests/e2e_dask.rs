//! A real distributed engine across a local fleet (design §22): the Dask
//! cluster of `examples/dask.toml` under the real `provision` binary. The
//! workers find the scheduler in their peers file; the example's client
//! finds it with `provision peers` and runs a computation on every worker,
//! after the bring-up, after a worker's node is killed and replaced, and
//! after `workers` is scaled from 3 to 5.
//!
//! Needs `dask[distributed]` in the test virtual environment
//! (`scripts/test-deps.sh`; `PROVISION_TEST_VENV` names another one).

mod up;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use provisioning::RunId;
use provisioning_agent::os;
use serde_json::Value;
use up::{BINARY, Bounds, Up, nodes, wait_output};

const BOUNDS: Bounds = Bounds {
    converge: Duration::from_secs(120),
    exit: Duration::from_secs(60),
    command: Duration::from_secs(30),
};

/// How long one run of the client may take (it waits for the workers).
const CLIENT_BOUND: Duration = Duration::from_secs(180);

/// How long leftovers get to die in the drop guard.
const CLEANUP_BOUND: Duration = Duration::from_secs(10);

/// The Python of the test virtual environment, checked to import Dask.
fn venv_python() -> PathBuf {
    let venv = std::env::var_os("PROVISION_TEST_VENV").map_or_else(
        || PathBuf::from("/opt/provisioning-test/venv"),
        PathBuf::from,
    );
    let python = venv.join("bin").join("python");
    let imports = Command::new(&python)
        .args(["-c", "import dask.distributed"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        imports,
        "{} cannot import dask.distributed: install it with scripts/test-deps.sh",
        python.display()
    );
    python
}

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

struct Dask {
    up: Up,
    python: PathBuf,
    port: u16,
}

impl Dask {
    fn new() -> Self {
        let run = format!("e2e-dask-{}", std::process::id());
        let up = Up::new("provision-dask-", run, "dask.toml", BOUNDS);
        // A port of this test's own, so two runs on one machine never meet.
        let port = 20_000 + u16::try_from(std::process::id() % 20_000).expect("fits");
        Dask {
            up,
            python: venv_python(),
            port,
        }
    }

    /// `examples/dask.toml` with this test's run, Python, port and worker
    /// count, and the node script by its absolute path.
    fn write(&self, workers: u32) {
        let example = std::fs::read_to_string(examples().join("dask.toml")).expect("the example");
        let node = examples().join("dask/node.py").display().to_string();
        let text = example
            .replace("run = \"dask-demo\"", &format!("run = \"{}\"", self.up.run))
            .replace("count = 3", &format!("count = {workers}"))
            .replace("examples/dask/node.py", &node)
            .replace(
                "[group.boot]\n",
                &format!(
                    "[group.boot]\nenv = {{ DASK_PYTHON = \"{}\", DASK_SCHEDULER_PORT = \"{}\" }}\n",
                    self.python.display(),
                    self.port
                ),
            );
        self.up.write_shape(&text);
    }

    fn wait_converged(&mut self, generation: u64) -> Value {
        self.up.wait_for(
            &format!("convergence at generation {generation}"),
            |s| s["converged"] == Value::Bool(true) && s["generation"] == generation,
            String::new,
        )
    }

    /// Runs the example's client; returns the worker names it saw and the
    /// sum it computed.
    fn compute(&self, workers: u32) -> (Vec<String>, u64) {
        let child = Command::new(&self.python)
            .arg(examples().join("dask/client.py"))
            .args(["--workers", &workers.to_string()])
            .args(["--run", &self.up.run])
            .args(["--provision", BINARY])
            .args(["--port", &self.port.to_string()])
            .env("PROVISION_SOCKET_DIR", self.up.socket_dir())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start the client");
        let output = wait_output(child, CLIENT_BOUND, "the Dask client");
        assert!(
            output.status.success(),
            "the client failed: {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            self.up.output()
        );
        let answer: Value = serde_json::from_slice(&output.stdout).expect("one JSON line");
        let names = answer["workers"]
            .as_array()
            .expect("names")
            .iter()
            .map(|n| n.as_str().unwrap_or_default().to_owned())
            .collect();
        (names, answer["sum"].as_u64().expect("a sum"))
    }

    fn run_id(&self) -> RunId {
        RunId::new(self.up.run.as_str())
    }
}

impl Drop for Dask {
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

const SUM_OF_SQUARES_BELOW_100: u64 = 328_350;

#[test]
fn a_dask_cluster_runs_on_every_worker_after_a_kill_and_a_scale_up() {
    let mut dask = Dask::new();
    dask.write(3);
    dask.up.start(&[], &[], 30);
    let first = dask.wait_converged(1);
    let (names, sum) = dask.compute(3);
    assert_eq!(names, ["workers-0", "workers-1", "workers-2"]);
    assert_eq!(sum, SUM_OF_SQUARES_BELOW_100);

    // A killed worker node is replaced; its new worker registers again.
    let old = attempt_of(&first, "workers-1");
    let victim = os::run_processes(&dask.run_id())
        .expect("read /proc")
        .into_iter()
        .find(|p| p.is_group_leader() && p.node.as_deref() == Some("workers-1"))
        .expect("the agent of workers-1 runs");
    kill(Pid::from_raw(victim.pid), Signal::SIGKILL).expect("kill the agent");
    dask.up.wait_for(
        "workers-1 replaced",
        |s| s["converged"] == Value::Bool(true) && attempt_of(s, "workers-1") != old,
        String::new,
    );
    let (names, _) = dask.compute(3);
    assert_eq!(names, ["workers-0", "workers-1", "workers-2"]);

    // Scaling the workers 3 → 5 registers five workers.
    dask.write(5);
    dask.wait_converged(2);
    let (names, sum) = dask.compute(5);
    assert_eq!(names.len(), 5, "{names:?}");
    assert_eq!(sum, SUM_OF_SQUARES_BELOW_100);

    dask.up.signal(Signal::SIGINT);
    assert!(dask.up.wait_exit().success(), "{}", dask.up.output());
}
