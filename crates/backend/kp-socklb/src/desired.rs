//! What the maps should hold for a [`ProxyState`]: the Service addresses the node's own
//! sockets reach, each with the endpoints the shared plan ([`kp_rules::plan::ServicePlan`],
//! the one nftables mode renders) sends such a socket to. One decision, two dataplanes.
//!
//! ClientIP affinity goes with its timeout ([`Target::affinity_ms`]): the programs pin each
//! client network namespace (a pod; the node's own processes share one) to an endpoint.
//!
//! Left out, so nftables mode's rules keep serving them: SCTP, a Local policy's drop (no
//! local endpoint: nftables drops), load balancer IPs with source ranges (the firewall
//! decides by source), and NodePorts (never reached by address from a socket here).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;
use kp_rules::plan::{EndpointList, Masquerading, NoEndpoints, ServicePlan};

use crate::layout::{ServiceKey, affinity_ms};

/// What the maps should hold for one Service port address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Target {
    /// Its endpoints (none: refused).
    pub endpoints: Vec<SocketAddr>,
    /// ClientIP affinity's timeout in ms as the programs read it (0: none).
    pub affinity_ms: u32,
}

/// Service port addresses and what each should hold.
pub type Targets = BTreeMap<ServiceKey, Target>;

/// Every Service port address to translate, with its endpoints (none: refused). Where two
/// Service ports claim one address (a shared externalIP), the greater name wins, as in
/// [`crate::ServiceLb`].
pub fn desired(state: &ProxyState) -> Targets {
    let mut out = BTreeMap::new();
    for (name, port) in &state.services {
        add_port(&mut out, state, name, port);
    }
    out
}

/// The addresses of one Service's ports to translate, with their endpoints; empty when the
/// state has no such Service or its ports stay with nftables mode's rules.
pub fn desired_service(state: &ProxyState, service: &ServiceName) -> Targets {
    let mut out = BTreeMap::new();
    for (name, port) in state.service_ports(service) {
        add_port(&mut out, state, name, port);
    }
    out
}

fn add_port(out: &mut Targets, state: &ProxyState, name: &ServicePortName, port: &ServicePort) {
    if name.protocol == Protocol::Sctp {
        return;
    }
    let affinity = port
        .session_affinity
        .as_ref()
        .map_or(0, |a| affinity_ms(a.timeout));
    let none = Vec::new();
    let endpoints = state.endpoints.get(name).unwrap_or(&none);
    for family in [IpFamily::V4, IpFamily::V6] {
        let Some(svc) = port.for_family(family) else {
            continue;
        };
        // Masquerading only shapes chains; the endpoint lists do not depend on it.
        // Source-ranged LB IPs stay with nftables: no node IP is needed for allowFromNode.
        let plan = ServicePlan::new(&svc, endpoints, &state.node, None, Masquerading::default());
        let target = |endpoints: Option<_>| {
            endpoints.map(|endpoints| Target {
                endpoints,
                affinity_ms: affinity,
            })
        };
        add(out, &svc, target(internal(&plan, family)), &svc.cluster_ips);
        add(
            out,
            &svc,
            target(external(&plan, family)),
            &svc.external_ips,
        );
        if svc.load_balancer_source_ranges.is_empty() {
            let lb = target(external(&plan, family));
            add(out, &svc, lb, &svc.load_balancer_ips);
        }
    }
}

fn add(out: &mut Targets, svc: &ServicePort, target: Option<Target>, ips: &[IpAddr]) {
    let Some(target) = target else {
        return;
    };
    for &ip in ips {
        let key = ServiceKey::new(SocketAddr::new(ip, svc.port), svc.name.protocol);
        out.insert(key, target.clone());
    }
}

/// ClusterIP traffic: the internal policy's list; rejected (empty) without any endpoint;
/// `None` (nftables) where the plan drops.
fn internal(plan: &ServicePlan<'_>, family: IpFamily) -> Option<Vec<SocketAddr>> {
    match plan.internal_filter {
        Some(NoEndpoints::Reject) => Some(Vec::new()),
        Some(NoEndpoints::Drop) => None,
        None => Some(addresses(plan.list(plan.internal.list), family)),
    }
}

/// externalIPs and load balancer IPs from this node: nftables mode short-circuits traffic
/// from local sources to the Cluster list whatever the external policy, so that list.
fn external(plan: &ServicePlan<'_>, family: IpFamily) -> Option<Vec<SocketAddr>> {
    if plan.external_filter == Some(NoEndpoints::Reject) {
        return Some(Vec::new());
    }
    plan.uses_cluster_chain
        .then(|| addresses(plan.list(EndpointList::Cluster), family))
}

fn addresses(endpoints: &[&Endpoint], family: IpFamily) -> Vec<SocketAddr> {
    endpoints
        .iter()
        .filter(|e| IpFamily::of(&e.ip) == family)
        .map(|e| SocketAddr::new(e.ip, e.port))
        .collect()
}

#[cfg(test)]
mod tests {
    use kp_core::testutil::{cluster_ip_port, endpoint, node_with, port_name, state_on};

    use super::*;

    fn key(addr: &str, protocol: Protocol) -> ServiceKey {
        ServiceKey::new(addr.parse().expect("literal"), protocol)
    }

    fn eps(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|e| e.parse().expect("literal")).collect()
    }

    fn endpoints_of(desired: &Targets, key: ServiceKey) -> Option<&Vec<SocketAddr>> {
        desired.get(&key).map(|t| &t.endpoints)
    }

    fn port(name: &str, cluster_ip: &str, protocol: Protocol) -> ServicePort {
        cluster_ip_port(port_name("ns", name, "p", protocol), cluster_ip, 80)
    }

    #[test]
    fn cluster_ips_external_ips_and_lb_ips_get_the_plans_endpoints() {
        let mut web = port("web", "10.96.0.10", Protocol::Tcp);
        web.external_ips = vec!["203.0.113.5".parse().expect("literal")];
        web.load_balancer_ips = vec!["198.51.100.7".parse().expect("literal")];
        let backends = vec![
            endpoint("10.244.1.3", 8080, true),
            endpoint("10.244.2.3", 8080, false),
        ];
        let state = state_on(node_with(&["192.168.0.2"]), vec![(web, backends)]);
        let desired = desired(&state);
        let both = eps(&["10.244.1.3:8080", "10.244.2.3:8080"]);
        for addr in ["10.96.0.10:80", "203.0.113.5:80", "198.51.100.7:80"] {
            assert_eq!(
                endpoints_of(&desired, key(addr, Protocol::Tcp)),
                Some(&both),
                "{addr}"
            );
        }
        assert_eq!(desired.len(), 3);
    }

    #[test]
    fn no_endpoints_is_refused_and_a_local_drop_stays_with_nftables() {
        let empty = port("empty", "10.96.0.11", Protocol::Udp);
        let mut local = port("local", "10.96.0.12", Protocol::Tcp);
        local.internal_policy_local = true;
        let remote_only = vec![endpoint("10.244.2.3", 8080, false)];
        let state = state_on(
            node_with(&["192.168.0.2"]),
            vec![(empty, vec![]), (local, remote_only)],
        );
        let desired = desired(&state);
        assert_eq!(
            endpoints_of(&desired, key("10.96.0.11:80", Protocol::Udp)),
            Some(&vec![])
        );
        assert_eq!(
            endpoints_of(&desired, key("10.96.0.12:80", Protocol::Tcp)),
            None
        );
    }

    #[test]
    fn internal_policy_local_keeps_only_local_endpoints() {
        let mut local = port("local", "10.96.0.12", Protocol::Tcp);
        local.internal_policy_local = true;
        let backends = vec![
            endpoint("10.244.1.3", 8080, true),
            endpoint("10.244.2.3", 8080, false),
        ];
        let state = state_on(node_with(&["192.168.0.2"]), vec![(local, backends)]);
        let desired = desired(&state);
        let want = eps(&["10.244.1.3:8080"]);
        assert_eq!(
            endpoints_of(&desired, key("10.96.0.12:80", Protocol::Tcp)),
            Some(&want)
        );
    }

    #[test]
    fn affinity_goes_with_its_timeout_sctp_and_source_ranges_stay_with_nftables() {
        let mut sticky = port("sticky", "10.96.0.13", Protocol::Tcp);
        sticky.session_affinity = Some(kp_core::model::SessionAffinity {
            timeout: std::time::Duration::from_secs(10),
        });
        let sctp = port("sctp", "10.96.0.14", Protocol::Sctp);
        let mut ranged = port("ranged", "10.96.0.15", Protocol::Tcp);
        ranged.load_balancer_ips = vec!["198.51.100.8".parse().expect("literal")];
        ranged.load_balancer_source_ranges = vec!["192.0.2.0/24".parse().expect("literal")];
        let ep = || vec![endpoint("10.244.1.3", 8080, true)];
        let state = state_on(
            node_with(&["192.168.0.2"]),
            vec![(sticky, ep()), (sctp, ep()), (ranged, ep())],
        );
        let desired = desired(&state);
        let keys: Vec<ServiceKey> = desired.keys().copied().collect();
        let sticky = key("10.96.0.13:80", Protocol::Tcp);
        let ranged = key("10.96.0.15:80", Protocol::Tcp);
        assert_eq!(
            keys,
            [sticky, ranged],
            "no SCTP, only the ClusterIP of ranged"
        );
        assert_eq!(desired[&sticky].affinity_ms, 10_000);
        assert_eq!(desired[&ranged].affinity_ms, 0);
    }

    #[test]
    fn each_family_gets_its_own_endpoints() {
        let mut dual = port("dual", "10.96.0.10", Protocol::Tcp);
        dual.cluster_ips
            .push("fd00:96::10".parse().expect("literal"));
        let backends = vec![
            endpoint("10.244.1.3", 8080, true),
            endpoint("fd00:10:244:1::3", 8080, true),
        ];
        let state = state_on(node_with(&["192.168.0.2"]), vec![(dual, backends)]);
        let desired = desired(&state);
        let four = eps(&["10.244.1.3:8080"]);
        let six = eps(&["[fd00:10:244:1::3]:8080"]);
        assert_eq!(
            endpoints_of(&desired, key("10.96.0.10:80", Protocol::Tcp)),
            Some(&four)
        );
        assert_eq!(
            endpoints_of(&desired, key("[fd00:96::10]:80", Protocol::Tcp)),
            Some(&six)
        );
    }
}
