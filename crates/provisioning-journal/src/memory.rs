use std::sync::{Arc, Mutex, MutexGuard};

use crate::{ChangeSet, Journal, JournalError, JournalStats, Snapshot, validate_run_name};

/// The committed data of an in-memory journal, shared between the journal and
/// the test that wants to crash and reopen it. Cloning gives another handle on
/// the same data.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Mutex<StoreInner>>,
}

#[derive(Debug)]
struct StoreInner {
    committed: Snapshot,
    /// A live [`MemoryJournal`] holds the store (the in-memory lock).
    held: bool,
    /// Commits still to fail with [`JournalError::Injected`].
    failures: u32,
}

impl MemoryStore {
    /// A new, empty store for `run`.
    pub fn new(run: &str) -> Result<Self, JournalError> {
        validate_run_name(run)?;
        Ok(MemoryStore {
            inner: Arc::new(Mutex::new(StoreInner {
                committed: Snapshot::empty(run),
                held: false,
                failures: 0,
            })),
        })
    }

    /// The run the store belongs to.
    pub fn run(&self) -> String {
        self.lock().committed.run.clone()
    }

    /// What is committed, without opening a journal.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().committed.clone()
    }

    /// True while a journal on this store is alive.
    pub fn is_held(&self) -> bool {
        self.lock().held
    }

    /// Makes the next commit on this store fail with
    /// [`JournalError::Injected`], writing nothing. Calls add up.
    pub fn fail_next_commit(&self) {
        self.lock().failures += 1;
    }

    fn lock(&self) -> MutexGuard<'_, StoreInner> {
        // Nothing panics between a commit's validation and its last write,
        // so the data behind a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The in-memory journal: the same contract as [`crate::SqliteJournal`], for
/// the conformance kit. Dropping it models a crash: only what was committed
/// stays in its [`MemoryStore`], and [`MemoryJournal::reopen`] resumes from it.
/// Like the file journal, a store has one live journal at a time.
#[derive(Debug)]
pub struct MemoryJournal {
    store: MemoryStore,
    stats: JournalStats,
}

impl MemoryJournal {
    /// A journal on a new, empty store for `run`.
    pub fn new(run: &str) -> Result<Self, JournalError> {
        Self::reopen(&MemoryStore::new(run)?)
    }

    /// Opens a journal on an existing store, e.g. after dropping the previous
    /// one. Refused with [`JournalError::InUse`] while another journal on the
    /// same store is alive.
    pub fn reopen(store: &MemoryStore) -> Result<Self, JournalError> {
        let mut inner = store.lock();
        if inner.held {
            return Err(JournalError::InUse {
                run: inner.committed.run.clone(),
            });
        }
        inner.held = true;
        drop(inner);
        Ok(MemoryJournal {
            store: store.clone(),
            stats: JournalStats::default(),
        })
    }

    /// A handle on this journal's store.
    pub fn storage(&self) -> MemoryStore {
        self.store.clone()
    }
}

impl Drop for MemoryJournal {
    fn drop(&mut self) {
        self.store.lock().held = false;
    }
}

impl Journal for MemoryJournal {
    fn load(&self) -> Result<Snapshot, JournalError> {
        Ok(self.store.snapshot())
    }

    fn commit(&mut self, changes: &ChangeSet) -> Result<(), JournalError> {
        changes.validate()?;
        let mut inner = self.store.lock();
        if inner.failures > 0 {
            inner.failures -= 1;
            return Err(JournalError::Injected);
        }
        let state = &mut inner.committed;
        for (key, value) in &changes.meta {
            state.meta.insert(key.clone(), value.clone());
        }
        for row in &changes.upserts {
            state.nodes.insert(row.node.clone(), row.clone());
        }
        for node in &changes.deletes {
            state.nodes.remove(node);
        }
        state.clean = false;
        drop(inner);
        self.stats.record(changes);
        Ok(())
    }

    fn set_secret(&mut self, secret: &[u8]) -> Result<(), JournalError> {
        self.store.lock().committed.secret = Some(secret.to_vec());
        Ok(())
    }

    fn mark_clean(&mut self) -> Result<(), JournalError> {
        self.store.lock().committed.clean = true;
        Ok(())
    }

    fn stats(&self) -> JournalStats {
        self.stats
    }
}
