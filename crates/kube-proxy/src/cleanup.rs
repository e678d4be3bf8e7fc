//! `--cleanup` as upstream's: whatever mode is configured, every kernel mode's state goes
//! (iptables mode's chains, userspace mode's capture chains, IPVS virtual servers with
//! kube-ipvs0 and the ipsets, the nftables tables), so a node can move between modes in any
//! direction. Every part is tried even when an earlier one failed; the first error is the
//! result.

use kp_config::KubeProxyConfiguration;
use kp_core::backend::{Backend, BackendError, SyncReport, SyncRequest};
use kp_dataplane::nftables::{NftablesBackend, NftablesConfig};
use prometheus_client::registry::Registry;

use crate::ipvs_mode::{self, RealIpvsBackend};
use crate::modes;
use crate::userspace::{self, UserspaceMode};

/// Every kernel mode's cleanup, in upstream's order (iptables, ipvs, nftables).
pub struct CleanupAll {
    iptables: kp_dataplane::iptables::IptablesBackend,
    userspace: UserspaceMode,
    /// `None` when the kernel has no IPVS: then there is nothing of ipvs mode to remove.
    ipvs: Option<RealIpvsBackend>,
    nftables: NftablesBackend,
}

/// The cleanups of every mode, built without touching the kernel.
pub fn build(
    config: &KubeProxyConfiguration,
    node: &modes::NodeAddressing,
    registry: &mut Registry,
) -> anyhow::Result<CleanupAll> {
    tracing::info!(
        "--cleanup: removing the state of every mode (iptables, userspace, ipvs, nftables)"
    );
    let iptables = modes::iptables(config, node, registry, true)?;
    let userspace = userspace::backend(config, node, registry);
    let ipvs = match ipvs_mode::build(config, node, true)? {
        Ok(backend) => Some(backend),
        Err(why) => {
            tracing::info!(reason = %why, "no IPVS here: nothing of ipvs mode to clean up");
            None
        }
    };
    let render = modes::render_config(config, None, node)?;
    let nftables = NftablesBackend::new(NftablesConfig::new(
        kp_dataplane::iptables::detect_families(),
        render,
    ))
    .map_err(|e| anyhow::anyhow!("invalid nftables configuration: {e}"))?;
    Ok(CleanupAll {
        iptables,
        userspace,
        ipvs,
        nftables,
    })
}

impl Backend for CleanupAll {
    fn mode(&self) -> &'static str {
        "cleanup"
    }

    /// Never called: `--cleanup` runs [`Backend::cleanup`] and exits.
    async fn sync(&mut self, _request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        Err(BackendError::Apply {
            what: "--cleanup".to_owned(),
            message: "this backend only cleans up".to_owned(),
        })
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let mut results = vec![
            self.iptables.cleanup().await,
            self.userspace.cleanup().await,
        ];
        if let Some(ipvs) = &mut self.ipvs {
            results.push(ipvs.cleanup().await);
        }
        results.push(self.nftables.cleanup().await);
        results
            .into_iter()
            .collect::<Result<Vec<()>, _>>()
            .map(drop)
    }
}
