//! winuserspace's backend on Linux, with a fake address host and service addresses in
//! 127.0.0.0/8 (all local here): portals on ClusterIP, externalIP and NodePort carry real
//! connections to the right endpoints, a shared address is added once and removed after its
//! last portal, a refused address skips only its service, and shutdown removes what was added.

use crate::support;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use kp_core::backend::{Backend, SyncKind, SyncRequest};
use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort, ServicePortName};
use kp_core::testutil::{cluster_ip_port, endpoint_at, node_with, port_name, state_on};
use kp_core::tracker::ProxyState;
use kp_userspace::addresses::FakeFault;
use kp_userspace::{FakeAddressHost, RelayConfig, RelayMetrics, ServiceAddresses, WinBackend};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::net::TcpStream;

use support::{free_port, greeter};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("literal address")
}

fn name(svc: &str) -> ServicePortName {
    port_name("ns", svc, "p", Protocol::Tcp)
}

/// Who answers a connection to `addr`; `None` when it is refused.
async fn greeted_by(addr: SocketAddr) -> Option<String> {
    let stream = TcpStream::connect(addr).await.ok()?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).await.ok()?;
    Some(line.trim().to_owned())
}

fn backend(host: &FakeAddressHost) -> WinBackend<FakeAddressHost> {
    let addresses =
        ServiceAddresses::new(host.clone()).with_appear_timeout(Duration::from_millis(200));
    WinBackend::new(
        RelayConfig::default(),
        RelayMetrics::default(),
        addresses,
        vec![IpFamily::V4],
    )
}

async fn sync(backend: &mut WinBackend<FakeAddressHost>, state: &ProxyState) -> Vec<String> {
    let report = backend
        .sync(&SyncRequest {
            state,
            kind: SyncKind::Full,
            changed: &BTreeSet::new(),
            conntrack_cleanup_required: false,
        })
        .await
        .expect("sync");
    report.skipped.iter().map(ToString::to_string).collect()
}

fn state(items: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    state_on(node_with(&["192.168.0.2"]), items)
}

#[tokio::test]
async fn portals_relay_on_every_service_address_and_share_addresses() {
    let (a, b) = (greeter("a").await, greeter("b").await);
    let node_port = free_port();
    let mut web = cluster_ip_port(name("web"), "127.0.0.10", 8080);
    web.external_ips = vec![ip("127.0.0.20")];
    web.node_port = Some(node_port);
    // A second service on the same ClusterIP, another port.
    let other = cluster_ip_port(name("other"), "127.0.0.10", 8081);
    let host = FakeAddressHost::new();
    let mut backend = backend(&host);
    let skipped = sync(
        &mut backend,
        &state(vec![
            (web.clone(), vec![a.clone(), b.clone()]),
            (other.clone(), vec![b.clone()]),
        ]),
    )
    .await;
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(
        host.added(),
        [ip("127.0.0.10"), ip("127.0.0.20")],
        "each address once"
    );
    assert_eq!(backend.addresses().users(ip("127.0.0.10")), 2);

    // Round robin through each kind of portal.
    for addr in [
        "127.0.0.10:8080",
        "127.0.0.20:8080",
        &format!("127.0.0.1:{node_port}"),
    ] {
        let addr: SocketAddr = addr.parse().expect("literal");
        let mut seen = BTreeSet::new();
        for _ in 0..4 {
            seen.insert(greeted_by(addr).await.expect("answered"));
        }
        assert_eq!(seen, ["a", "b"].map(String::from).into(), "{addr}");
    }
    assert_eq!(
        greeted_by("127.0.0.10:8081".parse().expect("literal"))
            .await
            .as_deref(),
        Some("b")
    );

    // `other` goes: its portal closes, the shared address stays for `web`.
    sync(
        &mut backend,
        &state(vec![(web.clone(), vec![a.clone(), b.clone()])]),
    )
    .await;
    assert_eq!(
        greeted_by("127.0.0.10:8081".parse().expect("literal")).await,
        None
    );
    assert!(host.present(ip("127.0.0.10")));
    assert!(host.removed().is_empty());

    // Without endpoints `web` has no portals: refused, and its addresses removed.
    sync(&mut backend, &state(vec![(web, vec![])])).await;
    assert_eq!(
        greeted_by("127.0.0.10:8080".parse().expect("literal")).await,
        None
    );
    assert_eq!(
        greeted_by(SocketAddr::new(ip("127.0.0.1"), node_port)).await,
        None
    );
    assert_eq!(
        host.removed().into_iter().collect::<BTreeSet<_>>(),
        [ip("127.0.0.10"), ip("127.0.0.20")].into()
    );
}

#[tokio::test]
async fn a_refused_address_skips_its_service_only_and_shutdown_removes_the_rest() {
    let a = greeter("a").await;
    let host = FakeAddressHost::new();
    let mut backend = backend(&host);
    host.set_fault(FakeFault::Add, true);
    let broken = cluster_ip_port(name("broken"), "127.0.0.30", 8080);
    let skipped = sync(
        &mut backend,
        &state(vec![(broken.clone(), vec![a.clone()])]),
    )
    .await;
    assert_eq!(skipped, ["ns/broken"]);
    assert_eq!(
        greeted_by("127.0.0.30:8080".parse().expect("literal")).await,
        None
    );

    // Once the host accepts it, the next sync opens the portal.
    host.set_fault(FakeFault::Add, false);
    let fine = cluster_ip_port(name("fine"), "127.0.0.31", 8080);
    let skipped = sync(
        &mut backend,
        &state(vec![(broken, vec![a.clone()]), (fine, vec![a])]),
    )
    .await;
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(
        greeted_by("127.0.0.30:8080".parse().expect("literal"))
            .await
            .as_deref(),
        Some("a")
    );
    assert_eq!(
        greeted_by("127.0.0.31:8080".parse().expect("literal"))
            .await
            .as_deref(),
        Some("a")
    );

    drop(backend);
    assert!(!host.present(ip("127.0.0.30")) && !host.present(ip("127.0.0.31")));
}

#[tokio::test]
async fn cleanup_removes_added_addresses_but_not_the_nodes_own() {
    let a = greeter("a").await;
    let host = FakeAddressHost::new();
    host.preset(ip("127.0.0.40"));
    let mut backend = backend(&host);
    let own = cluster_ip_port(name("own"), "127.0.0.40", 8080);
    let added = cluster_ip_port(name("added"), "127.0.0.41", 8080);
    sync(
        &mut backend,
        &state(vec![(own, vec![a.clone()]), (added, vec![a])]),
    )
    .await;
    backend.cleanup().await.expect("cleanup");
    assert!(
        host.present(ip("127.0.0.40")),
        "the node's own address stays"
    );
    assert!(!host.present(ip("127.0.0.41")));
    assert_eq!(
        greeted_by("127.0.0.41:8080".parse().expect("literal")).await,
        None
    );
}

/// A UDP backend answering each datagram with `name`.
async fn udp_greeter(name: &'static str) -> Endpoint {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = socket.local_addr().expect("address");
    tokio::spawn(async move {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = socket.recv_from(&mut buf).await {
            let _ = socket.send_to(name.as_bytes(), from).await;
        }
    });
    endpoint_at(addr.ip(), addr.port(), true)
}

/// Who answers a datagram sent to `addr` from a fresh socket (`None`: no answer in time).
async fn udp_answer(addr: SocketAddr) -> Option<String> {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.ok()?;
    socket.connect(addr).await.ok()?;
    socket.send(b"hi").await.ok()?;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(2), socket.recv(&mut buf))
        .await
        .ok()?
        .ok()?;
    Some(String::from_utf8_lossy(&buf[..read]).into_owned())
}

#[tokio::test]
async fn udp_portals_on_service_addresses_answer_from_them() {
    let (a, b) = (udp_greeter("a").await, udp_greeter("b").await);
    let name = port_name("ns", "dns", "p", Protocol::Udp);
    let mut dns = cluster_ip_port(name, "127.0.0.50", 5353);
    dns.load_balancer_ips = vec![ip("127.0.0.51")];
    let host = FakeAddressHost::new();
    let mut backend = backend(&host);
    let skipped = sync(&mut backend, &state(vec![(dns, vec![a, b])])).await;
    assert!(skipped.is_empty(), "{skipped:?}");
    // The ClusterIP and the LoadBalancer IP portals share the port, each on its address;
    // a connected client socket only accepts answers from the address it sent to.
    for vip in ["127.0.0.50", "127.0.0.51"] {
        let addr = SocketAddr::new(ip(vip), 5353);
        let mut seen = BTreeSet::new();
        for _ in 0..4 {
            seen.insert(udp_answer(addr).await.expect("answered"));
        }
        assert_eq!(seen, ["a", "b"].map(String::from).into(), "{vip}");
    }
}
