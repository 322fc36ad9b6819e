//! The ssh plugin against real OpenSSH servers on loopback.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{Testbed, key, spec};
use provisioning::Observation;
use provisioning::observe::LossCause;
use provisioning::{BootParams, Endpoint, EndpointLookup, RunId};
use provisioning_provider::{BootstrapRequest, ObservationSink, PluginError, ProvisionPlugin};
use provisioning_ssh::{FaultMode, FaultStep, SshHost, SshPlugin, SshPluginConfig};

fn boot() -> BootParams {
    BootParams::default()
}

#[tokio::test]
async fn create_adopt_list_lookup_and_destroy_over_real_ssh() {
    let bed = Testbed::start(1);
    let plugin = bed.plugin("run1", 2);
    let k = key("run1", "web", 0, 1);
    let first = plugin
        .create_node(&k, &spec(&k, boot()))
        .await
        .expect("create");
    assert!(!first.adopted);
    assert!(
        bed.hosts[0].claims().join("run1/web-0/a1").is_dir(),
        "the claim is a directory on the host"
    );
    let again = plugin
        .create_node(&k, &spec(&k, boot()))
        .await
        .expect("adopt");
    assert!(again.adopted);
    assert_eq!(again.lease, first.lease);

    let listed = plugin.list_nodes(&RunId::new("run1")).await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, k);
    assert_eq!(listed[0].lease, first.lease);
    assert!(
        plugin
            .list_nodes(&RunId::new("other-run"))
            .await
            .expect("list")
            .is_empty()
    );

    let endpoint = plugin
        .lookup_endpoint(&k, &first.lease)
        .await
        .expect("lookup");
    assert_eq!(
        endpoint,
        EndpointLookup::Ready(Endpoint(format!(
            "ssh://{}@127.0.0.1:{}",
            bed.user, bed.hosts[0].port
        )))
    );

    plugin
        .destroy_node(&k, &first.lease)
        .await
        .expect("destroy");
    assert!(!bed.hosts[0].claims().join("run1/web-0/a1").exists());
    assert!(
        plugin
            .list_nodes(&RunId::new("run1"))
            .await
            .expect("list")
            .is_empty()
    );
    plugin
        .destroy_node(&k, &first.lease)
        .await
        .expect("destroying an absent node succeeds");
    match plugin.lookup_endpoint(&k, &first.lease).await {
        Err(PluginError::NotFound(_)) => {}
        other => panic!("lookup of a destroyed node: {other:?}"),
    }
}

#[tokio::test]
async fn a_new_plugin_instance_lists_and_adopts_the_claims_on_the_hosts() {
    let bed = Testbed::start(2);
    let a = key("restart", "db", 0, 3);
    let b = key("restart", "db", 1, 4);
    let (lease_a, lease_b) = {
        let plugin = bed.plugin("restart", 1);
        let la = plugin
            .create_node(&a, &spec(&a, boot()))
            .await
            .expect("create a");
        let lb = plugin
            .create_node(&b, &spec(&b, boot()))
            .await
            .expect("create b");
        assert_ne!(la.lease, lb.lease, "one slot per host: two hosts used");
        (la.lease, lb.lease)
    };
    // A restarted controller: a new instance with no memory of its own.
    let plugin = bed.plugin("restart", 1);
    let listed = plugin
        .list_nodes(&RunId::new("restart"))
        .await
        .expect("list");
    let got: Vec<_> = listed
        .iter()
        .map(|n| (n.key.clone(), n.lease.clone()))
        .collect();
    assert_eq!(
        got,
        vec![(a.clone(), lease_a.clone()), (b.clone(), lease_b.clone())]
    );
    let adopted = plugin
        .create_node(&b, &spec(&b, boot()))
        .await
        .expect("adopt");
    assert!(adopted.adopted);
    assert_eq!(adopted.lease, lease_b);
    plugin.destroy_node(&a, &lease_a).await.expect("destroy a");
    plugin.destroy_node(&b, &lease_b).await.expect("destroy b");
    assert!(
        plugin
            .list_nodes(&RunId::new("restart"))
            .await
            .expect("list")
            .is_empty()
    );
}

#[tokio::test]
async fn no_free_slot_anywhere_is_definite_and_names_the_inventory() {
    let bed = Testbed::start(2);
    let plugin = bed.plugin("full", 1);
    // Another run's claim takes host0's only slot: slots count every run.
    let other = bed.plugin("neighbour", 1);
    let n = key("neighbour", "x", 0, 1);
    other
        .create_node(&n, &spec(&n, boot()))
        .await
        .expect("neighbour");
    let k1 = key("full", "w", 0, 1);
    let lease = plugin
        .create_node(&k1, &spec(&k1, boot()))
        .await
        .expect("one free slot");
    assert!(lease.lease.0.starts_with("ssh:host1:"), "{:?}", lease.lease);
    let k2 = key("full", "w", 1, 2);
    match plugin.create_node(&k2, &spec(&k2, boot())).await {
        Err(PluginError::Definite(message)) => {
            assert!(message.contains("no free slot"), "{message}");
            assert!(
                message.contains("\"testbed\""),
                "names the inventory: {message}"
            );
            assert!(
                message.contains("host0") && message.contains("host1"),
                "{message}"
            );
        }
        other => panic!("expected a definite failure, got {other:?}"),
    }
    assert_eq!(
        plugin
            .list_nodes(&RunId::new("full"))
            .await
            .expect("list")
            .len(),
        1
    );
}

#[tokio::test]
async fn an_unknown_host_key_is_refused_loudly_and_claims_nothing() {
    let bed = Testbed::start(1);
    bed.write_known_hosts("");
    let plugin = bed.plugin("strict", 1);
    let k = key("strict", "w", 0, 1);
    match plugin.create_node(&k, &spec(&k, boot())).await {
        Err(PluginError::Definite(message)) => {
            assert!(
                message.contains("HOST KEY VERIFICATION FAILED"),
                "{message}"
            );
            assert!(message.contains("UNKNOWN"), "{message}");
        }
        other => panic!("expected a definite host key failure, got {other:?}"),
    }
    assert!(
        !bed.hosts[0].claims().join("strict").exists(),
        "nothing claimed"
    );
    match plugin.list_nodes(&RunId::new("strict")).await {
        Err(PluginError::Definite(message)) => {
            assert!(
                message.contains("HOST KEY VERIFICATION FAILED"),
                "{message}"
            );
        }
        other => panic!("listing through an unknown host key: {other:?}"),
    }
}

#[tokio::test]
async fn a_changed_host_key_is_refused_loudly() {
    let bed = Testbed::start(1);
    let plugin = bed.plugin("changed", 1);
    let k = key("changed", "w", 0, 1);
    let lease = plugin
        .create_node(&k, &spec(&k, boot()))
        .await
        .expect("create");
    // The host now presents a key other than the recorded one.
    let impostor = bed.other_key("impostor");
    bed.write_known_hosts(&format!("[127.0.0.1]:{} {impostor}\n", bed.hosts[0].port));
    match plugin.lookup_endpoint(&k, &lease.lease).await {
        Err(PluginError::Definite(message)) => {
            assert!(
                message.contains("HOST KEY VERIFICATION FAILED"),
                "{message}"
            );
            assert!(message.contains("CHANGED"), "{message}");
        }
        other => panic!("expected a definite host key failure, got {other:?}"),
    }
    match plugin.destroy_node(&k, &lease.lease).await {
        Err(PluginError::Definite(message)) => {
            assert!(
                message.contains("HOST KEY VERIFICATION FAILED"),
                "{message}"
            )
        }
        other => panic!("destroy through a changed host key: {other:?}"),
    }
    assert!(bed.hosts[0].claims().join("changed/w-0/a1").is_dir());
    bed.write_known_hosts(&bed.known_hosts_lines());
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
}

#[tokio::test]
async fn a_host_that_refuses_connections_is_not_ready_and_cannot_be_destroyed_definitely() {
    let mut bed = Testbed::start(1);
    let plugin = bed.plugin("down", 1);
    let k = key("down", "w", 0, 1);
    let lease = plugin
        .create_node(&k, &spec(&k, boot()))
        .await
        .expect("create");
    bed.hosts[0].stop();
    assert_eq!(
        plugin
            .lookup_endpoint(&k, &lease.lease)
            .await
            .expect("lookup"),
        EndpointLookup::NotReady
    );
    match plugin.destroy_node(&k, &lease.lease).await {
        Err(PluginError::Definite(message)) => {
            assert!(message.contains("could not connect"), "{message}")
        }
        other => panic!("destroy on a refusing host: {other:?}"),
    }
    // A create of the same key cannot tell whether the host holds its claim.
    match plugin.create_node(&k, &spec(&k, boot())).await {
        Err(PluginError::Ambiguous(_)) => {}
        other => panic!("create while the claim's host is down: {other:?}"),
    }
    // A key never sent there fails definitely: no slot anywhere.
    let fresh = key("down", "w", 1, 2);
    match plugin.create_node(&fresh, &spec(&fresh, boot())).await {
        Err(PluginError::Definite(message)) => {
            assert!(message.contains("no free slot"), "{message}")
        }
        other => panic!("create with every host down: {other:?}"),
    }
    bed.hosts[0].start();
    assert!(matches!(
        plugin.lookup_endpoint(&k, &lease.lease).await,
        Ok(EndpointLookup::Ready(_))
    ));
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
}

#[tokio::test]
async fn a_refused_claim_is_definite_and_a_lost_reply_is_ambiguous_then_adopted() {
    let bed = Testbed::start(1);
    let plugin = bed.plugin("faults", 1);
    let k = key("faults", "w", 0, 1);
    plugin.arm_fault(FaultStep::Claim, FaultMode::Refused);
    assert!(matches!(
        plugin.create_node(&k, &spec(&k, boot())).await,
        Err(PluginError::Definite(_))
    ));
    assert!(
        plugin
            .list_nodes(&RunId::new("faults"))
            .await
            .expect("list")
            .is_empty()
    );
    plugin.arm_fault(FaultStep::Claim, FaultMode::ReplyLost);
    assert!(matches!(
        plugin.create_node(&k, &spec(&k, boot())).await,
        Err(PluginError::Ambiguous(_))
    ));
    let retry = plugin
        .create_node(&k, &spec(&k, boot()))
        .await
        .expect("retry");
    assert!(
        retry.adopted,
        "the retry adopts the claim the lost reply made"
    );
    plugin
        .destroy_node(&k, &retry.lease)
        .await
        .expect("destroy");
}

#[tokio::test]
async fn a_claim_removed_behind_the_plugins_back_is_reported_lost_under_its_attempt() {
    let bed = Testbed::start(1);
    let plugin = bed.plugin("loss", 2);
    let facts = Arc::new(Mutex::new(Vec::new()));
    let seen = facts.clone();
    plugin.attach(ObservationSink::new(move |o| seen.lock().unwrap().push(o)));
    let k = key("loss", "w", 0, 7);
    let kept = key("loss", "w", 1, 8);
    plugin
        .create_node(&k, &spec(&k, boot()))
        .await
        .expect("create");
    let lease = plugin
        .create_node(&kept, &spec(&kept, boot()))
        .await
        .expect("create");
    assert_eq!(plugin.check_losses().await.expect("check"), 0);
    std::fs::remove_dir_all(bed.hosts[0].claims().join("loss/w-0/a7")).expect("remove");
    assert_eq!(plugin.check_losses().await.expect("check"), 1);
    assert_eq!(
        *facts.lock().unwrap(),
        vec![Observation::NodeLost {
            node: k.node.clone(),
            attempt: k.attempt,
            cause: LossCause::LeaseGone,
        }]
    );
    // Reported once; a destroyed node is no loss.
    plugin
        .destroy_node(&kept, &lease.lease)
        .await
        .expect("destroy");
    assert_eq!(plugin.check_losses().await.expect("check"), 0);
    assert_eq!(facts.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn the_agent_is_installed_once_per_content_hash() {
    let bed = Testbed::start(1);
    let plugin = bed.plugin("install", 1);
    let local = bed.path().join("agent-v1");
    std::fs::write(&local, "#!/bin/sh\necho agent v1\n").expect("write agent");
    let (path, uploaded) = plugin
        .install_agent("host0", &local)
        .await
        .expect("install");
    assert!(uploaded);
    let installed = Path::new(&path);
    assert_eq!(
        std::fs::read(installed).expect("installed"),
        std::fs::read(&local).expect("local")
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(installed).expect("stat").permissions(),
    );
    assert_eq!(mode & 0o777, 0o755);
    let (again, uploaded) = plugin.install_agent("host0", &local).await.expect("again");
    assert_eq!(again, path);
    assert!(!uploaded, "the same content is not uploaded twice");
    std::fs::write(&local, "#!/bin/sh\necho agent v2\n").expect("write agent");
    let (v2, uploaded) = plugin.install_agent("host0", &local).await.expect("v2");
    assert!(uploaded);
    assert_ne!(v2, path, "another content hash is another file");
    assert!(matches!(
        plugin.install_agent("nowhere", &local).await,
        Err(PluginError::Definite(_))
    ));
}

#[tokio::test]
async fn a_plugin_without_an_agent_refuses_to_bootstrap_definitely() {
    let bed = Testbed::start(1);
    let plugin = bed.plugin("no-agent", 1);
    let k = key("no-agent", "w", 0, 1);
    let node_spec = spec(&k, boot());
    let lease = plugin.create_node(&k, &node_spec).await.expect("create");
    let request = BootstrapRequest {
        spec: node_spec,
        lease: lease.lease.clone(),
        endpoint: Endpoint("unused".into()),
    };
    match plugin.start_bootstrap(&k, &request).await {
        Err(PluginError::Definite(message)) => {
            assert!(message.contains("no node agent"), "{message}")
        }
        other => panic!("bootstrap without an agent: {other:?}"),
    }
    assert!(
        !bed.hosts[0]
            .claims()
            .join("no-agent/w-0/a1/session")
            .exists()
    );
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
}

#[test]
fn an_invalid_inventory_is_refused_with_located_errors() {
    let mut bad = SshHost::new("h1", "10.0.0.1", "ops");
    bad.slots = 0;
    bad.port = 0;
    let duplicate = SshHost::new("h1", "", "ops");
    let config = SshPluginConfig::new(RunId::new("r"), "rack", vec![bad, duplicate], "");
    let errors = SshPlugin::new(config).expect_err("invalid").to_string();
    for expected in [
        "hosts[0].slots",
        "hosts[0].port",
        "hosts[1].name: \"h1\" appears twice",
        "hosts[1].address",
        "known_hosts",
    ] {
        assert!(
            errors.contains(expected),
            "{expected} missing from:\n{errors}"
        );
    }
    let empty = SshPluginConfig::new(RunId::new("r"), "rack", Vec::new(), "/k");
    assert!(
        SshPlugin::new(empty)
            .expect_err("no hosts")
            .to_string()
            .contains("hosts: the inventory has no hosts")
    );
}
