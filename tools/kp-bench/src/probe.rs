//! Helpers of the kernel probes (`examples/nft_*.rs`): timing a call in wall time and in time
//! on a CPU, medians, `nft -f -`, and the transactions that do and do not make the kernel
//! validate a table.

use std::io::Write as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kp_core::model::IpFamily;
use kp_rules::nftables::cmd::{Name, Rule, Verdict};
use kp_rules::nftables::{Command, Transaction};

/// Time this thread has spent on a CPU (user and kernel: the kernel runs a netlink batch in
/// the sender's context), from `/proc/thread-self/schedstat`; less sensitive to other load
/// than wall time, but only as fine as the scheduler's accounting (sub-millisecond calls
/// often read 0).
pub fn on_cpu() -> anyhow::Result<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    let nanos: u64 = text
        .split_whitespace()
        .next()
        .context("empty schedstat")?
        .parse()?;
    Ok(Duration::from_nanos(nanos))
}

/// Run `f`, returning its wall and on-CPU time.
pub fn timed(f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<(Duration, Duration)> {
    let (wall, cpu) = (Instant::now(), on_cpu()?);
    f()?;
    Ok((wall.elapsed(), on_cpu()?.saturating_sub(cpu)))
}

/// The median of `times` (sorted in place).
pub fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times
        .get(times.len() / 2)
        .copied()
        .unwrap_or(Duration::ZERO)
}

/// Apply `script` with `nft -f -` in the current network namespace.
pub fn nft_apply(script: &str) -> anyhow::Result<()> {
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .context("running nft")?;
    child
        .stdin
        .take()
        .context("nft stdin")?
        .write_all(script.as_bytes())?;
    let status = child.wait()?;
    if !status.success() {
        bail!("nft -f - failed: {status}");
    }
    Ok(())
}

/// The smallest transactions that do and do not make the kernel validate the table: (re)write
/// `chain` (a chain no base chain reaches) with one `jump mark-for-masquerade` rule (any rule
/// with a verdict, `dnat`, `mark set` or verdict-map lookup marks the table for validation),
/// or only add and flush it (no rule: no validation). Both leave the table as they found it
/// after the first time.
pub fn validation_probe(chain: &'static str, with_rule: bool) -> Transaction {
    let chain = Name::from(chain);
    let mut commands = vec![
        Command::AddChain {
            chain: chain.clone(),
            hook: None,
            comment: None,
        },
        Command::FlushChain(chain.clone()),
    ];
    if with_rule {
        commands.push(Command::AddRule {
            chain,
            rule: Rule::verdict(Vec::new(), Verdict::Jump("mark-for-masquerade".into())),
        });
    }
    Transaction::new(IpFamily::V4, commands)
}
