//! The builders and fixtures of [`kp_rules::testutil`], and a runner for `iptables-restore`
//! inside a throwaway network namespace.

#![allow(dead_code, missing_docs, unused_imports)]

use std::io::Write as _;

use kp_core::model::IpFamily;
use kp_rules::iptables::{Setup, Table};

pub use kp_rules::testutil::*;

/// Why the kernel checks cannot run here, if they cannot (a failure in CI, see
/// `kp_testbed::isolated::required`).
pub fn netns_unavailable(tool: &str) -> Option<String> {
    kernel_check_unavailable(tool, &["true"])
}

/// Why kernel checks with `tool` cannot run here, if they cannot: `tool --version` must work,
/// and `probe` must run inside a new network namespace (as root). In CI a missing
/// prerequisite is a failure, never a skip.
pub fn kernel_check_unavailable(tool: &str, probe: &[&str]) -> Option<String> {
    kp_testbed::isolated::required(kp_testbed::isolated::missing(&[tool], probe))
}

/// Feeds each input in turn to `tool --noflush` inside one fresh network namespace, first
/// with `--test` (parsing) and then for real, so the kernel checks what `--test` cannot
/// (jumps to missing chains, targets invalid in a table, deleting referenced chains). The
/// namespace, and everything applied to it, disappears when the shell exits; the host's
/// rules are never read or written. Returns the namespace's final `iptables-save` output, or
/// the failing step and the tool's stderr.
pub fn apply_in_netns(tool: &str, inputs: &[&str]) -> Result<String, String> {
    let save = tool.replace("-restore", "-save");
    run_in_netns(
        inputs,
        |i, path| {
            format!(
                "echo 'step {i} --test' >&2; {tool} --noflush --test < '{path}'\n\
                 echo 'step {i} apply' >&2; {tool} --noflush < '{path}'\n"
            )
        },
        &format!("echo 'save' >&2; {save}"),
    )
}

/// Writes each input to a file and runs, in one shell inside one fresh network namespace
/// (`unshare -n`, `set -e`), the lines `steps(i, path)` gives for input `i`, then `last`.
/// The namespace vanishes when the shell exits. Returns the shell's standard output, or its
/// standard error (the failing step's message) when a step failed.
pub fn run_in_netns(
    inputs: &[&str],
    steps: impl Fn(usize, &str) -> String,
    last: &str,
) -> Result<String, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut shell = String::from("set -e\n");
    for (i, input) in inputs.iter().enumerate() {
        let path = dir.path().join(format!("{i}.in"));
        let mut file = std::fs::File::create(&path).map_err(|e| e.to_string())?;
        file.write_all(input.as_bytes())
            .map_err(|e| e.to_string())?;
        shell.push_str(&steps(i, &path.display().to_string()));
    }
    shell.push_str(last);
    shell.push('\n');
    kp_testbed::isolated::script(&shell)
}

/// The setup (chains and jumps from built-in chains) as restore input, the way a fresh node
/// would get it: chains created, each jump inserted at position 1.
pub fn setup_text(setup: &Setup) -> String {
    let mut text = String::new();
    for table in [Table::Mangle, Table::Filter, Table::Nat] {
        text.push_str(&format!("*{}\n", table.as_str()));
        for (t, chain) in &setup.chains {
            if *t == table {
                text.push_str(&format!(":{chain} - [0:0]\n"));
            }
        }
        for jump in setup.jumps.iter().filter(|j| j.table == table) {
            text.push_str(&format!("-I {} 1 {}\n", jump.from, jump.spec));
        }
        text.push_str("COMMIT\n");
    }
    text
}

pub fn restore_tool(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "iptables-restore",
        IpFamily::V6 => "ip6tables-restore",
    }
}
