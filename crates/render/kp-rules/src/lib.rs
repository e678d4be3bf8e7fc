//! Pure rule renderers: the proxy state in, dataplane rule text out.
//!
//! Nothing here touches the kernel or the filesystem; the dataplane crates apply what these
//! renderers return. Keeping rendering pure makes every layout testable with snapshots and
//! lets the same text be checked with `iptables-restore --test` in a throwaway namespace.
//!
//! - [`iptables`]: upstream kube-proxy's iptables-mode layout (`KUBE-SERVICES`,
//!   `KUBE-SVC-*`, `KUBE-SEP-*`, ...), for `iptables-restore --noflush`.
//! - [`nftables`]: upstream's nftables-mode layout (one `kube-proxy` table per family, verdict
//!   maps), as one `nft -f -` transaction per sync.
//! - [`ipvs`]: upstream's ipvs-mode layout: virtual and real servers, kube-ipvs0 addresses,
//!   ipsets (as `ipset restore` diffs) and the few iptables rules that go with them.
//! - [`explain`]: the same decisions as a readable answer for `kube-proxy explain`, and the
//!   rule comparison behind `--verify`.
//! - [`userspace`]: userspace mode's capture rules (redirects to the relay's ports).
//! - [`plan`]: the per-service-port decisions (chains, policies, filters, firewall,
//!   masquerade, affinity) shared by the iptables renderer and `explain`.

pub mod explain;
mod family;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod plan;
pub mod userspace;
