//! nf_tables over netlink, without the `nft` binary.
//!
//! `nft -f -` spends most of a small transaction dumping every chain of the table into its
//! cache (hundreds of milliseconds once the table holds 100k chains) and most of a large
//! one parsing and evaluating text. This crate sends the same transaction itself:
//!
//! - [`lower`](mod@lower) translates the renderer's typed commands ([`kp_rules::nftables::cmd`]) into
//!   the operations and expressions nft would send for them (no text is parsed: the
//!   renderer's `Display` of the same commands is only for `nft -f -`, snapshots and error
//!   messages), or says which value it cannot send, so the caller can hand the transaction
//!   to `nft` instead;
//! - [`class`] lowers the verdict-free layout's slot-count classes (sets, `typeof` maps and
//!   pick rules, described as data by the renderer) the same way, for a partial sync that
//!   creates one in its element transaction;
//! - [`codec`] encodes commands as nf_tables netlink messages inside one
//!   `NFNL_MSG_BATCH_BEGIN` ... `END` batch: one atomic transaction, as `nft -f` sends it,
//!   with the attributes and user data `nft` 1.0.6 sends for the same statement (golden
//!   tests compare bytes for several; a named set's elements and the lookups of the typed
//!   commands name it only, while anonymous sets and the rules of a class created in the
//!   same batch also carry its batch id, as nft's do), so `nft list` shows the result
//!   exactly as if `nft` had applied it;
//! - [`socket`] sends a batch over a `NETLINK_NETFILTER` socket and maps a kernel error back
//!   to the statement that caused it. Nothing is dumped. A large full sync goes as several
//!   transactions in the safe order of [`Transaction::steps`](kp_rules::nftables::Transaction::steps),
//!   each encoded only when the one before it is applied, so the process never holds the
//!   netlink bytes of the whole sync (the kernel takes one batch per `sendmsg`, so a single
//!   transaction cannot be streamed).
//! - [`abi`] holds nf_tables' netlink numbers (subsystem, batch messages, `NFTA_*`
//!   attributes) for all of them and for the backends that read dumps;
//! - [`counters`] reads the table's named counters back (metrics counted in the kernel);
//! - [`monitor`] reads nf_tables' change notifications (what `nft monitor` shows), so the
//!   proxy notices another program changing its rules.

pub mod abi;
pub mod class;
pub mod codec;
pub mod counters;
pub mod expr;
pub mod layout;
pub mod lower;
pub mod monitor;
pub mod socket;
pub mod xt;

pub use codec::{Batch, Family};
pub use lower::{LowerError, Lowered, lower};
pub use socket::{ApplyError, DEFAULT_MAX_STEP_COMMANDS, NftSocket, SharedSocket};
