//! The canary check: what another program removes from ipvs mode's kernel state is found,
//! once per kind, and the full sync the proxier then runs puts it back.

use kp_core::foreign::Check;

use super::*;
use crate::exec::split_args;

/// A synced harness whose fake `iptables-save` prints the modelled jumps.
fn synced(state: &ProxyState) -> Harness {
    let mut h = harness(config());
    h.runner.save_modelled();
    h.sync(state);
    h
}

impl Harness {
    fn verify(&mut self, check: Check) -> Vec<ForeignChange> {
        block_on(self.backend.verify(check)).expect("fakes answer")
    }

    /// What the proxier does on a finding: the next sync is full.
    fn restore(&mut self, state: &ProxyState) {
        self.backend.kernel_changed_behind_our_back();
        self.sync(state);
        assert_eq!(self.verify(Check::Thorough), vec![], "restored");
    }
}

fn labels(found: &[ForeignChange]) -> Vec<&'static str> {
    found.iter().map(|c| c.what).collect()
}

#[test]
fn verify_finds_nothing_before_a_sync_and_after_one() {
    let mut h = harness(config());
    h.runner.save_modelled();
    assert_eq!(h.verify(Check::Thorough), vec![], "nothing written yet");
    h.sync(&two_services());
    assert_eq!(h.verify(Check::Canary), vec![]);
    assert_eq!(h.verify(Check::Thorough), vec![]);
}

#[test]
fn a_flushed_ipvs_table_is_one_finding_and_comes_back() {
    let state = two_services();
    let mut h = synced(&state);
    h.ipvs.flush().expect("fake flushes");
    let found = h.verify(Check::Canary);
    assert_eq!(
        found,
        vec![ForeignChange::removed(
            "virtual-server",
            "2 of 2 virtual servers missing in IPVS (first: 10.96.0.1:80/TCP)"
        )]
    );
    h.restore(&state);
    assert_eq!(h.ipvs.services().expect("fake lists").len(), 2);
}

#[test]
fn a_changed_virtual_server_and_a_removed_real_server_are_found() {
    let state = two_services();
    let mut h = synced(&state);
    let a = key("10.96.0.1", 80);
    let mut changed = h.ipvs.services().expect("fake lists").remove(0);
    assert_eq!(changed.key, a);
    changed.scheduler = "wlc".to_owned();
    h.ipvs.update_service(&changed).expect("fake updates");
    let b = key("10.96.0.2", 80);
    let rs = h
        .ipvs
        .destinations(&b)
        .expect("fake lists")
        .remove(0)
        .server;
    h.ipvs.delete_destination(&b, &rs).expect("fake deletes");
    // The short-period check leaves real servers out (one dump per virtual server).
    let found = h.verify(Check::Canary);
    assert_eq!(labels(&found), ["virtual-server"], "{found:?}");
    assert!(
        found[0]
            .detail
            .starts_with("1 of 2 virtual servers changed"),
        "{found:?}"
    );
    let found = h.verify(Check::Thorough);
    assert_eq!(
        labels(&found),
        ["virtual-server", "real-server"],
        "{found:?}"
    );
    assert_eq!(
        found[1].detail,
        "1 of 2 real servers missing or changed in IPVS (first: 10.244.1.2:8080 of 10.96.0.2:80/TCP)"
    );
    h.restore(&state);
}

#[test]
fn a_deleted_kube_ipvs0_is_found_and_comes_back_with_its_addresses() {
    let state = two_services();
    let mut h = synced(&state);
    block_on(h.links.delete_link(DUMMY_DEVICE)).expect("fake deletes");
    assert_eq!(
        h.verify(Check::Canary),
        vec![ForeignChange::removed(
            "device",
            "device kube-ipvs0 missing"
        )]
    );
    h.restore(&state);
    assert_eq!(
        h.links.addresses_of(DUMMY_DEVICE),
        Some([ip("10.96.0.1"), ip("10.96.0.2")].into())
    );
}

#[test]
fn a_removed_service_address_is_found() {
    let state = two_services();
    let mut h = synced(&state);
    let index = block_on(h.links.find_link(DUMMY_DEVICE))
        .expect("fake answers")
        .expect("kube-ipvs0");
    block_on(h.links.delete_address(index, ip("10.96.0.2"))).expect("fake deletes");
    assert_eq!(
        h.verify(Check::Canary),
        vec![ForeignChange::removed(
            "address",
            "1 of 2 service addresses missing on kube-ipvs0 (first: 10.96.0.2)"
        )]
    );
    h.restore(&state);
}

#[test]
fn a_flushed_or_destroyed_ipset_is_found() {
    let state = two_services();
    let mut h = synced(&state);
    block_on(h.ipset.restore("flush KUBE-CLUSTER-IP\n")).expect("fake flushes");
    assert_eq!(
        h.verify(Check::Canary),
        vec![ForeignChange::changed(
            "element",
            "1 of 17 ipsets with entries removed or added (first: KUBE-CLUSTER-IP holds 0, kube-proxy-rs wrote 2)"
        )]
    );
    h.restore(&state);
    block_on(h.ipset.restore("destroy KUBE-LOOP-BACK\n")).expect("fake destroys");
    let found = h.verify(Check::Canary);
    assert_eq!(labels(&found), ["set"], "{found:?}");
    assert!(found[0].detail.contains("KUBE-LOOP-BACK"), "{found:?}");
    h.restore(&state);
}

#[test]
fn a_removed_jump_is_found_by_the_short_period_check_nat_included_unless_watched() {
    let state = two_services();
    let mut h = synced(&state);
    let setup = rules::setup();
    let jump = setup
        .jumps
        .iter()
        .find(|j| j.table == Table::Nat && j.from == "PREROUTING")
        .expect("nat PREROUTING jump");
    let mut delete: Vec<String> = ["-t", "nat", "-D", "PREROUTING"]
        .map(str::to_owned)
        .to_vec();
    delete.extend(split_args(&jump.spec));
    block_on(h.runner.run(IpFamily::V4, &delete)).expect("was there");
    let missing = vec![ForeignChange::removed(
        "jump",
        "jump from PREROUTING to KUBE-SERVICES missing in table nat (V4)",
    )];
    assert_eq!(h.verify(Check::Canary), missing);
    // One save per table, not one `iptables -C` per jump.
    h.runner.clear_calls();
    h.verify(Check::Canary);
    let calls = h.runner.calls();
    assert!(
        calls.iter().all(|c| matches!(c, RunnerCall::Save { .. })),
        "{calls:?}"
    );
    assert_eq!(calls.len(), 2, "nat and filter: {calls:?}");

    // Where nf_tables notifications watch iptables, only the periodic check reads them.
    let mut backend = std::mem::replace(&mut h.backend, harness(config()).backend);
    backend = backend.with_iptables_watched(true);
    h.backend = backend;
    assert_eq!(h.verify(Check::Canary), vec![]);
    assert_eq!(h.verify(Check::Thorough), missing);
    h.restore(&state);
}

#[test]
fn a_full_sync_with_the_setup_in_place_only_reads_it() {
    let state = two_services();
    let mut h = synced(&state);
    h.runner.clear_calls();
    h.backend.kernel_changed_behind_our_back();
    h.sync(&state);
    let runs: Vec<RunnerCall> = h
        .runner
        .calls()
        .into_iter()
        .filter(|c| matches!(c, RunnerCall::Run { .. }))
        .collect();
    assert_eq!(runs, vec![], "no `iptables` run per chain and jump");
    let restores = h.runner.restores();
    assert_eq!(restores.len(), 1, "one restore: {restores:?}");
    assert!(!restores[0].1.contains("\n-I "), "nothing to insert");
    assert_eq!(h.verify(Check::Thorough), vec![]);
}

#[test]
fn every_jump_removed_is_restored_by_one_restore_per_family() {
    let state = two_services();
    let mut h = synced(&state);
    for jump in &rules::setup().jumps {
        let mut delete: Vec<String> = ["-t", jump.table.as_str(), "-D", jump.from]
            .map(str::to_owned)
            .to_vec();
        delete.extend(split_args(&jump.spec));
        block_on(h.runner.run(IpFamily::V4, &delete)).expect("was there");
    }
    let found = h.verify(Check::Canary);
    assert_eq!(labels(&found), vec!["jump"; 9], "{found:?}");
    h.runner.clear_calls();
    h.restore(&state);
    let calls = h.runner.calls();
    let count = |f: fn(&RunnerCall) -> bool| calls.iter().filter(|c| f(c)).count();
    let restores = count(|c| matches!(c, RunnerCall::Restore { .. }));
    let runs = count(|c| matches!(c, RunnerCall::Run { .. }));
    assert_eq!((restores, runs), (1, 0), "{calls:?}");
}

/// What `iptables-save -t table` prints once `text` (rendered rules) and every jump of the
/// setup are in place, as the kernel spells rules ([`rules::saved_form`]).
fn saved_as_the_kernel_prints(text: &str, table: Table) -> String {
    let mut out = format!("*{}\n", table.as_str());
    let mut section = false;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            section = name == table.as_str();
        } else if !section || line == "COMMIT" {
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let (chain, spec) = rule.split_once(' ').expect("chain and rule");
            let spec = rules::saved_form(IpFamily::V4, spec);
            out.push_str(&format!("-A {chain} {spec}\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    for jump in rules::setup().jumps.iter().filter(|j| j.table == table) {
        out.push_str(&format!("-A {} {}\n", jump.from, jump.spec));
    }
    out.push_str("COMMIT\n");
    out
}

#[test]
fn a_full_sync_restores_nothing_when_the_saves_show_the_rules_as_written() {
    let state = two_services();
    let mut h = harness(config());
    h.sync(&state);
    let text = rules::render(IpFamily::V4, &config().plan, &Default::default()).expect("renders");
    for table in [Table::Filter, Table::Nat] {
        h.runner.set_save(
            IpFamily::V4,
            table,
            saved_as_the_kernel_prints(&text, table),
        );
    }
    h.runner.clear_calls();
    h.backend.kernel_changed_behind_our_back();
    h.sync(&state);
    assert_eq!(h.runner.restores(), vec![], "nothing to write");

    // A rule of ours gone (or added, or another one): restored, no jump inserted.
    let nat = saved_as_the_kernel_prints(&text, Table::Nat);
    let flushed: String = nat
        .lines()
        .filter(|l| !l.starts_with("-A KUBE-SERVICES -m addrtype"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(flushed, nat);
    h.runner.set_save(IpFamily::V4, Table::Nat, flushed);
    h.backend.kernel_changed_behind_our_back();
    h.sync(&state);
    let restores = h.runner.restores();
    assert_eq!(restores.len(), 1, "{restores:?}");
    assert_eq!(restores[0].1, text, "the rules alone");
}
