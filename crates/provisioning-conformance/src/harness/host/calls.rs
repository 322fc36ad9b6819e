//! Every backend call start, checked against what the driver recorded and
//! the executor said: the ledger's alarms (G08), one call per attempt
//! (G05), a call only for a recorded, current, unexpired operation (G04),
//! and committed to the journal first (G27).

use crate::guarantee::{GuaranteeId, Violation};
use crate::harness::Harness;
use crate::oracle;
use crate::substrate::Substrate;

impl<S: Substrate> Harness<S> {
    pub(in crate::harness) fn check_calls(&mut self) -> Result<(), Violation> {
        let alarms = self.substrate.take_ledger_alarms();
        if !alarms.is_empty() {
            let zombies = self.zombie_slots();
            // A resource a dead controller's call made after the crash is an
            // orphan (G28), not a double-create by this controller.
            let explained = |alarm: &String| {
                zombies
                    .iter()
                    .any(|node| alarm.contains(&format!(" {node}/")))
            };
            if let Some(alarm) = alarms.into_iter().find(|alarm| !explained(alarm)) {
                return Err(self.crash_aware(GuaranteeId::NoDoubleCreate, alarm));
            }
        }
        let (starts, zombies) = self.take_call_starts();
        for start in &starts {
            let watch = &mut self.executor_watch;
            watch.awaiting_call.remove(&start.op);
            watch.uncalled.remove(&start.op);
            if watch.waiting_behind.get(&start.op.attempt()) == Some(&start.op) {
                watch.waiting_behind.remove(&start.op.attempt());
            }
        }
        for mut call in self.substrate.take_calls() {
            // Calls of a dead controller still running in the backend are
            // beyond any executor's single flight.
            let zombie_calls = zombies.get(&call.op).copied().unwrap_or(0);
            call.overlapping = call.overlapping.saturating_sub(zombie_calls);
            // With a deterministic substrate calls start only while work
            // runs, and every start before an expiry was looked at before
            // it: a start seen now came after (the expiry form is strict).
            let verdict = oracle::at_call_start(
                &call,
                self.driver.state(),
                &self.timed_out,
                &self.ever_pending,
                &self.executor_watch.expired,
                &mut self.newest_call,
                self.strict_calls,
            );
            self.check(verdict)?;
            self.calls.push(call);
        }
        self.check_committed(&starts)
    }
}
