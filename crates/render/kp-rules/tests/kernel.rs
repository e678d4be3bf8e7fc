//! Random services and endpoints, rendered and fed to the real `iptables-restore` /
//! `ip6tables-restore` inside a throwaway network namespace; plus hostile names.
//!
//! Without root or the binaries the kernel half is skipped (with a printed reason) and only
//! the structural checks run.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use common::*;
use ipnet::IpNet;
use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort};
use kp_core::tracker::ProxyState;
use kp_rules::iptables::{
    LocalDetector, NodePortAddresses, RenderConfig, RenderOutput, SyncScope, render, setup,
};
use proptest::prelude::*;

/// Each case execs the restore tool several times; keep the count modest.
const CASES: u32 = 32;

/// Chains every render declares itself.
const TOP_LEVEL: [&str; 9] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    "KUBE-FIREWALL",
    "KUBE-PROXY-CANARY",
];

/// Checks that hold without a kernel: only known line kinds, quotes only as comment
/// delimiters, and every kube chain jumped to is declared here or already in place.
fn check_structure(out: &RenderOutput, existing: &BTreeSet<String>) {
    let declared: BTreeSet<&str> = out
        .text
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split(' ').next())
        .collect();
    for line in out.text.lines() {
        assert!(
            ["*filter", "*nat", "COMMIT"].contains(&line)
                || line.starts_with(':')
                || line.starts_with("-A ")
                || line.starts_with("-X "),
            "unexpected line {line:?}"
        );
        let quotes = line.matches('"').count();
        assert!(quotes == 0 || quotes == 2, "unbalanced quotes in {line:?}");
        if quotes == 2 {
            assert!(
                line.contains(" --comment \""),
                "quote outside a comment: {line:?}"
            );
        }
        // Strip the comment, then every `-j`/target must be a kube chain we know of.
        let bare = match line.split_once(" --comment \"") {
            Some((head, tail)) => {
                let rest = tail.split_once('"').map(|(_, r)| r).unwrap_or("");
                format!("{head}{rest}")
            }
            None => line.to_owned(),
        };
        assert!(bare.matches(" -j ").count() <= 1, "two targets in {line:?}");
        if let Some((_, target)) = bare.split_once(" -j ") {
            let target = target.split(' ').next().unwrap_or_default();
            if target.starts_with("KUBE-") {
                assert!(
                    declared.contains(target)
                        || TOP_LEVEL.contains(&target)
                        || (existing.contains(target) && out.chains.contains(target)),
                    "jump to undeclared {target} in {line:?}"
                );
            }
        }
    }
}

fn family_ip(family: IpFamily, net: u8, host: u16) -> IpAddr {
    match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::new(10, 180, net, host as u8)),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::new(
            0xfd00,
            0x10,
            0,
            0,
            0,
            0,
            u16::from(net),
            host,
        )),
    }
}

fn other(family: IpFamily) -> IpFamily {
    match family {
        IpFamily::V4 => IpFamily::V6,
        IpFamily::V6 => IpFamily::V4,
    }
}

/// Names: mostly valid, sometimes hostile (quotes, newlines, backslashes, any Unicode).
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z][a-z0-9-]{0,12}",
        1 => Just("a\" -j ACCEPT".to_owned()),
        1 => Just("x\n-A INPUT -j ACCEPT\n".to_owned()),
        1 => "\\PC{0,40}",
        1 => any::<String>(),
    ]
}

fn protocol() -> impl Strategy<Value = Protocol> {
    prop_oneof![
        Just(Protocol::Tcp),
        Just(Protocol::Udp),
        Just(Protocol::Sctp)
    ]
}

fn endpoint_strategy(family: IpFamily) -> impl Strategy<Value = Endpoint> {
    (0u8..3, 1u16..250, 1u16..=u16::MAX, any::<[bool; 4]>()).prop_map(
        move |(net, host, port, [ready, serving, terminating, local])| Endpoint {
            ip: family_ip(family, net, host),
            port,
            ready,
            serving: serving || ready,
            terminating,
            node_name: Some(if local { NODE } else { "other-node" }.into()),
            zone: None,
            zone_hints: None,
            node_hints: None,
            is_local: local,
        },
    )
}

fn cidr(family: IpFamily) -> impl Strategy<Value = IpNet> {
    (any::<u128>(), 0u8..=128).prop_map(move |(bits, len)| match family {
        IpFamily::V4 => IpNet::V4(
            ipnet::Ipv4Net::new(Ipv4Addr::from(bits as u32), len % 33).expect("len <= 32"),
        ),
        IpFamily::V6 => {
            IpNet::V6(ipnet::Ipv6Net::new(Ipv6Addr::from(bits), len).expect("len <= 128"))
        }
    })
}

fn public_ip(family: IpFamily) -> impl Strategy<Value = IpAddr> {
    any::<u128>().prop_map(move |bits| match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::from(bits as u32)),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::from(bits)),
    })
}

type Generated = (ServicePort, Vec<Endpoint>);

fn service(family: IpFamily, index: u16) -> impl Strategy<Value = Generated> {
    let ips = proptest::collection::vec(
        prop_oneof![3 => public_ip(family), 1 => public_ip(other(family))],
        0..3,
    );
    (
        (name(), name(), "[a-z0-9]{0,6}", protocol(), 1u16..=u16::MAX),
        (
            proptest::option::of(30000u16..32768),
            ips.clone(),
            ips,
            proptest::collection::vec(cidr(family), 0..3),
        ),
        (
            proptest::option::of(0u64..100_000),
            any::<[bool; 2]>(),
            proptest::option::of(30000u16..32768),
        ),
        proptest::collection::vec(endpoint_strategy(family), 0..6),
    )
        .prop_map(
            move |((ns, name, port_name, protocol, port), exposure, policies, endpoints)| {
                let cluster_ip = match family {
                    IpFamily::V4 => {
                        IpAddr::V4(Ipv4Addr::new(172, 30, (index >> 8) as u8, index as u8))
                    }
                    IpFamily::V6 => {
                        IpAddr::V6(Ipv6Addr::new(0xfd00, 0x172, 0x30, 0, 0, 0, 0, index))
                    }
                };
                let names = (ns, name, port_name, protocol);
                let svc = kp_core::testutil::service_port(
                    names,
                    vec![cluster_ip],
                    port,
                    exposure,
                    policies,
                );
                (svc, endpoints)
            },
        )
}

fn services(family: IpFamily) -> impl Strategy<Value = Vec<Generated>> {
    (0usize..6).prop_flat_map(move |n| {
        (0..n)
            .map(|i| service(family, i as u16 + 1))
            .collect::<Vec<_>>()
    })
}

fn render_config(family: IpFamily) -> impl Strategy<Value = RenderConfig> {
    let detector = prop_oneof![
        Just(LocalDetector::None),
        Just(LocalDetector::Cidrs(vec![
            net("10.0.0.0/8"),
            net("fd00:10::/64")
        ])),
        Just(LocalDetector::BridgeInterface("cbr0".into())),
        Just(LocalDetector::InterfaceNamePrefix("veth".into())),
    ];
    let node_ports = prop_oneof![
        Just(NodePortAddresses::All),
        proptest::collection::vec(
            prop_oneof![
                Just(ip("192.168.0.2")),
                Just(ip("127.0.0.1")),
                Just(ip("2001:db8::1")),
                Just(ip("::1")),
                public_ip(family)
            ],
            0..4
        )
        .prop_map(NodePortAddresses::Ips),
    ];
    (
        0u8..32,
        any::<[bool; 4]>(),
        detector,
        node_ports,
        prop_oneof![Just(0usize), Just(1000)],
    )
        .prop_map(
            |(
                bit,
                [all, localhost, invalid, random],
                local_detector,
                node_port_addresses,
                large,
            )| {
                RenderConfig {
                    masquerade_bit: bit,
                    masquerade_all: all,
                    local_detector,
                    node_port_addresses,
                    node_ips: Vec::new(),
                    localhost_node_ports: localhost,
                    nftables_localhost_rejects: Default::default(),
                    drop_invalid: invalid,
                    random_fully: random,
                    large_cluster_threshold: large,
                }
            },
        )
}

fn to_state(items: &[Generated]) -> ProxyState {
    state(items.to_vec())
}

/// The next state: some services dropped, some with an endpoint fewer; and which Services
/// changed (keyed by Service, so sibling ports of a changed port are rewritten too).
fn evolve(items: &[Generated], mask: &[u8]) -> (Vec<Generated>, BTreeSet<ServiceName>) {
    let mut next = Vec::new();
    let mut changed = BTreeSet::new();
    for (i, (svc, eps)) in items.iter().enumerate() {
        match mask.get(i).copied().unwrap_or(0) % 3 {
            0 => next.push((svc.clone(), eps.clone())),
            1 => {
                changed.insert(svc.name.service.clone());
            }
            _ => {
                changed.insert(svc.name.service.clone());
                let fewer: Vec<Endpoint> = eps.iter().skip(1).cloned().collect();
                next.push((svc.clone(), fewer));
            }
        }
    }
    (next, changed)
}

fn run_case(family: IpFamily, config: &RenderConfig, items: &[Generated], mask: &[u8]) {
    let first_state = to_state(items);
    let first = full(&first_state, family, config);
    check_structure(&first, &BTreeSet::new());

    let (next_items, changed) = evolve(items, mask);
    let next_state = to_state(&next_items);
    let second = render(
        &next_state,
        family,
        config,
        &SyncScope {
            kind: SyncKind::Partial,
            changed: &changed,
            existing_chains: &first.chains,
        },
    )
    .expect("generated configs are valid");
    check_structure(&second, &first.chains);
    let reference = full(&next_state, family, config);
    assert_eq!(second.chains, reference.chains);
    assert_eq!(second.nat_rules, reference.nat_rules);

    let tool = restore_tool(family);
    if netns_unavailable(tool).is_some() {
        return;
    }
    let setup = setup_text(&setup(family, config));
    let incremental =
        apply_in_netns(tool, &[&setup, &first.text, &second.text]).unwrap_or_else(|e| {
            panic!(
                "{tool} failed: {e}\n--- full\n{}\n--- partial\n{}",
                first.text, second.text
            )
        });
    let direct = apply_in_netns(tool, &[&setup, &reference.text])
        .unwrap_or_else(|e| panic!("{tool} failed: {e}\n{}", reference.text));
    assert_eq!(ruleset(&incremental), ruleset(&direct));
}

fn report_skip(family: IpFamily) {
    if let Some(reason) = netns_unavailable(restore_tool(family)) {
        eprintln!("kernel checks skipped, structural checks only: {reason}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn random_ipv4_rulesets_are_accepted_by_the_kernel(
        config in render_config(IpFamily::V4),
        items in services(IpFamily::V4),
        mask in proptest::collection::vec(any::<u8>(), 6),
    ) {
        run_case(IpFamily::V4, &config, &items, &mask);
    }

    #[test]
    fn random_ipv6_rulesets_are_accepted_by_the_kernel(
        config in render_config(IpFamily::V6),
        items in services(IpFamily::V6),
        mask in proptest::collection::vec(any::<u8>(), 6),
    ) {
        run_case(IpFamily::V6, &config, &items, &mask);
    }
}

#[test]
fn kernel_check_availability_is_reported() {
    report_skip(IpFamily::V4);
    report_skip(IpFamily::V6);
}

#[test]
fn harness_rejects_what_the_kernel_rejects() {
    // Guards against a harness that passes everything: `--test` alone accepts a jump to a
    // missing chain; the real apply in the namespace must not.
    let tool = restore_tool(IpFamily::V4);
    if let Some(reason) = netns_unavailable(tool) {
        eprintln!("skipping: {reason}");
        return;
    }
    let bad = "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j KUBE-SVC-MISSING\nCOMMIT\n";
    assert!(apply_in_netns(tool, &[bad]).is_err());
    let bad_table = "*filter\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -m tcp -p tcp -j DNAT --to-destination 10.0.0.1:80\nCOMMIT\n";
    assert!(apply_in_netns(tool, &[bad_table]).is_err());
}

#[test]
fn hostile_names_only_ever_reach_comments() {
    let mut svc = cluster_ip(
        "a\" -j ACCEPT",
        "b\n-A INPUT -j ACCEPT",
        "p\\\"'`%",
        "172.30.0.9",
        80,
    );
    svc.node_port = Some(30080);
    let out = full(
        &state(vec![(svc, vec![endpoint("10.180.0.9", 80, false)])]),
        IpFamily::V4,
        &config(),
    );
    check_structure(&out, &BTreeSet::new());
    assert!(
        !out.text.lines().any(|l| l.starts_with("-A INPUT")),
        "{}",
        out.text
    );
    assert!(
        out.text.contains(
            "--comment \"a%22 -j ACCEPT/b%0A-A INPUT -j ACCEPT:p%5C%22%27%60%25 cluster IP\""
        ),
        "{}",
        out.text
    );

    let tool = restore_tool(IpFamily::V4);
    if let Some(reason) = netns_unavailable(tool) {
        eprintln!("skipping kernel check: {reason}");
        return;
    }
    let saved = apply_in_netns(tool, &[&out.text]).unwrap_or_else(|e| panic!("{e}\n{}", out.text));
    let rules = ruleset(&saved);
    // Exactly the rules we wrote, and no ACCEPT anywhere but KUBE-FORWARD's two.
    let total: usize = rules.values().map(Vec::len).sum();
    assert_eq!(total, out.rules_written, "{saved}");
    let accepts: BTreeMap<_, usize> = rules
        .iter()
        .map(|(k, v)| {
            (
                k.1.clone(),
                v.iter().filter(|r| r.ends_with("-j ACCEPT")).count(),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    assert_eq!(
        accepts,
        BTreeMap::from([("KUBE-FORWARD".to_owned(), 2)]),
        "{saved}"
    );
}
