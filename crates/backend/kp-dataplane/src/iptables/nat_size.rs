//! The legacy nat canary. Reading any rule of an iptables-legacy table copies the whole
//! table, and nat holds every service's rules, so the short-period check cannot look for
//! the jumps into nat's chains every few seconds. It asks instead how many rules nat holds
//! ([`kp_xtinfo`]: one `getsockopt`, no copy) and compares that with what it held after
//! the proxy's last sync or check; only a difference makes the check read nat's jumps.
//!
//! A check remembers the size it read before looking at the jumps, never a read after
//! them, so a flush while it runs is seen by the next one. A change made between the end of
//! a sync and the size read right after it would look like the proxy's own: after a full
//! sync (a restore among them) nothing is recorded, so the next canary reads nat's jumps
//! once, and a program that flushes nat in a loop is seen after every restore; after a
//! partial sync that window is left to the thorough check before the next periodic sync.

use kp_core::report::ErrorChain as _;
use std::collections::BTreeMap;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, PoisonError};

use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
pub use kp_xtinfo::TableInfo;

/// Reads the size of a family's nat table.
pub trait NatSize: Send + Sync {
    /// How big nat is now.
    fn read(&self, family: IpFamily) -> std::io::Result<TableInfo>;
}

/// The kernel's legacy nat table, over `getsockopt` (only for the legacy backend: on
/// nf_tables hosts asking would create an empty legacy table).
#[derive(Clone, Copy, Debug, Default)]
pub struct LegacyNatSize;

impl NatSize for LegacyNatSize {
    fn read(&self, family: IpFamily) -> std::io::Result<TableInfo> {
        let family = match family {
            IpFamily::V4 => kp_xtinfo::Family::V4,
            IpFamily::V6 => kp_xtinfo::Family::V6,
        };
        kp_xtinfo::table_info(family, "nat")
    }
}

/// What nat held, per family, when the proxy last knew its jumps were in place (iptables
/// mode's, and userspace mode's capture rules).
pub struct NatCanary {
    size: Box<dyn NatSize>,
    seen: BTreeMap<IpFamily, TableInfo>,
}

impl std::fmt::Debug for NatCanary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatCanary")
            .field("seen", &self.seen)
            .finish_non_exhaustive()
    }
}

impl NatCanary {
    /// A canary reading nat's size with `size`.
    pub fn new(size: impl NatSize + 'static) -> Self {
        Self {
            size: Box::new(size),
            seen: BTreeMap::new(),
        }
    }

    /// After a sync of `kind` of `family`: see the module doc.
    pub fn after_sync(&mut self, family: IpFamily, kind: SyncKind) {
        match kind {
            SyncKind::Full => {
                self.seen.remove(&family);
            }
            SyncKind::Partial => self.record(family),
        }
    }

    /// Remember nat's size now (after a partial sync).
    fn record(&mut self, family: IpFamily) {
        match self.size.read(family) {
            Ok(info) => {
                self.seen.insert(family, info);
            }
            Err(error) => {
                tracing::debug!(?family, error = %error.chain(), "cannot read the size of table nat");
                self.seen.remove(&family);
            }
        }
    }

    /// nat's size now, and whether it may have changed since it was last recorded: it did,
    /// or it cannot be told (nothing recorded, or unreadable).
    pub fn look(&self, family: IpFamily) -> NatLook {
        let now = self.size.read(family).ok();
        let changed = match (self.seen.get(&family), &now) {
            (Some(seen), Some(now)) => seen != now,
            _ => true,
        };
        NatLook { now, changed }
    }

    /// A check begun after `look` found our jumps in place: remember the size read before
    /// it (not a new read, which could already hold a change the check did not see).
    pub fn confirm(&mut self, family: IpFamily, look: NatLook) {
        match look.now {
            Some(now) => {
                self.seen.insert(family, now);
            }
            None => {
                self.seen.remove(&family);
            }
        }
    }
}

/// What [`NatCanary::look`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NatLook {
    now: Option<TableInfo>,
    /// nat may have changed: read its jumps.
    pub changed: bool,
}

/// A [`NatSize`] a test sets; clones share it. Unset families fail to read.
#[cfg(any(test, feature = "test-util"))]
#[derive(Clone, Debug, Default)]
pub struct FakeNatSize {
    state: Arc<Mutex<FakeSizes>>,
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeSizes {
    sizes: BTreeMap<IpFamily, TableInfo>,
    /// Applied right after the next read: a change made while a check runs.
    after_next_read: Option<(IpFamily, TableInfo)>,
}

#[cfg(any(test, feature = "test-util"))]
fn fake_info(entries: u32) -> TableInfo {
    TableInfo {
        entries,
        size: entries * 152,
        hook_entry: [0; 5],
    }
}

#[cfg(any(test, feature = "test-util"))]
impl FakeNatSize {
    fn lock(&self) -> std::sync::MutexGuard<'_, FakeSizes> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// nat of `family` holds `entries` rules from now on.
    pub fn set(&self, family: IpFamily, entries: u32) {
        self.lock().sizes.insert(family, fake_info(entries));
    }

    /// nat of `family` holds `entries` rules once the next read has returned.
    pub fn set_after_next_read(&self, family: IpFamily, entries: u32) {
        self.lock().after_next_read = Some((family, fake_info(entries)));
    }
}

#[cfg(any(test, feature = "test-util"))]
impl NatSize for FakeNatSize {
    fn read(&self, family: IpFamily) -> std::io::Result<TableInfo> {
        let mut state = self.lock();
        let read = state.sizes.get(&family).copied();
        if let Some((family, info)) = state.after_next_read.take() {
            state.sizes.insert(family, info);
        }
        read.ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
    }
}
