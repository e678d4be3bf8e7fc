//! What both platforms' backends ([`crate::backend`] on Linux, [`crate::winuserspace`]) take
//! from a sync's state the same way.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort, ServicePortName};
use kp_core::topology::categorize;
use kp_core::tracker::ProxyState;

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

/// Whether `name` is an SCTP port, which the relay cannot serve; says so once per port.
pub(crate) fn skip_sctp(
    warned: &mut BTreeSet<ServicePortName>,
    name: &ServicePortName,
    mode: &str,
) -> bool {
    if name.protocol != Protocol::Sctp {
        return false;
    }
    if warned.insert(name.clone()) {
        tracing::warn!(service = %name, "{mode} relays TCP and UDP only; SCTP port not served (not supported)");
    }
    true
}

/// A service port's endpoints under its two traffic policies.
pub(crate) struct PolicyEndpoints<'a> {
    /// For ClusterIP traffic (internal traffic policy).
    pub(crate) internal: Vec<&'a Endpoint>,
    /// For NodePort, externalIP and LoadBalancer IP traffic (external traffic policy).
    pub(crate) external: Vec<&'a Endpoint>,
    /// Whether any endpoint is usable anywhere (none: reject rather than drop).
    pub(crate) any: bool,
}

/// `svc`'s endpoints in `state`, chosen by its traffic policies as the kernel modes choose.
pub(crate) fn policy_endpoints<'a>(
    svc: &ServicePort,
    state: &'a ProxyState,
) -> PolicyEndpoints<'a> {
    let endpoints = state
        .endpoints
        .get(&svc.name)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let categories = categorize(svc, endpoints, &state.node);
    let pick = |local: bool| {
        if local {
            categories.local.clone()
        } else {
            categories.cluster.clone()
        }
    };
    PolicyEndpoints {
        internal: pick(svc.internal_policy_local),
        external: pick(svc.external_policy_local),
        any: categories.has_any_endpoints,
    }
}
