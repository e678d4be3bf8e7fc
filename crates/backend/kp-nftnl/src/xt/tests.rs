//! Info structs against what the kernel dumped (`NFT_MSG_GETRULE`) for rules that
//! `iptables-nft-restore` 1.8.9 made in a scratch network namespace: the struct's length
//! and its non-zero bytes.

use std::net::IpAddr;

use super::*;

/// A zeroed struct of `len` bytes with `bytes` at their offsets.
fn sparse(len: usize, bytes: &[(usize, &[u8])]) -> Vec<u8> {
    let mut out = vec![0; len];
    for (at, value) in bytes {
        out[*at..*at + value.len()].copy_from_slice(value);
    }
    out
}

fn check(got: (&'static str, u32, Vec<u8>), name: &str, rev: u32, want: Vec<u8>) {
    assert_eq!(got.0, name);
    assert_eq!(got.1, rev, "{name} revision");
    assert_eq!(got.2.len(), want.len(), "{name} length");
    assert_eq!(got.2, want, "{name} bytes");
}

#[test]
fn comment_is_a_256_byte_buffer() {
    let got = comment("block incoming localnet connections").expect("fits");
    check(
        got,
        "comment",
        0,
        sparse(256, &[(0, b"block incoming localnet connections")]),
    );
    assert!(comment(&"x".repeat(255)).is_some());
    assert!(comment(&"x".repeat(256)).is_none(), "no room for the NUL");
    assert!(comment("a\0b").is_none());
}

#[test]
fn conntrack_states_as_iptables_sends_them() {
    // -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT
    check(
        conntrack_state(
            ctstate::RELATED | ctstate::ESTABLISHED | ctstate::DNAT,
            true,
        ),
        "conntrack",
        3,
        sparse(168, &[(146, &[1]), (148, &[1]), (150, &[0x86])]),
    );
    // --ctstate INVALID, NEW, RELATED,ESTABLISHED
    for (states, byte) in [
        (ctstate::INVALID, 0x01),
        (ctstate::NEW, 0x08),
        (ctstate::RELATED | ctstate::ESTABLISHED, 0x06),
    ] {
        check(
            conntrack_state(states, false),
            "conntrack",
            3,
            sparse(168, &[(146, &[1]), (150, &[byte])]),
        );
    }
}

#[test]
fn addrtype_local() {
    check(
        addrtype(0, ADDRTYPE_LOCAL),
        "addrtype",
        1,
        sparse(8, &[(2, &[4])]),
    );
    check(
        addrtype(ADDRTYPE_LOCAL, 0),
        "addrtype",
        1,
        sparse(8, &[(0, &[4])]),
    );
}

#[test]
fn recent_check_and_set() {
    let ones = [0xffu8; 16];
    check(
        recent(
            "KUBE-SEP-A",
            RecentOp::Check {
                seconds: 10800,
                reap: true,
            },
        )
        .expect("fits"),
        "recent",
        1,
        sparse(
            232,
            &[
                (0, &[0x30, 0x2a]),
                (8, &[0x21]),
                (10, b"KUBE-SEP-A"),
                (212, &ones),
            ],
        ),
    );
    check(
        recent("KUBE-SEP-A", RecentOp::Set).expect("fits"),
        "recent",
        1,
        sparse(232, &[(8, &[0x02]), (10, b"KUBE-SEP-A"), (212, &ones)]),
    );
    assert!(recent(&"x".repeat(200), RecentOp::Set).is_none());
}

#[test]
fn statistic_random_probability() {
    // --probability 0.3333333333
    let p = probability_fixed(0.333_333_333_3).expect("in range");
    assert_eq!(p, 0x2aaa_aaab);
    let bytes = [0xab, 0xaa, 0xaa, 0x2a];
    check(
        statistic_random(p),
        "statistic",
        0,
        sparse(24, &[(4, &bytes), (12, &bytes)]),
    );
    assert_eq!(probability_fixed(1.5), None);
}

#[test]
fn ports_and_protocol_matches() {
    let any = sparse(16, &[(2, &[0xff, 0xff]), (6, &[0xff, 0xff])]);
    check(any_port(PROTO_TCP).expect("tcp"), "tcp", 0, any.clone());
    check(any_port(PROTO_UDP).expect("udp"), "udp", 0, any);
    assert!(any_port(PROTO_SCTP).is_none());
    let slots: [(usize, &[u8]); 4] = [
        (268, &[0xff]),
        (271, &[0xff]),
        (274, &[0xff]),
        (277, &[0xff]),
    ];
    check(sctp(None), "sctp", 0, sparse(296, &slots));
    let mut with_port = vec![(0, &[0x35u8, 0, 0x35, 0][..]), (284, &[2][..])];
    with_port.extend(slots);
    check(sctp(Some(53)), "sctp", 0, sparse(296, &with_port));
}

#[test]
fn targets() {
    check(
        mark_target(0x4000, 0x4000),
        "MARK",
        2,
        sparse(8, &[(1, &[0x40]), (5, &[0x40])]),
    );
    check(
        mark_target(0x4000, 0),
        "MARK",
        2,
        sparse(8, &[(1, &[0x40])]),
    );
    check(
        masquerade(Family::Ipv4, true),
        "MASQUERADE",
        0,
        sparse(24, &[(0, &[1]), (4, &[0x10])]),
    );
    check(
        masquerade(Family::Ipv4, false),
        "MASQUERADE",
        0,
        sparse(24, &[(0, &[1])]),
    );
    check(
        masquerade(Family::Ipv6, true),
        "MASQUERADE",
        0,
        sparse(40, &[(0, &[0x10])]),
    );
    check(
        masquerade(Family::Ipv6, false),
        "MASQUERADE",
        0,
        sparse(40, &[]),
    );
    check(reject(Family::Ipv4), "REJECT", 0, sparse(8, &[(0, &[3])]));
    check(reject(Family::Ipv6), "REJECT", 0, sparse(8, &[(0, &[4])]));
    let v4: IpAddr = "10.180.0.2".parse().expect("address");
    let port = [0x1f, 0x90, 0x1f, 0x90];
    check(
        dnat(v4, 8080),
        "DNAT",
        2,
        sparse(
            48,
            &[
                (0, &[3]),
                (4, &[10, 180, 0, 2]),
                (20, &[10, 180, 0, 2]),
                (36, &port),
            ],
        ),
    );
    let v6: IpAddr = "fd00::1".parse().expect("address");
    check(
        dnat(v6, 8080),
        "DNAT",
        2,
        sparse(
            48,
            &[
                (0, &[3]),
                (4, &[0xfd]),
                (19, &[1]),
                (20, &[0xfd]),
                (35, &[1]),
                (36, &port),
            ],
        ),
    );
}

fn natives(rule: &XtRule) -> Vec<Expr> {
    rule.exprs
        .iter()
        .map(|e| match e {
            XtExpr::Native(expr) => expr.clone(),
            other => panic!("not native: {other:?}"),
        })
        .collect()
}

fn payload(offset: u32, len: u32) -> Expr {
    Expr::Payload {
        base: PAYLOAD_NETWORK,
        offset,
        len,
        dreg: REG_1,
    }
}

fn cmp(op: CmpOp, data: &[u8]) -> Expr {
    Expr::Cmp {
        sreg: REG_1,
        op,
        data: data.to_vec(),
    }
}

/// Address matches as `nft --debug=netlink` showed them for iptables-nft's rules.
#[test]
fn addresses_load_whole_bytes_or_mask() {
    let at = |source, addr: &str, prefix, invert| {
        let mut rule = XtRule::default();
        rule.address(source, addr.parse().expect("address"), prefix, invert)
            .expect("encodable");
        natives(&rule)
    };
    // -d 172.30.0.42 (/32)
    assert_eq!(
        at(false, "172.30.0.42", 32, false),
        vec![payload(16, 4), cmp(CmpOp::Eq, &[172, 30, 0, 42])]
    );
    // ! -s 127.0.0.0/8: one byte.
    assert_eq!(
        at(true, "127.0.0.0", 8, true),
        vec![payload(12, 1), cmp(CmpOp::Neq, &[127])]
    );
    // -d 10.16.0.0/12: the whole address through a mask.
    assert_eq!(
        at(false, "10.16.0.0", 12, false),
        vec![
            payload(16, 4),
            Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: vec![0xff, 0xf0, 0, 0],
                xor: vec![0; 4],
            },
            cmp(CmpOp::Eq, &[10, 16, 0, 0]),
        ]
    );
    // -s fd00:10::/64: eight bytes; ! -s fd00:10::/65 masked; -d fd00::42 sixteen.
    assert_eq!(
        at(true, "fd00:10::", 64, false),
        vec![
            payload(8, 8),
            cmp(CmpOp::Eq, &[0xfd, 0, 0, 0x10, 0, 0, 0, 0])
        ]
    );
    let mut mask = vec![0xff; 8];
    mask.push(0x80);
    mask.extend([0; 7]);
    let mut addr = vec![0xfd, 0, 0, 0x10];
    addr.extend([0; 12]);
    assert_eq!(
        at(true, "fd00:10::", 65, true),
        vec![
            payload(8, 16),
            Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask,
                xor: vec![0; 16],
            },
            cmp(CmpOp::Neq, &addr),
        ]
    );
    let mut daddr = vec![0xfd];
    daddr.extend([0; 14]);
    daddr.push(0x42);
    assert_eq!(
        at(false, "fd00::42", 128, false),
        vec![payload(24, 16), cmp(CmpOp::Eq, &daddr)]
    );
    // /0 adds nothing; inverted it is not encodable here.
    assert_eq!(at(true, "0.0.0.0", 0, false), vec![]);
    let mut rule = XtRule::default();
    assert!(
        rule.address(true, "0.0.0.0".parse().expect("address"), 0, true)
            .is_none()
    );
    assert!(
        rule.address(true, "10.0.0.0".parse().expect("address"), 33, false)
            .is_none()
    );
}

#[test]
fn interfaces_compare_with_or_without_the_nul() {
    let iface = |name: &str, invert| {
        let mut rule = XtRule::default();
        rule.in_interface(name, invert).expect("valid");
        natives(&rule)
    };
    let meta = Expr::Meta {
        key: META_IIFNAME,
        dreg: REG_1,
    };
    assert_eq!(
        iface("eth0+", false),
        vec![meta.clone(), cmp(CmpOp::Eq, b"eth0")]
    );
    assert_eq!(
        iface("abcdefghijklmno", true),
        vec![meta.clone(), cmp(CmpOp::Neq, b"abcdefghijklmno\0")]
    );
    assert_eq!(iface("br0", false), vec![meta, cmp(CmpOp::Eq, b"br0\0")]);
    let mut rule = XtRule::default();
    assert!(rule.in_interface("+", false).is_none());
    assert!(rule.in_interface("abcdefghijklmnop", false).is_none());
}

#[test]
fn protocol_sets_compat() {
    let mut rule = XtRule::default();
    rule.protocol(PROTO_UDP, false);
    rule.destination_port(53);
    assert_eq!(rule.compat, Some((PROTO_UDP, false)));
    assert_eq!(
        natives(&rule),
        vec![
            Expr::Meta {
                key: META_L4PROTO,
                dreg: REG_1
            },
            cmp(CmpOp::Eq, &[17]),
            Expr::Payload {
                base: PAYLOAD_TRANSPORT,
                offset: 2,
                len: 2,
                dreg: REG_1
            },
            cmp(CmpOp::Eq, &[0, 53]),
        ]
    );
}

#[test]
fn mark_is_native() {
    let mut rule = XtRule::default();
    rule.mark(0x4000, 0x4000, true);
    assert_eq!(
        natives(&rule),
        vec![
            Expr::Meta {
                key: META_MARK,
                dreg: REG_1
            },
            Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: 0x4000u32.to_ne_bytes().to_vec(),
                xor: vec![0; 4],
            },
            cmp(CmpOp::Neq, &0x4000u32.to_ne_bytes()),
        ]
    );
}
