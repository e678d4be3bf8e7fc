//! From the renderer's typed rules to iptables-nft's netlink messages: [`NetlinkSink`] is a
//! [`RuleSink`] that encodes what `iptables-nft-restore --noflush` would send for the same
//! restore input, and refuses (with [`Unsupported`]) anything it has not been checked for.
//!
//! How iptables reads a rule decides the encoding, not the order the text is written in:
//! the "IP part" (`-i`, `-p`, `-s`, `-d`) lives in the rule's header and is encoded first, in
//! that fixed order (iptables-nft's `nft_ipv4_add`/`nft_ipv6_add`), wherever it stood on the
//! line; then come the matches in the order of their `-m` (the comment first, as the renderer
//! writes it first), a `--dport` being an option of the protocol match it follows; then the
//! counter and the target.
//!
//! Message order follows the restore too, because rule handles are numbered per table in
//! creation order and `nft --debug=netlink list ruleset` shows them: per table (in order of
//! first use), the table, every declared chain (created if missing, then flushed, as
//! `:CHAIN - [0:0]` does with `--noflush`), then rules and chain deletions in render order.

use std::net::IpAddr;

use kp_core::model::{IpFamily, Protocol};
use kp_nftnl::Batch;
use kp_nftnl::codec::Family;
use kp_nftnl::expr::Verdict;
use kp_nftnl::xt::{
    self, ADDRTYPE_LOCAL, PROTO_SCTP, PROTO_TCP, PROTO_UDP, Position, RecentOp, XtBatch, XtRule,
};
use kp_rules::iptables::names::is_service_chain;
use kp_rules::iptables::{
    AddrType, AddrTypeSide, Comment, Match, RecentAction, RejectWith, Rule, RuleSink, Table, Target,
};

use super::handles::{Diff, Installed, Key, diff};
use std::collections::HashMap;

/// Something the encoder has no verified encoding for; the render goes to
/// `iptables-restore` instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} (in `{rule}`)")]
pub struct Unsupported {
    /// What is not supported.
    pub what: String,
    /// The rule, as restore text.
    pub rule: String,
}

/// One table's messages: the declarations, then the entries (kept apart so that every chain
/// exists before any rule jumps to it, and handles are numbered as the restore numbers them).
struct TableBatches {
    table: Table,
    declarations: Batch,
    entries: Batch,
    /// Restore lines of each part, for mapping a kernel error to a line.
    declared: usize,
    entered: usize,
    /// Top-level chains edited in place this sync ([`handles`]): each with its new rules.
    edited: Vec<(String, Vec<(XtRule, Key)>)>,
}

/// Owners of in-place edits start here (restore lines are far below), so their echoes can be
/// told apart.
const EDIT_OWNER: usize = 1 << 30;

/// A [`RuleSink`] building one netlink transaction for one family; [`NetlinkSink::finish`]
/// gives the batch, or the first [`Unsupported`] rule.
///
/// Without `previous` (full syncs, or when the handles are not known) every declared chain
/// is flushed and refilled, exactly as the restore does, and the top-level chains' rule keys
/// are recorded so their handles can be learned after the commit. With `previous`, the
/// top-level chains it knows are edited in place ([`handles`]).
pub struct NetlinkSink {
    family: IpFamily,
    tables: Vec<TableBatches>,
    error: Option<Unsupported>,
    rules: usize,
    previous: Option<Installed>,
    /// Top-level chains written whole this sync, with their rules' keys in order.
    learned: Vec<((Table, String), Vec<Key>)>,
}

/// A finished transaction and what to learn from the kernel once it is applied.
pub struct Prepared {
    /// The transaction.
    pub batch: Batch,
    /// How to work out the new [`Installed`].
    pub plan: Plan,
}

/// What a sync does to the top-level chains, to compute [`Installed`] after it.
pub struct Plan {
    /// Chains written whole: dump their handles ([`Plan::learn`]).
    learned: Vec<((Table, String), Vec<Key>)>,
    /// Chains edited: the rules kept at the start, inserted (owner and key), kept at the end.
    edited: Vec<((Table, String), Edited)>,
}

struct Edited {
    prefix: Vec<(Key, u64)>,
    inserted: Vec<(usize, Key)>,
    suffix: Vec<(Key, u64)>,
}

impl Plan {
    /// The chains whose handles must be dumped after the commit.
    pub fn learn(&self) -> impl Iterator<Item = &(Table, String)> {
        self.learned.iter().map(|(chain, _)| chain)
    }

    /// The kernel's state of the top-level chains after the commit, from the echoes of the
    /// inserted rules and the dumps (rule handles in order) of [`Plan::learn`]'s chains, in
    /// that order. `None` when they do not add up (then the next sync writes them whole).
    pub fn complete(self, echoes: &[(usize, Vec<u8>)], dumped: &[Vec<u64>]) -> Option<Installed> {
        let mut installed = Installed::default();
        if dumped.len() != self.learned.len() {
            return None;
        }
        for ((chain, keys), handles) in self.learned.into_iter().zip(dumped) {
            if keys.len() != handles.len() {
                return None;
            }
            installed.chains.insert(
                chain,
                keys.into_iter().zip(handles.iter().copied()).collect(),
            );
        }
        let echoed: HashMap<usize, u64> = echoes
            .iter()
            .filter_map(|(owner, message)| Some((*owner, kp_nftnl::xt::rule_handle(message)?)))
            .collect();
        for (chain, edited) in self.edited {
            let mut rules = edited.prefix;
            for (owner, key) in edited.inserted {
                rules.push((key, *echoed.get(&owner)?));
            }
            rules.extend(edited.suffix);
            installed.chains.insert(chain, rules);
        }
        Some(installed)
    }
}

impl NetlinkSink {
    /// An empty transaction for `family`; `previous` is what the top-level chains hold
    /// (`None`: write them whole).
    pub fn new(family: IpFamily, previous: Option<Installed>) -> Self {
        Self {
            family,
            tables: Vec::new(),
            error: None,
            rules: 0,
            previous,
            learned: Vec::new(),
        }
    }

    fn nf_family(&self) -> Family {
        super::family(self.family)
    }

    fn table(&mut self, table: Table) -> &mut TableBatches {
        let at = match self.tables.iter().position(|t| t.table == table) {
            Some(at) => at,
            None => {
                self.tables.push(TableBatches {
                    table,
                    declarations: Batch::new(0),
                    entries: Batch::new(0),
                    declared: 0,
                    entered: 0,
                    edited: Vec::new(),
                });
                self.tables.len() - 1
            }
        };
        &mut self.tables[at]
    }

    /// Whether `chain` is edited in place this sync.
    fn edits(&self, table: Table, chain: &str) -> bool {
        self.previous
            .as_ref()
            .is_some_and(|p| p.chains.contains_key(&(table, chain.to_owned())))
    }

    /// Rules encoded so far.
    pub fn rules(&self) -> usize {
        self.rules
    }

    /// The transaction, starting at sequence number `seq`: per table the table itself, its
    /// declarations, the in-place edits (deletions by handle, then insertions), its
    /// entries. A kernel error names the line of the equivalent restore input (1-based, as
    /// `iptables-restore` counts; edits have owners from [`EDIT_OWNER`] on).
    pub fn finish(mut self, seq: u32) -> Result<Prepared, Unsupported> {
        if let Some(error) = self.error {
            return Err(error);
        }
        let family = super::family(self.family);
        let mut previous = self.previous.take().unwrap_or_default();
        let mut batch = Batch::new(seq);
        let mut line = 0;
        let mut edit_owner = EDIT_OWNER;
        let mut edited_plan = Vec::new();
        for t in self.tables {
            let table = t.table.as_str();
            // `*table`.
            line += 1;
            batch.xt_table(family, table, line);
            batch.append(t.declarations, line + 1);
            line += t.declared;
            for (chain, new) in t.edited {
                let old = previous
                    .chains
                    .remove(&(t.table, chain.clone()))
                    .unwrap_or_default();
                let keys: Vec<Key> = new.iter().map(|(_, key)| *key).collect();
                let Diff { prefix, suffix } = diff(&old, &keys);
                for (_, handle) in &old[prefix..old.len() - suffix] {
                    batch.xt_delete_rule(family, table, &chain, *handle, edit_owner);
                    edit_owner += 1;
                }
                let middle = &new[prefix..new.len() - suffix];
                // Each insertion goes right before the first kept rule after it, or right
                // after the last kept one before it (so those go in reverse), or at the end.
                let (position, reverse) = if suffix > 0 {
                    (Position::Before(old[old.len() - suffix].1), false)
                } else if prefix > 0 {
                    (Position::After(old[prefix - 1].1), true)
                } else {
                    (Position::Append, false)
                };
                let mut inserted: Vec<(usize, Key)> = Vec::with_capacity(middle.len());
                let order: Box<dyn Iterator<Item = &(XtRule, Key)>> = if reverse {
                    Box::new(middle.iter().rev())
                } else {
                    Box::new(middle.iter())
                };
                for (rule, key) in order {
                    batch.xt_rule(family, table, &chain, rule, position, true, edit_owner);
                    inserted.push((edit_owner, *key));
                    edit_owner += 1;
                }
                if reverse {
                    inserted.reverse();
                }
                edited_plan.push((
                    (t.table, chain),
                    Edited {
                        prefix: old[..prefix].to_vec(),
                        inserted,
                        suffix: old[old.len() - suffix..].to_vec(),
                    },
                ));
            }
            batch.append(t.entries, line + 1);
            // The entries, then `COMMIT`.
            line += t.entered + 1;
        }
        Ok(Prepared {
            batch,
            plan: Plan {
                learned: self.learned,
                edited: edited_plan,
            },
        })
    }
}

impl RuleSink for NetlinkSink {
    fn chain(&mut self, table: Table, chain: &str) {
        if self.edits(table, chain) {
            let t = self.table(table);
            if !t.edited.iter().any(|(c, _)| c == chain) {
                t.edited.push((chain.to_owned(), Vec::new()));
            }
            return;
        }
        if !is_service_chain(chain) {
            self.learned.push(((table, chain.to_owned()), Vec::new()));
        }
        let family = self.nf_family();
        let t = self.table(table);
        let owner = t.declared;
        t.declarations
            .xt_chain(family, table.as_str(), chain, owner);
        t.declarations
            .xt_flush(family, table.as_str(), chain, owner);
        t.declared += 1;
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        if self.error.is_some() {
            return;
        }
        let family = self.nf_family();
        let encoded = match encode_rule(self.family, &rule) {
            Ok(encoded) => encoded,
            Err(what) => {
                self.error = Some(Unsupported {
                    what,
                    rule: rule.to_string(),
                });
                return;
            }
        };
        self.rules += 1;
        if self.edits(table, &rule.chain) {
            let key = Key::of(&encoded);
            let t = self.table(table);
            match t.edited.iter_mut().find(|(chain, _)| *chain == rule.chain) {
                Some((_, rules)) => rules.push((encoded, key)),
                None => t
                    .edited
                    .push((rule.chain.to_string(), vec![(encoded, key)])),
            }
            return;
        }
        if let Some((_, keys)) = self
            .learned
            .iter_mut()
            .find(|((t, chain), _)| *t == table && *chain == rule.chain)
        {
            keys.push(Key::of(&encoded));
        }
        let t = self.table(table);
        let owner = t.entered;
        t.entries.xt_rule(
            family,
            table.as_str(),
            &rule.chain,
            &encoded,
            Position::Append,
            false,
            owner,
        );
        t.entered += 1;
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        let family = self.nf_family();
        let t = self.table(table);
        let owner = t.entered;
        t.entries
            .xt_delete_chain(family, table.as_str(), chain, owner);
        t.entered += 1;
    }
}

/// The protocol number iptables stores for `-p`.
fn protocol_number(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::Tcp => PROTO_TCP,
        Protocol::Udp => PROTO_UDP,
        Protocol::Sctp => PROTO_SCTP,
    }
}

/// One `-m` match of the rule, in order.
enum Ext<'r> {
    Comment(&'r Comment<'r>),
    /// `-m tcp|udp|sctp`, with the `--dport` that followed it.
    Protocol(Protocol, Option<u16>),
    Other(&'r Match<'r>),
}

/// Checks an address operand belongs to the rule's family.
fn same_family(family: IpFamily, addr: IpAddr) -> Result<(), String> {
    if IpFamily::of(&addr) == family {
        Ok(())
    } else {
        Err(format!("address {addr} in a {family:?} rule"))
    }
}

/// Encode one rule as iptables-nft 1.8.9 does, or say what is not supported.
pub fn encode_rule(family: IpFamily, rule: &Rule<'_>) -> Result<XtRule, String> {
    let nf_family = super::family(family);
    // The IP part, wherever it was written.
    let mut interface = None;
    let mut protocol = None;
    let mut source = None;
    let mut destination = None;
    let mut exts: Vec<Ext<'_>> = Vec::with_capacity(rule.matches.len() + 1);
    if let Some(comment) = &rule.comment {
        exts.push(Ext::Comment(comment));
    }
    fn once<T>(slot: &mut Option<T>, value: T, what: &str) -> Result<(), String> {
        if slot.replace(value).is_some() {
            return Err(format!("more than one {what}"));
        }
        Ok(())
    }
    for m in &rule.matches {
        match m {
            Match::Protocol(p) => {
                once(&mut protocol, *p, "-p")?;
                exts.push(Ext::Protocol(*p, None));
            }
            Match::DestinationPort(port) => match exts.last_mut() {
                Some(Ext::Protocol(_, dport @ None)) => *dport = Some(*port),
                _ => return Err("--dport not right after its protocol match".to_owned()),
            },
            Match::Source { addr, negated } => once(&mut source, (addr.net(), *negated), "-s")?,
            Match::Destination { addr, negated } => {
                once(&mut destination, (addr.net(), *negated), "-d")?;
            }
            Match::InInterface {
                name,
                wildcard,
                negated,
            } => {
                let name = if *wildcard {
                    format!("{name}+")
                } else {
                    name.to_string()
                };
                once(&mut interface, (name, *negated), "-i")?;
            }
            other => exts.push(Ext::Other(other)),
        }
    }

    let mut out = XtRule::default();
    if let Some((name, negated)) = &interface {
        out.in_interface(name, *negated)
            .ok_or_else(|| format!("interface {name:?}"))?;
    }
    if let Some(p) = protocol {
        out.protocol(protocol_number(p), false);
    }
    for (is_source, slot) in [(true, source), (false, destination)] {
        if let Some((net, negated)) = slot {
            same_family(family, net.addr())?;
            out.address(is_source, net.addr(), net.prefix_len(), negated)
                .ok_or_else(|| format!("address match {net} (negated: {negated})"))?;
        }
    }
    for ext in exts {
        match ext {
            Ext::Comment(comment) => {
                let text = comment.sanitized();
                out.xt_match(xt::comment(&text).ok_or("comment longer than 255 bytes")?);
            }
            Ext::Protocol(p, dport) => match (p, dport) {
                (Protocol::Tcp | Protocol::Udp, Some(port)) => out.destination_port(port),
                (Protocol::Tcp | Protocol::Udp, None) => {
                    out.xt_match(xt::any_port(protocol_number(p)).ok_or("port match")?);
                }
                (Protocol::Sctp, dport) => out.xt_match(xt::sctp(dport)),
            },
            Ext::Other(m) => encode_match(&mut out, m)?,
        }
    }
    match &rule.target {
        None => out.no_target(),
        Some(target) => encode_target(&mut out, nf_family, family, target)?,
    }
    Ok(out)
}

fn encode_match(out: &mut XtRule, m: &Match<'_>) -> Result<(), String> {
    match m {
        Match::AddrType { side, addr_type } => {
            let bits = match addr_type {
                AddrType::Local => ADDRTYPE_LOCAL,
            };
            let (source, dest) = match side {
                AddrTypeSide::Source => (bits, 0),
                AddrTypeSide::Destination => (0, bits),
            };
            out.xt_match(xt::addrtype(source, dest));
        }
        Match::Mark {
            value,
            mask,
            negated,
        } => out.mark(*value, *mask, *negated),
        Match::Conntrack { states, negated } => {
            out.xt_match(xt::conntrack_state(states.bits(), *negated));
        }
        Match::Statistic(probability) => {
            let fixed = xt::probability_fixed(probability.value())
                .ok_or_else(|| format!("probability {probability}"))?;
            out.xt_match(xt::statistic_random(fixed));
        }
        Match::Recent { name, action } => {
            let op = match action {
                RecentAction::Set => RecentOp::Set,
                RecentAction::Rcheck { seconds, reap } => RecentOp::Check {
                    seconds: *seconds,
                    reap: *reap,
                },
            };
            out.xt_match(xt::recent(name, op).ok_or_else(|| format!("recent list {name:?}"))?);
        }
        // The IP part and ports are handled by the caller.
        other => return Err(format!("match `{other}` here")),
    }
    Ok(())
}

fn encode_target(
    out: &mut XtRule,
    nf_family: Family,
    family: IpFamily,
    target: &Target<'_>,
) -> Result<(), String> {
    match target {
        Target::Jump(chain) => out.verdict(Verdict::Jump(chain.to_string())),
        Target::Goto(chain) => out.verdict(Verdict::Goto(chain.to_string())),
        Target::Accept => out.verdict(Verdict::Accept),
        Target::Drop => out.verdict(Verdict::Drop),
        Target::Return => out.verdict(Verdict::Return),
        Target::Reject(with) => {
            // Only the family's port unreachable (the default) was checked.
            let default = match family {
                IpFamily::V4 => RejectWith::IcmpPortUnreachable,
                IpFamily::V6 => RejectWith::Icmp6PortUnreachable,
            };
            if with.is_some_and(|with| with != default) {
                return Err(format!("target `{target}`"));
            }
            out.xt_target(xt::reject(nf_family));
        }
        Target::Masquerade { random_fully } => {
            out.xt_target(xt::masquerade(nf_family, *random_fully));
        }
        Target::Dnat(to) => {
            same_family(family, to.ip())?;
            out.xt_target(xt::dnat(to.ip(), to.port()));
        }
        Target::Mark(op) => {
            let (mark, mask) = op.mark_and_mask();
            out.xt_target(xt::mark_target(mark, mask));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
