//! Building a kernel proxy mode from the configuration: the I/O that happens once at start-up
//! (conntrack sysctls, the node's addresses, the conntrack-liberal probe) before the backend
//! is handed to the proxier.

use std::net::IpAddr;

use anyhow::Context as _;
use ipnet::IpNet;
use kp_config::{KubeProxyConfiguration, LocalMode};
use kp_core::backend::{Backend, BackendError, SyncReport, SyncRequest};
use kp_dataplane::exec::Tools;
use kp_dataplane::iptables::{IptablesBackend, IptablesConfig, IptablesMetrics, detect_families};
use kp_dataplane::nftables::{NftablesBackend, NftablesConfig, NftablesMetrics};
use kp_dataplane::sysctls::{self, Applied, ConntrackSettings, FsSysctl, SysctlRecord};
use kp_rules::iptables::{LocalDetector, NodePortAddresses, RenderConfig};
use prometheus_client::registry::Registry;

/// What this node's IPs decide, resolved once at start-up ([`crate::node_ips`]): where
/// NodePorts (and health-check node ports) answer, and the node IP of each family the rules
/// use (`loadBalancerSourceRanges`' allowance for the node).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeAddressing {
    /// nodePortAddresses resolved ([`crate::node_ips::node_port_addresses`]).
    pub node_ports: NodePortAddresses,
    /// One node IP per family ([`kp_core::model::NodeIps::all`]).
    pub node_ips: Vec<IpAddr>,
}

impl NodeAddressing {
    /// From the node IPs detected at start-up and the node's `local` addresses.
    pub fn new(
        config: &KubeProxyConfiguration,
        detected: &crate::node_ips::Detected,
        local: &[IpAddr],
    ) -> Self {
        Self {
            node_ports: crate::node_ips::node_port_addresses(config, &detected.ips, local),
            node_ips: detected.ips.all().to_vec(),
        }
    }
}

/// Builds the iptables backend, applying upstream's start-up sysctls first unless the backend
/// is only wanted for `--cleanup`. `node` is resolved once at start-up. Changed sysctls are
/// recorded for `--cleanup` ([`restore_sysctls`]).
pub fn iptables(
    config: &KubeProxyConfiguration,
    node: &NodeAddressing,
    registry: &mut Registry,
    cleanup_only: bool,
) -> anyhow::Result<IptablesBackend> {
    let host = FsSysctl::host();
    if !cleanup_only {
        conntrack_sysctls(config, &host);
    }
    let families = detect_families();
    if config.detect_local_mode == LocalMode::ClusterCidr && config.cluster_cidrs().is_empty() {
        tracing::warn!(
            "clusterCIDR is empty: pod traffic cannot be told apart, so ClusterIP traffic is not masqueraded"
        );
    }
    let mut render = render_config(config, None, node)?;
    render.drop_invalid = !sysctls::tcp_be_liberal(&host);
    if !cleanup_only {
        match sysctls::apply(&host, &sysctls::route_localnet_plan(&render, &families)) {
            Ok(report) => record(&report.applied),
            Err(error) => tracing::error!(
                %error,
                "cannot enable route_localnet; localhost NodePorts will not answer"
            ),
        }
    }
    let tools = Tools::host();
    let netlink = kp_dataplane::iptables::netlink::for_host(&tools);
    let mut backend = IptablesBackend::new(IptablesConfig::new(families, render), tools)
        .context("invalid iptables configuration")?
        .with_metrics(IptablesMetrics::register(registry));
    if let Some(netlink) = netlink {
        backend = backend.with_netlink(netlink);
    }
    tracing::info!("Using iptables Proxier");
    Ok(backend)
}

/// The oldest `nft` upstream's nftables mode accepts.
const MIN_NFT_VERSION: (u32, u32, u32) = (1, 0, 1);

/// Builds the nftables backend, applying upstream's start-up conntrack sysctls first unless
/// the backend is only wanted for `--cleanup`. nodePortAddresses defaults to `primary` in
/// this mode ([`crate::node_ips::node_port_addresses`] resolves it); localhost NodePorts,
/// route_localnet and the conntrack INVALID drop do not exist in nftables mode.
pub fn nftables(
    config: &KubeProxyConfiguration,
    node: &NodeAddressing,
    registry: &mut Registry,
    cleanup_only: bool,
) -> anyhow::Result<NftablesMode> {
    check_nft_version()?;
    let host = FsSysctl::host();
    if !cleanup_only {
        conntrack_sysctls(config, &host);
    }
    let families = detect_families();
    if config.detect_local_mode == LocalMode::ClusterCidr && config.cluster_cidrs().is_empty() {
        tracing::warn!(
            "clusterCIDR is empty: pod traffic cannot be told apart, so ClusterIP traffic is not masqueraded"
        );
    }
    let render = render_config(config, None, node)?;
    let nft = NftablesBackend::with_metrics_registered(
        NftablesConfig::new(families.clone(), render.clone()),
        NftablesMetrics::register(registry),
    )
    .context("invalid nftables configuration")?;
    // Only for cleaning up what iptables mode left; its metrics are not registered.
    let iptables = IptablesBackend::new(IptablesConfig::new(families, render), Tools::host())
        .context("invalid iptables configuration")?;
    tracing::info!("Using nftables Proxier");
    Ok(NftablesMode {
        nft,
        iptables,
        iptables_cleaned: false,
    })
}

/// Fails unless `nft --version` reports at least [`MIN_NFT_VERSION`], as upstream.
fn check_nft_version() -> anyhow::Result<()> {
    let output = std::process::Command::new(kp_dataplane::nftables::DEFAULT_NFT_BINARY)
        .arg("--version")
        .output()
        .context("nftables mode needs `nft` (package nftables)")?;
    let text = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(
        output.status.success(),
        "`nft --version` failed: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    match parse_nft_version(&text) {
        Some(version) if version >= MIN_NFT_VERSION => {
            tracing::info!(version = %text.trim(), "Using nft");
            Ok(())
        }
        Some(_) => anyhow::bail!(
            "nftables mode needs nft >= {}.{}.{}, found {:?}",
            MIN_NFT_VERSION.0,
            MIN_NFT_VERSION.1,
            MIN_NFT_VERSION.2,
            text.trim()
        ),
        None => {
            tracing::warn!(version = %text.trim(), "cannot read the nft version; going on");
            Ok(())
        }
    }
}

/// `nftables v1.0.6 (Lester Gooch #5)` -> (1, 0, 6).
fn parse_nft_version(text: &str) -> Option<(u32, u32, u32)> {
    let word = text.split_whitespace().find(|w| w.starts_with('v'))?;
    let mut parts = word[1..].split('.').map(|p| p.parse::<u32>().ok());
    let major = parts.next()??;
    let minor = parts.next().flatten().unwrap_or(0);
    let patch = parts.next().flatten().unwrap_or(0);
    Some((major, minor, patch))
}

/// nftables mode as the binary runs it: [`NftablesBackend`], plus iptables mode's cleanup.
/// As upstream, a normal start removes iptables mode's chains once the first nftables sync
/// succeeded (errors there are only logged), so a node switched from iptables mode does not
/// run both. (`--cleanup` removes every mode's state through `crate::cleanup`.)
#[derive(Debug)]
pub struct NftablesMode {
    nft: NftablesBackend,
    iptables: IptablesBackend,
    iptables_cleaned: bool,
}

impl Backend for NftablesMode {
    fn mode(&self) -> &'static str {
        self.nft.mode()
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        // Look for iptables mode's leftovers before the first sync (cheap while the nftables
        // table is small, see `cleanup_plan`), remove them after it succeeded.
        let plan = if self.iptables_cleaned {
            None
        } else {
            Some(self.iptables.cleanup_plan().await)
        };
        let report = self.nft.sync(request).await?;
        if let Some(plan) = plan {
            self.iptables_cleaned = true;
            if plan.is_empty() {
                return Ok(report);
            }
            if let Err(error) = self.iptables.apply_cleanup(plan).await {
                tracing::warn!(%error, "cannot remove iptables mode's leftovers");
            }
        }
        Ok(report)
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let nft = self.nft.cleanup().await;
        let iptables = self.iptables.cleanup().await;
        nft.and(iptables)
    }
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
            tracing::error!(%error, "cannot apply conntrack settings; keeping the kernel's")
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
/// beyond conntrack. (The one kernel module, `ip_vs`, is loaded by [`init_only`]'s IPVS
/// probe, not by this plan.)
pub(crate) fn init_plan(
    config: &KubeProxyConfiguration,
    node_ports: NodePortAddresses,
    cpus: usize,
) -> anyhow::Result<Vec<sysctls::Setting>> {
    let mut plan = sysctls::conntrack_plan(&conntrack_settings(config), cpus);
    match config.mode() {
        kp_config::ProxyMode::Iptables => {
            let node = NodeAddressing {
                node_ports,
                node_ips: Vec::new(),
            };
            let render = render_config(config, None, &node)?;
            plan.extend(sysctls::route_localnet_plan(&render, &detect_families()));
        }
        kp_config::ProxyMode::Ipvs => {
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
/// size is only a warning, as at every start. In ipvs mode it probes IPVS first (loading
/// `ip_vs` if needed, which only this privileged container may); without IPVS it prepares
/// iptables mode, which the proxy then falls back to.
pub fn init_only(
    config: &KubeProxyConfiguration,
    node_ports: NodePortAddresses,
) -> anyhow::Result<()> {
    let host = FsSysctl::host();
    let mut config = std::borrow::Cow::Borrowed(config);
    if config.mode() == kp_config::ProxyMode::Ipvs
        && let Err(why) = crate::ipvs_mode::available(&config)?
    {
        tracing::error!(error = %why, "Can't use the IPVS proxier");
        tracing::info!("Falling back to the iptables proxier");
        config.to_mut().mode = kp_config::ProxyMode::Iptables;
    }
    let plan = init_plan(&config, node_ports, sysctls::online_cpus(&host))?;
    let report = sysctls::apply(&host, &plan).context("setting kernel parameters")?;
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
        Err(error) => tracing::debug!(value, %error, "Failed to apply OOMScore"),
    }
}

/// Remembers the original values of the settings just changed, so `--cleanup` can restore
/// them after any number of restarts. A failure only costs that: it is logged.
fn record(applied: &[Applied]) {
    let record = SysctlRecord::from_env();
    if let Err(error) = record.note(applied) {
        tracing::warn!(%error, "cannot record original kernel settings; --cleanup will not restore them");
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

/// This node's interface addresses, from `ip -o addr show` (empty, with a warning, if that
/// fails: NodePorts then answer nowhere rather than everywhere).
pub(crate) fn local_addresses() -> Vec<IpAddr> {
    match std::process::Command::new("ip")
        .args(["-o", "addr", "show"])
        .output()
    {
        Ok(out) if out.status.success() => parse_ip_addr(&String::from_utf8_lossy(&out.stdout)),
        Ok(out) => {
            tracing::warn!(stderr = %String::from_utf8_lossy(&out.stderr).trim(), "`ip -o addr show` failed");
            Vec::new()
        }
        Err(error) => {
            tracing::warn!(%error, "cannot run `ip -o addr show`");
            Vec::new()
        }
    }
}

/// Parses `ip -o addr show` lines: `2: eth0    inet 192.168.1.2/24 brd ... scope global eth0`.
fn parse_ip_addr(text: &str) -> Vec<IpAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|w| *w == "inet" || *w == "inet6")?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(config: &KubeProxyConfiguration) -> Vec<&'static str> {
        match init_plan(config, NodePortAddresses::All, 2) {
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
    fn parses_ip_addr_output() {
        let text = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n\
                    2: eth0    inet 192.168.49.2/24 brd 192.168.49.255 scope global eth0\n\
                    2: eth0    inet6 fe80::1/64 scope link \\       valid_lft forever\n";
        let ips = parse_ip_addr(text);
        let expected: Vec<IpAddr> = vec![
            "127.0.0.1".parse().expect("ip"),
            "192.168.49.2".parse().expect("ip"),
            "fe80::1".parse().expect("ip"),
        ];
        assert_eq!(ips, expected);
    }

    #[test]
    fn parses_nft_versions() {
        assert_eq!(
            parse_nft_version("nftables v1.0.6 (Lester Gooch #5)\n"),
            Some((1, 0, 6))
        );
        assert_eq!(
            parse_nft_version("nftables v0.9.8 (E.D.S.)"),
            Some((0, 9, 8))
        );
        assert!(parse_nft_version("nftables v0.9.8 (E.D.S.)") < Some(MIN_NFT_VERSION));
        assert_eq!(parse_nft_version("nftables v1.1"), Some((1, 1, 0)));
        assert_eq!(parse_nft_version("garbage"), None);
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

/// iptables or ipvs mode as the binary runs it: like upstream's, it removes nftables mode's
/// tables once its own first sync succeeded, so a node switched from nftables mode does not
/// run both (a failure there is only logged).
#[derive(Debug)]
pub struct RemovesNftablesLeftovers<B> {
    inner: B,
    nft: NftablesBackend,
    done: bool,
}

impl<B> RemovesNftablesLeftovers<B> {
    /// `inner`, which removes nftables mode's tables for `families` after its first sync.
    pub fn new(inner: B, config: &KubeProxyConfiguration) -> anyhow::Result<Self> {
        let render = render_config(config, None, &NodeAddressing::default())?;
        let nft = NftablesBackend::new(NftablesConfig::new(detect_families(), render))
            .context("invalid nftables configuration")?;
        Ok(Self {
            inner,
            nft,
            done: false,
        })
    }
}

impl<B: Backend> Backend for RemovesNftablesLeftovers<B> {
    fn mode(&self) -> &'static str {
        self.inner.mode()
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let report = self.inner.sync(request).await?;
        if !self.done {
            self.done = true;
            if let Err(error) = self.nft.cleanup().await {
                tracing::warn!(%error, "cannot remove nftables mode's leftovers");
            }
        }
        Ok(report)
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        self.inner.cleanup().await
    }

    fn recheck_after(&self) -> Option<std::time::Duration> {
        self.inner.recheck_after()
    }
}
