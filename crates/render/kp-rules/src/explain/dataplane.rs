//! The objects of the proxy mode in use that implement an explained service port: nftables
//! chains and verdict-map elements, the IPVS virtual server with its real servers and ipsets,
//! or userspace mode's capture chains.
//!
//! Names are never derived here: each mode's own pure renderer or planner runs over the same
//! state and configuration, and its output is searched for the service port's objects. An
//! explanation therefore names exactly what that mode programs (iptables mode's chains are in
//! [`super::ServiceMatch::hops`] already).

use std::net::IpAddr;

use kp_core::model::{IpFamily, Protocol};
use kp_core::tracker::ProxyState;
use serde::Serialize;

use super::{Explanation, MatchKind, Outcome, ServiceMatch};
use crate::iptables::{RenderConfig, RenderError};
use crate::ipvs::{self, IpvsConfig};
use crate::nftables::cmd::Verdict;
use crate::nftables::layout::{self, AffinitySet, Element, Entry, EntrySet, PinList, Slots};
use crate::nftables::{self, ElementSet, NftState};
use crate::userspace;

/// The proxy mode whose objects to name (iptables mode's are always in the hops).
#[derive(Clone, Debug)]
pub enum Mode<'a> {
    /// Upstream's nftables layout (`--nftables-layout=chains`).
    Nftables,
    /// nftables mode's verdict-free layout (the default).
    NftablesMaps,
    /// IPVS virtual servers, planned with this configuration.
    Ipvs(&'a IpvsConfig),
    /// Userspace mode's capture chains.
    Userspace,
}

impl Mode<'_> {
    /// The mode's name as in `--proxy-mode`.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Nftables | Mode::NftablesMaps => "nftables",
            Mode::Ipvs(_) => "ipvs",
            Mode::Userspace => "userspace",
        }
    }
}

/// One named object of the dataplane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DataplaneObject {
    /// What it is: `table`, `map element`, `chain`, `virtual server`, `real server`, `ipset`.
    pub kind: &'static str,
    /// Its name (or, for a map element or IPVS server, its key).
    pub name: String,
    /// What it does for this packet.
    pub detail: String,
}

/// The objects of one proxy mode for one service port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Dataplane {
    /// `nftables`, `ipvs` or `userspace`.
    pub mode: &'static str,
    /// The objects, in the order a packet meets them.
    pub objects: Vec<DataplaneObject>,
}

/// Names one match's objects from a mode's rendered or planned state.
type Namer = dyn Fn(&ServiceMatch) -> Vec<DataplaneObject>;

/// Fill [`ServiceMatch::dataplane`] of every match of `explanation` with `mode`'s objects.
pub fn annotate(
    explanation: &mut Explanation,
    state: &ProxyState,
    config: &RenderConfig,
    mode: &Mode<'_>,
) -> Result<(), RenderError> {
    if explanation.matches.is_empty() {
        return Ok(());
    }
    let family = explanation.family;
    let objects: Box<Namer> = match mode {
        Mode::Nftables => {
            let (_, rendered) = nftables::render_full(state, family, config)?;
            Box::new(move |m| nft_objects(&rendered, family, m))
        }
        Mode::NftablesMaps => {
            let ctx = layout::Context::new(config, state, family);
            let empty = layout::LayoutState::default();
            let installed =
                layout::LayoutState::from_ports(layout::full_updates(state, &ctx, &empty));
            Box::new(move |m| layout_objects(&installed, family, m))
        }
        Mode::Ipvs(ipvs_config) => {
            let desired = ipvs::plan(state, family, ipvs_config);
            Box::new(move |m| ipvs_objects(&desired, family, m))
        }
        Mode::Userspace => {
            let from_node = explanation.source.as_ref().is_some_and(|s| s.node_address);
            Box::new(move |m| userspace_objects(m, from_node))
        }
    };
    for m in &mut explanation.matches {
        m.dataplane = Some(Dataplane {
            mode: mode.name(),
            objects: objects(m),
        });
    }
    Ok(())
}

fn proto(p: Protocol) -> String {
    p.api_name().to_ascii_lowercase()
}

/// Whether an nft element key (`ip . proto . port` or `proto . port`) is this match's.
fn nft_key_matches(key: &str, set: ElementSet, m: &ServiceMatch) -> bool {
    let parts: Vec<&str> = key.split(" . ").collect();
    let proto = proto(m.name.protocol);
    let port = m.port.to_string();
    match (set, parts.as_slice()) {
        (ElementSet::ServiceNodePorts | ElementSet::NoEndpointNodePorts, [p, port_]) => {
            m.how == MatchKind::NodePort && *p == proto && *port_ == port
        }
        (_, [ip, p, port_]) => {
            m.how != MatchKind::NodePort
                && ip.parse::<IpAddr>().ok() == Some(m.ip)
                && *p == proto
                && *port_ == port
        }
        _ => false,
    }
}

fn nft_objects(rendered: &NftState, family: IpFamily, m: &ServiceMatch) -> Vec<DataplaneObject> {
    let mut out = vec![table_object(family)];
    let owned = rendered.owned(&m.name);
    let mut goto_chains = Vec::new();
    for set in [
        ElementSet::FirewallIps,
        ElementSet::NoEndpointServices,
        ElementSet::NoEndpointNodePorts,
        ElementSet::ServiceIps,
        ElementSet::ServiceNodePorts,
    ] {
        for (key, value) in rendered.elements(set) {
            if !nft_key_matches(key, set, m) {
                continue;
            }
            if let Some(Verdict::Goto(chain)) = &value.verdict {
                goto_chains.push(chain.to_string());
            }
            out.push(DataplaneObject {
                kind: "map element",
                name: format!("{} {{ {key} }}", set.name()),
                detail: value
                    .verdict
                    .as_ref()
                    .map(Verdict::to_string)
                    .unwrap_or_default(),
            });
        }
    }
    // The service's chains a packet passes, then its endpoint chains.
    if let Some(owned) = owned {
        for chain in &owned.chains {
            if chain.starts_with(nftables::names::ENDPOINT_PREFIX) {
                continue;
            }
            let reached = goto_chains.iter().any(|c| c == chain.as_str());
            out.push(DataplaneObject {
                kind: "chain",
                name: chain.to_string(),
                detail: if reached {
                    "entered from the map element".to_owned()
                } else {
                    "service chain".to_owned()
                },
            });
        }
        for ep in m.endpoints.iter().filter(|e| e.used) {
            let names = nftables::names::EndpointNames::new(&m.name, ep.ip, ep.port);
            if owned.chains.contains(names.chain.as_str()) {
                out.push(DataplaneObject {
                    kind: "chain",
                    name: names.chain,
                    detail: format!("DNAT to {}", super::endpoint_address(ep)),
                });
            }
        }
    }
    out
}

/// The verdict-free layout's elements deciding a packet of `m` (its entry's class, slots,
/// masquerade, filter, firewall and affinity elements, and its endpoints' hairpin ones).
fn layout_objects(
    installed: &layout::LayoutState,
    family: IpFamily,
    m: &ServiceMatch,
) -> Vec<DataplaneObject> {
    let entry = if m.how == MatchKind::NodePort {
        Entry::NodePort {
            proto: m.name.protocol,
            port: m.port,
        }
    } else {
        Entry::Ip {
            addr: m.ip,
            proto: m.name.protocol,
            port: m.port,
        }
    };
    let mut out = vec![table_object(family)];
    out.extend(
        installed
            .deciding(&entry)
            .into_iter()
            .map(|element| DataplaneObject {
                kind: if matches!(element, Element::Slot { .. }) {
                    "map element"
                } else {
                    "set element"
                },
                name: element.to_string(),
                detail: layout_detail(element),
            }),
    );
    out
}

/// What an element of the verdict-free layout does for a packet.
fn layout_detail(element: &Element) -> String {
    match element {
        Element::Entry(set, _) => match set {
            EntrySet::Count(Slots::Policy, n) => format!("DNAT to one of its {n} slots, at random"),
            EntrySet::Count(Slots::ShortCircuit, n) => {
                format!("from this node or its pods: DNAT to one of its {n} cluster-wide slots")
            }
            EntrySet::MasqueradeAll => "masqueraded".to_owned(),
            EntrySet::MasqueradeNotLocal => {
                "masqueraded unless it comes from a local pod".to_owned()
            }
            EntrySet::ShortCircuit => "masqueraded when it comes from this node".to_owned(),
            EntrySet::Reject => "rejected: no usable endpoint".to_owned(),
            EntrySet::Drop => "dropped: no local endpoint".to_owned(),
            EntrySet::Firewall => "source checked against firewall-allow".to_owned(),
            EntrySet::LocalhostReject => {
                "rejected (and counted) when sent to a loopback address".to_owned()
            }
        },
        Element::AffinityEntry(port, set, _) => affinity_detail(port, *set),
        Element::AffinityEndpoint(_, list, ..) => format!("a candidate of the {list:?} pins"),
        Element::Slot {
            slot, addr, port, ..
        } => {
            let addr = match addr {
                IpAddr::V6(v6) => format!("[{v6}]"),
                v4 => v4.to_string(),
            };
            format!("slot {slot}: DNAT to {addr}:{port}")
        }
        Element::Allow(_, net) => format!("sources in {net} allowed"),
        Element::Hairpin(_) => "masqueraded when the endpoint reaches itself".to_owned(),
        Element::ClusterIp(_) => "other ports of this address rejected".to_owned(),
    }
}

/// What an affinity entry set does for a packet of its port.
fn affinity_detail(port: &layout::AffinityPort, set: AffinitySet) -> String {
    let seconds = port.seconds;
    let pins = |list| port.map_name(list, false);
    match set {
        AffinitySet::Record => format!(
            "ClientIP affinity: a new connection's client is pinned to its endpoint for {seconds} s, across the port's addresses"
        ),
        AffinitySet::Cluster => format!(
            "a pinned client goes to its endpoint (map {})",
            pins(PinList::Cluster)
        ),
        AffinitySet::Local => format!(
            "a pinned client goes to its local endpoint (map {})",
            pins(PinList::Local)
        ),
        AffinitySet::ShortCircuit => format!(
            "a pinned client goes to its endpoint: from this node or its pods map {}, else map {}",
            pins(PinList::Cluster),
            pins(PinList::Local)
        ),
    }
}

fn table_object(family: IpFamily) -> DataplaneObject {
    let table_family = match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    };
    DataplaneObject {
        kind: "table",
        name: format!("{table_family} {}", nftables::TABLE),
        detail: "every rule of nftables mode for this family".to_owned(),
    }
}

fn ipvs_objects(
    desired: &ipvs::Desired,
    family: IpFamily,
    m: &ServiceMatch,
) -> Vec<DataplaneObject> {
    let proto = proto(m.name.protocol);
    let mut out = Vec::new();
    for svc in desired.services.values() {
        let server = &svc.server;
        let key = &server.key;
        if key.address != m.ip
            || key.port != m.port
            || key.protocol.to_string().to_ascii_lowercase() != proto
        {
            continue;
        }
        let address = match key.address {
            IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        };
        let mut name = format!(
            "{} {address}:{} {}",
            key.protocol, key.port, server.scheduler
        );
        if server.flags & kp_ipvs::FLAG_PERSISTENT != 0 {
            name.push_str(&format!(" persistent {}", server.timeout));
        }
        out.push(DataplaneObject {
            kind: "virtual server",
            name,
            detail: format!("{} real servers", svc.real_servers.len()),
        });
        for real in &svc.real_servers {
            let address = match real.address {
                IpAddr::V6(v6) => format!("[{v6}]"),
                v4 => v4.to_string(),
            };
            out.push(DataplaneObject {
                kind: "real server",
                name: format!("{address}:{} weight {}", real.port, real.weight),
                detail: if real.weight == ipvs::DRAINING_WEIGHT {
                    "terminating: keeps its connections, gets no new ones".to_owned()
                } else {
                    "takes new connections".to_owned()
                },
            });
        }
    }
    if out.is_empty() {
        // E.g. a localhost NodePort: iptables mode accepts it, ipvs mode does not.
        out.push(DataplaneObject {
            kind: "virtual server",
            name: "none".to_owned(),
            detail: format!(
                "ipvs mode programs no virtual server for {}:{}/{}",
                m.ip,
                m.port,
                m.name.protocol.api_name()
            ),
        });
    }
    let ip_port = format!("{},{proto}:{}", m.ip, m.port);
    let upper = m.name.protocol.api_name();
    for (kind, entries) in &desired.sets {
        let set = kind.name(family);
        for entry in entries {
            let ours = entry == &ip_port
                || entry.starts_with(&format!("{ip_port},"))
                || (m.how == MatchKind::NodePort
                    && *entry == m.port.to_string()
                    && set.ends_with(upper));
            if ours {
                out.push(DataplaneObject {
                    kind: "ipset",
                    name: set.clone(),
                    detail: format!("entry {entry}"),
                });
            }
        }
    }
    out
}

fn userspace_objects(m: &ServiceMatch, from_node: bool) -> Vec<DataplaneObject> {
    let chains = userspace::CaptureChains::new(&m.name);
    let chain = |name: &str, detail: String| DataplaneObject {
        kind: "chain",
        name: name.to_owned(),
        detail,
    };
    // Services the relay cannot serve are refused or dropped in the filter table.
    match m.outcome {
        Outcome::RejectNoEndpoints => {
            return vec![chain(
                userspace::KUBE_USERSPACE_FILTER,
                "filter: REJECT (no endpoints)".to_owned(),
            )];
        }
        Outcome::DropNoLocalEndpoints => {
            return vec![chain(
                userspace::KUBE_USERSPACE_FILTER,
                "filter: DROP (no local endpoints)".to_owned(),
            )];
        }
        Outcome::Dnat | Outcome::DropSourceRange => {}
    }
    let redirect = "nat: DNAT to the relay's address and its port for this service port \
                    (REDIRECT when the node has no local address of this family)"
        .to_owned();
    // The node's own traffic to an external address of an eTP Local service is internal
    // traffic: `KUBE-USX-…` sends it to the ClusterIP's chain (and frontend).
    let node_shortcut = from_node
        && m.how.is_external()
        && m.external_traffic_policy == Some(super::TrafficPolicy::Local)
        && m.internal_traffic_policy == super::TrafficPolicy::Cluster
        && m.endpoint_list == super::EndpointList::Cluster;
    let external_chain = |out: &mut Vec<DataplaneObject>| {
        if node_shortcut {
            out.push(chain(
                &chains.external,
                format!(
                    "nat: the node's own traffic (--src-type LOCAL) -> {}",
                    chains.internal
                ),
            ));
            out.push(chain(&chains.internal, redirect.clone()));
        } else {
            out.push(chain(&chains.external, redirect.clone()));
        }
    };
    let mut out = Vec::new();
    match m.how {
        MatchKind::ClusterIp => {
            out.push(chain(
                userspace::KUBE_USERSPACE,
                format!("nat: -> {}", chains.internal),
            ));
            out.push(chain(&chains.internal, redirect.clone()));
        }
        MatchKind::NodePort => {
            out.push(chain(
                userspace::KUBE_USERSPACE_NODEPORTS,
                format!("nat: -> {}", chains.external),
            ));
            external_chain(&mut out);
        }
        MatchKind::ExternalIp | MatchKind::LoadBalancerIp => {
            let firewalled =
                m.how == MatchKind::LoadBalancerIp && !m.load_balancer_source_ranges.is_empty();
            if firewalled {
                out.push(chain(
                    userspace::KUBE_USERSPACE,
                    format!("nat: -> {}", chains.firewall),
                ));
                out.push(chain(
                    &chains.firewall,
                    format!(
                        "nat: sources in loadBalancerSourceRanges (and the LB IPs themselves \
                         when a node IP is in them) -> {}, others marked and dropped in {}",
                        chains.external,
                        userspace::KUBE_USERSPACE_FILTER
                    ),
                ));
            } else {
                out.push(chain(
                    userspace::KUBE_USERSPACE,
                    format!("nat: -> {}", chains.external),
                ));
            }
            external_chain(&mut out);
        }
    }
    if let Some(affinity) = m.session_affinity {
        out.push(DataplaneObject {
            kind: "affinity",
            name: m.service_port.clone(),
            detail: format!(
                "ClientIP, {}s: the relay keeps one pin per client IP for this service port, \
                 shared by its ClusterIP, NodePort, externalIPs and LB IPs (both families); \
                 which endpoint a client is pinned to is known only to the running proxy \
                 (/debug/explain with from=, metric kube_proxy_rs_userspace_affinity_clients)",
                affinity.timeout_seconds
            ),
        });
    }
    out
}
