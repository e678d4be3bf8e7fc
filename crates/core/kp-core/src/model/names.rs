//! Shared copies of the strings endpoints repeat.

use std::collections::HashSet;
use std::sync::Arc;

/// Fewest names kept before a [`Names::prune`] looks for unused ones: below this the set is
/// too small to be worth walking.
const MIN_PRUNE: usize = 64;

/// One shared copy of each node and zone name that endpoints carry.
///
/// Every endpoint names its node and zone, but a cluster has few of them: at 10k services ×
/// 10 endpoints an owned `String` per endpoint was 200k allocations of a handful of
/// distinct values, held twice (the tracker's slices and the proxy state). Sharing makes
/// each a pointer copy.
#[derive(Debug, Default)]
pub struct Names {
    set: HashSet<Arc<str>>,
    /// How many names were left after the last prune.
    kept: usize,
}

impl Names {
    /// The shared copy of `name`.
    pub fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(shared) = self.set.get(name) {
            return Arc::clone(shared);
        }
        let shared: Arc<str> = Arc::from(name);
        self.set.insert(Arc::clone(&shared));
        shared
    }

    /// Forget names no endpoint holds any more (nodes come and go), once the set has doubled
    /// since the last prune, so the walk costs O(1) per name added.
    pub fn prune(&mut self) {
        if self.set.len() < MIN_PRUNE.max(2 * self.kept) {
            return;
        }
        self.set.retain(|name| Arc::strong_count(name) > 1);
        self.kept = self.set.len();
    }

    /// How many names are held.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// Whether no name is held.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_names_share_one_allocation() {
        let mut names = Names::default();
        let a = names.get("node-1");
        let b = names.get("node-1");
        let c = names.get("node-2");
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(&*a, "node-1");
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn prune_forgets_only_unused_names() {
        let mut names = Names::default();
        let held: Vec<Arc<str>> = (0..MIN_PRUNE)
            .map(|i| names.get(&format!("kept-{i}")))
            .collect();
        for i in 0..MIN_PRUNE {
            drop(names.get(&format!("gone-{i}")));
        }
        names.prune();
        assert_eq!(names.len(), MIN_PRUNE);
        // Still the same allocations.
        assert!(Arc::ptr_eq(&held[0], &names.get("kept-0")));
        // Below twice what was kept, nothing is walked.
        drop(names.get("gone-again"));
        names.prune();
        assert_eq!(names.len(), MIN_PRUNE + 1);
    }
}
