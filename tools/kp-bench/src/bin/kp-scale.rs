//! `kp-scale`: the iptables-mode scale benchmark.
//!
//! Generates N Services × M endpoints as manifests, runs the real `kube-proxy` on them inside
//! a network namespace of its own and reads from its `-v=2` log how long the first full sync
//! took (render and restore apart), then rewrites the file holding one service's
//! EndpointSlice and measures the partial sync that follows; peak RSS from `/proc`. With
//! `--restore` it also renders the same state in-process and times `iptables-restore` (nf_tables)
//! and `iptables-legacy-restore` on that text directly, whole and split into several
//! transactions. With `--source api` the proxy watches the fake API server of
//! `kp_testbed::apiserver` (`kp-echo apiserver` in the proxy's namespace) holding the same
//! objects, and the edit is that server's change of one EndpointSlice: what a cluster runs.
//! With `--checks` it then waits for the self-healing check before the next periodic sync
//! and prints what the checks of the kernel's rules cost (the canary check every canary
//! period, where nothing notifies, and that thorough one). `--changes` makes one edit of each
//! listed kind and prints their partial syncs; `--list-ruleset` times `nft list ruleset` of
//! the programmed namespace at any size (its output size and `nft`'s peak RSS).
//! See the crate's README for how to read the figures.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use clap::{Parser, ValueEnum};
use kp_bench::generate::{self, Change, Edit, Manifests, Scale};
use kp_bench::logs::{Checks, FIRST_SYNC, LogLine, SyncCollector, SyncPhases, median};
use kp_bench::report::{Figure, Table, human, mib};
use kp_bench::split::split_restore;
use kp_bench::state::Loaded;
use kp_bench::sys::{self, Netns};
use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
use kp_rules::iptables::{RenderConfig, SyncScope, render};
use kp_testbed::apiserver::{FakeApiProcess, yaml_objects};
use kp_testbed::proxy::{LogEntry, NextLine, ProxyProcess};

/// Which proxy mode to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// `--proxy-mode iptables`.
    Iptables,
    /// `--proxy-mode nftables --nftables-layout=chains` (upstream's layout; no render line in
    /// its log).
    Nftables,
    /// `--proxy-mode nftables --nftables-layout=maps`: the verdict-free layout, the default.
    NftablesMaps,
    /// `--proxy-mode fake`: the control plane only, nothing programmed.
    Fake,
    /// `--proxy-mode ipvs` (needs a kernel with IPVS: run inside the test VM, see README).
    Ipvs,
}

/// Where the proxy reads Services, EndpointSlices and its Node from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Source {
    /// `--manifests DIR`: the generated files; an edit rewrites one.
    Manifests,
    /// `--master URL`: the fake API server (`kp-echo apiserver`) in the proxy's namespace,
    /// holding the same objects; an edit is its change of one EndpointSlice, sent to the
    /// proxy's watch.
    Api,
}

/// How the generated manifests are laid out on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Layout {
    /// A directory of a few `services-NNN.yaml` files (at most 8) and `node.yaml`.
    Files,
    /// A directory of `node.yaml` and one `services.yaml` holding every Service and
    /// EndpointSlice: an edit rewrites the one big file.
    Single,
}

/// How an edit is written to its manifests file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Write {
    /// A hidden file renamed over it (atomic).
    Rename,
    /// In place, as `cat > file` or Python's `open(f, "w")`: truncated, then written in
    /// 64 KiB pieces.
    InPlace,
}

/// Which iptables the proxy runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Variant {
    /// The proxy's own choice (`--iptables-backend` unset): in the benchmark's empty namespace
    /// that is nf_tables, as upstream's image would choose.
    System,
    /// The legacy tools (`--iptables-backend=legacy`).
    Legacy,
    /// The nf_tables tools, chosen explicitly (`--iptables-backend=nft`).
    Nft,
}

/// Which restore tool the `--restore` comparison times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Tool {
    /// `iptables-restore` (nf_tables backend here).
    Nft,
    /// `iptables-legacy-restore`.
    Legacy,
}

#[derive(Debug, Parser)]
#[command(
    name = "kp-scale",
    about = "iptables-mode scale benchmark of kube-proxy-rs"
)]
struct Args {
    /// Services to generate.
    #[arg(long)]
    services: usize,
    /// Endpoints per service.
    #[arg(long)]
    endpoints: usize,
    /// Proxy mode of the run.
    #[arg(long, value_enum, default_value_t = Mode::Iptables)]
    mode: Mode,
    /// iptables tools the proxy uses.
    #[arg(long, value_enum, default_value_t = Variant::System)]
    iptables: Variant,
    /// How the manifests are laid out (the edits rewrite the file holding the slice).
    #[arg(long, value_enum, default_value_t = Layout::Files)]
    layout: Layout,
    /// Where the proxy reads its objects from.
    #[arg(long, value_enum, default_value_t = Source::Manifests)]
    source: Source,
    /// How an edit is written to its manifests file.
    #[arg(long, value_enum, default_value_t = Write::Rename)]
    write: Write,
    /// `KUBE_PROXY_RS_MANIFESTS_REMOVAL_GUARD` for the proxy (`off`, `50%,100`; default:
    /// unset, the proxy's default).
    #[arg(long)]
    removal_guard: Option<String>,
    /// The kp-echo binary serving the fake API server with `--source api` (default: the
    /// one kp-testbed finds next to this binary).
    #[arg(long)]
    echo: Option<PathBuf>,
    /// The kube-proxy binary.
    #[arg(long, default_value = "target/release/kube-proxy")]
    binary: PathBuf,
    /// Append the markdown rows to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Give up on the first sync (and on each restore) after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Also time the restore tools directly on the in-process render.
    #[arg(long)]
    restore: bool,
    /// Restore tools to time with --restore.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "nft,legacy")]
    tools: Vec<Tool>,
    /// With --restore: numbers of transactions to split the ruleset into (1 = whole).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    split: Vec<usize>,
    /// Skip the proxy run (only with --restore).
    #[arg(long)]
    no_proxy: bool,
    /// Keep manifests, logs and rendered rules in this directory (default: a temporary one).
    #[arg(long)]
    keep: Option<PathBuf>,
    /// After the partial syncs, wait for the thorough self-healing check before the next
    /// periodic sync (`syncPeriod`, 30 s by default) and print a table of the checks' times.
    #[arg(long)]
    checks: bool,
    /// After the two classic edits, one edit of each of these kinds, each to a service of
    /// its own (and a table of their partial syncs): `endpoint-replaced`, `service-added`,
    /// `affinity-on`, ... (`affinity-off` and `policy-cluster` revert an earlier
    /// `affinity-on` / `policy-local`).
    #[arg(long, value_enum, value_delimiter = ',')]
    changes: Vec<Change>,
    /// With --checks: give up waiting for the thorough check after this many seconds.
    #[arg(long, default_value_t = 90)]
    checks_wait: u64,
    /// After the edits, time `nft list ruleset` in the proxy's namespace at any size (what a
    /// monitoring agent or an operator runs) and print a table of its wall time, output size
    /// and the peak RSS of `nft`; given up after `--timeout`.
    #[arg(long)]
    list_ruleset: bool,
    /// With --list-ruleset: kill `nft` once its RSS passes this many MiB (the machine is
    /// shared; a listing of millions of elements can take gigabytes).
    #[arg(long, default_value_t = 4096)]
    list_max_mib: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("kp-scale: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        // Dropping `run` on a signal drops its guards: the proxy is killed and the
        // namespaces are deleted.
        tokio::select! {
            result = run(&args) => result,
            _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
            _ = term.recv() => Err(anyhow!("terminated")),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kp-scale: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<()> {
    if args.no_proxy && !args.restore {
        bail!("--no-proxy leaves nothing to do without --restore");
    }
    let scale = Scale::new(args.services, args.endpoints);
    let temp = tempfile::Builder::new().prefix("kp-scale-").tempdir()?;
    let dir = match &args.keep {
        Some(keep) => {
            std::fs::create_dir_all(keep)?;
            keep.clone()
        }
        None => temp.path().to_owned(),
    };
    let manifests_dir = dir.join("manifests");
    let manifests = generate_layout(args.layout, scale);
    write_manifests(&manifests_dir, &manifests)?;
    eprintln!(
        "kp-scale: {}×{}: {} service ports, {} NodePorts, {} files ({:.1} MiB) in {}; load {}",
        scale.services,
        scale.endpoints,
        scale.service_ports(),
        scale.node_ports(),
        manifests.files.len(),
        manifests.bytes() as f64 / 1048576.0,
        manifests_dir.display(),
        sys::load()
    );

    let mut report = String::new();
    if !args.no_proxy {
        for table in proxy_run(args, scale, &dir, &manifests_dir, &manifests).await? {
            println!("{}", table.render());
            report.push_str(&table.render());
            report.push('\n');
        }
    }
    if args.restore {
        let table = restore_runs(args, scale, &manifests, &dir).await?;
        println!("{}", table.render());
        report.push_str(&table.render());
        report.push('\n');
    }
    if let Some(out) = &args.out {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .with_context(|| format!("opening {}", out.display()))?;
        std::io::Write::write_all(&mut file, report.as_bytes())?;
    }
    Ok(())
}

/// The generated manifests in `layout`.
fn generate_layout(layout: Layout, scale: Scale) -> Manifests {
    match layout {
        Layout::Files => generate::generate(scale),
        Layout::Single => generate::generate_single(scale),
    }
}

/// The file holding the edited slices, rewritten with `edits` (all so far) in `layout`.
fn edited_layout(layout: Layout, scale: Scale, edits: &[Edit]) -> Option<(String, String)> {
    match layout {
        Layout::Files => {
            let file = scale.file_of(edits.last()?.service);
            let same_file: Vec<Edit> = edits
                .iter()
                .copied()
                .filter(|e| scale.file_of(e.service) == file)
                .collect();
            generate::edited_file(scale, &same_file)
        }
        Layout::Single => Some(generate::edited_single(scale, edits)),
    }
}

fn write_manifests(dir: &Path, manifests: &Manifests) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (name, text) in &manifests.files {
        std::fs::write(dir.join(name), text)?;
    }
    Ok(())
}

/// Replace `dir/name` atomically: write a hidden file (the source skips dot files), rename.
fn replace_file(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(name))?;
    Ok(())
}

/// Rewrite `dir/name` in place: truncate, then write in 64 KiB pieces (each its own
/// `write`, as a buffered writer does), then close.
fn rewrite_in_place(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::File::create(dir.join(name))?;
    for piece in text.as_bytes().chunks(64 * 1024) {
        file.write_all(piece)?;
    }
    Ok(())
}

/// How many log lines an error shows.
const LOG_TAIL: usize = 20;

/// The proxy under benchmark (kp-testbed's harness). Dropping it kills it and whatever it
/// started (by pid).
struct Proxy {
    process: ProxyProcess,
    pid: u32,
    collector: SyncCollector,
    checks: Checks,
    started: Instant,
}

impl Proxy {
    /// Starts the proxy reading from `source`: `--manifests=DIR` or `--master=URL`.
    fn spawn(netns: &Netns, args: &Args, source: &str, log: &Path) -> anyhow::Result<Self> {
        let mode = match args.mode {
            Mode::Iptables => "--proxy-mode=iptables",
            Mode::Nftables | Mode::NftablesMaps => "--proxy-mode=nftables",
            Mode::Fake => "--proxy-mode=fake",
            Mode::Ipvs => "--proxy-mode=ipvs",
        };
        let backend = match args.iptables {
            Variant::System => "--iptables-backend=auto",
            Variant::Legacy => "--iptables-backend=legacy",
            Variant::Nft => "--iptables-backend=nft",
        };
        let layout = match args.mode {
            Mode::Nftables => Some("--nftables-layout=chains"),
            Mode::NftablesMaps => Some("--nftables-layout=maps"),
            Mode::Iptables | Mode::Fake | Mode::Ipvs => None,
        };
        let mut launch = netns.proxy(&args.binary)?;
        if let Some(guard) = &args.removal_guard {
            launch = launch.env("KUBE_PROXY_RS_MANIFESTS_REMOVAL_GUARD", guard);
        }
        let process = launch
            .arg(source)
            .args([
                mode,
                backend,
                "-v=2",
                "--iptables-min-sync-period=0s",
                "--ipvs-min-sync-period=0s",
            ])
            .args(layout)
            .log_file(log)
            .spawn()
            .context("starting kube-proxy")?;
        Ok(Self {
            pid: process.pid(),
            started: process.started(),
            process,
            collector: SyncCollector::default(),
            checks: Checks::default(),
        })
    }

    /// The next log line's entry and its parse (`None` at `deadline`).
    async fn next_line(&mut self, deadline: Instant) -> anyhow::Result<Option<(Instant, LogLine)>> {
        loop {
            let LogEntry { at, line } = match self.process.next_line_async(deadline).await {
                NextLine::Line(entry) => entry,
                NextLine::Silent => return Ok(None),
                NextLine::Ended => bail!(
                    "kube-proxy exited; last log lines:\n{}",
                    self.process.tail(LOG_TAIL)
                ),
            };
            if line.starts_with('E') {
                eprintln!("kp-scale: proxy: {line}");
            }
            if let Some(parsed) = LogLine::parse(&line) {
                self.checks.feed(&parsed);
                return Ok(Some((at, parsed)));
            }
        }
    }

    /// Read lines until one more thorough check has been logged; whether it came before
    /// `deadline`.
    async fn wait_thorough_check(&mut self, deadline: Instant) -> anyhow::Result<bool> {
        let before = self.checks.thorough.len();
        while self.checks.thorough.len() == before {
            let Some((_, parsed)) = self.next_line(deadline).await? else {
                return Ok(false);
            };
            self.collector.feed(&parsed);
        }
        Ok(true)
    }

    /// Read lines until `done` accepts a completed sync (returns it and when its line
    /// arrived) or `deadline` passes (`None`).
    async fn wait_sync(
        &mut self,
        deadline: Instant,
        done: impl Fn(&SyncPhases, &SyncCollector) -> bool,
    ) -> anyhow::Result<Option<(Instant, SyncPhases)>> {
        loop {
            let Some((at, parsed)) = self.next_line(deadline).await? else {
                return Ok(None);
            };
            let first = parsed.message == FIRST_SYNC;
            let completed = self.collector.feed(&parsed).cloned();
            // The first-sync line follows the proxier's `synced` line of the same sync.
            if first && let Some(sync) = self.collector.completed.first().cloned() {
                if done(&sync, &self.collector) {
                    return Ok(Some((at, sync)));
                }
            } else if let Some(sync) = completed
                && done(&sync, &self.collector)
            {
                return Ok(Some((at, sync)));
            }
        }
    }

    /// "peak (now)" resident set.
    fn rss_cell(&self) -> String {
        match (sys::vm_hwm_kib(self.pid), sys::vm_rss_kib(self.pid)) {
            (Some(peak), Some(now)) => format!("{} ({} now)", mib(peak), mib(now)),
            (Some(peak), None) => mib(peak),
            _ => "-".to_owned(),
        }
    }

    fn cpu(&self) -> Option<(u64, u64)> {
        sys::cpu_ticks(self.pid)
    }
}

/// The most services whose rules are listed back to count them: `nft list table` took 41 s
/// at 10k×10 and had not finished after 5 minutes of CPU at 50k×10 (2026-11-28).
const LIST_LARGEST: usize = 20_000;

/// `iptables-save` in the namespace: (lines, `-A` rules, how long it took).
/// With `nft`: `nft list table ip kube-proxy` (lines, rule lines).
fn count_rules(netns: &Netns, save: &str) -> anyhow::Result<(usize, usize, Duration)> {
    let start = Instant::now();
    if save == "nft" {
        let text = netns.output("nft", &["list", "table", "ip", "kube-proxy"])?;
        let took = start.elapsed();
        let lines = text.lines().count();
        let rules = text
            .lines()
            .map(str::trim)
            .filter(|l| {
                !l.is_empty()
                    && *l != "}"
                    && ![
                        "table ",
                        "chain ",
                        "map ",
                        "set ",
                        "type ",
                        "flags ",
                        "elements ",
                    ]
                    .iter()
                    .any(|p| l.starts_with(p))
                    && !l.ends_with(',')
                    && !l.starts_with(|c: char| c.is_ascii_digit())
            })
            .count();
        return Ok((lines, rules, took));
    }
    if save == "ipvsadm" {
        // Virtual servers and real servers.
        let text = netns.output("ipvsadm", &["-Ln"])?;
        let took = start.elapsed();
        let rules = text
            .lines()
            .filter(|l| {
                l.starts_with("TCP")
                    || l.starts_with("UDP")
                    || (l.trim_start().starts_with("-> ") && !l.contains("RemoteAddress"))
            })
            .count();
        return Ok((text.lines().count(), rules, took));
    }
    let text = netns.output(save, &[])?;
    let took = start.elapsed();
    let lines = text.lines().count();
    let rules = text.lines().filter(|l| l.starts_with("-A ")).count();
    Ok((lines, rules, took))
}

fn phases_cell(sync: &SyncPhases) -> String {
    let total = Figure::from_option(sync.total());
    let mut parts = Vec::new();
    if let Some(render) = sync.render() {
        parts.push(format!("render {}", human(render)));
    }
    if let Some(restore) = sync.restore() {
        parts.push(format!("restore {}", human(restore)));
    }
    if let Some(conntrack) = sync.conntrack {
        parts.push(format!("conntrack {}", human(conntrack)));
    }
    if parts.is_empty() {
        total.to_string()
    } else {
        format!("{total} ({})", parts.join(", "))
    }
}

/// The run's tables: the sync figures, and with `--checks` the self-healing checks'.
async fn proxy_run(
    args: &Args,
    scale: Scale,
    dir: &Path,
    manifests_dir: &Path,
    manifests: &Manifests,
) -> anyhow::Result<Vec<Table>> {
    let mut table = Table::new(&[
        "N×M",
        "mode / iptables",
        "rules written (backend)",
        "iptables-save lines (v4; nftables: `nft list table` lines)",
        "first sync (log `took`)",
        "start → first sync (wall)",
        "first sync: render / restore (nftables: - / `nft -f`)",
        "partial, TCP NodePort svc",
        "partial, UDP svc",
        "edit → synced (wall, from the rename or the API server's change)",
        "peak RSS (VmHWM; VmRSS at end)",
        "CPU proxy / its children",
        "load 1m (start→end)",
    ]);
    let load_start = sys::load();
    let netns = Netns::create("kpbench-", "node")?;
    let (api, source_arg) = match args.source {
        Source::Manifests => (None, format!("--manifests={}", manifests_dir.display())),
        Source::Api => {
            let api = start_api(args, manifests, &netns)?;
            let url = format!("--master={}", api.url());
            (Some(api), url)
        }
    };
    let save_tool = match args.iptables {
        Variant::System | Variant::Nft => "iptables-nft-save",
        Variant::Legacy => "iptables-legacy-save",
    };
    let label = format!(
        "{} / {}{}",
        match args.mode {
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
            Mode::NftablesMaps => "nftables (maps layout)",
            Mode::Fake => "fake",
            Mode::Ipvs => "ipvs",
        },
        match (args.mode, args.iptables) {
            (Mode::Fake, _) => "-",
            (Mode::Ipvs, _) => "IPVS netlink + ipset",
            (Mode::Nftables | Mode::NftablesMaps, _) => "nft",
            (_, Variant::System) => "nf_tables (detected)",
            (_, Variant::Legacy) => "legacy (--iptables-backend)",
            (_, Variant::Nft) => "nf_tables (--iptables-backend)",
        },
        match (args.source, args.write) {
            (Source::Manifests, Write::Rename) => "",
            (Source::Manifests, Write::InPlace) => ", in-place write",
            (Source::Api, _) => ", API server",
        }
    );
    let log = dir.join(format!(
        "proxy-{}x{}-{}.log",
        scale.services,
        scale.endpoints,
        label.replace([' ', '/', '(', ')', ','], "")
    ));
    let mut proxy = Proxy::spawn(&netns, args, &source_arg, &log)?;
    eprintln!(
        "kp-scale: proxy pid {} in netns {}, log {}",
        proxy.pid,
        netns.name(),
        log.display()
    );
    let limit = Duration::from_secs(args.timeout);
    let first = proxy
        .wait_sync(proxy.started + limit, |_, c| c.first_sync.is_some())
        .await?;
    let ticks = sys::ticks_per_second().max(1);
    let cpu_cell = |cpu: Option<(u64, u64)>| {
        cpu.map_or("-".to_owned(), |(own, children)| {
            format!(
                "{:.1} s / {:.1} s",
                own as f64 / ticks as f64,
                children as f64 / ticks as f64
            )
        })
    };
    let scale_cell = format!(
        "{}×{}{}",
        scale.services,
        scale.endpoints,
        match args.layout {
            Layout::Files => "",
            Layout::Single => " (one file)",
        }
    );

    let Some((first_at, first_sync)) = first else {
        let progress = proxy.collector.in_progress().clone();
        let render = progress.render().map_or("-".to_owned(), human);
        let rss = proxy.rss_cell();
        let cpu = cpu_cell(proxy.cpu());
        let dnf = Figure::DidNotFinish(limit).to_string();
        table.row(vec![
            scale_cell,
            label,
            progress
                .families
                .first()
                .and_then(|f| f.rules_written)
                .map_or("-".to_owned(), |r| format!("{r} (rendered)")),
            "-".to_owned(),
            dnf.clone(),
            dnf.clone(),
            format!("render {render} / restore {dnf}"),
            "-".to_owned(),
            "-".to_owned(),
            "-".to_owned(),
            rss,
            cpu,
            format!("{load_start}→{}", sys::load()),
        ]);
        drop(proxy);
        return Ok(vec![table]);
    };
    let first_wall = first_at - proxy.started;
    if let Some(api) = &api {
        // Whether the lists waited on the fake server rather than on the proxy.
        eprintln!(
            "kp-scale: CPU at the first sync: proxy {}, fake API server {} (taking in the objects included)",
            proxy.cpu().map_or("-".to_owned(), |(own, _)| seconds(own)),
            api_cpu(api),
        );
    }
    let (took, _) = proxy.collector.first_sync.unwrap_or_default();
    eprintln!(
        "kp-scale: first sync took {} (wall {}); {:?}",
        Figure::from_option(took),
        human(first_wall),
        first_sync
    );
    let saved = match args.mode {
        _ if scale.services > LIST_LARGEST => None,
        Mode::Iptables => Some(count_rules(&netns, save_tool)?),
        Mode::Nftables | Mode::NftablesMaps => Some(count_rules(&netns, "nft")?),
        Mode::Ipvs => Some(count_rules(&netns, "ipvsadm")?),
        Mode::Fake => None,
    };

    // Edit one TCP NodePort service, then one UDP service (conntrack cleanup), one at a time.
    let mut edits: Vec<Edit> = Vec::new();
    let mut partials: Vec<Option<(Duration, SyncPhases)>> = Vec::new();
    for service in [0, 9] {
        if service >= scale.services {
            partials.push(None);
            continue;
        }
        edits.push(Edit::replace(service, 1));
        let before = proxy.collector.completed.len();
        if !send_edit(args, scale, manifests_dir, api.as_ref(), &edits)? {
            continue;
        }
        let edited = Instant::now();
        let deadline = edited + limit.min(Duration::from_secs(120));
        let synced = proxy
            .wait_sync(deadline, |s, c| {
                c.completed.len() > before && s.changed.unwrap_or(0) > 0
            })
            .await?;
        match synced {
            Some((at, sync)) => {
                eprintln!("kp-scale: edit of service {service} synced: {sync:?}");
                partials.push(Some((at - edited, sync)));
            }
            None => {
                eprintln!("kp-scale: edit of service {service}: no sync within the limit");
                partials.push(None);
            }
        }
    }
    let changes = if args.changes.is_empty() {
        None
    } else {
        let cells = (scale_cell.as_str(), label.as_str());
        let series = ChangeSeries {
            args,
            scale,
            manifests_dir,
            api: api.as_ref(),
            limit,
        };
        Some(series.run(&mut proxy, &mut edits, cells).await?)
    };
    // Taken before the listing and the checks' wait, so the sync table reads the same
    // with either.
    let rss = proxy.rss_cell();
    let cpu = proxy.cpu();
    let listing = if args.list_ruleset {
        let bounds = (limit, args.list_max_mib * 1024);
        Some(listing_table(&scale_cell, &label, &netns, bounds).await?)
    } else {
        None
    };
    let checks = if args.checks {
        let load_start = sys::load();
        let deadline = Instant::now() + Duration::from_secs(args.checks_wait);
        let came = proxy.wait_thorough_check(deadline).await?;
        Some(checks_table(
            &scale_cell,
            &label,
            &proxy.checks,
            came,
            args,
            &load_start,
        ))
    } else {
        None
    };
    drop(proxy);
    drop(api);

    let partial_cell = |p: &Option<(Duration, SyncPhases)>| match p {
        Some((_, sync)) => format!("{} {}", sync.kind, phases_cell(sync)),
        None => "-".to_owned(),
    };
    let walls: Vec<String> = partials
        .iter()
        .flatten()
        .map(|(wall, _)| human(*wall))
        .collect();
    table.row(vec![
        scale_cell,
        label,
        first_sync.rules.map_or("-".to_owned(), |r| r.to_string()),
        saved.map_or("-".to_owned(), |(lines, rules, took)| {
            format!("{lines} ({rules} -A; save {})", human(took))
        }),
        Figure::from_option(took).to_string(),
        human(first_wall),
        match (first_sync.render(), first_sync.restore()) {
            (None, None) => "-".to_owned(),
            (render, restore) => format!(
                "{} / {}",
                Figure::from_option(render),
                Figure::from_option(restore)
            ),
        },
        partial_cell(&partials[0]),
        partials.get(1).map_or("-".to_owned(), partial_cell),
        if walls.is_empty() {
            "-".to_owned()
        } else {
            walls.join(", ")
        },
        rss,
        cpu_cell(cpu),
        format!("{load_start}→{}", sys::load()),
    ]);
    Ok([Some(table), changes, listing, checks]
        .into_iter()
        .flatten()
        .collect())
}

/// Sends the last of `edits` to the proxy: the rewritten manifests file (with every edit
/// so far), or what the API server's watch sends for that change (the changed objects, or
/// their deletion). `false` when there is no file to rewrite.
fn send_edit(
    args: &Args,
    scale: Scale,
    manifests_dir: &Path,
    api: Option<&FakeApiProcess>,
    edits: &[Edit],
) -> anyhow::Result<bool> {
    let Some(edit) = edits.last() else {
        return Ok(false);
    };
    let Some(api) = api else {
        let Some((name, text)) = edited_layout(args.layout, scale, edits) else {
            return Ok(false);
        };
        match args.write {
            Write::Rename => replace_file(manifests_dir, &name, &text)?,
            Write::InPlace => rewrite_in_place(manifests_dir, &name, &text)?,
        }
        return Ok(true);
    };
    let index = edit.service;
    if edit.change == Change::ServiceRemoved {
        let ns = generate::namespace(index);
        api.delete(
            "Service",
            &format!("{ns}/{}", generate::service_name(index)),
        )?;
        api.delete(
            "EndpointSlice",
            &format!("{ns}/{}", generate::slice_name(index)),
        )?;
        return Ok(true);
    }
    let (service, slice) = generate::objects_yaml(scale, index, edits);
    let slice_only = matches!(
        edit.change,
        Change::EndpointReplaced
            | Change::EndpointAdded
            | Change::EndpointRemoved
            | Change::NotReady
            | Change::Terminating
    );
    let service_only =
        !slice_only && !matches!(edit.change, Change::ServiceAdded | Change::PortAdded);
    let mut yaml = String::new();
    if !slice_only {
        yaml.push_str(&service);
    }
    if !service_only {
        yaml.push_str(&slice);
    }
    for obj in yaml_objects(&yaml).map_err(anyhow::Error::msg)? {
        api.apply(obj)?;
    }
    Ok(true)
}

/// `--changes`: one edit of each kind, each waited for, and their partial syncs' table.
struct ChangeSeries<'a> {
    args: &'a Args,
    scale: Scale,
    manifests_dir: &'a Path,
    api: Option<&'a FakeApiProcess>,
    limit: Duration,
}

impl ChangeSeries<'_> {
    async fn run(
        &self,
        proxy: &mut Proxy,
        edits: &mut Vec<Edit>,
        (scale_cell, label): (&str, &str),
    ) -> anyhow::Result<Table> {
        let mut table = Table::new(&[
            "N×M",
            "mode / iptables",
            "change",
            "service",
            "sync (log `took`)",
            "rules written",
            "edit → synced (wall)",
            "load 1m",
        ]);
        for &change in &self.args.changes {
            let Some(edit) = generate::next_edit(self.scale, change, edits) else {
                eprintln!("kp-scale: no service fits {change:?} at this scale");
                continue;
            };
            edits.push(edit);
            let edited = Instant::now();
            if !send_edit(self.args, self.scale, self.manifests_dir, self.api, edits)? {
                continue;
            }
            let syncs = self.syncs_of(proxy, edited).await?;
            for (_, sync) in &syncs {
                eprintln!("kp-scale: {change:?} of service {}: {sync:?}", edit.service);
            }
            let (sync, written, wall) = change_cells(&syncs, edited, self.limit);
            table.row(vec![
                scale_cell.to_owned(),
                label.to_owned(),
                format!("{change:?}"),
                edit.service.to_string(),
                sync,
                written,
                wall,
                sys::load(),
            ]);
        }
        Ok(table)
    }

    /// The syncs an edit sent at `edited` caused: the first that changed a service, and any
    /// that follow within [`SETTLE`] (the API server's watches send a Service and its slice
    /// as two events, which may be two syncs).
    async fn syncs_of(
        &self,
        proxy: &mut Proxy,
        edited: Instant,
    ) -> anyhow::Result<Vec<(Instant, SyncPhases)>> {
        let mut deadline = edited + self.limit.min(Duration::from_secs(120));
        let mut syncs = Vec::new();
        loop {
            let before = proxy.collector.completed.len();
            let synced = proxy
                .wait_sync(deadline, |s, c| {
                    c.completed.len() > before && s.changed.unwrap_or(0) > 0
                })
                .await?;
            let Some((at, sync)) = synced else {
                return Ok(syncs);
            };
            syncs.push((at, sync));
            deadline = Instant::now() + SETTLE;
        }
    }
}

/// How long `--changes` waits for more syncs after an edit's first one.
const SETTLE: Duration = Duration::from_millis(300);

/// The sync, rules-written and wall cells of one change's `syncs` (` + ` between several).
fn change_cells(
    syncs: &[(Instant, SyncPhases)],
    edited: Instant,
    limit: Duration,
) -> (String, String, String) {
    let Some((last, _)) = syncs.last() else {
        let dnf = Figure::DidNotFinish(limit).to_string();
        return (dnf.clone(), "-".to_owned(), dnf);
    };
    let joined = |cell: &dyn Fn(&SyncPhases) -> String| {
        syncs
            .iter()
            .map(|(_, s)| cell(s))
            .collect::<Vec<_>>()
            .join(" + ")
    };
    (
        joined(&|s| format!("{} {}", s.kind, phases_cell(s))),
        joined(&|s| s.rules.map_or("-".to_owned(), |r| r.to_string())),
        human(*last - edited),
    )
}

/// The self-healing checks the proxy logged since its start: the canary checks (every canary
/// period; none where nf_tables notifications stand in for them) and the thorough check
/// waited for (`came`: it was logged in time).
fn checks_table(
    scale: &str,
    label: &str,
    checks: &Checks,
    came: bool,
    args: &Args,
    load_start: &str,
) -> Table {
    let mut table = Table::new(&[
        "N×M",
        "mode / iptables",
        "canary check (median; n, max)",
        "thorough check (before a periodic sync)",
        "load 1m (start→end)",
    ]);
    let canary = match (median(&checks.canary), checks.canary.iter().max()) {
        (Some(median), Some(max)) => format!(
            "{} (n {}, max {})",
            human(median),
            checks.canary.len(),
            human(*max)
        ),
        _ => "- (none logged)".to_owned(),
    };
    let thorough = match checks.thorough.last() {
        Some(took) if came => human(*took),
        _ => format!("- (none within {} s)", args.checks_wait),
    };
    table.row(vec![
        scale.to_owned(),
        label.to_owned(),
        canary,
        thorough,
        format!("{load_start}→{}", sys::load()),
    ]);
    table
}

/// How a `--list-ruleset` listing ended early.
enum Cut {
    /// Still running at the time limit.
    Time,
    /// Its RSS passed the cap.
    Memory,
}

/// `--list-ruleset`: `nft list ruleset` in `netns`, its output counted as it streams (bytes,
/// lines) and `nft`'s `VmHWM` sampled every 50 ms; killed after `limit` or once that passes
/// `max_kib`.
async fn listing_table(
    scale: &str,
    label: &str,
    netns: &Netns,
    (limit, max_kib): (Duration, u64),
) -> anyhow::Result<Table> {
    use tokio::io::AsyncReadExt as _;

    let load_start = sys::load();
    let mut child = netns
        .command("nft", &["list", "ruleset"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting nft list ruleset")?;
    let pid = child.id().unwrap_or_default();
    let mut stdout = child.stdout.take().context("nft's stdout")?;
    let started = Instant::now();
    let (mut bytes, mut lines, mut peak_kib) = (0u64, 0u64, 0u64);
    let mut buf = vec![0u8; 1 << 16];
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let deadline = tokio::time::sleep(limit);
    tokio::pin!(deadline);
    let cut = loop {
        tokio::select! {
            read = stdout.read(&mut buf) => match read.context("reading nft's output")? {
                0 => break None,
                n => {
                    bytes += n as u64;
                    lines += buf[..n].iter().filter(|b| **b == b'\n').count() as u64;
                }
            },
            _ = tick.tick() => {
                peak_kib = peak_kib.max(sys::vm_hwm_kib(pid).unwrap_or(0));
                if peak_kib > max_kib {
                    break Some(Cut::Memory);
                }
            }
            () = &mut deadline => break Some(Cut::Time),
        }
    };
    let took = started.elapsed();
    if cut.is_some() {
        let _ = child.kill().await;
    }
    let mut table = Table::new(&[
        "N×M",
        "mode / iptables",
        "nft list ruleset (wall)",
        "output",
        "lines",
        "nft peak RSS (VmHWM, sampled)",
        "load 1m (start→end)",
    ]);
    let wall = match cut {
        None => match child.wait().await {
            Ok(s) if s.success() => human(took),
            Ok(s) => format!("failed ({s}) after {}", human(took)),
            Err(err) => format!("lost ({err}) after {}", human(took)),
        },
        Some(Cut::Time) => Figure::DidNotFinish(limit).to_string(),
        Some(Cut::Memory) => format!("killed at {} RSS after {}", mib(max_kib), human(took)),
    };
    table.row(vec![
        scale.to_owned(),
        label.to_owned(),
        wall,
        format!("{:.1} MiB ({bytes} bytes)", bytes as f64 / 1048576.0),
        lines.to_string(),
        if peak_kib == 0 {
            "-".to_owned()
        } else {
            mib(peak_kib)
        },
        format!("{load_start}→{}", sys::load()),
    ]);
    Ok(table)
}

/// Where the fake API server listens inside the proxy's namespace.
const API_ADDRESS: &str = "127.0.0.1:6443";

/// How long the fake API server may take to take in every generated object.
const API_LOAD_WAIT: Duration = Duration::from_secs(600);

/// The fake API server in `netns` holding every generated object, the Node last; returns
/// once it has applied them all, so the proxy's first list sees the whole cluster.
fn start_api(args: &Args, manifests: &Manifests, netns: &Netns) -> anyhow::Result<FakeApiProcess> {
    let echo = match &args.echo {
        Some(path) => path.clone(),
        None => kp_testbed::echo_binary().context("the kp-echo binary")?,
    };
    let listen = API_ADDRESS.parse().context("API address")?;
    let api = FakeApiProcess::start(&echo, netns.name(), listen)?;
    let started = Instant::now();
    let (nodes, services): (Vec<_>, Vec<_>) = manifests
        .files
        .iter()
        .partition(|(name, _)| name == "node.yaml");
    for (name, text) in services.iter().chain(&nodes) {
        api.apply_yaml(text)
            .with_context(|| format!("loading {name} into the fake API server"))?;
    }
    api.sync(API_LOAD_WAIT)
        .context("waiting for the fake API server to apply the objects")?;
    eprintln!(
        "kp-scale: fake API server at {} holds the objects (loaded in {}, its CPU {}); load {}",
        api.url(),
        human(started.elapsed()),
        api_cpu(&api),
        sys::load()
    );
    Ok(api)
}

/// CPU `ticks` in seconds.
fn seconds(ticks: u64) -> String {
    format!(
        "{:.1} s",
        ticks as f64 / sys::ticks_per_second().max(1) as f64
    )
}

/// The fake API server's own CPU time so far.
fn api_cpu(api: &FakeApiProcess) -> String {
    api.pid()
        .and_then(sys::cpu_ticks)
        .map_or("-".to_owned(), |(own, _)| seconds(own))
}

/// One restore tool run on `input`, with a limit; `None` if it did not finish.
async fn restore_once(
    netns: &Netns,
    tool: &str,
    input: &Path,
    limit: Duration,
) -> anyhow::Result<Option<Duration>> {
    let stdin = File::open(input)?;
    let mut child = netns
        .command(tool, &["--noflush"])
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {tool}"))?;
    let start = Instant::now();
    let mut stderr = child.stderr.take();
    let status = tokio::time::timeout(limit, child.wait()).await;
    let took = start.elapsed();
    match status {
        Ok(status) => {
            let status = status?;
            if !status.success() {
                let mut message = String::new();
                if let Some(stderr) = stderr.as_mut() {
                    let _ = tokio::io::AsyncReadExt::read_to_string(stderr, &mut message).await;
                }
                bail!("{tool} failed ({status}): {}", message.trim());
            }
            Ok(Some(took))
        }
        Err(_) => {
            // `ip netns exec` exec'd the tool: this pid is the restore itself.
            let _ = child.start_kill();
            let _ = child.wait().await;
            Ok(None)
        }
    }
}

async fn restore_runs(
    args: &Args,
    scale: Scale,
    manifests: &Manifests,
    dir: &Path,
) -> anyhow::Result<Table> {
    let mut table = Table::new(&[
        "N×M",
        "restore tool",
        "transactions",
        "input lines",
        "in-process render (full / one-service partial)",
        "full restore total",
        "slowest transaction",
        "then one-service partial restore",
        "load 1m (start→end)",
    ]);
    let start = Instant::now();
    let mut loaded = Loaded::new(manifests)?;
    eprintln!(
        "kp-scale: parsed and tracked {} service ports, {} endpoints in {}",
        loaded.state.services.len(),
        loaded.endpoints(),
        human(start.elapsed())
    );
    let config = RenderConfig::default();
    let no_services = BTreeSet::new();
    let no_chains = BTreeSet::new();
    let start = Instant::now();
    let full = render(
        &loaded.state,
        IpFamily::V4,
        &config,
        &SyncScope {
            kind: SyncKind::Full,
            changed: &no_services,
            existing_chains: &no_chains,
        },
    )?;
    let full_render = start.elapsed();
    let (name, text) =
        generate::edited_file(scale, &[Edit::replace(0, 1)]).context("no service to edit")?;
    let changed = loaded.update(&name, &text)?;
    let start = Instant::now();
    let partial = render(
        &loaded.state,
        IpFamily::V4,
        &config,
        &SyncScope {
            kind: SyncKind::Partial,
            changed: &changed,
            existing_chains: &full.chains,
        },
    )?;
    let partial_render = start.elapsed();
    let render_cell = format!("{} / {}", human(full_render), human(partial_render));
    let full_path = dir.join("full.rules");
    let partial_path = dir.join("partial.rules");
    std::fs::write(&full_path, &full.text)?;
    std::fs::write(&partial_path, &partial.text)?;
    let lines = full.text.lines().count();
    eprintln!(
        "kp-scale: rendered {lines} lines ({} -A) in {}; partial ({} changed) {} lines in {}",
        full.rules_written,
        human(full_render),
        changed.len(),
        partial.text.lines().count(),
        human(partial_render)
    );
    let limit = Duration::from_secs(args.timeout);
    for tool in &args.tools {
        let program = match tool {
            Tool::Nft => "iptables-restore",
            Tool::Legacy => "iptables-legacy-restore",
        };
        for &parts in &args.split {
            let load_start = sys::load();
            let texts = split_restore(&full.text, parts);
            let mut paths = Vec::new();
            for (i, text) in texts.iter().enumerate() {
                let path = dir.join(format!("full-{parts}-{i}.rules"));
                std::fs::write(&path, text)?;
                paths.push(path);
            }
            let netns = Netns::create("kpbench-", "restore")?;
            let mut times = Vec::new();
            let mut finished = true;
            let began = Instant::now();
            for path in &paths {
                let left = limit.saturating_sub(began.elapsed());
                match restore_once(&netns, program, path, left).await? {
                    Some(took) => times.push(took),
                    None => {
                        finished = false;
                        break;
                    }
                }
            }
            let (total, slowest, partial_cell) = if finished {
                let total: Duration = times.iter().sum();
                let slowest = times.iter().max().copied().unwrap_or_default();
                let partial = restore_once(&netns, program, &partial_path, limit).await?;
                (
                    human(total),
                    human(slowest),
                    partial.map_or(Figure::DidNotFinish(limit).to_string(), human),
                )
            } else {
                (
                    format!(
                        "{} ({} of {} done)",
                        Figure::DidNotFinish(limit),
                        times.len(),
                        paths.len()
                    ),
                    "-".to_owned(),
                    "-".to_owned(),
                )
            };
            drop(netns);
            let row = vec![
                format!("{}×{}", scale.services, scale.endpoints),
                program.to_owned(),
                format!("{}", texts.len()),
                lines.to_string(),
                render_cell.clone(),
                total,
                slowest,
                partial_cell,
                format!("{load_start}→{}", sys::load()),
            ];
            eprintln!("kp-scale: {}", row.join(" | "));
            table.row(row);
        }
    }
    Ok(table)
}
