//! One `/proc` scan shared by every call of the plugin that waits for one.
//!
//! A scan reads the environment of every process on the machine, so its cost
//! grows with the fleet: a thousand destroys each scanning on their own is
//! quadratic, and a scan run on the async runtime stalls every task behind
//! it. [`ProcScanner::fresh`] runs scans on tokio's blocking pool, one at a
//! time, and hands one scan to every caller that asked before it started.
//!
//! Most calls never get here: the plugin knows each agent's process group
//! and asks the kernel (signal 0) whether anything of it is left; only a
//! group that still has members, an unknown node or a listing of detached
//! agents needs the tags.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use provisioning::RunId;

use provisioning_agent::os::{self, OsError, TaggedProcess};

/// What one scan found.
pub(crate) struct Scan {
    /// When the scan began: it saw every process that was alive then and
    /// still alive when its entry was read.
    started: Instant,
    /// The live processes of the run, sorted by pid.
    pub(crate) processes: Vec<TaggedProcess>,
}

/// Shared scans of one run's processes.
pub(crate) struct ProcScanner {
    run: RunId,
    /// The latest scan; held while a scan runs, so callers queue behind it.
    latest: tokio::sync::Mutex<Option<Arc<Scan>>>,
    scans: AtomicU64,
}

impl ProcScanner {
    pub(crate) fn new(run: RunId) -> Self {
        ProcScanner {
            run,
            latest: tokio::sync::Mutex::new(None),
            scans: AtomicU64::new(0),
        }
    }

    /// A scan that began at or after this call: the latest one when it is
    /// recent enough, else a new one (which the callers queued behind it
    /// share).
    ///
    /// # Errors
    /// As [`os::run_processes`]; a scan task that panicked is reported as
    /// `/proc` being unavailable.
    pub(crate) async fn fresh(&self) -> Result<Arc<Scan>, OsError> {
        let asked = Instant::now();
        let mut latest = self.latest.lock().await;
        if let Some(scan) = latest.as_ref()
            && scan.started >= asked
        {
            return Ok(scan.clone());
        }
        let run = self.run.clone();
        let started = Instant::now();
        let processes = tokio::task::spawn_blocking(move || os::run_processes(&run))
            .await
            .map_err(|error| OsError::ProcUnavailable(io::Error::other(error)))??;
        self.scans.fetch_add(1, Ordering::Relaxed);
        let scan = Arc::new(Scan { started, processes });
        *latest = Some(scan.clone());
        Ok(scan)
    }

    /// The live processes of the run that `wanted` keeps, from a fresh scan.
    ///
    /// # Errors
    /// As [`ProcScanner::fresh`].
    pub(crate) async fn processes(
        &self,
        wanted: impl Fn(&TaggedProcess) -> bool,
    ) -> Result<Vec<TaggedProcess>, OsError> {
        let scan = self.fresh().await?;
        Ok(scan
            .processes
            .iter()
            .filter(|p| wanted(p))
            .cloned()
            .collect())
    }

    /// The live processes of process group `group`; no scan when the kernel
    /// says the group is empty.
    ///
    /// # Errors
    /// As [`ProcScanner::fresh`].
    pub(crate) async fn group(&self, group: i32) -> Result<Vec<TaggedProcess>, OsError> {
        if !os::group_exists(group) {
            return Ok(Vec::new());
        }
        self.processes(|p| p.process_group == group).await
    }

    /// How many scans ran so far.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn scans(&self) -> u64 {
        self.scans.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_callers_share_scans() {
        let scanner = Arc::new(ProcScanner::new(RunId::new(format!(
            "scan-unit-{}",
            std::process::id()
        ))));
        let mut callers = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let scanner = scanner.clone();
            callers.spawn(async move { scanner.fresh().await.map(|s| s.processes.len()) });
        }
        while let Some(found) = callers.join_next().await {
            assert_eq!(found.unwrap().unwrap(), 0);
        }
        // The first caller scans; the callers that queued behind it share
        // the next one (a caller first polled late may need one more).
        assert!(
            scanner.scans() <= 8,
            "{} scans for 64 callers",
            scanner.scans()
        );
    }

    #[tokio::test]
    async fn an_empty_group_needs_no_scan() {
        let scanner = ProcScanner::new(RunId::new("scan-unit-empty"));
        // Pid space tops out below this, so no group has this id.
        assert!(scanner.group(i32::MAX - 7).await.unwrap().is_empty());
        assert_eq!(scanner.scans(), 0);
    }
}
