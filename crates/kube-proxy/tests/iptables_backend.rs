//! The iptables backend in the kernel: the real binary starts in a throwaway network namespace
//! (kp-testbed's, so the host's rules are never touched) whose "node" already has chains in
//! the legacy backend, in nf_tables, or in both, as kubelet, a CNI plugin or a firewall would
//! leave them. Each test checks the backend the proxy chose (its start-up log line with the
//! reason) and that its own rules then landed in that backend only.

use std::path::PathBuf;
use std::time::Duration;

use kp_testbed::proxy::ProxyLaunch;
use kp_testbed::{Namespace, isolated};

/// Namespace prefix of these tests.
const PREFIX: &str = "kpb-";

/// kubelet's two chains in the mangle table of one backend (`iptables-legacy` or
/// `iptables-nft`), as kubelet 1.17+ creates them.
fn kubelet_chains(tool: &str) -> String {
    format!(
        "{tool} -w -t mangle -N KUBE-IPTABLES-HINT && {tool} -w -t mangle -N KUBE-KUBELET-CANARY"
    )
}

/// `n` foreign filter rules in one backend (a firewall or CNI plugin).
fn firewall_rules(tool: &str, n: usize) -> String {
    (1..=n)
        .map(|i| format!("{tool} -w -A INPUT -s 192.0.2.{i} -j DROP"))
        .collect::<Vec<_>>()
        .join(" && ")
}

/// What one run left behind.
struct Run {
    log: String,
    legacy: String,
    nft: String,
}

impl Run {
    fn context(&self) -> String {
        format!(
            "log:\n{}\n--- iptables-legacy-save ---\n{}\n--- iptables-nft-save ---\n{}",
            self.log, self.legacy, self.nft
        )
    }

    /// The proxy's own rules (`KUBE-SERVICES` and a service chain) are in `chosen`'s dump and
    /// no kube-proxy chain at all is in `other`'s (kubelet's, made by the test, aside).
    fn assert_rules_only_in(&self, chosen: &str) {
        let (mine, other) = if chosen == "legacy" {
            (&self.legacy, &self.nft)
        } else {
            (&self.nft, &self.legacy)
        };
        assert!(
            mine.contains("-A KUBE-SERVICES") && mine.contains(":KUBE-SVC-"),
            "rules in {chosen}: {}",
            self.context()
        );
        let stray: Vec<&str> = other
            .lines()
            .filter(|l| l.contains("KUBE-"))
            .filter(|l| !l.contains("KUBE-IPTABLES-HINT") && !l.contains("KUBE-KUBELET-CANARY"))
            .collect();
        assert!(
            stray.is_empty(),
            "stray rules {stray:?}: {}",
            self.context()
        );
    }

    fn assert_chose(&self, backend: &str, reason: &str) {
        let line = self
            .log
            .lines()
            .find(|l| l.contains("Using iptables backend"))
            .unwrap_or_else(|| panic!("no backend line: {}", self.context()));
        assert!(
            line.contains(&format!("backend=\"{backend}\"")) && line.contains(reason),
            "expected {backend} ({reason}) in {line:?}: {}",
            self.context()
        );
        assert_eq!(
            self.log.matches("Using iptables backend").count(),
            1,
            "logged once: {}",
            self.context()
        );
    }
}

/// Whether this machine can run `test`: root (a network namespace) and both backends'
/// tools. In CI they must run.
fn runnable(test: &str) -> bool {
    let probe = "iptables-legacy-save >/dev/null && iptables-nft-save >/dev/null";
    !isolated::skip(test, isolated::missing(&[], &["sh", "-c", probe]))
}

/// How long the proxy may take for its first sync of the example cluster.
const FIRST_SYNC_WAIT: Duration = Duration::from_secs(60);
/// How long it gets to exit after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// Runs `setup` in a fresh namespace, then the proxy (`mode`, `flags`) until its first sync
/// (kp-testbed's proxy harness), and dumps both backends.
fn run(setup: &str, mode: &str, flags: &[&str], env: &[(&str, &str)]) -> Run {
    let binary = env!("CARGO_BIN_EXE_kube-proxy");
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster");
    let state = tempfile::tempdir().expect("state dir");
    let ns = Namespace::create(PREFIX, "node").unwrap_or_else(|e| panic!("namespace: {e}"));
    ns.exec(&["sh", "-c", &format!("set -e\n{setup}")])
        .unwrap_or_else(|e| panic!("setup failed: {e}"));
    let mut launch = ProxyLaunch::new(ns.name(), binary)
        .arg(format!("--manifests={}", examples.display()))
        .arg("--hostname-override=node-1")
        .arg(format!("--proxy-mode={mode}"))
        .args([
            "--cluster-cidr=10.244.0.0/16",
            "--conntrack-max-per-core=0",
            "-v=2",
        ])
        .args(["--healthz-bind-address=", "--metrics-bind-address="])
        .args(flags)
        .env(kp_dataplane::sysctls::STATE_DIR_ENV, state.path());
    launch
        .command_mut()
        .env_remove(kp_dataplane::xtables::BACKEND_ENV);
    for (key, value) in env {
        launch = launch.env(key, value);
    }
    let mut proxy = launch.spawn().expect("start the proxy in the namespace");
    let synced = proxy.wait_first_sync(FIRST_SYNC_WAIT);
    let stopped = proxy.terminate(STOP_GRACE);
    let dump = |tools: &str| {
        ns.exec(&["sh", "-c", &format!("{tools}; true")])
            .unwrap_or_else(|e| format!("dump failed: {e}"))
    };
    let run = Run {
        log: proxy.logged(|_| true).join("\n"),
        legacy: dump("iptables-legacy-save; ip6tables-legacy-save"),
        nft: dump("iptables-nft-save; ip6tables-nft-save"),
    };
    assert!(
        synced.is_ok() && stopped.is_ok(),
        "proxy failed ({synced:?}, stop: {stopped:?})\n{}",
        run.context()
    );
    run
}

/// Runs iptables mode over `setup` and checks that it chose `backend` ("legacy" or
/// "nf_tables") for `reason` and put its rules there only.
fn iptables_mode_chooses(
    setup: &str,
    flags: &[&str],
    env: &[(&str, &str)],
    backend: &str,
    reason: &str,
) -> Run {
    let run = run(setup, "iptables", flags, env);
    run.assert_chose(backend, reason);
    run.assert_rules_only_in(if backend == "legacy" { "legacy" } else { "nft" });
    run
}

#[test]
fn a_legacy_node_gets_legacy_rules() {
    if !runnable("a_legacy_node_gets_legacy_rules") {
        return;
    }
    let setup = format!(
        "{} && {}",
        kubelet_chains("iptables-legacy"),
        firewall_rules("iptables-legacy", 2)
    );
    let run = iptables_mode_chooses(&setup, &[], &[], "legacy", "iptables-legacy-save");
    // The sync-time log names the (faster) legacy backend.
    assert!(
        run.log
            .lines()
            .any(|l| l.contains("iptables sync finished")
                && l.contains("iptables_backend=\"legacy\"")),
        "{}",
        run.context()
    );
}

#[test]
fn an_nf_tables_node_gets_nf_tables_rules() {
    if !runnable("an_nf_tables_node_gets_nf_tables_rules") {
        return;
    }
    let setup = format!(
        "{} && {}",
        kubelet_chains("iptables-nft"),
        firewall_rules("iptables-nft", 2)
    );
    iptables_mode_chooses(&setup, &[], &[], "nf_tables", "iptables-nft-save -t mangle");
}

#[test]
fn a_node_with_chains_in_both_follows_kubelet_then_the_rule_count() {
    if !runnable("a_node_with_chains_in_both_follows_kubelet_then_the_rule_count") {
        return;
    }
    // kubelet in legacy, a firewall with more rules in nf_tables: kubelet's hint decides.
    let setup = format!(
        "{} && {}",
        kubelet_chains("iptables-legacy"),
        firewall_rules("iptables-nft", 3)
    );
    iptables_mode_chooses(&setup, &[], &[], "legacy", "kubelet");

    // kubelet's chains in both (a node mid-migration): nf_tables is asked first, as upstream.
    let setup = format!(
        "{} && {}",
        kubelet_chains("iptables-legacy"),
        kubelet_chains("ip6tables-nft")
    );
    iptables_mode_chooses(
        &setup,
        &[],
        &[],
        "nf_tables",
        "ip6tables-nft-save -t mangle",
    );

    // No kubelet chains: the backend with more rules (3 legacy against 2 nf_tables).
    let setup = format!(
        "{} && {}",
        firewall_rules("iptables-legacy", 3),
        firewall_rules("iptables-nft", 2)
    );
    iptables_mode_chooses(
        &setup,
        &[],
        &[],
        "legacy",
        "legacy holds 3 rules, nf_tables 2",
    );
}

#[test]
fn the_operator_overrides_detection_and_userspace_mode_follows() {
    if !runnable("the_operator_overrides_detection_and_userspace_mode_follows") {
        return;
    }
    let nft_node = format!(
        "{} && {}",
        kubelet_chains("iptables-nft"),
        firewall_rules("iptables-nft", 1)
    );
    // The variable beats detection; userspace mode's capture rules use the choice too.
    let run1 = run(
        &nft_node,
        "userspace",
        &[],
        &[(kp_dataplane::xtables::BACKEND_ENV, "legacy")],
    );
    run1.assert_chose("legacy", "set by $KUBE_PROXY_RS_IPTABLES_BACKEND");
    assert!(
        run1.legacy.contains("-A KUBE-USERSPACE") && run1.legacy.contains(":KUBE-USR-"),
        "{}",
        run1.context()
    );
    assert!(
        !run1.nft.lines().any(|l| l.starts_with("-A KUBE-")),
        "{}",
        run1.context()
    );
    // The flag beats the variable.
    iptables_mode_chooses(
        &nft_node,
        &["--iptables-backend=nft"],
        &[(kp_dataplane::xtables::BACKEND_ENV, "legacy")],
        "nf_tables",
        "set by --iptables-backend",
    );
}
