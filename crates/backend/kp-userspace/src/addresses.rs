//! Service addresses for `winuserspace`: on Windows the relay listens on the service
//! addresses themselves (ClusterIP, externalIPs, LoadBalancer IPs), so each must be on a host
//! interface first. [`ServiceAddresses`] keeps one reference per portal using an address,
//! adds the address when the first one needs it, waits (bounded) until the host shows it, and
//! removes it when the last one closes, but only an address it added: one that was already
//! there (the node's own, or put there by someone else) is used and left alone.
//!
//! The host side is an [`AddressHost`]: the IP Helper API on Windows (`kp-winaddr`),
//! `FakeAddressHost` (`test-util`) in tests.

use kp_core::report::ErrorChain as _;
use std::collections::BTreeMap;
use std::net::IpAddr;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How long an added address may take to show up (IPv6 duplicate address detection takes
/// about a second on Windows).
pub const DEFAULT_APPEAR_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the host is asked whether an added address is there yet.
const POLL: Duration = Duration::from_millis(50);

/// The host's interface addresses, as one interface's manager sees them.
pub trait AddressHost: Send {
    /// The interface addresses are added to (for messages).
    fn interface(&self) -> &str;

    /// Whether `ip` is on any interface of the host, ready to be bound.
    fn has(&self, ip: IpAddr) -> std::io::Result<bool>;

    /// Adds `ip` to the interface.
    fn add(&mut self, ip: IpAddr) -> std::io::Result<()>;

    /// Removes `ip` from the interface.
    fn remove(&mut self, ip: IpAddr) -> std::io::Result<()>;
}

/// Why a service address could not be had or given back.
#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    /// The host's address table could not be read.
    #[error("cannot tell whether {address} is on interface {interface:?}")]
    Lookup {
        /// The service address.
        address: IpAddr,
        /// The interface.
        interface: String,
        /// The host's error.
        #[source]
        source: std::io::Error,
    },
    /// The host refused to add the address.
    #[error("cannot add {address} to interface {interface:?}")]
    Add {
        /// The service address.
        address: IpAddr,
        /// The interface.
        interface: String,
        /// The host's error.
        #[source]
        source: std::io::Error,
    },
    /// The address was added but did not show up in time (it was removed again).
    #[error("{address} added to interface {interface:?} did not become usable within {waited:?}")]
    Timeout {
        /// The service address.
        address: IpAddr,
        /// The interface.
        interface: String,
        /// How long it was waited for.
        waited: Duration,
    },
    /// The host refused to remove the address.
    #[error("cannot remove {address} from interface {interface:?}")]
    Remove {
        /// The service address.
        address: IpAddr,
        /// The interface.
        interface: String,
        /// The host's error.
        #[source]
        source: std::io::Error,
    },
}

/// One address in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    /// Portals using it.
    users: usize,
    /// Whether this manager added it (and so removes it after the last user).
    added: bool,
}

/// Reference-counted service addresses on one interface.
#[derive(Debug)]
pub struct ServiceAddresses<H> {
    host: H,
    held: BTreeMap<IpAddr, Held>,
    appear_timeout: Duration,
}

impl<H: AddressHost> ServiceAddresses<H> {
    /// A manager adding addresses through `host`.
    pub fn new(host: H) -> Self {
        Self {
            host,
            held: BTreeMap::new(),
            appear_timeout: DEFAULT_APPEAR_TIMEOUT,
        }
    }

    /// Waits at most `timeout` for an added address to show up.
    pub fn with_appear_timeout(mut self, timeout: Duration) -> Self {
        self.appear_timeout = timeout;
        self
    }

    /// Takes a reference to `ip`, adding it to the interface if no interface has it.
    pub async fn acquire(&mut self, ip: IpAddr) -> Result<(), AddressError> {
        if let Some(held) = self.held.get_mut(&ip) {
            held.users += 1;
            return Ok(());
        }
        let added = !self.lookup(ip)?;
        if added {
            self.add_and_wait(ip).await?;
        }
        self.held.insert(ip, Held { users: 1, added });
        Ok(())
    }

    /// Gives back a reference to `ip`; after the last one, removes it if it was added here.
    /// Releasing an address not held does nothing.
    pub fn release(&mut self, ip: IpAddr) -> Result<(), AddressError> {
        let Some(held) = self.held.get_mut(&ip) else {
            return Ok(());
        };
        held.users -= 1;
        if held.users > 0 {
            return Ok(());
        }
        let added = held.added;
        self.held.remove(&ip);
        if added { self.remove(ip) } else { Ok(()) }
    }

    /// Removes every address added here, whatever its references (shutdown, `--cleanup`);
    /// returns what could not be removed.
    pub fn release_all(&mut self) -> Vec<AddressError> {
        let held = std::mem::take(&mut self.held);
        held.into_iter()
            .filter(|(_, h)| h.added)
            .filter_map(|(ip, _)| self.remove(ip).err())
            .collect()
    }

    /// The addresses added here and still held.
    pub fn added(&self) -> Vec<IpAddr> {
        self.held
            .iter()
            .filter(|(_, h)| h.added)
            .map(|(ip, _)| *ip)
            .collect()
    }

    /// How many portals use `ip`.
    pub fn users(&self, ip: IpAddr) -> usize {
        self.held.get(&ip).map_or(0, |h| h.users)
    }

    /// Whether the host shows `ip` on an interface.
    fn lookup(&self, ip: IpAddr) -> Result<bool, AddressError> {
        self.host.has(ip).map_err(|source| AddressError::Lookup {
            address: ip,
            interface: self.host.interface().to_owned(),
            source,
        })
    }

    /// Adds `ip` and polls until the host shows it; on a timeout or a failed look it is
    /// removed again (best effort) and that is the error.
    async fn add_and_wait(&mut self, ip: IpAddr) -> Result<(), AddressError> {
        let interface = self.host.interface().to_owned();
        self.host.add(ip).map_err(|source| AddressError::Add {
            address: ip,
            interface: interface.clone(),
            source,
        })?;
        let deadline = tokio::time::Instant::now() + self.appear_timeout;
        let outcome = loop {
            match self.lookup(ip) {
                Ok(true) => return Ok(()),
                Err(error) => break error,
                Ok(false) if tokio::time::Instant::now() >= deadline => {
                    break AddressError::Timeout {
                        address: ip,
                        interface,
                        waited: self.appear_timeout,
                    };
                }
                Ok(false) => tokio::time::sleep(POLL).await,
            }
        };
        if let Err(error) = self.remove(ip) {
            tracing::warn!(error = %error.chain(), "cannot take back an address that did not come up");
        }
        Err(outcome)
    }

    fn remove(&mut self, ip: IpAddr) -> Result<(), AddressError> {
        self.host.remove(ip).map_err(|source| AddressError::Remove {
            address: ip,
            interface: self.host.interface().to_owned(),
            source,
        })
    }
}

/// An [`AddressHost`] that also keeps, in a file, which addresses it added and has not
/// removed, so `--cleanup` can remove them after a proxy that did not stop cleanly. The
/// file holds one address a line; it is rewritten after every change (a write that fails
/// is logged: the addresses themselves are still right).
#[derive(Debug)]
pub struct RecordingHost<H> {
    host: H,
    path: std::path::PathBuf,
    added: std::collections::BTreeSet<IpAddr>,
}

impl<H: AddressHost> RecordingHost<H> {
    /// Records `host`'s additions in `path`, starting from what the file already lists (a
    /// previous run's leftovers stay listed until removed).
    pub fn new(host: H, path: std::path::PathBuf) -> Self {
        let added = Self::recorded(&path);
        Self { host, path, added }
    }

    /// The addresses listed in `path` (none when it is missing or unreadable).
    pub fn recorded(path: &std::path::Path) -> std::collections::BTreeSet<IpAddr> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    }

    /// Removes every address the record lists (`--cleanup`); returns what could not be.
    pub fn remove_recorded(&mut self) -> Vec<AddressError> {
        let listed: Vec<IpAddr> = self.added.iter().copied().collect();
        let mut errors = Vec::new();
        for ip in listed {
            match self.host.has(ip) {
                Ok(false) => {
                    self.added.remove(&ip);
                    self.write();
                }
                Ok(true) | Err(_) => {
                    if let Err(source) = self.remove(ip) {
                        let interface = self.host.interface().to_owned();
                        errors.push(AddressError::Remove {
                            address: ip,
                            interface,
                            source,
                        });
                    }
                }
            }
        }
        errors
    }

    fn write(&self) {
        let text: String = self.added.iter().map(|ip| format!("{ip}\n")).collect();
        let written = match self.path.parent() {
            Some(dir) => std::fs::create_dir_all(dir),
            None => Ok(()),
        }
        .and_then(|()| std::fs::write(&self.path, text));
        if let Err(error) = written {
            tracing::warn!(path = %self.path.display(), error = %error.chain(), "cannot record the service addresses added; --cleanup will not know them");
        }
    }
}

impl<H: AddressHost> AddressHost for RecordingHost<H> {
    fn interface(&self) -> &str {
        self.host.interface()
    }

    fn has(&self, ip: IpAddr) -> std::io::Result<bool> {
        self.host.has(ip)
    }

    fn add(&mut self, ip: IpAddr) -> std::io::Result<()> {
        self.host.add(ip)?;
        self.added.insert(ip);
        self.write();
        Ok(())
    }

    fn remove(&mut self, ip: IpAddr) -> std::io::Result<()> {
        self.host.remove(ip)?;
        self.added.remove(&ip);
        self.write();
        Ok(())
    }
}

#[cfg(any(test, feature = "test-util"))]
/// A host whose addresses live in memory. Clones share them, so a test keeps one to look.
#[derive(Clone, Debug, Default)]
pub struct FakeAddressHost {
    state: Arc<Mutex<FakeState>>,
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeState {
    /// Every address on the host, and whether it is usable yet.
    present: BTreeMap<IpAddr, bool>,
    /// Addresses added through this host, in order, and removed.
    added: Vec<IpAddr>,
    removed: Vec<IpAddr>,
    /// Adds that fail / lookups that fail / addresses that never become usable.
    fail_add: bool,
    fail_lookup: bool,
    never_usable: bool,
    fail_remove: bool,
}

#[cfg(any(test, feature = "test-util"))]
/// What [`FakeAddressHost`] can be told to get wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeFault {
    /// `add` fails.
    Add,
    /// `has` fails.
    Lookup,
    /// Added addresses never become usable (a bounded wait must end).
    NeverUsable,
    /// `remove` fails.
    Remove,
}

#[cfg(any(test, feature = "test-util"))]
impl FakeAddressHost {
    /// Interface name the fake reports.
    pub const INTERFACE: &'static str = "fake0";

    /// A host with no addresses.
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `ip` on the host as if someone else had (the node's own address).
    pub fn preset(&self, ip: IpAddr) {
        self.lock().present.insert(ip, true);
    }

    /// Makes `fault` happen from now on (or stop, with `on` false).
    pub fn set_fault(&self, fault: FakeFault, on: bool) {
        let mut state = self.lock();
        match fault {
            FakeFault::Add => state.fail_add = on,
            FakeFault::Lookup => state.fail_lookup = on,
            FakeFault::NeverUsable => state.never_usable = on,
            FakeFault::Remove => state.fail_remove = on,
        }
    }

    /// Whether `ip` is on the host now.
    pub fn present(&self, ip: IpAddr) -> bool {
        self.lock().present.contains_key(&ip)
    }

    /// Every `add` that succeeded, in order.
    pub fn added(&self) -> Vec<IpAddr> {
        self.lock().added.clone()
    }

    /// Every `remove` that succeeded, in order.
    pub fn removed(&self) -> Vec<IpAddr> {
        self.lock().removed.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "test-util"))]
fn injected() -> std::io::Error {
    std::io::Error::other("injected failure")
}

#[cfg(any(test, feature = "test-util"))]
impl AddressHost for FakeAddressHost {
    fn interface(&self) -> &str {
        Self::INTERFACE
    }

    fn has(&self, ip: IpAddr) -> std::io::Result<bool> {
        let state = self.lock();
        if state.fail_lookup {
            return Err(injected());
        }
        Ok(state.present.get(&ip).copied().unwrap_or(false))
    }

    fn add(&mut self, ip: IpAddr) -> std::io::Result<()> {
        let mut state = self.lock();
        if state.fail_add {
            return Err(injected());
        }
        let usable = !state.never_usable;
        state.present.insert(ip, usable);
        state.added.push(ip);
        Ok(())
    }

    fn remove(&mut self, ip: IpAddr) -> std::io::Result<()> {
        let mut state = self.lock();
        if state.fail_remove {
            return Err(injected());
        }
        if state.present.remove(&ip).is_none() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such address",
            ));
        }
        state.removed.push(ip);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn manager(host: &FakeAddressHost) -> ServiceAddresses<FakeAddressHost> {
        ServiceAddresses::new(host.clone()).with_appear_timeout(Duration::from_millis(200))
    }

    #[tokio::test]
    async fn an_address_is_added_once_and_removed_after_its_last_user() {
        let host = FakeAddressHost::new();
        let mut addresses = manager(&host);
        let vip = ip("10.96.0.10");
        addresses.acquire(vip).await.expect("first user");
        addresses
            .acquire(vip)
            .await
            .expect("second service on the same address");
        assert_eq!(host.added(), [vip]);
        assert_eq!(addresses.users(vip), 2);
        addresses.release(vip).expect("first release");
        assert!(host.present(vip), "still used by the other service");
        addresses.release(vip).expect("last release");
        assert!(!host.present(vip));
        assert_eq!(host.removed(), [vip]);
        assert_eq!(addresses.users(vip), 0);
        // A release too many is harmless.
        addresses.release(vip).expect("nothing held");
        assert_eq!(host.removed(), [vip]);
    }

    #[tokio::test]
    async fn ipv6_addresses_are_managed_the_same_way() {
        let host = FakeAddressHost::new();
        let mut addresses = manager(&host);
        let vip = ip("fd00:96::10");
        addresses.acquire(vip).await.expect("IPv6 added");
        assert_eq!(addresses.added(), [vip]);
        addresses.release(vip).expect("released");
        assert_eq!(host.removed(), [vip]);
    }

    #[tokio::test]
    async fn an_address_already_there_is_used_and_never_removed() {
        let host = FakeAddressHost::new();
        let node = ip("192.0.2.10");
        host.preset(node);
        let mut addresses = manager(&host);
        addresses.acquire(node).await.expect("present");
        assert!(host.added().is_empty());
        assert!(addresses.added().is_empty());
        addresses.release(node).expect("released");
        assert!(host.present(node), "not ours to remove");
        assert!(addresses.release_all().is_empty());
        assert!(host.present(node));
    }

    #[tokio::test]
    async fn a_refused_add_names_the_address_and_interface() {
        let host = FakeAddressHost::new();
        host.set_fault(FakeFault::Add, true);
        let mut addresses = manager(&host);
        let error = addresses
            .acquire(ip("10.96.0.11"))
            .await
            .expect_err("refused");
        assert!(matches!(error, AddressError::Add { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            "cannot add 10.96.0.11 to interface \"fake0\""
        );
        assert_eq!(
            error.source().map(ToString::to_string).as_deref(),
            Some("injected failure")
        );
        assert_eq!(addresses.users(ip("10.96.0.11")), 0, "nothing held");
    }

    #[tokio::test]
    async fn an_address_that_never_comes_up_times_out_and_is_taken_back() {
        let host = FakeAddressHost::new();
        host.set_fault(FakeFault::NeverUsable, true);
        let mut addresses = manager(&host);
        let vip = ip("fd00:96::11");
        let started = std::time::Instant::now();
        let error = addresses.acquire(vip).await.expect_err("times out");
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(started.elapsed() < Duration::from_secs(5), "bounded");
        assert!(matches!(error, AddressError::Timeout { .. }), "{error:?}");
        assert!(error.to_string().contains("fd00:96::11"), "{error}");
        assert!(error.to_string().contains("\"fake0\""), "{error}");
        assert!(!host.present(vip), "removed again");
        assert_eq!(addresses.users(vip), 0);
    }

    #[tokio::test]
    async fn lookup_and_remove_failures_are_errors_too() {
        let host = FakeAddressHost::new();
        let mut addresses = manager(&host);
        host.set_fault(FakeFault::Lookup, true);
        let error = addresses
            .acquire(ip("10.96.0.12"))
            .await
            .expect_err("no table");
        assert!(matches!(error, AddressError::Lookup { .. }), "{error:?}");
        host.set_fault(FakeFault::Lookup, false);
        addresses.acquire(ip("10.96.0.12")).await.expect("added");
        host.set_fault(FakeFault::Remove, true);
        let error = addresses
            .release(ip("10.96.0.12"))
            .expect_err("remove refused");
        assert!(matches!(error, AddressError::Remove { .. }), "{error:?}");
        assert!(error.to_string().contains("10.96.0.12"), "{error}");
        assert!(error.source().is_some());
    }

    #[tokio::test]
    async fn release_all_removes_only_what_was_added() {
        let host = FakeAddressHost::new();
        host.preset(ip("192.0.2.10"));
        let mut addresses = manager(&host);
        for vip in ["10.96.0.10", "10.96.0.10", "fd00:96::10", "192.0.2.10"] {
            addresses.acquire(ip(vip)).await.expect("acquired");
        }
        assert!(addresses.release_all().is_empty());
        assert_eq!(host.removed(), [ip("10.96.0.10"), ip("fd00:96::10")]);
        assert!(host.present(ip("192.0.2.10")));
        assert!(addresses.added().is_empty());
    }

    #[tokio::test]
    async fn the_record_lists_what_was_added_until_removed_and_cleanup_removes_it() {
        let dir = std::env::temp_dir().join(format!("kp-addr-record-{}", std::process::id()));
        let path = dir.join("addresses");
        let host = FakeAddressHost::new();
        host.preset(ip("192.0.2.10"));
        let mut addresses = ServiceAddresses::new(RecordingHost::new(host.clone(), path.clone()));
        for vip in ["10.96.0.10", "fd00:96::10", "192.0.2.10"] {
            addresses.acquire(ip(vip)).await.expect("acquired");
        }
        let listed = RecordingHost::<FakeAddressHost>::recorded(&path);
        assert_eq!(listed, [ip("10.96.0.10"), ip("fd00:96::10")].into());
        addresses.release(ip("10.96.0.10")).expect("released");
        let listed = RecordingHost::<FakeAddressHost>::recorded(&path);
        assert_eq!(listed, [ip("fd00:96::10")].into());
        // The process dies without releasing: a later --cleanup reads the record.
        drop(addresses);
        let mut cleanup = RecordingHost::new(host.clone(), path.clone());
        assert!(cleanup.remove_recorded().is_empty());
        assert!(!host.present(ip("fd00:96::10")));
        assert!(host.present(ip("192.0.2.10")), "never ours");
        assert!(RecordingHost::<FakeAddressHost>::recorded(&path).is_empty());
        let _ = std::fs::remove_dir_all(dir);
    }
}
