//! The verdict-free nftables layout (issue 24; design in `docs/nftables-layout.md`):
//! every per-service and per-endpoint fact is an element of a set or data map without
//! verdicts, behind a fixed set of chains and rules, so a Service or EndpointSlice change
//! is a transaction of element updates that the kernel neither validates nor walks the
//! table for.
//!
//! nftables mode writes it by default (backend `kp_dataplane::nftables::layout`);
//! `--nftables-layout=chains` writes [`render`](super::render)'s chain-per-service layout
//! instead. This module is the pure half, split by phase:
//!
//! - [`element`]: the elements and the names of the sets holding them;
//! - [`service`]: one service port's elements, read from the shared
//!   [`ServicePlan`] (the decisions are the plan's);
//! - [`state`]: what is installed (claims per element) and the element transaction of a
//!   full or partial sync, computed from the changed ports only, or of a repair from what
//!   the kernel was read back to hold;
//! - [`fixed`]: the fixed chains and rules, one set and rule group per slot count or
//!   affinity service port in use, and the `nft -f` text of a transaction (and of replacing a
//!   table of another layout).

pub mod class;
pub mod element;
pub mod fixed;
pub mod service;
pub mod state;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::net::IpAddr;

use kp_core::model::{IpFamily, Protocol, ServiceName, ServicePortName};
use kp_core::tracker::ProxyState;

pub use element::{AffinityPort, AffinitySet, Element, Entry, EntrySet, PinList, SetOf, Slots};
pub use fixed::{
    FixedConfig, change_script, delete_classes_script, fixed_part, replace_table_script,
};
pub use state::{Changes, Class, LayoutState, ready_classes};

use crate::config::RenderConfig;
use crate::family::{family_endpoints, for_family};
use crate::plan::{Masquerading, ServicePlan};

/// What every service port's elements depend on besides the port itself.
#[derive(Clone, Debug)]
pub struct Context {
    /// The family of the table.
    pub family: IpFamily,
    /// The masquerade settings of the shared plan.
    pub masquerading: Masquerading,
    /// This node's IP of `family`, for each plan's
    /// [`ServicePlan::allow_from_node`](crate::plan::ServicePlan::allow_from_node).
    pub node_ip: Option<IpAddr>,
    /// The protocols whose NodePorts' localhost traffic is rejected (KEP-6032).
    pub localhost_rejects: &'static [Protocol],
}

impl Context {
    /// The context of `family` under `config`.
    pub fn new(config: &RenderConfig, state: &ProxyState, family: IpFamily) -> Self {
        let detector = matches!(
            crate::config::Detector::new(&config.local_detector, family),
            Ok(Some(_))
        );
        Self {
            family,
            masquerading: Masquerading {
                all: config.masquerade_all,
                detector,
            },
            node_ip: crate::config::node_ip(&config.node_ips, &state.node, family),
            localhost_rejects: config.nftables_localhost_rejects.protocols(family),
        }
    }
}

/// The elements of `name` in `state` (empty when the port is gone or has no ClusterIP of
/// the context's family).
pub fn port_elements(state: &ProxyState, ctx: &Context, name: &ServicePortName) -> Vec<Element> {
    let family = ctx.family;
    let Some((cluster_ip, svc)) = state.services.get(name).and_then(|s| for_family(s, family))
    else {
        return Vec::new();
    };
    let all = state.endpoints.get(name).map_or(&[][..], Vec::as_slice);
    let endpoints = family_endpoints(all, family);
    let plan = ServicePlan::new(&svc, &endpoints, &state.node, ctx.node_ip, ctx.masquerading);
    let mut elements = service::service_elements(&svc, cluster_ip, &plan);
    if let Some(port) = svc.node_port
        && ctx.localhost_rejects.contains(&svc.name.protocol)
    {
        let entry = Entry::NodePort {
            proto: svc.name.protocol,
            port,
        };
        elements.push(Element::Entry(EntrySet::LocalhostReject, entry));
    }
    elements
}

/// Every port's elements: a full sync's updates (ports installed but gone get none). A port
/// with no element that is not installed either is left out: its update would change
/// nothing, and the other family's table would otherwise copy every port's name (no
/// faster at 100k by measurement: bench/notes/2026-12-03-nftables-100k-first-sync-memory.md).
pub fn full_updates(
    state: &ProxyState,
    ctx: &Context,
    installed: &LayoutState,
) -> Vec<(ServicePortName, Vec<Element>)> {
    let mut updates: Vec<_> = state
        .services
        .keys()
        .filter_map(|name| {
            let elements = port_elements(state, ctx, name);
            (!elements.is_empty() || !installed.port(name).is_empty())
                .then(|| (name.clone(), elements))
        })
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
    ctx: &Context,
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
            let elements = port_elements(state, ctx, &name);
            (name, elements)
        })
        .collect()
}
