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
    messages(batch).into_iter().map(|(kind, ..)| kind).collect()
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
    let Err(NetlinkError::Unsupported(error)) = sink.finish(1) else {
        panic!("unsupported");
    };
    assert!(error.rule.contains("tcp-reset"), "{error}");
}

/// One message of a finished batch: kind, flags, and its `NFTA_RULE_POSITION` and
/// `NFTA_RULE_HANDLE` when present (BEGIN and END left out).
fn messages(batch: kp_nftnl::Batch) -> Vec<(u16, u16, Option<u64>, Option<u64>)> {
    const NFTA_RULE_HANDLE: u16 = 3;
    const NFTA_RULE_POSITION: u16 = 6;
    let encoded = batch.finish();
    let bytes = &encoded.bytes;
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len =
            u32::from_ne_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
        let kind = u16::from_ne_bytes([bytes[at + 4], bytes[at + 5]]) & 0xff;
        let flags = u16::from_ne_bytes([bytes[at + 6], bytes[at + 7]]);
        let attr = |ty| {
            kp_nftnl::codec::attributes(&bytes[at + 20..at + len])
                .find(|(t, _)| *t == ty)
                .and_then(|(_, v)| Some(u64::from_be_bytes(v.try_into().ok()?)))
        };
        out.push((
            kind,
            flags,
            attr(NFTA_RULE_POSITION),
            attr(NFTA_RULE_HANDLE),
        ));
        at += len;
    }
    out[1..out.len() - 1].to_vec()
}

/// A rule the kernel echoed with `handle`.
fn echo(handle: u64) -> Vec<u8> {
    let mut message = vec![2, 0, 0, 0, 12, 0, 3, 0];
    message.extend_from_slice(&handle.to_be_bytes());
    message
}

/// A partial sync edits a known top-level chain in place: unchanged rules are kept (and never
/// encoded), a rule nothing matches is inserted before the next kept one or after the last,
/// old rules nothing matches are deleted by handle; the plan gives the chain's new handles.
#[test]
fn partial_syncs_edit_known_chains_in_place() {
    const NEWTABLE: u16 = 0;
    const NEWRULE: u16 = 6;
    const DELRULE: u16 = 8;
    const NLM_F_APPEND: u16 = 0x800;
    let rule = |target: &'static str| Rule::new("KUBE-SERVICES").jump(target);
    let old: Vec<(Key, u64)> = ["A", "B", "C", "D"]
        .iter()
        .zip(10..)
        .map(|(name, handle)| (Key::of(&rule(name)), handle))
        .collect();
    let mut previous = Installed::default();
    previous
        .chains
        .insert((Table::Nat, "KUBE-SERVICES".to_owned()), old);
    let mut sink = NetlinkSink::new(IpFamily::V4, Some(previous));
    sink.chain(Table::Nat, "KUBE-SERVICES");
    for name in ["A", "X", "C", "D", "Y", "Z"] {
        sink.rule(Table::Nat, rule(name));
    }
    assert_eq!(sink.rules(), 3, "only the new rules are encoded");
    let Prepared { batch, plan } = sink.finish(1).expect("supported");
    assert_eq!(plan.learn().count(), 0);
    let sent = messages(batch);
    assert_eq!(sent.len(), 5, "{sent:?}");
    assert_eq!(sent[0].0, NEWTABLE);
    // B deleted; X right before C; Z, then Y, right after D (so Y comes first).
    assert_eq!((sent[1].0, sent[1].3), (DELRULE, Some(11)));
    assert_eq!((sent[2].0, sent[2].2), (NEWRULE, Some(12)));
    assert_eq!(sent[2].1 & NLM_F_APPEND, 0);
    for m in &sent[3..] {
        assert_eq!((m.0, m.2), (NEWRULE, Some(13)));
        assert_ne!(m.1 & NLM_F_APPEND, 0);
    }
    // The kernel's echoes: X got 20, Z 21, Y 22 (in the order sent).
    let echoes = vec![
        (EDIT_OWNER + 1, echo(20)),
        (EDIT_OWNER + 2, echo(21)),
        (EDIT_OWNER + 3, echo(22)),
    ];
    let installed = plan.complete(&echoes, &[]).expect("adds up");
    let chain = &installed.chains[&(Table::Nat, "KUBE-SERVICES".to_owned())];
    let want: Vec<(Key, u64)> = [
        ("A", 10),
        ("X", 20),
        ("C", 12),
        ("D", 13),
        ("Y", 22),
        ("Z", 21),
    ]
    .iter()
    .map(|(name, handle)| (Key::of(&rule(name)), *handle))
    .collect();
    assert_eq!(chain, &want);
}

/// Rules that moved are deleted and inserted again; the rest stay; an emptied chain loses
/// every rule; a chain the sync does not know is written whole.
#[test]
fn partial_syncs_delete_what_is_gone() {
    const NEWCHAIN: u16 = 3;
    const NEWRULE: u16 = 6;
    const DELRULE: u16 = 8;
    let rule = |chain: &'static str, target: &'static str| Rule::new(chain).jump(target);
    let mut previous = Installed::default();
    for (chain, targets) in [
        ("KUBE-SERVICES", ["A", "B", "C"]),
        ("KUBE-NODEPORTS", ["N", "O", "P"]),
    ] {
        previous.chains.insert(
            (Table::Nat, chain.to_owned()),
            targets
                .iter()
                .zip(1..)
                .map(|(t, h)| (Key::of(&rule(chain, t)), h))
                .collect(),
        );
    }
    let mut sink = NetlinkSink::new(IpFamily::V4, Some(previous));
    sink.chain(Table::Nat, "KUBE-SERVICES");
    sink.chain(Table::Nat, "KUBE-NODEPORTS");
    sink.chain(Table::Nat, "KUBE-POSTROUTING");
    // C, then A: C is found further on and kept (A and B before it go); A then comes
    // again, after it.
    sink.rule(Table::Nat, rule("KUBE-SERVICES", "C"));
    sink.rule(Table::Nat, rule("KUBE-SERVICES", "A"));
    sink.rule(Table::Nat, rule("KUBE-POSTROUTING", "M"));
    let Prepared { batch, plan } = sink.finish(1).expect("supported");
    let kinds: Vec<(u16, Option<u64>, Option<u64>)> = messages(batch)
        .into_iter()
        .map(|(k, _, p, h)| (k, p, h))
        .collect();
    assert_eq!(
        kinds[1..],
        [
            // KUBE-POSTROUTING declared (created, flushed).
            (NEWCHAIN, None, None),
            (DELRULE, None, None),
            // KUBE-SERVICES.
            (DELRULE, None, Some(1)),
            (DELRULE, None, Some(2)),
            (NEWRULE, Some(3), None),
            // KUBE-NODEPORTS: emptied.
            (DELRULE, None, Some(1)),
            (DELRULE, None, Some(2)),
            (DELRULE, None, Some(3)),
            // KUBE-POSTROUTING: written whole.
            (NEWRULE, None, None),
        ]
    );
    assert_eq!(
        plan.learn().cloned().collect::<Vec<_>>(),
        [(Table::Nat, "KUBE-POSTROUTING".to_owned())]
    );
}

/// Three services, each sending a dispatch rule, its own chain and a rule in it, then a
/// closing top-level rule.
fn three_services(sink: &mut NetlinkSink<'_>) {
    sink.chain(Table::Nat, "KUBE-SERVICES");
    for svc in ["KUBE-SVC-A", "KUBE-SVC-B", "KUBE-SVC-C"] {
        sink.rule(Table::Nat, Rule::new("KUBE-SERVICES").jump(svc));
        sink.chain(Table::Nat, svc);
        sink.rule(Table::Nat, Rule::new(svc).target(Target::Accept));
        sink.service_done();
    }
    sink.rule(
        Table::Nat,
        Rule::new("KUBE-SERVICES").target(Target::Return),
    );
}

/// A split sync sends the service chains ahead, whole services at a time once the bound is
/// reached, and the rest before the last transaction, which holds the top-level chains; a
/// refused step stops it.
#[test]
fn split_syncs_send_service_chains_ahead() {
    const NEWTABLE: u16 = 0;
    const NEWCHAIN: u16 = 3;
    const NEWRULE: u16 = 6;
    const DELRULE: u16 = 8;
    let mut sent = Vec::new();
    let mut sink = NetlinkSink::new(IpFamily::V4, None).splitting(
        4,
        Box::new(|batch| {
            sent.push(kinds(batch));
            Ok(())
        }),
    );
    three_services(&mut sink);
    let last = sink.finish(1).expect("supported");
    assert_eq!(
        sent,
        [
            // KUBE-SERVICES created unflushed and KUBE-SVC-A (4 messages held after A),
            // then KUBE-SVC-B and C (3 held after B, 6 after C); nothing is left for the
            // step before the last.
            vec![NEWTABLE, NEWCHAIN, NEWCHAIN, DELRULE, NEWRULE],
            vec![
                NEWTABLE, NEWCHAIN, DELRULE, NEWCHAIN, DELRULE, NEWRULE, NEWRULE
            ],
        ]
    );
    // KUBE-SERVICES with its four rules.
    assert_eq!(
        kinds(last.batch),
        [
            NEWTABLE, NEWCHAIN, DELRULE, NEWRULE, NEWRULE, NEWRULE, NEWRULE
        ]
    );
    assert_eq!(
        last.plan.learn().cloned().collect::<Vec<_>>(),
        [(Table::Nat, "KUBE-SERVICES".to_owned())]
    );

    let mut sent = 0;
    let mut sink = NetlinkSink::new(IpFamily::V4, None).splitting(
        1000,
        Box::new(|_| {
            sent += 1;
            Ok(())
        }),
    );
    three_services(&mut sink);
    assert!(sink.finish(1).is_ok());
    assert_eq!(sent, 1, "below the bound: one step before the last");

    let mut tries = 0;
    let mut sink = NetlinkSink::new(IpFamily::V4, None).splitting(
        1,
        Box::new(|_| {
            tries += 1;
            Err(ApplyError::Batch(std::io::Error::from_raw_os_error(22)))
        }),
    );
    three_services(&mut sink);
    let Err(NetlinkError::Apply(ApplyError::Batch(error))) = sink.finish(1) else {
        panic!("the refused step is the sync's error");
    };
    assert_eq!(error.raw_os_error(), Some(22));
    assert_eq!(tries, 1, "nothing is sent after a refused step");
}
