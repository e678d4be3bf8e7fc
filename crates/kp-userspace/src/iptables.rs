//! Linux capture: `kp_rules::userspace` rules applied with `iptables-restore --noflush`
//! through kp-dataplane's exec layer, one restore per family and sync.
//!
//! The first apply removes whatever any kube-proxy mode left (iptables mode's `KUBE-SERVICES`
//! would otherwise DNAT service traffic before our redirects see it), then writes everything
//! and ensures the jumps from the built-in chains. Later applies are partial when the core
//! allows it: the top-level chains plus the changed ports' chains. A failed apply makes the
//! next one full.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::{IpFamily, ServicePortName};
use kp_dataplane::exec::{ExecError, RuleRunner, split_args};
use kp_dataplane::iptables::{SavedTable, cleanup_input};
use kp_rules::iptables::Table;
use kp_rules::userspace::{CaptureConfig, SERVICE_CHAIN_PREFIXES, jumps, render};
use tracing::{debug, info};

use crate::capture::{Capture, CaptureError, CapturePlan};

/// iptables exits with 1 for "no such rule" (`-C`).
const EXIT_NOT_APPLICABLE: i32 = 1;

/// The tables this mode (and cleanup) touches.
const TABLES: [Table; 3] = [Table::Filter, Table::Nat, Table::Mangle];

/// Capture with iptables `REDIRECT` rules.
#[derive(Debug)]
pub struct IptablesCapture<R> {
    runner: R,
    config: CaptureConfig,
    families: Vec<IpFamily>,
    /// Per family, the per-service chains the last successful apply left.
    chains: BTreeMap<IpFamily, BTreeSet<String>>,
    /// Whether the next apply must be full (and start by removing leftovers).
    force_full: bool,
    leftovers_removed: bool,
}

impl<R: RuleRunner> IptablesCapture<R> {
    /// Capture for `families` with `config`, running the tools through `runner`.
    pub fn new(runner: R, config: CaptureConfig, families: Vec<IpFamily>) -> Self {
        Self {
            runner,
            config,
            families,
            chains: BTreeMap::new(),
            force_full: true,
            leftovers_removed: false,
        }
    }

    fn fail(what: String) -> impl Fn(ExecError) -> CaptureError {
        move |err| CaptureError::Apply {
            what: what.clone(),
            message: err.to_string(),
        }
    }

    async fn ensure_jumps(&self, family: IpFamily) -> Result<(), CaptureError> {
        let fail = Self::fail(format!("userspace jumps ({family:?})"));
        for jump in jumps() {
            let spec = split_args(&jump.spec);
            let mut check: Vec<String> = ["-t", jump.table.as_str(), "-C", jump.from]
                .map(str::to_owned)
                .to_vec();
            check.extend(spec.iter().cloned());
            match self.runner.run(family, &check).await {
                Ok(()) => continue,
                Err(err) if err.exit_code() == Some(EXIT_NOT_APPLICABLE) => {}
                Err(err) => return Err(fail(err)),
            }
            let mut insert: Vec<String> = ["-t", jump.table.as_str(), "-I", jump.from, "1"]
                .map(str::to_owned)
                .to_vec();
            insert.extend(spec);
            self.runner.run(family, &insert).await.map_err(&fail)?;
            debug!(?family, from = jump.from, to = jump.to, "inserted jump");
        }
        Ok(())
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

impl<R: RuleRunner> Capture for IptablesCapture<R> {
    async fn apply(
        &mut self,
        plan: &CapturePlan,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<(), CaptureError> {
        let full = self.force_full || changed.is_none();
        self.force_full = true;
        if !self.leftovers_removed {
            for family in self.families.clone() {
                self.cleanup_family(family).await?;
            }
            self.leftovers_removed = true;
        }
        for family in self.families.clone() {
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
            let scope = if full { None } else { changed };
            let out = render(family, ports, &self.config, scope, &existing);
            self.runner
                .restore(family, &out.text)
                .await
                .map_err(Self::fail(format!("iptables-restore ({family:?})")))?;
            if full {
                self.ensure_jumps(family).await?;
            }
            self.chains.insert(family, out.chains);
        }
        self.force_full = false;
        Ok(())
    }

    async fn cleanup(&mut self) -> Result<(), CaptureError> {
        let mut first = None;
        for family in self.families.clone() {
            if let Err(err) = self.cleanup_family(family).await {
                first.get_or_insert(err);
            }
        }
        self.chains.clear();
        self.force_full = true;
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use kp_core::model::{Protocol, ServiceName};
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
                port: String::new(),
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
        }
    }

    fn plan(ports: Vec<CapturedPort>) -> CapturePlan {
        CapturePlan {
            families: [(IpFamily::V4, ports)].into(),
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
        let changed: BTreeSet<ServicePortName> = BTreeSet::new();
        // Even when the caller allows a partial apply, the first one is full.
        capture
            .apply(&plan(vec![port("a", 40001)]), Some(&changed))
            .await
            .expect("apply");
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
        capture
            .apply(
                &plan(vec![port("a", 40001), port("b", 40003)]),
                Some(&changed),
            )
            .await
            .expect("apply");
        let calls = runner.calls();
        assert_eq!(calls.len(), 1, "one restore: {calls:?}");
        let RunnerCall::Restore { input, .. } = &calls[0] else {
            panic!("{calls:?}");
        };
        assert!(input.contains("--to-ports 40003") && !input.contains("--to-ports 40001"));
    }

    #[tokio::test]
    async fn a_failed_restore_makes_the_next_apply_full() {
        let runner = FakeRunner::new();
        let mut capture =
            IptablesCapture::new(runner.clone(), CaptureConfig::default(), vec![IpFamily::V4]);
        capture
            .apply(&plan(vec![port("a", 40001)]), None)
            .await
            .expect("apply");
        runner.fail_next_restores(1);
        let changed: BTreeSet<ServicePortName> = [port("a", 0).name].into();
        assert!(
            capture
                .apply(&plan(vec![port("a", 40005)]), Some(&changed))
                .await
                .is_err()
        );
        runner.clear_calls();
        capture
            .apply(&plan(vec![port("a", 40005)]), Some(&changed))
            .await
            .expect("apply");
        assert!(
            runner
                .calls()
                .iter()
                .any(|c| matches!(c, RunnerCall::Save { .. })),
            "a full apply lists the chains in place"
        );
    }
}
