//! The reference provider program, `examples/providers/dirs.py`, under the
//! real host: a cluster converges on machine directories, a second process
//! of the program finds the same machines by their tags, and teardown
//! removes them all.
//!
//! Needs `python3`; without it the program cannot start and the test fails.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use provisioning::{
    BootParams, ClusterShape, DesiredUpdate, Generation, GroupId, NodeGroup, NodeTemplate,
    ProviderShape, RunId, SwarmJoinTemplate,
};
use provisioning_exec::{ExecConfig, ExecPlugin};
use provisioning_provider::ProvisionPlugin;
use provisioning_runtime::{Host, HostConfig, PluginEntry, ShutdownOutcome};

const PROGRAM: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../examples/providers/dirs.py"
);
const RUN: &str = "dirs-host";
/// A bound that only a hang reaches.
const WAIT_BOUND: Duration = Duration::from_secs(120);
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// A fresh root for the program's machines, removed on drop.
struct Root(PathBuf);

impl Root {
    fn new() -> Self {
        let path = std::env::temp_dir().join(format!("dirs-provider-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("a temporary directory");
        Root(path)
    }

    fn machines(&self) -> Vec<PathBuf> {
        let mut found: Vec<PathBuf> = std::fs::read_dir(self.0.join("machines"))
            .expect("the program made its machines directory")
            .map(|entry| entry.expect("a directory entry").path())
            .collect();
        found.sort();
        found
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn program(root: &Path) -> ExecConfig {
    ExecConfig::new(
        "python3",
        [
            PROGRAM.to_owned(),
            "--root".to_owned(),
            root.display().to_string(),
        ],
    )
}

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
async fn the_reference_provider_serves_a_cluster_on_directories_that_a_restart_finds_again() {
    let root = Root::new();
    let plugin = Arc::new(ExecPlugin::new(program(&root.0)));
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

    // Three real machine directories, each tagged with its attempt key.
    let machines = root.machines();
    assert_eq!(machines.len(), 3, "{machines:?}");
    for machine in &machines {
        let tag = std::fs::read_to_string(machine.join("key.json")).expect("a tag");
        assert!(tag.contains(RUN), "{tag}");
    }

    // A second process of the program, knowing nothing, finds the same
    // machines by their tags.
    let fresh = ExecPlugin::start(program(&root.0))
        .await
        .expect("a second process starts");
    let mut listed: Vec<String> = fresh
        .list_nodes(&RunId::new(RUN))
        .await
        .expect("the program lists")
        .into_iter()
        .map(|node| node.lease.0)
        .collect();
    listed.sort();
    let names: Vec<String> = machines
        .iter()
        .map(|m| {
            m.file_name()
                .expect("a name")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(listed, names);
    drop(fresh);

    let report = handle.shutdown().await;
    assert_eq!(report.outcome, ShutdownOutcome::Clean, "{report:?}");
    assert!(root.machines().is_empty(), "{:?}", root.machines());
}
