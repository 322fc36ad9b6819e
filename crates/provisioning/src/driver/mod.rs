//! The driver: sole writer of [`ClusterState`].
//!
//! The driver behaves like a single-key workqueue. Triggers queue one pass;
//! triggers while a pass is queued collapse; a trigger while a pass is open
//! guarantees exactly one more pass. A pass asks the decider about the nodes
//! that need it — nodes touched since the last pass and nodes whose stored
//! deadline fell due, or every node when a full pass was requested — applies
//! driver transitions, and records each operation pending *before* handing it
//! to an [`OperationSink`].
//!
//! This file holds the [`ClusterDriver`] type, its constructors, what it
//! shows of itself and the desired shape it is given. Its other parts each
//! live in a file of their own, every one an `impl ClusterDriver` block over
//! the fields declared here:
//!
//! - `schedule`: the workqueue — pass status, touched nodes, timers and the
//!   deadlines of pending operations;
//! - `fold`: folding results, timeouts and observations into the state;
//! - `pass`: planning a pass and applying it, and driving passes until none
//!   is queued;
//! - `step`: one node's step in a pass — a transition, or an operation
//!   recorded pending and handed to the sink;
//! - `gate`: the operator limits (launch caps, rollout budgets, breakers) as
//!   the driver applies them to a pass;
//! - `history`: what the driver notes in each node's history;
//! - `changes`: which nodes changed since a host last took them (one take,
//!   read through a [`DriverChangesView`]), and the durable form of the
//!   driver's memory;
//! - `membership`: the run's membership (its ready nodes) handed out
//!   whenever it changed;
//! - `recover`: a driver rebuilt from a committed durable state;
//! - `error`, `sink`, `report`: the driver's errors, the seam it hands
//!   operations to, and what it reports.

mod changes;
mod error;
mod fold;
mod gate;
mod history;
mod membership;
mod pass;
mod recover;
mod report;
mod schedule;
mod sink;
mod step;

use std::collections::BTreeMap;

use crate::decide::{Slot, walk_slots};
use crate::durable::ChangeTracker;
use crate::effect::EffectKind;
use crate::history::NodeHistory;
use crate::id::{Generation, LogicalNodeId, RunId};
use crate::limits::{LimitState, Limits};
use crate::membership::MembershipTracker;
use crate::policy::RetryPolicy;
use crate::shape::{ClusterShape, DesiredState};
use crate::state::{ClusterState, ManagedNode};
use crate::steady::SteadySlots;
use crate::time::Timestamp;

pub use changes::DriverChangesView;
pub use error::{DriverError, NodeError, Rejection};
pub use report::{DriveReport, DriverCounters, PassPlan, PassReport};
pub use schedule::DueOperation;
use schedule::Schedule;
pub use sink::{OperationSink, SubmitError};

/// The most passes one [`ClusterDriver::drive_until_blocked`] call runs. A
/// node needs at most four consecutive passes without outside input
/// (mark destroyed, restart, dispatch); more means something keeps re-queueing.
pub const MAX_PASSES_PER_DRIVE: u32 = 16;

/// The outcome of [`ClusterDriver::update_desired`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DesiredUpdate {
    /// The same generation with identical content: nothing to do.
    Unchanged,
    /// A new generation was accepted and a pass queued.
    Accepted,
}

/// The sole writer of [`ClusterState`]: folds observations, runs passes and
/// records operations pending before dispatch.
#[derive(Debug)]
pub struct ClusterDriver {
    desired: DesiredState,
    state: ClusterState,
    policy: RetryPolicy,
    /// The workqueue: whether a pass is queued or open, and which nodes it
    /// looks at.
    schedule: Schedule,
    counters: DriverCounters,
    /// Nodes inserted by the open pass, in slot order, merged into the state
    /// when it ends.
    inserted: Vec<(LogicalNodeId, Box<ManagedNode>)>,
    /// `Some` once [`ClusterDriver::track_changes`] was called.
    changes: Option<ChangeTracker>,
    /// `Some` once [`ClusterDriver::track_membership`] was called.
    membership: Option<MembershipTracker>,
    limits: Limits,
    limit_state: LimitState,
    /// How many transitions each node keeps; 0 keeps no history.
    history_depth: usize,
    history: BTreeMap<LogicalNodeId, NodeHistory>,
    /// The slots a pass found in the ready steady state, unchanged since:
    /// a full pass counts them without reading their nodes.
    steady: SteadySlots,
}

impl ClusterDriver {
    /// A driver for `run_id` with an empty desired shape at generation 0.
    ///
    /// # Errors
    /// [`DriverError::InvalidShape`] when the run name is invalid.
    pub fn new(run_id: RunId, policy: RetryPolicy) -> Result<Self, DriverError> {
        let desired = ClusterShape::empty(run_id, Generation::default()).validate()?;
        Ok(ClusterDriver::with_state(
            desired,
            ClusterState::default(),
            policy,
        ))
    }

    /// A driver that starts from an existing state (for example one a test
    /// built by hand). A full pass is queued.
    pub fn with_state(desired: DesiredState, state: ClusterState, policy: RetryPolicy) -> Self {
        let mut driver = ClusterDriver {
            desired,
            state,
            policy,
            schedule: Schedule::default(),
            counters: DriverCounters::default(),
            inserted: Vec::new(),
            changes: None,
            membership: None,
            limits: Limits::default(),
            limit_state: LimitState::default(),
            history_depth: 0,
            history: BTreeMap::new(),
            steady: SteadySlots::default(),
        };
        for node in driver.state.nodes.values() {
            if node
                .pending
                .as_ref()
                .is_some_and(|p| p.kind == EffectKind::CreateLease)
            {
                *driver
                    .limit_state
                    .creates_in_flight
                    .entry(node.spec.template().provider.clone())
                    .or_default() += 1;
            }
        }
        for (id, node) in &driver.state.nodes {
            if let Some(pending) = &node.pending {
                driver
                    .schedule
                    .deadlines
                    .insert(pending.deadline, id, &driver.state.nodes);
            }
        }
        driver.trigger();
        driver
    }

    /// The observed state.
    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// The current desired state.
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// The run.
    pub fn run_id(&self) -> &RunId {
        self.desired.run_id()
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Counters since the driver was made.
    pub fn counters(&self) -> &DriverCounters {
        &self.counters
    }

    /// Whether a pass is queued (or will follow the open one).
    pub fn is_queued(&self) -> bool {
        self.schedule.is_queued()
    }

    /// Replaces the desired shape, enforcing the revision contract.
    ///
    /// # Errors
    /// [`DriverError::RunChanged`], [`DriverError::GenerationRegressed`],
    /// [`DriverError::ContentChangedWithoutGenerationBump`],
    /// [`DriverError::InvalidShape`] or [`DriverError::PassInProgress`]; in
    /// every case nothing changes.
    pub fn update_desired(&mut self, shape: ClusterShape) -> Result<DesiredUpdate, DriverError> {
        self.schedule.ensure_idle()?;
        let current = self.desired.shape();
        if shape.run_id != current.run_id {
            return Err(DriverError::RunChanged {
                expected: current.run_id.clone(),
                got: shape.run_id,
            });
        }
        if shape.generation < current.generation {
            return Err(DriverError::GenerationRegressed {
                current: current.generation,
                got: shape.generation,
            });
        }
        if shape.generation == current.generation {
            return if shape.groups == current.groups {
                Ok(DesiredUpdate::Unchanged)
            } else {
                Err(DriverError::ContentChangedWithoutGenerationBump {
                    generation: shape.generation,
                })
            };
        }
        let mut desired = shape.validate()?;
        desired.share_templates_with(&self.desired);
        let changed_groups = self.desired.changed_groups(&desired);
        let changed = !changed_groups.is_empty();
        for group in &changed_groups {
            // A shape change of a group closes its breaker at once.
            self.limit_state.breakers.remove(group);
        }
        self.desired = desired;
        // What a slot is desired to be may have changed: every node is
        // decided afresh by the next full pass.
        self.steady.clear();
        self.meta_changed();
        if changed {
            self.schedule.full = true;
        }
        // The new generation must be observed even when no group changed.
        self.schedule.request_pass();
        Ok(DesiredUpdate::Accepted)
    }

    /// Queues a full pass over every node (the periodic safety net, or a
    /// forced pass).
    pub fn trigger(&mut self) {
        self.schedule.trigger();
    }

    /// Queues a pass if a stored retry, probe or restart deadline is due.
    /// Returns whether one was due.
    pub fn trigger_if_due(&mut self, now: Timestamp) -> bool {
        let due = self.schedule.timer_due(now);
        if due {
            self.schedule.request_pass();
        }
        due
    }

    /// The earliest stored deadline: a timer of a waiting node or the
    /// deadline of a pending operation. The host arms one timer at it.
    ///
    /// While an operation's deadline has passed and its timeout is not
    /// folded yet, this stays in the past.
    pub fn requeue_at(&self) -> Option<Timestamp> {
        self.schedule.requeue_at()
    }

    /// Operations whose stored deadline is at or before `now`.
    pub fn pending_operations_due(&self, now: Timestamp) -> Vec<DueOperation> {
        self.schedule
            .deadlines
            .due(now, &self.state.nodes)
            .map(|(id, pending)| DueOperation {
                node: id.clone(),
                op: pending.id,
                deadline: pending.deadline,
            })
            .collect()
    }

    /// Whether the cluster is converged for the current generation: every
    /// desired slot holds exactly the desired spec, ready, active and with no
    /// pending operation, and no other node remains.
    pub fn is_converged(&self) -> bool {
        if self.state.observed_generation != Some(self.desired.generation()) {
            return false;
        }
        let desired_count = self.desired.node_count();
        if u64::try_from(self.state.nodes.len()).ok() != Some(desired_count) {
            return false;
        }
        let mut converged = true;
        walk_slots(&self.state, &self.desired, |slot| {
            converged = converged
                && match slot {
                    Slot::Managed { node, desire, .. } => {
                        desire.is_desired()
                            && !desire.drifted(node)
                            && node.is_ready()
                            && node.pending.is_none()
                    }
                    Slot::Missing { .. } => false,
                };
        });
        converged
    }
}
