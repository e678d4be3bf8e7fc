//! The backend against the fake runner: sync kinds, empty scripts, failure handling, stale
//! chain deletion, adoption of a previous table, metrics, conntrack and cleanup.

use std::collections::BTreeSet;
use std::time::Duration;

use kp_core::backend::{Backend, SyncKind};
use kp_core::model::{IpFamily, Protocol, ServiceName};
use kp_core::tracker::ProxyState;
use kp_rules::nftables::names::{EndpointNames, ServiceChains};
use kp_rules::nftables::{RenderConfig, SERVICE_IPS};
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;

use super::*;
use crate::conntrack::conntrack_relevant;
use crate::conntrack::{FakeConntrack, FlowFilter};
use crate::testutil::*;

type Fake = NftablesBackend<FakeNft, FakeConntrack>;

mod verify;

fn backend(families: Vec<IpFamily>) -> (Fake, FakeNft, FakeConntrack) {
    let runner = FakeNft::new();
    let conntrack = FakeConntrack::new();
    let backend = NftablesBackend::with_parts(
        NftablesConfig::new(families, RenderConfig::default()),
        runner.clone(),
        conntrack.clone(),
    )
    .expect("default config is valid");
    (backend, runner, conntrack)
}

/// `two_services` with `b` moved to another endpoint.
fn b_moved() -> ProxyState {
    let mut state = two_services();
    let name = port_name("ns", "b", "p", Protocol::Tcp);
    state
        .endpoints
        .insert(name, vec![endpoint("10.244.2.9", 8080)]);
    state
}

fn service_chain(name: &str) -> String {
    ServiceChains::new(&port_name("ns", name, "p", Protocol::Tcp)).service
}

fn endpoint_chain(name: &str, ip_text: &str) -> String {
    EndpointNames::new(
        &port_name("ns", name, "p", Protocol::Tcp),
        ip(ip_text),
        8080,
    )
    .chain
}

fn changed(name: &str) -> BTreeSet<ServiceName> {
    BTreeSet::from([service_name("ns", name)])
}

/// Whether `script` writes `chain`'s rules (declares it).
fn writes_chain(script: &str, chain: &str) -> bool {
    script.contains(&format!("add chain ip kube-proxy {chain}\n"))
}

fn deletes_chain(script: &str, chain: &str) -> bool {
    script.contains(&format!("delete chain ip kube-proxy {chain}\n"))
}

fn flushes_chain(script: &str, chain: &str) -> bool {
    script.contains(&format!("flush chain ip kube-proxy {chain}\n"))
}

fn is_full(script: &str) -> bool {
    script.starts_with("add table ip kube-proxy") || script.starts_with("add table ip6 kube-proxy")
}

#[tokio::test]
async fn first_sync_is_full_per_family_and_lists_the_table_first() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    assert_eq!(backend.mode(), "nftables");
    let state = two_services();
    let none = BTreeSet::new();
    // Asked for partial, but the table lacks its fixed part: the renderer writes it all,
    // and the report says so.
    let report = backend
        .sync(&request(&state, SyncKind::Partial, &none, false))
        .await
        .expect("fake succeeds");
    assert_eq!(report.kind, SyncKind::Full);
    assert!(report.rules_written > 0);
    let calls = runner.calls();
    assert_eq!(calls.len(), 4, "{calls:?}");
    // IPv6 (no services here) first: the smaller table is synced before the larger one
    // makes every `nft` run list its chains.
    assert_eq!(calls[0], NftCall::List(IpFamily::V6));
    assert!(matches!(calls[1], NftCall::Apply(_)));
    assert_eq!(calls[2], NftCall::List(IpFamily::V4));
    let scripts = runner.scripts();
    assert_eq!(scripts.len(), 2, "one transaction per family");
    let v4 = &scripts[1];
    assert!(is_full(v4), "{v4}");
    assert!(writes_chain(v4, &service_chain("a")));
    assert!(writes_chain(v4, &service_chain("b")));
    // No table yet (the fake lists none): new chains are created empty, nothing to flush.
    assert!(!flushes_chain(v4, &service_chain("a")), "{v4}");
    assert!(
        !flushes_chain(v4, &endpoint_chain("a", "10.244.1.1")),
        "{v4}"
    );
    assert!(
        v4.contains(&format!(
            "add element ip kube-proxy {SERVICE_IPS} {{ 10.96.0.1 . tcp . 80"
        )),
        "{v4}"
    );
    // IPv6 gets its table, without the IPv4 services.
    assert!(scripts[0].starts_with("add table ip6 kube-proxy"));
    assert!(!scripts[0].contains("10.96.0.1"));
    assert!(
        backend
            .installed(IpFamily::V4)
            .expect("synced")
            .is_initialized()
    );
}

#[tokio::test]
async fn a_change_is_a_partial_sync_of_the_changed_service_only() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Full, &none).await;
    runner.clear_calls();
    sync(&mut backend, &b_moved(), SyncKind::Partial, &changed("b")).await;
    let scripts = runner.scripts();
    assert_eq!(scripts.len(), 1);
    let script = &scripts[0];
    assert!(!is_full(script), "{script}");
    assert!(
        writes_chain(script, &endpoint_chain("b", "10.244.2.9")),
        "{script}"
    );
    assert!(!writes_chain(script, &service_chain("a")), "{script}");
    // The old endpoint chain is only flushed: deleted a second later at the earliest.
    let old = endpoint_chain("b", "10.244.1.2");
    assert!(flushes_chain(script, &old), "{script}");
    assert!(!deletes_chain(script, &old), "{script}");
    // No listing after the first sync.
    assert!(
        runner
            .calls()
            .iter()
            .all(|c| matches!(c, NftCall::Apply(_)))
    );
}

#[tokio::test]
async fn an_idle_partial_sync_applies_nothing() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    let state = two_services();
    let none = BTreeSet::new();
    sync(&mut backend, &state, SyncKind::Full, &none).await;
    runner.clear_calls();
    let report = backend
        .sync(&request(&state, SyncKind::Partial, &none, false))
        .await
        .expect("nothing to do");
    assert_eq!(report.rules_written, 0);
    assert!(runner.calls().is_empty(), "{:?}", runner.calls());
    // A full sync is applied even when nothing changed.
    sync(&mut backend, &state, SyncKind::Full, &none).await;
    assert_eq!(runner.scripts().len(), 2);
}

#[tokio::test]
async fn a_failed_transaction_keeps_the_state() {
    let mut registry = Registry::default();
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let mut backend = backend.with_metrics(NftablesMetrics::register(&mut registry));
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Full, &none).await;
    let before = backend.installed(IpFamily::V4).cloned();
    runner.fail_next(1);
    let err = backend
        .sync(&request(
            &b_moved(),
            SyncKind::Partial,
            &changed("b"),
            false,
        ))
        .await
        .expect_err("injected failure");
    assert!(
        matches!(tool_error(&err, "nft -f - (ip kube-proxy)"), Some(ExecError::Failed { stderr, .. }) if stderr.contains("Device or resource busy")),
        "{err:?}"
    );
    assert_eq!(backend.installed(IpFamily::V4).cloned(), before);
    assert_eq!(backend.metrics.sync_failures.get(), 1);
    runner.clear_calls();
    // After a failure the core asks for a full sync.
    sync(&mut backend, &b_moved(), SyncKind::Full, &changed("b")).await;
    let scripts = runner.scripts();
    assert_eq!(scripts.len(), 1);
    assert!(is_full(&scripts[0]), "{}", scripts[0]);
    assert_eq!(backend.metrics.sync_failures.get(), 1);
}

#[tokio::test]
async fn one_family_failing_still_programs_the_other() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    runner.fail_when(|script| script.starts_with("add table ip kube-proxy"));
    let none = BTreeSet::new();
    let err = backend
        .sync(&request(&two_services(), SyncKind::Full, &none, false))
        .await
        .expect_err("IPv4 fails");
    assert!(
        tool_error(&err, "nft -f - (ip kube-proxy)").is_some(),
        "{err:?}"
    );
    assert_eq!(runner.scripts().len(), 2, "IPv6 still applied");
    assert!(
        !backend
            .installed(IpFamily::V4)
            .expect("known")
            .is_initialized()
    );
    assert!(
        backend
            .installed(IpFamily::V6)
            .expect("known")
            .is_initialized()
    );
}

#[tokio::test]
async fn stale_chains_are_deleted_only_by_a_later_sync_after_the_delay() {
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let mut backend = backend.with_stale_chain_delay(Duration::from_secs(3600));
    let none = BTreeSet::new();
    let both = two_services();
    sync(&mut backend, &both, SyncKind::Full, &none).await;
    // b is deleted: its chains are flushed, not deleted.
    let mut only_a = both.clone();
    only_a
        .services
        .remove(&port_name("ns", "b", "p", Protocol::Tcp));
    only_a
        .endpoints
        .remove(&port_name("ns", "b", "p", Protocol::Tcp));
    runner.clear_calls();
    sync(&mut backend, &only_a, SyncKind::Partial, &changed("b")).await;
    let script = &runner.scripts()[0];
    let stale = [service_chain("b"), endpoint_chain("b", "10.244.1.2")];
    for chain in &stale {
        assert!(flushes_chain(script, chain), "{script}");
        assert!(!deletes_chain(script, chain), "{script}");
    }
    let pending: BTreeSet<String> = stale.iter().cloned().collect();
    assert_eq!(
        backend
            .installed(IpFamily::V4)
            .expect("synced")
            .pending_deletions(),
        &pending
    );
    // Not due yet: an idle sync stays empty, a full one does not delete them either.
    runner.clear_calls();
    sync(&mut backend, &only_a, SyncKind::Partial, &none).await;
    assert!(runner.scripts().is_empty());
    sync(&mut backend, &only_a, SyncKind::Full, &none).await;
    assert!(
        stale
            .iter()
            .all(|chain| !deletes_chain(&runner.scripts()[0], chain))
    );

    // Once due, the next sync (even an otherwise idle one) deletes them.
    backend.stale_delay = Duration::ZERO;
    runner.clear_calls();
    sync(&mut backend, &only_a, SyncKind::Partial, &none).await;
    let scripts = runner.scripts();
    assert_eq!(scripts.len(), 1);
    for chain in &stale {
        assert!(deletes_chain(&scripts[0], chain), "{}", scripts[0]);
    }
    assert!(
        backend
            .installed(IpFamily::V4)
            .expect("synced")
            .pending_deletions()
            .is_empty()
    );
    runner.clear_calls();
    sync(&mut backend, &only_a, SyncKind::Partial, &none).await;
    assert!(runner.scripts().is_empty(), "nothing left to do");
}

#[tokio::test]
async fn a_stale_chain_needed_again_is_refilled_not_deleted() {
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let mut backend = backend.with_stale_chain_delay(Duration::ZERO);
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Full, &none).await;
    sync(&mut backend, &b_moved(), SyncKind::Partial, &changed("b")).await;
    // b moves back before the flushed chain was deleted.
    runner.clear_calls();
    sync(
        &mut backend,
        &two_services(),
        SyncKind::Partial,
        &changed("b"),
    )
    .await;
    let script = &runner.scripts()[0];
    let back = endpoint_chain("b", "10.244.1.2");
    assert!(writes_chain(script, &back), "{script}");
    assert!(!deletes_chain(script, &back), "{script}");
}

#[tokio::test]
async fn a_failed_stale_chain_deletion_is_retried_without_it_and_counted() {
    let mut registry = Registry::default();
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let mut backend = backend
        .with_stale_chain_delay(Duration::ZERO)
        .with_metrics(NftablesMetrics::register(&mut registry));
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Full, &none).await;
    sync(&mut backend, &b_moved(), SyncKind::Partial, &changed("b")).await;
    let old = endpoint_chain("b", "10.244.1.2");
    // The kernel refuses to delete the chain (still referenced); everything else works.
    let needle = format!("delete chain ip kube-proxy {old}\n");
    runner.fail_when(move |script| script.contains(&needle));
    runner.clear_calls();
    // Idle otherwise: the retry has nothing to apply.
    sync(&mut backend, &b_moved(), SyncKind::Partial, &none).await;
    assert_eq!(runner.scripts().len(), 1);
    assert_eq!(backend.metrics.cleanup_failures.get(), 1);
    // With a change in the same sync, the change is applied without the deletion.
    let mut a_moved = b_moved();
    a_moved.endpoints.insert(
        port_name("ns", "a", "p", Protocol::Tcp),
        vec![endpoint("10.244.3.3", 8080)],
    );
    runner.clear_calls();
    sync(&mut backend, &a_moved, SyncKind::Partial, &changed("a")).await;
    let scripts = runner.scripts();
    assert_eq!(scripts.len(), 2, "the deletion, then the sync without it");
    assert!(deletes_chain(&scripts[0], &old));
    assert!(!deletes_chain(&scripts[1], &old));
    assert!(writes_chain(
        &scripts[1],
        &endpoint_chain("a", "10.244.3.3")
    ));
    assert_eq!(backend.metrics.cleanup_failures.get(), 2);
    assert_eq!(backend.metrics.sync_failures.get(), 0);
    assert!(
        backend
            .installed(IpFamily::V4)
            .expect("synced")
            .pending_deletions()
            .contains(&old),
        "still pending"
    );
    // When the deletion works again, it happens.
    runner.fail_when(|_| false);
    runner.clear_calls();
    sync(&mut backend, &a_moved, SyncKind::Partial, &none).await;
    assert!(deletes_chain(&runner.scripts()[0], &old));
}

#[tokio::test]
async fn a_failed_sync_with_deletions_fails_when_the_retry_fails_too() {
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let mut backend = backend.with_stale_chain_delay(Duration::ZERO);
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Full, &none).await;
    sync(&mut backend, &b_moved(), SyncKind::Partial, &changed("b")).await;
    let before = backend.installed(IpFamily::V4).cloned();
    runner.fail_next(2);
    let mut a_moved = b_moved();
    a_moved.endpoints.insert(
        port_name("ns", "a", "p", Protocol::Tcp),
        vec![endpoint("10.244.3.3", 8080)],
    );
    backend
        .sync(&request(&a_moved, SyncKind::Partial, &changed("a"), false))
        .await
        .expect_err("both attempts fail");
    assert_eq!(backend.installed(IpFamily::V4).cloned(), before);
    assert_eq!(backend.metrics.cleanup_failures.get(), 0);
    assert_eq!(backend.metrics.sync_failures.get(), 1);
}

#[tokio::test]
async fn a_restart_adopts_the_previous_table() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    let gone = "service-ABCDEFGH-ns/gone/tcp/p";
    let gone_set = "affinity-ABCDEFGH-ns/gone/tcp/p__10.244.9.9/80";
    let in_use = endpoint_chain("a", "10.244.1.1");
    runner.set_listing(
        IpFamily::V4,
        format!(
            "table ip kube-proxy {{\n\tcomment \"rules for kube-proxy\"\n\
             \tset {gone_set} {{\n\t\ttype ipv4_addr\n\t}}\n\n\
             \tmap service-ips {{\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n\t}}\n\n\
             \tchain nat-prerouting {{\n\t\ttype nat hook prerouting priority dstnat; policy accept;\n\t}}\n\n\
             \tchain {in_use} {{\n\t}}\n\n\tchain {gone} {{\n\t}}\n}}\n"
        ),
    );
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Partial, &none).await;
    let script = &runner.scripts()[0];
    assert!(
        is_full(script),
        "nothing known about the table's fixed part"
    );
    assert!(writes_chain(script, &in_use), "{script}");
    assert!(
        flushes_chain(script, &in_use),
        "it has rules already: {script}"
    );
    assert!(
        !flushes_chain(script, &service_chain("a")),
        "not in the listing: {script}"
    );
    assert!(flushes_chain(script, gone), "{script}");
    assert!(!deletes_chain(script, gone), "deleted later: {script}");
    assert!(
        script.contains(&format!("delete set ip kube-proxy {gone_set}\n")),
        "{script}"
    );
    assert!(
        backend
            .installed(IpFamily::V4)
            .expect("synced")
            .pending_deletions()
            .contains(gone)
    );
}

#[tokio::test]
async fn a_listing_failure_still_syncs() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    runner.fail_listing();
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Full, &none).await;
    let script = &runner.scripts()[0];
    assert!(is_full(script));
    // The table's chains are unknown, so every chain written is flushed first.
    assert!(flushes_chain(script, &service_chain("a")), "{script}");
    assert!(flushes_chain(script, &endpoint_chain("a", "10.244.1.1")));
}

#[test]
fn listings_are_parsed_into_chains_and_sets() {
    let text = "table ip kube-proxy {\n\tcomment \"rules for kube-proxy\"\n\
                \tset cluster-ips {\n\t\ttype ipv4_addr\n\t}\n\
                \tmap service-ips {\n\t\ttype ipv4_addr . inet_proto . inet_service : verdict\n\
                \t\telements = { 10.0.0.1 . tcp . 80 : goto service-X-ns/a/tcp/p }\n\t}\n\
                \tchain services {\n\t\tip daddr . meta l4proto . th dport vmap @service-ips\n\t}\n\
                \tchain \"odd name\" {\n\t}\n}\n";
    let (chains, sets) = parse_listing(text);
    assert_eq!(chains, ["services", "odd name"]);
    assert_eq!(
        sets,
        [
            ("cluster-ips".to_owned(), None),
            ("service-ips".to_owned(), None)
        ]
    );
}

#[test]
fn listings_give_set_timeouts_in_seconds() {
    let set = |name: &str, timeout: &str| {
        format!(
            "\tset {name} {{\n\t\ttype ipv4_addr\n\t\tflags dynamic,timeout\n\
             \t\ttimeout {timeout}\n\t}}\n"
        )
    };
    let text = format!(
        "table ip kube-proxy {{\n{}{}{}{}{}\tchain c {{\n\t}}\n}}\n",
        set("a", "1m"),
        set("b", "1d3h46m40s"),
        set("c", "60s"),
        set("d", "1s500ms"),
        "\tset e {\n\t\ttype ipv4_addr\n\t}\n",
    );
    let (chains, sets) = parse_listing(&text);
    assert_eq!(chains, ["c"]);
    let expected: Vec<(String, Option<u64>)> = [
        ("a", Some(60)),
        ("b", Some(100_000)),
        ("c", Some(60)),
        ("d", None),
        ("e", None),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_owned(), t))
    .collect();
    assert_eq!(sets, expected);
}

#[test]
fn invalid_render_config_is_rejected_up_front() {
    let config = NftablesConfig::new(
        vec![IpFamily::V4],
        RenderConfig {
            masquerade_bit: 40,
            ..RenderConfig::default()
        },
    );
    assert!(NftablesBackend::with_parts(config, FakeNft::new(), FakeConntrack::new()).is_err());
}

#[tokio::test]
async fn metrics_have_upstream_names() {
    let mut registry = Registry::default();
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let mut backend = backend.with_metrics(NftablesMetrics::register(&mut registry));
    runner.fail_next(1);
    let none = BTreeSet::new();
    let _ = backend
        .sync(&request(&two_services(), SyncKind::Full, &none, false))
        .await;
    let mut text = String::new();
    encode(&mut text, &registry).expect("encoding into a String cannot fail");
    let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        samples,
        [
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total 1",
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total 0",
            "kube_proxy_rs_nftables_netlink_fallbacks_total 0",
        ],
        "{text}"
    );
    assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_nftables_sync_failures counter"));
}

// --- conntrack ---------------------------------------------------------------------------

fn udp_dns(endpoints: &[&str]) -> ProxyState {
    let svc = service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53);
    let eps = endpoints.iter().map(|e| endpoint(e, 5353)).collect();
    state(vec![(svc, eps)])
}

#[tokio::test]
async fn stale_udp_entries_are_deleted_as_in_iptables_mode() {
    let (mut backend, _, conntrack) = backend(vec![IpFamily::V4]);
    let none = BTreeSet::new();
    let before = udp_dns(&["10.244.1.5", "10.244.2.6"]);
    backend
        .sync(&request(&before, SyncKind::Full, &none, true))
        .await
        .expect("fake succeeds");
    assert!(conntrack.deleted().is_empty(), "first sync deletes nothing");
    let after = udp_dns(&["10.244.1.5"]);
    let dns = BTreeSet::from([service_name("kube-system", "dns")]);
    backend
        .sync(&request(&after, SyncKind::Partial, &dns, true))
        .await
        .expect("fake succeeds");
    let expected = crate::conntrack::stale_flows(
        &conntrack_relevant(&before),
        &after,
        Some(&dns),
        &[IpFamily::V4],
    );
    assert!(!expected.is_empty());
    assert_eq!(conntrack.deleted(), expected);
    // The partial sync refreshed only the changed service, to the same result as a copy of
    // everything.
    assert_eq!(backend.sync.programmed(), Some(&conntrack_relevant(&after)));
    assert!(conntrack.deleted().contains(&FlowFilter {
        family: IpFamily::V4,
        protocol: Protocol::Udp,
        orig_dst: Some(ip("10.96.0.10")),
        orig_dst_port: Some(53),
        reply_src: Some(ip("10.244.2.6")),
        reply_src_port: Some(5353),
    }));
}

#[tokio::test]
async fn partial_syncs_refresh_only_changed_services_for_conntrack() {
    let (mut backend, _, _) = backend(vec![IpFamily::V4]);
    let none = BTreeSet::new();
    let dns = |eps: &[&str]| {
        let svc = service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53);
        (svc, eps.iter().map(|e| endpoint(e, 5353)).collect())
    };
    let syslog = |eps: &[&str]| {
        let svc = service("logs", "syslog", Protocol::Udp, "10.96.0.11", 514);
        (svc, eps.iter().map(|e| endpoint(e, 514)).collect())
    };
    let web = || {
        let svc = service("default", "web", Protocol::Tcp, "10.96.0.12", 80);
        (svc, vec![endpoint("10.244.3.1", 8080)])
    };
    let before = state(vec![dns(&["10.244.1.5"]), syslog(&["10.244.4.1"]), web()]);
    backend
        .sync(&request(&before, SyncKind::Full, &none, true))
        .await
        .expect("fake succeeds");
    assert_eq!(
        backend.sync.programmed(),
        Some(&conntrack_relevant(&before))
    );
    // dns changes, syslog goes, web (TCP, never relevant) stays.
    let after = state(vec![dns(&["10.244.1.6"]), web()]);
    let changed = BTreeSet::from([
        service_name("kube-system", "dns"),
        service_name("logs", "syslog"),
    ]);
    backend
        .sync(&request(&after, SyncKind::Partial, &changed, true))
        .await
        .expect("fake succeeds");
    assert_eq!(backend.sync.programmed(), Some(&conntrack_relevant(&after)));
}

#[tokio::test]
async fn a_failed_sync_deletes_no_conntrack_entries() {
    let (mut backend, runner, conntrack) = backend(vec![IpFamily::V4]);
    let none = BTreeSet::new();
    let before = udp_dns(&["10.244.1.5", "10.244.2.6"]);
    backend
        .sync(&request(&before, SyncKind::Full, &none, true))
        .await
        .expect("fake succeeds");
    runner.fail_next(1);
    let after = udp_dns(&["10.244.1.5"]);
    let dns = BTreeSet::from([service_name("kube-system", "dns")]);
    backend
        .sync(&request(&after, SyncKind::Partial, &dns, true))
        .await
        .expect_err("injected");
    assert!(conntrack.deleted().is_empty());
    // The retry (full) compares against the last programmed state and cleans then.
    backend
        .sync(&request(&after, SyncKind::Partial, &dns, true))
        .await
        .expect("fake succeeds");
    assert!(!conntrack.deleted().is_empty());
}

// --- cleanup ------------------------------------------------------------------------------

#[tokio::test]
async fn cleanup_deletes_each_familys_table_even_when_absent() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    let none = BTreeSet::new();
    sync(&mut backend, &two_services(), SyncKind::Full, &none).await;
    runner.clear_calls();
    backend.cleanup().await.expect("fake succeeds");
    assert_eq!(
        runner.scripts(),
        [
            "add table ip kube-proxy\ndelete table ip kube-proxy\n",
            "add table ip6 kube-proxy\ndelete table ip6 kube-proxy\n",
        ]
    );
    // The next sync starts over: lists the table again and writes it fully (its fixed
    // part is gone), even when asked for a partial one.
    runner.clear_calls();
    sync(&mut backend, &two_services(), SyncKind::Partial, &none).await;
    assert_eq!(runner.calls()[0], NftCall::List(IpFamily::V6));
    assert!(is_full(&runner.scripts()[0]));
    assert!(is_full(&runner.scripts()[1]));
}

#[tokio::test]
async fn cleanup_reports_a_failure_but_tries_every_family() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    runner.script_applies([true, false]);
    let err = backend.cleanup().await.expect_err("IPv4 fails");
    assert!(
        tool_error(&err, "nftables cleanup (ip kube-proxy)").is_some(),
        "{err:?}"
    );
    assert_eq!(runner.scripts().len(), 2);
}

#[tokio::test]
async fn service_cidrs_of_the_state_drop_unallocated_cluster_ips() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    let mut state = two_services();
    let none = BTreeSet::new();
    sync(&mut backend, &state, SyncKind::Full, &none).await;
    assert!(
        !runner
            .scripts()
            .concat()
            .contains("Drop traffic to unallocated ClusterIPs")
    );

    // A ServiceCIDR appears: each family's table gets its own range, in a full sync (the
    // fixed part changed) although the core asked for a partial one.
    state.service_cidrs = vec![
        "10.96.0.0/16".parse().expect("literal"),
        "fd00:96::/112".parse().expect("literal"),
    ];
    runner.clear_calls();
    sync(&mut backend, &state, SyncKind::Partial, &none).await;
    let scripts = runner.scripts();
    let v4 = scripts.iter().find(|s| s.contains("table ip kube-proxy"));
    let v6 = scripts.iter().find(|s| s.contains("table ip6 kube-proxy"));
    assert!(
        v4.is_some_and(|s| is_full(s)
            && s.contains("ip daddr { 10.96.0.0/16 } drop")
            && !s.contains("fd00:96::")),
        "{scripts:?}"
    );
    assert!(
        v6.is_some_and(|s| s.contains("ip6 daddr { fd00:96::/112 } drop")),
        "{scripts:?}"
    );
}
