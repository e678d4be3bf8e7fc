//! What happens to every upstream configuration field, flag and feature gate.
//!
//! Upstream kube-proxy accepts settings that cannot apply to this implementation (Windows
//! settings on Linux, profiling, log options of formats we do not write). None of them may be
//! dropped silently: each is listed here as either [`Treatment::Effective`] or
//! [`Treatment::Warned`], and [`KubeProxyConfiguration::ignored_settings`] names every warned
//! one that a configuration sets to something other than upstream's default, so the binary
//! logs it at start-up. The tables are checked against the schema and the command line by
//! tests, so a new field or flag cannot be added without deciding its treatment.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::types::{KubeProxyConfiguration, ProxyMode};

/// What kube-proxy-rs does with a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Works as upstream.
    Effective,
    /// kube-proxy-rs's own setting (not in upstream's schema); works.
    Extension,
    /// Accepted but has no effect here; setting it to a non-default value is warned about
    /// at start-up, with this reason.
    Warned(&'static str),
}

/// A configuration field, by its path in the file (`iptables.syncPeriod`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldTreatment {
    /// Dotted path of the field in a `KubeProxyConfiguration` file.
    pub path: &'static str,
    /// What happens to it.
    pub treatment: Treatment,
}

const fn field(path: &'static str, treatment: Treatment) -> FieldTreatment {
    FieldTreatment { path, treatment }
}

use Treatment::{Effective, Extension, Warned};

const WINDOWS: &str = "Windows only (kernelspace mode); there is nothing to apply on Linux";
const LOG_OPTIONS: &str = "logs are written unbuffered to stderr in klog's text format";
const PROFILING: &str = "kube-proxy-rs has no /debug/pprof handlers";

/// Every field of `kubeproxy.config.k8s.io/v1alpha1` through upstream's newest release, and
/// kube-proxy-rs's extensions. Objects are implied by their fields' paths; `featureGates` is
/// a map whose entries are judged by [`FEATURE_GATES`].
pub const FIELDS: &[FieldTreatment] = &[
    field("featureGates", Effective),
    field("clientConnection.kubeconfig", Effective),
    field(
        "clientConnection.acceptContentTypes",
        Warned("the API client always accepts JSON"),
    ),
    field(
        "clientConnection.contentType",
        Warned("the API client always speaks JSON"),
    ),
    field(
        "clientConnection.qps",
        Warned("the API client does not rate-limit its few list and watch requests"),
    ),
    field(
        "clientConnection.burst",
        Warned("the API client does not rate-limit its few list and watch requests"),
    ),
    field("logging.format", Warned(LOG_OPTIONS)),
    field("logging.flushFrequency", Warned(LOG_OPTIONS)),
    field("logging.verbosity", Effective),
    field(
        "logging.vmodule",
        Warned("per-file verbosity is not supported; use logging.verbosity"),
    ),
    field("logging.options.json.splitStream", Warned(LOG_OPTIONS)),
    field("logging.options.json.infoBufferSize", Warned(LOG_OPTIONS)),
    field("logging.options.text.splitStream", Warned(LOG_OPTIONS)),
    field("logging.options.text.infoBufferSize", Warned(LOG_OPTIONS)),
    field("hostnameOverride", Effective),
    field("bindAddress", Effective),
    field("healthzBindAddress", Effective),
    field("metricsBindAddress", Effective),
    field("bindAddressHardFail", Effective),
    field("enableProfiling", Warned(PROFILING)),
    field(
        "showHiddenMetricsForVersion",
        Warned("kube-proxy-rs has no hidden (deprecated) metrics to show"),
    ),
    field("serviceProxyName", Extension),
    field("iptablesBackend", Extension),
    field("nftablesLayout", Extension),
    field("canaryPeriod", Extension),
    field("socketLB.enabled", Extension),
    field("socketLB.cgroup", Extension),
    field("mode", Effective),
    field("iptables.masqueradeBit", Effective),
    field("iptables.masqueradeAll", Effective),
    field("iptables.localhostNodePorts", Effective),
    field("iptables.syncPeriod", Effective),
    field("iptables.minSyncPeriod", Effective),
    field("ipvs.syncPeriod", Effective),
    field("ipvs.minSyncPeriod", Effective),
    field("ipvs.scheduler", Effective),
    field("ipvs.excludeCIDRs", Effective),
    field("ipvs.strictARP", Effective),
    field("ipvs.tcpTimeout", Effective),
    field("ipvs.tcpFinTimeout", Effective),
    field("ipvs.udpTimeout", Effective),
    field("nftables.masqueradeBit", Effective),
    field("nftables.masqueradeAll", Effective),
    field("nftables.syncPeriod", Effective),
    field("nftables.minSyncPeriod", Effective),
    field(
        "nftables.tableName",
        Warned("the nftables tables are always named \"kube-proxy\""),
    ),
    field("winkernel.networkName", Warned(WINDOWS)),
    field("winkernel.sourceVip", Warned(WINDOWS)),
    field("winkernel.enableDSR", Warned(WINDOWS)),
    field("winkernel.rootHnsEndpointName", Warned(WINDOWS)),
    field("winkernel.forwardHealthCheckVip", Warned(WINDOWS)),
    field("windowsRunAsService", Warned(WINDOWS)),
    field("detectLocalMode", Effective),
    field("detectLocal.bridgeInterface", Effective),
    field("detectLocal.interfaceNamePrefix", Effective),
    field("clusterCIDR", Effective),
    field("nodePortAddresses", Effective),
    field("oomScoreAdj", Effective),
    field("conntrack.maxPerCore", Effective),
    field("conntrack.min", Effective),
    field("conntrack.tcpEstablishedTimeout", Effective),
    field("conntrack.tcpCloseWaitTimeout", Effective),
    field("conntrack.tcpBeLiberal", Effective),
    field("conntrack.udpTimeout", Effective),
    field("conntrack.udpStreamTimeout", Effective),
    field(
        "configSyncPeriod",
        Warned("watches deliver every change; there is no periodic informer resync"),
    ),
    // Upstream keeps portRange (unused since its userspace mode was removed in 1.26); here it
    // drives userspace mode, as udpIdleTimeout does (upstream dropped that field in 1.26).
    field("portRange", Effective),
    field("udpIdleTimeout", Extension),
    field("userspace.maxConnectionsPerService", Extension),
    field("userspace.maxUDPSessionsPerService", Extension),
];

/// A command-line flag and what happens to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlagTreatment {
    /// The flag, with its dashes (`--iptables-sync-period`).
    pub flag: &'static str,
    /// The file field it sets (its treatment is then the field's), if any.
    pub field: Option<&'static str>,
    /// What happens to it (for flags that set a field: the field's treatment).
    pub treatment: Treatment,
}

const fn flag(flag: &'static str, treatment: Treatment) -> FlagTreatment {
    FlagTreatment {
        flag,
        field: None,
        treatment,
    }
}

const fn sets(flag: &'static str, field: &'static str) -> FlagTreatment {
    FlagTreatment {
        flag,
        field: Some(field),
        // Resolved through the field table; see `flag_treatment`.
        treatment: Effective,
    }
}

/// Every flag of upstream's newest kube-proxy on Linux (cmd/kube-proxy/app/options.go plus
/// component-base's logging flags), the Windows-only ones upstream has on Windows, and
/// kube-proxy-rs's own.
pub const FLAGS: &[FlagTreatment] = &[
    flag("--config", Effective),
    flag("--write-config-to", Effective),
    flag("--cleanup", Effective),
    flag("--init-only", Effective),
    flag("--master", Effective),
    flag("--version", Effective),
    flag("--help", Effective),
    flag("--manifests", Extension),
    flag("--debug-explain", Extension),
    sets("--iptables-backend", "iptablesBackend"),
    sets("--nftables-layout", "nftablesLayout"),
    sets("--canary-period", "canaryPeriod"),
    sets("--socket-lb", "socketLB.enabled"),
    sets("--socket-lb-cgroup", "socketLB.cgroup"),
    sets("--feature-gates", "featureGates"),
    sets("--kubeconfig", "clientConnection.kubeconfig"),
    sets("--kube-api-content-type", "clientConnection.contentType"),
    sets("--kube-api-qps", "clientConnection.qps"),
    sets("--kube-api-burst", "clientConnection.burst"),
    sets("--hostname-override", "hostnameOverride"),
    sets("--bind-address", "bindAddress"),
    sets("--healthz-bind-address", "healthzBindAddress"),
    sets("--metrics-bind-address", "metricsBindAddress"),
    // Deprecated upstream; set the port of the address (0 disables the server).
    sets("--healthz-port", "healthzBindAddress"),
    sets("--metrics-port", "metricsBindAddress"),
    sets("--bind-address-hard-fail", "bindAddressHardFail"),
    sets("--profiling", "enableProfiling"),
    sets(
        "--show-hidden-metrics-for-version",
        "showHiddenMetricsForVersion",
    ),
    sets("--proxy-mode", "mode"),
    sets("--iptables-masquerade-bit", "iptables.masqueradeBit"),
    sets("--masquerade-all", "iptables.masqueradeAll"),
    sets(
        "--iptables-localhost-nodeports",
        "iptables.localhostNodePorts",
    ),
    sets("--iptables-sync-period", "iptables.syncPeriod"),
    sets("--iptables-min-sync-period", "iptables.minSyncPeriod"),
    sets("--ipvs-sync-period", "ipvs.syncPeriod"),
    sets("--ipvs-min-sync-period", "ipvs.minSyncPeriod"),
    sets("--ipvs-scheduler", "ipvs.scheduler"),
    sets("--ipvs-exclude-cidrs", "ipvs.excludeCIDRs"),
    sets("--ipvs-strict-arp", "ipvs.strictARP"),
    sets("--ipvs-tcp-timeout", "ipvs.tcpTimeout"),
    sets("--ipvs-tcpfin-timeout", "ipvs.tcpFinTimeout"),
    sets("--ipvs-udp-timeout", "ipvs.udpTimeout"),
    sets("--detect-local-mode", "detectLocalMode"),
    sets("--pod-bridge-interface", "detectLocal.bridgeInterface"),
    sets(
        "--pod-interface-name-prefix",
        "detectLocal.interfaceNamePrefix",
    ),
    sets("--cluster-cidr", "clusterCIDR"),
    sets("--nodeport-addresses", "nodePortAddresses"),
    sets("--oom-score-adj", "oomScoreAdj"),
    sets("--conntrack-max-per-core", "conntrack.maxPerCore"),
    sets("--conntrack-min", "conntrack.min"),
    sets(
        "--conntrack-tcp-timeout-established",
        "conntrack.tcpEstablishedTimeout",
    ),
    sets(
        "--conntrack-tcp-timeout-close-wait",
        "conntrack.tcpCloseWaitTimeout",
    ),
    sets("--conntrack-tcp-be-liberal", "conntrack.tcpBeLiberal"),
    sets("--conntrack-udp-timeout", "conntrack.udpTimeout"),
    sets(
        "--conntrack-udp-timeout-stream",
        "conntrack.udpStreamTimeout",
    ),
    sets("--config-sync-period", "configSyncPeriod"),
    sets("--proxy-port-range", "portRange"),
    sets("--udp-timeout", "udpIdleTimeout"),
    sets(
        "--userspace-max-connections-per-service",
        "userspace.maxConnectionsPerService",
    ),
    sets(
        "--userspace-max-udp-sessions-per-service",
        "userspace.maxUDPSessionsPerService",
    ),
    sets("--v", "logging.verbosity"),
    sets("--vmodule", "logging.vmodule"),
    sets("--logging-format", "logging.format"),
    sets("--log-flush-frequency", "logging.flushFrequency"),
    sets(
        "--log-json-split-stream",
        "logging.options.json.splitStream",
    ),
    sets(
        "--log-json-info-buffer-size",
        "logging.options.json.infoBufferSize",
    ),
    sets(
        "--log-text-split-stream",
        "logging.options.text.splitStream",
    ),
    sets(
        "--log-text-info-buffer-size",
        "logging.options.text.infoBufferSize",
    ),
    sets("--network-name", "winkernel.networkName"),
    sets("--source-vip", "winkernel.sourceVip"),
    sets("--enable-dsr", "winkernel.enableDSR"),
    sets("--root-hnsendpoint-name", "winkernel.rootHnsEndpointName"),
    sets(
        "--forward-healthcheck-vip",
        "winkernel.forwardHealthCheckVip",
    ),
    sets("--windows-service", "windowsRunAsService"),
];

/// The treatment of a flag: its own, or that of the field it sets.
pub fn flag_treatment(flag: &str) -> Option<Treatment> {
    let entry = FLAGS.iter().find(|f| f.flag == flag)?;
    match entry.field {
        None => Some(entry.treatment),
        Some(path) => field_treatment(path),
    }
}

/// The treatment of a field by its dotted path.
pub fn field_treatment(path: &str) -> Option<Treatment> {
    FIELDS.iter().find(|f| f.path == path).map(|f| f.treatment)
}

/// How kube-proxy-rs relates to an upstream feature gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateTreatment {
    /// kube-proxy-rs always behaves as upstream does with the gate enabled (the gate is GA
    /// or beta-on upstream); setting it to false is warned about.
    AlwaysOn,
    /// The gate changes nothing here; setting it either way is warned about.
    NoEffect(&'static str),
    /// The gate does here what it does upstream, either way (read with
    /// [`crate::gates::enabled`]); never warned about.
    Effective,
}

/// The feature gates upstream kube-proxy consults (pkg/proxy and its logging) that its newest
/// release still has. Every other gate upstream knows ([`crate::gates::UPSTREAM_GATES`]) is
/// accepted and warned about as one kube-proxy does not consult; a gate upstream does not know,
/// or a locked one set against its lock, is refused by validation with upstream's message.
pub const FEATURE_GATES: &[(&str, GateTreatment)] = &[
    ("PreferSameTrafficDistribution", GateTreatment::AlwaysOn),
    ("MultiCIDRServiceAllocator", GateTreatment::AlwaysOn),
    ("NFTablesProxyMode", GateTreatment::AlwaysOn),
    // 1.37: false refuses ipvs mode (KEP-5495).
    ("KubeProxyIPVS", GateTreatment::Effective),
    // KEP-5707: false programs no externalIPs.
    ("AllowServiceExternalIPs", GateTreatment::Effective),
    // 1.37 alpha (KEP-6032): localhost NodePorts in nftables mode.
    (
        crate::gates::LOCALHOST_NODE_PORTS_GATE,
        GateTreatment::Effective,
    ),
    // 1.36 beta: false takes /statusz, /flagz off the metrics server.
    ("ComponentStatusz", GateTreatment::Effective),
    ("ComponentFlagz", GateTreatment::Effective),
    // 1.37 beta: upstream's nftables mode may write over netlink; ours always does.
    ("NFTablesNetlink", GateTreatment::AlwaysOn),
    // 1.36 alpha, 1.37 beta (KEP-5808): native histogram buckets in the protobuf exposition.
    ("NativeHistograms", GateTreatment::Effective),
    ("WinDSR", GateTreatment::NoEffect(WINDOWS)),
    ("WinOverlay", GateTreatment::NoEffect(WINDOWS)),
    ("LoggingAlphaOptions", GateTreatment::NoEffect(LOG_OPTIONS)),
    ("LoggingBetaOptions", GateTreatment::NoEffect(LOG_OPTIONS)),
    (
        "ContextualLogging",
        GateTreatment::NoEffect("logging is always structured"),
    ),
    (
        "AllAlpha",
        GateTreatment::NoEffect("kube-proxy-rs has no alpha features behind gates"),
    ),
    (
        "AllBeta",
        GateTreatment::NoEffect("kube-proxy-rs has no beta features behind gates"),
    ),
];

/// Whether `path` names a known field or an object that holds known fields.
pub(crate) fn is_known_path(path: &str) -> bool {
    matches!(path, "apiVersion" | "kind")
        || FIELDS.iter().any(|f| {
            f.path == path
                || f.path
                    .strip_prefix(path)
                    .is_some_and(|rest| rest.starts_with('.'))
        })
}

/// Whether the object at `path` is a map with free keys rather than a schema object.
pub(crate) fn is_free_map(path: &str) -> bool {
    path == "featureGates"
}

impl KubeProxyConfiguration {
    /// One line per setting that has no effect in kube-proxy-rs but is set to something
    /// other than upstream's default (see [`FIELDS`] and [`FEATURE_GATES`]), for the binary
    /// to log as warnings at start-up.
    pub fn ignored_settings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let (Ok(this), Ok(default)) = (
            serde_json::to_value(self),
            serde_json::to_value(KubeProxyConfiguration::default()),
        ) else {
            return out;
        };
        for f in FIELDS {
            let Treatment::Warned(reason) = f.treatment else {
                continue;
            };
            let pointer = format!("/{}", f.path.replace('.', "/"));
            let value = this.pointer(&pointer).unwrap_or(&Value::Null);
            let default = default.pointer(&pointer).unwrap_or(&Value::Null);
            if value != default {
                out.push(format!(
                    "{} is set to {value} but has no effect in kube-proxy-rs: {reason}",
                    f.path
                ));
            }
        }
        // The blocks of other modes: upstream reads them only in their own mode.
        for (block, mode) in [("ipvs", ProxyMode::Ipvs), ("nftables", ProxyMode::Nftables)] {
            if self.mode == mode {
                continue;
            }
            if let (Some(Value::Object(set)), Some(Value::Object(unset))) =
                (this.get(block), default.get(block))
            {
                for (key, value) in set {
                    if unset.get(key) != Some(value)
                        && field_treatment(&format!("{block}.{key}")) == Some(Effective)
                    {
                        out.push(format!(
                            "{block}.{key} is set to {value} but has no effect in {} mode: it \
                             applies to {mode} mode only",
                            self.mode
                        ));
                    }
                }
            }
        }
        if self.socket_lb.enabled && self.mode() != ProxyMode::Nftables {
            out.push(format!(
                "socketLB.enabled is set to true but has no effect in {} mode: the socket load \
                 balancer runs beside nftables mode only",
                self.mode()
            ));
        }
        out.extend(gate_warnings(&self.feature_gates));
        out
    }
}

/// One warning per gate upstream accepts that changes nothing here. Gates upstream refuses
/// are validation errors ([`crate::gates::upstream_refusal`]), not warnings.
fn gate_warnings(gates: &BTreeMap<String, bool>) -> Vec<String> {
    gates
        .iter()
        .filter(|(name, enabled)| crate::gates::upstream_refusal(name, **enabled).is_none())
        .filter_map(|(name, &enabled)| {
            match FEATURE_GATES.iter().find(|(known, _)| known == name) {
                Some((_, GateTreatment::AlwaysOn)) if enabled => None,
                Some((_, GateTreatment::Effective)) => None,
                Some((_, GateTreatment::AlwaysOn)) => Some(format!(
                    "feature gate {name}=false has no effect: kube-proxy-rs always behaves as \
                     upstream does with {name} enabled"
                )),
                Some((_, GateTreatment::NoEffect(reason))) => Some(format!(
                    "feature gate {name}={enabled} has no effect in kube-proxy-rs: {reason}"
                )),
                None => Some(format!(
                    "feature gate {name}={enabled} is not one kube-proxy consults; ignored, as \
                     upstream ignores it"
                )),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use clap::CommandFactory;

    use super::*;
    use crate::Options;

    /// A configuration in which every optional field is present when serialized.
    fn everything_set() -> KubeProxyConfiguration {
        let mut c = KubeProxyConfiguration::default();
        c.complete_defaults();
        c.feature_gates.insert("Any".into(), true);
        c.service_proxy_name = "x".into();
        c.udp_idle_timeout = std::time::Duration::from_secs(1);
        c.userspace.max_connections_per_service = 1;
        c.logging.vmodule.push(crate::VModuleItem {
            file_pattern: "p".into(),
            verbosity: 1,
        });
        c.logging.options.json.split_stream = true;
        c.logging.options.text.split_stream = true;
        c.nftables.table_name = "t".into();
        c.windows_run_as_service = true;
        c.iptables_backend = crate::IptablesBackend::Legacy;
        c.nftables_layout = crate::NftablesLayout::Chains;
        c.canary_period = std::time::Duration::from_secs(5);
        c.socket_lb.enabled = true;
        c.socket_lb.cgroup = "/sys/fs/cgroup".into();
        c
    }

    fn leaves(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
        match value {
            Value::Object(map) if !is_free_map(prefix) => {
                for (key, value) in map {
                    let path = if prefix.is_empty() {
                        key.clone()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    leaves(value, &path, out);
                }
            }
            _ => {
                out.insert(prefix.to_owned());
            }
        }
    }

    #[test]
    fn every_field_of_the_schema_has_a_treatment_and_no_other() {
        let value = serde_json::to_value(everything_set()).unwrap_or_default();
        let mut schema = BTreeSet::new();
        leaves(&value, "", &mut schema);
        let table: BTreeSet<String> = FIELDS.iter().map(|f| f.path.to_owned()).collect();
        assert_eq!(schema, table);
        assert_eq!(table.len(), FIELDS.len(), "a field is listed twice");
    }

    #[test]
    fn every_flag_has_a_treatment_and_no_other() {
        let command = Options::command();
        let mut parsed: BTreeSet<String> = command
            .get_arguments()
            .filter_map(|a| a.get_long())
            .map(|l| format!("--{l}"))
            .collect();
        parsed.extend(["--help".to_owned(), "--version".to_owned()]);
        let table: BTreeSet<String> = FLAGS.iter().map(|f| f.flag.to_owned()).collect();
        assert_eq!(parsed, table);
        assert_eq!(table.len(), FLAGS.len(), "a flag is listed twice");
        for f in FLAGS {
            if let Some(path) = f.field {
                assert!(field_treatment(path).is_some(), "{} sets {path}", f.flag);
            }
            assert!(flag_treatment(f.flag).is_some(), "{}", f.flag);
        }
    }

    #[test]
    fn upstream_defaults_warn_about_nothing() {
        let mut c = KubeProxyConfiguration::default();
        c.complete_defaults();
        assert_eq!(c.ignored_settings(), Vec::<String>::new());
    }

    #[test]
    fn each_warned_field_is_named_when_set() {
        let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  acceptContentTypes: application/json
  contentType: application/json
  qps: 50
  burst: 100
logging:
  format: json
  flushFrequency: 1s
  vmodule:
  - filePattern: proxier
    verbosity: 4
  options:
    json:
      splitStream: true
      infoBufferSize: 64Ki
    text:
      splitStream: true
      infoBufferSize: 1Mi
enableProfiling: true
showHiddenMetricsForVersion: \"1.33\"
nftables:
  tableName: kp
winkernel:
  networkName: n
  sourceVip: 10.0.0.1
  enableDSR: true
  rootHnsEndpointName: r
  forwardHealthCheckVip: true
windowsRunAsService: true
configSyncPeriod: 1m
";
        let c = match KubeProxyConfiguration::from_yaml(text) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        let warnings = c.ignored_settings();
        for f in FIELDS {
            if let Treatment::Warned(reason) = f.treatment {
                let named: Vec<&String> = warnings
                    .iter()
                    .filter(|w| w.starts_with(&format!("{} is set to ", f.path)))
                    .collect();
                assert_eq!(named.len(), 1, "{}: {warnings:#?}", f.path);
                assert!(named[0].ends_with(reason), "{}", named[0]);
            }
        }
    }

    #[test]
    fn feature_gates_are_judged_by_the_table() {
        let gates: BTreeMap<String, bool> = [
            ("PreferSameTrafficDistribution", true),
            ("ContextualLogging", false),
            ("WinDSR", true),
            ("GracefulNodeShutdown", true),
            // Refused by validation, so not warned about.
            ("NoSuchGate", true),
            ("NFTablesProxyMode", false),
            // Effective either way: no warning.
            ("KubeProxyIPVS", false),
            ("AllowServiceExternalIPs", false),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        let warnings = gate_warnings(&gates);
        assert_eq!(warnings.len(), 3, "{warnings:#?}");
        assert!(warnings[0].contains("ContextualLogging=false has no effect"));
        assert!(warnings[1].starts_with("feature gate GracefulNodeShutdown=true is not one"));
        assert!(warnings[2].contains("WinDSR=true has no effect"));
    }

    #[test]
    fn every_gate_the_table_judges_is_one_upstream_knows() {
        for (name, _) in FEATURE_GATES {
            assert_eq!(
                crate::gates::upstream_refusal(name, true),
                None,
                "{name} is not an upstream gate"
            );
        }
    }
}
