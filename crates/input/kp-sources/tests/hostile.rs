//! The hostile corpus (`tests/data/hostile/`, see its README): every file is read as the
//! manifests source reads it, and its objects go through the model and the change tracker as
//! the proxier feeds them. Nothing may panic or hang; broken documents are reported with
//! their file and position; the model rejects exactly the objects in [`EXPECTED`], each named
//! once; the valid objects next to them are programmed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use kp_core::event::{ObjectEvent, SourceEvent};
use kp_core::tracker::{ChangeTracker, ProxyState};
use kp_sources::manifests::{ManifestError, Object, parse_manifests};

/// How long reading the whole corpus may take before it counts as a hang: far beyond what
/// it needs (well under a second), so a loaded machine never trips it.
const HANG: Duration = Duration::from_secs(120);

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hostile")
}

/// Every corpus file's objects and errors, as the manifests source reads them (an unreadable
/// file, such as one that is not UTF-8, is one error).
fn read_corpus() -> Vec<(String, Vec<Object>, Option<Vec<ManifestError>>)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus())
        .expect("corpus directory")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml" || e == "json"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            match std::fs::read_to_string(&path) {
                Ok(text) => {
                    let (objects, errors) = parse_manifests(&text, &path);
                    (name, objects, Some(errors))
                }
                Err(_) => (name, Vec::new(), None),
            }
        })
        .collect()
}

/// Per file: objects decoded, broken documents reported (`None`: the file cannot be read).
const EXPECTED_FILES: &[(&str, usize, Option<usize>)] = &[
    ("addresses.yaml", 1, Some(8)),
    ("binary.yaml", 0, None),
    ("bomb.yaml", 0, Some(1)),
    ("broken.yaml", 2, Some(8)),
    ("deep.yaml", 0, Some(1)),
    ("huge.json", 2, Some(0)),
    ("list.json", 3, Some(8)),
    ("names.yaml", 5, Some(0)),
    ("ports.yaml", 7, Some(2)),
    ("valid.yaml", 2, Some(0)),
];

/// The objects the model rejects (they decode, and pass the manifests' address checks).
const EXPECTED_INVALID: &[(&str, &str)] = &[
    ("EndpointSlice", "slice-port-too-big"),
    ("EndpointSlice", "wrong-family"),
    ("Service", "affinity-too-long"),
    ("Service", "list-bad-port"),
    ("Service", "port-duplicate"),
    ("Service", "port-negative"),
    ("Service", "port-protocol"),
    ("Service", "port-too-big"),
    ("Service", "port-zero"),
];

#[test]
fn every_file_is_read_and_every_broken_document_reported_at_its_place() {
    let files = read_bounded();
    let names: Vec<&str> = files.iter().map(|(name, ..)| name.as_str()).collect();
    let expected: Vec<&str> = EXPECTED_FILES.iter().map(|(name, ..)| *name).collect();
    assert_eq!(
        names, expected,
        "corpus files without an expectation, or missing"
    );
    for ((name, objects, errors), (_, want_objects, want_errors)) in
        files.iter().zip(EXPECTED_FILES)
    {
        let keys: Vec<String> = objects.iter().map(|o| o.key().to_string()).collect();
        assert_eq!(objects.len(), *want_objects, "{name}: {keys:#?}");
        let Some(errors) = errors else {
            assert!(want_errors.is_none(), "{name} could not be read");
            continue;
        };
        let shown: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(Some(errors.len()), *want_errors, "{name}: {shown:#?}");
        for (error, text) in errors.iter().zip(&shown) {
            assert!(error.file.ends_with(name), "{text}");
            assert!(
                error.document.is_some() && error.line.is_some(),
                "no position: {text}"
            );
            // One log line each, whatever the input quoted.
            assert!(!text.contains(['\n', '\r']), "{text:?}");
        }
    }
}

#[test]
fn the_model_rejects_exactly_the_listed_objects_and_keeps_the_rest() {
    let files = read_bounded();
    let mut tracker = ChangeTracker::new("node-1");
    for (_, objects, _) in &files {
        for object in objects {
            tracker.record(object.clone().applied());
        }
    }
    for synced in [
        SourceEvent::Service(ObjectEvent::Synced),
        SourceEvent::EndpointSlice(ObjectEvent::Synced),
    ] {
        tracker.record(synced);
    }
    let mut state = ProxyState::default();
    let update = tracker.apply(&mut state);
    let invalid: Vec<(&str, &str)> = update
        .invalid
        .iter()
        .map(|e| (e.kind, e.name.as_str()))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(invalid, EXPECTED_INVALID, "{:#?}", update.invalid);
    assert_eq!(
        update.invalid.len(),
        EXPECTED_INVALID.len(),
        "each reported once"
    );
    for error in &update.invalid {
        assert_eq!(error.namespace, "hostile", "{error}");
        assert!(!error.to_string().contains('\n'), "{error}");
    }

    // The valid neighbours are all there, hostile names included.
    let services: BTreeSet<String> = state
        .services
        .keys()
        .map(|k| k.service.name.to_string())
        .collect();
    for name in [
        "survivor",
        "wide",
        "before-broken",
        "after-broken",
        "list-ok",
        "after-list",
    ] {
        assert!(services.contains(name), "{name} missing: {services:#?}");
    }
    assert!(services.contains("quote\" -j ACCEPT"), "{services:#?}");
    assert_eq!(services.len(), 10, "{services:#?}");
    let survivor = state
        .services
        .keys()
        .find(|k| k.service.name == "survivor")
        .expect("survivor");
    assert_eq!(state.endpoints[survivor].len(), 1);
    let wide: Vec<_> = state
        .services
        .keys()
        .filter(|k| k.service.name == "wide")
        .collect();
    assert_eq!(wide.len(), 200);
    let with_endpoints = wide
        .iter()
        .filter(|k| state.endpoints.contains_key(**k))
        .count();
    assert_eq!(with_endpoints, 2);
    assert_eq!(state.endpoints[wide[0]].len(), 1000);
}

/// [`read_corpus`] on another thread, failing (not hanging) if it takes beyond [`HANG`].
fn read_bounded() -> Vec<(String, Vec<Object>, Option<Vec<ManifestError>>)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(read_corpus());
    });
    rx.recv_timeout(HANG)
        .unwrap_or_else(|_| panic!("reading the corpus took over {HANG:?}: a hang"))
}
