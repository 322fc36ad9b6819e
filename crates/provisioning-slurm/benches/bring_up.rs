//! Bring-up of 8 nodes on the one-machine Slurm testbed: through the
//! plugin (create, endpoint, agent step, swarm join) against the same jobs
//! and steps submitted by hand (`sbatch`, `squeue` until running, `srun
//! --overlap` of a step that says it started) — the least Slurm needs.
//!
//! `cargo bench -p provisioning-slurm --bench bring_up` (as root). Prints
//! each round and the medians; the ratio is plugin / by hand.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use provisioning::observe::BootstrapEvent;
use provisioning::{
    BootParams, EndpointLookup, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate,
    Observation, ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_agent::RunSecret;
use provisioning_provider::{AttemptKey, BootstrapRequest, ObservationSink, ProvisionPlugin};
use provisioning_slurm::testbed::Testbed;
use provisioning_slurm::{SlurmPlugin, SlurmPluginConfig};
use tokio::io::{AsyncBufReadExt, BufReader};

const NODES: usize = 8;
const ROUNDS: usize = 5;
const POLL: Duration = Duration::from_millis(20);
const WAIT: Duration = Duration::from_secs(60);
const AGENT: &str = env!("CARGO_BIN_EXE_provision-slurm-agent");

fn spec(key: &AttemptKey) -> LogicalNodeSpec {
    let template = NodeTemplate {
        role: "bench".to_owned(),
        provider: "slurm".to_owned(),
        shape: ProviderShape::default(),
        boot: BootParams {
            on_peers_change: String::new(),
            start_command: "sleep 300".to_owned(),
            ..BootParams::default()
        },
        swarm_join: SwarmJoinTemplate {
            swarm: "default".to_owned(),
            labels: BTreeMap::new(),
        },
    };
    LogicalNodeSpec::new(key.node.clone(), key.run_id.clone(), Arc::new(template))
}

async fn through_plugin(bed: &Testbed, round: usize) -> Duration {
    let run = format!("bench-plugin-{round}");
    let mut config = SlurmPluginConfig::new(
        RunId::new(run.as_str()),
        RunSecret::generate(),
        vec![AGENT.to_owned()],
    );
    config.slurm_conf = Some(bed.conf().to_owned());
    let plugin = Arc::new(SlurmPlugin::start(config).await.expect("plugin"));
    let joined = Arc::new(Mutex::new(0_usize));
    let count = joined.clone();
    plugin.attach(ObservationSink::new(move |o| {
        if matches!(
            o,
            Observation::Bootstrap {
                event: BootstrapEvent::Joined,
                ..
            }
        ) {
            *count.lock().expect("count") += 1;
        }
    }));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for index in 0..NODES {
        let plugin = plugin.clone();
        let key = AttemptKey {
            run_id: RunId::new(run.as_str()),
            node: LogicalNodeId::parse(&format!("bench-{index}")).expect("node"),
            attempt: NodeAttemptId::from_raw(1),
        };
        tasks.push(tokio::spawn(async move {
            let spec = spec(&key);
            let lease = plugin.create_node(&key, &spec).await.expect("create");
            let endpoint = loop {
                match plugin
                    .lookup_endpoint(&key, &lease.lease)
                    .await
                    .expect("lookup")
                {
                    EndpointLookup::Ready(endpoint) => break endpoint,
                    EndpointLookup::NotReady => tokio::time::sleep(POLL).await,
                }
            };
            let request = BootstrapRequest {
                spec,
                lease: lease.lease,
                endpoint,
            };
            plugin.start_bootstrap(&key, &request).await.expect("start");
        }));
    }
    for task in tasks {
        task.await.expect("node task");
    }
    let deadline = Instant::now() + WAIT;
    while *joined.lock().expect("count") < NODES {
        assert!(Instant::now() < deadline, "not every agent joined");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    for node in plugin
        .list_nodes(&RunId::new(run.as_str()))
        .await
        .expect("list")
    {
        plugin
            .destroy_node(&node.key, &node.lease)
            .await
            .expect("destroy");
    }
    elapsed
}

fn client(bed: &Testbed, tool: &str) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(tool);
    command
        .env("SLURM_CONF", bed.conf())
        .current_dir("/tmp")
        .stdin(Stdio::null());
    command
}

async fn by_hand(bed: &Testbed, round: usize) -> Duration {
    let started = Instant::now();
    let names: Vec<String> = (0..NODES)
        .map(|index| format!("bench-hand-{round}-{index}"))
        .collect();
    let submits: Vec<_> = names
        .iter()
        .map(|name| {
            let mut sbatch = client(bed, "sbatch");
            sbatch.args([
                "--parsable",
                &format!("--job-name={name}"),
                "--nodes=1",
                "--ntasks=1",
                "--no-requeue",
                "--output=/dev/null",
                "--wrap=exec sleep infinity",
            ]);
            tokio::spawn(async move {
                let out = sbatch.output().await.expect("sbatch");
                String::from_utf8_lossy(&out.stdout).trim().to_owned()
            })
        })
        .collect();
    let mut jobs = Vec::new();
    for submit in submits {
        jobs.push(submit.await.expect("sbatch task"));
    }
    // One squeue for all jobs per poll, as a careful script would.
    let list = jobs.join(",");
    loop {
        let out = client(bed, "squeue")
            .args(["-h", "-j", &list, "-o", "%T"])
            .output()
            .await
            .expect("squeue");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.lines().filter(|l| l.trim() == "RUNNING").count() == NODES {
            break;
        }
        tokio::time::sleep(POLL).await;
    }
    let steps: Vec<_> = jobs
        .iter()
        .map(|job| {
            let mut child = client(bed, "srun")
                .args([
                    &format!("--jobid={job}"),
                    "--overlap",
                    "--nodes=1",
                    "--ntasks=1",
                    "--quiet",
                    "sh",
                    "-c",
                    "echo ready; exec sleep 300",
                ])
                .stdout(Stdio::piped())
                .kill_on_drop(false)
                .spawn()
                .expect("srun");
            tokio::spawn(async move {
                let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
                let line = lines.next_line().await.expect("read").unwrap_or_default();
                assert_eq!(line, "ready");
                tokio::spawn(async move {
                    let _ = child.wait().await;
                });
            })
        })
        .collect();
    for step in steps {
        step.await.expect("step task");
    }
    let elapsed = started.elapsed();
    let status = client(bed, "scancel")
        .args(&jobs)
        .status()
        .await
        .expect("scancel");
    assert!(status.success());
    let deadline = Instant::now() + WAIT;
    while !bed.live_jobs("bench-hand-").is_empty() {
        assert!(Instant::now() < deadline, "hand jobs did not go");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    elapsed
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let bed = Testbed::start(NODES);
    let mut plugin_times = Vec::new();
    let mut hand_times = Vec::new();
    runtime.block_on(async {
        for round in 0..ROUNDS {
            let hand = by_hand(&bed, round).await;
            let plugin = through_plugin(&bed, round).await;
            println!(
                "round {round}: by hand {:.0} ms, plugin {:.0} ms",
                hand.as_secs_f64() * 1e3,
                plugin.as_secs_f64() * 1e3
            );
            hand_times.push(hand);
            plugin_times.push(plugin);
        }
    });
    let hand = median(hand_times);
    let plugin = median(plugin_times);
    println!(
        "bring-up of {NODES} nodes, median of {ROUNDS}: by hand {:.0} ms, plugin {:.0} ms, ratio {:.2}",
        hand.as_secs_f64() * 1e3,
        plugin.as_secs_f64() * 1e3,
        plugin.as_secs_f64() / hand.as_secs_f64()
    );
}
