//! Slot-count and affinity classes of the verdict-free layout written over netlink (`kp_nftnl::class`)
//! against the same classes written by `nft -f` (the partial sync's text path): on the same
//! fixed part, `nft list table` prints both tables the same, and connections to a service
//! the netlink-written class picks for reach its endpoints. Each test runs in a network
//! namespace of its own (`kp_testbed::isolated`).

use crate::nft_tools;

use std::collections::BTreeSet;
use std::net::{IpAddr, TcpListener, TcpStream};
use std::time::Duration;

use kp_core::model::{IpFamily, Protocol};
use kp_nftnl::NftSocket;
use kp_nftnl::class::push_class_changes;
use kp_nftnl::codec::Batch;
use kp_rules::config::{LocalDetector, NodePortAddresses};
use kp_rules::nftables::layout::class::class_objects;
use kp_rules::nftables::layout::{
    AffinityPort, AffinitySet, Changes, Class, Element, Entry, EntrySet, FixedConfig, PinList,
    Slots, change_script, fixed_part,
};
use kp_testbed::isolated::{self, sh};
use nft_tools::{nft, unavailable};

fn config() -> FixedConfig {
    FixedConfig {
        family: IpFamily::V4,
        mark: 0x4000,
        random_fully: false,
        detector: LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().expect("cidr")]),
        node_port_addresses: NodePortAddresses::All,
        service_cidrs: Vec::new(),
        localhost_rejects: &[],
    }
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("address")
}

/// A service port at 10.96.0.10:80 with two endpoints (10.0.0.1:8081, :8082), and the
/// classes of two slots (its policy's, and the short-circuit's, ready beside).
fn changes() -> Changes {
    let entry = Entry::Ip {
        addr: ip("10.96.0.10"),
        proto: Protocol::Tcp,
        port: 80,
    };
    let slot = |slot, port| Element::Slot {
        slots: Slots::Policy,
        count: 2,
        entry,
        slot,
        addr: ip("10.0.0.1"),
        port,
    };
    let mut changes = Changes::default();
    changes.classes = BTreeSet::from([
        Class::Count(Slots::Policy, 2),
        Class::Count(Slots::ShortCircuit, 2),
    ]);
    changes.add = vec![
        slot(0, 8081),
        slot(1, 8082),
        Element::Entry(EntrySet::Count(Slots::Policy, 2), entry),
    ];
    changes
}

fn apply_text(lines: &[String]) {
    sh(&format!("nft -f - <<'EOF'\n{}\nEOF", lines.join("\n")));
}

/// The fixed part by `nft -f`, then `changes` (its classes and elements) over netlink.
fn over_netlink(changes: &Changes) {
    apply_text(&fixed_part(&config(), &BTreeSet::new()));
    let mut objects = Vec::new();
    for class in &changes.classes {
        objects.extend(class_objects(&config(), *class).expect("a class netlink writes"));
    }
    let mut batch = Batch::new(1);
    push_class_changes(&mut batch, IpFamily::V4, &objects, changes).expect("lowered");
    let mut socket = NftSocket::open().expect("nf_tables socket");
    socket
        .apply_batch(batch)
        .expect("the kernel takes the class");
}

fn table() -> String {
    nft(&["list", "table", "ip", "kube-proxy"])
}

#[test]
fn a_class_over_netlink_lists_as_the_same_class_by_nft() {
    isolated::run(
        "a_class_over_netlink_lists_as_the_same_class_by_nft",
        unavailable,
        || {
            let changes = changes();
            over_netlink(&changes);
            let ours = table();
            nft(&["delete", "table", "ip", "kube-proxy"]);
            apply_text(&fixed_part(&config(), &BTreeSet::new()));
            apply_text(&change_script(&config(), &changes));
            let nfts = table();
            assert!(
                ours.contains("map endpoints-2-tcp {\n\t\ttypeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . tcp dport"),
                "{ours}"
            );
            assert_eq!(ours, nfts, "netlink's table, then nft's");
        },
    );
}

/// Which listener took the one connection queued.
fn answered(listeners: &[(u16, TcpListener)]) -> Option<u16> {
    std::thread::sleep(Duration::from_millis(20));
    listeners
        .iter()
        .find(|(_, l)| l.accept().is_ok())
        .map(|(port, _)| *port)
}

#[test]
fn connections_through_a_class_over_netlink_reach_both_endpoints() {
    isolated::run(
        "connections_through_a_class_over_netlink_reach_both_endpoints",
        unavailable,
        || {
            nft_tools::endpoint_on_lo();
            over_netlink(&changes());
            let listeners: Vec<(u16, TcpListener)> = [8081, 8082]
                .into_iter()
                .map(|port| {
                    let l = TcpListener::bind(("10.0.0.1", port)).expect("bind");
                    l.set_nonblocking(true).expect("nonblocking");
                    (port, l)
                })
                .collect();
            let mut seen = BTreeSet::new();
            // Each pick is numgen random mod 2: 24 connections miss an endpoint with
            // probability 2^-23.
            for _ in 0..24 {
                let stream = TcpStream::connect_timeout(
                    &"10.96.0.10:80".parse().expect("addr"),
                    Duration::from_secs(2),
                )
                .expect("the ClusterIP answers through the class");
                seen.extend(answered(&listeners));
                drop(stream);
            }
            assert_eq!(seen, BTreeSet::from([8081, 8082]), "both slots picked");
        },
    );
}

/// An affinity port's class (`ns/web` TCP, 60 s) and one ClusterIP entry of it.
fn affinity_changes() -> Changes {
    let name = kp_core::model::ServicePortName {
        service: kp_core::model::ServiceName {
            namespace: "ns".into(),
            name: "web".into(),
        },
        port: "".into(),
        protocol: Protocol::Tcp,
    };
    let port = AffinityPort::new(&name, 60);
    let entry = Entry::Ip {
        addr: ip("10.96.0.10"),
        proto: Protocol::Tcp,
        port: 80,
    };
    let mut changes = Changes::default();
    changes.classes = BTreeSet::from([Class::Affinity(port)]);
    changes.add = vec![
        Element::AffinityEntry(port, AffinitySet::Record, entry),
        Element::AffinityEntry(port, AffinitySet::Cluster, entry),
        Element::AffinityEndpoint(port, PinList::Cluster, ip("10.0.0.1"), 8081),
    ];
    changes
}

/// The table as the kernel holds it: nft's text and, per rule, the expressions and
/// registers it decoded (`--debug=netlink`).
fn table_with_expressions() -> String {
    nft(&["--debug=netlink", "list", "table", "ip", "kube-proxy"])
}

#[test]
fn an_affinity_class_over_netlink_is_what_nft_writes() {
    isolated::run(
        "an_affinity_class_over_netlink_is_what_nft_writes",
        unavailable,
        || {
            let changes = affinity_changes();
            over_netlink(&changes);
            let ours = table_with_expressions();
            nft(&["delete", "table", "ip", "kube-proxy"]);
            apply_text(&fixed_part(&config(), &BTreeSet::new()));
            apply_text(&change_script(&config(), &changes));
            let nfts = table_with_expressions();
            assert!(
                ours.contains("flags dynamic,timeout") && ours.contains("update @affinity-tcp-60-"),
                "{ours}"
            );
            assert_eq!(ours, nfts, "netlink's table, then nft's");
        },
    );
}
