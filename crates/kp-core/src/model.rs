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
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Serialize;

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
        if ip.is_ipv4() { IpFamily::V4 } else { IpFamily::V6 }
    }
}

/// A Service's identity.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ServiceName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
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
    pub port: String,
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
        self.node_port.is_some() || !self.external_ips.is_empty() || !self.load_balancer_ips.is_empty()
    }

    /// Uses the cluster-wide endpoint list (iTP Cluster, or externally accessible).
    pub fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }

    /// Uses the node-local endpoint list (iTP Local, or eTP Local and externally accessible).
    pub fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
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
    /// `nodeName`, if set.
    pub node_name: Option<String>,
    /// `zone`, if set.
    pub zone: Option<String>,
    /// `hints.forZones`, if present.
    pub zone_hints: Option<BTreeSet<String>>,
    /// `hints.forNodes`, if present.
    pub node_hints: Option<BTreeSet<String>>,
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
        self.labels.get("topology.kubernetes.io/zone").map(String::as_str)
    }
}

/// A problem with one object. The object is skipped; everything else is programmed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind} {namespace}/{name}: {}", problems.join("; "))]
pub struct ModelError {
    /// `Service`, `EndpointSlice` or `Node`.
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
    pub ports: Vec<(String, Protocol, u16)>,
    /// The slice's endpoints, one per address, with `port` set to 0 (filled in per port when
    /// merging) and `is_local` unset (filled in when merging).
    pub endpoints: Vec<Endpoint>,
}

/// Build a Service's ports. `None` for services the proxy ignores (headless, ExternalName,
/// no ClusterIP); an error names every invalid field.
pub fn service_ports(service: &Service) -> Result<Option<Vec<ServicePort>>, ModelError> {
    let _ = service;
    todo!("model helper")
}

/// Parse one EndpointSlice. `None` for slices the proxy ignores (no service-name label,
/// FQDN address type).
pub fn slice_endpoints(slice: &EndpointSlice) -> Result<Option<SliceEndpoints>, ModelError> {
    let _ = slice;
    todo!("model helper")
}

/// Merge the slices of one service into per-service-port endpoint lists, sorted and
/// de-duplicated, with `is_local` computed against `node_name`.
pub fn merge_slices<'a>(
    slices: impl IntoIterator<Item = &'a SliceEndpoints>,
    node_name: &str,
) -> BTreeMap<ServicePortName, Vec<Endpoint>> {
    let _ = (slices.into_iter().count(), node_name);
    todo!("model helper")
}

/// Build the node's information from its Node object.
pub fn node_info(node: &Node) -> NodeInfo {
    let _ = node;
    todo!("model helper")
}
