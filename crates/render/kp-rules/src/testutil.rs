//! Proxy states in upstream's test conventions (reference section 4.1) and the renderer's
//! snapshot fixtures, for the tests of this crate and of the backends that apply the same
//! states to the kernel (`kp-dataplane`'s netlink equivalence tests). Built with the
//! `test-util` feature.

use std::collections::BTreeSet;
use std::time::Duration;

use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, NodeInfo, Protocol, ServicePort, SessionAffinity};
use kp_core::tracker::ProxyState;

use crate::iptables::{LocalDetector, RenderConfig, RenderOutput, SyncScope, render};

pub use kp_core::testutil::{NODE, endpoint, ip, net, port_name, service_name};

/// A ClusterIP service port with no external exposure.
pub fn cluster_ip(ns: &str, name: &str, port: &str, cluster_ip: &str, number: u16) -> ServicePort {
    kp_core::testutil::cluster_ip_port(port_name(ns, name, port, Protocol::Tcp), cluster_ip, number)
}

/// `svc` with ClientIP affinity of `seconds`.
pub fn with_affinity(mut svc: ServicePort, seconds: u64) -> ServicePort {
    svc.session_affinity = Some(SessionAffinity {
        timeout: Duration::from_secs(seconds),
    });
    svc
}

/// This node, at 192.168.0.2 and 2001:db8::1.
pub fn node() -> NodeInfo {
    kp_core::testutil::node_with(&["192.168.0.2", "2001:db8::1"])
}

/// A state on [`node`] holding `items`.
pub fn state(items: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    kp_core::testutil::state_on(node(), items)
}

/// Upstream's test configuration: mark 0x4000, pod CIDRs 10.0.0.0/8 and fd00:10::/64.
pub fn config() -> RenderConfig {
    RenderConfig {
        local_detector: LocalDetector::Cidrs(vec![net("10.0.0.0/8"), net("fd00:10::/64")]),
        ..RenderConfig::default()
    }
}

/// `state`'s full iptables sync for `family`.
pub fn full(state: &ProxyState, family: IpFamily, config: &RenderConfig) -> RenderOutput {
    render(
        state,
        family,
        config,
        &SyncScope {
            kind: SyncKind::Full,
            changed: &BTreeSet::new(),
            existing_chains: &BTreeSet::new(),
        },
    )
    .expect("valid config renders")
}

/// An `iptables-save` dump reduced to what matters for comparing rulesets: per table, each
/// chain's rules in order (counters and comments-only lines dropped).
pub fn ruleset(save: &str) -> std::collections::BTreeMap<(String, String), Vec<String>> {
    let mut out = std::collections::BTreeMap::new();
    let mut table = String::new();
    for line in save.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.to_owned();
        } else if let Some(rest) = line.strip_prefix(':') {
            let chain = rest.split(' ').next().unwrap_or_default().to_owned();
            out.entry((table.clone(), chain)).or_insert_with(Vec::new);
        } else if let Some(rest) = line.strip_prefix("-A ") {
            let (chain, rule) = rest.split_once(' ').unwrap_or((rest, ""));
            out.entry((table.clone(), chain.to_owned()))
                .or_insert_with(Vec::new)
                .push(rule.to_owned());
        }
    }
    out
}

/// The snapshot fixtures' states (`tests/snapshots.rs`), shared with the kernel tests of
/// other crates (`kp-dataplane`'s netlink equivalence tests).
pub mod fixtures {
    use super::*;
    use kp_core::model::Protocol;

    /// One ClusterIP service with two endpoints.
    pub fn cluster_ip_two_endpoints() -> ProxyState {
        state(vec![(
            cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80),
            vec![
                endpoint("10.180.0.1", 80, false),
                endpoint("10.180.0.2", 80, false),
            ],
        )])
    }

    /// A TCP NodePort with an external IP and a UDP NodePort with a local endpoint.
    pub fn node_port() -> ProxyState {
        let mut svc = cluster_ip("ns2", "svc2", "p80", "172.30.0.42", 80);
        svc.node_port = Some(3001);
        svc.external_ips = vec![ip("192.168.99.22")];
        let mut udp = cluster_ip("ns2", "dns", "dns", "172.30.0.43", 53);
        udp.name.protocol = Protocol::Udp;
        udp.node_port = Some(3053);
        state(vec![
            (svc, vec![endpoint("10.180.0.2", 8080, false)]),
            (udp, vec![endpoint("10.180.0.3", 5353, true)]),
        ])
    }

    /// eTP Local load balancers, one with source ranges (one of them holding the node IP)
    /// and a health check node port, one without local endpoints.
    pub fn etp_local_lb_source_ranges() -> ProxyState {
        let mut svc = cluster_ip("ns5", "svc5", "p80", "172.30.0.45", 80);
        svc.node_port = Some(3002);
        svc.load_balancer_ips = vec![ip("5.6.7.8")];
        // The second range contains the node IP, so the VIP-as-source rule appears.
        svc.load_balancer_source_ranges = vec![net("203.0.113.0/25"), net("192.168.0.0/24")];
        svc.external_policy_local = true;
        svc.health_check_node_port = Some(30000);
        let mut no_local = cluster_ip("ns6", "svc6", "p80", "172.30.0.46", 80);
        no_local.load_balancer_ips = vec![ip("9.10.11.12")];
        no_local.node_port = Some(3003);
        no_local.external_policy_local = true;
        state(vec![
            (
                svc,
                vec![
                    endpoint("10.180.0.5", 80, true),
                    endpoint("10.180.1.5", 80, false),
                ],
            ),
            (no_local, vec![endpoint("10.180.0.6", 80, false)]),
        ])
    }

    /// ClientIP affinity, and iTP Local.
    pub fn affinity_and_itp_local() -> ProxyState {
        let svc = with_affinity(cluster_ip("ns3", "svc3", "p80", "172.30.0.43", 80), 10800);
        let mut itp = cluster_ip("ns4", "svc4", "p80", "172.30.0.44", 80);
        itp.internal_policy_local = true;
        state(vec![
            (
                svc,
                vec![
                    endpoint("10.180.0.3", 80, false),
                    endpoint("10.180.0.4", 80, false),
                    endpoint("10.180.0.5", 80, false),
                ],
            ),
            (
                itp,
                vec![
                    endpoint("10.180.0.7", 80, true),
                    endpoint("10.180.1.7", 80, false),
                ],
            ),
        ])
    }

    /// A load balancer without endpoints (REJECT), an iTP Local service without local ones
    /// (DROP).
    pub fn no_endpoints() -> ProxyState {
        let mut lb = cluster_ip("ns7", "svc7", "p80", "172.30.0.47", 80);
        lb.node_port = Some(3007);
        lb.external_ips = vec![ip("192.168.99.33")];
        lb.load_balancer_ips = vec![ip("1.2.3.4")];
        lb.load_balancer_source_ranges = vec![net("203.0.113.0/25")];
        let mut itp = cluster_ip("ns8", "svc8", "", "172.30.0.48", 80);
        itp.internal_policy_local = true;
        state(vec![
            (lb, vec![]),
            (itp, vec![endpoint("10.180.0.8", 80, false)]),
        ])
    }

    /// An IPv6 NodePort with external IPs of both families, endpoints of both families.
    pub fn ipv6() -> ProxyState {
        let mut svc = cluster_ip("ns1", "svc1", "p80", "fd00:172:30::41", 80);
        svc.node_port = Some(3001);
        svc.external_ips = vec![ip("2600:5200::7"), ip("192.168.99.22")];
        svc.external_policy_local = true;
        state(vec![(
            svc,
            vec![
                endpoint("fd00:10::1", 80, true),
                endpoint("fd00:10::2", 80, false),
                // Other-family endpoints are not this proxier's business.
                endpoint("10.180.0.1", 80, false),
            ],
        )])
    }
}
