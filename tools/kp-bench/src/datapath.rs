//! The data path side by side (issue 36 item 6): `kp-datapath`'s table as it printed it,
//! when and where it ran, and the socket load balancer's two targets judged from it. Pure.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::report::Table;

/// The paths compared: direct first (the others are relative to it), the control (nftables
/// mode running, the client connecting to the endpoint's own address), nftables mode's
/// DNAT, and the socket load balancer beside it.
pub const PATHS: &str = "direct,endpoint-beside-nftables,nftables,nftables-socket-lb";

/// The Service counts (the benchmark Service alone, and among 10,000).
pub const SIZES: &str = "1,10000";

/// The path the targets are about.
pub const SOCKET_LB: &str = "nftables-socket-lb";

/// Connect set-up p50 at most this many times direct's.
pub const CONNECT_AT_MOST: f64 = 1.05;

/// Throughput (1 and 4 streams) at least this many times direct's.
pub const THROUGHPUT_AT_LEAST: f64 = 0.98;

/// The key of the targets' reason in `bench/reasons.md`.
pub const REASON_KEY: &str = "socket-lb-datapath";

/// One `kp-datapath` run, stored in `points.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredDatapath {
    /// When it started (UTC).
    pub date: String,
    /// The commit its binaries were built from.
    pub commit: String,
    /// Its command line.
    pub command: String,
    /// The 1-minute load at its start → end.
    pub load: String,
    /// Its output: the medians table and the line under it.
    pub text: String,
}

/// The socket load balancer's figures relative to direct at one size (medians of per-round
/// ratios, as `kp-datapath` prints them).
#[derive(Clone, Debug, PartialEq)]
pub struct Ratios {
    /// Services installed.
    pub services: String,
    /// Idle connect+echo p50.
    pub connect: Option<f64>,
    /// 1-stream throughput.
    pub one_stream: Option<f64>,
    /// 4-stream throughput.
    pub four_streams: Option<f64>,
}

impl Ratios {
    /// Both targets met (a missing figure is not met).
    pub fn met(&self) -> bool {
        let at_least = |r: Option<f64>| r.is_some_and(|r| r >= THROUGHPUT_AT_LEAST);
        self.connect.is_some_and(|r| r <= CONNECT_AT_MOST)
            && at_least(self.one_stream)
            && at_least(self.four_streams)
    }
}

/// The socket load balancer's rows of `text` (kp-datapath's table: services, path, 1 stream,
/// 4 streams, connect p50 / p99, ...), one per size.
pub fn socket_lb_ratios(text: &str) -> Vec<Ratios> {
    text.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line
                .trim()
                .strip_prefix('|')?
                .split('|')
                .map(str::trim)
                .collect();
            (cells.get(1) == Some(&SOCKET_LB)).then(|| Ratios {
                services: cells[0].to_owned(),
                one_stream: cells.get(2).and_then(|c| ratio(c)),
                four_streams: cells.get(3).and_then(|c| ratio(c)),
                connect: cells.get(4).and_then(|c| ratio(c)),
            })
        })
        .collect()
}

/// `R` of a cell's `(R× direct)`.
fn ratio(cell: &str) -> Option<f64> {
    let (_, rest) = cell.split_once('(')?;
    let (number, _) = rest.split_once("× direct")?;
    number.trim().parse().ok()
}

/// The report's section: the run, the targets judged from it, and its table.
pub fn section(md: &mut String, stored: Option<&StoredDatapath>, reasons: &[(String, String)]) {
    let _ = writeln!(
        md,
        "## The data path side by side: direct, nftables mode, the socket load balancer\n"
    );
    let _ = writeln!(
        md,
        "`kp-datapath` (`kp-report --datapath`): a client namespace reaches a server namespace \
         through the node; per size and round every path is measured once, rounds outermost. \
         `endpoint-beside-nftables` is the control: nftables mode running, the client \
         connecting to the endpoint's own address (neither DNAT nor the programs). Ratios are \
         per round against the same round's direct figure, then the median. Targets (issue 36): \
         the socket load balancer's connect p50 at most {CONNECT_AT_MOST}× direct, its \
         throughput at least {THROUGHPUT_AT_LEAST}× direct, at both sizes.\n"
    );
    let Some(run) = stored else {
        let _ = writeln!(md, "Not measured yet.\n");
        return;
    };
    let _ = writeln!(
        md,
        "Run {}, commit `{}`, release build, load 1m {}: `{}`\n",
        run.date, run.commit, run.load, run.command
    );
    let mut table = Table::new(&[
        "services",
        "connect p50 vs direct",
        "1 stream vs direct",
        "4 streams vs direct",
        "verdict",
        "why",
    ]);
    let shown = |r: Option<f64>| r.map_or("-".to_owned(), |r| format!("{r:.2}×"));
    for ratios in socket_lb_ratios(&run.text) {
        let met = ratios.met();
        table.row(vec![
            ratios.services.clone(),
            shown(ratios.connect),
            shown(ratios.one_stream),
            shown(ratios.four_streams),
            if met { "met" } else { "**missed**" }.to_owned(),
            if met {
                String::new()
            } else {
                reason_cell(reasons)
            },
        ]);
    }
    let _ = writeln!(md, "{}", table.render());
    let _ = writeln!(md, "{}", run.text.trim_end());
    let _ = writeln!(md);
}

fn reason_cell(reasons: &[(String, String)]) -> String {
    let recorded = reasons
        .iter()
        .any(|(key, text)| key == REASON_KEY && !text.is_empty());
    if recorded {
        format!("[why]({}#{REASON_KEY})", crate::targets::REASONS_FILE)
    } else {
        format!("missed: no measured reason recorded (`## {REASON_KEY}`)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
| services | path | 1 stream | 4 streams | connect+echo p50 / p99 (idle) | p50 / p99 under load |
| --- | --- | --- | --- | --- | --- |
| 1 | direct | 6.43 Gb/s (1.00× direct) | 5.85 Gb/s (1.00× direct) | 105 µs / 6.3 ms | 116 µs / 27.9 ms |
| 1 | nftables-socket-lb | 4.17 Gb/s (1.01× direct) | 5.20 Gb/s (1.31× direct) | 118 µs (1.04× direct) / 5.3 ms | 120 µs / 2.9 ms |
| 10000 | nftables-socket-lb | 9.16 Gb/s (0.97× direct) | 8.64 Gb/s (2.31× direct) | 115 µs (1.13× direct) / 4.1 ms | 117 µs / 4.0 ms |
";

    #[test]
    fn the_socket_lb_rows_are_read_and_judged() {
        let rows = socket_lb_ratios(TABLE);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].services, "1");
        assert_eq!(rows[0].connect, Some(1.04));
        assert_eq!(rows[0].one_stream, Some(1.01));
        assert_eq!(rows[0].four_streams, Some(1.31));
        assert!(rows[0].met());
        assert_eq!(rows[1].connect, Some(1.13));
        assert_eq!(rows[1].one_stream, Some(0.97));
        assert!(!rows[1].met(), "connect and 1-stream throughput both miss");
    }

    #[test]
    fn a_missing_figure_is_not_met() {
        let rows =
            socket_lb_ratios("| 1 | nftables-socket-lb | 4 Gb/s | 5 Gb/s | 118 µs / 5 ms |\n");
        assert_eq!(rows[0].one_stream, None);
        assert!(!rows[0].met());
    }

    #[test]
    fn the_section_shows_the_run_its_verdicts_and_a_missing_reason() {
        let run = StoredDatapath {
            date: "2026-12-03 18:53 UTC".into(),
            commit: "abc".into(),
            command: "kp-datapath --rounds 5".into(),
            load: "0.00→1.2".into(),
            text: TABLE.into(),
        };
        let mut md = String::new();
        section(&mut md, Some(&run), &[]);
        assert!(md.contains("Run 2026-12-03 18:53 UTC, commit `abc`"));
        assert!(
            md.contains("| 1 | 1.04× | 1.01× | 1.31× | met |  |"),
            "{md}"
        );
        assert!(
            md.contains(
                "| 10000 | 1.13× | 0.97× | 2.31× | **missed** | missed: no measured reason"
            )
        );
        let reasons = [(
            REASON_KEY.to_owned(),
            "the control costs the same".to_owned(),
        )];
        let mut md = String::new();
        section(&mut md, Some(&run), &reasons);
        assert!(md.contains("[why](reasons.md#socket-lb-datapath)"));
        let mut md = String::new();
        section(&mut md, None, &[]);
        assert!(md.contains("Not measured yet."));
    }
}
