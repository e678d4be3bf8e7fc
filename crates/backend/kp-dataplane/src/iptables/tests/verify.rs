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
    let setup = kp_rules::iptables::setup(IpFamily::V4, &RenderConfig::default());
    let jump = setup
        .jumps
        .iter()
        .find(|j| j.table == Table::Nat && j.from == "PREROUTING")
        .expect("nat PREROUTING jump");
    let mut delete = vec![
        "-t".to_owned(),
        "nat".to_owned(),
        "-D".to_owned(),
        "PREROUTING".to_owned(),
    ];
    delete.extend(split_args(&jump.spec));
    runner.run(IpFamily::V4, &delete).await.expect("was there");
    // The short-period check does not read nat (a whole-table copy on iptables-legacy).
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
