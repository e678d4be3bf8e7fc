//! Chain names, derived exactly as upstream does so that a node switched between upstream
//! kube-proxy and this one finds (and cleans up) the same chains.
//!
//! For a service port with display name `S` (`ns/name:port`, or `ns/name` when the port is
//! unnamed) and lower-case protocol `p`, the hash is the first 16 characters of the RFC 4648
//! base32 encoding of `sha256(S + p)`. Endpoint chains hash `S + p + "ip:port"`, with IPv6
//! addresses in brackets (`[fd00::1]:80`), as Go's `net.JoinHostPort` writes them.

use std::net::{IpAddr, SocketAddr};

use kp_core::model::ServicePortName;
use sha2::{Digest, Sha256};

/// Prefix of a service port's Cluster-policy chain.
pub const SVC_PREFIX: &str = "KUBE-SVC-";
/// Prefix of a service port's Local-policy chain.
pub const SVL_PREFIX: &str = "KUBE-SVL-";
/// Prefix of a service port's external-destination chain (NodePort, externalIP, LB IP).
pub const EXT_PREFIX: &str = "KUBE-EXT-";
/// Prefix of a service port's loadBalancerSourceRanges chain.
pub const FW_PREFIX: &str = "KUBE-FW-";
/// Prefix of an endpoint's DNAT chain.
pub const SEP_PREFIX: &str = "KUBE-SEP-";

/// Every prefix of a per-service chain. Chains with these prefixes that the current render
/// does not produce are stale and get deleted; any other chain is not ours to touch.
pub const SERVICE_CHAIN_PREFIXES: [&str; 5] =
    [SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX];

/// Upstream keeps 16 base32 characters (80 bits) of the hash: short enough that every
/// name stays under iptables' 28-character chain-name limit (`KUBE-SEP-` + 16 = 25).
const HASH_CHARS: usize = 16;

/// RFC 4648 base32 alphabet (Go's `base32.StdEncoding`).
const BASE32_ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// The first [`HASH_CHARS`] characters of `base32(sha256(input))`.
fn hash16(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    base32_prefix(&digest[..HASH_CHARS * 5 / 8])
}

/// Base32 of `bytes`, whose length must be a multiple of 5 so no padding is involved
/// (16 characters of 5 bits each come from exactly 10 bytes).
fn base32_prefix(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 8 / 5);
    push_base32(&mut out, bytes);
    out
}

/// Appends base32 of `bytes` (length a multiple of 5) to `out`.
fn push_base32(out: &mut String, bytes: &[u8]) {
    for group in bytes.chunks(5) {
        let mut bits: u64 = 0;
        for byte in group {
            bits = (bits << 8) | u64::from(*byte);
        }
        for i in (0..8).rev() {
            let index = ((bits >> (i * 5)) & 0x1f) as usize;
            out.push(char::from(BASE32_ALPHABET[index]));
        }
    }
}

/// The hash shared by a service port's `KUBE-SVC/SVL/EXT/FW` chains.
pub fn service_port_hash(name: &ServicePortName) -> String {
    hash16(&format!("{name}{}", name.protocol.as_str()))
}

/// The endpoint as upstream prints it: `ip:port`, `[ipv6]:port`.
pub fn endpoint_string(ip: IpAddr, port: u16) -> String {
    SocketAddr::new(ip, port).to_string()
}

/// The chain names of one service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceChains {
    /// `KUBE-SVC-H`: load-balances over the Cluster-policy endpoints.
    pub svc: String,
    /// `KUBE-SVL-H`: load-balances over the Local-policy endpoints.
    pub svl: String,
    /// `KUBE-EXT-H`: entry for NodePort, externalIP and LB traffic.
    pub ext: String,
    /// `KUBE-FW-H`: loadBalancerSourceRanges filter in front of `KUBE-EXT-H`.
    pub fw: String,
}

impl ServiceChains {
    /// Names for one service port.
    pub fn new(name: &ServicePortName) -> Self {
        let hash = service_port_hash(name);
        Self {
            svc: format!("{SVC_PREFIX}{hash}"),
            svl: format!("{SVL_PREFIX}{hash}"),
            ext: format!("{EXT_PREFIX}{hash}"),
            fw: format!("{FW_PREFIX}{hash}"),
        }
    }
}

/// `KUBE-SEP-…` for one endpoint of a service port.
pub fn endpoint_chain(name: &ServicePortName, ip: IpAddr, port: u16) -> String {
    let hash = hash16(&format!(
        "{name}{}{}",
        name.protocol.as_str(),
        endpoint_string(ip, port)
    ));
    format!("{SEP_PREFIX}{hash}")
}

/// Derives the `KUBE-SEP-…` names of one service port's endpoints without re-hashing (or
/// re-formatting) the service part for every endpoint; same names as [`endpoint_chain`].
pub(crate) struct EndpointChains {
    prefix: Sha256,
    scratch: String,
}

impl EndpointChains {
    /// `display` is the service port's display name (`name.to_string()`).
    pub(crate) fn new(display: &str, name: &ServicePortName) -> Self {
        let mut prefix = Sha256::new();
        prefix.update(display.as_bytes());
        prefix.update(name.protocol.as_str().as_bytes());
        Self {
            prefix,
            scratch: String::with_capacity(48),
        }
    }

    /// `KUBE-SEP-…` for the endpoint `ip:port`.
    pub(crate) fn chain(&mut self, ip: IpAddr, port: u16) -> String {
        use std::fmt::Write as _;
        self.scratch.clear();
        match ip {
            // The common case without the formatting machinery: `a.b.c.d:port`.
            IpAddr::V4(v4) => {
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        self.scratch.push('.');
                    }
                    push_decimal(&mut self.scratch, u32::from(octet));
                }
                self.scratch.push(':');
                push_decimal(&mut self.scratch, u32::from(port));
            }
            IpAddr::V6(_) => {
                let _ = write!(self.scratch, "{}", SocketAddr::new(ip, port));
            }
        }
        let mut hasher = self.prefix.clone();
        hasher.update(self.scratch.as_bytes());
        let digest = hasher.finalize();
        let mut out = String::with_capacity(SEP_PREFIX.len() + HASH_CHARS);
        out.push_str(SEP_PREFIX);
        push_base32(&mut out, &digest[..HASH_CHARS * 5 / 8]);
        out
    }
}

/// Appends `n` in decimal.
fn push_decimal(out: &mut String, n: u32) {
    // Writing to a `String` cannot fail.
    let _ = super::rule::write_decimal(out, n);
}

/// Whether `chain` is a per-service chain this renderer owns (and may delete when stale).
pub fn is_service_chain(chain: &str) -> bool {
    // Same as testing every prefix of SERVICE_CHAIN_PREFIXES, without a loop of calls: all
    // start with `KUBE-`.
    let Some(rest) = chain.strip_prefix("KUBE-") else {
        return false;
    };
    rest.starts_with("SEP-")
        || rest.starts_with("SVC-")
        || rest.starts_with("SVL-")
        || rest.starts_with("EXT-")
        || rest.starts_with("FW-")
}

#[cfg(test)]
mod tests {
    use kp_core::model::{Protocol, ServiceName};

    use super::*;

    fn spn(ns: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName {
            service: ServiceName {
                namespace: ns.into(),
                name: name.into(),
            },
            port: port.into(),
            protocol,
        }
    }

    #[test]
    fn reproduces_upstream_verified_service_hash() {
        let name = spn("ns1", "svc1", "p80", Protocol::Tcp);
        assert_eq!(service_port_hash(&name), "XPGD46QRK7WJZT7O");
        let chains = ServiceChains::new(&name);
        assert_eq!(chains.svc, "KUBE-SVC-XPGD46QRK7WJZT7O");
        assert_eq!(chains.svl, "KUBE-SVL-XPGD46QRK7WJZT7O");
        assert_eq!(chains.ext, "KUBE-EXT-XPGD46QRK7WJZT7O");
        assert_eq!(chains.fw, "KUBE-FW-XPGD46QRK7WJZT7O");
    }

    #[test]
    fn reproduces_upstream_verified_endpoint_hash() {
        let name = spn("ns1", "svc1", "p80", Protocol::Tcp);
        let ip = "10.180.0.1".parse().expect("literal");
        assert_eq!(endpoint_chain(&name, ip, 80), "KUBE-SEP-SXIVWICOYRO3J4NJ");
    }

    #[test]
    fn hash_depends_on_protocol_and_port_name() {
        let tcp = service_port_hash(&spn("ns1", "svc1", "p80", Protocol::Tcp));
        let udp = service_port_hash(&spn("ns1", "svc1", "p80", Protocol::Udp));
        let unnamed = service_port_hash(&spn("ns1", "svc1", "", Protocol::Tcp));
        assert_ne!(tcp, udp);
        assert_ne!(tcp, unnamed);
    }

    #[test]
    fn hash_is_16_base32_characters() {
        for input in ["", "a", "ns/name:port\"tcp", "日本/名前udp"] {
            let h = hash16(input);
            assert_eq!(h.len(), HASH_CHARS);
            assert!(h.bytes().all(|b| BASE32_ALPHABET.contains(&b)), "{h}");
        }
    }

    #[test]
    fn base32_matches_rfc4648_test_vectors() {
        // RFC 4648 section 10: BASE32("fooba") = "MZXW6YTB".
        assert_eq!(base32_prefix(b"fooba"), "MZXW6YTB");
        assert_eq!(base32_prefix(b"foobafooba"), "MZXW6YTBMZXW6YTB");
        assert_eq!(base32_prefix(&[0xff; 5]), "77777777");
    }

    #[test]
    fn endpoint_chains_match_endpoint_chain() {
        for (name, ip) in [
            (spn("ns1", "svc1", "p80", Protocol::Tcp), "10.180.0.1"),
            (spn("ns\"x", "s", "", Protocol::Udp), "fd00::1"),
            (spn("日本", "名前", "p", Protocol::Sctp), "10.0.0.255"),
            (spn("a", "b", "c", Protocol::Tcp), "0.0.0.0"),
            (spn("a", "b", "c", Protocol::Tcp), "255.255.255.255"),
            (spn("a", "b", "c", Protocol::Tcp), "::ffff:10.0.0.1"),
        ] {
            let ip: IpAddr = ip.parse().expect("literal");
            let mut chains = EndpointChains::new(&name.to_string(), &name);
            for port in [0, 1, 9, 10, 80, 100, 65535] {
                assert_eq!(chains.chain(ip, port), endpoint_chain(&name, ip, port));
            }
        }
        let name = spn("ns1", "svc1", "p80", Protocol::Tcp);
        let mut chains = EndpointChains::new(&name.to_string(), &name);
        let ip = "10.180.0.1".parse().expect("literal");
        assert_eq!(chains.chain(ip, 80), "KUBE-SEP-SXIVWICOYRO3J4NJ");
    }

    #[test]
    fn ipv6_endpoint_uses_brackets() {
        let ip = "fd00::1".parse().expect("literal");
        assert_eq!(endpoint_string(ip, 80), "[fd00::1]:80");
    }

    #[test]
    fn recognises_only_per_service_chains() {
        assert!(is_service_chain("KUBE-SEP-SXIVWICOYRO3J4NJ"));
        assert!(is_service_chain("KUBE-FW-XPGD46QRK7WJZT7O"));
        assert!(!is_service_chain("KUBE-SERVICES"));
        assert!(!is_service_chain("KUBE-NODEPORTS"));
        assert!(!is_service_chain("KUBE-MARK-MASQ"));
        for chain in [
            "",
            "KUBE-",
            "KUBE-SEP",
            "KUBE-SEP-",
            "KUBE-FW-",
            "KUBE-FWX",
            "KUBE-EXT-A",
            "KUBE-SVL-A",
            "KUBE-SVC-",
            "kube-svc-a",
            "XKUBE-SVC-A",
            "KUBE-SERVICES",
        ] {
            let reference = SERVICE_CHAIN_PREFIXES
                .iter()
                .any(|prefix| chain.starts_with(prefix));
            assert_eq!(is_service_chain(chain), reference, "{chain}");
        }
    }
}
