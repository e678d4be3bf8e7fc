//! Chain and set names, derived as upstream's nftables mode derives them, so that a node
//! switched between upstream kube-proxy and this one finds (and cleans up) the same objects.
//!
//! A service port's base name is `H-ns/name/proto/port`, where `H` is the first 8 characters
//! of the RFC 4648 base32 encoding of `sha256("ns/name/proto/port")`. An endpoint's base name
//! hashes and shows `ns/name/proto/port__ip/port`, with the colons of an IPv6 address replaced
//! by dots (colons are not allowed in nft identifiers). Base names longer than
//! [`MAX_BASE_LEN`] bytes are cut and end in `...`; the hash keeps them unique.
//!
//! Upstream copies the names into the identifier as they are, relying on API validation
//! (`[a-z0-9-]`). We do not trust that: every character outside the nft identifier alphabet
//! `[A-Za-z0-9_./-]` is shown as `_`. The hash is still taken over the original text, so a
//! valid name gets upstream's exact identifier, and two names that only differ in replaced
//! characters still get different identifiers. Names containing `/` or `%` (never valid) are
//! percent-encoded before hashing, so that the `/` separators stay unambiguous.

use std::borrow::Cow;
use std::net::IpAddr;

use kp_core::model::ServicePortName;
use sha2::{Digest, Sha256};

/// Prefix of a service port's Cluster-policy chain.
pub const SERVICE_PREFIX: &str = "service-";
/// Prefix of a service port's Local-policy chain.
pub const LOCAL_PREFIX: &str = "local-";
/// Prefix of a service port's external-destination chain (NodePort, externalIP, LB IP).
pub const EXTERNAL_PREFIX: &str = "external-";
/// Prefix of a service port's loadBalancerSourceRanges chain.
pub const FIREWALL_PREFIX: &str = "firewall-";
/// Prefix of an endpoint's DNAT chain.
pub const ENDPOINT_PREFIX: &str = "endpoint-";
/// Prefix of an endpoint's session-affinity set.
pub const AFFINITY_PREFIX: &str = "affinity-";

/// Upstream's limit for a base name: nft names have at most 256 bytes and a prefix takes at
/// most 16 of them.
pub const MAX_BASE_LEN: usize = 240;

/// Characters of the hash (40 bits, the first 5 bytes of the digest).
const HASH_CHARS: usize = 8;

/// RFC 4648 base32 alphabet (Go's `base32.StdEncoding`).
const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// The first [`HASH_CHARS`] characters of `base32(sha256(input))`.
fn hash8(input: &str) -> String {
    let digest = Sha256::digest(input.as_bytes());
    // 8 characters of 5 bits each are exactly the first 40 bits.
    let bits = digest[..5]
        .iter()
        .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte));
    (0..HASH_CHARS)
        .rev()
        .map(|i| char::from(BASE32[((bits >> (i * 5)) & 0x1f) as usize]))
        .collect()
}

/// Whether `c` may appear in an nft identifier (after its first character).
fn is_identifier_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')
}

/// `raw` with every character nft would not accept in an identifier shown as `_`.
fn sanitize_identifier(raw: &str) -> String {
    raw.chars()
        .map(|c| if is_identifier_char(c) { c } else { '_' })
        .collect()
}

/// Upstream's `hashAndTruncate`, over the raw text, showing the sanitised text.
fn hash_and_truncate(raw: &str) -> String {
    let mut name = format!("{}-{}", hash8(raw), sanitize_identifier(raw));
    if name.len() > MAX_BASE_LEN {
        // Sanitised names are ASCII, so any byte index is a character boundary.
        name.truncate(MAX_BASE_LEN - 3);
        name.push_str("...");
    }
    name
}

/// `ns/name/proto/port`, the text upstream hashes for a service port.
fn service_port_text(name: &ServicePortName) -> String {
    format!(
        "{}/{}/{}/{}",
        field(&name.service.namespace),
        field(&name.service.name),
        name.protocol.as_str(),
        field(&name.port)
    )
}

/// One name as part of the hashed text. Valid names (no `/`, no `%`) are used as they are,
/// as upstream does; otherwise `%` and `/` are percent-encoded, so that `a/b` + `c` and
/// `a` + `b/c` cannot produce the same text (and the same chains).
fn field(text: &str) -> Cow<'_, str> {
    if text.contains(['/', '%']) {
        Cow::Owned(text.replace('%', "%25").replace('/', "%2F"))
    } else {
        Cow::Borrowed(text)
    }
}

/// The base name shared by a service port's chains, e.g. `ULMVA6XW-ns1/svc1/tcp/p80`.
pub fn service_port_base(name: &ServicePortName) -> String {
    hash_and_truncate(&service_port_text(name))
}

/// The base name of one endpoint's chain and affinity set, e.g.
/// `5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80`.
pub fn endpoint_base(name: &ServicePortName, ip: IpAddr, port: u16) -> String {
    let ip = ip.to_string().replace(':', ".");
    hash_and_truncate(&format!("{}__{ip}/{port}", service_port_text(name)))
}

/// The chain names of one service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceChains {
    /// `service-…`: load-balances over the Cluster-policy endpoints.
    pub service: String,
    /// `local-…`: load-balances over the Local-policy endpoints.
    pub local: String,
    /// `external-…`: entry for NodePort, externalIP and LB traffic.
    pub external: String,
    /// `firewall-…`: drops LB traffic from outside loadBalancerSourceRanges.
    pub firewall: String,
}

impl ServiceChains {
    /// Names for one service port.
    pub fn new(name: &ServicePortName) -> Self {
        let base = service_port_base(name);
        Self {
            service: format!("{SERVICE_PREFIX}{base}"),
            local: format!("{LOCAL_PREFIX}{base}"),
            external: format!("{EXTERNAL_PREFIX}{base}"),
            firewall: format!("{FIREWALL_PREFIX}{base}"),
        }
    }
}

/// The names of one endpoint's objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointNames {
    /// `endpoint-…`: the DNAT chain.
    pub chain: String,
    /// `affinity-…`: the set of clients pinned to this endpoint (ClientIP affinity only).
    pub affinity_set: String,
}

impl EndpointNames {
    /// Names for one endpoint of a service port.
    pub fn new(name: &ServicePortName, ip: IpAddr, port: u16) -> Self {
        let base = endpoint_base(name, ip, port);
        Self {
            chain: format!("{ENDPOINT_PREFIX}{base}"),
            affinity_set: format!("{AFFINITY_PREFIX}{base}"),
        }
    }
}

/// Whether `name` is a per-service chain or set (upstream's test: only those contain `/`;
/// the fixed chains never do). Only such objects are ever treated as stale.
pub fn is_service_object(name: &str) -> bool {
    name.contains('/')
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

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("literal")
    }

    #[test]
    fn reproduces_upstream_verified_names() {
        let svc1 = spn("ns1", "svc1", "p80", Protocol::Tcp);
        let chains = ServiceChains::new(&svc1);
        assert_eq!(chains.service, "service-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(chains.local, "local-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(chains.external, "external-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(chains.firewall, "firewall-ULMVA6XW-ns1/svc1/tcp/p80");
        assert_eq!(
            EndpointNames::new(&svc1, ip("10.180.0.1"), 80).chain,
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        let svc5 = spn("ns5", "svc5", "p80", Protocol::Tcp);
        assert_eq!(service_port_base(&svc5), "HVFWP5L3-ns5/svc5/tcp/p80");
        assert_eq!(
            EndpointNames::new(&svc5, ip("10.180.0.3"), 80).affinity_set,
            "affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80"
        );
    }

    #[test]
    fn reproduces_upstream_verified_ipv6_names() {
        let name = spn("testing", "service", "http", Protocol::Tcp);
        assert_eq!(
            service_port_base(&name),
            "P4ZYZVCF-testing/service/tcp/http"
        );
        // Upstream hashes the address as the EndpointSlice spells it; its test data uses a
        // non-canonical spelling (`::` for a single zero group).
        assert_eq!(
            hash_and_truncate("testing/service/tcp/http__fd80.abcd.12..a1b2.c3d4.e5f6.9999/80"),
            "U7E2ET36-testing/service/tcp/http__fd80.abcd.12..a1b2.c3d4.e5f6.9999/80"
        );
        // We print parsed addresses canonically (RFC 5952), as Go does when it writes them.
        assert_eq!(
            endpoint_base(&name, ip("fd80:abcd:12::a1b2:c3d4:e5f6:9999"), 80),
            hash_and_truncate("testing/service/tcp/http__fd80.abcd.12.0.a1b2.c3d4.e5f6.9999/80")
        );
        assert!(endpoint_base(&name, ip("fd00::1"), 80).ends_with("__fd00..1/80"));
    }

    #[test]
    fn hostile_characters_are_replaced_but_still_hashed() {
        let hostile = spn("ns", "a\" ; flush ruleset\n", "p", Protocol::Udp);
        let base = service_port_base(&hostile);
        assert!(base.ends_with("-ns/a____flush_ruleset_/udp/p"), "{base}");
        assert!(base.chars().all(is_identifier_char));
        // Same sanitised text, different raw text: different names.
        let other = spn("ns", "a\" ; flush ruleset\t", "p", Protocol::Udp);
        assert_ne!(base, service_port_base(&other));
        let unicode = spn("名前", "svc", "", Protocol::Sctp);
        assert!(service_port_base(&unicode).ends_with("-__/svc/sctp/"));
    }

    #[test]
    fn slashes_in_names_cannot_alias_other_services() {
        let one = spn("a/b", "c", "p", Protocol::Tcp);
        let two = spn("a", "b/c", "p", Protocol::Tcp);
        assert_ne!(service_port_base(&one), service_port_base(&two));
        assert!(service_port_base(&one).ends_with("-a_2Fb/c/tcp/p"));
        let ep = |n: &ServicePortName| endpoint_base(n, ip("10.0.0.1"), 80);
        assert_ne!(ep(&one), ep(&two));
    }

    #[test]
    fn long_names_are_cut_with_dots() {
        let long = spn(
            &"n".repeat(63),
            &"s".repeat(300),
            &"p".repeat(63),
            Protocol::Tcp,
        );
        let base = service_port_base(&long);
        assert_eq!(base.len(), MAX_BASE_LEN);
        assert!(base.ends_with("..."));
        let endpoint = endpoint_base(&long, ip("fd00::1"), 65535);
        assert_eq!(endpoint.len(), MAX_BASE_LEN);
        assert_ne!(endpoint[..8], base[..8]);
        // The longest prefix keeps every name within nft's 255-byte limit.
        assert!(format!("{EXTERNAL_PREFIX}{base}").len() <= 255);
    }

    #[test]
    fn base32_of_known_digest_prefix() {
        // sha256("") starts e3 b0 c4 42 98 -> base32 "4OYMIQUY".
        assert_eq!(hash8(""), "4OYMIQUY");
    }

    #[test]
    fn only_per_service_objects_contain_a_slash() {
        assert!(is_service_object(
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        ));
        assert!(!is_service_object("services"));
        assert!(!is_service_object("filter-prerouting-pre-dnat"));
    }
}
