//! Userspace mode: a relay on tokio that accepts service traffic on local ports and copies it
//! to a backend, and the capture that steers service traffic to those ports.
//!
//! - [`balancer`]: round robin and sessionAffinity ClientIP, without I/O.
//! - [`relay`]: frontends (one listening TCP or UDP socket each), endpoint updates, TCP
//!   connections with retries on the next endpoint, UDP sessions with an idle timeout,
//!   per-frontend caps. Portable: nothing here is Linux-specific, so `winuserspace` would be
//!   this relay with another capture.
//! - [`config`], [`metrics`]: tunables with their defaults, and the relay's metrics.

pub mod balancer;
pub mod config;
pub mod metrics;
pub mod relay;
mod tcp;
mod udp;

pub use config::RelayConfig;
pub use metrics::RelayMetrics;
pub use relay::{Relay, Transport};
