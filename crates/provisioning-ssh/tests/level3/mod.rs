//! Level 3 of the conformance kit over SSH: the battery against the real
//! [`SshPlugin`](provisioning_ssh::SshPlugin) behind the real
//! `PluginBackendAdapter`, over namespaced sshd hosts, with faults as real
//! events on the hosts.
//!
//! - [`hosts`] — the testbed's hosts: claims, processes in each host's
//!   namespace, and the real faults (sshd stopped, link down, changed host
//!   key, exhausted inventory, held claim lock, signals).
//! - [`backend`] — the backend under the executor, and how each scripted
//!   fault becomes a real event (the table is there).
//! - [`substrate`] — [`SshSubstrate`], the kit's `Substrate`: work,
//!   settling, stream events, losses, and live resources counted from the
//!   hosts.
//! - [`shared`] — the state the harness thread and the plugin's threads share.
//!
//! Every substrate serves a run of its own, registered in a [`Level3`]
//! context, so that the test can check at the end that no agent process
//! and no claim of any run is left on any host.

pub(crate) mod backend;
pub(crate) mod hosts;
pub(crate) mod shared;
pub(crate) mod substrate;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};

use provisioning::RunId;

use crate::common::Testbed;
pub(crate) use backend::Defect;
pub(crate) use hosts::Hosts;
pub(crate) use shared::FaultCounts;
pub(crate) use substrate::SshSubstrate;

/// What one Level 3 test shares among its substrates: the hosts, the gated
/// agent program, the runs, the faults they applied and what survived.
pub(crate) struct Level3 {
    name: String,
    hosts: Hosts,
    agent: PathBuf,
    serial: AtomicU32,
    runs: Mutex<Vec<RunId>>,
    faults: Mutex<FaultCounts>,
    survivors: Mutex<Vec<String>>,
    /// Holds the gated agent program.
    _dir: tempfile::TempDir,
}

impl Level3 {
    /// A context over `hosts` namespaced sshd hosts with `slots` slots each,
    /// whose agents are `agent` behind a boot gate.
    pub(crate) fn new(name: &str, hosts: usize, slots: u32, agent: &str) -> Self {
        let dir = tempfile::tempdir().expect("level 3 needs a temporary directory");
        let gated = hosts::write_gate_agent(dir.path(), agent);
        Level3 {
            name: name.to_owned(),
            hosts: Hosts::new(Testbed::start_netns(hosts), slots),
            agent: gated,
            serial: AtomicU32::new(0),
            runs: Mutex::new(Vec::new()),
            faults: Mutex::new(FaultCounts::default()),
            survivors: Mutex::new(Vec::new()),
            _dir: dir,
        }
    }

    /// The hosts.
    pub(crate) fn hosts(&self) -> &Hosts {
        &self.hosts
    }

    /// The agent program the plugins install.
    pub(crate) fn agent(&self) -> &Path {
        &self.agent
    }

    /// The slots of every host.
    pub(crate) fn slots(&self) -> u32 {
        self.hosts.slots()
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

    /// Records what a substrate left once it was torn down: the faults it
    /// applied, and the processes and claims that outlived the plugin's own
    /// destroys (each was then killed or removed).
    pub(crate) fn finished(&self, run: &RunId, faults: &FaultCounts, left: Option<String>) {
        self.faults
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .add(faults);
        if let Some(left) = left {
            self.survivors
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(format!("run {run}: {left}"));
        }
    }

    /// Every run started so far.
    pub(crate) fn runs(&self) -> Vec<RunId> {
        self.runs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The faults applied by every finished substrate.
    pub(crate) fn faults(&self) -> FaultCounts {
        *self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What outlived a plugin's destroys.
    pub(crate) fn survivors(&self) -> Vec<String> {
        self.survivors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
