//! ipvs mode's canary check ([`Backend::verify`](kp_core::backend::Backend::verify)): no
//! notification tells of `ipvsadm -C`, a deleted `kube-ipvs0`, a flushed ipset or a firewall
//! reload, so the check compares the kernel with what the last successful sync wrote:
//!
//! - the virtual servers (one IPVS dump): missing or changed ones;
//! - `kube-ipvs0` (one link dump) and its addresses (one address dump): missing ones;
//! - every kube-proxy ipset (one netlink dump of the sets' headers, what `ipset list -t`
//!   reads, without running the tool): missing sets, changed entry counts;
//! - the jumps from the built-in chains into ipvs mode's chains, from one `iptables-save` per
//!   family (not one `iptables -C` per jump: each exec costs milliseconds, and the check runs
//!   every canary period). ipvs mode's nat holds a few
//!   rules matching ipsets, not every service's, so reading it stays cheap even on
//!   iptables-legacy. Where nf_tables notifications watch the iptables rules, only the
//!   thorough check reads them.
//!
//! [`Check::Thorough`] (before periodic syncs) also reads back the real servers of each
//! virtual server, one dump each. Each kind of finding is one [`ForeignChange`], however many
//! objects it covers, so an `ipvsadm -C` at 10k services is one line naming the count.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kp_core::backend::{ApplyError, BackendError};
use kp_core::foreign::{Check, ForeignChange};
use kp_ipvs::{Ipvs, ServiceKey};
use kp_rules::ipvs::ipset::SetKind;
use kp_rules::ipvs::{DUMMY_DEVICE, rules};

use super::{IpsetRunner, IpvsBackend, Links, SavedSetup, apply_error, link_error};
use crate::conntrack::Conntrack;
use crate::exec::RuleRunner;
use crate::iptables::{SavedTable, jump_present, save_setup_tables};
use kp_core::model::IpFamily;
use kp_rules::iptables::{Setup, Table};

/// Objects of one kind that are not as written: how many of how many, and the first.
struct Tally<T> {
    bad: usize,
    of: usize,
    first: Option<T>,
}

impl<T> Tally<T> {
    fn new() -> Self {
        Self {
            bad: 0,
            of: 0,
            first: None,
        }
    }

    fn count(&mut self, ok: bool, item: impl FnOnce() -> T) {
        self.of += 1;
        if !ok {
            self.bad += 1;
            if self.first.is_none() {
                self.first = Some(item());
            }
        }
    }
}

impl<T: std::fmt::Display> Tally<T> {
    /// One finding when something was not as written: `{bad} of {of} {what} {how} (first:
    /// {first})`, a removal or (`removed` false) a change.
    fn finding(
        &self,
        removed: bool,
        label: &'static str,
        what: &str,
        how: &str,
    ) -> Option<ForeignChange> {
        let first = self.first.as_ref()?;
        let detail = format!("{} of {} {what} {how} (first: {first})", self.bad, self.of);
        Some(if removed {
            ForeignChange::removed(label, detail)
        } else {
            ForeignChange::changed(label, detail)
        })
    }
}

impl<I: Ipvs, L: Links, R: RuleRunner, S: IpsetRunner, C: Conntrack> IpvsBackend<I, L, R, S, C> {
    /// Everything the check covers; empty until a full sync succeeded and after a failed one
    /// (the next sync is full and reads the kernel anyway).
    pub(super) async fn find_foreign_changes(
        &mut self,
        check: Check,
    ) -> Result<Vec<ForeignChange>, BackendError> {
        if self.installed.is_none() {
            return Ok(Vec::new());
        }
        let mut found = Vec::new();
        found.extend(self.check_virtual_servers(check)?);
        found.extend(self.check_device().await?);
        found.extend(self.check_sets().await?);
        if check == Check::Thorough || !self.iptables_watched {
            for family in self.sync.families().to_vec() {
                found.extend(self.check_jumps(family).await?);
            }
        }
        Ok(found)
    }

    /// The jumps of ipvs mode's setup from the built-in chains, read from one save of each
    /// table they live in.
    async fn check_jumps(&mut self, family: IpFamily) -> Result<Vec<ForeignChange>, BackendError> {
        let setup = rules::setup();
        let saved = self.saved_tables(family, &setup).await?;
        let mut missing = Vec::new();
        for jump in &setup.jumps {
            if !jump_present(&saved, jump) {
                let detail = format!(
                    "jump from {} to {} missing in table {} ({family:?})",
                    jump.from,
                    jump.to,
                    jump.table.as_str()
                );
                missing.push(ForeignChange::removed("jump", detail));
            }
        }
        Ok(missing)
    }

    /// `family`'s tables of `setup` (one `iptables-save` for all), with the jumps they lack:
    /// a full sync inserts those with its rules' restore instead of one `iptables` run per
    /// chain and jump (the restore declares every chain, so missing chains need nothing
    /// more), or skips the restore when nothing differs.
    pub(super) async fn saved_setup(
        &mut self,
        family: IpFamily,
        setup: &Setup,
    ) -> Result<SavedSetup, BackendError> {
        let saved = self.saved_tables(family, setup).await?;
        let missing = setup
            .jumps
            .iter()
            .filter(|jump| !jump_present(&saved, jump))
            .cloned()
            .collect();
        Ok(SavedSetup { missing, saved })
    }

    /// `iptables-save` of every table `setup` writes to.
    async fn saved_tables(
        &mut self,
        family: IpFamily,
        setup: &Setup,
    ) -> Result<BTreeMap<Table, SavedTable>, BackendError> {
        save_setup_tables(&self.runner, family, setup)
            .await
            .map_err(apply_error(ApplyError::tool, "iptables-save"))
    }

    /// The virtual servers the last syncs wrote (and, thoroughly, their real servers).
    fn check_virtual_servers(&mut self, check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        let listed = self.list_virtual_servers()?;
        let (mut missing, mut changed) = (Tally::new(), Tally::new());
        let mut present = Vec::new();
        for (key, (want, _)) in self
            .applied
            .iter()
            .filter_map(|(k, a)| Some((k, a.as_ref()?)))
        {
            let have = listed.get(key);
            missing.count(have.is_some(), || *key);
            if let Some(have) = have {
                changed.count(have == want, || *key);
                present.push(*key);
            }
        }
        let mut found: Vec<ForeignChange> = [
            missing.finding(true, "virtual-server", "virtual servers", "missing in IPVS"),
            changed.finding(
                false,
                "virtual-server",
                "virtual servers",
                "changed in IPVS",
            ),
        ]
        .into_iter()
        .flatten()
        .collect();
        if check == Check::Thorough {
            found.extend(self.check_real_servers(&present)?);
        }
        Ok(found)
    }

    /// The real servers of the virtual servers `keys` (present in the kernel): every one the
    /// last syncs wrote is there as written (those draining at weight 0 are not compared).
    fn check_real_servers(
        &mut self,
        keys: &[ServiceKey],
    ) -> Result<Option<ForeignChange>, BackendError> {
        let mut tally = Tally::new();
        for key in keys {
            let Some(Some((_, want))) = self.applied.get(key) else {
                continue;
            };
            let want = want.clone();
            let listed = self
                .ipvs
                .destinations(key)
                .map_err(apply_error(ApplyError::ipvs, "IPVS list"))?;
            let have: std::collections::HashSet<_> = listed.into_iter().map(|d| d.server).collect();
            for rs in want {
                tally.count(have.contains(&rs), || {
                    format!("{}:{} of {key}", rs.address, rs.port)
                });
            }
        }
        Ok(tally.finding(
            true,
            "real-server",
            "real servers",
            "missing or changed in IPVS",
        ))
    }

    /// `kube-ipvs0` exists (the one the last sync wrote to) and holds every service address.
    async fn check_device(&mut self) -> Result<Option<ForeignChange>, BackendError> {
        let Some(installed) = &self.installed else {
            return Ok(None);
        };
        let written = installed.dummy_index;
        let wanted: BTreeSet<IpAddr> = installed
            .planned
            .iter()
            .flat_map(|p| p.desired.addresses.iter().copied())
            .collect();
        let index = match self
            .links
            .find_link(DUMMY_DEVICE)
            .await
            .map_err(link_error)?
        {
            None => {
                let detail = format!("device {DUMMY_DEVICE} missing");
                return Ok(Some(ForeignChange::removed("device", detail)));
            }
            Some(index) if index != written => {
                let detail = format!("device {DUMMY_DEVICE} deleted and created again");
                return Ok(Some(ForeignChange::removed("device", detail)));
            }
            Some(index) => index,
        };
        let bound = self.links.addresses(index).await.map_err(link_error)?;
        let mut tally = Tally::new();
        for ip in &wanted {
            tally.count(bound.contains(ip), || *ip);
        }
        let on = format!("missing on {DUMMY_DEVICE}");
        Ok(tally.finding(true, "address", "service addresses", &on))
    }

    /// Every set of every family exists and holds as many entries as the last sync wrote.
    async fn check_sets(&mut self) -> Result<Vec<ForeignChange>, BackendError> {
        let Some(installed) = &self.installed else {
            return Ok(Vec::new());
        };
        let wanted: BTreeMap<String, usize> = installed
            .planned
            .iter()
            .flat_map(|p| {
                let family = p.desired.family;
                p.set_sizes()
                    .into_iter()
                    .map(move |(kind, n)| (SetKind::name(kind, family), n))
            })
            .collect();
        let sizes = self
            .ipset
            .entry_counts()
            .await
            .map_err(apply_error(ApplyError::tool, "ipset list"))?;
        let (mut missing, mut changed) = (Tally::new(), Tally::new());
        for (name, want) in &wanted {
            let have = sizes.get(name);
            missing.count(have.is_some(), || name.clone());
            // A version of ipset that prints no count is not compared.
            if let Some(Some(have)) = have {
                changed.count(have == want, || {
                    format!("{name} holds {have}, kube-proxy-rs wrote {want}")
                });
            }
        }
        Ok([
            missing.finding(true, "set", "ipsets", "missing"),
            changed.finding(false, "element", "ipsets", "with entries removed or added"),
        ]
        .into_iter()
        .flatten()
        .collect())
    }
}
