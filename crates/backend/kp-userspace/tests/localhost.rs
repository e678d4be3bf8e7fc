//! nftables mode's localhost NodePort listeners (KEP-6032) on this host's loopback: a TCP
//! NodePort with endpoints gets a listener on 127.0.0.1 that carries real connections to its
//! endpoints and follows their changes; UDP and endpoint-less ports get none; a port another
//! program holds is counted as a creation failure without stopping the rest; the metrics
//! carry upstream's names.

use crate::support;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use kp_core::model::{Endpoint, Protocol, ServicePort, ServicePortName};
use kp_core::testutil::{cluster_ip_port, node_with, port_name, state_on};
use kp_core::tracker::ProxyState;
use kp_userspace::localhost::FamilyLabel;
use kp_userspace::{LocalhostMetrics, LocalhostNodePorts, RelayConfig, RelayMetrics};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::net::TcpStream;

use support::{free_port, greeter};

const LOOPBACK: &str = "127.0.0.1";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("literal address")
}

/// Who answers a connection to 127.0.0.1:`port`; `None` when it is refused.
async fn greeted_by(port: u16) -> Option<String> {
    let stream = TcpStream::connect(SocketAddr::new(ip(LOOPBACK), port))
        .await
        .ok()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).await.ok()?;
    Some(line.trim().to_owned())
}

/// Who answers `n` connections.
async fn answers(port: u16, n: usize) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for _ in 0..n {
        seen.insert(greeted_by(port).await.unwrap_or_else(|| "refused".into()));
    }
    seen
}

fn node_port(svc: &str, protocol: Protocol, port: u16) -> ServicePort {
    let name: ServicePortName = port_name("ns", svc, "p", protocol);
    let mut service = cluster_ip_port(name, "10.96.0.10", 80);
    service.node_port = Some(port);
    service
}

fn state(items: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    state_on(node_with(&["192.168.0.2"]), items)
}

/// Listeners on 127.0.0.1, their metrics and the registry holding those.
fn listeners() -> (LocalhostNodePorts, LocalhostMetrics, Registry) {
    let mut registry = Registry::default();
    let metrics = LocalhostMetrics::register(&mut registry);
    let listeners = LocalhostNodePorts::new(
        RelayConfig::default(),
        RelayMetrics::default(),
        metrics.clone(),
        vec![ip(LOOPBACK)],
    );
    (listeners, metrics, registry)
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

#[tokio::test]
async fn listeners_follow_services_and_endpoints() {
    let (a, b) = (greeter("a").await, greeter("b").await);
    let (mut listeners, metrics, _registry) = listeners();
    let (web_port, dns_port, empty_port) = (free_port(), free_port(), free_port());
    let web = node_port("web", Protocol::Tcp, web_port);
    let dns = node_port("dns", Protocol::Udp, dns_port);
    let empty = node_port("empty", Protocol::Tcp, empty_port);
    let open = listeners.sync(&state(vec![
        (web.clone(), vec![a.clone(), b.clone()]),
        (dns.clone(), vec![a.clone()]),
        (empty.clone(), vec![]),
    ]));
    assert_eq!(open, 1, "only the TCP NodePort with endpoints");
    assert_eq!(answers(web_port, 8).await, set(&["a", "b"]));
    assert_eq!(greeted_by(empty_port).await, None);
    let v4 = FamilyLabel { ip_family: "IPv4" };
    assert_eq!(metrics.listeners.get_or_create(&v4).get(), 1);

    // An endpoint goes: new connections reach the one left.
    listeners.sync(&state(vec![(web.clone(), vec![b.clone()])]));
    assert_eq!(answers(web_port, 4).await, set(&["b"]));

    // No endpoints: the listener closes and the port refuses; back with them, it opens.
    listeners.sync(&state(vec![(web.clone(), vec![])]));
    assert_eq!(greeted_by(web_port).await, None);
    assert_eq!(metrics.listeners.get_or_create(&v4).get(), 0);
    listeners.sync(&state(vec![(web.clone(), vec![a.clone()])]));
    assert_eq!(answers(web_port, 2).await, set(&["a"]));

    // The Service goes: so does its listener.
    assert_eq!(listeners.sync(&state(vec![])), 0);
    assert_eq!(greeted_by(web_port).await, None);
}

#[tokio::test]
async fn a_taken_port_is_counted_and_the_rest_go_on() {
    let a = greeter("a").await;
    let (mut listeners, metrics, registry) = listeners();
    // Another program holds the port first.
    let squatter = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = squatter.local_addr().expect("address").port();
    let fine = free_port();
    let state = state(vec![
        (node_port("taken", Protocol::Tcp, taken), vec![a.clone()]),
        (node_port("fine", Protocol::Tcp, fine), vec![a.clone()]),
    ]);
    assert_eq!(listeners.sync(&state), 1);
    assert_eq!(greeted_by(fine).await.as_deref(), Some("a"));
    let v4 = FamilyLabel { ip_family: "IPv4" };
    assert_eq!(metrics.creation_failures.get_or_create(&v4).get(), 1);
    // Tried again at the next sync (and counted again), opened once the port is free.
    listeners.sync(&state);
    assert_eq!(metrics.creation_failures.get_or_create(&v4).get(), 2);
    drop(squatter);
    assert_eq!(listeners.sync(&state), 2);
    assert_eq!(greeted_by(taken).await.as_deref(), Some("a"));

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    for line in [
        "kubeproxy_nftables_localhost_nodeport_listeners{ip_family=\"IPv4\"} 2",
        "kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total{ip_family=\"IPv4\"} 2",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }
}
