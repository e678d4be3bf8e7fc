//! Kernel probe for pinning a ClientIP-affinity client across all the addresses of a service
//! port in the verdict-free layout (docs/nftables-layout.md, "Session affinity"): nft cannot
//! write a rule whose concatenated key holds a map lookup's result, but the kernel only sees
//! registers. A lookup of `daddr . l4proto . dport` in a map of service-port identities writes
//! the identity into the registers right after the source address, and the next lookup takes
//! `saddr . identity` as its key. This test builds such rules over netlink (`kp-nftnl`) and
//! sends real TCP through them in a throwaway network namespace: a client recorded through one
//! address of a service port is sent to the same endpoint through another. The kernel does
//! it; nft 1.0.6 aborts listing such rules, which is why the layout does not use them (see
//! the affinity section of docs/nftables-layout.md).
//!
//! Without root, `unshare` or `nft` the test is skipped with a message, unless `CI` or
//! `KP_REQUIRE_KERNEL_TESTS=1` is set, which makes that a failure.

use crate::nft_tools;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use kp_nftnl::NftSocket;
use kp_nftnl::codec::{Batch, Family};
use kp_nftnl::expr::{
    CT_DST_IP, CT_PROTO_DST, CmpOp, Expr, META_L4PROTO, PAYLOAD_NETWORK, PAYLOAD_TRANSPORT,
    REG32_00,
};
use kp_nftnl::lower::{Lowered, Op};
use kp_testbed::isolated::{self, sh};
use nft_tools::{nft, unavailable};

const TABLE: &str = "kp-probe";

/// The maps, the two elements of one service port's identity (two addresses) and an
/// endpoint per address for the plain pick, so that only the identity can make the second
/// address answer from the first one's endpoint.
const SETUP: &str = "
table ip kp-probe {
  map port-ids { type ipv4_addr . inet_proto . inet_service : mark ;
    elements = { 10.96.0.10 . tcp . 80 : 0x1, 10.96.0.11 . tcp . 80 : 0x1 } }
  map affinity { type ipv4_addr . mark : ipv4_addr . inet_service ;
    flags dynamic,timeout ; timeout 1h ; }
  map endpoints { type ipv4_addr . inet_proto . inet_service : ipv4_addr . inet_service ;
    elements = { 10.96.0.10 . tcp . 80 : 10.0.0.1 . 8081, 10.96.0.11 . tcp . 80 : 10.0.0.1 . 8082 } }
  chain out { type nat hook output priority -100 ; }
  chain post { type nat hook postrouting priority 100 ; }
}
";

fn r(n: u32) -> u32 {
    REG32_00 + n
}

fn tcp_only() -> [Expr; 2] {
    [
        Expr::Meta {
            key: META_L4PROTO,
            dreg: r(0),
        },
        Expr::Cmp {
            sreg: r(0),
            op: CmpOp::Eq,
            data: vec![6],
        },
    ]
}

/// `ip saddr` (4 bytes at 12) or `ip daddr` (at 16) into `dreg`.
fn addr(offset: u32, dreg: u32) -> Expr {
    Expr::Payload {
        base: PAYLOAD_NETWORK,
        offset,
        len: 4,
        dreg,
    }
}

fn dport(dreg: u32) -> Expr {
    Expr::Payload {
        base: PAYLOAD_TRANSPORT,
        offset: 2,
        len: 2,
        dreg,
    }
}

fn lookup(set: &str, sreg: u32, dreg: u32) -> Expr {
    Expr::Lookup {
        set_id: None,
        set: set.into(),
        sreg,
        dreg: Some(dreg),
    }
}

fn dnat(reg_addr: u32, reg_proto: u32) -> Expr {
    Expr::Dnat {
        family: 2,
        reg_addr,
        reg_proto,
    }
}

/// `ip daddr . meta l4proto . th dport` (the entry) into R1–R3, after `first`.
fn entry_key(first: &[Expr]) -> Vec<Expr> {
    let mut exprs = tcp_only().to_vec();
    exprs.extend_from_slice(first);
    exprs.extend([
        addr(16, r(1)),
        Expr::Meta {
            key: META_L4PROTO,
            dreg: r(2),
        },
        dport(r(3)),
    ]);
    exprs
}

/// `dnat to ip saddr . (ip daddr . meta l4proto . th dport map @port-ids) map @affinity`:
/// saddr in R0, the entry in R1–R3, replaced by the 4-byte identity in R1; then
/// `saddr . identity` (R0–R1) gives `addr . port` in R2–R3.
fn affinity_rule() -> Vec<Expr> {
    let mut exprs = entry_key(&[addr(12, r(0))]);
    exprs.extend([
        lookup("port-ids", r(1), r(1)),
        lookup("affinity", r(0), r(2)),
        dnat(r(2), r(3)),
    ]);
    exprs
}

/// `dnat to ip daddr . meta l4proto . th dport map @endpoints`.
fn pick_rule() -> Vec<Expr> {
    let mut exprs = entry_key(&[]);
    exprs.extend([lookup("endpoints", r(1), r(1)), dnat(r(1), r(2))]);
    exprs
}

/// After DNAT: `update @affinity { ip saddr . (ct original ip daddr . meta l4proto .
/// ct original proto-dst map @port-ids) : ip daddr . th dport }`.
fn record_rule() -> Vec<Expr> {
    let mut exprs = tcp_only().to_vec();
    exprs.extend([
        Expr::CtOriginal {
            key: CT_DST_IP,
            dreg: r(1),
        },
        Expr::Meta {
            key: META_L4PROTO,
            dreg: r(2),
        },
        Expr::CtOriginal {
            key: CT_PROTO_DST,
            dreg: r(3),
        },
        lookup("port-ids", r(1), r(1)),
        addr(12, r(0)),
        addr(16, r(2)),
        dport(r(3)),
        Expr::DynsetUpdate {
            set: "affinity".into(),
            set_id: None,
            sreg_key: r(0),
            sreg_data: Some(r(2)),
        },
    ]);
    exprs
}

fn add_rule(batch: &mut Batch, chain: &str, exprs: Vec<Expr>) {
    let rule = Lowered {
        family: Family::Ipv4,
        table: TABLE,
        op: Op::AddRule {
            chain: chain.into(),
            exprs,
            comment: None,
            anonymous: None,
        },
    };
    batch.push(&rule, 0);
}

/// Which of the listeners accepts a connection to `to`: the port it says.
fn answering_port(to: &str, listeners: &[TcpListener]) -> u16 {
    let to: SocketAddr = to.parse().expect("address");
    let mut client = TcpStream::connect_timeout(&to, Duration::from_secs(2)).expect("connect");
    client.write_all(b"?").expect("send");
    for listener in listeners {
        if let Ok((mut conn, _)) = listener.accept() {
            let mut byte = [0u8; 1];
            conn.read_exact(&mut byte).expect("read");
            return listener.local_addr().expect("bound").port();
        }
    }
    panic!("no listener accepted the connection to {to}");
}

#[test]
fn a_lookup_result_in_a_concatenated_key_pins_a_client_across_addresses() {
    isolated::run(
        "a_lookup_result_in_a_concatenated_key_pins_a_client_across_addresses",
        unavailable,
        || {
            nft_tools::endpoint_on_lo();
            sh(&format!("nft -f - <<'EOF'\n{SETUP}\nEOF"));

            let mut socket = NftSocket::open().expect("nf_tables socket");
            let mut batch = Batch::new(1);
            add_rule(&mut batch, "out", affinity_rule());
            add_rule(&mut batch, "out", pick_rule());
            add_rule(&mut batch, "post", record_rule());
            socket
                .apply_batch(batch)
                .expect("the kernel takes the rules");

            let listeners: Vec<TcpListener> = ["10.0.0.1:8081", "10.0.0.1:8082"]
                .iter()
                .map(|a| {
                    let listener = TcpListener::bind(a).expect("bind");
                    // Accepting only what is queued: the one that was connected to.
                    listener.set_nonblocking(true).expect("nonblocking");
                    listener
                })
                .collect();
            let accepted = |to: &str| {
                std::thread::sleep(Duration::from_millis(50));
                answering_port(to, &listeners)
            };

            // Nothing recorded: each address picks its own endpoint.
            assert_eq!(accepted("10.96.0.10:80"), 8081);
            let recorded = nft(&["list", "map", "ip", TABLE, "affinity"]);
            assert!(
                recorded.contains("10.0.0.1 . 0x00000001 expires")
                    && recorded.contains(": 10.0.0.1 . 8081"),
                "the record rule keyed the client by the identity: {recorded}"
            );
            // Recorded through .10: .11 of the same service port answers from 8081, not
            // from its own pick (8082).
            assert_eq!(accepted("10.96.0.11:80"), 8081);
            assert_eq!(accepted("10.96.0.11:80"), 8081);

            // Why the layout does not use this yet: nft 1.0.6 cannot list such a rule (it
            // aborts in netlink_parse_concat_expr), and operators read the ruleset with nft.
            // Printed, not asserted: the finding is about the tool, not about this code.
            let listing = Command::new("nft")
                .args(["list", "chain", "ip", TABLE, "out"])
                .output()
                .expect("run nft");
            eprintln!(
                "nft list chain: {} {}",
                listing.status,
                String::from_utf8_lossy(&listing.stderr).trim()
            );
        },
    );
}
