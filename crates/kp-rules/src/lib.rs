//! Pure rule renderers: the proxy state in, dataplane rule text out.
//!
//! Nothing here touches the kernel or the filesystem; the dataplane crates apply what these
//! renderers return. Keeping rendering pure makes every layout testable with snapshots and
//! lets the same text be checked with `iptables-restore --test` in a throwaway namespace.
//!
//! - [`iptables`]: upstream kube-proxy's iptables-mode layout (`KUBE-SERVICES`,
//!   `KUBE-SVC-*`, `KUBE-SEP-*`, ...), for `iptables-restore --noflush`.

pub mod iptables;
pub mod nftables;
pub mod explain;
