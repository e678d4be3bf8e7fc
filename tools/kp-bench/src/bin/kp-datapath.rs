//! `kp-datapath`: data-path throughput and latency, side by side: direct pod to pod, through
//! iptables mode, nftables mode, nftables mode with the socket load balancer
//! (`--socket-lb`), and userspace mode's relay.
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
//!
//! `--services 1,10000` repeats every path with that many Services in the proxy (the
//! benchmark Service plus generated ones, kp-bench's `generate`), rounds outermost, sizes
//! and paths alternated within a round. For `nftables-socket-lb` the benchmark process enters
//! a cgroup v2 directory of its own for the round (so the client's `iperf3` and `kp-connect`
//! start inside it) and the proxy attaches there through a second cgroup2 mount (`ip netns
//! exec` hides `/sys`); the round fails unless the proxy logs that it attached. The client's
//! CPU per connection is the probing process's user + system time (its shell's `cutime` +
//! `cstime`, in clock ticks) over the idle latency run, divided by the connections: it holds
//! the connect-time BPF programs, not softirq work the kernel does elsewhere.

use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use clap::{Parser, ValueEnum};
use kp_bench::connect::Stats;
use kp_bench::generate::NODE_NAME;
use kp_bench::generate::{Scale, generate};
use kp_bench::report::{Table, human};
use kp_bench::sys::{self, Netns};
use kp_bench::topology::{SERVER, Shape, Topology, spawn_in, topology_of};
use kp_testbed::cgroup::{TestCgroup, cgroup2_root};
use kp_testbed::proxy::ProxyProcess;

/// The benchmark's cgroups (`nftables-socket-lb` rounds), under the cgroup v2 root.
const CGROUP_PREFIX: &str = "kp-datapath-";

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
    Nftables,
    /// nftables mode with `--socket-lb`: the client's connects are translated by the
    /// cgroup programs, and packets go to the endpoint without NAT.
    NftablesSocketLb,
    /// The control for the socket load balancer: nftables mode running (its hooks and
    /// conntrack in the node's path), the client connecting to the endpoint's address.
    EndpointBesideNftables,
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
            PathKind::Nftables => "nftables",
            PathKind::NftablesSocketLb => "nftables-socket-lb",
            PathKind::EndpointBesideNftables => "endpoint-beside-nftables",
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
            PathKind::Nftables | PathKind::NftablesSocketLb | PathKind::EndpointBesideNftables => {
                Some("nftables")
            }
            PathKind::Userspace | PathKind::UserspaceBuffers | PathKind::UserspacePipe64k => {
                Some("userspace")
            }
        }
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "kp-datapath",
    about = "Throughput and latency: direct, iptables, nftables (+ socket LB), userspace relay (as root)"
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
    /// Services in the proxy, one size after another within each round (1: the benchmark
    /// Service alone).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    services: Vec<usize>,
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

/// One latency measurement with `kp-connect probe` (a sibling binary), and the probe's
/// CPU time (user + system, in seconds), read from its shell's `cutime` and `cstime`.
fn latency(client: &Netns, target: SocketAddr, count: usize) -> anyhow::Result<(Stats, f64)> {
    let exe = std::env::current_exe()?;
    let connect = exe.with_file_name("kp-connect");
    let (target, count) = (target.to_string(), count.to_string());
    let out = client.output(
        "sh",
        &[
            "-c",
            r#""$0" "$@" && cat /proc/$$/stat"#,
            connect.to_str().context("non-UTF-8 path")?,
            "probe",
            "--target",
            &target,
            "--count",
            &count,
        ],
    )?;
    let mut lines = out.lines();
    let stats = lines.next().and_then(|l| Stats::from_line(l.trim()));
    let cpu = lines.next().and_then(children_cpu_ticks);
    match (stats, cpu) {
        (Some(stats), Some(ticks)) => Ok((stats, ticks as f64 / sys::ticks_per_second() as f64)),
        _ => Err(anyhow!("bad probe output {out:?}")),
    }
}

/// `cutime + cstime` of a `/proc/PID/stat` line (fields 16 and 17).
fn children_cpu_ticks(stat: &str) -> Option<u64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (the state).
    let cutime: u64 = fields.get(13)?.parse().ok()?;
    let cstime: u64 = fields.get(14)?.parse().ok()?;
    Some(cutime + cstime)
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
    /// The client's CPU per connection over the idle latency run, in µs.
    client_cpu_us: f64,
}

fn round(
    args: &Args,
    path: PathKind,
    services: usize,
    n: usize,
    dir: &Path,
) -> anyhow::Result<Round> {
    let exe = std::env::current_exe()?;
    let tag = match path {
        PathKind::UserspaceBuffers => "b",
        PathKind::UserspacePipe64k => "m",
        PathKind::NftablesSocketLb => "s",
        PathKind::EndpointBesideNftables => "e",
        _ => &path.name()[..1],
    };
    let tag = format!("{tag}{}", services.min(99_999));
    // Entered for the whole round: every client command starts inside it.
    let mut cgroup = match path {
        PathKind::NftablesSocketLb => {
            let mut cgroup = TestCgroup::create(CGROUP_PREFIX).context("a cgroup v2 directory")?;
            cgroup.enter().context("entering the cgroup")?;
            Some(cgroup)
        }
        _ => None,
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
            (path, services),
            &topo,
            cgroup.as_ref(),
            &dir.join(format!("{}-{services}-{n}", path.name())),
        )?),
    };
    let (target, echo) = match path {
        PathKind::Direct | PathKind::EndpointBesideNftables => (SERVER, ECHO_PORT),
        PathKind::Iptables
        | PathKind::Nftables
        | PathKind::NftablesSocketLb
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
    let (idle, client_cpu) = latency(&topo.client, SocketAddr::from((target, echo)), args.count)?;
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
    let (loaded, _) = latency(&topo.client, SocketAddr::from((target, echo)), args.count)?;
    drop(background);
    drop(proxy);
    if let Some(cgroup) = cgroup.as_mut() {
        cgroup.leave().context("leaving the cgroup")?;
    }
    Ok(Round {
        one_stream,
        four_streams,
        cpu,
        idle,
        loaded,
        client_cpu_us: 1e6 * client_cpu / args.count as f64,
    })
}

/// How long the proxy may take for its first sync (a debug build with 10k Services on a
/// loaded machine took over 60 s).
const FIRST_SYNC_WAIT: Duration = Duration::from_secs(180);

fn start_proxy(
    args: &Args,
    (path, services): (PathKind, usize),
    topo: &Topology,
    cgroup: Option<&TestCgroup>,
    dir: &Path,
) -> anyhow::Result<ProxyProcess> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("bench.yaml"), manifest())?;
    std::fs::write(dir.join("node.yaml"), node_manifest(topo.node_ip))?;
    write_filler(dir, services.saturating_sub(1))?;
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
    let view = match cgroup {
        Some(cgroup) => {
            let view = CgroupView::mount(dir)?;
            launch = launch.arg("--socket-lb").arg(format!(
                "--socket-lb-cgroup={}",
                view.path_of(cgroup)?.display()
            ));
            Some(view)
        }
        None => None,
    };
    let mut proxy = launch.spawn().context("starting kube-proxy")?;
    proxy
        .wait_first_sync(FIRST_SYNC_WAIT)
        .with_context(|| format!("{} never synced", path.name()))?;
    if view.is_some() {
        let log = std::fs::read_to_string(dir.join("proxy.log")).unwrap_or_default();
        if !log.contains("Socket load balancer attached") {
            bail!(
                "the socket load balancer did not attach; see {}/proxy.log",
                dir.display()
            );
        }
    }
    Ok(proxy)
}

/// `count` generated Services (one endpoint each) beside the benchmark one; kp-bench's
/// generated node.yaml is left out (this benchmark writes its own).
fn write_filler(dir: &Path, count: usize) -> anyhow::Result<()> {
    if count == 0 {
        return Ok(());
    }
    for (name, text) in generate(Scale::new(count, 1)).files {
        if name != "node.yaml" {
            std::fs::write(dir.join(name), text)?;
        }
    }
    Ok(())
}

/// The cgroup v2 hierarchy mounted a second time under `dir`, where the proxy under `ip
/// netns exec` (which remounts `/sys`) can see it; unmounted (lazily) once the proxy has
/// attached: the programs stay attached to the cgroup, not to the mount.
struct CgroupView {
    path: PathBuf,
}

impl CgroupView {
    fn mount(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("cgroup2");
        std::fs::create_dir_all(&path)?;
        let target = path.to_str().context("non-UTF-8 path")?;
        sys::run_std("mount", &["-t", "cgroup2", "cgroup2", target])?;
        Ok(Self { path })
    }

    fn path_of(&self, cgroup: &TestCgroup) -> anyhow::Result<PathBuf> {
        let root = cgroup2_root().context("no cgroup v2 mount")?;
        let relative = cgroup.path().strip_prefix(&root)?;
        Ok(self.path.join(relative))
    }
}

impl Drop for CgroupView {
    fn drop(&mut self) {
        if let Some(path) = self.path.to_str() {
            let _ = sys::run_std("umount", &["-l", path]);
        }
    }
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
    client_cpu_us: f64,
    idle: (Duration, Duration),
    loaded: (Duration, Duration),
    /// 1-stream and 4-stream throughput relative to direct.
    ratios: Option<(f64, f64)>,
    /// Idle connect+echo p50 relative to direct (the issue's target: at most 1.05).
    p50_ratio: Option<f64>,
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
        client_cpu_us: median(rounds.iter().map(|r| r.client_cpu_us).collect()),
        idle: (pick(|r| r.idle.p50), pick(|r| r.idle.p99)),
        loaded: (pick(|r| r.loaded.p50), pick(|r| r.loaded.p99)),
        ratios,
        p50_ratio: paired(&|r, d| r.idle.p50.as_secs_f64() / d.idle.p50.as_secs_f64()),
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
            bail!("{tool} not found (./setup.sh --tests installs it)");
        }
    }
    let temp = tempfile::Builder::new().prefix("kp-datapath-").tempdir()?;
    // Rounds outermost: every path is measured once per round, so a change in the machine's
    // load between rounds affects every path alike.
    let mut measured: Vec<((usize, PathKind), Vec<Round>)> = args
        .services
        .iter()
        .flat_map(|&n| args.paths.iter().map(move |&p| ((n, p), Vec::new())))
        .collect();
    for n in 0..args.rounds {
        for ((services, path), rounds) in &mut measured {
            let r = round(args, *path, *services, n, temp.path())?;
            eprintln!(
                "kp-datapath: {} with {services} services round {n}: 1 stream {}, 4 streams {}, cpu {:?}, client cpu/conn {:.1} µs, idle p50/p99 {}/{}, loaded {}/{} (load {})",
                path.name(),
                gbps(r.one_stream),
                gbps(r.four_streams),
                r.cpu,
                r.client_cpu_us,
                human(r.idle.p50),
                human(r.idle.p99),
                human(r.loaded.p50),
                human(r.loaded.p99),
                sys::load()
            );
            rounds.push(r);
        }
    }
    let mut table = Table::new(&[
        "services",
        "path",
        "1 stream",
        "4 streams",
        "connect+echo p50 / p99 (idle)",
        "p50 / p99 under load",
        "added p50 / p99 vs direct, idle",
        "added p50 / p99 vs direct, under load",
        "proxy CPU (1 stream)",
        "client CPU per connection",
    ]);
    for ((services, path), rounds) in &measured {
        // Each size's direct rounds: the same round's, measured minutes apart at most.
        let direct: Option<&[Round]> = measured
            .iter()
            .find(|((n, p), _)| n == services && *p == PathKind::Direct)
            .map(|(_, r)| r.as_slice());
        let s = summarize(rounds, direct);
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
            services.to_string(),
            path.name().to_owned(),
            with_ratio(s.one, s.ratios.map(|r| r.0)),
            with_ratio(s.four, s.ratios.map(|r| r.1)),
            match s.p50_ratio {
                Some(r) if *path != PathKind::Direct => {
                    format!("{} ({r:.2}× direct) / {}", human(s.idle.0), human(s.idle.1))
                }
                _ => format!("{} / {}", human(s.idle.0), human(s.idle.1)),
            },
            format!("{} / {}", human(s.loaded.0), human(s.loaded.1)),
            idle_added,
            loaded_added,
            s.cpu
                .map_or("-".to_owned(), |c| format!("{c:.0}% of a core")),
            format!("{:.1} µs", s.client_cpu_us),
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
