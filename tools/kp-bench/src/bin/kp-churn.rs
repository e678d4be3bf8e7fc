//! `kp-churn`: endpoint churn through the API server path, with programming latency and
//! memory recorded.
//!
//! Inside a network namespace it runs the fake API server (`kp-echo apiserver`, from
//! kp-testbed) holding N generated Services × M endpoints (`generate`), and the real
//! `kube-proxy` watching it (`--master`, upstream's default 1 s minimum sync period unless
//! `--min-sync-period` says otherwise). Then it changes one EndpointSlice `--rate` times a
//! second for `--duration` (round robin over the services; each change replaces an endpoint
//! address) and records:
//!
//! With `--pair-gap`, every change is followed by a second change of the same EndpointSlice
//! that long after (upstream's affinity-switch conformance specs change a Service twice
//! 0.3 s apart), and the latencies of first and second changes are reported apart: the second
//! is the one a runner that rests `minSyncPeriod` after every sync delays.
//!
//! - the programming latency of each change: from sending it to the end of the first sync
//!   that started after it (the sync's start is its log line's arrival minus its `apply` and
//!   `backend` times; the event reaches the proxy within milliseconds, so that sync has it);
//! - the proxy's resident memory (VmRSS) every second, and its peak (VmHWM);
//! - the CPU time the proxy used during the churn (user + system), as a share of one core.
//!
//! Measurements, not a test: nothing here judges the numbers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use kp_bench::generate::{self, Scale, slice_yaml};
use kp_bench::logs::{self, LogLine};
use kp_bench::sys::{self, Netns};
use kp_testbed::apiserver::{FakeApiProcess, yaml_objects};
use kp_testbed::proxy::{LogEntry, NextLine, ProxyProcess};

/// Where the fake API server listens inside the namespace.
const API_ADDRESS: &str = "127.0.0.1:6443";
/// How long the first sync may take.
const FIRST_SYNC_WAIT: Duration = Duration::from_secs(300);
/// How long the proxy may take to program the last change after the churn ends.
const DRAIN: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Mode {
    Iptables,
    Nftables,
}

#[derive(Debug, Parser)]
#[command(
    name = "kp-churn",
    about = "Endpoint churn through the API server: programming latency and memory"
)]
struct Args {
    /// The proxy mode.
    #[arg(long, value_enum, default_value = "iptables")]
    mode: Mode,
    /// Services.
    #[arg(long, default_value_t = 100)]
    services: usize,
    /// Endpoints per service.
    #[arg(long, default_value_t = 10)]
    endpoints: usize,
    /// EndpointSlice changes per second.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// How long to churn, in seconds.
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// `--iptables-min-sync-period` (both modes), e.g. `1s` (upstream's default) or `0s`.
    #[arg(long, default_value = "1s")]
    min_sync_period: String,
    /// The kube-proxy binary.
    #[arg(long, default_value = "target/release/kube-proxy")]
    binary: PathBuf,
    /// The kp-echo binary (default: next to this one).
    #[arg(long)]
    echo: Option<PathBuf>,
    /// Follow every change by a second change of the same slice this many milliseconds later.
    #[arg(long)]
    pair_gap: Option<u64>,
    /// Print every change and sync, in milliseconds since the churn began.
    #[arg(long)]
    timeline: bool,
}

/// One change sent to the API server, and whether it was the second of a pair.
#[derive(Debug, Clone, Copy)]
struct Change {
    sent: Instant,
    second: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kp-churn: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A completed sync: when its log line arrived and when it started.
#[derive(Debug, Clone, Copy)]
struct Sync {
    start: Instant,
    end: Instant,
}

/// How long the proxy gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Every completed sync `proxy` logs until `until`.
fn syncs_until(proxy: &mut ProxyProcess, until: Instant, out: &mut Vec<Sync>) {
    while let NextLine::Line(LogEntry { at, line }) = proxy.next_line(until) {
        if let Some(sync) = parse_sync(at, &line) {
            out.push(sync);
        }
    }
}

fn parse_sync(at: Instant, line: &str) -> Option<Sync> {
    let parsed = LogLine::parse(line)?;
    if parsed.message != logs::SYNCED {
        return None;
    }
    let took = parsed.duration("apply")? + parsed.duration("backend")?;
    Some(Sync {
        start: at.checked_sub(took)?,
        end: at,
    })
}

fn run(args: &Args) -> anyhow::Result<()> {
    let scale = Scale::new(args.services, args.endpoints);
    let echo = match &args.echo {
        Some(path) => path.clone(),
        None => kp_testbed::echo_binary().context("the kp-echo binary")?,
    };
    let netns = Netns::create("kp-churn-", "node")?;
    let listen: SocketAddr = API_ADDRESS.parse().context("API address")?;
    let api = FakeApiProcess::start(&echo, netns.name(), listen)?;
    for (_, text) in generate::generate(scale).files {
        api.apply_yaml(&text)?;
    }
    // Sending only queues the objects: the proxy's first list must see them all.
    api.sync(FIRST_SYNC_WAIT)
        .context("waiting for the fake API server to apply the objects")?;

    let mode = match args.mode {
        Mode::Iptables => "iptables",
        Mode::Nftables => "nftables",
    };
    let mut proxy = netns
        .proxy(&args.binary)?
        .arg(format!("--master={}", api.url()))
        .arg(format!("--proxy-mode={mode}"))
        .arg("--cluster-cidr=10.128.0.0/9")
        .arg(format!(
            "--iptables-min-sync-period={}",
            args.min_sync_period
        ))
        .arg("-v=2")
        .stop_grace(STOP_GRACE)
        .spawn()
        .context("starting kube-proxy")?;
    let started = proxy.started();
    proxy
        .wait_first_sync(FIRST_SYNC_WAIT)
        .context("waiting for the first sync")?;
    println!(
        "kp-churn: {mode}, {}×{} (first sync after {:.1} s), {} changes/s for {} s, min sync period {}, load {}",
        args.services,
        args.endpoints,
        started.elapsed().as_secs_f64(),
        args.rate,
        args.duration,
        args.min_sync_period,
        sys::load()
    );

    let rss_start = sys::vm_rss_kib(proxy.pid()).unwrap_or(0);
    let cpu_start = sys::cpu_ticks(proxy.pid()).map(|(user, system)| user + system);
    let churn_start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / args.rate.max(0.01));
    let churn_end = Instant::now() + Duration::from_secs(args.duration);
    let mut changes: Vec<Change> = Vec::new();
    let mut step = 0;
    let mut syncs: Vec<Sync> = Vec::new();
    let mut rss: Vec<(f64, u64)> = Vec::new();
    let mut next_sample = Instant::now();
    let mut next_change = Instant::now();
    let mut generation = 0;
    while Instant::now() < churn_end {
        if Instant::now() >= next_sample {
            let at = Instant::now().duration_since(started).as_secs_f64();
            rss.push((at, sys::vm_rss_kib(proxy.pid()).unwrap_or(0)));
            next_sample += Duration::from_secs(1);
        }
        let service = step % args.services.max(1);
        step += 1;
        if service == 0 {
            generation += 2;
        }
        apply_slice(&api, scale, service, generation)?;
        changes.push(Change {
            sent: Instant::now(),
            second: false,
        });
        if let Some(gap) = args.pair_gap {
            syncs_until(
                &mut proxy,
                Instant::now() + Duration::from_millis(gap),
                &mut syncs,
            );
            apply_slice(&api, scale, service, generation + 1)?;
            changes.push(Change {
                sent: Instant::now(),
                second: true,
            });
        }
        next_change += interval;
        syncs_until(&mut proxy, next_change, &mut syncs);
    }
    let cpu_end = sys::cpu_ticks(proxy.pid()).map(|(user, system)| user + system);
    let churned = churn_start.elapsed();
    syncs_until(&mut proxy, Instant::now() + DRAIN, &mut syncs);
    let rss_end = sys::vm_rss_kib(proxy.pid()).unwrap_or(0);
    let peak = sys::vm_hwm_kib(proxy.pid()).unwrap_or(0);

    println!("changes {}, syncs {}", changes.len(), syncs.len());
    if args.timeline {
        print_timeline(churn_start, &changes, &syncs);
    }
    if args.pair_gap.is_some() {
        report_latencies("first of each pair", &changes, &syncs, |c| !c.second);
        report_latencies("second of each pair", &changes, &syncs, |c| c.second);
    } else {
        report_latencies("every change", &changes, &syncs, |_| true);
    }
    if let (Some(start), Some(end)) = (cpu_start, cpu_end) {
        let seconds = end.saturating_sub(start) as f64 / sys::ticks_per_second() as f64;
        println!(
            "CPU during the churn: {seconds:.2} s in {:.1} s ({:.1} % of one core)",
            churned.as_secs_f64(),
            100.0 * seconds / churned.as_secs_f64()
        );
    }
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "RSS MiB: at start {:.1}, at end {:.1}, peak {:.1}; slope {:+.3} MiB/min over the churn",
        mib(rss_start),
        mib(rss_end),
        mib(peak),
        slope(&rss) * 60.0 / 1024.0
    );
    let samples: Vec<String> = rss
        .iter()
        .step_by(10)
        .map(|(t, kib)| format!("{t:.0}s {:.1}", mib(*kib)))
        .collect();
    println!("RSS MiB every 10 s: {}", samples.join(", "));
    drop(proxy);
    drop(api);
    drop(netns);
    Ok(())
}

/// Applies generation `generation` of service `service`'s EndpointSlice.
fn apply_slice(
    api: &FakeApiProcess,
    scale: Scale,
    service: usize,
    generation: usize,
) -> anyhow::Result<()> {
    let slice = slice_yaml(scale, service, Some(generation));
    for obj in yaml_objects(&slice).map_err(anyhow::Error::msg)? {
        api.apply(obj)?;
    }
    Ok(())
}

/// Prints the programming latency of the `changes` that `which` selects: from sending a change
/// to the end of the first sync that started after it.
fn report_latencies(
    label: &str,
    changes: &[Change],
    syncs: &[Sync],
    which: impl Fn(&Change) -> bool,
) {
    let mut latencies: Vec<Duration> = Vec::new();
    let mut unprogrammed = 0;
    for change in changes.iter().filter(|c| which(c)) {
        match syncs.iter().find(|s| s.start >= change.sent) {
            Some(sync) => latencies.push(sync.end.duration_since(change.sent)),
            None => unprogrammed += 1,
        }
    }
    latencies.sort();
    let quantile = |q: f64| -> f64 {
        let i = ((latencies.len() as f64 - 1.0) * q).round() as usize;
        latencies.get(i).copied().unwrap_or_default().as_secs_f64() * 1000.0
    };
    println!(
        "{label}: {} changes (not seen programmed: {unprogrammed}); programming latency ms: \
         p50 {:.0}  p90 {:.0}  p99 {:.0}  max {:.0}",
        latencies.len(),
        quantile(0.5),
        quantile(0.9),
        quantile(0.99),
        quantile(1.0)
    );
}

/// Every change and sync in time order, in milliseconds since `origin`.
fn print_timeline(origin: Instant, changes: &[Change], syncs: &[Sync]) {
    let ms = |at: Instant| at.saturating_duration_since(origin).as_secs_f64() * 1000.0;
    let mut events: Vec<(f64, String)> = changes
        .iter()
        .map(|c| {
            let which = if c.second { "second change" } else { "change" };
            (ms(c.sent), which.to_owned())
        })
        .chain(syncs.iter().map(|s| {
            let took = s.end.duration_since(s.start).as_secs_f64() * 1000.0;
            (ms(s.start), format!("sync ({took:.1} ms)"))
        }))
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (at, what) in events {
        println!("  {at:9.1} ms  {what}");
    }
}

/// Least-squares slope of `(seconds, KiB)` samples, in KiB per second.
fn slope(samples: &[(f64, u64)]) -> f64 {
    let n = samples.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mean_t = samples.iter().map(|(t, _)| t).sum::<f64>() / n;
    let mean_v = samples.iter().map(|(_, v)| *v as f64).sum::<f64>() / n;
    let (num, den) = samples.iter().fold((0.0, 0.0), |(num, den), (t, v)| {
        (
            num + (t - mean_t) * (*v as f64 - mean_v),
            den + (t - mean_t).powi(2),
        )
    });
    if den == 0.0 { 0.0 } else { num / den }
}
