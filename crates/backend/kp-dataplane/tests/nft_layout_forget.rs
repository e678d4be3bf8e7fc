//! Kernel test of forgetting ClientIP-affinity pins in the verdict-free layout
//! (`kp_nftnl::layout::forget_clients_of`): in a throwaway network namespace the layout's
//! sets, maps and rules of one affinity service port are written with `nft -f`, two clients
//! are pinned (one to an endpoint that then goes, one to an endpoint that stays) in both the
//! address and the port map, and the sweep over netlink must delete the first client from
//! both maps and keep the second. IPv4 and IPv6.
//!
//! Without root or `nft` the test is skipped with a message, unless `CI` or
//! `KP_REQUIRE_KERNEL_TESTS=1` is set, which makes that a failure.

use crate::nft_tools;

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_core::model::{IpFamily, Protocol, ServiceName, ServicePortName};
use kp_nftnl::NftSocket;
use kp_nftnl::codec::Family;
use kp_nftnl::layout::{Forget, forget_clients_of};
use kp_rules::config::{LocalDetector, NodePortAddresses};
use kp_rules::nftables::layout::fixed::{affinity_maps, class_part, fixed_part};
use kp_rules::nftables::layout::{AffinityPort, Class, FixedConfig};
use kp_testbed::isolated::{self, sh};
use nft_tools::{nft, unavailable};

fn port() -> AffinityPort {
    let name = ServicePortName {
        service: ServiceName {
            namespace: "ns".into(),
            name: "web".into(),
        },
        port: "".into(),
        protocol: Protocol::Tcp,
    };
    AffinityPort::new(&name, 600)
}

/// Pins two clients, sweeps the first one's endpoint, and checks what stays.
fn forget(family: IpFamily, clients: [&str; 2], endpoints: [&str; 2]) {
    let config = FixedConfig {
        family,
        mark: 0x4000,
        random_fully: false,
        detector: LocalDetector::None,
        node_port_addresses: NodePortAddresses::All,
        service_cidrs: Vec::new(),
        localhost_rejects: &[],
    };
    let mut script = fixed_part(&config, &Default::default());
    script.extend(class_part(&config, Class::Affinity(port())));
    sh(&format!("nft -f - <<'EOF'\n{}\nEOF", script.join("\n")));
    let ip = if family == IpFamily::V4 { "ip" } else { "ip6" };
    let [(_, addrs, ports), _] = affinity_maps(port());
    for (client, endpoint) in clients.iter().zip(endpoints) {
        nft(&[
            "add",
            "element",
            ip,
            "kube-proxy",
            &addrs,
            &format!("{{ {client} : {endpoint} }}"),
        ]);
        nft(&[
            "add",
            "element",
            ip,
            "kube-proxy",
            &ports,
            &format!("{{ {client} : 8080 }}"),
        ]);
    }
    let gone: IpAddr = endpoints[0].parse().expect("literal");
    let pins = [Forget {
        addresses: addrs.clone(),
        ports: ports.clone(),
        gone: BTreeSet::from([gone]),
    }];
    let nl_family = if family == IpFamily::V4 {
        Family::Ipv4
    } else {
        Family::Ipv6
    };
    let mut socket = NftSocket::open().expect("nf_tables socket");
    let deleted = forget_clients_of(&mut socket, nl_family, &pins).expect("sweep");
    assert_eq!(deleted, 1);
    for map in [&addrs, &ports] {
        let listed = nft(&["list", "map", ip, "kube-proxy", map]);
        assert!(
            !listed.contains(clients[0]),
            "{} forgotten in {map}:\n{listed}",
            clients[0]
        );
        assert!(
            listed.contains(clients[1]),
            "{} kept in {map}:\n{listed}",
            clients[1]
        );
    }
    // The ruleset still lists (nft 1.0.6 aborts on rules it cannot print).
    nft(&["list", "ruleset"]);
}

#[test]
fn pins_to_a_removed_endpoint_are_forgotten_from_both_maps_v4() {
    isolated::run(
        "pins_to_a_removed_endpoint_are_forgotten_from_both_maps_v4",
        unavailable,
        || {
            forget(
                IpFamily::V4,
                ["10.1.0.1", "10.1.0.2"],
                ["10.244.0.1", "10.244.0.2"],
            )
        },
    );
}

#[test]
fn pins_to_a_removed_endpoint_are_forgotten_from_both_maps_v6() {
    isolated::run(
        "pins_to_a_removed_endpoint_are_forgotten_from_both_maps_v6",
        unavailable,
        || {
            forget(
                IpFamily::V6,
                ["fd00:1::1", "fd00:1::2"],
                ["fd00:244::1", "fd00:244::2"],
            )
        },
    );
}
