//! Errors of the harness itself (never of the flows it probes: those are [`crate::Outcome`]s).

use std::path::PathBuf;
use std::time::Duration;

/// Why the harness could not set up, drive or tear down the test cluster.
#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    /// Namespaces and veths need root (CAP_SYS_ADMIN and CAP_NET_ADMIN); CI runs as root.
    #[error(
        "kp-testbed needs root to create network namespaces (effective uid is {euid}); run the end-to-end tests as root"
    )]
    NotRoot {
        /// The effective uid this process runs with.
        euid: u32,
    },
    /// A required command-line tool is not installed.
    #[error(
        "`{tool}` is not usable ({source}); install it (Debian: apt-get install -y iproute2 iptables nftables conntrack)"
    )]
    ToolMissing {
        /// The tool that could not be run.
        tool: String,
        /// Why running it failed.
        source: std::io::Error,
    },
    /// A command could not be started at all.
    #[error("could not start `{command}`: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// A command exited unsuccessfully.
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// What it printed on standard error.
        stderr: String,
    },
    /// A command did not finish within its bound and was killed.
    #[error("`{command}` did not finish within {after:?} and was killed")]
    CommandTimedOut {
        /// The command line.
        command: String,
        /// The bound it exceeded.
        after: Duration,
    },
    /// The `kp-echo` helper binary was not found.
    #[error(
        "the kp-echo binary was not found (looked at {searched:?}); build it with `cargo build -p kp-testbed --bins` (or run `cargo test --workspace`, which builds every binary), or point {env} at it",
        env = crate::ECHO_BINARY_ENV
    )]
    EchoBinaryMissing {
        /// The paths that were tried.
        searched: Vec<PathBuf>,
    },
    /// An echo server exited or never reported that it listens.
    #[error("echo server {name:?} did not start: {detail}")]
    EchoStartFailed {
        /// The echo server's (pod) name.
        name: String,
        /// What went wrong, with its standard error when there was any.
        detail: String,
    },
    /// A pod or echo name cannot be used in a namespace name.
    #[error("invalid name {name:?}: {reason}")]
    InvalidName {
        /// The rejected name.
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// More pods were asked for than one pod subnet holds.
    #[error("at most {max} pods per node are supported")]
    TooManyPods {
        /// The limit.
        max: usize,
    },
    /// No pod of that name exists in this cluster.
    #[error("no pod named {name:?} in this cluster")]
    UnknownPod {
        /// The requested name.
        name: String,
    },
    /// No echo server of that name is running.
    #[error("no echo server named {name:?} is running")]
    UnknownEcho {
        /// The requested name.
        name: String,
    },
    /// The namespace does not belong to this cluster (the harness only runs commands in its own).
    #[error("namespace {ns:?} does not belong to this cluster")]
    UnknownNamespace {
        /// The requested namespace.
        ns: String,
    },
    /// SCTP flows cannot be probed on a kernel without SCTP sockets (e.g. this machine's;
    /// the kp-vm guest kernel has them).
    #[error(
        "SCTP is not supported by this kernel (no SCTP sockets), so kp-testbed cannot probe SCTP flows"
    )]
    SctpUnsupported,
    /// A line for a long-lived connection contained a newline or was empty.
    #[error("a session line must be non-empty and must not contain a newline: {line:?}")]
    InvalidLine {
        /// The rejected line.
        line: String,
    },
    /// The prober printed something that is not an outcome.
    #[error("unexpected probe output {output:?}: {detail}")]
    ProbeOutput {
        /// The offending output.
        output: String,
        /// Why it could not be understood.
        detail: String,
    },
    /// The long-lived connection's helper process has ended (its connection failed or closed).
    #[error("the long-lived connection has ended: {detail}")]
    SessionEnded {
        /// What is known about the end.
        detail: String,
    },
    /// The fake API server process did not start, or was driven wrongly.
    #[error("fake API server: {detail}")]
    ApiServer {
        /// What went wrong.
        detail: String,
    },
    /// The proxy under test exited before logging what was awaited.
    #[error("kube-proxy exited ({status}) before {what}; its last log lines:\n{log}")]
    ProxyExited {
        /// What was awaited (e.g. "its first sync").
        what: String,
        /// Its exit status, or "still running" if it closed its log and went on.
        status: String,
        /// The last lines it logged.
        log: String,
    },
    /// The proxy under test did not log what was awaited within the bound.
    #[error("kube-proxy did not log {what} within {after:?}; its last log lines:\n{log}")]
    ProxyTimedOut {
        /// What was awaited.
        what: String,
        /// The bound.
        after: Duration,
        /// The last lines it logged.
        log: String,
    },
    /// A test cgroup could not be made, entered, left or removed, or the node has no
    /// cgroup v2 hierarchy.
    #[error("cgroup v2 {action} {}: {source}", path.display())]
    Cgroup {
        /// What was being done ("create", "enter", ...).
        action: &'static str,
        /// The cgroup directory (or the file written).
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// A wait was interrupted (a signal arrived).
    #[error("interrupted")]
    Interrupted,
    /// Reading or writing a helper process's pipes failed.
    #[error("talking to a helper process failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Shorthand for results of this crate.
pub type Result<T, E = TestbedError> = std::result::Result<T, E>;
