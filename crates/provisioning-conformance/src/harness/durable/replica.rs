//! The kit's replica of the journal (G26, commit form): every committed
//! change set is applied to an `InMemoryJournal` of the kit's own, and on
//! every fourth commit the replica must hold the driver's durable state.

use crate::harness::Harness;
use crate::journal::InMemoryJournal;
use crate::oracle::{self};
use crate::substrate::Substrate;

impl<S: Substrate> Harness<S> {
    /// G26 (commit form): after a commit (every fourth), the journal as the
    /// kit applied the change sets holds the driver's durable state — every
    /// node that changed was written, every node that left was removed, and
    /// the meta (shape, allocator, breakers) was written whenever it changed.
    pub(in crate::harness) fn check_replica(&mut self) {
        // Every fourth commit (the three ways rotate through the checked
        // ones): a write the driver missed stays missing in the replica
        // until it is written, so a sample finds it, at a quarter of the
        // cost of comparing the whole state after every commit.
        if self.durable.commit_breach.is_some() || self.durable.commits % 4 != 0 {
            return;
        }
        let Some((meta, nodes)) = self
            .durable
            .replica
            .as_ref()
            .and_then(InMemoryJournal::held)
        else {
            return;
        };
        let Some(whole) = self.driver.durable_state(self.now) else {
            return;
        };
        self.durable.commit_breach =
            oracle::g26_journal_holds_durable_state(meta, nodes, &whole).err();
    }
}
