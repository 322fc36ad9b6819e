//! 100k-node bring-up with and without a journal, side by side in one run.
//!
//! The real driver and executor over an instant in-memory backend (as in the
//! core's `pass_cost` bench), driven the way the durable host drives them:
//! every drive goes into a buffer, its change set is encoded and committed,
//! and only then are its operations submitted. Variants: no journal (the
//! operations are submitted straight away), the in-memory journal, and the
//! SQLite journal with `synchronous=NORMAL` and `FULL`.
//!
//! `cargo bench -p provisioning-journal --bench journaled_bring_up`
//! (`-- --nodes N --runs R` to change the size and the repetitions).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provisioning::effect::EffectRequest;
use provisioning::spawn::BoxFuture;
use provisioning::{
    BootParams, BootstrapEvent, ClusterDriver, ClusterShape, EffectBackend, EffectError,
    EffectKind, EffectOutput, Endpoint, EndpointLookup, Generation, GroupId,
    IdempotentEffectExecutor, LeaseHandle, ManualSpawner, NodeGroup, NodeTemplate, Observation,
    Operation, OperationSink, ProviderShape, RetryPolicy, RunId, RunOrder, SessionHandle,
    SubmitError, SwarmJoinTemplate, Timestamp,
};
use provisioning_journal::codec::StateCodec;
use provisioning_journal::{Journal, MemoryJournal, SqliteJournal, SqliteOptions, Synchronous};

const RUN: &str = "bench";

struct Instantly;

impl EffectBackend for Instantly {
    fn execute<'a>(
        &'a self,
        operation: &'a Operation,
    ) -> BoxFuture<'a, Result<EffectOutput, EffectError>> {
        let n = operation.attempt().get();
        let output = match &operation.request {
            EffectRequest::CreateLease => EffectOutput::LeaseCreated {
                lease: LeaseHandle(format!("l{n}")),
                endpoint: Some(Endpoint(format!("127.0.0.1:{}", n % 60_000))),
                adopted: false,
            },
            EffectRequest::LookupEndpoint { .. } => EffectOutput::Endpoint(EndpointLookup::Ready(
                Endpoint(format!("127.0.0.1:{}", n % 60_000)),
            )),
            EffectRequest::StartBootstrap { .. } => EffectOutput::BootstrapStarted {
                session: SessionHandle(format!("s{n}")),
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
    let run = RunId::new(RUN);
    let groups = 4;
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

#[derive(Default)]
struct Batch(Vec<Operation>);

impl OperationSink for Batch {
    fn submit(&mut self, operation: Operation) -> Result<(), SubmitError> {
        self.0.push(operation);
        Ok(())
    }
}

struct Outcome {
    wall: Duration,
    commits: u64,
    bytes: u64,
    /// Time in `take_changes`, in the codec and in the journal's commit.
    take: Duration,
    encode: Duration,
    commit: Duration,
}

fn bring_up(nodes: u32, mut journal: Option<Box<dyn Journal>>) -> Outcome {
    let spawner = ManualSpawner::new();
    let executor = IdempotentEffectExecutor::new(Arc::new(Instantly), Arc::new(spawner.clone()));
    let mut driver = ClusterDriver::new(RunId::new(RUN), RetryPolicy::default()).expect("driver");
    let mut codec = StateCodec::new();
    let now = Timestamp::ZERO;
    let (mut take, mut encode, mut commit) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let start = Instant::now();
    if journal.is_some() {
        driver.track_changes();
    }
    driver.update_desired(shape(nodes)).expect("shape");
    for round in 0.. {
        assert!(round < 64, "bring-up did not converge");
        match journal.as_mut() {
            None => {
                executor.drive(&mut driver, now).expect("drive");
            }
            Some(journal) => {
                let mut batch = Batch::default();
                driver.drive_until_blocked(now, &mut batch).expect("drive");
                let t0 = Instant::now();
                let changes = driver.take_changes(now);
                let t1 = Instant::now();
                if !changes.is_empty() {
                    let rows = codec.encode_view(&changes).expect("encode");
                    drop(changes);
                    let t2 = Instant::now();
                    journal.commit(&rows).expect("commit");
                    encode += t2 - t1;
                    commit += t2.elapsed();
                }
                take += t1 - t0;
                for operation in batch.0 {
                    executor.submit(operation).expect("submit");
                }
            }
        }
        spawner.run_all(RunOrder::Fifo);
        let results = executor.take_results();
        if results.is_empty() {
            break;
        }
        for result in &results {
            driver.apply_executor_result(result, now).expect("fold");
            let event = match result.kind {
                EffectKind::StartBootstrap => BootstrapEvent::Joined,
                EffectKind::BootstrapConvergenceObserved => BootstrapEvent::Closed,
                _ => continue,
            };
            let observation = Observation::Bootstrap {
                node: result.node.clone(),
                attempt: result.op.attempt(),
                event,
            };
            driver.apply_observation(&observation, now).expect("event");
        }
    }
    if let Some(journal) = journal.as_mut() {
        let changes = driver.take_changes(now);
        if !changes.is_empty() {
            let rows = codec.encode_view(&changes).expect("encode");
            drop(changes);
            journal.commit(&rows).expect("commit");
        }
    }
    let wall = start.elapsed();
    assert!(driver.is_converged());
    let stats = journal.map(|j| j.stats()).unwrap_or_default();
    Outcome {
        wall,
        commits: stats.commits,
        bytes: stats.bytes_written,
        take,
        encode,
        commit,
    }
}

fn sqlite(dir: &std::path::Path, synchronous: Synchronous) -> Option<Box<dyn Journal>> {
    let opts = SqliteOptions {
        synchronous,
        ..SqliteOptions::default()
    };
    Some(Box::new(
        SqliteJournal::open(dir, RUN, &opts).expect("open"),
    ))
}

fn arg(args: &[String], name: &str, default: u32) -> u32 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nodes = arg(&args, "--nodes", 100_000);
    let runs = arg(&args, "--runs", 3).max(1);
    type Make = fn(&std::path::Path) -> Option<Box<dyn Journal>>;
    let variants: [(&str, Make); 4] = [
        ("no journal", |_| None),
        ("memory journal", |_| {
            Some(Box::new(MemoryJournal::new(RUN).expect("memory")))
        }),
        ("sqlite normal", |dir| sqlite(dir, Synchronous::Normal)),
        ("sqlite full", |dir| sqlite(dir, Synchronous::Full)),
    ];
    println!("# bring-up of {nodes} nodes, median of {runs} run(s) each, interleaved");
    let mut samples: Vec<Vec<Outcome>> = variants.iter().map(|_| Vec::new()).collect();
    for _ in 0..runs {
        for (i, (_, make)) in variants.iter().enumerate() {
            let dir = tempfile::tempdir().expect("tempdir");
            samples[i].push(bring_up(nodes, make(dir.path())));
        }
    }
    let median = |outcomes: &mut Vec<Outcome>| {
        outcomes.sort_by_key(|o| o.wall);
        outcomes.swap_remove(outcomes.len() / 2)
    };
    let base = median(&mut samples[0]).wall;
    println!(
        "{:>16} {:>9} {:>7} {:>8} {:>12} {:>8} {:>10} {:>10}",
        "variant", "wall ms", "ratio", "commits", "bytes/node", "take ms", "encode ms", "commit ms"
    );
    for (i, (name, _)) in variants.iter().enumerate() {
        let outcome = if i == 0 {
            Outcome {
                wall: base,
                commits: 0,
                bytes: 0,
                take: Duration::ZERO,
                encode: Duration::ZERO,
                commit: Duration::ZERO,
            }
        } else {
            median(&mut samples[i])
        };
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "{name:>16} {:>9.0} {:>7.2} {:>8} {:>12.0} {:>8.0} {:>10.0} {:>10.0}",
            ms(outcome.wall),
            outcome.wall.as_secs_f64() / base.as_secs_f64(),
            outcome.commits,
            outcome.bytes as f64 / f64::from(nodes),
            ms(outcome.take),
            ms(outcome.encode),
            ms(outcome.commit),
        );
    }
}
