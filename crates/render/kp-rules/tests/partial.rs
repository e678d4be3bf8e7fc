//! Partial syncs: only changed services' chains are written, stale chains are deleted, and
//! applying full-then-partial leaves the kernel exactly as a full sync of the new state would.

use crate::common;

use std::collections::BTreeSet;

use common::*;
use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, ServiceName};
use kp_core::tracker::ProxyState;
use kp_rules::iptables::names::{ServiceChains, endpoint_chain};
use kp_rules::iptables::{RenderOutput, SyncScope, render, setup};

fn partial(
    state: &ProxyState,
    changed: &[ServiceName],
    existing: &BTreeSet<String>,
) -> RenderOutput {
    let changed: BTreeSet<ServiceName> = changed.iter().cloned().collect();
    render(
        state,
        IpFamily::V4,
        &config(),
        &SyncScope {
            kind: SyncKind::Partial,
            changed: &changed,
            existing_chains: existing,
        },
    )
    .expect("valid config")
}

fn before() -> ProxyState {
    state(vec![
        (
            cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80),
            vec![
                endpoint("10.180.0.1", 80, false),
                endpoint("10.180.0.2", 80, false),
            ],
        ),
        (
            cluster_ip("ns2", "svc2", "p80", "172.30.0.42", 80),
            vec![endpoint("10.180.0.20", 80, false)],
        ),
        (
            cluster_ip("ns3", "svc3", "p80", "172.30.0.43", 80),
            vec![endpoint("10.180.0.30", 80, false)],
        ),
    ])
}

/// svc1's second endpoint moves from .2 to .3; svc3 is deleted; svc2 is untouched.
fn after() -> ProxyState {
    state(vec![
        (
            cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80),
            vec![
                endpoint("10.180.0.1", 80, false),
                endpoint("10.180.0.3", 80, false),
            ],
        ),
        (
            cluster_ip("ns2", "svc2", "p80", "172.30.0.42", 80),
            vec![endpoint("10.180.0.20", 80, false)],
        ),
    ])
}

#[test]
fn partial_sync_writes_only_changed_services_and_deletes_stale_chains() {
    let first = full(&before(), IpFamily::V4, &config());
    let changed = [service_name("ns1", "svc1"), service_name("ns3", "svc3")];
    let second = partial(&after(), &changed, &first.chains);

    let svc1 = port_name("ns1", "svc1", "p80", kp_core::model::Protocol::Tcp);
    let svc2 = port_name("ns2", "svc2", "p80", kp_core::model::Protocol::Tcp);
    let svc3 = port_name("ns3", "svc3", "p80", kp_core::model::Protocol::Tcp);
    let svc1_chain = ServiceChains::new(&svc1).svc;
    let svc2_chain = ServiceChains::new(&svc2).svc;
    let svc2_sep = endpoint_chain(&svc2, ip("10.180.0.20"), 80);
    let old_sep = endpoint_chain(&svc1, ip("10.180.0.2"), 80);
    let new_sep = endpoint_chain(&svc1, ip("10.180.0.3"), 80);
    let kept_sep = endpoint_chain(&svc1, ip("10.180.0.1"), 80);
    let svc3_chain = ServiceChains::new(&svc3).svc;
    let svc3_sep = endpoint_chain(&svc3, ip("10.180.0.30"), 80);
    let text = &second.text;

    // Changed service: rewritten in full.
    for chain in [&svc1_chain, &new_sep, &kept_sep] {
        assert!(
            text.contains(&format!(":{chain} - [0:0]\n")),
            "{chain} not declared:\n{text}"
        );
        assert!(
            text.contains(&format!("-A {chain} ")),
            "{chain} has no rules:\n{text}"
        );
    }
    // Unchanged service: its chains are neither declared nor written, but it stays
    // dispatched from the (fully rewritten) KUBE-SERVICES and counted as present.
    for chain in [&svc2_chain, &svc2_sep] {
        assert!(
            !text.contains(&format!(":{chain} ")),
            "{chain} rewritten:\n{text}"
        );
        assert!(
            !text.contains(&format!("-A {chain} ")),
            "{chain} rewritten:\n{text}"
        );
        assert!(second.chains.contains(chain));
    }
    assert!(text.contains(&format!("-j {svc2_chain}\n")));

    // Stale chains: flushed by declaration, then deleted.
    let stale: BTreeSet<String> = [old_sep, svc3_chain, svc3_sep].into_iter().collect();
    assert_eq!(second.deleted, stale);
    for chain in &stale {
        assert!(text.contains(&format!(":{chain} - [0:0]\n")), "{text}");
        assert!(text.contains(&format!("-X {chain}\n")), "{text}");
        assert!(!second.chains.contains(chain));
    }

    // Bookkeeping matches a full render of the new state.
    let reference = full(&after(), IpFamily::V4, &config());
    assert_eq!(second.chains, reference.chains);
    assert_eq!(second.nat_rules, reference.nat_rules);
    assert_eq!(second.filter_rules, reference.filter_rules);
    assert!(second.rules_written < reference.rules_written);

    // The kernel agrees: full(before) + partial(after) == full(after).
    let tool = restore_tool(IpFamily::V4);
    if let Some(reason) = netns_unavailable(tool) {
        eprintln!("skipping kernel check: {reason}");
        return;
    }
    let setup = setup_text(&setup(IpFamily::V4, &config()));
    let incremental = apply_in_netns(tool, &[&setup, &first.text, &second.text])
        .unwrap_or_else(|e| panic!("partial restore failed: {e}\n{}", second.text));
    let direct = apply_in_netns(tool, &[&setup, &reference.text])
        .unwrap_or_else(|e| panic!("full restore failed: {e}"));
    let direct = ruleset(&direct);
    // Not vacuous: the untouched service's chain survived with its two rules.
    let key = ("nat".to_owned(), svc2_chain.clone());
    assert_eq!(direct.get(&key).map(Vec::len), Some(2), "{direct:#?}");
    assert_eq!(ruleset(&incremental), direct);
}

#[test]
fn idle_partial_sync_writes_only_top_level_chains() {
    let first = full(&before(), IpFamily::V4, &config());
    let idle = partial(&before(), &[], &first.chains);
    assert!(idle.deleted.is_empty());
    assert_eq!(idle.chains, first.chains);
    assert!(!idle.text.contains(":KUBE-SVC-"), "{}", idle.text);
    assert!(!idle.text.contains(":KUBE-SEP-"), "{}", idle.text);
    assert!(!idle.text.contains("-X "), "{}", idle.text);
    assert_eq!(idle.nat_rules, first.nat_rules);

    let tool = restore_tool(IpFamily::V4);
    if let Some(reason) = netns_unavailable(tool) {
        eprintln!("skipping kernel check: {reason}");
        return;
    }
    let setup = setup_text(&setup(IpFamily::V4, &config()));
    let incremental = apply_in_netns(tool, &[&setup, &first.text, &idle.text])
        .unwrap_or_else(|e| panic!("idle restore failed: {e}\n{}", idle.text));
    let direct = apply_in_netns(tool, &[&setup, &first.text]).expect("full restore");
    assert_eq!(ruleset(&incremental), ruleset(&direct));
}

#[test]
fn full_sync_deletes_only_our_stale_chains() {
    let first = full(&before(), IpFamily::V4, &config());
    let mut existing = first.chains.clone();
    existing.insert("KUBE-SVC-AAAAAAAAAAAAAAAA".into());
    // Not ours (or a top-level chain): never deleted.
    existing.insert("KUBE-SERVICES".into());
    existing.insert("CNI-FORWARD".into());
    let out = render(
        &before(),
        IpFamily::V4,
        &config(),
        &SyncScope {
            kind: SyncKind::Full,
            changed: &BTreeSet::new(),
            existing_chains: &existing,
        },
    )
    .expect("valid config");
    assert_eq!(
        out.deleted,
        BTreeSet::from(["KUBE-SVC-AAAAAAAAAAAAAAAA".to_owned()])
    );
    assert_eq!(out.chains, first.chains);
}
