//! A class's sets, maps and rules as data ([`ClassObject`]): a slot count's, or an affinity
//! service port's. [`class_part`](super::fixed::class_part) prints them as `nft -f`
//! statements and `kp_nftnl::class` lowers them to netlink, so both paths write the same
//! objects.

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};

use super::element::{
    AffinityPort, AffinitySet, EntrySet, PROTOCOLS, PinList, Slots, entry_set_name, slot_map_name,
};
use super::fixed::{AFFINITY, AFFINITY_RECORD, FixedConfig, PICK, SHORT_CIRCUIT};
use super::state::Class;

/// Clients an affinity map holds at most (nft's default, 65535, would silently stop
/// recording on a busy service).
pub const AFFINITY_SIZE: u32 = 1 << 20;

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

/// `[source] meta l4proto P [dst] <key> @set dnat <ip> to <ip> saddr map @addrs : <ip> saddr
/// map @ports` in [`AFFINITY`]: a pinned client's connection to one of `set`'s entries goes to
/// its pinned endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinLookup {
    /// The port's protocol.
    pub proto: Protocol,
    /// For NodePort entries, their destination match.
    pub node_port: Option<NodePortDst>,
    /// The sources matched, written first (the short-circuited sources).
    pub source: Source,
    /// The entry set.
    pub set: String,
    /// The pinned addresses' map.
    pub addrs: String,
    /// The pinned ports' map.
    pub ports: String,
}

/// `meta l4proto P ct status dnat <original key> @entries <ip> daddr . th dport @endpoints
/// update @addrs { <ip> saddr : <ip> daddr } update @ports { <ip> saddr : th dport }` in
/// [`AFFINITY_RECORD`]: after DNAT, the endpoint a new connection to one of the entries got
/// is pinned for its client, when it is one of the list's endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PinRecord {
    /// The port's protocol.
    pub proto: Protocol,
    /// NodePort entries (matched by the original protocol and port only).
    pub node_port: bool,
    /// The entry set.
    pub entries: String,
    /// The list's endpoints.
    pub endpoints: String,
    /// The pinned addresses' map.
    pub addrs: String,
    /// The pinned ports' map.
    pub ports: String,
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
    /// `typeof <ip> saddr : <ip> daddr` (`: <proto> dport` when `ports`): a pin list's
    /// clients, `flags dynamic,timeout` with the port's timeout and [`AFFINITY_SIZE`].
    PinMap {
        /// Map name.
        name: String,
        /// The endpoints' ports (else their addresses).
        ports: bool,
        /// The protocol of the ports.
        proto: Protocol,
        /// The timeout in seconds.
        seconds: u32,
    },
    /// `type <addr> . inet_service`: a pin list's endpoints.
    EndpointSet {
        /// Set name.
        name: String,
    },
    /// A lookup of the pins.
    PinLookup(PinLookup),
    /// A record of a pin.
    PinRecord(PinRecord),
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

/// The objects of `class`, or `None` for a class that is only ever deleted (an affinity
/// class of an earlier version).
pub fn class_objects(config: &FixedConfig, class: Class) -> Option<Vec<ClassObject>> {
    match class {
        Class::Count(slots, n) => Some(count_objects(config, slots, n)),
        Class::Affinity(port) => Some(affinity_objects(config, port)),
        Class::LegacyAffinity(_) => None,
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

pub(super) const AFFINITY_SETS: [AffinitySet; 4] = [
    AffinitySet::Record,
    AffinitySet::Cluster,
    AffinitySet::Local,
    AffinitySet::ShortCircuit,
];
pub(super) const PIN_LISTS: [PinList; 2] = [PinList::Cluster, PinList::Local];

/// An affinity port's maps and sets, its lookups (in [`AFFINITY`]) and its record rules (in
/// [`AFFINITY_RECORD`]).
pub fn affinity_objects(config: &FixedConfig, port: AffinityPort) -> Vec<ClassObject> {
    let mut out = Vec::new();
    for list in PIN_LISTS {
        for ports in [false, true] {
            out.push(ClassObject::PinMap {
                name: port.map_name(list, ports),
                ports,
                proto: port.proto,
                seconds: port.seconds,
            });
        }
        out.push(ClassObject::EndpointSet {
            name: port.endpoints_name(list),
        });
    }
    for node_port in [false, true] {
        for set in AFFINITY_SETS {
            out.push(ClassObject::EntrySet {
                name: port.entries_name(set, node_port),
                node_port,
            });
        }
        out.extend(pin_lookups(config, port, node_port));
        out.extend(PIN_LISTS.map(|list| {
            ClassObject::PinRecord(PinRecord {
                proto: port.proto,
                node_port,
                entries: port.entries_name(AffinitySet::Record, node_port),
                endpoints: port.endpoints_name(list),
                addrs: port.map_name(list, false),
                ports: port.map_name(list, true),
            })
        }));
    }
    out
}

/// The lookups of one entry kind: the cluster and local entries read their list's pins;
/// externalTrafficPolicy `Local` entries read the cluster pins from this node and its pods,
/// the local pins from elsewhere.
fn pin_lookups(config: &FixedConfig, port: AffinityPort, node_port: bool) -> Vec<ClassObject> {
    let lookup = |set, list, source| {
        ClassObject::PinLookup(PinLookup {
            proto: port.proto,
            node_port: node_port.then(|| config.node_port_dst()),
            source,
            set: port.entries_name(set, node_port),
            addrs: port.map_name(list, false),
            ports: port.map_name(list, true),
        })
    };
    let mut out = vec![
        lookup(AffinitySet::Cluster, PinList::Cluster, Source::Any),
        lookup(AffinitySet::Local, PinList::Local, Source::Any),
    ];
    let short = AffinitySet::ShortCircuit;
    out.push(lookup(short, PinList::Cluster, Source::Local));
    if let Some(pods) = config.pod_match() {
        out.push(lookup(short, PinList::Cluster, Source::Pods(pods)));
    }
    out.push(lookup(short, PinList::Local, Source::Any));
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
                entry_key(family, *node_port),
                proto.as_str()
            ),
            ClassObject::Pick(rule) => {
                let node_port = rule.node_port.is_some();
                format!(
                    "add rule {table} {} meta l4proto {} {}{}{key} @{} dnat {ip} to {key} . numgen random mod {} map @{}",
                    rule.chain,
                    rule.proto.as_str(),
                    dst_text(family, rule.node_port),
                    source_text(family, &rule.source),
                    rule.set,
                    rule.count,
                    rule.map,
                    key = entry_key(family, node_port),
                )
            }
            ClassObject::PinMap {
                name,
                ports,
                proto,
                seconds,
            } => {
                let data = if *ports {
                    format!("{} dport", proto.as_str())
                } else {
                    format!("{ip} daddr")
                };
                format!(
                    "add map {table} {name} {{ typeof {ip} saddr : {data} ; flags dynamic,timeout ; timeout {seconds}s ; size {AFFINITY_SIZE} ; }}"
                )
            }
            ClassObject::EndpointSet { name } => {
                let addr = match family {
                    IpFamily::V4 => "ipv4_addr",
                    IpFamily::V6 => "ipv6_addr",
                };
                format!("add set {table} {name} {{ type {addr} . inet_service ; }}")
            }
            ClassObject::PinLookup(rule) => format!(
                "add rule {table} {AFFINITY} {}meta l4proto {} {}{} @{} dnat {ip} to {ip} saddr map @{} : {ip} saddr map @{}",
                source_text(family, &rule.source),
                rule.proto.as_str(),
                dst_text(family, rule.node_port),
                entry_key(family, rule.node_port.is_some()),
                rule.set,
                rule.addrs,
                rule.ports
            ),
            ClassObject::PinRecord(rule) => {
                let original = if rule.node_port {
                    "meta l4proto . ct original proto-dst".to_owned()
                } else {
                    format!("ct original {ip} daddr . meta l4proto . ct original proto-dst")
                };
                format!(
                    "add rule {table} {AFFINITY_RECORD} meta l4proto {} ct status dnat {original} @{} {ip} daddr . th dport @{} update @{} {{ {ip} saddr : {ip} daddr }} update @{} {{ {ip} saddr : th dport }}",
                    rule.proto.as_str(),
                    rule.entries,
                    rule.endpoints,
                    rule.addrs,
                    rule.ports
                )
            }
        }
    }
}

/// `<ip> daddr . meta l4proto . th dport`, or the NodePort key.
fn entry_key(family: IpFamily, node_port: bool) -> String {
    super::fixed::entry_key(ip(family), node_port)
}

/// `<ip> daddr @nodeport-ips`, or `fib daddr type local <ip> daddr != <loopback>`.
pub(super) fn node_port_dst_text(family: IpFamily, dst: NodePortDst) -> String {
    let ip = ip(family);
    match dst {
        NodePortDst::Ips => format!("{ip} daddr @nodeport-ips"),
        NodePortDst::LocalNotLoopback => {
            let loopback = match family {
                IpFamily::V4 => "127.0.0.0/8",
                IpFamily::V6 => "::1",
            };
            format!("fib daddr type local {ip} daddr != {loopback}")
        }
    }
}

/// A NodePort entry's destination match and a space, or nothing.
fn dst_text(family: IpFamily, node_port: Option<NodePortDst>) -> String {
    node_port.map_or_else(String::new, |dst| {
        format!("{} ", node_port_dst_text(family, dst))
    })
}

/// A source match and a space, or nothing.
fn source_text(family: IpFamily, source: &Source) -> String {
    match source {
        Source::Any => String::new(),
        Source::Local => "fib saddr type local ".to_owned(),
        Source::Pods(PodMatch::Cidr(net)) => format!("{} saddr {net} ", ip(family)),
        Source::Pods(PodMatch::Iifname { name, wildcard }) => {
            let star = if *wildcard { "*" } else { "" };
            format!("iifname \"{name}{star}\" ")
        }
    }
}
