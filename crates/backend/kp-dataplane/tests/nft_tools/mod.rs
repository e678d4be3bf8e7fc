//! The `nft` helpers the nftables kernel test files share.

use std::process::{Command, Stdio};

/// Why nftables kernel tests cannot run here, if they cannot.
pub fn unavailable() -> Option<String> {
    let nft = Command::new("nft")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !nft.is_ok_and(|s| s.success()) {
        return Some("nft not found (apt-get install -y nftables)".into());
    }
    // Creating a table inside a fresh namespace proves both root and nf_tables support.
    let probe = Command::new("unshare")
        .args(["-n", "nft", "add", "table", "ip", "kp-probe"])
        .stderr(Stdio::null())
        .status();
    if !probe.is_ok_and(|s| s.success()) {
        return Some("cannot use nftables in a new network namespace (needs root)".into());
    }
    None
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
