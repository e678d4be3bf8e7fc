//! The documentation, kept true where a test can: README's extensions table is what
//! `kp_config::audit` calls extensions (plus the subcommands `--help` lists and the
//! `KUBE_PROXY_RS_*` variables the code reads), `docs/metrics.md` is what `/metrics` serves in
//! each kind of run, README's headline figures are `bench/REPORT.md`'s, and every relative
//! link in the documents resolves, anchors included. `readme.rs` checks README's two commands.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kp_config::audit::{self, Treatment};
use kp_testbed::Namespace;
use kp_testbed::proxy::{ProxyLaunch, ProxyProcess};

const README: &str = include_str!("../../../README.md");
const METRICS_DOC: &str = include_str!("../../../docs/metrics.md");
const REPORT: &str = include_str!("../../../bench/REPORT.md");

/// How long a proxy on the small example cluster may take to start and sync once.
const FIRST_SYNC: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_kube-proxy")
}

/// The rows of the first Markdown table after `heading`, each as its cells (which hold no
/// `|` in these documents).
fn table_after(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let start = doc
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?} in the document"));
    doc[start..]
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2) // the header and its rule
        .map(|line| {
            line.trim_matches('|')
                .split('|')
                .map(|cell| cell.trim().to_owned())
                .collect()
        })
        .collect()
}

/// The `code spans` of a cell.
fn code_spans(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

// ---------------------------------------------------------------- the extensions table

/// What README's extensions table lists, by kind.
#[derive(Debug, Default)]
struct Extensions {
    flags: BTreeSet<String>,
    fields: BTreeSet<String>,
    subcommands: BTreeSet<String>,
    env: BTreeSet<String>,
    /// Rows naming a flag and a file field together: the flag must set that field.
    pairs: Vec<(String, String)>,
}

fn readme_extensions() -> Extensions {
    let mut found = Extensions::default();
    for row in table_after(README, "## What this project adds to upstream") {
        let (mut flag, mut field) = (None, None);
        for span in code_spans(&row[0]) {
            let word = span
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned();
            if word.starts_with("--") {
                found.flags.insert(word.clone());
                flag = Some(word);
            } else if let Some(sub) = span.strip_prefix("kube-proxy ") {
                found
                    .subcommands
                    .insert(sub.split_whitespace().next().unwrap_or_default().to_owned());
            } else if word.starts_with("KUBE_PROXY_RS_") {
                found.env.insert(word);
            } else {
                found.fields.insert(word.clone());
                field = Some(word);
            }
        }
        if let (Some(flag), Some(field)) = (flag, field) {
            found.pairs.push((flag, field));
        }
    }
    found
}

/// Every `"KUBE_PROXY_RS_..."` string literal in the product crates' sources.
fn env_vars_read_by_the_code() -> BTreeSet<String> {
    fn walk(dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).expect("read a source directory") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() && !path.ends_with("tests") {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read a source file");
                for (_, rest) in text
                    .match_indices("\"KUBE_PROXY_RS_")
                    .map(|(i, _)| text.split_at(i + 1))
                {
                    let name = rest.split('"').next().unwrap_or_default();
                    out.insert(name.to_owned());
                }
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(&repo().join("crates"), &mut out);
    out
}

/// The subcommands `kube-proxy --help` shows in its usage lines.
fn subcommands_in_help() -> BTreeSet<String> {
    let out = Command::new(binary())
        .arg("--help")
        .output()
        .expect("run kube-proxy --help");
    assert!(out.status.success(), "kube-proxy --help: {out:?}");
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        !help.contains("[`"),
        "rustdoc link syntax in --help:\n{help}"
    );
    help.lines()
        .filter_map(|line| line.strip_prefix("  kube-proxy "))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|word| !word.starts_with('['))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_extensions_table_is_what_the_audit_calls_extensions() {
    let readme = readme_extensions();
    let flags: BTreeSet<String> = audit::FLAGS
        .iter()
        .filter(|f| audit::flag_treatment(f.flag) == Some(Treatment::Extension))
        .map(|f| f.flag.to_owned())
        .collect();
    let fields: BTreeSet<String> = audit::FIELDS
        .iter()
        .filter(|f| f.treatment == Treatment::Extension)
        .map(|f| f.path.to_owned())
        .collect();
    assert_eq!(
        readme.flags, flags,
        "README's extension flags vs kp_config::audit::FLAGS"
    );
    assert_eq!(
        readme.fields, fields,
        "README's extension fields vs kp_config::audit::FIELDS"
    );
    for (flag, field) in &readme.pairs {
        let sets = audit::FLAGS
            .iter()
            .find(|f| f.flag == flag)
            .and_then(|f| f.field);
        assert_eq!(
            sets,
            Some(field.as_str()),
            "README pairs {flag} with {field}"
        );
    }
    assert_eq!(
        readme.env,
        env_vars_read_by_the_code(),
        "README's KUBE_PROXY_RS_* variables"
    );
    assert_eq!(
        readme.subcommands,
        subcommands_in_help(),
        "README's subcommands vs --help"
    );
}

// ---------------------------------------------------------------- README's figures

#[test]
fn readme_figures_are_the_reports() {
    let rows = table_after(README, "## Performance");
    assert_eq!(rows.len(), 5, "five headline figures: {rows:?}");
    for row in rows {
        for figure in row[1].split(" / ") {
            assert!(
                REPORT.contains(figure),
                "README's {figure:?} ({}) is not in bench/REPORT.md",
                row[0]
            );
        }
    }
}

// ---------------------------------------------------------------- links

/// The documents whose relative links must resolve.
fn documents() -> Vec<PathBuf> {
    let root = repo();
    let mut docs: Vec<PathBuf> = [
        "README.md",
        "CHANGELOG.md",
        "deploy/README.md",
        "tools/kp-bench/README.md",
    ]
    .iter()
    .map(|p| root.join(p))
    .collect();
    for dir in ["docs", "bench", "bench/notes"] {
        for entry in std::fs::read_dir(root.join(dir)).expect("read a docs directory") {
            let path = entry.expect("directory entry").path();
            if path.extension().is_some_and(|e| e == "md") {
                docs.push(path);
            }
        }
    }
    docs
}

/// The targets of a Markdown document's inline links outside code blocks.
fn link_targets(text: &str) -> Vec<String> {
    let mut in_code = false;
    let mut targets = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        for (i, _) in line.match_indices("](") {
            let rest = &line[i + 2..];
            if let Some(end) = rest.find(')') {
                targets.push(rest[..end].to_owned());
            }
        }
    }
    targets
}

/// The anchors of a Markdown document's headings, as GitHub makes them: lowercase, letters,
/// digits, `-` and `_` kept, spaces made `-`, everything else dropped.
fn anchors(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|line| line.starts_with('#'))
        .map(|line| {
            line.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

#[test]
fn every_relative_link_resolves() {
    let mut broken = Vec::new();
    let docs = documents();
    assert!(docs.len() > 10, "found the documents: {docs:?}");
    for doc in docs {
        let text = std::fs::read_to_string(&doc).expect("read a document");
        let dir = doc.parent().expect("a document's directory");
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let path = if file.is_empty() {
                doc.clone()
            } else {
                dir.join(file)
            };
            let resolves = path.exists()
                && (anchor.is_empty()
                    || !file.is_empty() && !file.ends_with(".md")
                    || anchors(&std::fs::read_to_string(&path).unwrap_or_default())
                        .contains(anchor));
            if !resolves {
                broken.push(format!("{}: {target}", doc.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to nothing:\n{}",
        broken.join("\n")
    );
}

// ---------------------------------------------------------------- the metrics reference

/// One row of `docs/metrics.md`: the family as queried, its type, whether it has labels (then
/// it shows up with its first sample) and when it is served.
#[derive(Debug)]
struct Documented {
    name: String,
    kind: String,
    labelled: bool,
    when: String,
}

/// Labelled families whose first sample needs an event these runs do not cause: a failed or
/// expired watch, a userspace cap reached, a client the relay gave up on, a localhost
/// NodePort whose port another program holds.
const NOT_CAUSED_HERE: [&str; 7] = [
    "kube_proxy_rs_watch_failures_total",
    "kube_proxy_rs_watch_relists_total",
    // An object the proxy cannot decode, and another program changing its rules: the fault
    // suite causes both and reads them from `/metrics`.
    "kube_proxy_rs_watch_skipped_objects_total",
    "kube_proxy_rs_foreign_changes_total",
    "kube_proxy_rs_userspace_limit_rejections_total",
    "kube_proxy_rs_userspace_unserved_total",
    // The relay's unit tests take the port first (kp-userspace `tests/localhost.rs`).
    "kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total",
];

fn documented_metrics() -> Vec<Documented> {
    table_after(METRICS_DOC, "| metric |")
        .into_iter()
        .map(|row| Documented {
            name: code_spans(&row[0])
                .first()
                .expect("a metric name")
                .to_string(),
            kind: row[1].clone(),
            labelled: !row[2].is_empty(),
            when: row[3].replace('`', ""),
        })
        .collect()
}

/// The families an exposition holds, by the name one queries (a counter's samples end in
/// `_total`), with their types.
fn served_families(exposition: &str) -> BTreeMap<String, String> {
    exposition
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .map(|(name, kind)| {
            let name = if kind == "counter" && !name.ends_with("_total") {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            (name, kind.to_owned())
        })
        .collect()
}

/// One kind of run: its flags, and which "when" values of the reference it serves.
struct Run {
    what: &'static str,
    args: Vec<String>,
    serves: &'static [&'static str],
}

/// A Node named node-1 with an address, as the fake API server takes it on standard input.
const NODE_COMMAND: &str = r#"{"apply": {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}, "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}}}"#;

/// The fake API server (`kp-echo apiserver`) inside `ns`, holding this node's Node; runs
/// until the returned child is killed.
fn api_server(ns: &Namespace, listen: &str) -> std::process::Child {
    let echo = kp_testbed::echo_binary().expect("kp-echo (cargo build -p kp-testbed)");
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .arg(echo)
        .args(["apiserver", "--listen", listen])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the fake API server");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut first = String::new();
    BufReader::new(stdout)
        .read_line(&mut first)
        .expect("read its first line");
    assert!(first.starts_with("listening"), "fake API server: {first:?}");
    let stdin = child.stdin.as_mut().expect("piped stdin");
    writeln!(stdin, "{NODE_COMMAND}").expect("send the Node");
    child
}

/// `GET path` from inside `ns` (perl's sockets: the proxy's listeners are in there).
fn get(ns: &Namespace, port: u16, path: &str) -> String {
    const GET: &str = r#"my $s = IO::Socket::INET->new("127.0.0.1:$ARGV[0]") or die "connect: $!\n"; print $s "GET $ARGV[1] HTTP/1.0\r\n\r\n"; local $/; print <$s>;"#;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match ns.exec(&[
            "perl",
            "-MIO::Socket::INET",
            "-e",
            GET,
            &port.to_string(),
            path,
        ]) {
            Ok(response) if response.starts_with("HTTP/1.") => return response,
            other if Instant::now() > deadline => {
                panic!("GET /metrics in {}: {other:?}", ns.name())
            }
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn start(ns: &Namespace, args: &[String]) -> ProxyProcess {
    let mut proxy = ProxyLaunch::new(ns.name(), binary())
        .args(args)
        .echo(format!("{}: ", ns.name()))
        .spawn()
        .expect("start kube-proxy");
    proxy
        .wait_first_sync(FIRST_SYNC)
        .expect("the proxy syncs once");
    proxy
}

#[test]
fn the_metrics_reference_is_what_metrics_serves() {
    const METRICS_PORT: u16 = 10249;
    const HEALTHZ_PORT: u16 = 10256;
    const API: &str = "127.0.0.1:18080";
    let documented = documented_metrics();
    let common = |mode: &str| {
        vec![
            "--hostname-override=node-1".to_owned(),
            format!("--proxy-mode={mode}"),
            format!("--metrics-bind-address=127.0.0.1:{METRICS_PORT}"),
            format!("--healthz-bind-address=127.0.0.1:{HEALTHZ_PORT}"),
            "--conntrack-max-per-core=0".to_owned(),
        ]
    };
    let manifests = |mode: &str, dir: &str| {
        let mut args = common(mode);
        args.push(format!("--manifests={}", repo().join(dir).display()));
        args
    };
    let mut from_api = common("fake");
    from_api.push(format!("--master=http://{API}"));
    // The hostile corpus holds invalid objects, so the fake run counts some.
    let hostile = "crates/input/kp-sources/tests/data/hostile";
    let runs = [
        Run {
            what: "fake mode from manifests",
            args: manifests("fake", hostile),
            serves: &["always", "--manifests"],
        },
        Run {
            what: "fake mode from an API server",
            args: from_api,
            serves: &["always", "API server"],
        },
        Run {
            what: "iptables mode",
            args: manifests("iptables", "examples/cluster"),
            serves: &["--manifests", "iptables mode"],
        },
        Run {
            what: "nftables mode",
            args: manifests("nftables", "examples/cluster"),
            serves: &["--manifests", "nftables mode"],
        },
        Run {
            what: "nftables mode with localhost NodePorts",
            args: {
                let mut args = manifests("nftables", "examples/cluster");
                args.push("--nodeport-addresses=primary,localhost".to_owned());
                args.push("--feature-gates=KubeProxyNFTablesLocalhostNodePorts=true".to_owned());
                args
            },
            serves: &[
                "--manifests",
                "nftables mode",
                "nftables mode, localhost NodePorts",
            ],
        },
        Run {
            what: "nftables mode with --socket-lb",
            args: {
                let mut args = manifests("nftables", "examples/cluster");
                // Never the cgroup root (other tests' sockets): /proc cannot be attached
                // to, and the metrics are served all the same.
                args.push("--socket-lb".to_owned());
                args.push("--socket-lb-cgroup=/proc".to_owned());
                args
            },
            serves: &["--manifests", "nftables mode", "nftables mode, --socket-lb"],
        },
        Run {
            what: "userspace mode",
            args: manifests("userspace", "examples/cluster"),
            serves: &["--manifests", "userspace mode"],
        },
    ];
    let mut never_served: BTreeSet<&str> = documented.iter().map(|d| d.name.as_str()).collect();
    for run in runs {
        let ns = Namespace::create("kpdocs-", "node").expect("a network namespace (needs root)");
        let mut api = run
            .args
            .iter()
            .any(|a| a.starts_with("--master"))
            .then(|| api_server(&ns, API));
        let mut proxy = start(&ns, &run.args);
        // As a kubelet's probes would, so the health counters have a sample.
        get(&ns, HEALTHZ_PORT, "/healthz");
        get(&ns, HEALTHZ_PORT, "/livez");
        let served = served_families(&get(&ns, METRICS_PORT, "/metrics"));
        let _ = proxy.terminate(Duration::from_secs(5));
        if let Some(api) = api.as_mut() {
            let _ = api.kill();
            let _ = api.wait();
        }
        let expected: Vec<&Documented> = documented
            .iter()
            .filter(|d| d.when == "always" || run.serves.contains(&d.when.as_str()))
            .collect();
        for (name, kind) in &served {
            let row = expected.iter().find(|d| &d.name == name);
            assert_eq!(
                row.map(|d| d.kind.as_str()),
                Some(kind.as_str()),
                "{}: /metrics serves {name} ({kind}); docs/metrics.md has {row:?}",
                run.what
            );
            never_served.remove(name.as_str());
        }
        for row in expected.iter().filter(|d| !d.labelled) {
            assert!(
                served.contains_key(&row.name),
                "{}: {} is documented but not served",
                run.what,
                row.name
            );
        }
    }
    for name in NOT_CAUSED_HERE {
        let row = documented.iter().find(|d| d.name == name);
        assert!(row.is_some_and(|d| d.labelled), "{name}: {row:?}");
        never_served.remove(name);
    }
    assert!(
        never_served.is_empty(),
        "documented but never served: {never_served:?}"
    );
}
