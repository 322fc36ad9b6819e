//! The deadlines of pending operations, by instant.
//!
//! Every dispatch registers its node under its deadline and every fold of a
//! pending operation ends one registration there. A bring-up does both a
//! hundred thousand times per step, and most of a step's operations share
//! one deadline, so the index is a small map of instants, each with a list
//! its registrations are pushed onto, instead of one ordered set of
//! (instant, node) pairs searched on every insert and removal.
//!
//! A fold takes its node's id off the list when it is at either end (results
//! mostly come in the order their operations went out, so they usually are);
//! otherwise the id stays until the list is compacted. So a list may hold
//! ids of operations that ended since: readers check each id against the
//! node's pending operation, an instant is dropped as soon as none of its
//! registrations is live, and a list is compacted when it holds more than
//! about twice its live ids, so it never outgrows what is pending by more
//! than that.

use std::collections::{BTreeMap, VecDeque};

use crate::id::LogicalNodeId;
use crate::state::{ManagedNode, PendingOperation};
use crate::time::Timestamp;

/// Ids a list holds beyond twice its live ones before it is compacted.
const SLACK: usize = 32;

/// The pending operations' deadlines.
#[derive(Debug, Default)]
pub(crate) struct Deadlines {
    at: BTreeMap<Timestamp, Registered>,
}

/// The registrations at one instant.
#[derive(Debug, Default)]
struct Registered {
    /// Nodes registered here, in registration order; may hold the id of a
    /// node whose operation ended since, or an id twice.
    ids: VecDeque<LogicalNodeId>,
    /// Registrations not yet ended.
    live: usize,
}

type Nodes = BTreeMap<LogicalNodeId, Box<ManagedNode>>;

/// `node`'s pending operation, if it is due at `at`.
fn pending_at<'n>(
    nodes: &'n Nodes,
    node: &LogicalNodeId,
    at: Timestamp,
) -> Option<&'n PendingOperation> {
    nodes
        .get(node)
        .and_then(|n| n.pending.as_ref())
        .filter(|p| p.deadline == at)
}

impl Deadlines {
    /// Registers `node`'s pending operation, due at `at`. `nodes` holds it
    /// already (a compaction keeps the ids whose operation is still due
    /// there).
    pub(crate) fn insert(&mut self, at: Timestamp, node: &LogicalNodeId, nodes: &Nodes) {
        let registered = self.at.entry(at).or_default();
        registered.live += 1;
        registered.ids.push_back(node.clone());
        if registered.ids.len() > registered.live.saturating_mul(2) + SLACK {
            let mut ids: Vec<LogicalNodeId> = std::mem::take(&mut registered.ids).into();
            ids.retain(|id| pending_at(nodes, id, at).is_some());
            ids.sort_unstable();
            ids.dedup();
            registered.ids = ids.into();
        }
    }

    /// Ends `node`'s registration at `at`: its pending operation, due then,
    /// was folded. A node has one pending operation at most, so no copy of
    /// its id at `at` is live any more.
    pub(crate) fn remove(&mut self, at: Timestamp, node: &LogicalNodeId) {
        if let Some(registered) = self.at.get_mut(&at) {
            debug_assert!(registered.live > 0, "a deadline ended twice");
            registered.live = registered.live.saturating_sub(1);
            if registered.live == 0 {
                self.at.remove(&at);
            } else if registered.ids.front() == Some(node) {
                registered.ids.pop_front();
            } else if registered.ids.back() == Some(node) {
                registered.ids.pop_back();
            }
        }
    }

    /// The earliest deadline of a pending operation.
    pub(crate) fn first(&self) -> Option<Timestamp> {
        self.at.keys().next().copied()
    }

    /// The pending operations due at or before `now`, with their nodes: by
    /// deadline, then by node, each once.
    pub(crate) fn due<'a>(
        &'a self,
        now: Timestamp,
        nodes: &'a Nodes,
    ) -> impl Iterator<Item = (&'a LogicalNodeId, &'a PendingOperation)> {
        self.at
            .iter()
            .take_while(move |(at, _)| now.reached(**at))
            .flat_map(|(&at, registered)| {
                let mut due: Vec<(&LogicalNodeId, &PendingOperation)> = registered
                    .ids
                    .iter()
                    .filter_map(|id| Some((id, pending_at(nodes, id, at)?)))
                    .collect();
                due.sort_unstable_by_key(|(id, _)| *id);
                due.dedup_by_key(|(id, _)| *id);
                due
            })
    }

    /// How many ids the lists hold, live or not.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.at.values().map(|r| r.ids.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::effect::EffectKind;
    use crate::id::{GroupId, OperationId};
    use crate::state::test_node;

    fn id(index: u32) -> LogicalNodeId {
        LogicalNodeId::new(GroupId::new("g"), index)
    }

    /// Gives node `index` a pending operation due at `at` and registers it.
    fn dispatch(deadlines: &mut Deadlines, nodes: &mut Nodes, index: u32, at: u64) {
        let at = Timestamp::from_millis(at);
        let node = nodes
            .entry(id(index))
            .or_insert_with(|| Box::new(test_node(index, u64::from(index) + 1)));
        let sequence = node.next_sequence;
        node.next_sequence = sequence.next().unwrap();
        node.pending = Some(PendingOperation {
            id: OperationId::new(node.attempt, sequence),
            kind: EffectKind::CreateLease,
            dispatched_at: Timestamp::ZERO,
            deadline: at,
        });
        deadlines.insert(at, &id(index), nodes);
    }

    /// Folds node `index`'s pending operation.
    fn fold(deadlines: &mut Deadlines, nodes: &mut Nodes, index: u32) {
        let pending = nodes.get_mut(&id(index)).unwrap().pending.take().unwrap();
        deadlines.remove(pending.deadline, &id(index));
    }

    fn due(deadlines: &Deadlines, nodes: &Nodes, now: u64) -> Vec<(u64, u32)> {
        deadlines
            .due(Timestamp::from_millis(now), nodes)
            .map(|(id, pending)| (pending.deadline.as_millis(), id.index()))
            .collect()
    }

    #[test]
    fn due_operations_come_by_deadline_then_node_each_once_and_ended_ones_never() {
        let (mut deadlines, mut nodes) = (Deadlines::default(), Nodes::new());
        for index in [5, 1, 3] {
            dispatch(&mut deadlines, &mut nodes, index, 20);
        }
        dispatch(&mut deadlines, &mut nodes, 2, 10);
        dispatch(&mut deadlines, &mut nodes, 4, 30);
        assert_eq!(deadlines.first(), Some(Timestamp::from_millis(10)));
        assert_eq!(due(&deadlines, &nodes, 9), []);
        assert_eq!(
            due(&deadlines, &nodes, 20),
            [(10, 2), (20, 1), (20, 3), (20, 5)]
        );
        // Node 3's operation ends, and its next is due at the same instant:
        // listed once. Node 1's ends for good.
        fold(&mut deadlines, &mut nodes, 3);
        dispatch(&mut deadlines, &mut nodes, 3, 20);
        fold(&mut deadlines, &mut nodes, 1);
        assert_eq!(due(&deadlines, &nodes, 25), [(10, 2), (20, 3), (20, 5)]);
        // An instant with nothing live left is gone.
        fold(&mut deadlines, &mut nodes, 2);
        assert_eq!(deadlines.first(), Some(Timestamp::from_millis(20)));
        fold(&mut deadlines, &mut nodes, 3);
        fold(&mut deadlines, &mut nodes, 5);
        assert_eq!(deadlines.first(), Some(Timestamp::from_millis(30)));
        fold(&mut deadlines, &mut nodes, 4);
        assert_eq!(deadlines.first(), None);
        assert_eq!(deadlines.held(), 0);
    }

    #[test]
    fn a_list_never_holds_much_more_than_twice_its_live_ids() {
        let (mut deadlines, mut nodes) = (Deadlines::default(), Nodes::new());
        dispatch(&mut deadlines, &mut nodes, 0, 50);
        // Node 1's operations end in the middle of the list, again and
        // again, while node 0 keeps the instant alive; node 2's end at the
        // back and are taken off at once.
        for _ in 0..1000 {
            dispatch(&mut deadlines, &mut nodes, 1, 50);
            dispatch(&mut deadlines, &mut nodes, 2, 50);
            fold(&mut deadlines, &mut nodes, 1);
            fold(&mut deadlines, &mut nodes, 2);
            assert!(deadlines.held() <= 2 * 3 + SLACK);
        }
        dispatch(&mut deadlines, &mut nodes, 1, 50);
        assert_eq!(due(&deadlines, &nodes, 50), [(50, 0), (50, 1)]);
        // Taken in the order they went out, they leave nothing behind.
        fold(&mut deadlines, &mut nodes, 0);
        dispatch(&mut deadlines, &mut nodes, 2, 50);
        let held = deadlines.held();
        fold(&mut deadlines, &mut nodes, 2);
        assert_eq!(deadlines.held(), held - 1, "the back is taken off");
        assert_eq!(due(&deadlines, &nodes, 50), [(50, 1)]);
    }
}
