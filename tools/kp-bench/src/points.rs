//! The report's measured points, kept in `bench/points.json` next to `bench/REPORT.md`, so a
//! run of some series (`kp-report --modes ipvs`) replaces only those series' points and the
//! report is rendered from all of them (see [`Points::merge`]). Each point carries the date
//! and commit of its run, its load and whether it ran in the test VM. Pure: the binary reads
//! and writes the file.

use serde::{Deserialize, Serialize};

use crate::changes::ChangePoint;
use crate::datapath::StoredDatapath;
use crate::summary::{CheckPoint, ConnectPoint, Environment, Measured, NO_TABLE, ScalePoint};

/// A stored point's series and size: what a newer point of the same replaces.
trait SeriesSize {
    fn series_size(&self) -> (&str, usize);
}

impl SeriesSize for StoredCheck {
    fn series_size(&self) -> (&str, usize) {
        (&self.series, self.point.services)
    }
}

impl SeriesSize for StoredChange {
    fn series_size(&self) -> (&str, usize) {
        (&self.series, self.point.services)
    }
}

/// `stored` without the points `new` replaces (same series and size), then `new`'s.
fn replace_sized<T: SeriesSize + Clone>(mut stored: Vec<T>, new: &[T]) -> Vec<T> {
    stored.retain(|p| !new.iter().any(|n| n.series_size() == p.series_size()));
    stored.extend(new.iter().cloned());
    stored
}

/// The points file's name, next to `REPORT.md`.
pub const POINTS_FILE: &str = "points.json";

/// The format written by this version; a file with another one is refused rather than
/// misread (its points would be lost on the next write).
pub const FORMAT_VERSION: u32 = 1;

/// Where and when one series (a mode of the report, e.g. `ipvs`) was last measured.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Run {
    /// The series' name (`kp-report --modes`).
    pub series: String,
    /// `kp-scale` ran inside the test VM.
    pub vm: bool,
    /// `git describe --always --dirty` of the tree the binaries were built from.
    pub commit: String,
    /// When the `kp-report` invocation that measured it started (UTC): series with the same
    /// `run_date` and `commit` come from one run.
    pub run_date: String,
    /// The series' own circumstances: `date` is when the series started, the loads are at
    /// its start and end, `duration` is how long the series took.
    pub env: Environment,
}

/// A `kp-scale` point with where it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredScale {
    /// The series.
    pub series: String,
    /// When the series' run started (UTC), as [`Run::run_date`].
    pub date: String,
    /// As [`Run::commit`].
    pub commit: String,
    /// Ran inside the test VM (then the point's own load is the guest's).
    pub vm: bool,
    /// The host's 1-minute load at the point's start → end (for VM points; host points'
    /// own load column is already the host's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_load: Option<String>,
    /// The figures.
    pub point: ScalePoint,
}

/// A `kp-connect` point with where it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredConnect {
    /// The series (`point.mode` is the proxy mode, e.g. `iptables` for `iptables-nft`).
    pub series: String,
    /// As [`StoredScale::date`].
    pub date: String,
    /// As [`Run::commit`].
    pub commit: String,
    /// The figures.
    pub point: ConnectPoint,
}

/// A `kp-scale --checks` point (the self-healing checks' cost) with where it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredCheck {
    /// The series.
    pub series: String,
    /// When the run that measured it started (UTC).
    pub date: String,
    /// As [`Run::commit`].
    pub commit: String,
    /// The host's 1-minute load at the point's start → end (for VM points).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_load: Option<String>,
    /// The figures.
    pub point: CheckPoint,
}

/// A `kp-scale --changes` point (one change kind's partial syncs) with where it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredChange {
    /// The series.
    pub series: String,
    /// When the run that measured it started (UTC).
    pub date: String,
    /// As [`Run::commit`].
    pub commit: String,
    /// The figures.
    pub point: ChangePoint,
}

/// A benchmark's output as printed, for the report's raw-output section.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawSection {
    /// The series it belongs to.
    pub series: String,
    /// The command line, e.g. `kp-scale --mode ipvs --services 1000 (in the test VM)`.
    pub heading: String,
    /// Its tables, or how it ended when it printed none.
    pub text: String,
}

impl RawSection {
    /// `kp-connect` sections go after every `kp-scale` one, as the report lists them.
    fn is_connect(&self) -> bool {
        self.heading.starts_with("kp-connect")
    }
}

/// Everything `points.json` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Points {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// One per series measured.
    pub runs: Vec<Run>,
    /// Scale points, by series then size.
    pub scale: Vec<StoredScale>,
    /// Connect-latency points.
    pub connect: Vec<StoredConnect>,
    /// Self-healing check points (absent from files written before they existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<StoredCheck>,
    /// One-service change points, per series and size in the order of the kinds (absent
    /// from files written before they existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<StoredChange>,
    /// The benchmarks' own output.
    pub raw: Vec<RawSection>,
    /// The last data-path side-by-side run (absent from files written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datapath: Option<StoredDatapath>,
}

impl Default for Points {
    fn default() -> Self {
        Self {
            version: FORMAT_VERSION,
            runs: Vec::new(),
            scale: Vec::new(),
            connect: Vec::new(),
            checks: Vec::new(),
            changes: Vec::new(),
            raw: Vec::new(),
            datapath: None,
        }
    }
}

/// Why `points.json` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum PointsError {
    /// Not JSON of the expected shape.
    #[error("points file is not valid")]
    Parse(#[from] serde_json::Error),
    /// Written by a different format version.
    #[error("points file has format version {found}, this kp-report reads {FORMAT_VERSION}")]
    Version {
        /// The file's version.
        found: u32,
    },
}

impl Points {
    /// Reads a points file's text.
    pub fn parse(text: &str) -> Result<Self, PointsError> {
        let points: Points = serde_json::from_str(text)?;
        if points.version != FORMAT_VERSION {
            return Err(PointsError::Version {
                found: points.version,
            });
        }
        Ok(points)
    }

    /// The file's text (pretty, so diffs of `bench/points.json` are readable).
    pub fn to_json(&self) -> String {
        // Plain data (strings, numbers, vectors): serialising it cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    /// The series that have anything stored.
    pub fn series(&self) -> Vec<&str> {
        let mut seen: Vec<&str> = Vec::new();
        let names = (self.runs.iter().map(|r| r.series.as_str()))
            .chain(self.scale.iter().map(|p| p.series.as_str()))
            .chain(self.connect.iter().map(|p| p.series.as_str()))
            .chain(self.checks.iter().map(|p| p.series.as_str()))
            .chain(self.changes.iter().map(|p| p.series.as_str()))
            .chain(self.raw.iter().map(|r| r.series.as_str()));
        for name in names {
            if !seen.contains(&name) {
                seen.push(name);
            }
        }
        seen
    }

    /// `self` with every series that `new` measured (its [`Points::runs`]) replaced by
    /// `new`'s points for it; the other series are kept as they are. Then everything is put
    /// in `order` (see `Points::sort`).
    pub fn merge(mut self, new: Points, order: &[&str]) -> Points {
        let replaced: Vec<String> = new.runs.iter().map(|r| r.series.clone()).collect();
        let kept = |series: &String| !replaced.contains(series);
        self.runs.retain(|r| kept(&r.series));
        self.scale.retain(|p| kept(&p.series));
        self.connect.retain(|p| kept(&p.series));
        self.checks.retain(|p| kept(&p.series));
        self.changes.retain(|p| kept(&p.series));
        self.raw.retain(|r| kept(&r.series));
        self.runs.extend(new.runs);
        self.scale.extend(new.scale);
        self.connect.extend(new.connect);
        self.checks.extend(new.checks);
        self.changes.extend(new.changes);
        self.raw.extend(new.raw);
        if new.datapath.is_some() {
            self.datapath = new.datapath;
        }
        self.sort(order);
        self
    }

    /// Series in `order` (unknown ones last, in the order they came), scale points by size
    /// within a series, `kp-scale` raw sections (by size) before `kp-connect` ones. Stable:
    /// runs of one series stay in the order they were added.
    fn sort(&mut self, order: &[&str]) {
        let rank = |series: &str| {
            order
                .iter()
                .position(|s| *s == series)
                .unwrap_or(order.len())
        };
        self.runs.sort_by_key(|r| rank(&r.series));
        self.scale
            .sort_by_key(|p| (rank(&p.series), p.point.services));
        self.connect
            .sort_by_key(|p| (rank(&p.series), p.point.services));
        self.checks
            .sort_by_key(|p| (rank(&p.series), p.point.services));
        // Stable: the kinds of one point stay in the order they were made.
        self.changes
            .sort_by_key(|p| (rank(&p.series), p.point.services));
        self.raw.sort_by_key(|r| {
            (
                r.is_connect(),
                rank(&r.series),
                heading_services(&r.heading),
            )
        });
    }

    /// `self` with `new`'s points added point by point, for a run of some sizes of a series
    /// that should not replace the series' other sizes (e.g. ipvs at 20k after 1k–10k):
    /// a stored scale point of the same series and size is replaced (with its raw section),
    /// the series' other points stay; `new`'s connect points of a series replace the stored
    /// ones of that series; check and change points replace those of the same series and
    /// size. `new`'s runs are listed beside the series' earlier runs; an
    /// earlier run none of whose points is left is dropped. Then sorted as [`Points::merge`].
    pub fn merge_points(mut self, new: Points, order: &[&str]) -> Points {
        let replaced_scale = |series: &str, services: usize| {
            new.scale
                .iter()
                .any(|p| p.series == series && p.point.services == services)
        };
        let replaced_connect = |series: &str| new.connect.iter().any(|p| p.series == series);
        self.scale
            .retain(|p| !replaced_scale(&p.series, p.point.services));
        self.connect.retain(|p| !replaced_connect(&p.series));
        self.raw.retain(|r| {
            if r.is_connect() {
                !replaced_connect(&r.series)
            } else {
                heading_services(&r.heading).is_none_or(|n| !replaced_scale(&r.series, n))
            }
        });
        self.checks = replace_sized(self.checks, &new.checks);
        self.changes = replace_sized(self.changes, &new.changes);
        let Points {
            version,
            mut runs,
            mut scale,
            mut connect,
            checks,
            changes,
            mut raw,
            datapath,
        } = self;
        runs.retain(|run| {
            let own = |series: &str, date: &str, commit: &str| {
                series == run.series && date == run.run_date && commit == run.commit
            };
            scale.iter().any(|p| own(&p.series, &p.date, &p.commit))
                || connect.iter().any(|p| own(&p.series, &p.date, &p.commit))
                || changes.iter().any(|p| own(&p.series, &p.date, &p.commit))
        });
        runs.extend(new.runs);
        scale.extend(new.scale);
        connect.extend(new.connect);
        raw.extend(new.raw);
        let mut merged = Points {
            version,
            runs,
            scale,
            connect,
            checks,
            changes,
            raw,
            datapath: new.datapath.or(datapath),
        };
        merged.sort(order);
        merged
    }

    /// `self` with `new` check points replacing the stored ones of the same series and
    /// size, every other point kept (`kp-report --checks-only`).
    pub fn merge_checks(mut self, new: Vec<StoredCheck>, order: &[&str]) -> Points {
        self.checks = replace_sized(self.checks, &new);
        self.sort(order);
        self
    }

    /// The scale sizes of `series` whose points came from `run`.
    pub fn sizes_of(&self, run: &Run) -> Vec<usize> {
        self.scale
            .iter()
            .filter(|p| p.series == run.series && p.date == run.run_date && p.commit == run.commit)
            .map(|p| p.point.services)
            .collect()
    }

    /// Every scale point read again from its stored raw output (e.g. after the parser
    /// learnt a column): a point whose section has a result table gets that table's
    /// figures; the others (skipped, failed) stay as they are.
    pub fn reparse(mut self) -> Points {
        for stored in &mut self.scale {
            let services = stored.point.services;
            let section = self.raw.iter().find(|r| {
                r.series == stored.series && heading_services(&r.heading) == Some(services)
            });
            if let Some(section) = section {
                let point = ScalePoint::from_output(
                    &stored.point.mode,
                    services,
                    stored.point.endpoints,
                    &section.text,
                );
                if !matches!(&point.first_sync, Measured::Missing(why) if why == NO_TABLE) {
                    stored.point = point;
                }
            }
        }
        self.reparse_changes();
        self
    }

    /// The change points of each series and size read again from that point's raw output,
    /// where it holds a change table (else they stay as they are).
    fn reparse_changes(&mut self) {
        let mut points: Vec<StoredChange> = Vec::new();
        for stored in &self.changes {
            let (series, services) = stored.series_size();
            if points.iter().any(|p| p.series_size() == (series, services)) {
                continue;
            }
            let section = self
                .raw
                .iter()
                .find(|r| r.series == series && heading_services(&r.heading) == Some(services));
            let read = section.map_or_else(Vec::new, |r| {
                ChangePoint::from_output(&stored.point.mode, services, &r.text)
            });
            if read.is_empty() {
                let same = self
                    .changes
                    .iter()
                    .filter(|p| p.series_size() == (series, services));
                points.extend(same.cloned());
            } else {
                points.extend(read.into_iter().map(|point| StoredChange {
                    point,
                    ..stored.clone()
                }));
            }
        }
        self.changes = points;
    }

    /// Groups of series measured by one run: (run date, commit, series names), in
    /// first-seen order. More than one group means the report mixes runs.
    pub fn run_groups(&self) -> Vec<(String, String, Vec<String>)> {
        let mut groups: Vec<(String, String, Vec<String>)> = Vec::new();
        for run in &self.runs {
            match groups
                .iter_mut()
                .find(|(date, commit, _)| *date == run.run_date && *commit == run.commit)
            {
                Some(group) => group.2.push(run.series.clone()),
                None => groups.push((
                    run.run_date.clone(),
                    run.commit.clone(),
                    vec![run.series.clone()],
                )),
            }
        }
        groups
    }
}

/// Which series a raw-output heading of an older `REPORT.md` belongs to, and whether it ran
/// in the VM: the binary knows the series' command lines.
pub trait SeriesOf {
    /// `heading` is the text after `### `.
    fn series_of(&self, heading: &str) -> Option<(String, bool)>;
}

impl<F: Fn(&str) -> Option<(String, bool)>> SeriesOf for F {
    fn series_of(&self, heading: &str) -> Option<(String, bool)> {
        self(heading)
    }
}

/// The points of a `REPORT.md` written before `points.json` existed (read back from its
/// header and raw-output sections), so the first partial run keeps the other series.
/// `commit` says what is known of the commit that measured them. Sections whose heading no
/// series claims are dropped.
pub fn import_report(markdown: &str, commit: &str, series_of: &impl SeriesOf) -> Points {
    let header = |key: &str| {
        markdown
            .lines()
            .find_map(|l| l.strip_prefix(&format!("| {key} | ")))
            .map(|rest| {
                rest.trim_end()
                    .trim_end_matches('|')
                    .trim()
                    .replace("\\|", "|")
            })
            .unwrap_or_default()
    };
    let env = Environment {
        date: header("date (UTC)"),
        machine: header("machine"),
        system: header("system"),
        tools: header("tools"),
        // The old report has these for the whole run only, not per series.
        load_start: format!("{} (at the run's start)", header("load at start")),
        load_end: format!("{} (at the run's end)", header("load at end")),
        quiet: markdown.contains("The machine was otherwise quiet"),
        duration: format!("{} (the whole run)", header("run took")),
        command: "cargo run --release -p kp-bench --bin kp-report".to_owned(),
    };
    let mut points = Points::default();
    let raw = markdown
        .split_once("\n## Raw output\n")
        .map_or("", |(_, raw)| raw);
    for (heading, text) in sections(raw) {
        let Some((series, vm)) = series_of.series_of(heading) else {
            continue;
        };
        if !points.runs.iter().any(|r| r.series == series) {
            points.runs.push(Run {
                series: series.clone(),
                vm,
                commit: commit.to_owned(),
                run_date: env.date.clone(),
                env: env.clone(),
            });
        }
        if heading.starts_with("kp-scale") {
            if let Some(services) = heading_services(heading) {
                let mut point = ScalePoint::from_output(&series, services, ENDPOINTS, text);
                if matches!(&point.first_sync, Measured::Missing(why) if why == NO_TABLE) {
                    point = ScalePoint::missing(&series, services, ENDPOINTS, text.trim());
                }
                points.scale.push(StoredScale {
                    series: series.clone(),
                    date: env.date.clone(),
                    commit: commit.to_owned(),
                    vm,
                    host_load: None,
                    point,
                });
            }
        } else {
            points
                .connect
                .extend(
                    ConnectPoint::from_output(text)
                        .into_iter()
                        .map(|point| StoredConnect {
                            series: series.clone(),
                            date: env.date.clone(),
                            commit: commit.to_owned(),
                            point,
                        }),
                );
        }
        points.raw.push(RawSection {
            series,
            heading: heading.to_owned(),
            text: text.trim().to_owned() + "\n",
        });
    }
    points
}

/// N of a `kp-scale ... --services N ...` heading.
fn heading_services(heading: &str) -> Option<usize> {
    let (_, rest) = heading.split_once("--services ")?;
    rest.split_whitespace().next()?.parse().ok()
}

/// Endpoints per service of every report point (the issues' N×10).
pub const ENDPOINTS: usize = 10;

/// `### heading` sections of `text`: (heading, body up to the next one).
fn sections(text: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("### ") {
        let after = &rest[start + 4..];
        let (heading, body) = after.split_once('\n').unwrap_or((after, ""));
        let end = body.find("\n### ").map_or(body.len(), |i| i + 1);
        out.push((heading.trim(), &body[..end]));
        rest = &body[end..];
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn run(series: &str, date: &str, commit: &str) -> Run {
        Run {
            series: series.to_owned(),
            vm: series == "ipvs",
            commit: commit.to_owned(),
            run_date: date.to_owned(),
            env: Environment {
                date: date.to_owned(),
                ..Environment::default()
            },
        }
    }

    fn scale(series: &str, services: usize, date: &str, first_ms: u64) -> StoredScale {
        StoredScale {
            series: series.to_owned(),
            date: date.to_owned(),
            commit: "c".to_owned(),
            vm: series == "ipvs",
            host_load: None,
            point: ScalePoint {
                first_sync: Measured::Took(Duration::from_millis(first_ms)),
                ..ScalePoint::missing(series, services, 10, "")
            },
        }
    }

    fn raw(series: &str, heading: &str) -> RawSection {
        RawSection {
            series: series.to_owned(),
            heading: heading.to_owned(),
            text: format!("{series} output\n"),
        }
    }

    const ORDER: &[&str] = &["fake", "nftables", "ipvs"];

    fn host_run() -> Points {
        Points {
            runs: vec![run("fake", "d1", "a"), run("nftables", "d1", "a")],
            scale: vec![
                scale("fake", 1000, "d1", 5),
                scale("nftables", 1000, "d1", 200),
                scale("nftables", 3000, "d1", 600),
            ],
            connect: vec![StoredConnect {
                series: "nftables".to_owned(),
                date: "d1".to_owned(),
                commit: "a".to_owned(),
                point: ConnectPoint::missing("nftables", 1, "x"),
            }],
            raw: vec![
                raw("fake", "kp-scale --mode fake --services 1000"),
                raw("nftables", "kp-scale --mode nftables --services 1000"),
                raw("nftables", "kp-connect run --modes nftables"),
            ],
            ..Points::default()
        }
    }

    #[test]
    fn a_partial_run_replaces_only_its_series_and_keeps_the_order() {
        let ipvs = Points {
            runs: vec![run("ipvs", "d2", "b")],
            scale: vec![
                scale("ipvs", 3000, "d2", 9000),
                scale("ipvs", 1000, "d2", 4000),
            ],
            raw: vec![raw(
                "ipvs",
                "kp-scale --mode ipvs --services 1000 (in the test VM)",
            )],
            ..Points::default()
        };
        let merged = host_run().merge(ipvs, ORDER);
        let series: Vec<(&str, usize)> = merged
            .scale
            .iter()
            .map(|p| (p.series.as_str(), p.point.services))
            .collect();
        assert_eq!(
            series,
            [
                ("fake", 1000),
                ("nftables", 1000),
                ("nftables", 3000),
                ("ipvs", 1000),
                ("ipvs", 3000)
            ]
        );
        // kp-scale sections first (in series order), kp-connect ones after them.
        let headings: Vec<&str> = merged.raw.iter().map(|r| r.heading.as_str()).collect();
        assert_eq!(
            headings,
            [
                "kp-scale --mode fake --services 1000",
                "kp-scale --mode nftables --services 1000",
                "kp-scale --mode ipvs --services 1000 (in the test VM)",
                "kp-connect run --modes nftables",
            ]
        );
        assert_eq!(merged.connect.len(), 1);
        assert_eq!(
            merged.run_groups(),
            [
                (
                    "d1".to_owned(),
                    "a".to_owned(),
                    vec!["fake".to_owned(), "nftables".to_owned()]
                ),
                ("d2".to_owned(), "b".to_owned(), vec!["ipvs".to_owned()]),
            ]
        );

        // Re-running nftables later drops all its old points (scale, connect, raw), even
        // sizes the new run did not reach, and leaves fake and ipvs alone.
        let nft = Points {
            runs: vec![run("nftables", "d3", "c")],
            scale: vec![scale("nftables", 1000, "d3", 150)],
            ..Points::default()
        };
        let merged = merged.merge(nft, ORDER);
        let nft_points: Vec<&StoredScale> = merged
            .scale
            .iter()
            .filter(|p| p.series == "nftables")
            .collect();
        assert_eq!(nft_points.len(), 1);
        assert_eq!(nft_points[0].date, "d3");
        assert!(merged.connect.is_empty());
        assert!(!merged.raw.iter().any(|r| r.series == "nftables"));
        assert_eq!(
            merged.scale.iter().filter(|p| p.series == "ipvs").count(),
            2
        );
        assert_eq!(merged.run_groups().len(), 3);
        assert_eq!(merged.series(), ["fake", "nftables", "ipvs"]);
    }

    #[test]
    fn a_run_of_some_sizes_adds_them_beside_the_series_earlier_points() {
        let first = host_run().merge(
            Points {
                runs: vec![run("ipvs", "d2", "c")],
                scale: vec![scale("ipvs", 1000, "d2", 1), scale("ipvs", 3000, "d2", 3)],
                raw: vec![
                    raw(
                        "ipvs",
                        "kp-scale --mode ipvs --services 1000 (in the test VM)",
                    ),
                    raw(
                        "ipvs",
                        "kp-scale --mode ipvs --services 3000 (in the test VM)",
                    ),
                ],
                ..Points::default()
            },
            ORDER,
        );
        let later_point = |services: usize| StoredScale {
            commit: "d".to_owned(),
            ..scale("ipvs", services, "d3", 2)
        };
        let later = Points {
            runs: vec![run("ipvs", "d3", "d")],
            scale: vec![later_point(20000), later_point(3000)],
            raw: vec![
                raw(
                    "ipvs",
                    "kp-scale --mode ipvs --services 20000 (in the test VM)",
                ),
                raw(
                    "ipvs",
                    "kp-scale --mode ipvs --services 3000 (in the test VM)",
                ),
            ],
            ..Points::default()
        };
        let merged = first.clone().merge_points(later.clone(), ORDER);
        let ipvs: Vec<(usize, &str)> = merged
            .scale
            .iter()
            .filter(|p| p.series == "ipvs")
            .map(|p| (p.point.services, p.date.as_str()))
            .collect();
        assert_eq!(ipvs, [(1000, "d2"), (3000, "d3"), (20000, "d3")]);
        let ipvs_runs: Vec<&Run> = merged.runs.iter().filter(|r| r.series == "ipvs").collect();
        assert_eq!(ipvs_runs.len(), 2);
        assert_eq!(merged.sizes_of(ipvs_runs[0]), [1000]);
        assert_eq!(merged.sizes_of(ipvs_runs[1]), [3000, 20000]);
        let headings: Vec<&str> = merged
            .raw
            .iter()
            .filter(|r| r.series == "ipvs")
            .map(|r| r.heading.as_str())
            .collect();
        assert_eq!(
            headings,
            [
                "kp-scale --mode ipvs --services 1000 (in the test VM)",
                "kp-scale --mode ipvs --services 3000 (in the test VM)",
                "kp-scale --mode ipvs --services 20000 (in the test VM)",
            ]
        );
        // The other series are untouched.
        assert_eq!(
            merged.scale.iter().filter(|p| p.series != "ipvs").count(),
            3
        );
        assert_eq!(merged.connect.len(), 1);
        assert_eq!(merged.run_groups().len(), 3);
        // A run none of whose points is left goes.
        let mut all = later;
        all.scale.push(later_point(1000));
        let merged = first.merge_points(all, ORDER);
        assert_eq!(merged.runs.iter().filter(|r| r.series == "ipvs").count(), 1);
        assert_eq!(merged.run_groups().len(), 2);
    }

    fn check(series: &str, date: &str, thorough_ms: u64) -> StoredCheck {
        StoredCheck {
            series: series.to_owned(),
            date: date.to_owned(),
            commit: "c".to_owned(),
            host_load: None,
            point: CheckPoint {
                thorough: Measured::Took(Duration::from_millis(thorough_ms)),
                ..CheckPoint::missing(series, 10_000, "")
            },
        }
    }

    #[test]
    fn a_checks_run_replaces_only_the_check_points_of_its_series() {
        let mut stored = host_run();
        stored.checks = vec![check("nftables", "d1", 9), check("ipvs", "d1", 50)];
        let merged = stored
            .clone()
            .merge_checks(vec![check("nftables", "d3", 7)], ORDER);
        assert_eq!(merged.scale, stored.scale, "scale points stay");
        assert_eq!(merged.runs, stored.runs);
        let dates: Vec<(&str, &str)> = merged
            .checks
            .iter()
            .map(|c| (c.series.as_str(), c.date.as_str()))
            .collect();
        assert_eq!(dates, [("nftables", "d3"), ("ipvs", "d1")]);
        // A whole run of a series replaces its check points too; a file without any reads.
        let again = merged.merge(
            Points {
                runs: vec![run("ipvs", "d4", "e")],
                ..Points::default()
            },
            ORDER,
        );
        assert_eq!(again.checks.len(), 1);
        let json = stored.to_json();
        let without: String = Points {
            checks: Vec::new(),
            ..stored
        }
        .to_json();
        assert!(json.contains("\"checks\"") && !without.contains("\"checks\""));
        assert!(Points::parse(&without).expect("reads").checks.is_empty());
    }

    /// A `kp-scale --changes` output of `kinds` at `services`, each sync taking `ms`.
    fn changes_output(services: usize, kinds: &[&str], ms: u64) -> String {
        let mut text = format!(
            "| N×M | first sync (log `took`) | load 1m |\n| --- | --- | --- |\n\
| {services}×10 | 1.0 s | 0.5 |\n\n\
| N×M | change | sync (log `took`) | rules written | edit → synced (wall) | load 1m |\n\
| --- | --- | --- | --- | --- | --- |\n"
        );
        for kind in kinds {
            text.push_str(&format!(
                "| {services}×10 | {kind} | Partial {ms} ms | 22 | 9 ms | 0.6 |\n"
            ));
        }
        text
    }

    /// The points a changes run of `series` at `services` on `date` stores.
    fn changes_run(series: &str, services: usize, date: &str, kinds: &[&str], ms: u64) -> Points {
        let text = changes_output(services, kinds, ms);
        let heading = format!("kp-scale --mode nftables-maps --services {services} --changes");
        Points {
            runs: vec![run(series, date, "c")],
            scale: vec![StoredScale {
                point: ScalePoint::from_output(series, services, 10, &text),
                ..scale(series, services, date, 1)
            }],
            changes: ChangePoint::from_output(series, services, &text)
                .into_iter()
                .map(|point| StoredChange {
                    series: series.to_owned(),
                    date: date.to_owned(),
                    commit: "c".to_owned(),
                    point,
                })
                .collect(),
            raw: vec![RawSection {
                text,
                ..raw(series, &heading)
            }],
            ..Points::default()
        }
    }

    #[test]
    fn a_changes_run_replaces_its_sizes_change_points_and_they_read_back_from_raw_output() {
        const ORDER: &[&str] = &["nftables-maps"];
        let kinds = ["EndpointAdded", "AffinityOn"];
        let first = changes_run("nftables-maps", 10_000, "d1", &kinds, 3).merge_points(
            changes_run("nftables-maps", 100_000, "d1", &kinds, 7),
            ORDER,
        );
        assert_eq!(first.changes.len(), 4);
        // A second run of 10k only: its points replace 10k's, 100k's stay, kinds in order.
        let merged =
            first.merge_points(changes_run("nftables-maps", 10_000, "d2", &kinds, 4), ORDER);
        let got: Vec<(usize, &str, &str)> = merged
            .changes
            .iter()
            .map(|c| (c.point.services, c.point.change.as_str(), c.date.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                (10_000, "EndpointAdded", "d2"),
                (10_000, "AffinityOn", "d2"),
                (100_000, "EndpointAdded", "d1"),
                (100_000, "AffinityOn", "d1"),
            ]
        );
        assert_eq!(merged.raw.len(), 2);
        // Stored points read again from their raw output; the file round-trips them.
        let mut edited = merged.clone();
        for c in &mut edited.changes {
            c.point.syncs.clear();
        }
        let again = edited.reparse();
        assert_eq!(again.changes, merged.changes);
        let read = Points::parse(&merged.to_json()).expect("reads");
        assert_eq!(read.changes, merged.changes);
        // A whole run of the series (not --changes) drops its change points.
        let whole = merged.merge(
            Points {
                runs: vec![run("nftables-maps", "d3", "e")],
                ..Points::default()
            },
            ORDER,
        );
        assert!(whole.changes.is_empty());
    }

    #[test]
    fn a_run_of_every_series_replaces_everything() {
        let merged = host_run().merge(host_run(), ORDER);
        assert_eq!(merged, host_run().merge(Points::default(), ORDER));
        assert_eq!(merged.scale.len(), 3);
        assert_eq!(merged.run_groups().len(), 1);
    }

    #[test]
    fn points_are_read_again_from_their_raw_output() {
        let table = "| N×M | first sync (log `took`) | partial, TCP NodePort svc | partial, UDP svc |\n\
| --- | --- | --- | --- |\n\
| 3000×10 | 30.66 s | Partial 19.6 ms | Partial 80.1 ms (conntrack 72.3 ms) |\n";
        let mut points = Points {
            runs: vec![run("ipvs", "d2", "b")],
            scale: vec![
                scale("ipvs", 1000, "d2", 1),
                scale("ipvs", 3000, "d2", 1),
                scale("ipvs", 30000, "d2", 1),
            ],
            raw: vec![
                raw(
                    "ipvs",
                    "kp-scale --mode ipvs --services 1000 (in the test VM)",
                ),
                RawSection {
                    text: table.to_owned(),
                    ..raw(
                        "ipvs",
                        "kp-scale --mode ipvs --services 3000 (in the test VM)",
                    )
                },
            ],
            ..Points::default()
        };
        points.scale[1].host_load = Some("9.5→13.8".to_owned());
        let before = points.clone();
        let after = points.reparse();
        // No table in the 1000 section and no section for 30000: left alone.
        assert_eq!(after.scale[0], before.scale[0]);
        assert_eq!(after.scale[2], before.scale[2]);
        let p = &after.scale[1];
        assert_eq!(
            p.point.first_sync,
            Measured::Took(Duration::from_millis(30_660))
        );
        assert_eq!(
            p.point.partial_udp,
            Measured::Took(Duration::from_micros(80_100))
        );
        assert_eq!(p.host_load.as_deref(), Some("9.5→13.8"));
        assert_eq!(p.date, "d2");
    }

    #[test]
    fn the_file_round_trips_and_other_versions_are_refused() {
        let mut points = host_run();
        points.scale[0].point.partial = Measured::TimedOut(Duration::from_secs(120));
        points.scale[0].point.rss_mib = Some(49.8);
        points.scale[0].host_load = Some("5.1→6.0".to_owned());
        points.connect[0].point.p50 = Some(Duration::from_micros(87));
        points.connect[0].point.direct =
            Some((Duration::from_micros(84), Duration::from_micros(182)));
        let text = points.to_json();
        assert!(text.contains("\"took_s\": 0.005"), "{text}");
        assert!(text.contains("\"timed_out_s\": 120.0"), "{text}");
        let back = Points::parse(&text).expect("parses");
        assert_eq!(back.scale, points.scale);
        assert_eq!(back.connect[0].point.p50, Some(Duration::from_micros(87)));
        assert_eq!(back.connect[0].point.direct, points.connect[0].point.direct);
        let other = text.replacen("\"version\": 1", "\"version\": 2", 1);
        assert!(matches!(
            Points::parse(&other),
            Err(PointsError::Version { found: 2 })
        ));
        assert!(matches!(Points::parse("{"), Err(PointsError::Parse(_))));
    }

    #[test]
    fn an_older_report_is_imported_from_its_header_and_raw_sections() {
        let md = "# Benchmark report\n\n| | |\n|---|---|\n\
| date (UTC) | 2026-11-25 11:38 UTC |\n\
| machine | 2 vCPU |\n\
| load at start | load average 0.32 1.87 3.59 (1, 5, 15 min) |\n\
| run took | 275 s |\n\n\
The machine was otherwise quiet (...)\n\n## Sync time\n\n| mode | x |\n| --- | --- |\n| fake | 1 |\n\n\
## Raw output\n\nThe benchmarks' own tables.\n\n\
### kp-scale --mode fake --services 1000\n\n\
| N×M | first sync (log `took`) | partial, TCP NodePort svc | edit → synced (wall, from the rename) | peak RSS (VmHWM; VmRSS at end) | load 1m (start→end) |\n\
| --- | --- | --- | --- | --- | --- |\n\
| 1000×10 | 5.9 ms | Partial 247 µs | 107 ms, 106 ms | 29.4 MiB (29.4 MiB now) | 0.32→0.32 |\n\n\n\
### kp-scale --mode nftables --services 20000\n\n\
skipped: 10000 services already timed out\n\n\
### kp-scale --mode userspace --services 5\n\nnobody's\n\n\
### kp-connect run --modes nftables\n\n\
| services | mode | first sync (log `took`) | via ClusterIP p50 / p99 | direct to pod IP p50 / p99 | load 1m |\n\
| --- | --- | --- | --- | --- | --- |\n\
| 1 | nftables | 35.0 ms | 84 µs / 169 µs | 76 µs / 200 µs | 1.10→1.10 |\n";
        let series_of = |heading: &str| {
            ["fake", "nftables"]
                .into_iter()
                .find(|s| heading.contains(&format!("--mode {s} ")) || heading.ends_with(s))
                .map(|s| (s.to_owned(), false))
        };
        let points = import_report(md, "cd4bc83", &series_of);
        assert_eq!(points.series(), ["fake", "nftables"]);
        assert_eq!(points.runs[0].run_date, "2026-11-25 11:38 UTC");
        assert_eq!(points.runs[0].commit, "cd4bc83");
        assert_eq!(points.runs[0].env.machine, "2 vCPU");
        assert_eq!(points.runs[0].env.duration, "275 s (the whole run)");
        assert!(points.runs[0].env.quiet);
        assert_eq!(points.scale.len(), 2);
        let fake = &points.scale[0].point;
        assert_eq!(fake.first_sync, Measured::Took(Duration::from_micros(5900)));
        assert_eq!(fake.edit_synced, Measured::Took(Duration::from_millis(107)));
        assert_eq!(fake.rss_mib, Some(29.4));
        assert_eq!(
            points.scale[1].point.first_sync,
            Measured::Missing("skipped: 10000 services already timed out".to_owned())
        );
        assert_eq!(points.connect.len(), 1);
        assert_eq!(points.connect[0].point.p50, Some(Duration::from_micros(84)));
        assert_eq!(points.raw.len(), 3, "the unclaimed section is dropped");
        assert!(points.raw[0].text.contains("| 1000×10 | 5.9 ms |"));
        assert!(!points.raw[0].text.contains("###"));
    }
}
