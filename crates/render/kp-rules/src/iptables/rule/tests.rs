use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;
use kp_core::model::Protocol;

use super::*;

fn ip(text: &str) -> IpAddr {
    text.parse().expect("literal")
}

fn net(text: &str) -> IpNet {
    text.parse().expect("literal")
}

#[test]
fn matches_print_as_restore_arguments() {
    let cases: Vec<(Match<'_>, &str)> = vec![
        (Match::Protocol(Protocol::Tcp), "-m tcp -p tcp"),
        (Match::Protocol(Protocol::Sctp), "-m sctp -p sctp"),
        (
            Match::Source {
                addr: ip("10.0.0.1").into(),
                negated: false,
            },
            "-s 10.0.0.1",
        ),
        (
            Match::Source {
                addr: net("10.0.0.0/8").into(),
                negated: true,
            },
            "! -s 10.0.0.0/8",
        ),
        (
            Match::Destination {
                addr: net("::1/128").into(),
                negated: true,
            },
            "! -d ::1/128",
        ),
        (
            Match::Destination {
                addr: ip("fd00::1").into(),
                negated: false,
            },
            "-d fd00::1",
        ),
        (
            Match::InInterface {
                name: "veth".into(),
                wildcard: true,
                negated: true,
            },
            "! -i veth+",
        ),
        (
            Match::InInterface {
                name: "cbr0".into(),
                wildcard: false,
                negated: false,
            },
            "-i cbr0",
        ),
        (Match::DestinationPort(30080), "--dport 30080"),
        (
            Match::AddrType {
                side: AddrTypeSide::Destination,
                addr_type: AddrType::Local,
            },
            "-m addrtype --dst-type LOCAL",
        ),
        (
            Match::AddrType {
                side: AddrTypeSide::Source,
                addr_type: AddrType::Local,
            },
            "-m addrtype --src-type LOCAL",
        ),
        (
            Match::Mark {
                value: 0x4000,
                mask: 0x4000,
                negated: true,
            },
            "-m mark ! --mark 0x4000/0x4000",
        ),
        (
            Match::Conntrack {
                states: CtStates::DNAT | CtStates::ESTABLISHED | CtStates::RELATED,
                negated: true,
            },
            "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT",
        ),
        (
            Match::Conntrack {
                states: CtStates::INVALID,
                negated: false,
            },
            "-m conntrack --ctstate INVALID",
        ),
        (
            Match::Statistic(Probability::one_in(3)),
            "-m statistic --mode random --probability 0.3333333333",
        ),
        (
            Match::Recent {
                name: "KUBE-SEP-ABC".into(),
                action: RecentAction::Rcheck {
                    seconds: 10800,
                    reap: true,
                },
            },
            "-m recent --name KUBE-SEP-ABC --rcheck --seconds 10800 --reap",
        ),
        (
            Match::Recent {
                name: "KUBE-SEP-ABC".into(),
                action: RecentAction::Set,
            },
            "-m recent --name KUBE-SEP-ABC --set",
        ),
    ];
    for (m, text) in cases {
        assert_eq!(m.to_string(), text);
        assert_eq!(m.clone().into_owned(), m);
    }
}

#[test]
fn numbers_print_in_decimal_at_the_edges() {
    for port in [0u16, 1, 9, 10, 65535] {
        assert_eq!(
            Match::DestinationPort(port).to_string(),
            format!("--dport {port}")
        );
    }
    let recent = |seconds| Match::Recent {
        name: "L".into(),
        action: RecentAction::Rcheck {
            seconds,
            reap: false,
        },
    };
    assert_eq!(
        recent(u32::MAX).to_string(),
        format!("-m recent --name L --rcheck --seconds {}", u32::MAX)
    );
    assert_eq!(
        recent(0).to_string(),
        "-m recent --name L --rcheck --seconds 0"
    );
}

#[test]
fn targets_print_as_restore_arguments() {
    let cases: Vec<(Target<'_>, &str)> = vec![
        (Target::Jump("KUBE-SVC-X".into()), "-j KUBE-SVC-X"),
        (Target::Goto("KUBE-SVC-X".into()), "-g KUBE-SVC-X"),
        (Target::Accept, "-j ACCEPT"),
        (Target::Drop, "-j DROP"),
        (Target::Return, "-j RETURN"),
        (Target::Reject(None), "-j REJECT"),
        (
            Target::Reject(Some(RejectWith::TcpReset)),
            "-j REJECT --reject-with tcp-reset",
        ),
        (
            Target::Masquerade { random_fully: true },
            "-j MASQUERADE --random-fully",
        ),
        (
            Target::Masquerade {
                random_fully: false,
            },
            "-j MASQUERADE",
        ),
        (
            Target::Dnat(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3)), 80)),
            "-j DNAT --to-destination 10.1.2.3:80",
        ),
        (
            Target::Dnat(SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 8080)),
            "-j DNAT --to-destination [::1]:8080",
        ),
        (Target::Mark(MarkOp::Or(0x4000)), "-j MARK --or-mark 0x4000"),
        (
            Target::Mark(MarkOp::Xor(0x4000)),
            "-j MARK --xor-mark 0x4000",
        ),
    ];
    for (target, text) in cases {
        assert_eq!(target.to_string(), text);
        assert_eq!(target.clone().into_owned(), target);
    }
}

#[test]
fn mark_ops_give_xt_mark_values() {
    assert_eq!(MarkOp::Or(0x4000).mark_and_mask(), (0x4000, 0x4000));
    assert_eq!(MarkOp::Xor(0x4000).mark_and_mask(), (0x4000, 0));
}

#[test]
fn probability_value_is_the_printed_decimal() {
    assert_eq!(Probability::one_in(3).to_string(), "0.3333333333");
    assert_eq!(Probability::one_in(3).value(), 0.3333333333);
    assert_eq!(Probability::one_in(0).to_string(), "1.0000000000");
    assert_eq!(Probability::one_in(100_001).to_string(), "0.0000099999");
    assert_eq!(Probability::one_in(7).remaining(), 7);
}

#[test]
fn addresses_keep_how_they_were_written() {
    assert_eq!(Address::Ip(ip("10.0.0.1")).to_string(), "10.0.0.1");
    assert_eq!(Address::Net(net("10.0.0.1/32")).to_string(), "10.0.0.1/32");
    assert_eq!(Address::Ip(ip("10.0.0.1")).net(), net("10.0.0.1/32"));
    assert_eq!(Address::Ip(ip("fd00::1")).net(), net("fd00::1/128"));
}

#[test]
fn rules_print_comment_first_then_matches_then_target() {
    let rule = Rule::new("KUBE-SERVICES")
        .comment(Comment::Service {
            before: "",
            service: "ns/svc:http",
            after: " cluster IP",
        })
        .with(Match::Protocol(Protocol::Tcp))
        .with(Match::Destination {
            addr: ip("10.96.0.10").into(),
            negated: false,
        })
        .with(Match::DestinationPort(80))
        .jump("KUBE-SVC-ABC");
    assert_eq!(
        rule.to_string(),
        "-A KUBE-SERVICES -m comment --comment \"ns/svc:http cluster IP\" \
         -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-SVC-ABC"
    );
    let owned = rule.clone().into_owned();
    assert_eq!(owned.to_string(), rule.to_string());
    assert_eq!(Rule::new("KUBE-FW-X").to_string(), "-A KUBE-FW-X");
}

#[test]
fn comments_are_encoded_when_printed_and_raw_in_display() {
    let hostile = Comment::Endpoint {
        service: "a\" -j ACCEPT/x\ny:p",
        endpoint: SocketAddr::new(ip("10.0.0.1"), 80),
    };
    assert_eq!(hostile.to_string(), "a\" -j ACCEPT/x\ny:p -> 10.0.0.1:80");
    assert_eq!(hostile.sanitized(), "a%22 -j ACCEPT/x%0Ay:p -> 10.0.0.1:80");
    let rule = Rule::new("C").comment(hostile.clone()).target(Target::Drop);
    assert_eq!(
        rule.to_string(),
        "-A C -m comment --comment \"a%22 -j ACCEPT/x%0Ay:p -> 10.0.0.1:80\" -j DROP"
    );
    assert_eq!(
        hostile.into_owned(),
        Comment::Text("a\" -j ACCEPT/x\ny:p -> 10.0.0.1:80".into())
    );
}

#[test]
fn typed_and_streamed_restores_give_the_same_text() {
    fn feed(sink: &mut impl RuleSink) {
        sink.chain(Table::Filter, "KUBE-FORWARD");
        sink.chain(Table::Nat, "KUBE-SERVICES");
        sink.rule(Table::Nat, Rule::new("KUBE-SERVICES").jump("KUBE-SVC-A"));
        sink.rule(
            Table::Filter,
            Rule::new("KUBE-FORWARD")
                .with(Match::Conntrack {
                    states: CtStates::INVALID,
                    negated: false,
                })
                .target(Target::Drop),
        );
        sink.chain(Table::Nat, "KUBE-SVC-OLD");
        sink.delete_chain(Table::Nat, "KUBE-SVC-OLD");
    }
    let mut typed = Restore::default();
    let mut text = RestoreText::default();
    feed(&mut typed);
    feed(&mut text);
    let want = "*filter\n:KUBE-FORWARD - [0:0]\n\
                -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\nCOMMIT\n\
                *nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-OLD - [0:0]\n\
                -A KUBE-SERVICES -j KUBE-SVC-A\n-X KUBE-SVC-OLD\nCOMMIT\n";
    assert_eq!(typed.to_string(), want);
    assert_eq!(text.finish(), want);
    assert_eq!(typed.rules().count(), 2);
}
