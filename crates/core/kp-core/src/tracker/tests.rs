//! Tests for the change tracker, with objects written as the API serves them.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde_json::{Value, json};

use super::*;
use crate::fixtures::{self, NODE, applied, deleted, endpoint, name, names, node};

/// A ClusterIP Service `ns/<service>` with `(port name, protocol, port)` ports.
fn service(service: &str, ip: &str, ports: &[(&str, &str, u16)]) -> Service {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(port_name, protocol, port)| {
            json!({"name": port_name, "protocol": protocol, "port": port})
        })
        .collect();
    let spec = json!({"clusterIP": ip, "clusterIPs": [ip], "ports": ports});
    fixtures::service("ns", service, spec)
}

/// An IPv4 EndpointSlice `ns/<slice>` of `ns/<service>` with one named port and ready
/// `(ip, node)` endpoints.
fn slice(
    slice: &str,
    service: &str,
    port: (&str, &str, u16),
    endpoints: &[(&str, Option<&str>)],
) -> EndpointSlice {
    let ports = json!([{"name": port.0, "protocol": port.1, "port": port.2}]);
    let endpoints: Vec<_> = endpoints
        .iter()
        .map(|(ip, node)| endpoint(ip).ready(true).node(*node))
        .collect();
    fixtures::slice("ns", slice, service, "IPv4", ports, &endpoints)
}

/// `ip:port` of every endpoint of `ns/<service>`, per port name.
fn endpoints_of(state: &ProxyState, service: &str) -> Vec<(String, Vec<String>)> {
    let service = name(service);
    state
        .service_endpoints(&service)
        .map(|(port, eps)| {
            (
                port.port.to_string(),
                eps.iter().map(|e| format!("{}:{}", e.ip, e.port)).collect(),
            )
        })
        .collect()
}

fn port_names(state: &ProxyState) -> Vec<String> {
    state.services.keys().map(ToString::to_string).collect()
}

#[test]
fn services_and_slices_add_update_delete() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();

    let web = service(
        "web",
        "172.30.0.41",
        &[("http", "TCP", 80), ("dns", "UDP", 53)],
    );
    let db = service("db", "172.30.0.42", &[("sql", "TCP", 5432)]);
    assert_eq!(tracker.record(applied(web.clone())), Recorded::Changed);
    assert_eq!(tracker.record(applied(db.clone())), Recorded::Changed);
    let a = slice(
        "web-a",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.1", Some(NODE))],
    );
    let b = slice(
        "web-b",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.2", None)],
    );
    assert_eq!(tracker.record(applied(a.clone())), Recorded::Changed);
    assert_eq!(tracker.record(applied(b.clone())), Recorded::Changed);
    assert_eq!(tracker.service_changes_pending(), 2);
    assert_eq!(tracker.endpoint_changes_pending(), 1);

    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["db", "web"]));
    assert!(result.invalid.is_empty());
    assert_eq!(
        port_names(&state),
        vec!["ns/db:sql", "ns/web:dns", "ns/web:http"]
    );
    assert_eq!(state.service_count(), 2);
    assert_eq!(
        endpoints_of(&state, "web"),
        vec![(
            "http".to_owned(),
            vec!["10.180.0.1:8080".to_owned(), "10.180.0.2:8080".to_owned()]
        )]
    );
    let local: Vec<bool> = state
        .endpoints
        .values()
        .flatten()
        .map(|e| e.is_local)
        .collect();
    assert_eq!(local, vec![true, false]);
    assert_eq!(state.node.name, NODE);
    assert_eq!(tracker.service_changes_pending(), 0);
    assert_eq!(tracker.endpoint_changes_pending(), 0);
    assert!(!tracker.has_pending());

    // Nothing recorded: nothing changes.
    let before = state.clone();
    assert_eq!(tracker.apply(&mut state), UpdateResult::default());
    assert_eq!(state, before);

    // An identical update is not a change.
    assert_eq!(tracker.record(applied(b.clone())), Recorded::Unchanged);
    assert!(!tracker.has_pending());

    // Update one slice of a multi-slice service: only that service changed.
    let b2 = slice(
        "web-b",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.2", None), ("10.180.0.3", None)],
    );
    assert_eq!(tracker.record(applied(b2)), Recorded::Changed);
    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["web"]));
    assert_eq!(endpoints_of(&state, "web")[0].1.len(), 3);

    // Delete a slice: its endpoints go, the other slice's stay.
    assert_eq!(tracker.record(deleted(a)), Recorded::Changed);
    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["web"]));
    assert_eq!(
        endpoints_of(&state, "web"),
        vec![(
            "http".to_owned(),
            vec!["10.180.0.2:8080".to_owned(), "10.180.0.3:8080".to_owned()]
        )]
    );

    // Delete the service: its ports go; its endpoints stay until their slices go (as
    // upstream's endpoints map, which is independent of Services).
    assert_eq!(tracker.record(deleted(web.clone())), Recorded::Changed);
    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["web"]));
    assert_eq!(port_names(&state), vec!["ns/db:sql"]);
    assert_eq!(tracker.record(deleted(b)), Recorded::Changed);
    tracker.apply(&mut state);
    assert!(state.endpoints.is_empty());

    // Deleting what is already gone is no change.
    assert_eq!(tracker.record(deleted(web)), Recorded::Unchanged);
}

#[test]
fn changes_that_return_to_the_applied_state_cancel_out() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    let web = service("web", "172.30.0.41", &[("http", "TCP", 80)]);
    let a = slice(
        "web-a",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.1", None)],
    );
    tracker.record(applied(web.clone()));
    tracker.record(applied(a.clone()));
    tracker.apply(&mut state);
    let applied_state = state.clone();

    // Update and revert, for both kinds.
    let web2 = service("web", "172.30.0.41", &[("http", "TCP", 8000)]);
    let a2 = slice(
        "web-a",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.9", None)],
    );
    assert_eq!(tracker.record(applied(web2)), Recorded::Changed);
    assert_eq!(tracker.record(applied(a2)), Recorded::Changed);
    assert_eq!(tracker.service_changes_pending(), 1);
    assert_eq!(tracker.endpoint_changes_pending(), 1);
    assert_eq!(tracker.record(applied(web)), Recorded::Changed);
    assert_eq!(tracker.record(applied(a.clone())), Recorded::Changed);
    assert_eq!(tracker.service_changes_pending(), 0);
    assert_eq!(tracker.endpoint_changes_pending(), 0);

    // Delete and re-create.
    tracker.record(deleted(a.clone()));
    tracker.record(applied(a));

    // Add and delete something never applied.
    let tmp = service("tmp", "172.30.0.50", &[("p", "UDP", 9)]);
    tracker.record(applied(tmp.clone()));
    tracker.record(deleted(tmp));

    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, BTreeSet::new());
    assert!(!result.conntrack_cleanup_required);
    assert_eq!(state, applied_state);
}

#[test]
fn endpoints_moving_between_slices_are_no_change() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    let a = slice(
        "web-a",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.1", None)],
    );
    let b = slice(
        "web-b",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.2", None)],
    );
    tracker.record(applied(a));
    tracker.record(applied(b));
    tracker.apply(&mut state);

    let a2 = slice(
        "web-a",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.1", None), ("10.180.0.2", None)],
    );
    let b2 = slice("web-b", "web", ("http", "TCP", 8080), &[]);
    tracker.record(applied(a2));
    tracker.record(applied(b2));
    assert_eq!(tracker.endpoint_changes_pending(), 1);
    // The slices changed, but the merged endpoints did not.
    assert_eq!(tracker.apply(&mut state).changed, BTreeSet::new());
}

#[test]
fn slice_relabelled_to_another_service_moves() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    let ep = [("10.180.0.1", None)];
    tracker.record(applied(slice("s", "web", ("", "TCP", 80), &ep)));
    tracker.apply(&mut state);
    assert_eq!(
        tracker.record(applied(slice("s", "api", ("", "TCP", 80), &ep))),
        Recorded::Changed
    );
    assert_eq!(tracker.apply(&mut state).changed, names(&["api", "web"]));
    assert!(endpoints_of(&state, "web").is_empty());
    assert_eq!(endpoints_of(&state, "api").len(), 1);

    // Losing the service-name label makes the slice ignored: its endpoints go.
    let mut unlabelled = slice("s", "api", ("", "TCP", 80), &ep);
    unlabelled.metadata.labels = None;
    assert_eq!(tracker.record(applied(unlabelled)), Recorded::Changed);
    assert_eq!(tracker.apply(&mut state).changed, names(&["api"]));
    assert!(state.endpoints.is_empty());
}

#[test]
fn conntrack_cleanup_only_for_udp_or_sctp_services() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();

    tracker.record(applied(service("tcp", "172.30.0.1", &[("p", "TCP", 80)])));
    tracker.record(applied(slice(
        "tcp-a",
        "tcp",
        ("p", "TCP", 80),
        &[("10.180.0.1", None)],
    )));
    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["tcp"]));
    assert!(!result.conntrack_cleanup_required);

    let udp = service("udp", "172.30.0.2", &[("dns", "UDP", 53)]);
    tracker.record(applied(udp.clone()));
    assert!(tracker.apply(&mut state).conntrack_cleanup_required);

    // Endpoint-only change of a UDP service.
    tracker.record(applied(slice(
        "udp-a",
        "udp",
        ("dns", "UDP", 53),
        &[("10.180.0.5", None)],
    )));
    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["udp"]));
    assert!(result.conntrack_cleanup_required);

    // A TCP-only change while the UDP service is untouched.
    tracker.record(applied(slice(
        "tcp-a",
        "tcp",
        ("p", "TCP", 80),
        &[("10.180.0.2", None)],
    )));
    assert!(!tracker.apply(&mut state).conntrack_cleanup_required);

    // SCTP counts too, and "before" counts: switching SCTP to TCP needs cleanup.
    tracker.record(applied(service("sig", "172.30.0.3", &[("s", "SCTP", 7)])));
    assert!(tracker.apply(&mut state).conntrack_cleanup_required);
    tracker.record(applied(service("sig", "172.30.0.3", &[("s", "TCP", 7)])));
    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["sig"]));
    assert!(result.conntrack_cleanup_required);
}

#[test]
fn invalid_objects_are_skipped_and_the_last_good_version_kept() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    tracker.record(applied(service(
        "web",
        "172.30.0.41",
        &[("http", "TCP", 80)],
    )));
    tracker.record(applied(slice(
        "web-a",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.1", None)],
    )));
    tracker.apply(&mut state);
    let good = state.clone();

    // Invalid updates: a bad ClusterIP, a bad endpoint address.
    let bad_service = service("web", "172.30.0.999", &[("http", "TCP", 80)]);
    let bad_slice = slice("web-a", "web", ("http", "TCP", 8080), &[("10.180.0", None)]);
    // A new, invalid object.
    let bad_new = service("new", "172.30.0.50", &[("p", "TCP", 0)]);
    assert_eq!(tracker.record(applied(bad_service)), Recorded::Invalid);
    assert_eq!(tracker.record(applied(bad_slice)), Recorded::Invalid);
    assert_eq!(tracker.record(applied(bad_new)), Recorded::Invalid);
    assert!(Recorded::Invalid.needs_sync());
    assert!(tracker.has_pending());

    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, BTreeSet::new());
    let invalid: Vec<(&str, &str)> = result
        .invalid
        .iter()
        .map(|e| (e.kind, e.name.as_str()))
        .collect();
    assert_eq!(
        invalid,
        vec![
            ("Service", "web"),
            ("EndpointSlice", "web-a"),
            ("Service", "new")
        ]
    );
    assert_eq!(state, good);
    // Reported once.
    assert!(tracker.apply(&mut state).invalid.is_empty());

    // A valid update after an invalid one applies normally.
    tracker.record(applied(service(
        "web",
        "172.30.0.41",
        &[("http", "TCP", 81)],
    )));
    assert_eq!(tracker.apply(&mut state).changed, names(&["web"]));
}

#[test]
fn node_labels_other_nodes_and_deletion() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    tracker.apply(&mut state);
    assert_eq!(state.node.name, NODE);
    assert!(!state.node.known);

    let zone_a = json!({"topology.kubernetes.io/zone": "a"});
    assert_eq!(
        tracker.record(applied(node("other", zone_a.clone(), Value::Null))),
        Recorded::Unchanged
    );
    assert!(!tracker.has_pending());

    assert_eq!(
        tracker.record(applied(node(NODE, zone_a.clone(), Value::Null))),
        Recorded::Changed
    );
    let result = tracker.apply(&mut state);
    assert!(result.node_labels_changed);
    assert_eq!(result.changed, BTreeSet::new());
    assert_eq!(state.node.zone(), Some("a"));

    // Same labels: nothing to sync.
    assert_eq!(
        tracker.record(applied(node(NODE, zone_a, Value::Null))),
        Recorded::Unchanged
    );
    assert!(!tracker.apply(&mut state).node_labels_changed);

    // Eligibility alone needs no sync but is tracked.
    let taint = json!({"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}
    ]});
    let tainted = node(NODE, json!({"topology.kubernetes.io/zone": "a"}), taint);
    assert_eq!(tracker.record(applied(tainted)), Recorded::Unchanged);
    assert!(!tracker.node().eligible);
    assert!(!tracker.apply(&mut state).node_labels_changed);
    assert!(!state.node.eligible);

    assert_eq!(
        tracker.record(applied(node(
            NODE,
            json!({"topology.kubernetes.io/zone": "b"}),
            Value::Null
        ))),
        Recorded::Changed
    );
    assert!(tracker.apply(&mut state).node_labels_changed);

    let gone = deleted(node(NODE, json!({}), Value::Null));
    assert_eq!(tracker.record(gone), Recorded::Changed);
    assert!(!tracker.node().eligible);
    assert!(tracker.apply(&mut state).node_labels_changed);
    assert!(state.node.labels.is_empty());
}

#[test]
fn endpoint_locality_uses_the_tracker_node_name() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    tracker.record(applied(slice(
        "web-a",
        "web",
        ("", "TCP", 80),
        &[("10.180.0.1", Some(NODE)), ("10.180.0.2", Some("other"))],
    )));
    tracker.apply(&mut state);
    let local: Vec<bool> = state
        .endpoints
        .values()
        .flatten()
        .map(|e| e.is_local)
        .collect();
    assert_eq!(local, vec![true, false]);
}

#[test]
fn synced_is_tracked_per_kind() {
    let mut tracker = ChangeTracker::new(NODE);
    assert!(!tracker.ready());
    assert_eq!(
        tracker.record(SourceEvent::Service(ObjectEvent::Synced)),
        Recorded::Synced(ObjectKind::Service)
    );
    assert!(!tracker.ready());
    assert_eq!(
        tracker.record(SourceEvent::Node(ObjectEvent::Synced)),
        Recorded::Synced(ObjectKind::Node)
    );
    assert!(!tracker.ready());
    tracker.record(SourceEvent::EndpointSlice(ObjectEvent::Synced));
    assert!(tracker.ready());
    assert!(tracker.is_synced(ObjectKind::Node));
}

#[test]
fn trigger_times_are_reported_for_changed_services() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    let annotated = |ip: &str, time: &str| {
        let mut s = slice("web-a", "web", ("", "TCP", 80), &[(ip, None)]);
        s.metadata.annotations = Some(
            [(
                LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_owned(),
                time.to_owned(),
            )]
            .into_iter()
            .collect(),
        );
        s
    };
    tracker.record(applied(annotated("10.180.0.1", "2025-01-02T03:04:05Z")));
    let result = tracker.apply(&mut state);
    let want = SystemTime::UNIX_EPOCH + Duration::from_secs(1_735_787_045);
    assert_eq!(result.trigger_times, vec![want]);

    // A change that cancels out measures nothing.
    tracker.record(applied(annotated("10.180.0.2", "2025-01-02T03:04:06Z")));
    tracker.record(applied(annotated("10.180.0.1", "2025-01-02T03:04:07Z")));
    assert_eq!(tracker.apply(&mut state).trigger_times, vec![]);

    // Unparsable annotations are ignored.
    tracker.record(applied(annotated("10.180.0.3", "yesterday")));
    let result = tracker.apply(&mut state);
    assert_eq!(result.changed, names(&["web"]));
    assert_eq!(result.trigger_times, vec![]);
}

fn service_cidr(name: &str, cidrs: &[&str]) -> k8s_openapi::api::networking::v1::ServiceCIDR {
    k8s_openapi::api::networking::v1::ServiceCIDR {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::networking::v1::ServiceCIDRSpec {
            cidrs: Some(cidrs.iter().map(|c| (*c).to_owned()).collect()),
        }),
        status: None,
    }
}

#[test]
fn service_cidrs_reach_the_state_sorted_and_merged() {
    let mut tracker = ChangeTracker::new("node-1");
    let mut state = ProxyState::default();
    let applied = |o| SourceEvent::ServiceCidr(ObjectEvent::Applied(o));
    assert_eq!(
        tracker.record(applied(service_cidr(
            "kubernetes",
            &["10.96.0.0/16", "fd00::/112"]
        ))),
        Recorded::Changed
    );
    assert_eq!(
        tracker.record(applied(service_cidr(
            "extra",
            &["10.0.0.0/24", "10.96.0.0/16"]
        ))),
        Recorded::Changed
    );
    assert!(tracker.has_pending());
    let update = tracker.apply(&mut state);
    assert!(update.changed.is_empty(), "no service changed");
    let shown: Vec<String> = state
        .service_cidrs
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(shown, ["10.0.0.0/24", "10.96.0.0/16", "fd00::/112"]);
    assert!(!tracker.has_pending());

    // The same object again changes nothing; an invalid update keeps the last good ranges.
    assert_eq!(
        tracker.record(applied(service_cidr(
            "extra",
            &["10.0.0.0/24", "10.96.0.0/16"]
        ))),
        Recorded::Unchanged
    );
    assert_eq!(
        tracker.record(applied(service_cidr("extra", &["10.0.0.1/24"]))),
        Recorded::Invalid
    );
    let update = tracker.apply(&mut state);
    assert_eq!(update.invalid.len(), 1);
    assert_eq!(update.invalid[0].kind, "ServiceCIDR");
    assert_eq!(state.service_cidrs.len(), 3);

    let deleted = SourceEvent::ServiceCidr(ObjectEvent::Deleted(service_cidr("extra", &[])));
    assert_eq!(tracker.record(deleted), Recorded::Changed);
    tracker.apply(&mut state);
    let shown: Vec<String> = state
        .service_cidrs
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(shown, ["10.96.0.0/16", "fd00::/112"]);
    // Not needed before the first sync: clusters without the API never send it.
    assert!(!tracker.is_synced(ObjectKind::ServiceCidr));
}

/// The names a service's objects repeat are one allocation each: the Service's ports and its
/// EndpointSlice's endpoint lists point at the same namespace, service and port name, and
/// two services of one namespace share it (the 10k × 10 control plane went from ~80 to ~63
/// MiB with this; bench/notes/2026-11-27-control-plane-floor.md).
#[test]
fn a_service_and_its_slices_share_their_names() {
    let mut tracker = ChangeTracker::new(NODE);
    let mut state = ProxyState::default();
    tracker.record(applied(service(
        "web",
        "172.30.0.41",
        &[("http", "TCP", 80)],
    )));
    tracker.record(applied(service(
        "db",
        "172.30.0.42",
        &[("sql", "TCP", 5432)],
    )));
    tracker.record(applied(slice(
        "web-a",
        "web",
        ("http", "TCP", 8080),
        &[("10.180.0.1", Some(NODE)), ("10.180.0.2", Some(NODE))],
    )));
    tracker.apply(&mut state);

    let web = state
        .services
        .keys()
        .find(|key| key.service.name == "web")
        .expect("web's port");
    let db = state
        .services
        .keys()
        .find(|key| key.service.name == "db")
        .expect("db's port");
    let (endpoints_key, endpoints) = state.endpoints.iter().next().expect("web's endpoints");
    assert_eq!(endpoints_key, web);
    assert!(model::Name::ptr_eq(
        &endpoints_key.service.name,
        &web.service.name
    ));
    assert!(model::Name::ptr_eq(
        &endpoints_key.service.namespace,
        &web.service.namespace
    ));
    assert!(model::Name::ptr_eq(&endpoints_key.port, &web.port));
    assert!(model::Name::ptr_eq(
        &db.service.namespace,
        &web.service.namespace
    ));
    let nodes: Vec<_> = endpoints
        .iter()
        .filter_map(|e| e.node_name.as_ref())
        .collect();
    assert_eq!(nodes.len(), 2);
    assert!(model::Name::ptr_eq(nodes[0], nodes[1]));
    let port = &state.services[web];
    assert!(model::Name::ptr_eq(
        &port.name.service.name,
        &web.service.name
    ));
}

#[test]
fn without_external_ips_services_are_programmed_as_if_they_had_none() {
    let spec = |type_: &str, port: Value| {
        json!({"type": type_, "clusterIP": "172.30.0.43", "clusterIPs": ["172.30.0.43"],
               "externalIPs": ["192.0.2.10"], "externalTrafficPolicy": "Local",
               "ports": [port]})
    };
    let http = json!({"name": "http", "protocol": "TCP", "port": 80});
    let node_http = json!({"name": "http", "protocol": "TCP", "port": 80, "nodePort": 30080});
    let cluster_ip = fixtures::service("ns", "ext", spec("ClusterIP", http));
    let node_port = fixtures::service("ns", "np", spec("NodePort", node_http));
    let ports = |tracker: &mut ChangeTracker| {
        let mut state = ProxyState::default();
        tracker.record(applied(cluster_ip.clone()));
        tracker.record(applied(node_port.clone()));
        tracker.apply(&mut state);
        state
            .services
            .values()
            .map(|p| {
                (
                    p.name.service.name.to_string(),
                    p.external_ips.len(),
                    p.external_policy_local,
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ports(&mut ChangeTracker::new(NODE)),
        [("ext".to_owned(), 1, true), ("np".to_owned(), 1, true)]
    );
    // Off: no externalIP; the ClusterIP Service is then reachable from nowhere outside, so
    // its external policy goes too, while the NodePort Service keeps its.
    assert_eq!(
        ports(&mut ChangeTracker::new(NODE).with_external_ips(false)),
        [("ext".to_owned(), 0, false), ("np".to_owned(), 0, true)]
    );
}
