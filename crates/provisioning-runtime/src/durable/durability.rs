//! [`Durability`]: a journal as opened for a host, with what was loaded
//! from it (the state to resume, whether the run was left unclean, the
//! run's secret and the embedding program's notes), and
//! [`DurabilityError`], why it could not be opened or resumed.

use std::collections::BTreeMap;
use std::time::Duration;

use provisioning::{DurableState, Generation, RecoveryError};
use provisioning_journal::codec::{CodecError, StateCodec};
use provisioning_journal::{Journal, JournalError};
use thiserror::Error;

use super::orphans::{DEFAULT_ORPHAN_GRACE, DEFAULT_ORPHAN_SCAN_INTERVAL};

/// Why durable state could not be opened or resumed. Nothing was started.
#[derive(Debug, Error)]
pub enum DurabilityError {
    /// The journal refused (locked, corrupt, newer schema, unwritable).
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// A committed row could not be read back.
    #[error("the state file's content is unreadable: {0}")]
    Codec(#[from] CodecError),
    /// The committed state could not be recovered.
    #[error("the committed state cannot be resumed: {0}")]
    Recovery(#[from] RecoveryError),
}

/// A journal with what was loaded from it.
pub struct Durability {
    pub(crate) journal: Box<dyn Journal>,
    pub(crate) codec: StateCodec,
    /// The committed state, also of a cleanly stopped run (whose nodes are
    /// all gone): the allocator and the generation continue from it, so
    /// attempt ids and generations never repeat across starts.
    pub(crate) resume: Option<DurableState>,
    /// Whether the last controller left the run unclean (it is resumed).
    pub(crate) unclean: bool,
    secret: Option<Vec<u8>>,
    /// The journal's meta entries outside the codec's own (`state`,
    /// `template/…`), as loaded or last recorded.
    notes: BTreeMap<String, String>,
    /// How long a resource must be seen unowned before it is destroyed.
    pub orphan_grace: Duration,
    /// How often providers are listed to look for orphans.
    pub orphan_scan_interval: Duration,
}

impl std::fmt::Debug for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Durability")
            .field("resume", &self.resume.as_ref().map(|s| s.nodes.len()))
            .field("orphan_grace", &self.orphan_grace)
            .field("orphan_scan_interval", &self.orphan_scan_interval)
            .finish_non_exhaustive()
    }
}

/// What a resumed run looked like when its controller stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResumeSummary {
    /// The generation in force.
    pub generation: Generation,
    /// Nodes the journal holds.
    pub nodes: usize,
}

impl Durability {
    /// Loads `journal`. A run whose last controller did not mark it clean is
    /// resumed; a clean or blank journal starts fresh.
    ///
    /// # Errors
    /// [`DurabilityError::Journal`] when it cannot be read;
    /// [`DurabilityError::Codec`] when a committed row is unreadable.
    pub fn open(journal: Box<dyn Journal>) -> Result<Durability, DurabilityError> {
        let snapshot = journal.load()?;
        let mut codec = StateCodec::new();
        let resume = codec.decode(&snapshot)?;
        let unclean = !snapshot.clean && resume.is_some();
        Ok(Durability {
            journal,
            codec,
            resume,
            unclean,
            secret: snapshot.secret,
            notes: snapshot
                .meta
                .iter()
                .filter(|(key, _)| key.starts_with(NOTE_PREFIX))
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect(),
            orphan_grace: DEFAULT_ORPHAN_GRACE,
            orphan_scan_interval: DEFAULT_ORPHAN_SCAN_INTERVAL,
        })
    }

    /// Whether the run is resumed (its last controller left it unclean), and
    /// from what.
    pub fn resume_summary(&self) -> Option<ResumeSummary> {
        let resume = self.resume.as_ref().filter(|_| self.unclean);
        resume.map(|state| ResumeSummary {
            generation: state.meta.desired.generation,
            nodes: state.nodes.len(),
        })
    }

    /// The run's stored secret, if any.
    pub fn secret(&self) -> Option<&[u8]> {
        self.secret.as_deref()
    }

    /// Stores the run's secret (the first start of a run, or after a clean
    /// teardown left none worth keeping).
    ///
    /// # Errors
    /// The journal's error.
    pub fn store_secret(&mut self, secret: &[u8]) -> Result<(), DurabilityError> {
        self.journal.set_secret(secret)?;
        self.secret = Some(secret.to_vec());
        Ok(())
    }

    /// A note the embedding program stored with [`Durability::store_note`]
    /// (for the CLI: the shape file its run was started from, so that a
    /// teardown after a crash can start the same providers).
    pub fn note(&self, name: &str) -> Option<&str> {
        self.notes
            .get(&format!("{NOTE_PREFIX}{name}"))
            .map(String::as_str)
    }

    /// Every note stored, by name, in name order.
    pub fn notes(&self) -> impl Iterator<Item = (&str, &str)> {
        self.notes.iter().filter_map(|(key, value)| {
            key.strip_prefix(NOTE_PREFIX)
                .map(|name| (name, value.as_str()))
        })
    }

    /// Stores `value` under `name` in the journal, in a commit of its own
    /// (which, like every commit, marks the run as not cleanly stopped).
    ///
    /// # Errors
    /// [`DurabilityError::Journal`] when the commit fails.
    pub fn store_note(&mut self, name: &str, value: &str) -> Result<(), DurabilityError> {
        let key = format!("{NOTE_PREFIX}{name}");
        if self.notes.get(&key).is_some_and(|v| v == value) {
            return Ok(());
        }
        let mut changes = provisioning_journal::ChangeSet::new();
        changes.meta.push((key.clone(), value.to_owned()));
        self.journal.commit(&changes)?;
        self.notes.insert(key, value.to_owned());
        Ok(())
    }
}

/// The meta-key prefix of notes (see [`Durability::note`]).
const NOTE_PREFIX: &str = "note/";
