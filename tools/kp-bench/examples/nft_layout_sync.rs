//! The verdict-free layout's syncs end to end, as the proxy would run them once the layout
//! is wired (it is not yet): kp-scale's generated cluster through
//! `kp_rules::nftables::layout` (plan, elements, difference) and kp-nftnl's element encoder
//! into the kernel.
//!
//! `ip netns exec NS nft_layout_sync SERVICES ENDPOINTS ROUNDS` renders and applies the full
//! sync (fixed part with `nft -f -`, then the elements over netlink in transactions of
//! [`STEP`] elements), then repeats kp-scale's edit (service 0's first endpoint moves)
//! ROUNDS times: the state update, the partial sync's render (plan of the changed service
//! and the difference with what is installed), its encoding and its apply, each timed.

use std::time::Instant;

use anyhow::Context as _;
use kp_bench::generate::{Edit, Scale, edited_file, generate};
use kp_bench::probe::{median, nft_apply};
use kp_bench::state::Loaded;
use kp_core::model::IpFamily;
use kp_nftnl::layout::{push_changes, push_elements};
use kp_nftnl::{Batch, Family, NftSocket};
use kp_rules::nftables::RenderConfig;
use kp_rules::nftables::layout::{
    Context, FixedConfig, LayoutState, change_script, fixed::class_part, fixed_part, full_updates,
    partial_updates,
};

/// Elements per transaction of the full sync.
const STEP: usize = 50_000;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let services: usize = args.next().unwrap_or_else(|| "1000".into()).parse()?;
    let endpoints: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let rounds: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let scale = Scale::new(services, endpoints);
    let mut loaded = Loaded::new(&generate(scale))?;
    let render_config = RenderConfig::default();
    let ctx = Context::new(&render_config, &loaded.state, IpFamily::V4);
    let config = FixedConfig::new(&render_config, IpFamily::V4, &[])?;
    let mut socket = NftSocket::open()?;
    let mut installed = LayoutState::default();

    let started = Instant::now();
    let changes = installed.changes(full_updates(&loaded.state, &ctx, &installed));
    let rendered = started.elapsed();
    let mut script = fixed_part(&config, &Default::default());
    for class in &changes.classes {
        script.extend(class_part(&config, *class));
    }
    nft_apply(&(script.join("\n") + "\n"))?;
    let fixed = started.elapsed();
    for chunk in changes.add.chunks(STEP) {
        let mut batch = Batch::new(1);
        push_elements(&mut batch, Family::Ipv4, true, chunk);
        socket.apply_batch(batch)?;
    }
    let elements = changes.add.len();
    installed.apply(changes);
    println!(
        "full sync {services}x{endpoints}: render {rendered:?}, fixed part (nft -f) done at {fixed:?}, {elements} elements applied at {:?}",
        started.elapsed()
    );

    let (mut renders, mut applies, mut totals) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        let (name, text) =
            edited_file(scale, &[Edit::replace(0, round)]).context("no service to edit")?;
        let changed = loaded.update(&name, &text)?;
        let started = Instant::now();
        let updates = partial_updates(&loaded.state, &ctx, &installed, &changed);
        let planned = started.elapsed();
        let changes = installed.changes(updates);
        let diffed = started.elapsed();
        let mut batch = Batch::new(1);
        push_changes(&mut batch, Family::Ipv4, &changes);
        let render = started.elapsed();
        if !changes.classes.is_empty() {
            // A new endpoint count: its sets and rules first (validates the small table).
            nft_apply(&(change_script(&config, &changes).join("\n") + "\n"))?;
        } else {
            socket.apply_batch(batch)?;
        }
        let total = started.elapsed();
        println!(
            "round {round}: {} deletions, {} additions, {} new classes: render+encode {render:?} (plan {planned:?}, difference at {diffed:?}), apply {:?}",
            changes.delete.len(),
            changes.add.len(),
            changes.classes.len(),
            total - render
        );
        installed.apply(changes);
        renders.push(render);
        applies.push(total - render);
        totals.push(total);
    }
    println!(
        "{services}x{endpoints}, median of {rounds}: partial sync {:?} (render+encode {:?}, apply {:?})",
        median(&mut totals),
        median(&mut renders),
        median(&mut applies)
    );
    Ok(())
}
