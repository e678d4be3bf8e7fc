//! Userspace mode: a relay on tokio that accepts service traffic on local ports and copies it
//! to a backend, and the capture that steers service traffic to those ports.
//!
//! - [`balancer`]: round robin and sessionAffinity ClientIP (one table per service port,
//!   shared by its frontends), without I/O; [`pins`]: the tables by service port, for
//!   metrics and `/debug/explain`.
//! - [`relay`]: frontends (one listening TCP or UDP socket each), endpoint updates, TCP
//!   connections with retries on the next endpoint, UDP sessions with an idle timeout,
//!   per-service caps. Portable: both backends run this one relay.
//! - [`config`], [`metrics`]: tunables with their defaults, and the relay's metrics.
//! - [`capture`]: the trait that steers service traffic to the relay, and a fake.
//! - `backend` (Linux only): userspace mode as a `kp_core` backend (frontends per service
//!   port, family and traffic scope; endpoints by traffic policy; capture rewritten each
//!   sync).
//! - [`winuserspace`]: the same relay as Windows runs it, with no capture: portals listening
//!   on the service addresses themselves, which [`addresses`] puts on a host interface
//!   (reference counted, bounded wait) through an [`AddressHost`] (the IP Helper API in
//!   `kp-winaddr`, a fake in tests). Portable, so its logic is tested on Linux.
//! - [`localhost`]: nftables mode's localhost NodePorts (KEP-6032): the relay listening on
//!   `127.0.0.1` / `::1` at each TCP NodePort. Portable.
//! - `iptables` (Linux only): capture with iptables `REDIRECT` rules from
//!   `kp_rules::userspace`, applied through kp-dataplane's exec layer.

pub mod addresses;
#[cfg(target_os = "linux")]
pub mod backend;
pub mod balancer;
mod bind;
pub mod capture;
pub mod config;
#[cfg(target_os = "linux")]
pub mod iptables;
pub mod localhost;
pub mod metrics;
pub mod pins;
pub mod relay;
mod shared;
mod source;
#[cfg(target_os = "linux")]
mod splice;
mod tcp;
mod udp;
pub mod winuserspace;

pub use addresses::{AddressError, AddressHost, RecordingHost, ServiceAddresses};
#[cfg(any(test, feature = "test-util"))]
pub use addresses::{FakeAddressHost, FakeFault};
#[cfg(target_os = "linux")]
pub use backend::{FrontendKey, Scope, UserspaceBackend};
#[cfg(any(test, feature = "test-util"))]
pub use capture::FakeCapture;
pub use capture::{Capture, CapturePlan};
pub use config::RelayConfig;
pub use localhost::{Listener, LocalhostMetrics, LocalhostNodePorts};
pub use metrics::RelayMetrics;
pub use pins::{AffinityTables, PinLookup};
pub use relay::{Owner, Relay, Transport};
pub use shared::service_port_label;
pub use winuserspace::{Portal, PortalKind, WinBackend};
