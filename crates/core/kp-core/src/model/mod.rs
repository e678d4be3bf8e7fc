//! The service/endpoint model: what the proxy programs, built from Kubernetes objects.
//!
//! A Service with several ports becomes several independent [`ServicePort`]s, keyed by
//! [`ServicePortName`] (namespace, name, port name, protocol) as upstream does. Endpoints of all
//! of a service's EndpointSlices are merged per service port. Invalid objects are rejected
//! with a [`ModelError`] naming every problem; they never affect other services.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde::Serialize;

mod endpoints;
mod names;
mod node;
mod node_ips;
mod parse;
mod service;
mod service_cidr;
#[cfg(test)]
mod tests;

pub use endpoints::{SERVICE_NAME_LABEL, merge_slices, slice_endpoints, slice_endpoints_with};
pub use names::{Name, Names};
pub use node::{TO_BE_DELETED_TAINT, node_info};
pub use node_ips::{NodeIps, host_ips};
pub use parse::{
    AddressError, IpNetOrAddr, check_strict_cidr, check_strict_ip, parse_cidr, parse_ip,
};
pub use service::{
    DEFAULT_AFFINITY_TIMEOUT_SECONDS, MAX_AFFINITY_TIMEOUT_SECONDS, service_ports,
    service_ports_with,
};
pub use service_cidr::service_cidr_ranges;

/// Transport protocol of a service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Protocol {
    /// The lower-case name used in rules (`tcp`, `udp`, `sctp`).
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }

    /// The API spelling (`TCP`, `UDP`, `SCTP`), used in messages.
    pub fn api_name(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// Parse the API spelling (`TCP`, `UDP`, `SCTP`; case-sensitive, as the API validates).
    pub fn from_api(value: &str) -> Option<Self> {
        match value {
            "TCP" => Some(Protocol::Tcp),
            "UDP" => Some(Protocol::Udp),
            "SCTP" => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

/// IP family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// The family of an address.
    pub fn of(ip: &IpAddr) -> Self {
        if ip.is_ipv4() {
            IpFamily::V4
        } else {
            IpFamily::V6
        }
    }

    /// The family of a network.
    pub fn of_net(net: &IpNet) -> Self {
        match net {
            IpNet::V4(_) => IpFamily::V4,
            IpNet::V6(_) => IpFamily::V6,
        }
    }

    /// The API spelling (`IPv4`, `IPv6`), used in messages.
    pub fn api_name(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

/// A Service's identity.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: Name,
    /// Name.
    pub name: Name,
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One port of one Service: the unit every proxy mode programs.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ServicePortName {
    /// The Service.
    pub service: ServiceName,
    /// The port's name; empty for a single unnamed port.
    pub port: Name,
    /// The port's protocol.
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    /// Upstream's display name: `ns/name:port`, or `ns/name` when the port is unnamed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}", self.service)
        } else {
            write!(f, "{}:{}", self.service, self.port)
        }
    }
}

/// sessionAffinity ClientIP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct SessionAffinity {
    /// How long a client stays pinned after its last connection (API default 10800 s).
    pub timeout: Duration,
}

/// A service port as the proxy programs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServicePort {
    /// Identity.
    pub name: ServicePortName,
    /// ClusterIPs (one per family in dual-stack). Empty for headless and ExternalName
    /// services, which are not built at all.
    pub cluster_ips: Vec<IpAddr>,
    /// The service port number.
    pub port: u16,
    /// The NodePort, if allocated.
    pub node_port: Option<u16>,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`, except entries with `ipMode: Proxy`.
    pub load_balancer_ips: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`, canonicalised.
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// ClientIP affinity, if enabled.
    pub session_affinity: Option<SessionAffinity>,
    /// `externalTrafficPolicy: Local` (only meaningful when externally accessible).
    pub external_policy_local: bool,
    /// `internalTrafficPolicy: Local`.
    pub internal_policy_local: bool,
    /// The health-check node port of an eTP Local LoadBalancer service.
    pub health_check_node_port: Option<u16>,
}

impl ServicePort {
    /// Reachable from outside the cluster: has a NodePort, externalIPs or LB IPs.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some()
            || !self.external_ips.is_empty()
            || !self.load_balancer_ips.is_empty()
    }

    /// Uses the cluster-wide endpoint list (iTP Cluster, or externally accessible).
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }

    /// Uses the node-local endpoint list (iTP Local, or eTP Local and externally accessible).
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
    }

    /// This port as one IP family's proxier sees it: only that family's ClusterIP,
    /// externalIPs, LB IPs and source ranges. `None` when the service has no ClusterIP of that
    /// family (each family is programmed separately, as upstream's per-family proxiers do).
    pub fn for_family(&self, family: IpFamily) -> Option<ServicePort> {
        let of_family = |ips: &[IpAddr]| -> Vec<IpAddr> {
            ips.iter()
                .copied()
                .filter(|ip| IpFamily::of(ip) == family)
                .collect()
        };
        let cluster_ips = of_family(&self.cluster_ips);
        if cluster_ips.is_empty() {
            return None;
        }
        Some(ServicePort {
            cluster_ips,
            external_ips: of_family(&self.external_ips),
            load_balancer_ips: of_family(&self.load_balancer_ips),
            load_balancer_source_ranges: self
                .load_balancer_source_ranges
                .iter()
                .copied()
                .filter(|net| IpFamily::of_net(net) == family)
                .collect(),
            ..self.clone()
        })
    }
}

/// One endpoint of a service port, merged from EndpointSlices.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Endpoint {
    /// The endpoint's address.
    pub ip: IpAddr,
    /// The target port.
    pub port: u16,
    /// `conditions.ready` (unset means ready, as the API documents).
    pub ready: bool,
    /// `conditions.serving` (unset means same as ready).
    pub serving: bool,
    /// `conditions.terminating` (unset means false).
    pub terminating: bool,
    /// `nodeName`, if set. Shared ([`Names`]): a cluster has far fewer nodes than endpoints.
    pub node_name: Option<Name>,
    /// `zone`, if set. Shared like `node_name`.
    pub zone: Option<Name>,
    /// `hints.forZones`, if present. Boxed, like `node_hints`: most endpoints have none, and
    /// an empty `Option<BTreeSet>` inline is 24 bytes in each of ~10^5 endpoints.
    pub zone_hints: Option<Box<BTreeSet<String>>>,
    /// `hints.forNodes`, if present.
    pub node_hints: Option<Box<BTreeSet<String>>>,
    /// Runs on this node (`nodeName` equals this node's name).
    pub is_local: bool,
}

/// What the proxy knows about its own node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeInfo {
    /// The node name (hostname or `--hostname-override`).
    pub name: String,
    /// The node's labels (zone comes from `topology.kubernetes.io/zone`).
    pub labels: BTreeMap<String, String>,
    /// `status.addresses` that parse as IPs (InternalIP first, then ExternalIP).
    pub addresses: Vec<IpAddr>,
    /// `spec.podCIDRs`.
    pub pod_cidrs: Vec<IpNet>,
    /// False when the Node is missing, being deleted, or tainted
    /// `ToBeDeletedByClusterAutoscaler` (upstream's /healthz eligibility).
    pub eligible: bool,
    /// Whether a Node object has been seen at all.
    pub known: bool,
}

impl NodeInfo {
    /// The `topology.kubernetes.io/zone` label.
    pub fn zone(&self) -> Option<&str> {
        self.labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str)
    }
}

/// A problem with one object. The object is skipped; everything else is programmed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {namespace}/{name}: {}", problems.join("; "))]
pub struct ModelError {
    /// `Service`, `EndpointSlice`, `Node` or `ServiceCIDR`.
    pub kind: &'static str,
    /// Namespace (empty for Nodes).
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Every problem found, each naming its field, for example
    /// `spec.ports[1].port: 70000 is out of range 1-65535`.
    pub problems: Vec<String>,
}

/// The endpoints one EndpointSlice contributes, before merging.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceEndpoints {
    /// The owning service (label `kubernetes.io/service-name`).
    pub service: ServiceName,
    /// The slice's address family.
    pub family: IpFamily,
    /// The slice's ports: (port name, protocol, port number).
    pub ports: Vec<(Name, Protocol, u16)>,
    /// The slice's endpoints, one per address, with `port` set to 0 (filled in per port when
    /// merging) and `is_local` unset (filled in when merging).
    pub endpoints: Vec<Endpoint>,
}

/// Collects every problem of one object, so a single error can list them all.
#[derive(Default)]
struct Problems(Vec<String>);

impl Problems {
    /// Record a problem with the field at `path`.
    fn push(&mut self, path: impl fmt::Display, message: impl fmt::Display) {
        self.0.push(format!("{path}: {message}"));
    }

    /// `Ok(())` if nothing was recorded, otherwise the error for the whole object.
    fn into_result(
        self,
        kind: &'static str,
        namespace: &str,
        name: &str,
    ) -> Result<(), ModelError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ModelError {
                kind,
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                problems: self.0,
            })
        }
    }
}

/// Check a port number from the API (an `i32`) against 1-65535.
fn port_number(value: i32) -> Result<u16, String> {
    u16::try_from(value)
        .ok()
        .filter(|port| *port != 0)
        .ok_or_else(|| format!("{value} is out of range 1-65535"))
}
