//! Property tests of the configuration's outside inputs through the public entry points
//! ([`KubeProxyConfiguration::from_yaml`], `Options::try_parse_from` and [`Options::load`]):
//! arbitrary text, a valid file mutated value by value (wrong types, hostile strings, numbers
//! at the edges, removed and unknown keys), and command lines of real flags with arbitrary
//! values.
//!
//! Properties that hold however decoding evolves: nothing panics; a refusal is an error with
//! a message; and every value that is invalid whatever the decoder does is reported, each
//! naming its field or flag. Bounded for CI: [`CASES`] cases per property.

use std::io::Write as _;

use clap::Parser as _;
use kp_config::{KubeProxyConfiguration, Options};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Value, json};

/// Cases per property.
const CASES: u32 = 256;

/// A valid file touching most sections, as JSON (which YAML includes).
fn base() -> Value {
    json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "bindAddress": "0.0.0.0",
        "clusterCIDR": "10.244.0.0/16",
        "healthzBindAddress": "0.0.0.0:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "mode": "iptables",
        "oomScoreAdj": -999,
        "portRange": "",
        "iptables": {"masqueradeBit": 14, "minSyncPeriod": "1s", "syncPeriod": "30s"},
        "ipvs": {"scheduler": "rr", "excludeCIDRs": ["10.96.0.0/12"], "tcpTimeout": "0s"},
        "conntrack": {"maxPerCore": 32768, "min": 131072, "tcpEstablishedTimeout": "24h0m0s"},
        "nodePortAddresses": ["10.0.0.0/8"],
        "featureGates": {"GracefulNodeShutdown": true},
        "clientConnection": {"kubeconfig": "", "qps": 5, "burst": 10},
        "detectLocalMode": "ClusterCIDR",
    })
}

/// Values to put anywhere.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(null)),
        Just(json!(true)),
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(i64::MAX)),
        Just(json!(u64::MAX)),
        Just(json!(1e300)),
        Just(json!(-0.5)),
        Just(json!("")),
        Just(json!("\" ; flush ruleset")),
        Just(json!("x\n-A KUBE-SERVICES -j ACCEPT")),
        Just(json!("::ffff:1.2.3.4")),
        Just(json!("10.0.0.0/33")),
        Just(json!("999999h")),
        Just(json!("-1s")),
        Just(json!("1.5.5")),
        Just(json!([])),
        Just(json!([1, "a", null])),
        Just(json!({})),
        Just(json!({"nested": {"deeper": [1]}})),
        any::<String>().prop_map(Value::String),
        any::<i64>().prop_map(|n| json!(n)),
    ]
}

#[derive(Clone, Debug)]
enum Edit {
    /// Replace the n-th leaf (in walk order) with a value.
    Replace(usize, Value),
    /// Remove the n-th key of any object.
    Remove(usize),
    /// Add a key (maybe unknown, maybe a known one at the wrong level) to the n-th object.
    Add(usize, String, Value),
}

fn edit() -> impl Strategy<Value = Edit> {
    let key = prop_oneof![
        Just("mode".to_owned()),
        Just("masqueradeBit".to_owned()),
        Just("unknownField".to_owned()),
        Just("apiVersion".to_owned()),
        any::<String>(),
    ];
    prop_oneof![
        3 => (any::<usize>(), hostile_value()).prop_map(|(n, v)| Edit::Replace(n, v)),
        1 => any::<usize>().prop_map(Edit::Remove),
        1 => (any::<usize>(), key, hostile_value()).prop_map(|(n, k, v)| Edit::Add(n, k, v)),
    ]
}

/// Every leaf, then every object, in a fixed order.
fn count(value: &Value, leaves: &mut usize, objects: &mut usize) {
    match value {
        Value::Object(map) => {
            *objects += 1;
            map.values().for_each(|v| count(v, leaves, objects));
        }
        Value::Array(items) => items.iter().for_each(|v| count(v, leaves, objects)),
        _ => *leaves += 1,
    }
}

fn apply(value: &mut Value, edit: &Edit) {
    let (mut leaves, mut objects) = (0, 0);
    count(value, &mut leaves, &mut objects);
    // The chosen position, counted down as the walk passes leaves or objects.
    let (mut target, on_leaves) = match edit {
        Edit::Replace(n, _) => (n % leaves.max(1), true),
        Edit::Remove(n) | Edit::Add(n, ..) => (n % objects.max(1), false),
    };
    walk(value, &mut target, on_leaves, edit);
}

fn walk(value: &mut Value, target: &mut usize, on_leaves: bool, edit: &Edit) -> bool {
    match value {
        Value::Object(map) => {
            if !on_leaves {
                if *target == 0 {
                    match edit {
                        Edit::Remove(n) => {
                            if let Some(key) = map.keys().nth(n % map.len().max(1)).cloned() {
                                map.remove(&key);
                            }
                        }
                        Edit::Add(_, key, v) => {
                            map.insert(key.clone(), v.clone());
                        }
                        Edit::Replace(..) => {}
                    }
                    return true;
                }
                *target -= 1;
            }
            map.values_mut().any(|v| walk(v, target, on_leaves, edit))
        }
        Value::Array(items) => items.iter_mut().any(|v| walk(v, target, on_leaves, edit)),
        leaf => {
            if on_leaves {
                if *target == 0 {
                    if let Edit::Replace(_, v) = edit {
                        *leaf = v.clone();
                    }
                    return true;
                }
                *target -= 1;
            }
            false
        }
    }
}

/// `message` names every one of `words` (case aside).
fn reports_all<'a>(
    message: &str,
    words: impl IntoIterator<Item = &'a str>,
) -> Result<(), TestCaseError> {
    let message = message.to_lowercase();
    for word in words {
        prop_assert!(
            message.contains(word),
            "{} not reported:\n{}",
            word,
            message
        );
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

#[test]
fn the_base_file_is_valid() {
    let text = base().to_string();
    KubeProxyConfiguration::from_yaml(&text).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn arbitrary_text_is_refused_with_a_message() {
    let text = prop_oneof![
        any::<String>(),
        "[-:{}\\[\\],'\"&*!|>%@` \t\n#?a-zA-Z0-9.]{0,300}",
        // A valid header followed by anything.
        any::<String>().prop_map(|rest| format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{rest}"
        )),
    ];
    runner()
        .run(&text, |text| {
            if let Err(error) = KubeProxyConfiguration::from_yaml(&text) {
                prop_assert!(!error.to_string().trim().is_empty());
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

#[test]
fn mutated_files_are_decoded_or_refused_with_a_message() {
    let strategy = (proptest::collection::vec(edit(), 1..5), any::<bool>());
    runner()
        .run(&strategy, |(edits, pretty)| {
            let mut value = base();
            for edit in &edits {
                apply(&mut value, edit);
            }
            let text = if pretty {
                serde_json::to_string_pretty(&value).expect("JSON")
            } else {
                value.to_string()
            };
            if let Err(error) = KubeProxyConfiguration::from_yaml(&text) {
                prop_assert!(!error.to_string().trim().is_empty());
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

/// Values no decoder accepts, with a word the report must contain (part of the field's
/// name, which survives however the message is worded).
fn invalid_fields() -> Vec<(&'static str, Value, &'static str)> {
    vec![
        ("mode", json!("bogus"), "mode"),
        ("oomScoreAdj", json!(5000), "oom"),
        ("healthzBindAddress", json!("not-an-address"), "healthz"),
        ("metricsBindAddress", json!("also not one"), "metrics"),
        ("clusterCIDR", json!("10.0.0.0/99"), "cluster"),
        ("portRange", json!("9-1-2"), "port"),
    ]
}

#[test]
fn every_invalid_value_is_reported() {
    let fields = invalid_fields();
    let subsets = proptest::sample::subsequence(fields, 1..=6);
    runner()
        .run(&subsets, |chosen| {
            let mut value = base();
            for (key, bad, _) in &chosen {
                value[*key] = bad.clone();
            }
            let error = KubeProxyConfiguration::from_yaml(&value.to_string())
                .expect_err("invalid values accepted");
            reports_all(&error.to_string(), chosen.iter().map(|(_, _, word)| *word))
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

/// Real flags (and a few that are not) with arbitrary values.
fn command_line() -> impl Strategy<Value = Vec<String>> {
    let flag = proptest::sample::select(
        &[
            "--proxy-mode",
            "--cluster-cidr",
            "--healthz-bind-address",
            "--metrics-bind-address",
            "--bind-address",
            "--iptables-masquerade-bit",
            "--iptables-sync-period",
            "--iptables-min-sync-period",
            "--ipvs-scheduler",
            "--ipvs-exclude-cidrs",
            "--conntrack-max-per-core",
            "--conntrack-tcp-timeout-established",
            "--nodeport-addresses",
            "--oom-score-adj",
            "--proxy-port-range",
            "--feature-gates",
            "--hostname-override",
            "--masquerade-all",
            "--kube-api-qps",
            "--detect-local-mode",
            "--udp-timeout",
            "-v",
            "--vmodule",
            "--no-such-flag",
            "-",
            "--",
        ][..],
    );
    let value = prop_oneof![
        Just(String::new()),
        Just("0".to_owned()),
        Just("-1".to_owned()),
        Just("99999999999999999999".to_owned()),
        Just("10.0.0.0/8,fd00::/64".to_owned()),
        Just("::ffff:1.2.3.4".to_owned()),
        Just("1h2m3s4ms".to_owned()),
        Just("true".to_owned()),
        Just("A=true,B=false,=".to_owned()),
        any::<String>(),
    ];
    proptest::collection::vec((flag, value, any::<bool>()), 0..8).prop_map(|flags| {
        let mut argv = vec!["kube-proxy".to_owned()];
        for (flag, value, joined) in flags {
            if joined {
                argv.push(format!("{flag}={value}"));
            } else {
                argv.push(flag.to_owned());
                argv.push(value);
            }
        }
        argv
    })
}

#[test]
fn arbitrary_command_lines_are_parsed_or_refused_with_a_message() {
    runner()
        .run(&command_line(), |argv| {
            match Options::try_parse_from(&argv) {
                Err(error) => prop_assert!(!error.to_string().trim().is_empty()),
                Ok(options) => {
                    if let Err(error) = options.load() {
                        prop_assert!(!error.to_string().trim().is_empty());
                    }
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}

#[test]
fn every_invalid_flag_is_reported_and_a_config_file_is_read_through_load() {
    let flags = proptest::sample::subsequence(
        vec![
            ("--iptables-masquerade-bit=40", "masquerade"),
            ("--oom-score-adj=5000", "oom"),
            ("--healthz-bind-address=not-an-address", "healthz"),
            ("--proxy-mode=bogus", "mode"),
        ],
        1..=4,
    );
    runner()
        .run(&flags, |chosen| {
            let mut argv = vec!["kube-proxy"];
            argv.extend(chosen.iter().map(|(flag, _)| *flag));
            match Options::try_parse_from(&argv) {
                // A value clap itself cannot parse (an unknown mode) stops the parse at the
                // first such flag: it is named, the others are not looked at.
                Err(error) => {
                    let message = error.to_string().to_lowercase();
                    prop_assert!(
                        chosen.iter().any(|(flag, _)| {
                            let name = flag.split('=').next().unwrap_or_default();
                            message.contains(name)
                        }),
                        "no flag named:\n{}",
                        message
                    );
                }
                // Every value refused by validation is reported at once.
                Ok(options) => {
                    let error = options.load().expect_err("invalid flags accepted");
                    reports_all(&error.to_string(), chosen.iter().map(|(_, word)| *word))?;
                }
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));

    // The file path of `load`: a mutated file is read and refused or accepted, never fatal.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.yaml");
    let strategy = proptest::collection::vec(edit(), 1..4);
    runner()
        .run(&strategy, |edits| {
            let mut value = base();
            for edit in &edits {
                apply(&mut value, edit);
            }
            let mut file = std::fs::File::create(&path).expect("create");
            file.write_all(value.to_string().as_bytes()).expect("write");
            let argv = [
                "kube-proxy".to_owned(),
                format!("--config={}", path.display()),
            ];
            let options = Options::try_parse_from(&argv).expect("--config parses");
            if let Err(error) = options.load() {
                prop_assert!(!error.to_string().trim().is_empty());
            }
            Ok(())
        })
        .unwrap_or_else(|failure| panic!("{failure}"));
}
