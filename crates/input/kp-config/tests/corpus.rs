//! The configuration corpus: files and command lines as cluster tools write them (kubeadm for
//! every minor release from 1.26, kind, minikube, kubespray; k3s, RKE2, Talos and kops, which
//! pass flags only; and upstream's bare defaults in each Linux mode, `upstream-defaults*`),
//! each with the effective configuration upstream kube-proxy derives from it, written by hand
//! from upstream's defaulting and conversion code (`tests/corpus/expected/`, each header
//! naming the upstream source it follows). Each one must
//! load without error and `--write-config-to`'s output (`write_config`, i.e. `to_yaml`) must
//! hold exactly those values: no field missing, none extra, none different.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Parser as _;
use kp_config::{Loaded, Options};
use serde_json::Value;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn yaml(text: &str, origin: &str) -> Value {
    serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{origin}: {e}"))
}

/// The files of `dir` ending in `suffix`, by name.
fn files(dir: &Path, suffix: &str) -> BTreeMap<String, PathBuf> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .filter_map(|p| Some((p.file_name()?.to_string_lossy().into_owned(), p)))
        .collect()
}

fn load(args: &[String]) -> Loaded {
    let options = Options::try_parse_from(
        std::iter::once("kube-proxy".to_owned()).chain(args.iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    options
        .load()
        .unwrap_or_else(|e| panic!("{args:?} refused: {e}"))
}

/// Every difference between `got` and `want`, by path; numbers compare by value (5 and 5.0).
fn differences(got: &Value, want: &Value, at: &str, out: &mut Vec<String>) {
    match (got, want) {
        (Value::Object(g), Value::Object(w)) => {
            for key in g.keys().chain(w.keys().filter(|k| !g.contains_key(*k))) {
                let path = format!("{at}.{key}");
                match (g.get(key), w.get(key)) {
                    (Some(g), Some(w)) => differences(g, w, &path, out),
                    (Some(g), None) => out.push(format!("{path}: extra, written as {g}")),
                    (None, Some(w)) => out.push(format!("{path}: missing, upstream has {w}")),
                    (None, None) => {}
                }
            }
        }
        (Value::Number(g), Value::Number(w)) if g.as_f64() == w.as_f64() => {}
        (g, w) if g == w => {}
        (g, w) => out.push(format!("{at}: written as {g}, upstream has {w}")),
    }
}

fn check(name: &str, args: &[String]) -> Loaded {
    let loaded = load(args);
    let written = loaded
        .config
        .to_yaml()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let expected_path = corpus().join("expected").join(name);
    let want = yaml(&read(&expected_path), &expected_path.display().to_string());
    let mut diffs = Vec::new();
    differences(&yaml(&written, "written"), &want, "", &mut diffs);
    assert!(
        diffs.is_empty(),
        "{name}: --write-config-to differs from upstream's effective configuration:\n{}\n\nwritten:\n{written}",
        diffs.join("\n")
    );
    loaded
}

#[test]
fn every_file_gives_upstreams_effective_configuration() {
    let sources = files(&corpus(), ".yaml");
    assert!(sources.len() >= 15, "{sources:?}");
    for (name, path) in &sources {
        check(name, &[format!("--config={}", path.display())]);
    }
}

#[test]
fn every_command_line_gives_upstreams_effective_configuration() {
    let sources = files(&corpus().join("flags"), ".args");
    assert_eq!(sources.len(), 7, "{sources:?}");
    for (name, path) in &sources {
        let args: Vec<String> = read(path)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect();
        let stem = name.trim_end_matches(".args");
        check(&format!("{stem}.yaml"), &args);
    }
}

#[test]
fn every_expected_file_has_its_source() {
    let sources: Vec<String> = files(&corpus(), ".yaml")
        .into_keys()
        .chain(
            files(&corpus().join("flags"), ".args")
                .into_keys()
                .map(|n| n.replace(".args", ".yaml")),
        )
        .collect();
    for name in files(&corpus().join("expected"), ".yaml").keys() {
        assert!(sources.contains(name), "expected/{name} has no source");
    }
}

#[test]
fn cluster_tools_files_load_without_warnings() {
    // What kubeadm and the installers write is entirely known and applicable: a warning at
    // every start of every node would be noise.
    for (name, path) in files(&corpus(), ".yaml") {
        if matches!(
            name.as_str(),
            "unknown-and-duplicate.yaml" | "kind-template.yaml"
        ) {
            continue;
        }
        let loaded = load(&[format!("--config={}", path.display())]);
        assert_eq!(loaded.warnings, Vec::<String>::new(), "{name}");
    }
}

#[test]
fn unknown_and_duplicate_fields_are_named() {
    let path = corpus().join("unknown-and-duplicate.yaml");
    let loaded = load(&[format!("--config={}", path.display())]);
    let strict: Vec<&str> = loaded
        .warnings
        .iter()
        .filter(|w| w.contains("strict decoding failed"))
        .map(String::as_str)
        .collect();
    assert_eq!(strict.len(), 3, "{:#?}", loaded.warnings);
    assert!(strict[0].contains("unknown field \"someFutureField\" (line 9)"));
    assert!(strict[1].contains("unknown field \"conntrack.udpTimout\" (line 15)"));
    assert!(strict[2].contains("duplicate field \"conntrack.udpStreamTimeout\" (line 17)"));
}

#[test]
fn kinds_own_document_warns_about_its_metadata_only() {
    let path = corpus().join("kind-template.yaml");
    let loaded = load(&[format!("--config={}", path.display())]);
    assert_eq!(loaded.warnings.len(), 1, "{:#?}", loaded.warnings);
    assert!(loaded.warnings[0].contains("unknown field \"metadata\" (line 8)"));
}
