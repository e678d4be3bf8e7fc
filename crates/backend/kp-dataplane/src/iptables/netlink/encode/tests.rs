//! The encoder's decisions (what goes where in a rule, and in the transaction); the bytes
//! of each piece are checked in `kp_nftnl::xt`'s tests, and the whole against
//! `iptables-nft-restore` in the kernel tests.

use std::net::SocketAddr;

use kp_core::model::{IpFamily, Protocol};
use kp_nftnl::expr::Verdict;
use kp_nftnl::xt::{self, XtRule};
use kp_rules::iptables::{
    AddrType, AddrTypeSide, Address, CtStates, MarkOp, Match, Probability, RecentAction,
    RejectWith, Rule, RuleSink, Table, Target,
};

use super::*;

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal")
}

/// The renderer writes `-m comment ... -m tcp -p tcp -d IP --dport P`; iptables puts the
/// protocol and address first, then the comment and port matches in `-m` order.
#[test]
fn ip_part_first_then_matches_in_order() {
    let rule = Rule::new("KUBE-SERVICES")
        .comment("ns2/dns:dns cluster IP")
        .with(Match::Protocol(Protocol::Udp))
        .with(Match::Destination {
            addr: Address::Ip(ip("172.30.0.43")),
            negated: false,
        })
        .with(Match::DestinationPort(53))
        .jump("KUBE-SVC-X");
    let mut want = XtRule::default();
    want.protocol(xt::PROTO_UDP, false);
    want.address(false, ip("172.30.0.43"), 32, false)
        .expect("encodable");
    want.xt_match(xt::comment("ns2/dns:dns cluster IP").expect("fits"));
    want.destination_port(53);
    want.verdict(Verdict::Jump("KUBE-SVC-X".into()));
    assert_eq!(encode_rule(IpFamily::V4, &rule), Ok(want));
}

#[test]
fn source_before_destination_and_interface_before_all() {
    let rule = Rule::new("KUBE-SVC-X")
        .with(Match::Protocol(Protocol::Tcp))
        .with(Match::Destination {
            addr: Address::Ip(ip("fd00::1")),
            negated: false,
        })
        .with(Match::DestinationPort(80))
        .with(Match::InInterface {
            name: "cali".into(),
            wildcard: true,
            negated: true,
        })
        .with(Match::Source {
            addr: Address::Net("fd00:10::/64".parse().expect("net")),
            negated: true,
        })
        .jump("KUBE-MARK-MASQ");
    let mut want = XtRule::default();
    want.in_interface("cali+", true).expect("valid");
    want.protocol(xt::PROTO_TCP, false);
    want.address(true, ip("fd00:10::"), 64, true)
        .expect("encodable");
    want.address(false, ip("fd00::1"), 128, false)
        .expect("encodable");
    want.destination_port(80);
    want.verdict(Verdict::Jump("KUBE-MARK-MASQ".into()));
    assert_eq!(encode_rule(IpFamily::V6, &rule), Ok(want));
}

#[test]
fn x_tables_matches_and_targets() {
    let sep = "KUBE-SEP-ABC";
    let rule = Rule::new(sep)
        .with(Match::Recent {
            name: sep.into(),
            action: RecentAction::Set,
        })
        .with(Match::Protocol(Protocol::Tcp))
        .target(Target::Dnat(SocketAddr::new(ip("10.1.2.3"), 8080)));
    let mut want = XtRule::default();
    want.protocol(xt::PROTO_TCP, false);
    want.xt_match(xt::recent(sep, xt::RecentOp::Set).expect("fits"));
    want.xt_match(xt::any_port(xt::PROTO_TCP).expect("tcp"));
    want.xt_target(xt::dnat(ip("10.1.2.3"), 8080));
    assert_eq!(encode_rule(IpFamily::V4, &rule), Ok(want));

    let rule = Rule::new("KUBE-SVC-X")
        .comment("c")
        .with(Match::Statistic(Probability::one_in(3)))
        .with(Match::Conntrack {
            states: CtStates::NEW,
            negated: false,
        })
        .with(Match::AddrType {
            side: AddrTypeSide::Source,
            addr_type: AddrType::Local,
        })
        .with(Match::Mark {
            value: 0x4000,
            mask: 0x4000,
            negated: true,
        })
        .with(Match::Recent {
            name: sep.into(),
            action: RecentAction::Rcheck {
                seconds: 10800,
                reap: true,
            },
        })
        .target(Target::Mark(MarkOp::Xor(0x4000)));
    let mut want = XtRule::default();
    want.xt_match(xt::comment("c").expect("fits"));
    want.xt_match(xt::statistic_random(0x2aaa_aaab));
    want.xt_match(xt::conntrack_state(xt::ctstate::NEW, false));
    want.xt_match(xt::addrtype(xt::ADDRTYPE_LOCAL, 0));
    want.mark(0x4000, 0x4000, true);
    want.xt_match(
        xt::recent(
            sep,
            xt::RecentOp::Check {
                seconds: 10800,
                reap: true,
            },
        )
        .expect("fits"),
    );
    want.xt_target(xt::mark_target(0x4000, 0));
    assert_eq!(encode_rule(IpFamily::V4, &rule), Ok(want));

    let rule = Rule::new("KUBE-POSTROUTING").target(Target::Masquerade { random_fully: true });
    let mut want = XtRule::default();
    want.xt_target(xt::masquerade(Family::Ipv6, true));
    assert_eq!(encode_rule(IpFamily::V6, &rule), Ok(want));

    let rule = Rule::new("KUBE-FW-X").comment("dropped later");
    let mut want = XtRule::default();
    want.xt_match(xt::comment("dropped later").expect("fits"));
    want.no_target();
    assert_eq!(encode_rule(IpFamily::V4, &rule), Ok(want));

    let rule = Rule::new("KUBE-SERVICES")
        .with(Match::Protocol(Protocol::Sctp))
        .with(Match::DestinationPort(9))
        .target(Target::Reject(None));
    let mut want = XtRule::default();
    want.protocol(xt::PROTO_SCTP, false);
    want.xt_match(xt::sctp(Some(9)));
    want.xt_target(xt::reject(Family::Ipv4));
    assert_eq!(encode_rule(IpFamily::V4, &rule), Ok(want));
}

/// Whatever was not checked against iptables-nft is refused, so the render goes to
/// `iptables-restore`.
#[test]
fn unverified_shapes_are_refused() {
    let refused = |family, rule: Rule<'_>| {
        assert!(encode_rule(family, &rule).is_err(), "{rule}");
    };
    refused(
        IpFamily::V4,
        Rule::new("C").target(Target::Reject(Some(RejectWith::TcpReset))),
    );
    refused(
        IpFamily::V6,
        Rule::new("C").target(Target::Reject(Some(RejectWith::IcmpPortUnreachable))),
    );
    refused(
        IpFamily::V4,
        Rule::new("C").with(Match::DestinationPort(80)),
    );
    refused(
        IpFamily::V4,
        Rule::new("C")
            .with(Match::Source {
                addr: Address::Ip(ip("10.0.0.1")),
                negated: false,
            })
            .with(Match::Source {
                addr: Address::Ip(ip("10.0.0.2")),
                negated: false,
            }),
    );
    refused(
        IpFamily::V4,
        Rule::new("C").with(Match::Destination {
            addr: Address::Ip(ip("fd00::1")),
            negated: false,
        }),
    );
    refused(
        IpFamily::V4,
        Rule::new("C").with(Match::Source {
            addr: Address::Net("0.0.0.0/0".parse().expect("net")),
            negated: true,
        }),
    );
    refused(
        IpFamily::V6,
        Rule::new("C").target(Target::Dnat(SocketAddr::new(ip("10.0.0.1"), 80))),
    );
}

/// Message kinds of a finished batch, in order (BEGIN and END left out).
fn kinds(batch: kp_nftnl::Batch) -> Vec<u16> {
    let encoded = batch.finish();
    let mut out = Vec::new();
    let mut at = 0;
    let bytes = &encoded.bytes;
    while at < bytes.len() {
        let len =
            u32::from_ne_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
        out.push(u16::from_ne_bytes([bytes[at + 4], bytes[at + 5]]) & 0xff);
        at += len;
    }
    out[1..out.len() - 1].to_vec()
}

/// Declarations of a table go before its rules even when the render interleaves them, and
/// the first unsupported rule makes the whole render unsupported.
#[test]
fn declarations_first_per_table() {
    const NEWTABLE: u16 = 0;
    const NEWCHAIN: u16 = 3;
    const DELCHAIN: u16 = 5;
    const NEWRULE: u16 = 6;
    const DELRULE: u16 = 8;
    let mut sink = NetlinkSink::new(IpFamily::V4, None);
    sink.chain(Table::Filter, "KUBE-FORWARD");
    sink.chain(Table::Nat, "KUBE-SERVICES");
    sink.rule(Table::Nat, Rule::new("KUBE-SERVICES").jump("KUBE-SVC-A"));
    sink.chain(Table::Nat, "KUBE-SVC-A");
    sink.rule(
        Table::Filter,
        Rule::new("KUBE-FORWARD").target(Target::Drop),
    );
    sink.chain(Table::Nat, "KUBE-SVC-OLD");
    sink.delete_chain(Table::Nat, "KUBE-SVC-OLD");
    assert_eq!(sink.rules(), 2);
    let batch = sink.finish(1).expect("supported").batch;
    assert_eq!(
        kinds(batch),
        vec![
            NEWTABLE, NEWCHAIN, DELRULE, NEWRULE, // filter
            NEWTABLE, NEWCHAIN, DELRULE, NEWCHAIN, DELRULE, NEWCHAIN, DELRULE, NEWRULE,
            DELCHAIN, // nat
        ]
    );

    let mut sink = NetlinkSink::new(IpFamily::V4, None);
    sink.chain(Table::Filter, "C");
    sink.rule(
        Table::Filter,
        Rule::new("C").target(Target::Reject(Some(RejectWith::TcpReset))),
    );
    sink.rule(Table::Filter, Rule::new("C").target(Target::Drop));
    let Err(error) = sink.finish(1) else {
        panic!("unsupported");
    };
    assert!(error.rule.contains("tcp-reset"), "{error}");
}
