//! Readiness re-earned after a crash (G37): which nodes the new controller
//! must see re-join before it may count them ready, the substrate's
//! re-joins of their agents, and the check.

use std::collections::BTreeSet;

use provisioning::{DurableState, LogicalNodeId, NodeAttemptId, NodeStage};

use crate::guarantee::Violation;
use crate::harness::Harness;
use crate::oracle;
use crate::substrate::Substrate;

/// The nodes a journal holds as ready (or rejoining since an earlier
/// restart): after a recovery from it, each must re-earn its readiness.
pub(in crate::harness) fn held_ready(
    stored: &DurableState,
) -> BTreeSet<(LogicalNodeId, NodeAttemptId)> {
    stored
        .nodes
        .iter()
        .filter(|e| {
            let node = &e.node;
            node.intent == provisioning::Intent::Active
                && (node.record.stage == NodeStage::Rejoining
                    || (node.record.ready
                        && matches!(node.record.stage, NodeStage::HandedOff | NodeStage::Dormant)))
        })
        .map(|e| (e.node.node.clone(), e.node.attempt))
        .collect()
}

impl<S: Substrate> Harness<S> {
    /// Lets the live agents of the nodes awaiting their re-join re-join the
    /// new controller (those of even slot indices only, when `even_only`:
    /// the fair tail lets the others' window end). Returns how many the
    /// substrate reported.
    pub(in crate::harness) fn rejoin_agents(&mut self, even_only: bool) -> usize {
        let waiting: Vec<(LogicalNodeId, NodeAttemptId)> = self
            .durable
            .awaiting_rejoin
            .iter()
            .filter(|(id, attempt)| {
                (!even_only || id.index() % 2 == 0)
                    && self.driver.state().node(id).is_some_and(|n| {
                        n.attempt == *attempt && n.record.stage == NodeStage::Rejoining
                    })
            })
            .cloned()
            .collect();
        waiting
            .into_iter()
            .filter(|(id, attempt)| self.substrate.rejoin(id, *attempt))
            .count()
    }

    /// The kit folded the re-join of `node`'s agent `attempt`.
    pub(in crate::harness) fn rejoin_folded(
        &mut self,
        node: &LogicalNodeId,
        attempt: NodeAttemptId,
    ) {
        if self
            .durable
            .awaiting_rejoin
            .remove(&(node.clone(), attempt))
        {
            self.vacuity.rejoined_after_recovery += 1;
        }
    }

    /// G37 after an input or a recovery: nodes that no longer run the
    /// attempt they were recovered with await nothing (a node lost at the
    /// end of its window is counted); every other must not be ready, nor
    /// the driver converged, before its re-join was folded.
    pub(in crate::harness) fn check_rejoins(&mut self) -> Result<(), Violation> {
        if self.durable.awaiting_rejoin.is_empty() {
            return Ok(());
        }
        let state = self.driver.state();
        let mut expired = 0;
        self.durable.awaiting_rejoin.retain(|(id, attempt)| {
            let Some(node) = state.node(id).filter(|n| n.attempt == *attempt) else {
                return false;
            };
            if let Some(failure) = &node.record.failure {
                if failure.reason.contains("did not re-join") {
                    expired += 1;
                }
                return false;
            }
            node.intent == provisioning::Intent::Active
        });
        self.vacuity.rejoin_windows_expired += expired;
        let verdict = oracle::g37_readiness_is_re_earned(
            self.driver.state(),
            &self.durable.awaiting_rejoin,
            self.driver.is_converged(),
        );
        self.check(verdict)
    }
}
