//! Builders for proxy states in tests (also used by the kernel tests via `#[path]`).

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_core::backend::{SyncKind, SyncRequest};
use kp_core::model::{Endpoint, NodeInfo, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;

pub const NODE: &str = "test-node";

pub fn ip(text: &str) -> IpAddr {
    text.parse().expect("test literal IP")
}

pub fn service_name(ns: &str, name: &str) -> ServiceName {
    ServiceName {
        namespace: ns.into(),
        name: name.into(),
    }
}

pub fn port_name(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName {
        service: service_name(ns, name),
        port: port.into(),
        protocol,
    }
}

/// A ClusterIP service port `ns/name:p`.
pub fn service(
    ns: &str,
    name: &str,
    protocol: Protocol,
    cluster_ip: &str,
    port: u16,
) -> ServicePort {
    ServicePort {
        name: port_name(ns, name, "p", protocol),
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

/// A ready endpoint on another node.
pub fn endpoint(address: &str, port: u16) -> Endpoint {
    Endpoint {
        ip: ip(address),
        port,
        ready: true,
        serving: true,
        terminating: false,
        node_name: Some("other-node".into()),
        zone: None,
        zone_hints: None,
        node_hints: None,
        is_local: false,
    }
}

pub fn node() -> NodeInfo {
    NodeInfo {
        name: NODE.into(),
        addresses: vec![ip("192.168.0.2")],
        eligible: true,
        known: true,
        ..NodeInfo::default()
    }
}

pub fn state(items: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    let mut state = ProxyState {
        node: node(),
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

/// TCP services `ns/a` (10.96.0.1:80 -> 10.244.1.1:8080) and `ns/b` (10.96.0.2:80 ->
/// 10.244.1.2:8080), one endpoint each.
pub fn two_services() -> ProxyState {
    state(vec![
        (
            service("ns", "a", Protocol::Tcp, "10.96.0.1", 80),
            vec![endpoint("10.244.1.1", 8080)],
        ),
        (
            service("ns", "b", Protocol::Tcp, "10.96.0.2", 80),
            vec![endpoint("10.244.1.2", 8080)],
        ),
    ])
}

pub fn request<'a>(
    state: &'a ProxyState,
    kind: SyncKind,
    changed: &'a BTreeSet<ServiceName>,
    conntrack: bool,
) -> SyncRequest<'a> {
    SyncRequest {
        state,
        kind,
        changed,
        conntrack_cleanup_required: conntrack,
    }
}

/// Run an async test body on a fresh current-thread runtime.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(future)
}
