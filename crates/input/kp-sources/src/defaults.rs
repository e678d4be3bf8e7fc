//! The defaults the API server would apply, so hand-written manifests yield the same model as
//! the objects read from a cluster.
//!
//! The API server fills in fields on every write: `kubectl apply` of a Service without
//! `protocol` is stored with `protocol: TCP`, and the proxy only ever sees the stored object.
//! The manifests source has no API server in front of it, so it calls these functions on every
//! object it reads. Each default below quotes the API's rule (Kubernetes 1.33,
//! `SetDefaults_Service` and `SetDefaults_EndpointSlice`, plus the Service registry's
//! `clusterIPs`/`ipFamilies`/`ipFamilyPolicy` initialisation).
//!
//! What the API server *allocates* rather than defaults cannot be reproduced here: cluster IPs,
//! node ports and health-check node ports. A Service that needs a cluster IP and has none is
//! an error ([`DefaultsError::MissingClusterIp`]); node ports that are not written are simply
//! absent. Nodes need no defaults the proxy reads.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::{ClientIPConfig, Service, SessionAffinityConfig};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kp_core::model::{AddressError, parse_ip};

/// `spec.type` when unset: the API defaults every Service to a cluster-internal virtual IP.
pub const DEFAULT_SERVICE_TYPE: &str = "ClusterIP";

/// `protocol` of a Service port or EndpointSlice port when unset: the API defaults to TCP.
pub const DEFAULT_PROTOCOL: &str = "TCP";

/// `spec.sessionAffinity` when unset: the API defaults to no affinity.
pub const DEFAULT_SESSION_AFFINITY: &str = "None";

/// `spec.sessionAffinityConfig.clientIP.timeoutSeconds` for ClientIP affinity when unset: the
/// API's `DefaultClientIPServiceAffinitySeconds`, three hours.
pub const DEFAULT_CLIENT_IP_TIMEOUT_SECONDS: i32 = 10800;

/// `spec.internalTrafficPolicy` and `spec.externalTrafficPolicy` when unset: the API defaults
/// both to routing to every endpoint in the cluster.
pub const DEFAULT_TRAFFIC_POLICY: &str = "Cluster";

/// `status.loadBalancer.ingress[].ipMode` for an ingress with an IP when unset: the API
/// (LoadBalancerIPMode, on by default since 1.30) defaults to `VIP`, traffic addressed to the
/// load-balancer IP itself.
pub const DEFAULT_LOAD_BALANCER_IP_MODE: &str = "VIP";

/// `spec.ipFamilyPolicy` for a Service with one cluster IP when unset.
pub const DEFAULT_SINGLE_STACK_POLICY: &str = "SingleStack";

/// `spec.ipFamilyPolicy` for a Service with two cluster IPs when unset: the user asked for
/// both families explicitly.
pub const DEFAULT_DUAL_STACK_POLICY: &str = "RequireDualStack";

/// A Service the defaults cannot be applied to, because the API server would have allocated
/// something or refused the object. Every variant names the object.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DefaultsError {
    /// The Service needs a cluster IP and has none. The API server would allocate one from the
    /// service CIDR; without it there is nothing to allocate from.
    #[error(
        "{object} has type {service_type} but no spec.clusterIP, and without an API server \
         nothing allocates one: set spec.clusterIP to a free address of the service CIDR \
         (or \"None\" for a headless service)"
    )]
    MissingClusterIp {
        /// The object, as `Service namespace/name`.
        object: String,
        /// Its `spec.type`, after defaulting.
        service_type: String,
    },
    /// A cluster IP is not an IP address the API accepts, so its family cannot be known.
    #[error("{object}: {field} {value:?} {error}")]
    InvalidClusterIp {
        /// The object, as `Service namespace/name`.
        object: String,
        /// The field, such as `spec.clusterIPs[1]`.
        field: String,
        /// The text found there.
        value: String,
        /// What is wrong with it.
        error: AddressError,
    },
    /// `spec.clusterIP` and `spec.clusterIPs[0]` are both set and differ; the API requires
    /// them equal, so there is no telling which one was meant.
    #[error(
        "{object}: spec.clusterIP {cluster_ip:?} differs from spec.clusterIPs[0] {first:?} \
         (they must be equal)"
    )]
    ClusterIpMismatch {
        /// The object, as `Service namespace/name`.
        object: String,
        /// `spec.clusterIP`.
        cluster_ip: String,
        /// `spec.clusterIPs[0]`.
        first: String,
    },
    /// `spec.clusterIPs` is not one address, or two addresses of different families.
    #[error("{object}: spec.clusterIPs {reason}")]
    InvalidClusterIps {
        /// The object, as `Service namespace/name`.
        object: String,
        /// What is wrong, for example `has 2 IPv4 addresses`.
        reason: String,
    },
    /// `spec.ipFamilies` or `spec.ipFamilyPolicy` contradicts the cluster IPs, or asks for a
    /// second family whose cluster IP only an API server could allocate.
    #[error("{object}: {reason}")]
    IpFamilies {
        /// The object, as `Service namespace/name`.
        object: String,
        /// What is wrong.
        reason: String,
    },
}

/// Apply the API server's Service defaults in place.
///
/// Headless (`clusterIP: None`) and ExternalName services get the port, affinity and
/// traffic-policy defaults but no family defaults: for them the API derives families from the
/// cluster's configuration, which is unknown here, and the proxy ignores such services anyway.
pub fn default_service(service: &mut Service) -> Result<(), DefaultsError> {
    let object = describe("Service", &service.metadata);
    let spec = service.spec.get_or_insert_with(Default::default);

    // `if Spec.Type == "" { Type = ClusterIP }`
    let service_type = spec
        .type_
        .get_or_insert_with(|| DEFAULT_SERVICE_TYPE.to_owned());
    if service_type.is_empty() {
        DEFAULT_SERVICE_TYPE.clone_into(service_type);
    }
    let service_type = service_type.clone();

    // `if SessionAffinity == "" { SessionAffinity = None }`; `None` drops any config; ClientIP
    // without a timeout gets the default timeout.
    let affinity = spec
        .session_affinity
        .get_or_insert_with(|| DEFAULT_SESSION_AFFINITY.to_owned());
    if affinity.is_empty() {
        DEFAULT_SESSION_AFFINITY.clone_into(affinity);
    }
    match affinity.as_str() {
        "None" => spec.session_affinity_config = None,
        "ClientIP" => {
            let client_ip = spec
                .session_affinity_config
                .get_or_insert_with(SessionAffinityConfig::default)
                .client_ip
                .get_or_insert_with(ClientIPConfig::default);
            client_ip
                .timeout_seconds
                .get_or_insert(DEFAULT_CLIENT_IP_TIMEOUT_SECONDS);
        }
        _ => {}
    }

    // Per port: `if Protocol == "" { Protocol = TCP }`; `if TargetPort is 0 or "" {
    // TargetPort = Port }`.
    for port in spec.ports.iter_mut().flatten() {
        if port.protocol.as_deref().is_none_or(str::is_empty) {
            port.protocol = Some(DEFAULT_PROTOCOL.to_owned());
        }
        let unset = match &port.target_port {
            None => true,
            Some(IntOrString::Int(value)) => *value == 0,
            Some(IntOrString::String(value)) => value.is_empty(),
        };
        if unset {
            port.target_port = Some(IntOrString::Int(port.port));
        }
    }

    // `if ExternallyAccessible(svc) && ExternalTrafficPolicy == "" { = Cluster }`, where
    // externally accessible is NodePort, LoadBalancer, or ClusterIP with external IPs.
    let externally_accessible = match service_type.as_str() {
        "NodePort" | "LoadBalancer" => true,
        "ClusterIP" => spec
            .external_ips
            .as_ref()
            .is_some_and(|ips| !ips.is_empty()),
        _ => false,
    };
    if externally_accessible
        && spec
            .external_traffic_policy
            .as_deref()
            .is_none_or(str::is_empty)
    {
        spec.external_traffic_policy = Some(DEFAULT_TRAFFIC_POLICY.to_owned());
    }

    // `if InternalTrafficPolicy == nil && Type in (ClusterIP, NodePort, LoadBalancer) {
    // = Cluster }`
    let has_cluster_ip = matches!(
        service_type.as_str(),
        "ClusterIP" | "NodePort" | "LoadBalancer"
    );
    if has_cluster_ip && spec.internal_traffic_policy.is_none() {
        spec.internal_traffic_policy = Some(DEFAULT_TRAFFIC_POLICY.to_owned());
    }

    if service_type == "LoadBalancer" {
        // `if AllocateLoadBalancerNodePorts == nil { = true }`
        spec.allocate_load_balancer_node_ports.get_or_insert(true);
        // `if ingress.IP != "" && ingress.IPMode == nil { IPMode = VIP }`
        let ingress = service
            .status
            .as_mut()
            .and_then(|status| status.load_balancer.as_mut())
            .and_then(|lb| lb.ingress.as_mut());
        for entry in ingress.into_iter().flatten() {
            if entry.ip.as_deref().is_some_and(|ip| !ip.is_empty()) && entry.ip_mode.is_none() {
                entry.ip_mode = Some(DEFAULT_LOAD_BALANCER_IP_MODE.to_owned());
            }
        }
    }

    if has_cluster_ip {
        let spec = service.spec.get_or_insert_with(Default::default);
        default_cluster_ips(&object, &service_type, spec)?;
    }
    Ok(())
}

/// The registry's cluster-IP and family initialisation: `clusterIPs` from `clusterIP` and
/// back, `ipFamilies` from the addresses, `ipFamilyPolicy` from how many there are.
fn default_cluster_ips(
    object: &str,
    service_type: &str,
    spec: &mut k8s_openapi::api::core::v1::ServiceSpec,
) -> Result<(), DefaultsError> {
    let cluster_ip = spec.cluster_ip.clone().filter(|ip| !ip.is_empty());
    let cluster_ips = spec.cluster_ips.clone().filter(|ips| !ips.is_empty());
    let ips = match (cluster_ip, cluster_ips) {
        (None, None) => {
            return Err(DefaultsError::MissingClusterIp {
                object: object.to_owned(),
                service_type: service_type.to_owned(),
            });
        }
        (Some(ip), None) => vec![ip],
        (None, Some(ips)) => ips,
        (Some(ip), Some(ips)) => {
            if ips[0] != ip {
                return Err(DefaultsError::ClusterIpMismatch {
                    object: object.to_owned(),
                    cluster_ip: ip,
                    first: ips[0].clone(),
                });
            }
            ips
        }
    };
    spec.cluster_ip = Some(ips[0].clone());
    spec.cluster_ips = Some(ips.clone());
    if ips[0] == "None" {
        // Headless: families depend on the cluster's configuration (see `default_service`).
        return Ok(());
    }

    let families = ips
        .iter()
        .enumerate()
        .map(|(index, text)| match parse_ip(text) {
            Ok(IpAddr::V4(_)) => Ok("IPv4"),
            Ok(IpAddr::V6(_)) => Ok("IPv6"),
            Err(error) => Err(DefaultsError::InvalidClusterIp {
                object: object.to_owned(),
                field: format!("spec.clusterIPs[{index}]"),
                value: text.clone(),
                error,
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let invalid_ips = |reason: String| DefaultsError::InvalidClusterIps {
        object: object.to_owned(),
        reason,
    };
    match families.as_slice() {
        [_] => {}
        [first, second] if first == second => {
            return Err(invalid_ips(format!(
                "has two {first} addresses (at most one per family)"
            )));
        }
        [_, _] => {}
        _ => {
            return Err(invalid_ips(format!(
                "has {} addresses (at most two: one per family)",
                families.len()
            )));
        }
    }

    let family_error = |reason: String| DefaultsError::IpFamilies {
        object: object.to_owned(),
        reason,
    };
    match spec.ip_families.as_deref() {
        None | Some([]) => {
            spec.ip_families = Some(families.iter().map(|f| (*f).to_owned()).collect());
        }
        Some(given) => {
            for (index, (given, actual)) in given.iter().zip(&families).enumerate() {
                if given != actual {
                    return Err(family_error(format!(
                        "spec.ipFamilies[{index}] is {given} but spec.clusterIPs[{index}] \
                         {:?} is {actual}",
                        ips[index]
                    )));
                }
            }
            if given.len() > families.len() {
                return Err(family_error(format!(
                    "spec.ipFamilies lists {} families but spec.clusterIPs has {} address, and \
                     without an API server nothing allocates the other: add it to \
                     spec.clusterIPs",
                    given.len(),
                    families.len()
                )));
            }
        }
    }

    match spec.ip_family_policy.as_deref() {
        None | Some("") => {
            let policy = if families.len() == 1 {
                DEFAULT_SINGLE_STACK_POLICY
            } else {
                DEFAULT_DUAL_STACK_POLICY
            };
            spec.ip_family_policy = Some(policy.to_owned());
        }
        Some("SingleStack") if families.len() > 1 => {
            return Err(family_error(
                "spec.ipFamilyPolicy is SingleStack but spec.clusterIPs has two addresses"
                    .to_owned(),
            ));
        }
        Some("RequireDualStack") if families.len() < 2 => {
            return Err(family_error(
                "spec.ipFamilyPolicy is RequireDualStack but spec.clusterIPs has one address, \
                 and without an API server nothing allocates the other: add it to \
                 spec.clusterIPs"
                    .to_owned(),
            ));
        }
        Some(_) => {}
    }
    Ok(())
}

/// Apply the API server's EndpointSlice defaults in place. Nothing here can fail.
///
/// Endpoint conditions are deliberately left unset: the API stores them as written, and the
/// model reads an unset `ready` as ready, as the API documents.
pub fn default_endpoint_slice(slice: &mut EndpointSlice) {
    // Per port: `if Name == nil { Name = "" }`; `if Protocol == nil { Protocol = TCP }`.
    for port in slice.ports.iter_mut().flatten() {
        port.name.get_or_insert_with(String::new);
        port.protocol
            .get_or_insert_with(|| DEFAULT_PROTOCOL.to_owned());
    }
}

/// `Kind namespace/name`, or `Kind name` without a namespace, for messages.
pub(crate) fn describe(kind: &str, metadata: &ObjectMeta) -> String {
    let name = shown(metadata.name.as_deref().unwrap_or("<unnamed>"));
    match metadata.namespace.as_deref() {
        Some(namespace) if !namespace.is_empty() => {
            format!("{kind} {}/{name}", shown(namespace))
        }
        _ => format!("{kind} {name}"),
    }
}

/// A name as messages show it: as it is, unless it holds control characters (a newline
/// would forge a log line of its own), which are escaped as Rust string escapes (`\n`).
pub(crate) fn shown(name: &str) -> std::borrow::Cow<'_, str> {
    if name.chars().any(char::is_control) {
        std::borrow::Cow::Owned(name.escape_debug().to_string())
    } else {
        std::borrow::Cow::Borrowed(name)
    }
}

#[cfg(test)]
mod tests;
