//! The `nft` helpers the nftables kernel test files share.

use std::process::Command;

/// Why nftables kernel tests cannot run here, if they cannot: creating a table inside a
/// fresh namespace proves both root and nf_tables support.
pub fn unavailable() -> Option<String> {
    kp_testbed::isolated::missing(&["nft"], &["nft", "add", "table", "ip", "kp-probe"])
}

/// Runs `nft args` and returns its stdout (panics on failure).
pub fn nft(args: &[&str]) -> String {
    let output = Command::new("nft").args(args).output().expect("run nft");
    assert!(
        output.status.success(),
        "`nft {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// An endpoint address (10.0.0.1) on `lo` and a route for the service range 10.96.0.0/16
/// through it: the service addresses only need a route, output DNAT rewrites them.
pub fn endpoint_on_lo() {
    kp_testbed::isolated::sh(
        "ip link set lo up && ip addr add 10.0.0.1/32 dev lo \
         && ip route add 10.96.0.0/16 dev lo src 10.0.0.1",
    );
}
