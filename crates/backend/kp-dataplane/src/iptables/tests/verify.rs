//! The canary check: our jumps from the built-in chains, as another program leaves them.

use super::*;
use kp_core::foreign::Check;

#[tokio::test]
async fn verify_finds_nothing_after_a_sync_and_names_each_removed_jump() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    let state = two_services();
    sync_full(&mut backend, &state).await;
    assert_eq!(
        backend.verify(Check::Thorough).await.expect("fake runs"),
        vec![]
    );

    // Another program deletes the jump into KUBE-SERVICES from nat PREROUTING.
    delete_nat_jump(&runner).await;
    // Without nat's size, the short-period check does not read nat (a whole-table copy on
    // iptables-legacy).
    assert_eq!(
        backend.verify(Check::Canary).await.expect("fake runs"),
        vec![]
    );
    let found = backend.verify(Check::Thorough).await.expect("fake runs");
    assert_eq!(
        found,
        vec![ForeignChange::removed(
            "jump",
            "jump from PREROUTING to KUBE-SERVICES missing in table nat (V4)"
        )]
    );

    // The full sync that restores it puts the jump back; the check is then quiet.
    sync_full(&mut backend, &state).await;
    assert_eq!(
        backend.verify(Check::Thorough).await.expect("fake runs"),
        vec![]
    );
}

/// Deletes nat's jump from PREROUTING into KUBE-SERVICES, as another program would.
async fn delete_nat_jump(runner: &FakeRunner) {
    let setup = kp_rules::iptables::setup(IpFamily::V4, &RenderConfig::default());
    let jump = setup
        .jumps
        .iter()
        .find(|j| j.table == Table::Nat && j.from == "PREROUTING")
        .expect("nat PREROUTING jump");
    let mut delete: Vec<String> = ["-t", "nat", "-D", "PREROUTING"].map(str::to_owned).into();
    delete.extend(split_args(&jump.spec));
    runner.run(IpFamily::V4, &delete).await.expect("was there");
}

/// A synced (full) backend whose nat size `size` says, holding `entries` rules.
async fn legacy_backend(entries: Option<u32>) -> (Fake, FakeRunner, FakeNatSize) {
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let size = FakeNatSize::default();
    if let Some(entries) = entries {
        size.set(IpFamily::V4, entries);
    }
    let mut backend = backend.with_nat_size(size.clone());
    sync_full(&mut backend, &two_services()).await;
    (backend, runner, size)
}

/// One canary check: what it found and how many `iptables -C` calls looked at nat.
async fn canary(backend: &mut Fake, runner: &FakeRunner) -> (Vec<ForeignChange>, usize) {
    runner.clear_calls();
    let found = backend.verify(Check::Canary).await.expect("fake runs");
    let nat = ["-t", "nat", "-C"].map(str::to_owned);
    let reads = runner
        .calls()
        .iter()
        .filter(|c| matches!(c, RunnerCall::Run { args, .. } if args.starts_with(&nat)))
        .count();
    (found, reads)
}

#[tokio::test]
async fn on_legacy_the_canary_reads_nat_only_when_its_size_changed() {
    let (mut backend, runner, size) = legacy_backend(Some(1000)).await;
    // After a full sync nat is read once (its size may already be another program's).
    let (found, reads) = canary(&mut backend, &runner).await;
    assert!(found.is_empty() && reads > 0, "{found:?} {reads}");
    // Same size since: nat's jumps are not read (each read copies the whole legacy table).
    assert_eq!(canary(&mut backend, &runner).await, (vec![], 0));

    // Another program flushes nat: its size changes, and the canary finds the jump gone.
    delete_nat_jump(&runner).await;
    size.set(IpFamily::V4, 12);
    let removed = ForeignChange::removed(
        "jump",
        "jump from PREROUTING to KUBE-SERVICES missing in table nat (V4)",
    );
    assert_eq!(canary(&mut backend, &runner).await.0, vec![removed.clone()]);
    // Until restored, every canary looks again.
    assert_eq!(canary(&mut backend, &runner).await.0, vec![removed]);
}

#[tokio::test]
async fn on_legacy_a_foreign_rule_in_nat_costs_one_read() {
    let (mut backend, runner, size) = legacy_backend(Some(1000)).await;
    canary(&mut backend, &runner).await;
    // Another program adds a rule of its own: nat is read once, our jumps are all there.
    size.set(IpFamily::V4, 1001);
    let (found, reads) = canary(&mut backend, &runner).await;
    assert!(found.is_empty() && reads > 0, "{found:?} {reads}");
    assert_eq!(
        canary(&mut backend, &runner).await,
        (vec![], 0),
        "remembered"
    );
}

#[tokio::test]
async fn on_legacy_an_unreadable_size_means_nat_is_read() {
    // Nothing set: every read of the size fails, as without legacy nat.
    let (mut backend, runner, _) = legacy_backend(None).await;
    delete_nat_jump(&runner).await;
    assert_eq!(canary(&mut backend, &runner).await.0.len(), 1);
}

#[tokio::test]
async fn on_legacy_a_flush_right_after_a_restore_is_found_though_the_size_looks_ours() {
    let (mut backend, runner, _) = legacy_backend(Some(12)).await;
    // The flush came between the restore and the size read: the size never changes again.
    delete_nat_jump(&runner).await;
    assert_eq!(canary(&mut backend, &runner).await.0.len(), 1);
}

#[tokio::test]
async fn on_legacy_a_flush_during_a_canary_is_found_by_the_next() {
    let (mut backend, runner, size) = legacy_backend(Some(1000)).await;
    canary(&mut backend, &runner).await;
    // nat is flushed while the next canary runs, after it read the size.
    size.set_after_next_read(IpFamily::V4, 12);
    delete_nat_jump(&runner).await;
    let (found, reads) = canary(&mut backend, &runner).await;
    assert_eq!(
        (found.len(), reads),
        (0, 0),
        "the size it read was the old one"
    );
    // The next canary compares with the size read before that check, not after it.
    assert_eq!(canary(&mut backend, &runner).await.0.len(), 1);
}
