//! The state both render benchmarks use: the shape `kp-scale` (tools/kp-bench) generates as
//! manifests, built from model types directly so the benchmarks measure the renderers only.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use kp_core::model::{Endpoint, NodeInfo, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;

pub const NODE: &str = "bench-node";

pub fn v4(base: [u8; 4], offset: usize) -> IpAddr {
    let offset = u32::try_from(offset).expect("small offset");
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::from(base)) + offset))
}

/// `services` × `endpoints` in the generator's shape.
pub fn state(services: usize, endpoints: usize) -> ProxyState {
    let mut state = ProxyState {
        node: NodeInfo {
            name: NODE.to_owned(),
            eligible: true,
            known: true,
            ..NodeInfo::default()
        },
        ..ProxyState::default()
    };
    let mut node_port = 30000u16;
    for i in 0..services {
        let service = ServiceName {
            namespace: format!("bench-{}", i % 10).into(),
            name: format!("svc-{i:05}").into(),
        };
        let mut ports = vec![if i % 10 == 9 {
            ("dns", Protocol::Udp, 53, 5353)
        } else {
            ("http", Protocol::Tcp, 80, 8080)
        }];
        if i % 5 == 0 {
            ports.push(("metrics", Protocol::Tcp, 9090, 9090));
        }
        for (port_name, protocol, port, target) in ports {
            let name = ServicePortName {
                service: service.clone(),
                port: port_name.into(),
                protocol,
            };
            let node_port = (i % 3 == 0).then(|| {
                node_port = node_port.wrapping_add(1);
                node_port
            });
            state.services.insert(
                name.clone(),
                ServicePort {
                    name: name.clone(),
                    cluster_ips: vec![v4([10, 96, 0, 16], i)],
                    port,
                    node_port,
                    external_ips: Vec::new(),
                    load_balancer_ips: Vec::new(),
                    load_balancer_source_ranges: Vec::new(),
                    session_affinity: None,
                    external_policy_local: false,
                    internal_policy_local: false,
                    health_check_node_port: None,
                },
            );
            let list = (0..endpoints)
                .map(|j| {
                    let global = i * endpoints + j;
                    let local = global.is_multiple_of(50);
                    Endpoint {
                        ip: v4([10, 128, 0, 1], global),
                        port: target,
                        ready: true,
                        serving: true,
                        terminating: false,
                        node_name: Some(
                            if local {
                                NODE.to_owned()
                            } else {
                                format!("node-{:02}", global % 50)
                            }
                            .into(),
                        ),
                        zone: None,
                        zone_hints: None,
                        node_hints: None,
                        is_local: local,
                    }
                })
                .collect();
            state.endpoints.insert(name, list);
        }
    }
    state
}

/// Moves one endpoint of the first service, as one EndpointSlice update does, and returns
/// that service: the changed set of a one-service partial sync.
pub fn move_one_endpoint(state: &mut ProxyState) -> BTreeSet<ServiceName> {
    let moved = state
        .endpoints
        .values_mut()
        .next()
        .and_then(|list| list.last_mut())
        .expect("endpoints");
    moved.ip = v4([10, 64, 0, 1], 0);
    state
        .services
        .keys()
        .next()
        .map(|k| k.service.clone())
        .into_iter()
        .collect()
}
