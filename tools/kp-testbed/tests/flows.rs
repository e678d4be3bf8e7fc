//! Real flows through a namespace cluster: what the harness classifies, and that it sees
//! rules installed in the node namespace the way a proxy mode would install them.

use std::net::{IpAddr, SocketAddr};

use kp_testbed::{
    Cluster, DEFAULT_ECHO_PORT, EchoSpec, Host, LinkLocalScope, Outcome, TestbedError,
};

/// A service VIP no route knows: only a DNAT rule in the node makes it answer.
const VIP: &str = "10.96.0.10";
const VIP_PORT: u16 = 80;
/// A pod port nothing listens on.
const CLOSED_PORT: u16 = 9999;

fn cluster() -> Cluster {
    Cluster::builder()
        .echo_binary(env!("CARGO_BIN_EXE_kp-echo"))
        .pod("a")
        .pod("b")
        .remote_pod("c")
        .build()
        .expect("test cluster builds (needs root and iproute2)")
}

fn vip() -> IpAddr {
    VIP.parse().expect("literal address")
}

/// The answer's (seen source, client, server), failing the test unless `pod` answered.
fn answer(outcome: &Outcome, pod: &str) -> (SocketAddr, SocketAddr, SocketAddr) {
    match outcome {
        Outcome::Answered {
            pod: who,
            seen_source,
            client,
            server,
        } if who == pod => (*seen_source, *client, *server),
        other => panic!("expected an answer from {pod}, got {other:?}"),
    }
}

fn iptables(cluster: &Cluster, ns: &str, rule: &str) -> Result<(), TestbedError> {
    let mut args = vec!["iptables"];
    args.extend(rule.split_whitespace());
    cluster.exec(ns, &args).map(drop)
}

fn dnat_vip_to(cluster: &Cluster, pod: &Host) -> Result<(), TestbedError> {
    let node = cluster.node_ns();
    let target = format!("{}:{DEFAULT_ECHO_PORT}", pod.ip());
    for chain in ["PREROUTING", "OUTPUT"] {
        iptables(
            cluster,
            node,
            &format!(
                "-t nat -A {chain} -d {VIP}/32 -p tcp --dport {VIP_PORT} -j DNAT --to-destination {target}"
            ),
        )?;
    }
    Ok(())
}

#[test]
fn pod_to_pod_flows_are_direct_and_not_masqueraded() -> Result<(), TestbedError> {
    let cluster = cluster();
    let client = cluster.client();
    for (pod, port) in [("a", DEFAULT_ECHO_PORT), ("c", DEFAULT_ECHO_PORT)] {
        let target = cluster.pod(pod)?;
        for outcome in [
            cluster.tcp(client, target.ip(), port)?,
            cluster.udp(client, target.ip(), port)?,
        ] {
            let (seen, own, server) = answer(&outcome, pod);
            assert_eq!(seen.ip(), client.ip(), "{outcome:?}");
            assert_eq!(own.ip(), client.ip(), "{outcome:?}");
            assert_eq!(server, SocketAddr::new(target.ip(), port));
            assert_eq!(outcome.masqueraded(), Some(false));
        }
    }
    let a6 = IpAddr::V6(cluster.pod("a")?.ipv6().expect("dual-stack by default"));
    let outcome = cluster.tcp(client, a6, DEFAULT_ECHO_PORT)?;
    let (seen, _, _) = answer(&outcome, "a");
    assert_eq!(seen.ip(), IpAddr::V6(client.ipv6().expect("dual-stack")));
    Ok(())
}

/// The link-local node shape: the node's only address is 169.254.100.2, it has no default
/// route and no address on its pods' veths, yet pods reach local and remote pods directly.
#[test]
fn link_local_node_routes_pods_without_addresses_on_their_veths() -> Result<(), TestbedError> {
    for scope in [LinkLocalScope::Global, LinkLocalScope::Link] {
        let cluster = Cluster::builder()
            .echo_binary(env!("CARGO_BIN_EXE_kp-echo"))
            .pod("a")
            .remote_pod("c")
            .link_local_node(scope)
            .build()?;
        let node = cluster.node_ns();
        let addresses = cluster.exec(node, &["ip", "-4", "-o", "addr", "show"])?;
        let mut own: Vec<&str> = addresses
            .lines()
            .filter_map(|l| l.split_whitespace().nth(3))
            .collect();
        own.sort_unstable();
        assert_eq!(own, ["127.0.0.1/8", "169.254.100.2/30"], "{addresses}");
        let routes = cluster.exec(node, &["ip", "-4", "route", "show"])?;
        assert!(!routes.contains("default"), "{routes}");
        assert_eq!(
            cluster.node_ip(),
            "169.254.100.2".parse::<IpAddr>().expect("literal")
        );
        let client = cluster.client();
        for pod in ["a", "c"] {
            let target = cluster.pod(pod)?;
            for outcome in [
                cluster.tcp(client, target.ip(), DEFAULT_ECHO_PORT)?,
                cluster.udp(client, target.ip(), DEFAULT_ECHO_PORT)?,
            ] {
                let (seen, _, _) = answer(&outcome, pod);
                assert_eq!(seen.ip(), client.ip(), "{scope:?}: {outcome:?}");
            }
        }
    }
    Ok(())
}

#[test]
fn closed_ports_refuse_and_dropped_flows_time_out() -> Result<(), TestbedError> {
    let cluster = cluster();
    let client = cluster.client();
    let a = cluster.pod("a")?;
    assert_eq!(cluster.tcp(client, a.ip(), CLOSED_PORT)?, Outcome::Refused);
    assert_eq!(cluster.udp(client, a.ip(), CLOSED_PORT)?, Outcome::Refused);
    assert_eq!(
        cluster
            .udp_repeat(client, a.ip(), CLOSED_PORT, 5)?
            .outcomes(),
        vec![Outcome::Refused; 5].as_slice(),
        "ICMP errors are not rate limited"
    );

    iptables(
        &cluster,
        a.ns(),
        &format!("-A INPUT -p tcp --dport {DEFAULT_ECHO_PORT} -j DROP"),
    )?;
    assert_eq!(
        cluster.tcp(client, a.ip(), DEFAULT_ECHO_PORT)?,
        Outcome::TimedOut
    );
    // Only pod a drops; the rest of the cluster is untouched.
    let b = cluster.pod("b")?;
    answer(&cluster.tcp(client, b.ip(), DEFAULT_ECHO_PORT)?, "b");

    cluster.stop_echo("b")?;
    assert_eq!(
        cluster.tcp(client, b.ip(), DEFAULT_ECHO_PORT)?,
        Outcome::Refused
    );
    cluster.start_echo(b, EchoSpec::new("b").tcp(DEFAULT_ECHO_PORT))?;
    answer(&cluster.tcp(client, b.ip(), DEFAULT_ECHO_PORT)?, "b");
    cluster.restart_echo("c")?;
    answer(
        &cluster.udp(client, cluster.pod("c")?.ip(), DEFAULT_ECHO_PORT)?,
        "c",
    );
    Ok(())
}

#[test]
fn node_dnat_rules_are_observed_like_a_proxy_mode() -> Result<(), TestbedError> {
    let cluster = cluster();
    let (client, a) = (cluster.client(), cluster.pod("a")?);
    assert_eq!(
        cluster.tcp(client, vip(), VIP_PORT)?,
        Outcome::TimedOut,
        "no rule yet"
    );

    dnat_vip_to(&cluster, a)?;
    let outcome = cluster.tcp(client, vip(), VIP_PORT)?;
    let (seen, _, server) = answer(&outcome, "a");
    assert_eq!(seen.ip(), client.ip());
    assert_eq!(server, SocketAddr::new(a.ip(), DEFAULT_ECHO_PORT));
    assert_eq!(outcome.masqueraded(), Some(false));
    // Locally originated traffic goes through OUTPUT.
    answer(&cluster.tcp(cluster.node(), vip(), VIP_PORT)?, "a");

    // Alternate between a and remote c deterministically, the way proxies split traffic
    // over endpoints: every 2nd new flow to a, the rest fall through to c.
    let node = cluster.node_ns();
    let c = cluster.pod("c")?;
    for (position, matcher, pod) in [
        (1, "-m statistic --mode nth --every 2 --packet 0", a),
        (2, "", c),
    ] {
        iptables(
            &cluster,
            node,
            &format!(
                "-t nat -I PREROUTING {position} -d {VIP}/32 -p udp --dport {VIP_PORT} {matcher} -j DNAT --to-destination {}:{DEFAULT_ECHO_PORT}",
                pod.ip()
            ),
        )?;
    }
    let tally = cluster.udp_repeat(client, vip(), VIP_PORT, 6)?;
    assert!(tally.all_answered(), "{tally:?}");
    assert_eq!((tally.count("a"), tally.count("c")), (3, 3), "{tally:?}");
    assert_eq!(tally.seen_source_ips(), vec![client.ip()]);
    Ok(())
}

#[test]
fn masquerade_rule_shows_as_masqueraded() -> Result<(), TestbedError> {
    let cluster = cluster();
    let (client, a) = (cluster.client(), cluster.pod("a")?);
    iptables(
        &cluster,
        cluster.node_ns(),
        &format!(
            "-t nat -A POSTROUTING -d {}/32 -p tcp -j MASQUERADE",
            a.ip()
        ),
    )?;
    let outcome = cluster.tcp(client, a.ip(), DEFAULT_ECHO_PORT)?;
    let (seen, own, _) = answer(&outcome, "a");
    assert_eq!(outcome.masqueraded(), Some(true));
    assert_eq!(own.ip(), client.ip());
    // The node's address on a's veth (the pod gateway).
    assert_eq!(seen.ip().to_string(), "10.244.1.1");
    // UDP was not masqueraded.
    assert_eq!(
        cluster
            .udp(client, a.ip(), DEFAULT_ECHO_PORT)?
            .masqueraded(),
        Some(false)
    );
    Ok(())
}

#[test]
fn external_clients_reach_the_node_and_source_ranges_can_be_told_apart() -> Result<(), TestbedError>
{
    let cluster = cluster();
    let (inside, outside, node) = (
        cluster.external_in(),
        cluster.external_out(),
        cluster.node(),
    );
    cluster.start_echo(node, EchoSpec::new("node").tcp(30080))?;
    let outcome = cluster.tcp(inside, cluster.node_ip(), 30080)?;
    let (seen, _, _) = answer(&outcome, "node");
    assert_eq!(seen.ip(), inside.ip(), "routed, not NATed");

    // A node port and a load balancer IP, both to pod a; a range check then drops outside.
    let a = cluster.pod("a")?;
    let lb: IpAddr = "198.51.100.10".parse().expect("literal address");
    for (dst, port) in [(cluster.node_ip(), 30081), (lb, 80)] {
        iptables(
            &cluster,
            node.ns(),
            &format!(
                "-t nat -A PREROUTING -d {dst}/32 -p tcp --dport {port} -j DNAT --to-destination {}:{DEFAULT_ECHO_PORT}",
                a.ip()
            ),
        )?;
        for from in [inside, outside] {
            let outcome = cluster.tcp(from, dst, port)?;
            assert_eq!(answer(&outcome, "a").0.ip(), from.ip(), "{outcome:?}");
        }
    }
    iptables(
        &cluster,
        node.ns(),
        &format!(
            "-A FORWARD -d {}/32 ! -s {} -j DROP",
            a.ip(),
            kp_testbed::addresses::EXTERNAL_IN_RANGE_V4
        ),
    )?;
    answer(&cluster.tcp(inside, lb, 80)?, "a");
    assert_eq!(cluster.tcp(outside, lb, 80)?, Outcome::TimedOut);
    Ok(())
}

#[test]
fn long_lived_connection_survives_an_unrelated_rule_change() -> Result<(), TestbedError> {
    let cluster = cluster();
    let (client, a) = (cluster.client(), cluster.pod("a")?);
    dnat_vip_to(&cluster, a)?;
    let mut session = cluster.connect(client, vip(), VIP_PORT)?;
    let (first_seen, _, _) = answer(session.greeting(), "a");
    answer(&session.send("one")?, "a");

    // Rewrite the whole nat table the way a proxy resync does, plus an unrelated rule.
    let node = cluster.node_ns();
    let nat = cluster.exec(node, &["iptables-save", "-t", "nat"])?;
    cluster.exec_with_input(node, &["iptables-restore"], Some(&nat))?;
    iptables(
        &cluster,
        node,
        "-t nat -A PREROUTING -d 10.96.0.11/32 -p tcp -j DNAT --to-destination 10.244.1.4:8080",
    )?;
    let (seen, _, _) = answer(&session.send("two")?, "a");
    assert_eq!(seen, first_seen, "same connection");

    // And the harness notices when the connection does break.
    cluster.stop_echo("a")?;
    assert_eq!(session.send("three")?, Outcome::Closed);
    Ok(())
}

#[test]
fn sctp_and_foreign_namespaces_are_clear_errors() {
    let cluster = cluster();
    let a = cluster.pod("a").expect("pod a exists").ip();
    assert!(matches!(
        cluster.sctp(cluster.client(), a, 8080),
        Err(TestbedError::SctpUnsupported)
    ));
    assert!(matches!(
        cluster.exec("not-ours", &["true"]),
        Err(TestbedError::UnknownNamespace { .. })
    ));
    assert!(matches!(
        cluster.pod("zz"),
        Err(TestbedError::UnknownPod { .. })
    ));
}

#[test]
fn a_real_shaped_node_has_its_addresses_and_routes() -> Result<(), TestbedError> {
    use kp_testbed::addresses::{
        LINK_LOCAL_DEVICE, LINK_LOCAL_SERVICE_V4, NIC2_DEVICE, NODE_LO_VIP_V4, NODE_LO_VIP_V6,
        NODE_NIC2_V4, NODE_NIC2_V6, NODE_SECONDARY_V4, NODE_SECONDARY_V6, NODE_V6,
    };
    let cluster = Cluster::builder()
        .echo_binary(env!("CARGO_BIN_EXE_kp-echo"))
        .pod("a")
        .real_node_shape(true)
        .build()?;
    assert!(cluster.real_node_shape());
    let node = cluster.node();
    let routes = cluster.exec(node.ns(), &["ip", "route", "show", "default"])?;
    assert!(routes.contains(&format!("dev {NIC2_DEVICE}")), "{routes}");
    let routes6 = cluster.exec(node.ns(), &["ip", "-6", "route", "show", "default"])?;
    assert!(routes6.contains(&format!("dev {NIC2_DEVICE}")), "{routes6}");
    let lo = cluster.exec(node.ns(), &["ip", "-o", "addr", "show", "dev", "lo"])?;
    assert!(lo.contains(&format!("{NODE_LO_VIP_V4}/32")), "{lo}");
    let dummy = cluster.exec(
        node.ns(),
        &["ip", "-o", "addr", "show", "dev", LINK_LOCAL_DEVICE],
    )?;
    assert!(
        dummy.contains(&format!("{LINK_LOCAL_SERVICE_V4}/32")),
        "{dummy}"
    );
    let eth0 = cluster.exec(node.ns(), &["ip", "-o", "addr", "show", "dev", "eth0"])?;
    assert!(
        eth0.lines()
            .any(|l| l.contains(&format!("{NODE_SECONDARY_V4}/24")) && l.contains("secondary")),
        "{eth0}"
    );

    // Every address but the link-local one answers an external client, and the node's
    // replies leave through the second NIC (the default route) without breaking the flow.
    cluster.start_echo(node, EchoSpec::new("node").tcp(30080))?;
    let from = cluster.external_in();
    for dst in [
        node.ip(),
        IpAddr::V4(NODE_SECONDARY_V4),
        IpAddr::V4(NODE_NIC2_V4),
        IpAddr::V4(NODE_LO_VIP_V4),
        IpAddr::V6(NODE_V6),
        IpAddr::V6(NODE_SECONDARY_V6),
        IpAddr::V6(NODE_NIC2_V6),
        IpAddr::V6(NODE_LO_VIP_V6),
    ] {
        let outcome = cluster.tcp(from, dst, 30080)?;
        let (seen, _, _) = answer(&outcome, "node");
        let client = if dst.is_ipv6() {
            IpAddr::V6(from.ipv6().expect("dual-stack"))
        } else {
            from.ip()
        };
        assert_eq!(seen.ip(), client, "{dst}: {outcome:?}");
    }
    // The link-local service address is the node's own.
    let own = cluster.tcp(node, IpAddr::V4(LINK_LOCAL_SERVICE_V4), 30080)?;
    answer(&own, "node");
    Ok(())
}
