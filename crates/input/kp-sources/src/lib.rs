//! Sources of Kubernetes objects, each turning them into [`kp_core::event::SourceEvent`]s.
//!
//! - [`api`]: the API server, through kube-rs watchers (Services, EndpointSlices, this Node).
//! - [`events`]: Events about this node's Node, posted to the API server as upstream does.
//! - [`decoded`]: objects decoded by the fields the proxy reads, so an odd value in any other
//!   field never loses an object, and an object that cannot be used loses only itself.
//! - [`manifests`]: a local file or directory of YAML/JSON manifests, re-read when it changes
//!   (in place, by atomic rename, or by a ConfigMap volume's symlink swap).
//! - [`node`]: the start-up wait for this node's Node object and its IPs.
//! - [`defaults`]: the defaults the API server would apply, so hand-written manifests yield
//!   the same model as objects read from a cluster.
//! - [`strict`]: the API server's create-time address validation, which manifests (new
//!   objects no API server has seen) go through.

pub mod api;
pub mod decoded;
pub mod defaults;
pub mod events;
pub mod manifests;
pub mod node;
pub mod strict;

/// An object of kind `K` with only the metadata that identifies it: what both sources'
/// deletions carry (every consumer of a deletion looks only at namespace and name).
pub(crate) fn identity<K: kube::Resource + Default>(namespace: Option<String>, name: String) -> K {
    let mut object = K::default();
    let meta = object.meta_mut();
    meta.namespace = namespace;
    meta.name = Some(name);
    object
}
