//! Level 3 of the conformance kit: the battery against the real
//! [`ProcessPlugin`](provisioning_process::ProcessPlugin) behind the real
//! `PluginBackendAdapter`, with faults as operating-system events.
//!
//! - [`substrate`] — [`ProcessSubstrate`], the kit's `Substrate` over real
//!   agent processes: work, settling, streams, losses, and live resources
//!   counted from `/proc`.
//! - [`backend`] — the backend under the executor, and how each scripted
//!   fault becomes a real event (the table is there).
//! - [`os_faults`] — the agent program that can go missing, the boot gates,
//!   and the signals.
//! - [`shared`] — the state the harness thread and the plugin's threads share.
//! - [`contract`] — the seam contract suite's fault hook, with real faults.
//!
//! Every substrate runs its own run id, registered in a [`Level3`] context
//! so that the test can check, at the end, that no process of any of them is
//! left.

pub(crate) mod backend;
pub(crate) mod contract;
pub(crate) mod os_faults;
pub(crate) mod shared;
pub(crate) mod substrate;

use std::path::{Path, PathBuf};
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::os::{self, TaggedProcess};
use provisioning_conformance::level3::{RunCleanup, Runs};

pub(crate) use backend::Defect;
pub(crate) use contract::contract_subject;
pub(crate) use shared::OsFaultCounts;
pub(crate) use substrate::{ProcessSubstrate, ProcessWorld};

/// How long cleaning up a run waits for its processes to be gone.
pub(crate) const RUN_GONE_WAIT_MAX: Duration = Duration::from_secs(10);

/// What one Level 3 test shares among its substrates: the agent binary, and
/// the kit's registry of the runs it started, the faults they applied and
/// what survived their teardown.
#[derive(Debug)]
pub(crate) struct Level3 {
    runs: Runs<OsFaultCounts>,
    agent_binary: PathBuf,
}

impl Level3 {
    /// A context whose runs are named after `name` and this test process.
    pub(crate) fn new(name: &str, agent_binary: impl Into<PathBuf>) -> Self {
        Level3 {
            runs: Runs::new(name),
            agent_binary: agent_binary.into(),
        }
    }

    /// The node agent binary.
    pub(crate) fn agent_binary(&self) -> &Path {
        &self.agent_binary
    }

    /// A run id no other substrate (or test process) uses, registered.
    pub(crate) fn next_run(&self) -> RunId {
        self.runs.next_run()
    }

    /// Records what a substrate did once it is torn down: the faults it
    /// applied, the processes that outlived its plugin's shutdown, and those
    /// that even survived being killed.
    pub(crate) fn finished(
        &self,
        run: &RunId,
        faults: &OsFaultCounts,
        outlived: &[TaggedProcess],
        unkillable: &[TaggedProcess],
    ) {
        let mut survivors = Vec::new();
        if !outlived.is_empty() {
            survivors.push(format!(
                "run {run}: {} process(es) outlived the plugin's shutdown and were killed: {outlived:?}",
                outlived.len()
            ));
        }
        if !unkillable.is_empty() {
            survivors.push(format!(
                "run {run}: {} process(es) survived SIGKILL: {unkillable:?}",
                unkillable.len()
            ));
        }
        self.runs.finished(faults, survivors);
    }

    /// Every run started so far.
    pub(crate) fn runs(&self) -> Vec<RunId> {
        self.runs.runs()
    }

    /// The operating-system faults applied by every finished substrate.
    pub(crate) fn faults(&self) -> OsFaultCounts {
        self.runs.faults()
    }

    /// Processes that outlived a plugin's shutdown (each was then killed).
    pub(crate) fn survivors(&self) -> Vec<String> {
        self.runs.survivors()
    }
}

impl RunCleanup for Level3 {
    fn runs(&self) -> Vec<RunId> {
        self.runs.runs()
    }

    /// Kills every process of `run`.
    fn clean_up(&self, run: &RunId) -> Option<String> {
        match os::kill_run(run, RUN_GONE_WAIT_MAX) {
            Ok(left) if left.is_empty() => None,
            Ok(left) => Some(format!("processes {left:#?}")),
            Err(error) => Some(format!("cannot clean up: {error}")),
        }
    }
}
