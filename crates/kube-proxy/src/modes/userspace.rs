//! `--proxy-mode userspace`: the relay (`kp-userspace`) with iptables capture. On Linux,
//! `winuserspace` is refused with a pointer to this mode, which runs the same relay.

use anyhow::Context as _;
use kp_dataplane::exec::ExecRunner;
use kp_rules::iptables::NodePortAddresses;
use kp_rules::userspace::{CaptureConfig, DEFAULT_DROP_BIT};
use kp_userspace::iptables::IptablesCapture;
use kp_userspace::{AffinityTables, Capture as _, RelayMetrics, UserspaceBackend};

use super::host::Host;
use super::{Input, Mode};

/// Why `--proxy-mode=winuserspace` does not start here.
pub const WINUSERSPACE_ON_LINUX: &str = "proxy mode \"winuserspace\" is for Windows nodes; on Linux use --proxy-mode=userspace, which runs the same relay with iptables capture";

/// Benchmark switch, comma-separated: `buffers` makes the relay copy through user-space
/// buffers instead of splice(2), `pipe-<KiB>` splices through another pipe size, `nagle`
/// leaves TCP_NODELAY off, so `kp-datapath` compares them with one build. Not a user setting.
pub const COPY_ENV: &str = "KP_RELAY_COPY";

/// Userspace mode as the binary runs it.
pub type UserspaceMode = UserspaceBackend<IptablesCapture<ExecRunner>>;

/// userspace mode.
#[derive(Debug)]
pub struct Userspace;

impl Mode for Userspace {
    type Backend = UserspaceMode;

    fn watch(host: &super::Host) -> Option<kp_dataplane::watch::Owned> {
        super::iptables_on_nf_tables(host).then_some(kp_dataplane::watch::Owned::IptablesChains)
    }

    /// NodePorts answer where iptables mode's would (`nodePortAddresses`, localhost
    /// NodePorts), without needing `route_localnet`: the capture (DNAT to the relay on a node
    /// address, or REDIRECT) keeps loopback traffic on the node.
    fn build(input: Input<'_>) -> anyhow::Result<Self::Backend> {
        Ok(backend(input))
    }

    fn affinity(backend: &Self::Backend) -> Option<AffinityTables> {
        Some(backend.relay().affinity().clone())
    }
}

/// The capture of `host`'s families.
fn capture(
    host: &Host,
    node_port_addresses: NodePortAddresses,
    localhost_node_ports: bool,
) -> IptablesCapture<ExecRunner> {
    let capture = IptablesCapture::new(
        ExecRunner::new(host.iptables.clone()),
        CaptureConfig {
            node_port_addresses,
            localhost_node_ports,
            drop_bit: DEFAULT_DROP_BIT,
        },
        host.families.clone(),
    );
    if super::iptables_on_nf_tables(host) {
        capture
    } else {
        capture.with_nat_size(kp_dataplane::iptables::LegacyNatSize)
    }
}

/// Removes userspace mode's capture chains (`--cleanup`): which chains go depends on the
/// families alone.
pub(crate) async fn remove_leftovers(host: &Host) -> anyhow::Result<()> {
    capture(host, NodePortAddresses::All, false)
        .cleanup()
        .await
        .context("userspace cleanup")
}

fn backend(input: Input<'_>) -> UserspaceMode {
    let (config, node, host) = (input.config, input.node, input.host);
    let capture = capture(
        host,
        node.node_ports.clone(),
        config.iptables.localhost_node_ports,
    );
    let copy = std::env::var(COPY_ENV).unwrap_or_default();
    let switches: Vec<&str> = copy.split(',').map(str::trim).collect();
    let splice = !switches.contains(&"buffers");
    let mut relay = relay_config(config)
        .with_splice(splice)
        .with_nodelay(!switches.contains(&"nagle"));
    if let Some(kib) = switches
        .iter()
        .find_map(|s| s.strip_prefix("pipe-")?.parse::<usize>().ok())
    {
        relay = relay.with_pipe_bytes(kib * 1024);
    }
    tracing::info!(
        splice,
        udp_idle_timeout = ?relay.udp_idle_timeout,
        port_range = ?relay.port_range,
        max_connections_per_service = relay.max_connections,
        max_udp_sessions_per_service = relay.max_udp_sessions,
        pipe_bytes = relay.pipe_bytes,
        buffer_bytes = relay.buffer_bytes,
        nodelay = relay.nodelay,
        "Using userspace Proxier"
    );
    UserspaceBackend::new(
        relay,
        RelayMetrics::register(input.registry),
        capture,
        host.families.clone(),
    )
    .with_node_ips(node.node_ips.clone())
}

pub use crate::app::relay_config;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kp_config::{
        DEFAULT_UDP_IDLE_TIMEOUT, DEFAULT_USERSPACE_MAX_CONNECTIONS_PER_SERVICE,
        DEFAULT_USERSPACE_MAX_UDP_SESSIONS_PER_SERVICE, KubeProxyConfiguration,
    };
    use kp_userspace::config as relay;

    use super::relay_config;

    #[test]
    fn configuration_defaults_are_the_relay_s() {
        let defaults = relay_config(&KubeProxyConfiguration::default());
        assert_eq!(defaults, kp_userspace::RelayConfig::default());
        assert_eq!(DEFAULT_UDP_IDLE_TIMEOUT, relay::DEFAULT_UDP_IDLE_TIMEOUT);
        assert_eq!(
            usize::try_from(DEFAULT_USERSPACE_MAX_CONNECTIONS_PER_SERVICE).ok(),
            Some(relay::DEFAULT_MAX_CONNECTIONS)
        );
        assert_eq!(
            usize::try_from(DEFAULT_USERSPACE_MAX_UDP_SESSIONS_PER_SERVICE).ok(),
            Some(relay::DEFAULT_MAX_UDP_SESSIONS)
        );
    }

    #[test]
    fn configured_values_reach_the_relay() {
        let config = KubeProxyConfiguration::from_yaml(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: userspace
portRange: 30000+10
udpIdleTimeout: 3s
userspace:
  maxConnectionsPerService: 12
  maxUDPSessionsPerService: 34
",
        );
        let config = match config {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        let r = relay_config(&config);
        assert_eq!(r.udp_idle_timeout, Duration::from_secs(3));
        assert_eq!(r.port_range, Some(30000..=30010));
        assert_eq!((r.max_connections, r.max_udp_sessions), (12, 34));
    }
}
