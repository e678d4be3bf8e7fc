//! The verdict-free nftables layout (issue 24; design in `docs/nftables-layout.md`):
//! every per-service and per-endpoint fact is an element of a set or data map without
//! verdicts, behind a fixed set of chains and rules, so a Service or EndpointSlice change
//! is a transaction of element updates that the kernel neither validates nor walks the
//! table for.
//!
//! **Not wired yet**: the backend still applies [`render`](super::render)'s chain-per-service
//! layout. This module is the pure half of the new one, split by phase:
//!
//! - [`element`]: the elements and the names of the sets holding them;
//! - [`service`]: one service port's elements, read from the shared
//!   [`ServicePlan`](crate::plan::ServicePlan) (the decisions are the plan's);
//! - [`state`]: what is installed (claims per element) and the element transaction of a
//!   full or partial sync, computed from the changed ports only;
//! - [`fixed`]: the fixed chains and rules, one set and rule group per slot count or
//!   affinity timeout in use, and the `nft -f` text of a transaction.

pub mod element;
pub mod fixed;
pub mod service;
pub mod state;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use kp_core::model::{IpFamily, ServiceName, ServicePortName};
use kp_core::tracker::ProxyState;

pub use element::{Element, Entry, EntrySet, Slots};
pub use fixed::{FixedConfig, change_script, fixed_part};
pub use state::{Changes, Class, LayoutState};

use crate::family::{family_endpoints, for_family};
use crate::plan::{Masquerading, ServicePlan};

/// The elements of `name` in `state` for `family` (empty when the port is gone or has no
/// ClusterIP of that family).
pub fn port_elements(
    state: &ProxyState,
    family: IpFamily,
    masquerading: Masquerading,
    name: &ServicePortName,
) -> Vec<Element> {
    let Some((cluster_ip, svc)) = state.services.get(name).and_then(|s| for_family(s, family))
    else {
        return Vec::new();
    };
    let all = state.endpoints.get(name).map_or(&[][..], Vec::as_slice);
    let endpoints = family_endpoints(all, family);
    let plan = ServicePlan::new(&svc, &endpoints, &state.node, masquerading);
    service::service_elements(&svc, cluster_ip, &plan)
}

/// Every port's elements: a full sync's updates (ports installed but gone get none).
pub fn full_updates(
    state: &ProxyState,
    family: IpFamily,
    masquerading: Masquerading,
    installed: &LayoutState,
) -> Vec<(ServicePortName, Vec<Element>)> {
    let mut updates: Vec<_> = state
        .services
        .keys()
        .map(|name| (name.clone(), port_elements(state, family, masquerading, name)))
        .collect();
    updates.extend(
        installed
            .port_names()
            .filter(|name| !state.services.contains_key(*name))
            .map(|name| (name.clone(), Vec::new())),
    );
    updates
}

/// The updates of a partial sync: every current and installed port of the `changed`
/// services, and nothing else.
pub fn partial_updates(
    state: &ProxyState,
    family: IpFamily,
    masquerading: Masquerading,
    installed: &LayoutState,
    changed: &BTreeSet<ServiceName>,
) -> Vec<(ServicePortName, Vec<Element>)> {
    let mut names = BTreeSet::new();
    for service in changed {
        names.extend(state.service_ports(service).map(|(name, _)| name.clone()));
        names.extend(installed.ports_of(service).cloned());
    }
    names
        .into_iter()
        .map(|name| {
            let elements = port_elements(state, family, masquerading, &name);
            (name, elements)
        })
        .collect()
}
