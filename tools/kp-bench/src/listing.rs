//! `nft list ruleset` of a programmed namespace in the report: reading back the table
//! `kp-scale --list-ruleset` prints (wall time, output size and lines, `nft`'s peak RSS) and
//! the report's section on it, one row per series and size. What a monitoring agent or an
//! operator pays to read the proxy's table, and whether it finishes at all (issue 33 asks it
//! at 100k services). Pure.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::points::Points;
use crate::report::Table;
use crate::summary::{Measured, cell, parse_mib, parse_tables};

/// One `nft list ruleset` of a `kp-scale --list-ruleset` run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Listing {
    /// Its wall time (timed out: killed at kp-scale's limit).
    pub took: Measured,
    /// Output bytes (as far as it got).
    pub bytes: Option<u64>,
    /// Output lines.
    pub lines: Option<u64>,
    /// `nft`'s peak RSS, sampled every 50 ms.
    pub nft_peak_mib: Option<f64>,
}

impl Listing {
    /// The listing table's row in `output`, if it printed one.
    pub fn from_output(output: &str) -> Option<Self> {
        let tables = parse_tables(output);
        let (table, row) = tables.iter().find_map(|t| {
            cell(t, &t.header, "nft list ruleset").and(t.rows.first().map(|r| (t, r)))
        })?;
        let get = |column: &str| cell(table, row, column).unwrap_or("-");
        // `153.2 MiB (160640000 bytes)`.
        let bytes = get("output")
            .split_once('(')
            .and_then(|(_, b)| b.split_whitespace().next()?.parse().ok());
        let wall = get("nft list ruleset");
        // `killed at 4096.0 MiB RSS after 12.0 s`, `failed (...) after 3.1 s`: no listing time.
        let cut = ["killed", "failed", "lost"]
            .iter()
            .any(|w| wall.starts_with(w));
        Some(Self {
            took: if cut {
                Measured::Missing(wall.to_owned())
            } else {
                Measured::parse(wall)
            },
            bytes,
            lines: get("lines").parse().ok(),
            nft_peak_mib: parse_mib(get("nft peak RSS")),
        })
    }
}

/// The report's section: every stored scale point that listed its ruleset (nothing when
/// none did).
pub fn section(md: &mut String, points: &Points) {
    let listed: Vec<_> = points
        .scale
        .iter()
        .filter_map(|s| Some((s, s.point.listing.as_ref()?)))
        .collect();
    if listed.is_empty() {
        return;
    }
    let _ = writeln!(md, "## Listing the ruleset (`nft list ruleset`)\n");
    let _ = writeln!(
        md,
        "`kp-scale --list-ruleset` (the `--changes` points): after the edits, `nft list \
         ruleset` in the proxy's namespace, its output counted as it streams and `nft`'s \
         `VmHWM` sampled every 50 ms; killed at the point's first-sync limit.\n"
    );
    let mut table = Table::new(&[
        "series",
        "services × endpoints",
        "nft list ruleset (wall)",
        "output",
        "lines",
        "nft peak RSS",
        "measured",
    ]);
    for (stored, listing) in listed {
        let p = &stored.point;
        table.row(vec![
            stored.series.clone(),
            format!("{} × {}", p.services, p.endpoints),
            listing.took.to_string(),
            listing.bytes.map_or("-".to_owned(), |b| {
                format!("{:.1} MiB", b as f64 / 1048576.0)
            }),
            listing.lines.map_or("-".to_owned(), |l| l.to_string()),
            listing
                .nft_peak_mib
                .map_or("-".to_owned(), |m| format!("{m:.1} MiB")),
            format!("{} (`{}`)", stored.date, stored.commit),
        ]);
    }
    let _ = writeln!(md, "{}", table.render());
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::points::StoredScale;
    use crate::summary::ScalePoint;

    const LISTING_OUTPUT: &str = "\
| N×M | mode / iptables | first sync (log `took`) | load 1m (start→end) |\n\
| --- | --- | --- | --- |\n\
| 100000×10 | nftables (maps layout) | 6.48 s | 0.5→0.6 |\n\n\
| N×M | mode / iptables | nft list ruleset (wall) | output | lines | nft peak RSS (VmHWM, sampled) | load 1m (start→end) |\n\
| --- | --- | --- | --- | --- | --- | --- |\n\
| 100000×10 | nftables (maps layout) | 12.3 s | 153.2 MiB (160640000 bytes) | 2812345 | 1204.5 MiB | 0.9→1.1 |\n";

    #[test]
    fn the_listing_is_read_into_its_scale_point_and_reported() {
        let listing = Listing::from_output(LISTING_OUTPUT).expect("a listing table");
        assert_eq!(listing.took, Measured::Took(Duration::from_millis(12_300)));
        assert_eq!(listing.bytes, Some(160_640_000));
        assert_eq!(listing.lines, Some(2_812_345));
        assert_eq!(listing.nft_peak_mib, Some(1204.5));
        let timed_out = LISTING_OUTPUT.replace("| 12.3 s |", "| did not finish in 120 s |");
        assert_eq!(
            Listing::from_output(&timed_out).map(|l| l.took),
            Some(Measured::TimedOut(Duration::from_secs(120)))
        );
        let killed =
            LISTING_OUTPUT.replace("| 12.3 s |", "| killed at 4096.0 MiB RSS after 12.0 s |");
        assert_eq!(
            Listing::from_output(&killed).map(|l| l.took),
            Some(Measured::Missing(
                "killed at 4096.0 MiB RSS after 12.0 s".to_owned()
            ))
        );
        let sync_only = LISTING_OUTPUT.split("\n\n").next().expect("first table");
        assert_eq!(Listing::from_output(sync_only), None);

        // The scale point carries it; the report lists it only where there is one.
        let point = ScalePoint::from_output("nftables-maps", 100_000, 10, LISTING_OUTPUT);
        assert_eq!(point.listing, Some(listing));
        let stored = |point: ScalePoint| StoredScale {
            series: "nftables-maps".to_owned(),
            date: "2026-12-02 15:00 UTC".to_owned(),
            commit: "abc".to_owned(),
            vm: false,
            host_load: None,
            point,
        };
        let mut points = Points {
            scale: vec![stored(ScalePoint::from_output(
                "nftables-maps",
                10_000,
                10,
                sync_only,
            ))],
            ..Points::default()
        };
        let mut md = String::new();
        section(&mut md, &points);
        assert_eq!(md, "");
        points.scale.push(stored(point));
        section(&mut md, &points);
        let tables = parse_tables(&md);
        assert_eq!(
            tables[0].rows,
            [[
                "nftables-maps",
                "100000 × 10",
                "12.30 s",
                "153.2 MiB",
                "2812345",
                "1204.5 MiB",
                "2026-12-02 15:00 UTC (`abc`)"
            ]]
        );
    }
}
