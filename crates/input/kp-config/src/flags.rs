//! Upstream kube-proxy's command line.
//!
//! Flag names and meanings follow upstream so existing DaemonSets keep working. Go's flag
//! syntax is accepted where it differs from clap's defaults: `--flag=value` and
//! `--flag value`, boolean flags given bare or as `--flag=true|false`, `-v=4`, and a repeated
//! flag where the last one wins. Every configuration flag is an `Option` so that "not given"
//! is distinguishable from "given with the default value": that drives both precedence
//! against `--config` and the warnings for ignored flags.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{ArgAction, Parser};
use ipnet::IpNet;

use crate::duration::{self, DurationError};
use crate::types::{
    KubeProxyConfiguration, LocalMode, NodePortAddressesSetting, ProxyMode, VModuleItem,
};
use crate::validate::FieldError;

/// Why a flag's value was rejected (clap prefixes the message with the flag's name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// Not one of Go's boolean spellings (`true`, `false`, `1`, `0`, `t`, `f`, ...).
    #[error("invalid boolean {0:?}; expected true or false")]
    Bool(String),
    /// A `--feature-gates` entry that is not `Name=true|false`.
    #[error("invalid feature gate {0:?}; expected Name=true or Name=false")]
    FeatureGate(String),
    /// A `--vmodule` entry that is not `pattern=N`.
    #[error("invalid vmodule entry {0:?}; expected pattern=N")]
    VModule(String),
    /// An entry of a CIDR list that is not a CIDR.
    #[error("not a CIDR: {0:?}")]
    Cidr(String),
}

/// Parses Go's `strconv.ParseBool` spellings, which is what upstream's flags accept.
pub fn parse_go_bool(s: &str) -> Result<bool, FlagError> {
    match s {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        other => Err(FlagError::Bool(other.to_owned())),
    }
}

/// `--feature-gates` value: `Name=true,Other=false`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FeatureGates(pub BTreeMap<String, bool>);

impl FromStr for FeatureGates {
    type Err = FlagError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut gates = BTreeMap::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = || FlagError::FeatureGate(entry.to_owned());
            let (name, value) = entry.split_once('=').ok_or_else(bad)?;
            let enabled = parse_go_bool(value.trim()).map_err(|_| bad())?;
            if name.trim().is_empty() {
                return Err(bad());
            }
            gates.insert(name.trim().to_owned(), enabled);
        }
        Ok(FeatureGates(gates))
    }
}

/// `--vmodule` value: `pattern=N,other=M`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VModule(pub Vec<VModuleItem>);

impl FromStr for VModule {
    type Err = FlagError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|entry| {
                let bad = || FlagError::VModule(entry.to_owned());
                let (pattern, level) = entry.split_once('=').ok_or_else(bad)?;
                Ok(VModuleItem {
                    file_pattern: Some(pattern.trim())
                        .filter(|p| !p.is_empty())
                        .ok_or_else(bad)?
                        .to_owned(),
                    verbosity: level.trim().parse().map_err(|_| bad())?,
                })
            })
            .collect::<Result<_, _>>()
            .map(VModule)
    }
}

/// A comma-separated CIDR list (`--ipvs-exclude-cidrs`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CidrList(pub Vec<IpNet>);

impl FromStr for CidrList {
    type Err = FlagError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(|e| e.parse().map_err(|_| FlagError::Cidr(e.to_owned())))
            .collect::<Result<_, _>>()
            .map(CidrList)
    }
}

/// The first paragraph of `kube-proxy --help`.
pub const ABOUT: &str = "\
The Kubernetes network proxy (kube-proxy-rs) runs on each node. It watches Services,
EndpointSlices and this node's Node, from the API server or from manifest files, and programs
the node so that traffic to a Service's cluster IP, node ports, external IPs and load-balancer
IPs reaches one of its ready endpoints. It takes upstream kube-proxy's flags and
KubeProxyConfiguration file.";

/// The layout of `kube-proxy --help`, as upstream's: what it is, how to call it (the
/// subcommands included, which `main` dispatches before these flags are parsed), the flags.
pub const HELP_TEMPLATE: &str = "\
{about-with-newline}
Usage:
  kube-proxy [flags]
  kube-proxy explain DEST[:PORT][/PROTO] [--from SRC] [flags]
  kube-proxy demo [--proxy-mode MODE] [--keep]

Commands:
  explain   Say how this node handles traffic to DEST: the service port it matches, each
            endpoint's verdict, masquerading, affinity, and the objects of the configured
            proxy mode. Reads the proxy's sources and configuration; see kube-proxy
            explain --help.
  demo      Build a small cluster in network namespaces, run the proxy in it, send traffic
            and show which pod answered; removes everything afterwards (needs root).

{all-args}{after-help}
";

fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    duration::parse(s.trim())
}

/// The kube-proxy command line.
///
/// Fields under "Process" are options of this run, not configuration; the rest set
/// `KubeProxyConfiguration` fields (see [`Options::load`] for how they combine with
/// `--config`). What `--help` shows is `ABOUT` and `HELP_TEMPLATE`, not this comment.
#[derive(Debug, Clone, Default, Parser)]
#[command(
    name = "kube-proxy",
    display_name = "kube-proxy-rs",
    version,
    about = ABOUT,
    long_about = None,
    override_usage = "kube-proxy [flags]",
    help_template = HELP_TEMPLATE,
    after_help = "When --config is given, the file is the configuration: flags other than \
                  --hostname-override, --iptables-backend and the logging flags are then ignored \
                  (with a warning).",
    args_override_self = true
)]
pub struct Options {
    /// KubeProxyConfiguration file (YAML or JSON). Most configuration flags are ignored when
    /// it is given.
    #[arg(long, value_name = "PATH", help_heading = "Process")]
    pub config: Option<PathBuf>,

    /// Write the effective configuration (defaults and flags applied) to PATH and exit.
    #[arg(long, value_name = "PATH", help_heading = "Process")]
    pub write_config_to: Option<PathBuf>,

    /// Remove the rules every proxy mode may have left on this node, then exit.
    #[arg(
        long,
        help_heading = "Process",
        action = ArgAction::Set,
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub cleanup: bool,

    /// Do the privileged node set-up (sysctls, conntrack limits) and exit, e.g. from an init
    /// container, so the long-running proxy needs fewer privileges.
    #[arg(
        long,
        help_heading = "Process",
        action = ArgAction::Set,
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub init_only: bool,

    /// kube-proxy-rs extension: read Services, EndpointSlices and Nodes from a manifest file
    /// or a directory of them instead of watching an API server. For clusterless tests and
    /// dry runs; the kubeconfig and --master are not used then.
    #[arg(long, value_name = "PATH", help_heading = "Process")]
    pub manifests: Option<PathBuf>,

    /// kube-proxy-rs extension: serve /debug/explain?dest=DEST&from=SRC on the metrics
    /// listener (DEST as for kube-proxy explain), the kube-proxy explain answer for the
    /// proxier's current state (text, or JSON with format=json or Accept: application/json). Off by default: it shows the
    /// node's services and endpoints to whoever reaches the metrics port, and keeps a copy of
    /// the proxy state per sync.
    #[arg(
        long,
        help_heading = "Process",
        action = ArgAction::Set,
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub debug_explain: bool,

    /// Address of the API server; takes precedence over the server in the kubeconfig.
    #[arg(long, value_name = "URL", help_heading = "Process")]
    pub master: Option<String>,

    /// kubeconfig file with the API server address and credentials; empty means the
    /// in-cluster service account.
    #[arg(long, value_name = "PATH", help_heading = "Client")]
    pub kubeconfig: Option<String>,

    /// Content type of requests to the API server.
    #[arg(long, value_name = "TYPE", help_heading = "Client")]
    pub kube_api_content_type: Option<String>,

    /// Sustained request rate to the API server.
    #[arg(long, value_name = "QPS", help_heading = "Client")]
    pub kube_api_qps: Option<f32>,

    /// Requests allowed in a burst above --kube-api-qps.
    #[arg(long, value_name = "N", help_heading = "Client")]
    pub kube_api_burst: Option<i32>,

    /// Name of this node, if not the host name (lowercased). Applies even with --config.
    #[arg(long, value_name = "NAME", help_heading = "Node")]
    pub hostname_override: Option<String>,

    /// kube-proxy-rs extension: the iptables backend, auto (the one the node's kubelet and
    /// rules use), legacy or nft. Wins over $KUBE_PROXY_RS_IPTABLES_BACKEND, which wins over
    /// iptablesBackend in the file. Applies even with --config (it describes the node).
    #[arg(long, value_name = "auto|legacy|nft", value_parser = crate::IptablesBackend::from_str, help_heading = "Node")]
    pub iptables_backend: Option<crate::IptablesBackend>,

    /// kube-proxy-rs extension: the table layout of nftables mode, maps (the default: fixed
    /// chains, per-service state in sets and maps) or chains (a chain per service and
    /// endpoint, as upstream). Wins over nftablesLayout in the file; applies even with
    /// --config.
    #[arg(long, value_name = "maps|chains", value_parser = crate::NftablesLayout::from_str, help_heading = "iptables / nftables")]
    pub nftables_layout: Option<crate::NftablesLayout>,

    /// Use this IP as the node's primary IP for rule programming; :: selects IPv6 defaults
    /// for the servers. Nothing listens on it.
    #[arg(long, value_name = "IP", help_heading = "Node")]
    pub bind_address: Option<IpAddr>,

    /// IP:port of the proxy health server (a bare IP gets port 10256); empty disables it.
    #[arg(long, value_name = "IP:PORT", help_heading = "Servers")]
    pub healthz_bind_address: Option<String>,

    /// IP:port of the metrics server (a bare IP gets port 10249); empty disables it.
    #[arg(long, value_name = "IP:PORT", help_heading = "Servers")]
    pub metrics_bind_address: Option<String>,

    /// Exit instead of retrying when the health or metrics port cannot be bound.
    #[arg(
        long,
        help_heading = "Servers",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub bind_address_hard_fail: Option<bool>,

    /// Serve profiling handlers on the metrics server.
    #[arg(
        long,
        help_heading = "Servers",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub profiling: Option<bool>,

    /// Previous release whose hidden metrics should still be exposed.
    #[arg(long, value_name = "VERSION", help_heading = "Servers")]
    pub show_hidden_metrics_for_version: Option<String>,

    /// How to program Services: iptables (Linux default), ipvs, nftables, kernelspace
    /// (Windows), userspace, winuserspace, or fake (programs nothing; for tests).
    #[arg(long, value_name = "MODE", value_parser = ProxyMode::from_str, help_heading = "Proxy")]
    pub proxy_mode: Option<ProxyMode>,

    /// Feature gates to set, as Name=true,Other=false.
    #[arg(long, value_name = "GATES", help_heading = "Proxy")]
    pub feature_gates: Option<FeatureGates>,

    /// Pod CIDR(s) of the cluster (one, or an IPv4,IPv6 pair); traffic from outside it is
    /// masqueraded in ClusterCIDR detect-local mode.
    #[arg(long, value_name = "CIDRS", help_heading = "Proxy")]
    pub cluster_cidr: Option<String>,

    /// How local pod traffic is recognised: ClusterCIDR, NodeCIDR, BridgeInterface or
    /// InterfaceNamePrefix.
    #[arg(long, value_name = "MODE", value_parser = LocalMode::from_str, help_heading = "Proxy")]
    pub detect_local_mode: Option<LocalMode>,

    /// Bridge interface carrying local pod traffic (BridgeInterface mode).
    #[arg(long, value_name = "IFACE", help_heading = "Proxy")]
    pub pod_bridge_interface: Option<String>,

    /// Name prefix of local pod interfaces (InterfaceNamePrefix mode).
    #[arg(long, value_name = "PREFIX", help_heading = "Proxy")]
    pub pod_interface_name_prefix: Option<String>,

    /// Node addresses NodePorts answer on: comma-separated CIDRs and the keywords "primary"
    /// (the node's primary IPs), "localhost" (loopback) and "all", in any combination; empty
    /// means all (nftables mode defaults to primary). In nftables mode with the
    /// KubeProxyNFTablesLocalhostNodePorts gate, an explicit loopback entry serves TCP
    /// NodePorts on 127.0.0.1 / ::1 through a userspace listener.
    #[arg(
        long = "nodeport-addresses",
        value_name = "CIDRS",
        value_parser = NodePortAddressesSetting::from_str,
        help_heading = "Proxy",
    )]
    pub nodeport_addresses: Option<NodePortAddressesSetting>,

    /// SNAT all Service traffic, not only traffic that needs it (iptables and nftables).
    #[arg(
        long,
        help_heading = "Proxy",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub masquerade_all: Option<bool>,

    /// Bit of the packet mark used to flag traffic needing SNAT, 0..31 (iptables and
    /// nftables).
    #[arg(long, value_name = "BIT", help_heading = "iptables / nftables")]
    pub iptables_masquerade_bit: Option<i32>,

    /// Allow NodePorts on 127.0.0.1 (iptables, IPv4 only).
    #[arg(
        long = "iptables-localhost-nodeports",
        help_heading = "iptables / nftables",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub iptables_localhost_nodeports: Option<bool>,

    /// Full resync interval in iptables and nftables modes (e.g. 30s, 1m, 2h22m).
    #[arg(
        long,
        value_name = "DURATION",
        value_parser = parse_duration,
        help_heading = "iptables / nftables",
    )]
    pub iptables_sync_period: Option<Duration>,

    /// Minimum time between syncs in iptables and nftables modes; batches bursts of
    /// changes (0 syncs on every change).
    #[arg(
        long,
        value_name = "DURATION",
        value_parser = parse_duration,
        help_heading = "iptables / nftables",
    )]
    pub iptables_min_sync_period: Option<Duration>,

    /// Full resync interval in IPVS mode.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "IPVS")]
    pub ipvs_sync_period: Option<Duration>,

    /// Minimum time between syncs in IPVS mode.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "IPVS")]
    pub ipvs_min_sync_period: Option<Duration>,

    /// IPVS scheduler: rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, nq or mh (empty is rr).
    #[arg(long, value_name = "NAME", help_heading = "IPVS")]
    pub ipvs_scheduler: Option<String>,

    /// CIDRs whose virtual servers IPVS cleanup must leave alone.
    #[arg(
        long = "ipvs-exclude-cidrs",
        value_name = "CIDRS",
        help_heading = "IPVS"
    )]
    pub ipvs_exclude_cidrs: Option<CidrList>,

    /// Make only the owning interface answer ARP for Service IPs (arp_ignore/arp_announce).
    #[arg(
        long = "ipvs-strict-arp",
        help_heading = "IPVS",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub ipvs_strict_arp: Option<bool>,

    /// Idle timeout of IPVS TCP sessions; 0 keeps the kernel's value.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "IPVS")]
    pub ipvs_tcp_timeout: Option<Duration>,

    /// Timeout of IPVS TCP sessions after FIN; 0 keeps the kernel's value.
    #[arg(
        long = "ipvs-tcpfin-timeout",
        value_name = "DURATION",
        value_parser = parse_duration,
        help_heading = "IPVS",
    )]
    pub ipvs_tcpfin_timeout: Option<Duration>,

    /// Timeout of IPVS UDP entries; 0 keeps the kernel's value.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "IPVS")]
    pub ipvs_udp_timeout: Option<Duration>,

    /// Conntrack entries to allow per CPU; 0 leaves the limit alone.
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        help_heading = "Conntrack"
    )]
    pub conntrack_max_per_core: Option<i32>,

    /// Lower bound on the conntrack table size, whatever the CPU count.
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        help_heading = "Conntrack"
    )]
    pub conntrack_min: Option<i32>,

    /// Idle timeout of established TCP conntrack entries; 0 leaves it alone.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Conntrack")]
    pub conntrack_tcp_timeout_established: Option<Duration>,

    /// Timeout of TCP conntrack entries in CLOSE_WAIT; 0 leaves it alone.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Conntrack")]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,

    /// Make conntrack accept out-of-window TCP packets instead of marking them invalid.
    #[arg(
        long,
        help_heading = "Conntrack",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub conntrack_tcp_be_liberal: Option<bool>,

    /// Idle timeout of UDP conntrack entries; 0 leaves it alone.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Conntrack")]
    pub conntrack_udp_timeout: Option<Duration>,

    /// Idle timeout of bidirectional UDP conntrack entries; 0 leaves it alone.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Conntrack")]
    pub conntrack_udp_timeout_stream: Option<Duration>,

    /// oom_score_adj of this process, -1000..1000.
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        help_heading = "Node"
    )]
    pub oom_score_adj: Option<i32>,

    /// How often the Service and EndpointSlice informers resync.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Client")]
    pub config_sync_period: Option<Duration>,

    /// Userspace mode: host ports the relay may listen on (BEGIN-END, BASE+SIZE or one
    /// port); empty, 0 or 0-0 let the kernel pick.
    #[arg(long, value_name = "RANGE", help_heading = "Userspace")]
    pub proxy_port_range: Option<String>,

    /// kube-proxy-rs extension: how often the proxy checks that the kernel still holds its
    /// rules where no change notification exists (iptables-legacy, IPVS), so rules another
    /// program removed come back within it; 0s checks only before each periodic sync.
    /// Default 2s.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Node")]
    pub canary_period: Option<Duration>,

    /// kube-proxy-rs extension: nftables mode also balances the node's own sockets' Service
    /// connections when they connect (cgroup BPF programs, no per-packet NAT); where BPF
    /// cannot run, the proxy says why and runs nftables mode alone.
    #[arg(
        long,
        help_heading = "Proxy",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub socket_lb: Option<bool>,

    /// kube-proxy-rs extension: the cgroup v2 directory --socket-lb attaches to (sockets of
    /// processes in it or below it are balanced). Default: the root of the node's cgroup v2
    /// hierarchy, mounted privately where the node has only cgroup v1.
    #[arg(long, value_name = "DIR", help_heading = "Proxy")]
    pub socket_lb_cgroup: Option<String>,

    /// Userspace mode: how long an idle UDP session is kept (e.g. 250ms, 2s); must be
    /// greater than 0. Default 250ms.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Userspace")]
    pub udp_timeout: Option<Duration>,

    /// kube-proxy-rs extension, userspace mode: open TCP connections per Service (over all
    /// its ports); further ones are reset and counted in
    /// kube_proxy_rs_userspace_limit_rejections_total. Default 4096.
    #[arg(
        long,
        value_name = "N",
        allow_negative_numbers = true,
        help_heading = "Userspace"
    )]
    pub userspace_max_connections_per_service: Option<i32>,

    /// kube-proxy-rs extension, userspace mode: live UDP sessions per Service (over all its
    /// ports); datagrams of further clients are dropped and counted. Default 4096.
    #[arg(
        long = "userspace-max-udp-sessions-per-service",
        value_name = "N",
        allow_negative_numbers = true,
        help_heading = "Userspace"
    )]
    pub userspace_max_udp_sessions_per_service: Option<i32>,

    /// Windows: HNS network name.
    #[arg(long, value_name = "NAME", help_heading = "Windows")]
    pub network_name: Option<String>,

    /// Windows: source VIP for load balancers.
    #[arg(long, value_name = "IP", help_heading = "Windows")]
    pub source_vip: Option<String>,

    /// Windows: direct server return.
    #[arg(
        long = "enable-dsr",
        help_heading = "Windows",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub enable_dsr: Option<bool>,

    /// Windows: host endpoint name of the root network namespace.
    #[arg(
        long = "root-hnsendpoint-name",
        value_name = "NAME",
        help_heading = "Windows"
    )]
    pub root_hns_endpoint_name: Option<String>,

    /// Windows: forward health-check VIP traffic.
    #[arg(
        long = "forward-healthcheck-vip",
        help_heading = "Windows",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub forward_healthcheck_vip: Option<bool>,

    /// Log verbosity (klog -v); higher is chattier. Applies even with --config.
    #[arg(
        short = 'v',
        long = "v",
        value_name = "LEVEL",
        help_heading = "Logging"
    )]
    pub verbosity: Option<u32>,

    /// Per-file verbosity, as pattern=N,... Applies even with --config.
    #[arg(long, value_name = "PATTERN=N,...", help_heading = "Logging")]
    pub vmodule: Option<VModule>,

    /// Log format: text or json. Applies even with --config.
    #[arg(long, value_name = "FORMAT", help_heading = "Logging")]
    pub logging_format: Option<String>,

    /// Maximum time between log flushes (logs are unbuffered here; accepted for upstream's
    /// command lines and warned about). Applies even with --config.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, help_heading = "Logging")]
    pub log_flush_frequency: Option<Duration>,

    /// JSON logs: errors to stderr, info to stdout (accepted, warned about).
    #[arg(
        long,
        help_heading = "Logging",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub log_json_split_stream: Option<bool>,

    /// JSON logs: buffer size of the info stream (accepted, warned about).
    #[arg(long, value_name = "QUANTITY", help_heading = "Logging")]
    pub log_json_info_buffer_size: Option<String>,

    /// Text logs: errors to stderr, info to stdout (accepted, warned about).
    #[arg(
        long,
        help_heading = "Logging",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub log_text_split_stream: Option<bool>,

    /// Text logs: buffer size of the info stream (accepted, warned about).
    #[arg(long, value_name = "QUANTITY", help_heading = "Logging")]
    pub log_text_info_buffer_size: Option<String>,

    /// Deprecated upstream: port of the health server; 0 disables it. Ignored with --config
    /// or --write-config-to, and (as upstream) it only sets the port of a
    /// --healthz-bind-address given without one.
    #[arg(long, value_name = "PORT", hide = true, help_heading = "Servers")]
    pub healthz_port: Option<i32>,

    /// Deprecated upstream: port of the metrics server; 0 disables it. As --healthz-port.
    #[arg(long, value_name = "PORT", hide = true, help_heading = "Servers")]
    pub metrics_port: Option<i32>,

    /// Windows: run as a Windows service (accepted, warned about on Linux).
    #[arg(
        long = "windows-service",
        help_heading = "Windows",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = parse_go_bool,
        value_name = "BOOL"
    )]
    pub windows_service: Option<bool>,
}

/// A flag that was given and the configuration fields it set.
pub(crate) type FlagFields = (&'static str, &'static [&'static str]);

impl Options {
    /// Applies the configuration flags (all but `--hostname-override` and logging) that were
    /// given, returning which ones.
    pub(crate) fn apply_config_flags(&self, c: &mut KubeProxyConfiguration) -> Vec<FlagFields> {
        let mut set: Vec<FlagFields> = Vec::new();
        macro_rules! flag {
            ($opt:expr, $flag:literal, [$($field:literal),+], |$v:ident| $apply:expr) => {
                if let Some($v) = &$opt {
                    $apply;
                    set.push(($flag, &[$($field),+]));
                }
            };
        }
        let cc = &mut c.client_connection;
        flag!(
            self.kubeconfig,
            "--kubeconfig",
            ["clientConnection.kubeconfig"],
            |v| { cc.kubeconfig = v.clone() }
        );
        flag!(
            self.kube_api_content_type,
            "--kube-api-content-type",
            ["clientConnection.contentType"],
            |v| { cc.content_type = v.clone() }
        );
        flag!(
            self.kube_api_qps,
            "--kube-api-qps",
            ["clientConnection.qps"],
            |v| cc.qps = *v
        );
        flag!(
            self.kube_api_burst,
            "--kube-api-burst",
            ["clientConnection.burst"],
            |v| { cc.burst = *v }
        );
        flag!(self.bind_address, "--bind-address", ["bindAddress"], |v| {
            c.bind_address = v.to_string()
        });
        flag!(
            self.healthz_bind_address,
            "--healthz-bind-address",
            ["healthzBindAddress"],
            |v| { c.healthz_bind_address = Some(v.trim().to_owned()) }
        );
        flag!(
            self.metrics_bind_address,
            "--metrics-bind-address",
            ["metricsBindAddress"],
            |v| { c.metrics_bind_address = Some(v.trim().to_owned()) }
        );
        flag!(
            self.bind_address_hard_fail,
            "--bind-address-hard-fail",
            ["bindAddressHardFail"],
            |v| { c.bind_address_hard_fail = *v }
        );
        flag!(self.profiling, "--profiling", ["enableProfiling"], |v| c
            .enable_profiling =
            *v);
        flag!(
            self.show_hidden_metrics_for_version,
            "--show-hidden-metrics-for-version",
            ["showHiddenMetricsForVersion"],
            |v| { c.show_hidden_metrics_for_version = v.clone() }
        );
        flag!(self.proxy_mode, "--proxy-mode", ["mode"], |v| {
            c.mode = *v;
            c.mode_defaulted = false;
        });
        flag!(
            self.feature_gates,
            "--feature-gates",
            ["featureGates"],
            |v| {
                c.feature_gates
                    .extend(v.0.iter().map(|(k, on)| (k.clone(), *on)))
            }
        );
        flag!(self.cluster_cidr, "--cluster-cidr", ["clusterCIDR"], |v| {
            c.cluster_cidr = v.trim().to_owned()
        });
        flag!(
            self.detect_local_mode,
            "--detect-local-mode",
            ["detectLocalMode"],
            |v| { c.detect_local_mode = *v }
        );
        flag!(
            self.pod_bridge_interface,
            "--pod-bridge-interface",
            ["detectLocal.bridgeInterface"],
            |v| { c.detect_local.bridge_interface = v.clone() }
        );
        flag!(
            self.pod_interface_name_prefix,
            "--pod-interface-name-prefix",
            ["detectLocal.interfaceNamePrefix"],
            |v| { c.detect_local.interface_name_prefix = v.clone() }
        );
        flag!(
            self.nodeport_addresses,
            "--nodeport-addresses",
            ["nodePortAddresses"],
            |v| { c.node_port_addresses = v.to_config() }
        );
        // Upstream's iptables-named flags also drive nftables mode, which has the same knobs.
        flag!(
            self.masquerade_all,
            "--masquerade-all",
            ["iptables.masqueradeAll", "nftables.masqueradeAll"],
            |v| { (c.iptables.masquerade_all, c.nftables.masquerade_all) = (*v, *v) }
        );
        // As upstream, only iptables.masqueradeBit (iptables and ipvs modes): nftables mode's
        // bit is nftables.masqueradeBit, which no flag sets (warned about in nftables mode).
        flag!(
            self.iptables_masquerade_bit,
            "--iptables-masquerade-bit",
            ["iptables.masqueradeBit"],
            |v| { c.iptables.masquerade_bit = *v }
        );
        flag!(
            self.iptables_localhost_nodeports,
            "--iptables-localhost-nodeports",
            ["iptables.localhostNodePorts"],
            |v| { c.iptables.localhost_node_ports = *v }
        );
        flag!(
            self.iptables_sync_period,
            "--iptables-sync-period",
            ["iptables.syncPeriod", "nftables.syncPeriod"],
            |v| { (c.iptables.sync_period, c.nftables.sync_period) = (*v, *v) }
        );
        flag!(
            self.iptables_min_sync_period,
            "--iptables-min-sync-period",
            ["iptables.minSyncPeriod", "nftables.minSyncPeriod"],
            |v| { (c.iptables.min_sync_period, c.nftables.min_sync_period) = (*v, *v) }
        );
        flag!(
            self.ipvs_sync_period,
            "--ipvs-sync-period",
            ["ipvs.syncPeriod"],
            |v| { c.ipvs.sync_period = *v }
        );
        flag!(
            self.ipvs_min_sync_period,
            "--ipvs-min-sync-period",
            ["ipvs.minSyncPeriod"],
            |v| { c.ipvs.min_sync_period = *v }
        );
        flag!(
            self.ipvs_scheduler,
            "--ipvs-scheduler",
            ["ipvs.scheduler"],
            |v| { c.ipvs.scheduler = v.trim().to_owned() }
        );
        flag!(
            self.ipvs_exclude_cidrs,
            "--ipvs-exclude-cidrs",
            ["ipvs.excludeCIDRs"],
            |v| { c.ipvs.exclude_cidrs = Some(v.0.iter().map(IpNet::to_string).collect()) }
        );
        flag!(
            self.ipvs_strict_arp,
            "--ipvs-strict-arp",
            ["ipvs.strictARP"],
            |v| { c.ipvs.strict_arp = *v }
        );
        flag!(
            self.ipvs_tcp_timeout,
            "--ipvs-tcp-timeout",
            ["ipvs.tcpTimeout"],
            |v| { c.ipvs.tcp_timeout = *v }
        );
        flag!(
            self.ipvs_tcpfin_timeout,
            "--ipvs-tcpfin-timeout",
            ["ipvs.tcpFinTimeout"],
            |v| { c.ipvs.tcp_fin_timeout = *v }
        );
        flag!(
            self.ipvs_udp_timeout,
            "--ipvs-udp-timeout",
            ["ipvs.udpTimeout"],
            |v| { c.ipvs.udp_timeout = *v }
        );
        let ct = &mut c.conntrack;
        flag!(
            self.conntrack_max_per_core,
            "--conntrack-max-per-core",
            ["conntrack.maxPerCore"],
            |v| { ct.max_per_core = *v }
        );
        flag!(
            self.conntrack_min,
            "--conntrack-min",
            ["conntrack.min"],
            |v| ct.min = *v
        );
        flag!(
            self.conntrack_tcp_timeout_established,
            "--conntrack-tcp-timeout-established",
            ["conntrack.tcpEstablishedTimeout"],
            |v| { ct.tcp_established_timeout = *v }
        );
        flag!(
            self.conntrack_tcp_timeout_close_wait,
            "--conntrack-tcp-timeout-close-wait",
            ["conntrack.tcpCloseWaitTimeout"],
            |v| { ct.tcp_close_wait_timeout = *v }
        );
        flag!(
            self.conntrack_tcp_be_liberal,
            "--conntrack-tcp-be-liberal",
            ["conntrack.tcpBeLiberal"],
            |v| { ct.tcp_be_liberal = *v }
        );
        flag!(
            self.conntrack_udp_timeout,
            "--conntrack-udp-timeout",
            ["conntrack.udpTimeout"],
            |v| { ct.udp_timeout = *v }
        );
        flag!(
            self.conntrack_udp_timeout_stream,
            "--conntrack-udp-timeout-stream",
            ["conntrack.udpStreamTimeout"],
            |v| { ct.udp_stream_timeout = *v }
        );
        flag!(
            self.oom_score_adj,
            "--oom-score-adj",
            ["oomScoreAdj"],
            |v| c.oom_score_adj = *v
        );
        flag!(
            self.config_sync_period,
            "--config-sync-period",
            ["configSyncPeriod"],
            |v| { c.config_sync_period = *v }
        );
        flag!(
            self.proxy_port_range,
            "--proxy-port-range",
            ["portRange"],
            |v| { c.port_range = v.trim().to_owned() }
        );
        flag!(self.udp_timeout, "--udp-timeout", ["udpIdleTimeout"], |v| {
            c.udp_idle_timeout = *v
        });
        flag!(
            self.canary_period,
            "--canary-period",
            ["canaryPeriod"],
            |v| { c.canary_period = *v }
        );
        flag!(self.socket_lb, "--socket-lb", ["socketLB.enabled"], |v| {
            c.socket_lb.enabled = *v
        });
        flag!(
            self.socket_lb_cgroup,
            "--socket-lb-cgroup",
            ["socketLB.cgroup"],
            |v| { c.socket_lb.cgroup = v.trim().to_owned() }
        );
        flag!(
            self.userspace_max_connections_per_service,
            "--userspace-max-connections-per-service",
            ["userspace.maxConnectionsPerService"],
            |v| { c.userspace.max_connections_per_service = *v }
        );
        flag!(
            self.userspace_max_udp_sessions_per_service,
            "--userspace-max-udp-sessions-per-service",
            ["userspace.maxUDPSessionsPerService"],
            |v| { c.userspace.max_udp_sessions_per_service = *v }
        );
        let wk = &mut c.winkernel;
        flag!(
            self.network_name,
            "--network-name",
            ["winkernel.networkName"],
            |v| { wk.network_name = v.clone() }
        );
        flag!(
            self.source_vip,
            "--source-vip",
            ["winkernel.sourceVip"],
            |v| { wk.source_vip = v.clone() }
        );
        flag!(
            self.enable_dsr,
            "--enable-dsr",
            ["winkernel.enableDSR"],
            |v| wk.enable_dsr = *v
        );
        flag!(
            self.root_hns_endpoint_name,
            "--root-hnsendpoint-name",
            ["winkernel.rootHnsEndpointName"],
            |v| { wk.root_hns_endpoint_name = v.clone() }
        );
        flag!(
            self.forward_healthcheck_vip,
            "--forward-healthcheck-vip",
            ["winkernel.forwardHealthCheckVip"],
            |v| { wk.forward_health_check_vip = *v }
        );
        flag!(
            self.windows_service,
            "--windows-service",
            ["windowsRunAsService"],
            |v| { c.windows_run_as_service = *v }
        );
        if self.write_config_to.is_none() {
            flag!(
                self.healthz_port,
                "--healthz-port",
                ["healthzBindAddress"],
                |v| { port_from_deprecated_flag(&mut c.healthz_bind_address, *v) }
            );
            flag!(
                self.metrics_port,
                "--metrics-port",
                ["metricsBindAddress"],
                |v| { port_from_deprecated_flag(&mut c.metrics_bind_address, *v) }
            );
        }
        set
    }

    /// Applies the flags that win over a config file: `--hostname-override` (trimmed and
    /// lowercased, as upstream) and the logging flags.
    pub(crate) fn apply_overriding_flags(&self, c: &mut KubeProxyConfiguration) -> Vec<FlagFields> {
        let mut set: Vec<FlagFields> = Vec::new();
        if let Some(name) = self
            .hostname_override
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
        {
            c.hostname_override = name.to_lowercase();
            set.push(("--hostname-override", &["hostnameOverride"]));
        }
        if let Some(backend) = self.iptables_backend {
            c.iptables_backend = backend;
            set.push(("--iptables-backend", &["iptablesBackend"]));
        }
        if let Some(layout) = self.nftables_layout {
            c.nftables_layout = layout;
            set.push(("--nftables-layout", &["nftablesLayout"]));
        }
        if let Some(level) = self.verbosity {
            c.logging.verbosity = level;
            set.push(("--v", &["logging.verbosity"]));
        }
        if let Some(vmodule) = &self.vmodule {
            c.logging.vmodule = vmodule.0.clone();
            set.push(("--vmodule", &["logging.vmodule"]));
        }
        if let Some(format) = &self.logging_format {
            c.logging.format = format.trim().to_owned();
            set.push(("--logging-format", &["logging.format"]));
        }
        if let Some(frequency) = self.log_flush_frequency {
            c.logging.flush_frequency = frequency;
            set.push(("--log-flush-frequency", &["logging.flushFrequency"]));
        }
        let options = &mut c.logging.options;
        if let Some(split) = self.log_json_split_stream {
            options.json.split_stream = split;
            set.push((
                "--log-json-split-stream",
                &["logging.options.json.splitStream"],
            ));
        }
        if let Some(size) = &self.log_json_info_buffer_size {
            options.json.info_buffer_size = size.trim().to_owned();
            set.push((
                "--log-json-info-buffer-size",
                &["logging.options.json.infoBufferSize"],
            ));
        }
        if let Some(split) = self.log_text_split_stream {
            options.text.split_stream = split;
            set.push((
                "--log-text-split-stream",
                &["logging.options.text.splitStream"],
            ));
        }
        if let Some(size) = &self.log_text_info_buffer_size {
            options.text.info_buffer_size = size.trim().to_owned();
            set.push((
                "--log-text-info-buffer-size",
                &["logging.options.text.infoBufferSize"],
            ));
        }
        set
    }
}

impl Options {
    /// Flags given that upstream's `mode` ignores: named, so that nothing is dropped silently.
    pub(crate) fn flags_of_other_modes(&self, mode: ProxyMode) -> Vec<String> {
        let mut out = Vec::new();
        let mut other = |given: bool, flag: &str, applies: &str| {
            if given {
                out.push(format!(
                    "flag {flag} has no effect in {mode} mode (it applies to {applies}), as upstream"
                ));
            }
        };
        let iptables_based = matches!(mode, ProxyMode::Iptables | ProxyMode::Ipvs);
        other(
            self.iptables_masquerade_bit.is_some() && !iptables_based,
            "--iptables-masquerade-bit",
            "iptables and ipvs modes; nftables mode uses nftables.masqueradeBit from a config file",
        );
        other(
            self.iptables_localhost_nodeports.is_some() && mode != ProxyMode::Iptables,
            "--iptables-localhost-nodeports",
            "iptables mode",
        );
        other(
            (self.iptables_sync_period.is_some() || self.iptables_min_sync_period.is_some())
                && mode == ProxyMode::Ipvs,
            "--iptables-sync-period / --iptables-min-sync-period",
            "iptables and nftables modes; ipvs mode uses --ipvs-sync-period / --ipvs-min-sync-period",
        );
        let ipvs_flags = [
            self.ipvs_sync_period.is_some(),
            self.ipvs_min_sync_period.is_some(),
            self.ipvs_scheduler.is_some(),
            self.ipvs_exclude_cidrs.is_some(),
            self.ipvs_strict_arp.is_some(),
            self.ipvs_tcp_timeout.is_some(),
            self.ipvs_tcpfin_timeout.is_some(),
            self.ipvs_udp_timeout.is_some(),
        ];
        other(
            ipvs_flags.contains(&true) && mode != ProxyMode::Ipvs,
            "--ipvs-*",
            "ipvs mode",
        );
        out
    }
}

/// Upstream's `addressFromDeprecatedFlags`: port 0 disables the server; another port is
/// appended only to an address given without one (the default address has a port, so
/// `--healthz-port=N` alone changes nothing upstream either).
fn port_from_deprecated_flag(address: &mut Option<String>, port: i32) {
    if port == 0 {
        *address = Some(String::new());
        return;
    }
    if let Some(value) = address
        && let (Ok(ip), Ok(port)) = (value.trim().parse::<IpAddr>(), u16::try_from(port))
    {
        *value = std::net::SocketAddr::new(ip, port).to_string();
    }
}

/// Renames errors about fields that a flag set to the flag's name, so users are pointed at
/// what they actually typed.
pub(crate) fn attribute_to_flags(errors: &mut [FieldError], set: &[FlagFields]) {
    for error in errors {
        let base = error.field.split('[').next().unwrap_or_default();
        if let Some((flag, _)) = set.iter().find(|(_, fields)| fields.contains(&base)) {
            error.field = (*flag).to_owned();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from(std::iter::once("kube-proxy").chain(args.iter().copied()))
    }

    #[test]
    fn command_definition_is_consistent() {
        use clap::CommandFactory;
        Options::command().debug_assert();
    }

    #[test]
    fn verbosity_accepts_go_spellings() {
        for args in [
            &["--v=4"][..],
            &["--v", "4"],
            &["-v=4"],
            &["-v", "4"],
            &["-v4"],
            &["-v", "2", "--v=4"],
        ] {
            let opts = parse(args).map_err(|e| e.to_string());
            assert_eq!(opts.map(|o| o.verbosity), Ok(Some(4)), "{args:?}");
        }
        assert!(parse(&["--v=-1"]).is_err());
        assert!(parse(&["-v"]).is_err());
    }

    #[test]
    fn bool_flags_bare_or_with_value() {
        let cases: &[(&[&str], Option<bool>)] = &[
            (&[], None),
            (&["--masquerade-all"], Some(true)),
            (&["--masquerade-all=true"], Some(true)),
            (&["--masquerade-all=false"], Some(false)),
            (&["--masquerade-all=0"], Some(false)),
            (&["--masquerade-all=T"], Some(true)),
        ];
        for (args, want) in cases {
            let opts = parse(args).map_err(|e| e.to_string());
            assert_eq!(opts.map(|o| o.masquerade_all), Ok(*want), "{args:?}");
        }
        assert!(parse(&["--masquerade-all=maybe"]).is_err());
        // As with Go's flag package, a separate word after a bool flag is a positional.
        assert!(parse(&["--masquerade-all", "false"]).is_err());
        let opts = parse(&["--cleanup", "--init-only=false"]).map_err(|e| e.to_string());
        assert_eq!(opts.map(|o| (o.cleanup, o.init_only)), Ok((true, false)));
    }

    #[test]
    fn typed_values_parse() {
        let opts = parse(&[
            "--iptables-sync-period=1m",
            "--ipvs-min-sync-period",
            "500ms",
            "--proxy-mode=nftables",
            "--oom-score-adj",
            "-500",
            "--bind-address=::",
            "--feature-gates=A=true,B=false",
            "--vmodule=proxier=5,runner=2",
            "--ipvs-exclude-cidrs=10.0.0.0/8,fd00::/64",
            "--detect-local-mode=InterfaceNamePrefix",
            "--healthz-bind-address=",
        ]);
        let opts = match opts {
            Ok(o) => o,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(opts.iptables_sync_period, Some(Duration::from_secs(60)));
        assert_eq!(opts.ipvs_min_sync_period, Some(Duration::from_millis(500)));
        assert_eq!(opts.proxy_mode, Some(ProxyMode::Nftables));
        assert_eq!(opts.oom_score_adj, Some(-500));
        assert_eq!(opts.bind_address, "::".parse().ok());
        let gates = opts.feature_gates.map(|g| g.0).unwrap_or_default();
        assert_eq!(gates.get("A"), Some(&true));
        assert_eq!(gates.get("B"), Some(&false));
        assert_eq!(opts.vmodule.map(|v| v.0.len()), Some(2));
        assert_eq!(opts.ipvs_exclude_cidrs.map(|v| v.0.len()), Some(2));
        assert_eq!(opts.detect_local_mode, Some(LocalMode::InterfaceNamePrefix));
        assert_eq!(opts.healthz_bind_address.as_deref(), Some(""));
    }

    #[test]
    fn bad_values_are_rejected_naming_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&["--iptables-sync-period=-5s"], "--iptables-sync-period"),
            (&["--iptables-sync-period=30"], "--iptables-sync-period"),
            (&["--proxy-mode=bogus"], "--proxy-mode"),
            (
                &["--nodeport-addresses=10.0.0.0/8,primary,Localhost"],
                "--nodeport-addresses",
            ),
            (&["--nodeport-addresses=10.0.0.0"], "--nodeport-addresses"),
            (&["--feature-gates=A=yes"], "--feature-gates"),
            (&["--vmodule=x"], "--vmodule"),
            (&["--bind-address=node-1"], "--bind-address"),
            (&["--conntrack-min=lots"], "--conntrack-min"),
            (&["--detect-local-mode=clustercidr"], "--detect-local-mode"),
        ];
        for (args, flag) in cases {
            match parse(args) {
                Ok(_) => panic!("{args:?} was accepted"),
                Err(e) => assert!(e.to_string().contains(flag), "{args:?}: {e}"),
            }
        }
    }

    #[test]
    fn nodeport_addresses_forms() {
        let get = |arg: &str| parse(&[arg]).ok().and_then(|o| o.nodeport_addresses);
        assert_eq!(
            get("--nodeport-addresses=primary"),
            Some(NodePortAddressesSetting::primary())
        );
        assert!(matches!(
            get("--nodeport-addresses=primary,localhost,all,10.0.0.0/8"),
            Some(NodePortAddressesSetting::Listed(e)) if e.len() == 4
        ));
        assert_eq!(get("--nodeport-addresses=primary,lo,10.0.0.0/33"), None);
        assert_eq!(
            get("--nodeport-addresses="),
            Some(NodePortAddressesSetting::All)
        );
        assert!(matches!(
            get("--nodeport-addresses=10.0.0.0/8, fd00::/64"),
            Some(NodePortAddressesSetting::Listed(c)) if c.len() == 2
        ));
    }

    #[test]
    fn positional_arguments_are_rejected() {
        assert!(parse(&["extra"]).is_err());
        assert!(parse(&["--config=/x", "extra"]).is_err());
    }

    #[test]
    fn version_names_this_project() {
        let e = parse(&["--version"]).err();
        assert_eq!(
            e.as_ref().map(clap::Error::kind),
            Some(clap::error::ErrorKind::DisplayVersion)
        );
        let text = e.map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(text.trim(), crate::VERSION);
    }

    #[test]
    fn help_mentions_the_extension() {
        use clap::CommandFactory;
        let help = Options::command().render_long_help().to_string();
        assert!(help.contains("--manifests <PATH>"));
        assert!(help.contains("--nodeport-addresses <CIDRS>"));
    }

    #[test]
    fn help_reads_like_upstreams_and_lists_the_subcommands() {
        use clap::CommandFactory;
        for help in [
            Options::command().render_help().to_string(),
            Options::command().render_long_help().to_string(),
        ] {
            assert!(help.starts_with("The Kubernetes network proxy"), "{help}");
            for usage in [
                "  kube-proxy [flags]",
                "  kube-proxy explain ",
                "  kube-proxy demo ",
            ] {
                assert!(help.contains(usage), "usage line {usage:?}:\n{help}");
            }
            assert!(
                help.contains("\n  explain ") && help.contains("\n  demo "),
                "{help}"
            );
            // Rustdoc's link and code syntax means nothing on a terminal.
            assert!(!help.contains("[`") && !help.contains('`'), "{help}");
        }
    }

    #[test]
    fn flags_set_the_matching_fields() {
        let opts = parse(&[
            "--masquerade-all",
            "--iptables-min-sync-period=2s",
            "--conntrack-max-per-core=0",
            "--kubeconfig=/etc/kubeconfig",
        ]);
        let Ok(opts) = opts else {
            panic!("{opts:?}");
        };
        let mut c = KubeProxyConfiguration::default();
        let set = opts.apply_config_flags(&mut c);
        assert!(c.iptables.masquerade_all && c.nftables.masquerade_all);
        assert_eq!(c.nftables.min_sync_period, Duration::from_secs(2));
        assert_eq!(c.conntrack.max_per_core, 0);
        assert_eq!(c.client_connection.kubeconfig, "/etc/kubeconfig");
        let names: Vec<&str> = set.iter().map(|(f, _)| *f).collect();
        assert_eq!(
            names,
            [
                "--kubeconfig",
                "--masquerade-all",
                "--iptables-min-sync-period",
                "--conntrack-max-per-core"
            ]
        );
    }
}
