//! The VM runner end to end: one boot runs this test binary's ignored (guest) tests inside
//! Debian's kernel. One of them fails on purpose, so the run proves that output, per-test
//! results and a non-zero exit status all come back to the host.

use kp_vm::{Vm, in_guest};

#[test]
fn runs_this_binary_in_the_vm_and_returns_its_results() {
    let out = Vm::from_env()
        .program("ipvsadm")
        .env("KP_VM_FAIL_ON_PURPOSE", "1")
        .run_current_exe(&["--ignored", "--test-threads=1"])
        .unwrap_or_else(|e| panic!("the VM did not run: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- guest stdout ---\n{stdout}--- guest stderr ---\n{stderr}");
    assert!(
        stdout.contains("test guest_kernel_has_ipvs ... ok"),
        "guest test did not pass"
    );
    assert!(stdout.contains("test guest_fails_on_purpose ... FAILED"));
    assert!(stdout.contains("failed on purpose inside the VM"));
    // libtest exits 101 when a test failed.
    assert_eq!(out.status, 101);
}

#[test]
#[ignore = "runs inside the VM (runs_this_binary_in_the_vm_and_returns_its_results)"]
fn guest_kernel_has_ipvs() {
    assert!(in_guest(), "must run inside the VM");
    let modules = std::fs::read_to_string("/proc/modules").expect("/proc/modules");
    assert!(modules.contains("ip_vs "), "{modules}");
    // The copied ipvsadm runs and talks to the kernel's IPVS over generic netlink.
    let out = std::process::Command::new("ipvsadm")
        .arg("-Ln")
        .output()
        .expect("ipvsadm runs");
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("IP Virtual Server"));
    // On-demand module loading works (the sctp module is not loaded at boot).
    let status = std::process::Command::new("modprobe")
        .arg("sctp")
        .status()
        .expect("modprobe runs");
    assert!(status.success());
}

#[test]
#[ignore = "runs inside the VM (runs_this_binary_in_the_vm_and_returns_its_results)"]
fn guest_fails_on_purpose() {
    if std::env::var_os("KP_VM_FAIL_ON_PURPOSE").is_some() {
        panic!("failed on purpose inside the VM");
    }
}

#[test]
fn reads_libtest_counts() {
    let out = kp_vm::VmOutput {
        stdout: b"test a ... ok\n\ntest result: FAILED. 12 passed; 3 failed; 0 ignored;\n".to_vec(),
        stderr: Vec::new(),
        status: 101,
        console: String::new(),
        elapsed: std::time::Duration::ZERO,
    };
    assert_eq!(out.libtest_counts(), Some((12, 3)));
    let result = std::panic::catch_unwind(|| out.assert_tests_passed(1));
    assert!(
        result.is_err(),
        "a failed guest suite must fail the host test"
    );
}
