//! ipvs mode: [`IpvsBackend`] applies `kp_rules::ipvs` plans to the kernel.
//!
//! Every sync diffs the desired state against what the kernel holds now and changes only the
//! difference: virtual servers that stay are never deleted and re-created (a changed
//! scheduler or affinity is edited in place), real servers are added, re-weighted or removed
//! one by one, `kube-ipvs0` gains and loses single addresses, and ipsets get only the
//! entries that differ, so established connections survive every update. New state is added
//! before stale state is removed.
//!
//! A real server that leaves a TCP service while it still has connections is kept at weight
//! 0 until they drain (upstream's graceful termination); later syncs delete it once its
//! counters reach zero, and while any drains the backend asks the runner for a sync within
//! [`DRAIN_CHECK_INTERVAL`] ([`Backend::recheck_after`]). UDP and SCTP real servers are
//! deleted at once.
//!
//! Full syncs (the first, every one after a failure, and when the core asks) list what the
//! kernel holds (virtual servers and their real servers, kube-ipvs0's addresses, `ipset save`)
//! and reconcile against it. Partial syncs list nothing: they diff against what the last
//! syncs programmed (virtual servers, real servers, ipset entries, addresses, kept here) and
//! read back only the real servers of virtual servers whose plan changed (or that are
//! draining), so a one-service change costs a few netlink round trips however many services
//! exist. Where the bookkeeping and the kernel disagree (a virtual server whose programming
//! failed half-way), adding and updating fall back to each other.
//!
//! One virtual server the kernel refuses is reported in [`SyncReport::skipped`] with its
//! Service; the others are still programmed.
//!
//! Nothing notifies of another program's changes here (`ipvsadm -C`, a deleted `kube-ipvs0`,
//! a flushed ipset, a firewall reload): the canary check ([`Backend::verify`], module
//! `verify`) compares the kernel with what the last sync wrote, every canary period.

mod ipset;
mod links;
mod planned;
#[cfg(test)]
mod tests;
mod verify;

use kp_core::report::ErrorChain as _;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::backend::{
    ApplyError, Backend, BackendError, Cause, SyncKind, SyncReport, SyncRequest,
};
use kp_core::foreign::{Check, ForeignChange};
use kp_core::model::{IpFamily, ServiceName};
use kp_ipvs::{Ipvs, IpvsError, Protocol, RealServer, ServiceKey, Timeouts, VirtualServer};
use kp_rules::ipvs::ipset::{SavedSets, change_input, destroy_input, parse_save, restore_input};
use kp_rules::ipvs::{DUMMY_DEVICE, Desired, DesiredService, IpvsConfig, rules};
use tracing::{debug, info, warn};

use crate::conntrack::{Conntrack, DefaultConntrack};
use crate::exec::{ExecRunner, RuleRunner};
use crate::iptables::{SavedTable, cleanup_input, ensure_setup};
use crate::sync::{FamilyErrors, SyncState};
use crate::sysctls::{self, Setting, Sysctl, WriteWhen};
use kp_rules::iptables::{JumpRule, Table};

#[cfg(any(test, feature = "test-util"))]
pub use ipset::FakeIpset;
pub use ipset::{Counts as IpsetCounts, ExecIpset, IpsetNetlinkError, IpsetRunner};
#[cfg(any(test, feature = "test-util"))]
pub use links::FakeLinks;
pub use links::{LinkError, Links, RtLinks};
use planned::{Delta, Planned};

/// What a full sync read of one family's iptables tables before writing its rules.
#[derive(Debug)]
struct SavedSetup {
    /// The jumps of ipvs mode's setup the kernel lacks (inserted with the rules' restore).
    missing: Vec<JumpRule>,
    /// The tables as saved (nat and filter).
    saved: BTreeMap<Table, SavedTable>,
}

/// Per family; a family whose tables could not be read is absent (its setup was ensured
/// run by run, and its rules are restored).
type SavedSetups = BTreeMap<IpFamily, SavedSetup>;

/// The mode name served on `/proxyMode`.
pub const MODE: &str = "ipvs";

/// The kernel's "already exists" (adding a virtual server the kernel has).
const EEXIST: i32 = 17;
/// The kernel's "no such process" (IPVS: no such virtual server).
const ESRCH: i32 = 3;

/// How often real servers draining at weight 0 are checked for remaining connections, and
/// deleted once they have none: upstream's graceful-termination check interval (one
/// minute), so a long syncPeriod does not keep drained real servers around.
pub const DRAIN_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// What the ipvs backend needs to know besides the plan's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsBackendConfig {
    /// Families to program.
    pub families: Vec<IpFamily>,
    /// The planner's configuration.
    pub plan: IpvsConfig,
    /// `ipvs.tcpTimeout`, `tcpFinTimeout`, `udpTimeout` in seconds (0: leave the kernel's).
    pub timeouts: Timeouts,
    /// `ipvs.strictARP`: do not answer ARP for kube-ipvs0's addresses on other interfaces.
    pub strict_arp: bool,
    /// `ipvs.excludeCIDRs`: virtual servers on these addresses are never deleted as stale
    /// (another agent's, e.g. on a node IP); `--cleanup` still flushes everything, as
    /// upstream.
    pub exclude_cidrs: Vec<IpNet>,
    /// Every address of the node besides `plan.node_ips` (kube-ipvs0's aside): virtual
    /// servers on them that no service wants are stale too, as NodePorts of an earlier
    /// `nodePortAddresses` are (upstream deletes every unwanted virtual server of its
    /// family; [`IpvsBackendConfig::exclude_cidrs`] protects another agent's).
    pub node_addresses: Vec<IpAddr>,
}

/// The sysctls upstream's ipvs mode sets: IPVS keeps conntrack entries (needed for
/// MASQUERADE and for the mark rules), expires connections to removed real servers and
/// persistence templates of quiescent ones, forwards packets, and with strictARP only answers
/// ARP for addresses on the receiving interface.
pub fn sysctl_plan(strict_arp: bool) -> Vec<Setting> {
    let set = |key, value| Setting {
        key,
        value,
        when: WriteWhen::Different,
        read_only_ok: false,
    };
    let mut plan = vec![
        set("proc/sys/net/ipv4/vs/conntrack", 1),
        set("proc/sys/net/ipv4/vs/expire_nodest_conn", 1),
        set("proc/sys/net/ipv4/vs/expire_quiescent_template", 1),
        set("proc/sys/net/ipv4/ip_forward", 1),
    ];
    if strict_arp {
        plan.push(set("proc/sys/net/ipv4/conf/all/arp_ignore", 1));
        plan.push(set("proc/sys/net/ipv4/conf/all/arp_announce", 2));
    }
    plan
}

/// ipvs mode. The type parameters are the kernel interfaces, swapped for fakes in tests.
pub struct IpvsBackend<I, L = RtLinks, R = ExecRunner, S = ExecIpset, C = DefaultConntrack> {
    config: IpvsBackendConfig,
    ipvs: I,
    links: L,
    runner: R,
    ipset: S,
    sysctl: Box<dyn Sysctl + Send + Sync>,
    /// Full or partial (sysctls, timeouts and jumps are ensured on every full sync), stale
    /// conntrack entries.
    sync: SyncState<C>,
    /// Rules restored per family, so partial syncs skip identical restores.
    rules_applied: BTreeMap<IpFamily, String>,
    /// What the last syncs programmed per virtual server (`None`: ours, but its state is
    /// unknown because programming it failed), so a partial sync neither lists the virtual
    /// servers nor reads back the real servers of those whose plan did not change, and
    /// knows which of ours became stale. Full syncs (and the first one, and any after a
    /// failure) list and read everything back.
    applied: BTreeMap<ServiceKey, Option<(VirtualServer, Vec<RealServer>)>>,
    /// Virtual servers with real servers still draining at weight 0: read back every sync.
    draining: BTreeSet<ServiceKey>,
    /// kube-ipvs0 and the ipsets as the last successful sync left them; `None` until a
    /// full sync succeeded and after any failure.
    installed: Option<Installed>,
    /// nf_tables notifications tell of other programs' changes to the iptables rules (the
    /// node's iptables writes to nf_tables): the short-period check leaves them out.
    iptables_watched: bool,
}

/// What ipvs mode keeps between syncs besides the virtual servers, so partial syncs plan only
/// the changed services and change the difference without listing addresses or running
/// `ipset save`: after a successful sync the kernel holds exactly these plans.
#[derive(Debug)]
struct Installed {
    /// kube-ipvs0's interface index.
    dummy_index: u32,
    /// Per family (in the configured order), every service's plan.
    planned: Vec<Planned>,
}

impl<I, L, R, S, C> std::fmt::Debug for IpvsBackend<I, L, R, S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpvsBackend")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Lends a boxed [`Sysctl`] to functions that take `&impl Sysctl`.
struct BoxedSysctl<'a>(&'a (dyn Sysctl + Send + Sync));

impl Sysctl for BoxedSysctl<'_> {
    fn read(&self, key: &str) -> Result<String, sysctls::SysctlError> {
        self.0.read(key)
    }
    fn write(&self, key: &str, value: &str) -> Result<(), sysctls::SysctlError> {
        self.0.write(key, value)
    }
}

fn link_error(e: LinkError) -> BackendError {
    ApplyError::link("kube-ipvs0", e).into()
}

/// `what` failed on `path` (an [`ApplyError`] constructor), as a sync reports it.
fn apply_error<E: Into<Cause>>(
    path: fn(String, Cause) -> ApplyError,
    what: &str,
) -> impl FnOnce(E) -> BackendError + '_ {
    move |e| path(what.to_owned(), e.into()).into()
}

impl<I: Ipvs, L: Links, R: RuleRunner, S: IpsetRunner> IpvsBackend<I, L, R, S> {
    /// A backend over the given kernel interfaces, deleting stale conntrack entries over
    /// ctnetlink.
    pub fn with_parts(
        config: IpvsBackendConfig,
        ipvs: I,
        links: L,
        runner: R,
        ipset: S,
        sysctl: Box<dyn Sysctl + Send + Sync>,
    ) -> Self {
        Self {
            sync: SyncState::new(config.families.clone(), DefaultConntrack::default()),
            config,
            ipvs,
            links,
            runner,
            ipset,
            sysctl,
            rules_applied: BTreeMap::new(),
            applied: BTreeMap::new(),
            draining: BTreeSet::new(),
            installed: None,
            iptables_watched: false,
        }
    }
}

impl<I: Ipvs, L: Links, R: RuleRunner, S: IpsetRunner, C: Conntrack> IpvsBackend<I, L, R, S, C> {
    /// The same backend deleting stale conntrack entries through `conntrack`.
    pub fn with_conntrack<D: Conntrack>(self, conntrack: D) -> IpvsBackend<I, L, R, S, D> {
        IpvsBackend {
            config: self.config,
            ipvs: self.ipvs,
            links: self.links,
            runner: self.runner,
            ipset: self.ipset,
            sysctl: self.sysctl,
            sync: self.sync.with_conntrack(conntrack),
            rules_applied: self.rules_applied,
            applied: self.applied,
            draining: self.draining,
            installed: self.installed,
            iptables_watched: self.iptables_watched,
        }
    }

    /// nf_tables notifications watch the iptables rules (`watched`): the short-period check
    /// ([`Check::Canary`]) then leaves out the jumps, which the periodic one still reads.
    pub fn with_iptables_watched(mut self, watched: bool) -> Self {
        self.iptables_watched = watched;
        self
    }

    /// The configuration.
    pub fn config(&self) -> &IpvsBackendConfig {
        &self.config
    }

    /// Sysctls and timeouts, and each family's nat and filter tables as they are (one
    /// `iptables-save` per family) with the jumps of ipvs mode's setup they lack: the rules' restore inserts
    /// those, or is skipped when nothing differs (see [`IpvsBackend::restore_rules`]). A
    /// family whose tables cannot be read gets its chains and jumps one `iptables` run at a
    /// time instead.
    async fn setup(&mut self) -> Result<SavedSetups, BackendError> {
        let sysctl = BoxedSysctl(self.sysctl.as_ref());
        match sysctls::apply(&sysctl, &sysctl_plan(self.config.strict_arp)) {
            Ok(report) => {
                for warning in report.warnings {
                    warn!(%warning, "ipvs sysctl left as is");
                }
            }
            Err(error) => {
                warn!(error = %error.chain(), "cannot apply ipvs sysctls; keeping the kernel's")
            }
        }
        if self.config.timeouts != Timeouts::default() {
            self.ipvs
                .set_timeouts(&self.config.timeouts)
                .map_err(apply_error(ApplyError::ipvs, "IPVS timeouts"))?;
        }
        let mut errors = FamilyErrors::new(MODE);
        let setup = rules::setup();
        let mut setups = SavedSetups::new();
        for family in self.sync.families().to_vec() {
            let result = match self.saved_setup(family, &setup).await {
                Ok(saved) => {
                    setups.insert(family, saved);
                    Ok(())
                }
                Err(error) => {
                    debug!(?family, error = %error.chain(), "cannot read the setup's tables; ensuring it run by run");
                    ensure_setup(&self.runner, family, &setup).await
                }
            };
            errors.check(family, result);
        }
        errors.into_result()?;
        Ok(setups)
    }

    async fn sync_all(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        // Partial syncs diff against what the last syncs installed; without that (only when
        // driven directly: the core asks for a full sync first and after a failure) or when
        // asked, a full one.
        let installed = match request.kind {
            SyncKind::Full => None,
            SyncKind::Partial => self.installed.take(),
        };
        match installed {
            Some(installed) => self.partial_sync(request, installed).await,
            None => self.full_sync(request).await,
        }
    }

    /// Plans every service and reconciles against what the kernel holds: re-checks what
    /// lives outside the diff (sysctls, jumps, the rules text) and lists virtual servers,
    /// their real servers, kube-ipvs0's addresses and the ipsets, so a flushed table, a reset
    /// sysctl or someone else's change is repaired within syncPeriod.
    async fn full_sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let started = std::time::Instant::now();
        let setups = self.setup().await?;
        let setup_took = started.elapsed();
        let planned: Vec<Planned> = self
            .config
            .families
            .iter()
            .map(|f| Planned::build(request.state, *f, &self.config.plan))
            .collect();
        let plans: Vec<&Desired> = planned.iter().map(|p| &p.desired).collect();
        let wanted_addresses: BTreeSet<IpAddr> = plans
            .iter()
            .flat_map(|p| p.addresses.iter().copied())
            .collect();

        // 1. Service addresses first, so new virtual servers receive traffic at once.
        let index = self
            .links
            .ensure_dummy(DUMMY_DEVICE)
            .await
            .map_err(link_error)?;
        let bound = self.links.addresses(index).await.map_err(link_error)?;
        for ip in wanted_addresses.difference(&bound) {
            self.links
                .add_address(index, *ip)
                .await
                .map_err(link_error)?;
        }

        let addresses_took = started.elapsed() - setup_took;
        // 2. ipsets: only the entries that differ, one restore for both families.
        let saved: SavedSets = parse_save(
            &self
                .ipset
                .save()
                .await
                .map_err(apply_error(ApplyError::tool, "ipset save"))?,
        );
        let input: String = planned
            .iter()
            .map(|p| restore_input(p.desired.family, &p.sets(), &saved))
            .collect();
        self.restore_sets(&input).await?;

        let sets_took = started.elapsed() - setup_took - addresses_took;
        // 3. iptables: the rules and the jumps the setup lacks, one restore per family (none
        // where the saves show everything in place).
        self.restore_rules(&plans, Some(&setups)).await?;
        let rules_took = started.elapsed() - setup_took - addresses_took - sets_took;

        // 4. IPVS, against the kernel's list.
        let listed = self.list_virtual_servers()?;
        let mut report = SyncReport::new(SyncKind::Full);
        let mut skipped: BTreeSet<ServiceName> = BTreeSet::new();
        let mut applied = BTreeMap::new();
        for p in &plans {
            for (key, want) in &p.services {
                let done =
                    self.program(key, want, listed.get(key), false, &mut report, &mut skipped);
                applied.insert(*key, done);
            }
        }

        // 5. Stale state last: virtual servers on addresses kube-proxy manages, then addresses.
        let ours: BTreeSet<IpAddr> = bound
            .iter()
            .chain(&wanted_addresses)
            .chain(&self.config.plan.node_ips)
            .chain(&self.config.node_addresses)
            .copied()
            .collect();
        let stale: Vec<ServiceKey> = listed
            .keys()
            .filter(|k| !applied.contains_key(*k) && ours.contains(&k.address))
            .copied()
            .collect();
        self.applied = applied;
        self.delete_stale(&stale, &mut report);
        for ip in bound.difference(&wanted_addresses) {
            self.links
                .delete_address(index, *ip)
                .await
                .map_err(link_error)?;
        }
        let applied = &self.applied;
        self.draining.retain(|k| applied.contains_key(k));
        self.installed = Some(Installed {
            dummy_index: index,
            planned,
        });
        report.skipped = skipped.into_iter().collect();
        debug!(
            setup = ?setup_took,
            addresses = ?addresses_took,
            sets = ?sets_took,
            rules = ?rules_took,
            took = ?started.elapsed(),
            "ipvs full sync finished"
        );
        Ok(report)
    }

    /// Plans only the changed services and changes only what that changes, listing nothing:
    /// their virtual servers (reading back the real servers of those whose plan differs from
    /// what was programmed), kube-ipvs0 addresses and set entries no other service shares, and
    /// the real servers still draining.
    async fn partial_sync(
        &mut self,
        request: &SyncRequest<'_>,
        mut installed: Installed,
    ) -> Result<SyncReport, BackendError> {
        let deltas: Vec<Delta> = installed
            .planned
            .iter_mut()
            .map(|p| p.update(request.state, &self.config.plan, request.changed))
            .collect();
        let index = installed.dummy_index;

        // 1. New service addresses first.
        for ip in deltas.iter().flat_map(|d| &d.added_addresses) {
            self.links
                .add_address(index, *ip)
                .await
                .map_err(link_error)?;
        }

        // 2. ipsets: the changed entries, one restore for both families.
        let input: String = installed
            .planned
            .iter()
            .zip(&deltas)
            .map(|(p, d)| change_input(p.desired.family, &d.removed_entries, &d.added_entries))
            .collect();
        self.restore_sets(&input).await?;

        // 3. iptables, when a load balancer's node access changed.
        let plans: Vec<&Desired> = installed.planned.iter().map(|p| &p.desired).collect();
        self.restore_rules(&plans, None).await?;

        // 4. IPVS: the changed virtual servers and those draining.
        let mut report = SyncReport::new(SyncKind::Partial);
        let mut skipped: BTreeSet<ServiceName> = BTreeSet::new();
        for (p, d) in plans.iter().zip(&deltas) {
            let draining = self
                .draining
                .iter()
                .filter(|k| p.services.contains_key(*k))
                .copied();
            let keys: BTreeSet<ServiceKey> = d.touched.iter().copied().chain(draining).collect();
            for key in keys {
                let Some(want) = p.services.get(&key) else {
                    continue;
                };
                let have = self
                    .applied
                    .get(&key)
                    .and_then(Option::as_ref)
                    .map(|(vs, _)| vs.clone());
                let done = self.program(&key, want, have.as_ref(), true, &mut report, &mut skipped);
                self.applied.insert(key, done);
            }
        }

        // 5. Stale state last.
        let stale: Vec<ServiceKey> = deltas.iter().flat_map(|d| &d.removed).copied().collect();
        for key in &stale {
            self.applied.remove(key);
            self.draining.remove(key);
        }
        self.delete_stale(&stale, &mut report);
        for ip in deltas.iter().flat_map(|d| &d.removed_addresses) {
            self.links
                .delete_address(index, *ip)
                .await
                .map_err(link_error)?;
        }
        self.installed = Some(installed);
        report.skipped = skipped.into_iter().collect();
        Ok(report)
    }

    /// Every virtual server the kernel holds, by key.
    fn list_virtual_servers(
        &mut self,
    ) -> Result<BTreeMap<ServiceKey, VirtualServer>, BackendError> {
        Ok(self
            .ipvs
            .services()
            .map_err(apply_error(ApplyError::ipvs, "IPVS list"))?
            .into_iter()
            .map(|vs| (vs.key, vs))
            .collect())
    }

    /// One `ipset restore` of `input`, unless it is empty.
    async fn restore_sets(&mut self, input: &str) -> Result<(), BackendError> {
        if input.is_empty() {
            return Ok(());
        }
        self.ipset
            .restore(input)
            .await
            .map_err(apply_error(ApplyError::tool, "ipset restore"))
    }

    /// Restores each family's iptables rules (they depend on the configuration and on which
    /// load balancers admit the node). A full sync (`setups`: what it read) restores a family
    /// with the jumps it lacks in the same restore, or not at all when the save shows every
    /// jump and every chain of ours holding exactly these rules; a partial one (`None`) skips
    /// a text restored before.
    async fn restore_rules(
        &mut self,
        plans: &[&Desired],
        setups: Option<&SavedSetups>,
    ) -> Result<(), BackendError> {
        for p in plans {
            let family = p.family;
            let text = rules::render(family, &self.config.plan, &p.lb_no_node_access)
                .map_err(apply_error(ApplyError::render, "ipvs iptables rules"))?;
            let input = match setups.map(|s| s.get(&family)) {
                None if self.rules_applied.get(&family) == Some(&text) => continue,
                None | Some(None) => text.clone(),
                Some(Some(setup)) if setup.missing.is_empty() => {
                    if rules_in_place(family, &text, &setup.saved) {
                        debug!(?family, "ipvs iptables rules in place; not restored");
                        self.rules_applied.insert(family, text);
                        continue;
                    }
                    text.clone()
                }
                Some(Some(setup)) => {
                    let jumps: Vec<&JumpRule> = setup.missing.iter().collect();
                    rules::with_jumps(&text, &jumps)
                }
            };
            self.runner
                .restore(family, &input)
                .await
                .map_err(apply_error(ApplyError::tool, "iptables-restore"))?;
            self.rules_applied.insert(family, text);
        }
        Ok(())
    }

    /// Brings virtual server `key` to `want` (`have`: what the kernel, or for a partial sync
    /// the bookkeeping, says it is) unless the bookkeeping says it is there already
    /// (`trust_applied`); returns its new bookkeeping entry, `None` when programming failed
    /// and its service was skipped.
    fn program(
        &mut self,
        key: &ServiceKey,
        want: &DesiredService,
        have: Option<&VirtualServer>,
        trust_applied: bool,
        report: &mut SyncReport,
        skipped: &mut BTreeSet<ServiceName>,
    ) -> Option<(VirtualServer, Vec<RealServer>)> {
        let planned = (want.server.clone(), want.real_servers.clone());
        let known = self.applied.get(key).and_then(Option::as_ref);
        if trust_applied && !self.draining.contains(key) && known == Some(&planned) {
            return Some(planned);
        }
        match self.sync_service(have, &want.server, &want.real_servers) {
            Ok((changes, draining)) => {
                report.rules_written += changes;
                if draining {
                    self.draining.insert(*key);
                } else {
                    self.draining.remove(key);
                }
                Some(planned)
            }
            Err(error) => {
                warn!(service = %want.owner, virtual_server = %key, error = %error.chain(), "cannot program virtual server; skipping it");
                skipped.insert(want.owner.clone());
                None
            }
        }
    }

    /// Deletes the stale virtual servers `keys` outside `exclude_cidrs`; one that cannot be
    /// deleted stays in the bookkeeping (state unknown) so a later sync tries again.
    fn delete_stale(&mut self, keys: &[ServiceKey], report: &mut SyncReport) {
        let excluded = |ip: &IpAddr| self.config.exclude_cidrs.iter().any(|n| n.contains(ip));
        let keys: Vec<ServiceKey> = keys
            .iter()
            .filter(|k| !excluded(&k.address))
            .copied()
            .collect();
        for key in keys {
            match self.ipvs.delete_service(&key) {
                Ok(()) => {
                    debug!(virtual_server = %key, "deleted stale virtual server");
                    report.rules_written += 1;
                }
                Err(error) => {
                    warn!(virtual_server = %key, error = %error.chain(), "cannot delete stale virtual server");
                    self.applied.insert(key, None);
                }
            }
        }
    }

    /// Removes every KUBE- chain of `table` and the jumps into them (iptables mode's
    /// leftovers too), keeping kubelet's.
    async fn cleanup_table(&mut self, family: IpFamily, table: Table) -> Result<(), BackendError> {
        let what = format!("iptables cleanup ({family:?} {})", table.as_str());
        let text = self
            .runner
            .save(family, table)
            .await
            .map_err(apply_error(ApplyError::tool, &what))?;
        if let Some(input) = cleanup_input(table, &SavedTable::parse(&text)) {
            self.runner
                .restore(family, &input)
                .await
                .map_err(apply_error(ApplyError::tool, &what))?;
        }
        Ok(())
    }

    /// Brings one virtual server and its real servers to `want`; returns the changes made and
    /// whether removed real servers are still draining.
    fn sync_service(
        &mut self,
        have: Option<&VirtualServer>,
        want: &VirtualServer,
        real_servers: &[RealServer],
    ) -> Result<(usize, bool), IpvsError> {
        let mut changes = 0;
        let mut draining = false;
        // A partial sync's `have` is what the last syncs programmed; where the kernel
        // disagrees (a virtual server whose programming failed half-way, or one deleted behind
        // our back), add and update swap so the service still converges.
        let exists = match have {
            None => match self.ipvs.add_service(want) {
                Err(err) if err.errno() == Some(EEXIST) => {
                    self.ipvs.update_service(want)?;
                    true
                }
                Err(err) => return Err(err),
                Ok(()) => false,
            },
            Some(have) if have != want => match self.ipvs.update_service(want) {
                Err(err) if err.errno() == Some(ESRCH) => {
                    self.ipvs.add_service(want)?;
                    false
                }
                Err(err) => return Err(err),
                Ok(()) => true,
            },
            Some(_) => true,
        };
        if have.is_none_or(|have| have != want) {
            changes += 1;
        }
        let listed = if exists {
            self.ipvs.destinations(&want.key)?
        } else {
            Vec::new()
        };
        let mut listed: BTreeMap<(IpAddr, u16), _> = listed
            .into_iter()
            .map(|d| ((d.server.address, d.server.port), d))
            .collect();
        for rs in real_servers {
            match listed.remove(&(rs.address, rs.port)) {
                None => {
                    self.ipvs.add_destination(&want.key, rs)?;
                    changes += 1;
                }
                Some(d) if d.server != *rs => {
                    self.ipvs.update_destination(&want.key, rs)?;
                    changes += 1;
                }
                Some(_) => {}
            }
        }
        // Gone from the endpoints: TCP real servers with connections drain at weight 0.
        for (_, d) in listed {
            let connections = d.active_connections + d.inactive_connections;
            if want.key.protocol == Protocol::Tcp && connections > 0 {
                draining = true;
                if d.server.weight != 0 {
                    let draining = RealServer {
                        weight: 0,
                        ..d.server.clone()
                    };
                    self.ipvs.update_destination(&want.key, &draining)?;
                    changes += 1;
                }
            } else {
                self.ipvs.delete_destination(&want.key, &d.server)?;
                changes += 1;
            }
        }
        Ok((changes, draining))
    }
}

/// Whether `saved` holds every chain `text` (a family's rendered rules) declares with exactly
/// its rules, in order, as `iptables-save` prints them ([`rules::saved_form`]).
fn rules_in_place(family: IpFamily, text: &str, saved: &BTreeMap<Table, SavedTable>) -> bool {
    text.split("COMMIT\n").all(|section| {
        let Some(name) = section.lines().next().and_then(|l| l.strip_prefix('*')) else {
            return section.trim().is_empty();
        };
        let Some(table) = [Table::Filter, Table::Nat]
            .into_iter()
            .find(|t| t.as_str() == name)
        else {
            return false;
        };
        let Some(have) = saved.get(&table) else {
            return false;
        };
        let want = SavedTable::parse(section);
        want.chains.iter().all(|chain| {
            let rules = |t: &SavedTable, saved_form: bool| -> Vec<String> {
                t.rules
                    .iter()
                    .filter(|(c, _)| c == chain)
                    .map(|(_, r)| {
                        if saved_form {
                            rules::saved_form(family, r)
                        } else {
                            r.clone()
                        }
                    })
                    .collect()
            };
            have.chains.contains(chain) && rules(have, false) == rules(&want, true)
        })
    })
}

impl<I: Ipvs, L: Links, R: RuleRunner, S: IpsetRunner, C: Conntrack> Backend
    for IpvsBackend<I, L, R, S, C>
{
    fn mode(&self) -> &'static str {
        MODE
    }

    /// While real servers drain, the runner syncs again within [`DRAIN_CHECK_INTERVAL`]
    /// however long syncPeriod is, so drained ones are deleted on that timer.
    fn recheck_after(&self) -> Option<std::time::Duration> {
        (!self.draining.is_empty()).then_some(DRAIN_CHECK_INTERVAL)
    }

    /// The virtual servers, `kube-ipvs0` and its addresses, the ipsets and the jumps into
    /// ipvs mode's chains, as the last sync wrote them (see module `verify`).
    async fn verify(&mut self, check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        self.find_foreign_changes(check).await
    }

    /// The next sync reads everything back, as after a failure.
    fn kernel_changed_behind_our_back(&mut self) {
        self.rules_applied.clear();
        self.installed = None;
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        match self.sync_all(request).await {
            Ok(report) => {
                // UDP/SCTP flows conntrack still sends to removed endpoints (IPVS keeps its
                // own entries in step with conntrack=1), as the other modes do.
                let skipped: BTreeSet<ServiceName> = report.skipped.iter().cloned().collect();
                self.sync.succeeded(request, report.kind, &skipped).await;
                Ok(report)
            }
            Err(err) => {
                // The kernel may be anywhere between the old and new state: the next sync
                // (full, as the core asks after a failure) checks it all again.
                self.rules_applied.clear();
                self.applied.clear();
                self.installed = None;
                Err(err)
            }
        }
    }

    /// As upstream: flush every virtual server, delete kube-ipvs0, remove the KUBE- iptables
    /// chains (iptables mode's too), then destroy the ipsets (referenced sets cannot be
    /// destroyed).
    async fn cleanup(&mut self) -> Result<(), BackendError> {
        let mut first: Option<BackendError> = None;
        let mut note = |r: Result<(), BackendError>| {
            if let Err(e) = r {
                warn!(error = %e.chain(), "ipvs cleanup step failed");
                first.get_or_insert(e);
            }
        };
        note(
            self.ipvs
                .flush()
                .map_err(apply_error(ApplyError::ipvs, "IPVS flush")),
        );
        note(
            self.links
                .delete_link(DUMMY_DEVICE)
                .await
                .map(drop)
                .map_err(apply_error(ApplyError::link, "delete kube-ipvs0")),
        );
        for family in self.sync.families().to_vec() {
            for table in [Table::Filter, Table::Nat, Table::Mangle] {
                note(self.cleanup_table(family, table).await);
            }
        }
        match self.ipset.save().await {
            Ok(text) => {
                let input = destroy_input(&parse_save(&text));
                if !input.is_empty() {
                    note(
                        self.ipset
                            .restore(&input)
                            .await
                            .map_err(apply_error(ApplyError::tool, "ipset destroy")),
                    );
                }
            }
            Err(e) => note(Err(apply_error(ApplyError::tool, "ipset save")(e))),
        }
        self.sync.reset();
        self.rules_applied.clear();
        self.applied.clear();
        self.draining.clear();
        self.installed = None;
        info!("removed ipvs mode's virtual servers, kube-ipvs0 and ipsets");
        first.map_or(Ok(()), Err)
    }
}
