//! The soak benchmark's figures (the `kp-soak` binary): samples of one process over time and
//! the least-squares slope of each series, so a leak shows as a steady climb per minute rather
//! than as one noisy reading.

use std::time::Duration;

use crate::report::{Table, mib};

/// One reading of the proxy's `/proc` entries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Since the churn started.
    pub at: Duration,
    /// `VmRSS`, KiB.
    pub rss_kib: u64,
    /// Entries of `/proc/PID/fd`.
    pub fds: usize,
    /// `Threads`.
    pub threads: u64,
    /// Endpoint edits written so far.
    pub edits: u64,
}

/// Least-squares slope of `points` (x, y), in y per x; `None` with fewer than two distinct x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    Some(sxy / sxx)
}

/// The summary of one mode's run.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// RSS after the warm-up, KiB.
    pub rss_start_kib: u64,
    /// RSS at the end, KiB.
    pub rss_end_kib: u64,
    /// Highest RSS sampled, KiB.
    pub rss_max_kib: u64,
    /// RSS slope after the warm-up, KiB per minute.
    pub rss_kib_per_min: Option<f64>,
    /// RSS slope over the last half of the samples after the warm-up: growth that is
    /// settling (caches, arenas) falls towards zero here, a leak keeps its slope.
    pub rss_kib_per_min_late: Option<f64>,
    /// Open fds after the warm-up and at the end.
    pub fds: (usize, usize),
    /// fd slope after the warm-up, per minute.
    pub fds_per_min: Option<f64>,
    /// Threads after the warm-up and at the end.
    pub threads: (u64, u64),
    /// Edits over the whole run.
    pub edits: u64,
}

/// Summarise `samples`, ignoring those taken before `warmup` (allocator arenas and caches
/// fill up first; that is growth, not a leak).
pub fn summarise(samples: &[Sample], warmup: Duration) -> Option<Summary> {
    let steady: Vec<&Sample> = samples.iter().filter(|s| s.at >= warmup).collect();
    let (first, last) = (steady.first()?, steady.last()?);
    let minutes = |s: &Sample| s.at.as_secs_f64() / 60.0;
    let rss: Vec<(f64, f64)> = steady
        .iter()
        .map(|s| (minutes(s), s.rss_kib as f64))
        .collect();
    let fds: Vec<(f64, f64)> = steady.iter().map(|s| (minutes(s), s.fds as f64)).collect();
    let late = &rss[rss.len() / 2..];
    Some(Summary {
        rss_start_kib: first.rss_kib,
        rss_end_kib: last.rss_kib,
        rss_max_kib: samples.iter().map(|s| s.rss_kib).max().unwrap_or(0),
        rss_kib_per_min: slope(&rss),
        rss_kib_per_min_late: slope(late),
        fds: (first.fds, last.fds),
        fds_per_min: slope(&fds),
        threads: (first.threads, last.threads),
        edits: samples.last().map_or(0, |s| s.edits),
    })
}

/// The time series as a table, one row per `every` (and the last sample).
pub fn series_table(samples: &[Sample], every: Duration) -> Table {
    let mut table = Table::new(&["t", "RSS", "fds", "threads", "edits"]);
    let mut next = Duration::ZERO;
    for (i, s) in samples.iter().enumerate() {
        if s.at >= next || i + 1 == samples.len() {
            table.row(vec![
                format!("{}s", s.at.as_secs()),
                mib(s.rss_kib),
                s.fds.to_string(),
                s.threads.to_string(),
                s.edits.to_string(),
            ]);
            while next <= s.at {
                next += every;
            }
        }
    }
    table
}

/// `+12.3` style, or `-` when unknown.
pub fn signed(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".to_owned(), |v| format!("{v:+.decimals$}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(secs: u64, rss_kib: u64, fds: usize) -> Sample {
        Sample {
            at: Duration::from_secs(secs),
            rss_kib,
            fds,
            threads: 4,
            edits: secs * 10,
        }
    }

    #[test]
    fn slope_of_a_line_and_of_noise_around_a_flat_level() {
        let line: Vec<(f64, f64)> = (0..10)
            .map(|x| (f64::from(x), 3.0 * f64::from(x) + 7.0))
            .collect();
        let s = slope(&line).expect("slope");
        assert!((s - 3.0).abs() < 1e-9, "{s}");
        let flat = [(0.0, 10.0), (1.0, 12.0), (2.0, 10.0), (3.0, 12.0)];
        assert!(slope(&flat).expect("slope").abs() < 1.0);
        assert_eq!(slope(&[(1.0, 1.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
    }

    #[test]
    fn summary_ignores_the_warm_up() {
        // Fast growth in the first minute, then 100 KiB per minute.
        let mut samples = vec![sample(0, 10_000, 20), sample(30, 40_000, 25)];
        samples.extend((1..=5).map(|m| sample(m * 60, 50_000 + 100 * (m - 1), 30)));
        let summary = summarise(&samples, Duration::from_secs(60)).expect("summary");
        assert_eq!(summary.rss_start_kib, 50_000);
        assert_eq!(summary.rss_end_kib, 50_400);
        assert_eq!(summary.rss_max_kib, 50_400);
        let per_min = summary.rss_kib_per_min.expect("slope");
        assert!((per_min - 100.0).abs() < 1e-6, "{per_min}");
        let late = summary.rss_kib_per_min_late.expect("slope");
        assert!((late - 100.0).abs() < 1e-6, "{late}");
        assert_eq!(summary.fds, (30, 30));
        assert_eq!(summary.fds_per_min, Some(0.0));
        assert_eq!(summary.edits, 3000);
        assert_eq!(summarise(&samples, Duration::from_secs(600)), None);
    }

    #[test]
    fn series_table_keeps_one_row_per_interval_and_the_last() {
        let samples: Vec<Sample> = (0..=13).map(|i| sample(i * 10, 1024, 10)).collect();
        let table = series_table(&samples, Duration::from_secs(60));
        let times: Vec<&str> = table.rows.iter().map(|r| r[0].as_str()).collect();
        assert_eq!(times, ["0s", "60s", "120s", "130s"]);
    }
}
