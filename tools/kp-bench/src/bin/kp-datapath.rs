//! `kp-datapath`: data-path throughput and latency, side by side: direct pod to pod, through
//! iptables mode, and through userspace mode's relay.
//!
//! Topology per path and round (namespaces `kpr-<pid>-<tag>-{cl,node,srv}`, created and
//! wired from inside the namespaces; the host's namespace is never touched):
//!
//! ```text
//! client 10.200.1.2 -- 10.200.1.1 node (kube-proxy, forwarding) 10.200.2.1 -- 10.200.2.2 server
//! ```
//!
//! The server runs two `iperf3 -s` (5201 for the measurement, 5202 for background load) and
//! `kp-connect serve` (echo on 8080). For the proxied paths one Service at 10.97.255.250
//! exposes 5201, 5202 and 80 -> 8080 with the server as its only endpoint; the direct path
//! uses the server's address. Per round: `iperf3` with 1 and 4 streams (`--seconds` each,
//! with the proxy's CPU time over the 1-stream run), then connect + 1-byte echo + close
//! latency (`kp-connect probe`) idle and again while a background `iperf3 -b --load-mbps`
//! flows through the same path. Figures are medians over `--rounds`. Measurements only;
//! nothing is asserted.

use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use clap::{Parser, ValueEnum};
use kp_bench::connect::Stats;
use kp_bench::generate::NODE_NAME;
use kp_bench::report::{Table, human};
use kp_bench::sys::{self, Netns};
use kp_bench::topology::{SERVER, Shape, Topology, spawn_in, topology_of};
use kp_testbed::proxy::ProxyProcess;

const SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 97, 255, 250);
/// The measured iperf3 server.
const IPERF_PORT: u16 = 5201;
/// The background-load iperf3 server.
const LOAD_PORT: u16 = 5202;
/// The echo server's port; the Service exposes it as port 80.
const ECHO_PORT: u16 = 8080;
const SERVICE_ECHO_PORT: u16 = 80;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PathKind {
    Direct,
    Iptables,
    Userspace,
    /// Userspace mode copying through user-space buffers instead of splice(2).
    UserspaceBuffers,
    /// Userspace mode splicing through 64 KiB pipes (the kernel's default) instead of 1 MiB.
    UserspacePipe64k,
}

impl PathKind {
    fn name(self) -> &'static str {
        match self {
            PathKind::Direct => "direct",
            PathKind::Iptables => "iptables",
            PathKind::Userspace => "userspace",
            PathKind::UserspaceBuffers => "userspace-buffers",
            PathKind::UserspacePipe64k => "userspace-pipe64k",
        }
    }

    /// The `--proxy-mode`, if a proxy runs.
    fn mode(self) -> Option<&'static str> {
        match self {
            PathKind::Direct => None,
            PathKind::Iptables => Some("iptables"),
            PathKind::Userspace | PathKind::UserspaceBuffers | PathKind::UserspacePipe64k => {
                Some("userspace")
            }
        }
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "kp-datapath",
    about = "Throughput and latency: direct, iptables mode, userspace relay (as root)"
)]
struct Args {
    /// Paths to measure (direct first: the others are reported relative to it).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "direct,iptables,userspace"
    )]
    paths: Vec<PathKind>,
    /// Rounds per path; figures are medians.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Connections per latency measurement.
    #[arg(long, default_value_t = 2000)]
    count: usize,
    /// Background load during the second latency measurement, in Mbit/s.
    #[arg(long, default_value_t = 1000)]
    load_mbps: u64,
    /// The kube-proxy binary.
    #[arg(long, default_value = "target/release/kube-proxy")]
    binary: PathBuf,
    /// Append the markdown table to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Build the node as the link-local shape: its only address 169.254.100.2/30 (towards
    /// the server), no default route, client and server on `/32` routes behind veths
    /// without an address on the node's side.
    #[arg(long)]
    link_local: bool,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kp-datapath: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// This node's Node object, with `address` as its InternalIP (the address userspace mode's
/// relay listens on and the capture DNATs to, as on a real node).
fn node_manifest(address: Ipv4Addr) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE_NAME}\n  labels:\n    \
         kubernetes.io/hostname: {NODE_NAME}\nstatus:\n  addresses:\n    - type: InternalIP\n      \
         address: \"{address}\"\n"
    )
}

/// The Service (three ports) and its EndpointSlice.
fn manifest() -> String {
    let ports = [
        ("iperf", IPERF_PORT, IPERF_PORT),
        ("load", LOAD_PORT, LOAD_PORT),
        ("echo", SERVICE_ECHO_PORT, ECHO_PORT),
    ];
    let service_ports: String = ports
        .iter()
        .map(|(name, port, target)| {
            format!(
                "    - name: {name}\n      protocol: TCP\n      port: {port}\n      targetPort: {target}\n"
            )
        })
        .collect();
    let slice_ports: String = ports
        .iter()
        .map(|(name, _, target)| {
            format!("  - name: {name}\n    protocol: TCP\n    port: {target}\n")
        })
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: bench\n  namespace: default\n\
         spec:\n  clusterIP: \"{SERVICE_IP}\"\n  ports:\n{service_ports}---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: bench-1\n  \
         namespace: default\n  labels:\n    kubernetes.io/service-name: bench\n\
         addressType: IPv4\nports:\n{slice_ports}endpoints:\n  - addresses: [\"{SERVER}\"]\n    \
         nodeName: other-node\n"
    )
}

/// Received throughput of one `iperf3 -J` run, in bit/s.
fn iperf(client: &Netns, target: Ipv4Addr, seconds: u64, streams: u32) -> anyhow::Result<f64> {
    let (t, p, port) = (
        seconds.to_string(),
        streams.to_string(),
        IPERF_PORT.to_string(),
    );
    let target = target.to_string();
    // The server takes a moment to start, and to accept the next test after one ends
    // ("busy"): retry those.
    for _ in 0..20 {
        let out = client.output(
            "iperf3",
            &["-c", &target, "-p", &port, "-t", &t, "-P", &p, "-J"],
        )?;
        let json: serde_json::Value = serde_json::from_str(&out).context("iperf3 -J output")?;
        if let Some(bits) = json["end"]["sum_received"]["bits_per_second"].as_f64() {
            return Ok(bits);
        }
        let error = json["error"].as_str().unwrap_or_default();
        if !error.contains("busy") && !error.contains("unable to connect") {
            bail!("no end.sum_received in iperf3 output: {}", json["error"]);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    bail!("the iperf3 server stayed busy or unreachable")
}

/// One latency measurement with `kp-connect probe` (a sibling binary).
fn latency(client: &Netns, target: SocketAddr, count: usize) -> anyhow::Result<Stats> {
    let exe = std::env::current_exe()?;
    let connect = exe.with_file_name("kp-connect");
    let (target, count) = (target.to_string(), count.to_string());
    let out = client.output(
        connect.to_str().context("non-UTF-8 path")?,
        &["probe", "--target", &target, "--count", &count],
    )?;
    Stats::from_line(out.trim()).ok_or_else(|| anyhow!("bad probe output {out:?}"))
}

/// One round's figures.
#[derive(Clone, Copy, Debug)]
struct Round {
    one_stream: f64,
    four_streams: f64,
    /// Proxy CPU over the 1-stream run, in % of one core (`None` without a proxy).
    cpu: Option<f64>,
    idle: Stats,
    loaded: Stats,
}

fn round(args: &Args, path: PathKind, n: usize, dir: &Path) -> anyhow::Result<Round> {
    let exe = std::env::current_exe()?;
    let tag = match path {
        PathKind::UserspaceBuffers => "b",
        PathKind::UserspacePipe64k => "m",
        _ => &path.name()[..1],
    };
    let shape = if args.link_local {
        Shape::LinkLocal
    } else {
        Shape::Subnets
    };
    let topo = topology_of(shape, "kpr", &format!("{tag}{n}"))?;
    let _servers = [
        spawn_in(
            &topo.server,
            "iperf3",
            &["-s", "-p", "5201"],
            Stdio::null(),
            &[],
        )?,
        spawn_in(
            &topo.server,
            "iperf3",
            &["-s", "-p", "5202"],
            Stdio::null(),
            &[],
        )?,
        spawn_in(
            &topo.server,
            exe.with_file_name("kp-connect"),
            &["serve", "--port", "8080"],
            Stdio::null(),
            &[],
        )?,
    ];
    let proxy = match path.mode() {
        None => None,
        Some(_) => Some(start_proxy(
            args,
            path,
            &topo,
            &dir.join(format!("{}-{n}", path.name())),
        )?),
    };
    let (target, echo) = match path {
        PathKind::Direct => (SERVER, ECHO_PORT),
        PathKind::Iptables
        | PathKind::Userspace
        | PathKind::UserspaceBuffers
        | PathKind::UserspacePipe64k => (SERVICE_IP, SERVICE_ECHO_PORT),
    };
    // Wait for the path (iperf3 servers start asynchronously).
    latency(&topo.client, SocketAddr::from((target, echo)), 10)?;
    let ticks = |p: &Option<ProxyProcess>| p.as_ref().and_then(|g| sys::cpu_ticks(g.pid()));
    let (cpu_before, started) = (ticks(&proxy), Instant::now());
    let one_stream = iperf(&topo.client, target, args.seconds, 1)?;
    let cpu = match (cpu_before, ticks(&proxy)) {
        (Some((a, _)), Some((b, _))) => {
            let seconds = (b - a) as f64 / sys::ticks_per_second() as f64;
            Some(100.0 * seconds / started.elapsed().as_secs_f64())
        }
        _ => None,
    };
    let four_streams = iperf(&topo.client, target, args.seconds, 4)?;
    let idle = latency(&topo.client, SocketAddr::from((target, echo)), args.count)?;
    let (t, b, ip) = (
        (args.seconds * 6).to_string(),
        format!("{}M", args.load_mbps),
        target.to_string(),
    );
    let background = spawn_in(
        &topo.client,
        "iperf3",
        &["-c", &ip, "-p", "5202", "-t", &t, "-b", &b],
        Stdio::null(),
        &[],
    )?;
    std::thread::sleep(Duration::from_secs(1));
    let loaded = latency(&topo.client, SocketAddr::from((target, echo)), args.count)?;
    drop(background);
    drop(proxy);
    Ok(Round {
        one_stream,
        four_streams,
        cpu,
        idle,
        loaded,
    })
}

/// How long the proxy may take for its first sync of the one benchmark service.
const FIRST_SYNC_WAIT: Duration = Duration::from_secs(60);

fn start_proxy(
    args: &Args,
    path: PathKind,
    topo: &Topology,
    dir: &Path,
) -> anyhow::Result<ProxyProcess> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("bench.yaml"), manifest())?;
    std::fs::write(dir.join("node.yaml"), node_manifest(topo.node_ip))?;
    let mut launch = topo
        .node
        .proxy(&args.binary)?
        .arg(format!("--manifests={}", dir.display()))
        .arg(format!("--proxy-mode={}", path.mode().unwrap_or_default()))
        .arg("--iptables-min-sync-period=0s")
        .log_file(dir.join("proxy.log"));
    // The relay's copy switch (see kube-proxy's `userspace::COPY_ENV`).
    match path {
        PathKind::UserspaceBuffers => launch = launch.env("KP_RELAY_COPY", "buffers"),
        PathKind::UserspacePipe64k => launch = launch.env("KP_RELAY_COPY", "pipe-64"),
        _ => {}
    }
    let mut proxy = launch.spawn().context("starting kube-proxy")?;
    proxy
        .wait_first_sync(FIRST_SYNC_WAIT)
        .with_context(|| format!("{} never synced", path.name()))?;
    Ok(proxy)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn median_duration(mut values: Vec<Duration>) -> Duration {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or_default()
}

/// Medians of one path; ratios and differences to direct are taken per round (the same
/// round's direct run, measured minutes apart at most), then their median.
struct Summary {
    one: f64,
    four: f64,
    cpu: Option<f64>,
    idle: (Duration, Duration),
    loaded: (Duration, Duration),
    /// 1-stream and 4-stream throughput relative to direct.
    ratios: Option<(f64, f64)>,
    /// Added p50 and p99, idle and under load, relative to direct (signed, in µs).
    added: Option<[f64; 4]>,
}

fn summarize(rounds: &[Round], direct: Option<&[Round]>) -> Summary {
    let pick = |f: fn(&Round) -> Duration| median_duration(rounds.iter().map(f).collect());
    let cpus: Vec<f64> = rounds.iter().filter_map(|r| r.cpu).collect();
    let paired = |f: &dyn Fn(&Round, &Round) -> f64| -> Option<f64> {
        let direct = direct?;
        Some(median(
            rounds.iter().zip(direct).map(|(r, d)| f(r, d)).collect(),
        ))
    };
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let ratios = paired(&|r, d| r.one_stream / d.one_stream)
        .zip(paired(&|r, d| r.four_streams / d.four_streams));
    let added = [
        paired(&|r, d| micros(r.idle.p50) - micros(d.idle.p50)),
        paired(&|r, d| micros(r.idle.p99) - micros(d.idle.p99)),
        paired(&|r, d| micros(r.loaded.p50) - micros(d.loaded.p50)),
        paired(&|r, d| micros(r.loaded.p99) - micros(d.loaded.p99)),
    ];
    Summary {
        one: median(rounds.iter().map(|r| r.one_stream).collect()),
        four: median(rounds.iter().map(|r| r.four_streams).collect()),
        cpu: (!cpus.is_empty()).then(|| median(cpus)),
        idle: (pick(|r| r.idle.p50), pick(|r| r.idle.p99)),
        loaded: (pick(|r| r.loaded.p50), pick(|r| r.loaded.p99)),
        ratios,
        added: match added {
            [Some(a), Some(b), Some(c), Some(d)] => Some([a, b, c, d]),
            _ => None,
        },
    }
}

fn gbps(bits: f64) -> String {
    format!("{:.2} Gb/s", bits / 1e9)
}

fn run(args: &Args) -> anyhow::Result<()> {
    for tool in ["iperf3", "ip"] {
        if sys::which(tool).is_none() {
            bail!("{tool} not found (apt-get install iperf3 iproute2)");
        }
    }
    let temp = tempfile::Builder::new().prefix("kp-datapath-").tempdir()?;
    // Rounds outermost: every path is measured once per round, so a change in the machine's
    // load between rounds affects every path alike.
    let mut measured: Vec<(PathKind, Vec<Round>)> =
        args.paths.iter().map(|p| (*p, Vec::new())).collect();
    for n in 0..args.rounds {
        for (path, rounds) in &mut measured {
            let r = round(args, *path, n, temp.path())?;
            eprintln!(
                "kp-datapath: {} round {n}: 1 stream {}, 4 streams {}, cpu {:?}, idle p50/p99 {}/{}, loaded {}/{} (load {})",
                path.name(),
                gbps(r.one_stream),
                gbps(r.four_streams),
                r.cpu,
                human(r.idle.p50),
                human(r.idle.p99),
                human(r.loaded.p50),
                human(r.loaded.p99),
                sys::load()
            );
            rounds.push(r);
        }
    }
    let direct: Option<Vec<Round>> = measured
        .iter()
        .find(|(p, _)| *p == PathKind::Direct)
        .map(|(_, r)| r.clone());
    let mut table = Table::new(&[
        "path",
        "1 stream",
        "4 streams",
        "connect+echo p50 / p99 (idle)",
        "p50 / p99 under load",
        "added p50 / p99 vs direct, idle",
        "added p50 / p99 vs direct, under load",
        "proxy CPU (1 stream)",
    ]);
    for (path, rounds) in &measured {
        let s = summarize(rounds, direct.as_deref());
        let with_ratio = |v: f64, r: Option<f64>| match r {
            Some(r) => format!("{} ({r:.2}× direct)", gbps(v)),
            None => gbps(v),
        };
        let us = |v: f64| format!("{v:+.0} µs");
        let (idle_added, loaded_added) = match s.added {
            Some([a, b, c, d]) if *path != PathKind::Direct => (
                format!("{} / {}", us(a), us(b)),
                format!("{} / {}", us(c), us(d)),
            ),
            _ => ("-".to_owned(), "-".to_owned()),
        };
        table.row(vec![
            path.name().to_owned(),
            with_ratio(s.one, s.ratios.map(|r| r.0)),
            with_ratio(s.four, s.ratios.map(|r| r.1)),
            format!("{} / {}", human(s.idle.0), human(s.idle.1)),
            format!("{} / {}", human(s.loaded.0), human(s.loaded.1)),
            idle_added,
            loaded_added,
            s.cpu
                .map_or("-".to_owned(), |c| format!("{c:.0}% of a core")),
        ]);
    }
    let text = format!(
        "{}\n{} rounds (medians), {} s per iperf3 run, {} connections per latency figure, background load {} Mbit/s{}; load 1m at the end {}\n",
        table.render(),
        args.rounds,
        args.seconds,
        args.count,
        args.load_mbps,
        if args.link_local {
            ", link-local node"
        } else {
            ""
        },
        sys::load()
    );
    println!("{text}");
    if let Some(out) = &args.out {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)?;
        file.write_all(text.as_bytes())?;
    }
    Ok(())
}
