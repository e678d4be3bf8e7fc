//! Snapshots of representative layouts, in upstream's test conventions (node 192.168.0.2,
//! pod CIDR 10.0.0.0/8, ClusterIPs 172.30.0.0/16, endpoints 10.180.x.y, mark 0x4000).
//! Each is also applied in a throwaway network namespace when that is possible.

use crate::common;

use common::*;
use kp_core::model::IpFamily;
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
    let state = fixtures::cluster_ip_two_endpoints();
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    assert!(out.text.contains("--probability 0.5000000000"));
    assert!(out.text.contains("KUBE-SVC-XPGD46QRK7WJZT7O"));
    assert!(out.text.contains("KUBE-SEP-SXIVWICOYRO3J4NJ"));
    check("cluster_ip_two_endpoints", &out, IpFamily::V4, &config);
}

#[test]
fn node_port_with_external_ip() {
    let state = fixtures::node_port();
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    check("node_port", &out, IpFamily::V4, &config);
}

#[test]
fn etp_local_load_balancer_with_source_ranges() {
    let state = fixtures::etp_local_lb_source_ranges();
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    check("etp_local_lb_source_ranges", &out, IpFamily::V4, &config);
}

#[test]
fn session_affinity_and_itp_local() {
    let state = fixtures::affinity_and_itp_local();
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    check("affinity_and_itp_local", &out, IpFamily::V4, &config);
}

#[test]
fn services_without_endpoints_reject_or_drop() {
    let state = fixtures::no_endpoints();
    let config = config();
    let out = full(&state, IpFamily::V4, &config);
    // No KUBE-SVC/SEP chains at all: nothing is usable on this node.
    assert!(!out.text.contains(":KUBE-SVC-"), "{}", out.text);
    assert!(!out.text.contains(":KUBE-SEP-"), "{}", out.text);
    check("no_endpoints", &out, IpFamily::V4, &config);
}

#[test]
fn ipv6_node_port_and_external_ip() {
    let state = fixtures::ipv6();
    let config = config();
    let out = full(&state, IpFamily::V6, &config);
    assert!(!out.text.contains("192.168.99.22"));
    assert!(!out.text.contains("10.180.0.1"));
    check("ipv6", &out, IpFamily::V6, &config);
}
