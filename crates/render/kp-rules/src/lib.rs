//! Pure rule renderers: the proxy state in, each mode's rules out, as typed values.
//!
//! Nothing here touches the kernel or the filesystem; the backend crates apply what these
//! renderers return (over netlink, or through the tools when the encoder refuses a value).
//! Keeping rendering pure makes every layout testable with snapshots and lets the same rules
//! be applied by the real tools in a throwaway namespace.
//!
//! - [`config`]: the render configuration every mode reads (mark, local detector, NodePort
//!   addresses, node IPs).
//! - [`iptables`]: upstream kube-proxy's iptables-mode layout (`KUBE-SERVICES`,
//!   `KUBE-SVC-*`, `KUBE-SEP-*`, ...) as typed rules ([`iptables::rule`]) sent to a sink; their
//!   `Display` is the `iptables-restore --noflush` text.
//! - [`nftables`]: upstream's nftables-mode layout (one `kube-proxy` table per family, verdict
//!   maps) as typed commands ([`nftables::cmd`]); partial syncs plan only the changed services,
//!   and a full sync can be rendered in steps. Their `Display` is the `nft -f` script.
//!   [`nftables::layout`] is the opt-in verdict-free layout: fixed chains written once, every
//!   service and endpoint an element of a data map or set.
//! - [`ipvs`]: upstream's ipvs-mode layout: virtual and real servers, kube-ipvs0 addresses,
//!   ipsets (as `ipset restore` diffs) and the few iptables rules that go with them.
//! - [`userspace`]: userspace mode's capture rules (DNAT or REDIRECT to the relay's ports).
//! - [`plan`]: the per-service-port decisions (chains, policies, filters, firewall,
//!   masquerade, affinity) made once for the iptables and nftables renderers and `explain`.
//! - [`explain`]: the same decisions as a readable answer for `kube-proxy explain`, and the
//!   rule comparison behind `--verify`.

pub mod config;
pub mod explain;
mod family;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod plan;
#[cfg(any(test, feature = "test-util"))]
pub mod testutil;
pub mod userspace;
