//! Nothing the harness creates outlives it: not after a drop, not after a panic, and
//! leftovers of crashed runs are swept.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;
use std::sync::Mutex;

use kp_testbed::{Cluster, list_namespaces, sweep_stale};

fn builder() -> kp_testbed::ClusterBuilder {
    Cluster::builder()
        .echo_binary(env!("CARGO_BIN_EXE_kp-echo"))
        .pod("a")
        .remote_pod("c")
}

fn leftovers(prefix: &str) -> Vec<String> {
    list_namespaces()
        .expect("ip netns list works")
        .into_iter()
        .filter(|ns| ns.starts_with(prefix))
        .collect()
}

#[test]
fn drop_removes_every_namespace() {
    let cluster = builder()
        .build()
        .expect("test cluster builds (needs root and iproute2)");
    let prefix = cluster.prefix().to_owned();
    assert_eq!(leftovers(&prefix).len(), cluster.namespaces().len());
    drop(cluster);
    assert_eq!(leftovers(&prefix), Vec::<String>::new());
}

#[test]
fn a_panicking_test_still_cleans_up() {
    let prefix = Mutex::new(None);
    let proxy = Mutex::new(None);
    let result = catch_unwind(AssertUnwindSafe(|| {
        let cluster = builder().build().expect("test cluster builds");
        // A long-running process in the node, as a proxy under test would be.
        let child = Command::new("ip")
            .args(["netns", "exec", cluster.node_ns(), "sleep", "600"])
            .spawn()
            .expect("spawn sleep in the node");
        *proxy.lock().expect("not poisoned") = Some(child);
        *prefix.lock().expect("not poisoned") = Some(cluster.prefix().to_owned());
        panic!("deliberate panic while the cluster is up");
    }));
    assert!(result.is_err(), "the closure panicked");
    let mut proxy = proxy
        .into_inner()
        .expect("not poisoned")
        .expect("the process was started before the panic");
    // Bounded: the cluster's drop already killed it, so this returns at once.
    let status = proxy.wait().expect("reaped");
    assert!(!status.success(), "killed, not finished: {status}");
    let prefix = prefix
        .into_inner()
        .expect("not poisoned")
        .expect("the cluster was built before the panic");
    assert_eq!(leftovers(&prefix), Vec::<String>::new());
}

#[test]
fn explicit_teardown_reports_success() {
    let cluster = builder()
        .dual_stack(false)
        .build()
        .expect("test cluster builds");
    assert_eq!(cluster.pod("a").expect("pod a").ipv6(), None);
    let prefix = cluster.prefix().to_owned();
    cluster.teardown().expect("teardown succeeds");
    assert_eq!(leftovers(&prefix), Vec::<String>::new());
}

/// Deletes a namespace this test made by hand, even if an assertion fails first.
struct Manual(String);

impl Drop for Manual {
    fn drop(&mut self) {
        if list_namespaces().is_ok_and(|all| all.contains(&self.0)) {
            let _ = Command::new("ip")
                .args(["netns", "delete", &self.0])
                .status();
        }
    }
}

#[test]
fn sweep_removes_only_namespaces_of_dead_runs() {
    // A prefix of its own, so parallel tests' clusters are never candidates.
    const PREFIX: &str = "kptsweep-";
    let mut exited = Command::new("true").spawn().expect("spawn true");
    exited.wait().expect("true exits");
    let dead = Manual(format!("{PREFIX}{}-0-node", exited.id()));
    let live = Manual(format!("{PREFIX}{}-0-node", std::process::id()));
    for ns in [&dead.0, &live.0] {
        let status = Command::new("ip")
            .args(["netns", "add", ns])
            .status()
            .expect("ip runs");
        assert!(status.success(), "created {ns}");
    }
    let removed = sweep_stale(PREFIX).expect("sweep works");
    assert_eq!(removed, vec![dead.0.clone()]);
    assert_eq!(leftovers(PREFIX), vec![live.0.clone()]);
}

#[test]
fn the_echo_binary_is_found_next_to_test_executables() {
    let found = kp_testbed::echo_binary().expect("cargo built kp-echo for this crate's tests");
    let expected = std::path::Path::new(env!("CARGO_BIN_EXE_kp-echo"));
    assert_eq!(
        found.canonicalize().expect("exists"),
        expected.canonicalize().expect("exists")
    );
    let missing = Cluster::builder()
        .echo_binary("/nonexistent/kp-echo")
        .build()
        .expect_err("no such binary");
    assert!(
        missing
            .to_string()
            .contains("cargo build -p kp-testbed --bins"),
        "{missing}"
    );
}

#[test]
fn a_lone_namespace_has_loopback_up_and_goes_with_its_processes() {
    let prefix = "kpt-lone-";
    let ns = kp_testbed::Namespace::create(prefix, "node").expect("namespace (needs root)");
    assert!(ns.name().starts_with(prefix), "{}", ns.name());
    let lo = ns
        .exec(&["ip", "-o", "link", "show", "lo"])
        .expect("ip runs");
    assert!(lo.contains("UP"), "{lo}");
    // A proxy started in it through the harness, still running at the drop.
    let mut sleeper = kp_testbed::proxy::ProxyLaunch::new(ns.name(), "sleep")
        .arg("600")
        .spawn()
        .expect("spawn sleep in the namespace");
    assert_eq!(leftovers(prefix), vec![ns.name().to_owned()]);
    drop(ns);
    assert_eq!(leftovers(prefix), Vec::<String>::new());
    // The namespace's drop killed it: the exit is already there to reap.
    let status = sleeper
        .terminate(std::time::Duration::from_secs(5))
        .expect("already exited");
    assert!(!status.success(), "killed, not finished: {status}");
}
