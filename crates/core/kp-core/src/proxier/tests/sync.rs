//! What one sync hands the backend and keeps for the next: the conntrack flag, services the
//! backend skipped, its recheck deadline, and the activity watchers read.

use super::*;

/// A ClusterIP service with one UDP port 53 (its changes need conntrack cleanup).
fn udp_service(service: &str, ip: &str) -> Service {
    let spec = json!({"clusterIP": ip, "ports": [{"port": 53, "protocol": "UDP"}]});
    fixtures::service("ns", service, spec)
}

/// A harness after the first sync of `objects`, its backend set up by `configure`.
async fn synced(objects: Vec<SourceEvent>, configure: impl FnOnce(&FakeBackend)) -> Harness {
    let h = Harness::start();
    configure(&h.backend);
    h.initialize(objects).await;
    h
}

/// [`synced`] with service `web`.
async fn web_synced(configure: impl FnOnce(&FakeBackend)) -> Harness {
    synced(vec![applied(service("web", "172.30.0.41"))], configure).await
}

#[tokio::test(start_paused = true)]
async fn conntrack_cleanup_is_asked_for_once_per_udp_change() {
    let h = synced(vec![applied(udp_service("dns", "172.30.0.10"))], |_| {}).await;
    run_for(SYNC_PERIOD + Duration::from_millis(1)).await;
    let flags: Vec<bool> = h
        .syncs()
        .iter()
        .map(|s| s.conntrack_cleanup_required)
        .collect();
    assert_eq!(
        flags,
        [true, false],
        "the periodic sync after it changed nothing"
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn services_the_backend_skipped_are_changed_in_the_next_sync() {
    let h = web_synced(|backend| backend.skip_next(vec![name("web")])).await;
    run_for(SYNC_PERIOD + Duration::from_millis(1)).await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2);
    assert_eq!(syncs[1].kind, SyncKind::Partial);
    assert_eq!(syncs[1].changed, names(&["web"]), "tried again");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_backend_recheck_deadline_brings_the_next_sync_forward() {
    let h = web_synced(|backend| backend.recheck_within(Duration::from_secs(5))).await;
    assert_eq!(h.syncs().len(), 1);
    run_for(Duration::from_secs(6)).await;
    assert_eq!(
        h.syncs().len(),
        2,
        "synced again by the deadline, not the sync period"
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn activity_covers_the_backend_sync_only() {
    let h = web_synced(|backend| backend.take(Duration::from_secs(2))).await;
    assert_eq!(h.syncs().len(), 1, "the sync started");
    assert!(
        h.activity.writing_within(Duration::ZERO),
        "writing during the sync"
    );
    run_for(Duration::from_secs(3)).await;
    assert!(!h.activity.writing_within(Duration::ZERO), "not after it");
    h.stop().await;
}
