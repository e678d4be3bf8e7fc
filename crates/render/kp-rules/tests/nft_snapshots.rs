//! Snapshots of representative nftables transactions, in upstream's test conventions (node
//! 192.168.0.2, pod CIDR 10.0.0.0/8, ClusterIPs 172.30.0.0/16, endpoints 10.180.x.y, mark
//! 0x4000, NodePorts on 192.168.0.2 only). Each is also checked and applied by the real `nft`
//! in a throwaway network namespace when that is possible.

use crate::common;
use crate::nft_common;

use common::{cluster_ip, endpoint, ip, net, state, with_affinity};
use kp_core::model::{IpFamily, Protocol};
use kp_rules::nftables::{NftOutput, NodePortAddresses, RenderConfig};
use nft_common::*;

/// The snapshot, plus the kernel's opinion of the same script.
fn check(name: &str, output: &NftOutput, family: IpFamily) {
    insta::assert_snapshot!(name, output.script());
    check_structure(&output.script(), family);
    if let Some(reason) = nft_unavailable() {
        eprintln!("skipping kernel check of {name}: {reason}");
        return;
    }
    if let Err(e) = apply_in_netns(family, &[&output.script()]) {
        panic!("nft rejected {name}:\n{e}\n{}", output.script());
    }
}

/// The lines of `script` that mention `needle`, for targeted assertions.
fn lines_with<'a>(script: &'a str, needle: &str) -> Vec<&'a str> {
    script.lines().filter(|l| l.contains(needle)).collect()
}

#[test]
fn cluster_ip_with_two_endpoints() {
    let state = state(vec![(
        cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80),
        vec![
            endpoint("10.180.0.1", 80, false),
            endpoint("10.180.0.2", 80, false),
        ],
    )]);
    let out = full(&state, IpFamily::V4, &nft_config());
    let script = &out.script();
    assert!(script.contains(
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 \
         ip saddr != 10.0.0.0/8 jump mark-for-masquerade\n"
    ));
    // Balancing without an anonymous map (see MAX_CASCADE_ENDPOINTS): 1/2, then the rest.
    assert!(script.contains(
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 2 0 goto \
         endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80\n\
         add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 goto \
         endpoint-"
    ));
    assert!(!script.contains("vmap {"));
    assert!(script.contains(
        "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto \
         service-ULMVA6XW-ns1/svc1/tcp/p80 }\n"
    ));
    assert!(script.contains("ip daddr { 172.30.0.0/16 } drop"));
    // nftables mode never drops conntrack-INVALID packets (upstream removed that rule).
    assert!(!script.contains("ct state invalid"));
    check("cluster_ip_two_endpoints", &out, IpFamily::V4);
}

#[test]
fn node_port_with_external_ip_and_udp() {
    let mut svc = cluster_ip("ns2", "svc2", "p80", "172.30.0.42", 80);
    svc.node_port = Some(3001);
    svc.external_ips = vec![ip("192.168.99.22")];
    let mut udp = cluster_ip("ns2", "dns", "dns", "172.30.0.43", 53);
    udp.name.protocol = Protocol::Udp;
    udp.node_port = Some(3053);
    let state = state(vec![
        (svc, vec![endpoint("10.180.0.2", 8080, false)]),
        (udp, vec![endpoint("10.180.0.3", 5353, true)]),
    ]);
    let out = full(&state, IpFamily::V4, &nft_config());
    let script = &out.script();
    assert!(script.contains("{ udp . 3053 : goto external-"));
    assert!(script.contains("{ 192.168.99.22 . tcp . 80 : goto external-"));
    assert!(script.contains("meta l4proto udp dnat to 10.180.0.3:5353"));
    assert!(script.contains("add element ip kube-proxy nodeport-ips { 192.168.0.2 }"));
    assert!(script.contains(
        "add rule ip kube-proxy services ip daddr @nodeport-ips meta l4proto . th dport vmap \
         @service-nodeports"
    ));
    check("node_port", &out, IpFamily::V4);

    // Unrestricted nodePortAddresses: every local address but loopback, and no set.
    let config = RenderConfig {
        node_port_addresses: NodePortAddresses::All,
        ..nft_config()
    };
    let all = full(&state, IpFamily::V4, &config);
    assert!(all.script().contains(
        "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta \
         l4proto . th dport vmap @service-nodeports"
    ));
    assert!(
        all.script()
            .contains("delete set ip kube-proxy nodeport-ips")
    );
    check("node_port_all_addresses", &all, IpFamily::V4);
}

#[test]
fn etp_local_load_balancer_with_source_ranges() {
    let mut svc = cluster_ip("ns2", "svc2", "p80", "172.30.0.42", 80);
    svc.node_port = Some(3001);
    svc.load_balancer_ips = vec![ip("1.2.3.4")];
    svc.external_ips = vec![ip("192.168.99.22")];
    svc.load_balancer_source_ranges = vec![net("203.0.113.0/25"), net("192.168.0.0/24")];
    svc.external_policy_local = true;
    svc.health_check_node_port = Some(30000);
    let mut remote_only = cluster_ip("ns3", "svc3", "p80", "172.30.0.43", 80);
    remote_only.load_balancer_ips = vec![ip("5.6.7.8")];
    remote_only.external_policy_local = true;
    let state = state(vec![
        (
            svc,
            vec![
                endpoint("10.180.0.2", 80, true),
                endpoint("10.180.1.2", 80, false),
            ],
        ),
        (remote_only, vec![endpoint("10.180.0.3", 80, false)]),
    ]);
    let out = full(&state, IpFamily::V4, &nft_config());
    let script = &out.script();
    // The node is inside a source range, so the LB IP itself is allowed as a source.
    assert!(script.contains("ip saddr != { 1.2.3.4, 192.168.0.0/24, 203.0.113.0/25 } drop"));
    assert!(script.contains("{ 1.2.3.4 . tcp . 80 comment \"ns2/svc2:p80\" : goto firewall-"));
    assert_eq!(
        lines_with(script, "external-42NFTM6N-ns2/svc2/tcp/p80 ")
            .iter()
            .filter(|l| l.starts_with("add rule"))
            .count(),
        4,
        "pod short-circuit, local masquerade, local short-circuit, local endpoints"
    );
    assert!(script.contains("goto local-42NFTM6N-ns2/svc2/tcp/p80\n"));
    // No local endpoint for svc3: external traffic from outside is dropped, but the node and
    // pods are still short-circuited to the remote endpoint.
    assert!(script.contains(
        "add element ip kube-proxy no-endpoint-services { 5.6.7.8 . tcp . 80 comment \
         \"ns3/svc3:p80\" : drop }"
    ));
    assert!(script.contains("{ 5.6.7.8 . tcp . 80 : goto external-4AT6LBPK-ns3/svc3/tcp/p80 }"));
    // The health-check node port gets no rule: nftables mode opens no firewall holes.
    assert!(!script.contains("30000"));
    check("etp_local_lb_source_ranges", &out, IpFamily::V4);
}

#[test]
fn session_affinity() {
    let mut svc = with_affinity(cluster_ip("ns5", "svc5", "p80", "172.30.0.45", 80), 10800);
    svc.node_port = Some(3002);
    let mut itp = with_affinity(cluster_ip("ns6", "svc6", "p80", "172.30.0.46", 80), 300);
    itp.internal_policy_local = true;
    let state = state(vec![
        (
            svc,
            vec![
                endpoint("10.180.0.3", 80, false),
                endpoint("10.180.0.4", 80, false),
            ],
        ),
        (
            itp,
            vec![
                endpoint("10.180.0.6", 80, true),
                endpoint("10.180.0.7", 80, false),
            ],
        ),
    ]);
    let out = full(&state, IpFamily::V4, &nft_config());
    let script = &out.script();
    assert!(script.contains(
        "add set ip kube-proxy affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { type \
         ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }"
    ));
    assert!(script.contains(
        "add rule ip kube-proxy service-HVFWP5L3-ns5/svc5/tcp/p80 ip saddr \
         @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 goto \
         endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80\n"
    ));
    assert!(script.contains(
        "add rule ip kube-proxy endpoint-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 update \
         @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 { ip saddr }\n"
    ));
    // iTP Local: only the local endpoint has a chain (and a set).
    assert_eq!(
        lines_with(script, "add set ip kube-proxy affinity-").len(),
        3
    );
    assert!(script.contains("timeout 300s"));
    check("affinity", &out, IpFamily::V4);
}

#[test]
fn no_endpoints() {
    let mut reject = cluster_ip("ns6", "svc6", "p80", "172.30.0.46", 80);
    reject.node_port = Some(3006);
    reject.load_balancer_ips = vec![ip("9.10.11.12")];
    reject.load_balancer_source_ranges = vec![net("203.0.113.0/25")];
    let mut itp = cluster_ip("ns7", "svc7", "p80", "172.30.0.47", 80);
    itp.internal_policy_local = true;
    let state = state(vec![
        (reject, vec![]),
        (itp, vec![endpoint("10.180.0.7", 80, false)]),
    ]);
    let out = full(&state, IpFamily::V4, &nft_config());
    let script = &out.script();
    assert!(script.contains(
        "add element ip kube-proxy no-endpoint-services { 172.30.0.46 . tcp . 80 comment \
         \"ns6/svc6:p80\" : goto reject-chain }"
    ));
    assert!(script.contains(
        "add element ip kube-proxy no-endpoint-nodeports { tcp . 3006 comment \"ns6/svc6:p80\" \
         : goto reject-chain }"
    ));
    // iTP Local without a local endpoint: dropped, not rejected, and no chains at all.
    assert!(script.contains("{ 172.30.0.47 . tcp . 80 comment \"ns7/svc7:p80\" : drop }"));
    assert!(!script.contains("service-") || !script.contains("ns7/svc7/tcp/p80 "));
    // The source-range filter applies even without endpoints, as upstream.
    assert!(script.contains("add element ip kube-proxy firewall-ips { 9.10.11.12 . tcp . 80"));
    check("no_endpoints", &out, IpFamily::V4);
}

#[test]
fn ipv6() {
    let mut svc = cluster_ip("testing", "service", "http", "fd00:10:96::41", 80);
    svc.node_port = Some(3001);
    svc.external_ips = vec![ip("2001:db8:99::11")];
    svc.load_balancer_ips = vec![ip("2001:db8:ffff::1"), ip("5.6.7.8")];
    svc.load_balancer_source_ranges = vec![net("2600:5200::/32"), net("203.0.113.0/25")];
    let mut udp = with_affinity(
        cluster_ip("testing", "dns", "dns", "fd00:10:96::53", 53),
        60,
    );
    udp.name.protocol = Protocol::Sctp;
    let state = state(vec![
        (
            svc,
            vec![
                endpoint("fd00:10::a1b2:c3d4:e5f6:9999", 8080, false),
                endpoint("10.180.0.1", 8080, false),
            ],
        ),
        (udp, vec![endpoint("fd00:10::53", 53, true)]),
    ]);
    let out = full(&state, IpFamily::V6, &nft_config());
    let script = &out.script();
    assert!(script.starts_with("add table ip6 kube-proxy"));
    assert!(script.contains("dnat to [fd00:10::a1b2:c3d4:e5f6:9999]:8080"));
    assert!(script.contains("__fd00.10..a1b2.c3d4.e5f6.9999/8080"));
    assert!(script.contains("ip6 saddr != { 2600:5200::/32 } drop"));
    assert!(script.contains("add element ip6 kube-proxy nodeport-ips { 2001:db8::1 }"));
    assert!(script.contains("type ipv6_addr ; flags dynamic,timeout ; timeout 60s ;"));
    // Nothing of the other family.
    assert!(!script.contains("10.180.0.1"));
    assert!(!script.contains("5.6.7.8"));
    check("ipv6", &out, IpFamily::V6);
}

#[test]
fn masquerade_all_and_interface_detectors() {
    let state = state(vec![(
        cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80),
        vec![endpoint("10.180.0.1", 80, false)],
    )]);
    let all = RenderConfig {
        masquerade_all: true,
        random_fully: false,
        ..nft_config()
    };
    let out = full(&state, IpFamily::V4, &all);
    assert!(out.script().contains(
        "service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 jump mark-for-masquerade\n"
    ));
    assert!(out.script().contains("masquerading masquerade\n"));
    check_structure(&out.script(), IpFamily::V4);

    let prefix = RenderConfig {
        local_detector: kp_rules::nftables::LocalDetector::InterfaceNamePrefix("veth".into()),
        ..nft_config()
    };
    let out = full(&state, IpFamily::V4, &prefix);
    assert!(
        out.script()
            .contains("ip daddr 172.30.0.41 iifname != \"veth*\" jump")
    );
    check("interface_prefix_detector", &out, IpFamily::V4);
}

/// Small services balance with a cascade of `numgen random mod k` rules (1/n, then 1/(n-1)
/// of the rest, ...: uniform), large ones with upstream's single anonymous vmap.
#[test]
fn balancing_cascade_and_large_services() {
    let addresses = |count: usize| -> Vec<String> {
        (0..count)
            .map(|i| format!("10.180.{}.{}", i / 200, 1 + i % 200))
            .collect()
    };
    let small = addresses(3);
    let large = addresses(40);
    let state = state(vec![
        (
            cluster_ip("ns1", "small", "p80", "172.30.0.41", 80),
            small.iter().map(|a| endpoint(a, 80, false)).collect(),
        ),
        (
            cluster_ip("ns1", "large", "p80", "172.30.0.42", 80),
            large.iter().map(|a| endpoint(a, 80, false)).collect(),
        ),
    ]);
    let out = full(&state, IpFamily::V4, &nft_config());
    let script = out.script();
    let small_rules: Vec<&str> = lines_with(&script, "add rule ip kube-proxy service-")
        .into_iter()
        .filter(|l| l.contains("/small/") && !l.contains("mark-for-masquerade"))
        .collect();
    assert_eq!(small_rules.len(), 3, "{small_rules:#?}");
    assert!(small_rules[0].contains(" numgen random mod 3 0 goto endpoint-"));
    assert!(small_rules[0].ends_with("__10.180.0.1/80"));
    assert!(small_rules[1].contains(" numgen random mod 2 0 goto endpoint-"));
    assert!(small_rules[1].ends_with("__10.180.0.2/80"));
    assert!(small_rules[2].contains("/small/tcp/p80 goto endpoint-"));
    assert!(small_rules[2].ends_with("__10.180.0.3/80"));

    let large_rules: Vec<&str> = lines_with(&script, "numgen random mod 40 vmap {");
    assert_eq!(large_rules.len(), 1);
    assert!(large_rules[0].contains("/large/tcp/p80 numgen random mod 40 vmap { 0 : goto "));
    assert!(large_rules[0].contains(" , 39 : goto endpoint-"));
    assert!(lines_with(&out.script(), "numgen random mod 39 0").is_empty());

    check_structure(&out.script(), IpFamily::V4);
    if let Some(reason) = nft_unavailable() {
        eprintln!("skipping kernel check: {reason}");
        return;
    }
    let listing = apply_in_netns(IpFamily::V4, &[&out.script()])
        .unwrap_or_else(|e| panic!("nft rejected the script: {e}"));
    assert!(
        listing.contains("numgen random mod 3 0 goto endpoint-"),
        "{listing}"
    );
}

/// KEP-6032 in the chain layout: with the gate on, every NodePort of a rejected protocol is an
/// element of its own `proto . port` set, looked up by one counted reject rule per protocol
/// in `filter-input` (a TCP reset for TCP); a served family keeps TCP out (its counter is
/// deleted); the gate off leaves no rule (the other snapshots).
#[test]
fn localhost_rejects() {
    let mut tcp = cluster_ip("ns", "web", "http", "172.30.0.51", 80);
    tcp.node_port = Some(30080);
    let mut udp = cluster_ip("ns", "dns", "dns", "172.30.0.53", 53);
    udp.name.protocol = Protocol::Udp;
    udp.node_port = Some(30053);
    let state = state(vec![
        (tcp, vec![endpoint("10.180.0.1", 8080, false)]),
        (udp, vec![]),
    ]);
    let config = |served: Vec<IpFamily>| RenderConfig {
        nftables_localhost_rejects: kp_rules::nftables::LocalhostNodePortRejects {
            enabled: true,
            served,
        },
        ..nft_config()
    };
    let unserved = full(&state, IpFamily::V4, &config(Vec::new()));
    let script = &unserved.script();
    assert_eq!(
        lines_with(script, "@nodeport-localhost-reject"),
        [
            "add rule ip kube-proxy filter-input ip daddr 127.0.0.0/8 meta l4proto tcp meta l4proto . th dport @nodeport-localhost-reject counter name localhost-nodeport-rejected-tcp reject with tcp reset",
            "add rule ip kube-proxy filter-input ip daddr 127.0.0.0/8 meta l4proto udp meta l4proto . th dport @nodeport-localhost-reject counter name localhost-nodeport-rejected-udp reject",
            "add rule ip kube-proxy filter-input ip daddr 127.0.0.0/8 meta l4proto sctp meta l4proto . th dport @nodeport-localhost-reject counter name localhost-nodeport-rejected-sctp reject",
        ]
    );
    // Whatever the endpoints: the UDP Service has none.
    assert_eq!(
        lines_with(
            script,
            "add element ip kube-proxy nodeport-localhost-reject"
        ),
        [
            "add element ip kube-proxy nodeport-localhost-reject { tcp . 30080 }",
            "add element ip kube-proxy nodeport-localhost-reject { udp . 30053 }",
        ]
    );
    assert!(!script.contains("delete counter"), "{script}");
    check("localhost_rejects", &unserved, IpFamily::V4);

    let served = full(&state, IpFamily::V4, &config(vec![IpFamily::V4]));
    let script = &served.script();
    assert_eq!(
        lines_with(script, "delete counter"),
        ["delete counter ip kube-proxy localhost-nodeport-rejected-tcp"]
    );
    assert!(
        !script.contains("nodeport-localhost-reject { tcp"),
        "{script}"
    );
    assert!(script.contains("add element ip kube-proxy nodeport-localhost-reject { udp . 30053 }"));
    let v6 = full(&state, IpFamily::V6, &config(Vec::new()));
    assert!(
        v6.script()
            .contains("filter-input ip6 daddr ::1 meta l4proto udp meta l4proto . th dport @nodeport-localhost-reject")
    );
}
