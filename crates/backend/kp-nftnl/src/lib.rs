//! nf_tables over netlink, without the `nft` binary.
//!
//! `nft -f -` spends most of a small transaction dumping every chain of the table into its
//! cache (hundreds of milliseconds once the table holds 100k chains) and most of a large
//! one parsing and evaluating text. This crate sends the same transaction itself:
//!
//! - [`script`] turns the renderer's script text (the statement shapes `kp_rules::nftables`
//!   emits, nothing more) into typed [`script::Command`]s, or says which statement it does
//!   not support, so the caller can hand the whole script to `nft` instead;
//! - [`codec`] encodes commands as nf_tables netlink messages inside one
//!   `NFNL_MSG_BATCH_BEGIN` ... `END` batch: one atomic transaction, as `nft -f` sends it,
//!   with the attributes and user data `nft` 1.0.6 sends for the same statement (golden
//!   tests compare bytes for several; lookups and set elements leave out the set's batch id,
//!   which the kernel only needs for sets without a name), so `nft list` shows the result
//!   exactly as if `nft` had applied it;
//! - [`socket`] sends a batch over a `NETLINK_NETFILTER` socket and maps a kernel error back
//!   to the statement that caused it. Nothing is dumped.

pub mod codec;
pub mod expr;
pub mod script;
pub mod socket;
pub mod xt;

pub use codec::{Batch, Family};
pub use script::{Command, ScriptError, for_each_command, parse_script};
pub use socket::{ApplyError, NftSocket, SharedSocket};

/// Translate `script` and apply it as one transaction: the whole script or nothing.
pub fn apply_script(socket: &mut NftSocket, script: &str) -> Result<(), ApplyError> {
    socket.apply_script(script)
}
