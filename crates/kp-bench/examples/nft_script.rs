//! Print the nftables full-sync script for N services × M endpoints (investigation aid).
use std::collections::BTreeSet;

use kp_bench::generate::{Scale, generate};
use kp_bench::state::Loaded;
use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
use kp_rules::nftables::{NftScope, NftState, RenderConfig, render};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let services: usize = args.next().unwrap_or_else(|| "1000".into()).parse()?;
    let endpoints: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let loaded = Loaded::new(&generate(Scale::new(services, endpoints)))?;
    let existing = NftState::default();
    let started = std::time::Instant::now();
    let out = render(
        &loaded.state,
        IpFamily::V4,
        &RenderConfig::default(),
        &NftScope {
            kind: SyncKind::Full,
            changed: &BTreeSet::new(),
            existing: &existing,
            delete_stale: false,
            service_cidrs: &[],
        },
    )?;
    eprintln!("full render: {:?}", started.elapsed());
    let changed = loaded
        .state
        .services
        .keys()
        .next()
        .map(|name| BTreeSet::from([name.service.clone()]))
        .unwrap_or_default();
    let started = std::time::Instant::now();
    let partial = render(
        &loaded.state,
        IpFamily::V4,
        &RenderConfig::default(),
        &NftScope {
            kind: SyncKind::Partial,
            changed: &changed,
            existing: &out.state,
            delete_stale: false,
            service_cidrs: &[],
        },
    )?;
    eprintln!(
        "one-service partial render: {:?} ({} operations)",
        started.elapsed(),
        partial.operations
    );
    print!("{}", out.script);
    Ok(())
}
