//! The elements of the verdict-free layout: which set or map, which key, which data.
//!
//! Every per-service and per-endpoint fact of the layout is one [`Element`]; none carries a
//! verdict, so adding or deleting one never makes the kernel validate the table. The
//! `Display` of an element is its `nft` text (`add element` statement body), which is also
//! what `explain` names.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::Protocol;

/// Where a packet enters a service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Entry {
    /// `daddr . l4proto . dport`: a ClusterIP, externalIP or LoadBalancer IP.
    Ip {
        /// The destination address.
        addr: IpAddr,
        /// The protocol.
        proto: Protocol,
        /// The service port.
        port: u16,
    },
    /// `l4proto . dport` on a local address: a NodePort.
    NodePort {
        /// The protocol.
        proto: Protocol,
        /// The NodePort.
        port: u16,
    },
}

impl Entry {
    /// Whether this is a NodePort entry (its sets are the `nodeport-` ones).
    pub fn is_node_port(&self) -> bool {
        matches!(self, Entry::NodePort { .. })
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Ip { addr, proto, port } => write!(f, "{addr} . {} . {port}", proto.as_str()),
            Entry::NodePort { proto, port } => write!(f, "{} . {port}", proto.as_str()),
        }
    }
}

/// Which endpoint list an entry's slots hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Slots {
    /// The list the entry's traffic policy picks.
    Policy,
    /// externalTrafficPolicy Local: the Cluster list, for traffic from this node and its
    /// pods (upstream's short-circuit).
    ShortCircuit,
}

/// Decisions that are set memberships of an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntrySet {
    /// The entry has exactly `N` endpoints in the list `Slots`: `slots-N` and kin.
    Count(Slots, u32),
    /// Always masqueraded (externalTrafficPolicy Cluster, or `masqueradeAll`).
    MasqueradeAll,
    /// Masqueraded unless it comes from a local pod (a ClusterIP with a detector).
    MasqueradeNotLocal,
    /// Masqueraded when it comes from this node (externalTrafficPolicy Local, short-circuit).
    ShortCircuit,
    /// No usable endpoint anywhere: reject.
    Reject,
    /// No endpoint in the policy's (Local) list: drop.
    Drop,
    /// LoadBalancer entry under `loadBalancerSourceRanges`.
    Firewall,
    /// ClientIP affinity with this timeout in seconds: record the endpoint chosen.
    Affinity(u32),
}

/// One element of the layout.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Element {
    /// `ENTRY` in an [`EntrySet`].
    Entry(EntrySet, Entry),
    /// `ENTRY . SLOT : ADDR . PORT` in an endpoints map.
    Slot {
        /// Which list.
        slots: Slots,
        /// The entry.
        entry: Entry,
        /// `0 ≤ slot < N`.
        slot: u32,
        /// The endpoint's address.
        addr: IpAddr,
        /// The endpoint's port.
        port: u16,
    },
    /// `ENTRY . RANGE` in `firewall-allow`.
    Allow(Entry, IpNet),
    /// `ADDR . ADDR` in `hairpin`: an endpoint address, for a pod reaching itself.
    Hairpin(IpAddr),
    /// `ADDR` in `cluster-ips`: an active ClusterIP (unknown ports are rejected).
    ClusterIp(IpAddr),
}

// The state keeps every element twice (its port's list and the claim list): at 10k
// services × 10 endpoints each byte is ~0.6 MB of peak RSS (bench/reasons.md).
const _: () = assert!(std::mem::size_of::<Element>() <= 44);

/// The name of the set or map holding elements of `set` for `entry`'s kind.
pub fn entry_set_name(set: EntrySet, node_port: bool) -> String {
    let base = match set {
        EntrySet::Count(Slots::Policy, n) => format!("slots-{n}"),
        EntrySet::Count(Slots::ShortCircuit, n) => format!("short-circuit-slots-{n}"),
        EntrySet::MasqueradeAll => "masquerade-all".to_owned(),
        EntrySet::MasqueradeNotLocal => "masquerade-not-local".to_owned(),
        EntrySet::ShortCircuit => "short-circuit".to_owned(),
        EntrySet::Reject => "reject-services".to_owned(),
        EntrySet::Drop => "drop-services".to_owned(),
        EntrySet::Firewall => "firewall-entries".to_owned(),
        EntrySet::Affinity(seconds) => format!("affinity-services-{seconds}"),
    };
    if node_port {
        format!("nodeport-{base}")
    } else {
        base
    }
}

/// The protocols a service port has; each has its own endpoint and affinity maps (see
/// [`slot_map_name`]).
pub const PROTOCOLS: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

/// The name of the endpoints map of `slots` for an entry of that kind and protocol
/// (`endpoints-tcp`, `nodeport-short-circuit-endpoints-udp`, ...). One map per protocol:
/// nft 1.0.6 cannot add a rule looking up a map whose data was declared (in an earlier
/// run) as `ip daddr . th dport` ("conflicting protocols specified"), so each map's data is
/// declared with its own protocol's port, and each rule matches that protocol.
pub fn slot_map_name(slots: Slots, node_port: bool, proto: Protocol) -> String {
    let base = match (slots, node_port) {
        (Slots::Policy, false) => "endpoints",
        (Slots::Policy, true) => "nodeport-endpoints",
        (Slots::ShortCircuit, false) => "short-circuit-endpoints",
        (Slots::ShortCircuit, true) => "nodeport-short-circuit-endpoints",
    };
    format!("{base}-{}", proto.as_str())
}

/// The protocol of an entry.
pub fn entry_protocol(entry: &Entry) -> Protocol {
    match entry {
        Entry::Ip { proto, .. } | Entry::NodePort { proto, .. } => *proto,
    }
}

/// Name of the `firewall-allow` set.
pub const FIREWALL_ALLOW: &str = "firewall-allow";
/// Name of the `hairpin` set.
pub const HAIRPIN: &str = "hairpin";
/// Name of the `cluster-ips` set.
pub const CLUSTER_IPS: &str = "cluster-ips";

impl Element {
    /// The set or map the element belongs to.
    pub fn set_name(&self) -> String {
        match self {
            Element::Entry(set, entry) => entry_set_name(*set, entry.is_node_port()),
            Element::Slot { slots, entry, .. } => {
                slot_map_name(*slots, entry.is_node_port(), entry_protocol(entry))
            }
            Element::Allow(..) => FIREWALL_ALLOW.to_owned(),
            Element::Hairpin(_) => HAIRPIN.to_owned(),
            Element::ClusterIp(_) => CLUSTER_IPS.to_owned(),
        }
    }

    /// Which set or map the element belongs to, without naming it ([`Element::set_name`]
    /// is its name): grouping a transaction's elements by set costs no string per element.
    pub fn set_of(&self) -> SetOf {
        match self {
            Element::Entry(set, entry) => SetOf::Entries(*set, entry.is_node_port()),
            Element::Slot { slots, entry, .. } => {
                SetOf::Slots(*slots, entry.is_node_port(), entry_protocol(entry))
            }
            Element::Allow(..) => SetOf::FirewallAllow,
            Element::Hairpin(_) => SetOf::Hairpin,
            Element::ClusterIp(_) => SetOf::ClusterIps,
        }
    }

    /// The element's key and data, as nft prints them (`KEY` or `KEY : DATA`).
    pub fn body(&self) -> ElementBody<'_> {
        ElementBody(self)
    }

    /// The identity a set holds once: the same key in the same set is one kernel element
    /// whoever claims it (two services sharing an endpoint address share its `hairpin`
    /// element). Data is not part of it: a slot's key has its endpoint cleared.
    pub fn key(&self) -> Element {
        match self {
            Element::Slot {
                slots, entry, slot, ..
            } => Element::Slot {
                slots: *slots,
                entry: *entry,
                slot: *slot,
                addr: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                port: 0,
            },
            other => other.clone(),
        }
    }

    /// The key as nft prints it in a `delete element` statement.
    pub fn key_text(&self) -> String {
        match self {
            Element::Slot { entry, slot, .. } => format!("{entry} . {slot}"),
            other => other.body().to_string(),
        }
    }
}

/// [`Element::body`].
pub struct ElementBody<'a>(&'a Element);

impl fmt::Display for ElementBody<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Element::Entry(_, entry) => write!(f, "{entry}"),
            Element::Slot {
                entry,
                slot,
                addr,
                port,
                ..
            } => write!(f, "{entry} . {slot} : {addr} . {port}"),
            Element::Allow(entry, net) => write!(f, "{entry} . {net}"),
            Element::Hairpin(addr) => write!(f, "{addr} . {addr}"),
            Element::ClusterIp(addr) => write!(f, "{addr}"),
        }
    }
}

impl fmt::Display for Element {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {{ {} }}", self.set_name(), self.body())
    }
}

/// What a set or map of the layout holds, read back from its name (a restart reads the
/// kernel's elements set by set, and decodes each by what its set holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetOf {
    /// Entries (`E`, or `P` when `node_port`) of an [`EntrySet`].
    Entries(EntrySet, bool),
    /// Slot elements of an endpoints map (`E . slot : addr . port`) of one protocol.
    Slots(Slots, bool, Protocol),
    /// `firewall-allow`.
    FirewallAllow,
    /// `hairpin`.
    Hairpin,
    /// `cluster-ips`.
    ClusterIps,
}

impl SetOf {
    /// The layout's per-service set named `name`; `None` for the fixed part's own sets
    /// (`nodeport-ips`), the affinity maps (written by the packet path) and foreign names.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            FIREWALL_ALLOW => return Some(SetOf::FirewallAllow),
            HAIRPIN => return Some(SetOf::Hairpin),
            CLUSTER_IPS => return Some(SetOf::ClusterIps),
            _ => {}
        }
        let (node_port, base) = match name.strip_prefix("nodeport-") {
            Some(rest) => (true, rest),
            None => (false, name),
        };
        let parsed = match base {
            "endpoints-tcp" => SetOf::Slots(Slots::Policy, node_port, Protocol::Tcp),
            "endpoints-udp" => SetOf::Slots(Slots::Policy, node_port, Protocol::Udp),
            "endpoints-sctp" => SetOf::Slots(Slots::Policy, node_port, Protocol::Sctp),
            "short-circuit-endpoints-tcp" => {
                SetOf::Slots(Slots::ShortCircuit, node_port, Protocol::Tcp)
            }
            "short-circuit-endpoints-udp" => {
                SetOf::Slots(Slots::ShortCircuit, node_port, Protocol::Udp)
            }
            "short-circuit-endpoints-sctp" => {
                SetOf::Slots(Slots::ShortCircuit, node_port, Protocol::Sctp)
            }
            "masquerade-all" => SetOf::Entries(EntrySet::MasqueradeAll, node_port),
            "masquerade-not-local" => SetOf::Entries(EntrySet::MasqueradeNotLocal, node_port),
            "short-circuit" => SetOf::Entries(EntrySet::ShortCircuit, node_port),
            "reject-services" => SetOf::Entries(EntrySet::Reject, node_port),
            "drop-services" => SetOf::Entries(EntrySet::Drop, node_port),
            "firewall-entries" => SetOf::Entries(EntrySet::Firewall, node_port),
            other => {
                let set = if let Some(n) = other.strip_prefix("short-circuit-slots-") {
                    EntrySet::Count(Slots::ShortCircuit, n.parse().ok()?)
                } else if let Some(n) = other.strip_prefix("slots-") {
                    EntrySet::Count(Slots::Policy, n.parse().ok()?)
                } else {
                    EntrySet::Affinity(other.strip_prefix("affinity-services-")?.parse().ok()?)
                };
                SetOf::Entries(set, node_port)
            }
        };
        // Names are canonical: `slots-03` is not ours.
        let canonical = match parsed {
            SetOf::Entries(set, np) => entry_set_name(set, np),
            SetOf::Slots(slots, np, proto) => slot_map_name(slots, np, proto),
            _ => return Some(parsed),
        };
        (canonical == name).then_some(parsed)
    }

    /// Whether the set's entries are NodePort entries (`P`).
    pub fn node_port(self) -> bool {
        match self {
            SetOf::Entries(_, node_port) | SetOf::Slots(_, node_port, _) => node_port,
            _ => false,
        }
    }
}
