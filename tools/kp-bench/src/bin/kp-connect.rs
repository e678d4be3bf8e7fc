//! `kp-connect`: TCP connection set-up latency through the proxy's rules.
//!
//! Topology (all veths created from inside the namespaces; the host's namespace is never
//! touched), namespaces `kpconn-<pid>-<tag>-{cl,node,srv}`:
//!
//! ```text
//! client 10.200.1.2 -- 10.200.1.1 node (kube-proxy, forwarding) 10.200.2.1 -- 10.200.2.2 server (echo :8080)
//! ```
//!
//! For each mode and service count N the proxy gets N services: N-1 of the `kp-scale` shape
//! (dummy endpoints) plus one target ClusterIP whose only endpoint is the echo server. Once
//! the first sync is logged, the client makes `--count` sequential connections to the
//! target (connect, send 1 byte, read it back, the server closes, close) and the same number
//! directly to the server's address, and reports p50/p99. Measurements only; nothing is asserted.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use clap::{Parser, Subcommand, ValueEnum};
use kp_bench::connect::{self, ECHO_PORT, Stats, TARGET_IP, TARGET_PORT};
use kp_bench::logs::LogLine;
use kp_bench::report::{Figure, Table, human, mib};
use kp_bench::sys::{self, Netns};
use kp_bench::topology::{SERVER, spawn_in, topology};
use kp_testbed::TestbedError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    Iptables,
    Nftables,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
        }
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "kp-connect",
    about = "TCP connect latency through kube-proxy-rs rules"
)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The benchmark (as root).
    Run(RunArgs),
    /// Internal: the echo server (run inside the server namespace).
    Serve {
        #[arg(long, default_value_t = ECHO_PORT)]
        port: u16,
    },
    /// Internal: the client loop (run inside the client namespace); prints one stats line.
    Probe {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 2000)]
        count: usize,
        #[arg(long, default_value_t = 50)]
        warmup: usize,
    },
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Service counts (the target included).
    #[arg(long, value_delimiter = ',', default_value = "1,1000,10000")]
    services: Vec<usize>,
    /// Dummy endpoints per generated service.
    #[arg(long, default_value_t = 10)]
    endpoints: usize,
    /// Proxy modes.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "iptables,nftables"
    )]
    modes: Vec<Mode>,
    /// Connections per measurement.
    #[arg(long, default_value_t = 2000)]
    count: usize,
    /// Give up waiting for the first sync after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// The kube-proxy binary.
    #[arg(long, default_value = "target/release/kube-proxy")]
    binary: PathBuf,
    /// Append the markdown table to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.command {
        Cmd::Run(run_args) => run(&run_args),
        Cmd::Serve { port } => serve(port),
        Cmd::Probe {
            target,
            count,
            warmup,
        } => probe(target, count, warmup),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kp-connect: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Threads accepting echo connections: the client is sequential, so a few suffice, and no
/// connection waits for a thread to be created (which cost tens of µs per connection).
const SERVE_THREADS: usize = 4;

/// Echoes one read of each connection, then closes it: the server closes first, so the
/// connection's TIME_WAIT stays on the server's side and the client's port search on connect
/// does not grow with the connections already made (it dominated the client's CPU in a
/// profile: `__inet_hash_connect`).
fn serve(port: u16) -> anyhow::Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", port)).context("binding the echo port")?;
    for _ in 1..SERVE_THREADS {
        let listener = listener.try_clone().context("sharing the echo port")?;
        std::thread::spawn(move || echo_each(&listener));
    }
    echo_each(&listener);
    Ok(())
}

fn echo_each(listener: &TcpListener) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let mut buf = [0u8; 64];
        if let Ok(n @ 1..) = stream.read(&mut buf) {
            let _ = stream.write_all(&buf[..n]);
        }
    }
}

/// Connect, send one byte, read it back, wait for the server's close, close.
fn one(target: SocketAddr) -> std::io::Result<Duration> {
    let start = Instant::now();
    let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.write_all(b"x")?;
    let mut byte = [0u8; 1];
    stream.read_exact(&mut byte)?;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest)?;
    drop(stream);
    Ok(start.elapsed())
}

fn probe(target: SocketAddr, count: usize, warmup: usize) -> anyhow::Result<()> {
    // Wait until the path works, then warm up.
    let ready_by = Instant::now() + Duration::from_secs(15);
    while let Err(err) = one(target) {
        if Instant::now() > ready_by {
            bail!("{target} not reachable: {err}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..warmup {
        one(target)?;
    }
    let mut samples = Vec::with_capacity(count);
    let mut errors = 0usize;
    for _ in 0..count {
        match one(target) {
            Ok(took) => samples.push(took),
            Err(_) => errors += 1,
        }
    }
    if errors > 0 {
        eprintln!("kp-connect: {errors} of {count} connections to {target} failed");
    }
    let stats = Stats::of(&mut samples).context("no successful connection")?;
    println!("{}", stats.to_line());
    Ok(())
}

fn run_probe(exe: &Path, ns: &Netns, target: SocketAddr, count: usize) -> anyhow::Result<Stats> {
    let target = target.to_string();
    let count = count.to_string();
    let out = ns.output(
        exe.to_str().context("non-UTF-8 path")?,
        &["probe", "--target", &target, "--count", &count],
    )?;
    Stats::from_line(out.trim()).ok_or_else(|| anyhow!("bad probe output {out:?}"))
}

/// One mode at one scale.
struct Row {
    took: Figure,
    rss: Option<u64>,
    service: Option<Stats>,
    direct: Option<Stats>,
    load: String,
}

fn measure(args: &RunArgs, mode: Mode, services: usize, dir: &Path) -> anyhow::Result<Row> {
    let exe = std::env::current_exe()?;
    let load_start = sys::load();
    let manifests_dir = dir.join(format!("manifests-{}-{services}", mode.name()));
    std::fs::create_dir_all(&manifests_dir)?;
    for (name, text) in connect::manifests(services, args.endpoints, SERVER).files {
        std::fs::write(manifests_dir.join(name), text)?;
    }
    let topo = topology("kpconn", &format!("{}{services}", &mode.name()[..1]))?;
    let port = ECHO_PORT.to_string();
    let server = spawn_in(
        &topo.server,
        &exe,
        &["serve", "--port", &port],
        Stdio::null(),
        &[],
    )?;
    let log_path = dir.join(format!("proxy-{}-{services}.log", mode.name()));
    let mut proxy = topo
        .node
        .proxy(&args.binary)?
        .arg(format!("--manifests={}", manifests_dir.display()))
        .arg(format!("--proxy-mode={}", mode.name()))
        .args(["-v=2", "--iptables-min-sync-period=0s"])
        .log_file(&log_path)
        .spawn()
        .context("starting kube-proxy")?;
    let limit = Duration::from_secs(args.timeout);
    let took = match proxy.wait_first_sync(limit) {
        Ok(entry) => Some(Figure::from_option(
            LogLine::parse(&entry.line).and_then(|l| l.duration("took")),
        )),
        Err(TestbedError::ProxyTimedOut { .. }) => None,
        Err(error) => return Err(error).context("waiting for the first sync"),
    };
    let rss = sys::vm_hwm_kib(proxy.pid());
    let load = || format!("{load_start}→{}", sys::load());
    let Some(took) = took else {
        eprintln!(
            "kp-connect: {} {services}: first sync did not finish in {} s",
            mode.name(),
            limit.as_secs()
        );
        drop(proxy);
        drop(server);
        return Ok(Row {
            took: Figure::DidNotFinish(limit),
            rss,
            service: None,
            direct: None,
            load: load(),
        });
    };
    eprintln!(
        "kp-connect: {} {services}: first sync took {took}; probing",
        mode.name()
    );
    let target = SocketAddr::from((TARGET_IP, TARGET_PORT));
    let service = run_probe(&exe, &topo.client, target, args.count);
    let direct = run_probe(
        &exe,
        &topo.client,
        SocketAddr::from((SERVER, ECHO_PORT)),
        args.count,
    );
    // The proxy's own pid is `ip netns exec`'s (it execs).
    let rss = sys::vm_hwm_kib(proxy.pid()).or(rss);
    drop(proxy);
    drop(server);
    Ok(Row {
        took,
        rss,
        service: Some(service?),
        direct: Some(direct?),
        load: load(),
    })
}

fn stats_cells(stats: Option<Stats>) -> (String, String) {
    stats.map_or(("-".to_owned(), "-".to_owned()), |s| {
        (
            format!("{} / {}", human(s.p50), human(s.p99)),
            format!("{} / {}", human(s.min), human(s.max)),
        )
    })
}

fn run(args: &RunArgs) -> anyhow::Result<()> {
    let temp = tempfile::Builder::new().prefix("kp-connect-").tempdir()?;
    let mut table = Table::new(&[
        "services",
        "mode",
        "first sync (log `took`)",
        "via ClusterIP p50 / p99",
        "min / max",
        "direct to pod IP p50 / p99",
        "peak RSS",
        "load 1m",
    ]);
    for &mode in &args.modes {
        for &services in &args.services {
            let row = measure(args, mode, services, temp.path())?;
            let (svc, svc_range) = stats_cells(row.service);
            let (direct, _) = stats_cells(row.direct);
            let cells = vec![
                services.to_string(),
                mode.name().to_owned(),
                row.took.to_string(),
                svc,
                svc_range,
                direct,
                row.rss.map_or("-".to_owned(), mib),
                row.load,
            ];
            eprintln!("kp-connect: {}", cells.join(" | "));
            table.row(cells);
        }
    }
    let text = table.render();
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
