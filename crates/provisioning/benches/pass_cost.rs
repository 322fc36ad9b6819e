//! Pass cost and large bring-up of the core, with an instant in-memory backend.
//!
//! Run with `cargo bench -p provisioning --bench pass_cost` (optionally
//! `-- --quick` for 1k/10k only; `-- --steady NODES PASSES` runs only
//! forced full passes after one bring-up, for a profiler). Prints medians over repeated runs, and
//! beside the pass cost its floor: a plain scan of a B-tree of as many
//! node-sized records. The heap columns of the bring-up table are filled by
//! a `--features bench-heap` build (see [`ALLOCATOR`]); its times are not the
//! ones to report.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::effect::EffectRequest;
use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{
    BootParams, BootstrapEvent, ClusterDriver, ClusterShape, EffectError, EffectKind, EffectOutput,
    Endpoint, EndpointLookup, ExecutorResult, Generation, GroupId, IdempotentEffectExecutor,
    LeaseHandle, LogicalNodeId, LossCause, ManagedNode, ManualSpawner, NodeGroup, NodeTemplate,
    Observation, Operation, ProviderShape, RetryPolicy, RunId, RunOrder, SessionHandle,
    SwarmJoinTemplate, Timestamp,
};

/// The allocator `provision` ships with (mimalloc), or the system's with
/// `--features bench-system-allocator`. With `--features bench-heap` it is
/// wrapped in a counter of live and peak heap bytes (of what is asked for,
/// the same under any allocator), so memory per node is measured from the
/// allocator as well as from the resident set. The counter's atomic updates
/// cost about a tenth of a bring-up's time, so times come from a build
/// without it and heap figures from one with it.
#[cfg(feature = "bench-heap")]
#[global_allocator]
static ALLOCATOR: cap::Cap<Inner> = cap::Cap::new(INNER, usize::MAX);
#[cfg(not(feature = "bench-heap"))]
#[global_allocator]
static ALLOCATOR: Inner = INNER;

/// Live and peak heap bytes, in a `bench-heap` build.
#[cfg(feature = "bench-heap")]
fn heap() -> Option<(usize, usize)> {
    Some((ALLOCATOR.allocated(), ALLOCATOR.max_allocated()))
}
#[cfg(not(feature = "bench-heap"))]
fn heap() -> Option<(usize, usize)> {
    None
}

#[cfg(not(feature = "bench-system-allocator"))]
type Inner = mimalloc::MiMalloc;
#[cfg(not(feature = "bench-system-allocator"))]
const INNER: Inner = mimalloc::MiMalloc;
#[cfg(feature = "bench-system-allocator")]
type Inner = std::alloc::System;
#[cfg(feature = "bench-system-allocator")]
const INNER: Inner = std::alloc::System;

struct InstantBackend;

impl EffectBackend for InstantBackend {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        let output = match &operation.request {
            EffectRequest::CreateLease => EffectOutput::LeaseCreated {
                lease: LeaseHandle(format!("l{}", operation.attempt().get())),
                endpoint: None,
                adopted: false,
            },
            EffectRequest::LookupEndpoint { .. } => EffectOutput::Endpoint(EndpointLookup::Ready(
                Endpoint(format!("127.0.0.1:{}", operation.attempt().get() % 60_000)),
            )),
            EffectRequest::StartBootstrap { .. } => EffectOutput::BootstrapStarted {
                session: SessionHandle(format!("s{}", operation.attempt().get())),
                adopted: false,
            },
            EffectRequest::BootstrapConvergenceObserved { .. } => {
                EffectOutput::ConvergenceAcknowledged
            }
            EffectRequest::CancelBootstrap { .. } => EffectOutput::BootstrapCancelled,
            EffectRequest::DestroyLease { .. } => EffectOutput::LeaseDestroyed,
        };
        Box::pin(async move { Ok(output) })
    }
}

fn shape(nodes: u32) -> ClusterShape {
    let groups = 4;
    let run = RunId::new("bench");
    ClusterShape {
        run_id: run.clone(),
        generation: Generation::new(1),
        groups: (0..groups)
            .map(|g| NodeGroup {
                id: GroupId::new(format!("group{g}")),
                run_id: run.clone(),
                count: nodes / groups,
                template: NodeTemplate {
                    role: "worker".into(),
                    provider: "instant".into(),
                    shape: ProviderShape {
                        image: "img".into(),
                        resources: BTreeMap::from([("cpu".into(), 1.0)]),
                        labels: BTreeMap::new(),
                    },
                    boot: BootParams::default(),
                    swarm_join: SwarmJoinTemplate::default(),
                },
            })
            .collect(),
    }
}

type Executor = IdempotentEffectExecutor<InstantBackend>;

/// The stream events a real provider would emit after a result.
fn follow_up(result: &ExecutorResult) -> Option<Observation> {
    let event = match result.kind {
        EffectKind::StartBootstrap => BootstrapEvent::Joined,
        EffectKind::BootstrapConvergenceObserved => BootstrapEvent::Closed,
        _ => return None,
    };
    Some(Observation::Bootstrap {
        node: result.node.clone(),
        attempt: result.op.attempt(),
        event,
    })
}

fn fold(driver: &mut ClusterDriver, result: &ExecutorResult, now: Timestamp) {
    driver
        .apply_executor_result(result, now)
        .expect("result folds");
    if let Some(obs) = follow_up(result) {
        driver.apply_observation(&obs, now).expect("event folds");
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Delivery {
    Batch,
    OneAtATime,
}

struct BringUp {
    wall: Duration,
    passes: u64,
    driver: ClusterDriver,
    executor: Executor,
    spawner: ManualSpawner,
}

fn bring_up(nodes: u32, delivery: Delivery) -> BringUp {
    let spawner = ManualSpawner::new();
    let mut executor =
        IdempotentEffectExecutor::new(Arc::new(InstantBackend), Arc::new(spawner.clone()));
    let mut driver =
        ClusterDriver::new(RunId::new("bench"), RetryPolicy::default()).expect("driver");
    let now = Timestamp::ZERO;
    let start = Instant::now();
    driver.update_desired(shape(nodes)).expect("shape");
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(rounds < 64, "bring-up did not converge");
        driver
            .drive_until_blocked(now, &mut executor)
            .expect("drive");
        spawner.run_all(RunOrder::Fifo);
        let results = executor.take_results();
        if results.is_empty() {
            break;
        }
        for result in &results {
            fold(&mut driver, result, now);
            if delivery == Delivery::OneAtATime {
                driver
                    .drive_until_blocked(now, &mut executor)
                    .expect("drive");
            }
        }
    }
    let wall = start.elapsed();
    assert!(driver.is_converged(), "bring-up converged");
    BringUp {
        wall,
        passes: driver.counters().passes,
        driver,
        executor,
        spawner,
    }
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The calling thread's user plus system time in clock ticks (10 ms), which
/// a preempted pass does not accrue: on a shared machine a steadier measure
/// than wall time for long runs of passes.
fn thread_cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    // Fields after the command name (which may hold spaces) closed by ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Makes one node of every group unsteady for good: lost, its teardown's
/// first step dispatched and never answered. Its group's slots are then
/// walked one by one by a full pass (no group is known steady as a whole),
/// each slot's steady bit read instead of its node.
fn unsettle_one_per_group(setup: &mut BringUp) {
    let now = Timestamp::ZERO;
    let ids: Vec<LogicalNodeId> = setup
        .driver
        .desired()
        .groups()
        .keys()
        .map(|g| LogicalNodeId::new(g.clone(), 0))
        .collect();
    for id in ids {
        let attempt = setup.driver.state().nodes[&id].attempt;
        let lost = Observation::NodeLost {
            node: id,
            attempt,
            cause: LossCause::AgentGone,
        };
        setup
            .driver
            .apply_observation(&lost, now)
            .expect("loss folds");
    }
    setup
        .driver
        .drive_until_blocked(now, &mut setup.executor)
        .expect("drive");
}

fn steady_pass(setup: &mut BringUp, samples: usize) -> Duration {
    let now = Timestamp::from_millis(1);
    median(
        (0..samples)
            .map(|_| {
                setup.driver.trigger();
                let t = Instant::now();
                setup
                    .driver
                    .drive_until_blocked(now, &mut setup.executor)
                    .expect("pass");
                t.elapsed()
            })
            .collect(),
    )
}

/// A forced pass over `nodes` nodes that all have an operation pending.
fn mid_bring_up_pass(nodes: u32, samples: usize) -> Duration {
    let spawner = ManualSpawner::new();
    let mut executor =
        IdempotentEffectExecutor::new(Arc::new(InstantBackend), Arc::new(spawner.clone()));
    let mut driver =
        ClusterDriver::new(RunId::new("bench"), RetryPolicy::default()).expect("driver");
    driver.update_desired(shape(nodes)).expect("shape");
    let now = Timestamp::ZERO;
    driver
        .drive_until_blocked(now, &mut executor)
        .expect("drive");
    median(
        (0..samples)
            .map(|_| {
                driver.trigger();
                let t = Instant::now();
                driver
                    .drive_until_blocked(now, &mut executor)
                    .expect("pass");
                t.elapsed()
            })
            .collect(),
    )
}

/// A record the size of a [`ManagedNode`], for the floor.
#[derive(Clone, Copy)]
struct NodeSized([u64; std::mem::size_of::<ManagedNode>() / 8]);

/// The floor of a full pass: one in-order scan of a B-tree of `nodes`
/// node-sized records under the driver's key type (4 groups), reading two
/// words of each record (a pass reads the stage and the pending operation).
fn floor_scan(nodes: u32, samples: usize) -> Duration {
    let groups: Vec<GroupId> = (0..4).map(|g| GroupId::new(format!("group{g}"))).collect();
    let map: BTreeMap<LogicalNodeId, NodeSized> = (0..nodes)
        .map(|i| {
            let group = groups[(i % 4) as usize].clone();
            let mut record = NodeSized([0; std::mem::size_of::<ManagedNode>() / 8]);
            record.0[0] = u64::from(i);
            record.0[record.0.len() / 2] = 1;
            (LogicalNodeId::new(group, i / 4), record)
        })
        .collect();
    median(
        (0..samples)
            .map(|_| {
                let t = Instant::now();
                let sum: u64 = map
                    .values()
                    .map(|r| r.0[0] ^ r.0[r.0.len() / 2])
                    .fold(0, u64::wrapping_add);
                std::hint::black_box(sum);
                t.elapsed()
            })
            .collect(),
    )
}

fn per_node(d: Duration, nodes: u32) -> f64 {
    d.as_nanos() as f64 / f64::from(nodes)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--bring-up") {
        let n = args[i + 2].parse().expect("node count");
        bring_up_child(&args[i + 1], n);
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--steady") {
        // For profilers: one batch bring-up, then only forced full passes.
        let n = args[i + 1].parse().expect("node count");
        let passes = args[i + 2].parse().expect("pass count");
        let mut up = bring_up(n, Delivery::Batch);
        if std::env::var_os("BENCH_REBUILD").is_some() {
            let state = up.driver.state().clone();
            up.driver = ClusterDriver::with_state(
                up.driver.desired().clone(),
                state,
                RetryPolicy::default(),
            );
        }
        let walked = std::env::var_os("BENCH_WALK").is_some();
        if walked {
            unsettle_one_per_group(&mut up);
        }
        let cpu_before = thread_cpu_ticks();
        let pass = steady_pass(&mut up, passes);
        let cpu = thread_cpu_ticks().zip(cpu_before).map(|(after, before)| {
            // Clock ticks are 10 ms here; per pass and node in ns.
            (after - before) as f64 * 1e7 / passes as f64 / f64::from(n)
        });
        println!(
            "{n} nodes{}: median steady pass {:.2} ns/node wall, mean {:.2} ns/node on the CPU",
            if walked { " (every slot walked)" } else { "" },
            per_node(pass, n),
            cpu.unwrap_or(f64::NAN)
        );
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let sizes: &[u32] = if quick {
        &[1_000, 10_000]
    } else {
        &[1_000, 10_000, 100_000]
    };
    println!("# pass cost (median of repeated forced full passes, ns per node per pass)");
    println!(
        "{:>8} {:>14} {:>14} {:>16} {:>16}",
        "nodes", "steady ns/node", "walked ns/node", "mid-bring-up ns/node", "floor ns/node"
    );
    for &n in sizes {
        let samples = if n >= 100_000 { 11 } else { 31 };
        let mut up = bring_up(n, Delivery::Batch);
        let steady = steady_pass(&mut up, samples);
        // The same cluster with one node per group kept unsteady: every
        // slot is walked (the figure before the steady groups were skipped,
        // less the reads of the nodes).
        unsettle_one_per_group(&mut up);
        let walked = steady_pass(&mut up, samples);
        drop(up);
        let mid = mid_bring_up_pass(n, samples);
        let floor = floor_scan(n, samples);
        println!(
            "{n:>8} {:>14.2} {:>14.1} {:>16.1} {:>16.1}",
            per_node(steady, n),
            per_node(walked, n),
            per_node(mid, n),
            per_node(floor, n)
        );
    }

    let n = if quick { 10_000 } else { 100_000 };
    // Each run in a fresh process, the modes alternated: the first process
    // after a large free pays for the machine's first touch of the memory,
    // which would otherwise land on whichever mode ran first.
    let runs = if quick { 3 } else { 5 };
    println!(
        "\n# bring-up of {n} nodes to convergence (instant backend; each run in its own process, \
         the modes alternated; the run of median wall time of {runs})"
    );
    println!(
        "{:>14} {:>10} {:>10} {:>14} {:>12} {:>14} {:>14}   all wall ms",
        "delivery",
        "wall ms",
        "passes",
        "peak RSS MiB",
        "RSS B/node",
        "peak heap B/node",
        "end heap B/node"
    );
    let modes = ["batch", "one-at-a-time"];
    let mut rows: Vec<Vec<(u64, String)>> = vec![Vec::new(); modes.len()];
    for _ in 0..runs {
        for (mode, delivery) in modes.iter().enumerate() {
            let exe = std::env::current_exe().expect("own path");
            let output = std::process::Command::new(exe)
                .args(["--bring-up", delivery, &n.to_string()])
                .output()
                .expect("child bench runs");
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            let row = String::from_utf8_lossy(&output.stdout)
                .trim_end()
                .to_string();
            let wall = row
                .split_whitespace()
                .nth(1)
                .and_then(|w| w.parse().ok())
                .expect("a row names its wall time");
            rows[mode].push((wall, row));
        }
    }
    for mut runs in rows {
        runs.sort();
        let walls: Vec<String> = runs.iter().map(|(wall, _)| wall.to_string()).collect();
        println!("{}   {}", runs[runs.len() / 2].1, walls.join(" "));
    }
}

/// One bring-up in this process; prints one table row. Memory per node is the
/// peak resident set minus the resident set before the run, over `n`.
fn bring_up_child(delivery: &str, n: u32) {
    let mode = if delivery == "batch" {
        Delivery::Batch
    } else {
        Delivery::OneAtATime
    };
    let before = rss_kib().unwrap_or(0);
    // The peak is the process's: the bring-up is the first and largest thing
    // this child does.
    let heap_before = heap();
    let up = bring_up(n, mode);
    let peak = peak_rss_kib().unwrap_or(0);
    let per_node = |bytes: usize| (bytes / n as usize).to_string();
    let (heap_peak, heap_end) = match (heap_before, heap()) {
        (Some((live_before, _)), Some((live, max))) => (
            per_node(max.saturating_sub(live_before)),
            per_node(live.saturating_sub(live_before)),
        ),
        _ => ("-".to_string(), "-".to_string()),
    };
    println!(
        "{delivery:>14} {:>10} {:>10} {:>14.1} {:>12} {:>14} {:>14}",
        up.wall.as_millis(),
        up.passes,
        peak as f64 / 1024.0,
        (peak.saturating_sub(before) * 1024) / u64::from(n),
        heap_peak,
        heap_end,
    );
    assert!(up.spawner.is_empty());
    if std::env::var_os("BENCH_BREAKDOWN").is_some() {
        let BringUp {
            driver, executor, ..
        } = up;
        let live = || heap().map_or(0, |(live, _)| live);
        let all = live();
        drop(executor);
        let without_executor = live();
        drop(driver);
        let without_driver = live();
        if heap().is_some() {
            eprintln!(
                "executor {} B/node, driver {} B/node",
                (all - without_executor) / n as usize,
                (without_executor - without_driver) / n as usize
            );
        } else {
            eprintln!("BENCH_BREAKDOWN counts the heap: build with --features bench-heap");
        }
    }
}
