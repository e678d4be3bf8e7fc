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
    /// A NodePort whose localhost traffic is rejected (`KubeProxyNFTablesLocalhostNodePorts`:
    /// `crate::config::LocalhostNodePortRejects`).
    LocalhostReject,
}

/// One service port with ClientIP affinity: its sets, maps and rules are its own, so a
/// client is pinned across all the port's addresses (upstream's nftables and iptables
/// modes), keyed by the client's address alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AffinityPort {
    /// The first 8 bytes of `sha256("ns/name:port/proto/seconds")`, as two words so the
    /// elements holding it stay 4-byte aligned (see the size assertion below).
    hash: [u32; 2],
    /// The timeout in seconds (a changed timeout is another port: its maps' timeout).
    pub seconds: u32,
    /// The port's protocol (its maps' data and its rules' protocol match).
    pub proto: Protocol,
}

impl AffinityPort {
    /// The affinity port of `name` with a `seconds` timeout.
    pub fn new(name: &kp_core::model::ServicePortName, seconds: u32) -> Self {
        use sha2::{Digest, Sha256};
        let input = format!("{name}/{}/{seconds}", name.protocol.as_str());
        let digest = Sha256::digest(input.as_bytes());
        let word = |at: usize| u32::from_be_bytes([0, 1, 2, 3].map(|i| digest[at + i]));
        Self {
            hash: [word(0), word(4)],
            seconds,
            proto: name.protocol,
        }
    }

    /// `affinity-tcp-10800-0123456789abcdef`: the prefix of every set and map of the port.
    pub fn base(&self) -> String {
        format!(
            "affinity-{}-{}-{:08x}{:08x}",
            self.proto.as_str(),
            self.seconds,
            self.hash[0],
            self.hash[1]
        )
    }

    /// The port named by `base` (the canonical text of [`AffinityPort::base`]).
    fn parse_base(base: &str) -> Option<Self> {
        let rest = base.strip_prefix("affinity-")?;
        let (proto, rest) = rest.split_once('-')?;
        let (seconds, hash) = rest.split_once('-')?;
        let proto = PROTOCOLS.into_iter().find(|p| p.as_str() == proto)?;
        if hash.len() != 16 {
            return None;
        }
        let word = |range: std::ops::Range<usize>| u32::from_str_radix(hash.get(range)?, 16).ok();
        let port = Self {
            hash: [word(0..8)?, word(8..16)?],
            seconds: seconds.parse().ok()?,
            proto,
        };
        (port.base() == base).then_some(port)
    }

    /// The map of `list`'s pinned endpoint addresses (`saddr : addr`), or with `ports` of
    /// their ports (`saddr : port`). Two maps, not one of `addr . port`: nft 1.0.6 cannot
    /// write an IPv6 `update` whose data is a concatenation (`netlink_gen_expr: Assertion
    /// 'dreg < ctx->reg_low' failed`); the lookup reads both (`dnat to saddr map @a :
    /// saddr map @b`).
    pub fn map_name(&self, list: PinList, ports: bool) -> String {
        let list = match list {
            PinList::Cluster => "",
            PinList::Local => "-local",
        };
        let ports = if ports { "-ports" } else { "" };
        format!("{}{list}{ports}", self.base())
    }

    /// The set of `list`'s endpoints (`addr . port`): what the record rule accepts.
    pub fn endpoints_name(&self, list: PinList) -> String {
        match list {
            PinList::Cluster => format!("{}-endpoints", self.base()),
            PinList::Local => format!("{}-local-endpoints", self.base()),
        }
    }

    /// The set of entries (`E`, or `P` when `node_port`) of `set`.
    pub fn entries_name(&self, set: AffinitySet, node_port: bool) -> String {
        let suffix = match set {
            AffinitySet::Record => "entries",
            AffinitySet::Cluster => "cluster-entries",
            AffinitySet::Local => "local-entries",
            AffinitySet::ShortCircuit => "short-circuit-entries",
        };
        let np = if node_port { "nodeport-" } else { "" };
        format!("{np}{}-{suffix}", self.base())
    }

    /// The port whose map is `name` (so a rollback knows it for its own).
    pub fn of_map(name: &str) -> Option<Self> {
        let base = name
            .strip_suffix("-ports")
            .unwrap_or(name)
            .trim_end_matches("-local");
        let port = Self::parse_base(base)?;
        [PinList::Cluster, PinList::Local]
            .into_iter()
            .any(|list| {
                [false, true]
                    .iter()
                    .any(|p| port.map_name(list, *p) == name)
            })
            .then_some(port)
    }
}

/// The endpoint list an affinity map pins to (upstream checks only the endpoints of the
/// list a path uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PinList {
    /// The cluster-wide list.
    Cluster,
    /// The node-local list (traffic policy `Local`).
    Local,
}

/// The entry sets of an [`AffinityPort`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AffinitySet {
    /// Every entry of the port: a new connection to one records its endpoint.
    Record,
    /// Entries whose lookup reads the cluster list's pins.
    Cluster,
    /// Entries whose lookup reads the local list's pins (a `Local` traffic policy).
    Local,
    /// externalTrafficPolicy `Local` entries: the cluster pins from this node and its pods,
    /// the local pins from elsewhere.
    ShortCircuit,
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
        /// How many slots the entry's list has (its class: the map holding the slot).
        count: u16,
        /// The entry.
        entry: Entry,
        /// `0 ≤ slot < N` (32 bits in the kernel, where `numgen` writes it).
        slot: u16,
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
    /// `ENTRY` in an affinity port's entry set.
    AffinityEntry(AffinityPort, AffinitySet, Entry),
    /// `ADDR . PORT` in an affinity port's endpoints set of a list.
    AffinityEndpoint(AffinityPort, PinList, IpAddr, u16),
}

/// Slots per list at most: a slot element holds its index and its list's count in 16 bits
/// each, since the element's size is the state's memory; a longer list uses its first
/// 65,535 endpoints.
pub const MAX_SLOTS: u16 = u16::MAX;

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
        EntrySet::LocalhostReject => "localhost-reject".to_owned(),
    };
    if node_port {
        format!("nodeport-{base}")
    } else {
        base
    }
}

/// The protocols a service port has; each has its own endpoint maps (see
/// [`slot_map_name`]).
pub const PROTOCOLS: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

/// The name of the endpoints map of the `count`-slot class of `slots` for an entry of that
/// kind and protocol (`endpoints-3-tcp`, `nodeport-short-circuit-endpoints-10-udp`, ...).
///
/// One map per class: a rule looking a map up binds it, and binding a data map walks every
/// element it holds (`nf_tables_bind_set`), so a rule added for a new class must find its
/// map empty, not shared with every other class (at 100k services a shared map made each
/// new class cost ~0.5 s of kernel time, and each full sync's rewrite of the rules many
/// times that). One map per protocol: nft 1.0.6 cannot add a rule looking up a map whose
/// data was declared (in an earlier run) as `ip daddr . th dport` ("conflicting protocols
/// specified"), so each map's data is declared with its own protocol's port, and each rule
/// matches that protocol.
pub fn slot_map_name(slots: Slots, count: u32, node_port: bool, proto: Protocol) -> String {
    let base = match (slots, node_port) {
        (Slots::Policy, false) => "endpoints",
        (Slots::Policy, true) => "nodeport-endpoints",
        (Slots::ShortCircuit, false) => "short-circuit-endpoints",
        (Slots::ShortCircuit, true) => "nodeport-short-circuit-endpoints",
    };
    format!("{base}-{count}-{}", proto.as_str())
}

/// Whether `name` is an endpoints map of this layout's earlier versions, one per list and
/// protocol shared by every class (`endpoints-tcp`): a table holding one is replaced whole
/// rather than adopted, so no rule ever points at a map being emptied.
pub fn is_shared_slot_map(name: &str) -> bool {
    let base = name.strip_prefix("nodeport-").unwrap_or(name);
    let base = base.strip_prefix("short-circuit-").unwrap_or(base);
    base.strip_prefix("endpoints-")
        .is_some_and(|proto| PROTOCOLS.iter().any(|p| p.as_str() == proto))
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
            Element::Slot {
                slots,
                count,
                entry,
                ..
            } => slot_map_name(
                *slots,
                u32::from(*count),
                entry.is_node_port(),
                entry_protocol(entry),
            ),
            Element::Allow(..) => FIREWALL_ALLOW.to_owned(),
            Element::Hairpin(_) => HAIRPIN.to_owned(),
            Element::ClusterIp(_) => CLUSTER_IPS.to_owned(),
            Element::AffinityEntry(port, set, entry) => {
                port.entries_name(*set, entry.is_node_port())
            }
            Element::AffinityEndpoint(port, list, ..) => port.endpoints_name(*list),
        }
    }

    /// Which set or map the element belongs to, without naming it ([`Element::set_name`]
    /// is its name): grouping a transaction's elements by set costs no string per element.
    pub fn set_of(&self) -> SetOf {
        match self {
            Element::Entry(set, entry) => SetOf::Entries(*set, entry.is_node_port()),
            Element::Slot {
                slots,
                count,
                entry,
                ..
            } => SetOf::Slots(
                *slots,
                u32::from(*count),
                entry.is_node_port(),
                entry_protocol(entry),
            ),
            Element::Allow(..) => SetOf::FirewallAllow,
            Element::Hairpin(_) => SetOf::Hairpin,
            Element::ClusterIp(_) => SetOf::ClusterIps,
            Element::AffinityEntry(port, set, entry) => {
                SetOf::AffinityEntries(*port, *set, entry.is_node_port())
            }
            Element::AffinityEndpoint(port, list, ..) => SetOf::AffinityEndpoints(*port, *list),
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
                slots,
                count,
                entry,
                slot,
                ..
            } => Element::Slot {
                slots: *slots,
                count: *count,
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
            Element::Entry(_, entry) | Element::AffinityEntry(_, _, entry) => write!(f, "{entry}"),
            Element::AffinityEndpoint(_, _, addr, port) => write!(f, "{addr} . {port}"),
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
    /// Slot elements of a class's endpoints map (`E . slot : addr . port`) of one protocol.
    Slots(Slots, u32, bool, Protocol),
    /// `firewall-allow`.
    FirewallAllow,
    /// `hairpin`.
    Hairpin,
    /// `cluster-ips`.
    ClusterIps,
    /// An affinity port's entries (`E`, or `P` when the bool is set) of one set.
    AffinityEntries(AffinityPort, AffinitySet, bool),
    /// An affinity port's endpoints (`addr . port`) of one list.
    AffinityEndpoints(AffinityPort, PinList),
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
        if let Some(set) = Self::parse_affinity(name) {
            return Some(set);
        }
        let (node_port, base) = match name.strip_prefix("nodeport-") {
            Some(rest) => (true, rest),
            None => (false, name),
        };
        let parsed = match base {
            "masquerade-all" => SetOf::Entries(EntrySet::MasqueradeAll, node_port),
            "masquerade-not-local" => SetOf::Entries(EntrySet::MasqueradeNotLocal, node_port),
            "short-circuit" => SetOf::Entries(EntrySet::ShortCircuit, node_port),
            "reject-services" => SetOf::Entries(EntrySet::Reject, node_port),
            "drop-services" => SetOf::Entries(EntrySet::Drop, node_port),
            "firewall-entries" => SetOf::Entries(EntrySet::Firewall, node_port),
            "localhost-reject" if node_port => SetOf::Entries(EntrySet::LocalhostReject, true),
            other if other.contains("endpoints-") => Self::parse_slots(other, node_port)?,
            other => {
                let set = if let Some(n) = other.strip_prefix("short-circuit-slots-") {
                    EntrySet::Count(Slots::ShortCircuit, n.parse().ok()?)
                } else if let Some(n) = other.strip_prefix("slots-") {
                    EntrySet::Count(Slots::Policy, n.parse().ok()?)
                } else {
                    return None;
                };
                SetOf::Entries(set, node_port)
            }
        };
        // Names are canonical: `slots-03` is not ours.
        let canonical = match parsed {
            SetOf::Entries(set, np) => entry_set_name(set, np),
            SetOf::Slots(slots, n, np, proto) => slot_map_name(slots, n, np, proto),
            _ => return Some(parsed),
        };
        (canonical == name).then_some(parsed)
    }

    /// A class's endpoints map, `base` being its name without `nodeport-`
    /// (`short-circuit-endpoints-3-udp`); canonical spelling is checked by the caller.
    fn parse_slots(base: &str, node_port: bool) -> Option<Self> {
        let (slots, rest) = match base.strip_prefix("short-circuit-endpoints-") {
            Some(rest) => (Slots::ShortCircuit, rest),
            None => (Slots::Policy, base.strip_prefix("endpoints-")?),
        };
        let (count, proto) = rest.split_once('-')?;
        let proto = PROTOCOLS.into_iter().find(|p| p.as_str() == proto)?;
        Some(SetOf::Slots(slots, count.parse().ok()?, node_port, proto))
    }

    /// An affinity port's set named `name`.
    fn parse_affinity(name: &str) -> Option<Self> {
        let (node_port, rest) = match name.strip_prefix("nodeport-") {
            Some(rest) => (true, rest),
            None => (false, name),
        };
        // The base is `affinity-PROTO-SECONDS-HASH`: three dashes after `affinity`.
        let at = rest.match_indices('-').nth(3)?.0;
        let (base, suffix) = (rest.get(..at)?, rest.get(at + 1..)?);
        let port = AffinityPort::parse_base(base)?;
        let parsed = match suffix {
            "entries" => SetOf::AffinityEntries(port, AffinitySet::Record, node_port),
            "cluster-entries" => SetOf::AffinityEntries(port, AffinitySet::Cluster, node_port),
            "local-entries" => SetOf::AffinityEntries(port, AffinitySet::Local, node_port),
            "short-circuit-entries" => {
                SetOf::AffinityEntries(port, AffinitySet::ShortCircuit, node_port)
            }
            "endpoints" if !node_port => SetOf::AffinityEndpoints(port, PinList::Cluster),
            "local-endpoints" if !node_port => SetOf::AffinityEndpoints(port, PinList::Local),
            _ => return None,
        };
        Some(parsed)
    }

    /// Whether the set's entries are NodePort entries (`P`).
    pub fn node_port(self) -> bool {
        match self {
            SetOf::Entries(_, node_port)
            | SetOf::Slots(_, _, node_port, _)
            | SetOf::AffinityEntries(_, _, node_port) => node_port,
            _ => false,
        }
    }
}
