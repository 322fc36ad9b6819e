//! The ssh plugin against an sshd in a network namespace of its own, with
//! its own address, partitioned by setting its link down: a real partition.

mod common;

use std::time::Duration;

use common::{Testbed, key, spec};
use provisioning::{BootParams, Endpoint, EndpointLookup};
use provisioning_agent::RunSecret;
use provisioning_provider::{BootstrapRequest, PluginError, ProvisionPlugin};
use provisioning_ssh::SshPlugin;

const AGENT: &str = env!("CARGO_BIN_EXE_provision-remote-agent");

/// How many times the test looks for the remote verify command to run.
const MARKER_POLLS_MAX: usize = 3_000;

#[tokio::test]
async fn a_partition_mid_call_is_ambiguous_and_a_partitioned_host_is_not_ready() {
    let bed = Testbed::start_netns(1);
    let host = &bed.hosts[0];
    let netns = host.netns.as_ref().expect("a namespaced host");
    let mut config = bed.config("part", 1);
    config.connect_timeout = Duration::from_secs(2);
    config.command_timeout = Duration::from_secs(6);
    let agent = bed.agent_config(AGENT, RunSecret::generate(), 0);
    let plugin = SshPlugin::start(config, agent)
        .await
        .expect("start the plugin");

    let k = key("part", "w", 0, 1);
    let marker = bed.path().join("verify-running");
    let params = BootParams {
        on_peers_change: String::new(),
        // Records its pid, then outlasts the call.
        verify_commands: vec![format!("echo $$ > {}; exec sleep 30", marker.display())],
        ..BootParams::default()
    };
    let node_spec = spec(&k, params);
    let lease = plugin.create_node(&k, &node_spec).await.expect("create");
    assert_eq!(
        plugin
            .lookup_endpoint(&k, &lease.lease)
            .await
            .expect("lookup"),
        EndpointLookup::Ready(Endpoint(format!("ssh://{}@{}:22", bed.user, netns.address)))
    );

    let request = BootstrapRequest {
        spec: node_spec,
        lease: lease.lease.clone(),
        endpoint: Endpoint("unused".into()),
    };
    let (result, ()) = tokio::join!(plugin.start_bootstrap(&k, &request), async {
        // Partition once the command runs on the host: mid-call.
        let mut polls = 0;
        while !std::fs::read_to_string(&marker).is_ok_and(|pid| !pid.trim().is_empty()) {
            polls += 1;
            assert!(polls < MARKER_POLLS_MAX, "the verify command never ran");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        netns.partition();
    });
    match result {
        Err(PluginError::Ambiguous(message)) => eprintln!("mid-call partition: {message}"),
        other => panic!("a call cut off by a partition must be ambiguous, got {other:?}"),
    }

    // While partitioned: not ready, and a destroy did nothing (definite).
    assert_eq!(
        plugin
            .lookup_endpoint(&k, &lease.lease)
            .await
            .expect("lookup"),
        EndpointLookup::NotReady
    );
    assert!(matches!(
        plugin.destroy_node(&k, &lease.lease).await,
        Err(PluginError::Definite(_))
    ));

    netns.heal();
    assert!(matches!(
        plugin.lookup_endpoint(&k, &lease.lease).await,
        Ok(EndpointLookup::Ready(_))
    ));
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
    if let Ok(pid) = std::fs::read_to_string(&marker) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status();
    }
}

/// A cleanup against a cut-off host is retried until it answers; the retry
/// in flight when the link comes back sees the heal (fresh probes about a
/// second apart, then `ssh`) instead of failing on a connection that was
/// opened while the host's route was gone, so the slot is not held for
/// another retry and backoff.
#[tokio::test]
async fn a_destroy_in_flight_when_a_partition_heals_succeeds() {
    let bed = Testbed::start_netns(1);
    let host = &bed.hosts[0];
    let netns = host.netns.as_ref().expect("a namespaced host");
    let mut config = bed.config("heal", 1);
    config.connect_timeout = Duration::from_secs(3);
    config.command_timeout = Duration::from_secs(8);
    let plugin = SshPlugin::new(config).expect("the plugin");
    let k = key("heal", "w", 0, 1);
    let node_spec = spec(&k, BootParams::default());
    let lease = plugin.create_node(&k, &node_spec).await.expect("create");

    netns.partition();
    // The first call fails to connect; the next is answered by the probes
    // alone (nothing ran, no `ssh` waited out its timeout).
    let first = plugin.destroy_node(&k, &lease.lease).await;
    assert!(
        matches!(&first, Err(PluginError::Definite(m)) if m.contains("could not connect")),
        "{first:?}"
    );
    let second = plugin.destroy_node(&k, &lease.lease).await;
    assert!(
        matches!(&second, Err(PluginError::Definite(m)) if m.contains("probed before calling ssh")),
        "{second:?}"
    );

    // A destroy starts while the host is cut off; the link comes back while
    // it is under way.
    let (destroyed, ()) = tokio::join!(plugin.destroy_node(&k, &lease.lease), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        netns.heal();
    });
    destroyed.expect("the destroy in flight at the heal reaches the host");
    assert!(
        plugin.list_nodes(&k.run_id).await.expect("list").is_empty(),
        "the claim is gone"
    );
}
