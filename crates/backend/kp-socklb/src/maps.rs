//! Applying [`MapOp`]s: to the kernel's maps ([`KernelMaps`]), or to [`FakeMaps`], which
//! holds the same bytes and answers a lookup as the programs would, for tests anywhere.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use aya::maps::{HashMap as BpfHashMap, MapData, MapError};
use kp_core::model::IpFamily;

use crate::layout::{
    Bytes, ServiceBytes, ServiceEntry, ServiceKey, SlotKey, affinity_endpoint, affinity_key_parts,
    endpoint_bytes, endpoint_from_bytes,
};
use crate::table::MapOp;

/// A map write that failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot apply {op:?} to the socket load balancer's maps")]
pub struct WriteError {
    /// The write.
    pub op: MapOp,
    /// The kernel's answer (boxed: aya's error is large, and writes are frequent).
    #[source]
    pub source: Box<MapError>,
}

/// Where [`MapOp`]s are written.
pub trait MapWriter {
    /// Applies one write; deleting what is absent succeeds.
    fn apply(&mut self, op: MapOp) -> Result<(), WriteError>;
}

/// A BPF hash map with fixed-size byte keys and values.
pub(crate) type ByteMap<const K: usize, const V: usize> = BpfHashMap<MapData, [u8; K], [u8; V]>;

/// The loaded programs' service, slot and affinity maps, for each family.
#[derive(Debug)]
pub struct KernelMaps {
    pub(crate) services: ByteMap<8, 12>,
    pub(crate) slots: ByteMap<8, 8>,
    pub(crate) services6: ByteMap<20, 12>,
    pub(crate) slots6: ByteMap<8, 20>,
    pub(crate) affinity: ByteMap<16, 16>,
    pub(crate) affinity6: ByteMap<32, 32>,
}

/// A Service port the maps held when they were adopted ([`KernelMaps::read_back`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The Service port.
    pub key: ServiceKey,
    /// Its entry.
    pub entry: ServiceEntry,
    /// Its slots from 0 up to the highest present (`None`: a hole).
    pub slots: Vec<Option<SocketAddr>>,
}

impl KernelMaps {
    /// What the maps hold (pinned maps a previous process wrote): each Service port with its
    /// slots, and the highest service id any slot uses (orphans included).
    pub fn read_back(&self) -> (Vec<Held>, Option<u32>) {
        let mut slots: BTreeMap<(IpFamily, u32), BTreeMap<u32, SocketAddr>> = BTreeMap::new();
        let mut add = |family, key: [u8; 8], endpoint: Bytes| {
            let (id, slot) = split_slot(key);
            let endpoint = endpoint_from_bytes(endpoint);
            slots
                .entry((family, id))
                .or_default()
                .insert(slot, endpoint);
        };
        for (key, value) in self.slots.iter().filter_map(Result::ok) {
            add(IpFamily::V4, key, Bytes::V4(value));
        }
        for (key, value) in self.slots6.iter().filter_map(Result::ok) {
            add(IpFamily::V6, key, Bytes::V6(value));
        }
        let four = self
            .services
            .iter()
            .filter_map(Result::ok)
            .map(|(k, v)| (Bytes::V4(k), v));
        let six = self
            .services6
            .iter()
            .filter_map(Result::ok)
            .map(|(k, v)| (Bytes::V6(k), v));
        let held = four
            .chain(six)
            .filter_map(|(key, value)| {
                let key = ServiceKey::from_bytes(key)?;
                let entry = ServiceEntry::from_bytes(value);
                let mine = slots.get(&(key.family(), entry.id));
                let high = mine
                    .and_then(|m| m.keys().next_back())
                    .map_or(0, |&s| s + 1);
                let slots = (0..high.max(entry.count))
                    .map(|slot| mine.and_then(|m| m.get(&slot)).copied())
                    .collect();
                Some(Held { key, entry, slots })
            })
            .collect();
        (held, slots.keys().map(|&(_, id)| id).max())
    }

    /// How many Service ports the service maps hold (read from the kernel).
    pub fn service_count(&self) -> usize {
        let four = self.services.keys().filter(Result::is_ok).count();
        four + self.services6.keys().filter(Result::is_ok).count()
    }

    fn write(&mut self, op: MapOp) -> Result<(), MapError> {
        match op {
            MapOp::PutSlot { key, endpoint } => match endpoint_bytes(endpoint) {
                Bytes::V4(value) => self.slots.insert(key.to_bytes(), value, 0),
                Bytes::V6(value) => self.slots6.insert(key.to_bytes(), value, 0),
            },
            MapOp::DeleteSlot { key, family } => absent_is_fine(match family {
                IpFamily::V4 => self.slots.remove(&key.to_bytes()),
                IpFamily::V6 => self.slots6.remove(&key.to_bytes()),
            }),
            MapOp::PutService { key, entry } => match key.to_bytes() {
                Bytes::V4(bytes) => self.services.insert(bytes, entry.to_bytes(), 0),
                Bytes::V6(bytes) => self.services6.insert(bytes, entry.to_bytes(), 0),
            },
            MapOp::DeleteService(key) => absent_is_fine(match key.to_bytes() {
                Bytes::V4(bytes) => self.services.remove(&bytes),
                Bytes::V6(bytes) => self.services6.remove(&bytes),
            }),
            MapOp::ClearAffinity(key) => self.clear_affinity(key).map(drop),
        }
    }

    /// The endpoints the maps give `key` now, if it has affinity (read back).
    fn pinnable(&self, key: ServiceKey) -> Result<Vec<SocketAddr>, MapError> {
        let entry = match key.to_bytes() {
            Bytes::V4(bytes) => self.services.get(&bytes, 0),
            Bytes::V6(bytes) => self.services6.get(&bytes, 0),
        };
        let entry = match entry {
            Ok(entry) => ServiceEntry::from_bytes(entry),
            Err(MapError::KeyNotFound) => return Ok(Vec::new()),
            Err(error) => return Err(error),
        };
        if entry.affinity_ms == 0 {
            return Ok(Vec::new());
        }
        let slot = |slot| SlotKey { id: entry.id, slot }.to_bytes();
        (0..entry.count)
            .map(|n| match key.family() {
                IpFamily::V4 => self.slots.get(&slot(n), 0).map(Bytes::V4),
                IpFamily::V6 => self.slots6.get(&slot(n), 0).map(Bytes::V6),
            })
            .map(|bytes| bytes.map(endpoint_from_bytes))
            .collect()
    }

    /// Deletes `key`'s pins to endpoints it no longer has; returns how many.
    fn clear_affinity(&mut self, key: ServiceKey) -> Result<usize, MapError> {
        let keep = self.pinnable(key)?;
        let service = key.to_bytes();
        let stale = |k: &[u8], v: &[u8]| {
            affinity_key_parts(k).is_some_and(|(_, s)| s == service)
                && affinity_endpoint(v).is_none_or(|e| !keep.contains(&e))
        };
        match key.family() {
            IpFamily::V4 => delete_where(&mut self.affinity, stale),
            IpFamily::V6 => delete_where(&mut self.affinity6, stale),
        }
    }
}

/// Deletes the entries of `map` for which `stale(key, value)`; returns how many.
fn delete_where<const K: usize, const V: usize>(
    map: &mut ByteMap<K, V>,
    stale: impl Fn(&[u8], &[u8]) -> bool,
) -> Result<usize, MapError> {
    let doomed: Vec<[u8; K]> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(k, v)| stale(k, v))
        .map(|(k, _)| k)
        .collect();
    for key in &doomed {
        absent_is_fine(map.remove(key))?;
    }
    Ok(doomed.len())
}

impl MapWriter for KernelMaps {
    fn apply(&mut self, op: MapOp) -> Result<(), WriteError> {
        self.write(op).map_err(|source| WriteError {
            op,
            source: Box::new(source),
        })
    }
}

/// `struct kp_slot_key`'s (id, slot).
fn split_slot(key: [u8; 8]) -> (u32, u32) {
    let [a, b, c, d, e, f, g, h] = key;
    (
        u32::from_ne_bytes([a, b, c, d]),
        u32::from_ne_bytes([e, f, g, h]),
    )
}

/// A delete of a key that is not there (ENOENT) did what was asked.
fn absent_is_fine(result: Result<(), MapError>) -> Result<(), MapError> {
    match result {
        Err(MapError::SyscallError(error))
            if error.io_error.kind() == std::io::ErrorKind::NotFound =>
        {
            Ok(())
        }
        other => other,
    }
}

/// The maps' contents as the kernel would hold them, byte for byte (affinity pins as
/// (namespace cookie, Service port) -> endpoint, made with [`FakeMaps::pin`]).
#[derive(Debug, Default)]
pub struct FakeMaps {
    services: BTreeMap<Bytes, ServiceBytes>,
    pins: BTreeMap<(u64, ServiceKey), SocketAddr>,
    /// Keyed by family and slot key.
    slots: BTreeMap<(IpFamily, [u8; 8]), Bytes>,
    /// Writes to fail (by position among all writes) and how many were made.
    fail_at: Option<usize>,
    writes: usize,
}

/// What the connect program does with a socket's destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not a Service port: the address stays.
    Untouched,
    /// A Service port without endpoints: the call fails with ECONNREFUSED.
    Refused,
    /// Rewritten to this endpoint.
    To(SocketAddr),
}

impl FakeMaps {
    /// Fails the `n`th write from now (0: the next one), as the kernel would on ENOMEM.
    pub fn fail_write(&mut self, n: usize) {
        self.fail_at = Some(self.writes + n);
    }

    /// The program's decision for `key` when its random number is `random`.
    pub fn resolve(&self, key: ServiceKey, random: u32) -> Verdict {
        let Some(entry) = self.services.get(&key.to_bytes()) else {
            return Verdict::Untouched;
        };
        let entry = ServiceEntry::from_bytes(*entry);
        if entry.count == 0 {
            return Verdict::Refused;
        }
        let slot = SlotKey {
            id: entry.id,
            slot: random % entry.count,
        };
        match self.slots.get(&(key.family(), slot.to_bytes())) {
            Some(bytes) => Verdict::To(endpoint_from_bytes(*bytes)),
            None => Verdict::Untouched,
        }
    }

    /// How many entries each map holds: (services, slots).
    pub fn sizes(&self) -> (usize, usize) {
        (self.services.len(), self.slots.len())
    }

    /// Pins the client in namespace `netns` to `endpoint` for `key`, as the programs do on
    /// a connect with affinity.
    pub fn pin(&mut self, netns: u64, key: ServiceKey, endpoint: SocketAddr) {
        self.pins.insert((netns, key), endpoint);
    }

    /// The endpoint the client in `netns` is pinned to for `key`.
    pub fn pinned(&self, netns: u64, key: ServiceKey) -> Option<SocketAddr> {
        self.pins.get(&(netns, key)).copied()
    }

    /// The endpoints `key` gives now if it has affinity, as [`KernelMaps`] reads them back.
    fn pinnable(&self, key: ServiceKey) -> Vec<SocketAddr> {
        let Some(entry) = self.services.get(&key.to_bytes()) else {
            return Vec::new();
        };
        let entry = ServiceEntry::from_bytes(*entry);
        if entry.affinity_ms == 0 {
            return Vec::new();
        }
        (0..entry.count)
            .filter_map(|slot| {
                let slot = SlotKey { id: entry.id, slot }.to_bytes();
                self.slots.get(&(key.family(), slot)).copied()
            })
            .map(endpoint_from_bytes)
            .collect()
    }
}

impl MapWriter for FakeMaps {
    fn apply(&mut self, op: MapOp) -> Result<(), WriteError> {
        let this = self.writes;
        self.writes += 1;
        if self.fail_at == Some(this) {
            let source = Box::new(MapError::KeyNotFound);
            return Err(WriteError { op, source });
        }
        match op {
            MapOp::PutSlot { key, endpoint } => {
                let family = IpFamily::of(&endpoint.ip());
                self.slots
                    .insert((family, key.to_bytes()), endpoint_bytes(endpoint));
            }
            MapOp::DeleteSlot { key, family } => {
                self.slots.remove(&(family, key.to_bytes()));
            }
            MapOp::PutService { key, entry } => {
                self.services.insert(key.to_bytes(), entry.to_bytes());
            }
            MapOp::DeleteService(key) => {
                self.services.remove(&key.to_bytes());
            }
            MapOp::ClearAffinity(key) => {
                let keep = self.pinnable(key);
                self.pins
                    .retain(|&(_, k), endpoint| k != key || keep.contains(endpoint));
            }
        }
        Ok(())
    }
}
