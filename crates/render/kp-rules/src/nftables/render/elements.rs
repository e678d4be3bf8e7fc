//! The element changes of one sync: which set and map elements are deleted and added, and
//! what each touched key holds afterwards (its value, holder and claim count).

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::ServicePortName;

use super::super::cmd::{Command, ElementKey, ElementValue};
use super::super::{ElementSet, Installed, NftState};
use super::service::ServiceObjects;

/// The element changes of one sync: every element on a full sync (whose fixed part flushed
/// the sets and maps), the difference on a partial one.
pub(super) struct ElementChanges {
    /// Touched keys: the element as installed afterwards, or `None` once deleted. On a
    /// partial sync a key may only change its holder or count, with no statement.
    changes: BTreeMap<(ElementSet, ElementKey), Option<Installed>>,
    /// Keys whose installed element is deleted first (gone, or its value changes).
    deletes: BTreeSet<(ElementSet, ElementKey)>,
    /// Keys whose element (new, or with a new value) is added.
    adds: BTreeSet<(ElementSet, ElementKey)>,
}

impl ElementChanges {
    /// Every element the services ask for; the first claim of a key (in service order)
    /// holds it.
    pub(super) fn full(services: &[ServiceObjects<'_>]) -> Self {
        let mut changes: BTreeMap<(ElementSet, ElementKey), Option<Installed>> = BTreeMap::new();
        for service in services {
            for (set, key, value) in &service.elements {
                match changes.entry((*set, key.clone())) {
                    Entry::Vacant(e) => {
                        e.insert(Some(Installed {
                            value: value.clone(),
                            owner: service.name.clone(),
                            claims: 1,
                        }));
                    }
                    Entry::Occupied(mut e) => {
                        if let Some(installed) = e.get_mut() {
                            installed.claims += 1;
                        }
                    }
                }
            }
        }
        Self {
            adds: changes.keys().cloned().collect(),
            changes,
            deletes: BTreeSet::new(),
        }
    }

    /// The difference made by rewriting `services` and dropping `gone`, against `existing`.
    /// A key is held by the first of its claimants in service order: an unchanged holder
    /// stays unless a rewritten port before it claims the key; when a rewritten port held it
    /// and unchanged ports still claim it, the stored claims are searched for the next one
    /// (rare: only ports of different services share keys).
    pub(super) fn partial(
        existing: &NftState,
        services: &[ServiceObjects<'_>],
        gone: &[&ServicePortName],
    ) -> Self {
        let rewritten: BTreeSet<&ServicePortName> = services
            .iter()
            .map(|p| p.name)
            .chain(gone.iter().copied())
            .collect();
        // Per touched key: how many claims the rewritten ports release, and their new ones.
        let mut released: BTreeMap<(ElementSet, &str), u32> = BTreeMap::new();
        // The typed key of each touched key text.
        let mut keys: BTreeMap<(ElementSet, &str), &ElementKey> = BTreeMap::new();
        for name in &rewritten {
            for (set, key, _) in existing.claims.get(*name).into_iter().flatten() {
                *released.entry((*set, key.as_str())).or_default() += 1;
                keys.insert((*set, key.as_str()), key);
            }
        }
        let mut claimed: BTreeMap<(ElementSet, &str), Vec<(&ServicePortName, &ElementValue)>> =
            BTreeMap::new();
        for service in services {
            for (set, key, value) in &service.elements {
                claimed
                    .entry((*set, key.as_str()))
                    .or_default()
                    .push((service.name, value));
                keys.insert((*set, key.as_str()), key);
            }
        }
        let touched: BTreeSet<(ElementSet, &str)> =
            released.keys().chain(claimed.keys()).copied().collect();

        let mut changes = Self {
            changes: BTreeMap::new(),
            deletes: BTreeSet::new(),
            adds: BTreeSet::new(),
        };
        for (set, key) in touched {
            let before = existing.elements.get(&set).and_then(|e| e.get(key));
            let new_claims = claimed.get(&(set, key)).map(Vec::as_slice).unwrap_or(&[]);
            let unchanged_claims = before
                .map_or(0, |b| b.claims)
                .saturating_sub(released.get(&(set, key)).copied().unwrap_or(0));
            let unchanged_holder = match before {
                _ if unchanged_claims == 0 => None,
                Some(b) if !rewritten.contains(&b.owner) => Some((&b.owner, &b.value)),
                _ => first_unchanged_claim(existing, &rewritten, set, key),
            };
            let first_new = new_claims.iter().min_by_key(|(name, _)| *name).copied();
            let holder = match (unchanged_holder, first_new) {
                (Some(old), Some(new)) => Some(if new.0 < old.0 { new } else { old }),
                (old, new) => old.or(new),
            };
            let after = holder.map(|(owner, value)| Installed {
                value: value.clone(),
                owner: owner.clone(),
                claims: unchanged_claims + u32::try_from(new_claims.len()).unwrap_or(u32::MAX),
            });
            if let Some(typed) = keys.get(&(set, key)) {
                changes.record((set, (*typed).clone()), before, after);
            }
        }
        changes
    }

    /// One touched key, installed as `before` and to be installed as `after`: its statements
    /// (none when only its holder or count changes) and its state.
    fn record(
        &mut self,
        entry: (ElementSet, ElementKey),
        before: Option<&Installed>,
        after: Option<Installed>,
    ) {
        if after.as_ref() == before {
            return;
        }
        if after.as_ref().map(|a| &a.value) != before.map(|b| &b.value) {
            if before.is_some() {
                self.deletes.insert(entry.clone());
            }
            if after.is_some() {
                self.adds.insert(entry.clone());
            }
        }
        self.changes.insert(entry, after);
    }

    /// The statements: per set, deletions first, then additions.
    pub(super) fn commands(&self) -> Vec<Command> {
        let mut out = Vec::with_capacity(self.deletes.len() + self.adds.len());
        for set in ElementSet::ALL {
            let of_set = |(s, _): &&(ElementSet, ElementKey)| *s == set;
            for (s, key) in self.deletes.iter().filter(of_set) {
                out.push(Command::DeleteElement {
                    set: s.name().into(),
                    key: key.clone(),
                });
            }
            for entry in self.adds.iter().filter(of_set) {
                if let Some(Some(installed)) = self.changes.get(entry) {
                    out.push(Command::AddElement {
                        set: entry.0.name().into(),
                        key: entry.1.clone(),
                        value: installed.value.clone(),
                    });
                }
            }
        }
        out
    }

    /// A full sync's elements as the state keeps them (every set present, maybe empty).
    pub(super) fn into_installed(self) -> BTreeMap<ElementSet, BTreeMap<ElementKey, Installed>> {
        let mut out: BTreeMap<ElementSet, BTreeMap<ElementKey, Installed>> = ElementSet::ALL
            .iter()
            .map(|set| (*set, BTreeMap::new()))
            .collect();
        for ((set, key), installed) in self.changes {
            if let Some(installed) = installed {
                out.entry(set).or_default().insert(key, installed);
            }
        }
        out
    }

    /// A partial sync's element changes for [`Patch`](super::super::Patch).
    pub(super) fn into_changes(self) -> Vec<(ElementSet, ElementKey, Option<Installed>)> {
        self.changes
            .into_iter()
            .map(|((set, key), installed)| (set, key, installed))
            .collect()
    }
}

/// The first claimant of `key` in `set` among the ports not `rewritten`, with its value, from
/// the stored claims.
fn first_unchanged_claim<'s>(
    existing: &'s NftState,
    rewritten: &BTreeSet<&ServicePortName>,
    set: ElementSet,
    key: &str,
) -> Option<(&'s ServicePortName, &'s ElementValue)> {
    existing
        .claims
        .iter()
        .filter(|(name, _)| !rewritten.contains(name))
        .find_map(|(name, claims)| {
            claims
                .iter()
                .find(|(s, k, _)| *s == set && k.as_str() == key)
                .map(|(_, _, value)| (name, value))
        })
}
