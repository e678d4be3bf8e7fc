//! Random services (hostile names included) rendered as a full sync, then changed and
//! rendered as a partial sync, then cleaned up; every script is checked with `nft -c -f` and
//! applied for real in one throwaway network namespace, and the resulting table must equal
//! what a fresh full render of the new state produces (`nft list table`, normalised).
//!
//! Without root or `nft` the kernel half is skipped with a printed reason (a failure when
//! `CI` is set) and only the pure checks run.

use crate::common;
use crate::nft_common;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use common::{endpoint, state};
use ipnet::IpNet;
use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort};
use kp_core::testutil::service_port;
use kp_core::tracker::ProxyState;
use kp_rules::nftables::{LocalDetector, NftState, NodePortAddresses, RenderConfig};
use nft_common::*;
use proptest::prelude::*;
use proptest::test_runner::Config;

/// Each case execs `nft` a dozen times in two namespaces; keep the count modest.
const CASES: u32 = 24;

fn other(family: IpFamily) -> IpFamily {
    match family {
        IpFamily::V4 => IpFamily::V6,
        IpFamily::V6 => IpFamily::V4,
    }
}

/// Address `host` of a small pool per purpose, so that services collide now and then.
fn pool_ip(family: IpFamily, pool: u8, host: u8) -> IpAddr {
    match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::new(10, 180, pool, host)),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::new(
            0xfd00,
            0x10,
            0,
            0,
            0,
            0,
            u16::from(pool),
            u16::from(host),
        )),
    }
}

fn pool(family: IpFamily, pool: u8) -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        4 => (1u8..5).prop_map(move |h| pool_ip(family, pool, h)),
        1 => (1u8..5).prop_map(move |h| pool_ip(other(family), pool, h)),
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => "[a-z][a-z0-9-]{0,8}",
        1 => Just("a\" ; flush ruleset".to_owned()),
        1 => Just("x\n} ; add table ip evil".to_owned()),
        1 => "\\PC{0,12}",
    ]
}

fn cidr(family: IpFamily) -> impl Strategy<Value = IpNet> {
    let one = move |family: IpFamily| {
        (any::<u128>(), 0u8..=128).prop_map(move |(bits, len)| match family {
            IpFamily::V4 => IpNet::V4(
                ipnet::Ipv4Net::new(Ipv4Addr::from(bits as u32), len % 33).expect("len <= 32"),
            ),
            IpFamily::V6 => {
                IpNet::V6(ipnet::Ipv6Net::new(Ipv6Addr::from(bits), len).expect("len <= 128"))
            }
        })
    };
    prop_oneof![
        3 => one(family),
        1 => one(other(family)),
        // Contains the node's address: the LB IPs become allowed sources.
        1 => Just(match family {
            IpFamily::V4 => "192.168.0.0/16".parse().expect("literal"),
            IpFamily::V6 => "2001:db8::/32".parse().expect("literal"),
        }),
    ]
}

fn endpoints(family: IpFamily) -> impl Strategy<Value = Vec<Endpoint>> {
    proptest::collection::vec(
        (
            pool(family, 0),
            prop_oneof![Just(80u16), Just(8080), 1u16..=u16::MAX],
            any::<[bool; 4]>(),
        )
            .prop_map(
                |(ip, port, [ready, serving, terminating, local])| Endpoint {
                    ready,
                    serving: serving || ready,
                    terminating,
                    ..endpoint(&ip.to_string(), port, local)
                },
            ),
        0..4,
    )
}

/// One service port; `index` makes its ClusterIP unique.
fn service(family: IpFamily, index: u8) -> impl Strategy<Value = ServicePort> {
    let cluster = move |family: IpFamily| match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::new(172, 30, 0, index)),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::new(
            0xfd00,
            0x10,
            0x96,
            0,
            0,
            0,
            0,
            u16::from(index),
        )),
    };
    (
        (
            name(),
            name(),
            "[a-z0-9]{0,3}",
            0u8..3,
            prop_oneof![Just(80u16), 1u16..=u16::MAX],
        ),
        (
            prop_oneof![
                6 => Just(vec![cluster(family)]),
                1 => Just(vec![cluster(family), cluster(other(family))]),
                1 => Just(vec![cluster(other(family))]),
            ],
            proptest::option::of(30000u16..30006),
            proptest::collection::vec(pool(family, 99), 0..3),
            proptest::collection::vec(pool(family, 200), 0..3),
            proptest::collection::vec(cidr(family), 0..3),
        ),
        (proptest::option::of(0u64..100_000), any::<[bool; 2]>()),
    )
        .prop_map(
            move |(
                (namespace, name, port, protocol, number),
                (cluster_ips, node_port, external_ips, load_balancer_ips, ranges),
                (affinity, locals),
            )| {
                let protocol =
                    [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][usize::from(protocol)];
                let exposure = (node_port, external_ips, load_balancer_ips, ranges);
                let names = (namespace, name, port, protocol);
                service_port(
                    names,
                    cluster_ips,
                    number,
                    exposure,
                    (affinity, locals, None),
                )
            },
        )
}

type Item = (ServicePort, Vec<Endpoint>);

/// What happens to one service slot between the two states.
#[derive(Clone, Copy, Debug)]
enum Change {
    Unchanged,
    Deleted,
    Added,
    NewEndpoints,
    Replaced,
}

/// The services before and after.
fn scenario(family: IpFamily) -> impl Strategy<Value = (Vec<Item>, Vec<Item>)> {
    let slot = move |index: u8| {
        (
            service(family, index),
            endpoints(family),
            service(family, index),
            endpoints(family),
            prop_oneof![
                Just(Change::Unchanged),
                Just(Change::Deleted),
                Just(Change::Added),
                Just(Change::NewEndpoints),
                Just(Change::Replaced),
            ],
        )
            .prop_map(|(a, eps_a, b, eps_b, change)| match change {
                Change::Unchanged => (Some((a.clone(), eps_a.clone())), Some((a, eps_a))),
                Change::Deleted => (Some((a, eps_a)), None),
                Change::Added => (None, Some((b, eps_b))),
                Change::NewEndpoints => (Some((a.clone(), eps_a)), Some((a, eps_b))),
                Change::Replaced => (Some((a, eps_a)), Some((b, eps_b))),
            })
    };
    (0u8..6)
        .prop_flat_map(move |n| (1..=n).map(slot).collect::<Vec<_>>())
        .prop_map(|slots| {
            let (before, after): (Vec<_>, Vec<_>) = slots.into_iter().unzip();
            (
                before.into_iter().flatten().collect(),
                after.into_iter().flatten().collect(),
            )
        })
}

fn config(family: IpFamily) -> impl Strategy<Value = RenderConfig> {
    let node_ip = match family {
        IpFamily::V4 => "192.168.0.2",
        IpFamily::V6 => "2001:db8::1",
    };
    (
        prop_oneof![
            Just(LocalDetector::None),
            Just(LocalDetector::Cidrs(vec![
                "10.0.0.0/8".parse().expect("literal"),
                "fd00:10::/64".parse().expect("literal"),
            ])),
            Just(LocalDetector::BridgeInterface("cbr0".into())),
            Just(LocalDetector::InterfaceNamePrefix("veth".into())),
        ],
        prop_oneof![
            Just(NodePortAddresses::All),
            Just(NodePortAddresses::Ips(vec![
                node_ip.parse().expect("literal"),
                "127.0.0.1".parse().expect("literal"),
                "::1".parse().expect("literal"),
            ])),
            Just(NodePortAddresses::Ips(vec![])),
        ],
        any::<[bool; 2]>(),
    )
        .prop_map(
            |(local_detector, node_port_addresses, [masquerade_all, random_fully])| RenderConfig {
                local_detector,
                node_port_addresses,
                masquerade_all,
                random_fully,
                ..RenderConfig::default()
            },
        )
}

/// The services whose ports or endpoints differ: what the change tracker reports.
fn changed(before: &ProxyState, after: &ProxyState) -> BTreeSet<ServiceName> {
    let names: BTreeSet<&ServiceName> = before
        .services
        .keys()
        .chain(after.services.keys())
        .map(|n| &n.service)
        .collect();
    names
        .into_iter()
        .filter(|s| {
            before.service_ports(s).ne(after.service_ports(s))
                || before.service_endpoints(s).ne(after.service_endpoints(s))
        })
        .cloned()
        .collect()
}

fn check_case(family: IpFamily, before: Vec<Item>, after: Vec<Item>, config: &RenderConfig) {
    let before = state(before);
    let after = state(after);
    let changed = changed(&before, &after);

    let first = full(&before, family, config);
    check_structure(&first.script(), family);
    let first_state = first.state_after(&NftState::default());
    let second = partial(&after, family, config, &changed, &first_state, false);
    let second_state = second.state_after(&first_state);
    assert_eq!(second.kind, SyncKind::Partial);
    check_structure(&second.script(), family);
    let cleanup = partial(
        &after,
        family,
        config,
        &BTreeSet::new(),
        &second_state,
        true,
    );
    let cleanup_state = cleanup.state_after(&second_state);
    assert_eq!(
        cleanup.operations,
        cleanup.deleted_chains.len(),
        "{}",
        cleanup.script()
    );
    assert_eq!(cleanup.deleted_chains, second.flushed_stale);
    let fresh = full(&after, family, config);
    // The bookkeeping converges on what a fresh full sync produces.
    assert_eq!(cleanup_state, fresh.state_after(&NftState::default()));
    let again = partial(&after, family, config, &changed, &cleanup_state, true);
    assert_eq!(again.flushed_stale.len(), 0);

    if nft_unavailable().is_some() {
        return;
    }
    let incremental = apply_in_netns(
        family,
        &[&first.script(), &second.script(), &cleanup.script()],
    )
    .unwrap_or_else(|e| {
        panic!(
            "nft rejected the sequence: {e}\n--- full\n{}\n--- partial\n{}\n--- cleanup\n{}",
            first.script(),
            second.script(),
            cleanup.script()
        )
    });
    let expected = apply_in_netns(family, &[&fresh.script()])
        .unwrap_or_else(|e| panic!("nft rejected the fresh render: {e}\n{}", fresh.script()));
    assert_eq!(
        normalize_listing(&incremental),
        normalize_listing(&expected),
        "partial sync diverged\n--- partial\n{}",
        second.script()
    );
}

fn runner_config() -> Config {
    Config {
        cases: CASES,
        // Do not write regression files into the shared checkout; failures print the case.
        failure_persistence: None,
        max_shrink_iters: 200,
        ..Config::default()
    }
}

proptest! {
    #![proptest_config(runner_config())]

    #[test]
    fn ipv4_full_then_partial_matches_fresh_full(
        (before, after) in scenario(IpFamily::V4),
        config in config(IpFamily::V4),
    ) {
        check_case(IpFamily::V4, before, after, &config);
    }

    #[test]
    fn ipv6_full_then_partial_matches_fresh_full(
        (before, after) in scenario(IpFamily::V6),
        config in config(IpFamily::V6),
    ) {
        check_case(IpFamily::V6, before, after, &config);
    }
}

#[test]
fn kernel_prerequisites_or_reason() {
    match nft_unavailable() {
        Some(reason) => eprintln!("kernel checks skipped: {reason}"),
        None => eprintln!("kernel checks run"),
    }
}

/// The comparison above would be vacuous if normalisation erased differences.
#[test]
fn normalised_listings_still_differ_when_tables_differ() {
    if let Some(reason) = nft_unavailable() {
        eprintln!("skipping: {reason}");
        return;
    }
    let svc = common::cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80);
    let one = state(vec![(svc.clone(), vec![endpoint("10.180.0.1", 80, false)])]);
    let other = state(vec![(svc, vec![endpoint("10.180.0.2", 80, false)])]);
    let config = nft_config();
    let a = apply_in_netns(IpFamily::V4, &[&full(&one, IpFamily::V4, &config).script()])
        .expect("applies");
    let b = apply_in_netns(
        IpFamily::V4,
        &[&full(&other, IpFamily::V4, &config).script()],
    )
    .expect("applies");
    assert_ne!(normalize_listing(&a), normalize_listing(&b));
    assert!(normalize_listing(&a).contains("\t\telements = {\n\t\t\t172.30.0.41\n"));
}
