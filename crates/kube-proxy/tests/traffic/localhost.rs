//! nftables mode's localhost NodePorts (`KubeProxyNFTablesLocalhostNodePorts`, KEP-6032): TCP
//! from the node to `127.0.0.1:<nodePort>` and `[::1]:<nodePort>` reaches an endpoint through
//! the userspace listener only with the gate on and an explicit loopback entry in
//! `--nodeport-addresses`; the listener follows endpoint changes and the Service's removal;
//! and, unlike upstream's open kubernetes#142183, a restart with another
//! `--nodeport-addresses` takes effect both ways.

use std::net::IpAddr;

use kp_testbed::Outcome;

use crate::support::{CLUSTER_CIDR_DUAL, Env, Flags, Mode, Service, assert_all, metric_sum};

const GATE_ON: &str = "--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true";
const V4_PORT: u16 = 30121;
const V6_PORT: u16 = 30122;
const LISTENERS: &str = "kubeproxy_nftables_localhost_nodeport_listeners";

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

fn flags(addresses: &str, gate: bool) -> Flags {
    let flags =
        Flags::cluster_cidr(CLUSTER_CIDR_DUAL).flag(&format!("--nodeport-addresses={addresses}"));
    if gate { flags.flag(GATE_ON) } else { flags }
}

fn services(c: &kp_testbed::Cluster, pods: &[&str]) -> [Service; 2] {
    [
        Service::new("lo4", "10.96.0.121")
            .tcp(80)
            .node_port(V4_PORT)
            .endpoints(c, pods),
        Service::new("lo6", "fd00:10:96::122")
            .tcp(80)
            .node_port(V6_PORT)
            .endpoints(c, pods),
    ]
}

/// Connections from the node to both loopback NodePorts: answered by exactly `pods` over
/// enough flows to see each, or all refused when `pods` is empty.
fn check(env: &Env, what: &str, pods: &[&str]) {
    let cl = &env.cluster;
    for (addr, port) in [(ip("127.0.0.1"), V4_PORT), (ip("::1"), V6_PORT)] {
        let flows = if pods.is_empty() { 2 } else { 24 };
        let tally = cl.tcp_repeat(cl.node(), addr, port, flows).expect("probe");
        let what = format!("{what}: [{addr}]:{port}");
        if pods.is_empty() {
            assert_all(env, &what, &tally, &Outcome::Refused);
            continue;
        }
        assert!(tally.all_answered(), "{what}: {tally:?}{}", env.diag());
        let seen: Vec<String> = tally.by_pod().into_keys().collect();
        assert_eq!(seen, pods, "{what}: {tally:?}{}", env.diag());
    }
}

pub fn localhost_node_ports(mode: Mode) {
    assert!(mode.is_nftables(), "a scenario of nftables mode");
    let c = crate::scenarios::cluster(true);
    let initial = services(&c, &["a", "b", "c"]);
    // The gate off: nftables mode never serves loopback NodePorts, whatever the addresses
    // say; the node's primary address does answer (primary combines with localhost).
    let mut env = Env::start_with(mode, c, flags("primary,localhost", false), &initial, &[]);
    check(&env, "gate off", &[]);
    let cl = &env.cluster;
    let tally = cl
        .tcp_repeat(cl.external_in(), cl.node_ip(), V4_PORT, 3)
        .expect("probe");
    assert!(
        tally.all_answered(),
        "primary with localhost: {tally:?}{}",
        env.diag()
    );
    assert_eq!(metric_sum(&env.metrics(), LISTENERS), None);

    // The gate on: both families' loopback NodePorts reach every endpoint, remote `c` too.
    env.restart_with(flags("primary,localhost", true));
    check(&env, "gate on", &["a", "b", "c"]);
    assert_eq!(metric_sum(&env.metrics(), LISTENERS), Some(2.0));

    // Endpoint changes, then the Service's removal and return.
    for svc in services(&env.cluster, &["b"]) {
        env.apply(&svc);
    }
    check(&env, "one endpoint left", &["b"]);
    for svc in services(&env.cluster, &[]) {
        env.apply(&svc);
    }
    check(&env, "no endpoints", &[]);
    env.delete("lo4");
    env.delete("lo6");
    check(&env, "Services deleted", &[]);
    assert_eq!(metric_sum(&env.metrics(), LISTENERS), Some(0.0));
    for svc in services(&env.cluster, &["a", "c"]) {
        env.apply(&svc);
    }
    check(&env, "Services back", &["a", "c"]);

    // Restarted without an explicit loopback entry (`all` contains loopback but does not
    // name it), then with `127.0.0.0/8` (IPv4 only), then with localhost again.
    env.restart_with(flags("all", true));
    check(&env, "nodePortAddresses all", &[]);
    env.restart_with(flags("primary,127.0.0.0/8", true));
    let cl = &env.cluster;
    let tally = cl
        .tcp_repeat(cl.node(), ip("127.0.0.1"), V4_PORT, 12)
        .expect("probe");
    assert!(tally.all_answered(), "127.0.0.0/8: {tally:?}{}", env.diag());
    let tally = cl
        .tcp_repeat(cl.node(), ip("::1"), V6_PORT, 2)
        .expect("probe");
    assert_all(&env, "::1 without ::1/128", &tally, &Outcome::Refused);
    env.restart_with(flags("primary,localhost", true));
    check(&env, "localhost again", &["a", "c"]);
}

const UDP_V4: u16 = 30123;
const UDP_V6: u16 = 30124;
const TCP_V4: u16 = 30125;
const REJECTED: &str = "kubeproxy_nftables_localhost_nodeport_rejected_packets_total";
const CLEANUP_FAILURES: &str = "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total";

/// `REJECTED`'s series of `family` and `protocol`, if served.
fn rejected(env: &Env, family: &str, protocol: &str) -> Option<f64> {
    let series = format!("{REJECTED}{{ip_family=\"{family}\",protocol=\"{protocol}\"}}");
    metric_sum(&env.metrics(), &series)
}

/// `n` flows of `protocol` from the node to `[addr]:port`, all with `outcome`.
fn from_node(env: &Env, what: &str, addr: &str, port: u16, udp: bool, outcome: &Outcome) {
    let cl = &env.cluster;
    let tally = if udp {
        cl.udp_repeat(cl.node(), ip(addr), port, 3)
    } else {
        cl.tcp_repeat(cl.node(), ip(addr), port, 3)
    }
    .expect("probe");
    assert_all(env, &format!("{what}: [{addr}]:{port}"), &tally, outcome);
}

/// The table's rejects of localhost NodePorts it does not serve (upstream 1.37): a host
/// program listening on `127.0.0.1` and `::1` on a UDP Service's NodePort gets its datagrams
/// with the gate off; with the gate on the table refuses them (and TCP ones too while no
/// listener serves the family), counted per family and protocol in
/// `kubeproxy_nftables_localhost_nodeport_rejected_packets_total`; the node's primary
/// address still reaches the pods; a switch to the other layout keeps rejecting and counting
/// (and cleans up after the first); a restart with the gate off again lets the program be.
pub fn localhost_rejects(mode: Mode) {
    assert!(mode.is_nftables(), "a scenario of nftables mode");
    let c = crate::scenarios::cluster(true);
    let pods = ["a", "b"];
    let services = [
        Service::new("lu4", "10.96.0.123")
            .udp(80)
            .node_port(UDP_V4)
            .endpoints(&c, &pods),
        Service::new("lu6", "fd00:10:96::124")
            .udp(80)
            .node_port(UDP_V6)
            .endpoints(&c, &pods),
        Service::new("lt4", "10.96.0.125")
            .tcp(80)
            .node_port(TCP_V4)
            .endpoints(&c, &pods),
    ];
    let host_program = kp_testbed::EchoSpec::new("host-program")
        .udp(UDP_V4)
        .udp(UDP_V6)
        .udp_bind(ip("127.0.0.1"))
        .udp_bind(ip("::1"));
    c.start_echo(c.node(), host_program).expect("host program");
    let answered_by_program = |env: &Env, what: &str| {
        let cl = &env.cluster;
        for (addr, port) in [("127.0.0.1", UDP_V4), ("::1", UDP_V6)] {
            let tally = cl.udp_repeat(cl.node(), ip(addr), port, 3).expect("probe");
            let seen: Vec<String> = tally.by_pod().into_keys().collect();
            assert!(
                tally.all_answered(),
                "{what}: [{addr}]:{port}: {tally:?}{}",
                env.diag()
            );
            assert_eq!(seen, ["host-program"], "{what}: [{addr}]:{port}: {tally:?}");
        }
    };

    // The gate off: nothing of the table touches loopback.
    let mut env = Env::start_with(mode, c, flags("primary", false), &services, &[]);
    answered_by_program(&env, "gate off");
    assert_eq!(metric_sum(&env.metrics(), REJECTED), None);

    // The gate on without listeners: UDP and TCP refused and counted, in both families.
    env.restart_with(flags("primary", true));
    from_node(
        &env,
        "gate on",
        "127.0.0.1",
        UDP_V4,
        true,
        &Outcome::Refused,
    );
    from_node(&env, "gate on", "::1", UDP_V6, true, &Outcome::Refused);
    from_node(
        &env,
        "gate on",
        "127.0.0.1",
        TCP_V4,
        false,
        &Outcome::Refused,
    );
    for (family, protocol) in [("IPv4", "UDP"), ("IPv6", "UDP"), ("IPv4", "TCP")] {
        let count = rejected(&env, family, protocol).unwrap_or_default();
        assert!(count >= 3.0, "{family} {protocol}: {count}{}", env.diag());
    }
    assert_eq!(rejected(&env, "IPv6", "TCP"), Some(0.0), "{}", env.diag());
    assert_eq!(rejected(&env, "IPv4", "SCTP"), Some(0.0), "{}", env.diag());
    let cl = &env.cluster;
    let tally = cl
        .udp_repeat(cl.external_in(), cl.node_ip(), UDP_V4, 12)
        .expect("probe");
    let seen: Vec<String> = tally.by_pod().into_keys().collect();
    assert_eq!(seen, pods, "primary UDP NodePort: {tally:?}{}", env.diag());

    // Listeners on both loopback addresses: TCP served (its counter gone), UDP still refused.
    env.restart_with(flags("primary,localhost", true));
    let cl = &env.cluster;
    let tally = cl
        .tcp_repeat(cl.node(), ip("127.0.0.1"), TCP_V4, 12)
        .expect("probe");
    assert!(
        tally.all_answered(),
        "TCP listener: {tally:?}{}",
        env.diag()
    );
    from_node(
        &env,
        "listeners",
        "127.0.0.1",
        UDP_V4,
        true,
        &Outcome::Refused,
    );
    assert_eq!(rejected(&env, "IPv4", "TCP"), None, "{}", env.diag());
    assert!(
        rejected(&env, "IPv4", "UDP").is_some_and(|n| n >= 6.0),
        "{}",
        env.diag()
    );

    // A switch to the other layout keeps the rejects, and removes the first layout's objects
    // without touching the shared set. The chain layout adopts the table, counts included;
    // the default layout replaces a chain layout's table, so its counts start again.
    let before = rejected(&env, "IPv4", "UDP").unwrap_or_default();
    let (other, kept) = match mode {
        Mode::NftablesChains => ("--nftables-layout=maps", 0.0),
        _ => ("--nftables-layout=chains", before),
    };
    env.restart_with(flags("primary,localhost", true).flag(other));
    from_node(&env, other, "127.0.0.1", UDP_V4, true, &Outcome::Refused);
    from_node(&env, other, "::1", UDP_V6, true, &Outcome::Refused);
    assert!(
        rejected(&env, "IPv4", "UDP").is_some_and(|n| n >= kept + 3.0),
        "{other}: {kept}{}",
        env.diag()
    );
    assert_eq!(
        metric_sum(&env.metrics(), CLEANUP_FAILURES),
        Some(0.0),
        "{other}{}",
        env.diag()
    );

    // The gate off again: the rules and counters are gone, the program gets its datagrams.
    env.restart_with(flags("primary", false));
    answered_by_program(&env, "gate off again");
    assert_eq!(metric_sum(&env.metrics(), REJECTED), None);
}
