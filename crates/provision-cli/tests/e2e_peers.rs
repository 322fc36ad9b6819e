//! End-to-end tests of what a workload is told (design §22): the real
//! `provision` binary on the local-process provider. Every workload records
//! its environment; every `on_peers_change` run copies the node's peers
//! file; the tests compare both with the ready nodes `status --json` shows,
//! after a bring-up, a kill and replacement, and a scale edit.

mod up;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use provisioning::RunId;
use provisioning_agent::os;
use serde_json::Value;
use up::{Bounds, POLL_INTERVAL, Up, nodes};

const BOUNDS: Bounds = Bounds {
    converge: Duration::from_secs(90),
    exit: Duration::from_secs(60),
    command: Duration::from_secs(30),
};

/// How long every node's peers file may take to list the ready nodes once
/// `status` shows them ready. Design §22 asks for 2 s from the fold; the
/// bound is looser because `status` is polled and the machine is shared.
const PEERS_CONVERGE_MAX: Duration = Duration::from_secs(10);

/// How long leftovers get to die in the drop guard.
const CLEANUP_BOUND: Duration = Duration::from_secs(10);

/// A run whose workloads record what they were told.
struct Told {
    up: Up,
}

impl Told {
    fn new(test: &str) -> Self {
        let run = format!("e2e-{test}-{}", std::process::id());
        let up = Up::new("provision-peers-", run, "shape.toml", BOUNDS);
        let dir = up.dir.path().display().to_string();
        fs::write(
            up.path("workload.sh"),
            format!(
                "env | grep '^PROVISION_' > \"{dir}/env.$PROVISION_NODE_ID.$PROVISION_ATTEMPT\"\nexec sleep 3600\n"
            ),
        )
        .expect("write the workload");
        fs::write(
            up.path("hook.sh"),
            format!(
                "copy=\"{dir}/hook.$PROVISION_NODE_ID.$PROVISION_ATTEMPT\"\ncp \"$PROVISION_PEERS_FILE\" \"$copy.tmp\" && mv \"$copy.tmp\" \"$copy\"\n"
            ),
        )
        .expect("write the hook");
        Told { up }
    }

    fn write(&self, groups: &[(&str, u32)]) {
        let dir = self.up.dir.path().display().to_string();
        let mut text = format!("run = \"{}\"\n", self.up.run);
        for (id, count) in groups {
            text.push_str(&format!(
                "\n[[group]]\nid = \"{id}\"\ncount = {count}\n[group.boot]\nstart_command = \"sh {dir}/workload.sh\"\non_peers_change = \"sh {dir}/hook.sh\"\n"
            ));
        }
        self.up.write_shape(&text);
    }

    fn wait_converged(&mut self, generation: u64) -> Value {
        self.up.wait_for(
            &format!("convergence at generation {generation}"),
            |s| s["converged"] == Value::Bool(true) && s["generation"] == generation,
            String::new,
        )
    }

    /// The environment the workload of `node`'s `attempt` recorded.
    fn env_of(&self, node: &str, attempt: u64) -> BTreeMap<String, String> {
        self.up
            .read(&format!("env.{node}.{attempt}"))
            .lines()
            .filter_map(|line| line.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// The `(node, attempt)` pairs a peers file lists.
    fn listed(text: &str) -> Option<BTreeSet<(String, u64)>> {
        let peers: Value = serde_json::from_str(text).ok()?;
        Some(
            peers["peers"]
                .as_array()?
                .iter()
                .map(|p| {
                    (
                        p["node"].as_str().unwrap_or_default().to_owned(),
                        p["attempt"].as_u64().unwrap_or_default(),
                    )
                })
                .collect(),
        )
    }

    /// Waits until the peers file of every ready node, and the copy its
    /// `on_peers_change` made, list exactly the ready nodes of `status`.
    fn wait_peers_agree(&self, status: &Value) {
        let ready: BTreeSet<(String, u64)> = nodes(status)
            .into_iter()
            .filter(|n| n.3)
            .map(|n| (n.0, n.1))
            .collect();
        let deadline = Instant::now() + PEERS_CONVERGE_MAX;
        loop {
            let mut disagreeing = Vec::new();
            for (node, attempt) in &ready {
                let env = self.env_of(node, *attempt);
                let live = env
                    .get("PROVISION_PEERS_FILE")
                    .and_then(|path| fs::read_to_string(path).ok())
                    .and_then(|text| Self::listed(&text));
                let copied = Self::listed(&self.up.read(&format!("hook.{node}.{attempt}")));
                if live.as_ref() != Some(&ready) || copied.as_ref() != Some(&ready) {
                    disagreeing.push(format!("{node}/{attempt}: file {live:?}, hook {copied:?}"));
                }
            }
            if disagreeing.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "peers files did not list {ready:?} within {PEERS_CONVERGE_MAX:?}: {disagreeing:#?}\n{}",
                self.up.output()
            );
            sleep(POLL_INTERVAL);
        }
    }

    /// Checks every ready node's environment: its place in the run, and
    /// that every group's indices are 0..size, each once.
    fn check_envs(&self, status: &Value, sizes: &[(&str, u32)]) {
        let mut indices: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        let mut addresses = BTreeSet::new();
        for (node, attempt, _, ready) in nodes(status) {
            assert!(ready, "{node} is ready");
            let env = self.env_of(&node, attempt);
            let group = env.get("PROVISION_GROUP").expect("PROVISION_GROUP").clone();
            let index: u32 = env["PROVISION_NODE_INDEX"].parse().expect("an index");
            assert_eq!(node, format!("{group}-{index}"), "{env:?}");
            assert_eq!(env["PROVISION_RUN"], self.up.run);
            assert_eq!(env["PROVISION_RUN_ID"], self.up.run, "the old name works");
            assert_eq!(env["PROVISION_NODE_ID"], node);
            assert_eq!(env["PROVISION_ATTEMPT"], attempt.to_string());
            let size = sizes.iter().find(|s| s.0 == group).expect("a group").1;
            assert_eq!(env["PROVISION_GROUP_SIZE"], size.to_string(), "{env:?}");
            let address = env.get("PROVISION_ADDRESS").expect("PROVISION_ADDRESS");
            assert!(
                addresses.insert(address.clone()),
                "every local node has a loopback address of its own: {address} twice"
            );
            indices.entry(group).or_default().push(index);
        }
        for (group, size) in sizes {
            let mut seen = indices.remove(*group).unwrap_or_default();
            seen.sort_unstable();
            assert_eq!(seen, (0..*size).collect::<Vec<_>>(), "ranks of {group}");
        }
    }

    fn run_id(&self) -> RunId {
        RunId::new(self.up.run.as_str())
    }
}

impl Drop for Told {
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

#[test]
fn every_workload_is_told_its_rank_and_every_peers_file_follows_kills_and_scaling() {
    let mut told = Told::new("peers");
    told.write(&[("head", 1), ("workers", 3)]);
    told.up.start(&[], &[], 30);
    let first = told.wait_converged(1);
    told.check_envs(&first, &[("head", 1), ("workers", 3)]);
    told.wait_peers_agree(&first);

    // A killed node is replaced in its slot; every peers file follows.
    let old = attempt_of(&first, "workers-1");
    let victim = os::run_processes(&told.run_id())
        .expect("read /proc")
        .into_iter()
        .find(|p| p.is_group_leader() && p.node.as_deref() == Some("workers-1"))
        .expect("the agent of workers-1 runs");
    kill(Pid::from_raw(victim.pid), Signal::SIGKILL).expect("kill the agent");
    let replaced = told.up.wait_for(
        "workers-1 replaced",
        |s| s["converged"] == Value::Bool(true) && attempt_of(s, "workers-1") != old,
        String::new,
    );
    told.check_envs(&replaced, &[("head", 1), ("workers", 3)]);
    let address = |status: &Value| {
        told.env_of("workers-1", attempt_of(status, "workers-1"))["PROVISION_ADDRESS"].clone()
    };
    assert_eq!(
        address(&first),
        address(&replaced),
        "a replacement keeps its slot's address"
    );
    told.wait_peers_agree(&replaced);

    // Scaling up and down: the new ranks are told the new size, and every
    // peers file lists exactly the nodes that remain.
    told.write(&[("head", 1), ("workers", 5)]);
    let grown = told.wait_converged(2);
    assert_eq!(nodes(&grown).len(), 6);
    told.wait_peers_agree(&grown);
    let new_rank = told.env_of("workers-4", attempt_of(&grown, "workers-4"));
    assert_eq!(new_rank["PROVISION_GROUP_SIZE"], "5");
    assert_eq!(new_rank["PROVISION_NODE_INDEX"], "4");
    told.write(&[("head", 1), ("workers", 2)]);
    let shrunk = told.wait_converged(3);
    assert_eq!(nodes(&shrunk).len(), 3);
    told.wait_peers_agree(&shrunk);

    let listing = told
        .up
        .run_command(&["peers", "--json", "--run", &told.up.run]);
    if listing.status.success() {
        let listed = Told::listed(&String::from_utf8_lossy(&listing.stdout));
        let ready: BTreeSet<(String, u64)> =
            nodes(&shrunk).into_iter().map(|n| (n.0, n.1)).collect();
        assert_eq!(listed, Some(ready), "provision peers lists the same set");
    }

    told.up.signal(Signal::SIGINT);
    assert!(told.up.wait_exit().success(), "{}", told.up.output());
}
