//! Test builders for the Kubernetes objects and source events the kp-core tests feed in.
//!
//! Objects are built from JSON as the API serves them, so what a test builds is what a source
//! would deliver. Every builder writes only the fields it is given.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use crate::event::{ObjectEvent, SourceEvent};
use crate::model::ServiceName;

/// The name of the node the proxy under test runs on.
pub(crate) const NODE: &str = "test-node";

/// Deserializes a Kubernetes object (or part of one) from JSON; panics if it does not fit.
pub(crate) fn object<T: DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value)
        .unwrap_or_else(|e| panic!("{} JSON: {e}", std::any::type_name::<T>()))
}

/// The ServiceName `ns/<service>`.
pub(crate) fn name(service: &str) -> ServiceName {
    ServiceName {
        namespace: "ns".to_owned(),
        name: service.to_owned(),
    }
}

/// The ServiceNames `ns/<service>` of `services`.
pub(crate) fn names(services: &[&str]) -> BTreeSet<ServiceName> {
    services.iter().map(|s| name(s)).collect()
}

/// Service `<ns>/<name>` JSON with the given spec.
pub(crate) fn service_json(ns: &str, name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    })
}

/// Service `<ns>/<name>` with the given spec.
pub(crate) fn service(ns: &str, name: &str, spec: Value) -> Service {
    object(service_json(ns, name, spec))
}

/// `spec` with ClusterIP 172.30.0.41 and port 80 (node port 3001 if NodePort or LoadBalancer).
pub(crate) fn port_80_spec(mut spec: Value) -> Value {
    spec["clusterIP"] = json!("172.30.0.41");
    let node_port = matches!(spec["type"].as_str(), Some("NodePort" | "LoadBalancer"));
    spec["ports"] = if node_port {
        json!([{"port": 80, "nodePort": 3001}])
    } else {
        json!([{"port": 80}])
    };
    spec
}

/// Node `<name>` with the given labels and spec (`null` for none).
pub(crate) fn node(name: &str, labels: Value, spec: Value) -> Node {
    object(json!({"metadata": {"name": name, "labels": labels}, "spec": spec}))
}

/// EndpointSlice `<ns>/<name>` JSON of service `<service>` with the given ports and endpoints.
pub(crate) fn slice_json(
    ns: &str,
    name: &str,
    service: &str,
    address_type: &str,
    ports: Value,
    endpoints: Value,
) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": ns,
            "name": name,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": address_type,
        "ports": ports,
        "endpoints": endpoints,
    })
}

/// EndpointSlice `<ns>/<name>` of service `<service>` with the given ports and endpoints.
pub(crate) fn slice(
    ns: &str,
    name: &str,
    service: &str,
    address_type: &str,
    ports: Value,
    endpoints: &[EndpointSpec],
) -> EndpointSlice {
    let endpoints = endpoints.iter().map(EndpointSpec::json).collect();
    object(slice_json(
        ns,
        name,
        service,
        address_type,
        ports,
        endpoints,
    ))
}

/// An EndpointSlice endpoint with one address and nothing else set.
pub(crate) fn endpoint(ip: &str) -> EndpointSpec {
    EndpointSpec {
        ip: ip.to_owned(),
        ..EndpointSpec::default()
    }
}

/// One EndpointSlice endpoint, built from [`endpoint`]; what is not set is left out.
#[derive(Clone, Debug, Default)]
pub(crate) struct EndpointSpec {
    ip: String,
    node: Option<String>,
    conditions: Map<String, Value>,
    hints: Option<(Vec<String>, Vec<String>)>,
}

impl EndpointSpec {
    /// Sets `conditions.ready` only.
    pub(crate) fn ready(mut self, ready: bool) -> Self {
        self.conditions.insert("ready".into(), json!(ready));
        self
    }

    /// Sets `conditions` to `(ready, serving, terminating)`.
    pub(crate) fn conditions(self, (ready, serving, terminating): (bool, bool, bool)) -> Self {
        let mut spec = self.ready(ready);
        spec.conditions.insert("serving".into(), json!(serving));
        spec.conditions
            .insert("terminating".into(), json!(terminating));
        spec
    }

    /// Sets `nodeName`, or leaves it out for `None`.
    pub(crate) fn node(mut self, node: Option<&str>) -> Self {
        self.node = node.map(str::to_owned);
        self
    }

    /// Sets `hints.forZones` and `hints.forNodes` (both written, even when empty).
    pub(crate) fn hints(mut self, zones: &[&str], nodes: &[&str]) -> Self {
        let owned = |list: &[&str]| list.iter().map(|n| (*n).to_owned()).collect();
        self.hints = Some((owned(zones), owned(nodes)));
        self
    }

    /// The endpoint as EndpointSlice JSON.
    pub(crate) fn json(&self) -> Value {
        let mut value = json!({"addresses": [self.ip]});
        if !self.conditions.is_empty() {
            value["conditions"] = Value::Object(self.conditions.clone());
        }
        if let Some(node) = &self.node {
            value["nodeName"] = json!(node);
        }
        if let Some((zones, nodes)) = &self.hints {
            let names = |list: &[String]| -> Vec<Value> {
                list.iter().map(|n| json!({"name": n})).collect()
            };
            value["hints"] = json!({"forZones": names(zones), "forNodes": names(nodes)});
        }
        value
    }
}

/// The kinds of object a source reports, and the event variant each travels in.
pub(crate) trait Kind: Sized {
    /// Wraps an event about this kind of object.
    fn event(event: ObjectEvent<Self>) -> SourceEvent;
}

impl Kind for Service {
    fn event(event: ObjectEvent<Self>) -> SourceEvent {
        SourceEvent::Service(event)
    }
}

impl Kind for EndpointSlice {
    fn event(event: ObjectEvent<Self>) -> SourceEvent {
        SourceEvent::EndpointSlice(event)
    }
}

impl Kind for Node {
    fn event(event: ObjectEvent<Self>) -> SourceEvent {
        SourceEvent::Node(event)
    }
}

/// The source event for `object` being created or updated.
pub(crate) fn applied<K: Kind>(object: K) -> SourceEvent {
    K::event(ObjectEvent::Applied(object))
}

/// The source event for `object` being deleted.
pub(crate) fn deleted<K: Kind>(object: K) -> SourceEvent {
    K::event(ObjectEvent::Deleted(object))
}
