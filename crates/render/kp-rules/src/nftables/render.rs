//! The chain-per-service renderer, in three phases, one module each:
//!
//! - [`fixed`]: the table's fixed part (base chains, helper chains, sets and maps, and their
//!   rules), the same for every service;
//! - [`service`]: one service port's objects (its chains and rules, affinity sets and
//!   set/map elements), written from the shared [`ServicePlan`](crate::plan::ServicePlan),
//!   and their commands;
//! - [`transaction`]: the sync, assembled in the order the kernel needs: which service ports
//!   a sync rewrites, what goes stale, the element changes ([`elements`]), and the state
//!   update.
//!
//! This module holds what the phases share: the render's context (family, detector, node)
//! and the small builders of matches, rules and commands.

mod elements;
mod fixed;
mod service;
mod transaction;

use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{IpFamily, NodeInfo};
use kp_core::tracker::ProxyState;

use super::cmd::{Addr, AddrField, Command, Match, Name, Rule, Verdict};
use super::{LocalDetector, MAX_COMMENT_BYTES, RenderConfig};
use crate::iptables::comment::sanitize;
use crate::plan::Masquerading;

pub use transaction::{StepRenderError, render, render_in_steps};

/// Family-specific values.
struct Family {
    /// Loopback destinations never accept NodePorts.
    loopback: Addr,
}

impl Family {
    fn new(family: IpFamily) -> Self {
        let loopback = match family {
            IpFamily::V4 => Addr::Net(IpNet::V4(
                ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(127, 0, 0, 0), 8).unwrap_or_default(),
            )),
            IpFamily::V6 => Addr::Host(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)),
        };
        Self { loopback }
    }
}

/// The local-traffic detector as nft matches.
struct Detector {
    if_local: Match,
    if_not_local: Match,
}

impl Detector {
    /// `config` must have been validated (one CIDR per family at most, sane interface names,
    /// which therefore need no escaping inside quotes).
    fn new(config: &RenderConfig, family: IpFamily) -> Option<Self> {
        let matches = |negate: bool| -> Option<Match> {
            Some(match &config.local_detector {
                LocalDetector::None => return None,
                LocalDetector::Cidrs(cidrs) => Match::Addr {
                    field: AddrField::Source,
                    negate,
                    value: Addr::Net(
                        cidrs
                            .iter()
                            .find(|c| IpFamily::of_net(c) == family)?
                            .trunc(),
                    ),
                },
                LocalDetector::BridgeInterface(name) => Match::Iifname {
                    negate,
                    name: name.clone(),
                    wildcard: false,
                },
                LocalDetector::InterfaceNamePrefix(prefix) => Match::Iifname {
                    negate,
                    name: prefix.clone(),
                    wildcard: true,
                },
            })
        };
        Some(Self {
            if_local: matches(false)?,
            if_not_local: matches(true)?,
        })
    }
}

/// A comment as nft takes it: percent-encoded (no quote, backslash or control character
/// survives) and cut to nft's limit without splitting an escape.
fn comment_text(text: &str) -> String {
    let mut encoded = sanitize(text);
    if encoded.len() > MAX_COMMENT_BYTES {
        let mut cut = MAX_COMMENT_BYTES;
        // Escapes are `%XX` and `%` never appears literally.
        if let Some(pos) = encoded[..cut].rfind('%')
            && pos + 3 > cut
        {
            cut = pos;
        }
        encoded.truncate(cut);
    }
    encoded
}

/// `ip daddr ADDR` (or saddr).
fn addr_is(field: AddrField, addr: IpAddr) -> Match {
    Match::Addr {
        field,
        negate: false,
        value: Addr::Host(addr),
    }
}

/// `ip daddr @SET` (or saddr).
fn addr_in_set(field: AddrField, set: impl Into<Name>) -> Match {
    Match::AddrInSet {
        field,
        set: set.into(),
    }
}

/// A rule ending in `jump CHAIN`.
fn jump(matches: Vec<Match>, chain: impl Into<Name>) -> Rule {
    Rule::verdict(matches, Verdict::Jump(chain.into()))
}

/// A rule ending in `goto CHAIN`.
fn goto(matches: Vec<Match>, chain: impl Into<Name>) -> Rule {
    Rule::verdict(matches, Verdict::Goto(chain.into()))
}

/// `add chain` of a regular chain.
fn add_chain(chain: impl Into<Name>) -> Command {
    Command::AddChain {
        chain: chain.into(),
        hook: None,
        comment: None,
    }
}

/// `add rule`.
fn add_rule(chain: impl Into<Name>, rule: Rule) -> Command {
    Command::AddRule {
        chain: chain.into(),
        rule,
    }
}

/// Settings shared by every service of one render.
struct Context<'a> {
    family: IpFamily,
    fam: Family,
    config: &'a RenderConfig,
    detector: Option<Detector>,
    /// The masquerade settings of every service port's plan.
    masquerading: Masquerading,
    node: &'a NodeInfo,
    /// This node's IP of `family`, for each plan's [`crate::plan::ServicePlan::allow_from_node`].
    node_ip: Option<IpAddr>,
    /// The protocols whose localhost NodePort traffic is rejected (KEP-6032).
    localhost_rejects: &'static [kp_core::model::Protocol],
}

impl<'a> Context<'a> {
    /// The context of `family` under `config` (validated) on `state`'s node.
    fn new(state: &'a ProxyState, config: &'a RenderConfig, family: IpFamily) -> Self {
        let detector = Detector::new(config, family);
        Self {
            family,
            masquerading: Masquerading {
                all: config.masquerade_all,
                detector: detector.is_some(),
            },
            detector,
            fam: Family::new(family),
            config,
            node: &state.node,
            node_ip: crate::iptables::node_ip(&config.node_ips, &state.node, family),
            localhost_rejects: config.nftables_localhost_rejects.protocols(family),
        }
    }
}

/// Internals the unit tests check directly.
#[cfg(test)]
pub(super) mod tests_support {
    /// See [`super::comment_text`].
    pub fn comment_text(text: &str) -> String {
        super::comment_text(text)
    }
}
