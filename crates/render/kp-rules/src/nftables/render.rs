//! The transaction for one sync, following upstream's nftables `syncProxyRules`.
//!
//! Statement order inside the transaction matters, because the kernel checks references as
//! it goes: the fixed part first; then stale chains are flushed and the chains of rewritten
//! services created (or emptied); only then can affinity sets those chains referenced be
//! deleted; then sets and rules are added, then map elements (which may point at the new
//! chains); deletion of long-stale chains comes last, after every rule that could still
//! reference them has been rewritten.

use std::borrow::Cow;

use crate::family::{family_endpoints, for_family};
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::backend::SyncKind;
use kp_core::model::{Endpoint, IpFamily, NodeInfo, Protocol, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;

use super::cmd::{
    Action, Addr, AddrField, Command, ElementKey, ElementValue, Hook, KeyParts, MapKey, Match,
    Name, NoSteps, Rule, ServiceCommands, SetKind, StepSink, StepWriter, Verdict, script,
};
use super::names::{EndpointNames, ServiceChains};
use super::{
    BASE_CHAINS, CLUSTER_IPS, ElementSet, FIREWALL_IPS, LEGACY_BASE_CHAINS, LEGACY_CHAINS,
    LocalDetector, MARK_FOR_MASQUERADE, MAX_COMMENT_BYTES, NO_ENDPOINT_NODEPORTS,
    NO_ENDPOINT_SERVICES, NODEPORT_IPS, NftOutput, NftScope, NftState, NodePortAddresses,
    OwnedObjects, REJECT_CHAIN, RenderConfig, RenderError, SERVICE_IPS, SERVICE_NODEPORTS,
    StateUpdate,
};
use super::{Installed, Patch, PortObjects, Update};
use crate::iptables::comment::sanitize;
use crate::plan::{
    EndpointList, ExternalMasquerade, InternalMasquerade, Masquerading, NoEndpoints,
    ServicePlan as Plan,
};

/// Up to this many endpoints, a service chain picks one with a cascade of `numgen random mod
/// k` rules instead of upstream's single `numgen random mod n vmap { ... }`. That anonymous
/// map costs the kernel a walk over the whole pending transaction when it is bound
/// (`__nft_set_trans_bind`), so a full sync with one per service grows with the square of
/// its size (3k services x 10 endpoints: 5.9 of 7.4 s; 10k: minutes). The cascade needs no
/// set; its cost is up to n-1 extra rule evaluations for the first packet of a connection,
/// negligible for small n, so larger services keep the O(1) map.
pub(crate) const MAX_CASCADE_ENDPOINTS: usize = 32;

/// Fixed chains (besides the base chains) and the rules jumping to them.
const SERVICES: &str = "services";
const MASQUERADING: &str = "masquerading";
const FIREWALL_CHECK: &str = "firewall-check";
const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";

/// Family-specific values.
struct Family {
    /// Loopback destinations never accept NodePorts.
    loopback: Addr,
}

impl Family {
    fn new(family: IpFamily) -> Self {
        let loopback = match family {
            IpFamily::V4 => Addr::Net(IpNet::V4(
                ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(127, 0, 0, 0), 8).unwrap_or_default(),
            )),
            IpFamily::V6 => Addr::Host(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)),
        };
        Self { loopback }
    }
}

/// The local-traffic detector as nft matches.
struct Detector {
    if_local: Match,
    if_not_local: Match,
}

impl Detector {
    /// `config` must have been validated (one CIDR per family at most, sane interface names,
    /// which therefore need no escaping inside quotes).
    fn new(config: &RenderConfig, family: IpFamily) -> Option<Self> {
        let matches = |negate: bool| -> Option<Match> {
            Some(match &config.local_detector {
                LocalDetector::None => return None,
                LocalDetector::Cidrs(cidrs) => Match::Addr {
                    field: AddrField::Source,
                    negate,
                    value: Addr::Net(
                        cidrs
                            .iter()
                            .find(|c| IpFamily::of_net(c) == family)?
                            .trunc(),
                    ),
                },
                LocalDetector::BridgeInterface(name) => Match::Iifname {
                    negate,
                    name: name.clone(),
                    wildcard: false,
                },
                LocalDetector::InterfaceNamePrefix(prefix) => Match::Iifname {
                    negate,
                    name: prefix.clone(),
                    wildcard: true,
                },
            })
        };
        Some(Self {
            if_local: matches(false)?,
            if_not_local: matches(true)?,
        })
    }
}

/// A comment as nft takes it: percent-encoded (no quote, backslash or control character
/// survives) and cut to nft's limit without splitting an escape.
fn comment_text(text: &str) -> String {
    let mut encoded = sanitize(text);
    if encoded.len() > MAX_COMMENT_BYTES {
        let mut cut = MAX_COMMENT_BYTES;
        // Escapes are `%XX` and `%` never appears literally.
        if let Some(pos) = encoded[..cut].rfind('%')
            && pos + 3 > cut
        {
            cut = pos;
        }
        encoded.truncate(cut);
    }
    encoded
}

/// `ip daddr ADDR` (or saddr).
fn addr_is(field: AddrField, addr: IpAddr) -> Match {
    Match::Addr {
        field,
        negate: false,
        value: Addr::Host(addr),
    }
}

/// `ip daddr @SET` (or saddr).
fn addr_in_set(field: AddrField, set: impl Into<Name>) -> Match {
    Match::AddrInSet {
        field,
        set: set.into(),
    }
}

/// A rule ending in `jump CHAIN`.
fn jump(matches: Vec<Match>, chain: impl Into<Name>) -> Rule {
    Rule::verdict(matches, Verdict::Jump(chain.into()))
}

/// A rule ending in `goto CHAIN`.
fn goto(matches: Vec<Match>, chain: impl Into<Name>) -> Rule {
    Rule::verdict(matches, Verdict::Goto(chain.into()))
}

/// `add chain` of a regular chain.
fn add_chain(chain: impl Into<Name>) -> Command {
    Command::AddChain {
        chain: chain.into(),
        hook: None,
        comment: None,
    }
}

/// `add rule`.
fn add_rule(chain: impl Into<Name>, rule: Rule) -> Command {
    Command::AddRule {
        chain: chain.into(),
        rule,
    }
}

/// Settings shared by every service of one render.
struct Context<'a> {
    family: IpFamily,
    fam: Family,
    config: &'a RenderConfig,
    detector: Option<Detector>,
    node: &'a NodeInfo,
    node_ips: Vec<IpAddr>,
}

/// Everything one service port puts in the table.
struct ServicePlan<'a> {
    name: &'a ServicePortName,
    /// Its chains with their rules, in writing order.
    chains: Vec<(Name, Vec<Rule>)>,
    /// Its affinity sets and their timeouts.
    affinity_sets: BTreeMap<String, u64>,
    /// Its set and map elements.
    elements: Vec<(ElementSet, ElementKey, ElementValue)>,
}

impl ServicePlan<'_> {
    /// What the state keeps of the plan once its commands are made: its objects and claims
    /// (moved, not copied: a full sync holds every service's plan at its end).
    fn into_objects(self) -> (ServicePortName, PortObjects) {
        let owned = OwnedObjects {
            chains: self.chains.into_iter().map(|(chain, _)| chain).collect(),
            affinity_sets: self.affinity_sets,
        };
        (self.name.clone(), (owned, self.elements))
    }
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

/// Render the transaction for `family`. See the [module docs](super) for what full and
/// partial syncs write.
pub fn render(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &NftScope<'_>,
) -> Result<NftOutput, RenderError> {
    render_in_steps(state, family, config, scope, &mut NoSteps).map_err(|err| match err {
        StepRenderError::Render(err) => err,
        StepRenderError::Step { error, .. } => match error {},
    })
}

/// Why [`render_in_steps`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum StepRenderError<E> {
    /// The configuration cannot be rendered; nothing was applied.
    #[error(transparent)]
    Render(RenderError),
    /// The sink failed to apply a step; the `applied` steps before it stay applied.
    #[error("step {} of the full sync was not applied", applied + 1)]
    Step {
        /// The sink's error.
        error: E,
        /// How many steps were applied before.
        applied: usize,
    },
}

/// [`render`], handing a large full sync to `sink` step by step as it is rendered, in the
/// order of [`Transaction::steps`](super::Transaction::steps): each step is applied (by the sink) before the next one
/// is rendered, so only one step's commands exist at a time. The output's transaction holds
/// what is left to apply (the last step, or the whole transaction when the sync did not need
/// steps, which the caller applies as usual); [`NftOutput::steps_applied`] says how many steps
/// the sink applied. The rest of the output (state update, counts) covers the whole sync.
pub fn render_in_steps<S: StepSink + ?Sized>(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &NftScope<'_>,
    sink: &mut S,
) -> Result<NftOutput, StepRenderError<S::Error>> {
    config.validate().map_err(StepRenderError::Render)?;
    let mark = config.masquerade_mark().map_err(StepRenderError::Render)?;
    let fam = Family::new(family);
    let ctx = Context {
        family,
        detector: Detector::new(config, family),
        fam,
        config,
        node: &state.node,
        node_ips: crate::iptables::node_ip(&config.node_ips, &state.node, family)
            .into_iter()
            .collect(),
    };
    let existing = scope.existing;

    let setup = setup_commands(&ctx, mark, scope.service_cidrs);
    let fingerprint = script(family, &setup);
    let full =
        scope.kind == SyncKind::Full || existing.setup.as_deref() != Some(fingerprint.as_str());

    // The service ports to (re)write: every one on a full sync, otherwise those of changed
    // services and any that appeared or vanished unnamed (so a caller that missed a change
    // cannot leave a rule pointing at a missing chain). Unchanged services are not even
    // planned: a partial sync costs the same with 10 or 10k services installed.
    let targets: Vec<&ServicePortName> = if full {
        state
            .services
            .iter()
            .filter(|(_, svc)| has_family(svc, family))
            .map(|(name, _)| name)
            .collect()
    } else {
        dirty_ports(state, family, scope)
    };

    let table = Command::AddTable {
        comment: Some(comment_text("rules for kube-proxy")),
    };
    let prelude = if full {
        vec![table.clone(), add_chain(MARK_FOR_MASQUERADE)]
    } else {
        Vec::new()
    };
    let mut steps = StepWriter::new(sink, family, prelude);
    // Each service port is planned and its commands handed on at once, so that a full sync
    // in steps holds the rules of one step only.
    let mut plans: Vec<ServicePlan<'_>> = Vec::with_capacity(targets.len());
    for name in &targets {
        let Some((name, svc)) = state.services.get_key_value(*name) else {
            continue;
        };
        let Some((cluster_ip, port)) = for_family(svc, family) else {
            continue;
        };
        let all = state.endpoints.get(name).map(Vec::as_slice).unwrap_or(&[]);
        let eps = family_endpoints(all, family);
        let mut plan = plan_service(&ctx, name, cluster_ip, &port, &eps);
        let commands = service_commands(existing, &mut plan);
        steps
            .push(commands)
            .map_err(|error| StepRenderError::Step {
                error,
                applied: steps.applied,
            })?;
        plans.push(plan);
    }
    // Rewritten ports that no longer exist in this family (partial syncs only).
    let gone: Vec<&ServicePortName> = if full {
        Vec::new()
    } else {
        let planned: BTreeSet<&ServicePortName> = plans.iter().map(|p| p.name).collect();
        targets
            .iter()
            .copied()
            .filter(|name| !planned.contains(name))
            .collect()
    };

    let mut desired_chains: BTreeSet<&str> = BTreeSet::new();
    let mut desired_sets: BTreeMap<&str, u64> = BTreeMap::new();
    for plan in &plans {
        desired_chains.extend(plan.chains.iter().map(|(c, _)| c.as_str()));
        desired_sets.extend(plan.affinity_sets.iter().map(|(s, t)| (s.as_str(), *t)));
    }
    // What the rewritten ports owned before: everything on a full sync. Per-service names
    // are unique to their service port, so no other port can still want one of these.
    let previous: Vec<&OwnedObjects> = if full {
        existing.owned.values().collect()
    } else {
        targets
            .iter()
            .filter_map(|name| existing.owned.get(*name))
            .collect()
    };

    let stale_chains: BTreeSet<String> = previous
        .iter()
        .flat_map(|o| o.chains.iter().map(Name::as_str))
        .chain(existing.foreign_chains.iter().map(String::as_str))
        .filter(|c| !desired_chains.contains(c))
        .map(str::to_owned)
        .collect();
    // Sets to delete: unused ones, and those whose timeout changes (or is unknown), since
    // older kernels cannot change a set's timeout in place. The same holds for sets adopted
    // from a previous process: those still wanted with their timeout stay, elements and all
    // (upstream deletes only unused affinity sets, so pinned clients survive a restart).
    let mut deleted_sets: BTreeSet<String> = previous
        .iter()
        .flat_map(|o| o.affinity_sets.iter())
        .filter(|(set, timeout)| desired_sets.get(set.as_str()) != Some(*timeout))
        .map(|(set, _)| set.clone())
        .collect();
    deleted_sets.extend(
        existing
            .foreign_sets
            .iter()
            .filter(|(set, timeout)| {
                timeout.is_none_or(|t| desired_sets.get(set.as_str()) != Some(&t))
            })
            .map(|(set, _)| set.clone()),
    );
    // Only the rewritten ports can want a pending chain again: the others' chains were all
    // in use when the pending ones went stale.
    let deleted_chains: BTreeSet<String> = if scope.delete_stale {
        existing
            .pending_deletions
            .iter()
            .filter(|c| !desired_chains.contains(c.as_str()))
            .cloned()
            .collect()
    } else {
        BTreeSet::new()
    };

    let elements = if full {
        ElementPlan::full(&plans)
    } else {
        ElementPlan::partial(existing, &plans, &gone)
    };

    let mut pending: BTreeSet<String> = existing
        .pending_deletions
        .iter()
        .filter(|c| !desired_chains.contains(c.as_str()) && !deleted_chains.contains(*c))
        .cloned()
        .collect();
    pending.extend(stale_chains.iter().cloned());

    let mut head = Vec::new();
    if full {
        head.push(table);
        if !existing.is_initialized() {
            // Re-create the base chains once, so that a changed priority (or an older
            // layout's chain) does not make `add chain` fail.
            for name in BASE_CHAINS
                .iter()
                .map(|c| c.name)
                .chain(LEGACY_BASE_CHAINS)
                .chain(LEGACY_CHAINS)
            {
                head.push(add_chain(name));
                head.push(Command::DeleteChain(name.into()));
            }
        }
        head.extend(setup);
    }

    for chain in &stale_chains {
        head.push(Command::FlushChain(chain.into()));
    }
    let deleted_set_commands = deleted_sets
        .iter()
        .map(|set| Command::DeleteSet(set.into()))
        .collect();
    let mut tail = elements.commands();
    tail.extend(
        deleted_chains
            .iter()
            .map(|chain| Command::DeleteChain(chain.into())),
    );
    let applied = steps.applied;
    let (transaction, applied, applied_commands) =
        steps
            .finish(head, deleted_set_commands, tail)
            .map_err(|error| StepRenderError::Step { error, applied })?;

    let services_written = plans.len();
    let update = if full {
        let (owned, claims) = plans
            .into_iter()
            .map(|plan| {
                let (name, (owned, claims)) = plan.into_objects();
                ((name.clone(), owned), (name, claims))
            })
            .unzip();
        Update::Replace(Box::new(NftState {
            setup: Some(fingerprint),
            owned,
            claims,
            foreign_chains: BTreeSet::new(),
            foreign_sets: BTreeMap::new(),
            pending_deletions: pending,
            elements: elements.into_installed(),
            // Every chain of ours is in `owned` or `pending_deletions` now; chains it did not
            // know before were flushed (stale) and are pending deletion.
            chains_known: true,
        }))
    } else {
        Update::Patch(Patch {
            ports: plans
                .into_iter()
                .map(|plan| {
                    let (name, objects) = plan.into_objects();
                    (name, Some(objects))
                })
                .chain(gone.iter().map(|name| ((*name).clone(), None)))
                .collect(),
            elements: elements.into_changes(),
            pending_deletions: pending,
        })
    };
    Ok(NftOutput {
        operations: applied_commands + transaction.len(),
        transaction,
        steps_applied: applied,
        kind: if full {
            SyncKind::Full
        } else {
            SyncKind::Partial
        },
        services_written,
        flushed_stale: stale_chains,
        deleted_chains,
        deleted_sets,
        update: StateUpdate(update),
    })
}

/// The commands of one planned service port: its chains (emptied when they may hold rules),
/// then its affinity sets and rules (moved out of `plan`).
fn service_commands(existing: &NftState, plan: &mut ServicePlan<'_>) -> ServiceCommands {
    let mut chains = Vec::with_capacity(plan.chains.len());
    let mut body = Vec::new();
    for (chain, _) in &plan.chains {
        chains.push(add_chain(chain.clone()));
        if existing.may_hold_chain(plan.name, chain) {
            chains.push(Command::FlushChain(chain.clone()));
        }
    }
    for (set, timeout) in &plan.affinity_sets {
        body.push(Command::AddSet {
            set: set.into(),
            kind: SetKind::Addresses {
                timeout: Some(*timeout),
            },
            comment: None,
        });
    }
    for (chain, rules) in &mut plan.chains {
        body.extend(
            std::mem::take(rules)
                .into_iter()
                .map(|rule| add_rule(chain.clone(), rule)),
        );
    }
    // One of its affinity sets is deleted first (its timeout changes): the service must
    // stay in the transaction that deletes it (the sync's last step). Per-service names are
    // unique to their service port, so only its own old objects can hold the name.
    let recreated = |set: &String, timeout: &u64| {
        existing
            .owned
            .get(plan.name)
            .and_then(|owned| owned.affinity_sets.get(set))
            .is_some_and(|old| old != timeout)
            || existing
                .foreign_sets
                .get(set)
                .is_some_and(|old| old.is_none_or(|old| old != *timeout))
    };
    let alone = !plan.affinity_sets.iter().any(|(s, t)| recreated(s, t));
    ServiceCommands {
        chains,
        body,
        alone,
    }
}

/// Whether `svc` has a ClusterIP of `family` (what [`for_family`] needs), without copying it.
fn has_family(svc: &ServicePort, family: IpFamily) -> bool {
    svc.cluster_ips.iter().any(|ip| IpFamily::of(ip) == family)
}

/// The service ports a partial sync rewrites, in service order: every port (in the state or
/// installed) of a changed service, and any port of this family that is installed but gone,
/// or present but not installed. The latter walk compares names only.
fn dirty_ports<'a>(
    state: &'a ProxyState,
    family: IpFamily,
    scope: &NftScope<'a>,
) -> Vec<&'a ServicePortName> {
    let existing = scope.existing;
    let mut dirty: BTreeSet<&ServicePortName> = BTreeSet::new();
    for service in scope.changed {
        dirty.extend(state.service_ports(service).map(|(name, _)| name));
        let first = ServicePortName {
            service: service.clone(),
            port: kp_core::model::Name::default(),
            protocol: Protocol::Tcp,
        };
        dirty.extend(ports_from(&existing.owned, &first));
    }
    let mut present = state
        .services
        .iter()
        .filter(|(_, svc)| has_family(svc, family))
        .map(|(name, _)| name)
        .peekable();
    let mut installed = existing.owned.keys().peekable();
    loop {
        match (present.peek(), installed.peek()) {
            (None, None) => break,
            (Some(p), Some(i)) if p == i => {
                present.next();
                installed.next();
            }
            (Some(p), i) if i.is_none_or(|i| p < i) => {
                dirty.insert(p);
                present.next();
            }
            // Installed only (the other cases are above).
            _ => dirty.extend(installed.next()),
        }
    }
    dirty.into_iter().collect()
}

/// The keys of `map` that are ports of `first`'s service (`first` being its smallest port).
fn ports_from<'a, V>(
    map: &'a BTreeMap<ServicePortName, V>,
    first: &ServicePortName,
) -> impl Iterator<Item = &'a ServicePortName> {
    let service = first.service.clone();
    map.range(first..)
        .map(|(name, _)| name)
        .take_while(move |name| name.service == service)
}

/// The element changes of one sync: every element on a full sync (whose fixed part flushed
/// the sets and maps), the difference on a partial one.
struct ElementPlan {
    /// Touched keys: the element as installed afterwards, or `None` once deleted. On a
    /// partial sync a key may only change its holder or count, with no statement.
    changes: BTreeMap<(ElementSet, ElementKey), Option<Installed>>,
    /// Keys whose installed element is deleted first (gone, or its value changes).
    deletes: BTreeSet<(ElementSet, ElementKey)>,
    /// Keys whose element (new, or with a new value) is added.
    adds: BTreeSet<(ElementSet, ElementKey)>,
}

impl ElementPlan {
    /// Every element the plans ask for; the first claim of a key (in service order) holds it.
    fn full(plans: &[ServicePlan<'_>]) -> Self {
        let mut changes: BTreeMap<(ElementSet, ElementKey), Option<Installed>> = BTreeMap::new();
        for plan in plans {
            for (set, key, value) in &plan.elements {
                match changes.entry((*set, key.clone())) {
                    Entry::Vacant(e) => {
                        e.insert(Some(Installed {
                            value: value.clone(),
                            owner: plan.name.clone(),
                            claims: 1,
                        }));
                    }
                    Entry::Occupied(mut e) => {
                        if let Some(installed) = e.get_mut() {
                            installed.claims += 1;
                        }
                    }
                }
            }
        }
        Self {
            adds: changes.keys().cloned().collect(),
            changes,
            deletes: BTreeSet::new(),
        }
    }

    /// The difference made by rewriting `plans` and dropping `gone`, against `existing`.
    /// A key is held by the first of its claimants in service order: an unchanged holder
    /// stays unless a rewritten port before it claims the key; when a rewritten port held it
    /// and unchanged ports still claim it, the stored claims are searched for the next one
    /// (rare: only ports of different services share keys).
    fn partial(existing: &NftState, plans: &[ServicePlan<'_>], gone: &[&ServicePortName]) -> Self {
        let rewritten: BTreeSet<&ServicePortName> = plans
            .iter()
            .map(|p| p.name)
            .chain(gone.iter().copied())
            .collect();
        // Per touched key: how many claims the rewritten ports release, and their new ones.
        let mut released: BTreeMap<(ElementSet, &str), u32> = BTreeMap::new();
        // The typed key of each touched key text.
        let mut keys: BTreeMap<(ElementSet, &str), &ElementKey> = BTreeMap::new();
        for name in &rewritten {
            for (set, key, _) in existing.claims.get(*name).into_iter().flatten() {
                *released.entry((*set, key.as_str())).or_default() += 1;
                keys.insert((*set, key.as_str()), key);
            }
        }
        let mut claimed: BTreeMap<(ElementSet, &str), Vec<(&ServicePortName, &ElementValue)>> =
            BTreeMap::new();
        for plan in plans {
            for (set, key, value) in &plan.elements {
                claimed
                    .entry((*set, key.as_str()))
                    .or_default()
                    .push((plan.name, value));
                keys.insert((*set, key.as_str()), key);
            }
        }
        let touched: BTreeSet<(ElementSet, &str)> =
            released.keys().chain(claimed.keys()).copied().collect();

        let mut plan = Self {
            changes: BTreeMap::new(),
            deletes: BTreeSet::new(),
            adds: BTreeSet::new(),
        };
        for (set, key) in touched {
            let before = existing.elements.get(&set).and_then(|e| e.get(key));
            let new_claims = claimed.get(&(set, key)).map(Vec::as_slice).unwrap_or(&[]);
            let unchanged_claims = before
                .map_or(0, |b| b.claims)
                .saturating_sub(released.get(&(set, key)).copied().unwrap_or(0));
            // The first claimant among the ports not rewritten, with its value.
            let unchanged_holder: Option<(&ServicePortName, &ElementValue)> = match before {
                _ if unchanged_claims == 0 => None,
                Some(b) if !rewritten.contains(&b.owner) => Some((&b.owner, &b.value)),
                _ => existing
                    .claims
                    .iter()
                    .filter(|(name, _)| !rewritten.contains(name))
                    .find_map(|(name, claims)| {
                        claims
                            .iter()
                            .find(|(s, k, _)| *s == set && k.as_str() == key)
                            .map(|(_, _, value)| (name, value))
                    }),
            };
            let first_new = new_claims.iter().min_by_key(|(name, _)| *name).copied();
            let holder = match (unchanged_holder, first_new) {
                (Some(old), Some(new)) => Some(if new.0 < old.0 { new } else { old }),
                (old, new) => old.or(new),
            };
            let after = holder.map(|(owner, value)| Installed {
                value: value.clone(),
                owner: owner.clone(),
                claims: unchanged_claims + u32::try_from(new_claims.len()).unwrap_or(u32::MAX),
            });
            if after.as_ref() == before {
                continue;
            }
            let Some(typed) = keys.get(&(set, key)) else {
                continue;
            };
            let entry = (set, (*typed).clone());
            if after.as_ref().map(|a| &a.value) != before.map(|b| &b.value) {
                if before.is_some() {
                    plan.deletes.insert(entry.clone());
                }
                if after.is_some() {
                    plan.adds.insert(entry.clone());
                }
            }
            plan.changes.insert(entry, after);
        }
        plan
    }

    /// The statements: per set, deletions first, then additions.
    fn commands(&self) -> Vec<Command> {
        let mut out = Vec::with_capacity(self.deletes.len() + self.adds.len());
        for set in ElementSet::ALL {
            let of_set = |(s, _): &&(ElementSet, ElementKey)| *s == set;
            for (s, key) in self.deletes.iter().filter(of_set) {
                out.push(Command::DeleteElement {
                    set: s.name().into(),
                    key: key.clone(),
                });
            }
            for entry in self.adds.iter().filter(of_set) {
                if let Some(Some(installed)) = self.changes.get(entry) {
                    out.push(Command::AddElement {
                        set: entry.0.name().into(),
                        key: entry.1.clone(),
                        value: installed.value.clone(),
                    });
                }
            }
        }
        out
    }

    /// A full sync's elements as the state keeps them (every set present, maybe empty).
    fn into_installed(self) -> BTreeMap<ElementSet, BTreeMap<ElementKey, Installed>> {
        let mut out: BTreeMap<ElementSet, BTreeMap<ElementKey, Installed>> = ElementSet::ALL
            .iter()
            .map(|set| (*set, BTreeMap::new()))
            .collect();
        for ((set, key), installed) in self.changes {
            if let Some(installed) = installed {
                out.entry(set).or_default().insert(key, installed);
            }
        }
        out
    }

    /// A partial sync's element changes for [`Patch`].
    fn into_changes(self) -> Vec<(ElementSet, ElementKey, Option<Installed>)> {
        self.changes
            .into_iter()
            .map(|((set, key), installed)| (set, key, installed))
            .collect()
    }
}

/// The fixed part of the table: base chains, helper chains, sets and maps (flushed), and
/// their rules. Written on every full sync; a partial sync is only possible while it is
/// unchanged, so its text doubles as the fingerprint of the installed layout.
fn setup_commands(ctx: &Context<'_>, mark: u32, service_cidrs: &[IpNet]) -> Vec<Command> {
    let mut out = Vec::new();
    let daddr = AddrField::Destination;

    for chain in &BASE_CHAINS {
        out.push(Command::AddChain {
            chain: chain.name.into(),
            hook: Some(Hook {
                kind: chain.kind,
                hook: chain.hook,
                priority: chain.priority,
            }),
            comment: None,
        });
        out.push(Command::FlushChain(chain.name.into()));
    }
    for chain in [
        CLUSTER_IPS_CHECK,
        FIREWALL_CHECK,
        MARK_FOR_MASQUERADE,
        MASQUERADING,
        NODEPORT_ENDPOINTS_CHECK,
        SERVICES,
        SERVICE_ENDPOINTS_CHECK,
    ] {
        out.push(add_chain(chain));
        out.push(Command::FlushChain(chain.into()));
    }
    out.push(Command::AddChain {
        chain: REJECT_CHAIN.into(),
        hook: None,
        comment: Some(comment_text(
            "helper for @no-endpoint-services / @no-endpoint-nodeports",
        )),
    });
    out.push(Command::FlushChain(REJECT_CHAIN.into()));

    let ip_port = SetKind::VerdictMap(MapKey::AddrProtoPort);
    let port_only = SetKind::VerdictMap(MapKey::ProtoPort);
    for (name, kind, text) in [
        (
            CLUSTER_IPS,
            SetKind::Addresses { timeout: None },
            "Active ClusterIPs",
        ),
        (
            FIREWALL_IPS,
            ip_port,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        (
            NO_ENDPOINT_NODEPORTS,
            port_only,
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        (
            NO_ENDPOINT_SERVICES,
            ip_port,
            "vmap to drop or reject packets to services with no endpoints",
        ),
        (
            SERVICE_IPS,
            ip_port,
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        (SERVICE_NODEPORTS, port_only, "NodePort traffic"),
    ] {
        out.push(Command::AddSet {
            set: name.into(),
            kind,
            comment: Some(comment_text(text)),
        });
    }
    for set in ElementSet::ALL {
        out.push(Command::FlushSet {
            set: set.name().into(),
            map: set.object() == "map",
        });
    }
    out.push(Command::AddSet {
        set: NODEPORT_IPS.into(),
        kind: SetKind::Addresses { timeout: None },
        comment: Some(comment_text("IPs that accept NodePort traffic")),
    });
    // Which destinations accept NodePorts: the listed node addresses, or every local address
    // but loopback (nftables mode never supports localhost NodePorts).
    let nodeport_match = match &ctx.config.node_port_addresses.for_family(ctx.family) {
        NodePortAddresses::All => {
            // Ensure the set is gone: `add` first so the `delete` cannot fail.
            out.push(Command::DeleteSet(NODEPORT_IPS.into()));
            None
        }
        NodePortAddresses::Ips(ips) => {
            out.push(Command::FlushSet {
                set: NODEPORT_IPS.into(),
                map: false,
            });
            let ips: BTreeSet<IpAddr> = ips
                .iter()
                .copied()
                .filter(|ip| IpFamily::of(ip) == ctx.family && !ip.is_loopback())
                .collect();
            for node_ip in ips {
                out.push(Command::AddElement {
                    set: NODEPORT_IPS.into(),
                    key: ElementKey::new(KeyParts::Addr(node_ip)),
                    value: ElementValue::default(),
                });
            }
            Some(addr_in_set(daddr, NODEPORT_IPS))
        }
    };

    let mut rule = |chain: &'static str, rule: Rule| out.push(add_rule(chain, rule));
    let new = || vec![Match::CtStateNew];
    for chain in ["filter-prerouting-pre-dnat", "filter-output-pre-dnat"] {
        rule(chain, jump(new(), FIREWALL_CHECK));
    }
    for chain in ["filter-forward", "filter-output"] {
        rule(chain, jump(new(), SERVICE_ENDPOINTS_CHECK));
        rule(chain, jump(new(), CLUSTER_IPS_CHECK));
    }
    rule("filter-input", jump(new(), NODEPORT_ENDPOINTS_CHECK));
    rule("filter-input", jump(new(), SERVICE_ENDPOINTS_CHECK));
    for chain in ["nat-prerouting", "nat-output"] {
        rule(chain, jump(Vec::new(), SERVICES));
    }
    rule("nat-postrouting", jump(Vec::new(), MASQUERADING));

    rule(
        CLUSTER_IPS_CHECK,
        Rule::new(vec![addr_in_set(daddr, CLUSTER_IPS)], Action::Reject).with_comment(
            comment_text("Reject traffic to invalid ports of ClusterIPs"),
        ),
    );
    let cidrs: Vec<IpNet> = service_cidrs
        .iter()
        .filter(|c| IpFamily::of_net(c) == ctx.family)
        .map(IpNet::trunc)
        .collect();
    let cidrs = IpNet::aggregate(&cidrs);
    if !cidrs.is_empty() {
        rule(
            CLUSTER_IPS_CHECK,
            Rule::verdict(
                vec![Match::AddrIn {
                    field: daddr,
                    negate: false,
                    nets: cidrs,
                }],
                Verdict::Drop,
            )
            .with_comment(comment_text("Drop traffic to unallocated ClusterIPs")),
        );
    }
    let vmap = |key: MapKey, map: &'static str| Action::Vmap {
        key,
        map: map.into(),
    };
    rule(
        FIREWALL_CHECK,
        Rule::new(Vec::new(), vmap(MapKey::AddrProtoPort, FIREWALL_IPS)),
    );
    rule(
        MARK_FOR_MASQUERADE,
        Rule::new(Vec::new(), Action::MarkOr(mark)),
    );
    rule(
        MASQUERADING,
        Rule::verdict(
            vec![Match::MarkAnd {
                mask: mark,
                value: 0,
            }],
            Verdict::Return,
        ),
    );
    rule(MASQUERADING, Rule::new(Vec::new(), Action::MarkXor(mark)));
    rule(
        MASQUERADING,
        Rule::new(
            Vec::new(),
            Action::Masquerade {
                fully_random: ctx.config.random_fully,
            },
        ),
    );
    let not_loopback = Match::Addr {
        field: daddr,
        negate: true,
        value: ctx.fam.loopback,
    };
    // Only reached from filter-input, so the destination is local already.
    let no_endpoint_match = nodeport_match.clone().unwrap_or(not_loopback.clone());
    rule(
        NODEPORT_ENDPOINTS_CHECK,
        Rule::new(
            vec![no_endpoint_match],
            vmap(MapKey::ProtoPort, NO_ENDPOINT_NODEPORTS),
        ),
    );
    rule(REJECT_CHAIN, Rule::new(Vec::new(), Action::Reject));
    rule(
        SERVICES,
        Rule::new(Vec::new(), vmap(MapKey::AddrProtoPort, SERVICE_IPS)),
    );
    let nodeport_matches = match nodeport_match {
        Some(matched) => vec![matched],
        None => vec![Match::FibLocal(daddr), not_loopback],
    };
    rule(
        SERVICES,
        Rule::new(nodeport_matches, vmap(MapKey::ProtoPort, SERVICE_NODEPORTS)),
    );
    rule(
        SERVICE_ENDPOINTS_CHECK,
        Rule::new(
            Vec::new(),
            vmap(MapKey::AddrProtoPort, NO_ENDPOINT_SERVICES),
        ),
    );
    out
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

/// Everything for one service port: its chains and their rules, its affinity sets, and its
/// map elements.
fn plan_service<'a>(
    ctx: &Context<'_>,
    name: &'a ServicePortName,
    cluster_ip: IpAddr,
    svc: &ServicePort,
    endpoints: &[Endpoint],
) -> ServicePlan<'a> {
    let (saddr, daddr) = (AddrField::Source, AddrField::Destination);
    // The decisions are the shared plan's (the iptables renderer and explain read the same
    // one); what follows only writes them as nftables objects.
    let plan = Plan::new(
        svc,
        endpoints,
        ctx.node,
        Masquerading {
            all: ctx.config.masquerade_all,
            detector: ctx.detector.is_some(),
        },
    );
    let cat = &plan.endpoints;
    let display = name.to_string();
    let proto = name.protocol;
    let chains = SharedChains::new(name);

    let uses_cluster_chain = plan.uses_cluster_chain;
    let uses_local_chain = plan.uses_local_chain;
    let chain_of = |list: EndpointList| match list {
        EndpointList::Local => &chains.local,
        EndpointList::Cluster => &chains.service,
    };
    let internal_chain = chain_of(plan.internal.list);
    let (external_policy_chain, has_external) =
        (chain_of(plan.external.list), plan.external.has_endpoints);
    let uses_external_chain = plan.uses_external_chain;
    // As upstream, the source-range filter applies whether or not there are endpoints.
    let uses_firewall_chain = plan.source_ranges;

    let reject = Verdict::Goto(REJECT_CHAIN.into());
    let filter_verdict = |filter: Option<NoEndpoints>| match filter {
        Some(NoEndpoints::Reject) => Some(&reject),
        Some(NoEndpoints::Drop) => Some(&Verdict::Drop),
        None => None,
    };
    let internal_filter = filter_verdict(plan.internal_filter);
    let external_filter = filter_verdict(plan.external_filter);

    let mut elements: Vec<(ElementSet, ElementKey, ElementValue)> = Vec::new();
    let mut element =
        |set: ElementSet, key: ElementKey, verdict: Option<&Verdict>, with_comment: bool| {
            elements.push((
                set,
                key,
                ElementValue {
                    verdict: verdict.cloned(),
                    comment: with_comment.then(|| comment_text(&display)),
                },
            ));
        };
    let key = |addr: IpAddr| ElementKey::new(KeyParts::AddrProtoPort(addr, proto, svc.port));
    let goto_external = Verdict::Goto(chains.external.clone());

    element(
        ElementSet::ClusterIps,
        ElementKey::new(KeyParts::Addr(cluster_ip)),
        None,
        false,
    );
    match internal_filter {
        None => element(
            ElementSet::ServiceIps,
            key(cluster_ip),
            Some(&Verdict::Goto(internal_chain.clone())),
            false,
        ),
        Some(verdict) => element(
            ElementSet::NoEndpointServices,
            key(cluster_ip),
            Some(verdict),
            true,
        ),
    }
    for external_ip in &svc.external_ips {
        if uses_external_chain {
            element(
                ElementSet::ServiceIps,
                key(*external_ip),
                Some(&goto_external),
                false,
            );
        }
        if let Some(verdict) = external_filter {
            element(
                ElementSet::NoEndpointServices,
                key(*external_ip),
                Some(verdict),
                true,
            );
        }
    }
    for lb_ip in &svc.load_balancer_ips {
        if uses_external_chain {
            element(
                ElementSet::ServiceIps,
                key(*lb_ip),
                Some(&goto_external),
                false,
            );
        }
        if uses_firewall_chain {
            element(
                ElementSet::FirewallIps,
                key(*lb_ip),
                Some(&Verdict::Goto(chains.firewall.clone())),
                true,
            );
        }
        if let Some(verdict) = external_filter {
            element(
                ElementSet::NoEndpointServices,
                key(*lb_ip),
                Some(verdict),
                true,
            );
        }
    }
    // NodePorts are not subject to loadBalancerSourceRanges, as upstream.
    if let Some(node_port) = svc.node_port {
        let key = ElementKey::new(KeyParts::ProtoPort(proto, node_port));
        if uses_external_chain {
            element(
                ElementSet::ServiceNodePorts,
                key.clone(),
                Some(&goto_external),
                false,
            );
        }
        if let Some(verdict) = external_filter {
            element(ElementSet::NoEndpointNodePorts, key, Some(verdict), true);
        }
    }

    let affinity = plan.affinity_seconds;
    // Endpoint chains: every endpoint reachable from here, and (belt and braces, as they
    // are part of it) every endpoint a policy chain written below points at.
    let mut reachable: Vec<&Endpoint> = cat.all_reachable.clone();
    if uses_cluster_chain {
        reachable.extend(&cat.cluster);
    }
    if uses_local_chain {
        reachable.extend(&cat.local);
    }
    let reachable = dedup_endpoints(&reachable);
    let endpoint_names: BTreeMap<(IpAddr, u16), SharedEndpointNames> = reachable
        .iter()
        .map(|ep| {
            (
                (ep.ip, ep.port),
                SharedEndpointNames::new(name, ep.ip, ep.port),
            )
        })
        .collect();
    let names_of = |ep: &Endpoint| -> Cow<'_, SharedEndpointNames> {
        match endpoint_names.get(&(ep.ip, ep.port)) {
            Some(names) => Cow::Borrowed(names),
            None => Cow::Owned(SharedEndpointNames::new(name, ep.ip, ep.port)),
        }
    };

    let mut plan_chains: Vec<(Name, Vec<Rule>)> = Vec::new();
    // Masquerade ClusterIP traffic that does not come from a local pod (all of it with
    // masqueradeAll); without a detector pod traffic cannot be told apart, so none is.
    let internal_masquerade = match plan.internal_masquerade {
        InternalMasquerade::All => {
            Some(jump(vec![addr_is(daddr, cluster_ip)], MARK_FOR_MASQUERADE))
        }
        InternalMasquerade::NotLocal => ctx.detector.as_ref().map(|d| {
            jump(
                vec![addr_is(daddr, cluster_ip), d.if_not_local.clone()],
                MARK_FOR_MASQUERADE,
            )
        }),
        InternalMasquerade::None => None,
    };
    let balance = |chain: &Name, eps: &[&Endpoint]| -> (Name, Vec<Rule>) {
        let mut rules = Vec::new();
        if chain == internal_chain
            && let Some(masquerade) = &internal_masquerade
        {
            rules.push(masquerade.clone());
        }
        let targets = dedup_endpoints(eps);
        if affinity.is_some() {
            for ep in &targets {
                let names = names_of(ep);
                rules.push(goto(
                    vec![addr_in_set(saddr, names.affinity_set.clone())],
                    names.chain.clone(),
                ));
            }
        }
        if targets.len() > MAX_CASCADE_ENDPOINTS {
            let arms: Vec<Name> = targets
                .iter()
                .map(|ep| names_of(ep).chain.clone())
                .collect();
            rules.push(Rule::new(Vec::new(), Action::NumgenVmap(arms)));
        } else {
            // Endpoint i of n is taken with probability 1/(n-i) once the ones before it
            // were passed over, which is 1/n overall; the last one takes the rest.
            let count = targets.len();
            for (i, ep) in targets.iter().enumerate() {
                let target = names_of(ep).chain.clone();
                if i + 1 == count {
                    rules.push(goto(Vec::new(), target));
                } else {
                    let modulus = u32::try_from(count - i).unwrap_or(u32::MAX);
                    rules.push(goto(vec![Match::Numgen { modulus, value: 0 }], target));
                }
            }
        }
        (chain.clone(), rules)
    };
    if uses_cluster_chain {
        plan_chains.push(balance(&chains.service, &cat.cluster));
    }
    if uses_local_chain {
        plan_chains.push(balance(&chains.local, &cat.local));
    }

    if uses_external_chain {
        let mut rules = Vec::new();
        match plan.external_masquerade {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            ExternalMasquerade::Always => rules.push(jump(Vec::new(), MARK_FOR_MASQUERADE)),
            ExternalMasquerade::ShortCircuit { pods } => {
                let service = &chains.service;
                if let Some(detector) = ctx.detector.as_ref().filter(|_| pods) {
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
        if has_external {
            rules.push(goto(Vec::new(), external_policy_chain.clone()));
        }
        plan_chains.push((chains.external.clone(), rules));
    }

    if uses_firewall_chain {
        let mut sources: Vec<IpNet> = svc
            .load_balancer_source_ranges
            .iter()
            .map(IpNet::trunc)
            .collect();
        let allow_from_node = sources
            .iter()
            .any(|cidr| ctx.node_ips.iter().any(|node_ip| cidr.contains(node_ip)));
        if allow_from_node {
            // The LB VIP is often a local address, so the node's own traffic to it has the
            // VIP as source.
            sources.extend(svc.load_balancer_ips.iter().map(|ip| IpNet::from(*ip)));
        }
        // Overlapping entries are merged: older nft rejects overlapping set intervals.
        plan_chains.push((
            chains.firewall.clone(),
            vec![Rule::verdict(
                vec![Match::AddrIn {
                    field: saddr,
                    negate: true,
                    nets: IpNet::aggregate(&sources),
                }],
                Verdict::Drop,
            )],
        ));
    }

    let mut affinity_sets = BTreeMap::new();
    for ep in &reachable {
        let names = names_of(ep);
        if let Some(seconds) = affinity {
            affinity_sets.insert(names.affinity_set.to_string(), seconds);
        }
        let mut rules = vec![
            // Hairpin: an endpoint reaching itself through the service must be masqueraded,
            // or it would answer itself directly.
            jump(vec![addr_is(saddr, ep.ip)], MARK_FOR_MASQUERADE),
        ];
        if affinity.is_some() {
            rules.push(Rule::new(
                Vec::new(),
                Action::UpdateSourceSet(names.affinity_set.clone()),
            ));
        }
        rules.push(Rule::new(
            vec![Match::L4Proto(proto)],
            Action::Dnat {
                addr: ep.ip,
                port: ep.port,
            },
        ));
        plan_chains.push((names.chain.clone(), rules));
    }

    ServicePlan {
        name,
        chains: plan_chains,
        affinity_sets,
        elements,
    }
}

/// Internals the unit tests check directly.
#[cfg(test)]
pub(super) mod tests_support {
    /// See [`super::comment_text`].
    pub fn comment_text(text: &str) -> String {
        super::comment_text(text)
    }
}
