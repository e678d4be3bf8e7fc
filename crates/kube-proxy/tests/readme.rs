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

/// The crates whose integration suites are gathered into one binary (`autotests = false`,
/// their `[[test]]` roots naming each suite as a `mod`), and for each the suite files under
/// `tests/` that no root names: such a file would never be built or run.
fn unrun_suites() -> Vec<String> {
    let mut unrun = Vec::new();
    for manifest in ["crates", "tools"]
        .iter()
        .flat_map(|top| manifests_under(&repo_root().join(top)))
    {
        let text = std::fs::read_to_string(&manifest).expect("manifest readable");
        if !text.lines().any(|l| l.trim() == "autotests = false") {
            continue;
        }
        let dir = manifest.parent().expect("a crate directory").to_path_buf();
        let roots: Vec<String> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("path = \"tests/"))
            .filter_map(|l| l.strip_suffix(".rs\""))
            .map(str::to_owned)
            .collect();
        let named: Vec<String> = roots
            .iter()
            .flat_map(|root| {
                let body = std::fs::read_to_string(dir.join(format!("tests/{root}.rs")))
                    .expect("test root readable");
                body.lines()
                    .filter_map(|l| l.trim().strip_prefix("mod "))
                    .filter_map(|l| l.strip_suffix(';'))
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        for entry in std::fs::read_dir(dir.join("tests")).expect("tests/ readable") {
            let path = entry.expect("tests/ entry").path();
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default();
            let suite =
                path.extension().is_some_and(|e| e == "rs") || path.join("mod.rs").is_file();
            if suite && !roots.iter().any(|r| r == stem) && !named.iter().any(|n| n == stem) {
                unrun.push(path.display().to_string());
            }
        }
    }
    unrun
}

/// The `Cargo.toml`s one and two directories below `top` (`crates/kube-proxy`,
/// `crates/render/kp-rules`, `tools/kp-bench`).
fn manifests_under(top: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let subdirs = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default()
    };
    for first in subdirs(top) {
        found.push(first.join("Cargo.toml"));
        found.extend(
            subdirs(&first)
                .into_iter()
                .map(|second| second.join("Cargo.toml")),
        );
    }
    found.retain(|manifest| manifest.is_file());
    found
}

#[test]
fn every_gathered_suite_file_is_a_module_of_its_test_binary() {
    let unrun = unrun_suites();
    assert!(
        unrun.is_empty(),
        "suite files no test binary builds (add a `mod` line to the crate's tests root): {unrun:?}"
    );
}
