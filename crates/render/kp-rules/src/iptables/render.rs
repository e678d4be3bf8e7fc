//! The restore input for one sync, following upstream's `syncProxyRules` layout, as typed
//! [`Rule`]s sent to a [`RuleSink`].

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, Protocol, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;

use super::names::{EndpointChains, ServiceChains, is_service_chain};
use super::rule::{
    AddrType, AddrTypeSide, Address, Comment, CtStates, MarkOp, Match, Probability, RecentAction,
    RestoreHead, RestoreTail, RestoreText, Rule, RuleSink, Table, Target,
};
use super::{
    Detector, KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_MARK_MASQ, KUBE_NODEPORTS,
    KUBE_POSTROUTING, KUBE_PROXY_FIREWALL, KUBE_SERVICES, NodePortAddresses, RenderConfig,
    RenderError, RenderOutput, StreamError, SyncScope,
};
use crate::family::{family_endpoints, for_family};
use crate::plan::{
    EndpointList, ExternalMasquerade, InternalMasquerade, Masquerading, NoEndpoints, ServicePlan,
};

/// IPv4 loopback (127.0.0.0/8), where localhost NodePorts arrive.
pub(super) fn ipv4_loopback() -> Address {
    Address::Net(IpNet::V4(
        Ipv4Net::new(Ipv4Addr::new(127, 0, 0, 0), 8).unwrap_or_default(),
    ))
}

/// IPv6 loopback (::1/128), never a NodePort address.
fn ipv6_loopback() -> Address {
    Address::Net(IpNet::V6(
        Ipv6Net::new(Ipv6Addr::LOCALHOST, 128).unwrap_or_default(),
    ))
}

/// Upstream's `--probability` for the i-th of n remaining endpoints: `1/n` with 10 decimals
/// (see [`Probability`]).
pub fn probability(n: usize) -> String {
    Probability::one_in(n).to_string()
}

/// Rule counts of one table.
#[derive(Default)]
struct Counts {
    /// Rules sent to the sink.
    written: usize,
    /// Rules in place once applied, including those of chains left as they were.
    total: usize,
}

/// The sink with per-table counts.
struct Out<'s, S: ?Sized> {
    sink: &'s mut S,
    filter: Counts,
    nat: Counts,
}

impl<S: RuleSink + ?Sized> Out<'_, S> {
    fn counts(&mut self, table: Table) -> &mut Counts {
        match table {
            Table::Filter => &mut self.filter,
            // The renderer writes only filter and nat.
            Table::Nat | Table::Mangle => &mut self.nat,
        }
    }

    fn chain(&mut self, table: Table, chain: &str) {
        self.sink.chain(table, chain);
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        let counts = self.counts(table);
        counts.written += 1;
        counts.total += 1;
        self.sink.rule(table, rule);
    }

    fn filter(&mut self, rule: Rule<'_>) {
        self.rule(Table::Filter, rule);
    }

    fn nat(&mut self, rule: Rule<'_>) {
        self.rule(Table::Nat, rule);
    }
}

/// A service's own nat chains: sent to the sink, or, when a partial sync leaves them alone,
/// only counted (no rule is even built).
struct Own<'o, 's, S: ?Sized> {
    out: &'o mut Out<'s, S>,
    write: bool,
}

impl<S: RuleSink + ?Sized> Own<'_, '_, S> {
    fn chain(&mut self, name: &str) {
        if self.write {
            self.out.chain(Table::Nat, name);
        }
    }

    /// One rule, built by `make` only when written.
    fn rule<'r>(&mut self, make: impl FnOnce() -> Rule<'r>) {
        if self.write {
            self.out.nat(make());
        } else {
            self.out.nat.total += 1;
        }
    }
}

/// Settings shared by every service of one render.
struct Context<'a> {
    family: IpFamily,
    config: &'a RenderConfig,
    detector: Option<Detector>,
    large_cluster: bool,
    /// This node's IP of `family`, for each plan's [`ServicePlan::allow_from_node`].
    node_ip: Option<IpAddr>,
}

/// Render the restore input for `family`.
///
/// The filter table and nat's top-level chains are always rewritten in full; per-service nat
/// chains only on full syncs or for services in `scope.changed`. Chains in
/// `scope.existing_chains` that no service produces any more are flushed and deleted.
///
/// A partial sync formats no rule text for the chains it leaves alone: it only counts their
/// rules and derives their names (for [`RenderOutput::chains`]).
pub fn render(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &SyncScope<'_>,
) -> Result<RenderOutput, RenderError> {
    let mut text = RestoreText::default();
    let mut output = render_into(state, family, config, scope, &mut text)?;
    output.text = text.finish();
    Ok(output)
}

/// How much restore text [`render_to`] hands its writer at a time: big enough that a pipe
/// write is one system call per pipe buffer (64 KiB on Linux), small enough not to matter.
pub const DEFAULT_CHUNK_BYTES: usize = 64 * 1024;

/// [`render`], writing the restore input to `out` in chunks of [`DEFAULT_CHUNK_BYTES`] as
/// it is produced instead of returning it: the same bytes, but the whole text (tens of MB at
/// 10,000 services) never exists at once. The returned bookkeeping's `text` is empty.
///
/// `iptables-restore` needs a table's chains declared before its rules, and the renderer
/// declares chains as it goes (stale ones at the very end), so this renders twice: the first
/// pass keeps the filter table and every chain declaration (a few MB at 10,000 services)
/// and writes them; the second writes nat's rules and deletions line by line, then `COMMIT`.
/// On a write error nothing more is written and the error is returned: the caller must not
/// let a consumer commit the truncated input (it lacks the last `COMMIT` anyway).
pub fn render_to<W: std::io::Write + ?Sized>(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &SyncScope<'_>,
    out: &mut W,
) -> Result<RenderOutput, StreamError> {
    let mut out = std::io::BufWriter::with_capacity(DEFAULT_CHUNK_BYTES, out);
    let mut head = RestoreHead {
        streamed: Table::Nat,
        text: RestoreText::default(),
    };
    render_into(state, family, config, scope, &mut head)?;
    if !head.text.ends_with(Table::Nat) {
        // Not the layout this renderer makes; keep the bytes right rather than streaming.
        let output = render(state, family, config, scope)?;
        out.write_all(output.text.as_bytes())?;
        out.flush()?;
        return Ok(RenderOutput {
            text: String::new(),
            ..output
        });
    }
    head.text.write_open(&mut out)?;
    drop(head);
    let mut tail = RestoreTail {
        table: Table::Nat,
        out: &mut out,
        line: String::new(),
        error: None,
    };
    let output = render_into(state, family, config, scope, &mut tail)?;
    if let Some(err) = tail.error {
        return Err(err.into());
    }
    out.write_all(b"COMMIT\n")?;
    out.flush()?;
    Ok(output)
}

/// [`render`], sending the typed rules to `sink` instead of formatting them: the returned
/// bookkeeping's `text` is empty.
///
/// Calls arrive as [`RuleSink`] describes (render order, tables interleaved). A partial sync
/// builds no [`Rule`] at all for the chains it leaves alone.
pub fn render_into<S: RuleSink + ?Sized>(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &SyncScope<'_>,
    sink: &mut S,
) -> Result<RenderOutput, RenderError> {
    let mark = config.masquerade_mark()?;
    let detector = Detector::new(&config.local_detector, family)?;
    let services = service_ports(state, family);
    let total_endpoints: usize = services
        .iter()
        .map(|(_, _, _, eps)| {
            eps.iter()
                .filter(|ep| IpFamily::of(&ep.ip) == family)
                .count()
        })
        .sum();
    let ctx = Context {
        family,
        config,
        detector,
        large_cluster: total_endpoints > config.large_cluster_threshold,
        node_ip: super::node_ip(&config.node_ips, &state.node, family),
    };

    let mut out = Out {
        sink,
        filter: Counts::default(),
        nat: Counts::default(),
    };
    fixed_chains(&mut out, mark, config.random_fully);
    // The localnet DROP of `route_localnet` goes into the kubelet's `KUBE-FIREWALL`, which the
    // restore must never flush: see `setup::SharedRule`.

    let mut active: Vec<String> = Vec::new();
    for (name, cluster_ip, port, all) in &services {
        let endpoints = family_endpoints(all, family);
        let write = match scope.kind {
            SyncKind::Full => true,
            SyncKind::Partial => scope.changed.contains(&name.service),
        };
        render_service(
            &ctx,
            &state.node,
            name,
            *cluster_ip,
            port,
            &endpoints,
            &mut out,
            write,
            &mut active,
        );
        out.sink.service_done();
    }
    let (active, deleted) = active_and_stale(active, scope.existing_chains);
    for chain in &deleted {
        out.chain(Table::Nat, chain);
        out.sink.delete_chain(Table::Nat, chain);
    }

    render_nodeport_dispatch(&ctx, &mut out);
    forward_rules(&mut out, mark, config.drop_invalid);

    Ok(RenderOutput {
        text: String::new(),
        chains: active,
        deleted,
        rules_written: out.filter.written + out.nat.written,
        filter_rules: out.filter.total,
        nat_rules: out.nat.total,
        large_cluster: ctx.large_cluster,
    })
}

/// A service port of `family`: its name, ClusterIP, the port (that family's view) and all
/// its endpoints.
type FamilyPort<'s> = (&'s ServicePortName, IpAddr, ServicePort, &'s [Endpoint]);

/// Each service port of `family` with its endpoints: both maps are sorted by name, so one
/// merge walk pairs them (no lookup per service).
fn service_ports(state: &ProxyState, family: IpFamily) -> Vec<FamilyPort<'_>> {
    let mut endpoint_lists = state.endpoints.iter().peekable();
    state
        .services
        .iter()
        .filter_map(|(name, svc)| {
            while endpoint_lists.next_if(|(key, _)| *key < name).is_some() {}
            let all = endpoint_lists
                .next_if(|(key, _)| *key == name)
                .map_or(&[][..], |(_, list)| list.as_slice());
            let (ip, port) = for_family(svc, family)?;
            Some((name, ip, port, all))
        })
        .collect()
}

/// The fixed chains, and the masquerading rules: only marked packets, the mark cleared so a
/// packet that re-traverses the stack is not masqueraded twice.
fn fixed_chains<S: RuleSink + ?Sized>(out: &mut Out<'_, S>, mark: u32, random_fully: bool) {
    for chain in [
        KUBE_SERVICES,
        KUBE_EXTERNAL_SERVICES,
        KUBE_FORWARD,
        KUBE_NODEPORTS,
        KUBE_PROXY_FIREWALL,
    ] {
        out.chain(Table::Filter, chain);
    }
    for chain in [
        KUBE_SERVICES,
        KUBE_NODEPORTS,
        KUBE_POSTROUTING,
        KUBE_MARK_MASQ,
    ] {
        out.chain(Table::Nat, chain);
    }
    out.nat(
        Rule::new(KUBE_POSTROUTING)
            .with(Match::Mark {
                value: mark,
                mask: mark,
                negated: true,
            })
            .target(Target::Return),
    );
    out.nat(Rule::new(KUBE_POSTROUTING).target(Target::Mark(MarkOp::Xor(mark))));
    out.nat(
        Rule::new(KUBE_POSTROUTING)
            .comment("kubernetes service traffic requiring SNAT")
            .target(Target::Masquerade { random_fully }),
    );
    out.nat(Rule::new(KUBE_MARK_MASQ).target(Target::Mark(MarkOp::Or(mark))));
}

/// The per-service chains in use (`active`, as the services reported them) as a set, and
/// the stale ones of `existing`. Sorted once by integer keys (the names are short ASCII), the
/// stale chains found with one merge walk, then the set bulk-built from the sorted names.
/// Declaring the stale chains flushes them (dropping their jumps to other stale chains)
/// before any `-X` runs.
fn active_and_stale(
    active: Vec<String>,
    existing: &BTreeSet<String>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut active: Vec<(ChainKey, String)> = active
        .into_iter()
        .map(|chain| (ChainKey::of(&chain), chain))
        .collect();
    active.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    active.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
    let deleted: BTreeSet<String> = stale_chains(existing, &active).cloned().collect();
    let active: BTreeSet<String> = active.into_iter().map(|(_, chain)| chain).collect();
    (active, deleted)
}

/// filter `KUBE-FORWARD`: marked traffic is service traffic, forwarded even when FORWARD's
/// policy is DROP, as are its established connections.
fn forward_rules<S: RuleSink + ?Sized>(out: &mut Out<'_, S>, mark: u32, drop_invalid: bool) {
    if drop_invalid {
        out.filter(
            Rule::new(KUBE_FORWARD)
                .with(Match::Conntrack {
                    states: CtStates::INVALID,
                    negated: false,
                })
                .target(Target::Drop),
        );
    }
    out.filter(
        Rule::new(KUBE_FORWARD)
            .comment("kubernetes forwarding rules")
            .with(Match::Mark {
                value: mark,
                mask: mark,
                negated: false,
            })
            .target(Target::Accept),
    );
    out.filter(
        Rule::new(KUBE_FORWARD)
            .comment("kubernetes forwarding conntrack rule")
            .with(Match::Conntrack {
                states: CtStates::RELATED | CtStates::ESTABLISHED,
                negated: false,
            })
            .target(Target::Accept),
    );
}

/// A chain name's first 32 bytes, zero-padded, as two big-endian integers: for names
/// without NUL bytes, comparing keys orders like comparing the names, up to ties between
/// names that share their first 32 bytes (ours are at most 25).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct ChainKey(u128, u128);

impl ChainKey {
    fn of(chain: &str) -> Self {
        let mut bytes = [0u8; 32];
        let n = chain.len().min(32);
        bytes[..n].copy_from_slice(&chain.as_bytes()[..n]);
        let (high, low) = bytes.split_at(16);
        Self(
            u128::from_be_bytes(high.try_into().expect("16 bytes")),
            u128::from_be_bytes(low.try_into().expect("16 bytes")),
        )
    }
}

/// The per-service chains of `existing` (ours by prefix) that are not in `active` (sorted
/// by key, then name, without duplicates), in order.
fn stale_chains<'e>(
    existing: &'e BTreeSet<String>,
    active: &[(ChainKey, String)],
) -> impl Iterator<Item = &'e String> {
    let mut at = 0;
    existing.iter().filter(move |chain| {
        if !is_service_chain(chain) {
            return false;
        }
        let key = ChainKey::of(chain);
        let order = |entry: &(ChainKey, String)| {
            entry.0.cmp(&key).then_with(|| {
                // Equal keys and lengths within the key: equal names (no byte compare).
                if entry.1.len() == chain.len() && chain.len() <= 32 {
                    std::cmp::Ordering::Equal
                } else {
                    entry.1.as_str().cmp(chain.as_str())
                }
            })
        };
        while active
            .get(at)
            .is_some_and(|entry| order(entry) == std::cmp::Ordering::Less)
        {
            at += 1;
        }
        active
            .get(at)
            .is_none_or(|entry| order(entry) != std::cmp::Ordering::Equal)
    })
}

/// The last rule(s) of nat `KUBE-SERVICES`: traffic to a node address goes on to
/// `KUBE-NODEPORTS`. It must come after every service IP rule.
fn render_nodeport_dispatch<S: RuleSink + ?Sized>(ctx: &Context<'_>, out: &mut Out<'_, S>) {
    let comment = "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
    let ipv4 = ctx.family == IpFamily::V4;
    match &ctx.config.node_port_addresses.for_family(ctx.family) {
        NodePortAddresses::All => {
            let rule = Rule::new(KUBE_SERVICES)
                .comment(comment)
                .with(Match::AddrType {
                    side: AddrTypeSide::Destination,
                    addr_type: AddrType::Local,
                });
            let not_loopback = |addr| Match::Destination {
                addr,
                negated: true,
            };
            let rule = if !ipv4 {
                rule.with(not_loopback(ipv6_loopback()))
            } else if !ctx.config.localhost_node_ports {
                rule.with(not_loopback(ipv4_loopback()))
            } else {
                rule
            };
            out.nat(rule.jump(KUBE_NODEPORTS));
        }
        NodePortAddresses::Ips(ips) => {
            let mut seen = BTreeSet::new();
            for ip in ips.iter().filter(|ip| IpFamily::of(ip) == ctx.family) {
                let loopback_ok = ipv4 && ctx.config.localhost_node_ports;
                if (ip.is_loopback() && !loopback_ok) || !seen.insert(*ip) {
                    continue;
                }
                out.nat(
                    Rule::new(KUBE_SERVICES)
                        .comment(comment)
                        .with(Match::Destination {
                            addr: Address::Ip(*ip),
                            negated: false,
                        })
                        .jump(KUBE_NODEPORTS),
                );
            }
        }
    }
}

/// `-m proto -p proto -d ip --dport port`.
fn to(protocol: Protocol, ip: IpAddr, port: u16) -> [Match<'static>; 3] {
    [
        Match::Protocol(protocol),
        Match::Destination {
            addr: Address::Ip(ip),
            negated: false,
        },
        Match::DestinationPort(port),
    ]
}

/// `{display}{after}`.
fn about<'a>(display: &'a str, after: &'a str) -> Comment<'a> {
    Comment::Service {
        before: "",
        service: display,
        after,
    }
}

/// `{before}{display}{after}`.
fn around<'a>(before: &'a str, display: &'a str, after: &'a str) -> Comment<'a> {
    Comment::Service {
        before,
        service: display,
        after,
    }
}

/// The filter rule's target and comment for traffic without endpoints.
type NoEndpointsRule<'a> = (Target<'static>, Comment<'a>);

/// The [`NoEndpointsRule`] of `verdict`.
fn no_endpoints(display: &str, verdict: NoEndpoints) -> NoEndpointsRule<'_> {
    match verdict {
        NoEndpoints::Reject => (Target::Reject(None), about(display, " has no endpoints")),
        NoEndpoints::Drop => (Target::Drop, about(display, " has no local endpoints")),
    }
}

/// Everything for one service port: its filter rules, its dispatch rules in nat
/// `KUBE-SERVICES`/`KUBE-NODEPORTS`, and its own chains (sent right after its dispatch rules
/// when `write`, else only counted). Its own chains' names go to `active`.
#[allow(clippy::too_many_arguments)]
fn render_service<S: RuleSink + ?Sized>(
    ctx: &Context<'_>,
    node: &kp_core::model::NodeInfo,
    name: &ServicePortName,
    cluster_ip: IpAddr,
    svc: &ServicePort,
    endpoints: &[Endpoint],
    out: &mut Out<'_, S>,
    write: bool,
    active: &mut Vec<String>,
) {
    let plan = ServicePlan::new(
        svc,
        endpoints,
        node,
        ctx.node_ip,
        Masquerading {
            all: ctx.config.masquerade_all,
            detector: ctx.detector.is_some(),
        },
    );
    let service = ServiceRules {
        ctx,
        plan,
        name,
        display: name.to_string(),
        cluster_ip,
        svc,
        chains: ServiceChains::new(name),
    };
    service.dispatch(out);
    // The service's own chains, right after its dispatch rules.
    let mut own = Own { out, write };
    service.internal_masquerade(&mut own);
    if service.plan.uses_external_chain {
        service.external_chain(&mut own, active);
    }
    if service.plan.uses_firewall_chain {
        service.firewall_chain(&mut own, active);
    }
    service.endpoint_chains(&mut own, active);
}

/// One service port's rules, in the parts of its plan: the dispatch rules ([`Self::dispatch`]),
/// then its own chains: the internal policy chain's masquerade rule, `KUBE-EXT-*`,
/// `KUBE-FW-*`, the policy chains balancing over `KUBE-SEP-*`, and those.
struct ServiceRules<'a, 'e> {
    ctx: &'a Context<'a>,
    plan: ServicePlan<'e>,
    name: &'a ServicePortName,
    /// `name` as comments show it.
    display: String,
    cluster_ip: IpAddr,
    svc: &'a ServicePort,
    chains: ServiceChains,
}

impl ServiceRules<'_, '_> {
    /// The chain of an endpoint list: `KUBE-SVC-*` or `KUBE-SVL-*`.
    fn policy_chain(&self, list: EndpointList) -> &str {
        match list {
            EndpointList::Cluster => &self.chains.svc,
            EndpointList::Local => &self.chains.svl,
        }
    }

    /// `ip:port` of this service port's protocol.
    fn to(&self, ip: IpAddr, port: u16) -> [Match<'static>; 3] {
        to(self.name.protocol, ip, port)
    }

    fn cluster_comment(&self) -> Comment<'_> {
        about(&self.display, " cluster IP")
    }

    fn lb_comment(&self) -> Comment<'_> {
        about(&self.display, " loadbalancer IP")
    }

    /// The dispatch rules in nat `KUBE-SERVICES`/`KUBE-NODEPORTS` and the filter rules for
    /// traffic without endpoints, per address: ClusterIP, externalIPs, LoadBalancer IPs,
    /// NodePort, and the health check node port.
    fn dispatch<S: RuleSink + ?Sized>(&self, out: &mut Out<'_, S>) {
        let external_filter = self
            .plan
            .external_filter
            .map(|v| no_endpoints(&self.display, v));
        self.dispatch_cluster_ip(out);
        self.dispatch_external_ips(out, external_filter.as_ref());
        self.dispatch_load_balancer_ips(out, external_filter.as_ref());
        self.dispatch_node_port(out, external_filter.as_ref());
        self.accept_health_checks(out);
    }

    /// ClusterIP: on to the internal policy chain, or rejected or dropped in filter when
    /// that chain is not written.
    fn dispatch_cluster_ip<S: RuleSink + ?Sized>(&self, out: &mut Out<'_, S>) {
        let to = self.to(self.cluster_ip, self.svc.port);
        match self
            .plan
            .internal_filter
            .map(|v| no_endpoints(&self.display, v))
        {
            None => out.nat(
                Rule::new(KUBE_SERVICES)
                    .comment(self.cluster_comment())
                    .with_all(to)
                    .jump(self.policy_chain(self.plan.internal.list)),
            ),
            Some((target, comment)) => out.filter(
                Rule::new(KUBE_SERVICES)
                    .comment(comment)
                    .with_all(to)
                    .target(target),
            ),
        }
    }

    /// externalIPs: on to `KUBE-EXT-*`; `external_filter` rejects or drops without endpoints.
    fn dispatch_external_ips<S: RuleSink + ?Sized>(
        &self,
        out: &mut Out<'_, S>,
        external_filter: Option<&NoEndpointsRule<'_>>,
    ) {
        for ip in &self.svc.external_ips {
            if self.plan.uses_external_chain {
                out.nat(
                    Rule::new(KUBE_SERVICES)
                        .comment(about(&self.display, " external IP"))
                        .with_all(self.to(*ip, self.svc.port))
                        .jump(&self.chains.ext),
                );
            }
            if let Some(filter) = external_filter {
                self.filter_external(out, filter, *ip);
            }
        }
    }

    /// LoadBalancer ingress IPs: on to `KUBE-FW-*` (source ranges) or `KUBE-EXT-*`, with the
    /// filter rule that drops what the firewall chain did not accept; `external_filter`
    /// rejects or drops without endpoints.
    fn dispatch_load_balancer_ips<S: RuleSink + ?Sized>(
        &self,
        out: &mut Out<'_, S>,
        external_filter: Option<&NoEndpointsRule<'_>>,
    ) {
        let plan = &self.plan;
        let lb_chain = if plan.uses_firewall_chain {
            &self.chains.fw
        } else {
            &self.chains.ext
        };
        let not_accepted = format!(" traffic not accepted by {}", self.chains.fw);
        for ip in &self.svc.load_balancer_ips {
            if plan.uses_external_chain {
                out.nat(
                    Rule::new(KUBE_SERVICES)
                        .comment(self.lb_comment())
                        .with_all(self.to(*ip, self.svc.port))
                        .jump(lb_chain),
                );
            }
            if plan.uses_firewall_chain {
                // Packets KUBE-FW-* accepted were DNATed and no longer match this.
                out.filter(
                    Rule::new(KUBE_PROXY_FIREWALL)
                        .comment(about(&self.display, &not_accepted))
                        .with_all(self.to(*ip, self.svc.port))
                        .target(Target::Drop),
                );
            }
        }
        if let Some(filter) = external_filter {
            for ip in &self.svc.load_balancer_ips {
                self.filter_external(out, filter, *ip);
            }
        }
    }

    /// The filter rule in `KUBE-EXTERNAL-SERVICES` for external traffic to `ip` without
    /// endpoints.
    fn filter_external<S: RuleSink + ?Sized>(
        &self,
        out: &mut Out<'_, S>,
        (target, comment): &NoEndpointsRule<'_>,
        ip: IpAddr,
    ) {
        out.filter(
            Rule::new(KUBE_EXTERNAL_SERVICES)
                .comment(comment.clone())
                .with_all(self.to(ip, self.svc.port))
                .target(target.clone()),
        );
    }

    /// NodePort (not subject to loadBalancerSourceRanges, as upstream): on to `KUBE-EXT-*`
    /// from `KUBE-NODEPORTS`; `external_filter` rejects or drops without endpoints.
    fn dispatch_node_port<S: RuleSink + ?Sized>(
        &self,
        out: &mut Out<'_, S>,
        external_filter: Option<&NoEndpointsRule<'_>>,
    ) {
        let Some(node_port) = self.svc.node_port else {
            return;
        };
        let protocol = self.name.protocol;
        if self.plan.uses_external_chain {
            out.nat(
                Rule::new(KUBE_NODEPORTS)
                    .comment(self.display.as_str())
                    .with(Match::Protocol(protocol))
                    .with(Match::DestinationPort(node_port))
                    .jump(&self.chains.ext),
            );
        }
        if let Some((target, comment)) = external_filter {
            out.filter(
                Rule::new(KUBE_EXTERNAL_SERVICES)
                    .comment(comment.clone())
                    .with(Match::AddrType {
                        side: AddrTypeSide::Destination,
                        addr_type: AddrType::Local,
                    })
                    .with(Match::Protocol(protocol))
                    .with(Match::DestinationPort(node_port))
                    .target(target.clone()),
            );
        }
    }

    /// healthCheckNodePort: always TCP, open whether or not local endpoints exist.
    fn accept_health_checks<S: RuleSink + ?Sized>(&self, out: &mut Out<'_, S>) {
        if let Some(hc_port) = self.svc.health_check_node_port {
            out.filter(
                Rule::new(KUBE_NODEPORTS)
                    .comment(about(&self.display, " health check node port"))
                    .with(Match::Protocol(Protocol::Tcp))
                    .with(Match::DestinationPort(hc_port))
                    .target(Target::Accept),
            );
        }
    }

    /// Masquerades ClusterIP traffic that does not come from a local pod (all of it with
    /// masqueradeAll), first in the internal policy chain.
    fn internal_masquerade<S: RuleSink + ?Sized>(&self, own: &mut Own<'_, '_, S>) {
        let unless = match self.plan.internal_masquerade {
            InternalMasquerade::All => None,
            InternalMasquerade::NotLocal => match &self.ctx.detector {
                Some(detector) => Some(detector.if_not_local()),
                None => return,
            },
            InternalMasquerade::None => return,
        };
        own.rule(|| {
            Rule::new(self.policy_chain(self.plan.internal.list))
                .comment(self.cluster_comment())
                .with_all(self.to(self.cluster_ip, self.svc.port))
                .with_all(unless)
                .jump(KUBE_MARK_MASQ)
        });
    }

    /// `KUBE-EXT-*`: how external traffic is masqueraded or short-circuited, then its policy
    /// chain.
    fn external_chain<S: RuleSink + ?Sized>(
        &self,
        own: &mut Own<'_, '_, S>,
        active: &mut Vec<String>,
    ) {
        let (ext, display) = (self.chains.ext.as_str(), self.display.as_str());
        own.chain(ext);
        active.push(self.chains.ext.clone());
        match self.plan.external_masquerade {
            ExternalMasquerade::Always => {
                // Endpoints may be on other nodes: masquerade so replies come back through us.
                own.rule(|| {
                    Rule::new(ext)
                        .comment(around(
                            "masquerade traffic for ",
                            display,
                            " external destinations",
                        ))
                        .jump(KUBE_MARK_MASQ)
                });
            }
            ExternalMasquerade::ShortCircuit { pods } => {
                if let (true, Some(detector)) = (pods, &self.ctx.detector) {
                    // Pods reaching an external IP of the service get any endpoint,
                    // unmasqueraded.
                    own.rule(|| {
                        Rule::new(ext)
                            .comment(around(
                                "pod traffic for ",
                                display,
                                " external destinations",
                            ))
                            .with(detector.if_local())
                            .jump(self.chains.svc.as_str())
                    });
                }
                // The node itself: masquerade (its source would not route back) and use any
                // endpoint.
                let from_node = Match::AddrType {
                    side: AddrTypeSide::Source,
                    addr_type: AddrType::Local,
                };
                own.rule(|| {
                    Rule::new(ext)
                        .comment(around(
                            "masquerade LOCAL traffic for ",
                            display,
                            " external destinations",
                        ))
                        .with(from_node.clone())
                        .jump(KUBE_MARK_MASQ)
                });
                own.rule(|| {
                    Rule::new(ext)
                        .comment(around(
                            "route LOCAL traffic for ",
                            display,
                            " external destinations",
                        ))
                        .with(from_node)
                        .jump(self.chains.svc.as_str())
                });
            }
            ExternalMasquerade::Never => {}
        }
        if self.plan.external.has_endpoints {
            own.rule(|| Rule::new(ext).jump(self.policy_chain(self.plan.external.list)));
        }
    }

    /// `KUBE-FW-*`: loadBalancerSourceRanges (and the node's own traffic to the VIP when a
    /// range admits the node) on to `KUBE-EXT-*`; the rest falls through.
    fn firewall_chain<S: RuleSink + ?Sized>(
        &self,
        own: &mut Own<'_, '_, S>,
        active: &mut Vec<String>,
    ) {
        let (fw, ext) = (self.chains.fw.as_str(), self.chains.ext.as_str());
        own.chain(fw);
        active.push(self.chains.fw.clone());
        let from = |addr| {
            Rule::new(fw)
                .comment(self.lb_comment())
                .with(Match::Source {
                    addr,
                    negated: false,
                })
                .jump(ext)
        };
        for cidr in &self.svc.load_balancer_source_ranges {
            own.rule(|| from(Address::Net(cidr.trunc())));
        }
        if self.plan.allow_from_node {
            // The LB VIP is often a local address, so the node's own traffic to it has the
            // VIP as source.
            for ip in &self.svc.load_balancer_ips {
                own.rule(|| from(Address::Ip(*ip)));
            }
        }
        // Falls through un-DNATed, so filter KUBE-PROXY-FIREWALL drops it.
        own.rule(|| {
            Rule::new(fw).comment(around(
                "other traffic to ",
                &self.display,
                " will be dropped by KUBE-PROXY-FIREWALL",
            ))
        });
    }

    /// The policy chains in use, each balancing over its list's `KUBE-SEP-*` chains, then
    /// every reachable endpoint's `KUBE-SEP-*` chain.
    fn endpoint_chains<S: RuleSink + ?Sized>(
        &self,
        own: &mut Own<'_, '_, S>,
        active: &mut Vec<String>,
    ) {
        // Every reachable endpoint's chain name, derived once.
        let mut sep_names = EndpointChains::new(&self.display, self.name);
        let reachable: Vec<(&Endpoint, String)> =
            dedup_endpoints(&self.plan.endpoints.all_reachable)
                .into_iter()
                .map(|ep| (ep, sep_names.chain(ep.ip, ep.port)))
                .collect();
        for (list, used) in [
            (EndpointList::Cluster, self.plan.uses_cluster_chain),
            (EndpointList::Local, self.plan.uses_local_chain),
        ] {
            if used {
                self.balance(list, &reachable, &mut sep_names, own, active);
            }
        }
        for (ep, sep) in reachable {
            self.endpoint_chain(ep, &sep, own);
            active.push(sep);
        }
    }

    /// The policy chain of `list`: ClientIP affinity's `recent` checks, then one rule per
    /// endpoint with upstream's probabilities.
    fn balance<S: RuleSink + ?Sized>(
        &self,
        list: EndpointList,
        reachable: &[(&Endpoint, String)],
        sep_names: &mut EndpointChains,
        own: &mut Own<'_, '_, S>,
        active: &mut Vec<String>,
    ) {
        let chain = self.policy_chain(list);
        own.chain(chain);
        active.push(chain.to_owned());
        let targets = dedup_endpoints(self.plan.list(list));
        let n = targets.len();
        if !own.write {
            let per_endpoint = if self.plan.affinity_seconds.is_some() {
                2
            } else {
                1
            };
            own.out.nat.total += n * per_endpoint;
            return;
        }
        let targets: Vec<(&Endpoint, Cow<'_, str>)> = targets
            .into_iter()
            .map(|ep| {
                // `reachable` is sorted by neither list's order in general; services are
                // small, and large ones only pay this when written.
                let sep = match reachable
                    .iter()
                    .find(|(r, _)| (r.ip, r.port) == (ep.ip, ep.port))
                {
                    Some((_, sep)) => Cow::Borrowed(sep.as_str()),
                    None => Cow::Owned(sep_names.chain(ep.ip, ep.port)),
                };
                (ep, sep)
            })
            .collect();
        let comment = |ep: &Endpoint| {
            (!self.ctx.large_cluster).then_some(Comment::Endpoint {
                service: &self.display,
                endpoint: SocketAddr::new(ep.ip, ep.port),
            })
        };
        if let Some(seconds) = self.plan.affinity_seconds {
            // Clamped to at most a day, so it fits.
            let seconds = u32::try_from(seconds).unwrap_or(u32::MAX);
            for (ep, sep) in &targets {
                own.rule(|| Rule {
                    chain: Cow::Borrowed(chain),
                    comment: comment(ep),
                    matches: vec![Match::Recent {
                        name: Cow::Borrowed(sep),
                        action: RecentAction::Rcheck {
                            seconds,
                            reap: true,
                        },
                    }],
                    target: Some(Target::Jump(Cow::Borrowed(sep))),
                });
            }
        }
        for (i, (ep, sep)) in targets.iter().enumerate() {
            own.rule(|| Rule {
                chain: Cow::Borrowed(chain),
                comment: comment(ep),
                matches: if i + 1 < n {
                    vec![Match::Statistic(Probability::one_in(n - i))]
                } else {
                    Vec::new()
                },
                target: Some(Target::Jump(Cow::Borrowed(sep))),
            });
        }
    }

    /// `ep`'s `KUBE-SEP-*` chain `sep`: the hairpin masquerade, then the DNAT (recording the
    /// client for ClientIP affinity).
    fn endpoint_chain<S: RuleSink + ?Sized>(
        &self,
        ep: &Endpoint,
        sep: &str,
        own: &mut Own<'_, '_, S>,
    ) {
        own.chain(sep);
        let comment = || {
            (!self.ctx.large_cluster).then_some(Comment::Text(Cow::Borrowed(self.display.as_str())))
        };
        // Hairpin: an endpoint reaching itself through the service must be masqueraded, or
        // it would answer itself directly.
        own.rule(|| Rule {
            chain: Cow::Borrowed(sep),
            comment: comment(),
            matches: vec![Match::Source {
                addr: Address::Ip(ep.ip),
                negated: false,
            }],
            target: Some(Target::Jump(Cow::Borrowed(KUBE_MARK_MASQ))),
        });
        own.rule(|| {
            let mut matches = Vec::with_capacity(2);
            if self.plan.affinity_seconds.is_some() {
                matches.push(Match::Recent {
                    name: Cow::Borrowed(sep),
                    action: RecentAction::Set,
                });
            }
            matches.push(Match::Protocol(self.name.protocol));
            Rule {
                chain: Cow::Borrowed(sep),
                comment: comment(),
                matches,
                target: Some(Target::Dnat(SocketAddr::new(ep.ip, ep.port))),
            }
        });
    }
}

/// Endpoints in the given order, each `ip:port` once (a duplicate would declare its chain
/// twice and fail the restore).
fn dedup_endpoints<'e>(eps: &[&'e Endpoint]) -> Vec<&'e Endpoint> {
    const LINEAR: usize = 16;
    let mut out: Vec<&'e Endpoint> = Vec::with_capacity(eps.len());
    if eps.len() <= LINEAR {
        for ep in eps {
            if !out.iter().any(|o| (o.ip, o.port) == (ep.ip, ep.port)) {
                out.push(ep);
            }
        }
    } else {
        let mut seen = std::collections::HashSet::with_capacity(eps.len());
        out.extend(
            eps.iter()
                .copied()
                .filter(|ep| seen.insert((ep.ip, ep.port))),
        );
    }
    out
}
