//! The canary check (our table per family) and re-reading the kernel after a foreign change.

use super::*;
use kp_core::foreign::Check;

#[tokio::test]
async fn verify_names_a_missing_table_and_a_foreign_change_makes_the_next_sync_list_again() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    let state = two_services();
    sync_full(&mut backend, &state).await;
    // The fake lists no table: as after `nft flush ruleset`.
    assert_eq!(
        backend.verify(Check::Thorough).await.expect("fake runs"),
        vec![ForeignChange::removed(
            "table",
            "table ip kube-proxy missing"
        )]
    );
    runner.set_listing(IpFamily::V4, "table ip kube-proxy {\n}\n");
    assert_eq!(
        backend.verify(Check::Thorough).await.expect("fake runs"),
        vec![]
    );

    // Told of a change, the backend lists the table again before its next sync.
    runner.clear_calls();
    sync_full(&mut backend, &state).await;
    assert!(!runner.calls().contains(&NftCall::List(IpFamily::V4)));
    backend.kernel_changed_behind_our_back();
    sync_full(&mut backend, &state).await;
    assert!(runner.calls().contains(&NftCall::List(IpFamily::V4)));
}
