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
//!
//! One concept per module: the values inside matches and targets (`values`), [`Match`]
//! (`matches`), [`Target`] (`target`), [`Comment`] (`comment`), and the sinks a rule goes to
//! (`restore`); [`Rule`] and [`RuleSink`] are here.

use std::borrow::Cow;
use std::fmt;

mod comment;
mod matches;
mod restore;
mod target;
#[cfg(test)]
mod tests;
mod values;

pub use super::setup::Table;
pub use comment::Comment;
pub use matches::Match;
pub(crate) use matches::write_decimal;
pub use restore::{Entry, Restore, RestoreText, TableRestore};
pub(crate) use restore::{RestoreHead, RestoreTail};
pub use target::Target;
pub use values::{
    AddrType, AddrTypeSide, Address, CtStates, MarkOp, Probability, RecentAction, RejectWith,
};

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
