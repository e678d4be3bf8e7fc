//! Lenient IP and CIDR parsing, as upstream's "sloppy" parsers.
//!
//! Before Go 1.17 the API server accepted IPv4 octets with leading zeros, so such values can
//! still be stored in etcd. Upstream reads them as decimal (`172.30.0.041` is 172.30.0.41,
//! never octal) and writes them back canonically; we do the same (`TestBadIPs`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// Parse an IP address, allowing leading zeros in IPv4 octets (read as decimal).
///
/// IPv4-mapped IPv6 addresses (`::ffff:1.2.3.4`) are returned as IPv4, because upstream
/// classifies them as IPv4 and a family's rules must only contain that family's addresses.
pub fn parse_ip_lenient(text: &str) -> Option<IpAddr> {
    parse_ip_raw(text).map(|ip| ip.to_canonical())
}

/// Parse a CIDR, allowing leading zeros in IPv4 octets and in the prefix length
/// (`203.0.113.000/025`), and return its network address (`203.0.113.0/25`), as upstream
/// writes it.
pub fn parse_cidr_lenient(text: &str) -> Option<IpNet> {
    let (address, prefix) = text.split_once('/')?;
    // Not canonicalised: the prefix length is relative to the family as written.
    let ip = parse_ip_raw(address)?;
    let prefix = parse_decimal(prefix, 3)?;
    let prefix = u8::try_from(prefix).ok()?;
    IpNet::new(ip, prefix).ok().map(|net| net.trunc())
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
