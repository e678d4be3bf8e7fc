//! Running a test body in a throwaway network namespace, shared by the kernel test files.
//!
//! The test binary re-executes itself as `unshare -n <binary> --exact <test>` and the child
//! runs the body. An unnamed namespace lives exactly as long as its processes, so the kernel
//! removes it (with every rule, table and conntrack entry made in it) when the child exits,
//! whether the body passed, panicked or was killed. The child refuses to run a body in the
//! namespace of its parent or of PID 1, so a harness bug can never touch the host.

use std::process::{Command, Stdio};

/// Set in the child to the name of the test it runs.
const CHILD_ENV: &str = "KP_DATAPLANE_NETNS_TEST";
/// The parent's network namespace, so the child can check it is elsewhere.
const PARENT_NS_ENV: &str = "KP_DATAPLANE_PARENT_NETNS";
/// Make unavailable prerequisites a failure instead of a skip (also implied by `CI`).
const REQUIRE_ENV: &str = "KP_DATAPLANE_REQUIRE_KERNEL_TESTS";

fn netns_id(pid: &str) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .ok()
        .map(|p| p.display().to_string())
}

/// Run `body` in a fresh network namespace. `name` must be the test function's name;
/// `unavailable` says why the prerequisites are missing, if they are (a skip, or a failure
/// under `CI`).
pub fn run_isolated(name: &str, unavailable: impl FnOnce() -> Option<String>, body: impl FnOnce()) {
    if std::env::var(CHILD_ENV).as_deref() == Ok(name) {
        let mine = netns_id("self").expect("own network namespace readable");
        let parent = std::env::var(PARENT_NS_ENV).expect("parent namespace passed");
        assert_ne!(
            mine, parent,
            "refusing to run in the parent's network namespace"
        );
        if let Some(init) = netns_id("1") {
            assert_ne!(mine, init, "refusing to run in PID 1's network namespace");
        }
        body();
        return;
    }
    if let Some(reason) = unavailable() {
        assert!(
            std::env::var_os(REQUIRE_ENV).is_none() && std::env::var_os("CI").is_none(),
            "{name}: kernel test required but {reason}"
        );
        eprintln!("SKIPPED {name}: {reason}");
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let parent = netns_id("self").expect("own network namespace readable");
    let output = Command::new("unshare")
        .arg("-n")
        .arg(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .env(PARENT_NS_ENV, parent)
        .output()
        .expect("run the test binary under unshare");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("--- child stdout ---\n{stdout}\n--- child stderr ---\n{stderr}");
    assert!(output.status.success(), "{name} failed in its namespace");
    // A misspelt name would run nothing and still succeed.
    assert!(
        stdout.contains("1 passed"),
        "{name} did not run in the child"
    );
}

/// Why tests needing `tools` (each answering `--version`) and a new network namespace cannot
/// run here, if they cannot.
#[allow(dead_code)] // each test file includes this module; not every one needs every helper
pub fn missing_tools(tools: &[&str]) -> Option<String> {
    let works = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(tool) = tools.iter().find(|tool| !works(tool, &["--version"])) {
        return Some(format!(
            "{tool} not found (apt-get install -y iptables conntrack)"
        ));
    }
    if !works("unshare", &["-n", "true"]) {
        return Some("cannot create a network namespace (`unshare -n` needs root)".into());
    }
    None
}

/// Run `command` with `sh -c`; its stdout (panics on failure, with stderr).
#[allow(dead_code)] // see `missing_tools`
pub fn sh(command: &str) -> String {
    let output = Command::new("sh")
        .args(["-c", command])
        .output()
        .expect("run sh");
    assert!(
        output.status.success(),
        "`{command}` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
