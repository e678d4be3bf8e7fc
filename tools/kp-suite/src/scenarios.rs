//! The scenarios of the traffic suite, each a function of the proxy mode. Every scenario
//! builds its own cluster (local pods `a`, `b`, remote pod `c`, plus the client pod), writes
//! manifests, runs the real binary in the node namespace and checks real flows: who answered,
//! which source they saw, and how refused or dropped flows ended.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use kp_testbed::{Cluster, LinkLocalScope, Outcome, TestbedError};

use crate::support::{
    CLUSTER_CIDR_DUAL, CLUSTER_CIDR_V4, Env, Flags, Mode, NODE_POD_GATEWAY_V4, NODE_POD_GATEWAY_V6,
    POD_VETH_PREFIX, Service, Source, assert_all, assert_flows, assert_source, http_get,
    http_get_path, kube_lines, kube_proxy, metric_sum, normalized_save, udp_from_port,
};

/// Flows per balancing check: with 3 endpoints the chance that one of them gets none of 45
/// random picks is about 4e-8; with 2 endpoints and 30 picks about 2e-9.
const SPREAD_FLOWS: usize = 45;
const SPREAD_FLOWS_TWO: usize = 30;

/// The source an endpoint sees where the kernel modes keep the client's address. By design,
/// userspace mode's relay opens its own connection to the endpoint, so there every endpoint
/// sees the node's address on its side (the same address a masqueraded flow shows).
fn kept(mode: Mode) -> Source {
    match mode {
        Mode::Iptables
        | Mode::IptablesRestore
        | Mode::NftablesChains
        | Mode::Nftables
        | Mode::Ipvs => Source::Preserved,
        Mode::Userspace => Source::Masqueraded,
    }
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

/// Local pods `a` and `b`, remote pod `c`, on a node shaped like real ones (a second NIC
/// with the default route, secondary addresses, a VIP on `lo`, a link-local service address
/// on a dummy-like device): every scenario must hold there with default flags.
pub fn cluster(dual_stack: bool) -> Cluster {
    Cluster::builder()
        .pod("a")
        .pod("b")
        .remote_pod("c")
        .real_node_shape(true)
        .dual_stack(dual_stack)
        .build()
        .expect(
            "test cluster builds (needs root, iproute2, and `cargo build -p kp-testbed --bins`)",
        )
}

/// ClusterIP traffic: balancing over exactly the service's endpoints, masquerade only for
/// traffic not from a pod, iTP Local, ClientIP affinity, no endpoints (REJECT), a port the
/// service does not define (mode-specific), UDP, hairpin, and SCTP being unavailable here.
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
        kept(mode),
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
        kept(mode),
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
        kept(mode),
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
        assert_source(&env, "affinity", outcome, kept(mode));
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

    // A port the ClusterIP does not define. nftables mode REJECTs it ("Reject traffic to
    // invalid ports of ClusterIPs"); iptables and userspace modes have no such rule, so the
    // node routes the address to the LAN router like any unknown one, and the flow times out
    // there. In ipvs mode the ClusterIP is a local address (on kube-ipvs0), so the node
    // itself answers a port IPVS does not serve: a TCP reset, an ICMP port unreachable.
    let expected = match mode {
        Mode::Iptables | Mode::IptablesRestore | Mode::Userspace => Outcome::TimedOut,
        Mode::NftablesChains | Mode::Nftables | Mode::Ipvs => Outcome::Refused,
    };
    let tcp = cl
        .tcp_repeat(client, ip("10.96.0.10"), 81, 2)
        .expect("probe");
    assert_all(
        &env,
        "TCP to an undefined port of a ClusterIP",
        &tcp,
        &expected,
    );
    let udp = cl
        .udp_repeat(client, ip("10.96.0.10"), 81, 2)
        .expect("probe");
    assert_all(
        &env,
        "UDP to an undefined port of a ClusterIP",
        &udp,
        &expected,
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
        kept(mode),
    );

    // SCTP cannot be probed on the host's kernel (no SCTP sockets); SCTP services have their
    // own suites in the VM (sctp_traffic.rs, ipvs_traffic.rs), whose kernel has them, and
    // where ipvs mode runs.
    if mode != Mode::Ipvs {
        assert!(matches!(
            cl.sctp(client, ip("10.96.0.10"), 80),
            Err(TestbedError::SctpUnsupported)
        ));
    }
}

/// External traffic: NodePort, externalIPs, LoadBalancer IPs, source ranges and eTP Local
/// (with its health-check node ports).
pub fn external(mode: Mode) {
    let c = cluster(false);
    let mut services = vec![
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
    if mode == Mode::Ipvs {
        // Source ranges admitting the node's LAN (for the node's own connections below).
        services.push(
            Service::new("ranged-node", "10.96.0.24")
                .tcp(80)
                .node_port(30084)
                .load_balancer("198.51.100.24")
                .source_range("192.168.50.0/24")
                .endpoints(&c, &["a", "b", "c"]),
        );
    }
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
    // ipvs mode: the node's own connections to an LB IP (local on kube-ipvs0, so their source
    // is the LB IP itself) pass KUBE-IPVS-OUT-FILTER only when a range admits the node
    // (KUBE-LOAD-BALANCER-SOURCE-IP, upstream's allowFromNode). Not asserted for the other
    // modes here.
    if mode == Mode::Ipvs {
        let tally = cl
            .tcp_repeat(cl.node(), ip("198.51.100.21"), 80, 2)
            .expect("probe");
        assert_all(
            &env,
            "LB IP from the node, outside the source ranges",
            &tally,
            &Outcome::TimedOut,
        );
        let tally = cl
            .tcp_repeat(cl.node(), ip("198.51.100.24"), 80, SPREAD_FLOWS)
            .expect("probe");
        assert_flows(
            &env,
            "LB IP from the node, inside the source ranges",
            &tally,
            &["a", "b", "c"],
            Source::Masqueraded,
        );
    }
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

    // 5. eTP Local: from outside only the local endpoints, source preserved (userspace mode:
    //    only the local endpoints too, but the relay cannot preserve the source: `kept`).
    let tally = cl
        .tcp_repeat(ext_in, node_ip, 30082, SPREAD_FLOWS_TWO)
        .expect("probe");
    assert_flows(
        &env,
        "eTP Local NodePort from outside",
        &tally,
        &["a", "b"],
        kept(mode),
    );
    let tally = cl
        .tcp_repeat(ext_in, ip("198.51.100.22"), 80, SPREAD_FLOWS_TWO)
        .expect("probe");
    assert_flows(
        &env,
        "eTP Local LB IP from outside",
        &tally,
        &["a", "b"],
        kept(mode),
    );
    // A pod using the LB IP: iptables and nftables modes short-circuit it to every
    // endpoint, not masqueraded. Userspace mode cannot tell a pod from an outside client once
    // the destination is the LB IP (both reach the external frontend), so the pod gets the
    // external policy: local endpoints only. ipvs mode, as upstream's: the LB IP is one
    // virtual server whatever the source, with the external policy's real servers (local
    // only), and KUBE-LOAD-BALANCER-LOCAL leaves it unmasqueraded.
    let (expected, what): (&[&str], _) = match mode {
        Mode::Iptables | Mode::IptablesRestore | Mode::NftablesChains | Mode::Nftables => {
            (&["a", "b", "c"], SPREAD_FLOWS)
        }
        Mode::Userspace | Mode::Ipvs => (&["a", "b"], SPREAD_FLOWS_TWO),
    };
    let tally = cl
        .tcp_repeat(cl.client(), ip("198.51.100.22"), 80, what)
        .expect("probe");
    assert_flows(
        &env,
        "eTP Local LB IP from a pod",
        &tally,
        expected,
        kept(mode),
    );

    // eTP Local with only remote endpoints: external traffic dropped, ClusterIP still works.
    // ipvs mode, as upstream's (kubernetes#97081): the external virtual servers fall back to
    // the remote endpoint, so pods can still use them; an outside client's flow reaches it
    // unmasqueraded, its answer leaves through the other node and never completes the
    // handshake: timed out all the same.
    let no_local = Outcome::TimedOut;
    let tally = cl.tcp_repeat(ext_in, node_ip, 30083, 2).expect("probe");
    assert_all(
        &env,
        "eTP Local NodePort without local endpoints",
        &tally,
        &no_local,
    );
    let tally = cl
        .tcp_repeat(ext_in, ip("198.51.100.23"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "eTP Local LB IP without local endpoints",
        &tally,
        &no_local,
    );
    let tally = cl
        .tcp_repeat(cl.client(), ip("10.96.0.23"), 80, 5)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP of an eTP Local service with remote endpoints",
        &tally,
        &["c"],
        kept(mode),
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
    external_ips_gated_off(env);
}

/// `AllowServiceExternalIPs=false` (KEP-5707): restarted with the gate off, the proxy's full
/// sync takes the externalIP's rules away while the same Service's NodePort and another's
/// LoadBalancer IP keep answering.
fn external_ips_gated_off(mut env: Env) {
    let mut flags = env.flags().clone();
    flags
        .extra
        .push("--feature-gates=AllowServiceExternalIPs=false".to_owned());
    env.restart_with(flags);
    let cl = &env.cluster;
    let ext_in = cl.external_in();
    let outcome = cl.tcp(ext_in, ip("192.168.50.100"), 80).expect("probe");
    assert_eq!(
        outcome.pod(),
        None,
        "externalIP with AllowServiceExternalIPs=false: {outcome:?}{}",
        env.diag()
    );
    for (dst, port) in [(cl.node_ip(), 30080), (ip("198.51.100.21"), 80)] {
        let outcome = cl.tcp(ext_in, dst, port).expect("probe");
        assert!(
            outcome.pod().is_some(),
            "{dst}:{port} with AllowServiceExternalIPs=false: {outcome:?}{}",
            env.diag()
        );
    }
}

/// Stale UDP conntrack after an endpoint change (scenario 9, second half), after the last
/// endpoint goes (upstream #139629) and after the Service is deleted (#141371).
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
    assert_source(&env, "UDP from a fixed port", &outcome, kept(mode));
    // Again from the same port: the flow's conntrack entry is in use.
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert!(outcome.answered_by("a"), "{outcome:?}{}", env.diag());

    // The only endpoint is replaced by another pod; `a` keeps running, so a stale conntrack
    // entry would show as `a` answering.
    let replaced = dns.clone().endpoints(&env.cluster, &["b"]);
    env.apply(&replaced);
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert!(
        outcome.answered_by("b"),
        "the first datagram after the sync must reach the new endpoint: {outcome:?}{}",
        env.diag()
    );
    assert_source(&env, "UDP after the endpoint change", &outcome, kept(mode));

    // No endpoints, then one again, the client still on the same port: refused while there
    // is none, answered by the new one at once after (userspace mode: its relay port for the
    // service changes with this, so the client's conntrack entry must go with it).
    env.apply(&dns.clone().endpoints(&env.cluster, &[]));
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert_eq!(
        outcome,
        Outcome::Refused,
        "UDP without endpoints{}",
        env.diag()
    );
    env.apply(&dns.endpoints(&env.cluster, &["a"]));
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert!(
        outcome.answered_by("a"),
        "the first datagram after endpoints return must be answered: {outcome:?}{}",
        env.diag()
    );

    // The Service is deleted while the client keeps sending from the same port (upstream
    // #141371): its entry must go with it, or `a`, still running, would keep answering.
    env.delete("dns");
    let outcome = udp_from_port(&env.cluster, &client, vip, SPORT);
    assert_eq!(
        outcome.pod(),
        None,
        "a datagram to a deleted UDP Service must reach no endpoint: {outcome:?}{}",
        env.diag()
    );
}

/// Services added and deleted while the proxy runs (13), and a long-lived connection across
/// a proxy restart, a partial and a full resync (11).
pub fn edits_and_restart(mode: Mode) {
    let c = cluster(false);
    let web = Service::new("web", "10.96.0.31")
        .tcp(80)
        .endpoints(&c, &["a", "b", "c"]);
    // Its name starts with a digit, as the API server accepts since 1.36's
    // RelaxedServiceNameValidation (GA 1.37): the manifests source and every mode's rules
    // take it.
    let late = Service::new("7late", "10.96.0.32")
        .tcp(80)
        .endpoints(&c, &["a", "c"]);
    let unrelated = Service::new("unrelated", "10.96.0.33")
        .tcp(80)
        .endpoints(&c, &["b"]);
    let mut env = Env::start(mode, c, CLUSTER_CIDR_V4, &[web]);
    let client = env.pod("client").clone();

    // 13. Before: the VIP is not handled at all: the node routes it to the LAN router, which
    //     has no route for the service range, nor one back to the pod network for its ICMP
    //     error, so the flow just times out (neither answered nor REJECTed). nftables mode
    //     DROPs unallocated addresses of the service CIDRs when ServiceCIDR objects name
    //     them (none here; see `unallocated_cluster_ips`); a drop would time out the same way.
    let unallocated = match mode {
        Mode::Iptables
        | Mode::IptablesRestore
        | Mode::NftablesChains
        | Mode::Nftables
        | Mode::Userspace
        | Mode::Ipvs => Outcome::TimedOut,
    };
    let before = env
        .cluster
        .tcp(&client, ip("10.96.0.32"), 80)
        .expect("probe");
    assert_eq!(before, unallocated, "{}", env.diag());
    // Added while running: answers on the first try after the sync. (The manifests source
    // delivers the file's Service and EndpointSlice as one batch, so no sync programs the
    // Service alone, which every mode would refuse: ipvs mode flaked on that, issue 6.)
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
    assert_source(&env, "new service", &outcome, kept(mode));
    let tally = env
        .cluster
        .tcp_repeat(&client, ip("10.96.0.32"), 80, SPREAD_FLOWS_TWO)
        .expect("probe");
    assert_flows(&env, "new service", &tally, &["a", "c"], kept(mode));
    // Deleted: no longer handled, as before it existed.
    env.delete("7late");
    let after = env
        .cluster
        .tcp(&client, ip("10.96.0.32"), 80)
        .expect("probe");
    assert_eq!(
        after,
        unallocated,
        "a deleted service must not answer{}",
        env.diag()
    );

    // 11. A long-lived connection survives a restart of the proxy and resyncs. Userspace
    //     mode, by design: the connection lives in the relay, so it ends with the process
    //     (the client sees it closed, never another endpoint); one opened after the restart
    //     survives the resyncs.
    let open = |env: &Env| {
        let session = env
            .cluster
            .connect(&client, ip("10.96.0.31"), 80)
            .expect("open a long-lived connection");
        let greeting = session.greeting().clone();
        let pod = greeting
            .pod()
            .unwrap_or_else(|| panic!("connect: {greeting:?}{}", env.diag()))
            .to_owned();
        assert_source(env, "long-lived connection", &greeting, kept(mode));
        (session, pod)
    };
    let echo = |env: &Env, session: &mut kp_testbed::Session, pod: &str, step: &str| {
        let outcome = session.send(step).expect("the connection is still open");
        assert!(
            outcome.answered_by(pod),
            "{step}: the same endpoint ({pod}) must answer on the same connection: {outcome:?}{}",
            env.diag()
        );
    };
    let (mut session, mut pod) = open(&env);
    echo(&env, &mut session, &pod, "before-restart");
    env.restart_proxy();
    match mode {
        // IPVS keeps its connection table across the proxy's restart, as conntrack does.
        Mode::Iptables
        | Mode::IptablesRestore
        | Mode::NftablesChains
        | Mode::Nftables
        | Mode::Ipvs => {
            echo(&env, &mut session, &pod, "after-restart");
        }
        Mode::Userspace => {
            let outcome = session.send("after-restart");
            assert!(
                !outcome.as_ref().is_ok_and(|o| o.pod().is_some()),
                "a relayed connection cannot outlive the relay: {outcome:?}{}",
                env.diag()
            );
            (session, pod) = open(&env);
        }
    }
    let tally = env
        .cluster
        .tcp_repeat(&client, ip("10.96.0.31"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "new connections after the restart",
        &tally,
        &["a", "b", "c"],
        kept(mode),
    );
    env.apply(&unrelated);
    echo(&env, &mut session, &pod, "after-unrelated-edit");
    env.relabel_node(1);
    echo(&env, &mut session, &pod, "after-full-resync");
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
        kept(mode),
    );
    let tally = cl
        .udp_repeat(cl.client(), vip, 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "IPv6 ClusterIP UDP from a pod",
        &tally,
        &["a", "b", "c"],
        kept(mode),
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

// --- node addresses, masquerade flags, local detection, cleanup, invalid input ----------------

/// A second node-local address, outside the LAN CIDR, that external clients can reach: added
/// to the node's LAN interface, with a route for it on the router.
const SECOND_NODE_IP: &str = "192.168.51.2";

/// `--nodeport-addresses` value of [`restricted_node_ports`]: the node LAN only.
const NODE_LAN_CIDR: &str = "192.168.50.0/24";

/// The kubelet's chains, which `--cleanup` leaves alone.
const KUBELET_CHAINS: [&str; 2] = ["KUBE-FIREWALL", "KUBE-KUBELET-CANARY"];

/// The IPv4 loopback address, the destination of localhost NodePorts.
const LOCALHOST: &str = "127.0.0.1";

/// Runs `args` in the node namespace before the proxy exists (set-up of a scenario).
fn node_setup(cluster: &Cluster, args: &[&str]) {
    cluster
        .exec(cluster.node_ns(), args)
        .unwrap_or_else(|e| panic!("{args:?} in the node namespace: {e}"));
}

/// Gives the node [`SECOND_NODE_IP`] (on its LAN interface) and routes it there from the
/// router.
fn add_second_node_address(cluster: &Cluster) {
    node_setup(
        cluster,
        &[
            "ip",
            "addr",
            "add",
            &format!("{SECOND_NODE_IP}/24"),
            "dev",
            "eth0",
        ],
    );
    let node_ip = cluster.node_ip().to_string();
    cluster
        .exec(
            cluster.router().ns(),
            &["ip", "route", "add", "192.168.51.0/24", "via", &node_ip],
        )
        .expect("route the second node address to the node");
}

/// `net.ipv4.conf.all.route_localnet` in the node namespace.
fn route_localnet(env: &Env) -> String {
    env.node_exec(&["sysctl", "-n", "net.ipv4.conf.all.route_localnet"])
        .trim()
        .to_owned()
}

/// The `KUBE-FORWARD` rules of a filter-table dump that drop conntrack INVALID packets.
fn invalid_drop_rules(save: &str) -> Vec<&str> {
    save.lines()
        .filter(|l| l.starts_with("-A KUBE-FORWARD ") && l.contains("--ctstate INVALID"))
        .filter(|l| l.ends_with("-j DROP"))
        .collect()
}

/// [`assert_flows`] with `Source::Masqueraded`, plus: no endpoint saw the client's own
/// address. `Source::Masqueraded` alone
/// cannot tell for the remote pod, whose masquerade address is the node's LAN address.
fn assert_all_masqueraded(env: &Env, what: &str, tally: &kp_testbed::Tally, expected: &[&str]) {
    assert_flows(env, what, tally, expected, Source::Masqueraded);
    for outcome in tally.outcomes() {
        assert_eq!(
            outcome.masqueraded(),
            Some(true),
            "{what}: {outcome:?}{}",
            env.diag()
        );
    }
}

/// With the default flags. iptables mode: localhost NodePorts (route_localnet set by the
/// proxy, masqueraded), NodePorts on every node address, the conntrack INVALID drop rule.
/// nftables mode, by design: no localhost NodePorts (route_localnet left alone),
/// nodePortAddresses defaults to `primary` (the node IP only), no INVALID drop. Then
/// `--cleanup` (everything of the proxy gone, foreign rules and tables kept, service IPs no
/// longer handled, idempotent).
pub fn node_addresses_and_cleanup(mode: Mode) {
    let c = cluster(true);
    // Whatever the namespace inherited from the host: the proxy must be what turns it on.
    node_setup(&c, &["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=0"]);
    add_second_node_address(&c);
    // Rules of some other agent, there before the proxy; cleanup must leave them.
    for tool in ["iptables", "ip6tables"] {
        node_setup(
            &c,
            &[
                tool,
                "-I",
                "INPUT",
                "-p",
                "tcp",
                "--dport",
                "9",
                "-m",
                "comment",
                "--comment",
                "foreign rule",
                "-j",
                "ACCEPT",
            ],
        );
    }
    node_setup(&c, &["iptables", "-t", "nat", "-N", "FOREIGN-NAT"]);
    node_setup(
        &c,
        &[
            "iptables",
            "-t",
            "nat",
            "-A",
            "FOREIGN-NAT",
            "-d",
            "198.18.0.1/32",
            "-j",
            "RETURN",
        ],
    );
    // ... and an nftables table of its own.
    node_setup(&c, &["nft", "add", "table", "inet", "foreign"]);
    node_setup(&c, &["nft", "add", "chain", "inet", "foreign", "keep"]);
    node_setup(
        &c,
        &[
            "nft", "add", "rule", "inet", "foreign", "keep", "tcp", "dport", "9", "accept",
        ],
    );
    let services = [
        Service::new("np", "10.96.0.50")
            .tcp(80)
            .node_port(30090)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("web6", "fd00:10:96::50")
            .tcp(80)
            .endpoints(&c, &["a", "b", "c"]),
    ];
    let mut env = Env::start(mode, c, CLUSTER_CIDR_DUAL, &services);
    let localhost = ip(LOCALHOST);
    let cl = &env.cluster;

    match mode {
        Mode::Ipvs => {
            // 1. No localhost NodePorts in ipvs mode, as upstream's: the NodePort virtual
            //    servers are on the node's addresses without loopback.
            assert_no_localhost_node_port(&env, 30090, "ipvs mode");
            // nodePortAddresses unset: a virtual server on every node address, the second
            // one included.
            for (address, what) in [
                (cl.node_ip(), "NodePort on the node IP"),
                (ip(SECOND_NODE_IP), "NodePort on a second node address"),
            ] {
                let tally = cl
                    .tcp_repeat(cl.external_in(), address, 30090, SPREAD_FLOWS)
                    .expect("probe");
                assert_all_masqueraded(&env, what, &tally, &["a", "b", "c"]);
            }
        }
        Mode::Iptables | Mode::IptablesRestore | Mode::Userspace => {
            // 1. Localhost NodePort: every endpoint, always masqueraded (a source of
            //    127.0.0.1 cannot leave the node). iptables mode turns route_localnet on;
            //    userspace mode needs not (the redirect keeps loopback traffic on the node).
            let expected = if mode.is_iptables() { "1" } else { "0" };
            assert_eq!(
                route_localnet(&env),
                expected,
                "route_localnet{}",
                env.diag()
            );
            let tally = cl
                .tcp_repeat(cl.node(), localhost, 30090, SPREAD_FLOWS)
                .expect("probe");
            assert_all_masqueraded(
                &env,
                "localhost NodePort from the node",
                &tally,
                &["a", "b", "c"],
            );
            // NodePorts answer on every node address when --nodeport-addresses is unset
            // (the control for `restricted_node_ports`).
            let tally = cl
                .tcp_repeat(cl.external_in(), ip(SECOND_NODE_IP), 30090, SPREAD_FLOWS)
                .expect("probe");
            assert_all_masqueraded(
                &env,
                "NodePort on a second node address",
                &tally,
                &["a", "b", "c"],
            );
        }
        Mode::NftablesChains | Mode::Nftables => {
            // 1. No localhost NodePorts in nftables mode: 127.0.0.1 is never DNATed.
            assert_no_localhost_node_port(&env, 30090, "nftables mode");
            // nodePortAddresses defaults to `primary`: the node IP answers ...
            let tally = cl
                .tcp_repeat(cl.external_in(), cl.node_ip(), 30090, SPREAD_FLOWS)
                .expect("probe");
            assert_all_masqueraded(
                &env,
                "NodePort on the primary node address",
                &tally,
                &["a", "b", "c"],
            );
            // ... a second node address does not (not DNATed: refused by the node).
            let tally = cl
                .tcp_repeat(cl.external_in(), ip(SECOND_NODE_IP), 30090, 2)
                .expect("probe");
            assert_all(
                &env,
                "NodePort on a second node address in nftables mode",
                &tally,
                &Outcome::Refused,
            );
            // `primary` is per family, as upstream: the dual-stack node's IPv6 address takes
            // NodePorts too (never loopback or link-local).
            let ips = env.node_exec(&["nft", "list", "set", "ip6", "kube-proxy", "nodeport-ips"]);
            let node_v6 = kp_testbed::addresses::NODE_V6.to_string();
            assert!(
                ips.contains(&node_v6) && !ips.contains("::1") && !ips.contains("fe80"),
                "ip6 nodeport-ips must hold {node_v6} only:\n{ips}"
            );
        }
    }

    // 5. The conntrack INVALID drop: there by default in iptables mode, in both families;
    //    never in nftables mode (upstream relies on nf_conntrack_tcp_be_liberal there), nor
    //    in userspace mode (no DNAT: the relay terminates every connection itself).
    //    ipvs mode has upstream's KUBE-FORWARD, INVALID drop included.
    match mode {
        Mode::Userspace => {
            for tool in ["iptables-save", "ip6tables-save"] {
                let filter = env.node_exec(&[tool, "-t", "filter"]);
                assert!(
                    invalid_drop_rules(&filter).is_empty(),
                    "{tool}: no INVALID drop in userspace mode:\n{filter}"
                );
            }
        }
        Mode::Iptables | Mode::IptablesRestore | Mode::Ipvs => {
            for tool in ["iptables-save", "ip6tables-save"] {
                let filter = env.node_exec(&[tool, "-t", "filter"]);
                assert_eq!(
                    invalid_drop_rules(&filter).len(),
                    1,
                    "{tool}: one KUBE-FORWARD ctstate INVALID DROP rule expected:\n{filter}"
                );
            }
        }
        Mode::NftablesChains | Mode::Nftables => {
            for family in ["ip", "ip6"] {
                let table = env.node_exec(&["nft", "list", "table", family, "kube-proxy"]);
                assert!(
                    !table.contains("ct state invalid"),
                    "{family}: no ct state invalid drop in nftables mode:\n{table}"
                );
            }
        }
    }

    // 6. --cleanup. The rules outlive a normal exit of the proxy ...
    let saves = |env: &Env| -> Vec<String> {
        ["iptables-save", "ip6tables-save"]
            .iter()
            .map(|tool| env.node_exec(&[tool]))
            .collect()
    };
    let before = saves(&env);
    match mode {
        Mode::Ipvs => {
            for save in &before {
                assert!(
                    !kube_lines(save, &KUBELET_CHAINS).is_empty(),
                    "the proxy programmed nothing?\n{save}"
                );
            }
            let state = ipvs_state(&env);
            for vs in ["10.96.0.50:80", "[fd00:10:96::50]:80", ":30090"] {
                assert!(state.contains(vs), "no virtual server {vs}?\n{state}");
            }
            for set in ["KUBE-CLUSTER-IP", "KUBE-6-CLUSTER-IP"] {
                assert!(state.contains(set), "no ipset {set}?\n{state}");
            }
        }
        Mode::Iptables | Mode::IptablesRestore | Mode::Userspace => {
            for save in &before {
                assert!(
                    !kube_lines(save, &KUBELET_CHAINS).is_empty(),
                    "the proxy programmed nothing?\n{save}"
                );
            }
        }
        Mode::NftablesChains | Mode::Nftables => {
            let tables = env.node_exec(&["nft", "list", "tables"]);
            for table in ["table ip kube-proxy", "table ip6 kube-proxy"] {
                assert!(tables.lines().any(|l| l == table), "{table}?\n{tables}");
            }
        }
    }
    env.stop_proxy();
    let client = env.pod("client").clone();
    let outcome = env
        .cluster
        .tcp(&client, ip("10.96.0.50"), 80)
        .expect("probe");
    match mode {
        // IPVS's virtual servers and kube-ipvs0 stay too.
        Mode::Iptables
        | Mode::IptablesRestore
        | Mode::NftablesChains
        | Mode::Nftables
        | Mode::Ipvs => assert!(
            outcome.pod().is_some(),
            "rules must outlive the proxy's exit: {outcome:?}{}",
            env.diag()
        ),
        // The redirects stay, but the relay they point at went with the process: refused.
        Mode::Userspace => assert_eq!(
            outcome,
            Outcome::Refused,
            "userspace redirects after the proxy's exit{}",
            env.diag()
        ),
    }
    // ... and `kube-proxy --cleanup` removes them: exit status 0 (exec fails otherwise). As
    // upstream, nftables mode's cleanup removes iptables mode's chains too.
    let state = env.state_env();
    let cleanup = [
        "env",
        &state,
        kube_proxy(),
        "--cleanup",
        &format!("--proxy-mode={}", mode.name()),
    ];
    env.node_exec(&cleanup);
    // The kernel settings the proxy changed are back: route_localnet was 0 before iptables
    // mode turned it on (nftables mode never touches it).
    assert_eq!(
        route_localnet(&env),
        "0",
        "route_localnet after --cleanup{}",
        env.diag()
    );
    let after = saves(&env);
    for save in &after {
        let left = kube_lines(save, &KUBELET_CHAINS);
        assert!(
            left.is_empty(),
            "kube-proxy chains or jumps left after --cleanup: {left:#?}\n{save}"
        );
        assert!(
            save.lines()
                .any(|l| l.starts_with("-A INPUT") && l.contains("\"foreign rule\"")),
            "a foreign rule was removed by --cleanup:\n{save}"
        );
    }
    assert!(
        after[0].lines().any(|l| l.starts_with(":FOREIGN-NAT"))
            && after[0]
                .lines()
                .any(|l| l.starts_with("-A FOREIGN-NAT -d 198.18.0.1/32")),
        "a foreign chain was removed by --cleanup:\n{}",
        after[0]
    );
    if mode == Mode::Ipvs {
        // Every virtual server, kube-ipvs0 and every KUBE- ipset are gone too.
        let state = ipvs_state(&env);
        assert!(
            !state.contains("TCP") && !state.contains("KUBE-") && !state.contains("kube-ipvs0"),
            "ipvs state left after --cleanup:\n{state}"
        );
    }
    let tables_after = env.node_exec(&["nft", "list", "tables"]);
    assert!(
        !tables_after.contains("kube-proxy"),
        "kube-proxy tables left after --cleanup:\n{tables_after}"
    );
    let foreign_after = env.node_exec(&["nft", "list", "table", "inet", "foreign"]);
    assert!(
        foreign_after.contains("tcp dport 9 accept"),
        "a foreign nftables table was changed by --cleanup:\n{foreign_after}"
    );
    // No service address is handled any more: the ClusterIP is routed to the router, which
    // drops it (as before a service exists, see `edits_and_restart`); the localhost and
    // node-IP NodePorts reach the node's own stack, where nothing listens.
    let outcome = env
        .cluster
        .tcp(&client, ip("10.96.0.50"), 80)
        .expect("probe");
    assert_eq!(outcome, Outcome::TimedOut, "ClusterIP after --cleanup");
    let cl = &env.cluster;
    let outcome = cl.tcp(cl.node(), localhost, 30090).expect("probe");
    assert_eq!(
        outcome,
        Outcome::Refused,
        "localhost NodePort after --cleanup"
    );
    let outcome = cl
        .tcp(cl.external_in(), cl.node_ip(), 30090)
        .expect("probe");
    assert_eq!(outcome, Outcome::Refused, "NodePort after --cleanup");
    // Cleaning a clean node succeeds and changes nothing.
    env.node_exec(&cleanup);
    for (tool, first) in ["iptables-save", "ip6tables-save"].iter().zip(&after) {
        let again = env.node_exec(&[tool]);
        assert_eq!(
            normalized_save(&again),
            normalized_save(first),
            "{tool}: a second --cleanup changed the rules"
        );
    }
    assert_eq!(
        env.node_exec(&["nft", "list", "tables"]),
        tables_after,
        "a second --cleanup changed the nftables tables"
    );
    assert_eq!(
        env.node_exec(&["nft", "list", "table", "inet", "foreign"]),
        foreign_after,
        "a second --cleanup changed a foreign table"
    );
}

/// 127.0.0.1:`port` is no NodePort: the SYN reaches the node's own stack where nothing
/// listens (RST), and route_localnet stays off.
fn assert_no_localhost_node_port(env: &Env, port: u16, what: &str) {
    assert_eq!(route_localnet(env), "0", "route_localnet{}", env.diag());
    let cl = &env.cluster;
    let tally = cl
        .tcp_repeat(cl.node(), ip(LOCALHOST), port, 2)
        .expect("probe");
    assert_all(
        env,
        &format!("localhost NodePort in {what}"),
        &tally,
        &Outcome::Refused,
    );
}

/// ipvs mode's kernel state in the node namespace: `ipvsadm -Ln`, the names of the ipsets,
/// and kube-ipvs0's addresses (or nothing when the device is gone).
fn ipvs_state(env: &Env) -> String {
    let ipvs = env.node_exec(&["ipvsadm", "-Ln"]);
    let sets = env.node_exec(&["ipset", "list", "-n"]);
    let links = env.node_exec(&["ip", "-o", "addr", "show"]);
    let dummy: String = links
        .lines()
        .filter(|l| l.contains("kube-ipvs0"))
        .map(|l| format!("{l}\n"))
        .collect();
    format!("{ipvs}\n{sets}\n{dummy}")
}

/// `--nodeport-addresses` restricted to the node LAN, with `nf_conntrack_tcp_be_liberal`
/// set before the proxy starts: NodePorts answer on the LAN address only (not on another
/// node address, nor on 127.0.0.1 although localhost NodePorts are on), route_localnet is
/// left alone, and the conntrack INVALID drop rule is skipped (iptables mode; nftables mode
/// never has one).
pub fn restricted_node_ports(mode: Mode) {
    let c = cluster(false);
    node_setup(&c, &["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=0"]);
    node_setup(
        &c,
        &[
            "sysctl",
            "-qw",
            "net.netfilter.nf_conntrack_tcp_be_liberal=1",
        ],
    );
    add_second_node_address(&c);
    let services = [Service::new("np", "10.96.0.60")
        .tcp(80)
        .node_port(30091)
        .endpoints(&c, &["a", "b", "c"])];
    let flags = Flags::cluster_cidr(CLUSTER_CIDR_V4)
        .flag(&format!("--nodeport-addresses={NODE_LAN_CIDR}"))
        .flag("--iptables-localhost-nodeports=true");
    let env = Env::start_with(mode, c, flags, &services, &[]);
    let cl = &env.cluster;

    // 2. The LAN address answers ...
    let tally = cl
        .tcp_repeat(cl.external_in(), cl.node_ip(), 30091, SPREAD_FLOWS)
        .expect("probe");
    assert_all_masqueraded(
        &env,
        "NodePort on the allowed address",
        &tally,
        &["a", "b", "c"],
    );
    // ... another node address does not: not DNATed, the SYN reaches the node's own stack,
    // where nothing listens on the port (RST).
    let tally = cl
        .tcp_repeat(cl.external_in(), ip(SECOND_NODE_IP), 30091, 2)
        .expect("probe");
    assert_all(
        &env,
        "NodePort on a node address outside --nodeport-addresses",
        &tally,
        &Outcome::Refused,
    );
    // ... nor 127.0.0.1, outside the allowed CIDR: refused the same way, and the proxy has
    // no reason to open route_localnet.
    let tally = cl
        .tcp_repeat(cl.node(), ip(LOCALHOST), 30091, 2)
        .expect("probe");
    assert_all(
        &env,
        "localhost NodePort outside --nodeport-addresses",
        &tally,
        &Outcome::Refused,
    );
    assert_eq!(route_localnet(&env), "0", "route_localnet{}", env.diag());
    // The ClusterIP is unaffected.
    let tally = cl
        .tcp_repeat(cl.client(), ip("10.96.0.60"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP with restricted NodePorts",
        &tally,
        &["a", "b", "c"],
        kept(mode),
    );

    // 5. tcp_be_liberal: no INVALID drop in either family, the rest of the forward filter
    //    kept. Userspace mode has no forward filter and never an INVALID drop; its filter
    //    chain is there.
    //    ipvs mode has iptables mode's KUBE-FORWARD (upstream's), so the same checks.
    match mode {
        Mode::Userspace => {
            let v4 = env.node_exec(&["iptables-save", "-t", "filter"]);
            assert!(
                v4.lines()
                    .any(|l| l.starts_with("-A FORWARD") && l.contains("KUBE-USERSPACE-FILTER")),
                "KUBE-USERSPACE-FILTER is not hooked:\n{v4}"
            );
            let v6 = env.node_exec(&["ip6tables-save", "-t", "filter"]);
            for save in [&v4, &v6] {
                assert!(invalid_drop_rules(save).is_empty(), "{save}");
            }
        }
        Mode::Iptables | Mode::IptablesRestore | Mode::Ipvs => {
            let v4 = env.node_exec(&["iptables-save", "-t", "filter"]);
            assert!(
                v4.lines()
                    .any(|l| l.starts_with("-A KUBE-FORWARD") && l.contains("forwarding rules")),
                "KUBE-FORWARD is incomplete:\n{v4}"
            );
            let v6 = env.node_exec(&["ip6tables-save", "-t", "filter"]);
            for save in [&v4, &v6] {
                assert!(
                    invalid_drop_rules(save).is_empty(),
                    "no INVALID drop with nf_conntrack_tcp_be_liberal=1:\n{save}"
                );
            }
        }
        Mode::NftablesChains | Mode::Nftables => {
            for family in ["ip", "ip6"] {
                let forward = env.node_exec(&[
                    "nft",
                    "list",
                    "chain",
                    family,
                    "kube-proxy",
                    "filter-forward",
                ]);
                let complete = if mode == Mode::Nftables {
                    forward.contains("jump entry-filter")
                        && forward.contains("jump cluster-ip-filter")
                } else {
                    forward.contains("jump service-endpoints-check")
                        && forward.contains("jump cluster-ips-check")
                };
                assert!(
                    complete,
                    "{family} filter-forward is incomplete:\n{forward}"
                );
                let table = env.node_exec(&["nft", "list", "table", family, "kube-proxy"]);
                assert!(
                    !table.contains("ct state invalid"),
                    "{family}: no ct state invalid drop in nftables mode:\n{table}"
                );
            }
        }
    }
}

/// Manifests the proxy must skip without blocking anything else: a port out of range (the
/// model rejects the Service) and a cluster IP that is not an address (the manifests source
/// cannot default it).
const INVALID_MANIFESTS: [(&str, &str); 2] = [
    (
        "bad-port.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: bad-port\n  namespace: default\n\
         spec:\n  type: ClusterIP\n  clusterIP: \"10.96.0.73\"\n  ports:\n    - name: tcp\n      \
         protocol: TCP\n      port: 70000\n      targetPort: 8080\n",
    ),
    (
        "bad-ip.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: bad-ip\n  namespace: default\n\
         spec:\n  type: ClusterIP\n  clusterIP: \"10.96.0.300\"\n  ports:\n    - name: tcp\n      \
         protocol: TCP\n      port: 80\n      targetPort: 8080\n",
    ),
];

/// `--masquerade-all` with `--iptables-localhost-nodeports=false`, and invalid or odd
/// objects next to valid ones: pod traffic to a ClusterIP is masqueraded, 127.0.0.1 is not a
/// NodePort address, and skipped objects are logged and counted without blocking the rest.
pub fn masquerade_all_and_invalid_input(mode: Mode) {
    let c = cluster(false);
    node_setup(&c, &["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=0"]);
    // The longest names the API accepts: 63-character namespace and Service name, and a
    // 15-character port name.
    let long_namespace = format!("ns-{}", "x".repeat(60));
    let long_name = format!("svc-{}", "y".repeat(59));
    let services = [
        Service::new("web", "10.96.0.70")
            .tcp(80)
            .node_port(30092)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new(&long_name, "10.96.0.71")
            .namespace(&long_namespace)
            .tcp(80)
            .port_name("longest-port-nm")
            .endpoints(&c, &["a"]),
        // The API would reject this port name; the manifests source does not validate it, so
        // it reaches the rules' comments, which must neutralise the quote.
        Service::new("quoted", "10.96.0.72")
            .tcp(80)
            .port_name("p\" -j ACCEPT #\\")
            .endpoints(&c, &["b"]),
    ];
    let flags = Flags::cluster_cidr(CLUSTER_CIDR_V4)
        .flag("--masquerade-all")
        .flag("--iptables-localhost-nodeports=false");
    let env = Env::start_with(mode, c, flags, &services, &INVALID_MANIFESTS);
    let cl = &env.cluster;
    let client = cl.client();

    // 3. Masquerade-all: even a pod inside the cluster CIDR is masqueraded.
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.70"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_all_masqueraded(
        &env,
        "ClusterIP from a pod with --masquerade-all",
        &tally,
        &["a", "b", "c"],
    );

    // 7. The valid services work next to the skipped ones, long names included.
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.71"), 80, 3)
        .expect("probe");
    assert_all_masqueraded(&env, "service with the longest names", &tally, &["a"]);
    let tally = cl
        .tcp_repeat(client, ip("10.96.0.72"), 80, 3)
        .expect("probe");
    assert_all_masqueraded(&env, "service with a quote in a port name", &tally, &["b"]);
    match mode {
        // No name reaches the kernel in ipvs mode: virtual servers are keyed by address, and
        // the iptables rules do not depend on the services (the ipsets carry them).
        Mode::Ipvs => {
            let state = ipvs_state(&env);
            for vs in ["10.96.0.71:80", "10.96.0.72:80"] {
                assert!(state.contains(vs), "no virtual server {vs}?\n{state}");
            }
            assert!(
                !state.contains("10.96.0.73") && !state.contains("10.96.0.300"),
                "skipped objects must not be programmed:\n{state}"
            );
            let save = env.node_exec(&["iptables-save"]);
            for name in ["quoted", "ACCEPT #", "longest-port-nm", "bad-"] {
                assert!(!save.contains(name), "{name} in the rules:\n{save}");
            }
        }
        // Both write the names into rule comments only.
        Mode::Iptables | Mode::IptablesRestore | Mode::Userspace => {
            let nat = env.node_exec(&["iptables-save", "-t", "nat"]);
            assert!(
                nat.contains("default/quoted:p%22 -j ACCEPT #%5C"),
                "the quoted port name must appear encoded in comments:\n{nat}"
            );
            assert!(
                nat.contains(&format!("{long_namespace}/{long_name}:longest-port-nm")),
                "the long names must appear in comments:\n{nat}"
            );
            assert!(
                !nat.contains("bad-port") && !nat.contains("bad-ip"),
                "skipped objects must not be programmed:\n{nat}"
            );
        }
        Mode::Nftables => {
            // No name reaches this layout: its elements hold addresses and ports only.
            let table = env.node_exec(&["nft", "list", "table", "ip", "kube-proxy"]);
            assert!(
                !table.contains("quoted") && !table.contains(long_name.as_str()),
                "service names must not reach the verdict-free layout:\n{table}"
            );
            assert!(
                !table.contains("10.96.0.73") && !table.contains("bad-ip"),
                "skipped objects must not be programmed:\n{table}"
            );
        }
        Mode::NftablesChains => {
            // The names are in the per-service chain names, with characters nft identifiers
            // cannot hold replaced.
            let table = env.node_exec(&["nft", "list", "table", "ip", "kube-proxy"]);
            for (namespace, name, port) in [
                ("default", "quoted", "p\" -j ACCEPT #\\"),
                (
                    long_namespace.as_str(),
                    long_name.as_str(),
                    "longest-port-nm",
                ),
            ] {
                let chain = nft_service_chain(namespace, name, port);
                assert!(
                    table.contains(&format!("chain {chain} {{")),
                    "chain {chain} of {namespace}/{name}:{port} missing:\n{table}"
                );
            }
            assert!(
                table.contains(&format!(
                    "-{long_namespace}/{long_name}/tcp/longest-port-nm"
                )),
                "the long names must appear in chain names:\n{table}"
            );
            assert!(
                !table.contains("bad-port") && !table.contains("bad-ip"),
                "skipped objects must not be programmed:\n{table}"
            );
        }
    }
    let skipped_port = env.logged(|l| l.contains("default/bad-port") && l.contains("70000"));
    assert!(
        !skipped_port.is_empty(),
        "the proxy must log the Service with port 70000{}",
        env.diag()
    );
    let skipped_ip = env.logged(|l| l.contains("bad-ip") && l.contains("10.96.0.300"));
    assert!(
        !skipped_ip.is_empty(),
        "the proxy must log the Service with an invalid clusterIP{}",
        env.diag()
    );
    let metrics = env.metrics();
    let invalid = metric_sum(&metrics, "kube_proxy_rs_invalid_objects_total");
    assert!(
        invalid.is_some_and(|n| n >= 1.0),
        "kube_proxy_rs_invalid_objects_total: {invalid:?}\n{metrics}"
    );
    let broken = metric_sum(&metrics, "kube_proxy_rs_manifest_errors_total");
    assert!(
        broken.is_some_and(|n| n >= 1.0),
        "kube_proxy_rs_manifest_errors_total: {broken:?}\n{metrics}"
    );

    // 1. Localhost NodePorts off: 127.0.0.1 is excluded from the NodePort dispatch, so the
    //    SYN is not DNATed and reaches the node's own stack, where nothing listens on the
    //    port: refused (RST), not timed out. route_localnet stays off and there is no
    //    localnet firewall chain.
    let tally = cl
        .tcp_repeat(cl.node(), ip(LOCALHOST), 30092, 2)
        .expect("probe");
    assert_all(
        &env,
        "localhost NodePort with --iptables-localhost-nodeports=false",
        &tally,
        &Outcome::Refused,
    );
    assert_eq!(route_localnet(&env), "0", "route_localnet{}", env.diag());
    match mode {
        Mode::Iptables | Mode::IptablesRestore | Mode::Userspace | Mode::Ipvs => {
            let filter = env.node_exec(&["iptables-save", "-t", "filter"]);
            assert!(
                !filter.contains("KUBE-FIREWALL"),
                "no localnet firewall without localhost NodePorts:\n{filter}"
            );
            if mode == Mode::Ipvs {
                // Never a virtual server on loopback.
                let state = ipvs_state(&env);
                assert!(!state.contains("127.0.0.1"), "{state}");
            }
        }
        Mode::NftablesChains | Mode::Nftables => {
            // Never localhost NodePorts: the NodePort addresses are the node's primary IP.
            let ips = env.node_exec(&["nft", "list", "set", "ip", "kube-proxy", "nodeport-ips"]);
            assert!(
                ips.contains(&env.cluster.node_ip().to_string()) && !ips.contains("127."),
                "nodeport-ips must hold the node IP only:\n{ips}"
            );
        }
    }
    // The same NodePort on the node's IP works.
    let tally = cl
        .tcp_repeat(cl.node(), cl.node_ip(), 30092, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "NodePort on the node IP from the node",
        &tally,
        &["a", "b", "c"],
        Source::Masqueraded,
    );
}

/// nftables mode's `service-` chain of a TCP service port.
fn nft_service_chain(namespace: &str, name: &str, port: &str) -> String {
    let port_name = kp_core::model::ServicePortName {
        service: kp_core::model::ServiceName {
            namespace: namespace.into(),
            name: name.into(),
        },
        port: port.into(),
        protocol: kp_core::model::Protocol::Tcp,
    };
    kp_rules::nftables::names::ServiceChains::new(&port_name).service
}

/// `--detect-local-mode=InterfaceNamePrefix` with the harness's pod veth prefix and no
/// cluster CIDR: traffic entering from a pod veth is local (not masqueraded), the node's own
/// is not. (BridgeInterface cannot be exercised: pods are routed point-to-point, the node
/// namespace has no bridge; the harness's only bridge is the LAN in `ext`.)
pub fn interface_name_prefix(mode: Mode) {
    let c = cluster(false);
    let bridges = c
        .exec(c.node_ns(), &["ip", "-o", "link", "show", "type", "bridge"])
        .expect("list bridges");
    assert!(
        bridges.trim().is_empty(),
        "the node has a bridge now; add a BridgeInterface scenario: {bridges}"
    );
    let services = [Service::new("web", "10.96.0.80")
        .tcp(80)
        .endpoints(&c, &["a", "b", "c"])];
    let flags = Flags::default()
        .flag("--detect-local-mode=InterfaceNamePrefix")
        .flag(&format!("--pod-interface-name-prefix={POD_VETH_PREFIX}"));
    let env = Env::start_with(mode, c, flags, &services, &[]);
    if mode.is_nftables() {
        // Upstream #134024: an interface *name* match (`iif` takes an existing interface's
        // index and refuses a wildcard), in both layouts.
        let table = env.node_exec(&["nft", "list", "table", "ip", "kube-proxy"]);
        let prefix = format!("iifname != \"{POD_VETH_PREFIX}*\"");
        assert!(table.contains(&prefix), "no `{prefix}`: {table}");
        assert!(!table.contains(" iif "), "{table}");
    }
    let cl = &env.cluster;
    let tally = cl
        .tcp_repeat(cl.client(), ip("10.96.0.80"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP from a pod (interface prefix)",
        &tally,
        &["a", "b", "c"],
        kept(mode),
    );
    let tally = cl
        .tcp_repeat(cl.node(), ip("10.96.0.80"), 80, SPREAD_FLOWS)
        .expect("probe");
    assert_flows(
        &env,
        "ClusterIP from the node (interface prefix)",
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
}

/// nftables mode's no-endpoint verdicts after DNAT (upstream #132456; both layouts judge them
/// in the filter chains at priority 0): a Service without endpoints is refused (REJECT) from a
/// pod, the node and outside, over TCP and UDP, at its ClusterIP, externalIP and NodePort (the
/// node's own UDP to the ClusterIP and externalIP is rejected in `output`, where the kernel
/// fails the send with `EPERM` instead of answering it, as for upstream's same rule); an
/// externalTrafficPolicy Local Service whose only endpoint is on another node is dropped for
/// outside clients, while a pod and the node reach that endpoint through the same externalIP,
/// LB IP and NodePort (short-circuited: #131765, which the earlier pre-DNAT filters broke).
pub fn nftables_filters_after_dnat(mode: Mode) {
    let c = cluster(false);
    let services = [
        Service::new("empty", "10.96.0.40")
            .tcp(80)
            .udp(80)
            .node_port(30040)
            .external_ip("192.168.50.140")
            .endpoints(&c, &[]),
        Service::new("remote", "10.96.0.41")
            .tcp(80)
            .node_port(30041)
            .external_ip("192.168.50.141")
            .load_balancer("198.51.100.41")
            .etp_local(32041)
            .endpoints(&c, &["c"]),
    ];
    let node_ip = c.node_ip();
    for ext in ["192.168.50.140", "192.168.50.141"] {
        c.exec(
            c.router().ns(),
            &[
                "ip",
                "route",
                "add",
                &format!("{ext}/32"),
                "via",
                &node_ip.to_string(),
            ],
        )
        .expect("route the external IP to the node");
    }
    let env = Env::start(mode, c, CLUSTER_CIDR_V4, &services);
    // The layout asked for is the one written (the start-up probe keeps the verdict-free one
    // off hosts whose nft cannot run scripts; this one can).
    let table = env.node_exec(&["nft", "-t", "list", "table", "ip", "kube-proxy"]);
    let maps = table.contains("chain dispatch {");
    assert_eq!(maps, mode == Mode::Nftables, "{table}");
    let cl = &env.cluster;
    let sources = [
        ("a pod", cl.client()),
        ("the node", cl.node()),
        ("outside", cl.external_in()),
    ];
    for (who, from) in sources {
        let mut targets = vec![
            ("externalIP", ip("192.168.50.140"), 80),
            ("NodePort", node_ip, 30040),
        ];
        if who != "outside" {
            targets.push(("ClusterIP", ip("10.96.0.40"), 80));
        }
        for (what, dst, port) in targets {
            let what = format!("{what} without endpoints from {who}");
            let tcp = cl.tcp_repeat(from, dst, port, 1).expect("probe");
            assert_all(&env, &format!("TCP to the {what}"), &tcp, &Outcome::Refused);
            let udp = cl.udp_repeat(from, dst, port, 1).expect("probe");
            let udp_expected = if who == "the node" && !what.starts_with("NodePort") {
                Outcome::Failed {
                    detail: "Operation not permitted (os error 1)".to_owned(),
                }
            } else {
                Outcome::Refused
            };
            assert_all(&env, &format!("UDP to the {what}"), &udp, &udp_expected);
        }
    }
    let remote = [
        ("externalIP", ip("192.168.50.141"), 80),
        ("LB IP", ip("198.51.100.41"), 80),
        ("NodePort", node_ip, 30041),
    ];
    for (what, dst, port) in remote {
        for (who, from) in &sources[..2] {
            let tally = cl.tcp_repeat(from, dst, port, 3).expect("probe");
            let what = format!("eTP Local {what} with a remote endpoint from {who}");
            assert_eq!(
                answering_pods(&env, &what, &tally),
                ["c"],
                "{what}{}",
                env.diag()
            );
        }
        let tally = cl
            .tcp_repeat(cl.external_in(), dst, port, 1)
            .expect("probe");
        let what = format!("eTP Local {what} with a remote endpoint from outside");
        assert_all(&env, &what, &tally, &Outcome::TimedOut);
    }
}

/// ServiceCIDR objects: nftables mode DROPs new flows to an address of a service CIDR that
/// no Service holds (upstream's "Drop traffic to unallocated ClusterIPs"); the other modes,
/// like upstream's, leave such traffic alone. So that a drop is told apart from "not
/// handled" (both would time out towards the LAN router), the unallocated address is made
/// reachable: pod `a` holds it too, and the node routes it there.
pub fn unallocated_cluster_ips(mode: Mode) {
    const UNALLOCATED: &str = "10.96.0.200";
    let c = cluster(false);
    let services = [Service::new("web", "10.96.0.10")
        .tcp(80)
        .endpoints(&c, &["a", "b"])];
    let service_cidr = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  \
                        name: kubernetes\nspec:\n  cidrs: [10.96.0.0/16]\n";
    let env = Env::start_with(
        mode,
        c,
        Flags::cluster_cidr(CLUSTER_CIDR_V4),
        &services,
        &[("servicecidr.yaml", service_cidr)],
    );
    let a = env.pod("a").clone();
    let client = env.pod("client").clone();
    let node = env.cluster.node_ns().to_owned();
    env.cluster
        .exec(
            a.ns(),
            &[
                "ip",
                "addr",
                "add",
                &format!("{UNALLOCATED}/32"),
                "dev",
                "lo",
            ],
        )
        .expect("address on pod a");
    let to_a = env
        .cluster
        .exec(&node, &["ip", "-o", "route", "get", &a.ip().to_string()])
        .expect("route to pod a");
    let dev = to_a
        .split_whitespace()
        .skip_while(|w| *w != "dev")
        .nth(1)
        .expect("route names a device")
        .to_owned();
    env.cluster
        .exec(
            &node,
            &[
                "ip",
                "route",
                "add",
                &format!("{UNALLOCATED}/32"),
                "dev",
                &dev,
            ],
        )
        .expect("route to the unallocated address");

    let outcome = env
        .cluster
        .tcp(&client, ip(UNALLOCATED), kp_testbed::DEFAULT_ECHO_PORT)
        .expect("probe");
    match mode {
        Mode::NftablesChains | Mode::Nftables => assert_eq!(
            outcome,
            Outcome::TimedOut,
            "dropped: inside the ServiceCIDR, no Service{}",
            env.diag()
        ),
        Mode::Iptables | Mode::IptablesRestore | Mode::Userspace | Mode::Ipvs => assert!(
            outcome.answered_by("a"),
            "not the proxy's business: {outcome:?}{}",
            env.diag()
        ),
    }
    // The Service inside the range answers as ever.
    let outcome = env
        .cluster
        .tcp(&client, ip("10.96.0.10"), 80)
        .expect("probe");
    assert!(
        outcome.answered_by("a") || outcome.answered_by("b"),
        "{outcome:?}{}",
        env.diag()
    );
}

// --- affinity across a service port's addresses, the node's own traffic ------------------

/// The answering pod of every flow of `tally`, asserting that each was answered.
fn answering_pods(env: &Env, what: &str, tally: &kp_testbed::Tally) -> Vec<String> {
    assert!(
        tally.all_answered(),
        "{what}: not every flow was answered: {:?}{}",
        tally.outcomes(),
        env.diag()
    );
    tally.by_pod().into_keys().collect()
}

/// A service whose ClientIP affinity is switched on while the proxy runs.
fn pinned_later(c: &Cluster) -> Service {
    Service::new("pinned-later", "10.96.0.35")
        .tcp(80)
        .node_port(30095)
        .endpoints(c, &["a", "b", "c"])
}

/// Affinity switched on by an edit (a partial sync: in nftables mode the port's maps, sets
/// and rules go over netlink with its elements) pins a pod's connections through the
/// ClusterIP and the NodePort to one endpoint.
fn affinity_switched_on(env: &mut Env, mode: Mode) {
    let synced = env.apply(&pinned_later(&env.cluster).affinity(600));
    let cl = &env.cluster;
    let node_ip = cl.node_ip();
    let mut seen = Vec::new();
    for (what, dst, port) in [
        ("ClusterIP", ip("10.96.0.35"), 80),
        ("NodePort", node_ip, 30095),
    ] {
        let tally = cl.tcp_repeat(cl.client(), dst, port, 4).expect("probe");
        let pods = answering_pods(env, what, &tally);
        assert_eq!(
            pods.len(),
            1,
            "affinity switched on, through the {what}: {pods:?} (after {synced}){}",
            env.diag()
        );
        seen.push(pods[0].clone());
    }
    if mode != Mode::Ipvs {
        assert_eq!(
            seen[0],
            seen[1],
            "one endpoint across both addresses once affinity is on{}",
            env.diag()
        );
    }
}

/// ClientIP affinity is kept per service port, whichever of its addresses (ClusterIP,
/// NodePort, externalIP, LB IP) a client uses, with its timeout; and the node's own traffic:
/// to an externalIP or NodePort of an `externalTrafficPolicy: Local` service with only a
/// remote endpoint it goes to that endpoint (internal traffic, as upstream), and a node inside
/// `loadBalancerSourceRanges` reaches an LB IP it holds itself (a VIP on the node, so its
/// source is the VIP: upstream's allowFromNode), while one outside them does not.
pub fn affinity_and_node_traffic(mode: Mode) {
    let c = cluster(false);
    let services = [
        Service::new("sticky", "10.96.0.30")
            .tcp(80)
            .node_port(30090)
            .external_ip("192.168.50.130")
            .load_balancer("198.51.100.30")
            .affinity(600)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("brief", "10.96.0.31")
            .tcp(80)
            .affinity(2)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("remote-local", "10.96.0.32")
            .tcp(80)
            .node_port(30092)
            .external_ip("192.168.50.132")
            .load_balancer("198.51.100.32")
            .etp_local(32092)
            .endpoints(&c, &["c"]),
        Service::new("vip-admitted", "10.96.0.33")
            .tcp(80)
            .load_balancer("198.51.100.33")
            .source_range("192.168.50.0/24")
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("vip-refused", "10.96.0.34")
            .tcp(80)
            .load_balancer("198.51.100.34")
            .source_range("203.0.113.0/25")
            .endpoints(&c, &["a", "b", "c"]),
        pinned_later(&c),
    ];
    let node_ip = c.node_ip().to_string();
    for ext in ["192.168.50.130", "192.168.50.132"] {
        c.exec(
            c.router().ns(),
            &["ip", "route", "add", &format!("{ext}/32"), "via", &node_ip],
        )
        .expect("route the external IP to the node");
    }
    let mut env = Env::start_with(
        mode,
        c,
        Flags::cluster_cidr(CLUSTER_CIDR_V4).flag("--debug-explain"),
        &services,
        &[],
    );
    affinity_switched_on(&mut env, mode);
    let cl = &env.cluster;
    // The VIPs on the node itself (ipvs mode makes every LB IP local on kube-ipvs0 anyway).
    // Added once the proxy runs: on `lo`, they would otherwise be the "first local address"
    // that nftables mode's default nodePortAddresses (`primary`) resolves to at start-up.
    if mode != Mode::Ipvs {
        for vip in ["198.51.100.33/32", "198.51.100.34/32"] {
            node_setup(cl, &["ip", "addr", "add", vip, "dev", "lo"]);
        }
    }
    let node_ip = cl.node_ip();

    // One client through every address of the service port: one endpoint. ipvs mode, by
    // design as upstream's: affinity is IPVS persistence, kept per virtual server, so each
    // address pins the client on its own.
    // Another client first, through the NodePort: a relay whose frontends kept pins (and
    // round robin) of their own would then send the pod's NodePort connection to another
    // endpoint than its ClusterIP one.
    let other = cl
        .tcp_repeat(cl.external_out(), node_ip, 30090, 1)
        .expect("probe");
    answering_pods(&env, "NodePort from another client", &other);
    let frontends = [
        ("ClusterIP", ip("10.96.0.30"), 80),
        ("NodePort", node_ip, 30090),
        ("externalIP", ip("192.168.50.130"), 80),
        ("LB IP", ip("198.51.100.30"), 80),
    ];
    for (client, name) in [(cl.client(), "a pod"), (cl.external_in(), "outside")] {
        let mut seen = Vec::new();
        for (what, dst, port) in frontends {
            if what == "ClusterIP" && client.name() != "client" {
                continue;
            }
            let tally = cl.tcp_repeat(client, dst, port, 4).expect("probe");
            let pods = answering_pods(&env, what, &tally);
            assert_eq!(
                pods.len(),
                1,
                "affinity through the {what} from {name}: {pods:?}{}",
                env.diag()
            );
            seen.push((what, pods[0].clone()));
        }
        if mode != Mode::Ipvs {
            assert!(
                seen.iter().all(|(_, pod)| *pod == seen[0].1),
                "one endpoint per client across the service port's addresses, from {name}: \
                 {seen:?}{}",
                env.diag()
            );
        }
    }

    // The timeout: the relay's metrics and /debug/explain name the pin while it lives, and it
    // goes after the timeout unused (the kernel modes' pins are kernel state).
    let brief = cl
        .tcp_repeat(cl.client(), ip("10.96.0.31"), 80, 3)
        .expect("probe");
    let pods = answering_pods(&env, "affinity with a 2 s timeout", &brief);
    assert_eq!(pods.len(), 1, "{pods:?}{}", env.diag());
    if mode == Mode::Userspace {
        let pinned = format!("{}:8080", env.pod(&pods[0]).ip());
        let series = format!(
            "kube_proxy_rs_userspace_affinity_clients{{service_port=\"default/brief:tcp/tcp\",endpoint=\"{pinned}\"}} 1"
        );
        let sticky_series =
            "kube_proxy_rs_userspace_affinity_clients{service_port=\"default/sticky:tcp/tcp\"";
        let metrics = env.metrics();
        assert!(
            metrics.contains(&series) && metrics.contains(sticky_series),
            "{series} and {sticky_series} in:\n{metrics}"
        );
        let explained = http_get_path(
            cl,
            cl.node(),
            env.metrics_address(),
            &format!(
                "/debug/explain?dest=10.96.0.31:80&from={}",
                cl.client().ip()
            ),
        );
        assert!(
            explained.body.contains(&format!("pinned to {pinned}")),
            "the pin in /debug/explain: {}",
            explained.body
        );
        // Unused for longer than the timeout: no live pin left.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while env.metrics().contains(&series) {
            assert!(
                std::time::Instant::now() < deadline,
                "the pin outlived its 2 s timeout{}",
                env.diag()
            );
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }

    // The node's own connections to an eTP Local service with only a remote endpoint: any
    // ready endpoint (the remote one), through the externalIP, the LB IP and the NodePort,
    // while outside clients are still dropped there. ipvs mode: the external virtual
    // servers fall back to the remote endpoint for everyone (see `external`), so the node's
    // flows are answered there too.
    for (what, dst, port) in [
        ("externalIP", ip("192.168.50.132"), 80),
        ("LB IP", ip("198.51.100.32"), 80),
        ("NodePort", node_ip, 30092),
    ] {
        let tally = cl.tcp_repeat(cl.node(), dst, port, 3).expect("probe");
        let pods = answering_pods(&env, &format!("eTP Local {what} from the node"), &tally);
        assert_eq!(pods, ["c"], "{what} from the node{}", env.diag());
    }
    let tally = cl
        .tcp_repeat(cl.external_in(), ip("192.168.50.132"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "eTP Local externalIP without local endpoints, from outside",
        &tally,
        &Outcome::TimedOut,
    );

    // A VIP on the node: reachable from the node when a node IP is inside the ranges,
    // dropped when none is; outside clients are held to the ranges as ever.
    let tally = cl
        .tcp_repeat(cl.node(), ip("198.51.100.33"), 80, SPREAD_FLOWS)
        .expect("probe");
    let pods = answering_pods(&env, "VIP on the node, node inside the ranges", &tally);
    assert_eq!(pods, ["a", "b", "c"], "{}", env.diag());
    let tally = cl
        .tcp_repeat(cl.node(), ip("198.51.100.34"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "VIP on the node, node outside the ranges",
        &tally,
        &Outcome::TimedOut,
    );
    let tally = cl
        .tcp_repeat(cl.external_in(), ip("198.51.100.33"), 80, 2)
        .expect("probe");
    assert_all(
        &env,
        "VIP from a client outside the ranges",
        &tally,
        &Outcome::TimedOut,
    );

    // The pinned endpoint goes away: the client's next connections are balanced among the
    // others at once, not sent to the removed address until the timeout (iptables and
    // nftables modes; ipvs keeps its own persistence, the relay its own pins).
    if mode.is_nftables() || mode.is_iptables() {
        let cl = &env.cluster;
        let tally = cl
            .tcp_repeat(cl.client(), ip("10.96.0.30"), 80, 2)
            .expect("probe");
        let pinned = answering_pods(&env, "pinned before the removal", &tally);
        assert_eq!(pinned.len(), 1, "{pinned:?}{}", env.diag());
        let rest: Vec<&str> = ["a", "b", "c"]
            .into_iter()
            .filter(|p| *p != pinned[0])
            .collect();
        let without = services[0].clone().endpoints(&env.cluster, &rest);
        env.apply(&without);
        let cl = &env.cluster;
        let tally = cl
            .tcp_repeat(cl.client(), ip("10.96.0.30"), 80, 4)
            .expect("probe");
        let now = answering_pods(&env, "after the pinned endpoint went", &tally);
        assert!(
            now.len() == 1 && rest.contains(&now[0].as_str()),
            "pinned anew to one of {rest:?}: {now:?}{}",
            env.diag()
        );
    }
}

/// The link-local node shape: the node's only address is 169.254.100.2/30 (scope global or
/// link), no default route, its pods on `/32` routes behind veths without an address. Pods
/// reach a ClusterIP (TCP and UDP) with local and remote endpoints. The kernel modes keep the
/// pod's address; userspace mode's relay connects from the node's address (the one the
/// capture DNATs to: REDIRECT would pick the address of the pod's veth, which has none).
pub fn link_local_node(mode: Mode) {
    for scope in [LinkLocalScope::Global, LinkLocalScope::Link] {
        let c = Cluster::builder()
            .pod("a")
            .pod("b")
            .remote_pod("c")
            .link_local_node(scope)
            .build()
            .expect("link-local test cluster builds");
        let services = [Service::new("web", "10.96.0.40")
            .tcp(80)
            .udp(80)
            .endpoints(&c, &["a", "b", "c"])];
        let env = Env::start(mode, c, CLUSTER_CIDR_V4, &services);
        let cl = &env.cluster;
        let client = cl.client();
        let tcp = cl
            .tcp_repeat(client, ip("10.96.0.40"), 80, SPREAD_FLOWS)
            .expect("probe");
        let udp = cl
            .udp_repeat(client, ip("10.96.0.40"), 80, SPREAD_FLOWS)
            .expect("probe");
        for (what, tally) in [("TCP", &tcp), ("UDP", &udp)] {
            let what = format!("ClusterIP {what} from a pod, link-local node ({scope:?})");
            let pods = answering_pods(&env, &what, tally);
            assert_eq!(pods, ["a", "b", "c"], "{what}{}", env.diag());
            let expected = match mode {
                Mode::Userspace => cl.node_ip(),
                Mode::Iptables
                | Mode::IptablesRestore
                | Mode::NftablesChains
                | Mode::Nftables
                | Mode::Ipvs => client.ip(),
            };
            assert_eq!(
                tally.seen_source_ips().into_iter().collect::<BTreeSet<_>>(),
                BTreeSet::from([expected]),
                "{what}: the source the endpoints saw{}",
                env.diag()
            );
        }
    }
}

// --- nodePortAddresses on a real-shaped node ---------------------------------------------

/// One `nodePortAddresses` form and where NodePorts (and, for IPv4, health-check node ports)
/// must answer on the real-shaped node; every other candidate address must refuse.
struct NodePortForm {
    /// What the check is called in messages.
    what: &'static str,
    /// The `--nodeport-addresses` flag, `None` for the mode's default.
    flag: Option<String>,
    /// The answering addresses (link-local ones are probed from the node itself).
    answer: Vec<IpAddr>,
}

/// Every address of the real-shaped node that could take NodePorts: the node IPs, the
/// secondary addresses, the second NIC's, the VIPs on `lo`, NodeLocal DNSCache's link-local
/// address.
fn node_port_candidates() -> Vec<IpAddr> {
    use kp_testbed::addresses::{
        LINK_LOCAL_SERVICE_V4, NODE_LO_VIP_V4, NODE_LO_VIP_V6, NODE_NIC2_V4, NODE_NIC2_V6,
        NODE_SECONDARY_V4, NODE_SECONDARY_V6, NODE_V4, NODE_V6,
    };
    vec![
        IpAddr::V4(NODE_V4),
        IpAddr::V4(NODE_SECONDARY_V4),
        IpAddr::V4(NODE_NIC2_V4),
        IpAddr::V4(NODE_LO_VIP_V4),
        IpAddr::V4(LINK_LOCAL_SERVICE_V4),
        IpAddr::V6(NODE_V6),
        IpAddr::V6(NODE_SECONDARY_V6),
        IpAddr::V6(NODE_NIC2_V6),
        IpAddr::V6(NODE_LO_VIP_V6),
    ]
}

/// Each `nodePortAddresses` form on the real-shaped node (dual-stack), one proxy run each
/// over the rules of the previous one: the mode's default (every local address in the
/// iptables, userspace and ipvs modes; `primary` in nftables mode), `primary` (the Node's
/// InternalIP of each family, not the secondary, second-NIC, VIP or link-local addresses),
/// a CIDR list (the LAN's addresses, primary and secondary), and a CIDR list that matches
/// only the second NIC (IPv4 there only; IPv6, which the list does not name, unrestricted,
/// as upstream). Health-check node ports answer on the same IPv4 addresses.
pub fn node_port_address_forms(mode: Mode) {
    use kp_testbed::addresses::{
        LAN_CIDR_V4, LAN_CIDR_V6, NIC2_CIDR_V4, NODE_NIC2_V4, NODE_SECONDARY_V4, NODE_SECONDARY_V6,
        NODE_V4, NODE_V6,
    };
    let c = cluster(true);
    let services = [
        Service::new("np", "10.96.0.95")
            .tcp(80)
            .node_port(30095)
            .endpoints(&c, &["a", "b", "c"]),
        Service::new("np6", "fd00:10:96::95")
            .tcp(80)
            .node_port(30096)
            .endpoints(&c, &["a", "b", "c"]),
        // Health-check node ports exist for LoadBalancer Services with eTP Local only.
        Service::new("hc", "10.96.0.96")
            .tcp(80)
            .node_port(30097)
            .load_balancer("198.51.100.95")
            .etp_local(32095)
            .endpoints(&c, &["a"]),
    ];
    let all = node_port_candidates();
    let primary = vec![IpAddr::V4(NODE_V4), IpAddr::V6(NODE_V6)];
    let forms = [
        NodePortForm {
            what: "default nodePortAddresses",
            flag: None,
            answer: if mode.is_nftables() {
                primary.clone()
            } else {
                all.clone()
            },
        },
        NodePortForm {
            what: "nodePortAddresses primary",
            flag: Some("primary".to_owned()),
            answer: primary,
        },
        NodePortForm {
            what: "nodePortAddresses: the LAN's CIDRs",
            flag: Some(format!("{LAN_CIDR_V4},{LAN_CIDR_V6}")),
            answer: vec![
                IpAddr::V4(NODE_V4),
                IpAddr::V4(NODE_SECONDARY_V4),
                IpAddr::V6(NODE_V6),
                IpAddr::V6(NODE_SECONDARY_V6),
            ],
        },
        NodePortForm {
            what: "nodePortAddresses: the second NIC's IPv4 CIDR only",
            flag: Some(NIC2_CIDR_V4.to_owned()),
            answer: std::iter::once(IpAddr::V4(NODE_NIC2_V4))
                .chain(all.iter().copied().filter(IpAddr::is_ipv6))
                .collect(),
        },
    ];
    let flags_of = |form: &NodePortForm| {
        let flags = Flags::cluster_cidr(CLUSTER_CIDR_DUAL);
        match &form.flag {
            Some(value) => flags.flag(&format!("--nodeport-addresses={value}")),
            None => flags,
        }
    };
    let mut env = Env::start_with(mode, c, flags_of(&forms[0]), &services, &[]);
    for (index, form) in forms.iter().enumerate() {
        if index > 0 {
            env.restart_with(flags_of(form));
        }
        check_node_port_form(&env, form, &all);
    }
}

/// Probes every candidate address for the NodePorts and (IPv4) the health-check node port.
fn check_node_port_form(env: &Env, form: &NodePortForm, all: &[IpAddr]) {
    let cl = &env.cluster;
    let what = form.what;
    for &address in all {
        // The link-local address is only reachable from the node itself.
        let from = if matches!(address, IpAddr::V4(v4) if v4.is_link_local()) {
            cl.node()
        } else {
            cl.external_in()
        };
        let port = if address.is_ipv6() { 30096 } else { 30095 };
        let answers = form.answer.contains(&address);
        let tally = cl.tcp_repeat(from, address, port, 3).expect("probe");
        if answers {
            assert!(
                tally.all_answered(),
                "{what}: NodePort on {address} must answer: {:?}{}",
                tally.outcomes(),
                env.diag()
            );
        } else {
            assert_all(
                env,
                &format!("{what}: NodePort on {address} must not answer"),
                &tally,
                &Outcome::Refused,
            );
        }
        if address.is_ipv4() {
            let health = SocketAddr::new(address, 32095);
            if answers {
                let response = http_get(cl, from, health);
                assert_eq!(
                    response.status,
                    200,
                    "{what}: health check on {health}: {response:?}{}",
                    env.diag()
                );
            } else {
                let outcome = cl.tcp(from, address, 32095).expect("probe");
                assert_eq!(
                    outcome,
                    Outcome::Refused,
                    "{what}: nothing may listen for health checks on {health}{}",
                    env.diag()
                );
            }
        }
    }
}
