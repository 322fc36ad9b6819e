//! Change tracking: every change of a node passes through here, so the
//! driver knows which nodes changed since a host last took its changes, and
//! the durable form of what it holds, whole or in part.
//!
//! A host that journals the state or keeps its own view of the nodes asks
//! for tracking ([`ClusterDriver::track_changes`]) and takes the changes
//! after every drive ([`ClusterDriver::take_changes`]): one take, whose
//! [`DriverChangesView`] each host reads as far as it needs — the ids alone,
//! the borrowed entries to encode, or an owned copy. The whole state is
//! [`ClusterDriver::durable_state`].

use std::collections::{BTreeMap, BTreeSet};

use super::ClusterDriver;
use crate::durable::{
    ChangeTracker, DURABLE_FORMAT, DriverChanges, DurableEntry, DurableEntryRef, DurableMeta,
    DurableNodeRef, DurableState,
};
use crate::id::LogicalNodeId;
use crate::state::ManagedNode;
use crate::time::Timestamp;

impl ClusterDriver {
    /// A node changed and the next pass must look at it.
    pub(super) fn touch(&mut self, node: &LogicalNodeId) {
        self.schedule.mark_dirty(node);
        self.node_changed(node);
        self.schedule.request_pass();
    }

    /// Every change of a node (its insert, every fold, transition and
    /// dispatch, its removal) passes through here.
    pub(super) fn node_changed(&mut self, node: &LogicalNodeId) {
        self.steady.remove(node);
        if let Some(changes) = &mut self.changes {
            if !changes.nodes.contains(node) {
                changes.nodes.insert(node.clone());
            }
        }
        if let Some(membership) = &mut self.membership {
            if !membership.dirty.contains(node) {
                membership.dirty.insert(node.clone());
            }
        }
    }

    /// The meta (desired shape, observed generation, allocator) changed.
    pub(super) fn meta_changed(&mut self) {
        if let Some(changes) = &mut self.changes {
            changes.meta = true;
        }
    }

    /// Starts tracking what changes, for a host that journals the state
    /// or keeps its own view of the nodes: from now on
    /// [`ClusterDriver::take_changes`] hands out the nodes and meta that
    /// changed since its last call. The first changes hold the whole state.
    pub fn track_changes(&mut self) {
        let nodes = self.state.nodes.keys().cloned().collect();
        self.changes = Some(ChangeTracker {
            nodes,
            meta: true,
            written_breakers: BTreeMap::new(),
        });
    }

    /// Takes the changes since the last call (none when nothing changed, or
    /// when changes are not tracked): the ids of the nodes inserted, changed
    /// or removed are moved out of the tracker, and the view reads the rest
    /// from the driver only when asked, so each host pays for what it reads
    /// — the ids alone ([`DriverChangesView::into_nodes`]), the borrowed
    /// entries to encode ([`DriverChangesView::entries`],
    /// [`DriverChangesView::meta`]) or an owned copy
    /// ([`DriverChangesView::to_owned_changes`]). Dropping the view unread
    /// discards the changes. `now` is the writer's clock the meta records.
    /// Take them after a drive and commit them before submitting the
    /// operations that drive produced.
    pub fn take_changes(&mut self, now: Timestamp) -> DriverChangesView<'_> {
        let Some(tracker) = self.changes.as_mut() else {
            return DriverChangesView {
                driver: self,
                now,
                nodes: BTreeSet::new(),
                written: false,
            };
        };
        // The breakers as they are now count as written, whatever the host
        // reads of the view: or `has_changes` would go on saying a breaker
        // change waits.
        let breakers_changed = tracker.written_breakers != self.limit_state.breakers;
        if breakers_changed {
            tracker.written_breakers = self.limit_state.breakers.clone();
        }
        let nodes = std::mem::take(&mut tracker.nodes);
        // The meta goes with every write, so that its clock is the clock of
        // the latest instants written: recovery reads every stored instant
        // against it. A meta written only when it changed would keep an old
        // clock, and a node's backoff written since would come back late by
        // all the time in between.
        let written =
            std::mem::replace(&mut tracker.meta, false) || breakers_changed || !nodes.is_empty();
        DriverChangesView {
            driver: self,
            now,
            nodes,
            written,
        }
    }

    /// Whether changes are waiting for [`ClusterDriver::take_changes`]
    /// (a breaker that changed alone counts: it is part of the meta).
    pub fn has_changes(&self) -> bool {
        self.changes.as_ref().is_some_and(|c| {
            c.meta || !c.nodes.is_empty() || c.written_breakers != self.limit_state.breakers
        })
    }

    fn durable_meta(&self, now: Timestamp) -> DurableMeta {
        DurableMeta {
            format: DURABLE_FORMAT,
            desired: self.desired.shape().clone(),
            observed_generation: self.state.observed_generation,
            next_attempt: self.state.attempts.next_unallocated(),
            written_at: now,
            breakers: self.limit_state.breakers.clone(),
        }
    }

    /// The whole durable state, as a journal would hold it after every
    /// change set so far was committed.
    pub fn durable_state(&self, now: Timestamp) -> DurableState {
        DurableState {
            meta: self.durable_meta(now),
            nodes: self
                .state
                .nodes
                .values()
                .map(|n| durable_entry(n))
                .collect(),
        }
    }
}

fn durable_entry(node: &ManagedNode) -> DurableEntry {
    durable_entry_ref(node).to_entry()
}

fn durable_entry_ref(node: &ManagedNode) -> DurableEntryRef<'_> {
    DurableEntryRef {
        node: DurableNodeRef {
            node: node.spec.id(),
            attempt: node.attempt,
            intent: node.intent,
            record: &node.record,
            pending: node.pending.as_ref(),
            next_sequence: node.next_sequence,
            retry: &node.retry,
        },
        template: node.spec.shared_template(),
    }
}

/// The changes a host took from the driver ([`ClusterDriver::take_changes`]):
/// the ids of the nodes inserted, changed or removed, moved out of the
/// tracker, and the driver borrowed to read their entries and the meta from
/// when asked. Reading costs only what is read: the ids cost nothing per
/// node, each entry is borrowed, never copied, until
/// [`DriverChangesView::to_owned_changes`]. The changes are taken whether or
/// not the view is read; dropping it unread discards them.
#[derive(Debug)]
#[must_use = "dropping the view discards the changes it took"]
pub struct DriverChangesView<'a> {
    driver: &'a ClusterDriver,
    /// The writer's clock, recorded in the meta.
    now: Timestamp,
    /// The nodes inserted, changed or removed, in slot order.
    nodes: BTreeSet<LogicalNodeId>,
    /// Whether anything is to be written (a node, the meta or a breaker
    /// changed): the meta goes with every write.
    written: bool,
}

impl<'a> DriverChangesView<'a> {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        !self.written
    }

    /// The ids of the nodes inserted, changed or removed, in slot order.
    pub fn nodes(&self) -> &BTreeSet<LogicalNodeId> {
        &self.nodes
    }

    /// The ids of the nodes inserted, changed or removed, moved out: what a
    /// host that keeps its own view of the nodes needs, at no cost per node.
    pub fn into_nodes(self) -> BTreeSet<LogicalNodeId> {
        self.nodes
    }

    /// The meta, whenever anything is written (see [`DriverChanges::meta`]),
    /// built on each call.
    pub fn meta(&self) -> Option<DurableMeta> {
        self.written.then(|| self.driver.durable_meta(self.now))
    }

    /// Each changed node in slot order, with its entry borrowed from the
    /// driver, or `None` when it left the map (reaped).
    pub fn entries(
        &self,
    ) -> impl Iterator<Item = (&LogicalNodeId, Option<DurableEntryRef<'a>>)> + '_ {
        let map = &self.driver.state.nodes;
        self.nodes
            .iter()
            .map(move |id| (id, map.get(id).map(|node| durable_entry_ref(node))))
    }

    /// The owned changes: the meta, and every changed node copied.
    pub fn to_owned_changes(&self) -> DriverChanges {
        let mut changes = DriverChanges {
            meta: self.meta(),
            ..DriverChanges::default()
        };
        for (id, entry) in self.entries() {
            match entry {
                Some(entry) => changes.upserts.push(entry.to_entry()),
                None => changes.removed.push(id.clone()),
            }
        }
        changes
    }
}
