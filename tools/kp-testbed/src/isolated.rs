//! Tests in a network namespace nobody names: the kernel removes it, with every rule, table,
//! device and conntrack entry made in it, when its last process exits, whether the test
//! passed, panicked or was killed, so there is nothing to clean up. (A namespace other
//! processes must find by name, such as a cluster's or a node's for the binary under test,
//! is a [`crate::Namespace`].)
//!
//! - [`run`]: the test re-executes its own binary under `unshare -n` and the child runs the
//!   body, for code that programs the kernel from the test process itself (backends, netlink
//!   sockets). The child refuses to run in its parent's or PID 1's namespace, so a harness bug
//!   can never touch the host.
//! - [`on_thread`]: the body on a thread that moved to a namespace of its own, for a test that
//!   compares two namespaces.
//! - [`script`]: a shell script under `unshare -n`, for tests of the tools alone.
//!
//! Prerequisites: [`missing`] says why a test cannot run here (not root, a tool missing);
//! [`required`] and [`skip`] make that a skip on a developer's machine and a failure under
//! `CI` or [`REQUIRE_ENV`], where the tests must run.

use std::process::{Command, Stdio};

/// Set (to anything) to make a test that cannot run a failure instead of a skip; `CI` does
/// the same.
pub const REQUIRE_ENV: &str = "KP_REQUIRE_KERNEL_TESTS";
/// Set in [`run`]'s child to the name of the test it runs.
const CHILD_ENV: &str = "KP_TESTBED_ISOLATED_TEST";
/// The parent's network namespace, so [`run`]'s child can check it is elsewhere.
const PARENT_NS_ENV: &str = "KP_TESTBED_PARENT_NETNS";

fn netns_id(pid: &str) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .ok()
        .map(|p| p.display().to_string())
}

/// Why tests needing `tools` (each answering `--version`) cannot run here, if they cannot:
/// `probe` (a program and its arguments, such as `["true"]` or `["nft", "add", "table", "ip",
/// "x"]`) must also succeed in a new network namespace, which proves root and kernel support.
pub fn missing(tools: &[&str], probe: &[&str]) -> Option<String> {
    let works = |command: &mut Command| {
        command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if let Some(tool) = tools
        .iter()
        .find(|tool| !works(Command::new(tool).arg("--version")))
    {
        return Some(format!("{tool} not found (see setup.sh --tests)"));
    }
    if !works(Command::new("unshare").arg("-n").args(probe)) {
        return Some(format!(
            "cannot run {probe:?} in a new network namespace (`unshare -n` needs root)"
        ));
    }
    None
}

/// Whether a test must run whatever is missing: under `CI` or [`REQUIRE_ENV`].
fn must_run() -> bool {
    std::env::var_os("CI").is_some() || std::env::var_os(REQUIRE_ENV).is_some()
}

/// `reason` a test cannot run here, passed on for the caller to skip; where tests must run
/// (`CI`, [`REQUIRE_ENV`]) a panic instead.
pub fn required(reason: Option<String>) -> Option<String> {
    if let Some(reason) = &reason {
        assert!(!must_run(), "kernel test required but {reason}");
    }
    reason
}

/// Whether `test` is to be skipped because of `reason` (printed); see [`required`].
pub fn skip(test: &str, reason: Option<String>) -> bool {
    match required(reason) {
        Some(reason) => {
            eprintln!("SKIPPED {test}: {reason}");
            true
        }
        None => false,
    }
}

/// Runs `body` in a fresh network namespace, in a child process running only this test.
/// `test` is the test's path inside its file (the function name, prefixed with its module
/// inside the file); when the file is a module of a test binary gathering several suites
/// (`tests/rules.rs` holding `mod explain;`), the file's module is put in front, so the
/// harness finds the test by its full path. `unavailable` says why the prerequisites are
/// missing, if they are ([`skip`]).
#[track_caller]
pub fn run(test: &str, unavailable: impl FnOnce() -> Option<String>, body: impl FnOnce()) {
    let test = &harness_path(std::panic::Location::caller().file(), test);
    if std::env::var(CHILD_ENV).as_deref() == Ok(test.as_str()) {
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
    if skip(test, unavailable()) {
        return;
    }
    let exe = std::env::current_exe().expect("test binary path");
    let parent = netns_id("self").expect("own network namespace readable");
    let output = Command::new("unshare")
        .arg("-n")
        .arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, test.as_str())
        .env(PARENT_NS_ENV, parent)
        .output()
        .expect("run the test binary under unshare");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("--- child stdout ---\n{stdout}\n--- child stderr ---\n{stderr}");
    assert!(output.status.success(), "{test} failed in its namespace");
    // A misspelt name would run nothing and still succeed.
    assert!(
        stdout.contains("1 passed"),
        "{test} did not run in the child"
    );
}

/// `test`'s path as the harness names it: `test`, or `file_module::test` when `file` (the
/// caller's source file) is not the test binary's root but a module of it, named after the
/// file (`tests/explain.rs` in the binary `rules`).
fn harness_path(file: &str, test: &str) -> String {
    let module = std::path::Path::new(file)
        .file_stem()
        .and_then(|stem| stem.to_str())
        .unwrap_or_default();
    let binary = std::env::current_exe().ok().and_then(|exe| {
        let name = exe.file_name()?.to_str()?.to_owned();
        // Cargo names test executables `<target>-<hash>`.
        Some(
            name.rsplit_once('-')
                .map_or(name.clone(), |(target, _)| target.to_owned()),
        )
    });
    let is_root = binary.is_some_and(|binary| binary.replace('-', "_") == module);
    if is_root || module.is_empty() || module == "mod" || test.starts_with(&format!("{module}::")) {
        test.to_owned()
    } else {
        format!("{module}::{test}")
    }
}

/// Runs `f` on a new thread in a new, empty network namespace of its own; programs it starts
/// run there too. The namespace goes away with the thread (and those programs).
pub fn on_thread<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // `unshare_unsafe` is only unsafe for CLONE_FILES; the workspace forbids
                // unsafe code, so the safe (deprecated) wrapper is used for CLONE_NEWNET.
                #[allow(deprecated)]
                rustix::thread::unshare(rustix::thread::UnshareFlags::NEWNET)
                    .expect("unshare(CLONE_NEWNET)");
                f()
            })
            .join()
            .expect("netns thread")
    })
}

/// Runs `script` with `sh -c` in a new network namespace (gone when the shell exits); its
/// standard output, or its standard error when it failed.
pub fn script(script: &str) -> Result<String, String> {
    let out = Command::new("unshare")
        .args(["-n", "sh", "-c", script])
        .output()
        .map_err(|e| format!("cannot run unshare: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Runs `command` with `sh -c` in the caller's namespace (inside [`run`]'s body, the test's
/// own); its standard output. Panics with its standard error when it fails.
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
