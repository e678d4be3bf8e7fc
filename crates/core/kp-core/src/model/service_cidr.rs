//! ServiceCIDR objects (`networking.k8s.io/v1`): the ranges ClusterIPs are allocated from.
//! nftables mode drops traffic to addresses inside them that no Service holds, as upstream.

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use super::ModelError;
use super::parse::check_strict_cidr;

/// The ranges of one ServiceCIDR (`spec.cidrs`, at most one per family), or every problem
/// found. A range with host bits set, leading zeros or an IPv4-mapped IPv6 address is an
/// error, as the API server's validation makes it.
pub fn service_cidr_ranges(object: &ServiceCIDR) -> Result<Vec<IpNet>, ModelError> {
    let mut ranges = Vec::new();
    let mut problems = Vec::new();
    let cidrs = object.spec.as_ref().and_then(|s| s.cidrs.as_ref());
    for (i, text) in cidrs.into_iter().flatten().enumerate() {
        // A new API (networking.k8s.io/v1, 1.33): validated strictly from the start, so no
        // stored value can have a legacy form.
        match check_strict_cidr(text) {
            Ok(net) => ranges.push(net),
            Err(error) => problems.push(format!("spec.cidrs[{i}]: {text:?} {error}")),
        }
    }
    if problems.is_empty() {
        Ok(ranges)
    } else {
        Err(ModelError {
            kind: "ServiceCIDR",
            namespace: String::new(),
            name: object.metadata.name.clone().unwrap_or_default(),
            problems,
        })
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::networking::v1::ServiceCIDRSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn object(cidrs: &[&str]) -> ServiceCIDR {
        ServiceCIDR {
            metadata: ObjectMeta {
                name: Some("kubernetes".into()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceCIDRSpec {
                cidrs: Some(cidrs.iter().map(|c| (*c).to_owned()).collect()),
            }),
            status: None,
        }
    }

    #[test]
    fn ranges_of_both_families_parse() {
        let ranges =
            service_cidr_ranges(&object(&["10.96.0.0/16", "fd00:10:96::/112"])).expect("valid");
        assert_eq!(ranges.len(), 2);
        assert_eq!(ranges[0].to_string(), "10.96.0.0/16");
    }

    #[test]
    fn every_bad_range_is_reported() {
        let err = service_cidr_ranges(&object(&["10.96.0.1/16", "nope", "10.97.0.0/16"]))
            .expect_err("invalid");
        assert_eq!(err.kind, "ServiceCIDR");
        assert_eq!(err.problems.len(), 2, "{:?}", err.problems);
        assert!(err.problems[0].contains("bits set beyond the prefix length"));
        assert!(err.problems[1].contains("spec.cidrs[1]"));
    }
}
