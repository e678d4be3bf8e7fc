//! `kube-proxy explain` end to end: the real binary on `examples/cluster`, and `--verify`
//! against real iptables rules in a throwaway network namespace.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
use kp_core::tracker::{ChangeTracker, ProxyState};
use kp_rules::iptables::{LocalDetector, RenderConfig, SyncScope, render};
use kp_testbed::{Namespace, isolated};
use serde_json::Value;

const CLUSTER_CIDR: &str = "10.244.0.0/16";

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_kube-proxy")
}

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster")
}

/// `explain` arguments for the example cluster as node-1.
fn base_args(extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "explain".to_owned(),
        format!("--manifests={}", examples().display()),
        "--hostname-override=node-1".to_owned(),
        format!("--cluster-cidr={CLUSTER_CIDR}"),
    ];
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

fn run(extra: &[&str]) -> Output {
    Command::new(binary())
        .args(base_args(extra))
        .output()
        .expect("run kube-proxy explain")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs with `-o json`, expecting `code`, and parses stdout.
fn json(extra: &[&str], code: i32) -> Value {
    let mut args = extra.to_vec();
    args.extend(["-o", "json"]);
    let out = run(&args);
    assert_eq!(out.status.code(), Some(code), "stderr: {}", stderr(&out));
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

/// (ip, verdict, used) of every endpoint of a match.
fn endpoints(m: &Value) -> Vec<(String, String, bool)> {
    m["endpoints"]
        .as_array()
        .expect("endpoints array")
        .iter()
        .map(|e| {
            (
                e["ip"].as_str().unwrap_or_default().to_owned(),
                e["verdict"].as_str().unwrap_or_default().to_owned(),
                e["used"].as_bool().unwrap_or_default(),
            )
        })
        .collect()
}

fn only_match(v: &Value) -> &Value {
    let matches = v["matches"].as_array().expect("matches array");
    assert_eq!(matches.len(), 1, "{v:#}");
    &matches[0]
}

#[test]
fn web_cluster_ip_has_two_endpoints_one_local() {
    let out = run(&["10.96.0.10:80"]);
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("default/web:http: ClusterIP 10.96.0.10:80/TCP"),
        "{text}"
    );
    assert!(text.contains("DNAT to one of 2 endpoints"), "{text}");
    assert!(
        text.lines().any(|l| l.contains("[used]")
            && l.contains("10.244.1.5:8080")
            && l.contains("node-1 (local)")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("[used]") && l.contains("10.244.2.7:8080") && !l.contains("local")),
        "{text}"
    );
    assert!(text.contains("nat KUBE-SERVICES"), "{text}");
    assert!(text.contains("KUBE-SVC-"), "{text}");

    let v = json(&["10.96.0.10:80", "--from", "10.244.1.7"], 0);
    let m = only_match(&v);
    assert_eq!(m["how"], "ClusterIp");
    assert_eq!(m["masquerade"]["reason"], "LocalTraffic");
    let locals: Vec<bool> = m["endpoints"]
        .as_array()
        .expect("array")
        .iter()
        .map(|e| e["local"].as_bool().unwrap_or_default())
        .collect();
    assert_eq!(locals, vec![true, false]);
    let v = json(&["10.96.0.10:80", "--from", "192.168.49.2"], 0);
    assert_eq!(only_match(&v)["masquerade"]["decision"], "Yes");
    let v = json(&["10.96.0.10:80", "--masquerade-all"], 0);
    assert_eq!(only_match(&v)["masquerade"]["reason"], "MasqueradeAll");
}

#[test]
fn dns_terminating_endpoint_is_not_used_while_a_ready_one_exists() {
    let v = json(&["10.96.0.53:53/udp"], 0);
    let m = only_match(&v);
    assert_eq!(m["service_port"], "kube-system/kube-dns:dns");
    assert_eq!(
        endpoints(m),
        vec![
            ("10.244.1.9".into(), "Ready".into(), true),
            ("10.244.2.9".into(), "ServingTerminating".into(), false),
        ]
    );
    // The TCP port of the same service is a near miss for UDP... and the match for TCP.
    assert_eq!(
        v["near_misses"][0]["service_port"],
        "kube-system/kube-dns:dns-tcp"
    );
    let v = json(&["10.96.0.53:53"], 0);
    assert_eq!(
        only_match(&v)["service_port"],
        "kube-system/kube-dns:dns-tcp"
    );
}

#[test]
fn shop_load_balancer_source_ranges() {
    let v = json(&["198.51.100.20:443", "--from", "203.0.113.200"], 0);
    let m = only_match(&v);
    assert_eq!(m["how"], "LoadBalancerIp");
    assert_eq!(m["outcome"], "DropSourceRange");
    assert!(endpoints(m).iter().all(|(_, _, used)| !used));
    let text = stdout(&run(&["198.51.100.20:443", "--from", "203.0.113.200"]));
    assert!(text.contains("KUBE-PROXY-FIREWALL"), "{text}");
    assert!(text.contains("DROP"), "{text}");

    let v = json(&["198.51.100.20:443", "--from", "203.0.113.5"], 0);
    let m = only_match(&v);
    assert_eq!(m["outcome"], "Dnat");
    assert_eq!(m["masquerade"]["decision"], "No");
    assert_eq!(m["masquerade"]["reason"], "ExternalLocalPreserved");
    assert_eq!(m["session_affinity"]["timeout_seconds"], 10800);
    assert_eq!(
        endpoints(m),
        vec![
            ("10.244.1.20".into(), "Ready".into(), true),
            ("10.244.1.21".into(), "Ready".into(), true),
            ("10.244.2.20".into(), "NotLocalExternalPolicy".into(), false),
        ]
    );
    let hops: Vec<&str> = m["hops"]
        .as_array()
        .expect("hops")
        .iter()
        .filter_map(|h| h["chain"].as_str())
        .collect();
    assert!(
        hops[1].starts_with("KUBE-FW-") && hops[2].starts_with("KUBE-EXT-"),
        "{hops:?}"
    );
    assert!(hops[3].starts_with("KUBE-SVL-"), "{hops:?}");

    // The NodePort on the node's address is not subject to the source ranges.
    let v = json(&["192.168.49.2:30443", "--from", "203.0.113.200"], 0);
    let m = only_match(&v);
    assert_eq!(
        (m["how"].as_str(), m["outcome"].as_str()),
        (Some("NodePort"), Some("Dnat"))
    );
}

#[test]
fn an_address_that_is_no_service() {
    let out = run(&["10.1.2.3:80"]);
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    assert!(
        stdout(&out)
            .contains("not a service address: routed normally, kube-proxy does not touch it"),
        "{}",
        stdout(&out)
    );
    let v = json(&["10.1.2.3"], 0);
    assert_eq!(v["matches"].as_array().map(Vec::len), Some(0));
}

#[test]
fn errors_are_reported_with_a_status() {
    let out = run(&["not-an-ip:80"]);
    assert_eq!(out.status.code(), Some(2), "usage error");
    assert!(
        stderr(&out).contains("not an IP address"),
        "{}",
        stderr(&out)
    );

    let out = run(&["10.96.0.10:80", "--from", "fd00::1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("different IP families"),
        "{}",
        stderr(&out)
    );

    let out = Command::new(binary())
        .args([
            "explain",
            "10.96.0.10:80",
            "--manifests=/nonexistent/kp",
            "--hostname-override=n",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no such file"), "{}", stderr(&out));

    let out = run(&["10.96.0.10:80", "--verify", "--proxy-mode=fake"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("--verify supports iptables mode only"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn other_modes_name_their_own_objects() {
    // Without --proxy-mode the answer is iptables mode's, with no dataplane section.
    let v = json(&["10.96.0.10:80"], 0);
    assert!(only_match(&v).get("dataplane").is_none());
    // nftables mode's default layout names its elements; the chain layout its map entry.
    for (layout, entry) in [
        (None, "slots-2 { 10.96.0.10 . tcp . 80 }"),
        (
            Some("--nftables-layout=chains"),
            "service-ips { 10.96.0.10 . tcp . 80 }",
        ),
    ] {
        let mut args = vec!["10.96.0.10:80", "--proxy-mode=nftables"];
        args.extend(layout);
        let v = json(&args, 0);
        let dataplane = &only_match(&v)["dataplane"];
        assert_eq!(dataplane["mode"], "nftables");
        let names: Vec<&str> = dataplane["objects"]
            .as_array()
            .expect("objects")
            .iter()
            .filter_map(|o| o["name"].as_str())
            .collect();
        assert!(names.contains(&"ip kube-proxy"), "{names:?}");
        assert!(names.contains(&entry), "{layout:?}: {names:?}");
    }
    let out = run(&["10.96.0.10:80", "--proxy-mode=ipvs"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("virtual server TCP 10.96.0.10:80 rr"),
        "{}",
        stdout(&out)
    );
    assert!(!stdout(&out).contains("KUBE-SVC-"), "{}", stdout(&out));
}

#[test]
fn the_socket_load_balancer_path_is_named() {
    // Without --socket-lb there is no such section.
    let v = json(&["10.96.0.10:80", "--proxy-mode=nftables"], 0);
    assert!(only_match(&v).get("socket_lb").is_none(), "{v:#}");
    let flags = ["10.96.0.10:80", "--proxy-mode=nftables", "--socket-lb"];
    let v = json(&flags, 0);
    let path = &only_match(&v)["socket_lb"];
    assert_eq!(path["translated"], true, "{path:#}");
    let endpoints: Vec<&str> = path["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        endpoints,
        ["10.244.1.5:8080", "10.244.2.7:8080"],
        "{path:#}"
    );
    let text = stdout(&run(&flags));
    assert!(
        text.contains("socket load balancer: translates the node's own sockets' connections"),
        "{text}"
    );
    assert!(text.contains("the cgroup v2 root"), "{text}");
    // A NodePort stays with nftables mode's rules.
    let v = json(
        &["192.168.49.2:30443", "--proxy-mode=nftables", "--socket-lb"],
        0,
    );
    let path = &only_match(&v)["socket_lb"];
    assert_eq!(path["translated"], false, "{path:#}");
    assert!(
        path["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("NodePorts"),
        "{path:#}"
    );
}

// ---- --verify in a throwaway network namespace ----

/// A network namespace (kp-testbed's [`Namespace`], deleted on drop), so the host's rules
/// are never touched.
struct Netns(Namespace);

impl Netns {
    /// `None` (with the reason printed) when namespaces or iptables are unavailable; in CI a
    /// failure instead.
    fn create(test: &str) -> Option<Netns> {
        let tools = ["iptables-save", "iptables-restore", "iptables"];
        if isolated::skip(test, isolated::missing(&tools, &["true"])) {
            return None;
        }
        let ns = Namespace::create("kp-explain-", "node").unwrap_or_else(|e| panic!("{e}"));
        Some(Netns(ns))
    }

    fn command(&self, program: &str) -> Command {
        self.0.command(program)
    }

    fn iptables(&self, args: &[&str]) {
        let out = self
            .command("iptables")
            .args(args)
            .output()
            .expect("iptables");
        assert!(out.status.success(), "iptables {args:?}: {}", stderr(&out));
    }

    fn restore(&self, text: &str) {
        self.restore_with("iptables-restore", text);
    }

    /// `tool --noflush` (an `iptables-restore` of some backend) with `text`.
    fn restore_with(&self, tool: &str, text: &str) {
        let mut child = self
            .command(tool)
            .arg("--noflush")
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("iptables-restore");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write rules");
        let out = child.wait_with_output().expect("wait");
        assert!(out.status.success(), "{tool}: {}", stderr(&out));
    }

    /// `explain --verify -o json` inside the namespace: (exit code, JSON).
    fn verify(&self, dest: &[&str]) -> (Option<i32>, Value) {
        let mut args = base_args(dest);
        args.extend(["--verify", "-o", "json"].map(str::to_owned));
        let out = self
            .command(binary())
            .args(&args)
            .output()
            .expect("explain");
        let value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}); stderr: {}", stderr(&out)));
        (out.status.code(), value)
    }
}

/// The example cluster as node-1 sees it, built independently of the binary: manifests
/// parsed by the source's parser, folded by the proxy's tracker.
fn example_state() -> ProxyState {
    let mut tracker = ChangeTracker::new("node-1");
    for entry in std::fs::read_dir(examples()).expect("examples dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read manifest");
        let (objects, errors) = kp_sources::manifests::parse_manifests(&text, &path);
        assert!(errors.is_empty(), "{errors:?}");
        for object in objects {
            tracker.record(object.applied());
        }
    }
    let mut state = ProxyState::default();
    let result = tracker.apply(&mut state);
    assert!(result.invalid.is_empty(), "{:?}", result.invalid);
    state
}

fn rendered_rules() -> String {
    let config = RenderConfig {
        local_detector: LocalDetector::Cidrs(vec![CLUSTER_CIDR.parse().expect("cidr")]),
        ..RenderConfig::default()
    };
    render(
        &example_state(),
        IpFamily::V4,
        &config,
        &SyncScope {
            kind: SyncKind::Full,
            changed: &Default::default(),
            existing_chains: &Default::default(),
        },
    )
    .expect("renders")
    .text
}

fn differences(v: &Value) -> Vec<Value> {
    v["verify"]["differences"]
        .as_array()
        .cloned()
        .expect("differences array")
}

/// On a node whose kubelet uses the legacy backend, `--verify` reads the legacy rules (where
/// the proxy put them), and says so; forced to nf_tables it finds nothing there.
#[test]
fn verify_reads_the_backend_the_proxy_uses() {
    let Some(ns) = Netns::create("verify_reads_the_backend_the_proxy_uses") else {
        return;
    };
    ns.restore_with(
        "iptables-legacy-restore",
        &format!(
            "*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n{}",
            rendered_rules()
        ),
    );
    let (code, v) = ns.verify(&["10.96.0.10:80"]);
    assert_eq!(code, Some(0), "{v:#}");
    let out = ns
        .command(binary())
        .args(base_args(&["10.96.0.10:80", "--verify"]))
        .output()
        .expect("explain");
    assert!(
        stdout(&out).contains("verify against iptables-legacy-save: "),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let (code, v) = ns.verify(&["10.96.0.10:80", "--iptables-backend=nft"]);
    assert_eq!(code, Some(3), "nothing in nf_tables: {v:#}");
}

#[test]
fn verify_against_kernel_rules() {
    let Some(ns) = Netns::create("verify_against_kernel_rules") else {
        return;
    };

    // Nothing applied yet: every chain is missing.
    let (code, v) = ns.verify(&["10.96.0.10:80"]);
    assert_eq!(code, Some(3), "{v:#}");
    assert!(
        differences(&v).iter().any(|d| d["kind"] == "MissingChain"),
        "{v:#}"
    );

    ns.restore(&rendered_rules());
    for dest in [
        &["10.96.0.10:80"][..],
        &["10.96.0.53:53/udp"],
        &["198.51.100.20:443", "--from", "203.0.113.5"],
        &["192.168.49.2:30443"],
        &["10.1.2.3:80"],
    ] {
        let (code, v) = ns.verify(dest);
        assert_eq!(code, Some(0), "{dest:?}: {v:#}");
        assert_eq!(differences(&v).len(), 0, "{dest:?}");
    }
    let (_, v) = ns.verify(&["10.96.0.10:80"]);
    assert!(
        v["verify"]["checked"]
            .as_array()
            .is_some_and(|c| c.len() >= 3),
        "{v:#}"
    );
    let m = only_match(&v);
    let svc = m["chains"]["svc"].as_str().expect("svc chain").to_owned();
    let local_sep = m["endpoints"][0]["chain"].as_str().expect("sep").to_owned();
    let remote_sep = m["endpoints"][1]["chain"].as_str().expect("sep").to_owned();

    // Delete the SVC chain's second rule: after the masquerade rule, the random pick of the
    // first (local) endpoint.
    ns.iptables(&["-t", "nat", "-D", &svc, "2"]);
    let (code, v) = ns.verify(&["10.96.0.10:80"]);
    assert_eq!(code, Some(3), "{v:#}");
    let diffs = differences(&v);
    assert_eq!(diffs.len(), 1, "{diffs:#?}");
    assert_eq!(diffs[0]["kind"], "MissingRule");
    assert_eq!(diffs[0]["chain"], svc.as_str());
    assert!(
        diffs[0]["rule"]
            .as_str()
            .is_some_and(|r| r.contains(&local_sep) && r.contains("--probability")),
        "{diffs:#?}"
    );
    // Other services are untouched, so still clean.
    assert_eq!(ns.verify(&["10.96.0.53:53/udp"]).0, Some(0));

    // Point the remote endpoint's DNAT somewhere else.
    ns.iptables(&[
        "-t",
        "nat",
        "-R",
        &remote_sep,
        "2",
        "-m",
        "comment",
        "--comment",
        "default/web:http",
        "-m",
        "tcp",
        "-p",
        "tcp",
        "-j",
        "DNAT",
        "--to-destination",
        "10.244.9.9:8080",
    ]);
    let (code, v) = ns.verify(&["10.96.0.10:80"]);
    assert_eq!(code, Some(3));
    let diffs = differences(&v);
    assert!(
        diffs.iter().any(|d| d["kind"] == "UnexpectedRule"
            && d["chain"] == remote_sep.as_str()
            && d["position"] == 2
            && d["rule"]
                .as_str()
                .is_some_and(|r| r.contains("10.244.9.9:8080"))),
        "{diffs:#?}"
    );
    assert!(
        diffs.iter().any(|d| d["kind"] == "MissingRule"
            && d["chain"] == remote_sep.as_str()
            && d["rule"]
                .as_str()
                .is_some_and(|r| r.contains("10.244.2.7:8080"))),
        "{diffs:#?}"
    );
    // The text report says the same.
    let out = ns
        .command(binary())
        .args(base_args(&["10.96.0.10:80", "--verify"]))
        .output()
        .expect("explain");
    assert_eq!(out.status.code(), Some(3));
    let text = stdout(&out);
    assert!(text.contains("3 differences"), "{text}");
    assert!(text.contains("unexpected rule nat"), "{text}");
}

#[test]
fn node_ports_follow_the_node_ip_and_the_mode_default() {
    // The example cluster with a Node listing a second InternalIP after the node IP.
    let dir = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(examples()).expect("examples dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).expect("read example");
            let text = text.replace(
                "    - type: Hostname\n",
                "    - type: InternalIP\n      address: 192.168.49.3\n    - type: Hostname\n",
            );
            std::fs::write(dir.path().join(path.file_name().expect("name")), text)
                .expect("write example");
        }
    }
    let explain = |dest: &str, mode: &str| -> Value {
        let out = Command::new(binary())
            .args([
                "explain",
                &format!("--manifests={}", dir.path().display()),
                "--hostname-override=node-1",
                &format!("--proxy-mode={mode}"),
                dest,
                "-o",
                "json",
            ])
            .output()
            .expect("run kube-proxy explain");
        assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
        serde_json::from_slice(&out.stdout).expect("stdout is JSON")
    };
    let node_port = |v: &Value| {
        v["matches"]
            .as_array()
            .expect("matches")
            .iter()
            .any(|m| m["how"] == "NodePort")
    };
    // iptables mode, nodePortAddresses unset: every node address.
    assert!(node_port(&explain("192.168.49.2:30443", "iptables")));
    assert!(node_port(&explain("192.168.49.3:30443", "iptables")));
    // nftables mode defaults to `primary`: the node IP (the first InternalIP) only.
    assert!(node_port(&explain("192.168.49.2:30443", "nftables")));
    assert!(!node_port(&explain("192.168.49.3:30443", "nftables")));
}

/// nftables mode, a loopback NodePort (KEP-6032): served by the localhost listener with the
/// gate on and loopback named in `--nodeport-addresses`, rejected by the table when the gate
/// is on without it, untouched with the gate off; never iptables mode's route_localnet DNAT.
#[test]
fn nftables_mode_explains_localhost_node_ports() {
    const GATE: &str = "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true";
    let verdict = |extra: &[&str]| {
        let mut args = vec!["127.0.0.1:30443", "--proxy-mode=nftables"];
        args.extend_from_slice(extra);
        let e = json(&args, 0);
        assert_eq!(e["matches"].as_array().map(Vec::len), Some(0), "{e:#}");
        e["localhost_node_ports"][0]["verdict"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(
        verdict(&[GATE, "--nodeport-addresses=primary,localhost"]),
        "listener"
    );
    assert_eq!(verdict(&[GATE, "--nodeport-addresses=primary"]), "rejected");
    assert_eq!(
        verdict(&["--nodeport-addresses=primary,localhost"]),
        "untouched"
    );
    let text = stdout(&run(&[
        "127.0.0.1:30443",
        "--proxy-mode=nftables",
        GATE,
        "--nodeport-addresses=primary",
    ]));
    assert!(
        text.contains(
            "rejected by the nftables table (counted in localhost-nodeport-rejected-tcp)"
        ),
        "{text}"
    );
}
