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

mod ipset;
mod links;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::backend::{Backend, BackendError, SyncKind, SyncReport, SyncRequest};
use kp_core::model::{IpFamily, ServiceName};
use kp_ipvs::{Ipvs, IpvsError, Protocol, RealServer, ServiceKey, Timeouts, VirtualServer};
use kp_rules::ipvs::ipset::{SavedSets, SetKind, destroy_input, parse_save, restore_input};
use kp_rules::ipvs::{DUMMY_DEVICE, Desired, IpvsConfig, plan, rules};
use tracing::{debug, info, warn};

use crate::conntrack::{Conntrack, DefaultConntrack};
use crate::exec::{ExecRunner, RuleRunner};
use crate::iptables::{SavedTable, cleanup_input, ensure_setup};
use crate::sync::{FamilyErrors, SyncState};
use crate::sysctls::{self, Setting, Sysctl, WriteWhen};
use kp_rules::iptables::Table;

pub use ipset::{ExecIpset, FakeIpset, IpsetRunner};
pub use links::{FakeLinks, LinkError, Links, RtLinks};

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
}

/// What ipvs mode keeps of the kernel besides the virtual servers, so partial syncs change
/// the difference without listing addresses or running `ipset save`.
#[derive(Debug)]
struct Installed {
    /// kube-ipvs0's interface index.
    dummy_index: u32,
    /// The addresses bound on kube-ipvs0.
    addresses: BTreeSet<IpAddr>,
    /// kube-proxy's ipsets by name, with their entries.
    sets: SavedSets,
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

fn apply_error(what: &str) -> impl FnOnce(String) -> BackendError + '_ {
    move |message| BackendError::Apply {
        what: what.to_owned(),
        message,
    }
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
        }
    }

    /// The configuration.
    pub fn config(&self) -> &IpvsBackendConfig {
        &self.config
    }

    async fn setup(&mut self) -> Result<(), BackendError> {
        let sysctl = BoxedSysctl(self.sysctl.as_ref());
        match sysctls::apply(&sysctl, &sysctl_plan(self.config.strict_arp)) {
            Ok(report) => {
                for warning in report.warnings {
                    warn!(%warning, "ipvs sysctl left as is");
                }
            }
            Err(error) => warn!(%error, "cannot apply ipvs sysctls; keeping the kernel's"),
        }
        if self.config.timeouts != Timeouts::default() {
            self.ipvs
                .set_timeouts(&self.config.timeouts)
                .map_err(|e| apply_error("IPVS timeouts")(e.to_string()))?;
        }
        let mut errors = FamilyErrors::new(MODE);
        for family in self.sync.families().to_vec() {
            errors.check(
                family,
                ensure_setup(&self.runner, family, &rules::setup()).await,
            );
        }
        self.sync.families_done(errors)
    }

    async fn sync_all(
        &mut self,
        request: &SyncRequest<'_>,
        kind: SyncKind,
    ) -> Result<SyncReport, BackendError> {
        // Full syncs (the first, any after a failure) re-check everything that lives outside
        // the diff (sysctls, jumps, the rules text) and list what the kernel holds, so a
        // flushed table, a reset sysctl or someone else's change is repaired within
        // syncPeriod. Partial ones diff against what the last syncs installed.
        let installed = match kind {
            SyncKind::Full => None,
            SyncKind::Partial => self.installed.take(),
        };
        let full = installed.is_none();
        if full {
            self.setup().await?;
        }
        let plans: Vec<Desired> = self
            .config
            .families
            .iter()
            .map(|f| plan(request.state, *f, &self.config.plan))
            .collect();
        let wanted_addresses: BTreeSet<IpAddr> = plans
            .iter()
            .flat_map(|p| p.addresses.iter().copied())
            .collect();

        // 1. Service addresses first, so new virtual servers receive traffic at once.
        let link_err = |e: LinkError| apply_error("kube-ipvs0")(e.to_string());
        let (index, bound, saved) = match installed {
            Some(i) => (i.dummy_index, i.addresses, i.sets),
            None => {
                let index = self
                    .links
                    .ensure_dummy(DUMMY_DEVICE)
                    .await
                    .map_err(link_err)?;
                let bound = self.links.addresses(index).await.map_err(link_err)?;
                let saved = parse_save(
                    &self
                        .ipset
                        .save()
                        .await
                        .map_err(|e| apply_error("ipset save")(e.to_string()))?,
                );
                (index, bound, saved)
            }
        };
        for ip in wanted_addresses.difference(&bound) {
            self.links.add_address(index, *ip).await.map_err(link_err)?;
        }

        // 2. ipsets: only the entries that differ, one restore for both families.
        let input: String = plans
            .iter()
            .map(|p| restore_input(p.family, &p.sets, &saved))
            .collect();
        if !input.is_empty() {
            self.ipset
                .restore(&input)
                .await
                .map_err(|e| apply_error("ipset restore")(e.to_string()))?;
        }
        let mut sets = saved;
        for p in &plans {
            for set_kind in SetKind::ALL {
                let entries = p.sets.get(&set_kind).cloned().unwrap_or_default();
                sets.insert(set_kind.name(p.family), entries);
            }
        }

        // 3. iptables: the rules depend on the configuration only.
        for p in &plans {
            let family = p.family;
            let text = rules::render(family, &self.config.plan, &p.lb_no_node_access)
                .map_err(|e| apply_error("ipvs iptables rules")(e.to_string()))?;
            if !full && self.rules_applied.get(&family) == Some(&text) {
                continue;
            }
            self.runner
                .restore(family, &text)
                .await
                .map_err(|e| apply_error("iptables-restore")(e.to_string()))?;
            self.rules_applied.insert(family, text);
        }

        // 4. IPVS: full syncs list the kernel's virtual servers, partial ones trust what the
        // last syncs programmed and touch only what differs from it.
        let listed: Option<BTreeMap<ServiceKey, VirtualServer>> = if full {
            Some(
                self.ipvs
                    .services()
                    .map_err(|e| apply_error("IPVS list")(e.to_string()))?
                    .into_iter()
                    .map(|vs| (vs.key, vs))
                    .collect(),
            )
        } else {
            None
        };
        let mut report = SyncReport::default();
        let mut skipped: BTreeSet<ServiceName> = BTreeSet::new();
        let mut applied = BTreeMap::new();
        for p in &plans {
            for (key, want) in &p.services {
                let planned = (want.server.clone(), want.real_servers.clone());
                let known = self.applied.get(key).and_then(Option::as_ref);
                let have = match &listed {
                    Some(listed) => listed.get(key),
                    None => known.map(|(vs, _)| vs),
                };
                let unchanged = !full && !self.draining.contains(key) && known == Some(&planned);
                if unchanged {
                    applied.insert(*key, Some(planned));
                    continue;
                }
                let have = have.cloned();
                match self.sync_service(have.as_ref(), &want.server, &want.real_servers) {
                    Ok((changes, draining)) => {
                        report.rules_written += changes;
                        applied.insert(*key, Some(planned));
                        if draining {
                            self.draining.insert(*key);
                        } else {
                            self.draining.remove(key);
                        }
                    }
                    Err(error) => {
                        warn!(service = %want.owner, virtual_server = %key, %error, "cannot program virtual server; skipping it");
                        skipped.insert(want.owner.clone());
                        // Ours, in whatever state the failure left it.
                        applied.insert(*key, None);
                    }
                }
            }
        }

        // 5. Stale state last: virtual servers on addresses kube-proxy manages (full syncs:
        // of those listed; partial ones: of those the last syncs programmed), then addresses.
        let excluded = |ip: &IpAddr| self.config.exclude_cidrs.iter().any(|n| n.contains(ip));
        let stale: Vec<ServiceKey> = match &listed {
            Some(listed) => {
                let ours: BTreeSet<IpAddr> = bound
                    .iter()
                    .chain(&wanted_addresses)
                    .chain(&self.config.plan.node_ips)
                    .chain(&self.config.node_addresses)
                    .copied()
                    .collect();
                listed
                    .keys()
                    .filter(|k| !applied.contains_key(*k) && ours.contains(&k.address))
                    .filter(|k| !excluded(&k.address))
                    .copied()
                    .collect()
            }
            None => self
                .applied
                .keys()
                .filter(|k| !applied.contains_key(*k) && !excluded(&k.address))
                .copied()
                .collect(),
        };
        for key in &stale {
            match self.ipvs.delete_service(key) {
                Ok(()) => {
                    debug!(virtual_server = %key, "deleted stale virtual server");
                    report.rules_written += 1;
                }
                Err(error) => {
                    warn!(virtual_server = %key, %error, "cannot delete stale virtual server");
                    // Still ours: a later sync tries again.
                    applied.insert(*key, None);
                }
            }
        }
        for ip in bound.difference(&wanted_addresses) {
            self.links
                .delete_address(index, *ip)
                .await
                .map_err(link_err)?;
        }
        self.draining.retain(|k| applied.contains_key(k));
        self.applied = applied;
        self.installed = Some(Installed {
            dummy_index: index,
            addresses: wanted_addresses,
            sets,
        });
        report.skipped = skipped.into_iter().collect();
        Ok(report)
    }

    /// Removes every KUBE- chain of `table` and the jumps into them (iptables mode's
    /// leftovers too), keeping kubelet's.
    async fn cleanup_table(&mut self, family: IpFamily, table: Table) -> Result<(), BackendError> {
        let what = format!("iptables cleanup ({family:?} {})", table.as_str());
        let text = self
            .runner
            .save(family, table)
            .await
            .map_err(|e| apply_error(&what)(e.to_string()))?;
        if let Some(input) = cleanup_input(table, &SavedTable::parse(&text)) {
            self.runner
                .restore(family, &input)
                .await
                .map_err(|e| apply_error(&what)(e.to_string()))?;
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

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let kind = self.sync.kind(request);
        match self.sync_all(request, kind).await {
            Ok(report) => {
                // UDP/SCTP flows conntrack still sends to removed endpoints (IPVS keeps its
                // own entries in step with conntrack=1), as the other modes do.
                let skipped: BTreeSet<ServiceName> = report.skipped.iter().cloned().collect();
                self.sync.succeeded(request, kind, &skipped).await;
                Ok(report)
            }
            Err(err) => {
                // The kernel may be anywhere between the old and new state: the next sync is
                // full and checks it all again.
                self.sync.failed();
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
                warn!(error = %e, "ipvs cleanup step failed");
                first.get_or_insert(e);
            }
        };
        note(
            self.ipvs
                .flush()
                .map_err(|e| apply_error("IPVS flush")(e.to_string())),
        );
        note(
            self.links
                .delete_link(DUMMY_DEVICE)
                .await
                .map(drop)
                .map_err(|e| apply_error("delete kube-ipvs0")(e.to_string())),
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
                            .map_err(|e| apply_error("ipset destroy")(e.to_string())),
                    );
                }
            }
            Err(e) => note(Err(apply_error("ipset save")(e.to_string()))),
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
