//! Change tracking: every change of a node passes through here, so the
//! driver knows which nodes changed since a host last took its changes, and
//! the durable form of what it holds, whole or in part.
//!
//! A host that journals the state asks for tracking
//! ([`ClusterDriver::track_changes`]) and takes the changes after every drive,
//! owned or borrowed; a host that journals nothing may take only the ids.

use std::collections::{BTreeMap, BTreeSet};

use super::ClusterDriver;
use crate::durable::{
    ChangeTracker, DURABLE_FORMAT, DriverChanges, DriverChangesView, DurableEntry, DurableEntryRef,
    DurableMeta, DurableNodeRef, DurableState,
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
    }

    /// The meta (desired shape, observed generation, allocator) changed.
    pub(super) fn meta_changed(&mut self) {
        if let Some(changes) = &mut self.changes {
            changes.meta = true;
        }
    }

    /// Starts tracking what changes, for a host that journals the state:
    /// from now on [`ClusterDriver::take_changes`] returns the nodes and meta
    /// that changed since its last call. The first change set holds the
    /// whole state.
    pub fn track_changes(&mut self) {
        let nodes = self.state.nodes.keys().cloned().collect();
        self.changes = Some(ChangeTracker {
            nodes,
            meta: true,
            written_breakers: BTreeMap::new(),
        });
    }

    /// The changes since the last call (empty when nothing changed, or when
    /// changes are not tracked). `now` is recorded in the meta as the
    /// writer's clock. Take them after a drive and commit them before
    /// submitting the operations that drive produced.
    pub fn take_changes(&mut self, now: Timestamp) -> DriverChanges {
        self.take_change_view(now).to_owned_changes()
    }

    /// [`ClusterDriver::take_changes`] with the changed nodes borrowed from
    /// the driver instead of copied: what a host that only encodes them
    /// uses. The changes are taken either way.
    pub fn take_change_view(&mut self, now: Timestamp) -> DriverChangesView<'_> {
        let Some(tracker) = self.changes.as_mut() else {
            return DriverChangesView::default();
        };
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
        let meta =
            std::mem::replace(&mut tracker.meta, false) || breakers_changed || !nodes.is_empty();
        let mut changes = DriverChangesView {
            meta: meta.then(|| std::borrow::Cow::Owned(self.durable_meta(now))),
            ..DriverChangesView::default()
        };
        for id in nodes {
            match self.state.nodes.get(&id) {
                Some(node) => changes.upserts.push(durable_entry_ref(node)),
                None => changes.removed.push(id),
            }
        }
        changes
    }

    /// Forgets the changes since the last change set without building one:
    /// for a host that only needs to know *whether* something changed
    /// ([`ClusterDriver::has_changes`]), at no cost per changed node.
    pub fn discard_changes(&mut self) {
        if let Some(tracker) = self.changes.as_mut() {
            tracker.nodes.clear();
            tracker.meta = false;
            // The breakers as they are now count as written too, or
            // `has_changes` would go on saying a breaker change waits.
            if tracker.written_breakers != self.limit_state.breakers {
                tracker.written_breakers = self.limit_state.breakers.clone();
            }
        }
    }

    /// Takes the changes without building a change set: the ids of the
    /// nodes inserted, changed or removed since the last one (moved out, in
    /// slot order), and whether anything else changed (the meta or a
    /// breaker). For a host that journals nothing and keeps its own view of
    /// the nodes up to date; costs no work per changed node.
    pub fn take_changed_nodes(&mut self) -> (BTreeSet<LogicalNodeId>, bool) {
        let Some(tracker) = self.changes.as_mut() else {
            return (BTreeSet::new(), false);
        };
        let breakers_changed = tracker.written_breakers != self.limit_state.breakers;
        if breakers_changed {
            tracker.written_breakers = self.limit_state.breakers.clone();
        }
        let meta = std::mem::replace(&mut tracker.meta, false) || breakers_changed;
        (std::mem::take(&mut tracker.nodes), meta)
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
    let entry = durable_entry_ref(node);
    DurableEntry {
        node: entry.node.to_node(),
        template: entry.template.clone(),
    }
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
