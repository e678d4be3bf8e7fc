//! The pure nftables render at scale: the full render of 10,000 services × 10 endpoints (the
//! transaction of a first sync, and its text for `nft -f`), and the partial render of one
//! changed service among them with the update of the installed state it carries.
//!
//! Same state shape as the iptables benchmark (`benches/shape`). Run with `cargo bench -p
//! kp-rules --bench nft_render` (`-- --quick` for a short run).

#![allow(missing_docs)]

use std::collections::BTreeSet;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, ServiceName};
use kp_core::tracker::ProxyState;
use kp_rules::nftables::{NftOutput, NftScope, NftState, RenderConfig, render};

mod shape;
use shape::{move_one_endpoint, state};

fn run(
    state: &ProxyState,
    kind: SyncKind,
    changed: &BTreeSet<ServiceName>,
    existing: &NftState,
) -> NftOutput {
    render(
        state,
        IpFamily::V4,
        &RenderConfig::default(),
        &NftScope {
            kind,
            changed,
            existing,
            delete_stale: false,
            service_cidrs: &[],
        },
    )
    .expect("valid config")
}

fn bench_full(c: &mut Criterion) {
    let state = state(10_000, 10);
    let (changed, empty) = (BTreeSet::new(), NftState::default());
    let mut group = c.benchmark_group("nft_render_full");
    group.sample_size(10);
    group.bench_function("10000x10", |b| {
        b.iter(|| black_box(run(black_box(&state), SyncKind::Full, &changed, &empty)))
    });
    group.bench_function("10000x10_text", |b| {
        b.iter(|| {
            let out = run(black_box(&state), SyncKind::Full, &changed, &empty);
            black_box(out.script().len())
        })
    });
    group.finish();
}

fn bench_partial(c: &mut Criterion) {
    let mut state = state(10_000, 10);
    let (none, empty) = (BTreeSet::new(), NftState::default());
    let first = run(&state, SyncKind::Full, &none, &empty);
    let mut installed = empty;
    first.update.apply(&mut installed);
    let changed = move_one_endpoint(&mut state);
    let mut group = c.benchmark_group("nft_render_partial");
    group.sample_size(10);
    group.bench_function("one_service_of_10000x10", |b| {
        b.iter(|| {
            black_box(run(
                black_box(&state),
                SyncKind::Partial,
                &changed,
                &installed,
            ))
        })
    });
    // Render, then apply the update to the installed state (undone by applying the reverse
    // partial, so each iteration starts from the same state).
    group.bench_function("one_service_of_10000x10_with_update", |b| {
        b.iter(|| {
            let out = run(black_box(&state), SyncKind::Partial, &changed, &installed);
            let text = out.operations;
            let mut after = NftState::default();
            std::mem::swap(&mut after, &mut installed);
            out.update.apply(&mut after);
            std::mem::swap(&mut after, &mut installed);
            black_box(text)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_full, bench_partial);
criterion_main!(benches);
