//! A slot-count class's sets, maps and rules as data ([`ClassObject`]): what
//! [`count_part`](super::fixed::class_part) prints as `nft -f` statements, and what
//! `kp_nftnl::class` lowers to netlink, so both paths write the same objects.
//!
//! Affinity classes are not described here yet: they go as text only.

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};

use super::element::{EntrySet, PROTOCOLS, Slots, entry_set_name, slot_map_name};
use super::fixed::{FixedConfig, PICK, SHORT_CIRCUIT};
use super::state::Class;

/// How a NodePort entry's destination is matched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePortDst {
    /// `ip daddr @nodeport-ips` (`nodePortAddresses` set).
    Ips,
    /// `fib daddr type local ip daddr != 127.0.0.0/8` (`::1` for IPv6).
    LocalNotLoopback,
}

/// How traffic from this node's pods is recognised (the detector of the table's family).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodMatch {
    /// `ip saddr <cidr>` (truncated).
    Cidr(IpNet),
    /// `iifname "<name>"`, or `iifname "<name>*"` when `wildcard`.
    Iifname {
        /// The interface name or prefix.
        name: String,
        /// A prefix match.
        wildcard: bool,
    },
}

/// Which sources a pick rule takes besides its entry match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Every source.
    Any,
    /// `fib saddr type local`: this node.
    Local,
    /// This node's pods.
    Pods(PodMatch),
}

/// `meta l4proto P [dst] [source] <key> @set dnat ip to <key> . numgen random mod N map @map`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PickRule {
    /// [`PICK`] or [`SHORT_CIRCUIT`].
    pub chain: &'static str,
    /// The protocol matched (and the map's).
    pub proto: Protocol,
    /// For NodePort entries, their destination match (the key is then `meta l4proto . th
    /// dport`).
    pub node_port: Option<NodePortDst>,
    /// The sources matched.
    pub source: Source,
    /// The entry set.
    pub set: String,
    /// The slot count (`numgen` modulus).
    pub count: u32,
    /// The slot map.
    pub map: String,
}

/// One object of a class, in the order the class is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClassObject {
    /// The entry set: `type <addr> . inet_proto . inet_service` (no address for NodePorts).
    EntrySet {
        /// Set name.
        name: String,
        /// NodePort entries.
        node_port: bool,
    },
    /// `typeof <key> . numgen random mod 1 : ip daddr . <proto> dport`.
    SlotMap {
        /// Map name.
        name: String,
        /// NodePort entries.
        node_port: bool,
        /// The protocol of its data's port.
        proto: Protocol,
    },
    /// A rule.
    Pick(PickRule),
}

impl FixedConfig {
    /// This family's pod detector as data, if it has one.
    pub fn pod_match(&self) -> Option<PodMatch> {
        use crate::config::LocalDetector;
        match &self.detector {
            LocalDetector::None => None,
            LocalDetector::Cidrs(cidrs) => cidrs
                .iter()
                .find(|c| IpFamily::of_net(c) == self.family)
                .map(|c| PodMatch::Cidr(c.trunc())),
            LocalDetector::BridgeInterface(name) => Some(PodMatch::Iifname {
                name: name.clone(),
                wildcard: false,
            }),
            LocalDetector::InterfaceNamePrefix(p) => Some(PodMatch::Iifname {
                name: p.clone(),
                wildcard: true,
            }),
        }
    }

    /// How NodePort destinations are matched.
    pub fn node_port_dst(&self) -> NodePortDst {
        if self.node_port_addresses.nftables_ips(self.family).is_some() {
            NodePortDst::Ips
        } else {
            NodePortDst::LocalNotLoopback
        }
    }
}

/// The objects of `class`, or `None` for a class only text describes (affinity).
pub fn class_objects(config: &FixedConfig, class: Class) -> Option<Vec<ClassObject>> {
    match class {
        Class::Count(slots, n) => Some(count_objects(config, slots, n)),
        Class::Affinity(_) | Class::LegacyAffinity(_) => None,
    }
}

/// The entry sets with `n` slots of `slots`, their maps and the rules picking among them.
pub fn count_objects(config: &FixedConfig, slots: Slots, n: u32) -> Vec<ClassObject> {
    let mut out = Vec::new();
    for node_port in [false, true] {
        let set = entry_set_name(EntrySet::Count(slots, n), node_port);
        out.push(ClassObject::EntrySet {
            name: set.clone(),
            node_port,
        });
        for proto in PROTOCOLS {
            let map = slot_map_name(slots, n, node_port, proto);
            out.push(ClassObject::SlotMap {
                name: map.clone(),
                node_port,
                proto,
            });
            let rule = |chain, source| {
                ClassObject::Pick(PickRule {
                    chain,
                    proto,
                    node_port: node_port.then(|| config.node_port_dst()),
                    source,
                    set: set.clone(),
                    count: n,
                    map: map.clone(),
                })
            };
            match slots {
                Slots::Policy => out.push(rule(PICK, Source::Any)),
                Slots::ShortCircuit => {
                    out.push(rule(SHORT_CIRCUIT, Source::Local));
                    if let Some(pods) = config.pod_match() {
                        out.push(rule(SHORT_CIRCUIT, Source::Pods(pods)));
                    }
                }
            }
        }
    }
    out
}

fn ip(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

impl ClassObject {
    /// The `nft -f` statement of the object on `family`'s table.
    pub fn statement(&self, family: IpFamily) -> String {
        let ip = ip(family);
        let table = format!("{ip} {}", crate::nftables::TABLE);
        let key = |node_port: bool| {
            if node_port {
                "meta l4proto . th dport".to_owned()
            } else {
                format!("{ip} daddr . meta l4proto . th dport")
            }
        };
        match self {
            ClassObject::EntrySet { name, node_port } => {
                let addr = match family {
                    IpFamily::V4 => "ipv4_addr . ",
                    IpFamily::V6 => "ipv6_addr . ",
                };
                let addr = if *node_port { "" } else { addr };
                format!("add set {table} {name} {{ type {addr}inet_proto . inet_service ; }}")
            }
            ClassObject::SlotMap {
                name,
                node_port,
                proto,
            } => format!(
                "add map {table} {name} {{ typeof {} . numgen random mod 1 : {ip} daddr . {} dport ; }}",
                key(*node_port),
                proto.as_str()
            ),
            ClassObject::Pick(rule) => {
                let mut text = format!(
                    "add rule {table} {} meta l4proto {} ",
                    rule.chain,
                    rule.proto.as_str()
                );
                match rule.node_port {
                    Some(NodePortDst::Ips) => text += &format!("{ip} daddr @nodeport-ips "),
                    Some(NodePortDst::LocalNotLoopback) => {
                        let loopback = match family {
                            IpFamily::V4 => "127.0.0.0/8",
                            IpFamily::V6 => "::1",
                        };
                        text += &format!("fib daddr type local {ip} daddr != {loopback} ");
                    }
                    None => {}
                }
                match &rule.source {
                    Source::Any => {}
                    Source::Local => text += "fib saddr type local ",
                    Source::Pods(PodMatch::Cidr(net)) => text += &format!("{ip} saddr {net} "),
                    Source::Pods(PodMatch::Iifname { name, wildcard }) => {
                        let star = if *wildcard { "*" } else { "" };
                        text += &format!("iifname \"{name}{star}\" ");
                    }
                }
                let key = key(rule.node_port.is_some());
                text += &format!(
                    "{key} @{} dnat {ip} to {key} . numgen random mod {} map @{}",
                    rule.set, rule.count, rule.map
                );
                text
            }
        }
    }
}
