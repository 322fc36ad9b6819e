//! Bring-up of 50 containers on a private Docker engine: through the plugin
//! (create, endpoint, agent exec, swarm join) against the same containers
//! made by direct Engine API calls (create, start, an exec that says it
//! started) — the least the engine needs.
//!
//! `cargo bench -p provisioning-container --bench bring_up` (as root). Prints
//! each round and the medians; the ratio is plugin / direct.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::exec::{StartExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, ExecConfig, HostConfig};
use bollard::query_parameters::{CreateContainerOptions, RemoveContainerOptions};
use futures_util::StreamExt;
use provisioning::observe::BootstrapEvent;
use provisioning::{
    BootParams, EndpointLookup, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, NodeTemplate,
    Observation, ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_agent::RunSecret;
use provisioning_container::testbed::{Engine, TEST_IMAGE};
use provisioning_container::{AgentSource, ContainerPlugin, ContainerPluginConfig};
use provisioning_provider::{AttemptKey, BootstrapRequest, ObservationSink, ProvisionPlugin};

const NODES: usize = 50;
const ROUNDS: usize = 5;
const POLL: Duration = Duration::from_millis(20);
const WAIT: Duration = Duration::from_secs(120);
const AGENT: &str = env!("CARGO_BIN_EXE_provision-container-agent");

fn spec(key: &AttemptKey, engine: &Engine) -> LogicalNodeSpec {
    let template = NodeTemplate {
        role: "bench".to_owned(),
        provider: "container".to_owned(),
        shape: ProviderShape {
            image: String::new(),
            resources: BTreeMap::new(),
            labels: BTreeMap::from([
                ("container.image".to_owned(), TEST_IMAGE.to_owned()),
                ("container.network".to_owned(), engine.network().to_owned()),
            ]),
        },
        boot: BootParams {
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

async fn through_plugin(engine: &Engine, round: usize) -> Duration {
    let run = format!("bench-plugin-{round}");
    let mut config = ContainerPluginConfig::new(
        RunId::new(run.as_str()),
        RunSecret::generate(),
        AgentSource::Mount(AGENT.into()),
    );
    config.socket = engine.socket();
    config.listen = SocketAddr::new(engine.gateway(), 0);
    config.stop_grace = Duration::from_secs(1);
    let plugin = Arc::new(ContainerPlugin::start(config).await.expect("plugin"));
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
    let specs: Vec<(AttemptKey, LogicalNodeSpec)> = (0..NODES)
        .map(|index| {
            let key = AttemptKey {
                run_id: RunId::new(run.as_str()),
                node: LogicalNodeId::parse(&format!("bench-{index}")).expect("node"),
                attempt: NodeAttemptId::from_raw(1),
            };
            let spec = spec(&key, engine);
            (key, spec)
        })
        .collect();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (key, spec) in specs {
        let plugin = plugin.clone();
        tasks.push(tokio::spawn(async move {
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
    let listed = plugin
        .list_nodes(&RunId::new(run.as_str()))
        .await
        .expect("list");
    let destroys: Vec<_> = listed
        .into_iter()
        .map(|node| {
            let plugin = plugin.clone();
            tokio::spawn(async move { plugin.destroy_node(&node.key, &node.lease).await })
        })
        .collect();
    for destroy in destroys {
        destroy.await.expect("destroy task").expect("destroy");
    }
    elapsed
}

/// One container by direct calls: create, start, an exec until it says
/// it started.
async fn direct_one(docker: Docker, name: String, network: String) -> String {
    let body = ContainerCreateBody {
        image: Some(TEST_IMAGE.to_owned()),
        entrypoint: Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            "exec sleep 3600".into(),
        ]),
        labels: Some(HashMap::from([("bench".to_owned(), "direct".to_owned())])),
        host_config: Some(HostConfig {
            network_mode: Some(network),
            ..Default::default()
        }),
        ..Default::default()
    };
    let created = docker
        .create_container(
            Some(CreateContainerOptions {
                name: Some(name),
                ..Default::default()
            }),
            body,
        )
        .await
        .expect("create");
    docker
        .start_container(&created.id, None)
        .await
        .expect("start");
    let exec = docker
        .create_exec(
            &created.id,
            ExecConfig {
                attach_stdout: Some(true),
                cmd: Some(vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "echo ready; exec sleep 300".into(),
                ]),
                ..Default::default()
            },
        )
        .await
        .expect("exec");
    let StartExecResults::Attached { mut output, .. } = docker
        .start_exec(&exec.id, None::<StartExecOptions>)
        .await
        .expect("start exec")
    else {
        panic!("not attached");
    };
    let mut said = Vec::new();
    while !said.ends_with(b"ready\n") {
        let chunk = output.next().await.expect("output").expect("chunk");
        said.extend_from_slice(&chunk.into_bytes());
    }
    created.id
}

async fn direct(engine: &Engine, docker: &Docker, round: usize) -> Duration {
    let started = Instant::now();
    let tasks: Vec<_> = (0..NODES)
        .map(|index| {
            tokio::spawn(direct_one(
                docker.clone(),
                format!("bench-direct-{round}-{index}"),
                engine.network().to_owned(),
            ))
        })
        .collect();
    let mut ids = Vec::new();
    for task in tasks {
        ids.push(task.await.expect("direct task"));
    }
    let elapsed = started.elapsed();
    let removes: Vec<_> = ids
        .into_iter()
        .map(|id| {
            let docker = docker.clone();
            tokio::spawn(async move {
                docker
                    .remove_container(
                        &id,
                        Some(RemoveContainerOptions {
                            force: true,
                            ..Default::default()
                        }),
                    )
                    .await
            })
        })
        .collect();
    for remove in removes {
        remove.await.expect("remove task").expect("remove");
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
    let engine = Engine::start(std::path::Path::new(AGENT));
    let mut plugin_times = Vec::new();
    let mut direct_times = Vec::new();
    runtime.block_on(async {
        let docker = Docker::connect_with_unix(&engine.socket(), 120, bollard::API_DEFAULT_VERSION)
            .expect("client")
            .negotiate_version()
            .await
            .expect("version");
        for round in 0..ROUNDS {
            // Alternate which goes first, so that neither always meets a
            // daemon still busy with the other's teardown.
            let (by_api, plugin) = if round % 2 == 0 {
                let by_api = direct(&engine, &docker, round).await;
                (by_api, through_plugin(&engine, round).await)
            } else {
                let plugin = through_plugin(&engine, round).await;
                (direct(&engine, &docker, round).await, plugin)
            };
            println!(
                "round {round}: direct {:.0} ms, plugin {:.0} ms",
                by_api.as_secs_f64() * 1e3,
                plugin.as_secs_f64() * 1e3
            );
            direct_times.push(by_api);
            plugin_times.push(plugin);
        }
    });
    let by_api = median(direct_times);
    let plugin = median(plugin_times);
    println!(
        "bring-up of {NODES} containers, median of {ROUNDS}: direct {:.0} ms, plugin {:.0} ms, ratio {:.2}",
        by_api.as_secs_f64() * 1e3,
        plugin.as_secs_f64() * 1e3,
        plugin.as_secs_f64() / by_api.as_secs_f64()
    );
}
