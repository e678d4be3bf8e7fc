//! The nf_tables expressions our rules use, and verdicts. Registers are the 16-byte ones
//! (`NFT_REG_1`, `NFT_REG_2`) nft uses; data is in network byte order except where the
//! kernel takes host order (meta, numgen, fib results).

use crate::codec::Writer;

/// The verdict register.
pub const REG_VERDICT: u32 = 0;
/// The first data register.
pub const REG_1: u32 = 1;
/// The second data register.
pub const REG_2: u32 = 2;

/// A verdict, in a rule (`immediate`) or as the value of a verdict map element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// `accept`.
    Accept,
    /// `drop`.
    Drop,
    /// `return`.
    Return,
    /// `jump <chain>`.
    Jump(String),
    /// `goto <chain>`.
    Goto(String),
}

impl Verdict {
    /// The kernel's verdict code (`NF_DROP`, `NF_ACCEPT`, `NFT_JUMP`, ...).
    pub fn code(&self) -> i32 {
        match self {
            Verdict::Drop => 0,
            Verdict::Accept => 1,
            Verdict::Return => -5,
            Verdict::Jump(_) => -3,
            Verdict::Goto(_) => -4,
        }
    }

    /// The target chain of a jump or goto.
    pub fn chain(&self) -> Option<&str> {
        match self {
            Verdict::Jump(chain) | Verdict::Goto(chain) => Some(chain),
            _ => None,
        }
    }
}

/// `NFT_PAYLOAD_NETWORK_HEADER`.
pub const PAYLOAD_NETWORK: u32 = 1;
/// `NFT_PAYLOAD_TRANSPORT_HEADER`.
pub const PAYLOAD_TRANSPORT: u32 = 2;

/// `NFT_META_MARK`.
pub const META_MARK: u32 = 3;
/// `NFT_META_IIFNAME`.
pub const META_IIFNAME: u32 = 6;
/// `NFT_META_L4PROTO`.
pub const META_L4PROTO: u32 = 16;

/// `NFT_CT_PROTO_DST`: the destination port (2 bytes, network order).
pub const CT_PROTO_DST: u32 = 12;
/// `NFT_CT_DST_IP`: the IPv4 destination address.
pub const CT_DST_IP: u32 = 20;
/// `NFT_CT_DST_IP6`: the IPv6 destination address.
pub const CT_DST_IP6: u32 = 22;

/// The first of the 4-byte data registers (`NFT_REG32_00`); `REG32_00 + n` is the n-th.
/// A concatenation is consecutive 4-byte registers, each field padded to 4 bytes, so a
/// lookup's data written into them can be part of the next lookup's key.
pub const REG32_00: u32 = 8;

/// Comparison operators of `cmp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    /// `NFT_CMP_EQ`.
    Eq = 0,
    /// `NFT_CMP_NEQ`.
    Neq = 1,
}

/// One expression of a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    /// Load `len` bytes at `offset` of a header into `dreg`.
    Payload {
        /// [`PAYLOAD_NETWORK`] or [`PAYLOAD_TRANSPORT`].
        base: u32,
        /// Byte offset in that header.
        offset: u32,
        /// Bytes to load.
        len: u32,
        /// Destination register.
        dreg: u32,
    },
    /// Compare `sreg` with `data`; the rule stops here when it does not hold.
    Cmp {
        /// Source register.
        sreg: u32,
        /// Operator.
        op: CmpOp,
        /// What to compare with (its length is the length compared).
        data: Vec<u8>,
    },
    /// `dreg = (sreg & mask) ^ xor`.
    Bitwise {
        /// Source register.
        sreg: u32,
        /// Destination register.
        dreg: u32,
        /// AND mask.
        mask: Vec<u8>,
        /// XOR value (same length).
        xor: Vec<u8>,
    },
    /// Load a meta key into `dreg`.
    Meta {
        /// `NFT_META_*`.
        key: u32,
        /// Destination register.
        dreg: u32,
    },
    /// Look `sreg` up in a set (a match), or in a map (`dreg`: the verdict register or a
    /// data register). A set created in the same batch is also referred to by its batch id,
    /// as nft sends it.
    Lookup {
        /// The set's name.
        set: String,
        /// Its batch id, when the same batch creates it.
        set_id: Option<u32>,
        /// Source register.
        sreg: u32,
        /// Destination register, for maps.
        dreg: Option<u32>,
    },
    /// Look `sreg` up in the rule's anonymous set or map (created in the same batch, so
    /// referred to by its batch id).
    LookupAnonymous {
        /// Source register.
        sreg: u32,
        /// Destination register, for maps.
        dreg: Option<u32>,
        /// Match when the key is absent (`!=`).
        invert: bool,
    },
    /// `update @set { <sreg_key> }` (`: <sreg_data>` for a map): add the key or refresh
    /// its timeout.
    DynsetUpdate {
        /// The set's name.
        set: String,
        /// Its batch id, when the same batch creates it.
        set_id: Option<u32>,
        /// Register holding the key.
        sreg_key: u32,
        /// For a map, the register holding the data.
        sreg_data: Option<u32>,
    },
    /// `numgen random mod <modulus>` into `dreg`.
    NumgenRandom {
        /// Destination register.
        dreg: u32,
        /// Modulus.
        modulus: u32,
    },
    /// `fib <saddr|daddr> type` into `dreg`.
    FibAddrType {
        /// `NFTA_FIB_F_SADDR` (1) or `NFTA_FIB_F_DADDR` (2).
        flags: u32,
        /// Destination register.
        dreg: u32,
    },
    /// Load a constant into a data register.
    ImmediateData {
        /// Destination register.
        dreg: u32,
        /// The value.
        data: Vec<u8>,
    },
    /// End the rule with a verdict.
    Immediate(Verdict),
    /// Load conntrack state into `dreg`.
    CtState {
        /// Destination register.
        dreg: u32,
    },
    /// Load the connection's status bits (`ct status`) into `dreg`.
    CtStatus {
        /// Destination register.
        dreg: u32,
    },
    /// Load a key of the connection's original direction (`ct original ip daddr`,
    /// `ct original proto-dst`) into `dreg`.
    CtOriginal {
        /// `NFT_CT_*`: [`CT_DST_IP`], [`CT_PROTO_DST`].
        key: u32,
        /// Destination register.
        dreg: u32,
    },
    /// Set a meta key (the mark) from `sreg`.
    MetaSet {
        /// `NFT_META_*`.
        key: u32,
        /// Source register.
        sreg: u32,
    },
    /// `masquerade`, with `NF_NAT_RANGE_*` flags (`fully-random`) or none.
    Masquerade {
        /// Flags, if any.
        flags: Option<u32>,
    },
    /// `reject`: ICMP(v6) port unreachable.
    Reject {
        /// The ICMP code (3 for ICMP, 4 for ICMPv6).
        icmp_code: u8,
    },
    /// `reject with tcp reset`.
    RejectTcpReset,
    /// `counter name NAME`: count in the table's named counter.
    CounterRef {
        /// The counter's name.
        name: String,
    },
    /// `dnat ip to <key> map @m`: address and port registers a map lookup wrote (nft sends
    /// no flags; the kernel sets "proto specified" for a port register itself).
    DnatMap {
        /// `NFPROTO_IPV4` or `NFPROTO_IPV6`.
        family: u32,
        /// Register holding the address.
        reg_addr: u32,
        /// Register holding the port.
        reg_proto: u32,
    },
    /// `dnat to <addr reg>:<port reg>`.
    Dnat {
        /// `NFPROTO_IPV4` or `NFPROTO_IPV6`.
        family: u32,
        /// Register holding the address.
        reg_addr: u32,
        /// Register holding the port.
        reg_proto: u32,
    },
}

// Attribute numbers (linux/netfilter/nf_tables.h).
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFTA_CMP_SREG: u16 = 1;
const NFTA_CMP_OP: u16 = 2;
const NFTA_CMP_DATA: u16 = 3;
const NFTA_BITWISE_SREG: u16 = 1;
const NFTA_BITWISE_DREG: u16 = 2;
const NFTA_BITWISE_LEN: u16 = 3;
const NFTA_BITWISE_MASK: u16 = 4;
const NFTA_BITWISE_XOR: u16 = 5;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFTA_META_SREG: u16 = 3;
const NFTA_CT_DREG: u16 = 1;
const NFTA_CT_KEY: u16 = 2;
const NFTA_CT_DIRECTION: u16 = 3;
/// `IP_CT_DIR_ORIGINAL`.
const CT_DIR_ORIGINAL: u8 = 0;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_STATUS: u32 = 2;
const NFTA_MASQ_FLAGS: u16 = 1;
const NFTA_REJECT_TYPE: u16 = 1;
const NFTA_REJECT_ICMP_CODE: u16 = 2;
const NFT_REJECT_ICMP_UNREACH: u32 = 0;
const NFT_REJECT_TCP_RST: u32 = 1;
const NFTA_OBJREF_IMM_TYPE: u16 = 1;
const NFTA_OBJREF_IMM_NAME: u16 = 2;
const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_LOOKUP_SREG: u16 = 2;
const NFTA_LOOKUP_DREG: u16 = 3;
const NFTA_LOOKUP_SET_ID: u16 = 4;
const NFTA_LOOKUP_FLAGS: u16 = 5;
const NFT_LOOKUP_F_INV: u32 = 1;
const NFTA_DYNSET_SET_NAME: u16 = 1;
const NFTA_DYNSET_SET_ID: u16 = 2;
const NFTA_DYNSET_OP: u16 = 3;
const NFTA_DYNSET_SREG_KEY: u16 = 4;
const NFTA_DYNSET_SREG_DATA: u16 = 5;
const NFT_DYNSET_OP_UPDATE: u32 = 1;
const NFTA_NG_DREG: u16 = 1;
const NFTA_NG_MODULUS: u16 = 2;
const NFTA_NG_TYPE: u16 = 3;
const NFTA_NG_OFFSET: u16 = 4;
const NFT_NG_RANDOM: u32 = 1;
const NFTA_FIB_DREG: u16 = 1;
const NFTA_FIB_RESULT: u16 = 2;
const NFTA_FIB_FLAGS: u16 = 3;
const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_NAT_TYPE: u16 = 1;
const NFTA_NAT_FAMILY: u16 = 2;
const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
const NFTA_NAT_FLAGS: u16 = 7;
const NFT_NAT_DNAT: u32 = 1;
/// `NF_NAT_RANGE_PROTO_SPECIFIED`.
const NAT_PROTO_SPECIFIED: u32 = 2;

impl Expr {
    /// The expression's kernel name.
    pub fn name(&self) -> &'static str {
        match self {
            Expr::Payload { .. } => "payload",
            Expr::Cmp { .. } => "cmp",
            Expr::Bitwise { .. } => "bitwise",
            Expr::Meta { .. } => "meta",
            Expr::Lookup { .. } | Expr::LookupAnonymous { .. } => "lookup",
            Expr::DynsetUpdate { .. } => "dynset",
            Expr::NumgenRandom { .. } => "numgen",
            Expr::FibAddrType { .. } => "fib",
            Expr::ImmediateData { .. } | Expr::Immediate(_) => "immediate",
            Expr::Dnat { .. } | Expr::DnatMap { .. } => "nat",
            Expr::CtState { .. } | Expr::CtStatus { .. } | Expr::CtOriginal { .. } => "ct",
            Expr::MetaSet { .. } => "meta",
            Expr::Masquerade { .. } => "masq",
            Expr::Reject { .. } | Expr::RejectTcpReset => "reject",
            Expr::CounterRef { .. } => "objref",
        }
    }

    /// Write the expression's attributes (the contents of `NFTA_EXPR_DATA`), in libnftnl's
    /// order. `anonymous` is the name and batch id of the rule's anonymous set, if any.
    pub fn encode(&self, w: &mut Writer, anonymous: Option<(&str, u32)>) {
        match self {
            Expr::LookupAnonymous { sreg, dreg, invert } => {
                let (name, id) = anonymous.unwrap_or(("", 0));
                w.put_u32(NFTA_LOOKUP_SREG, *sreg);
                if let Some(dreg) = dreg {
                    w.put_u32(NFTA_LOOKUP_DREG, *dreg);
                }
                w.put_str(NFTA_LOOKUP_SET, name);
                w.put_u32(NFTA_LOOKUP_SET_ID, id);
                if *invert {
                    w.put_u32(NFTA_LOOKUP_FLAGS, NFT_LOOKUP_F_INV);
                }
            }
            Expr::Payload {
                base,
                offset,
                len,
                dreg,
            } => {
                w.put_u32(NFTA_PAYLOAD_DREG, *dreg);
                w.put_u32(NFTA_PAYLOAD_BASE, *base);
                w.put_u32(NFTA_PAYLOAD_OFFSET, *offset);
                w.put_u32(NFTA_PAYLOAD_LEN, *len);
            }
            Expr::Cmp { sreg, op, data } => {
                w.put_u32(NFTA_CMP_SREG, *sreg);
                w.put_u32(NFTA_CMP_OP, *op as u32);
                w.put_data(NFTA_CMP_DATA, data);
            }
            Expr::Bitwise {
                sreg,
                dreg,
                mask,
                xor,
            } => {
                w.put_u32(NFTA_BITWISE_SREG, *sreg);
                w.put_u32(NFTA_BITWISE_DREG, *dreg);
                w.put_u32(NFTA_BITWISE_LEN, mask.len() as u32);
                w.put_data(NFTA_BITWISE_MASK, mask);
                w.put_data(NFTA_BITWISE_XOR, xor);
            }
            Expr::Meta { key, dreg } => {
                w.put_u32(NFTA_META_KEY, *key);
                w.put_u32(NFTA_META_DREG, *dreg);
            }
            Expr::DnatMap {
                family,
                reg_addr,
                reg_proto,
            } => {
                w.put_u32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
                w.put_u32(NFTA_NAT_FAMILY, *family);
                w.put_u32(NFTA_NAT_REG_ADDR_MIN, *reg_addr);
                w.put_u32(NFTA_NAT_REG_PROTO_MIN, *reg_proto);
            }
            Expr::Lookup {
                set,
                set_id,
                sreg,
                dreg,
            } => {
                w.put_u32(NFTA_LOOKUP_SREG, *sreg);
                if let Some(dreg) = dreg {
                    w.put_u32(NFTA_LOOKUP_DREG, *dreg);
                }
                w.put_str(NFTA_LOOKUP_SET, set);
                if let Some(set_id) = set_id {
                    w.put_u32(NFTA_LOOKUP_SET_ID, *set_id);
                }
            }
            Expr::DynsetUpdate {
                set,
                set_id,
                sreg_key,
                sreg_data,
            } => {
                w.put_u32(NFTA_DYNSET_SREG_KEY, *sreg_key);
                if let Some(sreg_data) = sreg_data {
                    w.put_u32(NFTA_DYNSET_SREG_DATA, *sreg_data);
                }
                w.put_u32(NFTA_DYNSET_OP, NFT_DYNSET_OP_UPDATE);
                w.put_str(NFTA_DYNSET_SET_NAME, set);
                if let Some(set_id) = set_id {
                    w.put_u32(NFTA_DYNSET_SET_ID, *set_id);
                }
            }
            Expr::NumgenRandom { dreg, modulus } => {
                w.put_u32(NFTA_NG_DREG, *dreg);
                w.put_u32(NFTA_NG_MODULUS, *modulus);
                w.put_u32(NFTA_NG_TYPE, NFT_NG_RANDOM);
                w.put_u32(NFTA_NG_OFFSET, 0);
            }
            Expr::FibAddrType { flags, dreg } => {
                w.put_u32(NFTA_FIB_FLAGS, *flags);
                w.put_u32(NFTA_FIB_RESULT, NFT_FIB_RESULT_ADDRTYPE);
                w.put_u32(NFTA_FIB_DREG, *dreg);
            }
            Expr::ImmediateData { dreg, data } => {
                w.put_u32(NFTA_IMMEDIATE_DREG, *dreg);
                w.put_data(NFTA_IMMEDIATE_DATA, data);
            }
            Expr::Immediate(verdict) => {
                w.put_u32(NFTA_IMMEDIATE_DREG, REG_VERDICT);
                w.put_verdict(NFTA_IMMEDIATE_DATA, verdict);
            }
            Expr::CtState { dreg } => {
                w.put_u32(NFTA_CT_KEY, NFT_CT_STATE);
                w.put_u32(NFTA_CT_DREG, *dreg);
            }
            Expr::CtStatus { dreg } => {
                w.put_u32(NFTA_CT_KEY, NFT_CT_STATUS);
                w.put_u32(NFTA_CT_DREG, *dreg);
            }
            Expr::CtOriginal { key, dreg } => {
                w.put_u32(NFTA_CT_KEY, *key);
                w.put_u32(NFTA_CT_DREG, *dreg);
                w.put(NFTA_CT_DIRECTION, &[CT_DIR_ORIGINAL]);
            }
            Expr::MetaSet { key, sreg } => {
                w.put_u32(NFTA_META_KEY, *key);
                w.put_u32(NFTA_META_SREG, *sreg);
            }
            Expr::Masquerade { flags } => {
                if let Some(flags) = flags {
                    w.put_u32(NFTA_MASQ_FLAGS, *flags);
                }
            }
            Expr::Reject { icmp_code } => {
                w.put_u32(NFTA_REJECT_TYPE, NFT_REJECT_ICMP_UNREACH);
                w.put(NFTA_REJECT_ICMP_CODE, &[*icmp_code]);
            }
            Expr::RejectTcpReset => w.put_u32(NFTA_REJECT_TYPE, NFT_REJECT_TCP_RST),
            Expr::CounterRef { name } => {
                w.put_u32(NFTA_OBJREF_IMM_TYPE, crate::counters::NFT_OBJECT_COUNTER);
                w.put_str(NFTA_OBJREF_IMM_NAME, name);
            }
            Expr::Dnat {
                family,
                reg_addr,
                reg_proto,
            } => {
                w.put_u32(NFTA_NAT_TYPE, NFT_NAT_DNAT);
                w.put_u32(NFTA_NAT_FAMILY, *family);
                w.put_u32(NFTA_NAT_REG_ADDR_MIN, *reg_addr);
                w.put_u32(NFTA_NAT_REG_PROTO_MIN, *reg_proto);
                w.put_u32(NFTA_NAT_FLAGS, NAT_PROTO_SPECIFIED);
            }
        }
    }
}
