//! A loopback address of its own for every slot (design §22): local nodes
//! share one machine, so each agent binds its control listener on the
//! slot's address, which becomes the node's endpoint and its workload's
//! `PROVISION_ADDRESS`. Workloads of several nodes can then bind the same
//! port, each on its own address, as they would on separate machines.
//!
//! A run's addresses are those of one `127.B.0.0/16` block, `B` (1 to 254)
//! derived from the run's name, so two runs on one machine rarely share
//! addresses. They are handed out in order from `127.B.0.1` the first time a
//! slot is created and kept for the slot, so a replacement gets the address
//! of the attempt it replaces. Addresses of agents adopted from an earlier
//! controller are reserved for their slots and never handed to another.
//! Past the block's last address, slots share `127.0.0.1`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use provisioning::{LogicalNodeId, RunId};

/// The slots' addresses.
#[derive(Debug)]
pub(crate) struct SlotAddresses {
    by_slot: BTreeMap<LogicalNodeId, Ipv4Addr>,
    taken: BTreeSet<Ipv4Addr>,
    next: u32,
    last: u32,
}

/// The second octet of `run`'s block: 1 to 254 (FNV-1a of its name), clear
/// of `127.0.0.1`, which other local services use.
fn block_of(run: &RunId) -> u8 {
    let hash = run
        .as_str()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    1 + u8::try_from(hash % 254).unwrap_or(0)
}

impl SlotAddresses {
    /// The addresses of `run`'s slots, none handed out yet.
    pub(crate) fn new(run: &RunId) -> Self {
        let block = block_of(run);
        SlotAddresses {
            by_slot: BTreeMap::new(),
            taken: BTreeSet::new(),
            next: u32::from(Ipv4Addr::new(127, block, 0, 1)),
            last: u32::from(Ipv4Addr::new(127, block, 255, 254)),
        }
    }

    /// The address of `slot`: the one it had, or the next free one.
    pub(crate) fn of(&mut self, slot: &LogicalNodeId) -> Ipv4Addr {
        if let Some(address) = self.by_slot.get(slot) {
            return *address;
        }
        // Bounded by the address range: each turn moves `next` up by one.
        while self.next <= self.last {
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
        let run = RunId::new("demo");
        let mut addresses = SlotAddresses::new(&run);
        let a = addresses.of(&slot("web", 0));
        let b = addresses.of(&slot("web", 1));
        let c = addresses.of(&slot("db", 0));
        assert_eq!(a, Ipv4Addr::new(127, block_of(&run), 0, 1));
        assert!(a.is_loopback() && a != Ipv4Addr::LOCALHOST);
        assert!(a != b && b != c && a != c);
        assert_eq!(addresses.of(&slot("web", 1)), b, "a replacement keeps it");
    }

    #[test]
    fn an_adopted_agents_address_is_never_handed_to_another_slot() {
        let run = RunId::new("demo");
        let mut addresses = SlotAddresses::new(&run);
        let first = Ipv4Addr::new(127, block_of(&run), 0, 1);
        addresses.reserve(&slot("web", 3), first);
        let other = addresses.of(&slot("web", 0));
        assert_ne!(other, first);
        assert_eq!(addresses.of(&slot("web", 3)), first);
    }

    #[test]
    fn runs_get_blocks_of_their_own() {
        let blocks: BTreeSet<u8> = ["a", "b", "c", "demo", "e2e-peers-1"]
            .iter()
            .map(|run| block_of(&RunId::new(*run)))
            .collect();
        assert!(blocks.len() > 1, "{blocks:?}");
        assert!(blocks.iter().all(|b| (1..=254).contains(b)));
    }
}
