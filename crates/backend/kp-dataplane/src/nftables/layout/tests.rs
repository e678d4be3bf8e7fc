//! The verdict-free layout's backend over the fake I/O: what each kind of sync writes, and
//! that the kernel's elements (as the fake keeps them) end up what the state says after
//! failures, foreign changes, restarts and another layout's table.

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_core::backend::{Backend, SyncKind};
use kp_core::model::{IpFamily, Protocol, ServiceName};
use kp_core::tracker::ProxyState;
use kp_rules::nftables::RenderConfig;
use kp_rules::nftables::layout::{Entry, EntrySet, Slots};

use super::*;
use crate::conntrack::FakeConntrack;
use crate::testutil::*;

type Fake = LayoutBackend<FakeLayoutIo, FakeConntrack>;

fn backend_on(io: &FakeLayoutIo) -> Fake {
    LayoutBackend::with_parts(
        NftablesConfig::new(vec![IpFamily::V4], RenderConfig::default()),
        io.clone(),
        FakeConntrack::new(),
    )
    .expect("default config is valid")
}

fn changed(name: &str) -> BTreeSet<ServiceName> {
    BTreeSet::from([service_name("ns", name)])
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

/// What the kernel must hold for `state`: a fresh backend's bookkeeping after syncing it.
async fn expected(state: &ProxyState) -> BTreeSet<Element> {
    let io = FakeLayoutIo::new();
    let mut fresh = backend_on(&io);
    sync(&mut fresh, state, SyncKind::Full, &BTreeSet::new()).await;
    io.elements(IpFamily::V4)
}

/// The class transactions: each one's statements, and its added elements.
fn class_calls(io: &FakeLayoutIo) -> Vec<(Vec<String>, Vec<Element>)> {
    io.calls()
        .into_iter()
        .filter_map(|c| match c {
            LayoutCall::Classes {
                statements, add, ..
            } => Some((statements, add)),
            _ => None,
        })
        .collect()
}

fn scripts(io: &FakeLayoutIo) -> Vec<String> {
    io.calls()
        .into_iter()
        .filter_map(|c| match c {
            LayoutCall::Script(text) => Some(text),
            _ => None,
        })
        .collect()
}

fn element_calls(io: &FakeLayoutIo) -> Vec<(Vec<Element>, Vec<Element>)> {
    io.calls()
        .into_iter()
        .filter_map(|c| match c {
            LayoutCall::Elements { delete, add, .. } => Some((delete, add)),
            _ => None,
        })
        .collect()
}

/// A backend on `io` after a full sync of `state`, the calls so far forgotten.
async fn synced_on(io: &FakeLayoutIo, state: &ProxyState) -> Fake {
    let mut backend = backend_on(io);
    sync(&mut backend, state, SyncKind::Full, &BTreeSet::new()).await;
    io.clear_calls();
    backend
}

fn addr(text: &str) -> IpAddr {
    text.parse().expect("literal")
}

#[tokio::test]
async fn the_first_sync_reads_writes_the_fixed_part_then_the_elements() {
    let io = FakeLayoutIo::new();
    let mut backend = backend_on(&io);
    let state = two_services();
    sync(&mut backend, &state, SyncKind::Partial, &BTreeSet::new()).await;
    let calls = io.calls();
    assert_eq!(calls[0], LayoutCall::Read(IpFamily::V4), "{calls:?}");
    let scripts = scripts(&io);
    assert_eq!(scripts.len(), 1, "{scripts:?}");
    assert!(scripts[0].contains("add chain ip kube-proxy dispatch\n"));
    assert!(
        scripts[0].contains("add set ip kube-proxy slots-1 "),
        "{}",
        scripts[0]
    );
    let elements = element_calls(&io);
    assert_eq!(elements.len(), 1, "one element transaction");
    assert!(elements[0].0.is_empty());
    let held = io.elements(IpFamily::V4);
    assert!(
        held.contains(&Element::ClusterIp(addr("10.96.0.2"))),
        "{held:?}"
    );
    assert_eq!(
        backend
            .installed(IpFamily::V4)
            .map(|s| s.elements().count()),
        Some(held.len())
    );
}

#[tokio::test]
async fn a_moved_endpoint_is_one_element_transaction_and_nothing_else() {
    let io = FakeLayoutIo::new();
    let mut backend = synced_on(&io, &two_services()).await;
    let moved = b_moved();
    sync(&mut backend, &moved, SyncKind::Partial, &changed("b")).await;
    let calls = io.calls();
    assert_eq!(calls.len(), 1, "no read, no script: {calls:?}");
    let (delete, add) = &element_calls(&io)[0];
    assert!(
        delete.iter().all(|e| !matches!(e, Element::ClusterIp(_))),
        "{delete:?}"
    );
    assert!(
        add.iter()
            .any(|e| matches!(e, Element::Slot { addr: a, .. } if *a == addr("10.244.2.9"))),
        "{add:?}"
    );
    assert_eq!(io.elements(IpFamily::V4), expected(&moved).await);
}

#[tokio::test]
async fn a_new_endpoint_count_goes_as_one_netlink_transaction_with_its_set_and_rules() {
    let io = FakeLayoutIo::new();
    let mut backend = synced_on(&io, &two_services()).await;
    io.clear_calls();
    // Three endpoints: not a count kept ready beside 1 (those are 1 and 2).
    let grown = b_with(3);
    sync(&mut backend, &grown, SyncKind::Partial, &changed("b")).await;
    assert!(element_calls(&io).is_empty());
    assert!(scripts(&io).is_empty(), "no nft -f: {:?}", scripts(&io));
    let calls = class_calls(&io);
    assert_eq!(calls.len(), 1, "{calls:?}");
    let (statements, add) = &calls[0];
    assert!(
        statements.contains(
            &"add set ip kube-proxy slots-3 { type ipv4_addr . inet_proto . inet_service ; }"
                .to_owned()
        ),
        "{statements:?}"
    );
    assert!(
        statements.iter().all(|s| !s.contains("flush chain")),
        "the fixed part stays: {statements:?}"
    );
    assert!(
        add.iter().any(|e| e.set_name() == "slots-3"),
        "the class's elements in the same transaction: {add:?}"
    );
    assert_eq!(io.elements(IpFamily::V4), expected(&grown).await);
}

#[tokio::test]
async fn affinity_switched_on_goes_as_one_netlink_transaction_with_its_maps_and_rules() {
    let io = FakeLayoutIo::new();
    let mut backend = synced_on(&io, &two_services()).await;
    io.clear_calls();
    let name = port_name("ns", "b", "p", Protocol::Tcp);
    let mut pinned = two_services();
    if let Some(svc) = pinned.services.get_mut(&name) {
        svc.session_affinity = Some(kp_core::model::SessionAffinity {
            timeout: std::time::Duration::from_secs(60),
        });
    }
    sync(&mut backend, &pinned, SyncKind::Partial, &changed("b")).await;
    assert!(scripts(&io).is_empty(), "no nft -f: {:?}", scripts(&io));
    let calls = class_calls(&io);
    assert_eq!(calls.len(), 1, "{calls:?}");
    let (statements, add) = &calls[0];
    let base = kp_rules::nftables::layout::AffinityPort::new(&name, 60).base();
    let map = format!(
        "add map ip kube-proxy {base} {{ typeof ip saddr : ip daddr ; flags dynamic,timeout ; timeout 60s ; size 1048576 ; }}"
    );
    assert!(statements.contains(&map), "{statements:?}");
    assert!(
        statements
            .iter()
            .any(|s| s.starts_with("add rule ip kube-proxy affinity-record ")),
        "{statements:?}"
    );
    assert!(
        add.iter().any(|e| e.set_name().starts_with(&base)),
        "the port's elements in the same transaction: {add:?}"
    );
    assert_eq!(io.elements(IpFamily::V4), expected(&pinned).await);
}

#[tokio::test]
async fn a_failed_transaction_keeps_the_rules_and_the_next_sync_repairs_from_a_read() {
    let io = FakeLayoutIo::new();
    let mut backend = backend_on(&io);
    let state = two_services();
    sync(&mut backend, &state, SyncKind::Full, &BTreeSet::new()).await;
    let before = io.elements(IpFamily::V4);
    io.fail_elements(1);
    let moved = b_moved();
    let failed = backend
        .sync(&request(&moved, SyncKind::Partial, &changed("b"), false))
        .await;
    assert!(
        matches!(failed, Err(BackendError::Apply { .. })),
        "{failed:?}"
    );
    assert_eq!(io.elements(IpFamily::V4), before, "nothing of it applied");
    io.clear_calls();
    // The core asks for partial; the backend knows better.
    sync(&mut backend, &moved, SyncKind::Partial, &changed("b")).await;
    assert_eq!(io.calls()[0], LayoutCall::Read(IpFamily::V4));
    assert_eq!(io.elements(IpFamily::V4), expected(&moved).await);
}

#[tokio::test]
async fn another_programs_deletion_is_put_back_and_nothing_else_written() {
    let io = FakeLayoutIo::new();
    let mut backend = backend_on(&io);
    let state = two_services();
    sync(&mut backend, &state, SyncKind::Full, &BTreeSet::new()).await;
    let whole = io.elements(IpFamily::V4);
    let victim = Element::ClusterIp(addr("10.96.0.1"));
    io.tamper(IpFamily::V4, |set| {
        set.remove(&victim);
    });
    backend.kernel_changed_behind_our_back();
    io.clear_calls();
    sync(&mut backend, &state, SyncKind::Partial, &BTreeSet::new()).await;
    let calls = element_calls(&io);
    assert_eq!(calls, vec![(Vec::new(), vec![victim])]);
    assert_eq!(io.elements(IpFamily::V4), whole);
}

#[tokio::test]
async fn a_quiet_load_reads_nothing_back_unless_another_program_committed_meanwhile() {
    let io = FakeLayoutIo::new();
    let mut backend = backend_on(&io).quiet_from(1);
    let state = two_services();
    sync(&mut backend, &state, SyncKind::Full, &BTreeSet::new()).await;
    io.clear_calls();
    let moved = b_moved();
    sync(&mut backend, &moved, SyncKind::Full, &BTreeSet::new()).await;
    let calls = io.calls();
    assert!(calls.contains(&LayoutCall::Quiet), "{calls:?}");
    assert!(
        !calls.contains(&LayoutCall::Read(IpFamily::V4)),
        "{calls:?}"
    );
    assert_eq!(io.elements(IpFamily::V4), expected(&moved).await);

    // Unheard (the watch was out of its group), another program deletes an element of
    // ours during the load: the generation says someone else committed, so the same sync
    // reads the table back and puts it back.
    let victim = Element::ClusterIp(addr("10.96.0.1"));
    assert!(io.elements(IpFamily::V4).contains(&victim));
    io.delete_during_quiet(IpFamily::V4, victim.clone());
    io.clear_calls();
    sync(&mut backend, &state, SyncKind::Full, &BTreeSet::new()).await;
    let calls = io.calls();
    assert!(calls.contains(&LayoutCall::Read(IpFamily::V4)), "{calls:?}");
    assert_eq!(io.elements(IpFamily::V4), expected(&state).await);
    assert_eq!(
        backend
            .installed(IpFamily::V4)
            .map(LayoutState::element_count),
        Some(expected(&state).await.len())
    );
}

#[tokio::test]
async fn a_restart_adopts_its_own_table_and_writes_only_the_difference() {
    let io = FakeLayoutIo::new();
    let mut first = backend_on(&io);
    sync(
        &mut first,
        &two_services(),
        SyncKind::Full,
        &BTreeSet::new(),
    )
    .await;
    drop(first);
    io.clear_calls();
    let mut second = backend_on(&io);
    let moved = b_moved();
    sync(&mut second, &moved, SyncKind::Full, &BTreeSet::new()).await;
    let calls = element_calls(&io);
    assert_eq!(calls.len(), 1, "{calls:?}");
    let (delete, add) = &calls[0];
    // b's slot, its hairpin; a is untouched.
    assert!(delete.len() <= 2 && add.len() <= 2, "{delete:?} {add:?}");
    assert!(!scripts(&io)[0].contains("delete table"));
    assert_eq!(io.elements(IpFamily::V4), expected(&moved).await);
}

/// The one script a full sync over a table found with `chains` and `sets` writes, asserting
/// that it replaced the table in one transaction: the old table deleted, then this layout's
/// chains, then its elements.
async fn replaced_in_one_script(chains: &[&str], sets: &[&str]) -> String {
    let io = FakeLayoutIo::new();
    let names = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect();
    io.set_table(
        IpFamily::V4,
        Readback {
            chains: names(chains),
            sets: names(sets),
            ..Readback::default()
        },
    );
    let mut backend = backend_on(&io);
    let state = two_services();
    sync(&mut backend, &state, SyncKind::Full, &BTreeSet::new()).await;
    assert!(
        element_calls(&io).is_empty(),
        "everything in the one script"
    );
    let mut scripts = scripts(&io);
    assert_eq!(scripts.len(), 1, "{scripts:?}");
    let script = scripts.remove(0);
    let delete = script
        .find("delete table ip kube-proxy")
        .expect("deletes the old table");
    let dispatch = script
        .find("add chain ip kube-proxy dispatch")
        .expect("writes the new");
    let element = script
        .find("add element ip kube-proxy cluster-ips { 10.96.0.1 }")
        .expect("and its elements");
    assert!(delete < dispatch && dispatch < element, "{script}");
    script
}

#[tokio::test]
async fn a_table_of_another_layout_is_replaced_in_one_transaction() {
    replaced_in_one_script(
        &["services", "service-ULMVA6XW-ns/a/tcp/p"],
        &["service-ips", "cluster-ips"],
    )
    .await;
}

/// This layout before its endpoints maps were per class: the rules of the new classes must
/// never point at the shared maps being emptied, so the table is replaced whole.
#[tokio::test]
async fn a_table_of_this_layouts_earlier_version_is_replaced_in_one_transaction() {
    let script = replaced_in_one_script(
        &["dispatch", "pick"],
        &["slots-1", "endpoints-tcp", "cluster-ips"],
    )
    .await;
    assert!(!script.contains("endpoints-tcp "), "{script}");
}

#[tokio::test]
async fn a_changed_service_cidr_rewrites_the_fixed_part_in_a_partial_sync() {
    let io = FakeLayoutIo::new();
    let mut backend = backend_on(&io);
    let mut state = two_services();
    sync(&mut backend, &state, SyncKind::Full, &BTreeSet::new()).await;
    assert!(!scripts(&io)[0].contains("daddr { 10.96.0.0/16 } drop"));
    io.clear_calls();
    state.service_cidrs = vec!["10.96.0.0/16".parse().expect("literal")];
    sync(&mut backend, &state, SyncKind::Partial, &BTreeSet::new()).await;
    let scripts = scripts(&io);
    assert_eq!(scripts.len(), 1, "{scripts:?}");
    assert!(
        scripts[0].contains("ip daddr { 10.96.0.0/16 } drop"),
        "{}",
        scripts[0]
    );
    io.clear_calls();
    sync(&mut backend, &state, SyncKind::Partial, &BTreeSet::new()).await;
    assert!(io.calls().is_empty(), "written once: {:?}", io.calls());
}

#[tokio::test]
async fn the_canary_check_names_a_missing_table_and_chain() {
    let io = FakeLayoutIo::new();
    let mut backend = backend_on(&io);
    sync(
        &mut backend,
        &two_services(),
        SyncKind::Full,
        &BTreeSet::new(),
    )
    .await;
    assert!(
        backend
            .verify(Check::Canary)
            .await
            .expect("fake")
            .is_empty()
    );
    io.set_table(
        IpFamily::V4,
        Readback {
            chains: vec!["dispatch".into()],
            ..Readback::default()
        },
    );
    let found = backend.verify(Check::Canary).await.expect("fake");
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0]
            .log_message()
            .contains("chain pick missing in table ip kube-proxy")
    );
}

/// Slot `i` of service `s`'s 250 slots.
fn slot(s: u8, i: u8) -> Element {
    Element::Slot {
        slots: Slots::Policy,
        count: 250,
        entry: entry(s),
        slot: u16::from(i),
        addr: IpAddr::from([10, 244, s, i]),
        port: 8080,
    }
}

fn entry(s: u8) -> Entry {
    Entry::Ip {
        addr: IpAddr::from([10, 96, 0, s]),
        proto: Protocol::Tcp,
        port: u16::from(s),
    }
}

#[test]
fn a_large_full_sync_fills_slots_before_entries_and_deletes_last() {
    let mut changes = Changes::default();
    // 60k slots of 240 entries, the entries' class elements, a replaced slot, deletions.
    for s in 0..240u8 {
        for i in 0..250 {
            changes.add.push(slot(s, i));
        }
        changes.add.push(Element::Entry(
            EntrySet::Count(Slots::Policy, 250),
            entry(s),
        ));
        changes
            .delete
            .push(Element::Entry(EntrySet::Count(Slots::Policy, 3), entry(s)));
    }
    let replaced = Element::Slot {
        slots: Slots::Policy,
        count: 250,
        entry: entry(7),
        slot: 7,
        addr: IpAddr::from([192, 0, 2, 1]),
        port: 8080,
    };
    changes.delete.push(replaced.clone());
    // The replaced slot's new data sorts late among the additions.
    changes.add.sort_by(|a, b| b.cmp(a));
    let total_changes = changes.add.len() + changes.delete.len();
    let steps = steps(changes.clone());
    assert!(steps.len() > 1, "{} steps", steps.len());
    assert!(steps.iter().all(|(d, a)| d.len() + a.len() <= STEP));
    assert!(steps[0].0.contains(&replaced), "{:?}", steps[0].0);
    assert!(
        steps[0].1.contains(&slot(7, 7)),
        "a replaced key's new data goes in the transaction deleting its old data"
    );
    let last_add = steps
        .iter()
        .rposition(|(_, a)| !a.is_empty())
        .expect("adds");
    let first_delete = steps
        .iter()
        .position(|(d, _)| d.iter().any(|e| *e != replaced))
        .expect("deletes");
    assert!(last_add < first_delete, "additions before deletions");
    let first_entry = steps
        .iter()
        .position(|(_, a)| a.iter().any(|e| matches!(e, Element::Entry(..))))
        .expect("entries");
    let last_slot = steps
        .iter()
        .rposition(|(_, a)| a.iter().any(|e| matches!(e, Element::Slot { .. })))
        .expect("slots");
    assert!(last_slot <= first_entry, "slots before what reaches them");
    let total: usize = steps.iter().map(|(d, a)| d.len() + a.len()).sum();
    assert_eq!(total, total_changes);
}

#[tokio::test]
async fn clients_pinned_to_a_removed_endpoint_are_forgotten() {
    let io = FakeLayoutIo::new();
    let mut backend = backend_on(&io);
    let name = port_name("ns", "b", "p", Protocol::Tcp);
    let mut state = two_services();
    if let Some(svc) = state.services.get_mut(&name) {
        svc.session_affinity = Some(kp_core::model::SessionAffinity {
            timeout: std::time::Duration::from_secs(60),
        });
    }
    state.endpoints.insert(
        name.clone(),
        vec![endpoint("10.244.1.2", 8080), endpoint("10.244.1.3", 8080)],
    );
    sync(&mut backend, &state, SyncKind::Full, &BTreeSet::new()).await;
    assert!(
        !io.calls()
            .iter()
            .any(|c| matches!(c, LayoutCall::Forget { .. }))
    );
    io.clear_calls();
    state
        .endpoints
        .insert(name.clone(), vec![endpoint("10.244.1.3", 8080)]);
    sync(&mut backend, &state, SyncKind::Partial, &changed("b")).await;
    let forgets: Vec<LayoutCall> = io
        .calls()
        .into_iter()
        .filter(|c| matches!(c, LayoutCall::Forget { .. }))
        .collect();
    // Only the port that lost the endpoint is swept, its cluster pins (no local list).
    let port = kp_rules::nftables::layout::AffinityPort::new(&name, 60);
    let base = port.base();
    assert_eq!(
        forgets,
        vec![LayoutCall::Forget(vec![kp_nftnl::layout::Forget {
            addresses: base.clone(),
            ports: format!("{base}-ports"),
            gone: BTreeSet::from([addr("10.244.1.2")]),
        }])]
    );
}

/// `two_services` with `b` holding `count` endpoints.
fn b_with(count: u8) -> ProxyState {
    let mut state = two_services();
    let name = port_name("ns", "b", "p", Protocol::Tcp);
    let endpoints = (1..=count)
        .map(|i| endpoint(&format!("10.244.3.{i}"), 8080))
        .collect();
    state.endpoints.insert(name, endpoints);
    state
}

#[tokio::test]
async fn one_endpoint_more_finds_its_class_ready_and_the_next_is_written_after() {
    let io = FakeLayoutIo::new();
    let mut backend = synced_on(&io, &b_with(1)).await;
    let ready = backend
        .installed(IpFamily::V4)
        .map(|s| s.classes().clone())
        .unwrap_or_default();
    for class in [
        Class::Count(Slots::Policy, 2),
        Class::Count(Slots::ShortCircuit, 1),
        Class::Count(Slots::ShortCircuit, 2),
    ] {
        assert!(
            ready.contains(&class),
            "{class:?} ready after a full sync: {ready:?}"
        );
    }
    assert_eq!(
        backend.recheck_after(),
        None,
        "nothing waits after a full sync"
    );

    sync(&mut backend, &b_with(2), SyncKind::Partial, &changed("b")).await;
    assert!(scripts(&io).is_empty(), "no nft -f: {:?}", scripts(&io));
    assert_eq!(element_calls(&io).len(), 1);
    // slots-3 is now a neighbour in use: written by the sync the recheck asks for.
    assert_eq!(backend.recheck_after(), Some(READY_AFTER));
    io.clear_calls();
    sync(
        &mut backend,
        &b_with(2),
        SyncKind::Partial,
        &BTreeSet::new(),
    )
    .await;
    assert!(scripts(&io).is_empty(), "no nft -f: {:?}", scripts(&io));
    let calls = class_calls(&io);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(
        calls[0]
            .0
            .iter()
            .any(|s| s.starts_with("add set ip kube-proxy slots-3 ")),
        "{calls:?}"
    );
    assert!(calls[0].1.is_empty(), "only the ready classes: {calls:?}");
    assert_eq!(backend.recheck_after(), None);
    io.clear_calls();
    sync(&mut backend, &b_with(3), SyncKind::Partial, &changed("b")).await;
    assert!(self::scripts(&io).is_empty(), "slots-3 was ready");
    assert!(class_calls(&io).is_empty(), "slots-3 was ready");
}
