//! One service port's objects: its chains and their rules, its affinity sets, and its set and
//! map elements, written from the shared [`ServicePlan`] (the decisions are the plan's, the
//! iptables renderer and `explain` read the same one; this module only writes them as
//! nftables objects), and the commands that create them.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::{Endpoint, ServicePort, ServicePortName};

use super::super::cmd::{
    Action, AddrField, Command, ElementKey, ElementValue, KeyParts, Match, Name, Rule,
    ServiceCommands, SetKind, Verdict,
};
use super::super::names::{EndpointNames, ServiceChains};
use super::super::{
    ElementSet, MARK_FOR_MASQUERADE, NftState, OwnedObjects, PortObjects, REJECT_CHAIN,
};
use super::{Context, add_chain, add_rule, addr_in_set, addr_is, comment_text, goto, jump};
use crate::plan::{EndpointList, ExternalMasquerade, InternalMasquerade, NoEndpoints, ServicePlan};

/// Up to this many endpoints, a service chain picks one with a cascade of `numgen random mod
/// k` rules instead of upstream's single `numgen random mod n vmap { ... }`. That anonymous
/// map costs the kernel a walk over the whole pending transaction when it is bound
/// (`__nft_set_trans_bind`), so a full sync with one per service grows with the square of
/// its size (3k services x 10 endpoints: 5.9 of 7.4 s; 10k: minutes). The cascade needs no
/// set; its cost is up to n-1 extra rule evaluations for the first packet of a connection,
/// negligible for small n, so larger services keep the O(1) map.
pub(crate) const MAX_CASCADE_ENDPOINTS: usize = 32;

/// A chain with its rules, in writing order.
type Chain = (Name, Vec<Rule>);

/// One set or map element: where it goes, its key and its value.
type Element = (ElementSet, ElementKey, ElementValue);

/// Everything one service port puts in the table.
pub(super) struct ServiceObjects<'a> {
    pub(super) name: &'a ServicePortName,
    /// Its chains with their rules, in writing order.
    pub(super) chains: Vec<Chain>,
    /// Its affinity sets and their timeouts.
    pub(super) affinity_sets: BTreeMap<String, u64>,
    /// Its set and map elements.
    pub(super) elements: Vec<Element>,
}

impl<'a> ServiceObjects<'a> {
    /// The objects of service port `name` (`svc`, already one family's view, with that
    /// family's `endpoints`): its dispatch elements, then its chains in the parts of its
    /// plan: the policy chains, the external chain, the firewall chain, the endpoint chains.
    pub(super) fn new(
        ctx: &Context<'_>,
        name: &'a ServicePortName,
        cluster_ip: IpAddr,
        svc: &ServicePort,
        endpoints: &[Endpoint],
    ) -> Self {
        let plan = ServicePlan::new(svc, endpoints, ctx.node, ctx.node_ip, ctx.masquerading);
        let writer = Writer::new(ctx, plan, name, cluster_ip, svc);
        let mut chains = writer.policy_chains();
        if writer.plan.uses_external_chain {
            chains.push(writer.external_chain());
        }
        // As upstream, the source-range filter applies whether or not there are endpoints.
        if writer.plan.source_ranges {
            chains.push(writer.firewall_chain());
        }
        let (endpoint_chains, affinity_sets) = writer.endpoint_chains();
        chains.extend(endpoint_chains);
        Self {
            name,
            elements: writer.elements(),
            chains,
            affinity_sets,
        }
    }

    /// Its commands: its chains (emptied when they may hold rules), then its affinity sets
    /// and rules (moved out of `self`).
    pub(super) fn commands(&mut self, existing: &NftState) -> ServiceCommands {
        let mut chains = Vec::with_capacity(self.chains.len());
        let mut body = Vec::new();
        for (chain, _) in &self.chains {
            chains.push(add_chain(chain.clone()));
            if existing.may_hold_chain(self.name, chain) {
                chains.push(Command::FlushChain(chain.clone()));
            }
        }
        for (set, timeout) in &self.affinity_sets {
            body.push(Command::AddSet {
                set: set.into(),
                kind: SetKind::Addresses {
                    timeout: Some(*timeout),
                },
                comment: None,
            });
        }
        for (chain, rules) in &mut self.chains {
            body.extend(
                std::mem::take(rules)
                    .into_iter()
                    .map(|rule| add_rule(chain.clone(), rule)),
            );
        }
        // One of its affinity sets is deleted first (its timeout changes): the service must
        // stay in the transaction that deletes it (the sync's last step). Per-service names
        // are unique to their service port, so only its own old objects can hold the name.
        let recreated = |set: &String, timeout: &u64| {
            existing
                .owned
                .get(self.name)
                .and_then(|owned| owned.affinity_sets.get(set))
                .is_some_and(|old| old != timeout)
                || existing
                    .foreign_sets
                    .get(set)
                    .is_some_and(|old| old.is_none_or(|old| old != *timeout))
        };
        let alone = !self.affinity_sets.iter().any(|(s, t)| recreated(s, t));
        ServiceCommands {
            chains,
            body,
            alone,
        }
    }

    /// What the state keeps of these objects once their commands are made: their names and
    /// claims (moved, not copied: a full sync holds every service's objects at its end).
    pub(super) fn into_objects(self) -> (ServicePortName, PortObjects) {
        let owned = OwnedObjects {
            chains: self.chains.into_iter().map(|(chain, _)| chain).collect(),
            affinity_sets: self.affinity_sets,
        };
        (self.name.clone(), (owned, self.elements))
    }
}

/// A service port's chain names ([`ServiceChains`]), each allocated once and shared by the
/// commands creating and referring to it.
struct SharedChains {
    service: Name,
    local: Name,
    external: Name,
    firewall: Name,
}

impl SharedChains {
    fn new(name: &ServicePortName) -> Self {
        let chains = ServiceChains::new(name);
        Self {
            service: (&chains.service).into(),
            local: (&chains.local).into(),
            external: (&chains.external).into(),
            firewall: (&chains.firewall).into(),
        }
    }
}

/// An endpoint's object names ([`EndpointNames`]), shared like [`SharedChains`].
#[derive(Clone)]
struct SharedEndpointNames {
    chain: Name,
    affinity_set: Name,
}

impl SharedEndpointNames {
    fn new(name: &ServicePortName, ip: IpAddr, port: u16) -> Self {
        let names = EndpointNames::new(name, ip, port);
        Self {
            chain: (&names.chain).into(),
            affinity_set: (&names.affinity_set).into(),
        }
    }
}

/// Writes one service port's plan as nftables objects, one part of the plan a method.
struct Writer<'a, 'e> {
    ctx: &'a Context<'a>,
    plan: ServicePlan<'e>,
    name: &'a ServicePortName,
    /// The comment of its no-endpoint and firewall elements: `name`, as nft takes it.
    comment: String,
    cluster_ip: IpAddr,
    svc: &'a ServicePort,
    chains: SharedChains,
    /// Every endpoint with a chain, each once.
    reachable: Vec<&'e Endpoint>,
    /// The names of the `reachable` endpoints' objects.
    endpoint_names: BTreeMap<(IpAddr, u16), SharedEndpointNames>,
}

impl<'a, 'e> Writer<'a, 'e> {
    fn new(
        ctx: &'a Context<'a>,
        plan: ServicePlan<'e>,
        name: &'a ServicePortName,
        cluster_ip: IpAddr,
        svc: &'a ServicePort,
    ) -> Self {
        // Endpoint chains: every endpoint reachable from here, and (belt and braces, as they
        // are part of it) every endpoint a policy chain written below points at.
        let cat = &plan.endpoints;
        let mut reachable: Vec<&Endpoint> = cat.all_reachable.clone();
        if plan.uses_cluster_chain {
            reachable.extend(&cat.cluster);
        }
        if plan.uses_local_chain {
            reachable.extend(&cat.local);
        }
        let reachable = dedup_endpoints(&reachable);
        let endpoint_names = reachable
            .iter()
            .map(|ep| {
                (
                    (ep.ip, ep.port),
                    SharedEndpointNames::new(name, ep.ip, ep.port),
                )
            })
            .collect();
        Self {
            ctx,
            plan,
            name,
            comment: comment_text(&name.to_string()),
            cluster_ip,
            svc,
            chains: SharedChains::new(name),
            reachable,
            endpoint_names,
        }
    }

    /// The object names of endpoint `ep`.
    fn names_of(&self, ep: &Endpoint) -> Cow<'_, SharedEndpointNames> {
        match self.endpoint_names.get(&(ep.ip, ep.port)) {
            Some(names) => Cow::Borrowed(names),
            None => Cow::Owned(SharedEndpointNames::new(self.name, ep.ip, ep.port)),
        }
    }

    /// The chain of an endpoint list.
    fn policy_chain(&self, list: EndpointList) -> &Name {
        match list {
            EndpointList::Local => &self.chains.local,
            EndpointList::Cluster => &self.chains.service,
        }
    }

    /// An element of this service port; a comment names it where nft shows it (the
    /// no-endpoint and firewall maps).
    fn element(
        &self,
        set: ElementSet,
        key: ElementKey,
        verdict: Option<&Verdict>,
        with_comment: bool,
    ) -> Element {
        let value = ElementValue {
            verdict: verdict.cloned(),
            comment: with_comment.then(|| self.comment.clone()),
        };
        (set, key, value)
    }

    /// `address . protocol . port` of this service port.
    fn key(&self, addr: IpAddr) -> ElementKey {
        ElementKey::new(KeyParts::AddrProtoPort(
            addr,
            self.name.protocol,
            self.svc.port,
        ))
    }

    /// The dispatch elements: the ClusterIP's, then the external destinations'.
    fn elements(&self) -> Vec<Element> {
        let mut out = vec![self.element(
            ElementSet::ClusterIps,
            ElementKey::new(KeyParts::Addr(self.cluster_ip)),
            None,
            false,
        )];
        let key = self.key(self.cluster_ip);
        out.push(match no_endpoints(self.plan.internal_filter) {
            None => {
                let policy = Verdict::Goto(self.policy_chain(self.plan.internal.list).clone());
                self.element(ElementSet::ServiceIps, key, Some(&policy), false)
            }
            Some(verdict) => {
                self.element(ElementSet::NoEndpointServices, key, Some(&verdict), true)
            }
        });
        self.external_elements(&mut out);
        out
    }

    /// The external destinations' elements: externalIPs, LoadBalancer IPs (with the
    /// firewall's), NodePort; each goes to the external chain when it is written, and to the
    /// no-endpoint map when external traffic is filtered.
    fn external_elements(&self, out: &mut Vec<Element>) {
        let uses_external_chain = self.plan.uses_external_chain;
        let filter = no_endpoints(self.plan.external_filter);
        let goto_external = Verdict::Goto(self.chains.external.clone());
        let service_ips = |key: ElementKey| {
            self.element(ElementSet::ServiceIps, key, Some(&goto_external), false)
        };
        let no_endpoint = |key: ElementKey, verdict: &Verdict| {
            self.element(ElementSet::NoEndpointServices, key, Some(verdict), true)
        };
        for external_ip in &self.svc.external_ips {
            if uses_external_chain {
                out.push(service_ips(self.key(*external_ip)));
            }
            if let Some(verdict) = &filter {
                out.push(no_endpoint(self.key(*external_ip), verdict));
            }
        }
        for lb_ip in &self.svc.load_balancer_ips {
            if uses_external_chain {
                out.push(service_ips(self.key(*lb_ip)));
            }
            if self.plan.source_ranges {
                let firewall = Verdict::Goto(self.chains.firewall.clone());
                out.push(self.element(
                    ElementSet::FirewallIps,
                    self.key(*lb_ip),
                    Some(&firewall),
                    true,
                ));
            }
            if let Some(verdict) = &filter {
                out.push(no_endpoint(self.key(*lb_ip), verdict));
            }
        }
        // NodePorts are not subject to loadBalancerSourceRanges, as upstream.
        if let Some(node_port) = self.svc.node_port {
            let key = ElementKey::new(KeyParts::ProtoPort(self.name.protocol, node_port));
            if uses_external_chain {
                out.push(self.element(
                    ElementSet::ServiceNodePorts,
                    key.clone(),
                    Some(&goto_external),
                    false,
                ));
            }
            if let Some(verdict) = &filter {
                out.push(self.element(
                    ElementSet::NoEndpointNodePorts,
                    key.clone(),
                    Some(verdict),
                    true,
                ));
            }
            // KEP-6032: whatever the endpoints, its localhost traffic is refused.
            if self.ctx.localhost_rejects.contains(&self.name.protocol) {
                out.push(self.element(ElementSet::NodePortLocalhostReject, key, None, false));
            }
        }
    }

    /// The policy chains balancing over the endpoint chains: the Cluster list's, then the
    /// Local list's, as far as they are written.
    fn policy_chains(&self) -> Vec<Chain> {
        let cat = &self.plan.endpoints;
        let mut out = Vec::new();
        if self.plan.uses_cluster_chain {
            out.push(self.balance(&self.chains.service, &cat.cluster));
        }
        if self.plan.uses_local_chain {
            out.push(self.balance(&self.chains.local, &cat.local));
        }
        out
    }

    /// The ClusterIP masquerade rule of the internal policy chain: traffic that does not come
    /// from a local pod (all of it with masqueradeAll); without a detector pod traffic cannot
    /// be told apart, so none is.
    fn internal_masquerade(&self) -> Option<Rule> {
        let to_cluster_ip = addr_is(AddrField::Destination, self.cluster_ip);
        match self.plan.internal_masquerade {
            InternalMasquerade::All => Some(jump(vec![to_cluster_ip], MARK_FOR_MASQUERADE)),
            InternalMasquerade::NotLocal => self.ctx.detector.as_ref().map(|d| {
                jump(
                    vec![to_cluster_ip, d.if_not_local.clone()],
                    MARK_FOR_MASQUERADE,
                )
            }),
            InternalMasquerade::None => None,
        }
    }

    /// A policy chain: the internal masquerade rule (in the internal policy's chain), the
    /// affinity rules, then an endpoint picked at random.
    fn balance(&self, chain: &Name, eps: &[&Endpoint]) -> Chain {
        let mut rules = Vec::new();
        if chain == self.policy_chain(self.plan.internal.list)
            && let Some(masquerade) = self.internal_masquerade()
        {
            rules.push(masquerade);
        }
        let targets = dedup_endpoints(eps);
        if self.plan.affinity_seconds.is_some() {
            for ep in &targets {
                let names = self.names_of(ep);
                rules.push(goto(
                    vec![addr_in_set(AddrField::Source, names.affinity_set.clone())],
                    names.chain.clone(),
                ));
            }
        }
        if targets.len() > MAX_CASCADE_ENDPOINTS {
            let arms: Vec<Name> = targets
                .iter()
                .map(|ep| self.names_of(ep).chain.clone())
                .collect();
            rules.push(Rule::new(Vec::new(), Action::NumgenVmap(arms)));
        } else {
            // Endpoint i of n is taken with probability 1/(n-i) once the ones before it
            // were passed over, which is 1/n overall; the last one takes the rest.
            let count = targets.len();
            for (i, ep) in targets.iter().enumerate() {
                let target = self.names_of(ep).chain.clone();
                if i + 1 == count {
                    rules.push(goto(Vec::new(), target));
                } else {
                    let modulus = u32::try_from(count - i).unwrap_or(u32::MAX);
                    rules.push(goto(vec![Match::Numgen { modulus, value: 0 }], target));
                }
            }
        }
        (chain.clone(), rules)
    }

    /// The external chain: masquerade (or short-circuit) as the plan says, then the external
    /// policy's chain.
    fn external_chain(&self) -> Chain {
        let saddr = AddrField::Source;
        let mut rules = Vec::new();
        match self.plan.external_masquerade {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            ExternalMasquerade::Always => rules.push(jump(Vec::new(), MARK_FOR_MASQUERADE)),
            ExternalMasquerade::ShortCircuit { pods } => {
                let service = &self.chains.service;
                if let Some(detector) = self.ctx.detector.as_ref().filter(|_| pods) {
                    // Pods reaching an external IP get any endpoint, unmasqueraded, as if the
                    // traffic had gone out to the load balancer and come back.
                    rules.push(
                        goto(vec![detector.if_local.clone()], service.clone())
                            .with_comment(comment_text("short-circuit pod traffic")),
                    );
                }
                // The node itself: its source address would not route back from another node.
                rules.push(
                    jump(vec![Match::FibLocal(saddr)], MARK_FOR_MASQUERADE)
                        .with_comment(comment_text("masquerade local traffic")),
                );
                rules.push(
                    goto(vec![Match::FibLocal(saddr)], service.clone())
                        .with_comment(comment_text("short-circuit local traffic")),
                );
            }
            ExternalMasquerade::Never => {}
        }
        if self.plan.external.has_endpoints {
            rules.push(goto(
                Vec::new(),
                self.policy_chain(self.plan.external.list).clone(),
            ));
        }
        (self.chains.external.clone(), rules)
    }

    /// The firewall chain: drop sources outside loadBalancerSourceRanges.
    fn firewall_chain(&self) -> Chain {
        let svc = self.svc;
        let mut sources: Vec<IpNet> = svc
            .load_balancer_source_ranges
            .iter()
            .map(IpNet::trunc)
            .collect();
        if self.plan.allow_from_node {
            // The LB VIP is often a local address, so the node's own traffic to it has the
            // VIP as source.
            sources.extend(svc.load_balancer_ips.iter().map(|ip| IpNet::from(*ip)));
        }
        // Overlapping entries are merged: older nft rejects overlapping set intervals.
        let outside = Match::AddrIn {
            field: AddrField::Source,
            negate: true,
            nets: IpNet::aggregate(&sources),
        };
        let drop = Rule::verdict(vec![outside], Verdict::Drop);
        (self.chains.firewall.clone(), vec![drop])
    }

    /// The endpoint chains (hairpin masquerade, affinity, DNAT) and their affinity sets.
    fn endpoint_chains(&self) -> (Vec<Chain>, BTreeMap<String, u64>) {
        let affinity = self.plan.affinity_seconds;
        let mut chains = Vec::with_capacity(self.reachable.len());
        let mut affinity_sets = BTreeMap::new();
        for ep in &self.reachable {
            let names = self.names_of(ep);
            if let Some(seconds) = affinity {
                affinity_sets.insert(names.affinity_set.to_string(), seconds);
            }
            let mut rules = vec![
                // Hairpin: an endpoint reaching itself through the service must be
                // masqueraded, or it would answer itself directly.
                jump(vec![addr_is(AddrField::Source, ep.ip)], MARK_FOR_MASQUERADE),
            ];
            if affinity.is_some() {
                rules.push(Rule::new(
                    Vec::new(),
                    Action::UpdateSourceSet(names.affinity_set.clone()),
                ));
            }
            rules.push(Rule::new(
                vec![Match::L4Proto(self.name.protocol)],
                Action::Dnat {
                    addr: ep.ip,
                    port: ep.port,
                },
            ));
            chains.push((names.chain.clone(), rules));
        }
        (chains, affinity_sets)
    }
}

/// The verdict of the no-endpoint maps for a filter of the plan.
fn no_endpoints(filter: Option<NoEndpoints>) -> Option<Verdict> {
    filter.map(|filter| match filter {
        NoEndpoints::Reject => Verdict::Goto(REJECT_CHAIN.into()),
        NoEndpoints::Drop => Verdict::Drop,
    })
}

/// Endpoints in the given order, each `ip:port` once (a duplicate would be a second chain of
/// the same name).
fn dedup_endpoints<'e>(eps: &[&'e Endpoint]) -> Vec<&'e Endpoint> {
    let mut seen = BTreeSet::new();
    eps.iter()
        .copied()
        .filter(|ep| seen.insert((ep.ip, ep.port)))
        .collect()
}
