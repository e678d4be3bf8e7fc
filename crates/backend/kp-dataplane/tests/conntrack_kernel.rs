//! ctnetlink deletion ([`NetlinkConntrack`]) against the real kernel's conntrack table, each
//! test in its own throwaway network namespace (`kp_testbed::isolated`), checked with conntrack-tools'
//! own view of the table (`conntrack -L`).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use kp_core::model::{IpFamily, Protocol};
use kp_dataplane::conntrack::{Conntrack, FlowEntry, FlowFilter, NetlinkConntrack};
use kp_testbed::isolated::{self, sh};

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal address")
}

/// One line per entry, the same for `conntrack -L` and for a dump:
/// `proto src dst sport dport | src dst sport dport`.
fn key(protocol: &str, fields: &[String]) -> String {
    format!(
        "{protocol} {} | {}",
        fields[..4].join(" "),
        fields[4..].join(" ")
    )
}

/// conntrack-tools' view of the table.
fn listed_by_tool() -> BTreeSet<String> {
    let text = sh("conntrack -L -f ipv4 2>/dev/null; conntrack -L -f ipv6 2>/dev/null");
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let mut words = line.split_whitespace();
            let protocol = words.next().expect("protocol name").to_owned();
            let fields: Vec<String> = words
                .filter_map(|w| w.split_once('='))
                .filter(|(k, _)| ["src", "dst", "sport", "dport"].contains(k))
                .map(|(_, v)| v.to_owned())
                .collect();
            assert_eq!(fields.len(), 8, "unexpected line: {line}");
            key(&protocol, &fields)
        })
        .collect()
}

fn entry_key(entry: &FlowEntry) -> String {
    let protocol = match entry.protocol {
        6 => "tcp",
        17 => "udp",
        132 => "sctp",
        other => panic!("unexpected protocol {other}"),
    };
    let port = |p: Option<u16>| p.map_or("-".to_owned(), |p| p.to_string());
    let fields = [
        entry.orig.src.to_string(),
        entry.orig.dst.to_string(),
        port(entry.orig.src_port),
        port(entry.orig.dst_port),
        entry.reply.src.to_string(),
        entry.reply.dst.to_string(),
        port(entry.reply.src_port),
        port(entry.reply.dst_port),
    ];
    key(protocol, &fields)
}

/// The netlink dump's view of the table.
fn listed_by_netlink() -> BTreeSet<String> {
    [IpFamily::V4, IpFamily::V6]
        .into_iter()
        .flat_map(|family| NetlinkConntrack::list(family).expect("dump"))
        .map(|entry| entry_key(&entry))
        .collect()
}

/// A conntrack entry inserted with `conntrack -I`, as DNAT would have made it.
struct Flow {
    name: &'static str,
    protocol: &'static str,
    client: (&'static str, u16),
    target: (&'static str, u16),
    endpoint: (&'static str, u16),
    /// A conntrack zone other than 0 (deleting needs the zone echoed back).
    zone: Option<u16>,
}

const FLOWS: &[Flow] = &[
    Flow {
        name: "svc-ep1",
        protocol: "udp",
        client: ("10.0.0.1", 1001),
        target: ("10.96.0.10", 53),
        endpoint: ("10.244.1.5", 5353),
        zone: None,
    },
    Flow {
        name: "svc-ep2",
        protocol: "udp",
        client: ("10.0.0.2", 1002),
        target: ("10.96.0.10", 53),
        endpoint: ("10.244.2.6", 5353),
        zone: None,
    },
    Flow {
        name: "other-svc",
        protocol: "udp",
        client: ("10.0.0.1", 1003),
        target: ("10.96.0.11", 53),
        endpoint: ("10.244.1.5", 5353),
        zone: None,
    },
    Flow {
        name: "svc-zone7",
        protocol: "udp",
        client: ("10.0.0.9", 1009),
        target: ("10.96.0.10", 53),
        endpoint: ("10.244.1.5", 5353),
        zone: Some(7),
    },
    Flow {
        name: "svc-tcp",
        protocol: "tcp",
        client: ("10.0.0.1", 1004),
        target: ("10.96.0.10", 53),
        endpoint: ("10.244.1.5", 5353),
        zone: None,
    },
    Flow {
        name: "svc-sctp",
        protocol: "sctp",
        client: ("10.0.0.1", 1005),
        target: ("10.96.0.10", 53),
        endpoint: ("10.244.1.5", 5353),
        zone: None,
    },
    Flow {
        name: "nodeport-ep1",
        protocol: "udp",
        client: ("10.0.0.3", 1006),
        target: ("192.168.0.2", 30053),
        endpoint: ("10.244.1.5", 5353),
        zone: None,
    },
    Flow {
        name: "nodeport-ep2",
        protocol: "udp",
        client: ("10.0.0.3", 1007),
        target: ("10.0.0.9", 30053),
        endpoint: ("10.244.2.6", 5353),
        zone: None,
    },
    Flow {
        name: "v6-svc",
        protocol: "udp",
        client: ("fd00::1", 1008),
        target: ("fd00:96::10", 53),
        endpoint: ("fd00:244::5", 5353),
        zone: None,
    },
    // Its client port is a NodePort number: a NodePort filter must not take it.
    Flow {
        name: "client-port-30053",
        protocol: "udp",
        client: ("10.0.0.4", 30053),
        target: ("10.96.0.12", 9999),
        endpoint: ("10.244.3.3", 9999),
        zone: None,
    },
];

fn insert(flow: &Flow) {
    let extra = match flow.protocol {
        "tcp" => " --state ESTABLISHED",
        "sctp" => " --state ESTABLISHED --orig-vtag 1 --reply-vtag 2",
        _ => "",
    }
    .to_owned();
    let extra = match flow.zone {
        Some(zone) => format!("{extra} --zone {zone}"),
        None => extra,
    };
    sh(&format!(
        "conntrack -I -p {} --src {} --dst {} --sport {} --dport {} \
         --reply-src {} --reply-dst {} --reply-port-src {} --reply-port-dst {} \
         --timeout 600{extra} 2>&1",
        flow.protocol,
        flow.client.0,
        flow.target.0,
        flow.client.1,
        flow.target.1,
        flow.endpoint.0,
        flow.client.0,
        flow.endpoint.1,
        flow.client.1,
    ));
}

fn flow_key(flow: &Flow) -> String {
    let fields = [
        flow.client.0,
        flow.target.0,
        &flow.client.1.to_string(),
        &flow.target.1.to_string(),
        flow.endpoint.0,
        flow.client.0,
        &flow.endpoint.1.to_string(),
        &flow.client.1.to_string(),
    ]
    .map(str::to_owned);
    key(flow.protocol, &fields)
}

fn filter(
    protocol: Protocol,
    orig_dst: Option<&str>,
    orig_dst_port: u16,
    reply: Option<(&str, u16)>,
) -> FlowFilter {
    let family = match orig_dst.or(reply.map(|r| r.0)) {
        Some(addr) if addr.contains(':') => IpFamily::V6,
        _ => IpFamily::V4,
    };
    FlowFilter {
        family,
        protocol,
        orig_dst: orig_dst.map(ip),
        orig_dst_port: Some(orig_dst_port),
        reply_src: reply.map(|r| ip(r.0)),
        reply_src_port: reply.map(|r| r.1),
    }
}

#[test]
fn netlink_deletes_exactly_what_each_filter_kind_selects() {
    isolated::run(
        "netlink_deletes_exactly_what_each_filter_kind_selects",
        || isolated::missing(&["conntrack"], &["true"]),
        || {
            use Protocol::{Sctp, Tcp, Udp};
            let cases: Vec<(&str, Vec<FlowFilter>, &[&str])> = vec![
                (
                    "every entry to a service IP:port (first endpoint)",
                    vec![filter(Udp, Some("10.96.0.10"), 53, None)],
                    &["svc-ep1", "svc-ep2", "svc-zone7"],
                ),
                (
                    "entries to a service DNATed to one endpoint",
                    vec![filter(
                        Udp,
                        Some("10.96.0.10"),
                        53,
                        Some(("10.244.2.6", 5353)),
                    )],
                    &["svc-ep2"],
                ),
                (
                    "every entry to a NodePort, any node address",
                    vec![filter(Udp, None, 30053, None)],
                    &["nodeport-ep1", "nodeport-ep2"],
                ),
                (
                    "entries to a NodePort DNATed to one endpoint",
                    vec![filter(Udp, None, 30053, Some(("10.244.1.5", 5353)))],
                    &["nodeport-ep1"],
                ),
                (
                    "SCTP only",
                    vec![filter(Sctp, Some("10.96.0.10"), 53, None)],
                    &["svc-sctp"],
                ),
                (
                    "TCP only",
                    vec![filter(
                        Tcp,
                        Some("10.96.0.10"),
                        53,
                        Some(("10.244.1.5", 5353)),
                    )],
                    &["svc-tcp"],
                ),
                (
                    "IPv6",
                    vec![filter(
                        Udp,
                        Some("fd00:96::10"),
                        53,
                        Some(("fd00:244::5", 5353)),
                    )],
                    &["v6-svc"],
                ),
                (
                    "several filters and both families in one pass",
                    vec![
                        filter(Udp, Some("10.96.0.11"), 53, None),
                        filter(Udp, Some("fd00:96::10"), 53, None),
                    ],
                    &["other-svc", "v6-svc"],
                ),
                (
                    "nothing matches",
                    vec![filter(Udp, Some("10.96.0.99"), 53, None)],
                    &[],
                ),
            ];
            for (what, filters, gone) in cases {
                sh("conntrack -F 2>/dev/null; conntrack -F -f ipv6 2>/dev/null; true");
                FLOWS.iter().for_each(insert);
                let all: BTreeSet<String> = FLOWS.iter().map(flow_key).collect();
                assert_eq!(listed_by_tool(), all, "{what}: the table as inserted");
                assert_eq!(
                    listed_by_netlink(),
                    all,
                    "{what}: the dump reads what the tool lists"
                );

                let deleted = NetlinkConntrack::delete_matching_blocking(&filters)
                    .unwrap_or_else(|err| panic!("{what}: {err}"));

                let expected: BTreeSet<String> = FLOWS
                    .iter()
                    .filter(|flow| !gone.contains(&flow.name))
                    .map(flow_key)
                    .collect();
                assert_eq!(listed_by_tool(), expected, "{what}");
                assert_eq!(deleted, gone.len(), "{what}: count");
            }
        },
    );
}

/// Real flows through the kernel's DNAT: UDP to two endpoints and a TCP connection, all to
/// the same service IP, then deleted through the `Conntrack` trait as the backends call it.
#[test]
fn netlink_deletes_real_dnat_flows() {
    isolated::run(
        "netlink_deletes_real_dnat_flows",
        || isolated::missing(&["conntrack", "iptables"], &["true"]),
        || {
            sh(
                "ip link set lo up && ip link add kpc0 type veth peer name kpc1 \
                && ip link set kpc0 up && ip link set kpc1 up \
                && ip addr add 10.244.1.5/32 dev kpc0 && ip addr add 10.244.1.6/32 dev kpc0 \
                && ip addr add 10.0.0.1/32 dev kpc0 \
                && ip route add 10.96.0.0/24 dev kpc0 src 10.0.0.1",
            );
            for (proto, sport, to) in [
                ("udp", "--sport 40001 --dport 53", "10.244.1.5:5353"),
                ("udp", "--sport 40002 --dport 53", "10.244.1.6:5353"),
                ("tcp", "--dport 80", "10.244.1.5:8080"),
            ] {
                sh(&format!(
                    "iptables -t nat -A OUTPUT -d 10.96.0.10 -p {proto} {sport} \
                     -j DNAT --to-destination {to}"
                ));
            }
            // A safety net against a hang, not an assertion on time.
            let patience = Some(Duration::from_secs(10));
            for (client, server) in [
                ("10.0.0.1:40001", "10.244.1.5:5353"),
                ("10.0.0.1:40002", "10.244.1.6:5353"),
            ] {
                let server = UdpSocket::bind(server).expect("bind server");
                server.set_read_timeout(patience).expect("timeout");
                let client = UdpSocket::bind(client).expect("bind client");
                client.set_read_timeout(patience).expect("timeout");
                client.send_to(b"ping", "10.96.0.10:53").expect("send");
                let mut buf = [0; 16];
                let (n, from) = server.recv_from(&mut buf).expect("DNATed to the endpoint");
                server.send_to(&buf[..n], from).expect("answer");
                let (_, answered_by) = client.recv_from(&mut buf).expect("answer arrives");
                assert_eq!(answered_by.to_string(), "10.96.0.10:53", "un-DNATed reply");
            }
            let listener = TcpListener::bind("10.244.1.5:8080").expect("listen");
            let mut tcp = TcpStream::connect("10.96.0.10:80").expect("connect through DNAT");
            let (mut accepted, _) = listener.accept().expect("accept");
            tcp.write_all(b"x").expect("write");
            let mut byte = [0; 1];
            accepted.read_exact(&mut byte).expect("read");

            let udp1 = "udp 10.0.0.1 10.96.0.10 40001 53 | 10.244.1.5 10.0.0.1 5353 40001";
            let udp2 = "udp 10.0.0.1 10.96.0.10 40002 53 | 10.244.1.6 10.0.0.1 5353 40002";
            let tcp_flow = "tcp 10.0.0.1 10.96.0.10 ";
            let table = listed_by_tool();
            assert!(table.contains(udp1) && table.contains(udp2), "{table:#?}");
            assert!(table.iter().any(|e| e.starts_with(tcp_flow)), "{table:#?}");
            assert_eq!(
                listed_by_netlink(),
                table,
                "the dump reads what the tool lists"
            );

            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            let conntrack = NetlinkConntrack::new();
            let delete =
                |filter: FlowFilter| runtime.block_on(conntrack.delete(&filter)).expect("delete");
            // The second endpoint goes away: only its flow goes.
            let n = delete(filter(
                Protocol::Udp,
                Some("10.96.0.10"),
                53,
                Some(("10.244.1.6", 5353)),
            ));
            let table = listed_by_tool();
            assert_eq!(n, 1);
            assert!(table.contains(udp1) && !table.contains(udp2), "{table:#?}");
            assert!(table.iter().any(|e| e.starts_with(tcp_flow)), "{table:#?}");
            // Every UDP entry to the service: the TCP connection's entry stays.
            let n = delete(filter(Protocol::Udp, Some("10.96.0.10"), 53, None));
            let table = listed_by_tool();
            assert_eq!(n, 1);
            assert!(!table.contains(udp1), "{table:#?}");
            assert!(table.iter().any(|e| e.starts_with(tcp_flow)), "{table:#?}");
            // And TCP by its endpoint.
            let n = delete(filter(
                Protocol::Tcp,
                Some("10.96.0.10"),
                80,
                Some(("10.244.1.5", 8080)),
            ));
            assert_eq!(n, 1);
            let table = listed_by_tool();
            assert!(!table.iter().any(|e| e.starts_with(tcp_flow)), "{table:#?}");
        },
    );
}
