//! The `nodePortAddresses` setting (`--nodeport-addresses`): which node addresses NodePort
//! Services (and health-check node ports) answer on.
//!
//! Upstream v1.37 (KEP-6032, kubernetes#138427) made the list a union of entries: CIDRs and
//! the keywords `primary` (the node's primary IPs from its Node object), `localhost` (the
//! loopback CIDRs `127.0.0.0/8` and `::1/128`) and `all` (`0.0.0.0/0` and `::/0`), in any
//! combination; before, `primary` had to stand alone and there were no other keywords. The
//! keywords are accepted whatever the feature gates (only the userspace listener of
//! `KubeProxyNFTablesLocalhostNodePorts` is gated), as upstream's flag help reads.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// The keyword meaning "the node's primary IPs".
pub const NODE_PORT_ADDRESSES_PRIMARY: &str = "primary";
/// The keyword meaning "the loopback addresses" (`127.0.0.0/8`, `::1/128`).
pub const NODE_PORT_ADDRESSES_LOCALHOST: &str = "localhost";
/// The keyword meaning "every address" (`0.0.0.0/0`, `::/0`).
pub const NODE_PORT_ADDRESSES_ALL: &str = "all";

/// One `nodePortAddresses` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddress {
    /// `primary`: the node's primary IP of each family (a /32 or /128 of it).
    Primary,
    /// `localhost`: `127.0.0.0/8` and `::1/128`.
    Localhost,
    /// `all`: `0.0.0.0/0` and `::/0`.
    All,
    /// A CIDR.
    Cidr(IpNet),
}

impl NodePortAddress {
    /// The CIDRs the entry stands for; none for `primary` (the node's IPs, known later).
    pub fn cidrs(&self) -> Vec<IpNet> {
        match self {
            NodePortAddress::Primary => Vec::new(),
            NodePortAddress::Localhost => vec![LOOPBACK_V4.into(), LOOPBACK_V6.into()],
            NodePortAddress::All => {
                vec![IpNet::V4(Ipv4Net::default()), IpNet::V6(Ipv6Net::default())]
            }
            NodePortAddress::Cidr(net) => vec![*net],
        }
    }
}

/// `localhost`'s CIDRs (checked at compile time).
const LOOPBACK_V4: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(127, 0, 0, 0), 8);
const LOOPBACK_V6: Ipv6Net = Ipv6Net::new_assert(Ipv6Addr::LOCALHOST, 128);

impl FromStr for NodePortAddress {
    type Err = ();

    /// A keyword (exact, as upstream) or a CIDR; surrounding blanks are ignored.
    fn from_str(s: &str) -> Result<Self, ()> {
        match s.trim() {
            NODE_PORT_ADDRESSES_PRIMARY => Ok(NodePortAddress::Primary),
            NODE_PORT_ADDRESSES_LOCALHOST => Ok(NodePortAddress::Localhost),
            NODE_PORT_ADDRESSES_ALL => Ok(NodePortAddress::All),
            other => other.parse().map(NodePortAddress::Cidr).map_err(|_| ()),
        }
    }
}

impl fmt::Display for NodePortAddress {
    /// As written in the configuration: the keyword, or the CIDR.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodePortAddress::Primary => f.write_str(NODE_PORT_ADDRESSES_PRIMARY),
            NodePortAddress::Localhost => f.write_str(NODE_PORT_ADDRESSES_LOCALHOST),
            NodePortAddress::All => f.write_str(NODE_PORT_ADDRESSES_ALL),
            NodePortAddress::Cidr(net) => write!(f, "{net}"),
        }
    }
}

/// Why an entry was refused: the bad entries, all of them.
pub(crate) fn refusal(bad: &[&str]) -> String {
    format!(
        "not a CIDR or keyword: {} (expected CIDRs such as 10.0.0.0/8, or \
         {NODE_PORT_ADDRESSES_PRIMARY:?}, {NODE_PORT_ADDRESSES_LOCALHOST:?}, \
         {NODE_PORT_ADDRESSES_ALL:?})",
        bad.join(", ")
    )
}

/// The `nodePortAddresses` setting: the proxy resolves it against the node's interface
/// addresses into the renderers' `kp_rules::config::NodePortAddresses`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddressesSetting {
    /// Unset: every local address (upstream's `null`).
    All,
    /// The listed entries, a union.
    Listed(Vec<NodePortAddress>),
}

impl NodePortAddressesSetting {
    /// The setting of exactly `primary` (nftables mode's default).
    pub fn primary() -> Self {
        NodePortAddressesSetting::Listed(vec![NodePortAddress::Primary])
    }

    /// The `nodePortAddresses` list this value is written as (`None` is `null`).
    pub fn to_config(&self) -> Option<Vec<String>> {
        match self {
            NodePortAddressesSetting::All => None,
            NodePortAddressesSetting::Listed(entries) => {
                Some(entries.iter().map(ToString::to_string).collect())
            }
        }
    }

    /// Whether `primary` is listed.
    pub fn has_primary(&self) -> bool {
        matches!(self, NodePortAddressesSetting::Listed(e) if e.contains(&NodePortAddress::Primary))
    }

    /// The listed CIDRs with `localhost` and `all` expanded (`primary` adds the node's IPs,
    /// which the caller knows); `None` when unset.
    pub fn cidrs(&self) -> Option<Vec<IpNet>> {
        match self {
            NodePortAddressesSetting::All => None,
            NodePortAddressesSetting::Listed(entries) => {
                Some(entries.iter().flat_map(NodePortAddress::cidrs).collect())
            }
        }
    }

    /// The loopback addresses the listed entries name explicitly: `127.0.0.1` when a
    /// loopback CIDR holding it is listed (`localhost`, `127.0.0.0/8`, `127.0.0.1/32`),
    /// `::1` likewise. A CIDR that merely contains them (`all`, `0.0.0.0/0`, `64.0.0.0/2`)
    /// does not count, nor does a loopback CIDR without them (`127.0.0.2/32`): the
    /// `KubeProxyNFTablesLocalhostNodePorts` listeners bind exactly these two addresses.
    /// (Upstream v1.37 counts any CIDR whose network address is loopback, `127.0.0.2/32`
    /// included; its open kubernetes#142129 proposes this rule.)
    pub fn explicit_loopback(&self) -> Vec<IpAddr> {
        let cidrs = self.cidrs().unwrap_or_default();
        [
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
        ]
        .into_iter()
        .filter(|ip| {
            cidrs
                .iter()
                .any(|c| c.network().is_loopback() && c.contains(ip))
        })
        .collect()
    }
}

impl FromStr for NodePortAddressesSetting {
    type Err = String;

    /// Reads the comma-separated flag form: CIDRs and keywords; empty means all. Every bad
    /// entry is named in the error.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let entries: Vec<&str> = s
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        if entries.is_empty() {
            return Ok(NodePortAddressesSetting::All);
        }
        let mut listed = Vec::with_capacity(entries.len());
        let mut bad = Vec::new();
        for entry in entries {
            match entry.parse() {
                Ok(address) => listed.push(address),
                Err(()) => bad.push(entry),
            }
        }
        if bad.is_empty() {
            Ok(NodePortAddressesSetting::Listed(listed))
        } else {
            Err(refusal(&bad))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(text: &str) -> NodePortAddressesSetting {
        text.parse().expect("valid")
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    #[test]
    fn keywords_combine_with_each_other_and_with_cidrs() {
        let s = setting("primary, localhost,10.0.0.0/8");
        assert!(s.has_primary());
        assert_eq!(
            s.cidrs().expect("listed"),
            vec![
                "127.0.0.0/8".parse::<IpNet>().expect("cidr"),
                "::1/128".parse().expect("cidr"),
                "10.0.0.0/8".parse().expect("cidr"),
            ]
        );
        assert_eq!(
            s.to_config(),
            Some(vec![
                "primary".to_owned(),
                "localhost".to_owned(),
                "10.0.0.0/8".to_owned()
            ])
        );
        let all = setting("all");
        assert!(!all.has_primary());
        assert_eq!(
            all.cidrs().expect("listed"),
            vec![
                "0.0.0.0/0".parse::<IpNet>().expect("cidr"),
                "::/0".parse().expect("cidr")
            ]
        );
        assert_eq!(setting(" , "), NodePortAddressesSetting::All);
        assert_eq!(setting("primary"), NodePortAddressesSetting::primary());
    }

    #[test]
    fn every_bad_entry_is_named() {
        let err = "primary,Localhost,10.0.0.0/33,ALL,fd00::/64"
            .parse::<NodePortAddressesSetting>()
            .expect_err("bad entries");
        assert!(
            err.contains("Localhost, 10.0.0.0/33, ALL"),
            "all three named: {err}"
        );
        assert!(!err.contains("fd00"), "{err}");
    }

    #[test]
    fn only_explicit_loopback_entries_ask_for_listeners() {
        let v4 = ip("127.0.0.1");
        let v6 = ip("::1");
        let cases: &[(&str, &[IpAddr])] = &[
            ("primary", &[]),
            ("all", &[]),
            ("0.0.0.0/0,::/0", &[]),
            ("64.0.0.0/2", &[]),
            ("127.0.0.2/32", &[]),
            ("primary,localhost", &[v4, v6]),
            ("all,localhost", &[v4, v6]),
            ("0.0.0.0/0,127.0.0.1/32", &[v4]),
            ("127.0.0.0/8", &[v4]),
            ("10.0.0.0/8,::1/128", &[v6]),
        ];
        for (text, want) in cases {
            assert_eq!(setting(text).explicit_loopback(), *want, "{text}");
        }
        assert!(NodePortAddressesSetting::All.explicit_loopback().is_empty());
    }
}
