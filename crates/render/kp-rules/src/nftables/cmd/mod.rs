//! Typed nft commands: what [`render`](super::render) produces.
//!
//! Each [`Command`] is one statement of an `nft -f` script on the family's `kube-proxy` table;
//! [`Command::display`] (and [`Transaction`]'s `Display`) give exactly the text `nft -f -`
//! takes, which is what the snapshots, the `nft` fallback and error messages show. Encoders
//! (kp-nftnl) consume the types, so a new statement is one new variant here, its `Display`
//! arm and its encoder arm: the compiler points at every place that needs it.
//!
//! The types carry only what the renderer writes (the table is always [`TABLE`], names are
//! the renderer's identifiers, comments are already percent-encoded and cut to
//! [`MAX_COMMENT_BYTES`](super::MAX_COMMENT_BYTES)); they are not a general nft model.
//!
//! By concept: `rule` (verdicts, matches, actions, hooks), `element` (set kinds and
//! element keys/data), `statement` (the [`Command`] and its text), `transaction` (one
//! sync's commands in order, and the steps a large full sync is split into).

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use super::TABLE;

mod element;
mod rule;
mod statement;
mod transaction;

pub use element::{ElementKey, ElementValue, KeyParts, SetKind};
use rule::SetItem;
pub use rule::{Action, Addr, AddrField, Hook, MapKey, Match, Rule, Verdict};
pub use statement::{Command, Statement, family_keyword, script};
pub use transaction::{NoSteps, StepSink, Transaction};
pub(crate) use transaction::{ServiceCommands, StepWriter};

/// The name of a chain, set or map: a fixed one, or a per-service one shared (a reference
/// count, not a copy) by the command creating the object and the rules referring to it.
#[derive(Clone, Debug)]
pub enum Name {
    /// One of the table's fixed objects.
    Fixed(&'static str),
    /// A per-service object.
    Shared(Arc<str>),
}

impl Name {
    /// The name.
    pub fn as_str(&self) -> &str {
        match self {
            Name::Fixed(name) => name,
            Name::Shared(name) => name,
        }
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Name {}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::borrow::Borrow<str> for Name {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl From<&'static str> for Name {
    fn from(name: &'static str) -> Self {
        Name::Fixed(name)
    }
}

impl From<&String> for Name {
    fn from(name: &String) -> Self {
        Name::Shared(Arc::from(name.as_str()))
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
