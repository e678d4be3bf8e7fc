//! This node's interface addresses, read over rtnetlink: what `nodePortAddresses` selects
//! from, and where ipvs mode's NodePorts listen. One dump of the links (for their names) and
//! one of the addresses, in the network namespace of the process.

use std::collections::BTreeMap;
use std::net::IpAddr;

use futures::TryStreamExt as _;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::LinkAttribute;

/// One address of one interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddress {
    /// The interface's name.
    pub device: String,
    /// The address.
    pub ip: IpAddr,
}

/// Why the addresses could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InterfaceError {
    /// The rtnetlink socket could not be opened.
    #[error("cannot open an rtnetlink socket")]
    Socket(#[source] std::io::Error),
    /// The kernel refused a dump, or the socket failed during it.
    // The one cause kept in the message, not in `source()`: the Display of a netlink error
    // leaves out the errno, so its Debug is printed.
    #[error("cannot list the {what}: {error:?}")]
    Dump {
        /// What was listed: links or addresses.
        what: &'static str,
        /// The netlink error.
        error: rtnetlink::Error,
    },
}

/// Every address of every interface, ordered by interface index as `ip addr` lists them.
/// Needs a tokio runtime (the socket's connection runs as a task until this returns).
pub async fn interface_addresses() -> Result<Vec<InterfaceAddress>, InterfaceError> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(InterfaceError::Socket)?;
    let connection = tokio::spawn(connection);
    let result = dump(&handle).await;
    connection.abort();
    result
}

async fn dump(handle: &rtnetlink::Handle) -> Result<Vec<InterfaceAddress>, InterfaceError> {
    let failed = |what| move |error| InterfaceError::Dump { what, error };
    let mut names = BTreeMap::new();
    let mut links = handle.link().get().execute();
    while let Some(link) = links.try_next().await.map_err(failed("links"))? {
        let name = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(name) => Some(name.clone()),
            _ => None,
        });
        if let Some(name) = name {
            names.insert(link.header.index, name);
        }
    }
    let mut found = Vec::new();
    let mut addresses = handle.address().get().execute();
    while let Some(message) = addresses.try_next().await.map_err(failed("addresses"))? {
        // On a point-to-point link `Address` is the peer's; `Local` is ours when present.
        let local = message.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        });
        let address = message.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        let (Some(ip), Some(device)) = (local.or(address), names.get(&message.header.index)) else {
            continue;
        };
        found.push((
            message.header.index,
            InterfaceAddress {
                device: device.clone(),
                ip,
            },
        ));
    }
    // Stable: within an interface the kernel's order (IPv4 first).
    found.sort_by_key(|(index, _)| *index);
    Ok(found.into_iter().map(|(_, address)| address).collect())
}
