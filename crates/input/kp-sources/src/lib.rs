//! Sources of Kubernetes objects, each turning them into [`kp_core::event::SourceEvent`]s.
//!
//! - [`api`]: the API server, through kube-rs watchers (Services, EndpointSlices, this Node).
//! - [`manifests`]: a local file or directory of YAML/JSON manifests, re-read when it changes
//!   (in place, by atomic rename, or by a ConfigMap volume's symlink swap).
//! - [`node`]: the start-up wait for this node's Node object and its IPs.
//! - [`defaults`]: the defaults the API server would apply, so hand-written manifests yield
//!   the same model as objects read from a cluster.
//! - [`strict`]: the API server's create-time address validation, which manifests (new
//!   objects no API server has seen) go through.

pub mod api;
pub mod defaults;
pub mod manifests;
pub mod node;
pub mod strict;
