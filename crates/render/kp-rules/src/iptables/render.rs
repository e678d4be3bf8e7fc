//! The restore text for one sync, following upstream's `syncProxyRules` layout.

use std::borrow::Cow;

use crate::family::{family_endpoints, for_family};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};

use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, ServicePort, ServicePortName};
use kp_core::topology::categorize;
use kp_core::tracker::ProxyState;

use super::comment::write_comment_args;
use super::names::{EndpointChains, ServiceChains, is_service_chain};
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
        self.chains.push(':');
        self.chains.push_str(name);
        self.chains.push_str(" - [0:0]\n");
    }

    /// Starts an `-A chain` rule, written straight into `rules`.
    fn append(&mut self, chain: &str) -> Rule<'_> {
        self.written += 1;
        self.total += 1;
        Rule::new(Some(&mut self.rules), chain)
    }
}

/// A service's own nat chains: written into the nat table, or, when a partial sync leaves
/// them alone, only counted (no text is formatted at all).
struct Own<'t> {
    table: &'t mut TableText,
    write: bool,
}

impl Own<'_> {
    fn chain(&mut self, name: &str) {
        if self.write {
            self.table.chain(name);
        }
    }

    fn append(&mut self, chain: &str) -> Rule<'_> {
        self.table.total += 1;
        if self.write {
            self.table.written += 1;
            Rule::new(Some(&mut self.table.rules), chain)
        } else {
            Rule::new(None, chain)
        }
    }
}

/// One `-A` rule, built argument by argument straight into the table text; the line ends
/// when the rule is dropped. Without a target it formats nothing (a counted-only rule).
struct Rule<'a>(Option<&'a mut String>);

impl<'a> Rule<'a> {
    fn new(out: Option<&'a mut String>, chain: &str) -> Self {
        let mut rule = Rule(out);
        if let Some(out) = rule.0.as_deref_mut() {
            out.push_str("-A ");
            out.push_str(chain);
        }
        rule
    }

    fn arg(mut self, arg: impl std::fmt::Display) -> Self {
        if let Some(out) = self.0.as_deref_mut() {
            let _ = write!(out, " {arg}");
        }
        self
    }

    fn comment(mut self, text: impl std::fmt::Display) -> Self {
        if let Some(out) = self.0.as_deref_mut() {
            out.push(' ');
            write_comment_args(out, text);
        }
        self
    }

    /// A comment that large-cluster mode drops.
    fn endpoint_comment(self, text: impl std::fmt::Display, large: bool) -> Self {
        if large { self } else { self.comment(text) }
    }

    fn jump(mut self, target: &str) -> Self {
        if let Some(out) = self.0.as_deref_mut() {
            out.push_str(" -j ");
            out.push_str(target);
        }
        self
    }
}

impl Drop for Rule<'_> {
    fn drop(&mut self) {
        if let Some(out) = self.0.as_deref_mut() {
            out.push('\n');
        }
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
///
/// A partial sync formats no rule text for the chains it leaves alone: it only counts their
/// rules and derives their names (for [`RenderOutput::chains`]).
pub fn render(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &SyncScope<'_>,
) -> Result<RenderOutput, RenderError> {
    let mark = config.masquerade_mark()?;
    let detector = Detector::new(&config.local_detector, family)?;

    // Each service port with its endpoints: both maps are sorted by name, so one merge walk
    // pairs them (no lookup per service).
    let mut endpoint_lists = state.endpoints.iter().peekable();
    let services: Vec<(&ServicePortName, IpAddr, ServicePort, &[Endpoint])> = state
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
        .collect();
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
    nat.append(KUBE_POSTROUTING)
        .arg(format_args!("-m mark ! --mark {mark:#x}/{mark:#x}"))
        .jump("RETURN");
    nat.append(KUBE_POSTROUTING)
        .arg(format_args!("-j MARK --xor-mark {mark:#x}"));
    {
        let masquerade = nat
            .append(KUBE_POSTROUTING)
            .comment("kubernetes service traffic requiring SNAT")
            .jump("MASQUERADE");
        if config.random_fully {
            masquerade.arg("--random-fully");
        }
    }
    nat.append(KUBE_MARK_MASQ)
        .arg(format_args!("-j MARK --or-mark {mark:#x}"));

    if family == IpFamily::V4 && config.localhost_node_ports {
        // route_localnet would otherwise let outside hosts reach 127.0.0.0/8 services.
        filter.chain(KUBE_FIREWALL);
        filter
            .append(KUBE_FIREWALL)
            .comment("block incoming localnet connections")
            .arg(format_args!("-d {IPV4_LOOPBACK} ! -s {IPV4_LOOPBACK}"))
            .arg("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT")
            .jump("DROP");
    }

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
            &mut filter,
            &mut nat,
            write,
            &mut active,
        );
    }
    // Sort once by integer keys (the names are short ASCII), find the stale chains with one
    // merge walk, then bulk-build the set from the sorted names.
    let mut active: Vec<(ChainKey, String)> = active
        .into_iter()
        .map(|chain| (ChainKey::of(&chain), chain))
        .collect();
    active.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    active.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);

    // Stale chains: declaring flushes them (dropping their jumps to other stale chains)
    // before any `-X` runs.
    let deleted: BTreeSet<String> = stale_chains(scope.existing_chains, &active)
        .cloned()
        .collect();
    let active: BTreeSet<String> = active.into_iter().map(|(_, chain)| chain).collect();
    for chain in &deleted {
        nat.chain(chain);
        nat.rules.push_str("-X ");
        nat.rules.push_str(chain);
        nat.rules.push('\n');
    }

    render_nodeport_dispatch(&ctx, &mut nat);

    if config.drop_invalid {
        filter
            .append(KUBE_FORWARD)
            .arg("-m conntrack --ctstate INVALID")
            .jump("DROP");
    }
    // Marked traffic is service traffic: forward it even when FORWARD's policy is DROP.
    filter
        .append(KUBE_FORWARD)
        .comment("kubernetes forwarding rules")
        .arg(format_args!("-m mark --mark {mark:#x}/{mark:#x}"))
        .jump("ACCEPT");
    filter
        .append(KUBE_FORWARD)
        .comment("kubernetes forwarding conntrack rule")
        .arg("-m conntrack --ctstate RELATED,ESTABLISHED")
        .jump("ACCEPT");

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
fn render_nodeport_dispatch(ctx: &Context<'_>, nat: &mut TableText) {
    let comment = "kubernetes service nodeports; NOTE: this must be the last rule in this chain";
    let ipv4 = ctx.family == IpFamily::V4;
    match &ctx.config.node_port_addresses.for_family(ctx.family) {
        NodePortAddresses::All => {
            let rule = nat
                .append(KUBE_SERVICES)
                .comment(comment)
                .arg("-m addrtype --dst-type LOCAL");
            let rule = if !ipv4 {
                rule.arg(format_args!("! -d {IPV6_LOOPBACK}"))
            } else if !ctx.config.localhost_node_ports {
                rule.arg(format_args!("! -d {IPV4_LOOPBACK}"))
            } else {
                rule
            };
            rule.jump(KUBE_NODEPORTS);
        }
        NodePortAddresses::Ips(ips) => {
            let mut seen = BTreeSet::new();
            for ip in ips.iter().filter(|ip| IpFamily::of(ip) == ctx.family) {
                let loopback_ok = ipv4 && ctx.config.localhost_node_ports;
                if (ip.is_loopback() && !loopback_ok) || !seen.insert(*ip) {
                    continue;
                }
                nat.append(KUBE_SERVICES)
                    .comment(comment)
                    .arg(format_args!("-d {ip}"))
                    .jump(KUBE_NODEPORTS);
            }
        }
    }
}

/// Everything for one service port: its filter rules, its dispatch rules in nat
/// `KUBE-SERVICES`/`KUBE-NODEPORTS`, and its own chains (written into `nat` right after its
/// dispatch rules when `write`, else only counted). Its own chains' names go to `active`.
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
    write: bool,
    active: &mut Vec<String>,
) {
    let cat = categorize(svc, endpoints, node);
    let display = name.to_string();
    let proto = name.protocol.as_str();
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

    let no_endpoints = format_args!("{display} has no endpoints");
    let no_local = format_args!("{display} has no local endpoints");
    let (internal_filter, external_filter) = if !has_endpoints {
        (
            Some(("REJECT", no_endpoints)),
            Some(("REJECT", no_endpoints)),
        )
    } else {
        (
            (!has_internal).then_some(("DROP", no_local)),
            (!has_external).then_some(("DROP", no_local)),
        )
    };
    let to = |ip: IpAddr, port: u16| Destination { proto, ip, port };
    let proto_match = format_args!("-m {proto} -p {proto}");

    // ClusterIP.
    let cluster_comment = format_args!("{display} cluster IP");
    match internal_filter {
        None => {
            nat.append(KUBE_SERVICES)
                .comment(cluster_comment)
                .arg(to(cluster_ip, svc.port))
                .jump(internal_chain);
        }
        Some((target, comment)) => {
            filter
                .append(KUBE_SERVICES)
                .comment(comment)
                .arg(to(cluster_ip, svc.port))
                .jump(target);
        }
    }

    // externalIPs.
    for ip in &svc.external_ips {
        if uses_ext_chain {
            nat.append(KUBE_SERVICES)
                .comment(format_args!("{display} external IP"))
                .arg(to(*ip, svc.port))
                .jump(&chains.ext);
        }
        if let Some((target, comment)) = external_filter {
            filter
                .append(KUBE_EXTERNAL_SERVICES)
                .comment(comment)
                .arg(to(*ip, svc.port))
                .jump(target);
        }
    }

    // LoadBalancer ingress IPs.
    for ip in &svc.load_balancer_ips {
        if uses_ext_chain {
            nat.append(KUBE_SERVICES)
                .comment(format_args!("{display} loadbalancer IP"))
                .arg(to(*ip, svc.port))
                .jump(lb_chain);
        }
        if uses_fw_chain {
            // Packets KUBE-FW-* accepted were DNATed and no longer match this.
            filter
                .append(KUBE_PROXY_FIREWALL)
                .comment(format_args!(
                    "{display} traffic not accepted by {}",
                    chains.fw
                ))
                .arg(to(*ip, svc.port))
                .jump("DROP");
        }
    }
    if let Some((target, comment)) = external_filter {
        for ip in &svc.load_balancer_ips {
            filter
                .append(KUBE_EXTERNAL_SERVICES)
                .comment(comment)
                .arg(to(*ip, svc.port))
                .jump(target);
        }
    }

    // NodePort (not subject to loadBalancerSourceRanges, as upstream).
    if let Some(node_port) = svc.node_port {
        if uses_ext_chain {
            nat.append(KUBE_NODEPORTS)
                .comment(&display)
                .arg(format_args!("{proto_match} --dport {node_port}"))
                .jump(&chains.ext);
        }
        if let Some((target, comment)) = external_filter {
            filter
                .append(KUBE_EXTERNAL_SERVICES)
                .comment(comment)
                .arg("-m addrtype --dst-type LOCAL")
                .arg(format_args!("{proto_match} --dport {node_port}"))
                .jump(target);
        }
    }

    // healthCheckNodePort: always TCP, open whether or not local endpoints exist.
    if let Some(hc_port) = svc.health_check_node_port {
        filter
            .append(KUBE_NODEPORTS)
            .comment(format_args!("{display} health check node port"))
            .arg(format_args!("-m tcp -p tcp --dport {hc_port}"))
            .jump("ACCEPT");
    }

    // The service's own chains, right after its dispatch rules.
    let mut own = Own { table: nat, write };
    if has_internal {
        // Masquerade ClusterIP traffic that does not come from a local pod.
        if ctx.config.masquerade_all {
            own.append(internal_chain)
                .comment(cluster_comment)
                .arg(to(cluster_ip, svc.port))
                .jump(KUBE_MARK_MASQ);
        } else if let Some(detector) = &ctx.detector {
            own.append(internal_chain)
                .comment(cluster_comment)
                .arg(to(cluster_ip, svc.port))
                .arg(&detector.if_not_local)
                .jump(KUBE_MARK_MASQ);
        }
    }

    if uses_ext_chain {
        own.chain(&chains.ext);
        active.push(chains.ext.clone());
        if !external_local {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            own.append(&chains.ext)
                .comment(format_args!(
                    "masquerade traffic for {display} external destinations"
                ))
                .jump(KUBE_MARK_MASQ);
        } else if uses_cluster_chain {
            if let Some(detector) = &ctx.detector {
                // Pods reaching an external IP of the service get any endpoint, unmasqueraded.
                own.append(&chains.ext)
                    .comment(format_args!(
                        "pod traffic for {display} external destinations"
                    ))
                    .arg(&detector.if_local)
                    .jump(&chains.svc);
            }
            // The node itself: masquerade (its source would not route back) and use any
            // endpoint.
            own.append(&chains.ext)
                .comment(format_args!(
                    "masquerade LOCAL traffic for {display} external destinations"
                ))
                .arg("-m addrtype --src-type LOCAL")
                .jump(KUBE_MARK_MASQ);
            own.append(&chains.ext)
                .comment(format_args!(
                    "route LOCAL traffic for {display} external destinations"
                ))
                .arg("-m addrtype --src-type LOCAL")
                .jump(&chains.svc);
        }
        if has_external {
            own.append(&chains.ext).jump(external_policy_chain);
        }
    }

    if uses_fw_chain {
        own.chain(&chains.fw);
        active.push(chains.fw.clone());
        let lb_comment = format_args!("{display} loadbalancer IP");
        let mut allow_from_node = false;
        for cidr in &svc.load_balancer_source_ranges {
            let cidr = cidr.trunc();
            own.append(&chains.fw)
                .comment(lb_comment)
                .arg(format_args!("-s {cidr}"))
                .jump(&chains.ext);
            allow_from_node |= ctx.node_ips.iter().any(|ip| cidr.contains(ip));
        }
        if allow_from_node {
            // The LB VIP is often a local address, so the node's own traffic to it has the
            // VIP as source.
            for ip in &svc.load_balancer_ips {
                own.append(&chains.fw)
                    .comment(lb_comment)
                    .arg(format_args!("-s {ip}"))
                    .jump(&chains.ext);
            }
        }
        // Falls through un-DNATed, so filter KUBE-PROXY-FIREWALL drops it.
        own.append(&chains.fw).comment(format_args!(
            "other traffic to {display} will be dropped by KUBE-PROXY-FIREWALL"
        ));
    }

    // Every reachable endpoint's chain name, derived once.
    let mut sep_names = EndpointChains::new(&display, name);
    let reachable: Vec<(&Endpoint, String)> = dedup_endpoints(&cat.all_reachable)
        .into_iter()
        .map(|ep| (ep, sep_names.chain(ep.ip, ep.port)))
        .collect();
    let sep_of = |ep: &Endpoint, sep_names: &mut EndpointChains| -> Cow<'_, str> {
        // `reachable` is sorted by neither list's order in general; services are small, and
        // large ones only pay this when written.
        match reachable
            .iter()
            .find(|(r, _)| (r.ip, r.port) == (ep.ip, ep.port))
        {
            Some((_, sep)) => Cow::Borrowed(sep.as_str()),
            None => Cow::Owned(sep_names.chain(ep.ip, ep.port)),
        }
    };

    let affinity = svc.session_affinity.map(|a| {
        a.timeout
            .as_secs()
            .clamp(MIN_AFFINITY_SECONDS, MAX_AFFINITY_SECONDS)
    });
    let mut balance = |chain: &str, eps: &[&Endpoint], own: &mut Own<'_>| {
        own.chain(chain);
        active.push(chain.to_owned());
        let targets = dedup_endpoints(eps);
        let n = targets.len();
        if !own.write {
            let per_endpoint = if affinity.is_some() { 2 } else { 1 };
            own.table.total += n * per_endpoint;
            return;
        }
        let targets: Vec<(&Endpoint, Cow<'_, str>)> = targets
            .into_iter()
            .map(|ep| (ep, sep_of(ep, &mut sep_names)))
            .collect();
        let comment = |ep: &Endpoint| EndpointComment {
            display: &display,
            ip: ep.ip,
            port: ep.port,
        };
        if let Some(seconds) = affinity {
            for (ep, sep) in &targets {
                own.append(chain)
                    .endpoint_comment(comment(ep), large)
                    .arg(format_args!(
                        "-m recent --name {sep} --rcheck --seconds {seconds} --reap"
                    ))
                    .jump(sep);
            }
        }
        for (i, (ep, sep)) in targets.iter().enumerate() {
            let rule = own.append(chain).endpoint_comment(comment(ep), large);
            let rule = if i + 1 < n {
                rule.arg(format_args!(
                    "-m statistic --mode random --probability {:.10}",
                    1.0 / ((n - i) as f64)
                ))
            } else {
                rule
            };
            rule.jump(sep);
        }
    };
    if uses_cluster_chain {
        balance(&chains.svc, &cat.cluster, &mut own);
    }
    if uses_local_chain {
        balance(&chains.svl, &cat.local, &mut own);
    }

    for (ep, sep) in reachable {
        own.chain(&sep);
        // Hairpin: an endpoint reaching itself through the service must be masqueraded, or
        // it would answer itself directly.
        own.append(&sep)
            .endpoint_comment(&display, large)
            .arg(format_args!("-s {}", ep.ip))
            .jump(KUBE_MARK_MASQ);
        let dnat = own.append(&sep).endpoint_comment(&display, large);
        let dnat = if affinity.is_some() {
            dnat.arg(format_args!("-m recent --name {sep} --set"))
        } else {
            dnat
        };
        dnat.arg(proto_match).arg(format_args!(
            "-j DNAT --to-destination {}",
            SocketAddr::new(ep.ip, ep.port)
        ));
        active.push(sep);
    }
}

/// `-m proto -p proto -d ip --dport port`.
struct Destination<'a> {
    proto: &'a str,
    ip: IpAddr,
    port: u16,
}

impl std::fmt::Display for Destination<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { proto, ip, port } = self;
        write!(f, "-m {proto} -p {proto} -d {ip} --dport {port}")
    }
}

/// `ns/name:port -> ip:port`, the comment of a load-balancing rule.
struct EndpointComment<'a> {
    display: &'a str,
    ip: IpAddr,
    port: u16,
}

impl std::fmt::Display for EndpointComment<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} -> {}",
            self.display,
            SocketAddr::new(self.ip, self.port)
        )
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
