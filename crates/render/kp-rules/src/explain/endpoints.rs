//! How each endpoint of a matched service port fares on the list its route uses: its
//! verdict, from [`kp_core::topology`]'s (the renderer's) for that list, and a sentence that
//! says why.

use kp_core::model::{Endpoint, IpFamily, NodeInfo};
use kp_core::topology::{self, TopologyMode};

use super::{
    Context, Decision, EndpointExplanation, EndpointList, EndpointVerdict, MatchKind, Outcome,
};
use crate::iptables::names::endpoint_chain;

impl Context<'_> {
    /// `ep` on the decided list (`topology`: its verdicts for both lists).
    pub(super) fn explain_endpoint(
        &self,
        ep: &Endpoint,
        d: &Decision<'_>,
        topology: &topology::Explanation<'_>,
    ) -> EndpointExplanation {
        let topo = topology
            .endpoints
            .iter()
            .find(|(e, _)| e.ip == ep.ip && e.port == ep.port)
            .and_then(|(_, v)| match d.list {
                EndpointList::Cluster => v.cluster,
                EndpointList::Local => v.local,
            });
        let verdict = self.endpoint_verdict(ep, topo, d.how);
        let mode = topology.topology_mode;
        EndpointExplanation {
            ip: ep.ip,
            port: ep.port,
            node_name: ep.node_name.as_deref().map(str::to_owned),
            zone: ep.zone.as_deref().map(str::to_owned),
            local: ep.is_local,
            ready: ep.ready,
            serving: ep.serving,
            terminating: ep.terminating,
            verdict,
            used: verdict.chosen() && d.outcome == Outcome::Dnat,
            reason: endpoint_reason(verdict, ep, mode, self.node(), self.family),
            chain: (verdict != EndpointVerdict::WrongFamily)
                .then(|| endpoint_chain(d.name, ep.ip, ep.port)),
            hairpin: self.source == Some(ep.ip),
        }
    }

    /// What the chosen list made of `ep`, from its topology verdict `topo` for that list.
    fn endpoint_verdict(
        &self,
        ep: &Endpoint,
        topo: Option<topology::Verdict>,
        how: MatchKind,
    ) -> EndpointVerdict {
        if IpFamily::of(&ep.ip) != self.family {
            return EndpointVerdict::WrongFamily;
        }
        match topo {
            Some(topology::Verdict::Ready) => EndpointVerdict::Ready,
            Some(topology::Verdict::TerminatingFallback) => EndpointVerdict::TerminatingFallback,
            Some(topology::Verdict::NotReady) => EndpointVerdict::ServingTerminating,
            Some(topology::Verdict::FilteredByTopology) => EndpointVerdict::FilteredByTopology,
            Some(topology::Verdict::NotLocal) if how.is_external() => {
                EndpointVerdict::NotLocalExternalPolicy
            }
            Some(topology::Verdict::NotLocal) => EndpointVerdict::NotLocalInternalPolicy,
            // `None` (the list is unused) cannot happen for the list the route picks; treat
            // it like an unusable endpoint rather than guess.
            Some(topology::Verdict::Unusable) | None => EndpointVerdict::NotReady,
        }
    }
}

/// Why `ep` got `verdict`, in one sentence (`mode`: the hints' topology mode).
fn endpoint_reason(
    verdict: EndpointVerdict,
    ep: &Endpoint,
    mode: TopologyMode,
    node: &NodeInfo,
    family: IpFamily,
) -> String {
    let on = match &ep.node_name {
        Some(n) => format!("on node {n}"),
        None => "with no node name".to_owned(),
    };
    match verdict {
        EndpointVerdict::Ready => "ready".to_owned(),
        EndpointVerdict::TerminatingFallback => {
            "terminating but still serving; used because no endpoint is ready".to_owned()
        }
        EndpointVerdict::ServingTerminating => {
            "terminating (still serving); not used while a ready endpoint exists".to_owned()
        }
        EndpointVerdict::FilteredByTopology => match mode {
            TopologyMode::PreferSameNode => {
                format!(
                    "ready, but its hints are for other nodes than {}",
                    node.name
                )
            }
            TopologyMode::PreferSameZone => format!(
                "ready, but its hints are for other zones than {}",
                node.zone().unwrap_or("this node's")
            ),
            TopologyMode::None => "ready, but filtered by topology hints".to_owned(),
        },
        EndpointVerdict::NotLocalInternalPolicy => {
            format!("{on}: not local, and internalTrafficPolicy is Local")
        }
        EndpointVerdict::NotLocalExternalPolicy => {
            format!("{on}: not local, and externalTrafficPolicy is Local")
        }
        EndpointVerdict::WrongFamily => format!(
            "{} endpoint: the destination is {}",
            IpFamily::of(&ep.ip).api_name(),
            family.api_name()
        ),
        EndpointVerdict::NotReady => "not ready (and not serving while terminating)".to_owned(),
    }
}
