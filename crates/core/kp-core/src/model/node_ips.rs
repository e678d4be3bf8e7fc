//! This node's IPs as upstream kube-proxy determines them ("node IPs"), pure.
//!
//! Upstream reads them from its own Node object once at start-up (its node manager in
//! `pkg/proxy`, `GetNodeHostIPs` in `pkg/util/node`): the first `InternalIP` of
//! `status.addresses` (an `ExternalIP` when there is none), plus the first address of the
//! other family, if any. A specific `bindAddress` (not `0.0.0.0`/`::`) then replaces the
//! node IP of its own family and makes that family the primary one. A family still without an
//! IP gets the loopback address, which is also what a node without any known IP ends up
//! with. The proxy uses these where upstream uses "the node IP": `nodePortAddresses:
//! primary` (each non-loopback node IP as a /32 or /128) and the allowance
//! `loadBalancerSourceRanges` gives the node's own traffic.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::{IpFamily, NodeInfo};

impl NodeInfo {
    /// Upstream's `GetNodeHostIPs` over `addresses` (already InternalIPs first, then
    /// ExternalIPs): the first address, then the first one of the other family. Empty when
    /// the Node lists no IP.
    pub fn host_ips(&self) -> Vec<IpAddr> {
        host_ips(&self.addresses)
    }
}

/// See [`NodeInfo::host_ips`].
pub fn host_ips(addresses: &[IpAddr]) -> Vec<IpAddr> {
    let Some(first) = addresses.first().copied() else {
        return Vec::new();
    };
    let other = addresses
        .iter()
        .copied()
        .find(|ip| ip.is_ipv4() != first.is_ipv4());
    std::iter::once(first).chain(other).collect()
}

/// This node's IP of each family and which family is primary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeIps {
    /// The family of the first node IP (IPv4 when unknown), or of a specific `bindAddress`.
    pub primary: IpFamily,
    /// The IPv4 node IP; `127.0.0.1` when unknown.
    pub v4: IpAddr,
    /// The IPv6 node IP; `::1` when unknown.
    pub v6: IpAddr,
}

impl NodeIps {
    /// Upstream's `detectNodeIPs`: `raw` is [`host_ips`] of the Node (empty when there was no
    /// Node or it had no IP), `bind_address` the configured `bindAddress`, which wins for its
    /// family when it is a specific address.
    pub fn detect(raw: &[IpAddr], bind_address: Option<IpAddr>) -> Self {
        let mut ips = Self {
            primary: raw.first().map_or(IpFamily::V4, IpFamily::of),
            v4: IpAddr::V4(Ipv4Addr::LOCALHOST),
            v6: IpAddr::V6(Ipv6Addr::LOCALHOST),
        };
        for ip in raw.iter().take(2) {
            ips.set(*ip);
        }
        if let Some(bind) = bind_address.filter(|ip| !ip.is_unspecified()) {
            ips.primary = IpFamily::of(&bind);
            ips.set(bind);
        }
        ips
    }

    fn set(&mut self, ip: IpAddr) {
        match IpFamily::of(&ip) {
            IpFamily::V4 => self.v4 = ip,
            IpFamily::V6 => self.v6 = ip,
        }
    }

    /// The node IP of `family`.
    pub fn get(&self, family: IpFamily) -> IpAddr {
        match family {
            IpFamily::V4 => self.v4,
            IpFamily::V6 => self.v6,
        }
    }

    /// Both node IPs, the primary family's first.
    pub fn all(&self) -> [IpAddr; 2] {
        match self.primary {
            IpFamily::V4 => [self.v4, self.v6],
            IpFamily::V6 => [self.v6, self.v4],
        }
    }

    /// The node IPs that are real addresses (not the loopback stand-ins), primary first:
    /// what `nodePortAddresses: primary` restricts NodePorts to. A family missing here is
    /// not restricted by `primary`, as upstream.
    pub fn known(&self) -> Vec<IpAddr> {
        self.all()
            .into_iter()
            .filter(|ip| !ip.is_loopback())
            .collect()
    }

    /// Whether the primary family's node IP is the loopback stand-in (upstream then logs
    /// that it cannot determine the node's IP).
    pub fn primary_unknown(&self) -> bool {
        self.get(self.primary).is_loopback()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("literal")
    }

    #[test]
    fn host_ips_take_the_first_of_each_family_internal_first() {
        // node_info lists InternalIPs before ExternalIPs already.
        let addresses = [
            ip("10.0.0.5"),
            ip("10.0.0.6"),
            ip("fd00::5"),
            ip("fd00::6"),
            ip("203.0.113.5"),
        ];
        assert_eq!(host_ips(&addresses), [ip("10.0.0.5"), ip("fd00::5")]);
        assert_eq!(
            host_ips(&[ip("fd00::5"), ip("10.0.0.5")]),
            [ip("fd00::5"), ip("10.0.0.5")]
        );
        assert_eq!(
            host_ips(&[ip("10.0.0.5"), ip("10.0.0.6")]),
            [ip("10.0.0.5")]
        );
        assert!(host_ips(&[]).is_empty());
    }

    #[test]
    fn detect_follows_upstream_precedence() {
        let dual = NodeIps::detect(&[ip("10.0.0.5"), ip("fd00::5")], None);
        assert_eq!(dual.primary, IpFamily::V4);
        assert_eq!(dual.all(), [ip("10.0.0.5"), ip("fd00::5")]);
        assert_eq!(dual.known(), [ip("10.0.0.5"), ip("fd00::5")]);
        assert!(!dual.primary_unknown());

        let v6_first = NodeIps::detect(&[ip("fd00::5"), ip("10.0.0.5")], None);
        assert_eq!(v6_first.primary, IpFamily::V6);
        assert_eq!(v6_first.known(), [ip("fd00::5"), ip("10.0.0.5")]);

        // Single-stack: the other family keeps its loopback stand-in, left out of known().
        let single = NodeIps::detect(&[ip("10.0.0.5")], None);
        assert_eq!(single.get(IpFamily::V6), ip("::1"));
        assert_eq!(single.known(), [ip("10.0.0.5")]);

        // A specific bindAddress overrides its family and makes it primary; 0.0.0.0 does
        // nothing.
        let bound = NodeIps::detect(&[ip("10.0.0.5"), ip("fd00::5")], Some(ip("fd00::9")));
        assert_eq!(bound.primary, IpFamily::V6);
        assert_eq!(bound.all(), [ip("fd00::9"), ip("10.0.0.5")]);
        assert_eq!(
            NodeIps::detect(&[ip("10.0.0.5")], Some(ip("0.0.0.0"))),
            single
        );

        // Nothing known: loopback for both, primary IPv4, reported as unknown.
        let none = NodeIps::detect(&[], None);
        assert!(none.primary_unknown());
        assert!(none.known().is_empty());
        assert_eq!(none.all(), [ip("127.0.0.1"), ip("::1")]);
        // bindAddress alone is enough.
        let only_bind = NodeIps::detect(&[], Some(ip("192.168.1.9")));
        assert_eq!(only_bind.known(), [ip("192.168.1.9")]);
    }
}
