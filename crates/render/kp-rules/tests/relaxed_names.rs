//! Service names as upstream's `RelaxedServiceNameValidation` (beta 1.36, GA 1.37) lets the
//! API server accept them: any DNS-1123 label, so a name may start with a digit (`1web`,
//! `0`, `123-456`). Every identifier the iptables and nftables renderers derive from such
//! names must stay valid for the kernel's tools and unique per service port, and every
//! comment must stay within what the kernel stores.
//!
//! Property: for states of service ports named by such labels (namespaces, names and port
//! names, mostly digit-first), with every feature that derives a name (ClusterIP, NodePort,
//! externalIP, LoadBalancer IP with source ranges, eTP Local, affinity, endpoints), per family:
//!
//! - every declared iptables chain is at most 28 bytes of `[A-Za-z0-9_-]` (the kernel's
//!   `XT_EXTENSION_MAXNAMELEN` less its NUL) and every `--comment` at most 255 bytes;
//! - every nft chain, set and map name starts with a letter and holds only
//!   `[A-Za-z0-9_./-]`, at most 255 bytes (`NFT_NAME_MAXLEN` less its NUL), and every comment
//!   holds no quote or control character;
//! - no iptables chain is declared twice in a table, and the identifiers one service port's
//!   render derives are disjoint from another's (rendered alone): two names never share a
//!   chain, set or map.
//!
//! ipvs mode's outputs hold no names at all (`fuzz_render::ipvs_outputs_hold_no_names`).

use crate::common;

use std::collections::BTreeSet;

use kp_core::model::{IpFamily, Protocol, ServicePort};
use kp_core::testutil::{self, strategies};
use kp_core::tracker::ProxyState;
use kp_rules::iptables::NodePortAddresses;
use kp_rules::nftables;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Cases: small states, a debug build, a few seconds.
const CASES: u32 = 128;

/// A DNS-1123 label, mostly starting with a digit (what the relaxed validation adds).
fn label() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[0-9][a-z0-9-]{0,20}[a-z0-9]",
        2 => "[0-9]{1,8}",
        1 => "[0-9][a-z0-9]{62}",
        1 => "[a-z]([a-z0-9-]{0,30}[a-z0-9])?",
    ]
}

/// A port name (IANA service name: at most 15 characters, a letter somewhere), digit-first,
/// or none.
fn port_name() -> impl Strategy<Value = String> {
    prop_oneof![3 => "[0-9]{1,6}[a-z][a-z0-9]{0,7}", 1 => Just(String::new())]
}

/// One service port using every feature that derives a name; `index` keeps addresses apart.
fn service_port(index: u8) -> impl Strategy<Value = (ServicePort, Vec<kp_core::model::Endpoint>)> {
    (label(), label(), port_name(), any::<bool>(), 1u8..4).prop_map(
        move |(ns, name, port, udp, count)| {
            let protocol = if udp { Protocol::Udp } else { Protocol::Tcp };
            let v4 = |host: u8| std::net::IpAddr::from([192, 0, 2 + index, host]);
            let svc = testutil::service_port(
                (ns, name, port, protocol),
                strategies::cluster_ips(index, [true, false]),
                80,
                (
                    Some(30000 + u16::from(index)),
                    vec![v4(1)],
                    vec![v4(2)],
                    vec!["203.0.113.0/25".parse().expect("literal")],
                ),
                (
                    Some(60),
                    [index.is_multiple_of(2), false],
                    Some(31000 + u16::from(index)),
                ),
            );
            // Ready endpoints, one of them on this node (eTP Local has a local one).
            let endpoints = (0..count)
                .map(|n| {
                    let ip = std::net::IpAddr::from([10, 180, index, n + 1]);
                    testutil::endpoint_at(ip, 8080, n == 0)
                })
                .collect();
            (svc, endpoints)
        },
    )
}

fn proxy_state() -> impl Strategy<Value = ProxyState> {
    (1u8..6)
        .prop_flat_map(|n| (1..=n).map(service_port).collect::<Vec<_>>())
        .prop_map(common::state)
}

/// One service port of `state` alone.
fn alone(state: &ProxyState, key: &kp_core::model::ServicePortName) -> ProxyState {
    let mut one = state.clone();
    one.services.retain(|k, _| k == key);
    let own = &state.services[key].name;
    one.endpoints.retain(|k, _| k == key || k == own);
    one
}

/// The double-quoted strings of `line` that follow `keyword` (comments).
fn quoted_after<'a>(line: &'a str, keyword: &str) -> Vec<&'a str> {
    line.match_indices(keyword)
        .filter_map(|(at, _)| {
            let rest = line[at + keyword.len()..].trim_start().strip_prefix('"')?;
            rest.find('"').map(|end| &rest[..end])
        })
        .collect()
}

/// The chains an iptables render declares (`:NAME - [0:0]`, as `TABLE NAME`), checked for validity and
/// uniqueness; its comments checked for length.
fn iptables_names(state: &ProxyState, family: IpFamily) -> Result<BTreeSet<String>, TestCaseError> {
    let out = common::full(state, family, &common::config());
    let mut declared = BTreeSet::new();
    let mut table = "";
    for line in out.text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name;
        }
        if let Some(chain) = line.strip_prefix(':').and_then(|l| l.split(' ').next()) {
            prop_assert!(chain.len() <= 28, "chain {chain:?} is too long");
            prop_assert!(
                chain
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-')),
                "chain {chain:?}"
            );
            prop_assert!(
                declared.insert(format!("{table} {chain}")),
                "{chain} declared twice in {table}"
            );
        }
        for comment in quoted_after(line, "--comment") {
            prop_assert!(comment.len() <= 255, "comment of {} bytes", comment.len());
            prop_assert!(!comment.chars().any(char::is_control), "{comment:?}");
        }
    }
    Ok(declared)
}

fn nft_config() -> nftables::RenderConfig {
    nftables::RenderConfig {
        local_detector: nftables::LocalDetector::Cidrs(vec![
            "10.0.0.0/8".parse().expect("literal"),
        ]),
        node_port_addresses: NodePortAddresses::Ips(vec!["192.168.0.2".parse().expect("literal")]),
        ..nftables::RenderConfig::default()
    }
}

/// The chains, sets and maps an nft render adds, checked for validity; its
/// comments checked for quotes and control characters.
fn nft_names(state: &ProxyState, family: IpFamily) -> Result<BTreeSet<String>, TestCaseError> {
    let (ops, _) = nftables::render_full(state, family, &nft_config()).expect("renders");
    let mut declared = BTreeSet::new();
    for line in ops.script().lines() {
        let mut words = line.split_whitespace();
        if let (Some("add"), Some(kind @ ("chain" | "set" | "map"))) = (words.next(), words.next())
        {
            let name = words.nth(2).unwrap_or_default();
            prop_assert!(name.len() <= 255, "{kind} {name:?} is too long");
            prop_assert!(
                name.starts_with(|c: char| c.is_ascii_alphabetic())
                    && name.bytes().all(
                        |b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-')
                    ),
                "{kind} {name:?}"
            );
            // Upstream's script adds a base chain, deletes it and adds it again: an add may
            // repeat; that two names never share one is checked per service port.
            declared.insert(format!("{kind} {name}"));
        }
        for comment in quoted_after(line, "comment") {
            prop_assert!(!comment.chars().any(char::is_control), "{comment:?}");
        }
    }
    Ok(declared)
}

/// Each service port's own identifiers (those its render alone adds to an empty state's)
/// are disjoint from every other's.
fn disjoint_per_port(
    state: &ProxyState,
    names: impl Fn(&ProxyState) -> Result<BTreeSet<String>, TestCaseError>,
) -> Result<(), TestCaseError> {
    let fixed = names(&common::state(Vec::new()))?;
    let mut owner: std::collections::BTreeMap<String, String> = Default::default();
    for key in state.services.keys() {
        let own: Vec<String> = names(&alone(state, key))?
            .difference(&fixed)
            .cloned()
            .collect();
        prop_assert!(!own.is_empty(), "{key} derived no identifier of its own");
        for name in &own {
            if let Some(other) = owner.insert(name.clone(), key.to_string()) {
                prop_assert!(false, "{name} derived for both {other} and {key}");
            }
        }
    }
    Ok(())
}

#[test]
fn digit_first_names_derive_valid_unique_identifiers() {
    TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    })
    .run(&proxy_state(), |state| {
        let family = IpFamily::V4;
        iptables_names(&state, family)?;
        nft_names(&state, family)?;
        disjoint_per_port(&state, |s| iptables_names(s, family))?;
        disjoint_per_port(&state, |s| nft_names(s, family))?;
        Ok(())
    })
    .unwrap_or_else(|failure| panic!("{failure}"));
}

/// The check notices an identifier two service ports share, and passes distinct ones.
#[test]
fn the_disjointness_check_catches_a_shared_identifier() {
    let svc = |port: &str| common::cluster_ip("1ns", "1web", port, "172.30.0.41", 80);
    let state = common::state(vec![(svc("1a"), Vec::new()), (svc("1b"), Vec::new())]);
    let per_port = |s: &ProxyState| -> Result<BTreeSet<String>, TestCaseError> {
        Ok(s.services.keys().map(ToString::to_string).collect())
    };
    let shared = |s: &ProxyState| -> Result<BTreeSet<String>, TestCaseError> {
        Ok(s.services
            .keys()
            .map(|_| "KUBE-SVC-SHARED".to_owned())
            .collect())
    };
    assert!(disjoint_per_port(&state, per_port).is_ok());
    let caught = disjoint_per_port(&state, shared);
    assert!(caught.is_err(), "{caught:?}");
}
