//! Tests for endpoint selection, following upstream's topology and terminating-endpoint
//! scenarios.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde_json::{Value, json};

use super::*;
use crate::fixtures::{EndpointSpec, NODE, endpoint, node, port_80_spec, service, slice};
use crate::model::{
    Endpoint, IpFamily, NodeInfo, ServicePort, ServicePortName, merge_slices, node_info,
    service_ports, slice_endpoints,
};

fn this_node(zone: Option<&str>) -> NodeInfo {
    let mut labels = serde_json::Map::new();
    if let Some(zone) = zone {
        labels.insert("topology.kubernetes.io/zone".into(), json!(zone));
    }
    node_info(&node(NODE, Value::Object(labels), Value::Null))
}

/// One service port built from a Service spec (ClusterIP 172.30.0.41, port 80).
fn service_port(spec: Value) -> ServicePort {
    let service = service("ns", "web", port_80_spec(spec));
    let mut ports = service_ports(&service)
        .expect("valid")
        .expect("not ignored");
    ports.remove(0)
}

fn cluster_policy() -> ServicePort {
    service_port(json!({}))
}

/// Endpoints of `ns/web` per service port, from one IPv4 EndpointSlice with the given ports.
fn merged(ports: Value, list: &[EndpointSpec]) -> BTreeMap<ServicePortName, Vec<Endpoint>> {
    let slice = slice("ns", "web-1", "web", "IPv4", ports, list);
    let parsed = slice_endpoints(&slice)
        .expect("valid slice")
        .expect("not ignored");
    merge_slices([&parsed], NODE)
}

/// Endpoints of `ns/web` port 80 built from one EndpointSlice's endpoints.
fn endpoints(list: &[EndpointSpec]) -> Vec<Endpoint> {
    merged(json!([{"port": 80}]), list)
        .into_values()
        .next()
        .unwrap_or_default()
}

/// One slice endpoint: address, (ready, serving, terminating), node name.
fn ep(address: &str, conditions: (bool, bool, bool), node: Option<&str>) -> EndpointSpec {
    endpoint(address).conditions(conditions).node(node)
}

const READY: (bool, bool, bool) = (true, true, false);
const TERMINATING: (bool, bool, bool) = (false, true, true);
const NOT_SERVING_TERMINATING: (bool, bool, bool) = (false, false, true);
const NOT_READY: (bool, bool, bool) = (false, false, false);

fn addrs(list: &[&Endpoint]) -> Vec<String> {
    list.iter().map(|e| e.ip.to_string()).collect()
}

fn strs(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// Check categorize against expectations, and that explain agrees with it.
#[track_caller]
#[allow(clippy::too_many_arguments)]
fn check(
    what: &str,
    svc: &ServicePort,
    eps: &[Endpoint],
    node: &NodeInfo,
    cluster: &[&str],
    local: &[&str],
    all: &[&str],
    has_any: bool,
) {
    let got = categorize(svc, eps, node);
    assert_eq!(addrs(&got.cluster), strs(cluster), "{what}: cluster");
    assert_eq!(addrs(&got.local), strs(local), "{what}: local");
    assert_eq!(
        addrs(&got.all_reachable),
        strs(all),
        "{what}: all_reachable"
    );
    assert_eq!(got.has_any_endpoints, has_any, "{what}: has_any_endpoints");

    let explanation = explain(svc, eps, node);
    let chosen = |pick: fn(&EndpointVerdict) -> Option<Verdict>| -> Vec<String> {
        explanation
            .endpoints
            .iter()
            .filter(|(_, v)| pick(v).is_some_and(Verdict::chosen))
            .map(|(e, _)| e.ip.to_string())
            .collect()
    };
    assert_eq!(
        chosen(|v| v.cluster),
        strs(cluster),
        "{what}: explain cluster"
    );
    assert_eq!(chosen(|v| v.local), strs(local), "{what}: explain local");
}

#[test]
fn traffic_policies_choose_lists() {
    let node = this_node(None);
    let eps = endpoints(&[
        ep("10.180.0.1", READY, Some(NODE)),
        ep("10.180.0.2", READY, Some("other-node")),
        ep("10.180.0.3", READY, None),
    ]);
    let cases = [
        (
            "iTP Cluster, eTP Cluster",
            json!({"type": "LoadBalancer"}),
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
            vec![],
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
        ),
        (
            "iTP Local, ClusterIP only",
            json!({"internalTrafficPolicy": "Local"}),
            vec![],
            vec!["10.180.0.1"],
            vec!["10.180.0.1"],
        ),
        (
            "eTP Local with a NodePort uses both",
            json!({"type": "NodePort", "externalTrafficPolicy": "Local"}),
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
            vec!["10.180.0.1"],
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
        ),
        (
            "eTP Local without external access uses only Cluster",
            json!({"externalTrafficPolicy": "Local"}),
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
            vec![],
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
        ),
        (
            "iTP Local and externally accessible uses both",
            json!({"type": "NodePort", "internalTrafficPolicy": "Local"}),
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
            vec!["10.180.0.1"],
            vec!["10.180.0.1", "10.180.0.2", "10.180.0.3"],
        ),
    ];
    for (what, spec, cluster, local, all) in cases {
        let svc = service_port(spec);
        check(what, &svc, &eps, &node, &cluster, &local, &all, true);
    }
}

#[test]
fn eligible_lists_are_none_for_unused_policies() {
    let node = this_node(None);
    let eps = endpoints(&[ep("10.180.0.1", READY, Some(NODE))]);
    let explanation = explain(&cluster_policy(), &eps, &node);
    assert_eq!(explanation.endpoints[0].1.local, None);
    assert_eq!(explanation.endpoints[0].1.cluster, Some(Verdict::Ready));
    let itp_local = service_port(json!({"internalTrafficPolicy": "Local"}));
    let explanation = explain(&itp_local, &eps, &node);
    assert_eq!(explanation.endpoints[0].1.cluster, None);
    assert_eq!(explanation.endpoints[0].1.local, Some(Verdict::Ready));
}

#[test]
fn cluster_falls_back_to_terminating_endpoints_anywhere() {
    let node = this_node(None);
    let eps = endpoints(&[
        ep("10.180.0.1", TERMINATING, Some("other-node")),
        ep("10.180.0.2", NOT_SERVING_TERMINATING, Some("other-node")),
        ep("10.180.0.3", NOT_READY, None),
        ep("10.180.0.4", TERMINATING, None),
    ]);
    check(
        "all terminating",
        &cluster_policy(),
        &eps,
        &node,
        &["10.180.0.1", "10.180.0.4"],
        &[],
        &["10.180.0.1", "10.180.0.4"],
        true,
    );
    let verdicts: Vec<Option<Verdict>> = explain(&cluster_policy(), &eps, &node)
        .endpoints
        .iter()
        .map(|(_, v)| v.cluster)
        .collect();
    assert_eq!(
        verdicts,
        vec![
            Some(Verdict::TerminatingFallback),
            Some(Verdict::Unusable),
            Some(Verdict::Unusable),
            Some(Verdict::TerminatingFallback),
        ]
    );
}

#[test]
fn ready_endpoints_are_preferred_over_terminating_ones() {
    let node = this_node(None);
    let eps = endpoints(&[
        ep("10.180.0.1", TERMINATING, None),
        ep("10.180.0.2", READY, None),
    ]);
    check(
        "one ready",
        &cluster_policy(),
        &eps,
        &node,
        &["10.180.0.2"],
        &[],
        &["10.180.0.2"],
        true,
    );
    let explanation = explain(&cluster_policy(), &eps, &node);
    assert_eq!(explanation.endpoints[0].1.cluster, Some(Verdict::NotReady));
}

#[test]
fn local_falls_back_to_local_terminating_endpoints() {
    let node = this_node(None);
    let etp_local = service_port(json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local"}));
    let itp_local = service_port(json!({"internalTrafficPolicy": "Local"}));

    let eps = endpoints(&[
        ep("10.180.0.1", TERMINATING, Some(NODE)),
        ep("10.180.0.2", READY, Some("other-node")),
        ep("10.180.0.3", NOT_SERVING_TERMINATING, Some(NODE)),
        ep("10.180.0.4", TERMINATING, Some("other-node")),
    ]);
    // Cluster has the remote ready endpoint, Local the local terminating one: the union.
    check(
        "eTP Local, local terminating",
        &etp_local,
        &eps,
        &node,
        &["10.180.0.2"],
        &["10.180.0.1"],
        &["10.180.0.1", "10.180.0.2"],
        true,
    );
    check(
        "iTP Local, local terminating",
        &itp_local,
        &eps,
        &node,
        &[],
        &["10.180.0.1"],
        &["10.180.0.1"],
        true,
    );

    // A local ready endpoint wins over local terminating ones.
    let eps = endpoints(&[
        ep("10.180.0.1", TERMINATING, Some(NODE)),
        ep("10.180.0.5", READY, Some(NODE)),
    ]);
    check(
        "iTP Local, local ready and terminating",
        &itp_local,
        &eps,
        &node,
        &[],
        &["10.180.0.5"],
        &["10.180.0.5"],
        true,
    );
}

#[test]
fn local_policy_without_local_endpoints_still_has_endpoints() {
    let node = this_node(None);
    let itp_local = service_port(json!({"internalTrafficPolicy": "Local"}));
    let eps = endpoints(&[ep("10.180.0.2", READY, Some("other-node"))]);
    // Upstream DROPs here (has endpoints, none usable locally) rather than REJECTing.
    check("remote only", &itp_local, &eps, &node, &[], &[], &[], true);
    let explanation = explain(&itp_local, &eps, &node);
    assert_eq!(explanation.endpoints[0].1.local, Some(Verdict::NotLocal));
}

#[test]
fn has_any_endpoints() {
    let node = this_node(None);
    let etp_local = service_port(json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local"}));
    let itp_local = service_port(json!({"internalTrafficPolicy": "Local"}));
    let cases = [
        ("no endpoints", vec![], false),
        (
            "only unusable",
            vec![
                ep("10.180.0.1", NOT_READY, Some(NODE)),
                ep("10.180.0.2", NOT_SERVING_TERMINATING, None),
            ],
            false,
        ),
        (
            "remote terminating",
            vec![ep("10.180.0.1", TERMINATING, None)],
            true,
        ),
        ("remote ready", vec![ep("10.180.0.1", READY, None)], true),
    ];
    for (what, list, want) in cases {
        let eps = endpoints(&list);
        for svc in [&cluster_policy(), &etp_local, &itp_local] {
            let got = categorize(svc, &eps, &node);
            assert_eq!(got.has_any_endpoints, want, "{what}");
        }
    }
}

#[test]
fn zone_hints() {
    let svc = cluster_policy();
    let zoned = this_node(Some("zone-a"));
    let ready = |addr: &str, zones: &[&str]| ep(addr, READY, None).hints(zones, &[]);
    struct Case {
        what: &'static str,
        endpoints: Vec<EndpointSpec>,
        node: NodeInfo,
        mode: TopologyMode,
        cluster: Vec<&'static str>,
    }
    let cases = [
        Case {
            what: "all hinted, some for this zone",
            endpoints: vec![
                ready("10.180.0.1", &["zone-a"]),
                ready("10.180.0.2", &["zone-b"]),
                ready("10.180.0.3", &["zone-c", "zone-a"]),
            ],
            node: zoned.clone(),
            mode: TopologyMode::PreferSameZone,
            cluster: vec!["10.180.0.1", "10.180.0.3"],
        },
        Case {
            what: "one ready endpoint without a hint",
            endpoints: vec![
                ready("10.180.0.1", &["zone-a"]),
                ep("10.180.0.2", READY, None),
            ],
            node: zoned.clone(),
            mode: TopologyMode::None,
            cluster: vec!["10.180.0.1", "10.180.0.2"],
        },
        Case {
            what: "no hint for this zone",
            endpoints: vec![
                ready("10.180.0.1", &["zone-b"]),
                ready("10.180.0.2", &["zone-c"]),
            ],
            node: zoned.clone(),
            mode: TopologyMode::None,
            cluster: vec!["10.180.0.1", "10.180.0.2"],
        },
        Case {
            what: "node has no zone label",
            endpoints: vec![
                ready("10.180.0.1", &["zone-a"]),
                ready("10.180.0.2", &["zone-b"]),
            ],
            node: this_node(None),
            mode: TopologyMode::None,
            cluster: vec!["10.180.0.1", "10.180.0.2"],
        },
        Case {
            what: "unhinted endpoints that are not ready do not count",
            endpoints: vec![
                ready("10.180.0.1", &["zone-a"]),
                ready("10.180.0.2", &["zone-b"]),
                ep("10.180.0.3", TERMINATING, None),
            ],
            node: zoned.clone(),
            mode: TopologyMode::PreferSameZone,
            cluster: vec!["10.180.0.1"],
        },
    ];
    for case in cases {
        let eps = endpoints(&case.endpoints);
        assert_eq!(topology_mode(&eps, &case.node), case.mode, "{}", case.what);
        let got = categorize(&svc, &eps, &case.node);
        assert_eq!(addrs(&got.cluster), strs(&case.cluster), "{}", case.what);
        assert_eq!(
            explain(&svc, &eps, &case.node).topology_mode,
            case.mode,
            "{}",
            case.what
        );
    }

    let eps = endpoints(&[
        ready("10.180.0.1", &["zone-a"]),
        ready("10.180.0.2", &["zone-b"]),
    ]);
    let verdicts: Vec<Option<Verdict>> = explain(&svc, &eps, &zoned)
        .endpoints
        .iter()
        .map(|(_, v)| v.cluster)
        .collect();
    assert_eq!(
        verdicts,
        vec![Some(Verdict::Ready), Some(Verdict::FilteredByTopology)]
    );
}

#[test]
fn node_hints() {
    let svc = cluster_policy();
    let node = this_node(Some("zone-a"));
    let hinted = |addr: &str, nodes: &[&str]| ep(addr, READY, None).hints(&["zone-a"], nodes);
    let cases = [
        (
            "all hinted, one for this node (beats zone hints)",
            vec![
                hinted("10.180.0.1", &[NODE]),
                hinted("10.180.0.2", &["other-node"]),
            ],
            TopologyMode::PreferSameNode,
            vec!["10.180.0.1"],
        ),
        (
            "one without a node hint falls back to zone hints",
            vec![hinted("10.180.0.1", &[NODE]), hinted("10.180.0.2", &[])],
            TopologyMode::PreferSameZone,
            vec!["10.180.0.1", "10.180.0.2"],
        ),
        (
            "no hint for this node falls back to zone hints",
            vec![
                hinted("10.180.0.1", &["node-b"]),
                hinted("10.180.0.2", &["node-c"]),
            ],
            TopologyMode::PreferSameZone,
            vec!["10.180.0.1", "10.180.0.2"],
        ),
    ];
    for (what, list, mode, cluster) in cases {
        let eps = endpoints(&list);
        assert_eq!(topology_mode(&eps, &node), mode, "{what}");
        let got = categorize(&svc, &eps, &node);
        assert_eq!(addrs(&got.cluster), strs(&cluster), "{what}");
    }
}

#[test]
fn topology_filtering_with_local_policy_takes_the_union() {
    // eTP Local with zone hints: Cluster is zone-filtered, Local keeps the local endpoint even
    // though it is hinted for another zone.
    let node = this_node(Some("zone-a"));
    let svc = service_port(json!({"type": "NodePort", "externalTrafficPolicy": "Local"}));
    let eps = endpoints(&[
        ep("10.180.0.1", READY, Some("other-node")).hints(&["zone-a"], &[]),
        ep("10.180.0.2", READY, Some(NODE)).hints(&["zone-b"], &[]),
    ]);
    check(
        "zone-filtered cluster plus local",
        &svc,
        &eps,
        &node,
        &["10.180.0.1"],
        &["10.180.0.2"],
        &["10.180.0.1", "10.180.0.2"],
        true,
    );
}

#[test]
fn local_policy_ignores_topology_for_local_only_services() {
    let node = this_node(Some("zone-a"));
    let svc = service_port(json!({"internalTrafficPolicy": "Local"}));
    let eps = endpoints(&[
        ep("10.180.0.1", READY, Some("other-node")).hints(&["zone-a"], &[]),
        ep("10.180.0.2", READY, Some(NODE)).hints(&["zone-b"], &[]),
    ]);
    assert_eq!(explain(&svc, &eps, &node).topology_mode, TopologyMode::None);
    check(
        "iTP Local with hints",
        &svc,
        &eps,
        &node,
        &[],
        &["10.180.0.2"],
        &["10.180.0.2"],
        true,
    );
}

#[test]
fn union_is_sorted_and_deduplicated() {
    let node = this_node(None);
    let svc = service_port(json!({"type": "NodePort", "externalTrafficPolicy": "Local"}));
    // Hand-built, unsorted input: the union must still come out sorted and without repeats.
    let mk = |addr: &str, ready: bool, terminating: bool, local: bool| Endpoint {
        ip: addr.parse().expect("ip"),
        port: 80,
        ready,
        serving: ready || terminating,
        terminating,
        node_name: local.then(|| NODE.into()),
        zone: None,
        zone_hints: None,
        node_hints: None,
        is_local: local,
    };
    let eps = vec![
        mk("10.180.0.9", true, false, false),
        mk("10.180.0.3", false, true, true),
        mk("10.180.0.1", true, false, false),
    ];
    let got = categorize(&svc, &eps, &node);
    assert_eq!(addrs(&got.cluster), strs(&["10.180.0.9", "10.180.0.1"]));
    assert_eq!(addrs(&got.local), strs(&["10.180.0.3"]));
    assert_eq!(
        addrs(&got.all_reachable),
        strs(&["10.180.0.1", "10.180.0.3", "10.180.0.9"])
    );

    // Ready local endpoints are in both lists but appear once.
    let eps = vec![
        mk("10.180.0.2", true, false, true),
        mk("10.180.0.1", true, false, false),
    ];
    let got = categorize(&svc, &eps, &node);
    assert_eq!(addrs(&got.local), strs(&["10.180.0.2"]));
    assert_eq!(
        addrs(&got.all_reachable),
        strs(&["10.180.0.1", "10.180.0.2"])
    );
}

#[test]
fn local_ready_count_counts_distinct_ips() {
    // TestHealthCheckNodePortWhenTerminating: ready local endpoints count, terminating ones
    // do not, and a pod with two ports counts once.
    let slice = |list: &[EndpointSpec]| -> Vec<Endpoint> {
        // Both ports' endpoints, as a health check over the whole service would see them.
        merged(
            json!([{"name": "a", "port": 80}, {"name": "b", "port": 81}]),
            list,
        )
        .into_values()
        .flatten()
        .collect()
    };
    let cases = [
        (
            "three ready local, one not ready",
            vec![
                ep("10.0.1.1", READY, Some(NODE)),
                ep("10.0.1.2", READY, Some(NODE)),
                ep("10.0.1.3", READY, Some(NODE)),
                ep("10.0.1.4", NOT_READY, Some(NODE)),
            ],
            3,
        ),
        (
            "all terminating",
            vec![
                ep("10.0.1.1", TERMINATING, Some(NODE)),
                ep("10.0.1.2", TERMINATING, Some(NODE)),
                ep("10.0.1.3", NOT_SERVING_TERMINATING, Some(NODE)),
            ],
            0,
        ),
        (
            "remote ready",
            vec![
                ep("10.0.1.1", READY, Some("other-node")),
                ep("10.0.1.2", READY, None),
            ],
            0,
        ),
    ];
    for (what, list, want) in cases {
        let eps = slice(&list);
        assert!(eps.len() >= 4, "{what}: both ports merged");
        assert_eq!(local_ready_endpoint_count(&eps), want, "{what}");
    }
}

#[test]
fn ipv6_family_and_empty_hint_sets() {
    // A dual-stack service is categorized per family with that family's endpoints; an empty
    // hint set counts as no hint, so it disables node-hint filtering.
    let node = this_node(None);
    let svc = service_port(json!({"clusterIPs": ["172.30.0.41", "fd00:172:30::41"]}));
    let v6 = svc.for_family(IpFamily::V6).expect("IPv6");
    let mk = |addr: &str, hints: &[&str]| Endpoint {
        ip: addr.parse::<IpAddr>().expect("ip"),
        port: 80,
        ready: true,
        serving: true,
        terminating: false,
        node_name: None,
        zone: None,
        zone_hints: None,
        node_hints: Some(Box::new(
            hints
                .iter()
                .map(|h| (*h).to_owned())
                .collect::<BTreeSet<_>>(),
        )),
        is_local: false,
    };
    let eps = vec![mk("fd00:10:180::1", &[NODE]), mk("fd00:10:180::2", &[])];
    assert_eq!(topology_mode(&eps, &node), TopologyMode::None);
    let got = categorize(&v6, &eps, &node);
    assert_eq!(
        addrs(&got.cluster),
        strs(&["fd00:10:180::1", "fd00:10:180::2"])
    );

    let eps = vec![
        mk("fd00:10:180::1", &[NODE]),
        mk("fd00:10:180::2", &["other-node"]),
    ];
    assert_eq!(topology_mode(&eps, &node), TopologyMode::PreferSameNode);
    let got = categorize(&v6, &eps, &node);
    assert_eq!(addrs(&got.cluster), strs(&["fd00:10:180::1"]));
}
