//! The conformance kit's seam contract suite against the container plugin
//! on a private Docker engine and on a private Podman service
//! (`provisioning_container::testbed`), every
//! fault a real event:
//!
//! | Armed fault | Method | What really happens |
//! |---|---|---|
//! | `definite` | `create_node` | the create goes to a socket nobody listens on: a real refused connection before anything was sent (the look for an existing container still happens first) |
//! | `ambiguous-done` | `create_node` | the container is created and started; the reply is thrown away |
//! | `definite` | `destroy_node` | the stop goes to the refusing socket |
//! | `ambiguous-done` | `destroy_node` | the container is stopped and removed; the reply is thrown away |
//! | loss | — | the container is removed by hand (`docker rm -f`); the plugin's loss watch sees it go |

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use provisioning::spawn::BoxFuture;
use provisioning::{BootParams, NodeTemplate, ProviderShape, SwarmJoinTemplate};
use provisioning_conformance::contract::{
    ContractFaults, ContractSubject, PluginMethod, run_contract_suite,
};
use provisioning_conformance::trace::Fault;
use provisioning_container::testbed::Engine;
use provisioning_container::{ContainerPlugin, FaultMode, FaultStep, container_name};
use provisioning_provider::AttemptKey;

const RUN: &str = "contract-test";

/// The bound on the whole suite.
const SUITE_WAIT: Duration = Duration::from_secs(600);

struct EngineFaults {
    plugin: Arc<ContainerPlugin>,
    engine: Arc<Engine>,
}

impl ContractFaults for EngineFaults {
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        let step = match method {
            PluginMethod::CreateNode => FaultStep::Create,
            PluginMethod::DestroyNode => FaultStep::Destroy,
            _ => return false,
        };
        let mode = match fault {
            Fault::Definite => FaultMode::Refused,
            Fault::AmbiguousDone => FaultMode::ReplyLost,
            _ => return false,
        };
        self.plugin.arm_fault(step, mode);
        true
    }

    fn lose_node<'a>(&'a self, key: &'a AttemptKey) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let Some(name) = container_name(key) else {
                return false;
            };
            let engine = self.engine.clone();
            tokio::task::spawn_blocking(move || engine.docker(&["rm", "-f", &name]).0)
                .await
                .expect("remove by hand")
        })
    }
}

fn template(engine: &Engine) -> NodeTemplate {
    NodeTemplate {
        role: "contract".to_owned(),
        provider: "container".to_owned(),
        shape: ProviderShape {
            image: String::new(),
            resources: BTreeMap::new(),
            labels: common::labels(engine),
        },
        boot: BootParams {
            user: String::new(),
            verify_commands: Vec::new(),
            start_command: "sleep 1000".to_owned(),
            env: BTreeMap::new(),
            args: Vec::new(),
            on_peers_change: String::new(),
        },
        swarm_join: SwarmJoinTemplate {
            swarm: "default".to_owned(),
            labels: BTreeMap::new(),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_plugin_keeps_the_seam_contract_on_a_real_engine() {
    suite_on(Arc::new(common::engine())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_plugin_keeps_the_seam_contract_on_podman() {
    suite_on(Arc::new(Engine::start_podman(std::path::Path::new(
        common::AGENT,
    ))))
    .await;
}

/// The suite against a plugin on `engine`, every contract exercised,
/// nothing left behind.
async fn suite_on(engine: Arc<Engine>) {
    let suite = run_contract_suite(|| {
        let engine = engine.clone();
        async move {
            let plugin = common::plugin(&engine, RUN).await;
            let faults = Arc::new(EngineFaults {
                plugin: plugin.clone(),
                engine: engine.clone(),
            });
            Ok::<_, String>(
                ContractSubject::new(plugin, provisioning::RunId::new(RUN))
                    .with_faults(faults)
                    .with_template(template(&engine))
                    .with_pause(Arc::new(|d| Box::pin(tokio::time::sleep(d)))),
            )
        }
    });
    let report = tokio::time::timeout(SUITE_WAIT, suite)
        .await
        .expect("the contract suite finished in time");
    println!("{:?}: {report}", engine.kind());
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "every contract is exercised on a real engine:\n{report}"
    );
    assert_eq!(report.passed().len(), 10, "{report}");
    assert!(
        engine.containers("prov.").is_empty(),
        "containers left after the suite: {:?}",
        engine.containers("")
    );
}
