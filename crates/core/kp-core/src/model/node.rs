//! The proxy's own Node.

use k8s_openapi::api::core::v1::Node;

use super::NodeInfo;
use super::parse::{parse_cidr, parse_ip};

/// The taint the cluster autoscaler puts on a node it is about to delete; upstream's
/// /healthz then reports the node as not eligible so load balancers drain it.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Build the node's information from its Node object.
///
/// Addresses and pod CIDRs that do not parse ([`super::parse_ip`], [`super::parse_cidr`])
/// are skipped: they only refine behaviour
/// (node-IP checks, local-traffic detection) and must not stop the proxy.
pub fn node_info(node: &Node) -> NodeInfo {
    let spec = node.spec.as_ref();
    let node_addresses = node
        .status
        .as_ref()
        .and_then(|status| status.addresses.as_deref())
        .unwrap_or_default();
    let mut addresses = Vec::new();
    for wanted in ["InternalIP", "ExternalIP"] {
        for address in node_addresses.iter().filter(|a| a.type_ == wanted) {
            if let Ok(ip) = parse_ip(&address.address)
                && !addresses.contains(&ip)
            {
                addresses.push(ip);
            }
        }
    }

    let pod_cidr_texts: Vec<&String> = match spec.and_then(|s| s.pod_cidrs.as_ref()) {
        Some(cidrs) if !cidrs.is_empty() => cidrs.iter().collect(),
        _ => spec.and_then(|s| s.pod_cidr.as_ref()).into_iter().collect(),
    };
    let pod_cidrs = pod_cidr_texts
        .into_iter()
        .filter_map(|text| parse_cidr(text).ok())
        .collect();

    let tainted = spec
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
        .iter()
        .any(|taint| taint.key == TO_BE_DELETED_TAINT);
    let deleting = node.metadata.deletion_timestamp.is_some();

    NodeInfo {
        name: node.metadata.name.clone().unwrap_or_default(),
        labels: node.metadata.labels.clone().unwrap_or_default(),
        addresses,
        pod_cidrs,
        eligible: !deleting && !tainted,
        known: true,
    }
}
