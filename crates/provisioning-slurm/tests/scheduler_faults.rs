//! Scheduler faults as real events on the testbed: a `slurmd` SIGKILLed
//! (its node goes down and its job fails) and `slurmctld` stopped and
//! started again.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{key, plugin, spec, wait_until, wait_until_within};
use provisioning::observe::LossCause;
use provisioning::{EndpointLookup, Observation, RunId};
use provisioning_provider::{ObservationSink, PluginError, ProvisionPlugin};
use provisioning_slurm::testbed::Testbed;

type Facts = Arc<Mutex<Vec<Observation>>>;

fn attach(plugin: &dyn ProvisionPlugin) -> Facts {
    let facts = Facts::default();
    let record = facts.clone();
    plugin.attach(ObservationSink::new(move |o| {
        record.lock().expect("facts").push(o)
    }));
    facts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_slurmd_is_killed_is_lost() {
    let mut bed = Testbed::start(2);
    let (plugin, _) = plugin(&bed, "node-down").await;
    let facts = attach(&*plugin);
    let k = key("node-down", "w-0", 1);
    let lease = plugin
        .create_node(&k, &spec(&k, BTreeMap::new(), ""))
        .await
        .expect("create");
    let mut host = String::new();
    wait_until("the job to run", || {
        let jobs = bed.live_jobs("prov+node-down+");
        match jobs.first() {
            Some((_, _, state, nodes)) if state == "RUNNING" => {
                host = nodes.clone();
                true
            }
            _ => false,
        }
    })
    .await;
    assert!(matches!(
        plugin.lookup_endpoint(&k, &lease.lease).await,
        Ok(EndpointLookup::Ready(_))
    ));
    let index: usize = host
        .strip_prefix('n')
        .and_then(|i| i.parse().ok())
        .unwrap_or_else(|| panic!("node name {host:?}"));
    bed.kill_slurmd(index);
    // The controller declares the node down after SlurmdTimeout (10 s on
    // the testbed) and fails its job; the plugin's watch sees the job end.
    let lost = Observation::NodeLost {
        node: k.node.clone(),
        attempt: k.attempt,
        cause: LossCause::LeaseGone,
    };
    wait_until("the loss of the node whose slurmd died", || {
        facts.lock().expect("facts").contains(&lost)
    })
    .await;
    let states = job_states(&bed, "prov+node-down+");
    assert_eq!(states, ["NODE_FAIL"], "{:?}", bed.jobs());
    assert!(
        plugin
            .list_nodes(&RunId::new("node-down"))
            .await
            .expect("list")
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_controller_makes_calls_definite_and_its_restart_keeps_the_nodes() {
    let mut bed = Testbed::start(2);
    let (plugin, _) = plugin(&bed, "restart").await;
    let facts = attach(&*plugin);
    let first = key("restart", "w-0", 1);
    let lease = plugin
        .create_node(&first, &spec(&first, BTreeMap::new(), ""))
        .await
        .expect("create");
    bed.stop_controller();
    let second = key("restart", "w-1", 2);
    match plugin
        .create_node(&second, &spec(&second, BTreeMap::new(), ""))
        .await
    {
        Err(PluginError::Definite(message)) => {
            assert!(message.contains("connect failure"), "{message}");
        }
        other => panic!("a create with the controller down: {other:?}"),
    }
    assert!(matches!(
        plugin.list_nodes(&RunId::new("restart")).await,
        Err(PluginError::Definite(_))
    ));
    bed.restart_controller();
    let listed = plugin
        .list_nodes(&RunId::new("restart"))
        .await
        .expect("list after the restart");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].key, first);
    assert_eq!(listed[0].lease, lease.lease);
    // The watch kept quiet while it could not ask: no node was lost.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !facts
            .lock()
            .expect("facts")
            .iter()
            .any(|o| matches!(o, Observation::NodeLost { .. })),
        "{:?}",
        facts.lock().expect("facts")
    );
    plugin
        .destroy_node(&first, &lease.lease)
        .await
        .expect("destroy");
    assert!(bed.live_jobs("prov+restart+").is_empty());
}

/// Slurm's smallest time limit is one minute, and the controller looks for
/// jobs past it every 30 s.
const TIME_LIMIT_WAIT: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_hits_its_time_limit_is_lost() {
    let bed = Testbed::start(1);
    let (plugin, _) = plugin(&bed, "time-limit").await;
    let facts = attach(&*plugin);
    let k = key("time-limit", "w-0", 1);
    let labels = BTreeMap::from([("slurm.time_limit".to_owned(), "1".to_owned())]);
    plugin
        .create_node(&k, &spec(&k, labels, ""))
        .await
        .expect("create");
    let lost = Observation::NodeLost {
        node: k.node.clone(),
        attempt: k.attempt,
        cause: LossCause::LeaseGone,
    };
    wait_until_within(
        "the loss of the job past its time limit",
        TIME_LIMIT_WAIT,
        || facts.lock().expect("facts").contains(&lost),
    )
    .await;
    // The loss can be seen while the job is still COMPLETING (its steps
    // being torn down); the final state is what is checked.
    wait_until_within("the job to leave COMPLETING", TIME_LIMIT_WAIT, || {
        !job_states(&bed, "prov+time-limit+")
            .iter()
            .any(|state| state == "COMPLETING")
    })
    .await;
    let states = job_states(&bed, "prov+time-limit+");
    assert_eq!(states, ["TIMEOUT"], "{:?}", bed.jobs());
}

/// The states of the jobs whose names start with `prefix`.
fn job_states(bed: &Testbed, prefix: &str) -> Vec<String> {
    bed.jobs()
        .into_iter()
        .filter(|(_, name, ..)| name.starts_with(prefix))
        .map(|(_, _, state, _)| state)
        .collect()
}
