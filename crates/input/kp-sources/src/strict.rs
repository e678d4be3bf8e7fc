//! The API server's create-time address validation, for objects that never went through an
//! API server (manifests).
//!
//! An object read from a cluster was validated when it was written, possibly by an older API
//! server with laxer rules, so the model accepts the legacy forms such objects can hold
//! (leading zeros in IPv4 octets, host bits in CIDRs; see `kp_core::model::parse_ip`). A
//! manifest is a *new* object: it is checked here with the rules the API server applies to
//! new values under `StrictIPCIDRValidation` (`IsValidIPForLegacyField` /
//! `IsValidCIDRForLegacyField` with strict validation): no leading zeros, no IPv4-mapped
//! IPv6, no zones, CIDRs without bits beyond the prefix length. Every bad value of the
//! object is listed in one error; the object is skipped like any other broken document.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kp_core::model::{check_strict_cidr, check_strict_ip};

use crate::defaults::describe;

/// An object with address values the API server would refuse on create.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{object}: {}", problems.join("; "))]
pub struct StrictError {
    /// The object, as `Service namespace/name`.
    pub object: String,
    /// One entry per bad value: field, value and what is wrong, for example
    /// `spec.clusterIP "010.0.0.1" has leading zeros, which the API refuses in new objects:
    /// write 10.0.0.1`.
    pub problems: Vec<String>,
}

/// Collects the problems of one object.
struct Check(Vec<String>);

impl Check {
    fn ip(&mut self, field: impl std::fmt::Display, value: &str) {
        if let Err(error) = check_strict_ip(value) {
            self.0.push(format!("{field} {value:?} {error}"));
        }
    }

    fn ips<'a>(&mut self, field: &str, values: impl IntoIterator<Item = &'a String>) {
        for (index, value) in values.into_iter().enumerate() {
            self.ip(format_args!("{field}[{index}]"), value);
        }
    }

    fn cidrs<'a>(&mut self, field: &str, values: impl IntoIterator<Item = &'a String>) {
        for (index, value) in values.into_iter().enumerate() {
            // The API trims whitespace around source ranges before validating them.
            if let Err(error) = check_strict_cidr(value.trim()) {
                self.0.push(format!("{field}[{index}] {value:?} {error}"));
            }
        }
    }

    fn finish(self, object: String) -> Result<(), StrictError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(StrictError {
                object,
                problems: self.0,
            })
        }
    }
}

/// A Service's `spec.clusterIP(s)` (except `None`), `spec.externalIPs`,
/// `spec.loadBalancerIP`, `spec.loadBalancerSourceRanges` and
/// `status.loadBalancer.ingress[].ip`.
pub fn check_service(service: &Service) -> Result<(), StrictError> {
    let mut check = Check(Vec::new());
    if let Some(spec) = &service.spec {
        let set = |ip: &&String| !ip.is_empty() && ip.as_str() != "None";
        if let Some(ip) = spec.cluster_ip.as_ref().filter(set) {
            check.ip("spec.clusterIP", ip);
        }
        check.ips(
            "spec.clusterIPs",
            spec.cluster_ips.iter().flatten().filter(|ip| set(ip)),
        );
        check.ips("spec.externalIPs", spec.external_ips.iter().flatten());
        if let Some(ip) = spec.load_balancer_ip.as_ref().filter(set) {
            check.ip("spec.loadBalancerIP", ip);
        }
        check.cidrs(
            "spec.loadBalancerSourceRanges",
            spec.load_balancer_source_ranges.iter().flatten(),
        );
    }
    let ingress = service
        .status
        .as_ref()
        .and_then(|status| status.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_deref())
        .unwrap_or_default();
    for (index, entry) in ingress.iter().enumerate() {
        if let Some(ip) = entry.ip.as_deref().filter(|ip| !ip.is_empty()) {
            check.ip(format_args!("status.loadBalancer.ingress[{index}].ip"), ip);
        }
    }
    check.finish(describe("Service", &service.metadata))
}

/// Every address of an `IPv4` or `IPv6` EndpointSlice's endpoints.
pub fn check_endpoint_slice(slice: &EndpointSlice) -> Result<(), StrictError> {
    let mut check = Check(Vec::new());
    if matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
        for (index, endpoint) in slice.endpoints.iter().enumerate() {
            check.ips(
                &format!("endpoints[{index}].addresses"),
                endpoint.addresses.iter(),
            );
        }
    }
    check.finish(describe("EndpointSlice", &slice.metadata))
}

/// A Node's `spec.podCIDR` and `spec.podCIDRs`. Its `status.addresses` are not checked: the
/// API lets them hold host names, and the model skips any that is not an address.
pub fn check_node(node: &Node) -> Result<(), StrictError> {
    let mut check = Check(Vec::new());
    if let Some(spec) = &node.spec {
        check.cidrs(
            "spec.podCIDR",
            spec.pod_cidr.iter().filter(|c| !c.is_empty()),
        );
        check.cidrs("spec.podCIDRs", spec.pod_cidrs.iter().flatten());
    }
    check.finish(describe("Node", &node.metadata))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn service(spec: serde_json::Value, status: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": spec,
            "status": status,
        }))
        .expect("valid Service JSON")
    }

    #[test]
    fn canonical_addresses_pass() {
        let svc = service(
            json!({
                "clusterIP": "10.96.0.10",
                "clusterIPs": ["10.96.0.10", "fd00:10:96::a"],
                "externalIPs": ["192.0.2.1", "2001:db8::1"],
                "loadBalancerSourceRanges": [" 203.0.113.0/24 ", "2001:db8::/32", "0.0.0.0/0"],
            }),
            json!({"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}, {"hostname": "lb"}]}}),
        );
        assert_eq!(check_service(&svc), Ok(()));
        let headless = service(
            json!({"clusterIP": "None", "clusterIPs": ["None"]}),
            json!({}),
        );
        assert_eq!(check_service(&headless), Ok(()));
    }

    #[test]
    fn every_legacy_or_ambiguous_form_is_listed() {
        let svc = service(
            json!({
                "clusterIP": "::ffff:1.2.3.4",
                "clusterIPs": ["::ffff:1.2.3.4"],
                "externalIPs": ["010.1.1.1", "fe80::1%eth0"],
                "loadBalancerSourceRanges": ["10.1.2.3/8", "10.0.0.0/08"],
            }),
            json!({"loadBalancer": {"ingress": [{"ip": "1.2.3.004"}]}}),
        );
        let error = check_service(&svc).expect_err("refused");
        assert_eq!(error.object, "Service ns/web");
        let problems = error.problems.join("\n");
        for expected in [
            r#"spec.clusterIP "::ffff:1.2.3.4" is an IPv4-mapped IPv6 address"#,
            r#"spec.clusterIPs[0] "::ffff:1.2.3.4" is an IPv4-mapped"#,
            r#"spec.externalIPs[0] "010.1.1.1" has leading zeros, which the API refuses in new objects: write 10.1.1.1"#,
            r#"spec.externalIPs[1] "fe80::1%eth0" has an IPv6 zone"#,
            r#"spec.loadBalancerSourceRanges[0] "10.1.2.3/8" has bits set beyond the prefix length: write 10.0.0.0/8"#,
            r#"spec.loadBalancerSourceRanges[1] "10.0.0.0/08" has leading zeros"#,
            r#"status.loadBalancer.ingress[0].ip "1.2.3.004" has leading zeros"#,
        ] {
            assert!(
                problems.contains(expected),
                "{expected}\nnot in\n{problems}"
            );
        }
        assert_eq!(error.problems.len(), 7, "{problems}");
    }

    #[test]
    fn endpoint_slices_and_nodes() {
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "ns"},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1"]},
                {"addresses": ["10.0.0.2", "::ffff:10.0.0.3"]},
            ],
        }))
        .expect("valid slice");
        let error = check_endpoint_slice(&slice).expect_err("refused");
        assert_eq!(error.problems.len(), 1, "{error}");
        assert!(
            error.problems[0].starts_with("endpoints[1].addresses[1] \"::ffff:10.0.0.3\""),
            "{error}"
        );
        let fqdn: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "web-2", "namespace": "ns"},
            "addressType": "FQDN",
            "endpoints": [{"addresses": ["db.example.com"]}],
        }))
        .expect("valid slice");
        assert_eq!(check_endpoint_slice(&fqdn), Ok(()));

        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "node-1"},
            "spec": {"podCIDR": "10.244.1.1/24", "podCIDRs": ["10.244.1.1/24"]},
            "status": {"addresses": [{"type": "Hostname", "address": "node-1"}]},
        }))
        .expect("valid node");
        let error = check_node(&node).expect_err("refused");
        assert_eq!(error.object, "Node node-1");
        assert_eq!(error.problems.len(), 2, "{error}");
    }
}
