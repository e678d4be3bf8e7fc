//! Property tests of the manifests reader over arbitrary text and over valid manifests
//! mutated line by line and value by value (broken indentation, markers, anchors and
//! aliases, hostile scalars, truncation), in both YAML and JSON, multi-document and
//! `kind: List`.
//!
//! Properties: nothing panics or hangs; every broken document is reported with its file and
//! a line inside the file; every object handed on has a name (and a namespace, unless
//! cluster-scoped); and the objects survive the model and the change tracker, which either
//! take them or report them by name. Bounded for CI: [`CASES`] cases per property, and the
//! whole property within [`HANG`].

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use kp_core::event::{ObjectEvent, SourceEvent};
use kp_core::tracker::{ChangeTracker, ProxyState};
use kp_sources::manifests::{Kind, parse_manifests};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Cases per property.
const CASES: u32 = 256;

/// A whole property's budget before it counts as a hang; it needs a few seconds.
const HANG: Duration = Duration::from_secs(300);

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// Valid manifests to mutate: the tests' data, the example cluster and the corpus's valid
/// file and `kind: List`.
fn seeds() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../examples/cluster");
    for path in [
        data("web.yaml"),
        data("nodes.yaml"),
        data("dns.json"),
        data("hostile/valid.yaml"),
        data("hostile/names.yaml"),
        data("hostile/list.json"),
        examples.join("shop.yaml"),
        examples.join("dns.yaml"),
    ] {
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        out.push((name, text));
    }
    out
}

/// Lines that break structure in interesting ways.
const LINES: &[&str] = &[
    "---",
    "...",
    "--- |",
    "kind: List",
    "items:",
    "- {",
    "  - port: 0",
    "  - port: 65536",
    "    nodePort: -1",
    "spec: &a {ports: *a}",
    "\t- tab",
    "metadata: {name: \"a\\\" -j ACCEPT\", namespace: \"x\\ny\"}",
    "apiVersion: v1",
    "kind: Service",
    "kind: EndpointSlice",
    "addressType: IPv4",
    "endpoints: [{addresses: ['::ffff:1.2.3.4']}]",
    "{\"apiVersion\": \"v1\", \"kind\": \"List\", \"items\": [1, [], {}]}",
    "%YAML 1.1",
    "%TAG ! tag:example.com,2000:",
    "? complex key",
    "!!binary aGVsbG8=",
    "<<: *merge",
    "#",
];

/// Scalars to put where a value was.
const VALUES: &[&str] = &[
    "::ffff:1.2.3.4",
    "010.1.1.1",
    "fe80::1%eth0",
    "10.1.2.3/8",
    "65536",
    "-1",
    "0",
    "99999999999999999999",
    "1e400",
    "\"a\\\" -j ACCEPT\"",
    "\"x\\n-A KUBE-SERVICES -j ACCEPT\"",
    "null",
    "~",
    "[]",
    "{}",
    "*undefined",
    "&anchor value",
    "'",
    "\"",
    "!!int x",
    "true",
    "None",
    "ExternalName",
    "Local",
];

#[derive(Clone, Debug)]
enum Mutation {
    Delete(usize),
    Duplicate(usize),
    Insert(usize, String),
    Value(usize, String),
    Indent(usize, bool),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let line = prop_oneof![
        3 => proptest::sample::select(LINES).prop_map(str::to_owned),
        1 => any::<String>(),
    ];
    let value = prop_oneof![
        3 => proptest::sample::select(VALUES).prop_map(str::to_owned),
        1 => any::<String>(),
    ];
    prop_oneof![
        1 => any::<usize>().prop_map(Mutation::Delete),
        1 => any::<usize>().prop_map(Mutation::Duplicate),
        1 => (any::<usize>(), line).prop_map(|(at, l)| Mutation::Insert(at, l)),
        3 => (any::<usize>(), value).prop_map(|(at, v)| Mutation::Value(at, v)),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(at, more)| Mutation::Indent(at, more)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(text: &str, mutation: &Mutation) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
    if lines.is_empty() {
        lines.push(String::new());
    }
    let n = lines.len();
    match mutation {
        Mutation::Delete(at) => {
            lines.remove(at % n);
        }
        Mutation::Duplicate(at) => {
            let line = lines[at % n].clone();
            lines.insert(at % n, line);
        }
        Mutation::Insert(at, line) => lines.insert(at % (n + 1), line.clone()),
        Mutation::Value(at, value) => {
            // The scalar after `key: ` (YAML) or `"key": ` (JSON), or the whole line.
            let line = &mut lines[at % n];
            *line = match line.split_once(": ") {
                Some((key, _)) => format!("{key}: {value}"),
                None => value.clone(),
            };
        }
        Mutation::Indent(at, more) => {
            let line = &mut lines[at % n];
            *line = if *more {
                format!("  {line}")
            } else {
                line.strip_prefix("  ").unwrap_or(line).to_owned()
            };
        }
        Mutation::Truncate(at) => {
            let joined = lines.join("\n");
            let mut cut = at % (joined.len() + 1);
            while !joined.is_char_boundary(cut) {
                cut -= 1;
            }
            return joined[..cut].to_owned();
        }
    }
    lines.join("\n") + "\n"
}

/// Parses `text` as `file` and checks every property; the objects then go through the model.
fn check(text: &str, file: &str) -> Result<(), TestCaseError> {
    let path = Path::new(file);
    let (objects, errors) = parse_manifests(text, path);
    let lines = text.lines().count().max(1);
    for error in &errors {
        prop_assert_eq!(&error.file, path);
        prop_assert!(error.document.is_some(), "{}", error);
        let line = error.line.unwrap_or_default();
        // A position is inside the file (or just after its last line, for an early end).
        prop_assert!(
            (1..=lines + 1).contains(&line),
            "line {} of {}: {}",
            line,
            lines,
            error
        );
        prop_assert!(!error.to_string().contains('\n'), "{:?}", error.to_string());
    }
    let mut tracker = ChangeTracker::new("node-1");
    for object in &objects {
        let key = object.key();
        prop_assert!(!key.name.is_empty(), "{:?}", key);
        let cluster_scoped = matches!(key.kind, Kind::Node | Kind::ServiceCidr);
        prop_assert_eq!(key.namespace.is_empty(), cluster_scoped, "{:?}", key);
        tracker.record(object.clone().applied());
    }
    tracker.record(SourceEvent::Service(ObjectEvent::Synced));
    tracker.record(SourceEvent::EndpointSlice(ObjectEvent::Synced));
    let update = tracker.apply(&mut ProxyState::default());
    for error in &update.invalid {
        let named = objects.iter().any(|o| {
            let key = o.key();
            key.kind.as_str() == error.kind
                && key.namespace == error.namespace
                && key.name == error.name
        });
        prop_assert!(named, "{} is not one of the objects read", error);
    }
    Ok(())
}

/// Runs `property` over `strategy` on another thread, failing if it outlives [`HANG`].
fn bounded<S>(strategy: S, property: fn(S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy + Send + 'static,
{
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut runner = TestRunner::new(Config {
            cases: CASES,
            failure_persistence: None,
            ..Config::default()
        });
        let _ = tx.send(runner.run(&strategy, property).map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(HANG) {
        Ok(Ok(())) => {}
        Ok(Err(failure)) => panic!("{failure}"),
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("no result within {HANG:?}: a hang"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the property panicked"),
    }
}

#[test]
fn arbitrary_text_is_reported_never_fatal() {
    let text = prop_oneof![
        any::<String>(),
        // Text made of the YAML and JSON syntax characters, to reach deeper into the parsers.
        "[-:{}\\[\\],'\"&*!|>%@` \t\n#?a-z0-9.]{0,400}",
        proptest::collection::vec(proptest::sample::select(LINES), 0..30)
            .prop_map(|lines| lines.join("\n")),
    ];
    bounded((text, any::<bool>()), |(text, json)| {
        check(&text, if json { "fuzz.json" } else { "fuzz.yaml" })
    });
}

#[test]
fn mutated_manifests_are_reported_never_fatal() {
    let seeds = seeds();
    let strategy = (
        proptest::sample::select(seeds),
        proptest::collection::vec(mutation(), 1..6),
    );
    bounded(strategy, |((name, text), mutations)| {
        let mutated = mutations.iter().fold(text, |text, m| apply(&text, m));
        check(&mutated, &name)
    });
}

/// The seeds themselves are valid: mutations start from something that works.
#[test]
fn the_seeds_parse_cleanly() {
    for (name, text) in seeds() {
        let (objects, errors) = parse_manifests(&text, Path::new(&name));
        assert!(!objects.is_empty(), "{name}");
        if name != "list.json" {
            assert!(errors.is_empty(), "{name}: {errors:#?}");
        }
    }
}
