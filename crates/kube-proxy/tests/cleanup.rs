//! `kube-proxy --cleanup` removes every kernel mode's state whatever mode it is given (as
//! upstream), so a node moves between modes in either direction: leftovers of iptables,
//! userspace and nftables mode are laid out by hand in a throwaway network namespace, then
//! each mode's `--cleanup` must remove all of them and nothing foreign. (ipvs mode's part
//! needs IPVS, which this kernel lacks: the VM suite's `node_addresses_and_cleanup` covers it.)
//! Needs root; under `CI=true` its absence is a failure, not a skip.

use std::process::Command;

use kp_testbed::{Namespace, isolated};

/// A throwaway namespace for `tag` (deleted on drop, even when the test panics).
fn namespace(tag: &str) -> Namespace {
    Namespace::create("kpcl-", tag).unwrap_or_else(|e| panic!("namespace: {e}"))
}

/// Runs `args` inside `ns`; panics with its stderr when it fails.
fn run(ns: &Namespace, args: &[&str]) -> String {
    ns.exec(args).unwrap_or_else(|e| panic!("{e}"))
}

/// Whether the test can run (root, the tools); in CI it must (a missing prerequisite fails).
fn ready(test: &str) -> bool {
    !isolated::skip(test, isolated::missing(&["iptables", "nft"], &["true"]))
}

/// What the modes leave behind, and something foreign of each kind.
fn lay_out_leftovers(ns: &Namespace) {
    let rules = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]\n\
                 :KUBE-PORTALS-CONTAINER - [0:0]\n:FOREIGN-NAT - [0:0]\n\
                 -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                 -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp --dport 443 -j KUBE-SVC-ABCDEFGHIJKLMNOP\n\
                 -A FOREIGN-NAT -d 198.18.0.1/32 -j RETURN\nCOMMIT\n";
    let input = std::env::temp_dir().join(format!("{}.rules", ns.name()));
    std::fs::write(&input, rules).expect("write rules");
    let path = input.to_string_lossy().into_owned();
    run(
        ns,
        &[
            "sh",
            "-c",
            &format!("iptables-restore --noflush < '{path}'"),
        ],
    );
    let _ = std::fs::remove_file(&input);
    for table in ["ip kube-proxy", "ip6 kube-proxy", "ip foreign"] {
        let mut args = vec!["nft", "add", "table"];
        args.extend(table.split(' '));
        run(ns, &args);
    }
}

#[test]
fn cleanup_in_any_mode_removes_every_modes_state() {
    if !ready("cleanup_in_any_mode_removes_every_modes_state") {
        return;
    }
    let binary = env!("CARGO_BIN_EXE_kube-proxy");
    for mode in ["iptables", "nftables", "userspace", "ipvs"] {
        let ns = namespace(mode);
        lay_out_leftovers(&ns);
        let state = tempfile::tempdir().expect("state dir");
        let env = format!("KUBE_PROXY_RS_STATE_DIR={}", state.path().display());
        run(
            &ns,
            &[
                "env",
                &env,
                binary,
                "--cleanup",
                &format!("--proxy-mode={mode}"),
            ],
        );
        let save = run(&ns, &["iptables-save", "-t", "nat"]);
        let tables = run(&ns, &["nft", "list", "tables"]);
        assert!(
            !save.contains("KUBE-"),
            "{mode}: KUBE- chains left after --cleanup:\n{save}"
        );
        assert!(
            save.contains("-A FOREIGN-NAT -d 198.18.0.1/32 -j RETURN"),
            "{mode}: a foreign rule went:\n{save}"
        );
        assert!(
            !tables.contains("kube-proxy"),
            "{mode}: nftables mode's tables left after --cleanup:\n{tables}"
        );
        assert!(tables.contains("table ip foreign"), "{mode}: {tables}");
    }
}

#[test]
fn iptables_mode_removes_nftables_leftovers_after_its_first_sync() {
    if !ready("iptables_mode_removes_nftables_leftovers_after_its_first_sync") {
        return;
    }
    let ns = namespace("start");
    lay_out_leftovers(&ns);
    let state = tempfile::tempdir().expect("state dir");
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/cluster");
    let mut child = ns
        .command(env!("CARGO_BIN_EXE_kube-proxy"))
        .args([
            &format!("--manifests={examples}"),
            "--hostname-override=node-1",
            "--proxy-mode=iptables",
            "--cluster-cidr=10.244.0.0/16",
            "--conntrack-max-per-core=0",
        ])
        .env("KUBE_PROXY_RS_STATE_DIR", state.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start kube-proxy");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let tables = loop {
        let tables = run(&ns, &["nft", "list", "tables"]);
        if !tables.contains("kube-proxy") || std::time::Instant::now() > deadline {
            break tables;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let save = run(&ns, &["iptables-save", "-t", "nat"]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        !tables.contains("kube-proxy"),
        "nftables mode's tables left while iptables mode runs:\n{tables}"
    );
    assert!(tables.contains("table ip foreign"), "{tables}");
    // The leftovers have no endpoint chains: these are the examples' own, so it synced.
    assert!(save.contains(":KUBE-SEP-"), "iptables mode synced:\n{save}");
}

#[test]
fn cleanup_needs_no_api_server_and_fake_mode_has_nothing_to_remove() {
    // Nothing listens at --master: --cleanup must neither wait for it nor read the Node.
    let state = tempfile::tempdir().expect("state dir");
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args([
            "--cleanup",
            "--proxy-mode=fake",
            "--master=https://127.0.0.1:1",
        ])
        .env("KUBE_PROXY_RS_STATE_DIR", state.path())
        .output()
        .expect("run kube-proxy");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("nothing was ever installed"), "{log}");
    assert!(!log.contains("Using node name"), "the proxy started: {log}");
}
