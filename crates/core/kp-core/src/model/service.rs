//! Building [`ServicePort`]s from a Service.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServiceSpec};

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
    // `clusterIPs[0]` always equals `clusterIP` when both are set; older objects may only
    // have `clusterIP`.
    let (cluster_ip_field, cluster_ip_texts): (&str, Vec<&String>) = match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ("spec.clusterIPs", ips.iter().collect()),
        _ => ("spec.clusterIP", spec.cluster_ip.iter().collect()),
    };
    match cluster_ip_texts.first() {
        None => return Ok(None),
        Some(primary) if primary.is_empty() || primary.as_str() == "None" => return Ok(None),
        Some(_) => {}
    }

    let mut problems = Problems::default();
    if name.is_empty() {
        problems.push("metadata.name", "must not be empty");
    }

    let cluster_ips = cluster_ips(cluster_ip_field, &cluster_ip_texts, &mut problems);
    let external_ips = ip_list(
        "spec.externalIPs",
        spec.external_ips.as_deref().unwrap_or_default(),
        &mut problems,
    );
    let load_balancer_ips = load_balancer_ips(service, &mut problems);
    let load_balancer_source_ranges = source_ranges(spec, &mut problems);
    let session_affinity = session_affinity(spec, &mut problems);

    // As upstream: eTP only counts for services that accept external traffic at all.
    let externally_accessible_type = match service_type {
        "LoadBalancer" | "NodePort" => true,
        "ClusterIP" => !external_ips.is_empty(),
        _ => false,
    };
    let external_policy_local =
        externally_accessible_type && spec.external_traffic_policy.as_deref() == Some("Local");
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let health_check_node_port = if service_type == "LoadBalancer" && external_policy_local {
        match spec.health_check_node_port {
            // Upstream logs and carries on without a health check.
            None | Some(0) => None,
            Some(port) => port_number(port)
                .map_err(|message| problems.push("spec.healthCheckNodePort", message))
                .ok(),
        }
    } else {
        None
    };

    let service_name = ServiceName {
        namespace: names.get(namespace),
        name: names.get(name),
    };
    // Sized up front, as the slices' lists: the tracker keeps this vector, and one pushed
    // element would get room for four.
    let mut ports = Vec::with_capacity(spec.ports.as_ref().map_or(0, Vec::len));
    // (name, protocol) -> index of the first port using it.
    let mut seen: BTreeMap<(&str, Protocol), usize> = BTreeMap::new();
    for (index, port) in spec.ports.iter().flatten().enumerate() {
        let path = format!("spec.ports[{index}]");
        let port_name = port.name.as_deref().unwrap_or_default();
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
        let Some(protocol) = protocol else { continue };
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
        let (Some(number), Some(node_port)) = (number, node_port) else {
            continue;
        };
        ports.push(ServicePort {
            name: ServicePortName {
                service: service_name.clone(),
                port: names.get(port_name),
                protocol,
            },
            cluster_ips: cluster_ips.clone(),
            port: number,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ips: load_balancer_ips.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            session_affinity,
            external_policy_local,
            internal_policy_local,
            health_check_node_port,
        });
    }

    problems.into_result("Service", namespace, name)?;
    // The tracker keeps this for every service: no spare room (a `ServicePort` is ~200 bytes).
    ports.shrink_to_fit();
    ports.shrink_to_fit();
    Ok(Some(ports))
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
