//! Controller crashes and recovery (G26): the controller dies (mid-wake,
//! between commit and submission, or at a `crash` input), its executor is
//! closed, and a new one is recovered from the journal and reconciled
//! against the substrate's live resources. Zombie calls of dead controllers
//! keep running in the backend.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use provisioning::driver::SubmitError;
use provisioning::durable::RecoveryError;
use provisioning::observe::LossCause;
use provisioning::state::PendingOperation;
use provisioning::{EffectKind, LogicalNodeId, NodeAttemptId, NodeTemplate, Observation};

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::Harness;
use crate::journal::InMemoryJournal;
use crate::oracle::{self, breach};
use crate::substrate::Substrate;
use crate::trace::WorkStep;

impl<S: Substrate> Harness<S> {
    /// Whether the substrate survives a controller crash (crash inputs and
    /// orphan collection apply only then).
    pub(in crate::harness) fn crash_capable(&self) -> bool {
        self.substrate.survives_controller_crash()
    }

    /// The armed crash fires: the backend runs whatever work reached it,
    /// then the controller dies and is recovered.
    pub(in crate::harness) fn crash_mid_wake(&mut self) -> Result<(), Violation> {
        self.substrate.run_work(WorkStep::Fifo);
        self.check_calls()?;
        self.crash()
    }

    /// The controller dies now and a new one is recovered from the journal.
    pub(in crate::harness) fn crash(&mut self) -> Result<(), Violation> {
        self.durable.crash_armed = false;
        let stored = match self.journal.load() {
            Ok(Some(stored)) => stored,
            Ok(None) => {
                return Err(self.violation(breach(
                    GuaranteeId::CrashSafety,
                    format!(
                        "the controller crashed, and the {} journal holds nothing to recover from (does the driver under test journal its changes?)",
                        self.journal.name()
                    ),
                )));
            }
            Err(error) => {
                return Err(self.violation(breach(
                    GuaranteeId::CrashSafety,
                    format!(
                        "the {} journal cannot be read after a crash: {error}",
                        self.journal.name()
                    ),
                )));
            }
        };
        let pending: Vec<(LogicalNodeId, PendingOperation)> = stored
            .nodes
            .iter()
            .filter_map(|e| e.node.pending.clone().map(|p| (e.node.node.clone(), p)))
            .collect();
        let stored_nodes = stored.nodes.len();
        let stored_generation = stored.meta.desired.generation;
        let stored_breakers = stored.meta.breakers.clone();
        let stored_templates: BTreeMap<LogicalNodeId, Arc<NodeTemplate>> = stored
            .nodes
            .iter()
            .map(|e| (e.node.node.clone(), e.template.clone()))
            .collect();
        // Sessions that streamed to the dead controller and had not handed
        // off: recovery must start them again (and say how many it did).
        let streaming: Vec<LogicalNodeId> = stored
            .nodes
            .iter()
            .filter(|e| {
                let record = &e.node.record;
                record.failure.is_none()
                    && record
                        .bootstrap
                        .as_ref()
                        .is_some_and(|b| b.state == provisioning::state::SessionState::Active)
                    && !matches!(
                        record.stage,
                        provisioning::NodeStage::HandedOff
                            | provisioning::NodeStage::Dormant
                            | provisioning::NodeStage::Destroyed
                    )
            })
            .map(|e| e.node.node.clone())
            .collect();
        // Readiness is re-earned (G37): what the journal held ready waits
        // for its agent's re-join to the new controller.
        let held_ready = super::rejoin::held_ready(&stored);
        // The journal holds what was committed: the kit's replica of it
        // starts again from what it gave back.
        self.durable.replica = Some(InMemoryJournal::holding(&stored));
        let (driver, report) = match (self.recovery)(&self.setup, stored, self.now) {
            Ok(recovered) => recovered,
            Err(RecoveryError::Clock(_)) => {
                // G13's edge: a clock at its end cannot take the recovered
                // deadlines. The error is the right answer; this controller
                // then simply does not crash.
                self.edges_reached = true;
                return Ok(());
            }
            Err(error) => {
                return Err(self.violation(breach(
                    GuaranteeId::CrashSafety,
                    format!("recovery from the committed state failed: {error}"),
                )));
            }
        };
        // The controller dies: its executor (queued work, undelivered
        // results) and every undelivered observation are lost; calls already
        // in the backend go on there.
        self.durable.crashes += 1;
        self.vacuity.crashes += 1;
        self.durable.late_dropped_before += self.executor.counters().late_dropped;
        self.close_dead_executor()?;
        {
            let mut control = self.durable.control.lock();
            control.live_epoch += 1;
            control.live_calls = 0;
            control.live_panics = 0;
            control.panicked.clear();
        }
        // The provider's sessions streamed to the dead controller: they go
        // quiet until the new one re-attaches them.
        self.substrate.controller_restarted();
        let _lost = self.substrate.take_observations();
        // What was delivered went to the dead controller: no late or
        // duplicated delivery of it can reach the new one (its executor and
        // its provider streams are new), so `redeliver` starts afresh.
        self.history.clear();
        // The new executor knows nothing of the old one's operations.
        self.executor_watch.recent.clear();
        self.executor_watch.expired.clear();
        self.executor_watch.accepted_here.clear();
        self.executor_watch.published_here.clear();
        self.executor_watch.queued_here = 0;
        self.executor_watch.replayed_here = 0;
        self.executor_watch.taken_here = 0;
        self.executor_watch.awaiting_call.clear();
        self.executor_watch.waiting_behind.clear();
        self.executor_watch.skipped_at_submission = 0;
        self.executor_watch.skipped_at_expiry = 0;
        self.executor_watch.uncalled.clear();
        self.executor_watch.notified = Arc::new(AtomicU64::new(0));
        // An acknowledgement folded after the last commit died with the
        // controller: the recovered one may report that convergence again.
        let recovered = driver.state();
        self.executor_watch.convergence_reported.retain(|attempt| {
            recovered.nodes.values().any(|n| {
                n.attempt == *attempt
                    && n.record
                        .bootstrap
                        .as_ref()
                        .is_some_and(|b| b.convergence_observed)
            })
        });
        self.executor = Harness::controller_executor(
            &self.substrate,
            &self.durable.control,
            &self.executor_watch.notified,
        );
        self.driver = driver;
        // The recovered controller hands out a membership of its own,
        // numbered anew (G35).
        self.driver.track_membership();
        self.membership.controller_replaced();
        self.durable.awaiting_rejoin = held_ready;
        // G37 at once: the recovered driver counts none of them ready.
        self.check_rejoins()?;
        // The limits are configuration: the new controller is given them too.
        self.driver.set_limits(self.limits.clone());
        let depth = if self.history_off {
            0
        } else {
            crate::harness::HISTORY_DEPTH
        };
        self.history_watch = crate::harness::HistoryWatch::start(self.driver.as_mut(), depth);
        let groups = self
            .driver
            .desired()
            .groups()
            .keys()
            .cloned()
            .collect::<Vec<_>>();
        let driver = &self.driver;
        let verdict = self.breaker_watch.recovered(
            &stored_breakers,
            &|group| driver.breaker_status(group),
            groups,
        );
        self.check(verdict)?;
        // G26 (template form): every recovered node runs the template its
        // attempt was journaled with (a node of an older template is
        // drifted, not up to date).
        let wrong = self.driver.state().nodes.iter().find(|(id, node)| {
            stored_templates
                .get(*id)
                .is_some_and(|t| **t != *node.spec.template())
        });
        if let Some((id, node)) = wrong {
            return Err(self.violation(breach(
                GuaranteeId::CrashSafety,
                format!(
                    "{id} was recovered with template {:?}, but its attempt was journaled with {:?}",
                    node.spec.template(),
                    stored_templates.get(id)
                ),
            )));
        }
        self.driver_counts = crate::harness::DriverCounts::default();
        self.full_expected = None;
        // Folds after the last commit die with the controller, and recovery
        // folds every journaled pending operation as ambiguous: the kit's
        // failure counts restart from the recovered ones (an approximation —
        // a recovery that resets counts is not caught here).
        self.failures = self
            .driver
            .state()
            .nodes
            .iter()
            .map(|(id, node)| (id.clone(), node.retry.consecutive_failures))
            .collect();
        self.check(oracle::g26_recovery_made_pending_ambiguous(
            self.driver.state(),
            &pending,
        ))?;
        let restarted = streaming
            .iter()
            .filter(|id| {
                self.driver
                    .state()
                    .nodes
                    .get(*id)
                    .is_some_and(|n| n.record.failure.is_none())
            })
            .count();
        self.check(oracle::g26_recovery_reports_what_it_recovered(
            &report,
            stored_nodes,
            pending.len(),
            restarted,
            stored_generation,
        ))?;
        self.durable.recovered_ambiguous = pending
            .iter()
            .filter(|(_, p)| matches!(p.kind, EffectKind::CreateLease | EffectKind::StartBootstrap))
            .map(|(_, p)| (p.id.attempt(), p.kind))
            .collect();
        if self.options.narrate {
            self.narration.push(format!(
                "   crash #{}: recovered {} node(s), {} pending made ambiguous",
                self.durable.crashes,
                self.driver.state().nodes.len(),
                pending.len()
            ));
        }
        // The real `up` applies the shape file again: a newer shape than the
        // journal's is submitted again.
        if self.driver.desired().generation().get() < self.generation {
            let shape = self.model.shape(self.generation);
            let _ = self.driver.update_desired(shape);
        }
        self.reconcile_listing()?;
        self.scan_orphans()
    }

    /// G26 (close form): the dead controller's executor is closed before it
    /// goes, as a host shutting a controller down closes it; closed, it
    /// must refuse a submission (here its latest operation again), so that
    /// nothing a late caller hands it can reach the backend.
    fn close_dead_executor(&mut self) -> Result<(), Violation> {
        self.executor.close();
        let Some(operation) = self.executor_watch.recent.back().cloned() else {
            return Ok(());
        };
        let answer = self.executor.submit(operation.clone());
        self.check(if matches!(answer, Err(SubmitError::Closed)) {
            Ok(())
        } else {
            Err(breach(
                GuaranteeId::CrashSafety,
                format!(
                    "the crashed controller's executor was closed, but it answered {answer:?} to {} {} submitted again (expected a refusal: closed)",
                    operation.kind(),
                    operation.id
                ),
            ))
        })
    }

    /// After recovery: a journaled lease of a node's current attempt that is
    /// no longer live means the node is lost.
    fn reconcile_listing(&mut self) -> Result<(), Violation> {
        let live = self.substrate.live_resources();
        let lost: Vec<(LogicalNodeId, NodeAttemptId)> = self
            .driver
            .state()
            .nodes
            .iter()
            .filter(|(id, node)| {
                let leased = node
                    .record
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.attempt == node.attempt);
                leased
                    && node.record.stage != provisioning::NodeStage::Destroyed
                    && live
                        .leases
                        .get(&((*id).clone(), node.attempt))
                        .is_none_or(|n| *n == 0)
            })
            .map(|(id, node)| (id.clone(), node.attempt))
            .collect();
        for (node, attempt) in lost {
            self.deliver_observation(Observation::NodeLost {
                node,
                attempt,
                cause: LossCause::LeaseGone,
            })?;
        }
        Ok(())
    }

    /// Whether a live resource left by a dead controller's call explains a
    /// G08 sample or alarm about `node` (an orphan, G28's business).
    pub(in crate::harness) fn zombie_slots(&self) -> BTreeSet<LogicalNodeId> {
        let state = self.driver.state();
        self.durable
            .control
            .lock()
            .zombie_created
            .iter()
            .filter(|key| !oracle::owned(state, key))
            .map(|(node, _)| node.clone())
            .collect()
    }
}
