//! nftables mode: [`NftablesBackend`] applies `kp_rules::nftables` renders to the kernel.
//!
//! One sync, per family:
//!
//! 1. On the family's first sync, list the `kube-proxy` table a previous process may have
//!    left (`nft -t list table`) and adopt its per-service chains and affinity sets
//!    ([`NftState::adopt`]): the first (full) sync rewrites those still in use and flushes
//!    the others, so a restart only changes what differs.
//! 2. Render against the state the kernel holds ([`NftState`], kept here) and apply the
//!    typed transaction: over nf_tables netlink ([`NetlinkNft`], which encodes the commands
//!    with `kp_nftnl` and never dumps the table), or with `nft -f -` (the transaction's
//!    text) when the encoder refuses a command (counted in
//!    `kube_proxy_rs_nftables_netlink_fallbacks_total`). A partial sync is one atomic
//!    transaction; a large full sync goes over netlink as several, in the safe order of
//!    [`Transaction::steps`](kp_rules::nftables::Transaction::steps) (services' own chains
//!    first, what makes them reachable last). The runner applies each step as soon as the
//!    renderer has made it ([`render_in_steps`], [`NftRunner::apply_in_steps`]), so neither
//!    the typed commands nor the netlink bytes of a whole first sync are in memory at once. An empty transaction (an idle partial sync) is not
//!    applied at all.
//! 3. Syncs are full at first, after any failure and when the core asks; partial otherwise
//!    (the renderer promotes a partial sync to a full one when the table's fixed part would
//!    change).
//! 4. Chains that fell out of use are flushed by the sync that finds them stale and deleted
//!    by a later one, once the newest of them was flushed at least [`STALE_CHAIN_DELAY`] ago
//!    (kernels before 6.2 keep a chain referenced for a moment after the map element
//!    pointing at it is gone). The renderer writes those deletions into the same
//!    transaction; if that transaction fails, the sync is retried at once without them and
//!    only `..._nftables_cleanup_failures_total` counts it (upstream deletes in a separate
//!    transaction with that metric), so a chain that cannot be deleted never blocks syncs.
//!
//! A failed transaction changes nothing in the kernel, so the previous [`NftState`] is kept
//! (after a failed full sync, with its chains marked as possibly holding rules, since earlier
//! steps may have been applied: the next sync empties every chain it writes),
//! the failure is counted (`kubeproxy_sync_proxy_rules_nftables_sync_failures_total`) and
//! returned as [`BackendError::Apply`] with nft's stderr (or, over netlink, the kernel's
//! error and the statement it rejected), and the core asks for a full sync next.
//!
//! After every family succeeded, stale UDP/SCTP conntrack entries are deleted exactly as in
//! iptables mode, with the shared logic of [`crate::conntrack`].
//!
//! The "drop traffic to unallocated ClusterIPs" rule covers the ranges of the cluster's
//! ServiceCIDR objects ([`ProxyState::service_cidrs`](kp_core::tracker::ProxyState)); a
//! cluster without them gets no such rule, as upstream. Not supported: the
//! `nftables.tableName` setting of the newest upstream (the table is always `kube-proxy`).

pub mod layout;
pub mod localhost;
mod netlink;
mod runner;
#[cfg(test)]
mod tests;

use kp_core::report::ErrorChain as _;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kp_core::backend::{ApplyError, Backend, BackendError, SyncKind, SyncReport, SyncRequest};
use kp_core::foreign::{Check, ForeignChange};
use kp_core::model::IpFamily;
use kp_rules::nftables::{
    NftOutput, NftScope, NftState, RenderConfig, RenderError, StepRenderError, StepSink, TABLE,
    Transaction, render, render_in_steps,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tracing::{debug, info, warn};

use crate::conntrack::{Conntrack, DefaultConntrack};
use crate::exec::ExecError;
use crate::sync::{FamilyErrors, SyncState};

pub use netlink::NetlinkNft;
pub use runner::{DEFAULT_NFT_BINARY, ExecNft, NftRunner, StepFailed, parse_listing, table_family};
#[cfg(any(test, feature = "test-util"))]
pub use runner::{FakeNft, NftCall};

/// The mode name served on `/proxyMode`.
pub const MODE: &str = "nftables";

/// How long a flushed stale chain stays before a sync deletes it (upstream's delay).
pub const STALE_CHAIN_DELAY: Duration = Duration::from_secs(1);

/// What the nftables backend needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftablesConfig {
    /// Families to program, each in its own table and transaction (see
    /// [`crate::iptables::detect_families`]).
    pub families: Vec<IpFamily>,
    /// The renderer's configuration; `node_port_addresses` already resolved to node IPs by
    /// the caller. `drop_invalid`, `localhost_node_ports` and `large_cluster_threshold` have
    /// no effect in nftables mode.
    pub render: RenderConfig,
}

impl NftablesConfig {
    /// Program `families` with `render`.
    pub fn new(families: Vec<IpFamily>, render: RenderConfig) -> Self {
        Self { families, render }
    }
}

/// The metrics upstream registers for nftables mode (besides the proxier's). Clones share
/// the series; `Default` gives unregistered ones.
#[derive(Clone, Debug, Default)]
pub struct NftablesMetrics {
    /// `kubeproxy_sync_proxy_rules_nftables_sync_failures_total`: failed sync transactions,
    /// per family.
    pub sync_failures: Counter,
    /// `kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total`: failed deletions of
    /// stale chains.
    pub cleanup_failures: Counter,
    /// `kube_proxy_rs_nftables_netlink_fallbacks_total` (ours): transactions applied with
    /// `nft -f -` because they held a statement the netlink translator does not support.
    pub netlink_fallbacks: Counter,
}

impl NftablesMetrics {
    /// Create the metrics and register them (prometheus-client appends `_total`).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            metrics.sync_failures.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
            "Cumulative proxy nftables cleanup failures",
            metrics.cleanup_failures.clone(),
        );
        registry.register(
            "kube_proxy_rs_nftables_netlink_fallbacks",
            "Transactions applied with nft -f because the netlink translator does not support one of their statements",
            metrics.netlink_fallbacks.clone(),
        );
        metrics
    }
}

/// What the backend knows about one family's table.
#[derive(Debug, Default)]
struct FamilyTable {
    /// What the kernel holds, as of the last successful transaction.
    installed: NftState,
    /// Whether the table a previous process left was looked at.
    adopted: bool,
    /// When the last transaction that flushed stale chains was applied.
    last_flush: Option<Instant>,
    /// When the adopted table was the verdict-free layout's (a rollback from it): its own
    /// chains and sets, deleted once the first sync has taken the base chains over.
    leftovers: Option<Transaction>,
}

/// nftables mode. `R` runs `nft`, `C` deletes conntrack entries; both are fakes in tests.
#[derive(Debug)]
pub struct NftablesBackend<R = NetlinkNft, C = DefaultConntrack> {
    config: NftablesConfig,
    runner: R,
    metrics: NftablesMetrics,
    stale_delay: Duration,
    tables: BTreeMap<IpFamily, FamilyTable>,
    /// Full or partial, stale conntrack entries.
    sync: SyncState<C>,
}

impl NftablesBackend {
    /// The real backend: transactions go over nf_tables netlink ([`NetlinkNft`]), or to
    /// `nft` from the `PATH` when the translator does not support a statement; stale
    /// conntrack entries go over ctnetlink.
    pub fn new(config: NftablesConfig) -> Result<Self, RenderError> {
        Self::with_metrics_registered(config, NftablesMetrics::default())
    }

    /// [`NftablesBackend::new`] reporting into `metrics` (from
    /// [`NftablesMetrics::register`]), the runner's fallbacks included.
    pub fn with_metrics_registered(
        config: NftablesConfig,
        metrics: NftablesMetrics,
    ) -> Result<Self, RenderError> {
        let runner = NetlinkNft::new(ExecNft::default(), metrics.netlink_fallbacks.clone());
        Ok(Self::with_parts(config, runner, DefaultConntrack::default())?.with_metrics(metrics))
    }
}

impl<R: NftRunner, C: Conntrack> NftablesBackend<R, C> {
    /// A backend from its parts. Fails if the render configuration cannot be expressed as
    /// rules (checked once here, so syncs cannot fail for that reason).
    pub fn with_parts(
        config: NftablesConfig,
        runner: R,
        conntrack: C,
    ) -> Result<Self, RenderError> {
        config.render.validate()?;
        Ok(Self {
            sync: SyncState::new(config.families.clone(), conntrack),
            config,
            runner,
            metrics: NftablesMetrics::default(),
            stale_delay: STALE_CHAIN_DELAY,
            tables: BTreeMap::new(),
        })
    }

    /// Report into `metrics` (from [`NftablesMetrics::register`]).
    pub fn with_metrics(mut self, metrics: NftablesMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Delete flushed stale chains only this long after the newest was flushed (default
    /// [`STALE_CHAIN_DELAY`]; tests shorten or lengthen it).
    pub fn with_stale_chain_delay(mut self, delay: Duration) -> Self {
        self.stale_delay = delay;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &NftablesConfig {
        &self.config
    }

    /// The runner.
    pub fn runner(&self) -> &R {
        &self.runner
    }

    /// What the backend believes `family`'s table holds.
    pub fn installed(&self, family: IpFamily) -> Option<&NftState> {
        self.tables.get(&family).map(|t| &t.installed)
    }

    /// The state to start `family` from: what a previous process left, adopted, and what
    /// of the verdict-free layout's it left to delete.
    async fn adopt(&self, family: IpFamily) -> (NftState, Option<Transaction>) {
        match self.runner.list_table(family).await {
            // No table: nothing to adopt, and every chain is known (there is none).
            Ok(None) => (NftState::adopt([], []), None),
            Ok(Some(text)) => {
                let (chains, sets) = parse_listing(&text);
                let leftovers = layout_leftovers(family, &chains, &sets);
                let state = NftState::adopt(chains, sets);
                info!(
                    ?family,
                    chains = state.chains().len(),
                    affinity_sets = state.affinity_sets().len(),
                    verdict_free_layout = leftovers.is_some(),
                    "adopting the existing nftables table"
                );
                (state, leftovers)
            }
            // Only the removal of a previous process's leftovers depends on this.
            Err(err) => {
                warn!(?family, error = %err.chain(), "cannot list the nftables table; stale chains stay");
                (NftState::default(), None)
            }
        }
    }

    fn render(
        &self,
        family: IpFamily,
        request: &SyncRequest<'_>,
        scope: &NftScope<'_>,
    ) -> Result<NftOutput, BackendError> {
        // `validate` ran in the constructor; a failure here is a renderer bug.
        render(request.state, family, &self.config.render, scope).map_err(render_error)
    }

    /// Render (and, when the runner applies full syncs step by step, apply all but the last
    /// step of) one family's sync. Returns the output, whose transaction is what is left to
    /// apply, and the time the steps took to apply. `partly_applied` is set when steps were
    /// applied before a failure.
    fn render_applying_steps(
        &self,
        family: IpFamily,
        request: &SyncRequest<'_>,
        scope: &NftScope<'_>,
        partly_applied: &mut bool,
    ) -> Result<(NftOutput, Duration), BackendError> {
        let mut steps_took = Duration::ZERO;
        let streamed = self.runner.apply_in_steps(|sink| {
            let mut timed = TimedSink {
                inner: sink,
                took: &mut steps_took,
            };
            render_in_steps(
                request.state,
                family,
                &self.config.render,
                scope,
                &mut timed,
            )
        });
        match streamed {
            None => Ok((self.render(family, request, scope)?, Duration::ZERO)),
            Some(Ok(output)) => Ok((output, steps_took)),
            Some(Err(StepRenderError::Render(err))) => Err(render_error(err)),
            // Nothing was applied: the whole transaction goes the usual way, which sends it
            // to `nft` (the fallback counts it).
            Some(Err(StepRenderError::Step {
                error: StepFailed::Refused(_),
                applied: 0,
            })) => Ok((self.render(family, request, scope)?, Duration::ZERO)),
            Some(Err(StepRenderError::Step { error, applied })) => {
                *partly_applied = applied > 0;
                let what = format!(
                    "nft -f - ({} {TABLE}, step {} of a full sync)",
                    table_family(family),
                    applied + 1
                );
                // Steps are applied over netlink only.
                Err(ApplyError::netfilter(what, error).into())
            }
        }
    }

    /// Apply `output`, rendered in `render_took`, whose earlier steps took `steps_took`.
    async fn run_script(
        &self,
        family: IpFamily,
        output: &NftOutput,
        render_took: Duration,
        steps_took: Duration,
    ) -> Result<(), BackendError> {
        let start = Instant::now();
        if !output.transaction.is_empty() {
            self.runner
                .apply(&output.transaction)
                .await
                .map_err(|err| {
                    runner_error(format!("nft -f - ({} {TABLE})", table_family(family)), err)
                })?;
        }
        debug!(
            ?family,
            kind = ?output.kind,
            took = ?(steps_took + start.elapsed()),
            render = ?render_took,
            steps = output.steps_applied + usize::from(!output.transaction.is_empty()),
            operations = output.operations,
            services_written = output.services_written,
            flushed_stale = output.flushed_stale.len(),
            deleted_chains = output.deleted_chains.len(),
            deleted_sets = output.deleted_sets.len(),
            "applied nftables transaction"
        );
        Ok(())
    }

    /// Render and apply one family; on success returns the output whose state is now
    /// installed.
    /// On failure, `partly_applied` tells whether some steps of the failed sync may have
    /// been applied (by [`NftRunner::apply_in_steps`], or see [`NftRunner::splits`]).
    async fn sync_family(
        &self,
        family: IpFamily,
        request: &SyncRequest<'_>,
        kind: SyncKind,
        table: &FamilyTable,
        partly_applied: &mut bool,
    ) -> Result<NftOutput, BackendError> {
        let existing = &table.installed;
        let delete_stale = !existing.pending_deletions().is_empty()
            && table
                .last_flush
                .is_none_or(|at| at.elapsed() >= self.stale_delay);
        let scope = |existing, delete_stale| NftScope {
            kind,
            changed: request.changed,
            existing,
            delete_stale,
            service_cidrs: &request.state.service_cidrs,
        };
        let render_start = Instant::now();
        let (output, steps_took) = self.render_applying_steps(
            family,
            request,
            &scope(existing, delete_stale),
            partly_applied,
        )?;
        if output.steps_applied == 0 && output.transaction.is_empty() {
            return Ok(output);
        }
        let render_took = render_start.elapsed().saturating_sub(steps_took);
        let Err(err) = self
            .run_script(family, &output, render_took, steps_took)
            .await
        else {
            return Ok(output);
        };
        *partly_applied = output.steps_applied > 0 || self.runner.splits(&output.transaction);
        if output.deleted_chains.is_empty() {
            return Err(err);
        }
        // Perhaps only the deletion of stale chains failed (a chain still referenced): do
        // the sync without it, and leave the chains pending for a later one. If earlier
        // steps may have been applied, every chain may hold rules.
        let forgotten;
        let existing = if *partly_applied {
            let mut state = existing.clone();
            state.forget_chain_contents();
            forgotten = state;
            &forgotten
        } else {
            existing
        };
        let render_start = Instant::now();
        let mut retry_partly = false;
        let retried =
            self.render_applying_steps(family, request, &scope(existing, false), &mut retry_partly);
        let retried = match retried {
            Ok((retry, steps_took)) => {
                let render_took = render_start.elapsed().saturating_sub(steps_took);
                self.run_script(family, &retry, render_took, steps_took)
                    .await
                    .map(|()| retry)
            }
            Err(err) => Err(err),
        };
        match retried {
            Ok(retry) => {
                self.metrics.cleanup_failures.inc();
                warn!(
                    ?family,
                    chains = ?output.deleted_chains,
                    error = %err.chain(),
                    "deleting stale nftables chains failed; they stay for a later sync"
                );
                Ok(retry)
            }
            Err(_) => Err(err),
        }
    }
}

impl<R: NftRunner, C: Conntrack> NftablesBackend<R, C> {
    /// Delete what the verdict-free layout left (its base chains are ours now); a failure
    /// only leaves unreferenced chains and sets behind.
    async fn remove_leftovers(&self, family: IpFamily, leftovers: &Transaction) {
        match self.runner.apply(leftovers).await {
            Ok(()) => info!(?family, "removed the verdict-free layout's chains and sets"),
            Err(err) => {
                self.metrics.cleanup_failures.inc();
                warn!(?family, error = %err.chain(), "cannot remove the verdict-free layout's chains and sets");
            }
        }
    }
}

/// When `chains` hold the verdict-free layout's `dispatch`: the transaction deleting its own
/// chains (flushed first, since they jump to each other) and sets.
fn layout_leftovers(
    family: IpFamily,
    chains: &[String],
    sets: &[(String, Option<u64>)],
) -> Option<Transaction> {
    use kp_rules::nftables::Command;
    use kp_rules::nftables::layout::fixed::{DISPATCH, OWN_CHAINS, is_own_set};
    if !chains.iter().any(|c| c == DISPATCH) {
        return None;
    }
    let own: Vec<&String> = chains
        .iter()
        .filter(|c| OWN_CHAINS.contains(&c.as_str()))
        .collect();
    let mut commands: Vec<Command> = own
        .iter()
        .map(|c| Command::FlushChain((*c).into()))
        .collect();
    commands.extend(own.iter().map(|c| Command::DeleteChain((*c).into())));
    commands.extend(
        sets.iter()
            .filter(|(s, _)| is_own_set(s))
            .map(|(s, _)| Command::DeleteSet(s.into())),
    );
    Some(Transaction::new(family, commands))
}

/// A render failure: `validate` ran in the constructor, so this is a renderer bug.
fn render_error(err: RenderError) -> BackendError {
    ApplyError::render("rendering nftables rules", err).into()
}

/// A runner's failure: `nft`'s, or the kernel's over netlink (reported the way `nft`'s is).
fn runner_error(what: String, err: ExecError) -> BackendError {
    if err.program() == netlink::PROGRAM {
        ApplyError::netfilter(what, err).into()
    } else {
        ApplyError::tool(what, err).into()
    }
}

/// A [`StepSink`] adding the time its steps take to `took`, so that the log tells rendering
/// from applying.
struct TimedSink<'a, 'b> {
    inner: &'a mut dyn StepSink<Error = StepFailed>,
    took: &'b mut Duration,
}

impl StepSink for TimedSink<'_, '_> {
    type Error = StepFailed;

    fn max_commands(&self) -> usize {
        self.inner.max_commands()
    }

    fn apply_step(
        &mut self,
        family: IpFamily,
        commands: &[kp_rules::nftables::Command],
    ) -> Result<(), StepFailed> {
        let start = Instant::now();
        let result = self.inner.apply_step(family, commands);
        *self.took += start.elapsed();
        result
    }
}

impl<R: NftRunner, C: Conntrack> Backend for NftablesBackend<R, C> {
    fn mode(&self) -> &'static str {
        MODE
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let sync_start = Instant::now();
        let kind = request.kind;
        // What ran: the renderer rewrites everything when the fixed part changed.
        let mut ran = kind;
        let mut errors = FamilyErrors::new(MODE);
        let mut operations = 0;
        // Until both tables are adopted, the family with fewer service ports first: the
        // `nft` listing that adopts a table dumps every chain of the namespace, which takes
        // seconds once the other family's table holds 100k+ chains (see bench/notes/2026-11-23-nftables-after-scale-work.md).
        // Applying goes over netlink without a dump, so later syncs skip this count.
        let mut families = self.sync.families().to_vec();
        if families
            .iter()
            .any(|f| !self.tables.get(f).is_some_and(|t| t.adopted))
        {
            families.sort_by_key(|family| {
                request
                    .state
                    .services
                    .values()
                    .filter(|svc| svc.cluster_ips.iter().any(|ip| IpFamily::of(ip) == *family))
                    .count()
            });
        }
        for family in families {
            let mut table = self.tables.remove(&family).unwrap_or_default();
            if !table.adopted {
                (table.installed, table.leftovers) = self.adopt(family).await;
                table.adopted = true;
            }
            let mut partly_applied = false;
            let result = self
                .sync_family(family, request, kind, &table, &mut partly_applied)
                .await;
            if result.is_err() {
                self.metrics.sync_failures.inc();
                if partly_applied {
                    // Chains written by the applied steps are not in the state.
                    table.installed.forget_chain_contents();
                }
            }
            if let Some(output) = errors.check(family, result) {
                if output.kind == SyncKind::Full {
                    ran = SyncKind::Full;
                }
                operations += output.operations;
                if !output.flushed_stale.is_empty() {
                    table.last_flush = Some(Instant::now());
                }
                output.update.apply(&mut table.installed);
                if let Some(leftovers) = table.leftovers.take() {
                    self.remove_leftovers(family, &leftovers).await;
                }
            }
            self.tables.insert(family, table);
        }
        errors.into_result()?;
        self.sync.succeeded(request, ran, &BTreeSet::new()).await;
        debug!(
            full = ran == SyncKind::Full,
            operations,
            took = ?sync_start.elapsed(),
            "nftables sync finished"
        );
        Ok(SyncReport {
            kind: ran,
            rules_written: operations,
            skipped: Vec::new(),
        })
    }

    /// The `kube-proxy` table of every family synced so far (`nft flush ruleset`, a
    /// firewall reload deleting all tables).
    async fn verify(&mut self, _check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        let mut missing = Vec::new();
        for (family, table) in &self.tables {
            if !table.adopted {
                continue;
            }
            let exists = self
                .runner
                .table_exists(*family)
                .await
                .map_err(|err| runner_error("nftables canary check".to_owned(), err))?;
            if !exists {
                let detail = format!("table {} {TABLE} missing", table_family(*family));
                missing.push(ForeignChange::removed("table", detail));
            }
        }
        Ok(missing)
    }

    /// Read the tables again before the next sync ([`NftState::adopt`]): what the
    /// bookkeeping says they hold may be gone.
    fn kernel_changed_behind_our_back(&mut self) {
        for table in self.tables.values_mut() {
            table.adopted = false;
        }
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let mut first_error = None;
        for family in self.sync.families().to_vec() {
            let fam = table_family(family);
            // `add` first, so that deleting an absent table is not an error.
            match self.runner.apply(&Transaction::remove_table(family)).await {
                Ok(()) => info!(?family, "removed the nftables {fam} {TABLE} table"),
                Err(err) => {
                    warn!(?family, error = %err.chain(), "nftables cleanup failed");
                    first_error.get_or_insert(runner_error(
                        format!("nftables cleanup ({fam} {TABLE})"),
                        err,
                    ));
                }
            }
        }
        // Whatever happened, the kernel no longer matches our bookkeeping; the next sync
        // starts over (and adopts whatever is left).
        self.tables.clear();
        self.sync.reset();
        first_error.map_or(Ok(()), Err)
    }
}
