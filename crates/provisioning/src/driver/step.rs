//! One node's step in a pass: a driver transition (insert, restart, begin
//! teardown, mark destroyed, reap), or an operation recorded pending —
//! deadline stored, sequence advanced — *before* it is handed to the
//! [`OperationSink`]. A refused submission is folded at once as a definite
//! failure the provider never saw.

use super::ClusterDriver;
use super::error::NodeError;
use super::report::PassReport;
use super::sink::OperationSink;
use crate::decide::NodeAction;
use crate::effect::{EffectError, EffectKind, EffectRequest, Operation};
use crate::history::Transition;
use crate::id::{LogicalNodeId, OperationId};
use crate::observe::{FoldContext, end_rejoin, expire_rejoin};
use crate::state::{Intent, ManagedNode, NodeStage, PendingOperation, RetryState};
use crate::time::Timestamp;

impl ClusterDriver {
    pub(super) fn transition(
        &mut self,
        id: &LogicalNodeId,
        action: NodeAction,
        now: Timestamp,
        sink: &mut dyn OperationSink,
    ) -> Result<(), NodeError> {
        let teardown_reason = (action == NodeAction::BeginDelete).then(|| self.teardown_reason(id));
        match action {
            NodeAction::Insert | NodeAction::Restart => {
                let Some(spec) = self.desired.spec(id) else {
                    return Ok(());
                };
                let retry = RetryState {
                    consecutive_failures: self
                        .state
                        .nodes
                        .get(id)
                        .map_or(0, |n| n.retry.consecutive_failures),
                    ..RetryState::default()
                };
                let attempt = self.state.attempts.allocate()?;
                self.meta_changed();
                let node = ManagedNode::new(spec, attempt, retry);
                self.note_history(id, &node, now);
                if action == NodeAction::Insert {
                    // Merged into the map at the end of the pass.
                    self.inserted.push((id.clone(), Box::new(node)));
                } else {
                    self.state.nodes.insert(id.clone(), Box::new(node));
                }
            }
            NodeAction::Reap => {
                self.state.nodes.remove(id);
                self.history.remove(id);
                self.schedule.forget(id);
                self.node_changed(id);
                return Ok(());
            }
            NodeAction::BeginDelete => {
                if let Some(node) = self.state.nodes.get_mut(id) {
                    node.intent = Intent::Deleting;
                    node.record.ready = false;
                    end_rejoin(node);
                    if node.retry.ambiguous.is_none() {
                        node.retry.next_effect_at = None;
                    }
                }
            }
            NodeAction::MarkDestroyed => {
                if let Some(node) = self.state.nodes.get_mut(id) {
                    node.record.stage = NodeStage::Destroyed;
                    node.record.destroyed_at = Some(now);
                    node.record.ready = false;
                    node.record.endpoint = None;
                    node.retry.next_effect_at = None;
                    sink.attempt_retired(node.attempt);
                }
            }
            NodeAction::ExpireRejoin => {
                let Some(node) = self.state.nodes.get_mut(id) else {
                    return Ok(());
                };
                let ctx = FoldContext {
                    policy: &self.policy,
                    now,
                    spec_is_desired: false,
                    sent: true,
                };
                // Worked on a copy: a restart deadline that does not fit
                // the clock leaves the node as it was.
                let mut lost = (**node).clone();
                expire_rejoin(&mut lost, &ctx)?;
                **node = lost;
                // A lost node counts toward its group's breaker, as a loss
                // the provider reports does.
                self.limit_events(id, (false, false), (true, false), now);
            }
            NodeAction::None | NodeAction::Dispatch(_) => return Ok(()),
        }
        if self.history_depth > 0
            && !matches!(action, NodeAction::Insert | NodeAction::Restart)
            && let Some(node) = self.state.nodes.get(id)
        {
            // A node lost at the end of its rejoin window names why.
            let reason = teardown_reason.or_else(|| {
                (action == NodeAction::ExpireRejoin)
                    .then(|| node.record.failure.as_ref().map(|f| f.reason.clone()))
                    .flatten()
            });
            let entry = Transition::of(node, now, reason);
            let depth = self.history_depth;
            self.history
                .entry(id.clone())
                .or_default()
                .note(entry, depth);
        }
        self.touch(id);
        Ok(())
    }

    /// Why a teardown of `id` begins, in words (for its history). A failed
    /// attempt names its failure first, even when its slot was also scaled
    /// away or drifted: the entry shows the `Failed` stage, and the reason
    /// must say what failed.
    fn teardown_reason(&self, id: &LogicalNodeId) -> String {
        let Some(node) = self.state.nodes.get(id) else {
            return "torn down".to_owned();
        };
        if let Some(failure) = &node.record.failure {
            return format!("failed: {}", failure.reason);
        }
        match self.desired.spec(id) {
            None => "scaled down: the slot is no longer desired".to_owned(),
            Some(spec) if spec != node.spec => "drifted: the group's spec changed".to_owned(),
            Some(_) => "torn down".to_owned(),
        }
    }

    pub(super) fn dispatch(
        &mut self,
        id: &LogicalNodeId,
        kind: EffectKind,
        now: Timestamp,
        sink: &mut dyn OperationSink,
        report: &mut PassReport,
    ) -> Result<(), NodeError> {
        let run_id = self.desired.run_id().clone();
        let timeout = self.policy.operation_timeout;
        let Some(node) = self.state.nodes.get_mut(id) else {
            return Ok(());
        };
        let request = build_request(node, kind)?;
        let deadline = now.checked_add(timeout)?;
        let sequence = node.next_sequence;
        let next_sequence = sequence.next()?;
        let op = OperationId::new(node.attempt, sequence);
        node.next_sequence = next_sequence;
        let pending = PendingOperation {
            id: op,
            kind,
            dispatched_at: now,
            deadline,
        };
        node.pending = Some(pending.clone());
        if kind == EffectKind::CreateLease && node.record.stage == NodeStage::New {
            node.record.stage = NodeStage::LeaseRequested;
            if self.history_depth > 0 {
                let entry = Transition::of(node, now, None);
                let depth = self.history_depth;
                self.history
                    .entry(id.clone())
                    .or_default()
                    .note(entry, depth);
            }
        }
        if kind == EffectKind::CreateLease {
            let provider = &node.spec.template().provider;
            match self.limit_state.creates_in_flight.get_mut(provider) {
                Some(n) => *n += 1,
                None => {
                    self.limit_state
                        .creates_in_flight
                        .insert(provider.clone(), 1);
                }
            }
        }
        let operation = Operation {
            id: op,
            run_id,
            node: id.clone(),
            spec: node.spec.clone(),
            request,
        };
        self.schedule
            .deadlines
            .insert(deadline, id, &self.state.nodes);
        self.node_changed(id);
        if let Err(refused) = sink.submit(operation) {
            report.refused += 1;
            let error = EffectError::definite(format!("submission refused: {refused}"));
            // Folded at once, while the pass is open: the touch makes sure
            // exactly one more pass follows. The provider never saw it.
            self.fold_pending_as(id, &pending, Err(&error), now, false)?;
        } else {
            report.dispatched += 1;
        }
        Ok(())
    }
}

fn build_request(node: &ManagedNode, kind: EffectKind) -> Result<EffectRequest, NodeError> {
    let missing = |what| NodeError::MissingFact {
        kind,
        missing: what,
    };
    let lease = || {
        node.record
            .lease
            .as_ref()
            .map(|l| l.lease.clone())
            .ok_or_else(|| missing("lease"))
    };
    let session = || {
        node.record
            .bootstrap
            .as_ref()
            .and_then(|b| b.session.clone())
    };
    Ok(match kind {
        EffectKind::CreateLease => EffectRequest::CreateLease,
        EffectKind::LookupEndpoint => EffectRequest::LookupEndpoint { lease: lease()? },
        EffectKind::StartBootstrap => EffectRequest::StartBootstrap {
            lease: lease()?,
            endpoint: node
                .record
                .endpoint
                .as_ref()
                .map(|e| e.endpoint.clone())
                .ok_or_else(|| missing("endpoint"))?,
        },
        EffectKind::BootstrapConvergenceObserved => {
            EffectRequest::BootstrapConvergenceObserved { session: session() }
        }
        EffectKind::CancelBootstrap => EffectRequest::CancelBootstrap { session: session() },
        EffectKind::DestroyLease => EffectRequest::DestroyLease { lease: lease()? },
    })
}
