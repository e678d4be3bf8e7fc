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

/// A harness with upstream's periodic full syncs of `mode`, after the first sync of service
/// `web` with `endpoints` IPv4 endpoints (in slices of at most 1,000, as the API splits them).
async fn synced_as(mode: &str, endpoints: usize) -> Harness {
    let schedule = crate::full_sync::PeriodicFullSync::for_mode(mode);
    let h = Harness::start_with(|config| config.with_periodic_full_sync(schedule));
    let ips: Vec<String> = (0..endpoints)
        .map(|i| format!("10.180.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let mut objects = vec![applied(service("web", "172.30.0.41"))];
    for (n, chunk) in ips.chunks(1000).enumerate() {
        let list: Vec<(&str, Option<&str>, bool)> =
            chunk.iter().map(|ip| (ip.as_str(), None, true)).collect();
        objects.push(applied(slice(&format!("web-{n}"), "web", &list)));
    }
    h.initialize(objects).await;
    assert_eq!(h.syncs().len(), 1);
    h
}

/// The kinds of every sync after the first.
fn later_kinds(h: &Harness) -> Vec<SyncKind> {
    h.syncs().iter().skip(1).map(|s| s.kind).collect()
}

/// After `d` more: how many syncs after the first were full, and the kinds of all of them.
async fn full_after(h: &Harness, d: Duration) -> (usize, Vec<SyncKind>) {
    run_for(d).await;
    let kinds = later_kinds(h);
    (
        kinds.iter().filter(|k| **k == SyncKind::Full).count(),
        kinds,
    )
}

#[tokio::test(start_paused = true)]
async fn iptables_mode_rewrites_everything_hourly_in_a_small_cluster() {
    let h = synced_as("iptables", 1000).await;
    // Periodic runs every 30 s are partial until the last full sync is an hour old.
    let (full, kinds) = full_after(
        &h,
        crate::full_sync::FULL_SYNC_PERIOD - Duration::from_secs(1),
    )
    .await;
    assert_eq!((full, kinds.len()), (0, 119), "{kinds:?}");
    run_for(SYNC_PERIOD).await;
    assert_eq!(later_kinds(&h).last(), Some(&SyncKind::Full));
    // And the hour starts again from that one.
    let (full, kinds) = full_after(&h, SYNC_PERIOD * 10).await;
    assert_eq!(full, 1, "{kinds:?}");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn iptables_mode_does_no_periodic_full_sync_above_1000_endpoints() {
    // Upstream #138571: in large-cluster mode the hourly full sync is skipped.
    let h = synced_as("iptables", 1001).await;
    let (full, kinds) = full_after(&h, crate::full_sync::FULL_SYNC_PERIOD * 3).await;
    assert_eq!(full, 0, "{kinds:?}");
    assert!(kinds.len() > 300, "{}", kinds.len());
    // A failure still makes the next sync full: only the periodic one is spared.
    h.backend.fail_next(1);
    let (full, kinds) = full_after(&h, SYNC_PERIOD * 3).await;
    assert_eq!(full, 1, "the retry of the failed sync: {kinds:?}");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn nftables_mode_rewrites_everything_hourly_whatever_the_size() {
    let h = synced_as("nftables", 1001).await;
    let (full, kinds) = full_after(&h, crate::full_sync::FULL_SYNC_PERIOD + SYNC_PERIOD).await;
    assert_eq!(full, 1, "{kinds:?}");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn ipvs_mode_resyncs_everything_every_sync_period() {
    // Upstream #135631: ipvs keeps its forced resync every syncPeriod.
    let h = synced_as("ipvs", 3).await;
    run_for(SYNC_PERIOD * 3 + Duration::from_secs(1)).await;
    assert_eq!(later_kinds(&h), [SyncKind::Full; 3]);
    // A change between them is still a partial sync.
    h.send(applied(slice(
        "web-0",
        "web",
        &[("10.180.0.9", None, true)],
    )))
    .await;
    settle().await;
    assert_eq!(later_kinds(&h).last(), Some(&SyncKind::Partial));
    h.stop().await;
}
