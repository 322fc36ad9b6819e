//! Orphan collection (G28): the host lists the live resources every
//! `orphan_scan_interval`, keeps resources no current attempt owns as
//! suspects, and destroys those still unowned after `orphan_grace`; the
//! oracle keeps its own sample and holds the host to grace plus one scan
//! once faults stopped. An unowned resource no dead controller's call made
//! is a leak (G23).

use std::collections::BTreeSet;
use std::time::Duration;

use provisioning::{NodeAttemptId, Timestamp};

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::Harness;
use crate::oracle::{self, breach};
use crate::substrate::{LiveResources, ResourceKey, Substrate};

impl<S: Substrate> Harness<S> {
    /// The live keys no node's current attempt owns.
    fn unowned(&self, live: &LiveResources) -> BTreeSet<ResourceKey> {
        let state = self.driver.state();
        live.leases
            .iter()
            .chain(live.sessions.iter())
            .filter(|(key, count)| **count > 0 && !oracle::owned(state, key))
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Lists the live resources: unowned ones become suspects (or stay
    /// suspects), owned or vanished ones stop being suspects; then collects.
    pub(super) fn scan_orphans(&mut self) -> Result<(), Violation> {
        if !self.crash_capable() {
            return Ok(());
        }
        let unowned = self.unowned(&self.substrate.live_resources());
        let now = self.now;
        self.durable.suspects.retain(|key, _| unowned.contains(key));
        for key in unowned {
            self.durable.suspects.entry(key).or_insert(now);
        }
        self.collect_orphans()
    }

    /// Destroys every suspect seen unowned for `orphan_grace`, checking
    /// again first that no current attempt owns it.
    fn collect_orphans(&mut self) -> Result<(), Violation> {
        if !self.options.host.collect_orphans {
            return Ok(());
        }
        let grace = self.options.host.orphan_grace;
        let due: Vec<ResourceKey> = self
            .durable
            .suspects
            .iter()
            .filter(|(_, since)| oracle::at_or_after(self.now, since.saturating_add(grace)))
            .map(|(key, _)| key.clone())
            .collect();
        for key in due {
            self.durable.suspects.remove(&key);
            let unowned = self.unowned(&self.substrate.live_resources());
            if !unowned.contains(&key) {
                continue;
            }
            self.check(oracle::g28_never_an_owned_resource(
                self.driver.state(),
                &key,
            ))?;
            if self.substrate.destroy_orphan(&key) {
                self.vacuity.orphans_collected += 1;
            }
        }
        self.check_calls()
    }

    /// At a host wake: a periodic scan when one is due, and the collection
    /// of suspects whose grace ran out.
    pub(in crate::harness) fn orphan_wake(&mut self) -> Result<(), Violation> {
        if !self.crash_capable() {
            return Ok(());
        }
        if oracle::at_or_after(self.now, self.durable.next_scan_at) {
            let interval = self
                .options
                .host
                .orphan_scan_interval
                .max(Duration::from_millis(1));
            self.durable.next_scan_at = self.now.saturating_add(interval);
            return self.scan_orphans();
        }
        if self.durable.suspects.is_empty() {
            return Ok(());
        }
        self.collect_orphans()
    }

    /// When the host next does something about orphans, if anything is
    /// (or may be) unowned.
    pub(in crate::harness) fn next_orphan_event(&self) -> Option<Timestamp> {
        if self.durable.observed_orphans.is_empty() && self.durable.suspects.is_empty() {
            return None;
        }
        let grace = self.options.host.orphan_grace;
        let collect = self
            .durable
            .suspects
            .values()
            .map(|since| since.saturating_add(grace))
            .min();
        Some(collect.map_or(self.durable.next_scan_at, |c| {
            c.min(self.durable.next_scan_at)
        }))
    }

    /// The oracle's orphan sample after an input or tail round: what is
    /// unowned now, since when it was seen so, and G28's bound once faults
    /// stopped.
    pub(in crate::harness) fn check_orphans(
        &mut self,
        live: &LiveResources,
    ) -> Result<(), Violation> {
        if !self.crash_capable() {
            return Ok(());
        }
        let unowned = self.unowned(live);
        let now = self.now;
        {
            // An orphan needs a cause: a call of a dead controller that made
            // it after the crash. Any other unowned resource is a provider's
            // leak (a destroy that did not take, a definite failure that
            // left something) — G23's, even before convergence.
            // A dead controller's call still in flight may have made it
            // already (a real provider's create spawns before it returns):
            // judged once the call returns.
            let control = self.durable.control.lock();
            let zombie_in_flight = |attempt: &NodeAttemptId| {
                control.in_flight.get(attempt).is_some_and(|calls| {
                    calls.iter().any(|(epoch, _)| *epoch != control.live_epoch)
                })
            };
            let leak = unowned
                .iter()
                .find(|key| !control.zombie_created.contains(*key) && !zombie_in_flight(&key.1))
                .cloned();
            drop(control);
            if let Some((node, attempt)) = leak {
                return Err(self.violation(breach(
                    GuaranteeId::ConvergedLeaksNothing,
                    format!(
                        "{node}/{attempt} is live, but no node's current attempt owns it and no call of a crashed controller made it: leaked (live: {live})"
                    ),
                )));
            }
        }
        let observed = &mut self.durable.observed_orphans;
        observed.retain(|key, _| unowned.contains(key));
        for key in unowned {
            observed.entry(key).or_insert(now);
        }
        let Some(stopped) = self.durable.faults_stopped_at else {
            return Ok(());
        };
        let bound = self
            .options
            .host
            .orphan_grace
            .saturating_add(self.options.host.orphan_scan_interval);
        self.check(oracle::g28_orphans_collected_in_time(
            &self.durable.observed_orphans,
            stopped,
            bound,
            now,
        ))
    }
}
