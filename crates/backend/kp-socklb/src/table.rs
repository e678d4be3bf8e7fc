//! What the maps should hold, and the map writes that get them there (sans I/O).
//!
//! Each Service port has an id and `count` endpoint slots. A change is written in an order
//! that keeps every lookup the programs make valid at every step: slots a new count will use
//! are written before the count, and slots past a smaller count are deleted after it. A
//! program that still finds no slot (a race with a removal) leaves the socket's address
//! alone, and nftables mode's rules serve it.

use std::collections::HashMap;
use std::net::SocketAddr;

use kp_core::model::IpFamily;

use crate::layout::{ServiceEntry, ServiceKey, SlotKey};

/// One map write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapOp {
    /// `kp_slots[key] = endpoint`.
    PutSlot {
        /// The slot.
        key: SlotKey,
        /// The endpoint it holds (its family picks the slots map).
        endpoint: SocketAddr,
    },
    /// Remove a slot (absent already is fine).
    DeleteSlot {
        /// The slot.
        key: SlotKey,
        /// Whose slots map.
        family: IpFamily,
    },
    /// `kp_services[key] = entry`.
    PutService {
        /// The Service port.
        key: ServiceKey,
        /// Its id and slot count.
        entry: ServiceEntry,
    },
    /// Remove a Service port (absent already is fine).
    DeleteService(ServiceKey),
}

/// A Service port as written.
#[derive(Clone, Debug)]
struct Placed {
    id: u32,
    endpoints: Vec<SocketAddr>,
    /// The maps are known to hold `endpoints` (false after a failed write).
    in_sync: bool,
    /// Slots `0..high` may hold something.
    high: u32,
}

/// The Service ports the maps hold, with their ids.
#[derive(Debug, Default)]
pub struct ServiceTable {
    services: HashMap<ServiceKey, Placed>,
    free_ids: Vec<u32>,
    next_id: u32,
}

impl ServiceTable {
    /// The writes that make `key` send to `endpoints` (sorted and deduplicated: each
    /// endpoint one slot, equally likely; none means refused), in a safe order. Call
    /// [`Self::written`] or [`Self::failed`] once they were applied or not.
    pub fn set(&mut self, key: ServiceKey, endpoints: &[SocketAddr]) -> Vec<MapOp> {
        let mut wanted = endpoints.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        let Some(placed) = self.services.get(&key) else {
            let id = self.free_ids.pop().unwrap_or_else(|| self.take_id());
            let ops = slot_writes(id, &[], &wanted, false);
            let ops = with_entry(ops, key, id, wanted.len(), 0);
            self.services.insert(key, pending(id, wanted, 0));
            return ops;
        };
        if placed.in_sync && placed.endpoints == wanted {
            return Vec::new();
        }
        let (id, high) = (placed.id, placed.high);
        let ops = slot_writes(id, &placed.endpoints, &wanted, placed.in_sync);
        let ops = with_entry(ops, key, id, wanted.len(), high);
        self.services.insert(key, pending(id, wanted, high));
        ops
    }

    /// The writes that remove `key` (none if it is not here). Call [`Self::removed`] once
    /// they were applied; after a failure `key` stays, and the next remove retries them.
    pub fn remove(&self, key: ServiceKey) -> Vec<MapOp> {
        let Some(placed) = self.services.get(&key) else {
            return Vec::new();
        };
        let (id, family) = (placed.id, key.family());
        let slots =
            (0..placed.high.max(count(placed.endpoints.len()))).map(|slot| MapOp::DeleteSlot {
                key: SlotKey { id, slot },
                family,
            });
        std::iter::once(MapOp::DeleteService(key))
            .chain(slots)
            .collect()
    }

    /// The writes [`Self::remove`] returned for `key` are applied: its id is free again.
    pub fn removed(&mut self, key: ServiceKey) {
        if let Some(placed) = self.services.remove(&key) {
            self.free_ids.push(placed.id);
        }
    }

    /// The writes [`Self::set`] returned for `key` are in the maps.
    pub fn written(&mut self, key: ServiceKey) {
        if let Some(placed) = self.services.get_mut(&key) {
            placed.in_sync = true;
            placed.high = count(placed.endpoints.len());
        }
    }

    /// Some write [`Self::set`] returned for `key` failed: the next set rewrites it whole.
    pub fn failed(&mut self, key: ServiceKey) {
        if let Some(placed) = self.services.get_mut(&key) {
            placed.in_sync = false;
            placed.high = placed.high.max(count(placed.endpoints.len()));
        }
    }

    /// The endpoints `key` sends to, if it is here.
    pub fn endpoints(&self, key: ServiceKey) -> Option<&[SocketAddr]> {
        self.services.get(&key).map(|p| p.endpoints.as_slice())
    }

    /// The Service ports here.
    pub fn keys(&self) -> impl Iterator<Item = ServiceKey> + '_ {
        self.services.keys().copied()
    }

    /// How many Service ports are here.
    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// Whether no Service port is here.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    fn take_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }
}

fn pending(id: u32, endpoints: Vec<SocketAddr>, high: u32) -> Placed {
    Placed {
        id,
        endpoints,
        in_sync: false,
        high,
    }
}

/// A slot count: a Service port has far fewer endpoints than `u32::MAX`.
fn count(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

/// Puts for the slots of `new` that differ from `old` (all of them unless `trusted`).
fn slot_writes(id: u32, old: &[SocketAddr], new: &[SocketAddr], trusted: bool) -> Vec<MapOp> {
    new.iter()
        .enumerate()
        .filter(|&(slot, endpoint)| !trusted || old.get(slot) != Some(endpoint))
        .map(|(slot, &endpoint)| MapOp::PutSlot {
            key: SlotKey {
                id,
                slot: count(slot),
            },
            endpoint,
        })
        .collect()
}

/// `ops`, then the service entry, then deletes of the slots from `len` up to `high`.
fn with_entry(mut ops: Vec<MapOp>, key: ServiceKey, id: u32, len: usize, high: u32) -> Vec<MapOp> {
    let len = count(len);
    ops.push(MapOp::PutService {
        key,
        entry: ServiceEntry { id, count: len },
    });
    let family = key.family();
    ops.extend((len..high).map(|slot| MapOp::DeleteSlot {
        key: SlotKey { id, slot },
        family,
    }));
    ops
}

#[cfg(test)]
mod tests {
    use kp_core::model::Protocol;

    use super::*;

    fn key() -> ServiceKey {
        ServiceKey::new("10.96.0.10:80".parse().expect("literal"), Protocol::Tcp)
    }

    fn eps(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|e| e.parse().expect("literal")).collect()
    }

    fn put(id: u32, slot: u32, endpoint: &str) -> MapOp {
        MapOp::PutSlot {
            key: SlotKey { id, slot },
            endpoint: endpoint.parse().expect("literal"),
        }
    }

    fn entry(id: u32, count: u32) -> MapOp {
        MapOp::PutService {
            key: key(),
            entry: ServiceEntry { id, count },
        }
    }

    #[test]
    fn a_new_service_writes_its_slots_before_its_count() {
        let mut table = ServiceTable::default();
        let ops = table.set(key(), &eps(&["10.0.0.2:80", "10.0.0.1:80", "10.0.0.2:80"]));
        assert_eq!(
            ops,
            [
                put(0, 0, "10.0.0.1:80"),
                put(0, 1, "10.0.0.2:80"),
                entry(0, 2)
            ]
        );
        table.written(key());
        assert!(
            table
                .set(key(), &eps(&["10.0.0.1:80", "10.0.0.2:80"]))
                .is_empty()
        );
    }

    #[test]
    fn shrinking_lowers_the_count_before_deleting_slots() {
        let mut table = ServiceTable::default();
        table.set(key(), &eps(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]));
        table.written(key());
        let ops = table.set(key(), &eps(&["10.0.0.1:80"]));
        let delete = |slot| MapOp::DeleteSlot {
            key: SlotKey { id: 0, slot },
            family: IpFamily::V4,
        };
        assert_eq!(ops, [entry(0, 1), delete(1), delete(2)]);
    }

    #[test]
    fn no_endpoints_is_a_count_of_zero() {
        let mut table = ServiceTable::default();
        assert_eq!(table.set(key(), &[]), [entry(0, 0)]);
    }

    #[test]
    fn a_failed_write_is_rewritten_whole() {
        let mut table = ServiceTable::default();
        table.set(key(), &eps(&["10.0.0.1:80", "10.0.0.2:80"]));
        table.failed(key());
        let ops = table.set(key(), &eps(&["10.0.0.1:80"]));
        let delete = MapOp::DeleteSlot {
            key: SlotKey { id: 0, slot: 1 },
            family: IpFamily::V4,
        };
        assert_eq!(ops, [put(0, 0, "10.0.0.1:80"), entry(0, 1), delete]);
    }

    #[test]
    fn removed_ids_are_reused_and_their_slots_deleted() {
        let mut table = ServiceTable::default();
        table.set(key(), &eps(&["10.0.0.1:80"]));
        table.written(key());
        let ops = table.remove(key());
        let delete = MapOp::DeleteSlot {
            key: SlotKey { id: 0, slot: 0 },
            family: IpFamily::V4,
        };
        assert_eq!(ops, [MapOp::DeleteService(key()), delete]);
        assert_eq!(table.len(), 1, "kept until the deletes are applied");
        table.removed(key());
        let other = ServiceKey::new("10.96.0.11:80".parse().expect("literal"), Protocol::Tcp);
        assert!(matches!(
            table.set(other, &[])[..],
            [MapOp::PutService {
                entry: ServiceEntry { id: 0, .. },
                ..
            }]
        ));
        assert!(table.remove(key()).is_empty());
    }
}
