//! Where the harness host journals the driver's durable state, and how it
//! recovers a driver from it after a controller crash (design §13).
//!
//! The harness host journals exactly as the real host does: every drive's
//! operations go into a buffer, the drive's change set
//! ([`provisioning::DriverChanges`]) is committed to a [`KitJournal`] as one
//! transaction, and only then are the buffered operations submitted to the
//! executor (a failed commit folds each of them as a definite failure
//! instead). At an [`Input::Crash`](crate::trace::Input::Crash) the driver
//! and the executor are dropped and a new driver is recovered from
//! [`KitJournal::load`] — only what was committed survives.
//!
//! [`InMemoryJournal`] is the journal of Levels 1 and 2: the committed
//! state with every committed change set applied. A journal over
//! real storage implements the same trait (this crate's tests run traces
//! against `provisioning_journal::SqliteJournal` that way and compare
//! digests with the in-memory one).

use std::collections::BTreeMap;

use provisioning::durable::{RecoveryError, RecoveryReport};
use provisioning::{
    ClusterDriver, DriverChanges, DurableEntry, DurableMeta, DurableState, LogicalNodeId, Timestamp,
};

use crate::driver_under_test::DriverUnderTest;
use crate::harness::DriverSetup;

/// A journal the harness host commits change sets to.
///
/// # Assumptions
/// - [`KitJournal::commit`] is one transaction: after `Ok` all of the change
///   set is durable, after `Err` none of it is.
/// - [`KitJournal::load`] returns everything committed and nothing else,
///   also when called after a crash (the harness calls it only then).
pub trait KitJournal {
    /// A short name for reports (`memory`, `sqlite`).
    fn name(&self) -> &str;

    /// Commits one drive's changes as one transaction.
    ///
    /// # Errors
    /// A description of why nothing was committed.
    fn commit(&mut self, changes: &DriverChanges) -> Result<(), String>;

    /// Everything committed so far, as recovery reads it; `None` when
    /// nothing was ever committed.
    ///
    /// # Errors
    /// A description of why the committed state cannot be read.
    fn load(&mut self) -> Result<Option<DurableState>, String>;
}

/// Builds a fresh, empty journal for one run.
pub type JournalFactory = dyn Fn() -> Box<dyn KitJournal>;

/// The in-memory journal: the committed meta and nodes, with every committed
/// change set applied as [`DurableState::apply`] would. Only committed data
/// survives a crash, because nothing else is ever written to it.
#[derive(Clone, Debug, Default)]
pub struct InMemoryJournal {
    meta: Option<DurableMeta>,
    nodes: BTreeMap<LogicalNodeId, DurableEntry>,
    commits: u64,
}

impl InMemoryJournal {
    /// An empty journal.
    pub fn new() -> Self {
        InMemoryJournal::default()
    }

    /// A boxed empty journal: a [`JournalFactory`].
    pub fn boxed() -> Box<dyn KitJournal> {
        Box::new(InMemoryJournal::new())
    }

    /// How many change sets were committed.
    pub fn commits(&self) -> u64 {
        self.commits
    }

    /// The committed state, if anything was committed.
    pub fn committed(&self) -> Option<DurableState> {
        self.meta.as_ref().map(|meta| DurableState {
            meta: meta.clone(),
            nodes: self.nodes.values().cloned().collect(),
        })
    }

    /// A journal that holds `state`, as if it had been committed.
    pub(crate) fn holding(state: &DurableState) -> Self {
        InMemoryJournal {
            meta: Some(state.meta.clone()),
            nodes: state
                .nodes
                .iter()
                .map(|e| (e.node.node.clone(), e.clone()))
                .collect(),
            commits: 0,
        }
    }

    /// The committed meta and nodes by slot, if anything was committed.
    pub(crate) fn held(&self) -> Option<(&DurableMeta, &BTreeMap<LogicalNodeId, DurableEntry>)> {
        self.meta.as_ref().map(|meta| (meta, &self.nodes))
    }

    /// Applies a change set in the order of [`DurableState::apply`]:
    /// removals, upserts, meta.
    pub(crate) fn apply(&mut self, changes: DriverChanges) {
        for id in &changes.removed {
            self.nodes.remove(id);
        }
        for entry in changes.upserts {
            self.nodes.insert(entry.node.node.clone(), entry);
        }
        if let Some(meta) = changes.meta {
            self.meta = Some(meta);
        }
    }
}

impl KitJournal for InMemoryJournal {
    fn name(&self) -> &str {
        "memory"
    }

    fn commit(&mut self, changes: &DriverChanges) -> Result<(), String> {
        if self.meta.is_none() && changes.meta.is_none() {
            return Err(
                "the first change set of a journal carries no meta (desired shape, allocator)"
                    .to_owned(),
            );
        }
        self.apply(changes.clone());
        self.commits += 1;
        Ok(())
    }

    fn load(&mut self) -> Result<Option<DurableState>, String> {
        Ok(self.committed())
    }
}

/// What a recovered driver comes with.
pub type Recovered = (Box<dyn DriverUnderTest>, RecoveryReport);

/// Rebuilds the driver under test from a committed state after a crash, at
/// the harness clock `now`.
pub type RecoveryFactory =
    dyn Fn(&DriverSetup, DurableState, Timestamp) -> Result<Recovered, RecoveryError>;

/// The default recovery: [`ClusterDriver::recover`] with the setup's run and
/// retry policy.
///
/// (The trace header's attempt limit is not durable: a recovered driver's
/// allocator is bounded only by the id space.)
///
/// # Errors
/// The [`RecoveryError`] of [`ClusterDriver::recover`].
pub fn recover_cluster_driver(
    setup: &DriverSetup,
    stored: DurableState,
    now: Timestamp,
) -> Result<Recovered, RecoveryError> {
    let (driver, report) = ClusterDriver::recover(&setup.run_id, stored, setup.policy, now)?;
    Ok((Box::new(driver), report))
}
