//! nftables mode in the verdict-free layout ([`LayoutBackend`]; design and kernel probe in
//! `docs/nftables-layout.md`): every per-service fact is an element of a set or data map
//! without verdicts, behind a fixed part of ~20 chains, so a one-service change is one
//! element transaction that the kernel neither validates nor walks the table for.
//!
//! nftables mode's default layout; `--nftables-layout=chains` writes the chain-per-service
//! layout ([`super::NftablesBackend`]) instead.
//!
//! One sync, per family:
//!
//! - **Full** (first, after a failure or another program's change, when the core asks):
//!   read the table back ([`LayoutIo::read_table`]) unless the bookkeeping is trusted; a
//!   table of another layout (ours or upstream's, same name) is replaced by this one in one
//!   `nft -f` transaction (no moment without rules). Otherwise the fixed part is rewritten
//!   (`nft -f`, with the sets and rules of the classes in use now *and* before, so nothing
//!   loses its rule), the element difference goes over netlink (one transaction, or steps
//!   of [`STEP`] in an order that never points a rule at a missing slot), and classes no
//!   longer used lose their rules and sets last. A load of at least [`QUIET_FROM`] elements
//!   runs with this process's notification watch out of its group, and the nf_tables
//!   generation before and after says whether anyone else committed meanwhile, unheard; if
//!   so the sync runs again, full, reading both tables back.
//! - **Partial**: the difference of the changed services' elements, over netlink in one
//!   transaction, with the sets, maps and rules of any new slot count or affinity service
//!   port ([`LayoutIo::apply_classes`], `kp_nftnl::class`); a class value the lowering
//!   refuses or a changed ServiceCIDR list makes that transaction `nft -f` text instead.
//!
//! A failed transaction changes nothing in the kernel: the bookkeeping stays, the failure is
//! counted (`kubeproxy_sync_proxy_rules_nftables_sync_failures_total`) and the next sync is
//! full (and reads the table back, since steps of a large one may have been applied).
//!
//! Clients pinned (ClientIP affinity) to an endpoint a sync removed from a service port's
//! list are deleted from that port's affinity maps right after it. The fixed part is still `nft -f` text
//! (written only when the classes in use change).

#[cfg(any(test, feature = "test-util"))]
mod fake;
mod io;
#[cfg(test)]
mod tests;

use kp_core::report::ErrorChain as _;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use ipnet::IpNet;
use kp_core::backend::{ApplyError, Backend, BackendError, SyncKind, SyncReport, SyncRequest};
use kp_core::foreign::{Check, ForeignChange};
use kp_core::model::IpFamily;
use kp_nftnl::layout::Forget;
use kp_rules::nftables::layout::class::{ClassObject, class_objects};
use kp_rules::nftables::layout::fixed::{DISPATCH, PICK};
use kp_rules::nftables::layout::{
    AffinityPort, Changes, Class, Context, Element, FixedConfig, LayoutState, PinList,
    change_script, delete_classes_script, fixed_part, full_updates, partial_updates, ready_classes,
    replace_table_script,
};
use kp_rules::nftables::{RenderError, TABLE};
use tracing::{debug, info, warn};

use super::{MODE, NftablesConfig, NftablesMetrics, table_family};
use crate::blocking::blocking;
use crate::conntrack::{Conntrack, DefaultConntrack};
use crate::exec::ExecError;
use crate::sync::{FamilyErrors, SyncState};

#[cfg(any(test, feature = "test-util"))]
pub use fake::{FakeLayoutIo, LayoutCall};
pub use io::{LayoutIo, NetlinkLayoutIo};
pub use kp_nftnl::layout::Readback;

/// Elements per kernel transaction of a large full sync (the kernel takes a transaction in
/// one `sendmsg`; this keeps each batch a few MB).
pub const STEP: usize = 50_000;

/// Whether this layout can run on this host: it writes its fixed part with `nft -f`, and
/// nft 1.0.x crashes loading a ruleset in which another table holds a set a newer nft wrote
/// (kubernetes#136786; [`ExecNft::check_scripts`](super::ExecNft::check_scripts)). `false`
/// (with a warning) only when `nft` crashed: the chain layout, which needs nothing but
/// netlink and a listing of its own table, is then the one to write. Other failures of the
/// probe are left to the syncs to report.
pub fn runs_here(nft: &super::ExecNft) -> bool {
    match nft.check_scripts() {
        Err(error) if error.exit_code().is_none() => {
            warn!(
                error = %error.chain(),
                "nft cannot run scripts on this host; nftables mode writes the chain layout"
            );
            false
        }
        _ => true,
    }
}

/// Loads of at least this many elements leave the notification group (see
/// [`LayoutBackend::quiet_from`]).
pub const QUIET_FROM: usize = 10_000;

/// How many full syncs in a row one sync runs when others commit during its quiet loads.
const FULL_ATTEMPTS: usize = 3;

/// How a full sync ended.
enum Full {
    /// Applied; this many elements written.
    Done(usize),
    /// Applied, but another program committed during a quiet load: the table must be read
    /// back and repaired.
    Unheard,
}

/// What the backend knows about one family's table.
#[derive(Debug, Default)]
struct Table {
    /// What the kernel holds, as of the last successful sync.
    installed: LayoutState,
    /// Whether `installed` is known to be what the kernel holds (else the next full sync
    /// reads the table back).
    trusted: bool,
    /// The fixed part's settings as last written (a ServiceCIDR change rewrites it).
    fixed: Option<FixedConfig>,
    /// Classes to write ahead of their use ([`ready_classes`]) at the next sync that writes
    /// text anyway or changes nothing (a recheck is asked for it), so that a partial sync
    /// using them stays an element transaction.
    unready: BTreeSet<Class>,
}

/// How soon after a sync that left classes unready the backend asks for a sync that
/// writes them.
const READY_AFTER: std::time::Duration = std::time::Duration::from_millis(500);

/// nftables mode in the verdict-free layout. `I` writes and reads the table, `C` deletes
/// conntrack entries; both are fakes in tests.
#[derive(Debug)]
pub struct LayoutBackend<I = NetlinkLayoutIo, C = DefaultConntrack> {
    config: NftablesConfig,
    io: I,
    metrics: NftablesMetrics,
    tables: BTreeMap<IpFamily, Table>,
    sync: SyncState<C>,
    quiet_from: usize,
}

impl LayoutBackend {
    /// The real backend reporting into `metrics`: elements over nf_tables netlink, the
    /// fixed part with `nft`, conntrack over ctnetlink.
    pub fn with_metrics_registered(
        config: NftablesConfig,
        metrics: NftablesMetrics,
    ) -> Result<Self, RenderError> {
        let mut backend = Self::with_parts(
            config,
            NetlinkLayoutIo::default(),
            DefaultConntrack::default(),
        )?;
        backend.metrics = metrics;
        Ok(backend)
    }
}

impl<I: LayoutIo, C: Conntrack> LayoutBackend<I, C> {
    /// A backend from its parts; fails if the render configuration cannot be expressed.
    pub fn with_parts(config: NftablesConfig, io: I, conntrack: C) -> Result<Self, RenderError> {
        config.render.validate()?;
        Ok(Self {
            sync: SyncState::new(config.families.clone(), conntrack),
            config,
            io,
            metrics: NftablesMetrics::default(),
            tables: BTreeMap::new(),
            quiet_from: QUIET_FROM,
        })
    }

    /// Full syncs writing at least `elements` elements load them with this process's
    /// notification watch out of its group ([`QUIET_FROM`] by default; tests lower it).
    pub fn quiet_from(mut self, elements: usize) -> Self {
        self.quiet_from = elements;
        self
    }

    /// The I/O (the fake's record in tests).
    pub fn io(&self) -> &I {
        &self.io
    }

    /// What the backend believes `family`'s table holds.
    pub fn installed(&self, family: IpFamily) -> Option<&LayoutState> {
        self.tables.get(&family).map(|t| &t.installed)
    }

    fn fixed_config(&self, family: IpFamily, cidrs: &[IpNet]) -> FixedConfig {
        // `validate` ran in the constructor, so the mark is valid.
        FixedConfig::new(&self.config.render, family, cidrs).unwrap_or_else(|_| FixedConfig {
            family,
            mark: 0x4000,
            random_fully: self.config.render.random_fully,
            detector: self.config.render.local_detector.clone(),
            node_port_addresses: self.config.render.node_port_addresses.clone(),
            service_cidrs: cidrs.to_vec(),
            localhost_rejects: self
                .config
                .render
                .nftables_localhost_rejects
                .protocols(family),
        })
    }

    /// One family's sync.
    async fn sync_family(
        &self,
        family: IpFamily,
        request: &SyncRequest<'_>,
        kind: SyncKind,
        table: &mut Table,
    ) -> Result<Full, BackendError> {
        let ctx = Context::new(&self.config.render, request.state, family);
        let fixed = self.fixed_config(family, &request.state.service_cidrs);
        if kind == SyncKind::Full || !table.trusted {
            return self.full(family, request, &ctx, fixed, table).await;
        }
        let updates = partial_updates(request.state, &ctx, &table.installed, request.changed);
        let mut changes = table.installed.changes(updates);
        let refix = table.fixed.as_ref().map(FixedConfig::family_service_cidrs)
            != Some(fixed.family_service_cidrs());
        let written = changes.delete.len() + changes.add.len();
        let text = refix || !changes.classes.is_empty();
        // Classes kept ready go along with text, or alone when nothing else changes.
        let ready = if text || changes.is_empty() {
            std::mem::take(&mut table.unready)
        } else {
            BTreeSet::new()
        };
        changes
            .classes
            .extend(ready.difference(table.installed.classes()));
        // New classes go over netlink with the elements when they all can; a changed
        // ServiceCIDR list (the fixed part) makes it `nft -f` text.
        let netlink = if changes.classes.is_empty() || refix {
            None
        } else {
            netlink_classes(&fixed, &changes.classes)
        };
        if let Some(objects) = netlink {
            self.classes(family, &objects, &changes)?;
        } else if text || !changes.classes.is_empty() {
            let mut script = Vec::new();
            if refix {
                let classes = table.installed.classes().clone();
                script.extend(fixed_part(&fixed, &classes));
            }
            script.extend(change_script(&fixed, &changes));
            self.script(family, &script).await?;
        } else if !changes.is_empty() {
            self.elements(family, &changes.delete, &changes.add)?;
        }
        let gone = removed_endpoints(&changes);
        let used = changes.used_classes();
        table.installed.apply(changes);
        let installed = table.installed.classes();
        table
            .unready
            .extend(ready_classes(&used).difference(installed));
        table.fixed = Some(fixed);
        self.forget_clients(family, &gone);
        Ok(Full::Done(written))
    }

    /// Clients pinned (ClientIP affinity) to an endpoint that left its port's list are
    /// forgotten, so their next connection is balanced again instead of sent to a removed
    /// address until the timeout. A failure is only logged: those pins expire.
    fn forget_clients(&self, family: IpFamily, gone: &[Forget]) {
        if gone.is_empty() {
            return;
        }
        match blocking(|| self.io.forget_clients(family, gone)) {
            Ok(count) => debug!(?family, count, "forgot clients pinned to removed endpoints"),
            Err(err) => {
                warn!(?family, error = %err.chain(), "cannot forget clients pinned to removed endpoints; they expire")
            }
        }
    }

    /// A full sync of one family (see the module doc).
    async fn full(
        &self,
        family: IpFamily,
        request: &SyncRequest<'_>,
        ctx: &Context,
        fixed: FixedConfig,
        table: &mut Table,
    ) -> Result<Full, BackendError> {
        let started = Instant::now();
        let mut desired =
            LayoutState::from_ports(full_updates(request.state, ctx, &LayoutState::default()));
        let ready = ready_classes(desired.classes());
        desired.add_classes(ready);
        let rendered = started.elapsed();
        let (kernel, kernel_classes) = if table.trusted {
            (None, table.installed.classes().clone())
        } else {
            match self.read_back(family)? {
                Some(back) if !back.is_this_layout() => {
                    self.replace(family, &fixed, &desired, &back).await?;
                    return self.installed_now(table, desired, fixed).map(Full::Done);
                }
                Some(back) => {
                    let classes = back
                        .sets
                        .iter()
                        .filter_map(|s| Class::of_set_name(s))
                        .collect();
                    (Some(back.elements), classes)
                }
                None => (Some(Vec::new()), BTreeSet::new()),
            }
        };
        let read = started.elapsed();
        let both: BTreeSet<Class> = desired.classes().union(&kernel_classes).copied().collect();
        self.script(family, &fixed_part(&fixed, &both)).await?;
        let fixed_done = started.elapsed();
        let diffed;
        let empty = match &kernel {
            Some(read) => read.is_empty(),
            None => table.installed.element_count() == 0,
        };
        let (written, gone, unheard);
        if empty {
            // A first sync: every element added, copied a step at a time.
            diffed = started.elapsed();
            written = desired.element_count();
            gone = Vec::new();
            unheard = self.load(family, additions(&desired), written >= self.quiet_from)?;
        } else {
            let changes = match kernel {
                Some(read) => desired.repair(read),
                None => desired.repair_from(&table.installed),
            };
            // Not needed any more (a failed load reads the table back): freed before the load.
            table.installed = LayoutState::default();
            table.trusted = false;
            written = changes.delete.len() + changes.add.len();
            gone = removed_endpoints(&changes);
            diffed = started.elapsed();
            unheard = self.load(family, steps(changes), written >= self.quiet_from)?;
        }
        info!(
            ?family,
            render = ?rendered,
            read_back = ?(read - rendered),
            fixed_part = ?(fixed_done - read),
            difference = ?(diffed - fixed_done),
            elements = ?(started.elapsed() - diffed),
            written,
            "nftables full sync (verdict-free layout)"
        );
        self.forget_clients(family, &gone);
        let unused: BTreeSet<Class> = kernel_classes
            .difference(desired.classes())
            .copied()
            .collect();
        if !unused.is_empty() {
            let mut script = fixed_part(&fixed, desired.classes());
            script.extend(delete_classes_script(&fixed, &unused));
            if let Err(err) = self.script(family, &script).await {
                // Only their sets stay; the next full sync tries again.
                self.metrics.cleanup_failures.inc();
                warn!(?family, error = %err.chain(), "deleting unused nftables sets failed");
            }
        }
        self.installed_now(table, desired, fixed)?;
        if unheard {
            warn!(
                ?family,
                "another program committed to nf_tables during our element load, unheard; reading the tables back"
            );
            return Ok(Full::Unheard);
        }
        Ok(Full::Done(written))
    }

    /// Apply a full sync's element transactions. When `quiet`, this process's notification
    /// watch leaves its group meanwhile (the kernel then builds no message per element,
    /// ~40 % of a large load's kernel time), and the generation before and after tells
    /// whether anyone else committed in that time, unheard: returns whether so.
    fn load(
        &self,
        family: IpFamily,
        steps: impl IntoIterator<Item = (Vec<Element>, Vec<Element>)>,
        quiet: bool,
    ) -> Result<bool, BackendError> {
        if !quiet {
            for (delete, add) in steps {
                self.elements(family, &delete, &add)?;
            }
            return Ok(false);
        }
        let generation = || {
            blocking(|| self.io.generation())
                .map_err(|err| apply_error("nf_tables generation".to_owned(), err))
        };
        let before = generation()?;
        let commits = {
            let _quiet = self.io.quiet();
            let mut commits: u32 = 0;
            for (delete, add) in steps {
                self.elements(family, &delete, &add)?;
                commits = commits.wrapping_add(1);
            }
            commits
        };
        let after = generation()?;
        Ok(after.wrapping_sub(before) != commits)
    }

    fn installed_now(
        &self,
        table: &mut Table,
        desired: LayoutState,
        fixed: FixedConfig,
    ) -> Result<usize, BackendError> {
        let count = desired.element_count();
        table.installed = desired;
        table.unready.clear();
        table.trusted = true;
        table.fixed = Some(fixed);
        Ok(count)
    }

    /// Replace a table of another layout with this one, in one transaction.
    async fn replace(
        &self,
        family: IpFamily,
        fixed: &FixedConfig,
        desired: &LayoutState,
        back: &Readback,
    ) -> Result<(), BackendError> {
        info!(
            ?family,
            chains = back.chains.len(),
            "replacing the nftables table of another layout with the verdict-free one"
        );
        let mut elements: Vec<Element> = desired.elements().cloned().collect();
        elements.sort();
        let script = replace_table_script(fixed, desired.classes(), &elements);
        self.script(family, &script).await
    }

    fn read_back(&self, family: IpFamily) -> Result<Option<Readback>, BackendError> {
        let back = blocking(|| self.io.read_table(family)).map_err(|err| {
            apply_error(
                format!(
                    "reading the nftables table back ({} {TABLE})",
                    table_family(family)
                ),
                err,
            )
        })?;
        if let Some(back) = &back {
            debug!(
                ?family,
                chains = back.chains.len(),
                elements = back.elements.len(),
                undecoded = back.undecoded,
                "read the nftables table back"
            );
        }
        Ok(back)
    }

    async fn script(&self, family: IpFamily, lines: &[String]) -> Result<(), BackendError> {
        if lines.is_empty() {
            return Ok(());
        }
        let text = lines.join("\n") + "\n";
        self.io
            .apply_script(&text)
            .await
            .map_err(|err| apply_error(format!("nft -f - ({} {TABLE})", table_family(family)), err))
    }

    fn classes(
        &self,
        family: IpFamily,
        objects: &[ClassObject],
        changes: &Changes,
    ) -> Result<(), BackendError> {
        blocking(|| self.io.apply_classes(family, objects, changes)).map_err(|err| {
            apply_error(
                format!("nf_tables classes ({} {TABLE})", table_family(family)),
                err,
            )
        })
    }

    fn elements(
        &self,
        family: IpFamily,
        delete: &[Element],
        add: &[Element],
    ) -> Result<(), BackendError> {
        blocking(|| self.io.apply_elements(family, delete, add)).map_err(|err| {
            apply_error(
                format!("nf_tables elements ({} {TABLE})", table_family(family)),
                err,
            )
        })
    }
}

/// The objects of `classes` when netlink can write them all as nft would (slot-count and
/// affinity classes; a legacy affinity class, or a value the lowering refuses, leaves them
/// to `nft -f`).
fn netlink_classes(fixed: &FixedConfig, classes: &BTreeSet<Class>) -> Option<Vec<ClassObject>> {
    let mut objects = Vec::new();
    for class in classes {
        objects.extend(class_objects(fixed, *class)?);
    }
    match kp_nftnl::class::lower_objects(fixed.family, &objects, 1) {
        Ok(_) => Some(objects),
        Err(err) => {
            debug!(error = %err, "class left to nft -f");
            None
        }
    }
}

/// A failure of `nft` (a tool) or of nf_tables netlink (the kernel or the socket).
fn apply_error(what: String, err: ExecError) -> BackendError {
    if err.program() == io::PROGRAM {
        ApplyError::netfilter(what, err).into()
    } else {
        ApplyError::tool(what, err).into()
    }
}

/// The pins to sweep after `changes`: for each affinity port's list, the endpoint
/// addresses it deleted from the list (upstream clears an endpoint's pins with it).
fn removed_endpoints(changes: &Changes) -> Vec<Forget> {
    let endpoint = |element: &Element| match element {
        Element::AffinityEndpoint(port, list, addr, _) => Some((*port, *list, *addr)),
        _ => None,
    };
    let mut gone: BTreeMap<(AffinityPort, PinList), BTreeSet<std::net::IpAddr>> = BTreeMap::new();
    for (port, list, addr) in changes.delete.iter().filter_map(endpoint) {
        // Also when the address comes back with another port: its pins name the old one.
        gone.entry((port, list)).or_default().insert(addr);
    }
    gone.into_iter()
        .map(|((port, list), gone)| Forget {
            addresses: port.map_name(list, false),
            ports: port.map_name(list, true),
            gone,
        })
        .collect()
}

/// How early an element is added in a split full sync: what a rule looks up must be there
/// before what makes the rule match it (slots before an entry's class membership).
fn add_rank(element: &Element) -> u8 {
    match element {
        Element::Slot { .. } => 0,
        Element::Hairpin(_) | Element::Allow(..) | Element::AffinityEndpoint(..) => 1,
        Element::Entry(..) | Element::AffinityEntry(..) => 2,
        Element::ClusterIp(_) => 3,
    }
}

/// A first sync's element transactions (every element of `desired` added), in the order and
/// sizes of [`steps`], each copied from `desired` only when it is sent.
fn additions(desired: &LayoutState) -> impl Iterator<Item = (Vec<Element>, Vec<Element>)> + '_ {
    let mut order: Vec<&Element> = desired.elements().collect();
    if order.len() <= STEP {
        order.sort();
    } else {
        // Only the rank matters across steps; within one, the kernel takes any order.
        order.sort_unstable_by_key(|e| add_rank(e));
    }
    let mut at = 0;
    std::iter::from_fn(move || {
        let chunk = order.get(at..(at + STEP).min(order.len()))?;
        if chunk.is_empty() {
            return None;
        }
        at += chunk.len();
        Some((Vec::new(), chunk.iter().map(|e| (*e).clone()).collect()))
    })
}

/// A full sync's element transactions: one when it fits in [`STEP`]; else replacements
/// (same key, new data: deleted and added together) and additions in `add_rank` order,
/// then deletions in the reverse order.
pub fn steps(mut changes: Changes) -> Vec<(Vec<Element>, Vec<Element>)> {
    // Moved, not copied: a first sync's additions are every element of the table.
    let (delete, mut additions) = (
        std::mem::take(&mut changes.delete),
        std::mem::take(&mut changes.add),
    );
    if delete.len() + additions.len() <= STEP {
        if delete.is_empty() && additions.is_empty() {
            return Vec::new();
        }
        return vec![(delete, additions)];
    }
    let (replaced, mut deletions): (Vec<Element>, Vec<Element>) = if delete.is_empty() {
        (Vec::new(), Vec::new())
    } else {
        let added: BTreeSet<Element> = additions.iter().map(Element::key).collect();
        delete.into_iter().partition(|e| added.contains(&e.key()))
    };
    let replaced_keys: BTreeSet<Element> = replaced.iter().map(Element::key).collect();
    // A replaced key's new data goes in the transaction deleting its old data.
    additions.sort_by_key(|e| (!replaced_keys.contains(&e.key()), add_rank(e)));
    deletions.sort_by_key(|e| std::cmp::Reverse(add_rank(e)));
    let mut out: Vec<(Vec<Element>, Vec<Element>)> = Vec::new();
    let mut current = (replaced, Vec::new());
    for element in additions {
        if current.0.len() + current.1.len() >= STEP {
            out.push(std::mem::take(&mut current));
        }
        current.1.push(element);
    }
    for element in deletions {
        if current.0.len() + current.1.len() >= STEP || !current.1.is_empty() {
            out.push(std::mem::take(&mut current));
        }
        current.0.push(element);
    }
    if !current.0.is_empty() || !current.1.is_empty() {
        out.push(current);
    }
    out
}

impl<I: LayoutIo, C: Conntrack> Backend for LayoutBackend<I, C> {
    fn mode(&self) -> &'static str {
        MODE
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let started = Instant::now();
        // Partial only where the bookkeeping is trusted (a failure or another program's
        // change makes the next sync of that table full, whatever the core asked).
        let families = self.sync.families().to_vec();
        let untrusted = families
            .iter()
            .any(|f| !self.tables.get(f).is_some_and(|t| t.trusted));
        let kind = if untrusted {
            SyncKind::Full
        } else {
            request.kind
        };
        let mut errors = FamilyErrors::new(MODE);
        let mut written = 0;
        let mut kind = kind;
        for attempt in 1..=FULL_ATTEMPTS {
            let mut unheard = false;
            for family in &families {
                let family = *family;
                let mut table = self.tables.remove(&family).unwrap_or_default();
                let result = self.sync_family(family, request, kind, &mut table).await;
                if result.is_err() {
                    self.metrics.sync_failures.inc();
                    // Steps of a split full sync may have been applied: read the table back.
                    table.trusted = false;
                }
                match errors.check(family, result) {
                    Some(Full::Done(count)) => written += count,
                    Some(Full::Unheard) => unheard = true,
                    None => {}
                }
                self.tables.insert(family, table);
            }
            if !unheard {
                break;
            }
            // Whatever another program committed unheard, in either family's table, a full
            // sync reading both back repairs; the last attempt leaves that to the next sync.
            self.kernel_changed_behind_our_back();
            kind = SyncKind::Full;
            if attempt == FULL_ATTEMPTS {
                warn!(
                    "others kept committing during every large nftables load; the next sync repairs"
                );
            }
        }
        errors.into_result()?;
        self.sync.succeeded(request, kind, &BTreeSet::new()).await;
        debug!(?kind, written, took = ?started.elapsed(), "nftables (maps) sync finished");
        Ok(SyncReport {
            kind,
            rules_written: written,
            skipped: Vec::new(),
        })
    }

    /// Soon, while classes wait to be written ahead of their use.
    fn recheck_after(&self) -> Option<std::time::Duration> {
        self.tables
            .values()
            .any(|t| !t.unready.is_empty())
            .then_some(READY_AFTER)
    }

    /// The table and its `dispatch` and `pick` chains in every family synced so far.
    async fn verify(&mut self, _check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        let mut missing = Vec::new();
        for (family, table) in &self.tables {
            if table.fixed.is_none() {
                continue;
            }
            let chains = blocking(|| self.io.chains(*family))
                .map_err(|err| apply_error("nftables canary check".to_owned(), err))?;
            let fam = table_family(*family);
            let Some(chains) = chains else {
                missing.push(ForeignChange::removed(
                    "table",
                    format!("table {fam} {TABLE} missing"),
                ));
                continue;
            };
            for chain in [DISPATCH, PICK] {
                if !chains.iter().any(|c| c == chain) {
                    let detail = format!("chain {chain} missing in table {fam} {TABLE}");
                    missing.push(ForeignChange::removed("chain", detail));
                }
            }
        }
        Ok(missing)
    }

    fn kernel_changed_behind_our_back(&mut self) {
        for table in self.tables.values_mut() {
            table.trusted = false;
        }
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let mut first_error = None;
        for family in self.sync.families().to_vec() {
            let fam = table_family(family);
            let script = format!("add table {fam} {TABLE}\ndelete table {fam} {TABLE}\n");
            match self.io.apply_script(&script).await {
                Ok(()) => info!(?family, "removed the nftables {fam} {TABLE} table"),
                Err(err) => {
                    warn!(?family, error = %err.chain(), "nftables cleanup failed");
                    if first_error.is_none() {
                        first_error = Some(apply_error(
                            format!("nftables cleanup ({fam} {TABLE})"),
                            err,
                        ));
                    }
                }
            }
        }
        self.tables.clear();
        self.sync.reset();
        first_error.map_or(Ok(()), Err)
    }
}
