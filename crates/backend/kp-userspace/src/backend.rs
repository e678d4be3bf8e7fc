//! [`UserspaceBackend`]: userspace mode as a [`kp_core::backend::Backend`]. Each sync opens
//! and closes frontends, hands them their endpoints, and has the [`Capture`] steer service
//! traffic to them.
//!
//! Frontends: one per service port, family and scope, all of a service sharing its caps. The internal frontend serves ClusterIP
//! traffic with the internal traffic policy's endpoints; the external one (only for ports with
//! a NodePort, externalIPs or LB IPs) serves the rest with the external policy's endpoints.
//! Two frontends are the only way a relay can honour both policies: by the time a connection
//! reaches it, the destination that distinguishes them has been rewritten.
//!
//! A frontend exists only while it has endpoints to relay to; without any, capture refuses or
//! drops the traffic as the kernel modes do. Its listener (and relay port) stays the same for
//! as long as it exists (and the relay address does), so unchanged services keep their rules
//! on partial syncs. The frontends of one service port share its ClientIP affinity table.
//!
//! Relay address: per family, the first of the Node's addresses that is local (can be bound).
//! Frontends listen on it and the capture DNATs to it; without one they listen on the
//! wildcard address and the capture REDIRECTs (which fails for traffic arriving on an
//! interface without an address of the family: see `kp_rules::userspace`).

use kp_core::report::ErrorChain as _;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use kp_core::backend::{ApplyError, Backend, BackendError, SyncKind, SyncReport, SyncRequest};
use kp_core::model::{IpFamily, Protocol, ServicePort, ServicePortName};
use tokio::net::{TcpListener, UdpSocket};
use tracing::{debug, error, info};

use crate::capture::{Capture, CapturePlan, CapturedPort, Target};
use crate::relay::{Owner, Relay};
use crate::shared::{endpoint_addresses, service_plan, skip_sctp};
use crate::{RelayConfig, RelayMetrics};

/// The mode name served on `/proxyMode`.
pub const MODE: &str = "userspace";

/// Which traffic of a service port a frontend serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// ClusterIP traffic (internal traffic policy).
    Internal,
    /// NodePort, externalIP and LoadBalancer IP traffic (external traffic policy).
    External,
}

/// A frontend's identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrontendKey {
    /// The service port.
    pub port: ServicePortName,
    /// The family of its addresses.
    pub family: IpFamily,
    /// Internal or external.
    pub scope: Scope,
}

impl fmt::Display for FrontendKey {
    /// `ns/name:port/tcp/IPv4/internal`: the frontend's metric label.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scope = match self.scope {
            Scope::Internal => "internal",
            Scope::External => "external",
        };
        write!(
            f,
            "{}/{}/{}/{scope}",
            self.port,
            self.port.protocol.as_str(),
            self.family.api_name()
        )
    }
}

pub use crate::shared::service_port_label;

/// Where the backend opens frontends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BindAddresses {
    /// IPv4 frontends' address (the wildcard in production: `REDIRECT` delivers to the
    /// receiving interface's address).
    pub v4: Ipv4Addr,
    /// IPv6 frontends' address.
    pub v6: Ipv6Addr,
}

impl Default for BindAddresses {
    fn default() -> Self {
        Self {
            v4: Ipv4Addr::UNSPECIFIED,
            v6: Ipv6Addr::UNSPECIFIED,
        }
    }
}

impl BindAddresses {
    fn of(&self, family: IpFamily) -> IpAddr {
        match family {
            IpFamily::V4 => IpAddr::V4(self.v4),
            IpFamily::V6 => IpAddr::V6(self.v6),
        }
    }
}

/// Userspace mode: a relay plus a capture.
#[derive(Debug)]
pub struct UserspaceBackend<C> {
    relay: Relay<FrontendKey>,
    capture: C,
    families: Vec<IpFamily>,
    bind: BindAddresses,
    sctp_warned: BTreeSet<ServicePortName>,
    /// With a port range: where in it the next frontend's search starts, so a port just
    /// given up is not the first one handed out again.
    next_port: u32,
    /// Whether relay addresses are chosen from the Node's addresses (off when the caller
    /// fixed the bind addresses).
    choose_relay_addresses: bool,
    /// The Node addresses the relay addresses were last chosen from, and the choice.
    relay_addresses: (Vec<IpAddr>, BTreeMap<IpFamily, IpAddr>),
    /// This node's IP of each family as detected at start-up (upstream's node IP), for the
    /// allowance `loadBalancerSourceRanges` give the node; empty: the Node's addresses.
    node_ips: Vec<IpAddr>,
}

/// A bound frontend socket.
enum Bound {
    Tcp(TcpListener),
    Udp(UdpSocket),
}

impl Bound {
    async fn bind(protocol: Protocol, addr: SocketAddr) -> std::io::Result<Self> {
        match protocol {
            Protocol::Tcp => TcpListener::bind(addr).await.map(Bound::Tcp),
            Protocol::Udp => UdpSocket::bind(addr).await.map(Bound::Udp),
            Protocol::Sctp => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "the relay has no SCTP",
            )),
        }
    }
}

impl<C: Capture> UserspaceBackend<C> {
    /// A backend for `families` whose relay uses `config`. Must be created inside a tokio
    /// runtime's context (the relay spawns tasks when frontends open).
    pub fn new(
        config: RelayConfig,
        metrics: RelayMetrics,
        capture: C,
        families: Vec<IpFamily>,
    ) -> Self {
        Self {
            relay: Relay::new(config, metrics),
            capture,
            families,
            bind: BindAddresses::default(),
            sctp_warned: BTreeSet::new(),
            next_port: 0,
            choose_relay_addresses: true,
            relay_addresses: (Vec::new(), BTreeMap::new()),
            node_ips: Vec::new(),
        }
    }

    /// Uses these node IPs (one per family, as detected at start-up) where upstream uses
    /// "the node IP", as the kernel modes' renderers do.
    pub fn with_node_ips(mut self, node_ips: Vec<IpAddr>) -> Self {
        self.node_ips = node_ips;
        self
    }

    /// Opens frontends on these addresses instead of the wildcards or the Node's addresses
    /// (tests use loopback).
    pub fn with_bind_addresses(mut self, bind: BindAddresses) -> Self {
        self.bind = bind;
        self.choose_relay_addresses = false;
        self
    }

    /// Chooses the relay address of each family: the first of the Node's addresses that is
    /// local (a socket can be bound to it). Checked again when they change and on every full
    /// sync, so an address that only becomes usable later (IPv6 duplicate address detection)
    /// or goes away from the node is noticed within a sync period.
    fn choose_relay_addresses(&mut self, node_addresses: &[IpAddr], full: bool) {
        if !self.choose_relay_addresses || (!full && self.relay_addresses.0 == node_addresses) {
            return;
        }
        let mut chosen = BTreeMap::new();
        for family in &self.families {
            let local = node_addresses.iter().copied().find(|ip| {
                IpFamily::of(ip) == *family
                    && !ip.is_loopback()
                    && std::net::UdpSocket::bind(SocketAddr::new(*ip, 0)).is_ok()
            });
            if self.relay_addresses.1.get(family) != local.as_ref() {
                match local {
                    Some(ip) => {
                        info!(?family, relay_address = %ip, "userspace relay listens on this node address; service traffic is DNATed to it")
                    }
                    None => info!(
                        ?family,
                        "no local node address for the userspace relay; service traffic is REDIRECTed (needs an address on every interface it arrives on)"
                    ),
                }
            }
            if let Some(ip) = local {
                chosen.insert(*family, ip);
            }
        }
        self.relay_addresses = (node_addresses.to_vec(), chosen);
    }

    /// Where frontends of `family` listen.
    fn bind_ip(&self, family: IpFamily) -> IpAddr {
        self.relay_addresses
            .1
            .get(&family)
            .copied()
            .unwrap_or_else(|| self.bind.of(family))
    }

    /// The relay (for tests and diagnostics).
    pub fn relay(&self) -> &Relay<FrontendKey> {
        &self.relay
    }

    /// Opens frontend `key` unless it is open on the family's current address (one on
    /// another address is replaced); returns its port and whether it is new.
    async fn ensure_frontend(&mut self, key: &FrontendKey) -> std::io::Result<(u16, bool)> {
        let ip = self.bind_ip(key.family);
        if let Some(addr) = self.relay.local_addr(key).filter(|a| a.ip() == ip) {
            return Ok((addr.port(), false));
        }
        let service = key.port.service.to_string();
        let service_port = service_port_label(&key.port);
        let owner = Owner {
            service: &service,
            service_port: &service_port,
        };
        let addr = match self.bind_frontend(key.port.protocol, ip).await? {
            Bound::Tcp(listener) => self.relay.add_tcp(key.clone(), owner, listener)?,
            Bound::Udp(socket) => self.relay.add_udp(key.clone(), owner, socket)?,
        };
        debug!(frontend = %key, %addr, "opened frontend");
        Ok((addr.port(), true))
    }

    /// Binds a frontend socket: on an ephemeral port, or with a port range on its first
    /// free port, searching from after the last port handed out.
    async fn bind_frontend(&mut self, protocol: Protocol, ip: IpAddr) -> std::io::Result<Bound> {
        let Some(range) = self.relay.config().port_range.clone() else {
            return Bound::bind(protocol, SocketAddr::new(ip, 0)).await;
        };
        let (low, high) = (*range.start(), *range.end());
        let size = u32::from(high.saturating_sub(low)) + 1;
        for i in 0..size {
            let offset = (self.next_port + i) % size;
            let Ok(port) = u16::try_from(u32::from(low) + offset) else {
                continue;
            };
            match Bound::bind(protocol, SocketAddr::new(ip, port)).await {
                Ok(bound) => {
                    self.next_port = (offset + 1) % size;
                    return Ok(bound);
                }
                Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => {}
                Err(error) => return Err(error),
            }
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("no free port in the proxy port range {low}-{high}"),
        ))
    }

    /// The target for one scope: a frontend (opened if needed) when there are endpoints,
    /// otherwise REJECT (no endpoints at all) or DROP (none under this policy).
    async fn target(
        &mut self,
        key: FrontendKey,
        endpoints: Vec<SocketAddr>,
        any_endpoints: bool,
        affinity: Option<Duration>,
        wanted: &mut BTreeSet<FrontendKey>,
        reopened: &mut BTreeSet<ServicePortName>,
    ) -> std::io::Result<Target> {
        if endpoints.is_empty() {
            return Ok(if any_endpoints {
                Target::Drop
            } else {
                Target::Reject
            });
        }
        let (port, new) = self.ensure_frontend(&key).await?;
        if new {
            reopened.insert(key.port.clone());
        }
        self.relay.update(&key, endpoints, affinity);
        wanted.insert(key);
        Ok(Target::Redirect(port))
    }
}

impl<C: Capture> Backend for UserspaceBackend<C> {
    fn mode(&self) -> &'static str {
        MODE
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let state = request.state;
        self.choose_relay_addresses(&state.node.addresses, request.kind == SyncKind::Full);
        let mut plan = CapturePlan {
            relay_addresses: self.relay_addresses.1.clone(),
            ..CapturePlan::default()
        };
        let mut wanted: BTreeSet<FrontendKey> = BTreeSet::new();
        let mut reopened: BTreeSet<ServicePortName> = BTreeSet::new();
        let mut skipped = BTreeSet::new();
        let services: Vec<(&ServicePortName, &ServicePort)> = state.services.iter().collect();
        for (name, svc) in services {
            if skip_sctp(&mut self.sctp_warned, name, MODE) {
                continue;
            }
            let affinity = svc.session_affinity.map(|a| a.timeout);
            for family in self.families.clone() {
                let Some(port) = svc.for_family(family) else {
                    continue;
                };
                // Upstream's node IP of this family, for the plan's allowFromNode.
                let node_ip = kp_rules::iptables::node_ip(&self.node_ips, &state.node, family);
                let chosen = service_plan(svc, state, node_ip);
                let internal_list = chosen.list(chosen.internal.list);
                let external_list = chosen.list(chosen.external.list);
                let Some(&cluster_ip) = port.cluster_ips.first() else {
                    continue;
                };
                let key = |scope| FrontendKey {
                    port: name.clone(),
                    family,
                    scope,
                };
                let internal = self
                    .target(
                        key(Scope::Internal),
                        endpoint_addresses(internal_list, family),
                        chosen.has_endpoints,
                        affinity,
                        &mut wanted,
                        &mut reopened,
                    )
                    .await;
                let external = if port.externally_accessible() {
                    self.target(
                        key(Scope::External),
                        endpoint_addresses(external_list, family),
                        chosen.has_endpoints,
                        affinity,
                        &mut wanted,
                        &mut reopened,
                    )
                    .await
                } else {
                    Ok(Target::Reject)
                };
                let (internal, external) = match (internal, external) {
                    (Ok(i), Ok(e)) => (i, e),
                    (Err(error), _) | (_, Err(error)) => {
                        error!(service = %name, ?family, error = %error.chain(), "cannot open a relay frontend; service skipped");
                        skipped.insert(name.service.clone());
                        continue;
                    }
                };
                plan.families.entry(family).or_default().push(CapturedPort {
                    name: name.clone(),
                    port: port.port,
                    cluster_ip,
                    external_ips: port.external_ips.clone(),
                    load_balancer_ips: port.load_balancer_ips.clone(),
                    source_ranges: port.load_balancer_source_ranges.clone(),
                    node_port: port.node_port,
                    internal,
                    external,
                    // As upstream: under eTP Local the node's own traffic to external
                    // addresses uses the cluster-wide endpoints when the service has them
                    // in use (here: the internal frontend's, under iTP Cluster).
                    local_source_internal: svc.external_policy_local && !svc.internal_policy_local,
                    allow_from_node: chosen.allow_from_node,
                });
            }
        }

        let full = request.kind == SyncKind::Full;
        let changed: BTreeSet<ServicePortName> = state
            .services
            .keys()
            .filter(|n| request.changed.contains(&n.service))
            .cloned()
            .chain(reopened)
            .chain(
                // Ports of deleted services: their chains go.
                self.relay
                    .keys()
                    .filter(|k| !wanted.contains(*k))
                    .map(|k| k.port.clone()),
            )
            .collect();
        self.relay.forget_stale_pins();
        let kind = self
            .capture
            .apply(&plan, (!full).then_some(&changed))
            .await
            .map_err(|e| ApplyError::capture("userspace capture", e))?;
        // Only now that no rule points at them: stop frontends no longer wanted.
        // Established connections finish on their own.
        let stale: Vec<FrontendKey> = self
            .relay
            .keys()
            .filter(|k| !wanted.contains(*k))
            .cloned()
            .collect();
        for key in stale {
            self.relay.remove(&key);
            debug!(frontend = %key, "closed frontend");
        }
        Ok(SyncReport {
            kind,
            rules_written: plan.len(),
            skipped: skipped.into_iter().collect(),
        })
    }

    async fn verify(
        &mut self,
        check: kp_core::foreign::Check,
    ) -> Result<Vec<kp_core::foreign::ForeignChange>, BackendError> {
        self.capture
            .verify(check)
            .await
            .map_err(|e| ApplyError::capture("userspace canary check", e).into())
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        self.capture
            .cleanup()
            .await
            .map_err(|e| ApplyError::capture("userspace cleanup", e).into())
    }
}
