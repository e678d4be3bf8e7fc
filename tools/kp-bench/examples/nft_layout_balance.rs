//! Real traffic through the verdict-free layout as `kp_rules::nftables::layout` renders it
//! (the module is not wired to the proxy yet): balancing across 1, 2, 3, 7, 10 and 100
//! endpoints, and ClientIP affinity.
//!
//! `ip netns exec NS nft_layout_balance [PER_ENDPOINT]` sets up, inside the current (fresh)
//! network namespace, an interface holding every endpoint address and a route to the
//! ClusterIP range, renders the full sync of one ClusterIP service per endpoint count (plus
//! one with ClientIP affinity and ten endpoints), applies it with `nft -f -`, and then opens
//! PER_ENDPOINT × N TCP connections to each service from this namespace. The kernel's DNAT
//! sends each to an endpoint address, all of them local, where one listener on
//! `0.0.0.0:8080` accepts it: the accepted socket's local address is the endpoint chosen.
//! Prints the count per endpoint, the chi-square statistic against the uniform distribution
//! (its expected value is N - 1, its standard deviation sqrt(2 (N - 1))) and the largest
//! relative deviation, then the affinity service's distribution (one endpoint) and its
//! recorded `affinity-10800` element.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, bail};
use kp_bench::probe::nft_apply;
use kp_core::model::{
    Endpoint, IpFamily, Protocol, ServiceName, ServicePort, ServicePortName, SessionAffinity,
};
use kp_core::tracker::ProxyState;
use kp_rules::config::{LocalDetector, NodePortAddresses};
use kp_rules::nftables::layout::{
    Context, FixedConfig, LayoutState, change_script, fixed_part, full_updates,
};
use kp_rules::plan::Masquerading;

/// Endpoint counts checked, as issue 24 asks.
const COUNTS: [u8; 6] = [1, 2, 3, 7, 10, 100];
/// The affinity service's ClusterIP and endpoint count.
const AFFINITY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 1);
const AFFINITY_ENDPOINTS: u8 = 10;
const TARGET_PORT: u16 = 8080;

fn run(args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new(args[0]).args(&args[1..]).status()?;
    if !status.success() {
        bail!("{args:?} failed: {status}");
    }
    Ok(())
}

fn port_name(name: &str) -> ServicePortName {
    ServicePortName {
        service: ServiceName {
            namespace: "bench".into(),
            name: name.into(),
        },
        port: "".into(),
        protocol: Protocol::Tcp,
    }
}

fn endpoint(ip: Ipv4Addr) -> Endpoint {
    Endpoint {
        ip: IpAddr::V4(ip),
        port: TARGET_PORT,
        ready: true,
        serving: true,
        terminating: false,
        node_name: None,
        zone: None,
        zone_hints: None,
        node_hints: None,
        is_local: false,
    }
}

/// One ClusterIP service on port 80.
fn service(name: &str, ip: Ipv4Addr, affinity: bool) -> ServicePort {
    ServicePort {
        name: port_name(name),
        cluster_ips: vec![IpAddr::V4(ip)],
        port: 80,
        node_port: None,
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        load_balancer_source_ranges: Vec::new(),
        session_affinity: affinity.then_some(SessionAffinity {
            timeout: Duration::from_secs(10_800),
        }),
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: None,
    }
}

/// The services, and every endpoint address to put on the dummy interface.
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
        state
            .endpoints
            .insert(svc.name.clone(), eps.into_iter().map(endpoint).collect());
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

/// Connect `connections` times to `target` and count the endpoint each reached.
fn distribution(
    listener: &TcpListener,
    target: SocketAddr,
    connections: usize,
) -> anyhow::Result<BTreeMap<IpAddr, usize>> {
    let mut counts = BTreeMap::new();
    for _ in 0..connections {
        let client = TcpStream::connect_timeout(&target, Duration::from_secs(2))
            .with_context(|| format!("connecting to {target}"))?;
        let (server, _) = listener.accept()?;
        *counts.entry(server.local_addr()?.ip()).or_default() += 1;
        // The accepting side closes first, so TIME_WAIT does not use up client ports.
        drop(server);
        drop(client);
    }
    Ok(counts)
}

fn main() -> anyhow::Result<()> {
    let per_endpoint: usize = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "300".into())
        .parse()?;
    let (state, addrs) = state();
    run(&["ip", "link", "set", "lo", "up"])?;
    // A veth pair (both ends here) carries the addresses: no dummy module needed.
    run(&[
        "ip", "link", "add", "kpb0", "type", "veth", "peer", "name", "kpb1",
    ])?;
    run(&["ip", "link", "set", "kpb1", "up"])?;
    run(&["ip", "addr", "add", "10.0.0.1/24", "dev", "kpb0"])?;
    run(&["ip", "link", "set", "kpb0", "up"])?;
    run(&["ip", "route", "add", "10.96.0.0/16", "dev", "kpb0"])?;
    for addr in &addrs {
        run(&["ip", "addr", "add", &format!("{addr}/32"), "dev", "kpb0"])?;
    }
    std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "1024\t65000")?;

    let config = FixedConfig {
        family: IpFamily::V4,
        mark: 0x4000,
        random_fully: true,
        detector: LocalDetector::None,
        node_port_addresses: NodePortAddresses::All,
        service_cidrs: Vec::new(),
    };
    let ctx = Context {
        family: IpFamily::V4,
        masquerading: Masquerading {
            all: false,
            detector: false,
        },
        node_ips: Vec::new(),
    };
    let mut installed = LayoutState::default();
    let changes = installed.changes(full_updates(&state, &ctx, &installed));
    let mut script = fixed_part(&config, &Default::default());
    script.extend(change_script(&config, &changes));
    installed.apply(changes);
    nft_apply(&(script.join("\n") + "\n"))?;
    eprintln!(
        "{} statements, {} elements, {} classes",
        script.len(),
        installed.element_count(),
        installed.classes().len()
    );

    let listener = TcpListener::bind(("0.0.0.0", TARGET_PORT))?;
    for n in COUNTS {
        let target = SocketAddr::from((Ipv4Addr::new(10, 96, 0, n), 80));
        let total = per_endpoint * usize::from(n);
        let counts = distribution(&listener, target, total)?;
        let expected = per_endpoint as f64;
        let chi2: f64 = counts
            .values()
            .map(|c| (*c as f64 - expected).powi(2) / expected)
            .sum::<f64>()
            + (usize::from(n) - counts.len()) as f64 * expected;
        let worst = counts
            .values()
            .map(|c| (*c as f64 - expected).abs() / expected)
            .fold(0.0, f64::max);
        let df = f64::from(n) - 1.0;
        println!(
            "{n} endpoints, {total} connections: {} endpoints reached, chi2 {chi2:.1} (expected {df} ± {:.1}), largest deviation {:.1} %, min {} max {}",
            counts.len(),
            (2.0 * df).sqrt(),
            worst * 100.0,
            counts.values().min().unwrap_or(&0),
            counts.values().max().unwrap_or(&0)
        );
        if counts.len() != usize::from(n) {
            bail!("only {} of {n} endpoints reached", counts.len());
        }
    }
    let target = SocketAddr::from((AFFINITY_IP, 80));
    let counts = distribution(&listener, target, 200)?;
    println!("affinity service, 200 connections from one client: {counts:?}");
    let listed = Command::new("nft")
        .args(["list", "map", "ip", "kube-proxy", "affinity-10800"])
        .output()?;
    println!("{}", String::from_utf8_lossy(&listed.stdout));
    if counts.len() != 1 {
        bail!("affinity did not hold: {counts:?}");
    }
    Ok(())
}
