//! The backend against fake runners: sync kinds, setup, failure handling, metrics,
//! conntrack decisions and cleanup.

use std::collections::BTreeSet;

use kp_core::backend::{Backend, SyncKind};
use kp_core::model::{IpFamily, Protocol, ServiceName};
use kp_core::tracker::ProxyState;
use kp_rules::iptables::{RenderConfig, Table, render};
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;

use super::*;
use crate::conntrack::{FakeConntrack, FlowFilter};
use crate::exec::{FakeRunner, RunnerCall};
use crate::testutil::*;

mod verify;

type Fake = IptablesBackend<FakeRunner, FakeConntrack>;

fn backend(families: Vec<IpFamily>) -> (Fake, FakeRunner, FakeConntrack) {
    let runner = FakeRunner::new();
    let conntrack = FakeConntrack::new();
    let backend = IptablesBackend::with_parts(
        IptablesConfig::new(families, RenderConfig::default()),
        runner.clone(),
        conntrack.clone(),
    )
    .expect("default config is valid");
    (backend, runner, conntrack)
}

/// The restore line declaring (creating or flushing) a service port's `KUBE-SVC-` chain:
/// present only when the sync writes that service's chains.
fn svc_chain(ns: &str, name: &str, protocol: Protocol) -> String {
    let chains = kp_rules::iptables::names::ServiceChains::new(&port_name(ns, name, "p", protocol));
    format!(":{} - [0:0]", chains.svc)
}

fn runs(runner: &FakeRunner, op: &str) -> usize {
    runner
        .calls()
        .iter()
        .filter(|c| matches!(c, RunnerCall::Run { args, .. } if args.iter().any(|a| a == op)))
        .count()
}

#[tokio::test]
async fn a_full_sync_writes_everything_and_ensures_setup() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    assert_eq!(backend.mode(), "iptables");
    let state = two_services();
    let none = BTreeSet::new();
    let report = backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect("fake succeeds");
    assert_eq!(report.kind, SyncKind::Full);
    assert!(report.rules_written > 0);
    let restores = runner.restores();
    assert_eq!(restores.len(), 2, "one restore per family");
    let (family, v4) = &restores[0];
    assert_eq!(*family, IpFamily::V4);
    assert!(v4.contains(":KUBE-SERVICES - [0:0]"));
    assert!(v4.contains(&svc_chain("ns", "a", Protocol::Tcp)));
    assert!(v4.contains(&svc_chain("ns", "b", Protocol::Tcp)));
    // Setup: chains created and every jump checked then inserted, per family.
    let setup4 = kp_rules::iptables::setup(IpFamily::V4, &RenderConfig::default());
    let setup6 = kp_rules::iptables::setup(IpFamily::V6, &RenderConfig::default());
    assert_eq!(
        runs(&runner, "-N"),
        setup4.chains.len() + setup6.chains.len()
    );
    assert_eq!(runs(&runner, "-I"), setup4.jumps.len() + setup6.jumps.len());
    assert!(runner.calls().contains(&RunnerCall::Save {
        family: IpFamily::V4,
        table: Table::Nat
    }));
}

#[tokio::test]
async fn setup_is_idempotent_and_partial_syncs_skip_it() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    let state = two_services();
    let none = BTreeSet::new();
    for _ in 0..2 {
        backend
            .sync(&request(&state, SyncKind::Full, &none, false))
            .await
            .expect("fake succeeds");
    }
    let setup = kp_rules::iptables::setup(IpFamily::V4, &RenderConfig::default());
    let (jumps, shared) = (setup.jumps.len(), setup.shared.len());
    assert_eq!(
        shared, 1,
        "the localnet rule in the kubelet's KUBE-FIREWALL"
    );
    // Inserted (jumps) or appended (the shared chain's rule) once; the second full sync
    // only checked (-C) them.
    assert_eq!(runs(&runner, "-I"), jumps);
    assert_eq!(runs(&runner, "-A"), shared);
    assert_eq!(runs(&runner, "-C"), 2 * (jumps + shared));

    runner.clear_calls();
    let changed = BTreeSet::from([service_name("ns", "a")]);
    let report = backend
        .sync(&request(&state, SyncKind::Partial, &changed, false))
        .await
        .expect("fake succeeds");
    assert_eq!(report.kind, SyncKind::Partial);
    assert_eq!(runs(&runner, "-C"), 0, "partial syncs do not touch setup");
    let restores = runner.restores();
    assert_eq!(restores.len(), 1);
    assert!(restores[0].1.contains(&svc_chain("ns", "a", Protocol::Tcp)));
    assert!(
        !restores[0].1.contains(&svc_chain("ns", "b", Protocol::Tcp)),
        "unchanged service not rewritten"
    );
}

#[tokio::test]
async fn restore_failure_is_an_apply_error_and_keeps_the_bookkeeping() {
    let registry = &mut Registry::default();
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let metrics = IptablesMetrics::register(registry);
    let mut backend = backend.with_metrics(metrics.clone());
    let state = two_services();
    let none = BTreeSet::new();
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect("fake succeeds");
    let good_chains = backend.chains.clone();

    runner.fail_next_restores(1);
    let err = backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect_err("injected failure");
    assert!(
        matches!(tool_error(&err, "iptables-restore"), Some(ExecError::Failed { stderr, .. }) if stderr.starts_with("injected failure")),
        "{err:?}"
    );
    assert_eq!(metrics.restore_failures.get(), 1);
    assert_eq!(metrics.partial_restore_failures.get(), 0);
    assert_eq!(
        backend.chains, good_chains,
        "bookkeeping matches the kept rules"
    );

    // After a failure the core asks for a full sync: everything is written again.
    runner.clear_calls();
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect("fake succeeds again");
    let restores = runner.restores();
    assert_eq!(restores.len(), 1);
    assert!(restores[0].1.contains(&svc_chain("ns", "a", Protocol::Tcp)));
    assert!(restores[0].1.contains(&svc_chain("ns", "b", Protocol::Tcp)));
    assert!(
        runs(&runner, "-C") > 0,
        "setup ensured again after a failure"
    );
}

#[tokio::test]
async fn partial_failure_is_retried_as_full_in_the_same_call() {
    let registry = &mut Registry::default();
    let (backend, runner, _) = backend(vec![IpFamily::V4]);
    let metrics = IptablesMetrics::register(registry);
    let mut backend = backend.with_metrics(metrics.clone());
    let state = two_services();
    let none = BTreeSet::new();
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect("fake succeeds");

    runner.clear_calls();
    runner.script_restores([true, false]);
    let changed = BTreeSet::from([service_name("ns", "a")]);
    let report = backend
        .sync(&request(&state, SyncKind::Partial, &changed, false))
        .await
        .expect("the full retry succeeds");
    assert_eq!(report.kind, SyncKind::Full, "what ran, for the metrics");
    let restores = runner.restores();
    assert_eq!(restores.len(), 2);
    let b = svc_chain("ns", "b", Protocol::Tcp);
    assert!(!restores[0].1.contains(&b), "first attempt was partial");
    assert!(restores[1].1.contains(&b), "retry was full");
    assert!(runs(&runner, "-C") > 0, "retry ensured the setup");
    assert_eq!(metrics.partial_restore_failures.get(), 1);
    assert_eq!(metrics.restore_failures.get(), 1);

    // Both attempts failing: the sync fails (and the core asks for a full one next).
    runner.script_restores([true, true]);
    let err = backend
        .sync(&request(&state, SyncKind::Partial, &changed, false))
        .await
        .expect_err("both fail");
    assert!(tool_error(&err, "iptables-restore").is_some(), "{err:?}");
    assert_eq!(metrics.partial_restore_failures.get(), 2);
    assert_eq!(metrics.restore_failures.get(), 3);
}

#[tokio::test]
async fn one_family_failing_still_programs_the_other() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    runner.fail_restores_when(|family, _| family == IpFamily::V6);
    let state = two_services();
    let none = BTreeSet::new();
    let err = backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect_err("v6 fails");
    assert!(tool_error(&err, "ip6tables-restore").is_some(), "{err:?}");
    let families: Vec<IpFamily> = runner.restores().iter().map(|(f, _)| *f).collect();
    assert_eq!(families, [IpFamily::V4, IpFamily::V6]);
}

#[tokio::test]
async fn full_sync_deletes_stale_chains_listed_by_save() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    runner.set_save(
        IpFamily::V4,
        Table::Nat,
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-LEFTOVERFROMBEFORE - [0:0]\n\
         :KUBE-SEP-LEFTOVERFROMBEFORE - [0:0]\n:FOO-CHAIN - [0:0]\nCOMMIT\n",
    );
    let state = two_services();
    let none = BTreeSet::new();
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect("fake succeeds");
    let text = &runner.restores()[0].1;
    assert!(text.contains("-X KUBE-SVC-LEFTOVERFROMBEFORE\n"));
    assert!(text.contains("-X KUBE-SEP-LEFTOVERFROMBEFORE\n"));
    assert!(!text.contains("FOO-CHAIN"));
}

#[test]
fn invalid_render_config_is_rejected_up_front() {
    let config = IptablesConfig::new(
        vec![IpFamily::V4],
        RenderConfig {
            masquerade_bit: 40,
            ..RenderConfig::default()
        },
    );
    let result = IptablesBackend::with_parts(config, FakeRunner::new(), FakeConntrack::new());
    assert!(result.is_err());
}

#[tokio::test]
async fn metrics_have_upstream_names_and_count_rules() {
    let mut registry = Registry::default();
    let (backend, _, _) = backend(vec![IpFamily::V4]);
    let mut backend = backend.with_metrics(IptablesMetrics::register(&mut registry));
    let state = two_services();
    let none = BTreeSet::new();
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect("fake succeeds");
    let mut text = String::new();
    encode(&mut text, &registry).expect("encoding into a String cannot fail");
    let samples: BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split([' ', '{']).next())
        .collect();
    assert_eq!(
        samples.into_iter().collect::<Vec<_>>(),
        [
            "kube_proxy_rs_iptables_netlink_fallbacks_total",
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            "kubeproxy_sync_proxy_rules_iptables_total",
        ]
    );
    let nat_line = text
        .lines()
        .find(|l| l.starts_with("kubeproxy_sync_proxy_rules_iptables_total{table=\"nat\"}"))
        .expect("nat gauge present");
    let nat: i64 = nat_line
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .expect("a number");
    assert!(nat > 0, "{nat_line}");
    assert!(text.contains("kubeproxy_sync_proxy_rules_iptables_total{table=\"filter\"}"));
}

// --- conntrack decisions -------------------------------------------------------------

fn udp_dns(endpoints: &[&str]) -> ProxyState {
    let mut svc = service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53);
    svc.node_port = Some(30053);
    svc.external_ips = vec![ip("203.0.113.7")];
    let eps = endpoints.iter().map(|e| endpoint(e, 5353)).collect();
    state(vec![(svc, eps)])
}

fn dns_changed() -> BTreeSet<ServiceName> {
    BTreeSet::from([service_name("kube-system", "dns")])
}

fn flow(orig_dst: Option<&str>, orig_dst_port: u16, reply: Option<(&str, u16)>) -> FlowFilter {
    FlowFilter {
        family: IpFamily::V4,
        protocol: Protocol::Udp,
        orig_dst: orig_dst.map(ip),
        orig_dst_port: Some(orig_dst_port),
        reply_src: reply.map(|(a, _)| ip(a)),
        reply_src_port: reply.map(|(_, p)| p),
    }
}

/// Sync `before` fully, then `after` partially with conntrack cleanup requested; returns
/// the filters deleted by the second sync.
async fn deleted_between(before: &ProxyState, after: &ProxyState) -> Vec<FlowFilter> {
    let (mut backend, _, conntrack) = backend(vec![IpFamily::V4]);
    let none = BTreeSet::new();
    backend
        .sync(&request(before, SyncKind::Full, &none, true))
        .await
        .expect("fake succeeds");
    assert!(conntrack.deleted().is_empty(), "first sync deletes nothing");
    let changed = dns_changed();
    backend
        .sync(&request(after, SyncKind::Partial, &changed, true))
        .await
        .expect("fake succeeds");
    conntrack.deleted()
}

#[tokio::test]
async fn removed_endpoint_entries_are_deleted_by_reply_source() {
    let before = udp_dns(&["10.244.1.5", "10.244.2.6"]);
    let after = udp_dns(&["10.244.1.5"]);
    let gone = Some(("10.244.2.6", 5353));
    assert_eq!(
        deleted_between(&before, &after).await,
        [
            flow(None, 30053, gone),
            flow(Some("10.96.0.10"), 53, gone),
            flow(Some("203.0.113.7"), 53, gone),
        ]
    );
}

#[tokio::test]
async fn endpoint_that_stops_being_ready_counts_as_removed() {
    let before = udp_dns(&["10.244.1.5", "10.244.2.6"]);
    let mut after = before.clone();
    for eps in after.endpoints.values_mut() {
        eps[1].ready = false;
        eps[1].serving = false;
    }
    let deleted = deleted_between(&before, &after).await;
    assert_eq!(deleted.len(), 3);
    assert!(
        deleted
            .iter()
            .all(|f| f.reply_src == Some(ip("10.244.2.6")))
    );
}

#[tokio::test]
async fn zero_to_one_endpoints_deletes_entries_to_the_service() {
    let before = udp_dns(&[]);
    let after = udp_dns(&["10.244.1.5"]);
    assert_eq!(
        deleted_between(&before, &after).await,
        [
            flow(None, 30053, None),
            flow(Some("10.96.0.10"), 53, None),
            flow(Some("203.0.113.7"), 53, None),
        ]
    );
}

#[tokio::test]
async fn new_service_with_endpoints_counts_as_newly_active() {
    let before = state(vec![]);
    let after = udp_dns(&["10.244.1.5"]);
    assert_eq!(deleted_between(&before, &after).await.len(), 3);
}

#[tokio::test]
async fn deleted_service_cleans_its_endpoints() {
    let before = udp_dns(&["10.244.1.5"]);
    let after = state(vec![]);
    let deleted = deleted_between(&before, &after).await;
    assert_eq!(deleted.len(), 3);
    assert!(
        deleted
            .iter()
            .all(|f| f.reply_src == Some(ip("10.244.1.5")))
    );
}

#[tokio::test]
async fn tcp_only_changes_delete_nothing() {
    let tcp = |eps: &[&str]| {
        state(vec![(
            service("kube-system", "dns", Protocol::Tcp, "10.96.0.10", 53),
            eps.iter().map(|e| endpoint(e, 5353)).collect(),
        )])
    };
    assert!(
        deleted_between(&tcp(&["10.244.1.5", "10.244.2.6"]), &tcp(&["10.244.1.5"]))
            .await
            .is_empty()
    );
    assert!(
        deleted_between(&tcp(&[]), &tcp(&["10.244.1.5"]))
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn unchanged_or_added_endpoints_delete_nothing() {
    let before = udp_dns(&["10.244.1.5"]);
    let after = udp_dns(&["10.244.1.5", "10.244.2.6"]);
    assert!(deleted_between(&before, &after).await.is_empty());
}

#[tokio::test]
async fn sctp_is_cleaned_like_udp() {
    let sctp = |eps: &[&str]| {
        state(vec![(
            service("kube-system", "dns", Protocol::Sctp, "10.96.0.10", 53),
            eps.iter().map(|e| endpoint(e, 5353)).collect(),
        )])
    };
    let deleted =
        deleted_between(&sctp(&["10.244.1.5", "10.244.2.6"]), &sctp(&["10.244.1.5"])).await;
    assert_eq!(deleted.len(), 1);
    assert_eq!(deleted[0].protocol, Protocol::Sctp);
}

#[tokio::test]
async fn no_cleanup_unless_requested_and_failures_do_not_fail_the_sync() {
    let (mut backend, _, conntrack) = backend(vec![IpFamily::V4]);
    let before = udp_dns(&["10.244.1.5", "10.244.2.6"]);
    let after = udp_dns(&["10.244.1.5"]);
    let none = BTreeSet::new();
    let changed = dns_changed();
    backend
        .sync(&request(&before, SyncKind::Full, &none, true))
        .await
        .expect("fake succeeds");
    backend
        .sync(&request(&after, SyncKind::Partial, &changed, false))
        .await
        .expect("fake succeeds");
    assert!(conntrack.deleted().is_empty(), "not requested");

    // Back and forth with failing deletions: the sync still succeeds.
    backend
        .sync(&request(&before, SyncKind::Partial, &changed, true))
        .await
        .expect("fake succeeds");
    conntrack.fail_next(10);
    backend
        .sync(&request(&after, SyncKind::Partial, &changed, true))
        .await
        .expect("conntrack failures are only logged");
    assert_eq!(conntrack.deleted().len(), 3);
}

#[tokio::test]
async fn failed_sync_keeps_the_previous_state_for_the_next_diff() {
    let (mut backend, runner, conntrack) = backend(vec![IpFamily::V4]);
    let none = BTreeSet::new();
    let changed = dns_changed();
    backend
        .sync(&request(
            &udp_dns(&["10.244.1.5", "10.244.2.6"]),
            SyncKind::Full,
            &none,
            true,
        ))
        .await
        .expect("fake succeeds");
    runner.fail_next_restores(2);
    let after = udp_dns(&["10.244.1.5"]);
    assert!(
        backend
            .sync(&request(&after, SyncKind::Partial, &changed, true))
            .await
            .is_err()
    );
    assert!(
        conntrack.deleted().is_empty(),
        "nothing deleted for unprogrammed rules"
    );
    backend
        .sync(&request(&after, SyncKind::Full, &changed, true))
        .await
        .expect("fake succeeds");
    assert_eq!(
        conntrack.deleted().len(),
        3,
        "the retry cleans what the failure skipped"
    );
}

// --- cleanup -------------------------------------------------------------------------

#[tokio::test]
async fn cleanup_restores_one_removal_per_table_with_kube_chains() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4, IpFamily::V6]);
    runner.set_save(
        IpFamily::V4,
        Table::Nat,
        "*nat\n:OUTPUT ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n\
         -A OUTPUT -j KUBE-SERVICES\nCOMMIT\n",
    );
    runner.set_save(
        IpFamily::V6,
        Table::Mangle,
        "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n",
    );
    backend.cleanup().await.expect("fake succeeds");
    let restores = runner.restores();
    assert_eq!(restores.len(), 2);
    assert_eq!(
        restores[0],
        (
            IpFamily::V4,
            "*nat\n:KUBE-SERVICES - [0:0]\n-D OUTPUT -j KUBE-SERVICES\n-X KUBE-SERVICES\nCOMMIT\n"
                .to_owned()
        )
    );
    assert_eq!(restores[1].0, IpFamily::V6);

    runner.fail_next_restores(1);
    let err = backend.cleanup().await.expect_err("injected");
    assert!(
        tool_error(&err, "iptables cleanup (restore V4 nat)").is_some(),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_cleanup_plan_looks_now_and_removes_later() {
    let (mut backend, runner, _) = backend(vec![IpFamily::V4]);
    assert!(backend.cleanup_plan().await.is_empty(), "nothing saved");
    runner.set_save(
        IpFamily::V4,
        Table::Nat,
        "*nat\n:KUBE-SERVICES - [0:0]\nCOMMIT\n",
    );
    let plan = backend.cleanup_plan().await;
    assert!(!plan.is_empty());
    assert!(runner.restores().is_empty(), "looking removes nothing");
    backend.apply_cleanup(plan).await.expect("fake succeeds");
    let restores = runner.restores();
    assert_eq!(restores.len(), 1);
    assert!(restores[0].1.contains("-X KUBE-SERVICES"), "{restores:?}");
}

/// Fails restores whose input contains one of `bad` (chain names), naming the first line
/// that does the way `iptables-restore` does: legacy wording for IPv4, nf_tables for IPv6.
#[derive(Clone, Default)]
struct LineFailRunner {
    inner: FakeRunner,
    bad: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Text whose presence fails a restore at its `COMMIT` (a line of no service), as the
    /// kernel's checks at commit do.
    bad_at_commit: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl LineFailRunner {
    fn fail_on(&self, chains: Vec<String>) {
        *self
            .bad
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = chains;
    }

    fn fail_at_commit_on(&self, texts: Vec<String>) {
        *self
            .bad_at_commit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = texts;
    }

    /// The failure `input` meets, wherever it is applied.
    fn check(&self, family: IpFamily, input: &str) -> Result<(), crate::exec::ExecError> {
        let lock = |m: &std::sync::Mutex<Vec<String>>| {
            m.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        };
        let (bad, bad_at_commit) = (lock(&self.bad), lock(&self.bad_at_commit));
        let failing = input
            .lines()
            .position(|line| bad.iter().any(|chain| line.contains(chain.as_str())))
            .or_else(|| {
                bad_at_commit
                    .iter()
                    .any(|text| input.contains(text.as_str()))
                    .then(|| input.lines().count() - 1)
            });
        let Some(line) = failing else {
            return Ok(());
        };
        let stderr = match family {
            IpFamily::V4 => format!("iptables-restore: line {} failed", line + 1),
            IpFamily::V6 => format!(
                "ip6tables-restore v1.8.9 (nf_tables): rule rejected\nError occurred at line: {}",
                line + 1
            ),
        };
        Err(crate::exec::ExecError::Failed {
            program: "fake-iptables-restore".to_owned(),
            code: Some(2),
            stderr,
        })
    }
}

impl crate::exec::RuleRunner for LineFailRunner {
    async fn restore(&self, family: IpFamily, input: &str) -> Result<(), crate::exec::ExecError> {
        self.inner.restore(family, input).await?;
        self.check(family, input)
    }

    async fn restore_isolated(
        &self,
        family: IpFamily,
        input: &str,
    ) -> Result<(), crate::exec::ExecError> {
        self.inner.restore_isolated(family, input).await?;
        self.check(family, input)
    }

    async fn save(&self, family: IpFamily, table: Table) -> Result<String, crate::exec::ExecError> {
        self.inner.save(family, table).await
    }

    async fn run(&self, family: IpFamily, args: &[String]) -> Result<(), crate::exec::ExecError> {
        self.inner.run(family, args).await
    }
}

fn line_fail_backend(
    families: Vec<IpFamily>,
) -> (
    IptablesBackend<LineFailRunner, FakeConntrack>,
    LineFailRunner,
) {
    let runner = LineFailRunner::default();
    let backend = IptablesBackend::with_parts(
        IptablesConfig::new(families, RenderConfig::default()),
        runner.clone(),
        FakeConntrack::new(),
    )
    .expect("default config is valid");
    (backend, runner)
}

/// Services `ns/s0` .. `ns/s{n-1}`, one endpoint each, of `family`.
fn services_of(family: IpFamily, n: u8) -> ProxyState {
    state(
        (0..n)
            .map(|i| {
                (
                    service(
                        "ns",
                        &format!("s{i}"),
                        Protocol::Tcp,
                        &cluster_ip(family, i),
                        80,
                    ),
                    vec![endpoint(&endpoint_ip(family, i), 8080)],
                )
            })
            .collect(),
    )
}

fn services(n: u8) -> ProxyState {
    services_of(IpFamily::V4, n)
}

fn cluster_ip(family: IpFamily, i: u8) -> String {
    match family {
        IpFamily::V4 => format!("10.96.0.{}", i + 1),
        IpFamily::V6 => format!("fd00:96::{}", i + 1),
    }
}

fn endpoint_ip(family: IpFamily, i: u8) -> String {
    match family {
        IpFamily::V4 => format!("10.244.1.{}", i + 1),
        IpFamily::V6 => format!("fd00:244::{}", i + 1),
    }
}

fn sep_chain(ns: &str, name: &str, address: &str, port: u16) -> String {
    kp_rules::iptables::names::endpoint_chain(
        &port_name(ns, name, "p", Protocol::Tcp),
        ip(address),
        port,
    )
}

#[tokio::test]
async fn a_failing_service_is_skipped_and_the_others_programmed() {
    for family in [IpFamily::V4, IpFamily::V6] {
        let (mut backend, runner) = line_fail_backend(vec![family]);
        let state = services_of(family, 3);
        let bad = sep_chain("ns", "s1", &endpoint_ip(family, 1), 8080);
        runner.fail_on(vec![bad.clone()]);
        let none = BTreeSet::new();
        let report = backend
            .sync(&request(&state, SyncKind::Full, &none, false))
            .await
            .expect("the other services are programmed");
        assert_eq!(report.skipped, [service_name("ns", "s1")], "{family:?}");
        let restores = runner.inner.restores();
        assert_eq!(restores.len(), 2, "one failure, one retry without ns/s1");
        let applied = &restores[1].1;
        assert!(applied.contains(&svc_chain("ns", "s0", Protocol::Tcp)));
        assert!(applied.contains(&svc_chain("ns", "s2", Protocol::Tcp)));
        assert!(!applied.contains(&svc_chain("ns", "s1", Protocol::Tcp)));
        assert!(!applied.contains(&bad));

        // The proxier hands the skipped service back as changed; once it restores, it is
        // programmed by an ordinary partial sync.
        runner.fail_on(Vec::new());
        runner.inner.clear_calls();
        let changed = BTreeSet::from([service_name("ns", "s1")]);
        let report = backend
            .sync(&request(&state, SyncKind::Partial, &changed, false))
            .await
            .expect("fixed");
        assert!(report.skipped.is_empty());
        let restores = runner.inner.restores();
        assert_eq!(restores.len(), 1);
        assert!(
            restores[0]
                .1
                .contains(&svc_chain("ns", "s1", Protocol::Tcp))
        );
        assert!(restores[0].1.contains(&format!(":{bad} - [0:0]")));
    }
}

#[tokio::test]
async fn a_failing_partial_restore_isolates_in_the_full_retry() {
    let (mut backend, runner) = line_fail_backend(vec![IpFamily::V4]);
    let state = services(2);
    let none = BTreeSet::new();
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect("fake succeeds");
    let chains =
        kp_rules::iptables::names::ServiceChains::new(&port_name("ns", "s0", "p", Protocol::Tcp));
    runner.fail_on(vec![chains.svc.clone()]);
    runner.inner.clear_calls();
    let changed = BTreeSet::from([service_name("ns", "s0")]);
    let report = backend
        .sync(&request(&state, SyncKind::Partial, &changed, false))
        .await
        .expect("isolated");
    assert_eq!(report.skipped, [service_name("ns", "s0")]);
    assert_eq!(
        runner.inner.restores().len(),
        3,
        "partial, full, full without ns/s0"
    );
    assert!(
        backend.chains[&IpFamily::V4].contains(&chains.svc),
        "the skipped service's chains stay in the bookkeeping"
    );
}

#[tokio::test]
async fn unmappable_restore_error_fails_as_before() {
    let (mut backend, runner) = line_fail_backend(vec![IpFamily::V4]);
    let state = services(2);
    // `KUBE-SERVICES` belongs to no service.
    runner.fail_on(vec![":KUBE-SERVICES".to_owned()]);
    let none = BTreeSet::new();
    let err = backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect_err("cannot isolate");
    assert!(
        matches!(tool_error(&err, "iptables-restore"), Some(ExecError::Failed { stderr, .. }) if stderr.contains("line")),
        "{err:?}"
    );
    assert_eq!(runner.inner.restores().len(), 1);
}

#[tokio::test]
async fn a_service_failing_at_commit_is_found_in_empty_namespaces() {
    for family in [IpFamily::V4, IpFamily::V6] {
        let (mut backend, runner) = line_fail_backend(vec![family]);
        let state = services_of(family, 9);
        // The error names the `COMMIT` line, so no line points at ns/s6.
        let bad = sep_chain("ns", "s6", &endpoint_ip(family, 6), 8080);
        runner.fail_at_commit_on(vec![bad.clone()]);
        let none = BTreeSet::new();
        let report = backend
            .sync(&request(&state, SyncKind::Full, &none, false))
            .await
            .expect("the other services are programmed");
        assert_eq!(report.skipped, [service_name("ns", "s6")], "{family:?}");
        let calls = runner.inner.calls();
        let isolated: Vec<&String> = calls
            .iter()
            .filter_map(|c| match c {
                crate::exec::RunnerCall::RestoreIsolated { input, .. } => Some(input),
                _ => None,
            })
            .collect();
        // The whole set, halves down to one service (at most two tries per halving), and
        // the set without it: bounded by 2 + 2·log2(9).
        assert!(isolated.len() <= 2 + 2 * 4, "{}", isolated.len());
        assert!(isolated.last().is_some_and(|t| !t.contains(&bad)));
        let restores = runner.inner.restores();
        assert_eq!(
            restores.len(),
            2,
            "the failure, and the retry without ns/s6"
        );
        assert!(!restores[1].1.contains(&bad));
        assert!(
            restores[1]
                .1
                .contains(&svc_chain("ns", "s5", Protocol::Tcp))
        );
        assert!(
            restores[1]
                .1
                .contains(&svc_chain("ns", "s7", Protocol::Tcp))
        );
    }
}

#[tokio::test]
async fn a_commit_failure_of_the_node_isolates_no_service() {
    let (mut backend, runner) = line_fail_backend(vec![IpFamily::V4]);
    let state = services(4);
    // Fails on the node only: the same rules apply in an empty namespace.
    runner.inner.fail_next_restores(1);
    let none = BTreeSet::new();
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect_err("nothing to isolate");
    let isolated = runner
        .inner
        .calls()
        .iter()
        .filter(|c| matches!(c, crate::exec::RunnerCall::RestoreIsolated { .. }))
        .count();
    assert_eq!(isolated, 1, "one try of the whole ruleset");
    // Failing with every service's rules (a shared part is bad): no service is blamed.
    let (mut backend, runner) = line_fail_backend(vec![IpFamily::V4]);
    runner.fail_at_commit_on(vec![":KUBE-SERVICES".to_owned()]);
    backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect_err("nothing to isolate");
    assert_eq!(runner.inner.restores().len(), 1);
}

#[tokio::test]
async fn isolation_is_bounded() {
    let (mut backend, runner) = line_fail_backend(vec![IpFamily::V4]);
    let n = u8::try_from(isolate::MAX_ISOLATED_SERVICES + 2).expect("small bound");
    let state = services(n);
    runner.fail_on(
        (0..n)
            .map(|i| sep_chain("ns", &format!("s{i}"), &format!("10.244.1.{}", i + 1), 8080))
            .collect(),
    );
    let none = BTreeSet::new();
    let err = backend
        .sync(&request(&state, SyncKind::Full, &none, false))
        .await
        .expect_err("too many failing services");
    assert!(tool_error(&err, "iptables-restore").is_some(), "{err:?}");
    assert_eq!(
        runner.inner.restores().len(),
        isolate::MAX_ISOLATED_SERVICES + 1
    );
}

#[test]
fn lines_map_to_services_by_chain_jump_and_comment() {
    let mut state = services(2);
    let lonely = service("ns", "lonely", Protocol::Tcp, "10.96.0.9", 80);
    state.services.insert(lonely.name.clone(), lonely);
    let none = BTreeSet::new();
    let existing = BTreeSet::new();
    let scope = SyncScope {
        kind: SyncKind::Full,
        changed: &none,
        existing_chains: &existing,
    };
    let output = render(&state, IpFamily::V4, &RenderConfig::default(), &scope).expect("renders");
    let owner = |pattern: &str| {
        let line = output
            .text
            .lines()
            .position(|line| line.contains(pattern))
            .unwrap_or_else(|| panic!("no line with {pattern}\n{}", output.text));
        let mut finder = isolate::LineFinder::new(line + 1);
        kp_rules::iptables::render_to(
            &state,
            IpFamily::V4,
            &RenderConfig::default(),
            &scope,
            &mut finder,
        )
        .expect("renders");
        let found = finder.into_line().expect("the input has the line");
        assert_eq!(Some(found.as_str()), output.text.lines().nth(line));
        isolate::service_of_line(&found, &state)
    };
    let svc1 =
        kp_rules::iptables::names::ServiceChains::new(&port_name("ns", "s1", "p", Protocol::Tcp))
            .svc;
    assert_eq!(owner(&format!("-j {svc1}")), Some(service_name("ns", "s1")));
    assert_eq!(owner(&format!("-A {svc1}")), Some(service_name("ns", "s1")));
    assert_eq!(owner("-j REJECT"), Some(service_name("ns", "lonely")));
    assert_eq!(owner("*nat"), None);
    assert_eq!(owner("COMMIT"), None);
}
