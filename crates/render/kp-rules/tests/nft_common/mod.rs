//! Helpers for the nftables renderer's tests: upstream's nftables test conventions, render
//! wrappers, and a runner for `nft` inside a throwaway network namespace.
//!
//! The state builders (`state`, `endpoint`, `cluster_ip`, ...) come from `tests/common`.

#![allow(dead_code, missing_docs)]

use std::collections::BTreeSet;

use ipnet::IpNet;
use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, ServiceName};
use kp_core::tracker::ProxyState;
use kp_rules::nftables::{
    LocalDetector, NftOutput, NftScope, NftState, NodePortAddresses, RenderConfig, render,
};

/// Upstream's nftables test configuration: mark 0x4000, pod CIDRs 10.0.0.0/8 and
/// fd00:10::/64, NodePorts only on 192.168.0.2 and 2001:db8::1.
pub fn nft_config() -> RenderConfig {
    RenderConfig {
        local_detector: LocalDetector::Cidrs(vec![
            "10.0.0.0/8".parse().expect("literal"),
            "fd00:10::/64".parse().expect("literal"),
        ]),
        node_port_addresses: NodePortAddresses::Ips(vec![
            "192.168.0.2".parse().expect("literal"),
            "2001:db8::1".parse().expect("literal"),
        ]),
        ..RenderConfig::default()
    }
}

/// Upstream's test service CIDRs.
pub fn service_cidrs() -> Vec<IpNet> {
    vec![
        "172.30.0.0/16".parse().expect("literal"),
        "fd00:10:96::/112".parse().expect("literal"),
    ]
}

pub fn render_with(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    kind: SyncKind,
    changed: &BTreeSet<ServiceName>,
    existing: &NftState,
    delete_stale: bool,
) -> NftOutput {
    let cidrs = service_cidrs();
    render(
        state,
        family,
        config,
        &NftScope {
            kind,
            changed,
            existing,
            delete_stale,
            service_cidrs: &cidrs,
        },
    )
    .expect("valid config renders")
}

/// A full sync from nothing.
pub fn full(state: &ProxyState, family: IpFamily, config: &RenderConfig) -> NftOutput {
    render_with(
        state,
        family,
        config,
        SyncKind::Full,
        &BTreeSet::new(),
        &NftState::default(),
        false,
    )
}

/// A partial sync on top of `existing`.
pub fn partial(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    changed: &BTreeSet<ServiceName>,
    existing: &NftState,
    delete_stale: bool,
) -> NftOutput {
    render_with(
        state,
        family,
        config,
        SyncKind::Partial,
        changed,
        existing,
        delete_stale,
    )
}

pub fn table(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip kube-proxy",
        IpFamily::V6 => "ip6 kube-proxy",
    }
}

/// Checks that hold without a kernel: every line is one statement on our table, and double
/// quotes only delimit `comment "..."` strings.
pub fn check_structure(script: &str, family: IpFamily) {
    let table = table(family);
    let verbs = [
        "add table",
        "add chain",
        "flush chain",
        "delete chain",
        "add rule",
        "add set",
        "flush set",
        "delete set",
        "add map",
        "flush map",
        "add element",
        "delete element",
        "add counter",
        "delete counter",
    ];
    for line in script.lines() {
        assert!(
            verbs
                .iter()
                .any(|v| line.starts_with(&format!("{v} {table} "))),
            "unexpected statement {line:?}"
        );
        let mut rest = line;
        let mut quotes = 0;
        while let Some(at) = rest.find('"') {
            quotes += 1;
            if quotes % 2 == 1 {
                let allowed = rest[..at].ends_with("comment ")
                    || rest[..at].ends_with("iifname ")
                    || rest[..at].ends_with("iifname != ");
                assert!(allowed, "quote outside a comment in {line:?}");
            }
            rest = &rest[at + 1..];
        }
        assert_eq!(quotes % 2, 0, "unbalanced quotes in {line:?}");
    }
}

/// Why `nft` cannot be run in a throwaway namespace here, if it cannot. In CI (`CI` set) a
/// missing prerequisite is a failure, never a skip.
pub fn nft_unavailable() -> Option<String> {
    crate::common::kernel_check_unavailable("nft", &["nft", "list", "ruleset"])
}

/// Feeds each script in turn to `nft` inside one fresh network namespace: first `nft -c -f`
/// (parse and kernel validation without committing), then `nft -f` for real. Empty scripts
/// are skipped, as a backend would. The namespace, and everything applied to it, vanishes
/// when the shell exits; the host's ruleset is never read or written. Returns `nft list
/// table` of the namespace afterwards, or the failing step and nft's message.
pub fn apply_in_netns(family: IpFamily, scripts: &[&str]) -> Result<String, String> {
    apply_in_netns_then(scripts, &format!("nft list table {}", table(family)))
}

/// As [`apply_in_netns`], with `last` (a shell command) run at the end instead of the
/// listing; returns its output.
pub fn apply_in_netns_then(scripts: &[&str], last: &str) -> Result<String, String> {
    crate::common::run_in_netns(
        scripts,
        |i, path| {
            if scripts[i].is_empty() {
                return String::new();
            }
            format!(
                "echo 'step {i} check' >&2; nft -c -f '{path}'\n\
                 echo 'step {i} apply' >&2; nft -f '{path}'\n"
            )
        },
        &format!("echo 'last' >&2; {last}"),
    )
}

/// `nft list table` output made independent of history: top-level sets, maps and chains
/// sorted by name (the kernel lists them in creation order) and the elements of every set
/// and map sorted, one per line (the kernel lists them in hash order). Rule order inside a
/// chain is kept: it matters.
pub fn normalize_listing(listing: &str) -> String {
    let mut preamble = Vec::new();
    let mut blocks: Vec<String> = Vec::new();
    let mut lines = listing.lines();
    while let Some(line) = lines.next() {
        let is_block =
            line.starts_with('\t') && !line.starts_with("\t\t") && line.trim_end().ends_with('{');
        if !is_block {
            if !line.trim().is_empty() {
                preamble.push(line.trim_end().to_owned());
            }
            continue;
        }
        let mut block = vec![line.trim_end().to_owned()];
        for inner in lines.by_ref() {
            block.push(inner.trim_end().to_owned());
            if inner.trim_end() == "\t}" {
                break;
            }
        }
        blocks.push(normalize_elements(&block));
    }
    blocks.sort();
    let mut out = preamble.join("\n");
    out.push('\n');
    for block in blocks {
        out.push_str(&block);
    }
    out
}

/// One block with its `elements = { ... }` (possibly spanning lines) sorted.
fn normalize_elements(block: &[String]) -> String {
    let mut out = String::new();
    let mut lines = block.iter();
    while let Some(line) = lines.next() {
        let Some(first) = line.trim_start().strip_prefix("elements = {") else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let mut text = first.to_owned();
        while !block_closed(&text) {
            match lines.next() {
                Some(more) => {
                    text.push(' ');
                    text.push_str(more.trim());
                }
                None => break,
            }
        }
        let body = text.trim_end().trim_end_matches('}');
        let mut elements = split_outside_quotes(body);
        elements.sort();
        out.push_str("\t\telements = {\n");
        for element in elements {
            out.push_str(&format!("\t\t\t{element}\n"));
        }
        out.push_str("\t\t}\n");
    }
    out
}

fn block_closed(text: &str) -> bool {
    let mut depth = 1i32;
    let mut quoted = false;
    for c in text.chars() {
        match c {
            '"' => quoted = !quoted,
            '{' if !quoted => depth += 1,
            '}' if !quoted => depth -= 1,
            _ => {}
        }
    }
    depth <= 0
}

fn split_outside_quotes(text: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    let mut depth = 0i32;
    for c in text.chars() {
        match c {
            '"' => quoted = !quoted,
            '{' if !quoted => depth += 1,
            '}' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => {
                parts.push(current.trim().to_owned());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    if !current.trim().is_empty() {
        parts.push(current.trim().to_owned());
    }
    parts
}
