//! Unit tests of the pieces the integration tests (`tests/nft_*.rs`) do not reach directly.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, Protocol};
use kp_core::tracker::ProxyState;

use super::*;

fn scope<'a>(
    kind: SyncKind,
    changed: &'a BTreeSet<ServiceName>,
    existing: &'a NftState,
) -> NftScope<'a> {
    NftScope {
        kind,
        changed,
        existing,
        delete_stale: false,
        service_cidrs: &[],
    }
}

#[test]
fn invalid_configuration_is_an_error() {
    let state = ProxyState::default();
    let none = BTreeSet::new();
    let existing = NftState::default();
    let config = RenderConfig {
        masquerade_bit: 32,
        ..RenderConfig::default()
    };
    assert_eq!(
        render(
            &state,
            IpFamily::V4,
            &config,
            &scope(SyncKind::Full, &none, &existing)
        ),
        Err(RenderError::MasqueradeBit(32))
    );
    let config = RenderConfig {
        local_detector: LocalDetector::BridgeInterface("br0\" accept".into()),
        ..RenderConfig::default()
    };
    assert!(matches!(
        render(
            &state,
            IpFamily::V4,
            &config,
            &scope(SyncKind::Full, &none, &existing)
        ),
        Err(RenderError::InterfaceName(_))
    ));
}

#[test]
fn partial_sync_without_setup_is_promoted_to_full() {
    let state = ProxyState::default();
    let none = BTreeSet::new();
    let existing = NftState::default();
    let config = RenderConfig::default();
    let out = render(
        &state,
        IpFamily::V4,
        &config,
        &scope(SyncKind::Partial, &none, &existing),
    )
    .expect("renders");
    assert_eq!(out.kind, SyncKind::Full);
    let installed = out.state_after(&existing);
    assert!(installed.is_initialized());
    // Same configuration again: an idle partial sync does nothing.
    let again = render(
        &state,
        IpFamily::V4,
        &config,
        &scope(SyncKind::Partial, &none, &installed),
    )
    .expect("renders");
    assert_eq!(again.kind, SyncKind::Partial);
    assert_eq!(again.operations, 0);
    assert!(again.script().is_empty());
    // Another configuration changes the fixed part: full again.
    let other = RenderConfig {
        masquerade_bit: 15,
        ..RenderConfig::default()
    };
    let changed = render(
        &state,
        IpFamily::V4,
        &other,
        &scope(SyncKind::Partial, &none, &installed),
    )
    .expect("renders");
    assert_eq!(changed.kind, SyncKind::Full);
    assert!(changed.script().contains("mark set mark or 0x8000"));
    // The base chains are only re-created on the very first sync.
    assert!(
        out.script()
            .contains("delete chain ip kube-proxy filter-input\n")
    );
    assert!(
        !changed
            .script()
            .contains("delete chain ip kube-proxy filter-input\n")
    );
}

#[test]
fn comments_fit_nft_limit_without_splitting_escapes() {
    let long = "\"".repeat(100);
    let text = render::tests_support::comment_text(&long);
    assert!(text.len() <= MAX_COMMENT_BYTES);
    assert_eq!(text.len() % 3, 0, "{text}");
    let plain = "a".repeat(300);
    assert_eq!(
        render::tests_support::comment_text(&plain).len(),
        MAX_COMMENT_BYTES
    );
    assert_eq!(
        render::tests_support::comment_text("ns/svc:p80"),
        "ns/svc:p80"
    );
}

#[test]
fn adopt_keeps_only_per_service_objects() {
    let state = NftState::adopt(
        [
            "services".to_owned(),
            "endpoint-AAAA-ns/s/tcp/__1.2.3.4/80".to_owned(),
        ],
        [
            ("cluster-ips".to_owned(), None),
            ("affinity-AAAA-ns/s/tcp/__1.2.3.4/80".to_owned(), Some(60)),
        ],
    );
    assert!(!state.is_initialized());
    assert_eq!(
        state.chains().into_iter().collect::<Vec<_>>(),
        ["endpoint-AAAA-ns/s/tcp/__1.2.3.4/80"]
    );
    assert_eq!(
        state.affinity_sets().into_iter().collect::<Vec<_>>(),
        ["affinity-AAAA-ns/s/tcp/__1.2.3.4/80"]
    );
}

/// [`Transaction::steps`]: the same commands, services whole, the reaching part last.
#[test]
fn a_full_sync_splits_into_safe_steps() {
    use super::cmd::Command;
    let mut services = Vec::new();
    for i in 0..12u8 {
        let name = ServicePortName {
            service: kp_core::model::ServiceName {
                namespace: "ns".into(),
                name: format!("s{i}").into(),
            },
            port: "p".into(),
            protocol: Protocol::Tcp,
        };
        services.push(name);
    }
    let state = steps_state(&services);
    let out = render_full(&state, IpFamily::V4, &RenderConfig::default())
        .expect("valid")
        .0;
    let tx = &out.transaction;
    let all: Vec<&Command> = tx.commands().collect();
    // Small enough: one step, in transaction order.
    assert_eq!(tx.steps(all.len()), vec![all.clone()]);

    let steps = tx.steps(45);
    assert!(steps.len() > 2, "{}", steps.len());
    // The first step creates the table and the chain every service jumps to; after them,
    // the same commands, each once.
    assert!(matches!(steps[0][0], Command::AddTable { .. }));
    assert!(
        matches!(steps[0][1], Command::AddChain { chain, .. } if chain.as_str() == super::MARK_FOR_MASQUERADE)
    );
    let mut flat: Vec<String> = steps
        .iter()
        .flatten()
        .skip(2)
        .map(|c| format!("{c:?}"))
        .collect();
    let mut expected: Vec<String> = all.iter().map(|c| format!("{c:?}")).collect();
    flat.sort();
    expected.sort();
    assert_eq!(flat, expected);
    // Before the last step: only the services' own chains, sets and rules; no map element,
    // no base chain, no rule outside a per-service chain.
    for step in &steps[..steps.len() - 1] {
        for command in step {
            match command {
                Command::AddTable { .. } => {}
                Command::AddChain { chain, hook, .. } => {
                    assert!(hook.is_none());
                    assert!(
                        chain.contains('/') || chain.as_str() == super::MARK_FOR_MASQUERADE,
                        "{chain}"
                    );
                }
                Command::AddRule { chain, .. } | Command::FlushChain(chain) => {
                    assert!(chain.contains('/'), "{chain}")
                }
                Command::AddSet { set, .. } => assert!(set.contains('/'), "{set}"),
                other => panic!("{other:?} before the last step"),
            }
        }
    }
    // Each step but the first and last holds whole services, within the limit (a step
    // starts a new service only below it).
    for step in &steps[1..steps.len() - 1] {
        assert!(step.len() <= 45, "{}", step.len());
        assert!(matches!(step[0], Command::AddChain { .. }));
    }
    // Every element is in the last step, after every chain it points at was created.
    let last = steps.last().expect("steps");
    assert!(last.iter().any(|c| matches!(c, Command::AddElement { .. })));
    assert!(
        last.iter()
            .any(|c| matches!(c, Command::AddChain { hook: Some(_), .. }))
    );

    // A partial sync is one transaction whatever its size.
    let mut installed = NftState::default();
    out.update.apply(&mut installed);
    let changed: BTreeSet<_> = services.iter().map(|s| s.service.clone()).collect();
    let partial = render(
        &state,
        IpFamily::V4,
        &RenderConfig::default(),
        &NftScope {
            kind: SyncKind::Partial,
            changed: &changed,
            existing: &installed,
            delete_stale: false,
            service_cidrs: &[],
        },
    )
    .expect("valid");
    assert_eq!(partial.kind, SyncKind::Partial);
    assert!(partial.transaction.len() > 45);
    assert_eq!(partial.transaction.steps(45).len(), 1);
}

/// A [`StepSink`] recording each step's commands, failing the step numbered `fail_at`.
struct Recorder {
    max: usize,
    steps: Vec<Vec<String>>,
    fail_at: Option<usize>,
}

impl StepSink for Recorder {
    type Error = &'static str;

    fn max_commands(&self) -> usize {
        self.max
    }

    fn apply_step(&mut self, family: IpFamily, commands: &[Command]) -> Result<(), &'static str> {
        if self.fail_at == Some(self.steps.len()) {
            return Err("injected");
        }
        self.steps.push(
            commands
                .iter()
                .map(|c| c.display(family).to_string())
                .collect(),
        );
        Ok(())
    }
}

/// [`render_in_steps`] applies exactly the steps [`Transaction::steps`] makes of the whole
/// transaction, whatever the step size, with one service that must stay in the last step;
/// its output is the rest, with the same state update and counts as [`render`]'s.
#[test]
fn rendering_in_steps_gives_the_steps_of_the_whole_transaction() {
    let services: Vec<ServicePortName> = (0..12u8)
        .map(|i| ServicePortName {
            service: kp_core::model::ServiceName {
                namespace: "ns".into(),
                name: format!("s{i}").into(),
            },
            port: "p".into(),
            protocol: Protocol::Tcp,
        })
        .collect();
    let state = steps_state(&services);
    let config = RenderConfig::default();
    let none = BTreeSet::new();
    // Service 0's affinity sets exist with another timeout: they are re-created, so that
    // service must stay in the last step.
    let affinity_sets: Vec<(String, Option<u64>)> = render_full(&state, IpFamily::V4, &config)
        .expect("valid")
        .1
        .affinity_sets()
        .into_iter()
        .map(|set| (set.to_owned(), Some(7)))
        .collect();
    assert!(!affinity_sets.is_empty());
    for existing in [NftState::default(), NftState::adopt([], affinity_sets)] {
        let scope = scope(SyncKind::Full, &none, &existing);
        let whole = render(&state, IpFamily::V4, &config, &scope).expect("valid");
        let text = |commands: Vec<&Command>| -> Vec<String> {
            commands
                .iter()
                .map(|c| c.display(IpFamily::V4).to_string())
                .collect()
        };
        for max in [1, 5, 20, 45, 100, whole.transaction.len(), usize::MAX] {
            let expected: Vec<Vec<String>> =
                whole.transaction.steps(max).into_iter().map(text).collect();
            let mut sink = Recorder {
                max,
                steps: Vec::new(),
                fail_at: None,
            };
            let out =
                render_in_steps(&state, IpFamily::V4, &config, &scope, &mut sink).expect("valid");
            assert_eq!(out.steps_applied, sink.steps.len());
            if sink.steps.is_empty() {
                // Nothing applied: the output is the whole transaction.
                assert_eq!(out.transaction, whole.transaction, "max {max}");
            }
            if max <= 20 {
                // Smaller than the services' own commands: they went as they were rendered.
                assert!(out.steps_applied > 0, "max {max}");
            }
            let mut got = sink.steps;
            got.extend(out.transaction.steps(max).into_iter().map(text));
            assert_eq!(got, expected, "max {max}");
            assert_eq!(out.operations, whole.operations);
            assert_eq!(out.update, whole.update);
            assert_eq!(out.deleted_sets, whole.deleted_sets);
        }
        // A failed step stops the render and says how many were applied before it.
        let mut sink = Recorder {
            max: 20,
            steps: Vec::new(),
            fail_at: Some(2),
        };
        match render_in_steps(&state, IpFamily::V4, &config, &scope, &mut sink) {
            Err(StepRenderError::Step { error, applied }) => {
                assert_eq!((error, applied), ("injected", 2));
            }
            other => panic!("{other:?}"),
        }
    }
}

/// `services`, each with a ClusterIP and three endpoints; the first with ClientIP affinity.
fn steps_state(services: &[ServicePortName]) -> ProxyState {
    use kp_core::model::{Endpoint, ServicePort, SessionAffinity};
    use std::net::{IpAddr, Ipv4Addr};
    let mut state = ProxyState::default();
    state.node.name = "node".into();
    state.node.known = true;
    state.node.eligible = true;
    for (i, name) in services.iter().enumerate() {
        let i = u8::try_from(i).expect("few");
        state.services.insert(
            name.clone(),
            ServicePort {
                name: name.clone(),
                cluster_ips: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 0, i + 1))],
                port: 80,
                node_port: Some(30000 + u16::from(i)),
                external_ips: Vec::new(),
                load_balancer_ips: Vec::new(),
                load_balancer_source_ranges: Vec::new(),
                session_affinity: (i == 0).then(|| SessionAffinity {
                    timeout: std::time::Duration::from_secs(60),
                }),
                external_policy_local: false,
                internal_policy_local: false,
                health_check_node_port: None,
            },
        );
        let endpoints = (1..=3u8)
            .map(|j| Endpoint {
                ip: IpAddr::V4(Ipv4Addr::new(10, 244, i, j)),
                port: 8080,
                ready: true,
                serving: true,
                terminating: false,
                node_name: Some("other".into()),
                zone: None,
                zone_hints: None,
                node_hints: None,
                is_local: false,
            })
            .collect();
        state.endpoints.insert(name.clone(), endpoints);
    }
    state
}

/// The jumps of `script`'s base chains to one of `targets`: (base chain, hook, priority,
/// target). Shared with the verdict-free layout's tests.
pub(super) fn base_chain_jumps(
    script: &str,
    targets: &[&str],
) -> BTreeSet<(String, String, i32, String)> {
    let mut hooks = BTreeMap::new();
    let mut jumps = Vec::new();
    for line in script.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [
                "add",
                "chain",
                _,
                _,
                chain,
                "{",
                "type",
                _,
                "hook",
                hook,
                "priority",
                prio,
                ..,
            ] => {
                let prio: i32 = prio.parse().expect("a numeric priority");
                hooks.insert(chain.to_string(), (hook.to_string(), prio));
            }
            ["add", "rule", _, _, from, .., "jump", to] if targets.contains(to) => {
                jumps.push((from.to_string(), to.to_string()));
            }
            _ => {}
        }
    }
    jumps
        .into_iter()
        .filter_map(|(from, to)| {
            let (hook, prio) = hooks.get(&from)?.clone();
            Some((from, hook, prio, to))
        })
        .collect()
}

/// Where both layouts hook their filters and dispatch, for `[nodeport filter, entry filter,
/// ClusterIP filter, firewall, dispatch]` (each layout's names): as [`base_chain_jumps`]
/// reads them.
pub(super) fn filters_after_dnat(names: [&str; 5]) -> BTreeSet<(String, String, i32, String)> {
    let [nodeport, entry, cluster_ips, firewall, dispatch] = names;
    [
        ("filter-input", "input", 0, nodeport),
        ("filter-input", "input", 0, entry),
        ("filter-forward", "forward", 0, entry),
        ("filter-output", "output", 0, entry),
        ("filter-forward", "forward", 0, cluster_ips),
        ("filter-output", "output", 0, cluster_ips),
        ("filter-prerouting-pre-dnat", "prerouting", -110, firewall),
        ("filter-output-pre-dnat", "output", -110, firewall),
        ("nat-prerouting", "prerouting", -100, dispatch),
        ("nat-output", "output", -100, dispatch),
    ]
    .into_iter()
    .map(|(c, h, p, t)| (c.to_owned(), h.to_owned(), p, t.to_owned()))
    .collect()
}

/// Upstream #132456: the no-endpoint drop/reject and the unknown-ClusterIP-port checks run in
/// the filter chains at priority 0, after DNAT (-100), so a connection DNATed to an endpoint
/// (pod and node traffic short-circuited to an externalTrafficPolicy Local service's
/// endpoints elsewhere) no longer matches them; only the source-range firewall runs before
/// DNAT (-110).
#[test]
fn no_endpoint_filters_run_at_filter_priority_after_dnat() {
    let none = BTreeSet::new();
    let existing = NftState::default();
    let out = render(
        &ProxyState::default(),
        IpFamily::V4,
        &RenderConfig::default(),
        &scope(SyncKind::Full, &none, &existing),
    )
    .expect("renders");
    let names = [
        "nodeport-endpoints-check",
        "service-endpoints-check",
        "cluster-ips-check",
        "firewall-check",
        "services",
    ];
    assert_eq!(
        base_chain_jumps(&out.script(), &names),
        filters_after_dnat(names)
    );
}
