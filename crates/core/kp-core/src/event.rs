//! What sources tell the core: Kubernetes objects applied, deleted, and "initial list done".
//!
//! Both sources (the API server and manifests files) speak this vocabulary and must produce
//! identical objects for identical input: the manifests source applies the API server's
//! defaults before sending.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

/// One change reported by a source.
// Each event is moved once through a channel; boxing the objects would add an allocation per
// event to save a few hundred bytes of channel slot.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum SourceEvent {
    /// A Service changed.
    Service(ObjectEvent<Service>),
    /// An EndpointSlice changed.
    EndpointSlice(ObjectEvent<EndpointSlice>),
    /// This node's Node object changed.
    Node(ObjectEvent<Node>),
    /// A ServiceCIDR changed (cluster-wide; clusters without the API never send these).
    ServiceCidr(ObjectEvent<ServiceCIDR>),
    /// Changes that belong together, such as the objects of one manifests file: the proxier
    /// records them all before it may sync, so no sync programs half of them (a Service
    /// without the EndpointSlice written next to it, which would refuse connections until
    /// the next sync).
    Batch(Vec<SourceEvent>),
}

/// A change to one kind of object.
#[derive(Clone, Debug, PartialEq)]
pub enum ObjectEvent<K> {
    /// The object was created or updated; it carries the whole new object.
    Applied(K),
    /// The object was deleted; it carries the last known state (at least namespace and name).
    Deleted(K),
    /// The source has delivered every object of this kind that existed when it started (or
    /// relisted). Nothing is programmed before Services and EndpointSlices are both synced.
    Synced,
}
