//! `provider = "exec"` end to end: the real host (driver, executor, adapter)
//! brings a cluster up through `ExecPlugin` and the reference double, and
//! tears it down.

use std::sync::Arc;
use std::time::Duration;

use provisioning::{
    BootParams, ClusterShape, DesiredUpdate, Generation, GroupId, NodeGroup, NodeTemplate,
    ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_exec::{ExecConfig, ExecPlugin};
use provisioning_provider::ProvisionPlugin;
use provisioning_runtime::{Host, HostConfig, PluginEntry, ShutdownOutcome};

const DOUBLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/doubles/memory_provider.py"
);
const RUN: &str = "exec-host";

/// A bound that only a hang reaches.
const WAIT_BOUND: Duration = Duration::from_secs(300);
const POLL_INTERVAL: Duration = Duration::from_millis(20);

fn shape(count: u32) -> ClusterShape {
    ClusterShape {
        run_id: RunId::new(RUN),
        generation: Generation::new(1),
        groups: vec![NodeGroup {
            id: GroupId::new("web"),
            run_id: RunId::new(RUN),
            count,
            template: NodeTemplate {
                role: "web".into(),
                provider: "exec".into(),
                shape: ProviderShape::default(),
                boot: BootParams::default(),
                swarm_join: SwarmJoinTemplate::default(),
            },
        }],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_converges_and_tears_down_a_cluster_served_by_a_provider_program() {
    let plugin = Arc::new(ExecPlugin::new(ExecConfig::new("python3", [DOUBLE])));
    let host = Host::start(
        HostConfig::new(RunId::new(RUN)),
        vec![PluginEntry::new(plugin.clone())],
    )
    .expect("the host starts");
    let handle = host.handle();
    assert_eq!(
        handle.apply(shape(3)).await.expect("applied"),
        DesiredUpdate::Accepted
    );
    let converged = tokio::time::timeout(WAIT_BOUND, async {
        loop {
            let status = handle.status().await;
            if status.converged && status.generation == 1 {
                return status;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    })
    .await
    .expect("the cluster converges");
    assert!(converged.nodes.iter().all(|n| n.ready), "{converged:#?}");
    let listed = plugin
        .list_nodes(&RunId::new(RUN))
        .await
        .expect("the program lists");
    assert_eq!(listed.len(), 3, "{listed:?}");

    let report = handle.shutdown().await;
    assert_eq!(report.outcome, ShutdownOutcome::Clean, "{report:?}");
    let left = plugin
        .list_nodes(&RunId::new(RUN))
        .await
        .expect("the program lists");
    assert!(left.is_empty(), "{left:?}");
}
