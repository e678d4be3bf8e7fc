//! Builders of model values for tests, shared by every crate's tests through the `test-util`
//! feature (`kp-core = { workspace = true, features = ["test-util"] }` in
//! `[dev-dependencies]`), so renderer, backend and relay tests build their states one way.
//!
//! The values follow upstream's test conventions: this node is [`NODE`] at 192.168.0.2,
//! endpoints on other nodes are on `other-node`. [`strategies`] holds the proptest pieces the
//! property tests share.

use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

use crate::model::{
    Endpoint, NodeInfo, Protocol, ServiceName, ServicePort, ServicePortName, SessionAffinity,
};
use crate::tracker::ProxyState;

pub mod strategies;

/// The name of the node the proxy under test runs on.
pub const NODE: &str = "test-node";

/// The node endpoints that are not local run on.
pub const OTHER_NODE: &str = "other-node";

/// A literal address; panics (in a test) if it is not one.
pub fn ip(text: &str) -> IpAddr {
    text.parse().expect("test literal IP")
}

/// A literal CIDR; panics (in a test) if it is not one.
pub fn net(text: &str) -> IpNet {
    text.parse().expect("test literal CIDR")
}

/// The ServiceName `ns/name`.
pub fn service_name(ns: &str, name: &str) -> ServiceName {
    ServiceName {
        namespace: ns.into(),
        name: name.into(),
    }
}

/// The service port name `ns/name:port` of `protocol`.
pub fn port_name(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName {
        service: service_name(ns, name),
        port: port.into(),
        protocol,
    }
}

/// A ClusterIP service port with no external exposure and no policies.
pub fn cluster_ip_port(name: ServicePortName, cluster_ip: &str, port: u16) -> ServicePort {
    ServicePort {
        name,
        cluster_ips: vec![ip(cluster_ip)],
        port,
        node_port: None,
        external_ips: vec![],
        load_balancer_ips: vec![],
        load_balancer_source_ranges: vec![],
        session_affinity: None,
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: None,
    }
}

/// A ready, serving endpoint: on [`NODE`] when `local`, else on [`OTHER_NODE`].
pub fn endpoint(address: &str, port: u16, local: bool) -> Endpoint {
    endpoint_at(ip(address), port, local)
}

/// [`endpoint`] of an address already parsed.
pub fn endpoint_at(ip: IpAddr, port: u16, local: bool) -> Endpoint {
    Endpoint {
        ip,
        port,
        ready: true,
        serving: true,
        terminating: false,
        node_name: Some(if local { NODE } else { OTHER_NODE }.into()),
        zone: None,
        zone_hints: None,
        node_hints: None,
        is_local: local,
    }
}

/// This node ([`NODE`]), known and eligible, with `addresses`.
pub fn node_with(addresses: &[&str]) -> NodeInfo {
    NodeInfo {
        name: NODE.into(),
        addresses: addresses.iter().map(|a| ip(a)).collect(),
        eligible: true,
        known: true,
        ..NodeInfo::default()
    }
}

/// A state on `node` holding `items` (service ports and their endpoints; an empty list
/// records no endpoints, as the tracker does).
pub fn state_on(node: NodeInfo, items: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    let mut state = ProxyState {
        node,
        ..ProxyState::default()
    };
    for (svc, endpoints) in items {
        if !endpoints.is_empty() {
            state.endpoints.insert(svc.name.clone(), endpoints);
        }
        state.services.insert(svc.name.clone(), svc);
    }
    state
}

/// The names of a generated service port: namespace, name, port name, protocol.
pub type PortNames = (String, String, String, Protocol);

/// How a generated service port is exposed: node port, externalIPs, load-balancer IPs,
/// `loadBalancerSourceRanges`.
pub type Exposure = (Option<u16>, Vec<IpAddr>, Vec<IpAddr>, Vec<IpNet>);

/// A generated service port's policies: ClientIP affinity timeout in seconds,
/// `[externalTrafficPolicy Local, internalTrafficPolicy Local]`, health-check node port.
pub type Policies = (Option<u64>, [bool; 2], Option<u16>);

/// A service port from generated parts (the shape property tests draw them in).
pub fn service_port(
    (namespace, name, port_name, protocol): PortNames,
    cluster_ips: Vec<IpAddr>,
    port: u16,
    (node_port, external_ips, load_balancer_ips, ranges): Exposure,
    (affinity, [etp_local, itp_local], health_check_node_port): Policies,
) -> ServicePort {
    ServicePort {
        name: ServicePortName {
            service: ServiceName {
                namespace: namespace.into(),
                name: name.into(),
            },
            port: port_name.into(),
            protocol,
        },
        cluster_ips,
        port,
        node_port,
        external_ips,
        load_balancer_ips,
        load_balancer_source_ranges: ranges,
        session_affinity: affinity.map(|s| SessionAffinity {
            timeout: Duration::from_secs(s),
        }),
        external_policy_local: etp_local,
        internal_policy_local: itp_local,
        health_check_node_port,
    }
}
