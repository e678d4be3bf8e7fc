//! Configuration knobs and edge cases, checked on the rendered text.

use crate::common;

use common::*;
use kp_core::model::{IpFamily, Protocol};
use kp_rules::iptables::{
    LocalDetector, NodePortAddresses, RenderConfig, RenderError, Table, setup,
};

fn one_service() -> kp_core::tracker::ProxyState {
    let mut svc = cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80);
    svc.node_port = Some(3001);
    state(vec![(
        svc,
        vec![
            endpoint("10.180.0.1", 80, false),
            endpoint("10.180.0.2", 80, true),
        ],
    )])
}

/// The `KUBE-SERVICES` rules jumping to `KUBE-NODEPORTS` for an IPv6 NodePort service.
fn v6_nodeport_dispatch(config: &RenderConfig) -> Vec<String> {
    let mut v6_svc = cluster_ip("ns1", "svc1", "p80", "fd00:172:30::41", 80);
    v6_svc.node_port = Some(3001);
    let v6 = full(
        &state(vec![(v6_svc, vec![endpoint("fd00:10::1", 80, false)])]),
        IpFamily::V6,
        config,
    );
    lines_of(&v6.text, "KUBE-SERVICES")
        .into_iter()
        .filter(|l| l.ends_with("-j KUBE-NODEPORTS"))
        .map(str::to_owned)
        .collect()
}

fn lines_of<'t>(text: &'t str, chain: &str) -> Vec<&'t str> {
    let prefix = format!("-A {chain} ");
    text.lines().filter(|l| l.starts_with(&prefix)).collect()
}

#[test]
fn masquerade_bit_sets_every_mark() {
    let config = RenderConfig {
        masquerade_bit: 0,
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &config);
    assert!(out.text.contains("-j MARK --or-mark 0x1\n"));
    assert!(out.text.contains("-m mark ! --mark 0x1/0x1 -j RETURN"));
    assert!(out.text.contains("-j MARK --xor-mark 0x1\n"));
    assert!(out.text.contains("-m mark --mark 0x1/0x1 -j ACCEPT"));
    assert!(!out.text.contains("0x4000"));
}

#[test]
fn invalid_configs_are_errors_not_rules() {
    let bad_bit = RenderConfig {
        masquerade_bit: 32,
        ..config()
    };
    assert_eq!(bad_bit.validate(), Err(RenderError::MasqueradeBit(32)));
    let two_v4 = RenderConfig {
        local_detector: LocalDetector::Cidrs(vec![net("10.0.0.0/8"), net("11.0.0.0/8")]),
        ..config()
    };
    assert!(matches!(
        two_v4.validate(),
        Err(RenderError::DetectorCidrs {
            family: IpFamily::V4,
            count: 2
        })
    ));
    for name in ["", "eth0 -j ACCEPT", "a\"b", "sixteen-chars-xx", "br/0"] {
        let config = RenderConfig {
            local_detector: LocalDetector::BridgeInterface(name.into()),
            ..config()
        };
        assert_eq!(
            config.validate(),
            Err(RenderError::InterfaceName(name.into())),
            "{name:?}"
        );
    }
    let prefix_too_long = RenderConfig {
        local_detector: LocalDetector::InterfaceNamePrefix("fifteen-chars-x".into()),
        ..config()
    };
    assert!(prefix_too_long.validate().is_err());
    assert!(config().validate().is_ok());
}

#[test]
fn masquerade_all_marks_every_cluster_ip_packet() {
    let config = RenderConfig {
        masquerade_all: true,
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &config);
    assert!(
        out.text.contains(
            "--comment \"ns1/svc1:p80 cluster IP\" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-MARK-MASQ\n"
        ),
        "{}",
        out.text
    );
}

#[test]
fn without_a_detector_cluster_ip_traffic_is_not_masqueraded() {
    let config = RenderConfig {
        local_detector: LocalDetector::None,
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &config);
    let svc_rules: Vec<&str> = out
        .text
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SVC-") && l.contains("KUBE-MARK-MASQ"))
        .collect();
    assert!(svc_rules.is_empty(), "{svc_rules:?}");
}

#[test]
fn interface_detectors_match_on_input_interface() {
    let bridge = RenderConfig {
        local_detector: LocalDetector::BridgeInterface("cbr0".into()),
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &bridge);
    assert!(
        out.text.contains("! -i cbr0 -j KUBE-MARK-MASQ"),
        "{}",
        out.text
    );
    let prefix = RenderConfig {
        local_detector: LocalDetector::InterfaceNamePrefix("veth".into()),
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &prefix);
    assert!(
        out.text.contains("! -i veth+ -j KUBE-MARK-MASQ"),
        "{}",
        out.text
    );
}

#[test]
fn restricted_node_port_addresses_dispatch_per_ip() {
    let ips = vec![
        ip("192.168.0.2"),
        ip("127.0.0.1"),
        ip("2001:db8::1"),
        ip("::1"),
    ];
    let config = RenderConfig {
        node_port_addresses: NodePortAddresses::Ips(ips.clone()),
        ..config()
    };
    let v4 = full(&one_service(), IpFamily::V4, &config);
    let dispatch = lines_of(&v4.text, "KUBE-SERVICES");
    let to_nodeports: Vec<&&str> = dispatch
        .iter()
        .filter(|l| l.ends_with("-j KUBE-NODEPORTS"))
        .collect();
    assert_eq!(to_nodeports.len(), 2, "{to_nodeports:?}");
    assert!(to_nodeports[0].contains("-d 192.168.0.2 "));
    assert!(to_nodeports[1].contains("-d 127.0.0.1 "));

    // Without localhost NodePorts, and always on IPv6, loopback is skipped.
    let no_localhost = RenderConfig {
        localhost_node_ports: false,
        ..config.clone()
    };
    let v4 = full(&one_service(), IpFamily::V4, &no_localhost);
    assert!(!v4.text.contains("-d 127.0.0.1 "));
    let v6_dispatch = v6_nodeport_dispatch(&config);
    assert_eq!(v6_dispatch.len(), 1, "{v6_dispatch:?}");
    assert!(v6_dispatch[0].contains("-d 2001:db8::1 "));
}

#[test]
fn localhost_node_ports_off_excludes_loopback_and_kube_firewall() {
    let config = RenderConfig {
        localhost_node_ports: false,
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &config);
    assert!(
        out.text
            .contains("-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8 -j KUBE-NODEPORTS")
    );
    assert!(!out.text.contains("KUBE-FIREWALL"));
    assert!(
        !setup(IpFamily::V4, &config)
            .jumps
            .iter()
            .any(|j| j.to == "KUBE-FIREWALL")
    );
    assert!(setup(IpFamily::V4, &config).shared.is_empty());
    // On by default, IPv4 only: the localnet rule is appended to the kubelet's KUBE-FIREWALL
    // when missing, never written by the restore (which would flush the kubelet's rules).
    let on = full(&one_service(), IpFamily::V4, &common::config());
    assert!(!on.text.contains("KUBE-FIREWALL"));
    let shared = setup(IpFamily::V4, &common::config()).shared;
    assert_eq!(shared.len(), 1);
    assert_eq!(shared[0].chain, "KUBE-FIREWALL");
    assert_eq!(
        shared[0].spec,
        "-m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 \
         ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
    );
    assert!(setup(IpFamily::V6, &common::config()).shared.is_empty());
}

#[test]
fn invalid_drop_and_random_fully_are_optional() {
    let config = RenderConfig {
        drop_invalid: false,
        random_fully: false,
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &config);
    assert!(!out.text.contains("INVALID"));
    assert!(!out.text.contains("--random-fully"));
    assert!(out.text.contains("-j MASQUERADE\n"));
    let default = full(&one_service(), IpFamily::V4, &common::config());
    assert!(
        default
            .text
            .contains("-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n")
    );
    assert!(default.text.contains("-j MASQUERADE --random-fully\n"));
}

#[test]
fn large_cluster_mode_drops_endpoint_comments_only() {
    let config = RenderConfig {
        large_cluster_threshold: 1,
        ..config()
    };
    let out = full(&one_service(), IpFamily::V4, &config);
    assert!(out.large_cluster);
    for line in out.text.lines() {
        if line.starts_with("-A KUBE-SEP-")
            || (line.starts_with("-A KUBE-SVC-") && line.contains("-j KUBE-SEP-"))
        {
            assert!(!line.contains("--comment"), "{line}");
        }
    }
    // Dispatch rules keep theirs.
    assert!(out.text.contains("--comment \"ns1/svc1:p80 cluster IP\""));
    // At the threshold itself (2 endpoints, threshold 2) comments stay.
    let at = RenderConfig {
        large_cluster_threshold: 2,
        ..config
    };
    let out = full(&one_service(), IpFamily::V4, &at);
    assert!(!out.large_cluster);
    assert!(
        out.text
            .contains("--comment \"ns1/svc1:p80 -> 10.180.0.1:80\"")
    );
}

#[test]
fn affinity_timeout_is_clamped_to_the_api_range() {
    let svc = with_affinity(
        cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80),
        10_000_000,
    );
    let out = full(
        &state(vec![(svc, vec![endpoint("10.180.0.1", 80, false)])]),
        IpFamily::V4,
        &config(),
    );
    assert!(
        out.text.contains("--rcheck --seconds 86400 --reap"),
        "{}",
        out.text
    );
    let svc = with_affinity(cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80), 0);
    let out = full(
        &state(vec![(svc, vec![endpoint("10.180.0.1", 80, false)])]),
        IpFamily::V4,
        &config(),
    );
    assert!(
        out.text.contains("--rcheck --seconds 1 --reap"),
        "{}",
        out.text
    );
}

#[test]
fn duplicate_endpoints_get_one_chain() {
    let svc = cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80);
    let ep = endpoint("10.180.0.1", 80, false);
    let out = full(
        &state(vec![(svc, vec![ep.clone(), ep])]),
        IpFamily::V4,
        &config(),
    );
    assert_eq!(out.text.matches(":KUBE-SEP-").count(), 1, "{}", out.text);
    assert!(!out.text.contains("--probability"));
}

#[test]
fn services_without_an_ip_of_the_family_are_left_out() {
    let v6_only = cluster_ip("ns1", "svc1", "p80", "fd00:172:30::41", 80);
    let out = full(
        &state(vec![(v6_only, vec![endpoint("fd00:10::1", 80, false)])]),
        IpFamily::V4,
        &config(),
    );
    assert!(!out.text.contains("ns1/svc1"));
    assert!(out.chains.is_empty());
}

#[test]
fn sctp_and_udp_use_their_own_matches() {
    let mut sctp = cluster_ip("ns1", "svc1", "p", "172.30.0.41", 9999);
    sctp.name.protocol = Protocol::Sctp;
    let out = full(
        &state(vec![(sctp, vec![endpoint("10.180.0.1", 9999, false)])]),
        IpFamily::V4,
        &config(),
    );
    assert!(
        out.text
            .contains("-m sctp -p sctp -d 172.30.0.41 --dport 9999")
    );
    assert!(
        out.text
            .contains("-m sctp -p sctp -j DNAT --to-destination 10.180.0.1:9999")
    );
}

#[test]
fn terminating_endpoints_are_used_only_as_fallback() {
    let svc = cluster_ip("ns1", "svc1", "p80", "172.30.0.41", 80);
    let mut terminating = endpoint("10.180.0.1", 80, false);
    terminating.ready = false;
    terminating.terminating = true;
    let mut not_serving = endpoint("10.180.0.2", 80, false);
    not_serving.ready = false;
    not_serving.serving = false;
    let out = full(
        &state(vec![(
            svc.clone(),
            vec![terminating.clone(), not_serving.clone()],
        )]),
        IpFamily::V4,
        &config(),
    );
    assert!(
        out.text.contains("--to-destination 10.180.0.1:80"),
        "{}",
        out.text
    );
    assert!(!out.text.contains("10.180.0.2"), "{}", out.text);

    // Only unusable endpoints: REJECT, as with none.
    let out = full(
        &state(vec![(svc, vec![not_serving])]),
        IpFamily::V4,
        &config(),
    );
    assert!(
        out.text
            .contains("has no endpoints\" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j REJECT")
    );
}

#[test]
fn setup_lists_upstream_jumps_and_canaries() {
    let s = setup(IpFamily::V6, &config());
    let canaries = s
        .chains
        .iter()
        .filter(|(_, c)| *c == "KUBE-PROXY-CANARY")
        .map(|(t, _)| *t)
        .collect::<Vec<_>>();
    assert_eq!(canaries, vec![Table::Mangle, Table::Nat, Table::Filter]);
    // No KUBE-FIREWALL for IPv6.
    assert!(!s.jumps.iter().any(|j| j.to == "KUBE-FIREWALL"));
    let nat_prerouting = s
        .jumps
        .iter()
        .find(|j| j.table == Table::Nat && j.from == "PREROUTING")
        .expect("nat PREROUTING jump");
    assert_eq!(
        nat_prerouting.spec,
        "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
    );
    let filter_forward: Vec<&str> = s
        .jumps
        .iter()
        .filter(|j| j.table == Table::Filter && j.from == "FORWARD")
        .map(|j| j.to)
        .collect();
    assert_eq!(
        filter_forward,
        [
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-SERVICES",
            "KUBE-FORWARD",
            "KUBE-PROXY-FIREWALL"
        ]
    );
    // Every jump target is a chain to create.
    for jump in &s.jumps {
        assert!(s.chains.contains(&(jump.table, jump.to)), "{jump:?}");
    }
}

#[test]
fn an_unspecified_address_leaves_its_family_unrestricted() {
    // `primary` on an IPv4-only node: IPv4 on the node IP, IPv6 everywhere (upstream).
    let config = RenderConfig {
        node_port_addresses: NodePortAddresses::Ips(vec![ip("192.168.0.2"), ip("::")]),
        ..config()
    };
    let v4 = full(&one_service(), IpFamily::V4, &config);
    let v4_dispatch: Vec<&str> = lines_of(&v4.text, "KUBE-SERVICES")
        .into_iter()
        .filter(|l| l.ends_with("-j KUBE-NODEPORTS"))
        .collect();
    assert_eq!(v4_dispatch.len(), 1, "{v4_dispatch:?}");
    assert!(v4_dispatch[0].contains("-d 192.168.0.2 "));
    let v6_dispatch = v6_nodeport_dispatch(&config);
    assert_eq!(v6_dispatch.len(), 1, "{v6_dispatch:?}");
    assert!(
        v6_dispatch[0].contains("-m addrtype --dst-type LOCAL"),
        "{v6_dispatch:?}"
    );
}

#[test]
fn source_ranges_admit_the_node_by_its_node_ip_only() {
    // The Node lists two InternalIPs; upstream's node IP is the first one, or the one
    // detected at start-up (`node_ips`, e.g. from bindAddress).
    let mut lb = cluster_ip("ns1", "lb", "p80", "172.30.0.42", 80);
    lb.load_balancer_ips = vec![ip("1.2.3.4")];
    lb.load_balancer_source_ranges = vec![net("192.168.7.0/24")];
    let mut state = state(vec![(lb, vec![endpoint("10.180.0.1", 80, false)])]);
    state.node.addresses = vec![ip("192.168.0.2"), ip("192.168.7.9")];
    let allows_node = |config: &RenderConfig| {
        full(&state, IpFamily::V4, config)
            .text
            .lines()
            .any(|l| l.contains("-s 1.2.3.4 ") && l.contains("loadbalancer IP"))
    };
    assert!(!allows_node(&config()), "the first address is the node IP");
    let detected = RenderConfig {
        node_ips: vec![ip("192.168.7.9"), ip("::1")],
        ..config()
    };
    assert!(
        allows_node(&detected),
        "the detected node IP is in the range"
    );
    let loopback = RenderConfig {
        node_ips: vec![ip("127.0.0.1"), ip("::1")],
        ..config()
    };
    assert!(!allows_node(&loopback));
}
