//! `--cleanup` as upstream's: whatever mode is configured, every kernel mode's state goes
//! (iptables mode's chains, userspace mode's capture chains, IPVS virtual servers with
//! kube-ipvs0 and the ipsets where the kernel has IPVS, the nftables tables, the socket load
//! balancer's pinned programs and maps), so a node can
//! move between modes in any direction; then the kernel settings this proxy changed are put
//! back. Every part is tried even when an earlier one failed; the first error is the result.
//! Nothing here needs the API server or the node's IPs.

use kp_config::KubeProxyConfiguration;
use kp_core::backend::Backend as _;

use crate::modes::{self, Host};

/// Removes every kernel mode's state, in upstream's order (iptables, ipvs, nftables; userspace
/// mode's capture chains after iptables mode's), then restores the recorded sysctls. `host`
/// was probed for [`modes::host::Task::Cleanup`]. Fake mode programmed nothing, so there is
/// nothing to remove.
pub async fn run(config: &KubeProxyConfiguration, host: &Host) -> anyhow::Result<()> {
    if !modes::host::programs_the_kernel(config.mode()) {
        return modes::fake::DryRun.cleanup().await.map_err(Into::into);
    }
    tracing::info!(
        "--cleanup: removing the state of every mode (iptables, userspace, ipvs, nftables)"
    );
    let mut results: Vec<anyhow::Result<()>> = Vec::new();
    results.push(match modes::iptables::leftovers(host) {
        Ok(mut iptables) => iptables.cleanup().await.map_err(Into::into),
        Err(error) => Err(error),
    });
    results.push(modes::userspace::remove_leftovers(host).await);
    results.push(match modes::ipvs::leftovers(config, host) {
        Ok(Some(mut ipvs)) => ipvs.cleanup().await.map_err(Into::into),
        Ok(None) => Ok(()),
        Err(error) => Err(error),
    });
    results.push(match modes::nftables::leftovers(host) {
        Ok(mut nftables) => nftables.cleanup().await.map_err(Into::into),
        Err(error) => Err(error),
    });
    results.push(
        modes::socket_lb::remove_pins()
            .map(|pins| tracing::info!(pins, "Socket load balancer's pins removed"))
            .map_err(Into::into),
    );
    // After the rules: a restored route_localnet must not outlive the rules that needed it.
    results.push(modes::restore_sysctls());
    let mut first = None;
    for result in results {
        if let Err(error) = result {
            match first {
                None => first = Some(error),
                Some(_) => tracing::error!("{}", kp_core::report::Chain(error.as_ref())),
            }
        }
    }
    match first {
        Some(error) => Err(error.context("cleanup")),
        None => {
            tracing::info!("Cleanup done");
            Ok(())
        }
    }
}
