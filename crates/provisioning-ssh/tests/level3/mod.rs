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

use provisioning::RunId;
use provisioning_conformance::level3::{RunCleanup, Runs};

use crate::common::Testbed;
pub(crate) use backend::Defect;
pub(crate) use hosts::Hosts;
pub(crate) use shared::FaultCounts;
pub(crate) use substrate::{SshSubstrate, SshWorld};

/// What one Level 3 test shares among its substrates: the hosts, the gated
/// agent program, the runs, the faults they applied and what survived.
pub(crate) struct Level3 {
    runs: Runs<FaultCounts>,
    hosts: Hosts,
    agent: PathBuf,
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
            runs: Runs::new(name),
            hosts: Hosts::new(Testbed::start_netns(hosts), slots),
            agent: gated,
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
        self.runs.next_run()
    }

    /// Records what a substrate left once it was torn down: the faults it
    /// applied, and the processes and claims that outlived the plugin's own
    /// destroys (each was then killed or removed).
    pub(crate) fn finished(&self, run: &RunId, faults: &FaultCounts, left: Option<String>) {
        self.runs
            .finished(faults, left.map(|left| format!("run {run}: {left}")));
    }

    /// Every run started so far.
    pub(crate) fn runs(&self) -> Vec<RunId> {
        self.runs.runs()
    }

    /// The faults applied by every finished substrate.
    pub(crate) fn faults(&self) -> FaultCounts {
        self.runs.faults()
    }

    /// What outlived a plugin's destroys.
    pub(crate) fn survivors(&self) -> Vec<String> {
        self.runs.survivors()
    }
}

impl RunCleanup for Level3 {
    fn runs(&self) -> Vec<RunId> {
        self.runs.runs()
    }

    /// Undoes every fault on the hosts.
    fn restore(&self) {
        self.hosts.restore();
    }

    /// Kills every agent and removes every claim of `run`.
    fn clean_up(&self, run: &RunId) -> Option<String> {
        let (processes, claims) = self.hosts.purge(run);
        (!processes.is_empty() || !claims.is_empty()).then(|| {
            format!(
                "{} process(es) and {} claim(s)",
                processes.len(),
                claims.len()
            )
        })
    }
}
