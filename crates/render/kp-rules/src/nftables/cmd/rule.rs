//! What a rule is made of: verdicts, matches, the one action, base-chain hooks.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::Protocol;

use super::Name;

/// A verdict: the end of a rule, or the value of a verdict-map element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// `drop`.
    Drop,
    /// `accept`.
    Accept,
    /// `return`.
    Return,
    /// `jump CHAIN`.
    Jump(Name),
    /// `goto CHAIN`.
    Goto(Name),
}

impl Verdict {
    /// The chain a `jump` or `goto` enters.
    pub fn chain(&self) -> Option<&str> {
        match self {
            Verdict::Jump(chain) | Verdict::Goto(chain) => Some(chain),
            _ => None,
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Drop => f.write_str("drop"),
            Verdict::Accept => f.write_str("accept"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(chain) => write!(f, "jump {chain}"),
            Verdict::Goto(chain) => write!(f, "goto {chain}"),
        }
    }
}

/// Which address of the packet a match looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrField {
    /// `saddr`.
    Source,
    /// `daddr`.
    Destination,
}

impl fmt::Display for AddrField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddrField::Source => "saddr",
            AddrField::Destination => "daddr",
        })
    }
}

/// An address a rule compares with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Addr {
    /// One address, written bare.
    Host(IpAddr),
    /// A prefix (canonical: no host bits), written with its length even for a single host.
    Net(IpNet),
}

impl Addr {
    /// The address and prefix length.
    pub fn net(self) -> IpNet {
        match self {
            Addr::Host(ip) => IpNet::from(ip),
            Addr::Net(net) => net,
        }
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Addr::Host(ip) => write!(f, "{ip}"),
            Addr::Net(net) => write!(f, "{net}"),
        }
    }
}

/// A prefix as an element of an anonymous set: bare for a single host.
pub(super) struct SetItem<'a>(pub(super) &'a IpNet);

impl fmt::Display for SetItem<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.prefix_len() == self.0.max_prefix_len() {
            write!(f, "{}", self.0.addr())
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// One match of a rule; a rule's matches all have to hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Match {
    /// `ip saddr [!=] ADDR`.
    Addr {
        /// Source or destination.
        field: AddrField,
        /// `!=`.
        negate: bool,
        /// The address or prefix.
        value: Addr,
    },
    /// `ip saddr [!=] { PREFIX, ... }`: an anonymous set of canonical prefixes (at least one).
    AddrIn {
        /// Source or destination.
        field: AddrField,
        /// `!=`.
        negate: bool,
        /// The prefixes, in the order written.
        nets: Vec<IpNet>,
    },
    /// `ip daddr @SET`.
    AddrInSet {
        /// Source or destination.
        field: AddrField,
        /// A named address set.
        set: Name,
    },
    /// `iifname [!=] "NAME"`, or `"PREFIX*"` with `wildcard`.
    Iifname {
        /// `!=`.
        negate: bool,
        /// The interface name or prefix (validated: no quote, backslash or `*`).
        name: String,
        /// Whether `name` is a prefix.
        wildcard: bool,
    },
    /// `fib saddr|daddr type local`.
    FibLocal(AddrField),
    /// `ct state new`.
    CtStateNew,
    /// `mark and MASK == VALUE`.
    MarkAnd {
        /// The mask, written in hex.
        mask: u32,
        /// The value compared with.
        value: u32,
    },
    /// `meta l4proto PROTO`.
    L4Proto(Protocol),
    /// `meta l4proto . th dport @SET`: a named `protocol . port` set.
    ProtoPortInSet(Name),
    /// `numgen random mod MODULUS VALUE`.
    Numgen {
        /// The modulus (at least 1).
        modulus: u32,
        /// The value matched (below `modulus`).
        value: u32,
    },
}

/// The key a verdict-map lookup builds from the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKey {
    /// `ip daddr . meta l4proto . th dport`.
    AddrProtoPort,
    /// `meta l4proto . th dport`.
    ProtoPort,
}

/// What a rule does once its matches hold: its one statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A verdict.
    Verdict(Verdict),
    /// `KEY vmap @MAP`.
    Vmap {
        /// What the lookup key is made of.
        key: MapKey,
        /// A named verdict map.
        map: Name,
    },
    /// `numgen random mod N vmap { 0 : goto C0 , 1 : goto C1 , ... }` (at least one chain).
    NumgenVmap(Vec<Name>),
    /// `reject` (the family's default: port unreachable).
    Reject,
    /// `counter name COUNTER reject [with tcp reset]`: counted in a named counter.
    CountedReject {
        /// The named counter.
        counter: Name,
        /// A TCP reset instead of port unreachable (TCP rules only).
        tcp_reset: bool,
    },
    /// `masquerade [fully-random]`.
    Masquerade {
        /// `fully-random`.
        fully_random: bool,
    },
    /// `mark set mark or VALUE`.
    MarkOr(u32),
    /// `mark set mark xor VALUE`.
    MarkXor(u32),
    /// `update @SET { ip saddr }`.
    UpdateSourceSet(Name),
    /// `dnat to ADDR:PORT`.
    Dnat {
        /// Of the table's family.
        addr: IpAddr,
        /// The port.
        port: u16,
    },
}

/// One rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The matches, in order.
    pub matches: Vec<Match>,
    /// The statement.
    pub action: Action,
    /// The comment, already encoded.
    pub comment: Option<Box<str>>,
}

impl Rule {
    /// A rule without comment.
    pub fn new(matches: Vec<Match>, action: Action) -> Self {
        Self {
            matches,
            action,
            comment: None,
        }
    }

    /// A rule that only ends in `verdict`.
    pub fn verdict(matches: Vec<Match>, verdict: Verdict) -> Self {
        Self::new(matches, Action::Verdict(verdict))
    }

    /// With the (encoded) comment.
    pub fn with_comment(mut self, comment: String) -> Self {
        self.comment = Some(comment.into_boxed_str());
        self
    }
}

/// A base chain's hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    /// `filter` or `nat`.
    pub kind: &'static str,
    /// `prerouting`, `input`, `forward`, `output` or `postrouting`.
    pub hook: &'static str,
    /// The priority.
    pub priority: i32,
}
