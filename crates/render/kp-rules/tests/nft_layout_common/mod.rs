//! Helpers the verdict-free layout's kernel tests share: run a command, apply `nft -f`
//! text, and the layout's full sync of a state as that text.

#![allow(dead_code)]

use std::io::Write as _;
use std::process::{Command, Stdio};

use kp_core::model::IpFamily;
use kp_core::tracker::ProxyState;
use kp_rules::config::{LocalDetector, NodePortAddresses};
use kp_rules::nftables::layout::{
    Context, FixedConfig, LayoutState, change_script, fixed_part, full_updates,
};
use kp_rules::plan::Masquerading;

/// Runs `args`, which must succeed.
pub fn run(args: &[&str]) {
    let status = Command::new(args[0])
        .args(&args[1..])
        .status()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(status.success(), "{args:?}: {status}");
}

/// `nft -f -` of `script`, which must succeed.
pub fn nft_apply(script: &str) {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("nft runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("script written");
    let status = child.wait().expect("nft exits");
    assert!(status.success(), "nft -f - failed: {status}\n{script}");
}

/// The layout's full sync of `state` in `family`'s table (no detector, NodePorts on every
/// local address), as `nft -f` text.
pub fn full_sync(state: &ProxyState, family: IpFamily) -> String {
    let config = FixedConfig {
        family,
        mark: 0x4000,
        random_fully: true,
        detector: LocalDetector::None,
        node_port_addresses: NodePortAddresses::All,
        service_cidrs: Vec::new(),
        localhost_rejects: &[],
    };
    let ctx = Context {
        family,
        masquerading: Masquerading {
            all: false,
            detector: false,
        },
        node_ip: None,
        localhost_rejects: &[],
    };
    let mut installed = LayoutState::default();
    let changes = installed.changes(full_updates(state, &ctx, &installed));
    let mut script = fixed_part(&config, &Default::default());
    script.extend(change_script(&config, &changes));
    installed.apply(changes);
    script.join("\n") + "\n"
}
