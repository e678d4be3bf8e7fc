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
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, ServiceName};

pub use render::{DEFAULT_CHUNK_BYTES, probability, render, render_into, render_to};
pub use rule::{
    AddrType, AddrTypeSide, Address, Comment, CtStates, Entry, MarkOp, Match, Probability,
    RecentAction, RejectWith, Restore, RestoreText, Rule, RuleSink, TableRestore, Target,
};
pub use setup::{CANARY_CHAIN, JumpRule, Setup, SharedRule, Table, localnet_block_rule, setup};

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

/// Upstream's default masquerade bit (mark `0x4000`).
pub const DEFAULT_MASQUERADE_BIT: u8 = 14;
/// Marks are 32-bit, so the bit index is at most 31.
pub const MAX_MASQUERADE_BIT: u8 = 31;
/// Upstream's large-cluster threshold: above this many endpoints (of one family) endpoint
/// comments are dropped to shrink the ruleset by ~40%.
pub const DEFAULT_LARGE_CLUSTER_THRESHOLD: usize = 1000;
/// Linux interface names are at most 15 bytes (`IFNAMSIZ` minus the NUL).
const MAX_INTERFACE_NAME: usize = 15;

/// How traffic from local pods is recognised (upstream's `detectLocalMode`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LocalDetector {
    /// No detector: pod traffic cannot be told apart, so ClusterIP traffic is not masqueraded
    /// (unless masqueradeAll) and eTP Local has no pod short-circuit.
    #[default]
    None,
    /// Source inside these CIDRs is local (ClusterCIDR or NodeCIDR mode). At most one per
    /// family; a family without one has no detector.
    Cidrs(Vec<IpNet>),
    /// Traffic entering through this bridge is local (BridgeInterface mode).
    BridgeInterface(String),
    /// Traffic entering through interfaces with this name prefix is local
    /// (InterfaceNamePrefix mode).
    InterfaceNamePrefix(String),
}

/// Which node addresses accept NodePort traffic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address (`--nodeport-addresses` unset).
    #[default]
    All,
    /// Only these addresses: the node's addresses matching `--nodeport-addresses`, resolved
    /// by the caller (that needs the interface list, which is I/O). An unspecified address
    /// (`0.0.0.0`, `::`) leaves its whole family unrestricted, as upstream treats a family
    /// that has no CIDR in the list (or a `0.0.0.0/0`, `::/0` one); any other family accepts
    /// NodePorts only on its listed addresses, nowhere when none is listed.
    Ips(Vec<IpAddr>),
}

impl NodePortAddresses {
    /// `family`'s part: [`NodePortAddresses::All`] when that family is unrestricted, else
    /// its own listed addresses (possibly none).
    pub fn for_family(&self, family: IpFamily) -> NodePortAddresses {
        match self {
            NodePortAddresses::All => NodePortAddresses::All,
            NodePortAddresses::Ips(ips) => {
                let mine = ips.iter().copied().filter(|ip| IpFamily::of(ip) == family);
                if mine.clone().any(|ip| ip.is_unspecified()) {
                    NodePortAddresses::All
                } else {
                    NodePortAddresses::Ips(mine.collect())
                }
            }
        }
    }
}

/// The node IP of `family` where upstream uses "the node IP" (the allowance
/// `loadBalancerSourceRanges` gives the node's own traffic): from `configured` (the IPs the
/// proxy detected at start-up, [`RenderConfig::node_ips`]) or, when that is empty, the
/// Node's own first address of that family.
pub fn node_ip(
    configured: &[IpAddr],
    node: &kp_core::model::NodeInfo,
    family: IpFamily,
) -> Option<IpAddr> {
    let from_node;
    let ips = if configured.is_empty() {
        from_node = node.host_ips();
        &from_node
    } else {
        configured
    };
    ips.iter().copied().find(|ip| IpFamily::of(ip) == family)
}

/// The proxy configuration the renderer depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderConfig {
    /// Bit of the packet mark that requests masquerading (`iptables.masqueradeBit`).
    pub masquerade_bit: u8,
    /// Masquerade all ClusterIP traffic (`iptables.masqueradeAll`).
    pub masquerade_all: bool,
    /// How local pod traffic is recognised.
    pub local_detector: LocalDetector,
    /// Which node addresses accept NodePorts.
    pub node_port_addresses: NodePortAddresses,
    /// This node's IP of each family as detected at start-up (`kp_core::model::NodeIps`:
    /// the Node's, `bindAddress`, or loopback), for [`node_ip`]. Empty: the Node's addresses
    /// in the state are used.
    pub node_ips: Vec<IpAddr>,
    /// Accept NodePorts on 127.0.0.0/8 (`iptables.localhostNodePorts`, IPv4 only).
    pub localhost_node_ports: bool,
    /// Drop forwarded packets in conntrack state INVALID. Upstream omits the rule when
    /// `nf_conntrack_tcp_be_liberal` is set.
    pub drop_invalid: bool,
    /// Use `MASQUERADE --random-fully` (when the kernel and iptables support it).
    pub random_fully: bool,
    /// Above this many endpoints, endpoint comments are omitted.
    pub large_cluster_threshold: usize,
}

impl Default for RenderConfig {
    /// Upstream's defaults.
    fn default() -> Self {
        Self {
            masquerade_bit: DEFAULT_MASQUERADE_BIT,
            masquerade_all: false,
            local_detector: LocalDetector::None,
            node_port_addresses: NodePortAddresses::All,
            node_ips: Vec::new(),
            localhost_node_ports: true,
            drop_invalid: true,
            random_fully: true,
            large_cluster_threshold: DEFAULT_LARGE_CLUSTER_THRESHOLD,
        }
    }
}

/// A configuration the renderer cannot express as rules.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// The masquerade bit does not fit a 32-bit mark.
    #[error("masquerade bit {0} is out of range 0-31")]
    MasqueradeBit(u8),
    /// More than one local-detector CIDR for one family: one `-s` match cannot express it.
    #[error("local detector has {count} {family:?} CIDRs; at most one per family is supported")]
    DetectorCidrs {
        /// The family with too many CIDRs.
        family: IpFamily,
        /// How many it has.
        count: usize,
    },
    /// An interface name that is not a valid Linux interface name (or prefix).
    #[error("invalid local-detector interface {0:?}: want 1-15 of [A-Za-z0-9._@:-]")]
    InterfaceName(String),
}

/// Why [`render_to`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The configuration cannot be rendered (nothing was written).
    #[error(transparent)]
    Render(#[from] RenderError),
    /// The writer failed (the input written so far is incomplete).
    #[error("writing the restore input: {0}")]
    Write(#[from] std::io::Error),
}

impl RenderConfig {
    /// The mark value (`1 << masquerade_bit`).
    pub fn masquerade_mark(&self) -> Result<u32, RenderError> {
        if self.masquerade_bit > MAX_MASQUERADE_BIT {
            return Err(RenderError::MasqueradeBit(self.masquerade_bit));
        }
        Ok(1u32 << self.masquerade_bit)
    }

    /// Checks everything [`render`] and [`setup`] would reject.
    pub fn validate(&self) -> Result<(), RenderError> {
        self.masquerade_mark()?;
        for family in [IpFamily::V4, IpFamily::V6] {
            Detector::new(&self.local_detector, family)?;
        }
        Ok(())
    }
}

/// The local detector resolved for one family: what "from a local pod" matches, or nothing
/// when no detector applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Detector {
    /// Source inside this CIDR (`-s CIDR`).
    Cidr(IpNet),
    /// Entering through this interface, or any with this prefix (`-i NAME`, `-i PREFIX+`).
    Interface {
        /// The validated name or prefix.
        name: String,
        /// `name` is a prefix.
        wildcard: bool,
    },
}

impl Detector {
    pub(crate) fn new(
        detector: &LocalDetector,
        family: IpFamily,
    ) -> Result<Option<Self>, RenderError> {
        Ok(Some(match detector {
            LocalDetector::None => return Ok(None),
            LocalDetector::Cidrs(cidrs) => {
                let mine: Vec<&IpNet> = cidrs
                    .iter()
                    .filter(|cidr| IpFamily::of(&cidr.addr()) == family)
                    .collect();
                match mine.as_slice() {
                    [] => return Ok(None),
                    [cidr] => Detector::Cidr(cidr.trunc()),
                    _ => {
                        return Err(RenderError::DetectorCidrs {
                            family,
                            count: mine.len(),
                        });
                    }
                }
            }
            LocalDetector::BridgeInterface(name) => {
                check_interface(name, MAX_INTERFACE_NAME)?;
                Detector::Interface {
                    name: name.clone(),
                    wildcard: false,
                }
            }
            LocalDetector::InterfaceNamePrefix(prefix) => {
                // The `+` wildcard takes one byte of the name.
                check_interface(prefix, MAX_INTERFACE_NAME - 1)?;
                Detector::Interface {
                    name: prefix.clone(),
                    wildcard: true,
                }
            }
        }))
    }

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

/// Interface names come from configuration and end up outside comments, so only characters
/// that are plain words to `iptables-restore` are accepted.
fn check_interface(name: &str, max: usize) -> Result<(), RenderError> {
    let valid = !name.is_empty()
        && name.len() <= max
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b':' | b'-'));
    if valid {
        Ok(())
    } else {
        Err(RenderError::InterfaceName(name.to_owned()))
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
