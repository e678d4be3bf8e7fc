//! Golden bytes for the IPVS generic netlink codec. Expected messages are written out by hand
//! from the kernel's `linux/ip_vs.h` layout (little-endian host; ports in network order;
//! 4-byte attribute alignment), so they check the encoding independently of the code.

use std::net::IpAddr;

use kp_ipvs::codec::{self, Attr, DestAttr, IpvsMessage, Reply, ServiceAttr};
use kp_ipvs::{
    FLAG_PERSISTENT, FLAG_SCHED_MH_PORT, Forward, Protocol, RealServer, Scheduler, ServiceKey,
    Timeouts, VirtualServer,
};
use netlink_packet_generic::GenlMessage;

const FAMILY: u16 = 0x24;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

fn dns() -> ServiceKey {
    ServiceKey {
        address: ip("10.96.0.10"),
        protocol: Protocol::Udp,
        port: 53,
    }
}

/// nlmsghdr (len, type, flags, seq, pid) + genlmsghdr (cmd, version, reserved).
fn headers(len: u32, flags: u16, seq: u32, cmd: u8) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend(len.to_le_bytes());
    v.extend(FAMILY.to_le_bytes());
    v.extend(flags.to_le_bytes());
    v.extend(seq.to_le_bytes());
    v.extend(0u32.to_le_bytes());
    v.extend([cmd, 1, 0, 0]);
    v
}

/// The four attributes that identify 10.96.0.10:53/UDP: 44 bytes.
const DNS_ID: [u8; 44] = [
    6, 0, 1, 0, 2, 0, 0, 0, // AF = AF_INET (2), padded
    6, 0, 2, 0, 17, 0, 0, 0, // PROTOCOL = 17 (UDP), padded
    20, 0, 3, 0, 10, 96, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // ADDR, 16 bytes
    6, 0, 4, 0, 0, 53, 0, 0, // PORT = 53 in network order, padded
];

#[test]
fn new_service_with_round_robin() {
    let vs = VirtualServer::new(dns(), Scheduler::Rr, None);
    let bytes = codec::encode(codec::new_service(&vs), FAMILY, 7);
    let mut expected = headers(104, 0x0005, 7, 1); // NLM_F_REQUEST | NLM_F_ACK; NEW_SERVICE
    expected.extend([84, 0, 1, 0]); // IPVS_CMD_ATTR_SERVICE, nested
    expected.extend(DNS_ID);
    expected.extend([7, 0, 6, 0, b'r', b'r', 0, 0]); // SCHED_NAME "rr\0", padded
    expected.extend([12, 0, 7, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]); // FLAGS 0, mask all
    expected.extend([8, 0, 8, 0, 0, 0, 0, 0]); // TIMEOUT 0
    expected.extend([8, 0, 9, 0, 0xff, 0xff, 0xff, 0xff]); // NETMASK /32
    assert_eq!(bytes, expected);
}

#[test]
fn persistent_service_for_session_affinity() {
    let key = ServiceKey {
        address: ip("2001:db8::10"),
        protocol: Protocol::Tcp,
        port: 443,
    };
    let vs = VirtualServer::new(key, Scheduler::Wlc, Some(10800));
    let bytes = codec::encode(codec::set_service(&vs), FAMILY, 9);
    let mut expected = headers(104, 0x0005, 9, 2); // SET_SERVICE
    expected.extend([84, 0, 1, 0]);
    expected.extend([6, 0, 1, 0, 10, 0, 0, 0]); // AF_INET6 = 10
    expected.extend([6, 0, 2, 0, 6, 0, 0, 0]); // TCP
    expected.extend([
        20, 0, 3, 0, 0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10,
    ]);
    expected.extend([6, 0, 4, 0, 0x01, 0xbb, 0, 0]); // 443
    expected.extend([8, 0, 6, 0, b'w', b'l', b'c', 0]);
    expected.extend([12, 0, 7, 0, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]); // PERSISTENT
    expected.extend([8, 0, 8, 0, 0x30, 0x2a, 0, 0]); // 10800 s
    expected.extend([8, 0, 9, 0, 128, 0, 0, 0]); // IPv6: prefix length 128
    assert_eq!(bytes, expected);
}

#[test]
fn every_scheduler_is_named_as_the_kernel_names_it() {
    let names: Vec<&str> = Scheduler::ALL.iter().map(|s| s.name()).collect();
    assert_eq!(
        names,
        [
            "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh"
        ]
    );
    for s in Scheduler::ALL {
        assert_eq!(s.name().parse::<Scheduler>(), Ok(s));
        let vs = VirtualServer::new(dns(), s, None);
        let msg = codec::new_service(&vs);
        let Attr::Service(attrs) = &msg.attrs[0] else {
            panic!("service attribute first")
        };
        assert!(attrs.contains(&ServiceAttr::SchedName(s.name().into())));
    }
    assert_eq!("".parse::<Scheduler>(), Ok(Scheduler::Rr));
    assert!("fancy".parse::<Scheduler>().is_err());
    // Maglev hashes the source port too (upstream's mh-port); the others set no flag.
    assert_eq!(
        VirtualServer::new(dns(), Scheduler::Mh, None).flags,
        FLAG_SCHED_MH_PORT
    );
    assert_eq!(
        VirtualServer::new(dns(), Scheduler::Mh, Some(60)).flags,
        FLAG_SCHED_MH_PORT | FLAG_PERSISTENT
    );
}

#[test]
fn delete_service_sends_only_its_identity() {
    let bytes = codec::encode(codec::del_service(&dns()), FAMILY, 3);
    let mut expected = headers(68, 0x0005, 3, 3);
    expected.extend([48, 0, 1, 0]);
    expected.extend(DNS_ID);
    assert_eq!(bytes, expected);
}

#[test]
fn list_services_is_a_dump() {
    let bytes = codec::encode(codec::get_services(), FAMILY, 4);
    // NLM_F_REQUEST | NLM_F_DUMP (ROOT | MATCH = 0x300); no attributes.
    assert_eq!(bytes, headers(20, 0x0301, 4, 4));
}

#[test]
fn new_masquerading_destination() {
    let rs = RealServer::new(ip("10.244.1.5"), 5353, 1);
    let bytes = codec::encode(codec::new_dest(&dns(), &rs), FAMILY, 11);
    let mut expected = headers(140, 0x0005, 11, 5); // NEW_DEST
    expected.extend([48, 0, 1, 0]);
    expected.extend(DNS_ID);
    expected.extend([72, 0, 2, 0]); // IPVS_CMD_ATTR_DEST, nested: 4 + 68
    expected.extend([
        20, 0, 1, 0, 10, 244, 1, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    expected.extend([6, 0, 2, 0, 0x14, 0xe9, 0, 0]); // port 5353
    expected.extend([8, 0, 3, 0, 0, 0, 0, 0]); // FWD_METHOD = IP_VS_CONN_F_MASQ
    expected.extend([8, 0, 4, 0, 1, 0, 0, 0]); // WEIGHT 1
    expected.extend([8, 0, 5, 0, 0, 0, 0, 0]); // U_THRESH
    expected.extend([8, 0, 6, 0, 0, 0, 0, 0]); // L_THRESH
    expected.extend([6, 0, 11, 0, 2, 0, 0, 0]); // ADDR_FAMILY = AF_INET
    assert_eq!(bytes, expected);
}

#[test]
fn terminating_destination_gets_weight_zero_in_place() {
    let rs = RealServer::new(ip("10.244.1.5"), 5353, 0);
    let msg = codec::set_dest(&dns(), &rs);
    assert_eq!(msg.command, codec::cmd::SET_DEST);
    let Attr::Dest(attrs) = &msg.attrs[1] else {
        panic!("dest attribute second")
    };
    assert!(attrs.contains(&DestAttr::Weight(0)));
}

#[test]
fn delete_destination_sends_address_and_port() {
    let bytes = codec::encode(codec::del_dest(&dns(), ip("10.244.1.5"), 5353), FAMILY, 12);
    let mut expected = headers(100, 0x0005, 12, 7);
    expected.extend([48, 0, 1, 0]);
    expected.extend(DNS_ID);
    expected.extend([32, 0, 2, 0]);
    expected.extend([
        20, 0, 1, 0, 10, 244, 1, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    expected.extend([6, 0, 2, 0, 0x14, 0xe9, 0, 0]);
    assert_eq!(bytes, expected);
}

#[test]
fn timeouts_leave_zero_values_out() {
    let t = Timeouts {
        tcp: 900,
        tcp_fin: 0,
        udp: 300,
    };
    let bytes = codec::encode(codec::set_config(&t), FAMILY, 5);
    let mut expected = headers(36, 0x0005, 5, 12); // SET_CONFIG
    expected.extend([8, 0, 4, 0, 0x84, 0x03, 0, 0]); // TIMEOUT_TCP 900
    expected.extend([8, 0, 6, 0, 0x2c, 0x01, 0, 0]); // TIMEOUT_UDP 300
    assert_eq!(bytes, expected);
    assert_eq!(
        codec::encode(codec::get_config(), FAMILY, 6),
        headers(20, 0x0005, 6, 13)
    );
    assert_eq!(
        codec::encode(codec::flush(), FAMILY, 8),
        headers(20, 0x0005, 8, 17)
    );
}

#[test]
fn family_resolution_asks_the_controller_by_name() {
    let bytes = codec::encode_family_request(1);
    let mut expected = Vec::new();
    expected.extend(32u32.to_le_bytes());
    expected.extend(16u16.to_le_bytes()); // GENL_ID_CTRL
    expected.extend(5u16.to_le_bytes());
    expected.extend(1u32.to_le_bytes());
    expected.extend(0u32.to_le_bytes());
    expected.extend([3, 2, 0, 0]); // CTRL_CMD_GETFAMILY, controller version 2
    expected.extend([9, 0, 2, 0, b'I', b'P', b'V', b'S', 0, 0, 0, 0]); // FAMILY_NAME "IPVS\0"
    assert_eq!(bytes, expected);
}

/// A service as the kernel lists it: full entry plus HASHED flag and a statistics nest.
fn listed_service() -> Vec<u8> {
    let mut nest = Vec::new();
    nest.extend(DNS_ID);
    nest.extend([7, 0, 6, 0, b's', b'h', 0, 0]);
    nest.extend([12, 0, 7, 0, 3, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]); // PERSISTENT | HASHED
    nest.extend([8, 0, 8, 0, 60, 0, 0, 0]);
    nest.extend([8, 0, 9, 0, 0xff, 0xff, 0xff, 0xff]);
    nest.extend([12, 0, 10, 0, 8, 0, 1, 0, 42, 0, 0, 0]); // STATS { CONNS = 42 }
    let mut out = headers(0, 0x0002, 4, 4); // NLM_F_MULTI
    out.extend(u16::try_from(nest.len() + 4).expect("short").to_le_bytes());
    out.extend([1, 0]);
    out.extend(nest);
    let len = u32::try_from(out.len()).expect("short");
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// `NLMSG_DONE` for sequence 4.
fn done() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend(20u32.to_le_bytes());
    v.extend(3u16.to_le_bytes());
    v.extend(2u16.to_le_bytes());
    v.extend(4u32.to_le_bytes());
    v.extend(0u32.to_le_bytes());
    v.extend(0i32.to_le_bytes());
    v
}

#[test]
fn decodes_a_listed_service_and_the_end_of_the_dump() {
    let mut datagram = listed_service();
    datagram.extend(done());
    let replies = codec::decode::<GenlMessage<IpvsMessage>>(&datagram).expect("decodes");
    assert_eq!(replies.len(), 2);
    let (seq, Reply::Data(msg)) = &replies[0] else {
        panic!("data first: {replies:?}")
    };
    assert_eq!(*seq, 4);
    let vs = codec::service_of(&msg.payload)
        .expect("valid")
        .expect("kube-proxy's kind");
    assert_eq!(
        vs,
        VirtualServer {
            key: dns(),
            scheduler: "sh".into(),
            flags: FLAG_PERSISTENT, // HASHED is the kernel's bookkeeping, dropped
            timeout: 60,
        }
    );
    assert_eq!(replies[1], (4, Reply::Done));
}

#[test]
fn decodes_errors_and_acks() {
    let error = |code: i32| {
        let mut v = Vec::new();
        v.extend(36u32.to_le_bytes());
        v.extend(2u16.to_le_bytes()); // NLMSG_ERROR
        v.extend(0u16.to_le_bytes());
        v.extend(9u32.to_le_bytes());
        v.extend(0u32.to_le_bytes());
        v.extend(code.to_le_bytes());
        v.extend(headers(16, 5, 9, 1)[..16].iter()); // the request's header echoed
        v
    };
    let replies = codec::decode::<GenlMessage<IpvsMessage>>(&error(-17)).expect("decodes");
    assert_eq!(replies, vec![(9, Reply::Error(-17))]);
    let replies = codec::decode::<GenlMessage<IpvsMessage>>(&error(0)).expect("decodes");
    assert_eq!(replies, vec![(9, Reply::Ack)]);
}

#[test]
fn decodes_a_listed_destination_with_counters() {
    let msg = IpvsMessage {
        command: codec::cmd::NEW_DEST,
        attrs: vec![Attr::Dest(vec![
            DestAttr::Addr([0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5]),
            DestAttr::Port(8080),
            DestAttr::FwdMethod(0),
            DestAttr::Weight(0),
            DestAttr::ActiveConns(3),
            DestAttr::InactConns(1),
            DestAttr::AddrFamily(10),
        ])],
    };
    let listed = codec::dest_of(&msg, ip("2001:db8::10")).expect("valid");
    assert_eq!(listed.server.address, ip("2001:db8::5"));
    assert_eq!(listed.server.port, 8080);
    assert_eq!(listed.server.weight, 0);
    assert_eq!(listed.server.forward, Forward::Masquerade);
    assert_eq!(
        (listed.active_connections, listed.inactive_connections),
        (3, 1)
    );
    // Truncated replies are reported, not guessed.
    let broken = IpvsMessage {
        command: codec::cmd::NEW_DEST,
        attrs: vec![Attr::Dest(vec![DestAttr::Port(1)])],
    };
    assert!(codec::dest_of(&broken, ip("10.0.0.1")).is_err());
}

#[test]
fn firewall_mark_services_are_not_kube_proxys() {
    let msg = IpvsMessage {
        command: codec::cmd::NEW_SERVICE,
        attrs: vec![Attr::Service(vec![
            ServiceAttr::Af(2),
            ServiceAttr::Fwmark(0x4000),
            ServiceAttr::SchedName("rr".into()),
        ])],
    };
    assert_eq!(codec::service_of(&msg), Ok(None));
}
