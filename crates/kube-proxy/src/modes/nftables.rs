//! `--proxy-mode nftables`: [`NftablesBackend`] once `nft` is new enough, plus the removal of
//! iptables mode's chains after the first sync and, with `KubeProxyNFTablesLocalhostNodePorts`,
//! the userspace listeners of localhost NodePorts ([`LocalhostNodePorts`]); and
//! [`RemovesNftablesLeftovers`], which the iptables-based modes wrap themselves in for the
//! opposite move.

use anyhow::Context as _;
use kp_config::KubeProxyConfiguration;
use kp_config::NftablesLayout;
use kp_config::gates::{LOCALHOST_NODE_PORTS_GATE, enabled};
use kp_core::backend::{Backend, BackendError, SyncReport, SyncRequest};
use kp_core::foreign::{Check, ForeignChange};
use kp_core::model::IpFamily;
use kp_core::report::ErrorChain as _;
use kp_dataplane::iptables::IptablesBackend;
use kp_dataplane::nftables::layout::{LayoutBackend, runs_here};
use kp_dataplane::nftables::localhost::LocalhostRejectedPackets;
use kp_dataplane::nftables::{NftablesBackend, NftablesConfig, NftablesMetrics};
use kp_dataplane::watch::Owned;
use kp_rules::config::LocalhostNodePortRejects;
use kp_rules::iptables::RenderConfig;
use kp_userspace::{LocalhostMetrics, LocalhostNodePorts, RelayMetrics};
use prometheus_client::registry::Registry;

use super::host::Host;
use super::socket_lb::{SocketLb, SocketLbMetrics};
use super::{Input, Mode};

/// nftables mode.
#[derive(Debug)]
pub struct Nftables;

impl Mode for Nftables {
    type Backend = NftablesMode;

    fn watch(_host: &Host) -> Option<Owned> {
        Some(Owned::NftablesTable)
    }

    /// The socket load balancer's pins are not nf_tables': checked every `canaryPeriod`.
    fn canaries_while_watched(backend: &Self::Backend) -> bool {
        backend.socket_lb.is_some()
    }

    /// Checks `nft`'s version and applies upstream's conntrack sysctls. nodePortAddresses
    /// defaults to `primary` in this mode ([`crate::node_ips::node_port_addresses`] resolves
    /// it); route_localnet and the conntrack INVALID drop do not exist here, and the rules
    /// never match loopback: localhost NodePorts are the listeners' ([`localhost_listeners`]).
    fn build(input: Input<'_>) -> anyhow::Result<Self::Backend> {
        let host = input.host;
        // Before anything is written: a second proxy on these pins must change nothing.
        let pins = if input.config.socket_lb.enabled {
            super::socket_lb::claim_pins().context("cannot start the socket load balancer")?
        } else {
            None
        };
        check_nft_version(host)?;
        let (_, mut render) = super::start_kernel_mode(&input)?;
        super::iptables::warn_without_cluster_cidr(input.config);
        let layout = match input.config.nftables_layout {
            // Its fixed part is `nft -f` text, which this host's nft may not run.
            NftablesLayout::Maps if !runs_here(&kp_dataplane::nftables::ExecNft::default()) => {
                NftablesLayout::Chains
            }
            layout => layout,
        };
        tracing::info!(layout = %layout, "nftables mode's table layout");
        render.nftables_localhost_rejects = localhost_rejects(input.config, &host.families);
        if render.nftables_localhost_rejects.enabled {
            LocalhostRejectedPackets::register(input.registry, host.families.clone());
        }
        let config = NftablesConfig::new(host.families.clone(), render);
        let metrics = NftablesMetrics::register(input.registry);
        if std::env::var_os(RETIRED_LAYOUT_ENV).is_some() {
            tracing::warn!(
                "${RETIRED_LAYOUT_ENV} is no longer read: --nftables-layout or nftablesLayout in \
                 the configuration choose the layout (maps by default)"
            );
        }
        let nft = match layout {
            NftablesLayout::Maps => Layout::Maps(
                LayoutBackend::with_metrics_registered(config, metrics)
                    .context("invalid nftables configuration")?,
            ),
            NftablesLayout::Chains => Layout::Chains(
                NftablesBackend::with_metrics_registered(config, metrics)
                    .context("invalid nftables configuration")?,
            ),
        };
        let iptables = super::iptables::leftovers(host)?;
        let localhost = localhost_listeners(input.config, &host.families, input.registry);
        tracing::info!("Using nftables Proxier");
        let socket_lb = if input.config.socket_lb.enabled {
            let metrics = SocketLbMetrics::register(input.registry);
            SocketLb::start(&input.config.socket_lb, metrics, pins)
        } else {
            super::socket_lb::remove_pins_logged("--socket-lb is off");
            None
        };
        Ok(NftablesMode {
            nft,
            iptables,
            iptables_cleaned: false,
            localhost,
            socket_lb,
        })
    }
}

/// The variable that chose the layout before `--nftables-layout`; set, it is only warned about.
const RETIRED_LAYOUT_ENV: &str = "KUBE_PROXY_RS_NFTABLES_LAYOUT";

/// What the table rejects of localhost NodePort traffic (KEP-6032): with the gate on, UDP
/// and SCTP, and TCP in the families without listeners ([`explicit_loopback`]); in either
/// layout.
pub(crate) fn localhost_rejects(
    config: &KubeProxyConfiguration,
    families: &[IpFamily],
) -> LocalhostNodePortRejects {
    let enabled = enabled(&config.feature_gates, LOCALHOST_NODE_PORTS_GATE);
    LocalhostNodePortRejects {
        enabled,
        served: if enabled {
            explicit_loopback(config, families)
                .iter()
                .map(IpFamily::of)
                .collect()
        } else {
            Vec::new()
        },
    }
}

/// The loopback addresses of the node's families that `nodePortAddresses` names explicitly
/// (`NodePortAddressesSetting::explicit_loopback`).
fn explicit_loopback(
    config: &KubeProxyConfiguration,
    families: &[IpFamily],
) -> Vec<std::net::IpAddr> {
    config
        .node_port_addresses()
        .explicit_loopback()
        .into_iter()
        .filter(|ip| families.contains(&IpFamily::of(ip)))
        .collect()
}

/// The localhost NodePort listeners (KEP-6032): with the gate on, on the loopback address of
/// each of the node's families whose `nodePortAddresses` name it explicitly
/// (`NodePortAddressesSetting::explicit_loopback`); `None` without any. Read once at start:
/// a restart with another `nodePortAddresses` starts from it afresh.
fn localhost_listeners(
    config: &KubeProxyConfiguration,
    families: &[IpFamily],
    registry: &mut Registry,
) -> Option<LocalhostNodePorts> {
    let loopback = explicit_loopback(config, families);
    if loopback.is_empty() {
        return None;
    }
    if !enabled(&config.feature_gates, LOCALHOST_NODE_PORTS_GATE) {
        tracing::warn!(
            addresses = ?loopback,
            "nodePortAddresses includes localhost but localhost NodePorts are not supported \
             in nftables mode without the {LOCALHOST_NODE_PORTS_GATE} feature gate"
        );
        return None;
    }
    tracing::info!(addresses = ?loopback, "Serving TCP NodePorts on localhost through a userspace listener");
    // The relay's own families are userspace mode's (`kube_proxy_rs_userspace_*`); here only
    // KEP-6032's are served.
    Some(LocalhostNodePorts::new(
        crate::app::relay_config(config),
        RelayMetrics::default(),
        LocalhostMetrics::register(registry),
        loopback,
    ))
}

/// The oldest `nft` upstream's nftables mode accepts.
const MIN_NFT_VERSION: (u32, u32, u32) = (1, 0, 1);

/// Fails unless the host's `nft --version` reports at least [`MIN_NFT_VERSION`], as upstream;
/// a version it cannot read is only a warning.
fn check_nft_version(host: &Host) -> anyhow::Result<()> {
    let text = match &host.nft_version {
        Some(Ok(text)) => text,
        Some(Err(why)) => anyhow::bail!("{why}"),
        None => anyhow::bail!("nft was not probed (a bug: nftables mode probes it)"),
    };
    match parse_nft_version(text) {
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

/// The layout nftables mode writes.
#[derive(Debug)]
pub enum Layout {
    /// One chain per service and endpoint, as upstream (`--nftables-layout=chains`).
    Chains(NftablesBackend),
    /// The verdict-free layout (the default).
    Maps(LayoutBackend),
}

impl Backend for Layout {
    fn mode(&self) -> &'static str {
        match self {
            Layout::Chains(b) => b.mode(),
            Layout::Maps(b) => b.mode(),
        }
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        match self {
            Layout::Chains(b) => b.sync(request).await,
            Layout::Maps(b) => b.sync(request).await,
        }
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        match self {
            Layout::Chains(b) => b.cleanup().await,
            Layout::Maps(b) => b.cleanup().await,
        }
    }

    async fn verify(&mut self, check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        match self {
            Layout::Chains(b) => b.verify(check).await,
            Layout::Maps(b) => b.verify(check).await,
        }
    }

    fn kernel_changed_behind_our_back(&mut self) {
        match self {
            Layout::Chains(b) => b.kernel_changed_behind_our_back(),
            Layout::Maps(b) => b.kernel_changed_behind_our_back(),
        }
    }
}

/// nftables mode as the binary runs it: the [`Layout`] chosen, the localhost NodePort
/// listeners when configured, plus iptables mode's cleanup.
/// As upstream, a normal start removes iptables mode's chains once the first nftables sync
/// succeeded (errors there are only logged), so a node switched from iptables mode does not
/// run both. (`--cleanup` removes every mode's state through [`crate::cleanup`].) With
/// `--socket-lb`, the socket load balancer's maps follow every sync, whatever nftables'
/// outcome: they serve sockets nftables mode's rules would serve the same way.
#[derive(Debug)]
pub struct NftablesMode {
    nft: Layout,
    iptables: IptablesBackend,
    iptables_cleaned: bool,
    localhost: Option<LocalhostNodePorts>,
    socket_lb: Option<SocketLb>,
}

impl Backend for NftablesMode {
    fn mode(&self) -> &'static str {
        self.nft.mode()
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        // The listeners need no rules: they follow the state even when the rules fail.
        if let Some(localhost) = &mut self.localhost {
            localhost.sync(request.state);
        }
        // Look for iptables mode's leftovers before the first sync (cheap while the nftables
        // table is small, see `cleanup_plan`), remove them after it succeeded.
        let plan = if self.iptables_cleaned {
            None
        } else {
            Some(self.iptables.cleanup_plan().await)
        };
        let report = self.nft.sync(request).await;
        if let Some(socket_lb) = &mut self.socket_lb {
            socket_lb.sync(request);
        }
        let report = report?;
        if let Some(plan) = plan {
            self.iptables_cleaned = true;
            if plan.is_empty() {
                return Ok(report);
            }
            if let Err(error) = self.iptables.apply_cleanup(plan).await {
                tracing::warn!(error = %error.chain(), "cannot remove iptables mode's leftovers");
            }
        }
        Ok(report)
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let nft = self.nft.cleanup().await;
        let iptables = self.iptables.cleanup().await;
        nft.and(iptables)
    }

    async fn verify(&mut self, check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        let mut changes = self.nft.verify(check).await?;
        if let Some(socket_lb) = &mut self.socket_lb {
            changes.extend(socket_lb.verify(check));
        }
        Ok(changes)
    }

    fn kernel_changed_behind_our_back(&mut self) {
        self.nft.kernel_changed_behind_our_back();
    }
}

/// An nftables backend only for removing nftables mode's tables (`--cleanup`, the
/// iptables-based modes' start): one `kube-proxy` table per family, whatever the
/// configuration; it registers no metrics.
pub(crate) fn leftovers(host: &Host) -> anyhow::Result<NftablesBackend> {
    NftablesBackend::new(NftablesConfig::new(
        host.families.clone(),
        RenderConfig::default(),
    ))
    .context("invalid nftables configuration")
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
    /// `inner`, which removes nftables mode's tables of `host`'s families after its first
    /// sync.
    pub fn new(inner: B, host: &Host) -> anyhow::Result<Self> {
        Ok(Self {
            inner,
            nft: leftovers(host)?,
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
                tracing::warn!(error = %error.chain(), "cannot remove nftables mode's leftovers");
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

    async fn verify(&mut self, check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        self.inner.verify(check).await
    }

    fn kernel_changed_behind_our_back(&mut self) {
        self.inner.kernel_changed_behind_our_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modes::host::ProbeError;

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
    fn the_probed_nft_decides_whether_nftables_mode_starts() {
        let host = |answer: Result<&str, ProbeError>| Host {
            nft_version: Some(answer.map(str::to_owned)),
            ..Host::default()
        };
        assert!(check_nft_version(&host(Ok("nftables v1.0.6 (Lester Gooch #5)"))).is_ok());
        let old = check_nft_version(&host(Ok("nftables v0.9.8 (E.D.S.)"))).expect_err("too old");
        assert!(old.to_string().contains("nft >= 1.0.1"), "{old}");
        // A version it cannot read does not stop the proxy.
        assert!(check_nft_version(&host(Ok("nftables (unknown)"))).is_ok());
        let missing = check_nft_version(&host(Err(ProbeError::NoNft(
            std::io::ErrorKind::NotFound.into(),
        ))))
        .expect_err("no nft");
        assert!(
            missing.to_string().contains("package nftables"),
            "{missing}"
        );
        assert!(check_nft_version(&Host::default()).is_err());
    }
}
