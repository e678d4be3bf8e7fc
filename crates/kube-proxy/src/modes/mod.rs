//! The proxy modes: one module each (`iptables`, `nftables`, `ipvs`, `userspace`, `fake`),
//! each a [`Mode`] built from the same [`Input`] (configuration, what the node's IPs decide,
//! the [`Host`] facts probed once at start-up, the metrics registry), and what they share:
//! upstream's start-up sysctls and their record for `--cleanup`, `--init-only`, the renderer
//! configuration. [`run`] builds the configured mode and runs it; ipvs mode's fallback to
//! iptables mode is decided by the host probe ([`Host::mode_to_run`]) before that.

pub mod fake;
pub mod host;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod socket_lb;
pub mod userspace;

use anyhow::Context as _;
use ipnet::IpNet;
use kp_config::{KubeProxyConfiguration, LocalMode, ProxyMode};
use kp_core::backend::Backend;
use kp_core::model::IpFamily;
use kp_core::report::ErrorChain as _;
use kp_dataplane::sysctls::{self, Applied, ConntrackSettings, FsSysctl, SysctlRecord};
use kp_dataplane::watch::Owned;
use kp_rules::iptables::{LocalDetector, NodePortAddresses, RenderConfig};
use kp_userspace::AffinityTables;
use prometheus_client::registry::Registry;

pub use crate::node_ips::NodeAddressing;
pub use host::Host;

/// What every mode's builder gets.
pub struct Input<'a> {
    /// The effective configuration.
    pub config: &'a KubeProxyConfiguration,
    /// What this node's IPs decide, resolved once at start-up.
    pub node: &'a NodeAddressing,
    /// The node's facts, probed once at start-up.
    pub host: &'a Host,
    /// Where the mode registers its metrics.
    pub registry: &'a mut Registry,
}

/// One proxy mode of the binary.
pub trait Mode {
    /// The backend the proxier drives.
    type Backend: Backend + 'static;

    /// Makes the node-wide settings the mode needs (as upstream's proxier constructors do)
    /// and builds its backend. A configuration the mode cannot run with is an error.
    fn build(input: Input<'_>) -> anyhow::Result<Self::Backend>;

    /// ClientIP affinity pins the mode keeps itself (userspace mode), for `/debug/explain`.
    fn affinity(_backend: &Self::Backend) -> Option<AffinityTables> {
        None
    }

    /// What the mode owns on nf_tables, when it writes there: nf_tables notifications then
    /// tell of other programs' changes at once ([`kp_dataplane::watch`]); elsewhere only the
    /// canary checks find them.
    fn watch(_host: &Host) -> Option<Owned> {
        None
    }

    /// The mode owns kernel state nf_tables does not notify of (ipvs mode: IPVS,
    /// `kube-ipvs0`, ipsets): its canaries are checked every `canaryPeriod` even while
    /// nf_tables is watched.
    const CANARIES_WHILE_WATCHED: bool = false;

    /// [`Self::CANARIES_WHILE_WATCHED`], or for this backend (nftables mode with the socket
    /// load balancer, whose pins nf_tables does not notify of).
    fn canaries_while_watched(_backend: &Self::Backend) -> bool {
        Self::CANARIES_WHILE_WATCHED
    }
}

/// Whether this node's iptables tools write to nf_tables (so iptables-based modes can be
/// watched): the chosen backend, or what `iptables --version` says of the system's.
pub(crate) fn iptables_on_nf_tables(host: &Host) -> bool {
    match host.iptables.variant {
        kp_dataplane::exec::IptablesVariant::Nft => true,
        kp_dataplane::exec::IptablesVariant::Legacy => false,
        kp_dataplane::exec::IptablesVariant::System => host
            .iptables_version
            .as_ref()
            .is_some_and(|v| v.as_ref().is_ok_and(|v| v.contains("nf_tables"))),
    }
}

/// The message for a mode this build does not run.
fn unavailable(mode: ProxyMode) -> anyhow::Error {
    anyhow::anyhow!(
        "proxy mode {:?} is not available in this build of kube-proxy-rs yet (available: iptables, nftables, ipvs, userspace, fake)",
        mode.as_str()
    )
}

/// Refuses, before anything is probed or read, a mode this binary cannot run on Linux.
pub fn check_runnable(mode: ProxyMode) -> anyhow::Result<()> {
    match mode {
        ProxyMode::Iptables
        | ProxyMode::Ipvs
        | ProxyMode::Nftables
        | ProxyMode::Userspace
        | ProxyMode::Fake => Ok(()),
        ProxyMode::Winuserspace => anyhow::bail!(userspace::WINUSERSPACE_ON_LINUX),
        other => Err(unavailable(other)),
    }
}

/// Builds `mode` (the one [`Host::mode_to_run`] chose) and runs it until SIGTERM.
pub fn run(
    runtime: &tokio::runtime::Runtime,
    mode: ProxyMode,
    settings: crate::app::Settings,
    host: &Host,
    registry: Registry,
) -> anyhow::Result<()> {
    match mode {
        ProxyMode::Iptables => start::<iptables::Iptables>(runtime, settings, host, registry),
        ProxyMode::Ipvs => start::<ipvs::Ipvs>(runtime, settings, host, registry),
        ProxyMode::Nftables => start::<nftables::Nftables>(runtime, settings, host, registry),
        ProxyMode::Userspace => start::<userspace::Userspace>(runtime, settings, host, registry),
        ProxyMode::Fake => start::<fake::Fake>(runtime, settings, host, registry),
        other => {
            check_runnable(other)?;
            Err(unavailable(other))
        }
    }
}

/// Builds `M` and runs the proxier with it.
fn start<M: Mode>(
    runtime: &tokio::runtime::Runtime,
    settings: crate::app::Settings,
    host: &Host,
    mut registry: Registry,
) -> anyhow::Result<()> {
    let backend = M::build(Input {
        config: settings.config(),
        node: settings.node(),
        host,
        registry: &mut registry,
    })?;
    let settings = match M::affinity(&backend) {
        Some(affinity) => settings.with_affinity(affinity),
        None => settings,
    };
    let settings = settings
        .with_watch(M::watch(host))
        .with_canaries_while_watched(M::canaries_while_watched(&backend));
    runtime.block_on(crate::app::run(settings, backend, registry))
}

/// What every kernel mode does first: upstream's conntrack sysctls, then the renderer's
/// configuration from `input`. Returns the sysctl layer for the mode's own settings.
fn start_kernel_mode(input: &Input<'_>) -> anyhow::Result<(FsSysctl, RenderConfig)> {
    let sysctl = FsSysctl::host();
    conntrack_sysctls(input.config, &sysctl);
    let render = render_config(input.config, None, input.node)?;
    Ok((sysctl, render))
}

/// Sets nf_conntrack_max and the TCP/UDP timeouts as upstream does. A failure is logged, not
/// fatal: the proxy still works with the kernel's values (inside a container or a network
/// namespace some of these files are read-only).
pub(crate) fn conntrack_sysctls(config: &KubeProxyConfiguration, host: &FsSysctl) {
    match sysctls::apply_conntrack_sysctls(host, &conntrack_settings(config)) {
        Ok(report) => {
            record(&report.applied);
            for warning in report.warnings {
                tracing::warn!(%warning, "conntrack setting left as is");
            }
        }
        Err(error) => {
            tracing::error!(error = %error.chain(), "cannot apply conntrack settings; keeping the kernel's")
        }
    }
}

/// `conntrack.*` as the sysctl layer takes it.
fn conntrack_settings(config: &KubeProxyConfiguration) -> ConntrackSettings {
    let c = &config.conntrack;
    ConntrackSettings {
        max_per_core: u32::try_from(c.max_per_core).unwrap_or(0),
        min: u32::try_from(c.min).unwrap_or(0),
        tcp_established_timeout: c.tcp_established_timeout,
        tcp_close_wait_timeout: c.tcp_close_wait_timeout,
        tcp_be_liberal: c.tcp_be_liberal,
        udp_timeout: c.udp_timeout,
        udp_stream_timeout: c.udp_stream_timeout,
    }
}

/// The kernel settings `--init-only` makes, in order: what upstream's start-up does before
/// its proxier needs only `CAP_NET_ADMIN` (`platformSetup`'s conntrack limits and timeouts,
/// then the proxier constructor's sysctls: `route_localnet` in iptables mode with localhost
/// NodePorts, IPVS's sysctls in ipvs mode). nftables, userspace and fake mode need nothing
/// beyond conntrack. (The one kernel module, `ip_vs`, is loaded by the host's IPVS probe,
/// not by this plan.) `mode` is the one that will run, `families` the host's.
pub(crate) fn init_plan(
    config: &KubeProxyConfiguration,
    mode: ProxyMode,
    node_ports: NodePortAddresses,
    families: &[IpFamily],
    cpus: usize,
) -> anyhow::Result<Vec<sysctls::Setting>> {
    let mut plan = sysctls::conntrack_plan(&conntrack_settings(config), cpus);
    match mode {
        ProxyMode::Iptables => {
            let node = NodeAddressing {
                node_ports,
                node_ips: Vec::new(),
            };
            let render = render_config(config, None, &node)?;
            plan.extend(sysctls::route_localnet_plan(&render, families));
        }
        ProxyMode::Ipvs => {
            plan.extend(kp_dataplane::ipvs::sysctl_plan(config.ipvs.strict_arp));
        }
        _ => {}
    }
    Ok(plan)
}

/// `--init-only`: makes the [`init_plan`] settings on this node and returns, so that the
/// long-running proxy (another container of the pod) can run without the privileges they
/// need. Unlike a normal start, where a setting that cannot be made is logged and the proxy
/// runs on the kernel's value, a failure here is an error (as upstream's): making these
/// settings is all the init container is for. A read-only `/sys` for the conntrack hash
/// size is only a warning, as at every start. In ipvs mode the host probe has probed IPVS
/// (loading `ip_vs` if needed, which only this privileged container may); without IPVS it
/// prepares iptables mode, which the proxy then falls back to.
pub fn init_only(
    config: &KubeProxyConfiguration,
    node_ports: NodePortAddresses,
    host: &Host,
) -> anyhow::Result<()> {
    let sysctl = FsSysctl::host();
    let mode = host.mode_to_run(config.mode());
    let plan = init_plan(
        config,
        mode,
        node_ports,
        &host.families,
        sysctls::online_cpus(&sysctl),
    )?;
    let report = sysctls::apply(&sysctl, &plan).context("setting kernel parameters")?;
    record(&report.applied);
    for warning in report.warnings {
        tracing::warn!(%warning, "kernel setting left as is");
    }
    Ok(())
}

/// Upstream's OOM score adjustment at start (`oomScoreAdj`, -999 by default, so the OOM
/// killer picks almost anything else first). As upstream, a failure (an unprivileged
/// container may not lower its score) is logged at verbosity 2 and changes nothing else.
pub fn apply_oom_score_adj(config: &KubeProxyConfiguration) {
    let value = config.oom_score_adj;
    match std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        Ok(()) => tracing::debug!(value, "Set oom_score_adj"),
        Err(error) => tracing::debug!(value, error = %error.chain(), "Failed to apply OOMScore"),
    }
}

/// Remembers the original values of the settings just changed, so `--cleanup` can restore
/// them after any number of restarts. A failure only costs that: it is logged.
fn record(applied: &[Applied]) {
    let record = SysctlRecord::from_env();
    if let Err(error) = record.note(applied) {
        tracing::warn!(error = %error.chain(), "cannot record original kernel settings; --cleanup will not restore them");
    }
}

/// `--cleanup`'s part for kernel settings: puts back what this proxy changed (as recorded
/// in `$KUBE_PROXY_RS_STATE_DIR`, default `/run/kube-proxy-rs`), see
/// [`sysctls::restored_on_cleanup`] for which.
pub fn restore_sysctls() -> anyhow::Result<()> {
    let record = SysctlRecord::from_env();
    let report = record
        .restore(&FsSysctl::host())
        .context("restoring kernel settings")?;
    tracing::info!(
        restored = report.restored.len(),
        left = report.left.len(),
        record = %record.path().display(),
        "Kernel settings restored"
    );
    Ok(())
}

/// The renderer's configuration from `KubeProxyConfiguration`, shared by the proxy and
/// `explain`. `node_pod_cidrs` is the Node's podCIDRs when known (`explain` reads the Node);
/// the proxy starts before the Node is read, so it refuses NodeCIDR detection for now.
/// `node` is resolved once by the caller.
pub(crate) fn render_config(
    config: &KubeProxyConfiguration,
    node_pod_cidrs: Option<&[IpNet]>,
    node: &NodeAddressing,
) -> anyhow::Result<RenderConfig> {
    let (bit, masquerade_all) = config.masquerade();
    let local_detector = match config.detect_local_mode {
        LocalMode::ClusterCidr if config.cluster_cidrs().is_empty() => LocalDetector::None,
        LocalMode::ClusterCidr => LocalDetector::Cidrs(config.cluster_cidrs()),
        LocalMode::NodeCidr => match node_pod_cidrs {
            None => anyhow::bail!(
                "detectLocalMode NodeCIDR is not supported yet; use ClusterCIDR with --cluster-cidr"
            ),
            Some([]) => LocalDetector::None,
            Some(cidrs) => LocalDetector::Cidrs(cidrs.to_vec()),
        },
        LocalMode::BridgeInterface => {
            LocalDetector::BridgeInterface(config.detect_local.bridge_interface.clone())
        }
        LocalMode::InterfaceNamePrefix => {
            LocalDetector::InterfaceNamePrefix(config.detect_local.interface_name_prefix.clone())
        }
    };
    Ok(RenderConfig {
        masquerade_bit: u8::try_from(bit).context("masqueradeBit out of range")?,
        masquerade_all,
        local_detector,
        node_port_addresses: node.node_ports.clone(),
        node_ips: node.node_ips.clone(),
        localhost_node_ports: config.iptables.localhost_node_ports,
        ..RenderConfig::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(config: &KubeProxyConfiguration) -> Vec<&'static str> {
        match init_plan(
            config,
            config.mode(),
            NodePortAddresses::All,
            &[IpFamily::V4, IpFamily::V6],
            2,
        ) {
            Ok(plan) => plan.iter().map(|s| s.key).collect(),
            Err(e) => panic!("{e:#}"),
        }
    }

    #[test]
    fn init_plan_follows_the_mode_as_upstreams_proxiers_do() {
        let mut config = KubeProxyConfiguration::default();
        let conntrack = [
            sysctls::CONNTRACK_MAX,
            sysctls::CONNTRACK_HASHSIZE,
            sysctls::TCP_TIMEOUT_ESTABLISHED,
            sysctls::TCP_TIMEOUT_CLOSE_WAIT,
        ];
        config.mode = kp_config::ProxyMode::Nftables;
        assert_eq!(keys(&config), conntrack);
        config.mode = kp_config::ProxyMode::Ipvs;
        config.ipvs.strict_arp = true;
        let ipvs = keys(&config);
        assert_eq!(ipvs[..4], conntrack);
        assert!(ipvs.contains(&"proc/sys/net/ipv4/vs/conntrack"), "{ipvs:?}");
        assert!(
            ipvs.contains(&"proc/sys/net/ipv4/conf/all/arp_ignore"),
            "{ipvs:?}"
        );
        // iptables mode: route_localnet only with localhost NodePorts (and IPv4 programmed).
        config.mode = kp_config::ProxyMode::Iptables;
        config.iptables.localhost_node_ports = false;
        assert_eq!(keys(&config), conntrack);
        // conntrack.maxPerCore 0 leaves the table size alone; zero timeouts leave theirs.
        config.conntrack.max_per_core = 0;
        config.conntrack.tcp_established_timeout = std::time::Duration::ZERO;
        assert_eq!(keys(&config), [sysctls::TCP_TIMEOUT_CLOSE_WAIT]);
    }

    #[test]
    fn render_config_follows_the_configuration() {
        let mut config = KubeProxyConfiguration::from_yaml(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             clusterCIDR: 10.244.0.0/16\niptables:\n  masqueradeAll: true\n  masqueradeBit: 15\n",
        )
        .expect("valid config");
        let render = render_config(&config, None, &NodeAddressing::default()).expect("renders");
        assert!(render.masquerade_all);
        assert_eq!(render.masquerade_bit, 15);
        assert_eq!(
            render.local_detector,
            LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().expect("cidr")])
        );
        config.detect_local_mode = LocalMode::NodeCidr;
        assert!(render_config(&config, None, &NodeAddressing::default()).is_err());
        let cidrs: Vec<IpNet> = vec!["10.244.1.0/24".parse().expect("cidr")];
        let render = render_config(&config, Some(&cidrs), &NodeAddressing::default())
            .expect("renders with the Node's podCIDRs");
        assert_eq!(render.local_detector, LocalDetector::Cidrs(cidrs));
    }
}
