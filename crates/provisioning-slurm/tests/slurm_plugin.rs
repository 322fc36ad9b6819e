//! The slurm plugin against a real Slurm cluster on this machine (see
//! `provisioning_slurm::testbed`), every fact checked in `squeue` as well.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::{key, plugin, spec, wait_until};
use provisioning::observe::{BootstrapEvent, LossCause};
use provisioning::{EndpointLookup, Observation, RunId};
use provisioning_provider::{BootstrapRequest, ObservationSink, PluginError, ProvisionPlugin};
use provisioning_slurm::parse::job_name;
use provisioning_slurm::testbed::Testbed;
use provisioning_slurm::{SlurmPlugin, Tool};

type Facts = Arc<Mutex<Vec<Observation>>>;

fn attach(plugin: &SlurmPlugin) -> Facts {
    let facts = Facts::default();
    let record = facts.clone();
    plugin.attach(ObservationSink::new(move |o| {
        record.lock().expect("facts").push(o)
    }));
    facts
}

async fn endpoint(
    plugin: &SlurmPlugin,
    key: &provisioning_provider::AttemptKey,
    lease: &provisioning::LeaseHandle,
) -> provisioning::Endpoint {
    let deadline = tokio::time::Instant::now() + common::WAIT;
    while tokio::time::Instant::now() < deadline {
        match plugin.lookup_endpoint(key, lease).await.expect("lookup") {
            EndpointLookup::Ready(endpoint) => return endpoint,
            EndpointLookup::NotReady => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
        }
    }
    panic!("the job of {key} never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_adopts_lists_and_destroys_a_job_named_by_its_attempt() {
    let bed = Testbed::start(2);
    let (plugin, _) = plugin(&bed, "plugin-test").await;
    let k = key("plugin-test", "workers-0", 3);
    let name = job_name(&k).expect("name");
    let labels = BTreeMap::from([
        ("slurm.partition".to_owned(), "debug".to_owned()),
        ("slurm.memory".to_owned(), "100M".to_owned()),
        ("slurm.time_limit".to_owned(), "10".to_owned()),
    ]);
    let s = spec(&k, labels, "");
    let first = plugin.create_node(&k, &s).await.expect("create");
    assert!(!first.adopted);
    let live = bed.live_jobs("prov+plugin-test+");
    assert_eq!(live.len(), 1, "{live:?}");
    assert_eq!(live[0].1, name);
    assert_eq!(first.lease.0, format!("slurm:{}", live[0].0));

    // The group's table reached sbatch.
    let shown = bed
        .client("squeue")
        .args(["-h", "-j", &live[0].0.to_string(), "-o", "%P|%m|%l"])
        .output()
        .expect("squeue");
    assert_eq!(
        String::from_utf8_lossy(&shown.stdout).trim(),
        "debug|100M|10:00"
    );

    let again = plugin.create_node(&k, &s).await.expect("second create");
    assert!(again.adopted);
    assert_eq!(again.lease, first.lease);
    assert_eq!(bed.live_jobs("prov+plugin-test+").len(), 1);

    let listed = plugin
        .list_nodes(&RunId::new("plugin-test"))
        .await
        .expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].key, k);
    assert_eq!(listed[0].lease, first.lease);
    assert!(
        plugin
            .list_nodes(&RunId::new("plugin-test-other"))
            .await
            .expect("list")
            .is_empty()
    );

    let at = endpoint(&plugin, &k, &first.lease).await;
    assert!(at.0.starts_with("slurm://n"), "{at:?}");

    plugin
        .destroy_node(&k, &first.lease)
        .await
        .expect("destroy");
    assert!(
        bed.live_jobs("prov+plugin-test+").is_empty(),
        "{:?}",
        bed.jobs()
    );
    plugin
        .destroy_node(&k, &first.lease)
        .await
        .expect("destroying an absent job succeeds");
    assert!(matches!(
        plugin.lookup_endpoint(&k, &first.lease).await,
        Err(PluginError::NotFound(_))
    ));
    assert!(
        plugin
            .list_nodes(&RunId::new("plugin-test"))
            .await
            .expect("list")
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_no_node_can_satisfy_is_a_definite_failure_that_leaves_nothing() {
    let bed = Testbed::start(1);
    let (plugin, _) = plugin(&bed, "unsatisfiable").await;
    for (label, value) in [
        ("slurm.cpus", "4"),
        ("slurm.memory", "5000M"),
        ("slurm.partition", "nope"),
    ] {
        let k = key("unsatisfiable", "big-0", 1);
        let s = spec(
            &k,
            BTreeMap::from([(label.to_owned(), value.to_owned())]),
            "",
        );
        match plugin.create_node(&k, &s).await {
            Err(PluginError::Definite(message)) => {
                assert!(
                    message.contains("submission failed")
                        || message.contains("no node can satisfy"),
                    "{message}"
                );
            }
            other => panic!("{label}={value}: expected a definite failure, got {other:?}"),
        }
        assert!(
            bed.live_jobs("prov+unsatisfiable+").is_empty(),
            "{:?}",
            bed.jobs()
        );
        assert!(
            plugin
                .list_nodes(&RunId::new("unsatisfiable"))
                .await
                .expect("list")
                .is_empty()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_controller_is_definite_and_a_lost_reply_is_ambiguous_then_adopted() {
    let bed = Testbed::start(1);
    let (plugin, cli) = plugin(&bed, "faults").await;
    let k = key("faults", "w-0", 1);
    let s = spec(&k, BTreeMap::new(), "");
    cli.arm(Tool::Squeue, common::Fault::Unreachable);
    match plugin.create_node(&k, &s).await {
        Err(PluginError::Definite(message)) => {
            assert!(message.contains("connect failure"), "{message}")
        }
        other => panic!("expected definite, got {other:?}"),
    }
    assert!(bed.live_jobs("prov+faults+").is_empty());
    cli.arm(Tool::Sbatch, common::Fault::ReplyLost);
    assert!(matches!(
        plugin.create_node(&k, &s).await,
        Err(PluginError::Ambiguous(_))
    ));
    assert_eq!(
        bed.live_jobs("prov+faults+").len(),
        1,
        "the lost submission happened"
    );
    let retry = plugin.create_node(&k, &s).await.expect("retry");
    assert!(retry.adopted);
    assert_eq!(bed.live_jobs("prov+faults+").len(), 1);
    plugin
        .destroy_node(&k, &retry.lease)
        .await
        .expect("destroy");
    assert!(bed.live_jobs("prov+faults+").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cancelled_by_hand_is_a_lost_node() {
    let bed = Testbed::start(1);
    let (plugin, _) = plugin(&bed, "by-hand").await;
    let facts = attach(&plugin);
    let k = key("by-hand", "w-0", 2);
    let lease = plugin
        .create_node(&k, &spec(&k, BTreeMap::new(), ""))
        .await
        .expect("create");
    endpoint(&plugin, &k, &lease.lease).await;
    let job = bed.live_jobs("prov+by-hand+")[0].0;
    bed.cancel_by_hand(job);
    let lost = Observation::NodeLost {
        node: k.node.clone(),
        attempt: k.attempt,
        cause: LossCause::LeaseGone,
    };
    wait_until("the loss of the cancelled job", || {
        facts.lock().expect("facts").contains(&lost)
    })
    .await;
    assert_eq!(
        facts
            .lock()
            .expect("facts")
            .iter()
            .filter(|o| **o == lost)
            .count(),
        1,
        "one loss, reported once"
    );
    assert!(
        plugin
            .list_nodes(&RunId::new("by-hand"))
            .await
            .expect("list")
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_runs_as_a_job_step_joins_the_swarm_and_cancel_stops_it() {
    let bed = Testbed::start(1);
    let (plugin, _) = plugin(&bed, "agent-step").await;
    let facts = attach(&plugin);
    let k = key("agent-step", "w-0", 1);
    let s = spec(&k, BTreeMap::new(), "sleep 300");
    let lease = plugin.create_node(&k, &s).await.expect("create");
    let at = endpoint(&plugin, &k, &lease.lease).await;
    let request = BootstrapRequest {
        spec: s.clone(),
        lease: lease.lease.clone(),
        endpoint: at,
    };
    let session = plugin.start_bootstrap(&k, &request).await.expect("start");
    assert!(!session.adopted);
    let joined = Observation::Bootstrap {
        node: k.node.clone(),
        attempt: k.attempt,
        event: BootstrapEvent::Joined,
    };
    wait_until("the agent's join", || {
        facts.lock().expect("facts").contains(&joined)
    })
    .await;
    // The workload keeps running after the join: no loss comes.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let early_loss = facts
        .lock()
        .expect("facts")
        .iter()
        .any(|o| matches!(o, Observation::NodeLost { .. }));
    assert!(!early_loss, "{:?}", facts.lock().expect("facts"));
    let job = bed.live_jobs("prov+agent-step+")[0].0;
    let steps = bed
        .client("squeue")
        .args(["-s", "-h", "-j", &job.to_string(), "-o", "%i|%j"])
        .output()
        .expect("squeue");
    let steps = String::from_utf8_lossy(&steps.stdout).into_owned();
    assert!(steps.contains("|provision-agent"), "{steps}");
    // Stages came in order, the join last.
    let events: Vec<BootstrapEvent> = facts
        .lock()
        .expect("facts")
        .iter()
        .filter_map(|o| match o {
            Observation::Bootstrap { event, .. } => Some(event.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(events.last(), Some(&BootstrapEvent::Joined), "{events:?}");
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, BootstrapEvent::Failed { .. })),
        "{events:?}"
    );

    let again = plugin
        .start_bootstrap(&k, &request)
        .await
        .expect("second start");
    assert!(again.adopted);
    assert_eq!(again.session, session.session);
    plugin
        .complete_bootstrap(&k, Some(&session.session))
        .await
        .expect("complete");
    plugin
        .cancel_bootstrap(&k, Some(&session.session))
        .await
        .expect("cancel");
    let steps = bed
        .client("squeue")
        .args(["-s", "-h", "-j", &job.to_string(), "-o", "%i|%j"])
        .output()
        .expect("squeue");
    assert!(!String::from_utf8_lossy(&steps.stdout).contains("provision-agent"));
    plugin
        .destroy_node(&k, &lease.lease)
        .await
        .expect("destroy");
    assert!(bed.live_jobs("prov+agent-step+").is_empty());
}
