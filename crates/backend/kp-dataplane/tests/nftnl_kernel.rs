//! The netlink runner ([`NetlinkNft`], `kp-nftnl`) against `nft -f -`, on a real kernel in
//! a throwaway network namespace (`kp_testbed::isolated`): the same syncs (full and partial) are run
//! once with each runner, the tables are removed in between, and `nft list ruleset` after
//! every sync must be identical. Plus: a statement the kernel rejects is reported by line
//! and text, and nothing of its transaction stays.
//!
//! Without root, `unshare` or `nft` the tests are skipped with a message, unless `CI` or
//! `KP_REQUIRE_KERNEL_TESTS=1` is set, which makes that a failure.

use crate::nft_tools;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ipnet::IpNet;
use kp_core::backend::{Backend, SyncKind};
use kp_core::model::{IpFamily, Protocol, ServiceName, SessionAffinity};
use kp_core::tracker::ProxyState;
use kp_dataplane::conntrack::FakeConntrack;
use kp_dataplane::exec::ExecError;
use kp_dataplane::nftables::{ExecNft, NetlinkNft, NftRunner, NftablesBackend, NftablesConfig};
use kp_dataplane::testutil::*;
use kp_nftnl::{ApplyError, NftSocket};
use kp_rules::nftables::cmd::{Command, Name, Rule, Verdict};
use kp_rules::nftables::{
    LocalDetector, LocalhostNodePortRejects, NodePortAddresses, RenderConfig, Transaction,
};
use kp_testbed::isolated;
use nft_tools::{nft, unavailable};
use prometheus_client::metrics::counter::Counter;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn in_netns(name: &str, body: impl FnOnce()) {
    isolated::run(name, unavailable, body);
}

/// Records every transaction's text, then hands it to the inner runner.
#[derive(Clone)]
struct Recording<R> {
    inner: R,
    scripts: Arc<Mutex<Vec<String>>>,
}

impl<R: NftRunner> NftRunner for Recording<R> {
    async fn apply(&self, transaction: &Transaction) -> Result<(), ExecError> {
        self.scripts
            .lock()
            .expect("not poisoned")
            .push(transaction.to_string());
        self.inner.apply(transaction).await
    }

    async fn list_table(&self, family: IpFamily) -> Result<Option<String>, ExecError> {
        self.inner.list_table(family).await
    }
}

/// The configurations the tests run with: every local-traffic detector, restricted
/// NodePort addresses, masqueradeAll, with and without fully random masquerading.
fn configs() -> Vec<NftablesConfig> {
    let cidrs = RenderConfig {
        local_detector: LocalDetector::Cidrs(vec![
            "10.244.0.0/16".parse().expect("cidr"),
            "fd00:10:244::/48".parse().expect("cidr"),
        ]),
        ..RenderConfig::default()
    };
    let prefix = RenderConfig {
        local_detector: LocalDetector::InterfaceNamePrefix("veth".into()),
        masquerade_all: true,
        masquerade_bit: 5,
        random_fully: false,
        node_port_addresses: NodePortAddresses::Ips(vec![
            ip("192.168.0.2"),
            ip("2001:db8::2"),
            ip("127.0.0.1"),
        ]),
        ..RenderConfig::default()
    };
    // With KEP-6032's localhost rejects: named counters, a counted `reject with tcp reset`.
    let bridge = RenderConfig {
        local_detector: LocalDetector::BridgeInterface("cbr0".into()),
        nftables_localhost_rejects: LocalhostNodePortRejects {
            enabled: true,
            served: vec![IpFamily::V6],
        },
        ..RenderConfig::default()
    };
    [cidrs, prefix, bridge]
        .into_iter()
        .map(|render| NftablesConfig::new(vec![IpFamily::V4, IpFamily::V6], render))
        .collect()
}

fn local(mut ep: kp_core::model::Endpoint) -> kp_core::model::Endpoint {
    ep.node_name = Some(NODE.into());
    ep.is_local = true;
    ep
}

/// The fixture states, in sync order, with the services each one changed.
fn steps() -> Vec<(ProxyState, BTreeSet<ServiceName>)> {
    let affinity = |mut svc: kp_core::model::ServicePort| {
        svc.session_affinity = Some(SessionAffinity {
            timeout: Duration::from_secs(10800),
        });
        svc
    };
    let node_port = |mut svc: kp_core::model::ServicePort, port: u16| {
        svc.node_port = Some(port);
        svc.external_ips = vec![ip("192.0.2.10")];
        svc.external_policy_local = true;
        svc
    };
    let lb = |mut svc: kp_core::model::ServicePort, ranges: &[&str]| {
        svc.load_balancer_ips = vec![ip("192.0.2.20")];
        svc.load_balancer_source_ranges = ranges
            .iter()
            .map(|r| r.parse::<IpNet>().expect("range"))
            .collect();
        svc
    };
    let hostile = "we\"ird\n;name";
    let first = state(vec![
        (
            affinity(service("ns", "aff", Protocol::Tcp, "10.96.0.1", 80)),
            vec![
                endpoint("10.244.1.1", 8080),
                endpoint("10.244.1.2", 8080),
                endpoint("10.244.1.3", 8080),
            ],
        ),
        (
            service(hostile, hostile, Protocol::Udp, "10.96.0.2", 53),
            vec![endpoint("10.244.1.4", 5353)],
        ),
        (
            node_port(service("ns", "np", Protocol::Tcp, "10.96.0.3", 80), 30080),
            vec![
                local(endpoint("10.244.0.5", 8080)),
                endpoint("10.244.1.5", 8080),
            ],
        ),
        (
            service("ns", "empty", Protocol::Sctp, "10.96.0.4", 9000),
            vec![],
        ),
        (
            affinity(service("ns", "v6", Protocol::Tcp, "fd00:96::1", 443)),
            vec![
                endpoint("fd00:10:244:1::1", 8443),
                endpoint("fd00:10:244:1::2", 8443),
            ],
        ),
        (
            node_port(service("ns", "np6", Protocol::Udp, "fd00:96::2", 53), 30053),
            vec![local(endpoint("fd00:10:244::7", 53))],
        ),
    ]);
    // Endpoints move, a service goes, one gets its first endpoint, another appears.
    let mut second = first.clone();
    let aff = port_name("ns", "aff", "p", Protocol::Tcp);
    second.endpoints.insert(
        aff.clone(),
        vec![endpoint("10.244.1.1", 8080), endpoint("10.244.2.9", 8080)],
    );
    let np = port_name("ns", "np", "p", Protocol::Tcp);
    second.services.remove(&np);
    second.endpoints.remove(&np);
    let empty = port_name("ns", "empty", "p", Protocol::Sctp);
    second
        .endpoints
        .insert(empty.clone(), vec![endpoint("10.244.3.1", 9000)]);
    let v6 = port_name("ns", "v6", "p", Protocol::Tcp);
    second
        .endpoints
        .insert(v6.clone(), vec![endpoint("fd00:10:244:1::3", 8443)]);
    let added = service("ns", "added", Protocol::Tcp, "10.96.0.9", 8080);
    second
        .endpoints
        .insert(added.name.clone(), vec![endpoint("10.244.4.1", 80)]);
    second.services.insert(added.name.clone(), added);
    let changed_second: BTreeSet<ServiceName> = [&aff, &np, &empty, &v6]
        .into_iter()
        .map(|p| p.service.clone())
        .chain([service_name("ns", "added")])
        .collect();
    // A load balancer with source ranges (its firewall rule has an anonymous set), and a
    // service with more endpoints than the renderer's numgen cascade takes (an anonymous
    // verdict map), then both gone again.
    let mut third = second.clone();
    let fw = lb(
        service("ns", "fw", Protocol::Tcp, "10.96.0.10", 443),
        &["203.0.113.0/24", "198.51.100.7/32"],
    );
    third
        .endpoints
        .insert(fw.name.clone(), vec![endpoint("10.244.5.1", 8443)]);
    third.services.insert(fw.name.clone(), fw);
    let big = service("ns", "big", Protocol::Tcp, "10.96.0.11", 80);
    third.endpoints.insert(
        big.name.clone(),
        (1..=40)
            .map(|i| endpoint(&format!("10.244.6.{i}"), 80))
            .collect(),
    );
    third.services.insert(big.name.clone(), big);
    let fw6 = lb(
        service("ns", "fw6", Protocol::Tcp, "fd00:96::3", 443),
        &["2001:db8::/64", "2001:db8:1::7/128"],
    );
    let mut fw6 = fw6;
    fw6.load_balancer_ips = vec![ip("2001:db8:2::20")];
    third
        .endpoints
        .insert(fw6.name.clone(), vec![endpoint("fd00:10:244:5::1", 8443)]);
    third.services.insert(fw6.name.clone(), fw6);
    let changed_fw = BTreeSet::from([
        service_name("ns", "fw"),
        service_name("ns", "big"),
        service_name("ns", "fw6"),
    ]);
    // ServiceCIDRs appear with the third step (the fixed part changes: a full sync with the
    // unallocated-ClusterIP drop) and go again with the fourth.
    third.service_cidrs = vec![
        "172.30.0.0/16".parse().expect("literal"),
        "10.96.0.0/12".parse().expect("literal"),
        "fd00:10:96::/112".parse().expect("literal"),
    ];
    let fourth = second.clone();
    vec![
        (first, BTreeSet::new()),
        (second.clone(), changed_second),
        // Nothing changed: only the deletion of stale chains.
        (second, BTreeSet::new()),
        (third, changed_fw.clone()),
        (fourth, changed_fw),
    ]
}

/// Run every step with `runner` from an empty ruleset; `nft list ruleset` after each.
async fn run_steps<R: NftRunner>(config: NftablesConfig, runner: R) -> Vec<String> {
    nft(&["flush", "ruleset"]);
    // Stale chains are deleted by the next sync, so the deletions are part of the test.
    let mut backend = NftablesBackend::with_parts(config, runner, FakeConntrack::default())
        .expect("valid config")
        .with_stale_chain_delay(Duration::ZERO);
    let mut listings = Vec::new();
    for (index, (state, changed)) in steps().iter().enumerate() {
        let kind = if index == 0 {
            SyncKind::Full
        } else {
            SyncKind::Partial
        };
        backend
            .sync(&request(state, kind, changed, false))
            .await
            .unwrap_or_else(|e| panic!("sync {index} failed: {e}"));
        listings.push(nft(&["list", "ruleset"]));
    }
    listings
}

#[test]
fn netlink_and_nft_build_identical_tables() {
    in_netns("netlink_and_nft_build_identical_tables", || {
        block_on(async {
            let fallbacks = Counter::default();
            let scripts = Arc::new(Mutex::new(Vec::new()));
            for (index, config) in configs().into_iter().enumerate() {
                let netlink = Recording {
                    inner: NetlinkNft::new(ExecNft::default(), fallbacks.clone()),
                    scripts: Arc::clone(&scripts),
                };
                let via_netlink = run_steps(config.clone(), netlink).await;
                let via_nft = run_steps(config, ExecNft::default()).await;
                for (step, (a, b)) in via_netlink.iter().zip(&via_nft).enumerate() {
                    assert_eq!(a, b, "config {index}, step {step}: netlink and nft differ");
                }
                assert!(via_netlink[0].contains("table ip kube-proxy"));
                assert!(via_netlink[0].contains("table ip6 kube-proxy"));
            }

            // Every transaction went over netlink: none fell back to nft.
            let scripts = scripts.lock().expect("not poisoned").clone();
            assert_eq!(
                scripts.len(),
                configs().len() * steps().len() * 2,
                "one transaction per family and step"
            );
            assert_eq!(fallbacks.get(), 0);
        });
    });
}

#[test]
fn a_rejected_statement_is_named_and_nothing_stays() {
    in_netns("a_rejected_statement_is_named_and_nothing_stays", || {
        let mut socket = NftSocket::open().expect("socket");
        let chain = |name: &'static str| Command::AddChain {
            chain: Name::Fixed(name),
            hook: None,
            comment: None,
        };
        let goto_kept = |from: &'static str| Command::AddRule {
            chain: Name::Fixed(from),
            rule: Rule::verdict(Vec::new(), Verdict::Goto(Name::Fixed("kept"))),
        };
        let apply = |socket: &mut NftSocket, commands: Vec<Command>| {
            socket.apply(&Transaction::new(IpFamily::V4, commands), usize::MAX)
        };
        apply(
            &mut socket,
            vec![Command::AddTable { comment: None }, chain("kept")],
        )
        .expect("first transaction");
        let commands = vec![
            chain("new-chain"),
            goto_kept("new-chain"),
            goto_kept("missing-chain"),
            chain("other"),
        ];
        let err = apply(&mut socket, commands).expect_err("rejected");
        match &err {
            ApplyError::Kernel {
                line, statement, ..
            } => {
                assert_eq!(line, &3);
                assert_eq!(statement, "add rule ip kube-proxy missing-chain goto kept");
            }
            other => panic!("unexpected error {other:?}"),
        }
        // ENOENT: no such chain.
        assert_eq!(err.errno(), Some(2));
        let table = nft(&["list", "table", "ip", "kube-proxy"]);
        assert!(table.contains("chain kept"), "{table}");
        assert!(!table.contains("new-chain"), "{table}");
        assert!(!table.contains("other"), "{table}");
        // The socket is still usable.
        apply(&mut socket, vec![chain("after")]).expect("next transaction");
        assert!(nft(&["list", "table", "ip", "kube-proxy"]).contains("chain after"));
    });
}

/// `nft list ruleset` with each table's chains, sets and maps in name order: a full sync
/// applied in steps creates the per-service chains before the fixed ones, which changes
/// only the order `nft list` prints them in.
fn by_name(listing: &str) -> String {
    let mut out = String::new();
    let mut blocks: Vec<String> = Vec::new();
    let mut current: Option<String> = None;
    for line in listing.lines() {
        let starts = ["\tchain ", "\tset ", "\tmap "]
            .iter()
            .any(|p| line.starts_with(p));
        if let Some(block) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
            if line == "\t}" {
                blocks.extend(current.take());
            }
        } else if starts {
            current = Some(format!("{line}\n"));
        } else {
            if line == "}" {
                blocks.sort();
                out.extend(blocks.drain(..));
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[test]
fn a_full_sync_in_steps_builds_the_same_tables() {
    in_netns("a_full_sync_in_steps_builds_the_same_tables", || {
        block_on(async {
            for (index, config) in configs().into_iter().enumerate() {
                let stepped = NetlinkNft::default().with_max_step(7);
                let via_steps = run_steps(config.clone(), stepped).await;
                let whole = NetlinkNft::default().with_max_step(usize::MAX);
                let via_one = run_steps(config, whole).await;
                for (step, (a, b)) in via_steps.iter().zip(&via_one).enumerate() {
                    assert_eq!(
                        by_name(a),
                        by_name(b),
                        "config {index}, step {step}: steps and one transaction differ"
                    );
                }
            }
        });
    });
}

#[test]
fn a_failed_step_leaves_nothing_the_next_sync_duplicates() {
    in_netns(
        "a_failed_step_leaves_nothing_the_next_sync_duplicates",
        || {
            block_on(async {
                let config = NftablesConfig::new(vec![IpFamily::V4], RenderConfig::default());
                let state = &steps()[0].0;
                let none = BTreeSet::new();
                let backend = |max_step: usize| {
                    NftablesBackend::with_parts(
                        config.clone(),
                        NetlinkNft::default().with_max_step(max_step),
                        FakeConntrack::default(),
                    )
                    .expect("valid config")
                };
                nft(&["flush", "ruleset"]);
                backend(usize::MAX)
                    .sync(&request(state, SyncKind::Full, &none, false))
                    .await
                    .expect("clean sync");
                let expected = by_name(&nft(&["list", "ruleset"]));

                // A set where the fixed part wants a map: the last step fails, after the steps
                // with the services' chains and rules were applied.
                nft(&["flush", "ruleset"]);
                nft(&[
                    "add",
                    "table",
                    "ip",
                    "kube-proxy",
                    "{ comment \"rules for kube-proxy\" ; }",
                ]);
                nft(&[
                    "add",
                    "set",
                    "ip",
                    "kube-proxy",
                    "service-ips",
                    "{ type ipv4_addr ; }",
                ]);
                let mut stepped = backend(5);
                stepped
                    .sync(&request(state, SyncKind::Full, &none, false))
                    .await
                    .expect_err("the fixed part is refused");
                let partly = nft(&["list", "ruleset"]);
                assert!(partly.contains("chain endpoint-"), "{partly}");
                assert!(!partly.contains("chain nat-prerouting"), "{partly}");

                nft(&["delete", "set", "ip", "kube-proxy", "service-ips"]);
                stepped
                    .sync(&request(state, SyncKind::Full, &none, false))
                    .await
                    .expect("the next sync");
                assert_eq!(by_name(&nft(&["list", "ruleset"])), expected);
            });
        },
    );
}

/// Random prefixes, with the edge cases nft encodes differently: `/0`, from zero, to the top.
fn prefix(v6: bool) -> impl Strategy<Value = IpNet> {
    let bits = if v6 { 128u8 } else { 32 };
    prop_oneof![
        3 => (any::<u128>(), 0..=bits).prop_map(move |(raw, len)| {
            let net = if v6 {
                IpNet::V6(ipnet::Ipv6Net::new(raw.into(), len).expect("valid length"))
            } else {
                IpNet::V4(ipnet::Ipv4Net::new((raw as u32).into(), len).expect("valid length"))
            };
            net.trunc()
        }),
        1 => Just(if v6 { "::/0" } else { "0.0.0.0/0" }.parse().expect("literal")),
        1 => Just(if v6 { "ffff::/16" } else { "255.0.0.0/8" }.parse().expect("literal")),
        1 => Just(if v6 { "::/3" } else { "0.0.0.0/3" }.parse().expect("literal")),
        // Contains the node's address: the LB IPs become allowed sources.
        1 => Just(if v6 { "2001:db8::/32" } else { "192.168.0.0/16" }.parse().expect("literal")),
    ]
}

fn svc_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z][a-z0-9-]{0,6}",
        1 => Just("a\" ; flush ruleset".to_owned()),
        1 => "\\PC{0,10}",
    ]
}

/// One service with its endpoints; `index` keeps ClusterIPs apart.
fn random_service(
    index: u8,
) -> impl Strategy<Value = (kp_core::model::ServicePort, Vec<kp_core::model::Endpoint>)> {
    (
        (
            any::<bool>(),
            svc_name(),
            0usize..3,
            proptest::option::of(1u64..100_000),
        ),
        (proptest::option::of(30000u16..30010), 0usize..3, 0usize..3),
        proptest::collection::vec(any::<bool>(), 0..3),
        any::<[bool; 2]>(),
        prop_oneof![4 => 0usize..4, 1 => 33usize..40],
        any::<u8>(),
    )
        .prop_flat_map(move |(head, ports, ranges, policies, endpoints, salt)| {
            let v6 = head.0;
            (
                Just((head, ports, policies, endpoints, salt)),
                proptest::collection::vec(prefix(v6), ranges.len()),
            )
        })
        .prop_map(move |((head, ports, policies, endpoints, salt), ranges)| {
            let (v6, name, protocol, affinity) = head;
            let (node_port, externals, lbs) = ports;
            let protocol = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][protocol];
            let addr = |net: u8, host: u8| {
                if v6 {
                    format!("fd00:{net}::{host:x}")
                } else {
                    format!("10.{net}.{}.{host}", salt % 4)
                }
            };
            let mut svc = service("ns", &name, protocol, &addr(96, index + 1), 80);
            svc.name = port_name("ns", &format!("{name}-{index}"), "p", protocol);
            svc.session_affinity = affinity.map(|s| SessionAffinity {
                timeout: Duration::from_secs(s),
            });
            svc.node_port = node_port;
            svc.external_ips = (0..externals).map(|i| ip(&addr(50, i as u8 + 1))).collect();
            svc.load_balancer_ips = (0..lbs).map(|i| ip(&addr(60, i as u8 + 1))).collect();
            svc.load_balancer_source_ranges = ranges;
            svc.external_policy_local = policies[0];
            svc.internal_policy_local = policies[1];
            let eps = (0..endpoints)
                .map(|i| {
                    let ep = endpoint(&addr(244, i as u8 + 1 + salt % 7), 8080);
                    if (i + usize::from(salt)) % 3 == 0 {
                        local(ep)
                    } else {
                        ep
                    }
                })
                .collect();
            (svc, eps)
        })
}

/// Two random states over the same slots: some services change, go or come.
fn random_states() -> impl Strategy<Value = (ProxyState, ProxyState, BTreeSet<ServiceName>)> {
    let slots: Vec<_> = (0..5u8)
        .map(|i| (random_service(i), random_service(i), 0u8..4))
        .collect();
    slots.prop_map(|slots| {
        let (mut before, mut after) = (Vec::new(), Vec::new());
        let mut changed = BTreeSet::new();
        for (first, second, fate) in slots {
            match fate {
                0 => {
                    before.push(first.clone());
                    after.push(first);
                }
                1 => {
                    changed.insert(first.0.name.service.clone());
                    before.push(first);
                }
                _ => {
                    changed.insert(first.0.name.service.clone());
                    changed.insert(second.0.name.service.clone());
                    before.push(first);
                    after.push(second);
                }
            }
        }
        (state(before), state(after), changed)
    })
}

/// A full sync of `before`, then a partial one to `after`, with `runner`; the ruleset
/// after each.
async fn full_then_partial<R: NftRunner>(
    config: NftablesConfig,
    runner: R,
    before: &ProxyState,
    after: &ProxyState,
    changed: &BTreeSet<ServiceName>,
) -> Vec<String> {
    nft(&["flush", "ruleset"]);
    let mut backend = NftablesBackend::with_parts(config, runner, FakeConntrack::default())
        .expect("valid config")
        .with_stale_chain_delay(Duration::ZERO);
    let none = BTreeSet::new();
    let mut out = Vec::new();
    for (state, kind, changed) in [
        (before, SyncKind::Full, &none),
        (after, SyncKind::Partial, changed),
    ] {
        backend
            .sync(&request(state, kind, changed, false))
            .await
            .unwrap_or_else(|e| panic!("{kind:?} sync failed: {e}"));
        out.push(nft(&["list", "ruleset"]));
    }
    out
}

#[test]
fn random_services_give_identical_tables_over_netlink_and_nft() {
    in_netns(
        "random_services_give_identical_tables_over_netlink_and_nft",
        || {
            // Each case runs nft a dozen times; keep the count modest.
            let mut runner = TestRunner::new(Config {
                cases: 24,
                failure_persistence: None,
                ..Config::default()
            });
            let fallbacks = Counter::default();
            runner
                .run(
                    &(random_states(), 0..configs().len()),
                    |(states, config)| {
                        let (before, after, changed) = states;
                        let config = configs().swap_remove(config);
                        block_on(async {
                            let netlink = NetlinkNft::new(ExecNft::default(), fallbacks.clone());
                            let via_netlink = full_then_partial(
                                config.clone(),
                                netlink,
                                &before,
                                &after,
                                &changed,
                            )
                            .await;
                            let via_nft = full_then_partial(
                                config,
                                ExecNft::default(),
                                &before,
                                &after,
                                &changed,
                            )
                            .await;
                            prop_assert_eq!(&via_netlink, &via_nft);
                            Ok(())
                        })
                    },
                )
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(fallbacks.get(), 0, "some scripts fell back to nft");
        },
    );
}

/// What a large element load of the verdict-free layout relies on: a quiet monitor hears
/// nothing of what is committed meanwhile (so the kernel need not build it), hears again
/// once the guard drops, and the generation moves by one per commit, anyone's.
#[test]
fn a_quiet_monitor_hears_nothing_and_the_generation_counts_every_commit() {
    use kp_nftnl::monitor::{Message, Monitor, Received, quiet};
    in_netns(
        "a_quiet_monitor_hears_nothing_and_the_generation_counts_every_commit",
        || {
            let mut monitor = Monitor::open(Duration::from_millis(200)).expect("subscribe");
            let mut socket = NftSocket::open().expect("nf_tables socket");
            let heard = |monitor: &mut Monitor| {
                let mut tables = Vec::new();
                while let Ok(Received::Messages(messages)) = monitor.recv() {
                    tables.extend(messages.into_iter().filter_map(|m| match m {
                        Message::Object { table, .. } => Some(table),
                        Message::Generation { .. } => None,
                    }));
                }
                tables
            };
            let before = socket.generation().expect("generation");
            {
                let quiet = quiet();
                assert_eq!(quiet.monitors(), 1, "this test's monitor left the group");
                nft(&["add", "table", "ip", "unheard-1"]);
                nft(&["add", "table", "ip", "unheard-2"]);
                assert_eq!(heard(&mut monitor), Vec::<String>::new());
            }
            let after = socket.generation().expect("generation");
            assert_eq!(after.wrapping_sub(before), 2, "one per commit");
            nft(&["add", "table", "ip", "heard"]);
            assert_eq!(heard(&mut monitor), vec!["heard".to_owned()]);
        },
    );
}

/// One full sync of `state` (both families) with `runner` from an empty ruleset; `nft list
/// ruleset` after it.
async fn full_sync_listing<R: NftRunner>(runner: R, state: &ProxyState) -> String {
    nft(&["flush", "ruleset"]);
    let config = NftablesConfig::new(vec![IpFamily::V4, IpFamily::V6], RenderConfig::default());
    let none = BTreeSet::new();
    NftablesBackend::with_parts(config, runner, FakeConntrack::default())
        .expect("valid config")
        .sync(&request(state, SyncKind::Full, &none, false))
        .await
        .expect("the full sync applies");
    nft(&["list", "ruleset"])
}

/// Upstream #140723 and #139516 on a real kernel, over netlink and with `nft -f` alike:
/// single-endpoint services of either family are written without any `numgen` (the chain
/// layout balances up to 32 endpoints without maps, so one endpoint is a plain `goto`), the
/// IPv6 one included (upstream's single-endpoint rule crashed nft 1.0.6 there, #140951);
/// and a valid Service whose `ns/name:port` is 131 bytes gets its comment cut to nft's 128.
#[test]
fn single_endpoints_and_long_comments_over_netlink_and_nft() {
    in_netns(
        "single_endpoints_and_long_comments_over_netlink_and_nft",
        || {
            let namespace = format!("team-{}", "n".repeat(57));
            let name = format!("svc-{}", "s".repeat(59));
            let mut long = kp_core::testutil::cluster_ip_port(
                port_name(&namespace, &name, "http", Protocol::Tcp),
                "10.96.0.60",
                80,
            );
            long.node_port = Some(30060);
            let state = state(vec![
                (
                    service("ns", "one", Protocol::Tcp, "10.96.0.50", 80),
                    vec![endpoint("10.244.9.1", 8080)],
                ),
                (
                    service("ns", "one6", Protocol::Tcp, "fd00:96::50", 80),
                    vec![endpoint("fd00:10::9", 8080)],
                ),
                (long, vec![]),
            ]);
            let full = format!("{namespace}/{name}:http");
            assert_eq!(full.len(), 131);
            block_on(async {
                let listing = full_sync_listing(NetlinkNft::default(), &state).await;
                let via_nft = full_sync_listing(ExecNft::default(), &state).await;
                assert_eq!(listing, via_nft, "netlink and nft differ");
                assert!(!listing.contains("numgen"), "{listing}");
                assert!(listing.contains("dnat to 10.244.9.1:8080"), "{listing}");
                assert!(listing.contains("dnat to [fd00:10::9]:8080"), "{listing}");
                let cut = &full[..128];
                assert!(listing.contains(&format!("comment \"{cut}\"")), "{listing}");
                assert!(!listing.contains(&full[..129]), "{listing}");
            });
        },
    );
}
