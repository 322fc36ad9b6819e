//! Level 3 of the conformance kit over containers: the battery against the
//! real [`ContainerPlugin`](provisioning_container::ContainerPlugin) behind
//! the real `PluginBackendAdapter`, on a private Docker engine
//! ([`Engine`]), with faults as real engine and process events.
//!
//! - [`substrate`] — [`ContainerSubstrate`], the kit's `Substrate` over real
//!   containers: boot gates, losses, and live resources counted from the
//!   engine's own listing and `/proc`, never from the plugin.
//! - [`backend`] — the backend under the executor, and how each scripted
//!   fault of a call becomes a real event (the table is there).
//! - [`shared`] — what the harness thread and the plugin's threads share.

pub(crate) mod backend;
pub(crate) mod shared;
pub(crate) mod substrate;

use std::sync::{Mutex, MutexGuard, PoisonError};

use provisioning::RunId;
use provisioning_conformance::level3::{RunCleanup, Runs};
use provisioning_container::testbed::Engine;
use provisioning_container::{LABEL_ATTEMPT, LABEL_NODE, LABEL_RUN};

pub(crate) use backend::Defect;
pub(crate) use shared::FaultCounts;
pub(crate) use substrate::{ContainerSubstrate, ContainerWorld};

/// One container of a run as the engine lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Listed {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) node: String,
    pub(crate) attempt: u64,
    pub(crate) state: String,
}

/// What one Level 3 test shares among its substrates: the engine, the runs
/// it started and the faults they applied.
pub(crate) struct Level3 {
    runs: Runs<FaultCounts>,
    engine: Mutex<Engine>,
}

impl Level3 {
    /// Starts a private engine; runs are named after `name`.
    pub(crate) fn new(name: &str) -> Self {
        Level3 {
            runs: Runs::new(name),
            engine: Mutex::new(crate::common::engine()),
        }
    }

    /// The engine (held only for short, bounded actions — and for a
    /// restart).
    pub(crate) fn engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A run id no other substrate (or test process) uses, registered.
    pub(crate) fn next_run(&self) -> RunId {
        self.runs.next_run()
    }

    /// Records the faults a finished substrate applied and what outlived it.
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

    /// What outlived the plugin's destroys, per run.
    pub(crate) fn survivors(&self) -> Vec<String> {
        self.runs.survivors()
    }

    /// The containers of `run` (any state), from the engine's own listing.
    pub(crate) fn containers(&self, run: &RunId) -> Vec<Listed> {
        let filter = format!("label={LABEL_RUN}={run}");
        let format = format!(
            "{{{{.ID}}}} {{{{.Names}}}} {{{{.Label \"{LABEL_NODE}\"}}}} {{{{.Label \"{LABEL_ATTEMPT}\"}}}} {{{{.State}}}}"
        );
        let (ok, out, err) = self.engine().docker(&[
            "ps",
            "-a",
            "--no-trunc",
            "--filter",
            &filter,
            "--format",
            &format,
        ]);
        assert!(ok, "level 3 cannot list the engine's containers: {err}");
        out.lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                Some(Listed {
                    id: fields.next()?.to_owned(),
                    name: fields.next()?.to_owned(),
                    node: fields.next()?.to_owned(),
                    attempt: fields.next()?.parse().ok()?,
                    state: fields.next().unwrap_or("").to_owned(),
                })
            })
            .collect()
    }

    /// Removes every container of `run` by hand; returns what was there.
    pub(crate) fn purge(&self, run: &RunId) -> Vec<Listed> {
        let left = self.containers(run);
        for container in &left {
            let _ = self.engine().docker(&["rm", "-f", &container.id]);
        }
        left
    }
}

impl RunCleanup for Level3 {
    fn runs(&self) -> Vec<RunId> {
        self.runs.runs()
    }

    fn restore(&self) {
        // An engine stopped by a fault that never finished comes back.
        self.engine().resume();
    }

    fn clean_up(&self, run: &RunId) -> Option<String> {
        let left = self.purge(run);
        (!left.is_empty()).then(|| format!("{} container(s)", left.len()))
    }
}
