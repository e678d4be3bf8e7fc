//! `kube-proxy`: the binary. Parses upstream's flags and config file, sets up klog-style
//! logging, picks the proxy mode and hands over to [`app::run`]. `anyhow` lives only here.

mod app;
mod cleanup;
mod debug_explain;
mod demo;
mod dryrun;
mod explain;
mod iptables_backend;
mod ipvs_mode;
mod log;
mod modes;
mod node_ips;
mod userspace;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use kp_config::{Options, ProxyMode};

fn main() -> ExitCode {
    // Subcommands come first; everything else is upstream's flag-only command line.
    match std::env::args().nth(1).as_deref() {
        Some("explain") => return explain::main(std::env::args().skip(1)),
        Some("demo") => return demo::main(std::env::args().skip(1)),
        Some(demo::ECHO_SUBCOMMAND) => return kp_testbed::tool::main(std::env::args_os().skip(1)),
        _ => {}
    }
    let options = Options::parse();
    match run(options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Logging may not be set up yet (bad flags), so errors go straight to stderr too.
            tracing::error!("{error:#}");
            if !tracing::dispatcher::has_been_set() {
                eprintln!("kube-proxy: {error:#}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run(options: Options) -> anyhow::Result<()> {
    // Configuration first: every invalid value is reported before anything touches the node.
    let loaded = options.load().context("invalid configuration")?;
    let config = loaded.config;
    log::init(i32::try_from(config.logging.verbosity).unwrap_or(i32::MAX));
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    tracing::info!(version = kp_config::VERSION, "Starting kube-proxy");

    if let Some(path) = &options.write_config_to {
        kp_config::write_config(path, &config)
            .with_context(|| format!("writing {}", path.display()))?;
        tracing::info!(path = %path.display(), "Wrote configuration");
        return Ok(());
    }

    let mode = config.mode();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kube-proxy")
        .build()
        .context("starting the async runtime")?;
    let mut registry = prometheus_client::registry::Registry::default();
    // As upstream, `--cleanup` removes every kernel mode's state whatever mode is set.
    let kernel_mode = !matches!(mode, ProxyMode::Fake | ProxyMode::Winuserspace);
    if kernel_mode {
        // Once, before any iptables tool runs: every mode runs some (nftables mode removes
        // iptables mode's leftovers), and all of them must use the node's backend.
        iptables_backend::select(&runtime, options.iptables_backend, config.iptables_backend)?;
    }
    if options.cleanup && kernel_mode {
        let settings = app::Settings::for_cleanup(&options, config);
        let backend = cleanup::build(settings.config(), settings.node(), &mut registry)?;
        return run_kernel_mode(&runtime, settings, backend, registry, true);
    }
    if options.init_only {
        // Before the node's IPs are read: the set-up needs no API server, and what it decides
        // (route_localnet for localhost NodePorts) follows the nodePortAddresses setting.
        let fallback = kp_core::model::NodeIps::detect(&[], config.bind_address());
        let node_ports =
            node_ips::node_port_addresses(&config, &fallback, &modes::local_addresses());
        modes::init_only(&config, node_ports).context("--init-only")?;
        tracing::info!("System initialized and --init-only specified");
        return Ok(());
    }
    if mode == ProxyMode::Winuserspace {
        anyhow::bail!(userspace::WINUSERSPACE_ON_LINUX);
    }
    // As upstream, the node's IPs are read once, before any rule is built; the backend's
    // rules and the health-check servers use the same answer.
    let source = node_ips::SourceSpec {
        manifests: options.manifests.as_ref(),
        master: options.master.as_deref(),
    };
    let detected = runtime
        .block_on(node_ips::detect(&source, &config, &app::node_name(&config)))
        .context("reading this node's IPs")?;
    for warning in node_ips::config_warnings(&config, &detected.ips) {
        tracing::error!(error = %warning, "Kube-proxy configuration may be incomplete or incorrect");
    }
    let settings = app::Settings::new(&options, config, &detected);
    let node = settings.node().clone();
    modes::apply_oom_score_adj(settings.config());
    match mode {
        ProxyMode::Fake => {
            tracing::info!("Using the fake proxier: nothing is programmed, every sync is logged");
            runtime.block_on(app::run(
                settings,
                dryrun::DryRun,
                registry,
                options.cleanup,
            ))
        }
        // `--cleanup` of the kernel modes returned above: these arms only run them.
        ProxyMode::Iptables | ProxyMode::Ipvs => {
            if matches!(mode, ProxyMode::Ipvs) {
                match ipvs_mode::build(settings.config(), &node, false)? {
                    Ok(backend) => {
                        let backend =
                            modes::RemovesNftablesLeftovers::new(backend, settings.config())?;
                        return run_kernel_mode(&runtime, settings, backend, registry, false);
                    }
                    Err(why) => {
                        // Upstream's wording; older upstream releases fell back the same way.
                        tracing::error!(error = %why, "Can't use the IPVS proxier");
                        tracing::info!("Falling back to the iptables proxier");
                    }
                }
            }
            let backend = modes::iptables(settings.config(), &node, &mut registry, false)?;
            let backend = modes::RemovesNftablesLeftovers::new(backend, settings.config())?;
            run_kernel_mode(&runtime, settings, backend, registry, false)
        }
        ProxyMode::Nftables => {
            let backend = modes::nftables(settings.config(), &node, &mut registry, false)?;
            run_kernel_mode(&runtime, settings, backend, registry, false)
        }
        ProxyMode::Userspace => {
            let backend = userspace::backend(settings.config(), &node, &mut registry);
            let settings = settings.with_affinity(backend.relay().affinity().clone());
            runtime.block_on(app::run(settings, backend, registry, false))
        }
        ProxyMode::Winuserspace => anyhow::bail!(userspace::WINUSERSPACE_ON_LINUX),
        other => anyhow::bail!(
            "proxy mode {:?} is not available in this build of kube-proxy-rs yet (available: iptables, nftables, ipvs, userspace, fake)",
            other.as_str()
        ),
    }
}

/// Runs a kernel mode until SIGTERM (or its `--cleanup`). After a cleanup (successful or not:
/// everything is attempted, as upstream) it restores the kernel settings the proxy changed;
/// the first error wins.
fn run_kernel_mode<B: kp_core::backend::Backend + 'static>(
    runtime: &tokio::runtime::Runtime,
    settings: app::Settings,
    backend: B,
    registry: prometheus_client::registry::Registry,
    cleanup: bool,
) -> anyhow::Result<()> {
    let result = runtime.block_on(app::run(settings, backend, registry, cleanup));
    if !cleanup {
        return result;
    }
    let restored = modes::restore_sysctls();
    if let (Err(error), Err(_)) = (&restored, &result) {
        tracing::error!("{error:#}");
    }
    result.and(restored)
}
