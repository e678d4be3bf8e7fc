//! Runner timing tests on paused tokio time: the runtime jumps straight to each deadline, so
//! elapsed virtual time is exact.

use std::time::Duration;

use tokio::time::{Instant, advance, timeout};

use super::*;

const MIN: Duration = Duration::from_secs(1);
const MAX: Duration = Duration::from_secs(30);
const RETRY: Duration = Duration::from_secs(10);
/// A run long enough to earn the whole `MIN` of rest.
const SLOW: Duration = Duration::from_millis(125);

/// Ends the run in progress after it took `took`.
async fn finish_after(runner: &mut Runner, took: Duration, ok: bool) {
    advance(took).await;
    runner.finished(ok);
}

fn runner() -> Runner {
    Runner::new(MIN, MAX, RETRY)
}

/// Wait for the next run; returns why and how long after `since` it started.
async fn next(runner: &mut Runner, since: Instant) -> (RunReason, Duration) {
    let reason = runner.wait().await;
    (reason, Instant::now() - since)
}

/// Whether `wait` stays pending for a long (virtual) while.
async fn idle(runner: &mut Runner) -> bool {
    timeout(Duration::from_secs(24 * 3600), runner.wait())
        .await
        .is_err()
}

#[tokio::test(start_paused = true)]
async fn nothing_runs_before_the_first_request() {
    let mut runner = runner();
    assert_eq!(runner.next_run(), None);
    assert!(idle(&mut runner).await);
}

#[tokio::test(start_paused = true)]
async fn first_request_runs_immediately_and_bursts_coalesce() {
    let mut runner = runner();
    let start = Instant::now();
    for _ in 0..5 {
        runner.request();
    }
    assert_eq!(
        next(&mut runner, start).await,
        (RunReason::Requested, Duration::ZERO)
    );
    assert!(!runner.is_requested());
    finish_after(&mut runner, SLOW, true).await;

    // A burst right after a slow run: one run, min_interval after the previous one ended.
    let end = Instant::now();
    for _ in 0..100 {
        runner.request();
    }
    assert_eq!(next(&mut runner, end).await, (RunReason::Requested, MIN));
    runner.finished(true);

    // Nothing was left over from the burst: the next run is the periodic one.
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Periodic, MAX));
}

#[tokio::test(start_paused = true)]
async fn a_fast_run_rests_in_proportion_to_how_long_it_took() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    // A 5 ms sync, and a second change right after it: it waits 45 ms, not a second.
    finish_after(&mut runner, Duration::from_millis(5), true).await;
    let end = Instant::now();
    runner.request();
    assert_eq!(
        next(&mut runner, end).await,
        (RunReason::Requested, Duration::from_millis(45))
    );
    // Under a storm of changes, each run rests nine times its length: a tenth of the time
    // goes to syncing.
    let mut busy = Duration::ZERO;
    let storm = Instant::now();
    for _ in 0..100 {
        finish_after(&mut runner, Duration::from_millis(20), true).await;
        busy += Duration::from_millis(20);
        runner.request();
        runner.wait().await;
    }
    let elapsed = Instant::now() - storm;
    assert_eq!(elapsed, Duration::from_millis(100 * 20 + 100 * 180));
    assert_eq!(busy * 10, elapsed);
}

#[tokio::test(start_paused = true)]
async fn a_failed_run_rests_the_whole_min_interval() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    finish_after(&mut runner, Duration::from_millis(1), false).await;
    let end = Instant::now();
    runner.request();
    assert_eq!(next(&mut runner, end).await, (RunReason::Requested, MIN));
}

#[tokio::test(start_paused = true)]
async fn min_interval_is_measured_from_the_end_of_a_run() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    // A slow run (longer than min_interval) with a request arriving during it: the next run
    // waits min_interval after it ended, as upstream's since 1.34 (up to 1.33 it ran at once
    // after such a run: kubernetes#138073).
    advance(Duration::from_millis(2500)).await;
    runner.request();
    assert_eq!(
        runner.next_run(),
        None,
        "nothing starts while a run is in progress"
    );
    runner.finished(true);
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Requested, MIN));
}

#[tokio::test(start_paused = true)]
async fn request_after_min_interval_runs_immediately() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    runner.finished(true);
    advance(Duration::from_secs(5)).await;
    let now = Instant::now();
    runner.request();
    assert_eq!(
        next(&mut runner, now).await,
        (RunReason::Requested, Duration::ZERO)
    );
}

#[tokio::test(start_paused = true)]
async fn periodic_runs_every_max_interval() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    runner.finished(true);
    for _ in 0..3 {
        let end = Instant::now();
        assert_eq!(next(&mut runner, end).await, (RunReason::Periodic, MAX));
        runner.finished(true);
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_resets_the_periodic_timer() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    runner.finished(true);
    advance(Duration::from_secs(20)).await;
    runner.request();
    runner.wait().await;
    runner.finished(true);
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Periodic, MAX));
}

#[tokio::test(start_paused = true)]
async fn failure_is_retried_after_the_retry_interval() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    runner.finished(false);
    assert!(runner.retry_pending());
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Retry, RETRY));
    // Failing again schedules another retry.
    runner.finished(false);
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Retry, RETRY));
    runner.finished(true);
    assert!(!runner.retry_pending());
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Periodic, MAX));
}

#[tokio::test(start_paused = true)]
async fn a_later_success_cancels_the_retry() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    runner.finished(false);
    let end = Instant::now();
    // A change arrives before the retry is due: it runs first (after min_interval).
    runner.request();
    assert_eq!(next(&mut runner, end).await, (RunReason::Requested, MIN));
    runner.finished(true);
    assert!(!runner.retry_pending());
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Periodic, MAX));
}

#[tokio::test(start_paused = true)]
async fn retries_respect_min_interval() {
    let mut runner = Runner::new(Duration::from_secs(5), MAX, Duration::from_secs(1));
    runner.request();
    runner.wait().await;
    runner.finished(false);
    let end = Instant::now();
    assert_eq!(
        next(&mut runner, end).await,
        (RunReason::Retry, Duration::from_secs(5))
    );
}

#[tokio::test(start_paused = true)]
async fn wait_is_cancel_safe() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    finish_after(&mut runner, SLOW, true).await;
    runner.request();
    // Dropped before the deadline: the request is still pending.
    assert!(
        timeout(Duration::from_millis(500), runner.wait())
            .await
            .is_err()
    );
    assert!(runner.is_requested());
    let (reason, _) = next(&mut runner, Instant::now()).await;
    assert_eq!(reason, RunReason::Requested);
}

#[tokio::test(start_paused = true)]
async fn a_recheck_runs_before_the_periodic_run_and_any_run_satisfies_it() {
    let mut runner = runner();
    runner.request();
    runner.wait().await;
    runner.recheck_after(Duration::from_secs(5));
    runner.finished(true);
    let end = Instant::now();
    assert_eq!(
        next(&mut runner, end).await,
        (RunReason::Recheck, Duration::from_secs(5))
    );
    runner.finished(true);
    // Not asked again: the periodic run is next.
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Periodic, MAX));

    // A requested run before the deadline takes the recheck's place.
    runner.recheck_after(Duration::from_secs(20));
    runner.finished(true);
    let end = Instant::now();
    advance(Duration::from_secs(2)).await;
    runner.request();
    assert_eq!(next(&mut runner, end).await.0, RunReason::Requested);
    runner.finished(true);
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Periodic, MAX));
    finish_after(&mut runner, SLOW, true).await;

    // min_interval applies to rechecks too.
    runner.recheck_after(Duration::ZERO);
    let end = Instant::now();
    assert_eq!(next(&mut runner, end).await, (RunReason::Recheck, MIN));
}
