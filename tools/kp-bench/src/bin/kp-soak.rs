//! `kp-soak`: the long-running churn benchmark.
//!
//! For each proxy mode, runs the real `kube-proxy` on generated manifests (N Services × M
//! endpoints) inside a network namespace of its own, then rewrites EndpointSlices at a fixed
//! rate through the manifests source for a bounded time, sampling the proxy's resident set,
//! open file descriptors and threads from `/proc`. It prints each mode's series and a summary
//! with the least-squares slope of RSS and fds per minute after a warm-up: a leak shows as a
//! slope that does not fall back to about zero as the run gets longer. See
//! bench/notes/2026-11-25-soak.md for figures and how to read them. A measurement, not a test: nothing here passes or fails
//! on a number.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, ValueEnum};
use kp_bench::generate::{self, Edit, Scale};
use kp_bench::logs::SYNCED;
use kp_bench::report::{Table, mib};
use kp_bench::soak::{Sample, series_table, signed, summarise};
use kp_bench::sys::{self, Netns};

/// How long the proxy gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// How many log lines an error shows.
const LOG_TAIL: usize = 20;

/// Proxy modes. ipvs needs a kernel with IPVS: run kp-soak in the test VM for it
/// (`kp-vm-run`; see the kp-bench README).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
enum Mode {
    /// `--proxy-mode fake`: the control plane only.
    Fake,
    /// `--proxy-mode iptables`.
    Iptables,
    /// `--proxy-mode nftables`.
    Nftables,
    /// `--proxy-mode userspace`: capture rules and the in-process relay.
    Userspace,
    /// `--proxy-mode ipvs`: virtual servers, kube-ipvs0, ipsets and iptables rules.
    Ipvs,
}

impl Mode {
    fn flag(self) -> &'static str {
        match self {
            Mode::Fake => "--proxy-mode=fake",
            Mode::Iptables => "--proxy-mode=iptables",
            Mode::Nftables => "--proxy-mode=nftables",
            Mode::Userspace => "--proxy-mode=userspace",
            Mode::Ipvs => "--proxy-mode=ipvs",
        }
    }

    fn name(self) -> &'static str {
        self.flag().trim_start_matches("--proxy-mode=")
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "kp-soak",
    about = "Churn soak of kube-proxy-rs: RSS and fds over time"
)]
struct Args {
    /// Modes to run, one after the other.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "fake,iptables,nftables,userspace"
    )]
    modes: Vec<Mode>,
    /// How long each mode churns, in seconds (the bound of the run).
    #[arg(long, default_value_t = 300)]
    seconds: u64,
    /// Samples before this many seconds of churn are left out of the slope and the start
    /// figures (caches and allocator arenas fill up first).
    #[arg(long, default_value_t = 60)]
    warmup: u64,
    /// Services to generate.
    #[arg(long, default_value_t = 200)]
    services: usize,
    /// Endpoints per service.
    #[arg(long, default_value_t = 10)]
    endpoints: usize,
    /// EndpointSlice edits per second (each rewrites one service's slice).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 5)]
    sample: u64,
    /// Seconds between rows of the printed series.
    #[arg(long, default_value_t = 60)]
    every: u64,
    /// The kube-proxy binary.
    #[arg(long, default_value = "target/release/kube-proxy")]
    binary: PathBuf,
    /// Give up on the first sync after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Append the markdown tables to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.warmup >= args.seconds {
        eprintln!("kp-soak: --warmup must be shorter than --seconds");
        return ExitCode::FAILURE;
    }
    let mut summary = Table::new(&[
        "mode",
        "churn",
        "edits",
        "syncs",
        "RSS after warm-up",
        "RSS end",
        "RSS max",
        "RSS slope (KiB/min)",
        "late half (KiB/min)",
        "fds (warm-up → end)",
        "fd slope (/min)",
        "threads",
        "errors logged",
    ]);
    let mut series = String::new();
    let mut failed = false;
    for mode in &args.modes {
        eprintln!(
            "kp-soak: {} for {}s (load {})",
            mode.name(),
            args.seconds,
            sys::load()
        );
        match soak(&args, *mode) {
            Ok(run) => {
                let table = series_table(&run.samples, Duration::from_secs(args.every));
                series.push_str(&format!(
                    "\n{} ({} services × {} endpoints, {}/s edits):\n\n{}",
                    mode.name(),
                    args.services,
                    args.endpoints,
                    args.rate,
                    table.render()
                ));
                let Some(s) = summarise(&run.samples, Duration::from_secs(args.warmup)) else {
                    eprintln!("kp-soak: {}: no samples after the warm-up", mode.name());
                    failed = true;
                    continue;
                };
                summary.row(vec![
                    mode.name().to_owned(),
                    format!("{}s", args.seconds),
                    s.edits.to_string(),
                    run.syncs.to_string(),
                    mib(s.rss_start_kib),
                    mib(s.rss_end_kib),
                    mib(s.rss_max_kib),
                    signed(s.rss_kib_per_min, 1),
                    signed(s.rss_kib_per_min_late, 1),
                    format!("{} → {}", s.fds.0, s.fds.1),
                    signed(s.fds_per_min, 2),
                    format!("{} → {}", s.threads.0, s.threads.1),
                    run.errors.to_string(),
                ]);
            }
            Err(error) => {
                eprintln!("kp-soak: {}: {error:#}", mode.name());
                failed = true;
            }
        }
    }
    let text = format!("{}{series}", summary.render());
    println!("{text}");
    if let Some(out) = &args.out
        && let Err(error) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
    {
        eprintln!("kp-soak: writing {}: {error}", out.display());
        failed = true;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// One mode's run.
struct Run {
    samples: Vec<Sample>,
    /// Syncs the proxy logged.
    syncs: usize,
    /// Error-severity log lines.
    errors: usize,
}

fn soak(args: &Args, mode: Mode) -> anyhow::Result<Run> {
    let scale = Scale::new(args.services, args.endpoints);
    let dir = tempfile::tempdir().context("temporary directory")?;
    let manifests = dir.path().join("manifests");
    std::fs::create_dir(&manifests)?;
    for (name, text) in generate::generate(scale).files {
        std::fs::write(manifests.join(name), text)?;
    }
    let netns = Netns::create("kpsoak-", mode.name())?;
    let mut proxy = netns
        .proxy(&args.binary)?
        .arg(format!("--manifests={}", manifests.display()))
        .arg(mode.flag())
        .arg("-v=2")
        .stop_grace(STOP_GRACE)
        .spawn()
        .context("starting kube-proxy")?;
    let pid = proxy.pid();
    proxy
        .wait_first_sync(Duration::from_secs(args.timeout))
        .context("waiting for the first sync")?;

    // Without IPVS the proxy falls back to iptables mode: figures under "ipvs" would lie.
    let fell_back = !proxy
        .logged(|l| l.contains("Can't use the IPVS proxier"))
        .is_empty();
    if mode == Mode::Ipvs && fell_back {
        bail!(
            "this kernel has no IPVS (the proxy fell back to iptables mode); run kp-soak in the test VM"
        );
    }

    // Churn: edit service after service, each edit a new endpoint address.
    let interval = Duration::from_secs_f64(1.0 / args.rate.max(0.001));
    let sample_every = Duration::from_secs(args.sample.max(1));
    let run_for = Duration::from_secs(args.seconds);
    let start = Instant::now();
    let mut generations: BTreeMap<usize, usize> = BTreeMap::new();
    let mut edits = 0u64;
    let mut samples = Vec::new();
    let mut next_edit = start;
    let mut next_sample = start;
    loop {
        let now = Instant::now();
        if now >= next_sample {
            samples.push(Sample {
                at: now - start,
                rss_kib: sys::vm_rss_kib(pid).context("the proxy is gone")?,
                fds: sys::open_fds(pid).unwrap_or(0),
                threads: sys::threads(pid).unwrap_or(0),
                edits,
            });
            next_sample += sample_every;
        }
        if now - start >= run_for {
            break;
        }
        if now >= next_edit {
            let service = usize::try_from(edits).unwrap_or(0) % args.services.max(1);
            *generations.entry(service).or_default() += 1;
            let file = scale.file_of(service);
            // The edited file with every edit of its services so far (earlier ones kept).
            let same_file: Vec<Edit> = std::iter::once((service, generations[&service]))
                .chain(
                    generations
                        .iter()
                        .filter(|(s, _)| **s != service && scale.file_of(**s) == file)
                        .map(|(s, g)| (*s, *g)),
                )
                .map(|(service, generation)| Edit::replace(service, generation))
                .collect();
            if let Some((name, text)) = generate::edited_file(scale, &same_file) {
                replace_file(&manifests, &name, &text)?;
            }
            edits += 1;
            next_edit += interval;
        }
        if let Some(status) = proxy.try_exit_status() {
            bail!(
                "kube-proxy exited ({status}) during the churn:\n{}",
                proxy.tail(LOG_TAIL)
            );
        }
        let wake = next_edit.min(next_sample);
        std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    }
    // The stop's own lines count too (a failed stop is the drop's to finish).
    let _ = proxy.terminate(STOP_GRACE);
    Ok(Run {
        samples,
        syncs: proxy.logged(|l| l.contains(SYNCED)).len(),
        errors: proxy.logged(|l| l.starts_with('E')).len(),
    })
}

/// Write `name` by renaming a temporary file over it, as editors and ConfigMap volumes do.
fn replace_file(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(name))?;
    Ok(())
}
