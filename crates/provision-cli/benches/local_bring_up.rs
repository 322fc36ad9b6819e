//! Local bring-up: how much the reconciler adds to starting local process
//! nodes.
//!
//! Two variants bring up the same nodes — real `provision agent` processes
//! on the local-process provider, a trivial verify command and a sleeping
//! workload — and are timed in one run, interleaved repetition by
//! repetition so that both see the same machine noise:
//!
//! - **reconciler**: a [`Host`] with the [`ProcessPlugin`], wired as
//!   `provision up` wires them; timed from applying the shape to the host
//!   reporting every node ready and the cluster converged.
//! - **baseline**: the same plugin driven directly, every node at once:
//!   create, poll the endpoint, start the bootstrap, wait for the join,
//!   complete the bootstrap. This is the least the provider itself needs.
//!
//! Between repetitions everything is torn down (through the host's graceful
//! shutdown for the reconciler, timed) and `/proc` is checked for leftovers
//! of the run. Every repetition uses a run id of its own.
//!
//! Run it with `cargo bench -p provision-cli --bench local_bring_up`, and
//! pass options after `--`: `--nodes 100`, `--reps 5`, `--groups 4`,
//! `--warmup 1`, `--stages` (when each node reached each stage),
//! `--probe-interval-ms 1000` (the host's probe interval; by default the
//! one `provision up` uses). `RUST_LOG` turns on logging to stderr.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use provisioning::observe::BootstrapEvent;
use provisioning::{
    BootParams, EndpointLookup, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeGroup,
    NodeTemplate, Observation, ProviderShape, RetryPolicy, RunId, SwarmJoinTemplate,
};
use provisioning_agent::{RunSecret, os};
use provisioning_process::{
    AgentCommand, ENDPOINT_PROBE_INTERVAL, ProcessPlugin, ProcessPluginConfig,
};
use provisioning_provider::{AttemptKey, BootstrapRequest, ObservationSink, ProvisionPlugin};
use provisioning_runtime::{Host, HostConfig, PluginEntry, ShutdownOutcome, StatusSnapshot};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The `provision` binary; run as `provision agent` it is a node agent.
const PROVISION: &str = env!("CARGO_BIN_EXE_provision");

/// The subcommand that makes `provision` a node agent.
const AGENT_SUBCOMMAND: &str = "agent";

/// The grace between `SIGTERM` and `SIGKILL`, as `provision up` uses it.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// The worker threads of the runtime, as `provision up` uses them.
const RUNTIME_WORKERS: usize = 2;

/// Every node's boot: a verify command that succeeds at once and a workload
/// that sleeps through the benchmark.
const VERIFY_COMMAND: &str = "true";
const WORKLOAD: &str = "sleep 3600";

/// How often the baseline asks for an endpoint that is not ready yet.
const BASELINE_PROBE_INTERVAL: Duration = Duration::from_millis(10);

/// The bound on one bring-up; reaching it fails the benchmark.
const BRING_UP_BOUND: Duration = Duration::from_secs(180);

/// The bound on the wait for a run's processes to disappear after teardown.
const LEFTOVER_BOUND: Duration = Duration::from_secs(30);

/// The most nodes a run may ask for; each is three processes.
const NODES_MAX: u32 = 2_000;

/// The target of the ratio of the medians.
const RATIO_TARGET: f64 = 1.5;

/// Local bring-up through the reconciler against the same processes started
/// by driving the process plugin directly.
#[derive(Debug, Parser)]
#[command(name = "local_bring_up")]
struct Options {
    /// Nodes per bring-up.
    #[arg(long, default_value_t = 100)]
    nodes: u32,
    /// Measured repetitions of each variant.
    #[arg(long, default_value_t = 5)]
    reps: u32,
    /// Groups the nodes are spread over.
    #[arg(long, default_value_t = 4)]
    groups: u32,
    /// Unmeasured repetitions of each variant first (page cache, allocator).
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Prints, for every repetition, when nodes reached each stage.
    #[arg(long)]
    stages: bool,
    /// Overrides the host's endpoint probe interval (milliseconds); by
    /// default the one `provision up` uses. `1000` is the core's default.
    #[arg(long, value_name = "MS")]
    probe_interval_ms: Option<u64>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Reconciler,
    Baseline,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Reconciler => "reconciler",
            Variant::Baseline => "baseline",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Variant::Reconciler => "r",
            Variant::Baseline => "b",
        }
    }
}

/// When nodes first reached each stage, measured from the start of the
/// bring-up. Stages are kept in the order they were first reached.
#[derive(Debug, Default)]
struct Timeline {
    order: Vec<String>,
    reached: BTreeMap<String, Vec<Duration>>,
}

impl Timeline {
    fn record(&mut self, stage: &str, at: Duration) {
        if !self.reached.contains_key(stage) {
            self.order.push(stage.to_owned());
        }
        self.reached.entry(stage.to_owned()).or_default().push(at);
    }

    fn merge(&mut self, other: Timeline) {
        for stage in other.order {
            for at in other.reached.get(&stage).into_iter().flatten() {
                self.record(&stage, *at);
            }
        }
    }

    fn render(&self) -> String {
        let mut text = String::new();
        for stage in &self.order {
            let mut times = self.reached.get(stage).cloned().unwrap_or_default();
            times.sort();
            let _ = writeln!(
                text,
                "      {stage:<20} nodes {:>4}  first {:>8}  median {:>8}  last {:>8}",
                times.len(),
                millis(times.first().copied()),
                millis(median(&times)),
                millis(times.last().copied()),
            );
        }
        text
    }
}

/// What one repetition of one variant measured.
#[derive(Debug)]
struct Sample {
    bring_up: Duration,
    teardown: Duration,
    timeline: Timeline,
    /// Processes of the run found after the teardown (always 0: survivors
    /// fail the benchmark).
    left: usize,
}

fn main() -> ExitCode {
    let options = Options::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_WORKERS)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(options: &Options) -> anyhow::Result<()> {
    ensure!(
        (1..=NODES_MAX).contains(&options.nodes),
        "--nodes must be between 1 and {NODES_MAX}"
    );
    ensure!(options.reps >= 1, "--reps must be at least 1");
    ensure!(
        (1..=options.nodes).contains(&options.groups),
        "--groups must be between 1 and --nodes"
    );
    println!(
        "local bring-up: {} process nodes in {} group(s); {} measured repetition(s) of each variant, \
         interleaved, after {} warm-up pair(s); {} core(s) available",
        options.nodes,
        options.groups,
        options.reps,
        options.warmup,
        std::thread::available_parallelism().map_or(0, usize::from),
    );
    println!(
        "the host probes endpoints every {} ms",
        probe_interval(options).as_millis()
    );
    println!(
        "{:<8} {:<11} {:>10} {:>10}  processes left",
        "rep", "variant", "bring-up", "teardown"
    );
    let mut samples: BTreeMap<&str, Vec<Sample>> = BTreeMap::new();
    for rep in 0..options.warmup + options.reps {
        let warmup = rep < options.warmup;
        for variant in [Variant::Reconciler, Variant::Baseline] {
            let run_id = RunId::new(format!(
                "lbu-{}-{rep}-{}",
                std::process::id(),
                variant.tag()
            ));
            let sample = measure(variant, &run_id, options).await?;
            let label = if warmup {
                "warm-up".to_owned()
            } else {
                (rep - options.warmup + 1).to_string()
            };
            println!(
                "{label:<8} {:<11} {:>10} {:>10}  {}",
                variant.name(),
                seconds(sample.bring_up),
                seconds(sample.teardown),
                sample.left,
            );
            if options.stages {
                print!("{}", sample.timeline.render());
            }
            if !warmup {
                samples.entry(variant.name()).or_default().push(sample);
            }
        }
    }
    summarise(&samples);
    Ok(())
}

/// Runs one repetition of `variant` under `run_id`, then makes sure nothing
/// of the run is left.
async fn measure(variant: Variant, run_id: &RunId, options: &Options) -> anyhow::Result<Sample> {
    let before = processes_of(run_id).await?;
    ensure!(
        before.is_empty(),
        "run {run_id} has processes before it started: {before:?}"
    );
    let outcome = match variant {
        Variant::Reconciler => reconciler(run_id, options).await,
        Variant::Baseline => baseline(run_id, options).await,
    };
    let left = wait_until_gone(run_id).await?;
    if !left.is_empty() {
        let pids: Vec<i32> = left.iter().map(|p| p.pid).collect();
        let cleanup = run_id.clone();
        let _ = tokio::task::spawn_blocking(move || os::kill_run(&cleanup, LEFTOVER_BOUND)).await;
        bail!(
            "{} process(es) of run {run_id} survived the teardown of the {} variant: {pids:?}",
            left.len(),
            variant.name()
        );
    }
    outcome.map(|sample| Sample {
        left: left.len(),
        ..sample
    })
}

/// Through the host, as `provision up` does it.
async fn reconciler(run_id: &RunId, options: &Options) -> anyhow::Result<Sample> {
    let plugin = ProcessPlugin::start(plugin_config(run_id)).await?;
    let for_shutdown = plugin.clone();
    let entry = PluginEntry::new(plugin)
        .with_shutdown(move || async move { for_shutdown.shutdown().await });
    let host = Host::start(host_config(run_id, options), vec![entry])?;
    let handle = host.handle();
    let nodes = usize::try_from(options.nodes)?;
    let mut progress = handle.subscribe();

    let started = Instant::now();
    let follower = tokio::spawn(follow_stages(handle.subscribe(), started));
    handle
        .apply_revision(run_id.clone(), groups(run_id, options))
        .await
        .context("the shape was refused")?;
    // The snapshot `wait_for` returns holds the channel's read lock: it is
    // dropped at once, or the host would block publishing its next one.
    let converged = tokio::time::timeout(
        BRING_UP_BOUND,
        progress.wait_for(|snapshot| snapshot.converged && snapshot.ready_count() == nodes),
    )
    .await
    .is_ok_and(|waited| waited.is_ok());
    let bring_up = started.elapsed();
    let timeline = follower.await.unwrap_or_default();

    let teardown_started = Instant::now();
    let report = handle.shutdown().await;
    let teardown = teardown_started.elapsed();
    host.join().await;
    ensure!(
        converged,
        "the host did not converge {nodes} nodes within {BRING_UP_BOUND:?}"
    );
    ensure!(
        report.outcome == ShutdownOutcome::Clean,
        "the teardown was forced with {} node(s) left",
        report.remaining_nodes
    );
    Ok(Sample {
        bring_up,
        teardown,
        timeline,
        left: 0,
    })
}

/// Records when each node first showed each stage in the host's snapshots,
/// until the cluster converged or the host stopped publishing.
async fn follow_stages(
    mut progress: watch::Receiver<StatusSnapshot>,
    started: Instant,
) -> Timeline {
    let mut timeline = Timeline::default();
    let mut seen: BTreeSet<(String, String)> = BTreeSet::new();
    let bound = tokio::time::Instant::now() + BRING_UP_BOUND;
    while tokio::time::timeout_at(bound, progress.changed())
        .await
        .is_ok_and(|changed| changed.is_ok())
    {
        let at = started.elapsed();
        let snapshot = progress.borrow_and_update().clone();
        for node in &snapshot.nodes {
            let stage = if node.ready {
                "ready"
            } else {
                node.stage.as_str()
            };
            if seen.insert((node.id.clone(), stage.to_owned())) {
                timeline.record(stage, at);
            }
        }
        if snapshot.converged && !snapshot.nodes.is_empty() {
            break;
        }
    }
    timeline
}

/// The provider alone: every node's steps in order, all nodes at once.
async fn baseline(run_id: &RunId, options: &Options) -> anyhow::Result<Sample> {
    let plugin = ProcessPlugin::start(plugin_config(run_id)).await?;
    let (joined_tx, joined) = watch::channel(BTreeSet::<LogicalNodeId>::new());
    plugin.attach(ObservationSink::new(move |observation| {
        if let Observation::Bootstrap {
            node,
            event: BootstrapEvent::Joined,
            ..
        } = observation
        {
            joined_tx.send_modify(|joined| {
                joined.insert(node);
            });
        }
    }));

    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for group in groups(run_id, options) {
        let template = Arc::new(group.template);
        for index in 0..group.count {
            let node = LogicalNodeId::new(group.id.clone(), index);
            let key = AttemptKey {
                run_id: run_id.clone(),
                node: node.clone(),
                attempt: NodeAttemptId::from_raw(1),
            };
            let spec = LogicalNodeSpec::new(node, run_id.clone(), template.clone());
            tasks.spawn(bring_up_one(
                plugin.clone(),
                key,
                spec,
                joined.clone(),
                started,
            ));
        }
    }
    let all = tokio::time::timeout(BRING_UP_BOUND, async {
        let mut timeline = Timeline::default();
        while let Some(joined) = tasks.join_next().await {
            timeline.merge(joined??);
        }
        anyhow::Ok(timeline)
    })
    .await;
    let bring_up = started.elapsed();

    let teardown_started = Instant::now();
    plugin.shutdown().await;
    let teardown = teardown_started.elapsed();
    drop(plugin);
    let timeline = match all {
        Ok(outcome) => outcome?,
        Err(_) => bail!("the baseline did not bring the nodes up within {BRING_UP_BOUND:?}"),
    };
    Ok(Sample {
        bring_up,
        teardown,
        timeline,
        left: 0,
    })
}

/// One node through the provider's steps: create, endpoint, bootstrap,
/// join, complete.
async fn bring_up_one(
    plugin: Arc<ProcessPlugin>,
    key: AttemptKey,
    spec: LogicalNodeSpec,
    mut joined: watch::Receiver<BTreeSet<LogicalNodeId>>,
    started: Instant,
) -> anyhow::Result<Timeline> {
    let mut timeline = Timeline::default();
    let lease = plugin
        .create_node(&key, &spec)
        .await
        .with_context(|| format!("create {key}"))?;
    timeline.record("created", started.elapsed());
    let endpoint = loop {
        match plugin
            .lookup_endpoint(&key, &lease.lease)
            .await
            .with_context(|| format!("endpoint of {key}"))?
        {
            EndpointLookup::Ready(endpoint) => break endpoint,
            EndpointLookup::NotReady => tokio::time::sleep(BASELINE_PROBE_INTERVAL).await,
        }
    };
    timeline.record("endpoint-known", started.elapsed());
    let request = BootstrapRequest {
        spec,
        lease: lease.lease,
        endpoint,
    };
    let session = plugin
        .start_bootstrap(&key, &request)
        .await
        .with_context(|| format!("bootstrap of {key}"))?;
    timeline.record("bootstrap-running", started.elapsed());
    joined
        .wait_for(|joined| joined.contains(&key.node))
        .await
        .context("the sink is gone")?;
    timeline.record("swarm-joined", started.elapsed());
    plugin
        .complete_bootstrap(&key, Some(&session.session))
        .await
        .with_context(|| format!("complete the bootstrap of {key}"))?;
    timeline.record("ready", started.elapsed());
    Ok(timeline)
}

/// The plugin configuration `provision up` uses, for `run_id`.
fn plugin_config(run_id: &RunId) -> ProcessPluginConfig {
    ProcessPluginConfig {
        run_id: run_id.clone(),
        agent: AgentCommand::new(PROVISION, [OsString::from(AGENT_SUBCOMMAND)]),
        run_secret: RunSecret::generate(),
        stop_grace: STOP_GRACE,
        lifetime: provisioning_process::AgentLifetime::WithController,
    }
}

/// The host configuration `provision up` uses, for `run_id` (its policy is
/// `providers::retry_policy()` of the CLI, which a bench cannot call), unless
/// the options override the probe interval.
fn host_config(run_id: &RunId, options: &Options) -> HostConfig {
    let mut config = HostConfig::new(run_id.clone());
    config.policy = RetryPolicy {
        endpoint_probe_interval: probe_interval(options),
        ..RetryPolicy::default()
    };
    config
}

fn probe_interval(options: &Options) -> Duration {
    options
        .probe_interval_ms
        .map_or(ENDPOINT_PROBE_INTERVAL, Duration::from_millis)
}

/// `options.nodes` nodes spread as evenly as possible over
/// `options.groups` groups, each booted with [`VERIFY_COMMAND`] and
/// [`WORKLOAD`].
fn groups(run_id: &RunId, options: &Options) -> Vec<NodeGroup> {
    let base = options.nodes / options.groups;
    let extra = options.nodes % options.groups;
    (0..options.groups)
        .map(|index| {
            let id = format!("group{index}");
            NodeGroup {
                id: GroupId::new(id.as_str()),
                run_id: run_id.clone(),
                count: base + u32::from(index < extra),
                template: NodeTemplate {
                    role: id,
                    provider: provisioning_process::PROVIDER_KIND.to_owned(),
                    shape: ProviderShape::default(),
                    boot: BootParams {
                        on_peers_change: String::new(),
                        user: String::new(),
                        verify_commands: vec![VERIFY_COMMAND.to_owned()],
                        start_command: WORKLOAD.to_owned(),
                        env: BTreeMap::new(),
                        args: Vec::new(),
                    },
                    swarm_join: SwarmJoinTemplate {
                        swarm: "main".to_owned(),
                        labels: BTreeMap::new(),
                    },
                },
            }
        })
        .collect()
}

async fn processes_of(run_id: &RunId) -> anyhow::Result<Vec<os::TaggedProcess>> {
    let run_id = run_id.clone();
    Ok(tokio::task::spawn_blocking(move || os::run_processes(&run_id)).await??)
}

/// Waits (bounded) until no process of `run_id` is alive; returns the
/// survivors.
async fn wait_until_gone(run_id: &RunId) -> anyhow::Result<Vec<os::TaggedProcess>> {
    let run_id = run_id.clone();
    Ok(
        tokio::task::spawn_blocking(move || os::wait_until_run_gone(&run_id, LEFTOVER_BOUND))
            .await??,
    )
}

fn summarise(samples: &BTreeMap<&str, Vec<Sample>>) {
    let times = |variant: Variant, of: fn(&Sample) -> Duration| -> Vec<Duration> {
        let mut times: Vec<Duration> = samples
            .get(variant.name())
            .into_iter()
            .flatten()
            .map(of)
            .collect();
        times.sort();
        times
    };
    let reconciler = times(Variant::Reconciler, |s| s.bring_up);
    let baseline = times(Variant::Baseline, |s| s.bring_up);
    println!();
    println!(
        "{:<22} {:>10} {:>10} {:>10}",
        "bring-up", "median", "min", "max"
    );
    for (name, times) in [("reconciler", &reconciler), ("baseline", &baseline)] {
        println!(
            "{name:<22} {:>10} {:>10} {:>10}",
            seconds_of(median(times)),
            seconds_of(times.first().copied()),
            seconds_of(times.last().copied()),
        );
    }
    let teardown = times(Variant::Reconciler, |s| s.teardown);
    println!(
        "{:<22} {:>10} {:>10} {:>10}",
        "teardown (host)",
        seconds_of(median(&teardown)),
        seconds_of(teardown.first().copied()),
        seconds_of(teardown.last().copied()),
    );
    if let (Some(r), Some(b)) = (median(&reconciler), median(&baseline)) {
        let ratio = r.as_secs_f64() / b.as_secs_f64();
        let verdict = if ratio <= RATIO_TARGET {
            "met"
        } else {
            "MISSED"
        };
        println!();
        println!(
            "ratio reconciler/baseline (medians): {ratio:.2} (target <= {RATIO_TARGET}: {verdict})"
        );
    }
}

fn median(sorted: &[Duration]) -> Option<Duration> {
    match sorted.len() {
        0 => None,
        n if n % 2 == 1 => Some(sorted[n / 2]),
        n => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2),
    }
}

fn seconds(duration: Duration) -> String {
    format!("{:.3} s", duration.as_secs_f64())
}

fn seconds_of(duration: Option<Duration>) -> String {
    duration.map_or_else(|| "-".to_owned(), seconds)
}

fn millis(duration: Option<Duration>) -> String {
    duration.map_or_else(|| "-".to_owned(), |d| format!("{} ms", d.as_millis()))
}
