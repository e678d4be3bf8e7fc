//! Endpoint selection, as upstream's `CategorizeEndpoints`: which endpoints a service port may
//! send traffic to on this node, given traffic policies, topology hints and terminating
//! endpoints.
//!
//! Both [`categorize`] and [`explain`] derive from the same per-endpoint [`Verdict`]s, so an
//! explanation can never disagree with what is programmed.

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde::Serialize;

use crate::model::{Endpoint, NodeInfo, ServicePort};

#[cfg(test)]
mod tests;

/// The endpoints a service port uses on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointCategories<'a> {
    /// Endpoints for Cluster traffic policy (topology-filtered Ready endpoints, else
    /// Serving+Terminating ones anywhere). Empty if the port never uses Cluster policy.
    pub cluster: Vec<&'a Endpoint>,
    /// Endpoints for Local traffic policy (local Ready endpoints, else local
    /// Serving+Terminating ones). Empty if the port never uses Local policy.
    pub local: Vec<&'a Endpoint>,
    /// Every endpoint reachable from this node: the union of `cluster` and `local`.
    pub all_reachable: Vec<&'a Endpoint>,
    /// Some endpoint anywhere in the cluster is usable (Ready, or Serving and Terminating).
    /// False means the service is REJECTed; true with an empty policy list means DROP.
    pub has_any_endpoints: bool,
}

/// How topology hints restrict the Cluster endpoint list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum TopologyMode {
    /// No filtering: hints are missing, incomplete, or name neither this node nor its zone.
    None,
    /// Only endpoints hinted for this node (`hints.forNodes`).
    PreferSameNode,
    /// Only endpoints hinted for this node's zone (`hints.forZones`).
    PreferSameZone,
}

/// Why an endpoint was or was not chosen for one policy list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Verdict {
    /// Chosen: ready (and, for Cluster, allowed by topology).
    Ready,
    /// Chosen: serving and terminating, used because no ready endpoint is available.
    TerminatingFallback,
    /// Not chosen: serving and terminating, but ready endpoints are preferred.
    NotReady,
    /// Not chosen: neither ready nor serving-and-terminating; never used.
    Unusable,
    /// Not chosen (Cluster): ready, but topology hints send it to other nodes or zones.
    FilteredByTopology,
    /// Not chosen (Local): runs on another node, or has no node name.
    NotLocal,
}

impl Verdict {
    /// Whether the endpoint is in the list.
    pub fn chosen(self) -> bool {
        matches!(self, Verdict::Ready | Verdict::TerminatingFallback)
    }
}

/// The verdicts for one endpoint. `None` for a list the service port does not use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EndpointVerdict {
    /// Verdict for the Cluster list.
    pub cluster: Option<Verdict>,
    /// Verdict for the Local list.
    pub local: Option<Verdict>,
}

/// The whole decision for one service port, for `explain`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Explanation<'a> {
    /// The topology mode chosen from the hints (always `None` if Cluster is unused).
    pub topology_mode: TopologyMode,
    /// Each endpoint with its verdicts, in input order.
    pub endpoints: Vec<(&'a Endpoint, EndpointVerdict)>,
}

/// Upstream's `CategorizeEndpoints` for one service port on this node.
///
/// `cluster` and `local` keep the input order (sorted when `endpoints` comes from
/// [`crate::model::merge_slices`]); `all_reachable` is one of them when the other is unused
/// or contained in it, else their sorted, de-duplicated union.
pub fn categorize<'a>(
    svc: &ServicePort,
    endpoints: &'a [Endpoint],
    node: &NodeInfo,
) -> EndpointCategories<'a> {
    let explanation = explain(svc, endpoints, node);
    let chosen = |pick: fn(&EndpointVerdict) -> Option<Verdict>| -> Vec<&'a Endpoint> {
        explanation
            .endpoints
            .iter()
            .filter(|(_, verdict)| pick(verdict).is_some_and(Verdict::chosen))
            .map(|(endpoint, _)| *endpoint)
            .collect()
    };
    let cluster = chosen(|v| v.cluster);
    let local = chosen(|v| v.local);
    let has_any_endpoints = endpoints.iter().any(usable);

    let all_reachable = if !svc.uses_local_endpoints() {
        cluster.clone()
    } else if !svc.uses_cluster_endpoints() {
        local.clone()
    } else {
        // Cluster may hold remote endpoints, Local may hold terminating or
        // topology-filtered local ones: take the union.
        let mut union: Vec<&'a Endpoint> = cluster.iter().chain(&local).copied().collect();
        union.sort();
        union.dedup_by(|a, b| (a.ip, a.port) == (b.ip, b.port));
        union
    };

    EndpointCategories {
        cluster,
        local,
        all_reachable,
        has_any_endpoints,
    }
}

/// Why each endpoint is or is not used by a service port on this node.
pub fn explain<'a>(
    svc: &ServicePort,
    endpoints: &'a [Endpoint],
    node: &NodeInfo,
) -> Explanation<'a> {
    let uses_cluster = svc.uses_cluster_endpoints();
    let uses_local = svc.uses_local_endpoints();
    let topology_mode = if uses_cluster {
        topology_mode(endpoints, node)
    } else {
        TopologyMode::None
    };
    let allowed = |endpoint: &Endpoint| available_for_topology(endpoint, topology_mode, node);
    // The topology mode guarantees a match when any endpoint is ready, so this only falls
    // back when nothing is ready anywhere.
    let cluster_fallback = !endpoints.iter().any(|e| e.ready && allowed(e));
    let local_fallback = !endpoints.iter().any(|e| e.is_local && e.ready);

    let verdicts = endpoints
        .iter()
        .map(|endpoint| {
            let cluster = uses_cluster.then(|| {
                if endpoint.ready {
                    if allowed(endpoint) {
                        Verdict::Ready
                    } else {
                        Verdict::FilteredByTopology
                    }
                } else {
                    readiness_fallback(endpoint, cluster_fallback)
                }
            });
            let local = uses_local.then(|| {
                if !endpoint.is_local {
                    Verdict::NotLocal
                } else if endpoint.ready {
                    Verdict::Ready
                } else {
                    readiness_fallback(endpoint, local_fallback)
                }
            });
            (endpoint, EndpointVerdict { cluster, local })
        })
        .collect();
    Explanation {
        topology_mode,
        endpoints: verdicts,
    }
}

/// Distinct IPs of local Ready endpoints: what a health-check node port reports. Terminating
/// endpoints do not count, so a draining node fails its LB health check.
pub fn local_ready_endpoint_count(endpoints: &[Endpoint]) -> usize {
    endpoints
        .iter()
        .filter(|e| e.is_local && e.ready)
        .map(|e| e.ip)
        .collect::<BTreeSet<IpAddr>>()
        .len()
}

/// The topology mode implied by the hints on Ready endpoints (upstream's
/// `topologyModeFromHints`). Hints are all-or-nothing: one ready endpoint without a hint
/// disables that mode.
pub fn topology_mode(endpoints: &[Endpoint], node: &NodeInfo) -> TopologyMode {
    let ready: Vec<&Endpoint> = endpoints.iter().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return TopologyMode::None;
    }
    let all_have = |hints: fn(&Endpoint) -> Option<&BTreeSet<String>>| {
        ready
            .iter()
            .all(|e| hints(e).is_some_and(|h| !h.is_empty()))
    };
    let any_names = |hints: fn(&Endpoint) -> Option<&BTreeSet<String>>, name: &str| {
        ready
            .iter()
            .any(|e| hints(e).is_some_and(|h| h.contains(name)))
    };
    if all_have(|e| e.node_hints.as_deref()) && any_names(|e| e.node_hints.as_deref(), &node.name) {
        return TopologyMode::PreferSameNode;
    }
    if let Some(zone) = node.zone()
        && all_have(|e| e.zone_hints.as_deref())
        && any_names(|e| e.zone_hints.as_deref(), zone)
    {
        return TopologyMode::PreferSameZone;
    }
    TopologyMode::None
}

/// Ready, or Serving and Terminating: usable by some policy list.
fn usable(endpoint: &Endpoint) -> bool {
    endpoint.ready || (endpoint.serving && endpoint.terminating)
}

/// Verdict for an endpoint that is not ready.
fn readiness_fallback(endpoint: &Endpoint, fallback: bool) -> Verdict {
    if !(endpoint.serving && endpoint.terminating) {
        Verdict::Unusable
    } else if fallback {
        Verdict::TerminatingFallback
    } else {
        Verdict::NotReady
    }
}

fn available_for_topology(endpoint: &Endpoint, mode: TopologyMode, node: &NodeInfo) -> bool {
    let named = |hints: &Option<Box<BTreeSet<String>>>, name: &str| {
        hints.as_ref().is_some_and(|h| h.contains(name))
    };
    match mode {
        TopologyMode::None => true,
        TopologyMode::PreferSameNode => named(&endpoint.node_hints, &node.name),
        TopologyMode::PreferSameZone => node.zone().is_some_and(|z| named(&endpoint.zone_hints, z)),
    }
}
