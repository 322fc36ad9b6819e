//! What the tests on the real testbed share: a plugin over a [`Testbed`],
//! a [`SlurmCli`] that puts real faults between the plugin and the tools,
//! node specs and a bounded wait.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use provisioning::{
    BootParams, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate,
    ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_agent::RunSecret;
use provisioning_provider::AttemptKey;
use provisioning_slurm::testbed::Testbed;
use provisioning_slurm::{
    CommandFailure, CommandOutput, SlurmCli, SlurmPlugin, SlurmPluginConfig, SystemCli, Tool,
};

/// The agent binary of this crate.
pub const AGENT: &str = env!("CARGO_BIN_EXE_provision-slurm-agent");

/// How a faulted call fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The tool runs against a closed controller port: a real connect
    /// failure before anything was sent.
    Unreachable,
    /// The tool runs for real, then its output is thrown away as if the
    /// call had timed out.
    ReplyLost,
}

/// The real tools, with faults armed per tool for the next call.
pub struct FaultyCli {
    real: SystemCli,
    unreachable: SystemCli,
    armed: Mutex<BTreeMap<Tool, Fault>>,
}

impl FaultyCli {
    pub fn new(bed: &Testbed) -> Self {
        FaultyCli {
            real: SystemCli::new(Some(bed.conf().to_owned()), COMMAND_TIMEOUT),
            unreachable: SystemCli::new(Some(bed.unreachable_conf().to_owned()), COMMAND_TIMEOUT),
            armed: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn arm(&self, tool: Tool, fault: Fault) {
        self.armed.lock().expect("armed").insert(tool, fault);
    }
}

#[async_trait]
impl SlurmCli for FaultyCli {
    async fn run(&self, tool: Tool, args: &[String]) -> Result<CommandOutput, CommandFailure> {
        let fault = self.armed.lock().expect("armed").remove(&tool);
        match fault {
            None => self.real.run(tool, args).await,
            Some(Fault::Unreachable) => self.unreachable.run(tool, args).await,
            Some(Fault::ReplyLost) => {
                let _ = self.real.run(tool, args).await;
                Err(CommandFailure::TimedOut {
                    program: tool.program().to_owned(),
                    timeout: COMMAND_TIMEOUT,
                })
            }
        }
    }

    fn step_command(&self, args: &[String]) -> tokio::process::Command {
        self.real.step_command(args)
    }
}

/// The bound on one Slurm command in the tests.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// How often the plugin under test looks for jobs that ended.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// The longest any wait of a test takes before it fails with a diagnosis.
pub const WAIT: Duration = Duration::from_secs(60);

pub fn config(bed: &Testbed, run: &str) -> SlurmPluginConfig {
    let mut config = SlurmPluginConfig::new(
        RunId::new(run),
        RunSecret::generate(),
        vec![AGENT.to_owned()],
    );
    config.slurm_conf = Some(bed.conf().to_owned());
    config.watch_interval = WATCH_INTERVAL;
    config.rejoin_grace = Duration::from_millis(500);
    config
}

/// A plugin of `run` over the testbed, with its fault hook.
pub async fn plugin(bed: &Testbed, run: &str) -> (Arc<SlurmPlugin>, Arc<FaultyCli>) {
    let cli = Arc::new(FaultyCli::new(bed));
    let plugin = SlurmPlugin::start_with_cli(config(bed, run), cli.clone())
        .await
        .expect("start the slurm plugin");
    (Arc::new(plugin), cli)
}

pub fn key(run: &str, node: &str, attempt: u64) -> AttemptKey {
    AttemptKey {
        run_id: RunId::new(run),
        node: LogicalNodeId::parse(node).expect("node id"),
        attempt: NodeAttemptId::from_raw(attempt),
    }
}

/// A spec of `key`'s slot with `labels` (the group's `slurm` table) and
/// `start` as the workload.
pub fn spec(key: &AttemptKey, labels: BTreeMap<String, String>, start: &str) -> LogicalNodeSpec {
    let template = NodeTemplate {
        role: key.node.group().as_str().to_owned(),
        provider: "slurm".to_owned(),
        shape: ProviderShape {
            image: String::new(),
            resources: BTreeMap::new(),
            labels,
        },
        boot: BootParams {
            on_peers_change: String::new(),
            user: String::new(),
            verify_commands: vec!["true".to_owned()],
            start_command: start.to_owned(),
            env: BTreeMap::new(),
            args: Vec::new(),
        },
        swarm_join: SwarmJoinTemplate {
            swarm: "default".to_owned(),
            labels: BTreeMap::new(),
        },
    };
    let _ = GroupId::new("unused");
    LogicalNodeSpec::new(key.node.clone(), key.run_id.clone(), Arc::new(template))
}

/// Waits (bounded by [`WAIT`]) until `done` holds; panics with `what`.
pub async fn wait_until(what: &str, done: impl FnMut() -> bool) {
    wait_until_within(what, WAIT, done).await;
}

/// Waits (bounded by `bound`) until `done` holds; panics with `what`.
pub async fn wait_until_within(what: &str, bound: Duration, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + bound;
    while tokio::time::Instant::now() < deadline {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out after {bound:?} waiting for {what}");
}
