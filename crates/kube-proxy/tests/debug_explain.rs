//! `--debug-explain` end to end: the real binary (fake mode, the example manifests) serves
//! `/debug/explain` on its metrics listener only when asked to, with the same answer as the
//! `explain` subcommand.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KUBE_PROXY: &str = env!("CARGO_BIN_EXE_kube-proxy");
const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/cluster");

/// Bound on waiting for the proxy to start serving and sync (it takes well under a second).
const PATIENCE: Duration = Duration::from_secs(30);

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind :0");
    listener.local_addr().expect("local address").port()
}

/// Kills the proxy when the test ends, however it ends.
struct Proxy(Child);

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(extra: &[&str]) -> (Proxy, u16) {
    let metrics = free_port();
    let child = Command::new(KUBE_PROXY)
        .args([
            &format!("--manifests={EXAMPLES}"),
            "--hostname-override=node-1",
            "--proxy-mode=fake",
            "--cluster-cidr=10.244.0.0/16",
            &format!("--metrics-bind-address=127.0.0.1:{metrics}"),
            &format!("--healthz-bind-address=127.0.0.1:{}", free_port()),
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kube-proxy");
    (Proxy(child), metrics)
}

/// `GET path` → (status, body); `None` while nothing listens yet.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(PATIENCE)).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// Polls `path` until `done` accepts the answer.
fn poll(port: u16, path: &str, done: impl Fn(u16) -> bool) -> (u16, String) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(answer) = get(port, path)
            && done(answer.0)
        {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "no answer on {path} within {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn off_unless_enabled() {
    let (_proxy, port) = start(&[]);
    poll(port, "/healthz", |s| s == 200);
    let (status, _) = poll(port, "/debug/explain?dest=10.96.0.10:80", |_| true);
    assert_eq!(status, 404);
}

#[test]
fn answers_like_the_explain_subcommand() {
    let (_proxy, port) = start(&["--debug-explain"]);
    // 503 until the first sync, then the answer.
    let path = "/debug/explain?dest=198.51.100.20:443&from=203.0.113.200";
    let (status, served) = poll(port, path, |s| s != 503);
    assert_eq!(status, 200, "{served}");
    let subcommand = Command::new(KUBE_PROXY)
        .args([
            "explain",
            "198.51.100.20:443",
            "--from",
            "203.0.113.200",
            &format!("--manifests={EXAMPLES}"),
            "--hostname-override=node-1",
            "--cluster-cidr=10.244.0.0/16",
            "--proxy-mode=fake",
        ])
        .output()
        .expect("run kube-proxy explain");
    assert!(subcommand.status.success());
    assert_eq!(served, String::from_utf8_lossy(&subcommand.stdout));
    assert!(
        served.contains("shop/shop:https: LoadBalancer IP"),
        "{served}"
    );

    let (status, json) = poll(
        port,
        "/debug/explain?dest=10.96.0.10:80&format=json",
        |_| true,
    );
    assert_eq!(status, 200);
    let value: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(
        value["matches"][0]["service_port"], "default/web:http",
        "{json}"
    );

    let (status, message) = poll(
        port,
        "/debug/explain?dest=10.96.0.10:80&from=fd00::1",
        |_| true,
    );
    assert_eq!(status, 400, "{message}");
    assert!(message.contains("different IP families"), "{message}");
}
