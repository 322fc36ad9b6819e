//! Level 3 of the conformance kit over Slurm: the battery against the real
//! [`SlurmPlugin`](provisioning_slurm::SlurmPlugin) behind the real
//! `PluginBackendAdapter`, on the one-machine cluster of
//! [`Testbed`], with faults as real scheduler and process events.
//!
//! - [`substrate`] — [`SlurmSubstrate`], the kit's `Substrate` over real
//!   jobs and job steps: work, settling, boot gates, losses, and live
//!   resources counted from `squeue`.
//! - [`backend`] — the backend under the executor, and how each scripted
//!   fault of a call becomes a real event (the table is there).
//! - [`cli`] — the Slurm tools as the plugin runs them, with the call's
//!   fault applied to its first (or acting) command.
//! - [`shared`] — what the harness thread and the plugin's threads share.
//!
//! Every substrate runs its own run id, registered in a [`Level3`] context
//! so that the test can check, at the end, that no job of any of them is
//! left.

pub(crate) mod backend;
pub(crate) mod cli;
pub(crate) mod shared;
pub(crate) mod substrate;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use provisioning::RunId;
use provisioning_conformance::level3::{RunCleanup, Runs};
use provisioning_slurm::parse::run_prefix;
use provisioning_slurm::testbed::{Testbed, is_terminal};

pub(crate) use backend::Defect;
pub(crate) use shared::FaultCounts;
pub(crate) use substrate::{SlurmSubstrate, SlurmWorld};

/// `MessageTimeout` of the plugin's client configuration: a client that
/// cannot reach a stopped controller gives up after about this less one
/// second (the testbed's daemons keep Slurm's default of 10 s).
const CLIENT_MESSAGE_TIMEOUT_SECS: u32 = 3;

/// How long the final cleanup waits for a run's jobs to be gone.
const JOBS_GONE_WAIT_MAX: Duration = Duration::from_secs(30);

/// How long a job listing waits for a stopped controller to come back.
const SQUEUE_WAIT_MAX: Duration = Duration::from_secs(60);

/// How long nodes may take to answer a restarted controller.
const NODES_RESPOND_WAIT_MAX: Duration = Duration::from_secs(20);

/// The pause between two looks while waiting for jobs to go.
const JOBS_GONE_POLL: Duration = Duration::from_millis(100);

/// What one Level 3 test shares among its substrates: the cluster, the
/// client configurations, the runs it started and the faults they applied.
pub(crate) struct Level3 {
    runs: Runs<FaultCounts>,
    bed: Mutex<Testbed>,
    client_conf: PathBuf,
    closed_conf: PathBuf,
    slow_closed_conf: PathBuf,
    /// Removes the client configurations.
    _dir: tempfile::TempDir,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `conf` with its `MessageTimeout` set to `seconds` (appended: the last
/// setting wins).
fn with_message_timeout(conf: &Path, seconds: u32) -> String {
    let text = fs::read_to_string(conf)
        .unwrap_or_else(|e| panic!("level 3 reads {}: {e}", conf.display()));
    format!("{}\nMessageTimeout={seconds}\n", text.trim_end())
}

impl Level3 {
    /// Starts a cluster of `nodes` nodes; runs are named after `name`.
    ///
    /// # Panics
    /// When the testbed cannot start (see [`Testbed::start`]).
    pub(crate) fn new(name: &str, nodes: usize) -> Self {
        let bed = Testbed::start(nodes);
        let dir = tempfile::tempdir().expect("level 3 needs a temporary directory");
        // The plugin's tools: the testbed's cluster, giving up quickly on a
        // stopped controller (a real connect failure).
        let client_conf = dir.path().join("client.conf");
        fs::write(
            &client_conf,
            with_message_timeout(bed.conf(), CLIENT_MESSAGE_TIMEOUT_SECS),
        )
        .expect("write the client slurm.conf");
        // Behind the testbed's closed controller port: a connect failure at
        // once, or (slow) one that keeps retrying for nine seconds.
        let closed_conf = dir.path().join("closed.conf");
        fs::write(
            &closed_conf,
            with_message_timeout(bed.unreachable_conf(), 1),
        )
        .expect("write the closed slurm.conf");
        let slow_closed_conf = dir.path().join("slow-closed.conf");
        fs::write(
            &slow_closed_conf,
            with_message_timeout(bed.unreachable_conf(), 10),
        )
        .expect("write the slow closed slurm.conf");
        Level3 {
            runs: Runs::new(name),
            bed: Mutex::new(bed),
            client_conf,
            closed_conf,
            slow_closed_conf,
            _dir: dir,
        }
    }

    /// The cluster (held only for short, bounded actions).
    pub(crate) fn bed(&self) -> MutexGuard<'_, Testbed> {
        lock(&self.bed)
    }

    /// The plugin's client configuration.
    pub(crate) fn client_conf(&self) -> &Path {
        &self.client_conf
    }

    /// A configuration whose controller port is closed (fails at once).
    pub(crate) fn closed_conf(&self) -> &Path {
        &self.closed_conf
    }

    /// A configuration whose controller port is closed, retrying for 9 s.
    pub(crate) fn slow_closed_conf(&self) -> &Path {
        &self.slow_closed_conf
    }

    /// The job-name prefix of every run of this context.
    pub(crate) fn prefix(&self) -> String {
        format!("prov+l3-{}-{}-", std::process::id(), self.runs.name())
    }

    /// A run id no other substrate (or test process) uses, registered.
    pub(crate) fn next_run(&self) -> RunId {
        self.runs.next_run()
    }

    /// Records the faults a finished substrate applied.
    pub(crate) fn finished(&self, faults: &FaultCounts) {
        self.runs.finished(faults, []);
    }

    /// Every run started so far.
    pub(crate) fn runs(&self) -> Vec<RunId> {
        self.runs.runs()
    }

    /// The faults applied by every finished substrate.
    pub(crate) fn faults(&self) -> FaultCounts {
        self.runs.faults()
    }

    /// The live jobs of `run`, from `squeue` (not from any plugin).
    pub(crate) fn live_jobs(&self, run: &RunId) -> Vec<(u64, String, String, String)> {
        self.live_jobs_named(&run_prefix(run))
    }

    /// The live jobs whose name starts with `prefix`, from `squeue`. While
    /// the controller is stopped on purpose `squeue` fails; this waits
    /// (bounded) until it answers again.
    ///
    /// # Panics
    /// When `squeue` keeps failing past [`SQUEUE_WAIT_MAX`].
    fn live_jobs_named(&self, prefix: &str) -> Vec<(u64, String, String, String)> {
        let deadline = Instant::now() + SQUEUE_WAIT_MAX;
        // Bounded by the deadline.
        loop {
            let output = self
                .bed()
                .client("squeue")
                .args(["-h", "-t", "all", "-o", "%i|%j|%T|%N"])
                .output();
            match output {
                Ok(output) if output.status.success() => {
                    return String::from_utf8_lossy(&output.stdout)
                        .lines()
                        .filter_map(|line| {
                            let mut fields = line.trim().splitn(4, '|');
                            let id = fields.next()?.parse().ok()?;
                            let name = fields.next()?.to_owned();
                            let state = fields.next()?.to_owned();
                            let nodes = fields.next().unwrap_or("").to_owned();
                            Some((id, name, state, nodes))
                        })
                        .filter(|(_, name, state, _)| {
                            name.starts_with(prefix) && !is_terminal(state)
                        })
                        .collect();
                }
                Ok(output) if Instant::now() >= deadline => panic!(
                    "squeue kept failing for {SQUEUE_WAIT_MAX:?}: {}",
                    String::from_utf8_lossy(&output.stderr)
                ),
                Err(error) => panic!("level 3 cannot run squeue: {error}"),
                Ok(_) => std::thread::sleep(JOBS_GONE_POLL),
            }
        }
    }

    /// Cancels every live job of `run` by hand and waits (bounded) until
    /// `squeue` shows none. Returns the jobs still live after the wait.
    pub(crate) fn cancel_run(&self, run: &RunId) -> Vec<(u64, String, String, String)> {
        let deadline = Instant::now() + JOBS_GONE_WAIT_MAX;
        // Bounded by the deadline.
        loop {
            let live = self.live_jobs(run);
            if live.is_empty() || Instant::now() >= deadline {
                return live;
            }
            let ids: Vec<String> = live.iter().map(|(id, ..)| id.to_string()).collect();
            let _ = self.bed().client("scancel").args(&ids).status();
            std::thread::sleep(JOBS_GONE_POLL);
        }
    }

    /// Cancels every live job of every run of this context (see
    /// [`Level3::cancel_run`]); returns what is still live.
    pub(crate) fn cancel_all(&self) -> Vec<(u64, String, String, String)> {
        self.runs()
            .iter()
            .flat_map(|run| self.cancel_run(run))
            .collect()
    }

    /// Waits (bounded) until `sinfo` shows every node answering the
    /// controller (none `unk` or marked `*`), as after a controller restart.
    pub(crate) fn wait_nodes_respond(&self) {
        let deadline = Instant::now() + NODES_RESPOND_WAIT_MAX;
        while Instant::now() < deadline {
            let output = self
                .bed()
                .client("sinfo")
                .args(["-h", "-N", "-o", "%t"])
                .output();
            let responding = output.is_ok_and(|o| {
                o.status.success()
                    && String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .all(|state| !state.contains("unk") && !state.ends_with('*'))
            });
            if responding {
                return;
            }
            std::thread::sleep(JOBS_GONE_POLL);
        }
        eprintln!("level 3: nodes did not answer the controller within {NODES_RESPOND_WAIT_MAX:?}");
    }

    /// Every job of this context's runs that is still live.
    pub(crate) fn live_jobs_of_any_run(&self) -> Vec<(u64, String, String, String)> {
        self.live_jobs_named(&self.prefix())
    }
}

impl RunCleanup for Level3 {
    fn runs(&self) -> Vec<RunId> {
        self.runs.runs()
    }

    /// Cancels every job of `run` by hand (the testbed's own drop then
    /// stops the daemons and kills whatever carries its configuration).
    fn clean_up(&self, run: &RunId) -> Option<String> {
        let left = self.cancel_run(run);
        (!left.is_empty()).then(|| format!("jobs {left:?}"))
    }
}
