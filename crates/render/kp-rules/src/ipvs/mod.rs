//! ipvs mode: the desired kernel state for one IP family, as data.
//!
//! [`plan`] turns the proxy state into upstream's ipvs layout: one IPVS virtual server per
//! (ClusterIP | externalIP | load-balancer IP | node IP for NodePorts, protocol, port), with
//! the service's endpoints (as [`crate::plan`] chooses them for every mode) as masquerading
//! real servers; the addresses to bind on the `kube-ipvs0` dummy device; and the ipset
//! entries the few iptables rules of [`rules`] match on. Applying it (diffing against the
//! kernel) is the backend's job.

pub mod ipset;
pub mod rules;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;
use kp_ipvs::{Protocol as IpvsProtocol, RealServer, Scheduler, ServiceKey, VirtualServer};

use crate::iptables::LocalDetector;
use crate::plan::{Masquerading, ServicePlan};
use ipset::{SetEntries, SetKind, empty_sets};

/// The dummy device holding every service address, so the kernel accepts their traffic as
/// local and hands it to IPVS.
pub const DUMMY_DEVICE: &str = "kube-ipvs0";

/// Weight of a real server that takes new connections.
pub const SERVING_WEIGHT: u32 = 1;
/// Weight of a terminating endpoint: it keeps its connections but gets no new ones.
pub const DRAINING_WEIGHT: u32 = 0;

/// The configuration the planner depends on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IpvsConfig {
    /// `ipvs.scheduler` (empty in the config means round robin).
    pub scheduler: Scheduler,
    /// The node addresses that accept NodePorts (resolved from nodePortAddresses, without
    /// loopback and kube-ipvs0's own addresses).
    pub node_ips: Vec<IpAddr>,
    /// This node's IP of each family as detected at start-up, for the allowance
    /// `loadBalancerSourceRanges` gives the node (as [`RenderConfig::node_ips`]; empty: the
    /// Node's addresses in the state).
    ///
    /// [`RenderConfig::node_ips`]: crate::iptables::RenderConfig::node_ips
    pub detected_node_ips: Vec<IpAddr>,
    /// How local pod traffic is recognised (for the masquerade rule).
    pub local_detector: LocalDetector,
    /// Masquerade all ClusterIP traffic.
    pub masquerade_all: bool,
    /// The masquerade mark's bit.
    pub masquerade_bit: u8,
    /// Drop forwarded packets in conntrack state INVALID.
    pub drop_invalid: bool,
    /// Use `MASQUERADE --random-fully`.
    pub random_fully: bool,
}

/// One desired virtual server and its real servers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredService {
    /// The virtual server.
    pub server: VirtualServer,
    /// Real servers, sorted by (address, port).
    pub real_servers: Vec<RealServer>,
    /// The Service it belongs to (for reporting a failure against that Service only).
    pub owner: ServiceName,
}

/// Everything ipvs mode programs for one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    /// The family.
    pub family: IpFamily,
    /// Virtual servers by key.
    pub services: BTreeMap<ServiceKey, DesiredService>,
    /// Addresses to bind on [`DUMMY_DEVICE`] (ClusterIPs, externalIPs, LB IPs).
    pub addresses: BTreeSet<IpAddr>,
    /// ipset contents.
    pub sets: SetEntries,
    /// Load-balancer virtual servers with source ranges that do not admit the node: the
    /// node's own connections to them are dropped ([`rules::render`]).
    pub lb_no_node_access: BTreeSet<ServiceKey>,
}

fn ipvs_protocol(p: Protocol) -> IpvsProtocol {
    match p {
        Protocol::Tcp => IpvsProtocol::Tcp,
        Protocol::Udp => IpvsProtocol::Udp,
        Protocol::Sctp => IpvsProtocol::Sctp,
    }
}

fn proto_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// `ip,proto:port`, ipset's syntax for hash:ip,port entries.
fn ip_port(ip: IpAddr, p: Protocol, port: u16) -> String {
    format!("{ip},{}:{port}", proto_name(p))
}

/// A source range as ipset prints it: a full-length prefix without its `/len`.
fn net_entry(net: &IpNet) -> String {
    if net.prefix_len() == net.max_prefix_len() {
        net.addr().to_string()
    } else {
        net.to_string()
    }
}

/// The affinity timeout in whole seconds, if the service has ClientIP affinity.
fn affinity(svc: &ServicePort) -> Option<u32> {
    svc.session_affinity.map(|a| {
        u32::try_from(a.timeout.as_secs())
            .unwrap_or(u32::MAX)
            .max(1)
    })
}

/// Real servers for `chosen` endpoints (serving weight), plus every other serving and
/// terminating endpoint of `all` at weight 0, so its connections drain.
fn real_servers(chosen: &[&Endpoint], all: &[Endpoint], family: IpFamily) -> Vec<RealServer> {
    let mut out: BTreeMap<(IpAddr, u16), u32> = BTreeMap::new();
    for e in all {
        if e.serving && e.terminating && IpFamily::of(&e.ip) == family {
            out.insert((e.ip, e.port), DRAINING_WEIGHT);
        }
    }
    for e in chosen {
        if IpFamily::of(&e.ip) == family {
            out.insert((e.ip, e.port), SERVING_WEIGHT);
        }
    }
    out.into_iter()
        .map(|((ip, port), weight)| RealServer::new(ip, port, weight))
        .collect()
}

/// The desired ipvs-mode state of `family`.
pub fn plan(state: &ProxyState, family: IpFamily, config: &IpvsConfig) -> Desired {
    plan_ports(state, family, config, state.services.iter())
}

/// The desired ipvs-mode state of `service`'s ports alone, in `family`: what a partial sync
/// that changes only this service needs. The union of every service's is [`plan`]'s.
pub fn plan_service(
    state: &ProxyState,
    family: IpFamily,
    config: &IpvsConfig,
    service: &ServiceName,
) -> Desired {
    plan_ports(state, family, config, state.service_ports(service))
}

fn plan_ports<'a>(
    state: &ProxyState,
    family: IpFamily,
    config: &IpvsConfig,
    ports: impl Iterator<Item = (&'a ServicePortName, &'a ServicePort)>,
) -> Desired {
    let mut desired = Desired {
        family,
        services: BTreeMap::new(),
        addresses: BTreeSet::new(),
        sets: empty_sets(),
        lb_no_node_access: BTreeSet::new(),
    };
    let none = Vec::new();
    // Upstream's node IP of this family (see `crate::iptables::node_ip`).
    let node_ip = crate::iptables::node_ip(&config.detected_node_ips, &state.node, family);
    for (name, full) in ports {
        let Some(svc) = full.for_family(family) else {
            continue;
        };
        let endpoints = state.endpoints.get(name).unwrap_or(&none);
        // The traffic policies' endpoint lists, decided once for every mode (ipvs mode has no
        // masquerade chains: `Masquerading` does not matter here).
        let plan = ServicePlan::new(
            &svc,
            endpoints,
            &state.node,
            node_ip,
            Masquerading::default(),
        );
        let port = PortEntries {
            name,
            svc: &svc,
            family,
            config,
            internal: real_servers(plan.list_or_cluster(plan.internal), endpoints, family),
            external: real_servers(plan.list_or_cluster(plan.external), endpoints, family),
            timeout: affinity(&svc),
        };
        port.cluster_ips(&mut desired);
        port.external_ips(&mut desired);
        port.load_balancer_ips(&mut desired, plan.allow_from_node);
        port.node_port(&mut desired);
        if let Some(hc) = svc.health_check_node_port {
            desired.put(SetKind::HealthCheckNodePort, hc.to_string());
        }
        // Hairpin: a local endpoint reaching its own service is masqueraded.
        for e in plan.endpoints.all_reachable.iter().filter(|e| e.is_local) {
            if IpFamily::of(&e.ip) == family {
                let entry = format!("{},{}", ip_port(e.ip, name.protocol, e.port), e.ip);
                desired.put(SetKind::LoopBack, entry);
            }
        }
    }
    let ips: BTreeSet<String> = desired.addresses.iter().map(IpAddr::to_string).collect();
    desired.sets.insert(SetKind::IpvsIps, ips);
    desired
}

impl Desired {
    /// An entry of set `kind`.
    fn put(&mut self, kind: SetKind, entry: String) {
        self.sets.entry(kind).or_default().insert(entry);
    }
}

/// One service port's part of the desired state: its virtual servers (with the real servers
/// of its traffic policies), their addresses on kube-ipvs0 and its ipset entries.
struct PortEntries<'p> {
    name: &'p ServicePortName,
    /// The port in the family planned.
    svc: &'p ServicePort,
    family: IpFamily,
    config: &'p IpvsConfig,
    /// Real servers of ClusterIP traffic.
    internal: Vec<RealServer>,
    /// Real servers of external traffic.
    external: Vec<RealServer>,
    /// The affinity timeout.
    timeout: Option<u32>,
}

impl PortEntries<'_> {
    /// The virtual server key of `ip:port`.
    fn key(&self, ip: IpAddr, port: u16) -> ServiceKey {
        ServiceKey {
            address: ip,
            protocol: ipvs_protocol(self.name.protocol),
            port,
        }
    }

    /// The virtual server `ip:port` with `servers`.
    fn add(&self, desired: &mut Desired, ip: IpAddr, port: u16, servers: &[RealServer]) {
        let key = self.key(ip, port);
        desired.services.insert(
            key,
            DesiredService {
                server: VirtualServer::new(key, self.config.scheduler, self.timeout),
                real_servers: servers.to_vec(),
                owner: self.name.service.clone(),
            },
        );
    }

    /// `ip,proto:port` of this port's protocol and service port.
    fn entry(&self, ip: IpAddr) -> String {
        ip_port(ip, self.name.protocol, self.svc.port)
    }

    fn cluster_ips(&self, desired: &mut Desired) {
        for &ip in &self.svc.cluster_ips {
            self.add(desired, ip, self.svc.port, &self.internal);
            desired.addresses.insert(ip);
            desired.put(SetKind::ClusterIp, self.entry(ip));
        }
    }

    fn external_ips(&self, desired: &mut Desired) {
        for &ip in &self.svc.external_ips {
            self.add(desired, ip, self.svc.port, &self.external);
            desired.addresses.insert(ip);
            desired.put(SetKind::ExternalIp, self.entry(ip));
            if self.svc.external_policy_local {
                desired.put(SetKind::ExternalIpLocal, self.entry(ip));
            }
        }
    }

    /// LoadBalancer IPs, with their source ranges: the ranges (and the LB IP itself when the
    /// plan allows the node, `allow_from_node`) are allowed, the node's own connections
    /// otherwise dropped.
    fn load_balancer_ips(&self, desired: &mut Desired, allow_from_node: bool) {
        let svc = self.svc;
        for &ip in &svc.load_balancer_ips {
            self.add(desired, ip, svc.port, &self.external);
            desired.addresses.insert(ip);
            let entry = self.entry(ip);
            desired.put(SetKind::LoadBalancer, entry.clone());
            if svc.external_policy_local {
                desired.put(SetKind::LoadBalancerLocal, entry.clone());
            }
            if svc.load_balancer_source_ranges.is_empty() {
                continue;
            }
            desired.put(SetKind::LoadBalancerFw, entry.clone());
            for net in &svc.load_balancer_source_ranges {
                let source = format!("{entry},{}", net_entry(net));
                desired.put(SetKind::LoadBalancerSourceCidr, source);
            }
            // The node's own connections to the LB IP (local on kube-ipvs0) leave with the LB
            // IP as source; allowed when a range admits the node, as upstream.
            if allow_from_node {
                desired.put(SetKind::LoadBalancerSourceIp, format!("{entry},{ip}"));
            } else {
                desired.lb_no_node_access.insert(self.key(ip, svc.port));
            }
        }
    }

    /// The NodePort: a virtual server on each node IP of the family, and its set entries
    /// (by port, or for SCTP by node IP and port).
    fn node_port(&self, desired: &mut Desired) {
        let Some(node_port) = self.svc.node_port else {
            return;
        };
        let family = self.family;
        let node_ips = || {
            self.config
                .node_ips
                .iter()
                .filter(move |ip| IpFamily::of(ip) == family)
        };
        for &ip in node_ips() {
            self.add(desired, ip, node_port, &self.external);
        }
        let local = self.svc.external_policy_local;
        let (all, local_kind) = match self.name.protocol {
            Protocol::Tcp => (SetKind::NodePortTcp, SetKind::NodePortLocalTcp),
            Protocol::Udp => (SetKind::NodePortUdp, SetKind::NodePortLocalUdp),
            Protocol::Sctp => {
                for &ip in node_ips() {
                    let entry = ip_port(ip, Protocol::Sctp, node_port);
                    if local {
                        desired.put(SetKind::NodePortLocalSctp, entry.clone());
                    }
                    desired.put(SetKind::NodePortSctp, entry);
                }
                return;
            }
        };
        desired.put(all, node_port.to_string());
        if local {
            desired.put(local_kind, node_port.to_string());
        }
    }
}
