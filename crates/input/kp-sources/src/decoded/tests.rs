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

/// What each kind's model (and the manifests source's defaults and validation) reads, written
/// out independently of the shapes: a mutation at or inside one of these paths, or at one of
/// their ancestors, may change the model; anywhere else it must not.
const READ: [(&str, &[&str]); 4] = [
    (
        "Service",
        &[
            "apiVersion",
            "kind",
            "metadata.name",
            "metadata.namespace",
            "metadata.labels",
            "metadata.resourceVersion",
            "spec.type",
            "spec.clusterIP",
            "spec.clusterIPs",
            "spec.ipFamilies",
            "spec.ipFamilyPolicy",
            "spec.externalIPs",
            "spec.loadBalancerIP",
            "spec.loadBalancerSourceRanges",
            "spec.sessionAffinity",
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
            "spec.externalTrafficPolicy",
            "spec.internalTrafficPolicy",
            "spec.healthCheckNodePort",
            "spec.ports[].name",
            "spec.ports[].protocol",
            "spec.ports[].port",
            "spec.ports[].nodePort",
            "status.loadBalancer.ingress[].ip",
            "status.loadBalancer.ingress[].ipMode",
            "status.loadBalancer.ingress[].hostname",
        ],
    ),
    (
        "EndpointSlice",
        &[
            "apiVersion",
            "kind",
            "metadata.name",
            "metadata.namespace",
            "metadata.labels",
            "metadata.annotations",
            "metadata.resourceVersion",
            "addressType",
            "ports[].name",
            "ports[].protocol",
            "ports[].port",
            "endpoints[].addresses",
            "endpoints[].conditions.ready",
            "endpoints[].conditions.serving",
            "endpoints[].conditions.terminating",
            "endpoints[].nodeName",
            "endpoints[].zone",
            "endpoints[].hints.forZones[].name",
            "endpoints[].hints.forNodes[].name",
        ],
    ),
    (
        "Node",
        &[
            "apiVersion",
            "kind",
            "metadata.name",
            "metadata.labels",
            "metadata.resourceVersion",
            "metadata.deletionTimestamp",
            "spec.podCIDR",
            "spec.podCIDRs",
            "spec.taints[].key",
            "spec.taints[].effect",
            "status.addresses[].type",
            "status.addresses[].address",
        ],
    ),
    (
        "ServiceCIDR",
        &[
            "apiVersion",
            "kind",
            "metadata.name",
            "metadata.namespace",
            "metadata.resourceVersion",
            "spec.cidrs",
        ],
    ),
];

/// A place in a JSON value: object keys and array indices.
#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

/// `spec.ports[].port` for `spec`, `ports`, `0`, `port`.
fn pattern(path: &[Step]) -> String {
    let mut out = String::new();
    for step in path {
        match step {
            Step::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Step::Index(_) => out.push_str("[]"),
        }
    }
    out
}

/// Whether a change at `path` leaves every read path alone: neither inside one nor above one.
fn unread(kind: &str, path: &[Step]) -> bool {
    let at = pattern(path);
    let reads = READ
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(&[][..], |(_, r)| *r);
    reads.iter().all(|read| {
        let inside = at == *read
            || at.starts_with(&format!("{read}."))
            || at.starts_with(&format!("{read}["));
        let above = read.starts_with(&format!("{at}.")) || read.starts_with(&format!("{at}["));
        !(inside || above)
    })
}

/// Every path in `value`, and for each object a path to a key it does not have yet.
fn paths(value: &Value, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    match value {
        Value::Object(map) => {
            let mut fresh = at.clone();
            fresh.push(Step::Key("fieldOfTheFuture".into()));
            out.push(fresh);
            for (key, child) in map {
                at.push(Step::Key(key.clone()));
                out.push(at.clone());
                paths(child, at, out);
                at.pop();
            }
        }
        Value::Array(items) => {
            for (index, child) in items.iter().enumerate() {
                at.push(Step::Index(index));
                out.push(at.clone());
                paths(child, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// Sets `path` of `value` to `new` (a missing last key is added).
fn set(value: &mut Value, path: &[Step], new: Value) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut at = value;
    for step in parents {
        at = match step {
            Step::Key(key) => &mut at[key.as_str()],
            Step::Index(index) => &mut at[*index],
        };
    }
    match last {
        Step::Key(key) => at[key.as_str()] = new,
        Step::Index(index) => at[*index] = new,
    }
}

/// The model of one object of `kind`, or what kept it from being built.
fn model_of(kind: &str, value: Value) -> String {
    fn decoded<K: Watched>(value: Value) -> Result<K, String> {
        match Decoded::<K>::from_value(value) {
            Decoded::Usable(object) => Ok(object),
            Decoded::Unusable(unusable) => Err(unusable.problem),
        }
    }
    match kind {
        "Service" => format!("{:?}", decoded::<Service>(value).map(|o| service_ports(&o))),
        "EndpointSlice" => {
            format!(
                "{:?}",
                decoded::<EndpointSlice>(value).map(|o| slice_endpoints(&o))
            )
        }
        "Node" => format!("{:?}", decoded::<Node>(value).map(|o| node_info(&o))),
        _ => format!(
            "{:?}",
            decoded::<ServiceCIDR>(value).map(|o| service_cidr_ranges(&o))
        ),
    }
}

/// The model of `value` read from a manifests file (JSON), as the manifests source builds it.
fn manifest_model(kind: &str, value: &Value) -> String {
    let (objects, errors) =
        crate::manifests::parse_manifests(&value.to_string(), std::path::Path::new("m.json"));
    let models: Vec<String> = objects
        .into_iter()
        .map(|object| match object {
            crate::manifests::Object::Service(o) => format!("{:?}", service_ports(&o)),
            crate::manifests::Object::EndpointSlice(o) => format!("{:?}", slice_endpoints(&o)),
            crate::manifests::Object::Node(o) => format!("{:?}", node_info(&o)),
            crate::manifests::Object::ServiceCidr(o) => format!("{:?}", service_cidr_ranges(&o)),
        })
        .collect();
    format!(
        "{kind}: {models:?} {:?}",
        errors.iter().map(ToString::to_string).collect::<Vec<_>>()
    )
}

fn odd_value() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-z:0-9 ]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z]{1,6}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Whatever a server puts into fields the proxy does not read, in any object of any kind,
    /// the model built from it (through the API server's decoding and through a manifests
    /// file) is the model of the object without it.
    #[test]
    fn values_in_unread_fields_never_change_the_model(
        which in 0usize..4,
        picks in proptest::collection::vec((proptest::prelude::any::<proptest::sample::Index>(), odd_value()), 1..6),
    ) {
        let (kind, original) = [
            ("Service", service_without_nulls()),
            ("EndpointSlice", endpoint_slice()),
            ("Node", node_without_nulls()),
            ("ServiceCIDR", service_cidr()),
        ][which].clone();
        let mut mutated = original.clone();
        for (pick, new) in picks {
            let mut all = Vec::new();
            paths(&mutated, &mut Vec::new(), &mut all);
            let allowed: Vec<Vec<Step>> =
                all.into_iter().filter(|p| unread(kind, p)).collect();
            if allowed.is_empty() {
                continue;
            }
            set(&mut mutated, &allowed[pick.index(allowed.len())], new);
        }
        proptest::prop_assert_eq!(
            model_of(kind, mutated.clone()),
            model_of(kind, original.clone())
        );
        proptest::prop_assert_eq!(manifest_model(kind, &mutated), manifest_model(kind, &original));
    }
}

/// [`service`] as a manifest a person writes: the strict decode takes it whole.
fn service_without_nulls() -> Value {
    without_unread(service(), &[&["status", "conditions"]])
}

/// [`node`] without the values the strict type refuses.
fn node_without_nulls() -> Value {
    without_unread(
        node(),
        &[
            &["status", "conditions"],
            &["status", "images"],
            &["status", "nodeInfo"],
            &["spec", "taints", "timeAdded"],
        ],
    )
}

#[test]
fn the_read_list_keeps_mutations_away_from_what_the_model_reads() {
    // A port number is read; the selector is not; sessionAffinityConfig is above a read path.
    let at = |p: &str| -> Vec<Step> {
        p.split('.')
            .flat_map(|part| match part.strip_suffix("[0]") {
                Some(key) => vec![Step::Key(key.into()), Step::Index(0)],
                None => vec![Step::Key(part.into())],
            })
            .collect()
    };
    assert!(!unread("Service", &at("spec.ports[0].port")));
    assert!(!unread("Service", &at("spec.sessionAffinityConfig")));
    assert!(!unread("Service", &at("spec.ports[0]")));
    assert!(unread("Service", &at("spec.selector")));
    assert!(unread("Service", &at("spec.ports[0].targetPort")));
    assert!(unread("Service", &at("status.conditions")));
    // And such a mutation of a read field does change the model: the test can fail.
    let mut value = service_without_nulls();
    set(&mut value, &at("spec.ports[0].port"), json!(81));
    assert_ne!(
        model_of("Service", value),
        model_of("Service", service_without_nulls())
    );
}
