//! `kp-conntrack`: what one sync's stale-entry cleanup costs, over ctnetlink
//! ([`NetlinkConntrack`], the default) and by exec'ing `conntrack -D` ([`ExecConntrack`]).
//!
//! Loads a conntrack table of `--services` × `--clients` UDP entries (`conntrack -R`), then
//! times deleting every entry of `--stale` services (one filter each, as a sync whose
//! services gained their first endpoint asks), the table reloaded before each variant, and
//! the same with filters that match nothing (the dump alone). It re-executes itself under
//! `unshare -n`, so it only ever touches the table of a namespace of its own (gone when it
//! exits), and the child refuses to run in its parent's namespace.

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use kp_bench::sys::run_std;
use kp_core::model::{IpFamily, Protocol};
use kp_dataplane::conntrack::{Conntrack, ExecConntrack, FlowFilter, NetlinkConntrack};

#[derive(Debug, Parser)]
#[command(about = "Times stale conntrack entry deletion: ctnetlink vs conntrack -D")]
struct Args {
    /// Service IPs (10.96.x.y:53/UDP) in the table.
    #[arg(long, default_value_t = 100)]
    services: u32,
    /// Client flows per service.
    #[arg(long, default_value_t = 100)]
    clients: u32,
    /// Services whose entries are deleted (one filter each).
    #[arg(long, default_value_t = 10)]
    stale: u32,
    /// Repetitions of each measurement.
    #[arg(long, default_value_t = 3)]
    runs: u32,
}

fn service_ip(i: u32) -> String {
    format!("10.96.{}.{}", i / 250, i % 250 + 1)
}

/// Client `c`; the same clients talk to every service.
fn client_ip(c: u32) -> String {
    format!("10.200.{}.{}", c / 256, c % 256)
}

/// The one endpoint of service `i`, so every entry's reply tuple is unique too.
fn endpoint_ip(i: u32) -> String {
    format!("10.128.{}.{}", i / 256, i % 256)
}

fn filters(services: impl Iterator<Item = u32>) -> anyhow::Result<Vec<FlowFilter>> {
    services
        .map(|i| {
            Ok(FlowFilter {
                family: IpFamily::V4,
                protocol: Protocol::Udp,
                orig_dst: Some(service_ip(i).parse()?),
                orig_dst_port: Some(53),
                reply_src: None,
                reply_src_port: None,
            })
        })
        .collect()
}

/// Empty the table and load `file` into it; returns the entry count.
fn reload(file: &std::path::Path) -> anyhow::Result<usize> {
    // `conntrack -F` exits 0 on an empty table too.
    run_std("conntrack", &["-F"])?;
    let path = file.to_str().context("temp path is UTF-8")?;
    run_std("conntrack", &["-R", path])?;
    let count = run_std("conntrack", &["-C"])?;
    count.trim().parse().context("conntrack -C output")
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Set in the child: the parent's network namespace.
const PARENT_NS_ENV: &str = "KP_CONNTRACK_PARENT_NETNS";

fn netns() -> anyhow::Result<String> {
    let link = std::fs::read_link("/proc/self/ns/net").context("reading /proc/self/ns/net")?;
    Ok(link.display().to_string())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let Some(parent) = std::env::var_os(PARENT_NS_ENV) else {
        // The parent: run the measurement in a fresh namespace.
        let status = std::process::Command::new("unshare")
            .arg("-n")
            .arg(std::env::current_exe().context("own path")?)
            .args(std::env::args_os().skip(1))
            .env(PARENT_NS_ENV, netns()?)
            .status()
            .context("running unshare -n (needs root)")?;
        ensure!(status.success(), "measurement failed: {status}");
        return Ok(());
    };
    if parent.to_str() == Some(netns()?.as_str()) {
        bail!("refusing to flush the conntrack table of the parent's network namespace");
    }
    ensure!(args.stale <= args.services, "--stale exceeds --services");
    ensure!(
        args.services + args.stale <= 62_500,
        "at most 62500 services"
    );
    ensure!(args.clients <= 65_536, "at most 65536 clients");

    let mut file = tempfile::NamedTempFile::new()?;
    for s in 0..args.services {
        for c in 0..args.clients {
            let client = client_ip(c);
            writeln!(
                file,
                "-I -p udp --src {client} --dst {} --sport 40000 --dport 53 \
                 --reply-src {} --reply-dst {client} --reply-port-src 5353 \
                 --reply-port-dst 40000 --timeout 3600",
                service_ip(s),
                endpoint_ip(s),
            )?;
        }
    }
    file.flush()?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let stale = filters(0..args.stale)?;
    let absent = filters(args.services..args.services + args.stale)?;
    println!(
        "| table | filters | variant | deleted | time (median of {}) |",
        args.runs
    );
    println!("|---|---|---|---|---|");
    type Variant<'a> = (&'a str, &'a [FlowFilter], bool);
    let variants: [Variant<'_>; 3] = [
        ("ctnetlink (dump + per-entry delete)", &stale, false),
        ("conntrack -D per filter", &stale, true),
        ("ctnetlink, nothing matches (dump only)", &absent, false),
    ];
    for (name, filters, exec) in variants {
        let mut times = Vec::new();
        let mut deleted = 0;
        let mut table = 0;
        for _ in 0..args.runs {
            table = reload(file.path())?;
            let start = Instant::now();
            deleted = if exec {
                // One `conntrack -D` per filter, failures surfaced (not logged and skipped).
                let conntrack = ExecConntrack::default();
                let mut n = 0;
                for filter in filters {
                    n += runtime.block_on(conntrack.delete(filter))?;
                }
                n
            } else {
                NetlinkConntrack::delete_matching_blocking(filters)?
            };
            times.push(start.elapsed());
        }
        times.sort();
        let median = times[times.len() / 2];
        println!(
            "| {table} | {} | {name} | {deleted} | {} |",
            filters.len(),
            ms(median)
        );
    }
    Ok(())
}
