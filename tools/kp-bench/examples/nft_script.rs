//! Print the nftables full-sync script (v4) for N services × M endpoints, and on stderr how
//! long its render and a one-service partial render against it took. An investigation aid:
//! `cargo run --release -p kp-bench --example nft_script -- 10000 10 > s.nft`, then time
//! `nft -f s.nft` in a throwaway network namespace.
//!
//! With a third argument `apply`, the full sync is applied over netlink instead (in the
//! current network namespace: run it under `ip netns exec`), as the proxy sends it, and the
//! time it took is printed; `apply 0` sends it as one transaction instead of steps.

use std::collections::BTreeSet;
use std::time::Instant;

use kp_bench::generate::{Scale, generate};
use kp_bench::state::Loaded;
use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, ServiceName};
use kp_rules::nftables::{NftOutput, NftScope, NftState, RenderConfig, RenderError, render};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let services: usize = args.next().unwrap_or_else(|| "1000".into()).parse()?;
    let endpoints: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let loaded = Loaded::new(&generate(Scale::new(services, endpoints)))?;
    let timed = |kind: SyncKind,
                 changed: &BTreeSet<ServiceName>,
                 existing: &NftState|
     -> Result<NftOutput, RenderError> {
        let started = Instant::now();
        let scope = NftScope {
            kind,
            changed,
            existing,
            delete_stale: false,
            service_cidrs: &[],
        };
        let out = render(
            &loaded.state,
            IpFamily::V4,
            &RenderConfig::default(),
            &scope,
        )?;
        eprintln!(
            "{kind:?} render: {:?} ({} operations)",
            started.elapsed(),
            out.operations
        );
        Ok(out)
    };
    let full = timed(SyncKind::Full, &BTreeSet::new(), &NftState::default())?;
    let first = loaded.state.services.keys().next();
    let changed = first.map(|n| BTreeSet::from([n.service.clone()]));
    let installed = full.state_after(&NftState::default());
    timed(SyncKind::Partial, &changed.unwrap_or_default(), &installed)?;
    if args.next().as_deref() == Some("apply") {
        let max_step = match args.next() {
            Some(n) if n == "0" => usize::MAX,
            Some(n) => n.parse()?,
            None => kp_nftnl::DEFAULT_MAX_STEP_COMMANDS,
        };
        let mut socket = kp_nftnl::NftSocket::open()?;
        let started = Instant::now();
        socket.apply(&full.transaction, max_step)?;
        eprintln!(
            "applied {} commands in {} transaction(s): {:?}",
            full.transaction.len(),
            full.transaction.steps(max_step).len(),
            started.elapsed()
        );
    } else {
        print!("{}", full.transaction);
    }
    Ok(())
}
