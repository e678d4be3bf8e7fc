//! iptables-nft's rules, encoded as iptables-nft 1.8.9 encodes them.
//!
//! iptables-nft keeps the iptables tables (`ip`/`ip6` `filter` and `nat`) in nf_tables.
//! Each rule is a list of expressions: native ones (`meta`, `payload`, `bitwise`, `cmp`,
//! `immediate`) for what iptables-nft translates itself (protocol, addresses, interfaces,
//! `-m mark`, tcp/udp ports, plain verdicts and jumps), and the kernel's x_tables
//! compatibility expressions (`match`, `target`) carrying the extension's name, revision
//! and info struct for the rest (`comment`, `conntrack`, `recent`, `statistic`, ...), with
//! a `counter` before the verdict. `iptables-save`, `iptables -L` and `iptables -C` read
//! the rules back by recognising exactly these shapes, so what this module writes must be
//! what iptables-nft writes, byte for byte: the info structs below are laid out as the
//! kernel headers (`linux/netfilter/xt_*.h`) define them, with the values iptables' own
//! extensions fill in, and the tests compare them with what the kernel dumps for rules
//! `iptables-nft-restore` 1.8.9 made. iptables 1.8.9 keeps a rule's comment in the
//! `comment` match, not in the rule's user data.

use std::net::IpAddr;

use kp_netlink::{NLM_F_APPEND, NLM_F_CREATE, NLM_F_ECHO};

use crate::abi::{
    NFT_RULE_COMPAT_F_INV, NFTA_CHAIN_HOOK, NFTA_CHAIN_NAME, NFTA_CHAIN_POLICY, NFTA_CHAIN_TABLE,
    NFTA_CHAIN_TYPE, NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS, NFTA_EXPR_DATA, NFTA_EXPR_NAME,
    NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY, NFTA_LIST_ELEM, NFTA_MATCH_INFO, NFTA_MATCH_NAME,
    NFTA_MATCH_REV, NFTA_RULE_CHAIN, NFTA_RULE_COMPAT, NFTA_RULE_COMPAT_FLAGS,
    NFTA_RULE_COMPAT_PROTO, NFTA_RULE_EXPRESSIONS, NFTA_RULE_HANDLE, NFTA_RULE_POSITION,
    NFTA_RULE_TABLE, NFTA_TABLE_NAME,
};
use crate::codec::{Batch, Family, MsgKind, Writer};
use crate::expr::{
    CmpOp, Expr, META_IIFNAME, META_L4PROTO, META_MARK, PAYLOAD_NETWORK, PAYLOAD_TRANSPORT, REG_1,
    Verdict,
};

/// `XT_MAX_COMMENT_LEN`: the comment match's buffer, NUL included.
pub const XT_MAX_COMMENT_LEN: usize = 256;
/// `XT_RECENT_NAME_LEN`: the recent list name buffer, NUL included.
pub const XT_RECENT_NAME_LEN: usize = 200;
/// `IFNAMSIZ`.
const IFNAMSIZ: usize = 16;

/// `NFTA_RULE_EXPRESSIONS` of `rule`.
fn write_expressions(w: &mut Writer, rule: &XtRule) {
    let list = w.nest(NFTA_RULE_EXPRESSIONS);
    for expr in &rule.exprs {
        let elem = w.nest(NFTA_LIST_ELEM);
        w.put_str(NFTA_EXPR_NAME, expr.name());
        let data = w.nest(NFTA_EXPR_DATA);
        expr.encode(w);
        w.nest_end(data);
        w.nest_end(elem);
    }
    w.nest_end(list);
}

/// The encoded expressions of `rule` (the `NFTA_RULE_EXPRESSIONS` attribute), for telling
/// rules apart.
pub fn expressions(rule: &XtRule) -> Vec<u8> {
    let mut w = Writer::default();
    write_expressions(&mut w, rule);
    w.bytes().to_vec()
}

/// The handle of a rule the kernel sent (a dump or an echo), from `NFTA_RULE_HANDLE`.
pub fn rule_handle(message: &[u8]) -> Option<u64> {
    let attrs = message.get(4..)?;
    crate::codec::attributes(attrs)
        .find(|(ty, _)| *ty == NFTA_RULE_HANDLE)
        .and_then(|(_, value)| Some(u64::from_be_bytes(value.try_into().ok()?)))
}

/// `NF_ACCEPT`, the policy iptables-nft gives the built-in chains it creates.
const NF_ACCEPT: u32 = 1;

/// One expression of an iptables-nft rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XtExpr {
    /// A native nf_tables expression.
    Native(Expr),
    /// An x_tables match: extension name, revision, info struct.
    Match {
        /// The extension (`comment`, `conntrack`, ...).
        name: &'static str,
        /// Its revision.
        rev: u32,
        /// Its info struct, padded to `XT_ALIGN`.
        info: Vec<u8>,
    },
    /// An x_tables target.
    Target {
        /// The extension (`DNAT`, `MARK`, ...).
        name: &'static str,
        /// Its revision.
        rev: u32,
        /// Its info struct, padded to `XT_ALIGN`.
        info: Vec<u8>,
    },
    /// The packet and byte counter iptables-nft puts before every rule's verdict.
    Counter,
}

impl XtExpr {
    fn name(&self) -> &'static str {
        match self {
            XtExpr::Native(expr) => expr.name(),
            XtExpr::Match { .. } => "match",
            XtExpr::Target { .. } => "target",
            XtExpr::Counter => "counter",
        }
    }

    fn encode(&self, w: &mut Writer) {
        match self {
            XtExpr::Native(expr) => expr.encode(w, None),
            XtExpr::Match { name, rev, info } | XtExpr::Target { name, rev, info } => {
                w.put_str(NFTA_MATCH_NAME, name);
                w.put_u32(NFTA_MATCH_REV, *rev);
                w.put(NFTA_MATCH_INFO, info);
            }
            XtExpr::Counter => {
                // iptables-nft sets both (to the restore's `[0:0]`).
                w.put_u64(NFTA_COUNTER_BYTES, 0);
                w.put_u64(NFTA_COUNTER_PACKETS, 0);
            }
        }
    }
}

/// An iptables-nft rule: its expressions, and the protocol of its `-p` (the kernel checks
/// the x_tables matches that need one, such as `tcp`, against it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XtRule {
    /// The expressions, in order.
    pub exprs: Vec<XtExpr>,
    /// `-p`'s protocol number and whether it is negated.
    pub compat: Option<(u8, bool)>,
}

impl XtRule {
    /// Append `expr`.
    pub fn push(&mut self, expr: XtExpr) {
        self.exprs.push(expr);
    }

    /// Append a native expression.
    pub fn native(&mut self, expr: Expr) {
        self.exprs.push(XtExpr::Native(expr));
    }

    /// `-p PROTO` (`! -p` when `invert`): the layer 4 protocol, and the compat protocol.
    pub fn protocol(&mut self, proto: u8, invert: bool) {
        self.native(Expr::Meta {
            key: META_L4PROTO,
            dreg: REG_1,
        });
        self.native(Expr::Cmp {
            sreg: REG_1,
            op: cmp_op(invert),
            data: vec![proto],
        });
        self.compat = Some((proto, invert));
    }

    /// `-s NET` / `-d NET` (`!` when `invert`), as iptables-nft's `add_addr` loads it: the
    /// whole-byte prefix alone when the mask ends on a byte boundary, else the full address
    /// through a `bitwise` mask. A `/0` matches everything and adds nothing (as iptables
    /// leaves an unset address out); inverted, it can never match, which iptables-nft
    /// encodes as a zero-length load this encoder does not reproduce: callers must not ask
    /// for it (`None`).
    pub fn address(&mut self, source: bool, addr: IpAddr, prefix: u8, invert: bool) -> Option<()> {
        let (bytes, offset): (Vec<u8>, u32) = match addr {
            IpAddr::V4(v4) => (v4.octets().to_vec(), if source { 12 } else { 16 }),
            IpAddr::V6(v6) => (v6.octets().to_vec(), if source { 8 } else { 24 }),
        };
        let bits = bytes.len() * 8;
        let prefix = usize::from(prefix);
        if prefix > bits {
            return None;
        }
        if prefix == 0 {
            return if invert { None } else { Some(()) };
        }
        let mask: Vec<u8> = (0..bytes.len())
            .map(|i| {
                let ones = prefix.saturating_sub(i * 8).min(8);
                if ones == 0 { 0 } else { 0xffu8 << (8 - ones) }
            })
            .collect();
        let masked: Vec<u8> = bytes.iter().zip(&mask).map(|(b, m)| b & m).collect();
        let partial = !prefix.is_multiple_of(8);
        let len = if partial { bytes.len() } else { prefix / 8 };
        self.native(Expr::Payload {
            base: PAYLOAD_NETWORK,
            offset,
            len: len as u32,
            dreg: REG_1,
        });
        if partial {
            self.native(Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: mask.clone(),
                xor: vec![0; bytes.len()],
            });
        }
        self.native(Expr::Cmp {
            sreg: REG_1,
            op: cmp_op(invert),
            data: masked[..len].to_vec(),
        });
        Some(())
    }

    /// `-i NAME` (a trailing `+` is a prefix wildcard), `!` when `invert`. `None` for a
    /// name that does not fit `IFNAMSIZ` or is a bare `+`.
    pub fn in_interface(&mut self, name: &str, invert: bool) -> Option<()> {
        let (data, wildcard) = match name.strip_suffix('+') {
            Some(prefix) => (prefix.as_bytes().to_vec(), true),
            None => (name.as_bytes().to_vec(), false),
        };
        if data.is_empty() || data.len() >= IFNAMSIZ || data.contains(&0) {
            return None;
        }
        let mut data = data;
        if !wildcard {
            data.push(0);
        }
        self.native(Expr::Meta {
            key: META_IIFNAME,
            dreg: REG_1,
        });
        self.native(Expr::Cmp {
            sreg: REG_1,
            op: cmp_op(invert),
            data,
        });
        Some(())
    }

    /// `-m tcp --dport P` / `-m udp --dport P` translated natively: the destination port
    /// loaded from the transport header and compared.
    pub fn destination_port(&mut self, port: u16) {
        self.native(Expr::Payload {
            base: PAYLOAD_TRANSPORT,
            offset: 2,
            len: 2,
            dreg: REG_1,
        });
        self.native(Expr::Cmp {
            sreg: REG_1,
            op: CmpOp::Eq,
            data: port.to_be_bytes().to_vec(),
        });
    }

    /// `-m mark --mark VALUE/MASK` (`!` when `invert`), translated natively.
    pub fn mark(&mut self, value: u32, mask: u32, invert: bool) {
        self.native(Expr::Meta {
            key: META_MARK,
            dreg: REG_1,
        });
        self.native(Expr::Bitwise {
            sreg: REG_1,
            dreg: REG_1,
            mask: mask.to_ne_bytes().to_vec(),
            xor: vec![0; 4],
        });
        self.native(Expr::Cmp {
            sreg: REG_1,
            op: cmp_op(invert),
            data: value.to_ne_bytes().to_vec(),
        });
    }

    /// An x_tables match.
    pub fn xt_match(&mut self, (name, rev, info): (&'static str, u32, Vec<u8>)) {
        self.push(XtExpr::Match { name, rev, info });
    }

    /// Ends the rule with its counter and `verdict` (`-j ACCEPT`, `-j KUBE-...`).
    pub fn verdict(&mut self, verdict: Verdict) {
        self.push(XtExpr::Counter);
        self.native(Expr::Immediate(verdict));
    }

    /// Ends the rule with its counter and an x_tables target.
    pub fn xt_target(&mut self, (name, rev, info): (&'static str, u32, Vec<u8>)) {
        self.push(XtExpr::Counter);
        self.push(XtExpr::Target { name, rev, info });
    }

    /// Ends a rule that has no target (`-A CHAIN -m comment ...`): only its counter.
    pub fn no_target(&mut self) {
        self.push(XtExpr::Counter);
    }
}

fn cmp_op(invert: bool) -> CmpOp {
    if invert { CmpOp::Neq } else { CmpOp::Eq }
}

/// `XT_ALIGN`: info structs are padded to 8 bytes.
fn xt_align(len: usize) -> usize {
    len.next_multiple_of(8)
}

/// A zeroed info struct of `size` bytes (before alignment).
fn info(size: usize) -> Vec<u8> {
    vec![0; xt_align(size)]
}

fn put_u16(info: &mut [u8], at: usize, value: u16) {
    info[at..at + 2].copy_from_slice(&value.to_ne_bytes());
}

fn put_u32(info: &mut [u8], at: usize, value: u32) {
    info[at..at + 4].copy_from_slice(&value.to_ne_bytes());
}

/// Copies `text` into a NUL-terminated buffer of `len` bytes at `at`; `None` when it does
/// not fit or holds a NUL (the kernel would read a shorter string).
fn put_str(info: &mut [u8], at: usize, len: usize, text: &str) -> Option<()> {
    if text.len() >= len || text.as_bytes().contains(&0) {
        return None;
    }
    info[at..at + text.len()].copy_from_slice(text.as_bytes());
    Some(())
}

/// `-m comment --comment TEXT`: `struct xt_comment_info { char comment[256]; }`.
/// `None` when the text does not fit (iptables refuses it too).
pub fn comment(text: &str) -> Option<(&'static str, u32, Vec<u8>)> {
    let mut data = info(XT_MAX_COMMENT_LEN);
    put_str(&mut data, 0, XT_MAX_COMMENT_LEN, text)?;
    Some(("comment", 0, data))
}

/// Conntrack states of `-m conntrack --ctstate` (`XT_CONNTRACK_STATE_BIT` values, as
/// iptables' libxt_conntrack numbers them).
pub mod ctstate {
    /// `INVALID`.
    pub const INVALID: u16 = 1 << 0;
    /// `ESTABLISHED`.
    pub const ESTABLISHED: u16 = 1 << 1;
    /// `RELATED`.
    pub const RELATED: u16 = 1 << 2;
    /// `NEW`.
    pub const NEW: u16 = 1 << 3;
    /// `SNAT` (a virtual state: the connection is source-NATed).
    pub const SNAT: u16 = 1 << 6;
    /// `DNAT`.
    pub const DNAT: u16 = 1 << 7;
    /// `UNTRACKED`.
    pub const UNTRACKED: u16 = 1 << 8;
}

/// `-m conntrack [!] --ctstate STATES` as iptables 1.8.9 sends it: revision 3,
/// `struct xt_conntrack_mtinfo3` (four address/mask pairs of `union nf_inet_addr`, expiry
/// bounds, then `u16` fields: l4proto, four ports, `match_flags` at 146, `invert_flags` at
/// 148, `state_mask` at 150, `status_mask`, four high ports; 162 bytes).
pub fn conntrack_state(states: u16, invert: bool) -> (&'static str, u32, Vec<u8>) {
    /// `XT_CONNTRACK_STATE`.
    const XT_CONNTRACK_STATE: u16 = 1 << 0;
    const SIZE: usize = 162;
    const MATCH_FLAGS: usize = 146;
    const INVERT_FLAGS: usize = 148;
    const STATE_MASK: usize = 150;
    let mut data = info(SIZE);
    put_u16(&mut data, MATCH_FLAGS, XT_CONNTRACK_STATE);
    if invert {
        put_u16(&mut data, INVERT_FLAGS, XT_CONNTRACK_STATE);
    }
    put_u16(&mut data, STATE_MASK, states);
    ("conntrack", 3, data)
}

/// `XT_ADDRTYPE_LOCAL` (`1 << RTN_LOCAL`).
pub const ADDRTYPE_LOCAL: u16 = 0x4;

/// `-m addrtype --src-type T` / `--dst-type T`: revision 1,
/// `struct xt_addrtype_info_v1 { u16 source; u16 dest; u32 flags; }`.
pub fn addrtype(source: u16, dest: u16) -> (&'static str, u32, Vec<u8>) {
    let mut data = info(8);
    put_u16(&mut data, 0, source);
    put_u16(&mut data, 2, dest);
    ("addrtype", 1, data)
}

/// What `-m recent` does with the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecentOp {
    /// `--set`: add the source address.
    Set,
    /// `--rcheck --seconds N [--reap]`: match a source seen in the last `seconds` (and,
    /// with `reap`, drop older entries).
    Check {
        /// The age limit.
        seconds: u32,
        /// `--reap`.
        reap: bool,
    },
}

/// `-m recent --name NAME ...` (source address, full mask, as iptables' defaults are):
/// revision 1, `struct xt_recent_mtinfo_v1 { u32 seconds; u32 hit_count; u8 check_set;
/// u8 invert; char name[200]; u8 side; union nf_inet_addr mask; }` (228 bytes; the mask
/// is all ones for both families, as libxt_recent initialises it). `None` for a name that
/// does not fit.
pub fn recent(name: &str, op: RecentOp) -> Option<(&'static str, u32, Vec<u8>)> {
    const XT_RECENT_CHECK: u8 = 1 << 0;
    const XT_RECENT_SET: u8 = 1 << 1;
    const XT_RECENT_REAP: u8 = 1 << 5;
    const CHECK_SET: usize = 8;
    const NAME: usize = 10;
    const MASK: usize = 212;
    const SIZE: usize = 228;
    let mut data = info(SIZE);
    match op {
        RecentOp::Set => data[CHECK_SET] = XT_RECENT_SET,
        RecentOp::Check { seconds, reap } => {
            put_u32(&mut data, 0, seconds);
            data[CHECK_SET] = XT_RECENT_CHECK | if reap { XT_RECENT_REAP } else { 0 };
        }
    }
    put_str(&mut data, NAME, XT_RECENT_NAME_LEN, name)?;
    data[MASK..MASK + 16].fill(0xff);
    Some(("recent", 1, data))
}

/// `-m statistic --mode random --probability P`: revision 0,
/// `struct xt_statistic_info { u16 mode; u16 flags; union { u32 probability; struct { u32
/// every, packet, count; } nth; } u; void *master (aligned 8); }` (24 bytes).
/// `probability` is iptables' fixed point: `round(P * 2^31)`. iptables also stores
/// `every - packet` in the `count` field for every mode (which, in random mode, aliases
/// the probability), and so does this.
pub fn statistic_random(probability: u32) -> (&'static str, u32, Vec<u8>) {
    let mut data = info(24);
    put_u32(&mut data, 4, probability);
    put_u32(&mut data, 12, probability);
    ("statistic", 0, data)
}

/// iptables' fixed-point probability for `--probability TEXT`: `lround(2^31 * p)`.
pub fn probability_fixed(p: f64) -> Option<u32> {
    if !(0.0..=1.0).contains(&p) {
        return None;
    }
    Some((p * f64::from(0x8000_0000u32)).round() as u32)
}

/// `-m tcp` / `-m udp` without ports (the matches iptables-nft keeps as x_tables ones):
/// `struct xt_tcp { u16 spts[2]; u16 dpts[2]; u8 option, flg_mask, flg_cmp, invflags; }`
/// and `struct xt_udp { u16 spts[2]; u16 dpts[2]; u8 invflags; }`, both with every port
/// allowed. `None` for other protocols.
pub fn any_port(proto: u8) -> Option<(&'static str, u32, Vec<u8>)> {
    let (name, size) = match proto {
        PROTO_TCP => ("tcp", 12),
        PROTO_UDP => ("udp", 9),
        _ => return None,
    };
    let mut data = info(size);
    put_u16(&mut data, 2, u16::MAX);
    put_u16(&mut data, 6, u16::MAX);
    Some((name, 0, data))
}

/// `-m sctp [--dport P]`: revision 0, `struct xt_sctp_info { u16 dpts[2]; u16 spts[2];
/// u32 chunkmap[64]; u32 chunk_match_type; struct { u8 chunktype, flag, flag_mask; }
/// flag_info[4]; int flag_count; u32 flags; u32 invflags; }` (292 bytes), with the
/// `chunktype` of each unused flag slot set to 0xff as libxt_sctp initialises it.
pub fn sctp(dport: Option<u16>) -> (&'static str, u32, Vec<u8>) {
    const XT_SCTP_DEST_PORTS: u32 = 0x02;
    const FLAG_INFO: usize = 268;
    const FLAGS: usize = 284;
    let mut data = info(292);
    for slot in 0..4 {
        data[FLAG_INFO + 3 * slot] = 0xff;
    }
    if let Some(port) = dport {
        put_u16(&mut data, 0, port);
        put_u16(&mut data, 2, port);
        put_u32(&mut data, FLAGS, XT_SCTP_DEST_PORTS);
    }
    ("sctp", 0, data)
}

/// `IPPROTO_TCP`.
pub const PROTO_TCP: u8 = 6;
/// `IPPROTO_UDP`.
pub const PROTO_UDP: u8 = 17;
/// `IPPROTO_SCTP`.
pub const PROTO_SCTP: u8 = 132;

/// `-j MARK`: revision 2, `struct xt_mark_tginfo2 { u32 mark, mask; }`; the kernel
/// computes `(mark & ~mask) ^ info.mark`, so iptables stores `--or-mark B` as `{B, B}` and
/// `--xor-mark B` as `{B, 0}`.
pub fn mark_target(mark: u32, mask: u32) -> (&'static str, u32, Vec<u8>) {
    let mut data = info(8);
    put_u32(&mut data, 0, mark);
    put_u32(&mut data, 4, mask);
    ("MARK", 2, data)
}

/// `NF_NAT_RANGE_MAP_IPS`.
const NAT_MAP_IPS: u32 = 1 << 0;
/// `NF_NAT_RANGE_PROTO_SPECIFIED`.
const NAT_PROTO_SPECIFIED: u32 = 1 << 1;
/// `NF_NAT_RANGE_PROTO_RANDOM_FULLY`.
const NAT_PROTO_RANDOM_FULLY: u32 = 1 << 4;

/// `-j MASQUERADE [--random-fully]`: revision 0; for IPv4
/// `struct nf_nat_ipv4_multi_range_compat` (a range count of 1, then one
/// `nf_nat_ipv4_range` whose flags come first; 20 bytes), for IPv6 `struct nf_nat_range`
/// (flags first; 40 bytes).
pub fn masquerade(family: Family, random_fully: bool) -> (&'static str, u32, Vec<u8>) {
    let flags = if random_fully {
        NAT_PROTO_RANDOM_FULLY
    } else {
        0
    };
    let data = match family {
        Family::Ipv4 => {
            let mut data = info(20);
            put_u32(&mut data, 0, 1);
            put_u32(&mut data, 4, flags);
            data
        }
        Family::Ipv6 => {
            let mut data = info(40);
            put_u32(&mut data, 0, flags);
            data
        }
    };
    ("MASQUERADE", 0, data)
}

/// `-j REJECT` (its default, port unreachable): revision 0, `struct ipt_reject_info` /
/// `struct ip6t_reject_info` (`u32 with`: `IPT_ICMP_PORT_UNREACHABLE` = 3,
/// `IP6T_ICMP6_PORT_UNREACH` = 4).
pub fn reject(family: Family) -> (&'static str, u32, Vec<u8>) {
    let mut data = info(4);
    put_u32(
        &mut data,
        0,
        match family {
            Family::Ipv4 => 3,
            Family::Ipv6 => 4,
        },
    );
    ("REJECT", 0, data)
}

/// `-j DNAT --to-destination ADDR:PORT`: revision 2, `struct nf_nat_range2 { u32 flags;
/// union nf_inet_addr min_addr, max_addr; __be16 min_proto, max_proto, base_proto; }`
/// (42 bytes) mapping to exactly that address and port.
pub fn dnat(addr: IpAddr, port: u16) -> (&'static str, u32, Vec<u8>) {
    let mut data = info(42);
    put_u32(&mut data, 0, NAT_MAP_IPS | NAT_PROTO_SPECIFIED);
    let octets: Vec<u8> = match addr {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    data[4..4 + octets.len()].copy_from_slice(&octets);
    data[20..20 + octets.len()].copy_from_slice(&octets);
    data[36..38].copy_from_slice(&port.to_be_bytes());
    data[38..40].copy_from_slice(&port.to_be_bytes());
    ("DNAT", 2, data)
}

/// A built-in chain as iptables-nft creates it (type, hook, priority; policy ACCEPT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuiltinChain {
    /// `INPUT`, `PREROUTING`, ...
    pub name: &'static str,
    /// nf_tables chain type: `filter` or `nat`.
    pub kind: &'static str,
    /// `NF_INET_*` hook.
    pub hook: u32,
    /// Priority.
    pub priority: i32,
}

const NF_INET_PRE_ROUTING: u32 = 0;
const NF_INET_LOCAL_IN: u32 = 1;
const NF_INET_FORWARD: u32 = 2;
const NF_INET_LOCAL_OUT: u32 = 3;
const NF_INET_POST_ROUTING: u32 = 4;

/// The built-in chains of a table, as iptables-nft defines them (same for both families).
pub fn builtin_chains(table: &str) -> &'static [BuiltinChain] {
    const FILTER: &[BuiltinChain] = &[
        BuiltinChain {
            name: "INPUT",
            kind: "filter",
            hook: NF_INET_LOCAL_IN,
            priority: 0,
        },
        BuiltinChain {
            name: "FORWARD",
            kind: "filter",
            hook: NF_INET_FORWARD,
            priority: 0,
        },
        BuiltinChain {
            name: "OUTPUT",
            kind: "filter",
            hook: NF_INET_LOCAL_OUT,
            priority: 0,
        },
    ];
    const NAT: &[BuiltinChain] = &[
        BuiltinChain {
            name: "PREROUTING",
            kind: "nat",
            hook: NF_INET_PRE_ROUTING,
            priority: -100,
        },
        BuiltinChain {
            name: "INPUT",
            kind: "nat",
            hook: NF_INET_LOCAL_IN,
            priority: 100,
        },
        BuiltinChain {
            name: "POSTROUTING",
            kind: "nat",
            hook: NF_INET_POST_ROUTING,
            priority: 100,
        },
        BuiltinChain {
            name: "OUTPUT",
            kind: "nat",
            hook: NF_INET_LOCAL_OUT,
            priority: -100,
        },
    ];
    match table {
        "filter" => FILTER,
        "nat" => NAT,
        _ => &[],
    }
}

/// Where a rule goes in its chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Position {
    /// At the end (`-A`).
    Append,
    /// At the start (`-I CHAIN 1`).
    First,
    /// Right after the rule with this handle.
    After(u64),
    /// Right before the rule with this handle.
    Before(u64),
}

/// The iptables-nft messages of one transaction, on top of [`Batch`]. Each message is
/// reported as `owner` when the kernel refuses it.
pub trait XtBatch {
    /// `*table` of a restore: create the table if it is missing.
    fn xt_table(&mut self, family: Family, table: &str, owner: usize);
    /// Create a built-in chain (a no-op for one that exists).
    fn xt_builtin_chain(&mut self, family: Family, table: &str, chain: &BuiltinChain, owner: usize);
    /// Create a user chain (a no-op for one that exists).
    fn xt_chain(&mut self, family: Family, table: &str, chain: &str, owner: usize);
    /// Delete every rule of a chain.
    fn xt_flush(&mut self, family: Family, table: &str, chain: &str, owner: usize);
    /// Delete a (flushed, unreferenced) user chain.
    fn xt_delete_chain(&mut self, family: Family, table: &str, chain: &str, owner: usize);
    /// Add `rule` to `chain` at `position`; with `echo`, the kernel sends the created rule
    /// (and its handle) back ([`crate::NftSocket::apply_batch_echoed`]).
    #[allow(clippy::too_many_arguments)]
    fn xt_rule(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
        rule: &XtRule,
        position: Position,
        echo: bool,
        owner: usize,
    );
    /// Delete the rule with `handle` from `chain`.
    fn xt_delete_rule(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
        handle: u64,
        owner: usize,
    );
}

impl XtBatch for Batch {
    fn xt_table(&mut self, family: Family, table: &str, owner: usize) {
        self.raw(MsgKind::NewTable, NLM_F_CREATE, family, owner, |w| {
            w.put_str(NFTA_TABLE_NAME, table);
        });
    }

    fn xt_builtin_chain(
        &mut self,
        family: Family,
        table: &str,
        chain: &BuiltinChain,
        owner: usize,
    ) {
        self.raw(MsgKind::NewChain, NLM_F_CREATE, family, owner, |w| {
            w.put_str(NFTA_CHAIN_TABLE, table);
            w.put_str(NFTA_CHAIN_NAME, chain.name);
            let hook = w.nest(NFTA_CHAIN_HOOK);
            w.put_u32(NFTA_HOOK_HOOKNUM, chain.hook);
            w.put_u32(NFTA_HOOK_PRIORITY, chain.priority as u32);
            w.nest_end(hook);
            w.put_u32(NFTA_CHAIN_POLICY, NF_ACCEPT);
            w.put_str(NFTA_CHAIN_TYPE, chain.kind);
        });
    }

    fn xt_chain(&mut self, family: Family, table: &str, chain: &str, owner: usize) {
        self.raw(MsgKind::NewChain, NLM_F_CREATE, family, owner, |w| {
            w.put_str(NFTA_CHAIN_TABLE, table);
            w.put_str(NFTA_CHAIN_NAME, chain);
        });
    }

    fn xt_flush(&mut self, family: Family, table: &str, chain: &str, owner: usize) {
        self.raw(MsgKind::DelRule, 0, family, owner, |w| {
            w.put_str(NFTA_RULE_TABLE, table);
            w.put_str(NFTA_RULE_CHAIN, chain);
        });
    }

    fn xt_delete_chain(&mut self, family: Family, table: &str, chain: &str, owner: usize) {
        self.raw(MsgKind::DelChain, 0, family, owner, |w| {
            w.put_str(NFTA_CHAIN_TABLE, table);
            w.put_str(NFTA_CHAIN_NAME, chain);
        });
    }

    fn xt_rule(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
        rule: &XtRule,
        position: Position,
        echo: bool,
        owner: usize,
    ) {
        // Without NLM_F_APPEND the kernel inserts before the position (or at the start);
        // with it, after the position (or at the end).
        let (append, handle) = match position {
            Position::Append => (true, None),
            Position::First => (false, None),
            Position::After(handle) => (true, Some(handle)),
            Position::Before(handle) => (false, Some(handle)),
        };
        let flags = NLM_F_CREATE
            | if append { NLM_F_APPEND } else { 0 }
            | if echo { NLM_F_ECHO } else { 0 };
        self.raw(MsgKind::NewRule, flags, family, owner, |w| {
            w.put_str(NFTA_RULE_TABLE, table);
            w.put_str(NFTA_RULE_CHAIN, chain);
            if let Some(handle) = handle {
                w.put_u64(NFTA_RULE_POSITION, handle);
            }
            write_expressions(w, rule);
            if let Some((proto, invert)) = rule.compat {
                let compat = w.nest(NFTA_RULE_COMPAT);
                w.put_u32(NFTA_RULE_COMPAT_PROTO, u32::from(proto));
                w.put_u32(
                    NFTA_RULE_COMPAT_FLAGS,
                    if invert { NFT_RULE_COMPAT_F_INV } else { 0 },
                );
                w.nest_end(compat);
            }
        });
    }

    fn xt_delete_rule(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
        handle: u64,
        owner: usize,
    ) {
        self.raw(MsgKind::DelRule, 0, family, owner, |w| {
            w.put_str(NFTA_RULE_TABLE, table);
            w.put_str(NFTA_RULE_CHAIN, chain);
            w.put_u64(NFTA_RULE_HANDLE, handle);
        });
    }
}

#[cfg(test)]
mod tests;
