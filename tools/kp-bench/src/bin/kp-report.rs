//! `kp-report`: one command for the benchmark report. Builds the release binaries, runs
//! `kp-scale` for every mode at a few sizes and `kp-connect` for every kernel mode with a few
//! installed-service counts, each bounded in time, and writes `bench/REPORT.md` with tables
//! and SVG plots (see `kp_bench::summary`). The points are kept in `bench/points.json`
//! (`kp_bench::points`): a run of some modes replaces only theirs, and the report, with issue
//! 16's targets table (`kp_bench::targets`), is rendered from all of them. At 10k services the
//! kernel modes' points also measure the self-healing checks (`kp-scale --checks`);
//! `--checks-only` measures just those. `--changes` runs the verdict-free layout's series
//! with every one-service change kind of issue 33 (`kp-scale --changes`) at `--sizes`, each
//! point replacing only its series' point of that size, and the report gets their per-kind
//! table (`kp_bench::changes`). `--datapath` runs `kp-datapath`'s side-by-side comparison of
//! direct, nftables mode and the socket load balancer (`kp_bench::datapath`). Must run as root (the benchmarks use network namespaces).
//!
//! ```sh
//! cargo run --release -p kp-bench --bin kp-report
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, ValueEnum as _};
use kp_bench::changes::ChangePoint;
use kp_bench::datapath::{self, StoredDatapath};
use kp_bench::generate::Change;
use kp_bench::points::{
    self, ENDPOINTS, Points, RawSection, Run, StoredChange, StoredCheck, StoredConnect,
    StoredScale, import_report,
};
use kp_bench::report::human;
use kp_bench::summary::{self, CheckPoint, ConnectPoint, Environment, Measured, ScalePoint};
use kp_bench::sys;
use kp_bench::targets;

/// A series of the report: a proxy mode (with its variant), and which benchmarks run it.
struct ModeSpec {
    /// The series' name in tables and plots, and in `--modes`.
    name: &'static str,
    /// `kp-scale --mode` / `kp-connect run --modes`.
    proxy_mode: &'static str,
    /// More `kp-scale` arguments (the iptables backend).
    scale_args: &'static [&'static str],
    /// `kp-scale` runs it.
    scale: bool,
    /// `kp-connect run --modes` runs it (a mode that forwards traffic).
    connect: bool,
    /// `kp-scale` runs inside the test VM (tools/kp-vm): the mode needs IPVS, which the
    /// host kernel may lack.
    vm: bool,
    /// The most services a point of this series is run with; larger sizes are recorded as
    /// skipped.
    largest: usize,
    /// Its point at [`targets::TARGET_SERVICES`] also measures the self-healing checks
    /// (`kp-scale --checks`): the kernel modes reading manifests.
    checks: bool,
    /// `kp-report --changes` runs it (`kp-scale --changes`, every kind): the layout issue 33
    /// judges its one-service change kinds on.
    changes: bool,
}

/// Every series, in the order the report lists them: the control plane alone, iptables mode
/// on each backend (chosen with `--iptables-backend`, as an operator would), nftables, and
/// ipvs in the test VM, all reading manifests; then the control plane alone and nftables
/// watching the fake API server (`kp-scale --source api`), as a cluster runs them; then
/// nftables mode's verdict-free layout (`--nftables-layout=maps`, the default; the `nftables`
/// series are `--nftables-layout=chains`) from both sources.
const MODES: &[ModeSpec] = &[
    ModeSpec {
        name: "fake",
        proxy_mode: "fake",
        scale_args: &[],
        scale: true,
        connect: false,
        vm: false,
        largest: usize::MAX,
        checks: false,
        changes: false,
    },
    ModeSpec {
        name: "iptables-nft",
        proxy_mode: "iptables",
        scale_args: &["--iptables", "nft"],
        scale: true,
        // kp-connect's proxy picks its backend itself: nf_tables in an empty namespace.
        connect: true,
        vm: false,
        largest: usize::MAX,
        checks: true,
        changes: false,
    },
    ModeSpec {
        name: "iptables-legacy",
        proxy_mode: "iptables",
        scale_args: &["--iptables", "legacy"],
        scale: true,
        connect: false,
        vm: false,
        largest: usize::MAX,
        checks: true,
        changes: false,
    },
    ModeSpec {
        name: "nftables",
        proxy_mode: "nftables",
        scale_args: &[],
        scale: true,
        connect: true,
        vm: false,
        largest: usize::MAX,
        checks: true,
        changes: false,
    },
    ModeSpec {
        name: "ipvs",
        proxy_mode: "ipvs",
        scale_args: &[],
        scale: true,
        connect: false,
        vm: true,
        // Emulated, 1 vCPU: 20k already takes up to 20 minutes of the run.
        largest: 20_000,
        checks: true,
        changes: false,
    },
    ModeSpec {
        name: "fake-api",
        proxy_mode: "fake",
        scale_args: &["--source", "api"],
        scale: true,
        connect: false,
        vm: false,
        largest: usize::MAX,
        checks: false,
        changes: false,
    },
    ModeSpec {
        name: "nftables-api",
        proxy_mode: "nftables",
        scale_args: &["--source", "api"],
        scale: true,
        connect: false,
        vm: false,
        largest: usize::MAX,
        checks: false,
        changes: false,
    },
    ModeSpec {
        name: "nftables-maps",
        proxy_mode: "nftables-maps",
        scale_args: &[],
        scale: true,
        connect: false,
        vm: false,
        largest: usize::MAX,
        checks: true,
        changes: true,
    },
    ModeSpec {
        name: "nftables-maps-api",
        proxy_mode: "nftables-maps",
        scale_args: &["--source", "api"],
        scale: true,
        connect: false,
        vm: false,
        largest: usize::MAX,
        checks: false,
        changes: true,
    },
    // The edit rewritten in place into one file holding every object, as `cat > file` or a
    // configuration-management tool writes it (issue 34): only where files get that large.
    ModeSpec {
        name: "nftables-maps-in-place",
        proxy_mode: "nftables-maps",
        scale_args: &["--layout", "single", "--write", "in-place"],
        scale: true,
        connect: false,
        vm: false,
        largest: 10_000,
        checks: false,
        changes: false,
    },
];

/// The first-sync limit inside the test VM, in seconds, counted from the proxy's start (so it
/// includes parsing the manifests): under emulation ipvs mode reached its first sync 218 s
/// after start at 1k services (debug build) and 402 s at 10k (release) in earlier runs;
/// 15 minutes lets 20k finish if it scales linearly and bounds it if not.
const DEFAULT_VM_TIMEOUT: u64 = 900;

/// Guest RAM for VM points: the proxy (hundreds of MiB at 20k services), the generated
/// manifests (in the guest's RAM too) and the kernel's IPVS state.
const DEFAULT_VM_MEMORY_MIB: u64 = 3072;

/// Beyond the benchmark's own first-sync limit, how long a run may take (partial syncs of
/// up to two minutes each, building and deleting namespaces) before it is killed.
const RUN_SLACK: Duration = Duration::from_secs(300);

/// How long the data-path run may take (about 15 minutes on a quiet 2-core machine).
const DATAPATH_LIMIT: Duration = Duration::from_secs(3600);

#[derive(Debug, Parser)]
#[command(
    name = "kp-report",
    about = "Run the scale and connect-latency benchmarks of every mode and write bench/REPORT.md with SVG plots"
)]
struct Args {
    /// Modes to run (default: all of them).
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Service counts for the scale benchmark (10 endpoints each).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,3000,10000,20000,50000"
    )]
    sizes: Vec<usize>,
    /// Installed-service counts for the connect-latency benchmark.
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000")]
    connect_services: Vec<usize>,
    /// Connections per connect-latency point.
    #[arg(long, default_value_t = 1000)]
    connections: usize,
    /// Per-point limit on the first sync, in seconds (a longer one is recorded as timed out).
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// The same limit for points run inside the test VM (software emulation is several
    /// times slower than the host).
    #[arg(long, default_value_t = DEFAULT_VM_TIMEOUT)]
    vm_timeout: u64,
    /// Guest RAM for points run inside the test VM, in MiB.
    #[arg(long, default_value_t = DEFAULT_VM_MEMORY_MIB)]
    vm_memory_mib: u64,
    /// Where to write REPORT.md and the plots, and where the points of earlier runs are
    /// kept (`points.json`): the series run now replace theirs, the others stay.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench"))]
    out_dir: PathBuf,
    /// The hand-written reasons of missed targets (`## <target key>` sections).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/reasons.md"))]
    reasons: PathBuf,
    /// Measure nothing: render REPORT.md and the plots again from the stored points (e.g.
    /// after editing the reasons), re-reading each point from its stored raw output.
    #[arg(long)]
    render_only: bool,
    /// Measure nothing: add the points of another `points.json` (e.g. written by a run of
    /// some sizes with `--out-dir`) point by point, replacing only the same series and
    /// sizes, then render.
    #[arg(long)]
    merge_from: Option<PathBuf>,
    /// Use the binaries next to this one as they are (skip `cargo build --release`).
    #[arg(long)]
    no_build: bool,
    /// Measure only the self-healing checks (`kp-scale --checks` at 10000 services) of the
    /// `--modes` that have them, replacing only the stored check points, then render.
    #[arg(long)]
    checks_only: bool,
    /// Measure the one-service change kinds (`kp-scale --changes` with every kind) of the
    /// `--modes` that have them (default: nftables-maps, nftables-maps-api) at `--sizes`;
    /// each point replaces its series' point of that size (its scale figures, change points
    /// and raw output), every other point kept, then render.
    #[arg(long, conflicts_with = "checks_only")]
    changes: bool,
    /// Measure only the data path side by side (`kp-datapath`: direct, nftables mode and the
    /// socket load balancer, with 1 and 10,000 Services), replacing the stored run, then
    /// render.
    #[arg(long, conflicts_with_all = ["checks_only", "changes", "modes"])]
    datapath: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(path) => {
            eprintln!("kp-report: wrote {}", path.display());
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("kp-report: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> anyhow::Result<PathBuf> {
    for name in &args.modes {
        if !MODES.iter().any(|m| m.name == name) {
            let known: Vec<&str> = MODES.iter().map(|m| m.name).collect();
            bail!("unknown mode {name:?} (known: {})", known.join(", "));
        }
    }
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    let mut stored = stored_points(&args.out_dir)?;
    if let Some(other) = &args.merge_from {
        let text = std::fs::read_to_string(other)
            .with_context(|| format!("reading {}", other.display()))?;
        let new = Points::parse(&text)
            .map(Points::reparse)
            .with_context(|| format!("reading {}", other.display()))?;
        stored = stored.merge_points(new, &series_order());
    }
    if args.render_only || args.merge_from.is_some() {
        write_points(&args.out_dir, &stored)?;
    } else if args.datapath {
        if !args.no_build {
            build()?;
        }
        settle(SETTLE_LIMIT);
        stored.datapath = Some(measure_datapath()?);
        write_points(&args.out_dir, &stored)?;
    } else {
        let modes = selected_modes(args)?;
        if !args.no_build {
            build()?;
        }
        settle(SETTLE_LIMIT);
        let run = RunContext {
            date: utc_now(),
            commit: commit(),
            bin_dir: std::env::current_exe()?
                .parent()
                .context("the executable has no directory")?
                .to_owned(),
            work: tempfile::Builder::new().prefix("kp-report-").tempdir()?,
        };
        for mode in modes {
            stored = if args.checks_only {
                measure_checks(args, &run, mode, stored)?
            } else {
                measure_series(args, &run, mode, stored)?
            };
        }
    }
    render(args, &stored)
}

/// The series `args` asks for: `--modes` (all by default); with `--changes` only those
/// that have the change kinds, refusing a named one that has not.
fn selected_modes(args: &Args) -> anyhow::Result<Vec<&'static ModeSpec>> {
    let named = |m: &ModeSpec| args.modes.iter().any(|n| n == m.name);
    if args.changes
        && let Some(m) = MODES.iter().find(|m| named(m) && !m.changes)
    {
        bail!("{} has no change kinds to measure (--changes)", m.name);
    }
    Ok(MODES
        .iter()
        .filter(|m| args.modes.is_empty() || named(m))
        .filter(|m| !args.changes || m.changes)
        .collect())
}

/// What every series of one `kp-report` invocation shares.
struct RunContext {
    /// When the invocation started (UTC).
    date: String,
    /// The tree the binaries were built from.
    commit: String,
    /// Where `kube-proxy`, `kp-scale` and `kp-connect` are.
    bin_dir: PathBuf,
    /// Scratch space for the benchmarks' output files.
    work: tempfile::TempDir,
}

/// The order series are listed in.
fn series_order() -> Vec<&'static str> {
    MODES.iter().map(|m| m.name).collect()
}

/// Runs one series (its scale points, then its connect points) and merges it into
/// `stored`, replacing what was stored for it. `points.json` is rewritten after every point,
/// so an interrupted series keeps the points it finished.
fn measure_series(
    args: &Args,
    run: &RunContext,
    mode: &ModeSpec,
    stored: Points,
) -> anyhow::Result<Points> {
    let started = Instant::now();
    let (load_start, quiet_start) = load_and_neighbours();
    let mut series = Points {
        runs: vec![Run {
            series: mode.name.to_owned(),
            vm: mode.vm,
            commit: run.commit.clone(),
            run_date: run.date.clone(),
            env: Environment {
                date: utc_now(),
                machine: machine(),
                system: system(),
                tools: tools(),
                load_start,
                load_end: "(series still running)".to_owned(),
                quiet: quiet_start,
                duration: "(series still running)".to_owned(),
                command: format!(
                    "cargo run --release -p kp-bench --bin kp-report{}",
                    if args.changes { " -- --changes" } else { "" }
                ),
            },
        }],
        ..Points::default()
    };
    let order = series_order();
    let save = |series: &Points| -> anyhow::Result<Points> {
        // A changes run measures some sizes of the series: only those are replaced.
        let merged = if args.changes {
            stored.clone().merge_points(series.clone(), &order)
        } else {
            stored.clone().merge(series.clone(), &order)
        };
        write_points(&args.out_dir, &merged)?;
        Ok(merged)
    };
    let kube_proxy = run.bin_dir.join("kube-proxy");
    let stored_scale = |point: ScalePoint, host_load: Option<String>| StoredScale {
        series: mode.name.to_owned(),
        date: run.date.clone(),
        commit: run.commit.clone(),
        vm: mode.vm,
        host_load,
        point,
    };

    let mut timed_out_at = None;
    for &services in args.sizes.iter().filter(|_| mode.scale) {
        let heading = point_heading(args, mode, services);
        let skipped = match timed_out_at {
            Some(smaller) => Some(format!("skipped: {smaller} services already timed out")),
            None if services > mode.largest => Some(format!(
                "skipped: this series runs at most {} services",
                mode.largest
            )),
            None => None,
        };
        if let Some(why) = skipped {
            series.scale.push(stored_scale(
                ScalePoint::missing(mode.name, services, ENDPOINTS, &why),
                None,
            ));
            series.raw.push(RawSection {
                series: mode.name.to_owned(),
                heading,
                text: format!("{why}\n"),
            });
            continue;
        }
        let host_load_start = load_1m();
        // A changes run leaves the check points as they are.
        let checks = mode.checks && services == targets::TARGET_SERVICES && !args.changes;
        let (text, status) = scale_point(args, run, mode, services, checks)?;
        let point = if text.is_empty() {
            ScalePoint::missing(mode.name, services, ENDPOINTS, &status)
        } else {
            ScalePoint::from_output(mode.name, services, ENDPOINTS, &text)
        };
        // A run killed at its bound did not finish its first sync in time either.
        if matches!(point.first_sync, Measured::TimedOut(_)) || status.contains("killed after") {
            timed_out_at = Some(services);
        }
        eprintln!(
            "kp-report: scale {} {services}×{ENDPOINTS}: first sync {}",
            mode.name, point.first_sync
        );
        // VM points carry the guest's load; the host's is what else ran on the machine.
        let host_load = mode.vm.then(|| format!("{host_load_start}→{}", load_1m()));
        if checks {
            let point = check_point(mode, services, &text, &status);
            series
                .checks
                .push(stored_check(run, mode, point, host_load.clone()));
        }
        series.changes.extend(
            ChangePoint::from_output(mode.name, services, &text)
                .into_iter()
                .map(|point| StoredChange {
                    series: mode.name.to_owned(),
                    date: run.date.clone(),
                    commit: run.commit.clone(),
                    point,
                }),
        );
        series.scale.push(stored_scale(point, host_load));
        series.raw.push(RawSection {
            series: mode.name.to_owned(),
            heading,
            text: if text.is_empty() { status } else { text },
        });
        save(&series)?;
    }

    if mode.connect && !args.changes {
        let (points, section) = connect_series(args, run, mode, &kube_proxy)?;
        series
            .connect
            .extend(points.into_iter().map(|point| StoredConnect {
                series: mode.name.to_owned(),
                date: run.date.clone(),
                commit: run.commit.clone(),
                point,
            }));
        series.raw.push(section);
    }

    let (load_end, quiet_end) = load_and_neighbours();
    if let Some(run) = series.runs.first_mut() {
        run.env.load_end = load_end;
        run.env.quiet = run.env.quiet && quiet_end;
        run.env.duration = human(started.elapsed());
    }
    save(&series)
}

/// The self-healing checks of `mode` alone (`--checks-only`): one `kp-scale --checks` run at
/// [`targets::TARGET_SERVICES`], whose check point replaces the stored one; its scale figures
/// are not kept (they stay those of the series' own run). `points.json` is rewritten after.
fn measure_checks(
    args: &Args,
    run: &RunContext,
    mode: &ModeSpec,
    stored: Points,
) -> anyhow::Result<Points> {
    if !mode.checks {
        eprintln!(
            "kp-report: {} has no self-healing checks to measure",
            mode.name
        );
        return Ok(stored);
    }
    let services = targets::TARGET_SERVICES;
    let host_load_start = load_1m();
    let (text, status) = scale_point(args, run, mode, services, true)?;
    let point = check_point(mode, services, &text, &status);
    eprintln!(
        "kp-report: checks {} {services}×{ENDPOINTS}: canary {}, thorough {}",
        mode.name, point.canary, point.thorough
    );
    let host_load = mode.vm.then(|| format!("{host_load_start}→{}", load_1m()));
    let merged = stored.merge_checks(
        vec![stored_check(run, mode, point, host_load)],
        &series_order(),
    );
    write_points(&args.out_dir, &merged)?;
    Ok(merged)
}

/// `points.json` in `out_dir`, rewritten with `points`: every measuring branch calls it as
/// soon as it has a point, so a run that renders the report also keeps what it rendered.
fn write_points(out_dir: &Path, points: &Points) -> anyhow::Result<()> {
    let path = out_dir.join(points::POINTS_FILE);
    std::fs::write(&path, points.to_json()).with_context(|| format!("writing {}", path.display()))
}

/// One `kp-scale` point of `mode` on the host or in the test VM (`checks`: with
/// `--checks`): (its tables, how it ended).
fn scale_point(
    args: &Args,
    run: &RunContext,
    mode: &ModeSpec,
    services: usize,
    checks: bool,
) -> anyhow::Result<(String, String)> {
    let kube_proxy = run.bin_dir.join("kube-proxy");
    Ok(if mode.vm {
        scale_in_vm(args, mode, services, checks, &run.bin_dir, &kube_proxy)
    } else {
        scale_on_host(
            args,
            mode,
            services,
            checks,
            &run.bin_dir,
            &kube_proxy,
            run.work.path(),
        )?
    })
}

/// The check point in a `kp-scale --checks` output, or one saying why there is none.
fn check_point(mode: &ModeSpec, services: usize, text: &str, status: &str) -> CheckPoint {
    CheckPoint::from_output(mode.name, services, text)
        .unwrap_or_else(|| CheckPoint::missing(mode.name, services, status))
}

fn stored_check(
    run: &RunContext,
    mode: &ModeSpec,
    point: CheckPoint,
    host_load: Option<String>,
) -> StoredCheck {
    StoredCheck {
        series: mode.name.to_owned(),
        date: run.date.clone(),
        commit: run.commit.clone(),
        host_load,
        point,
    }
}

/// The raw-output heading of a `kp-scale` point (also how an older report's sections are
/// told apart, see [`series_of_heading`]).
fn scale_heading(mode: &ModeSpec, services: usize) -> String {
    format!(
        "kp-scale --mode {} {}--services {services}{}",
        mode.proxy_mode,
        mode.scale_args
            .iter()
            .map(|a| format!("{a} "))
            .collect::<String>(),
        if mode.vm { " (in the test VM)" } else { "" },
    )
}

/// The raw-output heading of a point of this run: [`scale_heading`], saying so when the
/// run made every change kind (and listed the ruleset).
fn point_heading(args: &Args, mode: &ModeSpec, services: usize) -> String {
    let heading = scale_heading(mode, services);
    if args.changes {
        format!("{heading} --changes (every kind) --list-ruleset")
    } else {
        heading
    }
}

/// `kp-scale --changes`' argument: every change kind, in the order issue 33 lists them.
fn every_change() -> String {
    Change::value_variants()
        .iter()
        .filter_map(|c| Some(c.to_possible_value()?.get_name().to_owned()))
        .collect::<Vec<_>>()
        .join(",")
}

/// The raw-output heading of a series' `kp-connect` run.
fn connect_heading(mode: &ModeSpec) -> String {
    format!("kp-connect run --modes {}", mode.proxy_mode)
}

/// Which series wrote a raw-output section of an older report, and whether it ran in the VM.
fn series_of_heading(heading: &str) -> Option<(String, bool)> {
    MODES
        .iter()
        .find(|m| {
            let scale = scale_heading(m, 0);
            let prefix = scale.split("--services ").next().unwrap_or_default();
            (m.scale && heading.starts_with(&format!("{prefix}--services ")))
                || (m.connect && heading == connect_heading(m))
        })
        .map(|m| (m.name.to_owned(), m.vm))
}

/// `kp-connect` for one series at every installed-service count: its points and its output.
fn connect_series(
    args: &Args,
    run: &RunContext,
    mode: &ModeSpec,
    kube_proxy: &Path,
) -> anyhow::Result<(Vec<ConnectPoint>, RawSection)> {
    let out = run.work.path().join(format!("connect-{}.md", mode.name));
    let services: Vec<String> = args.connect_services.iter().map(usize::to_string).collect();
    let services_arg = services.join(",");
    let count_arg = args.connections.to_string();
    let timeout_arg = args.timeout.to_string();
    let runs = u32::try_from(args.connect_services.len()).unwrap_or(u32::MAX);
    let status = bounded(
        &run.bin_dir.join("kp-connect"),
        &[
            "run",
            "--modes",
            mode.proxy_mode,
            "--services",
            &services_arg,
            "--count",
            &count_arg,
            "--timeout",
            &timeout_arg,
            "--binary",
            &kube_proxy.to_string_lossy(),
            "--out",
            &out.to_string_lossy(),
        ],
        (Duration::from_secs(args.timeout) + RUN_SLACK) * runs,
    )?;
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let mut points = ConnectPoint::from_output(&text);
    if points.is_empty() {
        points = args
            .connect_services
            .iter()
            .map(|&n| ConnectPoint::missing(mode.proxy_mode, n, &status))
            .collect();
    }
    for point in &points {
        eprintln!(
            "kp-report: connect {} {}: p50 {:?} p99 {:?}",
            point.mode, point.services, point.p50, point.p99
        );
    }
    let section = RawSection {
        series: mode.name.to_owned(),
        heading: connect_heading(mode),
        text: if text.is_empty() { status } else { text },
    };
    Ok((points, section))
}

/// The points stored in `out_dir`: `points.json`; without one, the points of a `REPORT.md`
/// written before it existed (so a partial run keeps the other series); else none. A
/// points file that cannot be read is an error, not an empty start: writing over it would
/// lose its points.
fn stored_points(out_dir: &Path) -> anyhow::Result<Points> {
    let path = out_dir.join(points::POINTS_FILE);
    match std::fs::read_to_string(&path) {
        // Read again from the raw output, so a column the parser learnt since counts.
        Ok(text) => {
            return Points::parse(&text)
                .map(Points::reparse)
                .with_context(|| format!("reading {}", path.display()));
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    }
    let report = out_dir.join("REPORT.md");
    let Ok(markdown) = std::fs::read_to_string(&report) else {
        return Ok(Points::default());
    };
    let commit = git(&["log", "-1", "--format=%h", "--", &report.to_string_lossy()])
        .filter(|c| !c.is_empty())
        .map_or_else(
            || "unknown (imported from REPORT.md)".to_owned(),
            |c| format!("{c} (REPORT.md's commit; imported)"),
        );
    let imported = import_report(&markdown, &commit, &series_of_heading);
    eprintln!(
        "kp-report: no {}; imported {} scale and {} connect points of {} from {}",
        points::POINTS_FILE,
        imported.scale.len(),
        imported.connect.len(),
        imported.series().join(", "),
        report.display()
    );
    Ok(Points::default().merge(imported, &series_order()))
}

/// Writes REPORT.md and the plots from `points`, with the reasons of missed targets.
fn render(args: &Args, points: &Points) -> anyhow::Result<PathBuf> {
    let reasons = match std::fs::read_to_string(&args.reasons) {
        Ok(text) => targets::parse_reasons(&text),
        Err(error) => {
            eprintln!(
                "kp-report: no reasons for missed targets ({}: {error})",
                args.reasons.display()
            );
            Vec::new()
        }
    };
    for key in targets::unknown_keys(&reasons) {
        eprintln!(
            "kp-report: {} has a section {key:?} that names no target",
            args.reasons.display()
        );
    }
    let report = summary::render(points, &reasons);
    for (name, svg) in &report.plots {
        std::fs::write(args.out_dir.join(name), svg)?;
    }
    let path = args.out_dir.join("REPORT.md");
    std::fs::write(&path, &report.markdown)?;
    Ok(path)
}

/// `git describe --always --dirty` of the workspace: the commit the binaries were built
/// from (when built by this run or just before it).
fn commit() -> String {
    git(&["describe", "--always", "--dirty", "--abbrev=10"]).unwrap_or_else(|| "unknown".to_owned())
}

/// `git ARGS` in the workspace, its trimmed output.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// How long [`settle`] waits at most for the load to fall below [`summary::QUIET_LOAD`]:
/// after the release build (two busy cores for minutes) the 1-minute average needs ~20–45 s
/// of idleness to get there, and the first series' start was otherwise reported as busy
/// because of this report's own build (2026-11-27, ipvs at load 2.00).
const SETTLE_LIMIT: Duration = Duration::from_secs(120);

/// Wait until the 1-minute load average is below [`summary::QUIET_LOAD`] (or `limit` has
/// passed): the load this run's own build left behind is not other jobs. A load that stays
/// up is what the report then records.
fn settle(limit: Duration) {
    let started = Instant::now();
    loop {
        let load: f64 = load_1m().parse().unwrap_or(f64::NAN);
        // NaN: no /proc/loadavg, nothing to wait for.
        if load.is_nan() || load < summary::QUIET_LOAD {
            return;
        }
        if started.elapsed() >= limit {
            eprintln!("kp-report: load {load:.2} after {limit:?}; measuring anyway");
            return;
        }
        eprintln!("kp-report: load {load:.2}; waiting for it to settle before measuring");
        std::thread::sleep(Duration::from_secs(5));
    }
}

/// The 1-minute load average.
fn load_1m() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}

/// `kp-datapath`'s side-by-side run of the socket load balancer's paths (release binaries
/// next to this one), stored only when it finished.
fn measure_datapath() -> anyhow::Result<StoredDatapath> {
    let bin_dir = std::env::current_exe()?
        .parent()
        .context("the executable has no directory")?
        .to_owned();
    let work = tempfile::Builder::new().prefix("kp-report-").tempdir()?;
    let out = work.path().join("datapath.md");
    let measured = [
        "--paths",
        datapath::PATHS,
        "--services",
        datapath::SIZES,
        "--rounds",
        "5",
        "--seconds",
        "5",
        "--count",
        "3000",
    ];
    let kube_proxy = bin_dir.join("kube-proxy");
    let mut run_args: Vec<&str> = measured.to_vec();
    let kube_proxy = kube_proxy.to_string_lossy();
    let out_arg = out.to_string_lossy();
    run_args.extend(["--binary", &kube_proxy, "--out", &out_arg]);
    let (date, commit, load_start) = (utc_now(), commit(), load_1m());
    let status = bounded(&bin_dir.join("kp-datapath"), &run_args, DATAPATH_LIMIT)?;
    if status != "kp-datapath finished" {
        bail!("the data-path run did not finish: {status}");
    }
    let text =
        std::fs::read_to_string(&out).with_context(|| format!("reading {}", out.display()))?;
    Ok(StoredDatapath {
        date,
        commit,
        command: format!("kp-datapath {}", measured.join(" ")),
        load: format!("{load_start}→{}", load_1m()),
        text,
    })
}

/// One `kp-scale` point on this machine, bounded by the first-sync limit plus
/// [`RUN_SLACK`]: (its tables, how it ended).
fn scale_on_host(
    args: &Args,
    mode: &ModeSpec,
    services: usize,
    checks: bool,
    bin_dir: &Path,
    kube_proxy: &Path,
    work: &Path,
) -> anyhow::Result<(String, String)> {
    let out = work.join(format!("scale-{}-{services}.md", mode.name));
    let mut scale_args = scale_args(mode, services, args.timeout, kube_proxy);
    if checks {
        scale_args.push("--checks".to_owned());
    }
    if args.changes {
        // The layout's points also list the ruleset back, at every size (issue 33 at 100k).
        scale_args.extend(["--changes".to_owned(), every_change()]);
        scale_args.push("--list-ruleset".to_owned());
    }
    scale_args.extend(["--out".to_owned(), out.to_string_lossy().into_owned()]);
    let scale_args: Vec<&str> = scale_args.iter().map(String::as_str).collect();
    let status = bounded(
        &bin_dir.join("kp-scale"),
        &scale_args,
        Duration::from_secs(args.timeout) + RUN_SLACK + checks_slack(checks) + changes_slack(args),
    )?;
    Ok((std::fs::read_to_string(&out).unwrap_or_default(), status))
}

/// One `kp-scale` point inside the test VM (Debian's kernel under QEMU, see tools/kp-vm),
/// with the proxy, the benchmark and the tools the mode runs copied in; the VM is killed
/// after the VM first-sync limit plus [`RUN_SLACK`]. Returns (its tables, how it ended).
fn scale_in_vm(
    args: &Args,
    mode: &ModeSpec,
    services: usize,
    checks: bool,
    bin_dir: &Path,
    kube_proxy: &Path,
) -> (String, String) {
    let limit = Duration::from_secs(args.vm_timeout) + RUN_SLACK + checks_slack(checks);
    let mut scale_args = scale_args(mode, services, args.vm_timeout, kube_proxy);
    if checks {
        scale_args.push("--checks".to_owned());
    }
    let scale_args: Vec<std::ffi::OsString> = scale_args.iter().map(Into::into).collect();
    eprintln!(
        "kp-report: in the test VM: kp-scale {}",
        scale_args
            .iter()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let vm = kp_vm::Vm::from_env()
        .iptables()
        .program("ipvsadm")
        .program("ipset")
        .program("conntrack")
        .program(&kube_proxy.to_string_lossy())
        .memory_mib(args.vm_memory_mib)
        .timeout(limit);
    match vm.run(&bin_dir.join("kp-scale"), &scale_args) {
        Ok(out) => {
            let status = if out.status == 0 {
                format!("kp-scale finished in the VM ({})", human(out.elapsed))
            } else {
                let stderr = String::from_utf8_lossy(&out.stderr);
                let last = stderr.lines().last().unwrap_or_default();
                format!("kp-scale failed in the VM (status {}): {last}", out.status)
            };
            (String::from_utf8_lossy(&out.stdout).into_owned(), status)
        }
        Err(kp_vm::VmError::Timeout { seconds, .. }) => (
            String::new(),
            format!("the test VM was killed after {seconds} s"),
        ),
        Err(error) => (String::new(), format!("the test VM did not run: {error}")),
    }
}

/// How much longer a point with `--checks` may run: kp-scale's default wait for the
/// thorough check (90 s) and the check itself.
fn checks_slack(checks: bool) -> Duration {
    if checks {
        Duration::from_secs(120)
    } else {
        Duration::ZERO
    }
}

/// How much longer a `--changes` point may run: its `nft list ruleset`, bounded by the
/// first-sync limit too, and a minute for the edits (milliseconds each when they sync).
fn changes_slack(args: &Args) -> Duration {
    if args.changes {
        Duration::from_secs(args.timeout + 60)
    } else {
        Duration::ZERO
    }
}

/// `kp-scale`'s arguments for one point of `mode`.
fn scale_args(mode: &ModeSpec, services: usize, timeout: u64, kube_proxy: &Path) -> Vec<String> {
    let mut out: Vec<String> = [
        "--services",
        &services.to_string(),
        "--endpoints",
        &ENDPOINTS.to_string(),
        "--mode",
        mode.proxy_mode,
        "--timeout",
        &timeout.to_string(),
        "--binary",
        &kube_proxy.to_string_lossy(),
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    out.extend(mode.scale_args.iter().map(|a| (*a).to_owned()));
    out
}

/// `cargo build --release` of the proxy, the benchmarks and kp-echo (`cargo run` built only
/// this one).
fn build() -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("kp-report: building the release binaries ...");
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "--locked",
            "-p",
            "kube-proxy",
            "-p",
            "kp-bench",
            // kp-echo serves the fake API server of the `-api` series.
            "-p",
            "kp-testbed",
            "--bins",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build --release failed ({status})");
    }
    Ok(())
}

/// Runs `program args` with its output passed through to ours, killing it (and what it
/// started) after `limit`. Returns a one-line description of how it ended.
fn bounded(program: &Path, args: &[&str], limit: Duration) -> anyhow::Result<String> {
    let name = program
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    eprintln!("kp-report: {name} {}", args.join(" "));
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", program.display()))?;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(if status.success() {
                format!("{name} finished")
            } else {
                format!("{name} failed ({status})")
            });
        }
        if Instant::now() > deadline {
            // SIGTERM first: the benchmarks delete their namespaces on it.
            sys::kill(child.id(), "TERM");
            std::thread::sleep(Duration::from_secs(10));
            for pid in sys::descendants(child.id()) {
                sys::kill(pid, "KILL");
            }
            let _ = child.kill();
            let _ = child.wait();
            return Ok(format!("{name} killed after {}", human(limit)));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `2026-11-23 19:40 UTC`, from `date -u` (no time crate needed for one line).
fn utc_now() -> String {
    sys::run_std("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned())
}

/// CPU model, cores and memory, from `/proc`.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or("unknown CPU", |(_, m)| m.trim())
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .map_or_else(String::new, |kib| {
            format!(", {:.0} GiB RAM", kib / 1048576.0)
        });
    let virt = sys::run_std("systemd-detect-virt", &[])
        .map(|v| format!(" ({} VM)", v.trim()))
        .unwrap_or_default();
    format!("{cores} vCPU {model}{mem_gib}{virt}")
}

/// Kernel and distribution.
fn system() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| format!("Linux {}", s.trim()))
        .unwrap_or_default();
    let distro = std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|s| s.trim_matches('"').to_owned())
        .unwrap_or_default();
    format!("{kernel}, {distro}")
}

/// iptables and nft versions.
fn tools() -> String {
    ["iptables", "nft"]
        .iter()
        .map(|t| {
            sys::run_std(t, &["--version"])
                .map(|v| v.trim().to_owned())
                .unwrap_or_else(|_| format!("{t}: not found"))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The load averages and the other processes using CPU right now (compilers, tests): what
/// else ran while we measured.
/// The load line the report shows, and whether the machine is quiet
/// ([`summary::is_quiet`]).
fn load_and_neighbours() -> (String, bool) {
    let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let averages: Vec<&str> = loadavg.split_whitespace().take(3).collect();
    let busy = sys::run_std("ps", &["-eo", "pcpu=,comm=", "--sort=-pcpu"]).unwrap_or_default();
    let top: Vec<String> = busy
        .lines()
        .filter_map(|l| {
            let (cpu, comm) = l.trim().split_once(' ')?;
            let cpu: f64 = cpu.parse().ok()?;
            (cpu >= 5.0 && comm.trim() != "ps").then(|| format!("{} {cpu:.0}%", comm.trim()))
        })
        .take(6)
        .collect();
    let compilers = busy
        .lines()
        .filter(|l| l.contains("rustc") || l.contains("cargo"))
        .count();
    let load_1m = averages
        .first()
        .and_then(|l| l.parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    let line = format!(
        "load average {} (1, 5, 15 min); {compilers} cargo/rustc processes; busiest processes (lifetime CPU %): {}",
        averages.join(" "),
        if top.is_empty() {
            "none above 5%".to_owned()
        } else {
            top.join(", ")
        }
    );
    (line, summary::is_quiet(load_1m, compilers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_series_is_named_once_and_selects_its_backend() {
        let mut names: Vec<&str> = MODES.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), MODES.len());
        let args = |name: &str| {
            let mode = MODES.iter().find(|m| m.name == name).expect(name);
            scale_args(mode, 1000, 120, Path::new("/k")).join(" ")
        };
        assert_eq!(
            args("iptables-legacy"),
            "--services 1000 --endpoints 10 --mode iptables --timeout 120 --binary /k --iptables legacy"
        );
        assert!(
            args("iptables-nft")
                .ends_with("--mode iptables --timeout 120 --binary /k --iptables nft")
        );
        assert!(args("nftables").contains("--mode nftables"));
        // ipvs needs IPVS, which only the test VM's kernel is sure to have.
        assert!(
            MODES
                .iter()
                .filter(|m| m.vm)
                .all(|m| m.proxy_mode == "ipvs")
        );
    }

    #[test]
    fn raw_headings_name_their_series() {
        for mode in MODES.iter().filter(|m| m.scale) {
            let heading = scale_heading(mode, 3000);
            assert_eq!(
                series_of_heading(&heading),
                Some((mode.name.to_owned(), mode.vm)),
                "{heading}"
            );
        }
        assert_eq!(
            scale_heading(&MODES[1], 1000),
            "kp-scale --mode iptables --iptables nft --services 1000"
        );
        // The committed report's headings (written before points.json existed).
        for (heading, series) in [
            (
                "kp-scale --mode iptables --iptables legacy --services 20000",
                "iptables-legacy",
            ),
            (
                "kp-scale --mode ipvs --services 1000 (in the test VM)",
                "ipvs",
            ),
            ("kp-connect run --modes iptables", "iptables-nft"),
            ("kp-connect run --modes nftables", "nftables"),
        ] {
            assert_eq!(
                series_of_heading(heading).map(|s| s.0).as_deref(),
                Some(series)
            );
        }
        assert_eq!(series_of_heading("kp-connect run --modes fake"), None);
        assert_eq!(series_of_heading("kp-soak --modes fake"), None);
    }
}
