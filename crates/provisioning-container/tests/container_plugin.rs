//! The container plugin against a private Docker engine on this machine
//! (see `provisioning_container::testbed`), every fact checked with the
//! `docker` client as well.

mod common;

use std::sync::{Arc, Mutex};

use common::{key, labels, plugin, spec, wait_until};
use provisioning::observe::{BootstrapEvent, LossCause, WorkloadEnd};
use provisioning::{EndpointLookup, Observation, RunId};
use provisioning_container::{ContainerPlugin, container_name};
use provisioning_provider::{BootstrapRequest, ObservationSink, PluginError, ProvisionPlugin};

type Facts = Arc<Mutex<Vec<Observation>>>;

fn attach(plugin: &ContainerPlugin) -> Facts {
    let facts = Facts::default();
    let record = facts.clone();
    plugin.attach(ObservationSink::new(move |o| {
        record.lock().expect("facts").push(o)
    }));
    facts
}

fn joined(facts: &Facts, key: &provisioning_provider::AttemptKey) -> bool {
    facts.lock().expect("facts").iter().any(|o| {
        matches!(o, Observation::Bootstrap { node, attempt, event: BootstrapEvent::Joined, .. }
            if *node == key.node && *attempt == key.attempt)
    })
}

fn lost(facts: &Facts, key: &provisioning_provider::AttemptKey) -> Option<LossCause> {
    facts.lock().expect("facts").iter().find_map(|o| match o {
        Observation::NodeLost {
            node,
            attempt,
            cause,
            ..
        } if *node == key.node && *attempt == key.attempt => Some(*cause),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_is_created_adopted_bootstrapped_lost_and_destroyed() {
    let engine = common::engine();
    let plugin = plugin(&engine, "plugin-test").await;
    let facts = attach(&plugin);
    let k = key("plugin-test", "workers-0", 3);
    let name = container_name(&k).expect("name");
    let mut table = labels(&engine);
    table.insert("container.memory".into(), "64m".into());
    table.insert("container.env.MODE".into(), "test".into());
    let s = spec(&k, table, "sleep 1000");
    let first = plugin.create_node(&k, &s).await.expect("create");
    assert!(!first.adopted);
    let live = engine.containers("prov.plugin-test.");
    assert_eq!(live.len(), 1, "{live:?}");
    assert_eq!(live[0].1, name);
    assert_eq!(first.lease.0, format!("container:{}", live[0].0));
    // The group's table reached the engine.
    let shown = engine.docker_ok(&[
        "inspect",
        "-f",
        "{{.HostConfig.Memory}} {{json .Config.Env}}",
        &name,
    ]);
    assert!(shown.starts_with(&(64u64 << 20).to_string()), "{shown}");
    assert!(shown.contains("MODE=test"), "{shown}");

    let again = plugin.create_node(&k, &s).await.expect("second create");
    assert!(again.adopted);
    assert_eq!(again.lease, first.lease);
    assert_eq!(engine.containers("prov.plugin-test.").len(), 1);
    let listed = plugin
        .list_nodes(&RunId::new("plugin-test"))
        .await
        .expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, k);
    assert_eq!(listed[0].lease, first.lease);

    let endpoint = match plugin
        .lookup_endpoint(&k, &first.lease)
        .await
        .expect("lookup")
    {
        EndpointLookup::Ready(endpoint) => endpoint,
        EndpointLookup::NotReady => panic!("a started container is ready"),
    };
    assert!(endpoint.0.starts_with("container://"), "{endpoint:?}");
    let request = BootstrapRequest {
        spec: s.clone(),
        lease: first.lease.clone(),
        endpoint,
    };
    let session = plugin
        .start_bootstrap(&k, &request)
        .await
        .expect("bootstrap");
    assert!(!session.adopted);
    wait_until("the agent's join", || joined(&facts, &k)).await;
    let again = plugin
        .start_bootstrap(&k, &request)
        .await
        .expect("bootstrap again");
    assert!(again.adopted);
    plugin
        .complete_bootstrap(&k, Some(&session.session))
        .await
        .expect("complete");

    // Killed by someone: lost, with its exit code.
    engine.docker_ok(&["kill", &name]);
    wait_until("the loss of the killed container", || {
        lost(&facts, &k).is_some()
    })
    .await;
    let cause = lost(&facts, &k).expect("lost");
    assert!(
        matches!(
            cause,
            LossCause::WorkloadEnded(WorkloadEnd::Status(137)) | LossCause::AgentGone
        ),
        "{cause:?}"
    );

    plugin
        .destroy_node(&k, &first.lease)
        .await
        .expect("destroy");
    assert!(engine.containers("prov.plugin-test.").is_empty());
    plugin
        .destroy_node(&k, &first.lease)
        .await
        .expect("destroying an absent container succeeds");
    assert!(matches!(
        plugin.lookup_endpoint(&k, &first.lease).await,
        Err(PluginError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_image_is_a_definite_failure_and_leaves_nothing() {
    let engine = common::engine();
    let plugin = plugin(&engine, "image-test").await;
    let k = key("image-test", "workers-0", 1);
    let mut table = labels(&engine);
    table.insert("container.image".into(), "not-here:404".into());
    let error = plugin
        .create_node(&k, &spec(&k, table, ""))
        .await
        .expect_err("no such image");
    assert!(
        matches!(&error, PluginError::Definite(m) if m.contains("not-here:404")),
        "{error:?}"
    );
    assert!(engine.containers("prov.").is_empty());
    let mut table = labels(&engine);
    table.insert("container.cpus".into(), "0".into());
    let error = plugin
        .create_node(&k, &spec(&k, table, ""))
        .await
        .expect_err("bad table");
    assert!(
        matches!(&error, PluginError::Definite(m) if m.contains("cpus")),
        "{error:?}"
    );
}
