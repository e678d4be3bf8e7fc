//! Building [`ServicePort`]s from a Service.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServicePort as ApiServicePort, ServiceSpec};

use super::parse::{parse_cidr, parse_ip};
use super::{
    IpFamily, ModelError, Names, Problems, Protocol, ServiceName, ServicePort, ServicePortName,
    SessionAffinity, port_number,
};

/// ClientIP affinity timeout when `timeoutSeconds` is unset (the API default, 3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: i32 = 10800;

/// Largest ClientIP affinity timeout the API allows (1 day).
pub const MAX_AFFINITY_TIMEOUT_SECONDS: i32 = 86400;

/// Build a Service's ports. `None` for services the proxy ignores (headless, ExternalName,
/// no ClusterIP); an error names every invalid field.
///
/// Ignored services are not validated, as upstream skips them before looking at anything
/// else.
pub fn service_ports(service: &Service) -> Result<Option<Vec<ServicePort>>, ModelError> {
    service_ports_with(service, &mut Names::default())
}

/// [`service_ports`], taking the namespace, name and port names from `names`, so ports built
/// with the same `names` share them (with each other and with the EndpointSlices').
pub fn service_ports_with(
    service: &Service,
    names: &mut Names,
) -> Result<Option<Vec<ServicePort>>, ModelError> {
    let namespace = service.metadata.namespace.as_deref().unwrap_or_default();
    let name = service.metadata.name.as_deref().unwrap_or_default();
    let Some(spec) = service.spec.as_ref() else {
        return Ok(None);
    };
    let service_type = spec.type_.as_deref().unwrap_or("ClusterIP");
    if service_type == "ExternalName" {
        return Ok(None);
    }
    let Some((cluster_ip_field, cluster_ip_texts)) = cluster_ip_texts(spec) else {
        return Ok(None);
    };

    let mut problems = Problems::default();
    if name.is_empty() {
        problems.push("metadata.name", "must not be empty");
    }
    let wide = ServiceWide::new(
        service,
        spec,
        service_type,
        (cluster_ip_field, &cluster_ip_texts),
        &mut problems,
    );
    let service_name = ServiceName {
        namespace: names.get(namespace),
        name: names.get(name),
    };
    let mut ports = spec_ports(spec, &service_name, &wide, names, &mut problems);

    problems.into_result("Service", namespace, name)?;
    // The tracker keeps this for every service: no spare room (a `ServicePort` is ~200 bytes).
    ports.shrink_to_fit();
    Ok(Some(ports))
}

/// The ClusterIP field to read and its texts, or `None` for a headless service or one
/// without a ClusterIP (ignored, not validated).
fn cluster_ip_texts(spec: &ServiceSpec) -> Option<(&'static str, Vec<&String>)> {
    // `clusterIPs[0]` always equals `clusterIP` when both are set; older objects may only
    // have `clusterIP`.
    let (field, texts): (&'static str, Vec<&String>) = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ("spec.clusterIPs", ips.iter().collect()),
        _ => ("spec.clusterIP", spec.cluster_ip.iter().collect()),
    };
    let primary = texts.first()?;
    if primary.is_empty() || primary.as_str() == "None" {
        return None;
    }
    Some((field, texts))
}

/// What every port of one Service shares: its addresses and policies.
struct ServiceWide {
    cluster_ips: Vec<IpAddr>,
    external_ips: Vec<IpAddr>,
    load_balancer_ips: Vec<IpAddr>,
    load_balancer_source_ranges: Vec<IpNet>,
    session_affinity: Option<SessionAffinity>,
    external_policy_local: bool,
    internal_policy_local: bool,
    health_check_node_port: Option<u16>,
}

impl ServiceWide {
    /// Read the service-wide fields, recording each invalid one in `problems`, in field
    /// order.
    fn new(
        service: &Service,
        spec: &ServiceSpec,
        service_type: &str,
        (cluster_ip_field, cluster_ip_texts): (&str, &[&String]),
        problems: &mut Problems,
    ) -> Self {
        let cluster_ips = cluster_ips(cluster_ip_field, cluster_ip_texts, problems);
        let external_ips = ip_list(
            "spec.externalIPs",
            spec.external_ips.as_deref().unwrap_or_default(),
            problems,
        );
        let load_balancer_ips = load_balancer_ips(service, problems);
        let load_balancer_source_ranges = source_ranges(spec, problems);
        let session_affinity = session_affinity(spec, problems);
        let external_policy_local = external_policy_local(spec, service_type, &external_ips);
        let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
        let health_check_node_port =
            health_check_node_port(spec, service_type, external_policy_local, problems);
        Self {
            cluster_ips,
            external_ips,
            load_balancer_ips,
            load_balancer_source_ranges,
            session_affinity,
            external_policy_local,
            internal_policy_local,
            health_check_node_port,
        }
    }

    /// One port of the service.
    fn port(&self, name: ServicePortName, port: u16, node_port: Option<u16>) -> ServicePort {
        ServicePort {
            name,
            cluster_ips: self.cluster_ips.clone(),
            port,
            node_port,
            external_ips: self.external_ips.clone(),
            load_balancer_ips: self.load_balancer_ips.clone(),
            load_balancer_source_ranges: self.load_balancer_source_ranges.clone(),
            session_affinity: self.session_affinity,
            external_policy_local: self.external_policy_local,
            internal_policy_local: self.internal_policy_local,
            health_check_node_port: self.health_check_node_port,
        }
    }
}

/// `externalTrafficPolicy: Local`, which counts only for a service that accepts external
/// traffic at all (as upstream).
fn external_policy_local(spec: &ServiceSpec, service_type: &str, external_ips: &[IpAddr]) -> bool {
    let externally_accessible_type = match service_type {
        "LoadBalancer" | "NodePort" => true,
        "ClusterIP" => !external_ips.is_empty(),
        _ => false,
    };
    externally_accessible_type && spec.external_traffic_policy.as_deref() == Some("Local")
}

/// The health-check node port, which only an eTP Local LoadBalancer service has.
fn health_check_node_port(
    spec: &ServiceSpec,
    service_type: &str,
    external_policy_local: bool,
    problems: &mut Problems,
) -> Option<u16> {
    if service_type != "LoadBalancer" || !external_policy_local {
        return None;
    }
    match spec.health_check_node_port {
        // Upstream logs and carries on without a health check.
        None | Some(0) => None,
        Some(port) => port_number(port)
            .map_err(|message| problems.push("spec.healthCheckNodePort", message))
            .ok(),
    }
}

/// The spec's ports, each with the service-wide fields; ports with a problem are recorded
/// and left out.
fn spec_ports(
    spec: &ServiceSpec,
    service_name: &ServiceName,
    wide: &ServiceWide,
    names: &mut Names,
    problems: &mut Problems,
) -> Vec<ServicePort> {
    // Sized up front, as the slices' lists: the tracker keeps this vector, and one pushed
    // element would get room for four.
    let mut ports = Vec::with_capacity(spec.ports.as_ref().map_or(0, Vec::len));
    // (name, protocol) -> index of the first port using it.
    let mut seen: BTreeMap<(&str, Protocol), usize> = BTreeMap::new();
    for (index, port) in spec.ports.iter().flatten().enumerate() {
        let path = format!("spec.ports[{index}]");
        let port_name = port.name.as_deref().unwrap_or_default();
        let fields = PortFields::parse(&path, port, problems);
        let Some(protocol) = fields.protocol else {
            continue;
        };
        if let Some(first) = seen.get(&(port_name, protocol)) {
            problems.push(
                &path,
                format_args!(
                    "duplicate port name {port_name:?} with protocol {} (also spec.ports[{first}])",
                    protocol.api_name()
                ),
            );
            continue;
        }
        seen.insert((port_name, protocol), index);
        let (Some(number), Some(node_port)) = (fields.number, fields.node_port) else {
            continue;
        };
        let name = ServicePortName {
            service: service_name.clone(),
            port: names.get(port_name),
            protocol,
        };
        ports.push(wide.port(name, number, node_port));
    }
    ports
}

/// One port entry's own fields, each `None` when invalid (and recorded as a problem).
struct PortFields {
    protocol: Option<Protocol>,
    number: Option<u16>,
    /// `Some(None)`: valid, no node port.
    node_port: Option<Option<u16>>,
}

impl PortFields {
    /// Read the entry at `path`, recording its problems in field order.
    fn parse(path: &str, port: &ApiServicePort, problems: &mut Problems) -> Self {
        let protocol = match port.protocol.as_deref() {
            None => Some(Protocol::Tcp),
            Some(text) => {
                let parsed = Protocol::from_api(text);
                if parsed.is_none() {
                    problems.push(
                        format_args!("{path}.protocol"),
                        format_args!("{text:?} is not TCP, UDP or SCTP"),
                    );
                }
                parsed
            }
        };
        let number = port_number(port.port)
            .map_err(|message| problems.push(format_args!("{path}.port"), message))
            .ok();
        let node_port = match port.node_port {
            None | Some(0) => Some(None),
            Some(value) => port_number(value)
                .map(Some)
                .map_err(|message| problems.push(format_args!("{path}.nodePort"), message))
                .ok(),
        };
        Self {
            protocol,
            number,
            node_port,
        }
    }
}

/// The ClusterIPs, at most one per family (dual-stack), in API order.
fn cluster_ips(field: &str, texts: &[&String], problems: &mut Problems) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = Vec::new();
    let mut first_of_family: BTreeMap<IpFamily, usize> = BTreeMap::new();
    for (index, text) in texts.iter().enumerate() {
        // `spec.clusterIP` is a single value; `spec.clusterIPs` a list.
        let path = if texts.len() == 1 && field == "spec.clusterIP" {
            field.to_owned()
        } else {
            format!("{field}[{index}]")
        };
        let ip = match parse_ip(text) {
            Ok(ip) => ip,
            Err(error) => {
                problems.push(&path, format_args!("{text:?} {error}"));
                continue;
            }
        };
        let family = IpFamily::of(&ip);
        if let Some(first) = first_of_family.get(&family) {
            problems.push(
                &path,
                format_args!(
                    "{text:?} is a second {} address (also {field}[{first}])",
                    family.api_name()
                ),
            );
            continue;
        }
        first_of_family.insert(family, index);
        ips.push(ip);
    }
    ips
}

/// Parse a list of IP addresses, reporting each invalid entry.
fn ip_list(field: &str, texts: &[String], problems: &mut Problems) -> Vec<IpAddr> {
    texts
        .iter()
        .enumerate()
        .filter_map(|(index, text)| {
            parse_ip(text)
                .map_err(|error| {
                    problems.push(
                        format_args!("{field}[{index}]"),
                        format_args!("{text:?} {error}"),
                    );
                })
                .ok()
        })
        .collect()
}

/// VIP-style load-balancer IPs. Entries with `ipMode: Proxy` (the LB proxies, so traffic
/// arrives addressed to the node) and hostname-only entries get no rules, as upstream.
fn load_balancer_ips(service: &Service, problems: &mut Problems) -> Vec<IpAddr> {
    let ingress = service
        .status
        .as_ref()
        .and_then(|status| status.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_deref())
        .unwrap_or_default();
    let mut ips = Vec::new();
    for (index, entry) in ingress.iter().enumerate() {
        let Some(text) = entry.ip.as_deref().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        if entry.ip_mode.as_deref() == Some("Proxy") {
            continue;
        }
        match parse_ip(text) {
            Ok(ip) => ips.push(ip),
            Err(error) => problems.push(
                format_args!("status.loadBalancer.ingress[{index}].ip"),
                format_args!("{text:?} {error}"),
            ),
        }
    }
    ips
}

/// `loadBalancerSourceRanges`, trimmed (API validation lets whitespace through) and
/// canonicalised to network addresses.
fn source_ranges(spec: &ServiceSpec, problems: &mut Problems) -> Vec<IpNet> {
    let texts = spec
        .load_balancer_source_ranges
        .as_deref()
        .unwrap_or_default();
    let mut ranges = Vec::new();
    for (index, text) in texts.iter().enumerate() {
        match parse_cidr(text.trim()) {
            Ok(net) => ranges.push(net),
            Err(error) => problems.push(
                format_args!("spec.loadBalancerSourceRanges[{index}]"),
                format_args!("{text:?} {error}"),
            ),
        }
    }
    ranges
}

/// ClientIP affinity. Any other `sessionAffinity` value means none, as upstream.
fn session_affinity(spec: &ServiceSpec, problems: &mut Problems) -> Option<SessionAffinity> {
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return None;
    }
    let seconds = spec
        .session_affinity_config
        .as_ref()
        .and_then(|config| config.client_ip.as_ref())
        .and_then(|client_ip| client_ip.timeout_seconds)
        .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_SECONDS);
    match u64::try_from(seconds) {
        Ok(secs) if (1..=MAX_AFFINITY_TIMEOUT_SECONDS).contains(&seconds) => {
            Some(SessionAffinity {
                timeout: Duration::from_secs(secs),
            })
        }
        _ => {
            problems.push(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                format_args!("{seconds} is out of range 1-{MAX_AFFINITY_TIMEOUT_SECONDS}"),
            );
            None
        }
    }
}
