//! Userspace mode's capture rules: nat rules that redirect a service's addresses to the
//! local relay's ports, and filter rules for the services the relay cannot serve.
//!
//! Per family (one `iptables-restore --noflush` each):
//!
//! - nat `KUBE-USERSPACE` (jumped to from `PREROUTING` and `OUTPUT`) dispatches on
//!   destination: a ClusterIP to the port's `KUBE-USR-<hash>` chain, externalIPs and
//!   LoadBalancer IPs to `KUBE-USX-<hash>` (through `KUBE-USF-<hash>` when the service has
//!   loadBalancerSourceRanges), and local destinations to `KUBE-USERSPACE-NODEPORTS`, which
//!   sends NodePorts to `KUBE-USX-<hash>`.
//! - `KUBE-USR-*` / `KUBE-USX-*` hold one rule sending the packet to the relay's internal or
//!   external frontend: `DNAT` to the relay's address and port when the plan has a relay
//!   address for the family (a local address of the node), else `REDIRECT --to-ports`.
//!   `REDIRECT` rewrites the destination to the primary address of the receiving interface
//!   (127.0.0.1 for locally generated traffic) and the kernel drops the packet when that
//!   interface has no address of the family, as a routed pod veth (Calico style, or the
//!   node ends of `/32` pod routes) often has none; `DNAT` to a fixed local address works
//!   whatever the interface. Replies flow back through conntrack's reverse translation.
//! - `KUBE-USX-*` first sends the node's own traffic (`--src-type LOCAL`) to `KUBE-USR-*`
//!   when the port says so (`externalTrafficPolicy: Local` with cluster-wide internal
//!   endpoints): upstream treats the node's traffic to its external addresses as internal.
//! - `KUBE-USF-*` redirects sources inside the ranges (and, when a node IP is inside them,
//!   the LB IPs themselves as sources: a VIP on the node, upstream's allowFromNode) and marks
//!   the rest with the drop bit.
//! - filter `KUBE-USERSPACE-FILTER` (from `INPUT`, `FORWARD`, `OUTPUT`) drops marked
//!   packets, REJECTs services without endpoints and DROPs external traffic of
//!   `externalTrafficPolicy: Local` services without a local endpoint (as iptables mode).
//!
//! The hash is iptables mode's (`KUBE-SVC-<hash>` of the same port), so the two modes' rules
//! for one service are easy to correlate. Names from API objects appear only in comments,
//! percent-encoded by [`crate::iptables::comment`]. Partial renders rewrite the top-level
//! chains and only the per-service chains of changed ports; unchanged ones keep their rules
//! (their relay ports do not change while the relay runs).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{IpFamily, ServicePortName};

use crate::iptables::NodePortAddresses;
use crate::iptables::comment::comment_args;
use crate::iptables::names::service_port_hash;
use crate::iptables::{JumpRule, Table};

/// nat dispatch chain, jumped to from `PREROUTING` and `OUTPUT`.
pub const KUBE_USERSPACE: &str = "KUBE-USERSPACE";
/// nat chain of NodePorts, entered for local destinations.
pub const KUBE_USERSPACE_NODEPORTS: &str = "KUBE-USERSPACE-NODEPORTS";
/// filter chain, jumped to from `INPUT`, `FORWARD` and `OUTPUT`.
pub const KUBE_USERSPACE_FILTER: &str = "KUBE-USERSPACE-FILTER";
/// Prefix of a service port's internal (ClusterIP) redirect chain.
pub const INTERNAL_PREFIX: &str = "KUBE-USR-";
/// Prefix of a service port's external (NodePort, externalIP, LB IP) redirect chain.
pub const EXTERNAL_PREFIX: &str = "KUBE-USX-";
/// Prefix of a service port's loadBalancerSourceRanges chain.
pub const FIREWALL_PREFIX: &str = "KUBE-USF-";
/// Every per-service chain prefix of this mode: chains with these prefixes that a render
/// does not produce are stale.
pub const SERVICE_CHAIN_PREFIXES: [&str; 3] = [INTERNAL_PREFIX, EXTERNAL_PREFIX, FIREWALL_PREFIX];

/// The packet-mark bit meaning "drop in filter": upstream's `--iptables-drop-bit` default,
/// from the time its modes marked packets for dropping.
pub const DEFAULT_DROP_BIT: u8 = 15;

/// IPv4 loopback, excluded from NodePorts unless localhost NodePorts are on.
const IPV4_LOOPBACK: &str = "127.0.0.0/8";

/// What happens to one kind of traffic of a service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Redirected to this relay port.
    Redirect(u16),
    /// Refused (no endpoints at all): ICMP port unreachable, as iptables mode.
    Reject,
    /// Dropped (eTP Local without a local endpoint), as iptables mode.
    Drop,
}

/// One service port of one family, as the capture rules see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturedPort {
    /// The service port.
    pub name: ServicePortName,
    /// The service port number.
    pub port: u16,
    /// This family's ClusterIP.
    pub cluster_ip: IpAddr,
    /// This family's externalIPs.
    pub external_ips: Vec<IpAddr>,
    /// This family's LoadBalancer ingress IPs.
    pub load_balancer_ips: Vec<IpAddr>,
    /// This family's loadBalancerSourceRanges (they apply to LB IPs only).
    pub source_ranges: Vec<IpNet>,
    /// The NodePort, if any.
    pub node_port: Option<u16>,
    /// ClusterIP traffic.
    pub internal: Target,
    /// NodePort, externalIP and LB IP traffic (unused when there is none).
    pub external: Target,
    /// The node's own traffic to external destinations is internal traffic (goes where
    /// ClusterIP traffic goes): set for `externalTrafficPolicy: Local` when the internal
    /// policy uses cluster-wide endpoints, as upstream's "route LOCAL traffic" rule.
    pub local_source_internal: bool,
    /// A node IP of this family is inside `source_ranges`, so LB IPs as sources are admitted
    /// too (the node's own traffic to a VIP it holds has the VIP as its source).
    pub allow_from_node: bool,
}

impl CapturedPort {
    /// Whether the port has any external destination.
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some()
            || !self.external_ips.is_empty()
            || !self.load_balancer_ips.is_empty()
    }

    /// Whether LB IPs are guarded by source ranges.
    fn firewalled(&self) -> bool {
        !self.load_balancer_ips.is_empty() && !self.source_ranges.is_empty()
    }

    /// Whether `KUBE-USX-*` sends the node's own traffic to `KUBE-USR-*`.
    fn local_shortcut(&self) -> bool {
        self.local_source_internal && matches!(self.internal, Target::Redirect(_))
    }
}

/// The per-service chain names of a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureChains {
    /// `KUBE-USR-<hash>`.
    pub internal: String,
    /// `KUBE-USX-<hash>`.
    pub external: String,
    /// `KUBE-USF-<hash>`.
    pub firewall: String,
}

impl CaptureChains {
    /// Names for one service port.
    pub fn new(name: &ServicePortName) -> Self {
        let hash = service_port_hash(name);
        Self {
            internal: format!("{INTERNAL_PREFIX}{hash}"),
            external: format!("{EXTERNAL_PREFIX}{hash}"),
            firewall: format!("{FIREWALL_PREFIX}{hash}"),
        }
    }
}

/// The configuration the capture rules depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureConfig {
    /// Which node addresses accept NodePorts.
    pub node_port_addresses: NodePortAddresses,
    /// Accept NodePorts on 127.0.0.0/8 (IPv4; no route_localnet needed: the redirect stays
    /// on the node).
    pub localhost_node_ports: bool,
    /// Mark bit for "drop" ([`DEFAULT_DROP_BIT`]).
    pub drop_bit: u8,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        Self {
            node_port_addresses: NodePortAddresses::All,
            localhost_node_ports: true,
            drop_bit: DEFAULT_DROP_BIT,
        }
    }
}

/// A render: the restore input and every per-service chain the rules now use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureRender {
    /// `iptables-restore --noflush` input (filter and nat tables).
    pub text: String,
    /// Per-service chains that exist after applying `text`.
    pub chains: BTreeSet<String>,
}

/// Renders one family's capture rules. `ports` must be that family's (their addresses of
/// `family`); `relay_address` is where to DNAT to (a local address of `family` the relay
/// listens on), or `None` to REDIRECT; `changed` is `None` for a full render (every
/// per-service chain written) or the ports whose chains must be rewritten; `existing` the
/// per-service chains currently in the kernel (those no longer used are deleted).
pub fn render(
    family: IpFamily,
    ports: &[CapturedPort],
    config: &CaptureConfig,
    relay_address: Option<IpAddr>,
    changed: Option<&BTreeSet<ServicePortName>>,
    existing: &BTreeSet<String>,
) -> CaptureRender {
    let mut capture = Capture::new(family, config, relay_address);
    for p in ports {
        let port = Port {
            p,
            proto: p.name.protocol.as_str(),
            chains: CaptureChains::new(&p.name),
            write: changed.is_none_or(|set| set.contains(&p.name)),
        };
        capture.internal(&port);
        if !p.externally_accessible() {
            continue;
        }
        let redirects = matches!(p.external, Target::Redirect(_));
        if redirects || p.local_shortcut() {
            capture.external_dispatch(&port);
            if port.write {
                capture.external_chains(&port);
            }
        }
        if !redirects {
            capture.external_filter(&port);
        }
    }
    capture.finish(existing)
}

/// One port as [`render`] writes it.
struct Port<'p> {
    p: &'p CapturedPort,
    /// Its protocol as iptables spells it.
    proto: &'static str,
    chains: CaptureChains,
    /// Its per-service chains are (re)written.
    write: bool,
}

impl Port<'_> {
    /// The matches of destination `ip:port` of this port's protocol.
    fn dest(&self, ip: &IpAddr, port: u16) -> String {
        let proto = self.proto;
        format!("-d {} -p {proto} -m {proto} --dport {port}", host(ip))
    }

    /// The external destinations with what comments call them.
    fn external_dests(&self) -> impl Iterator<Item = (&IpAddr, &'static str)> {
        let p = self.p;
        p.external_ips
            .iter()
            .map(|ip| (ip, "external IP"))
            .chain(p.load_balancer_ips.iter().map(|ip| (ip, "loadbalancer IP")))
    }
}

/// `ip/32` or `ip/128`.
fn host(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
}

/// The restore input of one render, by part, and the per-service chains it uses.
struct Capture<'c> {
    family: IpFamily,
    config: &'c CaptureConfig,
    relay_address: Option<IpAddr>,
    /// `--mark`/`--set-xmark` value of the drop bit.
    mark: String,
    /// filter `KUBE-USERSPACE-FILTER` rules.
    filter: String,
    /// Declarations of the per-service chains written.
    nat_heads: String,
    /// nat `KUBE-USERSPACE` rules.
    dispatch: String,
    /// nat `KUBE-USERSPACE-NODEPORTS` rules.
    nodeports: String,
    /// The per-service chains' rules.
    service_rules: String,
    chains: BTreeSet<String>,
}

impl<'c> Capture<'c> {
    fn new(family: IpFamily, config: &'c CaptureConfig, relay_address: Option<IpAddr>) -> Self {
        let bit = 1u32 << config.drop_bit;
        let mark = format!("{bit:#x}/{bit:#x}");
        let mut filter = String::new();
        let _ = writeln!(
            filter,
            "-A {KUBE_USERSPACE_FILTER} {} -m mark --mark {mark} -j DROP",
            comment_args("kubernetes userspace: dropped by loadBalancerSourceRanges")
        );
        Self {
            family,
            config,
            relay_address,
            mark,
            filter,
            nat_heads: String::new(),
            dispatch: String::new(),
            nodeports: String::new(),
            service_rules: String::new(),
            chains: BTreeSet::new(),
        }
    }

    /// A per-service chain in use, declared when its port is written.
    fn declare(&mut self, chain: &str, write: bool) {
        self.chains.insert(chain.to_owned());
        if write {
            let _ = writeln!(self.nat_heads, ":{chain} - [0:0]");
        }
    }

    /// ClusterIP traffic: dispatched to `KUBE-USR-*` and the relay, or refused.
    fn internal(&mut self, port: &Port<'_>) {
        let (p, chain) = (port.p, &port.chains.internal);
        self.declare(chain, port.write);
        match p.internal {
            Target::Redirect(relay) => {
                let _ = writeln!(
                    self.dispatch,
                    "-A {KUBE_USERSPACE} {} {} -j {chain}",
                    comment_args(&format!("{} cluster IP", p.name)),
                    port.dest(&p.cluster_ip, p.port),
                );
                if port.write {
                    self.redirect(chain, port, relay);
                }
            }
            Target::Reject | Target::Drop => {
                let _ = writeln!(
                    self.filter,
                    "-A {KUBE_USERSPACE_FILTER} {} {} -j {}",
                    comment_args(&format!("{} has no endpoints", p.name)),
                    port.dest(&p.cluster_ip, p.port),
                    verdict(p.internal)
                );
            }
        }
    }

    /// External traffic's dispatch: externalIPs and LB IPs (through the firewall chain when
    /// firewalled) and the NodePort to `KUBE-USX-*`.
    fn external_dispatch(&mut self, port: &Port<'_>) {
        let (p, chains) = (port.p, &port.chains);
        self.declare(&chains.external, port.write);
        if p.firewalled() {
            self.declare(&chains.firewall, port.write);
        }
        for (ip, what) in port.external_dests() {
            let to = if what == "loadbalancer IP" && p.firewalled() {
                &chains.firewall
            } else {
                &chains.external
            };
            let _ = writeln!(
                self.dispatch,
                "-A {KUBE_USERSPACE} {} {} -j {to}",
                comment_args(&format!("{} {what}", p.name)),
                port.dest(ip, p.port)
            );
        }
        if let Some(node_port) = p.node_port {
            let proto = port.proto;
            let _ = writeln!(
                self.nodeports,
                "-A {KUBE_USERSPACE_NODEPORTS} {} -p {proto} -m {proto} --dport {node_port} -j {}",
                comment_args(&p.name.to_string()),
                chains.external
            );
        }
    }

    /// The rules of `KUBE-USX-*` (the node's own traffic to `KUBE-USR-*`, then the relay)
    /// and `KUBE-USF-*`.
    fn external_chains(&mut self, port: &Port<'_>) {
        let (p, chains) = (port.p, &port.chains);
        if p.local_shortcut() {
            let _ = writeln!(
                self.service_rules,
                "-A {} {} -m addrtype --src-type LOCAL -j {}",
                chains.external,
                comment_args(&format!(
                    "route LOCAL traffic for {} external destinations",
                    p.name
                )),
                chains.internal
            );
        }
        if let Target::Redirect(relay) = p.external {
            self.redirect(&chains.external, port, relay);
        }
        if p.firewalled() {
            self.firewall_chain(port);
        }
    }

    /// `KUBE-USF-*`: sources inside the ranges (and the LB IPs, when the node is inside
    /// them) go on to `KUBE-USX-*`, the rest is marked for dropping.
    fn firewall_chain(&mut self, port: &Port<'_>) {
        let (p, chains, out) = (port.p, &port.chains, &mut self.service_rules);
        let lb_comment = comment_args(&format!("{} loadbalancer IP", p.name));
        for range in &p.source_ranges {
            let _ = writeln!(
                out,
                "-A {} {lb_comment} -s {} -j {}",
                chains.firewall,
                range.trunc(),
                chains.external
            );
        }
        if p.allow_from_node {
            // The LB IP is often a local address, so the node's own traffic to it has the LB
            // IP as its source.
            for ip in &p.load_balancer_ips {
                let _ = writeln!(
                    out,
                    "-A {} {lb_comment} -s {} -j {}",
                    chains.firewall,
                    host(ip),
                    chains.external
                );
            }
        }
        let _ = writeln!(
            out,
            "-A {} {} -j MARK --set-xmark {}",
            chains.firewall,
            comment_args(&format!("{} outside loadBalancerSourceRanges", p.name)),
            self.mark,
        );
    }

    /// External traffic the relay does not take: refused (no endpoints) or dropped (no
    /// local endpoint) at every external destination and the NodePort.
    fn external_filter(&mut self, port: &Port<'_>) {
        let p = port.p;
        // Packets the rules above sent to the relay no longer have these destinations.
        let why = if p.external == Target::Reject {
            "has no endpoints"
        } else {
            "has no local endpoints"
        };
        let text = comment_args(&format!("{} {why}", p.name));
        for (ip, _) in port.external_dests() {
            let _ = writeln!(
                self.filter,
                "-A {KUBE_USERSPACE_FILTER} {text} {} -j {}",
                port.dest(ip, p.port),
                verdict(p.external)
            );
        }
        if let Some(node_port) = p.node_port {
            let proto = port.proto;
            for local in local_matches(self.family, self.config) {
                let _ = writeln!(
                    self.filter,
                    "-A {KUBE_USERSPACE_FILTER} {text} {local} -p {proto} -m {proto} --dport {node_port} -j {}",
                    verdict(p.external)
                );
            }
        }
    }

    /// `-A <chain> ... -j DNAT --to-destination <address>:<relay>`, or without an address
    /// `-j REDIRECT --to-ports <relay>`.
    fn redirect(&mut self, chain: &str, port: &Port<'_>, relay: u16) {
        let (out, proto) = (&mut self.service_rules, port.proto);
        let comment = comment_args(&format!("{} to the userspace relay", port.p.name));
        let _ = match self.relay_address {
            Some(ip) => writeln!(
                out,
                "-A {chain} {comment} -p {proto} -j DNAT --to-destination {}",
                std::net::SocketAddr::new(ip, relay)
            ),
            None => writeln!(
                out,
                "-A {chain} {comment} -p {proto} -j REDIRECT --to-ports {relay}"
            ),
        };
    }

    /// The restore input: filter, then nat with the NodePort dispatch last, stale
    /// per-service chains emptied and deleted.
    fn finish(mut self, existing: &BTreeSet<String>) -> CaptureRender {
        for local in local_matches(self.family, self.config) {
            let _ = writeln!(
                self.dispatch,
                "-A {KUBE_USERSPACE} {} {local} -j {KUBE_USERSPACE_NODEPORTS}",
                comment_args("kubernetes userspace: node ports; must be last")
            );
        }
        let stale: Vec<&String> = existing
            .iter()
            .filter(|c| !self.chains.contains(*c))
            .filter(|c| SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p)))
            .collect();
        let mut text = String::new();
        let _ = writeln!(text, "*filter\n:{KUBE_USERSPACE_FILTER} - [0:0]");
        text.push_str(&self.filter);
        text.push_str("COMMIT\n*nat\n");
        let _ = writeln!(
            text,
            ":{KUBE_USERSPACE} - [0:0]\n:{KUBE_USERSPACE_NODEPORTS} - [0:0]"
        );
        text.push_str(&self.nat_heads);
        for c in &stale {
            let _ = writeln!(text, ":{c} - [0:0]");
        }
        text.push_str(&self.dispatch);
        text.push_str(&self.nodeports);
        text.push_str(&self.service_rules);
        for c in &stale {
            let _ = writeln!(text, "-X {c}");
        }
        text.push_str("COMMIT\n");
        CaptureRender {
            text,
            chains: self.chains,
        }
    }
}

fn verdict(target: Target) -> &'static str {
    match target {
        Target::Drop => "DROP",
        Target::Reject | Target::Redirect(_) => "REJECT",
    }
}

/// The matches selecting NodePort destinations of `family`: every local address (minus
/// loopback unless localhost NodePorts are on), or each allowed node address.
fn local_matches(family: IpFamily, config: &CaptureConfig) -> Vec<String> {
    match config.node_port_addresses.for_family(family) {
        NodePortAddresses::All => {
            let mut m = "-m addrtype --dst-type LOCAL".to_owned();
            if family == IpFamily::V4 && !config.localhost_node_ports {
                let _ = write!(m, " ! -d {IPV4_LOOPBACK}");
            }
            vec![m]
        }
        NodePortAddresses::Ips(ips) => ips
            .iter()
            .map(|ip| match ip {
                IpAddr::V4(_) => format!("-d {ip}/32"),
                IpAddr::V6(_) => format!("-d {ip}/128"),
            })
            .collect(),
    }
}

/// The jumps from the built-in chains into this mode's chains, ensured on full syncs.
pub fn jumps() -> Vec<JumpRule> {
    let jump = |table, from, to: &'static str, extra: &str| JumpRule {
        table,
        from,
        to,
        spec: format!(
            "{extra}{} -j {to}",
            comment_args("kubernetes userspace service portals")
        ),
        rule: None,
    };
    let new = "-m conntrack --ctstate NEW ";
    vec![
        jump(Table::Nat, "PREROUTING", KUBE_USERSPACE, ""),
        jump(Table::Nat, "OUTPUT", KUBE_USERSPACE, ""),
        jump(Table::Filter, "INPUT", KUBE_USERSPACE_FILTER, new),
        jump(Table::Filter, "FORWARD", KUBE_USERSPACE_FILTER, new),
        jump(Table::Filter, "OUTPUT", KUBE_USERSPACE_FILTER, new),
    ]
}
