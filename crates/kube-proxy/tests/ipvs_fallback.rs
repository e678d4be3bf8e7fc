//! `--proxy-mode ipvs` on a kernel without IPVS (this machine's): the binary logs upstream's
//! "Can't use the IPVS proxier" with the reason and runs iptables mode instead, programming
//! iptables rules. It runs inside a throwaway network namespace (kp-testbed's), so the
//! host's rules are never touched. On a kernel that does have IPVS the test checks the
//! opposite: ipvs mode is used.

use std::path::PathBuf;
use std::time::Duration;

use kp_testbed::proxy::ProxyLaunch;
use kp_testbed::{Namespace, isolated};

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster")
}

/// Whether this kernel offers the IPVS generic netlink family (what the binary probes).
fn kernel_has_ipvs() -> bool {
    kp_ipvs::NetlinkIpvs::open().is_ok()
}

#[test]
fn ipvs_mode_falls_back_to_iptables_without_ipvs() {
    let test = "ipvs_mode_falls_back_to_iptables_without_ipvs";
    if isolated::skip(test, isolated::missing(&[], &["true"])) {
        return;
    }
    let binary = env!("CARGO_BIN_EXE_kube-proxy");
    let state = tempfile::tempdir().expect("state dir");
    let ns = Namespace::create("kpfb-", "node").unwrap_or_else(|e| panic!("namespace: {e}"));
    // Start the proxy, wait for its first sync (or its exit), show the nat table, stop it.
    let mut proxy = ProxyLaunch::new(ns.name(), binary)
        .arg(format!("--manifests={}", examples().display()))
        .args(["--hostname-override=node-1", "--proxy-mode=ipvs"])
        .args(["--cluster-cidr=10.244.0.0/16", "--conntrack-max-per-core=0"])
        .args(["--healthz-bind-address=", "--metrics-bind-address="])
        .env(kp_dataplane::sysctls::STATE_DIR_ENV, state.path())
        .spawn()
        .expect("start the proxy in the namespace");
    let synced = proxy.wait_first_sync(Duration::from_secs(30));
    let nat = ns
        .exec(&["iptables-save", "-t", "nat"])
        .unwrap_or_else(|e| format!("iptables-save failed: {e}"));
    let _ = proxy.terminate(Duration::from_secs(30));
    let log_text = proxy.logged(|_| true).join("\n");
    let context = format!("log:\n{log_text}\nnat table:\n{nat}");
    assert!(
        synced.is_ok() && log_text.contains(kp_core::proxier::FIRST_SYNC_LOG),
        "{synced:?}\n{context}"
    );
    if kernel_has_ipvs() {
        assert!(log_text.contains("Using ipvs Proxier"), "{context}");
        assert!(
            !log_text.contains("Can't use the IPVS proxier"),
            "{context}"
        );
    } else {
        assert!(log_text.contains("Can't use the IPVS proxier"), "{context}");
        assert!(
            log_text.contains("IPVS is not available"),
            "reason given: {context}"
        );
        assert!(log_text.contains("Using iptables Proxier"), "{context}");
        assert!(
            log_text.contains("mode=\"iptables\"") || log_text.contains("mode=iptables"),
            "{context}"
        );
        // iptables mode's own chains: a ClusterIP of the examples is programmed.
        assert!(
            nat.contains("-A KUBE-SERVICES") && nat.contains("KUBE-SVC-"),
            "{context}"
        );
    }
}
