//! What both platforms' backends ([`crate::backend`] on Linux, [`crate::winuserspace`]) take
//! from a sync's state the same way.

use std::net::SocketAddr;

use kp_core::model::{Endpoint, IpFamily, ServicePortName};

/// The name a service port's affinity table goes by (metrics, `/debug/explain`):
/// `namespace/name:port/protocol`.
pub fn service_port_label(name: &ServicePortName) -> String {
    format!("{name}/{}", name.protocol.as_str())
}

/// The endpoints of `family` in `list`, as socket addresses.
pub(crate) fn endpoint_addresses(list: &[&Endpoint], family: IpFamily) -> Vec<SocketAddr> {
    list.iter()
        .filter(|e| IpFamily::of(&e.ip) == family)
        .map(|e| SocketAddr::new(e.ip, e.port))
        .collect()
}
