//! Objects decoded by the fields the proxy reads, one object at a time.
//!
//! An API server stores values that k8s-openapi's types refuse: Go's zero time is `null` in
//! `status.conditions[].lastTransitionTime`, and a newer server may send a field in a form an
//! older type does not know. Decoding a whole list with those types lets one such object fail
//! the list, and with it every Service of the node. Here each object is first cut down to the
//! fields the model reads (its kind's [`Shape`]), every other value skipped unread, and only
//! that is typed. An object whose read fields still do not decode is [`Decoded::Unusable`]: it
//! keeps its name, so its deletion still applies, and the rest of the list goes on.

use std::borrow::Cow;
use std::fmt;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::de::{self, DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};

/// Which fields of an object (or of each element of an array) are kept.
#[derive(Debug)]
pub enum Shape {
    /// The value as it is, whatever it holds.
    Whole,
    /// Only these fields of an object, each with its own shape; other fields are skipped.
    Fields(&'static [(&'static str, Shape)]),
}

use Shape::{Fields, Whole};

/// The metadata every kind keeps: identity, labels (selectors, the proxy-name filter) and the
/// resourceVersion the watcher resumes from.
const META: Shape = Fields(&[
    ("name", Whole),
    ("namespace", Whole),
    ("labels", Whole),
    ("resourceVersion", Whole),
]);

/// A Service: what `kp_core::model::service_ports` reads, and what the manifests source's
/// defaults and create-time validation read.
const SERVICE: Shape = Fields(&[
    ("apiVersion", Whole),
    ("kind", Whole),
    ("metadata", META),
    (
        "spec",
        Fields(&[
            ("type", Whole),
            ("clusterIP", Whole),
            ("clusterIPs", Whole),
            ("ipFamilies", Whole),
            ("ipFamilyPolicy", Whole),
            ("externalIPs", Whole),
            ("loadBalancerIP", Whole),
            ("loadBalancerSourceRanges", Whole),
            ("sessionAffinity", Whole),
            (
                "sessionAffinityConfig",
                Fields(&[("clientIP", Fields(&[("timeoutSeconds", Whole)]))]),
            ),
            ("externalTrafficPolicy", Whole),
            ("internalTrafficPolicy", Whole),
            ("healthCheckNodePort", Whole),
            (
                "ports",
                Fields(&[
                    ("name", Whole),
                    ("protocol", Whole),
                    ("port", Whole),
                    ("nodePort", Whole),
                ]),
            ),
        ]),
    ),
    (
        "status",
        Fields(&[(
            "loadBalancer",
            Fields(&[(
                "ingress",
                Fields(&[("ip", Whole), ("ipMode", Whole), ("hostname", Whole)]),
            )]),
        )]),
    ),
]);

/// An EndpointSlice: what `kp_core::model::slice_endpoints` reads, and the trigger-time
/// annotation behind the network-programming metric.
const ENDPOINT_SLICE: Shape = Fields(&[
    ("apiVersion", Whole),
    ("kind", Whole),
    (
        "metadata",
        Fields(&[
            ("name", Whole),
            ("namespace", Whole),
            ("labels", Whole),
            ("annotations", Whole),
            ("resourceVersion", Whole),
        ]),
    ),
    ("addressType", Whole),
    (
        "ports",
        Fields(&[("name", Whole), ("protocol", Whole), ("port", Whole)]),
    ),
    (
        "endpoints",
        Fields(&[
            ("addresses", Whole),
            (
                "conditions",
                Fields(&[("ready", Whole), ("serving", Whole), ("terminating", Whole)]),
            ),
            ("nodeName", Whole),
            ("zone", Whole),
            (
                "hints",
                Fields(&[
                    ("forZones", Fields(&[("name", Whole)])),
                    ("forNodes", Fields(&[("name", Whole)])),
                ]),
            ),
        ]),
    ),
]);

/// This node's Node: what `kp_core::model::node_info` reads. A taint keeps its `effect`
/// because the type requires it.
const NODE: Shape = Fields(&[
    ("apiVersion", Whole),
    ("kind", Whole),
    (
        "metadata",
        Fields(&[
            ("name", Whole),
            ("labels", Whole),
            ("resourceVersion", Whole),
            ("deletionTimestamp", Whole),
        ]),
    ),
    (
        "spec",
        Fields(&[
            ("podCIDR", Whole),
            ("podCIDRs", Whole),
            ("taints", Fields(&[("key", Whole), ("effect", Whole)])),
        ]),
    ),
    (
        "status",
        Fields(&[("addresses", Fields(&[("type", Whole), ("address", Whole)]))]),
    ),
]);

/// A ServiceCIDR: its ranges.
const SERVICE_CIDR: Shape = Fields(&[
    ("apiVersion", Whole),
    ("kind", Whole),
    ("metadata", META),
    ("spec", Fields(&[("cidrs", Whole)])),
]);

/// A kind the proxy watches, with the fields it reads.
pub trait Watched: Resource<DynamicType = ()> + DeserializeOwned {
    /// The fields kept when decoding.
    const SHAPE: &'static Shape;
}

impl Watched for Service {
    const SHAPE: &'static Shape = &SERVICE;
}

impl Watched for EndpointSlice {
    const SHAPE: &'static Shape = &ENDPOINT_SLICE;
}

impl Watched for Node {
    const SHAPE: &'static Shape = &NODE;
}

impl Watched for ServiceCIDR {
    const SHAPE: &'static Shape = &SERVICE_CIDR;
}

/// One object of kind `K`, decoded by its shape.
// Decoded objects are handed on one at a time, unboxed as the watcher's events carry them.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Decoded<K> {
    /// Every field the proxy reads decoded.
    Usable(K),
    /// A field the proxy reads did not decode.
    Unusable(Unusable),
}

/// An object the proxy cannot use, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Unusable {
    /// What could be read of its metadata (at least its name, when it has one).
    pub meta: ObjectMeta,
    /// The first field that did not decode, and why: `spec.ports[0].port: invalid type: ...`.
    pub problem: String,
}

impl<K: Watched> Decoded<K> {
    /// Decodes `value` (a whole object, or already cut to `K`'s shape) by `K`'s shape.
    pub fn from_value(value: Value) -> Self {
        let kept = match Projection(K::SHAPE).deserialize(value) {
            Ok(kept) => kept,
            // A `Value` always deserializes; keep the error path all the same.
            Err(error) => return Self::unusable(&Value::Null, error.to_string()),
        };
        Self::from_kept(kept)
    }

    /// Types a value already cut to `K`'s shape.
    fn from_kept(kept: Value) -> Self {
        // The metadata is needed in either outcome, and typing consumes the value.
        let meta = kept.get("metadata").cloned().unwrap_or(Value::Null);
        match serde_path_to_error::deserialize::<_, K>(kept) {
            Ok(object) => Decoded::Usable(object),
            Err(error) => {
                let path = error.path().to_string();
                Self::unusable(&meta, format!("{path}: {}", error.into_inner()))
            }
        }
    }

    fn unusable(meta: &Value, problem: String) -> Self {
        Decoded::Unusable(Unusable {
            meta: readable_meta(meta),
            problem: one_line(&problem),
        })
    }
}

/// The metadata as typed, or, when that fails too, its name, namespace and resourceVersion.
fn readable_meta(meta: &Value) -> ObjectMeta {
    if let Ok(typed) = ObjectMeta::deserialize(meta) {
        return typed;
    }
    let text = |field: &str| meta.get(field).and_then(Value::as_str).map(str::to_owned);
    ObjectMeta {
        name: text("name"),
        namespace: text("namespace"),
        resource_version: text("resourceVersion"),
        ..ObjectMeta::default()
    }
}

/// Longest problem text kept: a message can quote a value, and a log line stays short.
const PROBLEM_MAX: usize = 200;

/// `text` on one line and at most [`PROBLEM_MAX`] characters.
pub(crate) fn one_line(text: &str) -> String {
    let mut line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(PROBLEM_MAX)
        .collect();
    if text.chars().count() > PROBLEM_MAX {
        line.push('…');
    }
    line
}

impl<'de, K: Watched> Deserialize<'de> for Decoded<K> {
    /// Never fails for well-formed JSON: a value that does not type is `Unusable`.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let kept = Projection(K::SHAPE).deserialize(deserializer)?;
        Ok(Self::from_kept(kept))
    }
}

impl<K: Watched> Resource for Decoded<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        match self {
            Decoded::Usable(object) => object.meta(),
            Decoded::Unusable(unusable) => &unusable.meta,
        }
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Decoded::Usable(object) => object.meta_mut(),
            Decoded::Unusable(unusable) => &mut unusable.meta,
        }
    }
}

/// Reads a value keeping only what a [`Shape`] names; skipped values are never built.
#[derive(Clone, Copy)]
struct Projection(&'static Shape);

impl<'de> DeserializeSeed<'de> for Projection {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        match self.0 {
            Whole => Value::deserialize(deserializer),
            Fields(_) => deserializer.deserialize_any(self),
        }
    }
}

impl<'de> de::Visitor<'de> for Projection {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let Fields(fields) = self.0 else {
            return Value::deserialize(de::value::MapAccessDeserializer::new(map));
        };
        let mut kept = Map::new();
        while let Some(field) = map.next_key_seed(FieldName(fields))? {
            match field {
                Some((name, shape)) => {
                    let value = map.next_value_seed(Projection(shape))?;
                    kept.insert((*name).to_owned(), value);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Value::Object(kept))
    }

    /// An array of objects: each element keeps the same fields.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut kept = Vec::new();
        while let Some(value) = seq.next_element_seed(self)? {
            kept.push(value);
        }
        Ok(Value::Array(kept))
    }

    // Scalars where an object was expected are kept as they are: typing then names the field.
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }
}

/// Reads a field name and finds it among the kept fields, without copying it.
struct FieldName(&'static [(&'static str, Shape)]);

impl<'de> DeserializeSeed<'de> for FieldName {
    type Value = Option<&'static (&'static str, Shape)>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl de::Visitor<'_> for FieldName {
    type Value = Option<&'static (&'static str, Shape)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.iter().find(|(name, _)| *name == v))
    }
}

#[cfg(test)]
mod tests;
