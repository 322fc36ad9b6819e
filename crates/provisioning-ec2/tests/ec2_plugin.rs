//! The ec2 plugin and its client against the EC2 testbed: what the server
//! really answers, and what the plugin makes of it.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{Mode, Testbed};
use provisioning::{EndpointLookup, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId, RunId};
use provisioning_ec2::{
    Ec2ErrorKind, Ec2Plugin, Filter, LossReason, ReasonClass, RunRequest, client_token,
};
use provisioning_provider::{AttemptKey, ObservationSink, PluginError, ProvisionPlugin};

fn key(run: &str, index: u32, attempt: u64) -> AttemptKey {
    AttemptKey {
        run_id: RunId::new(run),
        node: LogicalNodeId::new(GroupId::new("workers"), index),
        attempt: NodeAttemptId::from_raw(attempt),
    }
}

fn spec(key: &AttemptKey) -> LogicalNodeSpec {
    LogicalNodeSpec::new(
        key.node.clone(),
        key.run_id.clone(),
        Arc::new(common::template()),
    )
}

fn plugin(bed: &Testbed, run: &str) -> Arc<Ec2Plugin> {
    let plugin = Arc::new(Ec2Plugin::new(bed.plugin_config(run)));
    plugin.attach(ObservationSink::new(|_| {}));
    plugin
}

fn instances_of(bed: &Testbed, key: &AttemptKey) -> usize {
    bed.live_instances(key.run_id.as_str())
        .iter()
        .filter(|i| {
            i["tags"]["provision:node"] == key.node.to_string()
                && i["tags"]["provision:attempt"] == key.attempt.to_string()
        })
        .count()
}

fn request(token: &str, instance_type: &str) -> RunRequest {
    RunRequest {
        client_token: token.to_owned(),
        image_id: common::IMAGE.to_owned(),
        instance_type: instance_type.to_owned(),
        tags: BTreeMap::from([("provision:run".to_owned(), "raw".to_owned())]),
        ..RunRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn against_plain_moto_which_ignores_tokens_a_repeated_create_adopts_instead_of_doubling() {
    let bed = Testbed::start(Mode::Plain, 0);
    let plugin = plugin(&bed, "plain");
    // The server really ignores tokens: the same token twice makes two.
    let client = plugin.client();
    let first = client
        .run_instance(&request("same", "t3.micro"))
        .await
        .unwrap();
    let second = client
        .run_instance(&request("same", "t3.micro"))
        .await
        .unwrap();
    assert_ne!(first.id, second.id, "plain moto ignores ClientToken");
    // The plugin looks by tag first, so its second create adopts.
    let key = key("plain", 0, 1);
    let created = plugin.create_node(&key, &spec(&key)).await.unwrap();
    assert!(!created.adopted);
    for _ in 0..3 {
        let again = plugin.create_node(&key, &spec(&key)).await.unwrap();
        assert!(again.adopted);
        assert_eq!(again.lease, created.lease);
    }
    assert_eq!(instances_of(&bed, &key), 1, "{:?}", bed.instances());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_testbed_honours_tokens_and_refuses_a_mismatched_repeat() {
    let bed = Testbed::start(Mode::Full, 0);
    let plugin = plugin(&bed, "tokens");
    let client = plugin.client();
    let first = client
        .run_instance(&request("tok", "t3.micro"))
        .await
        .unwrap();
    let again = client
        .run_instance(&request("tok", "t3.micro"))
        .await
        .unwrap();
    assert_eq!(first.id, again.id);
    let error = client
        .run_instance(&request("tok", "t3.large"))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Some("IdempotentParameterMismatch"), "{error}");
    assert_eq!(error.reason_class(), Some(ReasonClass::Request));
    // The token of an attempt is stable, short and its own.
    let key = key("tokens", 0, 1);
    assert_eq!(client_token(&key), client_token(&key.clone()));
    assert!(client_token(&key).len() <= 64);
    assert_ne!(client_token(&key), client_token(&self::key("tokens", 0, 2)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_definite_with_their_class_and_the_rest_is_ambiguous() {
    let bed = Testbed::start(Mode::Full, 0);
    let plugin = plugin(&bed, "faults");
    let cases = [
        ("capacity", "[capacity]", false),
        ("quota", "[quota]", false),
        ("instance-limit", "[quota]", false),
        ("throttle", "[throttled]", true),
        ("server-error", "InternalError", true),
    ];
    for (index, (kind, prefix, ambiguous)) in cases.into_iter().enumerate() {
        let key = key("faults", index as u32, 1);
        bed.fault("RunInstances", kind, 1);
        let error = plugin.create_node(&key, &spec(&key)).await.unwrap_err();
        assert_eq!(
            matches!(error, PluginError::Ambiguous(_)),
            ambiguous,
            "{kind}: {error}"
        );
        assert!(error.to_string().contains(prefix), "{kind}: {error}");
        assert_eq!(instances_of(&bed, &key), 0, "{kind} created nothing");
        // The re-issue (as the reconciler makes it) creates exactly one.
        plugin.create_node(&key, &spec(&key)).await.unwrap();
        assert_eq!(instances_of(&bed, &key), 1, "{kind}");
    }
    // A reply lost after the instance was made: ambiguous; the retry adopts.
    let key = key("faults", 9, 1);
    bed.fault("RunInstances", "drop", 1);
    let error = plugin.create_node(&key, &spec(&key)).await.unwrap_err();
    assert!(matches!(error, PluginError::Ambiguous(_)), "{error}");
    assert_eq!(instances_of(&bed, &key), 1);
    assert!(plugin.create_node(&key, &spec(&key)).await.unwrap().adopted);
    assert_eq!(instances_of(&bed, &key), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_a_reply_in_time_is_a_timeout_the_caller_sees() {
    let bed = Testbed::start(Mode::Full, 0);
    let mut config = bed.plugin_config("slow");
    config.request_timeout = Duration::from_millis(500);
    let plugin = Ec2Plugin::new(config);
    let started = std::time::Instant::now();
    bed.delay("DescribeInstances", 1500);
    let error = plugin
        .client()
        .describe_instances(&[Filter::new("tag:provision:run", &["slow"])], &[])
        .await
        .unwrap_err();
    assert_eq!(error.kind, Ec2ErrorKind::Timeout, "{error}");
    assert!(error.may_have_acted());
    assert!(
        started.elapsed() < Duration::from_millis(1400),
        "no hidden retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_instance_is_not_ready_and_a_running_one_has_its_private_address() {
    let bed = Testbed::start(Mode::Full, 1500);
    let plugin = plugin(&bed, "pending");
    let key = key("pending", 0, 1);
    let lease = plugin.create_node(&key, &spec(&key)).await.unwrap().lease;
    assert_eq!(
        plugin.lookup_endpoint(&key, &lease).await.unwrap(),
        EndpointLookup::NotReady
    );
    tokio::time::sleep(Duration::from_millis(1700)).await;
    match plugin.lookup_endpoint(&key, &lease).await.unwrap() {
        EndpointLookup::Ready(endpoint) => {
            assert!(endpoint.0.starts_with("ec2://i-"), "{endpoint:?}");
        }
        other => panic!("not ready after pending: {other:?}"),
    }
    plugin.destroy_node(&key, &lease).await.unwrap();
    // Destroying again, and looking it up, find it gone.
    plugin.destroy_node(&key, &lease).await.unwrap();
    assert!(matches!(
        plugin.lookup_endpoint(&key, &lease).await,
        Err(PluginError::NotFound(_))
    ));
    assert_eq!(instances_of(&bed, &key), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_interruption_is_a_preemption_and_a_foreign_termination_is_named_as_such() {
    let bed = Testbed::start(Mode::Full, 0);
    let plugin = plugin(&bed, "losses");
    let spot = key("losses", 0, 1);
    let other = key("losses", 1, 1);
    plugin.create_node(&spot, &spec(&spot)).await.unwrap();
    plugin.create_node(&other, &spec(&other)).await.unwrap();
    assert_eq!(plugin.check_losses().await.unwrap(), 0);
    let id_of = |key: &AttemptKey| {
        bed.live_instances("losses")
            .into_iter()
            .find(|i| i["tags"]["provision:node"] == key.node.to_string())
            .map(|i| i["id"].as_str().unwrap().to_owned())
            .expect("the instance")
    };
    let (spot_id, other_id) = (id_of(&spot), id_of(&other));
    bed.interrupt(&spot_id);
    bed.terminate_outside(&other_id);
    assert_eq!(plugin.check_losses().await.unwrap(), 2);
    assert_eq!(plugin.loss_reason(&spot), Some(LossReason::Preempted));
    assert_eq!(
        plugin.loss_reason(&other),
        Some(LossReason::TerminatedOutside)
    );
    assert_eq!(plugin.check_losses().await.unwrap(), 0, "each loss once");
    assert_eq!(LossReason::Preempted.to_string(), "preempted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_nodes_reads_the_attempt_from_the_tags_of_live_instances_only() {
    let bed = Testbed::start(Mode::Full, 0);
    let plugin = plugin(&bed, "list");
    let a = key("list", 0, 1);
    let b = key("list", 1, 3);
    let lease_a = plugin.create_node(&a, &spec(&a)).await.unwrap().lease;
    plugin.create_node(&b, &spec(&b)).await.unwrap();
    // An instance of another run is not listed.
    let foreign = key("other-run", 0, 1);
    plugin.create_node(&foreign, &spec(&foreign)).await.unwrap();
    let listed = plugin.list_nodes(&RunId::new("list")).await.unwrap();
    let keys: Vec<_> = listed.iter().map(|n| n.key.clone()).collect();
    assert_eq!(keys, [a.clone(), b.clone()]);
    plugin.destroy_node(&a, &lease_a).await.unwrap();
    let listed = plugin.list_nodes(&RunId::new("list")).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, b);
    let calls = bed.calls();
    assert!(calls["DescribeInstances"].as_u64().unwrap() >= 2);
}
