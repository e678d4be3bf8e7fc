//! kube-proxy's configuration: the `KubeProxyConfiguration` file
//! (`kubeproxy.config.k8s.io/v1alpha1`), upstream's command-line flags, their defaults,
//! precedence and validation.
//!
//! `main` parses [`Options`] with clap, calls [`Options::load`], logs the returned
//! warnings and uses the typed accessors of [`KubeProxyConfiguration`]. The crate reads the
//! `--config` file and nothing else: it does not log and does not look up the host name.
//!
//! A file means what it means to upstream: v1alpha1's defaulting turns absent, `null` and the
//! zero values upstream treats as unset into defaults (`iptables.syncPeriod: 0s` is 30s), and
//! unknown or duplicate fields are warnings (upstream decodes strictly, then leniently). Every
//! setting kube-proxy-rs cannot honour is listed in [`audit`] and warned about when set.
//!
//! Adding a setting: the field in `types.rs` (with its default in `Default`), its optional
//! mirror and conversion in `wire.rs` (zero meaning "unset" only if upstream's defaulting says
//! so), a flag in `flags.rs` if it has one (and its `apply_config_flags` entry), and its
//! treatment in [`audit::FIELDS`] / [`audit::FLAGS`]; the audit tests fail until the tables
//! name it, and the strict-decoding check learns the field's path from `audit::FIELDS`.

pub mod audit;
pub mod duration;
mod flags;
pub mod gates;
mod iptables_backend;
mod load;
mod nftables_layout;
mod nodeport;
mod types;
mod validate;
mod wire;
mod write;

#[cfg(test)]
mod tests;

pub use flags::{CidrList, FeatureGates, FlagError, Options, VModule, parse_go_bool};
pub use load::{LoadError, Loaded};
pub use types::{
    API_VERSION, ClientConnection, ConntrackConfiguration, DEFAULT_BIND_ADDRESS, DEFAULT_BURST,
    DEFAULT_CANARY_PERIOD, DEFAULT_CONFIG_SYNC_PERIOD, DEFAULT_CONNTRACK_MAX_PER_CORE,
    DEFAULT_CONNTRACK_MIN, DEFAULT_CONNTRACK_TCP_CLOSE_WAIT_TIMEOUT,
    DEFAULT_CONNTRACK_TCP_ESTABLISHED_TIMEOUT, DEFAULT_CONTENT_TYPE, DEFAULT_HEALTHZ_BIND_ADDRESS,
    DEFAULT_HEALTHZ_BIND_ADDRESS_V6, DEFAULT_HEALTHZ_PORT, DEFAULT_IPTABLES_MIN_SYNC_PERIOD,
    DEFAULT_IPVS_MIN_SYNC_PERIOD, DEFAULT_IPVS_SCHEDULER, DEFAULT_LOCALHOST_NODE_PORTS,
    DEFAULT_LOG_FLUSH_FREQUENCY, DEFAULT_LOG_FORMAT, DEFAULT_LOG_INFO_BUFFER_SIZE,
    DEFAULT_MASQUERADE_BIT, DEFAULT_METRICS_BIND_ADDRESS, DEFAULT_METRICS_BIND_ADDRESS_V6,
    DEFAULT_METRICS_PORT, DEFAULT_NFTABLES_MIN_SYNC_PERIOD, DEFAULT_OOM_SCORE_ADJ, DEFAULT_QPS,
    DEFAULT_SYNC_PERIOD, DEFAULT_UDP_IDLE_TIMEOUT, DEFAULT_USERSPACE_MAX_CONNECTIONS_PER_SERVICE,
    DEFAULT_USERSPACE_MAX_UDP_SESSIONS_PER_SERVICE, DetectLocalConfiguration, IPVS_SCHEDULERS,
    IptablesBackend, IptablesConfiguration, IpvsConfiguration, KIND, KubeProxyConfiguration,
    LocalMode, LogFormatOptions, Logging, LoggingOptions, NODE_PORT_ADDRESSES_ALL,
    NODE_PORT_ADDRESSES_LOCALHOST, NODE_PORT_ADDRESSES_PRIMARY, NftablesConfiguration,
    NftablesLayout, NodePortAddress, NodePortAddressesSetting, ProxyMode, SocketLbConfiguration,
    UserspaceConfiguration, VModuleItem, WinkernelConfiguration,
};
pub use validate::{ConfigErrors, FieldError};
pub use write::{VersionedConfiguration, WriteError, write_config};

/// What `--version` prints: this project's name and version.
pub const VERSION: &str = concat!("kube-proxy-rs ", env!("CARGO_PKG_VERSION"));
