//! `kp_rules::explain::localhost`: what nftables mode does with a connection to a loopback
//! NodePort (KEP-6032): the listener and its endpoints (the listeners' own answer), the table's
//! reject with its counter, no listener, or nothing at all with the gate off.

use crate::common;

use common::*;
use kp_core::model::{IpFamily, Protocol, ServicePort};
use kp_core::tracker::ProxyState;
use kp_rules::config::LocalhostNodePortRejects;
use kp_rules::explain::Destination;
use kp_rules::explain::localhost::{LocalhostVerdict, explain_localhost};
use kp_rules::iptables::RenderConfig;

fn node_port_service(name: &str, protocol: Protocol, node_port: u16) -> ServicePort {
    let mut svc = cluster_ip("ns1", name, "p80", "172.30.0.41", 80);
    svc.name.protocol = protocol;
    svc.node_port = Some(node_port);
    svc
}

fn state_of() -> ProxyState {
    let endpoints = vec![
        endpoint("10.180.0.1", 8080, true),
        endpoint("10.180.0.2", 8080, false),
    ];
    state(vec![
        (
            node_port_service("tcp", Protocol::Tcp, 30080),
            endpoints.clone(),
        ),
        (node_port_service("udp", Protocol::Udp, 30081), endpoints),
        (node_port_service("empty", Protocol::Tcp, 30082), Vec::new()),
    ])
}

/// The gate `enabled`, listeners in `served` (either layout: both reject).
fn config(enabled: bool, served: &[IpFamily]) -> RenderConfig {
    RenderConfig {
        nftables_localhost_rejects: LocalhostNodePortRejects {
            enabled,
            served: served.to_vec(),
        },
        ..RenderConfig::default()
    }
}

fn verdicts(config: &RenderConfig, to: &str) -> Vec<(String, LocalhostVerdict)> {
    let dest: Destination = to.parse().expect("test destination");
    explain_localhost(&state_of(), config, &dest)
        .into_iter()
        .map(|p| (p.service_port, p.verdict))
        .collect()
}

fn one(config: &RenderConfig, to: &str) -> LocalhostVerdict {
    let mut found = verdicts(config, to);
    assert_eq!(found.len(), 1, "{to}: {found:?}");
    found.remove(0).1
}

#[test]
fn the_listener_serves_tcp_with_the_listeners_endpoints() {
    let served = config(true, &[IpFamily::V4]);
    let LocalhostVerdict::Listener { endpoints } = one(&served, "127.0.0.1:30080") else {
        panic!("a listener");
    };
    let got: Vec<String> = endpoints.iter().map(ToString::to_string).collect();
    assert_eq!(got, ["10.180.0.1:8080", "10.180.0.2:8080"]);
    // The listener's own answer, which the listeners of kp-userspace relay to.
    let state = state_of();
    let svc = state
        .services
        .values()
        .find(|s| s.node_port == Some(30080))
        .expect("tcp service");
    assert_eq!(
        endpoints,
        kp_rules::plan::localhost_listener_endpoints(svc, &state, IpFamily::V4)
    );
    // No endpoint: no listener; another loopback address: not the listener's.
    assert_eq!(
        one(&served, "127.0.0.1:30082"),
        LocalhostVerdict::NoListener
    );
    assert_eq!(
        one(&served, "127.0.0.2:30080"),
        LocalhostVerdict::NoListener
    );
}

#[test]
fn the_table_rejects_what_no_listener_serves() {
    let served = config(true, &[IpFamily::V4]);
    assert_eq!(
        one(&served, "127.0.0.1:30081/udp"),
        LocalhostVerdict::Rejected {
            counter: "localhost-nodeport-rejected-udp"
        }
    );
    // Gate on, but loopback not named explicitly: TCP is rejected too.
    let unserved = config(true, &[]);
    assert_eq!(
        one(&unserved, "127.0.0.1:30080"),
        LocalhostVerdict::Rejected {
            counter: "localhost-nodeport-rejected-tcp"
        }
    );
}

#[test]
fn gate_off_leaves_loopback_alone() {
    let off = config(false, &[]);
    assert_eq!(one(&off, "127.0.0.1:30080"), LocalhostVerdict::Untouched);
    assert_eq!(
        one(&off, "127.0.0.1:30081/udp"),
        LocalhostVerdict::Untouched
    );
}

#[test]
fn only_loopback_and_the_ports_protocol_and_family_are_answered() {
    let served = config(true, &[IpFamily::V4]);
    assert!(verdicts(&served, "192.168.0.2:30080").is_empty());
    assert!(
        verdicts(&served, "127.0.0.1:30081").is_empty(),
        "UDP port, TCP asked"
    );
    assert!(verdicts(&served, "127.0.0.1:31000").is_empty());
    // The services are IPv4 only.
    assert!(verdicts(&served, "[::1]:30080").is_empty());
    // Without a port: every TCP NodePort.
    let all: Vec<String> = verdicts(&served, "127.0.0.1")
        .into_iter()
        .map(|(port, _)| port)
        .collect();
    assert_eq!(all, ["ns1/empty:p80", "ns1/tcp:p80"]);
}
