//! Recovery: a driver rebuilt from a committed durable state after the
//! controller that wrote it stopped, cleanly or not.

use std::collections::{BTreeMap, BTreeSet};

use super::ClusterDriver;
use crate::durable::{
    DURABLE_FORMAT, DurableEntry, DurableState, RecoveryError, RecoveryReport, Shift,
};
use crate::effect::{EffectError, EffectKind};
use crate::id::{AttemptAllocator, LogicalNodeId, OperationId, RunId};
use crate::observe::await_rejoin;
use crate::policy::RetryPolicy;
use crate::shape::LogicalNodeSpec;
use crate::state::{ClusterState, ManagedNode, NodeStage};
use crate::time::Timestamp;

impl ClusterDriver {
    /// Rebuilds a driver from a committed durable state, after the
    /// controller that wrote it stopped (cleanly or not).
    ///
    /// - The allocator resumes at the stored mark (above every stored
    ///   attempt), so no attempt id is handed out twice across restarts.
    /// - Every stored instant moves onto the new clock by the distance
    ///   between the stored `written_at` and `now`, so a backoff keeps the
    ///   time it had left.
    /// - Every pending operation becomes ambiguous at `now` (its result is
    ///   unknown): the ladder re-issues it after backoff and the provider
    ///   adopts what it may have made; cleanup steps are simply retried.
    /// - Every bootstrap session that had not handed off loses its stream
    ///   (it went to the controller that died): its facts are dropped and its
    ///   start becomes ambiguous, so it is re-issued at once and adopted.
    /// - Every node the journal held as ready is *rejoining*: readiness is
    ///   re-earned, never taken on the journal's word. It is not ready (and
    ///   the cluster not converged) until an
    ///   [`Observation::AgentRejoined`](crate::Observation::AgentRejoined)
    ///   of the new controller says its agent is there; with none by
    ///   `now + policy.rejoin_window` it is lost and replaced.
    ///
    /// The recovered driver tracks changes, and a full pass is queued.
    ///
    /// # Errors
    /// A [`RecoveryError`] for a state of another format or run, an invalid
    /// stored shape, or nodes stored twice; nothing is built.
    pub fn recover(
        run_id: &RunId,
        stored: DurableState,
        policy: RetryPolicy,
        now: Timestamp,
    ) -> Result<(ClusterDriver, RecoveryReport), RecoveryError> {
        let DurableState { meta, nodes } = stored;
        if meta.format != DURABLE_FORMAT {
            return Err(RecoveryError::UnsupportedFormat {
                found: meta.format,
                supported: DURABLE_FORMAT,
            });
        }
        if &meta.desired.run_id != run_id {
            return Err(RecoveryError::RunMismatch {
                expected: run_id.clone(),
                found: meta.desired.run_id.clone(),
            });
        }
        let desired = meta.desired.validate()?;
        let shift = Shift::between(meta.written_at, now);
        let mut report = RecoveryReport {
            generation: desired.generation(),
            ..RecoveryReport::default()
        };
        let mut map = BTreeMap::new();
        let mut attempts = BTreeSet::new();
        let mut highest = 0;
        for DurableEntry { mut node, template } in nodes {
            if !attempts.insert(node.attempt) {
                return Err(RecoveryError::DuplicateAttempt(node.attempt));
            }
            highest = highest.max(node.attempt.get());
            shift.node(&mut node);
            // Nodes of an unchanged group share the desired template, so
            // drift checks keep comparing pointers.
            let template = match desired.groups().get(node.node.group()) {
                Some(group) if *group.template() == template => group.template().clone(),
                _ => template,
            };
            let spec = LogicalNodeSpec::new(node.node.clone(), run_id.clone(), template);
            let managed = ManagedNode {
                spec,
                attempt: node.attempt,
                intent: node.intent,
                record: node.record,
                pending: node.pending,
                next_sequence: node.next_sequence,
                retry: node.retry,
            };
            if map.insert(node.node.clone(), Box::new(managed)).is_some() {
                return Err(RecoveryError::DuplicateNode(node.node));
            }
        }
        let mut next_attempt = meta.next_attempt;
        if highest >= next_attempt {
            next_attempt = highest.saturating_add(1);
            report.allocator_raised = true;
        }
        let state = ClusterState {
            observed_generation: meta.observed_generation,
            attempts: AttemptAllocator::with_limit(next_attempt, u64::MAX),
            nodes: map,
        };
        let mut driver = ClusterDriver::with_state(desired, state, policy);
        let mut breakers = meta.breakers;
        for breaker in breakers.values_mut() {
            shift.breaker(breaker);
        }
        driver.limit_state.breakers = breakers;
        driver.track_changes();
        if shift.is_zero()
            && let Some(changes) = &mut driver.changes
        {
            // The stored instants are on this clock already: only what
            // recovery itself changes needs writing again. On any other
            // clock everything is written again, moved: a meta written later
            // with this clock must not be read against instants of the old.
            changes.nodes.clear();
            changes.meta = report.allocator_raised;
            changes.written_breakers = driver.limit_state.breakers.clone();
        }
        report.nodes = driver.state.nodes.len();
        let pending: Vec<_> = driver
            .state
            .nodes
            .iter()
            .filter_map(|(id, n)| n.pending.clone().map(|p| (id.clone(), p)))
            .collect();
        let error = EffectError::ambiguous("the controller restarted; the outcome is unknown");
        for (id, op) in pending {
            driver.fold_pending(&id, &op, Err(&error), now)?;
            report.pending_made_ambiguous += 1;
        }
        // A session that had not handed off streamed to the controller that
        // died: nothing more will arrive for it. Its start becomes ambiguous,
        // so the ladder starts it again and the provider adopts the session
        // (and replays what it reports); cleanup re-issues it before it
        // cancels. The join is forgotten too: the agent joins the new
        // controller's swarm again.
        let streaming: Vec<LogicalNodeId> = driver
            .state
            .nodes
            .iter()
            .filter(|(_, n)| {
                n.record.failure.is_none()
                    && n.record.session_active()
                    && !matches!(
                        n.record.stage,
                        NodeStage::HandedOff | NodeStage::Dormant | NodeStage::Destroyed
                    )
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in streaming {
            if let Some(node) = driver.state.nodes.get_mut(&id) {
                let record = &mut node.record;
                record.bootstrap = None;
                record.swarm = None;
                record.stage = if record.endpoint.is_some() {
                    NodeStage::EndpointKnown
                } else if record.lease.is_some() {
                    NodeStage::LeaseCreated
                } else {
                    NodeStage::New
                };
                let last = node.next_sequence.get().saturating_sub(1).max(1);
                node.retry.ambiguous = Some(Box::new(crate::state::AmbiguousOperation {
                    op: OperationId::new(
                        node.attempt,
                        crate::id::OperationSequence::from_raw(last),
                    ),
                    kind: EffectKind::StartBootstrap,
                }));
                node.retry.next_effect_at = None;
                report.sessions_restarted += 1;
            }
            driver.touch(&id);
        }
        // Readiness is re-earned: the journal saw the agent of a ready node
        // joined to the controller that died, which says nothing of the new
        // one. A node rejoining since an earlier restart keeps its stored
        // (shifted) deadline.
        let rejoin_by = now.checked_add(driver.policy.rejoin_window)?;
        let ready: Vec<LogicalNodeId> = driver
            .state
            .nodes
            .iter()
            .filter(|(_, n)| n.is_ready())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ready {
            if let Some(node) = driver.state.nodes.get_mut(&id) {
                await_rejoin(node, rejoin_by);
                report.rejoining += 1;
            }
            driver.touch(&id);
        }
        Ok((driver, report))
    }
}
