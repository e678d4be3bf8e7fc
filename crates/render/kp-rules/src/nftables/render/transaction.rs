//! The transaction of one sync, assembled as upstream's nftables `syncProxyRules` does: which
//! service ports it rewrites (every one on a full sync), their objects, what went stale, the
//! element changes, and the state update the caller keeps.
//!
//! Statement order inside the transaction matters, because the kernel checks references as
//! it goes: the fixed part first; then stale chains are flushed and the chains of rewritten
//! services created (or emptied); only then can affinity sets those chains referenced be
//! deleted; then sets and rules are added, then map elements (which may point at the new
//! chains); deletion of long-stale chains comes last, after every rule that could still
//! reference them has been rewritten.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, Protocol, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;

use super::super::cmd::{Command, Name, NoSteps, StepSink, StepWriter, script};
use super::super::{
    BASE_CHAINS, LEGACY_BASE_CHAINS, LEGACY_CHAINS, MARK_FOR_MASQUERADE, NftOutput, NftScope,
    NftState, OwnedObjects, Patch, RenderConfig, RenderError, StateUpdate, Update,
};
use super::elements::ElementChanges;
use super::fixed::fixed_commands;
use super::service::ServiceObjects;
use super::{Context, add_chain, comment_text};
use crate::family::{family_endpoints, for_family};

/// Render the transaction for `family`. See the [module docs](crate::nftables) for what full and
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
/// order of [`Transaction::steps`](crate::nftables::Transaction::steps): each step is applied
/// (by the sink) before the next one is rendered, so only one step's commands exist at a
/// time. The output's transaction holds what is left to apply (the last step, or the whole
/// transaction when the sync did not need steps, which the caller applies as usual);
/// [`NftOutput::steps_applied`] says how many steps the sink applied. The rest of the output
/// (state update, counts) covers the whole sync.
pub fn render_in_steps<S: StepSink + ?Sized>(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
    scope: &NftScope<'_>,
    sink: &mut S,
) -> Result<NftOutput, StepRenderError<S::Error>> {
    config.validate().map_err(StepRenderError::Render)?;
    let mark = config.masquerade_mark().map_err(StepRenderError::Render)?;
    let ctx = Context::new(state, config, family);
    let existing = scope.existing;

    let fixed = fixed_commands(&ctx, mark, scope.service_cidrs);
    let fingerprint = script(family, &fixed);
    let full =
        scope.kind == SyncKind::Full || existing.setup.as_deref() != Some(fingerprint.as_str());
    let targets = targets(state, family, scope, full);

    let table = Command::AddTable {
        comment: Some(comment_text("rules for kube-proxy")),
    };
    let prelude = if full {
        vec![table.clone(), add_chain(MARK_FOR_MASQUERADE)]
    } else {
        Vec::new()
    };
    let mut steps = StepWriter::new(sink, family, prelude);
    let services = write_services(&ctx, state, existing, &targets, &mut steps)?;
    let gone = if full {
        Vec::new()
    } else {
        gone(&targets, &services)
    };
    let stale = Stale::new(existing, &services, &targets, full, scope.delete_stale);
    let elements = if full {
        ElementChanges::full(&services)
    } else {
        ElementChanges::partial(existing, &services, &gone)
    };

    let mut head = if full {
        fixed_head(existing, table, fixed)
    } else {
        Vec::new()
    };
    head.extend(stale.flush_commands());
    let mut tail = elements.commands();
    tail.extend(stale.delete_chain_commands());
    let applied = steps.applied;
    let (transaction, applied, applied_commands) = steps
        .finish(head, stale.delete_set_commands(), tail)
        .map_err(|error| StepRenderError::Step { error, applied })?;

    let services_written = services.len();
    let update = if full {
        replace(fingerprint, services, elements, stale.pending)
    } else {
        patch(services, &gone, elements, stale.pending)
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
        flushed_stale: stale.flushed,
        deleted_chains: stale.deleted_chains,
        deleted_sets: stale.deleted_sets,
        update: StateUpdate(update),
    })
}

/// The service ports to (re)write: every one on a full sync, otherwise those of changed
/// services and any that appeared or vanished unnamed (so a caller that missed a change
/// cannot leave a rule pointing at a missing chain). Unchanged services are not even
/// planned: a partial sync costs the same with 10 or 10k services installed.
fn targets<'a>(
    state: &'a ProxyState,
    family: IpFamily,
    scope: &NftScope<'a>,
    full: bool,
) -> Vec<&'a ServicePortName> {
    if full {
        state
            .services
            .iter()
            .filter(|(_, svc)| has_family(svc, family))
            .map(|(name, _)| name)
            .collect()
    } else {
        dirty_ports(state, family, scope)
    }
}

/// The objects of each target that exists in this family, each handed to `steps` as soon as
/// it is made, so that a full sync in steps holds the rules of one step only.
fn write_services<'a, S: StepSink + ?Sized>(
    ctx: &Context<'_>,
    state: &'a ProxyState,
    existing: &NftState,
    targets: &[&ServicePortName],
    steps: &mut StepWriter<'_, S>,
) -> Result<Vec<ServiceObjects<'a>>, StepRenderError<S::Error>> {
    let mut services = Vec::with_capacity(targets.len());
    for name in targets {
        let Some((name, svc)) = state.services.get_key_value(*name) else {
            continue;
        };
        let Some((cluster_ip, port)) = for_family(svc, ctx.family) else {
            continue;
        };
        let all = state.endpoints.get(name).map(Vec::as_slice).unwrap_or(&[]);
        let eps = family_endpoints(all, ctx.family);
        let mut objects = ServiceObjects::new(ctx, name, cluster_ip, &port, &eps);
        let commands = objects.commands(existing);
        steps
            .push(commands)
            .map_err(|error| StepRenderError::Step {
                error,
                applied: steps.applied,
            })?;
        services.push(objects);
    }
    Ok(services)
}

/// Rewritten ports that no longer exist in this family (partial syncs only).
fn gone<'a>(
    targets: &[&'a ServicePortName],
    services: &[ServiceObjects<'_>],
) -> Vec<&'a ServicePortName> {
    let written: BTreeSet<&ServicePortName> = services.iter().map(|s| s.name).collect();
    targets
        .iter()
        .copied()
        .filter(|name| !written.contains(name))
        .collect()
}

/// The objects of ours a sync finds stale, and what it does with them.
struct Stale {
    /// Chains no longer used: flushed now, deleted by a later sync.
    flushed: BTreeSet<String>,
    /// Affinity sets deleted now.
    deleted_sets: BTreeSet<String>,
    /// Chains pending deletion, deleted now (with [`NftScope::delete_stale`]).
    deleted_chains: BTreeSet<String>,
    /// Chains pending deletion afterwards.
    pending: BTreeSet<String>,
}

impl Stale {
    /// What the rewritten ports (`targets`, now written as `services`; every port on a
    /// `full` sync) and the objects of a previous process leave stale.
    fn new(
        existing: &NftState,
        services: &[ServiceObjects<'_>],
        targets: &[&ServicePortName],
        full: bool,
        delete_stale: bool,
    ) -> Self {
        let mut desired_chains: BTreeSet<&str> = BTreeSet::new();
        let mut desired_sets: BTreeMap<&str, u64> = BTreeMap::new();
        for service in services {
            desired_chains.extend(service.chains.iter().map(|(c, _)| c.as_str()));
            desired_sets.extend(service.affinity_sets.iter().map(|(s, t)| (s.as_str(), *t)));
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
        let flushed: BTreeSet<String> = previous
            .iter()
            .flat_map(|o| o.chains.iter().map(Name::as_str))
            .chain(existing.foreign_chains.iter().map(String::as_str))
            .filter(|c| !desired_chains.contains(c))
            .map(str::to_owned)
            .collect();
        let deleted_sets = deleted_sets(existing, &previous, &desired_sets);
        // Only the rewritten ports can want a pending chain again: the others' chains were all
        // in use when the pending ones went stale.
        let deleted_chains: BTreeSet<String> = if delete_stale {
            existing
                .pending_deletions
                .iter()
                .filter(|c| !desired_chains.contains(c.as_str()))
                .cloned()
                .collect()
        } else {
            BTreeSet::new()
        };
        let mut pending: BTreeSet<String> = existing
            .pending_deletions
            .iter()
            .filter(|c| !desired_chains.contains(c.as_str()) && !deleted_chains.contains(*c))
            .cloned()
            .collect();
        pending.extend(flushed.iter().cloned());
        Self {
            flushed,
            deleted_sets,
            deleted_chains,
            pending,
        }
    }

    /// `flush chain` of each stale chain.
    fn flush_commands(&self) -> impl Iterator<Item = Command> + '_ {
        self.flushed.iter().map(|c| Command::FlushChain(c.into()))
    }

    /// `delete set` of each affinity set deleted now.
    fn delete_set_commands(&self) -> Vec<Command> {
        self.deleted_sets
            .iter()
            .map(|set| Command::DeleteSet(set.into()))
            .collect()
    }

    /// `delete chain` of each chain deleted now.
    fn delete_chain_commands(&self) -> impl Iterator<Item = Command> + '_ {
        self.deleted_chains
            .iter()
            .map(|c| Command::DeleteChain(c.into()))
    }
}

/// Sets to delete: unused ones, and those whose timeout changes (or is unknown), since older
/// kernels cannot change a set's timeout in place. The same holds for sets adopted from a
/// previous process: those still wanted with their timeout stay, elements and all (upstream
/// deletes only unused affinity sets, so pinned clients survive a restart).
fn deleted_sets(
    existing: &NftState,
    previous: &[&OwnedObjects],
    desired_sets: &BTreeMap<&str, u64>,
) -> BTreeSet<String> {
    let mut deleted: BTreeSet<String> = previous
        .iter()
        .flat_map(|o| o.affinity_sets.iter())
        .filter(|(set, timeout)| desired_sets.get(set.as_str()) != Some(*timeout))
        .map(|(set, _)| set.clone())
        .collect();
    deleted.extend(
        existing
            .foreign_sets
            .iter()
            .filter(|(set, timeout)| {
                timeout.is_none_or(|t| desired_sets.get(set.as_str()) != Some(&t))
            })
            .map(|(set, _)| set.clone()),
    );
    deleted
}

/// A full sync's head: the table, the base chains re-created on the first sync, the fixed
/// part.
fn fixed_head(existing: &NftState, table: Command, fixed: Vec<Command>) -> Vec<Command> {
    let mut head = vec![table];
    if !existing.is_initialized() {
        // Re-create the base chains once, so that a changed priority (or an older layout's
        // chain) does not make `add chain` fail.
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
    head.extend(fixed);
    head
}

/// A full sync's state: every service port's objects, and the elements.
fn replace(
    fingerprint: String,
    services: Vec<ServiceObjects<'_>>,
    elements: ElementChanges,
    pending: BTreeSet<String>,
) -> Update {
    let (owned, claims) = services
        .into_iter()
        .map(|service| {
            let (name, (owned, claims)) = service.into_objects();
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
}

/// A partial sync's change to the state: the rewritten ports' objects (none for those
/// `gone`) and the touched elements.
fn patch(
    services: Vec<ServiceObjects<'_>>,
    gone: &[&ServicePortName],
    elements: ElementChanges,
    pending: BTreeSet<String>,
) -> Update {
    Update::Patch(Patch {
        ports: services
            .into_iter()
            .map(|service| {
                let (name, objects) = service.into_objects();
                (name, Some(objects))
            })
            .chain(gone.iter().map(|name| ((*name).clone(), None)))
            .collect(),
        elements: elements.into_changes(),
        pending_deletions: pending,
    })
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
