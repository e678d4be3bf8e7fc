//! A throwaway network namespace standing in for a node, for tests that run the real binary
//! against real per-namespace sysctls. The two global conntrack settings
//! (`nf_conntrack_max`, the hash size) cannot be written from a non-initial namespace and
//! must not be changed on the host, so [`Globals`] bind-mounts plain files over them in a
//! private mount namespace of each command. Shared by `init_only.rs` and `deploy.rs`.

// Each test binary uses part of this module.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

use kp_testbed::{Namespace, isolated};

/// The kube-proxy binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
/// Per-namespace conntrack settings.
pub const NETFILTER: &str = "/proc/sys/net/netfilter";
/// The global conntrack table size.
pub const MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";
/// The global conntrack hash size.
pub const HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";
/// `route_localnet` of the namespace.
pub const ROUTE_LOCALNET: &str = "/proc/sys/net/ipv4/conf/all/route_localnet";

/// A node's network namespace (kp-testbed's [`Namespace`]: loopback up, deleted with its
/// processes on drop, even when the test panics), with this file's helpers.
pub struct Netns(Namespace);

impl Netns {
    /// A new namespace named after this process and `tag`.
    pub fn new(tag: &str) -> Netns {
        Netns(Namespace::create("kpio-", tag).unwrap_or_else(|e| panic!("namespace: {e}")))
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        self.0.name()
    }

    /// The trimmed contents of `path` as seen inside.
    pub fn read(&self, path: &str) -> String {
        let out = self.sh(&format!("cat {path}"));
        assert!(out.status.success(), "cat {path}: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// Writes `value` to `path` inside.
    pub fn write(&self, path: &str, value: &str) {
        let out = self.sh(&format!("echo {value} > {path}"));
        assert!(out.status.success(), "writing {path}: {}", stderr(&out));
    }

    /// The command line that runs a shell script inside, in a mount namespace of its own.
    pub fn command(&self, script: &str) -> Command {
        let mut command = self.0.command("unshare");
        command.args(["-m", "sh", "-c", script]);
        command
    }

    /// Runs a shell script inside, in a mount namespace of its own.
    pub fn sh(&self, script: &str) -> Output {
        self.command(script)
            .output()
            .unwrap_or_else(|e| panic!("ip netns exec: {e}"))
    }
}

/// Standard error, for assertion messages.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Root, the tools and a conntrack-enabled kernel, or why not.
fn unavailable() -> Option<String> {
    isolated::missing(&["unshare", "setpriv", "iptables-save"], &["true"])
        .or_else(|| (!Path::new(MAX).exists()).then(|| "nf_conntrack is not loaded".to_owned()))
}

/// Whether to skip: not root or tools missing (a failure in CI, see
/// `kp_testbed::isolated::skip`).
pub fn skip() -> bool {
    isolated::skip("node test", unavailable())
}

/// The fake global files and the sysctl record directory of one node.
pub struct Globals {
    /// Holds `max`, `hashsize` and `state/`.
    pub dir: tempfile::TempDir,
}

impl Globals {
    /// Fake `nf_conntrack_max` and hash size holding these values.
    pub fn new(max: u64, hashsize: u64) -> Globals {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        for (name, value) in [("max", max), ("hashsize", hashsize)] {
            std::fs::write(dir.path().join(name), format!("{value}\n"))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        std::fs::create_dir(dir.path().join("state")).unwrap_or_else(|e| panic!("state: {e}"));
        Globals { dir }
    }

    /// The value of fake file `name` (`max` or `hashsize`).
    pub fn get(&self, name: &str) -> u64 {
        let path = self.dir.path().join(name);
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{}: {text:?}", path.display()))
    }

    /// The record of changed settings kube-proxy keeps for `--cleanup`.
    pub fn record(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("state/sysctls")).unwrap_or_default()
    }

    /// A script prefix: mounts the fake global files and points the record at `state/`.
    pub fn mounts(&self) -> String {
        let d = self.dir.path().display();
        format!(
            "mount --bind {d}/max {MAX} && mount --bind {d}/hashsize {HASHSIZE} && \
             export KUBE_PROXY_RS_STATE_DIR={d}/state && "
        )
    }

    /// Runs `kube-proxy ARGS` in `ns` with the global files mounted over the real ones.
    pub fn run(&self, ns: &Netns, args: &[&str]) -> Output {
        ns.sh(&format!("{}exec {BIN} {}", self.mounts(), args.join(" ")))
    }
}

/// The node's online CPUs, as kube-proxy counts them for the conntrack table.
pub fn cpus() -> u64 {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    text.trim()
        .split(',')
        .filter(|p| !p.is_empty())
        .map(|part| match part.split_once('-') {
            Some((a, b)) => b.parse::<u64>().unwrap_or(0) + 1 - a.parse::<u64>().unwrap_or(0),
            None => 1,
        })
        .sum::<u64>()
        .max(1)
}
