//! SSH bring-up: how much the reconciler adds to bringing up nodes on a
//! fleet of real SSH hosts.
//!
//! A testbed of N `sshd` hosts, each in a network namespace of its own
//! (`tests/common`), one slot per host, one node per host. Two variants
//! bring up the same nodes with the same [`SshPlugin`] calls, interleaved
//! repetition by repetition so that both see the same machine noise:
//!
//! - **reconciler**: a [`Host`] with the plugin, as `provision up` wires it;
//!   timed from applying the shape to every node ready and converged.
//! - **direct**: the plugin driven directly, every node at once: create,
//!   look up the endpoint, start the bootstrap, wait for the agent's join,
//!   complete the bootstrap — the same SSH calls, with nothing around them.
//!
//! The agent (`provision-remote-agent`) is installed on every host before
//! the first repetition, so both variants measure a warm fleet (a cold
//! host adds one upload to whichever variant comes first). Between
//! repetitions every node is destroyed and the hosts are checked for
//! leftover claims.
//!
//! Run it (as root) with `cargo bench -p provisioning-ssh --bench
//! ssh_bring_up`, options after `--`: `--hosts 16`, `--reps 3`.
//!
//! `--cold FULL SLIM` measures instead what the agent's size costs a fleet
//! whose hosts have no agent yet: the reconciler variant twice, once
//! shipping `FULL` (the whole `provision` binary, run as `provision agent`)
//! and once `SLIM` (`provision-agent`), with every host's agent store
//! emptied before each sample, interleaved the same way. Build both first:
//! `cargo build --release --bin provision --bin provision-agent`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Testbed;
use nix::sys::resource::{UsageWho, getrusage};
use provisioning::observe::BootstrapEvent;
use provisioning::{
    BootParams, EndpointLookup, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeGroup,
    NodeTemplate, Observation, ProviderShape, RetryPolicy, RunId, SwarmJoinTemplate,
};
use provisioning_agent::RunSecret;
use provisioning_provider::{AttemptKey, BootstrapRequest, ObservationSink, ProvisionPlugin};
use provisioning_runtime::{Host, HostConfig, PluginEntry};
use provisioning_ssh::SshPlugin;
use tokio::sync::watch;

const AGENT: &str = env!("CARGO_BIN_EXE_provision-remote-agent");

/// The bound on one bring-up.
const BRING_UP_BOUND: Duration = Duration::from_secs(300);

/// The endpoint probe interval `provision up` uses.
const PROBE_INTERVAL: Duration = Duration::from_millis(20);

/// Every node's boot: one verify command and a sleeping workload.
const VERIFY_COMMAND: &str = "true";
const WORKLOAD: &str = "sleep 3600";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Direct,
    Reconciler,
}

/// The agent a sample ships to the hosts: the program and its arguments.
#[derive(Clone, Debug)]
struct AgentProgram {
    program: String,
    args: Vec<String>,
}

/// One column of the report: how it brings nodes up, with which agent, and
/// whether every host's agent store is emptied before each sample.
#[derive(Clone, Debug)]
struct Column {
    name: &'static str,
    variant: Variant,
    agent: AgentProgram,
    cold: bool,
}

struct Options {
    hosts: usize,
    reps: usize,
    /// `--cold FULL SLIM`: the two agents compared from a cold store.
    cold: Option<(String, String)>,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        hosts: 16,
        reps: 3,
        cold: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{name} takes a positive number"))
        };
        match arg.as_str() {
            "--hosts" => options.hosts = number("--hosts")?,
            "--reps" => options.reps = number("--reps")?,
            "--cold" => {
                let full = args.next().ok_or("--cold takes FULL and SLIM paths")?;
                let slim = args.next().ok_or("--cold takes FULL and SLIM paths")?;
                options.cold = Some((full, slim));
            }
            // What `cargo bench` passes to every bench binary.
            "--bench" => {}
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(options)
}

fn template(boot: BootParams) -> NodeTemplate {
    NodeTemplate {
        role: "web".to_owned(),
        provider: provisioning_ssh::PROVIDER_KIND.to_owned(),
        shape: ProviderShape::default(),
        boot,
        swarm_join: SwarmJoinTemplate {
            swarm: "main".to_owned(),
            labels: BTreeMap::new(),
        },
    }
}

fn boot() -> BootParams {
    BootParams {
        on_peers_change: String::new(),
        user: String::new(),
        verify_commands: vec![VERIFY_COMMAND.to_owned()],
        start_command: WORKLOAD.to_owned(),
        env: BTreeMap::new(),
        args: Vec::new(),
    }
}

/// The nodes that joined, as the sink reports them.
fn joined_watch(plugin: &SshPlugin) -> watch::Receiver<BTreeSet<LogicalNodeId>> {
    let (tx, rx) = watch::channel(BTreeSet::new());
    plugin.attach(ObservationSink::new(move |observation| {
        if let Observation::Bootstrap {
            node,
            event: BootstrapEvent::Joined,
            ..
        } = observation
        {
            tx.send_modify(|joined| {
                joined.insert(node);
            });
        }
    }));
    rx
}

async fn direct(plugin: Arc<SshPlugin>, run: &RunId, nodes: usize) -> Result<(), String> {
    let joined = joined_watch(&plugin);
    let template = Arc::new(template(boot()));
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..nodes {
        let key = AttemptKey {
            run_id: run.clone(),
            node: LogicalNodeId::new(GroupId::new("web"), index as u32),
            attempt: NodeAttemptId::from_raw(index as u64 + 1),
        };
        let spec = LogicalNodeSpec::new(key.node.clone(), run.clone(), template.clone());
        let plugin = plugin.clone();
        let mut joined = joined.clone();
        tasks.spawn(async move {
            let lease = plugin
                .create_node(&key, &spec)
                .await
                .map_err(|e| format!("create {key}: {e}"))?;
            let endpoint = loop {
                match plugin.lookup_endpoint(&key, &lease.lease).await {
                    Ok(EndpointLookup::Ready(endpoint)) => break endpoint,
                    Ok(EndpointLookup::NotReady) => tokio::time::sleep(PROBE_INTERVAL).await,
                    Err(e) => return Err(format!("lookup {key}: {e}")),
                }
            };
            let request = BootstrapRequest {
                spec,
                lease: lease.lease,
                endpoint,
            };
            let session = plugin
                .start_bootstrap(&key, &request)
                .await
                .map_err(|e| format!("start {key}: {e}"))?;
            joined
                .wait_for(|joined| joined.contains(&key.node))
                .await
                .map_err(|_| format!("no join of {key}"))?;
            plugin
                .complete_bootstrap(&key, Some(&session.session))
                .await
                .map_err(|e| format!("complete {key}: {e}"))
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| e.to_string())??;
    }
    Ok(())
}

async fn destroy_all(plugin: &SshPlugin, run: &RunId) -> Result<(), String> {
    let listed = plugin.list_nodes(run).await.map_err(|e| e.to_string())?;
    for node in listed {
        plugin
            .destroy_node(&node.key, &node.lease)
            .await
            .map_err(|e| format!("destroy {}: {e}", node.key))?;
    }
    Ok(())
}

async fn reconciler(
    plugin: Arc<SshPlugin>,
    run: &RunId,
    nodes: usize,
    baseline: &Baseline,
) -> Result<Sample, String> {
    let mut config = HostConfig::new(run.clone());
    config.policy = RetryPolicy {
        endpoint_probe_interval: PROBE_INTERVAL,
        ..RetryPolicy::default()
    };
    let host = Host::start(config, vec![PluginEntry::new(plugin)]).map_err(|e| e.to_string())?;
    let handle = host.handle();
    let mut progress = handle.subscribe();
    let group = NodeGroup {
        id: GroupId::new("web"),
        run_id: run.clone(),
        count: nodes as u32,
        template: template(boot()),
    };
    handle
        .apply_revision(run.clone(), vec![group])
        .await
        .map_err(|e| e.to_string())?;
    let converged = progress
        .wait_for(|snapshot| snapshot.converged && snapshot.ready_count() == nodes)
        .await
        .is_ok();
    // The sample ends at convergence: the host's teardown is not timed
    // (the direct variant's destroys are not either).
    let sample = baseline.sample();
    handle.shutdown().await;
    host.join().await;
    if converged {
        Ok(sample)
    } else {
        Err("the host stopped before convergence".to_owned())
    }
}

/// One bring-up: its wall time, the CPU time (user + system) of this
/// process over it — the controller: the host or the direct calls, and the
/// plugin — and that of the `ssh` clients it ran and reaped.
#[derive(Clone, Copy, Debug)]
struct Sample {
    wall: Duration,
    controller_cpu: Duration,
    ssh_cpu: Duration,
}

/// One figure of a [`Sample`].
type SampleField = fn(&Sample) -> Duration;

/// Where a bring-up started: the clock and both CPU times.
struct Baseline {
    started: Instant,
    controller: Duration,
    ssh: Duration,
}

impl Baseline {
    fn now() -> Self {
        Baseline {
            started: Instant::now(),
            controller: cpu_time(UsageWho::RUSAGE_SELF),
            ssh: cpu_time(UsageWho::RUSAGE_CHILDREN),
        }
    }

    /// What the bring-up cost from the baseline up to now.
    fn sample(&self) -> Sample {
        Sample {
            wall: self.started.elapsed(),
            controller_cpu: cpu_time(UsageWho::RUSAGE_SELF).saturating_sub(self.controller),
            ssh_cpu: cpu_time(UsageWho::RUSAGE_CHILDREN).saturating_sub(self.ssh),
        }
    }
}

/// User plus system CPU time of `who` so far.
fn cpu_time(who: UsageWho) -> Duration {
    let Ok(usage) = getrusage(who) else {
        return Duration::ZERO;
    };
    let time = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(u64::try_from(t.tv_sec()).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec()).unwrap_or(0))
    };
    time(usage.user_time()) + time(usage.system_time())
}

async fn measure(
    bed: &Testbed,
    column: &Column,
    rep: usize,
    nodes: usize,
) -> Result<Sample, String> {
    let variant = column.variant;
    let name = format!("bench-{rep}-{}", column.name);
    let run = RunId::new(name.as_str());
    if column.cold {
        empty_agent_stores(bed)?;
    }
    let mut agent = bed.agent_config(&column.agent.program, RunSecret::generate(), 0);
    agent.args = column.agent.args.clone();
    let plugin = SshPlugin::start(bed.config(&name, 1), agent)
        .await
        .map_err(|e| e.to_string())?;
    let baseline = Baseline::now();
    let brought_up = match variant {
        Variant::Direct => {
            tokio::time::timeout(BRING_UP_BOUND, async {
                direct(plugin.clone(), &run, nodes).await?;
                Ok(baseline.sample())
            })
            .await
        }
        Variant::Reconciler => {
            tokio::time::timeout(
                BRING_UP_BOUND,
                reconciler(plugin.clone(), &run, nodes, &baseline),
            )
            .await
        }
    };
    // Whatever happened, nothing of the run stays on the hosts.
    destroy_all(&plugin, &run).await?;
    let left: usize = bed.hosts.iter().map(|h| h.claims_of(&name).len()).sum();
    match brought_up {
        Err(_) => Err(format!("no bring-up within {BRING_UP_BOUND:?}")),
        Ok(Err(error)) => Err(error),
        Ok(Ok(_)) if left > 0 => Err(format!("{left} claim(s) left after teardown")),
        Ok(Ok(sample)) => Ok(sample),
    }
}

/// Removes every uploaded agent from every host (the hosts share this
/// machine's file system), so the next bootstrap uploads it again.
fn empty_agent_stores(bed: &Testbed) -> Result<(), String> {
    for host in &bed.hosts {
        let store = host.claims().join(".agents");
        match std::fs::remove_dir_all(&store) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(format!("{}: {error}", store.display())),
        }
    }
    Ok(())
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

async fn run(options: Options) -> Result<(), String> {
    eprintln!(
        "starting {} sshd hosts in network namespaces...",
        options.hosts
    );
    let bed = Testbed::start_netns(options.hosts);
    let columns: [Column; 2] = match &options.cold {
        None => {
            // Warm: the agent is on every host before anything is timed.
            let installer =
                SshPlugin::new(bed.config("bench-install", 1)).map_err(|e| e.to_string())?;
            for host in &bed.hosts {
                installer
                    .install_agent(&host.name, Path::new(AGENT))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            let agent = AgentProgram {
                program: AGENT.to_owned(),
                args: Vec::new(),
            };
            [
                Column {
                    name: "direct",
                    variant: Variant::Direct,
                    agent: agent.clone(),
                    cold: false,
                },
                Column {
                    name: "reconciler",
                    variant: Variant::Reconciler,
                    agent,
                    cold: false,
                },
            ]
        }
        Some((full, slim)) => [
            Column {
                name: "full-agent",
                variant: Variant::Reconciler,
                agent: AgentProgram {
                    program: full.clone(),
                    args: vec!["agent".to_owned()],
                },
                cold: true,
            },
            Column {
                name: "slim-agent",
                variant: Variant::Reconciler,
                agent: AgentProgram {
                    program: slim.clone(),
                    args: Vec::new(),
                },
                cold: true,
            },
        ],
    };
    let mut direct_samples = Vec::new();
    let mut reconciler_samples = Vec::new();
    for rep in 0..options.reps {
        // Alternate which column goes first.
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for index in order {
            let column = &columns[index];
            let sample = measure(&bed, column, rep, options.hosts).await?;
            eprintln!(
                "rep {rep}: {} {:.3} s (controller cpu {:.3} s, ssh clients cpu {:.3} s)",
                column.name,
                sample.wall.as_secs_f64(),
                sample.controller_cpu.as_secs_f64(),
                sample.ssh_cpu.as_secs_f64()
            );
            if index == 0 {
                direct_samples.push(sample);
            } else {
                reconciler_samples.push(sample);
            }
        }
    }
    println!(
        "ssh bring-up, {} hosts, {} node(s), {} rep(s), medians:",
        options.hosts, options.hosts, options.reps
    );
    println!(
        "                   {:>10} {:>12}   ratio",
        columns[0].name, columns[1].name
    );
    let rows: [(&str, SampleField); 3] = [
        ("wall s", |s| s.wall),
        ("controller cpu s", |s| s.controller_cpu),
        ("ssh clients cpu s", |s| s.ssh_cpu),
    ];
    for (name, field) in rows {
        let direct = median(direct_samples.iter().map(field).collect());
        let reconciler = median(reconciler_samples.iter().map(field).collect());
        println!(
            "{name:<18} {:>9.3} {:>12.3} {:>7.2}",
            direct.as_secs_f64(),
            reconciler.as_secs_f64(),
            reconciler.as_secs_f64() / direct.as_secs_f64().max(f64::MIN_POSITIVE)
        );
    }
    let walls = |samples: &[Sample]| -> Vec<String> {
        samples
            .iter()
            .map(|s| format!("{:.3}", s.wall.as_secs_f64()))
            .collect()
    };
    println!(
        "{} wall samples: {:?}\n{} wall samples: {:?}",
        columns[0].name,
        walls(&direct_samples),
        columns[1].name,
        walls(&reconciler_samples)
    );
    Ok(())
}

fn main() -> ExitCode {
    let options = match options() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
