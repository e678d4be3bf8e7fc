//! Snapshots of representative layouts, in upstream's test conventions (node 192.168.0.2,
//! pod CIDR 10.0.0.0/8, ClusterIPs 172.30.0.0/16, endpoints 10.180.x.y, mark 0x4000).
//! Each is also applied in a throwaway network namespace when that is possible.

mod common;

use common::*;
use kp_core::model::{IpFamily, Protocol};
use kp_rules::iptables::{RenderConfig, RenderOutput, setup};

/// The snapshot, plus the kernel's opinion of the same text.
fn check(name: &str, output: &RenderOutput, family: IpFamily, config: &RenderConfig) {
    insta::assert_snapshot!(name, output.text);
    let tool = restore_tool(family);
    if let Some(reason) = netns_unavailable(tool) {
        eprintln!("skipping kernel check of {name}: {reason}");
        return;
    }
    let setup = setup_text(&setup(family, config));
    if let Err(e) = apply_in_netns(tool, &[&setup, &output.text]) {
        panic!("{tool} rejected {name}:\n{e}\n{}", output.text);
    }
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
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    assert!(out.text.contains("--probability 0.5000000000"));
    assert!(out.text.contains("KUBE-SVC-XPGD46QRK7WJZT7O"));
    assert!(out.text.contains("KUBE-SEP-SXIVWICOYRO3J4NJ"));
    check("cluster_ip_two_endpoints", &out, IpFamily::V4, &config);
}

#[test]
fn node_port_with_external_ip() {
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
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    check("node_port", &out, IpFamily::V4, &config);
}

#[test]
fn etp_local_load_balancer_with_source_ranges() {
    let mut svc = cluster_ip("ns5", "svc5", "p80", "172.30.0.45", 80);
    svc.node_port = Some(3002);
    svc.load_balancer_ips = vec![ip("5.6.7.8")];
    // The second range contains the node IP, so the VIP-as-source rule appears.
    svc.load_balancer_source_ranges = vec![net("203.0.113.0/25"), net("192.168.0.0/24")];
    svc.external_policy_local = true;
    svc.health_check_node_port = Some(30000);
    let mut no_local = cluster_ip("ns6", "svc6", "p80", "172.30.0.46", 80);
    no_local.load_balancer_ips = vec![ip("9.10.11.12")];
    no_local.node_port = Some(3003);
    no_local.external_policy_local = true;
    let state = state(vec![
        (
            svc,
            vec![
                endpoint("10.180.0.5", 80, true),
                endpoint("10.180.1.5", 80, false),
            ],
        ),
        (no_local, vec![endpoint("10.180.0.6", 80, false)]),
    ]);
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    check("etp_local_lb_source_ranges", &out, IpFamily::V4, &config);
}

#[test]
fn session_affinity_and_itp_local() {
    let svc = with_affinity(cluster_ip("ns3", "svc3", "p80", "172.30.0.43", 80), 10800);
    let mut itp = cluster_ip("ns4", "svc4", "p80", "172.30.0.44", 80);
    itp.internal_policy_local = true;
    let state = state(vec![
        (
            svc,
            vec![
                endpoint("10.180.0.3", 80, false),
                endpoint("10.180.0.4", 80, false),
                endpoint("10.180.0.5", 80, false),
            ],
        ),
        (
            itp,
            vec![
                endpoint("10.180.0.7", 80, true),
                endpoint("10.180.1.7", 80, false),
            ],
        ),
    ]);
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    check("affinity_and_itp_local", &out, IpFamily::V4, &config);
}

#[test]
fn services_without_endpoints_reject_or_drop() {
    let mut lb = cluster_ip("ns7", "svc7", "p80", "172.30.0.47", 80);
    lb.node_port = Some(3007);
    lb.external_ips = vec![ip("192.168.99.33")];
    lb.load_balancer_ips = vec![ip("1.2.3.4")];
    lb.load_balancer_source_ranges = vec![net("203.0.113.0/25")];
    let mut itp = cluster_ip("ns8", "svc8", "", "172.30.0.48", 80);
    itp.internal_policy_local = true;
    let state = state(vec![
        (lb, vec![]),
        (itp, vec![endpoint("10.180.0.8", 80, false)]),
    ]);
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    // No KUBE-SVC/SEP chains at all: nothing is usable on this node.
    assert!(!out.text.contains(":KUBE-SVC-"), "{}", out.text);
    assert!(!out.text.contains(":KUBE-SEP-"), "{}", out.text);
    check("no_endpoints", &out, IpFamily::V4, &config);
}

#[test]
fn ipv6_node_port_and_external_ip() {
    let mut svc = cluster_ip("ns1", "svc1", "p80", "fd00:172:30::41", 80);
    svc.node_port = Some(3001);
    svc.external_ips = vec![ip("2600:5200::7"), ip("192.168.99.22")];
    svc.external_policy_local = true;
    let state = state(vec![(
        svc,
        vec![
            endpoint("fd00:10::1", 80, true),
            endpoint("fd00:10::2", 80, false),
            // Other-family endpoints are not this proxier's business.
            endpoint("10.180.0.1", 80, false),
        ],
    )]);
    let config = config();
    let out = full(&state, IpFamily::V6, &config);
    assert!(!out.text.contains("192.168.99.22"));
    assert!(!out.text.contains("10.180.0.1"));
    check("ipv6", &out, IpFamily::V6, &config);
}
