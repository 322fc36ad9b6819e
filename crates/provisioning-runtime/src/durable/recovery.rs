//! Recovery: the driver recovered from the journal when a durable host
//! starts, and, before the first pass of a resumed run, every provider's
//! listing held against the journal. A journaled lease of a current attempt
//! that its provider no longer lists is a lost node (the ladder replaces
//! it); a listed resource no current attempt owns is an orphan suspect.

use std::collections::BTreeSet;

use provisioning::{ClusterDriver, LossCause, Observation, RetryPolicy, RunId, Timestamp};

use super::durability::{Durability, DurabilityError};
use super::host_side::DurableLoop;
use super::orphans::{Listing, Orphans, owned};
use crate::fold::fold_observation;

impl DurableLoop {
    /// The durable side of a host starting over `durability`, with the
    /// driver recovered from its committed state (`None` when the journal
    /// holds none: the host starts a fresh driver).
    ///
    /// # Errors
    /// [`DurabilityError::Recovery`] when the committed state cannot be
    /// recovered.
    pub(crate) fn open(
        mut durability: Durability,
        run_id: &RunId,
        policy: RetryPolicy,
    ) -> Result<(Option<ClusterDriver>, DurableLoop), DurabilityError> {
        let mut resumed = false;
        let recovered = match durability.resume.take() {
            Some(stored) => {
                let (driver, report) =
                    ClusterDriver::recover(run_id, stored, policy, Timestamp::ZERO)?;
                if durability.unclean {
                    tracing::info!(
                        run = %run_id,
                        generation = report.generation.get(),
                        nodes = report.nodes,
                        pending = report.pending_made_ambiguous,
                        "resuming from the journal"
                    );
                } else {
                    tracing::info!(
                        generation = report.generation.get(),
                        next_attempt = driver.state().attempts.next_unallocated(),
                        "a clean start; generations and attempts continue from the journal"
                    );
                }
                if report.allocator_raised {
                    tracing::warn!("the journal's attempt mark was below a stored attempt; raised");
                }
                resumed = durability.unclean;
                Some(driver)
            }
            None => None,
        };
        let (reports_tx, reports) = tokio::sync::mpsc::unbounded_channel();
        let orphans = Orphans::new(
            durability.orphan_grace,
            durability.orphan_scan_interval,
            reports_tx,
        );
        let durable = DurableLoop {
            journal: durability.journal,
            codec: durability.codec,
            journal_error: None,
            orphans,
            reports,
            resumed,
            lost_at_recovery: 0,
        };
        Ok((recovered, durable))
    }

    /// Holds the first listing of a resumed run (`listing`, taken at `now`)
    /// against the recovered driver: journaled nodes their provider no
    /// longer lists are folded as lost, listed resources no current attempt
    /// owns become orphan suspects.
    pub(crate) fn reconcile_listing(
        &mut self,
        listing: &Listing,
        driver: &mut ClusterDriver,
        run: &RunId,
        now: Timestamp,
    ) {
        let mut adopted = 0_usize;
        let mut lost = Vec::new();
        for (kind, listed) in listing {
            let listed = match listed {
                Ok(listed) => listed,
                Err(error) => {
                    tracing::warn!(provider = %kind, "cannot list the provider's nodes at recovery: {error}");
                    continue;
                }
            };
            let keys: BTreeSet<_> = listed.iter().map(|n| &n.key).collect();
            for node in listed {
                if &node.key.run_id != run {
                    continue;
                }
                if owned(driver.state(), &node.key) {
                    adopted += 1;
                } else {
                    self.orphans.seed(kind, node);
                }
            }
            for (id, node) in &driver.state().nodes {
                let ours = node.spec.template().provider == *kind;
                let leased = node
                    .record
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.attempt == node.attempt);
                if !ours || !leased || node.record.stage == provisioning::NodeStage::Destroyed {
                    continue;
                }
                let key = provisioning_provider::AttemptKey {
                    run_id: run.clone(),
                    node: id.clone(),
                    attempt: node.attempt,
                };
                if !keys.contains(&key) {
                    lost.push((id.clone(), node.attempt));
                }
            }
        }
        self.lost_at_recovery = lost.len() as u64;
        for (node, attempt) in lost {
            tracing::info!(%node, %attempt, "journaled node no longer listed by its provider: lost");
            let observation = Observation::NodeLost {
                node,
                attempt,
                cause: LossCause::LeaseGone,
            };
            fold_observation(driver, &observation, now);
        }
        tracing::info!(
            adopted,
            lost = self.lost_at_recovery,
            orphans = self.orphans.suspected(),
            "recovery listing reconciled"
        );
    }
}
