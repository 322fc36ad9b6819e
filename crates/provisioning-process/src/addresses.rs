//! A loopback address of its own for every slot (design §22): local nodes
//! share one machine, so each agent binds its control listener on the
//! slot's address, which becomes the node's endpoint and its workload's
//! `PROVISION_ADDRESS`. Workloads of several nodes can then bind the same
//! port, each on its own address, as they would on separate machines.
//!
//! Addresses are handed out in order from [`FIRST_ADDRESS`] the first time a
//! slot is created and kept for the slot, so a replacement gets the address
//! of the attempt it replaces. Addresses of agents adopted from an earlier
//! controller are reserved for their slots and never handed to another.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use provisioning::LogicalNodeId;

/// The first address handed out: `127.1.0.1`, clear of `127.0.0.1`, which
/// other local services use.
pub(crate) const FIRST_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 1, 0, 1);

/// The last address handed out; past it, slots share `127.0.0.1`.
pub(crate) const LAST_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 255, 255, 254);

/// The slots' addresses.
#[derive(Debug)]
pub(crate) struct SlotAddresses {
    by_slot: BTreeMap<LogicalNodeId, Ipv4Addr>,
    taken: BTreeSet<Ipv4Addr>,
    next: u32,
}

impl Default for SlotAddresses {
    fn default() -> Self {
        SlotAddresses {
            by_slot: BTreeMap::new(),
            taken: BTreeSet::new(),
            next: u32::from(FIRST_ADDRESS),
        }
    }
}

impl SlotAddresses {
    /// The address of `slot`: the one it had, or the next free one.
    pub(crate) fn of(&mut self, slot: &LogicalNodeId) -> Ipv4Addr {
        if let Some(address) = self.by_slot.get(slot) {
            return *address;
        }
        // Bounded by the address range: each turn moves `next` up by one.
        while self.next <= u32::from(LAST_ADDRESS) {
            let candidate = Ipv4Addr::from(self.next);
            self.next += 1;
            if self.taken.insert(candidate) {
                self.by_slot.insert(slot.clone(), candidate);
                return candidate;
            }
        }
        Ipv4Addr::LOCALHOST
    }

    /// Reserves `address` for `slot` (an adopted agent listens on it).
    pub(crate) fn reserve(&mut self, slot: &LogicalNodeId, address: Ipv4Addr) {
        if address == Ipv4Addr::LOCALHOST {
            return;
        }
        self.taken.insert(address);
        self.by_slot.insert(slot.clone(), address);
    }
}

#[cfg(test)]
mod tests {
    use provisioning::GroupId;

    use super::*;

    fn slot(group: &str, index: u32) -> LogicalNodeId {
        LogicalNodeId::new(GroupId::new(group), index)
    }

    #[test]
    fn every_slot_gets_its_own_address_and_keeps_it() {
        let mut addresses = SlotAddresses::default();
        let a = addresses.of(&slot("web", 0));
        let b = addresses.of(&slot("web", 1));
        let c = addresses.of(&slot("db", 0));
        assert_eq!(a, FIRST_ADDRESS);
        assert!(a != b && b != c && a != c);
        assert_eq!(addresses.of(&slot("web", 1)), b, "a replacement keeps it");
    }

    #[test]
    fn an_adopted_agents_address_is_never_handed_to_another_slot() {
        let mut addresses = SlotAddresses::default();
        addresses.reserve(&slot("web", 3), FIRST_ADDRESS);
        let other = addresses.of(&slot("web", 0));
        assert_ne!(other, FIRST_ADDRESS);
        assert_eq!(addresses.of(&slot("web", 3)), FIRST_ADDRESS);
    }
}
