//! `kube-proxy`: the binary. Parses upstream's flags and config file, sets up klog-style
//! logging, picks the proxy mode and hands over to [`app::run`]. `anyhow` lives only here.

mod app;
#[cfg(target_os = "linux")]
mod cleanup;
#[cfg(target_os = "linux")]
mod debug_explain;
#[cfg(feature = "demo")]
mod demo;
#[cfg(target_os = "linux")]
mod explain;
#[cfg(target_os = "linux")]
mod iptables_backend;
mod log;
#[cfg(target_os = "linux")]
mod modes;
mod node_ips;
#[cfg(target_os = "linux")]
mod notices;
#[cfg(not(target_os = "linux"))]
mod win;
mod zpages;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use kp_config::{KubeProxyConfiguration, Options};

/// The hidden subcommand under which this binary serves as the testbed's echo server and
/// prober for the demo (`kube-proxy testbed-echo serve --name web-a --tcp 8080`).
const ECHO_SUBCOMMAND: &str = "testbed-echo";

/// What a build without the `demo` feature (the default, the container image's) says to
/// `kube-proxy demo`.
const NO_DEMO: &str = "kube-proxy: this build has no demo (the `demo` cargo feature is off by default, and the container image is built without it); build it from a checkout with `cargo run --release -p kube-proxy --features demo -- demo`";

/// What the first argument asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Command {
    /// `kube-proxy explain ...`.
    Explain,
    /// `kube-proxy demo ...`.
    Demo,
    /// `kube-proxy testbed-echo ...`, the demo's echo servers and probes.
    DemoEcho,
    /// Anything else: upstream's flag-only command line.
    Proxy,
}

impl Command {
    fn of(first: Option<&str>) -> Self {
        match first {
            Some("explain") => Self::Explain,
            Some("demo") => Self::Demo,
            Some(ECHO_SUBCOMMAND) => Self::DemoEcho,
            _ => Self::Proxy,
        }
    }
}

/// The demo's subcommands in a build with the demo.
#[cfg(feature = "demo")]
fn demo(command: Command) -> ExitCode {
    if command == Command::DemoEcho {
        return kp_testbed::tool::main(std::env::args_os().skip(1));
    }
    demo::main(std::env::args().skip(1))
}

/// The demo's subcommands in a build without it: a clear refusal.
#[cfg(not(feature = "demo"))]
fn demo(_command: Command) -> ExitCode {
    ExitCode::from(no_demo(&mut std::io::stderr()))
}

/// Says this build has no demo; returns the exit status.
#[cfg_attr(feature = "demo", allow(dead_code))]
fn no_demo(out: &mut impl std::io::Write) -> u8 {
    let _ = writeln!(out, "{NO_DEMO}");
    1
}

/// `kube-proxy explain ...`.
#[cfg(target_os = "linux")]
fn explain() -> ExitCode {
    explain::main(std::env::args().skip(1))
}

/// `explain` speaks of the Linux modes' rules: not on Windows.
#[cfg(not(target_os = "linux"))]
fn explain() -> ExitCode {
    eprintln!(
        "kube-proxy: `explain` describes the Linux proxy modes and is not available on Windows"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    // Subcommands come first; everything else is upstream's flag-only command line.
    match Command::of(std::env::args().nth(1).as_deref()) {
        Command::Explain => return explain(),
        command @ (Command::Demo | Command::DemoEcho) => return demo(command),
        Command::Proxy => {}
    }
    // Before any thread allocates: the proxier's syncs must not pay for earlier frees.
    let fastbins = kp_malloc::disable_fastbins(std::env::var("GLIBC_TUNABLES").ok().as_deref());
    let options = Options::parse();
    match run(options, fastbins) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Logging may not be set up yet (bad flags), so errors go straight to stderr too.
            let chain = kp_core::report::Chain(error.as_ref());
            tracing::error!("{chain}");
            if !tracing::dispatcher::has_been_set() {
                eprintln!("kube-proxy: {chain}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run(
    options: Options,
    fastbins: Result<kp_malloc::Fastbins, kp_malloc::MalloptFailed>,
) -> anyhow::Result<()> {
    // Configuration first: every invalid value is reported before anything touches the node.
    let loaded = options.load().context("invalid configuration")?;
    let config = loaded.config;
    log::init(i32::try_from(config.logging.verbosity).unwrap_or(i32::MAX));
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    match fastbins {
        Ok(fastbins) => tracing::debug!(?fastbins, "Allocator set up"),
        Err(error) => tracing::warn!(%error, "Syncs may pause to merge freed memory"),
    }
    tracing::info!(version = kp_config::VERSION, "Starting kube-proxy");

    if let Some(path) = &options.write_config_to {
        // The error names the file.
        kp_config::write_config(path, &config)?;
        tracing::info!(path = %path.display(), "Wrote configuration");
        return Ok(());
    }

    run_proxy(&options, config)
}

/// The proxy's async runtime.
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kube-proxy")
        .build()
        .context("starting the async runtime")
}

/// As upstream, the node's IPs are read once, before any rule is built; the backend's rules
/// and the health-check servers use the same answer. The source started to read them (the
/// manifests') goes on to feed the proxy; the registry holds its metrics.
fn read_node_ips(
    runtime: &tokio::runtime::Runtime,
    options: &Options,
    config: &KubeProxyConfiguration,
) -> anyhow::Result<(
    node_ips::Detected,
    Option<app::StartedSource>,
    prometheus_client::registry::Registry,
)> {
    let source = node_ips::SourceSpec {
        manifests: options.manifests.as_ref(),
        master: options.master.as_deref(),
    };
    let mut registry = prometheus_client::registry::Registry::default();
    let (detected, started) = runtime
        .block_on(node_ips::detect(
            &source,
            config,
            &app::node_name(config),
            &mut registry,
        ))
        .context("reading this node's IPs")?;
    for warning in node_ips::config_warnings(config, &detected.ips) {
        tracing::error!(error = %warning, "Kube-proxy configuration may be incomplete or incorrect");
    }
    Ok((detected, started, registry))
}

/// The proxy (or `--cleanup`, `--init-only`) on Linux.
#[cfg(target_os = "linux")]
fn run_proxy(options: &Options, config: KubeProxyConfiguration) -> anyhow::Result<()> {
    use kp_config::ProxyMode;
    use modes::host::{Host, SystemProbe, Task, Wants};
    let mode = config.mode();
    let runtime = runtime()?;
    // The node's facts, once, for what this start is for; the iptables backend is chosen
    // first, before any iptables tool runs (every kernel mode runs some: nftables mode
    // removes iptables mode's leftovers), so all of them use the node's backend.
    let probe = SystemProbe::new(options.iptables_backend, &config);
    let probe_host = |task| -> anyhow::Result<Host> {
        let wants = Wants::new(&config, task)?;
        runtime.block_on(Host::probe(&probe, &wants))
    };
    // As upstream, `--cleanup` removes every kernel mode's state whatever mode is set.
    if options.cleanup && mode != ProxyMode::Winuserspace {
        let host = probe_host(Task::Cleanup)?;
        return runtime.block_on(cleanup::run(&config, &host));
    }
    if options.init_only {
        // Before the node's IPs are read: the set-up needs no API server, and what it decides
        // (route_localnet for localhost NodePorts) follows the nodePortAddresses setting.
        let host = probe_host(Task::InitOnly)?;
        let fallback = kp_core::model::NodeIps::detect(&[], config.bind_address());
        let node_ports = node_ips::node_port_addresses(&config, &fallback, &host.local_addresses());
        modes::init_only(&config, node_ports, &host).context("--init-only")?;
        tracing::info!("System initialized and --init-only specified");
        return Ok(());
    }
    modes::check_runnable(mode)?;
    let host = probe_host(Task::Run)?;
    let mode = host.mode_to_run(mode);
    announce_start(&runtime, options, &config, mode);
    let (detected, started, registry) = read_node_ips(&runtime, options, &config)?;
    let families = host.families.clone();
    let settings = app::Settings::new(
        options,
        config,
        &detected,
        started,
        (&host.local_addresses(), families),
    );
    modes::apply_oom_score_adj(settings.config());
    modes::run(&runtime, mode, settings, &host, registry)
}

/// Logs what upstream tells the operator about the mode that runs and, with an API server,
/// posts it as Events on this node's Node (in the background: events never hold up the start).
#[cfg(target_os = "linux")]
fn announce_start(
    runtime: &tokio::runtime::Runtime,
    options: &Options,
    config: &KubeProxyConfiguration,
    running: kp_config::ProxyMode,
) {
    let notices = notices::start_notices(config, running);
    if notices.is_empty() {
        return;
    }
    let _entered = runtime.enter();
    let events = match options.manifests {
        Some(_) => None,
        None => match runtime.block_on(app::api_client(options.master.as_deref(), config)) {
            Ok(client) => Some(kp_sources::events::NodeEvents::new(
                client,
                &app::node_name(config),
                &notices::host_name(),
            )),
            Err(error) => {
                tracing::warn!(%error, "no API client for this node's events");
                None
            }
        },
    };
    notices::announce(&notices, events.as_ref());
}

/// The proxy (or `--cleanup`, `--init-only`) on Windows.
#[cfg(not(target_os = "linux"))]
fn run_proxy(options: &Options, config: KubeProxyConfiguration) -> anyhow::Result<()> {
    win::run(options, config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subcommands_come_first() {
        assert_eq!(Command::of(Some("explain")), Command::Explain);
        assert_eq!(Command::of(Some("demo")), Command::Demo);
        assert_eq!(Command::of(Some(ECHO_SUBCOMMAND)), Command::DemoEcho);
        assert_eq!(Command::of(Some("--proxy-mode=fake")), Command::Proxy);
        assert_eq!(Command::of(None), Command::Proxy);
    }

    #[test]
    fn a_build_without_the_demo_says_so() {
        let mut out = Vec::new();
        assert_eq!(no_demo(&mut out), 1);
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("this build has no demo"), "{text}");
        assert!(text.contains("`demo` cargo feature"), "{text}");
        assert!(
            text.contains("cargo run --release -p kube-proxy --features demo -- demo"),
            "{text}"
        );
    }
}
