//! `kube-proxy explain`: why a packet to DEST goes where it goes. (Being built.)

use std::process::ExitCode;

/// Entry point for `kube-proxy explain ARGS...` (`args` starts with `explain`).
pub fn main(args: impl Iterator<Item = String>) -> ExitCode {
    let _ = args;
    eprintln!("kube-proxy explain: not built yet");
    ExitCode::FAILURE
}
