//! `kube-proxy --init-only` makes upstream's privileged start-up settings and exits 0 without
//! starting the proxy, so a DaemonSet can run it as a privileged init container and the proxy
//! itself unprivileged.
//!
//! Each case runs the real binary in a throwaway network namespace: the per-namespace sysctls
//! (conntrack timeouts, `tcp_be_liberal`, `route_localnet`) are that namespace's real ones.
//! The two global settings (`nf_conntrack_max`, the conntrack hash size) are bind-mounted
//! over by plain files in a private mount namespace, so the test sees what was written
//! without touching the host. Needs root; under `CI=true` its absence is a failure.

use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy");
const NETFILTER: &str = "/proc/sys/net/netfilter";
const MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";
const HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// A network namespace deleted on drop, even when the test panics.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("kpio-{}-{tag}", std::process::id());
        let status = Command::new("ip").args(["netns", "add", &name]).status();
        assert!(status.is_ok_and(|s| s.success()), "ip netns add {name}");
        Netns(name)
    }

    fn read(&self, path: &str) -> String {
        let out = self.sh(&format!("cat {path}"));
        assert!(out.status.success(), "cat {path}: {}", stderr(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn write(&self, path: &str, value: &str) {
        let out = self.sh(&format!("echo {value} > {path}"));
        assert!(out.status.success(), "writing {path}: {}", stderr(&out));
    }

    /// Runs a shell script inside, in a mount namespace of its own.
    fn sh(&self, script: &str) -> Output {
        Command::new("ip")
            .args([
                "netns", "exec", &self.0, "unshare", "-m", "sh", "-c", script,
            ])
            .output()
            .unwrap_or_else(|e| panic!("ip netns exec: {e}"))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Root, `unshare` and a conntrack-enabled kernel, or why not.
fn unavailable() -> Option<String> {
    let id = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&id.stdout).trim() != "0" {
        return Some("not root".into());
    }
    if Command::new("unshare").arg("--version").output().is_err() {
        return Some("unshare is missing".into());
    }
    if !Path::new(MAX).exists() {
        return Some("nf_conntrack is not loaded".into());
    }
    None
}

fn skip() -> bool {
    match unavailable() {
        None => false,
        Some(why) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("init-only tests cannot run under CI=true: {why}")
        }
        Some(why) => {
            eprintln!("skipping: {why}");
            true
        }
    }
}

/// The fake global files and the record directory of one run.
struct Globals {
    dir: tempfile::TempDir,
}

impl Globals {
    fn new(max: u64, hashsize: u64) -> Globals {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        for (name, value) in [("max", max), ("hashsize", hashsize)] {
            std::fs::write(dir.path().join(name), format!("{value}\n"))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        std::fs::create_dir(dir.path().join("state")).unwrap_or_else(|e| panic!("state: {e}"));
        Globals { dir }
    }

    fn get(&self, name: &str) -> u64 {
        let path = self.dir.path().join(name);
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{}: {text:?}", path.display()))
    }

    fn record(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("state/sysctls")).unwrap_or_default()
    }

    /// Runs `kube-proxy ARGS` in `ns` with the global files mounted over the real ones.
    fn run(&self, ns: &Netns, args: &[&str]) -> Output {
        let d = self.dir.path().display();
        let script = format!(
            "mount --bind {d}/max {MAX} && mount --bind {d}/hashsize {HASHSIZE} && \
             KUBE_PROXY_RS_STATE_DIR={d}/state exec {BIN} {}",
            args.join(" ")
        );
        ns.sh(&script)
    }
}

fn cpus() -> u64 {
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

#[test]
fn iptables_mode_sets_conntrack_and_route_localnet_then_exits() {
    if skip() {
        return;
    }
    let host_max = std::fs::read_to_string(MAX).unwrap_or_default();
    let host_liberal = std::fs::read_to_string(format!("{NETFILTER}/nf_conntrack_tcp_be_liberal"))
        .unwrap_or_default();
    let ns = Netns::new("ipt");
    ns.write("/proc/sys/net/ipv4/conf/all/route_localnet", "0");
    ns.write(&format!("{NETFILTER}/nf_conntrack_tcp_be_liberal"), "0");
    let globals = Globals::new(1000, 250);
    let out = globals.run(
        &ns,
        &[
            "--init-only",
            "--proxy-mode=iptables",
            "--conntrack-tcp-be-liberal",
            "--conntrack-udp-timeout=33s",
            "--conntrack-udp-timeout-stream=2m3s",
            "--conntrack-tcp-timeout-established=4h",
            "--conntrack-tcp-timeout-close-wait=7m",
            // Nothing is listening here: init-only must not need the API server.
            "--master=https://127.0.0.1:1",
        ],
    );
    assert!(out.status.success(), "init-only failed: {}", stderr(&out));
    let log = stderr(&out);
    assert!(
        log.contains("System initialized and --init-only specified"),
        "{log}"
    );
    assert!(!log.contains("Using node name"), "the proxy started: {log}");

    let want_max = (32_768 * cpus()).max(131_072);
    assert_eq!(globals.get("max"), want_max);
    assert_eq!(globals.get("hashsize"), want_max / 4);
    for (key, want) in [
        ("nf_conntrack_tcp_be_liberal", "1"),
        ("nf_conntrack_udp_timeout", "33"),
        ("nf_conntrack_udp_timeout_stream", "123"),
        ("nf_conntrack_tcp_timeout_established", "14400"),
        ("nf_conntrack_tcp_timeout_close_wait", "420"),
    ] {
        assert_eq!(ns.read(&format!("{NETFILTER}/{key}")), want, "{key}");
    }
    assert_eq!(ns.read("/proc/sys/net/ipv4/conf/all/route_localnet"), "1");
    // Recorded for --cleanup, as at a normal start.
    let record = globals.record();
    assert!(record.contains("route_localnet 0 1"), "{record}");

    // The host's own settings are untouched.
    assert_eq!(std::fs::read_to_string(MAX).unwrap_or_default(), host_max);
    assert_eq!(
        std::fs::read_to_string(format!("{NETFILTER}/nf_conntrack_tcp_be_liberal"))
            .unwrap_or_default(),
        host_liberal
    );

    // A second run (what the unprivileged proxy's start-up does) finds nothing to write.
    let again = globals.run(
        &ns,
        &[
            "--init-only",
            "--proxy-mode=iptables",
            "--conntrack-tcp-be-liberal",
            "--conntrack-udp-timeout=33s",
            "--conntrack-udp-timeout-stream=2m3s",
            "--conntrack-tcp-timeout-established=4h",
            "--conntrack-tcp-timeout-close-wait=7m",
        ],
    );
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        !stderr(&again).contains("set kernel setting"),
        "{}",
        stderr(&again)
    );
}

#[test]
fn nftables_mode_leaves_route_localnet_and_an_admins_larger_table() {
    if skip() {
        return;
    }
    let ns = Netns::new("nft");
    ns.write("/proc/sys/net/ipv4/conf/all/route_localnet", "0");
    let before = ns.read(&format!("{NETFILTER}/nf_conntrack_tcp_timeout_established"));
    // An admin's bigger table is never shrunk.
    let globals = Globals::new(4_000_000, 1_000_000);
    let out = globals.run(
        &ns,
        &[
            "--init-only",
            "--proxy-mode=nftables",
            "--conntrack-tcp-timeout-established=0s",
        ],
    );
    assert!(out.status.success(), "init-only failed: {}", stderr(&out));
    assert_eq!(globals.get("max"), 4_000_000);
    assert_eq!(globals.get("hashsize"), 1_000_000);
    assert_eq!(ns.read("/proc/sys/net/ipv4/conf/all/route_localnet"), "0");
    // 0s leaves the kernel's value.
    assert_eq!(
        ns.read(&format!("{NETFILTER}/nf_conntrack_tcp_timeout_established")),
        before
    );
    // The default close-wait timeout (1h) is set.
    assert_eq!(
        ns.read(&format!("{NETFILTER}/nf_conntrack_tcp_timeout_close_wait")),
        "3600"
    );
}

#[test]
fn a_setting_that_cannot_be_made_fails_the_init_container() {
    if skip() {
        return;
    }
    let ns = Netns::new("ro");
    let globals = Globals::new(1000, 250);
    // A read-only /proc/sys (an unprivileged container's) cannot take the timeouts.
    let d = globals.dir.path().display();
    let out = ns.sh(&format!(
        "mount --bind {d}/max {MAX} && mount --bind {d}/hashsize {HASHSIZE} && \
         mount -o remount,bind,ro {MAX} && mount --bind -o ro {NETFILTER} {NETFILTER} && \
         KUBE_PROXY_RS_STATE_DIR={d}/state exec {BIN} --init-only --proxy-mode=nftables"
    ));
    assert!(!out.status.success(), "init-only succeeded read-only");
    let log = stderr(&out);
    assert!(log.contains("--init-only"), "{log}");
    assert!(
        log.contains("read-only") || log.contains("nf_conntrack"),
        "{log}"
    );
}
