//! What must exist outside the restore: kube-proxy's jumps from the built-in chains, the
//! canary chains, and its rule in the kubelet's `KUBE-FIREWALL`.
//!
//! Upstream inserts each jump at the top of its built-in chain with one `iptables` call on
//! full syncs only, rather than in the restore input, because `--noflush` cannot say "insert
//! unless present" and must never flush a built-in chain that other software fills. The same
//! holds for `KUBE-FIREWALL` ([`SharedRule`]).

use kp_core::model::IpFamily;

use super::comment::comment_args;
use super::render::ipv4_loopback;
use super::rule::{CtStates, Match, Rule, Target};
use super::{
    KUBE_EXTERNAL_SERVICES, KUBE_FIREWALL, KUBE_FORWARD, KUBE_NODEPORTS, KUBE_POSTROUTING,
    KUBE_PROXY_FIREWALL, KUBE_SERVICES, RenderConfig,
};

/// An empty chain kube-proxy creates and polls; if it disappears someone flushed the tables,
/// and the next sync must be full.
pub const CANARY_CHAIN: &str = "KUBE-PROXY-CANARY";

/// Only new connections need service handling; established ones are already translated.
const NEW_ONLY: Match<'static> = Match::Conntrack {
    states: CtStates::NEW,
    negated: false,
};

/// An iptables table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    /// `filter`.
    Filter,
    /// `nat`.
    Nat,
    /// `mangle` (only the canary lives there).
    Mangle,
}

impl Table {
    /// The table's name (`-t` argument).
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
            Table::Mangle => "mangle",
        }
    }
}

/// One jump from a built-in chain into a kube-proxy chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JumpRule {
    /// The table.
    pub table: Table,
    /// The built-in chain (`INPUT`, `FORWARD`, `OUTPUT`, `PREROUTING`, `POSTROUTING`).
    pub from: &'static str,
    /// The kube-proxy chain jumped to.
    pub to: &'static str,
    /// The rule specification after the chain name, ending in `-j <to>`; usable with
    /// `iptables -t <table> -C <from> <spec>` and `-I <from> 1 <spec>`. Its comment comes
    /// after the conntrack match, unlike `rule`'s `Display` (which puts comments first).
    pub spec: String,
    /// The same rule, typed (chain `from`), where the mode builds it from types (iptables
    /// mode does; ipvs and userspace modes' jumps carry only `spec`).
    pub rule: Option<Rule<'static>>,
}

/// A rule kube-proxy needs in a chain another component owns too: appended when missing
/// (`-C`, then `-A`), never written by flushing the chain.
///
/// The one such chain is the kubelet's `KUBE-FIREWALL`. A kubelet before the
/// `IPTablesOwnershipCleanup` change (v1.26 and older by default) keeps its
/// `-m mark --mark 0x8000/0x8000 -j DROP` there and re-creates it only when its canary
/// disappears, so a restore that declared the chain would drop that rule until the kubelet
/// restarts. Newer kubelets write the same localnet rule as ours, which `-C` finds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedRule {
    /// The table.
    pub table: Table,
    /// The shared chain.
    pub chain: &'static str,
    /// The rule specification after the chain name, for `-C`/`-A`.
    pub spec: String,
}

/// Everything to ensure once per full sync, before the restore.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    /// Chains to create if missing (`-N`), including the canaries.
    pub chains: Vec<(Table, &'static str)>,
    /// Jumps to insert at position 1 of their built-in chain if missing, in this order.
    pub jumps: Vec<JumpRule>,
    /// Rules to append to shared chains if missing, after the chains exist.
    pub shared: Vec<SharedRule>,
}

/// The rule that keeps outside hosts from reaching 127.0.0.0/8 through `route_localnet`
/// (CVE-2020-8558), as the kubelet writes it.
pub fn localnet_block_rule() -> Rule<'static> {
    Rule::new(KUBE_FIREWALL)
        .comment("block incoming localnet connections")
        .with(Match::Destination {
            addr: ipv4_loopback(),
            negated: false,
        })
        .with(Match::Source {
            addr: ipv4_loopback(),
            negated: true,
        })
        .with(Match::Conntrack {
            states: CtStates::RELATED | CtStates::ESTABLISHED | CtStates::DNAT,
            negated: true,
        })
        .target(Target::Drop)
}

/// The chains and jumps upstream ensures for `family`.
pub fn setup(family: IpFamily, config: &RenderConfig) -> Setup {
    let jump =
        |table, from: &'static str, to, extra: Option<Match<'static>>, comment: Option<&str>| {
            let mut spec = String::new();
            if let Some(extra) = &extra {
                spec.push_str(&extra.to_string());
                spec.push(' ');
            }
            if let Some(comment) = comment {
                spec.push_str(&comment_args(comment));
                spec.push(' ');
            }
            spec.push_str("-j ");
            spec.push_str(to);
            let mut rule = Rule::new(from).with_all(extra).jump(to);
            rule.comment = comment.map(|c| super::rule::Comment::Text(c.to_owned().into()));
            JumpRule {
                table,
                from,
                to,
                spec,
                rule: Some(rule),
            }
        };
    let external = Some("kubernetes externally-visible service portals");
    let portals = Some("kubernetes service portals");
    let firewall = Some("kubernetes load balancer firewall");
    let new = || Some(NEW_ONLY);
    let mut jumps = vec![
        jump(
            Table::Filter,
            "INPUT",
            KUBE_EXTERNAL_SERVICES,
            new(),
            external,
        ),
        jump(
            Table::Filter,
            "FORWARD",
            KUBE_EXTERNAL_SERVICES,
            new(),
            external,
        ),
        jump(
            Table::Filter,
            "INPUT",
            KUBE_NODEPORTS,
            None,
            Some("kubernetes health check service ports"),
        ),
        jump(Table::Filter, "FORWARD", KUBE_SERVICES, new(), portals),
        jump(Table::Filter, "OUTPUT", KUBE_SERVICES, new(), portals),
        jump(
            Table::Filter,
            "FORWARD",
            KUBE_FORWARD,
            None,
            Some("kubernetes forwarding rules"),
        ),
        jump(Table::Filter, "INPUT", KUBE_PROXY_FIREWALL, new(), firewall),
        jump(
            Table::Filter,
            "OUTPUT",
            KUBE_PROXY_FIREWALL,
            new(),
            firewall,
        ),
        jump(
            Table::Filter,
            "FORWARD",
            KUBE_PROXY_FIREWALL,
            new(),
            firewall,
        ),
        jump(Table::Nat, "OUTPUT", KUBE_SERVICES, None, portals),
        jump(Table::Nat, "PREROUTING", KUBE_SERVICES, None, portals),
        jump(
            Table::Nat,
            "POSTROUTING",
            KUBE_POSTROUTING,
            None,
            Some("kubernetes postrouting rules"),
        ),
    ];
    let mut chains: Vec<(Table, &'static str)> = Vec::new();
    let mut shared = Vec::new();
    if family == IpFamily::V4 && config.localhost_node_ports {
        // Kubelet installs the same jumps; upstream ensures them too when it relies on
        // `route_localnet`.
        jumps.push(jump(Table::Filter, "INPUT", KUBE_FIREWALL, None, None));
        jumps.push(jump(Table::Filter, "OUTPUT", KUBE_FIREWALL, None, None));
        let line = localnet_block_rule().to_string();
        let prefix = format!("-A {KUBE_FIREWALL} ");
        shared.push(SharedRule {
            table: Table::Filter,
            chain: KUBE_FIREWALL,
            spec: line.strip_prefix(&prefix).unwrap_or(&line).to_owned(),
        });
    }
    for rule in &jumps {
        if !chains.contains(&(rule.table, rule.to)) {
            chains.push((rule.table, rule.to));
        }
    }
    for table in [Table::Mangle, Table::Nat, Table::Filter] {
        chains.push((table, CANARY_CHAIN));
    }
    Setup {
        chains,
        jumps,
        shared,
    }
}
