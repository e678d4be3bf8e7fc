//! `kube-proxy explain`: why a packet to a destination goes where it goes.
//!
//! [`explain`] takes the proxy state, the render configuration and a [`Query`] (destination
//! IP, optional port and protocol, optional source IP) and returns an [`Explanation`]: every
//! service port the destination hits and how (ClusterIP, NodePort, externalIP, LoadBalancer
//! IP), each endpoint with its verdict and reason, the masquerade decision, session affinity,
//! the verdict when no endpoint is usable, and the iptables chains that implement it
//! ([`dataplane`] adds the nftables, IPVS or userspace objects when another mode is in use).
//!
//! Endpoint choice comes from [`kp_core::topology`] and chain names from
//! [`crate::iptables::names`], the same functions the renderer uses, so an explanation
//! cannot disagree with the rules that are programmed. [`verify`] compares those rules with
//! what the kernel holds.
//!
//! Each matched service port is first decided (route, endpoint list, outcome, from the
//! renderer's plan); the parts of its answer are told from that decision in submodules:
//! `endpoints` (each endpoint's verdict and reason), `masquerade` (the row of upstream's
//! masquerade table) and `hops` (the way through iptables mode's chains).
//!
//! Everything here is pure: the binary reads the sources and the kernel and prints.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{Endpoint, IpFamily, NodeInfo, Protocol, ServicePort, ServicePortName};
use kp_core::topology::{self, TopologyMode};
use kp_core::tracker::ProxyState;
use serde::Serialize;

use crate::iptables::names::{ServiceChains, endpoint_string};
use crate::iptables::{
    KUBE_PROXY_FIREWALL, LocalDetector, NodePortAddresses, RenderConfig, RenderError,
};
pub use crate::plan::EndpointList;
use crate::plan::{ExternalMasquerade, Masquerading, ServicePlan};

pub mod dataplane;
mod dest;
mod endpoints;
mod hops;
pub mod localhost;
mod masquerade;
pub mod verify;

pub use dest::{Destination, DestinationError};

/// The text shown when the destination matches no service port.
pub const NOT_A_SERVICE: &str =
    "not a service address: routed normally, kube-proxy does not touch it";

/// What to explain: a destination, and optionally where the packet comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Query {
    /// Where the packet goes.
    pub destination: Destination,
    /// Where it comes from; `None` when unknown (decisions that depend on it say so).
    pub source: Option<IpAddr>,
}

/// Why a query cannot be explained.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExplainError {
    /// Source and destination are of different IP families: no such packet exists.
    #[error("source {from} and destination {to} are of different IP families")]
    FamilyMismatch {
        /// The source address.
        from: IpAddr,
        /// The destination address.
        to: IpAddr,
    },
    /// The render configuration is one the renderer rejects, so there are no rules to explain.
    #[error("invalid proxy configuration")]
    Config(#[from] RenderError),
}

/// The whole answer for one query.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    /// The destination asked about.
    pub destination: Destination,
    /// What is known about the source, if one was given.
    pub source: Option<SourceInfo>,
    /// The family of the destination: only that family's proxier handles the packet.
    pub family: IpFamily,
    /// Every service port the destination hits, in service-port order.
    pub matches: Vec<ServiceMatch>,
    /// Service ports on the same IP whose port or protocol differ (why a near-miss is not
    /// handled).
    pub near_misses: Vec<NearMiss>,
    /// One line: how many service ports match, or [`NOT_A_SERVICE`].
    pub summary: String,
    /// nftables mode, a loopback destination: the NodePorts it names and what happens to
    /// them ([`localhost::explain_localhost`]; the caller fills it, `explain` leaves it empty).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub localhost_node_ports: Vec<localhost::LocalhostNodePort>,
}

/// What the proxy can tell about the source address.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SourceInfo {
    /// The source address.
    pub ip: IpAddr,
    /// Whether the local-traffic detector counts it as pod traffic: `None` when there is no
    /// detector for the family, or it matches interfaces rather than addresses.
    pub local_traffic: Option<bool>,
    /// One of this node's addresses or loopback, so `--src-type LOCAL` matches it.
    pub node_address: bool,
}

/// How the destination reaches a service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum MatchKind {
    /// The service's ClusterIP and port.
    ClusterIp,
    /// A node address and the service's NodePort.
    NodePort,
    /// One of `spec.externalIPs` and the service port.
    ExternalIp,
    /// A `status.loadBalancer.ingress` IP and the service port.
    LoadBalancerIp,
}

impl MatchKind {
    /// Human name.
    pub fn describe(self) -> &'static str {
        match self {
            MatchKind::ClusterIp => "ClusterIP",
            MatchKind::NodePort => "NodePort",
            MatchKind::ExternalIp => "externalIP",
            MatchKind::LoadBalancerIp => "LoadBalancer IP",
        }
    }

    /// NodePort, externalIP and LB traffic is "external" for traffic policies.
    pub fn is_external(self) -> bool {
        self != MatchKind::ClusterIp
    }
}

/// A service traffic policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum TrafficPolicy {
    /// Any ready endpoint in the cluster.
    Cluster,
    /// Only endpoints on this node.
    Local,
}

/// What happens to the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// DNATed to one of the used endpoints.
    Dnat,
    /// Rejected (ICMP port unreachable): no endpoint is usable anywhere in the cluster.
    RejectNoEndpoints,
    /// Dropped: the traffic policy is Local and this node has no usable endpoint.
    DropNoLocalEndpoints,
    /// Dropped: the source is outside `loadBalancerSourceRanges`.
    DropSourceRange,
}

/// Whether the packet's source is rewritten to the node's address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum MasqueradeDecision {
    /// Masqueraded.
    Yes,
    /// Not masqueraded: the endpoint sees the client's address.
    No,
    /// Depends on something the query does not say (source, incoming interface, which
    /// endpoint is picked).
    Depends,
    /// The packet is dropped or rejected; nothing is masqueraded.
    NotApplicable,
}

/// Which row of upstream's masquerade table applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum MasqueradeReason {
    /// `masqueradeAll`: every packet to a ClusterIP is masqueraded.
    MasqueradeAll,
    /// ClusterIP traffic from outside the local-traffic range (host or external).
    NotLocalTraffic,
    /// ClusterIP traffic from a pod (inside the local-traffic range).
    LocalTraffic,
    /// No local-traffic detector: pod traffic cannot be told apart, so none is masqueraded.
    NoLocalDetector,
    /// ClusterIP traffic, but the source is unknown or the detector matches interfaces.
    SourceUndetermined,
    /// The source is an endpoint that may be picked for itself (hairpin): that packet is
    /// masqueraded so the reply goes back through the service.
    Hairpin,
    /// External traffic with externalTrafficPolicy Cluster: always masqueraded.
    ExternalPolicyCluster,
    /// eTP Local from a local pod: not masqueraded, sent to any cluster endpoint.
    ExternalLocalFromPod,
    /// eTP Local from this node: masqueraded, sent to any cluster endpoint.
    ExternalLocalFromNode,
    /// eTP Local from outside: not masqueraded (client IP preserved), local endpoints only.
    ExternalLocalPreserved,
    /// The packet is dropped or rejected.
    Dropped,
}

/// The masquerade decision and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Masquerade {
    /// The decision.
    pub decision: MasqueradeDecision,
    /// The rule behind it.
    pub reason: MasqueradeReason,
    /// One sentence for people.
    pub detail: String,
}

/// Why an endpoint is or is not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum EndpointVerdict {
    /// Used: ready (and allowed by topology hints).
    Ready,
    /// Used: serving and terminating, because no ready endpoint is available.
    TerminatingFallback,
    /// Not used: serving but terminating, and a ready endpoint is preferred.
    ServingTerminating,
    /// Not used: ready, but topology hints send it to other nodes or zones.
    FilteredByTopology,
    /// Not used: on another node, and internalTrafficPolicy is Local.
    NotLocalInternalPolicy,
    /// Not used: on another node, and externalTrafficPolicy is Local.
    NotLocalExternalPolicy,
    /// Not used: of the other IP family than the destination.
    WrongFamily,
    /// Not used: neither ready nor serving-and-terminating.
    NotReady,
}

impl EndpointVerdict {
    /// Whether the verdict puts the endpoint in the list.
    pub fn chosen(self) -> bool {
        matches!(
            self,
            EndpointVerdict::Ready | EndpointVerdict::TerminatingFallback
        )
    }
}

/// One endpoint of a matched service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EndpointExplanation {
    /// Address.
    pub ip: IpAddr,
    /// Target port.
    pub port: u16,
    /// `nodeName`, if set.
    pub node_name: Option<String>,
    /// `zone`, if set.
    pub zone: Option<String>,
    /// On this node.
    pub local: bool,
    /// `conditions.ready`.
    pub ready: bool,
    /// `conditions.serving`.
    pub serving: bool,
    /// `conditions.terminating`.
    pub terminating: bool,
    /// Why it is or is not used.
    pub verdict: EndpointVerdict,
    /// The packet may be DNATed here (chosen, and the outcome is DNAT).
    pub used: bool,
    /// One sentence for people.
    pub reason: String,
    /// Its `KUBE-SEP-…` chain (for same-family endpoints; it exists only when chosen).
    pub chain: Option<String>,
    /// The source is this endpoint: if picked, the hairpin rule masquerades the packet.
    pub hairpin: bool,
}

/// A step of the packet's way through the rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Hop {
    /// `nat` or `filter`.
    pub table: &'static str,
    /// The chain.
    pub chain: String,
    /// What happens there.
    pub action: String,
}

/// The four per-service-port chain names (whether or not they exist).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChainNames {
    /// `KUBE-SVC-…`: Cluster-policy load balancing.
    pub svc: String,
    /// `KUBE-SVL-…`: Local-policy load balancing.
    pub svl: String,
    /// `KUBE-EXT-…`: external entry.
    pub ext: String,
    /// `KUBE-FW-…`: loadBalancerSourceRanges filter.
    pub fw: String,
}

impl ChainNames {
    /// The renderer's names for `name`'s chains.
    fn of(name: &ServicePortName) -> Self {
        let ServiceChains { svc, svl, ext, fw } = ServiceChains::new(name);
        ChainNames { svc, svl, ext, fw }
    }

    /// The policy chain of `list`: `KUBE-SVC-…` or `KUBE-SVL-…`.
    fn policy(&self, list: EndpointList) -> &str {
        match list {
            EndpointList::Cluster => &self.svc,
            EndpointList::Local => &self.svl,
        }
    }
}

/// ClientIP session affinity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Affinity {
    /// Seconds a client stays on its endpoint after its last packet (as programmed).
    pub timeout_seconds: u64,
}

/// One service port the destination hits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ServiceMatch {
    /// Upstream's display name, `ns/name:port`.
    pub service_port: String,
    /// The service port's identity.
    pub name: ServicePortName,
    /// How the destination reaches it.
    pub how: MatchKind,
    /// The matched address.
    pub ip: IpAddr,
    /// The matched port (the NodePort for [`MatchKind::NodePort`]).
    pub port: u16,
    /// The service port number.
    pub service_port_number: u16,
    /// internalTrafficPolicy.
    pub internal_traffic_policy: TrafficPolicy,
    /// externalTrafficPolicy; `None` when the service is not externally accessible.
    pub external_traffic_policy: Option<TrafficPolicy>,
    /// The endpoint list this traffic uses.
    pub endpoint_list: EndpointList,
    /// Why that list.
    pub endpoint_list_reason: String,
    /// Topology mode from the hints (only restricts the Cluster list).
    pub topology_mode: TopologyMode,
    /// What happens to the packet.
    pub outcome: Outcome,
    /// Why.
    pub outcome_reason: String,
    /// Source NAT.
    pub masquerade: Masquerade,
    /// ClientIP affinity, if enabled.
    pub session_affinity: Option<Affinity>,
    /// `loadBalancerSourceRanges` of this family (only checked for LB IPs).
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// The packet's way through the rules, up to the endpoint chains.
    pub hops: Vec<Hop>,
    /// The service port's chain names.
    pub chains: ChainNames,
    /// The objects of the proxy mode in use when it is not iptables (filled by
    /// [`dataplane::annotate`]); the hops and chains above are iptables mode's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dataplane: Option<dataplane::Dataplane>,
    /// With nftables mode's socket load balancer (`--socket-lb`): what it does with the
    /// node's own sockets' connections to this address (filled by the binary).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_lb: Option<SocketLbPath>,
    /// Every endpoint with its verdict, in endpoint order.
    pub endpoints: Vec<EndpointExplanation>,
    /// Things that would change the answer (unknown source, short-circuits).
    pub notes: Vec<String>,
}

/// Which path a connection from the node's own sockets (pods and host processes in the
/// socket load balancer's cgroup) takes: translated when it connects, or nftables' rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SocketLbPath {
    /// The programs translate it (to `endpoints`; none: refused with ECONNREFUSED).
    pub translated: bool,
    /// The endpoints a connection is sent to, when translated.
    pub endpoints: Vec<std::net::SocketAddr>,
    /// Why: where the programs act, or why nftables mode's rules serve it instead.
    pub reason: String,
}

/// A service port on the destination IP that does not match its port or protocol.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NearMiss {
    /// Display name.
    pub service_port: String,
    /// Which address of it is the destination IP.
    pub how: MatchKind,
    /// The port it listens on.
    pub port: u16,
    /// Its protocol.
    pub protocol: Protocol,
}

/// Explain `query` against `state` as the iptables renderer would program it with `config`.
///
/// Node addresses (for NodePorts and `--src-type LOCAL`) are the Node object's addresses
/// (`state.node.addresses`) unless `config.node_port_addresses` restricts NodePorts; a
/// kernel "local address" the Node object does not list is not known here.
pub fn explain(
    state: &ProxyState,
    config: &RenderConfig,
    query: &Query,
) -> Result<Explanation, ExplainError> {
    config.validate()?;
    let dest = query.destination;
    let family = IpFamily::of(&dest.ip);
    if let Some(from) = query.source
        && IpFamily::of(&from) != family
    {
        return Err(ExplainError::FamilyMismatch { from, to: dest.ip });
    }
    let ctx = Context {
        state,
        config,
        family,
        detector: detector_view(&config.local_detector, family),
        source: query.source,
    };
    let source = query.source.map(|ip| SourceInfo {
        ip,
        local_traffic: ctx.local_traffic(ip),
        node_address: ctx.is_node_address(ip),
    });

    let mut matches = Vec::new();
    let mut near_misses = Vec::new();
    for (name, svc) in &state.services {
        let Some((cluster_ip, view)) = family_view(svc, family) else {
            continue;
        };
        for (how, port) in ctx.fronts(cluster_ip, &view, dest.ip) {
            let hit = name.protocol == dest.protocol && dest.port.is_none_or(|p| p == port);
            if hit {
                matches.push(ctx.explain_port(name, &view, dest.ip, how, port));
            } else if how != MatchKind::NodePort {
                // Every NodePort service "listens" on every node address: not worth listing.
                near_misses.push(NearMiss {
                    service_port: name.to_string(),
                    how,
                    port,
                    protocol: name.protocol,
                });
            }
        }
    }
    let summary = match matches.len() {
        0 => NOT_A_SERVICE.to_owned(),
        1 => "matches 1 service port".to_owned(),
        n => format!("matches {n} service ports"),
    };
    Ok(Explanation {
        destination: dest,
        source,
        family,
        matches,
        near_misses,
        summary,
        localhost_node_ports: Vec::new(),
    })
}

/// The local-traffic detector as far as addresses are concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
enum DetectorView {
    /// No detector for this family.
    None,
    /// Pod traffic is traffic from this CIDR.
    Cidr(IpNet),
    /// Pod traffic is traffic arriving on these interfaces (described for people).
    Interface(String),
}

fn detector_view(detector: &LocalDetector, family: IpFamily) -> DetectorView {
    match detector {
        LocalDetector::None => DetectorView::None,
        // `validate` guarantees at most one per family.
        LocalDetector::Cidrs(cidrs) => cidrs
            .iter()
            .find(|c| IpFamily::of_net(c) == family)
            .map_or(DetectorView::None, |c| DetectorView::Cidr(c.trunc())),
        LocalDetector::BridgeInterface(name) => DetectorView::Interface(format!("bridge {name}")),
        LocalDetector::InterfaceNamePrefix(prefix) => {
            DetectorView::Interface(format!("interfaces {prefix}*"))
        }
    }
}

/// A service port as the family's proxier sees it, with its ClusterIP (the renderer's view:
/// a zero NodePort means none).
fn family_view(svc: &ServicePort, family: IpFamily) -> Option<(IpAddr, ServicePort)> {
    let mut view = svc.for_family(family)?;
    let cluster_ip = view.cluster_ips.first().copied()?;
    view.node_port = view.node_port.filter(|p| *p != 0);
    view.health_check_node_port = view.health_check_node_port.filter(|p| *p != 0);
    Some((cluster_ip, view))
}

/// Where the packet is steered on the way to the endpoints, before any drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    /// ClusterIP: the internal policy's list.
    Internal,
    /// External with eTP Cluster.
    ExternalCluster,
    /// eTP Local, source is a local pod: short-circuit to the Cluster list.
    ExternalLocalPod,
    /// eTP Local, source is this node: masquerade and short-circuit to the Cluster list.
    ExternalLocalNode,
    /// eTP Local, source outside (or unknown): local endpoints only.
    ExternalLocal,
}

impl Route {
    /// The endpoint list the route uses, and why.
    fn list(self, svc: &ServicePort) -> (EndpointList, String) {
        let (list, reason) = match self {
            Route::Internal if svc.internal_policy_local => (
                EndpointList::Local,
                "internalTrafficPolicy Local: only endpoints on this node",
            ),
            Route::Internal => (
                EndpointList::Cluster,
                "internalTrafficPolicy Cluster: endpoints anywhere in the cluster",
            ),
            Route::ExternalCluster => (
                EndpointList::Cluster,
                "externalTrafficPolicy Cluster: endpoints anywhere in the cluster",
            ),
            Route::ExternalLocalPod => (
                EndpointList::Cluster,
                "externalTrafficPolicy Local, but the source is a local pod: short-circuited \
                 to endpoints anywhere in the cluster",
            ),
            Route::ExternalLocalNode => (
                EndpointList::Cluster,
                "externalTrafficPolicy Local, but the source is this node: short-circuited to \
                 endpoints anywhere in the cluster",
            ),
            Route::ExternalLocal => (
                EndpointList::Local,
                "externalTrafficPolicy Local: only endpoints on this node",
            ),
        };
        (list, reason.to_owned())
    }
}

/// What happens to the packet of `display` on `list`, and why (`source_refused`: the
/// firewall drops its source).
fn outcome(
    display: &str,
    svc: &ServicePort,
    plan: &ServicePlan<'_>,
    list: EndpointList,
    source_refused: bool,
) -> (Outcome, String) {
    let chosen_list = plan.list(list);
    if !plan.has_endpoints {
        return (
            Outcome::RejectNoEndpoints,
            format!("{display} has no usable endpoints anywhere: REJECT"),
        );
    }
    if source_refused {
        return (
            Outcome::DropSourceRange,
            "the source is outside loadBalancerSourceRanges: not DNATed, then DROPped".to_owned(),
        );
    }
    if chosen_list.is_empty() {
        return (
            Outcome::DropNoLocalEndpoints,
            format!("{display} has no local endpoints and the traffic policy is Local: DROP"),
        );
    }
    let n = chosen_list.len();
    let how_picked = if svc.session_affinity.is_some() {
        "by client IP affinity, else at random"
    } else {
        "at random"
    };
    let reason = if n == 1 {
        "DNAT to the only usable endpoint".to_owned()
    } else {
        format!("DNAT to one of {n} endpoints, picked {how_picked}")
    };
    (Outcome::Dnat, reason)
}

/// What the renderer's plan does with a packet to one matched service port, before its
/// endpoints: the hops, the masquerade decision and the endpoint verdicts are told from it.
struct Decision<'a> {
    name: &'a ServicePortName,
    /// `name` as upstream displays it.
    display: String,
    svc: &'a ServicePort,
    /// The renderer's own decisions for this port.
    plan: ServicePlan<'a>,
    chains: ChainNames,
    how: MatchKind,
    ip: IpAddr,
    port: u16,
    route: Route,
    list: EndpointList,
    list_reason: String,
    outcome: Outcome,
    outcome_reason: String,
    /// What the query leaves open.
    notes: Vec<String>,
}

impl Decision<'_> {
    /// The answer, with the parts told from the decision (`mode`: the hints' topology mode).
    fn into_match(
        self,
        mode: TopologyMode,
        masquerade: Masquerade,
        hops: Vec<Hop>,
        endpoints: Vec<EndpointExplanation>,
    ) -> ServiceMatch {
        let svc = self.svc;
        ServiceMatch {
            service_port: self.display,
            name: self.name.clone(),
            how: self.how,
            ip: self.ip,
            port: self.port,
            service_port_number: svc.port,
            internal_traffic_policy: policy(svc.internal_policy_local),
            external_traffic_policy: svc
                .externally_accessible()
                .then(|| policy(svc.external_policy_local)),
            endpoint_list: self.list,
            endpoint_list_reason: self.list_reason,
            topology_mode: if self.list == EndpointList::Cluster {
                mode
            } else {
                TopologyMode::None
            },
            outcome: self.outcome,
            outcome_reason: self.outcome_reason,
            masquerade,
            session_affinity: self
                .plan
                .affinity_seconds
                .map(|timeout_seconds| Affinity { timeout_seconds }),
            load_balancer_source_ranges: svc
                .load_balancer_source_ranges
                .iter()
                .map(IpNet::trunc)
                .collect(),
            hops,
            chains: self.chains,
            dataplane: None,
            socket_lb: None,
            endpoints,
            notes: self.notes,
        }
    }
}

struct Context<'a> {
    state: &'a ProxyState,
    config: &'a RenderConfig,
    family: IpFamily,
    detector: DetectorView,
    source: Option<IpAddr>,
}

impl Context<'_> {
    fn node(&self) -> &NodeInfo {
        &self.state.node
    }

    /// The Node's addresses of this family: what iptables' `--dst-type LOCAL` matches
    /// as far as the Node object tells.
    fn node_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.node()
            .addresses
            .iter()
            .copied()
            .filter(|ip| IpFamily::of(ip) == self.family)
    }

    /// The node IP (upstream's, see [`crate::iptables::node_ip`]) of this family.
    fn node_ip(&self) -> Option<IpAddr> {
        crate::iptables::node_ip(&self.config.node_ips, self.node(), self.family)
    }

    fn local_traffic(&self, ip: IpAddr) -> Option<bool> {
        match &self.detector {
            DetectorView::Cidr(cidr) => Some(cidr.contains(&ip)),
            DetectorView::None | DetectorView::Interface(_) => None,
        }
    }

    fn is_node_address(&self, ip: IpAddr) -> bool {
        ip.is_loopback() || self.node_addresses().any(|n| n == ip)
    }

    /// How `ip` reaches the service port `view` (with ClusterIP `cluster_ip`), and on which
    /// port: every address of it that is `ip`, in the order the answer lists them.
    fn fronts(&self, cluster_ip: IpAddr, view: &ServicePort, ip: IpAddr) -> Vec<(MatchKind, u16)> {
        let mut fronts = Vec::new();
        if cluster_ip == ip {
            fronts.push((MatchKind::ClusterIp, view.port));
        }
        if view.external_ips.contains(&ip) {
            fronts.push((MatchKind::ExternalIp, view.port));
        }
        if view.load_balancer_ips.contains(&ip) {
            fronts.push((MatchKind::LoadBalancerIp, view.port));
        }
        if let Some(node_port) = view.node_port
            && self.accepts_node_ports(ip)
        {
            fronts.push((MatchKind::NodePort, node_port));
        }
        fronts
    }

    /// Whether nat `KUBE-SERVICES` sends traffic to `ip` on to `KUBE-NODEPORTS`.
    fn accepts_node_ports(&self, ip: IpAddr) -> bool {
        let loopback_ok = self.family == IpFamily::V4 && self.config.localhost_node_ports;
        if ip.is_loopback() {
            return loopback_ok
                && match self.config.node_port_addresses.for_family(self.family) {
                    NodePortAddresses::All => true,
                    NodePortAddresses::Ips(ips) => ips.iter().any(|n| n.is_loopback()),
                };
        }
        match self.config.node_port_addresses.for_family(self.family) {
            NodePortAddresses::All => self.node_addresses().any(|n| n == ip),
            NodePortAddresses::Ips(ips) => ips.contains(&ip),
        }
    }

    /// The answer for the service port `name` (`svc`, the family's view of it) reached at
    /// `ip`:`port` as `how`.
    fn explain_port(
        &self,
        name: &ServicePortName,
        svc: &ServicePort,
        ip: IpAddr,
        how: MatchKind,
        port: u16,
    ) -> ServiceMatch {
        let all = self
            .state
            .endpoints
            .get(name)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let same_family: Vec<Endpoint> = all
            .iter()
            .filter(|e| IpFamily::of(&e.ip) == self.family)
            .cloned()
            .collect();
        let topology = topology::explain(svc, &same_family, self.node());
        let decision = self.decide(name, svc, &same_family, ip, how, port);
        let endpoints: Vec<EndpointExplanation> = all
            .iter()
            .map(|ep| self.explain_endpoint(ep, &decision, &topology))
            .collect();
        let masquerade = self.masquerade(&decision, &endpoints);
        let hops = self.hops(&decision);
        decision.into_match(topology.topology_mode, masquerade, hops, endpoints)
    }

    /// What the renderer's plan does with a packet to `svc` matched `how`: its route, list
    /// and outcome, with notes on what the query leaves open.
    fn decide<'a>(
        &self,
        name: &'a ServicePortName,
        svc: &'a ServicePort,
        same_family: &'a [Endpoint],
        ip: IpAddr,
        how: MatchKind,
        port: u16,
    ) -> Decision<'a> {
        let display = name.to_string();
        let masquerading = Masquerading {
            all: self.config.masquerade_all,
            detector: !matches!(self.detector, DetectorView::None),
        };
        let plan = ServicePlan::new(svc, same_family, self.node(), self.node_ip(), masquerading);
        let mut notes = Vec::new();
        let route = self.route(&plan, how, &mut notes);
        let (list, list_reason) = route.list(svc);
        let firewall = how == MatchKind::LoadBalancerIp && plan.uses_firewall_chain;
        let range_allowed = self.range_allowed(svc, &plan, firewall, &mut notes);
        let refused = firewall && range_allowed == Some(false);
        let (outcome, outcome_reason) = outcome(&display, svc, &plan, list, refused);
        Decision {
            name,
            display,
            svc,
            plan,
            chains: ChainNames::of(name),
            how,
            ip,
            port,
            route,
            list,
            list_reason,
            outcome,
            outcome_reason,
            notes,
        }
    }

    /// The route a packet matched `how` takes through the plan: internal, or which of the
    /// external cases (the short-circuits exist only when the renderer writes them).
    fn route(&self, plan: &ServicePlan<'_>, how: MatchKind, notes: &mut Vec<String>) -> Route {
        if !how.is_external() {
            return Route::Internal;
        }
        if !plan.external_local {
            return Route::ExternalCluster;
        }
        let pod = self.source.and_then(|s| self.local_traffic(s)) == Some(true);
        let from_node = self.source.is_some_and(|s| self.is_node_address(s));
        let short_circuit = match plan.external_masquerade {
            ExternalMasquerade::ShortCircuit { pods } => Some(pods),
            ExternalMasquerade::Always | ExternalMasquerade::Never => None,
        };
        if short_circuit == Some(true) && pod {
            return Route::ExternalLocalPod;
        }
        if short_circuit.is_some() && from_node {
            return Route::ExternalLocalNode;
        }
        if self.source.is_none() {
            notes.push(
                "assuming a client outside the node: from this node the packet is \
                 masqueraded and may go to any endpoint in the cluster; from a local \
                 pod it goes to any endpoint without masquerading"
                    .to_owned(),
            );
        } else if let DetectorView::Interface(iface) = &self.detector {
            notes.push(format!(
                "if the packet arrives on {iface} it is pod traffic and may go to \
                 any endpoint in the cluster"
            ));
        }
        Route::ExternalLocal
    }

    /// Whether the source passes loadBalancerSourceRanges (the node's own traffic to a VIP
    /// when the plan allows the node), `None` without a source; without one, a note on the
    /// `firewall`.
    fn range_allowed(
        &self,
        svc: &ServicePort,
        plan: &ServicePlan<'_>,
        firewall: bool,
        notes: &mut Vec<String>,
    ) -> Option<bool> {
        let ranges = &svc.load_balancer_source_ranges;
        let range_allowed = self.source.map(|s| {
            ranges.iter().any(|r| r.trunc().contains(&s))
                || (plan.allow_from_node && svc.load_balancer_ips.contains(&s))
        });
        if firewall && range_allowed.is_none() {
            let list: Vec<String> = ranges.iter().map(|r| r.trunc().to_string()).collect();
            notes.push(format!(
                "only sources in loadBalancerSourceRanges ({}) are accepted; others are \
                 dropped by {KUBE_PROXY_FIREWALL}",
                list.join(", ")
            ));
        }
        range_allowed
    }
}

fn policy(local: bool) -> TrafficPolicy {
    if local {
        TrafficPolicy::Local
    } else {
        TrafficPolicy::Cluster
    }
}

impl fmt::Display for EndpointVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EndpointVerdict::Ready => "ready",
            EndpointVerdict::TerminatingFallback => "terminating fallback",
            EndpointVerdict::ServingTerminating => "serving, terminating",
            EndpointVerdict::FilteredByTopology => "filtered by topology",
            EndpointVerdict::NotLocalInternalPolicy => "not local (iTP Local)",
            EndpointVerdict::NotLocalExternalPolicy => "not local (eTP Local)",
            EndpointVerdict::WrongFamily => "wrong family",
            EndpointVerdict::NotReady => "not ready",
        })
    }
}

/// The address:port an endpoint is DNATed to, as the rules write it.
pub fn endpoint_address(ep: &EndpointExplanation) -> String {
    endpoint_string(ep.ip, ep.port)
}
