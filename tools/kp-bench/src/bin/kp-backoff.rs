//! `kp-backoff`: what an API server outage looks like from the server's side when many
//! watchers retry with the API source's back-off (`kp_sources::api::Backoff`, the code the
//! proxy runs), in virtual time: no sockets, so 1,000 watchers cost nothing and a run is
//! repeatable (`--seed`).
//!
//! Every watcher's watch breaks when the server goes away (t = 0); each retry before the
//! outage ends is refused; the first one after it reaches the restarted server, which answers
//! `410 Gone` (its history starts anew), and the watcher relists (a list and a watch). Watchers
//! are grouped four to a proxy (Services, EndpointSlices, the Node, ServiceCIDRs); once one
//! of a proxy's requests is answered its other watchers retry at once, as the source's do
//! (`no wake-up`: each waits out its own delay). For each policy it prints the refused attempts per second late in the outage, the requests per
//! second the recovering server receives (peak 1 s window, and in its first 10 s), and how long
//! after the server's return watchers and whole proxies are back in step.
//!
//! `client-go` is a model of upstream's reflector for comparison, not the proxy's code: its
//! back-off manager (800 ms doubling to 30 s, each delay lengthened by up to 100 %, reset after
//! 2 minutes without a back-off) also waits a delay after the `410` before relisting.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use clap::Parser;
use kp_sources::api::{Backoff, Failure, RetryPolicy};
use tokio::time::Instant;

/// Watchers per proxy: Services, EndpointSlices, this Node, ServiceCIDRs.
const KINDS: usize = 4;

// client-go's reflector back-off: `NewExponentialBackoffManager(800ms, 30s, 2m, 2.0, 1.0)`.
/// Its first delay (before the up to 100 % added).
const CLIENT_GO_INITIAL: Duration = Duration::from_millis(800);
/// Its cap (before the up to 100 % added).
const CLIENT_GO_MAX: Duration = Duration::from_secs(30);
/// How long without a back-off resets it.
const CLIENT_GO_RESET: Duration = Duration::from_secs(120);

#[derive(Parser, Debug)]
#[command(
    name = "kp-backoff",
    about = "API server outage: retries and recovery of many watchers"
)]
struct Args {
    /// Watchers (four per proxy).
    #[arg(long, default_value_t = 1000)]
    watchers: usize,
    /// How long the API server is away, in seconds.
    #[arg(long, default_value_t = 30.0)]
    outage: f64,
    /// Seed of the jitter's random numbers.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Caps (seconds) of the proxy's policy to compare; 3 was the cap before.
    #[arg(long, value_delimiter = ',', default_value = "3,30,60")]
    caps: Vec<f64>,
}

/// splitmix64: deterministic numbers in `[0, 1)` for the jitter.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One watcher's retry delays.
trait Schedule {
    /// The delay after `failure` at `now`; `unit` in `[0, 1)` picks the jitter.
    fn failed(&mut self, failure: Failure, now: Instant, unit: f64) -> Duration;
}

impl Schedule for Backoff {
    fn failed(&mut self, failure: Failure, now: Instant, unit: f64) -> Duration {
        Backoff::failed(self, failure, now, unit)
    }
}

/// The model of client-go's reflector back-off: every failure, `410` included, waits.
struct ClientGo {
    next: Duration,
    last: Option<Instant>,
}

impl Schedule for ClientGo {
    fn failed(&mut self, _failure: Failure, now: Instant, unit: f64) -> Duration {
        if self.last.is_some_and(|last| now - last > CLIENT_GO_RESET) {
            self.next = CLIENT_GO_INITIAL;
        }
        self.last = Some(now);
        let delay = self.next.mul_f64(1.0 + unit);
        self.next = (self.next * 2).min(CLIENT_GO_MAX);
        delay
    }
}

/// What one run measured, in seconds from the server's return unless said otherwise.
struct Outcome {
    /// Refused attempts per second over the outage's last 10 s.
    refused_rate: f64,
    /// Requests to the restarted server, by the second after its return.
    per_second: Vec<u64>,
    /// When each watcher was back in step.
    watchers: Vec<f64>,
    /// When each proxy's last watcher was.
    proxies: Vec<f64>,
}

/// Runs the outage for `watchers` schedules; with `wake`, a proxy's other watchers retry as
/// soon as one of its requests is answered (what the API source does), else each waits out
/// its own delay.
fn simulate(
    mut watchers: Vec<Box<dyn Schedule>>,
    outage: Duration,
    wake: bool,
    rng: &mut Rng,
) -> Outcome {
    let start = Instant::now();
    let end = start + outage;
    // (when, watcher, its version): a woken watcher's earlier entry is stale.
    let mut due = BinaryHeap::new();
    let mut version = vec![0u32; watchers.len()];
    for (i, w) in watchers.iter_mut().enumerate() {
        let delay = w.failed(Failure::Unreachable, start, rng.unit());
        due.push(Reverse((start + delay, i, 0)));
    }
    let mut refused_late = 0u64;
    let mut requests: Vec<Duration> = Vec::new();
    let mut back: Vec<Option<Duration>> = vec![None; watchers.len()];
    while let Some(Reverse((at, i, v))) = due.pop() {
        if v != version[i] || back[i].is_some() {
            continue;
        }
        if at < end {
            if end - at <= Duration::from_secs(10) {
                refused_late += 1;
            }
            let delay = watchers[i].failed(Failure::Unreachable, at, rng.unit());
            due.push(Reverse((at + delay, i, v)));
            continue;
        }
        // The restarted server: `410` to the old watch, then a list and a watch.
        let relist = at + watchers[i].failed(Failure::Expired, at, rng.unit());
        requests.push(at - end);
        requests.extend([relist - end; 2]);
        back[i] = Some(relist - end);
        if wake {
            let proxy = i / KINDS * KINDS;
            for sibling in (proxy..proxy + KINDS).filter(|s| *s < watchers.len()) {
                version[sibling] += 1;
                due.push(Reverse((at, sibling, version[sibling])));
            }
        }
    }
    let back: Vec<Duration> = back.into_iter().map(Option::unwrap_or_default).collect();
    outcome(refused_late, &requests, &back, outage)
}

fn outcome(
    refused_late: u64,
    requests: &[Duration],
    back: &[Duration],
    outage: Duration,
) -> Outcome {
    let seconds = requests
        .iter()
        .map(|d| d.as_secs() as usize)
        .max()
        .unwrap_or(0)
        + 1;
    let mut per_second = vec![0u64; seconds];
    for d in requests {
        per_second[d.as_secs() as usize] += 1;
    }
    let watchers: Vec<f64> = back.iter().map(Duration::as_secs_f64).collect();
    let proxies = watchers
        .chunks(KINDS)
        .map(|kinds| kinds.iter().copied().fold(0.0, f64::max))
        .collect();
    Outcome {
        refused_rate: refused_late as f64 / outage.as_secs_f64().min(10.0),
        per_second,
        watchers,
        proxies,
    }
}

/// The `q` quantile of `values` (sorted in place).
fn quantile(values: &mut [f64], q: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64 - 1.0) * q).round() as usize;
    values.get(index).copied().unwrap_or(0.0)
}

fn print_row(name: &str, mut o: Outcome) {
    let peak = o.per_second.iter().max().copied().unwrap_or(0);
    let first10: u64 = o.per_second.iter().take(10).sum();
    println!(
        "| {name} | {:.1} | {peak} | {:.1} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} |",
        o.refused_rate,
        first10 as f64 / 10.0,
        quantile(&mut o.watchers, 0.5),
        quantile(&mut o.watchers, 0.99),
        quantile(&mut o.watchers, 1.0),
        quantile(&mut o.proxies, 0.5),
        quantile(&mut o.proxies, 0.99),
        quantile(&mut o.proxies, 1.0),
    );
}

fn main() {
    let args = Args::parse();
    let outage = Duration::from_secs_f64(args.outage);
    println!(
        "{} watchers ({} proxies), outage {:?}, seed {}\n",
        args.watchers,
        args.watchers.div_ceil(KINDS),
        outage,
        args.seed
    );
    println!(
        "| policy | refused attempts/s, outage's last 10 s | peak requests in 1 s after return | requests/s, first 10 s | watcher back after return p50 / p99 / max (s) | proxy back p50 / p99 / max (s) |"
    );
    println!("|---|---|---|---|---|---|");
    for cap in &args.caps {
        let policy = RetryPolicy::capped(Duration::from_secs_f64(*cap));
        for wake in [true, false] {
            let watchers = (0..args.watchers)
                .map(|_| Box::new(Backoff::new(policy)) as Box<dyn Schedule>)
                .collect();
            let mut rng = Rng(args.seed);
            let name = format!(
                "kube-proxy-rs, cap {cap} s{}",
                if wake { "" } else { ", no wake-up" }
            );
            print_row(&name, simulate(watchers, outage, wake, &mut rng));
        }
    }
    let watchers = (0..args.watchers)
        .map(|_| {
            Box::new(ClientGo {
                next: CLIENT_GO_INITIAL,
                last: None,
            }) as Box<dyn Schedule>
        })
        .collect();
    let mut rng = Rng(args.seed);
    print_row(
        "client-go (model)",
        simulate(watchers, outage, false, &mut rng),
    );
}
