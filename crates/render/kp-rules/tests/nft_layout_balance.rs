//! Real traffic through the verdict-free nftables layout (`kp_rules::nftables::layout`):
//! balancing across 1, 2, 3, 7, 10 and 100 endpoints, and ClientIP affinity.
//!
//! In a throwaway network namespace, a veth end holds every endpoint address and the route to
//! the ClusterIPs; the full sync of one ClusterIP service per endpoint count (and one with
//! affinity) is applied with `nft -f -`; then TCP connections to each ClusterIP are counted by
//! the endpoint address they were accepted on (one listener on `0.0.0.0`). Each distribution
//! must reach every endpoint and pass a chi-square test against the uniform one whose bound
//! a fair kernel exceeds with a probability below 1e-6, while a 2:1 skew between two
//! endpoints fails it. Without root or `nft` the test is skipped (a failure under `CI`).

use crate::nft_layout_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort};
use kp_core::testutil::{endpoint_at, service_port};
use kp_core::tracker::ProxyState;
use kp_testbed::isolated;
use nft_layout_common::{full_sync, nft_apply, run};

/// Endpoint counts checked.
const COUNTS: [u8; 6] = [1, 2, 3, 7, 10, 100];
/// Connections per service with few endpoints (enough for a 2:1 skew to fail the bound)...
const CONNECTIONS: usize = 1200;
/// ...and at least this many per endpoint with many.
const PER_ENDPOINT: usize = 30;
const AFFINITY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 1);
const AFFINITY_ENDPOINTS: u8 = 10;
const TARGET_PORT: u16 = 8080;

fn endpoint(ip: Ipv4Addr) -> Endpoint {
    endpoint_at(IpAddr::V4(ip), TARGET_PORT, false)
}

/// A ClusterIP service on port 80 (TCP), with ClientIP affinity for three hours or none.
fn service(name: &str, ip: Ipv4Addr, affinity: bool) -> ServicePort {
    let names = ("balance".into(), name.into(), String::new(), Protocol::Tcp);
    let exposure = (None, Vec::new(), Vec::new(), Vec::new());
    let policies = (affinity.then_some(10_800), [false, false], None);
    service_port(names, vec![IpAddr::V4(ip)], 80, exposure, policies)
}

/// The services, and every endpoint address to put on the interface.
fn state() -> (ProxyState, Vec<Ipv4Addr>) {
    let mut state = ProxyState::default();
    state.node.name = "node".into();
    state.node.eligible = true;
    state.node.known = true;
    let mut addrs = Vec::new();
    let mut add = |name: &str, ip: Ipv4Addr, net: u8, count: u8, affinity: bool| {
        let eps: Vec<Ipv4Addr> = (1..=count)
            .map(|j| Ipv4Addr::new(10, 244, net, j))
            .collect();
        addrs.extend(&eps);
        let svc = service(name, ip, affinity);
        let eps = eps.into_iter().map(endpoint).collect();
        state.endpoints.insert(svc.name.clone(), eps);
        state.services.insert(svc.name.clone(), svc);
    };
    for n in COUNTS {
        add(
            &format!("svc-{n}"),
            Ipv4Addr::new(10, 96, 0, n),
            n,
            n,
            false,
        );
    }
    add("affinity", AFFINITY_IP, 200, AFFINITY_ENDPOINTS, true);
    (state, addrs)
}

/// The node: a veth end with every endpoint address and the ClusterIP route.
fn set_up_node(addrs: &[Ipv4Addr]) {
    run(&["ip", "link", "set", "lo", "up"]);
    run(&[
        "ip", "link", "add", "kpb0", "type", "veth", "peer", "name", "kpb1",
    ]);
    run(&["ip", "link", "set", "kpb1", "up"]);
    run(&["ip", "addr", "add", "10.0.0.1/24", "dev", "kpb0"]);
    run(&["ip", "link", "set", "kpb0", "up"]);
    run(&["ip", "route", "add", "10.96.0.0/16", "dev", "kpb0"]);
    for addr in addrs {
        run(&["ip", "addr", "add", &format!("{addr}/32"), "dev", "kpb0"]);
    }
    std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "1024\t65000")
        .expect("port range set");
}

/// Connect `connections` times to `target`; how many reached each endpoint.
fn distribution(listener: &TcpListener, target: SocketAddr, connections: usize) -> Vec<usize> {
    let mut counts: BTreeMap<IpAddr, usize> = BTreeMap::new();
    for _ in 0..connections {
        let client = TcpStream::connect_timeout(&target, Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("connecting to {target}: {e}"));
        let (server, _) = listener.accept().expect("accepted");
        let endpoint = server.local_addr().expect("local address").ip();
        *counts.entry(endpoint).or_default() += 1;
        // The accepting side closes first, so TIME_WAIT does not use up client ports.
        drop(server);
        drop(client);
    }
    counts.into_values().collect()
}

/// Pearson's statistic of `counts` against `n` equally likely endpoints.
fn chi_square(counts: &[usize], n: usize) -> f64 {
    let total: usize = counts.iter().sum();
    let expected = total as f64 / n as f64;
    let missing = (n - counts.len()) as f64 * expected;
    counts
        .iter()
        .map(|c| (*c as f64 - expected).powi(2) / expected)
        .sum::<f64>()
        + missing
}

/// Exceeded by a fair distribution with `df` degrees of freedom with a probability below
/// 1e-6 (for df = 1, P(X > 25) is 6e-7; the margin grows with the standard deviation).
fn bound(df: f64) -> f64 {
    df + 10.0 * (2.0 * df).sqrt() + 10.0
}

#[test]
fn the_bound_tells_a_skew_from_chance() {
    // Two endpoints, 1200 connections: fair is 600/600; 2:1 is 800/400.
    assert!(chi_square(&[620, 580], 2) < bound(1.0));
    assert!(chi_square(&[800, 400], 2) > bound(1.0));
    // Ten endpoints, one chosen twice as often as each other one.
    let mut skewed = vec![109; 9];
    skewed.push(219);
    assert!(chi_square(&skewed, 10) > bound(9.0));
}

#[test]
fn balancing_and_affinity_hold_for_real_traffic() {
    isolated::run(
        "balancing_and_affinity_hold_for_real_traffic",
        || isolated::missing(&["nft"], &["nft", "add", "table", "ip", "probe"]),
        || {
            let (state, addrs) = state();
            set_up_node(&addrs);
            nft_apply(&full_sync(&state, IpFamily::V4));
            let listener = TcpListener::bind(("0.0.0.0", TARGET_PORT)).expect("listening");
            for n in COUNTS {
                let target = SocketAddr::from((Ipv4Addr::new(10, 96, 0, n), 80));
                let n = usize::from(n);
                let counts = distribution(&listener, target, CONNECTIONS.max(PER_ENDPOINT * n));
                let chi2 = chi_square(&counts, n);
                let df = (n - 1) as f64;
                println!(
                    "{n} endpoints: {counts:?}, chi-square {chi2:.1} (bound {:.1})",
                    bound(df)
                );
                assert_eq!(counts.len(), n, "{n} endpoints: {counts:?}");
                assert!(
                    chi2 <= bound(df),
                    "{n} endpoints: {counts:?}, chi-square {chi2:.1}"
                );
            }
            let counts = distribution(&listener, SocketAddr::from((AFFINITY_IP, 80)), 100);
            assert_eq!(counts, vec![100], "one client stays with one endpoint");
        },
    );
}
