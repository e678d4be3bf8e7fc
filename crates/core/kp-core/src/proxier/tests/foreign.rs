//! Changes other programs make to the rules: restored by a full sync, counted once, backed
//! off while they keep coming, found by the canary check and before periodic syncs.

use super::*;
use crate::foreign::{BACKOFF_BASE, FREE_RESTORES, ForeignChange, ForeignEvent, SETTLE};
use crate::metrics::ForeignLabels;

fn chain_missing() -> ForeignChange {
    ForeignChange::removed("chain", "chain KUBE-SERVICES missing in table nat")
}

impl Harness {
    /// Started, synced once, with no minSyncPeriod (so timings are the foreign logic's).
    async fn started() -> Self {
        let h = Harness::start_with(|c| c.with_min_sync_period(Duration::ZERO));
        h.initialize(vec![
            applied(service("web", "172.30.0.41")),
            applied(slice("web-a", "web", &[("10.180.0.1", None, true)])),
        ])
        .await;
        assert_eq!(h.syncs().len(), 1);
        h
    }

    async fn report(&self, event: ForeignEvent) {
        self.foreign.send(event).await.expect("proxier running");
        settle().await;
    }

    fn foreign_count(&self, what: &'static str) -> u64 {
        self.metrics
            .foreign_changes
            .get_or_create(&ForeignLabels { mode: "fake", what })
            .get()
    }
}

#[tokio::test(start_paused = true)]
async fn a_foreign_change_makes_a_full_sync_after_settling_and_is_counted_once() {
    let h = Harness::started().await;
    run_for(Duration::from_secs(5)).await;
    h.report(ForeignEvent::Changed(chain_missing())).await;
    // The rest of the same reload joins the restore.
    h.report(ForeignEvent::Changed(ForeignChange::removed(
        "rule", "flushed",
    )))
    .await;
    assert_eq!(
        h.syncs().len(),
        1,
        "waits {SETTLE:?} for the rest of a reload"
    );
    run_for(SETTLE).await;
    settle().await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2);
    assert_eq!(syncs[1].kind, SyncKind::Full);
    assert_eq!(h.backend.forgotten(), 1);
    assert_eq!((h.foreign_count("chain"), h.foreign_count("rule")), (1, 0));

    // After the restore, the next change is a new event.
    run_for(Duration::from_secs(1)).await;
    h.report(ForeignEvent::Changed(chain_missing())).await;
    run_for(SETTLE).await;
    settle().await;
    assert_eq!(h.syncs().len(), 3);
    assert_eq!(h.foreign_count("chain"), 2);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn restores_respect_min_sync_period() {
    let h = Harness::start_with(|c| c.with_min_sync_period(Duration::from_secs(5)));
    // Syncs slow enough to earn the whole min sync period of rest (9 × 600 ms > 5 s).
    h.backend.take(Duration::from_millis(600));
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    h.report(ForeignEvent::Changed(chain_missing())).await;
    run_for(Duration::from_secs(4)).await;
    assert_eq!(h.syncs().len(), 1);
    run_for(Duration::from_secs(2)).await;
    assert_eq!(h.syncs().len(), 2);
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_program_that_keeps_changing_the_rules_is_backed_off() {
    let h = Harness::started().await;
    let mut waits = Vec::new();
    for _ in 0..FREE_RESTORES + 2 {
        let before = h.syncs().len();
        let reported = Instant::now();
        h.report(ForeignEvent::Changed(chain_missing())).await;
        while h.syncs().len() == before {
            run_for(Duration::from_millis(10)).await;
        }
        waits.push(reported.elapsed());
    }
    let ms = |d: Duration| d.as_millis();
    let free = &waits[..FREE_RESTORES as usize];
    assert!(free.iter().all(|w| ms(*w) <= ms(SETTLE) + 10), "{waits:?}");
    let first_backoff = waits[FREE_RESTORES as usize];
    assert!(
        first_backoff >= SETTLE + BACKOFF_BASE,
        "backed off: {waits:?}"
    );
    assert!(waits[FREE_RESTORES as usize + 1] >= SETTLE + BACKOFF_BASE * 2);
    assert_eq!(h.foreign_count("chain"), u64::from(FREE_RESTORES) + 2);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_suspect_change_runs_the_check_which_decides() {
    let h = Harness::started().await;
    h.report(ForeignEvent::Suspect).await;
    assert_eq!(h.backend.verifies(), 1);
    run_for(Duration::from_secs(1)).await;
    assert_eq!(h.syncs().len(), 1, "nothing missing: no sync");

    h.backend.find_on_verify(vec![chain_missing()]);
    h.report(ForeignEvent::Suspect).await;
    run_for(SETTLE).await;
    settle().await;
    assert_eq!(h.syncs().len(), 2);
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    assert_eq!(h.foreign_count("chain"), 1);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_canary_period_checks_the_kernel() {
    let period = Duration::from_secs(2);
    let h = Harness::start_with(|c| c.with_canary_period(period));
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    run_for(period * 3).await;
    let verifies = h.backend.verifies();
    assert!((2..=4).contains(&verifies), "{verifies}");
    assert_eq!(h.syncs().len(), 1);

    h.backend.find_on_verify(vec![chain_missing()]);
    run_for(period + SETTLE).await;
    settle().await;
    assert_eq!(h.syncs().len(), 2);
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn paused_canaries_start_when_the_watch_is_lost() {
    let period = Duration::from_secs(2);
    let h = Harness::start_with(|c| {
        c.with_canary_period(period)
            .with_canaries_paused_while_watched(true)
    });
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    run_for(period * 3).await;
    assert_eq!(
        h.backend.verifies(),
        0,
        "the watch notifies: no canary checks"
    );

    h.report(ForeignEvent::WatchLost("read error".into())).await;
    h.backend.find_on_verify(vec![chain_missing()]);
    run_for(period + SETTLE).await;
    settle().await;
    assert!(h.backend.verifies() >= 1);
    assert_eq!(h.syncs().len(), 2, "restored within a canary period");
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    assert_eq!(h.metrics.watch_losses.get(), 1);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_slow_canary_check_rests_nine_times_as_long_before_the_next() {
    let period = Duration::from_secs(2);
    let h = Harness::start_with(|c| c.with_canary_period(period));
    // Each check takes 1 s: the next starts 9 s after it ended, not 2 s (else some 9 checks
    // in 25 s).
    h.backend.verify_take(Duration::from_secs(1));
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    run_for(Duration::from_secs(25)).await;
    let verifies = h.backend.verifies();
    assert!((2..=3).contains(&verifies), "{verifies} checks in 25 s");
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn the_periodic_sync_verifies_first_and_is_full_when_something_is_missing() {
    let h = Harness::started().await;
    run_for(SYNC_PERIOD - Duration::from_secs(1)).await;
    assert_eq!(h.backend.verifies(), 0, "no canary period: no check before");
    h.backend.find_on_verify(vec![chain_missing()]);
    run_for(Duration::from_secs(2)).await;
    assert_eq!(h.backend.verifies(), 1);
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2);
    assert_eq!(syncs[1].kind, SyncKind::Full);
    assert_eq!(h.foreign_count("chain"), 1);

    // Nothing missing: the periodic sync stays partial.
    run_for(SYNC_PERIOD + Duration::from_secs(1)).await;
    assert_eq!(h.backend.verifies(), 2);
    assert_eq!(h.last_sync().kind, SyncKind::Partial);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn changes_before_the_first_sync_are_ignored() {
    let h = Harness::start();
    h.report(ForeignEvent::Changed(chain_missing())).await;
    h.report(ForeignEvent::Suspect).await;
    assert_eq!(h.backend.verifies(), 0);
    assert_eq!(h.foreign_count("chain"), 0);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_restore_that_fails_is_tried_again_soon_not_after_the_retry_interval() {
    let h = Harness::started().await;
    h.backend.fail_next(1);
    h.report(ForeignEvent::Changed(chain_missing())).await;
    run_for(SETTLE).await;
    settle().await;
    assert_eq!(h.syncs().len(), 2, "the failed restore");
    run_for(SETTLE).await;
    settle().await;
    let syncs = h.syncs();
    assert_eq!(
        syncs.len(),
        3,
        "tried again {SETTLE:?} later, well before {SYNC_PERIOD:?}"
    );
    assert_eq!(syncs[2].kind, SyncKind::Full);
    h.stop().await;
}
