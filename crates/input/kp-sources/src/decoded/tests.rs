use kp_core::model::{node_info, service_cidr_ranges, service_ports, slice_endpoints};
use kube::core::ObjectList;
use serde_json::json;

use super::*;

/// A Service as a v1.26 API server returns it after the conformance spec "should complete a
/// service status lifecycle": every field the model reads set, and the fields it does not
/// read as an API server fills them, with Go's zero time as `null`.
pub(super) fn service() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": "web", "namespace": "ns", "uid": "0d6c", "resourceVersion": "42",
            "creationTimestamp": "2026-11-27T10:00:00Z",
            "labels": { "app": "web" },
            "annotations": { "note": "x" },
            "managedFields": [{ "manager": "kubectl", "operation": "Update",
                                "time": "2026-11-27T10:00:00Z", "fieldsType": "FieldsV1",
                                "fieldsV1": { "f:spec": {} } }]
        },
        "spec": {
            "type": "LoadBalancer",
            "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
            "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "PreferDualStack",
            "externalIPs": ["192.0.2.7"],
            "loadBalancerSourceRanges": ["198.51.100.0/24"],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": { "clientIP": { "timeoutSeconds": 60 } },
            "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
            "healthCheckNodePort": 31000,
            "allocateLoadBalancerNodePorts": true,
            "selector": { "app": "web" },
            "ports": [
                { "name": "http", "protocol": "TCP", "port": 80, "targetPort": "http",
                  "nodePort": 30080, "appProtocol": "http" },
                { "name": "dns", "protocol": "UDP", "port": 53, "targetPort": 5353,
                  "nodePort": 30053 }
            ]
        },
        "status": {
            "loadBalancer": { "ingress": [
                { "ip": "203.0.113.9", "ipMode": "VIP",
                  "ports": [{ "port": 80, "protocol": "TCP", "error": "x" }] },
                { "ip": "203.0.113.10", "ipMode": "Proxy" },
                { "hostname": "lb.example" }
            ] },
            "conditions": [{ "type": "StatusUpdate", "status": "True", "reason": "E2E",
                             "message": "x", "lastTransitionTime": null }]
        }
    })
}

pub(super) fn endpoint_slice() -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": "web-abc", "namespace": "ns", "resourceVersion": "43",
            "generateName": "web-", "creationTimestamp": null,
            "labels": { "kubernetes.io/service-name": "web",
                        "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io" },
            "annotations": { "endpoints.kubernetes.io/last-change-trigger-time": "2026-11-27T10:00:00Z" },
            "ownerReferences": [{ "apiVersion": "v1", "kind": "Service", "name": "web", "uid": "0d6c" }]
        },
        "addressType": "IPv4",
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080, "appProtocol": "http" }],
        "endpoints": [
            { "addresses": ["10.244.1.5"],
              "conditions": { "ready": true, "serving": true, "terminating": false },
              "nodeName": "node-1", "zone": "a",
              "hints": { "forZones": [{ "name": "a" }], "forNodes": [{ "name": "node-1" }] },
              "targetRef": { "kind": "Pod", "name": "web-1", "namespace": "ns" },
              "deprecatedTopology": { "x": "y" } },
            { "addresses": ["10.244.2.5"],
              "conditions": { "ready": false, "serving": true, "terminating": true },
              "nodeName": "node-2", "zone": "b" }
        ]
    })
}

pub(super) fn node() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": "node-1", "resourceVersion": "44",
            "labels": { "topology.kubernetes.io/zone": "a" },
            "deletionTimestamp": "2026-11-27T10:00:00Z"
        },
        "spec": {
            "podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:1::/64"],
            "taints": [{ "key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule",
                         "timeAdded": null }],
            "providerID": "kind://x"
        },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": "192.168.1.10" },
                          { "type": "Hostname", "address": "node-1" }],
            "conditions": [{ "type": "Ready", "status": "True", "lastHeartbeatTime": null }],
            "images": [{ "names": ["x"], "sizeBytes": "not a number" }],
            "nodeInfo": { "kernelVersion": 6 }
        }
    })
}

pub(super) fn service_cidr() -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": { "name": "kubernetes", "resourceVersion": "45" },
        "spec": { "cidrs": ["10.96.0.0/16", "fd00::/108"] },
        "status": { "conditions": [{ "type": "Ready", "status": "True",
                                     "lastTransitionTime": null, "reason": "", "message": "" }] }
    })
}

fn usable<K: Watched + fmt::Debug>(value: Value) -> K {
    match Decoded::<K>::from_value(value) {
        Decoded::Usable(object) => object,
        Decoded::Unusable(unusable) => panic!("unusable: {unusable:?}"),
    }
}

/// Without what the model does not read, the typed object may as well be decoded whole.
fn without_unread(mut value: Value, paths: &[&[&str]]) -> Value {
    for path in paths {
        let (last, parents) = path.split_last().expect("non-empty path");
        let mut at = &mut value;
        for step in parents {
            at = &mut at[*step];
        }
        if let Some(array) = at.as_array_mut() {
            for item in array {
                item.as_object_mut().map(|o| o.remove(*last));
            }
        } else if let Some(object) = at.as_object_mut() {
            object.remove(*last);
        }
    }
    value
}

#[test]
fn a_null_timestamp_where_the_proxy_reads_nothing_does_not_lose_the_service() {
    // The strict type refuses the object whole.
    assert!(serde_json::from_value::<Service>(service()).is_err());
    let projected: Service = usable(service());
    let strict: Service = serde_json::from_value(without_unread(
        service(),
        &[&["status", "conditions"], &["metadata", "managedFields"]],
    ))
    .expect("the object without its conditions types");
    assert_eq!(service_ports(&projected), service_ports(&strict));
    let ports = service_ports(&projected)
        .expect("valid")
        .expect("not ignored");
    assert_eq!(ports.len(), 2);
}

#[test]
fn every_kind_reads_what_the_model_reads() {
    let slice: EndpointSlice = usable(endpoint_slice());
    let strict: EndpointSlice = serde_json::from_value(endpoint_slice()).expect("types whole");
    assert_eq!(slice_endpoints(&slice), slice_endpoints(&strict));
    assert_eq!(
        slice.metadata.annotations, strict.metadata.annotations,
        "the trigger time is read"
    );

    let node_value = without_unread(
        node(),
        &[
            &["status", "conditions"],
            &["status", "images"],
            &["status", "nodeInfo"],
            &["spec", "taints", "timeAdded"],
        ],
    );
    let strict: Node = serde_json::from_value(node_value).expect("types without the odd fields");
    let projected: Node = usable(node());
    assert_eq!(node_info(&projected), node_info(&strict));
    assert!(
        !node_info(&projected).eligible,
        "deletion and taint are read"
    );

    let strict: ServiceCIDR =
        serde_json::from_value(without_unread(service_cidr(), &[&["status", "conditions"]]))
            .expect("types without conditions");
    let projected: ServiceCIDR = usable(service_cidr());
    assert_eq!(
        service_cidr_ranges(&projected).expect("valid"),
        service_cidr_ranges(&strict).expect("valid")
    );
}

#[test]
fn a_field_the_proxy_reads_that_does_not_decode_names_the_object_and_the_field() {
    let mut value = service();
    value["spec"]["ports"][1]["port"] = json!("fifty-three");
    let Decoded::<Service>::Unusable(unusable) = Decoded::from_value(value) else {
        panic!("a port that is not a number cannot be used");
    };
    assert_eq!(unusable.meta.name.as_deref(), Some("web"));
    assert_eq!(unusable.meta.namespace.as_deref(), Some("ns"));
    assert!(
        unusable
            .problem
            .starts_with("spec.ports[1].port: invalid type: string"),
        "{}",
        unusable.problem
    );
}

#[test]
fn unusable_metadata_still_names_the_object() {
    let mut value = endpoint_slice();
    value["metadata"]["labels"] = json!(["not", "a", "map"]);
    let Decoded::<EndpointSlice>::Unusable(unusable) = Decoded::from_value(value) else {
        panic!("labels that are not a map cannot be used");
    };
    assert_eq!(unusable.meta.name.as_deref(), Some("web-abc"));
    assert_eq!(unusable.meta.resource_version.as_deref(), Some("43"));
    assert!(
        unusable.problem.starts_with("metadata.labels"),
        "{}",
        unusable.problem
    );
}

#[test]
fn one_unusable_item_does_not_fail_the_list() {
    let mut bad = service();
    bad["metadata"]["name"] = json!("bad");
    bad["spec"]["clusterIPs"] = json!({ "not": "a list" });
    let list = json!({
        "apiVersion": "v1", "kind": "ServiceList",
        "metadata": { "resourceVersion": "50" },
        "items": [service(), bad, service()]
    })
    .to_string();
    // The list as the watcher decodes it: from the response's bytes.
    let list: ObjectList<Decoded<Service>> = serde_json::from_str(&list).expect("the list decodes");
    let kinds: Vec<bool> = list
        .items
        .iter()
        .map(|item| matches!(item, Decoded::Usable(_)))
        .collect();
    assert_eq!(kinds, [true, false, true]);
    assert_eq!(list.metadata.resource_version.as_deref(), Some("50"));
}

#[test]
fn problems_stay_one_short_line() {
    let long = format!("a\nb{}", "x".repeat(500));
    let line = one_line(&long);
    assert!(!line.contains('\n'));
    assert_eq!(line.chars().count(), PROBLEM_MAX + 1);
    assert_eq!(one_line("short"), "short");
}
