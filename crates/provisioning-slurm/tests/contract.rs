//! The conformance kit's seam contract suite against the slurm plugin on a
//! real Slurm cluster (`provisioning_slurm::testbed`), every fault a real
//! event:
//!
//! | Armed fault | Method | What really happens |
//! |---|---|---|
//! | `definite` | `create_node` | `sbatch` runs against a closed controller port: a real connect failure before anything was sent (the `squeue` look for an existing job still happens first) |
//! | `ambiguous-done` | `create_node` | `sbatch` submits the job; its reply is thrown away as if it had timed out |
//! | `definite` | `destroy_node` | `scancel` cannot reach the controller |
//! | `ambiguous-done` | `destroy_node` | `scancel` cancels the job; its reply is thrown away |
//! | loss | — | the job is `scancel`led by hand; the plugin's loss watch sees it end |

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Fault as CliFault, FaultyCli};
use provisioning::spawn::BoxFuture;
use provisioning_conformance::contract::{
    ContractFaults, ContractSubject, PluginMethod, run_contract_suite,
};
use provisioning_conformance::trace::Fault;
use provisioning_provider::AttemptKey;
use provisioning_slurm::Tool;
use provisioning_slurm::parse::job_name;
use provisioning_slurm::testbed::Testbed;

const RUN: &str = "contract-test";

/// The bound on the whole suite.
const SUITE_WAIT: Duration = Duration::from_secs(600);

struct SlurmFaults {
    cli: Arc<FaultyCli>,
    bed: Arc<Testbed>,
}

impl ContractFaults for SlurmFaults {
    fn inject(&self, method: PluginMethod, fault: Fault) -> bool {
        let tool = match method {
            PluginMethod::CreateNode => Tool::Sbatch,
            PluginMethod::DestroyNode => Tool::Scancel,
            _ => return false,
        };
        let mode = match fault {
            Fault::Definite => CliFault::Unreachable,
            Fault::AmbiguousDone => CliFault::ReplyLost,
            _ => return false,
        };
        self.cli.arm(tool, mode);
        true
    }

    fn lose_node<'a>(&'a self, key: &'a AttemptKey) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let Some(name) = job_name(key) else {
                return false;
            };
            let bed = self.bed.clone();
            tokio::task::spawn_blocking(move || {
                let jobs: Vec<u64> = bed
                    .live_jobs(&name)
                    .into_iter()
                    .filter(|(_, n, _, _)| *n == name)
                    .map(|(id, ..)| id)
                    .collect();
                for job in &jobs {
                    bed.cancel_by_hand(*job);
                }
                !jobs.is_empty()
            })
            .await
            .expect("cancel by hand")
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slurm_plugin_keeps_the_seam_contract_on_a_real_cluster() {
    let bed = Arc::new(Testbed::start(4));
    let suite = run_contract_suite(|| {
        let bed = bed.clone();
        async move {
            let (plugin, cli) = common::plugin(&bed, RUN).await;
            let faults = Arc::new(SlurmFaults {
                cli,
                bed: bed.clone(),
            });
            Ok::<_, String>(
                ContractSubject::new(plugin, provisioning::RunId::new(RUN))
                    .with_faults(faults)
                    .with_pause(Arc::new(|d| Box::pin(tokio::time::sleep(d)))),
            )
        }
    });
    let report = tokio::time::timeout(SUITE_WAIT, suite)
        .await
        .expect("the contract suite finished in time");
    println!("{report}");
    report.assert_passed();
    assert!(
        report.skipped().is_empty(),
        "every contract is exercised on real Slurm:\n{report}"
    );
    assert_eq!(report.passed().len(), 10, "{report}");
    assert!(
        bed.live_jobs("prov+").is_empty(),
        "jobs left after the suite: {:?}",
        bed.jobs()
    );
}
