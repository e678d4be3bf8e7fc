//! The layout's fixed part as `nft -f` statements: tables, chains, sets, maps and the rules
//! that read them, written once (plus one set and rule group per [`Class`] in use; a slot
//! count's from the objects of [`super::class`]), and the element statements of a
//! [`Changes`].
//!
//! Every rule that carries a verdict, `dnat`, `mark set` or `masquerade` is here, so only
//! a transaction that writes this part (a full sync, or the first use of a slot count or
//! affinity service port) makes the kernel validate the table, and then the table is these few
//! chains.

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};
use std::fmt::Write as _;

use super::class::{AFFINITY_SETS, PIN_LISTS};
use super::element::{AffinityPort, PROTOCOLS, PinList, entry_set_name, slot_map_name};
use super::state::{Changes, Class};
use crate::config::{LocalDetector, NodePortAddresses};
use crate::nftables::TABLE;

/// The dispatch chain `nat-prerouting` and `nat-output` jump to.
pub const DISPATCH: &str = "dispatch";
/// The reject/drop chain of IP entries (ClusterIPs, externalIPs, LB IPs) without endpoints,
/// jumped to from `filter-input`, `filter-forward` and `filter-output` (upstream's
/// `service-endpoints-check` hooks).
pub const ENTRY_FILTER: &str = "entry-filter";
/// The reject/drop chain of NodePorts without endpoints: from `filter-input` only, as
/// upstream's `nodeport-endpoints-check` (a node's own NodePort traffic is judged when it
/// arrives, so an IPv6 reject answers it instead of dropping it in `output`).
pub const NODEPORT_FILTER: &str = "nodeport-filter";
/// Unknown ports of active ClusterIPs and unallocated ServiceCIDR addresses: from
/// `filter-forward` and `filter-output`, as upstream's `cluster-ips-check`.
pub const CLUSTER_IP_FILTER: &str = "cluster-ip-filter";
/// The `loadBalancerSourceRanges` chain of the pre-DNAT filter chains.
pub const FIREWALL: &str = "firewall";
/// The chains `dispatch` jumps to in this order, one rule per class each: recorded
/// affinity first, then the short-circuit of externalTrafficPolicy Local, then the policy's
/// slots. Rules of a new class are appended to their chain, so the order between kinds
/// holds whatever order classes appear in.
pub const AFFINITY: &str = "affinity";
/// See [`AFFINITY`].
pub const SHORT_CIRCUIT: &str = "short-circuit-pick";
/// See [`AFFINITY`].
pub const PICK: &str = "pick";
/// `nat-postrouting` jumps here before masquerading: each affinity service port's rules record
/// the endpoint a new connection got.
pub const AFFINITY_RECORD: &str = "affinity-record";

/// The chains only this layout has (its base chains, `masquerading` and
/// `mark-for-masquerade` have the chain layout's names, and that layout rewrites them): what
/// a rollback to the chain layout deletes, with the sets [`is_own_set`] names.
pub const OWN_CHAINS: [&str; 9] = [
    DISPATCH,
    AFFINITY,
    SHORT_CIRCUIT,
    PICK,
    AFFINITY_RECORD,
    ENTRY_FILTER,
    NODEPORT_FILTER,
    CLUSTER_IP_FILTER,
    FIREWALL,
];

/// Whether `name` is a set or map only this layout has (not `cluster-ips`, `nodeport-ips`
/// and `nodeport-localhost-reject`, which the chain layout has too).
pub fn is_own_set(name: &str) -> bool {
    // The per-timeout maps of an earlier version of the layout, and its sets.
    let legacy_map = name
        .strip_prefix("affinity-")
        .and_then(|rest| rest.split_once('-'))
        .is_some_and(|(seconds, proto)| {
            seconds.parse::<u64>().is_ok() && PROTOCOLS.iter().any(|p| p.as_str() == proto)
        });
    legacy_map
        || super::element::is_shared_slot_map(name)
        || AffinityPort::of_map(name).is_some()
        || Class::of_set_name(name).is_some()
        || super::element::SetOf::parse(name).is_some_and(|set| {
            set != super::element::SetOf::ClusterIps
                && set
                    != super::element::SetOf::Entries(
                        super::element::EntrySet::LocalhostReject,
                        true,
                    )
        })
}

/// What the fixed rules depend on besides the classes in use.
#[derive(Clone, Debug)]
pub struct FixedConfig {
    /// The family of the table.
    pub family: IpFamily,
    /// The masquerade mark (one bit).
    pub mark: u32,
    /// `masquerade fully-random`.
    pub random_fully: bool,
    /// How traffic from local pods is recognised.
    pub detector: LocalDetector,
    /// Where NodePorts are accepted.
    pub node_port_addresses: NodePortAddresses,
    /// The cluster's ServiceCIDRs (any family; this family's are used): traffic to their
    /// unallocated addresses is dropped.
    pub service_cidrs: Vec<IpNet>,
    /// The protocols whose localhost NodePort traffic is rejected and counted (KEP-6032).
    pub localhost_rejects: &'static [Protocol],
}

impl FixedConfig {
    /// The fixed part's settings for `family` under `config`.
    pub fn new(
        config: &crate::config::RenderConfig,
        family: IpFamily,
        service_cidrs: &[IpNet],
    ) -> Result<Self, crate::config::RenderError> {
        Ok(Self {
            family,
            mark: config.masquerade_mark()?,
            random_fully: config.random_fully,
            detector: config.local_detector.clone(),
            node_port_addresses: config.node_port_addresses.clone(),
            service_cidrs: service_cidrs.to_vec(),
            localhost_rejects: config.nftables_localhost_rejects.protocols(family),
        })
    }

    /// This family's ServiceCIDRs, aggregated.
    pub fn family_service_cidrs(&self) -> Vec<IpNet> {
        let cidrs: Vec<IpNet> = self
            .service_cidrs
            .iter()
            .filter(|c| IpFamily::of_net(c) == self.family)
            .map(IpNet::trunc)
            .collect();
        IpNet::aggregate(&cidrs)
    }

    fn ip(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        }
    }

    fn addr_type(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        }
    }

    /// `ip saddr 10.0.0.0/8`, `iifname "cbr0"`, ... (negated with `not`), when this family
    /// has a detector.
    fn local_pod_match(&self, not: bool) -> Option<String> {
        let op = if not { "!= " } else { "" };
        match &self.detector {
            LocalDetector::None => None,
            LocalDetector::Cidrs(cidrs) => cidrs
                .iter()
                .find(|c| IpFamily::of_net(c) == self.family)
                .map(|c| format!("{} saddr {op}{}", self.ip(), c.trunc())),
            LocalDetector::BridgeInterface(name) => Some(format!("iifname {op}\"{name}\"")),
            LocalDetector::InterfaceNamePrefix(p) => Some(format!("iifname {op}\"{p}*\"")),
        }
    }

    /// The addresses NodePorts are restricted to in this family (`None`: every local one).
    fn node_port_ips(&self) -> Option<Vec<std::net::IpAddr>> {
        self.node_port_addresses.nftables_ips(self.family)
    }

    /// The match of a destination that accepts NodePorts.
    fn node_port_destination(&self) -> String {
        super::class::node_port_dst_text(self.family, self.node_port_dst())
    }
}

/// Statements building on `table`.
struct Script<'c> {
    config: &'c FixedConfig,
    out: Vec<String>,
}

impl Script<'_> {
    fn table(&self) -> String {
        format!("{} {TABLE}", self.config.ip())
    }

    fn push(&mut self, verb: &str, rest: std::fmt::Arguments<'_>) {
        let mut line = format!("{verb} {} ", self.table());
        let _ = line.write_fmt(rest);
        self.out.push(line);
    }

    fn rule(&mut self, chain: &str, rule: impl AsRef<str>) {
        self.push("add rule", format_args!("{chain} {}", rule.as_ref()));
    }
}

/// What a rule for an entry kind starts with: the NodePort destination match, or nothing.
fn entry_prefix(nodeport_dst: &str, node_port: bool) -> String {
    if node_port {
        format!("{nodeport_dst} ")
    } else {
        String::new()
    }
}

/// `ip daddr . meta l4proto . th dport` (or the NodePort key) of an entry kind.
pub(super) fn entry_key(ip: &str, node_port: bool) -> String {
    if node_port {
        "meta l4proto . th dport".to_owned()
    } else {
        format!("{ip} daddr . meta l4proto . th dport")
    }
}

/// The fixed part with the sets and rules of `classes`.
pub fn fixed_part(
    config: &FixedConfig,
    classes: &std::collections::BTreeSet<Class>,
) -> Vec<String> {
    let mut s = Script {
        config,
        out: Vec::new(),
    };
    s.push(
        "add table",
        format_args!("{{ comment \"rules for kube-proxy\" ; }}"),
    );
    declare_sets(&mut s);
    declare_chains(&mut s);
    let mark = config.mark;
    s.rule("mark-for-masquerade", format!("mark set mark or {mark:#x}"));
    let fully = if config.random_fully {
        " fully-random"
    } else {
        ""
    };
    s.rule("masquerading", format!("mark and {mark:#x} == 0 return"));
    s.rule("masquerading", format!("mark set mark xor {mark:#x}"));
    s.rule("masquerading", format!("masquerade{fully}"));
    for base in ["nat-prerouting", "nat-output"] {
        s.rule(base, format!("jump {DISPATCH}"));
    }
    masquerade_rules(&mut s);
    for chain in [AFFINITY, SHORT_CIRCUIT, PICK] {
        s.rule(DISPATCH, format!("jump {chain}"));
    }
    for class in classes {
        s.out.extend(class_part(config, *class));
    }
    s.rule("nat-postrouting", format!("jump {AFFINITY_RECORD}"));
    s.rule(
        "nat-postrouting",
        format!(
            "ct status dnat {ip} saddr . {ip} daddr @hairpin jump mark-for-masquerade",
            ip = config.ip()
        ),
    );
    s.rule("nat-postrouting", "jump masquerading");
    filter_rules(&mut s);
    s.out
}

/// Sets and maps that do not depend on a class.
fn declare_sets(s: &mut Script<'_>) {
    let addr = s.config.addr_type();
    let entry = format!("{addr} . inet_proto . inet_service");
    for node_port in [false, true] {
        let ty = if node_port {
            "inet_proto . inet_service"
        } else {
            entry.as_str()
        };
        for set in [
            super::element::EntrySet::MasqueradeAll,
            super::element::EntrySet::MasqueradeNotLocal,
            super::element::EntrySet::ShortCircuit,
            super::element::EntrySet::Reject,
            super::element::EntrySet::Drop,
        ] {
            let name = entry_set_name(set, node_port);
            s.push("add set", format_args!("{name} {{ type {ty} ; }}"));
        }
    }
    s.push(
        "add set",
        format_args!("firewall-entries {{ type {entry} ; }}"),
    );
    s.push(
        "add set",
        format_args!("firewall-allow {{ type {entry} . {addr} ; flags interval ; }}"),
    );
    s.push(
        "add set",
        format_args!("hairpin {{ type {addr} . {addr} ; }}"),
    );
    s.push("add set", format_args!("cluster-ips {{ type {addr} ; }}"));
    let localhost = entry_set_name(super::element::EntrySet::LocalhostReject, true);
    s.push(
        "add set",
        format_args!("{localhost} {{ type inet_proto . inet_service ; }}"),
    );
    s.push("add set", format_args!("nodeport-ips {{ type {addr} ; }}"));
    s.push("flush set", format_args!("nodeport-ips"));
    for ip in s.config.node_port_ips().unwrap_or_default() {
        s.push("add element", format_args!("nodeport-ips {{ {ip} }}"));
    }
}

/// Base and regular chains (base chains and priorities as in nftables-integration.md).
fn declare_chains(s: &mut Script<'_>) {
    for (chain, kind, hook, priority) in [
        ("filter-prerouting-pre-dnat", "filter", "prerouting", -110),
        ("filter-output-pre-dnat", "filter", "output", -110),
        ("filter-forward", "filter", "forward", 0),
        ("filter-input", "filter", "input", 0),
        ("filter-output", "filter", "output", 0),
        ("nat-prerouting", "nat", "prerouting", -100),
        ("nat-output", "nat", "output", -100),
        ("nat-postrouting", "nat", "postrouting", 100),
    ] {
        s.push(
            "add chain",
            format_args!("{chain} {{ type {kind} hook {hook} priority {priority} ; }}"),
        );
        s.push("flush chain", format_args!("{chain}"));
    }
    for chain in OWN_CHAINS
        .into_iter()
        .chain(["mark-for-masquerade", "masquerading"])
    {
        s.push("add chain", format_args!("{chain}"));
        s.push("flush chain", format_args!("{chain}"));
    }
}

/// The masquerade decisions of `dispatch`, before any `dnat`.
fn masquerade_rules(s: &mut Script<'_>) {
    let ip = s.config.ip();
    let not_local = s.config.local_pod_match(true);
    let nodeport_dst = s.config.node_port_destination();
    for node_port in [false, true] {
        let key = entry_key(ip, node_port);
        let dst = entry_prefix(&nodeport_dst, node_port);
        let set = |set| entry_set_name(set, node_port);
        use super::element::EntrySet::{MasqueradeAll, MasqueradeNotLocal, ShortCircuit};
        s.rule(
            DISPATCH,
            format!(
                "{dst}{key} @{} jump mark-for-masquerade",
                set(MasqueradeAll)
            ),
        );
        if let Some(not_local) = &not_local {
            s.rule(
                DISPATCH,
                format!(
                    "{dst}{not_local} {key} @{} jump mark-for-masquerade",
                    set(MasqueradeNotLocal)
                ),
            );
        }
        s.rule(
            DISPATCH,
            format!(
                "{dst}fib saddr type local {key} @{} jump mark-for-masquerade",
                set(ShortCircuit)
            ),
        );
    }
}

/// The sets and `dispatch` rules of one class.
pub fn class_part(config: &FixedConfig, class: Class) -> Vec<String> {
    let mut s = Script {
        config,
        out: Vec::new(),
    };
    match class {
        // Only deleted (see `delete_classes_script`).
        Class::LegacyAffinity(_) => {}
        class => {
            let objects = super::class::class_objects(s.config, class).unwrap_or_default();
            let family = s.config.family;
            s.out
                .extend(objects.iter().map(|object| object.statement(family)));
        }
    }
    s.out
}

/// Filter chains: source ranges before DNAT, no-endpoint verdicts and unknown ClusterIP
/// ports after it (DNATed connections no longer match an entry), each from the hooks
/// upstream's nftables mode judges it in.
fn filter_rules(s: &mut Script<'_>) {
    let ip = s.config.ip();
    let key = entry_key(ip, false);
    for base in ["filter-prerouting-pre-dnat", "filter-output-pre-dnat"] {
        s.rule(base, format!("ct state new jump {FIREWALL}"));
    }
    s.rule(
        FIREWALL,
        format!("{key} @firewall-entries {key} . {ip} saddr != @firewall-allow drop"),
    );
    s.rule(
        "filter-input",
        format!("ct state new jump {NODEPORT_FILTER}"),
    );
    for base in ["filter-input", "filter-forward", "filter-output"] {
        s.rule(base, format!("ct state new jump {ENTRY_FILTER}"));
    }
    for base in ["filter-forward", "filter-output"] {
        s.rule(base, format!("ct state new jump {CLUSTER_IP_FILTER}"));
    }
    let nodeport_dst = s.config.node_port_destination();
    use super::element::EntrySet::{Drop, Reject};
    for (node_port, chain) in [(false, ENTRY_FILTER), (true, NODEPORT_FILTER)] {
        let key = entry_key(ip, node_port);
        let dst = entry_prefix(&nodeport_dst, node_port);
        s.rule(
            chain,
            format!("{dst}{key} @{} reject", entry_set_name(Reject, node_port)),
        );
        s.rule(
            chain,
            format!("{dst}{key} @{} drop", entry_set_name(Drop, node_port)),
        );
    }
    localhost_rejects(s);
    s.rule(CLUSTER_IP_FILTER, format!("{ip} daddr @cluster-ips reject"));
    let cidrs = s.config.family_service_cidrs();
    if !cidrs.is_empty() {
        let list: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
        s.rule(
            CLUSTER_IP_FILTER,
            format!("{ip} daddr {{ {} }} drop", list.join(", ")),
        );
    }
}

/// KEP-6032: localhost traffic to the NodePorts of `nodeport-localhost-reject` is rejected
/// when it arrives, counted per protocol in upstream's named counters; without rejects the
/// counters are deleted (`add` first, so the deletion cannot fail).
fn localhost_rejects(s: &mut Script<'_>) {
    let (ip, rejects) = (s.config.ip(), s.config.localhost_rejects);
    let loopback = match s.config.family {
        IpFamily::V4 => "127.0.0.0/8",
        IpFamily::V6 => "::1",
    };
    let set = entry_set_name(super::element::EntrySet::LocalhostReject, true);
    for proto in PROTOCOLS {
        let counter = crate::nftables::localhost_reject_counter(proto);
        s.push("add counter", format_args!("{counter}"));
        if !rejects.contains(&proto) {
            s.push("delete counter", format_args!("{counter}"));
            continue;
        }
        // TCP gets a reset, as a port without a socket answers: the node's own TCP stack
        // ignores an ICMPv6 error that arrives while connect() holds the socket, so an
        // ICMPv6 reject would only refuse the SYN retransmitted a second later.
        let with = if proto == Protocol::Tcp {
            " with tcp reset"
        } else {
            ""
        };
        s.rule(
            "filter-input",
            format!(
                "{ip} daddr {loopback} meta l4proto {} meta l4proto . th dport @{set} counter name {counter} reject{with}",
                proto.as_str()
            ),
        );
    }
}

/// The element statements of `changes` (deletions, the new classes' sets and rules, then
/// additions), on `config`'s table.
pub fn change_script(config: &FixedConfig, changes: &Changes) -> Vec<String> {
    let mut s = Script {
        config,
        out: Vec::new(),
    };
    for element in &changes.delete {
        let (set, key) = (element.set_name(), element.key_text());
        s.push("delete element", format_args!("{set} {{ {key} }}"));
    }
    for class in &changes.classes {
        s.out.extend(class_part(config, *class));
    }
    for element in &changes.add {
        s.push("add element", format_args!("{element}"));
    }
    s.out
}

/// One transaction replacing whatever table `config`'s family holds (another layout of
/// kube-proxy-rs, or upstream's) with this layout holding `classes` and `elements`: there
/// is no moment without rules, the old table serves until the commit.
pub fn replace_table_script(
    config: &FixedConfig,
    classes: &std::collections::BTreeSet<Class>,
    elements: &[super::Element],
) -> Vec<String> {
    let mut s = Script {
        config,
        out: Vec::new(),
    };
    // `add` first, so that the deletion cannot fail.
    s.push("add table", format_args!(""));
    s.push("delete table", format_args!(""));
    s.out.extend(fixed_part(config, classes));
    for element in elements {
        s.push("add element", format_args!("{element}"));
    }
    s.out
}

/// The deletion of the sets (and affinity maps) of classes no rule uses any more.
pub fn delete_classes_script(
    config: &FixedConfig,
    classes: &std::collections::BTreeSet<Class>,
) -> Vec<String> {
    let mut s = Script {
        config,
        out: Vec::new(),
    };
    for class in classes {
        let (sets, maps) = class_objects(*class);
        for set in sets {
            s.push("delete set", format_args!("{set}"));
        }
        for map in maps {
            s.push("delete map", format_args!("{map}"));
        }
    }
    s.out
}

/// The sets and the maps of a class.
fn class_objects(class: Class) -> (Vec<String>, Vec<String>) {
    let both = [false, true];
    match class {
        Class::Count(slots, n) => {
            let set = super::element::EntrySet::Count(slots, n);
            let maps = both
                .into_iter()
                .flat_map(|np| PROTOCOLS.map(|proto| slot_map_name(slots, n, np, proto)))
                .collect();
            (both.map(|np| entry_set_name(set, np)).to_vec(), maps)
        }
        Class::Affinity(port) => {
            let mut sets: Vec<String> = PIN_LISTS.map(|list| port.endpoints_name(list)).to_vec();
            for set in AFFINITY_SETS {
                sets.extend(both.map(|np| port.entries_name(set, np)));
            }
            let maps = PIN_LISTS
                .into_iter()
                .flat_map(|list| both.map(|ports| port.map_name(list, ports)))
                .collect();
            (sets, maps)
        }
        Class::LegacyAffinity(seconds) => {
            let sets = both.map(|np| {
                let np = if np { "nodeport-" } else { "" };
                format!("{np}affinity-services-{seconds}")
            });
            let maps = PROTOCOLS.map(|proto| format!("affinity-{seconds}-{}", proto.as_str()));
            (sets.to_vec(), maps.to_vec())
        }
    }
}

/// The affinity maps of `port`: each list's address and port maps (what a sweep of the
/// clients pinned to removed endpoints reads).
pub fn affinity_maps(port: AffinityPort) -> [(PinList, String, String); 2] {
    PIN_LISTS.map(|list| (list, port.map_name(list, false), port.map_name(list, true)))
}
