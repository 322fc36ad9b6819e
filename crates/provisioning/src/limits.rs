//! Operator safety limits (design §15): launch caps, rollout budgets and
//! circuit breakers, as inputs of the pass.
//!
//! The decider stays as it is — a pure function of one node. The driver
//! applies [`Limits`] to the decider's answers in slot order while it applies
//! a pass: a create beyond its provider's cap, a drift replacement beyond its
//! group's budget, or a new attempt of a group whose breaker is open is held
//! back (the node waits) instead of dispatched. No limit reads a clock: the
//! breaker's cool-down is a stored instant compared with the pass's `now`.
//!
//! None of them holds back cleanup: scale-down, failed and lost nodes are
//! torn down at once, whatever the limits.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::id::{GroupId, LogicalNodeId};
use crate::time::Timestamp;

/// How many of a group's desired nodes a drift replacement may leave
/// unavailable at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaxUnavailable {
    /// A number of nodes; at least one is always allowed, or a rollout could
    /// never start (replacement here is delete-then-create, with no surge).
    Count(u32),
    /// A percentage of the group's desired count, rounded down, at least one.
    Percent(u32),
}

impl MaxUnavailable {
    /// The number of nodes this allows for a group of `desired` nodes.
    pub fn of(self, desired: u32) -> u32 {
        let n = match self {
            MaxUnavailable::Count(n) => n,
            MaxUnavailable::Percent(p) => {
                u32::try_from(u64::from(desired) * u64::from(p.min(100)) / 100).unwrap_or(u32::MAX)
            }
        };
        n.max(1)
    }
}

/// When a group's breaker opens and how long it stays open before a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Consecutive attempt failures of the group that open the breaker.
    pub failures: u32,
    /// How long an open breaker waits before it lets one probe attempt start.
    pub cooldown: Duration,
    /// How long a node of the group must stay ready before the group counts
    /// as healthy again. A node lost sooner counts as a failed attempt and
    /// keeps the count going, so a workload that exits right after it
    /// joined (a typo in its start command) opens the breaker instead of
    /// restarting forever. Zero: a node becoming ready closes the breaker at
    /// once.
    pub stable_after: Duration,
}

impl BreakerPolicy {
    /// A policy that opens after `failures` consecutive failures and probes
    /// after `cooldown`, with no stable window.
    pub fn new(failures: u32, cooldown: Duration) -> Self {
        BreakerPolicy {
            failures,
            cooldown,
            stable_after: Duration::ZERO,
        }
    }

    /// The same policy with a stable window.
    #[must_use]
    pub fn with_stable_after(mut self, stable_after: Duration) -> Self {
        self.stable_after = stable_after;
        self
    }
}

/// The limits a driver applies while it applies a pass. The default limits
/// nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Creates in flight at once, per provider kind.
    pub max_concurrent_creates: BTreeMap<String, u32>,
    /// The rollout budget of each group (groups not named are not limited).
    pub max_unavailable: BTreeMap<GroupId, MaxUnavailable>,
    /// The breaker of each group (groups not named have none).
    pub breakers: BTreeMap<GroupId, BreakerPolicy>,
}

/// What a group's breaker looks like now. Durable: the host journals it
/// with the state's meta, so a restarted controller keeps an open breaker
/// open (and its count of failures) instead of retrying at full speed.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BreakerStatus {
    /// Consecutive attempt failures since the group last had a node stay
    /// ready for the policy's stable window (or since its breaker was closed
    /// by hand or by a shape change).
    pub consecutive_failures: u32,
    /// When the breaker opened; `None` while it is closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opened_at: Option<Timestamp>,
    /// Whether a probe attempt is under way.
    #[serde(default)]
    pub probing: bool,
    /// The last failure's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When a node of the group became ready after the last counted
    /// failure: once the stable window has passed since then, the group is
    /// healthy and the breaker closes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered_at: Option<Timestamp>,
}

impl BreakerStatus {
    /// Whether the breaker is open (new attempts wait for the cool-down).
    pub fn is_open(&self) -> bool {
        self.opened_at.is_some()
    }

    /// Whether a node that became ready has stayed ready for `policy`'s
    /// stable window by `now`.
    pub fn recovered(&self, policy: &BreakerPolicy, now: Timestamp) -> bool {
        self.recovered_at
            .is_some_and(|at| now.reached(at.saturating_add(policy.stable_after)))
    }
}

/// Counts of what limits held back, for operators and the kit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LimitCounters {
    /// Creates held back by a launch cap.
    pub held_by_cap: u64,
    /// Drift replacements held back by a rollout budget.
    pub held_by_budget: u64,
    /// New attempts held back by an open breaker.
    pub held_by_breaker: u64,
    /// Breakers opened.
    pub breakers_opened: u64,
    /// Probe attempts let through by a breaker.
    pub breaker_probes: u64,
}

/// What the limits keep between passes: the driver's bookkeeping of the
/// creates in flight, the nodes each limit holds back, and every group's
/// breaker. Only the driver writes it.
#[derive(Debug, Default)]
pub(crate) struct LimitState {
    /// `CreateLease` operations pending, per provider kind.
    pub(crate) creates_in_flight: BTreeMap<String, u32>,
    /// Nodes whose create waits for a launch slot, per provider, in slot order.
    pub(crate) held_by_cap: BTreeMap<String, BTreeSet<LogicalNodeId>>,
    /// Drifted ready nodes whose replacement waits for the rollout budget.
    pub(crate) held_by_budget: BTreeMap<GroupId, BTreeSet<LogicalNodeId>>,
    /// Nodes whose insert or restart an open breaker holds back, per group:
    /// their wake depends on the breaker, so a change of it looks at them
    /// again.
    pub(crate) held_by_breaker: BTreeMap<GroupId, BTreeSet<LogicalNodeId>>,
    /// Every group's breaker that counted a failure since it last closed.
    pub(crate) breakers: BTreeMap<GroupId, BreakerStatus>,
    /// What the limits held back so far.
    pub(crate) counters: LimitCounters,
}
