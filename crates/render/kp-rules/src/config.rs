//! The proxy configuration every renderer reads (iptables, nftables, explain): the
//! masquerade mark, the local-traffic detector, which node addresses accept NodePorts,
//! and the node IPs detected at start-up. Shared here so that no mode imports another
//! mode's module for it.

use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};

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

/// Which node addresses accept NodePort traffic: the `nodePortAddresses` setting
/// (`kp_config::NodePortAddressesSetting`) resolved against this node's addresses.
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

impl NodePortAddresses {
    /// The addresses nftables mode accepts NodePorts on in `family`, or `None` for every
    /// local address but loopback. Loopback is never one (the kernel cannot DNAT it without
    /// `route_localnet`; localhost NodePorts are the userspace listeners' of
    /// `KubeProxyNFTablesLocalhostNodePorts`, `kp_userspace::localhost`): both nftables
    /// layouts read this one answer, so they cannot disagree on it.
    pub fn nftables_ips(&self, family: IpFamily) -> Option<Vec<IpAddr>> {
        match self.for_family(family) {
            NodePortAddresses::All => None,
            NodePortAddresses::Ips(ips) => {
                let mut ips: Vec<IpAddr> = ips.into_iter().filter(|ip| !ip.is_loopback()).collect();
                ips.sort_unstable();
                ips.dedup();
                Some(ips)
            }
        }
    }
}

/// nftables mode's rejection of localhost NodePort traffic it does not serve
/// (`KubeProxyNFTablesLocalhostNodePorts`, upstream 1.37, KEP-6032). With the gate on,
/// upstream rejects a connection or datagram to a NodePort on `127.0.0.0/8` or `::1` in its
/// table, counted per protocol: UDP and SCTP always (the userspace listeners are TCP only),
/// TCP too in a family whose NodePorts no listener serves (loopback not named explicitly in
/// `nodePortAddresses`). Off (the default), nothing is rejected: the kernel refuses what no
/// socket listens on. Both layouts write the rejects, each looking the NodePort up in a
/// `proto . port` set of its own (the chain layout's NodePort maps hold `goto` elements, which
/// the kernel refuses once a rule looks such a map up as a set: EOPNOTSUPP).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalhostNodePortRejects {
    /// The gate is on.
    pub enabled: bool,
    /// The families whose loopback TCP NodePorts the userspace listeners serve.
    pub served: Vec<IpFamily>,
}

impl LocalhostNodePortRejects {
    /// The protocols whose localhost NodePort traffic `family`'s table rejects.
    pub fn protocols(&self, family: IpFamily) -> &'static [Protocol] {
        const UNSERVED: [Protocol; 2] = [Protocol::Udp, Protocol::Sctp];
        const ALL: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];
        match (self.enabled, self.served.contains(&family)) {
            (false, _) => &[],
            (true, true) => &UNSERVED,
            (true, false) => &ALL,
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
    /// nftables mode: which localhost NodePort traffic is rejected (KEP-6032).
    pub nftables_localhost_rejects: LocalhostNodePortRejects,
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
            nftables_localhost_rejects: LocalhostNodePortRejects::default(),
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

impl RenderConfig {
    /// The mark value (`1 << masquerade_bit`).
    pub fn masquerade_mark(&self) -> Result<u32, RenderError> {
        if self.masquerade_bit > MAX_MASQUERADE_BIT {
            return Err(RenderError::MasqueradeBit(self.masquerade_bit));
        }
        Ok(1u32 << self.masquerade_bit)
    }

    /// Checks everything the renderers ([`crate::iptables::render`], [`crate::iptables::setup`],
    /// [`crate::nftables::render`]) would reject.
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
    /// The detector of `family`; an error for a configuration no rule can express.
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
