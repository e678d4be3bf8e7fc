//! Property tests: nothing from an object's names reaches rule text outside a quoted comment,
//! in any mode's renderer (iptables, nftables, ipvs plans and ipset/iptables text, userspace
//! capture rules), whatever the names hold.
//!
//! The check is differential. Each generated state (arbitrary Unicode, quotes, newlines,
//! rule text, percent signs, 300-byte names; random ports, families, exposure, policies and
//! endpoints) is rendered twice: as generated, and with every namespace, name and port name
//! replaced by a plain placeholder (`n0`, `n1`, ... , one per distinct string). Both outputs
//! are cut into lines and tokens the way `iptables-restore` and `nft` read them (a
//! double-quoted string is one token); comment texts and name-derived identifiers (hashed
//! chain and set names) are replaced by a marker. The two multisets of lines must then be
//! equal: a name that added a line, a token, a match or a target would change its line's
//! shape or the count. On top of that, every line of the hostile render must have balanced
//! quotes and no control character, and the ipvs outputs, which hold no names at all, must be
//! byte-identical.
//!
//! Bounded for CI: [`CASES`] cases per property, small states.

use crate::common;
use crate::nft_common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::backend::SyncKind;
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::testutil;
use kp_core::testutil::strategies::{self, addr};
use kp_core::tracker::{ChangeTracker, ProxyState};
use kp_ipvs::Scheduler;
use kp_rules::iptables::{self, LocalDetector, NodePortAddresses, SyncScope};
use kp_rules::ipvs::{self, IpvsConfig};
use kp_rules::nftables::{self, NftScope, NftState};
use kp_rules::userspace::{self, CaptureConfig, CapturedPort, Target};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Cases per property: enough to mix every feature with many names, small enough that all
/// of them run in a few seconds of a debug build.
const CASES: u32 = 192;

/// Names that target each renderer's syntax, besides arbitrary strings.
const HOSTILE: &[&str] = &[
    "a\" -j ACCEPT",
    "x\n-A KUBE-SERVICES -j ACCEPT\n",
    "y\r\nCOMMIT\n*filter",
    "\" ; flush ruleset ; #",
    "\" } ; add rule ip kube-proxy services accept ; #",
    "{ } ; @set * \\ ' `",
    "$(reboot)",
    "%22%0A",
    "\0\t\u{7f}\u{85}\u{2028}",
    "名前",
    "--comment",
    "-m comment --comment \"x\"",
    "KUBE-SVC-AAAAAAAAAAAAAAAA",
    "service-AAAAAAAA-a/b/tcp/c",
    "",
    "-",
    "/",
    "nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\
     nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\
     nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn\"\n",
];

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(HOSTILE).prop_map(str::to_owned),
        2 => any::<String>(),
        2 => "[ -~]{0,24}",
        1 => "[a-z0-9-]{1,12}",
        // DNS-1123 labels starting with a digit (RelaxedServiceNameValidation).
        1 => "[0-9][a-z0-9-]{0,12}",
    ]
}

fn any_net() -> impl Strategy<Value = IpNet> {
    strategies::any_net().prop_map(|net| net.trunc())
}

fn endpoint() -> impl Strategy<Value = Endpoint> {
    strategies::endpoint(1u16..=u16::MAX, common::NODE, "node-b")
}

/// Addresses only service port `index` uses, so no two services claim the same virtual
/// server (the API server's allocators see to that; with a conflict the first name would
/// win, and renaming would change which).
fn own_ip(index: u8) -> impl Strategy<Value = IpAddr> {
    (any::<bool>(), 0u8..4).prop_map(move |(v6, host)| addr(v6, 100 + index, host))
}

/// One service port with hostile names; `index` keeps its addresses and node ports apart.
fn service_port(index: u8) -> impl Strategy<Value = (ServicePort, Vec<Endpoint>)> {
    (
        (
            name(),
            name(),
            name(),
            prop_oneof![
                Just(Protocol::Tcp),
                Just(Protocol::Udp),
                Just(Protocol::Sctp)
            ],
            any::<[bool; 2]>(),
            prop_oneof![Just(1u16), Just(80), Just(u16::MAX), 1u16..=u16::MAX],
        ),
        (
            proptest::option::of(prop_oneof![
                Just(1 + u16::from(index)),
                Just(u16::MAX - u16::from(index)),
                Just(30000 + u16::from(index)),
            ]),
            proptest::collection::vec(own_ip(index), 0..3),
            proptest::collection::vec(own_ip(index), 0..3),
            proptest::collection::vec(any_net(), 0..3),
        ),
        (
            proptest::option::of(1u64..=86_400),
            any::<[bool; 2]>(),
            proptest::option::of(Just(30100 + u16::from(index))),
        ),
        proptest::collection::vec(endpoint(), 0..6),
    )
        .prop_map(
            move |(
                (ns, name, port_name, protocol, families, port),
                exposure,
                policies,
                endpoints,
            )| {
                let names = (ns, name, port_name, protocol);
                let ips = strategies::cluster_ips(index, families);
                let svc = testutil::service_port(names, ips, port, exposure, policies);
                (svc, endpoints)
            },
        )
}

fn proxy_state() -> impl Strategy<Value = ProxyState> {
    (0u8..7)
        .prop_flat_map(|n| (1..=n).map(service_port).collect::<Vec<_>>())
        .prop_map(|items| {
            let mut state = common::state(items);
            state.service_cidrs = vec![
                "172.30.0.0/16".parse().expect("literal"),
                "fd00:10:96::/112".parse().expect("literal"),
            ];
            state
        })
}

/// The same state with every name replaced by a plain placeholder, one per distinct string
/// (so the renaming is injective and keys stay distinct). The empty port name stays empty:
/// it changes how upstream spells a service port.
fn benign(state: &ProxyState) -> ProxyState {
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    let mut rename = |text: &str| -> String {
        let next = names.len();
        names
            .entry(text.to_owned())
            .or_insert_with(|| format!("n{next}"))
            .clone()
    };
    let mut map = |name: &ServicePortName| ServicePortName {
        service: ServiceName {
            namespace: rename(&name.service.namespace).into(),
            name: rename(&name.service.name).into(),
        },
        port: if name.port.is_empty() {
            Default::default()
        } else {
            rename(&name.port).into()
        },
        protocol: name.protocol,
    };
    let mut out = ProxyState {
        node: state.node.clone(),
        service_cidrs: state.service_cidrs.clone(),
        ..ProxyState::default()
    };
    for (key, svc) in &state.services {
        let new = map(key);
        let mut svc = svc.clone();
        svc.name = new.clone();
        out.services.insert(new, svc);
    }
    for (key, endpoints) in &state.endpoints {
        out.endpoints.insert(map(key), endpoints.clone());
    }
    out
}

// ------------------------------------------------------------------ tokens and shapes

/// Splits a line into tokens as the restore tools do: whitespace separates, a double-quoted
/// string (quotes included) is one token. `None` if a quote is left open.
fn tokens(line: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => {
                current.push(c);
                quoted = !quoted;
            }
            c if c.is_whitespace() && !quoted => {
                if !current.is_empty() {
                    out.push(std::mem::take(&mut current));
                }
            }
            c => current.push(c),
        }
    }
    if quoted {
        return None;
    }
    if !current.is_empty() {
        out.push(current);
    }
    Some(out)
}

/// `[A-Z2-7]` (RFC 4648 base32), the alphabet of every hash in chain and set names.
fn is_hash(text: &str, len: usize) -> bool {
    text.len() == len
        && text
            .bytes()
            .all(|b| b.is_ascii_uppercase() || (b'2'..=b'7').contains(&b))
}

/// An iptables chain named after a service port or endpoint: `KUBE-XXX-<16 base32>`.
fn is_iptables_hashed(token: &str) -> bool {
    let token = token.trim_start_matches(':');
    let Some(rest) = token.strip_prefix("KUBE-") else {
        return false;
    };
    let Some((kind, hash)) = rest.split_once('-') else {
        return false;
    };
    (2..=3).contains(&kind.len())
        && kind.bytes().all(|b| b.is_ascii_uppercase())
        && is_hash(hash, 16)
}

/// An nft chain or set named after a service port or endpoint:
/// `<prefix>-<8 base32>-<shown name in [A-Za-z0-9_./-]>`.
fn is_nft_hashed(token: &str) -> bool {
    let token = token.trim_start_matches('@').trim_end_matches([',', ';']);
    let prefixes = [
        nftables::names::SERVICE_PREFIX,
        nftables::names::LOCAL_PREFIX,
        nftables::names::EXTERNAL_PREFIX,
        nftables::names::FIREWALL_PREFIX,
        nftables::names::ENDPOINT_PREFIX,
        nftables::names::AFFINITY_PREFIX,
    ];
    let Some(rest) = prefixes.iter().find_map(|p| token.strip_prefix(p)) else {
        return false;
    };
    let (Some(hash), Some(shown)) = (rest.get(..8), rest.get(8..)) else {
        return false;
    };
    is_hash(hash, 8)
        && shown.starts_with('-')
        && shown
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-'))
}

/// Every line's shape: tokens, with quoted strings (comments) and name-derived identifiers
/// replaced by markers. Panics, naming the line, on an open quote or a control character.
fn shapes(text: &str, hashed: fn(&str) -> bool) -> BTreeMap<Vec<String>, usize> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        assert!(
            !line.chars().any(char::is_control),
            "control character in a rule line: {line:?}"
        );
        let Some(tokens) = tokens(line) else {
            panic!("unbalanced quote in a rule line: {line:?}");
        };
        let shape: Vec<String> = tokens
            .into_iter()
            .map(|t| {
                if t.starts_with('"') {
                    assert!(
                        t.ends_with('"')
                            && t.len() >= 2
                            && t[1..t.len() - 1].chars().all(|c| c != '"'),
                        "quote inside a token: {line:?}"
                    );
                    "<comment>".to_owned()
                } else if hashed(&t) {
                    "<name>".to_owned()
                } else {
                    assert!(!t.contains('"'), "quote outside a comment: {line:?}");
                    t
                }
            })
            .collect();
        *out.entry(shape).or_default() += 1;
    }
    out
}

/// The hostile render's lines have exactly the benign render's shapes.
fn same_shapes(hostile: &str, benign: &str, hashed: fn(&str) -> bool) -> Result<(), TestCaseError> {
    let h = shapes(hostile, hashed);
    let b = shapes(benign, hashed);
    if h != b {
        let extra: Vec<_> = h.keys().filter(|k| !b.contains_key(*k)).collect();
        let missing: Vec<_> = b.keys().filter(|k| !h.contains_key(*k)).collect();
        return Err(TestCaseError::fail(format!(
            "hostile names changed the rule structure\nextra: {extra:#?}\nmissing: {missing:#?}\n\
             --- hostile\n{hostile}"
        )));
    }
    Ok(())
}

fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    })
}

// ------------------------------------------------------------------ per mode

fn iptables_config() -> iptables::RenderConfig {
    iptables::RenderConfig {
        local_detector: LocalDetector::Cidrs(vec![
            "10.0.0.0/8".parse().expect("literal"),
            "fd00:10::/64".parse().expect("literal"),
        ]),
        ..iptables::RenderConfig::default()
    }
}

fn iptables_full(state: &ProxyState, family: IpFamily) -> iptables::RenderOutput {
    iptables::render(
        state,
        family,
        &iptables_config(),
        &SyncScope {
            kind: SyncKind::Full,
            changed: &BTreeSet::new(),
            existing_chains: &BTreeSet::new(),
        },
    )
    .expect("valid config renders")
}

#[test]
fn iptables_renders_keep_names_in_comments() {
    runner()
        .run(&proxy_state(), |state| {
            let safe = benign(&state);
            for family in [IpFamily::V4, IpFamily::V6] {
                let hostile = iptables_full(&state, family);
                let plain = iptables_full(&safe, family);
                same_shapes(&hostile.text, &plain.text, is_iptables_hashed)?;
                prop_assert_eq!(hostile.rules_written, plain.rules_written);
                prop_assert_eq!(hostile.chains.len(), plain.chains.len());
                // Every declared chain of the render is one it says it wrote.
                for line in hostile.text.lines() {
                    if let Some(chain) = line.strip_prefix(':').and_then(|l| l.split(' ').next())
                        && is_iptables_hashed(chain)
                    {
                        prop_assert!(hostile.chains.contains(chain), "{}", chain);
                    }
                }
                // A partial sync of the first service over the full one's chains.
                let Some(first) = state.services.keys().next() else {
                    continue;
                };
                let partial = |s: &ProxyState, changed: &ServicePortName, existing| {
                    iptables::render(
                        s,
                        family,
                        &iptables_config(),
                        &SyncScope {
                            kind: SyncKind::Partial,
                            changed: &BTreeSet::from([changed.service.clone()]),
                            existing_chains: existing,
                        },
                    )
                    .expect("valid config renders")
                };
                // The same service under both namings (names sort differently once renamed).
                let renamed = benign_key(&state, &safe, first);
                let hostile = partial(&state, first, &hostile.chains);
                let plain = partial(&safe, &renamed, &plain.chains);
                same_shapes(&hostile.text, &plain.text, is_iptables_hashed)?;
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

/// The key `key` of `state` has in its renamed copy `safe`: every generated service port
/// has its own ClusterIPs.
fn benign_key(state: &ProxyState, safe: &ProxyState, key: &ServicePortName) -> ServicePortName {
    let port = &state.services[key];
    safe.services
        .values()
        .find(|candidate| candidate.cluster_ips == port.cluster_ips)
        .map(|candidate| candidate.name.clone())
        .expect("renamed copy holds every service port")
}

fn nft_config() -> nftables::RenderConfig {
    nftables::RenderConfig {
        local_detector: nftables::LocalDetector::Cidrs(vec![
            "10.0.0.0/8".parse().expect("literal"),
            "fd00:10::/64".parse().expect("literal"),
        ]),
        node_port_addresses: NodePortAddresses::Ips(vec![
            "192.168.0.2".parse().expect("literal"),
            "2001:db8::1".parse().expect("literal"),
        ]),
        ..nftables::RenderConfig::default()
    }
}

#[test]
fn nftables_renders_keep_names_in_comments_and_identifiers() {
    runner()
        .run(&proxy_state(), |state| {
            let safe = benign(&state);
            for family in [IpFamily::V4, IpFamily::V6] {
                let (hostile, hostile_after) =
                    nftables::render_full(&state, family, &nft_config()).expect("renders");
                let (plain, plain_after) =
                    nftables::render_full(&safe, family, &nft_config()).expect("renders");
                same_shapes(&hostile.script(), &plain.script(), is_nft_hashed)?;
                prop_assert_eq!(hostile.operations, plain.operations);
                prop_assert_eq!(hostile.script().lines().count(), hostile.operations);
                // A partial sync that rewrites every service, over the full one's state.
                let changed = |s: &ProxyState| -> BTreeSet<ServiceName> {
                    s.services.keys().map(|n| n.service.clone()).collect()
                };
                let partial = |s: &ProxyState, existing: &NftState| {
                    nftables::render(
                        s,
                        family,
                        &nft_config(),
                        &NftScope {
                            kind: SyncKind::Partial,
                            changed: &changed(s),
                            existing,
                            delete_stale: true,
                            service_cidrs: &s.service_cidrs,
                        },
                    )
                    .expect("renders")
                };
                let hostile = partial(&state, &hostile_after);
                let plain = partial(&safe, &plain_after);
                same_shapes(&hostile.script(), &plain.script(), is_nft_hashed)?;
                prop_assert_eq!(hostile.operations, plain.operations);
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

fn ipvs_config() -> IpvsConfig {
    IpvsConfig {
        scheduler: Scheduler::Rr,
        node_ips: vec![
            "192.168.0.2".parse().expect("literal"),
            "2001:db8::1".parse().expect("literal"),
        ],
        detected_node_ips: Vec::new(),
        local_detector: LocalDetector::Cidrs(vec![
            "10.0.0.0/8".parse().expect("literal"),
            "fd00:10::/64".parse().expect("literal"),
        ]),
        masquerade_all: false,
        masquerade_bit: 14,
        drop_invalid: true,
        random_fully: true,
    }
}

/// ipvs mode writes no names: its plan (but the owner kept for error reports), ipset input
/// and iptables rules are the same under both namings, and well-formed.
fn check_ipvs(state: &ProxyState, safe: &ProxyState) -> Result<(), TestCaseError> {
    let config = ipvs_config();
    for family in [IpFamily::V4, IpFamily::V6] {
        let hostile = ipvs::plan(state, family, &config);
        let plain = ipvs::plan(safe, family, &config);
        prop_assert_eq!(hostile.services.len(), plain.services.len());
        for ((hk, hs), (pk, ps)) in hostile.services.iter().zip(&plain.services) {
            prop_assert_eq!(hk, pk);
            prop_assert_eq!(&hs.server, &ps.server);
            prop_assert_eq!(&hs.real_servers, &ps.real_servers);
        }
        prop_assert_eq!(&hostile.addresses, &plain.addresses);
        let restore =
            |d: &ipvs::Desired| ipvs::ipset::restore_input(family, &d.sets, &Default::default());
        let sets = restore(&hostile);
        prop_assert_eq!(&sets, &restore(&plain));
        shapes(&sets, |_| false);
        let rules = |d: &ipvs::Desired| {
            ipvs::rules::render(family, &config, &d.lb_no_node_access).expect("renders")
        };
        let text = rules(&hostile);
        prop_assert_eq!(&text, &rules(&plain));
        shapes(&text, |_| false);
    }
    Ok(())
}

#[test]
fn ipvs_outputs_hold_no_names() {
    runner()
        .run(&proxy_state(), |state| check_ipvs(&state, &benign(&state)))
        .unwrap_or_else(|failure| panic!("{failure}"));
}
/// The capture rules' input for one family, as the userspace backend builds it (a relay port
/// per service port, from its ClusterIP so that it does not depend on the names' order;
/// REJECT without endpoints).
fn captured(state: &ProxyState, family: IpFamily) -> Vec<CapturedPort> {
    let mut out = Vec::new();
    for (name, svc) in &state.services {
        let Some(svc) = svc.for_family(family) else {
            continue;
        };
        let has_endpoints = state.endpoints.get(name).is_some_and(|e| !e.is_empty());
        let index = match svc.cluster_ips[0] {
            IpAddr::V4(ip) => u16::from(ip.octets()[3]),
            IpAddr::V6(ip) => ip.segments()[7],
        };
        let target = if has_endpoints {
            Target::Redirect(40000 + index)
        } else {
            Target::Reject
        };
        out.push(CapturedPort {
            name: name.clone(),
            port: svc.port,
            cluster_ip: svc.cluster_ips[0],
            external_ips: svc.external_ips.clone(),
            load_balancer_ips: svc.load_balancer_ips.clone(),
            source_ranges: svc.load_balancer_source_ranges.clone(),
            node_port: svc.node_port,
            internal: target,
            external: if svc.external_policy_local {
                Target::Drop
            } else {
                target
            },
            // Both rule kinds present whenever they can be, so names meet them too.
            local_source_internal: svc.external_policy_local,
            allow_from_node: !svc.load_balancer_source_ranges.is_empty(),
        });
    }
    out
}

/// A full render of the capture rules.
fn capture(state: &ProxyState, family: IpFamily) -> userspace::CaptureRender {
    userspace::render(
        family,
        &captured(state, family),
        &CaptureConfig::default(),
        None,
        None,
        &BTreeSet::new(),
    )
}

#[test]
fn userspace_capture_rules_keep_names_in_comments() {
    runner()
        .run(&proxy_state(), |state| {
            let safe = benign(&state);
            for family in [IpFamily::V4, IpFamily::V6] {
                let hostile = capture(&state, family);
                let plain = capture(&safe, family);
                same_shapes(&hostile.text, &plain.text, is_iptables_hashed)?;
                prop_assert_eq!(hostile.chains.len(), plain.chains.len());
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

/// Every mode's checks above on one state.
fn check_all_modes(state: &ProxyState) -> Result<(), TestCaseError> {
    let safe = benign(state);
    check_ipvs(state, &safe)?;
    for family in [IpFamily::V4, IpFamily::V6] {
        same_shapes(
            &iptables_full(state, family).text,
            &iptables_full(&safe, family).text,
            is_iptables_hashed,
        )?;
        let nft = |s: &ProxyState| {
            nftables::render_full(s, family, &nft_config())
                .expect("renders")
                .0
                .script()
        };
        same_shapes(&nft(state), &nft(&safe), is_nft_hashed)?;
        same_shapes(
            &capture(state, family).text,
            &capture(&safe, family).text,
            is_iptables_hashed,
        )?;
    }
    Ok(())
}

/// The hostile manifests corpus (kp-sources/tests/data/hostile), read as the manifests
/// source reads it and tracked as the proxier tracks it, rendered in every mode.
#[test]
fn hostile_corpus_renders_keep_names_in_comments() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../input/kp-sources/tests/data/hostile");
    let mut tracker = ChangeTracker::new(common::NODE);
    for entry in std::fs::read_dir(&dir).expect("corpus") {
        let path = entry.expect("entry").path();
        // Unreadable files (not UTF-8) and the README hold no objects.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for object in kp_sources::manifests::parse_manifests(&text, &path).0 {
            tracker.record(object.applied());
        }
    }
    tracker.record(SourceEvent::Service(ObjectEvent::Synced));
    tracker.record(SourceEvent::EndpointSlice(ObjectEvent::Synced));
    let mut state = ProxyState::default();
    tracker.apply(&mut state);
    let hostile = state
        .services
        .keys()
        .filter(|k| k.service.name.contains('"') || k.service.namespace.contains('\n'))
        .count();
    assert!(hostile > 0, "the corpus's hostile names were not tracked");
    check_all_modes(&state).unwrap_or_else(|e| panic!("{e}"));

    // The real tools read the renders back as the renderer meant them: the same rules per
    // chain, nothing else (in a throwaway network namespace).
    let text = iptables_full(&state, IpFamily::V4).text;
    if let Some(reason) = common::netns_unavailable("iptables-restore") {
        eprintln!("skipping kernel check: {reason}");
    } else {
        let save = common::apply_in_netns("iptables-restore", &[&text])
            .unwrap_or_else(|e| panic!("iptables-restore refused the corpus's rules: {e}"));
        let rules = |text: &str, chain: &str| {
            let prefix = format!("-A {chain} ");
            text.lines().filter(|l| l.starts_with(&prefix)).count()
        };
        for chain in ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-EXTERNAL-SERVICES"] {
            assert_eq!(rules(&save, chain), rules(&text, chain), "{chain}:\n{save}");
        }
    }
    if let Some(reason) = nft_common::nft_unavailable() {
        eprintln!("skipping kernel check: {reason}");
    } else {
        let script = nftables::render_full(&state, IpFamily::V4, &nft_config())
            .expect("renders")
            .0
            .script();
        let listing = nft_common::apply_in_netns_then(&[&script], "nft list tables")
            .unwrap_or_else(|e| panic!("nft refused the corpus's script: {e}"));
        assert_eq!(listing.trim(), "table ip kube-proxy", "{listing}");
    }
}

/// The checker itself: an injected token, line or open quote is caught.
#[test]
fn shape_check_catches_injection() {
    let benign = "-A KUBE-SERVICES -m comment --comment \"ns/a:p\" -j KUBE-SVC-AAAAAAAAAAAAAAAA\n";
    let renamed = "-A KUBE-SERVICES -m comment --comment \"x\" -j KUBE-SVC-BBBBBBBBBBBBBBBB\n";
    assert!(same_shapes(renamed, benign, is_iptables_hashed).is_ok());
    let token =
        "-A KUBE-SERVICES -m comment --comment \"x\" -j ACCEPT -j KUBE-SVC-BBBBBBBBBBBBBBBB\n";
    assert!(same_shapes(token, benign, is_iptables_hashed).is_err());
    let line = "-A KUBE-SERVICES -m comment --comment \"x\" -j KUBE-SVC-BBBBBBBBBBBBBBBB\n-A KUBE-SERVICES -j ACCEPT\n";
    assert!(same_shapes(line, benign, is_iptables_hashed).is_err());
    let open = "-A KUBE-SERVICES -m comment --comment \"x -j KUBE-SVC-BBBBBBBBBBBBBBBB\n";
    assert!(std::panic::catch_unwind(|| shapes(open, is_iptables_hashed)).is_err());
    let nft = "add chain ip kube-proxy service-AAAAAAAA-ns/a/tcp/p\n";
    let nft_renamed = "add chain ip kube-proxy service-BBBBBBBB-x_y/b/tcp/p\n";
    assert!(same_shapes(nft_renamed, nft, is_nft_hashed).is_ok());
    let nft_injected = "add chain ip kube-proxy service-BBBBBBBB-x ; flush ruleset\n";
    assert!(same_shapes(nft_injected, nft, is_nft_hashed).is_err());
}

/// `DEST[:PORT][/PROTO]` texts: arbitrary, and well-formed ones aimed at the generated
/// services' addresses and ports (with hostile protocol and port spellings mixed in).
fn destination_text() -> impl Strategy<Value = String> {
    let ip = prop_oneof![
        (0u8..8).prop_map(|i| format!("172.30.0.{i}")),
        (0u8..8).prop_map(|i| format!("[fd00:172::{i}]")),
        (0u8..8, 0u8..4).prop_map(|(i, h)| format!("10.180.{}.{h}", 100 + i)),
        Just("192.168.0.2".to_owned()),
        Just("::ffff:1.2.3.4".to_owned()),
        Just("fe80::1%eth0".to_owned()),
        any::<String>(),
    ];
    let port = prop_oneof![
        Just(String::new()),
        (0u32..70000).prop_map(|p| format!(":{p}")),
        Just(":-1".to_owned()),
        Just(":".to_owned()),
    ];
    let proto = prop_oneof![
        Just(String::new()),
        Just("/tcp".to_owned()),
        Just("/UDP".to_owned()),
        Just("/sctp".to_owned()),
        Just("/icmp".to_owned()),
        Just("/24".to_owned()),
    ];
    prop_oneof![
        1 => any::<String>(),
        4 => (ip, port, proto).prop_map(|(ip, port, proto)| format!("{ip}{port}{proto}")),
    ]
}

/// `kp_rules::explain` (behind `kube-proxy explain` and `/debug/explain`) answers any query
/// against any state, hostile names included, or refuses it with an error; never panics.
#[test]
fn explain_answers_or_refuses_any_query() {
    let strategy = (
        proxy_state(),
        destination_text(),
        proptest::option::of(prop_oneof![
            Just("203.0.113.200".to_owned()),
            Just("fd00:10::9".to_owned()),
            any::<String>(),
        ]),
    );
    runner()
        .run(&strategy, |(state, dest, from)| {
            let Ok(destination) = dest.parse::<kp_rules::explain::Destination>() else {
                return Ok(());
            };
            let Some(source) = from.map(|f| f.parse::<IpAddr>()).transpose().ok() else {
                return Ok(());
            };
            let query = kp_rules::explain::Query {
                destination,
                source,
            };
            match kp_rules::explain::explain(&state, &iptables_config(), &query) {
                Ok(_) => {}
                Err(kp_rules::explain::ExplainError::FamilyMismatch { .. }) => {
                    prop_assert!(source.is_some_and(|s| s.is_ipv4() != destination.ip.is_ipv4()));
                }
                Err(other) => {
                    return Err(TestCaseError::fail(format!("{query:?}: {other}")));
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}
