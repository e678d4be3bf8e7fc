//! `kp-ipvs-sync`: what one-service changes cost ipvs mode's backend against a kernel holding
//! many services. Drives `kp_dataplane::ipvs::IpvsBackend` directly (real IPVS netlink,
//! rtnetlink, `ipset`, `iptables`; no proxy, no manifests to parse), so it runs in the test VM
//! in seconds where `kp-scale --mode ipvs` spends minutes starting the proxy under emulation:
//!
//! ```sh
//! B=$PWD/target/debug
//! KP_VM_DIRS=/usr/lib/x86_64-linux-gnu/xtables \
//! KP_VM_PROGRAMS="ipset iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore" \
//!   $B/kp-vm-run $B/kp-ipvs-sync --services 1000 --endpoints 10 --changes 10
//! ```
//!
//! It programs `--services` TCP services (every third with a NodePort) with `--endpoints`
//! endpoints each in one full sync, then makes `--changes` partial syncs that each add one
//! endpoint to one service (alternating a ClusterIP and a NodePort service), and prints each
//! sync's time with the IPVS netlink requests it made (lists, per-service reads, changes).
//! Everything it made is removed at the end (`cleanup`). Numbers, not assertions.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use kp_core::backend::{Backend, SyncKind, SyncRequest};
use kp_core::model::{Endpoint, NodeInfo, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;
use kp_dataplane::exec::{ExecRunner, IptablesVariant, Tools};
use kp_dataplane::ipvs::{ExecIpset, IpvsBackend, IpvsBackendConfig, RtLinks};
use kp_dataplane::sysctls::FsSysctl;
use kp_ipvs::{
    Ipvs, IpvsError, ListedRealServer, NetlinkIpvs, RealServer, ServiceKey, Timeouts, VirtualServer,
};
use kp_rules::ipvs::IpvsConfig;

/// The node's address (NodePorts are virtual servers on it).
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 0, 2);

#[derive(Parser, Debug)]
#[command(about = "Time one-service partial syncs of ipvs mode against many installed services")]
struct Args {
    /// Services to install first.
    #[arg(long, default_value_t = 1000)]
    services: u32,
    /// Endpoints per service.
    #[arg(long, default_value_t = 10)]
    endpoints: u32,
    /// One-service partial syncs to time.
    #[arg(long, default_value_t = 10)]
    changes: u32,
}

/// Requests made to the kernel, by kind.
#[derive(Debug, Default)]
struct Counts {
    lists: AtomicUsize,
    reads: AtomicUsize,
    changes: AtomicUsize,
}

impl Counts {
    fn take(&self) -> (usize, usize, usize) {
        (
            self.lists.swap(0, Ordering::Relaxed),
            self.reads.swap(0, Ordering::Relaxed),
            self.changes.swap(0, Ordering::Relaxed),
        )
    }
}

/// An [`Ipvs`] that counts the requests it passes on.
struct Counting {
    inner: NetlinkIpvs,
    counts: Arc<Counts>,
}

impl Counting {
    fn count<T>(&self, which: &AtomicUsize, result: Result<T, IpvsError>) -> Result<T, IpvsError> {
        which.fetch_add(1, Ordering::Relaxed);
        result
    }
}

impl Ipvs for Counting {
    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError> {
        let r = self.inner.services();
        self.count(&self.counts.lists, r)
    }
    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let r = self.inner.add_service(vs);
        self.count(&self.counts.changes, r)
    }
    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        let r = self.inner.update_service(vs);
        self.count(&self.counts.changes, r)
    }
    fn delete_service(&mut self, key: &ServiceKey) -> Result<(), IpvsError> {
        let r = self.inner.delete_service(key);
        self.count(&self.counts.changes, r)
    }
    fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<ListedRealServer>, IpvsError> {
        let r = self.inner.destinations(key);
        self.count(&self.counts.reads, r)
    }
    fn add_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        let r = self.inner.add_destination(key, rs);
        self.count(&self.counts.changes, r)
    }
    fn update_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        let r = self.inner.update_destination(key, rs);
        self.count(&self.counts.changes, r)
    }
    fn delete_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        let r = self.inner.delete_destination(key, rs);
        self.count(&self.counts.changes, r)
    }
    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        let r = self.inner.timeouts();
        self.count(&self.counts.reads, r)
    }
    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        let r = self.inner.set_timeouts(t);
        self.count(&self.counts.changes, r)
    }
    fn flush(&mut self) -> Result<(), IpvsError> {
        let r = self.inner.flush();
        self.count(&self.counts.changes, r)
    }
}

fn name(i: u32) -> ServiceName {
    ServiceName {
        namespace: "bench".into(),
        name: format!("svc-{i}").into(),
    }
}

/// The `n`-th address of `base`'s /12-sized range.
fn nth(base: [u8; 2], n: u32) -> IpAddr {
    let [a, b] = base;
    let [_, x, y, z] = n.to_be_bytes();
    IpAddr::V4(Ipv4Addr::new(a, b.wrapping_add(x), y, z))
}

fn endpoint(ip: IpAddr) -> Endpoint {
    Endpoint {
        ip,
        port: 8080,
        ready: true,
        serving: true,
        terminating: false,
        node_name: Some("other-node".into()),
        zone: None,
        zone_hints: None,
        node_hints: None,
        is_local: false,
    }
}

/// `services` services with `endpoints` endpoints each; every third has a NodePort.
fn generate(services: u32, endpoints: u32) -> anyhow::Result<ProxyState> {
    let mut state = ProxyState {
        node: NodeInfo {
            name: "bench-node".into(),
            addresses: vec![IpAddr::V4(NODE_IP)],
            eligible: true,
            known: true,
            ..NodeInfo::default()
        },
        ..ProxyState::default()
    };
    for i in 0..services {
        let port_name = ServicePortName {
            service: name(i),
            port: "http".into(),
            protocol: Protocol::Tcp,
        };
        let node_port = (i % 3 == 0)
            .then(|| u16::try_from(30000 + i / 3).context("too many NodePorts"))
            .transpose()?;
        let port = ServicePort {
            name: port_name.clone(),
            cluster_ips: vec![nth([10, 96], i + 1)],
            port: 80,
            node_port,
            external_ips: vec![],
            load_balancer_ips: vec![],
            load_balancer_source_ranges: vec![],
            session_affinity: None,
            external_policy_local: false,
            internal_policy_local: false,
            health_check_node_port: None,
        };
        let eps = (0..endpoints)
            .map(|e| endpoint(nth([10, 128], i * endpoints + e + 1)))
            .collect();
        state.endpoints.insert(port_name.clone(), eps);
        state.services.insert(port_name, port);
    }
    Ok(state)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.services == 0 {
        bail!("--services must be at least 1");
    }
    let counts = Arc::new(Counts::default());
    let ipvs = Counting {
        inner: NetlinkIpvs::open().context("IPVS netlink (run in the test VM)")?,
        counts: counts.clone(),
    };
    let mut backend = IpvsBackend::with_parts(
        IpvsBackendConfig {
            families: vec![kp_core::model::IpFamily::V4],
            plan: IpvsConfig {
                node_ips: vec![IpAddr::V4(NODE_IP)],
                masquerade_bit: 14,
                ..IpvsConfig::default()
            },
            timeouts: Timeouts::default(),
            strict_arp: false,
            exclude_cidrs: Vec::new(),
            node_addresses: Vec::new(),
        },
        ipvs,
        RtLinks::new(),
        ExecRunner::new(Tools::new(IptablesVariant::System)),
        ExecIpset,
        Box::new(FsSysctl::host()),
    );
    backend.cleanup().await.context("clean start")?;
    counts.take();
    let mut state = generate(args.services, args.endpoints)?;
    let none = BTreeSet::new();
    let started = Instant::now();
    let report = backend
        .sync(&SyncRequest {
            state: &state,
            kind: SyncKind::Full,
            changed: &none,
            conntrack_cleanup_required: false,
        })
        .await
        .context("first sync")?;
    let (lists, reads, changes) = counts.take();
    println!(
        "kp-ipvs-sync: {}x{}: first (full) sync {:.3} s, {} changes written; IPVS lists {lists}, reads {reads}, changes {changes}",
        args.services,
        args.endpoints,
        started.elapsed().as_secs_f64(),
        report.rules_written
    );
    let mut times = Vec::new();
    for c in 0..args.changes {
        // Alternate a NodePort service (i % 3 == 0) and a ClusterIP-only one.
        let i = if c % 2 == 0 {
            (c * 3) % args.services
        } else {
            (c * 3 + 1) % args.services
        };
        let port_name = ServicePortName {
            service: name(i),
            port: "http".into(),
            protocol: Protocol::Tcp,
        };
        let added = nth([10, 200], c + 1);
        state
            .endpoints
            .get_mut(&port_name)
            .context("generated service")?
            .push(endpoint(added));
        let changed = BTreeSet::from([name(i)]);
        let started = Instant::now();
        let report = backend
            .sync(&SyncRequest {
                state: &state,
                kind: SyncKind::Partial,
                changed: &changed,
                conntrack_cleanup_required: false,
            })
            .await
            .context("partial sync")?;
        let took = started.elapsed();
        let (lists, reads, changes) = counts.take();
        println!(
            "kp-ipvs-sync: partial sync {} (svc-{i}{}): {:.1} ms, {} changes written; IPVS lists {lists}, reads {reads}, changes {changes}",
            c + 1,
            if i % 3 == 0 { ", NodePort" } else { "" },
            took.as_secs_f64() * 1000.0,
            report.rules_written
        );
        times.push(took);
    }
    if !times.is_empty() {
        let max = times.iter().max().copied().unwrap_or_default();
        println!(
            "kp-ipvs-sync: {}x{}: one-service partial sync median {:.1} ms, max {:.1} ms over {}",
            args.services,
            args.endpoints,
            median(times.clone()).as_secs_f64() * 1000.0,
            max.as_secs_f64() * 1000.0,
            times.len()
        );
    }
    backend.cleanup().await.context("cleanup")?;
    Ok(())
}
