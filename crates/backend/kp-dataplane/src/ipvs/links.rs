//! The `kube-ipvs0` dummy device and its addresses, over rtnetlink, behind [`Links`] with an
//! in-memory `FakeLinks` (`test-util`).

#[cfg(any(test, feature = "test-util"))]
use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::future::Future;
use std::net::IpAddr;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::TryStreamExt as _;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::LinkAttribute;
use rtnetlink::{Handle, LinkDummy};

/// Why a link operation failed.
#[derive(Debug, thiserror::Error)]
#[error("{op}: {message}")]
pub struct LinkError {
    /// What was attempted.
    pub op: String,
    /// The kernel's or the library's message.
    pub message: String,
}

fn link_error(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> LinkError {
    let op = op.into();
    // Debug: the Display of a netlink error leaves out the errno.
    move |e| LinkError {
        op,
        message: format!("{e:?}"),
    }
}

/// What ipvs mode does with links.
pub trait Links: Send {
    /// The interface index of dummy device `name`, creating it if missing.
    fn ensure_dummy(&mut self, name: &str) -> impl Future<Output = Result<u32, LinkError>> + Send;
    /// The interface index of device `name`; `None` if there is none.
    fn find_link(
        &mut self,
        name: &str,
    ) -> impl Future<Output = Result<Option<u32>, LinkError>> + Send;
    /// The addresses on interface `index`.
    fn addresses(
        &mut self,
        index: u32,
    ) -> impl Future<Output = Result<BTreeSet<IpAddr>, LinkError>> + Send;
    /// Adds `ip` as a host address (/32, /128).
    fn add_address(
        &mut self,
        index: u32,
        ip: IpAddr,
    ) -> impl Future<Output = Result<(), LinkError>> + Send;
    /// Removes host address `ip`.
    fn delete_address(
        &mut self,
        index: u32,
        ip: IpAddr,
    ) -> impl Future<Output = Result<(), LinkError>> + Send;
    /// Deletes device `name`; `Ok(false)` if there was none.
    fn delete_link(&mut self, name: &str) -> impl Future<Output = Result<bool, LinkError>> + Send;
}

fn host_prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

/// [`Links`] over an rtnetlink socket, opened on first use: its connection task runs on the
/// tokio runtime of that first call, which must outlive the backend (the proxy has one).
#[derive(Debug, Default)]
pub struct RtLinks {
    handle: Option<Handle>,
}

impl RtLinks {
    /// Not connected until the first call.
    pub fn new() -> Self {
        Self::default()
    }

    fn handle(&mut self) -> Result<Handle, LinkError> {
        if let Some(h) = &self.handle {
            return Ok(h.clone());
        }
        let (connection, handle, _) = rtnetlink::new_connection().map_err(|e| LinkError {
            op: "open an rtnetlink socket".into(),
            message: e.to_string(),
        })?;
        tokio::spawn(connection);
        self.handle = Some(handle.clone());
        Ok(handle)
    }

    /// The index of link `name`, from a dump of every link (a lookup by name answers a
    /// missing link with an error whose code differs between kernels).
    async fn index_of(handle: &Handle, name: &str) -> Result<Option<u32>, LinkError> {
        let mut links = handle.link().get().execute();
        while let Some(link) = links
            .try_next()
            .await
            .map_err(link_error(format!("look up {name}")))?
        {
            let named = link
                .attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::IfName(n) if n == name));
            if named {
                return Ok(Some(link.header.index));
            }
        }
        Ok(None)
    }
}

impl Links for RtLinks {
    async fn ensure_dummy(&mut self, name: &str) -> Result<u32, LinkError> {
        let handle = self.handle()?;
        if let Some(index) = Self::index_of(&handle, name).await? {
            return Ok(index);
        }
        handle
            .link()
            .add(LinkDummy::new(name).build())
            .execute()
            .await
            .map_err(link_error(format!("create dummy device {name}")))?;
        Self::index_of(&handle, name)
            .await?
            .ok_or_else(|| LinkError {
                op: format!("create dummy device {name}"),
                message: "created but not found".into(),
            })
    }

    async fn find_link(&mut self, name: &str) -> Result<Option<u32>, LinkError> {
        let handle = self.handle()?;
        Self::index_of(&handle, name).await
    }

    async fn addresses(&mut self, index: u32) -> Result<BTreeSet<IpAddr>, LinkError> {
        let handle = self.handle()?;
        let mut stream = handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute();
        let mut out = BTreeSet::new();
        while let Some(msg) = stream
            .try_next()
            .await
            .map_err(link_error(format!("list addresses of link {index}")))?
        {
            if msg.header.index != index {
                continue;
            }
            for attr in &msg.attributes {
                if let AddressAttribute::Address(ip) = attr {
                    out.insert(*ip);
                }
            }
        }
        Ok(out)
    }

    async fn add_address(&mut self, index: u32, ip: IpAddr) -> Result<(), LinkError> {
        let handle = self.handle()?;
        handle
            .address()
            .add(index, ip, host_prefix(ip))
            .execute()
            .await
            .map_err(link_error(format!("add {ip} to link {index}")))
    }

    async fn delete_address(&mut self, index: u32, ip: IpAddr) -> Result<(), LinkError> {
        let handle = self.handle()?;
        let mut stream = handle
            .address()
            .get()
            .set_link_index_filter(index)
            .set_address_filter(ip)
            .execute();
        while let Some(msg) = stream
            .try_next()
            .await
            .map_err(link_error(format!("find {ip} on link {index}")))?
        {
            handle
                .address()
                .del(msg)
                .execute()
                .await
                .map_err(link_error(format!("delete {ip} from link {index}")))?;
        }
        Ok(())
    }

    async fn delete_link(&mut self, name: &str) -> Result<bool, LinkError> {
        let handle = self.handle()?;
        let Some(index) = Self::index_of(&handle, name).await? else {
            return Ok(false);
        };
        handle
            .link()
            .del(index)
            .execute()
            .await
            .map_err(link_error(format!("delete {name}")))?;
        Ok(true)
    }
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeTable {
    links: BTreeMap<String, (u32, BTreeSet<IpAddr>)>,
    changes: Vec<String>,
    requests: usize,
}

#[cfg(any(test, feature = "test-util"))]
/// In-memory [`Links`]; clones share the table. Records every change as text.
#[derive(Clone, Debug, Default)]
pub struct FakeLinks {
    table: Arc<Mutex<FakeTable>>,
}

#[cfg(any(test, feature = "test-util"))]
impl FakeLinks {
    /// No links.
    pub fn new() -> Self {
        Self::default()
    }

    /// The addresses on `name`, if it exists.
    pub fn addresses_of(&self, name: &str) -> Option<BTreeSet<IpAddr>> {
        self.lock().links.get(name).map(|(_, a)| a.clone())
    }

    /// How many requests were made (each at least one rtnetlink round trip).
    pub fn requests(&self) -> usize {
        self.lock().requests
    }

    /// Changes since the last call (`add IP`, `del IP`, `create NAME`, `delete NAME`).
    pub fn take_changes(&self) -> Vec<String> {
        std::mem::take(&mut self.lock().changes)
    }

    fn lock(&self) -> MutexGuard<'_, FakeTable> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one request.
    fn request(&self) {
        self.lock().requests += 1;
    }

    fn with_index<T>(
        &self,
        index: u32,
        f: impl FnOnce(&mut BTreeSet<IpAddr>) -> T,
    ) -> Result<T, LinkError> {
        let mut t = self.lock();
        let (_, addrs) = t
            .links
            .values_mut()
            .find(|(i, _)| *i == index)
            .ok_or_else(|| LinkError {
                op: format!("link {index}"),
                message: "no such device".into(),
            })?;
        Ok(f(addrs))
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Links for FakeLinks {
    async fn ensure_dummy(&mut self, name: &str) -> Result<u32, LinkError> {
        self.request();
        let mut t = self.lock();
        let next = u32::try_from(t.links.len()).unwrap_or(u32::MAX - 10) + 10;
        if let Some((i, _)) = t.links.get(name) {
            return Ok(*i);
        }
        t.links.insert(name.to_owned(), (next, BTreeSet::new()));
        t.changes.push(format!("create {name}"));
        Ok(next)
    }

    async fn find_link(&mut self, name: &str) -> Result<Option<u32>, LinkError> {
        self.request();
        Ok(self.lock().links.get(name).map(|(i, _)| *i))
    }

    async fn addresses(&mut self, index: u32) -> Result<BTreeSet<IpAddr>, LinkError> {
        self.request();
        self.with_index(index, |a| a.clone())
    }

    async fn add_address(&mut self, index: u32, ip: IpAddr) -> Result<(), LinkError> {
        self.request();
        self.with_index(index, |a| a.insert(ip))?;
        self.lock().changes.push(format!("add {ip}"));
        Ok(())
    }

    async fn delete_address(&mut self, index: u32, ip: IpAddr) -> Result<(), LinkError> {
        self.request();
        self.with_index(index, |a| a.remove(&ip))?;
        self.lock().changes.push(format!("del {ip}"));
        Ok(())
    }

    async fn delete_link(&mut self, name: &str) -> Result<bool, LinkError> {
        self.request();
        let mut t = self.lock();
        let existed = t.links.remove(name).is_some();
        if existed {
            t.changes.push(format!("delete {name}"));
        }
        Ok(existed)
    }
}
