//! Partial syncs by rule handle: the top-level chains (`KUBE-SERVICES`, `KUBE-NODEPORTS`,
//! ... in both tables: every chain that is not a service's own) are edited in place, only
//! the rules that changed deleted by handle and the new ones inserted at their place,
//! instead of being flushed and refilled as `iptables-restore` does. Unchanged rules keep
//! their handles and counters.
//!
//! [`Installed`] remembers, per chain, each rule's [`Key`] (a digest of the typed rule, which
//! decides its encoding) and handle. A full sync writes the chains as the restore does and
//! then learns their handles with one rule dump per chain; a partial sync matches the rendered
//! rules against the remembered ones as they arrive (`encode::EditedChain`), so an unchanged
//! rule is neither encoded nor kept, and learns the inserted rules' handles from the
//! kernel's echo.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use kp_rules::iptables::{Rule, Table};

/// A rule's identity: two 64-bit digests of the typed rule (a collision among a chain's
/// rules is about as likely as 2^-100). Equal rules encode equally (the encoding depends only
/// on the rule and the family, which is fixed per [`Installed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key(u64, u64);

impl Key {
    /// The key of `rule`.
    pub fn of(rule: &Rule<'_>) -> Self {
        let digest = |salt: u8| {
            let mut hasher = DefaultHasher::new();
            salt.hash(&mut hasher);
            rule.hash(&mut hasher);
            hasher.finish()
        };
        Key(digest(0), digest(1))
    }
}

/// What the kernel holds in the top-level chains, per (table, chain): the rules in order.
#[derive(Clone, Debug, Default)]
pub struct Installed {
    /// Each chain's rules: key and handle.
    pub chains: HashMap<(Table, String), Vec<(Key, u64)>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_rules::iptables::Target;

    #[test]
    fn keys_tell_rules_apart() {
        let a = Rule::new("KUBE-SERVICES").target(Target::Accept);
        let b = Rule::new("KUBE-SERVICES").target(Target::Drop);
        let c = Rule::new("KUBE-NODEPORTS").target(Target::Accept);
        assert_eq!(Key::of(&a), Key::of(&a.clone()));
        assert_ne!(Key::of(&a), Key::of(&b));
        assert_ne!(Key::of(&a), Key::of(&c));
    }
}
