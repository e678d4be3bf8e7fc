//! Changes another program made to what the proxy programmed (a firewalld reload, `iptables
//! -F`, `nft flush ruleset`, an agent rewriting the ruleset), sans I/O.
//!
//! Watchers (nf_tables notifications) and the backend's own check ([`Backend::verify`]) report
//! a [`ForeignChange`]; the proxier makes the next sync full, at once, logs and counts the
//! change once, and backs off ([`Backoff`]) when another program keeps undoing its work, so
//! that a fight does not make it spin. [`Activity`] tells a watcher whether the proxier is
//! writing right now, since a change seen then may be its own.
//!
//! [`Backend::verify`]: crate::backend::Backend::verify

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// How long the proxier waits after the first foreign change before it restores, so that the
/// rest of the same reload (firewalld flushes and deletes table by table, one command each)
/// is restored by the same sync and reported as one event.
pub const SETTLE: Duration = Duration::from_millis(150);

/// Restores right after a change this many times in a row before backing off.
pub const FREE_RESTORES: u32 = 3;
/// The first delay once backing off; it doubles with each further change.
pub const BACKOFF_BASE: Duration = Duration::from_millis(250);
/// The longest delay: the rules are back at most this long after a fight stops.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// A change this long after the previous one starts a new streak (longer than the longest
/// delay, so a steady fight never looks calm).
pub const CALM: Duration = Duration::from_secs(5);

/// What another program changed, as one event: what kind of object (the metric's `what`
/// label), whether it took something away, and a readable description for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForeignChange {
    /// `table`, `chain`, `rule`, `jump`, `set`, `element`, `device`, `address`,
    /// `virtual-server`, `real-server`...: a short, bounded label.
    pub what: &'static str,
    /// Something the proxy wrote is gone (rather than altered or added to).
    pub removed: bool,
    /// For example `chain KUBE-SERVICES missing in table nat`.
    pub detail: String,
}

/// The words every foreign-change line starts with, by [`ForeignChange::removed`]: the one
/// place for the wording ([`ForeignChange::log_message`], [`is_log_message`]).
const LOG_REMOVED: &str = "rules of kube-proxy-rs removed by another program: ";
const LOG_CHANGED: &str = "rules of kube-proxy-rs changed by another program: ";

impl ForeignChange {
    /// Something of kind `what` the proxy wrote is gone, as `detail` says.
    pub fn removed(what: &'static str, detail: impl Into<String>) -> Self {
        Self {
            what,
            removed: true,
            detail: detail.into(),
        }
    }

    /// Something of kind `what` the proxy owns was altered or added to, as `detail` says.
    pub fn changed(what: &'static str, detail: impl Into<String>) -> Self {
        Self {
            what,
            removed: false,
            detail: detail.into(),
        }
    }

    /// The line the proxier logs once per event, for example `rules of kube-proxy-rs removed
    /// by another program: chain KUBE-SERVICES missing in table nat; restoring`.
    pub fn log_message(&self) -> String {
        let start = if self.removed {
            LOG_REMOVED
        } else {
            LOG_CHANGED
        };
        format!("{start}{}; restoring", self.detail)
    }
}

/// Whether `line` holds a [`ForeignChange::log_message`] (tests and tools count them).
pub fn is_log_message(line: &str) -> bool {
    line.contains(LOG_REMOVED) || line.contains(LOG_CHANGED)
}

impl fmt::Display for ForeignChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

/// How much a canary check looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// The short-period check: only what is cheap to read at any scale (iptables-legacy
    /// copies a whole table to read one chain, and nat holds every service's rules).
    Canary,
    /// Before periodic syncs and when a watcher cannot tell whose a change was: everything
    /// the check covers.
    Thorough,
}

/// What a watcher tells the proxier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForeignEvent {
    /// Another program changed what the proxy owns.
    Changed(ForeignChange),
    /// Something that may be the proxy's changed while the proxier was writing, so the
    /// watcher cannot tell whose change it was: the proxier runs the backend's check.
    Suspect,
    /// The watcher stopped (why, for the log): nothing notifies of changes any more, so the
    /// proxier starts the canary checks it had paused for it.
    WatchLost(String),
}

/// Whether the proxier is writing to the kernel, shared with watchers (atomics only).
#[derive(Clone, Debug)]
pub struct Activity {
    inner: Arc<ActivityInner>,
}

#[derive(Debug)]
struct ActivityInner {
    base: std::time::Instant,
    busy: AtomicBool,
    /// Milliseconds since `base` when the last write ended.
    last_end_ms: AtomicU64,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            inner: Arc::new(ActivityInner {
                base: std::time::Instant::now(),
                busy: AtomicBool::new(false),
                last_end_ms: AtomicU64::new(0),
            }),
        }
    }
}

impl Activity {
    /// The proxier starts writing.
    pub fn begin(&self) {
        self.inner.busy.store(true, Ordering::SeqCst);
    }

    /// The proxier stopped writing.
    pub fn end(&self) {
        let ms = u64::try_from(self.inner.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.inner.last_end_ms.store(ms, Ordering::SeqCst);
        self.inner.busy.store(false, Ordering::SeqCst);
    }

    /// Whether the proxier is writing now or stopped less than `grace` ago (a change read
    /// now may have been made by that write).
    pub fn writing_within(&self, grace: Duration) -> bool {
        if self.inner.busy.load(Ordering::SeqCst) {
            return true;
        }
        let end = Duration::from_millis(self.inner.last_end_ms.load(Ordering::SeqCst));
        self.inner.base.elapsed().saturating_sub(end) < grace
    }
}

/// How long to wait before restoring after a foreign change: at once at first, then, while
/// changes keep coming less than [`CALM`] apart, doubling delays up to [`BACKOFF_MAX`].
#[derive(Debug, Default)]
pub struct Backoff {
    streak: u32,
    last: Option<Instant>,
}

/// The delay for one change, and whether it is the first one backed off in this streak (the
/// proxier says so once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delay {
    /// Wait this long (after [`SETTLE`]) before restoring.
    pub delay: Duration,
    /// This change started backing off.
    pub started_backing_off: bool,
    /// Changes in the current streak, this one included.
    pub streak: u32,
}

impl Backoff {
    /// Record a change at `now` and say how long to wait before restoring.
    pub fn next(&mut self, now: Instant) -> Delay {
        if self.last.is_some_and(|last| now - last >= CALM) {
            self.streak = 0;
        }
        self.last = Some(now);
        self.streak = self.streak.saturating_add(1);
        let over = self.streak.saturating_sub(FREE_RESTORES);
        let delay = match over {
            0 => Duration::ZERO,
            n => BACKOFF_BASE
                .saturating_mul(1 << (n - 1).min(16))
                .min(BACKOFF_MAX),
        };
        Delay {
            delay,
            started_backing_off: over == 1,
            streak: self.streak,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn backoff_restores_at_once_then_doubles_up_to_the_max() {
        let mut backoff = Backoff::default();
        let delays: Vec<Duration> = (0..8).map(|_| backoff.next(Instant::now()).delay).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            delays,
            [0, 0, 0, 250, 500, 1000, 2000, 2000].map(ms).to_vec()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_says_once_that_it_starts_and_resets_after_calm() {
        let mut backoff = Backoff::default();
        let started: Vec<bool> = (0..6)
            .map(|_| backoff.next(Instant::now()).started_backing_off)
            .collect();
        assert_eq!(started, [false, false, false, true, false, false]);
        tokio::time::advance(CALM).await;
        let after_calm = backoff.next(Instant::now());
        assert_eq!((after_calm.delay, after_calm.streak), (Duration::ZERO, 1));
    }

    #[test]
    fn the_log_message_says_removed_or_changed_and_is_recognised() {
        let removed = ForeignChange::removed("chain", "chain KUBE-SERVICES missing in table nat");
        assert_eq!(
            removed.log_message(),
            "rules of kube-proxy-rs removed by another program: chain KUBE-SERVICES missing in table nat; restoring"
        );
        let changed = ForeignChange::changed("rule", "rule added in chain KUBE-SERVICES");
        assert!(
            changed
                .log_message()
                .starts_with("rules of kube-proxy-rs changed by another program: rule added")
        );
        assert!(is_log_message(&format!(
            "I1128 proxier.rs:1] {}",
            removed.log_message()
        )));
        assert!(is_log_message(&changed.log_message()));
        assert!(!is_log_message(
            "another program keeps changing the rules of kube-proxy-rs; backing off"
        ));
    }

    #[test]
    fn activity_is_writing_while_busy_and_for_the_grace_after() {
        let activity = Activity::default();
        let long_ago = Duration::ZERO;
        assert!(!activity.writing_within(long_ago));
        activity.begin();
        assert!(activity.writing_within(long_ago));
        activity.end();
        assert!(activity.writing_within(Duration::from_secs(3600)));
        assert!(!activity.writing_within(long_ago));
    }
}
