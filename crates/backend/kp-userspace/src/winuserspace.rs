//! [`WinBackend`]: `winuserspace`, the relay as upstream's Windows userspace proxier ran it.
//! There is no packet capture on Windows, so each service port gets one listening socket (a
//! portal) per address it answers on: its ClusterIP, each externalIP and each LoadBalancer IP
//! at the service port, and every address of the family at its NodePort. A service address
//! must be on a host interface before it can be bound: [`ServiceAddresses`] adds it (reference
//! counted: two services may share one) and removes it when its last portal closes.
//!
//! The relay is the same as Linux userspace mode's: round robin, ClientIP affinity shared by
//! all portals of a service port, retries on the next endpoint, UDP sessions, per-service
//! caps. ClusterIP portals relay to the internal traffic policy's endpoints, the others to
//! the external policy's. A portal exists only while it has endpoints; without one the
//! address refuses connections. `loadBalancerSourceRanges` are not enforced (upstream's
//! winuserspace did not either). Nothing here is Windows-specific but the [`AddressHost`]
//! given to it, so it is tested on Linux with `FakeAddressHost` (the `test-util` feature).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use kp_core::backend::{ApplyError, Backend, BackendError, SyncKind, SyncReport, SyncRequest};
use kp_core::model::{IpFamily, ServiceName, ServicePort, ServicePortName};
use kp_core::report::ErrorChain as _;
use tracing::{debug, error, info};

use crate::addresses::{AddressError, AddressHost, ServiceAddresses};
use crate::bind::{Bound, bind};
use crate::relay::{Owner, Relay};
use crate::shared::{endpoint_addresses, service_plan, service_port_label, skip_sctp};
use crate::{RelayConfig, RelayMetrics};

/// The mode name served on `/proxyMode`.
pub const MODE: &str = "winuserspace";

/// Which of a service port's addresses a portal listens on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PortalKind {
    /// The ClusterIP (internal traffic policy).
    ClusterIp,
    /// An `externalIPs` entry.
    ExternalIp,
    /// A LoadBalancer ingress IP.
    LoadBalancer,
    /// The NodePort on every address of the family.
    NodePort,
}

impl PortalKind {
    /// Whether the address must be on an interface (all but the NodePort's wildcard).
    fn needs_address(self) -> bool {
        self != PortalKind::NodePort
    }
}

/// A portal's identity: a service port and the socket address it listens on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Portal {
    /// The service port.
    pub port: ServicePortName,
    /// What the address is to the service.
    pub kind: PortalKind,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl fmt::Display for Portal {
    /// `ns/name:port/tcp/10.96.0.10:80`: the portal's metric label.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", service_port_label(&self.port), self.addr)
    }
}

/// What one portal should relay to.
#[derive(Debug)]
struct Wanted {
    endpoints: Vec<SocketAddr>,
    affinity: Option<Duration>,
}

/// Why a portal could not be opened.
#[derive(Debug, thiserror::Error)]
enum OpenError {
    #[error(transparent)]
    Address(#[from] AddressError),
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// `winuserspace`: the relay with portals on the service addresses.
#[derive(Debug)]
pub struct WinBackend<H: AddressHost> {
    relay: Relay<Portal>,
    addresses: ServiceAddresses<H>,
    families: Vec<IpFamily>,
    sctp_warned: BTreeSet<ServicePortName>,
}

impl<H: AddressHost> WinBackend<H> {
    /// A backend for `families` adding service addresses through `addresses`. Must be
    /// created inside a tokio runtime's context.
    pub fn new(
        config: RelayConfig,
        metrics: RelayMetrics,
        addresses: ServiceAddresses<H>,
        families: Vec<IpFamily>,
    ) -> Self {
        Self {
            relay: Relay::new(config, metrics),
            addresses,
            families,
            sctp_warned: BTreeSet::new(),
        }
    }

    /// The relay (for tests and diagnostics).
    pub fn relay(&self) -> &Relay<Portal> {
        &self.relay
    }

    /// The service addresses (for tests and diagnostics).
    pub fn addresses(&self) -> &ServiceAddresses<H> {
        &self.addresses
    }

    /// Every portal `svc` wants, with its endpoints, for each family this node has.
    fn wanted(
        &mut self,
        svc: &ServicePort,
        state: &kp_core::tracker::ProxyState,
    ) -> Vec<(Portal, Wanted)> {
        let name = &svc.name;
        if skip_sctp(&mut self.sctp_warned, name, MODE) {
            return Vec::new();
        }
        // Portals do not filter by loadBalancerSourceRanges: no node IP is needed.
        let chosen = service_plan(svc, state, None);
        let internal = chosen.list(chosen.internal.list);
        let external = chosen.list(chosen.external.list);
        let affinity = svc.session_affinity.map(|a| a.timeout);
        let mut portals = Vec::new();
        for &family in &self.families {
            let Some(port) = svc.for_family(family) else {
                continue;
            };
            let mut add = |kind, addr, list| {
                let endpoints = endpoint_addresses(list, family);
                if !endpoints.is_empty() {
                    let portal = Portal {
                        port: name.clone(),
                        kind,
                        addr,
                    };
                    portals.push((
                        portal,
                        Wanted {
                            endpoints,
                            affinity,
                        },
                    ));
                }
            };
            for ip in &port.cluster_ips {
                add(
                    PortalKind::ClusterIp,
                    SocketAddr::new(*ip, port.port),
                    internal,
                );
            }
            for ip in &port.external_ips {
                add(
                    PortalKind::ExternalIp,
                    SocketAddr::new(*ip, port.port),
                    external,
                );
            }
            for ip in &port.load_balancer_ips {
                add(
                    PortalKind::LoadBalancer,
                    SocketAddr::new(*ip, port.port),
                    external,
                );
            }
            if let Some(node_port) = port.node_port {
                add(
                    PortalKind::NodePort,
                    SocketAddr::new(unspecified(family), node_port),
                    external,
                );
            }
        }
        portals
    }

    /// Opens `portal`: its address on an interface, then a socket on it.
    async fn open(&mut self, portal: &Portal) -> Result<(), OpenError> {
        let ip = portal.addr.ip();
        if portal.kind.needs_address() {
            self.addresses.acquire(ip).await?;
        }
        let service = portal.port.service.to_string();
        let service_port = service_port_label(&portal.port);
        let owner = Owner {
            service: &service,
            service_port: &service_port,
        };
        let bound = bind(portal.port.protocol, portal.addr).and_then(|socket| match socket {
            Bound::Tcp(listener) => self.relay.add_tcp(portal.clone(), owner, listener),
            Bound::Udp(socket) => self.relay.add_udp(portal.clone(), owner, socket),
        });
        if let Err(source) = bound {
            self.release(portal);
            return Err(OpenError::Bind {
                addr: portal.addr,
                source,
            });
        }
        debug!(%portal, "opened portal");
        Ok(())
    }

    /// Closes `portal` (established connections finish on their own) and gives back its
    /// address.
    fn close(&mut self, portal: &Portal) {
        self.relay.remove(portal);
        self.release(portal);
        debug!(%portal, "closed portal");
    }

    fn release(&mut self, portal: &Portal) {
        if !portal.kind.needs_address() {
            return;
        }
        if let Err(error) = self.addresses.release(portal.addr.ip()) {
            error!(error = %error.chain(), "cannot remove a service address");
        }
    }
}

/// The wildcard address of `family`.
fn unspecified(family: IpFamily) -> IpAddr {
    match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// The service addresses a cleanup could not remove, each with why.
#[derive(Debug)]
struct NotReleased(Vec<AddressError>);

impl fmt::Display for NotReleased {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let message: Vec<String> = self.0.iter().map(|e| e.chain().to_string()).collect();
        f.write_str(&message.join("; "))
    }
}

impl std::error::Error for NotReleased {}

impl<H: AddressHost> Backend for WinBackend<H> {
    fn mode(&self) -> &'static str {
        MODE
    }

    /// Every sync is a full one: it compares the portals wanted with those open, which
    /// costs nothing per unchanged portal.
    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let state = request.state;
        let mut wanted: BTreeMap<Portal, Wanted> = BTreeMap::new();
        for svc in state.services.values() {
            wanted.extend(self.wanted(svc, state));
        }
        // Close first: an address or port given up may be what a new portal needs.
        let stale: Vec<Portal> = self
            .relay
            .keys()
            .filter(|p| !wanted.contains_key(*p))
            .cloned()
            .collect();
        for portal in &stale {
            self.close(portal);
        }
        let mut skipped: BTreeSet<ServiceName> = BTreeSet::new();
        let mut open = 0;
        for (portal, want) in wanted {
            if self.relay.local_addr(&portal).is_none()
                && let Err(error) = self.open(&portal).await
            {
                error!(%portal, error = %error.chain(), "cannot open a portal; service skipped");
                skipped.insert(portal.port.service.clone());
                continue;
            }
            self.relay.update(&portal, want.endpoints, want.affinity);
            open += 1;
        }
        self.relay.forget_stale_pins();
        Ok(SyncReport {
            kind: SyncKind::Full,
            rules_written: open,
            skipped: skipped.into_iter().collect(),
        })
    }

    /// Closes every portal and removes every service address this process added.
    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let portals: Vec<Portal> = self.relay.keys().cloned().collect();
        for portal in &portals {
            self.relay.remove(portal);
        }
        let errors = self.addresses.release_all();
        if errors.is_empty() {
            return Ok(());
        }
        Err(ApplyError::capture("winuserspace cleanup", NotReleased(errors)).into())
    }
}

impl<H: AddressHost> Drop for WinBackend<H> {
    /// On shutdown the service addresses this process added go with it.
    fn drop(&mut self) {
        let added = self.addresses.added();
        for error in self.addresses.release_all() {
            error!(error = %error.chain(), "cannot remove a service address");
        }
        if !added.is_empty() {
            info!(addresses = ?added, "removed the service addresses this proxy added");
        }
    }
}
