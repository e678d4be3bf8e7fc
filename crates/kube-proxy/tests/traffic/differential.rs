//! The differential test of nftables mode's two layouts (issue 33): generated cluster states,
//! each programmed by the chain-per-service layout in one cluster and by the verdict-free
//! layout in another, and the same probes sent through both. Every probe must end the same
//! way: the same pods answering with the same source seen, or the same refusal or drop.
//!
//! A case is drawn from a seed ([`Rng`]); a case that differs is reported with its seed, and
//! `KP_DIFF_SEEDS=1,2,3` reruns exactly those. `KP_DIFF_CASES=N` draws `N` random seeds on
//! top of the fixed ones (for a longer search by hand; CI runs the fixed ones only).
//!
//! What a probe's answer is, so that randomness does not look like a difference: without
//! affinity, the set of (pod, source seen) pairs over several flows, re-probed with many more
//! flows in both clusters when the first sets differ (a pod that got none of few random
//! picks); with ClientIP affinity, whether one pod answered every flow and whether the source
//! was masqueraded (which pod a client is pinned to is chance in both layouts). Affinity
//! *across* a service port's addresses is checked by the traffic scenario
//! `affinity_and_node_traffic` and kp-rules' `nft_layout_affinity`, not here.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use kp_testbed::addresses::{
    EXTERNAL_IN_RANGE_V4, EXTERNAL_IN_RANGE_V6, LAN_CIDR_V4, LAN_CIDR_V6, LINK_LOCAL_SERVICE_V4,
    NODE_SECONDARY_V4, NODE_SECONDARY_V6, NODE_V4, NODE_V6,
};
use kp_testbed::{Cluster, Host, Outcome, Protocol, Tally};

use crate::support::{
    CLUSTER_CIDR_DUAL, CLUSTER_CIDR_V4, Env, Flags, Mode, POD_VETH_PREFIX, Service,
};

/// The seeds CI runs (each one case).
const FIXED_SEEDS: [u64; 4] = [1, 2, 3, 4];
/// Flows per probe at first, and the flows of the re-probe when the answers differ: with
/// three endpoints, the chance that one of them gets none of 6 + 48 random picks is ~1e-9.
const FLOWS: usize = 6;
const REPROBE_FLOWS: usize = 48;
/// A dropped flow costs this much; answers on these namespaces take milliseconds.
const PROBE_TIMEOUT: Duration = Duration::from_millis(700);
/// The pods endpoints are drawn from: two on this node, one on the remote node.
const PODS: [&str; 3] = ["a", "b", "c"];

/// splitmix64: a small, seedable generator (the case must be rebuilt from its seed alone).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with probability `percent` / 100.
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        let len = u64::try_from(items.len()).expect("a short list");
        let index = usize::try_from(self.next() % len).expect("an index");
        &items[index]
    }
}

/// How an endpoint is listed in its slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Condition {
    Ready,
    /// Terminating but still serving (used when a port has no ready endpoint).
    TerminatingServing,
    /// Terminating and no longer serving (never used).
    TerminatingGone,
}

/// One generated Service: everything but the pod addresses, which each cluster supplies.
#[derive(Debug, Clone)]
struct ServiceSpec {
    name: String,
    v6: bool,
    index: u8,
    tcp: bool,
    udp: bool,
    node_port: bool,
    load_balancer: bool,
    /// `loadBalancerSourceRanges` (only with a load balancer).
    source_ranges: Vec<&'static str>,
    /// externalIPs: one routed to the node, or the node's own IP.
    external_ip: Option<IpAddr>,
    etp_local: bool,
    itp_local: bool,
    affinity: Option<u32>,
    endpoints: Vec<(&'static str, Condition)>,
}

impl ServiceSpec {
    fn draw(rng: &mut Rng, index: u8, dual_stack: bool) -> Self {
        let v6 = dual_stack && rng.chance(35);
        let (tcp, udp) = match rng.next() % 4 {
            0 => (false, true),
            1 => (true, true),
            _ => (true, false),
        };
        let load_balancer = rng.chance(30);
        let node_port = load_balancer || rng.chance(45);
        let source_ranges = if load_balancer && rng.chance(50) {
            let (inside, lan) = if v6 {
                (EXTERNAL_IN_RANGE_V6, LAN_CIDR_V6)
            } else {
                (EXTERNAL_IN_RANGE_V4, LAN_CIDR_V4)
            };
            let other = if v6 {
                "2001:db8:9::/64"
            } else {
                "203.0.113.128/25"
            };
            match rng.next() % 3 {
                0 => vec![inside],
                1 => vec![other],
                _ => vec![other, lan],
            }
        } else {
            Vec::new()
        };
        let external_ip = rng.chance(30).then(|| match (v6, rng.chance(35)) {
            (false, true) => IpAddr::V4(NODE_V4),
            (true, true) => IpAddr::V6(NODE_V6),
            (false, false) => IpAddr::V4(Ipv4Addr::new(198, 51, 100, 100 + index)),
            (true, false) => IpAddr::V6(Ipv6Addr::new(
                0x2001,
                0xdb8,
                0x100,
                0,
                0,
                0,
                1,
                u16::from(index),
            )),
        });
        let external = node_port || external_ip.is_some();
        let mut endpoints = Vec::new();
        for pod in PODS {
            if rng.chance(60) {
                let condition = match rng.next() % 8 {
                    0 => Condition::TerminatingServing,
                    1 => Condition::TerminatingGone,
                    _ => Condition::Ready,
                };
                endpoints.push((pod, condition));
            }
        }
        Self {
            name: format!("d{index}"),
            v6,
            index,
            tcp,
            udp,
            node_port,
            load_balancer,
            source_ranges,
            external_ip,
            etp_local: external && rng.chance(35),
            itp_local: rng.chance(20),
            affinity: rng.chance(25).then(|| *rng.pick(&[60, 10_800])),
            endpoints,
        }
    }

    fn cluster_ip(&self) -> IpAddr {
        if self.v6 {
            IpAddr::V6(Ipv6Addr::new(
                0xfd00,
                0x10,
                0x96,
                0,
                0,
                0,
                0,
                0x100 + u16::from(self.index),
            ))
        } else {
            IpAddr::V4(Ipv4Addr::new(10, 96, 9, 10 + self.index))
        }
    }

    fn load_balancer_ip(&self) -> IpAddr {
        if self.v6 {
            IpAddr::V6(Ipv6Addr::new(
                0x2001,
                0xdb8,
                0x100,
                0,
                0,
                0,
                0,
                0x10 + u16::from(self.index),
            ))
        } else {
            IpAddr::V4(Ipv4Addr::new(198, 51, 100, 10 + self.index))
        }
    }

    fn port(&self, protocol: Protocol) -> u16 {
        match protocol {
            Protocol::Udp => 53,
            _ => 80,
        }
    }

    fn node_port_of(&self, protocol: Protocol) -> u16 {
        let base = 30_200 + 2 * u16::from(self.index);
        if protocol == Protocol::Udp {
            base + 1
        } else {
            base
        }
    }

    fn protocols(&self) -> Vec<Protocol> {
        let mut out = Vec::new();
        if self.tcp {
            out.push(Protocol::Tcp);
        }
        if self.udp {
            out.push(Protocol::Udp);
        }
        out
    }

    /// The Service and its slice, with `cluster`'s pod addresses.
    fn service(&self, cluster: &Cluster) -> Service {
        let mut svc = Service::new(&self.name, &self.cluster_ip().to_string());
        for protocol in self.protocols() {
            svc = match protocol {
                Protocol::Udp => svc.udp(self.port(protocol)),
                _ => svc.tcp(self.port(protocol)),
            };
            if self.node_port {
                svc = svc.node_port(self.node_port_of(protocol));
            }
        }
        if self.load_balancer {
            svc = svc.load_balancer(&self.load_balancer_ip().to_string());
        }
        for range in &self.source_ranges {
            svc = svc.source_range(range);
        }
        if let Some(ip) = self.external_ip {
            svc = svc.external_ip(&ip.to_string());
        }
        if self.etp_local {
            svc = svc.etp_local(32_200 + u16::from(self.index));
        }
        if self.itp_local {
            svc = svc.itp_local();
        }
        if let Some(seconds) = self.affinity {
            svc = svc.affinity(seconds);
        }
        for condition in [
            Condition::Ready,
            Condition::TerminatingServing,
            Condition::TerminatingGone,
        ] {
            let pods: Vec<&str> = self
                .endpoints
                .iter()
                .filter(|(_, c)| *c == condition)
                .map(|(pod, _)| *pod)
                .collect();
            svc = match condition {
                Condition::Ready => svc.endpoints(cluster, &pods),
                Condition::TerminatingServing => svc.terminating_endpoints(cluster, &pods, true),
                Condition::TerminatingGone => svc.terminating_endpoints(cluster, &pods, false),
            };
        }
        svc
    }
}

/// The proxy's settings that decide the rules' shape.
#[derive(Debug, Clone)]
struct Settings {
    cluster_cidr: Option<&'static str>,
    extra: Vec<String>,
}

impl Settings {
    fn draw(rng: &mut Rng, dual_stack: bool) -> Self {
        let mut extra = Vec::new();
        let cluster_cidr = match rng.next() % 6 {
            0 => None,
            1 => {
                extra.push("--detect-local-mode=InterfaceNamePrefix".to_owned());
                extra.push(format!("--pod-interface-name-prefix={POD_VETH_PREFIX}"));
                None
            }
            _ if dual_stack => Some(CLUSTER_CIDR_DUAL),
            _ => Some(CLUSTER_CIDR_V4),
        };
        if rng.chance(15) {
            extra.push("--masquerade-all".to_owned());
        }
        let lan = if dual_stack {
            format!("{LAN_CIDR_V4},{LAN_CIDR_V6}")
        } else {
            LAN_CIDR_V4.to_owned()
        };
        let loopback = if dual_stack {
            "127.0.0.1/32,::1/128"
        } else {
            "127.0.0.1/32"
        };
        let addresses = match rng.next() % 7 {
            0 => None,
            1 => Some(lan),
            2 => Some(format!("{lan},{loopback}")),
            3 => Some("127.0.0.0/8".to_owned()),
            4 => Some(format!("{lan},169.254.0.0/16")),
            5 => Some("0.0.0.0/0,::/0".to_owned()),
            _ => Some("primary".to_owned()),
        };
        if let Some(addresses) = addresses {
            extra.push(format!("--nodeport-addresses={addresses}"));
        }
        Self {
            cluster_cidr,
            extra,
        }
    }

    fn flags(&self) -> Flags {
        let mut flags = Flags {
            cluster_cidr: self.cluster_cidr,
            ..Flags::default()
        };
        for flag in &self.extra {
            flags = flags.flag(flag);
        }
        flags
    }
}

/// One generated cluster state.
#[derive(Debug, Clone)]
struct Case {
    seed: u64,
    dual_stack: bool,
    settings: Settings,
    services: Vec<ServiceSpec>,
}

impl Case {
    fn draw(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let dual_stack = rng.chance(50);
        let settings = Settings::draw(&mut rng, dual_stack);
        let count = 2 + rng.next() % 3;
        let services = (0..u8::try_from(count).expect("a few"))
            .map(|index| ServiceSpec::draw(&mut rng, index, dual_stack))
            .collect();
        Self {
            seed,
            dual_stack,
            settings,
            services,
        }
    }

    fn cluster(&self) -> Cluster {
        Cluster::builder()
            .pod("a")
            .pod("b")
            .remote_pod("c")
            .real_node_shape(true)
            .dual_stack(self.dual_stack)
            .probe_timeout(PROBE_TIMEOUT)
            .build()
            .expect("test cluster builds (needs root, iproute2, and `cargo build -p kp-testbed --bins`)")
    }

    /// Every probe of this case, in a fixed order.
    fn probes(&self) -> Vec<Probe> {
        let mut out = Vec::new();
        for spec in &self.services {
            for protocol in spec.protocols() {
                spec_probes(spec, protocol, &mut out);
            }
        }
        out
    }
}

/// Who sends a probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum From {
    /// The client pod on this node.
    Pod,
    /// The node itself.
    Node,
    /// A client outside the cluster, routed through the LAN router.
    External,
}

/// One probe: `flows` flows of `protocol` from `from` to `dst`:`port`.
#[derive(Debug, Clone)]
struct Probe {
    what: String,
    from: From,
    protocol: Protocol,
    dst: IpAddr,
    port: u16,
    affinity: bool,
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dst = std::net::SocketAddr::new(self.dst, self.port);
        write!(
            f,
            "{} from {:?}: {} {dst}",
            self.what, self.from, self.protocol
        )
    }
}

/// The probes of one service port: its ClusterIP from a pod and the node, an undefined port,
/// and each external address from outside, a pod and the node (NodePorts also on a secondary
/// address, loopback and, for IPv4, the node's link-local service address).
fn spec_probes(spec: &ServiceSpec, protocol: Protocol, out: &mut Vec<Probe>) {
    let port = spec.port(protocol);
    let mut add = |what: &str, from: From, dst: IpAddr, port: u16| {
        out.push(Probe {
            what: format!("{} {what}", spec.name),
            from,
            protocol,
            dst,
            port,
            affinity: spec.affinity.is_some(),
        });
    };
    let cluster_ip = spec.cluster_ip();
    add("ClusterIP", From::Pod, cluster_ip, port);
    add("ClusterIP", From::Node, cluster_ip, port);
    add("ClusterIP, undefined port", From::Pod, cluster_ip, port + 1);
    if spec.node_port {
        let np = spec.node_port_of(protocol);
        let (node, secondary, loopback) = if spec.v6 {
            (
                IpAddr::V6(NODE_V6),
                IpAddr::V6(NODE_SECONDARY_V6),
                IpAddr::V6(Ipv6Addr::LOCALHOST),
            )
        } else {
            (
                IpAddr::V4(NODE_V4),
                IpAddr::V4(NODE_SECONDARY_V4),
                IpAddr::V4(Ipv4Addr::LOCALHOST),
            )
        };
        add("NodePort on the node IP", From::External, node, np);
        add("NodePort on the node IP", From::Pod, node, np);
        add("NodePort on the node IP", From::Node, node, np);
        add(
            "NodePort on a secondary address",
            From::External,
            secondary,
            np,
        );
        add("NodePort on loopback", From::Node, loopback, np);
        if !spec.v6 {
            add(
                "NodePort on a link-local address",
                From::Node,
                IpAddr::V4(LINK_LOCAL_SERVICE_V4),
                np,
            );
        }
    }
    if spec.load_balancer {
        let lb = spec.load_balancer_ip();
        add("LoadBalancer IP", From::External, lb, port);
        add("LoadBalancer IP", From::Pod, lb, port);
        add("LoadBalancer IP", From::Node, lb, port);
    }
    if let Some(ip) = spec.external_ip {
        add("externalIP", From::External, ip, port);
        add("externalIP", From::Pod, ip, port);
    }
}

/// A probe's answer, in terms both layouts must agree on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Answer {
    /// How the flows ended: `POD saw SOURCE` for each answer (without affinity), else the
    /// outcome; with affinity, whether one pod answered them all.
    kinds: BTreeSet<String>,
    /// With affinity: the sources each answering pod saw. Which pod a client is pinned to is
    /// chance, and the source a masqueraded flow shows depends on the pod, so only pods that
    /// answered in both layouts are compared.
    pinned: BTreeMap<String, BTreeSet<String>>,
}

impl Answer {
    fn of(tally: &Tally, affinity: bool) -> Self {
        let mut out = Self::default();
        for outcome in tally.outcomes() {
            match outcome {
                Outcome::Answered {
                    pod,
                    seen_source,
                    client,
                    ..
                } => {
                    let seen = source_kind(seen_source.ip(), client.ip());
                    if affinity {
                        out.pinned.entry(pod.clone()).or_default().insert(seen);
                    } else {
                        out.kinds.insert(format!("{pod} saw {seen}"));
                    }
                }
                other => {
                    out.kinds.insert(format!("{other:?}"));
                }
            }
        }
        if affinity && tally.answered() > 0 {
            let pinned = tally.by_pod().len() == 1;
            let kind = if pinned {
                "pinned to one pod"
            } else {
                "spread over pods"
            };
            out.kinds.insert(kind.to_owned());
        }
        out
    }

    /// Whether some flow was answered.
    fn answered(&self) -> bool {
        !self.pinned.is_empty() || self.kinds.iter().any(|kind| kind.contains(" saw "))
    }

    fn agrees(&self, other: &Self) -> bool {
        self.kinds == other.kinds
            && self
                .pinned
                .iter()
                .all(|(pod, seen)| other.pinned.get(pod).is_none_or(|theirs| theirs == seen))
    }

    fn extend(&mut self, more: Self) {
        self.kinds.extend(more.kinds);
        for (pod, seen) in more.pinned {
            self.pinned.entry(pod).or_default().extend(seen);
        }
    }
}

/// The source an endpoint saw: the client's own, or the address it was masqueraded to.
fn source_kind(seen: IpAddr, client: IpAddr) -> String {
    if seen == client {
        "the client".to_owned()
    } else {
        seen.to_string()
    }
}

fn host(cluster: &Cluster, from: From) -> &Host {
    match from {
        From::Pod => cluster.client(),
        From::Node => cluster.node(),
        From::External => cluster.external_in(),
    }
}

fn run_probe(cluster: &Cluster, probe: &Probe, flows: usize) -> Tally {
    let dst = std::net::SocketAddr::new(probe.dst, probe.port);
    cluster
        .probe(host(cluster, probe.from), probe.protocol, dst, flows)
        .unwrap_or_else(|e| panic!("{probe}: {e}"))
}

/// One layout's cluster, proxy and answers.
struct Run {
    env: Env,
    answers: Vec<Answer>,
}

fn run_layout(case: &Case, mode: Mode, probes: &[Probe]) -> Run {
    let cluster = case.cluster();
    let services: Vec<Service> = case.services.iter().map(|s| s.service(&cluster)).collect();
    let env = Env::start_with(mode, cluster, case.settings.flags(), &services, &[]);
    let answers = probes
        .iter()
        .map(|probe| Answer::of(&run_probe(&env.cluster, probe, FLOWS), probe.affinity))
        .collect();
    Run { env, answers }
}

/// The probes whose answers differ after a re-probe with [`REPROBE_FLOWS`] more flows.
fn differences(
    chains: &mut Run,
    maps: &mut Run,
    probes: &[Probe],
) -> BTreeMap<String, (Answer, Answer)> {
    let mut out = BTreeMap::new();
    for (index, probe) in probes.iter().enumerate() {
        let (a, b) = (&chains.answers[index], &maps.answers[index]);
        if a.agrees(b) {
            continue;
        }
        // Only chance among endpoints can hide a pod: a probe no endpoint answered in one
        // layout differs for good.
        if !(a.answered() && b.answered()) {
            out.insert(format!("{index:02} {probe}"), (a.clone(), b.clone()));
            continue;
        }
        let (more_chains, more_maps) = std::thread::scope(|s| {
            let a = s.spawn(|| {
                Answer::of(
                    &run_probe(&chains.env.cluster, probe, REPROBE_FLOWS),
                    probe.affinity,
                )
            });
            let b = s.spawn(|| {
                Answer::of(
                    &run_probe(&maps.env.cluster, probe, REPROBE_FLOWS),
                    probe.affinity,
                )
            });
            (
                a.join().expect("probe thread"),
                b.join().expect("probe thread"),
            )
        });
        chains.answers[index].extend(more_chains);
        maps.answers[index].extend(more_maps);
        if !chains.answers[index].agrees(&maps.answers[index]) {
            out.insert(
                format!("{index:02} {probe}"),
                (chains.answers[index].clone(), maps.answers[index].clone()),
            );
        }
    }
    out
}

/// Runs one case in both layouts; `Err` describes every probe that differs.
fn check_case(case: &Case) -> Result<usize, String> {
    let probes = case.probes();
    let (mut chains, mut maps) = std::thread::scope(|s| {
        let a = s.spawn(|| run_layout(case, Mode::NftablesChains, &probes));
        let b = s.spawn(|| run_layout(case, Mode::Nftables, &probes));
        (
            a.join().expect("chain layout thread"),
            b.join().expect("maps layout thread"),
        )
    });
    let differ = differences(&mut chains, &mut maps, &probes);
    if differ.is_empty() {
        return Ok(probes.len());
    }
    let mut report = format!(
        "seed {} (rerun: KP_DIFF_SEEDS={}): {} of {} probes differ between the layouts\ncase: {case:#?}\n",
        case.seed,
        case.seed,
        differ.len(),
        probes.len()
    );
    for (probe, (a, b)) in &differ {
        report += &format!("  {probe}\n    chains: {a:?}\n    maps:   {b:?}\n");
    }
    report += &format!(
        "--- chain layout ---{}\n--- verdict-free layout ---{}",
        chains.env.diag(),
        maps.env.diag()
    );
    Err(report)
}

/// The seeds to run: `KP_DIFF_SEEDS`, else the fixed ones plus `KP_DIFF_CASES` random ones.
fn seeds() -> Vec<u64> {
    if let Ok(list) = std::env::var("KP_DIFF_SEEDS") {
        return list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .expect("KP_DIFF_SEEDS: comma-separated numbers")
            })
            .collect();
    }
    let extra: u64 = std::env::var("KP_DIFF_CASES")
        .ok()
        .map_or(0, |n| n.parse().expect("KP_DIFF_CASES: a number"));
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut rng = Rng(start);
    FIXED_SEEDS
        .into_iter()
        .chain((0..extra).map(|_| rng.next() % 1_000_000))
        .collect()
}

/// Every seed's case, in both layouts: each probe must end the same way in both.
pub fn layouts_agree() {
    let mut failures = Vec::new();
    for seed in seeds() {
        let case = Case::draw(seed);
        eprintln!("seed {seed}: {case:?}");
        match check_case(&case) {
            Ok(probes) => eprintln!("seed {seed}: {probes} probes, the layouts agree"),
            Err(report) => {
                eprintln!("{report}");
                failures.push(seed);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "the layouts differ for seeds {failures:?} (reports above)"
    );
}
