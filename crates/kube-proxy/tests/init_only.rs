//! `kube-proxy --init-only` makes upstream's privileged start-up settings and exits 0 without
//! starting the proxy, so a DaemonSet can run it as a privileged init container and the proxy
//! itself unprivileged.
//!
//! Each case runs the real binary in a throwaway network namespace: the per-namespace sysctls
//! (conntrack timeouts, `tcp_be_liberal`, `route_localnet`) are that namespace's real ones.
//! The two global settings (`nf_conntrack_max`, the conntrack hash size) are bind-mounted
//! over by plain files in a private mount namespace, so the test sees what was written
//! without touching the host. Needs root; under `CI=true` its absence is a failure.

use crate::node;

use node::{BIN, Globals, MAX, NETFILTER, Netns, ROUTE_LOCALNET, cpus, skip, stderr};

#[test]
fn iptables_mode_sets_conntrack_and_route_localnet_then_exits() {
    if skip() {
        return;
    }
    let host_max = std::fs::read_to_string(MAX).unwrap_or_default();
    let host_liberal = std::fs::read_to_string(format!("{NETFILTER}/nf_conntrack_tcp_be_liberal"))
        .unwrap_or_default();
    let ns = Netns::new("ipt");
    ns.write(ROUTE_LOCALNET, "0");
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
    assert_eq!(ns.read(ROUTE_LOCALNET), "1");
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
    ns.write(ROUTE_LOCALNET, "0");
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
    assert_eq!(ns.read(ROUTE_LOCALNET), "0");
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
    let out = ns.sh(&format!(
        "{}mount --bind -o ro {NETFILTER} {NETFILTER} && \
         exec {BIN} --init-only --proxy-mode=nftables",
        globals.mounts()
    ));
    assert!(!out.status.success(), "init-only succeeded read-only");
    let log = stderr(&out);
    assert!(log.contains("--init-only"), "{log}");
    assert!(
        log.contains("read-only") || log.contains("nf_conntrack"),
        "{log}"
    );
}

#[test]
fn ipvs_mode_prepares_ipvs_or_the_iptables_fallback() {
    if skip() {
        return;
    }
    let ns = Netns::new("ipvs");
    ns.write(ROUTE_LOCALNET, "0");
    let globals = Globals::new(1000, 250);
    let out = globals.run(&ns, &["--init-only", "--proxy-mode=ipvs"]);
    assert!(out.status.success(), "init-only failed: {}", stderr(&out));
    let log = stderr(&out);
    if log.contains("Can't use the IPVS proxier") {
        // No IPVS in this kernel (the case on the CI host): the proxy will fall back to
        // iptables mode, so its settings are the ones made.
        assert!(
            log.contains("Falling back to the iptables proxier"),
            "{log}"
        );
        assert_eq!(ns.read(ROUTE_LOCALNET), "1");
    } else {
        // IPVS works here: its sysctls are made (IPVS needs conntrack for SNAT).
        assert_eq!(ns.read("/proc/sys/net/ipv4/vs/conntrack"), "1");
    }
    assert!(globals.get("max") >= 131_072);
}
