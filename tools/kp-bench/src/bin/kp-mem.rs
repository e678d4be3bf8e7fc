//! `kp-mem`: where the proxy's memory goes, in-process, sampling VmRSS/VmHWM (the peak reset
//! between phases through `/proc/self/clear_refs`); glibc keeps freed memory, so "live" is
//! resident, not allocated.
//!
//! Runs the fake-mode pipeline without a backend: generated manifests (written to a temp
//! dir) → the manifests source (its real scanner, through an event channel as deep as the
//! proxy's) → change tracker → [`ProxyState`], and prints the bytes live and the peak
//! since the previous phase. Then the pieces one by one (file text, parsed objects, tracker,
//! state, a state clone) to attribute them.

use std::time::{Duration, Instant};

use clap::Parser;
use kp_bench::generate::{self, NODE_NAME, Scale};
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_core::tracker::{ChangeTracker, ProxyState};
use kp_sources::manifests::{ManifestsSource, parse_manifests};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The proxy binary's source event queue (`EVENT_QUEUE` in crates/kube-proxy/src/app.rs): queued
/// events hold whole objects, so the depth shows in the peak.
const EVENT_QUEUE: usize = 256;

/// `key` of `/proc/self/status`, in bytes.
fn status(key: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<usize>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// Resident bytes now and the peak since the last reset (resets it: `clear_refs` 5).
fn sample() -> (usize, usize) {
    let live = status("VmRSS:");
    let peak = status("VmHWM:");
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    (live, peak)
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Print the live bytes, the peak since the last phase, and the change from `base`.
fn phase(name: &str, base: usize) -> usize {
    let (live, peak) = sample();
    println!(
        "{name:<44} live {:>10}  (+{:>10})  peak {:>10}",
        mib(live),
        mib(live.saturating_sub(base)),
        mib(peak)
    );
    live
}

#[derive(Debug, Parser)]
#[command(
    name = "kp-mem",
    about = "In-process memory attribution of the fake-mode pipeline"
)]
struct Args {
    /// Services.
    #[arg(long, default_value_t = 10_000)]
    services: usize,
    /// Endpoints per service.
    #[arg(long, default_value_t = 10)]
    endpoints: usize,
    /// Only the pieces one by one (in a fresh process, where freed memory does not blur them).
    #[arg(long)]
    pieces: bool,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let scale = Scale::new(args.services, args.endpoints);
    let dir = tempfile::tempdir()?;
    {
        let manifests = generate::generate(scale);
        for (name, text) in &manifests.files {
            std::fs::write(dir.path().join(name), text)?;
        }
        println!(
            "{} services x {} endpoints: {} files, {}",
            args.services,
            args.endpoints,
            manifests.files.len(),
            mib(manifests.bytes())
        );
    }
    let base = phase("start", 0);

    if args.pieces {
        return pieces(dir.path(), base);
    }
    // The pipeline as the proxy runs it.
    let (tx, mut rx) = mpsc::channel::<SourceEvent>(EVENT_QUEUE);
    let shutdown = CancellationToken::new();
    let source = ManifestsSource::new(dir.path()).node_name(NODE_NAME);
    let task = tokio::spawn(source.run(tx, shutdown.clone()));
    let mut tracker = ChangeTracker::new(NODE_NAME);
    let started = Instant::now();
    let mut synced = 0;
    while synced < 3 {
        let Some(event) = rx.recv().await else { break };
        if matches!(
            event,
            SourceEvent::Service(ObjectEvent::Synced)
                | SourceEvent::EndpointSlice(ObjectEvent::Synced)
                | SourceEvent::Node(ObjectEvent::Synced)
        ) {
            synced += 1;
        }
        tracker.record(event);
    }
    let recorded = started.elapsed();
    phase("source read + tracker recorded", base);
    let mut state = ProxyState::default();
    let result = tracker.apply(&mut state);
    println!(
        "  ({} services changed, read+record {:?}, apply {:?})",
        result.changed.len(),
        recorded,
        started.elapsed() - recorded
    );
    drop(result);
    let after_apply = phase("tracker applied -> state", base);
    let started = Instant::now();
    let copy = state.clone();
    println!("  (ProxyState clone {:?})", started.elapsed());
    phase("+ one ProxyState clone (Arc::make_mut)", after_apply);
    drop(copy);
    tokio::time::sleep(Duration::from_millis(50)).await;
    shutdown.cancel();
    task.await??;
    drop(rx);
    let live = phase("source stopped (its memory freed)", base);
    drop(tracker);
    let live_state = phase("tracker dropped (state only)", base);
    drop(state);
    let empty = phase("state dropped", base);
    println!(
        "=> source {}, tracker {}, state {}",
        mib(after_apply.saturating_sub(live)),
        mib(live.saturating_sub(live_state)),
        mib(live_state.saturating_sub(empty))
    );

    Ok(())
}

/// The pieces one by one.
fn pieces(dir: &std::path::Path, base: usize) -> anyhow::Result<()> {
    let mut texts = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        texts.push((path.clone(), std::fs::read_to_string(&path)?));
    }
    let with_text = phase("file text", base);
    let mut objects = Vec::new();
    for (path, text) in &texts {
        let (parsed, errors) = parse_manifests(text, path);
        anyhow::ensure!(errors.is_empty(), "{path:?}: {}", errors[0]);
        objects.extend(parsed);
    }
    let with_objects = phase("parsed objects (peak: while parsing)", with_text);
    let mut tracker = ChangeTracker::new(NODE_NAME);
    for object in objects.iter().cloned() {
        tracker.record(object.applied());
    }
    phase("tracker (recorded, pending)", with_objects);
    let mut state = ProxyState::default();
    tracker.apply(&mut state);
    phase("tracker applied + state", with_objects);
    drop(objects);
    drop(texts);
    phase("text + objects dropped", base);
    drop(state);
    phase("state dropped (tracker only)", base);
    Ok(())
}
