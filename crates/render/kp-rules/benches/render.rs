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

use criterion::{Criterion, criterion_group, criterion_main};
use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
use kp_core::tracker::ProxyState;
use kp_rules::iptables::{RenderConfig, RenderOutput, SyncScope, render};

mod shape;
use shape::{move_one_endpoint, state};

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
    let changed = move_one_endpoint(&mut state);
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
