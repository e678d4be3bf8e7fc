//! The benchmark report (`kp-report`): reading back the markdown tables `kp-scale` and
//! `kp-connect` print, and turning the points into `bench/REPORT.md` with SVG plots. Pure:
//! the binary runs the benchmarks and hands the text over; tests feed made-up tables.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::listing::Listing;
use crate::points::Points;
use crate::report::{Table, human};
use crate::svg::{Plot, Scale, Series};
use crate::targets::{self, Verdict};

/// A duration a benchmark reported, or why there is none. Stored in `points.json` as
/// `{"took_s": 1.5}`, `{"timed_out_s": 120.0}` or `{"missing": "why"}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Measured {
    /// Measured.
    #[serde(rename = "took_s")]
    Took(#[serde(with = "secs")] Duration),
    /// Still running when the benchmark gave up after this long.
    #[serde(rename = "timed_out_s")]
    TimedOut(#[serde(with = "secs")] Duration),
    /// Not run or not reported, with the reason (e.g. a smaller size already timed out).
    Missing(String),
}

impl Measured {
    /// Parses a cell written by [`crate::report::Figure`]: `1.55 s`, `45.6 ms`, `789 µs`,
    /// `did not finish in 120 s` (anything after the first duration, e.g. `(render ...)`,
    /// is ignored); anything else is `Missing` with the cell as the reason.
    pub fn parse(cell: &str) -> Self {
        let cell = cell.trim();
        if let Some(rest) = cell.strip_prefix("did not finish in ") {
            return parse_duration(rest)
                .map_or_else(|| Measured::Missing(cell.to_owned()), Measured::TimedOut);
        }
        parse_duration(cell).map_or_else(|| Measured::Missing(cell.to_owned()), Measured::Took)
    }

    /// The duration, when measured.
    pub fn took(&self) -> Option<Duration> {
        match self {
            Measured::Took(d) => Some(*d),
            _ => None,
        }
    }
}

impl std::fmt::Display for Measured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Measured::Took(d) => f.write_str(&human(*d)),
            Measured::TimedOut(limit) => write!(f, "**timed out** (> {})", human(*limit)),
            Measured::Missing(why) if why.is_empty() || why == "-" => f.write_str("-"),
            Measured::Missing(why) => write!(f, "- ({why})"),
        }
    }
}

/// `Measured::Missing("")`: what an older `points.json` without a field stands for.
fn not_reported() -> Measured {
    Measured::Missing(String::new())
}

/// Durations as seconds (`f64`) in `points.json`, readable by anything.
mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

/// `Option<Duration>` as seconds or `null`.
mod opt_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Option::<f64>::deserialize(d)?
            .map(|secs| Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// `Option<(Duration, Duration)>` as `[seconds, seconds]` or `null`.
mod opt_pair_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serialize as _, Serializer};

    pub(super) fn serialize<S: Serializer>(
        d: &Option<(Duration, Duration)>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        d.map(|(a, b)| [a.as_secs_f64(), b.as_secs_f64()])
            .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<(Duration, Duration)>, D::Error> {
        let to = |secs: f64| Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom);
        Option::<[f64; 2]>::deserialize(d)?
            .map(|[a, b]| Ok((to(a)?, to(b)?)))
            .transpose()
    }
}

/// The first `<number> <unit>` in `text` as a duration (`s`, `ms`, `µs`/`us`, `ns`), e.g.
/// `259 µs` in `Partial 259 µs (render 1.0 ms)`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let words: Vec<&str> = text
        .split_whitespace()
        .map(|w| w.trim_matches(|c| matches!(c, '(' | ')' | ',' | ';')))
        .collect();
    words.windows(2).find_map(|pair| {
        let number: f64 = pair[0].parse().ok()?;
        let seconds = match pair[1] {
            "s" => number,
            "ms" => number / 1e3,
            "µs" | "us" => number / 1e6,
            "ns" => number / 1e9,
            _ => return None,
        };
        (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds))
    })
}

/// The first `<number> MiB` of `text`.
pub fn parse_mib(text: &str) -> Option<f64> {
    let mut words = text.split_whitespace();
    let number: f64 = words.next()?.parse().ok()?;
    (words.next()? == "MiB").then_some(number)
}

/// Every markdown table in `text` (a header row, a `---` separator row, then rows).
pub fn parse_tables(text: &str) -> Vec<Table> {
    let cells = |line: &str| -> Vec<String> {
        let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
        inner.split(" |").map(|c| c.trim().to_owned()).collect()
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut tables = Vec::new();
    let mut index = 0;
    while index + 1 < lines.len() {
        let is_row = |l: &str| l.trim_start().starts_with('|');
        let separator = lines[index + 1].trim();
        if is_row(lines[index]) && separator.starts_with("|") && separator.contains("---") {
            let mut table = Table {
                header: cells(lines[index]),
                rows: Vec::new(),
            };
            index += 2;
            while index < lines.len() && is_row(lines[index]) {
                table.rows.push(cells(lines[index]));
                index += 1;
            }
            tables.push(table);
        } else {
            index += 1;
        }
    }
    tables
}

/// The cell of `row` under the column whose name starts with `column`.
pub(crate) fn cell<'a>(table: &Table, row: &'a [String], column: &str) -> Option<&'a str> {
    let at = table.header.iter().position(|h| h.starts_with(column))?;
    row.get(at).map(String::as_str)
}

/// Why a [`ScalePoint`] read from output without a result table has no figures.
pub const NO_TABLE: &str = "no result table";

/// One `kp-scale` run: a mode at a size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalePoint {
    /// The proxy mode.
    pub mode: String,
    /// Services (each with [`ScalePoint::endpoints`] endpoints).
    pub services: usize,
    /// Endpoints per service.
    pub endpoints: usize,
    /// The first full sync (the proxier's `took`).
    pub first_sync: Measured,
    /// The one-service partial sync after an EndpointSlice edit (TCP NodePort service).
    pub partial: Measured,
    /// The same for a UDP service (adds the stale-conntrack cleanup).
    #[serde(default = "not_reported")]
    pub partial_udp: Measured,
    /// Wall clock from that edit (the rename of the manifests file) to the synced line:
    /// the manifests source's share of an edit.
    #[serde(default = "not_reported")]
    pub edit_synced: Measured,
    /// Peak RSS of the proxy (at the time out, when it timed out).
    pub rss_mib: Option<f64>,
    /// 1-minute load average at start → end.
    pub load: String,
    /// `nft list ruleset` after the edits (`kp-scale --list-ruleset`), where it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listing: Option<Listing>,
}

impl ScalePoint {
    /// A point for a run that produced no table (crashed, killed, skipped).
    pub fn missing(mode: &str, services: usize, endpoints: usize, why: &str) -> Self {
        Self {
            mode: mode.to_owned(),
            services,
            endpoints,
            first_sync: Measured::Missing(why.to_owned()),
            partial: Measured::Missing(String::new()),
            partial_udp: Measured::Missing(String::new()),
            edit_synced: Measured::Missing(String::new()),
            rss_mib: None,
            load: "-".to_owned(),
            listing: None,
        }
    }

    /// Reads the first data row of `kp-scale`'s proxy table in `output`.
    pub fn from_output(mode: &str, services: usize, endpoints: usize, output: &str) -> Self {
        let tables = parse_tables(output);
        let Some((table, row)) = tables
            .iter()
            .find_map(|t| cell(t, &t.header, "first sync").and(t.rows.first().map(|r| (t, r))))
        else {
            return Self::missing(mode, services, endpoints, NO_TABLE);
        };
        let get = |column: &str| cell(table, row, column).unwrap_or("-");
        Self {
            mode: mode.to_owned(),
            services,
            endpoints,
            first_sync: Measured::parse(get("first sync (log")),
            partial: Measured::parse(get("partial, TCP")),
            partial_udp: Measured::parse(get("partial, UDP")),
            // `107 ms, 106 ms`: the TCP service's edit, then the UDP one's.
            edit_synced: Measured::parse(get("edit → synced")),
            rss_mib: parse_mib(get("peak RSS")),
            load: get("load").to_owned(),
            listing: Listing::from_output(output),
        }
    }
}

/// What the self-healing checks of the kernel's rules cost in one `kp-scale --checks` run:
/// the canary check (every canary period, where no notification tells of other programs'
/// changes) and the thorough check before a periodic sync.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckPoint {
    /// The proxy mode.
    pub mode: String,
    /// Services (10 endpoints each).
    pub services: usize,
    /// The canary checks' median (`Missing` where none ran: the mode is notified).
    pub canary: Measured,
    /// The canary cell as printed: median, how many, the slowest.
    pub canary_cell: String,
    /// The thorough check.
    pub thorough: Measured,
    /// 1-minute load average while waiting for the thorough check (start → end).
    pub load: String,
}

impl CheckPoint {
    /// A point for a run that printed no checks table, with why.
    pub fn missing(mode: &str, services: usize, why: &str) -> Self {
        Self {
            mode: mode.to_owned(),
            services,
            canary: Measured::Missing(why.to_owned()),
            canary_cell: "-".to_owned(),
            thorough: Measured::Missing(why.to_owned()),
            load: "-".to_owned(),
        }
    }

    /// Reads `kp-scale --checks`'s checks table in `output`, if it printed one.
    pub fn from_output(mode: &str, services: usize, output: &str) -> Option<Self> {
        let tables = parse_tables(output);
        let (table, row) = tables.iter().find_map(|t| {
            cell(t, &t.header, "thorough check").and(t.rows.first().map(|r| (t, r)))
        })?;
        let get = |column: &str| cell(table, row, column).unwrap_or("-");
        Some(Self {
            mode: mode.to_owned(),
            services,
            canary: Measured::parse(get("canary check")),
            canary_cell: get("canary check").to_owned(),
            thorough: Measured::parse(get("thorough check")),
            load: get("load").to_owned(),
        })
    }
}

/// One `kp-connect` measurement: a mode with some services installed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConnectPoint {
    /// The proxy mode.
    pub mode: String,
    /// Services installed (the target included).
    pub services: usize,
    /// The proxy's first sync.
    pub first_sync: Measured,
    /// Connect + 1-byte echo + close through the ClusterIP: median and 99th percentile.
    #[serde(with = "opt_secs")]
    pub p50: Option<Duration>,
    /// See [`ConnectPoint::p50`].
    #[serde(with = "opt_secs")]
    pub p99: Option<Duration>,
    /// The same directly to the pod IP (no DNAT): median and 99th percentile.
    #[serde(with = "opt_pair_secs")]
    pub direct: Option<(Duration, Duration)>,
    /// 1-minute load average at start → end.
    pub load: String,
}

impl ConnectPoint {
    /// A point for a run that produced no table.
    pub fn missing(mode: &str, services: usize, why: &str) -> Self {
        Self {
            mode: mode.to_owned(),
            services,
            first_sync: Measured::Missing(why.to_owned()),
            p50: None,
            p99: None,
            direct: None,
            load: "-".to_owned(),
        }
    }

    /// Reads every row of `kp-connect run`'s table in `output`.
    pub fn from_output(output: &str) -> Vec<Self> {
        let mut points = Vec::new();
        for table in parse_tables(output) {
            if cell(&table, &table.header, "via ClusterIP").is_none() {
                continue;
            }
            for row in &table.rows {
                let get = |column: &str| cell(&table, row, column).unwrap_or("-");
                let pair = |text: &str| {
                    let (a, b) = text.split_once('/')?;
                    Some((parse_duration(a)?, parse_duration(b)?))
                };
                let Ok(services) = get("services").parse() else {
                    continue;
                };
                let via = pair(get("via ClusterIP"));
                points.push(Self {
                    mode: get("mode").to_owned(),
                    services,
                    first_sync: Measured::parse(get("first sync")),
                    p50: via.map(|p| p.0),
                    p99: via.map(|p| p.1),
                    direct: pair(get("direct")),
                    load: get("load").to_owned(),
                });
            }
        }
        points
    }
}

/// Below this 1-minute load average (2 cores) and with no build running, a run is called
/// quiet: the benchmarks themselves keep one core busy at most.
pub const QUIET_LOAD: f64 = 1.5;

/// Whether a machine with this 1-minute load average and this many cargo/rustc processes
/// counts as quiet.
pub fn is_quiet(load_1m: f64, builds: usize) -> bool {
    load_1m < QUIET_LOAD && builds == 0
}

/// What the report says about where and when it was measured.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Environment {
    /// UTC date and time of the start.
    pub date: String,
    /// CPU model, core count, memory.
    pub machine: String,
    /// Kernel and distribution.
    pub system: String,
    /// iptables / nft versions.
    pub tools: String,
    /// Load average and other busy processes at the start.
    pub load_start: String,
    /// The same at the end.
    pub load_end: String,
    /// Nothing else ran at the start or the end: 1-minute load below [`QUIET_LOAD`] and no
    /// build (see [`is_quiet`]); decides how the report describes the machine.
    pub quiet: bool,
    /// How long the whole run took.
    pub duration: String,
    /// The command that produced the report.
    pub command: String,
}

/// The report's files: `REPORT.md` and the plots it links.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// The markdown.
    pub markdown: String,
    /// (file name, SVG document) pairs, next to the markdown.
    pub plots: Vec<(String, String)>,
}

/// File names of the plots.
pub const SYNC_PLOT: &str = "sync-time.svg";
/// See [`SYNC_PLOT`].
pub const RSS_PLOT: &str = "rss.svg";
/// See [`SYNC_PLOT`].
pub const CONNECT_PLOT: &str = "connect-latency.svg";

/// The modes of `points`, in first-seen order.
fn modes_of<'a>(modes: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut seen = Vec::new();
    for mode in modes {
        if !seen.contains(&mode) {
            seen.push(mode);
        }
    }
    seen
}

/// The report's head: how it is made, where and when each series was measured, and whether
/// the machine was busy.
fn header(md: &mut String, points: &Points) {
    let command = points
        .runs
        .first()
        .map_or("kp-report", |r| r.env.command.as_str());
    let _ = writeln!(md, "## How these were measured\n");
    let _ = writeln!(
        md,
        "Generated by `{command}` (one command; it builds the release binaries, runs `kp-scale` \
         per mode and size and `kp-connect` per mode, and writes this file and its plots). The \
         points are kept in `{}` next to this file; `kp-report --modes X,Y` measures only those \
         series again, replaces their points there and renders this file from all stored \
         points, so series may come from different runs (see below).\n",
        crate::points::POINTS_FILE
    );
    let distinct = |pick: &dyn Fn(&crate::points::Run) -> &str| -> String {
        let mut values: Vec<&str> = Vec::new();
        for run in &points.runs {
            let value = pick(run);
            if !value.is_empty() && !values.contains(&value) {
                values.push(value);
            }
        }
        values.join(" / ")
    };
    let _ = writeln!(md, "| | |\n|---|---|");
    for (key, value) in [
        ("machine", distinct(&|r| &r.env.machine)),
        ("system", distinct(&|r| &r.env.system)),
        ("tools", distinct(&|r| &r.env.tools)),
    ] {
        let _ = writeln!(md, "| {key} | {} |", value.replace('|', "\\|"));
    }
    let groups = points.run_groups();
    let _ = writeln!(md);
    if groups.len() > 1 {
        let _ = writeln!(
            md,
            "**These points come from {} different runs** (date, commit and sizes per run \
             below: series measured again on their own with `--modes`, or sizes added with \
             `--merge-from`). Compare points of different runs with care, above all their \
             times.\n",
            groups.len()
        );
    }
    let mut table = Table::new(&[
        "series",
        "where",
        "run started (UTC)",
        "commit",
        "load at series start",
        "load at series end",
        "series took",
        "its sizes (services)",
    ]);
    for run in &points.runs {
        let sizes: Vec<String> = points.sizes_of(run).iter().map(usize::to_string).collect();
        table.row(vec![
            run.series.clone(),
            if run.vm { "test VM" } else { "host" }.to_owned(),
            run.run_date.clone(),
            format!("`{}`", run.commit),
            run.env.load_start.clone(),
            run.env.load_end.clone(),
            run.env.duration.clone(),
            if sizes.is_empty() {
                "-".to_owned()
            } else {
                sizes.join(", ")
            },
        ]);
    }
    let _ = writeln!(md, "{}", table.render());
    let mut busy: Vec<&str> = Vec::new();
    for run in points.runs.iter().filter(|r| !r.env.quiet) {
        if !busy.contains(&run.series.as_str()) {
            busy.push(&run.series);
        }
    }
    if busy.is_empty() {
        let _ = writeln!(
            md,
            "The machine was otherwise quiet (1-minute load average below {QUIET_LOAD} and no \
             build running at the start and end of every series; each point carries its own \
             load). Nothing here is a pass/fail threshold.\n"
        );
    } else {
        let _ = writeln!(
            md,
            "**Other jobs were running on this machine while {} {} measured** (other \
             engineers' builds and tests share its cores; the busy processes at start and end \
             are listed above, and each point carries the 1-minute load average at its start → \
             end). Read those figures as what a busy 2-core node gets. Nothing here is a \
             pass/fail threshold.\n",
            busy.join(", "),
            if busy.len() == 1 { "was" } else { "were" }
        );
    }
}

/// The summary at the top: the targets judged on the stored 10k points, each miss with
/// links to its measured reason and the notes behind it (or the statement that there is
/// none), one line a target.
fn targets_section(md: &mut String, points: &Points, reasons: &[(String, String)]) {
    let _ = writeln!(md, "## Targets ({} × 10)\n", targets::TARGET_SERVICES);
    let _ = writeln!(
        md,
        "Judged on the {} × 10 points below (release build; the ipvs row in the test VM; \
         the load beside each figure). Why a target is missed is written by whoever measured \
         it, in [`{reasons}`]({reasons}) next to this file (one `## <key>` section per \
         target, keys in `tools/kp-bench/src/targets.rs`), with the dated notes in \
         [`notes/`](notes/); a miss without one says so.\n",
        targets::TARGET_SERVICES,
        reasons = targets::REASONS_FILE
    );
    let mut table = Table::new(&["target", "goal", "measured", "verdict", "why"]);
    for row in targets::evaluate(&points.scale) {
        table.row(vec![
            row.target.what.to_owned(),
            row.target.goal(),
            row.measured.clone(),
            match row.verdict {
                Verdict::Met => "met",
                Verdict::Missed => "**missed**",
                Verdict::NotMeasured => "not measured",
            }
            .to_owned(),
            targets::reason_cell(&row, reasons),
        ]);
    }
    let _ = writeln!(md, "{}", table.render());
}

/// What the self-healing checks cost at [`targets::TARGET_SERVICES`], per series.
fn checks_section(md: &mut String, points: &Points) {
    let _ = writeln!(
        md,
        "## Self-healing checks ({} × 10)\n",
        targets::TARGET_SERVICES
    );
    let _ = writeln!(
        md,
        "`kp-scale --checks`: after the partial syncs the proxy's debug lines `checked the rules \
         in the kernel` are read until the thorough check before the next periodic sync \
         (`syncPeriod`, 30 s). The canary check runs every `canaryPeriod` (2 s) only where \
         nothing notifies of other programs' changes (iptables-legacy's filter jumps; ipvs \
         mode's virtual servers, `kube-ipvs0`, its addresses and the ipsets' entry counts, \
         over netlink); nf_tables modes are told by notifications and run only the thorough \
         check. The ipvs row is the test VM's (software emulation, one vCPU).\n"
    );
    let mut table = Table::new(&[
        "mode",
        "canary check (median; n, max)",
        "thorough check",
        "measured",
        "load 1m (start→end)",
    ]);
    let at = targets::TARGET_SERVICES;
    for stored in points.checks.iter().filter(|c| c.point.services == at) {
        let p = &stored.point;
        let canary = match &p.canary {
            Measured::Took(_) => p.canary_cell.clone(),
            Measured::Missing(_) => "none (notified)".to_owned(),
            other => other.to_string(),
        };
        table.row(vec![
            p.mode.clone(),
            canary,
            p.thorough.to_string(),
            format!("{} (`{}`)", stored.date, stored.commit),
            match &stored.host_load {
                Some(host) => format!("{} (guest); host {host}", p.load),
                None => p.load.clone(),
            },
        ]);
    }
    if table.rows.is_empty() {
        let _ = writeln!(md, "Not measured yet (`kp-report --checks-only`).\n");
    } else {
        let _ = writeln!(md, "{}", table.render());
    }
}

/// Builds the report from every stored point, with the targets judged on them and
/// `reasons` (`reasons.md`'s sections, see [`targets::parse_reasons`]) next to the misses.
pub fn render(points: &Points, reasons: &[(String, String)]) -> Report {
    let scale: Vec<ScalePoint> = points.scale.iter().map(|p| p.point.clone()).collect();
    let scale = scale.as_slice();
    let connect: Vec<ConnectPoint> = points.connect.iter().map(|p| p.point.clone()).collect();
    let connect = connect.as_slice();
    let scale_modes = modes_of(scale.iter().map(|p| p.mode.as_str()));
    let connect_modes = modes_of(connect.iter().map(|p| p.mode.as_str()));
    let per_mode = |mode: &str, value: &dyn Fn(&ScalePoint) -> Option<f64>| -> Vec<(f64, f64)> {
        scale
            .iter()
            .filter(|p| p.mode == mode)
            .filter_map(|p| Some((p.services as f64, value(p)?)))
            .collect()
    };
    let sync_plot = Plot {
        title: "First full sync vs services (10 endpoints each)".to_owned(),
        x_label: "services".to_owned(),
        y_label: "first sync, seconds".to_owned(),
        x_scale: Scale::Log,
        y_scale: Scale::Log,
        series: scale_modes
            .iter()
            .map(|mode| {
                Series::new(
                    *mode,
                    per_mode(mode, &|p| p.first_sync.took().map(|d| d.as_secs_f64())),
                )
            })
            .collect(),
    };
    let rss_plot = Plot {
        title: "Peak RSS of the proxy vs services".to_owned(),
        x_label: "services".to_owned(),
        y_label: "peak RSS, MiB".to_owned(),
        x_scale: Scale::Log,
        y_scale: Scale::Linear,
        series: scale_modes
            .iter()
            .map(|mode| {
                // Only runs that finished: an RSS at a time out is a lower bound.
                Series::new(
                    *mode,
                    per_mode(mode, &|p| p.first_sync.took().and(p.rss_mib)),
                )
            })
            .collect(),
    };
    let micros = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1e6);
    let connect_plot = Plot {
        title: "TCP connect latency via a ClusterIP vs installed services".to_owned(),
        x_label: "services installed".to_owned(),
        y_label: "connect + echo + close, µs".to_owned(),
        x_scale: Scale::Log,
        // p50 (tens of µs) and p99 (ms on a busy machine) differ by orders of magnitude.
        y_scale: Scale::Log,
        series: connect_modes
            .iter()
            .flat_map(|mode| {
                let points = |pick: &dyn Fn(&ConnectPoint) -> Option<f64>| -> Vec<(f64, f64)> {
                    connect
                        .iter()
                        .filter(|p| p.mode == *mode)
                        .filter_map(|p| Some((p.services as f64, pick(p)?)))
                        .collect()
                };
                [
                    Series::new(format!("{mode} p50"), points(&|p| micros(p.p50))),
                    Series::new(format!("{mode} p99"), points(&|p| micros(p.p99))).dashed(),
                ]
            })
            .collect(),
    };

    let mut md = String::new();
    let _ = writeln!(md, "# Benchmark report\n");
    targets_section(&mut md, points, reasons);
    header(&mut md, points);
    checks_section(&mut md, points);
    crate::changes::section(&mut md, points);
    crate::listing::section(&mut md, points);
    crate::datapath::section(&mut md, points.datapath.as_ref(), reasons);

    let _ = writeln!(
        md,
        "## Sync time and memory against the number of services\n"
    );
    let _ = writeln!(
        md,
        "`kp-scale`: N Services × 10 endpoints as manifests, the real `kube-proxy` in a network \
         namespace of its own; first full sync as the proxier logs it (`took`), then one \
         EndpointSlice edit and the partial sync it causes; peak RSS (`VmHWM`) of the proxy. \
         A first sync that did not finish within the per-point limit is recorded as \
         **timed out**, and larger sizes of that mode are then skipped. `fake` programs \
         nothing: it is the control plane alone. `iptables-nft` and `iptables-legacy` are \
         iptables mode with `--iptables-backend=nft` / `=legacy`. `ipvs` runs inside the test \
         VM (Debian's kernel under QEMU, usually software emulation, one vCPU), so its times \
         are not comparable with the host's modes, only with each other (its load column is \
         the guest's).\n"
    );
    let _ = writeln!(md, "![first sync vs services]({SYNC_PLOT})\n");
    let _ = writeln!(md, "![peak RSS vs services]({RSS_PLOT})\n");
    let mut table = Table::new(&[
        "mode",
        "services × endpoints",
        "first full sync",
        "one-service partial sync",
        "peak RSS",
        "load 1m (start→end)",
    ]);
    for stored in &points.scale {
        let p = &stored.point;
        table.row(vec![
            p.mode.clone(),
            format!("{} × {}", p.services, p.endpoints),
            p.first_sync.to_string(),
            p.partial.to_string(),
            p.rss_mib.map_or("-".to_owned(), |m| {
                if p.first_sync.took().is_some() {
                    format!("{m:.1} MiB")
                } else {
                    format!("≥ {m:.1} MiB (at the time out)")
                }
            }),
            match &stored.host_load {
                Some(host) => format!("{} (guest); host {host}", p.load),
                None => p.load.clone(),
            },
        ]);
    }
    let _ = writeln!(md, "{}", table.render());

    let _ = writeln!(
        md,
        "## Connection latency against the number of installed services\n"
    );
    let _ = writeln!(
        md,
        "`kp-connect`: client namespace → node namespace (the proxy) → server namespace; N \
         services installed (N−1 dummies with 10 endpoints each, plus the target); sequential \
         connections (connect, one byte echoed, close) to the target's ClusterIP, then \
         directly to the pod IP as a baseline. Solid: p50; dashed: p99.\n"
    );
    let _ = writeln!(
        md,
        "![connect latency vs installed services]({CONNECT_PLOT})\n"
    );
    let mut table = Table::new(&[
        "mode",
        "services installed",
        "first sync",
        "via ClusterIP p50 / p99",
        "direct to pod p50 / p99",
        "load 1m (start→end)",
    ]);
    let pair = |a: Option<Duration>, b: Option<Duration>| match (a, b) {
        (Some(a), Some(b)) => format!("{} / {}", human(a), human(b)),
        _ => "-".to_owned(),
    };
    for p in connect {
        table.row(vec![
            p.mode.clone(),
            p.services.to_string(),
            p.first_sync.to_string(),
            pair(p.p50, p.p99),
            pair(p.direct.map(|d| d.0), p.direct.map(|d| d.1)),
            p.load.clone(),
        ]);
    }
    let _ = writeln!(md, "{}", table.render());
    let _ = writeln!(
        md,
        "## Raw output\n\nThe benchmarks' own tables, as printed (column meanings in \
         `tools/kp-bench/README.md` and `bench/notes/`).\n"
    );
    for section in &points.raw {
        let _ = writeln!(md, "### {}\n\n{}", section.heading, section.text);
    }
    Report {
        markdown: md,
        plots: vec![
            (SYNC_PLOT.to_owned(), sync_plot.render()),
            (RSS_PLOT.to_owned(), rss_plot.render()),
            (CONNECT_PLOT.to_owned(), connect_plot.render()),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Figure;

    #[test]
    fn a_quiet_run_is_told_apart_from_a_busy_one() {
        assert!(is_quiet(0.32, 0));
        assert!(!is_quiet(1.6, 0));
        assert!(!is_quiet(0.3, 2));
        assert!(!is_quiet(f64::NAN, 0));
    }

    #[test]
    fn figures_read_back_as_printed() {
        for d in [
            Duration::from_micros(789),
            Duration::from_micros(45_600),
            Duration::from_millis(160),
            Duration::from_millis(1550),
            Duration::from_secs(150),
        ] {
            let printed = Figure::Took(d).to_string();
            let read = Measured::parse(&printed).took().expect(&printed);
            let error = (read.as_secs_f64() - d.as_secs_f64()).abs() / d.as_secs_f64();
            assert!(error < 0.01, "{printed} read as {read:?}");
        }
        assert_eq!(
            Measured::parse(&Figure::DidNotFinish(Duration::from_secs(120)).to_string()),
            Measured::TimedOut(Duration::from_secs(120))
        );
        assert_eq!(
            Measured::parse("160 ms (render 1.0 ms, restore 89.7 ms)"),
            Measured::Took(Duration::from_millis(160))
        );
        // kp-scale's partial-sync cells start with the sync kind.
        assert_eq!(
            Measured::parse("Partial 259 µs"),
            Measured::Took(Duration::from_micros(259))
        );
        assert!(matches!(Measured::parse("-"), Measured::Missing(_)));
        assert_eq!(parse_mib("49.8 MiB (40.1 MiB now)"), Some(49.8));
        assert_eq!(parse_mib("-"), None);
    }

    const SCALE_OUTPUT: &str = "kp-scale: noise\n\
| N×M | mode / iptables | first sync (log `took`) | start → first sync (wall) | partial, TCP NodePort svc | partial, UDP svc | peak RSS (VmHWM; VmRSS at end) | load 1m (start→end) |\n\
| --- | --- | --- | --- | --- | --- | --- | --- |\n\
| 1000×10 | nftables / nft | 1.55 s | 1.86 s | 160 ms (restore 89.7 ms) | 175 ms | 49.8 MiB (40.1 MiB now) | 1.3→1.2 |\n\n";

    const CONNECT_OUTPUT: &str = "\
| services | mode | first sync (log `took`) | via ClusterIP p50 / p99 | min / max | direct to pod IP p50 / p99 | peak RSS | load 1m |\n\
| --- | --- | --- | --- | --- | --- | --- | --- |\n\
| 1 | iptables | 133 ms | 123 µs / 330 µs | 91 µs / 737 µs | 116 µs / 262 µs | 12.1 MiB | 4.0 |\n\
| 1000 | iptables | did not finish in 120 s | - | - | - | 43.5 MiB | 4.0→3.5 |\n";

    const CHECKS_OUTPUT: &str = "\
| N×M | mode / iptables | canary check (median; n, max) | thorough check (before a periodic sync) | load 1m (start→end) |\n\
| --- | --- | --- | --- | --- |\n\
| 10000×10 | iptables / legacy (--iptables-backend) | 61.2 ms (n 14, max 112 ms) | 4.24 s | 1.1→1.2 |\n";

    #[test]
    fn the_checks_table_is_read_and_reported_at_ten_thousand() {
        let output = format!("{SCALE_OUTPUT}{CHECKS_OUTPUT}");
        let p = CheckPoint::from_output("iptables-legacy", 10_000, &output).expect("a table");
        assert_eq!(p.canary, Measured::Took(Duration::from_micros(61_200)));
        assert_eq!(p.canary_cell, "61.2 ms (n 14, max 112 ms)");
        assert_eq!(p.thorough, Measured::Took(Duration::from_millis(4240)));
        assert_eq!(
            CheckPoint::from_output("nftables", 1000, SCALE_OUTPUT),
            None
        );
        let notified = CHECKS_OUTPUT.replace("61.2 ms (n 14, max 112 ms)", "- (none logged)");
        let n = CheckPoint::from_output("nftables", 10_000, &notified).expect("a table");
        assert!(matches!(n.canary, Measured::Missing(_)));

        let stored = |point: CheckPoint| crate::points::StoredCheck {
            series: point.mode.clone(),
            date: "2026-11-28 09:00 UTC".to_owned(),
            commit: "abc".to_owned(),
            host_load: None,
            point,
        };
        let mut points = Points::default();
        let md = render(&points, &[]).markdown;
        assert!(md.contains("## Self-healing checks (10000 × 10)"), "{md}");
        assert!(md.contains("Not measured yet"), "{md}");
        points.checks = vec![stored(p), stored(n)];
        let md = render(&points, &[]).markdown;
        assert!(
            md.contains("| iptables-legacy | 61.2 ms (n 14, max 112 ms) | 4.24 s | 2026-11-28 09:00 UTC (`abc`) | 1.1→1.2 |"),
            "{md}"
        );
        assert!(
            md.contains("| nftables | none (notified) | 4.24 s |"),
            "{md}"
        );
    }

    #[test]
    fn scale_and_connect_tables_are_read_by_column_name() {
        let p = ScalePoint::from_output("nftables", 1000, 10, SCALE_OUTPUT);
        assert_eq!(p.first_sync, Measured::Took(Duration::from_millis(1550)));
        assert_eq!(p.partial, Measured::Took(Duration::from_millis(160)));
        assert_eq!(p.partial_udp, Measured::Took(Duration::from_millis(175)));
        assert_eq!(p.rss_mib, Some(49.8));
        assert_eq!(p.load, "1.3→1.2");
        let none = ScalePoint::from_output("fake", 10, 10, "crashed");
        assert!(matches!(none.first_sync, Measured::Missing(ref why) if why == "no result table"));

        let points = ConnectPoint::from_output(CONNECT_OUTPUT);
        assert_eq!(points.len(), 2);
        assert_eq!(points[0].p50, Some(Duration::from_micros(123)));
        assert_eq!(points[0].p99, Some(Duration::from_micros(330)));
        assert_eq!(
            points[0].direct,
            Some((Duration::from_micros(116), Duration::from_micros(262)))
        );
        assert_eq!(
            points[1].first_sync,
            Measured::TimedOut(Duration::from_secs(120))
        );
        assert_eq!(points[1].p50, None);
    }

    #[test]
    fn report_has_tables_plots_and_the_circumstances() {
        use crate::points::{RawSection, Run, StoredConnect, StoredScale};

        let env = Environment {
            date: "2026-11-23 19:00".to_owned(),
            machine: "2 vCPU".to_owned(),
            command: "cargo run --release -p kp-bench --bin kp-report".to_owned(),
            load_start: "2.5 (rustc ×3)".to_owned(),
            quiet: false,
            ..Environment::default()
        };
        let stored = |point: ScalePoint| StoredScale {
            series: point.mode.clone(),
            date: "2026-11-23 19:00".to_owned(),
            commit: "abc".to_owned(),
            vm: false,
            host_load: None,
            point,
        };
        let mut scale = vec![
            stored(ScalePoint::from_output("nftables", 1000, 10, SCALE_OUTPUT)),
            stored(ScalePoint {
                first_sync: Measured::TimedOut(Duration::from_secs(120)),
                rss_mib: Some(300.0),
                ..ScalePoint::missing("nftables", 3000, 10, "")
            }),
            stored(ScalePoint::missing(
                "nftables",
                10000,
                10,
                "skipped: 3000 timed out",
            )),
        ];
        let mut ipvs = stored(ScalePoint::from_output("ipvs", 10000, 10, SCALE_OUTPUT));
        ipvs.vm = true;
        ipvs.host_load = Some("6.1→7.2".to_owned());
        ipvs.date = "2026-11-25 12:50 UTC".to_owned();
        scale.push(ipvs);
        let run = |series: &str, date: &str, vm: bool| Run {
            series: series.to_owned(),
            vm,
            commit: format!("commit-{series}"),
            run_date: date.to_owned(),
            env: env.clone(),
        };
        let points = Points {
            runs: vec![
                run("nftables", "2026-11-23 19:00", false),
                run("ipvs", "2026-11-25 12:50 UTC", true),
            ],
            scale,
            connect: ConnectPoint::from_output(CONNECT_OUTPUT)
                .into_iter()
                .map(|point| StoredConnect {
                    series: "nftables".to_owned(),
                    date: String::new(),
                    commit: String::new(),
                    point,
                })
                .collect(),
            raw: vec![RawSection {
                series: "nftables".to_owned(),
                heading: "kp-scale --mode nftables --services 1000".to_owned(),
                text: "RAW\n".to_owned(),
            }],
            ..Points::default()
        };
        let reasons = vec![(
            "nftables-partial".to_owned(),
            "Measured: the\nkernel's floor.".to_owned(),
        )];
        let report = render(&points, &reasons);
        let md = &report.markdown;
        for needle in [
            "2026-11-23 19:00",
            "Other jobs were running",
            "2.5 (rustc ×3)",
            "| nftables | 1000 × 10 | 1.55 s | 160 ms | 49.8 MiB |",
            "**timed out** (> 120 s)",
            "≥ 300.0 MiB (at the time out)",
            "- (skipped: 3000 timed out)",
            "| iptables | 1 | 133 ms | 123 µs / 330 µs | 116 µs / 262 µs |",
            "![first sync vs services](sync-time.svg)",
            "(rss.svg)",
            "(connect-latency.svg)",
            "### kp-scale --mode nftables --services 1000\n\nRAW\n",
            "| nftables | host | 2026-11-23 19:00 | `commit-nftables` | 2.5 (rustc ×3) |",
            "| ipvs | test VM | 2026-11-25 12:50 UTC | `commit-ipvs` |",
            "**These points come from 2 different runs**",
            "while nftables, ipvs were measured",
            "| ipvs | 10000 × 10 | 1.55 s | 160 ms | 49.8 MiB | 1.3→1.2 (guest); host 6.1→7.2 |",
            "## Targets (10000 × 10)",
            // The nftables 10k point was skipped, so its targets have no figure.
            "| nftables one-service change | < 150 ms | - (skipped: 3000 timed out) | not measured | [why](reasons.md#nftables-partial) |",
            "| peak RSS, nftables | < 150 MiB | - (skipped: 3000 timed out) | not measured |",
            "| ipvs one-service change in the VM (10× less than 6–11 s) | < 600 ms | TCP 160 ms, UDP 175 ms (2026-11-25 12:50 UTC, in the VM, load 1.3→1.2 (host 6.1→7.2)) | met |  |",
            "| no fake point at 10000 services | not measured | not measured: no reason recorded (`## fake-rss`) |",
        ] {
            assert!(md.contains(needle), "missing {needle:?} in\n{md}");
        }
        // The targets come first, before how they were measured.
        let targets_at = md.find("## Targets (10000 × 10)").expect("targets");
        assert!(targets_at < md.find("## How these were measured").expect("header"));
        assert!(md.starts_with("# Benchmark report\n\n## Targets"), "{md}");
        let names: Vec<&str> = report.plots.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, [SYNC_PLOT, RSS_PLOT, CONNECT_PLOT]);
        // The timed-out point is not plotted as if it were a measurement.
        let sync_svg = &report.plots[0].1;
        assert_eq!(sync_svg.matches("<circle").count(), 2, "{sync_svg}");
        let connect_svg = &report.plots[2].1;
        assert!(connect_svg.contains("iptables p50") && connect_svg.contains("iptables p99"));
    }
}
