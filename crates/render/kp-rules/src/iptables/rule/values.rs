//! The structured values inside matches and targets: addresses, address types, conntrack
//! states, probabilities, `recent` actions, mark operations and reject types, each printing
//! as `iptables-restore` writes it.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

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
    pub(super) fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
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
    pub(super) fn write<W: fmt::Write + ?Sized>(self, out: &mut W) -> fmt::Result {
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

#[cfg(test)]
mod tests {
    use super::CtStates;

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
}
