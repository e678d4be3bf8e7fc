//! The removal guard: a read of the manifests that would remove many of the known Services
//! at once is applied only after a second read, some time later, agrees. A file caught
//! half-written, or a directory between a tool's delete and re-create, must not empty the
//! node; a real mass removal is only delayed. The decisions are pure (the scanner hands in
//! the time), so they are tested on their own.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// When a read removes too many Services: more than `percent` of the known ones, and at least
/// `min`. Written `50%,100` (the default), or `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemovalGuard {
    /// The share of the known Services, in percent, a read may remove without a second read.
    pub percent: u8,
    /// The fewest removed Services that are held back: smaller removals always apply.
    pub min: usize,
    /// Whether the guard is on.
    pub enabled: bool,
}

impl Default for RemovalGuard {
    fn default() -> Self {
        RemovalGuard {
            percent: 50,
            min: 100,
            enabled: true,
        }
    }
}

impl RemovalGuard {
    /// No guard: every read applies as soon as it is settled.
    pub fn off() -> Self {
        RemovalGuard {
            enabled: false,
            ..RemovalGuard::default()
        }
    }

    /// Whether removing `removed` of `known` Services must wait for a second read.
    pub fn holds(&self, removed: usize, known: usize) -> bool {
        // removed / known > percent / 100, in integers.
        self.enabled
            && removed >= self.min
            && removed.saturating_mul(100) > known.saturating_mul(usize::from(self.percent))
    }
}

impl fmt::Display for RemovalGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.enabled {
            write!(f, "{}%,{}", self.percent, self.min)
        } else {
            f.write_str("off")
        }
    }
}

/// Why a removal guard setting was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid manifests removal guard {value:?}: want PERCENT%,MIN (such as 50%,100) or off")]
pub struct RemovalGuardError {
    /// The value given.
    pub value: String,
}

impl FromStr for RemovalGuard {
    type Err = RemovalGuardError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let error = || RemovalGuardError {
            value: value.to_owned(),
        };
        let value = value.trim();
        if value == "off" {
            return Ok(RemovalGuard::off());
        }
        let (percent, min) = value.split_once(',').ok_or_else(error)?;
        let percent: u8 = percent
            .trim()
            .strip_suffix('%')
            .and_then(|p| p.parse().ok())
            .filter(|p| *p <= 100)
            .ok_or_else(error)?;
        let min = min.trim().parse().map_err(|_| error())?;
        Ok(RemovalGuard {
            percent,
            min,
            enabled: true,
        })
    }
}

/// What to do with a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// Apply it.
    Apply,
    /// Keep the last state; `first` when this read is newly held (log it and count it).
    Hold { first: bool },
}

/// Where a held read stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    Nothing,
    /// Held at `since`; the files are read again once `confirm` has passed.
    Waiting {
        removal: u64,
        since: Instant,
    },
    /// The files are being read again: the next settled read decides.
    Rereading {
        removal: u64,
    },
}

/// The guard's state between polls.
#[derive(Debug)]
pub(super) struct Guard {
    config: RemovalGuard,
    /// How long after holding a read the files are read again.
    confirm: Duration,
    held: Held,
}

impl Guard {
    pub(super) fn new(config: RemovalGuard, confirm: Duration) -> Guard {
        Guard {
            config,
            confirm,
            held: Held::Nothing,
        }
    }

    pub(super) fn config(&self) -> RemovalGuard {
        self.config
    }

    /// A read is held back.
    pub(super) fn holding(&self) -> bool {
        self.held != Held::Nothing
    }

    /// Whether the files must be read again now for a held read's confirmation: once per
    /// hold, when `confirm` has passed.
    pub(super) fn reread_due(&mut self, now: Instant) -> bool {
        match self.held {
            Held::Waiting { removal, since } if now.duration_since(since) >= self.confirm => {
                self.held = Held::Rereading { removal };
                true
            }
            _ => false,
        }
    }

    /// How long until [`Guard::reread_due`], while a read waits.
    pub(super) fn wake_in(&self, now: Instant) -> Option<Duration> {
        match self.held {
            Held::Waiting { since, .. } => {
                Some(self.confirm.saturating_sub(now.duration_since(since)))
            }
            _ => None,
        }
    }

    /// Decide on a read that removes `removed` of `known` Services (`removal`: a hash of
    /// which ones); `settled` when every file has been read since the last change seen.
    pub(super) fn decide(
        &mut self,
        removal: u64,
        removed: usize,
        known: usize,
        settled: bool,
        now: Instant,
    ) -> Decision {
        if !self.config.holds(removed, known) {
            self.held = Held::Nothing;
            return Decision::Apply;
        }
        match self.held {
            Held::Rereading { removal: held } if held == removal && settled => {
                self.held = Held::Nothing;
                Decision::Apply
            }
            Held::Waiting { removal: held, .. } | Held::Rereading { removal: held }
                if held == removal =>
            {
                Decision::Hold { first: false }
            }
            _ => {
                self.held = Held::Waiting {
                    removal,
                    since: now,
                };
                Decision::Hold { first: true }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIRM: Duration = Duration::from_secs(1);

    #[test]
    fn the_default_holds_more_than_half_and_at_least_100() {
        let guard = RemovalGuard::default();
        assert!(!guard.holds(99, 100), "fewer than 100");
        assert!(!guard.holds(100, 200), "exactly half");
        assert!(guard.holds(101, 200));
        assert!(guard.holds(10_000, 10_000));
        assert!(!guard.holds(4_000, 10_000));
        assert!(!RemovalGuard::off().holds(10_000, 10_000));
    }

    #[test]
    fn settings_parse_and_print_alike() {
        for text in ["50%,100", "0%,1", "100%,0", "off"] {
            let guard: RemovalGuard = text.parse().expect(text);
            assert_eq!(guard.to_string(), text);
        }
        assert_eq!(
            " 30% , 5 ".parse(),
            Ok(RemovalGuard {
                percent: 30,
                min: 5,
                enabled: true
            })
        );
        for bad in [
            "", "50", "50%", "50,100", "101%,1", "50%,-1", "half,100", "on",
        ] {
            assert!(bad.parse::<RemovalGuard>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_held_read_applies_only_after_a_settled_reread_agrees() {
        let start = Instant::now();
        let mut guard = Guard::new(RemovalGuard::default(), CONFIRM);
        assert_eq!(
            guard.decide(7, 500, 600, true, start),
            Decision::Hold { first: true }
        );
        assert!(guard.holding());
        // The same read again before the confirmation time: still held, not logged again.
        let soon = start + Duration::from_millis(300);
        assert!(!guard.reread_due(soon));
        assert_eq!(guard.wake_in(soon), Some(Duration::from_millis(700)));
        assert_eq!(
            guard.decide(7, 500, 600, true, soon),
            Decision::Hold { first: false }
        );
        let later = start + CONFIRM;
        assert!(guard.reread_due(later));
        assert!(!guard.reread_due(later), "one re-read per hold");
        // Files still being read again: not yet.
        assert_eq!(
            guard.decide(7, 500, 600, false, later),
            Decision::Hold { first: false }
        );
        assert_eq!(guard.decide(7, 500, 600, true, later), Decision::Apply);
        assert!(!guard.holding());
    }

    #[test]
    fn a_reread_that_disagrees_replaces_or_ends_the_hold() {
        let start = Instant::now();
        let mut guard = Guard::new(RemovalGuard::default(), CONFIRM);
        guard.decide(7, 500, 600, true, start);
        let later = start + CONFIRM;
        assert!(guard.reread_due(later));
        // Other Services removed: a new hold, logged and counted, timed anew.
        assert_eq!(
            guard.decide(8, 450, 600, true, later),
            Decision::Hold { first: true }
        );
        assert!(!guard.reread_due(later));
        assert_eq!(guard.wake_in(later), Some(CONFIRM));
        // The files came back: applied at once, nothing held.
        assert_eq!(guard.decide(0, 0, 600, true, later), Decision::Apply);
        assert!(!guard.holding());
        assert_eq!(guard.wake_in(later), None);
    }

    #[test]
    fn small_removals_never_wait() {
        let mut guard = Guard::new(RemovalGuard::default(), CONFIRM);
        assert_eq!(
            guard.decide(1, 99, 99, true, Instant::now()),
            Decision::Apply
        );
        let mut off = Guard::new(RemovalGuard::off(), CONFIRM);
        assert_eq!(
            off.decide(1, 10_000, 10_000, true, Instant::now()),
            Decision::Apply
        );
    }
}
