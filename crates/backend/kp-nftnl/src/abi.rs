//! nf_tables' netlink numbers, in one place: the nfnetlink subsystem and batch messages, the
//! notification group, and the `NFTA_*` attribute numbers of tables, chains, rules, sets,
//! elements and data (`linux/netfilter/nfnetlink.h`, `linux/netfilter/nf_tables.h`; the
//! names are the kernel's). The encoder ([`crate::codec`]), iptables-nft's rules
//! ([`crate::xt`]), the layout's element messages ([`crate::layout`]), the monitor and the
//! backends that read dumps (`kp-dataplane`) all take them from here. Expression attributes
//! stay with the expressions ([`crate::expr`]), the only module that writes them.
#![allow(missing_docs)]

/// `NFNL_SUBSYS_NFTABLES`: the high byte of every nf_tables message type.
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// `NFNL_MSG_BATCH_BEGIN` / `_END`: the frame of one transaction.
pub const NFNL_MSG_BATCH_BEGIN: u16 = 16;
pub const NFNL_MSG_BATCH_END: u16 = 17;
/// `NFNLGRP_NFTABLES`: the multicast group of nf_tables' change notifications.
pub const NFNLGRP_NFTABLES: u32 = 7;
/// `NFT_MSG_NEWGEN`: a commit's notification (and the answer to `NFT_MSG_GETGEN`).
pub const NFT_MSG_NEWGEN: u16 = 15;

// The generation (`NFT_MSG_NEWGEN`): its id and who committed it.
pub const NFTA_GEN_ID: u16 = 1;
pub const NFTA_GEN_PROC_PID: u16 = 2;
pub const NFTA_GEN_PROC_NAME: u16 = 3;

// Tables.
pub const NFTA_TABLE_NAME: u16 = 1;
pub const NFTA_TABLE_FLAGS: u16 = 2;
pub const NFTA_TABLE_USERDATA: u16 = 6;

// Chains and their hooks.
pub const NFTA_CHAIN_TABLE: u16 = 1;
pub const NFTA_CHAIN_NAME: u16 = 3;
pub const NFTA_CHAIN_HOOK: u16 = 4;
pub const NFTA_CHAIN_POLICY: u16 = 5;
pub const NFTA_CHAIN_TYPE: u16 = 7;
pub const NFTA_CHAIN_USERDATA: u16 = 12;
pub const NFTA_HOOK_HOOKNUM: u16 = 1;
pub const NFTA_HOOK_PRIORITY: u16 = 2;

// Rules, their expression lists and iptables-nft's compat attributes.
pub const NFTA_RULE_TABLE: u16 = 1;
pub const NFTA_RULE_CHAIN: u16 = 2;
pub const NFTA_RULE_HANDLE: u16 = 3;
pub const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub const NFTA_RULE_COMPAT: u16 = 5;
pub const NFTA_RULE_POSITION: u16 = 6;
pub const NFTA_RULE_USERDATA: u16 = 7;
pub const NFTA_RULE_COMPAT_PROTO: u16 = 1;
pub const NFTA_RULE_COMPAT_FLAGS: u16 = 2;
/// `NFT_RULE_COMPAT_F_INV`: the protocol match is inverted.
pub const NFT_RULE_COMPAT_F_INV: u32 = 1 << 1;
pub const NFTA_LIST_ELEM: u16 = 1;
pub const NFTA_EXPR_NAME: u16 = 1;
pub const NFTA_EXPR_DATA: u16 = 2;
pub const NFTA_MATCH_NAME: u16 = 1;
pub const NFTA_MATCH_REV: u16 = 2;
pub const NFTA_MATCH_INFO: u16 = 3;
pub const NFTA_COUNTER_BYTES: u16 = 1;
pub const NFTA_COUNTER_PACKETS: u16 = 2;

// Sets and maps.
pub const NFTA_SET_TABLE: u16 = 1;
pub const NFTA_SET_NAME: u16 = 2;
pub const NFTA_SET_FLAGS: u16 = 3;
pub const NFTA_SET_KEY_TYPE: u16 = 4;
pub const NFTA_SET_KEY_LEN: u16 = 5;
pub const NFTA_SET_DATA_TYPE: u16 = 6;
pub const NFTA_SET_DATA_LEN: u16 = 7;
pub const NFTA_SET_DESC: u16 = 9;
pub const NFTA_SET_ID: u16 = 10;
pub const NFTA_SET_TIMEOUT: u16 = 11;
pub const NFTA_SET_USERDATA: u16 = 13;
pub const NFTA_SET_DESC_SIZE: u16 = 1;
/// `NFT_SET_*` flags.
pub const SET_ANONYMOUS: u32 = 0x1;
pub const SET_CONSTANT: u32 = 0x2;
pub const SET_INTERVAL: u32 = 0x4;
pub const SET_MAP: u32 = 0x8;

// Set elements.
pub const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
pub const NFTA_SET_ELEM_LIST_SET: u16 = 2;
pub const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;
pub const NFTA_SET_ELEM_KEY: u16 = 1;
pub const NFTA_SET_ELEM_DATA: u16 = 2;
pub const NFTA_SET_ELEM_FLAGS: u16 = 3;
pub const NFTA_SET_ELEM_USERDATA: u16 = 6;
pub const NFTA_SET_ELEM_KEY_END: u16 = 10;
/// `NFT_SET_ELEM_INTERVAL_END`.
pub const SET_ELEM_INTERVAL_END: u32 = 0x1;

// Data: values and verdicts.
pub const NFTA_DATA_VALUE: u16 = 1;
pub const NFTA_DATA_VERDICT: u16 = 2;
pub const NFTA_VERDICT_CODE: u16 = 1;
pub const NFTA_VERDICT_CHAIN: u16 = 2;
