//! What both platforms' backends ([`crate::backend`] on Linux, [`crate::winuserspace`]) take
//! from a sync's state the same way.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;
use kp_rules::plan::{Masquerading, ServicePlan};

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

/// `svc`'s plan in `state` (every family's endpoints; the relay picks a family's with
/// [`endpoint_addresses`]): its traffic policies' endpoint lists (`plan.list(plan.internal
/// .list)`, `plan.list(plan.external.list)`) as the kernel modes choose them, and whether any
/// endpoint is usable anywhere (`plan.has_endpoints`; none: reject rather than drop), and
/// with `node_ip` (this node's IP of one family) whether the node's own traffic passes that
/// family's source ranges (`plan.allow_from_node`).
pub(crate) fn service_plan<'a>(
    svc: &ServicePort,
    state: &'a ProxyState,
    node_ip: Option<IpAddr>,
) -> ServicePlan<'a> {
    let endpoints = state
        .endpoints
        .get(&svc.name)
        .map(Vec::as_slice)
        .unwrap_or_default();
    // The relay masquerades nothing: `Masquerading` does not matter here.
    ServicePlan::new(
        svc,
        endpoints,
        &state.node,
        node_ip,
        Masquerading::default(),
    )
}
