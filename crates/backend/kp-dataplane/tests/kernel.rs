//! The real tools against a real kernel, each test inside its own throwaway network
//! namespace.
//!
//! Every test re-executes this test binary as `unshare -n <binary> --exact <test>` and the
//! child runs the body. An unnamed namespace lives exactly as long as its processes, so the
//! kernel removes it (with every rule and conntrack entry made in it) when the child exits,
//! whether the body passed, panicked or was killed: there is nothing left to clean up. The
//! child refuses to run a body in the namespace of its parent or of PID 1, so a harness bug
//! can never touch the host's rules.
//!
//! Without root, `unshare` or the iptables tools the tests are skipped with a message, unless
//! `KP_REQUIRE_KERNEL_TESTS=1` makes that a failure (for CI).

use std::collections::BTreeSet;
use std::path::PathBuf;

use kp_core::backend::{Backend, SyncKind};
use kp_core::model::{IpFamily, Protocol};
use kp_dataplane::conntrack::{Conntrack, DefaultConntrack, ExecConntrack};
use kp_dataplane::exec::{ExecError, ExecRunner, IptablesVariant, Tools, backend_of_version};
use kp_dataplane::iptables::{IptablesBackend, IptablesConfig, KUBELET_CHAINS};
use kp_dataplane::testutil::*;
use kp_rules::iptables::RenderConfig;
use kp_testbed::isolated::{self, sh};

/// Run `body` in a fresh network namespace (`kp_testbed::isolated`). `name` must be the test
/// function's name; `tools` the binaries it needs.
fn in_netns(name: &str, tools: &[&str], body: impl FnOnce()) {
    isolated::run(name, || isolated::missing(tools, &["true"]), body);
}

fn save(family: IpFamily) -> String {
    match family {
        IpFamily::V4 => sh("iptables-save"),
        IpFamily::V6 => sh("ip6tables-save"),
    }
}

/// Chains of a dump, as `table/chain`.
fn chains(dump: &str) -> BTreeSet<String> {
    let mut table = String::new();
    let mut out = BTreeSet::new();
    for line in dump.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t.to_owned();
        } else if let Some(rest) = line.strip_prefix(':') {
            let chain = rest.split(' ').next().unwrap_or_default();
            out.insert(format!("{table}/{chain}"));
        }
    }
    out
}

fn config(families: Vec<IpFamily>) -> IptablesConfig {
    IptablesConfig::new(families, RenderConfig::default())
}

fn real_backend(families: Vec<IpFamily>) -> IptablesBackend {
    IptablesBackend::new(config(families), Tools::default()).expect("valid config")
}

fn web(endpoint_ip: &str) -> kp_core::tracker::ProxyState {
    state(vec![(
        service("ns", "web", Protocol::Tcp, "10.96.0.1", 80),
        vec![endpoint(endpoint_ip, 8080)],
    )])
}

fn web_chain() -> String {
    kp_rules::iptables::names::ServiceChains::new(&port_name("ns", "web", "p", Protocol::Tcp)).svc
}

fn sep_chain(endpoint_ip: &str) -> String {
    kp_rules::iptables::names::endpoint_chain(
        &port_name("ns", "web", "p", Protocol::Tcp),
        ip(endpoint_ip),
        8080,
    )
}

#[test]
fn full_then_partial_sync_in_a_netns() {
    in_netns(
        "full_then_partial_sync_in_a_netns",
        &["iptables-restore"],
        || {
            block_on(async {
                let mut backend = real_backend(vec![IpFamily::V4]);
                let none = BTreeSet::new();
                let first = web("10.244.1.1");
                backend
                    .sync(&request(&first, SyncKind::Full, &none, false))
                    .await
                    .expect("full sync applies");
                let dump = save(IpFamily::V4);
                let present = chains(&dump);
                assert!(present.contains("nat/KUBE-SERVICES"), "{dump}");
                assert!(present.contains("filter/KUBE-SERVICES"), "{dump}");
                assert!(present.contains(&format!("nat/{}", web_chain())), "{dump}");
                assert!(present.contains(&format!("nat/{}", sep_chain("10.244.1.1"))));
                assert!(dump.contains("--to-destination 10.244.1.1:8080"));
                assert!(dump.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"));

                // The endpoint moves: a partial sync replaces the SEP chain.
                let second = web("10.244.2.2");
                let changed = BTreeSet::from([service_name("ns", "web")]);
                backend
                    .sync(&request(&second, SyncKind::Partial, &changed, false))
                    .await
                    .expect("partial sync applies");
                let dump = save(IpFamily::V4);
                let present = chains(&dump);
                assert!(
                    present.contains(&format!("nat/{}", sep_chain("10.244.2.2"))),
                    "{dump}"
                );
                assert!(
                    !present.contains(&format!("nat/{}", sep_chain("10.244.1.1"))),
                    "{dump}"
                );
                assert!(dump.contains("--to-destination 10.244.2.2:8080"));
                assert!(!dump.contains("10.244.1.1"));
            });
        },
    );
}

#[test]
fn dual_stack_sync_in_a_netns() {
    in_netns(
        "dual_stack_sync_in_a_netns",
        &["iptables-restore", "ip6tables-restore"],
        || {
            block_on(async {
                let mut backend = real_backend(vec![IpFamily::V4, IpFamily::V6]);
                let mut state = web("10.244.1.1");
                let mut v6 = service("ns", "web6", Protocol::Udp, "fd00::1", 53);
                v6.node_port = Some(30053);
                state
                    .endpoints
                    .insert(v6.name.clone(), vec![endpoint("fd00:10::5", 5353)]);
                state.services.insert(v6.name.clone(), v6);
                let none = BTreeSet::new();
                backend
                    .sync(&request(&state, SyncKind::Full, &none, false))
                    .await
                    .expect("both families apply");
                let dump6 = save(IpFamily::V6);
                assert!(
                    dump6.contains("--to-destination [fd00:10::5]:5353"),
                    "{dump6}"
                );
                assert!(!save(IpFamily::V4).contains("fd00"));
            });
        },
    );
}

#[test]
fn restore_failures_in_a_netns() {
    in_netns("restore_failures_in_a_netns", &["iptables-restore"], || {
        block_on(async {
            // A bogus restore binary: setup (real iptables) works, the restore cannot run.
            let tools = Tools {
                iptables_restore: PathBuf::from("/nonexistent/kp-dataplane-test/iptables-restore"),
                ..Tools::default()
            };
            let mut backend =
                IptablesBackend::new(config(vec![IpFamily::V4]), tools).expect("valid config");
            let state = web("10.244.1.1");
            let none = BTreeSet::new();
            let err = backend
                .sync(&request(&state, SyncKind::Full, &none, false))
                .await
                .expect_err("restore binary missing");
            assert!(
                matches!(tool_error(&err, "iptables-restore"), Some(ExecError::Spawn { program, .. }) if program.contains("/nonexistent/kp-dataplane-test")),
                "{err:?}"
            );
            assert!(!chains(&save(IpFamily::V4)).contains(&format!("nat/{}", web_chain())));

            // A restore the kernel rejects keeps the previous rules: program a good state,
            // then make one that fails (a jump to a chain that does not exist).
            let mut good = real_backend(vec![IpFamily::V4]);
            good.sync(&request(&state, SyncKind::Full, &none, false))
                .await
                .expect("good state applies");
            let before = save(IpFamily::V4);
            sh("iptables -t nat -N KUBE-SVC-HELDBYFOREIGNRULE && \
                iptables -t nat -A OUTPUT -j KUBE-SVC-HELDBYFOREIGNRULE");
            // The next full sync lists that chain as stale and tries to delete it, which
            // fails while a foreign rule references it: the whole restore is rejected.
            let err = good
                .sync(&request(&state, SyncKind::Full, &none, false))
                .await
                .expect_err("deleting a referenced chain fails");
            assert!(tool_error(&err, "iptables-restore").is_some(), "{err:?}");
            let after = save(IpFamily::V4);
            assert!(after.contains("--to-destination 10.244.1.1:8080"));
            assert_eq!(
                chains(&before).len() + 1,
                chains(&after).len(),
                "only the foreign chain was added"
            );
        });
    });
}

#[test]
fn restore_in_an_empty_namespace_leaves_this_one_alone() {
    in_netns(
        "restore_in_an_empty_namespace_leaves_this_one_alone",
        &["iptables-restore", "unshare"],
        || {
            block_on(async {
                use kp_dataplane::exec::RuleRunner as _;
                let runner = ExecRunner::new(Tools::default());
                let none = BTreeSet::new();
                let scope = kp_rules::iptables::SyncScope {
                    kind: SyncKind::Full,
                    changed: &none,
                    existing_chains: &BTreeSet::new(),
                };
                let text = kp_rules::iptables::render(
                    &web("10.244.1.1"),
                    IpFamily::V4,
                    &RenderConfig::default(),
                    &scope,
                )
                .expect("renders")
                .text;
                let before = save(IpFamily::V4);
                runner
                    .restore_isolated(IpFamily::V4, &text)
                    .await
                    .expect("a full ruleset applies to an empty namespace");
                assert_eq!(save(IpFamily::V4), before, "this namespace is untouched");
                // What the kernel rejects fails there too.
                let bad = "*nat\n:KUBE-SVC-TESTONLY - [0:0]\n-A KUBE-SVC-TESTONLY -j KUBE-SEP-MISSING\nCOMMIT\n";
                let err = runner
                    .restore_isolated(IpFamily::V4, bad)
                    .await
                    .expect_err("a jump to a missing chain");
                assert!(
                    matches!(err, kp_dataplane::exec::ExecError::Failed { .. }),
                    "{err}"
                );
                assert_eq!(save(IpFamily::V4), before);
            });
        },
    );
}

#[test]
fn setup_is_idempotent_across_restarts() {
    in_netns(
        "setup_is_idempotent_across_restarts",
        &["iptables-restore"],
        || {
            block_on(async {
                let state = web("10.244.1.1");
                let none = BTreeSet::new();
                for _ in 0..2 {
                    // A new backend each time, as after a restart.
                    let mut backend = real_backend(vec![IpFamily::V4]);
                    for _ in 0..2 {
                        backend
                            .sync(&request(&state, SyncKind::Full, &none, false))
                            .await
                            .expect("sync applies");
                    }
                }
                let dump = save(IpFamily::V4);
                let jumps = |rule: &str| dump.lines().filter(|l| *l == rule).count();
                assert_eq!(
                    jumps(
                        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
                    ),
                    1,
                    "{dump}"
                );
                assert_eq!(
                    jumps(
                        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING"
                    ),
                    1
                );
                assert_eq!(jumps("-A INPUT -j KUBE-FIREWALL"), 1);
                let canaries = chains(&dump)
                    .iter()
                    .filter(|c| c.ends_with("/KUBE-PROXY-CANARY"))
                    .count();
                assert_eq!(canaries, 3);
            });
        },
    );
}

#[test]
fn cleanup_removes_kube_chains_and_nothing_else() {
    in_netns(
        "cleanup_removes_kube_chains_and_nothing_else",
        &["iptables-restore", "ip6tables-restore"],
        || {
            block_on(async {
                // Foreign rules and chains, and an upstream-only chain (KUBE-MARK-DROP).
                sh(
                    "iptables -N FOO-CHAIN && iptables -A FOO-CHAIN -s 192.0.2.1 -j DROP && \
                    iptables -A INPUT -s 198.51.100.1 -j ACCEPT && \
                    iptables -t nat -N KUBE-MARK-DROP && \
                    iptables -t nat -A KUBE-MARK-DROP -j MARK --or-mark 0x8000 && \
                    ip6tables -N FOO-CHAIN",
                );
                let foreign4 = save(IpFamily::V4);
                let families = vec![IpFamily::V4, IpFamily::V6];
                let mut backend = real_backend(families.clone());
                let state = web("10.244.1.1");
                let none = BTreeSet::new();
                backend
                    .sync(&request(&state, SyncKind::Full, &none, false))
                    .await
                    .expect("sync applies");
                assert!(save(IpFamily::V4).contains("KUBE-SVC-"));

                // A fresh backend, as for `--cleanup`; twice to show it is idempotent.
                for _ in 0..2 {
                    real_backend(families.clone())
                        .cleanup()
                        .await
                        .expect("cleanup succeeds");
                }
                for family in [IpFamily::V4, IpFamily::V6] {
                    let dump = save(family);
                    let left: Vec<String> = chains(&dump)
                        .into_iter()
                        .filter(|c| c.contains("/KUBE-"))
                        .collect();
                    // Only the kubelet's chains may remain, and KUBE-MARK-MASQ, which a
                    // kubelet that creates KUBE-MARK-DROP shares.
                    for chain in &left {
                        let name = chain.split('/').nth(1).unwrap_or_default();
                        assert!(
                            KUBELET_CHAINS.contains(&name) || name == "KUBE-MARK-MASQ",
                            "{chain} left:\n{dump}"
                        );
                    }
                    let kube_jumps: Vec<&str> = dump
                        .lines()
                        .filter(|l| l.contains("-j KUBE-") && !l.contains("-j KUBE-FIREWALL"))
                        .collect();
                    assert!(kube_jumps.is_empty(), "{kube_jumps:?}");
                    assert!(chains(&dump).contains("filter/FOO-CHAIN"));
                }
                let dump = save(IpFamily::V4);
                assert!(dump.contains("-A FOO-CHAIN -s 192.0.2.1/32 -j DROP"));
                assert!(dump.contains("-A INPUT -s 198.51.100.1/32 -j ACCEPT"));
                // Apart from KUBE-FIREWALL and its jumps, the rules and user chains are what
                // they were before. (nf_tables leaves the emptied mangle table behind, with
                // only its built-in chains, so tables and built-in chains are not compared.)
                let strip = |d: &str| -> Vec<String> {
                    d.lines()
                        .filter(|l| {
                            l.starts_with("-A ") || (l.starts_with(':') && l.contains(" - ["))
                        })
                        .filter(|l| !l.contains("KUBE-"))
                        .map(str::to_owned)
                        .collect()
                };
                assert_eq!(strip(&dump), strip(&foreign4));
            });
        },
    );
}

/// What a kubelet leaves in iptables, by era: before `IPTablesOwnershipCleanup` (v1.26 and
/// older by default) it creates the mark chains and a `KUBE-FIREWALL` that also drops marked
/// packets; later ones only `KUBE-FIREWALL`'s localnet rule. Both add the canaries and the hint.
const KUBELET_V1_26: &str = "\
iptables -t nat -N KUBE-MARK-DROP
iptables -t nat -A KUBE-MARK-DROP -j MARK --or-mark 0x8000
iptables -t nat -N KUBE-MARK-MASQ
iptables -t nat -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
iptables -t nat -N KUBE-POSTROUTING
iptables -t nat -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
iptables -t nat -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
iptables -t nat -A KUBE-POSTROUTING -m comment --comment 'kubernetes service traffic requiring SNAT' -j MASQUERADE
iptables -t nat -A POSTROUTING -m comment --comment 'kubernetes postrouting rules' -j KUBE-POSTROUTING
iptables -N KUBE-FIREWALL
iptables -A KUBE-FIREWALL -m comment --comment 'kubernetes firewall for dropping marked packets' -m mark --mark 0x8000/0x8000 -j DROP
iptables -A KUBE-FIREWALL -m comment --comment 'block incoming localnet connections' --dst 127.0.0.0/8 ! --src 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
iptables -I INPUT -j KUBE-FIREWALL
iptables -I OUTPUT -j KUBE-FIREWALL
";

const KUBELET_V1_28: &str = "\
iptables -N KUBE-FIREWALL
iptables -A KUBE-FIREWALL -m comment --comment 'block incoming localnet connections' --dst 127.0.0.0/8 ! --src 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
iptables -I INPUT -j KUBE-FIREWALL
iptables -I OUTPUT -j KUBE-FIREWALL
";

const KUBELET_CANARIES: &str = "\
iptables -t mangle -N KUBE-IPTABLES-HINT
iptables -t mangle -N KUBE-KUBELET-CANARY
iptables -t nat -N KUBE-KUBELET-CANARY
iptables -N KUBE-KUBELET-CANARY
";

/// The rules of `chain` in table `table` of an `iptables-save` dump.
fn rules_of(dump: &str, table: &str, chain: &str) -> Vec<String> {
    let prefix = format!("-A {chain} ");
    let mut current = "";
    dump.lines()
        .filter(|line| {
            if let Some(t) = line.strip_prefix('*') {
                current = t;
            }
            current == table && line.starts_with(&prefix)
        })
        .map(str::to_owned)
        .collect()
}

/// Syncs twice and cleans up on a node as a kubelet of one era leaves it: the kubelet's chains
/// and rules are never flushed or removed, and cleanup removes what upstream's cleanup of that
/// era removes (`KUBE-POSTROUTING` in both; `KUBE-MARK-MASQ` only where no kubelet shares it).
fn kubelet_era_survives(kubelet: &str, shares_mark_masq: bool) {
    block_on(async {
        sh(&format!("set -e\n{kubelet}{KUBELET_CANARIES}"));
        let kubelet_firewall = rules_of(&save(IpFamily::V4), "filter", "KUBE-FIREWALL");
        let mut backend = real_backend(vec![IpFamily::V4]);
        let (state, none) = (web("10.244.1.1"), BTreeSet::new());
        for _ in 0..2 {
            backend
                .sync(&request(&state, SyncKind::Full, &none, false))
                .await
                .expect("sync applies");
            let dump = save(IpFamily::V4);
            // The kubelet's rules stay, in order, and ours is the same rule: not added twice.
            assert_eq!(
                rules_of(&dump, "filter", "KUBE-FIREWALL"),
                kubelet_firewall,
                "{dump}"
            );
            assert!(dump.contains("KUBE-SVC-"), "{dump}");
        }
        real_backend(vec![IpFamily::V4])
            .cleanup()
            .await
            .expect("cleanup succeeds");
        let dump = save(IpFamily::V4);
        let left = chains(&dump);
        for chain in [
            "filter/KUBE-FIREWALL",
            "filter/KUBE-KUBELET-CANARY",
            "nat/KUBE-KUBELET-CANARY",
            "mangle/KUBE-KUBELET-CANARY",
            "mangle/KUBE-IPTABLES-HINT",
        ] {
            assert!(left.contains(chain), "{chain} removed:\n{dump}");
        }
        assert_eq!(rules_of(&dump, "filter", "KUBE-FIREWALL"), kubelet_firewall);
        assert_eq!(
            rules_of(&dump, "filter", "INPUT"),
            ["-A INPUT -j KUBE-FIREWALL"]
        );
        assert!(!left.contains("nat/KUBE-POSTROUTING"), "{dump}");
        assert!(!left.contains("nat/KUBE-SERVICES"), "{dump}");
        assert_eq!(
            left.contains("nat/KUBE-MARK-MASQ"),
            shares_mark_masq,
            "{dump}"
        );
        if shares_mark_masq {
            assert!(left.contains("nat/KUBE-MARK-DROP"), "{dump}");
            assert_eq!(rules_of(&dump, "nat", "KUBE-MARK-MASQ").len(), 1, "{dump}");
        }
    });
}

#[test]
fn a_v1_26_kubelets_chains_survive_syncs_and_cleanup() {
    in_netns(
        "a_v1_26_kubelets_chains_survive_syncs_and_cleanup",
        &["iptables-restore"],
        || kubelet_era_survives(KUBELET_V1_26, true),
    );
}

#[test]
fn a_v1_28_kubelets_chains_survive_syncs_and_cleanup() {
    in_netns(
        "a_v1_28_kubelets_chains_survive_syncs_and_cleanup",
        &["iptables-restore"],
        || kubelet_era_survives(KUBELET_V1_28, false),
    );
}

/// A partial sync that removes an endpoint deletes the UDP entry DNATed to it, and only
/// that one, through `conntrack`.
async fn udp_entry_to_a_removed_endpoint_is_deleted<C: Conntrack>(conntrack: C) {
    let dns = |eps: &[&str]| {
        state(vec![(
            service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53),
            eps.iter().map(|e| endpoint(e, 5353)).collect(),
        )])
    };
    let mut backend =
        IptablesBackend::with_parts(config(vec![IpFamily::V4]), ExecRunner::default(), conntrack)
            .expect("valid config");
    let none = BTreeSet::new();
    backend
        .sync(&request(
            &dns(&["10.244.1.5", "10.244.2.6"]),
            SyncKind::Full,
            &none,
            true,
        ))
        .await
        .expect("sync applies");
    // Two clients' flows as DNAT would have made them, one per endpoint.
    for (client, endpoint) in [("10.0.0.1", "10.244.1.5"), ("10.0.0.2", "10.244.2.6")] {
        sh(&format!(
            "conntrack -I -p udp --src {client} --dst 10.96.0.10 --sport 1234 --dport 53 \
             --reply-src {endpoint} --reply-dst {client} --reply-port-src 5353 \
             --reply-port-dst 1234 --timeout 60 2>&1"
        ));
    }
    assert_eq!(sh("conntrack -L -p udp 2>/dev/null").lines().count(), 2);

    let changed = BTreeSet::from([service_name("kube-system", "dns")]);
    backend
        .sync(&request(
            &dns(&["10.244.1.5"]),
            SyncKind::Partial,
            &changed,
            true,
        ))
        .await
        .expect("sync applies");
    let left = sh("conntrack -L -p udp 2>/dev/null");
    assert!(!left.contains("10.244.2.6"), "{left}");
    assert!(
        left.contains("src=10.244.1.5"),
        "the other flow stays: {left}"
    );
}

#[test]
fn udp_conntrack_entry_to_a_removed_endpoint_is_deleted_over_netlink() {
    in_netns(
        "udp_conntrack_entry_to_a_removed_endpoint_is_deleted_over_netlink",
        &["iptables-restore", "conntrack"],
        || {
            block_on(udp_entry_to_a_removed_endpoint_is_deleted(
                DefaultConntrack::default(),
            ))
        },
    );
}

#[test]
fn udp_conntrack_entry_to_a_removed_endpoint_is_deleted_by_the_tool() {
    in_netns(
        "udp_conntrack_entry_to_a_removed_endpoint_is_deleted_by_the_tool",
        &["iptables-restore", "conntrack"],
        || {
            block_on(udp_entry_to_a_removed_endpoint_is_deleted(
                ExecConntrack::default(),
            ))
        },
    );
}

#[test]
fn legacy_variant_syncs_and_cleans_in_a_netns() {
    in_netns(
        "legacy_variant_syncs_and_cleans_in_a_netns",
        &["iptables-legacy-restore"],
        || {
            block_on(async {
                let tools = Tools::new(IptablesVariant::Legacy);
                let version = ExecRunner::new(tools.clone())
                    .version()
                    .await
                    .expect("iptables-legacy runs");
                assert_eq!(
                    backend_of_version(&version),
                    IptablesVariant::Legacy,
                    "{version}"
                );
                let mut backend =
                    IptablesBackend::new(config(vec![IpFamily::V4]), tools).expect("valid config");
                let state = web("10.244.1.1");
                let none = BTreeSet::new();
                backend
                    .sync(&request(&state, SyncKind::Full, &none, false))
                    .await
                    .expect("legacy restore applies");
                let dump = sh("iptables-legacy-save");
                assert!(dump.contains("--to-destination 10.244.1.1:8080"), "{dump}");
                // The nf_tables side saw nothing.
                assert!(!save(IpFamily::V4).contains("KUBE-"));
                backend.cleanup().await.expect("cleanup succeeds");
                let dump = sh("iptables-legacy-save");
                assert!(!dump.contains("KUBE-SVC-"), "{dump}");
            });
        },
    );
}

#[test]
fn legacy_nat_size_follows_every_change_and_nothing_else() {
    in_netns(
        "legacy_nat_size_follows_every_change_and_nothing_else",
        &["iptables-legacy", "ip6tables-legacy"],
        || {
            use kp_dataplane::iptables::{LegacyNatSize, NatSize as _};
            for (family, tool) in [
                (IpFamily::V4, "iptables-legacy"),
                (IpFamily::V6, "ip6tables-legacy"),
            ] {
                sh(&format!(
                    "{tool} -t nat -N KUBE-T && {tool} -t nat -A OUTPUT -j KUBE-T"
                ));
                let read = || LegacyNatSize.read(family).expect("legacy nat readable");
                let before = read();
                assert_eq!(read(), before, "{tool}: nothing changed");
                sh(&format!("{tool} -t nat -A KUBE-T -j RETURN"));
                let added = read();
                assert_eq!(added.entries, before.entries + 1, "{tool}: one rule added");
                // Counters are not a change; a rule replaced by another of the same size is.
                sh(&format!("{tool} -t nat -Z"));
                assert_eq!(read(), added, "{tool}: counters zeroed");
                sh(&format!("{tool} -t nat -F"));
                let flushed = read();
                assert_eq!(flushed.entries, before.entries - 1, "{tool}: flushed");
                assert_ne!(flushed, before, "{tool}");
            }
        },
    );
}

#[test]
fn one_save_of_every_table_reads_as_a_save_of_each() {
    in_netns(
        "one_save_of_every_table_reads_as_a_save_of_each",
        &["iptables-save"],
        || {
            block_on(async {
                use kp_dataplane::exec::RuleRunner as _;
                use kp_rules::iptables::Table;
                sh(
                    "iptables -t nat -N KUBE-T && iptables -t nat -A OUTPUT -j KUBE-T && \
                    iptables -N KUBE-F && iptables -A INPUT -m comment --comment 'a b' -j KUBE-F && \
                    iptables -t mangle -N OTHER",
                );
                let runner = ExecRunner::new(Tools::default());
                let tables = [Table::Nat, Table::Filter];
                let together = runner
                    .save_tables(IpFamily::V4, &tables)
                    .await
                    .expect("saves");
                for table in tables {
                    let alone = runner.save(IpFamily::V4, table).await.expect("saves");
                    let body = |text: &str| -> Vec<String> {
                        text.lines()
                            .filter(|l| !l.starts_with('#'))
                            .map(str::to_owned)
                            .collect()
                    };
                    assert_eq!(body(&together[&table]), body(&alone), "{table:?}");
                    assert!(together[&table].contains("-j KUBE-"), "{together:?}");
                }
            });
        },
    );
}

#[test]
fn interface_addresses_are_read_over_rtnetlink() {
    in_netns("interface_addresses_are_read_over_rtnetlink", &[], || {
        sh(
            "ip link set lo up && ip link add kp-test0 type veth peer name kp-test1 && \
            ip link set kp-test0 up && \
            ip addr add 10.1.2.3/24 dev kp-test0 && ip addr add 10.1.2.4/32 dev kp-test0 && \
            ip addr add fd00:1::3/64 dev kp-test0 nodad && \
            ip addr add 10.9.0.1 peer 10.9.0.2 dev kp-test0",
        );
        let read = block_on(kp_dataplane::interfaces::interface_addresses()).expect("dump");
        let read: Vec<(String, String)> = read
            .into_iter()
            .map(|a| (a.device, a.ip.to_string()))
            .collect();
        // `ip -o addr show`, read independently: `2: kp-test0    inet 10.1.2.3/24 ...`.
        let shown: Vec<(String, String)> = sh("ip -o addr show")
            .lines()
            .filter_map(|line| {
                let words: Vec<&str> = line.split_whitespace().collect();
                let at = words.iter().position(|w| *w == "inet" || *w == "inet6")?;
                let ip = words.get(at + 1)?.split('/').next()?;
                Some((words.get(1)?.to_string(), ip.to_owned()))
            })
            .collect();
        assert_eq!(read, shown);
        assert!(
            read.contains(&("kp-test0".to_owned(), "10.9.0.1".to_owned())),
            "a point-to-point address is the local one: {read:?}"
        );
        assert!(read.contains(&("kp-test0".to_owned(), "fd00:1::3".to_owned())));
    });
}
