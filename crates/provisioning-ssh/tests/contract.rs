//! The conformance kit's seam contract suite against the ssh plugin over
//! real sshd hosts on loopback, with every fault a real event:
//!
//! | Armed fault | Method | What really happens |
//! |---|---|---|
//! | `definite` | `create_node` | the claim's SSH connection goes to a closed port of the host: refused before anything ran (the look for an existing claim still happens first) |
//! | `ambiguous-done` | `create_node` | the claim is made on the host, its reply is thrown away |
//! | `definite` | `destroy_node` | the release's SSH connection is refused |
//! | `ambiguous-done` | `destroy_node` | the claim is released on the host, its reply is thrown away |
//! | loss | — | the claim directory is removed on the host behind the plugin's back; the plugin's loss watch finds it gone |
//!
//! Every plugin bootstraps with the real node agent (`provision-remote-agent`),
//! which joins the plugin's own swarm listener over TCP.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::Testbed;
use provisioning::spawn::BoxFuture;
use provisioning_agent::RunSecret;
use provisioning_conformance::contract::{
    ContractFaults, ContractSubject, PluginMethod, run_contract_suite,
};
use provisioning_conformance::trace::Fault;
use provisioning_provider::AttemptKey;
use provisioning_ssh::{FaultMode, FaultStep, SshPlugin, WatchHandle};

const AGENT: &str = env!("CARGO_BIN_EXE_provision-remote-agent");

const RUN: &str = "contract-test";

/// How often the plugin's loss watch looks at the hosts.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);

struct SshFaults {
    plugin: Arc<SshPlugin>,
    claims: Vec<std::path::PathBuf>,
    _watch: WatchHandle,
}

impl ContractFaults for SshFaults {
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        let step = match method {
            PluginMethod::CreateNode => FaultStep::Claim,
            PluginMethod::DestroyNode => FaultStep::Release,
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
            let path = format!("{}/{}/{}", key.run_id, key.node, key.attempt);
            let mut removed = false;
            for root in &self.claims {
                let claim = root.join(&path);
                if claim.is_dir() {
                    std::fs::remove_dir_all(&claim).expect("remove the claim out of band");
                    removed = true;
                }
            }
            removed
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ssh_plugin_keeps_the_seam_contract_over_real_sshd() {
    let bed = Testbed::start(2);
    let claims: Vec<_> = bed.hosts.iter().map(|h| h.claims()).collect();
    let bed = &bed;
    let report = run_contract_suite(|| {
        let claims = claims.clone();
        async move {
            let agent = bed.agent_config(AGENT, RunSecret::generate(), 0);
            let plugin = bed.agent_plugin(RUN, 2, agent).await;
            let watch = plugin.start_watch(WATCH_INTERVAL);
            let faults = Arc::new(SshFaults {
                plugin: plugin.clone(),
                claims,
                _watch: watch,
            });
            Ok::<_, String>(
                ContractSubject::new(plugin, provisioning::RunId::new(RUN))
                    .with_faults(faults)
                    .with_pause(Arc::new(|d| Box::pin(tokio::time::sleep(d)))),
            )
        }
    })
    .await;
    println!("{report}");
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "every contract is exercised over real ssh:\n{report}"
    );
}
