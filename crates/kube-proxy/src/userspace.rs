//! Building userspace mode: the relay (`kp-userspace`) with iptables capture. On Linux,
//! `winuserspace` is refused with a pointer to this mode, which runs the same relay.

use kp_config::KubeProxyConfiguration;
use kp_dataplane::exec::{ExecRunner, IptablesVariant, Tools};
use kp_dataplane::iptables::detect_families;
use kp_rules::userspace::{CaptureConfig, DEFAULT_DROP_BIT};
use kp_userspace::iptables::IptablesCapture;
use kp_userspace::{RelayConfig, RelayMetrics, UserspaceBackend};
use prometheus_client::registry::Registry;

/// Why `--proxy-mode=winuserspace` does not start here.
pub const WINUSERSPACE_ON_LINUX: &str = "proxy mode \"winuserspace\" is for Windows nodes; on Linux use --proxy-mode=userspace, which runs the same relay with iptables capture";

/// Benchmark switch: `KP_RELAY_COPY=buffers` makes the relay copy through user-space buffers
/// instead of splice(2), `KP_RELAY_COPY=pipe-<KiB>` splices through another pipe size, so
/// `kp-datapath` compares them with one build. Not a user setting.
pub const COPY_ENV: &str = "KP_RELAY_COPY";

/// Userspace mode as the binary runs it.
pub type UserspaceMode = UserspaceBackend<IptablesCapture<ExecRunner>>;

/// Builds userspace mode. NodePorts answer where iptables mode's would
/// (`nodePortAddresses`, localhost NodePorts), without needing `route_localnet`: the
/// redirect keeps loopback traffic on the node.
pub fn backend(config: &KubeProxyConfiguration, registry: &mut Registry) -> UserspaceMode {
    let families = detect_families();
    let capture = IptablesCapture::new(
        ExecRunner::new(Tools::new(IptablesVariant::System)),
        CaptureConfig {
            node_port_addresses: crate::modes::node_port_addresses(config),
            localhost_node_ports: config.iptables.localhost_node_ports,
            drop_bit: DEFAULT_DROP_BIT,
        },
        families.clone(),
    );
    let copy = std::env::var(COPY_ENV).unwrap_or_default();
    let splice = copy != "buffers";
    let mut relay = RelayConfig::default().with_splice(splice);
    // `KP_RELAY_COPY=pipe-<KiB>`: a larger splice pipe, for the benchmark's comparison.
    if let Some(kib) = copy
        .strip_prefix("pipe-")
        .and_then(|k| k.parse::<usize>().ok())
    {
        relay = relay.with_buffer_bytes(kib * 1024);
    }
    tracing::info!(
        splice,
        buffer_bytes = relay.buffer_bytes,
        "Using userspace Proxier"
    );
    UserspaceBackend::new(relay, RelayMetrics::register(registry), capture, families)
}
