//! Durable state in the host (SPEC §13): what the host needs to journal
//! every drive before its operations reach the executor, to resume a run a
//! crashed controller left behind, and to collect orphans.
//!
//! - [`Durability::open`] loads a journal. A run left unclean is resumed:
//!   [`crate::Host::start_durable`] recovers the driver from it, lists every
//!   provider's resources before the first pass, reports journaled nodes the
//!   provider no longer lists as lost (the ladder replaces them) and treats
//!   listed resources no current attempt owns as orphan suspects.
//! - Every wake, the host drives the driver into a buffer, commits the
//!   drive's change set as one transaction and only then submits the
//!   buffered operations. A failed commit submits nothing: each buffered
//!   operation is folded as a definite failure (it never reached a
//!   provider) and retried after backoff.
//! - Orphans: a periodic scan (every `orphan_scan_interval`) lists the
//!   providers again. A resource no node's current attempt owns is destroyed
//!   once it has been seen unowned for `orphan_grace`; one a current attempt
//!   owns is never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use provisioning::{ClusterState, DurableState, Generation, LeaseHandle, NodeStage, RecoveryError};
use provisioning_journal::codec::{CodecError, StateCodec};
use provisioning_journal::{Journal, JournalError};
use provisioning_provider::{AttemptKey, ListedNode, PluginBackendAdapter};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// How long a resource must be seen unowned before it is destroyed.
pub const DEFAULT_ORPHAN_GRACE: Duration = Duration::from_secs(30);

/// How often the host lists every provider to look for orphans.
pub const DEFAULT_ORPHAN_SCAN_INTERVAL: Duration = Duration::from_secs(60);

/// How long one provider's listing may take before the scan gives up on it.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long one orphan destroy may take before it is retried at a later scan.
pub const ORPHAN_DESTROY_TIMEOUT: Duration = Duration::from_secs(60);

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

/// A resource seen unowned, waiting out its grace.
#[derive(Clone, Debug)]
struct Suspect {
    lease: LeaseHandle,
    first_seen: Instant,
}

/// One finished listing of every provider.
pub(crate) type Listing = Vec<(String, Result<Vec<ListedNode>, String>)>;

/// What background orphan work reports to the loop.
pub(crate) enum OrphanReport {
    Listed(Listing),
    Destroyed {
        kind: String,
        key: AttemptKey,
        outcome: Result<(), String>,
    },
}

/// Whether a current attempt owns a listed resource.
pub(crate) fn owned(state: &ClusterState, key: &AttemptKey) -> bool {
    state
        .nodes
        .get(&key.node)
        .is_some_and(|n| n.attempt == key.attempt && n.record.stage != NodeStage::Destroyed)
}

/// Orphan suspects, destroys in flight and counters.
pub(crate) struct Orphans {
    grace: Duration,
    interval: Duration,
    suspects: BTreeMap<(String, AttemptKey), Suspect>,
    destroying: BTreeSet<(String, AttemptKey)>,
    pub(crate) collected: u64,
    scanning: bool,
    next_scan: Instant,
    pub(crate) reports: mpsc::UnboundedSender<OrphanReport>,
}

impl Orphans {
    pub(crate) fn new(
        grace: Duration,
        interval: Duration,
        reports: mpsc::UnboundedSender<OrphanReport>,
    ) -> Self {
        Orphans {
            grace,
            interval: interval.max(Duration::from_millis(10)),
            suspects: BTreeMap::new(),
            destroying: BTreeSet::new(),
            collected: 0,
            scanning: false,
            next_scan: Instant::now() + interval,
            reports,
        }
    }

    pub(crate) fn suspected(&self) -> usize {
        self.suspects.len()
    }

    /// When the next scan is due: the periodic one, or earlier when a
    /// suspect's grace ends (so it is destroyed within grace plus one scan).
    pub(crate) fn next_scan(&self) -> Option<Instant> {
        if self.scanning {
            return None;
        }
        let grace_ends = self
            .suspects
            .iter()
            .filter(|(k, _)| !self.destroying.contains(*k))
            .map(|(_, s)| s.first_seen + self.grace)
            .min();
        Some(grace_ends.map_or(self.next_scan, |g| g.min(self.next_scan)))
    }

    /// Starts a listing of every provider in the background.
    pub(crate) fn start_scan(
        &mut self,
        adapter: Arc<PluginBackendAdapter>,
        run: provisioning::RunId,
    ) {
        if self.scanning {
            return;
        }
        self.scanning = true;
        let reports = self.reports.clone();
        tokio::spawn(async move {
            let listing = list_all(&adapter, &run).await;
            let _ = reports.send(OrphanReport::Listed(listing));
        });
    }

    /// Folds a listing: new suspects, suspects that became owned or gone,
    /// and destroys of suspects whose grace ended.
    pub(crate) fn on_listing(
        &mut self,
        listing: &Listing,
        state: &ClusterState,
        adapter: &Arc<PluginBackendAdapter>,
        run: &provisioning::RunId,
    ) {
        self.scanning = false;
        let now = Instant::now();
        self.next_scan = now + self.interval;
        for (kind, listed) in listing {
            let Ok(listed) = listed else {
                // Nothing is known about this provider's resources this time;
                // its suspects wait for a listing that works.
                continue;
            };
            let mut seen = BTreeSet::new();
            for node in listed {
                if &node.key.run_id != run {
                    continue;
                }
                let id = (kind.clone(), node.key.clone());
                seen.insert(id.clone());
                if owned(state, &node.key) {
                    self.suspects.remove(&id);
                } else if !self.suspects.contains_key(&id) {
                    tracing::info!(provider = %kind, key = %node.key, lease = %node.lease.0,
                        "a resource no current attempt owns; destroyed after {:?} unless claimed", self.grace);
                    self.suspects.insert(
                        id,
                        Suspect {
                            lease: node.lease.clone(),
                            first_seen: now,
                        },
                    );
                }
            }
            self.suspects
                .retain(|(k, key), _| k != kind || seen.contains(&(k.clone(), key.clone())));
        }
        self.collect_due(state, adapter);
    }

    fn collect_due(&mut self, state: &ClusterState, adapter: &Arc<PluginBackendAdapter>) {
        let now = Instant::now();
        let due: Vec<_> = self
            .suspects
            .iter()
            .filter(|(id, s)| !self.destroying.contains(*id) && now >= s.first_seen + self.grace)
            .map(|(id, s)| (id.clone(), s.lease.clone()))
            .collect();
        for ((kind, key), lease) in due {
            if owned(state, &key) {
                self.suspects.remove(&(kind, key));
                continue;
            }
            let Some(plugin) = adapter.plugin(&kind).cloned() else {
                continue;
            };
            self.destroying.insert((kind.clone(), key.clone()));
            let reports = self.reports.clone();
            tokio::spawn(async move {
                let outcome = match tokio::time::timeout(
                    ORPHAN_DESTROY_TIMEOUT,
                    plugin.destroy_node(&key, &lease),
                )
                .await
                {
                    Ok(Ok(())) | Ok(Err(provisioning_provider::PluginError::NotFound(_))) => Ok(()),
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err("timed out".to_owned()),
                };
                let _ = reports.send(OrphanReport::Destroyed { kind, key, outcome });
            });
        }
    }

    pub(crate) fn on_destroyed(
        &mut self,
        kind: String,
        key: AttemptKey,
        outcome: Result<(), String>,
    ) {
        let id = (kind, key);
        self.destroying.remove(&id);
        match outcome {
            Ok(()) => {
                self.suspects.remove(&id);
                self.collected += 1;
                tracing::info!(provider = %id.0, key = %id.1, "orphan destroyed");
            }
            Err(error) => {
                // Still a suspect: the next scan tries again.
                tracing::warn!(provider = %id.0, key = %id.1, "orphan destroy failed: {error}");
            }
        }
    }

    /// Registers the suspects of the recovery listing (their grace starts now).
    pub(crate) fn seed(&mut self, kind: &str, node: &ListedNode) {
        self.suspects
            .entry((kind.to_owned(), node.key.clone()))
            .or_insert_with(|| Suspect {
                lease: node.lease.clone(),
                first_seen: Instant::now(),
            });
    }
}

/// Lists every plugin, each bounded by [`LIST_TIMEOUT`].
pub(crate) async fn list_all(adapter: &PluginBackendAdapter, run: &provisioning::RunId) -> Listing {
    let kinds: Vec<String> = adapter.kinds().map(str::to_owned).collect();
    let mut listing = Vec::with_capacity(kinds.len());
    for kind in kinds {
        let Some(plugin) = adapter.plugin(&kind) else {
            continue;
        };
        let listed = match tokio::time::timeout(LIST_TIMEOUT, plugin.list_nodes(run)).await {
            Ok(Ok(nodes)) => Ok(nodes),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err(format!("listing took longer than {LIST_TIMEOUT:?}")),
        };
        listing.push((kind, listed));
    }
    listing
}
