//! Test builders for the Kubernetes objects and source events the kp-core tests feed in
//! (and, through the `test-util` feature, other crates' tests: a source's output, built the
//! way the model's tests build it).
//!
//! Objects are built from JSON as the API serves them, so what a test builds is what a source
//! would deliver. Every builder writes only the fields it is given.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use crate::event::{ObjectEvent, SourceEvent};
use crate::model::ServiceName;

pub use crate::testutil::NODE;

/// Deserializes a Kubernetes object (or part of one) from JSON; panics if it does not fit.
pub fn object<T: DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value)
        .unwrap_or_else(|e| panic!("{} JSON: {e}", std::any::type_name::<T>()))
}

/// The ServiceName `ns/<service>`.
pub fn name(service: &str) -> ServiceName {
    ServiceName {
        namespace: "ns".into(),
        name: service.into(),
    }
}

/// The ServiceNames `ns/<service>` of `services`.
pub fn names(services: &[&str]) -> BTreeSet<ServiceName> {
    services.iter().map(|s| name(s)).collect()
}

/// Service `<ns>/<name>` JSON with the given spec.
pub fn service_json(ns: &str, name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    })
}

/// Service `<ns>/<name>` with the given spec.
pub fn service(ns: &str, name: &str, spec: Value) -> Service {
    object(service_json(ns, name, spec))
}

/// `spec` with ClusterIP 172.30.0.41 and port 80 (node port 3001 if NodePort or LoadBalancer).
pub fn port_80_spec(mut spec: Value) -> Value {
    spec["clusterIP"] = json!("172.30.0.41");
    let node_port = matches!(spec["type"].as_str(), Some("NodePort" | "LoadBalancer"));
    spec["ports"] = if node_port {
        json!([{"port": 80, "nodePort": 3001}])
    } else {
        json!([{"port": 80}])
    };
    spec
}

/// ServiceCIDR `<name>` with the given ranges.
pub fn service_cidr(name: &str, cidrs: &[&str]) -> ServiceCIDR {
    object(json!({"metadata": {"name": name}, "spec": {"cidrs": cidrs}}))
}

/// Node `<name>` with the given labels and spec (`null` for none).
pub fn node(name: &str, labels: Value, spec: Value) -> Node {
    object(json!({"metadata": {"name": name, "labels": labels}, "spec": spec}))
}

/// EndpointSlice `<ns>/<name>` JSON of service `<service>` with the given ports and endpoints.
pub fn slice_json(
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
pub fn slice(
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
pub fn endpoint(ip: &str) -> EndpointSpec {
    EndpointSpec {
        ip: ip.to_owned(),
        ..EndpointSpec::default()
    }
}

/// One EndpointSlice endpoint, built from [`endpoint`]; what is not set is left out.
#[derive(Clone, Debug, Default)]
pub struct EndpointSpec {
    ip: String,
    node: Option<String>,
    conditions: Map<String, Value>,
    hints: Option<(Vec<String>, Vec<String>)>,
}

impl EndpointSpec {
    /// Sets `conditions.ready` only.
    pub fn ready(mut self, ready: bool) -> Self {
        self.conditions.insert("ready".into(), json!(ready));
        self
    }

    /// Sets `conditions` to `(ready, serving, terminating)`.
    pub fn conditions(self, (ready, serving, terminating): (bool, bool, bool)) -> Self {
        let mut spec = self.ready(ready);
        spec.conditions.insert("serving".into(), json!(serving));
        spec.conditions
            .insert("terminating".into(), json!(terminating));
        spec
    }

    /// Sets `nodeName`, or leaves it out for `None`.
    pub fn node(mut self, node: Option<&str>) -> Self {
        self.node = node.map(str::to_owned);
        self
    }

    /// Sets `hints.forZones` and `hints.forNodes` (both written, even when empty).
    pub fn hints(mut self, zones: &[&str], nodes: &[&str]) -> Self {
        let owned = |list: &[&str]| list.iter().map(|n| (*n).to_owned()).collect();
        self.hints = Some((owned(zones), owned(nodes)));
        self
    }

    /// The endpoint as EndpointSlice JSON.
    pub fn json(&self) -> Value {
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
pub trait Kind: Sized {
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

impl Kind for ServiceCIDR {
    fn event(event: ObjectEvent<Self>) -> SourceEvent {
        SourceEvent::ServiceCidr(event)
    }
}

/// The source event for `object` being created or updated.
pub fn applied<K: Kind>(object: K) -> SourceEvent {
    K::event(ObjectEvent::Applied(object))
}

/// The source event for `object` being deleted.
pub fn deleted<K: Kind>(object: K) -> SourceEvent {
    K::event(ObjectEvent::Deleted(object))
}
