//! Userspace mode's capture rules: snapshots of representative layouts, each applied in a
//! throwaway network namespace (with the jumps from the built-in chains), partial renders
//! that rewrite only changed ports and delete stale chains, and hostile names that stay
//! inside comments.

use crate::common;

use std::collections::BTreeSet;

use common::{apply_in_netns, ip, net, netns_unavailable, port_name, restore_tool};
use kp_core::model::{IpFamily, Protocol, ServicePortName};
use kp_rules::iptables::NodePortAddresses;
use kp_rules::userspace::{
    CaptureChains, CaptureConfig, CaptureRender, CapturedPort, SERVICE_CHAIN_PREFIXES, Target,
    jumps, render,
};

fn port(ns: &str, name: &str, cluster_ip: &str, number: u16, relay: u16) -> CapturedPort {
    CapturedPort {
        name: port_name(ns, name, "p", Protocol::Tcp),
        port: number,
        cluster_ip: ip(cluster_ip),
        external_ips: Vec::new(),
        load_balancer_ips: Vec::new(),
        source_ranges: Vec::new(),
        node_port: None,
        internal: Target::Redirect(relay),
        external: Target::Redirect(relay + 1),
        local_source_internal: false,
        allow_from_node: false,
    }
}

/// The jumps as restore input, as the backend ensures them.
fn jumps_text() -> String {
    let mut text = String::new();
    for table in ["filter", "nat"] {
        text.push_str(&format!("*{table}\n"));
        for jump in jumps().iter().filter(|j| j.table.as_str() == table) {
            text.push_str(&format!("-I {} 1 {}\n", jump.from, jump.spec));
        }
        text.push_str("COMMIT\n");
    }
    text
}

/// Applies `renders` in order (after the render's own chains exist, the jumps) in a fresh
/// namespace and returns the final save.
fn apply(family: IpFamily, renders: &[&CaptureRender]) -> Option<String> {
    let tool = restore_tool(family);
    if let Some(reason) = netns_unavailable(tool) {
        eprintln!("skipping kernel check: {reason}");
        return None;
    }
    let jumps = jumps_text();
    let mut inputs: Vec<&str> = vec![&renders[0].text, &jumps];
    inputs.extend(renders[1..].iter().map(|r| r.text.as_str()));
    match apply_in_netns(tool, &inputs) {
        Ok(save) => Some(save),
        Err(e) => panic!(
            "{tool} rejected the rules:\n{e}\n{}",
            renders
                .iter()
                .map(|r| r.text.as_str())
                .collect::<Vec<_>>()
                .join("\n---\n")
        ),
    }
}

fn full(family: IpFamily, ports: &[CapturedPort], config: &CaptureConfig) -> CaptureRender {
    render(family, ports, config, None, None, &BTreeSet::new())
}

#[test]
fn every_kind_of_destination() {
    let plain = port("ns1", "web", "172.30.0.41", 80, 40001);
    let mut np = port("ns2", "np", "172.30.0.42", 80, 40003);
    np.node_port = Some(30080);
    np.external_ips = vec![ip("192.168.99.22")];
    let mut lb = port("ns3", "lb", "172.30.0.43", 443, 40005);
    lb.node_port = Some(30443);
    lb.load_balancer_ips = vec![ip("1.2.3.4")];
    lb.source_ranges = vec![net("203.0.113.0/25"), net("198.51.100.0/24")];
    let mut udp = port("ns4", "dns", "172.30.0.44", 53, 40007);
    udp.name.protocol = Protocol::Udp;
    let mut empty = port("ns5", "empty", "172.30.0.45", 80, 40009);
    empty.internal = Target::Reject;
    empty.external = Target::Reject;
    empty.node_port = Some(30090);
    let mut local = port("ns6", "local", "172.30.0.46", 80, 40011);
    local.load_balancer_ips = vec![ip("5.6.7.8")];
    local.node_port = Some(30091);
    local.external = Target::Drop;
    let ports = [plain, np, lb, udp, empty, local];
    let out = full(IpFamily::V4, &ports, &CaptureConfig::default());
    insta::assert_snapshot!("userspace_every_destination", out.text);
    // Every ClusterIP chain, the external chains of the two ports that redirect external
    // traffic (those without endpoints, or without local ones, have rules only in filter),
    // and one firewall chain.
    assert_eq!(out.chains.len(), 6 + 2 + 1, "{:?}", out.chains);
    if let Some(save) = apply(IpFamily::V4, &[&out]) {
        assert!(save.contains("-j REDIRECT --to-ports 40001"), "{save}");
        assert!(save.contains("-A PREROUTING"), "{save}");
    }
}

#[test]
fn restricted_node_port_addresses_and_no_localhost() {
    let mut np = port("ns", "np", "172.30.0.42", 80, 40003);
    np.node_port = Some(30080);
    let mut ports = vec![np];
    let restricted = CaptureConfig {
        node_port_addresses: NodePortAddresses::Ips(vec![ip("192.168.0.2"), ip("fd00::2")]),
        ..CaptureConfig::default()
    };
    let out = full(IpFamily::V4, &ports, &restricted);
    insta::assert_snapshot!("userspace_restricted_node_ports", out.text);
    assert!(
        !out.text.contains("fd00::2"),
        "other family's addresses are ignored"
    );
    let no_localhost = CaptureConfig {
        localhost_node_ports: false,
        ..CaptureConfig::default()
    };
    let out = full(IpFamily::V4, &ports, &no_localhost);
    assert!(
        out.text
            .contains("--dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-USERSPACE-NODEPORTS")
    );
    apply(IpFamily::V4, &[&out]);

    ports[0].cluster_ip = ip("fd00:30::42");
    let out = full(IpFamily::V6, &ports, &no_localhost);
    assert!(out.text.contains("-d fd00:30::42/128"), "{}", out.text);
    assert!(
        !out.text.contains("127.0.0.0/8"),
        "no IPv4 loopback in IPv6 rules"
    );
    apply(IpFamily::V6, &[&out]);
}

#[test]
fn partial_renders_rewrite_changed_ports_and_delete_stale_chains() {
    let a = port("ns", "a", "172.30.0.1", 80, 40001);
    let b = port("ns", "b", "172.30.0.2", 80, 40003);
    let mut c = port("ns", "c", "172.30.0.3", 80, 40005);
    c.node_port = Some(30001);
    let config = CaptureConfig::default();
    let first = full(IpFamily::V4, &[a.clone(), b.clone(), c.clone()], &config);

    // `b` gets a new relay port, `c` is deleted, `a` is untouched.
    let mut b2 = b.clone();
    b2.internal = Target::Redirect(41000);
    let changed: BTreeSet<ServicePortName> = [b.name.clone(), c.name.clone()].into();
    let second = render(
        IpFamily::V4,
        &[a.clone(), b2],
        &config,
        None,
        Some(&changed),
        &first.chains,
    );
    let chains_a = CaptureChains::new(&a.name);
    let chains_b = CaptureChains::new(&b.name);
    let chains_c = CaptureChains::new(&c.name);
    assert!(
        !second.text.contains(&format!(":{}", chains_a.internal)),
        "a is not rewritten"
    );
    assert!(second.text.contains(&format!(":{}", chains_b.internal)));
    assert!(second.text.contains(&format!("-X {}", chains_c.internal)));
    assert!(second.text.contains(&format!("-X {}", chains_c.external)));
    assert!(!second.chains.contains(&chains_c.internal));
    insta::assert_snapshot!("userspace_partial", second.text);
    if let Some(save) = apply(IpFamily::V4, &[&first, &second]) {
        assert!(
            save.contains("--to-ports 40001"),
            "a keeps its rule: {save}"
        );
        assert!(
            save.contains("--to-ports 41000"),
            "b has its new port: {save}"
        );
        assert!(!save.contains("--to-ports 40005"), "c is gone: {save}");
        assert!(
            !save.contains(&chains_c.internal),
            "c's chains are gone: {save}"
        );
    }
}

/// With a relay address the redirects are DNATs to it; the node's own traffic to external
/// destinations of an eTP Local port goes to the ClusterIP's frontend, also when the port
/// has no local endpoints (the rest is still dropped); a node inside the source ranges
/// admits the LB IPs as sources.
#[test]
fn relay_address_node_traffic_and_allow_from_node() {
    let mut local = port("ns", "local", "172.30.0.51", 80, 40001);
    local.external_ips = vec![ip("192.168.99.51")];
    local.load_balancer_ips = vec![ip("1.2.3.51")];
    local.source_ranges = vec![net("192.168.0.0/24")];
    local.node_port = Some(30051);
    local.external = Target::Drop;
    local.local_source_internal = true;
    local.allow_from_node = true;
    let mut v6 = port("ns", "six", "fd00:96::52", 80, 40003);
    v6.load_balancer_ips = vec![ip("2001:db8:100::52")];
    v6.source_ranges = vec![net("2001:db8:1::/64")];
    v6.local_source_internal = true;
    let config = CaptureConfig::default();
    let out = render(
        IpFamily::V4,
        std::slice::from_ref(&local),
        &config,
        Some(ip("192.168.0.2")),
        None,
        &BTreeSet::new(),
    );
    insta::assert_snapshot!("userspace_relay_address_node_traffic", out.text);
    let chains = CaptureChains::new(&local.name);
    for expected in [
        "-j DNAT --to-destination 192.168.0.2:40001".to_owned(),
        format!("-m addrtype --src-type LOCAL -j {}", chains.internal),
        format!("-s 1.2.3.51/32 -j {}", chains.external),
        format!("-s 192.168.0.0/24 -j {}", chains.external),
    ] {
        assert!(out.text.contains(&expected), "{expected}:\n{}", out.text);
    }
    // No local endpoints: only the shortcut in the external chain, the rest dropped.
    assert!(!out.text.contains("40002"), "{}", out.text);
    assert!(
        out.text
            .contains("-d 192.168.99.51/32 -p tcp -m tcp --dport 80 -j DROP"),
        "{}",
        out.text
    );
    let six = render(
        IpFamily::V6,
        std::slice::from_ref(&v6),
        &config,
        Some(ip("fd00:50::2")),
        None,
        &BTreeSet::new(),
    );
    assert!(
        six.text
            .contains("-j DNAT --to-destination [fd00:50::2]:40004"),
        "{}",
        six.text
    );
    assert!(
        !six.text.contains("-s 2001:db8:100::52"),
        "no node IP in the ranges: {}",
        six.text
    );
    if let Some(save) = apply(IpFamily::V4, &[&out]) {
        assert!(
            save.contains("--to-destination 192.168.0.2:40001"),
            "{save}"
        );
    }
    if let Some(save) = apply(IpFamily::V6, &[&six]) {
        assert!(
            save.contains("--to-destination [fd00:50::2]:40004"),
            "{save}"
        );
    }
}

const HOSTILE: [&str; 6] = [
    "a\" -j ACCEPT #",
    "x\n-A INPUT -j DROP\n",
    "y\r\nCOMMIT",
    "'; `rm` \\",
    "名前",
    "%22%0A",
];

#[test]
fn hostile_names_stay_inside_comments() {
    let benign = port("ns", "svc", "172.30.0.9", 80, 40001);
    let benign_text = full(
        IpFamily::V4,
        std::slice::from_ref(&benign),
        &CaptureConfig::default(),
    )
    .text;
    let shape = |text: &str| -> Vec<String> {
        // Everything but the comments and the chain hash.
        text.lines()
            .map(|l| {
                let mut out = String::new();
                let mut rest = l;
                while let Some(at) = rest.find("--comment \"") {
                    out.push_str(&rest[..at]);
                    let after = &rest[at + 11..];
                    let end = after.find('"').expect("closing quote");
                    rest = &after[end + 1..];
                }
                out.push_str(rest);
                out.split_whitespace()
                    .map(|w| {
                        let name = w.trim_start_matches(':');
                        if SERVICE_CHAIN_PREFIXES.iter().any(|p| name.starts_with(p)) {
                            "KUBE-US*"
                        } else {
                            w
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    };
    let mut renders = Vec::new();
    for (i, hostile) in HOSTILE.iter().enumerate() {
        let mut p = benign.clone();
        p.name = port_name(hostile, hostile, hostile, Protocol::Tcp);
        let out = full(IpFamily::V4, &[p], &CaptureConfig::default());
        assert_eq!(
            shape(&out.text),
            shape(&benign_text),
            "hostile name {i} changed the rules:\n{}",
            out.text
        );
        renders.push(out);
    }
    let all: Vec<&CaptureRender> = renders.iter().collect();
    if let Some(save) = apply(IpFamily::V4, &all) {
        assert!(
            !save.lines().any(|l| l.trim() == "-A INPUT -j DROP"),
            "a name added a rule: {save}"
        );
    }
}
