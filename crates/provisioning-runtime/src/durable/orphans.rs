//! Orphan collection: a periodic scan lists every provider, a resource no
//! node's current attempt owns becomes a suspect, and a suspect still
//! unowned after its grace is destroyed in the background. A resource a
//! current attempt owns is never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use provisioning::{ClusterState, LeaseHandle, NodeStage};
use provisioning_provider::{AttemptKey, ListedNode, PluginBackendAdapter};
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
