//! One service port's elements, read from the shared [`ServicePlan`]: the decisions are the
//! plan's, this module only says which set each one is an element of.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{Endpoint, ServicePort};

use super::element::{
    AffinityPort, AffinitySet, Element, Entry, EntrySet, MAX_SLOTS, PinList, Slots,
};
use crate::plan::{EndpointList, ExternalMasquerade, InternalMasquerade, NoEndpoints, ServicePlan};

/// The elements of `svc` (one family's view, whose ClusterIP is `cluster_ip`) as `plan`
/// decides, in a stable order.
pub fn service_elements(
    svc: &ServicePort,
    cluster_ip: IpAddr,
    plan: &ServicePlan<'_>,
) -> Vec<Element> {
    let mut out = BTreeSet::new();
    out.insert(Element::ClusterIp(cluster_ip));
    let clusterip = Entry::Ip {
        addr: cluster_ip,
        proto: svc.name.protocol,
        port: svc.port,
    };
    let affinity = plan.affinity_seconds.map(|seconds| {
        // Validated to at most a day (86,400 s).
        AffinityPort::new(&svc.name, u32::try_from(seconds).unwrap_or(u32::MAX))
    });
    let pins = |out: &mut BTreeSet<Element>, entry, reads| {
        if let Some(port) = affinity {
            pin(out, port, entry, reads, plan);
        }
    };
    if internal(&mut out, clusterip, plan) {
        pins(&mut out, clusterip, reads(plan.internal.list));
    }
    for entry in external_entries(svc) {
        if let Some(reads) = external(&mut out, entry, plan) {
            pins(&mut out, entry, reads);
        }
    }
    if plan.source_ranges {
        firewall(&mut out, svc, plan.allow_from_node);
    }
    out.into_iter().collect()
}

/// Every external entry of `svc`: externalIPs, LoadBalancer IPs, the NodePort.
fn external_entries(svc: &ServicePort) -> Vec<Entry> {
    let ip = |addr: &IpAddr| Entry::Ip {
        addr: *addr,
        proto: svc.name.protocol,
        port: svc.port,
    };
    let mut entries: Vec<Entry> = svc.external_ips.iter().map(ip).collect();
    entries.extend(svc.load_balancer_ips.iter().map(ip));
    if let Some(port) = svc.node_port {
        entries.push(Entry::NodePort {
            proto: svc.name.protocol,
            port,
        });
    }
    entries
}

/// ClusterIP traffic: the internal policy's slots, or its filter; whether it is DNATed.
fn internal(out: &mut BTreeSet<Element>, entry: Entry, plan: &ServicePlan<'_>) -> bool {
    if !plan.internal.has_endpoints {
        filter(out, entry, plan.internal_filter);
        return false;
    }
    slots(out, entry, Slots::Policy, plan.list(plan.internal.list));
    match plan.internal_masquerade {
        InternalMasquerade::All => {
            out.insert(Element::Entry(EntrySet::MasqueradeAll, entry));
        }
        InternalMasquerade::NotLocal => {
            out.insert(Element::Entry(EntrySet::MasqueradeNotLocal, entry));
        }
        InternalMasquerade::None => {}
    }
    true
}

/// External traffic (NodePort, externalIPs, LB IPs): the external policy's slots (or its
/// filter) and, for externalTrafficPolicy Local, the short-circuit to the Cluster list.
/// Returns which pins a DNATed entry's affinity reads.
fn external(
    out: &mut BTreeSet<Element>,
    entry: Entry,
    plan: &ServicePlan<'_>,
) -> Option<AffinitySet> {
    if !plan.uses_external_chain {
        filter(out, entry, plan.external_filter);
        return None;
    }
    let mut pins = plan
        .external
        .has_endpoints
        .then(|| reads(plan.external.list));
    match plan.external_masquerade {
        ExternalMasquerade::Always => {
            out.insert(Element::Entry(EntrySet::MasqueradeAll, entry));
        }
        ExternalMasquerade::ShortCircuit { .. } => {
            out.insert(Element::Entry(EntrySet::ShortCircuit, entry));
            slots(out, entry, Slots::ShortCircuit, &plan.endpoints.cluster);
            pins = Some(AffinitySet::ShortCircuit);
        }
        ExternalMasquerade::Never => {}
    }
    if plan.external.has_endpoints {
        slots(out, entry, Slots::Policy, plan.list(plan.external.list));
    } else {
        // Only traffic not short-circuited (so not DNATed) reaches the filter.
        filter(out, entry, plan.external_filter);
    }
    pins
}

/// The affinity entry set of an entry using `list`.
fn reads(list: EndpointList) -> AffinitySet {
    match list {
        EndpointList::Cluster => AffinitySet::Cluster,
        EndpointList::Local => AffinitySet::Local,
    }
}

/// The filter decision for an entry without endpoints in its list.
fn filter(out: &mut BTreeSet<Element>, entry: Entry, verdict: Option<NoEndpoints>) {
    let set = match verdict {
        Some(NoEndpoints::Reject) => EntrySet::Reject,
        Some(NoEndpoints::Drop) => EntrySet::Drop,
        None => return,
    };
    out.insert(Element::Entry(set, entry));
}

/// The class set and one slot element per endpoint (each `addr:port` once, in the list's
/// order), and the endpoints' hairpin elements.
fn slots(out: &mut BTreeSet<Element>, entry: Entry, slots: Slots, list: &[&Endpoint]) {
    let mut seen = BTreeSet::new();
    let unique: Vec<&Endpoint> = list
        .iter()
        .copied()
        .filter(|ep| seen.insert((ep.ip, ep.port)))
        .collect();
    let count = u16::try_from(unique.len()).unwrap_or(MAX_SLOTS);
    if count == 0 {
        return;
    }
    out.insert(Element::Entry(
        EntrySet::Count(slots, u32::from(count)),
        entry,
    ));
    for (slot, ep) in (0..count).zip(unique) {
        out.insert(Element::Slot {
            slots,
            count,
            entry,
            slot,
            addr: ep.ip,
            port: ep.port,
        });
        out.insert(Element::Hairpin(ep.ip));
    }
}

/// ClientIP affinity of a DNATed entry: it records into the port's pins and its lookup reads
/// the pins of `reads`; the endpoints of each list it reads are the candidates.
fn pin(
    out: &mut BTreeSet<Element>,
    port: AffinityPort,
    entry: Entry,
    reads: AffinitySet,
    plan: &ServicePlan<'_>,
) {
    out.insert(Element::AffinityEntry(port, AffinitySet::Record, entry));
    out.insert(Element::AffinityEntry(port, reads, entry));
    let lists: &[PinList] = match reads {
        AffinitySet::Cluster => &[PinList::Cluster],
        AffinitySet::Local => &[PinList::Local],
        AffinitySet::ShortCircuit | AffinitySet::Record => &[PinList::Cluster, PinList::Local],
    };
    for list in lists {
        let endpoints = match list {
            PinList::Cluster => &plan.endpoints.cluster,
            PinList::Local => &plan.endpoints.local,
        };
        for ep in endpoints {
            out.insert(Element::AffinityEndpoint(port, *list, ep.ip, ep.port));
        }
    }
}

/// `loadBalancerSourceRanges`: each LB entry with each allowed range, and with the LB IPs
/// themselves when the plan allows the node's own traffic.
fn firewall(out: &mut BTreeSet<Element>, svc: &ServicePort, allow_from_node: bool) {
    let mut allowed: Vec<IpNet> = svc
        .load_balancer_source_ranges
        .iter()
        .map(IpNet::trunc)
        .collect();
    if allow_from_node {
        allowed.extend(svc.load_balancer_ips.iter().map(|ip| IpNet::from(*ip)));
    }
    for addr in &svc.load_balancer_ips {
        let entry = Entry::Ip {
            addr: *addr,
            proto: svc.name.protocol,
            port: svc.port,
        };
        out.insert(Element::Entry(EntrySet::Firewall, entry));
        for range in &allowed {
            out.insert(Element::Allow(entry, *range));
        }
    }
}
