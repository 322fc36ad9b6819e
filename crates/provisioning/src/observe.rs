//! Observations and how they fold into a node's record.
//!
//! Folding is the only place where lifecycle facts change. It computes every
//! deadline once, from the `now` of the observation, and stores it; the
//! decider only reads stored deadlines. The functions here work on a copy of
//! the node so that an error (a saturated clock) leaves the real node untouched.

use std::fmt;

use crate::effect::{EffectError, EffectKind, EffectOutput, EndpointLookup};
use crate::id::{LogicalNodeId, NodeAttemptId, OperationId};
use crate::policy::RetryPolicy;
use crate::state::{
    AmbiguousOperation, BootstrapFacts, BootstrapFailure, BootstrapProgress, BootstrapStage,
    EndpointFacts, FailureFacts, Intent, LeaseFacts, ManagedNode, NodeStage, SessionState,
    SwarmJoinFacts,
};
use crate::time::{ClockSaturated, Timestamp};

/// An asynchronous fact about one attempt, reported by a provider or the swarm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observation {
    /// An event of the attempt's bootstrap session.
    Bootstrap {
        /// The slot.
        node: LogicalNodeId,
        /// The attempt the event was produced for.
        attempt: NodeAttemptId,
        /// What happened.
        event: BootstrapEvent,
    },
    /// The attempt's agent or lease disappeared.
    NodeLost {
        /// The slot.
        node: LogicalNodeId,
        /// The attempt that was lost.
        attempt: NodeAttemptId,
        /// What is gone.
        cause: LossCause,
    },
    /// After a controller restart, the attempt's agent re-joined this
    /// (the new) controller: a node that was ready before the restart is
    /// ready again.
    AgentRejoined {
        /// The slot.
        node: LogicalNodeId,
        /// The attempt whose agent re-joined.
        attempt: NodeAttemptId,
    },
}

impl Observation {
    /// The slot the observation is about.
    pub fn node(&self) -> &LogicalNodeId {
        match self {
            Observation::Bootstrap { node, .. }
            | Observation::NodeLost { node, .. }
            | Observation::AgentRejoined { node, .. } => node,
        }
    }

    /// The attempt the observation is about.
    pub fn attempt(&self) -> NodeAttemptId {
        match self {
            Observation::Bootstrap { attempt, .. }
            | Observation::NodeLost { attempt, .. }
            | Observation::AgentRejoined { attempt, .. } => *attempt,
        }
    }
}

/// One event of a bootstrap session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BootstrapEvent {
    /// The session made progress.
    Progress(BootstrapProgress),
    /// The node's agent joined the run's swarm.
    Joined,
    /// The stream reported convergence.
    Converged,
    /// The session closed. After a join this is the handoff.
    Closed,
    /// The session failed at the given stage.
    Failed {
        /// The failing stage.
        failure: BootstrapFailure,
        /// What went wrong, for operators.
        detail: String,
    },
}

/// What disappeared from a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LossCause {
    /// The agent's swarm connection or process is gone.
    AgentGone,
    /// The provider reports that the lease no longer exists.
    LeaseGone,
    /// The node's workload exited while the node was meant to run it (how
    /// it ended is not known).
    WorkloadExited,
    /// The node's workload ended while the node was meant to run it, and
    /// the agent said how.
    WorkloadEnded(WorkloadEnd),
}

/// How a node's workload ended, as its agent saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkloadEnd {
    /// It exited with this status.
    Status(i32),
    /// This signal killed it.
    Signal(i32),
}

impl WorkloadEnd {
    /// From an exit's code and signal (as a wait status gives them); `None`
    /// when neither is known.
    pub fn from_parts(code: Option<i32>, signal: Option<i32>) -> Option<WorkloadEnd> {
        match (code, signal) {
            (Some(code), _) => Some(WorkloadEnd::Status(code)),
            (None, Some(signal)) => Some(WorkloadEnd::Signal(signal)),
            (None, None) => None,
        }
    }
}

impl fmt::Display for WorkloadEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkloadEnd::Status(code) => write!(f, "exited with status {code}"),
            WorkloadEnd::Signal(signal) => write!(f, "killed by signal {signal}"),
        }
    }
}

impl LossCause {
    /// The loss of a workload that ended as `code` and `signal` say (either
    /// may be unknown).
    pub fn workload(code: Option<i32>, signal: Option<i32>) -> LossCause {
        WorkloadEnd::from_parts(code, signal)
            .map_or(LossCause::WorkloadExited, LossCause::WorkloadEnded)
    }

    /// Whether the node's workload ended (however).
    pub fn is_workload_exit(&self) -> bool {
        matches!(
            self,
            LossCause::WorkloadExited | LossCause::WorkloadEnded(_)
        )
    }
}

impl fmt::Display for LossCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossCause::AgentGone => "the node's agent is gone",
            LossCause::LeaseGone => "the node's lease is gone",
            LossCause::WorkloadExited => "the node's workload exited",
            LossCause::WorkloadEnded(end) => return write!(f, "workload {end}"),
        })
    }
}

/// What a fold needs besides the node.
pub(crate) struct FoldContext<'a> {
    pub(crate) policy: &'a RetryPolicy,
    pub(crate) now: Timestamp,
    /// Whether the node's spec equals the desired spec of its slot.
    pub(crate) spec_is_desired: bool,
    /// Whether the operation reached the provider: `false` for one the
    /// host's sink refused, whose failure says nothing of what the provider
    /// did.
    pub(crate) sent: bool,
}

impl FoldContext<'_> {
    fn after(&self, delay: std::time::Duration) -> Result<Timestamp, ClockSaturated> {
        self.now.checked_add(delay)
    }

    fn backoff_deadline(&self, node: &ManagedNode) -> Result<Timestamp, ClockSaturated> {
        self.after(
            self.policy
                .backoff(node.retry.consecutive_failures, node.attempt),
        )
    }

    fn cleanup_backoff_deadline(&self, node: &ManagedNode) -> Result<Timestamp, ClockSaturated> {
        self.after(
            self.policy
                .cleanup_backoff(node.retry.consecutive_failures, node.attempt),
        )
    }
}

/// Whether folding `outcome` of a `kind` operation may fail. A fold fails
/// only when a deadline it computes does not fit the clock, and only a
/// failure or a not-yet-ready endpoint computes one; every other fold may be
/// applied to the node in place, without a copy to fall back on.
pub(crate) fn operation_fold_may_fail(
    kind: EffectKind,
    outcome: Result<&EffectOutput, &EffectError>,
) -> bool {
    !matches!(
        outcome,
        Ok(output) if output.kind() == kind
            && !matches!(output, EffectOutput::Endpoint(EndpointLookup::NotReady))
    )
}

/// Whether folding `observation` into `node` may fail (see
/// [`operation_fold_may_fail`]): a loss, a failure, or a close before the
/// join fail the attempt, which computes its restart deadline.
pub(crate) fn observation_fold_may_fail(node: &ManagedNode, observation: &Observation) -> bool {
    match observation {
        Observation::Bootstrap { event, .. } => match event {
            BootstrapEvent::Progress(_) | BootstrapEvent::Joined | BootstrapEvent::Converged => {
                false
            }
            BootstrapEvent::Closed => node.record.swarm.is_none(),
            BootstrapEvent::Failed { .. } => true,
        },
        Observation::NodeLost { .. } => true,
        Observation::AgentRejoined { .. } => false,
    }
}

/// Everything a fold that cannot fail may change in a node (see
/// [`observation_fold_may_fail`]): comparing it before and after tells
/// whether such a fold changed the node, without a copy of the node.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct FoldableCondition {
    stage: NodeStage,
    ready: bool,
    bootstrap: Option<(SessionState, BootstrapStage, bool, bool)>,
    joined_at: Option<Timestamp>,
    handed_off_at: Option<Timestamp>,
    rejoin_by: Option<Timestamp>,
    ambiguous: Option<(OperationId, EffectKind)>,
    next_effect_at: Option<Timestamp>,
    consecutive_failures: u32,
}

impl FoldableCondition {
    pub(crate) fn of(node: &ManagedNode) -> Self {
        let record = &node.record;
        FoldableCondition {
            stage: record.stage,
            ready: record.ready,
            bootstrap: record.bootstrap.as_ref().map(|b| {
                (
                    b.state,
                    b.stage,
                    b.session.is_some(),
                    b.convergence_observed,
                )
            }),
            joined_at: record.swarm.as_ref().map(|s| s.joined_at),
            handed_off_at: record.handed_off_at,
            rejoin_by: record.rejoin_by,
            ambiguous: node.retry.ambiguous.as_ref().map(|a| (a.op, a.kind)),
            next_effect_at: node.retry.next_effect_at,
            consecutive_failures: node.retry.consecutive_failures,
        }
    }
}

/// Folds the outcome of the node's pending operation `op` of kind `kind`.
/// The caller checked that `op` is pending; this clears it.
pub(crate) fn fold_operation(
    node: &mut ManagedNode,
    op: OperationId,
    kind: EffectKind,
    outcome: Result<&EffectOutput, &EffectError>,
    ctx: &FoldContext<'_>,
) -> Result<(), ClockSaturated> {
    node.pending = None;
    match outcome {
        Ok(output) if output.kind() == kind => fold_success(node, output, ctx),
        Ok(output) => {
            // A backend that answers the wrong question may still have acted.
            let error = EffectError::ambiguous(format!(
                "backend answered {} to a {} request",
                output.kind(),
                kind
            ));
            fold_failure(node, op, kind, &error, ctx)
        }
        Err(error) => fold_failure(node, op, kind, error, ctx),
    }
}

fn clear_ambiguous(node: &mut ManagedNode, kind: EffectKind) {
    if node
        .retry
        .ambiguous
        .as_ref()
        .is_some_and(|a| a.kind == kind)
    {
        node.retry.ambiguous = None;
    }
}

fn fold_success(
    node: &mut ManagedNode,
    output: &EffectOutput,
    ctx: &FoldContext<'_>,
) -> Result<(), ClockSaturated> {
    let attempt = node.attempt;
    let record = &mut node.record;
    node.retry.next_effect_at = None;
    match output {
        EffectOutput::LeaseCreated {
            lease,
            endpoint,
            adopted,
        } => {
            record.lease = Some(LeaseFacts {
                attempt,
                lease: lease.clone(),
                observed_at: ctx.now,
                adopted: *adopted,
            });
            if let Some(endpoint) = endpoint {
                record.endpoint = Some(EndpointFacts {
                    attempt,
                    endpoint: endpoint.clone(),
                    observed_at: ctx.now,
                });
            }
            if matches!(record.stage, NodeStage::New | NodeStage::LeaseRequested) {
                record.stage = if record.endpoint.is_some() {
                    NodeStage::EndpointKnown
                } else {
                    NodeStage::LeaseCreated
                };
            }
            clear_ambiguous(node, EffectKind::CreateLease);
        }
        EffectOutput::Endpoint(EndpointLookup::Ready(endpoint)) => {
            record.endpoint = Some(EndpointFacts {
                attempt,
                endpoint: endpoint.clone(),
                observed_at: ctx.now,
            });
            if record.stage == NodeStage::LeaseCreated {
                record.stage = NodeStage::EndpointKnown;
            }
        }
        EffectOutput::Endpoint(EndpointLookup::NotReady) => {
            // A probe, not a failure: the failure count stays as it is.
            node.retry.next_effect_at = Some(ctx.after(ctx.policy.endpoint_probe_interval)?);
        }
        EffectOutput::BootstrapStarted { session, .. } => {
            match &mut record.bootstrap {
                Some(facts) => {
                    // Stream events arrived before the start result; keep them.
                    if facts.session.is_none() {
                        facts.session = Some(session.clone());
                    }
                }
                None => {
                    record.bootstrap = Some(BootstrapFacts {
                        attempt,
                        session: Some(session.clone()),
                        state: SessionState::Active,
                        stage: BootstrapStage::Progress(BootstrapProgress::Created),
                        convergence_observed: false,
                    });
                }
            }
            if record.stage == NodeStage::EndpointKnown {
                record.stage = NodeStage::BootstrapRunning;
            }
            clear_ambiguous(node, EffectKind::StartBootstrap);
        }
        EffectOutput::ConvergenceAcknowledged => {
            if let Some(facts) = &mut record.bootstrap {
                facts.convergence_observed = true;
            }
        }
        EffectOutput::BootstrapCancelled => {
            if let Some(facts) = &mut record.bootstrap {
                facts.state = SessionState::Cancelled;
                facts.stage = BootstrapStage::Cancelled;
            }
        }
        EffectOutput::LeaseDestroyed => {
            record.lease = None;
            record.endpoint = None;
        }
    }
    Ok(())
}

fn fold_failure(
    node: &mut ManagedNode,
    op: OperationId,
    kind: EffectKind,
    error: &EffectError,
    ctx: &FoldContext<'_>,
) -> Result<(), ClockSaturated> {
    if kind == EffectKind::BootstrapConvergenceObserved && !node.record.session_active() {
        // The session already closed: the handoff happened (or the attempt
        // ended) and the report is moot. Its result only clears the pending
        // operation; counting it would give a ready node a backoff.
        return Ok(());
    }
    let deleting = node.intent == Intent::Deleting;
    node.retry.consecutive_failures = node.retry.consecutive_failures.saturating_add(1);
    node.retry.last_error = Some(format!("{kind}: {}", error.message));

    if kind.adopts_after_ambiguity() {
        if error.is_ambiguous() {
            node.retry.ambiguous = Some(Box::new(AmbiguousOperation { op, kind }));
        } else if ctx.sent {
            // A definite failure means the provider looked for a resource of
            // this key, found none and created none.
            clear_ambiguous(node, kind);
        }
        // A refused submission never reached the provider: what an earlier
        // operation may have made stays remembered, to be adopted.
    }
    if kind == EffectKind::CreateLease && node.record.stage == NodeStage::LeaseRequested {
        node.record.stage = NodeStage::New;
    }

    // (A start the host refused did not fail: it is tried again after the
    // backoff.)
    if kind == EffectKind::StartBootstrap && !error.is_ambiguous() && ctx.sent {
        fail_attempt(
            node,
            format!("bootstrap did not start: {}", error.message),
            true,
            ctx,
        )?;
        if deleting {
            node.retry.next_effect_at = None;
        }
        return Ok(());
    }

    // A deleting node only waits after a failed cleanup step or an
    // ambiguous create/start; anything else lets cleanup go on at once.
    let backoff = !deleting
        || kind.is_cleanup()
        || (kind.adopts_after_ambiguity() && node.retry.ambiguous.is_some());
    node.retry.next_effect_at = if kind.is_cleanup() {
        // Bounded more tightly: the provider may answer again at any moment
        // (a partition heals), and the slot's replacement waits for it.
        Some(ctx.cleanup_backoff_deadline(node)?)
    } else if backoff {
        Some(ctx.backoff_deadline(node)?)
    } else {
        None
    };
    Ok(())
}

/// Marks the attempt failed. Cleanup starts in the next pass; only the
/// restart waits for the backoff.
fn fail_attempt(
    node: &mut ManagedNode,
    reason: String,
    failure_counted: bool,
    ctx: &FoldContext<'_>,
) -> Result<(), ClockSaturated> {
    if !failure_counted {
        node.retry.consecutive_failures = node.retry.consecutive_failures.saturating_add(1);
    }
    node.retry.restart_at = Some(ctx.backoff_deadline(node)?);
    node.retry.last_error = Some(reason.clone());
    node.record.stage = NodeStage::Failed;
    node.record.ready = false;
    // An attempt fails once: a later failure folded while it is torn down (a
    // cleanup step's, a re-issued start's) is its last error, not why it
    // failed, and its history keeps the reason it gave when it failed.
    if node.record.failure.is_none() {
        node.record.failure = Some(Box::new(FailureFacts {
            reason,
            at: ctx.now,
        }));
    }
    Ok(())
}

/// Why an observation was not folded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapRejection {
    /// No session was started or is being started for the attempt.
    #[error("no bootstrap session was started for this attempt")]
    NoSession,
    /// The session already closed or was cancelled.
    #[error("the bootstrap session already ended")]
    SessionEnded,
    /// The attempt already failed (its session reported a failure, closed
    /// before the join, or the node was lost): late events of it change
    /// nothing, and cleanup still cancels the session.
    #[error("the attempt already failed; late bootstrap events are ignored")]
    AttemptFailed,
}

/// Folds a bootstrap event for the node's current attempt.
pub(crate) fn fold_bootstrap(
    node: &mut ManagedNode,
    event: &BootstrapEvent,
    ctx: &FoldContext<'_>,
) -> Result<Result<(), BootstrapRejection>, ClockSaturated> {
    let attempt = node.attempt;
    let starting = node
        .pending
        .as_ref()
        .is_some_and(|p| p.kind == EffectKind::StartBootstrap)
        || node
            .retry
            .ambiguous
            .as_ref()
            .is_some_and(|a| a.kind == EffectKind::StartBootstrap);
    if node.record.failure.is_some() {
        // A failed attempt is being cleaned up. Folding a late join would give
        // it swarm facts it never keeps, and a late close would make cleanup
        // skip the cancel of a session that may still run.
        return Ok(Err(BootstrapRejection::AttemptFailed));
    }
    match &node.record.bootstrap {
        Some(facts) if facts.state != SessionState::Active => {
            return Ok(Err(BootstrapRejection::SessionEnded));
        }
        Some(_) => {}
        None if starting => {
            node.record.bootstrap = Some(BootstrapFacts {
                attempt,
                session: None,
                state: SessionState::Active,
                stage: BootstrapStage::Progress(BootstrapProgress::Created),
                convergence_observed: false,
            });
        }
        None => return Ok(Err(BootstrapRejection::NoSession)),
    }
    // An event of this attempt's session is evidence that the session
    // exists: it answers a remembered ambiguous start, so cleanup cancels
    // the session instead of starting it again.
    clear_ambiguous(node, EffectKind::StartBootstrap);
    let running = node.record.stage == NodeStage::EndpointKnown;
    let Some(facts) = node.record.bootstrap.as_mut() else {
        return Ok(Err(BootstrapRejection::NoSession));
    };
    match event {
        BootstrapEvent::Progress(progress) => {
            facts.stage = BootstrapStage::Progress(*progress);
            if running {
                node.record.stage = NodeStage::BootstrapRunning;
            }
        }
        BootstrapEvent::Converged => {
            facts.stage = BootstrapStage::Converged;
            // Like any event of the session, a convergence report before the
            // start's answer shows the session runs.
            if running {
                node.record.stage = NodeStage::BootstrapRunning;
            }
        }
        BootstrapEvent::Joined => {
            if node.record.swarm.is_none() {
                node.record.swarm = Some(SwarmJoinFacts {
                    attempt,
                    joined_at: ctx.now,
                });
            }
            if running || node.record.stage == NodeStage::BootstrapRunning {
                node.record.stage = NodeStage::SwarmJoined;
            }
        }
        BootstrapEvent::Closed => {
            facts.state = SessionState::Closed;
            facts.stage = BootstrapStage::Closed;
            if node.record.swarm.is_some() {
                hand_off(node, ctx);
            } else {
                fail_attempt(
                    node,
                    "bootstrap session closed before the agent joined".to_owned(),
                    false,
                    ctx,
                )?;
            }
        }
        BootstrapEvent::Failed { failure, detail } => {
            facts.stage = BootstrapStage::Failed(*failure);
            fail_attempt(
                node,
                format!("bootstrap failed: {failure}: {detail}"),
                false,
                ctx,
            )?;
        }
    }
    Ok(Ok(()))
}

/// The session closed after the join: the node is handed off. A node being
/// cleaned up keeps its stored backoff: a failed cleanup step still waits.
fn hand_off(node: &mut ManagedNode, ctx: &FoldContext<'_>) {
    node.record.stage = NodeStage::Dormant;
    node.record.handed_off_at = Some(ctx.now);
    if node.intent != Intent::Active {
        return;
    }
    node.retry.next_effect_at = None;
    if ctx.spec_is_desired {
        node.record.ready = true;
        node.retry.consecutive_failures = 0;
    }
}

/// Folds the loss of a node's agent or lease. A node being torn down is
/// expected to disappear; that changes nothing.
pub(crate) fn fold_loss(
    node: &mut ManagedNode,
    cause: LossCause,
    ctx: &FoldContext<'_>,
) -> Result<(), ClockSaturated> {
    if node.intent == Intent::Deleting || node.record.stage == NodeStage::Failed {
        return Ok(());
    }
    fail_attempt(node, cause.to_string(), false, ctx)
}

/// Folds the re-join of a node's agent after a controller restart: a
/// rejoining node is ready again (dormant), as it was before the restart.
/// Any other node is left as it is: an agent may re-dial a controller it
/// never left, and that says nothing new.
pub(crate) fn fold_rejoin(node: &mut ManagedNode, ctx: &FoldContext<'_>) {
    if node.record.stage != NodeStage::Rejoining {
        return;
    }
    node.record.stage = NodeStage::Dormant;
    node.record.rejoin_by = None;
    // A rejoining node is active (a teardown ends the rejoin); its spec may
    // have drifted since the restart, and then it is torn down, not ready.
    node.record.ready = node.intent == Intent::Active && ctx.spec_is_desired;
}

/// Marks a node the journal held as ready as rejoining, at recovery: not
/// ready until its agent re-joins the new controller, lost at `rejoin_by`.
pub(crate) fn await_rejoin(node: &mut ManagedNode, rejoin_by: Timestamp) {
    node.record.stage = NodeStage::Rejoining;
    node.record.ready = false;
    node.record.rejoin_by = Some(rejoin_by);
}

/// The reason a rejoining node is lost when its window ends.
pub(crate) fn rejoin_expired_reason(window: std::time::Duration) -> String {
    format!(
        "the node's agent did not re-join the restarted controller within {} s",
        window.as_secs()
    )
}

/// The rejoin window of a rejoining node ended with no re-join: the node is
/// lost, and the ladder replaces it as any lost node.
pub(crate) fn expire_rejoin(
    node: &mut ManagedNode,
    ctx: &FoldContext<'_>,
) -> Result<(), ClockSaturated> {
    if node.record.stage != NodeStage::Rejoining {
        return Ok(());
    }
    node.record.rejoin_by = None;
    fail_attempt(
        node,
        rejoin_expired_reason(ctx.policy.rejoin_window),
        false,
        ctx,
    )
}

/// A rejoining node whose teardown begins is no longer waiting for its
/// agent: it is dormant and not ready, as any node torn down.
pub(crate) fn end_rejoin(node: &mut ManagedNode) {
    if node.record.stage == NodeStage::Rejoining {
        node.record.stage = NodeStage::Dormant;
    }
    node.record.rejoin_by = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::test_node;

    /// Kit finding 12 (G32 stage coherence): a failure folded while a failed
    /// attempt is torn down replaced the reason its history entry gave.
    #[test]
    fn an_attempt_keeps_the_reason_it_failed_for_and_a_later_failure_is_its_last_error() {
        let policy = RetryPolicy::default();
        let ctx = |ms| FoldContext {
            policy: &policy,
            now: Timestamp::from_millis(ms),
            spec_is_desired: false,
            sent: true,
        };
        let mut node = test_node(0, 1);
        fail_attempt(&mut node, "boot check failed".into(), false, &ctx(10)).unwrap();
        fail_attempt(&mut node, "start refused".into(), true, &ctx(20)).unwrap();
        let failure = node.record.failure.as_ref().expect("failed");
        assert_eq!(failure.reason, "boot check failed");
        assert_eq!(failure.at, Timestamp::from_millis(10));
        assert_eq!(node.retry.last_error.as_deref(), Some("start refused"));
        assert_eq!(node.record.stage, NodeStage::Failed);
    }
}
