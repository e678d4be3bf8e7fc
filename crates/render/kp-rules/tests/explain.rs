//! `kp_rules::explain`: every endpoint verdict, outcome, masquerade reason and match kind,
//! cross-checked against what the renderer actually writes.

use crate::common;

use std::collections::BTreeSet;

use common::*;
use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort};
use kp_core::topology::TopologyMode;
use kp_core::tracker::ProxyState;
use kp_rules::explain::verify::{Difference, RuleSet, verify};
use kp_rules::explain::{
    Destination, EndpointList, EndpointVerdict, ExplainError, Explanation, MasqueradeDecision,
    MasqueradeReason, MatchKind, NOT_A_SERVICE, Outcome, Query, ServiceMatch, explain,
};
use kp_rules::iptables::names::{ServiceChains, endpoint_chain};
use kp_rules::iptables::{LocalDetector, NodePortAddresses, RenderConfig};

const CIP: &str = "172.30.0.41";
const NODE_IP: &str = "192.168.0.2";
const LB_IP: &str = "203.0.113.10";
const EXT_IP: &str = "198.51.100.7";

fn dest(text: &str) -> Destination {
    text.parse().expect("test destination")
}

fn ask(state: &ProxyState, config: &RenderConfig, to: &str, from: Option<&str>) -> Explanation {
    explain(
        state,
        config,
        &Query {
            destination: dest(to),
            source: from.map(ip),
        },
    )
    .expect("explainable")
}

/// The only match of an explanation.
fn only(e: &Explanation) -> &ServiceMatch {
    assert_eq!(e.matches.len(), 1, "{e:#?}");
    &e.matches[0]
}

fn verdicts(m: &ServiceMatch) -> Vec<(String, EndpointVerdict, bool)> {
    m.endpoints
        .iter()
        .map(|e| (e.ip.to_string(), e.verdict, e.used))
        .collect()
}

fn web() -> ServicePort {
    cluster_ip("ns1", "web", "p80", CIP, 80)
}

fn not_ready(address: &str, local: bool) -> Endpoint {
    Endpoint {
        ready: false,
        serving: false,
        ..endpoint(address, 80, local)
    }
}

fn terminating(address: &str, local: bool) -> Endpoint {
    Endpoint {
        ready: false,
        serving: true,
        terminating: true,
        ..endpoint(address, 80, local)
    }
}

/// A LoadBalancer service with NodePort 30080, an externalIP and an LB IP.
fn lb(etp_local: bool) -> ServicePort {
    let mut svc = web();
    svc.node_port = Some(30080);
    svc.external_ips = vec![ip(EXT_IP)];
    svc.load_balancer_ips = vec![ip(LB_IP)];
    svc.external_policy_local = etp_local;
    svc
}

#[test]
fn cluster_ip_ready_endpoints_are_used_with_their_chains() {
    let state = state(vec![(
        web(),
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
        ],
    )]);
    let e = ask(&state, &config(), "172.30.0.41:80", None);
    let m = only(&e);
    assert_eq!(m.how, MatchKind::ClusterIp);
    assert_eq!(m.outcome, Outcome::Dnat);
    assert_eq!(m.endpoint_list, EndpointList::Cluster);
    assert_eq!(
        verdicts(m),
        vec![
            ("10.180.0.1".into(), EndpointVerdict::Ready, true),
            ("10.180.0.2".into(), EndpointVerdict::Ready, true),
        ]
    );
    let names = ServiceChains::new(&web().name);
    assert_eq!(m.chains.svc, names.svc);
    assert_eq!(
        m.endpoints[0].chain.as_deref(),
        Some(endpoint_chain(&web().name, ip("10.180.0.1"), 80).as_str())
    );
    let path: Vec<&str> = m.hops.iter().map(|h| h.chain.as_str()).collect();
    assert_eq!(path, vec!["KUBE-SERVICES", names.svc.as_str()]);
    assert_eq!(m.session_affinity, None);
    assert!(e.near_misses.is_empty());
}

#[test]
fn terminating_endpoint_is_not_used_while_a_ready_one_exists() {
    let state = state(vec![(
        web(),
        vec![
            endpoint("10.180.0.1", 80, true),
            terminating("10.180.0.2", false),
        ],
    )]);
    let m = ask(&state, &config(), "172.30.0.41:80", None)
        .matches
        .remove(0);
    assert_eq!(
        verdicts(&m),
        vec![
            ("10.180.0.1".into(), EndpointVerdict::Ready, true),
            (
                "10.180.0.2".into(),
                EndpointVerdict::ServingTerminating,
                false
            ),
        ]
    );
}

#[test]
fn terminating_fallback_when_nothing_is_ready() {
    let state = state(vec![(
        web(),
        vec![
            terminating("10.180.0.2", false),
            not_ready("10.180.0.3", true),
        ],
    )]);
    let m = ask(&state, &config(), "172.30.0.41:80", None)
        .matches
        .remove(0);
    assert_eq!(m.outcome, Outcome::Dnat);
    assert_eq!(
        verdicts(&m),
        vec![
            (
                "10.180.0.2".into(),
                EndpointVerdict::TerminatingFallback,
                true
            ),
            ("10.180.0.3".into(), EndpointVerdict::NotReady, false),
        ]
    );
}

#[test]
fn no_usable_endpoint_is_rejected() {
    for endpoints in [vec![], vec![not_ready("10.180.0.3", true)]] {
        let state = state(vec![(web(), endpoints)]);
        let m = ask(&state, &config(), "172.30.0.41:80", Some("10.1.2.3"))
            .matches
            .remove(0);
        assert_eq!(m.outcome, Outcome::RejectNoEndpoints);
        assert_eq!(m.masquerade.decision, MasqueradeDecision::NotApplicable);
        assert_eq!(m.masquerade.reason, MasqueradeReason::Dropped);
        assert_eq!(m.hops.len(), 1);
        assert_eq!(
            (m.hops[0].table, m.hops[0].chain.as_str()),
            ("filter", "KUBE-SERVICES")
        );
        assert!(m.endpoints.iter().all(|e| !e.used));
    }
    // External traffic without endpoints is rejected in KUBE-EXTERNAL-SERVICES.
    let state = state(vec![(lb(false), vec![])]);
    let m = ask(&state, &config(), "198.51.100.7:80", None)
        .matches
        .remove(0);
    assert_eq!(m.outcome, Outcome::RejectNoEndpoints);
    assert_eq!(m.hops[0].chain, "KUBE-EXTERNAL-SERVICES");
}

#[test]
fn topology_filtered_endpoint() {
    let zoned = |address: &str, zone: &str| Endpoint {
        zone: Some(zone.into()),
        zone_hints: Some(Box::new(BTreeSet::from([zone.to_owned()]))),
        ..endpoint(address, 80, false)
    };
    let mut state = state(vec![(
        web(),
        vec![zoned("10.180.0.1", "zone-a"), zoned("10.180.0.2", "zone-b")],
    )]);
    state
        .node
        .labels
        .insert("topology.kubernetes.io/zone".into(), "zone-a".into());
    let m = ask(&state, &config(), "172.30.0.41:80", None)
        .matches
        .remove(0);
    assert_eq!(m.topology_mode, TopologyMode::PreferSameZone);
    assert_eq!(
        verdicts(&m),
        vec![
            ("10.180.0.1".into(), EndpointVerdict::Ready, true),
            (
                "10.180.0.2".into(),
                EndpointVerdict::FilteredByTopology,
                false
            ),
        ]
    );
    assert!(
        m.endpoints[1].reason.contains("zone-a"),
        "{}",
        m.endpoints[1].reason
    );
}

#[test]
fn internal_policy_local() {
    let mut svc = web();
    svc.internal_policy_local = true;
    let names = ServiceChains::new(&svc.name);
    let with_local = state(vec![(
        svc.clone(),
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
        ],
    )]);
    let m = ask(&with_local, &config(), "172.30.0.41:80", None)
        .matches
        .remove(0);
    assert_eq!(m.endpoint_list, EndpointList::Local);
    assert_eq!(
        verdicts(&m),
        vec![
            ("10.180.0.1".into(), EndpointVerdict::Ready, true),
            (
                "10.180.0.2".into(),
                EndpointVerdict::NotLocalInternalPolicy,
                false
            ),
        ]
    );
    assert_eq!(
        m.hops.last().map(|h| h.chain.as_str()),
        Some(names.svl.as_str())
    );

    let remote_only = state(vec![(svc, vec![endpoint("10.180.0.2", 80, false)])]);
    let m = ask(&remote_only, &config(), "172.30.0.41:80", None)
        .matches
        .remove(0);
    assert_eq!(m.outcome, Outcome::DropNoLocalEndpoints);
    assert_eq!(
        (m.hops[0].table, m.hops[0].chain.as_str()),
        ("filter", "KUBE-SERVICES")
    );
    assert!(m.hops[0].action.contains("DROP"));
}

#[test]
fn external_policy_local_from_outside_uses_local_endpoints_only() {
    let state = state(vec![(
        lb(true),
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
        ],
    )]);
    let m = ask(&state, &config(), "198.51.100.7:80", Some("8.8.8.8"))
        .matches
        .remove(0);
    assert_eq!(m.how, MatchKind::ExternalIp);
    assert_eq!(m.endpoint_list, EndpointList::Local);
    assert_eq!(
        verdicts(&m),
        vec![
            ("10.180.0.1".into(), EndpointVerdict::Ready, true),
            (
                "10.180.0.2".into(),
                EndpointVerdict::NotLocalExternalPolicy,
                false
            ),
        ]
    );
    assert_eq!(m.masquerade.decision, MasqueradeDecision::No);
    assert_eq!(
        m.masquerade.reason,
        MasqueradeReason::ExternalLocalPreserved
    );
    let names = ServiceChains::new(&m.name);
    let path: Vec<&str> = m.hops.iter().map(|h| h.chain.as_str()).collect();
    assert_eq!(
        path,
        vec!["KUBE-SERVICES", names.ext.as_str(), names.svl.as_str()]
    );
}

#[test]
fn external_policy_local_short_circuits_for_pods_and_the_node() {
    let state = state(vec![(lb(true), vec![endpoint("10.180.0.2", 80, false)])]);
    // From a local pod: all cluster endpoints, not masqueraded.
    let m = ask(&state, &config(), "198.51.100.7:80", Some("10.1.1.1"))
        .matches
        .remove(0);
    assert_eq!(m.endpoint_list, EndpointList::Cluster);
    assert_eq!(m.outcome, Outcome::Dnat);
    assert_eq!(m.masquerade.reason, MasqueradeReason::ExternalLocalFromPod);
    assert_eq!(m.masquerade.decision, MasqueradeDecision::No);
    // From the node itself: masqueraded, all cluster endpoints.
    let m = ask(&state, &config(), "198.51.100.7:80", Some(NODE_IP))
        .matches
        .remove(0);
    assert_eq!(m.endpoint_list, EndpointList::Cluster);
    assert_eq!(m.masquerade.reason, MasqueradeReason::ExternalLocalFromNode);
    assert_eq!(m.masquerade.decision, MasqueradeDecision::Yes);
    // From outside: no local endpoint, DROP.
    let m = ask(&state, &config(), "198.51.100.7:80", Some("8.8.8.8"))
        .matches
        .remove(0);
    assert_eq!(m.outcome, Outcome::DropNoLocalEndpoints);
    assert_eq!(m.hops[0].chain, "KUBE-EXTERNAL-SERVICES");
    // Unknown source: explained as an outside client, with a note.
    let m = ask(&state, &config(), "198.51.100.7:80", None)
        .matches
        .remove(0);
    assert_eq!(m.outcome, Outcome::DropNoLocalEndpoints);
    assert!(
        m.notes
            .iter()
            .any(|n| n.contains("assuming a client outside"))
    );
}

#[test]
fn wrong_family_endpoints_are_listed_but_never_used() {
    let mut svc = web();
    svc.cluster_ips.push(ip("fd00:172:30::41"));
    let state = state(vec![(
        svc,
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("fd00:10::1", 80, true),
        ],
    )]);
    let m = ask(&state, &config(), "[fd00:172:30::41]:80", None)
        .matches
        .remove(0);
    assert_eq!(
        verdicts(&m),
        vec![
            ("10.180.0.1".into(), EndpointVerdict::WrongFamily, false),
            ("fd00:10::1".into(), EndpointVerdict::Ready, true),
        ]
    );
    assert_eq!(m.endpoints[0].chain, None);
}

#[test]
fn cluster_ip_masquerade_rows() {
    let state = state(vec![(
        web(),
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
        ],
    )]);
    let reason = |config: &RenderConfig, from: Option<&str>| {
        let m = ask(&state, config, "172.30.0.41:80", from)
            .matches
            .remove(0);
        (m.masquerade.decision, m.masquerade.reason)
    };
    use MasqueradeDecision as D;
    use MasqueradeReason as R;
    assert_eq!(
        reason(&config(), Some("10.2.3.4")),
        (D::No, R::LocalTraffic)
    );
    assert_eq!(
        reason(&config(), Some(NODE_IP)),
        (D::Yes, R::NotLocalTraffic)
    );
    assert_eq!(reason(&config(), None), (D::Depends, R::SourceUndetermined));
    let all = RenderConfig {
        masquerade_all: true,
        ..config()
    };
    assert_eq!(reason(&all, Some("10.2.3.4")), (D::Yes, R::MasqueradeAll));
    let none = RenderConfig::default();
    assert_eq!(reason(&none, Some(NODE_IP)), (D::No, R::NoLocalDetector));
    let bridge = RenderConfig {
        local_detector: LocalDetector::BridgeInterface("cbr0".into()),
        ..RenderConfig::default()
    };
    assert_eq!(
        reason(&bridge, Some("10.2.3.4")),
        (D::Depends, R::SourceUndetermined)
    );
    // Hairpin: a pod reaching its own service may land on itself.
    assert_eq!(
        reason(&config(), Some("10.180.0.1")),
        (D::Depends, R::Hairpin)
    );
    let single = ProxyState {
        endpoints: [(web().name, vec![endpoint("10.180.0.1", 80, true)])].into(),
        ..state.clone()
    };
    let m = ask(&single, &config(), "172.30.0.41:80", Some("10.180.0.1"))
        .matches
        .remove(0);
    assert_eq!(
        (m.masquerade.decision, m.masquerade.reason),
        (D::Yes, R::Hairpin)
    );
    assert!(m.endpoints[0].hairpin);
}

#[test]
fn external_policy_cluster_is_always_masqueraded() {
    let state = state(vec![(lb(false), vec![endpoint("10.180.0.2", 80, false)])]);
    for to in ["198.51.100.7:80", "203.0.113.10:80", "192.168.0.2:30080"] {
        for from in [None, Some("10.1.1.1"), Some("8.8.8.8")] {
            let m = ask(&state, &config(), to, from).matches.remove(0);
            assert_eq!(
                m.masquerade.decision,
                MasqueradeDecision::Yes,
                "{to} {from:?}"
            );
            assert_eq!(m.masquerade.reason, MasqueradeReason::ExternalPolicyCluster);
            assert_eq!(m.endpoint_list, EndpointList::Cluster);
        }
    }
}

#[test]
fn load_balancer_source_ranges() {
    let mut svc = lb(false);
    svc.load_balancer_source_ranges = vec![net("203.0.113.0/25")];
    let state = state(vec![(svc, vec![endpoint("10.180.0.2", 80, false)])]);
    let names = ServiceChains::new(&web().name);

    let outside = ask(&state, &config(), "203.0.113.10:80", Some("203.0.113.200"));
    let m = only(&outside);
    assert_eq!(m.how, MatchKind::LoadBalancerIp);
    assert_eq!(m.outcome, Outcome::DropSourceRange);
    let path: Vec<(&str, &str)> = m.hops.iter().map(|h| (h.table, h.chain.as_str())).collect();
    assert_eq!(
        path,
        vec![
            ("nat", "KUBE-SERVICES"),
            ("nat", names.fw.as_str()),
            ("filter", "KUBE-PROXY-FIREWALL")
        ]
    );
    assert!(m.endpoints.iter().all(|e| !e.used));

    let inside = ask(&state, &config(), "203.0.113.10:80", Some("203.0.113.5"));
    let m = only(&inside);
    assert_eq!(m.outcome, Outcome::Dnat);
    let path: Vec<&str> = m.hops.iter().map(|h| h.chain.as_str()).collect();
    assert_eq!(
        path,
        vec![
            "KUBE-SERVICES",
            names.fw.as_str(),
            names.ext.as_str(),
            names.svc.as_str()
        ]
    );

    let unknown = ask(&state, &config(), "203.0.113.10:80", None);
    assert!(
        only(&unknown)
            .notes
            .iter()
            .any(|n| n.contains("203.0.113.0/25"))
    );

    // Source ranges do not apply to the NodePort or the externalIP.
    for to in ["192.168.0.2:30080", "198.51.100.7:80"] {
        let m = ask(&state, &config(), to, Some("203.0.113.200"))
            .matches
            .remove(0);
        assert_eq!(m.outcome, Outcome::Dnat, "{to}");
    }
}

#[test]
fn node_port_addresses() {
    let state = state(vec![(lb(false), vec![endpoint("10.180.0.2", 80, false)])]);
    let m = ask(&state, &config(), "192.168.0.2:30080", None)
        .matches
        .remove(0);
    assert_eq!(
        (m.how, m.port, m.service_port_number),
        (MatchKind::NodePort, 30080, 80)
    );
    let path: Vec<&str> = m.hops.iter().map(|h| h.chain.as_str()).collect();
    assert_eq!(path[..2], ["KUBE-SERVICES", "KUBE-NODEPORTS"]);
    // localhost NodePorts (IPv4, on by default).
    assert_eq!(
        ask(&state, &config(), "127.0.0.1:30080", None)
            .matches
            .len(),
        1
    );
    let no_localhost = RenderConfig {
        localhost_node_ports: false,
        ..config()
    };
    assert!(
        ask(&state, &no_localhost, "127.0.0.1:30080", None)
            .matches
            .is_empty()
    );
    // Restricted nodePortAddresses.
    let restricted = RenderConfig {
        node_port_addresses: NodePortAddresses::Ips(vec![ip("192.168.0.9")]),
        ..config()
    };
    assert!(
        ask(&state, &restricted, "192.168.0.2:30080", None)
            .matches
            .is_empty()
    );
    assert_eq!(
        ask(&state, &restricted, "192.168.0.9:30080", None)
            .matches
            .len(),
        1
    );
    // An address that is no node address.
    assert!(
        ask(&state, &config(), "192.168.0.3:30080", None)
            .matches
            .is_empty()
    );
}

#[test]
fn session_affinity_is_reported_with_the_programmed_timeout() {
    let state = state(vec![
        (
            with_affinity(web(), 10800),
            vec![endpoint("10.180.0.1", 80, true)],
        ),
        (
            with_affinity(cluster_ip("ns1", "big", "p80", "172.30.0.42", 80), 999_999),
            vec![endpoint("10.180.0.1", 80, true)],
        ),
    ]);
    let m = ask(&state, &config(), "172.30.0.41:80", None)
        .matches
        .remove(0);
    assert_eq!(m.session_affinity.map(|a| a.timeout_seconds), Some(10800));
    assert!(m.hops.iter().any(|h| h.action.contains("10800s")));
    let m = ask(&state, &config(), "172.30.0.42:80", None)
        .matches
        .remove(0);
    assert_eq!(m.session_affinity.map(|a| a.timeout_seconds), Some(86_400));
}

#[test]
fn not_a_service_and_near_misses() {
    let state = state(vec![(web(), vec![endpoint("10.180.0.1", 80, true)])]);
    let e = ask(&state, &config(), "10.9.9.9:80", None);
    assert!(e.matches.is_empty());
    assert_eq!(e.summary, NOT_A_SERVICE);
    let e = ask(&state, &config(), "172.30.0.41:81", None);
    assert!(e.matches.is_empty());
    assert_eq!(e.near_misses.len(), 1);
    assert_eq!(e.near_misses[0].port, 80);
    let e = ask(&state, &config(), "172.30.0.41:80/udp", None);
    assert!(e.matches.is_empty(), "protocol must match");
    assert_eq!(e.near_misses[0].protocol, Protocol::Tcp);
    // Without a port every port of the protocol matches.
    let mut second = cluster_ip("ns1", "web", "p443", CIP, 443);
    second.name.port = "p443".into();
    let state = state_with(&state, second);
    assert_eq!(ask(&state, &config(), "172.30.0.41", None).matches.len(), 2);
}

fn state_with(base: &ProxyState, svc: ServicePort) -> ProxyState {
    let mut state = base.clone();
    state.services.insert(svc.name.clone(), svc);
    state
}

#[test]
fn errors() {
    let state = state(vec![(web(), vec![])]);
    let mismatch = explain(
        &state,
        &config(),
        &Query {
            destination: dest("172.30.0.41:80"),
            source: Some(ip("fd00::1")),
        },
    );
    assert!(matches!(mismatch, Err(ExplainError::FamilyMismatch { .. })));
    let two_cidrs = RenderConfig {
        local_detector: LocalDetector::Cidrs(vec![net("10.0.0.0/8"), net("10.1.0.0/16")]),
        ..RenderConfig::default()
    };
    let bad = explain(
        &state,
        &two_cidrs,
        &Query {
            destination: dest("172.30.0.41:80"),
            source: None,
        },
    );
    assert!(matches!(bad, Err(ExplainError::Config(_))));
}

/// Every chain an explanation names for a forwarded packet is one the renderer writes, and
/// used endpoints are exactly the renderer's `KUBE-SEP` chains.
#[test]
fn chains_agree_with_the_renderer() {
    let mut etp_local = lb(true);
    etp_local.name = port_name("ns2", "shop", "https", Protocol::Tcp);
    etp_local.cluster_ips = vec![ip("172.30.0.50")];
    etp_local.external_ips = vec![];
    etp_local.load_balancer_ips = vec![ip("203.0.113.20")];
    etp_local.load_balancer_source_ranges = vec![net("203.0.113.0/25")];
    let state = state(vec![
        (
            with_affinity(web(), 300),
            vec![
                endpoint("10.180.0.1", 80, true),
                terminating("10.180.0.2", false),
            ],
        ),
        (
            etp_local,
            vec![
                endpoint("10.180.1.1", 8443, true),
                endpoint("10.180.1.2", 8443, false),
                not_ready("10.180.1.3", true),
            ],
        ),
    ]);
    let rendered = full(&state, IpFamily::V4, &config());
    let queries = [
        ("172.30.0.41:80", None),
        ("172.30.0.50:80", None),
        ("203.0.113.20:80", Some("203.0.113.5")),
        ("192.168.0.2:30080", Some(NODE_IP)),
        ("192.168.0.2:30080", Some("10.1.1.1")),
        ("192.168.0.2:30080", Some("8.8.8.8")),
    ];
    for (to, from) in queries {
        let e = ask(&state, &config(), to, from);
        assert!(!e.matches.is_empty(), "{to}");
        for m in &e.matches {
            assert_eq!(m.outcome, Outcome::Dnat, "{to} {from:?}");
            for hop in m.hops.iter().filter(|h| h.table == "nat") {
                assert!(
                    hop.chain.starts_with("KUBE-SERVICES")
                        || hop.chain == "KUBE-NODEPORTS"
                        || rendered.chains.contains(&hop.chain),
                    "{to}: {} is not rendered",
                    hop.chain
                );
                assert!(
                    rendered.text.contains(&format!(":{} ", hop.chain)),
                    "{}",
                    hop.chain
                );
            }
            for ep in &m.endpoints {
                let chain = ep.chain.as_deref().expect("same family");
                if ep.used {
                    assert!(
                        rendered.chains.contains(chain),
                        "{to}: {chain} not rendered"
                    );
                    assert!(
                        rendered
                            .text
                            .contains(&format!("-j DNAT --to-destination {}:{}", ep.ip, ep.port)),
                        "{to}: no DNAT to {}",
                        ep.ip
                    );
                }
            }
        }
    }
}

#[test]
fn explanation_serialises_to_json() {
    let state = state(vec![(lb(true), vec![endpoint("10.180.0.1", 80, true)])]);
    let e = ask(&state, &config(), "203.0.113.10:80", Some("8.8.8.8"));
    let json = serde_json::to_value(&e).expect("serialisable");
    assert_eq!(json["matches"][0]["how"], "LoadBalancerIp");
    assert_eq!(json["matches"][0]["outcome"], "Dnat");
    assert_eq!(json["matches"][0]["endpoints"][0]["verdict"], "Ready");
    assert_eq!(json["destination"]["port"], 80);
}

#[test]
fn verify_finds_nothing_on_the_rendered_rules_and_every_edit() {
    let state = state(vec![(
        with_affinity(web(), 300),
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
        ],
    )]);
    let rendered = full(&state, IpFamily::V4, &config());
    let desired = RuleSet::parse(&rendered.text).expect("renderer output parses");
    let e = ask(&state, &config(), "172.30.0.41:80", None);
    let clean = verify(&e, &desired, &desired);
    assert!(clean.is_clean(), "{:#?}", clean.differences);
    assert!(
        clean
            .checked
            .iter()
            .any(|c| c.chain == e.matches[0].chains.svc)
    );

    let svc = &e.matches[0].chains.svc;
    let sep = e.matches[0].endpoints[1].chain.clone().expect("chain");
    // Drop the last rule of the SVC chain.
    let last_svc_rule = rendered
        .text
        .lines()
        .rfind(|l| l.starts_with(&format!("-A {svc} ")))
        .expect("svc rule")
        .to_owned();
    let edited = rendered.text.replace(&format!("{last_svc_rule}\n"), "");
    let report = verify(&e, &desired, &RuleSet::parse(&edited).expect("parses"));
    assert_eq!(
        report.differences,
        vec![Difference::MissingRule {
            table: "nat".into(),
            chain: svc.clone(),
            // Masquerade rule, two affinity checks, two random picks.
            position: 5,
            rule: last_svc_rule,
        }]
    );
    // Change a DNAT target.
    let edited = rendered.text.replace(
        "--to-destination 10.180.0.2:80",
        "--to-destination 10.180.0.9:80",
    );
    let report = verify(&e, &desired, &RuleSet::parse(&edited).expect("parses"));
    let kinds: Vec<(&str, &str)> = report
        .differences
        .iter()
        .map(|d| match d {
            Difference::MissingRule { chain, .. } => ("missing", chain.as_str()),
            Difference::UnexpectedRule { chain, .. } => ("unexpected", chain.as_str()),
            _ => ("other", ""),
        })
        .collect();
    assert_eq!(
        kinds,
        vec![("missing", sep.as_str()), ("unexpected", sep.as_str())]
    );
    // A whole chain gone, and an unrelated service's rules are out of scope.
    let edited: String = rendered
        .text
        .lines()
        .filter(|l| !l.contains(&sep))
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        + "*filter\n-A KUBE-SERVICES -m comment --comment \"ns9/other:p cluster IP\" -j REJECT\nCOMMIT\n";
    let report = verify(&e, &desired, &RuleSet::parse(&edited).expect("parses"));
    assert!(report.differences.contains(&Difference::MissingChain {
        table: "nat".into(),
        chain: sep.clone(),
        rules: 2,
    }));
    assert!(
        report
            .differences
            .iter()
            .all(|d| !d.to_string().contains("ns9/other")),
        "{:#?}",
        report.differences
    );
    // An empty kernel: everything is missing.
    let report = verify(&e, &desired, &RuleSet::default());
    assert!(report.differences.len() >= 4, "{:#?}", report.differences);
}

#[test]
fn near_miss_does_not_count_node_ports() {
    // Every NodePort service is reachable on every node address; listing them all as near
    // misses of some other port would be noise.
    let state = state(vec![(lb(false), vec![endpoint("10.180.0.1", 80, true)])]);
    let e = ask(&state, &config(), "192.168.0.2:22", None);
    assert!(e.matches.is_empty());
    assert!(e.near_misses.is_empty());
}

/// The hops of the only match, each as `table chain: action`, this service port's chains
/// shown as `SVC`, `SVL`, `EXT` and `FW`.
fn hop_lines(
    state: &ProxyState,
    config: &RenderConfig,
    to: &str,
    from: Option<&str>,
) -> Vec<String> {
    let e = ask(state, config, to, from);
    let m = only(&e);
    let c = &m.chains;
    m.hops
        .iter()
        .map(|h| {
            format!("{} {}: {}", h.table, h.chain, h.action)
                .replace(&c.svc, "SVC")
                .replace(&c.svl, "SVL")
                .replace(&c.ext, "EXT")
                .replace(&c.fw, "FW")
        })
        .collect()
}

const PICK: &str = "pick an endpoint -> KUBE-SEP-…";
const RECENT: &str = "recent client (within 600s) -> its endpoint; ";

/// An LB service port with affinity (600s) and a source range, two endpoints.
fn lb_with_affinity_and_range() -> ProxyState {
    let mut svc = with_affinity(lb(false), 600);
    svc.load_balancer_source_ranges = vec![net("203.0.113.0/25")];
    state(vec![(
        svc,
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
        ],
    )])
}

#[test]
fn cluster_ip_hops_show_the_masquerade_rule_the_detector_writes() {
    let cluster = lb_with_affinity_and_range();
    let to_svc = "nat KUBE-SERVICES: ClusterIP 172.30.0.41:80/tcp -> SVC";
    let marks = [
        (config(), "mark for masquerade if not from 10.0.0.0/8; "),
        (
            RenderConfig {
                masquerade_all: true,
                ..config()
            },
            "mark for masquerade (masqueradeAll); ",
        ),
        (
            RenderConfig {
                local_detector: LocalDetector::BridgeInterface("cbr0".into()),
                ..RenderConfig::default()
            },
            "mark for masquerade unless from bridge cbr0; ",
        ),
        (RenderConfig::default(), ""),
    ];
    for (config, mark) in marks {
        assert_eq!(
            hop_lines(&cluster, &config, CIP, None),
            [to_svc.to_owned(), format!("nat SVC: {mark}{RECENT}{PICK}")]
        );
    }
    let v6 = state(vec![(
        cluster_ip("ns1", "web", "p80", "fd00::41", 80),
        vec![endpoint("fd00:10::1", 80, true)],
    )]);
    assert_eq!(
        hop_lines(&v6, &config(), "[fd00::41]:80", None)[0],
        "nat KUBE-SERVICES: ClusterIP [fd00::41]:80/tcp -> SVC"
    );
}

#[test]
fn external_hops_pass_the_firewall_and_kube_ext() {
    let cluster = lb_with_affinity_and_range();
    assert_eq!(
        hop_lines(&cluster, &config(), "192.168.0.2:30080", None),
        [
            "nat KUBE-SERVICES: destination is a node address -> KUBE-NODEPORTS (last rule)"
                .to_owned(),
            "nat KUBE-NODEPORTS: tcp port 30080 -> EXT".to_owned(),
            "nat EXT: mark for masquerade -> SVC".to_owned(),
            format!("nat SVC: {RECENT}{PICK}"),
        ]
    );
    let to_fw = "nat KUBE-SERVICES: LoadBalancer IP 203.0.113.10:80/tcp -> FW";
    assert_eq!(
        hop_lines(&cluster, &config(), LB_IP, Some("203.0.113.5")),
        [
            to_fw.to_owned(),
            "nat FW: source in loadBalancerSourceRanges -> EXT".to_owned(),
            "nat EXT: mark for masquerade -> SVC".to_owned(),
            format!("nat SVC: {RECENT}{PICK}"),
        ]
    );
    assert_eq!(
        hop_lines(&cluster, &config(), LB_IP, Some("203.0.113.200")),
        [
            to_fw,
            "nat FW: source matches no loadBalancerSourceRanges rule: falls through, not DNATed",
            "filter KUBE-PROXY-FIREWALL: traffic to the LB IP not accepted by FW -> DROP",
        ]
    );
    // eTP Local: KUBE-EXT-* short-circuits pods and the node, keeps the rest local.
    let local = state(vec![(
        lb(true),
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
        ],
    )]);
    let to_ext = "nat KUBE-SERVICES: externalIP 198.51.100.7:80/tcp -> EXT";
    for (from, ext, chain) in [
        ("10.1.1.1", "pod traffic -> SVC", "SVC"),
        (
            NODE_IP,
            "--src-type LOCAL: mark for masquerade -> SVC",
            "SVC",
        ),
        ("8.8.8.8", "external client -> SVL", "SVL"),
    ] {
        assert_eq!(
            hop_lines(&local, &config(), EXT_IP, Some(from)),
            [
                to_ext.to_owned(),
                format!("nat EXT: {ext}"),
                format!("nat {chain}: {PICK}"),
            ],
            "{from}"
        );
    }
}

#[test]
fn packets_without_endpoints_stop_in_filter() {
    assert_eq!(
        hop_lines(&state(vec![(web(), vec![])]), &config(), CIP, None),
        [
            "filter KUBE-SERVICES: 172.30.0.41:80/tcp (ns1/web:p80) -> REJECT; nat leaves it \
          untranslated"
        ]
    );
    let remote = state(vec![(lb(true), vec![endpoint("10.180.0.2", 80, false)])]);
    assert_eq!(
        hop_lines(&remote, &config(), "192.168.0.2:30080", Some("8.8.8.8")),
        [
            "filter KUBE-EXTERNAL-SERVICES: local address, tcp port 30080 (ns1/web:p80) -> DROP; \
          nat leaves it untranslated"
        ]
    );
}

#[test]
fn masquerade_details_name_the_rule() {
    let two = vec![
        endpoint("10.180.0.1", 80, true),
        endpoint("10.180.0.2", 80, false),
    ];
    let cluster = state(vec![(web(), two.clone())]);
    let local = state(vec![(lb(true), two.clone())]);
    let detail = |state: &ProxyState, config: &RenderConfig, to: &str, from: Option<&str>| {
        only(&ask(state, config, to, from))
            .masquerade
            .detail
            .clone()
    };
    let cip = |config: &RenderConfig, from: Option<&str>| detail(&cluster, config, CIP, from);
    assert_eq!(
        cip(&config(), Some("10.2.3.4")),
        "the source is in 10.0.0.0/8 (pod traffic): not masqueraded"
    );
    assert_eq!(
        cip(&config(), Some(NODE_IP)),
        "the source is not in 10.0.0.0/8 (not pod traffic): masqueraded"
    );
    assert_eq!(
        cip(&config(), None),
        "masqueraded unless the source is in 10.0.0.0/8 (pod traffic); give --from to decide"
    );
    assert_eq!(
        cip(&RenderConfig::default(), None),
        "no local-traffic detector (e.g. no clusterCIDR): ClusterIP traffic is not masqueraded"
    );
    let all = RenderConfig {
        masquerade_all: true,
        ..config()
    };
    assert_eq!(
        cip(&all, None),
        "masqueradeAll: all ClusterIP traffic is masqueraded"
    );
    let bridge = RenderConfig {
        local_detector: LocalDetector::BridgeInterface("cbr0".into()),
        ..RenderConfig::default()
    };
    assert_eq!(
        cip(&bridge, None),
        "masqueraded unless the packet arrives on bridge cbr0"
    );
    assert_eq!(
        cip(&config(), Some("10.180.0.1")),
        "the source is an endpoint: masqueraded if it is picked for itself (hairpin); \
         otherwise the source is in 10.0.0.0/8 (pod traffic): not masqueraded"
    );
    let single = state(vec![(web(), vec![endpoint("10.180.0.1", 80, true)])]);
    assert_eq!(
        detail(&single, &config(), CIP, Some("10.180.0.1")),
        "the source is the only usable endpoint: the hairpin rule masquerades it"
    );
    assert_eq!(
        detail(&state(vec![(web(), vec![])]), &config(), CIP, None),
        "the packet is not forwarded"
    );
    let external = [
        (
            &state(vec![(lb(false), two)]),
            None,
            "external traffic with externalTrafficPolicy Cluster is always masqueraded",
        ),
        (
            &local,
            Some("10.1.1.1"),
            "externalTrafficPolicy Local, from a local pod: not masqueraded",
        ),
        (
            &local,
            Some(NODE_IP),
            "externalTrafficPolicy Local, from this node: masqueraded",
        ),
        (
            &local,
            Some("8.8.8.8"),
            "externalTrafficPolicy Local from outside: not masqueraded, the client IP is preserved",
        ),
    ];
    for (state, from, expected) in external {
        assert_eq!(detail(state, &config(), EXT_IP, from), expected, "{from:?}");
    }
}

#[test]
fn endpoint_reasons_say_why() {
    let mut svc = lb(true);
    svc.internal_policy_local = true;
    let mixed = state(vec![(
        svc,
        vec![
            terminating("10.180.0.1", true),
            not_ready("10.180.0.2", true),
            endpoint("10.180.0.3", 80, false),
            endpoint("fd00:10::4", 80, true),
        ],
    )]);
    let reasons = |to: &str| -> Vec<String> {
        only(&ask(&mixed, &config(), to, Some("8.8.8.8")))
            .endpoints
            .iter()
            .map(|e| e.reason.clone())
            .collect()
    };
    let fallback = "terminating but still serving; used because no endpoint is ready";
    let not_ready = "not ready (and not serving while terminating)";
    let v6 = "IPv6 endpoint: the destination is IPv4";
    assert_eq!(
        reasons(CIP),
        [
            fallback,
            not_ready,
            "on node other-node: not local, and internalTrafficPolicy is Local",
            v6
        ]
    );
    assert_eq!(
        reasons(EXT_IP),
        [
            fallback,
            not_ready,
            "on node other-node: not local, and externalTrafficPolicy is Local",
            v6
        ]
    );
    let ready = state(vec![(
        web(),
        vec![
            endpoint("10.180.0.1", 80, true),
            terminating("10.180.0.2", true),
        ],
    )]);
    let m = ask(&ready, &config(), CIP, None).matches.remove(0);
    assert_eq!(
        [
            m.endpoints[0].reason.as_str(),
            m.endpoints[1].reason.as_str()
        ],
        [
            "ready",
            "terminating (still serving); not used while a ready endpoint exists"
        ]
    );
}
