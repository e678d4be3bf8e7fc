//! `kube-proxy --cleanup` removes every kernel mode's state whatever mode it is given (as
//! upstream), so a node moves between modes in either direction: leftovers of iptables,
//! userspace and nftables mode are laid out by hand in a throwaway network namespace, then
//! each mode's `--cleanup` must remove all of them and nothing foreign. (ipvs mode's part
//! needs IPVS, which this kernel lacks: the VM suite's `node_addresses_and_cleanup` covers it.)
//! Needs root; under `CI=true` its absence is a failure, not a skip.

use std::process::Command;

/// A network namespace deleted on drop, even when the test panics.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("kpcl-{}-{tag}", std::process::id());
        sh("ip", &["netns", "add", &name]);
        let ns = Netns(name);
        ns.run(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// Runs `args` inside; panics with its stderr when it fails.
    fn run(&self, args: &[&str]) -> String {
        let mut full = vec!["netns", "exec", self.0.as_str()];
        full.extend_from_slice(args);
        sh("ip", &full)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Root and the tools, or why not.
fn unavailable() -> Option<String> {
    let id = Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&id.stdout).trim() != "0" {
        return Some("not root".into());
    }
    for tool in ["ip", "iptables", "nft"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Some(format!("{tool} is missing"));
        }
    }
    None
}

/// Whether the test can run; under `CI=true` it must (a missing prerequisite fails).
fn ready() -> bool {
    let Some(why) = unavailable() else {
        return true;
    };
    assert!(
        std::env::var("CI").is_err(),
        "the cleanup test cannot run under CI: {why}"
    );
    eprintln!("skipping: {why}");
    false
}

/// What the modes leave behind, and something foreign of each kind.
fn lay_out_leftovers(ns: &Netns) {
    let rules = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABCDEFGHIJKLMNOP - [0:0]\n\
                 :KUBE-PORTALS-CONTAINER - [0:0]\n:FOREIGN-NAT - [0:0]\n\
                 -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                 -A KUBE-SERVICES -d 10.96.0.1/32 -p tcp --dport 443 -j KUBE-SVC-ABCDEFGHIJKLMNOP\n\
                 -A FOREIGN-NAT -d 198.18.0.1/32 -j RETURN\nCOMMIT\n";
    let input = std::env::temp_dir().join(format!("{}.rules", ns.0));
    std::fs::write(&input, rules).expect("write rules");
    let path = input.to_string_lossy().into_owned();
    ns.run(&[
        "sh",
        "-c",
        &format!("iptables-restore --noflush < '{path}'"),
    ]);
    let _ = std::fs::remove_file(&input);
    for table in ["ip kube-proxy", "ip6 kube-proxy", "ip foreign"] {
        let mut args = vec!["nft", "add", "table"];
        args.extend(table.split(' '));
        ns.run(&args);
    }
}

#[test]
fn cleanup_in_any_mode_removes_every_modes_state() {
    if !ready() {
        return;
    }
    let binary = env!("CARGO_BIN_EXE_kube-proxy");
    for mode in ["iptables", "nftables", "userspace", "ipvs"] {
        let ns = Netns::new(mode);
        lay_out_leftovers(&ns);
        let state = tempfile::tempdir().expect("state dir");
        let env = format!("KUBE_PROXY_RS_STATE_DIR={}", state.path().display());
        ns.run(&[
            "env",
            &env,
            binary,
            "--cleanup",
            &format!("--proxy-mode={mode}"),
        ]);
        let save = ns.run(&["iptables-save", "-t", "nat"]);
        let tables = ns.run(&["nft", "list", "tables"]);
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
    if !ready() {
        return;
    }
    let ns = Netns::new("start");
    lay_out_leftovers(&ns);
    let state = tempfile::tempdir().expect("state dir");
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/cluster");
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.0, env!("CARGO_BIN_EXE_kube-proxy")])
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
        let tables = ns.run(&["nft", "list", "tables"]);
        if !tables.contains("kube-proxy") || std::time::Instant::now() > deadline {
            break tables;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let save = ns.run(&["iptables-save", "-t", "nat"]);
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
