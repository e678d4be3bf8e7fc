//! From the renderer's typed commands ([`kp_rules::nftables::cmd`]) to the operations
//! [`codec`](crate::codec) encodes: what nft 1.0.6 would send for the statement each command
//! prints as (registers, byte orders, anonymous sets and user data included).
//!
//! Every command the renderer can produce has a translation here (the `match`es are
//! exhaustive, so a new command or match does not compile until it has one). What can still
//! be refused is a value the kernel could not take as nft would send it (a prefix with host
//! bits, an interface name too long, a second anonymous set in one rule): then
//! [`LowerError`] names the statement and the caller applies the transaction with `nft -f -`
//! (its `Display`) instead, which reports the problem in nft's words.

use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};
use kp_rules::nftables::TABLE;
use kp_rules::nftables::cmd::{
    self, Action, AddrField, Command, KeyParts, MapKey, Match, Rule, SetKind,
};

use crate::codec::{Family, udata_u32s};
use crate::expr::{
    CmpOp, Expr, META_IIFNAME, META_L4PROTO, META_MARK, PAYLOAD_NETWORK, PAYLOAD_TRANSPORT, REG_1,
    REG_2, REG_VERDICT, Verdict,
};

/// Why a command cannot be sent as nft would send it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("statement not supported over netlink: {statement}")]
pub struct LowerError {
    /// The statement, as `nft -f` text.
    pub statement: String,
}

/// What a base chain hooks into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseChain {
    /// `filter` or `nat`.
    pub kind: &'static str,
    /// `NF_INET_*` hook number.
    pub hook: u32,
    /// Priority.
    pub priority: i32,
}

/// A set's (or map's) declaration, as the kernel wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetSpec {
    /// `NFT_SET_*` flags.
    pub flags: u32,
    /// nft's data type id of the key (concatenations combine ids).
    pub key_type: u32,
    /// Key length in bytes.
    pub key_len: u32,
    /// Data type and length, for maps.
    pub data: Option<(u32, u32)>,
    /// Default element timeout.
    pub timeout_ms: Option<u64>,
    /// The most elements it holds (`size`), when not the kernel's default.
    pub size: Option<u32>,
    /// User data nft writes before the comment (byte orders, ...).
    pub udata_prefix: Vec<u8>,
    /// The comment, shown by `nft list`.
    pub comment: Option<String>,
}

/// One operation on a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `add table`.
    AddTable {
        /// Table comment.
        comment: Option<String>,
    },
    /// `delete table` (with everything in it).
    DeleteTable,
    /// `add chain`.
    AddChain {
        /// Chain name.
        chain: String,
        /// For base chains: the hook.
        base: Option<BaseChain>,
        /// Chain comment.
        comment: Option<String>,
    },
    /// `flush chain`.
    FlushChain {
        /// Chain name.
        chain: String,
    },
    /// `delete chain`.
    DeleteChain {
        /// Chain name.
        chain: String,
    },
    /// `add set` / `add map`.
    AddSet {
        /// Set name.
        set: String,
        /// Declaration.
        spec: SetSpec,
    },
    /// `flush set` / `flush map`.
    FlushSet {
        /// Set name.
        set: String,
    },
    /// `delete set` / `delete map`.
    DeleteSet {
        /// Set name.
        set: String,
    },
    /// `add rule`.
    AddRule {
        /// Chain name.
        chain: String,
        /// The rule's expressions.
        exprs: Vec<Expr>,
        /// Rule comment.
        comment: Option<String>,
        /// The anonymous set or map the rule looks up, created just before it.
        anonymous: Option<AnonymousSet>,
    },
    /// `add element` (one element).
    AddElement {
        /// Set name.
        set: String,
        /// The key, encoded.
        key: Vec<u8>,
        /// The value, for verdict maps.
        verdict: Option<Verdict>,
        /// Element comment.
        comment: Option<String>,
    },
    /// `delete element` (one element).
    DeleteElement {
        /// Set name.
        set: String,
        /// The key, encoded.
        key: Vec<u8>,
    },
    /// `add counter` (a named counter).
    AddCounter {
        /// Counter name.
        counter: String,
    },
    /// `delete counter`.
    DeleteCounter {
        /// Counter name.
        counter: String,
    },
}

/// An anonymous (constant) set or map, as nft creates one for `{ ... }` in a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnonymousSet {
    /// Address prefixes: an interval set, with the elements nft sends for it (see
    /// [`IntervalMark`]).
    Prefixes {
        /// The table's family (the key type).
        family: Family,
        /// Whether the rule matches the source (else destination) address.
        source: bool,
        /// Keys in ascending order.
        elements: Vec<(Vec<u8>, IntervalMark)>,
    },
    /// `numgen ... vmap { i : verdict, ... }`: integer keys (host order).
    NumgenMap {
        /// Key `i` maps to `verdicts[i]`.
        verdicts: Vec<Verdict>,
    },
}

/// One command, ready for [`Batch::push`](crate::codec::Batch::push).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lowered {
    /// The table's family.
    pub family: Family,
    /// The table.
    pub table: &'static str,
    /// What to do.
    pub op: Op,
}

/// The netlink family of an IP family.
pub fn family(family: IpFamily) -> Family {
    match family {
        IpFamily::V4 => Family::Ipv4,
        IpFamily::V6 => Family::Ipv6,
    }
}

/// Translate one command on `ip_family`'s table.
pub fn lower(ip_family: IpFamily, command: &Command) -> Result<Lowered, LowerError> {
    let fam = family(ip_family);
    lower_op(fam, command)
        .map(|op| Lowered {
            family: fam,
            table: TABLE,
            op,
        })
        .ok_or_else(|| LowerError {
            statement: command.display(ip_family).to_string(),
        })
}

fn lower_op(family: Family, command: &Command) -> Option<Op> {
    Some(match command {
        Command::AddTable { comment } => Op::AddTable {
            comment: comment.clone(),
        },
        Command::DeleteTable => Op::DeleteTable,
        Command::AddChain {
            chain,
            hook,
            comment,
        } => Op::AddChain {
            chain: chain.to_string(),
            base: match hook {
                Some(hook) => Some(BaseChain {
                    kind: match hook.kind {
                        "filter" => "filter",
                        "nat" => "nat",
                        _ => return None,
                    },
                    hook: match hook.hook {
                        "prerouting" => 0,
                        "input" => 1,
                        "forward" => 2,
                        "output" => 3,
                        "postrouting" => 4,
                        _ => return None,
                    },
                    priority: hook.priority,
                }),
                None => None,
            },
            comment: comment.clone(),
        },
        Command::FlushChain(chain) => Op::FlushChain {
            chain: chain.to_string(),
        },
        Command::DeleteChain(chain) => Op::DeleteChain {
            chain: chain.to_string(),
        },
        Command::AddSet { set, kind, comment } => Op::AddSet {
            set: set.to_string(),
            spec: set_spec(family, *kind, comment.clone())?,
        },
        Command::FlushSet { set, .. } => Op::FlushSet {
            set: set.to_string(),
        },
        Command::DeleteSet(set) => Op::DeleteSet {
            set: set.to_string(),
        },
        Command::AddRule { chain, rule } => {
            let (exprs, anonymous) = lower_rule(family, rule)?;
            Op::AddRule {
                chain: chain.to_string(),
                exprs,
                comment: rule.comment.as_deref().map(str::to_owned),
                anonymous,
            }
        }
        Command::AddElement { set, key, value } => Op::AddElement {
            set: set.to_string(),
            key: key_bytes(family, key.parts())?,
            verdict: value.verdict.as_ref().map(verdict),
            comment: value.comment.clone(),
        },
        Command::DeleteElement { set, key } => Op::DeleteElement {
            set: set.to_string(),
            key: key_bytes(family, key.parts())?,
        },
        Command::AddCounter(counter) => Op::AddCounter {
            counter: counter.to_string(),
        },
        Command::DeleteCounter(counter) => Op::DeleteCounter {
            counter: counter.to_string(),
        },
    })
}

fn verdict(verdict: &cmd::Verdict) -> Verdict {
    match verdict {
        cmd::Verdict::Drop => Verdict::Drop,
        cmd::Verdict::Accept => Verdict::Accept,
        cmd::Verdict::Return => Verdict::Return,
        cmd::Verdict::Jump(chain) => Verdict::Jump(chain.to_string()),
        cmd::Verdict::Goto(chain) => Verdict::Goto(chain.to_string()),
    }
}

/// A set's declaration: address sets (dynamic ones with a timeout) and verdict maps.
fn set_spec(family: Family, kind: SetKind, comment: Option<String>) -> Option<SetSpec> {
    let (addr_type, addr_len) = match family {
        Family::Ipv4 => (TYPE_IPV4_ADDR, 4),
        Family::Ipv6 => (TYPE_IPV6_ADDR, 16),
    };
    Some(match kind {
        SetKind::Addresses { timeout } => SetSpec {
            flags: if timeout.is_some() {
                SET_TIMEOUT | SET_EVAL
            } else {
                0
            },
            key_type: addr_type,
            key_len: addr_len,
            data: None,
            timeout_ms: match timeout {
                Some(seconds) => Some(seconds.checked_mul(1000)?),
                None => None,
            },
            size: None,
            udata_prefix: key_byteorder_big_endian(),
            comment,
        },
        SetKind::VerdictMap(key) => {
            let (key_type, key_len) = match key {
                MapKey::AddrProtoPort => (
                    concat_type(&[addr_type, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
                    addr_len + 8,
                ),
                MapKey::ProtoPort => (concat_type(&[TYPE_INET_PROTO, TYPE_INET_SERVICE]), 8),
            };
            SetSpec {
                flags: SET_MAP,
                key_type,
                key_len,
                data: Some((TYPE_VERDICT, 0)),
                timeout_ms: None,
                size: None,
                udata_prefix: map_udata_prefix(),
                comment,
            }
        }
        SetKind::ProtoPorts => SetSpec {
            flags: 0,
            key_type: concat_type(&[TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            key_len: 8,
            data: None,
            timeout_ms: None,
            size: None,
            // Key byte order unset, as for the maps' concatenations.
            udata_prefix: udata_u32s(&[(&[0, 4], 0, &[])]),
            comment,
        },
    })
}

/// An element key: each part of a concatenation takes a multiple of 4 bytes, as the kernel
/// lays registers out.
fn key_bytes(family: Family, parts: KeyParts) -> Option<Vec<u8>> {
    let mut key = Vec::with_capacity(24);
    match parts {
        KeyParts::Addr(addr) => key.extend(family_addr(family, addr)?),
        KeyParts::AddrProtoPort(addr, proto, port) => {
            key.extend(family_addr(family, addr)?);
            push_proto_port(&mut key, proto, port);
        }
        KeyParts::ProtoPort(proto, port) => push_proto_port(&mut key, proto, port),
    }
    Some(key)
}

fn push_proto_port(key: &mut Vec<u8>, proto: Protocol, port: u16) {
    key.extend_from_slice(&[protocol_number(proto), 0, 0, 0]);
    key.extend_from_slice(&port.to_be_bytes());
    key.extend_from_slice(&[0, 0]);
}

pub(crate) fn protocol_number(proto: Protocol) -> u8 {
    match proto {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

/// The bytes of `addr` if it is of `family`.
pub(crate) fn family_addr(family: Family, addr: IpAddr) -> Option<Vec<u8>> {
    match (family, addr) {
        (Family::Ipv4, IpAddr::V4(v4)) => Some(v4.octets().to_vec()),
        (Family::Ipv6, IpAddr::V6(v6)) => Some(v6.octets().to_vec()),
        _ => None,
    }
}

/// Header offset and length of the source or destination address.
pub(crate) fn addr_offset(family: Family, field: AddrField) -> (u32, u32) {
    match (family, field) {
        (Family::Ipv4, AddrField::Source) => (12, 4),
        (Family::Ipv4, AddrField::Destination) => (16, 4),
        (Family::Ipv6, AddrField::Source) => (8, 16),
        (Family::Ipv6, AddrField::Destination) => (24, 16),
    }
}

/// `meta l4proto <proto>`.
pub(crate) fn match_proto(exprs: &mut Vec<Expr>, proto: Protocol) {
    exprs.push(Expr::Meta {
        key: META_L4PROTO,
        dreg: REG_1,
    });
    exprs.push(Expr::Cmp {
        sreg: REG_1,
        op: CmpOp::Eq,
        data: vec![protocol_number(proto)],
    });
}

/// Load the whole source or destination address into the first register.
pub(crate) fn load_addr(exprs: &mut Vec<Expr>, family: Family, field: AddrField) {
    load_addr_to(exprs, family, field, REG_1);
}

/// Load the whole source or destination address into `dreg`.
pub(crate) fn load_addr_to(exprs: &mut Vec<Expr>, family: Family, field: AddrField, dreg: u32) {
    let (offset, len) = addr_offset(family, field);
    exprs.push(Expr::Payload {
        base: PAYLOAD_NETWORK,
        offset,
        len,
        dreg,
    });
}

/// Match an address against a host or prefix, as nft compiles it: a whole-byte prefix
/// loads only its bytes; any other prefix (and /0) loads the address and masks it.
pub(crate) fn match_prefix(
    exprs: &mut Vec<Expr>,
    family: Family,
    field: AddrField,
    op: CmpOp,
    net: IpNet,
) -> Option<()> {
    let (offset, len) = addr_offset(family, field);
    let bytes = family_addr(family, net.addr())?;
    let prefix = u32::from(net.prefix_len());
    let mask: Vec<u8> = (0..len)
        .map(|i| {
            let bits = prefix.saturating_sub(i * 8).min(8);
            (0xffu16 << (8 - bits)) as u8
        })
        .collect();
    // The renderer writes canonical (truncated) prefixes; anything else is not ours.
    if bytes.iter().zip(&mask).any(|(b, m)| b & !m != 0) {
        return None;
    }
    if prefix % 8 == 0 && prefix > 0 {
        let n = prefix / 8;
        exprs.push(Expr::Payload {
            base: PAYLOAD_NETWORK,
            offset,
            len: n,
            dreg: REG_1,
        });
        exprs.push(Expr::Cmp {
            sreg: REG_1,
            op,
            data: bytes[..n as usize].to_vec(),
        });
    } else {
        exprs.push(Expr::Payload {
            base: PAYLOAD_NETWORK,
            offset,
            len,
            dreg: REG_1,
        });
        exprs.push(Expr::Bitwise {
            sreg: REG_1,
            dreg: REG_1,
            xor: vec![0; mask.len()],
            mask,
        });
        exprs.push(Expr::Cmp {
            sreg: REG_1,
            op,
            data: bytes,
        });
    }
    Some(())
}

/// `iifname [!=] "name"` or `"prefix*"`.
pub(crate) fn match_iifname(
    exprs: &mut Vec<Expr>,
    op: CmpOp,
    name: &str,
    wildcard: bool,
) -> Option<()> {
    if name.is_empty() || name.contains(['*', '"', '\\']) {
        return None;
    }
    let data = if wildcard {
        name.as_bytes().to_vec()
    } else {
        // IFNAMSIZ, NUL-padded.
        if name.len() >= 16 {
            return None;
        }
        let mut data = name.as_bytes().to_vec();
        data.resize(16, 0);
        data
    };
    exprs.push(Expr::Meta {
        key: META_IIFNAME,
        dreg: REG_1,
    });
    exprs.push(Expr::Cmp {
        sreg: REG_1,
        op,
        data,
    });
    Some(())
}

fn cmp_op(negate: bool) -> CmpOp {
    if negate { CmpOp::Neq } else { CmpOp::Eq }
}

/// A rule's expressions, and the anonymous set it looks up (at most one, as nft allows).
fn lower_rule(family: Family, rule: &Rule) -> Option<(Vec<Expr>, Option<AnonymousSet>)> {
    let mut exprs = Vec::new();
    let mut anonymous = None;
    for m in &rule.matches {
        match m {
            Match::Addr {
                field,
                negate,
                value,
            } => match_prefix(&mut exprs, family, *field, cmp_op(*negate), value.net())?,
            Match::AddrIn {
                field,
                negate,
                nets,
            } => {
                let items = nets
                    .iter()
                    .map(|net| prefix_item(family, net))
                    .collect::<Option<Vec<_>>>()?;
                match items.as_slice() {
                    [] => return None,
                    // nft compiles a one-element set as a plain match.
                    [_] => match_prefix(&mut exprs, family, *field, cmp_op(*negate), nets[0])?,
                    _ => {
                        if anonymous.is_some() {
                            return None;
                        }
                        load_addr(&mut exprs, family, *field);
                        exprs.push(Expr::LookupAnonymous {
                            sreg: REG_1,
                            dreg: None,
                            invert: *negate,
                        });
                        anonymous = Some(AnonymousSet::Prefixes {
                            family,
                            source: *field == AddrField::Source,
                            elements: prefix_intervals(family, &items),
                        });
                    }
                }
            }
            Match::AddrInSet { field, set } => {
                load_addr(&mut exprs, family, *field);
                exprs.push(Expr::Lookup {
                    set_id: None,
                    set: set.to_string(),
                    sreg: REG_1,
                    dreg: None,
                });
            }
            Match::Iifname {
                negate,
                name,
                wildcard,
            } => match_iifname(&mut exprs, cmp_op(*negate), name, *wildcard)?,
            Match::FibLocal(field) => {
                exprs.push(Expr::FibAddrType {
                    flags: if *field == AddrField::Source { 1 } else { 2 },
                    dreg: REG_1,
                });
                // RTN_LOCAL, host order.
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: 2u32.to_ne_bytes().to_vec(),
                });
            }
            Match::CtStateNew => {
                exprs.push(Expr::CtState { dreg: REG_1 });
                exprs.push(Expr::Bitwise {
                    sreg: REG_1,
                    dreg: REG_1,
                    mask: CT_STATE_NEW.to_ne_bytes().to_vec(),
                    xor: vec![0; 4],
                });
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Neq,
                    data: vec![0; 4],
                });
            }
            Match::MarkAnd { mask, value } => {
                exprs.push(Expr::Meta {
                    key: META_MARK,
                    dreg: REG_1,
                });
                exprs.push(Expr::Bitwise {
                    sreg: REG_1,
                    dreg: REG_1,
                    mask: mask.to_ne_bytes().to_vec(),
                    xor: vec![0; 4],
                });
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: value.to_ne_bytes().to_vec(),
                });
            }
            Match::L4Proto(proto) => {
                match_proto(&mut exprs, *proto);
            }
            Match::ProtoPortInSet(set) => {
                push_proto_port_load(&mut exprs, 0);
                exprs.push(Expr::Lookup {
                    set_id: None,
                    set: set.to_string(),
                    sreg: REG_1,
                    dreg: None,
                });
            }
            Match::Numgen { modulus, value } => {
                if *modulus == 0 || value >= modulus {
                    return None;
                }
                exprs.push(Expr::NumgenRandom {
                    dreg: REG_1,
                    modulus: *modulus,
                });
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: value.to_ne_bytes().to_vec(),
                });
            }
        }
    }
    match &rule.action {
        Action::Verdict(v) => exprs.push(Expr::Immediate(verdict(v))),
        Action::Vmap { key, map } => {
            let offset = match key {
                MapKey::AddrProtoPort => {
                    let (_, len) = addr_offset(family, AddrField::Destination);
                    load_addr(&mut exprs, family, AddrField::Destination);
                    len
                }
                MapKey::ProtoPort => 0,
            };
            push_proto_port_load(&mut exprs, offset);
            exprs.push(Expr::Lookup {
                set_id: None,
                set: map.to_string(),
                sreg: REG_1,
                dreg: Some(REG_VERDICT),
            });
        }
        Action::NumgenVmap(chains) => {
            let modulus = u32::try_from(chains.len()).ok().filter(|m| *m > 0)?;
            if anonymous.is_some() {
                return None;
            }
            exprs.push(Expr::NumgenRandom {
                dreg: REG_1,
                modulus,
            });
            exprs.push(Expr::LookupAnonymous {
                sreg: REG_1,
                dreg: Some(REG_VERDICT),
                invert: false,
            });
            anonymous = Some(AnonymousSet::NumgenMap {
                verdicts: chains
                    .iter()
                    .map(|chain| Verdict::Goto(chain.to_string()))
                    .collect(),
            });
        }
        Action::Reject => exprs.push(reject(family)),
        Action::CountedReject { counter, tcp_reset } => {
            exprs.push(Expr::CounterRef {
                name: counter.to_string(),
            });
            exprs.push(if *tcp_reset {
                Expr::RejectTcpReset
            } else {
                reject(family)
            });
        }
        Action::Masquerade { fully_random } => exprs.push(Expr::Masquerade {
            flags: fully_random.then_some(NAT_RANGE_PROTO_RANDOM_FULLY),
        }),
        Action::MarkOr(value) | Action::MarkXor(value) => {
            // nft computes `mark | v` as `(mark & !v) ^ v` and `mark ^ v` as
            // `(mark & all) ^ v`.
            let mask = if matches!(rule.action, Action::MarkOr(_)) {
                !value
            } else {
                u32::MAX
            };
            exprs.push(Expr::Meta {
                key: META_MARK,
                dreg: REG_1,
            });
            exprs.push(Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: mask.to_ne_bytes().to_vec(),
                xor: value.to_ne_bytes().to_vec(),
            });
            exprs.push(Expr::MetaSet {
                key: META_MARK,
                sreg: REG_1,
            });
        }
        Action::UpdateSourceSet(set) => {
            load_addr(&mut exprs, family, AddrField::Source);
            exprs.push(Expr::DynsetUpdate {
                set: set.to_string(),
                set_id: None,
                sreg_key: REG_1,
                sreg_data: None,
            });
        }
        Action::Dnat { addr, port } => {
            exprs.push(Expr::ImmediateData {
                dreg: REG_1,
                data: family_addr(family, *addr)?,
            });
            exprs.push(Expr::ImmediateData {
                dreg: REG_2,
                data: port.to_be_bytes().to_vec(),
            });
            exprs.push(Expr::Dnat {
                family: u32::from(family.nfproto()),
                reg_addr: REG_1,
                reg_proto: REG_2,
            });
        }
    }
    Some((exprs, anonymous))
}

/// The family's `reject`: port unreachable.
fn reject(family: Family) -> Expr {
    Expr::Reject {
        icmp_code: match family {
            // ICMP_PORT_UNREACH, ICMPV6_PORT_UNREACH.
            Family::Ipv4 => 3,
            Family::Ipv6 => 4,
        },
    }
}

/// A prefix of an anonymous set: `(address, prefix length)`, canonical only.
fn prefix_item(family: Family, net: &IpNet) -> Option<(u128, u32)> {
    let value = match (family, net.addr()) {
        (Family::Ipv4, IpAddr::V4(v4)) => u128::from(u32::from(v4)),
        (Family::Ipv6, IpAddr::V6(v6)) => u128::from(v6),
        _ => return None,
    };
    let prefix = u32::from(net.prefix_len());
    (*net == net.trunc()).then_some((value, prefix))
}

/// nft's data type ids.
pub(crate) const TYPE_IPV4_ADDR: u32 = 7;
pub(crate) const TYPE_IPV6_ADDR: u32 = 8;
/// `NFT_SET_TIMEOUT`.
pub(crate) const SET_TIMEOUT: u32 = 0x10;
/// `NFT_SET_EVAL`: the set is updated from the packet path (`dynamic`).
pub(crate) const SET_EVAL: u32 = 0x20;
/// libnftnl user data: the key's byte order is big endian (`NFTNL_UDATA_SET_KEYBYTEORDER`,
/// `BYTEORDER_BIG_ENDIAN`, as a host-order `u32`).
fn key_byteorder_big_endian() -> Vec<u8> {
    let mut out = vec![0u8, 4];
    out.extend_from_slice(&2u32.to_ne_bytes());
    out
}

/// One element nft sends for an interval set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntervalMark {
    /// The first key of an interval.
    Start,
    /// The first key of an interval that runs to the top of the address space (it has no
    /// end element; nft flags it in the element's user data).
    StartOpen,
    /// The first key after an interval.
    End,
}

fn family_bits(family: Family) -> u32 {
    match family {
        Family::Ipv4 => 32,
        Family::Ipv6 => 128,
    }
}

/// The elements nft sends for an interval set of `items`: overlapping and adjacent
/// intervals merged; a leading end at zero unless the first interval starts there; no end
/// after an interval that reaches the top.
fn prefix_intervals(family: Family, items: &[(u128, u32)]) -> Vec<(Vec<u8>, IntervalMark)> {
    let bits = family_bits(family);
    let max = if bits == 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    };
    let mut ranges: Vec<(u128, u128)> = items
        .iter()
        .map(|(value, prefix)| {
            let span = if *prefix == 0 {
                max
            } else {
                (1u128 << (bits - prefix)) - 1
            };
            (*value, value + span)
        })
        .collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u128, u128)> = Vec::new();
    for (start, end) in ranges {
        match merged.last_mut() {
            Some(last) if start <= last.1.saturating_add(1) => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let key = |value: u128| -> Vec<u8> { value.to_be_bytes()[16 - (bits as usize / 8)..].to_vec() };
    let mut elements = Vec::new();
    if merged.first().is_some_and(|first| first.0 != 0) {
        elements.push((key(0), IntervalMark::End));
    }
    for (start, end) in merged {
        if end == max {
            elements.push((key(start), IntervalMark::StartOpen));
        } else {
            elements.push((key(start), IntervalMark::Start));
            elements.push((key(end + 1), IntervalMark::End));
        }
    }
    elements
}

/// `ct state new`: the `NF_CT_STATE_BIT(IP_CT_NEW)` bit.
const CT_STATE_NEW: u32 = 8;
/// `NF_NAT_RANGE_PROTO_RANDOM_FULLY`.
const NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;

/// The register holding byte `offset` of a concatenation: a 16-byte register when the
/// offset is aligned to one (as nft picks), else a 4-byte one (`NFT_REG32_00` is 8).
pub(crate) fn concat_register(offset: u32) -> u32 {
    if offset.is_multiple_of(16) {
        offset / 16 + 1
    } else {
        8 + offset / 4
    }
}

/// `meta l4proto . th dport`, loaded after `offset` bytes of a concatenation.
pub(crate) fn push_proto_port_load(exprs: &mut Vec<Expr>, offset: u32) {
    exprs.push(Expr::Meta {
        key: META_L4PROTO,
        dreg: concat_register(offset),
    });
    exprs.push(Expr::Payload {
        base: PAYLOAD_TRANSPORT,
        offset: 2,
        len: 2,
        dreg: concat_register(offset + 4),
    });
}

/// nft's id of a concatenated type: each part's id shifted in 6 bits at a time.
pub(crate) fn concat_type(parts: &[u32]) -> u32 {
    parts.iter().fold(0, |acc, part| (acc << 6) | part)
}

pub(crate) const TYPE_INET_PROTO: u32 = 12;
pub(crate) const TYPE_INET_SERVICE: u32 = 13;
/// nft's id of the verdict type.
const TYPE_VERDICT: u32 = 0xffff_ff00;
/// `NFT_SET_MAP`.
pub(crate) const SET_MAP: u32 = 0x8;

/// The user data nft 1.0.6 writes for our verdict maps before their comment: key and data
/// byte order unset, the concatenation's typeof record, no data interval.
fn map_udata_prefix() -> Vec<u8> {
    udata_u32s(&[
        (&[0, 4], 0, &[]),
        (&[1, 4], 0, &[]),
        (&[3, 8, 0, 4], TYPE_INET_SERVICE, &[1, 0]),
        (&[6, 4], 0, &[]),
    ])
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use kp_rules::nftables::cmd::{Addr, ElementKey, ElementValue, Name};

    use super::*;

    fn net(text: &str) -> IpNet {
        text.parse()
            .or_else(|_| text.parse::<IpAddr>().map(IpNet::from))
            .expect("prefix or address")
    }

    fn rule(matches: Vec<Match>, action: Action) -> Command {
        Command::AddRule {
            chain: Name::Fixed("c"),
            rule: Rule::new(matches, action),
        }
    }

    fn lowered_rule(family: IpFamily, command: &Command) -> (Vec<Expr>, Option<AnonymousSet>) {
        match lower(family, command).expect("supported").op {
            Op::AddRule {
                exprs, anonymous, ..
            } => (exprs, anonymous),
            other => panic!("{other:?}"),
        }
    }

    fn drop_from(nets: &[&str]) -> Command {
        rule(
            vec![Match::AddrIn {
                field: AddrField::Source,
                negate: true,
                nets: nets.iter().map(|n| net(n)).collect(),
            }],
            Action::Verdict(cmd::Verdict::Drop),
        )
    }

    #[test]
    fn values_nft_would_not_send_are_refused_with_the_statement() {
        let goto = || Action::Verdict(cmd::Verdict::Goto(Name::Fixed("a")));
        for command in [
            // Prefixes that are not canonical.
            drop_from(&["10.0.0.1/8", "192.0.2.1"]),
            drop_from(&["0.0.0.1/0"]),
            rule(
                vec![Match::Addr {
                    field: AddrField::Source,
                    negate: false,
                    value: Addr::Net(net("10.0.0.1/8")),
                }],
                goto(),
            ),
            // An address of the other family.
            rule(
                vec![Match::Addr {
                    field: AddrField::Source,
                    negate: false,
                    value: Addr::Host(IpAddr::V6(Ipv6Addr::LOCALHOST)),
                }],
                goto(),
            ),
            // Interface names the kernel cannot match as nft would.
            rule(
                vec![Match::Iifname {
                    negate: false,
                    name: "a-name-longer-than-15".into(),
                    wildcard: false,
                }],
                goto(),
            ),
            rule(
                vec![Match::Iifname {
                    negate: false,
                    name: "x*".into(),
                    wildcard: true,
                }],
                goto(),
            ),
            rule(
                vec![Match::Numgen {
                    modulus: 2,
                    value: 2,
                }],
                goto(),
            ),
            rule(Vec::new(), Action::NumgenVmap(Vec::new())),
            // Two anonymous sets in one rule.
            rule(
                vec![Match::AddrIn {
                    field: AddrField::Source,
                    negate: false,
                    nets: vec![net("10.0.0.0/8"), net("192.0.2.0/24")],
                }],
                Action::NumgenVmap(vec![Name::Fixed("a"), Name::Fixed("b")]),
            ),
        ] {
            let err = lower(IpFamily::V4, &command).expect_err("refused");
            assert_eq!(err.statement, command.display(IpFamily::V4).to_string());
        }
    }

    #[test]
    fn element_keys_are_laid_out_in_registers() {
        let add = Command::AddElement {
            set: Name::Fixed("service-ips"),
            key: ElementKey::new(KeyParts::AddrProtoPort(
                IpAddr::V6("fd00::1".parse().expect("v6")),
                Protocol::Sctp,
                443,
            )),
            value: ElementValue {
                verdict: Some(cmd::Verdict::Goto(Name::Fixed("service-X"))),
                comment: Some("ns/a:p".into()),
            },
        };
        assert_eq!(
            add.display(IpFamily::V6).to_string(),
            "add element ip6 kube-proxy service-ips { fd00::1 . sctp . 443 comment \"ns/a:p\" : goto service-X }"
        );
        let Op::AddElement {
            key,
            verdict,
            comment,
            ..
        } = lower(IpFamily::V6, &add).expect("supported").op
        else {
            panic!("not an element");
        };
        let mut expected = vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        expected.extend([132, 0, 0, 0, 0x01, 0xbb, 0, 0]);
        assert_eq!(key, expected);
        assert_eq!(verdict, Some(Verdict::Goto("service-X".into())));
        assert_eq!(comment.as_deref(), Some("ns/a:p"));
        let delete = Command::DeleteElement {
            set: Name::Fixed("service-nodeports"),
            key: ElementKey::new(KeyParts::ProtoPort(Protocol::Udp, 30053)),
        };
        assert_eq!(
            lower(IpFamily::V4, &delete).expect("supported").op,
            Op::DeleteElement {
                set: "service-nodeports".into(),
                key: vec![17, 0, 0, 0, 0x75, 0x65, 0, 0],
            }
        );
    }

    #[test]
    fn anonymous_prefix_sets_are_intervals_merged_as_nft_merges_them() {
        let (exprs, anonymous) = lowered_rule(
            IpFamily::V4,
            &drop_from(&["10.0.0.2/31", "10.0.0.1", "192.0.2.0/24"]),
        );
        let Some(AnonymousSet::Prefixes {
            elements, source, ..
        }) = anonymous
        else {
            panic!("{anonymous:?}");
        };
        assert!(source);
        assert!(matches!(
            exprs[1],
            Expr::LookupAnonymous {
                invert: true,
                dreg: None,
                ..
            }
        ));
        use IntervalMark::*;
        assert_eq!(
            elements,
            vec![
                (vec![0, 0, 0, 0], End),
                (vec![10, 0, 0, 1], Start),
                (vec![10, 0, 0, 4], End),
                (vec![192, 0, 2, 0], Start),
                (vec![192, 0, 3, 0], End),
            ]
        );
        // From zero, and to the top: no leading end, no final end.
        let (_, anonymous) = lowered_rule(IpFamily::V4, &drop_from(&["0.0.0.0/2", "192.0.0.0/2"]));
        let Some(AnonymousSet::Prefixes { elements, .. }) = anonymous else {
            panic!("{anonymous:?}");
        };
        assert_eq!(
            elements,
            vec![
                (vec![0, 0, 0, 0], Start),
                (vec![64, 0, 0, 0], End),
                (vec![192, 0, 0, 0], StartOpen),
            ]
        );
        // One element is a plain match, as nft compiles it.
        let (exprs, anonymous) = lowered_rule(IpFamily::V4, &drop_from(&["0.0.0.0/0"]));
        assert_eq!(anonymous, None);
        assert_eq!(
            exprs[1],
            Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: vec![0; 4],
                xor: vec![0; 4]
            }
        );
    }

    #[test]
    fn prefixes_compile_as_nft_compiles_them() {
        let matching = |negate: bool, prefix: &str| {
            rule(
                vec![Match::Addr {
                    field: AddrField::Source,
                    negate,
                    value: Addr::Net(net(prefix)),
                }],
                Action::Verdict(cmd::Verdict::Goto(Name::Fixed("a"))),
            )
        };
        // A whole-byte prefix loads only its bytes.
        let (exprs, _) = lowered_rule(IpFamily::V4, &matching(false, "10.1.0.0/16"));
        assert_eq!(
            exprs[..2],
            [
                Expr::Payload {
                    base: PAYLOAD_NETWORK,
                    offset: 12,
                    len: 2,
                    dreg: REG_1
                },
                Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: vec![10, 1]
                }
            ]
        );
        // Any other prefix is masked.
        let (exprs, _) = lowered_rule(IpFamily::V4, &matching(true, "10.16.0.0/12"));
        assert_eq!(
            exprs[1],
            Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: vec![0xff, 0xf0, 0, 0],
                xor: vec![0; 4]
            }
        );
        assert!(matches!(exprs[2], Expr::Cmp { op: CmpOp::Neq, .. }));
        // A host is its whole address.
        let host = rule(
            vec![Match::Addr {
                field: AddrField::Destination,
                negate: false,
                value: Addr::Host(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7))),
            }],
            Action::Verdict(cmd::Verdict::Drop),
        );
        let (exprs, _) = lowered_rule(IpFamily::V4, &host);
        assert_eq!(
            exprs[0],
            Expr::Payload {
                base: PAYLOAD_NETWORK,
                offset: 16,
                len: 4,
                dreg: REG_1
            }
        );
    }
}
