//! One service port's plan: which of its chains exist, where internal and external traffic
//! goes, what is rejected or dropped, and the firewall, masquerade and affinity decisions.
//!
//! Upstream makes these decisions at the top of each proxier's per-service loop
//! (`syncProxyRules` in `pkg/proxy/iptables` and `pkg/proxy/nftables`); here they are made
//! once, purely, from the service port, its endpoints, the node and two settings, and every
//! consumer reads them:
//!
//! - the iptables renderer ([`crate::iptables::render`]) turns a plan into `KUBE-SVC/SVL/
//!   EXT/FW/SEP` chains and the filter rules;
//! - `kube-proxy explain` ([`crate::explain`]) turns it into the route, outcome, masquerade
//!   answer and chain hops, so an explanation cannot disagree with the rules;
//! - the nftables renderer (`nftables/render/service.rs`, `ServiceObjects`) turns it into its
//!   verdict-map elements and chains; the one difference between the modes is read from
//!   two fields: nftables filters source ranges with or without endpoints, as upstream
//!   ([`ServicePlan::source_ranges`]), iptables only when it writes the firewall chain
//!   ([`ServicePlan::uses_firewall_chain`]).
//!
//! - ipvs mode's plan (`crate::ipvs`) and userspace mode's relay (`kp-userspace`) read the
//!   endpoint lists and whether any endpoint is usable; they have no chains, and where a
//!   Local policy has no local endpoint ipvs mode falls back to the Cluster list, as
//!   upstream's ([`ServicePlan::list_or_cluster`]).
//!
//! Every mode that filters by `loadBalancerSourceRanges` (iptables, nftables in both layouts,
//! ipvs, userspace, explain) reads one answer for the node's own traffic to the LB IPs:
//! [`ServicePlan::allow_from_node`].

use std::net::IpAddr;

use kp_core::model::{Endpoint, NodeInfo, ServicePort};
use kp_core::topology::{EndpointCategories, categorize};
use serde::Serialize;

/// `xt_recent` (and nft set timeouts) need a positive age; the API minimum is 1 s.
pub const MIN_AFFINITY_SECONDS: u64 = 1;
/// The API server caps `sessionAffinityConfig.clientIP.timeoutSeconds` at one day; clamping
/// keeps the rule valid even if a bad value slips through.
pub const MAX_AFFINITY_SECONDS: u64 = 86_400;

/// Which of the two endpoint lists upstream computes a packet uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum EndpointList {
    /// The cluster-wide list (`KUBE-SVC-…`).
    Cluster,
    /// The node-local list (`KUBE-SVL-…`).
    Local,
}

/// Where one kind of traffic (internal or external) is sent: a traffic policy's endpoint
/// list, and whether its chain is written (it is only when it has endpoints).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// `Local` for traffic policy Local, else `Cluster`.
    pub list: EndpointList,
    /// The list's chain exists: the service has usable endpoints and this list is not
    /// empty. Otherwise the traffic is filtered ([`ServicePlan::internal_filter`]).
    pub has_endpoints: bool,
}

/// The filter verdict for traffic whose policy has no endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoEndpoints {
    /// No usable endpoint anywhere: REJECT (`"<svc> has no endpoints"`).
    Reject,
    /// Endpoints exist, but none in the policy's (Local) list: DROP (`"<svc> has no local
    /// endpoints"`).
    Drop,
}

/// How ClusterIP traffic is masqueraded (in the internal policy chain, before picking an
/// endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InternalMasquerade {
    /// `masqueradeAll`: every packet.
    All,
    /// Packets that do not come from a local pod (by the local-traffic detector).
    NotLocal,
    /// None: no detector, so pod traffic cannot be told apart (or the chain is not written).
    None,
}

/// How external traffic (NodePort, externalIPs, LB IPs) is handled in the `KUBE-EXT-*` chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExternalMasquerade {
    /// externalTrafficPolicy Cluster: always masquerade, then the Cluster list (endpoints
    /// may be on other nodes, so replies must come back through this node).
    Always,
    /// externalTrafficPolicy Local with the Cluster chain in use: short-circuits before the
    /// Local list. Traffic from this node (`--src-type LOCAL`) is masqueraded and sent to the
    /// Cluster list; with a detector, traffic from local pods goes to the Cluster list
    /// unmasqueraded (`pods`). Everything else keeps its source and goes to the Local list.
    ShortCircuit {
        /// A local-traffic detector exists, so pod traffic is short-circuited too.
        pods: bool,
    },
    /// externalTrafficPolicy Local without the Cluster chain: no short-circuit, no
    /// masquerade (only reached when the service has no endpoints, so no chain is written).
    Never,
}

/// The two settings the decisions depend on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Masquerading {
    /// `masqueradeAll`.
    pub all: bool,
    /// A local-traffic detector applies to this family.
    pub detector: bool,
}

/// Everything decided for one service port on this node (one IP family).
#[derive(Clone, Debug)]
pub struct ServicePlan<'e> {
    /// Upstream's endpoint categories (`kp_core::topology::categorize`).
    pub endpoints: EndpointCategories<'e>,
    /// Some endpoint anywhere is usable; false means REJECT.
    pub has_endpoints: bool,
    /// The Cluster list's chain (`KUBE-SVC-*`) is written: the port uses Cluster endpoints
    /// and the list is not empty.
    pub uses_cluster_chain: bool,
    /// The Local list's chain (`KUBE-SVL-*`) is written.
    pub uses_local_chain: bool,
    /// Where ClusterIP traffic goes (internalTrafficPolicy).
    pub internal: Policy,
    /// externalTrafficPolicy Local on an externally accessible port.
    pub external_local: bool,
    /// Where external traffic goes once past `KUBE-EXT-*` (externalTrafficPolicy).
    pub external: Policy,
    /// The `KUBE-EXT-*` chain is written: externally accessible, with endpoints.
    pub uses_external_chain: bool,
    /// LB IPs with loadBalancerSourceRanges: traffic to the LB IPs is filtered by source.
    pub source_ranges: bool,
    /// Upstream's `allowFromNode`: a source range holds this node's IP (of the plan's family,
    /// [`crate::config::node_ip`]), so the node's own traffic to an LB IP passes the filter
    /// also with the LB IP as its source (the VIP is often a local address, and a connection
    /// from the node to a local address leaves from that address).
    pub allow_from_node: bool,
    /// iptables' `KUBE-FW-*` chain is written: [`ServicePlan::source_ranges`] and endpoints
    /// (upstream's iptables proxier writes no firewall for a service it rejects anyway).
    pub uses_firewall_chain: bool,
    /// What filters ClusterIP traffic, when its policy chain is not written.
    pub internal_filter: Option<NoEndpoints>,
    /// What filters external traffic, when its policy chain is not written.
    pub external_filter: Option<NoEndpoints>,
    /// The ClusterIP masquerade rule.
    pub internal_masquerade: InternalMasquerade,
    /// The `KUBE-EXT-*` chain's handling (meaningful when it is written).
    pub external_masquerade: ExternalMasquerade,
    /// ClientIP session affinity's timeout, clamped to
    /// [`MIN_AFFINITY_SECONDS`]..=[`MAX_AFFINITY_SECONDS`].
    pub affinity_seconds: Option<u64>,
}

impl<'e> ServicePlan<'e> {
    /// The plan for `svc` (already one family's view) with that family's `endpoints`;
    /// `node_ip` is this node's IP of that family ([`crate::config::node_ip`]).
    pub fn new(
        svc: &ServicePort,
        endpoints: &'e [Endpoint],
        node: &NodeInfo,
        node_ip: Option<IpAddr>,
        masquerading: Masquerading,
    ) -> Self {
        let categories = categorize(svc, endpoints, node);
        // Chains only exist when something jumps to them, and nothing jumps to a chain that
        // does not exist: every flag derives from the endpoint lists actually written.
        let uses_cluster_chain = svc.uses_cluster_endpoints() && !categories.cluster.is_empty();
        let uses_local_chain = svc.uses_local_endpoints() && !categories.local.is_empty();
        let has_endpoints = categories.has_any_endpoints;
        let policy = |local: bool| {
            if local {
                Policy {
                    list: EndpointList::Local,
                    has_endpoints: has_endpoints && uses_local_chain,
                }
            } else {
                Policy {
                    list: EndpointList::Cluster,
                    has_endpoints: has_endpoints && uses_cluster_chain,
                }
            }
        };
        let internal = policy(svc.internal_policy_local);
        let external_local = svc.external_policy_local && svc.externally_accessible();
        let external = policy(external_local);
        let source_ranges =
            !svc.load_balancer_ips.is_empty() && !svc.load_balancer_source_ranges.is_empty();
        let filter = |policy: Policy| {
            if !has_endpoints {
                Some(NoEndpoints::Reject)
            } else if !policy.has_endpoints {
                Some(NoEndpoints::Drop)
            } else {
                None
            }
        };
        let internal_masquerade = if !internal.has_endpoints {
            InternalMasquerade::None
        } else if masquerading.all {
            InternalMasquerade::All
        } else if masquerading.detector {
            InternalMasquerade::NotLocal
        } else {
            InternalMasquerade::None
        };
        let external_masquerade = if !external_local {
            ExternalMasquerade::Always
        } else if uses_cluster_chain {
            ExternalMasquerade::ShortCircuit {
                pods: masquerading.detector,
            }
        } else {
            ExternalMasquerade::Never
        };
        Self {
            has_endpoints,
            uses_cluster_chain,
            uses_local_chain,
            internal,
            external_local,
            external,
            uses_external_chain: has_endpoints && svc.externally_accessible(),
            source_ranges,
            allow_from_node: allows_node(svc, node_ip),
            uses_firewall_chain: has_endpoints && source_ranges,
            internal_filter: filter(internal),
            external_filter: filter(external),
            internal_masquerade,
            external_masquerade,
            affinity_seconds: svc.session_affinity.map(|a| affinity_seconds(a.timeout)),
            endpoints: categories,
        }
    }

    /// The endpoints of `list`.
    pub fn list(&self, list: EndpointList) -> &[&'e Endpoint] {
        match list {
            EndpointList::Cluster => &self.endpoints.cluster,
            EndpointList::Local => &self.endpoints.local,
        }
    }

    /// The endpoints `policy` sends to in ipvs mode: its list, or the Cluster list where a
    /// Local policy has no local endpoint. Upstream's ipvs mode falls back so (kubernetes
    /// #97081): pods keep reaching the service through its external addresses, while an
    /// outside client's unmasqueraded flow gets its answer from the remote endpoint's own
    /// node and never completes. The chain modes drop instead ([`ServicePlan::internal_filter`]).
    pub fn list_or_cluster(&self, policy: Policy) -> &[&'e Endpoint] {
        match policy.list {
            EndpointList::Local if !self.endpoints.local.is_empty() => &self.endpoints.local,
            EndpointList::Local | EndpointList::Cluster => &self.endpoints.cluster,
        }
    }
}

/// Whether a source range of `svc` holds `node_ip` ([`ServicePlan::allow_from_node`]).
fn allows_node(svc: &ServicePort, node_ip: Option<IpAddr>) -> bool {
    node_ip.is_some_and(|ip| {
        svc.load_balancer_source_ranges
            .iter()
            .any(|range| range.contains(&ip))
    })
}

/// A session affinity timeout as the rules carry it (whole seconds, clamped).
pub fn affinity_seconds(timeout: std::time::Duration) -> u64 {
    timeout
        .as_secs()
        .clamp(MIN_AFFINITY_SECONDS, MAX_AFFINITY_SECONDS)
}

/// The endpoints nftables mode's localhost NodePort listener of `svc` relays to in `family`
/// (KEP-6032): a TCP NodePort of a service with a ClusterIP of that family has a listener
/// while its external traffic has endpoints of that family (`externalTrafficPolicy: Local`:
/// local ones); empty, it has none and the port refuses connections. One answer for the
/// listeners (`kp_userspace::localhost`) and `explain`.
pub fn localhost_listener_endpoints(
    svc: &ServicePort,
    state: &kp_core::tracker::ProxyState,
    family: kp_core::model::IpFamily,
) -> Vec<std::net::SocketAddr> {
    use kp_core::model::{IpFamily, Protocol};
    let has_family = svc.cluster_ips.iter().any(|c| IpFamily::of(c) == family);
    if svc.name.protocol != Protocol::Tcp || svc.node_port.is_none() || !has_family {
        return Vec::new();
    }
    let endpoints = state
        .endpoints
        .get(&svc.name)
        .map(Vec::as_slice)
        .unwrap_or_default();
    // The relay masquerades nothing: `Masquerading` does not matter here.
    // Localhost listeners: no LB source ranges, so no node IP is needed.
    let plan = ServicePlan::new(svc, endpoints, &state.node, None, Masquerading::default());
    plan.list(plan.external.list)
        .iter()
        .filter(|e| IpFamily::of(&e.ip) == family)
        .map(|e| std::net::SocketAddr::new(e.ip, e.port))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::time::Duration;

    use kp_core::model::{Protocol, ServiceName, ServicePortName, SessionAffinity};

    use super::*;

    const NODE: &str = "node-a";

    fn node() -> NodeInfo {
        NodeInfo {
            name: NODE.to_owned(),
            eligible: true,
            known: true,
            ..NodeInfo::default()
        }
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("literal")
    }

    fn port() -> ServicePort {
        let name = ServicePortName {
            service: ServiceName {
                namespace: "ns".into(),
                name: "svc".into(),
            },
            port: "p".into(),
            protocol: Protocol::Tcp,
        };
        ServicePort {
            name,
            cluster_ips: vec![ip("10.96.0.1")],
            port: 80,
            node_port: None,
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            load_balancer_source_ranges: Vec::new(),
            session_affinity: None,
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
        }
    }

    fn endpoint(addr: &str, local: bool, ready: bool) -> Endpoint {
        Endpoint {
            ip: ip(addr),
            port: 8080,
            ready,
            serving: ready,
            terminating: false,
            node_name: Some(if local { NODE } else { "node-b" }.into()),
            zone: None,
            zone_hints: None,
            node_hints: None,
            is_local: local,
        }
    }

    const MASQ: Masquerading = Masquerading {
        all: false,
        detector: true,
    };

    #[test]
    fn no_usable_endpoint_rejects_everything_and_writes_no_chain() {
        let mut svc = port();
        svc.node_port = Some(30080);
        svc.load_balancer_ips = vec![ip("192.0.2.1")];
        svc.load_balancer_source_ranges = vec!["198.51.100.0/24".parse().expect("literal")];
        let eps = [endpoint("10.0.0.1", false, false)];
        let plan = ServicePlan::new(&svc, &eps, &node(), None, MASQ);
        assert!(!plan.has_endpoints);
        assert!(!plan.uses_cluster_chain && !plan.uses_external_chain);
        assert_eq!(plan.internal_filter, Some(NoEndpoints::Reject));
        assert_eq!(plan.external_filter, Some(NoEndpoints::Reject));
        assert!(
            plan.source_ranges,
            "nftables filters source ranges regardless"
        );
        assert!(
            !plan.uses_firewall_chain,
            "iptables writes no firewall then"
        );
        assert_eq!(plan.internal_masquerade, InternalMasquerade::None);
    }

    #[test]
    fn local_policies_without_local_endpoints_drop() {
        let mut svc = port();
        svc.internal_policy_local = true;
        svc.external_policy_local = true;
        svc.node_port = Some(30080);
        let eps = [endpoint("10.0.0.1", false, true)];
        let plan = ServicePlan::new(&svc, &eps, &node(), None, MASQ);
        assert!(plan.has_endpoints && plan.external_local);
        assert_eq!(
            plan.internal,
            Policy {
                list: EndpointList::Local,
                has_endpoints: false
            }
        );
        assert_eq!(plan.internal_filter, Some(NoEndpoints::Drop));
        assert_eq!(plan.external_filter, Some(NoEndpoints::Drop));
        // Externally accessible: the Cluster list is used for short-circuits.
        assert!(plan.uses_cluster_chain && !plan.uses_local_chain);
        assert_eq!(
            plan.external_masquerade,
            ExternalMasquerade::ShortCircuit { pods: true }
        );
        assert_eq!(plan.list(EndpointList::Cluster).len(), 1);
        assert!(plan.list(EndpointList::Local).is_empty());
        // ipvs mode falls back to the Cluster list instead.
        assert_eq!(
            plan.list_or_cluster(plan.internal),
            plan.list(EndpointList::Cluster)
        );
        let local = [
            endpoint("10.0.0.2", true, true),
            endpoint("10.0.0.3", false, true),
        ];
        let plan = ServicePlan::new(&svc, &local, &node(), None, MASQ);
        let only_local: Vec<IpAddr> = plan
            .list_or_cluster(plan.external)
            .iter()
            .map(|e| e.ip)
            .collect();
        assert_eq!(only_local, [ip("10.0.0.2")]);
    }

    #[test]
    fn cluster_policies_masquerade_by_settings() {
        let mut svc = port();
        svc.external_ips = vec![ip("192.0.2.9")];
        let eps = [endpoint("10.0.0.1", true, true)];
        let plan = |masquerading| ServicePlan::new(&svc, &eps, &node(), None, masquerading);
        assert_eq!(plan(MASQ).internal_masquerade, InternalMasquerade::NotLocal);
        assert_eq!(
            plan(Masquerading {
                all: true,
                detector: true
            })
            .internal_masquerade,
            InternalMasquerade::All
        );
        assert_eq!(
            plan(Masquerading::default()).internal_masquerade,
            InternalMasquerade::None
        );
        let plan = plan(MASQ);
        assert_eq!(plan.external_masquerade, ExternalMasquerade::Always);
        assert!(plan.uses_external_chain && plan.internal_filter.is_none());
    }

    #[test]
    fn the_node_is_allowed_where_a_source_range_holds_its_ip() {
        let mut svc = port();
        svc.load_balancer_ips = vec![ip("192.0.2.1")];
        svc.load_balancer_source_ranges = vec![
            "198.51.100.0/24".parse().expect("literal"),
            // Not truncated, as the API may hand it: still the /16 around the node.
            "192.168.7.9/16".parse().expect("literal"),
        ];
        let allows = |node_ip: Option<&str>| {
            ServicePlan::new(&svc, &[], &node(), node_ip.map(ip), MASQ).allow_from_node
        };
        assert!(allows(Some("192.168.50.2")));
        assert!(allows(Some("198.51.100.7")));
        assert!(!allows(Some("203.0.113.2")), "no range holds it");
        assert!(!allows(None), "no node IP of the family");
    }

    #[test]
    fn affinity_is_clamped_to_what_the_kernel_accepts() {
        let mut svc = port();
        svc.session_affinity = Some(SessionAffinity {
            timeout: Duration::from_secs(0),
        });
        let plan = ServicePlan::new(&svc, &[], &node(), None, MASQ);
        assert_eq!(plan.affinity_seconds, Some(MIN_AFFINITY_SECONDS));
        assert_eq!(
            affinity_seconds(Duration::from_secs(10 * 86_400)),
            MAX_AFFINITY_SECONDS
        );
        assert_eq!(affinity_seconds(Duration::from_secs(10_800)), 10_800);
    }
}
