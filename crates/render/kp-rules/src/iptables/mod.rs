//! iptables mode: the pure renderer of upstream kube-proxy's rule layout.
//!
//! [`render`] turns the proxy state into the text of one `iptables-restore --noflush` run
//! (tables `filter` and `nat`), with upstream's chain names and hashes so that a node can move
//! between upstream kube-proxy and this one. [`setup`] lists what must exist once, outside
//! the restore: the jumps from the built-in chains and the canary chains. Applying either is
//! the caller's job; nothing here touches the kernel.
//!
//! Every string that comes from an API object only appears inside a rule comment, encoded as
//! [`comment`] documents, so a hostile name cannot add rules or arguments.

pub mod comment;
pub mod names;
mod render;
pub mod rule;
mod setup;

use std::collections::BTreeSet;

use kp_core::backend::SyncKind;
use kp_core::model::ServiceName;

pub use render::{DEFAULT_CHUNK_BYTES, probability, render, render_into, render_to};
pub use rule::{
    AddrType, AddrTypeSide, Address, Comment, CtStates, Entry, MarkOp, Match, Probability,
    RecentAction, RejectWith, Restore, RestoreText, Rule, RuleSink, TableRestore, Target,
};
pub use setup::{CANARY_CHAIN, JumpRule, Setup, SharedRule, Table, localnet_block_rule, setup};

// The shared render configuration, re-exported where callers have always found it.
pub(crate) use crate::config::Detector;
pub use crate::config::{
    DEFAULT_LARGE_CLUSTER_THRESHOLD, DEFAULT_MASQUERADE_BIT, LocalDetector, MAX_MASQUERADE_BIT,
    NodePortAddresses, RenderConfig, RenderError, node_ip,
};

/// nat chain every service dispatch starts from (also a filter chain for REJECT/DROP).
pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
/// filter chain rejecting or dropping external traffic to services without endpoints.
pub const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
/// nat: NodePort dispatch; filter: health-check node port ACCEPTs.
pub const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
/// nat chain turning the masquerade mark into MASQUERADE.
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat chain setting the masquerade mark.
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// filter chain accepting forwarded service traffic (and dropping conntrack INVALID).
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
/// filter chain dropping LB traffic that `KUBE-FW-*` did not accept.
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// filter chain (shared with kubelet) blocking outside traffic to 127.0.0.0/8, needed because
/// localhost NodePorts require `route_localnet`.
pub const KUBE_FIREWALL: &str = "KUBE-FIREWALL";

/// Why [`render_to`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The configuration cannot be rendered (nothing was written).
    #[error(transparent)]
    Render(#[from] RenderError),
    /// The writer failed (the input written so far is incomplete).
    #[error("writing the restore input")]
    Write(#[from] std::io::Error),
}

impl Detector {
    /// The match for "from a local pod" (`-s CIDR`, `-i IFACE`), or its negation.
    fn matching(&self, negated: bool) -> Match<'_> {
        match self {
            Detector::Cidr(cidr) => Match::Source {
                addr: Address::Net(*cidr),
                negated,
            },
            Detector::Interface { name, wildcard } => Match::InInterface {
                name: std::borrow::Cow::Borrowed(name),
                wildcard: *wildcard,
                negated,
            },
        }
    }

    /// The match for "from a local pod" (`-s CIDR`, `-i IFACE`).
    pub(crate) fn if_local(&self) -> Match<'_> {
        self.matching(false)
    }

    /// The match for "not from a local pod" (`! -s CIDR`, `! -i IFACE`).
    pub(crate) fn if_not_local(&self) -> Match<'_> {
        self.matching(true)
    }
}

/// What one sync covers.
#[derive(Clone, Copy, Debug)]
pub struct SyncScope<'a> {
    /// Full: every chain is written. Partial: per-service nat chains only for `changed`.
    pub kind: SyncKind,
    /// Services whose Service or EndpointSlices changed since the last successful sync.
    pub changed: &'a BTreeSet<ServiceName>,
    /// The per-service nat chains in place now: the previous [`RenderOutput::chains`] after
    /// a successful restore, or the `KUBE-SVC/SVL/EXT/FW/SEP` chains `iptables-save -t nat`
    /// lists. Those this render does not produce are flushed and deleted. Pass an empty set
    /// to skip the cleanup (upstream defers it in large clusters); the caller must then keep
    /// the skipped chains in its own bookkeeping.
    pub existing_chains: &'a BTreeSet<String>,
}

/// The rendered restore input and its bookkeeping.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RenderOutput {
    /// Input for `iptables-restore --noflush` (or `ip6tables-restore`).
    pub text: String,
    /// The per-service nat chains that exist once `text` is applied, written or not: the
    /// next sync's [`SyncScope::existing_chains`].
    pub chains: BTreeSet<String>,
    /// The stale chains `text` deletes.
    pub deleted: BTreeSet<String>,
    /// `-A` lines in `text`.
    pub rules_written: usize,
    /// Rules in the filter table once applied (all written every sync).
    pub filter_rules: usize,
    /// Rules in kube-proxy's nat chains once applied, including the chains of unchanged
    /// services a partial sync did not rewrite (upstream's `iptables_total{table="nat"}`).
    pub nat_rules: usize,
    /// More endpoints than the threshold: endpoint comments were omitted.
    pub large_cluster: bool,
}

#[cfg(test)]
mod tests;
