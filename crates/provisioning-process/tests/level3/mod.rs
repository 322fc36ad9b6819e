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
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};

use provisioning::RunId;
use provisioning_process::os::TaggedProcess;

pub(crate) use backend::Defect;
pub(crate) use contract::contract_subject;
pub(crate) use shared::OsFaultCounts;
pub(crate) use substrate::ProcessSubstrate;

/// What one Level 3 test shares among its substrates: the agent binary, the
/// runs it started, the faults they applied and what survived their teardown.
#[derive(Debug)]
pub(crate) struct Level3 {
    name: String,
    agent_binary: PathBuf,
    serial: AtomicU32,
    runs: Mutex<Vec<RunId>>,
    faults: Mutex<OsFaultCounts>,
    survivors: Mutex<Vec<String>>,
}

impl Level3 {
    /// A context whose runs are named after `name` and this test process.
    pub(crate) fn new(name: &str, agent_binary: impl Into<PathBuf>) -> Self {
        Level3 {
            name: name.to_owned(),
            agent_binary: agent_binary.into(),
            serial: AtomicU32::new(0),
            runs: Mutex::new(Vec::new()),
            faults: Mutex::new(OsFaultCounts::default()),
            survivors: Mutex::new(Vec::new()),
        }
    }

    /// The node agent binary.
    pub(crate) fn agent_binary(&self) -> &Path {
        &self.agent_binary
    }

    /// A run id no other substrate (or test process) uses, registered.
    pub(crate) fn next_run(&self) -> RunId {
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let mut text = format!("l3-{}-{}-{serial}", std::process::id(), self.name);
        text.truncate(63);
        let run = RunId::new(text);
        self.runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(run.clone());
        run
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
        self.faults
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .add(faults);
        let mut survivors = self
            .survivors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
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
    }

    /// Every run started so far.
    pub(crate) fn runs(&self) -> Vec<RunId> {
        self.runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The operating-system faults applied by every finished substrate.
    pub(crate) fn faults(&self) -> OsFaultCounts {
        *self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Processes that outlived a plugin's shutdown (each was then killed).
    pub(crate) fn survivors(&self) -> Vec<String> {
        self.survivors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
