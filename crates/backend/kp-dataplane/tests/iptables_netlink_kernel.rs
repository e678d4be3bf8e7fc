//! iptables mode over nf_tables netlink against `iptables-nft-restore`, in the real kernel.
//!
//! Each test runs the same syncs (a full one, then partial ones) through two iptables
//! backends, each in its own new network namespace: one applying with
//! `iptables-nft-restore` (the reference), one over netlink ([`NetlinkRestore`]). After every
//! sync both namespaces must look identical three ways: `iptables-nft-save`, `nft
//! --debug=netlink list ruleset` (every expression and rule handle) and the kernel's own dump
//! of every table, chain and rule, byte for byte (x_tables info structs included; after
//! partial syncs, which the netlink path makes by rule handle, without the handles). Setup
//! (chains, jumps from the built-in chains) is done by the backend with `iptables-nft` in
//! both.
//!
//! The states are the renderer's snapshot fixtures (`kp_rules::testutil::fixtures`, built
//! with the same helpers), the configuration variants the renderer has, and a property
//! test of random services.

use crate::xt_dumps;

use std::collections::BTreeSet;

use kp_core::backend::{Backend, SyncKind, SyncRequest};
use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort};
use kp_core::tracker::ProxyState;
use kp_dataplane::exec::{IptablesVariant, Tools};
use kp_dataplane::iptables::netlink::NetlinkRestore;
use kp_dataplane::iptables::{IptablesBackend, IptablesConfig, IptablesMetrics};
use kp_rules::iptables::{LocalDetector, NodePortAddresses, RenderConfig};
use kp_rules::testutil::*;
use kp_testbed::isolated;
use xt_dumps::{Dumps, assert_same, dumps};

/// iptables-nft-save, ip6tables-nft-save, nft and unshare must be there (CI installs them).
fn unavailable() -> Option<String> {
    isolated::missing(
        &[
            "iptables-nft-restore",
            "ip6tables-nft-restore",
            "iptables-nft-save",
            "nft",
        ],
        &["true"],
    )
}

/// One step: the state to sync and the services changed since the previous step (`None`:
/// a full sync).
struct Step {
    state: ProxyState,
    changed: Option<BTreeSet<ServiceName>>,
}

fn backend(family: IpFamily, config: &RenderConfig, netlink: bool) -> IptablesBackend {
    backend_with(family, config, netlink.then(NetlinkRestore::new))
}

/// A backend applying with `netlink`, or with `iptables-nft-restore` when `None`.
fn backend_with(
    family: IpFamily,
    config: &RenderConfig,
    netlink: Option<NetlinkRestore>,
) -> IptablesBackend {
    let backend = IptablesBackend::new(
        IptablesConfig::new(vec![family], config.clone()),
        Tools::new(IptablesVariant::Nft),
    )
    .expect("valid config");
    match netlink {
        Some(netlink) => backend.with_netlink(netlink),
        None => backend,
    }
}

/// Syncs `steps` in order through `backend` (on a runtime of this thread), calling
/// `after` after each.
fn sync_steps(backend: &mut IptablesBackend, steps: &[Step], mut after: impl FnMut()) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let empty = BTreeSet::new();
    for step in steps {
        let request = SyncRequest {
            state: &step.state,
            kind: if step.changed.is_some() {
                SyncKind::Partial
            } else {
                SyncKind::Full
            },
            changed: step.changed.as_ref().unwrap_or(&empty),
            conntrack_cleanup_required: false,
        };
        runtime
            .block_on(backend.sync(&request))
            .expect("sync succeeds");
        after();
    }
}

/// Runs `steps` through one backend in a new namespace; the dumps after each step, and how
/// many syncs the netlink path handed to iptables-restore.
fn run_steps(
    family: IpFamily,
    config: &RenderConfig,
    steps: &[Step],
    netlink: bool,
) -> (Vec<Dumps>, u64) {
    run_steps_with(family, config, steps, netlink.then(NetlinkRestore::new))
}

/// [`run_steps`] with the given netlink writer (`None`: `iptables-nft-restore`).
fn run_steps_with(
    family: IpFamily,
    config: &RenderConfig,
    steps: &[Step],
    netlink: Option<NetlinkRestore>,
) -> (Vec<Dumps>, u64) {
    isolated::on_thread(|| {
        let metrics = IptablesMetrics::default();
        let mut backend = backend_with(family, config, netlink).with_metrics(metrics.clone());
        let mut out = Vec::new();
        sync_steps(&mut backend, steps, || out.push(dumps()));
        (out, metrics.netlink_fallbacks.get())
    })
}

/// Both ways, compared after every step; the netlink side must not have fallen back.
fn equivalent(name: &str, family: IpFamily, config: &RenderConfig, steps: Vec<Step>) {
    let (reference, _) = run_steps(family, config, &steps, false);
    let (ours, fallbacks) = run_steps(family, config, &steps, true);
    assert_eq!(
        fallbacks, 0,
        "{name}: the netlink path fell back to iptables-restore"
    );
    for (i, ((a, b), step)) in reference.iter().zip(&ours).zip(&steps).enumerate() {
        if step.changed.is_some() {
            assert_same(
                &format!("{name}, step {i} (handles aside)"),
                &a.without_handles(),
                &b.without_handles(),
            );
        } else {
            assert_same(&format!("{name}, step {i}"), a, b);
        }
    }
    // The comparison is not vacuous: the rules are there.
    let last = ours.last().expect("steps");
    assert!(last.save.contains("-A KUBE-SERVICES"), "{}", last.save);
    assert!(last.raw.contains("GetRule"), "{}", last.raw);
}

fn names(state: &ProxyState) -> BTreeSet<ServiceName> {
    state.services.keys().map(|n| n.service.clone()).collect()
}

/// A full sync of `state`, then partial ones: the first service's endpoints replaced, a
/// service added, then the first service removed (its chains go stale and are deleted).
fn full_then_partials(state: ProxyState) -> Vec<Step> {
    let mut steps = vec![Step {
        state: state.clone(),
        changed: None,
    }];
    let first = state.services.keys().next().cloned();
    let mut next = state.clone();
    let mut changed = BTreeSet::new();
    if let Some(first) = &first {
        let ip = if next.services[first].cluster_ips[0].is_ipv6() {
            "fd00:10::99"
        } else {
            "10.180.9.9"
        };
        next.endpoints
            .insert(first.clone(), vec![endpoint(ip, 8443, false)]);
        changed.insert(first.service.clone());
    }
    steps.push(Step {
        state: next.clone(),
        changed: Some(changed),
    });
    let v6 = next
        .services
        .values()
        .next()
        .is_some_and(|s| s.cluster_ips[0].is_ipv6());
    let (cip, ep) = if v6 {
        ("fd00:172:30::99", "fd00:10::7")
    } else {
        ("172.30.0.99", "10.180.7.7")
    };
    let added = cluster_ip("zz", "added", "p", cip, 8080);
    next.services.insert(added.name.clone(), added.clone());
    next.endpoints
        .insert(added.name.clone(), vec![endpoint(ep, 80, true)]);
    steps.push(Step {
        state: next.clone(),
        changed: Some(BTreeSet::from([added.name.service.clone()])),
    });
    if let Some(first) = first {
        next.services.remove(&first);
        next.endpoints.remove(&first);
        steps.push(Step {
            state: next,
            changed: Some(BTreeSet::from([first.service])),
        });
    }
    steps
}

fn check(name: &str, family: IpFamily, config: RenderConfig, state: ProxyState) {
    let steps = full_then_partials(state);
    equivalent(name, family, &config, steps);
}

// The renderer's snapshot fixtures (`kp_rules::testutil::fixtures`), and more.

use kp_rules::testutil::fixtures::{
    affinity_and_itp_local, cluster_ip_two_endpoints as two_endpoints,
    etp_local_lb_source_ranges as etp_local_lb, no_endpoints, node_port,
};

/// The IPv6 fixture, with a UDP load balancer under affinity and a service without
/// endpoints added.
fn ipv6() -> ProxyState {
    let mut state = fixtures::ipv6();
    let mut lb = with_affinity(cluster_ip("ns9", "svc9", "p", "fd00:172:30::42", 53), 60);
    lb.name.protocol = Protocol::Udp;
    lb.load_balancer_ips = vec![ip("2001:db8:9::1")];
    lb.load_balancer_source_ranges = vec![net("2001:db8::/65")];
    let mut none = cluster_ip("ns10", "svc10", "p", "fd00:172:30::43", 80);
    none.node_port = Some(3010);
    state
        .endpoints
        .insert(lb.name.clone(), vec![endpoint("fd00:10::3", 5353, false)]);
    state.services.insert(lb.name.clone(), lb);
    state.services.insert(none.name.clone(), none);
    state
}

/// Every fixture together, with an SCTP service.
fn everything() -> ProxyState {
    let mut state = node_port();
    for other in [
        etp_local_lb(),
        affinity_and_itp_local(),
        no_endpoints(),
        two_endpoints(),
    ] {
        state.services.extend(other.services);
        state.endpoints.extend(other.endpoints);
    }
    let mut sctp = cluster_ip("ns11", "sctp", "p", "172.30.0.50", 9);
    sctp.name.protocol = Protocol::Sctp;
    sctp.node_port = Some(3011);
    let endpoints = vec![endpoint("10.180.0.11", 9, false)];
    state.endpoints.insert(sctp.name.clone(), endpoints);
    state.services.insert(sctp.name.clone(), sctp);
    state
}

#[test]
fn snapshot_fixtures_cluster_ip_two_endpoints() {
    isolated::run(
        "snapshot_fixtures_cluster_ip_two_endpoints",
        unavailable,
        || {
            check("two endpoints", IpFamily::V4, config(), two_endpoints());
        },
    );
}

#[test]
fn snapshot_fixtures_node_port() {
    isolated::run("snapshot_fixtures_node_port", unavailable, || {
        check("node port", IpFamily::V4, config(), node_port());
    });
}

#[test]
fn snapshot_fixtures_etp_local_lb_source_ranges() {
    isolated::run(
        "snapshot_fixtures_etp_local_lb_source_ranges",
        unavailable,
        || {
            check("eTP local LB", IpFamily::V4, config(), etp_local_lb());
        },
    );
}

#[test]
fn snapshot_fixtures_affinity_and_itp_local() {
    isolated::run(
        "snapshot_fixtures_affinity_and_itp_local",
        unavailable,
        || {
            check(
                "affinity, iTP local",
                IpFamily::V4,
                config(),
                affinity_and_itp_local(),
            );
        },
    );
}

#[test]
fn snapshot_fixtures_no_endpoints() {
    isolated::run("snapshot_fixtures_no_endpoints", unavailable, || {
        check("no endpoints", IpFamily::V4, config(), no_endpoints());
    });
}

#[test]
fn snapshot_fixtures_ipv6() {
    isolated::run("snapshot_fixtures_ipv6", unavailable, || {
        check("ipv6", IpFamily::V6, config(), ipv6());
    });
}

/// The renderer's configuration variants, over every fixture at once.
#[test]
fn configuration_variants() {
    isolated::run("configuration_variants", unavailable, || {
        let variants: Vec<(&str, RenderConfig)> = vec![
            (
                "masqueradeAll, no detector",
                RenderConfig {
                    masquerade_all: true,
                    ..RenderConfig::default()
                },
            ),
            (
                "interface prefix detector, no random-fully, INVALID kept",
                RenderConfig {
                    local_detector: LocalDetector::InterfaceNamePrefix("cali".into()),
                    random_fully: false,
                    drop_invalid: false,
                    ..RenderConfig::default()
                },
            ),
            (
                "bridge detector, mark bit 5, no localhost NodePorts",
                RenderConfig {
                    local_detector: LocalDetector::BridgeInterface("cbr0".into()),
                    masquerade_bit: 5,
                    localhost_node_ports: false,
                    ..RenderConfig::default()
                },
            ),
            (
                "nodePortAddresses, large-cluster comments",
                RenderConfig {
                    node_port_addresses: NodePortAddresses::Ips(vec![
                        ip("192.168.0.2"),
                        ip("127.0.0.1"),
                    ]),
                    large_cluster_threshold: 2,
                    ..config()
                },
            ),
        ];
        for (name, config) in variants {
            check(name, IpFamily::V4, config, everything());
        }
        let v6 = RenderConfig {
            node_port_addresses: NodePortAddresses::Ips(vec![ip("2001:db8::1"), ip("::1")]),
            local_detector: LocalDetector::InterfaceNamePrefix("veth".into()),
            ..RenderConfig::default()
        };
        check("ipv6 variants", IpFamily::V6, v6, ipv6());
    });
}

/// An unencodable render is applied with iptables-restore and counted; the result is the
/// same as the reference's.
#[test]
fn unencodable_render_falls_back_to_iptables_restore() {
    isolated::run(
        "unencodable_render_falls_back_to_iptables_restore",
        unavailable,
        || {
            // A local-detector CIDR of /0, inverted (`! -s 0.0.0.0/0`), is one shape the
            // encoder refuses.
            let config = RenderConfig {
                local_detector: LocalDetector::Cidrs(vec![net("0.0.0.0/0")]),
                ..RenderConfig::default()
            };
            let steps = vec![Step {
                state: two_endpoints(),
                changed: None,
            }];
            let (reference, _) = run_steps(IpFamily::V4, &config, &steps, false);
            let (ours, fallbacks) = run_steps(IpFamily::V4, &config, &steps, true);
            assert_eq!(fallbacks, 1);
            assert_same("fallback", &reference[0], &ours[0]);
        },
    );
}

/// The handles of `table`'s `chain` rules, in order (`nft -a`).
fn handles(family: &str, table: &str, chain: &str) -> Vec<u64> {
    xt_dumps::run("nft", &["-a", "list", "chain", family, table, chain], None)
        .lines()
        .filter_map(|line| {
            line.rsplit_once("# handle ")
                .and_then(|(_, h)| h.trim().parse().ok())
        })
        .collect()
}

/// A partial sync leaves the unchanged rules of KUBE-SERVICES alone (same handles) and
/// inserts only the new service's rule; an endpoint change does not touch it at all.
#[test]
fn partial_syncs_edit_top_level_chains_by_handle() {
    isolated::run(
        "partial_syncs_edit_top_level_chains_by_handle",
        unavailable,
        || {
            let steps = full_then_partials(everything());
            isolated::on_thread(|| {
                let mut backend = backend(IpFamily::V4, &config(), true);
                let mut seen = Vec::new();
                sync_steps(&mut backend, &steps, || {
                    seen.push(handles("ip", "nat", "KUBE-SERVICES"));
                });
                // Step 1 only changed endpoints: KUBE-SERVICES is untouched.
                assert_eq!(seen[1], seen[0]);
                // Step 2 added one service: every old rule kept, one new one.
                let kept = seen[2].iter().filter(|h| seen[1].contains(h)).count();
                assert_eq!(kept, seen[1].len(), "{seen:?}");
                assert_eq!(seen[2].len(), seen[1].len() + 1, "{seen:?}");
                // Step 3 removed the first service: its rules gone, the others kept.
                assert!(seen[3].iter().all(|h| seen[2].contains(h)), "{seen:?}");
                assert!(seen[3].len() < seen[2].len(), "{seen:?}");
            });
        },
    );
}

mod random {
    //! Random services: every kind of exposure, protocol, policy and affinity the renderer
    //! handles, a full sync then partial syncs of random changes.

    use proptest::prelude::*;

    use super::*;

    /// Cases per run: each case is two namespaces and a few syncs (about a second).
    const CASES: u32 = 12;

    #[derive(Clone, Debug)]
    struct Svc {
        protocol: Protocol,
        node_port: bool,
        external_ip: bool,
        lb: bool,
        source_ranges: bool,
        etp_local: bool,
        itp_local: bool,
        affinity: Option<u64>,
        endpoints: Vec<(u8, bool)>,
    }

    fn svc() -> impl Strategy<Value = Svc> {
        (
            prop_oneof![
                Just(Protocol::Tcp),
                Just(Protocol::Udp),
                Just(Protocol::Sctp)
            ],
            any::<[bool; 6]>(),
            prop::option::of(1u64..100_000),
            prop::collection::vec((any::<u8>(), any::<bool>()), 0..5),
        )
            .prop_map(|(protocol, flags, affinity, endpoints)| Svc {
                protocol,
                node_port: flags[0],
                external_ip: flags[1],
                lb: flags[2],
                source_ranges: flags[3],
                etp_local: flags[4],
                itp_local: flags[5],
                affinity,
                endpoints,
            })
    }

    fn build(family: IpFamily, index: usize, svc: &Svc) -> (ServicePort, Vec<Endpoint>) {
        let v6 = family == IpFamily::V6;
        let addr = |v4: String, v6s: String| ip(if v6 { &v6s } else { &v4 });
        let mut port = cluster_ip(
            &format!("ns{index}"),
            &format!("svc{index}"),
            "p",
            &if v6 {
                format!("fd00:172:30::{index:x}")
            } else {
                format!("172.30.1.{index}")
            },
            80 + index as u16,
        );
        port.name.protocol = svc.protocol;
        if svc.node_port {
            port.node_port = Some(30000 + index as u16);
        }
        if svc.external_ip {
            port.external_ips = vec![addr(
                format!("192.168.99.{index}"),
                format!("2001:db8:99::{index:x}"),
            )];
        }
        if svc.lb {
            port.load_balancer_ips = vec![addr(
                format!("5.6.7.{index}"),
                format!("2001:db8:5::{index:x}"),
            )];
            port.node_port.get_or_insert(31000 + index as u16);
            if svc.source_ranges {
                port.load_balancer_source_ranges = if v6 {
                    vec![net("2001:db8:203::/48"), net("2001:db8::/32")]
                } else {
                    vec![net("203.0.113.0/25"), net("192.168.0.0/24")]
                };
            }
            if svc.etp_local {
                port.health_check_node_port = Some(32000 + index as u16);
            }
        }
        port.external_policy_local = svc.etp_local;
        port.internal_policy_local = svc.itp_local;
        if let Some(seconds) = svc.affinity {
            port = with_affinity(port, seconds);
        }
        let endpoints = svc
            .endpoints
            .iter()
            .map(|(host, local)| {
                endpoint(
                    &if v6 {
                        format!("fd00:10::{host:x}")
                    } else {
                        format!("10.180.2.{host}")
                    },
                    8000 + u16::from(*host),
                    *local,
                )
            })
            .collect();
        (port, endpoints)
    }

    fn build_state(family: IpFamily, services: &[Svc]) -> ProxyState {
        state(
            services
                .iter()
                .enumerate()
                .map(|(i, s)| build(family, i + 1, s))
                .collect(),
        )
    }

    #[test]
    fn random_services() {
        isolated::run("random::random_services", unavailable, || {
            let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
                cases: CASES,
                failure_persistence: None,
                ..ProptestConfig::default()
            });
            let strategy = (
                any::<bool>(),
                prop::collection::vec(svc(), 1..6),
                prop::collection::vec(svc(), 1..6),
            );
            runner
                .run(&strategy, |(v6, before, after)| {
                    let family = if v6 { IpFamily::V6 } else { IpFamily::V4 };
                    let first = build_state(family, &before);
                    let second = build_state(family, &after);
                    let mut changed = names(&first);
                    changed.extend(names(&second));
                    let steps = vec![
                        Step {
                            state: first,
                            changed: None,
                        },
                        Step {
                            state: second,
                            changed: Some(changed),
                        },
                    ];
                    equivalent("random", family, &config(), steps);
                    Ok(())
                })
                .expect("netlink and iptables-nft-restore agree");
        });
    }
}

/// A first sync split into steps (here every few messages; at scale, ~20k) gives the same
/// rules as the one restore, handles aside (the service chains go first), and the partial
/// syncs after it edit its top-level chains by handle as usual.
#[test]
fn split_first_syncs_give_the_same_rules() {
    isolated::run("split_first_syncs_give_the_same_rules", unavailable, || {
        let config = config();
        let steps = full_then_partials(everything());
        let (reference, _) = run_steps(IpFamily::V4, &config, &steps, false);
        let split = NetlinkRestore::new().with_max_step_messages(8);
        let (ours, fallbacks) = run_steps_with(IpFamily::V4, &config, &steps, Some(split));
        assert_eq!(
            fallbacks, 0,
            "the netlink path fell back to iptables-restore"
        );
        for (i, (a, b)) in reference.iter().zip(&ours).enumerate() {
            assert_same(
                &format!("split, step {i} (handles aside)"),
                &a.without_handles(),
                &b.without_handles(),
            );
        }
        assert_ne!(
            reference[0].nft, ours[0].nft,
            "the first sync was split: its rule handles are numbered differently"
        );
        assert!(
            ours[0].save.contains("-A KUBE-SERVICES"),
            "{}",
            ours[0].save
        );
    });
}
