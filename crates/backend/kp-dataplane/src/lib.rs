//! The I/O side of the proxy modes: everything that touches the kernel, each piece behind a
//! small trait with an in-memory fake so the logic around it is testable anywhere.
//!
//! - [`exec`]: running `iptables`, `iptables-save` and `iptables-restore` ([`exec::RuleRunner`]).
//! - [`iptables`]: [`iptables::IptablesBackend`], the `iptables` proxy mode (a
//!   [`kp_core::backend::Backend`]) applying `kp_rules::iptables` renders over nf_tables
//!   netlink ([`iptables::netlink`]) or with `iptables-restore`, and its cleanup; on
//!   iptables-legacy its canary reads nat only when nat's size changed (`kp-xtinfo`).
//! - [`nftables`]: the `nftables` proxy mode: `kp_rules::nftables` commands sent as
//!   transactions over netlink by `kp-nftnl` (`nft -f -` when the encoder refuses a value),
//!   adopting the existing table on restart, and its cleanup; [`nftables::layout`] writes
//!   the verdict-free layout (element transactions; the table read back on full syncs).
//! - [`ipvs`]: [`ipvs::IpvsBackend`], the `ipvs` proxy mode: IPVS over netlink
//!   (`kp-ipvs`), the kube-ipvs0 dummy device over rtnetlink, ipsets and a few iptables rules.
//! - [`interfaces`]: this node's interface addresses, over rtnetlink.
//! - [`conntrack`]: which UDP/SCTP conntrack entries a sync made stale, and deleting them over
//!   ctnetlink ([`conntrack::Conntrack`]).
//! - [`sync`]: the sync skeleton every backend shares (per-family errors, stale-flow
//!   bookkeeping), so a mode writes only its own apply; whether a sync is full or partial
//!   is the core's to ask.
//! - [`sysctls`]: conntrack table size and timeouts, `route_localnet`
//!   ([`sysctls::Sysctl`]).
//! - [`xtables`]: which iptables backend (legacy or nf_tables) the node uses, detected as
//!   upstream's image does; the binary then hands that backend's [`exec::Tools`] to every mode.
//! - [`watch`]: nf_tables notifications read on a thread, telling the proxier when another
//!   program changed its rules.
//!
//! Each I/O trait has an in-memory fake (`FakeRunner`, `FakeNft`, `FakeConntrack`, ...)
//! behind the `test-util` feature, with `testutil`'s state builders; dev-dependencies
//! enable it, the product never does.
//!
//! The userspace mode's backend lives in `kp-userspace`. Nothing here decides *what* to
//! program; that is `kp-core` (state, change tracking) and `kp-rules` (the rules).

mod blocking;
pub mod conntrack;
pub mod exec;
pub mod interfaces;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod sync;
pub mod sysctls;
pub mod watch;
pub mod xtables;

#[cfg(any(test, feature = "test-util"))]
pub mod testutil;
