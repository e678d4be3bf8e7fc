//! Sets and maps: what they hold, and the keys and data of their elements.

use std::fmt;
use std::net::IpAddr;

use kp_core::model::Protocol;

use super::{MapKey, Verdict};

/// What a set or map holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetKind {
    /// Addresses of the table's family (`type ipv4_addr`); with a timeout, a set the packet
    /// path updates (`flags dynamic,timeout ; timeout Ns`).
    Addresses {
        /// The default element timeout in seconds.
        timeout: Option<u64>,
    },
    /// A verdict map.
    VerdictMap(MapKey),
    /// A set of `protocol . port` (`type inet_proto . inet_service`).
    ProtoPorts,
}

/// The key of a set or map element.
#[derive(Clone, Debug)]
pub struct ElementKey {
    /// The nft text, which orders keys (as the state and the statements list them).
    text: Box<str>,
    parts: KeyParts,
}

/// The values making up an [`ElementKey`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyParts {
    /// `ADDR`.
    Addr(IpAddr),
    /// `ADDR . PROTO . PORT`.
    AddrProtoPort(IpAddr, Protocol, u16),
    /// `PROTO . PORT`.
    ProtoPort(Protocol, u16),
}

impl ElementKey {
    /// A key made of `parts`.
    pub fn new(parts: KeyParts) -> Self {
        let text = match parts {
            KeyParts::Addr(addr) => addr.to_string(),
            KeyParts::AddrProtoPort(addr, proto, port) => {
                format!("{addr} . {} . {port}", proto.as_str())
            }
            KeyParts::ProtoPort(proto, port) => format!("{} . {port}", proto.as_str()),
        };
        Self {
            text: text.into_boxed_str(),
            parts,
        }
    }

    /// The values.
    pub fn parts(&self) -> KeyParts {
        self.parts
    }

    /// The nft text.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl PartialEq for ElementKey {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for ElementKey {}

impl PartialOrd for ElementKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ElementKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.text.cmp(&other.text)
    }
}

impl std::borrow::Borrow<str> for ElementKey {
    fn borrow(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for ElementKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The data of one set or map element: what a diff compares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ElementValue {
    /// The verdict of a map element; `None` for a plain set element.
    pub verdict: Option<Verdict>,
    /// The element comment, already encoded.
    pub comment: Option<String>,
}
