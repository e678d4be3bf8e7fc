//! What the layout's sets hold, and the element transaction of a sync.
//!
//! Several service ports may claim the same kernel element (two services sharing an
//! endpoint address share its `hairpin` element, ports of one service share its
//! `cluster-ips` element), so the state counts claims per element key and a sync deletes
//! an element only when its last claim goes. [`LayoutState::changes`] is pure and reads
//! only the ports it is given: a partial sync costs what its services hold, not what the
//! table holds.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasher;

use kp_core::model::{Protocol, ServiceName, ServicePortName};

use super::element::{AffinityPort, Element, Entry, EntrySet, SetOf, Slots};

/// A slot count or affinity service port in use: each has its sets and fixed rules, written the
/// first time an element needs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// `slots-N` (or `short-circuit-slots-N`) and the rules picking among `N` slots.
    Count(Slots, u32),
    /// An affinity port's sets, maps and rules.
    Affinity(AffinityPort),
    /// The per-timeout affinity sets and maps of an earlier version of this layout
    /// (`affinity-services-T`, `affinity-T-PROTO`): found in a table read back, never
    /// desired, so the full sync deletes them.
    LegacyAffinity(u32),
}

impl Class {
    /// The class an element needs, if any.
    fn of(element: &Element) -> Option<Self> {
        match element {
            Element::Entry(EntrySet::Count(slots, n), _) => Some(Class::Count(*slots, *n)),
            Element::AffinityEntry(port, ..) | Element::AffinityEndpoint(port, ..) => {
                Some(Class::Affinity(*port))
            }
            _ => None,
        }
    }

    /// The classes a sync keeps ready beside this one while it is in use: for a slot count
    /// `n`, the counts `n - 1`, `n` and `n + 1` of both lists, so that one endpoint more or
    /// less, or a switch of traffic policy, finds its set and rules written and stays an
    /// element transaction (a class adds its sets, maps and rules to the transaction, which
    /// the kernel then validates; an affinity class makes it an `nft -f` run).
    /// An affinity class has none.
    pub fn ready_beside(self) -> Vec<Class> {
        let Class::Count(_, n) = self else {
            return vec![self];
        };
        let counts = [n.saturating_sub(1), n, n.saturating_add(1)];
        [Slots::Policy, Slots::ShortCircuit]
            .into_iter()
            .flat_map(|slots| counts.map(|m| Class::Count(slots, m)))
            .filter(|class| !matches!(class, Class::Count(_, 0)))
            .collect()
    }

    /// The class whose set `set` is (`slots-3`, `affinity-tcp-10800-HASH-entries`, ...).
    pub fn of_set(set: SetOf) -> Option<Self> {
        match set {
            SetOf::Entries(EntrySet::Count(slots, n), _) | SetOf::Slots(slots, n, ..) => {
                Some(Class::Count(slots, n))
            }
            SetOf::AffinityEntries(port, ..) | SetOf::AffinityEndpoints(port, _) => {
                Some(Class::Affinity(port))
            }
            _ => None,
        }
    }

    /// The class of the set or map named `name` in a table read back, the legacy affinity
    /// sets included.
    pub fn of_set_name(name: &str) -> Option<Self> {
        if let Some(seconds) = name
            .strip_prefix("nodeport-")
            .unwrap_or(name)
            .strip_prefix("affinity-services-")
        {
            return seconds.parse().ok().map(Class::LegacyAffinity);
        }
        SetOf::parse(name).and_then(Class::of_set)
    }
}

/// Every class of `used` and those kept ready beside them ([`Class::ready_beside`]).
pub fn ready_classes<'a>(used: impl IntoIterator<Item = &'a Class>) -> BTreeSet<Class> {
    used.into_iter().flat_map(|c| c.ready_beside()).collect()
}

/// Each kernel element as installed, and how many service ports claim its key
/// ([`Element::key`]). The elements sit once in a dense list; the hash table holds only
/// their 4-byte positions, found by the key's hash, so its power-of-two buckets (524,288
/// for 290k elements at 10k services × 10 endpoints) cost 5 bytes each, not an element's.
#[derive(Clone, Debug, Default)]
struct Claims {
    /// Each element with the data installed, and its claim count.
    list: Vec<(Element, u32)>,
    /// Positions in `list`, hashed by their element's key.
    index: hashbrown::HashTable<u32>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl Claims {
    fn hash(hasher: &hashbrown::DefaultHashBuilder, element: &Element) -> u64 {
        hasher.hash_one(element.key())
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    fn reserve(&mut self, additional: usize) {
        let Self {
            list,
            index,
            hasher,
        } = self;
        list.reserve_exact(additional);
        index.reserve(additional, |&at| Self::hash(hasher, &list[at as usize].0));
    }

    /// Drops spare room once a build is done (the list is kept for the state's life).
    fn shrink_to_fit(&mut self) {
        let Self {
            list,
            index,
            hasher,
        } = self;
        list.shrink_to_fit();
        index.shrink_to_fit(|&at| Self::hash(hasher, &list[at as usize].0));
    }

    /// Where the element with `element`'s key sits, and its key's hash.
    fn position(&self, element: &Element) -> (u64, Option<usize>) {
        let hash = Self::hash(&self.hasher, element);
        let key = element.key();
        let at = self
            .index
            .find(hash, |&at| self.list[at as usize].0.key() == key)
            .map(|&at| at as usize);
        (hash, at)
    }

    /// The installed element with `element`'s key and its claim count.
    fn get(&self, element: &Element) -> Option<(&Element, u32)> {
        let (_, at) = self.position(element);
        at.map(|at| {
            let (installed, claims) = &self.list[at];
            (installed, *claims)
        })
    }

    fn iter(&self) -> impl Iterator<Item = (&Element, u32)> + '_ {
        self.list.iter().map(|(element, claims)| (element, *claims))
    }

    /// One more claim of `element`'s key; the first claim's data is installed.
    fn claim(&mut self, element: &Element) {
        match self.position(element) {
            (_, Some(at)) => self.list[at].1 += 1,
            (hash, None) => {
                let Self {
                    list,
                    index,
                    hasher,
                } = self;
                // Positions fit: the kernel's sets hold far fewer than 2^32 elements.
                let at = u32::try_from(list.len()).unwrap_or(u32::MAX);
                list.push((element.clone(), 1));
                index.insert_unique(hash, at, |&at| Self::hash(hasher, &list[at as usize].0));
            }
        }
    }

    /// One claim of `element`'s key less; its last claim removes it.
    fn release(&mut self, element: &Element) {
        let (hash, Some(at)) = self.position(element) else {
            return;
        };
        let claims = &mut self.list[at].1;
        *claims = claims.saturating_sub(1);
        if *claims > 0 {
            return;
        }
        let wanted = at as u32;
        if let Ok(entry) = self.index.find_entry(hash, |&i| i == wanted) {
            entry.remove();
        }
        self.list.swap_remove(at);
        // The last element moved into the hole: its position changes.
        if let Some((moved, _)) = self.list.get(at) {
            let from = self.list.len() as u32;
            let hash = Self::hash(&self.hasher, moved);
            if let Some(i) = self.index.find_mut(hash, |&i| i == from) {
                *i = wanted;
            }
        }
    }

    /// `element`'s data is what the kernel now holds for its key (if the key is claimed).
    fn install(&mut self, element: Element) {
        if let (_, Some(at)) = self.position(&element) {
            self.list[at].0 = element;
        }
    }
}

/// What the layout's sets and maps hold after the syncs applied so far.
#[derive(Clone, Debug, Default)]
pub struct LayoutState {
    ports: BTreeMap<ServicePortName, Vec<Element>>,
    /// Each kernel element as installed, and how many service ports claim its key.
    elements: Claims,
    classes: BTreeSet<Class>,
}

impl PartialEq for LayoutState {
    fn eq(&self, other: &Self) -> bool {
        self.ports == other.ports
            && self.classes == other.classes
            && self.elements.len() == other.elements.len()
            && self.elements.iter().all(|(installed, claims)| {
                other
                    .elements
                    .get(installed)
                    .is_some_and(|(theirs, c)| theirs == installed && c == claims)
            })
    }
}

impl Eq for LayoutState {}

/// One sync's element transaction: deletions, then classes to create, then additions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Elements to delete (their last claim went, or their data changes).
    pub delete: Vec<Element>,
    /// Classes whose sets and rules must be created before `add`.
    pub classes: BTreeSet<Class>,
    /// Elements to add.
    pub add: Vec<Element>,
    ports: Vec<(ServicePortName, Vec<Element>)>,
}

impl Changes {
    /// The classes of the elements it adds (whether or not their sets exist already).
    pub fn used_classes(&self) -> BTreeSet<Class> {
        self.add.iter().filter_map(Class::of).collect()
    }

    /// Whether the kernel has nothing to do (the state may still change: a port with no
    /// element of its own).
    pub fn is_empty(&self) -> bool {
        self.delete.is_empty() && self.classes.is_empty() && self.add.is_empty()
    }
}

impl LayoutState {
    /// The elements of `port` as installed.
    pub fn port(&self, port: &ServicePortName) -> &[Element] {
        self.ports.get(port).map_or(&[], Vec::as_slice)
    }

    /// Every installed port.
    pub fn port_names(&self) -> impl Iterator<Item = &ServicePortName> + '_ {
        self.ports.keys()
    }

    /// The installed ports of `service`.
    pub fn ports_of<'a>(
        &'a self,
        service: &'a ServiceName,
    ) -> impl Iterator<Item = &'a ServicePortName> + 'a {
        let first = ServicePortName {
            service: service.clone(),
            port: Default::default(),
            protocol: Protocol::Tcp,
        };
        self.ports
            .range(first..)
            .take_while(move |(name, _)| name.service == *service)
            .map(|(name, _)| name)
    }

    /// The installed elements that decide a packet to `entry`, as `explain` names them: its
    /// class, slot, masquerade, filter, firewall and affinity elements, and the hairpin
    /// elements of the endpoints its slots hold.
    pub fn deciding(&self, entry: &Entry) -> Vec<&Element> {
        let mut found: Vec<&Element> = Vec::new();
        let mut endpoints = BTreeSet::new();
        for element in self.ports.values().flatten() {
            let hit = match element {
                Element::Entry(_, e) | Element::Allow(e, _) | Element::AffinityEntry(_, _, e) => {
                    e == entry
                }
                Element::Slot { entry: e, addr, .. } => {
                    if e == entry {
                        endpoints.insert(*addr);
                    }
                    e == entry
                }
                Element::Hairpin(_) | Element::ClusterIp(_) | Element::AffinityEndpoint(..) => {
                    false
                }
            };
            if hit {
                found.push(element);
            }
        }
        found.extend(
            endpoints
                .into_iter()
                .filter_map(|addr| self.installed(&Element::Hairpin(addr))),
        );
        found.sort();
        found.dedup();
        found
    }

    /// The state after a full sync of `updates` (each port with its elements) on an empty
    /// table: what a full sync makes the kernel hold.
    pub fn from_ports(updates: Vec<(ServicePortName, Vec<Element>)>) -> Self {
        // Built directly: the difference with an empty state would hash, sort and copy
        // every element twice more (2 s at 10k services × 10 endpoints).
        let mut state = Self::default();
        // Sized once: growing the map would hold its old and new tables at once.
        state
            .elements
            .reserve(updates.iter().map(|(_, elements)| elements.len()).sum());
        let mut ports = Vec::with_capacity(updates.len());
        for (name, mut elements) in updates {
            elements.sort();
            elements.dedup();
            if elements.is_empty() {
                continue;
            }
            // Kept for the state's life: no spare capacity.
            elements.shrink_to_fit();
            for element in &elements {
                state.claim(element);
            }
            state.classes.extend(elements.iter().filter_map(Class::of));
            ports.push((name, elements));
        }
        // Built in one go (the last of equal names wins, as inserting would): full B-tree
        // nodes, where inserting in order leaves each about half full.
        state.ports = ports.into_iter().collect();
        state.elements.shrink_to_fit();
        state
    }

    /// Every kernel element, with the data installed.
    pub fn elements(&self) -> impl Iterator<Item = &Element> + '_ {
        self.elements.iter().map(|(installed, _)| installed)
    }

    /// The installed element with `element`'s key (its data may differ).
    fn installed(&self, element: &Element) -> Option<&Element> {
        self.elements.get(element).map(|(installed, _)| installed)
    }

    /// Like [`LayoutState::repair`], from `kernel` as last written (no copy of it).
    pub fn repair_from(&self, kernel: &LayoutState) -> Changes {
        let differs = |from: &LayoutState, element: &Element| {
            from.installed(element).is_none_or(|there| there != element)
        };
        self.repairing(
            kernel
                .elements()
                .filter(|e| differs(self, e))
                .cloned()
                .collect(),
            self.elements()
                .filter(|e| differs(kernel, e))
                .cloned()
                .collect(),
        )
    }

    /// A repair's transaction: `delete` and `add` in order, with every class of `self`.
    fn repairing(&self, mut delete: Vec<Element>, mut add: Vec<Element>) -> Changes {
        delete.sort();
        add.sort();
        Changes {
            delete,
            classes: self.classes.clone(),
            add,
            ports: Vec::new(),
        }
    }

    /// The element transaction that turns `kernel` (what the table holds, read back or as
    /// last written) into this state: elements not here (or with other data) deleted,
    /// elements missing added. Its `classes` are every class of this state (the caller
    /// writes the fixed part with them); applying it changes no state (`self` is the
    /// result).
    pub fn repair(&self, kernel: impl IntoIterator<Item = Element>) -> Changes {
        let kernel: std::collections::HashSet<Element> = kernel.into_iter().collect();
        let delete = kernel
            .iter()
            .filter(|element| {
                self.installed(element)
                    .is_none_or(|there| there != *element)
            })
            .cloned()
            .collect();
        let add = self
            .elements()
            .filter(|element| !kernel.contains(*element))
            .cloned()
            .collect();
        self.repairing(delete, add)
    }

    /// The endpoints (`addr`, `port`) some slot of `self` holds.
    pub fn endpoints(&self) -> BTreeSet<(std::net::IpAddr, u16)> {
        self.elements()
            .filter_map(|element| match element {
                Element::Slot { addr, port, .. } => Some((*addr, *port)),
                _ => None,
            })
            .collect()
    }

    /// The classes whose sets and rules exist.
    pub fn classes(&self) -> &BTreeSet<Class> {
        &self.classes
    }

    /// Records that the sets and rules of `classes` exist (written ahead of their use).
    pub fn add_classes(&mut self, classes: impl IntoIterator<Item = Class>) {
        self.classes.extend(classes);
    }

    /// How many distinct kernel elements there are.
    pub fn element_count(&self) -> usize {
        self.elements.len()
    }

    /// The transaction that makes each of `updates` (a port and its new elements; empty
    /// when the port is gone) what the kernel holds.
    pub fn changes(&self, updates: Vec<(ServicePortName, Vec<Element>)>) -> Changes {
        let mut delta: HashMap<Element, i64> = HashMap::new();
        let mut removed: HashMap<Element, Vec<Element>> = HashMap::new();
        let mut added: HashMap<Element, Element> = HashMap::new();
        for (name, new) in &updates {
            let old: BTreeSet<&Element> = self.port(name).iter().collect();
            let new: BTreeSet<&Element> = new.iter().collect();
            for element in old.difference(&new) {
                let key = element.key();
                *delta.entry(key.clone()).or_default() -= 1;
                removed.entry(key).or_default().push((*element).clone());
            }
            for element in new.difference(&old) {
                let key = element.key();
                *delta.entry(key.clone()).or_default() += 1;
                added.entry(key).or_insert_with(|| (*element).clone());
            }
        }
        let mut changes = Changes::default();
        let mut keys: Vec<_> = delta.into_iter().collect();
        keys.sort();
        for (key, change) in keys {
            let current = self.elements.get(&key);
            let before = i64::from(current.map_or(0, |(_, claims)| claims));
            let after = before + change;
            match (
                current.map(|(installed, _)| installed),
                after > 0,
                added.remove(&key),
            ) {
                (Some(installed), false, _) => changes.delete.push(installed.clone()),
                (None, true, Some(element)) => changes.add.push(element),
                (Some(installed), true, Some(element)) => {
                    // Its owner changed the data (a slot now holds another endpoint).
                    let gone = removed.get(&key).is_some_and(|r| r.contains(installed));
                    if gone && *installed != element {
                        changes.delete.push(installed.clone());
                        changes.add.push(element);
                    }
                }
                _ => {}
            }
        }
        changes.classes = changes
            .add
            .iter()
            .filter_map(Class::of)
            .filter(|class| !self.classes.contains(class))
            .collect();
        changes.ports = updates;
        changes
    }

    /// Record that `changes` were applied.
    pub fn apply(&mut self, changes: Changes) {
        for (name, new) in changes.ports {
            let old = if new.is_empty() {
                self.ports.remove(&name).unwrap_or_default()
            } else {
                self.ports.insert(name, new.clone()).unwrap_or_default()
            };
            let (old, new): (BTreeSet<Element>, BTreeSet<Element>) =
                (old.into_iter().collect(), new.into_iter().collect());
            for element in old.difference(&new) {
                self.release(element);
            }
            for element in new.difference(&old) {
                self.claim(element);
            }
        }
        for element in changes.add {
            // The data the kernel now holds for the key.
            self.elements.install(element);
        }
        self.classes.extend(changes.classes);
    }

    fn release(&mut self, element: &Element) {
        self.elements.release(element);
    }

    fn claim(&mut self, element: &Element) {
        self.elements.claim(element);
    }
}
