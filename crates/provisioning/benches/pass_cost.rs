//! Pass cost and large bring-up of the core, with an instant in-memory backend.
//!
//! Run with `cargo bench -p provisioning --bench pass_cost` (optionally
//! `-- --quick` for 1k/10k only). Prints medians over repeated runs.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::effect::EffectRequest;
use provisioning::executor::EffectBackend;
use provisioning::spawn::BoxFuture;
use provisioning::{
    BootParams, BootstrapEvent, ClusterDriver, ClusterShape, EffectError, EffectKind, EffectOutput,
    Endpoint, EndpointLookup, ExecutorResult, Generation, GroupId, IdempotentEffectExecutor,
    LeaseHandle, ManualSpawner, NodeGroup, NodeTemplate, Observation, Operation, ProviderShape,
    RetryPolicy, RunId, RunOrder, SessionHandle, SwarmJoinTemplate, Timestamp,
};

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

fn per_node(d: Duration, nodes: u32) -> f64 {
    d.as_nanos() as f64 / f64::from(nodes)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sizes: &[u32] = if quick {
        &[1_000, 10_000]
    } else {
        &[1_000, 10_000, 100_000]
    };
    println!("# pass cost (median of repeated forced full passes, ns per node per pass)");
    println!(
        "{:>8} {:>14} {:>16}",
        "nodes", "steady ns/node", "mid-bring-up ns/node"
    );
    for &n in sizes {
        let samples = if n >= 100_000 { 11 } else { 31 };
        let mut up = bring_up(n, Delivery::Batch);
        let steady = steady_pass(&mut up, samples);
        drop(up);
        let mid = mid_bring_up_pass(n, samples);
        println!(
            "{n:>8} {:>14.1} {:>16.1}",
            per_node(steady, n),
            per_node(mid, n)
        );
    }

    let n = if quick { 10_000 } else { 100_000 };
    println!("\n# bring-up of {n} nodes to convergence (instant backend)");
    println!(
        "{:>12} {:>10} {:>10} {:>14} {:>12}",
        "delivery", "wall ms", "passes", "peak RSS MiB", "bytes/node"
    );
    for delivery in [Delivery::Batch, Delivery::OneAtATime] {
        let before = rss_kib().unwrap_or(0);
        let up = bring_up(n, delivery);
        let after = rss_kib().unwrap_or(0);
        let peak = peak_rss_kib().unwrap_or(0);
        let name = match delivery {
            Delivery::Batch => "batch",
            Delivery::OneAtATime => "one-at-a-time",
        };
        println!(
            "{name:>12} {:>10} {:>10} {:>14.1} {:>12}",
            up.wall.as_millis(),
            up.passes,
            peak as f64 / 1024.0,
            (after.saturating_sub(before) * 1024) / u64::from(n)
        );
        assert!(up.spawner.is_empty());
        drop(up);
    }
}
