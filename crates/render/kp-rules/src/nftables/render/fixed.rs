//! The table's fixed part: base chains, helper chains, sets and maps (flushed), and their
//! rules. Written on every full sync; a partial sync is only possible while it is unchanged,
//! so its text doubles as the fingerprint of the installed layout.

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};

use super::super::cmd::{
    Action, AddrField, Command, ElementKey, ElementValue, Hook, KeyParts, MapKey, Match, Rule,
    SetKind, Verdict,
};
use super::super::{
    BASE_CHAINS, CLUSTER_IPS, ElementSet, FIREWALL_IPS, MARK_FOR_MASQUERADE, NO_ENDPOINT_NODEPORTS,
    NO_ENDPOINT_SERVICES, NODEPORT_IPS, NODEPORT_LOCALHOST_REJECT, REJECT_CHAIN, SERVICE_IPS,
    SERVICE_NODEPORTS,
};
use super::{Context, add_chain, add_rule, addr_in_set, comment_text, jump};

/// Fixed chains (besides the base chains) and the rules jumping to them.
const SERVICES: &str = "services";
const MASQUERADING: &str = "masquerading";
const FIREWALL_CHECK: &str = "firewall-check";
const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";

/// The fixed part's commands: its chains, its sets and maps, the NodePort addresses, then
/// the rules of the base chains and of the helper chains.
pub(super) fn fixed_commands(
    ctx: &Context<'_>,
    mark: u32,
    service_cidrs: &[IpNet],
) -> Vec<Command> {
    let mut out = chains();
    out.extend(sets());
    let nodeport_match = nodeport_ips(ctx, &mut out);
    out.extend(base_chain_jumps());
    out.extend(localhost_rejects(ctx));
    out.extend(cluster_ips_check(ctx, service_cidrs));
    out.extend(helper_rules(ctx, mark, nodeport_match));
    out
}

/// The base chains with their hooks, then the helper chains, each added and flushed.
fn chains() -> Vec<Command> {
    let mut out = Vec::new();
    for chain in &BASE_CHAINS {
        out.push(Command::AddChain {
            chain: chain.name.into(),
            hook: Some(Hook {
                kind: chain.kind,
                hook: chain.hook,
                priority: chain.priority,
            }),
            comment: None,
        });
        out.push(Command::FlushChain(chain.name.into()));
    }
    for chain in [
        CLUSTER_IPS_CHECK,
        FIREWALL_CHECK,
        MARK_FOR_MASQUERADE,
        MASQUERADING,
        NODEPORT_ENDPOINTS_CHECK,
        SERVICES,
        SERVICE_ENDPOINTS_CHECK,
    ] {
        out.push(add_chain(chain));
        out.push(Command::FlushChain(chain.into()));
    }
    out.push(Command::AddChain {
        chain: REJECT_CHAIN.into(),
        hook: None,
        comment: Some(comment_text(
            "helper for @no-endpoint-services / @no-endpoint-nodeports",
        )),
    });
    out.push(Command::FlushChain(REJECT_CHAIN.into()));
    out
}

/// The sets and verdict maps the services' elements go into, added and flushed.
fn sets() -> Vec<Command> {
    let mut out = Vec::new();
    let ip_port = SetKind::VerdictMap(MapKey::AddrProtoPort);
    let port_only = SetKind::VerdictMap(MapKey::ProtoPort);
    for (name, kind, text) in [
        (
            CLUSTER_IPS,
            SetKind::Addresses { timeout: None },
            "Active ClusterIPs",
        ),
        (
            FIREWALL_IPS,
            ip_port,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        (
            NO_ENDPOINT_NODEPORTS,
            port_only,
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        (
            NO_ENDPOINT_SERVICES,
            ip_port,
            "vmap to drop or reject packets to services with no endpoints",
        ),
        (
            SERVICE_IPS,
            ip_port,
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (SERVICE_NODEPORTS, port_only, "NodePort traffic"),
        (
            NODEPORT_LOCALHOST_REJECT,
            SetKind::ProtoPorts,
            "NodePorts whose localhost traffic is rejected",
        ),
    ] {
        out.push(Command::AddSet {
            set: name.into(),
            kind,
            comment: Some(comment_text(text)),
        });
    }
    for set in ElementSet::ALL {
        out.push(Command::FlushSet {
            set: set.name().into(),
            map: set.object() == "map",
        });
    }
    out
}

/// Which destinations accept NodePorts: the listed node addresses (the `nodeport-ips` set,
/// filled here, and the match on it), or every local address but loopback (`None`: the set
/// is deleted). Loopback never is one: the kernel cannot DNAT it without `route_localnet`;
/// localhost NodePorts are the userspace listeners' (KEP-6032; the rest of their traffic is
/// [`localhost_rejects`]').
fn nodeport_ips(ctx: &Context<'_>, out: &mut Vec<Command>) -> Option<Match> {
    out.push(Command::AddSet {
        set: NODEPORT_IPS.into(),
        kind: SetKind::Addresses { timeout: None },
        comment: Some(comment_text("IPs that accept NodePort traffic")),
    });
    match ctx.config.node_port_addresses.nftables_ips(ctx.family) {
        None => {
            // Ensure the set is gone: `add` first so the `delete` cannot fail.
            out.push(Command::DeleteSet(NODEPORT_IPS.into()));
            None
        }
        Some(ips) => {
            out.push(Command::FlushSet {
                set: NODEPORT_IPS.into(),
                map: false,
            });
            for node_ip in ips {
                out.push(Command::AddElement {
                    set: NODEPORT_IPS.into(),
                    key: ElementKey::new(KeyParts::Addr(node_ip)),
                    value: ElementValue::default(),
                });
            }
            Some(addr_in_set(AddrField::Destination, NODEPORT_IPS))
        }
    }
}

/// The base chains' jumps to the helper chains.
fn base_chain_jumps() -> Vec<Command> {
    let mut out = Vec::new();
    let mut rule = |chain: &'static str, rule: Rule| out.push(add_rule(chain, rule));
    let new = || vec![Match::CtStateNew];
    for chain in ["filter-prerouting-pre-dnat", "filter-output-pre-dnat"] {
        rule(chain, jump(new(), FIREWALL_CHECK));
    }
    for chain in ["filter-forward", "filter-output"] {
        rule(chain, jump(new(), SERVICE_ENDPOINTS_CHECK));
        rule(chain, jump(new(), CLUSTER_IPS_CHECK));
    }
    rule("filter-input", jump(new(), NODEPORT_ENDPOINTS_CHECK));
    rule("filter-input", jump(new(), SERVICE_ENDPOINTS_CHECK));
    for chain in ["nat-prerouting", "nat-output"] {
        rule(chain, jump(Vec::new(), SERVICES));
    }
    rule("nat-postrouting", jump(Vec::new(), MASQUERADING));
    out
}

/// KEP-6032: localhost traffic to the NodePorts of `nodeport-localhost-reject` is rejected
/// in `filter-input`, counted per protocol in upstream's named counters, as the verdict-free
/// layout does; a protocol not rejected has its counter deleted (`add` first, so the
/// deletion cannot fail). Its own `proto . port` set, because the NodePort verdict maps
/// cannot be looked up as a set (their `goto` elements: EOPNOTSUPP).
fn localhost_rejects(ctx: &Context<'_>) -> Vec<Command> {
    let mut out = Vec::new();
    let loopback = Match::Addr {
        field: AddrField::Destination,
        negate: false,
        value: ctx.fam.loopback,
    };
    for proto in crate::nftables::layout::element::PROTOCOLS {
        let counter = crate::nftables::localhost_reject_counter(proto);
        out.push(Command::AddCounter(counter.into()));
        if !ctx.localhost_rejects.contains(&proto) {
            out.push(Command::DeleteCounter(counter.into()));
            continue;
        }
        // A reset for TCP, as a port without a socket answers (see the verdict-free layout).
        let action = Action::CountedReject {
            counter: counter.into(),
            tcp_reset: proto == Protocol::Tcp,
        };
        let matches = vec![
            loopback.clone(),
            Match::L4Proto(proto),
            Match::ProtoPortInSet(NODEPORT_LOCALHOST_REJECT.into()),
        ];
        out.push(add_rule("filter-input", Rule::new(matches, action)));
    }
    out
}

/// `cluster-ips-check`: traffic to a ClusterIP's ports no service uses is rejected, and
/// traffic to unallocated addresses of the service CIDRs dropped.
fn cluster_ips_check(ctx: &Context<'_>, service_cidrs: &[IpNet]) -> Vec<Command> {
    let daddr = AddrField::Destination;
    let mut out = vec![add_rule(
        CLUSTER_IPS_CHECK,
        Rule::new(vec![addr_in_set(daddr, CLUSTER_IPS)], Action::Reject).with_comment(
            comment_text("Reject traffic to invalid ports of ClusterIPs"),
        ),
    )];
    let cidrs: Vec<IpNet> = service_cidrs
        .iter()
        .filter(|c| IpFamily::of_net(c) == ctx.family)
        .map(IpNet::trunc)
        .collect();
    let cidrs = IpNet::aggregate(&cidrs);
    if !cidrs.is_empty() {
        out.push(add_rule(
            CLUSTER_IPS_CHECK,
            Rule::verdict(
                vec![Match::AddrIn {
                    field: daddr,
                    negate: false,
                    nets: cidrs,
                }],
                Verdict::Drop,
            )
            .with_comment(comment_text("Drop traffic to unallocated ClusterIPs")),
        ));
    }
    out
}

/// The other helper chains' rules: the lookups in the verdict maps (firewall, dispatch,
/// no-endpoint filters), masquerading, and the reject helper.
fn helper_rules(ctx: &Context<'_>, mark: u32, nodeport_match: Option<Match>) -> Vec<Command> {
    let daddr = AddrField::Destination;
    let mut out = Vec::new();
    let mut rule = |chain: &'static str, rule: Rule| out.push(add_rule(chain, rule));
    let vmap = |key: MapKey, map: &'static str| Action::Vmap {
        key,
        map: map.into(),
    };
    rule(
        FIREWALL_CHECK,
        Rule::new(Vec::new(), vmap(MapKey::AddrProtoPort, FIREWALL_IPS)),
    );
    for (chain, masquerade) in masquerade_rules(mark, ctx.config.random_fully) {
        rule(chain, masquerade);
    }
    let not_loopback = Match::Addr {
        field: daddr,
        negate: true,
        value: ctx.fam.loopback,
    };
    // Only reached from filter-input, so the destination is local already.
    let no_endpoint_match = nodeport_match.clone().unwrap_or(not_loopback.clone());
    rule(
        NODEPORT_ENDPOINTS_CHECK,
        Rule::new(
            vec![no_endpoint_match],
            vmap(MapKey::ProtoPort, NO_ENDPOINT_NODEPORTS),
        ),
    );
    rule(REJECT_CHAIN, Rule::new(Vec::new(), Action::Reject));
    rule(
        SERVICES,
        Rule::new(Vec::new(), vmap(MapKey::AddrProtoPort, SERVICE_IPS)),
    );
    let nodeport_matches = match nodeport_match {
        Some(matched) => vec![matched],
        None => vec![Match::FibLocal(daddr), not_loopback],
    };
    rule(
        SERVICES,
        Rule::new(nodeport_matches, vmap(MapKey::ProtoPort, SERVICE_NODEPORTS)),
    );
    rule(
        SERVICE_ENDPOINTS_CHECK,
        Rule::new(
            Vec::new(),
            vmap(MapKey::AddrProtoPort, NO_ENDPOINT_SERVICES),
        ),
    );
    out
}

/// `mark-for-masquerade` sets the mark; `masquerading` masquerades marked packets once
/// (clearing the mark) and returns the others.
fn masquerade_rules(mark: u32, fully_random: bool) -> [(&'static str, Rule); 4] {
    [
        (
            MARK_FOR_MASQUERADE,
            Rule::new(Vec::new(), Action::MarkOr(mark)),
        ),
        (
            MASQUERADING,
            Rule::verdict(
                vec![Match::MarkAnd {
                    mask: mark,
                    value: 0,
                }],
                Verdict::Return,
            ),
        ),
        (MASQUERADING, Rule::new(Vec::new(), Action::MarkXor(mark))),
        (
            MASQUERADING,
            Rule::new(Vec::new(), Action::Masquerade { fully_random }),
        ),
    ]
}
