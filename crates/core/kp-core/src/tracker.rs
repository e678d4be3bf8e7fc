//! Change tracking: coalesce source events into the proxy state and report what changed.
//!
//! This is upstream's service and endpoints change trackers in one place. Events are
//! recorded as they arrive; [`ChangeTracker::apply`] folds everything recorded since the
//! previous apply into the [`ProxyState`] and reports which services changed, so a backend
//! can rewrite only those. For every service with unapplied changes the tracker keeps the
//! latest version next to the applied one, so a change that returns to the applied state
//! cancels out and is not reported.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Serialize;

use crate::event::{ObjectEvent, SourceEvent};
use crate::model::{
    self, Endpoint, ModelError, Names, NodeInfo, Protocol, ServiceName, ServicePort,
    ServicePortName, SliceEndpoints,
};

#[cfg(test)]
mod tests;

/// The EndpointSlice annotation holding when the change that produced the slice was
/// triggered; the source of the network-programming latency metric.
pub const LAST_CHANGE_TRIGGER_TIME_ANNOTATION: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";

/// The complete desired state handed to a backend.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ProxyState {
    /// Every valid service port, sorted (so renderers are deterministic).
    pub services: BTreeMap<ServicePortName, ServicePort>,
    /// Endpoints per service port, sorted; a service port without endpoints may be absent.
    pub endpoints: BTreeMap<ServicePortName, Vec<Endpoint>>,
    /// This node.
    pub node: NodeInfo,
    /// The ranges of every ServiceCIDR, sorted, without duplicates (empty when the cluster
    /// has none or no ServiceCIDR API).
    pub service_cidrs: Vec<IpNet>,
}

impl ProxyState {
    /// The service ports of one service, in key order.
    pub fn service_ports<'a>(
        &'a self,
        service: &'a ServiceName,
    ) -> impl Iterator<Item = (&'a ServicePortName, &'a ServicePort)> + 'a {
        of_service(&self.services, service)
    }

    /// The endpoint lists of one service, per service port, in key order.
    pub fn service_endpoints<'a>(
        &'a self,
        service: &'a ServiceName,
    ) -> impl Iterator<Item = (&'a ServicePortName, &'a Vec<Endpoint>)> + 'a {
        of_service(&self.endpoints, service)
    }

    /// Every service with at least one service port, once each, in key order.
    pub fn service_names(&self) -> impl Iterator<Item = &ServiceName> {
        let mut last: Option<&ServiceName> = None;
        self.services.keys().filter_map(move |name| {
            let new = last != Some(&name.service);
            last = Some(&name.service);
            new.then_some(&name.service)
        })
    }

    /// The number of distinct services with at least one service port.
    pub fn service_count(&self) -> usize {
        self.service_names().count()
    }
}

/// The kinds of objects sources report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum ObjectKind {
    /// `v1/Service`.
    Service,
    /// `discovery.k8s.io/v1/EndpointSlice`.
    EndpointSlice,
    /// `v1/Node` (only this node's).
    Node,
    /// `networking.k8s.io/v1/ServiceCIDR`.
    ServiceCidr,
}

impl ObjectKind {
    /// The API kind name, as used in [`ModelError::kind`] and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Service => "Service",
            ObjectKind::EndpointSlice => "EndpointSlice",
            ObjectKind::Node => "Node",
            ObjectKind::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// What recording one event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// The latest desired state moved (it may have moved back to the applied state, which
    /// [`ChangeTracker::apply`] then does not report); a sync should be requested.
    Changed,
    /// Nothing to program: an identical update, an object the proxy ignores and never had,
    /// another node's Node, or a Node change that only affects eligibility.
    Unchanged,
    /// The object is invalid and was skipped (the last good version, if any, is kept). The
    /// error is reported by the next [`ChangeTracker::apply`], so a sync should be requested
    /// to surface it promptly.
    Invalid,
    /// A source finished listing this kind.
    Synced(ObjectKind),
}

impl Recorded {
    /// Whether the proxier should request a sync for this event (once initialised).
    pub fn needs_sync(self) -> bool {
        matches!(self, Recorded::Changed | Recorded::Invalid)
    }

    /// The result of a batch: the one that asks the most of the proxier (Changed, then
    /// Invalid, then Synced, then Unchanged). The proxier records a batch's events one by
    /// one, so it sees every `Synced`; this is for other callers of
    /// [`ChangeTracker::record`].
    pub fn strongest(self, other: Recorded) -> Recorded {
        let rank = |r: &Recorded| match r {
            Recorded::Changed => 3,
            Recorded::Invalid => 2,
            Recorded::Synced(_) => 1,
            Recorded::Unchanged => 0,
        };
        if rank(&other) > rank(&self) {
            other
        } else {
            self
        }
    }
}

/// What one [`ChangeTracker::apply`] changed in the [`ProxyState`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UpdateResult {
    /// Services whose service ports or endpoints differ from before the apply.
    pub changed: BTreeSet<ServiceName>,
    /// A changed service has a UDP or SCTP port (service or endpoint port, before or after),
    /// so stale conntrack entries may exist.
    pub conntrack_cleanup_required: bool,
    /// This node's labels changed (topology may change for every service: sync fully).
    pub node_labels_changed: bool,
    /// Objects skipped since the previous apply because they are invalid.
    pub invalid: Vec<ModelError>,
    /// `last-change-trigger-time` annotations of the applied EndpointSlice changes of the
    /// changed services, for the network-programming latency metric.
    pub trigger_times: Vec<SystemTime>,
}

/// Applied and unapplied versions of a per-service value.
#[derive(Debug)]
struct Versions<V> {
    /// As of the last apply.
    applied: BTreeMap<ServiceName, V>,
    /// Latest version of every service that differs from `applied` (`None`: absent).
    pending: BTreeMap<ServiceName, Option<V>>,
}

impl<V> Default for Versions<V> {
    fn default() -> Self {
        Self {
            applied: BTreeMap::new(),
            pending: BTreeMap::new(),
        }
    }
}

impl<V: Clone + PartialEq> Versions<V> {
    fn latest(&self, key: &ServiceName) -> Option<&V> {
        match self.pending.get(key) {
            Some(pending) => pending.as_ref(),
            None => self.applied.get(key),
        }
    }

    /// Set the latest version; returns whether it moved.
    fn set(&mut self, key: &ServiceName, value: Option<V>) -> bool {
        if self.latest(key) == value.as_ref() {
            return false;
        }
        if self.applied.get(key) == value.as_ref() {
            // Back where the last apply left it: the change cancels out.
            self.pending.remove(key);
        } else {
            self.pending.insert(key.clone(), value);
        }
        true
    }

    /// Make the pending versions the applied ones (moved, not copied: the latest version is
    /// then read from `applied`); returns the services that had one.
    fn checkout(&mut self) -> BTreeSet<ServiceName> {
        let pending = std::mem::take(&mut self.pending);
        if self.applied.is_empty() {
            // The first apply: built in one go from the sorted pending versions, with full
            // B-tree nodes (inserting in order leaves each node about half full).
            let keys = pending.keys().cloned().collect();
            self.applied = pending
                .into_iter()
                .filter_map(|(key, value)| value.map(|value| (key, value)))
                .collect();
            return keys;
        }
        let mut keys = BTreeSet::new();
        for (key, value) in pending {
            match value {
                Some(value) => self.applied.insert(key.clone(), value),
                None => self.applied.remove(&key),
            };
            keys.insert(key);
        }
        keys
    }
}

/// The slices of one service, by slice name (sorted, so merging is deterministic).
///
/// A sorted `Vec`, not a `BTreeMap`: a service has one or a few slices, and a `BTreeMap`
/// allocates a node for eleven entries even for one (about 1.4 KiB per service here).
#[derive(Clone, Debug, Default, PartialEq)]
struct SliceMap(Vec<(String, SliceEndpoints)>);

impl SliceMap {
    /// Add or replace the slice `name`.
    fn insert(&mut self, name: String, slice: SliceEndpoints) {
        match self
            .0
            .binary_search_by(|(have, _)| have.as_str().cmp(&name))
        {
            Ok(index) => self.0[index].1 = slice,
            Err(index) => {
                // Exact: a first push would make room for four slices, and most services
                // have one (10^4 of these are kept).
                self.0.reserve_exact(1);
                self.0.insert(index, (name, slice));
            }
        }
    }

    /// Remove the slice `name`, if present.
    fn remove(&mut self, name: &str) {
        if let Ok(index) = self.0.binary_search_by(|(have, _)| have.as_str().cmp(name)) {
            self.0.remove(index);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The slices, by name.
    fn values(&self) -> impl Iterator<Item = &SliceEndpoints> {
        self.0.iter().map(|(_, slice)| slice)
    }
}

/// Records source events and applies them to a [`ProxyState`] (upstream's
/// `ServiceChangeTracker` and `EndpointsChangeTracker`).
///
/// Always apply to the same [`ProxyState`]: the tracker remembers what it applied.
#[derive(Debug)]
pub struct ChangeTracker {
    node_name: String,
    services: Versions<Vec<ServicePort>>,
    slices: Versions<SliceMap>,
    /// Which service each known slice, by (namespace, name), belongs to (latest version).
    slice_owners: BTreeMap<(String, String), ServiceName>,
    /// Trigger times of recorded slice changes, per service.
    trigger_times: BTreeMap<ServiceName, BTreeSet<SystemTime>>,
    /// The latest version of this node.
    node: NodeInfo,
    /// The node as of the last apply.
    applied_node: Option<NodeInfo>,
    /// The ranges of each ServiceCIDR, by name (latest versions).
    service_cidrs: BTreeMap<String, Vec<IpNet>>,
    /// The ranges as of the last apply.
    applied_service_cidrs: Vec<IpNet>,
    invalid: Vec<ModelError>,
    synced: BTreeSet<ObjectKind>,
    /// Node and zone names, shared by all endpoints (here and in the applied state).
    names: Names,
    /// Services' `externalIPs` are kept (`AllowServiceExternalIPs`).
    external_ips: bool,
}

impl ChangeTracker {
    /// A tracker for the proxy on `node_name` (endpoints there are local; only that Node is
    /// tracked).
    pub fn new(node_name: impl Into<String>) -> Self {
        let node_name = node_name.into();
        Self {
            node: NodeInfo {
                name: node_name.clone(),
                ..NodeInfo::default()
            },
            node_name,
            services: Versions::default(),
            slices: Versions::default(),
            slice_owners: BTreeMap::new(),
            trigger_times: BTreeMap::new(),
            applied_node: None,
            service_cidrs: BTreeMap::new(),
            applied_service_cidrs: Vec::new(),
            invalid: Vec::new(),
            synced: BTreeSet::new(),
            names: Names::default(),
            external_ips: true,
        }
    }

    /// Keep (the default) or drop every Service's `externalIPs`, as upstream's
    /// `AllowServiceExternalIPs` gate does: dropped, a Service is programmed as if it had none.
    pub fn with_external_ips(mut self, allowed: bool) -> Self {
        self.external_ips = allowed;
        self
    }

    /// The node this tracker is for.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The latest recorded state of this node (not yet applied, maybe).
    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    /// Record one event.
    pub fn record(&mut self, event: SourceEvent) -> Recorded {
        match event {
            SourceEvent::Service(event) => match event {
                ObjectEvent::Applied(service) => self.service_applied(&service),
                ObjectEvent::Deleted(service) => {
                    let key = service_key(&service, &mut self.names);
                    changed_if(self.services.set(&key, None))
                }
                ObjectEvent::Synced => self.synced(ObjectKind::Service),
            },
            SourceEvent::EndpointSlice(event) => match event {
                ObjectEvent::Applied(slice) => self.slice_applied(&slice),
                ObjectEvent::Deleted(slice) => {
                    let key = slice_key(&slice);
                    changed_if(self.remove_slice(&key))
                }
                ObjectEvent::Synced => self.synced(ObjectKind::EndpointSlice),
            },
            SourceEvent::Node(event) => match event {
                ObjectEvent::Applied(node) => {
                    if node.metadata.name.as_deref() != Some(self.node_name.as_str()) {
                        return Recorded::Unchanged;
                    }
                    self.node_changed(model::node_info(&node))
                }
                ObjectEvent::Deleted(node) => {
                    if node.metadata.name.as_deref() != Some(self.node_name.as_str()) {
                        return Recorded::Unchanged;
                    }
                    // Labels go (as upstream), the node is no longer eligible; addresses and
                    // pod CIDRs are kept, as a re-created Node normally gets the same ones.
                    let gone = NodeInfo {
                        name: self.node_name.clone(),
                        labels: BTreeMap::new(),
                        eligible: false,
                        known: true,
                        ..self.node.clone()
                    };
                    self.node_changed(gone)
                }
                ObjectEvent::Synced => self.synced(ObjectKind::Node),
            },
            SourceEvent::ServiceCidr(event) => match event {
                ObjectEvent::Applied(object) => {
                    let name = object.metadata.name.clone().unwrap_or_default();
                    match model::service_cidr_ranges(&object) {
                        Ok(ranges) => changed_if(
                            self.service_cidrs.insert(name, ranges.clone()) != Some(ranges),
                        ),
                        Err(error) => {
                            // Keep the last good version, as for Services.
                            self.invalid.push(error);
                            Recorded::Invalid
                        }
                    }
                }
                ObjectEvent::Deleted(object) => {
                    let name = object.metadata.name.clone().unwrap_or_default();
                    changed_if(self.service_cidrs.remove(&name).is_some())
                }
                ObjectEvent::Synced => self.synced(ObjectKind::ServiceCidr),
            },
            SourceEvent::Batch(events) => events
                .into_iter()
                .map(|event| self.record(event))
                .fold(Recorded::Unchanged, Recorded::strongest),
        }
    }

    /// Every ServiceCIDR's ranges, sorted, without duplicates.
    fn latest_service_cidrs(&self) -> Vec<IpNet> {
        let ranges: BTreeSet<IpNet> = self.service_cidrs.values().flatten().copied().collect();
        ranges.into_iter().collect()
    }

    /// Whether the source of `kind` has finished its initial list.
    pub fn is_synced(&self, kind: ObjectKind) -> bool {
        self.synced.contains(&kind)
    }

    /// Services and EndpointSlices are both synced: the proxy may program rules.
    pub fn ready(&self) -> bool {
        self.is_synced(ObjectKind::Service) && self.is_synced(ObjectKind::EndpointSlice)
    }

    /// Services with unapplied Service changes (`..._service_changes_pending`).
    pub fn service_changes_pending(&self) -> usize {
        self.services.pending.len()
    }

    /// Services with unapplied EndpointSlice changes (`..._endpoint_changes_pending`).
    pub fn endpoint_changes_pending(&self) -> usize {
        self.slices.pending.len()
    }

    /// Whether [`apply`](Self::apply) would do anything.
    pub fn has_pending(&self) -> bool {
        !self.services.pending.is_empty()
            || !self.slices.pending.is_empty()
            || !self.invalid.is_empty()
            || self.applied_node.as_ref() != Some(&self.node)
            || self.applied_service_cidrs != self.latest_service_cidrs()
    }

    /// Fold every recorded change into `state` and report what changed.
    pub fn apply(&mut self, state: &mut ProxyState) -> UpdateResult {
        let mut result = UpdateResult {
            invalid: std::mem::take(&mut self.invalid),
            ..UpdateResult::default()
        };

        let services = self.services.checkout();
        let slices = self.slices.checkout();
        let touched: BTreeSet<ServiceName> = services.union(&slices).cloned().collect();
        for service in touched {
            let mut changed = false;
            let mut protocols: BTreeSet<Protocol> = BTreeSet::new();

            let old_ports = take_service(&mut state.services, &service);
            let new_ports: BTreeMap<ServicePortName, ServicePort> = if services.contains(&service) {
                self.services
                    .applied
                    .get(&service)
                    .into_iter()
                    .flatten()
                    .map(|port| (port.name.clone(), port.clone()))
                    .collect()
            } else {
                old_ports.clone()
            };
            changed |= old_ports != new_ports;
            protocols.extend(old_ports.keys().chain(new_ports.keys()).map(|n| n.protocol));
            state.services.extend(new_ports);

            let old_endpoints = take_service(&mut state.endpoints, &service);
            let new_endpoints = if slices.contains(&service) {
                let latest = self.slices.applied.get(&service);
                model::merge_slices(latest.into_iter().flat_map(|m| m.values()), &self.node_name)
            } else {
                old_endpoints.clone()
            };
            changed |= old_endpoints != new_endpoints;
            protocols.extend(
                old_endpoints
                    .keys()
                    .chain(new_endpoints.keys())
                    .map(|n| n.protocol),
            );
            state.endpoints.extend(new_endpoints);

            if changed {
                // As upstream: any UDP (or SCTP) port of a changed service, before or after.
                result.conntrack_cleanup_required |= protocols
                    .iter()
                    .any(|p| matches!(p, Protocol::Udp | Protocol::Sctp));
                if let Some(times) = self.trigger_times.remove(&service) {
                    result.trigger_times.extend(times);
                }
                result.changed.insert(service);
            }
        }
        // Trigger times of changes that cancelled out measure nothing.
        self.trigger_times.clear();
        // The old state's endpoints are gone now: names only they used can go too.
        self.names.prune();

        if state.node != self.node {
            result.node_labels_changed = state.node.labels != self.node.labels;
            state.node = self.node.clone();
        }
        self.applied_node = Some(self.node.clone());
        let cidrs = self.latest_service_cidrs();
        if state.service_cidrs != cidrs {
            state.service_cidrs.clone_from(&cidrs);
        }
        self.applied_service_cidrs = cidrs;
        result
    }

    fn synced(&mut self, kind: ObjectKind) -> Recorded {
        self.synced.insert(kind);
        Recorded::Synced(kind)
    }

    fn service_applied(&mut self, service: &Service) -> Recorded {
        let key = service_key(service, &mut self.names);
        match model::service_ports_with(service, &mut self.names) {
            Ok(mut ports) => {
                if !self.external_ips {
                    ports.iter_mut().flatten().for_each(without_external_ips);
                }
                changed_if(self.services.set(&key, ports))
            }
            Err(error) => {
                // Keep the last good version: an invalid update must not take down a
                // working service.
                self.invalid.push(error);
                Recorded::Invalid
            }
        }
    }

    fn slice_applied(&mut self, slice: &EndpointSlice) -> Recorded {
        let key = slice_key(slice);
        let parsed = match model::slice_endpoints_with(slice, &mut self.names) {
            Ok(parsed) => parsed,
            Err(error) => {
                // Keep the last good version, as for Services.
                self.invalid.push(error);
                return Recorded::Invalid;
            }
        };
        let Some(parsed) = parsed else {
            // Ignored now (label removed, FQDN): forget any earlier version.
            return changed_if(self.remove_slice(&key));
        };
        let owner = parsed.service.clone();
        let mut moved = false;
        if self.slice_owners.get(&key).is_some_and(|old| *old != owner) {
            moved |= self.remove_slice(&key);
        }
        let mut slices = self.slices.latest(&owner).cloned().unwrap_or_default();
        slices.insert(key.1.clone(), parsed);
        let changed = self.slices.set(&owner, Some(slices));
        self.slice_owners.insert(key, owner.clone());
        if changed && let Some(time) = trigger_time(slice) {
            self.trigger_times.entry(owner).or_default().insert(time);
        }
        changed_if(moved || changed)
    }

    /// Forget one slice; returns whether its service's latest slices moved.
    fn remove_slice(&mut self, key: &(String, String)) -> bool {
        let Some(owner) = self.slice_owners.remove(key) else {
            return false;
        };
        let mut slices = self.slices.latest(&owner).cloned().unwrap_or_default();
        slices.remove(&key.1);
        let slices = (!slices.is_empty()).then_some(slices);
        self.slices.set(&owner, slices)
    }

    fn node_changed(&mut self, info: NodeInfo) -> Recorded {
        // Eligibility only matters to /healthz; the proxier reads it from `node()`.
        let relevant = info.labels != self.node.labels
            || info.addresses != self.node.addresses
            || info.pod_cidrs != self.node.pod_cidrs
            || info.known != self.node.known;
        self.node = info;
        changed_if(relevant)
    }
}

/// `port` as if its Service had no `externalIPs`: a port left with no external address has
/// no external traffic policy either.
fn without_external_ips(port: &mut ServicePort) {
    port.external_ips.clear();
    if !port.externally_accessible() {
        port.external_policy_local = false;
    }
}

fn changed_if(moved: bool) -> Recorded {
    if moved {
        Recorded::Changed
    } else {
        Recorded::Unchanged
    }
}

/// The entries of one service in a map keyed by [`ServicePortName`].
fn of_service<'a, V>(
    map: &'a BTreeMap<ServicePortName, V>,
    service: &'a ServiceName,
) -> impl Iterator<Item = (&'a ServicePortName, &'a V)> + 'a {
    map.range(first_port_of(service)..)
        .take_while(move |(name, _)| name.service == *service)
}

/// Remove and return the entries of one service.
fn take_service<V>(
    map: &mut BTreeMap<ServicePortName, V>,
    service: &ServiceName,
) -> BTreeMap<ServicePortName, V> {
    let keys: Vec<ServicePortName> = of_service(map, service)
        .map(|(name, _)| name.clone())
        .collect();
    keys.into_iter()
        .filter_map(|key| map.remove_entry(&key))
        .collect()
}

/// The smallest [`ServicePortName`] of a service (empty port name sorts first, TCP first).
fn first_port_of(service: &ServiceName) -> ServicePortName {
    ServicePortName {
        service: service.clone(),
        port: model::Name::default(),
        protocol: Protocol::Tcp,
    }
}

fn service_key(service: &Service, names: &mut Names) -> ServiceName {
    ServiceName {
        namespace: names.get(service.metadata.namespace.as_deref().unwrap_or_default()),
        name: names.get(service.metadata.name.as_deref().unwrap_or_default()),
    }
}

fn slice_key(slice: &EndpointSlice) -> (String, String) {
    (
        slice.metadata.namespace.clone().unwrap_or_default(),
        slice.metadata.name.clone().unwrap_or_default(),
    )
}

/// The slice's trigger-time annotation; unparsable values are ignored (it only feeds a
/// metric).
fn trigger_time(slice: &EndpointSlice) -> Option<SystemTime> {
    let text = slice
        .metadata
        .annotations
        .as_ref()?
        .get(LAST_CHANGE_TRIGGER_TIME_ANNOTATION)?;
    let timestamp: jiff::Timestamp = text.parse().ok()?;
    Some(SystemTime::from(timestamp))
}
