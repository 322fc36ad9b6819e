//! `DurableLoop`: what a durable host loop keeps of its journal (the
//! journal, its codec, the last commit error), of its recovery (whether it
//! resumed, how many nodes were lost) and of orphan collection (the
//! suspects and the channel background scans and destroys report on).

use std::sync::Arc;

use provisioning::{ClusterState, RunId};
use provisioning_journal::Journal;
use provisioning_journal::codec::StateCodec;
use provisioning_provider::PluginBackendAdapter;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::orphans::{OrphanReport, Orphans};
use crate::status::DurabilityStatus;

/// The journal side of a durable host loop.
pub(crate) struct DurableLoop {
    pub(super) journal: Box<dyn Journal>,
    pub(super) codec: StateCodec,
    /// The last commit's error, while commits fail.
    pub(super) journal_error: Option<String>,
    pub(super) orphans: Orphans,
    pub(super) reports: mpsc::UnboundedReceiver<OrphanReport>,
    pub(super) resumed: bool,
    pub(super) lost_at_recovery: u64,
}

impl DurableLoop {
    /// Whether the run was resumed from a journal its last controller left
    /// unclean (the loop then reconciles the providers' listing first).
    pub(crate) fn resumed(&self) -> bool {
        self.resumed
    }

    /// When the loop should start the next orphan scan; `None` while one
    /// runs.
    pub(crate) fn next_scan(&self) -> Option<Instant> {
        self.orphans.next_scan()
    }

    /// Starts a background listing of every provider.
    pub(crate) fn start_scan(&mut self, adapter: Arc<PluginBackendAdapter>, run: RunId) {
        self.orphans.start_scan(adapter, run);
    }

    /// Folds what background orphan work reported.
    pub(crate) fn on_orphan_report(
        &mut self,
        report: OrphanReport,
        state: &ClusterState,
        adapter: &Arc<PluginBackendAdapter>,
        run: &RunId,
    ) {
        match report {
            OrphanReport::Listed(listing) => {
                self.orphans.on_listing(&listing, state, adapter, run);
            }
            OrphanReport::Destroyed { kind, key, outcome } => {
                self.orphans.on_destroyed(kind, key, outcome);
            }
        }
    }

    /// What a snapshot shows of durable state.
    pub(crate) fn status(&self) -> DurabilityStatus {
        let stats = self.journal.stats();
        DurabilityStatus {
            resumed: self.resumed,
            commits: stats.commits,
            bytes_written: stats.bytes_written,
            journal_error: self.journal_error.clone(),
            orphans_suspected: self.orphans.suspected(),
            orphans_collected: self.orphans.collected,
            lost_at_recovery: self.lost_at_recovery,
        }
    }
}

/// The next orphan report, or never when the host keeps no durable state.
pub(crate) async fn recv_report(durable: Option<&mut DurableLoop>) -> Option<OrphanReport> {
    match durable {
        Some(durable) => durable.reports.recv().await,
        None => std::future::pending().await,
    }
}
