//! [`DurableSide`]: what the durable side of one run keeps (crashes, the
//! last commit, the kit's replica of the journal, orphan suspects and
//! samples), and how a breach is relabelled once a crash happened.

use std::collections::{BTreeMap, BTreeSet};

use provisioning::{EffectKind, LogicalNodeId, NodeAttemptId, Timestamp};

use super::controller::Control;
use super::options::HostOptions;
use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::Harness;
use crate::journal::InMemoryJournal;
use crate::oracle::{self, breach};
use crate::substrate::{ResourceKey, Substrate};

/// What the durable side of one run keeps.
#[derive(Debug)]
pub(in crate::harness) struct DurableSide {
    pub(in crate::harness) control: Control,
    /// A crash input is waiting for its wake.
    pub(in crate::harness) crash_armed: bool,
    /// Crashes that happened.
    pub(in crate::harness) crashes: u64,
    /// What the last commit wrote: meta, upserts, removals (all zero for
    /// an empty change set).
    pub(in crate::harness) last_commit: (bool, usize, usize),
    /// What the driver said before the commit: whether changes waited.
    pub(in crate::harness) changes_waiting: Option<bool>,
    /// Create/start operations recovery made ambiguous, by attempt.
    pub(in crate::harness) recovered_ambiguous: BTreeSet<(NodeAttemptId, EffectKind)>,
    /// The host's orphan suspects: key → first seen unowned.
    pub(in crate::harness) suspects: BTreeMap<ResourceKey, Timestamp>,
    /// The oracle's own sample: key → first observed unowned.
    pub(in crate::harness) observed_orphans: BTreeMap<ResourceKey, Timestamp>,
    /// When the host lists the live resources next.
    pub(in crate::harness) next_scan_at: Timestamp,
    /// When faults stopped (the fair tail began).
    pub(in crate::harness) faults_stopped_at: Option<Timestamp>,
    /// Late results the executors of dead controllers dropped.
    pub(in crate::harness) late_dropped_before: u64,
    /// Commits attempted (successful or not): which of the three ways the
    /// next one takes the driver's changes.
    pub(in crate::harness) commits: u64,
    /// What the journal holds, as the kit applied every committed change set
    /// itself (`None` before the first commit of a controller whose
    /// journal the kit has not read).
    pub(in crate::harness) replica: Option<InMemoryJournal>,
    /// A breach found while committing, reported right after the commit.
    pub(in crate::harness) commit_breach: Option<oracle::Breach>,
    /// Nodes the journal held as ready (or rejoining) at the last crash,
    /// whose agent's re-join the kit has not folded into the new
    /// controller yet (G37).
    pub(in crate::harness) awaiting_rejoin: BTreeSet<(LogicalNodeId, NodeAttemptId)>,
}

impl DurableSide {
    pub(in crate::harness) fn new(now: Timestamp, options: &HostOptions) -> Self {
        DurableSide {
            control: Control::default(),
            crash_armed: false,
            crashes: 0,
            last_commit: (false, 0, 0),
            changes_waiting: None,
            recovered_ambiguous: BTreeSet::new(),
            suspects: BTreeMap::new(),
            observed_orphans: BTreeMap::new(),
            next_scan_at: now.saturating_add(options.orphan_scan_interval),
            faults_stopped_at: None,
            late_dropped_before: 0,
            commits: 0,
            replica: None,
            commit_breach: None,
            awaiting_rejoin: BTreeSet::new(),
        }
    }

    /// The guarantee to report for a breach of `guarantee` once a crash
    /// happened: an attempt id reused after a crash is G26's.
    pub(in crate::harness) fn relabel(
        &self,
        guarantee: GuaranteeId,
        detail: String,
    ) -> (GuaranteeId, String) {
        // G08, G21 and G23 keep their own ids after a crash: they are the
        // same guarantees (G26 names them), and a defect that breaks them
        // shrinks to the same id with or without the crash.
        let covered = guarantee == GuaranteeId::Identity;
        if self.crashes > 0 && covered {
            (
                GuaranteeId::CrashSafety,
                format!(
                    "after {} controller crash(es), {} broken: {detail}",
                    self.crashes,
                    guarantee.id()
                ),
            )
        } else {
            (guarantee, detail)
        }
    }
}

impl<S: Substrate> Harness<S> {
    /// A violation of `guarantee`, relabelled as G26 after a crash where G26
    /// covers it.
    pub(in crate::harness) fn crash_aware(
        &self,
        guarantee: GuaranteeId,
        detail: String,
    ) -> Violation {
        let (guarantee, detail) = self.durable.relabel(guarantee, detail);
        self.violation(breach(guarantee, detail))
    }
}
