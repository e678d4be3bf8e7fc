//! nf_tables netlink messages, sans I/O: a [`Batch`] collects the messages of one
//! transaction between `NFNL_MSG_BATCH_BEGIN` and `NFNL_MSG_BATCH_END`, each remembering
//! the script statement it came from, so that a kernel error (which names the message by
//! its sequence number) can be reported against that statement.
//!
//! Attribute order, flags and user data follow what `nft` 1.0.6 (libnftnl) sends for the
//! same statement, so that `nft list` shows objects created here exactly as if `nft` had
//! created them.

use crate::abi::{
    NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFNL_SUBSYS_NFTABLES, NFTA_CHAIN_HOOK,
    NFTA_CHAIN_NAME, NFTA_CHAIN_TABLE, NFTA_CHAIN_TYPE, NFTA_CHAIN_USERDATA, NFTA_DATA_VALUE,
    NFTA_DATA_VERDICT, NFTA_EXPR_DATA, NFTA_EXPR_NAME, NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY,
    NFTA_LIST_ELEM, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS, NFTA_RULE_TABLE, NFTA_RULE_USERDATA,
    NFTA_SET_DATA_LEN, NFTA_SET_DATA_TYPE, NFTA_SET_DESC, NFTA_SET_DESC_SIZE, NFTA_SET_ELEM_DATA,
    NFTA_SET_ELEM_FLAGS, NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_LIST_ELEMENTS, NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_SET_ID, NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_USERDATA, NFTA_SET_FLAGS,
    NFTA_SET_ID, NFTA_SET_KEY_LEN, NFTA_SET_KEY_TYPE, NFTA_SET_NAME, NFTA_SET_TABLE,
    NFTA_SET_TIMEOUT, NFTA_SET_USERDATA, NFTA_TABLE_FLAGS, NFTA_TABLE_NAME, NFTA_TABLE_USERDATA,
    NFTA_VERDICT_CHAIN, NFTA_VERDICT_CODE, SET_ANONYMOUS, SET_CONSTANT, SET_ELEM_INTERVAL_END,
    SET_INTERVAL, SET_MAP,
};
use crate::expr::{Expr, Verdict};
use crate::lower::{AnonymousSet, IntervalMark, Lowered, Op, SetSpec};

use crate::counters::{
    NFT_OBJECT_COUNTER, NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS, NFTA_OBJ_DATA, NFTA_OBJ_NAME,
    NFTA_OBJ_TABLE, NFTA_OBJ_TYPE,
};
use kp_netlink::{NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST};
pub use kp_netlink::{NLMSG_DONE, NLMSG_ERROR, attributes};

/// `NFT_MSG_*` message kinds (the low byte of the netlink message type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum MsgKind {
    /// Create (or update) a table.
    NewTable = 0,
    /// Delete a table.
    DelTable = 2,
    /// Create (or update) a chain.
    NewChain = 3,
    /// Delete a chain.
    DelChain = 5,
    /// Append a rule.
    NewRule = 6,
    /// Delete rules (all of a chain's when no handle is given: `flush chain`).
    DelRule = 8,
    /// Create a set or map.
    NewSet = 9,
    /// Delete a set or map.
    DelSet = 11,
    /// Add set elements.
    NewSetElem = 12,
    /// Delete set elements (all of them when none is listed: `flush set`).
    DelSetElem = 14,
    /// Read the ruleset generation (used as a fence after a batch).
    GetGen = 16,
    /// List tables (a dump).
    GetTable = 1,
    /// List chains (a dump).
    GetChain = 4,
    /// List rules (a dump).
    GetRule = 7,
    /// List sets and maps (a dump).
    GetSet = 10,
    /// List a set's elements (a dump).
    GetSetElem = 13,
    /// Create a stateful object (a named counter; an existing one is left as it is).
    NewObj = 18,
    /// List stateful objects such as named counters (a dump).
    GetObj = 19,
    /// Delete a stateful object.
    DelObj = 20,
}

/// The nftables families this crate writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `ip` (`NFPROTO_IPV4`).
    Ipv4,
    /// `ip6` (`NFPROTO_IPV6`).
    Ipv6,
}

impl Family {
    /// The `NFPROTO_*` number in the message header.
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Ipv4 => 2,
            Family::Ipv6 => 10,
        }
    }

    /// The nft keyword (`ip`, `ip6`).
    pub fn keyword(self) -> &'static str {
        match self {
            Family::Ipv4 => "ip",
            Family::Ipv6 => "ip6",
        }
    }
}

/// nft's integer and verdict data types.
const TYPE_INTEGER: u32 = 4;
const TYPE_VERDICT: u32 = 0xffff_ff00;
/// nft's ids in the typeof record of an anonymous set: the payload expression, the IPv4
/// and IPv6 header descriptions, and their address fields.
const EXPR_PAYLOAD: u32 = 7;
const PROTO_DESC_IP: u32 = 12;
const PROTO_DESC_IP6: u32 = 13;
const IPHDR_SADDR: u32 = 11;
const IPHDR_DADDR: u32 = 12;
const IP6HDR_SADDR: u32 = 7;
const IP6HDR_DADDR: u32 = 8;
/// libnftnl user data made of `u32` records (host order): each `(header, value, trailer)`.
pub(crate) fn udata_u32s(records: &[(&[u8], u32, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (head, value, tail) in records {
        out.extend_from_slice(head);
        out.extend_from_slice(&value.to_ne_bytes());
        out.extend_from_slice(tail);
    }
    out
}

/// The user data nft 1.0.6 writes for a `numgen ... vmap { }` map: host-order integer
/// keys, the data's typeof record, no data interval.
fn numgen_map_udata() -> Vec<u8> {
    udata_u32s(&[
        (&[0, 4], 1, &[]),
        (&[1, 4], 0, &[]),
        (&[4, 8, 0, 4], 1, &[1, 0]),
        (&[6, 4], 0, &[]),
    ])
}

/// `NFTNL_UDATA_*_COMMENT`: the comment inside rule, element, table and chain user data.
const UDATA_COMMENT: u8 = 0;
/// `NFTNL_UDATA_SET_COMMENT`.
const UDATA_SET_COMMENT: u8 = 7;

/// Writes nf_tables messages and their attributes into one buffer: the framing is
/// [`kp_netlink::Writer`]'s (`put`, `put_str`, `nest`, ... through `Deref`), nf_tables' data
/// and verdict values are added here.
#[derive(Debug, Default)]
pub struct Writer(kp_netlink::Writer);

impl std::ops::Deref for Writer {
    type Target = kp_netlink::Writer;

    fn deref(&self) -> &kp_netlink::Writer {
        &self.0
    }
}

impl std::ops::DerefMut for Writer {
    fn deref_mut(&mut self) -> &mut kp_netlink::Writer {
        &mut self.0
    }
}

impl Writer {
    /// Start an nf_tables message (with its `struct nfgenmsg`); returns its offset for `end`.
    fn begin(&mut self, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> usize {
        self.0.begin_nfnl(ty, flags, seq, family, res_id)
    }

    /// `NFTA_DATA_VALUE` inside a nest of type `ty`.
    pub fn put_data(&mut self, ty: u16, value: &[u8]) {
        let nest = self.nest(ty);
        self.put(NFTA_DATA_VALUE, value);
        self.nest_end(nest);
    }

    /// `NFTA_DATA_VERDICT` inside a nest of type `ty`.
    pub fn put_verdict(&mut self, ty: u16, verdict: &Verdict) {
        let outer = self.nest(ty);
        let inner = self.nest(NFTA_DATA_VERDICT);
        self.put_u32(NFTA_VERDICT_CODE, verdict.code() as u32);
        if let Some(chain) = verdict.chain() {
            self.put_str(NFTA_VERDICT_CHAIN, chain);
        }
        self.nest_end(inner);
        self.nest_end(outer);
    }
}

/// User data (libnftnl's TLV list: type, length, value) holding a NUL-terminated comment.
fn comment_udata(kind: u8, comment: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(comment.len() + 3);
    // nft limits comments to 128 bytes, so the length fits; longer ones are rejected by
    // the parser before they get here.
    out.push(kind);
    out.push((comment.len() + 1) as u8);
    out.extend_from_slice(comment.as_bytes());
    out.push(0);
    out
}

/// The messages of one transaction.
#[derive(Debug)]
pub struct Batch {
    writer: Writer,
    first_seq: u32,
    next_seq: u32,
    /// For each message after BEGIN, in order: the owner (see [`Batch::push`]) of the
    /// command it encodes.
    owners: Vec<u32>,
    /// Numbers sets created in this batch (`NFTA_SET_ID`), as nft does.
    next_set_id: u32,
}

impl Batch {
    /// A batch whose BEGIN message has sequence number `first_seq`.
    pub fn new(first_seq: u32) -> Self {
        let mut writer = Writer::default();
        let start = writer.begin(
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            first_seq,
            0,
            NFNL_SUBSYS_NFTABLES,
        );
        writer.end(start);
        Self {
            writer,
            first_seq,
            next_seq: first_seq.wrapping_add(1),
            owners: Vec::new(),
            next_set_id: 1,
        }
    }

    fn message(&mut self, kind: MsgKind, flags: u16, family: Family, owner: usize) -> usize {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        self.owners.push(u32::try_from(owner).unwrap_or(u32::MAX));
        self.writer.begin(
            (NFNL_SUBSYS_NFTABLES << 8) | kind as u16,
            NLM_F_REQUEST | flags,
            seq,
            family.nfproto(),
            0,
        )
    }

    /// Append one message of `kind` whose attributes `body` writes (for message shapes
    /// [`Command`](kp_rules::nftables::cmd::Command) does not cover, such as iptables-nft's, see [`crate::xt`]); a kernel error
    /// for it is reported as `owner`. `flags` are netlink flags besides `NLM_F_REQUEST`.
    pub fn raw(
        &mut self,
        kind: MsgKind,
        flags: u16,
        family: Family,
        owner: usize,
        body: impl FnOnce(&mut Writer),
    ) {
        let m = self.message(kind, flags, family, owner);
        body(&mut self.writer);
        self.writer.end(m);
    }

    /// Move the messages of `other` (not its BEGIN) to the end of this batch, renumbered in
    /// sequence; each keeps its owner plus `owner_offset`. Lets a caller build parts of a
    /// transaction apart (declarations before the rules that need them) and join them.
    ///
    /// When `other` holds more bytes than this batch, this batch's bytes go in front of
    /// `other`'s buffer instead (one move within that buffer), so a large part is never held
    /// twice while joining.
    pub fn append(&mut self, other: Batch, owner_offset: usize) {
        let Batch { writer, owners, .. } = other;
        let mut bytes = writer.0.into_bytes();
        let begin = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        let ours = self.writer.buffer_mut();
        let start = ours.len();
        if bytes.len() - begin > start {
            // Replace `other`'s BEGIN with all of ours; its messages follow.
            bytes.splice(..begin, ours.drain(..));
            *ours = bytes;
        } else {
            ours.extend_from_slice(&bytes[begin..]);
            drop(bytes);
        }
        let buf = self.writer.buffer_mut();
        let mut at = start;
        for owner in owners {
            let len = u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as usize;
            let seq = self.next_seq;
            self.next_seq = self.next_seq.wrapping_add(1);
            buf[at + 8..at + 12].copy_from_slice(&seq.to_ne_bytes());
            self.owners
                .push(owner.saturating_add(u32::try_from(owner_offset).unwrap_or(u32::MAX)));
            at += len;
        }
    }

    /// Messages pushed so far.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Append the message(s) of `command`; a kernel error for them is reported as `owner`
    /// (the caller's number for the command).
    pub fn push(&mut self, command: &Lowered, owner: usize) {
        let family = command.family;
        let table: &str = command.table;
        fn w(b: &mut Batch) -> &mut Writer {
            &mut b.writer
        }
        match &command.op {
            Op::AddTable { comment } => {
                let m = self.message(MsgKind::NewTable, NLM_F_CREATE, family, owner);
                let wr = w(self);
                wr.put_str(NFTA_TABLE_NAME, table);
                wr.put_u32(NFTA_TABLE_FLAGS, 0);
                if let Some(comment) = comment {
                    wr.put(NFTA_TABLE_USERDATA, &comment_udata(UDATA_COMMENT, comment));
                }
                wr.end(m);
            }
            Op::DeleteTable => {
                let m = self.message(MsgKind::DelTable, 0, family, owner);
                let wr = w(self);
                wr.put_str(NFTA_TABLE_NAME, table);
                wr.end(m);
            }
            Op::AddChain {
                chain,
                base,
                comment,
            } => {
                let m = self.message(MsgKind::NewChain, NLM_F_CREATE, family, owner);
                let wr = w(self);
                wr.put_str(NFTA_CHAIN_TABLE, table);
                wr.put_str(NFTA_CHAIN_NAME, chain);
                if let Some(base) = base {
                    // No policy: the kernel's default (accept), as nft sends it.
                    wr.put_str(NFTA_CHAIN_TYPE, base.kind);
                    let hook = wr.nest(NFTA_CHAIN_HOOK);
                    wr.put_u32(NFTA_HOOK_HOOKNUM, base.hook);
                    wr.put_u32(NFTA_HOOK_PRIORITY, base.priority as u32);
                    wr.nest_end(hook);
                }
                if let Some(comment) = comment {
                    wr.put(NFTA_CHAIN_USERDATA, &comment_udata(UDATA_COMMENT, comment));
                }
                wr.end(m);
            }
            Op::FlushChain { chain } => {
                self.named(
                    MsgKind::DelRule,
                    family,
                    owner,
                    (NFTA_RULE_TABLE, table),
                    (NFTA_RULE_CHAIN, chain),
                );
            }
            Op::DeleteChain { chain } => {
                self.named(
                    MsgKind::DelChain,
                    family,
                    owner,
                    (NFTA_CHAIN_TABLE, table),
                    (NFTA_CHAIN_NAME, chain),
                );
            }
            Op::AddSet { set, spec } => {
                let id = self.next_set_id;
                self.next_set_id += 1;
                let m = self.message(MsgKind::NewSet, NLM_F_CREATE, family, owner);
                let wr = w(self);
                encode_set(wr, table, set, spec, id);
                wr.end(m);
            }
            Op::FlushSet { set } => {
                self.named(
                    MsgKind::DelSetElem,
                    family,
                    owner,
                    (NFTA_SET_ELEM_LIST_TABLE, table),
                    (NFTA_SET_ELEM_LIST_SET, set),
                );
            }
            Op::DeleteSet { set } => {
                self.named(
                    MsgKind::DelSet,
                    family,
                    owner,
                    (NFTA_SET_TABLE, table),
                    (NFTA_SET_NAME, set),
                );
            }
            Op::AddRule {
                chain,
                exprs,
                comment,
                anonymous,
            } => {
                let anonymous = anonymous
                    .as_ref()
                    .map(|set| self.push_anonymous(family, table, set, owner));
                let m = self.message(MsgKind::NewRule, NLM_F_CREATE | NLM_F_APPEND, family, owner);
                let wr = w(self);
                wr.put_str(NFTA_RULE_TABLE, table);
                wr.put_str(NFTA_RULE_CHAIN, chain);
                encode_exprs(wr, exprs, anonymous);
                if let Some(comment) = comment {
                    wr.put(NFTA_RULE_USERDATA, &comment_udata(UDATA_COMMENT, comment));
                }
                wr.end(m);
            }
            Op::AddElement {
                set,
                key,
                verdict,
                comment,
            } => {
                let element = (key.as_slice(), verdict.as_ref(), comment.as_deref());
                self.element(MsgKind::NewSetElem, family, owner, table, set, element);
            }
            Op::DeleteElement { set, key } => {
                let element = (key.as_slice(), None, None);
                self.element(MsgKind::DelSetElem, family, owner, table, set, element);
            }
            Op::AddCounter { counter } => {
                let m = self.message(MsgKind::NewObj, NLM_F_CREATE, family, owner);
                let wr = w(self);
                put_counter_id(wr, table, counter);
                // The kernel wants the data nested even for a counter starting at zero.
                let data = wr.nest(NFTA_OBJ_DATA);
                wr.put_u64(NFTA_COUNTER_BYTES, 0);
                wr.put_u64(NFTA_COUNTER_PACKETS, 0);
                wr.nest_end(data);
                wr.end(m);
            }
            Op::DeleteCounter { counter } => {
                let m = self.message(MsgKind::DelObj, 0, family, owner);
                put_counter_id(w(self), table, counter);
                w(self).end(m);
            }
        }
    }

    /// One set element added (with its verdict and comment) or deleted.
    fn element(
        &mut self,
        kind: MsgKind,
        family: Family,
        owner: usize,
        table: &str,
        set: &str,
        (key, verdict, comment): (&[u8], Option<&Verdict>, Option<&str>),
    ) {
        let flags = if kind == MsgKind::NewSetElem {
            NLM_F_CREATE
        } else {
            0
        };
        let m = self.message(kind, flags, family, owner);
        let wr = &mut self.writer;
        wr.put_str(NFTA_SET_ELEM_LIST_TABLE, table);
        wr.put_str(NFTA_SET_ELEM_LIST_SET, set);
        let list = wr.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
        let elem = wr.nest(NFTA_LIST_ELEM);
        wr.put_data(NFTA_SET_ELEM_KEY, key);
        if let Some(verdict) = verdict {
            wr.put_verdict(NFTA_SET_ELEM_DATA, verdict);
        }
        if let Some(comment) = comment {
            wr.put(
                NFTA_SET_ELEM_USERDATA,
                &comment_udata(UDATA_COMMENT, comment),
            );
        }
        wr.nest_end(elem);
        wr.nest_end(list);
        wr.end(m);
    }

    /// The batch id the next set pushed gets (rules created with it refer to it by this id,
    /// as nft's do).
    pub fn next_set_id(&self) -> u32 {
        self.next_set_id
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    /// The bytes encoded so far.
    pub fn len_bytes(&self) -> usize {
        self.writer.bytes().len()
    }

    /// A deletion that names its object by table and name only.
    fn named(
        &mut self,
        kind: MsgKind,
        family: Family,
        owner: usize,
        table: (u16, &str),
        name: (u16, &str),
    ) {
        let m = self.message(kind, 0, family, owner);
        self.writer.put_str(table.0, table.1);
        self.writer.put_str(name.0, name.1);
        self.writer.end(m);
    }

    /// Create `set` and its elements; returns its name and batch id for the lookup.
    fn push_anonymous(
        &mut self,
        family: Family,
        table: &str,
        set: &AnonymousSet,
        owner: usize,
    ) -> (&'static str, u32) {
        let id = self.next_set_id;
        self.next_set_id += 1;
        let (name, size) = match set {
            // nft sizes an interval set at two keys per interval, plus the leading end.
            AnonymousSet::Prefixes { elements, .. } => (
                "__set%d",
                2 * elements
                    .iter()
                    .filter(|(_, mark)| *mark != IntervalMark::End)
                    .count()
                    + usize::from(
                        elements
                            .first()
                            .is_some_and(|(_, m)| *m == IntervalMark::End),
                    ),
            ),
            AnonymousSet::NumgenMap { verdicts } => ("__map%d", verdicts.len()),
        };
        let m = self.message(MsgKind::NewSet, NLM_F_CREATE, family, owner);
        let wr = &mut self.writer;
        wr.put_str(NFTA_SET_TABLE, table);
        wr.put_str(NFTA_SET_NAME, name);
        match set {
            AnonymousSet::Prefixes { family, source, .. } => {
                wr.put_u32(NFTA_SET_FLAGS, SET_ANONYMOUS | SET_CONSTANT | SET_INTERVAL);
                let (key_type, key_len, desc, field) = match (family, source) {
                    (Family::Ipv4, true) => (7, 4, PROTO_DESC_IP, IPHDR_SADDR),
                    (Family::Ipv4, false) => (7, 4, PROTO_DESC_IP, IPHDR_DADDR),
                    (Family::Ipv6, true) => (8, 16, PROTO_DESC_IP6, IP6HDR_SADDR),
                    (Family::Ipv6, false) => (8, 16, PROTO_DESC_IP6, IP6HDR_DADDR),
                };
                wr.put_u32(NFTA_SET_KEY_TYPE, key_type);
                wr.put_u32(NFTA_SET_KEY_LEN, key_len);
                wr.put_u32(NFTA_SET_ID, id);
                put_desc_size(wr, size);
                // Key byte order big endian; merge adjacent elements; the key is the
                // payload expression `<desc> <field>` (nft's typeof record).
                let mut udata = vec![0, 4];
                udata.extend_from_slice(&2u32.to_ne_bytes());
                udata.extend_from_slice(&[2, 4]);
                udata.extend_from_slice(&1u32.to_ne_bytes());
                udata.extend_from_slice(&[3, 20, 0, 4]);
                udata.extend_from_slice(&EXPR_PAYLOAD.to_ne_bytes());
                udata.extend_from_slice(&[1, 12, 0, 4]);
                udata.extend_from_slice(&desc.to_ne_bytes());
                udata.extend_from_slice(&[1, 4]);
                udata.extend_from_slice(&field.to_ne_bytes());
                wr.put(NFTA_SET_USERDATA, &udata);
            }
            AnonymousSet::NumgenMap { .. } => {
                wr.put_u32(NFTA_SET_FLAGS, SET_ANONYMOUS | SET_CONSTANT | SET_MAP);
                wr.put_u32(NFTA_SET_KEY_TYPE, TYPE_INTEGER);
                wr.put_u32(NFTA_SET_KEY_LEN, 4);
                wr.put_u32(NFTA_SET_DATA_TYPE, TYPE_VERDICT);
                wr.put_u32(NFTA_SET_DATA_LEN, 0);
                wr.put_u32(NFTA_SET_ID, id);
                put_desc_size(wr, size);
                wr.put(NFTA_SET_USERDATA, &numgen_map_udata());
            }
        }
        wr.end(m);

        let m = self.message(MsgKind::NewSetElem, NLM_F_CREATE, family, owner);
        let wr = &mut self.writer;
        wr.put_str(NFTA_SET_ELEM_LIST_TABLE, table);
        wr.put_str(NFTA_SET_ELEM_LIST_SET, name);
        wr.put_u32(NFTA_SET_ELEM_LIST_SET_ID, id);
        let list = wr.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
        match set {
            AnonymousSet::Prefixes { elements, .. } => {
                for (index, (key, mark)) in elements.iter().enumerate() {
                    // libnftnl numbers the list entries; the kernel ignores the numbers.
                    let elem = wr.nest(index as u16 + 1);
                    if *mark == IntervalMark::End {
                        wr.put_u32(NFTA_SET_ELEM_FLAGS, SET_ELEM_INTERVAL_END);
                    }
                    wr.put_data(NFTA_SET_ELEM_KEY, key);
                    if *mark == IntervalMark::StartOpen {
                        // NFTNL_UDATA_SET_ELEM_FLAGS: NFTNL_SET_ELEM_F_INTERVAL_OPEN.
                        let mut udata = vec![1, 4];
                        udata.extend_from_slice(&1u32.to_ne_bytes());
                        wr.put(NFTA_SET_ELEM_USERDATA, &udata);
                    }
                    wr.nest_end(elem);
                }
            }
            AnonymousSet::NumgenMap { verdicts } => {
                for (index, verdict) in verdicts.iter().enumerate() {
                    let elem = wr.nest(index as u16 + 1);
                    wr.put_data(NFTA_SET_ELEM_KEY, &(index as u32).to_ne_bytes());
                    wr.put_verdict(NFTA_SET_ELEM_DATA, verdict);
                    wr.nest_end(elem);
                }
            }
        }
        wr.nest_end(list);
        wr.end(m);
        (name, id)
    }

    /// Close the batch with `NFNL_MSG_BATCH_END`, then append a `NFT_MSG_GETGEN` request
    /// with an acknowledgement: the kernel processes the batch while it is being sent and
    /// queues its errors before it answers the request, so once that answer arrives every
    /// error of the batch has been read.
    pub fn finish(mut self) -> EncodedBatch {
        let seq = self.next_seq;
        let start = self.writer.begin(
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            seq,
            0,
            NFNL_SUBSYS_NFTABLES,
        );
        self.writer.end(start);
        let fence_seq = seq.wrapping_add(1);
        EncodedBatch {
            bytes: self.writer.0.into_bytes(),
            first_seq: self.first_seq,
            owners: self.owners,
            fence_seq,
        }
    }
}

/// A finished batch: the bytes to send and how to map sequence numbers back to commands.
#[derive(Debug)]
pub struct EncodedBatch {
    /// BEGIN, the messages, END.
    pub bytes: Vec<u8>,
    /// The sequence number of BEGIN; message `i` has `first_seq + 1 + i`.
    pub first_seq: u32,
    /// The owner (see [`Batch::push`]) of each message.
    pub owners: Vec<u32>,
    /// The sequence number the fence request must use.
    pub fence_seq: u32,
}

impl EncodedBatch {
    /// The owner of message `seq` (see [`Batch::push`]), if `seq` is one of this batch's.
    pub fn owner(&self, seq: u32) -> Option<usize> {
        let index = seq.wrapping_sub(self.first_seq).checked_sub(1)?;
        self.owners.get(index as usize).map(|owner| *owner as usize)
    }
}

/// A dump request (`NLM_F_DUMP`) of `kind` for `family`, with the filter attributes `body`
/// writes (a table and chain name for rules, for example).
pub fn dump_request(
    kind: MsgKind,
    family: Family,
    seq: u32,
    body: impl FnOnce(&mut Writer),
) -> Vec<u8> {
    const NLM_F_DUMP: u16 = 0x300;
    let mut writer = Writer::default();
    let start = writer.begin(
        (NFNL_SUBSYS_NFTABLES << 8) | kind as u16,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        family.nfproto(),
        0,
    );
    body(&mut writer);
    writer.end(start);
    writer.0.into_bytes()
}

/// `NFT_MSG_GETGEN` with an acknowledgement requested, sent after a batch (see
/// [`Batch::finish`]).
pub fn fence(seq: u32) -> Vec<u8> {
    let mut writer = Writer::default();
    let start = writer.begin(
        (NFNL_SUBSYS_NFTABLES << 8) | MsgKind::GetGen as u16,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        0,
        0,
    );
    writer.end(start);
    writer.0.into_bytes()
}

fn encode_set(wr: &mut Writer, table: &str, set: &str, spec: &SetSpec, id: u32) {
    wr.put_str(NFTA_SET_TABLE, table);
    wr.put_str(NFTA_SET_NAME, set);
    wr.put_u32(NFTA_SET_FLAGS, spec.flags);
    wr.put_u32(NFTA_SET_KEY_TYPE, spec.key_type);
    wr.put_u32(NFTA_SET_KEY_LEN, spec.key_len);
    if let Some((data_type, data_len)) = spec.data {
        wr.put_u32(NFTA_SET_DATA_TYPE, data_type);
        wr.put_u32(NFTA_SET_DATA_LEN, data_len);
    }
    wr.put_u32(NFTA_SET_ID, id);
    if let Some(size) = spec.size {
        put_desc_size(wr, size as usize);
    }
    if let Some(timeout) = spec.timeout_ms {
        wr.put_u64(NFTA_SET_TIMEOUT, timeout);
    }
    let mut udata = spec.udata_prefix.clone();
    if let Some(comment) = &spec.comment {
        udata.extend_from_slice(&comment_udata(UDATA_SET_COMMENT, comment));
    }
    wr.put(NFTA_SET_USERDATA, &udata);
}

/// A named counter's table, name and type (what `add counter` and `delete counter` name).
fn put_counter_id(wr: &mut Writer, table: &str, counter: &str) {
    wr.put_str(NFTA_OBJ_TABLE, table);
    wr.put_str(NFTA_OBJ_NAME, counter);
    wr.put_u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER);
}

fn put_desc_size(wr: &mut Writer, size: usize) {
    let desc = wr.nest(NFTA_SET_DESC);
    wr.put_u32(NFTA_SET_DESC_SIZE, size as u32);
    wr.nest_end(desc);
}

fn encode_exprs(wr: &mut Writer, exprs: &[Expr], anonymous: Option<(&str, u32)>) {
    let list = wr.nest(NFTA_RULE_EXPRESSIONS);
    for expr in exprs {
        let elem = wr.nest(NFTA_LIST_ELEM);
        wr.put_str(NFTA_EXPR_NAME, expr.name());
        let data = wr.nest(NFTA_EXPR_DATA);
        expr.encode(wr, anonymous);
        wr.nest_end(data);
        wr.nest_end(elem);
    }
    wr.nest_end(list);
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use kp_core::model::{IpFamily, Protocol};
    use kp_rules::nftables::cmd::{
        self, AddrField, Command, ElementKey, KeyParts, Match, Name, Rule, SetKind,
    };

    use super::*;
    use crate::lower::lower;

    fn chain(name: &'static str) -> Name {
        Name::Fixed(name)
    }

    /// The commands of [`GOLDEN`], in its order.
    fn golden_commands() -> Vec<Command> {
        vec![
            Command::AddSet {
                set: chain("aff-c"),
                kind: SetKind::Addresses {
                    timeout: Some(10800),
                },
                comment: None,
            },
            Command::AddChain {
                chain: chain("svc/c"),
                hook: None,
                comment: None,
            },
            Command::FlushChain(chain("svc/c")),
            Command::DeleteChain(chain("svc/c")),
            Command::DeleteElement {
                set: chain("service-ips"),
                key: ElementKey::new(KeyParts::AddrProtoPort(
                    IpAddr::V4(Ipv4Addr::new(172, 30, 0, 3)),
                    Protocol::Udp,
                    53,
                )),
            },
            Command::DeleteSet(chain("aff-c")),
            Command::AddRule {
                chain: chain("svc/a"),
                rule: Rule::verdict(
                    vec![Match::Numgen {
                        modulus: 3,
                        value: 0,
                    }],
                    cmd::Verdict::Goto(chain("ep/a")),
                ),
            },
            Command::AddRule {
                chain: chain("ep/a"),
                rule: Rule::verdict(
                    vec![Match::Addr {
                        field: AddrField::Source,
                        negate: false,
                        value: cmd::Addr::Host(IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3))),
                    }],
                    cmd::Verdict::Jump(chain("mark-for-masquerade")),
                ),
            },
        ]
    }

    /// What `nft` 1.0.6 sent for the same statement (captured with `nft --debug=mnl`):
    /// message type and everything after the netlink header.
    const GOLDEN: &[(&str, u16, &str)] = &[
        (
            "add set ip kube-proxy aff-c { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }",
            2569,
            "020000000f0001006b7562652d70726f787900000a0002006166662d6300000008000300000000300800040000000007080005000000000408000a00000000010c000b000000000000a4cb800a000d000004020000000000",
        ),
        (
            "add chain ip kube-proxy svc/c",
            2563,
            "020000000f0001006b7562652d70726f787900000a0003007376632f63000000",
        ),
        (
            "flush chain ip kube-proxy svc/c",
            2568,
            "020000000f0001006b7562652d70726f787900000a0002007376632f63000000",
        ),
        (
            "delete chain ip kube-proxy svc/c",
            2565,
            "020000000f0001006b7562652d70726f787900000a0003007376632f63000000",
        ),
        (
            "delete element ip kube-proxy service-ips { 172.30.0.3 . udp . 53 }",
            2574,
            "020000000f0001006b7562652d70726f7879000010000200736572766963652d697073001c000380180001801400018010000100ac1e00031100000000350000",
        ),
        (
            "delete set ip kube-proxy aff-c",
            2571,
            "020000000f0001006b7562652d70726f787900000a0002006166662d63000000",
        ),
        (
            "add rule ip kube-proxy svc/a numgen random mod 3 0 goto ep/a",
            2566,
            "020000000f0001006b7562652d70726f787900000a0002007376632f61000000a0000480340001800b0001006e756d67656e00002400028008000100000000010800020000000003080003000000000108000400000000002c00018008000100636d700020000280080001000000000108000200000000000c00038008000100000000003c0001800e000100696d6d6564696174650000002800028008000100000000001c0002801800028008000100fffffffc0900020065702f6100000000",
        ),
        (
            "add rule ip kube-proxy ep/a ip saddr 10.1.2.3 jump mark-for-masquerade",
            2566,
            "020000000f0001006b7562652d70726f787900000900020065702f6100000000ac000480340001800c0001007061796c6f6164002400028008000100000000010800020000000001080003000000000c08000400000000042c00018008000100636d700020000280080001000000000108000200000000000c000380080001000a010203480001800e000100696d6d656469617465000000340002800800010000000000280002802400028008000100fffffffd180002006d61726b2d666f722d6d61737175657261646500",
        ),
    ];

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn messages_match_what_nft_sends() {
        let commands = golden_commands();
        assert_eq!(commands.len(), GOLDEN.len());
        for ((statement, ty, body), command) in GOLDEN.iter().zip(&commands) {
            assert_eq!(
                command.display(IpFamily::V4).to_string(),
                *statement,
                "the command prints as the statement nft was given"
            );
            let mut batch = Batch::new(100);
            batch.push(&lower(IpFamily::V4, command).expect("supported"), 0);
            let encoded = batch.finish();
            // BEGIN is 20 bytes; then our message; END is 20 bytes.
            let message = &encoded.bytes[20..encoded.bytes.len() - 20];
            let len = u32::from_ne_bytes([message[0], message[1], message[2], message[3]]);
            assert_eq!(len as usize, message.len(), "{statement}");
            assert_eq!(
                u16::from_ne_bytes([message[4], message[5]]),
                *ty,
                "{statement}"
            );
            assert_eq!(hex(&message[16..]), *body, "{statement}");
            assert_eq!(encoded.owner(101), Some(0));
            assert_eq!(encoded.owner(100), None);
            assert_eq!(encoded.owner(102), None);
        }
    }

    /// Add a chain, add a rule to it, delete another: one command of each message kind.
    fn three_commands() -> [Command; 3] {
        [
            Command::AddChain {
                chain: chain("a"),
                hook: None,
                comment: None,
            },
            Command::AddRule {
                chain: chain("a"),
                rule: Rule::verdict(Vec::new(), cmd::Verdict::Goto(chain("b"))),
            },
            Command::DeleteChain(chain("c")),
        ]
    }

    #[test]
    fn appended_batches_are_renumbered() {
        let commands: Vec<_> = three_commands()
            .iter()
            .map(|c| lower(IpFamily::V4, c).expect("supported"))
            .collect();
        let mut first = Batch::new(7);
        first.push(&commands[0], 1);
        let mut second = Batch::new(0);
        second.push(&commands[1], 0);
        second.push(&commands[2], 1);
        first.append(second, 10);
        assert_eq!(first.len(), 3);
        let mut expected = Batch::new(7);
        expected.push(&commands[0], 1);
        expected.push(&commands[1], 10);
        expected.push(&commands[2], 11);
        let (got, want) = (first.finish(), expected.finish());
        assert_eq!(got.bytes, want.bytes);
        assert_eq!(got.owners, want.owners);
        assert_eq!(got.fence_seq, want.fence_seq);
    }

    /// Appending a part larger than the batch (its buffer is reused) or smaller gives the
    /// same bytes as pushing everything into one batch.
    #[test]
    fn appending_a_larger_or_smaller_part_gives_the_same_batch() {
        let commands: Vec<_> = three_commands()
            .iter()
            .map(|c| lower(IpFamily::V4, c).expect("supported"))
            .collect();
        for (head, tail) in [(1, 40), (40, 1), (0, 3), (3, 0)] {
            let mut first = Batch::new(7);
            let mut expected = Batch::new(7);
            for i in 0..head {
                first.push(&commands[i % 3], i);
                expected.push(&commands[i % 3], i);
            }
            let mut second = Batch::new(0);
            for i in 0..tail {
                second.push(&commands[i % 3], i);
                expected.push(&commands[i % 3], 100 + i);
            }
            first.append(second, 100);
            first.push(&commands[0], 7);
            expected.push(&commands[0], 7);
            let (got, want) = (first.finish(), expected.finish());
            assert_eq!(got.bytes, want.bytes, "{head} + {tail}");
            assert_eq!(got.owners, want.owners, "{head} + {tail}");
            assert_eq!(got.fence_seq, want.fence_seq, "{head} + {tail}");
        }
    }

    #[test]
    fn batch_is_framed_and_flagged() {
        let commands = three_commands();
        let mut batch = Batch::new(7);
        for (i, c) in commands.iter().enumerate() {
            batch.push(&lower(IpFamily::V4, c).expect("supported"), i);
        }
        let encoded = batch.finish();
        let mut at = 0;
        let mut seen = Vec::new();
        while at < encoded.bytes.len() {
            let b = &encoded.bytes[at..];
            let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
            let ty = u16::from_ne_bytes([b[4], b[5]]);
            let flags = u16::from_ne_bytes([b[6], b[7]]);
            let seq = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
            seen.push((ty, flags, seq));
            at += len;
        }
        assert_eq!(
            seen,
            vec![
                (NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 7),
                (0x0a03, NLM_F_REQUEST | NLM_F_CREATE, 8),
                (0x0a06, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_APPEND, 9),
                (0x0a05, NLM_F_REQUEST, 10),
                (NFNL_MSG_BATCH_END, NLM_F_REQUEST, 11),
            ]
        );
        assert_eq!(encoded.fence_seq, 12);
        assert_eq!(encoded.owner(9), Some(1));
        let fence = fence(12);
        assert_eq!(
            u16::from_ne_bytes([fence[6], fence[7]]),
            NLM_F_REQUEST | NLM_F_ACK
        );
    }
}
