//! The cost of a one-Service change with the socket load balancer at scale (issue 36: at most
//! 1 ms for the map writes at 100k Services), in this kernel's maps (as root):
//!
//! ```text
//! cargo run --release -p kp-socklb --example update_cost -- [SERVICES] [CHANGES]
//! ```
//!
//! Loads the programs (not attached: map writes cost the same), fills the maps with SERVICES
//! ClusterIP Services of two endpoints each through `ServiceLb`'s full sync, then makes
//! CHANGES one-Service changes, each adding or removing one endpoint: (a) as the proxy does,
//! a partial `ServiceLb::sync` (the Service's plan and its map writes), and (b) the map writes
//! alone (`Balancer::set` with the endpoints given). Prints p50 / p99 / max of each and the
//! writes per change; then (c) the thorough check's read-back and comparison of the maps
//! (5 runs). Measurements only.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kp_core::model::Protocol;
use kp_core::testutil::{cluster_ip_port, endpoint, node_with, port_name, state_on};
use kp_socklb::{ServiceKey, ServiceLb, SocketPrograms};

fn cluster_ip(i: usize) -> Ipv4Addr {
    let i = u32::try_from(i).unwrap_or(u32::MAX);
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + 16 + i)
}

fn pod_ip(i: usize, n: u8) -> String {
    let i = u32::try_from(i).unwrap_or(u32::MAX);
    let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + 4 * i;
    Ipv4Addr::from(base + u32::from(n)).to_string()
}

fn name(i: usize) -> String {
    format!("svc-{i:06}")
}

fn percentiles(mut samples: Vec<Duration>) -> String {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    format!(
        "p50 {:?}, p99 {:?}, max {:?}",
        at(0.5),
        at(0.99),
        samples.last().copied().unwrap_or_default()
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let services: usize = args.next().map_or(Ok(100_000), |a| a.parse())?;
    let changes: usize = args.next().map_or(Ok(1_000), |a| a.parse())?;
    let (_programs, maps) = SocketPrograms::load()?;
    let items = (0..services)
        .map(|i| {
            let port = cluster_ip_port(
                port_name("bench", &name(i), "http", Protocol::Tcp),
                &cluster_ip(i).to_string(),
                80,
            );
            let eps = vec![
                endpoint(&pod_ip(i, 1), 8080, false),
                endpoint(&pod_ip(i, 2), 8080, false),
            ];
            (port, eps)
        })
        .collect();
    let mut state = state_on(node_with(&["192.168.0.2"]), items);
    let mut lb = ServiceLb::new(maps);
    let started = Instant::now();
    let full = lb.sync(&state, true, &BTreeSet::new());
    println!(
        "full sync of {services} Services: {:?}, {} writes, {} failed (load {})",
        started.elapsed(),
        full.writes,
        full.failed.len(),
        load()
    );

    let (mut synced, mut writes) = (Vec::with_capacity(changes), 0);
    for c in 0..changes {
        // Each Service twice in a row: an endpoint added, then removed again.
        let i = ((c / 2) * 7919) % services;
        let port = port_name("bench", &name(i), "http", Protocol::Tcp);
        let eps = state.endpoints.entry(port.clone()).or_default();
        if c % 2 == 0 {
            eps.push(endpoint(&pod_ip(i, 3), 8080, false));
        } else {
            eps.retain(|e| e.ip.to_string() != pod_ip(i, 3));
        }
        let changed = BTreeSet::from([port.service.clone()]);
        let started = Instant::now();
        let report = lb.sync(&state, false, &changed);
        synced.push(started.elapsed());
        writes += report.writes;
        assert!(report.failed.is_empty(), "{:?}", report.failed);
    }
    println!(
        "(a) one-Service partial sync (plan + map writes): {}; {:.1} writes per change",
        percentiles(synced),
        writes as f64 / changes as f64
    );

    let key = ServiceKey::new(
        SocketAddr::new(IpAddr::V4(cluster_ip(0)), 80),
        Protocol::Tcp,
    );
    let two: Vec<SocketAddr> = [1, 2]
        .iter()
        .map(|&n| SocketAddr::new(pod_ip(0, n).parse().expect("address"), 8080))
        .collect();
    let three: Vec<SocketAddr> = two
        .iter()
        .copied()
        .chain([SocketAddr::new(
            pod_ip(0, 3).parse().expect("address"),
            8080,
        )])
        .collect();
    let (mut written, mut writes) = (Vec::with_capacity(changes), 0);
    for c in 0..changes {
        let endpoints = if c % 2 == 0 { &three } else { &two };
        let started = Instant::now();
        writes += lb.balancer_mut().set(key, endpoints)?;
        written.push(started.elapsed());
    }
    println!(
        "(b) the map writes alone (Balancer::set): {}; {:.1} writes per change (load {})",
        percentiles(written),
        writes as f64 / changes as f64,
        load()
    );
    entries_check(&mut lb);
    Ok(())
}

/// (c) The thorough check of the maps' entries (the proxy's `SocketLb::verify`): the
/// read-back, which the proxy runs on its socket load balancer thread, and the comparison
/// with what was written (`differences_since`), which runs on the sync thread, timed apart.
fn entries_check(lb: &mut ServiceLb<kp_socklb::KernelMaps>) {
    let (mut read, mut compared) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let epoch = lb.balancer_mut().watch();
        let started = Instant::now();
        let (held, _) = lb.balancer().maps().read_back();
        read.push(started.elapsed());
        let started = Instant::now();
        let differ = lb.balancer().table().differences_since(&held, epoch);
        compared.push(started.elapsed());
        assert_eq!(differ.map(|d| d.len()), Some(0), "entries differ");
    }
    println!(
        "(c) the thorough check of the map entries: read back (off the sync thread) {}; \
         compare (on it) {} (load {})",
        percentiles(read),
        percentiles(compared),
        load()
    );
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}
