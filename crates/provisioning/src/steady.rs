//! The driver's dense record of which slots sit in the ready steady state.
//!
//! A full pass over a converged cluster decides "steady, nothing to do, no
//! timer" for every node, and at 100k nodes reading every ~360-byte node to
//! find that out is what the pass costs (memory traffic, not work). The
//! driver keeps one bit per slot instead: set when a pass decided the node
//! [`Rule::Steady`](crate::decide::Rule::Steady) against its group's desired
//! template with no stored backoff, cleared on every change of the node
//! (the driver's single writer path reports each one) and on every change of
//! the desired shape. While the bit is set, deciding the node again gives
//! the same answer at any instant (the decision reads no clock for such a
//! node), so a full pass counts it as evaluated without reading it.

use crate::id::{GroupId, LogicalNodeId};

/// One bit per slot, per group; a set bit means "decided steady since the
/// node and the desired shape last changed".
#[derive(Debug, Default)]
pub(crate) struct SteadySlots {
    /// In group-name order; found by pointer when there are a few (the
    /// driver's ids share their group's name with the desired state), else
    /// by a binary search on the name.
    groups: Vec<(GroupId, Vec<u64>)>,
}

impl SteadySlots {
    fn find(&self, group: &GroupId) -> Option<usize> {
        // A few groups: by pointer first (the driver's ids share their
        // group's name), which reads no name. Otherwise, or when the id was
        // made apart, a binary search: the list is kept in name order, so a
        // shape with many groups does not pay a scan per node change.
        if self.groups.len() <= 8
            && let Some(at) = self
                .groups
                .iter()
                .position(|(g, _)| g.shares_name_with(group))
        {
            return Some(at);
        }
        self.groups.binary_search_by(|(g, _)| g.cmp(group)).ok()
    }

    /// Whether the slot's bit is set.
    pub(crate) fn contains(&self, id: &LogicalNodeId) -> bool {
        let Some(at) = self.find(id.group()) else {
            return false;
        };
        let index = id.index() as usize;
        self.groups[at]
            .1
            .get(index / 64)
            .is_some_and(|word| word & (1 << (index % 64)) != 0)
    }

    /// Whether the bits of slots `0..count` of `group` are all set: every
    /// one of them holds a node decided steady.
    pub(crate) fn covers(&self, group: &GroupId, count: u32) -> bool {
        if count == 0 {
            return false;
        }
        let Some(at) = self.find(group) else {
            return false;
        };
        let words = &self.groups[at].1;
        let count = count as usize;
        let (full, rest) = (count / 64, count % 64);
        let Some(whole) = words.get(..full) else {
            return false;
        };
        whole.iter().all(|w| *w == u64::MAX)
            && (rest == 0
                || words
                    .get(full)
                    .is_some_and(|w| w | (u64::MAX << rest) == u64::MAX))
    }

    /// Sets the slot's bit, unless its index is beyond `bound` (a sparse
    /// group far past its nodes is simply decided the ordinary way, so the
    /// table stays within a few bits per node).
    pub(crate) fn insert(&mut self, id: &LogicalNodeId, bound: usize) {
        let index = id.index() as usize;
        if index >= bound {
            return;
        }
        let at = match self.find(id.group()) {
            Some(at) => at,
            None => {
                let at = self.groups.partition_point(|(g, _)| g < id.group());
                self.groups.insert(at, (id.group().clone(), Vec::new()));
                at
            }
        };
        let words = &mut self.groups[at].1;
        if words.len() <= index / 64 {
            words.resize(index / 64 + 1, 0);
        }
        words[index / 64] |= 1 << (index % 64);
    }

    /// Clears the slot's bit.
    pub(crate) fn remove(&mut self, id: &LogicalNodeId) {
        let Some(at) = self.find(id.group()) else {
            return;
        };
        let index = id.index() as usize;
        if let Some(word) = self.groups[at].1.get_mut(index / 64) {
            *word &= !(1 << (index % 64));
        }
    }

    /// Clears every bit.
    pub(crate) fn clear(&mut self) {
        self.groups.clear();
    }

    /// How far slot indices get a bit, for a map of `nodes` nodes.
    pub(crate) fn bound(nodes: usize) -> usize {
        nodes.saturating_mul(4).saturating_add(4096)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_per_slot_and_group_and_bounded() {
        let a = GroupId::new("a");
        let b = GroupId::new("b");
        let mut set = SteadySlots::default();
        let a3 = LogicalNodeId::new(a.clone(), 3);
        let a70 = LogicalNodeId::new(a.clone(), 70);
        let b3 = LogicalNodeId::new(b.clone(), 3);
        set.insert(&a3, 100);
        set.insert(&a70, 100);
        assert!(set.contains(&a3) && set.contains(&a70));
        assert!(!set.contains(&b3), "another group's slot");
        assert!(!set.contains(&LogicalNodeId::new(a.clone(), 4)));
        // Found by name as well as by pointer.
        assert!(set.contains(&LogicalNodeId::new(GroupId::new("a"), 3)));
        set.remove(&a3);
        assert!(!set.contains(&a3) && set.contains(&a70));
        set.insert(&LogicalNodeId::new(b.clone(), 100), 100);
        assert!(!set.contains(&LogicalNodeId::new(b, 100)), "past the bound");
        set.clear();
        assert!(!set.contains(&a70));
        let c = GroupId::new("c");
        assert!(!set.covers(&c, 0) && !set.covers(&c, 3));
        for count in [1, 63, 64, 65, 130] {
            set.clear();
            for index in 0..count {
                set.insert(&LogicalNodeId::new(c.clone(), index), 1000);
            }
            assert!(set.covers(&c, count), "{count}");
            assert!(set.covers(&c, count - 1) || count == 1);
            assert!(!set.covers(&c, count + 1), "{count}");
            set.remove(&LogicalNodeId::new(c.clone(), count - 1));
            assert!(!set.covers(&c, count), "{count}");
        }
    }

    #[test]
    fn many_groups_are_found_by_name_in_any_insert_order() {
        let mut set = SteadySlots::default();
        let names: Vec<String> = (0..20).rev().map(|g| format!("g{g:02}")).collect();
        for name in &names {
            set.insert(&LogicalNodeId::new(GroupId::new(name.as_str()), 1), 100);
        }
        for name in &names {
            // A fresh id: another allocation of the same name.
            let id = LogicalNodeId::new(GroupId::new(name.as_str()), 1);
            assert!(set.contains(&id), "{name}");
            assert!(!set.contains(&LogicalNodeId::new(GroupId::new(name.as_str()), 2)));
        }
        set.remove(&LogicalNodeId::new(GroupId::new("g07"), 1));
        assert!(!set.contains(&LogicalNodeId::new(GroupId::new("g07"), 1)));
        assert!(set.contains(&LogicalNodeId::new(GroupId::new("g08"), 1)));
    }
}
