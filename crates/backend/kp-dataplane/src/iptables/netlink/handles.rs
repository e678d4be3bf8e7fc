//! Partial syncs by rule handle: the top-level chains (`KUBE-SERVICES`, `KUBE-NODEPORTS`,
//! ... in both tables: every chain that is not a service's own) are edited in place, only
//! the rules that changed deleted by handle and the new ones inserted at their place,
//! instead of being flushed and refilled as `iptables-restore` does. Unchanged rules keep
//! their handles and counters.
//!
//! [`Installed`] remembers, per chain, each rule's [`Key`] (a digest of its encoded
//! expressions) and handle. A full sync writes the chains as the restore does and then
//! learns their handles with one rule dump per chain; a partial sync diffs the new rule
//! list against the remembered one ([`diff`]: the common prefix and suffix stay, the middle
//! is replaced, which is exact for one changed service since a service's rules are
//! contiguous) and learns the inserted rules' handles from the kernel's echo.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use kp_nftnl::xt::XtRule;
use kp_rules::iptables::Table;

/// A rule's identity: two 64-bit digests of its encoded expressions and compat protocol
/// (a collision among a chain's rules is about as likely as 2^-100).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key(u64, u64);

impl Key {
    /// The key of `rule`.
    pub fn of(rule: &XtRule) -> Self {
        let bytes = kp_nftnl::xt::expressions(rule);
        let digest = |salt: u8| {
            let mut hasher = DefaultHasher::new();
            salt.hash(&mut hasher);
            bytes.hash(&mut hasher);
            rule.compat.hash(&mut hasher);
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

/// How to turn a chain's `old` rules into `new` ones: keep `prefix` rules at the start and
/// `suffix` at the end, replace the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Diff {
    /// Rules kept at the start.
    pub prefix: usize,
    /// Rules kept at the end.
    pub suffix: usize,
}

/// The longest common prefix and then suffix of the two key lists (not overlapping).
pub fn diff(old: &[(Key, u64)], new: &[Key]) -> Diff {
    let prefix = old
        .iter()
        .zip(new)
        .take_while(|((a, _), b)| a == *b)
        .count();
    let room = old.len().min(new.len()) - prefix;
    let suffix = old[prefix..]
        .iter()
        .rev()
        .zip(new[prefix..].iter().rev())
        .take(room)
        .take_while(|((a, _), b)| a == *b)
        .count();
    Diff { prefix, suffix }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(ids: &[u64]) -> Vec<Key> {
        ids.iter().map(|id| Key(*id, 0)).collect()
    }

    fn installed(ids: &[u64]) -> Vec<(Key, u64)> {
        ids.iter().map(|id| (Key(*id, 0), 100 + id)).collect()
    }

    #[test]
    fn one_changed_block_is_the_middle() {
        assert_eq!(
            diff(&installed(&[1, 2, 3, 4, 9]), &keys(&[1, 2, 5, 6, 4, 9])),
            Diff {
                prefix: 2,
                suffix: 2
            }
        );
        // Removed at the end, added at the start, nothing in common, identical.
        assert_eq!(
            diff(&installed(&[1, 2, 3]), &keys(&[1, 2])),
            Diff {
                prefix: 2,
                suffix: 0
            }
        );
        assert_eq!(
            diff(&installed(&[1, 2]), &keys(&[0, 1, 2])),
            Diff {
                prefix: 0,
                suffix: 2
            }
        );
        assert_eq!(
            diff(&installed(&[1, 2]), &keys(&[3])),
            Diff {
                prefix: 0,
                suffix: 0
            }
        );
        assert_eq!(
            diff(&installed(&[1, 2]), &keys(&[1, 2])),
            Diff {
                prefix: 2,
                suffix: 0
            }
        );
        // Repeated rules: prefix and suffix never overlap.
        assert_eq!(
            diff(&installed(&[7, 7]), &keys(&[7, 7, 7])),
            Diff {
                prefix: 2,
                suffix: 0
            }
        );
        assert_eq!(
            diff(&installed(&[7, 7, 7]), &keys(&[7])),
            Diff {
                prefix: 1,
                suffix: 0
            }
        );
    }

    #[test]
    fn keys_tell_rules_apart() {
        let mut a = XtRule::default();
        a.verdict(kp_nftnl::expr::Verdict::Accept);
        let mut b = XtRule::default();
        b.verdict(kp_nftnl::expr::Verdict::Drop);
        assert_eq!(Key::of(&a), Key::of(&a.clone()));
        assert_ne!(Key::of(&a), Key::of(&b));
        let mut c = a.clone();
        c.compat = Some((6, false));
        assert_ne!(Key::of(&a), Key::of(&c));
    }
}
