//! The scenarios of the traffic suite, each a function of the proxy mode. Every scenario
//! builds its own cluster (local pods `a`, `b`, remote pod `c`, plus the client pod), writes
//! manifests, runs the real binary in the node namespace and checks real flows: who answered,
//! which source they saw, and how refused or dropped flows ended.

use std::net::{IpAddr, SocketAddr};

use kp_testbed::{Cluster, Outcome, TestbedError};

use crate::support::{
    CLUSTER_CIDR_DUAL, CLUSTER_CIDR_V4, Env, Mode, NODE_POD_GATEWAY_V4, NODE_POD_GATEWAY_V6,
    Service, Source, assert_all, assert_flows, assert_source, http_get, udp_from_port,
};

/// Flows per balancing check: with 3 endpoints the chance that one of them gets none of 45
/// random picks is about 4e-8; with 2 endpoints and 30 picks about 2e-9.
const SPREAD_FLOWS: usize = 45;
const SPREAD_FLOWS_TWO: usize = 30;

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

/// Local pods `a` and `b`, remote pod `c`.
fn cluster(dual_stack: bool) -> Cluster {
    Cluster::builder()
        .pod("a")
        .pod("b")
        .remote_pod("c")
        .dual_stack(dual_stack)
        .build()
        .expect(
            "test cluster builds (needs root, iproute2, and `cargo build -p kp-testbed --bins`)",
        )
}

/// ClusterIP traffic: balancing over exactly the service's endpoints, masquerade only for
/// traffic not from a pod, iTP Local, ClientIP affinity, no endpoints (REJECT), UDP,
/// hairpin, and SCTP being unavailable here.
pub fn cluster_ip(mode: Mode) {
    let c = cluster(false);
    let services = [
        Service::new("web", "10.96.0.10")
            .tcp(80)
            .udp(80)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("itp", "10.96.0.11")
            .tcp(80)
            .itp_local()
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("sticky", "10.96.0.12")
            .tcp(80)
            .affinity(60)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("empty", "10.96.0.13")
            .tcp(80)
            .udp(80)
            .endpoints(&c, &[]),
        Service::new("self", "10.96.0.14")
            .tcp(80)
            .endpoints(&c, &["a"]),
    ];
    let env = Env::start(mode, c, CLUSTER_CIDR_V4, &services);
    let cl = &env.cluster;
    let client = cl.client();

    // 1. From the client pod: every endpoint of the service, source kept (it is inside the
    //    cluster CIDR).
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.10"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP TCP from a pod",
        &tally,
        &["a", "b", "c"],
        Source::Preserved,
    );

    // ... and from the node itself: masqueraded. (To the remote pod the masquerade address is
    // the node's own LAN address, so there the source looks unchanged either way.)
    let tally = cl
        .tcp_repeat(cl.node(), ip("10.96.0.10"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP TCP from the node",
        &tally,
        &["a", "b", "c"],
        Source::Masqueraded,
    );
    for outcome in tally.outcomes().iter().filter(|o| !o.answered_by("c")) {
        assert_eq!(
            outcome.masqueraded(),
            Some(true),
            "{outcome:?}{}",
            env.diag()
        );
    }

    // 9 (first half). UDP ClusterIP.
    let tally = cl
        .udp_repeat(client, ip("10.96.0.10"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP UDP from a pod",
        &tally,
        &["a", "b", "c"],
        Source::Preserved,
    );

    // 6. internalTrafficPolicy Local: only the local endpoints.
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.11"), 80, SPREAD_FLOWS_TWO)
        .expect("probe");
    assert_flows(
        &env,
        "iTP Local from a pod",
        &tally,
        &["a", "b"],
        Source::Preserved,
    );

    // 7. ClientIP affinity: every connection of one client lands on the same endpoint.
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.12"), 80, 20)
        .expect("probe");
    assert!(tally.all_answered(), "{:?}{}", tally.outcomes(), env.diag());
    let pods = tally.by_pod();
    assert_eq!(
        pods.len(),
        1,
        "affinity: one endpoint for one client, got {pods:?}{}",
        env.diag()
    );
    assert!(
        pods.keys().all(|p| ["a", "b", "c"].contains(&p.as_str())),
        "{pods:?}"
    );
    for outcome in tally.outcomes() {
        assert_source(&env, "affinity", outcome, Source::Preserved);
    }

    // 8. No endpoints: REJECT, i.e. refused for TCP and UDP alike.
    let tcp = cl
        .tcp_repeat(client, ip("10.96.0.13"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "TCP to a service without endpoints",
        &tcp,
        &Outcome::Refused,
    );
    let udp = cl
        .udp_repeat(client, ip("10.96.0.13"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "UDP to a service without endpoints",
        &udp,
        &Outcome::Refused,
    );

    // 10. Hairpin: the only endpoint reaching its own service lands on itself, masqueraded to
    //     the node's address on its veth, not its own IP.
    let a = env.pod("a");
    let outcome = cl.tcp(a, ip("10.96.0.14"), 80).expect("probe");
    assert!(outcome.answered_by("a"), "{outcome:?}{}", env.diag());
    assert_eq!(
        outcome.seen_source().map(|s| s.ip()),
        Some(IpAddr::V4(NODE_POD_GATEWAY_V4)),
        "hairpin source{}",
        env.diag()
    );
    // The same service from another pod is not masqueraded.
    let outcome = cl.tcp(client, ip("10.96.0.14"), 80).expect("probe");
    assert!(outcome.answered_by("a"), "{outcome:?}{}", env.diag());
    assert_source(
        &env,
        "non-hairpin to the same service",
        &outcome,
        Source::Preserved,
    );

    // SCTP cannot be probed on this kernel (no SCTP sockets); SCTP services are exercised by
    // the IPVS VM suite later.
    assert!(matches!(
        cl.sctp(client, ip("10.96.0.10"), 80),
        Err(TestbedError::SctpUnsupported)
    ));
}

/// External traffic: NodePort, externalIPs, LoadBalancer IPs, source ranges and eTP Local
/// (with its health-check node ports).
pub fn external(mode: Mode) {
    let c = cluster(false);
    let services = [
        Service::new("np", "10.96.0.20")
            .tcp(80)
            .node_port(30080)
            .external_ip("192.168.50.100")
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("ranged", "10.96.0.21")
            .tcp(80)
            .node_port(30081)
            .load_balancer("198.51.100.21")
            .source_range("203.0.113.0/25")
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("local", "10.96.0.22")
            .tcp(80)
            .node_port(30082)
            .load_balancer("198.51.100.22")
            .etp_local(32082)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("remote", "10.96.0.23")
            .tcp(80)
            .node_port(30083)
            .load_balancer("198.51.100.23")
            .etp_local(32083)
            .endpoints(&c, &["c"]),
    ];
    let env = Env::start(mode, c, CLUSTER_CIDR_V4, &services);
    let cl = &env.cluster;
    let ext_in = cl.external_in();
    let ext_out = cl.external_out();
    let node_ip = cl.node_ip();
    // The external IP sits in the node LAN's range without being anyone's address: the router
    // sends it to this node, as a cloud's routing would.
    cl.exec(
        cl.router().ns(),
        &[
            "ip",
            "route",
            "add",
            "192.168.50.100/32",
            "via",
            &node_ip.to_string(),
        ],
    )
    .expect("route the external IP to the node");

    // 2. NodePort (eTP Cluster) on the node IP: every endpoint, masqueraded.
    let tally = cl
        .tcp_repeat(ext_in, node_ip, 30080, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "NodePort from outside",
        &tally,
        &["a", "b", "c"],
        Source::Masqueraded,
    );
    assert!(
        tally
            .outcomes()
            .iter()
            .all(|o| o.masqueraded() == Some(true))
    );

    // 3. externalIP and LoadBalancer ingress IP from outside.
    let tally = cl
        .tcp_repeat(ext_in, ip("192.168.50.100"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "externalIP from outside",
        &tally,
        &["a", "b", "c"],
        Source::Masqueraded,
    );
    let tally = cl
        .tcp_repeat(ext_in, ip("198.51.100.21"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "LB IP from inside the source range",
        &tally,
        &["a", "b", "c"],
        Source::Masqueraded,
    );

    // 4. loadBalancerSourceRanges: a client outside the range is dropped at the LB IP ...
    let tally = cl
        .tcp_repeat(ext_out, ip("198.51.100.21"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "LB IP from outside the source range",
        &tally,
        &Outcome::TimedOut,
    );
    // ... while the ranges do not apply to the service's NodePort.
    let tally = cl
        .tcp_repeat(ext_out, node_ip, 30081, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "NodePort of a ranged LB from outside the range",
        &tally,
        &["a", "b", "c"],
        Source::Masqueraded,
    );

    // 5. eTP Local: from outside only the local endpoints, source preserved.
    let tally = cl
        .tcp_repeat(ext_in, node_ip, 30082, SPREAD_FLOWS_TWO)
        .expect("probe");
    assert_flows(
        &env,
        "eTP Local NodePort from outside",
        &tally,
        &["a", "b"],
        Source::Preserved,
    );
    let tally = cl
        .tcp_repeat(ext_in, ip("198.51.100.22"), 80, SPREAD_FLOWS_TWO)
        .expect("probe");
    assert_flows(
        &env,
        "eTP Local LB IP from outside",
        &tally,
        &["a", "b"],
        Source::Preserved,
    );
    // A pod using the LB IP is short-circuited to every endpoint, not masqueraded.
    let tally = cl
        .tcp_repeat(cl.client(), ip("198.51.100.22"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "eTP Local LB IP from a pod",
        &tally,
        &["a", "b", "c"],
        Source::Preserved,
    );

    // eTP Local with only remote endpoints: external traffic dropped, ClusterIP still works.
    let tally = cl.tcp_repeat(ext_in, node_ip, 30083, 2).expect("probe");
    assert_all(
        &env,
        "eTP Local NodePort without local endpoints",
        &tally,
        &Outcome::TimedOut,
    );
    let tally = cl
        .tcp_repeat(ext_in, ip("198.51.100.23"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "eTP Local LB IP without local endpoints",
        &tally,
        &Outcome::TimedOut,
    );
    let tally = cl
        .tcp_repeat(cl.client(), ip("10.96.0.23"), 80, 5)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP of an eTP Local service with remote endpoints",
        &tally,
        &["c"],
        Source::Preserved,
    );

    // Health-check node ports, as a load balancer asks them: from outside, on the node IP.
    let healthy = http_get(cl, ext_in, SocketAddr::new(node_ip, 32082));
    assert_eq!(healthy.status, 200, "{healthy:?}{}", env.diag());
    assert_eq!(
        healthy.header("X-Load-Balancing-Endpoint-Weight"),
        Some("2"),
        "{healthy:?}"
    );
    let unhealthy = http_get(cl, ext_in, SocketAddr::new(node_ip, 32083));
    assert_eq!(unhealthy.status, 503, "{unhealthy:?}{}", env.diag());
    assert_eq!(
        unhealthy.header("X-Load-Balancing-Endpoint-Weight"),
        Some("0"),
        "{unhealthy:?}"
    );
    for (response, name, local) in [(&healthy, "local", 2), (&unhealthy, "remote", 0)] {
        let body = response.json();
        assert_eq!(body["service"]["name"], name, "{body}");
        assert_eq!(body["service"]["namespace"], "default", "{body}");
        assert_eq!(body["localEndpoints"], local, "{body}");
    }
}

/// Stale UDP conntrack after an endpoint change (scenario 9, second half).
pub fn udp_endpoint_replaced(mode: Mode) {
    let c = cluster(false);
    let dns = Service::new("dns", "10.96.0.30").udp(53);
    let env_services = [dns.clone().endpoints(&c, &["a"])];
    let mut env = Env::start(mode, c, CLUSTER_CIDR_V4, &env_services);
    let vip = SocketAddr::new(ip("10.96.0.30"), 53);
    const SPORT: u16 = 40053;

    let client = env.pod("client").clone();
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert!(outcome.answered_by("a"), "{outcome:?}{}", env.diag());
    assert_source(&env, "UDP from a fixed port", &outcome, Source::Preserved);
    // Again from the same port: the flow's conntrack entry is in use.
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert!(outcome.answered_by("a"), "{outcome:?}{}", env.diag());

    // The only endpoint is replaced by another pod; `a` keeps running, so a stale conntrack
    // entry would show as `a` answering.
    let replaced = dns.endpoints(&env.cluster, &["b"]);
    env.apply(&replaced);
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert!(
        outcome.answered_by("b"),
        "the first datagram after the sync must reach the new endpoint: {outcome:?}{}",
        env.diag()
    );
    assert_source(
        &env,
        "UDP after the endpoint change",
        &outcome,
        Source::Preserved,
    );
}

/// Services added and deleted while the proxy runs (13), and a long-lived connection across
/// a proxy restart, a partial and a full resync (11).
pub fn edits_and_restart(mode: Mode) {
    let c = cluster(false);
    let web = Service::new("web", "10.96.0.31")
        .tcp(80)
        .endpoints(&c, &["a", "b", "c"]);
    let late = Service::new("late", "10.96.0.32")
        .tcp(80)
        .endpoints(&c, &["a", "c"]);
    let unrelated = Service::new("unrelated", "10.96.0.33")
        .tcp(80)
        .endpoints(&c, &["b"]);
    let mut env = Env::start(mode, c, CLUSTER_CIDR_V4, &[web]);
    let client = env.pod("client").clone();

    // 13. Before: the VIP is not handled at all: the node routes it to the LAN router, which
    //     has no route for the service range, nor one back to the pod network for its ICMP
    //     error, so the flow just times out (neither answered nor REJECTed).
    let before = env
        .cluster
        .tcp(&client, ip("10.96.0.32"), 80)
        .expect("probe");
    assert_eq!(before, Outcome::TimedOut, "{}", env.diag());
    // Added while running: answers on the first try after the sync.
    env.apply(&late);
    let outcome = env
        .cluster
        .tcp(&client, ip("10.96.0.32"), 80)
        .expect("probe");
    assert!(
        outcome.answered_by("a") || outcome.answered_by("c"),
        "a new service must answer right after its sync: {outcome:?}{}",
        env.diag()
    );
    assert_source(&env, "new service", &outcome, Source::Preserved);
    let tally = env
        .cluster
        .tcp_repeat(&client, ip("10.96.0.32"), 80, SPREAD_FLOWS_TWO)
        .expect("probe");
    assert_flows(&env, "new service", &tally, &["a", "c"], Source::Preserved);
    // Deleted: no longer handled, as before it existed.
    env.delete("late");
    let after = env
        .cluster
        .tcp(&client, ip("10.96.0.32"), 80)
        .expect("probe");
    assert_eq!(
        after,
        Outcome::TimedOut,
        "a deleted service must not answer{}",
        env.diag()
    );

    // 11. A long-lived connection survives a restart of the proxy and resyncs.
    let mut session = env
        .cluster
        .connect(&client, ip("10.96.0.31"), 80)
        .expect("open a long-lived connection");
    let greeting = session.greeting().clone();
    let pod = greeting
        .pod()
        .unwrap_or_else(|| panic!("connect: {greeting:?}{}", env.diag()))
        .to_owned();
    assert_source(&env, "long-lived connection", &greeting, Source::Preserved);
    let mut echo = |env: &Env, step: &str| {
        let outcome = session.send(step).expect("the connection is still open");
        assert!(
            outcome.answered_by(&pod),
            "{step}: the same endpoint ({pod}) must answer on the same connection: {outcome:?}{}",
            env.diag()
        );
    };
    echo(&env, "before-restart");
    env.restart_proxy();
    echo(&env, "after-restart");
    let tally = env
        .cluster
        .tcp_repeat(&client, ip("10.96.0.31"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "new connections after the restart",
        &tally,
        &["a", "b", "c"],
        Source::Preserved,
    );
    env.apply(&unrelated);
    echo(&env, "after-unrelated-edit");
    env.relabel_node(1);
    echo(&env, "after-full-resync");
}

/// IPv6 ClusterIP (dual-stack cluster CIDR so that IPv6 pods are recognised as local).
pub fn ipv6_cluster_ip(mode: Mode) {
    let c = cluster(true);
    let services = [Service::new("web6", "fd00:10:96::10")
        .tcp(80)
        .udp(80)
        .endpoints(&c, &["a", "b", "c"])];
    let env = Env::start(mode, c, CLUSTER_CIDR_DUAL, &services);
    let cl = &env.cluster;
    let vip = ip("fd00:10:96::10");
    let tally = cl
        .tcp_repeat(cl.client(), vip, 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "IPv6 ClusterIP TCP from a pod",
        &tally,
        &["a", "b", "c"],
        Source::Preserved,
    );
    let tally = cl
        .udp_repeat(cl.client(), vip, 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "IPv6 ClusterIP UDP from a pod",
        &tally,
        &["a", "b", "c"],
        Source::Preserved,
    );
    let tally = cl
        .tcp_repeat(cl.node(), vip, 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "IPv6 ClusterIP from the node",
        &tally,
        &["a", "b", "c"],
        Source::Masqueraded,
    );
    let to_local = tally
        .outcomes()
        .iter()
        .find(|o| o.answered_by("a"))
        .and_then(Outcome::seen_source)
        .map(|s| s.ip());
    assert_eq!(to_local, Some(IpAddr::V6(NODE_POD_GATEWAY_V6)));
}
