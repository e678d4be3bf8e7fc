//! Reading `iptables-save` output, and the restore input that removes kube-proxy's chains.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use kp_rules::iptables::Table;
use kp_rules::iptables::names::is_service_chain;

use crate::exec::split_args;

/// Every chain kube-proxy (this one or upstream, any mode) creates starts with this.
pub const KUBE_CHAIN_PREFIX: &str = "KUBE-";

/// `KUBE-` chains the kubelet creates, which cleanup never removes or flushes. The kubelet
/// re-creates its chains only when its `KUBE-KUBELET-CANARY` disappears, so a removed one stays
/// gone until the kubelet restarts.
///
/// - `KUBE-FIREWALL` blocks outside traffic to 127.0.0.0/8 (and, before v1.27's kubelet,
///   drops packets marked by `KUBE-MARK-DROP`): without it a node with `route_localnet=1` is
///   unprotected (CVE-2020-8558).
/// - `KUBE-KUBELET-CANARY` is the kubelet's flush detector.
/// - `KUBE-IPTABLES-HINT` tells every component which iptables backend the node uses (our
///   own detection reads it too).
/// - `KUBE-MARK-DROP` only kubelets before the `IPTablesOwnershipCleanup` change (default off
///   up to v1.26) create; no kube-proxy of that era or later does.
pub const KUBELET_CHAINS: [&str; 4] = [
    "KUBE-FIREWALL",
    "KUBE-KUBELET-CANARY",
    "KUBE-IPTABLES-HINT",
    "KUBE-MARK-DROP",
];

/// The chain the kubelet shares with kube-proxy until v1.27: a kubelet of that era creates it
/// next to `KUBE-MARK-DROP`, and upstream's cleanup of that era leaves it; later cleanups,
/// whose kubelet no longer creates it, remove it.
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";

/// The fixed chains some kube-proxy mode creates (this one's, or upstream's in any version),
/// which cleanup removes. Per-service chains are found by prefix ([`OWN_PREFIXES`]); any other
/// `KUBE-` chain belongs to someone else (the kubelet, kube-router's `KUBE-ROUTER-*` and
/// `KUBE-NWPLCY-*`, ...).
pub const OWN_CHAINS: [&str; 19] = [
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    "KUBE-LOAD-BALANCER",
    "KUBE-NODE-PORT",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
    "KUBE-USERSPACE",
    "KUBE-USERSPACE-FILTER",
    "KUBE-USERSPACE-NODEPORTS",
    "KUBE-PORTALS-CONTAINER",
    "KUBE-PORTALS-HOST",
    "KUBE-NODEPORT-CONTAINER",
    "KUBE-NODEPORT-HOST",
];

/// Prefixes of the per-service chains of every mode (iptables' `KUBE-SVC/SVL/EXT/FW/SEP-`,
/// upstream's older `KUBE-XLB-`, userspace mode's `KUBE-USR/USX/USF-`).
pub const OWN_PREFIXES: [&str; 9] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
    "KUBE-XLB-",
    "KUBE-USR-",
    "KUBE-USX-",
    "KUBE-USF-",
];

/// One table of an `iptables-save` dump.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    /// Every chain, built-in and user-defined, in dump order.
    pub chains: Vec<String>,
    /// Every rule as (chain, specification after `-A CHAIN `), in dump order.
    pub rules: Vec<(String, String)>,
}

impl SavedTable {
    /// Parse the dump of one table (`iptables-save -t <table>`). Comment lines, the table
    /// header and `COMMIT` are skipped; nothing here can fail, unknown lines are ignored.
    pub fn parse(text: &str) -> Self {
        let mut table = SavedTable::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix(':') {
                if let Some(name) = rest.split_whitespace().next() {
                    table.chains.push(name.to_owned());
                }
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let (chain, spec) = rest.split_once(' ').unwrap_or((rest, ""));
                table.rules.push((chain.to_owned(), spec.to_owned()));
            }
        }
        table
    }

    /// The per-service nat chains (`KUBE-SVC/SVL/EXT/FW/SEP-*`) present.
    pub fn service_chains(&self) -> BTreeSet<String> {
        self.chains
            .iter()
            .filter(|c| is_service_chain(c))
            .cloned()
            .collect()
    }
}

/// The per-service nat chains (`KUBE-SVC/SVL/EXT/FW/SEP-*`) declared in `iptables-save`
/// output, read from its `:CHAIN` lines only: what [`SavedTable::parse`] then
/// [`SavedTable::service_chains`] give, without copying every rule (half a million at
/// 10,000 services).
pub fn service_chains(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix(':')?.split_whitespace().next())
        .filter(|c| is_service_chain(c))
        .map(str::to_owned)
        .collect()
}

/// The jump or goto target of a rule specification, if any.
pub fn rule_target(spec: &str) -> Option<String> {
    let args = split_args(spec);
    args.windows(2)
        .find(|pair| matches!(pair[0].as_str(), "-j" | "--jump" | "-g" | "--goto"))
        .map(|pair| pair[1].clone())
}

/// Whether cleanup deletes `chain` of a table whose chains are `table`: kube-proxy's own
/// chains, and `KUBE-MARK-MASQ` unless a kubelet that shares it is there (its
/// `KUBE-MARK-DROP` in the same table says so).
pub fn is_removable(chain: &str, table: &SavedTable) -> bool {
    if chain == KUBE_MARK_MASQ {
        return !table.chains.iter().any(|c| c == "KUBE-MARK-DROP");
    }
    is_own_chain(chain)
}

/// Whether some kube-proxy mode creates `chain` (`OWN_CHAINS`, `OWN_PREFIXES`); the
/// shared `KUBE-MARK-MASQ` is not counted here (see `is_removable`).
pub fn is_own_chain(chain: &str) -> bool {
    OWN_CHAINS.contains(&chain) || OWN_PREFIXES.iter().any(|p| chain.starts_with(p))
}

/// The restore input removing every removable chain of `table`, or `None` when there is
/// none. Rules in other chains (built-in or foreign) that jump to a removed chain are
/// deleted first (`-D` with the dumped specification), since a referenced chain cannot be
/// deleted; every other rule and chain is left as it is. Declaring the chains flushes them
/// all before any `-X`, so references between them do not matter.
pub fn cleanup_input(table: Table, saved: &SavedTable) -> Option<String> {
    let doomed: BTreeSet<&str> = saved
        .chains
        .iter()
        .map(String::as_str)
        .filter(|c| is_removable(c, saved))
        .collect();
    if doomed.is_empty() {
        return None;
    }
    let mut text = format!("*{}\n", table.as_str());
    for chain in &doomed {
        let _ = writeln!(text, ":{chain} - [0:0]");
    }
    for (chain, spec) in &saved.rules {
        let jumps_to_doomed =
            rule_target(spec).is_some_and(|target| doomed.contains(target.as_str()));
        if !doomed.contains(chain.as_str()) && jumps_to_doomed {
            let _ = writeln!(text, "-D {chain} {spec}");
        }
    }
    for chain in &doomed {
        let _ = writeln!(text, "-X {chain}");
    }
    text.push_str("COMMIT\n");
    Some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUMP: &str = "\
# Generated by iptables-save v1.8.9 (nf_tables) on Sun Nov 22 05:59:53 2026
*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:FOO-CHAIN - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"says -j KUBE-SERVICES\" -j ACCEPT
-A OUTPUT -j KUBE-FIREWALL
-A FOO-CHAIN -s 192.0.2.1/32 -g KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SERVICES -d 10.96.0.10/32 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SVC-XPGD46QRK7WJZT7O -j KUBE-SEP-SXIVWICOYRO3J4NJ
COMMIT
# Completed on Sun Nov 22 05:59:53 2026
";

    #[test]
    fn parses_chains_and_rules() {
        let saved = SavedTable::parse(DUMP);
        assert_eq!(saved.chains.len(), 7);
        assert_eq!(saved.rules.len(), 6);
        assert_eq!(saved.rules[0].0, "PREROUTING");
        assert_eq!(
            saved.service_chains().into_iter().collect::<Vec<_>>(),
            ["KUBE-SEP-SXIVWICOYRO3J4NJ", "KUBE-SVC-XPGD46QRK7WJZT7O"]
        );
        assert_eq!(service_chains(DUMP), saved.service_chains());
    }

    #[test]
    fn targets_ignore_text_inside_comments() {
        assert_eq!(
            rule_target("-m comment --comment \"says -j KUBE-SERVICES\" -j ACCEPT").as_deref(),
            Some("ACCEPT")
        );
        assert_eq!(rule_target("-g KUBE-X").as_deref(), Some("KUBE-X"));
        assert_eq!(rule_target("-s 10.0.0.0/8"), None);
    }

    #[test]
    fn cleanup_removes_kube_chains_and_jumps_only() {
        let input = cleanup_input(Table::Nat, &SavedTable::parse(DUMP)).expect("has KUBE chains");
        assert_eq!(
            input,
            "*nat\n\
             :KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]\n\
             :KUBE-SERVICES - [0:0]\n\
             :KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]\n\
             -D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -D FOO-CHAIN -s 192.0.2.1/32 -g KUBE-SVC-XPGD46QRK7WJZT7O\n\
             -X KUBE-SEP-SXIVWICOYRO3J4NJ\n\
             -X KUBE-SERVICES\n\
             -X KUBE-SVC-XPGD46QRK7WJZT7O\n\
             COMMIT\n"
        );
    }

    #[test]
    fn nothing_to_clean_gives_no_input() {
        let saved =
            SavedTable::parse("*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\nCOMMIT\n");
        assert_eq!(cleanup_input(Table::Filter, &saved), None);
    }
}
