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

use super::NetlinkError;
use super::handles::{Installed, Key};
use kp_nftnl::ApplyError;
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

/// One table's messages: the declarations, the in-place edits, then the entries (kept apart
/// so that every chain exists before any rule jumps to it, and handles are numbered as the
/// restore numbers them).
struct TableBatches {
    table: Table,
    declarations: Batch,
    /// Deletions and insertions by handle in the top-level chains ([`handles`]).
    edits: Batch,
    entries: Batch,
    /// Restore lines of each part, for mapping a kernel error to a line.
    declared: usize,
    entered: usize,
}

/// Owners of in-place edits start here (restore lines are far below), so their echoes can be
/// told apart.
const EDIT_OWNER: usize = 1 << 30;

/// A top-level chain edited in place: its rules as they arrive are matched against what the
/// kernel holds (`old`), so that only rules that are new are encoded and only those kept in
/// memory until their place is known. A rule equal to the next old one keeps it; one equal to
/// a later old one keeps that and deletes the old ones in between; any other is inserted
/// right before the next kept rule (or, at the end, right after the last kept one).
struct EditedChain {
    table: Table,
    chain: String,
    old: Vec<(Key, u64)>,
    /// The positions in `old` of each key, ascending; built at the first mismatch.
    positions: Option<HashMap<Key, Vec<usize>>>,
    /// The old rules before this one are decided (kept or deleted).
    cursor: usize,
    /// The chain once applied: kept rules with their handle, inserted ones with their owner.
    result: Vec<Slot>,
    /// New rules waiting for the next kept rule (their place).
    pending: Vec<(XtRule, Key)>,
}

/// One rule of an edited chain after the sync.
enum Slot {
    Kept(Key, u64),
    Inserted(usize, Key),
}

impl EditedChain {
    fn new(table: Table, chain: String, old: Vec<(Key, u64)>) -> Self {
        Self {
            table,
            chain,
            old,
            positions: None,
            cursor: 0,
            result: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// The position of the first old rule with `key` at or after the cursor.
    fn find(&mut self, key: Key) -> Option<usize> {
        if self.old.get(self.cursor).is_some_and(|(k, _)| *k == key) {
            return Some(self.cursor);
        }
        let old = &self.old;
        let positions = self.positions.get_or_insert_with(|| {
            let mut positions: HashMap<Key, Vec<usize>> = HashMap::with_capacity(old.len());
            for (at, (key, _)) in old.iter().enumerate() {
                positions.entry(*key).or_default().push(at);
            }
            positions
        });
        let list = positions.get(&key)?;
        let first = list.partition_point(|at| *at < self.cursor);
        list.get(first).copied()
    }
}

/// A [`RuleSink`] building one netlink transaction for one family; [`NetlinkSink::finish`]
/// gives the batch, or the first [`Unsupported`] rule.
///
/// Without `previous` (full syncs, or when the handles are not known) every declared chain
/// is flushed and refilled, exactly as the restore does, and the top-level chains' rule keys
/// are recorded so their handles can be learned after the commit. With `previous`, the
/// top-level chains it knows are edited in place (`handles`, `EditedChain`): their
/// unchanged rules are neither encoded nor sent.
///
/// With [`NetlinkSink::splitting`] (a large full sync into a kernel without service chains),
/// the service chains' declarations and rules are sent ahead in transactions of their own
/// ([`Step`]) whenever those held pass a bound at the end of a service, so a large first sync
/// never holds the whole batch; the last transaction holds the top-level chains, whose rules
/// make the service chains reachable.
pub struct NetlinkSink<'s> {
    family: IpFamily,
    tables: Vec<TableBatches>,
    error: Option<Unsupported>,
    rules: usize,
    previous: Option<Installed>,
    /// Top-level chains written whole this sync, with their rules' keys in order.
    learned: Vec<((Table, String), Vec<Key>)>,
    /// Top-level chains edited in place this sync.
    edited: Vec<EditedChain>,
    /// The next owner of an edit message.
    edit_owner: usize,
    /// Sends steps of a split sync.
    split: Option<Split<'s>>,
    /// The restore line the next step or the finished batch starts at.
    line: usize,
}

/// Sends one step of a split sync: a whole transaction (BEGIN..END).
pub type Step<'s> = Box<dyn FnMut(Batch) -> Result<(), ApplyError> + 's>;

/// How a sync is split.
struct Split<'s> {
    send: Step<'s>,
    max_messages: usize,
    /// The service chains' declarations and rules not sent yet.
    tables: Vec<TableBatches>,
    /// Why the last step was not applied (nothing more is sent then).
    failed: Option<ApplyError>,
}

/// The messages held in `tables`.
fn held(tables: &[TableBatches]) -> usize {
    tables
        .iter()
        .map(|t| t.declarations.len() + t.edits.len() + t.entries.len())
        .sum()
}

/// The batches of `table` in `tables`, added when missing.
fn table_in(tables: &mut Vec<TableBatches>, table: Table) -> &mut TableBatches {
    let at = match tables.iter().position(|t| t.table == table) {
        Some(at) => at,
        None => {
            tables.push(TableBatches {
                table,
                declarations: Batch::new(0),
                edits: Batch::new(0),
                entries: Batch::new(0),
                declared: 0,
                entered: 0,
            });
            tables.len() - 1
        }
    };
    &mut tables[at]
}

/// The messages held in `tables`, as one transaction starting at sequence number `seq`: per
/// table the table itself, its declarations, the in-place edits (deletions by handle and
/// insertions), its entries. A kernel error names the line of the equivalent restore input
/// (1-based, as `iptables-restore` counts, from `line` on; edits have owners from
/// [`EDIT_OWNER`] on). The tables stay, emptied, for what follows.
fn take_batch(tables: &mut [TableBatches], family: Family, line: &mut usize, seq: u32) -> Batch {
    let mut batch = Batch::new(seq);
    for t in tables {
        // `*table`.
        *line += 1;
        batch.xt_table(family, t.table.as_str(), *line);
        let declarations = std::mem::replace(&mut t.declarations, Batch::new(0));
        batch.append(declarations, *line + 1);
        *line += t.declared;
        batch.append(std::mem::replace(&mut t.edits, Batch::new(0)), 0);
        batch.append(std::mem::replace(&mut t.entries, Batch::new(0)), *line + 1);
        // The entries, then `COMMIT`.
        *line += t.entered + 1;
        t.declared = 0;
        t.entered = 0;
    }
    batch
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
    /// Chains edited: their rules after the sync.
    edited: Vec<((Table, String), Vec<Slot>)>,
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
        for (chain, slots) in self.edited {
            let mut rules = Vec::with_capacity(slots.len());
            for slot in slots {
                rules.push(match slot {
                    Slot::Kept(key, handle) => (key, handle),
                    Slot::Inserted(owner, key) => (key, *echoed.get(&owner)?),
                });
            }
            installed.chains.insert(chain, rules);
        }
        Some(installed)
    }
}

impl<'s> NetlinkSink<'s> {
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
            edited: Vec::new(),
            edit_owner: EDIT_OWNER,
            split: None,
            line: 0,
        }
    }

    /// Split the sync: the service chains (`KUBE-SVC-*`, `KUBE-SEP-*`, ...) go to `send`, one
    /// transaction whenever at least `max_messages` of their messages are held at the end of
    /// a service, and once more before [`NetlinkSink::finish`]'s transaction, which holds the
    /// top-level chains (which the first step creates, unflushed, if they are missing, as its
    /// rules may jump to them). Nothing reaches a service chain before that last transaction
    /// (only top-level rules jump to them), so the rules change for traffic at one commit, and
    /// each step's commit validates little. Only for a full sync into a kernel without
    /// service chains (a step flushes every chain it declares), and the message order differs
    /// from the restore's (rule handles are numbered differently), so callers split only
    /// syncs too large for one transaction to be held cheaply.
    pub fn splitting(mut self, max_messages: usize, send: Step<'s>) -> Self {
        self.split = Some(Split {
            send,
            max_messages: max_messages.max(1),
            tables: Vec::new(),
            failed: None,
        });
        self
    }

    /// Where the declarations and rules of `chain` go: ahead in a step when splitting and
    /// `chain` is a service chain, else into the (last) transaction.
    fn target(&mut self, table: Table, chain: &str) -> &mut TableBatches {
        match &mut self.split {
            Some(split) if is_service_chain(chain) => table_in(&mut split.tables, table),
            _ => table_in(&mut self.tables, table),
        }
    }

    /// Send the service chains held as one step.
    fn send_step(&mut self) {
        let family = self.nf_family();
        let Some(split) = &mut self.split else {
            return;
        };
        if split.failed.is_some() || held(&split.tables) == 0 {
            return;
        }
        let batch = take_batch(&mut split.tables, family, &mut self.line, 1);
        if let Err(error) = (split.send)(batch) {
            split.failed = Some(error);
        }
    }

    fn nf_family(&self) -> Family {
        super::family(self.family)
    }

    fn table(&mut self, table: Table) -> &mut TableBatches {
        table_in(&mut self.tables, table)
    }

    /// The chain edited in place this sync, if `chain` is one.
    fn edited(&self, table: Table, chain: &str) -> Option<usize> {
        self.edited
            .iter()
            .position(|e| e.table == table && e.chain == chain)
    }

    /// Rules encoded so far.
    pub fn rules(&self) -> usize {
        self.rules
    }

    /// Encode `rule`, or record why not (then the sync goes to `iptables-restore`).
    fn encode(&mut self, rule: &Rule<'_>) -> Option<XtRule> {
        if self.error.is_some() {
            return None;
        }
        match encode_rule(self.family, rule) {
            Ok(encoded) => {
                self.rules += 1;
                Some(encoded)
            }
            Err(what) => {
                self.error = Some(Unsupported {
                    what,
                    rule: rule.to_string(),
                });
                None
            }
        }
    }

    /// `rule` for the edited chain `at`: keeps an old rule, or waits to be inserted.
    fn edit_rule(&mut self, at: usize, rule: &Rule<'_>) {
        let key = Key::of(rule);
        let Some(found) = self.edited[at].find(key) else {
            if let Some(encoded) = self.encode(rule) {
                self.edited[at].pending.push((encoded, key));
            }
            return;
        };
        let family = self.nf_family();
        let mut owner = self.edit_owner;
        let e = &mut self.edited[at];
        let table = e.table;
        let t = match self.tables.iter_mut().find(|t| t.table == table) {
            Some(t) => t,
            // `chain` created the table's batches.
            None => return,
        };
        for (_, handle) in &e.old[e.cursor..found] {
            t.edits
                .xt_delete_rule(family, table.as_str(), &e.chain, *handle, owner);
            owner += 1;
        }
        let (kept_key, kept_handle) = e.old[found];
        for (rule, key) in e.pending.drain(..) {
            t.edits.xt_rule(
                family,
                table.as_str(),
                &e.chain,
                &rule,
                Position::Before(kept_handle),
                true,
                owner,
            );
            e.result.push(Slot::Inserted(owner, key));
            owner += 1;
        }
        e.result.push(Slot::Kept(kept_key, kept_handle));
        e.cursor = found + 1;
        self.edit_owner = owner;
    }

    /// Closes the edited chains: deletes the old rules nothing matched and inserts the new
    /// rules that came after the last kept one.
    fn close_edits(&mut self) {
        let family = self.nf_family();
        let mut owner = self.edit_owner;
        for e in &mut self.edited {
            let Some(t) = self.tables.iter_mut().find(|t| t.table == e.table) else {
                continue;
            };
            let table = e.table.as_str();
            for (_, handle) in &e.old[e.cursor..] {
                t.edits
                    .xt_delete_rule(family, table, &e.chain, *handle, owner);
                owner += 1;
            }
            let anchor = e.result.iter().rev().find_map(|slot| match slot {
                Slot::Kept(_, handle) => Some(*handle),
                Slot::Inserted(..) => None,
            });
            let pending = std::mem::take(&mut e.pending);
            let first = e.result.len();
            match anchor {
                // Each right after the anchor: in reverse, so they end up in order.
                Some(anchor) => {
                    for (rule, key) in pending.into_iter().rev() {
                        t.edits.xt_rule(
                            family,
                            table,
                            &e.chain,
                            &rule,
                            Position::After(anchor),
                            true,
                            owner,
                        );
                        e.result.push(Slot::Inserted(owner, key));
                        owner += 1;
                    }
                    e.result[first..].reverse();
                }
                None => {
                    for (rule, key) in pending {
                        t.edits.xt_rule(
                            family,
                            table,
                            &e.chain,
                            &rule,
                            Position::Append,
                            true,
                            owner,
                        );
                        e.result.push(Slot::Inserted(owner, key));
                        owner += 1;
                    }
                }
            }
        }
        self.edit_owner = owner;
    }

    /// The transaction (the last one of a split sync, after the remaining step is sent),
    /// starting at sequence number `seq` (see `take_batch`), or why there is none: the
    /// first rule that cannot be encoded, or the step of a split sync the kernel refused.
    pub fn finish(mut self, seq: u32) -> Result<Prepared, NetlinkError> {
        if let Some(error) = self.error.take() {
            return Err(error.into());
        }
        self.send_step();
        if let Some(failed) = self.split.take().and_then(|split| split.failed) {
            return Err(failed.into());
        }
        self.close_edits();
        let family = self.nf_family();
        let batch = take_batch(&mut self.tables, family, &mut self.line, seq);
        Ok(Prepared {
            batch,
            plan: Plan {
                learned: self.learned,
                edited: self
                    .edited
                    .into_iter()
                    .map(|e| ((e.table, e.chain), e.result))
                    .collect(),
            },
        })
    }
}

impl RuleSink for NetlinkSink<'_> {
    fn chain(&mut self, table: Table, chain: &str) {
        let old = self
            .previous
            .as_mut()
            .and_then(|p| p.chains.remove(&(table, chain.to_owned())));
        if let Some(old) = old {
            self.table(table);
            self.edited
                .push(EditedChain::new(table, chain.to_owned(), old));
            return;
        }
        if self.edited(table, chain).is_some() {
            return;
        }
        let family = self.nf_family();
        if !is_service_chain(chain) {
            self.learned.push(((table, chain.to_owned()), Vec::new()));
            // The steps' rules jump to top-level chains (`KUBE-MARK-MASQ`): the next step
            // creates them if missing, without flushing them (the last transaction does).
            if let Some(split) = &mut self.split {
                let t = table_in(&mut split.tables, table);
                t.declarations
                    .xt_chain(family, table.as_str(), chain, t.declared);
                t.declared += 1;
            }
        }
        let t = self.target(table, chain);
        let owner = t.declared;
        t.declarations
            .xt_chain(family, table.as_str(), chain, owner);
        t.declarations
            .xt_flush(family, table.as_str(), chain, owner);
        t.declared += 1;
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        if self.error.is_some() || self.split.as_ref().is_some_and(|s| s.failed.is_some()) {
            return;
        }
        if let Some(at) = self.edited(table, &rule.chain) {
            self.edit_rule(at, &rule);
            return;
        }
        if !is_service_chain(&rule.chain)
            && let Some((_, keys)) = self
                .learned
                .iter_mut()
                .find(|((t, chain), _)| *t == table && *chain == rule.chain)
        {
            keys.push(Key::of(&rule));
        }
        let Some(encoded) = self.encode(&rule) else {
            return;
        };
        let family = self.nf_family();
        let t = self.target(table, &rule.chain);
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

    fn service_done(&mut self) {
        let full = self
            .split
            .as_ref()
            .is_some_and(|split| held(&split.tables) >= split.max_messages);
        if full && self.error.is_none() {
            self.send_step();
        }
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
