//! [`ServiceLb`]: the [`Balancer`] driven by the proxy's syncs, Service by Service.
//!
//! A full sync computes what every Service asks for and writes the difference; a partial
//! sync recomputes only the changed Services and touches only the addresses they had or now
//! have, so a one-Service change costs that Service's plan and its few map writes, whatever
//! the number of Services. Where two Services claim one address (a shared externalIP), the
//! greater name wins, as in [`crate::desired()`]; when it lets go, the next claimant gets it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use kp_core::model::ServiceName;
use kp_core::tracker::ProxyState;

use crate::balancer::{Balancer, SetError, SyncReport};
use crate::desired::{Target, Targets, desired_service};
use crate::layout::ServiceKey;
use crate::maps::MapWriter;

/// What one Service asks the maps for.
type Wants = Targets;

/// The socket load balancer's maps, kept to the proxy state by full and partial syncs.
#[derive(Debug)]
pub struct ServiceLb<M> {
    balancer: Balancer<M>,
    /// Each Service's addresses and endpoints, as last computed.
    wants: BTreeMap<ServiceName, Wants>,
    /// Which Services ask for each address (one, but for shared externalIPs).
    claims: BTreeMap<ServiceKey, BTreeSet<ServiceName>>,
    /// A write failed: the next sync is full, whatever it is asked.
    needs_full: bool,
    /// UDP Service ports are left to nftables mode (its DNAT and conntrack flush), where
    /// sockets of removed endpoints cannot be destroyed.
    skip_udp: bool,
}

impl<M: MapWriter> ServiceLb<M> {
    /// An empty balancer writing to `maps` (which must be empty too).
    pub fn new(maps: M) -> Self {
        Self {
            balancer: Balancer::new(maps),
            wants: BTreeMap::new(),
            claims: BTreeMap::new(),
            needs_full: false,
            skip_udp: false,
        }
    }

    /// Leaves UDP Service ports to nftables mode from the next sync on (call before the
    /// first): where sockets of removed endpoints cannot be destroyed, a connected UDP
    /// socket would keep sending to a gone endpoint, which nftables mode's conntrack flush
    /// avoids.
    pub fn leave_udp_to_nftables(&mut self) {
        self.skip_udp = true;
    }

    /// Makes the maps hold what `state` asks for: every Service when `full` (or after a
    /// failed write), else only those in `changed`. Failed ports are reported and taken out
    /// of the maps where possible (nftables mode's rules then serve them); the next sync is
    /// full.
    pub fn sync(
        &mut self,
        state: &ProxyState,
        full: bool,
        changed: &BTreeSet<ServiceName>,
    ) -> SyncReport {
        let report = if full || self.needs_full {
            self.sync_all(state)
        } else {
            self.sync_changed(state, changed)
        };
        for (key, _) in &report.failed {
            // Best effort: a port half written may still send to what it had.
            let _ = self.balancer.remove(*key);
        }
        self.needs_full = !report.failed.is_empty();
        report
    }

    fn sync_all(&mut self, state: &ProxyState) -> SyncReport {
        self.wants.clear();
        self.claims.clear();
        let services: BTreeSet<&ServiceName> = state.services.keys().map(|n| &n.service).collect();
        for service in services {
            self.claim(service.clone(), desired_service(state, service));
        }
        let desired: Wants = self
            .claims
            .iter()
            .filter_map(|(&key, names)| Some((key, self.winner_endpoints(key, names)?.clone())))
            .collect();
        self.balancer.sync(&desired)
    }

    fn sync_changed(&mut self, state: &ProxyState, changed: &BTreeSet<ServiceName>) -> SyncReport {
        let mut touched = BTreeSet::new();
        for service in changed {
            let old = self.release(service);
            touched.extend(old.into_keys());
            let new = desired_service(state, service);
            touched.extend(new.keys().copied());
            self.claim(service.clone(), new);
        }
        let mut report = SyncReport::default();
        for key in touched {
            let wanted = self
                .claims
                .get(&key)
                .and_then(|names| self.winner_endpoints(key, names))
                .cloned();
            let result = match wanted {
                Some(target) => {
                    self.balancer
                        .set_target(key, &target.endpoints, target.affinity_ms)
                }
                None => self
                    .balancer
                    .remove(key)
                    .map(|()| 0)
                    .map_err(SetError::from),
            };
            match result {
                Ok(writes) => report.writes += writes,
                Err(error) => report.failed.push((key, error)),
            }
        }
        report
    }

    /// Records what `service` asks for.
    fn claim(&mut self, service: ServiceName, mut wants: Wants) {
        if self.skip_udp {
            wants.retain(|key, _| key.protocol != kp_core::model::Protocol::Udp);
        }
        if wants.is_empty() {
            return;
        }
        for &key in wants.keys() {
            self.claims.entry(key).or_default().insert(service.clone());
        }
        self.wants.insert(service, wants);
    }

    /// Forgets what `service` asked for, returning it.
    fn release(&mut self, service: &ServiceName) -> Wants {
        let old = self.wants.remove(service).unwrap_or_default();
        for key in old.keys() {
            if let Some(names) = self.claims.get_mut(key) {
                names.remove(service);
                if names.is_empty() {
                    self.claims.remove(key);
                }
            }
        }
        old
    }

    /// What `key` holds as its winning claimant (the greatest name) asks.
    fn winner_endpoints(&self, key: ServiceKey, names: &BTreeSet<ServiceName>) -> Option<&Target> {
        self.wants.get(names.last()?)?.get(&key)
    }

    /// The Service ports the maps hold.
    pub fn balancer(&self) -> &Balancer<M> {
        &self.balancer
    }

    /// The maps, to change in a test.
    pub fn balancer_mut(&mut self) -> &mut Balancer<M> {
        &mut self.balancer
    }

    /// The endpoints the maps send `key` to (none: refused), if they translate it.
    pub fn endpoints(&self, key: ServiceKey) -> Option<&[SocketAddr]> {
        self.balancer.table().endpoints(key)
    }
}

#[cfg(test)]
mod tests {
    use kp_core::model::Protocol;
    use kp_core::testutil::{cluster_ip_port, endpoint, node_with, port_name, state_on};

    use super::*;
    use crate::maps::{FakeMaps, Verdict};

    fn key(addr: &str) -> ServiceKey {
        ServiceKey::new(addr.parse().expect("literal"), Protocol::Tcp)
    }

    fn web(name: &str, cluster_ip: &str, external_ip: Option<&str>) -> kp_core::model::ServicePort {
        let mut port = cluster_ip_port(port_name("ns", name, "p", Protocol::Tcp), cluster_ip, 80);
        port.external_ips = external_ip
            .map(|ip| vec![ip.parse().expect("literal")])
            .unwrap_or_default();
        port
    }

    fn state(services: Vec<(kp_core::model::ServicePort, Vec<&str>)>) -> ProxyState {
        let services = services
            .into_iter()
            .map(|(port, eps)| {
                let eps = eps.iter().map(|ip| endpoint(ip, 8080, true)).collect();
                (port, eps)
            })
            .collect();
        state_on(node_with(&["192.168.0.2"]), services)
    }

    fn names(list: &[&str]) -> BTreeSet<ServiceName> {
        list.iter()
            .map(|n| port_name("ns", n, "p", Protocol::Tcp).service)
            .collect()
    }

    #[test]
    fn a_partial_sync_writes_only_the_changed_service() {
        let mut lb = ServiceLb::new(FakeMaps::default());
        let before = state(vec![
            (web("a", "10.96.0.1", None), vec!["10.244.1.1"]),
            (web("b", "10.96.0.2", None), vec!["10.244.1.2"]),
        ]);
        let first = lb.sync(&before, true, &BTreeSet::new());
        assert_eq!((first.writes, first.failed.len()), (4, 0));
        let after = state(vec![
            (
                web("a", "10.96.0.1", None),
                vec!["10.244.1.1", "10.244.1.3"],
            ),
            (web("b", "10.96.0.2", None), vec!["10.244.1.9"]),
        ]);
        // Only a is said to have changed: b's new endpoint is not looked at.
        let partial = lb.sync(&after, false, &names(&["a"]));
        assert_eq!(partial.writes, 2, "a's new slot and its count");
        let ep = |s: &str| -> SocketAddr { s.parse().expect("literal") };
        assert_eq!(
            lb.endpoints(key("10.96.0.1:80")),
            Some(&[ep("10.244.1.1:8080"), ep("10.244.1.3:8080")][..])
        );
        assert_eq!(
            lb.endpoints(key("10.96.0.2:80")),
            Some(&[ep("10.244.1.2:8080")][..])
        );
        // A removed Service's addresses go; a full sync catches up with everything.
        let gone = state(vec![(web("b", "10.96.0.2", None), vec!["10.244.1.9"])]);
        lb.sync(&gone, false, &names(&["a"]));
        assert_eq!(lb.endpoints(key("10.96.0.1:80")), None);
        lb.sync(&gone, true, &BTreeSet::new());
        assert_eq!(
            lb.endpoints(key("10.96.0.2:80")),
            Some(&[ep("10.244.1.9:8080")][..])
        );
        assert_eq!(lb.balancer().maps().sizes(), (1, 1));
    }

    #[test]
    fn a_shared_address_passes_to_the_other_claimant() {
        let mut lb = ServiceLb::new(FakeMaps::default());
        let shared = "203.0.113.5";
        let both = state(vec![
            (web("a", "10.96.0.1", Some(shared)), vec!["10.244.1.1"]),
            (web("b", "10.96.0.2", Some(shared)), vec!["10.244.1.2"]),
        ]);
        lb.sync(&both, true, &BTreeSet::new());
        let ep = |s: &str| -> SocketAddr { s.parse().expect("literal") };
        let external = key("203.0.113.5:80");
        assert_eq!(
            lb.endpoints(external),
            Some(&[ep("10.244.1.2:8080")][..]),
            "b wins"
        );
        assert_eq!(
            crate::desired(&both).get(&external).map(|t| &t.endpoints),
            lb.endpoints(external).map(<[_]>::to_vec).as_ref()
        );
        let only_a = state(vec![(
            web("a", "10.96.0.1", Some(shared)),
            vec!["10.244.1.1"],
        )]);
        lb.sync(&only_a, false, &names(&["b"]));
        assert_eq!(
            lb.endpoints(external),
            Some(&[ep("10.244.1.1:8080")][..]),
            "a's now"
        );
        assert_eq!(lb.endpoints(key("10.96.0.2:80")), None);
    }

    #[test]
    fn after_a_failed_write_the_next_sync_is_full() {
        let mut lb = ServiceLb::new(FakeMaps::default());
        let one = state(vec![(web("a", "10.96.0.1", None), vec!["10.244.1.1"])]);
        lb.balancer_mut().maps_mut().fail_write(1);
        assert_eq!(lb.sync(&one, true, &BTreeSet::new()).failed.len(), 1);
        let a = key("10.96.0.1:80");
        assert_eq!(
            lb.balancer().maps().resolve(a, 0),
            Verdict::Untouched,
            "taken out: nftables mode serves it meanwhile"
        );
        // Asked for a partial sync of nothing, it still repairs a.
        let repaired = lb.sync(&one, false, &BTreeSet::new());
        assert!(
            repaired.failed.is_empty() && repaired.writes > 0,
            "{repaired:?}"
        );
        assert_eq!(lb.balancer().maps().sizes(), (1, 1));
    }
}
