//! The renderer as it was before partial syncs skipped the unchanged services' chains: it
//! builds every chain and drops the unchanged ones. Kept verbatim as the oracle for the
//! property test that the current renderer's output is identical for every input.
#![allow(dead_code)]

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, ServicePort, ServicePortName};
use kp_core::topology::categorize;
use kp_core::tracker::ProxyState;

use super::comment::comment_args;
use super::names::{ServiceChains, endpoint_chain, endpoint_string, is_service_chain};
use super::{
    Detector, KUBE_EXTERNAL_SERVICES, KUBE_FIREWALL, KUBE_FORWARD, KUBE_MARK_MASQ, KUBE_NODEPORTS,
    KUBE_POSTROUTING, KUBE_PROXY_FIREWALL, KUBE_SERVICES, NodePortAddresses, RenderConfig,
    RenderError, RenderOutput, SyncScope,
};

/// The API server caps `sessionAffinityConfig.clientIP.timeoutSeconds` at one day; clamping
/// keeps `xt_recent --seconds` valid even if a bad value slips through.
const MAX_AFFINITY_SECONDS: u64 = 86_400;
/// `xt_recent` needs a positive age; the API minimum is 1 s.
const MIN_AFFINITY_SECONDS: u64 = 1;
/// IPv4 loopback, where localhost NodePorts arrive.
const IPV4_LOOPBACK: &str = "127.0.0.0/8";
/// IPv6 loopback, never a NodePort address.
const IPV6_LOOPBACK: &str = "::1/128";

/// Upstream's `--probability` for the i-th of n remaining endpoints: `1/n` with 10 decimals.
///
/// Ten decimals keep the values strictly decreasing for n up to 100000 (`1/100001` prints as
/// `0.0000099999`). `n == 0` never happens (the last endpoint has no probability match) and
/// yields `1.0000000000` rather than a division by zero.
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / (n.max(1) as f64))
}

/// One table's part of the restore input.
#[derive(Default)]
struct TableText {
    chains: String,
    rules: String,
    /// `-A` lines in `rules`.
    written: usize,
    /// Rules in place once applied, including those of chains left as they were.
    total: usize,
}

impl TableText {
    fn chain(&mut self, name: &str) {
        // `:NAME - [0:0]` creates the chain, or flushes it when it exists (with --noflush).
        let _ = writeln!(self.chains, ":{name} - [0:0]");
    }

    fn rule(&mut self, rule: Rule) {
        self.rules.push_str(&rule.0);
        self.rules.push('\n');
        self.written += 1;
        self.total += 1;
    }

    /// Appends a service's nat chains, or only counts them when the sync leaves them alone.
    fn absorb(&mut self, other: TableText, write: bool) {
        if write {
            self.chains.push_str(&other.chains);
            self.rules.push_str(&other.rules);
            self.written += other.written;
        }
        self.total += other.total;
    }
}

/// One `-A` rule, built argument by argument.
struct Rule(String);

impl Rule {
    fn append(chain: &str) -> Self {
        Rule(format!("-A {chain}"))
    }

    fn arg(mut self, arg: impl std::fmt::Display) -> Self {
        let _ = write!(self.0, " {arg}");
        self
    }

    fn comment(self, text: &str) -> Self {
        self.arg(comment_args(text))
    }

    /// A comment that large-cluster mode drops.
    fn endpoint_comment(self, text: &str, large: bool) -> Self {
        if large { self } else { self.comment(text) }
    }

    fn jump(self, target: &str) -> Self {
        self.arg(format_args!("-j {target}"))
    }
}

/// A service port as one family's proxier sees it ([`ServicePort::for_family`]), with its
/// ClusterIP of that family. A zero port number means "none", as in the API.
fn for_family(svc: &ServicePort, family: IpFamily) -> Option<(IpAddr, ServicePort)> {
    let mut port = svc.for_family(family)?;
    let cluster_ip = port.cluster_ips.first().copied()?;
    port.node_port = port.node_port.filter(|p| *p != 0);
    port.health_check_node_port = port.health_check_node_port.filter(|p| *p != 0);
    Some((cluster_ip, port))
}

/// The endpoints of `family`, borrowed when none need filtering out.
fn family_endpoints(endpoints: &[Endpoint], family: IpFamily) -> Cow<'_, [Endpoint]> {
    if endpoints.iter().all(|ep| IpFamily::of(&ep.ip) == family) {
        Cow::Borrowed(endpoints)
    } else {
        Cow::Owned(
            endpoints
                .iter()
                .filter(|ep| IpFamily::of(&ep.ip) == family)
                .cloned()
                .collect(),
        )
    }
}

/// Settings shared by every service of one render.
struct Context<'a> {
    family: IpFamily,
    config: &'a RenderConfig,
    detector: Option<Detector>,
    large_cluster: bool,
    node_ips: Vec<IpAddr>,
}

/// Render the restore input for `family`.
///
/// The filter table and nat's top-level chains are always rewritten in full; per-service nat
/// chains only on full syncs or for services in `scope.changed`. Chains in
/// `scope.existing_chains` that no service produces any more are flushed and deleted.
pub(super) fn render(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &SyncScope<'_>,
) -> Result<RenderOutput, RenderError> {
    let mark = config.masquerade_mark()?;
    let detector = Detector::new(&config.local_detector, family)?;

    let services: Vec<(&ServicePortName, IpAddr, ServicePort)> = state
        .services
        .iter()
        .filter_map(|(name, svc)| {
            let (ip, port) = for_family(svc, family)?;
            Some((name, ip, port))
        })
        .collect();
    let total_endpoints: usize = services
        .iter()
        .filter_map(|(name, _, _)| state.endpoints.get(*name))
        .map(|eps| {
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
        node_ips: super::node_ip(&config.node_ips, &state.node, family)
            .into_iter()
            .collect(),
    };

    let mut filter = TableText::default();
    let mut nat = TableText::default();
    for chain in [
        KUBE_SERVICES,
        KUBE_EXTERNAL_SERVICES,
        KUBE_FORWARD,
        KUBE_NODEPORTS,
        KUBE_PROXY_FIREWALL,
    ] {
        filter.chain(chain);
    }
    for chain in [
        KUBE_SERVICES,
        KUBE_NODEPORTS,
        KUBE_POSTROUTING,
        KUBE_MARK_MASQ,
    ] {
        nat.chain(chain);
    }

    // Masquerading: only marked packets, the mark cleared so a packet that re-traverses the
    // stack is not masqueraded twice.
    nat.rule(
        Rule::append(KUBE_POSTROUTING)
            .arg(format_args!("-m mark ! --mark {mark:#x}/{mark:#x}"))
            .jump("RETURN"),
    );
    nat.rule(Rule::append(KUBE_POSTROUTING).arg(format_args!("-j MARK --xor-mark {mark:#x}")));
    let mut masquerade = Rule::append(KUBE_POSTROUTING)
        .comment("kubernetes service traffic requiring SNAT")
        .jump("MASQUERADE");
    if config.random_fully {
        masquerade = masquerade.arg("--random-fully");
    }
    nat.rule(masquerade);
    nat.rule(Rule::append(KUBE_MARK_MASQ).arg(format_args!("-j MARK --or-mark {mark:#x}")));

    if family == IpFamily::V4 && config.localhost_node_ports {
        // route_localnet would otherwise let outside hosts reach 127.0.0.0/8 services.
        filter.chain(KUBE_FIREWALL);
        filter.rule(
            Rule::append(KUBE_FIREWALL)
                .comment("block incoming localnet connections")
                .arg(format_args!("-d {IPV4_LOOPBACK} ! -s {IPV4_LOOPBACK}"))
                .arg("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT")
                .jump("DROP"),
        );
    }

    let mut active: BTreeSet<String> = BTreeSet::new();
    for (name, cluster_ip, port) in &services {
        let all = state.endpoints.get(*name).map(Vec::as_slice).unwrap_or(&[]);
        let endpoints = family_endpoints(all, family);
        let write = match scope.kind {
            SyncKind::Full => true,
            SyncKind::Partial => scope.changed.contains(&name.service),
        };
        let mut own = TableText::default();
        render_service(
            &ctx,
            &state.node,
            name,
            *cluster_ip,
            port,
            &endpoints,
            &mut filter,
            &mut nat,
            &mut own,
            &mut active,
        );
        nat.absorb(own, write);
    }

    // Stale chains: declaring flushes them (dropping their jumps to other stale chains)
    // before any `-X` runs.
    let deleted: BTreeSet<String> = scope
        .existing_chains
        .iter()
        .filter(|chain| is_service_chain(chain) && !active.contains(*chain))
        .cloned()
        .collect();
    for chain in &deleted {
        nat.chain(chain);
        let _ = writeln!(nat.rules, "-X {chain}");
    }

    render_nodeport_dispatch(&ctx, &mut nat);

    if config.drop_invalid {
        filter.rule(
            Rule::append(KUBE_FORWARD)
                .arg("-m conntrack --ctstate INVALID")
                .jump("DROP"),
        );
    }
    // Marked traffic is service traffic: forward it even when FORWARD's policy is DROP.
    filter.rule(
        Rule::append(KUBE_FORWARD)
            .comment("kubernetes forwarding rules")
            .arg(format_args!("-m mark --mark {mark:#x}/{mark:#x}"))
            .jump("ACCEPT"),
    );
    filter.rule(
        Rule::append(KUBE_FORWARD)
            .comment("kubernetes forwarding conntrack rule")
            .arg("-m conntrack --ctstate RELATED,ESTABLISHED")
            .jump("ACCEPT"),
    );

    let mut text = String::with_capacity(
        filter.chains.len() + filter.rules.len() + nat.chains.len() + nat.rules.len() + 32,
    );
    for (header, table) in [("*filter", &filter), ("*nat", &nat)] {
        text.push_str(header);
        text.push('\n');
        text.push_str(&table.chains);
        text.push_str(&table.rules);
        text.push_str("COMMIT\n");
    }
    Ok(RenderOutput {
        text,
        chains: active,
        deleted,
        rules_written: filter.written + nat.written,
        filter_rules: filter.total,
        nat_rules: nat.total,
        large_cluster: ctx.large_cluster,
    })
}

/// The last rule(s) of nat `KUBE-SERVICES`: traffic to a node address goes on to
/// `KUBE-NODEPORTS`. It must come after every service IP rule.
fn render_nodeport_dispatch(ctx: &Context<'_>, nat: &mut TableText) {
    let comment = "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
    let ipv4 = ctx.family == IpFamily::V4;
    match &ctx.config.node_port_addresses.for_family(ctx.family) {
        NodePortAddresses::All => {
            let mut rule = Rule::append(KUBE_SERVICES)
                .comment(comment)
                .arg("-m addrtype --dst-type LOCAL");
            if !ipv4 {
                rule = rule.arg(format_args!("! -d {IPV6_LOOPBACK}"));
            } else if !ctx.config.localhost_node_ports {
                rule = rule.arg(format_args!("! -d {IPV4_LOOPBACK}"));
            }
            nat.rule(rule.jump(KUBE_NODEPORTS));
        }
        NodePortAddresses::Ips(ips) => {
            let mut seen = BTreeSet::new();
            for ip in ips.iter().filter(|ip| IpFamily::of(ip) == ctx.family) {
                let loopback_ok = ipv4 && ctx.config.localhost_node_ports;
                if (ip.is_loopback() && !loopback_ok) || !seen.insert(*ip) {
                    continue;
                }
                nat.rule(
                    Rule::append(KUBE_SERVICES)
                        .comment(comment)
                        .arg(format_args!("-d {ip}"))
                        .jump(KUBE_NODEPORTS),
                );
            }
        }
    }
}

/// Everything for one service port: its filter rules, its dispatch rules in nat
/// `KUBE-SERVICES`/`KUBE-NODEPORTS`, and its own chains (into `own`).
#[allow(clippy::too_many_arguments)]
fn render_service(
    ctx: &Context<'_>,
    node: &kp_core::model::NodeInfo,
    name: &ServicePortName,
    cluster_ip: IpAddr,
    svc: &ServicePort,
    endpoints: &[Endpoint],
    filter: &mut TableText,
    nat: &mut TableText,
    own: &mut TableText,
    active: &mut BTreeSet<String>,
) {
    let cat = categorize(svc, endpoints, node);
    let display = name.to_string();
    let proto = name.protocol.as_str();
    let proto_match = format!("-m {proto} -p {proto}");
    let chains = ServiceChains::new(name);
    let large = ctx.large_cluster;

    // Chains are only created when something jumps to them, and jumps only go to chains that
    // are created: derive every "has endpoints" flag from the lists actually written.
    let uses_cluster_chain = svc.uses_cluster_endpoints() && !cat.cluster.is_empty();
    let uses_local_chain = svc.uses_local_endpoints() && !cat.local.is_empty();
    let has_endpoints = cat.has_any_endpoints;
    let policy = |local: bool| {
        if local {
            (&chains.svl, has_endpoints && uses_local_chain)
        } else {
            (&chains.svc, has_endpoints && uses_cluster_chain)
        }
    };
    let (internal_chain, has_internal) = policy(svc.internal_policy_local);
    let external_local = svc.external_policy_local && svc.externally_accessible();
    let (external_policy_chain, has_external) = policy(external_local);
    let uses_ext_chain = has_endpoints && svc.externally_accessible();
    let uses_fw_chain = has_endpoints
        && !svc.load_balancer_ips.is_empty()
        && !svc.load_balancer_source_ranges.is_empty();
    let lb_chain = if uses_fw_chain {
        &chains.fw
    } else {
        &chains.ext
    };

    let no_endpoints = format!("{display} has no endpoints");
    let no_local = format!("{display} has no local endpoints");
    let (internal_filter, external_filter) = if !has_endpoints {
        (
            Some(("REJECT", &no_endpoints)),
            Some(("REJECT", &no_endpoints)),
        )
    } else {
        (
            (!has_internal).then_some(("DROP", &no_local)),
            (!has_external).then_some(("DROP", &no_local)),
        )
    };
    let to = |ip: IpAddr, port: u16| format!("{proto_match} -d {ip} --dport {port}");

    // ClusterIP.
    let cluster_match = to(cluster_ip, svc.port);
    let cluster_comment = format!("{display} cluster IP");
    match internal_filter {
        None => nat.rule(
            Rule::append(KUBE_SERVICES)
                .comment(&cluster_comment)
                .arg(&cluster_match)
                .jump(internal_chain),
        ),
        Some((target, comment)) => filter.rule(
            Rule::append(KUBE_SERVICES)
                .comment(comment)
                .arg(&cluster_match)
                .jump(target),
        ),
    }

    // externalIPs.
    for ip in &svc.external_ips {
        if uses_ext_chain {
            nat.rule(
                Rule::append(KUBE_SERVICES)
                    .comment(&format!("{display} external IP"))
                    .arg(to(*ip, svc.port))
                    .jump(&chains.ext),
            );
        }
        if let Some((target, comment)) = external_filter {
            filter.rule(
                Rule::append(KUBE_EXTERNAL_SERVICES)
                    .comment(comment)
                    .arg(to(*ip, svc.port))
                    .jump(target),
            );
        }
    }

    // LoadBalancer ingress IPs.
    for ip in &svc.load_balancer_ips {
        if uses_ext_chain {
            nat.rule(
                Rule::append(KUBE_SERVICES)
                    .comment(&format!("{display} loadbalancer IP"))
                    .arg(to(*ip, svc.port))
                    .jump(lb_chain),
            );
        }
        if uses_fw_chain {
            // Packets KUBE-FW-* accepted were DNATed and no longer match this.
            filter.rule(
                Rule::append(KUBE_PROXY_FIREWALL)
                    .comment(&format!("{display} traffic not accepted by {}", chains.fw))
                    .arg(to(*ip, svc.port))
                    .jump("DROP"),
            );
        }
    }
    if let Some((target, comment)) = external_filter {
        for ip in &svc.load_balancer_ips {
            filter.rule(
                Rule::append(KUBE_EXTERNAL_SERVICES)
                    .comment(comment)
                    .arg(to(*ip, svc.port))
                    .jump(target),
            );
        }
    }

    // NodePort (not subject to loadBalancerSourceRanges, as upstream).
    if let Some(node_port) = svc.node_port {
        if uses_ext_chain {
            nat.rule(
                Rule::append(KUBE_NODEPORTS)
                    .comment(&display)
                    .arg(format_args!("{proto_match} --dport {node_port}"))
                    .jump(&chains.ext),
            );
        }
        if let Some((target, comment)) = external_filter {
            filter.rule(
                Rule::append(KUBE_EXTERNAL_SERVICES)
                    .comment(comment)
                    .arg("-m addrtype --dst-type LOCAL")
                    .arg(format_args!("{proto_match} --dport {node_port}"))
                    .jump(target),
            );
        }
    }

    // healthCheckNodePort: always TCP, open whether or not local endpoints exist.
    if let Some(hc_port) = svc.health_check_node_port {
        filter.rule(
            Rule::append(KUBE_NODEPORTS)
                .comment(&format!("{display} health check node port"))
                .arg(format_args!("-m tcp -p tcp --dport {hc_port}"))
                .jump("ACCEPT"),
        );
    }

    // The service's own chains.
    if has_internal {
        // Masquerade ClusterIP traffic that does not come from a local pod.
        let base = Rule::append(internal_chain)
            .comment(&cluster_comment)
            .arg(&cluster_match);
        if ctx.config.masquerade_all {
            own.rule(base.jump(KUBE_MARK_MASQ));
        } else if let Some(detector) = &ctx.detector {
            own.rule(base.arg(detector.if_not_local()).jump(KUBE_MARK_MASQ));
        }
    }

    if uses_ext_chain {
        own.chain(&chains.ext);
        active.insert(chains.ext.clone());
        if !external_local {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            own.rule(
                Rule::append(&chains.ext)
                    .comment(&format!(
                        "masquerade traffic for {display} external destinations"
                    ))
                    .jump(KUBE_MARK_MASQ),
            );
        } else if uses_cluster_chain {
            if let Some(detector) = &ctx.detector {
                // Pods reaching an external IP of the service get any endpoint, unmasqueraded.
                own.rule(
                    Rule::append(&chains.ext)
                        .comment(&format!("pod traffic for {display} external destinations"))
                        .arg(detector.if_local())
                        .jump(&chains.svc),
                );
            }
            // The node itself: masquerade (its source would not route back) and use any
            // endpoint.
            own.rule(
                Rule::append(&chains.ext)
                    .comment(&format!(
                        "masquerade LOCAL traffic for {display} external destinations"
                    ))
                    .arg("-m addrtype --src-type LOCAL")
                    .jump(KUBE_MARK_MASQ),
            );
            own.rule(
                Rule::append(&chains.ext)
                    .comment(&format!(
                        "route LOCAL traffic for {display} external destinations"
                    ))
                    .arg("-m addrtype --src-type LOCAL")
                    .jump(&chains.svc),
            );
        }
        if has_external {
            own.rule(Rule::append(&chains.ext).jump(external_policy_chain));
        }
    }

    if uses_fw_chain {
        own.chain(&chains.fw);
        active.insert(chains.fw.clone());
        let lb_comment = format!("{display} loadbalancer IP");
        let mut allow_from_node = false;
        for cidr in &svc.load_balancer_source_ranges {
            let cidr = cidr.trunc();
            own.rule(
                Rule::append(&chains.fw)
                    .comment(&lb_comment)
                    .arg(format_args!("-s {cidr}"))
                    .jump(&chains.ext),
            );
            allow_from_node |= ctx.node_ips.iter().any(|ip| cidr.contains(ip));
        }
        if allow_from_node {
            // The LB VIP is often a local address, so the node's own traffic to it has the
            // VIP as source.
            for ip in &svc.load_balancer_ips {
                own.rule(
                    Rule::append(&chains.fw)
                        .comment(&lb_comment)
                        .arg(format_args!("-s {ip}"))
                        .jump(&chains.ext),
                );
            }
        }
        // Falls through un-DNATed, so filter KUBE-PROXY-FIREWALL drops it.
        own.rule(Rule::append(&chains.fw).comment(&format!(
            "other traffic to {display} will be dropped by KUBE-PROXY-FIREWALL"
        )));
    }

    let affinity = svc.session_affinity.map(|a| {
        a.timeout
            .as_secs()
            .clamp(MIN_AFFINITY_SECONDS, MAX_AFFINITY_SECONDS)
    });
    let mut balance = |chain: &str, eps: &[&Endpoint], own: &mut TableText| {
        own.chain(chain);
        active.insert(chain.to_owned());
        let targets: Vec<(String, String)> = dedup_endpoints(eps)
            .map(|ep| {
                (
                    endpoint_chain(name, ep.ip, ep.port),
                    format!("{display} -> {}", endpoint_string(ep.ip, ep.port)),
                )
            })
            .collect();
        if let Some(seconds) = affinity {
            for (sep, comment) in &targets {
                own.rule(
                    Rule::append(chain)
                        .endpoint_comment(comment, large)
                        .arg(format_args!(
                            "-m recent --name {sep} --rcheck --seconds {seconds} --reap"
                        ))
                        .jump(sep),
                );
            }
        }
        let n = targets.len();
        for (i, (sep, comment)) in targets.iter().enumerate() {
            let mut rule = Rule::append(chain).endpoint_comment(comment, large);
            if i + 1 < n {
                rule = rule.arg(format_args!(
                    "-m statistic --mode random --probability {}",
                    probability(n - i)
                ));
            }
            own.rule(rule.jump(sep));
        }
    };
    if uses_cluster_chain {
        balance(&chains.svc, &cat.cluster, own);
    }
    if uses_local_chain {
        balance(&chains.svl, &cat.local, own);
    }

    for ep in dedup_endpoints(&cat.all_reachable) {
        let sep = endpoint_chain(name, ep.ip, ep.port);
        own.chain(&sep);
        // Hairpin: an endpoint reaching itself through the service must be masqueraded, or
        // it would answer itself directly.
        own.rule(
            Rule::append(&sep)
                .endpoint_comment(&display, large)
                .arg(format_args!("-s {}", ep.ip))
                .jump(KUBE_MARK_MASQ),
        );
        let mut dnat = Rule::append(&sep).endpoint_comment(&display, large);
        if affinity.is_some() {
            dnat = dnat.arg(format_args!("-m recent --name {sep} --set"));
        }
        own.rule(dnat.arg(&proto_match).arg(format_args!(
            "-j DNAT --to-destination {}",
            endpoint_string(ep.ip, ep.port)
        )));
        active.insert(sep);
    }
}

/// Endpoints in the given order, each `ip:port` once (a duplicate would declare its chain
/// twice and fail the restore).
fn dedup_endpoints<'e>(eps: &[&'e Endpoint]) -> impl Iterator<Item = &'e Endpoint> {
    let mut seen = BTreeSet::new();
    eps.iter()
        .copied()
        .filter(move |ep| seen.insert((ep.ip, ep.port)))
        .collect::<Vec<_>>()
        .into_iter()
}
