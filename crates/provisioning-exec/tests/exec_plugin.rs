//! `ExecPlugin` against the reference double (`tests/doubles/memory_provider.py`)
//! and its deliberate defects.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use provisioning::{
    BootstrapEvent, EndpointLookup, GroupId, LogicalNodeId, LogicalNodeSpec, NodeAttemptId,
    NodeTemplate, Observation, RunId,
};
use provisioning_conformance::contract::{Contract, ContractVerdict};
use provisioning_exec::conformance::run_contract_suite_against;
use provisioning_exec::{ExecConfig, ExecPlugin};
use provisioning_provider::{
    AttemptKey, BootstrapRequest, ObservationSink, PluginError, ProvisionPlugin,
};

const DOUBLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/doubles/memory_provider.py"
);

/// A bound on a whole suite, so that a regression fails instead of hanging.
const SUITE_WAIT_MAX: Duration = Duration::from_secs(300);

fn double(defect: Option<&str>) -> ExecConfig {
    let mut args = vec![DOUBLE.to_owned()];
    if let Some(defect) = defect {
        args.push("--defect".to_owned());
        args.push(defect.to_owned());
    }
    ExecConfig::new("python3", args)
}

fn key(index: u32, attempt: u64) -> AttemptKey {
    AttemptKey {
        run_id: RunId::new("exec-test"),
        node: LogicalNodeId::new(GroupId::new("web"), index),
        attempt: NodeAttemptId::from_raw(attempt),
    }
}

fn spec(key: &AttemptKey) -> LogicalNodeSpec {
    LogicalNodeSpec::new(
        key.node.clone(),
        key.run_id.clone(),
        Arc::new(NodeTemplate {
            role: "web".to_owned(),
            provider: "exec".to_owned(),
            shape: Default::default(),
            boot: Default::default(),
            swarm_join: Default::default(),
        }),
    )
}

fn recording_sink() -> (ObservationSink, Arc<Mutex<Vec<Observation>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let sink = ObservationSink::new(move |o| record.lock().unwrap().push(o));
    (sink, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_double_keeps_the_whole_seam_contract_through_exec_plugin() {
    let report = tokio::time::timeout(SUITE_WAIT_MAX, run_contract_suite_against(&double(None)))
        .await
        .expect("the suite ends");
    eprintln!("{report}");
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "the double implements every test hook, so nothing may be skipped:\n{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_that_creates_anew_instead_of_adopting_fails_create_twice_adopts() {
    let report = tokio::time::timeout(
        SUITE_WAIT_MAX,
        run_contract_suite_against(&double(Some("create-anew"))),
    )
    .await
    .expect("the suite ends");
    eprintln!("{report}");
    assert!(!report.is_success(), "{report}");
    assert!(
        matches!(
            report.verdict(Contract::CreateTwiceAdopts),
            Some(ContractVerdict::Failed(_))
        ),
        "{report}"
    );
}

#[tokio::test]
async fn a_reply_that_does_not_come_in_time_is_ambiguous() {
    let plugin = ExecPlugin::new(
        double(Some("silent-create")).with_call_timeout(Duration::from_millis(300)),
    );
    let key = key(0, 1);
    let outcome = plugin.create_node(&key, &spec(&key)).await;
    assert!(
        matches!(outcome, Err(PluginError::Ambiguous(_))),
        "{outcome:?}"
    );
    // The program still answers other calls.
    assert_eq!(plugin.list_nodes(&key.run_id).await, Ok(Vec::new()));
}

#[tokio::test]
async fn a_program_that_dies_makes_its_call_ambiguous_and_is_restarted() {
    let plugin = ExecPlugin::start(double(Some("die-on-create")))
        .await
        .expect("the double starts");
    let key = key(0, 1);
    let outcome = plugin.create_node(&key, &spec(&key)).await;
    assert!(
        matches!(outcome, Err(PluginError::Ambiguous(_))),
        "{outcome:?}"
    );
    // The next call reaches a restarted program.
    assert_eq!(plugin.list_nodes(&key.run_id).await, Ok(Vec::new()));
    assert_eq!(plugin.start_count(), 2);
}

#[tokio::test]
async fn a_result_of_the_wrong_shape_is_a_definite_error_of_its_call() {
    let plugin = ExecPlugin::new(double(Some("garbage-create")));
    let key = key(0, 1);
    let outcome = plugin.create_node(&key, &spec(&key)).await;
    assert!(
        matches!(outcome, Err(PluginError::Definite(_))),
        "{outcome:?}"
    );
    assert_eq!(plugin.start_count(), 1, "the program keeps running");
}

#[tokio::test]
async fn junk_lines_and_stderr_chatter_are_ignored_and_replies_still_match() {
    let plugin = ExecPlugin::new(double(Some("noisy")));
    let key = key(3, 2);
    let lease = plugin
        .create_node(&key, &spec(&key))
        .await
        .expect("the create is answered");
    assert!(!lease.adopted);
    let listed = plugin.list_nodes(&key.run_id).await.expect("listed");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, key);
    assert_eq!(listed[0].lease, lease.lease);
}

#[tokio::test]
async fn bootstrap_observations_reach_the_attached_sink_under_their_attempt() {
    let plugin = ExecPlugin::new(double(None));
    let (sink, seen) = recording_sink();
    plugin.attach(sink);
    let key = key(1, 4);
    let lease = plugin
        .create_node(&key, &spec(&key))
        .await
        .expect("created");
    let EndpointLookup::Ready(endpoint) = plugin
        .lookup_endpoint(&key, &lease.lease)
        .await
        .expect("looked up")
    else {
        panic!("the double's nodes are reachable at once");
    };
    let request = BootstrapRequest {
        spec: spec(&key),
        lease: lease.lease.clone(),
        endpoint,
    };
    let session = plugin
        .start_bootstrap(&key, &request)
        .await
        .expect("started");
    plugin
        .complete_bootstrap(&key, Some(&session.session))
        .await
        .expect("completed");
    // The double writes its observations before its reply, on one stream.
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty());
    assert!(
        seen.iter()
            .all(|o| *o.node() == key.node && o.attempt() == key.attempt),
        "{seen:?}"
    );
    assert!(
        matches!(
            seen.last(),
            Some(Observation::Bootstrap {
                event: BootstrapEvent::Closed,
                ..
            })
        ),
        "{seen:?}"
    );
}

#[tokio::test]
async fn a_program_that_cannot_be_started_fails_calls_definitely() {
    let plugin = ExecPlugin::new(ExecConfig::new(
        "/nonexistent/provisioning-provider",
        Vec::<String>::new(),
    ));
    let outcome = plugin.list_nodes(&RunId::new("r")).await;
    assert!(
        matches!(outcome, Err(PluginError::Definite(_))),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_program_that_fails_its_handshake_is_refused_and_calls_fail_definitely() {
    let wrong = ExecConfig::new(
        "python3",
        [
            "-c",
            "import sys; sys.stdin.readline(); print('{\"id\":0,\"result\":{\"protocol\":\"other\",\"version\":1,\"program\":\"p\",\"kind\":\"k\"}}', flush=True); sys.stdin.read()",
        ],
    );
    let started = ExecPlugin::start(wrong.clone()).await;
    assert!(started.is_err(), "{started:?}");
    let plugin = ExecPlugin::new(ExecConfig::new("true", Vec::<String>::new()));
    let outcome = plugin.list_nodes(&RunId::new("r")).await;
    assert!(
        matches!(outcome, Err(PluginError::Definite(_))),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn after_a_failed_start_calls_fail_definitely_at_once_until_the_backoff_is_due() {
    let mut config = ExecConfig::new("true", Vec::<String>::new());
    config.restart_backoff_min = Duration::from_secs(3600);
    config.restart_backoff_max = Duration::from_secs(3600);
    let plugin = ExecPlugin::new(config);
    for _ in 0..3 {
        let outcome = plugin.list_nodes(&RunId::new("r")).await;
        assert!(
            matches!(outcome, Err(PluginError::Definite(_))),
            "{outcome:?}"
        );
    }
    assert_eq!(plugin.start_count(), 1, "one start, then the backoff");
}
