//! The fair-scheduler tail (G21–G24).

use std::collections::BTreeSet;
use std::time::Duration;

use provisioning::NodeAttemptId;

use super::{FAIR_INNER_MAX, FAIR_ROUNDS_IDLE_MAX, FAIR_ROUNDS_MAX, Harness};
use crate::guarantee::{GuaranteeId, Phase, Violation};
use crate::oracle::{self, breach};
use crate::substrate::Substrate;
use crate::trace::WorkStep;

impl<S: Substrate> Harness<S> {
    /// Runs the fair tail. Records the rounds it took and the attempts it
    /// allocated; whether it converged is [`Harness::converged`].
    pub(super) fn fair_tail(&mut self) -> Result<(), Violation> {
        self.converged = false;
        self.tail_rounds = 0;
        self.tail_new_attempts = 0;
        self.substrate.stop_faults();
        self.durable.faults_stopped_at = Some(self.now);
        let attempts_before = self.driver.state().attempts.next_unallocated();
        let order = match self.options.tail_order {
            WorkStep::One(_) => WorkStep::Fifo,
            order => order,
        };
        // Rounds that count toward the bound, and the driver's state as the
        // last round ended (an idle round changes neither).
        let mut counted = 0;
        let mut last_state = None;
        for round in 0..FAIR_ROUNDS_IDLE_MAX {
            if counted == FAIR_ROUNDS_MAX {
                break;
            }
            self.phase = Phase::Tail(round);
            self.tail_rounds = round + 1;
            let mut worked = false;
            for _ in 0..FAIR_INNER_MAX {
                let released = self.substrate.release_all_hangs();
                let ran = self.substrate.run_work(order);
                self.check_calls()?;
                self.settle()?;
                // Agents of nodes recovered as ready re-join the new
                // controller: those of even slots; the others let their
                // rejoin window end, so the loss path runs too (G37).
                let progressed = self.substrate.fair_progress() + self.rejoin_agents(true);
                self.settle()?;
                worked |= released + ran + progressed > 0;
                if released + ran + progressed == 0 && !self.substrate.has_runnable_work() {
                    break;
                }
            }
            self.check_state()?;
            // Converged only once no orphan is left (G26).
            let orphans = self.next_orphan_event();
            if self.driver.is_converged() && orphans.is_none() {
                self.converged = true;
                break;
            }
            // Past an edge every round counts: convergence is waived there,
            // and idle rounds would only delay the waiver.
            let state = self.driver.state();
            if worked || self.edges_reached || last_state.as_ref() != Some(state) {
                counted += 1;
                last_state = Some(state.clone());
            }
            let requeue = self.driver.requeue_at().filter(|t| *t > self.now);
            let orphans = orphans.filter(|t| *t > self.now);
            let next = match (requeue, orphans) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => a
                    .or(b)
                    .unwrap_or_else(|| self.now.saturating_add(Duration::from_secs(1))),
            };
            self.advance_to(next)?;
            self.check_state()?;
        }
        self.phase = Phase::End;
        self.tail_new_attempts = self
            .driver
            .state()
            .attempts
            .next_unallocated()
            .saturating_sub(attempts_before);
        if self.edges_reached {
            return Ok(());
        }
        if !self.converged {
            let pending = oracle::describe_pending(self.driver.state(), self.driver.desired());
            let orphans: Vec<String> = self
                .durable
                .observed_orphans
                .keys()
                .map(|(node, attempt)| format!("{node}/{attempt}"))
                .collect();
            // A group with a breaker (in the kit's model of the limits)
            // whose desired slots are not all ready: its breaker blocked
            // convergence after faults stopped (G30).
            let desired = self.driver.desired();
            let blocked: Vec<String> = self
                .limits
                .breakers
                .keys()
                .filter(|group| oracle::unavailable_slots(self.driver.state(), desired, group) > 0)
                .map(ToString::to_string)
                .collect();
            if !blocked.is_empty() {
                return Err(self.crash_aware(
                    GuaranteeId::BreakerLiveness,
                    format!(
                        "no convergence within {FAIR_ROUNDS_MAX} fair rounds ({} in all, idle ones included) with a breaker on group(s) {} and their slots not ready; still pending: {pending}",
                        self.tail_rounds,
                        blocked.join(", ")
                    ),
                ));
            }
            return Err(self.crash_aware(
                GuaranteeId::FairConvergence,
                format!(
                    "no convergence within {FAIR_ROUNDS_MAX} fair rounds ({} in all, idle ones included); still pending: {pending}; orphans: [{}]; work: {}",
                    self.tail_rounds,
                    orphans.join(", "),
                    self.substrate.describe_work()
                ),
            ));
        }
        self.probe_quiescence()?;
        let new_attempts = self.tail_new_attempts;
        let nodes = self.driver.desired().node_count();
        let bound = 2 * nodes + 2;
        self.check(if new_attempts <= bound {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::BoundedReplacement,
                format!("the fair tail made {new_attempts} new attempts for {nodes} nodes (bound {bound})"),
            ))
        })?;
        let live = self.substrate.live_resources();
        if let Err(leak) = oracle::g23_converged_leaks_nothing(self.driver.state(), &live) {
            return Err(self.crash_aware(leak.guarantee, leak.detail));
        }
        if self.strict_calls {
            // The executor at convergence: no operation runs or waits (every
            // hang was released and ran), and it keeps nothing of an attempt
            // it was told to retire.
            let (ledger, _) = self.executor.ledger();
            let kept: BTreeSet<NodeAttemptId> = ledger.iter().map(|e| e.attempt).collect();
            let retired: Vec<String> = ledger
                .iter()
                .filter(|entry| {
                    entry.retired || self.executor_watch.retired.contains(&entry.attempt)
                })
                .map(|entry| entry.attempt.to_string())
                .collect();
            let busy = self.executor.has_work();
            // Without a crash, the executor took every current attempt's
            // operations and keeps each one's latest result.
            let missing = if self.durable.crashes == 0 {
                self.driver
                    .state()
                    .nodes
                    .values()
                    .map(|n| n.attempt)
                    .find(|a| !kept.contains(a))
            } else {
                None
            };
            if let Some(attempt) = missing {
                return Err(self.violation(breach(
                    GuaranteeId::ConvergedLeaksNothing,
                    format!(
                        "converged, but the executor's ledger has no entry for the current attempt {attempt}"
                    ),
                )));
            }
            self.check(if retired.is_empty() && !busy {
                Ok(())
            } else {
                Err(breach(
                    GuaranteeId::ConvergedLeaksNothing,
                    format!(
                        "converged, but the executor {}keeps retired attempt(s) [{}]",
                        if busy { "still has work and " } else { "" },
                        retired.join(", ")
                    ),
                ))
            })?;
        }
        let latest = self.model.shape(self.generation);
        self.check(if *self.driver.desired().shape() == latest
            && self.driver.state().observed_generation == Some(latest.generation)
        {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::LatestDesiredWins,
                format!(
                    "converged for generation {:?} / {}, but the latest desired generation is {}",
                    self.driver.state().observed_generation,
                    self.driver.desired().generation(),
                    latest.generation
                ),
            ))
        })
    }
}
