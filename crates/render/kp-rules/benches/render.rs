//! The pure iptables render at scale: full renders of 1,000 and 10,000 services × 10
//! endpoints, and the partial render of one changed service among 10,000 × 10.
//!
//! The state has the shape `kp-scale` (tools/kp-bench) generates as manifests: ClusterIP
//! services, a third of them NodePort, every 10th UDP, every 5th with a second port, every
//! 50th endpoint on this node. It is built from model types directly so the benchmark
//! measures the renderer only. Run with `cargo bench -p kp-rules --bench render`
//! (`-- --quick` for a short run).

#![allow(missing_docs)]

use std::collections::BTreeSet;
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};

use criterion::{Criterion, criterion_group, criterion_main};
use kp_core::backend::SyncKind;
use kp_core::model::{
    Endpoint, IpFamily, NodeInfo, Protocol, ServiceName, ServicePort, ServicePortName,
};
use kp_core::tracker::ProxyState;
use kp_rules::iptables::{RenderConfig, RenderOutput, SyncScope, render};

const NODE: &str = "bench-node";

fn v4(base: [u8; 4], offset: usize) -> IpAddr {
    let offset = u32::try_from(offset).expect("small offset");
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::from(base)) + offset))
}

/// `services` × `endpoints` in the generator's shape.
fn state(services: usize, endpoints: usize) -> ProxyState {
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
            namespace: format!("bench-{}", i % 10),
            name: format!("svc-{i:05}"),
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
                port: port_name.to_owned(),
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

fn full(state: &ProxyState, config: &RenderConfig) -> RenderOutput {
    let (changed, existing) = (BTreeSet::new(), BTreeSet::new());
    render(
        state,
        IpFamily::V4,
        config,
        &SyncScope {
            kind: SyncKind::Full,
            changed: &changed,
            existing_chains: &existing,
        },
    )
    .expect("valid config")
}

fn bench_full(c: &mut Criterion) {
    let config = RenderConfig::default();
    let mut group = c.benchmark_group("iptables_render_full");
    group.sample_size(10);
    for services in [1_000, 10_000] {
        let state = state(services, 10);
        group.bench_function(format!("{services}x10"), |b| {
            b.iter(|| black_box(full(black_box(&state), &config)))
        });
    }
    group.finish();
}

fn bench_partial(c: &mut Criterion) {
    let config = RenderConfig::default();
    let mut state = state(10_000, 10);
    let previous = full(&state, &config);
    // One endpoint of one service moves, as after one EndpointSlice update.
    let moved = state
        .endpoints
        .values_mut()
        .next()
        .and_then(|list| list.last_mut())
        .expect("endpoints");
    moved.ip = v4([10, 64, 0, 1], 0);
    let changed: BTreeSet<ServiceName> = state
        .services
        .keys()
        .next()
        .map(|k| k.service.clone())
        .into_iter()
        .collect();
    let mut group = c.benchmark_group("iptables_render_partial");
    group.sample_size(10);
    group.bench_function("one_service_of_10000x10", |b| {
        b.iter(|| {
            black_box(
                render(
                    black_box(&state),
                    IpFamily::V4,
                    &config,
                    &SyncScope {
                        kind: SyncKind::Partial,
                        changed: &changed,
                        existing_chains: &previous.chains,
                    },
                )
                .expect("valid config"),
            )
        })
    });
    group.finish();
}

criterion_group!(benches, bench_full, bench_partial);
criterion_main!(benches);
