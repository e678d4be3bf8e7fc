//! The binary end to end: `kube-proxy --manifests DIR --proxy-mode fake` starts, serves its
//! health and metrics endpoints, reflects edits to the files, rejects bad configuration without
//! starting, and exits cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long to wait for something the proxy should do within a second or two.
const PATIENCE: Duration = Duration::from_secs(30);

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_kube-proxy")
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/cluster")
}

/// A free loopback port: bind :0, read the port, release it.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    l.local_addr().expect("local addr").port()
}

/// A running proxy whose stderr lines arrive on a channel; killed on drop.
struct Proxy {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    healthz: SocketAddr,
    metrics: SocketAddr,
}

impl Proxy {
    fn start(manifests: &Path, extra: &[&str]) -> Proxy {
        let healthz: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let metrics: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let mut child = Command::new(binary())
            .arg(format!("--manifests={}", manifests.display()))
            .arg("--hostname-override=node-1")
            .arg("--proxy-mode=fake")
            .arg(format!("--healthz-bind-address={healthz}"))
            .arg(format!("--metrics-bind-address={metrics}"))
            .arg("--iptables-min-sync-period=0s")
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kube-proxy");
        let stderr = child.stderr.take().expect("stderr piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("proxy: {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proxy {
            child,
            lines,
            seen: Vec::new(),
            healthz,
            metrics,
        }
    }

    /// Wait for a log line containing every needle; panics with the log so far on timeout.
    fn wait_for(&mut self, needles: &[&str]) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if needles.iter().all(|n| line.contains(n)) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no log line with {needles:?}; log so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        wait_exit(&mut self)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Connect, retrying while the server is not yet listening: the log line a test waits for
/// (a sync) can come before the metrics server binds.
fn connect(addr: SocketAddr) -> TcpStream {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => return stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("connect {addr}: {e}"),
        }
    }
}

/// A plain HTTP/1.1 GET; returns (status, body).
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = connect(addr);
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read response");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn copy_examples(dir: &Path) {
    for entry in std::fs::read_dir(examples()).expect("examples dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            std::fs::copy(&path, dir.join(path.file_name().expect("file name"))).expect("copy");
        }
    }
}

#[test]
fn serves_health_and_metrics_and_reflects_edits() {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_examples(dir.path());
    let mut proxy = Proxy::start(dir.path(), &["-v=2"]);

    // The example has 4 service ports: web:http, kube-dns:dns, kube-dns:dns-tcp, shop:https.
    proxy.wait_for(&["Dry-run sync", "service_ports=\"4\""]);

    let (code, body) = get(proxy.healthz, "/healthz");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("\"healthy\":true") || body.contains("\"healthy\": true"),
        "{body}"
    );
    let (code, _) = get(proxy.healthz, "/livez");
    assert_eq!(code, 200);
    let (code, body) = get(proxy.metrics, "/metrics");
    assert_eq!(code, 200);
    assert!(
        body.contains("kubeproxy_sync_proxy_rules_duration_seconds"),
        "{body}"
    );
    let (code, body) = get(proxy.metrics, "/proxyMode");
    assert_eq!((code, body.trim()), (200, "fake"));
    // The z-pages, as text (no Accept header): this binary and the flags it was given.
    let (code, body) = get(proxy.metrics, "/statusz");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("kube-proxy statusz") && body.contains("Emulation version: 1.36"),
        "{body}"
    );
    let (code, body) = get(proxy.metrics, "/flagz");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("\nproxy-mode=fake\n") && body.contains("\nv=2\n"),
        "{body}"
    );

    // A new service written in place is picked up.
    std::fs::write(
        dir.path().join("extra.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: extra, namespace: default}\n\
         spec:\n  clusterIP: 10.96.0.99\n  ports: [{port: 9000}]\n",
    )
    .expect("write extra.yaml");
    proxy.wait_for(&["Dry-run sync", "service_ports=\"5\"", "default/extra"]);

    // A broken document is reported with its file, and nothing else is lost.
    std::fs::write(
        dir.path().join("broken.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: [oops\n",
    )
    .expect("write broken.yaml");
    proxy.wait_for(&["broken.yaml"]);

    // Removing a file removes its service.
    std::fs::remove_file(dir.path().join("extra.yaml")).expect("remove extra.yaml");
    proxy.wait_for(&["Dry-run sync", "service_ports=\"4\""]);

    let status = proxy.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

#[test]
fn every_invalid_flag_is_reported_and_nothing_starts() {
    let output = Command::new(binary())
        .args([
            "--proxy-mode=fake",
            "--iptables-masquerade-bit=40",
            "--oom-score-adj=5000",
            "--healthz-bind-address=not-an-address",
        ])
        .output()
        .expect("run kube-proxy");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    for name in ["masquerade", "oom", "healthz"] {
        assert!(
            stderr.to_lowercase().contains(name),
            "{name} missing from:\n{stderr}"
        );
    }
    // Each error once (the error chain once printed the whole list a second time).
    for flag in [
        "--iptables-masquerade-bit: invalid value",
        "--oom-score-adj: invalid value",
        "--healthz-bind-address: invalid value",
    ] {
        assert_eq!(stderr.matches(flag).count(), 1, "{flag} in:\n{stderr}");
    }
}

/// What a start that fails prints on stderr; it must fail.
fn failed_start(args: &[String]) -> String {
    let output = Command::new(binary())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run kube-proxy");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!output.status.success(), "{args:?} started:\n{stderr}");
    stderr
}

#[test]
fn a_failed_start_prints_each_cause_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing");
    let no_such = "No such file or directory";
    // Before logging is set up (stderr directly), after it (the log line), and through
    // kube-rs' errors, which quote their causes themselves.
    let starts = [
        (
            vec![format!("--config={}", missing.display())],
            "cannot read config file",
        ),
        (
            vec![
                "--proxy-mode=fake".to_owned(),
                format!("--write-config-to={}", missing.join("out.yaml").display()),
            ],
            "cannot write config file",
        ),
        (
            vec![
                "--proxy-mode=fake".to_owned(),
                format!("--kubeconfig={}", missing.display()),
                "--healthz-bind-address=".to_owned(),
                "--metrics-bind-address=".to_owned(),
            ],
            "kubeconfig",
        ),
    ];
    for (args, what) in starts {
        let stderr = failed_start(&args);
        assert!(stderr.contains(what), "{args:?}:\n{stderr}");
        assert_eq!(stderr.matches(no_such).count(), 1, "{args:?}:\n{stderr}");
    }
}

#[test]
fn an_unbuilt_mode_exits_with_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let output = Command::new(binary())
        .arg(format!("--manifests={}", dir.path().display()))
        .args([
            "--proxy-mode=kernelspace",
            "--healthz-bind-address=",
            "--metrics-bind-address=",
        ])
        .output()
        .expect("run kube-proxy");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("kernelspace") && stderr.contains("not available"),
        "{stderr}"
    );
}

#[test]
fn write_config_to_writes_a_loadable_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.yaml");
    let status = Command::new(binary())
        .arg(format!("--write-config-to={}", path.display()))
        .arg("--proxy-mode=fake")
        .status()
        .expect("run kube-proxy");
    assert!(status.success());
    let text = std::fs::read_to_string(&path).expect("config written");
    assert!(text.contains("kind: KubeProxyConfiguration"), "{text}");
    // The written file is accepted back (and still names the fake mode).
    let output = Command::new(binary())
        .arg(format!("--config={}", path.display()))
        .arg(format!(
            "--write-config-to={}",
            dir.path().join("again.yaml").display()
        ))
        .output()
        .expect("run kube-proxy");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let again =
        std::fs::read_to_string(dir.path().join("again.yaml")).expect("config written again");
    assert_eq!(text, again);
}

#[test]
fn winuserspace_is_refused_on_linux_with_a_pointer_to_userspace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let output = Command::new(binary())
        .arg(format!("--manifests={}", dir.path().display()))
        .args([
            "--proxy-mode=winuserspace",
            "--healthz-bind-address=",
            "--metrics-bind-address=",
        ])
        .output()
        .expect("run kube-proxy");
    assert!(
        !output.status.success(),
        "winuserspace must not start on Linux"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("winuserspace") && stderr.contains("--proxy-mode=userspace"),
        "{stderr}"
    );
}

#[test]
fn bind_address_hard_fail_stops_on_a_taken_port() {
    // The port stays taken for the whole test.
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let port = taken.local_addr().expect("local addr").port();
    let mut child = Command::new(binary())
        .arg(format!("--manifests={}", examples().display()))
        .args([
            "--hostname-override=node-1",
            "--proxy-mode=fake",
            "--healthz-bind-address=",
            &format!("--metrics-bind-address=127.0.0.1:{port}"),
            "--bind-address-hard-fail",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kube-proxy");
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let _ = child.wait();
    let status = status.unwrap_or_else(|| panic!("still running with the port taken:\n{stderr}"));
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "cannot bind the metrics server to 127.0.0.1:{port}"
        )),
        "{stderr}"
    );
    drop(taken);
}

/// The hostile manifests corpus (kp-sources/tests/data/hostile): the real binary logs every
/// rejected object by name and every broken document by file and line, counts each in its
/// metric, and programs the valid objects next to them. The expectations come from reading
/// the corpus with the same library calls, so the test follows the corpus as it grows.
#[test]
fn hostile_corpus_is_logged_and_counted() {
    use kp_core::event::{ObjectEvent, SourceEvent};
    use kp_core::tracker::{ChangeTracker, ProxyState};

    let corpus =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../input/kp-sources/tests/data/hostile");
    let mut broken = Vec::new();
    let mut tracker = ChangeTracker::new("node-1");
    for entry in std::fs::read_dir(&corpus).expect("corpus") {
        let path = entry.expect("entry").path();
        if !path.extension().is_some_and(|e| e == "yaml" || e == "json") {
            continue;
        }
        let file = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let Ok(text) = std::fs::read_to_string(&path) else {
            broken.push((file, None));
            continue;
        };
        let (objects, errors) = kp_sources::manifests::parse_manifests(&text, &path);
        broken.extend(errors.iter().map(|e| (file.clone(), e.line)));
        for object in objects {
            tracker.record(object.applied());
        }
    }
    tracker.record(SourceEvent::Service(ObjectEvent::Synced));
    tracker.record(SourceEvent::EndpointSlice(ObjectEvent::Synced));
    let mut state = ProxyState::default();
    let invalid = tracker.apply(&mut state).invalid;
    assert!(!invalid.is_empty() && !broken.is_empty());

    let mut proxy = Proxy::start(&corpus, &[]);
    proxy.wait_for(&[kp_core::proxier::FIRST_SYNC_LOG]);
    let log = proxy.seen.join("\n");
    for error in &invalid {
        // Names in the corpus's rejected objects are plain, so they show as they are.
        let name = format!("{} {}/{}", error.kind, error.namespace, error.name);
        let named = proxy
            .seen
            .iter()
            .any(|line| line.contains("skipping invalid object") && line.contains(&name));
        assert!(named, "no log line names {name}:\n{log}");
    }
    for (file, line) in &broken {
        let place = match line {
            Some(line) => format!("{file}:{line}"),
            None => file.clone(),
        };
        assert!(
            proxy.seen.iter().any(|l| l.contains(&place)),
            "no log line for the broken document at {place}:\n{log}"
        );
    }
    let (code, metrics) = get(proxy.metrics, "/metrics");
    assert_eq!(code, 200);
    let sum = |metric: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(metric))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(
        sum("kube_proxy_rs_invalid_objects_total"),
        invalid.len() as f64,
        "{metrics}"
    );
    assert_eq!(
        sum("kube_proxy_rs_manifest_errors_total"),
        broken.len() as f64,
        "{metrics}"
    );
    // The valid service ports, hostile names and all, are programmed.
    let ports = format!("service_ports={:?}", state.services.len().to_string());
    assert!(log.contains(&ports), "expected {ports}:\n{log}");
    let status = proxy.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

/// Waits (bounded) for the proxy to exit by itself and returns its status.
fn wait_exit(proxy: &mut Proxy) -> std::process::ExitStatus {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(Some(status)) = proxy.child.try_wait() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "kube-proxy did not exit; log so far:\n{}",
            proxy.seen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A Node named node-1 with these `status.addresses` (type, address).
fn node_yaml(addresses: &[(&str, &str)]) -> String {
    let list: String = addresses
        .iter()
        .map(|(kind, address)| format!("    - type: {kind}\n      address: \"{address}\"\n"))
        .collect();
    format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: node-1\nstatus:\n  addresses:\n{list}")
}

#[test]
fn node_ips_are_read_at_start_and_a_change_restarts_the_proxy() {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_examples(dir.path());
    let node = dir.path().join("node.yaml");
    // ExternalIP listed first, a second InternalIP: upstream takes the first InternalIP and
    // the first address of the other family.
    std::fs::write(
        &node,
        node_yaml(&[
            ("ExternalIP", "203.0.113.7"),
            ("InternalIP", "192.168.9.10"),
            ("InternalIP", "192.168.9.11"),
            ("InternalIP", "fd00:9::10"),
            ("Hostname", "node-1"),
        ]),
    )
    .expect("write node.yaml");
    let mut proxy = Proxy::start(dir.path(), &[]);
    proxy.wait_for(&["Successfully retrieved NodeIPs", "192.168.9.10,fd00:9::10"]);
    proxy.wait_for(&["Dry-run sync"]);

    // Labels and further addresses do not change the node IPs: the proxy keeps running.
    std::fs::write(
        &node,
        node_yaml(&[
            ("InternalIP", "192.168.9.10"),
            ("InternalIP", "fd00:9::10"),
            ("InternalIP", "192.168.9.12"),
        ]),
    )
    .expect("rewrite node.yaml");
    proxy.wait_for(&["Dry-run sync"]);
    assert!(
        matches!(proxy.child.try_wait(), Ok(None)),
        "still running after an edit that keeps the node IPs:\n{}",
        proxy.seen.join("\n")
    );
    // Then the node IP changes: upstream's node manager exits with status 1.
    std::fs::write(
        &node,
        node_yaml(&[("InternalIP", "192.168.9.20"), ("InternalIP", "fd00:9::10")]),
    )
    .expect("rewrite node.yaml");
    let line = proxy.wait_for(&["NodeIPs changed for the node"]);
    assert!(
        line.contains("192.168.9.20") && line.contains("192.168.9.10"),
        "{line}"
    );
    let status = wait_exit(&mut proxy);
    assert_eq!(status.code(), Some(1), "exit status {status}");
}

#[test]
fn without_a_node_the_proxy_falls_back_as_upstream() {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_examples(dir.path());
    std::fs::remove_file(dir.path().join("node.yaml")).expect("remove node.yaml");
    let mut proxy = Proxy::start(dir.path(), &[]);
    proxy.wait_for(&["Timed out waiting for node to exist"]);
    proxy.wait_for(&["Can't determine this node's IP, assuming loopback"]);
    proxy.wait_for(&["Dry-run sync"]);
    let status = proxy.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status}");

    // A specific bindAddress is the node IP then: no loopback notice.
    let mut proxy = Proxy::start(dir.path(), &["--bind-address=192.168.9.30"]);
    proxy.wait_for(&["Timed out waiting for node to exist"]);
    proxy.wait_for(&["Dry-run sync"]);
    assert!(
        !proxy.seen.iter().any(|l| l.contains("assuming loopback")),
        "{}",
        proxy.seen.join("\n")
    );
    let status = proxy.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status}");
}

/// `GET /metrics` asking for the delimited MetricFamily protobuf: the raw response.
fn get_protobuf(addr: SocketAddr) -> Vec<u8> {
    let mut stream = connect(addr);
    stream.set_read_timeout(Some(PATIENCE)).expect("timeout");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: application/vnd.google.protobuf;\
         proto=io.prometheus.client.MetricFamily;encoding=delimited\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).expect("read response");
    response
}

/// `NativeHistograms` (KEP-5808) through the binary: a protobuf scrape carries the native
/// fields (here the zero threshold, 2^-128, as field 6) only with the gate on; the sync
/// histograms are there either way.
#[test]
fn native_histograms_follow_the_gate() {
    const THRESHOLD: [u8; 9] = [0x31, 0, 0, 0, 0, 0, 0, 0xf0, 0x37];
    for gate in [true, false] {
        let dir = tempfile::tempdir().expect("tempdir");
        copy_examples(dir.path());
        let flag = format!("--feature-gates=NativeHistograms={gate}");
        let mut proxy = Proxy::start(dir.path(), &["-v=2", &flag]);
        proxy.wait_for(&["Dry-run sync"]);
        let response = get_protobuf(proxy.metrics);
        let has = |needle: &[u8]| response.windows(needle.len()).any(|w| w == needle);
        assert!(
            has(b"content-type: application/vnd.google.protobuf")
                || has(b"Content-Type: application/vnd.google.protobuf"),
            "gate {gate}"
        );
        assert!(
            has(b"kubeproxy_sync_proxy_rules_duration_seconds"),
            "gate {gate}"
        );
        assert_eq!(has(&THRESHOLD), gate, "gate {gate}");
    }
}
