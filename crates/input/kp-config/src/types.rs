//! The effective `KubeProxyConfiguration`: upstream's v1alpha1 fields with defaults applied.
//!
//! Field names, nesting and serialized spelling follow
//! `kubeproxy.config.k8s.io/v1alpha1` so that `--write-config-to` output is a file upstream
//! kube-proxy (and this crate) reads back. Values are kept in upstream's shapes (addresses and
//! CIDRs as strings); the typed accessors at the bottom parse them for callers once the
//! configuration has been validated.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use serde::Serialize;

use crate::duration::serde_go;
pub use crate::iptables_backend::IptablesBackend;
pub use crate::nftables_layout::NftablesLayout;

/// The only `apiVersion` upstream has ever shipped for this kind.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The `kind` of a kube-proxy configuration file.
pub const KIND: &str = "KubeProxyConfiguration";

/// Protobuf is much cheaper than JSON to decode for the high-volume EndpointSlice watch.
pub const DEFAULT_CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";
/// client-go's conservative rate; kube-proxy mostly watches, so it rarely needs more.
pub const DEFAULT_QPS: f32 = 5.0;
/// Allows a short burst of requests at start-up (initial lists) above `DEFAULT_QPS`.
pub const DEFAULT_BURST: i32 = 10;
/// component-base's default: flushing buffered logs every few seconds bounds log loss on crash.
pub const DEFAULT_LOG_FLUSH_FREQUENCY: Duration = Duration::from_secs(5);
/// klog's human-readable format; `json` must be chosen explicitly.
pub const DEFAULT_LOG_FORMAT: &str = "text";
/// Zero means "no extra buffering" for the split-stream info logs (a resource quantity).
pub const DEFAULT_LOG_INFO_BUFFER_SIZE: &str = "0";
/// The unspecified IPv4 address: "use the node's primary IP" rather than a specific one.
pub const DEFAULT_BIND_ADDRESS: &str = "0.0.0.0";
/// Well-known port cloud load balancers probe for node health (upstream `ProxyHealthzPort`).
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// Well-known metrics port (upstream `ProxyStatusPort`) that monitoring stacks scrape.
pub const DEFAULT_METRICS_PORT: u16 = 10249;
/// Health checks come from outside the node, so listen on every IPv4 address.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: &str = "0.0.0.0:10256";
/// The IPv6 form of `DEFAULT_HEALTHZ_BIND_ADDRESS`, used when `bindAddress` is IPv6.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS_V6: &str = "[::]:10256";
/// Metrics (and `/configz`) reveal cluster details, so only localhost by default.
pub const DEFAULT_METRICS_BIND_ADDRESS: &str = "127.0.0.1:10249";
/// The IPv6 form of `DEFAULT_METRICS_BIND_ADDRESS`, used when `bindAddress` is IPv6.
pub const DEFAULT_METRICS_BIND_ADDRESS_V6: &str = "[::1]:10249";
/// Bit 14 of the fwmark is the one kubelet and kube-proxy agree on for "needs SNAT".
pub const DEFAULT_MASQUERADE_BIT: i32 = 14;
/// Full resync interval: repairs rules that something else changed behind our back.
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// Batches bursts of endpoint changes into one `iptables-restore` / `nft` run.
pub const DEFAULT_IPTABLES_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
/// Same batching rationale as iptables; nftables upstream copies the iptables default.
pub const DEFAULT_NFTABLES_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
/// IPVS updates are incremental netlink calls, so upstream does not rate-limit them.
pub const DEFAULT_IPVS_MIN_SYNC_PERIOD: Duration = Duration::ZERO;
/// Round-robin: what the empty `ipvs.scheduler` means, and what IPVS users expect.
pub const DEFAULT_IPVS_SCHEDULER: &str = "rr";
/// NodePorts on 127.0.0.1 keep working by default, as they always have with iptables.
pub const DEFAULT_LOCALHOST_NODE_PORTS: bool = true;
/// Node infrastructure: the OOM killer should pick almost anything else first.
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
/// Scales the conntrack table with the node's CPUs (each core can drive many flows).
pub const DEFAULT_CONNTRACK_MAX_PER_CORE: i32 = 32 * 1024;
/// Floor for the conntrack table on small nodes.
pub const DEFAULT_CONNTRACK_MIN: i32 = 128 * 1024;
/// A fifth of the kernel's 5-day default, so dead TCP flows give their table slot back sooner.
pub const DEFAULT_CONNTRACK_TCP_ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// The kernel's own CLOSE_WAIT timeout; kube-proxy pins it so nodes behave alike.
pub const DEFAULT_CONNTRACK_TCP_CLOSE_WAIT_TIMEOUT: Duration = Duration::from_secs(3600);
/// Informer resync: rare, since watches deliver every change anyway.
pub const DEFAULT_CONFIG_SYNC_PERIOD: Duration = Duration::from_secs(15 * 60);
pub use crate::nodeport::{
    NODE_PORT_ADDRESSES_ALL, NODE_PORT_ADDRESSES_LOCALHOST, NODE_PORT_ADDRESSES_PRIMARY,
    NodePortAddress, NodePortAddressesSetting,
};
/// Upstream's `--udp-timeout` default for its userspace proxy: a UDP session holds a socket
/// and a task, and most UDP exchanges in a cluster (DNS) are over in milliseconds.
pub const DEFAULT_UDP_IDLE_TIMEOUT: Duration = Duration::from_millis(250);

/// kube-proxy-rs's default `canaryPeriod`: where the kernel does not notify changes
/// (iptables-legacy, IPVS), rules another program removed are found within this. Upstream
/// looks at its canary chains once per `syncPeriod` (30 s).
pub const DEFAULT_CANARY_PERIOD: Duration = Duration::from_secs(2);
/// kube-proxy-rs extension, userspace mode: open TCP connections per Service (all its ports,
/// families and scopes). Each holds six descriptors (two sockets, two pipes), so one service
/// at the cap holds about 24k; the cap keeps it from taking what every other service needs.
pub const DEFAULT_USERSPACE_MAX_CONNECTIONS_PER_SERVICE: i32 = 4096;
/// kube-proxy-rs extension, userspace mode: live UDP sessions per Service, for the same
/// reason (each holds a socket and a task).
pub const DEFAULT_USERSPACE_MAX_UDP_SESSIONS_PER_SERVICE: i32 = 4096;
/// IPVS schedulers kube-proxy accepts (`mh` is Maglev, kernel >= 4.18).
pub const IPVS_SCHEDULERS: &[&str] = &[
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh",
];

/// How Services are programmed into the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyMode {
    /// iptables NAT rules (the Linux default).
    Iptables,
    /// IPVS virtual servers plus ipsets (deprecated upstream).
    Ipvs,
    /// nftables `ip`/`ip6 kube-proxy` tables.
    Nftables,
    /// Windows HNS load balancers.
    Kernelspace,
    /// Historical userspace proxy (removed upstream in 1.26); accepted for old files.
    Userspace,
    /// Historical Windows userspace proxy; accepted for old files.
    Winuserspace,
    /// Ours: programs nothing and records syncs, for tests and dry runs.
    Fake,
}

impl ProxyMode {
    /// Every accepted mode, in the order help texts list them.
    pub const ALL: [ProxyMode; 7] = [
        ProxyMode::Iptables,
        ProxyMode::Ipvs,
        ProxyMode::Nftables,
        ProxyMode::Kernelspace,
        ProxyMode::Userspace,
        ProxyMode::Winuserspace,
        ProxyMode::Fake,
    ];

    /// What an empty `mode` means on this OS, as upstream: iptables, or kernelspace on Windows.
    pub fn platform_default() -> ProxyMode {
        if cfg!(windows) {
            ProxyMode::Kernelspace
        } else {
            ProxyMode::Iptables
        }
    }

    /// The spelling used in files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Iptables => "iptables",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Nftables => "nftables",
            ProxyMode::Kernelspace => "kernelspace",
            ProxyMode::Userspace => "userspace",
            ProxyMode::Winuserspace => "winuserspace",
            ProxyMode::Fake => "fake",
        }
    }
}

impl Default for ProxyMode {
    fn default() -> Self {
        ProxyMode::platform_default()
    }
}

impl fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ProxyMode {
    type Err = String;

    /// Exact, case-sensitive names as upstream; the empty string is the platform default.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Ok(ProxyMode::platform_default());
        }
        ProxyMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown proxy mode; expected one of {}", mode_list()))
    }
}

fn mode_list() -> String {
    ProxyMode::ALL.map(ProxyMode::as_str).join(", ")
}

/// How traffic from local pods is told apart from traffic from elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
pub enum LocalMode {
    /// Source inside `clusterCIDR` (the default).
    #[default]
    #[serde(rename = "ClusterCIDR")]
    ClusterCidr,
    /// Source inside the Node object's `podCIDR`s.
    #[serde(rename = "NodeCIDR")]
    NodeCidr,
    /// Arrives on `detectLocal.bridgeInterface`.
    BridgeInterface,
    /// Arrives on an interface whose name starts with `detectLocal.interfaceNamePrefix`.
    InterfaceNamePrefix,
}

impl LocalMode {
    /// Every accepted mode.
    pub const ALL: [LocalMode; 4] = [
        LocalMode::ClusterCidr,
        LocalMode::NodeCidr,
        LocalMode::BridgeInterface,
        LocalMode::InterfaceNamePrefix,
    ];

    /// The spelling used in files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            LocalMode::ClusterCidr => "ClusterCIDR",
            LocalMode::NodeCidr => "NodeCIDR",
            LocalMode::BridgeInterface => "BridgeInterface",
            LocalMode::InterfaceNamePrefix => "InterfaceNamePrefix",
        }
    }
}

impl fmt::Display for LocalMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for LocalMode {
    type Err = String;

    /// Exact names as upstream; the empty string means `ClusterCIDR`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Ok(LocalMode::default());
        }
        LocalMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                let names = LocalMode::ALL.map(LocalMode::as_str).join(", ");
                format!("unknown local traffic detection mode; expected one of {names}")
            })
    }
}

/// The whole kube-proxy configuration, as upstream's v1alpha1 `KubeProxyConfiguration`.
///
/// `Default` is upstream's defaulted object. Three defaults depend on other fields and are
/// filled in when a configuration is loaded: `healthzBindAddress` and `metricsBindAddress`
/// (IPv4 or IPv6 by `bindAddress`) and `nodePortAddresses` (`["primary"]` in nftables mode).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    /// Feature gate overrides, name to enabled.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub feature_gates: BTreeMap<String, bool>,
    /// How to reach the API server.
    pub client_connection: ClientConnection,
    /// Log format and verbosity.
    pub logging: Logging,
    /// Node name to use instead of the host name; empty means the host name.
    pub hostname_override: String,
    /// Overrides the node's primary IP for rule programming; no socket is bound to it.
    pub bind_address: String,
    /// `IP:port` of the proxy health server; `""` disables it; `None` until defaults are
    /// completed (then derived from `bindAddress`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub healthz_bind_address: Option<String>,
    /// `IP:port` of the metrics server; `""` disables it; `None` as for the health server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_bind_address: Option<String>,
    /// Exit instead of retrying when the health or metrics port cannot be bound.
    pub bind_address_hard_fail: bool,
    /// Serve `/debug/pprof`-style handlers on the metrics server.
    pub enable_profiling: bool,
    /// Previous version whose hidden metrics should still be shown.
    pub show_hidden_metrics_for_version: String,
    /// Only handle Services labelled `service.kubernetes.io/service-proxy-name` with this value.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service_proxy_name: String,
    /// Which proxier programs the node.
    pub mode: ProxyMode,
    /// Neither `mode` (non-empty) nor `--proxy-mode` chose the mode: upstream 1.37 warns that
    /// the Linux default is moving to nftables (kubernetes#139957). Not part of the file.
    #[serde(skip)]
    pub mode_defaulted: bool,
    /// iptables mode settings.
    pub iptables: IptablesConfiguration,
    /// IPVS mode settings.
    pub ipvs: IpvsConfiguration,
    /// nftables mode settings.
    pub nftables: NftablesConfiguration,
    /// Windows (kernelspace) settings.
    pub winkernel: WinkernelConfiguration,
    /// How local pod traffic is detected.
    pub detect_local_mode: LocalMode,
    /// Inputs for the interface-based detection modes.
    pub detect_local: DetectLocalConfiguration,
    /// Pod CIDR(s) of the cluster: one CIDR, or an IPv4,IPv6 pair; may be empty.
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: String,
    /// CIDRs and keywords (`primary`, `localhost`, `all`) of the node addresses NodePorts
    /// answer on ([`NodePortAddressesSetting`]); `None` is all.
    pub node_port_addresses: Option<Vec<String>>,
    /// oom_score_adj for the kube-proxy process, -1000..1000.
    pub oom_score_adj: i32,
    /// Conntrack sysctls to set at start-up.
    pub conntrack: ConntrackConfiguration,
    /// Informer resync period.
    #[serde(with = "serde_go")]
    pub config_sync_period: Duration,
    /// Userspace mode: the host ports the relay listens on, as upstream's
    /// `--proxy-port-range` (`BEGIN-END`, `BASE+SIZE` or one port); empty, `0` or `0-0` let
    /// the kernel pick ephemeral ports.
    pub port_range: String,
    /// Userspace mode: how long a UDP session without traffic either way lives (upstream's
    /// `udpIdleTimeout`). Written only when not the default, as upstream no longer has it.
    #[serde(with = "serde_go", skip_serializing_if = "is_default_udp_idle_timeout")]
    pub udp_idle_timeout: Duration,
    /// Windows only: run as a Windows service (upstream's `windowsRunAsService`, which
    /// upstream also omits when false).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub windows_run_as_service: bool,
    /// kube-proxy-rs extension: userspace mode's per-Service caps. Written only when not the
    /// default, so other files stay readable by upstream.
    #[serde(skip_serializing_if = "UserspaceConfiguration::is_default")]
    pub userspace: UserspaceConfiguration,
    /// kube-proxy-rs extension: the iptables backend (`auto` detects the node's; see
    /// [`IptablesBackend`]). Written only when set.
    #[serde(skip_serializing_if = "IptablesBackend::is_auto")]
    pub iptables_backend: IptablesBackend,
    /// kube-proxy-rs extension: the layout nftables mode writes (see [`NftablesLayout`]).
    /// Written only when not the default.
    #[serde(skip_serializing_if = "NftablesLayout::is_default")]
    pub nftables_layout: NftablesLayout,
    /// kube-proxy-rs extension: how often the proxy checks that the kernel still holds its
    /// rules where no change notification exists (`0s`: only before each periodic sync).
    /// Written only when not the default.
    #[serde(with = "serde_go", skip_serializing_if = "is_default_canary_period")]
    pub canary_period: Duration,
    /// kube-proxy-rs extension: socket-level load balancing beside nftables mode
    /// (docs/socket-lb.md). Written only when not the default.
    #[serde(
        rename = "socketLB",
        skip_serializing_if = "SocketLbConfiguration::is_default"
    )]
    pub socket_lb: SocketLbConfiguration,
}

/// kube-proxy-rs extension (`socketLB`): cgroup BPF programs that send the node's own
/// sockets' connections to Service addresses straight to an endpoint (nftables mode only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SocketLbConfiguration {
    /// Load and attach the programs (`--socket-lb`).
    pub enabled: bool,
    /// The cgroup v2 directory to attach to (`--socket-lb-cgroup`); empty: the root of the
    /// node's cgroup v2 hierarchy, mounted privately where the node has only cgroup v1.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub cgroup: String,
}

impl SocketLbConfiguration {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

fn is_default_canary_period(period: &Duration) -> bool {
    *period == DEFAULT_CANARY_PERIOD
}

fn is_default_udp_idle_timeout(timeout: &Duration) -> bool {
    *timeout == DEFAULT_UDP_IDLE_TIMEOUT
}

/// kube-proxy-rs extension: limits of userspace mode's relay that keep the node safe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UserspaceConfiguration {
    /// Open TCP connections per Service; more are reset and counted.
    pub max_connections_per_service: i32,
    /// Live UDP sessions per Service; datagrams of further clients are dropped and counted.
    #[serde(rename = "maxUDPSessionsPerService")]
    pub max_udp_sessions_per_service: i32,
}

impl Default for UserspaceConfiguration {
    fn default() -> Self {
        UserspaceConfiguration {
            max_connections_per_service: DEFAULT_USERSPACE_MAX_CONNECTIONS_PER_SERVICE,
            max_udp_sessions_per_service: DEFAULT_USERSPACE_MAX_UDP_SESSIONS_PER_SERVICE,
        }
    }
}

impl UserspaceConfiguration {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// API server client settings (component-base `ClientConnectionConfiguration`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnection {
    /// Path to a kubeconfig; empty means in-cluster configuration.
    pub kubeconfig: String,
    /// `Accept` header for requests.
    pub accept_content_types: String,
    /// Content type of requests.
    pub content_type: String,
    /// Sustained request rate.
    pub qps: f32,
    /// Request burst above `qps`.
    pub burst: i32,
}

/// component-base `LoggingConfiguration`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Logging {
    /// `text` or `json`.
    pub format: String,
    /// How often buffered logs are flushed.
    #[serde(with = "serde_go")]
    pub flush_frequency: Duration,
    /// klog verbosity (`-v`).
    pub verbosity: u32,
    /// Per-file verbosity overrides (`--vmodule`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub vmodule: Vec<VModuleItem>,
    /// Format-specific options.
    pub options: LoggingOptions,
}

/// One `--vmodule` entry: files matching `filePattern` log at `verbosity`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VModuleItem {
    /// Glob over source file names, without extension.
    pub file_pattern: String,
    /// Verbosity for matching files.
    pub verbosity: u32,
}

/// Options of the `text` and `json` log formats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct LoggingOptions {
    /// JSON format options.
    pub json: LogFormatOptions,
    /// Text format options.
    pub text: LogFormatOptions,
}

/// Per-format log output options.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LogFormatOptions {
    /// Write errors to stderr and info to (buffered) stdout.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub split_stream: bool,
    /// Buffer size for the info stream when split, as a resource quantity (`"0"`, `"64Ki"`).
    pub info_buffer_size: String,
}

/// iptables mode settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IptablesConfiguration {
    /// fwmark bit marking packets that need SNAT, 0..31.
    pub masquerade_bit: i32,
    /// SNAT all Service traffic, not only traffic that needs it.
    pub masquerade_all: bool,
    /// Allow NodePorts on 127.0.0.1 (IPv4 only; sets `route_localnet`).
    pub localhost_node_ports: bool,
    /// Full resync interval.
    #[serde(with = "serde_go")]
    pub sync_period: Duration,
    /// Minimum gap between syncs.
    #[serde(with = "serde_go")]
    pub min_sync_period: Duration,
}

/// IPVS mode settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IpvsConfiguration {
    /// Full resync interval.
    #[serde(with = "serde_go")]
    pub sync_period: Duration,
    /// Minimum gap between syncs.
    #[serde(with = "serde_go")]
    pub min_sync_period: Duration,
    /// IPVS scheduler; empty means `rr`.
    pub scheduler: String,
    /// Virtual servers inside these CIDRs are never deleted by cleanup.
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    /// Set `arp_ignore=1`/`arp_announce=2` so only the owning interface answers ARP.
    #[serde(rename = "strictARP")]
    pub strict_arp: bool,
    /// IPVS TCP session timeout; 0 leaves the kernel's value.
    #[serde(with = "serde_go")]
    pub tcp_timeout: Duration,
    /// IPVS TCP FIN_WAIT timeout; 0 leaves the kernel's value.
    #[serde(with = "serde_go")]
    pub tcp_fin_timeout: Duration,
    /// IPVS UDP timeout; 0 leaves the kernel's value.
    #[serde(with = "serde_go")]
    pub udp_timeout: Duration,
}

/// nftables mode settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NftablesConfiguration {
    /// fwmark bit marking packets that need SNAT, 0..31.
    pub masquerade_bit: i32,
    /// SNAT all Service traffic, not only traffic that needs it.
    pub masquerade_all: bool,
    /// Full resync interval.
    #[serde(with = "serde_go")]
    pub sync_period: Duration,
    /// Minimum gap between syncs.
    #[serde(with = "serde_go")]
    pub min_sync_period: Duration,
    /// Name of the `ip`/`ip6` tables (newest upstream only); empty means `kube-proxy`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub table_name: String,
}

/// Windows HNS settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct WinkernelConfiguration {
    /// HNS network name.
    pub network_name: String,
    /// Source VIP for load balancers.
    pub source_vip: String,
    /// Direct server return.
    #[serde(rename = "enableDSR")]
    pub enable_dsr: bool,
    /// Host endpoint name for the root network namespace.
    pub root_hns_endpoint_name: String,
    /// Forward health-check VIP traffic.
    pub forward_health_check_vip: bool,
}

/// Inputs for interface-based local traffic detection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocalConfiguration {
    /// Bridge that local pod traffic arrives on (`BridgeInterface` mode).
    pub bridge_interface: String,
    /// Prefix of pod interface names (`InterfaceNamePrefix` mode).
    pub interface_name_prefix: String,
}

/// Conntrack sysctls kube-proxy sets at start-up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackConfiguration {
    /// `nf_conntrack_max` per CPU; 0 leaves the table size alone.
    pub max_per_core: i32,
    /// Lower bound for `nf_conntrack_max`.
    pub min: i32,
    /// `nf_conntrack_tcp_timeout_established`; 0 leaves it alone.
    #[serde(with = "serde_go")]
    pub tcp_established_timeout: Duration,
    /// `nf_conntrack_tcp_timeout_close_wait`; 0 leaves it alone.
    #[serde(with = "serde_go")]
    pub tcp_close_wait_timeout: Duration,
    /// Set `nf_conntrack_tcp_be_liberal` (and skip the INVALID-drop rule).
    pub tcp_be_liberal: bool,
    /// `nf_conntrack_udp_timeout`; 0 leaves it alone.
    #[serde(with = "serde_go")]
    pub udp_timeout: Duration,
    /// `nf_conntrack_udp_timeout_stream`; 0 leaves it alone.
    #[serde(with = "serde_go")]
    pub udp_stream_timeout: Duration,
}

impl Default for KubeProxyConfiguration {
    fn default() -> Self {
        KubeProxyConfiguration {
            feature_gates: BTreeMap::new(),
            client_connection: ClientConnection::default(),
            logging: Logging::default(),
            hostname_override: String::new(),
            bind_address: DEFAULT_BIND_ADDRESS.to_owned(),
            healthz_bind_address: None,
            metrics_bind_address: None,
            bind_address_hard_fail: false,
            enable_profiling: false,
            show_hidden_metrics_for_version: String::new(),
            service_proxy_name: String::new(),
            mode: ProxyMode::default(),
            mode_defaulted: true,
            iptables: IptablesConfiguration::default(),
            ipvs: IpvsConfiguration::default(),
            nftables: NftablesConfiguration::default(),
            winkernel: WinkernelConfiguration::default(),
            detect_local_mode: LocalMode::default(),
            detect_local: DetectLocalConfiguration::default(),
            cluster_cidr: String::new(),
            node_port_addresses: None,
            oom_score_adj: DEFAULT_OOM_SCORE_ADJ,
            conntrack: ConntrackConfiguration::default(),
            config_sync_period: DEFAULT_CONFIG_SYNC_PERIOD,
            port_range: String::new(),
            udp_idle_timeout: DEFAULT_UDP_IDLE_TIMEOUT,
            windows_run_as_service: false,
            userspace: UserspaceConfiguration::default(),
            iptables_backend: IptablesBackend::Auto,
            nftables_layout: NftablesLayout::default(),
            canary_period: DEFAULT_CANARY_PERIOD,
            socket_lb: SocketLbConfiguration::default(),
        }
    }
}

impl Default for ClientConnection {
    fn default() -> Self {
        ClientConnection {
            kubeconfig: String::new(),
            accept_content_types: String::new(),
            content_type: DEFAULT_CONTENT_TYPE.to_owned(),
            qps: DEFAULT_QPS,
            burst: DEFAULT_BURST,
        }
    }
}

impl Default for Logging {
    fn default() -> Self {
        Logging {
            format: DEFAULT_LOG_FORMAT.to_owned(),
            flush_frequency: DEFAULT_LOG_FLUSH_FREQUENCY,
            verbosity: 0,
            vmodule: Vec::new(),
            options: LoggingOptions::default(),
        }
    }
}

impl Default for LogFormatOptions {
    fn default() -> Self {
        LogFormatOptions {
            split_stream: false,
            info_buffer_size: DEFAULT_LOG_INFO_BUFFER_SIZE.to_owned(),
        }
    }
}

impl Default for IptablesConfiguration {
    fn default() -> Self {
        IptablesConfiguration {
            masquerade_bit: DEFAULT_MASQUERADE_BIT,
            masquerade_all: false,
            localhost_node_ports: DEFAULT_LOCALHOST_NODE_PORTS,
            sync_period: DEFAULT_SYNC_PERIOD,
            min_sync_period: DEFAULT_IPTABLES_MIN_SYNC_PERIOD,
        }
    }
}

impl Default for IpvsConfiguration {
    fn default() -> Self {
        IpvsConfiguration {
            sync_period: DEFAULT_SYNC_PERIOD,
            min_sync_period: DEFAULT_IPVS_MIN_SYNC_PERIOD,
            scheduler: String::new(),
            exclude_cidrs: None,
            strict_arp: false,
            tcp_timeout: Duration::ZERO,
            tcp_fin_timeout: Duration::ZERO,
            udp_timeout: Duration::ZERO,
        }
    }
}

impl Default for NftablesConfiguration {
    fn default() -> Self {
        NftablesConfiguration {
            masquerade_bit: DEFAULT_MASQUERADE_BIT,
            masquerade_all: false,
            sync_period: DEFAULT_SYNC_PERIOD,
            min_sync_period: DEFAULT_NFTABLES_MIN_SYNC_PERIOD,
            table_name: String::new(),
        }
    }
}

impl Default for ConntrackConfiguration {
    fn default() -> Self {
        ConntrackConfiguration {
            max_per_core: DEFAULT_CONNTRACK_MAX_PER_CORE,
            min: DEFAULT_CONNTRACK_MIN,
            tcp_established_timeout: DEFAULT_CONNTRACK_TCP_ESTABLISHED_TIMEOUT,
            tcp_close_wait_timeout: DEFAULT_CONNTRACK_TCP_CLOSE_WAIT_TIMEOUT,
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

impl KubeProxyConfiguration {
    /// Fills in the defaults that depend on other fields; idempotent.
    ///
    /// As upstream, a health or metrics address given as a bare IP gets the default port.
    pub(crate) fn complete_defaults(&mut self) {
        let ipv6 = bind_address_is_ipv6(&self.bind_address);
        let (healthz, metrics) = if ipv6 {
            (
                DEFAULT_HEALTHZ_BIND_ADDRESS_V6,
                DEFAULT_METRICS_BIND_ADDRESS_V6,
            )
        } else {
            (DEFAULT_HEALTHZ_BIND_ADDRESS, DEFAULT_METRICS_BIND_ADDRESS)
        };
        complete_address(
            &mut self.healthz_bind_address,
            healthz,
            DEFAULT_HEALTHZ_PORT,
        );
        complete_address(
            &mut self.metrics_bind_address,
            metrics,
            DEFAULT_METRICS_PORT,
        );
        if self.mode == ProxyMode::Nftables
            && self.node_port_addresses.as_ref().is_none_or(Vec::is_empty)
        {
            self.node_port_addresses = Some(vec![NODE_PORT_ADDRESSES_PRIMARY.to_owned()]);
        }
    }

    /// The proxy mode.
    pub fn mode(&self) -> ProxyMode {
        self.mode
    }

    /// Full resync interval of the active mode: the `ipvs` block in IPVS mode, the `nftables`
    /// block in nftables mode, otherwise the `iptables` block.
    pub fn sync_period(&self) -> Duration {
        match self.mode {
            ProxyMode::Ipvs => self.ipvs.sync_period,
            ProxyMode::Nftables => self.nftables.sync_period,
            _ => self.iptables.sync_period,
        }
    }

    /// Minimum gap between syncs of the active mode (block chosen as in [`Self::sync_period`]).
    pub fn min_sync_period(&self) -> Duration {
        match self.mode {
            ProxyMode::Ipvs => self.ipvs.min_sync_period,
            ProxyMode::Nftables => self.nftables.min_sync_period,
            _ => self.iptables.min_sync_period,
        }
    }

    /// SNAT fwmark bit and masquerade-all of the active mode (nftables or iptables block).
    pub fn masquerade(&self) -> (i32, bool) {
        match self.mode {
            ProxyMode::Nftables => (self.nftables.masquerade_bit, self.nftables.masquerade_all),
            _ => (self.iptables.masquerade_bit, self.iptables.masquerade_all),
        }
    }

    /// Where the proxy health server listens; `None` when disabled.
    pub fn healthz_bind_address(&self) -> Option<SocketAddr> {
        let default = if bind_address_is_ipv6(&self.bind_address) {
            DEFAULT_HEALTHZ_BIND_ADDRESS_V6
        } else {
            DEFAULT_HEALTHZ_BIND_ADDRESS
        };
        socket_addr(self.healthz_bind_address.as_deref(), default)
    }

    /// Where the metrics server listens; `None` when disabled.
    pub fn metrics_bind_address(&self) -> Option<SocketAddr> {
        let default = if bind_address_is_ipv6(&self.bind_address) {
            DEFAULT_METRICS_BIND_ADDRESS_V6
        } else {
            DEFAULT_METRICS_BIND_ADDRESS
        };
        socket_addr(self.metrics_bind_address.as_deref(), default)
    }

    /// `bindAddress` as an IP; `None` if it is not one (validation rejects that).
    pub fn bind_address(&self) -> Option<IpAddr> {
        self.bind_address.trim().parse().ok()
    }

    /// The cluster's pod CIDRs (zero, one, or one per IP family).
    pub fn cluster_cidrs(&self) -> Vec<IpNet> {
        parse_cidr_list(&self.cluster_cidr)
    }

    /// Which node addresses NodePorts answer on, with the mode-dependent default resolved.
    pub fn node_port_addresses(&self) -> NodePortAddressesSetting {
        match self.node_port_addresses.as_deref() {
            None | Some([]) if self.mode == ProxyMode::Nftables => {
                NodePortAddressesSetting::primary()
            }
            None | Some([]) => NodePortAddressesSetting::All,
            Some(entries) => NodePortAddressesSetting::Listed(
                entries.iter().filter_map(|e| e.parse().ok()).collect(),
            ),
        }
    }

    /// `ipvs.excludeCIDRs`, parsed.
    pub fn ipvs_exclude_cidrs(&self) -> Vec<IpNet> {
        self.ipvs
            .exclude_cidrs
            .iter()
            .flatten()
            .filter_map(|e| e.trim().parse().ok())
            .collect()
    }

    /// The IPVS scheduler, with the empty default resolved to `rr`.
    pub fn ipvs_scheduler(&self) -> &str {
        match self.ipvs.scheduler.as_str() {
            "" => DEFAULT_IPVS_SCHEDULER,
            other => other,
        }
    }

    /// The node name override, if any. Without one, the caller uses the system host name
    /// (lowercased, as upstream).
    pub fn hostname_override(&self) -> Option<&str> {
        Some(self.hostname_override.trim()).filter(|h| !h.is_empty())
    }

    /// `portRange` as the relay's listening ports; `None` for ephemeral ports (also when it
    /// does not parse: validation rejects that).
    pub fn proxy_port_range(&self) -> Option<RangeInclusive<u16>> {
        parse_port_range(&self.port_range).ok().flatten()
    }

    /// Whether a feature gate was set to true in the configuration; `None` if not mentioned.
    pub fn feature_gate(&self, name: &str) -> Option<bool> {
        self.feature_gates.get(name).copied()
    }
}

/// Upstream picks the IPv6 defaults when `bindAddress` is not an IPv4 address.
fn bind_address_is_ipv6(bind_address: &str) -> bool {
    match bind_address.trim().parse::<IpAddr>() {
        Ok(IpAddr::V6(v6)) => v6.to_ipv4_mapped().is_none(),
        _ => false,
    }
}

fn complete_address(field: &mut Option<String>, default: &str, port: u16) {
    match field {
        None => *field = Some(default.to_owned()),
        Some(value) => {
            if let Ok(ip) = value.trim().parse::<IpAddr>() {
                *value = SocketAddr::new(ip, port).to_string();
            }
        }
    }
}

fn socket_addr(value: Option<&str>, default: &str) -> Option<SocketAddr> {
    match value.unwrap_or(default).trim() {
        "" => None,
        text => text.parse().ok(),
    }
}

/// Upstream's port range syntax: `BEGIN-END`, `BASE+SIZE` (BASE to BASE+SIZE) or one port.
/// `Ok(None)` for "no range" (empty, `0`, `0-0`); a range must lie within 1..=65535.
pub(crate) fn parse_port_range(text: &str) -> Result<Option<RangeInclusive<u16>>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let port = |p: &str| {
        p.trim()
            .parse::<u16>()
            .map_err(|_| format!("{:?} is not a port number (0-65535)", p.trim()))
    };
    let (low, high) = if let Some((low, high)) = text.split_once('-') {
        (port(low)?, port(high)?)
    } else if let Some((base, size)) = text.split_once('+') {
        let base = port(base)?;
        let size = port(size)?;
        let high = base
            .checked_add(size)
            .ok_or_else(|| format!("{base}+{size} goes past port 65535"))?;
        (base, high)
    } else {
        let single = port(text)?;
        (single, single)
    };
    match (low, high) {
        (0, 0) => Ok(None),
        (0, _) => Err("a range must start at port 1 or above (0 alone means any port)".into()),
        (low, high) if low > high => Err(format!("the end port {high} is below the start {low}")),
        (low, high) => Ok(Some(low..=high)),
    }
}

/// Comma-separated CIDRs; entries that do not parse are skipped (validation reports them).
pub(crate) fn parse_cidr_list(text: &str) -> Vec<IpNet> {
    text.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .filter_map(|e| e.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_upstream_table() {
        let c = KubeProxyConfiguration::default();
        assert_eq!(c.client_connection.content_type, DEFAULT_CONTENT_TYPE);
        assert_eq!(c.client_connection.qps, 5.0);
        assert_eq!(c.client_connection.burst, 10);
        assert_eq!(c.logging.flush_frequency, Duration::from_secs(5));
        assert_eq!(c.logging.format, "text");
        assert_eq!(c.bind_address, "0.0.0.0");
        assert_eq!(c.iptables.masquerade_bit, 14);
        assert!(c.iptables.localhost_node_ports);
        assert_eq!(c.iptables.sync_period, Duration::from_secs(30));
        assert_eq!(c.iptables.min_sync_period, Duration::from_secs(1));
        assert_eq!(c.ipvs.sync_period, Duration::from_secs(30));
        assert_eq!(c.ipvs.min_sync_period, Duration::ZERO);
        assert_eq!(c.nftables.min_sync_period, Duration::from_secs(1));
        assert_eq!(c.oom_score_adj, -999);
        assert_eq!(c.conntrack.max_per_core, 32768);
        assert_eq!(c.conntrack.min, 131072);
        assert_eq!(
            c.conntrack.tcp_established_timeout,
            Duration::from_secs(86400)
        );
        assert_eq!(
            c.conntrack.tcp_close_wait_timeout,
            Duration::from_secs(3600)
        );
        assert_eq!(c.config_sync_period, Duration::from_secs(900));
        assert_eq!(c.detect_local_mode, LocalMode::ClusterCidr);
        assert_eq!(c.ipvs_scheduler(), "rr");
        #[cfg(not(windows))]
        assert_eq!(c.mode(), ProxyMode::Iptables);
    }

    #[test]
    fn bind_address_family_picks_server_defaults() {
        let cases = [
            ("0.0.0.0", "0.0.0.0:10256", "127.0.0.1:10249"),
            ("10.1.2.3", "0.0.0.0:10256", "127.0.0.1:10249"),
            ("::", "[::]:10256", "[::1]:10249"),
            ("fd00::1", "[::]:10256", "[::1]:10249"),
            ("::ffff:10.0.0.1", "0.0.0.0:10256", "127.0.0.1:10249"),
        ];
        for (bind, healthz, metrics) in cases {
            let mut c = KubeProxyConfiguration {
                bind_address: bind.to_owned(),
                ..Default::default()
            };
            assert_eq!(c.healthz_bind_address(), healthz.parse().ok(), "{bind}");
            c.complete_defaults();
            assert_eq!(c.healthz_bind_address.as_deref(), Some(healthz), "{bind}");
            assert_eq!(c.metrics_bind_address.as_deref(), Some(metrics), "{bind}");
            assert_eq!(c.metrics_bind_address(), metrics.parse().ok(), "{bind}");
        }
    }

    #[test]
    fn bare_ip_gets_default_port_and_empty_disables() {
        let mut c = KubeProxyConfiguration {
            healthz_bind_address: Some("::1".into()),
            metrics_bind_address: Some(String::new()),
            ..Default::default()
        };
        c.complete_defaults();
        assert_eq!(c.healthz_bind_address.as_deref(), Some("[::1]:10256"));
        assert_eq!(c.metrics_bind_address(), None);
    }

    #[test]
    fn node_port_addresses_default_depends_on_mode() {
        let mut ipt = KubeProxyConfiguration {
            mode: ProxyMode::Iptables,
            ..Default::default()
        };
        ipt.complete_defaults();
        assert_eq!(ipt.node_port_addresses, None);
        assert_eq!(ipt.node_port_addresses(), NodePortAddressesSetting::All);

        let mut nft = KubeProxyConfiguration {
            mode: ProxyMode::Nftables,
            ..Default::default()
        };
        assert_eq!(
            nft.node_port_addresses(),
            NodePortAddressesSetting::primary()
        );
        nft.complete_defaults();
        assert_eq!(nft.node_port_addresses, Some(vec!["primary".to_owned()]));

        let explicit = KubeProxyConfiguration {
            mode: ProxyMode::Nftables,
            node_port_addresses: Some(vec!["10.0.0.0/8".into(), "fd00::/64".into()]),
            ..Default::default()
        };
        let want = parse_cidr_list("10.0.0.0/8,fd00::/64");
        assert_eq!(want.len(), 2);
        assert_eq!(
            explicit.node_port_addresses(),
            NodePortAddressesSetting::Listed(
                want.into_iter().map(super::NodePortAddress::Cidr).collect()
            )
        );
    }

    #[test]
    fn sync_periods_follow_mode_block() {
        let mut c = KubeProxyConfiguration::default();
        c.iptables.sync_period = Duration::from_secs(1);
        c.ipvs.sync_period = Duration::from_secs(2);
        c.nftables.sync_period = Duration::from_secs(3);
        c.iptables.min_sync_period = Duration::from_millis(1);
        c.ipvs.min_sync_period = Duration::from_millis(2);
        c.nftables.min_sync_period = Duration::from_millis(3);
        let cases = [
            (ProxyMode::Iptables, 1),
            (ProxyMode::Ipvs, 2),
            (ProxyMode::Nftables, 3),
            (ProxyMode::Fake, 1),
        ];
        for (mode, n) in cases {
            c.mode = mode;
            assert_eq!(c.sync_period(), Duration::from_secs(n), "{mode}");
            assert_eq!(c.min_sync_period(), Duration::from_millis(n), "{mode}");
        }
    }

    #[test]
    fn cluster_cidrs_and_modes_parse() {
        let c = KubeProxyConfiguration {
            cluster_cidr: "10.244.0.0/16, fd00:10:244::/56".into(),
            ..Default::default()
        };
        assert_eq!(c.cluster_cidrs().len(), 2);
        assert_eq!("nftables".parse(), Ok(ProxyMode::Nftables));
        assert_eq!("fake".parse(), Ok(ProxyMode::Fake));
        assert!("IPTABLES".parse::<ProxyMode>().is_err());
        assert_eq!("NodeCIDR".parse(), Ok(LocalMode::NodeCidr));
        assert_eq!("".parse(), Ok(LocalMode::ClusterCidr));
        assert!("nodecidr".parse::<LocalMode>().is_err());
    }

    #[test]
    fn port_ranges_parse_as_upstream_writes_them() {
        let ok = [
            ("", None),
            ("0", None),
            ("0-0", None),
            (" 30000-30100 ", Some(30000..=30100)),
            ("30000+100", Some(30000..=30100)),
            ("8080", Some(8080..=8080)),
            ("65535", Some(65535..=65535)),
            ("1-65535", Some(1..=65535)),
        ];
        for (text, want) in ok {
            assert_eq!(parse_port_range(text), Ok(want), "{text:?}");
        }
        for bad in [
            "abc", "100-", "-100", "200-100", "0-100", "65535+1", "70000", "1-2-3", "1,2",
        ] {
            assert!(parse_port_range(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn hostname_override_is_optional() {
        let mut c = KubeProxyConfiguration::default();
        assert_eq!(c.hostname_override(), None);
        c.hostname_override = "node-1".into();
        assert_eq!(c.hostname_override(), Some("node-1"));
    }
}
