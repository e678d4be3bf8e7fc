//! Applying [`MapOp`]s: to the kernel's maps ([`KernelMaps`]), or to [`FakeMaps`], which
//! holds the same bytes and answers a lookup as the programs would, for tests anywhere.

use std::collections::BTreeMap;
use std::net::SocketAddrV4;

use aya::maps::{HashMap as BpfHashMap, MapData, MapError};

use crate::layout::{ServiceEntry, ServiceKey, SlotKey, endpoint_bytes, endpoint_from_bytes};
use crate::table::MapOp;

/// A map write that failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot apply {op:?} to the socket load balancer's maps")]
pub struct WriteError {
    /// The write.
    pub op: MapOp,
    /// The kernel's answer.
    #[source]
    pub source: MapError,
}

/// Where [`MapOp`]s are written.
pub trait MapWriter {
    /// Applies one write; deleting what is absent succeeds.
    fn apply(&mut self, op: MapOp) -> Result<(), WriteError>;
}

/// The loaded programs' `kp_services` and `kp_slots`.
#[derive(Debug)]
pub struct KernelMaps {
    pub(crate) services: BpfHashMap<MapData, [u8; 8], [u8; 8]>,
    pub(crate) slots: BpfHashMap<MapData, [u8; 8], [u8; 8]>,
}

impl KernelMaps {
    /// How many Service ports `kp_services` holds (read from the kernel).
    pub fn service_count(&self) -> usize {
        self.services.keys().filter(Result::is_ok).count()
    }
}

impl MapWriter for KernelMaps {
    fn apply(&mut self, op: MapOp) -> Result<(), WriteError> {
        let result = match op {
            MapOp::PutSlot { key, endpoint } => {
                self.slots
                    .insert(key.to_bytes(), endpoint_bytes(endpoint), 0)
            }
            MapOp::DeleteSlot(key) => absent_is_fine(self.slots.remove(&key.to_bytes())),
            MapOp::PutService { key, entry } => {
                self.services.insert(key.to_bytes(), entry.to_bytes(), 0)
            }
            MapOp::DeleteService(key) => absent_is_fine(self.services.remove(&key.to_bytes())),
        };
        result.map_err(|source| WriteError { op, source })
    }
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

/// The maps' contents as the kernel would hold them, byte for byte.
#[derive(Debug, Default)]
pub struct FakeMaps {
    services: BTreeMap<[u8; 8], [u8; 8]>,
    slots: BTreeMap<[u8; 8], [u8; 8]>,
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
    To(SocketAddrV4),
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
        match self.slots.get(&slot.to_bytes()) {
            Some(bytes) => Verdict::To(endpoint_from_bytes(*bytes)),
            None => Verdict::Untouched,
        }
    }

    /// How many entries each map holds: (services, slots).
    pub fn sizes(&self) -> (usize, usize) {
        (self.services.len(), self.slots.len())
    }
}

impl MapWriter for FakeMaps {
    fn apply(&mut self, op: MapOp) -> Result<(), WriteError> {
        let this = self.writes;
        self.writes += 1;
        if self.fail_at == Some(this) {
            let source = MapError::KeyNotFound;
            return Err(WriteError { op, source });
        }
        match op {
            MapOp::PutSlot { key, endpoint } => {
                self.slots.insert(key.to_bytes(), endpoint_bytes(endpoint));
            }
            MapOp::DeleteSlot(key) => {
                self.slots.remove(&key.to_bytes());
            }
            MapOp::PutService { key, entry } => {
                self.services.insert(key.to_bytes(), entry.to_bytes());
            }
            MapOp::DeleteService(key) => {
                self.services.remove(&key.to_bytes());
            }
        }
        Ok(())
    }
}
