//! The conformance kit's seam contract suite against the ec2 plugin over
//! the EC2 testbed (moto behind `scripts/ec2-testbed/server.py`), with every
//! fault a real reply of the server:
//!
//! | Armed fault | Method | What the server really does |
//! |---|---|---|
//! | `definite` | `create_node` | `RunInstances` answers `InsufficientInstanceCapacity` (the look by tag still happens first) |
//! | `ambiguous-done` | `create_node` | `RunInstances` makes the instance, then the connection closes without a reply |
//! | `definite` | `destroy_node` | `TerminateInstances` answers `UnauthorizedOperation` |
//! | `ambiguous-done` | `destroy_node` | `TerminateInstances` terminates, then the connection closes without a reply |
//! | loss | — | the instance gets a spot interruption; the plugin's loss watch finds it ended |
//!
//! Every instance boots its user-data on the testbed, which starts the real
//! node agent; it joins the plugin's own swarm listener over TCP.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Mode, Testbed};
use provisioning::spawn::BoxFuture;
use provisioning_conformance::contract::{
    ContractFaults, ContractSubject, PluginMethod, run_contract_suite,
};
use provisioning_conformance::trace::Fault;
use provisioning_ec2::{Ec2Plugin, LossReason, WatchHandle};
use provisioning_provider::AttemptKey;

const RUN: &str = "contract-test";

/// How often the plugin's loss watch lists the run's instances.
const WATCH_INTERVAL: Duration = Duration::from_millis(200);

struct Ec2Faults {
    bed: Arc<Testbed>,
    plugin: Arc<Ec2Plugin>,
    _watch: WatchHandle,
}

impl ContractFaults for Ec2Faults {
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        let action = match method {
            PluginMethod::CreateNode => "RunInstances",
            PluginMethod::DestroyNode => "TerminateInstances",
            _ => return false,
        };
        let kind = match (method, fault) {
            (PluginMethod::CreateNode, Fault::Definite) => "capacity",
            (PluginMethod::DestroyNode, Fault::Definite) => "unauthorized",
            (_, Fault::AmbiguousDone) => "drop",
            _ => return false,
        };
        self.bed.fault(action, kind, 1);
        true
    }

    fn lose_node<'a>(&'a self, key: &'a AttemptKey) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let found = self
                .bed
                .live_instances(key.run_id.as_str())
                .into_iter()
                .find(|i| {
                    i["tags"]["provision:node"] == key.node.to_string()
                        && i["tags"]["provision:attempt"] == key.attempt.to_string()
                });
            let Some(instance) = found else {
                return false;
            };
            self.bed.interrupt(instance["id"].as_str().expect("an id"));
            let plugin = self.plugin.clone();
            let key = key.clone();
            // The reason is checked once the watch has seen the loss.
            tokio::spawn(async move {
                for _ in 0..100 {
                    if let Some(reason) = plugin.loss_reason(&key) {
                        assert_eq!(reason, LossReason::Preempted);
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
            true
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ec2_plugin_keeps_the_seam_contract_against_the_testbed() {
    let bed = Arc::new(Testbed::start(Mode::Full, 300));
    let report = run_contract_suite(|| {
        let bed = bed.clone();
        async move {
            // A fault armed for a step the plugin never reached (it adopted)
            // stays armed on the server: each subject starts without.
            bed.clear_faults();
            let plugin = bed.agent_plugin(RUN).await;
            let watch = plugin.start_watch(WATCH_INTERVAL);
            let faults = Arc::new(Ec2Faults {
                bed: bed.clone(),
                plugin: plugin.clone(),
                _watch: watch,
            });
            Ok::<_, String>(
                ContractSubject::new(plugin, provisioning::RunId::new(RUN))
                    .with_faults(faults)
                    .with_template(common::template())
                    .with_pause(Arc::new(|d| Box::pin(tokio::time::sleep(d)))),
            )
        }
    })
    .await;
    println!("{report}");
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "every contract is exercised against the testbed:\n{report}"
    );
    // Counted from the server's own list, not from the plugin.
    let live = bed.live_instances(RUN);
    assert!(live.is_empty(), "instances left behind: {live:?}");
}
