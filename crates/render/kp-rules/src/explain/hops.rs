//! The packet's way through iptables mode's rules for one matched service port, told as
//! [`Hop`]s: the dispatch in nat `KUBE-SERVICES` (and `KUBE-NODEPORTS`), the firewall
//! chain, `KUBE-EXT-*`, and the policy chain that picks an endpoint; or the filter rule that
//! rejects or drops the packet first. The chain names are the renderer's
//! ([`super::ChainNames`]), and every step follows a branch of the plan the renderer writes.

use std::net::IpAddr;

use crate::iptables::{KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL, KUBE_SERVICES};
use crate::plan::InternalMasquerade;

use super::{Context, Decision, DetectorView, Hop, MatchKind, Outcome, Route};

impl Context<'_> {
    /// Every hop of the decided packet, up to the endpoint chains.
    pub(super) fn hops(&self, d: &Decision<'_>) -> Vec<Hop> {
        match d.outcome {
            Outcome::RejectNoEndpoints => vec![unforwarded(d, "REJECT")],
            Outcome::DropNoLocalEndpoints => vec![unforwarded(d, "DROP")],
            Outcome::Dnat | Outcome::DropSourceRange => self.through_nat(d),
        }
    }

    /// A packet nat handles: dispatch, the firewall (where it may end), `KUBE-EXT-*` for
    /// external traffic, then the policy chain.
    fn through_nat(&self, d: &Decision<'_>) -> Vec<Hop> {
        let entry = entry_chain(d);
        let mut hops = dispatch(d, entry);
        if entry == d.chains.fw {
            hops.extend(firewall(d));
            if d.outcome == Outcome::DropSourceRange {
                return hops;
            }
        }
        if d.how.is_external() {
            hops.push(external(d));
        }
        hops.push(self.policy(d));
        hops
    }

    /// The policy chain: its ClusterIP masquerade mark, affinity, then the pick.
    fn policy(&self, d: &Decision<'_>) -> Hop {
        let mut action = String::new();
        if d.how == MatchKind::ClusterIp {
            action.push_str(&self.cluster_ip_mark(d.plan.internal_masquerade));
        }
        if let Some(seconds) = d.plan.affinity_seconds {
            action.push_str(&format!(
                "recent client (within {seconds}s) -> its endpoint; "
            ));
        }
        action.push_str("pick an endpoint -> KUBE-SEP-…");
        nat(d.chains.policy(d.list), action)
    }

    /// The ClusterIP masquerade rule at the head of the policy chain, as an action prefix
    /// (empty when no such rule is written).
    fn cluster_ip_mark(&self, rule: InternalMasquerade) -> String {
        match (rule, &self.detector) {
            (InternalMasquerade::All, _) => "mark for masquerade (masqueradeAll); ".to_owned(),
            (InternalMasquerade::NotLocal, DetectorView::Cidr(cidr)) => {
                format!("mark for masquerade if not from {cidr}; ")
            }
            (InternalMasquerade::NotLocal, DetectorView::Interface(iface)) => {
                format!("mark for masquerade unless from {iface}; ")
            }
            (InternalMasquerade::NotLocal, DetectorView::None) | (InternalMasquerade::None, _) => {
                String::new()
            }
        }
    }
}

/// A nat hop.
fn nat(chain: &str, action: String) -> Hop {
    Hop {
        table: "nat",
        chain: chain.to_owned(),
        action,
    }
}

/// A filter hop.
fn filter(chain: &str, action: String) -> Hop {
    Hop {
        table: "filter",
        chain: chain.to_owned(),
        action,
    }
}

/// The filter rule that rejects or drops (`target`) traffic without a usable endpoint,
/// before nat translates it.
fn unforwarded(d: &Decision<'_>, target: &str) -> Hop {
    let (proto, port) = (d.svc.name.protocol.as_str(), d.port);
    // External traffic from a pod or the node is DNATed by KUBE-EXT first; these rules only
    // see what was not.
    let chain = if d.how.is_external() {
        KUBE_EXTERNAL_SERVICES
    } else {
        KUBE_SERVICES
    };
    let what = match d.how {
        MatchKind::NodePort => format!("local address, {proto} port {port}"),
        _ => format!("{}:{port}/{proto}", bracket(d.ip)),
    };
    filter(
        chain,
        format!(
            "{what} ({}) -> {target}; nat leaves it untranslated",
            d.display
        ),
    )
}

/// The chain the dispatch rule jumps to: the policy chain for a ClusterIP, the firewall for
/// an LB IP with source ranges, else `KUBE-EXT-*`.
fn entry_chain<'d>(d: &'d Decision<'_>) -> &'d str {
    match d.how {
        MatchKind::ClusterIp => d.chains.policy(d.list),
        MatchKind::NodePort | MatchKind::ExternalIp => &d.chains.ext,
        MatchKind::LoadBalancerIp if d.plan.uses_firewall_chain => &d.chains.fw,
        MatchKind::LoadBalancerIp => &d.chains.ext,
    }
}

/// nat `KUBE-SERVICES` on to `entry`; a NodePort goes by `KUBE-NODEPORTS` (the last rule).
fn dispatch(d: &Decision<'_>, entry: &str) -> Vec<Hop> {
    let (proto, port) = (d.svc.name.protocol.as_str(), d.port);
    if d.how == MatchKind::NodePort {
        return vec![
            nat(
                KUBE_SERVICES,
                format!("destination is a node address -> {KUBE_NODEPORTS} (last rule)"),
            ),
            nat(
                KUBE_NODEPORTS,
                format!("{proto} port {port} -> {}", d.chains.ext),
            ),
        ];
    }
    vec![nat(
        KUBE_SERVICES,
        format!(
            "{} {}:{port}/{proto} -> {entry}",
            d.how.describe(),
            bracket(d.ip)
        ),
    )]
}

/// `KUBE-FW-*`: on to `KUBE-EXT-*` from an allowed source, else through to the filter
/// table's drop.
fn firewall(d: &Decision<'_>) -> Vec<Hop> {
    let fw = &d.chains.fw;
    if d.outcome == Outcome::DropSourceRange {
        return vec![
            nat(
                fw,
                "source matches no loadBalancerSourceRanges rule: falls through, not DNATed"
                    .to_owned(),
            ),
            filter(
                KUBE_PROXY_FIREWALL,
                format!("traffic to the LB IP not accepted by {fw} -> DROP"),
            ),
        ];
    }
    vec![nat(
        fw,
        format!("source in loadBalancerSourceRanges -> {}", d.chains.ext),
    )]
}

/// `KUBE-EXT-*`: masquerade or short-circuit as the route says, then a policy chain.
fn external(d: &Decision<'_>) -> Hop {
    let (svc, svl) = (&d.chains.svc, &d.chains.svl);
    let action = match d.route {
        Route::ExternalCluster => format!("mark for masquerade -> {svc}"),
        Route::ExternalLocalPod => format!("pod traffic -> {svc}"),
        Route::ExternalLocalNode => format!("--src-type LOCAL: mark for masquerade -> {svc}"),
        Route::ExternalLocal | Route::Internal => format!("external client -> {svl}"),
    };
    nat(&d.chains.ext, action)
}

/// An address as it is written before `:port` (IPv6 in brackets).
fn bracket(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}
