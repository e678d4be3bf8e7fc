//! Per-family views shared by the renderers: each IP family is programmed separately, as
//! upstream runs one proxier per family.

use std::borrow::Cow;
use std::net::IpAddr;

use kp_core::model::{Endpoint, IpFamily, ServicePort};

/// The service port as seen by one family with its ClusterIP of that family, or `None` when it
/// has none. Port numbers of 0 mean "not allocated" and are dropped, so no rule ever names
/// port 0.
pub(crate) fn for_family(svc: &ServicePort, family: IpFamily) -> Option<(IpAddr, ServicePort)> {
    let mut port = svc.for_family(family)?;
    let cluster_ip = port.cluster_ips.first().copied()?;
    port.node_port = port.node_port.filter(|p| *p != 0);
    port.health_check_node_port = port.health_check_node_port.filter(|p| *p != 0);
    Some((cluster_ip, port))
}

/// The endpoints of `family`, borrowed when none need filtering out.
pub(crate) fn family_endpoints(endpoints: &[Endpoint], family: IpFamily) -> Cow<'_, [Endpoint]> {
    if endpoints.iter().all(|ep| IpFamily::of(&ep.ip) == family) {
        Cow::Borrowed(endpoints)
    } else {
        Cow::Owned(
            endpoints
                .iter()
                .filter(|ep| IpFamily::of(&ep.ip) == family)
                .cloned()
                .collect(),
        )
    }
}
