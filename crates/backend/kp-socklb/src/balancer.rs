//! [`Balancer`]: the [`ServiceTable`] and the maps it writes, kept in step.

use std::net::SocketAddr;

use crate::desired::{Target, Targets};
use crate::layout::ServiceKey;
use crate::maps::{MapWriter, WriteError};
use crate::table::{Epoch, MapOp, ServiceTable};

/// Why [`Balancer::set`] did not (fully) apply.
#[derive(Debug, thiserror::Error)]
pub enum SetError {
    /// An endpoint of the other family than the Service address: a caller's bug (the plan
    /// gives each family its own list). Nothing was written.
    #[error("endpoint {endpoint} is not of the family of Service port {}", key.addr)]
    Family {
        /// The Service port.
        key: ServiceKey,
        /// The endpoint.
        endpoint: SocketAddr,
    },
    /// A map write failed; the next set of the key rewrites it whole.
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// What [`Balancer::sync`] did.
#[derive(Debug, Default)]
pub struct SyncReport {
    /// Map writes made setting ports (removals are not counted).
    pub writes: usize,
    /// Service ports not (fully) written, with why.
    pub failed: Vec<(ServiceKey, SetError)>,
}

/// The socket load balancer's Service ports, written to `M` (the kernel's maps, or a fake).
#[derive(Debug)]
pub struct Balancer<M> {
    table: ServiceTable,
    maps: M,
    /// (Service port, endpoint) pairs taken out by [`Self::set`] since the last
    /// [`Self::take_removed`]: sockets connected to them are to be destroyed.
    removed: Vec<(ServiceKey, SocketAddr)>,
}

impl<M: MapWriter> Balancer<M> {
    /// An empty balancer writing to `maps` (which must be empty too).
    pub fn new(maps: M) -> Self {
        Self {
            table: ServiceTable::default(),
            maps,
            removed: Vec::new(),
        }
    }

    /// Takes over what the maps hold already (pinned maps a previous process wrote, see
    /// [`crate::KernelMaps::read_back`]): the next sync writes only the difference.
    pub fn adopt(&mut self, held: Vec<crate::maps::Held>, top_slot_id: Option<u32>) {
        self.table.adopt(held, top_slot_id);
    }

    /// Sends `key` to `endpoints` (none: refused), without affinity; returns how many map
    /// writes it took. On failure the next call for `key` rewrites it whole.
    pub fn set(&mut self, key: ServiceKey, endpoints: &[SocketAddr]) -> Result<usize, SetError> {
        self.set_target(key, endpoints, 0)
    }

    /// [`Self::set`] with ClientIP affinity for `affinity_ms` (0: none): each client keeps
    /// its endpoint while it connects again within that long, and loses it when the
    /// endpoint leaves `endpoints`.
    pub fn set_target(
        &mut self,
        key: ServiceKey,
        endpoints: &[SocketAddr],
        affinity_ms: u32,
    ) -> Result<usize, SetError> {
        if let Some(&endpoint) = endpoints.iter().find(|e| e.is_ipv6() != key.addr.is_ipv6()) {
            return Err(SetError::Family { key, endpoint });
        }
        self.note_removed(key, endpoints);
        let ops = self.table.set(key, endpoints, affinity_ms);
        let writes = ops.len();
        match ops.into_iter().try_for_each(|op| self.maps.apply(op)) {
            Ok(()) => {
                self.table.written(key);
                Ok(writes)
            }
            Err(error) => {
                self.table.failed(key);
                Err(error.into())
            }
        }
    }

    /// Records the endpoints `key` had and `endpoints` lacks (whether or not the writes
    /// then succeed: the endpoints left the Service either way).
    fn note_removed(&mut self, key: ServiceKey, endpoints: &[SocketAddr]) {
        let Some(old) = self.table.endpoints(key) else {
            return;
        };
        let gone = old.iter().filter(|e| !endpoints.contains(e));
        self.removed.extend(gone.map(|&endpoint| (key, endpoint)));
    }

    /// The (Service port, endpoint) pairs [`Self::set`] took out since the last call: the
    /// sockets the programs connected to them keep that endpoint until destroyed
    /// ([`crate::SocketPrograms::destroy_sockets`]). A port [`Self::remove`]d (the
    /// Service deleted, or left to nftables mode) adds none.
    pub fn take_removed(&mut self) -> Vec<(ServiceKey, SocketAddr)> {
        std::mem::take(&mut self.removed)
    }

    /// Stops translating `key` (its sockets then go to nftables mode's rules); on failure
    /// `key` stays and the next call retries.
    pub fn remove(&mut self, key: ServiceKey) -> Result<(), WriteError> {
        let ops = self.table.remove(key);
        ops.into_iter().try_for_each(|op| self.maps.apply(op))?;
        self.table.removed(key);
        Ok(())
    }

    /// Makes the maps hold exactly `desired` ([`crate::desired()`]'s answer): unchanged
    /// ports cost no write. A port that fails is reported and the others are still written;
    /// the next sync retries it.
    pub fn sync(&mut self, desired: &Targets) -> SyncReport {
        let mut report = SyncReport::default();
        let gone: Vec<ServiceKey> = self
            .table
            .keys()
            .filter(|k| !desired.contains_key(k))
            .collect();
        for key in gone {
            if let Err(error) = self.remove(key) {
                report.failed.push((key, error.into()));
            }
        }
        for (
            &key,
            Target {
                endpoints,
                affinity_ms,
            },
        ) in desired
        {
            match self.set_target(key, endpoints, *affinity_ms) {
                Ok(writes) => report.writes += writes,
                Err(error) => report.failed.push((key, error)),
            }
        }
        report
    }

    /// Puts right the ports someone else changed (`keys`, from
    /// [`ServiceTable::differences_since`]): ours are rewritten whole by the next sync, one
    /// we never wrote is deleted now. Returns the deletes that failed.
    pub fn restore(&mut self, keys: &[ServiceKey]) -> Vec<(ServiceKey, WriteError)> {
        let stray: Vec<ServiceKey> = keys
            .iter()
            .copied()
            .filter(|&key| !self.table.distrust(key))
            .collect();
        stray
            .into_iter()
            .filter_map(|key| {
                let result = self.maps.apply(MapOp::DeleteService(key));
                result.err().map(|error| (key, error))
            })
            .collect()
    }

    /// Starts a read-back of the maps on another thread ([`ServiceTable::watch`]).
    pub fn watch(&mut self) -> Epoch {
        self.table.watch()
    }

    /// The Service ports written.
    pub fn table(&self) -> &ServiceTable {
        &self.table
    }

    /// The maps, to inspect.
    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// The maps, to change in a test (e.g. [`crate::FakeMaps::fail_write`]).
    pub fn maps_mut(&mut self) -> &mut M {
        &mut self.maps
    }
}

#[cfg(test)]
mod tests {
    use kp_core::model::Protocol;

    use super::*;
    use crate::maps::{FakeMaps, Verdict};

    fn targets(list: Vec<(ServiceKey, Vec<SocketAddr>)>) -> Targets {
        list.into_iter()
            .map(|(key, endpoints)| {
                let target = Target {
                    endpoints,
                    affinity_ms: 0,
                };
                (key, target)
            })
            .collect()
    }

    fn key(addr: &str) -> ServiceKey {
        ServiceKey::new(addr.parse().expect("literal"), Protocol::Tcp)
    }

    fn ep(addr: &str) -> SocketAddr {
        addr.parse().expect("literal")
    }

    #[test]
    fn lookups_follow_the_endpoints_set() {
        let mut lb = Balancer::new(FakeMaps::default());
        let web = key("10.96.0.10:80");
        lb.set(web, &[ep("10.0.0.1:8080"), ep("10.0.0.2:8080")])
            .expect("fake");
        let picked: Vec<_> = (0..4).map(|r| lb.maps().resolve(web, r)).collect();
        let (a, b) = (
            Verdict::To(ep("10.0.0.1:8080")),
            Verdict::To(ep("10.0.0.2:8080")),
        );
        assert_eq!(picked, [a, b, a, b]);
        assert_eq!(
            lb.maps().resolve(key("10.96.0.11:80"), 0),
            Verdict::Untouched
        );
        lb.set(web, &[]).expect("fake");
        assert_eq!(lb.maps().resolve(web, 1), Verdict::Refused);
        assert_eq!(lb.maps().sizes(), (1, 0));
        lb.remove(web).expect("fake");
        assert_eq!(lb.maps().resolve(web, 0), Verdict::Untouched);
        assert_eq!(lb.maps().sizes(), (0, 0));
    }

    #[test]
    fn a_failed_write_is_repaired_by_the_next_set() {
        let mut lb = Balancer::new(FakeMaps::default());
        let web = key("10.96.0.10:80");
        let three = [ep("10.0.0.1:80"), ep("10.0.0.2:80"), ep("10.0.0.3:80")];
        lb.maps_mut().fail_write(3);
        assert!(
            lb.set(web, &three).is_err(),
            "the service entry write fails"
        );
        assert_eq!(
            lb.maps().resolve(web, 0),
            Verdict::Untouched,
            "not visible yet"
        );
        let writes = lb.set(web, &three[..1]).expect("fake");
        assert_eq!(
            writes, 4,
            "slot 0, the entry, then stale slots 1 and 2 deleted"
        );
        assert_eq!(lb.maps().sizes(), (1, 1));
        assert_eq!(lb.maps().resolve(web, 2), Verdict::To(three[0]));
    }

    #[test]
    fn families_have_their_own_slots_and_do_not_mix() {
        let mut lb = Balancer::new(FakeMaps::default());
        let four = key("10.96.0.10:80");
        let six = key("[fd00::10]:80");
        lb.set(four, &[ep("10.0.0.1:80")]).expect("fake");
        lb.set(six, &[ep("[fd00::1]:80")]).expect("fake");
        assert_eq!(lb.maps().resolve(six, 0), Verdict::To(ep("[fd00::1]:80")));
        assert_eq!(lb.maps().resolve(four, 0), Verdict::To(ep("10.0.0.1:80")));
        let mixed = lb.set(six, &[ep("10.0.0.2:80")]);
        assert!(matches!(mixed, Err(SetError::Family { .. })), "{mixed:?}");
        assert_eq!(lb.maps().resolve(six, 0), Verdict::To(ep("[fd00::1]:80")));
    }

    #[test]
    fn sync_writes_only_the_difference() {
        let mut lb = Balancer::new(FakeMaps::default());
        let (web, dns) = (key("10.96.0.10:80"), key("10.96.0.11:80"));
        let mut desired = targets(vec![(web, vec![ep("10.0.0.1:80")]), (dns, vec![])]);
        let first = lb.sync(&desired);
        assert_eq!(
            (first.writes, first.failed.len()),
            (3, 0),
            "a slot and two entries"
        );
        assert_eq!(lb.sync(&desired).writes, 0, "nothing changed");
        desired.remove(&dns);
        let endpoints = vec![ep("10.0.0.1:80"), ep("10.0.0.2:80")];
        desired.insert(
            web,
            Target {
                endpoints,
                affinity_ms: 0,
            },
        );
        let second = lb.sync(&desired);
        assert_eq!(
            second.writes, 2,
            "one slot and web's count; dns removed apart"
        );
        assert_eq!(lb.maps().resolve(dns, 0), Verdict::Untouched);
        assert_eq!(lb.maps().resolve(web, 1), Verdict::To(ep("10.0.0.2:80")));
    }

    #[test]
    fn endpoints_taken_out_are_reported_once() {
        let mut lb = Balancer::new(FakeMaps::default());
        let (web, dns) = (key("10.96.0.10:80"), key("10.96.0.11:80"));
        let (a, b) = (ep("10.0.0.1:80"), ep("10.0.0.2:80"));
        lb.set(web, &[a, b]).expect("fake");
        lb.set(dns, &[a]).expect("fake");
        assert_eq!(lb.take_removed(), [], "nothing was taken out yet");
        lb.set(web, &[b]).expect("fake");
        lb.set(dns, &[]).expect("fake");
        assert_eq!(lb.take_removed(), [(web, a), (dns, a)]);
        assert_eq!(lb.take_removed(), [], "taken once");
        lb.maps_mut().fail_write(0);
        assert!(lb.set(web, &[a]).is_err());
        assert_eq!(
            lb.take_removed(),
            [(web, b)],
            "gone from the Service all the same"
        );
        lb.remove(dns).expect("fake");
        assert_eq!(lb.take_removed(), [], "a removed port destroys nothing");
    }

    #[test]
    fn a_failed_remove_is_retried() {
        let mut lb = Balancer::new(FakeMaps::default());
        let web = key("10.96.0.10:80");
        lb.set(web, &[ep("10.0.0.1:80")]).expect("fake");
        lb.maps_mut().fail_write(1);
        assert!(lb.remove(web).is_err());
        assert_eq!(lb.table().len(), 1);
        lb.remove(web).expect("fake");
        assert_eq!(lb.maps().sizes(), (0, 0));
        assert!(lb.table().is_empty());
    }

    #[test]
    fn pins_to_an_endpoint_that_left_are_cleared_and_others_kept() {
        let mut lb = Balancer::new(FakeMaps::default());
        let web = key("10.96.0.10:80");
        let (a, b, c) = (ep("10.0.0.1:80"), ep("10.0.0.2:80"), ep("10.0.0.3:80"));
        lb.set_target(web, &[a, b], 10_000).expect("fake");
        lb.maps_mut().pin(1, web, a);
        lb.maps_mut().pin(2, web, b);
        lb.maps_mut().pin(1, key("10.96.0.11:80"), a);
        lb.set_target(web, &[a, b, c], 10_000).expect("fake");
        assert_eq!(lb.maps().pinned(1, web), Some(a), "a stays");
        lb.set_target(web, &[b, c], 10_000).expect("fake");
        assert_eq!(lb.maps().pinned(1, web), None, "a left: unpinned");
        assert_eq!(lb.maps().pinned(2, web), Some(b), "b stays");
        assert_eq!(
            lb.maps().pinned(1, key("10.96.0.11:80")),
            Some(a),
            "another port's"
        );
        lb.remove(web).expect("fake");
        assert_eq!(lb.maps().pinned(2, web), None, "removed: unpinned");
    }
}
