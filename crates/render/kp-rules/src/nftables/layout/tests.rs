//! The layout's elements and transactions, from plans to `nft` text.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use kp_core::model::{
    Endpoint, IpFamily, Protocol, ServiceName, ServicePort, ServicePortName, SessionAffinity,
};
use kp_core::tracker::ProxyState;

use super::*;
use crate::config::{LocalDetector, NodePortAddresses};

fn ctx() -> Context {
    Context {
        family: IpFamily::V4,
        masquerading: Masquerading {
            all: false,
            detector: true,
        },
        node_ip: Some(v4(192, 168, 50, 2)),
        localhost_rejects: &[],
    }
}

fn name(service: &str) -> ServicePortName {
    ServicePortName {
        service: ServiceName {
            namespace: "ns".into(),
            name: service.into(),
        },
        port: "".into(),
        protocol: Protocol::Tcp,
    }
}

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn port(service: &str, cluster_ip: IpAddr) -> ServicePort {
    ServicePort {
        name: name(service),
        cluster_ips: vec![cluster_ip],
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

fn endpoint(ip: IpAddr, local: bool) -> Endpoint {
    Endpoint {
        ip,
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        node_name: Some(if local { "node-a" } else { "node-b" }.into()),
        zone: None,
        zone_hints: None,
        node_hints: None,
        is_local: local,
    }
}

fn state_with(services: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    let mut state = ProxyState::default();
    state.node.name = "node-a".into();
    state.node.eligible = true;
    state.node.known = true;
    for (svc, eps) in services {
        state.endpoints.insert(svc.name.clone(), eps);
        state.services.insert(svc.name.clone(), svc);
    }
    state
}

fn texts(elements: &[Element]) -> Vec<String> {
    elements.iter().map(ToString::to_string).collect()
}

fn config() -> FixedConfig {
    FixedConfig {
        family: IpFamily::V4,
        mark: 0x4000,
        random_fully: true,
        detector: LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().expect("literal")]),
        node_port_addresses: NodePortAddresses::All,
        service_cidrs: vec!["10.96.0.0/16".parse().expect("literal")],
        localhost_rejects: &[],
    }
}

/// Install `updates` on `installed` and return the statements that did it.
fn sync(installed: &mut LayoutState, updates: Vec<(ServicePortName, Vec<Element>)>) -> Vec<String> {
    let changes = installed.changes(updates);
    let script = change_script(&config(), &changes);
    installed.apply(changes);
    script
}

#[test]
fn a_clusterip_is_one_element_per_endpoint_and_its_decisions() {
    let eps: Vec<Endpoint> = (1..=3)
        .map(|i| endpoint(v4(10, 244, 0, i), false))
        .collect();
    let state = state_with(vec![(port("web", v4(10, 96, 0, 1)), eps)]);
    let elements = port_elements(&state, &ctx(), &name("web"));
    assert_eq!(
        texts(&elements),
        [
            "slots-3 { 10.96.0.1 . tcp . 80 }",
            "masquerade-not-local { 10.96.0.1 . tcp . 80 }",
            "endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 0 : 10.244.0.1 . 8080 }",
            "endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 1 : 10.244.0.2 . 8080 }",
            "endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 2 : 10.244.0.3 . 8080 }",
            "hairpin { 10.244.0.1 . 10.244.0.1 }",
            "hairpin { 10.244.0.2 . 10.244.0.2 }",
            "hairpin { 10.244.0.3 . 10.244.0.3 }",
            "cluster-ips { 10.96.0.1 }",
        ]
    );
}

#[test]
fn without_endpoints_every_entry_is_rejected() {
    let mut svc = port("web", v4(10, 96, 0, 1));
    svc.node_port = Some(30080);
    svc.external_ips = vec![v4(192, 0, 2, 1)];
    let state = state_with(vec![(svc, Vec::new())]);
    let elements = port_elements(&state, &ctx(), &name("web"));
    assert_eq!(
        texts(&elements),
        [
            "reject-services { 10.96.0.1 . tcp . 80 }",
            "reject-services { 192.0.2.1 . tcp . 80 }",
            "nodeport-reject-services { tcp . 30080 }",
            "cluster-ips { 10.96.0.1 }",
        ]
    );
}

#[test]
fn external_policy_local_short_circuits_to_the_cluster_list() {
    let mut svc = port("web", v4(10, 96, 0, 1));
    svc.load_balancer_ips = vec![v4(192, 0, 2, 1)];
    svc.load_balancer_source_ranges = vec!["198.51.100.0/24".parse().expect("literal")];
    svc.external_policy_local = true;
    svc.session_affinity = Some(SessionAffinity {
        timeout: Duration::from_secs(60),
    });
    let eps = vec![
        endpoint(v4(10, 244, 0, 1), true),
        endpoint(v4(10, 244, 1, 1), false),
    ];
    let state = state_with(vec![(svc, eps)]);
    let elements = port_elements(&state, &ctx(), &name("web"));
    let base = AffinityPort::new(&name("web"), 60).base();
    let lb: Vec<String> = texts(&elements)
        .into_iter()
        .filter(|e| e.contains("192.0.2.1"))
        .collect();
    assert_eq!(
        lb,
        [
            "slots-1 { 192.0.2.1 . tcp . 80 }",
            "short-circuit-slots-2 { 192.0.2.1 . tcp . 80 }",
            "short-circuit { 192.0.2.1 . tcp . 80 }",
            "firewall-entries { 192.0.2.1 . tcp . 80 }",
            "endpoints-1-tcp { 192.0.2.1 . tcp . 80 . 0 : 10.244.0.1 . 8080 }",
            "short-circuit-endpoints-2-tcp { 192.0.2.1 . tcp . 80 . 0 : 10.244.0.1 . 8080 }",
            "short-circuit-endpoints-2-tcp { 192.0.2.1 . tcp . 80 . 1 : 10.244.1.1 . 8080 }",
            "firewall-allow { 192.0.2.1 . tcp . 80 . 198.51.100.0/24 }",
            &format!("{base}-entries {{ 192.0.2.1 . tcp . 80 }}"),
            &format!("{base}-short-circuit-entries {{ 192.0.2.1 . tcp . 80 }}"),
        ]
    );
}

#[test]
fn moving_one_endpoint_rewrites_one_slot_and_its_hairpin() {
    let eps = |first: u8| -> Vec<Endpoint> {
        [first, 2, 3]
            .iter()
            .map(|d| endpoint(v4(10, 244, 0, *d), false))
            .collect()
    };
    let mut state = state_with(vec![
        (port("web", v4(10, 96, 0, 1)), eps(1)),
        (port("db", v4(10, 96, 0, 2)), eps(1)),
    ]);
    let mut installed = LayoutState::default();
    let updates = full_updates(&state, &ctx(), &installed);
    let first = sync(&mut installed, updates);
    assert!(
        first
            .iter()
            .any(|s| s.starts_with("add set ip kube-proxy slots-3 "))
    );
    assert_eq!(installed.classes().len(), 1);

    state.endpoints.insert(name("web"), eps(9));
    let changed = BTreeSet::from([name("web").service]);
    let partial = partial_updates(&state, &ctx(), &installed, &changed);
    assert_eq!(partial.len(), 1, "only the changed service is planned");
    assert_eq!(
        sync(&mut installed, partial),
        [
            "delete element ip kube-proxy endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 0 }",
            "add element ip kube-proxy endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 0 : 10.244.0.9 . 8080 }",
            "add element ip kube-proxy hairpin { 10.244.0.9 . 10.244.0.9 }",
        ],
        "db still claims 10.244.0.1's hairpin element"
    );

    let web = Entry::Ip {
        addr: v4(10, 96, 0, 1),
        proto: Protocol::Tcp,
        port: 80,
    };
    let named: Vec<String> = installed
        .deciding(&web)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        named,
        [
            "slots-3 { 10.96.0.1 . tcp . 80 }",
            "masquerade-not-local { 10.96.0.1 . tcp . 80 }",
            "endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 0 : 10.244.0.9 . 8080 }",
            "endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 1 : 10.244.0.2 . 8080 }",
            "endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 2 : 10.244.0.3 . 8080 }",
            "hairpin { 10.244.0.2 . 10.244.0.2 }",
            "hairpin { 10.244.0.3 . 10.244.0.3 }",
            "hairpin { 10.244.0.9 . 10.244.0.9 }",
        ],
        "explain names what decides a packet to web"
    );

    state.endpoints.remove(&name("db"));
    state.services.remove(&name("db"));
    let changed = BTreeSet::from([name("db").service]);
    let updates = partial_updates(&state, &ctx(), &installed, &changed);
    let gone = sync(&mut installed, updates);
    assert!(
        gone.contains(
            &"delete element ip kube-proxy hairpin { 10.244.0.1 . 10.244.0.1 }".to_owned()
        )
    );
    assert!(
        !gone.iter().any(|s| s.contains("10.244.0.2 . 10.244.0.2")),
        "web still has it"
    );
    assert!(gone.iter().all(|s| s.starts_with("delete element")));
}

#[test]
fn a_new_endpoint_count_brings_its_set_and_rules_once() {
    let eps = |n: u8| -> Vec<Endpoint> {
        (1..=n)
            .map(|d| endpoint(v4(10, 244, 0, d), false))
            .collect()
    };
    let mut state = state_with(vec![(port("web", v4(10, 96, 0, 1)), eps(2))]);
    let mut installed = LayoutState::default();
    let updates = full_updates(&state, &ctx(), &installed);
    sync(&mut installed, updates);
    state.endpoints.insert(name("web"), eps(3));
    let changed = BTreeSet::from([name("web").service]);
    let updates = partial_updates(&state, &ctx(), &installed, &changed);
    let grown = sync(&mut installed, updates);
    assert_eq!(
        grown,
        [
            "delete element ip kube-proxy slots-2 { 10.96.0.1 . tcp . 80 }",
            "delete element ip kube-proxy endpoints-2-tcp { 10.96.0.1 . tcp . 80 . 0 }",
            "delete element ip kube-proxy endpoints-2-tcp { 10.96.0.1 . tcp . 80 . 1 }",
            "add set ip kube-proxy slots-3 { type ipv4_addr . inet_proto . inet_service ; }",
            "add map ip kube-proxy endpoints-3-tcp { typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . tcp dport ; }",
            "add rule ip kube-proxy pick meta l4proto tcp ip daddr . meta l4proto . th dport @slots-3 dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @endpoints-3-tcp",
            "add map ip kube-proxy endpoints-3-udp { typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . udp dport ; }",
            "add rule ip kube-proxy pick meta l4proto udp ip daddr . meta l4proto . th dport @slots-3 dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @endpoints-3-udp",
            "add map ip kube-proxy endpoints-3-sctp { typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . sctp dport ; }",
            "add rule ip kube-proxy pick meta l4proto sctp ip daddr . meta l4proto . th dport @slots-3 dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 3 map @endpoints-3-sctp",
            "add set ip kube-proxy nodeport-slots-3 { type inet_proto . inet_service ; }",
            "add map ip kube-proxy nodeport-endpoints-3-tcp { typeof meta l4proto . th dport . numgen random mod 1 : ip daddr . tcp dport ; }",
            "add rule ip kube-proxy pick meta l4proto tcp fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport @nodeport-slots-3 dnat ip to meta l4proto . th dport . numgen random mod 3 map @nodeport-endpoints-3-tcp",
            "add map ip kube-proxy nodeport-endpoints-3-udp { typeof meta l4proto . th dport . numgen random mod 1 : ip daddr . udp dport ; }",
            "add rule ip kube-proxy pick meta l4proto udp fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport @nodeport-slots-3 dnat ip to meta l4proto . th dport . numgen random mod 3 map @nodeport-endpoints-3-udp",
            "add map ip kube-proxy nodeport-endpoints-3-sctp { typeof meta l4proto . th dport . numgen random mod 1 : ip daddr . sctp dport ; }",
            "add rule ip kube-proxy pick meta l4proto sctp fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport @nodeport-slots-3 dnat ip to meta l4proto . th dport . numgen random mod 3 map @nodeport-endpoints-3-sctp",
            "add element ip kube-proxy slots-3 { 10.96.0.1 . tcp . 80 }",
            "add element ip kube-proxy endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 0 : 10.244.0.1 . 8080 }",
            "add element ip kube-proxy endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 1 : 10.244.0.2 . 8080 }",
            "add element ip kube-proxy endpoints-3-tcp { 10.96.0.1 . tcp . 80 . 2 : 10.244.0.3 . 8080 }",
            "add element ip kube-proxy hairpin { 10.244.0.3 . 10.244.0.3 }",
        ]
    );
    // Back to two: elements only, the class of three stays for the next full sync.
    state.endpoints.insert(name("web"), eps(2));
    let updates = partial_updates(&state, &ctx(), &installed, &changed);
    let shrunk = sync(&mut installed, updates);
    assert!(shrunk.iter().all(|s| s.contains(" element ")), "{shrunk:?}");
}

#[test]
fn the_fixed_part_has_no_per_service_object() {
    let port = AffinityPort::new(&name("web"), 10800);
    let classes = BTreeSet::from([Class::Count(Slots::Policy, 10), Class::Affinity(port)]);
    let script = fixed_part(&config(), &classes);
    let rules = script.iter().filter(|s| s.starts_with("add rule")).count();
    assert!(rules < 70, "{rules} rules");
    assert!(
        script.iter().all(|s| !s.contains("goto")),
        "no verdict map anywhere"
    );
    let b = port.base();
    let record = format!(
        "add rule ip kube-proxy affinity-record meta l4proto tcp ct status dnat ct original ip daddr . meta l4proto . ct original proto-dst @{b}-entries ip daddr . th dport @{b}-endpoints update @{b} {{ ip saddr : ip daddr }} update @{b}-ports {{ ip saddr : th dport }}"
    );
    assert!(script.contains(&record), "{script:#?}");
}

#[test]
fn loopback_in_node_port_addresses_never_accepts_node_ports() {
    let mut config = config();
    config.node_port_addresses = NodePortAddresses::Ips(vec![v4(192, 168, 0, 2), v4(127, 0, 0, 1)]);
    let script = fixed_part(&config, &BTreeSet::new());
    let elements: Vec<&String> = script
        .iter()
        .filter(|s| s.starts_with("add element ip kube-proxy nodeport-ips"))
        .collect();
    assert_eq!(
        elements,
        ["add element ip kube-proxy nodeport-ips { 192.168.0.2 }"],
        "{script:#?}"
    );
}

#[test]
fn source_ranges_holding_the_node_allow_its_own_traffic_to_the_lb_ip() {
    let mut svc = port("web", v4(10, 96, 0, 1));
    svc.load_balancer_ips = vec![v4(192, 0, 2, 1)];
    svc.load_balancer_source_ranges = vec!["192.168.50.0/24".parse().expect("literal")];
    let state = state_with(vec![(svc, vec![endpoint(v4(10, 244, 0, 1), false)])]);
    let allowed: Vec<String> = texts(&port_elements(&state, &ctx(), &name("web")))
        .into_iter()
        .filter(|e| e.starts_with("firewall-allow"))
        .collect();
    assert_eq!(
        allowed,
        [
            "firewall-allow { 192.0.2.1 . tcp . 80 . 192.0.2.1/32 }",
            "firewall-allow { 192.0.2.1 . tcp . 80 . 192.168.50.0/24 }",
        ]
    );
}

#[test]
fn a_state_built_from_ports_equals_one_synced_from_empty() {
    let shared = endpoint(v4(10, 244, 0, 1), true);
    let state = state_with(vec![
        (
            port("a", v4(10, 96, 0, 1)),
            vec![shared.clone(), endpoint(v4(10, 244, 0, 2), false)],
        ),
        (port("b", v4(10, 96, 0, 2)), vec![shared]),
        (port("c", v4(10, 96, 0, 3)), Vec::new()),
    ]);
    let empty = LayoutState::default();
    let updates = full_updates(&state, &ctx(), &empty);
    let mut synced = LayoutState::default();
    let changes = synced.changes(updates.clone());
    synced.apply(changes);
    let built = LayoutState::from_ports(updates);
    assert_eq!(built, synced);
    assert!(built.element_count() > 0);
}

/// Releasing elements moves others in the claim list: every key must still be found.
#[test]
fn removing_ports_in_any_order_leaves_the_state_of_those_left() {
    let services: Vec<_> = (0..12u8)
        .map(|i| {
            let endpoints = (0..=i % 4)
                .map(|e| endpoint(v4(10, 244, 0, i % 5 + e), e == 0))
                .collect();
            (port(&format!("s{i}"), v4(10, 96, 0, i + 1)), endpoints)
        })
        .collect();
    let empty = LayoutState::default();
    let updates = full_updates(&state_with(services), &ctx(), &empty);
    let mut synced = LayoutState::from_ports(updates.clone());
    let (gone, kept): (Vec<_>, Vec<_>) = updates
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 3 != 1);
    for (_, (name, _)) in gone.iter().rev() {
        let changes = synced.changes(vec![(name.clone(), Vec::new())]);
        synced.apply(changes);
    }
    let kept: Vec<_> = kept.into_iter().map(|(_, update)| update).collect();
    let left = LayoutState::from_ports(kept.clone());
    // Classes stay once written, so the states differ there; their elements must not.
    let sorted = |state: &LayoutState| {
        let mut elements: Vec<Element> = state.elements().cloned().collect();
        elements.sort();
        elements
    };
    assert!(left.element_count() > 0);
    assert_eq!(sorted(&synced), sorted(&left));
    for repair in [
        synced.repair(left.elements().cloned()),
        left.repair(synced.elements().cloned()),
    ] {
        assert!(repair.delete.is_empty() && repair.add.is_empty());
    }
    // Each claim was counted once: releasing the ports left empties the state.
    for (name, _) in kept {
        let changes = synced.changes(vec![(name, Vec::new())]);
        synced.apply(changes);
    }
    assert_eq!(synced.element_count(), 0);
    assert_eq!(synced.elements().count(), 0);
}

/// A service port with ClientIP affinity on a ClusterIP, an externalIP and a NodePort.
fn affinity_port(external_local: bool, internal_local: bool) -> ServicePort {
    let mut svc = port("web", v4(10, 96, 0, 1));
    svc.external_ips = vec![v4(192, 0, 2, 1)];
    svc.node_port = Some(30080);
    svc.external_policy_local = external_local;
    svc.internal_policy_local = internal_local;
    svc.session_affinity = Some(SessionAffinity {
        timeout: Duration::from_secs(60),
    });
    svc
}

/// The affinity elements of `svc` with a local and a remote endpoint.
fn affinity_texts(svc: ServicePort) -> Vec<String> {
    let eps = vec![
        endpoint(v4(10, 244, 0, 1), true),
        endpoint(v4(10, 244, 1, 1), false),
    ];
    let base = AffinityPort::new(&svc.name, 60).base();
    let state = state_with(vec![(svc, eps)]);
    texts(&port_elements(&state, &ctx(), &name("web")))
        .into_iter()
        .filter(|e| e.contains(&base))
        .map(|e| e.replace(&base, "A"))
        .collect()
}

#[test]
fn affinity_pins_a_client_across_every_address_of_the_port() {
    assert_eq!(
        affinity_texts(affinity_port(false, false)),
        [
            "A-entries { 10.96.0.1 . tcp . 80 }",
            "A-entries { 192.0.2.1 . tcp . 80 }",
            "nodeport-A-entries { tcp . 30080 }",
            "A-cluster-entries { 10.96.0.1 . tcp . 80 }",
            "A-cluster-entries { 192.0.2.1 . tcp . 80 }",
            "nodeport-A-cluster-entries { tcp . 30080 }",
            "A-endpoints { 10.244.0.1 . 8080 }",
            "A-endpoints { 10.244.1.1 . 8080 }",
        ]
    );
}

#[test]
fn affinity_reads_the_pins_of_the_list_each_path_uses() {
    // externalTrafficPolicy Local: the ClusterIP reads the cluster pins, the external
    // entries by source (both lists' endpoints are candidates).
    assert_eq!(
        affinity_texts(affinity_port(true, false)),
        [
            "A-entries { 10.96.0.1 . tcp . 80 }",
            "A-entries { 192.0.2.1 . tcp . 80 }",
            "nodeport-A-entries { tcp . 30080 }",
            "A-cluster-entries { 10.96.0.1 . tcp . 80 }",
            "A-short-circuit-entries { 192.0.2.1 . tcp . 80 }",
            "nodeport-A-short-circuit-entries { tcp . 30080 }",
            "A-endpoints { 10.244.0.1 . 8080 }",
            "A-endpoints { 10.244.1.1 . 8080 }",
            "A-local-endpoints { 10.244.0.1 . 8080 }",
        ]
    );
    // internalTrafficPolicy Local: the ClusterIP reads the local pins only.
    let internal = affinity_texts(affinity_port(false, true));
    assert!(internal.contains(&"A-local-entries { 10.96.0.1 . tcp . 80 }".to_owned()));
    assert!(internal.contains(&"A-local-endpoints { 10.244.0.1 . 8080 }".to_owned()));
    assert!(!internal.contains(&"A-cluster-entries { 10.96.0.1 . tcp . 80 }".to_owned()));
}

#[test]
fn affinity_ports_differ_by_name_protocol_and_timeout() {
    let web = AffinityPort::new(&name("web"), 60);
    assert_eq!(web, AffinityPort::new(&name("web"), 60));
    assert_ne!(web, AffinityPort::new(&name("web"), 61));
    assert_ne!(web, AffinityPort::new(&name("db"), 60));
    let mut udp = name("web");
    udp.protocol = Protocol::Udp;
    assert_ne!(web, AffinityPort::new(&udp, 60));
    assert!(web.base().starts_with("affinity-tcp-60-"), "{}", web.base());
}

#[test]
fn affinity_set_and_map_names_read_back_to_their_port() {
    let svc = affinity_port(true, false);
    let eps = vec![endpoint(v4(10, 244, 0, 1), true)];
    let state = state_with(vec![(svc, eps)]);
    let elements = port_elements(&state, &ctx(), &name("web"));
    let port = AffinityPort::new(&name("web"), 60);
    for element in elements.iter().filter(|e| {
        matches!(
            e,
            Element::AffinityEntry(..) | Element::AffinityEndpoint(..)
        )
    }) {
        let set = element.set_name();
        assert_eq!(SetOf::parse(&set), Some(element.set_of()), "{set}");
        assert_eq!(Class::of_set_name(&set), Some(Class::Affinity(port)));
        assert!(fixed::is_own_set(&set), "{set}");
    }
    for (_, addrs, ports) in fixed::affinity_maps(port) {
        assert_eq!(AffinityPort::of_map(&addrs), Some(port), "{addrs}");
        assert_eq!(AffinityPort::of_map(&ports), Some(port), "{ports}");
        assert!(fixed::is_own_set(&addrs) && fixed::is_own_set(&ports));
    }
    let base = port.base();
    for foreign in [
        format!("{base}-other"),
        format!("nodeport-{base}-endpoints"),
        base.replace("tcp", "icmp"),
        base.to_uppercase(),
    ] {
        assert_eq!(SetOf::parse(&foreign), None, "{foreign}");
        assert_eq!(AffinityPort::of_map(&foreign), None, "{foreign}");
    }
    // The per-timeout sets of the earlier layout are a class of their own, deleted.
    assert_eq!(
        Class::of_set_name("nodeport-affinity-services-60"),
        Some(Class::LegacyAffinity(60))
    );
    let deleted = delete_classes_script(&config(), &BTreeSet::from([Class::LegacyAffinity(60)]));
    assert!(deleted.contains(&"delete map ip kube-proxy affinity-60-tcp".to_owned()));
    assert!(deleted.contains(&"delete set ip kube-proxy affinity-services-60".to_owned()));
}

#[test]
fn an_affinity_port_s_rules_read_both_maps_and_record_into_each_list() {
    let port = AffinityPort::new(&name("web"), 60);
    let part = fixed::class_part(&config(), Class::Affinity(port));
    let b = port.base();
    let rules: Vec<String> = part
        .iter()
        .filter(|s| s.starts_with("add rule"))
        .map(|s| s.replace(&b, "A"))
        .collect();
    assert!(rules.contains(&"add rule ip kube-proxy affinity meta l4proto tcp ip daddr . meta l4proto . th dport @A-cluster-entries dnat ip to ip saddr map @A : ip saddr map @A-ports".to_owned()), "{rules:#?}");
    assert!(rules.contains(&"add rule ip kube-proxy affinity meta l4proto tcp fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport @nodeport-A-short-circuit-entries dnat ip to ip saddr map @A-local : ip saddr map @A-local-ports".to_owned()), "{rules:#?}");
    assert!(rules.contains(&"add rule ip kube-proxy affinity-record meta l4proto tcp ct status dnat meta l4proto . ct original proto-dst @nodeport-A-entries ip daddr . th dport @A-local-endpoints update @A-local { ip saddr : ip daddr } update @A-local-ports { ip saddr : th dport }".to_owned()), "{rules:#?}");
    // Short-circuited sources read the cluster pins before the others read the local ones.
    let short: Vec<&String> = rules
        .iter()
        .filter(|r| r.contains(" @A-short-circuit-entries "))
        .collect();
    assert!(short.len() >= 2 && short[0].contains("fib saddr type local"));
    assert!(short.last().is_some_and(|r| r.ends_with("@A-local-ports")));
    let deleted = delete_classes_script(&config(), &BTreeSet::from([Class::Affinity(port)]));
    let declared = part
        .iter()
        .filter(|s| s.starts_with("add set") || s.starts_with("add map"))
        .count();
    assert_eq!(
        deleted.len(),
        declared,
        "every set and map deleted: {deleted:#?}"
    );
}

/// Upstream #132456 in this layout: the no-endpoint reject/drop (`entry-filter`,
/// `nodeport-filter`) and the ClusterIP checks run at filter priority 0, after `dispatch`'s
/// DNAT (-100), from the hooks the chain layout uses; the source-range firewall before it.
#[test]
fn no_endpoint_filters_run_at_filter_priority_after_dnat() {
    use crate::nftables::tests::{base_chain_jumps, filters_after_dnat};
    let script = fixed_part(&config(), &BTreeSet::new()).join("\n");
    let names = [
        fixed::NODEPORT_FILTER,
        fixed::ENTRY_FILTER,
        fixed::CLUSTER_IP_FILTER,
        fixed::FIREWALL,
        fixed::DISPATCH,
    ];
    assert_eq!(base_chain_jumps(&script, &names), filters_after_dnat(names));
}

#[test]
fn each_class_has_its_own_endpoints_maps_and_the_shared_ones_of_before_are_ours() {
    use super::element::{SetOf, is_shared_slot_map};
    for name in [
        "endpoints-3-tcp",
        "nodeport-endpoints-1-udp",
        "short-circuit-endpoints-12-sctp",
        "nodeport-short-circuit-endpoints-2-tcp",
    ] {
        let set = SetOf::parse(name).unwrap_or_else(|| panic!("{name} parses"));
        assert!(matches!(set, SetOf::Slots(..)), "{name}: {set:?}");
        assert!(!is_shared_slot_map(name), "{name}");
        assert!(fixed::is_own_set(name), "{name}");
    }
    let SetOf::Slots(slots, count, node_port, proto) =
        SetOf::parse("nodeport-short-circuit-endpoints-12-udp").expect("parses")
    else {
        panic!("a slots map");
    };
    assert_eq!(
        (slots, count, node_port, proto),
        (Slots::ShortCircuit, 12, true, Protocol::Udp)
    );
    assert_eq!(
        Class::of_set_name("endpoints-7-tcp"),
        Some(Class::Count(Slots::Policy, 7))
    );
    for not_ours in ["endpoints-03-tcp", "endpoints-3-icmp", "endpoints--tcp"] {
        assert_eq!(SetOf::parse(not_ours), None, "{not_ours}");
    }
    // The layout's earlier maps, one per list and protocol for every class.
    for shared in ["endpoints-tcp", "nodeport-short-circuit-endpoints-sctp"] {
        assert!(is_shared_slot_map(shared), "{shared}");
        assert_eq!(SetOf::parse(shared), None, "{shared}");
        assert!(fixed::is_own_set(shared), "{shared}");
    }
}

/// KEP-6032: a NodePort of a rejected protocol is an element of `nodeport-localhost-reject`
/// (the set the fixed part's counted reject rules look up); the layout's set parser knows it.
#[test]
fn localhost_rejects_are_elements_and_counted_rules() {
    let mut svc = port("web", v4(10, 96, 0, 1));
    svc.node_port = Some(30080);
    let state = state_with(vec![(svc, vec![endpoint(v4(10, 244, 0, 1), true)])]);
    let rejecting = Context {
        localhost_rejects: &[Protocol::Tcp, Protocol::Udp],
        ..ctx()
    };
    let with = texts(&port_elements(&state, &rejecting, &name("web")));
    assert!(
        with.contains(&"nodeport-localhost-reject { tcp . 30080 }".to_owned()),
        "{with:?}"
    );
    let without = texts(&port_elements(&state, &ctx(), &name("web")));
    assert!(
        !without.iter().any(|e| e.contains("localhost")),
        "{without:?}"
    );
    assert_eq!(
        SetOf::parse("nodeport-localhost-reject"),
        Some(SetOf::Entries(EntrySet::LocalhostReject, true))
    );
    assert_eq!(SetOf::parse("localhost-reject"), None);
    // The chain layout's set of the same name and type: a switch to it keeps it.
    assert_eq!(
        super::element::entry_set_name(EntrySet::LocalhostReject, true),
        crate::nftables::NODEPORT_LOCALHOST_REJECT
    );
    assert!(!fixed::is_own_set(
        crate::nftables::NODEPORT_LOCALHOST_REJECT
    ));

    let fixed = |rejects| {
        let config = FixedConfig {
            localhost_rejects: rejects,
            ..config()
        };
        fixed_part(&config, &Default::default()).join("\n")
    };
    let on = fixed(&[Protocol::Udp, Protocol::Sctp]);
    assert!(on.contains("add rule ip kube-proxy filter-input ip daddr 127.0.0.0/8 meta l4proto udp meta l4proto . th dport @nodeport-localhost-reject counter name localhost-nodeport-rejected-udp reject"), "{on}");
    assert!(
        on.contains("delete counter ip kube-proxy localhost-nodeport-rejected-tcp"),
        "{on}"
    );
    let off = fixed(&[]);
    assert!(!off.contains("counter name"), "{off}");
    assert_eq!(off.matches("delete counter").count(), 3, "{off}");
}
