//! What the maps should hold, and the map writes that get them there (sans I/O).
//!
//! Each Service port has an id and `count` endpoint slots. A change is written in an order
//! that keeps every lookup the programs make valid at every step: slots a new count will use
//! are written before the count, and slots past a smaller count are deleted after it. A
//! program that still finds no slot (a race with a removal) leaves the socket's address
//! alone, and nftables mode's rules serve it. A Service port with ClientIP affinity also
//! gets [`MapOp::ClearAffinity`] after its writes when an endpoint left its list (or it was
//! removed, or affinity turned off), so no client stays pinned to a gone endpoint.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use kp_core::model::IpFamily;

use crate::layout::{ServiceEntry, ServiceKey, SlotKey};
use crate::maps::Held;

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
    /// Delete the affinity pins of a Service port to endpoints the maps no longer give it
    /// (every pin when the port is gone or has no affinity): read back from the maps, so
    /// it comes after the writes that change them.
    ClearAffinity(ServiceKey),
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
    /// ClientIP affinity's timeout (ms; 0: none).
    affinity_ms: u32,
    /// The affinity maps may hold pins of this port.
    pinned: bool,
}

/// The Service ports the maps hold, with their ids.
#[derive(Debug, Default)]
pub struct ServiceTable {
    services: HashMap<ServiceKey, Placed>,
    free_ids: Vec<u32>,
    next_id: u32,
    /// Ports [`Self::set`] or [`Self::remove`] wrote since [`Self::watch`] (`None`: not
    /// watching): a read-back that ran meanwhile may have seen them mid-write, so
    /// [`Self::differences_since`] skips them.
    touched: Option<HashSet<ServiceKey>>,
    /// Counts [`Self::adopt`]s: a read-back from before one is compared with nothing.
    generation: u64,
}

/// When a read-back of the maps began ([`ServiceTable::watch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Epoch(u64);

impl ServiceTable {
    /// The writes that make `key` send to `endpoints` (sorted and deduplicated: each
    /// endpoint one slot, equally likely; none means refused) with ClientIP affinity for
    /// `affinity_ms` (0: none), in a safe order. Call [`Self::written`] or [`Self::failed`]
    /// once they were applied or not.
    pub fn set(
        &mut self,
        key: ServiceKey,
        endpoints: &[SocketAddr],
        affinity_ms: u32,
    ) -> Vec<MapOp> {
        self.touch(key);
        let mut wanted = endpoints.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        let entry = |id| ServiceEntry {
            id,
            count: count(wanted.len()),
            affinity_ms,
        };
        let Some(placed) = self.services.get(&key) else {
            let id = self.free_ids.pop().unwrap_or_else(|| self.take_id());
            let ops = slot_writes(id, &[], &wanted, false);
            let ops = with_entry(ops, key, entry(id), 0);
            let placed = pending(id, wanted, 0, affinity_ms, affinity_ms != 0);
            self.services.insert(key, placed);
            return ops;
        };
        if placed.in_sync && placed.endpoints == wanted && placed.affinity_ms == affinity_ms {
            return Vec::new();
        }
        let (id, high, pinned) = (placed.id, placed.high, placed.pinned || affinity_ms != 0);
        let clear = unpins(placed, &wanted, affinity_ms);
        let ops = slot_writes(id, &placed.endpoints, &wanted, placed.in_sync);
        let mut ops = with_entry(ops, key, entry(id), high);
        if clear {
            ops.push(MapOp::ClearAffinity(key));
        }
        let placed = pending(id, wanted, high, affinity_ms, pinned);
        self.services.insert(key, placed);
        ops
    }

    /// The writes that remove `key` (none if it is not here). Call [`Self::removed`] once
    /// they were applied; after a failure `key` stays, and the next remove retries them.
    pub fn remove(&mut self, key: ServiceKey) -> Vec<MapOp> {
        self.touch(key);
        let Some(placed) = self.services.get(&key) else {
            return Vec::new();
        };
        let (id, family) = (placed.id, key.family());
        let slots =
            (0..placed.high.max(count(placed.endpoints.len()))).map(|slot| MapOp::DeleteSlot {
                key: SlotKey { id, slot },
                family,
            });
        let clear = placed.pinned.then_some(MapOp::ClearAffinity(key));
        std::iter::once(MapOp::DeleteService(key))
            .chain(slots)
            .chain(clear)
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
            // Without affinity, its writes cleared every pin there was.
            placed.pinned = placed.affinity_ms != 0;
        }
    }

    /// Some write [`Self::set`] returned for `key` failed: the next set rewrites it whole.
    pub fn failed(&mut self, key: ServiceKey) {
        if let Some(placed) = self.services.get_mut(&key) {
            placed.in_sync = false;
            placed.high = placed.high.max(count(placed.endpoints.len()));
        }
    }

    /// Takes over what maps a previous process wrote hold (`held`; `top_slot_id`: the highest
    /// id any slot uses), so the next writes are differences and no id is used twice. A
    /// port with a hole in its slots is rewritten whole by its next set.
    /// What the table held before is forgotten (adopting again after someone else rewrote
    /// the maps: the next writes correct what they hold).
    pub fn adopt(&mut self, held: Vec<Held>, top_slot_id: Option<u32>) {
        self.services.clear();
        self.generation += 1;
        self.touched = None;
        let top = held.iter().map(|h| h.entry.id).chain(top_slot_id).max();
        self.next_id = top.map_or(0, |id| id.saturating_add(1));
        self.free_ids.clear();
        for Held { key, entry, slots } in held {
            let given = &slots[..slots.len().min(entry.count as usize)];
            let endpoints: Vec<SocketAddr> = given.iter().flatten().copied().collect();
            let whole = endpoints.len() == entry.count as usize && endpoints.is_sorted();
            let placed = Placed {
                id: entry.id,
                endpoints,
                in_sync: whole,
                high: count(slots.len()),
                affinity_ms: entry.affinity_ms,
                pinned: entry.affinity_ms != 0,
            };
            self.services.insert(key, placed);
        }
    }

    /// The Service ports whose entry or slots in `held` (the maps read back) differ from
    /// what was written, or that one side lacks: someone else rewrote, removed or added
    /// them. Ports whose last write failed are left out: their next set rewrites them
    /// whole anyway. Slots past a port's count are not looked at (the programs never read
    /// them).
    pub fn differences(&self, held: &[Held]) -> Vec<ServiceKey> {
        // One lookup per held port; the ports the maps lack are looked for only when fewer
        // of ours were found than we have (the sync thread runs this).
        let mut found = 0;
        let mut differ: Vec<ServiceKey> = held
            .iter()
            .filter(|h| match self.services.get(&h.key) {
                None => true,
                Some(placed) if !placed.in_sync => false,
                Some(placed) => {
                    found += 1;
                    !holds(placed, h)
                }
            })
            .map(|h| h.key)
            .collect();
        if found < self.services.values().filter(|p| p.in_sync).count() {
            let present: HashSet<ServiceKey> = held.iter().map(|h| h.key).collect();
            let missing = self
                .services
                .iter()
                .filter(|(key, placed)| placed.in_sync && !present.contains(key))
                .map(|(key, _)| *key);
            differ.extend(missing);
        }
        differ
    }

    /// Starts recording the ports written from now on, for a read-back of the maps that
    /// begins now (on another thread, while syncs go on writing).
    pub fn watch(&mut self) -> Epoch {
        self.touched = Some(HashSet::new());
        Epoch(self.generation)
    }

    /// `key` is being written (a set or a remove).
    fn touch(&mut self, key: ServiceKey) {
        if let Some(touched) = &mut self.touched {
            touched.insert(key);
        }
    }

    /// [`Self::differences`] for a read-back that began at `epoch`, leaving out the ports
    /// written since (their entries may be mid-write in it, and are checked next time):
    /// every other port held the same bytes throughout the read, so a difference there is
    /// someone else's. `None` when the table was adopted anew since, or nothing watched.
    pub fn differences_since(&self, held: &[Held], epoch: Epoch) -> Option<Vec<ServiceKey>> {
        let touched = self.touched.as_ref()?;
        if epoch.0 != self.generation {
            return None;
        }
        let mut keys = self.differences(held);
        keys.retain(|key| !touched.contains(key));
        Some(keys)
    }

    /// After someone else changed `key`'s entries: its next set rewrites it whole (a port
    /// not here is left to the caller, which deletes it).
    pub fn distrust(&mut self, key: ServiceKey) -> bool {
        match self.services.get_mut(&key) {
            Some(placed) => {
                placed.in_sync = false;
                true
            }
            None => false,
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

/// Whether `held` is what was written for its port (`placed`, in sync).
fn holds(placed: &Placed, held: &Held) -> bool {
    let written = ServiceEntry {
        id: placed.id,
        count: count(placed.endpoints.len()),
        affinity_ms: placed.affinity_ms,
    };
    held.entry == written
        && held.slots.len() >= placed.endpoints.len()
        && held
            .slots
            .iter()
            .zip(&placed.endpoints)
            .all(|(slot, endpoint)| *slot == Some(*endpoint))
}

fn pending(
    id: u32,
    endpoints: Vec<SocketAddr>,
    high: u32,
    affinity_ms: u32,
    pinned: bool,
) -> Placed {
    Placed {
        id,
        endpoints,
        in_sync: false,
        high,
        affinity_ms,
        pinned,
    }
}

/// Whether going from `placed` to `wanted` (sorted) may leave a client pinned to an
/// endpoint no longer given: one left the list, affinity was turned off, or the maps are
/// not known (a failed write).
fn unpins(placed: &Placed, wanted: &[SocketAddr], affinity_ms: u32) -> bool {
    placed.pinned
        && (!placed.in_sync
            || affinity_ms == 0
            || placed
                .endpoints
                .iter()
                .any(|e| wanted.binary_search(e).is_err()))
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

/// `ops`, then the service entry, then deletes of the slots from its count up to `high`.
fn with_entry(mut ops: Vec<MapOp>, key: ServiceKey, entry: ServiceEntry, high: u32) -> Vec<MapOp> {
    ops.push(MapOp::PutService { key, entry });
    let (family, id) = (key.family(), entry.id);
    ops.extend((entry.count..high).map(|slot| MapOp::DeleteSlot {
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
            entry: ServiceEntry {
                id,
                count,
                affinity_ms: 0,
            },
        }
    }

    #[test]
    fn a_new_service_writes_its_slots_before_its_count() {
        let mut table = ServiceTable::default();
        let ops = table.set(
            key(),
            &eps(&["10.0.0.2:80", "10.0.0.1:80", "10.0.0.2:80"]),
            0,
        );
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
                .set(key(), &eps(&["10.0.0.1:80", "10.0.0.2:80"]), 0)
                .is_empty()
        );
    }

    #[test]
    fn shrinking_lowers_the_count_before_deleting_slots() {
        let mut table = ServiceTable::default();
        table.set(
            key(),
            &eps(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]),
            0,
        );
        table.written(key());
        let ops = table.set(key(), &eps(&["10.0.0.1:80"]), 0);
        let delete = |slot| MapOp::DeleteSlot {
            key: SlotKey { id: 0, slot },
            family: IpFamily::V4,
        };
        assert_eq!(ops, [entry(0, 1), delete(1), delete(2)]);
    }

    #[test]
    fn no_endpoints_is_a_count_of_zero() {
        let mut table = ServiceTable::default();
        assert_eq!(table.set(key(), &[], 0), [entry(0, 0)]);
    }

    #[test]
    fn a_failed_write_is_rewritten_whole() {
        let mut table = ServiceTable::default();
        table.set(key(), &eps(&["10.0.0.1:80", "10.0.0.2:80"]), 0);
        table.failed(key());
        let ops = table.set(key(), &eps(&["10.0.0.1:80"]), 0);
        let delete = MapOp::DeleteSlot {
            key: SlotKey { id: 0, slot: 1 },
            family: IpFamily::V4,
        };
        assert_eq!(ops, [put(0, 0, "10.0.0.1:80"), entry(0, 1), delete]);
    }

    #[test]
    fn removed_ids_are_reused_and_their_slots_deleted() {
        let mut table = ServiceTable::default();
        table.set(key(), &eps(&["10.0.0.1:80"]), 0);
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
            table.set(other, &[], 0)[..],
            [MapOp::PutService {
                entry: ServiceEntry { id: 0, .. },
                ..
            }]
        ));
        assert!(table.remove(key()).is_empty());
    }

    #[test]
    fn affinity_pins_are_cleared_when_an_endpoint_leaves() {
        let mut table = ServiceTable::default();
        let two = eps(&["10.0.0.1:80", "10.0.0.2:80"]);
        let ops = table.set(key(), &two, 10_000);
        assert!(
            !ops.contains(&MapOp::ClearAffinity(key())),
            "new: no pins yet"
        );
        table.written(key());
        let grown = eps(&["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"]);
        let ops = table.set(key(), &grown, 10_000);
        assert!(
            !ops.contains(&MapOp::ClearAffinity(key())),
            "nobody's endpoint left"
        );
        table.written(key());
        let ops = table.set(key(), &two[1..], 10_000);
        assert_eq!(
            ops.last(),
            Some(&MapOp::ClearAffinity(key())),
            "after the writes"
        );
        table.written(key());
        let ops = table.set(key(), &two[1..], 0);
        assert_eq!(
            ops.last(),
            Some(&MapOp::ClearAffinity(key())),
            "affinity off"
        );
        table.written(key());
        let ops = table.set(key(), &two[..1], 0);
        assert!(
            !ops.contains(&MapOp::ClearAffinity(key())),
            "no affinity, no pins"
        );
        table.written(key());
        table.set(key(), &two, 5_000);
        table.written(key());
        assert_eq!(
            table.remove(key()).last(),
            Some(&MapOp::ClearAffinity(key()))
        );
    }

    #[test]
    fn adopted_ports_are_kept_and_their_ids_never_reused() {
        let mut table = ServiceTable::default();
        let (a, b) = (
            "10.0.0.1:80".parse().expect("literal"),
            "10.0.0.2:80".parse().expect("literal"),
        );
        let entry = |id, count| ServiceEntry {
            id,
            count,
            affinity_ms: 0,
        };
        let other = ServiceKey::new("10.96.0.11:80".parse().expect("literal"), Protocol::Tcp);
        let held = vec![
            Held {
                key: key(),
                entry: entry(3, 2),
                slots: vec![Some(a), Some(b)],
            },
            Held {
                key: other,
                entry: entry(1, 2),
                slots: vec![Some(a), None],
            },
        ];
        table.adopt(held, Some(7));
        assert!(
            table.set(key(), &[a, b], 0).is_empty(),
            "held as wanted: no write"
        );
        let ops = table.set(other, &[a, b], 0);
        assert_eq!(ops.len(), 3, "a hole: rewritten whole: {ops:?}");
        let new = ServiceKey::new("10.96.0.12:80".parse().expect("literal"), Protocol::Tcp);
        assert!(
            matches!(
                table.set(new, &[], 0)[..],
                [MapOp::PutService {
                    entry: ServiceEntry { id: 8, .. },
                    ..
                }]
            ),
            "past every id in use, orphan slots' included"
        );
    }

    #[test]
    fn entries_rewritten_by_someone_else_are_found_and_corrected_after_adopting() {
        let mut table = ServiceTable::default();
        let (a, b, wrong) = (
            "10.0.0.1:80".parse().expect("literal"),
            "10.0.0.2:80".parse().expect("literal"),
            "10.0.0.9:80".parse().expect("literal"),
        );
        let other = ServiceKey::new("10.96.0.11:80".parse().expect("literal"), Protocol::Tcp);
        for k in [key(), other] {
            table.set(k, &[a, b], 0);
            table.written(k);
        }
        let written = |k, id| Held {
            key: k,
            entry: ServiceEntry {
                id,
                count: 2,
                affinity_ms: 0,
            },
            slots: vec![Some(a), Some(b)],
        };
        let intact = vec![written(key(), 0), written(other, 1)];
        assert!(table.differences(&intact).is_empty(), "as written");
        let mut rewritten = written(key(), 0);
        rewritten.slots[1] = Some(wrong);
        let stray = ServiceKey::new("10.96.0.99:80".parse().expect("literal"), Protocol::Tcp);
        let mut held = vec![rewritten, written(stray, 5)];
        let mut found = table.differences(&held);
        found.sort_unstable_by_key(|k| k.addr);
        assert_eq!(
            found,
            vec![key(), other, stray],
            "rewritten, missing, added"
        );
        held.push(written(other, 1));
        table.adopt(held, None);
        assert_eq!(
            table.set(key(), &[a, b], 0),
            vec![put(0, 1, "10.0.0.2:80"), entry(0, 2)]
        );
        assert!(table.set(other, &[a, b], 0).is_empty());
        assert!(table.keys().any(|k| k == stray), "removed by the next sync");
    }

    #[test]
    fn a_read_back_during_writes_skips_the_ports_written_since_it_began() {
        let mut table = ServiceTable::default();
        let (a, b) = (
            "10.0.0.1:80".parse().expect("literal"),
            "10.0.0.2:80".parse().expect("literal"),
        );
        let other = ServiceKey::new("10.96.0.11:80".parse().expect("literal"), Protocol::Tcp);
        for k in [key(), other] {
            table.set(k, &[a], 0);
            table.written(k);
        }
        let held = |k, id, slots: Vec<SocketAddr>| Held {
            key: k,
            entry: ServiceEntry {
                id,
                count: count(slots.len()),
                affinity_ms: 0,
            },
            slots: slots.into_iter().map(Some).collect(),
        };
        let epoch = table.watch();
        // The read saw key() before a sync's write gave it b, and other as someone rewrote it.
        let read = vec![held(key(), 0, vec![a]), held(other, 1, vec![b])];
        table.set(key(), &[a, b], 0);
        table.written(key());
        assert_eq!(table.differences(&read), vec![key(), other], "unfiltered");
        assert_eq!(table.differences_since(&read, epoch), Some(vec![other]));
        // Distrusted, other is rewritten whole by its next set, even to the same endpoints.
        assert!(table.distrust(other));
        assert!(!table.set(other, &[a], 0).is_empty());
        // A read from before an adoption is compared with nothing.
        let epoch = table.watch();
        table.adopt(read.clone(), None);
        assert_eq!(table.differences_since(&read, epoch), None);
    }
}
