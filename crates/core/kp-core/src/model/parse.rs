//! IP and CIDR parsing with the API server's rules.
//!
//! # What is accepted, and why
//!
//! The API server validates address fields (`clusterIP(s)`, `externalIPs`, load-balancer
//! ingress IPs, endpoint addresses, `loadBalancerSourceRanges`, `podCIDR(s)`) with
//! `IsValidIPForLegacyField` / `IsValidCIDRForLegacyField` (k8s.io/apimachinery
//! `pkg/util/validation/ip.go`). Without the `StrictIPCIDRValidation` feature gate (alpha,
//! off by default) these accept two ambiguous forms; with it, a *new* value in either form is
//! refused, while a value an object already held is kept on update (ratcheting):
//!
//! 1. **Leading zeros in IPv4 octets** (`172.30.0.041`, `203.0.113.000/025`). Before Go 1.17
//!    they were accepted everywhere, so they can still be stored in etcd, and the non-strict
//!    API server still accepts them. Upstream kube-proxy reads them as decimal (never octal:
//!    `TestBadIPs`). [`parse_ip`] and [`parse_cidr`] do the same, so an old object from a
//!    cluster keeps working. A manifest, though, is a new object: the manifests source
//!    applies the strict rules on top ([`check_strict_ip`], [`check_strict_cidr`]), as the
//!    API server does on create with the gate on.
//! 2. **IPv4-mapped IPv6 addresses** (`::ffff:1.2.3.4`). Some software reads them as IPv4,
//!    other as IPv6, and kube-proxy programs each family separately, so the same text could
//!    be taken for an address of either family; Kubernetes has no use for them and strict
//!    validation refuses them. We refuse them everywhere, old objects included
//!    ([`AddressError::Ipv4Mapped`]): upstream would program `::ffff:1.2.3.4` as `1.2.3.4`,
//!    which the object's author may not have meant.
//!
//! Never accepted by any API server, so never by us either: zones (`fe80::1%eth0`),
//! whitespace, and anything else that is not an address. CIDRs with host bits set
//! (`10.1.2.3/8`) are legacy-valid and read as their network (`10.0.0.0/8`), as upstream
//! does; the strict check refuses them.
//!
//! The API server also refuses some *values* that are well-formed (for example loopback or
//! link-local endpoint addresses, `ValidateEndpointIP`); those are not address forms and are
//! left to the fields' own checks, as upstream kube-proxy does.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// Why an address or CIDR text was refused. The messages follow a quoted value, as in
/// `"::ffff:1.2.3.4" is an IPv4-mapped IPv6 address ...`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    /// Not an IP address in any form the API accepts.
    #[error("is not an IP address")]
    NotAnIp,
    /// Not `ADDRESS/PREFIX-LENGTH` with a valid address and length.
    #[error("is not a CIDR")]
    NotACidr,
    /// An IPv6 zone (`%eth0`), which no API address field allows.
    #[error("has an IPv6 zone (%...), which an API address may not have")]
    Zone,
    /// An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`): ambiguous between the families.
    #[error("is an IPv4-mapped IPv6 address, which the API refuses: write the IPv4 address {0}")]
    Ipv4Mapped(Ipv4Addr),
    /// Leading zeros in an IPv4 octet or a prefix length (strict rules only).
    #[error("has leading zeros, which the API refuses in new objects: write {0}")]
    LeadingZeros(IpNetOrAddr),
    /// Bits set beyond the prefix length (strict rules only).
    #[error("has bits set beyond the prefix length: write {0}")]
    HostBits(IpNet),
}

/// The canonical spelling suggested by [`AddressError::LeadingZeros`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpNetOrAddr {
    /// An address.
    Addr(IpAddr),
    /// A CIDR.
    Net(IpNet),
}

impl std::fmt::Display for IpNetOrAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IpNetOrAddr::Addr(ip) => write!(f, "{ip}"),
            IpNetOrAddr::Net(net) => write!(f, "{net}"),
        }
    }
}

/// Parse an IP address as the API server's legacy rules do: leading zeros in IPv4 octets
/// are read as decimal; IPv4-mapped IPv6 addresses and zones are refused (see the module
/// docs).
pub fn parse_ip(text: &str) -> Result<IpAddr, AddressError> {
    if has_zone(text) {
        return Err(AddressError::Zone);
    }
    let ip = parse_ip_raw(text).ok_or(AddressError::NotAnIp)?;
    if let IpAddr::V6(v6) = ip
        && let Some(v4) = v6.to_ipv4_mapped()
    {
        return Err(AddressError::Ipv4Mapped(v4));
    }
    Ok(ip)
}

/// Parse a CIDR as the API server's legacy rules do: leading zeros in IPv4 octets and in the
/// prefix length (`203.0.113.000/025`) are allowed, host bits are dropped (the result is the
/// network, `10.1.2.3/8` gives `10.0.0.0/8`, as upstream writes it); IPv4-mapped IPv6
/// addresses and zones are refused.
pub fn parse_cidr(text: &str) -> Result<IpNet, AddressError> {
    let (address, prefix) = text.split_once('/').ok_or(AddressError::NotACidr)?;
    if has_zone(address) {
        return Err(AddressError::Zone);
    }
    // Not canonicalised: the prefix length is relative to the family as written.
    let ip = parse_ip_raw(address).ok_or(AddressError::NotACidr)?;
    if let IpAddr::V6(v6) = ip
        && let Some(v4) = v6.to_ipv4_mapped()
    {
        return Err(AddressError::Ipv4Mapped(v4));
    }
    let prefix = parse_decimal(prefix, 3).ok_or(AddressError::NotACidr)?;
    let prefix = u8::try_from(prefix).map_err(|_| AddressError::NotACidr)?;
    IpNet::new(ip, prefix)
        .map(|net| net.trunc())
        .map_err(|_| AddressError::NotACidr)
}

/// The strict rules on top of [`parse_ip`], for new objects: no leading zeros.
pub fn check_strict_ip(text: &str) -> Result<IpAddr, AddressError> {
    let ip = parse_ip(text)?;
    // The standard parser refuses leading zeros in IPv4 octets, as Go's `netip` does.
    if text.parse::<IpAddr>().is_err() {
        return Err(AddressError::LeadingZeros(IpNetOrAddr::Addr(ip)));
    }
    Ok(ip)
}

/// The strict rules on top of [`parse_cidr`], for new objects: no leading zeros in the
/// address or the prefix length, no bits set beyond the prefix length.
pub fn check_strict_cidr(text: &str) -> Result<IpNet, AddressError> {
    let net = parse_cidr(text)?;
    let (address, prefix) = text.split_once('/').ok_or(AddressError::NotACidr)?;
    let canonical_prefix = prefix == "0" || !prefix.starts_with('0');
    let Ok(ip) = address.parse::<IpAddr>() else {
        return Err(AddressError::LeadingZeros(IpNetOrAddr::Net(net)));
    };
    if !canonical_prefix {
        return Err(AddressError::LeadingZeros(IpNetOrAddr::Net(net)));
    }
    if ip != net.addr() {
        return Err(AddressError::HostBits(net));
    }
    Ok(net)
}

/// An IPv6 address followed by `%zone`.
fn has_zone(text: &str) -> bool {
    text.split_once('%')
        .is_some_and(|(address, _)| parse_ip_raw(address).is_some_and(|ip| ip.is_ipv6()))
}

fn parse_ip_raw(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(v4) = parse_v4_decimal(text) {
        return Some(IpAddr::V4(v4));
    }
    // An IPv6 address whose dotted IPv4 tail has leading zeros (`::ffff:010.1.2.3`).
    let (head, tail) = text.rsplit_once(':')?;
    if !tail.contains('.') {
        return None;
    }
    let v4 = parse_v4_decimal(tail)?;
    format!("{head}:{v4}")
        .parse::<Ipv6Addr>()
        .ok()
        .map(IpAddr::V6)
}

/// Dotted-quad IPv4 where every octet is decimal digits, leading zeros allowed.
fn parse_v4_decimal(text: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = text.split('.');
    for octet in &mut octets {
        let value = parse_decimal(parts.next()?, 3)?;
        *octet = u8::try_from(value).ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Ipv4Addr::from(octets))
}

/// A non-empty run of ASCII digits with at most `max_digits` significant digits.
fn parse_decimal(text: &str, max_digits: usize) -> Option<u16> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let significant = text.trim_start_matches('0');
    if significant.is_empty() {
        return Some(0);
    }
    if significant.len() > max_digits {
        return None;
    }
    significant.parse().ok()
}
