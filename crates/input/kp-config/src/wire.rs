//! Decoding of configuration files, with upstream's v1alpha1 defaulting.
//!
//! As upstream, a file is first checked strictly: unknown and duplicate fields are strict
//! errors. Upstream then decodes leniently (unknown fields skipped, the last of duplicate
//! fields wins) and only logs the strict errors; so does this module, returning one warning
//! per problem that names the field and its line.
//!
//! The file is read into a mirror of the schema where every field is optional. Upstream's
//! defaulting (`SetDefaults_KubeProxyConfiguration`) then fills absent and `null` fields, and
//! also the zero values it treats as unset: a `0s` `iptables.syncPeriod` is 30s, `qps: 0` is
//! 5, `healthzBindAddress: ""` is the default address. Values whose syntax serde cannot judge
//! with a useful message (durations, modes) are converted afterwards so that all of them are
//! reported together, each naming its field and line.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::{DuplicateKeyPolicy, Spanned};

use crate::audit;
use crate::duration;
use crate::load::LoadError;
use crate::types::{
    API_VERSION, ClientConnection, ConntrackConfiguration, DetectLocalConfiguration,
    IptablesConfiguration, IpvsConfiguration, KIND, KubeProxyConfiguration, LogFormatOptions,
    Logging, LoggingOptions, NftablesConfiguration, SocketLbConfiguration, UserspaceConfiguration,
    VModuleItem, WinkernelConfiguration,
};
use crate::validate::FieldError;

type Text = Option<String>;
type Located = Option<Spanned<String>>;

/// Just the type header; read leniently first so that a file of another kind gets a
/// "wrong kind" error rather than a list of unknown fields.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    api_version: Text,
    kind: Text,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Config {
    #[allow(dead_code)]
    api_version: Text,
    #[allow(dead_code)]
    kind: Text,
    feature_gates: Option<BTreeMap<String, bool>>,
    client_connection: Option<Client>,
    logging: Option<Log>,
    hostname_override: Text,
    bind_address: Text,
    healthz_bind_address: Text,
    metrics_bind_address: Text,
    bind_address_hard_fail: Option<bool>,
    enable_profiling: Option<bool>,
    show_hidden_metrics_for_version: Text,
    service_proxy_name: Text,
    mode: Located,
    iptables: Option<Iptables>,
    ipvs: Option<Ipvs>,
    nftables: Option<Nftables>,
    winkernel: Option<Winkernel>,
    detect_local_mode: Located,
    detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Text,
    node_port_addresses: Option<Vec<String>>,
    oom_score_adj: Option<i32>,
    conntrack: Option<Conntrack>,
    config_sync_period: Located,
    port_range: Text,
    udp_idle_timeout: Located,
    windows_run_as_service: Option<bool>,
    userspace: Option<Userspace>,
    iptables_backend: Located,
    nftables_layout: Located,
    canary_period: Located,
    #[serde(rename = "socketLB")]
    socket_lb: Option<SocketLb>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct SocketLb {
    enabled: Option<bool>,
    cgroup: Text,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Userspace {
    max_connections_per_service: Option<i32>,
    #[serde(rename = "maxUDPSessionsPerService")]
    max_udp_sessions_per_service: Option<i32>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Client {
    kubeconfig: Text,
    accept_content_types: Text,
    content_type: Text,
    qps: Option<f32>,
    burst: Option<i32>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Log {
    format: Text,
    flush_frequency: Located,
    verbosity: Option<Spanned<i64>>,
    vmodule: Option<Vec<VModule>>,
    options: Option<LogOptions>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct VModule {
    file_pattern: String,
    verbosity: u32,
}

#[derive(Deserialize, Default)]
struct LogOptions {
    json: Option<LogFormat>,
    text: Option<LogFormat>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct LogFormat {
    split_stream: Option<bool>,
    /// A resource quantity: upstream accepts a string (`"64Ki"`) or a number.
    info_buffer_size: Option<Scalar>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Iptables {
    masquerade_bit: Option<i32>,
    masquerade_all: Option<bool>,
    localhost_node_ports: Option<bool>,
    sync_period: Located,
    min_sync_period: Located,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Ipvs {
    sync_period: Located,
    min_sync_period: Located,
    scheduler: Text,
    #[serde(rename = "excludeCIDRs")]
    exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    strict_arp: Option<bool>,
    tcp_timeout: Located,
    tcp_fin_timeout: Located,
    udp_timeout: Located,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Nftables {
    masquerade_bit: Option<i32>,
    masquerade_all: Option<bool>,
    sync_period: Located,
    min_sync_period: Located,
    table_name: Text,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Winkernel {
    network_name: Text,
    source_vip: Text,
    #[serde(rename = "enableDSR")]
    enable_dsr: Option<bool>,
    root_hns_endpoint_name: Text,
    forward_health_check_vip: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct DetectLocal {
    bridge_interface: Text,
    interface_name_prefix: Text,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Conntrack {
    max_per_core: Option<i32>,
    min: Option<i32>,
    tcp_established_timeout: Located,
    tcp_close_wait_timeout: Located,
    tcp_be_liberal: Option<bool>,
    udp_timeout: Located,
    udp_stream_timeout: Located,
}

/// What [`decode`] produced.
pub(crate) struct Decoded {
    /// The configuration with upstream's static defaults applied.
    pub config: KubeProxyConfiguration,
    /// Values that were syntactically bad (each replaced by its default).
    pub errors: Vec<FieldError>,
    /// Strict-decoding problems that the lenient decode skipped, one line each.
    pub warnings: Vec<String>,
}

/// Decodes a YAML or JSON `KubeProxyConfiguration`, applying upstream's static defaults.
///
/// `origin` names the input in errors (usually the path). Dependent defaults and validation
/// are left to the caller.
pub(crate) fn decode(text: &str, origin: &str) -> Result<Decoded, LoadError> {
    let meta = serde_saphyr::from_str_with_options::<Option<TypeMeta>>(text, lenient())
        .map_err(|e| decode_error(origin, &e))?
        .ok_or_else(|| LoadError::Decode {
            origin: origin.to_owned(),
            line: 0,
            column: 0,
            message: "the document is empty".to_owned(),
        })?;
    let api_version = meta.api_version.unwrap_or_default();
    let kind = meta.kind.unwrap_or_default();
    if api_version != API_VERSION || kind != KIND {
        return Err(LoadError::WrongKind {
            origin: origin.to_owned(),
            api_version,
            kind,
        });
    }
    let wire: Config = serde_saphyr::from_str_with_options(text, lenient())
        .map_err(|e| decode_error(origin, &e))?;
    let warnings = strict_problems(text)
        .into_iter()
        .map(|problem| {
            format!(
                "{origin}: {problem} (strict decoding failed; decoded leniently, as upstream does)"
            )
        })
        .collect();
    let mut conv = Converter::default();
    let config = conv.config(wire);
    Ok(Decoded {
        config,
        errors: conv.errors,
        warnings,
    })
}

/// Upstream's lenient decoder: unknown fields are skipped, the last duplicate wins.
fn lenient() -> serde_saphyr::Options {
    let mut options = serde_saphyr::Options::default();
    options.duplicate_keys = DuplicateKeyPolicy::LastWins;
    options
}

/// What upstream's strict decoder would complain about: every unknown field (by its full
/// path, e.g. `iptables.masqueradeBitt`) and every duplicate field, in document order.
fn strict_problems(text: &str) -> Vec<String> {
    let mut options = serde_saphyr::Options::default();
    options.duplicate_keys = DuplicateKeyPolicy::PassThrough;
    // The lenient decode succeeded, so this one does too; if not, there is nothing to add.
    let Ok(root) = serde_saphyr::from_str_with_options::<Node>(text, options) else {
        return Vec::new();
    };
    let mut problems = Vec::new();
    walk(&root, "", &mut problems);
    problems
}

/// A YAML/JSON value reduced to what the strict check needs: mappings with every entry
/// (duplicates included) and the line of each key.
enum Node {
    Map(Vec<(String, usize, Node)>),
    Seq(Vec<Node>),
    Other,
}

/// The keys of `logging.vmodule` entries (the only list of objects in the schema).
const VMODULE_KEYS: [&str; 2] = ["filePattern", "verbosity"];

fn walk(node: &Node, prefix: &str, problems: &mut Vec<String>) {
    let entries = match node {
        Node::Map(entries) => entries,
        Node::Seq(items) if prefix == "logging.vmodule." => {
            for (i, item) in items.iter().enumerate() {
                let Node::Map(entries) = item else { continue };
                for (key, line, _) in entries {
                    if !VMODULE_KEYS.contains(&key.as_str()) {
                        let at = if *line == 0 {
                            String::new()
                        } else {
                            format!(" (line {line})")
                        };
                        problems.push(format!(
                            "unknown field \"logging.vmodule[{i}].{key}\"{at}: skipped"
                        ));
                    }
                }
            }
            return;
        }
        _ => return,
    };
    // Maps with free keys (featureGates) have no unknown keys.
    if !prefix.is_empty() && audit::is_free_map(prefix.trim_end_matches('.')) {
        return;
    }
    let mut seen = std::collections::BTreeSet::new();
    for (key, line, value) in entries {
        let path = format!("{prefix}{key}");
        let at = if *line == 0 {
            String::new()
        } else {
            format!(" (line {line})")
        };
        if !seen.insert(key.as_str()) {
            problems.push(format!(
                "duplicate field {path:?}{at}: the last one is used"
            ));
            continue;
        }
        if !audit::is_known_path(&path) {
            problems.push(format!("unknown field {path:?}{at}: skipped"));
            continue;
        }
        walk(value, &format!("{path}."), problems);
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<Scalar>>()? {
            let value: Node = map.next_value()?;
            entries.push((key.value.0, key.referenced.line() as usize, value));
        }
        Ok(Node::Map(entries))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Node>()? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_str<E>(self, _: &str) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_none<E>(self) -> Result<Node, E> {
        Ok(Node::Other)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

/// Any scalar (string, number, bool) as its text: map keys, and resource quantities that
/// upstream accepts as a string or a number.
#[derive(Debug, Clone, PartialEq)]
struct Scalar(String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;
        impl Visitor<'_> for ScalarVisitor {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a number")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.to_owned()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
        }
        deserializer.deserialize_any(ScalarVisitor)
    }
}

fn decode_error(origin: &str, error: &serde_saphyr::Error) -> LoadError {
    let location = error.location();
    let (line, column) = location.map_or((0, 0), |l| (l.line(), l.column()));
    let message = error.without_snippet().to_string();
    // The position goes into our own fields; drop serde-saphyr's copy of it.
    let suffix = format!(" at line {line}, column {column}");
    let message = message
        .strip_suffix(&suffix)
        .map_or_else(|| message.clone(), str::to_owned);
    LoadError::Decode {
        origin: origin.to_owned(),
        line,
        column,
        message,
    }
}

/// Turns the optional mirror into the effective configuration, collecting bad values.
#[derive(Default)]
struct Converter {
    errors: Vec<FieldError>,
}

impl Converter {
    fn config(&mut self, w: Config) -> KubeProxyConfiguration {
        let d = KubeProxyConfiguration::default();
        KubeProxyConfiguration {
            feature_gates: w.feature_gates.unwrap_or_default(),
            client_connection: client(w.client_connection.unwrap_or_default()),
            logging: self.logging(w.logging.unwrap_or_default()),
            hostname_override: w.hostname_override.unwrap_or_default(),
            // An empty bindAddress can only mean "unset", as upstream treats it.
            bind_address: w
                .bind_address
                .filter(|a| !a.is_empty())
                .unwrap_or(d.bind_address),
            // Upstream defaults an empty address like an absent one (only the flag can
            // disable a server).
            healthz_bind_address: w.healthz_bind_address.filter(|a| !a.is_empty()),
            metrics_bind_address: w.metrics_bind_address.filter(|a| !a.is_empty()),
            bind_address_hard_fail: w.bind_address_hard_fail.unwrap_or_default(),
            enable_profiling: w.enable_profiling.unwrap_or_default(),
            show_hidden_metrics_for_version: w.show_hidden_metrics_for_version.unwrap_or_default(),
            service_proxy_name: w.service_proxy_name.unwrap_or_default(),
            mode_defaulted: w.mode.as_ref().is_none_or(|m| m.value.is_empty()),
            mode: self.parsed("mode", w.mode, d.mode),
            iptables: self.iptables(w.iptables.unwrap_or_default()),
            ipvs: self.ipvs(w.ipvs.unwrap_or_default()),
            nftables: self.nftables(w.nftables.unwrap_or_default()),
            winkernel: winkernel(w.winkernel.unwrap_or_default()),
            detect_local_mode: self.parsed(
                "detectLocalMode",
                w.detect_local_mode,
                d.detect_local_mode,
            ),
            detect_local: detect_local(w.detect_local.unwrap_or_default()),
            cluster_cidr: w.cluster_cidr.unwrap_or_default(),
            node_port_addresses: w.node_port_addresses,
            oom_score_adj: w.oom_score_adj.unwrap_or(d.oom_score_adj),
            conntrack: self.conntrack(w.conntrack.unwrap_or_default()),
            config_sync_period: self.duration_or_default(
                "configSyncPeriod",
                w.config_sync_period,
                d.config_sync_period,
            ),
            port_range: w.port_range.unwrap_or_default(),
            udp_idle_timeout: self.duration_or_default(
                "udpIdleTimeout",
                w.udp_idle_timeout,
                d.udp_idle_timeout,
            ),
            windows_run_as_service: w.windows_run_as_service.unwrap_or_default(),
            userspace: userspace(w.userspace.unwrap_or_default()),
            iptables_backend: self.parsed(
                "iptablesBackend",
                w.iptables_backend,
                d.iptables_backend,
            ),
            nftables_layout: self.parsed("nftablesLayout", w.nftables_layout, d.nftables_layout),
            canary_period: self.duration("canaryPeriod", w.canary_period, d.canary_period),
            socket_lb: socket_lb(w.socket_lb.unwrap_or_default()),
        }
    }

    fn logging(&mut self, w: Log) -> Logging {
        let d = Logging::default();
        let verbosity = match w.verbosity {
            None => d.verbosity,
            Some(v) => u32::try_from(v.value).unwrap_or_else(|_| {
                self.errors.push(FieldError::new(
                    "logging.verbosity",
                    v.value.to_string(),
                    format!(
                        "{}{}",
                        if v.value < 0 {
                            "must not be negative"
                        } else {
                            "too large"
                        },
                        at_line(&v)
                    ),
                ));
                d.verbosity
            }),
        };
        let options = w.options.unwrap_or_default();
        Logging {
            format: w.format.filter(|f| !f.is_empty()).unwrap_or(d.format),
            flush_frequency: self.flush_frequency(w.flush_frequency, d.flush_frequency),
            verbosity,
            vmodule: w
                .vmodule
                .unwrap_or_default()
                .into_iter()
                .map(|m| VModuleItem {
                    file_pattern: m.file_pattern,
                    verbosity: m.verbosity,
                })
                .collect(),
            options: LoggingOptions {
                json: log_format(options.json.unwrap_or_default()),
                text: log_format(options.text.unwrap_or_default()),
            },
        }
    }

    /// component-base also accepts a plain integer of nanoseconds here.
    fn flush_frequency(&mut self, raw: Located, default: Duration) -> Duration {
        if let Some(nanos) = raw
            .as_ref()
            .and_then(|r| r.value.trim().parse::<u64>().ok())
        {
            return match nanos {
                0 => default,
                nanos => Duration::from_nanos(nanos),
            };
        }
        self.duration_or_default("logging.flushFrequency", raw, default)
    }

    fn iptables(&mut self, w: Iptables) -> IptablesConfiguration {
        let d = IptablesConfiguration::default();
        IptablesConfiguration {
            masquerade_bit: w.masquerade_bit.unwrap_or(d.masquerade_bit),
            masquerade_all: w.masquerade_all.unwrap_or(d.masquerade_all),
            localhost_node_ports: w.localhost_node_ports.unwrap_or(d.localhost_node_ports),
            sync_period: self.duration_or_default(
                "iptables.syncPeriod",
                w.sync_period,
                d.sync_period,
            ),
            min_sync_period: self.duration_or_default(
                "iptables.minSyncPeriod",
                w.min_sync_period,
                d.min_sync_period,
            ),
        }
    }

    fn ipvs(&mut self, w: Ipvs) -> IpvsConfiguration {
        let d = IpvsConfiguration::default();
        IpvsConfiguration {
            sync_period: self.duration_or_default("ipvs.syncPeriod", w.sync_period, d.sync_period),
            min_sync_period: self.duration(
                "ipvs.minSyncPeriod",
                w.min_sync_period,
                d.min_sync_period,
            ),
            scheduler: w.scheduler.unwrap_or(d.scheduler),
            exclude_cidrs: w.exclude_cidrs,
            strict_arp: w.strict_arp.unwrap_or(d.strict_arp),
            tcp_timeout: self.duration("ipvs.tcpTimeout", w.tcp_timeout, d.tcp_timeout),
            tcp_fin_timeout: self.duration(
                "ipvs.tcpFinTimeout",
                w.tcp_fin_timeout,
                d.tcp_fin_timeout,
            ),
            udp_timeout: self.duration("ipvs.udpTimeout", w.udp_timeout, d.udp_timeout),
        }
    }

    fn nftables(&mut self, w: Nftables) -> NftablesConfiguration {
        let d = NftablesConfiguration::default();
        NftablesConfiguration {
            masquerade_bit: w.masquerade_bit.unwrap_or(d.masquerade_bit),
            masquerade_all: w.masquerade_all.unwrap_or(d.masquerade_all),
            sync_period: self.duration_or_default(
                "nftables.syncPeriod",
                w.sync_period,
                d.sync_period,
            ),
            min_sync_period: self.duration_or_default(
                "nftables.minSyncPeriod",
                w.min_sync_period,
                d.min_sync_period,
            ),
            table_name: w.table_name.unwrap_or(d.table_name),
        }
    }

    fn conntrack(&mut self, w: Conntrack) -> ConntrackConfiguration {
        let d = ConntrackConfiguration::default();
        ConntrackConfiguration {
            max_per_core: w.max_per_core.unwrap_or(d.max_per_core),
            min: w.min.unwrap_or(d.min),
            tcp_established_timeout: self.duration(
                "conntrack.tcpEstablishedTimeout",
                w.tcp_established_timeout,
                d.tcp_established_timeout,
            ),
            tcp_close_wait_timeout: self.duration(
                "conntrack.tcpCloseWaitTimeout",
                w.tcp_close_wait_timeout,
                d.tcp_close_wait_timeout,
            ),
            tcp_be_liberal: w.tcp_be_liberal.unwrap_or(d.tcp_be_liberal),
            udp_timeout: self.duration("conntrack.udpTimeout", w.udp_timeout, d.udp_timeout),
            udp_stream_timeout: self.duration(
                "conntrack.udpStreamTimeout",
                w.udp_stream_timeout,
                d.udp_stream_timeout,
            ),
        }
    }

    /// Upstream's defaulting for `metav1.Duration` fields that are not pointers: zero is
    /// "unset" and gets the default.
    fn duration_or_default(&mut self, field: &str, raw: Located, default: Duration) -> Duration {
        match self.duration(field, raw, default) {
            Duration::ZERO => default,
            value => value,
        }
    }

    fn duration(&mut self, field: &str, raw: Located, default: Duration) -> Duration {
        let Some(raw) = raw else {
            return default;
        };
        duration::parse(raw.value.trim()).unwrap_or_else(|e| {
            self.errors.push(FieldError::new(
                field,
                raw.value.clone(),
                format!("{e}{}", at_line(&raw)),
            ));
            default
        })
    }

    fn parsed<T: FromStr<Err = String>>(&mut self, field: &str, raw: Located, default: T) -> T {
        let Some(raw) = raw else {
            return default;
        };
        raw.value.parse().unwrap_or_else(|e| {
            self.errors.push(FieldError::new(
                field,
                raw.value.clone(),
                format!("{e}{}", at_line(&raw)),
            ));
            default
        })
    }
}

fn client(w: Client) -> ClientConnection {
    let d = ClientConnection::default();
    ClientConnection {
        kubeconfig: w.kubeconfig.unwrap_or(d.kubeconfig),
        accept_content_types: w.accept_content_types.unwrap_or(d.accept_content_types),
        content_type: w
            .content_type
            .filter(|c| !c.is_empty())
            .unwrap_or(d.content_type),
        // Zero is unset for upstream's defaulting.
        qps: w.qps.filter(|q| *q != 0.0).unwrap_or(d.qps),
        burst: w.burst.filter(|b| *b != 0).unwrap_or(d.burst),
    }
}

fn log_format(w: LogFormat) -> LogFormatOptions {
    let d = LogFormatOptions::default();
    LogFormatOptions {
        split_stream: w.split_stream.unwrap_or(d.split_stream),
        info_buffer_size: w
            .info_buffer_size
            .map(|q| q.0)
            .filter(|q| !q.is_empty())
            .unwrap_or(d.info_buffer_size),
    }
}

fn winkernel(w: Winkernel) -> WinkernelConfiguration {
    WinkernelConfiguration {
        network_name: w.network_name.unwrap_or_default(),
        source_vip: w.source_vip.unwrap_or_default(),
        enable_dsr: w.enable_dsr.unwrap_or_default(),
        root_hns_endpoint_name: w.root_hns_endpoint_name.unwrap_or_default(),
        forward_health_check_vip: w.forward_health_check_vip.unwrap_or_default(),
    }
}

fn userspace(w: Userspace) -> UserspaceConfiguration {
    let d = UserspaceConfiguration::default();
    UserspaceConfiguration {
        max_connections_per_service: w
            .max_connections_per_service
            .unwrap_or(d.max_connections_per_service),
        max_udp_sessions_per_service: w
            .max_udp_sessions_per_service
            .unwrap_or(d.max_udp_sessions_per_service),
    }
}

fn socket_lb(w: SocketLb) -> SocketLbConfiguration {
    SocketLbConfiguration {
        enabled: w.enabled.unwrap_or_default(),
        cgroup: w.cgroup.unwrap_or_default(),
    }
}

fn detect_local(w: DetectLocal) -> DetectLocalConfiguration {
    DetectLocalConfiguration {
        bridge_interface: w.bridge_interface.unwrap_or_default(),
        interface_name_prefix: w.interface_name_prefix.unwrap_or_default(),
    }
}

/// ` (line N)` when the location is known.
fn at_line<T>(spanned: &Spanned<T>) -> String {
    match spanned.referenced.line() {
        0 => String::new(),
        line => format!(" (line {line})"),
    }
}
