//! When to sync: upstream's newest sync runner (`pkg/proxy/runner`) as a small state machine.
//!
//! - Requests coalesce: any number of [`Runner::request`]s before a run starts make one run.
//! - Between the *end* of one run and the *start* of the next, the runner rests for
//!   [`REST_PER_RUN`] times as long as the run took, at most `min_interval`; after a failed run,
//!   `min_interval` whole.
//! - At most `max_interval` passes between the end of one run and the start of the next: a
//!   periodic run re-programs the state even when nothing changed.
//! - A failed run schedules a retry `retry_interval` after it ended; any later successful run
//!   cancels it. `min_interval` applies to retries too.
//! - A backend may ask for another run by a deadline ([`Runner::recheck_after`]: ipvs
//!   mode's draining real servers); any run before then satisfies it.
//!
//! The rest is measured from the *end* of the previous run, as upstream's runner has measured
//! `minSyncPeriod` since 1.34 (its timer is reset when a run ends, #131615). Up to 1.33 a
//! token bucket measured it from start to start, so a request made during a run longer than
//! `min_interval` ran again as soon as that run ended: kubernetes#138073 (a 2.8 s sync with
//! `minSyncPeriod` 14 s, the next one 11 s after it ended). A proxy whose syncs are slow
//! (large clusters) gets the whole `min_interval` of rest between them, which is what the
//! setting is for.
//!
//! `min_interval` (`minSyncPeriod`) exists so that a storm of changes cannot keep the proxy
//! syncing all the time: upstream's older runner rests `min_interval` after a burst of two
//! runs, its newer one after every run. Both make a proxy whose syncs take milliseconds wait
//! up to a second for the second of two changes. The rest here is proportional to the run
//! instead: under any storm syncing takes at most a tenth of the time, and a run that takes
//! `min_interval / REST_PER_RUN` or longer (a large cluster's) is followed by the whole
//! `min_interval`, exactly as before.
//!
//! Nothing runs before the first [`Runner::request`]: the periodic and retry timers only
//! start once a run has finished, so the proxier controls when the first run may happen.
//!
//! The runner does not run anything itself: the proxier awaits [`Runner::wait`] (in its
//! `select!`), performs the sync, then reports with [`Runner::finished`].

use std::time::Duration;

use tokio::time::{Instant, sleep_until};

#[cfg(test)]
mod tests;

/// How many times as long as a run the runner rests after it (capped at `min_interval`):
/// during a storm of changes, runs take at most `1 / (1 + REST_PER_RUN)` of the time.
pub const REST_PER_RUN: u32 = 9;

/// Why a run starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunReason {
    /// Something asked for a run (a change, or start-up).
    Requested,
    /// `max_interval` passed since the last run.
    Periodic,
    /// The last run failed and `retry_interval` passed.
    Retry,
    /// The backend asked to look at the kernel again by now ([`Runner::recheck_after`]).
    Recheck,
}

/// Timing of sync runs; see the [module documentation](self).
#[derive(Debug)]
pub struct Runner {
    min_interval: Duration,
    max_interval: Duration,
    retry_interval: Duration,
    /// A run was requested and has not started yet.
    requested: bool,
    /// A run started (wait returned) and has not finished.
    running: bool,
    /// When the last run ended.
    last_end: Option<Instant>,
    /// When the run in progress started.
    started: Option<Instant>,
    /// The rest the last run earns before the next may start.
    rest: Duration,
    /// When a failed run is retried.
    retry_at: Option<Instant>,
    /// When the backend wants another run even without a request.
    recheck_at: Option<Instant>,
}

impl Runner {
    /// A runner with upstream's three intervals (minSyncPeriod, syncPeriod, retry interval).
    pub fn new(min_interval: Duration, max_interval: Duration, retry_interval: Duration) -> Self {
        Self {
            min_interval,
            max_interval,
            retry_interval,
            requested: false,
            running: false,
            last_end: None,
            started: None,
            rest: min_interval,
            retry_at: None,
            recheck_at: None,
        }
    }

    /// Run again within `after` even if nothing is requested (any run before that does
    /// instead). Keeps an earlier pending recheck.
    pub fn recheck_after(&mut self, after: Duration) {
        let at = Instant::now() + after;
        self.recheck_at = Some(self.recheck_at.map_or(at, |pending| pending.min(at)));
    }

    /// Ask for a run as soon as `min_interval` allows. Coalesces with any pending request.
    pub fn request(&mut self) {
        self.requested = true;
    }

    /// Whether a requested run has not started yet.
    pub fn is_requested(&self) -> bool {
        self.requested
    }

    /// Whether a failed run is waiting to be retried.
    pub fn retry_pending(&self) -> bool {
        self.retry_at.is_some()
    }

    /// When the next run will start and why, if anything is scheduled. `None` while a run
    /// is in progress or before anything was requested.
    pub fn next_run(&self) -> Option<(Instant, RunReason)> {
        if self.running {
            return None;
        }
        let earliest = self.last_end.map(|end| end + self.rest);
        let not_before = |at: Instant| earliest.map_or(at, |earliest| at.max(earliest));
        // Candidates in priority order; on a tie the first wins.
        let candidates = [
            self.requested
                .then(|| (not_before(Instant::now()), RunReason::Requested)),
            self.retry_at.map(|at| (not_before(at), RunReason::Retry)),
            self.recheck_at
                .map(|at| (not_before(at), RunReason::Recheck)),
            self.last_end
                .map(|end| (not_before(end + self.max_interval), RunReason::Periodic)),
        ];
        candidates
            .into_iter()
            .flatten()
            .reduce(|best, next| if next.0 < best.0 { next } else { best })
    }

    /// Resolve when the next run should start, and mark it started. Call
    /// [`finished`](Self::finished) when it is done. Never resolves while a run is in
    /// progress or when nothing is scheduled.
    ///
    /// Cancel-safe: nothing changes until it resolves, so it can sit in a `select!` next to
    /// the branch that calls [`request`](Self::request).
    pub async fn wait(&mut self) -> RunReason {
        let Some((at, reason)) = self.next_run() else {
            return std::future::pending().await;
        };
        sleep_until(at).await;
        self.running = true;
        self.started = Some(Instant::now());
        self.requested = false;
        // Whatever the reason, this run looks at the kernel again.
        self.recheck_at = None;
        reason
    }

    /// The run started by [`wait`](Self::wait) ended, successfully or not.
    pub fn finished(&mut self, ok: bool) {
        let now = Instant::now();
        let took = self
            .started
            .take()
            .map_or(Duration::ZERO, |start| now - start);
        self.running = false;
        self.last_end = Some(now);
        self.rest = if ok {
            took.saturating_mul(REST_PER_RUN).min(self.min_interval)
        } else {
            self.min_interval
        };
        self.retry_at = if ok {
            None
        } else {
            Some(now + self.retry_interval)
        };
    }
}
