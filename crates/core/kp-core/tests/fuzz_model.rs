//! Property tests of the conversion from API objects (as a watch or the manifests source
//! delivers them) to the model: Services, EndpointSlices, Nodes and ServiceCIDRs built from
//! valid objects with fields mutated into hostile and edge-case values (names with quotes,
//! newlines and rule text; ports 0, -1, 65536, `i32` extremes; garbage, legacy and ambiguous
//! addresses; hundreds of ports and a thousand endpoints).
//!
//! Properties: nothing panics; a rejected object is reported under its own kind, namespace and
//! name with every problem naming a field; an accepted one holds only valid values (ports
//! 1-65535, no IPv4-mapped IPv6 address, addresses that were in the object); an object with
//! an address the API server refuses is never accepted; and the change tracker skips exactly
//! the objects the model rejects, reporting each once (the proxier logs and counts each of
//! those reports: `Proxier::sync`). Bounded for CI: [`CASES`] cases per property.

use std::collections::BTreeSet;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_core::model::{
    ModelError, node_info, parse_cidr, parse_ip, service_cidr_ranges, service_ports,
    slice_endpoints,
};
use kp_core::tracker::{ChangeTracker, ProxyState};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Value, json};

/// Cases per property.
const CASES: u32 = 256;

/// Names: valid ones, and ones that target rule syntax, logs and parsers.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z][a-z0-9-]{0,12}",
        1 => Just(String::new()),
        1 => Just("a\" -j ACCEPT".to_owned()),
        1 => Just("x\n-A KUBE-SERVICES -j ACCEPT".to_owned()),
        1 => Just("\" ; flush ruleset ; #".to_owned()),
        1 => Just("n".repeat(300)),
        1 => Just("名前\u{0}\u{7f}".to_owned()),
        2 => any::<String>(),
    ]
}

/// IPv4 addresses the API accepts (legacy forms included).
const GOOD_V4: &[&str] = &["10.0.0.1", "172.30.0.041", "192.168.99.22", "0.0.0.0"];

/// IPv6 addresses the API accepts.
const GOOD_V6: &[&str] = &[
    "fd00:10::1",
    "FD00:10::0001",
    "2001:db8::ff",
    "::1",
    "::1.2.3.4",
];

/// Addresses the API refuses: garbage, IPv4-mapped IPv6, zones, whitespace, CIDRs, rule text.
const BAD_IPS: &[&str] = &[
    "",
    "::ffff:1.2.3.4",
    "::ffff:10.0.0.1",
    "0:0:0:0:0:ffff:a00:1",
    "fe80::1%eth0",
    "10.0.0.1 ",
    "10.0.0.1\n-j ACCEPT",
    "10.0.0.256",
    "10.0.0",
    "0x0a.0.0.1",
    "10.0.0.1/32",
    "[fd00::1]",
    "None",
    "\" ; flush ruleset",
];

/// An address text and whether the API accepts it, of `family` (`None`: either) when valid.
fn ip_of(family: Option<bool>) -> impl Strategy<Value = (String, bool)> {
    let good: Vec<&'static str> = match family {
        Some(false) => GOOD_V4.to_vec(),
        Some(true) => GOOD_V6.to_vec(),
        None => GOOD_V4.iter().chain(GOOD_V6).copied().collect(),
    };
    prop_oneof![
        3 => proptest::sample::select(good).prop_map(|s| (s.to_owned(), true)),
        2 => proptest::sample::select(BAD_IPS).prop_map(|s| (s.to_owned(), false)),
        1 => any::<String>().prop_map(|s| {
            let ok = parse_ip(&s).is_ok();
            (s, ok)
        }),
    ]
}

fn ip_text() -> impl Strategy<Value = (String, bool)> {
    ip_of(None)
}

fn cidr_text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("203.0.113.0/24".to_owned()),
        Just(" 10.1.2.3/8 ".to_owned()),
        Just("203.0.113.000/025".to_owned()),
        Just("fd00::/64".to_owned()),
        Just("::ffff:1.2.3.0/120".to_owned()),
        Just("10.0.0.0/33".to_owned()),
        Just("10.0.0.0".to_owned()),
        Just("fe80::%eth0/64".to_owned()),
        any::<String>(),
    ]
}

fn port_number() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => 1i64..=65535,
        1 => Just(0i64),
        1 => Just(-1i64),
        1 => Just(65536i64),
        1 => Just(i64::from(i32::MAX)),
        1 => Just(i64::from(i32::MIN)),
    ]
}

fn protocol() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        4 => proptest::sample::select(&["TCP", "UDP", "SCTP"][..]).prop_map(|p| Some(p.to_owned())),
        1 => Just(None),
        1 => proptest::sample::select(&["tcp", "", "ICMP", "TCP\n"][..]).prop_map(|p| Some(p.to_owned())),
    ]
}

fn service_port() -> impl Strategy<Value = Value> {
    (
        proptest::option::of(name()),
        protocol(),
        port_number(),
        proptest::option::of(port_number()),
    )
        .prop_map(|(name, protocol, port, node_port)| {
            let mut p = json!({"port": port});
            if let Some(name) = name {
                p["name"] = json!(name);
            }
            if let Some(protocol) = protocol {
                p["protocol"] = json!(protocol);
            }
            if let Some(node_port) = node_port {
                p["nodePort"] = json!(node_port);
            }
            p
        })
}

/// A Service and whether every address it holds is one the API accepts.
fn service() -> impl Strategy<Value = (Value, bool)> {
    (
        (name(), name()),
        proptest::sample::select(
            &[
                "ClusterIP",
                "NodePort",
                "LoadBalancer",
                "ExternalName",
                "Weird",
            ][..],
        ),
        proptest::collection::vec(ip_text(), 1..3),
        proptest::collection::vec(ip_text(), 0..3),
        proptest::collection::vec((ip_text(), any::<bool>()), 0..3),
        proptest::collection::vec(cidr_text(), 0..3),
        prop_oneof![
            8 => proptest::collection::vec(service_port(), 0..4),
            1 => proptest::collection::vec(service_port(), 150..250),
        ],
        (
            proptest::option::of(prop_oneof![Just(-1i64), Just(0), Just(10800), Just(86401)]),
            any::<[bool; 3]>(),
        ),
    )
        .prop_map(
            |(
                (namespace, name),
                type_,
                cluster_ips,
                external_ips,
                ingress,
                ranges,
                ports,
                (timeout, [affinity, etp, itp]),
            )| {
                let mut all_good =
                    cluster_ips.iter().all(|(_, ok)| *ok) && external_ips.iter().all(|(_, ok)| *ok);
                let cluster: Vec<&String> = cluster_ips.iter().map(|(ip, _)| ip).collect();
                let mut spec = json!({
                    "type": type_,
                    "clusterIP": cluster[0],
                    "clusterIPs": cluster,
                    "externalIPs": external_ips.iter().map(|(ip, _)| ip).collect::<Vec<_>>(),
                    "loadBalancerSourceRanges": ranges,
                    "ports": ports,
                    "externalTrafficPolicy": if etp { "Local" } else { "Cluster" },
                    "internalTrafficPolicy": if itp { "Local" } else { "Cluster" },
                });
                if affinity {
                    spec["sessionAffinity"] = json!("ClientIP");
                    if let Some(timeout) = timeout {
                        spec["sessionAffinityConfig"] =
                            json!({"clientIP": {"timeoutSeconds": timeout}});
                    }
                }
                let ingress: Vec<Value> = ingress
                    .iter()
                    .map(|((ip, ok), proxy)| {
                        // Proxy-mode entries get no rules, so are not read.
                        all_good &= *ok || *proxy || ip.is_empty();
                        let mut entry = json!({"ip": ip});
                        if *proxy {
                            entry["ipMode"] = json!("Proxy");
                        }
                        entry
                    })
                    .collect();
                let object = json!({
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": spec,
                    "status": {"loadBalancer": {"ingress": ingress}},
                });
                (object, all_good)
            },
        )
}

/// An EndpointSlice and whether every endpoint's first address is one the API accepts.
fn endpoint_slice() -> impl Strategy<Value = (Value, bool)> {
    (
        (name(), name(), name()),
        proptest::sample::select(&["IPv4", "IPv6", "FQDN", "IP", ""][..]).prop_flat_map(|family| {
            let pool = move || ip_of(match family {
                "IPv4" => Some(false),
                "IPv6" => Some(true),
                _ => None,
            });
            (
                Just(family),
                prop_oneof![
                    8 => proptest::collection::vec((pool(), any::<[bool; 3]>()), 0..5),
                    1 => proptest::collection::vec((pool(), any::<[bool; 3]>()), 900..1100),
                ],
            )
        }),
        proptest::collection::vec(service_port(), 0..4),
    )
        .prop_map(|((namespace, name, service), (family, endpoints), ports)| {
            let all_good = endpoints.iter().all(|((_, ok), _)| *ok);
            let endpoints: Vec<Value> = endpoints
                .iter()
                .map(|((ip, _), [ready, serving, terminating])| {
                    json!({
                        "addresses": [ip],
                        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
                        "nodeName": "node-1",
                    })
                })
                .collect();
            let object = json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": {"kubernetes.io/service-name": service},
                },
                "addressType": family,
                "endpoints": endpoints,
                "ports": ports,
            });
            (object, all_good)
        })
}

fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    })
}

/// The error is about this object and names a field in every problem.
fn check_error(
    error: &ModelError,
    kind: &str,
    namespace: &str,
    name: &str,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(error.kind, kind);
    prop_assert_eq!(&error.namespace, namespace);
    prop_assert_eq!(&error.name, name);
    prop_assert!(!error.problems.is_empty());
    for problem in &error.problems {
        let field = problem.split(':').next().unwrap_or_default();
        prop_assert!(
            [
                "metadata.",
                "spec.",
                "status.",
                "endpoints[",
                "ports[",
                "addressType"
            ]
            .iter()
            .any(|prefix| field.starts_with(prefix)),
            "problem without a field: {:?}",
            problem
        );
    }
    Ok(())
}

fn is_mapped(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some())
}

#[test]
fn services_convert_or_are_rejected_by_name() {
    runner()
        .run(&service(), |(value, all_good)| {
            let service: Service = serde_json::from_value(value.clone()).expect("typed");
            let namespace = service.metadata.namespace.clone().unwrap_or_default();
            let name = service.metadata.name.clone().unwrap_or_default();
            match service_ports(&service) {
                Err(error) => check_error(&error, "Service", &namespace, &name)?,
                Ok(None) => {}
                Ok(Some(ports)) => {
                    prop_assert!(all_good, "an address the API refuses was accepted: {value}");
                    let declared = service.spec.as_ref().and_then(|s| s.ports.as_ref());
                    prop_assert!(ports.len() <= declared.map_or(0, Vec::len));
                    for port in &ports {
                        prop_assert!(port.port != 0);
                        prop_assert!(port.node_port != Some(0));
                        prop_assert!(!port.cluster_ips.is_empty());
                        for ip in port
                            .cluster_ips
                            .iter()
                            .chain(&port.external_ips)
                            .chain(&port.load_balancer_ips)
                        {
                            prop_assert!(!is_mapped(ip), "{}", ip);
                        }
                        prop_assert_eq!(&port.name.service.name, &name);
                    }
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

#[test]
fn endpoint_slices_convert_or_are_rejected_by_name() {
    runner()
        .run(&endpoint_slice(), |(value, all_good)| {
            let slice: EndpointSlice = serde_json::from_value(value.clone()).expect("typed");
            let namespace = slice.metadata.namespace.clone().unwrap_or_default();
            let name = slice.metadata.name.clone().unwrap_or_default();
            match slice_endpoints(&slice) {
                Err(error) => check_error(&error, "EndpointSlice", &namespace, &name)?,
                Ok(None) => {}
                Ok(Some(parsed)) => {
                    prop_assert!(all_good, "an address the API refuses was accepted: {value}");
                    prop_assert_eq!(parsed.endpoints.len(), slice.endpoints.len());
                    for endpoint in &parsed.endpoints {
                        prop_assert!(!is_mapped(&endpoint.ip));
                    }
                    for (_, _, port) in &parsed.ports {
                        prop_assert!(*port != 0);
                    }
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

#[test]
fn nodes_and_service_cidrs_never_panic() {
    let strategy = (
        name(),
        proptest::collection::vec((ip_text(), any::<bool>()), 0..4),
        proptest::collection::vec(cidr_text(), 0..3),
    );
    runner()
        .run(&strategy, |(name, addresses, cidrs)| {
            let node: Node = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"podCIDRs": cidrs},
                "status": {"addresses": addresses.iter().map(|((ip, _), internal)| json!({
                    "type": if *internal { "InternalIP" } else { "ExternalIP" },
                    "address": ip,
                })).collect::<Vec<_>>()},
            }))
            .expect("typed");
            let info = node_info(&node);
            prop_assert_eq!(&info.name, &name);
            for ip in &info.addresses {
                prop_assert!(!is_mapped(ip));
                let from_object = addresses
                    .iter()
                    .any(|((text, _), _)| parse_ip(text).ok() == Some(*ip));
                prop_assert!(from_object, "{} was not in the Node", ip);
            }
            let object: ServiceCIDR = serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"cidrs": cidrs},
            }))
            .expect("typed");
            match service_cidr_ranges(&object) {
                Ok(ranges) => prop_assert_eq!(ranges.len(), cidrs.len()),
                Err(error) => {
                    prop_assert_eq!(error.kind, "ServiceCIDR");
                    prop_assert_eq!(&error.name, &name);
                    prop_assert!(error.problems.iter().all(|p| p.starts_with("spec.cidrs[")));
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

/// The tracker skips exactly what the model rejects, reports each rejection once, and keeps
/// the valid objects' service ports.
#[test]
fn the_tracker_reports_every_rejected_object_once() {
    let strategy = (
        proptest::collection::vec(service(), 0..6),
        proptest::collection::vec(endpoint_slice(), 0..6),
    );
    runner()
        .run(&strategy, |(services, slices)| {
            let mut tracker = ChangeTracker::new("node-1");
            let mut expected_invalid = BTreeSet::new();
            let mut rejections = 0;
            for (value, _) in &services {
                let service: Service = serde_json::from_value(value.clone()).expect("typed");
                if let Err(error) = service_ports(&service) {
                    expected_invalid.insert(("Service", error.namespace, error.name));
                    rejections += 1;
                }
                tracker.record(SourceEvent::Service(ObjectEvent::Applied(service)));
            }
            for (value, _) in &slices {
                let slice: EndpointSlice = serde_json::from_value(value.clone()).expect("typed");
                if let Err(error) = slice_endpoints(&slice) {
                    expected_invalid.insert(("EndpointSlice", error.namespace, error.name));
                    rejections += 1;
                }
                tracker.record(SourceEvent::EndpointSlice(ObjectEvent::Applied(slice)));
            }
            tracker.record(SourceEvent::Service(ObjectEvent::Synced));
            tracker.record(SourceEvent::EndpointSlice(ObjectEvent::Synced));
            let mut state = ProxyState::default();
            let update = tracker.apply(&mut state);
            let reported: BTreeSet<_> = update
                .invalid
                .iter()
                .map(|e| (e.kind, e.namespace.clone(), e.name.clone()))
                .collect();
            prop_assert_eq!(&reported, &expected_invalid);
            prop_assert_eq!(update.invalid.len(), rejections);
            // Each rejected version is reported by the apply that follows it, once.
            prop_assert!(tracker.apply(&mut state).invalid.is_empty());
            for port in state.services.values() {
                prop_assert!(port.port != 0);
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

/// Structured mutation: a valid LoadBalancer Service and its EndpointSlice, with exactly one
/// address field set to a form the API server refuses. The object must be rejected, with a
/// problem naming that field; the untouched object is accepted.
#[test]
fn one_refused_address_rejects_the_object() {
    let refused = prop_oneof![
        proptest::sample::select(BAD_IPS).prop_map(str::to_owned),
        any::<String>().prop_filter("refused", |s| parse_ip(s).is_err()),
    ];
    let strategy = (refused, 0usize..5, any::<bool>());
    runner()
        .run(&strategy, |(bad, field, v6)| {
            let (cluster, external, lb, endpoint) = if v6 {
                ("fd00:96::10", "2001:db8::22", "2001:db8::33", "fd00:10::5")
            } else {
                ("10.96.0.10", "192.0.2.22", "198.51.100.33", "10.244.0.5")
            };
            let mut service = json!({
                "metadata": {"name": "web", "namespace": "ns"},
                "spec": {
                    "type": "LoadBalancer",
                    "clusterIP": cluster,
                    "clusterIPs": [cluster],
                    "externalIPs": [external],
                    "loadBalancerSourceRanges": [if v6 { "2001:db8::/32" } else { "203.0.113.0/24" }],
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080}],
                },
                "status": {"loadBalancer": {"ingress": [{"ip": lb}]}},
            });
            let mut slice = json!({
                "metadata": {
                    "name": "web-1",
                    "namespace": "ns",
                    "labels": {"kubernetes.io/service-name": "web"},
                },
                "addressType": if v6 { "IPv6" } else { "IPv4" },
                "endpoints": [{"addresses": [endpoint]}],
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            });
            let typed = |v: &Value| serde_json::from_value::<Service>(v.clone()).expect("typed");
            prop_assert!(matches!(service_ports(&typed(&service)), Ok(Some(_))));
            let path = match field {
                0 => {
                    service["spec"]["clusterIP"] = json!(bad);
                    service["spec"]["clusterIPs"] = json!([bad]);
                    "spec.clusterIP"
                }
                1 => {
                    service["spec"]["externalIPs"] = json!([external, bad]);
                    "spec.externalIPs[1]"
                }
                2 => {
                        // An empty IP is a hostname-only entry, which gets no rules.
                    prop_assume!(!bad.is_empty());
                    service["status"]["loadBalancer"]["ingress"] = json!([{"ip": lb}, {"ip": bad}]);
                    "status.loadBalancer.ingress[1].ip"
                }
                3 => {
                    // As a CIDR: the address part refused (whitespace around it is trimmed).
                    prop_assume!(parse_cidr(format!("{bad}/24").trim()).is_err());
                    service["spec"]["loadBalancerSourceRanges"] = json!([format!("{bad}/24")]);
                    "spec.loadBalancerSourceRanges[0]"
                }
                _ => {
                    slice["endpoints"] = json!([{"addresses": [endpoint]}, {"addresses": [bad]}]);
                    "endpoints[1].addresses[0]"
                }
            };
            if field == 4 {
                let slice: EndpointSlice = serde_json::from_value(slice).expect("typed");
                let error = slice_endpoints(&slice).expect_err("refused address accepted");
                prop_assert!(error.problems.iter().any(|p| p.starts_with(path)), "{}", error);
                return Ok(());
            }
            match service_ports(&typed(&service)) {
                // An empty or `None` ClusterIP makes a headless Service, which is ignored.
                Ok(None) if field == 0 && (bad.is_empty() || bad == "None") => {}
                Ok(ports) => {
                    return Err(TestCaseError::fail(format!(
                        "{bad:?} in {path} accepted: {ports:?}"
                    )));
                }
                Err(error) => {
                    prop_assert!(error.problems.iter().any(|p| p.starts_with(path)), "{}", error);
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}
