//! Linux capture: `kp_rules::userspace` rules applied with `iptables-restore --noflush`
//! through kp-dataplane's exec layer, one restore per family and sync.
//!
//! The first apply removes whatever any kube-proxy mode left (iptables mode's `KUBE-SERVICES`
//! would otherwise DNAT service traffic before our redirects see it), then writes everything
//! and ensures the jumps from the built-in chains. Later applies are partial when the core
//! asks for it: the top-level chains plus the changed ports' chains; a change of the relay's
//! addresses rewrites everything. A failed apply fails the sync (the core asks for a full one
//! next).
//!
//! UDP has no connection for the kernel to forget: a client that keeps its source port keeps
//! its conntrack entry, and with it the relay port the entry was redirected to. When a UDP
//! port's redirect target changes or goes (its frontend reopened on another port, or it now
//! refuses), the entries for its addresses are deleted, as the kernel modes do for changed
//! endpoints.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::backend::{ApplyError, SyncKind};
use kp_core::foreign::{Check, ForeignChange};
use kp_core::model::{IpFamily, Protocol, ServicePortName};
use kp_dataplane::conntrack::{Conntrack, DefaultConntrack, FlowFilter, delete_flows};
use kp_dataplane::exec::{ExecError, RuleRunner};
use kp_dataplane::iptables::{
    NatCanary, NatSize, SavedTable, cleanup_input, ensure_setup, missing_jumps,
};
use kp_dataplane::sync::FamilyErrors;
use kp_rules::iptables::{Setup, Table};
use kp_rules::userspace::{CaptureConfig, CapturedPort, SERVICE_CHAIN_PREFIXES, jumps, render};
use tracing::info;

use crate::capture::{Capture, CaptureError, CapturePlan};

/// The tables this mode (and cleanup) touches.
const TABLES: [Table; 3] = [Table::Filter, Table::Nat, Table::Mangle];

/// Capture with iptables `REDIRECT` rules.
#[derive(Debug)]
pub struct IptablesCapture<R, C = DefaultConntrack> {
    runner: R,
    conntrack: C,
    /// Per family, the UDP ports as the last successful apply captured them.
    udp_ports: BTreeMap<(IpFamily, ServicePortName), CapturedPort>,
    config: CaptureConfig,
    families: Vec<IpFamily>,
    /// Per family, the per-service chains the last successful apply left.
    chains: BTreeMap<IpFamily, BTreeSet<String>>,
    /// The relay addresses of the last successful apply: every chain is rewritten when they
    /// change.
    relay_addresses: BTreeMap<IpFamily, std::net::IpAddr>,
    leftovers_removed: bool,
    /// iptables-legacy: nat's size, so the canary check reads nat only when it changed.
    nat_canary: Option<NatCanary>,
}

impl<R: RuleRunner> IptablesCapture<R> {
    /// Capture for `families` with `config`, running the tools through `runner`.
    pub fn new(runner: R, config: CaptureConfig, families: Vec<IpFamily>) -> Self {
        Self::with_conntrack(runner, DefaultConntrack::default(), config, families)
    }
}

impl<R: RuleRunner, C: Conntrack> IptablesCapture<R, C> {
    /// Like [`IptablesCapture::new`], deleting stale UDP entries through `conntrack`.
    pub fn with_conntrack(
        runner: R,
        conntrack: C,
        config: CaptureConfig,
        families: Vec<IpFamily>,
    ) -> Self {
        Self {
            runner,
            conntrack,
            udp_ports: BTreeMap::new(),
            config,
            families,
            chains: BTreeMap::new(),
            relay_addresses: BTreeMap::new(),
            leftovers_removed: false,
            nat_canary: None,
        }
    }

    /// Let the canary check look at nat when `size` says it changed (iptables-legacy);
    /// without it nat is only checked before periodic syncs.
    pub fn with_nat_size(mut self, size: impl NatSize + 'static) -> Self {
        self.nat_canary = Some(NatCanary::new(size));
        self
    }

    fn fail(what: String) -> impl FnOnce(ExecError) -> CaptureError {
        move |err| ApplyError::tool(what, err).into()
    }

    /// Inserts the jumps from the built-in chains that are missing, as iptables mode does.
    async fn ensure_jumps(&self, family: IpFamily) -> Result<(), CaptureError> {
        let setup = jump_setup();
        ensure_setup(&self.runner, family, &setup)
            .await
            .map_err(|err| ApplyError::tool(format!("userspace jumps ({family:?})"), err).into())
    }

    async fn cleanup_family(&self, family: IpFamily) -> Result<(), CaptureError> {
        for table in TABLES {
            let what = format!("cleanup ({family:?} {})", table.as_str());
            let text = self
                .runner
                .save(family, table)
                .await
                .map_err(Self::fail(what.clone()))?;
            if let Some(input) = cleanup_input(table, &SavedTable::parse(&text)) {
                self.runner
                    .restore(family, &input)
                    .await
                    .map_err(Self::fail(what))?;
                info!(?family, table = table.as_str(), "removed kube-proxy chains");
            }
        }
        Ok(())
    }

    /// Deletes the conntrack entries of UDP ports whose redirect target changed or went
    /// (deleted ports included; every port when the relay's address `moved`), and remembers
    /// the new ones. Failures are logged: the rules are already right, and the entries
    /// expire on their own.
    async fn forget_stale_udp(&mut self, plan: &CapturePlan, moved: bool) {
        let mut now: BTreeMap<(IpFamily, ServicePortName), CapturedPort> = BTreeMap::new();
        for (family, list) in &plan.families {
            for p in list.iter().filter(|p| p.name.protocol == Protocol::Udp) {
                now.insert((*family, p.name.clone()), p.clone());
            }
        }
        let mut filters = Vec::new();
        for ((family, name), before) in &self.udp_ports {
            let after = now.get(&(*family, name.clone()));
            let filter = |dst: Option<std::net::IpAddr>, dport: u16| FlowFilter {
                family: *family,
                protocol: Protocol::Udp,
                orig_dst: dst,
                orig_dst_port: Some(dport),
                reply_src: None,
                reply_src_port: None,
            };
            if moved || after.map(|a| a.internal) != Some(before.internal) {
                filters.push(filter(Some(before.cluster_ip), before.port));
            }
            if before.externally_accessible()
                && (moved || after.map(|a| a.external) != Some(before.external))
            {
                for ip in before.external_ips.iter().chain(&before.load_balancer_ips) {
                    filters.push(filter(Some(*ip), before.port));
                }
                if let Some(node_port) = before.node_port {
                    filters.push(filter(None, node_port));
                }
            }
        }
        delete_flows(&self.conntrack, &filters).await;
        self.udp_ports = now;
    }

    /// Renders and restores one family (`changed`: `None` for a full apply, which also
    /// lists the chains in place and ensures the jumps); returns the chains it leaves.
    async fn apply_family(
        &self,
        family: IpFamily,
        plan: &CapturePlan,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<BTreeSet<String>, CaptureError> {
        let full = changed.is_none();
        let existing = if full {
            self.listed_chains(family).await?
        } else {
            self.chains.get(&family).cloned().unwrap_or_default()
        };
        let ports = plan
            .families
            .get(&family)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let relay_address = plan.relay_addresses.get(&family).copied();
        let out = render(
            family,
            ports,
            &self.config,
            relay_address,
            changed,
            &existing,
        );
        self.runner
            .restore(family, &out.text)
            .await
            .map_err(Self::fail(format!("iptables-restore ({family:?})")))?;
        if full {
            self.ensure_jumps(family).await?;
        }
        Ok(out.chains)
    }

    /// The per-service chains of this mode present in the kernel.
    async fn listed_chains(&self, family: IpFamily) -> Result<BTreeSet<String>, CaptureError> {
        let text = self
            .runner
            .save(family, Table::Nat)
            .await
            .map_err(Self::fail(format!("iptables-save ({family:?} nat)")))?;
        Ok(SavedTable::parse(&text)
            .chains
            .into_iter()
            .filter(|c| SERVICE_CHAIN_PREFIXES.iter().any(|p| c.starts_with(p)))
            .collect())
    }
}

impl<R: RuleRunner, C: Conntrack> Capture for IptablesCapture<R, C> {
    async fn apply(
        &mut self,
        plan: &CapturePlan,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncKind, CaptureError> {
        // Every chain DNATs to the relay's addresses: when they change, all are rewritten.
        let changed = changed.filter(|_| plan.relay_addresses == self.relay_addresses);
        if !self.leftovers_removed {
            for family in self.families.clone() {
                self.cleanup_family(family).await?;
            }
            self.leftovers_removed = true;
        }
        let mut errors = FamilyErrors::new(crate::backend::MODE);
        for family in self.families.clone() {
            let result = self.apply_family(family, plan, changed).await;
            if let Some(chains) = errors.check(family, result) {
                self.chains.insert(family, chains);
            }
        }
        errors.into_result()?;
        let kind = match changed {
            None => SyncKind::Full,
            Some(_) => SyncKind::Partial,
        };
        if let Some(canary) = &mut self.nat_canary {
            for family in &self.families {
                canary.after_sync(*family, kind);
            }
        }
        let moved = plan.relay_addresses != self.relay_addresses;
        self.relay_addresses.clone_from(&plan.relay_addresses);
        self.forget_stale_udp(plan, moved).await;
        Ok(kind)
    }

    /// The jumps from the built-in chains of every family applied, as iptables mode checks.
    async fn verify(&mut self, check: Check) -> Result<Vec<ForeignChange>, CaptureError> {
        let setup = jump_setup();
        let mut missing = Vec::new();
        for family in self.chains.keys() {
            let canary = self.nat_canary.as_mut();
            let found = missing_jumps(&self.runner, canary, *family, &setup, check)
                .await
                .map_err(|err| {
                    ApplyError::tool(format!("userspace canary check ({family:?})"), err)
                })?;
            missing.extend(found);
        }
        Ok(missing)
    }

    async fn cleanup(&mut self) -> Result<(), CaptureError> {
        let mut errors = FamilyErrors::new(crate::backend::MODE);
        for family in self.families.clone() {
            errors.check(family, self.cleanup_family(family).await);
        }
        self.chains.clear();
        errors.into_result()
    }
}

/// The capture's setup: only its jumps from the built-in chains (its chains are in the
/// restore, and it shares no chain with another component).
fn jump_setup() -> Setup {
    Setup {
        chains: Vec::new(),
        jumps: jumps(),
        shared: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use kp_core::model::{Protocol, ServiceName};
    use kp_dataplane::conntrack::FakeConntrack;
    use kp_dataplane::exec::{FakeRunner, RunnerCall};
    use kp_rules::userspace::{CapturedPort, Target};

    use super::*;

    fn port(name: &str, relay: u16) -> CapturedPort {
        CapturedPort {
            name: ServicePortName {
                service: ServiceName {
                    namespace: "ns".into(),
                    name: name.into(),
                },
                port: Default::default(),
                protocol: Protocol::Tcp,
            },
            port: 80,
            cluster_ip: IpAddr::from([10, 96, 0, 1]),
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            source_ranges: Vec::new(),
            node_port: None,
            internal: Target::Redirect(relay),
            external: Target::Reject,
            local_source_internal: false,
            allow_from_node: false,
        }
    }

    fn plan(ports: Vec<CapturedPort>) -> CapturePlan {
        CapturePlan {
            families: [(IpFamily::V4, ports)].into(),
            relay_addresses: BTreeMap::new(),
        }
    }

    #[tokio::test]
    async fn first_apply_removes_leftovers_then_writes_all_and_the_jumps() {
        let runner = FakeRunner::new();
        runner.set_save(
            IpFamily::V4,
            Table::Nat,
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n\
             -A PREROUTING -j KUBE-SERVICES\nCOMMIT\n",
        );
        let mut capture =
            IptablesCapture::new(runner.clone(), CaptureConfig::default(), vec![IpFamily::V4]);
        let ran = capture
            .apply(&plan(vec![port("a", 40001)]), None)
            .await
            .expect("apply");
        assert_eq!(ran, SyncKind::Full);
        let restores = runner.restores();
        assert!(
            restores[0].1.contains("-X KUBE-SERVICES"),
            "leftovers first: {restores:?}"
        );
        let rules = &restores.last().expect("the capture restore").1;
        assert!(rules.contains("--to-ports 40001"), "{rules}");
        let inserted: Vec<String> = runner
            .calls()
            .iter()
            .filter_map(|c| match c {
                RunnerCall::Run { args, .. } if args.contains(&"-I".to_owned()) => {
                    Some(args.join(" "))
                }
                _ => None,
            })
            .collect();
        assert_eq!(inserted.len(), jumps().len(), "{inserted:?}");

        // A partial apply rewrites only the changed port's chain, without any jump checks.
        runner.clear_calls();
        let changed: BTreeSet<ServicePortName> = [port("b", 0).name].into();
        let ran = capture
            .apply(
                &plan(vec![port("a", 40001), port("b", 40003)]),
                Some(&changed),
            )
            .await
            .expect("apply");
        assert_eq!(ran, SyncKind::Partial);
        let calls = runner.calls();
        assert_eq!(calls.len(), 1, "one restore: {calls:?}");
        let RunnerCall::Restore { input, .. } = &calls[0] else {
            panic!("{calls:?}");
        };
        assert!(input.contains("--to-ports 40003") && !input.contains("--to-ports 40001"));
    }

    #[tokio::test]
    async fn a_failed_restore_fails_the_apply_and_moved_relay_addresses_rewrite_all() {
        let runner = FakeRunner::new();
        let mut capture =
            IptablesCapture::new(runner.clone(), CaptureConfig::default(), vec![IpFamily::V4]);
        capture
            .apply(&plan(vec![port("a", 40001)]), None)
            .await
            .expect("apply");
        runner.fail_next_restores(1);
        let changed: BTreeSet<ServicePortName> = [port("a", 0).name].into();
        let err = capture
            .apply(&plan(vec![port("a", 40005)]), Some(&changed))
            .await
            .expect_err("injected");
        assert!(
            matches!(&err, CaptureError::Apply(ApplyError::Tool { what, .. }) if what == "iptables-restore (V4)"),
            "{err}"
        );
        // Every chain DNATs to the relay's address: a new one rewrites them all, even when
        // only one port changed, and the apply says it ran fully.
        runner.clear_calls();
        let mut moved = plan(vec![port("a", 40005), port("b", 40007)]);
        moved
            .relay_addresses
            .insert(IpFamily::V4, IpAddr::from([10, 0, 0, 5]));
        let ran = capture.apply(&moved, Some(&changed)).await.expect("apply");
        assert_eq!(ran, SyncKind::Full);
        assert!(
            runner
                .calls()
                .iter()
                .any(|c| matches!(c, RunnerCall::Save { .. })),
            "a full apply lists the chains in place"
        );
        let restores = runner.restores();
        assert!(restores[0].1.contains("40007"), "{restores:?}");
    }

    #[tokio::test]
    async fn udp_entries_go_when_their_redirect_changes_or_the_port_goes() {
        let conntrack = FakeConntrack::new();
        let mut capture = IptablesCapture::with_conntrack(
            FakeRunner::new(),
            conntrack.clone(),
            CaptureConfig::default(),
            vec![IpFamily::V4],
        );
        let mut dns = port("dns", 40001);
        dns.name.protocol = Protocol::Udp;
        let web = port("web", 40003);
        capture
            .apply(&plan(vec![dns.clone(), web.clone()]), None)
            .await
            .expect("apply");
        assert!(conntrack.deleted().is_empty(), "nothing stale at first");
        // Same targets again: nothing deleted; TCP ports are never cleaned.
        let mut web2 = web.clone();
        web2.internal = Target::Redirect(41000);
        capture
            .apply(&plan(vec![dns.clone(), web2]), None)
            .await
            .expect("apply");
        assert!(conntrack.deleted().is_empty());
        // The UDP port's frontend reopened elsewhere: its ClusterIP entries go.
        let mut moved = dns.clone();
        moved.internal = Target::Redirect(42000);
        capture
            .apply(&plan(vec![moved]), None)
            .await
            .expect("apply");
        let deleted = conntrack.deleted();
        assert_eq!(deleted.len(), 1, "{deleted:?}");
        assert_eq!(deleted[0].orig_dst, Some(dns.cluster_ip));
        assert_eq!(deleted[0].orig_dst_port, Some(80));
        // Deleted altogether: its entries go too.
        conntrack.clear();
        capture.apply(&plan(vec![]), None).await.expect("apply");
        assert_eq!(conntrack.deleted().len(), 1);
    }
    #[tokio::test]
    async fn on_legacy_the_canary_reads_nat_when_its_size_changed() {
        use kp_dataplane::iptables::FakeNatSize;
        let runner = FakeRunner::new();
        let size = FakeNatSize::default();
        size.set(IpFamily::V4, 100);
        let mut capture =
            IptablesCapture::new(runner.clone(), CaptureConfig::default(), vec![IpFamily::V4])
                .with_nat_size(size.clone());
        capture
            .apply(&plan(vec![port("a", 40001)]), None)
            .await
            .expect("apply");
        let nat_checks = |runner: &FakeRunner| {
            let calls = runner.calls();
            calls
                .iter()
                .filter(|c| matches!(c, RunnerCall::Run { args, .. } if args[..3] == ["-t", "nat", "-C"]))
                .count()
        };
        // Once after the full apply, then not while nat's size stays.
        capture.verify(Check::Canary).await.expect("fake runs");
        runner.clear_calls();
        assert_eq!(
            capture.verify(Check::Canary).await.expect("fake runs"),
            vec![]
        );
        assert_eq!(nat_checks(&runner), 0);
        // nat flushed: its size changes and the capture's nat jumps are found missing.
        let jump = jumps()
            .into_iter()
            .find(|j| j.table == Table::Nat)
            .expect("a nat jump");
        let mut delete: Vec<String> = ["-t", "nat", "-D", jump.from].map(str::to_owned).into();
        delete.extend(kp_dataplane::exec::split_args(&jump.spec));
        runner.run(IpFamily::V4, &delete).await.expect("was there");
        size.set(IpFamily::V4, 10);
        let found = capture.verify(Check::Canary).await.expect("fake runs");
        assert_eq!(found.len(), 1, "{found:?}");
    }
}
