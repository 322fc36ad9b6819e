//! The real agent over real SSH: installed once per content hash, started
//! detached with its boot order on `ssh`'s standard input, joins the
//! controller's [`RemoteSwarm`] over TCP; destroying the node stops it.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Testbed, key, spec};
use provisioning::BootParams;
use provisioning_agent::RunSecret;
use provisioning_agent::remote::{RemoteEvent, RemoteSwarm, RemoteSwarmConfig};
use provisioning_agent::wire::{BootOrder, JoinOrder, PROTOCOL_VERSION};
use provisioning_provider::ProvisionPlugin;

const AGENT: &str = env!("CARGO_BIN_EXE_provision-remote-agent");

#[tokio::test]
async fn an_installed_agent_joins_over_tcp_and_destroy_stops_it() {
    let bed = Testbed::start(1);
    let plugin = bed.plugin("run-agent", 1);
    let k = key("run-agent", "web", 0, 1);
    let lease = plugin
        .create_node(&k, &spec(&k, BootParams::default()))
        .await
        .expect("create");
    let host = bed.hosts[0].name.clone();
    let (remote, fresh) = plugin
        .install_agent(&host, Path::new(AGENT))
        .await
        .expect("install");
    assert!(fresh);
    let (again, fresh) = plugin
        .install_agent(&host, Path::new(AGENT))
        .await
        .expect("install again");
    assert_eq!(again, remote);
    assert!(!fresh, "the same content is uploaded once");

    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = events.clone();
    let swarm = RemoteSwarm::bind(
        RemoteSwarmConfig {
            run_id: k.run_id.clone(),
            secret: RunSecret::generate(),
            listen: "127.0.0.1:0".parse().expect("address"),
            advertised: None,
            rejoin_grace: Duration::from_millis(500),
        },
        move |event| sink.lock().expect("events").push(event),
    )
    .await
    .expect("bind");
    swarm.expect(&k);
    let credential = swarm.credential(&k).to_hex();
    let order = BootOrder {
        protocol: PROTOCOL_VERSION,
        run: k.run_id.as_str().to_owned(),
        node: k.node.to_string(),
        attempt: k.attempt.get(),
        user: String::new(),
        verify_commands: vec!["true".to_owned()],
        start_command: "sleep 300".to_owned(),
        env: BTreeMap::new(),
        args: Vec::new(),
        join: JoinOrder {
            address: swarm.advertised(),
            credential: credential.clone(),
            swarm: "default".to_owned(),
            labels: BTreeMap::new(),
        },
        group_size: None,
        address: None,
        on_peers_change: String::new(),
        resume_only: false,
    };
    let json = serde_json::to_vec(&order).expect("json");
    assert!(
        plugin
            .launch_agent(&host, &k, &remote, &json)
            .await
            .expect("launch")
    );
    assert!(
        swarm.wait_connected(&k, Duration::from_secs(20)).await,
        "the agent never joined"
    );
    assert_eq!(
        events.lock().expect("events").as_slice(),
        &[RemoteEvent::Joined(k.clone())]
    );
    let session = bed.hosts[0].claims().join("run-agent/web-0/a1/session");
    let pid = std::fs::read_to_string(session.join("pid")).expect("pid file");
    let pid = pid.trim().to_owned();
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    assert!(!session.join("order").exists(), "the boot file is gone");
    let log = std::fs::read_to_string(session.join("log")).unwrap_or_default();
    assert!(!log.contains(&credential), "the credential reached the log");
    // A second launch for the same claim adopts the running session.
    assert!(
        !plugin
            .launch_agent(&host, &k, &remote, &json)
            .await
            .expect("launch again")
    );

    swarm.forget(&k);
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
    assert!(!bed.hosts[0].claims().join("run-agent/web-0/a1").exists());
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(
        stat.is_empty() || stat.contains(") Z "),
        "the agent survived its node: {stat}"
    );
}
