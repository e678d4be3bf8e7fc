//! [`Match`]: one match of a rule (`-s`, `-m comment`, `-m recent`, ...) and its restore
//! text.

use std::borrow::Cow;
use std::fmt;

use kp_core::model::Protocol;

use super::{AddrType, AddrTypeSide, Address, CtStates, Probability, RecentAction};

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
/// render, and the octets and ports of endpoint chain names).
pub(crate) fn write_decimal<W: fmt::Write + ?Sized>(out: &mut W, mut n: u32) -> fmt::Result {
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
    pub(super) fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
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
