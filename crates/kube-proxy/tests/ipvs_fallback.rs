//! `--proxy-mode ipvs` on a kernel without IPVS (this machine's): the binary logs upstream's
//! "Can't use the IPVS proxier" with the reason and runs iptables mode instead, programming
//! iptables rules. It runs inside a throwaway network namespace (`unshare -n`), so the
//! host's rules are never touched. On a kernel that does have IPVS the test checks the
//! opposite: ipvs mode is used.

use std::path::PathBuf;
use std::process::Command;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster")
}

/// Whether this kernel offers the IPVS generic netlink family (what the binary probes).
fn kernel_has_ipvs() -> bool {
    kp_ipvs::NetlinkIpvs::open().is_ok()
}

#[test]
fn ipvs_mode_falls_back_to_iptables_without_ipvs() {
    let ci = std::env::var_os("CI").is_some();
    let root = Command::new("unshare")
        .args(["-n", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !root {
        assert!(!ci, "this test needs root (unshare -n) and runs in CI");
        eprintln!("skipped: needs root for a network namespace");
        return;
    }
    let binary = env!("CARGO_BIN_EXE_kube-proxy");
    let log = tempfile::NamedTempFile::new().expect("log file");
    // Start the proxy, wait for its first sync (or its exit), show the nat table, stop it.
    let script = format!(
        r#"ip link set lo up
"$0" --manifests="$1" --hostname-override=node-1 --proxy-mode=ipvs \
    --cluster-cidr=10.244.0.0/16 --conntrack-max-per-core=0 \
    --healthz-bind-address= --metrics-bind-address= >"$2" 2>&1 &
pid=$!
n=0
while ! grep -q "{first_sync}" "$2" && kill -0 $pid 2>/dev/null && [ $n -lt 300 ]; do
    sleep 0.1; n=$((n+1))
done
iptables-save -t nat
kill -TERM $pid 2>/dev/null; wait $pid
exit 0"#,
        first_sync = kp_core::proxier::FIRST_SYNC_LOG
    );
    let out = Command::new("unshare")
        .args(["-n", "sh", "-c", &script, binary])
        .arg(examples())
        .arg(log.path())
        .output()
        .expect("run the proxy in a namespace");
    let log_text = std::fs::read_to_string(log.path()).expect("read log");
    let nat = String::from_utf8_lossy(&out.stdout);
    let context = format!("log:\n{log_text}\nnat table:\n{nat}");
    assert!(
        log_text.contains(kp_core::proxier::FIRST_SYNC_LOG),
        "{context}"
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
