//! Shared copies of the strings the model repeats: [`Name`], and the [`Names`] set that
//! hands out one copy of each.

use std::borrow::Borrow;
use std::collections::HashSet;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;
use std::sync::{Arc, LazyLock};

use serde::Serialize;

/// The one empty [`Name`]: most service ports are unnamed, and an empty name should cost no
/// allocation.
static EMPTY: LazyLock<Arc<Box<str>>> = LazyLock::new(|| Arc::new(Box::from("")));

/// An immutable, shared string: one pointer wide, cloned by a reference count.
///
/// The model repeats a few names very often: every service port, endpoint list and map key
/// of a service carries its namespace and name, every endpoint its node and zone. At 10,000
/// services an owned `String` (24 bytes inline plus a heap block) per copy was ~10^5 heap
/// blocks held at once; a `Name` is 8 bytes and a copy allocates nothing. Compares, orders
/// and hashes as the string it holds, so it can stand in for `String` as a map key (it
/// borrows as `str`).
#[derive(Clone)]
pub struct Name(Arc<Box<str>>);

impl Name {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether two names share one allocation (equal names from one [`Names`] do).
    pub fn ptr_eq(a: &Name, b: &Name) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }

    /// How many copies of this allocation exist (for [`Names::prune`]).
    fn copies(&self) -> usize {
        Arc::strong_count(&self.0)
    }
}

impl Default for Name {
    fn default() -> Self {
        Name(Arc::clone(&EMPTY))
    }
}

impl From<&str> for Name {
    fn from(text: &str) -> Self {
        if text.is_empty() {
            return Name::default();
        }
        Name(Arc::new(Box::from(text)))
    }
}

impl From<String> for Name {
    fn from(text: String) -> Self {
        if text.is_empty() {
            return Name::default();
        }
        Name(Arc::new(text.into_boxed_str()))
    }
}

impl From<&String> for Name {
    fn from(text: &String) -> Self {
        Name::from(text.as_str())
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Name) -> bool {
        Name::ptr_eq(self, other) || self.as_str() == other.as_str()
    }
}

impl Eq for Name {}

impl PartialEq<str> for Name {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Name {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<String> for Name {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Name) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Name) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl Hash for Name {
    /// As `str` hashes, so lookups by `&str` find it ([`Borrow`]).
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_str(), f)
    }
}

impl fmt::Debug for Name {
    /// As a `String` prints, so debug output and snapshots read the same as before.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl Serialize for Name {
    fn serialize<S: serde::Serializer>(&self, out: S) -> Result<S::Ok, S::Error> {
        out.serialize_str(self.as_str())
    }
}

/// Fewest names kept before a [`Names::prune`] looks for unused ones: below this the set is
/// too small to be worth walking.
const MIN_PRUNE: usize = 64;

/// One shared copy of each name the tracker's objects carry: namespaces, service names, port
/// names, node and zone names.
///
/// Every endpoint names its node and zone, but a cluster has few of them: at 10k services ×
/// 10 endpoints an owned `String` per endpoint was 200k allocations of a handful of
/// distinct values, held twice (the tracker's slices and the proxy state). Likewise a
/// namespace is shared by its services, and a service's name by its Service and its
/// EndpointSlices. Sharing makes each a pointer copy.
#[derive(Debug, Default)]
pub struct Names {
    set: HashSet<Name>,
    /// How many names were left after the last prune.
    kept: usize,
}

impl Names {
    /// The shared copy of `name`.
    pub fn get(&mut self, name: &str) -> Name {
        if name.is_empty() {
            return Name::default();
        }
        if let Some(shared) = self.set.get(name) {
            return shared.clone();
        }
        let shared = Name::from(name);
        self.set.insert(shared.clone());
        shared
    }

    /// Forget names no endpoint holds any more (nodes come and go), once the set has doubled
    /// since the last prune, so the walk costs O(1) per name added.
    pub fn prune(&mut self) {
        if self.set.len() < MIN_PRUNE.max(2 * self.kept) {
            return;
        }
        self.set.retain(|name| name.copies() > 1);
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
        assert!(Name::ptr_eq(&a, &b));
        assert!(!Name::ptr_eq(&a, &c));
        assert_eq!(&*a, "node-1");
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn a_name_is_one_pointer_and_compares_as_its_text() {
        assert_eq!(std::mem::size_of::<Name>(), 8);
        assert_eq!(std::mem::size_of::<Option<Name>>(), 8);
        let a = Name::from("web");
        let b = Name::from(String::from("web"));
        assert!(!Name::ptr_eq(&a, &b));
        assert_eq!(a, b);
        assert_eq!(a, "web");
        let (a_name, b_name) = (Name::from("a"), Name::from("b"));
        assert_eq!(a_name.cmp(&b_name), std::cmp::Ordering::Less);
        assert_eq!(Name::default().cmp(&a_name), std::cmp::Ordering::Less);
        assert_eq!(format!("{a} {a:?}"), "web \"web\"");
        let mut set = HashSet::new();
        set.insert(a);
        assert!(set.contains("web"));
    }

    #[test]
    fn empty_names_share_one_allocation() {
        let mut names = Names::default();
        assert!(Name::ptr_eq(&Name::from(""), &Name::default()));
        assert!(Name::ptr_eq(&names.get(""), &Name::from(String::new())));
        assert!(names.is_empty());
    }

    #[test]
    fn prune_forgets_only_unused_names() {
        let mut names = Names::default();
        let held: Vec<Name> = (0..MIN_PRUNE)
            .map(|i| names.get(&format!("kept-{i}")))
            .collect();
        for i in 0..MIN_PRUNE {
            drop(names.get(&format!("gone-{i}")));
        }
        names.prune();
        assert_eq!(names.len(), MIN_PRUNE);
        // Still the same allocations.
        assert!(Name::ptr_eq(&held[0], &names.get("kept-0")));
        // Below twice what was kept, nothing is walked.
        drop(names.get("gone-again"));
        names.prune();
        assert_eq!(names.len(), MIN_PRUNE + 1);
    }
}
