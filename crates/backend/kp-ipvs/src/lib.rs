//! IPVS for kube-proxy's ipvs mode, over the kernel's generic netlink family `IPVS`.
//!
//! - [`codec`]: sans-I/O request encoding and reply decoding (golden-byte tested).
//! - [`Ipvs`]: the operations a backend needs, implemented by [`NetlinkIpvs`] (a blocking
//!   netlink socket) and, with the `test-util` feature, `FakeIpvs` (an in-memory table
//!   that behaves like the kernel's, for tests of the sync logic).

pub mod codec;
#[cfg(any(test, feature = "test-util"))]
mod fake;
#[cfg(target_os = "linux")]
mod socket;
mod types;

#[cfg(any(test, feature = "test-util"))]
pub use fake::{FakeIpvs, Op};
#[cfg(target_os = "linux")]
pub use socket::NetlinkIpvs;
pub use types::*;

/// Why an IPVS operation failed.
#[derive(Debug, thiserror::Error)]
pub enum IpvsError {
    /// The kernel has no IPVS (module `ip_vs` missing or not loadable): the mode cannot run.
    #[error("IPVS is not available in this kernel: {0}")]
    Unavailable(String),
    /// The kernel refused a request.
    #[error("IPVS {op} failed")]
    Kernel {
        /// What was asked, for example `add service 10.0.0.1:80/TCP`.
        op: String,
        /// The errno as an I/O error.
        source: std::io::Error,
    },
    /// Talking to the netlink socket failed.
    #[error("netlink socket: {0}")]
    Socket(std::io::Error),
    /// The kernel's reply could not be decoded.
    #[error("cannot decode the kernel's IPVS reply: {0}")]
    Decode(String),
}

impl IpvsError {
    /// The errno behind a [`IpvsError::Kernel`] failure.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Kernel { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// The IPVS operations kube-proxy's ipvs mode needs.
pub trait Ipvs: Send {
    /// Every virtual server kube-proxy could have made (firewall-mark services are left out).
    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError>;
    /// Creates a virtual server.
    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError>;
    /// Changes scheduler, flags or timeout of an existing one (its connections stay).
    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError>;
    /// Deletes a virtual server and its real servers.
    fn delete_service(&mut self, key: &ServiceKey) -> Result<(), IpvsError>;
    /// The real servers of one virtual server.
    fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<ListedRealServer>, IpvsError>;
    /// Adds a real server.
    fn add_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError>;
    /// Changes a real server's weight in place.
    fn update_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError>;
    /// Removes a real server.
    fn delete_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError>;
    /// The connection timeouts.
    fn timeouts(&mut self) -> Result<Timeouts, IpvsError>;
    /// Sets the non-zero timeouts.
    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError>;
    /// Removes every virtual server.
    fn flush(&mut self) -> Result<(), IpvsError>;
}
