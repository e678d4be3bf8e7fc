//! [`Target`]: what a rule does (`-j`/`-g` a chain, DNAT, MARK, REJECT, ...) and its restore
//! text.

use std::borrow::Cow;
use std::fmt;
use std::net::SocketAddr;

use super::{MarkOp, RejectWith};

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
    pub(super) fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
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
