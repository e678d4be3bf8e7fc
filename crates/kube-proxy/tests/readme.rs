//! README's two commands: the first sets up and runs the demo, the second installs what the
//! tests need and runs them, and `.ci/run` runs that second command first, so what CI proves
//! is what a new user types; its other steps are the gates docs/testing.md lists. `setup.sh --tests` must know every tool the test suites
//! need beyond the proxy's own.

use std::path::{Path, PathBuf};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    let path = repo_root().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The lines of README's first code block.
fn readme_commands() -> Vec<String> {
    let readme = read("README.md");
    let block = readme
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("README has a ```sh block");
    block.lines().map(str::to_owned).collect()
}

#[test]
fn readme_starts_with_the_setup_and_the_test_command() {
    let commands = readme_commands();
    assert_eq!(commands.len(), 2, "two commands: {commands:?}");
    assert_eq!(
        commands[0],
        "./setup.sh && cargo run --release -p kube-proxy --features demo -- demo"
    );
    assert!(
        commands[1].starts_with("./setup.sh --tests && ")
            && commands[1].ends_with("cargo test --workspace --locked"),
        "the test command installs what the tests need first: {:?}",
        commands[1]
    );
}

/// `.ci/run`'s steps: its lines but comments, blank lines and the shell's set-up.
fn ci_steps() -> Vec<String> {
    read(".ci/run")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter(|l| !l.starts_with("set ") && !l.starts_with("cd "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn ci_runs_the_readme_test_command_then_the_gates_testing_md_lists() {
    let test_command = readme_commands().pop().expect("two commands");
    let steps = ci_steps();
    assert_eq!(steps.first(), Some(&test_command), "{steps:?}");
    // Every other step is a gate, listed in docs/testing.md's "What CI runs" block.
    let testing = read("docs/testing.md");
    let section = testing
        .split("## What CI runs\n")
        .nth(1)
        .expect("docs/testing.md has a \"What CI runs\" section");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the section has a ```sh block");
    let listed: Vec<&str> = block.lines().collect();
    assert_eq!(listed, steps[1..], "docs/testing.md's gates are .ci/run's");
}

#[test]
fn setup_installs_what_the_test_suites_run() {
    let setup = read("setup.sh");
    // Programs the suites exec that a fresh Debian machine lacks, each mapped to its package.
    for (command, package) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("ipvsadm", "ipvsadm"),
        ("debootstrap", "debootstrap"),
        ("depmod", "kmod"),
        ("xz", "xz-utils"),
        ("iptables-restore", "iptables"),
        ("nft", "nftables"),
        ("conntrack", "conntrack"),
        ("ipset", "ipset"),
        ("cc", "build-essential"),
        ("clang", "clang"),
    ] {
        assert!(
            setup.contains(&format!("[{command}]={package}")),
            "setup.sh maps {command} to {package}"
        );
    }
    assert!(setup.contains("busybox-static"), "the VM's static busybox");
    assert!(
        setup.contains("libbpf-dev"),
        "the BPF programs' headers (kp-socklb)"
    );
    // CI's gates: the licence and source check is not part of rustup's toolchain.
    assert!(
        setup.contains("cargo install --locked cargo-deny"),
        "setup.sh installs cargo-deny"
    );
}
