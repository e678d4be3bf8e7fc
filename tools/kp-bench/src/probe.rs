//! Helpers of the kernel probes (`examples/nft_*.rs`): timing a call in wall time and in time
//! on a CPU, medians, and `nft -f -`.

use std::io::Write as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

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
