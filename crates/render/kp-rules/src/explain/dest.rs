//! The `DEST[:PORT][/PROTO]` argument.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use kp_core::model::Protocol;
use serde::Serialize;

/// Where a packet goes: an IP, optionally a port, and a protocol (TCP unless given).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Destination {
    /// Destination address.
    pub ip: IpAddr,
    /// Destination port; `None` matches every port of the protocol.
    pub port: Option<u16>,
    /// Transport protocol.
    pub protocol: Protocol,
}

/// Why a `DEST` argument was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DestinationError {
    /// Nothing was given.
    #[error("empty destination")]
    Empty,
    /// The part after `/` is neither `tcp`, `udp` nor `sctp` (a CIDR is not a destination).
    #[error("unknown protocol {0:?}: expected tcp, udp or sctp (DEST is one address, not a CIDR)")]
    Protocol(String),
    /// The address part is not an IP address.
    #[error("{0:?} is not an IP address (use [IPv6]:PORT for IPv6 with a port)")]
    Address(String),
    /// The port is not 1-65535.
    #[error("invalid port {0:?}: expected 1-65535")]
    Port(String),
}

impl FromStr for Destination {
    type Err = DestinationError;

    /// Accepts `IP`, `IP:PORT`, `[IPv6]`, `[IPv6]:PORT` and a bare IPv6 address, each
    /// optionally followed by `/tcp`, `/udp` or `/sctp` (any case).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Err(DestinationError::Empty);
        }
        let (host, protocol) = match s.rsplit_once('/') {
            Some((host, proto)) => (host, parse_protocol(proto)?),
            None => (s, Protocol::Tcp),
        };
        let (ip, port) = if let Some(rest) = host.strip_prefix('[') {
            let (ip, after) = rest
                .split_once(']')
                .ok_or_else(|| DestinationError::Address(host.to_owned()))?;
            let port = match after {
                "" => None,
                _ => {
                    Some(parse_port(after.strip_prefix(':').ok_or_else(|| {
                        DestinationError::Address(host.to_owned())
                    })?)?)
                }
            };
            (parse_ip(ip)?, port)
        } else if let Ok(ip) = host.parse::<IpAddr>() {
            // A bare IPv6 address: its last group is never taken for a port.
            (ip, None)
        } else if let Some((ip, port)) = host.rsplit_once(':') {
            let ip = parse_ip(ip)?;
            if ip.is_ipv6() {
                return Err(DestinationError::Address(host.to_owned()));
            }
            (ip, Some(parse_port(port)?))
        } else {
            return Err(DestinationError::Address(host.to_owned()));
        };
        Ok(Destination { ip, port, protocol })
    }
}

fn parse_protocol(text: &str) -> Result<Protocol, DestinationError> {
    match text.to_ascii_lowercase().as_str() {
        "tcp" => Ok(Protocol::Tcp),
        "udp" => Ok(Protocol::Udp),
        "sctp" => Ok(Protocol::Sctp),
        _ => Err(DestinationError::Protocol(text.to_owned())),
    }
}

fn parse_ip(text: &str) -> Result<IpAddr, DestinationError> {
    text.parse()
        .map_err(|_| DestinationError::Address(text.to_owned()))
}

fn parse_port(text: &str) -> Result<u16, DestinationError> {
    text.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| DestinationError::Port(text.to_owned()))
}

impl fmt::Display for Destination {
    /// `10.0.0.1:80/TCP`, `[fd00::1]:53/UDP`, or `10.0.0.1/TCP` without a port.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.ip, self.port) {
            (IpAddr::V6(ip), Some(port)) => write!(f, "[{ip}]:{port}")?,
            (ip, Some(port)) => write!(f, "{ip}:{port}")?,
            (ip, None) => write!(f, "{ip}")?,
        }
        write!(f, "/{}", self.protocol.api_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Destination, DestinationError> {
        s.parse()
    }

    #[test]
    fn accepted_forms() {
        let d = parse("10.96.0.10").expect("bare v4");
        assert_eq!((d.port, d.protocol), (None, Protocol::Tcp));
        let d = parse("10.96.0.53:53/udp").expect("v4 port proto");
        assert_eq!((d.port, d.protocol), (Some(53), Protocol::Udp));
        let d = parse("[fd00::1]:443/SCTP").expect("v6 port proto");
        assert_eq!(d.ip, "fd00::1".parse::<IpAddr>().expect("literal"));
        assert_eq!((d.port, d.protocol), (Some(443), Protocol::Sctp));
        let d = parse("fd00::1:80").expect("bare v6");
        assert_eq!(d.port, None, "a bare IPv6 address never has a port");
        let d = parse("fd00::1/udp").expect("bare v6 proto");
        assert_eq!((d.port, d.protocol), (None, Protocol::Udp));
        assert_eq!(parse("[fd00::1]").expect("brackets").port, None);
    }

    #[test]
    fn rejected_forms() {
        assert_eq!(parse(""), Err(DestinationError::Empty));
        assert!(matches!(
            parse("10.0.0.0/8"),
            Err(DestinationError::Protocol(_))
        ));
        assert!(matches!(
            parse("web.default"),
            Err(DestinationError::Address(_))
        ));
        assert!(matches!(
            parse("10.0.0.1:0"),
            Err(DestinationError::Port(_))
        ));
        assert!(matches!(
            parse("10.0.0.1:70000"),
            Err(DestinationError::Port(_))
        ));
        assert!(matches!(
            parse("[fd00::1"),
            Err(DestinationError::Address(_))
        ));
        assert!(matches!(
            parse("[fd00::1]x"),
            Err(DestinationError::Address(_))
        ));
    }

    #[test]
    fn display_round_trips() {
        for s in ["10.96.0.10:80/TCP", "[fd00::1]:53/UDP", "10.96.0.10/SCTP"] {
            assert_eq!(parse(s).expect("valid").to_string(), s);
        }
    }
}
