//! Publishing: the snapshots the loop sends to subscribers (from the
//! progress view, only when something changed and at most once per
//! [`publish_interval`]) and the whole ones a status query answers.

use std::time::Duration;

use tokio::time::Instant;

use super::run_loop::HostLoop;
use crate::durable::DurableLoop;
use crate::status::StatusSnapshot;

/// The longest a change waits before it is published to subscribers.
pub const PUBLISH_INTERVAL_MAX: Duration = Duration::from_secs(1);

/// How many times the cost of the last snapshot build the loop waits before
/// it builds the next one (so publishing takes at most about 1/this of the
/// loop's time).
const PUBLISH_COST_FACTOR: u32 = 10;

/// The wait between two published snapshots, after one that cost `cost` to
/// build: [`PUBLISH_COST_FACTOR`] times it, at most [`PUBLISH_INTERVAL_MAX`].
pub fn publish_interval(cost: Duration) -> Duration {
    cost.saturating_mul(PUBLISH_COST_FACTOR)
        .min(PUBLISH_INTERVAL_MAX)
}

impl HostLoop {
    /// When the next snapshot is due: `None` while nothing changed.
    pub(super) fn publish_at(&self) -> Option<Instant> {
        if !self.status_dirty {
            return None;
        }
        Some(match self.published_at {
            Some(at) => at + publish_interval(self.publish_cost),
            None => Instant::now(),
        })
    }

    /// Publishes a snapshot if something changed and the interval since the
    /// last one is over; otherwise the loop's timer comes back for it.
    pub(super) fn publish_if_due(&mut self) {
        let Some(due) = self.publish_at() else {
            return;
        };
        let now = Instant::now();
        if now < due {
            return;
        }
        // Bringing the view up to date costs the nodes changed since the
        // last snapshot (each changed node is built once per snapshot at
        // most): work in proportion to the loop's own, not counted in the
        // interval. What a snapshot costs beyond it (a pointer per node, the
        // groups, the metrics) is.
        self.view.update(&self.driver);
        let assembling = Instant::now();
        let replaced = self.publish();
        self.publish_cost = assembling.elapsed();
        // Frees the statuses of the nodes that changed since (per-change
        // work again), off the loop: another worker does it.
        if !replaced.nodes.is_empty() {
            tokio::spawn(async move { drop(replaced) });
        }
        self.published_at = Some(now);
        self.status_dirty = false;
    }

    /// Publishes a snapshot; returns the one it replaced (or the fresh one,
    /// when nothing it shows changed), for the caller to drop outside the
    /// channel's lock.
    fn publish(&mut self) -> StatusSnapshot {
        let mut fresh = self.snapshot();
        if self.config.metrics {
            let mut previous = self
                .stage_gauges
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            crate::metrics::gauges(&fresh, &mut previous);
        }
        self.progress.send_if_modified(|current| {
            let changed = fresh.differs_from(current);
            if changed {
                std::mem::swap(current, &mut fresh);
            }
            changed
        });
        fresh
    }

    /// A progress snapshot, from the view kept up to date per changed node.
    pub(super) fn snapshot(&mut self) -> StatusSnapshot {
        let uptime = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let snapshot = self.view.snapshot(&self.driver, self.phase, uptime);
        self.with_durability(snapshot)
    }

    /// A fresh snapshot built whole, with the nodes' histories (what a
    /// status query answers).
    pub(super) fn fresh_snapshot(&self) -> StatusSnapshot {
        let uptime = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let snapshot = StatusSnapshot::with_history(&self.driver, self.phase, uptime);
        self.with_durability(snapshot)
    }

    fn with_durability(&self, mut snapshot: StatusSnapshot) -> StatusSnapshot {
        snapshot.durability = self.durable.as_ref().map(DurableLoop::status);
        snapshot
    }
}
