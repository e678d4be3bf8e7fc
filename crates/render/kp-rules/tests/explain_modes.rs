//! `kp_rules::explain::dataplane`: the nftables, IPVS and userspace objects named for a
//! ClusterIP, a NodePort and a service without endpoints, checked against each mode's own
//! naming functions and rendered output.

use crate::common;

use common::*;
use kp_core::model::{Endpoint, IpFamily, ServicePort};
use kp_core::tracker::ProxyState;
use kp_rules::explain::dataplane::{DataplaneObject, Mode, annotate};
use kp_rules::explain::{Explanation, Query, ServiceMatch, explain};
use kp_rules::ipvs::IpvsConfig;
use kp_rules::nftables::names::{EndpointNames, ServiceChains};
use kp_rules::userspace::{
    CaptureChains, KUBE_USERSPACE, KUBE_USERSPACE_FILTER, KUBE_USERSPACE_NODEPORTS,
};

const CIP: &str = "172.30.0.41";
const NODE_IP: &str = "192.168.0.2";

fn web() -> ServicePort {
    let mut svc = cluster_ip("ns1", "web", "p80", CIP, 80);
    svc.node_port = Some(30080);
    svc
}

fn terminating(address: &str) -> Endpoint {
    Endpoint {
        ready: false,
        serving: true,
        terminating: true,
        ..endpoint(address, 80, false)
    }
}

fn two_endpoints() -> ProxyState {
    state(vec![(
        web(),
        vec![
            endpoint("10.180.0.1", 80, true),
            endpoint("10.180.0.2", 80, false),
            terminating("10.180.0.3"),
        ],
    )])
}

fn ipvs_config() -> IpvsConfig {
    IpvsConfig {
        node_ips: vec![ip(NODE_IP)],
        ..IpvsConfig::default()
    }
}

fn ask(state: &ProxyState, to: &str, mode: &Mode<'_>) -> ServiceMatch {
    let mut e: Explanation = explain(
        state,
        &config(),
        &Query {
            destination: to.parse().expect("destination"),
            source: None,
        },
    )
    .expect("explainable");
    annotate(&mut e, state, &config(), mode).expect("renders");
    assert_eq!(e.matches.len(), 1, "{e:#?}");
    e.matches.remove(0)
}

fn objects(m: &ServiceMatch) -> Vec<(&'static str, String, String)> {
    m.dataplane
        .as_ref()
        .expect("annotated")
        .objects
        .iter()
        .map(|DataplaneObject { kind, name, detail }| (*kind, name.clone(), detail.clone()))
        .collect()
}

fn names_of(m: &ServiceMatch, kind: &str) -> Vec<String> {
    objects(m)
        .into_iter()
        .filter(|(k, _, _)| *k == kind)
        .map(|(_, n, _)| n)
        .collect()
}

/// The map elements named: (map { key }, verdict).
fn map_elements(m: &ServiceMatch) -> Vec<(String, String)> {
    objects(m)
        .into_iter()
        .filter(|(k, _, _)| *k == "map element")
        .map(|(_, n, d)| (n, d))
        .collect()
}

/// The nft script a full sync of `state` writes.
fn nft_script(state: &ProxyState) -> String {
    kp_rules::nftables::render_full(state, IpFamily::V4, &config())
        .expect("renders")
        .0
        .script()
}

#[test]
fn nftables_cluster_ip() {
    let state = two_endpoints();
    let m = ask(&state, "172.30.0.41:80", &Mode::Nftables);
    let chains = ServiceChains::new(&web().name);
    let ep1 = EndpointNames::new(&web().name, ip("10.180.0.1"), 80).chain;
    let ep2 = EndpointNames::new(&web().name, ip("10.180.0.2"), 80).chain;
    assert_eq!(m.dataplane.as_ref().map(|d| d.mode), Some("nftables"));
    assert_eq!(names_of(&m, "table"), vec!["ip kube-proxy"]);
    let elements = map_elements(&m);
    assert_eq!(
        elements,
        vec![(
            "service-ips { 172.30.0.41 . tcp . 80 }".to_owned(),
            format!("goto {}", chains.service)
        )]
    );
    let chain_names = names_of(&m, "chain");
    assert!(chain_names.contains(&chains.service), "{chain_names:?}");
    // Only the used endpoints' chains, never the terminating one's.
    let terminating = EndpointNames::new(&web().name, ip("10.180.0.3"), 80).chain;
    assert!(chain_names.contains(&ep1) && chain_names.contains(&ep2));
    assert!(!chain_names.contains(&terminating));
    // Every named chain is one the renderer writes.
    let script = nft_script(&state);
    for chain in &chain_names {
        assert!(
            script.contains(&format!("add chain ip kube-proxy {chain}")),
            "{chain}"
        );
    }
}

#[test]
fn nftables_node_port() {
    let state = two_endpoints();
    let m = ask(&state, "192.168.0.2:30080", &Mode::Nftables);
    let chains = ServiceChains::new(&web().name);
    let elements = map_elements(&m);
    assert_eq!(
        elements,
        vec![(
            "service-nodeports { tcp . 30080 }".to_owned(),
            format!("goto {}", chains.external)
        )]
    );
    assert!(names_of(&m, "chain").contains(&chains.external));
}

#[test]
fn nftables_no_endpoints_is_rejected() {
    let state = state(vec![(web(), vec![])]);
    let m = ask(&state, "172.30.0.41:80", &Mode::Nftables);
    let elements = map_elements(&m);
    assert_eq!(
        elements,
        vec![(
            "no-endpoint-services { 172.30.0.41 . tcp . 80 }".to_owned(),
            format!("goto {}", kp_rules::nftables::REJECT_CHAIN)
        )]
    );
    assert!(
        names_of(&m, "chain")
            .iter()
            .all(|c| !c.starts_with(kp_rules::nftables::names::ENDPOINT_PREFIX))
    );
}

#[test]
fn ipvs_cluster_ip_with_weights_and_ipset() {
    let config = ipvs_config();
    let m = ask(&two_endpoints(), "172.30.0.41:80", &Mode::Ipvs(&config));
    assert_eq!(
        names_of(&m, "virtual server"),
        vec!["TCP 172.30.0.41:80 rr"]
    );
    assert_eq!(
        names_of(&m, "real server"),
        vec![
            "10.180.0.1:80 weight 1",
            "10.180.0.2:80 weight 1",
            "10.180.0.3:80 weight 0"
        ]
    );
    assert_eq!(names_of(&m, "ipset"), vec!["KUBE-CLUSTER-IP"]);
}

#[test]
fn ipvs_node_port_and_affinity() {
    let config = ipvs_config();
    let state = state(vec![(
        with_affinity(web(), 600),
        vec![endpoint("10.180.0.1", 80, true)],
    )]);
    let m = ask(&state, "192.168.0.2:30080", &Mode::Ipvs(&config));
    assert_eq!(
        names_of(&m, "virtual server"),
        vec!["TCP 192.168.0.2:30080 rr persistent 600"]
    );
    assert_eq!(names_of(&m, "ipset"), vec!["KUBE-NODE-PORT-TCP"]);
}

#[test]
fn ipvs_no_endpoints_has_no_real_servers() {
    let config = ipvs_config();
    let state = state(vec![(web(), vec![])]);
    let m = ask(&state, "172.30.0.41:80", &Mode::Ipvs(&config));
    assert_eq!(
        names_of(&m, "virtual server"),
        vec!["TCP 172.30.0.41:80 rr"]
    );
    assert!(names_of(&m, "real server").is_empty());
}

#[test]
fn userspace_capture_chains() {
    let chains = CaptureChains::new(&web().name);
    let state = two_endpoints();
    let m = ask(&state, "172.30.0.41:80", &Mode::Userspace);
    assert_eq!(
        names_of(&m, "chain"),
        vec![KUBE_USERSPACE.to_owned(), chains.internal]
    );
    let m = ask(&state, "192.168.0.2:30080", &Mode::Userspace);
    assert_eq!(
        names_of(&m, "chain"),
        vec![KUBE_USERSPACE_NODEPORTS.to_owned(), chains.external.clone()]
    );
    // Without endpoints the filter table refuses the packet; nothing is captured.
    let m = ask(&state_with_none(), "172.30.0.41:80", &Mode::Userspace);
    assert_eq!(
        objects(&m),
        vec![(
            "chain",
            KUBE_USERSPACE_FILTER.to_owned(),
            "filter: REJECT (no endpoints)".to_owned()
        )]
    );
}

/// The node's own traffic to an externalIP of an eTP Local service goes through the
/// ClusterIP's chain (not only when asked from the node), and affinity is explained as the
/// relay keeps it: one table per service port.
#[test]
fn userspace_node_traffic_and_affinity() {
    let mut svc = web();
    svc.external_ips = vec![ip("192.168.99.41")];
    svc.external_policy_local = true;
    svc.session_affinity = Some(kp_core::model::SessionAffinity {
        timeout: std::time::Duration::from_secs(300),
    });
    let chains = CaptureChains::new(&svc.name);
    let state = state(vec![(svc, vec![endpoint("10.180.0.1", 80, false)])]);
    let from = |source: Option<&str>| {
        let mut e = explain(
            &state,
            &config(),
            &Query {
                destination: "192.168.99.41:80".parse().expect("destination"),
                source: source.map(ip),
            },
        )
        .expect("explainable");
        annotate(&mut e, &state, &config(), &Mode::Userspace).expect("renders");
        e.matches.remove(0)
    };
    let m = from(Some(NODE_IP));
    assert_eq!(
        names_of(&m, "chain"),
        vec![
            KUBE_USERSPACE.to_owned(),
            chains.external.clone(),
            chains.internal.clone()
        ]
    );
    let affinity = objects(&m)
        .into_iter()
        .find(|(kind, _, _)| *kind == "affinity")
        .expect("an affinity object");
    assert!(
        affinity.2.contains("300s") && affinity.2.contains("per client IP for this service port"),
        "{affinity:?}"
    );
    // From outside: no local endpoint, dropped in filter.
    let m = from(Some("203.0.113.9"));
    assert_eq!(
        names_of(&m, "chain"),
        vec![KUBE_USERSPACE_FILTER.to_owned()]
    );
}

fn state_with_none() -> ProxyState {
    state(vec![(web(), vec![])])
}

#[test]
fn iptables_explanations_carry_no_dataplane() {
    let e = explain(
        &two_endpoints(),
        &config(),
        &Query {
            destination: "172.30.0.41:80".parse().expect("destination"),
            source: None,
        },
    )
    .expect("explainable");
    assert!(e.matches.iter().all(|m| m.dataplane.is_none()));
    let json = serde_json::to_value(&e).expect("json");
    assert!(json["matches"][0].get("dataplane").is_none());
}

#[test]
fn nftables_load_balancer_firewall() {
    let mut svc = web();
    svc.load_balancer_ips = vec![ip("203.0.113.10")];
    svc.load_balancer_source_ranges = vec![net("203.0.113.0/24")];
    let state = state(vec![(svc.clone(), vec![endpoint("10.180.0.1", 80, true)])]);
    let m = ask(&state, "203.0.113.10:80", &Mode::Nftables);
    let chains = ServiceChains::new(&svc.name);
    assert_eq!(
        map_elements(&m),
        vec![
            (
                "firewall-ips { 203.0.113.10 . tcp . 80 }".to_owned(),
                format!("goto {}", chains.firewall)
            ),
            (
                "service-ips { 203.0.113.10 . tcp . 80 }".to_owned(),
                format!("goto {}", chains.external)
            ),
        ]
    );
    assert!(names_of(&m, "chain").contains(&chains.firewall));
}

#[test]
fn ipvs_says_when_it_has_no_virtual_server() {
    // iptables mode accepts NodePorts on 127.0.0.1; ipvs mode plans none there.
    let config = ipvs_config();
    let m = ask(&two_endpoints(), "127.0.0.1:30080", &Mode::Ipvs(&config));
    assert_eq!(names_of(&m, "virtual server"), vec!["none"]);
    assert!(names_of(&m, "real server").is_empty());
}

#[test]
fn nftables_maps_names_the_elements_that_decide_the_packet() {
    let state = two_endpoints();
    let m = ask(&state, &format!("{CIP}:80"), &Mode::NftablesMaps);
    let found = objects(&m);
    let has = |kind: &str, name: &str| found.iter().any(|(k, n, _)| *k == kind && n == name);
    assert!(has("table", "ip kube-proxy"), "{found:#?}");
    // Both serving, ready endpoints are slots; the terminating one is not used.
    let slots: Vec<&(&str, String, String)> = found
        .iter()
        .filter(|(k, n, _)| *k == "map element" && n.starts_with("endpoints-2-tcp {"))
        .collect();
    assert_eq!(slots.len(), 2, "{found:#?}");
    assert!(
        slots
            .iter()
            .any(|(_, _, d)| d == "slot 0: DNAT to 10.180.0.1:80"),
        "{slots:#?}"
    );
    assert!(
        has("set element", &format!("slots-2 {{ {CIP} . tcp . 80 }}")),
        "{found:#?}"
    );
    assert!(
        !found.iter().any(|(_, n, _)| n.contains("10.180.0.3")),
        "{found:#?}"
    );
    // The NodePort entry is keyed by protocol and port only.
    let m = ask(&state, &format!("{NODE_IP}:30080"), &Mode::NftablesMaps);
    let found = objects(&m);
    assert!(
        found
            .iter()
            .any(|(k, n, _)| *k == "set element" && n == "nodeport-slots-2 { tcp . 30080 }"),
        "{found:#?}"
    );
}
