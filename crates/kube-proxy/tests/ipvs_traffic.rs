//! ipvs mode with real traffic, in a kernel that has IPVS: one boot of the test VM
//! (tools/kp-vm) runs the `#[ignore]`d tests below. Each builds a `kp-testbed` cluster
//! (network namespaces, veths, `kp-echo` pods) inside the VM, runs the real `kube-proxy`
//! binary with `--proxy-mode=ipvs` in the node namespace, and sends real TCP flows through
//! IPVS: round robin spreads evenly, source hashing pins a client, weight 0 (a terminating
//! endpoint) takes no new flows; SCTP services are balanced and answered too. The host test
//! fails when the VM cannot start or any guest test fails.

use kp_suite::support;

use std::net::IpAddr;
use std::time::Duration;

use kp_testbed::proxy::{ProxyLaunch, ProxyProcess};
use kp_testbed::{Cluster, DEFAULT_ECHO_PORT, Tally};
use support::{CLUSTER_CIDR_V4, Service, THIS_NODE, kube_proxy, node_yaml};

/// Guest tests in this file.
const GUEST_TESTS: usize = 4;
/// Namespace prefix of these tests (inside the VM; unique anyway).
const PREFIX: &str = "kpi-";

#[test]
fn ipvs_traffic_in_the_vm() {
    let echo = kp_testbed::echo_binary().unwrap_or_else(|e| panic!("{e}"));
    let out = kp_vm::Vm::from_env()
        .iptables()
        .program("ipvsadm")
        .program("ipset")
        .module("sctp")
        .program(kube_proxy())
        .program(&echo.to_string_lossy())
        .run_current_exe(&[
            "--ignored",
            "--test-threads=1",
            "--nocapture",
            "ipvs_traffic::",
        ])
        .unwrap_or_else(|e| panic!("the IPVS VM did not run: {e}"));
    out.assert_tests_passed(GUEST_TESTS);
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

/// Local pods `a`, `b` and remote pod `c`.
fn cluster() -> Cluster {
    assert!(kp_vm::in_guest(), "this test needs the VM's kernel");
    Cluster::builder()
        .prefix(PREFIX)
        .pod("a")
        .pod("b")
        .remote_pod("c")
        .echo_sctp_ports(&[DEFAULT_ECHO_PORT])
        .build()
        .expect("test cluster builds in the VM")
}

/// How long the first sync may take in the emulated VM.
const FIRST_SYNC_WAIT: Duration = Duration::from_secs(120);

/// `kube-proxy --proxy-mode=ipvs` in the node namespace (kp-testbed's proxy harness); killed
/// on drop.
struct Proxy {
    _process: ProxyProcess,
    _dir: tempfile::TempDir,
}

impl Proxy {
    /// Writes the manifests, starts the proxy and waits for its first sync.
    fn start(cluster: &Cluster, manifests: &[(&str, String)], flags: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("manifests dir");
        std::fs::write(dir.path().join("node.yaml"), node_yaml(cluster, 0)).expect("node");
        for (name, text) in manifests {
            std::fs::write(dir.path().join(name), text).expect("manifest");
        }
        let mut process = ProxyLaunch::new(cluster.node_ns(), kube_proxy())
            .arg(format!("--manifests={}", dir.path().display()))
            .args([
                "--proxy-mode=ipvs",
                &format!("--hostname-override={THIS_NODE}"),
            ])
            .arg(format!("--cluster-cidr={CLUSTER_CIDR_V4}"))
            .args(["--conntrack-max-per-core=0", "--ipvs-min-sync-period=0s"])
            .args(["--healthz-bind-address=", "--metrics-bind-address="])
            .args(flags)
            .echo("proxy: ")
            .spawn()
            .unwrap_or_else(|e| panic!("start kube-proxy: {e}"));
        process
            .wait_first_sync(FIRST_SYNC_WAIT)
            .unwrap_or_else(|e| panic!("no first sync: {e}"));
        assert!(
            !process
                .logged(|l| l.contains("Using ipvs Proxier"))
                .is_empty(),
            "ipvs mode must be used in the VM (no fallback):\n{}",
            process.tail(usize::MAX)
        );
        Self {
            _process: process,
            _dir: dir,
        }
    }
}

fn ipvsadm(cluster: &Cluster) -> String {
    cluster
        .exec(cluster.node_ns(), &["ipvsadm", "-Ln"])
        .unwrap_or_else(|e| format!("ipvsadm failed: {e}"))
}

fn counts(tally: &Tally) -> Vec<(String, usize)> {
    tally.by_pod().into_iter().collect()
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_traffic_in_the_vm)"]
fn round_robin_spreads_evenly_over_every_endpoint() {
    let c = cluster();
    let web = Service::new("web", "10.96.0.10")
        .tcp(80)
        .node_port(30080)
        .endpoints(&c, &["a", "b", "c"]);
    let _proxy = Proxy::start(&c, &[("web.yaml", web.yaml())], &[]);
    let tally = c
        .tcp_repeat(c.client(), ip("10.96.0.10"), 80, 30)
        .expect("probe");
    // rr hands out new connections strictly in turn: 30 over 3 is exactly 10 each.
    assert_eq!(
        counts(&tally),
        [("a".into(), 10), ("b".into(), 10), ("c".into(), 10)],
        "{tally:?}\n{}",
        ipvsadm(&c)
    );
    // From the node itself: masqueraded, still balanced.
    let tally = c
        .tcp_repeat(c.node(), ip("10.96.0.10"), 80, 30)
        .expect("probe");
    assert_eq!(counts(&tally).len(), 3, "{tally:?}\n{}", ipvsadm(&c));
    // A NodePort from outside the cluster: IPVS on the node's address, masqueraded by the
    // KUBE-NODE-PORT ipset rule (without it the remote pod's reply would bypass the node).
    let tally = c
        .tcp_repeat(c.external_in(), c.node().ip(), 30080, 9)
        .expect("probe");
    assert_eq!(counts(&tally).len(), 3, "{tally:?}\n{}", ipvsadm(&c));
    for outcome in tally.outcomes().iter().filter(|o| o.pod().is_some()) {
        assert_eq!(outcome.masqueraded(), Some(true), "{outcome:?}");
    }
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_traffic_in_the_vm)"]
fn source_hashing_pins_each_client_to_one_endpoint() {
    let c = cluster();
    let web = Service::new("web", "10.96.0.20")
        .tcp(80)
        .endpoints(&c, &["a", "b", "c"]);
    let _proxy = Proxy::start(&c, &[("web.yaml", web.yaml())], &["--ipvs-scheduler=sh"]);
    assert!(ipvsadm(&c).contains("10.96.0.20:80 sh"), "{}", ipvsadm(&c));
    for from in [c.client(), c.node()] {
        let tally = c.tcp_repeat(from, ip("10.96.0.20"), 80, 20).expect("probe");
        let by_pod = counts(&tally);
        assert_eq!(by_pod.len(), 1, "one source, one endpoint: {by_pod:?}");
        assert_eq!(by_pod[0].1, 20, "every flow answered: {tally:?}");
    }
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_traffic_in_the_vm)"]
fn a_terminating_endpoint_at_weight_zero_takes_no_new_flows() {
    let c = cluster();
    let web = Service::new("web", "10.96.0.30")
        .tcp(80)
        .endpoints(&c, &["a", "b"]);
    let b = c.pod("b").expect("b").ip();
    let ready = format!("  - addresses: [\"{b}\"]\n    nodeName: {THIS_NODE}\n");
    let yaml = web.yaml();
    assert!(yaml.contains(&ready), "{yaml}");
    let yaml = yaml.replace(
        &ready,
        &format!(
            "{ready}    conditions:\n      ready: false\n      serving: true\n      terminating: true\n"
        ),
    );
    let _proxy = Proxy::start(&c, &[("web.yaml", yaml)], &[]);
    let table = ipvsadm(&c);
    let line = |ip: IpAddr| {
        table
            .lines()
            .find(|l| l.contains(&format!("-> {ip}:")))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
    };
    // b is still a real server (its connections would drain) but with weight 0.
    assert!(
        line(b).is_some_and(|l| l.contains("Masq 0 ")),
        "b at weight 0:\n{table}"
    );
    let tally = c
        .tcp_repeat(c.client(), ip("10.96.0.30"), 80, 20)
        .expect("probe");
    assert_eq!(counts(&tally), [("a".into(), 20)], "{tally:?}\n{table}");
}

#[test]
#[ignore = "runs inside the IPVS VM (ipvs_traffic_in_the_vm)"]
fn sctp_services_are_balanced_and_answered() {
    let c = cluster();
    let web = Service::new("sctp", "10.96.0.40")
        .sctp(80)
        .node_port(30040)
        .endpoints(&c, &["a", "b", "c"]);
    let _proxy = Proxy::start(&c, &[("sctp.yaml", web.yaml())], &[]);
    let table = ipvsadm(&c);
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().eq(["SCTP", "10.96.0.40:80", "rr"])),
        "an SCTP virtual server:\n{table}"
    );
    // Each association is a new IPVS connection, so rr hands them out strictly in turn: the
    // answers rotate over all three endpoints. Under the VM's emulated CPU one INIT in 30 has
    // been lost before IPVS scheduled it (the next answer continued the rotation), so one
    // timed-out probe is allowed; the rotation is checked over the answers.
    let tally = c
        .sctp_repeat(c.client(), ip("10.96.0.40"), 80, 30)
        .expect("probe");
    let pods: Vec<&str> = tally.outcomes().iter().filter_map(|o| o.pod()).collect();
    assert!(pods.len() >= 29, "{tally:?}\n{table}");
    let mut first: Vec<&str> = pods[..3].to_vec();
    first.sort_unstable();
    assert_eq!(first, ["a", "b", "c"], "{tally:?}\n{table}");
    assert!(
        pods.windows(4).all(|w| w[0] == w[3]),
        "strictly in turn: {pods:?}\n{table}"
    );
    // From a pod (inside the cluster CIDR) the endpoints see the client itself.
    for outcome in tally.outcomes().iter().filter(|o| o.pod().is_some()) {
        assert_eq!(outcome.masqueraded(), Some(false), "{outcome:?}");
    }
    // The NodePort from outside: masqueraded by the KUBE-NODE-PORT-SCTP-HASH ipset rule.
    let tally = c
        .sctp_repeat(c.external_in(), c.node().ip(), 30040, 9)
        .expect("probe");
    assert_eq!(counts(&tally).len(), 3, "{tally:?}\n{}", ipvsadm(&c));
    for outcome in tally.outcomes() {
        assert_eq!(outcome.masqueraded(), Some(true), "{outcome:?}");
    }
}
