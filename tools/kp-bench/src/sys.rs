//! Network namespaces, processes and `/proc`: the I/O the benchmark needs around the proxy.
//!
//! Everything the benchmark runs against the kernel runs inside a namespace it created
//! ([`Netns`]), which is deleted when the guard drops, on errors and interrupts too, and
//! swept by the next run after a crash. Processes
//! are only ever ended by their process id.

use std::path::{Path, PathBuf};
use std::process::{Command as StdCommand, Stdio};

use anyhow::{Context as _, bail};
use kp_testbed::Namespace;
use kp_testbed::proxy::ProxyLaunch;

use crate::generate::NODE_NAME;

/// A network namespace that exists while this guard lives (kp-testbed's [`Namespace`]:
/// named `<prefix><pid>-<n>-<role>`, swept after a crash, removed with every process still
/// inside it).
#[derive(Debug)]
pub struct Netns {
    ns: Namespace,
    /// The proxy's record of kernel settings it changed in this namespace: its own, so runs
    /// never write the host's `/run/kube-proxy-rs`. Removed with the guard.
    state: tempfile::TempDir,
}

impl Netns {
    /// Create `<prefix><pid>-<n>-<role>` and bring its loopback up.
    pub fn create(prefix: &str, role: &str) -> anyhow::Result<Self> {
        let state = tempfile::tempdir().context("state directory")?;
        let ns = Namespace::create(prefix, role)
            .with_context(|| format!("creating a netns {prefix}...-{role}"))?;
        Ok(Self { ns, state })
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        self.ns.name()
    }

    /// The state directory for a proxy running in this namespace
    /// (`KUBE_PROXY_RS_STATE_DIR`; [`Netns::command`] sets it).
    pub fn state_dir(&self) -> &Path {
        self.state.path()
    }

    /// A command running `program args` inside the namespace. `ip netns exec` execs the
    /// program, so the child's pid is the program's.
    pub fn command(&self, program: impl AsRef<Path>, args: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("ip");
        command
            .args(["netns", "exec", self.name()])
            .arg(program.as_ref())
            .args(args)
            .env(kp_dataplane::sysctls::STATE_DIR_ENV, self.state_dir())
            .kill_on_drop(true);
        command
    }

    /// The proxy under benchmark, `binary`, as kp-testbed's harness starts it in this
    /// namespace: with the namespace's state directory, this benchmark's node name, the admin
    /// servers on the namespace's loopback and the host-wide conntrack table size left alone.
    /// The caller adds the source and the mode.
    pub fn proxy(&self, binary: &Path) -> anyhow::Result<ProxyLaunch> {
        let binary = std::fs::canonicalize(binary)
            .with_context(|| format!("kube-proxy binary {}", binary.display()))?;
        Ok(ProxyLaunch::new(self.name(), binary)
            .env(kp_dataplane::sysctls::STATE_DIR_ENV, self.state_dir())
            .arg(format!("--hostname-override={NODE_NAME}"))
            .args([
                "--healthz-bind-address=127.0.0.1:10256",
                "--metrics-bind-address=127.0.0.1:10249",
                // The conntrack table size is the host's, not the namespace's: leave it.
                "--conntrack-max-per-core=0",
            ]))
    }

    /// Run `program args` inside the namespace to completion and return its stdout.
    pub fn output(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["netns", "exec", self.name(), program];
        all.extend_from_slice(args);
        run_std("ip", &all)
    }
}

/// Run a command to completion; its stdout, or an error with its stderr.
pub fn run_std(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = StdCommand::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `VmHWM` (peak resident set) of `pid`, in KiB.
pub fn vm_hwm_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

/// `VmRSS` (resident set now) of `pid`, in KiB.
pub fn vm_rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

/// `Threads` of `pid`.
pub fn threads(pid: u32) -> Option<u64> {
    status_kib(pid, "Threads:")
}

/// Open file descriptors of `pid` (entries of `/proc/PID/fd`).
pub fn open_fds(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// The first number after `key` in `/proc/PID/status` (in KiB for the `Vm*` keys).
fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// CPU time of a process in clock ticks: (own user+system, reaped children's user+system).
pub fn cpu_ticks(pid: u32) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the `(comm)`, which may contain spaces: state is field 3, utime 14.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|f| f.parse().ok())
        .collect();
    match fields.as_slice() {
        [utime, stime, cutime, cstime] => Some((utime + stime, cutime + cstime)),
        _ => None,
    }
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 if that fails).
pub fn ticks_per_second() -> u64 {
    run_std("getconf", &["CLK_TCK"])
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(100)
}

pub use kp_testbed::proxy::descendants;

/// Send `signal` (`TERM`, `KILL`) to one process by id.
pub fn kill(pid: u32, signal: &str) {
    kp_testbed::proxy::signal(pid, signal);
}

/// The first `name` on the `PATH` (plus the sbin directories).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The 1-minute load average and the number of running processes now (`/proc/loadavg`).
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}
