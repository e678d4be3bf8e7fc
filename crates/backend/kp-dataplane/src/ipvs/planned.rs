//! One family's desired state kept between syncs, per service ([`Planned`]), so a partial sync
//! plans only the changed services and learns exactly what that changes ([`Delta`]): no plan
//! of the whole state, no diff of every virtual server, set or address.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kp_core::model::{IpFamily, ServiceName};
use kp_core::tracker::ProxyState;
use kp_ipvs::ServiceKey;
use kp_rules::ipvs::ipset::{SetEntries, SetKind};
use kp_rules::ipvs::{Desired, IpvsConfig, plan_service};

/// What a change of some services changes in the union of every service's plan.
#[derive(Debug, Default)]
pub(super) struct Delta {
    /// Virtual servers (re)planned: to bring to their plan.
    pub touched: BTreeSet<ServiceKey>,
    /// Virtual servers no service wants any more.
    pub removed: BTreeSet<ServiceKey>,
    /// kube-ipvs0 addresses newly wanted.
    pub added_addresses: BTreeSet<IpAddr>,
    /// kube-ipvs0 addresses no longer wanted.
    pub removed_addresses: BTreeSet<IpAddr>,
    /// Set entries newly wanted.
    pub added_entries: SetEntries,
    /// Set entries no longer wanted.
    pub removed_entries: SetEntries,
}

/// The union of every service's plan for one family ([`Planned::desired`], equal to
/// `kp_rules::ipvs::plan`'s but for its sets, which [`Planned::sets`] gives), with what each
/// service contributed and how many services want each virtual server, address and set
/// entry (two services may share an address or a hairpin entry; a virtual server two claim
/// goes to the later one, as in `plan`).
#[derive(Debug)]
pub(super) struct Planned {
    /// Everything but the sets (kept once, as the keys of `entries`).
    pub desired: Desired,
    pieces: BTreeMap<ServiceName, Piece>,
    keys: BTreeMap<ServiceKey, usize>,
    addresses: BTreeMap<IpAddr, usize>,
    entries: BTreeMap<(SetKind, String), usize>,
    no_node_access: BTreeMap<ServiceKey, usize>,
}

/// What one service contributed: enough to take it out again.
#[derive(Debug, Default)]
struct Piece {
    keys: Vec<ServiceKey>,
    addresses: Vec<IpAddr>,
    entries: Vec<(SetKind, String)>,
    no_node_access: Vec<ServiceKey>,
}

impl Planned {
    /// Every service of `state`, each planned on its own.
    pub fn build(state: &ProxyState, family: IpFamily, config: &IpvsConfig) -> Self {
        let mut planned = Self {
            desired: Desired {
                family,
                services: BTreeMap::new(),
                addresses: BTreeSet::new(),
                sets: SetEntries::new(),
                lb_no_node_access: BTreeSet::new(),
            },
            pieces: BTreeMap::new(),
            keys: BTreeMap::new(),
            addresses: BTreeMap::new(),
            entries: BTreeMap::new(),
            no_node_access: BTreeMap::new(),
        };
        let names: BTreeSet<&ServiceName> = state.services.keys().map(|n| &n.service).collect();
        for name in names {
            let piece = plan_service(state, family, config, name);
            planned.add(name, piece, None);
        }
        planned
    }

    /// Every set's wanted entries (what `plan` puts in `sets`).
    pub fn sets(&self) -> SetEntries {
        let mut sets = kp_rules::ipvs::ipset::empty_sets();
        for (kind, entry) in self.entries.keys() {
            sets.entry(*kind).or_default().insert(entry.clone());
        }
        sets
    }

    /// How many entries each set holds once this plan is installed (every kind, zero
    /// included): what the canary check compares `ipset list -t` with.
    pub fn set_sizes(&self) -> BTreeMap<SetKind, usize> {
        let mut sizes: BTreeMap<SetKind, usize> =
            SetKind::ALL.iter().map(|kind| (*kind, 0)).collect();
        for (kind, _) in self.entries.keys() {
            *sizes.entry(*kind).or_default() += 1;
        }
        sizes
    }

    /// Plans `changed` again from `state`; returns what that changes.
    pub fn update(
        &mut self,
        state: &ProxyState,
        config: &IpvsConfig,
        changed: &BTreeSet<ServiceName>,
    ) -> Delta {
        let mut delta = Delta::default();
        for name in changed {
            if let Some(old) = self.pieces.remove(name) {
                self.remove(name, &old, state, config, &mut delta);
            }
        }
        for name in changed {
            let piece = plan_service(state, self.desired.family, config, name);
            self.add(name, piece, Some(&mut delta));
        }
        delta
    }

    /// Adds one service's plan; `delta` (none when building) learns what that changes.
    fn add(&mut self, name: &ServiceName, piece: Desired, mut delta: Option<&mut Delta>) {
        let d = &mut self.desired;
        let mut kept = Piece::default();
        for (key, service) in piece.services {
            *self.keys.entry(key).or_default() += 1;
            d.services.insert(key, service);
            if let Some(delta) = delta.as_deref_mut() {
                delta.removed.remove(&key);
                delta.touched.insert(key);
            }
            kept.keys.push(key);
        }
        for ip in piece.addresses {
            if increment(&mut self.addresses, ip) {
                d.addresses.insert(ip);
                if let Some(delta) = delta.as_deref_mut()
                    && !delta.removed_addresses.remove(&ip)
                {
                    delta.added_addresses.insert(ip);
                }
            }
            kept.addresses.push(ip);
        }
        for (kind, entries) in piece.sets {
            for entry in entries {
                if increment(&mut self.entries, (kind, entry.clone()))
                    && let Some(delta) = delta.as_deref_mut()
                {
                    let was_removed = delta
                        .removed_entries
                        .get_mut(&kind)
                        .is_some_and(|gone| gone.remove(&entry));
                    if !was_removed {
                        delta
                            .added_entries
                            .entry(kind)
                            .or_default()
                            .insert(entry.clone());
                    }
                }
                kept.entries.push((kind, entry));
            }
        }
        for key in piece.lb_no_node_access {
            if increment(&mut self.no_node_access, key) {
                d.lb_no_node_access.insert(key);
            }
            kept.no_node_access.push(key);
        }
        if !kept.keys.is_empty() || !kept.addresses.is_empty() {
            self.pieces.insert(name.clone(), kept);
        }
    }

    fn remove(
        &mut self,
        name: &ServiceName,
        piece: &Piece,
        state: &ProxyState,
        config: &IpvsConfig,
        delta: &mut Delta,
    ) {
        for key in &piece.keys {
            if decrement(&mut self.keys, *key) {
                self.desired.services.remove(key);
                delta.touched.remove(key);
                delta.removed.insert(*key);
            } else if self
                .desired
                .services
                .get(key)
                .is_some_and(|s| &s.owner == name)
            {
                // Another service claims it too: its plan is the one to program now.
                let other = self
                    .pieces
                    .iter()
                    .find(|(_, p)| p.keys.contains(key))
                    .map(|(other, _)| other.clone());
                let service = other.and_then(|other| {
                    plan_service(state, self.desired.family, config, &other)
                        .services
                        .remove(key)
                });
                if let Some(service) = service {
                    self.desired.services.insert(*key, service);
                    delta.touched.insert(*key);
                }
            }
        }
        for ip in &piece.addresses {
            if decrement(&mut self.addresses, *ip) {
                self.desired.addresses.remove(ip);
                delta.removed_addresses.insert(*ip);
            }
        }
        for (kind, entry) in &piece.entries {
            if decrement(&mut self.entries, (*kind, entry.clone())) {
                delta
                    .removed_entries
                    .entry(*kind)
                    .or_default()
                    .insert(entry.clone());
            }
        }
        for key in &piece.no_node_access {
            if decrement(&mut self.no_node_access, *key) {
                self.desired.lb_no_node_access.remove(key);
            }
        }
    }
}

/// Counts one more user of `item`; true when it is the first.
fn increment<T: Ord>(counts: &mut BTreeMap<T, usize>, item: T) -> bool {
    let count = counts.entry(item).or_default();
    *count += 1;
    *count == 1
}

/// Counts one user of `item` less; true when it was the last.
fn decrement<T: Ord>(counts: &mut BTreeMap<T, usize>, item: T) -> bool {
    match counts.get_mut(&item) {
        Some(count) if *count > 1 => {
            *count -= 1;
            false
        }
        Some(_) => {
            counts.remove(&item);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use kp_core::model::Protocol;

    use super::*;
    use crate::testutil::{endpoint, ip, service, service_name, state};

    fn config() -> IpvsConfig {
        IpvsConfig {
            node_ips: vec![ip("192.168.0.2")],
            masquerade_bit: 14,
            ..IpvsConfig::default()
        }
    }

    #[test]
    fn the_union_of_the_pieces_is_the_whole_plan_and_updates_keep_it_so() {
        let mut web = service("ns", "web", Protocol::Tcp, "10.96.0.1", 80);
        web.node_port = Some(30080);
        web.external_ips = vec![ip("203.0.113.7")];
        // `api` shares web's external IP (another port).
        let mut api = service("ns", "api", Protocol::Tcp, "10.96.0.2", 443);
        api.external_ips = vec![ip("203.0.113.7")];
        let before = state(vec![
            (web.clone(), vec![endpoint("10.244.1.1", 8080)]),
            (api, vec![endpoint("10.244.1.2", 8443)]),
        ]);
        let mut planned = Planned::build(&before, IpFamily::V4, &config());
        let whole = |planned: &Planned| Desired {
            sets: planned.sets(),
            ..planned.desired.clone()
        };
        assert_eq!(
            whole(&planned),
            kp_rules::ipvs::plan(&before, IpFamily::V4, &config())
        );
        // api goes: its ClusterIP goes, the shared external IP stays for web.
        let after = state(vec![(web, vec![endpoint("10.244.1.3", 8080)])]);
        let changed = [service_name("ns", "api"), service_name("ns", "web")].into();
        let delta = planned.update(&after, &config(), &changed);
        assert_eq!(
            whole(&planned),
            kp_rules::ipvs::plan(&after, IpFamily::V4, &config())
        );
        assert_eq!(delta.removed_addresses, [ip("10.96.0.2")].into());
        assert!(delta.added_addresses.is_empty());
        assert_eq!(delta.removed.len(), 2, "{:?}", delta.removed);
        assert_eq!(delta.touched.len(), 3, "web's three virtual servers");
        assert_eq!(
            delta.removed_entries.get(&SetKind::ClusterIp),
            Some(&["10.96.0.2,tcp:443".to_owned()].into())
        );
        assert!(
            delta.added_entries.values().all(BTreeSet::is_empty),
            "web's entries were removed and added back: no change"
        );
    }
}
