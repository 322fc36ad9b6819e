//! End-to-end on Slurm: the real `provision up` binary against a real
//! four-node Slurm cluster on this machine (`provisioning_slurm::testbed`).
//! The agent is the `provision` binary itself, run as a job step. Every
//! wait is bounded; `up` is killed and the testbed (daemons, jobs, steps,
//! files) torn down in `Drop`, also when the test fails. Jobs are counted
//! from `squeue`, independently of the plugin.

mod up;

use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use provisioning_slurm::testbed::Testbed;
use serde_json::Value;
use up::{Bounds, CrashPoints, POLL_INTERVAL, Up, nodes, ready, ready_nodes};

const BOUNDS: Bounds = Bounds {
    converge: Duration::from_secs(120),
    exit: Duration::from_secs(90),
    command: Duration::from_secs(30),
};
const NODES: usize = 4;

/// `provision up` over a testbed; dropping it kills `up`, then the testbed.
struct SlurmCluster {
    up: Up,
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
        let run = format!("e2e-slurm-{test}-{}", std::process::id());
        let up = Up::new("provision-e2e-slurm-", run, "slurm.toml", BOUNDS)
            .with_log("info")
            .appending();
        let shape = format!(
            "run = \"{run}\"\n\n[providers.slurm]\nslurm_conf = \"{conf}\"\n{listen}\n\
             [[group]]\nid = \"workers\"\ncount = {NODES}\nprovider = \"slurm\"\n\
             slurm = {{ partition = \"debug\", cpus = 1, memory = \"100M\" }}\n\
             [group.boot]\nverify_commands = [\"test -d /proc/self\"]\nstart_command = \"sleep 3600\"\n",
            run = up.run,
            conf = bed.conf().display(),
            listen = listen.map_or(String::new(), |port| format!(
                "listen = \"127.0.0.1:{port}\"\n"
            )),
        );
        up.write_shape(&shape);
        SlurmCluster { up, bed }
    }

    fn prefix(&self) -> String {
        format!("prov+{}+", self.up.run)
    }

    fn start(&mut self) {
        self.up.start(&[], &[], 60);
    }

    /// The `up` log so far (both lives of a restarted `up` append to it).
    fn log(&self) -> String {
        self.up.log()
    }

    fn up_output(&self) -> String {
        format!(
            "{}\n--- squeue ---\n{:?}",
            self.up.output(),
            self.bed.jobs()
        )
    }

    fn wait_for(&mut self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let bed = &self.bed;
        self.up
            .wait_for(what, done, || format!("--- squeue ---\n{:?}", bed.jobs()))
    }

    fn wait_up_exit(&mut self) -> std::process::ExitStatus {
        self.up.wait_exit()
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
    cluster.up.signal(Signal::SIGINT);
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
    restart_adopts_every_job(SlurmCluster::with_listen("crash", free_port()));
}

/// With no `listen` configured, the first `up` picks a port and keeps it in
/// the run's state; the restarted one listens there again, so the agent
/// steps it left running re-join it.
#[test]
fn without_a_configured_port_a_restart_listens_where_the_agents_redial_and_adopts_them() {
    restart_adopts_every_job(SlurmCluster::new("crash-default-port"));
}

/// Converges, kills `up` with SIGKILL, starts it again: every job and agent
/// step is adopted (same jobs, same attempts, no step started again), the
/// run converges only once every agent re-joined, and Ctrl-C leaves no job.
fn restart_adopts_every_job(mut cluster: SlurmCluster) {
    cluster.start();
    let first = cluster.wait_for("convergence with every node ready", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES
    });
    let jobs = cluster.live_job_ids();
    assert_eq!(jobs.len(), NODES, "{}", cluster.up_output());

    // The controller dies without a word; jobs and agent steps stay.
    cluster.up.kill();
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
    let deadline = Instant::now() + BOUNDS.converge;
    loop {
        let log = cluster.log();
        let rejoined = log
            .get(before_restart..)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("agent joined the swarm"))
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

    cluster.up.signal(Signal::SIGINT);
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

/// Crash chaos on Slurm: `kill -9` of `up` at pseudo-random points of a
/// bring-up, ten times. After each restart: exactly the declared jobs (by
/// `squeue`), one per slot, each its node's current attempt; every node
/// that was ready before the crash keeps its attempt and its job (its
/// workload never restarted); and Ctrl-C leaves no job of the run.
#[test]
fn kill_9_of_up_at_pseudo_random_points_of_a_slurm_bring_up_ends_with_exactly_the_declared_jobs() {
    const CRASHES: u32 = 10;
    let mut cluster = SlurmCluster::new("chaos");
    let mut points = CrashPoints::new(0x9e37_79b9_7f4a_7c15);
    // Crashes that found ready nodes to keep: the run is not vacuous.
    let mut kept_ready = 0;
    for crash in 0..CRASHES {
        cluster.start();
        sleep(points.next_below(Duration::from_millis(3_000)));
        let before = cluster
            .up
            .status()
            .map(|s| ready_nodes(&s))
            .unwrap_or_default();
        let jobs_before = cluster.bed.live_jobs(&cluster.prefix());
        cluster.up.kill();

        cluster.start();
        let status = cluster.wait_for("convergence after the restart", |s| {
            s["converged"] == Value::Bool(true) && ready(s) == NODES
        });
        let jobs = cluster.bed.live_jobs(&cluster.prefix());
        let mut names: Vec<String> = jobs.iter().map(|(_, name, ..)| name.clone()).collect();
        names.sort();
        let expected: Vec<String> = {
            let mut expected: Vec<String> = nodes(&status)
                .iter()
                .map(|(id, attempt, ..)| format!("{}{id}+a{attempt}", cluster.prefix()))
                .collect();
            expected.sort();
            expected
        };
        assert_eq!(
            names,
            expected,
            "crash {crash}: exactly one live job per node, of its current attempt\n{}",
            cluster.up_output()
        );
        kept_ready += before.len();
        for (id, attempt) in &before {
            let name = format!("{}{id}+a{attempt}", cluster.prefix());
            let was = jobs_before
                .iter()
                .find(|(_, n, ..)| *n == name)
                .map(|j| j.0);
            let is = jobs.iter().find(|(_, n, ..)| *n == name).map(|j| j.0);
            assert!(
                was.is_some() && was == is,
                "crash {crash}: {name}, ready before the crash, kept its job ({was:?} then {is:?})\n{}",
                cluster.up_output()
            );
        }
        cluster.up.signal(Signal::SIGINT);
        let exit = cluster.wait_up_exit();
        assert!(
            exit.success(),
            "crash {crash}: up exited with {exit}\n{}",
            cluster.up_output()
        );
        assert_eq!(
            cluster.live_job_ids(),
            Vec::<u64>::new(),
            "crash {crash}: jobs left after Ctrl-C\n{}",
            cluster.up_output()
        );
    }
    assert!(
        kept_ready > 0,
        "no crash found a ready node: the crash points are all too early"
    );
    eprintln!("{kept_ready} ready node(s) kept across {CRASHES} crashes");
}
