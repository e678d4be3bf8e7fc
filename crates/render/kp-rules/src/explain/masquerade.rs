//! The masquerade decision for one matched service port: which row of upstream's table
//! applies (ClusterIP by masqueradeAll and the local-traffic detector, external traffic by
//! its route), then the hairpin rule, which masquerades a source picked as its own endpoint.

use crate::plan::InternalMasquerade;

use super::{
    Context, Decision, DetectorView, EndpointExplanation, Masquerade, MasqueradeDecision as D,
    MasqueradeReason as R, Outcome, Route,
};

impl Context<'_> {
    /// Whether the decided packet is masqueraded, and why.
    pub(super) fn masquerade(
        &self,
        d: &Decision<'_>,
        endpoints: &[EndpointExplanation],
    ) -> Masquerade {
        if d.outcome != Outcome::Dnat {
            return row(
                D::NotApplicable,
                R::Dropped,
                "the packet is not forwarded".to_owned(),
            );
        }
        let base = self.by_route(d);
        if base.decision == D::Yes {
            return base;
        }
        hairpin(base, endpoints)
    }

    /// The row of the packet's route: ClusterIP traffic by [`Self::cluster_ip`], external
    /// traffic by its traffic policy and, for eTP Local, where the source is.
    fn by_route(&self, d: &Decision<'_>) -> Masquerade {
        match d.route {
            Route::Internal => self.cluster_ip(d.plan.internal_masquerade),
            Route::ExternalCluster => row(
                D::Yes,
                R::ExternalPolicyCluster,
                "external traffic with externalTrafficPolicy Cluster is always masqueraded"
                    .to_owned(),
            ),
            Route::ExternalLocalPod => row(
                D::No,
                R::ExternalLocalFromPod,
                "externalTrafficPolicy Local, from a local pod: not masqueraded".to_owned(),
            ),
            Route::ExternalLocalNode => row(
                D::Yes,
                R::ExternalLocalFromNode,
                "externalTrafficPolicy Local, from this node: masqueraded".to_owned(),
            ),
            Route::ExternalLocal => row(
                D::No,
                R::ExternalLocalPreserved,
                "externalTrafficPolicy Local from outside: not masqueraded, the client IP is \
                 preserved"
                    .to_owned(),
            ),
        }
    }

    /// ClusterIP traffic: masqueradeAll, else by what the detector makes of the source.
    fn cluster_ip(&self, rule: InternalMasquerade) -> Masquerade {
        if rule == InternalMasquerade::All {
            return row(
                D::Yes,
                R::MasqueradeAll,
                "masqueradeAll: all ClusterIP traffic is masqueraded".to_owned(),
            );
        }
        match (&self.detector, self.source) {
            (DetectorView::None, _) => row(
                D::No,
                R::NoLocalDetector,
                "no local-traffic detector (e.g. no clusterCIDR): ClusterIP traffic is not \
                 masqueraded"
                    .to_owned(),
            ),
            (DetectorView::Cidr(cidr), Some(s)) if cidr.contains(&s) => row(
                D::No,
                R::LocalTraffic,
                format!("the source is in {cidr} (pod traffic): not masqueraded"),
            ),
            (DetectorView::Cidr(cidr), Some(_)) => row(
                D::Yes,
                R::NotLocalTraffic,
                format!("the source is not in {cidr} (not pod traffic): masqueraded"),
            ),
            (DetectorView::Cidr(cidr), None) => row(
                D::Depends,
                R::SourceUndetermined,
                format!(
                    "masqueraded unless the source is in {cidr} (pod traffic); give --from to \
                     decide"
                ),
            ),
            (DetectorView::Interface(iface), _) => row(
                D::Depends,
                R::SourceUndetermined,
                format!("masqueraded unless the packet arrives on {iface}"),
            ),
        }
    }
}

/// One row of the table.
fn row(decision: D, reason: R, detail: String) -> Masquerade {
    Masquerade {
        decision,
        reason,
        detail,
    }
}

/// The per-endpoint `-s <ep>` rule marks a packet from an endpoint to itself: when the
/// source is one of the used endpoints, `base` holds only if another one is picked.
fn hairpin(base: Masquerade, endpoints: &[EndpointExplanation]) -> Masquerade {
    let used: Vec<&EndpointExplanation> = endpoints.iter().filter(|e| e.used).collect();
    if !used.iter().any(|e| e.hairpin) {
        return base;
    }
    if used.iter().all(|e| e.hairpin) {
        return row(
            D::Yes,
            R::Hairpin,
            "the source is the only usable endpoint: the hairpin rule masquerades it".to_owned(),
        );
    }
    row(
        D::Depends,
        R::Hairpin,
        format!(
            "the source is an endpoint: masqueraded if it is picked for itself (hairpin); \
             otherwise {}",
            base.detail
        ),
    )
}
