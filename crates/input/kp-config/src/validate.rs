//! Validation of an effective configuration.
//!
//! Every rule runs on every call, so a user fixing a file sees all of its problems in one go
//! instead of one per restart.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ipnet::IpNet;

use crate::duration;
use crate::types::{
    IPVS_SCHEDULERS, KubeProxyConfiguration, LocalMode, NodePortAddress, ProxyMode,
    parse_port_range,
};

/// One invalid value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Where the value came from: a config path such as `iptables.minSyncPeriod`, or the
    /// flag that set it, such as `--iptables-min-sync-period`.
    pub field: String,
    /// The offending value as the user wrote it (durations in Go form).
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

impl FieldError {
    /// Builds an error for `field`.
    pub fn new(
        field: impl Into<String>,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        FieldError {
            field: field.into(),
            value: value.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: invalid value {:?}: {}",
            self.field, self.value, self.reason
        )
    }
}

impl std::error::Error for FieldError {}

/// All invalid values of a configuration; `Display` writes one per line.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigErrors {
    /// The individual problems: unparsable values first, then failed rules.
    pub errors: Vec<FieldError>,
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl KubeProxyConfiguration {
    /// Checks every field; `Err` lists all problems found.
    pub fn validate(&self) -> Result<(), ConfigErrors> {
        let errors = validate(self);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigErrors { errors })
        }
    }
}

/// Returns every problem in `c`; empty when it is valid.
pub(crate) fn validate(c: &KubeProxyConfiguration) -> Vec<FieldError> {
    let mut v = Validator::default();

    if c.client_connection.burst < 0 {
        v.error(
            "clientConnection.burst",
            c.client_connection.burst,
            "must not be negative",
        );
    }
    if !matches!(c.logging.format.as_str(), "text" | "json") {
        v.error(
            "logging.format",
            &c.logging.format,
            "unsupported log format; expected \"text\" or \"json\"",
        );
    }

    // Upstream refuses gates its registry does not have, and locked gates set against their
    // lock, with component-base's messages.
    for (name, &enabled) in &c.feature_gates {
        if let Some(reason) = crate::gates::upstream_refusal(name, enabled) {
            v.error("featureGates", format!("{name}={enabled}"), reason);
        }
    }
    v.ip("bindAddress", &c.bind_address);
    v.optional_host_port("healthzBindAddress", c.healthz_bind_address.as_deref());
    v.optional_host_port("metricsBindAddress", c.metrics_bind_address.as_deref());

    // As upstream: the iptables block is checked in every Linux mode, the others only when
    // their mode is selected.
    if !matches!(c.mode, ProxyMode::Kernelspace | ProxyMode::Winuserspace) {
        v.sync_periods(
            "iptables",
            c.iptables.sync_period,
            c.iptables.min_sync_period,
        );
        v.masquerade_bit("iptables.masqueradeBit", c.iptables.masquerade_bit);
    }
    if c.mode == ProxyMode::Ipvs && !crate::gates::enabled(&c.feature_gates, "KubeProxyIPVS") {
        // Upstream 1.37 (KEP-5495): no fallback to another mode.
        v.error("mode", c.mode.as_str(), ipvs_disabled());
    }
    if c.mode == ProxyMode::Ipvs {
        v.sync_periods("ipvs", c.ipvs.sync_period, c.ipvs.min_sync_period);
        let scheduler = c.ipvs.scheduler.as_str();
        if !scheduler.is_empty() && !IPVS_SCHEDULERS.contains(&scheduler) {
            v.error(
                "ipvs.scheduler",
                scheduler,
                format!(
                    "unknown IPVS scheduler; expected one of {}",
                    IPVS_SCHEDULERS.join(" ")
                ),
            );
        }
        for (i, cidr) in c.ipvs.exclude_cidrs.iter().flatten().enumerate() {
            v.cidr(&format!("ipvs.excludeCIDRs[{i}]"), cidr);
        }
    }
    if c.mode == ProxyMode::Nftables {
        v.sync_periods(
            "nftables",
            c.nftables.sync_period,
            c.nftables.min_sync_period,
        );
        v.masquerade_bit("nftables.masqueradeBit", c.nftables.masquerade_bit);
    }

    match c.detect_local_mode {
        LocalMode::BridgeInterface if c.detect_local.bridge_interface.trim().is_empty() => {
            v.error(
                "detectLocal.bridgeInterface",
                &c.detect_local.bridge_interface,
                "required when detectLocalMode is BridgeInterface",
            );
        }
        LocalMode::InterfaceNamePrefix
            if c.detect_local.interface_name_prefix.trim().is_empty() =>
        {
            v.error(
                "detectLocal.interfaceNamePrefix",
                &c.detect_local.interface_name_prefix,
                "required when detectLocalMode is InterfaceNamePrefix",
            );
        }
        _ => {}
    }

    v.cluster_cidr(&c.cluster_cidr);
    if let Some(entries) = &c.node_port_addresses {
        v.node_port_addresses(entries);
    }

    if !(-1000..=1000).contains(&c.oom_score_adj) {
        v.error(
            "oomScoreAdj",
            c.oom_score_adj,
            "must be between -1000 and 1000",
        );
    }
    if c.conntrack.max_per_core < 0 {
        v.error(
            "conntrack.maxPerCore",
            c.conntrack.max_per_core,
            "must not be negative",
        );
    }
    if c.conntrack.min < 0 {
        v.error("conntrack.min", c.conntrack.min, "must not be negative");
    }
    if let Err(reason) = parse_port_range(&c.port_range) {
        v.error(
            "portRange",
            &c.port_range,
            format!("{reason}; expected BEGIN-END, BASE+SIZE or one port, or empty for any"),
        );
    }
    if c.udp_idle_timeout.is_zero() {
        v.error(
            "udpIdleTimeout",
            duration::format(c.udp_idle_timeout),
            "must be greater than 0",
        );
    }
    let caps = [
        (
            "userspace.maxConnectionsPerService",
            c.userspace.max_connections_per_service,
        ),
        (
            "userspace.maxUDPSessionsPerService",
            c.userspace.max_udp_sessions_per_service,
        ),
    ];
    for (field, cap) in caps {
        if cap < 1 {
            v.error(field, cap, "must be at least 1");
        }
    }
    if c.config_sync_period.is_zero() {
        v.error(
            "configSyncPeriod",
            duration::format(c.config_sync_period),
            "must be greater than 0",
        );
    }
    v.errors
}

#[derive(Default)]
struct Validator {
    errors: Vec<FieldError>,
}

impl Validator {
    fn error(&mut self, field: &str, value: impl ToString, reason: impl Into<String>) {
        self.errors
            .push(FieldError::new(field, value.to_string(), reason));
    }

    fn sync_periods(&mut self, block: &str, sync: Duration, min: Duration) {
        if sync.is_zero() {
            self.error(
                &format!("{block}.syncPeriod"),
                duration::format(sync),
                "must be greater than 0",
            );
        }
        if min > sync {
            self.error(
                &format!("{block}.minSyncPeriod"),
                duration::format(min),
                format!(
                    "must not be greater than {block}.syncPeriod ({})",
                    duration::format(sync)
                ),
            );
        }
    }

    fn masquerade_bit(&mut self, field: &str, bit: i32) {
        if !(0..=31).contains(&bit) {
            self.error(field, bit, "must be between 0 and 31");
        }
    }

    fn ip(&mut self, field: &str, value: &str) {
        if value.trim().parse::<IpAddr>().is_err() {
            self.error(field, value, "must be an IP address");
        }
    }

    /// `IP:port` with a usable port, or empty to disable the server.
    fn optional_host_port(&mut self, field: &str, value: Option<&str>) {
        let Some(value) = value.filter(|v| !v.trim().is_empty()) else {
            return;
        };
        match value.trim().parse::<SocketAddr>() {
            Ok(addr) if addr.port() == 0 => {
                self.error(field, value, "port must be between 1 and 65535");
            }
            Ok(_) => {}
            Err(_) => self.error(
                field,
                value,
                "must be IP:port (IPv6 as [addr]:port), or empty to disable",
            ),
        }
    }

    fn cidr(&mut self, field: &str, value: &str) -> Option<IpNet> {
        match value.trim().parse::<IpNet>() {
            Ok(net) => Some(net),
            Err(_) => {
                self.error(field, value, "must be a CIDR such as 10.0.0.0/8");
                None
            }
        }
    }

    fn cluster_cidr(&mut self, value: &str) {
        if value.trim().is_empty() {
            return;
        }
        let entries: Vec<&str> = value.split(',').map(str::trim).collect();
        if entries.len() > 2 {
            self.error(
                "clusterCIDR",
                value,
                "at most two CIDRs (one per IP family) are allowed",
            );
            return;
        }
        let nets: Vec<IpNet> = entries
            .iter()
            .filter_map(|e| self.cidr("clusterCIDR", e))
            .collect();
        if let [a, b] = nets.as_slice()
            && matches!(
                (a, b),
                (IpNet::V4(_), IpNet::V4(_)) | (IpNet::V6(_), IpNet::V6(_))
            )
        {
            self.error(
                "clusterCIDR",
                value,
                "two CIDRs must be one IPv4 and one IPv6 (dual-stack)",
            );
        }
    }

    /// Each entry a CIDR or a keyword, in any combination (upstream v1.37, KEP-6032).
    fn node_port_addresses(&mut self, entries: &[String]) {
        for (i, entry) in entries.iter().enumerate() {
            if entry.parse::<NodePortAddress>().is_err() {
                self.error(
                    &format!("nodePortAddresses[{i}]"),
                    entry,
                    "must be a CIDR such as 10.0.0.0/8, or \"primary\", \"localhost\" or \"all\"",
                );
            }
        }
    }
}

/// Why ipvs mode is refused with `KubeProxyIPVS=false`, naming the modes that remain.
fn ipvs_disabled() -> String {
    let valid: Vec<&str> = ProxyMode::ALL
        .into_iter()
        .filter(|m| *m != ProxyMode::Ipvs)
        .map(ProxyMode::as_str)
        .collect();
    format!(
        "the ipvs proxy mode is disabled by feature gate KubeProxyIPVS=false; valid modes: {}",
        valid.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(c: &KubeProxyConfiguration) -> Vec<String> {
        validate(c).into_iter().map(|e| e.field).collect()
    }

    #[test]
    fn defaults_are_valid_in_every_mode() {
        for mode in ProxyMode::ALL {
            let mut c = KubeProxyConfiguration {
                mode,
                ..Default::default()
            };
            c.complete_defaults();
            assert_eq!(c.validate(), Ok(()), "{mode}");
        }
    }

    /// One row per rule: a change that breaks exactly that rule, and the field it names.
    #[test]
    fn each_rule_reports_its_field() {
        type Edit = fn(&mut KubeProxyConfiguration);
        let cases: &[(&str, Edit)] = &[
            ("clientConnection.burst", |c| c.client_connection.burst = -1),
            ("logging.format", |c| c.logging.format = "xml".into()),
            ("bindAddress", |c| c.bind_address = "node-1".into()),
            ("bindAddress", |c| c.bind_address = String::new()),
            ("healthzBindAddress", |c| {
                c.healthz_bind_address = Some("0.0.0.0:0".into())
            }),
            ("healthzBindAddress", |c| {
                c.healthz_bind_address = Some("0.0.0.0:70000".into())
            }),
            ("metricsBindAddress", |c| {
                c.metrics_bind_address = Some("localhost:10249".into())
            }),
            ("metricsBindAddress", |c| {
                c.metrics_bind_address = Some("::1:10249".into())
            }),
            ("iptables.syncPeriod", |c| {
                c.iptables.sync_period = Duration::ZERO;
                c.iptables.min_sync_period = Duration::ZERO;
            }),
            ("iptables.minSyncPeriod", |c| {
                c.iptables.min_sync_period = Duration::from_secs(31)
            }),
            ("iptables.masqueradeBit", |c| c.iptables.masquerade_bit = 32),
            ("iptables.masqueradeBit", |c| c.iptables.masquerade_bit = -1),
            ("mode", |c| {
                c.mode = ProxyMode::Ipvs;
                c.feature_gates.insert("KubeProxyIPVS".into(), false);
            }),
            ("ipvs.syncPeriod", |c| {
                c.mode = ProxyMode::Ipvs;
                c.ipvs.sync_period = Duration::ZERO;
            }),
            ("ipvs.minSyncPeriod", |c| {
                c.mode = ProxyMode::Ipvs;
                c.ipvs.min_sync_period = Duration::from_secs(60);
            }),
            ("ipvs.scheduler", |c| {
                c.mode = ProxyMode::Ipvs;
                c.ipvs.scheduler = "fastest".into();
            }),
            ("ipvs.excludeCIDRs[1]", |c| {
                c.mode = ProxyMode::Ipvs;
                c.ipvs.exclude_cidrs = Some(vec!["10.0.0.0/8".into(), "10.0.0.1".into()]);
            }),
            ("nftables.syncPeriod", |c| {
                c.mode = ProxyMode::Nftables;
                c.nftables.sync_period = Duration::ZERO;
                c.nftables.min_sync_period = Duration::ZERO;
            }),
            ("nftables.minSyncPeriod", |c| {
                c.mode = ProxyMode::Nftables;
                c.nftables.min_sync_period = Duration::from_secs(3600);
            }),
            ("nftables.masqueradeBit", |c| {
                c.mode = ProxyMode::Nftables;
                c.nftables.masquerade_bit = 40;
            }),
            ("detectLocal.bridgeInterface", |c| {
                c.detect_local_mode = LocalMode::BridgeInterface
            }),
            ("detectLocal.interfaceNamePrefix", |c| {
                c.detect_local_mode = LocalMode::InterfaceNamePrefix
            }),
            ("clusterCIDR", |c| c.cluster_cidr = "10.244.0.0".into()),
            ("clusterCIDR", |c| {
                c.cluster_cidr = "10.0.0.0/8,10.1.0.0/16".into()
            }),
            ("clusterCIDR", |c| {
                c.cluster_cidr = "10.0.0.0/8,fd00::/48,fd01::/48".into()
            }),
            ("nodePortAddresses[1]", |c| {
                c.node_port_addresses = Some(vec!["primary".into(), "Localhost".into()])
            }),
            ("nodePortAddresses[0]", |c| {
                c.node_port_addresses = Some(vec!["10.0.0.0/33".into()])
            }),
            ("oomScoreAdj", |c| c.oom_score_adj = 1001),
            ("oomScoreAdj", |c| c.oom_score_adj = -1001),
            ("conntrack.maxPerCore", |c| c.conntrack.max_per_core = -1),
            ("conntrack.min", |c| c.conntrack.min = -1),
            ("configSyncPeriod", |c| {
                c.config_sync_period = Duration::ZERO
            }),
        ];
        for (field, edit) in cases {
            let mut c = KubeProxyConfiguration::default();
            c.complete_defaults();
            edit(&mut c);
            assert_eq!(fields(&c), vec![field.to_string()], "case {field}");
        }
    }

    #[test]
    fn accepted_edge_values() {
        let mut c = KubeProxyConfiguration::default();
        c.complete_defaults();
        c.healthz_bind_address = Some(String::new());
        c.metrics_bind_address = Some("[::1]:65535".into());
        c.iptables.min_sync_period = c.iptables.sync_period;
        c.iptables.masquerade_bit = 31;
        c.oom_score_adj = -1000;
        c.conntrack.max_per_core = 0;
        c.cluster_cidr = "fd00::/48,10.0.0.0/8".into();
        c.node_port_addresses = Some(vec![
            "primary".into(),
            "localhost".into(),
            "all".into(),
            " 10.0.0.0/8".into(),
        ]);
        c.detect_local_mode = LocalMode::BridgeInterface;
        c.detect_local.bridge_interface = "cbr0".into();
        assert_eq!(c.validate(), Ok(()));
        // Blocks of modes that are not selected are not checked.
        c.ipvs.scheduler = "fastest".into();
        c.nftables.masquerade_bit = 99;
        assert_eq!(c.validate(), Ok(()));
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let mut c = KubeProxyConfiguration::default();
        c.complete_defaults();
        c.bind_address = "nope".into();
        c.iptables.masquerade_bit = 99;
        c.iptables.min_sync_period = Duration::from_secs(60);
        c.oom_score_adj = 5000;
        c.conntrack.min = -5;
        let errors = c.validate().err().map(|e| e.errors).unwrap_or_default();
        assert_eq!(errors.len(), 5, "{errors:?}");
        let text = ConfigErrors {
            errors: errors.clone(),
        }
        .to_string();
        assert_eq!(text.lines().count(), 5);
        assert!(text.contains(
            "iptables.minSyncPeriod: invalid value \"1m0s\": \
             must not be greater than iptables.syncPeriod (30s)"
        ));
        assert!(text.contains("oomScoreAdj: invalid value \"5000\""));
    }

    #[test]
    fn every_bad_node_port_address_is_reported() {
        let mut c = KubeProxyConfiguration::default();
        c.complete_defaults();
        c.node_port_addresses = Some(
            [
                "primary",
                "Primary",
                "localhost",
                "10.0.0.0/33",
                "all",
                "any",
            ]
            .map(String::from)
            .to_vec(),
        );
        assert_eq!(
            fields(&c),
            [
                "nodePortAddresses[1]",
                "nodePortAddresses[3]",
                "nodePortAddresses[5]"
            ]
        );
    }
}
