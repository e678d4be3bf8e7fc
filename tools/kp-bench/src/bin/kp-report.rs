//! `kp-report`: one command for the benchmark report. Builds the release binaries, runs
//! `kp-scale` for every mode at a few sizes and `kp-connect` for every kernel mode with a few
//! installed-service counts, each bounded in time, and writes `bench/REPORT.md` with tables
//! and SVG plots (see `kp_bench::summary`). Must run as root (the benchmarks use network
//! namespaces).
//!
//! ```sh
//! cargo run --release -p kp-bench --bin kp-report
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use kp_bench::report::human;
use kp_bench::summary::{self, ConnectPoint, Environment, Measured, ScalePoint};
use kp_bench::sys;

/// A proxy mode the report covers, and which benchmarks can run it. New modes (userspace,
/// ipvs) join here once `kp-scale --mode` / `kp-connect --modes` accept them.
struct ModeSpec {
    name: &'static str,
    /// `kp-scale --mode NAME` works.
    scale: bool,
    /// `kp-connect run --modes NAME` works (a mode that forwards traffic).
    connect: bool,
}

/// Every mode, in the order the report lists them.
const MODES: &[ModeSpec] = &[
    ModeSpec {
        name: "fake",
        scale: true,
        connect: false,
    },
    ModeSpec {
        name: "iptables",
        scale: true,
        connect: true,
    },
    ModeSpec {
        name: "nftables",
        scale: true,
        connect: true,
    },
];

/// Endpoints per generated service, as in the issues' N×10 targets.
const ENDPOINTS: usize = 10;

/// Beyond the benchmark's own first-sync limit, how long a run may take (partial syncs of
/// up to two minutes each, building and deleting namespaces) before it is killed.
const RUN_SLACK: Duration = Duration::from_secs(300);

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
    #[arg(long, value_delimiter = ',', default_value = "100,300,1000,3000")]
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
    /// Where to write REPORT.md and the plots.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench"))]
    out_dir: PathBuf,
    /// Use the binaries next to this one as they are (skip `cargo build --release`).
    #[arg(long)]
    no_build: bool,
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
    let modes: Vec<&ModeSpec> = MODES
        .iter()
        .filter(|m| args.modes.is_empty() || args.modes.iter().any(|n| n == m.name))
        .collect();
    let started = Instant::now();
    let mut env = Environment {
        date: utc_now(),
        machine: machine(),
        system: system(),
        tools: tools(),
        load_start: load_and_neighbours(),
        command: "cargo run --release -p kp-bench --bin kp-report".to_owned(),
        ..Environment::default()
    };
    let bin_dir = std::env::current_exe()?
        .parent()
        .context("the executable has no directory")?
        .to_owned();
    if !args.no_build {
        build()?;
    }
    let kube_proxy = bin_dir.join("kube-proxy");
    let work = tempfile::Builder::new().prefix("kp-report-").tempdir()?;
    let mut raw = String::new();

    let mut scale = Vec::new();
    for mode in modes.iter().filter(|m| m.scale) {
        let mut timed_out_at = None;
        for &services in &args.sizes {
            if let Some(smaller) = timed_out_at {
                let why = format!("skipped: {smaller} services already timed out");
                scale.push(ScalePoint::missing(mode.name, services, ENDPOINTS, &why));
                continue;
            }
            let out = work
                .path()
                .join(format!("scale-{}-{services}.md", mode.name));
            let services_arg = services.to_string();
            let endpoints_arg = ENDPOINTS.to_string();
            let timeout_arg = args.timeout.to_string();
            let status = bounded(
                &bin_dir.join("kp-scale"),
                &[
                    "--services",
                    &services_arg,
                    "--endpoints",
                    &endpoints_arg,
                    "--mode",
                    mode.name,
                    "--timeout",
                    &timeout_arg,
                    "--binary",
                    &kube_proxy.to_string_lossy(),
                    "--out",
                    &out.to_string_lossy(),
                ],
                Duration::from_secs(args.timeout) + RUN_SLACK,
            )?;
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let point = if text.is_empty() {
                ScalePoint::missing(mode.name, services, ENDPOINTS, &status)
            } else {
                ScalePoint::from_output(mode.name, services, ENDPOINTS, &text)
            };
            if matches!(point.first_sync, Measured::TimedOut(_)) {
                timed_out_at = Some(services);
            }
            eprintln!(
                "kp-report: scale {} {services}×{ENDPOINTS}: first sync {}",
                mode.name, point.first_sync
            );
            raw.push_str(&format!(
                "### kp-scale --mode {} --services {services}\n\n{}\n",
                mode.name,
                if text.is_empty() { &status } else { &text }
            ));
            scale.push(point);
        }
    }

    let mut connect = Vec::new();
    for mode in modes.iter().filter(|m| m.connect) {
        let out = work.path().join(format!("connect-{}.md", mode.name));
        let services: Vec<String> = args.connect_services.iter().map(usize::to_string).collect();
        let services_arg = services.join(",");
        let count_arg = args.connections.to_string();
        let timeout_arg = args.timeout.to_string();
        let runs = u32::try_from(args.connect_services.len()).unwrap_or(u32::MAX);
        let status = bounded(
            &bin_dir.join("kp-connect"),
            &[
                "run",
                "--modes",
                mode.name,
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
        let points = ConnectPoint::from_output(&text);
        if points.is_empty() {
            for &n in &args.connect_services {
                connect.push(ConnectPoint::missing(mode.name, n, &status));
            }
        }
        for point in &points {
            eprintln!(
                "kp-report: connect {} {}: p50 {:?} p99 {:?}",
                point.mode, point.services, point.p50, point.p99
            );
        }
        connect.extend(points);
        raw.push_str(&format!(
            "### kp-connect run --modes {}\n\n{}\n",
            mode.name,
            if text.is_empty() { &status } else { &text }
        ));
    }

    env.load_end = load_and_neighbours();
    env.duration = human(started.elapsed());
    let report = summary::render(&env, &scale, &connect, &raw);
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    for (name, svg) in &report.plots {
        std::fs::write(args.out_dir.join(name), svg)?;
    }
    let path = args.out_dir.join("REPORT.md");
    std::fs::write(&path, &report.markdown)?;
    Ok(path)
}

/// `cargo build --release` of the proxy and the benchmarks (`cargo run` built only this one).
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
fn load_and_neighbours() -> String {
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
    format!(
        "load average {} (1, 5, 15 min); {compilers} cargo/rustc processes; busiest processes (lifetime CPU %): {}",
        averages.join(" "),
        if top.is_empty() {
            "none above 5%".to_owned()
        } else {
            top.join(", ")
        }
    )
}
