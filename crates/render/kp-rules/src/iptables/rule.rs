//! Typed iptables rules: what the renderer decides, as values, with the restore text at the
//! edge.
//!
//! The renderer builds [`Rule`]s out of [`Match`]es and a [`Target`] carrying structured
//! values (addresses, ports, marks, conntrack states, probabilities), and hands them to a
//! [`RuleSink`]. `Display` on every type gives exactly the `iptables-restore` text kube-proxy
//! has always written (snapshots pin it byte for byte), so the text backend formats them
//! straight into its buffers; an encoder for nf_tables netlink (iptables-nft's encoding) reads
//! the same values instead of parsing text.
//!
//! Types borrow where the renderer already holds the data (`'a`: chain names, the service's
//! display name) so a rule costs no allocation beyond its match list; [`Rule::into_owned`]
//! gives a `Rule<'static>` to keep.
//!
//! Only what kube-proxy writes is modelled; each variant documents its text and, where the
//! text leaves it implicit, the value iptables fills in (an encoder needs those).

use std::borrow::Cow;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use kp_core::model::Protocol;

use super::comment::Sanitizer;
pub use super::setup::Table;

/// An address match operand as written: a bare address (`-d 10.0.0.1`, which iptables reads
/// as a host prefix, /32 or /128) or a CIDR (`-s 10.0.0.0/8`, printed with its prefix even
/// when it is a host prefix).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Address {
    /// A single address, printed without a prefix length.
    Ip(IpAddr),
    /// A network, printed as `addr/len` (already truncated by the renderer).
    Net(IpNet),
}

impl Address {
    /// The network iptables matches: a bare address is its host prefix.
    pub fn net(&self) -> IpNet {
        match *self {
            Address::Ip(ip) => IpNet::from(ip),
            Address::Net(net) => net,
        }
    }
}

impl From<IpAddr> for Address {
    fn from(ip: IpAddr) -> Self {
        Address::Ip(ip)
    }
}

impl From<IpNet> for Address {
    fn from(net: IpNet) -> Self {
        Address::Net(net)
    }
}

impl Address {
    fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        match self {
            Address::Ip(ip) => write!(out, "{ip}"),
            Address::Net(net) => write!(out, "{net}"),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f)
    }
}

/// Which address `-m addrtype` tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AddrTypeSide {
    /// `--src-type`.
    Source,
    /// `--dst-type`.
    Destination,
}

/// An `-m addrtype` address type (only the one kube-proxy uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AddrType {
    /// `LOCAL`: an address of this host (kernel `RTN_LOCAL`). The bit iptables-nft puts in
    /// the match info is the encoder's business (kp-dataplane's `iptables::netlink`).
    Local,
}

/// A set of conntrack states for `-m conntrack --ctstate`, with xt_conntrack's bit values
/// (`XT_CONNTRACK_STATE_*`), printed in iptables' order (`INVALID,NEW,RELATED,ESTABLISHED,
/// UNTRACKED,SNAT,DNAT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtStates(u16);

impl CtStates {
    /// `INVALID` (`XT_CONNTRACK_STATE_INVALID`, bit 0).
    pub const INVALID: CtStates = CtStates(1 << 0);
    /// `ESTABLISHED` (`IP_CT_ESTABLISHED` + 1, bit 1).
    pub const ESTABLISHED: CtStates = CtStates(1 << 1);
    /// `RELATED` (`IP_CT_RELATED` + 1, bit 2).
    pub const RELATED: CtStates = CtStates(1 << 2);
    /// `NEW` (`IP_CT_NEW` + 1, bit 3).
    pub const NEW: CtStates = CtStates(1 << 3);
    /// `SNAT` (`IP_CT_NUMBER` + 1, bit 6).
    pub const SNAT: CtStates = CtStates(1 << 6);
    /// `DNAT` (`IP_CT_NUMBER` + 2, bit 7).
    pub const DNAT: CtStates = CtStates(1 << 7);
    /// `UNTRACKED` (`IP_CT_NUMBER` + 3, bit 8).
    pub const UNTRACKED: CtStates = CtStates(1 << 8);

    /// Names in iptables' print order.
    const NAMES: [(CtStates, &'static str); 7] = [
        (CtStates::INVALID, "INVALID"),
        (CtStates::NEW, "NEW"),
        (CtStates::RELATED, "RELATED"),
        (CtStates::ESTABLISHED, "ESTABLISHED"),
        (CtStates::UNTRACKED, "UNTRACKED"),
        (CtStates::SNAT, "SNAT"),
        (CtStates::DNAT, "DNAT"),
    ];

    /// The xt_conntrack state mask (`xt_conntrack_mtinfo*.state_mask`).
    pub fn bits(self) -> u16 {
        self.0
    }

    /// Whether every state of `other` is in `self`.
    pub fn contains(self, other: CtStates) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for CtStates {
    type Output = CtStates;

    fn bitor(self, other: CtStates) -> CtStates {
        CtStates(self.0 | other.0)
    }
}

impl CtStates {
    fn write<W: fmt::Write + ?Sized>(self, out: &mut W) -> fmt::Result {
        let mut first = true;
        for (state, name) in Self::NAMES {
            if self.contains(state) {
                if !first {
                    out.write_str(",")?;
                }
                out.write_str(name)?;
                first = false;
            }
        }
        Ok(())
    }
}

impl fmt::Display for CtStates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f)
    }
}

/// `-m statistic --mode random --probability P` for the first of `remaining` endpoints:
/// `1/remaining`, printed as upstream does with 10 decimals.
///
/// Ten decimals keep the values strictly decreasing for up to 100000 endpoints (`1/100001`
/// prints as `0.0000099999`). iptables parses the printed decimal, not `1/n`; an encoder must
/// start from [`Probability::value`] to store what `iptables-restore` would.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Probability {
    remaining: usize,
}

impl Probability {
    /// One in `remaining` (0 is treated as 1, printing `1.0000000000`, rather than dividing
    /// by zero; the renderer never asks for it: the last endpoint has no probability match).
    pub fn one_in(remaining: usize) -> Self {
        Self {
            remaining: remaining.max(1),
        }
    }

    /// The `n` of `1/n`.
    pub fn remaining(self) -> usize {
        self.remaining
    }

    /// The printed decimal read back, which is what iptables parses.
    pub fn value(self) -> f64 {
        // The text is always a plain decimal; `1/n` is its fallback, never reached.
        self.to_string()
            .parse()
            .unwrap_or(1.0 / self.remaining as f64)
    }
}

impl fmt::Display for Probability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.10}", 1.0 / (self.remaining as f64))
    }
}

/// What an `-m recent` match does with the source address in list `name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecentAction {
    /// `--set`: add or refresh the source (xt_recent `XT_RECENT_SET`).
    Set,
    /// `--rcheck --seconds S [--reap]`: matches when the source was seen within `seconds`
    /// (`XT_RECENT_CHECK`, plus `XT_RECENT_REAP` when `reap`; `--seconds` is a field of the
    /// match info, not a flag).
    Rcheck {
        /// The age limit.
        seconds: u32,
        /// Drop entries older than `seconds` while checking.
        reap: bool,
    },
}

/// One match of a rule, printed as the arguments kube-proxy writes for it.
///
/// The list of a rule is printed in order, separated by spaces; some variants only make sense
/// after another one (noted on each), exactly as in the iptables command line.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Match<'a> {
    /// `-m P -p P` (`P` = tcp, udp or sctp): the protocol, with its match extension loaded so
    /// that [`Match::DestinationPort`] may follow. The extension has no options of its own
    /// unless a `DestinationPort` follows (DNAT rules load it without one).
    Protocol(Protocol),
    /// `[! ]-s A`.
    Source {
        /// The address or network.
        addr: Address,
        /// `!`: anything but `addr`.
        negated: bool,
    },
    /// `[! ]-d A`.
    Destination {
        /// The address or network.
        addr: Address,
        /// `!`: anything but `addr`.
        negated: bool,
    },
    /// `[! ]-i NAME[+]`: the input interface (`+`: any name starting with `name`).
    InInterface {
        /// The interface name or prefix (validated: at most 15 bytes of `[A-Za-z0-9._@:-]`).
        name: Cow<'a, str>,
        /// A trailing `+`: `name` is a prefix.
        wildcard: bool,
        /// `!`: any other interface.
        negated: bool,
    },
    /// `--dport N`: an option of the protocol match that must come before it in the rule
    /// ([`Match::Protocol`]).
    DestinationPort(u16),
    /// `-m addrtype --src-type T` / `--dst-type T`.
    AddrType {
        /// Which address is tested.
        side: AddrTypeSide,
        /// The type it must have.
        addr_type: AddrType,
    },
    /// `-m mark [! ]--mark 0xVALUE/0xMASK`: `(mark & mask) == value`.
    Mark {
        /// The value after masking.
        value: u32,
        /// The bits compared.
        mask: u32,
        /// `!`: the masked mark differs.
        negated: bool,
    },
    /// `-m conntrack [! ]--ctstate S,...`.
    Conntrack {
        /// The states (any of them matches).
        states: CtStates,
        /// `!`: none of them.
        negated: bool,
    },
    /// `-m statistic --mode random --probability P`.
    Statistic(Probability),
    /// `-m recent --name NAME --set` or `-m recent --name NAME --rcheck --seconds S [--reap]`,
    /// on the source address (iptables' defaults: `--rsource`, mask all ones).
    Recent {
        /// The list (kube-proxy uses the endpoint chain's name).
        name: Cow<'a, str>,
        /// What to do with the source in that list.
        action: RecentAction,
    },
}

/// `!` before a negated option.
fn bang(negated: bool) -> &'static str {
    if negated { "! " } else { "" }
}

/// Decimal digits of `n` without the formatting machinery (ports and seconds, many per
/// render).
fn write_decimal<W: fmt::Write + ?Sized>(out: &mut W, mut n: u32) -> fmt::Result {
    let mut digits = [0u8; 10];
    let mut at = digits.len();
    loop {
        at -= 1;
        // `n % 10` is a single digit.
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // ASCII digits.
    out.write_str(std::str::from_utf8(&digits[at..]).map_err(|_| fmt::Error)?)
}

impl Match<'_> {
    /// The arguments into `out` (what `Display` gives).
    fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        match self {
            Match::Protocol(protocol) => {
                let p = protocol.as_str();
                out.write_str("-m ")?;
                out.write_str(p)?;
                out.write_str(" -p ")?;
                out.write_str(p)
            }
            Match::Source { addr, negated } => {
                out.write_str(bang(*negated))?;
                out.write_str("-s ")?;
                addr.write(out)
            }
            Match::Destination { addr, negated } => {
                out.write_str(bang(*negated))?;
                out.write_str("-d ")?;
                addr.write(out)
            }
            Match::InInterface {
                name,
                wildcard,
                negated,
            } => {
                out.write_str(bang(*negated))?;
                out.write_str("-i ")?;
                out.write_str(name)?;
                out.write_str(if *wildcard { "+" } else { "" })
            }
            Match::DestinationPort(port) => {
                out.write_str("--dport ")?;
                write_decimal(out, u32::from(*port))
            }
            Match::AddrType { side, addr_type } => {
                out.write_str(match side {
                    AddrTypeSide::Source => "-m addrtype --src-type ",
                    AddrTypeSide::Destination => "-m addrtype --dst-type ",
                })?;
                out.write_str(match addr_type {
                    AddrType::Local => "LOCAL",
                })
            }
            Match::Mark {
                value,
                mask,
                negated,
            } => write!(out, "-m mark {}--mark {value:#x}/{mask:#x}", bang(*negated)),
            Match::Conntrack { states, negated } => {
                out.write_str("-m conntrack ")?;
                out.write_str(bang(*negated))?;
                out.write_str("--ctstate ")?;
                states.write(out)
            }
            Match::Statistic(probability) => {
                write!(
                    out,
                    "-m statistic --mode random --probability {probability}"
                )
            }
            Match::Recent { name, action } => {
                out.write_str("-m recent --name ")?;
                out.write_str(name)?;
                match action {
                    RecentAction::Set => out.write_str(" --set"),
                    RecentAction::Rcheck { seconds, reap } => {
                        out.write_str(" --rcheck --seconds ")?;
                        write_decimal(out, *seconds)?;
                        out.write_str(if *reap { " --reap" } else { "" })
                    }
                }
            }
        }
    }
}

impl fmt::Display for Match<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f)
    }
}

impl Match<'_> {
    /// The same match owning its strings.
    pub fn into_owned(self) -> Match<'static> {
        match self {
            Match::InInterface {
                name,
                wildcard,
                negated,
            } => Match::InInterface {
                name: Cow::Owned(name.into_owned()),
                wildcard,
                negated,
            },
            Match::Recent { name, action } => Match::Recent {
                name: Cow::Owned(name.into_owned()),
                action,
            },
            Match::Protocol(p) => Match::Protocol(p),
            Match::Source { addr, negated } => Match::Source { addr, negated },
            Match::Destination { addr, negated } => Match::Destination { addr, negated },
            Match::DestinationPort(port) => Match::DestinationPort(port),
            Match::AddrType { side, addr_type } => Match::AddrType { side, addr_type },
            Match::Mark {
                value,
                mask,
                negated,
            } => Match::Mark {
                value,
                mask,
                negated,
            },
            Match::Conntrack { states, negated } => Match::Conntrack { states, negated },
            Match::Statistic(p) => Match::Statistic(p),
        }
    }
}

/// `-j MARK`'s operation on the packet mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MarkOp {
    /// `--or-mark 0xV`: set the bits of `V`.
    Or(u32),
    /// `--xor-mark 0xV`: flip the bits of `V`.
    Xor(u32),
}

impl MarkOp {
    /// xt_MARK revision 2's `(mark, mask)` (new mark = `(old & !mask) ^ mark`), as iptables
    /// fills them in: `--or-mark V` is `(V, V)`, `--xor-mark V` is `(V, 0)`.
    pub fn mark_and_mask(self) -> (u32, u32) {
        match self {
            MarkOp::Or(value) => (value, value),
            MarkOp::Xor(value) => (value, 0),
        }
    }
}

/// The ICMP (or TCP) answer of `-j REJECT --reject-with T`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectWith {
    /// `icmp-port-unreachable` (IPv4; iptables' default).
    IcmpPortUnreachable,
    /// `icmp6-port-unreachable` (IPv6; ip6tables' default).
    Icmp6PortUnreachable,
    /// `tcp-reset`.
    TcpReset,
}

impl RejectWith {
    /// The `--reject-with` name.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectWith::IcmpPortUnreachable => "icmp-port-unreachable",
            RejectWith::Icmp6PortUnreachable => "icmp6-port-unreachable",
            RejectWith::TcpReset => "tcp-reset",
        }
    }
}

/// What a matching packet does.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target<'a> {
    /// `-j CHAIN`: a user chain, returning here afterwards.
    Jump(Cow<'a, str>),
    /// `-g CHAIN`: a user chain, not returning here.
    Goto(Cow<'a, str>),
    /// `-j ACCEPT`.
    Accept,
    /// `-j DROP`.
    Drop,
    /// `-j RETURN`.
    Return,
    /// `-j REJECT`, with `--reject-with T` when given (without: the family's port
    /// unreachable, which iptables fills in).
    Reject(Option<RejectWith>),
    /// `-j MASQUERADE [--random-fully]`.
    Masquerade {
        /// `--random-fully` (`NF_NAT_RANGE_PROTO_RANDOM_FULLY`).
        random_fully: bool,
    },
    /// `-j DNAT --to-destination ADDR:PORT` (`[ADDR]:PORT` for IPv6).
    Dnat(SocketAddr),
    /// `-j MARK --or-mark 0xV` / `--xor-mark 0xV`.
    Mark(MarkOp),
}

impl Target<'_> {
    /// The arguments into `out` (what `Display` gives).
    fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        match self {
            Target::Jump(chain) => {
                out.write_str("-j ")?;
                out.write_str(chain)
            }
            Target::Goto(chain) => {
                out.write_str("-g ")?;
                out.write_str(chain)
            }
            Target::Accept => out.write_str("-j ACCEPT"),
            Target::Drop => out.write_str("-j DROP"),
            Target::Return => out.write_str("-j RETURN"),
            Target::Reject(None) => out.write_str("-j REJECT"),
            Target::Reject(Some(with)) => {
                out.write_str("-j REJECT --reject-with ")?;
                out.write_str(with.as_str())
            }
            Target::Masquerade { random_fully } => out.write_str(if *random_fully {
                "-j MASQUERADE --random-fully"
            } else {
                "-j MASQUERADE"
            }),
            Target::Dnat(to) => write!(out, "-j DNAT --to-destination {to}"),
            Target::Mark(MarkOp::Or(value)) => write!(out, "-j MARK --or-mark {value:#x}"),
            Target::Mark(MarkOp::Xor(value)) => write!(out, "-j MARK --xor-mark {value:#x}"),
        }
    }
}

impl fmt::Display for Target<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f)
    }
}

impl Target<'_> {
    /// The same target owning its chain name.
    pub fn into_owned(self) -> Target<'static> {
        match self {
            Target::Jump(chain) => Target::Jump(Cow::Owned(chain.into_owned())),
            Target::Goto(chain) => Target::Goto(Cow::Owned(chain.into_owned())),
            Target::Accept => Target::Accept,
            Target::Drop => Target::Drop,
            Target::Return => Target::Return,
            Target::Reject(with) => Target::Reject(with),
            Target::Masquerade { random_fully } => Target::Masquerade { random_fully },
            Target::Dnat(to) => Target::Dnat(to),
            Target::Mark(op) => Target::Mark(op),
        }
    }
}

/// A rule comment, formatted only when the rule is written.
///
/// `Display` gives the raw text (names from API objects included as they are); a rule prints
/// it percent-encoded and quoted (see [`super::comment`]), and [`Comment::sanitized`] is the
/// text the kernel stores (xt_comment, or the rule userdata under iptables-nft).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Comment<'a> {
    /// Fixed or preformatted text.
    Text(Cow<'a, str>),
    /// `{before}{service}{after}`: a service port's display name (`ns/name:port`) in text.
    Service {
        /// Text before the name.
        before: &'a str,
        /// The service port's display name.
        service: &'a str,
        /// Text after the name.
        after: &'a str,
    },
    /// `{service} -> {endpoint}`: a load-balancing rule's comment.
    Endpoint {
        /// The service port's display name.
        service: &'a str,
        /// The endpoint.
        endpoint: SocketAddr,
    },
}

impl Comment<'_> {
    /// The text as iptables passes it to the kernel: percent-encoded, cut to
    /// [`super::comment::MAX_COMMENT_BYTES`].
    pub fn sanitized(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = self.write_sanitized(&mut out);
        out
    }

    /// The raw text into `out`.
    fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        match self {
            Comment::Text(text) => out.write_str(text),
            Comment::Service {
                before,
                service,
                after,
            } => {
                out.write_str(before)?;
                out.write_str(service)?;
                out.write_str(after)
            }
            Comment::Endpoint { service, endpoint } => {
                out.write_str(service)?;
                out.write_str(" -> ")?;
                write!(out, "{endpoint}")
            }
        }
    }

    /// The sanitized text into `out`.
    fn write_sanitized<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        self.write(&mut Sanitizer::new(out))
    }

    /// The same comment owning its text.
    pub fn into_owned(self) -> Comment<'static> {
        match self {
            Comment::Text(text) => Comment::Text(Cow::Owned(text.into_owned())),
            other => Comment::Text(Cow::Owned(other.to_string())),
        }
    }
}

impl fmt::Display for Comment<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f)
    }
}

impl<'a> From<&'a str> for Comment<'a> {
    fn from(text: &'a str) -> Self {
        Comment::Text(Cow::Borrowed(text))
    }
}

/// One rule appended to a chain: `-A CHAIN [comment] [matches...] [target]`.
///
/// A rule without a target only counts packets (kube-proxy writes one as the last rule of a
/// `KUBE-FW-*` chain, to carry its comment).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule<'a> {
    /// The chain the rule is appended to.
    pub chain: Cow<'a, str>,
    /// Printed first, as `-m comment --comment "..."`.
    pub comment: Option<Comment<'a>>,
    /// Printed in order after the comment.
    pub matches: Vec<Match<'a>>,
    /// Printed last.
    pub target: Option<Target<'a>>,
}

impl<'a> Rule<'a> {
    /// An empty rule for `chain` (matches every packet, no target).
    pub fn new(chain: impl Into<Cow<'a, str>>) -> Self {
        Self {
            chain: chain.into(),
            comment: None,
            matches: Vec::new(),
            target: None,
        }
    }

    /// With this comment.
    pub fn comment(mut self, comment: impl Into<Comment<'a>>) -> Self {
        self.comment = Some(comment.into());
        self
    }

    /// With this match added at the end.
    pub fn with(mut self, m: Match<'a>) -> Self {
        self.matches.push(m);
        self
    }

    /// With these matches added at the end, in order.
    pub fn with_all(mut self, matches: impl IntoIterator<Item = Match<'a>>) -> Self {
        self.matches.extend(matches);
        self
    }

    /// With this target.
    pub fn target(mut self, target: Target<'a>) -> Self {
        self.target = Some(target);
        self
    }

    /// With `-j chain`.
    pub fn jump(self, chain: impl Into<Cow<'a, str>>) -> Self {
        self.target(Target::Jump(chain.into()))
    }

    /// The same rule owning all its strings.
    pub fn into_owned(self) -> Rule<'static> {
        Rule {
            chain: Cow::Owned(self.chain.into_owned()),
            comment: self.comment.map(Comment::into_owned),
            matches: self.matches.into_iter().map(Match::into_owned).collect(),
            target: self.target.map(Target::into_owned),
        }
    }
}

impl Rule<'_> {
    /// The restore line without its newline into `out` (what `Display` gives).
    fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        out.write_str("-A ")?;
        out.write_str(&self.chain)?;
        if let Some(comment) = &self.comment {
            out.write_str(" -m comment --comment \"")?;
            comment.write_sanitized(out)?;
            out.write_str("\"")?;
        }
        for m in &self.matches {
            out.write_str(" ")?;
            m.write(out)?;
        }
        if let Some(target) = &self.target {
            out.write_str(" ")?;
            target.write(out)?;
        }
        Ok(())
    }
}

impl fmt::Display for Rule<'_> {
    /// The restore line without its newline: `-A CHAIN ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f)
    }
}

/// Where the renderer sends what it produces, in render order.
///
/// Render order is not dependency order: a rule may jump to a chain declared later. Like
/// `iptables-restore` (which reads every `:CHAIN` line of a table before its rules), a sink
/// that applies as it goes must create every declared chain of a table before that table's
/// rules, and run deletions after them, in the order given.
pub trait RuleSink {
    /// `:CHAIN - [0:0]`: create `chain` in `table`, or flush it when it exists.
    fn chain(&mut self, table: Table, chain: &str);
    /// `-A ...`: append `rule` to its chain in `table`.
    fn rule(&mut self, table: Table, rule: Rule<'_>);
    /// `-X CHAIN`: delete `chain` (declared, so flushed, earlier in the same table).
    fn delete_chain(&mut self, table: Table, chain: &str);
    /// One service port is complete: its filter and dispatch rules and (when written) its
    /// own chains were all sent, so nothing sent so far jumps to a chain still to come. A
    /// sink may apply what it holds here (iptables mode's netlink path splits a large first
    /// sync this way). Nothing by default.
    fn service_done(&mut self) {}
}

/// One entry after a table's chain declarations.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    /// `-A ...`.
    Rule(Rule<'static>),
    /// `-X CHAIN`.
    DeleteChain(String),
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Rule(rule) => write!(f, "{rule}"),
            Entry::DeleteChain(chain) => write!(f, "-X {chain}"),
        }
    }
}

/// One table's part of a restore: chain declarations, then rules and deletions in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TableRestore {
    /// The table.
    pub table: Table,
    /// Declared (created or flushed) chains, in order.
    pub chains: Vec<String>,
    /// Everything after the declarations, in order.
    pub entries: Vec<Entry>,
}

impl fmt::Display for TableRestore {
    /// `*table`, the `:CHAIN - [0:0]` lines, the entries, `COMMIT`, each line ending in `\n`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "*{}", self.table.as_str())?;
        for chain in &self.chains {
            writeln!(f, ":{chain} - [0:0]")?;
        }
        for entry in &self.entries {
            writeln!(f, "{entry}")?;
        }
        f.write_str("COMMIT\n")
    }
}

/// A whole restore input as typed values: a [`RuleSink`] that keeps everything, tables in the
/// order they were first used. `Display` gives the `iptables-restore` text.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Restore {
    /// The tables, in order of first use.
    pub tables: Vec<TableRestore>,
}

impl Restore {
    /// The part for `table`, added at the end when new.
    fn table(&mut self, table: Table) -> &mut TableRestore {
        let at = match self.tables.iter().position(|t| t.table == table) {
            Some(at) => at,
            None => {
                self.tables.push(TableRestore {
                    table,
                    chains: Vec::new(),
                    entries: Vec::new(),
                });
                self.tables.len() - 1
            }
        };
        &mut self.tables[at]
    }

    /// Every rule of every table, with its table.
    pub fn rules(&self) -> impl Iterator<Item = (Table, &Rule<'static>)> {
        self.tables.iter().flat_map(|t| {
            t.entries.iter().filter_map(move |entry| match entry {
                Entry::Rule(rule) => Some((t.table, rule)),
                Entry::DeleteChain(_) => None,
            })
        })
    }
}

impl RuleSink for Restore {
    fn chain(&mut self, table: Table, chain: &str) {
        self.table(table).chains.push(chain.to_owned());
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        self.table(table)
            .entries
            .push(Entry::Rule(rule.into_owned()));
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        self.table(table)
            .entries
            .push(Entry::DeleteChain(chain.to_owned()));
    }
}

impl fmt::Display for Restore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for table in &self.tables {
            write!(f, "{table}")?;
        }
        Ok(())
    }
}

/// A [`RuleSink`] that formats straight into restore text (no typed rule is kept): what the
/// `iptables-restore` backend applies. Same text as [`Restore`]'s `Display`.
#[derive(Debug, Default)]
pub struct RestoreText {
    /// Per table in order of first use: `(table, chain lines, rule lines)`.
    tables: Vec<(Table, String, String)>,
}

impl RestoreText {
    fn table(&mut self, table: Table) -> &mut (Table, String, String) {
        let at = match self.tables.iter().position(|t| t.0 == table) {
            Some(at) => at,
            None => {
                self.tables.push((table, String::new(), String::new()));
                self.tables.len() - 1
            }
        };
        &mut self.tables[at]
    }

    /// The restore input.
    pub fn finish(self) -> String {
        let len = self
            .tables
            .iter()
            .map(|(_, chains, rules)| chains.len() + rules.len() + 24)
            .sum();
        let mut text = String::with_capacity(len);
        for (table, chains, rules) in &self.tables {
            text.push('*');
            text.push_str(table.as_str());
            text.push('\n');
            text.push_str(chains);
            text.push_str(rules);
            text.push_str("COMMIT\n");
        }
        text
    }
}

impl RestoreText {
    /// Whether `table` is the last table used (so its rules end the input).
    pub(crate) fn ends_with(&self, table: Table) -> bool {
        self.tables.last().is_some_and(|t| t.0 == table)
    }

    /// The input up to where the last table's rules go: every table before it whole, then
    /// its header and chain declarations and whatever rules it holds, without `COMMIT`.
    pub(crate) fn write_open<W: std::io::Write + ?Sized>(
        &self,
        out: &mut W,
    ) -> std::io::Result<()> {
        let last = self.tables.len().saturating_sub(1);
        for (at, (table, chains, rules)) in self.tables.iter().enumerate() {
            out.write_all(b"*")?;
            out.write_all(table.as_str().as_bytes())?;
            out.write_all(b"\n")?;
            out.write_all(chains.as_bytes())?;
            out.write_all(rules.as_bytes())?;
            if at != last {
                out.write_all(b"COMMIT\n")?;
            }
        }
        Ok(())
    }
}

/// The first pass of [`super::render_to`]: a [`RestoreText`] that keeps everything but the
/// rules and deletions of `streamed` (the big nat table), which the second pass writes.
#[derive(Debug)]
pub(crate) struct RestoreHead {
    /// The table left out.
    pub(crate) streamed: Table,
    /// Everything else.
    pub(crate) text: RestoreText,
}

impl RuleSink for RestoreHead {
    fn chain(&mut self, table: Table, chain: &str) {
        self.text.chain(table, chain);
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        if table != self.streamed {
            self.text.rule(table, rule);
        }
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        if table != self.streamed {
            self.text.delete_chain(table, chain);
        }
    }
}

/// The second pass of [`super::render_to`]: the rule and deletion lines of `table`, written
/// to `out` as they come (one line formatted at a time); everything else is ignored. Keeps
/// the first write error and writes nothing after it.
pub(crate) struct RestoreTail<'w, W: std::io::Write + ?Sized> {
    /// The table written.
    pub(crate) table: Table,
    /// Where the lines go.
    pub(crate) out: &'w mut W,
    /// The line being formatted (reused).
    pub(crate) line: String,
    /// The first write error.
    pub(crate) error: Option<std::io::Error>,
}

impl<W: std::io::Write + ?Sized> RestoreTail<'_, W> {
    fn emit(&mut self) {
        if self.error.is_none()
            && let Err(err) = self.out.write_all(self.line.as_bytes())
        {
            self.error = Some(err);
        }
    }
}

impl<W: std::io::Write + ?Sized> RuleSink for RestoreTail<'_, W> {
    fn chain(&mut self, _table: Table, _chain: &str) {}

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        if table != self.table || self.error.is_some() {
            return;
        }
        self.line.clear();
        // Writing into a String cannot fail.
        let _ = rule.write(&mut self.line);
        self.line.push('\n');
        self.emit();
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        if table != self.table || self.error.is_some() {
            return;
        }
        self.line.clear();
        self.line.push_str("-X ");
        self.line.push_str(chain);
        self.line.push('\n');
        self.emit();
    }
}

impl RuleSink for RestoreText {
    fn chain(&mut self, table: Table, chain: &str) {
        let chains = &mut self.table(table).1;
        chains.push(':');
        chains.push_str(chain);
        chains.push_str(" - [0:0]\n");
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        let rules = &mut self.table(table).2;
        // Writing into a String cannot fail.
        let _ = rule.write(rules);
        rules.push('\n');
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        let rules = &mut self.table(table).2;
        rules.push_str("-X ");
        rules.push_str(chain);
        rules.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("literal")
    }

    fn net(text: &str) -> IpNet {
        text.parse().expect("literal")
    }

    #[test]
    fn matches_print_as_restore_arguments() {
        let cases: Vec<(Match<'_>, &str)> = vec![
            (Match::Protocol(Protocol::Tcp), "-m tcp -p tcp"),
            (Match::Protocol(Protocol::Sctp), "-m sctp -p sctp"),
            (
                Match::Source {
                    addr: ip("10.0.0.1").into(),
                    negated: false,
                },
                "-s 10.0.0.1",
            ),
            (
                Match::Source {
                    addr: net("10.0.0.0/8").into(),
                    negated: true,
                },
                "! -s 10.0.0.0/8",
            ),
            (
                Match::Destination {
                    addr: net("::1/128").into(),
                    negated: true,
                },
                "! -d ::1/128",
            ),
            (
                Match::Destination {
                    addr: ip("fd00::1").into(),
                    negated: false,
                },
                "-d fd00::1",
            ),
            (
                Match::InInterface {
                    name: "veth".into(),
                    wildcard: true,
                    negated: true,
                },
                "! -i veth+",
            ),
            (
                Match::InInterface {
                    name: "cbr0".into(),
                    wildcard: false,
                    negated: false,
                },
                "-i cbr0",
            ),
            (Match::DestinationPort(30080), "--dport 30080"),
            (
                Match::AddrType {
                    side: AddrTypeSide::Destination,
                    addr_type: AddrType::Local,
                },
                "-m addrtype --dst-type LOCAL",
            ),
            (
                Match::AddrType {
                    side: AddrTypeSide::Source,
                    addr_type: AddrType::Local,
                },
                "-m addrtype --src-type LOCAL",
            ),
            (
                Match::Mark {
                    value: 0x4000,
                    mask: 0x4000,
                    negated: true,
                },
                "-m mark ! --mark 0x4000/0x4000",
            ),
            (
                Match::Conntrack {
                    states: CtStates::DNAT | CtStates::ESTABLISHED | CtStates::RELATED,
                    negated: true,
                },
                "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT",
            ),
            (
                Match::Conntrack {
                    states: CtStates::INVALID,
                    negated: false,
                },
                "-m conntrack --ctstate INVALID",
            ),
            (
                Match::Statistic(Probability::one_in(3)),
                "-m statistic --mode random --probability 0.3333333333",
            ),
            (
                Match::Recent {
                    name: "KUBE-SEP-ABC".into(),
                    action: RecentAction::Rcheck {
                        seconds: 10800,
                        reap: true,
                    },
                },
                "-m recent --name KUBE-SEP-ABC --rcheck --seconds 10800 --reap",
            ),
            (
                Match::Recent {
                    name: "KUBE-SEP-ABC".into(),
                    action: RecentAction::Set,
                },
                "-m recent --name KUBE-SEP-ABC --set",
            ),
        ];
        for (m, text) in cases {
            assert_eq!(m.to_string(), text);
            assert_eq!(m.clone().into_owned(), m);
        }
    }

    #[test]
    fn numbers_print_in_decimal_at_the_edges() {
        for port in [0u16, 1, 9, 10, 65535] {
            assert_eq!(
                Match::DestinationPort(port).to_string(),
                format!("--dport {port}")
            );
        }
        let recent = |seconds| Match::Recent {
            name: "L".into(),
            action: RecentAction::Rcheck {
                seconds,
                reap: false,
            },
        };
        assert_eq!(
            recent(u32::MAX).to_string(),
            format!("-m recent --name L --rcheck --seconds {}", u32::MAX)
        );
        assert_eq!(
            recent(0).to_string(),
            "-m recent --name L --rcheck --seconds 0"
        );
    }

    #[test]
    fn targets_print_as_restore_arguments() {
        let cases: Vec<(Target<'_>, &str)> = vec![
            (Target::Jump("KUBE-SVC-X".into()), "-j KUBE-SVC-X"),
            (Target::Goto("KUBE-SVC-X".into()), "-g KUBE-SVC-X"),
            (Target::Accept, "-j ACCEPT"),
            (Target::Drop, "-j DROP"),
            (Target::Return, "-j RETURN"),
            (Target::Reject(None), "-j REJECT"),
            (
                Target::Reject(Some(RejectWith::TcpReset)),
                "-j REJECT --reject-with tcp-reset",
            ),
            (
                Target::Masquerade { random_fully: true },
                "-j MASQUERADE --random-fully",
            ),
            (
                Target::Masquerade {
                    random_fully: false,
                },
                "-j MASQUERADE",
            ),
            (
                Target::Dnat(SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3)), 80)),
                "-j DNAT --to-destination 10.1.2.3:80",
            ),
            (
                Target::Dnat(SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 8080)),
                "-j DNAT --to-destination [::1]:8080",
            ),
            (Target::Mark(MarkOp::Or(0x4000)), "-j MARK --or-mark 0x4000"),
            (
                Target::Mark(MarkOp::Xor(0x4000)),
                "-j MARK --xor-mark 0x4000",
            ),
        ];
        for (target, text) in cases {
            assert_eq!(target.to_string(), text);
            assert_eq!(target.clone().into_owned(), target);
        }
    }

    #[test]
    fn mark_ops_give_xt_mark_values() {
        assert_eq!(MarkOp::Or(0x4000).mark_and_mask(), (0x4000, 0x4000));
        assert_eq!(MarkOp::Xor(0x4000).mark_and_mask(), (0x4000, 0));
    }

    #[test]
    fn conntrack_states_have_xt_conntrack_bits() {
        assert_eq!(CtStates::INVALID.bits(), 0x1);
        assert_eq!(CtStates::ESTABLISHED.bits(), 0x2);
        assert_eq!(CtStates::RELATED.bits(), 0x4);
        assert_eq!(CtStates::NEW.bits(), 0x8);
        assert_eq!(CtStates::SNAT.bits(), 0x40);
        assert_eq!(CtStates::DNAT.bits(), 0x80);
        assert_eq!(CtStates::UNTRACKED.bits(), 0x100);
        let all = CtStates::NAMES
            .iter()
            .fold(CtStates(0), |acc, (state, _)| acc | *state);
        assert_eq!(
            all.to_string(),
            "INVALID,NEW,RELATED,ESTABLISHED,UNTRACKED,SNAT,DNAT"
        );
    }

    #[test]
    fn probability_value_is_the_printed_decimal() {
        assert_eq!(Probability::one_in(3).to_string(), "0.3333333333");
        assert_eq!(Probability::one_in(3).value(), 0.3333333333);
        assert_eq!(Probability::one_in(0).to_string(), "1.0000000000");
        assert_eq!(Probability::one_in(100_001).to_string(), "0.0000099999");
        assert_eq!(Probability::one_in(7).remaining(), 7);
    }

    #[test]
    fn addresses_keep_how_they_were_written() {
        assert_eq!(Address::Ip(ip("10.0.0.1")).to_string(), "10.0.0.1");
        assert_eq!(Address::Net(net("10.0.0.1/32")).to_string(), "10.0.0.1/32");
        assert_eq!(Address::Ip(ip("10.0.0.1")).net(), net("10.0.0.1/32"));
        assert_eq!(Address::Ip(ip("fd00::1")).net(), net("fd00::1/128"));
    }

    #[test]
    fn rules_print_comment_first_then_matches_then_target() {
        let rule = Rule::new("KUBE-SERVICES")
            .comment(Comment::Service {
                before: "",
                service: "ns/svc:http",
                after: " cluster IP",
            })
            .with(Match::Protocol(Protocol::Tcp))
            .with(Match::Destination {
                addr: ip("10.96.0.10").into(),
                negated: false,
            })
            .with(Match::DestinationPort(80))
            .jump("KUBE-SVC-ABC");
        assert_eq!(
            rule.to_string(),
            "-A KUBE-SERVICES -m comment --comment \"ns/svc:http cluster IP\" \
             -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-SVC-ABC"
        );
        let owned = rule.clone().into_owned();
        assert_eq!(owned.to_string(), rule.to_string());
        assert_eq!(Rule::new("KUBE-FW-X").to_string(), "-A KUBE-FW-X");
    }

    #[test]
    fn comments_are_encoded_when_printed_and_raw_in_display() {
        let hostile = Comment::Endpoint {
            service: "a\" -j ACCEPT/x\ny:p",
            endpoint: SocketAddr::new(ip("10.0.0.1"), 80),
        };
        assert_eq!(hostile.to_string(), "a\" -j ACCEPT/x\ny:p -> 10.0.0.1:80");
        assert_eq!(hostile.sanitized(), "a%22 -j ACCEPT/x%0Ay:p -> 10.0.0.1:80");
        let rule = Rule::new("C").comment(hostile.clone()).target(Target::Drop);
        assert_eq!(
            rule.to_string(),
            "-A C -m comment --comment \"a%22 -j ACCEPT/x%0Ay:p -> 10.0.0.1:80\" -j DROP"
        );
        assert_eq!(
            hostile.into_owned(),
            Comment::Text("a\" -j ACCEPT/x\ny:p -> 10.0.0.1:80".into())
        );
    }

    #[test]
    fn typed_and_streamed_restores_give_the_same_text() {
        fn feed(sink: &mut impl RuleSink) {
            sink.chain(Table::Filter, "KUBE-FORWARD");
            sink.chain(Table::Nat, "KUBE-SERVICES");
            sink.rule(Table::Nat, Rule::new("KUBE-SERVICES").jump("KUBE-SVC-A"));
            sink.rule(
                Table::Filter,
                Rule::new("KUBE-FORWARD")
                    .with(Match::Conntrack {
                        states: CtStates::INVALID,
                        negated: false,
                    })
                    .target(Target::Drop),
            );
            sink.chain(Table::Nat, "KUBE-SVC-OLD");
            sink.delete_chain(Table::Nat, "KUBE-SVC-OLD");
        }
        let mut typed = Restore::default();
        let mut text = RestoreText::default();
        feed(&mut typed);
        feed(&mut text);
        let want = "*filter\n:KUBE-FORWARD - [0:0]\n\
                    -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\nCOMMIT\n\
                    *nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-OLD - [0:0]\n\
                    -A KUBE-SERVICES -j KUBE-SVC-A\n-X KUBE-SVC-OLD\nCOMMIT\n";
        assert_eq!(typed.to_string(), want);
        assert_eq!(text.finish(), want);
        assert_eq!(typed.rules().count(), 2);
    }
}
