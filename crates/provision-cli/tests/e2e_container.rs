//! End-to-end on containers: the real `provision up` binary against a
//! private Docker engine on this machine (`provisioning_container::testbed`:
//! its own `dockerd` on its own socket, a bridge network of its own, a test
//! image built locally). The agent is the slim `provision-agent` beside
//! `provision` (or `provision` itself), bind-mounted read-only into every
//! container. Every wait is bounded; `up` is killed and the engine
//! (containers, network, daemon, files) torn down in `Drop`, also when the
//! test fails. Containers are counted from the engine's own listing,
//! independently of the plugin.

mod up;

use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use provisioning_container::testbed::{Engine, TEST_IMAGE};
use serde_json::Value;
use up::{BINARY, Bounds, POLL_INTERVAL, Up, nodes, ready};

const BOUNDS: Bounds = Bounds {
    converge: Duration::from_secs(120),
    exit: Duration::from_secs(90),
    command: Duration::from_secs(30),
};
const NODES: usize = 3;

/// `provision up` over a private engine; dropping it kills `up`, then the
/// engine.
struct ContainerFleet {
    up: Up,
    // Last: torn down after `up` is dead.
    engine: Engine,
}

/// A free port of `ip`.
fn free_port(ip: std::net::IpAddr) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

impl ContainerFleet {
    fn new(test: &str) -> Self {
        let engine = Engine::start(std::path::Path::new(BINARY));
        let run = format!("e2e-container-{test}-{}", std::process::id());
        let up = Up::new("provision-e2e-container-", run, "containers.toml", BOUNDS)
            .with_log("info")
            .appending();
        // A fixed port on the network's gateway: containers reach it, and a
        // restarted `up` listens where the running agents re-dial.
        let listen = format!("{}:{}", engine.gateway(), free_port(engine.gateway()));
        let shape = format!(
            "run = \"{run}\"\n\n[providers.container]\nsocket = \"{socket}\"\nlisten = \"{listen}\"\nstop_grace_secs = 2\n\n\
             [[group]]\nid = \"workers\"\ncount = {NODES}\nprovider = \"container\"\n\
             container = {{ image = \"{TEST_IMAGE}\", network = \"{network}\", memory = \"128m\" }}\n\
             [group.boot]\nverify_commands = [\"test -d /proc/self\"]\nstart_command = \"sleep 3600\"\n",
            run = up.run,
            socket = engine.socket(),
            network = engine.network(),
        );
        up.write_shape(&shape);
        ContainerFleet { up, engine }
    }

    fn prefix(&self) -> String {
        format!("prov.{}.", self.up.run)
    }

    fn start(&mut self) {
        self.up.start(&[], &[], 60);
    }

    fn log(&self) -> String {
        self.up.log()
    }

    fn up_output(&self) -> String {
        format!(
            "{}\n--- containers ---\n{:?}",
            self.up.output(),
            self.engine.containers("")
        )
    }

    fn wait_for(&mut self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let engine = &self.engine;
        self.up.wait_for(what, done, || {
            format!("--- containers ---\n{:?}", engine.containers(""))
        })
    }

    /// The ids of the run's containers that run, from the engine.
    fn running_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .engine
            .containers(&self.prefix())
            .into_iter()
            .filter(|(_, _, state)| state == "running")
            .map(|(id, ..)| id)
            .collect();
        ids.sort();
        ids
    }

    /// Every container of the run, any state.
    fn all_ids(&self) -> Vec<String> {
        self.engine
            .containers(&self.prefix())
            .into_iter()
            .map(|(id, ..)| id)
            .collect()
    }
}

#[test]
fn a_container_fleet_converges_replaces_a_killed_container_and_ctrl_c_leaves_none() {
    let mut fleet = ContainerFleet::new("converge");
    fleet.start();
    let first = fleet.wait_for("convergence with every node ready", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES
    });
    let containers = fleet.running_ids();
    assert_eq!(
        containers.len(),
        NODES,
        "one container per node\n{}",
        fleet.up_output()
    );
    let before = nodes(&first);

    // Someone kills one node's container: the node is lost and replaced.
    let victim = containers[0].clone();
    fleet.engine.docker_ok(&["kill", &victim]);
    let changed = |s: &Value| {
        nodes(s)
            .iter()
            .zip(&before)
            .filter(|(now, then)| now.1 != then.1)
            .count()
    };
    let replaced = fleet.wait_for("the killed node's replacement", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES && changed(s) >= 1
    });
    assert_eq!(
        changed(&replaced),
        1,
        "exactly one node was replaced: {before:?} then {:?}\n{}",
        nodes(&replaced),
        fleet.up_output()
    );
    let deadline = Instant::now() + BOUNDS.converge;
    // The killed container is destroyed (removed) once its node is replaced.
    while fleet.all_ids().contains(&victim) {
        assert!(
            Instant::now() < deadline,
            "the killed container was never removed\n{}",
            fleet.up_output()
        );
        sleep(POLL_INTERVAL);
    }
    assert_eq!(fleet.running_ids().len(), NODES, "{}", fleet.up_output());

    // Ctrl-C: a graceful teardown that leaves no container of the run.
    fleet.up.signal(Signal::SIGINT);
    let exit = fleet.up.wait_exit();
    assert!(
        exit.success(),
        "up exited with {exit}\n{}",
        fleet.up_output()
    );
    assert_eq!(
        fleet.all_ids(),
        Vec::<String>::new(),
        "containers left after Ctrl-C\n{}",
        fleet.up_output()
    );
}

#[test]
fn after_kill_9_of_up_a_restart_adopts_every_container_and_its_running_agent() {
    let mut fleet = ContainerFleet::new("crash");
    fleet.start();
    let first = fleet.wait_for("convergence with every node ready", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES
    });
    let containers = fleet.running_ids();
    assert_eq!(containers.len(), NODES, "{}", fleet.up_output());

    // The controller dies without a word; containers and agents stay.
    fleet.up.kill();
    assert_eq!(
        fleet.running_ids(),
        containers,
        "the containers outlive the controller"
    );
    let before_restart = fleet.log().len();

    fleet.start();
    let again = fleet.wait_for("convergence after the restart", |s| {
        s["converged"] == Value::Bool(true) && ready(s) == NODES
    });
    let deadline = Instant::now() + BOUNDS.converge;
    loop {
        let rejoined = fleet
            .log()
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
            fleet.up_output()
        );
        sleep(POLL_INTERVAL);
    }
    assert_eq!(
        nodes(&again),
        nodes(&first),
        "no node was replaced (same attempts, all ready)\n{}",
        fleet.up_output()
    );
    assert_eq!(
        fleet.running_ids(),
        containers,
        "the same container ids, none doubled\n{}",
        fleet.up_output()
    );
    let launches = fleet.log()[before_restart..]
        .lines()
        .filter(|l| l.contains("starting the agent"))
        .count();
    assert_eq!(
        launches,
        0,
        "no agent was started again\n{}",
        fleet.up_output()
    );

    fleet.up.signal(Signal::SIGINT);
    let exit = fleet.up.wait_exit();
    assert!(
        exit.success(),
        "up exited with {exit}\n{}",
        fleet.up_output()
    );
    assert_eq!(
        fleet.all_ids(),
        Vec::<String>::new(),
        "containers left after Ctrl-C\n{}",
        fleet.up_output()
    );
}
