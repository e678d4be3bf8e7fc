//! SCTP services with real traffic, in a kernel that has SCTP sockets: this machine's kernel
//! has none, so one boot of the test VM (tools/kp-vm) runs the `#[ignore]`d tests below.
//! Each builds a `kp-testbed` cluster whose pods also answer SCTP, runs the real
//! `kube-proxy` binary in one kernel mode in the node namespace (through the shared traffic
//! suite's `Env`), and opens real SCTP associations: a ClusterIP service is balanced over
//! every endpoint and answered without masquerade from a pod, and with masquerade from the
//! node; its NodePort answers an external client, masqueraded. The host test fails when the
//! VM cannot start or any guest test fails; it never skips. A module of the `traffic` binary:
//! the guest runs this module's ignored tests only.

use kp_suite::support;

use std::net::IpAddr;

use kp_testbed::{Cluster, DEFAULT_ECHO_PORT, Tally};
use support::{CLUSTER_CIDR_V4, Env, Mode, Service, Source, assert_flows, kube_proxy};

/// Guest tests in this file: every one must pass, none may be filtered away.
const GUEST_TESTS: usize = 3;
/// Namespace prefix of these tests (inside the VM, where nothing else runs; unique anyway).
const PREFIX: &str = "kpx-";
/// Associations per balancing check: the chance that one of 3 endpoints gets none of 30
/// random picks is about 2e-5.
const SPREAD_FLOWS: usize = 30;

/// The host side: boots the VM once with the tools the iptables and nftables modes exec,
/// and runs this binary's ignored tests inside it.
#[test]
fn sctp_traffic_in_the_vm() {
    let echo = kp_testbed::echo_binary().unwrap_or_else(|e| panic!("{e}"));
    let out = kp_vm::Vm::from_env()
        .iptables()
        .program("nft")
        .program("conntrack")
        .module("sctp")
        .program(kube_proxy())
        .program(&echo.to_string_lossy())
        .run_current_exe(&[
            "--ignored",
            "--test-threads=1",
            "--nocapture",
            "sctp_traffic::",
        ])
        .unwrap_or_else(|e| panic!("the SCTP VM did not run: {e}"));
    println!("VM run took {:.1} s", out.elapsed.as_secs_f64());
    out.assert_tests_passed(GUEST_TESTS);
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

/// Local pods `a`, `b` and remote pod `c`, each also answering SCTP on the echo port.
fn cluster() -> Cluster {
    assert!(kp_vm::in_guest(), "this test needs the VM's kernel");
    Cluster::builder()
        .prefix(PREFIX)
        .pod("a")
        .pod("b")
        .remote_pod("c")
        .echo_sctp_ports(&[DEFAULT_ECHO_PORT])
        .dual_stack(false)
        .build()
        .expect("test cluster builds in the VM")
}

fn probe(env: &Env, from: &kp_testbed::Host, to: IpAddr, port: u16) -> Tally {
    env.cluster
        .sctp_repeat(from, to, port, SPREAD_FLOWS)
        .unwrap_or_else(|e| panic!("SCTP probe to {to}:{port}: {e}{}", env.diag()))
}

/// An SCTP ClusterIP service with a NodePort, over local pods and a remote one.
fn sctp_service(mode: Mode) {
    let c = cluster();
    let service = Service::new("sctp", "10.96.0.40")
        .sctp(80)
        .node_port(30040)
        .endpoints(&c, &["a", "b", "c"]);
    let env = Env::start(mode, c, CLUSTER_CIDR_V4, &[service]);
    let cl = &env.cluster;
    let every = ["a", "b", "c"];

    let tally = probe(&env, cl.client(), ip("10.96.0.40"), 80);
    assert_flows(
        &env,
        "SCTP ClusterIP from a pod",
        &tally,
        &every,
        Source::Preserved,
    );

    // The node is outside the cluster CIDR: masqueraded, as TCP and UDP are.
    let tally = probe(&env, cl.node(), ip("10.96.0.40"), 80);
    assert_flows(
        &env,
        "SCTP ClusterIP from the node",
        &tally,
        &every,
        Source::Masqueraded,
    );

    let tally = probe(&env, cl.external_in(), cl.node_ip(), 30040);
    assert_flows(
        &env,
        "SCTP NodePort from an external client",
        &tally,
        &every,
        Source::Masqueraded,
    );
}

#[test]
#[ignore = "runs inside the SCTP VM (sctp_traffic_in_the_vm)"]
fn iptables_balances_sctp_services() {
    sctp_service(Mode::Iptables);
}

#[test]
#[ignore = "runs inside the SCTP VM (sctp_traffic_in_the_vm)"]
fn nftables_balances_sctp_services() {
    sctp_service(Mode::Nftables);
}

#[test]
#[ignore = "runs inside the SCTP VM (sctp_traffic_in_the_vm)"]
fn nftables_chains_balances_sctp_services() {
    sctp_service(Mode::NftablesChains);
}
