//! ClientIP affinity of the verdict-free nftables layout across a service port's addresses,
//! with real traffic, in IPv4 and IPv6 (issue 33).
//!
//! In a throwaway network namespace a veth end holds ten endpoint addresses, eight client
//! addresses and the routes to a ClusterIP and an externalIP; the layout's full sync of one
//! service port with ClientIP affinity (ClusterIP, externalIP and NodePort) is applied with
//! `nft -f -` and must list with `nft list ruleset`. Each client connects once through the
//! ClusterIP, then ten times through the externalIP and ten through the NodePort: every
//! connection must reach the endpoint its first one did. With a pin per address instead,
//! the chance to pass is 10^-160. Without root or `nft` the test is skipped (a failure under
//! `CI`).

use crate::nft_layout_common;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::process::Command;
use std::time::Duration;

use kp_core::model::{IpFamily, Protocol, ServicePort};
use kp_core::testutil::{endpoint_at, service_port};
use kp_core::tracker::ProxyState;
use kp_testbed::isolated;
use nft_layout_common::{full_sync, nft_apply, run};

const TARGET_PORT: u16 = 8080;
const NODE_PORT: u16 = 30080;
const ENDPOINTS: u16 = 10;
const CLIENTS: u16 = 8;
const CONNECTIONS: usize = 10;

/// One family's addresses.
struct Addrs {
    family: IpFamily,
    node: IpAddr,
    cluster_ip: IpAddr,
    external_ip: IpAddr,
    endpoints: Vec<IpAddr>,
    clients: Vec<IpAddr>,
    /// `/32` or `/128`.
    host: u8,
}

fn v4() -> Addrs {
    let at = |c, d| IpAddr::V4(Ipv4Addr::new(10, 0, c, d));
    Addrs {
        family: IpFamily::V4,
        node: at(0, 1),
        cluster_ip: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)),
        external_ip: IpAddr::V4(Ipv4Addr::new(192, 0, 2, 10)),
        endpoints: (1..=ENDPOINTS).map(|d| at(244, d as u8)).collect(),
        clients: (1..=CLIENTS).map(|d| at(1, d as u8)).collect(),
        host: 32,
    }
}

fn v6() -> Addrs {
    let at = |c, d| IpAddr::V6(Ipv6Addr::new(0xfd00, c, 0, 0, 0, 0, 0, d));
    Addrs {
        family: IpFamily::V6,
        node: at(0, 1),
        cluster_ip: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 10)),
        external_ip: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 10)),
        endpoints: (1..=ENDPOINTS).map(|d| at(0x244, d)).collect(),
        clients: (1..=CLIENTS).map(|d| at(1, d)).collect(),
        host: 128,
    }
}

/// `nft list ruleset`, which must succeed (nft 1.0.6 aborts on rules it cannot print).
fn listed() -> String {
    let out = Command::new("nft")
        .args(["list", "ruleset"])
        .output()
        .expect("nft runs");
    assert!(
        out.status.success(),
        "nft list ruleset failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One TCP service port with ClientIP affinity on a ClusterIP, an externalIP and a NodePort.
fn service(addrs: &Addrs) -> ServicePort {
    let names = ("aff".into(), "web".into(), String::new(), Protocol::Tcp);
    let exposure = (
        Some(NODE_PORT),
        vec![addrs.external_ip],
        Vec::new(),
        Vec::new(),
    );
    service_port(
        names,
        vec![addrs.cluster_ip],
        80,
        exposure,
        (Some(10_800), [false, false], None),
    )
}

fn state(addrs: &Addrs) -> ProxyState {
    let mut state = ProxyState::default();
    state.node.name = "node".into();
    state.node.eligible = true;
    state.node.known = true;
    let svc = service(addrs);
    let eps = addrs
        .endpoints
        .iter()
        .map(|ip| endpoint_at(*ip, TARGET_PORT, false))
        .collect();
    state.endpoints.insert(svc.name.clone(), eps);
    state.services.insert(svc.name.clone(), svc);
    state
}

/// The node: a veth end with every address, and the routes to the service addresses.
fn set_up_node(addrs: &Addrs) {
    run(&["ip", "link", "set", "lo", "up"]);
    run(&[
        "ip", "link", "add", "kpa0", "type", "veth", "peer", "name", "kpa1",
    ]);
    run(&["ip", "link", "set", "kpa1", "up"]);
    run(&["ip", "link", "set", "kpa0", "up"]);
    let local = addrs
        .endpoints
        .iter()
        .chain(&addrs.clients)
        .chain([&addrs.node]);
    for addr in local {
        let addr = format!("{addr}/{}", addrs.host);
        let mut args = vec!["ip", "addr", "add", &addr, "dev", "kpa0"];
        if addrs.family == IpFamily::V6 {
            args.push("nodad");
        }
        run(&args);
    }
    for target in [addrs.cluster_ip, addrs.external_ip] {
        let route = format!("{target}/{}", addrs.host);
        run(&["ip", "route", "add", &route, "dev", "kpa0"]);
    }
}

/// The endpoint a connection from `client` to `target` reaches.
fn reached(listener: &TcpListener, client: IpAddr, target: SocketAddr) -> IpAddr {
    let socket = match client {
        IpAddr::V4(_) => socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None),
        IpAddr::V6(_) => socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None),
    }
    .expect("socket");
    socket
        .bind(&SocketAddr::new(client, 0).into())
        .expect("client address bound");
    socket
        .connect_timeout(&target.into(), Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("{client} to {target}: {e}"));
    let (server, _) = listener.accept().expect("accepted");
    let endpoint = server.local_addr().expect("local address").ip();
    // The accepting side closes first, so TIME_WAIT does not use up client ports.
    drop(server);
    drop(socket);
    endpoint
}

fn pinned_across_addresses(addrs: &Addrs) {
    set_up_node(addrs);
    nft_apply(&full_sync(&state(addrs), addrs.family));
    let ruleset = listed();
    assert!(ruleset.contains("chain affinity-record"), "{ruleset}");
    let any = match addrs.family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let listener = TcpListener::bind((any, TARGET_PORT)).expect("listening");
    let mut pins = std::collections::BTreeSet::new();
    for client in &addrs.clients {
        let pin = reached(&listener, *client, SocketAddr::new(addrs.cluster_ip, 80));
        assert!(addrs.endpoints.contains(&pin), "{client} reached {pin}");
        pins.insert(pin);
        for target in [
            SocketAddr::new(addrs.external_ip, 80),
            SocketAddr::new(addrs.node, NODE_PORT),
        ] {
            for _ in 0..CONNECTIONS {
                let got = reached(&listener, *client, target);
                assert_eq!(
                    got, pin,
                    "{client} pinned to {pin} through the ClusterIP, {target}"
                );
            }
        }
    }
    println!(
        "{:?}: {} clients pinned to {} endpoints",
        addrs.family,
        CLIENTS,
        pins.len()
    );
    // The clients are balanced before they are pinned: eight on one endpoint of ten is a
    // chance of 10^-7.
    assert!(
        pins.len() > 1,
        "every client pinned to one endpoint: {pins:?}"
    );
}

#[test]
fn a_client_pinned_through_the_cluster_ip_keeps_its_endpoint_through_other_addresses_v4() {
    isolated::run(
        "a_client_pinned_through_the_cluster_ip_keeps_its_endpoint_through_other_addresses_v4",
        || isolated::missing(&["nft"], &["nft", "add", "table", "ip", "probe"]),
        || pinned_across_addresses(&v4()),
    );
}

#[test]
fn a_client_pinned_through_the_cluster_ip_keeps_its_endpoint_through_other_addresses_v6() {
    isolated::run(
        "a_client_pinned_through_the_cluster_ip_keeps_its_endpoint_through_other_addresses_v6",
        || isolated::missing(&["nft"], &["nft", "add", "table", "ip6", "probe"]),
        || pinned_across_addresses(&v6()),
    );
}
