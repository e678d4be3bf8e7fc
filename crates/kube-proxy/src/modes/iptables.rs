//! `--proxy-mode iptables` (the Linux default, and ipvs mode's fallback): upstream's
//! start-up sysctls, then [`IptablesBackend`], which removes nftables mode's tables once its
//! own first sync succeeded.

use anyhow::Context as _;
use kp_config::{KubeProxyConfiguration, LocalMode};
use kp_core::report::ErrorChain as _;
use kp_dataplane::iptables::{IptablesBackend, IptablesConfig, IptablesMetrics};
use kp_dataplane::sysctls;
use kp_rules::iptables::RenderConfig;

use super::host::Host;
use super::nftables::RemovesNftablesLeftovers;
use super::{Input, Mode};

/// iptables mode.
#[derive(Debug)]
pub struct Iptables;

impl Mode for Iptables {
    type Backend = RemovesNftablesLeftovers<IptablesBackend>;

    fn watch(host: &Host) -> Option<kp_dataplane::watch::Owned> {
        super::iptables_on_nf_tables(host).then_some(kp_dataplane::watch::Owned::IptablesChains)
    }

    /// Applies upstream's conntrack sysctls and, with localhost NodePorts, `route_localnet`
    /// (recorded for `--cleanup`), then builds the backend with its metrics registered.
    fn build(input: Input<'_>) -> anyhow::Result<Self::Backend> {
        let (sysctl, mut render) = super::start_kernel_mode(&input)?;
        warn_without_cluster_cidr(input.config);
        let host = input.host;
        render.drop_invalid = !sysctls::tcp_be_liberal(&sysctl);
        match sysctls::apply(
            &sysctl,
            &sysctls::route_localnet_plan(&render, &host.families),
        ) {
            Ok(report) => super::record(&report.applied),
            Err(error) => tracing::error!(
                error = %error.chain(),
                "cannot enable route_localnet; localhost NodePorts will not answer"
            ),
        }
        let tools = host.iptables.clone();
        let version = match &host.iptables_version {
            Some(Ok(version)) => version.as_str(),
            Some(Err(why)) => {
                tracing::warn!(error = %why, "cannot tell the iptables version; using iptables-restore");
                ""
            }
            None => "",
        };
        let netlink = kp_dataplane::iptables::netlink::for_host(&tools, version);
        let mut backend =
            IptablesBackend::new(IptablesConfig::new(host.families.clone(), render), tools)
                .context("invalid iptables configuration")?
                .with_metrics(IptablesMetrics::register(input.registry));
        if let Some(netlink) = netlink {
            backend = backend.with_netlink(netlink);
        }
        if !super::iptables_on_nf_tables(host) {
            backend = backend.with_nat_size(kp_dataplane::iptables::LegacyNatSize);
        }
        tracing::info!("Using iptables Proxier");
        RemovesNftablesLeftovers::new(backend, host)
    }
}

/// Logs that pod traffic cannot be told apart when ClusterCIDR detection has no CIDR (iptables
/// and nftables modes).
pub(super) fn warn_without_cluster_cidr(config: &KubeProxyConfiguration) {
    if config.detect_local_mode == LocalMode::ClusterCidr && config.cluster_cidrs().is_empty() {
        tracing::warn!(
            "clusterCIDR is empty: pod traffic cannot be told apart, so ClusterIP traffic is not masqueraded"
        );
    }
}

/// An iptables backend only for removing iptables mode's chains (`--cleanup`, nftables
/// mode's start): what it removes depends on the families alone, so it needs no
/// configuration, and it registers no metrics.
pub(crate) fn leftovers(host: &Host) -> anyhow::Result<IptablesBackend> {
    IptablesBackend::new(
        IptablesConfig::new(host.families.clone(), RenderConfig::default()),
        host.iptables.clone(),
    )
    .context("invalid iptables configuration")
}
