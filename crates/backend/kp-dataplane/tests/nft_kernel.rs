//! nftables mode with the real `nft` against a real kernel, each test inside its own
//! throwaway network namespace (the approach of `kernel.rs`: the test binary re-executes
//! itself as `unshare -n <binary> --exact <test>`, the child refuses to run in its parent's
//! or PID 1's namespace, and the kernel drops every table with the namespace).
//!
//! Without root, `unshare` or `nft` the tests are skipped with a message, unless `CI` or
//! `KP_REQUIRE_KERNEL_TESTS=1` is set, which makes that a failure.

use crate::nft_tools;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use kp_core::backend::{ApplyError, Backend, SyncKind};
use kp_core::model::{IpFamily, Protocol, SessionAffinity};
use kp_core::tracker::ProxyState;
use kp_dataplane::exec::ExecError;
use kp_dataplane::nftables::{NftablesBackend, NftablesConfig, NftablesMetrics};
use kp_dataplane::testutil::*;
use kp_rules::nftables::RenderConfig;
use kp_rules::nftables::names::{EndpointNames, ServiceChains};
use kp_testbed::isolated;
use nft_tools::{nft, unavailable};
use prometheus_client::registry::Registry;

/// Longer than the backend's stale-chain delay.
const AFTER_STALE_DELAY: Duration = Duration::from_millis(1100);

/// Run `body` in a fresh network namespace (`kp_testbed::isolated`). `name` must be the test
/// function's name.
fn in_netns(name: &str, body: impl FnOnce()) {
    isolated::run(name, unavailable, body);
}

fn list(family: &str) -> String {
    nft(&["list", "table", family, "kube-proxy"])
}

/// Chain name -> (handle, number of rules), from `nft -a list table ip kube-proxy`.
fn chains_with_handles() -> BTreeMap<String, (u64, usize)> {
    let text = nft(&["-a", "list", "table", "ip", "kube-proxy"]);
    let mut out = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("chain ") {
            // `chain NAME { # handle N`
            let name = rest
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned();
            let handle = rest
                .rsplit("# handle ")
                .next()
                .and_then(|h| h.trim().parse().ok())
                .expect("chain handle");
            out.insert(name.clone(), (handle, 0));
            current = Some(name);
        } else if line == "}" {
            current = None;
        } else if let Some(name) = &current
            && line.contains("# handle ")
            && !line.starts_with("type ")
            && let Some(entry) = out.get_mut(name)
        {
            entry.1 += 1;
        }
    }
    out
}

/// The first line of `nft -a list table ip kube-proxy`: `table ip kube-proxy { # handle N`.
fn table_handle() -> String {
    let text = nft(&["-a", "list", "table", "ip", "kube-proxy"]);
    let first = text.lines().next().unwrap_or_default().to_owned();
    assert!(first.contains("# handle "), "{first}");
    first
}

fn backend() -> NftablesBackend {
    NftablesBackend::new(NftablesConfig::new(
        vec![IpFamily::V4],
        RenderConfig::default(),
    ))
    .expect("valid config")
}

fn port(name: &str) -> kp_core::model::ServicePortName {
    port_name("ns", name, "p", Protocol::Tcp)
}

/// Services `a` (10.96.0.1) and `b` (10.96.0.2), with the given endpoints.
fn services(a_endpoint: &str, b_endpoint: &str) -> ProxyState {
    state(vec![
        (
            service("ns", "a", Protocol::Tcp, "10.96.0.1", 80),
            vec![endpoint(a_endpoint, 8080)],
        ),
        (
            service("ns", "b", Protocol::Tcp, "10.96.0.2", 80),
            vec![endpoint(b_endpoint, 8080)],
        ),
    ])
}

fn endpoint_chain(name: &str, ip_text: &str) -> String {
    EndpointNames::new(&port(name), ip(ip_text), 8080).chain
}

#[test]
fn full_sync_creates_the_table_and_partial_syncs_update_it() {
    in_netns(
        "full_sync_creates_the_table_and_partial_syncs_update_it",
        || {
            block_on(async {
                let mut backend = backend();
                let none = BTreeSet::new();
                let first = services("10.244.1.1", "10.244.1.2");
                backend
                    .sync(&request(&first, SyncKind::Partial, &none, false))
                    .await
                    .expect("full sync applies");
                let table = list("ip");
                let a_chain = ServiceChains::new(&port("a")).service;
                assert!(
                    table.contains(&format!("10.96.0.1 . tcp . 80 : goto {a_chain}")),
                    "{table}"
                );
                assert!(table.contains("dnat to 10.244.1.1:8080"), "{table}");
                assert!(table.contains("chain nat-prerouting"), "{table}");

                // b's endpoint moves: a partial sync; the old chain is flushed ...
                let second = services("10.244.1.1", "10.244.2.2");
                let changed = BTreeSet::from([service_name("ns", "b")]);
                backend
                    .sync(&request(&second, SyncKind::Partial, &changed, false))
                    .await
                    .expect("partial sync applies");
                let old = endpoint_chain("b", "10.244.1.2");
                let chains = chains_with_handles();
                assert_eq!(chains.get(&old).map(|c| c.1), Some(0), "{chains:?}");
                let table = list("ip");
                assert!(table.contains("dnat to 10.244.2.2:8080"), "{table}");
                assert!(!table.contains("dnat to 10.244.1.2"), "{table}");
                // ... and deleted by a sync at least a second later.
                std::thread::sleep(AFTER_STALE_DELAY);
                backend
                    .sync(&request(&second, SyncKind::Partial, &none, false))
                    .await
                    .expect("deletion applies");
                assert!(!chains_with_handles().contains_key(&old));
            });
        },
    );
}

#[test]
fn a_restart_adopts_the_table_and_changes_only_what_differs() {
    in_netns(
        "a_restart_adopts_the_table_and_changes_only_what_differs",
        || {
            block_on(async {
                let none = BTreeSet::new();
                let before = with_affinity_on_a(services("10.244.1.1", "10.244.1.2"));
                backend()
                    .sync(&request(&before, SyncKind::Full, &none, false))
                    .await
                    .expect("first process syncs");
                // A client pinned to a's endpoint by ClientIP affinity.
                let pinned = EndpointNames::new(&port("a"), ip("10.244.1.1"), 8080).affinity_set;
                nft(&[
                    "add",
                    "element",
                    "ip",
                    "kube-proxy",
                    &pinned,
                    "{ 10.1.2.3 }",
                ]);
                let old_chains = chains_with_handles();
                let handle_before = table_handle();

                // A new process, while b moved: it adopts what the first one left.
                let after = with_affinity_on_a(services("10.244.1.1", "10.244.2.2"));
                let mut restarted = backend();
                restarted
                    .sync(&request(&after, SyncKind::Partial, &none, false))
                    .await
                    .expect("restarted process syncs");
                let new_chains = chains_with_handles();
                assert_eq!(table_handle(), handle_before, "the table is kept");
                // The affinity set still in use was kept, and with it the pinned client.
                let set = nft(&["list", "set", "ip", "kube-proxy", &pinned]);
                assert!(set.contains("timeout 1m"), "{set}");
                assert!(set.contains("10.1.2.3"), "pinned client lost: {set}");
                nft(&[
                    "delete",
                    "element",
                    "ip",
                    "kube-proxy",
                    &pinned,
                    "{ 10.1.2.3 }",
                ]);
                // Every per-service chain still in use is the same kernel object (same
                // handle), with the same number of rules: kept, not re-created. (The base
                // chains are re-created once per process, to apply changed priorities.)
                let stale = endpoint_chain("b", "10.244.1.2");
                for (name, (handle, rules)) in &old_chains {
                    if *name == stale || !name.contains('/') {
                        continue;
                    }
                    assert_eq!(
                        new_chains.get(name),
                        Some(&(*handle, *rules)),
                        "{name} changed: {old_chains:?} -> {new_chains:?}"
                    );
                }
                // The chain no longer needed was flushed, the new one added.
                assert_eq!(new_chains.get(&stale).map(|c| c.1), Some(0));
                let moved = endpoint_chain("b", "10.244.2.2");
                assert!(new_chains.get(&moved).is_some_and(|c| c.1 > 0));
                std::thread::sleep(AFTER_STALE_DELAY);
                restarted
                    .sync(&request(&after, SyncKind::Partial, &none, false))
                    .await
                    .expect("deletion applies");
                assert!(!chains_with_handles().contains_key(&stale));

                // The result is what a fresh process on a clean node writes.
                let adopted = sorted_lines(&list("ip"));
                nft(&["delete", "table", "ip", "kube-proxy"]);
                backend()
                    .sync(&request(&after, SyncKind::Full, &none, false))
                    .await
                    .expect("fresh sync");
                assert_eq!(adopted, sorted_lines(&list("ip")));
            });
        },
    );
}

/// `state` with ClientIP affinity (60 s) on service `a`.
fn with_affinity_on_a(mut state: ProxyState) -> ProxyState {
    let svc = state.services.get_mut(&port("a")).expect("service a");
    svc.session_affinity = Some(SessionAffinity {
        timeout: Duration::from_secs(60),
    });
    state
}

/// A listing's lines, sorted (element order is the kernel's).
fn sorted_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text.lines().map(|l| l.trim().to_owned()).collect();
    lines.sort();
    lines
}

#[test]
fn a_rejected_transaction_keeps_the_previous_table() {
    in_netns("a_rejected_transaction_keeps_the_previous_table", || {
        block_on(async {
            let mut registry = Registry::default();
            let metrics = NftablesMetrics::register(&mut registry);
            let mut backend = backend().with_metrics(metrics.clone());
            let none = BTreeSet::new();
            // Something else made a set of ours with another type: the kernel rejects the
            // whole transaction.
            nft(&["add", "table", "ip", "kube-proxy"]);
            nft(&[
                "add",
                "set",
                "ip",
                "kube-proxy",
                "cluster-ips",
                "{ type inet_service ; }",
            ]);
            let state = services("10.244.1.1", "10.244.1.2");
            let err = backend
                .sync(&request(&state, SyncKind::Full, &none, false))
                .await
                .expect_err("conflicting set");
            // Over netlink (the default runner): the kernel's error, reported as nft's.
            let Some(ApplyError::Netfilter { what, source }) = err.apply() else {
                panic!("wrong error {err:?}");
            };
            assert_eq!(what, "nft -f - (ip kube-proxy)");
            assert!(
                matches!(source.downcast_ref(), Some(ExecError::Failed { stderr, .. }) if stderr.starts_with("Error")),
                "{source:?}"
            );
            assert_eq!(metrics.sync_failures.get(), 1);
            let table = list("ip");
            assert!(!table.contains("chain"), "nothing applied: {table}");

            nft(&["delete", "set", "ip", "kube-proxy", "cluster-ips"]);
            // After a failure the core asks for a full sync.
            backend
                .sync(&request(&state, SyncKind::Full, &none, false))
                .await
                .expect("full sync after the conflict is gone");
            assert!(list("ip").contains("dnat to 10.244.1.1:8080"));

            // A stale chain that something still jumps to cannot be deleted: counted as a
            // cleanup failure, the sync itself goes through.
            let moved = services("10.244.3.3", "10.244.1.2");
            let changed = BTreeSet::from([service_name("ns", "a")]);
            backend
                .sync(&request(&moved, SyncKind::Partial, &changed, false))
                .await
                .expect("partial sync");
            let stale = endpoint_chain("a", "10.244.1.1");
            nft(&["add", "chain", "ip", "kube-proxy", "foreign"]);
            nft(&["add", "rule", "ip", "kube-proxy", "foreign", "jump", &stale]);
            std::thread::sleep(AFTER_STALE_DELAY);
            let again = services("10.244.3.4", "10.244.1.2");
            backend
                .sync(&request(&again, SyncKind::Partial, &changed, false))
                .await
                .expect("the sync goes through without the deletion");
            assert_eq!(metrics.cleanup_failures.get(), 1);
            assert_eq!(metrics.sync_failures.get(), 1);
            let table = list("ip");
            assert!(table.contains("dnat to 10.244.3.4:8080"), "{table}");
            assert!(chains_with_handles().contains_key(&stale));
        });
    });
}

#[test]
fn cleanup_removes_the_tables_and_is_fine_when_absent() {
    in_netns("cleanup_removes_the_tables_and_is_fine_when_absent", || {
        block_on(async {
            let families = vec![IpFamily::V4, IpFamily::V6];
            let mut backend =
                NftablesBackend::new(NftablesConfig::new(families, RenderConfig::default()))
                    .expect("valid config");
            let mut state = services("10.244.1.1", "10.244.1.2");
            let v6 = service("ns", "web6", Protocol::Udp, "fd00::1", 53);
            state
                .endpoints
                .insert(v6.name.clone(), vec![endpoint("fd00:10::5", 5353)]);
            state.services.insert(v6.name.clone(), v6);
            let none = BTreeSet::new();
            backend
                .sync(&request(&state, SyncKind::Full, &none, false))
                .await
                .expect("both families apply");
            assert!(list("ip6").contains("dnat to [fd00:10::5]:5353"));
            // Tables of others stay.
            nft(&["add", "table", "ip", "other"]);
            backend.cleanup().await.expect("cleanup");
            let tables = nft(&["list", "tables"]);
            assert_eq!(tables.trim(), "table ip other", "{tables}");
            backend.cleanup().await.expect("cleanup of a clean node");
            assert_eq!(nft(&["list", "tables"]), tables);
            // The backend starts over after a cleanup.
            backend
                .sync(&request(&state, SyncKind::Partial, &none, false))
                .await
                .expect("sync after cleanup");
            assert!(list("ip").contains("dnat to 10.244.1.1:8080"));
        });
    });
}
