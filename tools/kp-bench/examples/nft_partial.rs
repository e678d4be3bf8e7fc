//! Repeat the nftables one-service partial sync against a loaded table and time each one: an
//! investigation aid for the partial's kernel floor (see
//! bench/notes/2026-11-25-nftables-partial-kernel-floor.md).
//!
//! `ip netns exec NS nft_partial SERVICES ENDPOINTS ROUNDS [netlink|nft] [DIR]` loads the
//! full sync of SERVICES × ENDPOINTS (v4) over netlink into the current network namespace,
//! then edits service 0's EndpointSlice ROUNDS times (the first endpoint moves, as in
//! kp-scale's edit step), renders each partial sync against the installed state as the
//! proxy does (stale chains of the previous round deleted) and applies it over netlink
//! (default) or with `nft -f -`. It prints one line per round (render and apply) and the
//! median apply, in wall time and in time on a CPU (the kernel runs the batch in this
//! thread, so that is the kernel's work plus ours, without run-queue waits; with `nft -f`
//! only ours). Each round also times two probes on the same socket (see [`probe`]): a
//! one-rule transaction that makes the kernel validate the table (the floor any change
//! with a jump pays) and a commit that does not. With DIR, the full script and the first partial script are written there
//! (`full.nft`, `partial.nft`), for replaying with plain `nft -f`. Run under `perf record -a
//! -g` to attribute the applies; the full sync's load is done before the line `rounds:` on
//! stderr.

use std::collections::BTreeSet;
use std::time::Instant;

use anyhow::{Context as _, bail};
use kp_bench::generate::{Edit, Scale, edited_file, generate};
use kp_bench::probe::{median, nft_apply, timed, validation_probe};
use kp_bench::state::Loaded;
use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
use kp_rules::nftables::{NftScope, NftState, RenderConfig, render};

/// The probe chain of [`validation_probe`]: not reachable from any base chain.
const PROBE_CHAIN: &str = "floor-probe";

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let services: usize = args.next().unwrap_or_else(|| "1000".into()).parse()?;
    let endpoints: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let rounds: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let via_nft = match args.next().as_deref() {
        None | Some("netlink") => false,
        Some("nft") => true,
        Some(other) => bail!("unknown applier {other} (netlink or nft)"),
    };
    let dump = args.next().map(std::path::PathBuf::from);

    let scale = Scale::new(services, endpoints);
    let mut loaded = Loaded::new(&generate(scale))?;
    let config = RenderConfig::default();
    let none = BTreeSet::new();
    let empty = NftState::default();
    let full = render(
        &loaded.state,
        IpFamily::V4,
        &config,
        &NftScope {
            kind: SyncKind::Full,
            changed: &none,
            existing: &empty,
            delete_stale: false,
            service_cidrs: &[],
        },
    )?;
    let mut socket = kp_nftnl::NftSocket::open()?;
    let started = Instant::now();
    socket.apply(&full.transaction, kp_nftnl::DEFAULT_MAX_STEP_COMMANDS)?;
    eprintln!(
        "full sync: {} commands applied in {:?}",
        full.transaction.len(),
        started.elapsed()
    );
    if let Some(dir) = &dump {
        std::fs::write(dir.join("full.nft"), full.transaction.to_string())?;
    }
    let mut installed = full.state_after(&empty);
    drop(full);

    eprintln!("rounds: {rounds}");
    let mut applies = Vec::with_capacity(rounds);
    let (mut jumps, mut empties) = (Vec::new(), Vec::new());
    let (mut apply_cpus, mut jump_cpus) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let (name, text) =
            edited_file(scale, &[Edit::replace(0, round)]).context("no service to edit")?;
        let changed = loaded.update(&name, &text)?;
        let started = Instant::now();
        let partial = render(
            &loaded.state,
            IpFamily::V4,
            &config,
            &NftScope {
                kind: SyncKind::Partial,
                changed: &changed,
                existing: &installed,
                delete_stale: !installed.pending_deletions().is_empty(),
                service_cidrs: &[],
            },
        )?;
        let rendered = started.elapsed();
        if round == 1
            && let Some(dir) = &dump
        {
            std::fs::write(dir.join("partial.nft"), partial.transaction.to_string())?;
        }
        let (applied, cpu) = timed(|| {
            if via_nft {
                nft_apply(&partial.transaction.to_string())
            } else {
                Ok(socket.apply(&partial.transaction, kp_nftnl::DEFAULT_MAX_STEP_COMMANDS)?)
            }
        })?;
        applies.push(applied);
        apply_cpus.push(cpu);
        println!(
            "round {round}: {} commands, render {rendered:?}, apply {applied:?} (on CPU {cpu:?})",
            partial.transaction.len()
        );
        installed = partial.state_after(&installed);
        // The floor, under the same load: one rule that needs validation, then a commit
        // that needs none.
        let (jump, jump_cpu) =
            timed(|| Ok(socket.apply(&validation_probe(PROBE_CHAIN, true), usize::MAX)?))?;
        let (empty, empty_cpu) =
            timed(|| Ok(socket.apply(&validation_probe(PROBE_CHAIN, false), usize::MAX)?))?;
        println!(
            "round {round}: probe: one jump rule {jump:?} (on CPU {jump_cpu:?}), no rule {empty:?} (on CPU {empty_cpu:?})"
        );
        jumps.push(jump);
        jump_cpus.push(jump_cpu);
        empties.push(empty);
    }
    println!(
        "{services}x{endpoints} over {rounds} rounds: median partial apply ({}) {:?} \
         (on CPU {:?}); one jump rule (netlink) {:?} (on CPU {:?}); commit without \
         validation {:?}",
        if via_nft { "nft -f" } else { "netlink" },
        median(&mut applies),
        median(&mut apply_cpus),
        median(&mut jumps),
        median(&mut jump_cpus),
        median(&mut empties)
    );
    Ok(())
}
