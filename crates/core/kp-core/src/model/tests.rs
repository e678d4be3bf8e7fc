//! Tests for building the model from Kubernetes objects, written as the API serves them.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service;
use serde_json::{Value, json};

use super::*;
use crate::fixtures::{self, endpoint, object, port_80_spec, service_json};

fn ip(text: &str) -> IpAddr {
    text.parse().expect("test IP")
}

fn ips(texts: &[&str]) -> Vec<IpAddr> {
    texts.iter().map(|t| ip(t)).collect()
}

fn net(text: &str) -> IpNet {
    text.parse().expect("test CIDR")
}

/// The Service `ns/web` with the given spec, as JSON (to add a status to).
fn svc_json(spec: Value) -> Value {
    service_json("ns", "web", spec)
}

fn ports_of(value: Value) -> Vec<ServicePort> {
    service_ports(&object(value))
        .expect("valid Service")
        .expect("Service not ignored")
}

fn only_port(value: Value) -> ServicePort {
    let mut ports = ports_of(value);
    assert_eq!(ports.len(), 1, "{ports:?}");
    ports.remove(0)
}

fn problems_of(value: Value) -> Vec<String> {
    service_ports(&object(value))
        .expect_err("invalid Service")
        .problems
}

// ---------------------------------------------------------------- address parsing

#[test]
fn ip_parsing_follows_the_api_legacy_rules() {
    let cases: &[(&str, Result<&str, AddressError>)] = &[
        ("10.0.0.1", Ok("10.0.0.1")),
        ("172.30.0.041", Ok("172.30.0.41")),
        ("010.000.001.009", Ok("10.0.1.9")),
        ("0001.2.3.4", Ok("1.2.3.4")),
        ("fd00:10::0001", Ok("fd00:10::1")),
        ("64:ff9b::010.1.2.3", Ok("64:ff9b::a01:203")),
        // IPv4-compatible (deprecated, not mapped): IPv6, as the API reads it.
        ("::1.2.3.4", Ok("::102:304")),
        (
            "::ffff:1.2.3.4",
            Err(AddressError::Ipv4Mapped("1.2.3.4".parse().expect("v4"))),
        ),
        (
            "::FFFF:010.1.2.3",
            Err(AddressError::Ipv4Mapped("10.1.2.3".parse().expect("v4"))),
        ),
        (
            "0:0:0:0:0:ffff:102:304",
            Err(AddressError::Ipv4Mapped("1.2.3.4".parse().expect("v4"))),
        ),
        ("fe80::1%eth0", Err(AddressError::Zone)),
        ("fe80::1%", Err(AddressError::Zone)),
        ("1.2.3.4%eth0", Err(AddressError::NotAnIp)),
        ("1.2.3", Err(AddressError::NotAnIp)),
        ("1.2.3.4.5", Err(AddressError::NotAnIp)),
        ("256.1.1.1", Err(AddressError::NotAnIp)),
        ("1.2.3.0256", Err(AddressError::NotAnIp)),
        (" 1.2.3.4", Err(AddressError::NotAnIp)),
        ("1.2.3.4\n", Err(AddressError::NotAnIp)),
        ("1.2.3.-4", Err(AddressError::NotAnIp)),
        ("0x01.2.3.4", Err(AddressError::NotAnIp)),
        ("1.2.3.4/32", Err(AddressError::NotAnIp)),
        ("[fd00::1]", Err(AddressError::NotAnIp)),
        ("", Err(AddressError::NotAnIp)),
        ("None", Err(AddressError::NotAnIp)),
        ("fd00::g", Err(AddressError::NotAnIp)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_ip(text), want.map(ip), "{text:?}");
    }
}

#[test]
fn strict_ip_rules_refuse_leading_zeros() {
    assert_eq!(check_strict_ip("10.0.0.1"), Ok(ip("10.0.0.1")));
    assert_eq!(check_strict_ip("0.0.0.0"), Ok(ip("0.0.0.0")));
    assert_eq!(check_strict_ip("FD00:10::0001"), Ok(ip("fd00:10::1")));
    for text in ["010.0.0.1", "10.0.0.01", "64:ff9b::010.1.2.3"] {
        assert!(
            matches!(check_strict_ip(text), Err(AddressError::LeadingZeros(_))),
            "{text}"
        );
    }
    assert_eq!(
        check_strict_ip("010.0.0.1")
            .expect_err("leading zeros")
            .to_string(),
        "has leading zeros, which the API refuses in new objects: write 10.0.0.1"
    );
    assert!(matches!(
        check_strict_ip("::ffff:10.0.0.1"),
        Err(AddressError::Ipv4Mapped(_))
    ));
}

#[test]
fn cidr_parsing_returns_the_network() {
    let cases: &[(&str, Result<&str, AddressError>)] = &[
        ("203.0.113.0/25", Ok("203.0.113.0/25")),
        ("203.0.113.000/025", Ok("203.0.113.0/25")),
        ("203.0.113.130/25", Ok("203.0.113.128/25")),
        ("10.1.2.3/8", Ok("10.0.0.0/8")),
        ("0.0.0.0/0", Ok("0.0.0.0/0")),
        ("fd00:10::1/64", Ok("fd00:10::/64")),
        (
            "::ffff:1.2.3.0/120",
            Err(AddressError::Ipv4Mapped("1.2.3.0".parse().expect("v4"))),
        ),
        ("fe80::%eth0/64", Err(AddressError::Zone)),
        ("203.0.113.0/33", Err(AddressError::NotACidr)),
        ("fd00::/129", Err(AddressError::NotACidr)),
        ("203.0.113.0/", Err(AddressError::NotACidr)),
        ("203.0.113.0", Err(AddressError::NotACidr)),
        ("203.0.113.0/2x", Err(AddressError::NotACidr)),
        ("203.0.113.0/-1", Err(AddressError::NotACidr)),
        ("1.2.3/24", Err(AddressError::NotACidr)),
        ("203.0.113.0/25/1", Err(AddressError::NotACidr)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_cidr(text), want.map(net), "{text:?}");
    }
}

#[test]
fn strict_cidr_rules_refuse_leading_zeros_and_host_bits() {
    assert_eq!(check_strict_cidr("10.0.0.0/8"), Ok(net("10.0.0.0/8")));
    assert_eq!(check_strict_cidr("0.0.0.0/0"), Ok(net("0.0.0.0/0")));
    assert_eq!(check_strict_cidr("fd00:10::/64"), Ok(net("fd00:10::/64")));
    assert_eq!(
        check_strict_cidr("10.1.2.3/8"),
        Err(AddressError::HostBits(net("10.0.0.0/8")))
    );
    for text in ["010.0.0.0/8", "10.0.0.0/08"] {
        assert!(
            matches!(check_strict_cidr(text), Err(AddressError::LeadingZeros(_))),
            "{text}"
        );
    }
}

#[test]
fn ipv4_mapped_and_zoned_addresses_are_rejected_in_every_field() {
    let mut value = svc_json(json!({
        "type": "LoadBalancer",
        "clusterIP": "::ffff:1.2.3.4",
        "clusterIPs": ["::ffff:1.2.3.4"],
        "externalIPs": ["::ffff:192.168.99.22", "fe80::1%eth0"],
        "loadBalancerSourceRanges": ["::ffff:203.0.113.0/120"],
        "ports": [{"port": 80, "nodePort": 3001}],
    }));
    value["status"] = json!({"loadBalancer": {"ingress": [{"ip": "::ffff:1.2.3.5"}]}});
    let problems = problems_of(value);
    assert_eq!(problems.len(), 5, "{problems:#?}");
    assert!(
        problems[0].starts_with(
            r#"spec.clusterIPs[0]: "::ffff:1.2.3.4" is an IPv4-mapped IPv6 address, which the API refuses: write the IPv4 address 1.2.3.4"#
        ),
        "{problems:#?}"
    );
    assert!(problems[2].contains("IPv6 zone"), "{problems:#?}");
}

// ---------------------------------------------------------------- Service

#[test]
fn cluster_ip_service_with_named_ports() {
    let ports = ports_of(svc_json(json!({
        "type": "ClusterIP",
        "clusterIP": "172.30.0.41",
        "clusterIPs": ["172.30.0.41"],
        "ports": [
            {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
            {"name": "dns", "port": 53, "targetPort": "dns", "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            {"name": "sig", "port": 7777, "protocol": "SCTP"},
        ],
    })));
    let summary: Vec<(String, Protocol, u16)> = ports
        .iter()
        .map(|p| (p.name.to_string(), p.name.protocol, p.port))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("ns/web:http".to_owned(), Protocol::Tcp, 80),
            ("ns/web:dns".to_owned(), Protocol::Udp, 53),
            ("ns/web:dns-tcp".to_owned(), Protocol::Tcp, 53),
            ("ns/web:sig".to_owned(), Protocol::Sctp, 7777),
        ]
    );
    for port in &ports {
        assert_eq!(port.cluster_ips, ips(&["172.30.0.41"]));
        assert_eq!(port.node_port, None);
        assert!(port.external_ips.is_empty());
        assert!(port.load_balancer_ips.is_empty());
        assert!(port.load_balancer_source_ranges.is_empty());
        assert_eq!(port.session_affinity, None);
        assert!(!port.external_policy_local);
        assert!(!port.internal_policy_local);
        assert_eq!(port.health_check_node_port, None);
        assert!(!port.externally_accessible());
        assert!(port.uses_cluster_endpoints());
        assert!(!port.uses_local_endpoints());
    }
}

#[test]
fn unnamed_port_defaults_to_tcp() {
    let port = only_port(svc_json(json!({
        "clusterIP": "172.30.0.42",
        "ports": [{"port": 8080}],
    })));
    assert_eq!(port.name.port, "");
    assert_eq!(port.name.protocol, Protocol::Tcp);
    assert_eq!(port.name.to_string(), "ns/web");
    assert_eq!(port.port, 8080);
}

#[test]
fn service_without_ports_has_none() {
    assert_eq!(
        ports_of(svc_json(json!({"clusterIP": "172.30.0.42"}))),
        vec![]
    );
}

#[test]
fn ignored_services_are_not_validated() {
    // Each carries an invalid port to show ignored services are skipped before validation.
    let bad_port = json!([{"name": "p", "port": 70000}]);
    let cases = [
        (
            "ExternalName",
            json!({"type": "ExternalName", "externalName": "example.com", "ports": bad_port}),
        ),
        (
            "ExternalName with a ClusterIP",
            json!({"type": "ExternalName", "clusterIP": "172.30.0.1", "ports": bad_port}),
        ),
        (
            "headless clusterIP",
            json!({"clusterIP": "None", "ports": bad_port}),
        ),
        (
            "headless clusterIPs",
            json!({"clusterIP": "None", "clusterIPs": ["None"], "ports": bad_port}),
        ),
        (
            "empty clusterIP",
            json!({"clusterIP": "", "ports": bad_port}),
        ),
        ("no clusterIP", json!({"ports": bad_port})),
    ];
    for (what, spec) in cases {
        let result = service_ports(&object(svc_json(spec)));
        assert_eq!(result, Ok(None), "{what}");
    }
    let no_spec: Service = object(json!({"metadata": {"namespace": "ns", "name": "web"}}));
    assert_eq!(service_ports(&no_spec), Ok(None));
}

#[test]
fn cluster_ips_fall_back_to_cluster_ip() {
    let cases = [
        (json!({"clusterIP": "172.30.0.1"}), vec!["172.30.0.1"]),
        (
            json!({"clusterIP": "172.30.0.1", "clusterIPs": []}),
            vec!["172.30.0.1"],
        ),
        (
            json!({"clusterIP": "172.30.0.1", "clusterIPs": ["172.30.0.1", "fd00:10:96::1"]}),
            vec!["172.30.0.1", "fd00:10:96::1"],
        ),
        (
            json!({"clusterIP": "fd00:10:96::1", "clusterIPs": ["fd00:10:96::1", "172.30.0.1"]}),
            vec!["fd00:10:96::1", "172.30.0.1"],
        ),
    ];
    for (mut spec, want) in cases {
        spec["ports"] = json!([{"port": 80}]);
        assert_eq!(
            only_port(svc_json(spec.clone())).cluster_ips,
            ips(&want),
            "{spec}"
        );
    }
}

#[test]
fn dual_stack_service_splits_per_family() {
    let mut value = svc_json(json!({
        "type": "LoadBalancer",
        "clusterIP": "172.30.0.41",
        "clusterIPs": ["172.30.0.41", "fd00:172:30::41"],
        "ipFamilies": ["IPv4", "IPv6"],
        "ipFamilyPolicy": "RequireDualStack",
        "externalIPs": ["192.168.99.11", "2001:db8::11"],
        "loadBalancerSourceRanges": ["203.0.113.0/25", "2600:5200::/64"],
        "ports": [{"name": "p80", "port": 80, "nodePort": 3001}],
    }));
    value["status"] =
        json!({"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}, {"ip": "2001:db8::1234"}]}});
    let port = only_port(value);

    let v4 = port
        .for_family(IpFamily::V4)
        .expect("has an IPv4 ClusterIP");
    assert_eq!(v4.cluster_ips, ips(&["172.30.0.41"]));
    assert_eq!(v4.external_ips, ips(&["192.168.99.11"]));
    assert_eq!(v4.load_balancer_ips, ips(&["1.2.3.4"]));
    assert_eq!(v4.load_balancer_source_ranges, vec![net("203.0.113.0/25")]);
    assert_eq!((v4.port, v4.node_port), (80, Some(3001)));
    assert_eq!(v4.name, port.name);

    let v6 = port
        .for_family(IpFamily::V6)
        .expect("has an IPv6 ClusterIP");
    assert_eq!(v6.cluster_ips, ips(&["fd00:172:30::41"]));
    assert_eq!(v6.external_ips, ips(&["2001:db8::11"]));
    assert_eq!(v6.load_balancer_ips, ips(&["2001:db8::1234"]));
    assert_eq!(v6.load_balancer_source_ranges, vec![net("2600:5200::/64")]);
}

#[test]
fn for_family_without_a_cluster_ip_of_that_family_is_none() {
    let port = only_port(svc_json(json!({
        "clusterIP": "172.30.0.41",
        "externalIPs": ["2001:db8::11"],
        "ports": [{"port": 80}],
    })));
    assert_eq!(port.for_family(IpFamily::V6), None);
    // Other-family externalIPs are dropped, so the IPv4 port is not externally accessible.
    let v4 = port.for_family(IpFamily::V4).expect("IPv4");
    assert!(port.externally_accessible());
    assert!(!v4.externally_accessible());
}

#[test]
fn load_balancer_ingress_skips_proxy_mode_and_hostnames() {
    let mut value = svc_json(json!({
        "type": "LoadBalancer",
        "clusterIP": "172.30.0.41",
        "ports": [{"port": 80, "nodePort": 3001}],
    }));
    value["status"] = json!({"loadBalancer": {"ingress": [
        {"ip": "1.2.3.4"},
        {"ip": "5.6.7.8", "ipMode": "Proxy"},
        {"hostname": "lb.example.com"},
        {"ip": "", "hostname": "lb2.example.com"},
        {"ip": "9.10.11.12", "ipMode": "VIP"},
    ]}});
    assert_eq!(
        only_port(value).load_balancer_ips,
        ips(&["1.2.3.4", "9.10.11.12"])
    );
}

#[test]
fn leading_zeros_are_read_leniently_and_stored_canonically() {
    let mut value = svc_json(json!({
        "type": "LoadBalancer",
        "clusterIP": "172.30.0.041",
        "clusterIPs": ["172.30.0.041"],
        "externalIPs": ["192.168.099.022"],
        "loadBalancerSourceRanges": ["203.0.113.000/025", " 203.0.113.128/25 ", "10.1.2.3/8"],
        "ports": [{"port": 80, "nodePort": 3001}],
    }));
    value["status"] = json!({"loadBalancer": {"ingress": [{"ip": "1.2.3.004"}]}});
    let port = only_port(value);
    assert_eq!(port.cluster_ips, ips(&["172.30.0.41"]));
    assert_eq!(port.external_ips, ips(&["192.168.99.22"]));
    assert_eq!(port.load_balancer_ips, ips(&["1.2.3.4"]));
    assert_eq!(
        port.load_balancer_source_ranges,
        vec![
            net("203.0.113.0/25"),
            net("203.0.113.128/25"),
            net("10.0.0.0/8")
        ]
    );
}

#[test]
fn node_ports() {
    let cases = [
        (json!(null), None),
        (json!(0), None),
        (json!(30080), Some(30080)),
    ];
    for (node_port, want) in cases {
        let port = only_port(svc_json(json!({
            "type": "NodePort",
            "clusterIP": "172.30.0.41",
            "ports": [{"port": 80, "nodePort": node_port}],
        })));
        assert_eq!(port.node_port, want, "{node_port}");
        assert_eq!(port.externally_accessible(), want.is_some());
    }
}

#[test]
fn traffic_policies_and_health_check_node_port() {
    struct Case {
        what: &'static str,
        spec: Value,
        etp_local: bool,
        itp_local: bool,
        hcnp: Option<u16>,
    }
    let cases = [
        Case {
            what: "LoadBalancer eTP Local",
            spec: json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 345}),
            etp_local: true,
            itp_local: false,
            hcnp: Some(345),
        },
        Case {
            what: "LoadBalancer eTP Local without healthCheckNodePort",
            spec: json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local"}),
            etp_local: true,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "LoadBalancer eTP Local with healthCheckNodePort 0",
            spec: json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "healthCheckNodePort": 0}),
            etp_local: true,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "LoadBalancer eTP Cluster",
            spec: json!({"type": "LoadBalancer", "externalTrafficPolicy": "Cluster", "healthCheckNodePort": 345}),
            etp_local: false,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "NodePort eTP Local",
            spec: json!({"type": "NodePort", "externalTrafficPolicy": "Local", "healthCheckNodePort": 345}),
            etp_local: true,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "legacy OnlyLocal is not Local",
            spec: json!({"type": "NodePort", "externalTrafficPolicy": "OnlyLocal"}),
            etp_local: false,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "ClusterIP eTP Local without externalIPs",
            spec: json!({"type": "ClusterIP", "externalTrafficPolicy": "Local"}),
            etp_local: false,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "ClusterIP eTP Local with externalIPs",
            spec: json!({"externalTrafficPolicy": "Local", "externalIPs": ["192.168.99.11"]}),
            etp_local: true,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "no type is ClusterIP: eTP Local without externalIPs",
            spec: json!({"externalTrafficPolicy": "Local"}),
            etp_local: false,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "an unknown type never takes eTP Local, even with externalIPs",
            spec: json!({"type": "Unknown", "externalTrafficPolicy": "Local", "externalIPs": ["192.168.99.11"]}),
            etp_local: false,
            itp_local: false,
            hcnp: None,
        },
        Case {
            what: "iTP Local",
            spec: json!({"type": "ClusterIP", "internalTrafficPolicy": "Local"}),
            etp_local: false,
            itp_local: true,
            hcnp: None,
        },
        Case {
            what: "iTP Cluster",
            spec: json!({"type": "ClusterIP", "internalTrafficPolicy": "Cluster"}),
            etp_local: false,
            itp_local: false,
            hcnp: None,
        },
    ];
    for case in cases {
        let port = only_port(svc_json(port_80_spec(case.spec)));
        assert_eq!(port.external_policy_local, case.etp_local, "{}", case.what);
        assert_eq!(port.internal_policy_local, case.itp_local, "{}", case.what);
        assert_eq!(port.health_check_node_port, case.hcnp, "{}", case.what);
    }
}

#[test]
fn session_affinity_timeout() {
    let cases = [
        (json!({"sessionAffinity": "ClientIP"}), Some(10800)),
        (
            json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {}}}),
            Some(10800),
        ),
        (
            json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 300}}}),
            Some(300),
        ),
        (
            json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 1}}}),
            Some(1),
        ),
        (
            json!({"sessionAffinity": "ClientIP", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86400}}}),
            Some(86400),
        ),
        (
            json!({"sessionAffinity": "None", "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 300}}}),
            None,
        ),
        (json!({}), None),
    ];
    for (mut spec, want) in cases {
        spec["clusterIP"] = json!("172.30.0.41");
        spec["ports"] = json!([{"port": 80}]);
        let port = only_port(svc_json(spec.clone()));
        assert_eq!(
            port.session_affinity,
            want.map(|secs| SessionAffinity {
                timeout: Duration::from_secs(secs)
            }),
            "{spec}"
        );
    }
}

#[test]
fn session_affinity_timeout_out_of_bounds() {
    for seconds in [0, -1, 86401, i32::MAX] {
        let problems = problems_of(svc_json(json!({
            "clusterIP": "172.30.0.41",
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": seconds}},
            "ports": [{"port": 80}],
        })));
        assert_eq!(
            problems,
            vec![format!(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds: {seconds} is out of range 1-86400"
            )]
        );
    }
}

#[test]
fn every_problem_is_reported_with_its_field() {
    let mut value = svc_json(json!({
        "type": "LoadBalancer",
        "clusterIP": "172.30.0.41",
        "clusterIPs": ["172.30.0.41", "fd00::x", "172.30.0.42"],
        "externalIPs": ["192.168.99.11", "1.2.3"],
        "loadBalancerSourceRanges": ["203.0.113.0/25", "203.0.113.0/33"],
        "externalTrafficPolicy": "Local",
        "healthCheckNodePort": 70000,
        "ports": [
            {"name": "a", "port": 80, "nodePort": 30080},
            {"name": "b", "port": 70000},
            {"name": "c", "port": 0, "nodePort": -5},
            {"name": "d", "port": 53, "protocol": "ICMP"},
            {"name": "a", "port": 81, "protocol": "TCP"},
            {"name": "a", "port": 82, "protocol": "UDP"},
        ],
    }));
    value["status"] =
        json!({"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}, {"ip": "lb.example.com"}]}});
    let error = service_ports(&object(value)).expect_err("invalid");
    assert_eq!(error.kind, "Service");
    assert_eq!(
        (error.namespace.as_str(), error.name.as_str()),
        ("ns", "web")
    );
    let want = [
        r#"spec.clusterIPs[1]: "fd00::x" is not an IP address"#,
        r#"spec.clusterIPs[2]: "172.30.0.42" is a second IPv4 address (also spec.clusterIPs[0])"#,
        r#"spec.externalIPs[1]: "1.2.3" is not an IP address"#,
        r#"status.loadBalancer.ingress[1].ip: "lb.example.com" is not an IP address"#,
        r#"spec.loadBalancerSourceRanges[1]: "203.0.113.0/33" is not a CIDR"#,
        "spec.healthCheckNodePort: 70000 is out of range 1-65535",
        "spec.ports[1].port: 70000 is out of range 1-65535",
        "spec.ports[2].port: 0 is out of range 1-65535",
        "spec.ports[2].nodePort: -5 is out of range 1-65535",
        r#"spec.ports[3].protocol: "ICMP" is not TCP, UDP or SCTP"#,
        r#"spec.ports[4]: duplicate port name "a" with protocol TCP (also spec.ports[0])"#,
    ];
    assert_eq!(error.problems, want);
    let message = error.to_string();
    assert!(
        message.starts_with("Service ns/web: spec.clusterIPs[1]: "),
        "{message}"
    );
    assert!(
        message.contains("; spec.ports[1].port: 70000 is out of range 1-65535;"),
        "{message}"
    );
}

#[test]
fn single_problems() {
    let cases = [
        (
            json!({"clusterIP": "172.30.0.300", "ports": [{"port": 80}]}),
            r#"spec.clusterIP: "172.30.0.300" is not an IP address"#,
        ),
        (
            json!({"clusterIP": "172.30.0.1", "externalIPs": ["10.0.0.1 "], "ports": [{"port": 80}]}),
            r#"spec.externalIPs[0]: "10.0.0.1 " is not an IP address"#,
        ),
        (
            json!({"clusterIP": "172.30.0.1", "loadBalancerSourceRanges": ["10.0.0.1"], "ports": [{"port": 80}]}),
            r#"spec.loadBalancerSourceRanges[0]: "10.0.0.1" is not a CIDR"#,
        ),
        (
            json!({"clusterIP": "172.30.0.1", "ports": [{"port": 80, "protocol": "tcp"}]}),
            r#"spec.ports[0].protocol: "tcp" is not TCP, UDP or SCTP"#,
        ),
        (
            // The port with an unknown protocol is left out, so it clashes with no other.
            json!({"clusterIP": "172.30.0.1", "ports": [{"port": 80, "protocol": "tcp"}, {"port": 81}]}),
            r#"spec.ports[0].protocol: "tcp" is not TCP, UDP or SCTP"#,
        ),
        (
            json!({"clusterIP": "172.30.0.1", "ports": [{"port": 80, "nodePort": 65536}]}),
            "spec.ports[0].nodePort: 65536 is out of range 1-65535",
        ),
        (
            json!({"clusterIP": "172.30.0.1", "ports": [{"port": 80}, {"port": 81}]}),
            r#"spec.ports[1]: duplicate port name "" with protocol TCP (also spec.ports[0])"#,
        ),
    ];
    for (spec, want) in cases {
        assert_eq!(
            problems_of(svc_json(spec.clone())),
            vec![want.to_owned()],
            "{spec}"
        );
    }
}

#[test]
fn missing_service_name_is_a_problem() {
    let problems = problems_of(json!({
        "metadata": {"namespace": "ns"},
        "spec": {"clusterIP": "172.30.0.1", "ports": [{"port": 80}]},
    }));
    assert_eq!(problems, vec!["metadata.name: must not be empty"]);
}

#[test]
fn hostile_names_are_carried_as_data() {
    let hostile = "p\"; drop\n# -j ACCEPT";
    let value = json!({
        "metadata": {"namespace": "ns\"x", "name": "web\nname"},
        "spec": {"clusterIP": "172.30.0.1", "ports": [{"name": hostile, "port": 80}]},
    });
    let port = only_port(value);
    assert_eq!(port.name.port, hostile);
    assert_eq!(port.name.service.namespace, "ns\"x");
    assert_eq!(port.name.service.name, "web\nname");

    // In messages the name is quoted and escaped, so a problem stays on one line.
    let problems = problems_of(json!({
        "metadata": {"namespace": "ns", "name": "web"},
        "spec": {"clusterIP": "172.30.0.1", "ports": [
            {"name": hostile, "port": 80},
            {"name": hostile, "port": 81},
        ]},
    }));
    assert_eq!(
        problems,
        vec![
            r#"spec.ports[1]: duplicate port name "p\"; drop\n# -j ACCEPT" with protocol TCP (also spec.ports[0])"#
        ]
    );
    assert!(!problems[0].contains('\n'));
}

// ---------------------------------------------------------------- EndpointSlice

/// An EndpointSlice of service `ns/web` with the given body fields, managed by the controller.
fn slice_json(name: &str, address_type: &str, ports: Value, endpoints: Value) -> Value {
    let mut value = fixtures::slice_json("ns", name, "web", address_type, ports, endpoints);
    value["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] =
        json!("endpointslice-controller.k8s.io");
    value
}

fn parsed_slice(value: Value) -> SliceEndpoints {
    slice_endpoints(&object(value))
        .expect("valid slice")
        .expect("slice not ignored")
}

fn slice_problems(value: Value) -> Vec<String> {
    slice_endpoints(&object(value))
        .expect_err("invalid slice")
        .problems
}

#[test]
fn slice_fields_are_carried() {
    let parsed = parsed_slice(slice_json(
        "web-abc",
        "IPv4",
        json!([{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}]),
        json!([{
            "addresses": ["10.180.0.1", "10.180.0.99"],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "nodeName": "test-node",
            "zone": "zone-a",
            "hints": {"forZones": [{"name": "zone-a"}, {"name": "zone-b"}], "forNodes": [{"name": "test-node"}]},
            "targetRef": {"kind": "Pod", "namespace": "ns", "name": "web-1"},
        }]),
    ));
    assert_eq!(
        parsed.service,
        ServiceName {
            namespace: "ns".into(),
            name: "web".into()
        }
    );
    assert_eq!(parsed.family, IpFamily::V4);
    assert_eq!(parsed.ports, vec![("http".into(), Protocol::Tcp, 8080)]);
    let set = |names: &[&str]| Some(Box::new(names.iter().map(|n| (*n).to_owned()).collect()));
    assert_eq!(
        parsed.endpoints,
        vec![Endpoint {
            ip: ip("10.180.0.1"),
            port: 0,
            ready: true,
            serving: true,
            terminating: false,
            node_name: Some("test-node".into()),
            zone: Some("zone-a".into()),
            zone_hints: set(&["zone-a", "zone-b"]),
            node_hints: set(&["test-node"]),
            is_local: false,
        }]
    );
}

#[test]
fn slice_condition_defaults() {
    // (conditions, ready, serving, terminating)
    let cases = [
        (json!(null), true, true, false),
        (json!({}), true, true, false),
        (json!({"ready": true}), true, true, false),
        (json!({"ready": false}), false, false, false),
        (json!({"ready": false, "serving": true}), false, true, false),
        (
            json!({"ready": false, "serving": true, "terminating": true}),
            false,
            true,
            true,
        ),
        (
            json!({"ready": false, "serving": false, "terminating": true}),
            false,
            false,
            true,
        ),
        (json!({"terminating": true}), true, true, true),
    ];
    for (conditions, ready, serving, terminating) in cases {
        let parsed = parsed_slice(slice_json(
            "web-abc",
            "IPv4",
            json!([{"port": 80}]),
            json!([{"addresses": ["10.180.0.1"], "conditions": conditions}]),
        ));
        let ep = &parsed.endpoints[0];
        assert_eq!(
            (ep.ready, ep.serving, ep.terminating),
            (ready, serving, terminating),
            "{conditions}"
        );
    }
}

#[test]
fn slice_port_defaults_and_portless_entries() {
    let parsed = parsed_slice(slice_json(
        "web-abc",
        "IPv6",
        json!([
            {"port": 80},
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "all"},
            {"name": "zero", "port": 0},
            {"name": "sctp", "port": 9, "protocol": "SCTP"},
        ]),
        json!([{"addresses": ["fd00:10:180::1"]}]),
    ));
    assert_eq!(parsed.family, IpFamily::V6);
    assert_eq!(
        parsed.ports,
        vec![
            (Name::default(), Protocol::Tcp, 80),
            ("dns".into(), Protocol::Udp, 53),
            ("sctp".into(), Protocol::Sctp, 9),
        ]
    );
    assert_eq!(parsed.endpoints[0].ip, ip("fd00:10:180::1"));
}

#[test]
fn empty_hint_lists_are_no_hints() {
    let parsed = parsed_slice(slice_json(
        "web-abc",
        "IPv4",
        json!([{"port": 80}]),
        json!([
            {"addresses": ["10.180.0.1"], "hints": {"forZones": [], "forNodes": []}},
            {"addresses": ["10.180.0.2"], "hints": {}},
            {"addresses": ["10.180.0.3"]},
        ]),
    ));
    for ep in &parsed.endpoints {
        assert_eq!(
            (&ep.zone_hints, &ep.node_hints),
            (&None, &None),
            "{}",
            ep.ip
        );
    }
}

#[test]
fn ignored_slices() {
    let ports = json!([{"port": 80}]);
    let eps = json!([{"addresses": ["10.180.0.1"]}]);
    let mut no_label = slice_json("a", "IPv4", ports.clone(), eps.clone());
    no_label["metadata"]["labels"] = json!({"app": "web"});
    let mut no_labels = slice_json("a", "IPv4", ports.clone(), eps.clone());
    no_labels["metadata"]
        .as_object_mut()
        .expect("object")
        .remove("labels");
    let mut empty_label = slice_json("a", "IPv4", ports.clone(), eps.clone());
    empty_label["metadata"]["labels"]["kubernetes.io/service-name"] = json!("");
    let fqdn = slice_json(
        "a",
        "FQDN",
        ports,
        json!([{"addresses": ["web.example.com"]}]),
    );
    for (what, value) in [
        ("other labels", no_label),
        ("no labels", no_labels),
        ("empty label", empty_label),
        ("FQDN", fqdn),
    ] {
        assert_eq!(slice_endpoints(&object(value)), Ok(None), "{what}");
    }
}

#[test]
fn slice_problems_are_all_reported() {
    let error = slice_endpoints(&object(slice_json(
        "web-abc",
        "IPv4",
        json!([
            {"name": "a", "port": 70000},
            {"name": "b", "port": 80, "protocol": "ICMP"},
            {"name": "c", "port": 81},
            {"name": "c", "port": 82},
            {"name": "d", "port": -1},
        ]),
        json!([
            {"addresses": ["10.180.0.1"]},
            {"addresses": ["fd00::1"]},
            {"addresses": ["10.180.0"]},
            {"addresses": []},
            {"addresses": ["10.180.0.5", "not-an-ip"]},
        ]),
    )))
    .expect_err("invalid");
    assert_eq!(error.kind, "EndpointSlice");
    assert_eq!(
        (error.namespace.as_str(), error.name.as_str()),
        ("ns", "web-abc")
    );
    assert_eq!(
        error.problems,
        vec![
            "ports[0].port: 70000 is out of range 1-65535",
            r#"ports[1].protocol: "ICMP" is not TCP, UDP or SCTP"#,
            r#"ports[3]: duplicate port name "c" with protocol TCP (also ports[2])"#,
            "ports[4].port: -1 is out of range 1-65535",
            r#"endpoints[1].addresses[0]: "fd00::1" is not an IPv4 address (addressType IPv4)"#,
            r#"endpoints[2].addresses[0]: "10.180.0" is not an IP address"#,
            "endpoints[3].addresses: must not be empty",
        ]
    );
}

#[test]
fn slice_port_with_an_unknown_protocol_clashes_with_no_other() {
    assert_eq!(
        slice_problems(slice_json(
            "s",
            "IPv4",
            json!([{"name": "p", "port": 80, "protocol": "tcp"}, {"name": "p", "port": 81}]),
            json!([{"addresses": ["10.180.0.1"]}]),
        )),
        vec![r#"ports[0].protocol: "tcp" is not TCP, UDP or SCTP"#]
    );
}

#[test]
fn slice_wrong_family_and_unknown_address_type() {
    assert_eq!(
        slice_problems(slice_json(
            "s",
            "IPv6",
            json!([{"port": 80}]),
            json!([{"addresses": ["10.180.0.1"]}]),
        )),
        vec![
            r#"endpoints[0].addresses[0]: "10.180.0.1" is not an IPv6 address (addressType IPv6)"#
        ]
    );
    assert_eq!(
        slice_problems(slice_json(
            "s",
            "IPX",
            json!([{"port": 80}]),
            json!([{"addresses": ["10.180.0.1"]}]),
        )),
        vec![r#"addressType: "IPX" is not IPv4, IPv6 or FQDN"#]
    );
}

#[test]
fn slice_addresses_with_leading_zeros_are_canonical() {
    let parsed = parsed_slice(slice_json(
        "s",
        "IPv4",
        json!([{"port": 80}]),
        json!([{"addresses": ["10.180.000.001"]}]),
    ));
    assert_eq!(parsed.endpoints[0].ip, ip("10.180.0.1"));
}

// ---------------------------------------------------------------- merging

/// A slice endpoint as JSON: address, ready, node name.
fn ep_json(address: &str, ready: bool, node: Option<&str>) -> Value {
    endpoint(address).ready(ready).node(node).json()
}

fn key(port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName {
        service: ServiceName {
            namespace: "ns".into(),
            name: "web".into(),
        },
        port: port.into(),
        protocol,
    }
}

/// (ip:port, ready, is_local) per service port, for compact comparisons.
fn summary(
    merged: &BTreeMap<ServicePortName, Vec<Endpoint>>,
) -> BTreeMap<String, Vec<(String, bool, bool)>> {
    merged
        .iter()
        .map(|(name, eps)| {
            let list = eps
                .iter()
                .map(|e| {
                    let addr = match e.ip {
                        IpAddr::V4(v4) => format!("{v4}:{}", e.port),
                        IpAddr::V6(v6) => format!("[{v6}]:{}", e.port),
                    };
                    (addr, e.ready, e.is_local)
                })
                .collect();
            (format!("{name}/{}", name.protocol.as_str()), list)
        })
        .collect()
}

#[test]
fn merge_named_ports_across_slices() {
    let a = parsed_slice(slice_json(
        "web-a",
        "IPv4",
        json!([{"name": "http", "port": 8080}, {"name": "metrics", "port": 9090}]),
        json!([
            ep_json("10.180.0.9", true, Some("test-node")),
            ep_json("10.180.0.10", true, Some("other-node")),
        ]),
    ));
    // A second slice where the named port has another number (a rolling renumber).
    let b = parsed_slice(slice_json(
        "web-b",
        "IPv4",
        json!([{"name": "http", "port": 8081}, {"name": "http", "port": 53, "protocol": "UDP"}]),
        json!([ep_json("10.180.0.2", false, None)]),
    ));
    let merged = merge_slices([&a, &b], "test-node");
    let s = |addr: &str, ready: bool, local: bool| (addr.to_owned(), ready, local);
    let want: BTreeMap<String, Vec<(String, bool, bool)>> = [
        (
            "ns/web:http/tcp".to_owned(),
            vec![
                s("10.180.0.2:8081", false, false),
                s("10.180.0.9:8080", true, true),
                s("10.180.0.10:8080", true, false),
            ],
        ),
        (
            "ns/web:http/udp".to_owned(),
            vec![s("10.180.0.2:53", false, false)],
        ),
        (
            "ns/web:metrics/tcp".to_owned(),
            vec![
                s("10.180.0.9:9090", true, true),
                s("10.180.0.10:9090", true, false),
            ],
        ),
    ]
    .into_iter()
    .collect();
    assert_eq!(summary(&merged), want);
    assert!(merged.contains_key(&key("http", Protocol::Udp)));
    // Merged endpoints carry their port; everything else comes from the slice.
    let http = &merged[&key("http", Protocol::Tcp)];
    assert_eq!(http[1].node_name.as_deref(), Some("test-node"));
}

#[test]
fn merge_duplicates_prefer_the_first_slice() {
    let ready = parsed_slice(slice_json(
        "web-a",
        "IPv4",
        json!([{"port": 80}]),
        json!([ep_json("10.180.0.1", true, Some("test-node"))]),
    ));
    let stale = parsed_slice(slice_json(
        "web-b",
        "IPv4",
        json!([{"port": 80}]),
        json!([
            ep_json("10.180.0.1", false, Some("other-node")),
            ep_json("10.180.0.1", true, None),
            ep_json("10.180.0.3", true, None),
        ]),
    ));
    let s = |addr: &str, ready: bool, local: bool| (addr.to_owned(), ready, local);

    let first = summary(&merge_slices([&ready, &stale], "test-node"));
    assert_eq!(
        first["ns/web/tcp"],
        vec![
            s("10.180.0.1:80", true, true),
            s("10.180.0.3:80", true, false)
        ]
    );
    let reversed = summary(&merge_slices([&stale, &ready], "test-node"));
    assert_eq!(
        reversed["ns/web/tcp"],
        vec![
            s("10.180.0.1:80", false, false),
            s("10.180.0.3:80", true, false)
        ]
    );
}

#[test]
fn merge_sorts_by_address_then_port_and_skips_empty_ports() {
    let v4 = parsed_slice(slice_json(
        "web-v4",
        "IPv4",
        json!([{"port": 80}]),
        json!([
            ep_json("10.180.0.10", true, None),
            ep_json("10.180.0.9", true, None),
            ep_json("9.1.1.1", true, None),
        ]),
    ));
    let v6 = parsed_slice(slice_json(
        "web-v6",
        "IPv6",
        json!([{"port": 80}, {"name": "unused", "port": 81}]),
        json!([]),
    ));
    let portless = parsed_slice(slice_json(
        "web-none",
        "IPv4",
        json!([]),
        json!([ep_json("10.180.0.1", true, None)]),
    ));
    let merged = merge_slices([&v6, &portless, &v4], "test-node");
    let got: Vec<(String, Vec<String>)> = summary(&merged)
        .into_iter()
        .map(|(k, eps)| (k, eps.into_iter().map(|e| e.0).collect()))
        .collect();
    assert_eq!(
        got,
        vec![(
            "ns/web/tcp".to_owned(),
            vec![
                "9.1.1.1:80".to_owned(),
                "10.180.0.9:80".to_owned(),
                "10.180.0.10:80".to_owned()
            ]
        )]
    );
}

#[test]
fn merge_without_a_node_name_marks_nothing_local() {
    let s = parsed_slice(slice_json(
        "web-a",
        "IPv4",
        json!([{"port": 80}]),
        json!([{"addresses": ["10.180.0.1"], "nodeName": ""}]),
    ));
    let merged = merge_slices([&s], "");
    assert!(!merged[&key("", Protocol::Tcp)][0].is_local);
    let merged = merge_slices([&s], "test-node");
    assert!(!merged[&key("", Protocol::Tcp)][0].is_local);
}

// ---------------------------------------------------------------- Node

#[test]
fn node_info_from_a_node() {
    let info = node_info(&object(json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": "test-node",
            "labels": {"topology.kubernetes.io/zone": "zone-a", "kubernetes.io/os": "linux"},
        },
        "spec": {
            "podCIDR": "10.0.0.0/24",
            "podCIDRs": ["10.0.0.0/24", "fd00:10::/64"],
            "taints": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}],
        },
        "status": {"addresses": [
            {"type": "Hostname", "address": "test-node"},
            {"type": "ExternalIP", "address": "203.0.113.7"},
            {"type": "InternalIP", "address": "192.168.0.2"},
            {"type": "InternalIP", "address": "not-an-ip"},
            {"type": "InternalIP", "address": "2001:db8::1"},
            {"type": "ExternalIP", "address": "192.168.0.2"},
        ]},
    })));
    assert_eq!(info.name, "test-node");
    assert_eq!(info.zone(), Some("zone-a"));
    assert_eq!(info.labels.len(), 2);
    assert_eq!(
        info.addresses,
        ips(&["192.168.0.2", "2001:db8::1", "203.0.113.7"])
    );
    assert_eq!(
        info.pod_cidrs,
        vec![net("10.0.0.0/24"), net("fd00:10::/64")]
    );
    assert!(info.eligible);
    assert!(info.known);
}

#[test]
fn node_pod_cidr_fallback() {
    let info = node_info(&object(json!({
        "metadata": {"name": "n"},
        "spec": {"podCIDR": "10.0.001.0/24"},
    })));
    assert_eq!(info.pod_cidrs, vec![net("10.0.1.0/24")]);
    let bare = node_info(&object(json!({"metadata": {"name": "n"}})));
    assert!(bare.pod_cidrs.is_empty());
    assert!(bare.addresses.is_empty());
    assert_eq!(bare.zone(), None);
    assert!(bare.eligible && bare.known);
}

#[test]
fn node_eligibility() {
    let cases = [
        ("plain", json!({"name": "n"}), json!({}), true),
        (
            "being deleted",
            json!({"name": "n", "deletionTimestamp": "2025-01-02T03:04:05Z"}),
            json!({}),
            false,
        ),
        (
            "autoscaler taint",
            json!({"name": "n"}),
            json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "value": "1736000000", "effect": "NoSchedule"}]}),
            false,
        ),
        (
            "other taints",
            json!({"name": "n"}),
            json!({"taints": [
                {"key": "DeletionCandidateOfClusterAutoscaler", "effect": "PreferNoSchedule"},
                {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
            ], "unschedulable": true}),
            true,
        ),
    ];
    for (what, metadata, spec, eligible) in cases {
        let info = node_info(&object(json!({"metadata": metadata, "spec": spec})));
        assert_eq!(info.eligible, eligible, "{what}");
        assert!(info.known, "{what}");
    }
}

/// The sizes the control plane's memory at 10k services rests on (~220k endpoints held by the
/// tracker and the state, ~12k service ports): a field that grows one of these shows here.
#[test]
fn model_types_stay_small() {
    assert_eq!(std::mem::size_of::<ServiceName>(), 16);
    assert_eq!(std::mem::size_of::<ServicePortName>(), 32);
    assert_eq!(std::mem::size_of::<Endpoint>(), 56);
}
