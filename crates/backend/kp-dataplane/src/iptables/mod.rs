//! iptables mode: [`IptablesBackend`] applies `kp_rules::iptables` renders to the kernel.
//!
//! One sync, per family:
//!
//! 1. On full syncs (the core asks for one first, after a failure and when it sees fit),
//!    ensure the setup: the canary and top-level chains (`-N`) and the jumps from the built-in
//!    chains (`-C`, then `-I ... 1` if missing), and list the per-service chains in place
//!    (`iptables-save -t nat`) so stale ones left by an earlier run get deleted.
//! 2. Render with the previous render's chains as `existing_chains` and apply it with one
//!    `iptables-restore --noflush` (atomic: on failure the kernel keeps the old rules).
//! 3. If a partial restore fails, retry at once as a full sync (setup included), so every
//!    other service still gets programmed, and report the sync as full; upstream would only
//!    count the failure and make the next sync full.
//! 4. If a full restore fails and the line it names belongs to one service (module `isolate`),
//!    or, when the line is no service's (the kernel checks a table at `COMMIT`), halves of
//!    the ruleset restored in throwaway network namespaces point at one service
//!    ([`RuleRunner::restore_isolated`]), render again without that service and retry, for
//!    at most three services (`isolate::MAX_ISOLATED_SERVICES`). The excluded services' chains are left
//!    as they are (neither written nor deleted), each is logged at error level and reported
//!    in [`SyncReport::skipped`], which the proxier hands to the next sync as changed.
//!    Otherwise the sync fails with [`BackendError::Apply`] (the core asks for a full sync
//!    next).
//!
//! After every family succeeded, stale UDP/SCTP conntrack entries are deleted when the core
//! says they may exist ([`crate::conntrack`]).

mod isolate;
mod nat_size;
pub mod netlink;
mod save;
#[cfg(test)]
mod tests;

use kp_core::report::ErrorChain as _;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::{Duration, Instant};

use kp_core::backend::{ApplyError, Backend, BackendError, SyncKind, SyncReport, SyncRequest};
use kp_core::foreign::{Check, ForeignChange};
use kp_core::model::{IpFamily, ServiceName};
use kp_core::tracker::ProxyState;
use kp_rules::iptables::{
    RenderConfig, RenderError, RenderOutput, StreamError, SyncScope, Table, render_to, setup,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::{debug, error, info, warn};

use crate::conntrack::{Conntrack, DefaultConntrack};
use crate::exec::{ExecError, ExecRunner, RestoreInto, RuleRunner, Tools, split_args};
use crate::sync::{FamilyErrors, SyncState};

#[cfg(any(test, feature = "test-util"))]
pub use nat_size::FakeNatSize;
pub use nat_size::{LegacyNatSize, NatCanary, NatSize, TableInfo};
pub use save::{
    KUBE_CHAIN_PREFIX, KUBE_MARK_MASQ, KUBELET_CHAINS, SavedTable, cleanup_input, is_own_chain,
    rule_target,
};

/// The mode name served on `/proxyMode`.
pub const MODE: &str = "iptables";

/// Tables cleanup scans: everything any kube-proxy mode ever put a `KUBE-` chain in.
const CLEANUP_TABLES: [Table; 3] = [Table::Filter, Table::Nat, Table::Mangle];

/// iptables exits with 1 for "chain already exists" (`-N`) and "no such rule" (`-C`); other
/// codes (2: bad arguments, 4: lock or resource problem) are real failures.
const EXIT_NOT_APPLICABLE: i32 = 1;

/// Where the kernel reports IPv6 interfaces; upstream treats its existence as "IPv6 works".
const IPV6_PROBE: &str = "/proc/net/if_inet6";

/// The families this node can program: IPv4, and IPv6 when the kernel has it (upstream runs
/// dual-stack whenever it can, whatever the cluster uses).
pub fn detect_families() -> Vec<IpFamily> {
    let mut families = vec![IpFamily::V4];
    if std::path::Path::new(IPV6_PROBE).exists() {
        families.push(IpFamily::V6);
    }
    families
}

/// What the iptables backend needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptablesConfig {
    /// Families to program, each with its own restore ([`detect_families`]).
    pub families: Vec<IpFamily>,
    /// The renderer's configuration; `node_port_addresses` already resolved to node IPs by
    /// the caller.
    pub render: RenderConfig,
}

impl IptablesConfig {
    /// Program `families` with `render`.
    pub fn new(families: Vec<IpFamily>, render: RenderConfig) -> Self {
        Self { families, render }
    }
}

/// The `table` label of `kubeproxy_sync_proxy_rules_iptables_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabel {
    /// `filter` or `nat`.
    pub table: &'static str,
}

/// The metrics upstream registers for iptables mode (besides the proxier's). Clones share
/// the series; `Default` gives unregistered ones.
#[derive(Clone, Debug, Default)]
pub struct IptablesMetrics {
    /// `kubeproxy_sync_proxy_rules_iptables_restore_failures_total`: every failed restore,
    /// partial ones included.
    pub restore_failures: Counter,
    /// `kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total`: failed partial
    /// restores (each was retried as a full one).
    pub partial_restore_failures: Counter,
    /// `kubeproxy_sync_proxy_rules_iptables_total{table}`: rules in kube-proxy's chains after
    /// the last successful sync, summed over families.
    pub rules: Family<TableLabel, Gauge>,
    /// `kube_proxy_rs_iptables_netlink_fallbacks_total` (ours): renders the netlink path
    /// ([`netlink`]) handed to `iptables-restore` (a rule it cannot encode, or a transaction
    /// the kernel refused).
    pub netlink_fallbacks: Counter,
}

impl IptablesMetrics {
    /// Create the metrics and register them. prometheus-client appends `_total` to counters
    /// itself; the gauge's upstream name already ends in it.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            "Cumulative proxy iptables restore failures",
            metrics.restore_failures.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures",
            metrics.partial_restore_failures.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_iptables_total",
            "Total number of iptables rules owned by kube-proxy",
            metrics.rules.clone(),
        );
        registry.register(
            "kube_proxy_rs_iptables_netlink_fallbacks",
            "Syncs whose rules were applied with iptables-restore instead of over nf_tables netlink",
            metrics.netlink_fallbacks.clone(),
        );
        metrics
    }
}

/// What one family's sync produced.
struct FamilyResult {
    output: RenderOutput,
    /// Full when asked, or when a partial restore failed and was retried fully.
    ran: SyncKind,
    /// Services left out of the restore because their rules failed.
    skipped: BTreeSet<ServiceName>,
}

/// Why one render-and-restore failed.
enum ApplyFailure {
    /// Rendering failed (a renderer bug; `validate` ran in the constructor).
    Render(BackendError),
    /// The restore failed (its input is not kept: [`IptablesBackend::restore_line`]
    /// renders the line the error names again).
    Restore {
        /// The tool's error.
        error: ExecError,
    },
}

impl ApplyFailure {
    fn into_backend(self, family: IpFamily) -> BackendError {
        match self {
            ApplyFailure::Render(err) => err,
            ApplyFailure::Restore { error, .. } => {
                ApplyError::tool(restore_name(family), error).into()
            }
        }
    }
}

/// iptables mode. `R` runs the iptables tools, `C` deletes conntrack entries; both are
/// fakes in tests.
#[derive(Debug)]
pub struct IptablesBackend<R = ExecRunner, C = DefaultConntrack> {
    config: IptablesConfig,
    runner: R,
    metrics: IptablesMetrics,
    /// Per family: the per-service nat chains the kernel has after the last successful
    /// restore (the next render's `existing_chains`).
    chains: BTreeMap<IpFamily, BTreeSet<String>>,
    /// Full or partial, stale conntrack entries.
    sync: SyncState<C>,
    /// Apply renders over nf_tables netlink instead of `iptables-restore` (nf_tables
    /// backend only; see [`netlink`]).
    netlink: Option<netlink::NetlinkRestore>,
    /// iptables-legacy: nat's size, so the canary check reads nat only when it changed.
    nat_canary: Option<NatCanary>,
}

impl IptablesBackend {
    /// The real backend: runs `tools`; stale conntrack entries go over ctnetlink.
    pub fn new(config: IptablesConfig, tools: Tools) -> Result<Self, RenderError> {
        Self::with_parts(config, ExecRunner::new(tools), DefaultConntrack::default())
    }
}

impl<R: RuleRunner, C: Conntrack> IptablesBackend<R, C> {
    /// A backend from its parts. Fails if the render configuration cannot be expressed as
    /// rules (checked once here, so syncs cannot fail for that reason).
    pub fn with_parts(
        config: IptablesConfig,
        runner: R,
        conntrack: C,
    ) -> Result<Self, RenderError> {
        config.render.validate()?;
        Ok(Self {
            sync: SyncState::new(config.families.clone(), conntrack),
            config,
            runner,
            metrics: IptablesMetrics::default(),
            chains: BTreeMap::new(),
            netlink: None,
            nat_canary: None,
        })
    }

    /// Apply renders with `netlink` (the caller checked [`netlink::usable`]), falling back
    /// to `iptables-restore` for a sync it cannot apply.
    pub fn with_netlink(mut self, netlink: netlink::NetlinkRestore) -> Self {
        self.netlink = Some(netlink);
        self
    }

    /// Let the canary check look at nat when `size` says it changed (iptables-legacy,
    /// [`LegacyNatSize`]); without it nat is only checked before periodic syncs.
    pub fn with_nat_size(mut self, size: impl NatSize + 'static) -> Self {
        self.nat_canary = Some(NatCanary::new(size));
        self
    }

    /// Report into `metrics` (from [`IptablesMetrics::register`]).
    pub fn with_metrics(mut self, metrics: IptablesMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &IptablesConfig {
        &self.config
    }

    /// The rule runner.
    pub fn runner(&self) -> &R {
        &self.runner
    }

    /// Ensure the chains and jumps of [`setup`] for `family`.
    async fn ensure_setup(&self, family: IpFamily) -> Result<(), BackendError> {
        ensure_setup(&self.runner, family, &setup(family, &self.config.render)).await
    }

    /// Render `state` and restore one family once.
    async fn apply(
        &self,
        family: IpFamily,
        state: &ProxyState,
        request: &SyncRequest<'_>,
        kind: SyncKind,
        existing: &BTreeSet<String>,
    ) -> Result<RenderOutput, ApplyFailure> {
        let scope = SyncScope {
            kind,
            changed: request.changed,
            existing_chains: existing,
        };
        if let Some(netlink) = &self.netlink {
            let start = Instant::now();
            match netlink
                .apply(family, state, &self.config.render, &scope)
                .await
            {
                Ok(output) => {
                    debug!(
                        ?family,
                        ?kind,
                        took = ?start.elapsed(),
                        rules_written = output.rules_written,
                        deleted_chains = output.deleted.len(),
                        "applied iptables rules over nf_tables netlink"
                    );
                    return Ok(output);
                }
                Err(err) => {
                    self.metrics.netlink_fallbacks.inc();
                    warn!(?family, ?kind, error = %err.chain(), "applying with iptables-restore instead of netlink");
                }
            }
        }
        // The render is written into the restore as it is produced (`render_to`): the
        // whole input (tens of MB at 10,000 services) never exists at once.
        let restore_start = Instant::now();
        let config = &self.config.render;
        let mut rendered = None;
        let mut fed = Duration::ZERO;
        let mut bytes = 0;
        let restored = self
            .runner
            .restore_from(family, RestoreInto::Node, |out: &mut dyn Write| {
                let start = Instant::now();
                let mut out = Counted { out, bytes: 0 };
                let result = render_to(state, family, config, &scope, &mut out);
                (fed, bytes) = (start.elapsed(), out.bytes);
                match result {
                    Ok(output) => {
                        rendered = Some(Ok(output));
                        Ok(())
                    }
                    Err(StreamError::Write(err)) => Err(err),
                    Err(StreamError::Render(err)) => {
                        rendered = Some(Err(err));
                        Err(std::io::Error::other("rendering failed"))
                    }
                }
            })
            .await;
        let output = match rendered {
            Some(Ok(output)) => output,
            // `validate` ran in the constructor; a failure here is a renderer bug.
            Some(Err(err)) => {
                return Err(ApplyFailure::Render(
                    ApplyError::render("rendering iptables rules", err).into(),
                ));
            }
            // The tool went away before the render finished (its error says why).
            None => RenderOutput::default(),
        };
        debug!(
            ?family,
            ?kind,
            // Both passes of the render and the writes (which wait for the tool to read).
            render = ?fed,
            bytes,
            rules_written = output.rules_written,
            filter_rules = output.filter_rules,
            nat_rules = output.nat_rules,
            deleted_chains = output.deleted.len(),
            "rendered iptables rules"
        );
        if let Err(error) = restored {
            self.metrics.restore_failures.inc();
            return Err(ApplyFailure::Restore { error });
        }
        debug!(
            ?family,
            ?kind,
            restore = ?restore_start.elapsed(),
            rules_written = output.rules_written,
            "applied iptables rules"
        );
        Ok(output)
    }

    /// A full sync of one family: setup, the chains in place, one restore (more when
    /// services are isolated).
    async fn full_sync(
        &self,
        family: IpFamily,
        request: &SyncRequest<'_>,
    ) -> Result<FamilyResult, BackendError> {
        let setup_start = Instant::now();
        self.ensure_setup(family).await?;
        let setup_time = setup_start.elapsed();
        let save_start = Instant::now();
        let mut existing = self.chains.get(&family).cloned().unwrap_or_default();
        existing.extend(self.service_chains_in_place(family).await);
        debug!(
            ?family,
            setup = ?setup_time,
            save = ?save_start.elapsed(),
            "prepared iptables full sync"
        );
        let mut skipped = BTreeSet::new();
        let mut reduced = None;
        loop {
            let state = reduced.as_ref().unwrap_or(request.state);
            // The excluded services' chains stay as they are and in the bookkeeping.
            let kept: BTreeSet<String> = isolate::chains_of(request.state, &skipped)
                .intersection(&existing)
                .cloned()
                .collect();
            let scope_existing: BTreeSet<String> = existing.difference(&kept).cloned().collect();
            let failure = match self
                .apply(family, state, request, SyncKind::Full, &scope_existing)
                .await
            {
                Ok(mut output) => {
                    output.chains.extend(kept);
                    return Ok(FamilyResult {
                        output,
                        ran: SyncKind::Full,
                        skipped,
                    });
                }
                Err(failure) => failure,
            };
            let ApplyFailure::Restore { error } = &failure else {
                return Err(failure.into_backend(family));
            };
            let message = error.to_string();
            let named = isolate::failed_line(&message)
                .and_then(|line| self.restore_line(family, state, request, &scope_existing, line))
                .and_then(|line| isolate::service_of_line(&line, state));
            let service = match named {
                Some(service) => Some(service),
                None => self.find_breaking_service(family, state, request).await,
            };
            let Some(service) = service else {
                return Err(failure.into_backend(family));
            };
            if skipped.len() >= isolate::MAX_ISOLATED_SERVICES {
                warn!(
                    ?family,
                    limit = isolate::MAX_ISOLATED_SERVICES,
                    "too many services fail to restore; giving up on isolation"
                );
                return Err(failure.into_backend(family));
            }
            error!(
                ?family,
                service = %service,
                error = %message,
                "restoring this service's rules failed; programming the others without it"
            );
            skipped.insert(service);
            reduced = Some(isolate::without(request.state, &skipped));
        }
    }

    /// The per-service nat chains the kernel has: one chain dump over netlink when that path
    /// is on (`iptables-save -t nat` formats every rule, seconds at scale), else the save.
    /// Only stale-chain deletion depends on this, so a failure leaves stale chains in place.
    async fn service_chains_in_place(&self, family: IpFamily) -> BTreeSet<String> {
        if let Some(netlink) = &self.netlink {
            match netlink.service_chains(family).await {
                Ok(chains) => return chains,
                Err(err) => {
                    warn!(?family, error = %err.chain(), "cannot dump nat chains; using iptables-save")
                }
            }
        }
        match self.runner.save(family, Table::Nat).await {
            Ok(text) => save::service_chains(&text),
            Err(err) => {
                warn!(?family, error = %err.chain(), "cannot list nat chains; stale chains stay");
                BTreeSet::new()
            }
        }
    }

    /// Line `line` (1-based) of the full restore input for `state` and `existing`, rendered
    /// again (the same input: the render is deterministic) into a writer that keeps only
    /// that line.
    fn restore_line(
        &self,
        family: IpFamily,
        state: &ProxyState,
        request: &SyncRequest<'_>,
        existing: &BTreeSet<String>,
        line: usize,
    ) -> Option<String> {
        let scope = SyncScope {
            kind: SyncKind::Full,
            changed: request.changed,
            existing_chains: existing,
        };
        let mut finder = isolate::LineFinder::new(line);
        render_to(state, family, &self.config.render, &scope, &mut finder).ok()?;
        finder.into_line()
    }

    /// When a full restore fails at a line of no service (typically its `COMMIT`, where the
    /// kernel checks the whole table at once), finds the one service whose rules make it
    /// fail, by restoring halves of the ruleset in empty network namespaces
    /// ([`RuleRunner::restore_isolated`]): at most 1 + 2·log2(services) restores, none of
    /// which touches the node. `None` when the whole ruleset applies there (the node is the
    /// problem, not a service), when only services together fail, or when the namespace
    /// cannot be made.
    async fn find_breaking_service(
        &self,
        family: IpFamily,
        state: &ProxyState,
        request: &SyncRequest<'_>,
    ) -> Option<ServiceName> {
        let mut suspects: Vec<ServiceName> =
            state.services.keys().map(|n| n.service.clone()).collect();
        suspects.dedup();
        let started = Instant::now();
        let mut restores = 1;
        if self
            .applies_alone(family, state, request, &suspects)
            .await?
        {
            warn!(
                ?family,
                "the ruleset applies in an empty network namespace: the restore fails because \
                 of the node, not of a service"
            );
            return None;
        }
        while suspects.len() > 1 {
            let (first, second) = suspects.split_at(suspects.len() / 2);
            restores += 1;
            if !self.applies_alone(family, state, request, first).await? {
                suspects = first.to_vec();
                continue;
            }
            restores += 1;
            if !self.applies_alone(family, state, request, second).await? {
                suspects = second.to_vec();
                continue;
            }
            warn!(
                ?family,
                suspects = suspects.len(),
                "the restore fails only with several services together; not isolating"
            );
            return None;
        }
        // Every subset failing (a shared part of the ruleset is bad) also ends here: the
        // suspect is only blamed if the others apply without it.
        let suspect = suspects.pop()?;
        let others: Vec<ServiceName> = state
            .services
            .keys()
            .map(|n| n.service.clone())
            .filter(|s| *s != suspect)
            .collect();
        restores += 1;
        if !self.applies_alone(family, state, request, &others).await? {
            warn!(?family, %suspect, "the restore fails without this service too; not isolating");
            return None;
        }
        debug!(?family, restores, took = ?started.elapsed(), "found the service breaking the restore");
        Some(suspect)
    }

    /// Whether the full ruleset of `only` (services of `state`) applies in an empty network
    /// namespace; `None` when that could not be tried.
    async fn applies_alone(
        &self,
        family: IpFamily,
        state: &ProxyState,
        request: &SyncRequest<'_>,
        only: &[ServiceName],
    ) -> Option<bool> {
        let keep: BTreeSet<&ServiceName> = only.iter().collect();
        let others: BTreeSet<ServiceName> = state
            .services
            .keys()
            .map(|n| &n.service)
            .filter(|s| !keep.contains(s))
            .cloned()
            .collect();
        let reduced = isolate::without(state, &others);
        let scope = SyncScope {
            kind: SyncKind::Full,
            changed: request.changed,
            existing_chains: &BTreeSet::new(),
        };
        let config = &self.config.render;
        let feed = |out: &mut dyn Write| {
            render_to(&reduced, family, config, &scope, out)
                .map(drop)
                .map_err(std::io::Error::other)
        };
        match self
            .runner
            .restore_from(family, RestoreInto::EmptyNamespace, feed)
            .await
        {
            Ok(()) => Some(true),
            Err(ExecError::Failed { .. }) => Some(false),
            Err(err) => {
                warn!(?family, error = %err.chain(), "cannot restore in an empty network namespace");
                None
            }
        }
    }

    async fn sync_family(
        &self,
        family: IpFamily,
        request: &SyncRequest<'_>,
    ) -> Result<FamilyResult, BackendError> {
        if request.kind == SyncKind::Partial {
            // Borrowed, not cloned: ~140,000 names at 10,000 services.
            static NO_CHAINS: BTreeSet<String> = BTreeSet::new();
            let existing = self.chains.get(&family).unwrap_or(&NO_CHAINS);
            match self
                .apply(family, request.state, request, SyncKind::Partial, existing)
                .await
            {
                Ok(output) => {
                    return Ok(FamilyResult {
                        output,
                        ran: SyncKind::Partial,
                        skipped: BTreeSet::new(),
                    });
                }
                Err(failure) => {
                    let err = failure.into_backend(family);
                    self.metrics.partial_restore_failures.inc();
                    warn!(?family, error = %err.chain(), "partial restore failed; retrying as a full sync");
                }
            }
        }
        self.full_sync(family, request).await
    }
}

impl<R: RuleRunner, C: Conntrack> Backend for IptablesBackend<R, C> {
    fn mode(&self) -> &'static str {
        MODE
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let sync_start = Instant::now();
        let mut kind = request.kind;
        let mut errors = FamilyErrors::new(MODE);
        let mut rules_written = 0;
        let (mut filter_rules, mut nat_rules) = (0, 0);
        let mut skipped = BTreeSet::new();
        for family in self.sync.families().to_vec() {
            let result = self.sync_family(family, request).await;
            if let Some(FamilyResult {
                output,
                ran,
                skipped: family_skipped,
            }) = errors.check(family, result)
            {
                if ran == SyncKind::Full {
                    kind = SyncKind::Full;
                }
                skipped.extend(family_skipped);
                rules_written += output.rules_written;
                filter_rules += output.filter_rules;
                nat_rules += output.nat_rules;
                self.chains.insert(family, output.chains);
            }
        }
        errors.into_result()?;
        for (table, count) in [("filter", filter_rules), ("nat", nat_rules)] {
            self.metrics
                .rules
                .get_or_create(&TableLabel { table })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
        self.sync.succeeded(request, kind, &skipped).await;
        if let Some(canary) = &mut self.nat_canary {
            for family in self.sync.families() {
                canary.after_sync(*family, kind);
            }
        }
        debug!(
            full = kind == SyncKind::Full,
            rules_written,
            filter_rules,
            nat_rules,
            took = ?sync_start.elapsed(),
            // Which backend restored them: legacy restores are much faster at scale.
            iptables_backend = self.runner.variant().map_or("", crate::xtables::variant_name),
            "iptables sync finished"
        );
        Ok(SyncReport {
            kind,
            rules_written,
            skipped: skipped.into_iter().collect(),
        })
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let plan = self.cleanup_plan().await;
        self.apply_cleanup(plan).await
    }

    /// Our jumps from the built-in chains, per family: what a flush or a reload removes.
    /// The canary check looks at nat's too when its size changed (iptables-legacy).
    async fn verify(&mut self, check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        let mut missing = Vec::new();
        for family in self.sync.families().to_vec() {
            let setup = setup(family, &self.config.render);
            let canary = self.nat_canary.as_mut();
            missing.extend(missing_jumps(&self.runner, canary, family, &setup, check).await?);
        }
        Ok(missing)
    }
}

/// What a cleanup has to remove, found by [`IptablesBackend::cleanup_plan`]: the restores to
/// run, and the first error met while looking.
#[derive(Debug, Default)]
pub struct CleanupPlan {
    restores: Vec<(IpFamily, Table, String)>,
    error: Option<BackendError>,
}

impl CleanupPlan {
    /// Whether there is nothing to remove and nothing went wrong.
    pub fn is_empty(&self) -> bool {
        self.restores.is_empty() && self.error.is_none()
    }
}

impl<R: RuleRunner, C: Conntrack> IptablesBackend<R, C> {
    /// Look (with `iptables-save`) for what [`Backend::cleanup`] would remove, without
    /// removing it. nftables mode looks before its first sync and removes after it: every
    /// iptables-nft call lists every nftables chain of the namespace, which costs seconds
    /// once the 100k+ chains of a large nftables table are there (and nothing when it is
    /// not), while the removal itself must wait until the nftables rules are in place.
    pub async fn cleanup_plan(&self) -> CleanupPlan {
        let mut plan = CleanupPlan::default();
        for family in self.sync.families().to_vec() {
            for table in CLEANUP_TABLES {
                let text = match self.runner.save(family, table).await {
                    Ok(text) => text,
                    Err(err) => {
                        let err = cleanup_error("save", family, table, err);
                        warn!(?family, table = table.as_str(), error = %err.chain(), "cleanup failed");
                        plan.error.get_or_insert(err);
                        continue;
                    }
                };
                if let Some(input) = cleanup_input(table, &SavedTable::parse(&text)) {
                    plan.restores.push((family, table, input));
                }
            }
        }
        plan
    }

    /// Run the restores of `plan` (from [`IptablesBackend::cleanup_plan`]); returns the
    /// first error, the plan's own included.
    pub async fn apply_cleanup(&mut self, plan: CleanupPlan) -> Result<(), BackendError> {
        let mut first_error = plan.error;
        for (family, table, input) in plan.restores {
            match self.runner.restore(family, &input).await {
                Ok(_) => info!(?family, table = table.as_str(), "removed kube-proxy chains"),
                Err(err) => {
                    let err = cleanup_error("restore", family, table, err);
                    warn!(?family, table = table.as_str(), error = %err.chain(), "cleanup failed");
                    first_error.get_or_insert(err);
                }
            }
        }
        // Whatever happened, the kernel no longer matches our bookkeeping.
        self.chains.clear();
        self.sync.reset();
        first_error.map_or(Ok(()), Err)
    }
}

fn cleanup_error(what: &str, family: IpFamily, table: Table, err: ExecError) -> BackendError {
    let what = format!("iptables cleanup ({what} {family:?} {})", table.as_str());
    ApplyError::tool(what, err).into()
}

/// `iptables-save` of every table `setup` writes to (one run for all of them where the runner
/// can), to check a setup without one `iptables -C` per chain and jump.
pub async fn save_setup_tables<R: RuleRunner>(
    runner: &R,
    family: IpFamily,
    setup: &kp_rules::iptables::Setup,
) -> Result<BTreeMap<Table, SavedTable>, ExecError> {
    let tables: BTreeSet<Table> = setup
        .chains
        .iter()
        .map(|(table, _)| *table)
        .chain(setup.jumps.iter().map(|j| j.table))
        .collect();
    let tables: Vec<Table> = tables.into_iter().collect();
    let saved = runner.save_tables(family, &tables).await?;
    Ok(saved
        .into_iter()
        .map(|(table, text)| (table, SavedTable::parse(&text)))
        .collect())
}

/// Whether `saved` holds a rule of `jump.from` jumping to `jump.to`.
pub fn jump_present(
    saved: &BTreeMap<Table, SavedTable>,
    jump: &kp_rules::iptables::JumpRule,
) -> bool {
    saved.get(&jump.table).is_some_and(|t| {
        t.rules.iter().any(|(chain, spec)| {
            chain == jump.from && rule_target(spec).as_deref() == Some(jump.to)
        })
    })
}

/// Creates the chains of `setup` that are missing and inserts its jumps (at position 1 of
/// their built-in chain) unless an equal rule is there already. Shared with ipvs mode and the
/// userspace capture.
pub async fn ensure_setup<R: RuleRunner>(
    runner: &R,
    family: IpFamily,
    setup: &kp_rules::iptables::Setup,
) -> Result<(), BackendError> {
    let fail = |err: ExecError| BackendError::from(ApplyError::tool("iptables setup", err));
    for (table, chain) in &setup.chains {
        let args = owned(&["-t", table.as_str(), "-N", chain]);
        match runner.run(family, &args).await {
            Ok(()) => debug!(?family, chain, table = table.as_str(), "created chain"),
            Err(err) if err.exit_code() == Some(EXIT_NOT_APPLICABLE) => {}
            Err(err) => return Err(fail(err)),
        }
    }
    for jump in &setup.jumps {
        let at = ["-I", jump.from, "1"];
        if ensure_rule(runner, family, jump.table, jump.from, &jump.spec, &at).await? {
            debug!(?family, from = jump.from, to = jump.to, "inserted jump");
        }
    }
    for rule in &setup.shared {
        let at = ["-A", rule.chain];
        if ensure_rule(runner, family, rule.table, rule.chain, &rule.spec, &at).await? {
            debug!(
                ?family,
                chain = rule.chain,
                "appended rule to a shared chain"
            );
        }
    }
    Ok(())
}

/// Adds the rule `spec` of `chain` at `at` (`-I CHAIN 1` or `-A CHAIN`) unless `-C` finds it;
/// whether it was added.
async fn ensure_rule<R: RuleRunner>(
    runner: &R,
    family: IpFamily,
    table: Table,
    chain: &str,
    spec: &str,
    at: &[&str],
) -> Result<bool, BackendError> {
    let fail = |err: ExecError| BackendError::from(ApplyError::tool("iptables setup", err));
    let absent = |code| code == EXIT_NOT_APPLICABLE;
    if rule_present(runner, family, table, chain, spec, absent)
        .await
        .map_err(fail)?
    {
        return Ok(false);
    }
    let mut add = owned(&["-t", table.as_str()]);
    add.extend(owned(at));
    add.extend(split_args(spec));
    runner.run(family, &add).await.map_err(fail)?;
    Ok(true)
}

/// Whether the rule `spec` is in `chain` (`iptables -C`); an exit code for which `absent`
/// holds means it is not, any other failure is an error.
async fn rule_present<R: RuleRunner>(
    runner: &R,
    family: IpFamily,
    table: Table,
    chain: &str,
    spec: &str,
    absent: impl Fn(i32) -> bool,
) -> Result<bool, ExecError> {
    let mut check = owned(&["-t", table.as_str(), "-C", chain]);
    check.extend(split_args(spec));
    match runner.run(family, &check).await {
        Ok(()) => Ok(true),
        Err(err) if err.exit_code().is_some_and(&absent) => Ok(false),
        Err(err) => Err(err),
    }
}

/// The canary check of the iptables-based modes: every jump of `setup` from a built-in
/// chain is still there (a flush of the table, or a deleted chain, takes ours with it). Any
/// exit code of `iptables -C` means absent: the target chain may be gone too (exit 2).
/// The short-period check ([`Check::Canary`]) leaves out nat's jumps: reading any chain of
/// a table copies all of it on iptables-legacy, and nat holds every service's rules; with a
/// `nat_canary` (iptables-legacy) it reads them when nat's size says it changed, and
/// remembers that size when every jump was found.
pub async fn missing_jumps<R: RuleRunner>(
    runner: &R,
    nat_canary: Option<&mut NatCanary>,
    family: IpFamily,
    setup: &kp_rules::iptables::Setup,
    check: Check,
) -> Result<Vec<ForeignChange>, BackendError> {
    let look = nat_canary.as_deref().map(|c| c.look(family));
    let check = if look.is_some_and(|l| l.changed) {
        Check::Thorough
    } else {
        check
    };
    let missing = absent_jumps(runner, family, setup, check).await?;
    if let (Some(canary), Some(look), true) = (nat_canary, look, missing.is_empty()) {
        canary.confirm(family, look);
    }
    Ok(missing)
}

/// The jumps of `setup` that `check` looks at and does not find.
async fn absent_jumps<R: RuleRunner>(
    runner: &R,
    family: IpFamily,
    setup: &kp_rules::iptables::Setup,
    check: Check,
) -> Result<Vec<ForeignChange>, BackendError> {
    let mut missing = Vec::new();
    let checked = setup
        .jumps
        .iter()
        .filter(|jump| check == Check::Thorough || jump.table != Table::Nat);
    for jump in checked {
        let present = rule_present(runner, family, jump.table, jump.from, &jump.spec, |_| true)
            .await
            .map_err(|err| ApplyError::tool("iptables canary check", err))?;
        if !present {
            let table = jump.table.as_str();
            let detail = format!(
                "jump from {} to {} missing in table {table} ({family:?})",
                jump.from, jump.to
            );
            missing.push(ForeignChange::removed("jump", detail));
        }
    }
    Ok(missing)
}

/// A writer that counts what passes through it (the `bytes` of the render log line).
struct Counted<'w> {
    out: &'w mut dyn Write,
    bytes: usize,
}

impl Write for Counted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        self.bytes += n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

fn restore_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "iptables-restore",
        IpFamily::V6 => "ip6tables-restore",
    }
}

fn owned(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| (*a).to_owned()).collect()
}
