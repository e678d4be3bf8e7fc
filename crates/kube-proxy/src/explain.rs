//! `kube-proxy explain DEST[:PORT][/PROTO] [--from SRC]`: why a packet to DEST goes where it
//! goes, from the same sources and configuration the proxy uses.
//!
//! The sources are read once (until Services and EndpointSlices, and the Node when the source
//! reports it, are listed, within `--timeout`), folded into a `ProxyState` with the proxy's
//! own change tracker, and handed to the pure [`kp_rules::explain::explain`]. With `--verify`
//! the kernel's rules (`iptables-save` / `ip6tables-save` in this network namespace) are
//! compared with what `kp_rules::iptables::render` would write for that state.
//!
//! Configuration: the proxy's own flags that affect the answer are accepted and turned into
//! [`kp_config::Options`], so `--config` precedence and validation are exactly the proxy's.
//!
//! Exit status: 0 when DEST is explained (also "not a service"), 1 on errors (sources,
//! configuration, kernel reads), 2 on usage errors (bad DEST or flags), 3 when `--verify`
//! found differences.

pub(crate) mod text;

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr as _;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Parser, ValueEnum};
use kp_config::{IptablesBackend, KubeProxyConfiguration, Options, ProxyMode, parse_go_bool};
use kp_core::backend::SyncKind;
use kp_core::event::SourceEvent;
use kp_core::tracker::{ChangeTracker, ObjectKind, ProxyState};
use kp_rules::explain::verify::{RuleSet, VerifyReport, verify};
use kp_rules::explain::{Destination, Explanation, Query, explain};
use kp_rules::iptables::{RenderConfig, SyncScope, render};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Exit status when `--verify` finds differences (distinct from errors).
const EXIT_DIFFERENCES: u8 = 3;
/// How long to wait for the Node after Services and EndpointSlices are listed: the Node only
/// adds addresses and labels, so a slow or absent one must not hold up the answer.
const NODE_GRACE: Duration = Duration::from_secs(2);
/// Source events buffered while listing.
const EVENT_QUEUE: usize = 4096;

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Format {
    /// A readable tree.
    Text,
    /// The explanation (and verify report) as JSON.
    Json,
}

/// Why a packet to DEST goes where it goes on this node.
#[derive(Debug, Parser)]
#[command(
    name = "kube-proxy explain",
    bin_name = "kube-proxy explain",
    about = "Explain how kube-proxy handles traffic to DEST on this node: the service ports it \
             hits, each endpoint's verdict, masquerading, affinity and the configured mode's objects.",
    after_help = "Exit status: 0 explained (also when DEST is no service), 1 error, 2 usage \
                  error, 3 --verify found differences."
)]
struct Args {
    /// Destination: IP, IP:PORT or [IPv6]:PORT, optionally /tcp, /udp or /sctp (TCP by
    /// default). Without a port, every port of the protocol is explained.
    #[allow(
        rustdoc::broken_intra_doc_links,
        reason = "this text is also --help's, where [IPv6] is literal"
    )]
    #[arg(value_name = "DEST[:PORT][/PROTO]")]
    dest: Destination,

    /// Source address of the packet; decides masquerading, eTP Local short-circuits and
    /// loadBalancerSourceRanges.
    #[arg(long, value_name = "SRC")]
    from: Option<IpAddr>,

    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Text)]
    output: Format,

    /// Compare the kernel's iptables rules for DEST's service ports with the desired ones
    /// (iptables mode only: another mode fails with exit status 1; reads iptables-save in the
    /// current network namespace).
    #[arg(long)]
    verify: bool,

    /// How long to wait for the sources to list Services and EndpointSlices (e.g. 30s, 1m).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    timeout: Duration,

    /// Read Services, EndpointSlices and Nodes from a manifest file or directory instead of
    /// the API server (as the proxy's --manifests).
    #[arg(long, value_name = "PATH", help_heading = "Proxy configuration")]
    manifests: Option<PathBuf>,

    /// kubeconfig file (as the proxy's --kubeconfig).
    #[arg(long, value_name = "PATH", help_heading = "Proxy configuration")]
    kubeconfig: Option<String>,

    /// API server address (as the proxy's --master).
    #[arg(long, value_name = "URL", help_heading = "Proxy configuration")]
    master: Option<String>,

    /// KubeProxyConfiguration file; as for the proxy, the flags below other than
    /// --hostname-override are then ignored.
    #[arg(long, value_name = "PATH", help_heading = "Proxy configuration")]
    config: Option<PathBuf>,

    /// This node's name (default: the host name).
    #[arg(long, value_name = "NAME", help_heading = "Proxy configuration")]
    hostname_override: Option<String>,

    /// The cluster's pod CIDR(s): the local-traffic detector.
    #[arg(long, value_name = "CIDRS", help_heading = "Proxy configuration")]
    cluster_cidr: Option<String>,

    /// Masquerade all ClusterIP traffic.
    #[arg(
        long,
        help_heading = "Proxy configuration",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    masquerade_all: Option<bool>,

    /// The proxy mode: the objects shown are this mode's (nftables table, maps and chains; IPVS
    /// virtual server, real servers and ipsets; userspace capture chains); --verify needs
    /// iptables.
    #[arg(long, value_name = "MODE", value_parser = ProxyMode::from_str, help_heading = "Proxy configuration")]
    proxy_mode: Option<ProxyMode>,

    /// The iptables backend --verify reads (as the proxy's; default: detected as the proxy
    /// detects it, after $KUBE_PROXY_RS_IPTABLES_BACKEND and the file's iptablesBackend).
    #[arg(long, value_name = "auto|legacy|nft", value_parser = IptablesBackend::from_str, help_heading = "Proxy configuration")]
    iptables_backend: Option<IptablesBackend>,

    /// nftables mode's socket load balancer (as the proxy's --socket-lb): the answer says
    /// which path the node's own sockets' connections take.
    #[arg(
        long,
        help_heading = "Proxy configuration",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    socket_lb: Option<bool>,

    /// The cgroup the socket load balancer attaches to (as the proxy's --socket-lb-cgroup).
    #[arg(long, value_name = "DIR", help_heading = "Proxy configuration")]
    socket_lb_cgroup: Option<String>,

    /// nftables mode's table layout whose objects are shown (as the proxy's
    /// `--nftables-layout`; default: the file's nftablesLayout, else maps).
    #[arg(long, value_name = "maps|chains", value_parser = kp_config::NftablesLayout::from_str, help_heading = "Proxy configuration")]
    nftables_layout: Option<kp_config::NftablesLayout>,

    /// Feature gates (as the proxy's --feature-gates), e.g.
    /// KubeProxyNFTablesLocalhostNodePorts=true for nftables mode's localhost NodePorts.
    #[arg(long, value_name = "GATES", help_heading = "Proxy configuration")]
    feature_gates: Option<kp_config::FeatureGates>,

    /// Where NodePorts answer (as the proxy's --nodeport-addresses).
    #[arg(long = "nodeport-addresses", value_name = "CIDRS", value_parser = kp_config::NodePortAddressesSetting::from_str, help_heading = "Proxy configuration")]
    nodeport_addresses: Option<kp_config::NodePortAddressesSetting>,
}

fn parse_duration(text: &str) -> Result<Duration, kp_config::duration::DurationError> {
    kp_config::duration::parse(text.trim())
}

/// Entry point for `kube-proxy explain ARGS...` (`args` starts with `explain`).
pub fn main(args: impl Iterator<Item = String>) -> ExitCode {
    let args = match Args::try_parse_from(args) {
        Ok(args) => args,
        Err(error) => {
            // Help and version go to stdout with status 0; usage errors to stderr with 2.
            let _ = error.print();
            return ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2));
        }
    };
    init_logging();
    match run(&args) {
        Ok(code) => code,
        Err(error) => {
            eprintln!(
                "kube-proxy explain: {}",
                kp_core::report::Chain(error.as_ref())
            );
            ExitCode::FAILURE
        }
    }
}

/// Only warnings and errors from the sources: the answer goes to stdout.
fn init_logging() {
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .with_target(false)
        .finish();
    let _ = tracing::subscriber::set_global_default(subscriber);
}

fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let options = Options {
        config: args.config.clone(),
        manifests: args.manifests.clone(),
        master: args.master.clone(),
        kubeconfig: args.kubeconfig.clone(),
        hostname_override: args.hostname_override.clone(),
        cluster_cidr: args.cluster_cidr.clone(),
        masquerade_all: args.masquerade_all,
        proxy_mode: args.proxy_mode,
        iptables_backend: args.iptables_backend,
        socket_lb: args.socket_lb,
        socket_lb_cgroup: args.socket_lb_cgroup.clone(),
        nftables_layout: args.nftables_layout,
        feature_gates: args.feature_gates.clone(),
        nodeport_addresses: args.nodeport_addresses.clone(),
        ..Options::default()
    };
    let loaded = options.load().context("invalid configuration")?;
    for warning in &loaded.warnings {
        eprintln!("warning: {warning}");
    }
    let config = loaded.config;
    let mode = config.mode();
    if args.verify && mode != ProxyMode::Iptables {
        bail!(
            "--verify supports iptables mode only, and the proxy mode is {:?} (the \
             explanation without --verify names that mode's objects)",
            mode.as_str()
        );
    }
    let node_name = node_name(&config)?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let state = runtime.block_on(read_state(args, &config, &node_name))?;
    if !state.node.known {
        eprintln!(
            "warning: no Node named {node_name:?} was found: node addresses (NodePorts, \
             --src-type LOCAL) and topology labels are unknown; is --hostname-override right?"
        );
    }

    // The node IPs as the proxy would detect them from this Node (no start-up wait here).
    // nodePortAddresses select among this machine's addresses and the Node's, so the answer
    // fits the node whether explain runs on it or elsewhere.
    let detected = crate::node_ips::Detected::new(state.node.host_ips(), config.bind_address());
    // This machine's facts, probed as the proxy does: its addresses, and with --verify the
    // iptables backend the proxy on this node uses, chosen the same way.
    let wants = crate::modes::host::Wants {
        iptables_backend: args.verify,
        addresses: true,
        ..Default::default()
    };
    let probe = crate::modes::host::SystemProbe::new(args.iptables_backend, &config);
    let host = runtime.block_on(crate::modes::Host::probe(&probe, &wants))?;
    let mut local = host.local_addresses();
    local.extend(
        state
            .node
            .addresses
            .iter()
            .filter(|ip| !local.contains(ip))
            .copied()
            .collect::<Vec<_>>(),
    );
    let node = crate::modes::NodeAddressing::new(&config, &detected, &local);
    let mut render_config =
        crate::modes::render_config(&config, Some(&state.node.pod_cidrs), &node)?;
    if config.mode() == ProxyMode::Nftables {
        // The table never DNATs loopback; the localhost NodePorts are the listeners' or the
        // table's rejects (`localhost_node_ports` is iptables mode's route_localnet).
        render_config.localhost_node_ports = false;
        render_config.nftables_localhost_rejects =
            crate::modes::nftables::localhost_rejects(&config, &host.families);
    }
    let query = Query {
        destination: args.dest,
        source: args.from,
    };
    let mut explanation = explain(&state, &render_config, &query)?;
    annotate_mode(&mut explanation, &state, &render_config, &config)?;
    if config.mode() == ProxyMode::Nftables {
        add_localhost(&mut explanation, &state, &render_config);
    }

    let save_tool = host.iptables.save(explanation.family).display().to_string();
    let report = if args.verify {
        Some(verify_kernel(
            &state,
            &render_config,
            &explanation,
            &save_tool,
        )?)
    } else {
        None
    };
    match args.output {
        Format::Text => print!(
            "{}",
            text::render(
                &explanation,
                report.as_ref().map(|r| (save_tool.as_str(), r))
            )
        ),
        Format::Json => {
            let mut value = serde_json::to_value(&explanation).context("encoding JSON")?;
            if let (Some(report), Some(object)) = (&report, value.as_object_mut()) {
                object.insert(
                    "verify".into(),
                    serde_json::to_value(report).context("encoding JSON")?,
                );
            }
            println!(
                "{}",
                serde_json::to_string_pretty(&value).context("encoding JSON")?
            );
        }
    }
    Ok(match &report {
        Some(report) if !report.is_clean() => ExitCode::from(EXIT_DIFFERENCES),
        _ => ExitCode::SUCCESS,
    })
}

/// Adds the objects of the configured mode when it is not iptables (whose chains are the
/// explanation's hops). IPVS NodePorts are planned on nodePortAddresses, else on the Node
/// object's addresses (the running proxy uses the kernel's, which explain does not read).
pub(crate) fn annotate_mode(
    explanation: &mut kp_rules::explain::Explanation,
    state: &ProxyState,
    render_config: &kp_rules::iptables::RenderConfig,
    config: &KubeProxyConfiguration,
) -> anyhow::Result<()> {
    use kp_rules::explain::dataplane::{Mode, annotate};
    let ipvs_config;
    let mode = match config.mode() {
        ProxyMode::Nftables => match config.nftables_layout {
            kp_config::NftablesLayout::Maps => Mode::NftablesMaps,
            kp_config::NftablesLayout::Chains => Mode::Nftables,
        },
        ProxyMode::Userspace => Mode::Userspace,
        ProxyMode::Ipvs => {
            let scheduler: kp_ipvs::Scheduler = config
                .ipvs
                .scheduler
                .parse()
                .context("invalid ipvs.scheduler")?;
            let node_ips =
                crate::modes::ipvs::node_port_ips(&render_config.node_port_addresses, || {
                    state.node.addresses.clone()
                });
            ipvs_config = kp_rules::ipvs::IpvsConfig {
                scheduler,
                node_ips,
                detected_node_ips: render_config.node_ips.clone(),
                ..Default::default()
            };
            Mode::Ipvs(&ipvs_config)
        }
        _ => return Ok(()),
    };
    annotate(explanation, state, render_config, &mode).context("rendering the mode's rules")?;
    if config.mode() == ProxyMode::Nftables && config.socket_lb.enabled {
        for m in &mut explanation.matches {
            m.socket_lb = Some(crate::modes::socket_lb::explain_path(
                state,
                m,
                &config.socket_lb,
            ));
        }
    }
    Ok(())
}

/// nftables mode: what a loopback destination's NodePorts get (KEP-6032); when no service
/// port matched otherwise, the summary says it.
fn add_localhost(
    explanation: &mut Explanation,
    state: &ProxyState,
    render_config: &kp_rules::iptables::RenderConfig,
) {
    let found = kp_rules::explain::localhost::explain_localhost(
        state,
        render_config,
        &explanation.destination,
    );
    if explanation.matches.is_empty() && !found.is_empty() {
        explanation.summary = match found.as_slice() {
            [one] => one.describe(),
            many => format!("{} localhost NodePorts", many.len()),
        };
    }
    explanation.localhost_node_ports = found;
}

/// The node name as the proxy picks it: the override, else the host name, lowercased.
fn node_name(config: &KubeProxyConfiguration) -> anyhow::Result<String> {
    let name = match config.hostname_override() {
        Some(name) => name.to_owned(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_default(),
    };
    let name = name.trim().to_lowercase();
    if name.is_empty() {
        bail!("cannot tell this node's name; pass --hostname-override");
    }
    Ok(name)
}

/// Runs the configured source until it has listed everything, then stops it.
async fn read_state(
    args: &Args,
    config: &KubeProxyConfiguration,
    node_name: &str,
) -> anyhow::Result<ProxyState> {
    let (tx, mut rx) = mpsc::channel::<SourceEvent>(EVENT_QUEUE);
    let shutdown = CancellationToken::new();
    let source: tokio::task::JoinHandle<anyhow::Result<()>> = match &args.manifests {
        Some(path) => {
            // The manifests source waits for a missing path to appear; here that is a typo.
            if !path.exists() {
                bail!("--manifests {}: no such file or directory", path.display());
            }
            let source =
                kp_sources::manifests::ManifestsSource::new(path.clone()).node_name(node_name);
            let stop = shutdown.clone();
            tokio::spawn(async move { Ok(source.run(tx, stop).await?) })
        }
        None => {
            let client = crate::app::api_client(args.master.as_deref(), config).await?;
            let source = kp_sources::api::ApiSource::new(client, node_name)
                .service_proxy_name(config.service_proxy_name.clone());
            let stop = shutdown.clone();
            tokio::spawn(async move { Ok(source.run(tx, stop).await?) })
        }
    };

    let mut tracker = ChangeTracker::new(node_name).with_external_ips(kp_config::gates::enabled(
        &config.feature_gates,
        "AllowServiceExternalIPs",
    ));
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut until = deadline;
    let mut ended = false;
    loop {
        if tracker.ready() && tracker.is_synced(ObjectKind::Node) {
            break;
        }
        tokio::select! {
            event = rx.recv() => match event {
                Some(event) => {
                    tracker.record(event);
                    if tracker.ready() && until == deadline {
                        until = deadline.min(tokio::time::Instant::now() + NODE_GRACE);
                    }
                }
                None => {
                    ended = true;
                    break;
                }
            },
            () = tokio::time::sleep_until(until) => break,
        }
    }
    shutdown.cancel();
    drop(rx);
    let outcome = tokio::time::timeout(Duration::from_secs(5), source).await;
    if !tracker.ready() {
        if ended && let Ok(Ok(Err(error))) = outcome {
            return Err(error.context("reading the sources"));
        }
        let missing: Vec<&str> = [ObjectKind::Service, ObjectKind::EndpointSlice]
            .into_iter()
            .filter(|k| !tracker.is_synced(*k))
            .map(ObjectKind::as_str)
            .collect();
        bail!(
            "the source did not list {} within {:?}{}",
            missing.join(" and "),
            args.timeout,
            if ended {
                " (it stopped)"
            } else {
                "; see --timeout"
            }
        );
    }

    let mut state = ProxyState::default();
    let result = tracker.apply(&mut state);
    for invalid in &result.invalid {
        eprintln!("warning: skipped invalid object: {invalid}");
    }
    Ok(state)
}

/// Renders the desired rules for DEST's family and compares them with what `tool` (that
/// family's `iptables-save` of the node's backend) lists.
fn verify_kernel(
    state: &ProxyState,
    config: &RenderConfig,
    explanation: &Explanation,
    tool: &str,
) -> anyhow::Result<VerifyReport> {
    let family = explanation.family;
    let desired = render(
        state,
        family,
        config,
        &SyncScope {
            kind: SyncKind::Full,
            changed: &Default::default(),
            existing_chains: &Default::default(),
        },
    )
    .context("rendering the desired rules")?;
    let desired = RuleSet::parse(&desired.text).context("reading the rendered rules")?;
    let output = std::process::Command::new(tool)
        .output()
        .with_context(|| format!("running {tool}"))?;
    if !output.status.success() {
        bail!(
            "{tool} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let actual = RuleSet::parse(&String::from_utf8_lossy(&output.stdout))
        .with_context(|| format!("reading {tool} output"))?;
    Ok(verify(explanation, &desired, &actual))
}

#[cfg(test)]
mod tests {
    //! `kube-proxy explain`'s command line is outside input: any argument list is parsed or
    //! refused with clap's message, never a panic.

    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    use super::*;

    #[test]
    fn any_command_line_is_parsed_or_refused_with_a_message() {
        let arg = prop_oneof![
            Just("10.96.0.10:80/tcp".to_owned()),
            Just("[fd00::1]:53/udp".to_owned()),
            Just("10.96.0.10:0".to_owned()),
            Just("::ffff:1.2.3.4".to_owned()),
            Just("--from".to_owned()),
            Just("--from=fe80::1%eth0".to_owned()),
            Just("-o".to_owned()),
            Just("json".to_owned()),
            Just("--timeout=-1s".to_owned()),
            Just("--timeout=99999999999h".to_owned()),
            Just("--verify".to_owned()),
            Just("--proxy-mode=bogus".to_owned()),
            Just("--manifests".to_owned()),
            Just("--".to_owned()),
            any::<String>(),
        ];
        let mut runner = TestRunner::new(Config {
            cases: 512,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&proptest::collection::vec(arg, 0..6), |args| {
                let argv = std::iter::once("explain".to_owned()).chain(args);
                match Args::try_parse_from(argv) {
                    Ok(parsed) => prop_assert!(parsed.dest.port != Some(0)),
                    Err(error) => prop_assert!(!error.to_string().trim().is_empty()),
                }
                Ok(())
            })
            .unwrap_or_else(|failure| panic!("{failure}"));
    }
}
