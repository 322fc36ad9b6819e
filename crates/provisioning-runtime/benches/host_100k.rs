//! 100k nodes through the real host: bring-up to convergence, then idle.
//!
//! The whole user path above the provider: a [`Host`] on a multi-threaded
//! tokio runtime (2 workers), the `IdempotentEffectExecutor` on the
//! `TokioSpawner`, the `PluginBackendAdapter` and its observation sink, in
//! front of an instant in-memory plugin (every call answers at once; a
//! bootstrap's join and close are reported by one reporter task, as a
//! provider's background task would).
//!
//! Measured: the wall time from applying the shape to the first published
//! snapshot that shows every node ready and converged (what a progress
//! display waits for), how many snapshots were published on the way, and
//! then — converged, nothing to do — the CPU the process uses (user + system
//! from `getrusage`) over an idle window that spans several safety ticks,
//! and the snapshots published meanwhile. A fresh `status()` is checked to be
//! exact at both ends. Finally the graceful teardown.
//!
//! `cargo bench -p provisioning-runtime --bench host_100k` (release); pass
//! options after `--`: `--nodes 100000`, `--groups 4`, `--idle-secs 12`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use nix::sys::resource::{UsageWho, getrusage};
use provisioning::observe::BootstrapEvent;
/// The allocator `provision` runs with (crates/provision-cli/src/main.rs);
/// `--features bench-system-allocator` measures the system allocator's.
#[cfg(not(feature = "bench-system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use provisioning::{
    BootParams, ClusterShape, Endpoint, EndpointLookup, Generation, GroupId, LeaseHandle,
    LogicalNodeSpec, NodeGroup, NodeTemplate, ProviderShape, RunId, SessionHandle,
    SwarmJoinTemplate,
};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, BootstrapSession, ListedNode, NodeLease, ObservationSink,
    PluginError, ProvisionPlugin,
};
use provisioning_runtime::{Host, HostConfig, PluginEntry, ShutdownOutcome, StatusSnapshot};
use tokio::sync::{mpsc, watch};

const RUN: &str = "host-100k";
const KIND: &str = "instant";

/// The bound on the bring-up; reaching it fails the benchmark.
const BRING_UP_BOUND: Duration = Duration::from_secs(120);

/// How many events the reporter hands the sink before it lets the host
/// fold them.
const REPORT_BATCH: usize = 4096;

/// The most reported events the host has not acted on yet. The host's
/// observation queue holds 65 536 and drops what does not fit (a dropped
/// join or close leaves its node waiting for a timeout), and an instant
/// provider reports far faster than any real one, so the reporter keeps at
/// most this many in flight: a join counts until the host completes its
/// bootstrap, a close until a published snapshot shows its node ready.
const EVENTS_IN_FLIGHT_MAX: u64 = 49_152;

struct Options {
    nodes: u32,
    groups: u32,
    idle: Duration,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        nodes: 100_000,
        groups: 4,
        idle: Duration::from_secs(12),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} needs a number"))
        };
        match arg.as_str() {
            "--nodes" => {
                options.nodes = u32::try_from(value("--nodes")?).map_err(|e| e.to_string())?
            }
            "--groups" => {
                options.groups = u32::try_from(value("--groups")?).map_err(|e| e.to_string())?;
            }
            "--idle-secs" => options.idle = Duration::from_secs(value("--idle-secs")?),
            "--bench" => {}
            other => return Err(format!("unknown option {other}")),
        }
    }
    if options.groups == 0 || options.groups > options.nodes {
        return Err("--groups must be between 1 and --nodes".into());
    }
    Ok(options)
}

/// A provider whose every call answers at once.
#[derive(Default)]
struct InstantPlugin {
    sink: Mutex<Option<ObservationSink>>,
    reports: Mutex<Option<mpsc::UnboundedSender<(AttemptKey, BootstrapEvent)>>>,
    calls: AtomicU64,
    /// Events reported so far.
    reported: AtomicU64,
    /// Bootstraps completed so far.
    completed: AtomicU64,
    /// What the host publishes, for the ready count.
    progress: Mutex<Option<watch::Receiver<StatusSnapshot>>>,
}

impl InstantPlugin {
    /// Starts the reporter task; events reach the sink in order, a batch
    /// at a time.
    fn start_reporter(self: &Arc<Self>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(AttemptKey, BootstrapEvent)>();
        *self.reports.lock().unwrap() = Some(tx);
        let plugin = self.clone();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(REPORT_BATCH);
            while rx.recv_many(&mut batch, REPORT_BATCH).await > 0 {
                let sink = plugin.sink.lock().unwrap().clone();
                if let Some(sink) = sink {
                    for (key, event) in batch.drain(..) {
                        while plugin.in_flight() >= EVENTS_IN_FLIGHT_MAX {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        plugin.reported.fetch_add(1, Ordering::AcqRel);
                        sink.bootstrap(&key, event);
                    }
                }
                batch.clear();
                tokio::task::yield_now().await;
            }
        });
    }

    /// Reported events the host has not visibly acted on.
    fn in_flight(&self) -> u64 {
        let ready: u64 = self.progress.lock().unwrap().as_ref().map_or(0, |p| {
            p.borrow().groups.iter().map(|g| u64::from(g.ready)).sum()
        });
        let acted = self.completed.load(Ordering::Acquire) + ready;
        self.reported.load(Ordering::Acquire).saturating_sub(acted)
    }

    fn report(&self, key: &AttemptKey, event: BootstrapEvent) {
        if let Some(tx) = self.reports.lock().unwrap().as_ref() {
            let _ = tx.send((key.clone(), event));
        }
    }
}

#[async_trait]
impl ProvisionPlugin for InstantPlugin {
    fn kind(&self) -> &str {
        KIND
    }

    fn attach(&self, sink: ObservationSink) {
        *self.sink.lock().unwrap() = Some(sink);
    }

    async fn create_node(
        &self,
        key: &AttemptKey,
        _spec: &LogicalNodeSpec,
    ) -> Result<NodeLease, PluginError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(NodeLease {
            lease: LeaseHandle(format!("mem:{}", key.attempt.get())),
            endpoint: Some(Endpoint(format!("mem://{}", key.node))),
            adopted: false,
        })
    }

    async fn lookup_endpoint(
        &self,
        key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<EndpointLookup, PluginError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(EndpointLookup::Ready(Endpoint(format!(
            "mem://{}",
            key.node
        ))))
    }

    async fn start_bootstrap(
        &self,
        key: &AttemptKey,
        _request: &BootstrapRequest,
    ) -> Result<BootstrapSession, PluginError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.report(key, BootstrapEvent::Joined);
        Ok(BootstrapSession {
            session: SessionHandle(format!("s:{}", key.attempt.get())),
            adopted: false,
        })
    }

    async fn complete_bootstrap(
        &self,
        key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.completed.fetch_add(1, Ordering::AcqRel);
        self.report(key, BootstrapEvent::Closed);
        Ok(())
    }

    async fn cancel_bootstrap(
        &self,
        _key: &AttemptKey,
        _session: Option<&SessionHandle>,
    ) -> Result<(), PluginError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn destroy_node(
        &self,
        _key: &AttemptKey,
        _lease: &LeaseHandle,
    ) -> Result<(), PluginError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn list_nodes(&self, _run: &RunId) -> Result<Vec<ListedNode>, PluginError> {
        Ok(Vec::new())
    }
}

fn shape(options: &Options) -> ClusterShape {
    let base = options.nodes / options.groups;
    let extra = options.nodes % options.groups;
    let groups = (0..options.groups)
        .map(|g| NodeGroup {
            id: GroupId::new(format!("g{g}")),
            run_id: RunId::new(RUN),
            count: base + u32::from(g < extra),
            template: NodeTemplate {
                role: "worker".into(),
                provider: KIND.into(),
                shape: ProviderShape::default(),
                boot: BootParams {
                    on_peers_change: String::new(),
                    start_command: "serve".into(),
                    ..BootParams::default()
                },
                swarm_join: SwarmJoinTemplate::default(),
            },
        })
        .collect();
    ClusterShape {
        run_id: RunId::new(RUN),
        generation: Generation::new(1),
        groups,
    }
}

/// User plus system CPU time of this process so far.
fn cpu_time() -> Duration {
    let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let micros = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(u64::try_from(t.tv_sec()).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec()).unwrap_or(0))
    };
    micros(usage.user_time()) + micros(usage.system_time())
}

/// Whether `snapshot` shows `nodes` ready nodes, converged, with exact group
/// counts.
fn complete(snapshot: &StatusSnapshot, nodes: usize) -> bool {
    snapshot.converged
        && snapshot.nodes.len() == nodes
        && snapshot.ready_count() == nodes
        && snapshot.groups.iter().all(|g| g.ready == g.desired)
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

async fn run(options: Options) -> Result<(), String> {
    let nodes = usize::try_from(options.nodes).map_err(|e| e.to_string())?;
    let plugin = Arc::new(InstantPlugin::default());
    plugin.start_reporter();
    let mut config = HostConfig::new(RunId::new(RUN));
    config.shutdown_deadline = Duration::from_secs(120);
    let host =
        Host::start(config, vec![PluginEntry::new(plugin.clone())]).map_err(|e| e.to_string())?;
    let handle = host.handle();
    *plugin.progress.lock().unwrap() = Some(handle.subscribe());

    // Counts the snapshots the host publishes (without cloning them).
    let published = Arc::new(AtomicU64::new(0));
    let counter = {
        let published = published.clone();
        let mut progress = handle.subscribe();
        tokio::spawn(async move {
            while progress.changed().await.is_ok() {
                progress.borrow_and_update();
                published.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let mut progress = handle.subscribe();
    let cpu_before = cpu_time();
    let started = Instant::now();
    handle
        .apply(shape(&options))
        .await
        .map_err(|e| e.to_string())?;
    let converged = tokio::time::timeout(
        BRING_UP_BOUND,
        progress.wait_for(|snapshot| complete(snapshot, nodes)),
    )
    .await
    .is_ok_and(|waited| waited.is_ok());
    let bring_up = started.elapsed();
    let bring_up_cpu = cpu_time().saturating_sub(cpu_before);
    if !converged {
        let status = handle.status().await;
        let mut stages: BTreeMap<String, usize> = BTreeMap::new();
        for node in &status.nodes {
            *stages.entry(node.stage.clone()).or_default() += 1;
        }
        let report = handle.shutdown().await;
        return Err(format!(
            "not converged within {BRING_UP_BOUND:?}: {} nodes by stage {stages:?}, converged {}, \
             dropped observations {}",
            status.nodes.len(),
            status.converged,
            report.dropped_observations
        ));
    }
    let published_bring_up = published.load(Ordering::Relaxed);
    let exact = complete(&handle.status().await, nodes);

    // Converged and idle: whatever runs now is the host's own overhead.
    let published_before_idle = published.load(Ordering::Relaxed);
    let calls_before_idle = plugin.calls.load(Ordering::Relaxed);
    let idle_cpu_before = cpu_time();
    let idle_started = Instant::now();
    tokio::time::sleep(options.idle).await;
    let idle_wall = idle_started.elapsed();
    let idle_cpu = cpu_time().saturating_sub(idle_cpu_before);
    let published_idle = published.load(Ordering::Relaxed) - published_before_idle;
    let calls_idle = plugin.calls.load(Ordering::Relaxed) - calls_before_idle;
    let status_started = Instant::now();
    let still_exact = complete(&handle.status().await, nodes);
    let status_cost = status_started.elapsed();

    let teardown_started = Instant::now();
    let report = handle.shutdown().await;
    let teardown = teardown_started.elapsed();
    host.join().await;
    counter.abort();

    let idle_percent = 100.0 * idle_cpu.as_secs_f64() / idle_wall.as_secs_f64();
    let mut table = BTreeMap::new();
    table.insert("1 nodes", options.nodes.to_string());
    table.insert("2 bring-up ms", ms(bring_up));
    table.insert("3 bring-up cpu ms", ms(bring_up_cpu));
    table.insert("4 snapshots seen", published_bring_up.to_string());
    table.insert("5 idle s", format!("{:.1}", idle_wall.as_secs_f64()));
    table.insert("6 idle cpu ms", ms(idle_cpu));
    table.insert("7 idle cpu % of a core", format!("{idle_percent:.2}"));
    table.insert("8 idle snapshots seen", published_idle.to_string());
    table.insert("9 idle plugin calls", calls_idle.to_string());
    table.insert("a status() ms", ms(status_cost));
    println!(
        "host bring-up through the real Host (tokio, 2 workers), instant in-memory plugin, {} group(s)",
        options.groups
    );
    for (name, value) in &table {
        println!("  {:<24} {value:>10}", &name[2..]);
    }
    println!(
        "  teardown ms {:>22}  outcome {:?}, dropped observations {}",
        ms(teardown),
        report.outcome,
        report.dropped_observations
    );
    if !exact || !still_exact {
        return Err("a fresh status() was not exact".into());
    }
    if report.outcome != ShutdownOutcome::Clean {
        return Err(format!(
            "teardown forced with {} left",
            report.remaining_nodes
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let options = match options() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("host_100k: {error}");
            return ExitCode::from(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("host_100k: {error}");
            ExitCode::FAILURE
        }
    }
}
